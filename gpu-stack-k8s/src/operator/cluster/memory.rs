//! An in-memory cluster that behaves like an API server where the operator
//! can tell the difference:
//!
//! - every write bumps a cluster-wide resource version; a write carrying a
//!   stale resource version is a conflict; a write that changes nothing keeps
//!   the stored version (as server-side apply does);
//! - DaemonSets get a `generation` that moves only on spec changes, and a
//!   status computed from the nodes their pod template fits (node selector,
//!   affinity, taints);
//! - pods do not start by themselves: [`InMemoryCluster::settle`] plays the
//!   part of kubelets and marks every scheduled pod ready, so callers can show
//!   the not-ready → ready transition.
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};

use futures::StreamExt;
use futures::channel::mpsc;
use futures::stream::BoxStream;
use gpu_stack_core::operator::labels::{LabelPatch, apply_patch};
use k8s_openapi::api::apps::v1::DaemonSetStatus;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use super::object::{Object, ObjectKey};
use super::selector::{label_selector_matches, pod_fits_node};
use super::{Cluster, ClusterError, NodeEvent};
use crate::operator::clusterpolicy::ClusterPolicy;
use crate::operator::clusterpolicy::status::ClusterPolicyStatus;
use crate::operator::migconfig::{MigConfig, MigConfigStatus};
use crate::operator::nvidiadriver::{NvidiaDriver, NvidiaDriverStatus};

#[derive(Default)]
struct State {
    rv: u64,
    nodes: BTreeMap<String, Node>,
    objects: BTreeMap<ObjectKey, Object>,
    /// DaemonSets whose pods are running the current generation on the
    /// listed nodes.
    rolled_out: BTreeMap<ObjectKey, (i64, BTreeSet<String>)>,
    policies: BTreeMap<String, ClusterPolicy>,
    nvidia_drivers: BTreeMap<String, NvidiaDriver>,
    mig_configs: BTreeMap<String, MigConfig>,
    watchers: Vec<mpsc::UnboundedSender<NodeEvent>>,
    writes: u64,
}

/// Counters of what the cluster was asked to do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteStats {
    /// Object writes that changed something (create, update, delete, label patch).
    pub writes: u64,
    /// Current resource version.
    pub resource_version: u64,
}

/// The in-memory cluster. Cheap to share by reference; interior mutability
/// behind one mutex.
#[derive(Default)]
pub struct InMemoryCluster {
    state: Mutex<State>,
}

fn spec_view(o: &Object) -> serde_json::Value {
    let mut v = o.to_json();
    if let Some(m) = v.get_mut("metadata").and_then(|m| m.as_object_mut()) {
        for k in ["resourceVersion", "generation", "uid", "creationTimestamp"] {
            m.remove(k);
        }
    }
    if let Some(obj) = v.as_object_mut() {
        obj.remove("status");
    }
    v
}

impl State {
    fn next_rv(&mut self) -> String {
        self.rv += 1;
        self.rv.to_string()
    }

    fn notify(&mut self, ev: NodeEvent) {
        self.watchers
            .retain(|w| w.unbounded_send(ev.clone()).is_ok());
    }

    fn refresh_daemonset_status(&mut self) {
        let nodes: Vec<Node> = self.nodes.values().cloned().collect();
        let keys: Vec<ObjectKey> = self
            .objects
            .keys()
            .filter(|k| k.kind == "DaemonSet")
            .cloned()
            .collect();
        for key in keys {
            let Some(Object::DaemonSet(ds)) = self.objects.get_mut(&key) else {
                continue;
            };
            let generation = ds.metadata.generation.unwrap_or(1);
            let matching: BTreeSet<String> = match ds.spec.template.spec.as_ref() {
                Some(spec) => nodes
                    .iter()
                    .filter(|n| pod_fits_node(spec, n))
                    .filter_map(|n| n.metadata.name.clone())
                    .collect(),
                None => BTreeSet::new(),
            };
            let ready: i32 = match self.rolled_out.get(&key) {
                Some((g, on)) if *g == generation => on.intersection(&matching).count() as i32,
                _ => 0,
            };
            let desired = matching.len() as i32;
            ds.status = Some(DaemonSetStatus {
                desired_number_scheduled: desired,
                current_number_scheduled: desired,
                number_ready: ready,
                number_available: Some(ready),
                updated_number_scheduled: Some(ready),
                number_unavailable: Some(desired - ready),
                number_misscheduled: 0,
                observed_generation: Some(generation),
                ..Default::default()
            });
        }
    }
}

impl InMemoryCluster {
    /// A stream of node changes from now on (as a node watch reports them).
    pub fn watch_nodes(&self) -> BoxStream<'static, NodeEvent> {
        let (tx, rx) = mpsc::unbounded();
        self.lock().watchers.push(tx);
        rx.boxed()
    }

    /// An empty cluster.
    pub fn new() -> InMemoryCluster {
        InMemoryCluster::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means a panic elsewhere; the data is still consistent
        // for a test double.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds or replaces a node (a node joining, or its labels changing).
    pub fn upsert_node(&self, mut node: Node) {
        let mut st = self.lock();
        node.metadata.resource_version = Some(st.next_rv());
        let name = node.metadata.name.clone().unwrap_or_default();
        st.nodes.insert(name, node.clone());
        st.writes += 1;
        st.refresh_daemonset_status();
        st.notify(NodeEvent::Applied(Box::new(node)));
    }

    /// Removes a node.
    pub fn remove_node(&self, name: &str) -> bool {
        let mut st = self.lock();
        let Some(node) = st.nodes.remove(name) else {
            return false;
        };
        st.next_rv();
        st.writes += 1;
        st.refresh_daemonset_status();
        st.notify(NodeEvent::Deleted(Box::new(node)));
        true
    }

    /// Creates or replaces a ClusterPolicy (spec and metadata; status is kept).
    pub fn upsert_policy(&self, mut policy: ClusterPolicy) {
        let mut st = self.lock();
        let name = policy.metadata.name.clone().unwrap_or_default();
        let rv = st.next_rv();
        let old = st.policies.get(&name).cloned();
        let generation = match &old {
            Some(o) if o.spec == policy.spec => o.metadata.generation.unwrap_or(1),
            Some(o) => o.metadata.generation.unwrap_or(1) + 1,
            None => 1,
        };
        policy.metadata.generation = Some(generation);
        policy.metadata.resource_version = Some(rv);
        if policy.metadata.uid.is_none() {
            policy.metadata.uid = Some(format!("uid-clusterpolicy-{name}"));
        }
        if let Some(o) = old {
            policy.status = o.status;
            if policy.metadata.creation_timestamp.is_none() {
                policy.metadata.creation_timestamp = o.metadata.creation_timestamp;
            }
        }
        st.writes += 1;
        st.policies.insert(name, policy);
    }

    /// Creates or replaces an NVIDIADriver (spec and metadata; the stored
    /// status is kept when the new one has none).
    pub fn upsert_nvidia_driver(&self, mut driver: NvidiaDriver) {
        let mut st = self.lock();
        let name = driver.name().to_string();
        let old = st.nvidia_drivers.get(&name).cloned();
        let generation = match &old {
            Some(o) if o.spec == driver.spec => o.metadata.generation.unwrap_or(1),
            Some(o) => o.metadata.generation.unwrap_or(1) + 1,
            None => 1,
        };
        driver.metadata.generation = Some(generation);
        if driver.metadata.uid.is_none() {
            driver.metadata.uid = Some(format!("uid-nvidiadriver-{name}"));
        }
        if driver.status.is_none() {
            driver.status = old.and_then(|o| o.status);
        }
        driver.metadata.resource_version = Some(st.next_rv());
        st.writes += 1;
        st.nvidia_drivers.insert(name, driver);
    }

    /// Deletes an NVIDIADriver; returns whether it existed.
    pub fn remove_nvidia_driver(&self, name: &str) -> bool {
        let mut st = self.lock();
        let found = st.nvidia_drivers.remove(name).is_some();
        if found {
            st.next_rv();
            st.writes += 1;
        }
        found
    }

    /// Creates or replaces a MigConfig (the stored status is kept when the
    /// new one has none).
    pub fn upsert_mig_config(&self, mut mig: MigConfig) {
        let mut st = self.lock();
        let name = mig.name().to_string();
        let old = st.mig_configs.get(&name).cloned();
        let generation = match &old {
            Some(o) if o.spec == mig.spec => o.metadata.generation.unwrap_or(1),
            Some(o) => o.metadata.generation.unwrap_or(1) + 1,
            None => 1,
        };
        mig.metadata.generation = Some(generation);
        if mig.status.is_none() {
            mig.status = old.and_then(|o| o.status);
        }
        mig.metadata.resource_version = Some(st.next_rv());
        st.writes += 1;
        st.mig_configs.insert(name, mig);
    }

    /// Deletes a MigConfig; returns whether it existed.
    pub fn remove_mig_config(&self, name: &str) -> bool {
        let mut st = self.lock();
        let found = st.mig_configs.remove(name).is_some();
        if found {
            st.next_rv();
            st.writes += 1;
        }
        found
    }

    /// A MigConfig as stored.
    pub fn mig_config(&self, name: &str) -> Option<MigConfig> {
        self.lock().mig_configs.get(name).cloned()
    }

    /// An NVIDIADriver as stored.
    pub fn nvidia_driver(&self, name: &str) -> Option<NvidiaDriver> {
        self.lock().nvidia_drivers.get(name).cloned()
    }

    /// A ClusterPolicy by name.
    pub fn policy(&self, name: &str) -> Option<ClusterPolicy> {
        self.lock().policies.get(name).cloned()
    }

    /// All nodes, sorted by name.
    pub fn nodes(&self) -> Vec<Node> {
        self.lock().nodes.values().cloned().collect()
    }

    /// All stored objects, sorted by key.
    pub fn objects(&self) -> Vec<Object> {
        self.lock().objects.values().cloned().collect()
    }

    /// Objects of a kind whose labels match a selector, as a LIST with a
    /// label selector would return them.
    pub fn list_selected(&self, kind: &str, selector: &LabelSelector) -> Vec<Object> {
        self.lock()
            .objects
            .values()
            .filter(|o| o.kind() == kind)
            .filter(|o| {
                let labels = o.meta().labels.clone().unwrap_or_default();
                label_selector_matches(selector, &labels)
            })
            .cloned()
            .collect()
    }

    /// One object.
    pub fn get(&self, key: &ObjectKey) -> Option<Object> {
        self.lock().objects.get(key).cloned()
    }

    /// Plays the kubelets: every DaemonSet pod that is scheduled becomes ready
    /// on the current generation.
    pub fn settle(&self) {
        let mut st = self.lock();
        st.refresh_daemonset_status();
        let nodes: Vec<Node> = st.nodes.values().cloned().collect();
        let mut rolled = BTreeMap::new();
        for (k, o) in &st.objects {
            if let Object::DaemonSet(ds) = o {
                let on: BTreeSet<String> = match ds.spec.template.spec.as_ref() {
                    Some(spec) => nodes
                        .iter()
                        .filter(|n| pod_fits_node(spec, n))
                        .filter_map(|n| n.metadata.name.clone())
                        .collect(),
                    None => BTreeSet::new(),
                };
                rolled.insert(k.clone(), (ds.metadata.generation.unwrap_or(1), on));
            }
        }
        st.rolled_out = rolled;
        st.refresh_daemonset_status();
    }

    /// Changes one node in place (labels, annotations, status), as a node
    /// agent's PATCH would: a change bumps the resource version, refreshes
    /// DaemonSet status and notifies watchers; an edit that changes nothing
    /// writes nothing. Returns the node as stored.
    pub fn update_node(
        &self,
        name: &str,
        edit: impl FnOnce(&mut Node),
    ) -> Result<Node, ClusterError> {
        let mut st = self.lock();
        let Some(mut n) = st.nodes.get(name).cloned() else {
            return Err(ClusterError::NotFound {
                what: format!("Node/{name}"),
            });
        };
        let before = n.clone();
        edit(&mut n);
        if n == before {
            return Ok(n);
        }
        n.metadata.resource_version = Some(st.next_rv());
        st.writes += 1;
        st.nodes.insert(name.to_string(), n.clone());
        st.refresh_daemonset_status();
        st.notify(NodeEvent::Applied(Box::new(n.clone())));
        Ok(n)
    }

    /// Write counters.
    pub fn stats(&self) -> WriteStats {
        let st = self.lock();
        WriteStats {
            writes: st.writes,
            resource_version: st.rv,
        }
    }

    fn apply_sync(&self, mut obj: Object) -> Result<Object, ClusterError> {
        let mut st = self.lock();
        let key = obj.key();
        if key.name.is_empty() {
            return Err(ClusterError::Invalid {
                what: key.to_string(),
                reason: "metadata.name is empty".into(),
            });
        }
        let existing = st.objects.get(&key).cloned();
        if let (Some(given), Some(cur)) = (
            obj.meta().resource_version.clone(),
            existing
                .as_ref()
                .and_then(|e| e.meta().resource_version.clone()),
        ) && given != cur
        {
            return Err(ClusterError::Conflict {
                what: key.to_string(),
                given,
                current: cur,
            });
        }
        if let Some(e) = &existing
            && spec_view(e) == spec_view(&obj)
        {
            return Ok(e.clone());
        }
        let generation = match (&existing, &obj) {
            (Some(Object::DaemonSet(old)), Object::DaemonSet(new)) => {
                let g = old.metadata.generation.unwrap_or(1);
                if old.spec == new.spec { g } else { g + 1 }
            }
            _ => 1,
        };
        let rv = st.next_rv();
        let meta = obj.meta_mut();
        meta.resource_version = Some(rv);
        meta.generation = Some(generation);
        if meta.uid.is_none() {
            meta.uid = Some(match &existing {
                Some(e) => e.meta().uid.clone().unwrap_or_default(),
                None => format!("uid-{}", key.to_string().replace('/', "-").to_lowercase()),
            });
        }
        if let (Some(Object::DaemonSet(old)), Object::DaemonSet(new)) = (&existing, &mut obj) {
            new.status = old.status.clone();
        }
        st.writes += 1;
        st.objects.insert(key.clone(), obj);
        st.refresh_daemonset_status();
        st.objects.get(&key).cloned().ok_or(ClusterError::NotFound {
            what: key.to_string(),
        })
    }
}

impl Cluster for InMemoryCluster {
    type Node = Node;

    async fn list_nodes(&self) -> Result<Vec<Node>, ClusterError> {
        Ok(self.nodes())
    }

    async fn list_owned(&self) -> Result<Vec<Object>, ClusterError> {
        Ok(self
            .lock()
            .objects
            .values()
            .filter(|o| o.is_managed())
            .cloned()
            .collect())
    }

    async fn apply(&self, obj: Object) -> Result<Object, ClusterError> {
        self.apply_sync(obj)
    }

    async fn delete(&self, key: &ObjectKey) -> Result<(), ClusterError> {
        let mut st = self.lock();
        if st.objects.remove(key).is_some() {
            st.rolled_out.remove(key);
            st.next_rv();
            st.writes += 1;
        }
        Ok(())
    }

    async fn patch_node(
        &self,
        node: &str,
        label_patch: &LabelPatch,
        annotation_patch: &LabelPatch,
    ) -> Result<Node, ClusterError> {
        let mut st = self.lock();
        let Some(mut n) = st.nodes.get(node).cloned() else {
            return Err(ClusterError::NotFound {
                what: format!("Node/{node}"),
            });
        };
        let mut labels = n.metadata.labels.clone().unwrap_or_default();
        let mut annotations = n.metadata.annotations.clone().unwrap_or_default();
        let before = (labels.clone(), annotations.clone());
        apply_patch(&mut labels, label_patch);
        apply_patch(&mut annotations, annotation_patch);
        if (&labels, &annotations) == (&before.0, &before.1) {
            return Ok(n);
        }
        n.metadata.labels = Some(labels);
        n.metadata.annotations = (!annotations.is_empty()).then_some(annotations);
        n.metadata.resource_version = Some(st.next_rv());
        st.writes += 1;
        st.nodes.insert(node.to_string(), n.clone());
        st.refresh_daemonset_status();
        st.notify(NodeEvent::Applied(Box::new(n.clone())));
        Ok(n)
    }

    async fn list_cluster_policies(&self) -> Result<Vec<ClusterPolicy>, ClusterError> {
        Ok(self.lock().policies.values().cloned().collect())
    }

    async fn update_policy_status(
        &self,
        name: &str,
        status: &ClusterPolicyStatus,
    ) -> Result<(), ClusterError> {
        let mut st = self.lock();
        let rv = st.next_rv();
        let Some(p) = st.policies.get_mut(name) else {
            return Err(ClusterError::NotFound {
                what: format!("ClusterPolicy/{name}"),
            });
        };
        if p.status.as_ref() == Some(status) {
            return Ok(());
        }
        p.status = Some(status.clone());
        p.metadata.resource_version = Some(rv);
        st.writes += 1;
        Ok(())
    }

    async fn list_nvidia_drivers(&self) -> Result<Vec<NvidiaDriver>, ClusterError> {
        Ok(self.lock().nvidia_drivers.values().cloned().collect())
    }

    async fn update_nvidia_driver_status(
        &self,
        name: &str,
        status: &NvidiaDriverStatus,
    ) -> Result<(), ClusterError> {
        let mut st = self.lock();
        let rv = st.next_rv();
        let Some(d) = st.nvidia_drivers.get_mut(name) else {
            return Err(ClusterError::NotFound {
                what: format!("NVIDIADriver/{name}"),
            });
        };
        if d.status.as_ref() == Some(status) {
            return Ok(());
        }
        d.status = Some(status.clone());
        d.metadata.resource_version = Some(rv);
        st.writes += 1;
        Ok(())
    }

    async fn list_mig_configs(&self) -> Result<Vec<MigConfig>, ClusterError> {
        Ok(self.lock().mig_configs.values().cloned().collect())
    }

    async fn update_mig_config_status(
        &self,
        name: &str,
        status: &MigConfigStatus,
    ) -> Result<(), ClusterError> {
        let mut st = self.lock();
        let rv = st.next_rv();
        let Some(m) = st.mig_configs.get_mut(name) else {
            return Err(ClusterError::NotFound {
                what: format!("MigConfig/{name}"),
            });
        };
        // As the server-side apply of the kube backend: a status without
        // `demand` leaves the demand controller's field as it is.
        let mut status = status.clone();
        if status.demand.is_none() {
            status.demand = m.status.as_ref().and_then(|s| s.demand.clone());
        }
        if m.status.as_ref() == Some(&status) {
            return Ok(());
        }
        m.status = Some(status);
        m.metadata.resource_version = Some(rv);
        st.writes += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::executor::block_on;
    use k8s_openapi::api::apps::v1::{DaemonSet, DaemonSetSpec};
    use k8s_openapi::api::core::v1::{PodSpec, PodTemplateSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn node(name: &str, labels: &[(&str, &str)]) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn ds(name: &str, sel: &str) -> Object {
        Object::DaemonSet(DaemonSet {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                labels: Some(
                    [(
                        "app.kubernetes.io/managed-by".to_string(),
                        "gpu-stack".to_string(),
                    )]
                    .into(),
                ),
                ..Default::default()
            },
            spec: DaemonSetSpec {
                template: PodTemplateSpec {
                    spec: Some(PodSpec {
                        node_selector: Some([(sel.to_string(), "true".to_string())].into()),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                ..Default::default()
            },
            status: None,
        })
    }

    #[test]
    fn resource_versions_conflicts_and_noop_writes() {
        let c = InMemoryCluster::new();
        let stored = block_on(c.apply(ds("a", "x"))).unwrap();
        let rv = stored.meta().resource_version.clone().unwrap();
        // Same content: no new version, no write.
        let writes = c.stats().writes;
        let again = block_on(c.apply(ds("a", "x"))).unwrap();
        assert_eq!(again.meta().resource_version.as_deref(), Some(rv.as_str()));
        assert_eq!(c.stats().writes, writes);
        // Stale version: conflict.
        let mut stale = ds("a", "y");
        stale.meta_mut().resource_version = Some("0".into());
        assert!(matches!(
            block_on(c.apply(stale)),
            Err(ClusterError::Conflict { .. })
        ));
        // Spec change bumps generation.
        let changed = block_on(c.apply(ds("a", "y"))).unwrap();
        assert_eq!(changed.meta().generation, Some(2));
    }

    #[test]
    fn daemonset_status_follows_nodes_and_settle() {
        let c = InMemoryCluster::new();
        c.upsert_node(node("n1", &[("x", "true")]));
        c.upsert_node(node("n2", &[("x", "false")]));
        block_on(c.apply(ds("a", "x"))).unwrap();
        let status = |c: &InMemoryCluster| {
            c.get(&ObjectKey {
                kind: "DaemonSet".into(),
                namespace: Some("ns".into()),
                name: "a".into(),
            })
            .and_then(|o| o.as_daemonset().and_then(|d| d.status.clone()))
            .unwrap()
        };
        assert_eq!(status(&c).desired_number_scheduled, 1);
        assert_eq!(status(&c).number_ready, 0);
        c.settle();
        assert_eq!(status(&c).number_ready, 1);
        let mut patch = LabelPatch::new();
        patch.insert("x".into(), Some("true".into()));
        block_on(c.patch_node_labels("n2", &patch)).unwrap();
        let s = status(&c);
        assert_eq!((s.desired_number_scheduled, s.number_ready), (2, 1));
        assert!(block_on(c.patch_node_labels("nope", &patch)).is_err());
    }

    #[test]
    fn list_by_label_selector() {
        let c = InMemoryCluster::new();
        block_on(c.apply(ds("a", "x"))).unwrap();
        let mut other = ds("b", "x");
        other.meta_mut().labels = Some([("team".to_string(), "ml".to_string())].into());
        block_on(c.apply(other)).unwrap();
        let managed = LabelSelector {
            match_labels: Some(
                [(
                    "app.kubernetes.io/managed-by".to_string(),
                    "gpu-stack".to_string(),
                )]
                .into(),
            ),
            ..Default::default()
        };
        let names: Vec<String> = c
            .list_selected("DaemonSet", &managed)
            .iter()
            .map(|o| o.name().to_string())
            .collect();
        assert_eq!(names, ["a"]);
        assert!(c.list_selected("ConfigMap", &managed).is_empty());
        // Only owned objects are listed through the trait.
        assert_eq!(block_on(c.list_owned()).unwrap().len(), 1);
    }

    #[test]
    fn watch_sees_node_changes() {
        let c = InMemoryCluster::new();
        let mut w = c.watch_nodes();
        c.upsert_node(node("n1", &[]));
        assert!(c.remove_node("n1"));
        let evs: Vec<NodeEvent> = block_on(async {
            let a = w.next().await.unwrap();
            let b = w.next().await.unwrap();
            vec![a, b]
        });
        assert!(matches!(evs[0], NodeEvent::Applied(_)));
        assert!(matches!(evs[1], NodeEvent::Deleted(_)));
    }
}
