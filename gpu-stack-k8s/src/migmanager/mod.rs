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

pub mod agent;
pub mod kube_node;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use gpu_stack_core::backend::GpuBackend;
use gpu_stack_core::migmanager::labels::any_paused;
use gpu_stack_core::migmanager::{
    FAILURE_REASON_ANNOTATION, GPU_CLIENTS, LabelEdits, MIG_CONFIG_LABEL, MIG_CONFIG_STATE_LABEL,
    MigConfigState, PAUSE_RECORD_ANNOTATION, PauseRecord, plan_pause, plan_restore,
};
use gpu_stack_core::migparted::MigPartedConfig;
use gpu_stack_nvml::migapply::{self, ApplyOptions, ApplyOutcome, ProcessProbe};

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

/// One pass: read the node and the GPUs, converge, report.
pub async fn reconcile<A: NodeApi>(
    api: &A,
    backend: &dyn GpuBackend,
    config: &MigPartedConfig,
    opts: &ManagerOptions,
    probe: &dyn ProcessProbe,
) -> Result<PassResult, ManagerError> {
    let node = api.get(&opts.node).await?;
    let Some(selected) = node.labels.get(MIG_CONFIG_LABEL).cloned() else {
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

    let plan = match migapply::plan_node(backend, config, &selected, probe) {
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

    let options = ApplyOptions {
        force: opts.force,
        reset_gpus: opts.reset_gpus,
        mode_only: false,
    };
    match migapply::apply(backend, config, &selected, options, probe, &mut |_| {}) {
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
            }),
        }
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
