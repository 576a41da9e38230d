//! The toolkit agent: makes the node's container runtime inject GPUs through
//! CDI, with no runtime shim. It writes the host's CDI spec (by the caller),
//! a runtime drop-in and the `imports` line (see [`agent`]), restarts the
//! runtime only when its effective configuration changes, and undoes its
//! changes when the component is removed from the node, not when its pod is
//! merely restarted or upgraded.

pub mod agent;
pub mod cri;
#[cfg(test)]
pub(crate) mod fake_runtime;

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use kube::runtime::{WatchStreamExt, watcher};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::{Api, Client};

pub use agent::{Outcome, Plan, RestartMode, RuntimeKind, ToolkitConfig, ToolkitError};

/// Where host path `path` is under `root` (the host's root as this process
/// sees it), following the host's symlinks inside `root`: `/var/run` links to
/// `/run` on the host, which must not resolve to this container's `/run`.
pub fn host_path(root: &Path, path: &str) -> PathBuf {
    let mut todo: VecDeque<String> = path.split('/').map(String::from).collect();
    let mut done: Vec<String> = Vec::new();
    let mut hops = 0;
    while let Some(part) = todo.pop_front() {
        match part.as_str() {
            "" | "." => continue,
            ".." => {
                done.pop();
                continue;
            }
            _ => {}
        }
        let here = root.join(done.join("/")).join(&part);
        match std::fs::read_link(&here) {
            // Bounded like the kernel's 40 links per lookup.
            Ok(target) if hops < 40 => {
                hops += 1;
                let target = target.to_string_lossy().into_owned();
                if target.starts_with('/') {
                    done.clear();
                }
                for p in target.split('/').rev() {
                    todo.push_front(p.to_string());
                }
            }
            _ => done.push(part),
        }
    }
    root.join(done.join("/"))
}

/// The node label that selects the toolkit for a node.
pub const DEPLOY_LABEL: &str = "nvidia.com/gpu.deploy.container-toolkit";

/// Who the agent's pod is, to decide at SIGTERM whether the component is
/// going away.
#[derive(Debug, Clone)]
pub struct PodIdentity {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub name: String,
    /// The node's name.
    pub node: String,
}

/// Whether the node's deploy label still selects the toolkit.
fn selects_toolkit(node: &Node) -> bool {
    node.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(DEPLOY_LABEL))
        .is_some_and(|v| v == "true")
}

/// Whether the toolkit is being removed from this node: its DaemonSet is gone
/// or being deleted (ClusterPolicy deleted, toolkit disabled, uninstall), or
/// the node no longer selects it. A rolling update, an eviction or a reboot
/// keeps the configuration, so the runtime is not restarted for nothing.
pub async fn component_removed(client: &Client, who: &PodIdentity) -> Result<bool, kube::Error> {
    let nodes: Api<Node> = Api::all(client.clone());
    if !selects_toolkit(&nodes.get(&who.node).await?) {
        return Ok(true);
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), &who.namespace);
    let Some(owner) = pods.get_opt(&who.name).await?.and_then(owner_daemonset) else {
        return Ok(false);
    };
    let sets: Api<DaemonSet> = Api::namespaced(client.clone(), &who.namespace);
    Ok(daemonset_leaving(
        sets.get_opt(&owner.name).await?.as_ref(),
        &owner,
    ))
}

/// The DaemonSet that owns `pod`, if any.
fn owner_daemonset(pod: Pod) -> Option<OwnerReference> {
    pod.metadata
        .owner_references
        .unwrap_or_default()
        .into_iter()
        .find(|o| o.kind == "DaemonSet")
}

/// Whether the pod's DaemonSet is going: gone, being deleted, or replaced by
/// another of the same name (a new uid).
fn daemonset_leaving(now: Option<&DaemonSet>, owner: &OwnerReference) -> bool {
    now.is_none_or(|ds| {
        ds.metadata.deletion_timestamp.is_some()
            || ds.metadata.uid.as_deref() != Some(owner.uid.as_str())
    })
}

/// What the agent last saw of its DaemonSet and Node, kept up to date by
/// watches started while its RBAC still exists: when the component is
/// removed, the operator deletes the agent's role with the DaemonSet, so a
/// check made only at SIGTERM may be refused.
#[derive(Clone, Default)]
pub struct RemovalWatch {
    daemonset_gone: Arc<AtomicBool>,
    node_deselected: Arc<AtomicBool>,
}

impl RemovalWatch {
    /// Finds the pod's DaemonSet and watches it and the Node.
    pub async fn start(client: &Client, who: &PodIdentity) -> Result<Self, kube::Error> {
        let pods: Api<Pod> = Api::namespaced(client.clone(), &who.namespace);
        let owner = owner_daemonset(pods.get(&who.name).await?);
        let state = Self::default();
        if let Some(owner) = owner {
            let sets: Api<DaemonSet> = Api::namespaced(client.clone(), &who.namespace);
            let gone = state.daemonset_gone.clone();
            let config =
                watcher::Config::default().fields(&format!("metadata.name={}", owner.name));
            tokio::spawn(async move {
                let mut seen = false;
                let mut events = std::pin::pin!(watcher::watcher(sets, config).default_backoff());
                while let Some(event) = events.next().await {
                    match event {
                        Ok(watcher::Event::Apply(ds) | watcher::Event::InitApply(ds)) => {
                            seen = true;
                            gone.store(daemonset_leaving(Some(&ds), &owner), Ordering::SeqCst);
                        }
                        Ok(watcher::Event::Delete(_)) => gone.store(true, Ordering::SeqCst),
                        Ok(watcher::Event::Init) => seen = false,
                        Ok(watcher::Event::InitDone) => {
                            if !seen {
                                gone.store(true, Ordering::SeqCst);
                            }
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "watching the toolkit's DaemonSet; retrying");
                        }
                    }
                }
            });
        }
        let nodes: Api<Node> = Api::all(client.clone());
        let deselected = state.node_deselected.clone();
        let config = watcher::Config::default().fields(&format!("metadata.name={}", who.node));
        tokio::spawn(async move {
            let mut events = std::pin::pin!(watcher::watcher(nodes, config).default_backoff());
            while let Some(event) = events.next().await {
                match event {
                    Ok(watcher::Event::Apply(node) | watcher::Event::InitApply(node)) => {
                        deselected.store(!selects_toolkit(&node), Ordering::SeqCst);
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "watching the toolkit's Node; retrying"),
                }
            }
        });
        Ok(state)
    }

    /// Whether the last events said the toolkit is leaving this node.
    pub fn removed(&self) -> bool {
        self.daemonset_gone.load(Ordering::SeqCst) || self.node_deselected.load(Ordering::SeqCst)
    }
}

/// Configures the runtime, then re-checks every `recheck` (a file removed by
/// hand, a runtime reinstalled) until `stop` resolves. Errors of a re-check
/// are logged and retried; the first configuration's error is returned.
pub async fn run(
    config: &ToolkitConfig,
    recheck: Duration,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), ToolkitError> {
    let started = std::time::Instant::now();
    let out = config.configure().await?;
    log_outcome(&out, started.elapsed());
    tokio::pin!(stop);
    let mut tick = tokio::time::interval(recheck);
    tick.tick().await;
    loop {
        tokio::select! {
            () = &mut stop => return Ok(()),
            _ = tick.tick() => {
                let t = std::time::Instant::now();
                match config.configure().await {
                    Ok(out) => log_outcome(&out, t.elapsed()),
                    Err(e) => tracing::warn!(error = %e, "re-check failed; retrying at the next one"),
                }
            }
        }
    }
}

fn log_outcome(out: &Outcome, took: Duration) {
    if out.changed.is_empty() && out.restarts == 0 {
        tracing::info!(
            took_ms = took.as_millis() as u64,
            "container runtime already configured: nothing written, no restart"
        );
    } else {
        tracing::info!(
            took_ms = took.as_millis() as u64,
            files = ?out.changed,
            restarts = out.restarts,
            "container runtime configured"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_daemonset_is_leaving_when_gone_deleting_or_replaced() {
        let owner = OwnerReference {
            kind: "DaemonSet".into(),
            name: "tk".into(),
            uid: "u1".into(),
            ..Default::default()
        };
        let ds = |uid: &str, deleting: bool| DaemonSet {
            metadata: kube::api::ObjectMeta {
                uid: Some(uid.into()),
                deletion_timestamp: deleting.then(|| {
                    k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Default::default())
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        assert!(daemonset_leaving(None, &owner));
        assert!(daemonset_leaving(Some(&ds("u1", true)), &owner));
        assert!(daemonset_leaving(Some(&ds("u2", false)), &owner));
        assert!(
            !daemonset_leaving(Some(&ds("u1", false)), &owner),
            "a rolling update keeps it"
        );
        let pod = Pod {
            metadata: kube::api::ObjectMeta {
                owner_references: Some(vec![owner.clone()]),
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(owner_daemonset(pod).map(|o| o.uid), Some("u1".to_string()));
        assert!(owner_daemonset(Pod::default()).is_none());
    }

    #[test]
    fn host_paths_follow_the_hosts_symlinks_inside_the_root() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        std::fs::create_dir_all(r.join("run/cdi")).unwrap();
        std::fs::create_dir_all(r.join("var")).unwrap();
        std::os::unix::fs::symlink("/run", r.join("var/run")).unwrap();
        std::os::unix::fs::symlink("../../run/cdi", r.join("var/cdi-rel")).unwrap();
        assert_eq!(
            host_path(r, "/var/run/cdi/x.json"),
            r.join("run/cdi/x.json")
        );
        assert_eq!(host_path(r, "/var/cdi-rel/x"), r.join("run/cdi/x"));
        assert_eq!(
            host_path(r, "/etc/containerd/config.toml"),
            r.join("etc/containerd/config.toml")
        );
        // `..` never leaves the root.
        assert_eq!(host_path(r, "/../../etc"), r.join("etc"));
        // A loop ends.
        std::os::unix::fs::symlink("/loop", r.join("loop")).unwrap();
        let _ = host_path(r, "/loop/x");
    }
}
