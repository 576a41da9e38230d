//! `gpu-stack crdgen` as a process: the default output is the committed
//! ClusterPolicy CRD, `--kind nvidiadriver` the committed NVIDIADriver CRD,
//! `--kind all` both, and the Helm chart ships the same files.
use std::path::{Path, PathBuf};
use std::process::Command;

fn crdgen(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-stack"))
        .arg("crdgen")
        .args(args)
        .output()
        .expect("gpu-stack runs");
    assert!(
        out.status.success(),
        "crdgen {args:?} failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn committed(name: &str) -> String {
    let path = deploy().join("crds").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn default_output_is_the_clusterpolicy_crd() {
    let cp = committed("nvidia.com_clusterpolicies.yaml");
    assert_eq!(crdgen(&[]), cp);
    assert_eq!(crdgen(&["--kind", "clusterpolicy"]), cp);
}

#[test]
fn nvidiadriver_and_all() {
    let nvd = committed("nvidia.com_nvidiadrivers.yaml");
    assert_eq!(crdgen(&["--kind", "nvidiadriver"]), nvd);
    let mig = committed("gpustack.io_migconfigs.yaml");
    assert_eq!(crdgen(&["--kind", "migconfig"]), mig);
    let cp = committed("nvidia.com_clusterpolicies.yaml");
    assert_eq!(
        crdgen(&["--kind", "all"]),
        format!("{cp}---\n{nvd}---\n{mig}")
    );
}

#[test]
fn the_chart_ships_every_committed_crd() {
    for name in [
        "nvidia.com_clusterpolicies.yaml",
        "nvidia.com_nvidiadrivers.yaml",
        "gpustack.io_migconfigs.yaml",
    ] {
        let chart = deploy().join("helm/gpu-stack/crds").join(name);
        let copy =
            std::fs::read_to_string(&chart).unwrap_or_else(|e| panic!("{}: {e}", chart.display()));
        assert!(
            copy == committed(name),
            "{} differs from deploy/crds/{name}",
            chart.display()
        );
    }
}

#[test]
fn an_unknown_kind_is_refused_with_the_choices() {
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-stack"))
        .args(["crdgen", "--kind", "gpucluster"])
        .output()
        .expect("gpu-stack runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nvidiadriver"), "{err}");
}
