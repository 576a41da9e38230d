//! Background refresh of the kubelet's pod resources. Scrapes read the cached
//! state; the kubelet sees one `List` per refresh interval, whatever the scrape
//! rate. When the kubelet cannot be reached the state says so and carries no
//! pods, so metrics keep serving without pod labels.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gpu_stack_core::metrics::ContainerDevices;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::client::PodResourcesClient;

/// What the cache knows right now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodResourcesState {
    /// Container devices from the last successful `List`; empty while the kubelet is down.
    pub entries: Arc<Vec<ContainerDevices>>,
    /// Whether the last `List` succeeded.
    pub up: bool,
    /// The last error, if the last `List` failed.
    pub last_error: Option<String>,
    /// Number of failed `List` calls so far.
    pub errors: u64,
    /// Number of `List` calls made so far.
    pub refreshes: u64,
}

/// A running background refresher. Dropping it stops the refresh task.
#[derive(Debug)]
pub struct PodResourcesCache {
    rx: watch::Receiver<PodResourcesState>,
    task: JoinHandle<()>,
}

impl PodResourcesCache {
    /// Starts refreshing from `socket` every `interval` (first call at once).
    /// Must be called inside a tokio runtime.
    pub fn start(socket: impl Into<PathBuf>, interval: Duration, call_timeout: Duration) -> Self {
        let (tx, rx) = watch::channel(PodResourcesState::default());
        let mut client = PodResourcesClient::new(socket, call_timeout);
        let task = tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut errors = 0u64;
            let mut refreshes = 0u64;
            loop {
                ticker.tick().await;
                refreshes += 1;
                let next = match client.list().await {
                    Ok(entries) => PodResourcesState {
                        entries: Arc::new(entries),
                        up: true,
                        last_error: None,
                        errors,
                        refreshes,
                    },
                    Err(e) => {
                        errors += 1;
                        tracing::warn!(error = %e, "pod attribution unavailable");
                        PodResourcesState {
                            entries: Arc::new(Vec::new()),
                            up: false,
                            last_error: Some(e.to_string()),
                            errors,
                            refreshes,
                        }
                    }
                };
                // Only wake readers when the attribution actually changed.
                tx.send_if_modified(|cur| {
                    let changed = cur.entries != next.entries || cur.up != next.up;
                    cur.errors = next.errors;
                    cur.refreshes = next.refreshes;
                    cur.last_error = next.last_error.clone();
                    if changed {
                        cur.entries = next.entries.clone();
                        cur.up = next.up;
                    }
                    changed
                });
                if tx.is_closed() {
                    break;
                }
            }
        });
        Self { rx, task }
    }

    /// The current state.
    pub fn state(&self) -> PodResourcesState {
        self.rx.borrow().clone()
    }

    /// A receiver that is notified whenever the attribution changes.
    pub fn subscribe(&self) -> watch::Receiver<PodResourcesState> {
        self.rx.clone()
    }
}

impl Drop for PodResourcesCache {
    fn drop(&mut self) {
        self.task.abort();
    }
}
