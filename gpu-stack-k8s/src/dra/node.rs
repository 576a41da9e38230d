//! The node side of the DRA driver: prepares a claim by creating the MIG
//! instances at the placements the scheduler allocated (or handing out a
//! whole GPU), writes the claim's CDI spec, and records it in a checkpoint
//! written atomically, so a restart neither leaks an instance nor creates one
//! twice; unprepare destroys what prepare made.
//!
//! The decisions are core's ([`gpu_stack_core::dra::prepare`]); GPU changes
//! go through the MIG manager's apply path
//! ([`gpu_stack_nvml::migapply::apply_targets`]), with its MIG mode and reset
//! rules.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use gpu_stack_core::backend::{GpuBackend, SystemInfo};
use gpu_stack_core::cdi::{HostFiles, to_json};
use gpu_stack_core::dra::cdi::{ClaimCdiDevice, claim_spec, qualified_id};
use gpu_stack_core::dra::devices::{GpuDevices, PublishGpu, gpu_devices};
use gpu_stack_core::dra::prepare::{
    AllocatedDevice, Checkpoint, CheckpointError, ClaimEntry, ClaimState, MAX_CHECKPOINT_BYTES,
    PrepareGpu, plan_claim, pre_r510,
};
use gpu_stack_core::mig::{PlacedInstance, ValidateOptions};
use gpu_stack_nvml::fsutil::{AtomicWriteError, write_atomic};
use gpu_stack_nvml::migapply::{
    ApplyOptions, ApplyOutcome, GpuSnapshot, LayoutTargets, NoProcesses, apply_targets, observe,
};
use tokio::sync::Mutex;

use crate::kubelet::dra::{ClaimRef, DraDriver, PrepareResults, PreparedDevice, UnprepareResults};

/// Where the devices a claim was allocated come from (the API server's
/// ResourceClaim status in a cluster).
pub trait AllocationSource: Send + Sync + 'static {
    /// The devices of this driver and pool allocated to `claim`, or why they
    /// cannot be read.
    fn allocated(
        &self,
        claim: &ClaimRef,
    ) -> impl Future<Output = Result<Vec<AllocatedDevice>, String>> + Send;

    /// Whether the claim `namespace/name` still exists with `uid` (`false`
    /// when it is gone or was created again under another uid), or why
    /// that cannot be read.
    fn exists(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> impl Future<Output = Result<bool, String>> + Send;
}

/// The plugin's settings.
#[derive(Debug, Clone)]
pub struct NodeDriverConfig {
    /// Driver name (`gpu.nvidia.com`).
    pub driver: String,
    /// Node name: the pool name.
    pub node: String,
    /// Checkpoint file.
    pub checkpoint: PathBuf,
    /// Directory the claim CDI specs go to.
    pub cdi_dir: PathBuf,
    /// Host files the CDI specs mount.
    pub host: HostFiles,
    /// MIG capability minors file (`/proc/driver/nvidia-caps/mig-minors`).
    pub mig_minors: Option<PathBuf>,
    /// Reset a GPU when a MIG mode change waits for one.
    pub reset_gpus: bool,
}

/// Errors starting the driver.
#[derive(Debug, thiserror::Error)]
pub enum NodeDriverError {
    /// The checkpoint cannot be read.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// Its path.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The GPUs cannot be read or changed.
    #[error("GPUs: {0}")]
    Gpus(String),
}

struct State {
    checkpoint: Checkpoint,
    published: Vec<GpuDevices>,
}

/// The DRA driver of one node.
pub struct NodeDriver<A> {
    config: NodeDriverConfig,
    backend: Arc<dyn GpuBackend>,
    allocations: A,
    state: Mutex<State>,
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| format!("GPU task failed: {e}"))?
}

fn observe_gpus(backend: &Arc<dyn GpuBackend>) -> Result<Vec<GpuSnapshot>, String> {
    observe(backend.as_ref(), &NoProcesses).map_err(|e| e.to_string())
}

fn apply_layouts(
    backend: &Arc<dyn GpuBackend>,
    targets: &LayoutTargets,
    reset_gpus: bool,
) -> Result<(), String> {
    let options = ApplyOptions {
        reset_gpus,
        ..ApplyOptions::default()
    };
    let report = apply_targets(backend.as_ref(), targets, options, &NoProcesses, &mut |e| {
        tracing::debug!(event = ?e, "MIG change");
    })
    .map_err(|e| e.to_string())?;
    match report.outcome {
        ApplyOutcome::Converged => Ok(()),
        ApplyOutcome::NeedsReboot { gpus } => Err(format!(
            "GPUs {gpus:?} need a reset for their MIG mode change and the reset was refused; drain the node and reset the GPUs or reboot it"
        )),
    }
}

/// Instances on a GPU that no claim of the checkpoint owns.
fn foreign(snapshot: &GpuSnapshot, checkpoint: &Checkpoint) -> Vec<PlacedInstance> {
    let owned = checkpoint.owned_on(&snapshot.info.uuid);
    snapshot
        .layout
        .iter()
        .filter(|i| {
            !owned
                .iter()
                .any(|(_, m)| m.start == i.start && m.profile == i.profile.to_string())
        })
        .cloned()
        .collect()
}

fn publish_from(
    snapshots: &[GpuSnapshot],
    system: &SystemInfo,
    checkpoint: &Checkpoint,
) -> Vec<GpuDevices> {
    snapshots
        .iter()
        .map(|s| {
            let foreign = foreign(s, checkpoint);
            gpu_devices(
                &PublishGpu {
                    info: &s.info,
                    geometry: s.geometry(),
                    foreign: &foreign,
                },
                system,
            )
        })
        .collect()
}

/// Reads a file of at most `max` bytes; a larger one is refused (as
/// [`CheckpointError::TooLarge`]) before anything is allocated for it.
fn read_bounded(path: &std::path::Path, max: usize) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let file = std::fs::File::open(path)?;
    let len = usize::try_from(file.metadata()?.len()).unwrap_or(usize::MAX);
    if len > max {
        return Err(std::io::Error::other(CheckpointError::TooLarge(len)));
    }
    let mut bytes = Vec::with_capacity(len);
    // A file that grew since is cut one byte past the bound: decoding
    // refuses it.
    file.take(max as u64 + 1).read_to_end(&mut bytes)?;
    Ok(bytes)
}

impl<A: AllocationSource> NodeDriver<A> {
    /// Starts the driver: reads the checkpoint, rolls back claims a restart
    /// interrupted while preparing (destroying any instance they may have
    /// created), and computes the devices to publish.
    pub async fn start(
        config: NodeDriverConfig,
        backend: Arc<dyn GpuBackend>,
        allocations: A,
    ) -> Result<NodeDriver<A>, NodeDriverError> {
        let mut checkpoint = match read_bounded(&config.checkpoint, MAX_CHECKPOINT_BYTES) {
            Ok(bytes) => Checkpoint::decode(&bytes).map_err(|e| NodeDriverError::Checkpoint {
                path: config.checkpoint.clone(),
                message: e.to_string(),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Checkpoint::new(),
            Err(e) => {
                return Err(NodeDriverError::Checkpoint {
                    path: config.checkpoint.clone(),
                    message: e.to_string(),
                });
            }
        };
        let interrupted: Vec<String> = checkpoint
            .claims
            .iter()
            .filter(|(_, c)| c.state == ClaimState::Preparing)
            .map(|(uid, _)| uid.clone())
            .collect();
        let b = backend.clone();
        let snapshots = blocking(move || observe_gpus(&b))
            .await
            .map_err(NodeDriverError::Gpus)?;
        if !interrupted.is_empty() {
            let targets = release_targets(&snapshots, &checkpoint, &interrupted);
            let (b, reset) = (backend.clone(), config.reset_gpus);
            blocking(move || apply_layouts(&b, &targets, reset))
                .await
                .map_err(NodeDriverError::Gpus)?;
            for uid in &interrupted {
                tracing::warn!(claim = %uid, "rolled back a claim whose preparation a restart interrupted; the kubelet prepares it again");
                checkpoint.claims.remove(uid);
            }
            save(&config.checkpoint, &checkpoint).map_err(|m| NodeDriverError::Checkpoint {
                path: config.checkpoint.clone(),
                message: m,
            })?;
        }
        let driver = NodeDriver {
            config,
            backend,
            allocations,
            state: Mutex::new(State {
                checkpoint,
                published: Vec::new(),
            }),
        };
        driver.refresh().await.map_err(NodeDriverError::Gpus)?;
        Ok(driver)
    }

    /// Reads the GPUs again and returns the devices to publish (instances a
    /// person or another agent made since are taken out of the counters).
    pub async fn refresh(&self) -> Result<Vec<GpuDevices>, String> {
        let mut state = self.state.lock().await;
        let b = self.backend.clone();
        let (snapshots, system) = blocking(move || {
            let system = b.system_info().map_err(|e| e.to_string())?;
            Ok((observe_gpus(&b)?, system))
        })
        .await?;
        state.published = publish_from(&snapshots, &system, &state.checkpoint);
        Ok(state.published.clone())
    }

    /// The devices last computed for publishing.
    pub async fn published(&self) -> Vec<GpuDevices> {
        self.state.lock().await.published.clone()
    }

    /// Unprepares the checkpoint's claims the API server no longer has: a
    /// claim deleted while the kubelet could not tell the plugin (it was
    /// down, or the node was), or deleted and created again under another
    /// uid, would otherwise keep its MIG instances and block those
    /// placements for good. A claim whose state cannot be read stays.
    /// Returns the uids released.
    pub async fn release_orphans(&self) -> Vec<String> {
        let prepared: Vec<(String, String, String)> = {
            let state = self.state.lock().await;
            state
                .checkpoint
                .claims
                .iter()
                .filter(|(_, e)| e.state == ClaimState::Prepared)
                .map(|(uid, e)| (uid.clone(), e.namespace.clone(), e.name.clone()))
                .collect()
        };
        let mut gone = Vec::new();
        for (uid, namespace, name) in prepared {
            match self.allocations.exists(&namespace, &name, &uid).await {
                Ok(true) => {}
                Ok(false) => gone.push(uid),
                Err(e) => tracing::debug!(claim = %uid, error = %e, "claim not checked"),
            }
        }
        let mut released = Vec::new();
        let mut state = self.state.lock().await;
        for uid in gone {
            match self.unprepare_one(&mut state, &uid).await {
                Ok(()) => {
                    tracing::info!(claim = %uid, "released a claim the API server no longer has");
                    released.push(uid);
                }
                Err(e) => {
                    tracing::warn!(claim = %uid, error = %e, "releasing a deleted claim failed; retried on the next rescan")
                }
            }
        }
        released
    }

    /// The claims in the checkpoint.
    pub async fn checkpoint(&self) -> Checkpoint {
        self.state.lock().await.checkpoint.clone()
    }

    async fn prepare_one(
        &self,
        state: &mut State,
        claim: &ClaimRef,
    ) -> Result<Vec<PreparedDevice>, String> {
        if let Some(entry) = state.checkpoint.claims.get(&claim.uid)
            && entry.state == ClaimState::Prepared
        {
            return Ok(self.wire_devices(entry));
        }
        state
            .checkpoint
            .room_for(&claim.uid)
            .map_err(|e| e.to_string())?;
        let allocated = self.allocations.allocated(claim).await?;
        let b = self.backend.clone();
        let (snapshots, system) = blocking(move || {
            let system = b.system_info().map_err(|e| e.to_string())?;
            Ok((observe_gpus(&b)?, system))
        })
        .await?;
        let gpus: Vec<PrepareGpu<'_>> = state
            .published
            .iter()
            .filter_map(|p| {
                let snap = snapshots.iter().find(|s| s.info.uuid == p.uuid)?;
                Some(PrepareGpu {
                    published: p,
                    geometry: snap.geometry(),
                    current: snap.layout.clone(),
                })
            })
            .collect();
        let options = ValidateOptions {
            pre_r510_driver: pre_r510(&system.driver_version),
        };
        let plan = plan_claim(&gpus, &state.checkpoint, &claim.uid, &allocated, options)
            .map_err(|e| e.to_string())?;
        // Recorded before any change: a restart from here on rolls it back.
        state.checkpoint.claims.insert(
            claim.uid.clone(),
            ClaimEntry {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                state: ClaimState::Preparing,
                devices: plan.devices.clone(),
            },
        );
        save(&self.config.checkpoint, &state.checkpoint)?;
        match self
            .create(claim, &plan.targets, &snapshots, &plan.devices)
            .await
        {
            Ok(entry) => {
                let wire = self.wire_devices(&entry);
                state.checkpoint.claims.insert(claim.uid.clone(), entry);
                save(&self.config.checkpoint, &state.checkpoint)?;
                Ok(wire)
            }
            Err(message) => {
                // Put the GPUs back as they were, then forget the claim.
                let targets = release_targets(
                    &snapshots,
                    &state.checkpoint,
                    std::slice::from_ref(&claim.uid),
                );
                let (b, reset) = (self.backend.clone(), self.config.reset_gpus);
                if let Err(e) = blocking(move || apply_layouts(&b, &targets, reset)).await {
                    tracing::error!(claim = %claim.uid, error = %e, "rolling back a failed prepare failed; a restart retries it");
                    return Err(message);
                }
                state.checkpoint.claims.remove(&claim.uid);
                save(&self.config.checkpoint, &state.checkpoint)?;
                Err(message)
            }
        }
    }

    async fn create(
        &self,
        claim: &ClaimRef,
        targets: &LayoutTargets,
        before: &[GpuSnapshot],
        devices: &[gpu_stack_core::dra::prepare::PreparedDevice],
    ) -> Result<ClaimEntry, String> {
        let (b, reset, t) = (
            self.backend.clone(),
            self.config.reset_gpus,
            targets.clone(),
        );
        blocking(move || apply_layouts(&b, &t, reset)).await?;
        let b = self.backend.clone();
        let minors = self.config.mig_minors.clone();
        let (after, node) = blocking(move || {
            let after = observe_gpus(&b)?;
            let node = crate::deviceplugin::node::read_node_gpus(b.as_ref(), minors.as_deref())
                .map_err(|e| e.to_string())?;
            Ok((after, node))
        })
        .await?;
        let mut entry_devices = Vec::new();
        let mut cdi = Vec::new();
        for d in devices {
            let snap = after
                .iter()
                .find(|s| s.info.uuid == d.gpu_uuid)
                .or_else(|| before.iter().find(|s| s.info.uuid == d.gpu_uuid))
                .ok_or_else(|| format!("GPU {} ({}) is gone", d.gpu, d.gpu_uuid))?;
            let mut d = d.clone();
            let (uuid, caps) = match &mut d.mig {
                None => (d.gpu_uuid.clone(), Vec::new()),
                Some(m) => {
                    let gi = snap
                        .mig
                        .iter()
                        .flat_map(|s| s.gpu_instances.iter())
                        .find(|g| g.profile_id == m.profile_id && g.placement.start == m.start)
                        .ok_or_else(|| {
                            format!(
                                "GPU {}: no {} instance at slice {} after creating it",
                                d.gpu, m.profile, m.start
                            )
                        })?;
                    let ci = gi.compute_instances.first().ok_or_else(|| {
                        format!(
                            "GPU {}: the {} instance has no compute instance",
                            d.gpu, m.profile
                        )
                    })?;
                    m.uuid = Some(ci.uuid.clone());
                    let caps = node
                        .gpus
                        .iter()
                        .flat_map(|g| g.mig_devices.iter())
                        .find(|md| md.uuid == ci.uuid)
                        .map(|md| {
                            [md.gi_cap_minor, md.ci_cap_minor]
                                .into_iter()
                                .flatten()
                                .collect()
                        })
                        .unwrap_or_default();
                    (ci.uuid.clone(), caps)
                }
            };
            d.cdi_devices = vec![qualified_id(&self.config.driver, &claim.uid, &d.device)];
            cdi.push(ClaimCdiDevice {
                device: d.device.clone(),
                minor: snap.info.minor_number,
                uuid,
                caps,
            });
            entry_devices.push(d);
        }
        let spec = claim_spec(&self.config.driver, &claim.uid, &cdi, &self.config.host);
        let text = to_json(&spec).map_err(|e| format!("CDI spec: {e}"))?;
        std::fs::create_dir_all(&self.config.cdi_dir)
            .map_err(|e| format!("CDI directory {}: {e}", self.config.cdi_dir.display()))?;
        save_bytes(&self.spec_path(&claim.uid), text.as_bytes())?;
        Ok(ClaimEntry {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            state: ClaimState::Prepared,
            devices: entry_devices,
        })
    }

    fn spec_path(&self, uid: &str) -> PathBuf {
        self.config
            .cdi_dir
            .join(format!("{}-claim_{uid}.json", self.config.driver))
    }

    fn wire_devices(&self, entry: &ClaimEntry) -> Vec<PreparedDevice> {
        entry
            .devices
            .iter()
            .map(|d| PreparedDevice {
                request_names: d.requests.clone(),
                pool_name: self.config.node.clone(),
                device_name: d.device.clone(),
                cdi_device_ids: d.cdi_devices.clone(),
            })
            .collect()
    }

    async fn unprepare_one(&self, state: &mut State, uid: &str) -> Result<(), String> {
        if !state.checkpoint.claims.contains_key(uid) {
            return Ok(());
        }
        let b = self.backend.clone();
        let snapshots = blocking(move || observe_gpus(&b)).await?;
        let targets = release_targets(&snapshots, &state.checkpoint, &[uid.to_string()]);
        let (b, reset) = (self.backend.clone(), self.config.reset_gpus);
        blocking(move || apply_layouts(&b, &targets, reset)).await?;
        match std::fs::remove_file(self.spec_path(uid)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("removing the claim's CDI spec: {e}")),
        }
        state.checkpoint.claims.remove(uid);
        save(&self.config.checkpoint, &state.checkpoint)
    }
}

/// The layouts that leave every GPU as it is except without the MIG
/// instances of `claims` (GPUs they do not touch are not listed).
fn release_targets(
    snapshots: &[GpuSnapshot],
    checkpoint: &Checkpoint,
    claims: &[String],
) -> LayoutTargets {
    let mut targets: BTreeMap<u32, Option<Vec<PlacedInstance>>> = BTreeMap::new();
    for uid in claims {
        let Some(entry) = checkpoint.claims.get(uid) else {
            continue;
        };
        for d in &entry.devices {
            let Some(m) = &d.mig else { continue };
            let Some(snap) = snapshots.iter().find(|s| s.info.uuid == d.gpu_uuid) else {
                continue;
            };
            if !snap.observed.mode.current {
                continue;
            }
            let layout = targets
                .entry(snap.info.index)
                .or_insert_with(|| Some(snap.layout.clone()));
            if let Some(layout) = layout {
                layout.retain(|i| !(i.start == m.start && i.profile.to_string() == m.profile));
            }
        }
    }
    targets
}

fn save(path: &std::path::Path, checkpoint: &Checkpoint) -> Result<(), String> {
    save_bytes(path, &checkpoint.encode())
}

fn save_bytes(path: &std::path::Path, bytes: &[u8]) -> Result<(), String> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    match write_atomic(path, bytes) {
        Ok(()) => Ok(()),
        Err(e @ AtomicWriteError::NotDurable { .. }) => {
            tracing::warn!(error = %e, "written, but not yet durable");
            Ok(())
        }
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

impl<A: AllocationSource> DraDriver for NodeDriver<A> {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> PrepareResults {
        let mut state = self.state.lock().await;
        let mut out = BTreeMap::new();
        for claim in claims {
            let result = self.prepare_one(&mut state, &claim).await;
            match &result {
                Ok(d) => {
                    tracing::info!(claim = %claim.uid, namespace = %claim.namespace, name = %claim.name, devices = d.len(), "prepared")
                }
                Err(e) => {
                    tracing::warn!(claim = %claim.uid, namespace = %claim.namespace, name = %claim.name, error = %e, "prepare refused")
                }
            }
            out.insert(claim.uid, result);
        }
        out
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> UnprepareResults {
        let mut state = self.state.lock().await;
        let mut out = BTreeMap::new();
        for claim in claims {
            let result = self.unprepare_one(&mut state, &claim.uid).await;
            if let Err(e) = &result {
                tracing::warn!(claim = %claim.uid, error = %e, "unprepare failed");
            }
            out.insert(claim.uid, result);
        }
        out
    }
}

/// Whether the node's MIG layout belongs to the MIG manager: it has a
/// `nvidia.com/mig.config` label and the MIG manager is not switched off for
/// it. Such a node is refused: one owner of the GPUs' layout.
pub fn mig_manager_owns(node: &str, labels: &BTreeMap<String, String>) -> Option<String> {
    let config = labels.get("nvidia.com/mig.config")?;
    if labels
        .get("nvidia.com/gpu.deploy.mig-manager")
        .is_some_and(|v| v == "false")
    {
        return None;
    }
    Some(format!(
        "node {node} is managed by the MIG manager (label nvidia.com/mig.config={}); a GPU layout has one owner: \
         remove the label (kubectl label node {node} nvidia.com/mig.config-) or set nvidia.com/gpu.deploy.mig-manager=false before running the DRA plugin on it",
        gpu_stack_core::echo::clipped(config)
    ))
}

/// Allocations read from the API server: the claim's
/// `status.allocation.devices.results` for this driver and pool.
#[derive(Clone)]
pub struct KubeAllocations {
    /// Client.
    pub client: kube::Client,
    /// Driver name.
    pub driver: String,
    /// Pool (node) name.
    pub pool: String,
}

impl AllocationSource for KubeAllocations {
    async fn allocated(&self, claim: &ClaimRef) -> Result<Vec<AllocatedDevice>, String> {
        use k8s_openapi::api::resource::v1::ResourceClaim;
        let api: kube::Api<ResourceClaim> =
            kube::Api::namespaced(self.client.clone(), &claim.namespace);
        let rc = api.get(&claim.name).await.map_err(|e| {
            format!(
                "reading ResourceClaim {}/{}: {e}",
                claim.namespace, claim.name
            )
        })?;
        if rc.metadata.uid.as_deref() != Some(claim.uid.as_str()) {
            return Err(format!(
                "ResourceClaim {}/{} has uid {:?}, not {}: it was deleted and created again",
                claim.namespace, claim.name, rc.metadata.uid, claim.uid
            ));
        }
        Ok(allocated_devices(&rc, &self.driver, &self.pool))
    }

    async fn exists(&self, namespace: &str, name: &str, uid: &str) -> Result<bool, String> {
        use k8s_openapi::api::resource::v1::ResourceClaim;
        let api: kube::Api<ResourceClaim> = kube::Api::namespaced(self.client.clone(), namespace);
        let rc = api
            .get_opt(name)
            .await
            .map_err(|e| format!("reading ResourceClaim {namespace}/{name}: {e}"))?;
        Ok(rc.is_some_and(|rc| rc.metadata.uid.as_deref() == Some(uid)))
    }
}

/// The devices of `driver` in `pool` a claim's status says were allocated.
pub fn allocated_devices(
    claim: &k8s_openapi::api::resource::v1::ResourceClaim,
    driver: &str,
    pool: &str,
) -> Vec<AllocatedDevice> {
    claim
        .status
        .iter()
        .flat_map(|s| s.allocation.iter())
        .flat_map(|a| a.devices.iter())
        .flat_map(|d| d.results.iter().flatten())
        .filter(|r| r.driver == driver && r.pool == pool)
        .map(|r| AllocatedDevice {
            request: r.request.clone(),
            device: r.device.clone(),
        })
        .collect()
}
