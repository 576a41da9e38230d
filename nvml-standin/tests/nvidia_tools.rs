//! NVIDIA's own NVML clients on the stand-in, on examples/fleets/dgx-a100.yaml:
//! gpu-feature-discovery (`--oneshot`) and `nvidia-mig-parted export`, each
//! loading `libnvidia-ml.so.1` from a directory where that name points at the
//! stand-in.
//!
//! The binaries come from `tools/nvidia-oracles/build.sh` (cached under
//! `~/.cache/gpu-stack/nvidia-oracles/bin`; `cargo xtask test` builds them and
//! requires them); run alone without them, each test says so and passes.
//! mig-parted also reads /proc/modules and the PCI devices in sysfs, which
//! `tools/nvidia-oracles/fake-host.sh` fakes in a private mount namespace
//! (`unshare -m`, root only); without that the mig-parted test is skipped too.

use std::process::Command;

mod oracles;

use oracles::{Node, fleet, oracle, unshare_works};

#[test]
fn gpu_feature_discovery_labels_the_simulated_node() {
    let Some(gfd) = oracle("gpu-feature-discovery") else {
        return;
    };
    let node = Node::new(fleet("dgx-a100"), None);
    let labels = node.nvml.path().join("labels");
    let mut cmd = Command::new(gfd);
    cmd.args(["--oneshot", "--mig-strategy=mixed", "--no-timestamp"])
        .arg(format!("--output-file={}", labels.display()));
    let out = node.nvidia(cmd);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "gpu-feature-discovery failed:\n{stderr}"
    );
    let text = std::fs::read_to_string(&labels).unwrap();
    let mut got: Vec<&str> = text.lines().collect();
    got.sort();
    eprintln!("gpu-feature-discovery labels:\n{}", got.join("\n"));
    for want in [
        "nvidia.com/gpu.count=8",
        "nvidia.com/gpu.product=NVIDIA-A100-SXM4-40GB",
        "nvidia.com/gpu.memory=40960",
        "nvidia.com/gpu.family=ampere",
        "nvidia.com/gpu.compute.major=8",
        "nvidia.com/mig.capable=true",
        "nvidia.com/mig.strategy=mixed",
        "nvidia.com/mig-1g.5gb.count=4",
        "nvidia.com/mig-1g.5gb.memory=4864",
        "nvidia.com/mig-1g.5gb.multiprocessors=14",
        "nvidia.com/mig-2g.10gb.count=2",
        "nvidia.com/mig-2g.10gb.slices.gi=2",
        "nvidia.com/mig-3g.20gb.count=2",
        "nvidia.com/mig-3g.20gb.engines.copy=3",
        "nvidia.com/mig-3g.20gb.product=NVIDIA-A100-SXM4-40GB-MIG-3g.20gb",
    ] {
        assert!(
            got.contains(&want),
            "no {want} in:\n{text}\nstderr:\n{stderr}"
        );
    }
}

#[test]
fn mig_parted_exports_the_simulated_layout() {
    let Some(parted) = oracle("nvidia-mig-parted") else {
        return;
    };
    if !unshare_works() {
        return;
    }
    let fake_host = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tools/nvidia-oracles/fake-host.sh"
    );
    let node = Node::new(fleet("dgx-a100"), None);
    let mut cmd = Command::new("unshare");
    cmd.args(["-m", fake_host, &node.fake_host_gpus()])
        .arg(parted)
        .arg("export");
    let out = node.nvidia(cmd);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("nvidia-mig-parted export:\n{stdout}");
    assert!(
        out.status.success(),
        "nvidia-mig-parted export failed:\n{stderr}"
    );
    let want = "\
version: v1
mig-configs:
  current:
  - devices: [0, 1, 2, 3, 4, 5]
    mig-enabled: false
    mig-devices: {}
  - devices: [6, 7]
    mig-enabled: true
    mig-devices:
      1g.5gb: 2
      2g.10gb: 1
      3g.20gb: 1
";
    assert_eq!(stdout, want, "stderr:\n{stderr}");
}
