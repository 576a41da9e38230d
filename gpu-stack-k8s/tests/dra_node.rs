//! The DRA plugin's node side over the real gRPC: a stand-in kubelet finds it
//! through plugin registration and calls NodePrepareResources and
//! NodeUnprepareResources on its unix socket; the GPUs are simulated H100s.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpu_stack_core::backend::GpuBackend;
use gpu_stack_core::cdi::HostFiles;
use gpu_stack_core::dra::prepare::{AllocatedDevice, Checkpoint, ClaimState};
use gpu_stack_k8s::dra::node::{AllocationSource, NodeDriver, NodeDriverConfig};
use gpu_stack_k8s::kubelet::dra::{ClaimRef, DraKubeletStandin, DraPlugin};
use gpu_stack_nvml::{SimNodeSpec, SimulatedBackend};

const DRIVER: &str = "gpu.nvidia.com";

#[derive(Clone, Default)]
struct Allocations(Arc<Mutex<BTreeMap<String, Vec<AllocatedDevice>>>>);

impl Allocations {
    fn set(&self, uid: &str, devices: &[&str]) {
        let devices = devices
            .iter()
            .enumerate()
            .map(|(i, d)| AllocatedDevice {
                request: format!("gpu{i}"),
                device: d.to_string(),
            })
            .collect();
        self.0.lock().unwrap().insert(uid.to_string(), devices);
    }
}

impl AllocationSource for Allocations {
    async fn allocated(&self, claim: &ClaimRef) -> Result<Vec<AllocatedDevice>, String> {
        self.0
            .lock()
            .unwrap()
            .get(&claim.uid)
            .cloned()
            .ok_or_else(|| format!("claim {} is not allocated", claim.uid))
    }

    async fn exists(&self, _namespace: &str, _name: &str, uid: &str) -> Result<bool, String> {
        Ok(self.0.lock().unwrap().contains_key(uid))
    }
}

fn claim(uid: &str) -> ClaimRef {
    ClaimRef {
        namespace: "default".into(),
        uid: uid.into(),
        name: format!("claim-{uid}"),
    }
}

fn config(dir: &Path) -> NodeDriverConfig {
    NodeDriverConfig {
        driver: DRIVER.into(),
        node: "node-a".into(),
        checkpoint: dir.join("state/checkpoint.json"),
        cdi_dir: dir.join("cdi"),
        host: HostFiles::default(),
        mig_minors: None,
        reset_gpus: true,
    }
}

fn layout(backend: &dyn GpuBackend, gpu: u32) -> Vec<(String, u32)> {
    let mut l: Vec<(String, u32)> = backend
        .mig_state(gpu)
        .unwrap()
        .gpu_instances
        .iter()
        .map(|g| (g.profile_name.clone(), g.placement.start))
        .collect();
    l.sort();
    l
}

struct Running {
    standin: DraKubeletStandin,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

async fn serve(dir: &Path, driver: NodeDriver<Allocations>) -> Running {
    let plugin = DraPlugin::new(DRIVER, dir.join("plugins"), dir.join("registry")).unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        plugin
            .serve(driver, async {
                let _ = rx.await;
            })
            .await
            .unwrap();
    });
    let standin = DraKubeletStandin::start(&dir.join("registry"))
        .await
        .unwrap();
    standin
        .wait_for("registered", Duration::from_secs(20), |v| {
            v.endpoint(DRIVER).is_some()
        })
        .await
        .unwrap();
    Running {
        standin,
        stop: Some(tx),
        task,
    }
}

impl Running {
    async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let _ = self.task.await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_become_mig_instances_at_their_placements_and_go_away_again() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = SimNodeSpec::uniform("node-a", "H100-SXM5-80GB", 2);
    spec.mig_change_needs_reset = true;
    let sim = Arc::new(SimulatedBackend::new(&spec).unwrap());
    let backend: Arc<dyn GpuBackend> = sim.clone();
    let alloc = Allocations::default();
    let driver = NodeDriver::start(config(dir.path()), backend.clone(), alloc.clone())
        .await
        .unwrap();
    let devices = driver.published().await;
    assert_eq!(devices.len(), 2);
    assert_eq!(
        devices[0].devices.len(),
        26,
        "the whole GPU and 25 placements"
    );
    let run = serve(dir.path(), driver).await;

    // One 3g.40gb at slice 4: MIG mode goes on (with the reset the simulated
    // H100 needs) and the instance is created exactly there.
    alloc.set("a", &["gpu-0-mig-3g40gb-9-4"]);
    let out = run.standin.prepare(DRIVER, &[claim("a")]).await.unwrap();
    let prepared = out["a"].as_ref().unwrap();
    assert_eq!(prepared[0].device_name, "gpu-0-mig-3g40gb-9-4");
    assert_eq!(prepared[0].pool_name, "node-a");
    assert_eq!(
        prepared[0].cdi_device_ids,
        ["k8s.gpu.nvidia.com/claim=a-gpu-0-mig-3g40gb-9-4"]
    );
    assert_eq!(layout(backend.as_ref(), 0), [("3g.40gb".to_string(), 4)]);
    let spec_file = dir.path().join("cdi/gpu.nvidia.com-claim_a.json");
    let cdi = std::fs::read_to_string(&spec_file).unwrap();
    let mig_uuid = &backend.mig_state(0).unwrap().gpu_instances[0].compute_instances[0].uuid;
    assert!(
        cdi.contains(&format!("NVIDIA_VISIBLE_DEVICES={mig_uuid}")),
        "{cdi}"
    );

    // The kubelet retries: the same answer, nothing created twice.
    let again = run.standin.prepare(DRIVER, &[claim("a")]).await.unwrap();
    assert_eq!(again["a"].as_ref().unwrap(), prepared);
    assert_eq!(layout(backend.as_ref(), 0).len(), 1);

    // Two 1g.10gb on the same GPU in one claim.
    alloc.set("b", &["gpu-0-mig-1g10gb-19-0", "gpu-0-mig-1g10gb-19-1"]);
    let out = run.standin.prepare(DRIVER, &[claim("b")]).await.unwrap();
    assert_eq!(out["b"].as_ref().unwrap().len(), 2);
    assert_eq!(
        layout(backend.as_ref(), 0),
        [
            ("1g.10gb".to_string(), 0),
            ("1g.10gb".to_string(), 1),
            ("3g.40gb".to_string(), 4)
        ]
    );

    // An allocation that overlaps what the GPU holds is refused with the
    // validator's reason, and nothing changes.
    alloc.set("c", &["gpu-0-mig-1g10gb-19-5"]);
    let out = run.standin.prepare(DRIVER, &[claim("c")]).await.unwrap();
    let err = out["c"].as_ref().unwrap_err();
    assert!(err.contains("overlap"), "{err}");
    assert_eq!(layout(backend.as_ref(), 0).len(), 3);

    // A whole GPU: MIG stays off on GPU 1.
    alloc.set("d", &["gpu-1"]);
    let out = run.standin.prepare(DRIVER, &[claim("d")]).await.unwrap();
    assert_eq!(out["d"].as_ref().unwrap()[0].device_name, "gpu-1");
    assert!(!backend.mig_mode(1).unwrap().current);

    // Unprepare destroys the claim's instance and its CDI spec.
    let out = run.standin.unprepare(DRIVER, &[claim("a")]).await.unwrap();
    assert!(out["a"].is_ok());
    assert_eq!(layout(backend.as_ref(), 0).len(), 2);
    assert!(!spec_file.exists());
    // Unknown claims unprepare fine (the kubelet may retry).
    let out = run
        .standin
        .unprepare(DRIVER, &[claim("zzz")])
        .await
        .unwrap();
    assert!(out["zzz"].is_ok());

    // Prepare latency on simulated GPUs (a figure, not an assertion).
    let mut samples = Vec::new();
    for i in 0..40 {
        let uid = format!("lat{i}");
        alloc.set(&uid, &["gpu-0-mig-1g10gb-19-2"]);
        let t = Instant::now();
        let out = run.standin.prepare(DRIVER, &[claim(&uid)]).await.unwrap();
        samples.push(t.elapsed());
        assert!(out[&uid].is_ok(), "{:?}", out[&uid]);
        let out = run.standin.unprepare(DRIVER, &[claim(&uid)]).await.unwrap();
        assert!(out[&uid].is_ok());
    }
    samples.sort();
    println!(
        "figure: prepare latency over gRPC on a simulated H100 (1g.10gb): p50 {:?}, p99 {:?}",
        samples[samples.len() / 2],
        samples[samples.len() * 99 / 100]
    );
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_rolls_back_an_interrupted_prepare_and_keeps_prepared_claims() {
    let dir = tempfile::tempdir().unwrap();
    let spec = SimNodeSpec::uniform("node-b", "H100-SXM5-80GB", 1);
    let backend: Arc<dyn GpuBackend> = Arc::new(SimulatedBackend::new(&spec).unwrap());
    let alloc = Allocations::default();
    let driver = NodeDriver::start(config(dir.path()), backend.clone(), alloc.clone())
        .await
        .unwrap();
    let run = serve(dir.path(), driver).await;
    alloc.set("kept", &["gpu-0-mig-2g20gb-14-0"]);
    alloc.set("cut", &["gpu-0-mig-1g10gb-19-6"]);
    for uid in ["kept", "cut"] {
        let out = run.standin.prepare(DRIVER, &[claim(uid)]).await.unwrap();
        assert!(out[uid].is_ok(), "{:?}", out[uid]);
    }
    run.stop().await;

    // As if the plugin died after creating "cut"'s instance and before
    // recording it as prepared.
    let path = dir.path().join("state/checkpoint.json");
    let mut cp = Checkpoint::decode(&std::fs::read(&path).unwrap()).unwrap();
    cp.claims.get_mut("cut").unwrap().state = ClaimState::Preparing;
    std::fs::write(&path, cp.encode()).unwrap();

    let driver = NodeDriver::start(config(dir.path()), backend.clone(), alloc.clone())
        .await
        .unwrap();
    assert_eq!(
        layout(backend.as_ref(), 0),
        [("2g.20gb".to_string(), 0)],
        "the interrupted claim's instance is destroyed, the prepared one kept"
    );
    let cp = driver.checkpoint().await;
    assert!(cp.claims.contains_key("kept") && !cp.claims.contains_key("cut"));
    // The kubelet prepares "cut" again: created once more, exactly there.
    let run = serve(dir.path(), driver).await;
    let out = run.standin.prepare(DRIVER, &[claim("cut")]).await.unwrap();
    assert!(out["cut"].is_ok(), "{:?}", out["cut"]);
    assert_eq!(
        layout(backend.as_ref(), 0),
        [("1g.10gb".to_string(), 6), ("2g.20gb".to_string(), 0)]
    );
    run.stop().await;
}

#[test]
fn a_node_the_mig_manager_manages_is_refused_with_how_to_fix_it() {
    use gpu_stack_k8s::dra::node::mig_manager_owns;
    let mut labels = BTreeMap::from([(
        "nvidia.com/mig.config".to_string(),
        "all-1g.10gb".to_string(),
    )]);
    let msg = mig_manager_owns("n1", &labels).unwrap();
    assert!(
        msg.contains("nvidia.com/mig.config=all-1g.10gb") && msg.contains("kubectl label node n1")
    );
    labels.insert("nvidia.com/gpu.deploy.mig-manager".into(), "false".into());
    assert_eq!(mig_manager_owns("n1", &labels), None);
    assert_eq!(mig_manager_owns("n1", &BTreeMap::new()), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_deleted_while_the_plugin_was_down_gives_its_instance_back() {
    use gpu_stack_k8s::kubelet::dra::DraDriver;
    let dir = tempfile::tempdir().unwrap();
    let spec = SimNodeSpec::uniform("node-c", "H100-SXM5-80GB", 1);
    let backend: Arc<dyn GpuBackend> = Arc::new(SimulatedBackend::new(&spec).unwrap());
    let alloc = Allocations::default();
    let driver = NodeDriver::start(config(dir.path()), backend.clone(), alloc.clone())
        .await
        .unwrap();
    alloc.set("kept", &["gpu-0-mig-3g40gb-9-4"]);
    alloc.set("gone", &["gpu-0-mig-1g10gb-19-0"]);
    let out = driver.prepare(vec![claim("kept"), claim("gone")]).await;
    assert!(out.values().all(Result::is_ok), "{out:?}");
    assert_eq!(layout(backend.as_ref(), 0).len(), 2);
    // The plugin goes down; meanwhile one claim is deleted, so no
    // unprepare ever comes for it.
    drop(driver);
    alloc.0.lock().unwrap().remove("gone");
    let driver = NodeDriver::start(config(dir.path()), backend.clone(), alloc.clone())
        .await
        .unwrap();
    assert_eq!(driver.release_orphans().await, ["gone"]);
    assert_eq!(layout(backend.as_ref(), 0), [("3g.40gb".to_string(), 4)]);
    assert!(
        !dir.path()
            .join("cdi/gpu.nvidia.com-claim_gone.json")
            .exists()
    );
    assert!(
        dir.path()
            .join("cdi/gpu.nvidia.com-claim_kept.json")
            .exists()
    );
    let checkpoint = driver.checkpoint().await;
    assert_eq!(checkpoint.claims.keys().collect::<Vec<_>>(), ["kept"]);
    assert!(
        driver.release_orphans().await.is_empty(),
        "nothing left to release"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_checkpoint_is_refused_before_it_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let spec = SimNodeSpec::uniform("node-c", "H100-SXM5-80GB", 1);
    let backend: Arc<dyn GpuBackend> = Arc::new(SimulatedBackend::new(&spec).unwrap());
    let path = dir.path().join("state/checkpoint.json");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    // Sparse: its size is past the bound without the disk to match.
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(1 << 40).unwrap();
    let Err(err) = NodeDriver::start(config(dir.path()), backend, Allocations::default()).await
    else {
        panic!("a 1 TiB checkpoint was accepted");
    };
    let message = err.to_string();
    assert!(
        message.contains("1099511627776 bytes") && message.contains("move it aside"),
        "{message}"
    );
}
