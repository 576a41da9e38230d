//! Device plugin figures over real unix sockets, with the kubelet stand-in and
//! simulated GPUs (DGX A100 fleet):
//! - Allocate latency p50/p99 over 10,000 calls (one persistent connection, as
//!   the kubelet keeps), plus the pure in-process decision for comparison;
//! - time from an Xid injected into the backend to the Unhealthy update the
//!   kubelet receives;
//! - time from kubelet socket re-creation (kubelet restart) to re-registration.
//!
//! Run: `cargo bench -p gpu-stack-k8s --bench deviceplugin_figures`.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_stack_core::backend::{Fault, FaultSpec, GpuBackend};
use gpu_stack_core::deviceplugin::{
    HealthPolicy, Overrides, Settings, allocate_container, node_resources,
};
use gpu_stack_k8s::deviceplugin::health::{BackendProbe, spawn_backend_health};
use gpu_stack_k8s::deviceplugin::node::read_node_gpus;
use gpu_stack_k8s::deviceplugin::{DevicePlugins, PluginOptions};
use gpu_stack_k8s::kubelet::deviceplugin::api;
use gpu_stack_k8s::kubelet::deviceplugin::standin::KubeletStandin;
use gpu_stack_nvml::{SimNodeSpec, SimulatedBackend};

const CALLS: usize = 10_000;
const SAMPLES: usize = 20;
const WAIT: Duration = Duration::from_secs(20);

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn report(name: &str, mut v: Vec<Duration>) {
    v.sort();
    println!(
        "{name}: n={} p50={:?} p99={:?} max={:?}",
        v.len(),
        pct(&v, 0.50),
        pct(&v, 0.99),
        v.last().copied().unwrap_or_default()
    );
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(run());
}

async fn run() {
    let fleet = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/fleets/dgx-a100.yaml");
    let spec = SimNodeSpec::from_fleet_file(&fleet, Some("dgx-a100-0")).expect("fleet");
    let backend = Arc::new(SimulatedBackend::new(&spec).expect("backend"));
    let dyn_backend: Arc<dyn GpuBackend> = backend.clone();
    let settings = Settings::resolve(
        None,
        &Overrides {
            mig_strategy: Some("mixed".into()),
            ..Overrides::default()
        },
    )
    .expect("settings");
    let node = read_node_gpus(dyn_backend.as_ref(), None).expect("inventory");
    let resources = node_resources(&node, &settings).expect("resources");

    // Pure decision cost.
    let gpu = resources
        .iter()
        .find(|r| r.name == "nvidia.com/gpu")
        .expect("gpu resource")
        .clone();
    let ids: Vec<String> = gpu.devices.iter().take(2).map(|d| d.id.clone()).collect();
    let mut pure = Vec::with_capacity(CALLS);
    for _ in 0..CALLS {
        let t = Instant::now();
        std::hint::black_box(allocate_container(&gpu, &settings, &ids).expect("allocate"));
        pure.push(t.elapsed());
    }
    report("allocate_container (in-process)", pure);

    let dir = tempfile::tempdir().expect("tempdir");
    let mut kubelet = KubeletStandin::start(dir.path()).await.expect("kubelet");
    let options = PluginOptions {
        kubelet_dir: dir.path().to_path_buf(),
        register: true,
        health: HealthPolicy {
            // Long enough that an Unhealthy state outlives a busy kubelet's
            // next ListAndWatch read (with 0 it could recover unseen), short
            // enough that each GPU is healthy again when its turn comes.
            recovery_quiet_ms: 500,
            ..HealthPolicy::default()
        },
        probe_interval: Duration::from_millis(50),
    };
    let plugins = DevicePlugins::new(resources.clone(), settings, Default::default(), options)
        .with_probe(Arc::new(BackendProbe::new(dyn_backend.clone(), &resources)));
    let pump = spawn_backend_health(dyn_backend.clone(), &resources, plugins.health_sender());
    let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(plugins.run(async move {
        let _ = stop_rx.await;
    }));
    kubelet
        .wait_for("registration", WAIT, |v| {
            v.devices.contains_key("nvidia.com/gpu")
        })
        .await
        .expect("registered");

    // Allocate over the socket.
    let mut client = kubelet
        .plugin_client("nvidia.com/gpu")
        .await
        .expect("client");
    let mut lat = Vec::with_capacity(CALLS);
    for _ in 0..CALLS {
        let req = api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest {
                devices_ids: ids.clone(),
            }],
        };
        let t = Instant::now();
        client.allocate(req).await.expect("allocate");
        lat.push(t.elapsed());
    }
    report("Allocate over unix socket", lat);

    // Xid -> Unhealthy seen by the kubelet.
    let mut xid = Vec::new();
    for i in 0..SAMPLES {
        let g = &node.gpus[i % 6];
        let uuid = g.uuid.clone();
        let healthy = |v: &gpu_stack_k8s::kubelet::deviceplugin::standin::KubeletView,
                       want: &str| {
            v.devices
                .get("nvidia.com/gpu")
                .is_some_and(|d| d.iter().any(|d| d.id == uuid && d.health == want))
        };
        kubelet
            .wait_for("healthy", WAIT, |v| healthy(v, "Healthy"))
            .await
            .expect("healthy before");
        let t = Instant::now();
        backend
            .inject(FaultSpec {
                gpu: Some(g.index),
                at_ms: 0,
                fault: Fault::Xid {
                    xid: 48,
                    gpu_instance: None,
                },
            })
            .expect("inject");
        kubelet
            .wait_for("unhealthy", WAIT, |v| healthy(v, "Unhealthy"))
            .await
            .expect("unhealthy");
        xid.push(t.elapsed());
    }
    report("Xid injected -> Unhealthy in ListAndWatch", xid);

    // Kubelet restart -> re-registration.
    let mut rereg = Vec::new();
    for _ in 0..SAMPLES {
        let t = Instant::now();
        kubelet.restart().await.expect("restart");
        let g = kubelet.generation();
        kubelet
            .wait_for("re-registration", WAIT, |v| {
                [
                    "nvidia.com/gpu",
                    "nvidia.com/mig-1g.5gb",
                    "nvidia.com/mig-2g.10gb",
                    "nvidia.com/mig-3g.20gb",
                ]
                .iter()
                .all(|r| {
                    v.registrations
                        .iter()
                        .any(|x| &x.resource == r && x.generation == g)
                })
            })
            .await
            .expect("re-registered");
        rereg.push(t.elapsed());
    }
    report(
        "kubelet.sock re-created -> all 4 resources re-registered",
        rereg,
    );

    let _ = stop.send(());
    let _ = tokio::time::timeout(WAIT, task).await;
    pump.stop();
    kubelet.stop().await;
}
