//! The MIG manager's node loop: reads `nvidia.com/mig.config` on its own node,
//! pauses the GPU clients, applies the named mig-parted config through the
//! shared apply path (`gpu_stack_nvml::migapply`), restores the clients and
//! reports `nvidia.com/mig.config.state`.
//!
//! One [`reconcile`] pass never leaves the node `pending`: every exit path
//! either reaches `success`, `failed` (with the reason in an annotation and the
//! deploy labels restored) or `rebooting` (a MIG mode change waits for a reset;
//! the next pass after the reboot resumes). The pause record lives on the node,
//! so a pass killed at any point is finished by the next one.
//!
//! The GPU side of a pass (reading and planning the GPUs, applying) is
//! synchronous backend work that can take minutes. [`reconcile_on`] runs it on
//! tokio's blocking threads through a [`GpuWorker`], so the manager's loop
//! keeps answering signals and watch events meanwhile; [`reconcile`] runs it
//! on the calling thread, for callers without such a loop (tests, the demo).

pub mod agent;
pub mod kube_node;
pub mod usage;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_stack_core::backend::GpuBackend;
use gpu_stack_core::mig::{Demand, PlacedInstance};
use gpu_stack_core::migmanager::labels::any_paused;
use gpu_stack_core::migmanager::{
    FAILURE_REASON_ANNOTATION, GPU_CLIENTS, LabelEdits, MIG_CONFIG_STATE_LABEL, MigConfigState,
    PAUSE_RECORD_ANNOTATION, PauseRecord, plan_pause, plan_restore,
};
use gpu_stack_core::migparted::MigPartedConfig;
use gpu_stack_core::operator::labels::MIG_CONFIG;
use gpu_stack_core::operator::migusage::first_shortfall;
use gpu_stack_nvml::migapply::{
    self, ApplyError, ApplyOptions, ApplyOutcome, ApplyReport, NodePlan, ProcessProbe,
};
use tokio::sync::Semaphore;

/// A node as the manager sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeView {
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Annotations.
    pub annotations: BTreeMap<String, String>,
}

/// One patch of a node: labels and annotations (`None` removes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodePatch {
    /// Label edits.
    pub labels: LabelEdits,
    /// Annotation edits.
    pub annotations: BTreeMap<String, Option<String>>,
}

/// What the manager needs from the cluster, for its own node only.
pub trait NodeApi: Send + Sync {
    /// Reads the node.
    fn get(&self, node: &str) -> impl Future<Output = Result<NodeView, ManagerError>> + Send;
    /// Patches labels and annotations in one request.
    fn patch(
        &self,
        node: &str,
        patch: &NodePatch,
    ) -> impl Future<Output = Result<(), ManagerError>> + Send;
    /// MIG instances the live pods bound to the node request, per profile
    /// (none where the cluster side cannot tell).
    fn mig_in_use(&self, _node: &str) -> impl Future<Output = Result<Demand, ManagerError>> + Send {
        async { Ok(Demand::new()) }
    }
    /// Names of pods on the node whose `app` label is one of `apps`.
    fn pods_on_node(
        &self,
        node: &str,
        apps: &[&str],
    ) -> impl Future<Output = Result<Vec<String>, ManagerError>> + Send;
}

/// Failures talking to the cluster.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    /// The API call failed; the pass is retried.
    #[error("cluster API error on node {node}: {detail}")]
    Cluster {
        /// Node.
        node: String,
        /// What failed.
        detail: String,
    },
}

/// Manager settings.
#[derive(Debug, Clone)]
pub struct ManagerOptions {
    /// Own node name.
    pub node: String,
    /// Destroy busy instances.
    pub force: bool,
    /// Longest wait for GPU client pods to leave.
    pub client_timeout: Duration,
    /// Poll interval while waiting.
    pub poll: Duration,
    /// Try GPU resets for pending MIG mode changes.
    pub reset_gpus: bool,
    /// Touched after every successful change so the device plugin and the CDI
    /// spec generator re-read the MIG devices.
    pub signal_file: Option<PathBuf>,
}

/// What a pass ended with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PassResult {
    /// No `nvidia.com/mig.config` label: nothing to do.
    NoConfig,
    /// The state label written, with the failure reason for `failed`.
    State(MigConfigState, Option<String>),
}

/// Why the GPU side of a pass did not complete.
#[derive(Debug, thiserror::Error)]
enum GpuWorkError {
    /// Reading, planning or applying failed (the reason names what to do).
    #[error(transparent)]
    Apply(#[from] ApplyError),
    /// The blocking task ended without an answer (it panicked).
    #[error(
        "the GPU work ended without an answer ({detail}); the next pass reads the GPUs again \
         and resumes from what they hold"
    )]
    Lost {
        /// What the runtime said.
        detail: String,
    },
}

/// The GPU side of a pass: reading and planning the GPUs, and applying.
trait PassGpu {
    /// Reads the GPUs and plans `selected`; changes nothing.
    async fn plan(
        &self,
        config: &MigPartedConfig,
        selected: &str,
    ) -> Result<NodePlan, GpuWorkError>;
    /// Applies `selected`.
    async fn apply(
        &self,
        config: &MigPartedConfig,
        selected: &str,
        options: ApplyOptions,
    ) -> Result<ApplyReport, GpuWorkError>;
}

/// GPU work on the calling thread.
struct Inline<'a> {
    backend: &'a dyn GpuBackend,
    probe: &'a dyn ProcessProbe,
}

impl PassGpu for Inline<'_> {
    async fn plan(
        &self,
        config: &MigPartedConfig,
        selected: &str,
    ) -> Result<NodePlan, GpuWorkError> {
        Ok(migapply::plan_node(
            self.backend,
            config,
            selected,
            self.probe,
        )?)
    }

    async fn apply(
        &self,
        config: &MigPartedConfig,
        selected: &str,
        options: ApplyOptions,
    ) -> Result<ApplyReport, GpuWorkError> {
        Ok(migapply::apply(
            self.backend,
            config,
            selected,
            options,
            self.probe,
            &mut |_| {},
        )?)
    }
}

/// Runs a pass's GPU work (synchronous backend calls) on tokio's blocking
/// threads, one piece at a time, and says whether some is in flight.
///
/// A blocking backend call cannot be cancelled; a caller that stops while one
/// runs waits for [`GpuWorker::idle`] so the change is never cut off half
/// way by the process exiting.
#[derive(Clone)]
pub struct GpuWorker {
    backend: Arc<dyn GpuBackend>,
    probe: Arc<dyn ProcessProbe + Send + Sync>,
    /// One permit, held by the blocking task while it runs.
    in_flight: Arc<Semaphore>,
}

impl std::fmt::Debug for GpuWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuWorker")
            .field("backend", &self.backend.name())
            .field("busy", &self.busy())
            .finish()
    }
}

impl GpuWorker {
    /// A worker over `backend`, with `probe` adding processes the driver
    /// cannot see.
    pub fn new(backend: Arc<dyn GpuBackend>, probe: Arc<dyn ProcessProbe + Send + Sync>) -> Self {
        Self {
            backend,
            probe,
            in_flight: Arc::new(Semaphore::new(1)),
        }
    }

    /// Whether GPU work is running now.
    pub fn busy(&self) -> bool {
        self.in_flight.available_permits() == 0
    }

    /// Resolves once no GPU work is running (at once when none is).
    pub async fn idle(&self) {
        // The semaphore is never closed, so an error cannot happen; either
        // way there is nothing left to wait for.
        let _ = self.in_flight.acquire().await;
    }

    /// Reads every GPU (no change), after any GPU work in flight.
    pub async fn snapshot(&self) -> Result<Vec<migapply::GpuSnapshot>, String> {
        self.run(migapply::observe).await.map_err(|e| e.to_string())
    }

    async fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce(&dyn GpuBackend, &dyn ProcessProbe) -> Result<T, ApplyError> + Send + 'static,
    ) -> Result<T, GpuWorkError> {
        let lost = |detail: String| GpuWorkError::Lost { detail };
        let permit = Arc::clone(&self.in_flight)
            .acquire_owned()
            .await
            .map_err(|e| lost(e.to_string()))?;
        let (backend, probe) = (Arc::clone(&self.backend), Arc::clone(&self.probe));
        // The permit moves into the task: it is released when the backend
        // work returns, even if this future is dropped before then.
        let task = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            work(backend.as_ref(), probe.as_ref())
        });
        Ok(task.await.map_err(|e| lost(e.to_string()))??)
    }
}

impl PassGpu for GpuWorker {
    async fn plan(
        &self,
        config: &MigPartedConfig,
        selected: &str,
    ) -> Result<NodePlan, GpuWorkError> {
        let (config, selected) = (config.clone(), selected.to_string());
        self.run(move |backend, probe| migapply::plan_node(backend, &config, &selected, probe))
            .await
    }

    async fn apply(
        &self,
        config: &MigPartedConfig,
        selected: &str,
        options: ApplyOptions,
    ) -> Result<ApplyReport, GpuWorkError> {
        let (config, selected) = (config.clone(), selected.to_string());
        self.run(move |backend, probe| {
            migapply::apply(backend, &config, &selected, options, probe, &mut |_| {})
        })
        .await
    }
}

/// One pass: read the node and the GPUs, converge, report. The GPU calls run
/// on the calling thread; a long-running loop uses [`reconcile_on`].
pub async fn reconcile<A: NodeApi>(
    api: &A,
    backend: &dyn GpuBackend,
    config: &MigPartedConfig,
    opts: &ManagerOptions,
    probe: &dyn ProcessProbe,
) -> Result<PassResult, ManagerError> {
    reconcile_with(api, &Inline { backend, probe }, config, opts).await
}

/// Every instance the node holds once `plan` is applied: the selected
/// GPUs' targets, the other GPUs as they are.
fn layout_after(plan: &NodePlan) -> Vec<PlacedInstance> {
    let mut out = Vec::new();
    for s in &plan.snapshots {
        match plan.gpus.iter().find(|(_, r, _)| r.gpu == s.info.index) {
            Some((_, r, _)) => out.extend(r.target.iter().filter_map(|t| t.parse().ok())),
            None if s.observed.mode.current => out.extend(s.layout.iter().cloned()),
            None => {}
        }
    }
    out
}

/// One pass, as [`reconcile`], with the GPU calls on `gpu`'s blocking
/// threads so the caller's other tasks keep running during an apply.
pub async fn reconcile_on<A: NodeApi>(
    api: &A,
    gpu: &GpuWorker,
    config: &MigPartedConfig,
    opts: &ManagerOptions,
) -> Result<PassResult, ManagerError> {
    reconcile_with(api, gpu, config, opts).await
}

#[tracing::instrument(level = "debug", name = "mig_pass", skip_all, fields(node = %opts.node))]
async fn reconcile_with<A: NodeApi, G: PassGpu>(
    api: &A,
    gpu: &G,
    config: &MigPartedConfig,
    opts: &ManagerOptions,
) -> Result<PassResult, ManagerError> {
    let node = api.get(&opts.node).await?;
    let Some(selected) = node.labels.get(MIG_CONFIG).cloned() else {
        return Ok(PassResult::NoConfig);
    };
    let previous = node
        .labels
        .get(MIG_CONFIG_STATE_LABEL)
        .and_then(|s| s.parse::<MigConfigState>().ok());
    let record = node
        .annotations
        .get(PAUSE_RECORD_ANNOTATION)
        .and_then(|a| PauseRecord::from_annotation(a).ok());

    let plan = match gpu.plan(config, &selected).await {
        Ok(p) => p,
        Err(e) => return finish(api, opts, record.as_ref(), Some(e.to_string())).await,
    };
    if plan.is_converged() {
        if record.is_some() || any_paused(&node.labels) {
            signal(opts);
        }
        return finish(api, opts, record.as_ref(), None).await;
    }
    if previous == Some(MigConfigState::Rebooting)
        && plan.gpus.iter().any(|(p, _, _)| p.needs_reset)
    {
        let reason =
            "the MIG mode change did not take effect after the reset or reboot".to_string();
        return finish(api, opts, record.as_ref(), Some(reason)).await;
    }
    let busy = plan.busy();
    if !busy.is_empty() && !opts.force {
        let e = migapply::ApplyError::Busy(busy);
        return finish(api, opts, record.as_ref(), Some(e.to_string())).await;
    }
    // Pods bound here hold instances the driver may not see processes on
    // yet: a layout keeping fewer of a profile than they use is refused.
    if !opts.force {
        let in_use = api.mig_in_use(&opts.node).await?;
        if !in_use.is_empty() {
            let after = layout_after(&plan);
            if let Some((profile, kept, used)) = first_shortfall(&after, &in_use) {
                let reason = format!(
                    "MIG config {selected} would leave {kept} {profile} instance(s) while pods bound to this node use {used}; nothing was changed (wait for those pods to finish, or pick a layout that keeps them)"
                );
                return finish(api, opts, record.as_ref(), Some(reason)).await;
            }
        }
    }

    // Pause the clients and mark pending in one patch, with the record.
    let (edits, record) = plan_pause(&node.labels, GPU_CLIENTS, record.as_ref());
    let mut patch = NodePatch {
        labels: edits,
        annotations: BTreeMap::new(),
    };
    patch.labels.set.insert(
        MIG_CONFIG_STATE_LABEL.to_string(),
        MigConfigState::Pending.to_string(),
    );
    patch.annotations.insert(
        PAUSE_RECORD_ANNOTATION.to_string(),
        Some(record.to_annotation()),
    );
    api.patch(&opts.node, &patch).await?;

    // Wait, bounded, for the client pods to leave.
    let apps: Vec<&str> = GPU_CLIENTS
        .iter()
        .map(|c| c.app)
        .filter(|a| !a.is_empty())
        .collect();
    let deadline = Instant::now() + opts.client_timeout;
    loop {
        let pods = api.pods_on_node(&opts.node, &apps).await?;
        if pods.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            let reason = format!(
                "GPU client pods did not leave the node within {:?}: {}",
                opts.client_timeout,
                pods.join(", ")
            );
            return finish(api, opts, Some(&record), Some(reason)).await;
        }
        tokio::time::sleep(opts.poll).await;
    }

    tracing::info!(node = %opts.node, config = %selected, "GPU clients gone; applying the config");
    let options = ApplyOptions {
        force: opts.force,
        reset_gpus: opts.reset_gpus,
        mode_only: false,
    };
    match gpu.apply(config, &selected, options).await {
        Ok(report) => match report.outcome {
            ApplyOutcome::Converged => {
                signal(opts);
                finish(api, opts, Some(&record), None).await
            }
            ApplyOutcome::NeedsReboot { .. } => {
                // Clients stay paused across the reboot; the record says what to restore.
                let mut patch = NodePatch::default();
                patch.labels.set.insert(
                    MIG_CONFIG_STATE_LABEL.to_string(),
                    MigConfigState::Rebooting.to_string(),
                );
                api.patch(&opts.node, &patch).await?;
                Ok(PassResult::State(MigConfigState::Rebooting, None))
            }
        },
        Err(e) => finish(api, opts, Some(&record), Some(e.to_string())).await,
    }
}

/// Restores the clients, clears the record and writes `success` or `failed`.
async fn finish<A: NodeApi>(
    api: &A,
    opts: &ManagerOptions,
    record: Option<&PauseRecord>,
    failure: Option<String>,
) -> Result<PassResult, ManagerError> {
    let node = api.get(&opts.node).await?;
    let mut patch = NodePatch {
        labels: plan_restore(&node.labels, record, GPU_CLIENTS),
        annotations: BTreeMap::new(),
    };
    let state = if failure.is_some() {
        MigConfigState::Failed
    } else {
        MigConfigState::Success
    };
    patch
        .labels
        .set
        .insert(MIG_CONFIG_STATE_LABEL.to_string(), state.to_string());
    if node.annotations.contains_key(PAUSE_RECORD_ANNOTATION) {
        patch
            .annotations
            .insert(PAUSE_RECORD_ANNOTATION.to_string(), None);
    }
    match &failure {
        Some(reason) => {
            patch
                .annotations
                .insert(FAILURE_REASON_ANNOTATION.to_string(), Some(reason.clone()));
        }
        None if node.annotations.contains_key(FAILURE_REASON_ANNOTATION) => {
            patch
                .annotations
                .insert(FAILURE_REASON_ANNOTATION.to_string(), None);
        }
        None => {}
    }
    let unchanged = node.labels.get(MIG_CONFIG_STATE_LABEL).map(String::as_str)
        == Some(state.as_str())
        && patch.labels.set.len() == 1
        && patch.labels.remove.is_empty()
        && patch.annotations.is_empty();
    if !unchanged {
        api.patch(&opts.node, &patch).await?;
    }
    Ok(PassResult::State(state, failure))
}

fn signal(opts: &ManagerOptions) {
    if let Some(path) = &opts.signal_file {
        let stamp = format!("{:?}\n", std::time::SystemTime::now());
        if let Err(e) = std::fs::write(path, stamp) {
            tracing::warn!(path = %path.display(), error = %e, "could not touch the MIG change signal file");
        }
    }
}

/// A node held in memory, for tests and the embedded demo: labels,
/// annotations, and GPU client pods that leave when their deploy label stops
/// being `true` (unless told to linger).
#[derive(Debug, Default)]
pub struct MemoryNode {
    inner: std::sync::Mutex<MemoryNodeState>,
}

#[derive(Debug, Default)]
struct MemoryNodeState {
    view: NodeView,
    /// app label → deploy label of running client pods.
    pods: Vec<(String, String)>,
    lingering: bool,
    /// Every label state written, in order (for tests to follow transitions).
    history: Vec<BTreeMap<String, String>>,
    /// MIG instances the node's pods use, per profile.
    mig_in_use: Demand,
}

impl MemoryNode {
    /// A node with these labels and one running pod per client whose deploy label is `true`.
    pub fn new(labels: BTreeMap<String, String>) -> Self {
        let pods = GPU_CLIENTS
            .iter()
            .filter(|c| {
                !c.app.is_empty() && labels.get(c.deploy_label).map(String::as_str) == Some("true")
            })
            .map(|c| (c.app.to_string(), c.deploy_label.to_string()))
            .collect();
        MemoryNode {
            inner: std::sync::Mutex::new(MemoryNodeState {
                view: NodeView {
                    labels,
                    annotations: BTreeMap::new(),
                },
                pods,
                lingering: false,
                history: Vec::new(),
                mig_in_use: Demand::new(),
            }),
        }
    }

    /// Pods bound to the node use these MIG instances, per profile.
    pub fn set_mig_in_use(&self, in_use: Demand) {
        self.lock().mig_in_use = in_use;
    }

    /// Pods never leave (a stuck client).
    pub fn set_lingering(&self, lingering: bool) {
        self.lock().lingering = lingering;
    }

    /// Current view.
    pub fn view(&self) -> NodeView {
        self.lock().view.clone()
    }

    /// Every label state written so far.
    pub fn history(&self) -> Vec<BTreeMap<String, String>> {
        self.lock().history.clone()
    }

    /// Sets a label as a person would.
    pub fn set_label(&self, key: &str, value: &str) {
        self.lock()
            .view
            .labels
            .insert(key.to_string(), value.to_string());
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemoryNodeState> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl NodeApi for MemoryNode {
    async fn get(&self, _node: &str) -> Result<NodeView, ManagerError> {
        Ok(self.view())
    }

    async fn mig_in_use(&self, _node: &str) -> Result<Demand, ManagerError> {
        Ok(self.lock().mig_in_use.clone())
    }

    async fn patch(&self, _node: &str, patch: &NodePatch) -> Result<(), ManagerError> {
        let mut s = self.lock();
        patch.labels.apply_to(&mut s.view.labels);
        for (k, v) in &patch.annotations {
            match v {
                Some(v) => s.view.annotations.insert(k.clone(), v.clone()),
                None => s.view.annotations.remove(k),
            };
        }
        let labels = s.view.labels.clone();
        s.history.push(labels.clone());
        if !s.lingering {
            s.pods
                .retain(|(_, deploy)| labels.get(deploy).map(String::as_str) == Some("true"));
        }
        // Clients come back when their label is `true` again.
        for c in GPU_CLIENTS {
            if !c.app.is_empty()
                && labels.get(c.deploy_label).map(String::as_str) == Some("true")
                && !s.pods.iter().any(|(a, _)| a == c.app)
            {
                s.pods.push((c.app.to_string(), c.deploy_label.to_string()));
            }
        }
        Ok(())
    }

    async fn pods_on_node(&self, node: &str, apps: &[&str]) -> Result<Vec<String>, ManagerError> {
        Ok(self
            .lock()
            .pods
            .iter()
            .filter(|(a, _)| apps.contains(&a.as_str()))
            .map(|(a, _)| format!("{a}-{node}"))
            .collect())
    }
}
