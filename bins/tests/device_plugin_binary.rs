//! `gpu-device-plugin` as a process, as the kubelet sees it: the binary runs
//! against a simulated DGX A100 with its `--kubelet-dir` in a temporary
//! directory where the kubelet stand-in serves `kubelet.sock`. The tests check
//! registration, Allocate through the stand-in, an Xid injected by another
//! process (`gpu-stack gpus --inject-xid`) through the shared `--sim-state`
//! file turning exactly that GPU Unhealthy, and a clean SIGTERM stop that
//! removes the plugin sockets.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use gpu_stack_k8s::kubelet::deviceplugin::standin::{KubeletStandin, KubeletView};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// Bound on every wait; only keeps a broken build from hanging the run.
const WAIT: Duration = Duration::from_secs(60);
const NODE: &str = "dgx-a100-0";
const GPU: &str = "nvidia.com/gpu";

fn fleet() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/fleets/dgx-a100.yaml")
}

/// Environment variables the binaries read; cleared so the caller's shell
/// cannot change what the test runs.
const ENV: [&str; 12] = [
    "NODE_NAME",
    "KUBELET_DIR",
    "CONFIG_FILE",
    "MIG_STRATEGY",
    "DEVICE_LIST_STRATEGY",
    "DEVICE_ID_STRATEGY",
    "CDI_SPEC_DIR",
    "DP_DISABLE_HEALTHCHECKS",
    "DP_ENABLE_HEALTHCHECKS",
    "GPU_STACK_BACKEND",
    "GPU_STACK_FLEET",
    "GPU_STACK_SIM_STATE",
];

fn command(bin: &str) -> Command {
    let mut c = Command::new(bin);
    for k in ENV {
        c.env_remove(k);
    }
    c.env("RUST_LOG", "info").env("RUST_BACKTRACE", "0");
    c
}

/// The plugin process; killed if a test ends without stopping it.
struct Plugin {
    child: Child,
    log: PathBuf,
}

impl Plugin {
    fn start(dir: &Path, state: &Path, extra: &[&str]) -> Plugin {
        let log = dir.join("plugin.log");
        let child = command(env!("CARGO_BIN_EXE_gpu-device-plugin"))
            .args(["--backend", "simulated", "--node", NODE, "--fleet"])
            .arg(fleet())
            .arg("--sim-state")
            .arg(state)
            .arg("--kubelet-dir")
            .arg(dir.join("device-plugins"))
            // No recovery while the test looks at the Unhealthy device.
            .args(["--health-recovery-seconds", "3600"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Plugin { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, then a bounded wait for the exit.
    fn terminate(&mut self) -> ExitStatus {
        kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM).unwrap();
        for _ in 0..400 {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!(
            "gpu-device-plugin did not stop within 10 s of SIGTERM; log:\n{}",
            self.log()
        );
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// UUIDs of the node's GPUs by index, read by `gpu-stack gpus -o json` from
/// the same simulated node.
fn gpu_uuids(state: &Path) -> Vec<String> {
    let out = command(env!("CARGO_BIN_EXE_gpu-stack"))
        .args([
            "gpus",
            "-o",
            "json",
            "--backend",
            "simulated",
            "--node",
            NODE,
        ])
        .arg("--fleet")
        .arg(fleet())
        .arg("--sim-state")
        .arg(state)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "gpu-stack gpus failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let snap: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    snap["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["uuid"].as_str().unwrap().to_string())
        .collect()
}

fn inject_xid(state: &Path, gpu_xid: &str) {
    let out = command(env!("CARGO_BIN_EXE_gpu-stack"))
        .args(["gpus", "--backend", "simulated", "--node", NODE])
        .arg("--fleet")
        .arg(fleet())
        .arg("--sim-state")
        .arg(state)
        .args(["--inject-xid", gpu_xid])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "gpu-stack gpus --inject-xid failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn health<'a>(v: &'a KubeletView, resource: &str, id: &str) -> Option<&'a str> {
    v.devices
        .get(resource)?
        .iter()
        .find(|d| d.id == id)
        .map(|d| d.health.as_str())
}

fn sockets(dir: &Path) -> Vec<String> {
    use std::os::unix::fs::FileTypeExt;
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_socket()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_allocates_turns_unhealthy_on_xid_and_stops_on_sigterm() {
    let tmp = tempfile::tempdir().unwrap();
    let kubelet_dir = tmp.path().join("device-plugins");
    std::fs::create_dir_all(&kubelet_dir).unwrap();
    let state = tmp.path().join("gpus.json");
    let kubelet = KubeletStandin::start(&kubelet_dir).await.unwrap();
    let uuids = gpu_uuids(&state);
    assert_eq!(uuids.len(), 8, "the DGX A100 fleet node has 8 GPUs");

    let mut plugin = Plugin::start(tmp.path(), &state, &[]);

    // Registration: the kubelet dials back and receives all 8 GPUs, Healthy
    // (mig strategy none advertises every GPU whole, MIG-enabled ones too).
    let view = kubelet
        .wait_for("nvidia.com/gpu registered with 8 healthy GPUs", WAIT, |v| {
            v.registrations.iter().any(|r| r.resource == GPU) && v.healthy(GPU).len() == 8
        })
        .await
        .unwrap_or_else(|e| panic!("{e}; plugin log:\n{}", plugin.log()));
    let reg = view
        .registrations
        .iter()
        .find(|r| r.resource == GPU)
        .unwrap();
    assert_eq!(reg.endpoint, "nvidia-gpu.sock");
    assert!(
        reg.options.get_preferred_allocation_available,
        "the plugin offers GetPreferredAllocation"
    );
    let mut advertised = view.healthy(GPU);
    advertised.sort();
    let mut expected = uuids.clone();
    expected.sort();
    assert_eq!(advertised, expected, "device ids are the GPU UUIDs");
    assert_eq!(
        view.registrations.len(),
        1,
        "only nvidia.com/gpu with mig strategy none: {:?}",
        view.registrations
    );

    // Allocate through the kubelet stand-in: envvar strategy by default.
    let resp = kubelet
        .allocate(GPU, &[uuids[1].clone(), uuids[0].clone()])
        .await
        .unwrap();
    let visible = resp.envs.get("NVIDIA_VISIBLE_DEVICES").unwrap();
    let mut got: Vec<&str> = visible.split(',').collect();
    got.sort();
    let mut want = vec![uuids[0].as_str(), uuids[1].as_str()];
    want.sort();
    assert_eq!(got, want, "NVIDIA_VISIBLE_DEVICES={visible}");
    // The same request gives the same answer (the kubelet replays it).
    let again = kubelet
        .allocate(GPU, &[uuids[1].clone(), uuids[0].clone()])
        .await
        .unwrap();
    assert_eq!(again, resp);
    // Unknown ids are refused with InvalidArgument naming them.
    let err = kubelet
        .allocate(GPU, &["GPU-not-on-this-node".to_string()])
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("GPU-not-on-this-node"), "{err}");

    // A critical Xid (48, double-bit ECC) raised by another process through
    // the shared state file turns exactly GPU 3 Unhealthy.
    inject_xid(&state, "3:48");
    let view = kubelet
        .wait_for("GPU 3 Unhealthy after Xid 48", WAIT, |v| {
            health(v, GPU, &uuids[3]) == Some("Unhealthy")
        })
        .await
        .unwrap_or_else(|e| panic!("{e}; plugin log:\n{}", plugin.log()));
    let healthy = view.healthy(GPU);
    assert_eq!(healthy.len(), 7, "one broken GPU leaves the others Healthy");
    assert!(!healthy.contains(&uuids[3]));
    assert_eq!(
        plugin.child.try_wait().unwrap(),
        None,
        "the plugin keeps running with one broken GPU"
    );

    // An ignored Xid (13, graphics engine exception) changes nothing.
    let updates = view.updates[GPU];
    inject_xid(&state, "5:13");
    // A second critical Xid after it is the marker that the first was seen.
    inject_xid(&state, "6:48");
    let view = kubelet
        .wait_for("GPU 6 Unhealthy after Xid 48", WAIT, |v| {
            health(v, GPU, &uuids[6]) == Some("Unhealthy")
        })
        .await
        .unwrap_or_else(|e| panic!("{e}; plugin log:\n{}", plugin.log()));
    assert_eq!(health(&view, GPU, &uuids[5]), Some("Healthy"));
    assert_eq!(view.healthy(GPU).len(), 6);
    assert!(view.updates[GPU] > updates);

    // SIGTERM: clean exit, our socket gone, the kubelet's left in place.
    assert_eq!(
        sockets(&kubelet_dir),
        ["kubelet.sock", "nvidia-gpu.sock"],
        "sockets while running"
    );
    let status = plugin.terminate();
    assert!(
        status.success(),
        "exit status {status:?}; log:\n{}",
        plugin.log()
    );
    assert_eq!(sockets(&kubelet_dir), ["kubelet.sock"]);
    kubelet
        .wait_for("the ListAndWatch stream to end", WAIT, |v| {
            v.disconnected.iter().any(|r| r == GPU)
        })
        .await
        .unwrap();
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_strategy_with_cdi_registers_mig_resources_and_writes_the_spec() {
    let tmp = tempfile::tempdir().unwrap();
    let kubelet_dir = tmp.path().join("device-plugins");
    std::fs::create_dir_all(&kubelet_dir).unwrap();
    let cdi_dir = tmp.path().join("cdi");
    let state = tmp.path().join("gpus.json");
    let kubelet = KubeletStandin::start(&kubelet_dir).await.unwrap();
    let cdi_arg = cdi_dir.display().to_string();
    let mut plugin = Plugin::start(
        tmp.path(),
        &state,
        &[
            "--mig-strategy",
            "mixed",
            "--device-list-strategy",
            "cdi-cri",
            "--cdi-spec-dir",
            &cdi_arg,
        ],
    );

    // GPUs 6 and 7 each hold 3g.20gb + 2g.10gb + 2x 1g.5gb.
    let expected = [
        (GPU, 6),
        ("nvidia.com/mig-1g.5gb", 4),
        ("nvidia.com/mig-2g.10gb", 2),
        ("nvidia.com/mig-3g.20gb", 2),
    ];
    let view = kubelet
        .wait_for("every mixed-strategy resource registered", WAIT, |v| {
            expected.iter().all(|(r, n)| {
                v.healthy(r).len() == *n && v.registrations.iter().any(|g| g.resource == *r)
            })
        })
        .await
        .unwrap_or_else(|e| panic!("{e}; plugin log:\n{}", plugin.log()));
    let mut registered: Vec<&str> = view
        .registrations
        .iter()
        .map(|r| r.resource.as_str())
        .collect();
    registered.sort();
    assert_eq!(registered, expected.map(|(r, _)| r));

    // cdi-cri: the kubelet gets fully qualified CDI device names, and the
    // spec that defines them is on disk.
    let mig = view.healthy("nvidia.com/mig-1g.5gb")[0].clone();
    let resp = kubelet
        .allocate("nvidia.com/mig-1g.5gb", std::slice::from_ref(&mig))
        .await
        .unwrap();
    let names: Vec<&str> = resp.cdi_devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, [format!("nvidia.com/gpu={mig}")], "{resp:?}");
    let specs: Vec<PathBuf> = std::fs::read_dir(&cdi_dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(specs.len(), 1, "one CDI spec: {specs:?}");
    let text = std::fs::read_to_string(&specs[0]).unwrap();
    let spec: serde_json::Value = if specs[0].extension().is_some_and(|e| e == "json") {
        serde_json::from_str(&text).unwrap()
    } else {
        serde_saphyr::from_str(&text).unwrap()
    };
    assert_eq!(spec["kind"], "nvidia.com/gpu");
    let spec_names: Vec<&str> = spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|d| d["name"].as_str())
        .collect();
    assert!(spec_names.contains(&mig.as_str()), "{spec_names:?}");
    assert!(spec_names.contains(&"all"), "{spec_names:?}");

    let status = plugin.terminate();
    assert!(status.success(), "{status:?}; log:\n{}", plugin.log());
    assert_eq!(sockets(&kubelet_dir), ["kubelet.sock"]);
    kubelet.stop().await;
}
