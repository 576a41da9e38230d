//! Running the device plugins of a node: one gRPC server per resource on
//! `<kubelet-dir>/nvidia-<name>.sock`, served before registering with the
//! kubelet; health updates pushed to every `ListAndWatch` stream; clean stop
//! on shutdown.
//!
//! Re-registration follows the kubelet's directory (inotify), by the rules
//! of [`crate::kubelet::deviceplugin::registration`]: any creation of
//! `kubelet.sock` means registering again, and a removed plugin socket means
//! serving it again (then registering). Events are gathered for
//! [`DIR_SETTLE`] and acted on once, so a kubelet restart (removals, then the
//! creation) leads to one registration. A check on each probe tick catches
//! lost events.
//!
//! Nothing queues without bound: health events come over a channel of
//! [`HEALTH_EVENT_BUFFER`], directory changes are folded into one
//! [`DirChanges`] value as they happen, and device lists reach the
//! `ListAndWatch` streams as the latest value of a watch channel.

use std::collections::BTreeSet;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_stack_core::deviceplugin::allocate::NvlinkMap;
use gpu_stack_core::deviceplugin::{HealthEvent, HealthPolicy, HealthTracker, Resource, Settings};
use notify::Watcher;
use tokio::net::UnixListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::health::HealthProbe;
use crate::kubelet::deviceplugin::api;
use crate::kubelet::deviceplugin::registration::{
    DEFAULT_KUBELET_DIR, DirAction, DirChanges, KUBELET_SOCKET, dir_action, kubelet_restarted,
    register, socket_identity,
};
use crate::kubelet::deviceplugin::server::{PluginService, wire_devices};
use crate::kubelet::transport::unix_incoming;

/// How long changes in the kubelet directory are gathered before the
/// plugins act on them.
pub const DIR_SETTLE: Duration = Duration::from_millis(100);

/// Health events queued between their source (the backend's health thread)
/// and the plugins' loop. The loop applies an event in microseconds, so the
/// queue only fills in a burst while the loop is busy elsewhere (registering
/// with the kubelet, restarting its servers); 256 holds an Xid on every MIG
/// device of an 8-GPU node several times over. An event is a fault, not a
/// state that a later event replaces, so none is dropped: when the queue is
/// full the sender waits (the health thread does so in short steps, still
/// seeing its stop flag) while the backend keeps the events it has not
/// handed over yet. The loop itself never waits on the queue.
pub const HEALTH_EVENT_BUFFER: usize = 256;

/// Errors running the plugins.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// The socket could not be created.
    #[error(
        "cannot listen on {path}: {source}; check that the kubelet device-plugins directory exists and is writable (--kubelet-dir)"
    )]
    Bind {
        /// Socket path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The kubelet directory could not be watched.
    #[error("cannot watch {path} for kubelet restarts: {message}")]
    Watch {
        /// Directory.
        path: PathBuf,
        /// Cause.
        message: String,
    },
    /// No resource to advertise.
    #[error(
        "no GPU devices to advertise on this node; check the backend inventory and the MIG strategy"
    )]
    NoDevices,
}

/// Socket file name of a resource: `nvidia-gpu.sock`, `nvidia-mig-1g.5gb.sock`.
pub fn socket_name(resource: &Resource) -> String {
    format!("nvidia-{}.sock", resource.short_name())
}

/// How the plugins run.
#[derive(Debug, Clone)]
pub struct PluginOptions {
    /// Kubelet device-plugins directory.
    pub kubelet_dir: PathBuf,
    /// Register with the kubelet (off: serve only).
    pub register: bool,
    /// Health policy (ignored Xids, recovery quiet period).
    pub health: HealthPolicy,
    /// How often faulted devices are probed and registration is retried.
    pub probe_interval: Duration,
}

impl Default for PluginOptions {
    fn default() -> Self {
        PluginOptions {
            kubelet_dir: PathBuf::from(DEFAULT_KUBELET_DIR),
            register: true,
            health: HealthPolicy::default(),
            probe_interval: Duration::from_secs(5),
        }
    }
}

struct Running {
    stop: watch::Sender<bool>,
    servers: Vec<(PathBuf, JoinHandle<()>)>,
}

impl Running {
    async fn shutdown(self) {
        let _ = self.stop.send(true);
        for (path, handle) in self.servers {
            // Streams end on the stop signal, so graceful shutdown is quick; bound it anyway.
            let abort = handle.abort_handle();
            if tokio::time::timeout(Duration::from_secs(5), handle)
                .await
                .is_err()
            {
                abort.abort();
            }
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// The device plugins of one node.
pub struct DevicePlugins {
    resources: Vec<Arc<Resource>>,
    settings: Arc<Settings>,
    nvlinks: Arc<NvlinkMap>,
    options: PluginOptions,
    probe: Option<Arc<dyn HealthProbe>>,
    health_tx: mpsc::Sender<HealthEvent>,
    health_rx: mpsc::Receiver<HealthEvent>,
}

impl DevicePlugins {
    /// Plugins for `resources` (from `node_resources`).
    pub fn new(
        resources: Vec<Resource>,
        settings: Settings,
        nvlinks: NvlinkMap,
        options: PluginOptions,
    ) -> DevicePlugins {
        let (health_tx, health_rx) = mpsc::channel(HEALTH_EVENT_BUFFER);
        DevicePlugins {
            resources: resources.into_iter().map(Arc::new).collect(),
            settings: Arc::new(settings),
            nvlinks: Arc::new(nvlinks),
            options,
            probe: None,
            health_tx,
            health_rx,
        }
    }

    /// Sets the probe that decides whether a faulted device answers again.
    pub fn with_probe(mut self, probe: Arc<dyn HealthProbe>) -> DevicePlugins {
        self.probe = Some(probe);
        self
    }

    /// Where health events go (from the backend pump, or tests); it holds
    /// [`HEALTH_EVENT_BUFFER`] events the plugins have not applied yet.
    pub fn health_sender(&self) -> mpsc::Sender<HealthEvent> {
        self.health_tx.clone()
    }

    /// Serves, registers and keeps the plugins up until `shutdown` completes;
    /// then stops the servers and removes the sockets.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) -> Result<(), PluginError> {
        if self.resources.is_empty() {
            return Err(PluginError::NoDevices);
        }
        let dir = self.options.kubelet_dir.clone();
        let kubelet_sock = dir.join(KUBELET_SOCKET);
        let ours = self.socket_paths();
        // Directory changes are noted on the watcher's thread into one value
        // the loop takes when they settle: a burst of events costs nothing
        // more than one, and none is lost while the loop is busy. Receivers
        // are told only when a change adds something.
        let dir_changes = watch::Sender::new(DirChanges::default());
        let mut dir_rx = dir_changes.subscribe();
        let noted = dir_changes.clone();
        let (watched_sock, watched_ours) = (kubelet_sock.clone(), ours.clone());
        let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            if let Ok(ev) = res {
                noted.send_if_modified(|changes| {
                    let before = *changes;
                    changes.note(&ev, &watched_sock, &watched_ours);
                    *changes != before
                });
            }
        })
        .map_err(|e| PluginError::Watch {
            path: dir.clone(),
            message: e.to_string(),
        })?;
        watcher
            .watch(&dir, notify::RecursiveMode::NonRecursive)
            .map_err(|e| PluginError::Watch {
                path: dir.clone(),
                message: e.to_string(),
            })?;

        let start = Instant::now();
        let now_ms = || u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
        let mut tracker = HealthTracker::new(self.options.health.clone());
        let senders: Vec<watch::Sender<Arc<Vec<api::Device>>>> = self
            .resources
            .iter()
            .map(|r| watch::channel(Arc::new(wire_devices(r, |u, g| tracker.is_healthy(u, g)))).0)
            .collect();
        let publish = |tracker: &HealthTracker| {
            for (r, tx) in self.resources.iter().zip(&senders) {
                let devices = wire_devices(r, |u, g| tracker.is_healthy(u, g));
                tx.send_if_modified(|cur| {
                    if **cur == devices {
                        false
                    } else {
                        *cur = Arc::new(devices);
                        true
                    }
                });
            }
        };

        tokio::pin!(shutdown);
        let mut ticker = tokio::time::interval(self.options.probe_interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut generation = 0u64;
        // Directory changes (in `dir_changes`) are gathered until `settle_at`.
        let mut settle_at: Option<tokio::time::Instant> = None;
        'restart: loop {
            generation += 1;
            let running = self.serve_all(&senders)?;
            let mut kubelet_id = socket_identity(&kubelet_sock);
            let mut registered = if self.options.register {
                self.register_all(&kubelet_sock).await
            } else {
                true
            };
            tracing::info!(generation, registered, "device plugins serving");
            // The safety net acts on a condition seen on two ticks in a row
            // with no directory event between them, so it never races the
            // events of a change in progress.
            let mut suspect = false;
            loop {
                let settle_deadline = settle_at;
                let settle_sleep = async move {
                    match settle_deadline {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending::<()>().await,
                    }
                };
                let recovery_at = tracker.next_recovery_ms();
                let recovery_sleep = async {
                    match recovery_at {
                        Some(at) => {
                            tokio::time::sleep(Duration::from_millis(at.saturating_sub(now_ms())))
                                .await
                        }
                        None => std::future::pending::<()>().await,
                    }
                };
                tokio::select! {
                    () = &mut shutdown => {
                        tracing::info!("stopping device plugins");
                        running.shutdown().await;
                        return Ok(());
                    }
                    Ok(()) = dir_rx.changed() => {
                        if dir_rx.borrow_and_update().any() {
                            suspect = false;
                            settle_at.get_or_insert_with(|| tokio::time::Instant::now() + DIR_SETTLE);
                        }
                    }
                    () = settle_sleep => {
                        // Taken without telling the receiver: emptying is not a change.
                        let mut seen = DirChanges::default();
                        dir_changes.send_if_modified(|changes| {
                            seen = std::mem::take(changes);
                            false
                        });
                        settle_at = None;
                        let missing = ours.iter().any(|p| !p.exists());
                        match dir_action(seen, missing, kubelet_sock.exists(), self.options.register) {
                            DirAction::Nothing => {}
                            DirAction::Register => {
                                tracing::info!(?seen, "kubelet socket created; registering again");
                                kubelet_id = socket_identity(&kubelet_sock);
                                registered = self.register_all(&kubelet_sock).await;
                            }
                            DirAction::Restart => {
                                tracing::info!(?seen, "a plugin socket was removed; serving it again and registering");
                                running.shutdown().await;
                                continue 'restart;
                            }
                        }
                    }
                    Some(ev) = self.health_rx.recv() => {
                        if tracker.apply(&ev, now_ms()) {
                            tracing::warn!(event = ?ev, "device health changed");
                            publish(&tracker);
                        }
                    }
                    () = recovery_sleep => {
                        if tracker.tick(now_ms()) {
                            tracing::info!("device(s) recovered");
                            publish(&tracker);
                        }
                    }
                    _ = ticker.tick() => {
                        if let Some(probe) = &self.probe {
                            let faulted = tracker.uncleared();
                            let probe = probe.clone();
                            let all = tracker.all_devices_faulted();
                            let answered = tokio::task::spawn_blocking(move || {
                                faulted.into_iter().filter(|u| probe.responds(u)).collect::<Vec<_>>()
                            }).await.unwrap_or_default();
                            let mut changed = false;
                            for uuid in answered {
                                changed |= tracker.apply(&HealthEvent::Cleared { uuid }, now_ms());
                            }
                            if all {
                                changed |= tracker.apply(&HealthEvent::Cleared { uuid: String::new() }, now_ms());
                            }
                            if changed {
                                publish(&tracker);
                            }
                        }
                        // Safety net for lost directory events: the kubelet socket
                        // was replaced by one with another inode, or ours vanished
                        // while the kubelet's is up.
                        let sockets_gone = running.servers.iter().any(|(p, _)| !p.exists());
                        let kubelet_up = kubelet_sock.exists();
                        let off = self.options.register
                            && settle_at.is_none()
                            && (kubelet_restarted(&kubelet_sock, kubelet_id) || (sockets_gone && kubelet_up));
                        if off && suspect {
                            tracing::info!("kubelet restarted or plugin socket removed, with no directory event; restarting plugins");
                            running.shutdown().await;
                            continue 'restart;
                        }
                        suspect = off;
                        // A change being gathered registers when it settles.
                        if !registered && settle_at.is_none() {
                            kubelet_id = socket_identity(&kubelet_sock);
                            registered = self.register_all(&kubelet_sock).await;
                        }
                    }
                }
            }
        }
    }

    /// The sockets the plugins serve, each once.
    fn socket_paths(&self) -> Vec<PathBuf> {
        let mut paths: Vec<PathBuf> = self
            .resources
            .iter()
            .map(|r| self.options.kubelet_dir.join(socket_name(r)))
            .collect();
        paths.sort();
        paths.dedup();
        paths
    }

    fn serve_all(
        &self,
        senders: &[watch::Sender<Arc<Vec<api::Device>>>],
    ) -> Result<Running, PluginError> {
        let (stop, stop_rx) = watch::channel(false);
        let mut servers = Vec::new();
        let mut seen = BTreeSet::new();
        for (r, tx) in self.resources.iter().zip(senders) {
            let path = self.options.kubelet_dir.join(socket_name(r));
            if !seen.insert(path.clone()) {
                continue;
            }
            let _ = std::fs::remove_file(&path);
            let listener = match UnixListener::bind(&path) {
                Ok(l) => l,
                Err(source) => {
                    let _ = stop.send(true);
                    return Err(PluginError::Bind { path, source });
                }
            };
            let service = PluginService::new(
                r.clone(),
                self.settings.clone(),
                self.nvlinks.clone(),
                tx.subscribe(),
                stop_rx.clone(),
            );
            let mut stop_wait = stop_rx.clone();
            let name = r.name.clone();
            let handle = tokio::spawn(async move {
                let res = tonic::transport::Server::builder()
                    .add_service(api::device_plugin_server::DevicePluginServer::new(service))
                    .serve_with_incoming_shutdown(unix_incoming(listener), async move {
                        let _ = stop_wait.wait_for(|s| *s).await;
                    })
                    .await;
                if let Err(e) = res {
                    tracing::error!(resource = %name, error = %e, "device plugin server failed");
                }
            });
            servers.push((path, handle));
        }
        Ok(Running { stop, servers })
    }

    /// Registers every resource; logs and returns false on the first failure
    /// (retried on the next probe tick or kubelet restart).
    async fn register_all(&self, kubelet_sock: &Path) -> bool {
        for r in &self.resources {
            if let Err(e) = register(kubelet_sock, &socket_name(r), &r.name).await {
                tracing::warn!(error = %e, "registration failed; will retry");
                return false;
            }
            tracing::info!(resource = %r.name, "registered with the kubelet");
        }
        true
    }
}
