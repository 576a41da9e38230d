//! The `gpu-mig-manager` process loop: watches its own Node (by field selector
//! `metadata.name=<node>`, metadata only) and the mig-parted config file, and
//! runs one [`reconcile_on`] pass whenever the `nvidia.com/mig.config` label
//! changes, the file's content changes, or at start (the watch's initial list
//! counts as a change). A pass that hit a cluster API error is retried after a
//! pause. A pass that ends `rebooting` runs the configured reboot hook, for at
//! most [`AgentOptions::reboot_hook_timeout`].
//!
//! The GPU work of a pass runs on blocking threads ([`GpuWorker`]), so the loop
//! sees a stop (the `shutdown` future resolving, e.g. on SIGTERM) and node
//! events while an apply runs. A stop during a pass drops it at its next await
//! point, but first waits for backend work in flight to return: an apply is
//! never cut off half way. The pause record on the node lets the next start
//! finish what this one began.
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::FusedStream;
use futures::{Stream, StreamExt};
use gpu_stack_core::backend::GpuBackend;
use gpu_stack_core::migmanager::MigConfigState;
use gpu_stack_core::migparted::MigPartedConfig;
use gpu_stack_core::operator::labels::MIG_CONFIG;
use gpu_stack_core::operator::migusage;
use gpu_stack_nvml::migapply::NoProcesses;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};

use super::kube_node::{KubeNode, LocalClients};
use super::usage::{MIG_USAGE_ANNOTATION, requested_on_node, usage_of};
use super::{
    GpuWorker, ManagerError, ManagerOptions, NodeApi, NodePatch, PassResult, reconcile_on,
};

/// Default bound on the reboot hook: long enough for a drain and a reboot
/// command, short enough that a hung hook is noticed.
pub const DEFAULT_REBOOT_HOOK_TIMEOUT: Duration = Duration::from_secs(300);

/// Settings of the manager process.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// Settings of each pass (node name, timeouts, force, signal file).
    pub manager: ManagerOptions,
    /// mig-parted config file (`default` for NVIDIA's shipped file).
    pub config_file: PathBuf,
    /// How often the config file is re-read for changes.
    pub config_poll: Duration,
    /// Pause before retrying a pass that failed talking to the cluster.
    pub retry: Duration,
    /// Shell command run (`sh -c`) when a pass ends `rebooting`; `NODE_NAME`
    /// and `MIG_CONFIG` are set in its environment.
    pub reboot_hook: Option<String>,
    /// Longest the reboot hook may run before it is killed and reported
    /// ([`DEFAULT_REBOOT_HOOK_TIMEOUT`] unless told).
    pub reboot_hook_timeout: Duration,
    /// This replica's name in Events (the pod name).
    pub instance: Option<String>,
    /// Publish the GPUs' layouts and in-use instances in the node's
    /// [`MIG_USAGE_ANNOTATION`] for demand-driven MIG (watches the pods
    /// bound to this node).
    pub publish_usage: bool,
    /// GPU clients in this process to wait for besides pods (set by the
    /// combined node agent).
    pub local_clients: Option<LocalClients>,
}

/// Why the manager process stopped.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The config file could not be read or parsed at start.
    #[error(
        "mig-parted config file {path}: {detail}; fix the file (or pass `default` for NVIDIA's shipped configs)"
    )]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// The node watch ended, which it only does when the client is gone.
    #[error("the watch of node {node} ended; restart the manager")]
    WatchEnded {
        /// The node.
        node: String,
    },
}

/// Why the reboot hook did not finish cleanly. The node stays `rebooting`
/// with its clients paused; a reboot (by hand, if need be) lets the next
/// start resume.
#[derive(Debug, thiserror::Error)]
pub enum RebootHookError {
    /// `sh` could not be started.
    #[error(
        "could not start the reboot hook `{hook}`: {source}; check that `sh` exists in the manager's image, or reboot the node by hand"
    )]
    Start {
        /// The hook command.
        hook: String,
        /// Underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Waiting for the hook failed.
    #[error(
        "could not wait for the reboot hook `{hook}`: {source}; check the node's state and reboot it by hand if need be"
    )]
    Wait {
        /// The hook command.
        hook: String,
        /// Underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The hook exited unsuccessfully.
    #[error("the reboot hook `{hook}` failed ({status}); fix the hook or reboot the node by hand")]
    Failed {
        /// The hook command.
        hook: String,
        /// Its exit status.
        status: std::process::ExitStatus,
    },
    /// The hook did not finish in time and was killed.
    #[error(
        "the reboot hook `{hook}` did not finish within {timeout:?} and was killed; fix the hook (or raise --reboot-hook-timeout-seconds) or reboot the node by hand"
    )]
    TimedOut {
        /// The hook command.
        hook: String,
        /// The bound it ran past.
        timeout: Duration,
    },
}

/// How [`drive_pass`] ended.
#[derive(Debug)]
pub enum PassEnd {
    /// The pass ran to its end.
    Done(Result<PassResult, ManagerError>),
    /// A stop came first; the pass was dropped (the next start finishes it).
    Stopped {
        /// The stop came while GPU work ran; it was waited for first.
        waited_for_gpu: bool,
    },
}

/// A loaded config and the text it came from (to notice changes).
#[derive(Debug, Clone)]
pub struct LoadedConfig {
    /// The file's text (empty for the built-in default).
    pub text: String,
    /// The parsed config.
    pub config: MigPartedConfig,
}

/// Reads and parses a mig-parted config file; `default` is NVIDIA's shipped file.
pub fn load_config(path: &Path) -> Result<LoadedConfig, AgentError> {
    let err = |detail: String| AgentError::Config {
        path: path.to_path_buf(),
        detail,
    };
    if path == Path::new("default") {
        let config = MigPartedConfig::default_config().map_err(|e| err(e.to_string()))?;
        return Ok(LoadedConfig {
            text: String::new(),
            config,
        });
    }
    let text = std::fs::read_to_string(path).map_err(|e| err(format!("cannot read it: {e}")))?;
    let config = MigPartedConfig::from_yaml(&text).map_err(|e| err(e.to_string()))?;
    Ok(LoadedConfig { text, config })
}

/// Watches the config file: yields a new config when the content changed and
/// parses; a bad edit is logged once and the previous config stays in use.
#[derive(Debug)]
pub struct ConfigWatch {
    path: PathBuf,
    current: LoadedConfig,
    last_bad: Option<String>,
}

impl ConfigWatch {
    /// Starts from an already loaded config.
    pub fn new(path: PathBuf, current: LoadedConfig) -> Self {
        Self {
            path,
            current,
            last_bad: None,
        }
    }

    /// The config in use.
    pub fn config(&self) -> &MigPartedConfig {
        &self.current.config
    }

    /// Re-reads the file; `true` when a new, valid config is now in use.
    pub fn poll(&mut self) -> bool {
        if self.path == Path::new("default") {
            return false;
        }
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) => {
                let note = format!("unreadable: {e}");
                if self.last_bad.as_deref() != Some(note.as_str()) {
                    tracing::warn!(path = %self.path.display(), error = %e,
                        "cannot re-read the mig-parted config file; keeping the previous config");
                    self.last_bad = Some(note);
                }
                return false;
            }
        };
        if text == self.current.text || self.last_bad.as_deref() == Some(text.as_str()) {
            return false;
        }
        match MigPartedConfig::from_yaml(&text) {
            Ok(config) => {
                tracing::info!(path = %self.path.display(), "mig-parted config file changed; reloaded");
                self.current = LoadedConfig { text, config };
                self.last_bad = None;
                true
            }
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e,
                    "the changed mig-parted config file does not parse; keeping the previous config");
                self.last_bad = Some(text);
                false
            }
        }
    }
}

/// Runs the manager until `shutdown` resolves.
pub async fn run(
    client: Client,
    backend: Arc<dyn GpuBackend>,
    opts: AgentOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<(), AgentError> {
    let node_name = opts.manager.node.clone();
    let mut config = ConfigWatch::new(opts.config_file.clone(), load_config(&opts.config_file)?);
    let mut api = KubeNode::new(client.clone(), opts.instance.clone());
    if let Some(local) = opts.local_clients.clone() {
        api = api.with_local_clients(local);
    }
    let nodes: Api<PartialObjectMeta<Node>> = Api::all(client.clone());
    let watch_cfg = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
    let mut changes = watcher(nodes, watch_cfg)
        .default_backoff()
        .applied_objects()
        .boxed()
        // A pass stops polling it once it ends; the loop then sees the end.
        .fuse();
    let gpu = GpuWorker::new(Arc::clone(&backend), Arc::new(NoProcesses));
    // The pods bound to this node, for the usage annotation; `true` from the
    // stream once the first list is complete (never publish before: an
    // empty list would hide instances in use).
    let (pods, pod_writer) = reflector::store::<Pod>();
    let mut pod_changes = if opts.publish_usage {
        watcher(
            Api::<Pod>::all(client),
            watcher::Config::default().fields(&format!("spec.nodeName={node_name}")),
        )
        .default_backoff()
        .modify(|p: &mut Pod| p.metadata.managed_fields = None)
        .reflect(pod_writer)
        .map(|e| matches!(e, Ok(watcher::Event::InitDone)))
        .boxed()
    } else {
        futures::stream::pending().boxed()
    }
    .fuse();
    let mut pods_synced = false;
    let mut usage_dirty = false;
    let mut published: Option<String> = None;
    let mut ticker = tokio::time::interval(opts.config_poll.max(Duration::from_millis(10)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    tokio::pin!(shutdown);

    // `None` until the watch's first answer: that answer triggers the start pass.
    let mut seen: Option<Option<String>> = None;
    let mut dirty = false;
    let mut retry_at: Option<tokio::time::Instant> = None;
    tracing::info!(node = %node_name, config = %opts.config_file.display(), backend = backend.name(),
        "MIG manager started");
    loop {
        if dirty {
            retry_at = None;
            let selected = seen.clone().flatten();
            // Label changes during the pass are noted and run another pass after it.
            let mut changed_during = false;
            let end = drive_pass(
                &api,
                &gpu,
                config.config(),
                &opts.manager,
                shutdown.as_mut(),
                &mut changes,
                |change| changed_during |= note_change(change, &mut seen, &node_name),
            )
            .await;
            dirty = changed_during;
            usage_dirty = true;
            let result = match end {
                PassEnd::Done(result) => result,
                PassEnd::Stopped { .. } => return Ok(()),
            };
            match result {
                Ok(PassResult::NoConfig) => {
                    tracing::info!(node = %node_name, "no {MIG_CONFIG} label; nothing to do");
                }
                Ok(PassResult::State(state, reason)) => {
                    report(
                        &api,
                        &node_name,
                        selected.as_deref(),
                        state,
                        reason.as_deref(),
                    )
                    .await;
                    if state == MigConfigState::Rebooting {
                        let hook = reboot(&opts, selected.as_deref());
                        tokio::select! {
                            () = hook => {}
                            () = &mut shutdown => {
                                // Likely the reboot itself stopping us: the
                                // hook is left to finish, not killed.
                                tracing::info!("stopping while the reboot hook runs");
                                return Ok(());
                            }
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?opts.retry, "MIG manager pass failed; retrying");
                    retry_at = Some(tokio::time::Instant::now() + opts.retry);
                }
            }
        }
        if usage_dirty && pods_synced && !gpu.busy() {
            usage_dirty = false;
            publish_usage(&api, &node_name, &gpu, &pods, &mut published).await;
        }
        let retry_sleep =
            tokio::time::sleep_until(retry_at.unwrap_or_else(tokio::time::Instant::now));
        tokio::select! {
            () = &mut shutdown => return Ok(()),
            change = changes.next() => match change {
                Some(change) => dirty |= note_change(change, &mut seen, &node_name),
                None => return Err(AgentError::WatchEnded { node: node_name }),
            },
            _ = ticker.tick() => {
                // The label is not known before the first watch answer; that
                // answer runs a pass with the new config anyway.
                if config.poll() && seen.is_some() {
                    dirty = true;
                }
            }
            () = retry_sleep, if retry_at.is_some() => dirty = true,
            Some(synced) = pod_changes.next(), if !pod_changes.is_terminated() => {
                pods_synced |= synced;
                usage_dirty = true;
            }
        }
    }
}

/// Publishes the GPUs' layouts and in-use instances in the node's
/// [`MIG_USAGE_ANNOTATION`] when they differ from what was last published.
/// Failures are logged; the next change publishes again.
async fn publish_usage(
    api: &KubeNode,
    node: &str,
    gpu: &GpuWorker,
    pods: &Store<Pod>,
    published: &mut Option<String>,
) {
    let snapshots = match gpu.snapshot().await {
        Ok(s) => s,
        Err(error) => {
            tracing::warn!(%error, "cannot read the GPUs for the MIG usage annotation");
            return;
        }
    };
    let state = pods.state();
    let requested = requested_on_node(state.iter().map(|p| p.as_ref()));
    let text = match migusage::encode(&usage_of(&snapshots, &requested)) {
        Ok(t) => t,
        Err(error) => {
            tracing::warn!(%error, "MIG usage not published");
            return;
        }
    };
    if published.as_deref() == Some(text.as_str()) {
        return;
    }
    let patch = NodePatch {
        annotations: [(MIG_USAGE_ANNOTATION.to_string(), Some(text.clone()))].into(),
        ..NodePatch::default()
    };
    match api.patch(node, &patch).await {
        Ok(()) => {
            tracing::debug!(usage = %text, "MIG usage published");
            *published = Some(text);
        }
        Err(error) => tracing::warn!(%error, "cannot publish the MIG usage annotation"),
    }
}

/// Notes one answer of the node watch; `true` when the selected config
/// changed (or is first known) and a pass should run.
fn note_change(
    change: Result<PartialObjectMeta<Node>, watcher::Error>,
    seen: &mut Option<Option<String>>,
    node: &str,
) -> bool {
    match change {
        Ok(meta) => {
            let value = meta.labels().get(MIG_CONFIG).cloned();
            if seen.as_ref() == Some(&value) {
                return false;
            }
            tracing::info!(node, selected = ?value, "{MIG_CONFIG} changed");
            *seen = Some(value);
            true
        }
        Err(e) => {
            tracing::warn!(error = %e, "node watch error; the watch retries");
            false
        }
    }
}

async fn report(
    api: &KubeNode,
    node: &str,
    selected: Option<&str>,
    state: MigConfigState,
    reason: Option<&str>,
) {
    match state {
        MigConfigState::Failed => tracing::error!(node, config = ?selected,
            reason = reason.unwrap_or(""), "MIG config failed"),
        _ => tracing::info!(node, config = ?selected, state = %state, "MIG manager pass done"),
    }
    if let Err(e) = api.record_outcome(node, selected, state, reason).await {
        tracing::warn!(error = %e, "could not publish the Event (the state label is set)");
    }
}

/// Runs one pass to its end, handing each item of `events` to `on_event`
/// meanwhile, unless `shutdown` resolves first. A stop while GPU work runs
/// waits for that work to return before the pass is dropped, so an apply is
/// never cut off by the process exiting; nothing is written after the stop,
/// and the next start finishes the pass from the pause record.
pub async fn drive_pass<A, S>(
    api: &A,
    gpu: &GpuWorker,
    config: &MigPartedConfig,
    opts: &ManagerOptions,
    mut shutdown: Pin<&mut impl Future<Output = ()>>,
    events: &mut S,
    mut on_event: impl FnMut(S::Item),
) -> PassEnd
where
    A: NodeApi,
    S: Stream + FusedStream + Unpin,
{
    let pass = reconcile_on(api, gpu, config, opts);
    tokio::pin!(pass);
    loop {
        tokio::select! {
            result = &mut pass => return PassEnd::Done(result),
            () = &mut shutdown => {
                let waited_for_gpu = gpu.busy();
                if waited_for_gpu {
                    tracing::info!("stop requested while the GPUs are being changed; stopping once the backend work returns");
                }
                gpu.idle().await;
                tracing::info!("stopping during a pass; the next start finishes it");
                return PassEnd::Stopped { waited_for_gpu };
            }
            Some(item) = events.next(), if !events.is_terminated() => on_event(item),
        }
    }
}

/// Kills a hook's process group and reaps the hook.
async fn kill_group(child: &mut tokio::process::Child) {
    use nix::sys::signal::{Signal, killpg};
    use nix::unistd::Pid;
    let group = child.id().and_then(|id| i32::try_from(id).ok());
    if let Some(group) = group
        && let Err(e) = killpg(Pid::from_raw(group), Signal::SIGKILL)
    {
        tracing::warn!(error = %e, "could not kill the reboot hook's process group");
    }
    // Kills the hook itself if the group kill missed it, and reaps it.
    if let Err(e) = child.kill().await {
        tracing::warn!(error = %e, "could not kill the timed-out reboot hook");
    }
}

/// Runs the configured reboot hook, if any, and logs how it ended.
async fn reboot(opts: &AgentOptions, selected: Option<&str>) {
    let Some(hook) = &opts.reboot_hook else {
        tracing::warn!(
            "a MIG mode change waits for a GPU reset the driver refused: reboot the node; \
             the manager resumes at start (or set --reboot-hook)"
        );
        return;
    };
    tracing::info!(hook = %hook, timeout = ?opts.reboot_hook_timeout, "running the reboot hook");
    match run_reboot_hook(hook, &opts.manager.node, selected, opts.reboot_hook_timeout).await {
        Ok(()) => tracing::info!("reboot hook finished"),
        Err(e) => tracing::error!(error = %e, "reboot hook did not finish cleanly"),
    }
}

/// Runs `hook` with `sh -c`, `NODE_NAME` and `MIG_CONFIG` in its environment,
/// for at most `timeout`; past it the hook is killed and
/// [`RebootHookError::TimedOut`] returned. Dropping the future leaves a
/// running hook alone (the reboot it started may be what stops the caller).
pub async fn run_reboot_hook(
    hook: &str,
    node: &str,
    selected: Option<&str>,
    timeout: Duration,
) -> Result<(), RebootHookError> {
    let mut child = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(hook)
        .env("NODE_NAME", node)
        .env("MIG_CONFIG", selected.unwrap_or(""))
        // Its own process group, so a timeout kills whatever the hook started.
        .process_group(0)
        .spawn()
        .map_err(|source| RebootHookError::Start {
            hook: hook.to_string(),
            source,
        })?;
    match tokio::time::timeout(timeout, child.wait()).await {
        Ok(Ok(status)) if status.success() => Ok(()),
        Ok(Ok(status)) => Err(RebootHookError::Failed {
            hook: hook.to_string(),
            status,
        }),
        Ok(Err(source)) => Err(RebootHookError::Wait {
            hook: hook.to_string(),
            source,
        }),
        Err(_elapsed) => {
            kill_group(&mut child).await;
            Err(RebootHookError::TimedOut {
                hook: hook.to_string(),
                timeout,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::sync::{Mutex, mpsc};

    use gpu_stack_core::backend::{
        BackendError, ComputeInstance, GpuInfo, GpuInstance, GpuInstanceProfile, GpuProcess,
        GpuTelemetry, HealthEvents, MigChangeLock, MigMode, MigModeChange, MigTelemetry,
        SlicePlacement, SystemInfo,
    };
    use gpu_stack_core::migmanager::{MIG_CONFIG_STATE_LABEL, PAUSE_RECORD_ANNOTATION};
    use gpu_stack_nvml::{SimNodeSpec, SimulatedBackend};
    use tokio_stream::wrappers::UnboundedReceiverStream;

    use crate::migmanager::MemoryNode;

    /// Simulated GPUs whose first GPU-instance create (mid-apply: the MIG
    /// mode is already on) blocks until the test releases it.
    struct HeldApply {
        inner: SimulatedBackend,
        entered: tokio::sync::mpsc::UnboundedSender<()>,
        release: Mutex<mpsc::Receiver<()>>,
        held: std::sync::atomic::AtomicBool,
    }

    impl HeldApply {
        fn hold(&self) {
            if self.held.swap(true, std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            let _ = self.entered.send(());
            let release = self.release.lock().unwrap_or_else(|p| p.into_inner());
            // A safety net, not a timing assertion: if the apply blocked the
            // async side, nothing can release it and the test would hang.
            release
                .recv_timeout(Duration::from_secs(60))
                .expect("the apply was never released: it blocked the async loop");
        }
    }

    impl GpuBackend for HeldApply {
        fn name(&self) -> &str {
            "held-apply"
        }
        fn system_info(&self) -> Result<SystemInfo, BackendError> {
            self.inner.system_info()
        }
        fn device_count(&self) -> Result<u32, BackendError> {
            self.inner.device_count()
        }
        fn gpu_info(&self, gpu: u32) -> Result<GpuInfo, BackendError> {
            self.inner.gpu_info(gpu)
        }
        fn mig_mode(&self, gpu: u32) -> Result<MigMode, BackendError> {
            self.inner.mig_mode(gpu)
        }
        fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<MigModeChange, BackendError> {
            self.inner.set_mig_mode(gpu, enabled)
        }
        fn gpu_instance_profiles(&self, gpu: u32) -> Result<Vec<GpuInstanceProfile>, BackendError> {
            self.inner.gpu_instance_profiles(gpu)
        }
        fn gpu_instances(&self, gpu: u32) -> Result<Vec<GpuInstance>, BackendError> {
            self.inner.gpu_instances(gpu)
        }
        fn create_gpu_instance(
            &self,
            gpu: u32,
            profile_id: u32,
            placement: SlicePlacement,
        ) -> Result<GpuInstance, BackendError> {
            self.hold();
            self.inner.create_gpu_instance(gpu, profile_id, placement)
        }
        fn create_compute_instance(
            &self,
            gpu: u32,
            gi: u32,
            slices: u32,
        ) -> Result<ComputeInstance, BackendError> {
            self.inner.create_compute_instance(gpu, gi, slices)
        }
        fn destroy_compute_instance(&self, gpu: u32, gi: u32, ci: u32) -> Result<(), BackendError> {
            self.inner.destroy_compute_instance(gpu, gi, ci)
        }
        fn destroy_gpu_instance(&self, gpu: u32, gi: u32) -> Result<(), BackendError> {
            self.inner.destroy_gpu_instance(gpu, gi)
        }
        fn reset_gpu(&self, gpu: u32) -> Result<(), BackendError> {
            self.inner.reset_gpu(gpu)
        }
        fn gpu_telemetry(&self, gpu: u32) -> Result<GpuTelemetry, BackendError> {
            self.inner.gpu_telemetry(gpu)
        }
        fn mig_telemetry(&self, gpu: u32) -> Result<Vec<MigTelemetry>, BackendError> {
            self.inner.mig_telemetry(gpu)
        }
        fn health_events(&self) -> Result<Box<dyn HealthEvents>, BackendError> {
            self.inner.health_events()
        }
        fn lock_mig_changes(&self) -> Result<MigChangeLock, BackendError> {
            self.inner.lock_mig_changes()
        }
        fn running_processes(&self, gpu: u32) -> Result<Vec<GpuProcess>, BackendError> {
            self.inner.running_processes(gpu)
        }
    }

    fn manager_opts() -> ManagerOptions {
        ManagerOptions {
            node: "n0".into(),
            force: false,
            client_timeout: Duration::from_secs(5),
            poll: Duration::from_millis(1),
            reset_gpus: true,
            signal_file: None,
        }
    }

    /// GPU-instance count of each GPU.
    fn instances(b: &dyn GpuBackend) -> Vec<usize> {
        (0..b.device_count().unwrap())
            .map(|g| b.mig_state(g).unwrap().gpu_instances.len())
            .collect()
    }

    // The default test runtime has one thread: were the apply run on it, the
    // event, the stop and the release below could never be seen.
    #[tokio::test]
    async fn events_and_a_stop_are_seen_while_an_apply_blocks_and_the_apply_finishes() {
        let (entered_tx, mut entered) = tokio::sync::mpsc::unbounded_channel();
        let (release, release_rx) = mpsc::channel();
        let backend = Arc::new(HeldApply {
            inner: SimulatedBackend::new(&SimNodeSpec::uniform("n0", "0x233010DE", 1)).unwrap(),
            entered: entered_tx,
            release: Mutex::new(release_rx),
            held: Default::default(),
        });
        let gpu = GpuWorker::new(backend.clone(), Arc::new(NoProcesses));
        let labels: BTreeMap<String, String> = [
            (MIG_CONFIG, "all-1g.10gb"),
            ("nvidia.com/gpu.deploy.device-plugin", "true"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let node = MemoryNode::new(labels);
        let config = MigPartedConfig::default_config().unwrap();
        let opts = manager_opts();

        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async {
            let _ = stop_rx.await;
        };
        tokio::pin!(shutdown);
        let (event_tx, event_rx) = tokio::sync::mpsc::unbounded_channel::<&str>();
        let mut events = UnboundedReceiverStream::new(event_rx).fuse();
        let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
        let pass = drive_pass(
            &node,
            &gpu,
            &config,
            &opts,
            shutdown.as_mut(),
            &mut events,
            |e| {
                let _ = seen_tx.send(e);
            },
        );
        tokio::pin!(pass);

        // Run the pass until its apply is held inside the backend.
        tokio::select! {
            end = &mut pass => panic!("the pass ended before its apply was held: {end:?}"),
            Some(()) = entered.recv() => {}
        }
        assert!(gpu.busy());
        // A node event is handled while the apply is held.
        event_tx.send("mig.config changed").unwrap();
        tokio::select! {
            end = &mut pass => panic!("the pass ended while its apply was held: {end:?}"),
            e = seen.recv() => assert_eq!(e, Some("mig.config changed")),
        }
        // The stop is taken now (it is the only branch ready), and the pass
        // waits for the held apply rather than dropping it.
        stop.send(()).unwrap();
        assert!(futures::poll!(&mut pass).is_pending());
        assert!(gpu.busy());
        release.send(()).unwrap();
        let end = pass.await;
        assert!(
            matches!(
                end,
                PassEnd::Stopped {
                    waited_for_gpu: true
                }
            ),
            "{end:?}"
        );
        // The apply ran to its end; nothing was written after the stop.
        assert!(!gpu.busy());
        assert_eq!(instances(backend.as_ref()), [7]);
        let view = node.view();
        assert_eq!(view.labels[MIG_CONFIG_STATE_LABEL], "pending");
        assert!(view.annotations.contains_key(PAUSE_RECORD_ANNOTATION));

        // The next start finishes the pass from the pause record.
        let next = reconcile_on(&node, &gpu, &config, &opts).await.unwrap();
        assert_eq!(next, PassResult::State(MigConfigState::Success, None));
        let view = node.view();
        assert_eq!(view.labels["nvidia.com/gpu.deploy.device-plugin"], "true");
        assert!(!view.annotations.contains_key(PAUSE_RECORD_ANNOTATION));
    }

    #[tokio::test]
    async fn a_pass_without_a_stop_runs_to_its_end_on_the_worker() {
        let backend: Arc<dyn GpuBackend> =
            Arc::new(SimulatedBackend::new(&SimNodeSpec::uniform("n0", "0x233010DE", 2)).unwrap());
        let gpu = GpuWorker::new(backend.clone(), Arc::new(NoProcesses));
        let labels = [(MIG_CONFIG.to_string(), "all-balanced".to_string())].into();
        let node = MemoryNode::new(labels);
        let config = MigPartedConfig::default_config().unwrap();
        let shutdown = std::future::pending::<()>();
        tokio::pin!(shutdown);
        let mut events = futures::stream::empty::<()>().fuse();
        let end = drive_pass(
            &node,
            &gpu,
            &config,
            &manager_opts(),
            shutdown.as_mut(),
            &mut events,
            |()| {},
        )
        .await;
        assert!(
            matches!(
                end,
                PassEnd::Done(Ok(PassResult::State(MigConfigState::Success, None)))
            ),
            "{end:?}"
        );
        assert_eq!(instances(backend.as_ref()), [4, 4]);
    }

    #[tokio::test]
    async fn reboot_hook_sees_the_node_and_reports_failure_and_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("hook");
        let hook = format!("echo \"$NODE_NAME $MIG_CONFIG\" > '{}'", out.display());
        let long = DEFAULT_REBOOT_HOOK_TIMEOUT;
        run_reboot_hook(&hook, "n0", Some("all-1g.10gb"), long)
            .await
            .unwrap();
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "n0 all-1g.10gb\n");

        let e = run_reboot_hook("exit 3", "n0", None, long)
            .await
            .unwrap_err();
        assert!(matches!(e, RebootHookError::Failed { .. }), "{e}");
        assert!(e.to_string().contains("reboot the node by hand"), "{e}");

        // A hook that never ends is killed at the bound, with what it started.
        let pid_file = dir.path().join("pid");
        let hung = format!("sleep 600 & echo $! > '{}'; wait", pid_file.display());
        let e = run_reboot_hook(&hung, "n0", None, Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(matches!(e, RebootHookError::TimedOut { .. }), "{e}");
        assert!(e.to_string().contains("did not finish within"), "{e}");
        let pid: i32 = std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // The background `sleep` went with the hook's process group: gone,
        // or a zombie waiting for whoever reaps orphans here.
        let pid = nix::unistd::Pid::from_raw(pid);
        let stat = format!("/proc/{pid}/stat");
        let dead = || {
            nix::sys::signal::kill(pid, None).is_err()
                || std::fs::read_to_string(&stat)
                    .map(|s| s.rsplit(") ").next().is_some_and(|r| r.starts_with('Z')))
                    .unwrap_or(true)
        };
        let mut gone = false;
        for _ in 0..1000 {
            if dead() {
                gone = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(gone, "the hook's child outlived the timeout");
    }

    const ONE: &str = "version: v1\nmig-configs:\n  all-disabled:\n    - devices: all\n      mig-enabled: false\n";
    const TWO: &str = "version: v1\nmig-configs:\n  all-disabled:\n    - devices: all\n      mig-enabled: false\n  all-enabled:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {}\n";

    #[test]
    fn default_is_the_shipped_file() {
        let c = load_config(Path::new("default")).unwrap();
        assert!(c.config.get("all-1g.10gb").is_some());
    }

    #[test]
    fn missing_or_bad_file_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.yaml");
        let e = load_config(&missing).unwrap_err().to_string();
        assert!(e.contains("nope.yaml") && e.contains("cannot read"), "{e}");
        let bad = dir.path().join("bad.yaml");
        std::fs::write(&bad, "mig-configs: [").unwrap();
        let e = load_config(&bad).unwrap_err().to_string();
        assert!(e.contains("bad.yaml"), "{e}");
    }

    #[test]
    fn watch_reloads_changes_and_keeps_the_old_config_on_a_bad_edit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.yaml");
        std::fs::write(&path, ONE).unwrap();
        let mut w = ConfigWatch::new(path.clone(), load_config(&path).unwrap());
        assert!(!w.poll(), "unchanged content is not a change");
        std::fs::write(&path, TWO).unwrap();
        assert!(w.poll());
        assert!(w.config().get("all-enabled").is_some());
        std::fs::write(&path, "mig-configs: [").unwrap();
        assert!(!w.poll());
        assert!(!w.poll(), "a bad edit is reported once");
        assert!(w.config().get("all-enabled").is_some(), "old config kept");
        std::fs::remove_file(&path).unwrap();
        assert!(!w.poll());
        std::fs::write(&path, ONE).unwrap();
        assert!(w.poll());
        assert!(w.config().get("all-enabled").is_none());
    }
}
