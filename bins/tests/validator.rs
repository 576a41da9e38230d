//! `gpu-stack validator` as a process on simulated GPUs: a valid driver writes
//! `driver-ready` with the expected env file; a node without GPUs exits 1,
//! writes nothing and removes a stale file; `--wait-only` times out naming the
//! missing file, and returns once the file appears.
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

const FLEET: &str = r#"
nodes:
  - name: gpu-node
    gpus:
      - model: H100-SXM5-80GB
        count: 2
  - name: cpu-node
    gpus: []
"#;

fn fleet(dir: &Path) -> PathBuf {
    let path = dir.join("fleet.yaml");
    std::fs::write(&path, FLEET).unwrap();
    path
}

fn validator(dir: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpu-stack"));
    c.arg("validator")
        .args(["--backend", "simulated", "--fleet"])
        .arg(fleet(dir))
        .arg("--validations-dir")
        .arg(dir.join("validations"))
        .args(["--poll-interval-ms", "20"])
        .args(args)
        .env_remove("NODE_NAME")
        .env_remove("COMPONENT")
        .env_remove("WITH_WAIT")
        .env_remove("NVIDIA_DRIVER_ROOT")
        .env_remove("GPU_STACK_BACKEND");
    c
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn valid_driver_writes_the_env_file() {
    let dir = tempfile::tempdir().unwrap();
    let out = validator(dir.path(), &["--node", "gpu-node"])
        .env("COMPONENT", "driver")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let content = std::fs::read_to_string(dir.path().join("validations/driver-ready")).unwrap();
    assert!(
        content.starts_with(
            "IS_HOST_DRIVER=true\nNVIDIA_DRIVER_ROOT=/\nDRIVER_ROOT_CTR_PATH=/host\nNVIDIA_DEV_ROOT=/\nDEV_ROOT_CTR_PATH=/host\nDRIVER_VERSION="
        ),
        "{content}"
    );
    assert!(content.ends_with("GPU_COUNT=2\n"), "{content}");
}

#[test]
fn cuda_check_uses_the_required_version() {
    let dir = tempfile::tempdir().unwrap();
    let ok = validator(dir.path(), &["--node", "gpu-node", "--component", "cuda"])
        .output()
        .unwrap();
    assert!(ok.status.success(), "{}", text(&ok));
    assert!(dir.path().join("validations/cuda-ready").exists());
    let too_new = validator(
        dir.path(),
        &[
            "--node",
            "gpu-node",
            "--component",
            "cuda",
            "--cuda-version",
            "99.0",
        ],
    )
    .output()
    .unwrap();
    assert_eq!(too_new.status.code(), Some(1), "{}", text(&too_new));
    assert!(String::from_utf8_lossy(&too_new.stderr).contains("older than the required 99.0"));
    assert!(!dir.path().join("validations/cuda-ready").exists());
}

#[test]
fn node_without_gpus_fails_writes_nothing_and_removes_stale_file() {
    let dir = tempfile::tempdir().unwrap();
    let validations = dir.path().join("validations");
    std::fs::create_dir(&validations).unwrap();
    std::fs::write(validations.join("driver-ready"), "stale\n").unwrap();
    let out = validator(dir.path(), &["--node", "cpu-node", "--component", "driver"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("lists no GPU"), "{stderr}");
    assert_eq!(std::fs::read_dir(&validations).unwrap().count(), 0);
}

#[test]
fn unknown_component_is_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let out = validator(dir.path(), &["--component", "mofed"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown validator component"));
    assert!(!dir.path().join("validations").exists());
}

#[test]
fn wait_only_times_out_naming_the_missing_file() {
    let dir = tempfile::tempdir().unwrap();
    let out = validator(
        dir.path(),
        &["--component", "toolkit", "--wait-only", "--timeout", "0"],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("timed out") && stderr.contains("toolkit-ready"),
        "{stderr}"
    );
}

#[test]
fn wait_only_sees_the_file_appear() {
    let dir = tempfile::tempdir().unwrap();
    let validations = dir.path().join("validations");
    std::fs::create_dir(&validations).unwrap();
    let child = validator(
        dir.path(),
        &["--component", "toolkit", "--wait-only", "--timeout", "60"],
    )
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    std::fs::write(validations.join("toolkit-ready"), "TOOLKIT_EVIDENCE=x\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("ready: toolkit-ready"));
}

#[test]
fn waiting_check_passes_when_the_toolkit_appears() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("toolkit");
    let child = validator(dir.path(), &["--component", "toolkit", "--timeout", "60"])
        .arg("--toolkit-evidence")
        .arg(&marker)
        .env("WITH_WAIT", "true")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    std::fs::create_dir(&marker).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let content = std::fs::read_to_string(dir.path().join("validations/toolkit-ready")).unwrap();
    assert_eq!(content, format!("TOOLKIT_EVIDENCE={}\n", marker.display()));
}
