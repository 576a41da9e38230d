//! What the upgrade controller reads, kept current by watches, so that a
//! pass reads memory and never lists: the ClusterPolicies, the driver
//! DaemonSets and their ControllerRevisions, the driver and validator pods
//! (each watch filtered by label), and the nodes (the reconcile pass's
//! store, shared). Every object is stripped to the fields the flow reads
//! before it is stored (pods into a [`WatchedPod`]), so the caches of a
//! large fleet stay small.
use futures::stream::BoxStream;
use futures::{StreamExt, future};
use gpu_stack_core::operator::upgrade::state::VALIDATOR_POD_SELECTOR;
use k8s_openapi::api::apps::v1::{ControllerRevision, DaemonSet, DaemonSetSpec, DaemonSetStatus};
use std::borrow::Cow;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use kube::runtime::reflector::{Lookup, Store};
use kube::runtime::watcher;
use kube::{Api, Client};

use super::DRIVER_SELECTOR;
use super::observe::REVISION_HASH_LABEL;
use crate::operator::clusterpolicy::ClusterPolicy;
use crate::operator::controller::watches::{
    CacheError, NodeStore, synced, watch_stripped, watch_summarized,
};

/// The caches an upgrade pass reads.
#[derive(Clone)]
pub struct UpgradeStores {
    /// Nodes (shared with the reconcile pass; see
    /// [`crate::operator::controller::watches::WatchedNode`]).
    pub nodes: NodeStore,
    /// ClusterPolicies.
    pub policies: Store<ClusterPolicy>,
    /// Driver DaemonSets: identity, generation and observed generation.
    pub daemonsets: Store<DaemonSet>,
    /// Their ControllerRevisions, without the templates they hold.
    pub revisions: Store<ControllerRevision>,
    /// Driver pods.
    pub driver_pods: Store<WatchedPod>,
    /// Validator and node-agent pods.
    pub validator_pods: Store<WatchedPod>,
}

impl UpgradeStores {
    /// Starts the watches of operands in `namespace`; `nodes` is the node
    /// cache the reconcile pass keeps. The stream must be polled to keep the
    /// stores fed; it yields when a policy, a driver DaemonSet or a revision
    /// changes (pod changes feed the stores without triggering a pass: the
    /// loop's own pace follows pods mid-upgrade).
    pub fn start(
        client: &Client,
        namespace: &str,
        nodes: NodeStore,
    ) -> (Self, BoxStream<'static, ()>) {
        let mut triggers = Vec::new();
        let mut fed = Vec::new();
        let driver = || watcher::Config::default().labels(DRIVER_SELECTOR);
        let stores = Self {
            nodes,
            policies: watch_stripped(
                Api::all(client.clone()),
                watcher::Config::default(),
                |p: &mut ClusterPolicy| p.metadata.managed_fields = None,
                &mut triggers,
            ),
            daemonsets: watch_stripped(
                Api::namespaced(client.clone(), namespace),
                driver(),
                strip_daemonset,
                &mut triggers,
            ),
            revisions: watch_stripped(
                Api::namespaced(client.clone(), namespace),
                driver(),
                strip_revision,
                &mut triggers,
            ),
            driver_pods: watch_summarized(
                Api::<Pod>::namespaced(client.clone(), namespace),
                driver(),
                WatchedPod::from,
                &mut fed,
            ),
            validator_pods: watch_summarized(
                Api::<Pod>::namespaced(client.clone(), namespace),
                watcher::Config::default().labels(VALIDATOR_POD_SELECTOR),
                WatchedPod::from,
                &mut fed,
            ),
        };
        let fed = futures::stream::select_all(fed).filter_map(|()| future::ready(None));
        let all = futures::stream::select(futures::stream::select_all(triggers), fed);
        (stores, all.boxed())
    }

    /// Waits until every watch has completed its first list.
    pub async fn wait_until_synced(&self) -> Result<(), CacheError> {
        synced("Node", &self.nodes).await?;
        synced("ClusterPolicy", &self.policies).await?;
        synced("DaemonSet", &self.daemonsets).await?;
        synced("ControllerRevision", &self.revisions).await?;
        synced("Pod", &self.driver_pods).await?;
        synced("Pod", &self.validator_pods).await
    }
}

/// A driver or validator pod as the upgrade caches keep it: the fields the
/// flow reads, moved out of the decoded [`Pod`]. A `Pod` stripped of
/// everything else would still take about 2.5 KB of empty fields (its spec
/// and status are inline); this is its strings and little more.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WatchedPod {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: Option<String>,
    /// The node it is bound to.
    pub node: Option<String>,
    /// Its `controller-revision-hash` label.
    pub revision: Option<String>,
    /// Kind and UID of its controller.
    pub controller: Option<(String, String)>,
    /// Whether its deletion has begun.
    pub terminating: bool,
    /// Phase (`Running`, ...), empty when unknown.
    pub phase: String,
    /// Each container's readiness and restart count.
    pub containers: Vec<(bool, i32)>,
}

impl From<Pod> for WatchedPod {
    fn from(pod: Pod) -> Self {
        let meta = pod.metadata;
        let status = pod.status.unwrap_or_default();
        WatchedPod {
            namespace: meta.namespace.unwrap_or_default(),
            name: meta.name.unwrap_or_default(),
            uid: meta.uid,
            node: pod.spec.and_then(|s| s.node_name),
            revision: meta.labels.and_then(|mut l| l.remove(REVISION_HASH_LABEL)),
            controller: meta
                .owner_references
                .into_iter()
                .flatten()
                .find(|o| o.controller == Some(true))
                .map(|o| (o.kind, o.uid)),
            terminating: meta.deletion_timestamp.is_some(),
            phase: status.phase.unwrap_or_default(),
            containers: status
                .container_statuses
                .into_iter()
                .flatten()
                .map(|c| (c.ready, c.restart_count))
                .collect(),
        }
    }
}

impl Lookup for WatchedPod {
    type DynamicType = ();

    fn kind(_: &()) -> Cow<'_, str> {
        "Pod".into()
    }

    fn group(_: &()) -> Cow<'_, str> {
        "".into()
    }

    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }

    fn plural(_: &()) -> Cow<'_, str> {
        "pods".into()
    }

    fn name(&self) -> Option<Cow<'_, str>> {
        Some(self.name.as_str().into())
    }

    fn namespace(&self) -> Option<Cow<'_, str>> {
        Some(self.namespace.as_str().into())
    }

    fn resource_version(&self) -> Option<Cow<'_, str>> {
        None
    }

    fn uid(&self) -> Option<Cow<'_, str>> {
        self.uid.as_deref().map(Into::into)
    }
}

/// Cuts a ControllerRevision down to its identity, labels, owners and
/// revision number: the template it stores is never read.
pub fn strip_revision(r: &mut ControllerRevision) {
    r.metadata.managed_fields = None;
    r.metadata.annotations = None;
    r.data = RawExtension(serde_json::Value::Null);
}

/// Cuts a DaemonSet down to its identity, generation and observed
/// generation: the flow reads revisions from the ControllerRevisions.
pub fn strip_daemonset(ds: &mut DaemonSet) {
    ds.metadata.managed_fields = None;
    ds.metadata.annotations = None;
    ds.spec = DaemonSetSpec::default();
    ds.status = ds.status.take().map(|s| DaemonSetStatus {
        observed_generation: s.observed_generation,
        ..DaemonSetStatus::default()
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::operator::upgrade::observe::{PodView, pod_ready};
    use serde_json::json;

    #[test]
    fn a_stored_pod_keeps_what_the_flow_reads() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {
                "name": "driver-x", "namespace": "gpu", "uid": "u",
                "labels": {"app": "nvidia-driver-daemonset", REVISION_HASH_LABEL: "abc"},
                "annotations": {"a": "b"},
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Other", "name": "o", "uid": "o"},
                    {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "d", "uid": "ds", "controller": true},
                ],
                "deletionTimestamp": "2026-12-07T10:00:00Z",
            },
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i", "args": ["x"]}]},
            "status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True"}],
                "containerStatuses": [{"name": "c", "image": "i", "imageID": "id", "ready": true,
                                       "restartCount": 3, "state": {"running": {}}}],
            },
        }))
        .unwrap();
        let watched = WatchedPod::from(pod.clone());
        assert_eq!(
            watched,
            WatchedPod {
                namespace: "gpu".into(),
                name: "driver-x".into(),
                uid: Some("u".into()),
                node: Some("n1".into()),
                revision: Some("abc".into()),
                controller: Some(("DaemonSet".into(), "ds".into())),
                terminating: true,
                phase: "Running".into(),
                containers: vec![(true, 3)],
            }
        );
        // What the flow reads is the same from either.
        assert!(pod_ready(&pod) && pod_ready(&watched));
        for (a, b) in [
            (pod.pod_namespace(), watched.pod_namespace()),
            (pod.pod_name(), watched.pod_name()),
            (pod.phase(), watched.phase()),
        ] {
            assert_eq!(a, b);
        }
        assert_eq!(pod.node(), watched.node());
        assert_eq!(pod.revision(), watched.revision());
        assert_eq!(pod.controller(), watched.controller());
        assert_eq!(pod.terminating(), watched.terminating());
        assert_eq!(
            pod.containers().collect::<Vec<_>>(),
            watched.containers().collect::<Vec<_>>()
        );
        let key = watched.to_object_ref(());
        assert_eq!(
            (key.name.as_str(), key.namespace.as_deref()),
            ("driver-x", Some("gpu"))
        );
    }

    #[test]
    fn a_stored_revision_and_daemonset_drop_their_templates() {
        let mut r: ControllerRevision = serde_json::from_value(json!({
            "metadata": {"name": "r", "labels": {REVISION_HASH_LABEL: "abc"},
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "d", "uid": "ds"}]},
            "revision": 4,
            "data": {"spec": {"template": {"spec": {"containers": []}}}},
        }))
        .unwrap();
        strip_revision(&mut r);
        assert_eq!(r.data, RawExtension(serde_json::Value::Null));
        assert_eq!(r.revision, Some(4));
        assert_eq!(r.metadata.owner_references.as_ref().map(Vec::len), Some(1));
        let mut ds: DaemonSet = serde_json::from_value(json!({
            "metadata": {"name": "d", "uid": "ds", "generation": 3},
            "spec": {"selector": {"matchLabels": {"a": "b"}},
                     "template": {"spec": {"containers": [{"name": "c", "image": "i"}]}}},
            "status": {"observedGeneration": 3, "currentNumberScheduled": 1, "desiredNumberScheduled": 1,
                       "numberMisscheduled": 0, "numberReady": 1},
        }))
        .unwrap();
        strip_daemonset(&mut ds);
        assert_eq!(ds.spec, DaemonSetSpec::default());
        assert_eq!(ds.status.and_then(|s| s.observed_generation), Some(3));
        assert_eq!(ds.metadata.generation, Some(3));
    }
}
