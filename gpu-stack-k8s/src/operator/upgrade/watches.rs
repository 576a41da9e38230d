//! What the upgrade controller reads, kept current by watches, so that a
//! pass reads memory and never lists: the ClusterPolicies, the driver
//! DaemonSets and their ControllerRevisions, the driver and validator pods
//! (each watch filtered by label), and the nodes (the reconcile pass's
//! store, shared). Every object is stripped to the fields the flow reads
//! before it is stored, so the caches of a 1,000-node fleet stay small.
use futures::stream::BoxStream;
use futures::{StreamExt, future};
use gpu_stack_core::operator::upgrade::state::VALIDATOR_POD_SELECTOR;
use k8s_openapi::api::apps::v1::{ControllerRevision, DaemonSet, DaemonSetSpec, DaemonSetStatus};
use k8s_openapi::api::core::v1::{ContainerStatus, Pod, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Api, Client};

use super::DRIVER_SELECTOR;
use super::observe::REVISION_HASH_LABEL;
use crate::operator::clusterpolicy::ClusterPolicy;
use crate::operator::controller::watches::{CacheError, NodeStore, synced, watch_stripped};

/// The caches an upgrade pass reads.
#[derive(Clone)]
pub struct UpgradeStores {
    /// Nodes (shared with the reconcile pass; see
    /// [`crate::operator::controller::watches::strip_node`]).
    pub nodes: NodeStore,
    /// ClusterPolicies.
    pub policies: Store<ClusterPolicy>,
    /// Driver DaemonSets: identity, generation and observed generation.
    pub daemonsets: Store<DaemonSet>,
    /// Their ControllerRevisions, without the templates they hold.
    pub revisions: Store<ControllerRevision>,
    /// Driver pods (see [`strip_pod`]).
    pub driver_pods: Store<Pod>,
    /// Validator and node-agent pods (see [`strip_pod`]).
    pub validator_pods: Store<Pod>,
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
            driver_pods: watch_stripped(
                Api::namespaced(client.clone(), namespace),
                driver(),
                strip_pod,
                &mut fed,
            ),
            validator_pods: watch_stripped(
                Api::namespaced(client.clone(), namespace),
                watcher::Config::default().labels(VALIDATOR_POD_SELECTOR),
                strip_pod,
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

/// Cuts a pod down to what the upgrade flow reads: identity, the revision
/// hash label, its controller, deletion, node, phase, and each container's
/// readiness and restart count.
pub fn strip_pod(pod: &mut Pod) {
    let meta = &mut pod.metadata;
    meta.managed_fields = None;
    meta.annotations = None;
    meta.finalizers = None;
    meta.generate_name = None;
    meta.labels = meta
        .labels
        .take()
        .map(|l| {
            l.into_iter()
                .filter(|(k, _)| k == REVISION_HASH_LABEL)
                .collect()
        })
        .filter(|l: &std::collections::BTreeMap<String, String>| !l.is_empty());
    if let Some(owners) = meta.owner_references.as_mut() {
        owners.retain(|o| o.controller == Some(true));
    }
    let node_name = pod.spec.take().and_then(|s| s.node_name);
    pod.spec = Some(PodSpec {
        node_name,
        ..PodSpec::default()
    });
    pod.status = pod.status.take().map(|s| PodStatus {
        phase: s.phase,
        container_statuses: s.container_statuses.map(|cs| {
            cs.into_iter()
                .map(|c| ContainerStatus {
                    name: c.name,
                    ready: c.ready,
                    restart_count: c.restart_count,
                    ..ContainerStatus::default()
                })
                .collect()
        }),
        ..PodStatus::default()
    });
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
    use crate::operator::upgrade::observe::pod_ready;
    use serde_json::json;

    #[test]
    fn a_stored_pod_keeps_what_the_flow_reads() {
        let mut pod: Pod = serde_json::from_value(json!({
            "metadata": {
                "name": "driver-x", "namespace": "gpu", "uid": "u",
                "labels": {"app": "nvidia-driver-daemonset", REVISION_HASH_LABEL: "abc"},
                "annotations": {"a": "b"},
                "ownerReferences": [
                    {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "d", "uid": "ds", "controller": true},
                    {"apiVersion": "v1", "kind": "Other", "name": "o", "uid": "o"},
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
        strip_pod(&mut pod);
        assert_eq!(
            serde_json::to_value(&pod).unwrap(),
            json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {
                    "name": "driver-x", "namespace": "gpu", "uid": "u",
                    "labels": {REVISION_HASH_LABEL: "abc"},
                    "ownerReferences": [
                        {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "d", "uid": "ds", "controller": true},
                    ],
                    "deletionTimestamp": "2026-12-07T10:00:00Z",
                },
                "spec": {"nodeName": "n1", "containers": []},
                "status": {
                    "phase": "Running",
                    "containerStatuses": [{"name": "c", "image": "", "imageID": "", "ready": true, "restartCount": 3}],
                },
            })
        );
        assert!(pod_ready(&pod));
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
