//! The commands the operator renders into operand pods of the gpu-stack
//! (validator) image, run as processes: the images are distroless, so each
//! must be a `gpu-stack` subcommand that does its job on its own.
//! - a wait gate (`--wait-only`) waits for its status file with no GPU, no
//!   Kubernetes client and no kubeconfig, and returns once the file appears;
//! - the validator pod's readiness probe checks the chain's files once;
//! - the validator pod's main container (`--hold`) removes the `*-ready`
//!   files on SIGTERM and exits 0;
//! - the node status exporter serves the files as gauges on `/metrics`.
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpu_stack_core::operator::components::Component;
use gpu_stack_k8s::operator::cluster::Object;
use gpu_stack_k8s::operator::clusterpolicy::{ClusterPolicy, ClusterPolicySpec};
use gpu_stack_k8s::operator::desired::render::{self, GPU_STACK_BIN, RenderContext};
use k8s_openapi::api::core::v1::PodSpec;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

fn pod(c: Component) -> PodSpec {
    let spec: ClusterPolicySpec =
        serde_json::from_value(serde_json::json!({"nodeStatusExporter": {"enabled": true}}))
            .unwrap();
    let policy = ClusterPolicy::new("cluster-policy", spec);
    let ctx = RenderContext {
        policy: &policy,
        namespace: "gpu-operator",
    };
    match render::daemonset(&ctx, c, None) {
        Object::DaemonSet(ds) => ds.spec.template.spec.unwrap(),
        other => panic!("not a DaemonSet: {other:?}"),
    }
}

/// The rendered args, pointed at `dir` instead of the host's validations directory.
fn gpu_stack(args: &[String], dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpu-stack"));
    c.args(args)
        .arg("--validations-dir")
        .arg(dir)
        // Nothing from the environment may be needed: no GPU, no cluster.
        .env_clear()
        .env("KUBECONFIG", dir.join("no-such-kubeconfig"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

fn replace(args: &[String], from: &str, to: &str) -> Vec<String> {
    args.iter()
        .map(|a| if a == from { to.to_string() } else { a.clone() })
        .collect()
}

fn wait_exit(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the process did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn wait_gate_waits_for_its_file_without_gpu_or_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let gate = pod(Component::DevicePlugin)
        .init_containers
        .unwrap()
        .remove(0);
    let args = gate.args.unwrap();
    assert!(args.contains(&"never".to_string()), "{args:?}");
    let fast = replace(&args, "5000", "20");
    let mut child = gpu_stack(&fast, dir.path()).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        child.try_wait().unwrap().is_none(),
        "the gate must keep waiting"
    );
    std::fs::write(dir.path().join("toolkit-ready"), "TOOLKIT_EVIDENCE=x\n").unwrap();
    let status = wait_exit(&mut child, Duration::from_secs(30));
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert!(status.success(), "{status:?} {out}");
    assert!(out.contains("ready: toolkit-ready"), "{out}");
}

#[test]
fn validator_readiness_probe_checks_the_chain_once() {
    let dir = tempfile::tempdir().unwrap();
    let main = pod(Component::OperatorValidator).containers.remove(0);
    let probe = main.readiness_probe.unwrap().exec.unwrap().command.unwrap();
    assert_eq!(probe[0], GPU_STACK_BIN);
    let run = || gpu_stack(&probe[1..], dir.path()).output().unwrap();
    assert_eq!(run().status.code(), Some(1), "not ready without the files");
    for f in ["driver-ready", "toolkit-ready", "cuda-ready"] {
        std::fs::write(dir.path().join(f), "x").unwrap();
    }
    let partial = run();
    assert_eq!(partial.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&partial.stderr).contains("plugin-ready"));
    std::fs::write(dir.path().join("plugin-ready"), "x").unwrap();
    let ready = run();
    assert!(ready.status.success(), "{ready:?}");
}

#[test]
fn validator_main_container_removes_the_ready_files_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    for f in [
        "driver-ready",
        "toolkit-ready",
        "cuda-ready",
        "plugin-ready",
        ".driver-ctr-ready",
    ] {
        std::fs::write(dir.path().join(f), "x").unwrap();
    }
    let main = pod(Component::OperatorValidator).containers.remove(0);
    let mut child = gpu_stack(&main.args.unwrap(), dir.path()).spawn().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "all validations are successful");
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        dir.path().join("driver-ready").exists(),
        "kept while running"
    );
    kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).unwrap();
    let status = wait_exit(&mut child, Duration::from_secs(30));
    assert!(status.success(), "{status:?}");
    let left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(
        left,
        [".driver-ctr-ready"],
        "only the driver container's own file stays"
    );
}

#[test]
fn node_status_exporter_serves_the_status_files() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("driver-ready"), "x").unwrap();
    let main = pod(Component::NodeStatusExporter).containers.remove(0);
    let args = main.args.unwrap();
    assert_eq!(args[0], "node-status-exporter");
    let local = replace(&args, "0.0.0.0:8000", "127.0.0.1:0");
    let mut child = gpu_stack(&local, dir.path())
        .env("NODE_NAME", "gpu-7")
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .strip_prefix("serving validation status on http://")
        .and_then(|s| s.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    assert!(
        body.contains("gpu_operator_node_driver_ready{node=\"gpu-7\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("gpu_operator_node_plugin_ready{node=\"gpu-7\"} 0"),
        "{body}"
    );
    kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).unwrap();
    assert!(wait_exit(&mut child, Duration::from_secs(30)).success());
}
