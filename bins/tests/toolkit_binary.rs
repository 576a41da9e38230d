//! `gpu-stack toolkit` as a process on a fake host root: bad input (a
//! version-1 containerd config, a k3s node, an unknown restart mode, a
//! runtime that is not there) exits non-zero with a message naming what and
//! where, and leaves every file as it was. The runtime itself is exercised on
//! the real node (tests/tests/real_node_e2e.rs).
use std::path::Path;
use std::process::{Command, Output};

const FLEET: &str =
    "nodes:\n  - name: gpu-node\n    gpus:\n      - model: H100-SXM5-80GB\n        count: 1\n";

fn toolkit(root: &Path, args: &[&str]) -> Output {
    std::fs::write(root.join("fleet.yaml"), FLEET).unwrap();
    Command::new(env!("CARGO_BIN_EXE_gpu-stack"))
        .arg("toolkit")
        .arg("--host-root")
        .arg(root)
        .args(["--backend", "simulated", "--node", "gpu-node", "--fleet"])
        .arg(root.join("fleet.yaml"))
        .args(args)
        .env_remove("CONTAINERD_CONFIG")
        .env_remove("CONTAINERD_SOCKET")
        .env_remove("RUNTIME")
        .env_remove("POD_NAME")
        .output()
        .unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn host_with_config(text: &str) -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(root.path().join("etc/containerd")).unwrap();
    std::fs::write(root.path().join("etc/containerd/config.toml"), text).unwrap();
    root
}

fn untouched(root: &Path, text: &str) {
    assert_eq!(
        std::fs::read_to_string(root.join("etc/containerd/config.toml")).unwrap(),
        text
    );
    assert!(
        !root.join("etc/containerd/conf.d").exists(),
        "no drop-in written"
    );
}

#[test]
fn a_version_1_config_is_refused_naming_the_file() {
    let v1 = "[plugins.cri]\n  sandbox_image = \"pause\"\n";
    let root = host_with_config(v1);
    let out = toolkit(root.path(), &["--once", "--no-cdi-spec"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("/etc/containerd/config.toml") && err.contains("version"),
        "{err}"
    );
    untouched(root.path(), v1);
    // --dry-run says the same and changes nothing either.
    let out = toolkit(root.path(), &["--dry-run"]);
    assert!(!out.status.success(), "{}", stderr(&out));
    untouched(root.path(), v1);
}

#[test]
fn a_k3s_node_is_refused_naming_its_generated_config() {
    let plain = "version = 2\n";
    let root = host_with_config(plain);
    let k3s = root.path().join("var/lib/rancher/k3s/agent/etc/containerd");
    std::fs::create_dir_all(&k3s).unwrap();
    std::fs::write(k3s.join("config.toml"), plain).unwrap();
    let out = toolkit(root.path(), &["--once", "--no-cdi-spec"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("/var/lib/rancher/k3s/agent/etc/containerd/config.toml"),
        "{err}"
    );
    untouched(root.path(), plain);
}

#[test]
fn a_missing_runtime_names_its_socket_and_the_variable_to_set() {
    let plain = "version = 2\n";
    let root = host_with_config(plain);
    let out = toolkit(root.path(), &["--once", "--no-cdi-spec"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("/run/containerd/containerd.sock") && err.contains("CONTAINERD_SOCKET"),
        "{err}"
    );
    untouched(root.path(), plain);
}

#[test]
fn an_unknown_restart_mode_is_refused_before_anything_happens() {
    let plain = "version = 2\n";
    let root = host_with_config(plain);
    for (mode, says) in [
        ("systemd", "not supported"),
        ("reboot", "unknown restart mode"),
    ] {
        let out = toolkit(root.path(), &["--once", "--restart-mode", mode]);
        assert!(!out.status.success());
        let err = stderr(&out);
        assert!(err.contains(says) && err.contains("signal"), "{err}");
    }
    untouched(root.path(), plain);
}

#[test]
fn the_host_cdi_spec_is_written_under_the_host_root() {
    // No runtime here, so configuring fails after the spec is written.
    let root = host_with_config("version = 2\n");
    std::fs::create_dir_all(root.path().join("run")).unwrap();
    std::fs::create_dir_all(root.path().join("var")).unwrap();
    std::os::unix::fs::symlink("/run", root.path().join("var/run")).unwrap();
    let _ = toolkit(root.path(), &["--once"]);
    let spec = std::fs::read_to_string(root.path().join("run/cdi/nvidia-gpu-stack.json"))
        .expect("the spec, through the host's /var/run -> /run link");
    let spec: serde_json::Value = serde_json::from_str(&spec).unwrap();
    assert_eq!(spec["kind"], "nvidia.com/gpu");
    assert!(
        spec["devices"].as_array().is_some_and(|d| d.len() >= 2),
        "{spec}"
    );
}
