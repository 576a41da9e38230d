//! `gpu-operator` against an API server older than gpu-stack supports: it
//! stops at start with the version it found and what to do, having made no
//! other request (a loopback server that answers `/version` like Kubernetes
//! 1.33 and records every request path).
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const VERSION_1_33: &str =
    r#"{"major":"1","minor":"33","gitVersion":"v1.33.7","platform":"linux/amd64"}"#;

/// Serves every request with `body` and records the request lines.
fn api_server(body: &'static str) -> (u16, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut request = String::new();
            if reader.read_line(&mut request).is_err() {
                continue;
            }
            record.lock().unwrap().push(request.trim().to_string());
            // The headers, up to the blank line (the client sends no body).
            let mut line = String::new();
            while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
                line.clear();
            }
            let mut stream = stream;
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    (port, seen)
}

#[test]
fn an_api_server_older_than_1_34_is_refused_at_start_with_its_version() {
    let (port, seen) = api_server(VERSION_1_33);
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: http://127.0.0.1:{port}\nusers:\n- name: u\n  user: {{}}\ncontexts:\n- name: x\n  context: {{cluster: c, user: u}}\ncurrent-context: x\n"
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-operator"))
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["--namespace", "gpu-operator", "--listen", "127.0.0.1:0"])
        .arg("--no-leader-election")
        .env_remove("KUBECONFIG")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{stdout}{stderr}");
    let said = format!("{stdout}{stderr}");
    assert!(
        said.contains("Kubernetes 1.33, older than 1.34")
            && said.contains("upgrade the control plane"),
        "{said}"
    );
    // Nothing was listed, watched or written: one question, one answer.
    let paths = seen.lock().unwrap().clone();
    assert!(
        paths.iter().all(|p| p.starts_with("GET /version")),
        "{paths:?}"
    );
}
