//! Device plugin protocol tests: the plugin and a kubelet stand-in speak the
//! real v1beta1 gRPC over unix sockets in a temporary directory, with GPUs from
//! the simulated backend (DGX A100 fleet: GPUs 0-5 whole, 6-7 MIG-partitioned).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpu_stack_core::backend::{Fault, FaultSpec, GpuBackend};
use gpu_stack_core::deviceplugin::{HealthPolicy, NodeGpus, Overrides, Settings, node_resources};
use gpu_stack_k8s::deviceplugin::health::{BackendProbe, HealthPump, spawn_backend_health};
use gpu_stack_k8s::deviceplugin::node::read_node_gpus;
use gpu_stack_k8s::deviceplugin::{DevicePlugins, PluginOptions};
use gpu_stack_k8s::kubelet::deviceplugin::standin::{KubeletStandin, KubeletView};
use gpu_stack_nvml::{SimNodeSpec, SimulatedBackend};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const WAIT: Duration = Duration::from_secs(20);

fn fleet() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/fleets/dgx-a100.yaml")
}

fn backend() -> Arc<SimulatedBackend> {
    let spec = SimNodeSpec::from_fleet_file(&fleet(), Some("dgx-a100-0")).unwrap();
    Arc::new(SimulatedBackend::new(&spec).unwrap())
}

fn settings(mig: &str, list: &str) -> Settings {
    Settings::resolve(
        None,
        &Overrides {
            mig_strategy: Some(mig.into()),
            device_list_strategy: Some(list.into()),
            ..Overrides::default()
        },
    )
    .unwrap()
}

struct Plugin {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<(), gpu_stack_k8s::deviceplugin::PluginError>>,
    _pump: HealthPump,
}

impl Plugin {
    async fn stop(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(WAIT, self.task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
}

fn start_plugin(
    dir: &Path,
    backend: Arc<SimulatedBackend>,
    settings: Settings,
    quiet_ms: u64,
) -> (Plugin, NodeGpus) {
    start_plugin_probing(dir, backend, settings, quiet_ms, Duration::from_millis(50))
}

/// Like [`start_plugin`], with the probe tick (health probes, registration
/// retries and the check for lost directory events) every `probe_interval`.
fn start_plugin_probing(
    dir: &Path,
    backend: Arc<SimulatedBackend>,
    settings: Settings,
    quiet_ms: u64,
    probe_interval: Duration,
) -> (Plugin, NodeGpus) {
    let node = read_node_gpus(backend.as_ref(), None).unwrap();
    let resources = node_resources(&node, &settings).unwrap();
    let options = PluginOptions {
        kubelet_dir: dir.to_path_buf(),
        register: true,
        health: HealthPolicy {
            recovery_quiet_ms: quiet_ms,
            ..HealthPolicy::default()
        },
        probe_interval,
    };
    let dyn_backend: Arc<dyn GpuBackend> = backend;
    let plugins = DevicePlugins::new(resources.clone(), settings, Default::default(), options)
        .with_probe(Arc::new(BackendProbe::new(dyn_backend.clone(), &resources)));
    let pump = spawn_backend_health(dyn_backend, &resources, plugins.health_sender());
    let (stop, stop_rx) = oneshot::channel();
    let task = tokio::spawn(plugins.run(async move {
        let _ = stop_rx.await;
    }));
    (
        Plugin {
            stop,
            task,
            _pump: pump,
        },
        node,
    )
}

fn registered(v: &KubeletView, resource: &str, generation: u64) -> bool {
    v.registrations
        .iter()
        .any(|r| r.resource == resource && r.generation == generation)
        && v.devices.contains_key(resource)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_every_resource_and_lists_devices() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = KubeletStandin::start(dir.path()).await.unwrap();
    let (plugin, node) = start_plugin(dir.path(), backend(), settings("mixed", "envvar"), 60_000);

    let v = kubelet
        .wait_for("four resources", WAIT, |v| {
            [
                "nvidia.com/gpu",
                "nvidia.com/mig-1g.5gb",
                "nvidia.com/mig-2g.10gb",
                "nvidia.com/mig-3g.20gb",
            ]
            .iter()
            .all(|r| registered(v, r, 1))
        })
        .await
        .unwrap();
    assert_eq!(v.devices["nvidia.com/gpu"].len(), 6);
    assert_eq!(v.devices["nvidia.com/mig-1g.5gb"].len(), 4);
    assert_eq!(v.devices["nvidia.com/mig-3g.20gb"].len(), 2);
    assert!(v.devices.values().flatten().all(|d| d.health == "Healthy"));
    let gpu0 = &node.gpus[0];
    let d0 = v.devices["nvidia.com/gpu"]
        .iter()
        .find(|d| d.id == gpu0.uuid)
        .unwrap();
    assert_eq!(
        d0.topology.as_ref().map(|t| t.nodes.len()),
        gpu0.numa_node.map(|_| 1),
        "NUMA topology is sent when known"
    );
    let reg = v
        .registrations
        .iter()
        .find(|r| r.resource == "nvidia.com/mig-1g.5gb")
        .unwrap();
    assert_eq!(reg.endpoint, "nvidia-mig-1g.5gb.sock");
    assert!(reg.options.get_preferred_allocation_available);
    assert!(!reg.options.pre_start_required);

    // GetPreferredAllocation keeps MIG devices of one request on one GPU.
    let avail = kubelet.view().healthy("nvidia.com/mig-1g.5gb");
    let got = kubelet
        .preferred("nvidia.com/mig-1g.5gb", &avail, &[], 2)
        .await
        .unwrap();
    assert_eq!(got.len(), 2);
    let parent = |id: &str| {
        node.gpus
            .iter()
            .find(|g| g.mig_devices.iter().any(|m| m.uuid == id))
            .unwrap()
            .index
    };
    assert_eq!(parent(&got[0]), parent(&got[1]));

    // Ids never advertised and must-include lists past the size are refused.
    let mut bogus = avail.clone();
    bogus.push("MIG-not-advertised".into());
    let e = kubelet
        .preferred("nvidia.com/mig-1g.5gb", &bogus, &[], 2)
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("MIG-not-advertised"), "{e}");
    let e = kubelet
        .preferred("nvidia.com/mig-1g.5gb", &avail, &avail[..2], 1)
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("must-include"), "{e}");

    plugin.stop().await;
    assert!(
        !dir.path().join("nvidia-gpu.sock").exists(),
        "sockets are removed on shutdown"
    );
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_per_device_list_strategy() {
    for (strategy, check) in [("envvar", 0), ("cdi-annotations", 1), ("cdi-cri", 2)] {
        let dir = tempfile::tempdir().unwrap();
        let kubelet = KubeletStandin::start(dir.path()).await.unwrap();
        let (plugin, _) = start_plugin(dir.path(), backend(), settings("mixed", strategy), 60_000);
        let v = kubelet
            .wait_for("gpu", WAIT, |v| registered(v, "nvidia.com/gpu", 1))
            .await
            .unwrap();
        let ids: Vec<String> = v.healthy("nvidia.com/gpu").into_iter().take(2).collect();
        let r = kubelet.allocate("nvidia.com/gpu", &ids).await.unwrap();
        let again = kubelet.allocate("nvidia.com/gpu", &ids).await.unwrap();
        assert_eq!(r, again, "{strategy}: same request, same response");
        let cdi: Vec<String> = ids.iter().map(|i| format!("nvidia.com/gpu={i}")).collect();
        match check {
            0 => {
                assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], ids.join(","));
                assert!(r.cdi_devices.is_empty());
            }
            1 => {
                assert!(r.envs.is_empty());
                assert_eq!(r.annotations.len(), 1);
                let (k, val) = r.annotations.iter().next().unwrap();
                assert!(k.starts_with("cdi.k8s.io/"), "{k}");
                assert_eq!(val, &cdi.join(","));
            }
            _ => {
                assert!(r.envs.is_empty());
                let names: Vec<String> = r.cdi_devices.iter().map(|d| d.name.clone()).collect();
                assert_eq!(names, cdi);
            }
        }
        // Unknown and duplicated ids are refused with InvalidArgument naming them.
        let e = kubelet
            .allocate("nvidia.com/gpu", &["GPU-does-not-exist".to_string()])
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(
            e.message().contains("GPU-does-not-exist"),
            "{}",
            e.message()
        );
        let e = kubelet
            .allocate("nvidia.com/gpu", &[ids[0].clone(), ids[0].clone()])
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains(&ids[0]));
        plugin.stop().await;
        kubelet.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xid_marks_unhealthy_and_cleared_device_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = KubeletStandin::start(dir.path()).await.unwrap();
    let be = backend();
    let (plugin, node) = start_plugin(dir.path(), be.clone(), settings("mixed", "envvar"), 500);
    kubelet
        .wait_for("gpu", WAIT, |v| registered(v, "nvidia.com/gpu", 1))
        .await
        .unwrap();
    let gpu2 = node.gpus[2].uuid.clone();
    let gpu5 = node.gpus[5].uuid.clone();
    let health = |v: &KubeletView, id: &str| {
        v.devices["nvidia.com/gpu"]
            .iter()
            .find(|d| d.id == id)
            .map(|d| d.health.clone())
            .unwrap_or_default()
    };

    // An ignored Xid (13, application error) changes nothing.
    be.inject(FaultSpec {
        gpu: Some(2),
        at_ms: 0,
        fault: Fault::Xid {
            xid: 13,
            gpu_instance: None,
        },
    })
    .unwrap();
    // A critical one (48, double-bit ECC) marks GPU 2 Unhealthy; GPU 5 falls off the bus.
    be.inject(FaultSpec {
        gpu: Some(2),
        at_ms: 0,
        fault: Fault::Xid {
            xid: 48,
            gpu_instance: None,
        },
    })
    .unwrap();
    be.inject(FaultSpec {
        gpu: Some(5),
        at_ms: 0,
        fault: Fault::FallOffBus,
    })
    .unwrap();
    let v = kubelet
        .wait_for("GPUs 2 and 5 unhealthy", WAIT, |v| {
            health(v, &gpu2) == "Unhealthy" && health(v, &gpu5) == "Unhealthy"
        })
        .await
        .unwrap();
    assert_eq!(
        v.healthy("nvidia.com/gpu").len(),
        4,
        "one broken GPU does not take others down"
    );

    // GPU 2 still answers queries: after the quiet period it is Healthy again.
    // GPU 5 is gone: it stays Unhealthy.
    let v = kubelet
        .wait_for("GPU 2 recovers", WAIT, |v| health(v, &gpu2) == "Healthy")
        .await
        .unwrap();
    assert_eq!(health(&v, &gpu5), "Unhealthy");

    // An Xid on a MIG GPU instance only affects that MIG device.
    let mig_gpu = node
        .gpus
        .iter()
        .find(|g| !g.mig_devices.is_empty())
        .unwrap();
    let m = &mig_gpu.mig_devices[0];
    let res = format!("nvidia.com/mig-{}", m.resource_profile());
    be.inject(FaultSpec {
        gpu: Some(mig_gpu.index),
        at_ms: 0,
        fault: Fault::Xid {
            xid: 94,
            gpu_instance: Some(m.gi),
        },
    })
    .unwrap();
    let v = kubelet
        .wait_for("MIG device unhealthy", WAIT, |v| {
            v.devices
                .get(&res)
                .is_some_and(|d| d.iter().any(|d| d.id == m.uuid && d.health == "Unhealthy"))
        })
        .await
        .unwrap();
    let others_healthy = v
        .devices
        .iter()
        .filter(|(r, _)| r.starts_with("nvidia.com/mig-"))
        .flat_map(|(_, d)| d)
        .filter(|d| d.id != m.uuid)
        .all(|d| d.health == "Healthy");
    assert!(others_healthy);

    plugin.stop().await;
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_restart_leads_to_reregistration() {
    let dir = tempfile::tempdir().unwrap();
    let mut kubelet = KubeletStandin::start(dir.path()).await.unwrap();
    let (plugin, _) = start_plugin(dir.path(), backend(), settings("none", "envvar"), 60_000);
    kubelet
        .wait_for("first registration", WAIT, |v| {
            registered(v, "nvidia.com/gpu", 1)
        })
        .await
        .unwrap();
    kubelet.restart().await.unwrap();
    assert_eq!(kubelet.generation(), 2);
    let v = kubelet
        .wait_for("re-registration", WAIT, |v| {
            registered(v, "nvidia.com/gpu", 2)
        })
        .await
        .unwrap();
    assert!(dir.path().join("nvidia-gpu.sock").exists());
    assert_eq!(
        v.registrations
            .iter()
            .filter(|r| r.resource == "nvidia.com/gpu")
            .count(),
        2
    );
    // The new endpoint serves Allocate.
    let ids = kubelet.view().healthy("nvidia.com/gpu");
    kubelet.allocate("nvidia.com/gpu", &ids[..1]).await.unwrap();
    plugin.stop().await;
    kubelet.stop().await;
}

/// No probe tick during the test (the first one fires at start): what the
/// plugin does, it does on the directory's events.
const NO_TICKS: Duration = Duration::from_secs(3600);

fn inode(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map(|m| m.ino()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_restart_reregisters_on_the_socket_creation_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut kubelet = KubeletStandin::start(dir.path()).await.unwrap();
    let (plugin, _) = start_plugin_probing(
        dir.path(),
        backend(),
        settings("none", "envvar"),
        60_000,
        NO_TICKS,
    );
    kubelet
        .wait_for("first registration", WAIT, |v| {
            registered(v, "nvidia.com/gpu", 1)
        })
        .await
        .unwrap();
    // Twice: the new kubelet.sock often gets the inode number of the one
    // just removed, which an inode comparison would take for the old socket.
    for generation in [2, 3] {
        let before = inode(&kubelet.socket_path());
        kubelet.restart().await.unwrap();
        let v = kubelet
            .wait_for("re-registration", WAIT, |v| {
                registered(v, "nvidia.com/gpu", generation)
            })
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "{e} (kubelet.sock inode {before} -> {})",
                    inode(&kubelet.socket_path())
                )
            });
        assert!(dir.path().join("nvidia-gpu.sock").exists());
        // One registration per kubelet start: removals and the creation are
        // acted on together.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let count = kubelet
            .view()
            .registrations
            .iter()
            .filter(|r| r.resource == "nvidia.com/gpu")
            .count();
        assert_eq!(count as u64, generation, "{:?}", v.registrations);
    }
    let ids = kubelet.view().healthy("nvidia.com/gpu");
    kubelet.allocate("nvidia.com/gpu", &ids[..1]).await.unwrap();
    plugin.stop().await;
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_plugin_socket_is_served_again_and_registered() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = KubeletStandin::start(dir.path()).await.unwrap();
    let (plugin, _) = start_plugin_probing(
        dir.path(),
        backend(),
        settings("none", "envvar"),
        60_000,
        NO_TICKS,
    );
    kubelet
        .wait_for("first registration", WAIT, |v| {
            registered(v, "nvidia.com/gpu", 1)
        })
        .await
        .unwrap();
    let socket = dir.path().join("nvidia-gpu.sock");
    std::fs::remove_file(&socket).unwrap();
    let v = kubelet
        .wait_for("registration of the new socket", WAIT, |v| {
            v.registrations
                .iter()
                .filter(|r| r.resource == "nvidia.com/gpu")
                .count()
                == 2
                && !v.disconnected.iter().any(|r| r == "nvidia.com/gpu")
        })
        .await
        .unwrap();
    assert!(socket.exists());
    assert_eq!(v.devices["nvidia.com/gpu"].len(), 8);
    let ids = v.healthy("nvidia.com/gpu");
    kubelet.allocate("nvidia.com/gpu", &ids[..1]).await.unwrap();
    plugin.stop().await;
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_restart_is_seen_by_the_kubelet() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = KubeletStandin::start(dir.path()).await.unwrap();
    let (plugin, _) = start_plugin(dir.path(), backend(), settings("none", "envvar"), 60_000);
    kubelet
        .wait_for("first registration", WAIT, |v| {
            registered(v, "nvidia.com/gpu", 1)
        })
        .await
        .unwrap();
    plugin.stop().await;
    kubelet
        .wait_for("stream ends when the plugin stops", WAIT, |v| {
            v.disconnected.iter().any(|r| r == "nvidia.com/gpu")
        })
        .await
        .unwrap();
    let (plugin, _) = start_plugin(dir.path(), backend(), settings("none", "envvar"), 60_000);
    let v = kubelet
        .wait_for("second registration", WAIT, |v| {
            v.registrations
                .iter()
                .filter(|r| r.resource == "nvidia.com/gpu")
                .count()
                == 2
                && !v.disconnected.iter().any(|r| r == "nvidia.com/gpu")
        })
        .await
        .unwrap();
    assert_eq!(v.devices["nvidia.com/gpu"].len(), 8);
    let ids = v.healthy("nvidia.com/gpu");
    kubelet.allocate("nvidia.com/gpu", &ids[..2]).await.unwrap();
    plugin.stop().await;
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_slicing_advertises_replicas_and_allocates_the_physical_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = KubeletStandin::start(dir.path()).await.unwrap();
    let file = gpu_stack_core::deviceplugin::ConfigFile::parse(
        "ts.yaml",
        "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n",
    )
    .unwrap();
    let settings = Settings::resolve(Some(&file), &Overrides::default()).unwrap();
    let (plugin, node) = start_plugin(dir.path(), backend(), settings, 60_000);
    let v = kubelet
        .wait_for("shared resource", WAIT, |v| {
            registered(v, "nvidia.com/gpu.shared", 1)
        })
        .await
        .unwrap();
    assert_eq!(v.devices["nvidia.com/gpu.shared"].len(), 8 * 4);
    let reg = v
        .registrations
        .iter()
        .find(|r| r.resource == "nvidia.com/gpu.shared")
        .unwrap();
    assert_eq!(reg.endpoint, "nvidia-gpu.shared.sock");
    let u = &node.gpus[3].uuid;
    let r = kubelet
        .allocate(
            "nvidia.com/gpu.shared",
            &[format!("{u}::0"), format!("{u}::2")],
        )
        .await
        .unwrap();
    assert_eq!(
        &r.envs["NVIDIA_VISIBLE_DEVICES"], u,
        "replicas collapse to their GPU"
    );
    // distributed policy: two replicas land on two different GPUs
    let avail = kubelet.view().healthy("nvidia.com/gpu.shared");
    let got = kubelet
        .preferred("nvidia.com/gpu.shared", &avail, &[], 2)
        .await
        .unwrap();
    let gpus: std::collections::BTreeSet<&str> =
        got.iter().map(|i| i.split("::").next().unwrap()).collect();
    assert_eq!(gpus.len(), 2);
    plugin.stop().await;
    kubelet.stop().await;
}

// ---- any :authority on the unix sockets ----

mod raw_h2 {
    //! A bare HTTP/2 client that says what gRPC C-core says on a unix
    //! socket: the socket path as `:authority`, which no hyper or tonic
    //! client can send (their URIs cannot hold it).
    use std::collections::BTreeMap;
    use std::path::Path;
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::UnixStream;

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    /// What one stream got back.
    #[derive(Debug, Default)]
    pub struct Outcome {
        /// Every header field of every response header block.
        pub fields: Vec<(String, String)>,
        /// Bytes of response DATA.
        pub data: usize,
        /// The RST_STREAM error code, if the server reset the stream.
        pub reset: Option<u32>,
        done: bool,
    }

    impl Outcome {
        pub fn grpc_status(&self) -> Option<&str> {
            self.fields
                .iter()
                .find(|(n, _)| n == "grpc-status")
                .map(|(_, v)| v.as_str())
        }
    }

    fn int(v: usize, out: &mut Vec<u8>) {
        // 7-bit prefix, no Huffman: enough for these short strings.
        assert!(v < 127);
        out.push(v as u8);
    }

    fn string(s: &str, out: &mut Vec<u8>) {
        int(s.len(), out);
        out.extend_from_slice(s.as_bytes());
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8], out: &mut Vec<u8>) {
        let n = payload.len();
        out.extend_from_slice(&[(n >> 16) as u8, (n >> 8) as u8, n as u8, kind, flags]);
        out.extend_from_slice(&stream.to_be_bytes());
        out.extend_from_slice(payload);
    }

    /// Two unary calls of `method` with an empty message: stream 1 sends
    /// every field as a literal and indexes `:authority` and `:path`, as
    /// C-core does; stream 3 refers to them in the dynamic table.
    pub async fn two_calls(socket: &Path, authority: &str, method: &str) -> BTreeMap<u32, Outcome> {
        let mut first = vec![0x41]; // :authority, incremental indexing
        string(authority, &mut first);
        first.extend_from_slice(&[0x83, 0x86]); // :method POST, :scheme http
        first.push(0x44); // :path, incremental indexing
        string(method, &mut first);
        first.push(0x5f); // content-type (static 31), incremental indexing
        string("application/grpc", &mut first);
        first.push(0x40); // te: trailers, new name, incremental indexing
        string("te", &mut first);
        string("trailers", &mut first);
        // Dynamic table now: 62 te, 63 content-type, 64 :path, 65 :authority.
        let second = [0x80 | 65, 0x83, 0x86, 0x80 | 64, 0x80 | 63, 0x80 | 62];
        let empty_message = [0u8, 0, 0, 0, 0];
        let mut out = PREFACE.to_vec();
        frame(0x4, 0, 0, &[], &mut out);
        frame(0x1, 0x4, 1, &first, &mut out);
        frame(0x0, 0x1, 1, &empty_message, &mut out);
        frame(0x1, 0x4, 3, &second, &mut out);
        frame(0x0, 0x1, 3, &empty_message, &mut out);
        let mut conn = UnixStream::connect(socket).await.expect("connect");
        conn.write_all(&out).await.expect("write");

        let mut outcomes: BTreeMap<u32, Outcome> = BTreeMap::new();
        outcomes.insert(1, Outcome::default());
        outcomes.insert(3, Outcome::default());
        let mut decoder = loona_hpack::Decoder::new();
        let mut buf = Vec::new();
        let mut block: Vec<u8> = Vec::new();
        let read = async {
            while !outcomes.values().all(|o| o.done) {
                while buf.len() >= 9 {
                    let len = (usize::from(buf[0]) << 16)
                        | (usize::from(buf[1]) << 8)
                        | usize::from(buf[2]);
                    if buf.len() < 9 + len {
                        break;
                    }
                    let (kind, flags) = (buf[3], buf[4]);
                    let stream = u32::from_be_bytes([buf[5], buf[6], buf[7], buf[8]]) & 0x7fff_ffff;
                    let payload: Vec<u8> = buf[9..9 + len].to_vec();
                    buf.drain(..9 + len);
                    match kind {
                        0x4 if flags & 0x1 == 0 => {
                            let mut ack = Vec::new();
                            frame(0x4, 0x1, 0, &[], &mut ack);
                            conn.write_all(&ack).await.expect("ack");
                        }
                        0x1 | 0x9 => {
                            let mut p = payload.as_slice();
                            if kind == 0x1 && flags & 0x8 != 0 {
                                let pad = usize::from(p[0]);
                                p = &p[1..p.len() - pad];
                            }
                            if kind == 0x1 && flags & 0x20 != 0 {
                                p = &p[5..];
                            }
                            block.extend_from_slice(p);
                            if flags & 0x4 != 0 {
                                let fields = decoder.decode(&block).expect("server headers decode");
                                block.clear();
                                if let Some(o) = outcomes.get_mut(&stream) {
                                    o.fields.extend(fields.into_iter().map(|(n, v)| {
                                        (
                                            String::from_utf8_lossy(&n).into_owned(),
                                            String::from_utf8_lossy(&v).into_owned(),
                                        )
                                    }));
                                    o.done |= flags & 0x1 != 0;
                                }
                            }
                        }
                        0x0 => {
                            if let Some(o) = outcomes.get_mut(&stream) {
                                o.data += payload.len();
                                o.done |= flags & 0x1 != 0;
                            }
                        }
                        0x3 => {
                            if let Some(o) = outcomes.get_mut(&stream) {
                                o.reset = Some(u32::from_be_bytes([
                                    payload[0], payload[1], payload[2], payload[3],
                                ]));
                                o.done = true;
                            }
                        }
                        0x7 => panic!("GOAWAY from the server: {payload:?}"),
                        _ => {}
                    }
                }
                if outcomes.values().all(|o| o.done) {
                    break;
                }
                let mut chunk = [0u8; 4096];
                let n = conn.read(&mut chunk).await.expect("read");
                assert!(n > 0, "the server closed the connection: {outcomes:?}");
                buf.extend_from_slice(&chunk[..n]);
            }
        };
        tokio::time::timeout(Duration::from_secs(20), read)
            .await
            .expect("both calls answered in time");
        outcomes
    }
}

const SOCKET_PATH_AUTHORITY: &str = "/var/lib/kubelet/device-plugins/nvidia-gpu.sock";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_device_plugin_answers_a_client_sending_the_socket_path_as_authority() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = KubeletStandin::start(dir.path()).await.unwrap();
    let (plugin, _) = start_plugin(dir.path(), backend(), settings("none", "envvar"), 60_000);
    kubelet
        .wait_for("registration", WAIT, |v| registered(v, "nvidia.com/gpu", 1))
        .await
        .unwrap();
    let got = raw_h2::two_calls(
        &dir.path().join("nvidia-gpu.sock"),
        SOCKET_PATH_AUTHORITY,
        "/v1beta1.DevicePlugin/GetDevicePluginOptions",
    )
    .await;
    for (stream, o) in &got {
        assert_eq!(o.reset, None, "stream {stream} reset: {o:?}");
        assert_eq!(o.grpc_status(), Some("0"), "stream {stream}: {o:?}");
        assert!(o.data > 5, "stream {stream} got its options message: {o:?}");
    }
    // The kubelet stand-in's own socket accepts it too.
    let got = raw_h2::two_calls(
        &kubelet.socket_path(),
        "/var/lib/kubelet/device-plugins/kubelet.sock",
        "/v1beta1.Registration/Register",
    )
    .await;
    for o in got.values() {
        assert_eq!(o.reset, None, "{o:?}");
        // An empty request is refused by the handler, not by HTTP/2.
        assert_eq!(o.grpc_status(), Some("3"), "{o:?}");
    }
    plugin.stop().await;
    kubelet.stop().await;
}

#[derive(Clone, Copy)]
struct AcceptAll;

#[tonic::async_trait]
impl gpu_stack_k8s::kubelet::deviceplugin::api::registration_server::Registration for AcceptAll {
    async fn register(
        &self,
        _: tonic::Request<gpu_stack_k8s::kubelet::deviceplugin::api::RegisterRequest>,
    ) -> Result<tonic::Response<gpu_stack_k8s::kubelet::deviceplugin::api::Empty>, tonic::Status>
    {
        Ok(tonic::Response::new(
            gpu_stack_k8s::kubelet::deviceplugin::api::Empty {},
        ))
    }
}

/// Without the rewrite, the HTTP/2 server resets every such stream: this is
/// what the test above would see, and shows its client sends the path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_tonic_server_resets_a_socket_path_authority() {
    use gpu_stack_k8s::kubelet::deviceplugin::api::registration_server::RegistrationServer;
    use gpu_stack_k8s::kubelet::transport::unix_incoming;
    let dir = tempfile::tempdir().unwrap();
    let serve = |path: PathBuf, fixed: bool| {
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let router =
                tonic::transport::Server::builder().add_service(RegistrationServer::new(AcceptAll));
            let _ = if fixed {
                router.serve_with_incoming(unix_incoming(listener)).await
            } else {
                router
                    .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener))
                    .await
            };
        })
    };
    let plain = serve(dir.path().join("plain.sock"), false);
    let fixed = serve(dir.path().join("fixed.sock"), true);
    let method = "/v1beta1.Registration/Register";
    let got = raw_h2::two_calls(
        &dir.path().join("plain.sock"),
        SOCKET_PATH_AUTHORITY,
        method,
    )
    .await;
    for o in got.values() {
        assert_eq!(o.reset, Some(0x1), "PROTOCOL_ERROR: {o:?}");
    }
    let got = raw_h2::two_calls(
        &dir.path().join("fixed.sock"),
        SOCKET_PATH_AUTHORITY,
        method,
    )
    .await;
    for o in got.values() {
        assert_eq!(o.grpc_status(), Some("0"), "{o:?}");
    }
    let got = raw_h2::two_calls(&dir.path().join("plain.sock"), "localhost", method).await;
    for o in got.values() {
        assert_eq!(
            o.grpc_status(),
            Some("0"),
            "a valid authority works anyway: {o:?}"
        );
    }
    plain.abort();
    fixed.abort();
}
