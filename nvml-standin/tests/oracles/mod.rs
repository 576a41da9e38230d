//! What the differential tests share: NVIDIA's binaries (built by
//! `tools/nvidia-oracles/build.sh`), ours (built here from gpu-stack-bins into
//! this test's target directory), a directory where `libnvidia-ml.so.1` is the
//! stand-in, and process runs with a time limit.
//!
//! Same convention as `nvidia_tools.rs`: without NVIDIA's binaries (or
//! `unshare -m`) a test says why and passes, unless
//! `GPU_STACK_NVIDIA_ORACLES_REQUIRED=1` (set by `cargo xtask test`).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use gpu_stack_core::backend::GpuBackend;

/// A fleet file of `examples/fleets/`.
pub fn fleet(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/fleets")
        .join(format!("{name}.yaml"))
}

/// Where build.sh puts NVIDIA's binaries (same rule as the script).
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
pub fn skip(why: &str) {
    assert!(
        !required(),
        "{why} ({REQUIRED_ENV}=1: cargo xtask test builds and needs them)"
    );
    eprintln!("SKIPPED: {why}");
}

/// NVIDIA's binary `name`, or `None` after saying why the test is skipped.
pub fn oracle(name: &str) -> Option<PathBuf> {
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

/// Whether `unshare -m` works here (root); says why not otherwise.
pub fn unshare_works() -> bool {
    let ok = Command::new("unshare")
        .args(["-m", "true"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        skip(
            "`unshare -m` is not available (needs root); nvidia-mig-parted reads \
             /proc/modules and sysfs, which tools/nvidia-oracles/fake-host.sh fakes in a \
             mount namespace",
        );
    }
    ok
}

/// Our binary `name` (`gpu-stack`, `gpu-feature-discovery`, ...), built once
/// per test process into the target directory and profile of this test.
pub fn ours(name: &str) -> PathBuf {
    static PROFILE_DIR: OnceLock<PathBuf> = OnceLock::new();
    let dir = PROFILE_DIR.get_or_init(|| {
        let exe = std::env::current_exe().unwrap();
        // <target>/<profile>/deps/<test binary>
        let profile_dir = exe.parent().and_then(Path::parent).unwrap().to_path_buf();
        let target_dir = profile_dir.parent().unwrap().to_path_buf();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        // The same build as `cargo xtask test`'s first step (and so nothing to
        // do after it): building the binaries alone (`-p gpu-stack-bins`)
        // resolves dependency features differently and would rebuild them,
        // and part of their dependencies, back and forth with the workspace
        // build.
        cmd.current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
            .args([
                "test",
                "--quiet",
                "--workspace",
                "--all-targets",
                "--no-run",
            ])
            .env("CARGO_TARGET_DIR", &target_dir);
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let built = cmd.status().is_ok_and(|s| s.success());
        assert!(
            built,
            "cargo test --workspace --all-targets --no-run failed"
        );
        profile_dir
    });
    let bin = dir.join(name);
    assert!(bin.is_file(), "{} was not built", bin.display());
    bin
}

/// A directory holding `libnvidia-ml.so.1` → the built stand-in.
pub fn nvml_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(
        gpu_stack_nvml::testing::standin_lib(),
        dir.path().join("libnvidia-ml.so.1"),
    )
    .unwrap();
    dir
}

/// One simulated node as both sides see it: the fleet file and, when MIG
/// changes are to persist between processes, the shared state file. NVIDIA's
/// tools reach it through the stand-in (`GPU_STACK_STANDIN_*`), ours through
/// `--backend simulated --fleet --sim-state`.
pub struct Node {
    pub fleet: PathBuf,
    pub state: Option<PathBuf>,
    pub nvml: tempfile::TempDir,
}

impl Node {
    pub fn new(fleet: PathBuf, state: Option<PathBuf>) -> Node {
        Node {
            fleet,
            state,
            nvml: nvml_dir(),
        }
    }

    /// Runs NVIDIA's `cmd` on the stand-in.
    pub fn nvidia(&self, mut cmd: Command) -> Output {
        self.nvidia_env(&mut cmd);
        run(cmd)
    }

    /// Points NVIDIA's `cmd` at the stand-in and this node (for commands
    /// spawned rather than run to the end).
    pub fn nvidia_env(&self, cmd: &mut Command) {
        cmd.env("LD_LIBRARY_PATH", self.nvml.path())
            .env("GPU_STACK_STANDIN_FLEET", &self.fleet)
            .env_remove("GPU_STACK_STANDIN_NODE")
            .env_remove("GPU_STACK_STANDIN_STATE");
        if let Some(s) = &self.state {
            cmd.env("GPU_STACK_STANDIN_STATE", s);
        }
    }

    /// The backend flags of our binaries for this node.
    pub fn backend_args(&self) -> Vec<String> {
        let mut a = vec![
            "--backend".to_string(),
            "simulated".to_string(),
            "--fleet".to_string(),
            self.fleet.display().to_string(),
        ];
        if let Some(s) = &self.state {
            a.extend(["--sim-state".to_string(), s.display().to_string()]);
        }
        a
    }

    /// Runs our `cmd` (backend flags added) on the simulated backend.
    pub fn ours(&self, mut cmd: Command) -> Output {
        self.ours_env(&mut cmd);
        run(cmd)
    }

    /// Adds the backend flags to our `cmd` and clears the environment that
    /// would override them (for commands spawned rather than run to the end).
    pub fn ours_env(&self, cmd: &mut Command) {
        cmd.args(self.backend_args())
            .env_remove("GPU_STACK_BACKEND")
            .env_remove("GPU_STACK_FLEET")
            .env_remove("GPU_STACK_SIM_STATE")
            .env_remove("NODE_NAME");
    }

    /// The simulated backend of this node, on its state file when it has one
    /// (so faults injected here reach both sides' processes).
    pub fn sim(&self) -> gpu_stack_nvml::SimulatedBackend {
        let spec = gpu_stack_nvml::SimNodeSpec::from_fleet_file(&self.fleet, None).unwrap();
        match &self.state {
            Some(s) => gpu_stack_nvml::SimulatedBackend::with_state_file(&spec, s).unwrap(),
            None => gpu_stack_nvml::SimulatedBackend::new(&spec).unwrap(),
        }
    }

    /// Each GPU's PCI bus id and device id (`0x20B010DE`), by index.
    pub fn gpus(&self) -> Vec<(String, u32)> {
        let sim = self.sim();
        (0..sim.device_count().unwrap())
            .map(|i| {
                let info = sim.gpu_info(i).unwrap();
                (info.pci_bus_id, info.pci_device_id)
            })
            .collect()
    }

    /// The `ADDR=DEVICE@NUMA,...` argument of fake-host.sh for this node's
    /// GPUs (sysfs bus address, PCI device id, NUMA node; `@0` where the
    /// node reports none).
    pub fn fake_host_gpus(&self) -> String {
        let sim = self.sim();
        (0..sim.device_count().unwrap())
            .map(|i| {
                let info = sim.gpu_info(i).unwrap();
                let bus = info.pci_bus_id.to_lowercase();
                let bus = bus.strip_prefix("0000").unwrap_or(&bus).to_string();
                format!(
                    "{bus}={:#06x}@{}",
                    info.pci_device_id >> 16,
                    info.numa_node.unwrap_or(0)
                )
            })
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// Runs `cmd` with piped output, killing it after a minute.
pub fn run(mut cmd: Command) -> Output {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let shown = format!("{cmd:?}");
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {shown}: {e}"));
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

/// stdout and stderr of a run, for failure messages.
pub fn shown(out: &Output) -> String {
    format!(
        "{}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `- left` / `+ right` lines for keys whose values differ between two maps
/// (a missing key shows as absent).
pub fn map_diff<V: std::fmt::Debug + PartialEq>(
    left_name: &str,
    left: &BTreeMap<String, V>,
    right_name: &str,
    right: &BTreeMap<String, V>,
) -> String {
    let mut keys: Vec<&String> = left.keys().chain(right.keys()).collect();
    keys.sort();
    keys.dedup();
    let mut out = String::new();
    for k in keys {
        let (l, r) = (left.get(k), right.get(k));
        if l == r {
            continue;
        }
        let show = |v: Option<&V>| v.map_or("(absent)".to_string(), |v| format!("{v:?}"));
        out.push_str(&format!(
            "  {k}:\n    {left_name:>6}: {}\n    {right_name:>6}: {}\n",
            show(l),
            show(r)
        ));
    }
    out
}
