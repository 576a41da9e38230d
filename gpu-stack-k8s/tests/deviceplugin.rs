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
use gpu_stack_k8s::kubelet_standin::{KubeletStandin, KubeletView};
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
