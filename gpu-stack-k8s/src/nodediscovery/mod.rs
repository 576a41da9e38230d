//! The node-discovery agent: writes the NFD labels the operator reads
//! (`feature.node.kubernetes.io/pci-10de.present`, `system-os_release.*`,
//! `kernel-version.*`) on its own node where node feature discovery is not
//! installed. What to write is decided by
//! [`gpu_stack_core::nodediscovery::plan_node_patch`]; this module reads the
//! host ([`host`]) and talks to the API server.
//!
//! - Only its own Node, by name: a metadata-only `GET` ([`run_once`]) or a
//!   metadata-only watch with field selector `metadata.name=<node>` ([`run`]).
//! - Writes are one JSON merge patch of `metadata.labels` and the ownership
//!   annotation (the body the MIG manager uses, [`merge_patch_body`]), only
//!   when something changes; the patch response becomes the agent's view
//!   of the node, and watch events older than it are skipped, so the agent
//!   never re-patches from a stale event.
//! - [`run`] re-plans on every change of the node (a label someone deleted is
//!   rewritten) and re-reads the host files every `rescan_interval`. Failed
//!   writes are retried with exponential backoff; the watch backs off by itself.
//!
//! Memory stays small: one current-thread runtime in the binary, node
//! metadata only, no cache beyond the one node.
pub mod host;

use std::future::Future;
use std::time::Duration;

use futures::StreamExt;
use gpu_stack_core::nodediscovery::{NodeDiscoveryPatch, nfd_manages, plan_node_patch};
use gpu_stack_core::operator::labels::Labels;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use kube::core::PartialObjectMeta;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde::Serialize;

use crate::migmanager::NodePatch;
use crate::migmanager::kube_node::merge_patch_body;

pub use host::{HostPaths, KernelRelease, scan};

/// Field manager of the agent's writes (shown in the node's managedFields).
pub const FIELD_MANAGER: &str = "gpu-stack-node-discovery";

/// Failures of the agent.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// A host file could not be read.
    #[error("cannot read {path}: {error}; {hint}")]
    Read {
        /// The file or directory.
        path: std::path::PathBuf,
        /// Why (in the message, so it is not also a `source`).
        error: std::io::Error,
        /// What to check.
        hint: &'static str,
    },
    /// An API call failed.
    #[error("node {node}: {what}: {detail}")]
    Cluster {
        /// The node.
        node: String,
        /// The call.
        what: &'static str,
        /// The error, with a hint for permission and name problems.
        detail: String,
    },
    /// The node watch ended, which it only does when the client is gone.
    #[error("the watch of node {node} ended; restart the agent")]
    WatchEnded {
        /// The node.
        node: String,
    },
}

fn cluster(node: &str, what: &'static str, e: kube::Error) -> DiscoveryError {
    let hint = match &e {
        kube::Error::Api(s) if s.code == 403 => {
            "; give the node-discovery ServiceAccount get, list, watch and patch on nodes"
        }
        kube::Error::Api(s) if s.code == 404 => "; check --node-name (NODE_NAME) names this node",
        _ => "",
    };
    DiscoveryError::Cluster {
        node: node.to_string(),
        what,
        detail: format!("{e}{hint}"),
    }
}

/// Settings of the agent.
#[derive(Debug, Clone)]
pub struct DiscoveryOptions {
    /// This node's name.
    pub node: String,
    /// Where the host facts are read.
    pub paths: HostPaths,
    /// How often [`run`] re-reads the host files.
    pub rescan_interval: Duration,
    /// First pause before retrying a failed write; doubled up to `retry_max`.
    pub retry_min: Duration,
    /// Longest pause between retries.
    pub retry_max: Duration,
}

impl DiscoveryOptions {
    /// Options for `node` with the default paths, a 5 minute rescan and
    /// retries from 1 s to 60 s.
    pub fn new(node: impl Into<String>) -> Self {
        Self {
            node: node.into(),
            paths: HostPaths::default(),
            rescan_interval: Duration::from_secs(300),
            retry_min: Duration::from_secs(1),
            retry_max: Duration::from_secs(60),
        }
    }
}

/// What one pass did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "kebab-case")]
pub enum PassOutcome {
    /// NFD manages the node: nothing written.
    NfdManaged,
    /// The node already carries the labels: nothing written.
    Unchanged,
    /// One patch written.
    Patched {
        /// Labels set.
        set: Vec<String>,
        /// Labels removed.
        removed: Vec<String>,
    },
}

impl PassOutcome {
    fn of(patch: &NodeDiscoveryPatch) -> Self {
        PassOutcome::Patched {
            set: patch.labels.set.keys().cloned().collect(),
            removed: patch.labels.remove.clone(),
        }
    }
}

/// A node's labels and annotations, and the resourceVersion they were read at.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct NodeView {
    labels: Labels,
    annotations: Labels,
    resource_version: Option<String>,
}

impl From<PartialObjectMeta<Node>> for NodeView {
    fn from(meta: PartialObjectMeta<Node>) -> Self {
        let resource_version = meta.resource_version();
        NodeView {
            labels: meta.metadata.labels.unwrap_or_default(),
            annotations: meta.metadata.annotations.unwrap_or_default(),
            resource_version,
        }
    }
}

/// Whether a watch event at `event` is older than the agent's own write at
/// `written`. Resource versions are compared as numbers when both are (etcd's
/// revisions are); anything else counts as not older.
fn is_older(event: Option<&str>, written: Option<&str>) -> bool {
    match (
        event.and_then(|v| v.parse::<u64>().ok()),
        written.and_then(|v| v.parse::<u64>().ok()),
    ) {
        (Some(e), Some(w)) => e < w,
        _ => false,
    }
}

/// Exponential backoff between `min` and `max`.
#[derive(Debug, Clone)]
struct Backoff {
    min: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    fn new(min: Duration, max: Duration) -> Self {
        let min = min.max(Duration::from_millis(1));
        let max = max.max(min);
        Self {
            min,
            max,
            next: min,
        }
    }

    /// The pause before the next retry.
    fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = self.next.saturating_mul(2).min(self.max);
        delay
    }

    fn reset(&mut self) {
        self.next = self.min;
    }
}

/// The agent's access to its own Node.
#[derive(Clone)]
struct OwnNode {
    api: Api<Node>,
    name: String,
}

impl OwnNode {
    fn new(client: Client, name: &str) -> Self {
        Self {
            api: Api::all(client),
            name: name.to_string(),
        }
    }

    async fn get(&self) -> Result<NodeView, DiscoveryError> {
        self.api
            .get_metadata(&self.name)
            .await
            .map(NodeView::from)
            .map_err(|e| cluster(&self.name, "reading the node", e))
    }

    /// Writes the patch; returns the node as the API server stored it.
    async fn patch(&self, patch: &NodeDiscoveryPatch) -> Result<NodeView, DiscoveryError> {
        let body = merge_patch_body(&NodePatch {
            labels: patch.labels.clone(),
            annotations: patch.annotations.clone(),
        });
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_string()),
            ..PatchParams::default()
        };
        self.api
            .patch_metadata(&self.name, &params, &Patch::Merge(&body))
            .await
            .map(NodeView::from)
            .map_err(|e| cluster(&self.name, "patching the node's labels", e))
    }
}

/// One pass: read the host and the node, write one patch if needed.
pub async fn run_once(
    client: Client,
    opts: &DiscoveryOptions,
) -> Result<PassOutcome, DiscoveryError> {
    let desired = scan(&opts.paths)?.labels();
    let node = OwnNode::new(client, &opts.node);
    let view = node.get().await?;
    if nfd_manages(&view.annotations) {
        return Ok(PassOutcome::NfdManaged);
    }
    match plan_node_patch(&desired, &view.labels, &view.annotations) {
        None => Ok(PassOutcome::Unchanged),
        Some(patch) => {
            node.patch(&patch).await?;
            Ok(PassOutcome::of(&patch))
        }
    }
}

/// Runs the agent until `shutdown` resolves (SIGTERM): a pass at start (the
/// watch's first answer), on every change of the node, and when a rescan finds
/// different host facts. A failing first scan is an error (the paths are
/// wrong); a failing rescan keeps the last good facts.
pub async fn run(
    client: Client,
    opts: DiscoveryOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<(), DiscoveryError> {
    let name = opts.node.clone();
    let mut desired = scan(&opts.paths)?.labels();
    let node = OwnNode::new(client.clone(), &name);
    let metas: Api<PartialObjectMeta<Node>> = Api::all(client);
    let watch_cfg = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut events = watcher(metas, watch_cfg).default_backoff().boxed();
    let period = opts.rescan_interval.max(Duration::from_millis(100));
    let mut rescan = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    rescan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    tokio::pin!(shutdown);

    let mut backoff = Backoff::new(opts.retry_min, opts.retry_max);
    // The node as last seen (`None` until the watch's first answer).
    let mut view: Option<NodeView> = None;
    // resourceVersion of the agent's last write, until the watch catches up.
    let mut written: Option<String> = None;
    // Whether the watch's last listing found the node.
    let mut listed = false;
    let mut dirty = false;
    let mut retry_at: Option<tokio::time::Instant> = None;
    let mut nfd_logged = false;
    tracing::info!(node = %name, sysfs = %opts.paths.sysfs_root.display(),
        os_release = %opts.paths.os_release.display(), labels = desired.len(),
        "node discovery started");
    loop {
        if dirty && retry_at.is_none() {
            dirty = false;
            if let Some(current) = &view {
                let managed = nfd_manages(&current.annotations);
                if managed != nfd_logged {
                    nfd_logged = managed;
                    if managed {
                        tracing::info!(node = %name, "NFD manages this node; writing nothing");
                    } else {
                        tracing::info!(node = %name, "NFD no longer manages this node");
                    }
                }
                if let Some(patch) =
                    plan_node_patch(&desired, &current.labels, &current.annotations)
                {
                    let result = tokio::select! {
                        r = node.patch(&patch) => r,
                        () = &mut shutdown => return Ok(()),
                    };
                    match result {
                        Ok(stored) => {
                            backoff.reset();
                            tracing::info!(node = %name, outcome = ?PassOutcome::of(&patch), "node labels written");
                            written = stored.resource_version.clone();
                            view = Some(stored);
                        }
                        Err(e) => {
                            let delay = backoff.next_delay();
                            tracing::warn!(error = %e, retry_in = ?delay, "writing node labels failed; retrying");
                            retry_at = Some(tokio::time::Instant::now() + delay);
                            dirty = true;
                        }
                    }
                }
            }
        }
        let retry = tokio::time::sleep_until(retry_at.unwrap_or_else(tokio::time::Instant::now));
        tokio::select! {
            () = &mut shutdown => {
                tracing::info!(node = %name, "node discovery stopped");
                return Ok(());
            }
            event = events.next() => match event {
                Some(Ok(watcher::Event::Apply(meta) | watcher::Event::InitApply(meta))) => {
                    listed = true;
                    let seen = NodeView::from(meta);
                    if is_older(seen.resource_version.as_deref(), written.as_deref()) {
                        tracing::debug!(node = %name, "skipping a watch event older than our write");
                    } else {
                        written = None;
                        if view.as_ref() != Some(&seen) {
                            view = Some(seen);
                            dirty = true;
                        }
                    }
                }
                Some(Ok(watcher::Event::Init)) => listed = false,
                Some(Ok(watcher::Event::InitDone)) => {
                    if !listed {
                        tracing::warn!(node = %name,
                            "no Node of this name; waiting for it (check --node-name / NODE_NAME)");
                        view = None;
                    }
                }
                Some(Ok(watcher::Event::Delete(_))) => {
                    tracing::info!(node = %name, "the Node was deleted; waiting for it to come back");
                    view = None;
                    written = None;
                }
                Some(Err(e)) => tracing::warn!(error = %e, "node watch error; the watch retries"),
                None => return Err(DiscoveryError::WatchEnded { node: name }),
            },
            _ = rescan.tick() => match scan(&opts.paths) {
                Ok(facts) => {
                    let labels = facts.labels();
                    if labels != desired {
                        tracing::info!(node = %name, labels = labels.len(), "host facts changed");
                        desired = labels;
                        dirty = true;
                    }
                }
                Err(e) => tracing::warn!(error = %e, "rescan failed; keeping the labels of the last good scan"),
            },
            () = retry, if retry_at.is_some() => retry_at = None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn older_events_are_recognised_only_by_number() {
        assert!(is_older(Some("41"), Some("42")));
        assert!(!is_older(Some("42"), Some("42")));
        assert!(!is_older(Some("43"), Some("42")));
        assert!(!is_older(Some("x"), Some("42")));
        assert!(!is_older(Some("41"), None));
        assert!(!is_older(None, Some("42")));
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(5));
        let delays: Vec<u64> = (0..5).map(|_| b.next_delay().as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 5, 5]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_secs(1));
        // A zero minimum still waits.
        let mut z = Backoff::new(Duration::ZERO, Duration::ZERO);
        assert!(z.next_delay() > Duration::ZERO);
    }

    #[test]
    fn outcomes_serialise_for_the_once_report() {
        let o = PassOutcome::Patched {
            set: vec!["a".into()],
            removed: vec![],
        };
        assert_eq!(
            serde_json::to_value(&o).unwrap(),
            serde_json::json!({"outcome": "patched", "set": ["a"], "removed": []})
        );
        assert_eq!(
            serde_json::to_value(PassOutcome::NfdManaged).unwrap(),
            serde_json::json!({"outcome": "nfd-managed"})
        );
    }

    #[test]
    fn permission_errors_say_which_verbs() {
        let status = kube::core::Status::failure("forbidden", "Forbidden").with_code(403);
        let e = cluster(
            "n",
            "patching the node's labels",
            kube::Error::Api(Box::new(status)),
        );
        let msg = e.to_string();
        assert!(msg.contains("get, list, watch and patch on nodes"), "{msg}");
    }
}
