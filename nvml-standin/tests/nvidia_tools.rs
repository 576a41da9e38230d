//! NVIDIA's own NVML clients on the stand-in, on examples/fleets/dgx-a100.yaml:
//! gpu-feature-discovery (`--oneshot`) and `nvidia-mig-parted export`, each
//! loading `libnvidia-ml.so.1` from a directory where that name points at the
//! stand-in.
//!
//! The binaries come from `tools/nvidia-oracles/build.sh` (cached under
//! `~/.cache/gpu-stack/nvidia-oracles/bin`; `cargo xtask test` builds them and
//! requires them); run alone without them, each test says so and passes. mig-parted also reads /proc/modules and the PCI
//! devices in sysfs, which `tools/nvidia-oracles/fake-host.sh` fakes in a
//! private mount namespace (`unshare -m`, root only); without that the
//! mig-parted test is skipped too.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use gpu_stack_core::backend::GpuBackend;

const FLEET: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../examples/fleets/dgx-a100.yaml"
);

/// Where build.sh puts the binaries (same rule as the script).
fn oracle_bin() -> PathBuf {
    if let Some(dir) = std::env::var_os("GPU_STACK_NVIDIA_ORACLES_CACHE") {
        return PathBuf::from(dir).join("bin");
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache")
        });
    cache.join("gpu-stack").join("nvidia-oracles").join("bin")
}

/// Set by `cargo xtask test`, which builds the tools first: a missing tool or
/// `unshare` is then a failure, not a skip.
const REQUIRED_ENV: &str = "GPU_STACK_NVIDIA_ORACLES_REQUIRED";

fn required() -> bool {
    std::env::var_os(REQUIRED_ENV).is_some_and(|v| v == "1")
}

/// Says why a test cannot run: a skip, or a failure where the tools are required.
fn skip(why: &str) {
    assert!(
        !required(),
        "{why} ({REQUIRED_ENV}=1: cargo xtask test builds and needs them)"
    );
    eprintln!("SKIPPED: {why}");
}

/// The binary `name`, or `None` after saying why the test is skipped.
fn oracle(name: &str) -> Option<PathBuf> {
    let path = oracle_bin().join(name);
    if path.is_file() {
        return Some(path);
    }
    skip(&format!(
        "{} is not built; run tools/nvidia-oracles/build.sh to build NVIDIA's tools",
        path.display()
    ));
    None
}

/// A directory holding `libnvidia-ml.so.1` → the built stand-in.
fn nvml_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(
        gpu_stack_nvml::testing::standin_lib(),
        dir.path().join("libnvidia-ml.so.1"),
    )
    .unwrap();
    dir
}

/// Runs `cmd` with the stand-in as libnvidia-ml, killing it after a minute.
fn run(mut cmd: Command, nvml: &Path) -> Output {
    cmd.env("LD_LIBRARY_PATH", nvml)
        .env("GPU_STACK_STANDIN_FLEET", FLEET)
        .env_remove("GPU_STACK_STANDIN_NODE")
        .env_remove("GPU_STACK_STANDIN_STATE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn gpu_feature_discovery_labels_the_simulated_node() {
    let Some(gfd) = oracle("gpu-feature-discovery") else {
        return;
    };
    let nvml = nvml_dir();
    let labels = nvml.path().join("labels");
    let mut cmd = Command::new(gfd);
    cmd.args(["--oneshot", "--mig-strategy=mixed", "--no-timestamp"])
        .arg(format!("--output-file={}", labels.display()));
    let out = run(cmd, nvml.path());
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
    let unshare_works = Command::new("unshare")
        .args(["-m", "true"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !unshare_works {
        skip(
            "`unshare -m` is not available (needs root); nvidia-mig-parted reads \
             /proc/modules and sysfs, which tools/nvidia-oracles/fake-host.sh fakes in a \
             mount namespace",
        );
        return;
    }
    // The PCI devices mig-parted enumerates: the simulated GPUs' addresses.
    let spec = gpu_stack_nvml::SimNodeSpec::from_fleet_file(Path::new(FLEET), None).unwrap();
    let sim = gpu_stack_nvml::SimulatedBackend::new(&spec).unwrap();
    let gpus: Vec<String> = (0..sim.device_count().unwrap())
        .map(|i| {
            let info = sim.gpu_info(i).unwrap();
            let bus = info.pci_bus_id.to_lowercase();
            let bus = bus.strip_prefix("0000").unwrap_or(&bus).to_string();
            format!("{bus}={:#06x}", info.pci_device_id >> 16)
        })
        .collect();
    let fake_host = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tools/nvidia-oracles/fake-host.sh"
    );
    let nvml = nvml_dir();
    let mut cmd = Command::new("unshare");
    cmd.args(["-m", fake_host, &gpus.join(",")])
        .arg(parted)
        .arg("export");
    let out = run(cmd, nvml.path());
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
