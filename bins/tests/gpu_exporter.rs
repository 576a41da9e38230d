//! `gpu-exporter` as a process: bad input (unknown counters field, unreadable
//! counters file, no usable metric, port in use, bad address) gives a clear
//! message and exit code and starts nothing; good input serves on loopback.

use std::io::{BufRead, BufReader, Read as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

fn fleet() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/fleets/dgx-a100.yaml")
}

fn exporter() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpu-exporter"));
    c.args([
        "--backend",
        "simulated",
        "--no-pod-attribution",
        "--hostname",
        "test-node",
    ])
    .arg("--fleet")
    .arg(fleet())
    .env_remove("DCGM_EXPORTER_LISTEN")
    .env_remove("DCGM_EXPORTER_COLLECTORS")
    .env_remove("DCGM_EXPORTER_INTERVAL")
    .env("RUST_LOG", "info");
    c
}

/// Runs to completion (bounded) and returns (exit code, stderr).
fn run_to_exit(mut cmd: Command) -> (i32, String) {
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    for _ in 0..400 {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return (status.code().unwrap_or(-1), err);
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("gpu-exporter did not exit within 10 s");
}

#[test]
fn unreadable_counters_file_exits_2_and_starts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("sim-state");
    let mut cmd = exporter();
    cmd.args(["--listen", "127.0.0.1:0", "-f", "/nonexistent/counters.csv"])
        .arg("--sim-state")
        .arg(&state);
    let (code, err) = run_to_exit(cmd);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("cannot read the counters file /nonexistent/counters.csv"),
        "{err}"
    );
    assert!(!state.exists(), "the backend must not have been started");
}

#[test]
fn counters_file_without_usable_metrics_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("c.csv");
    std::fs::write(&csv, "DCGM_FI_DEV_NOT_A_FIELD, gauge, nope\n").unwrap();
    let mut cmd = exporter();
    cmd.args(["--listen", "127.0.0.1:0", "-f"]).arg(&csv);
    let (code, err) = run_to_exit(cmd);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("selects no metric"), "{err}");
}

#[test]
fn port_in_use_exits_3_with_a_clear_message_before_starting_anything() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("sim-state");
    let mut cmd = exporter();
    cmd.args(["--listen", &addr.to_string()])
        .arg("--sim-state")
        .arg(&state);
    let (code, err) = run_to_exit(cmd);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(&format!("cannot listen on {addr}")), "{err}");
    assert!(err.contains("--listen"), "{err}");
    assert!(!state.exists(), "the backend must not have been started");
}

#[test]
fn bad_listen_address_exits_2() {
    let mut cmd = exporter();
    cmd.args(["--listen", "9400"]);
    let (code, err) = run_to_exit(cmd);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("invalid listen address `9400`"), "{err}");
}

#[test]
fn unknown_counters_field_is_reported_with_its_line_and_the_rest_is_served() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("c.csv");
    std::fs::write(
        &csv,
        "# custom set\nDCGM_FI_DEV_GPU_TEMP, gauge, GPU temperature (in C).\nDCGM_FI_DEV_FLUX_CAPACITOR, gauge, nope\n",
    )
    .unwrap();
    let mut child = exporter()
        .args(["--listen", "127.0.0.1:0", "-f"])
        .arg(&csv)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    let mut serving = false;
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(20)) {
        serving = line.contains("serving /metrics");
        seen.push(line);
        if serving {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let log = seen.join("\n");
    assert!(
        serving,
        "the exporter should serve despite the unknown field:\n{log}"
    );
    assert!(
        log.contains("line 3: unknown field `DCGM_FI_DEV_FLUX_CAPACITOR`"),
        "{log}"
    );
}
