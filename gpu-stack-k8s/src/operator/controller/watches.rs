//! The operator's view of the cluster, kept current by watches, so that a
//! reconcile pass reads memory and never lists: nodes (name, labels and
//! taints only), the ClusterPolicies (the controller's own store), and every
//! object the operator owns (one label-filtered watch per kind).
//!
//! Each watch also yields a trigger when something it sees changes (an owned
//! object edited or deleted by someone else, a DaemonSet's rollout status, a
//! node's labels or taints), which the controller turns into a debounced pass.
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::collections::hash_map::DefaultHasher;
use std::fmt::Debug;
use std::hash::{Hash, Hasher};
use std::time::Duration;

use futures::stream::BoxStream;
use futures::{Stream, StreamExt, future};
use gpu_stack_core::operator::upgrade::state::ANNOTATION_PREFIX;
use k8s_openapi::ClusterResourceScope;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Service, ServiceAccount, Taint};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::reflector::{self, Lookup, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;

use crate::operator::cluster::Object;
use crate::operator::cluster::object::{MANAGED_BY, MANAGED_BY_LABEL};
use crate::operator::clusterpolicy::ClusterPolicy;
use crate::operator::desired::NodeMeta;
use crate::operator::migconfig::MigConfig;
use crate::operator::nvidiadriver::NvidiaDriver;

/// Nodes as the operator keeps them ([`WatchedNode`]). Shared by the
/// reconcile pass and the upgrade controller, so neither lists nodes.
pub type NodeStore = Store<WatchedNode>;

/// A node as the operator keeps it: its name, uid, resource version,
/// labels, the driver upgrade flow's annotations ([`ANNOTATION_PREFIX`]),
/// its taints, `spec.unschedulable` and whether its Ready condition says it
/// is not ready. The rest of the status (images, other conditions,
/// addresses, heartbeat times), the rest of the spec, other annotations and
/// managed fields would be nearly all of what a large store holds; and a
/// `Node` stripped of them would still take about 1.2 KB of empty inline
/// spec and status fields.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WatchedNode {
    /// Name, uid, resource version, labels and the upgrade annotations.
    pub metadata: ObjectMeta,
    /// Taints (key, value and effect).
    pub taints: Vec<Taint>,
    /// `spec.unschedulable`.
    pub unschedulable: bool,
    /// `false` only when a Ready condition says other than `True`.
    pub ready: bool,
}

impl From<Node> for WatchedNode {
    fn from(node: Node) -> Self {
        let meta = node.metadata;
        let annotations = meta
            .annotations
            .map(|a| {
                a.into_iter()
                    .filter(|(k, _)| k.starts_with(ANNOTATION_PREFIX))
                    .collect::<BTreeMap<_, _>>()
            })
            .filter(|a| !a.is_empty());
        let ready = node
            .status
            .and_then(|s| s.conditions)
            .and_then(|cs| cs.into_iter().find(|c| c.type_ == "Ready"))
            .is_none_or(|c| c.status == "True");
        let spec = node.spec.unwrap_or_default();
        WatchedNode {
            metadata: ObjectMeta {
                name: meta.name,
                uid: meta.uid,
                resource_version: meta.resource_version,
                labels: meta.labels,
                annotations,
                ..ObjectMeta::default()
            },
            taints: spec
                .taints
                .into_iter()
                .flatten()
                // Only key, value and effect decide where a pod goes.
                .map(|t| Taint {
                    time_added: None,
                    ..t
                })
                .collect(),
            unschedulable: spec.unschedulable.unwrap_or(false),
            ready,
        }
    }
}

impl Resource for WatchedNode {
    type DynamicType = ();
    type Scope = ClusterResourceScope;

    fn kind(dt: &()) -> Cow<'_, str> {
        <Node as Resource>::kind(dt)
    }

    fn group(dt: &()) -> Cow<'_, str> {
        <Node as Resource>::group(dt)
    }

    fn version(dt: &()) -> Cow<'_, str> {
        <Node as Resource>::version(dt)
    }

    fn plural(dt: &()) -> Cow<'_, str> {
        <Node as Resource>::plural(dt)
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl NodeMeta for WatchedNode {
    fn node_metadata(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn node_taints(&self) -> &[Taint] {
        &self.taints
    }
}

/// How long a pass waits for the watches' first lists before it fails (and
/// is retried with backoff): long enough for a large cluster's first list,
/// short enough that a missing RBAC rule surfaces as an error.
pub const SYNC_TIMEOUT: Duration = Duration::from_secs(60);

/// Nodes per page of the node watch's list.
pub const NODE_LIST_PAGE: u32 = 100;

/// A hash of what the operator reads of a node (labels and taints), so the
/// node watch triggers a pass only when one of them changed, not on every
/// status heartbeat.
pub fn node_fingerprint(node: &WatchedNode) -> Option<u64> {
    let mut h = DefaultHasher::new();
    node.metadata.labels.hash(&mut h);
    for t in &node.taints {
        (&t.key, &t.value, &t.effect).hash(&mut h);
    }
    Some(h.finish())
}

/// Starts the node watch and returns its store plus the stream that must be
/// polled to keep it fed; every item is a node whose labels or taints
/// changed (or that joined or left).
///
/// Taints live in the spec, which a metadata-only watch does not carry, so
/// this watches whole nodes but stores each one as a [`WatchedNode`]: the
/// store stays smaller than a metadata-only one, and a node's full object
/// lives only while one event or one list page of [`NODE_LIST_PAGE`] nodes
/// is decoded.
pub fn node_watch(client: Client) -> (NodeStore, impl Stream<Item = WatchedNode> + Send + 'static) {
    let (store, writer) = reflector::store();
    let api: Api<Node> = Api::all(client);
    // Small pages from a consistent list: a cached (`any`) list ignores the
    // page size, and a whole large cluster in one response is the operator's
    // peak memory.
    let config = watcher::Config::default().page_size(NODE_LIST_PAGE);
    let stream = watcher(api, config)
        .default_backoff()
        .map(|event| event.map(|e| summarize_event(e, WatchedNode::from)))
        .reflect(writer)
        .touched_objects()
        .predicate_filter(node_fingerprint, Default::default())
        .filter_map(|r| future::ready(logged("Node", r)));
    (store, stream)
}

/// Stores of every kind of object the operator owns, each fed by a watch
/// filtered on the operator's `managed-by` label.
#[derive(Clone)]
pub struct OwnedStores {
    namespace: Store<Namespace>,
    cluster_roles: Store<ClusterRole>,
    cluster_role_bindings: Store<ClusterRoleBinding>,
    runtime_classes: Store<RuntimeClass>,
    service_accounts: Store<ServiceAccount>,
    roles: Store<Role>,
    role_bindings: Store<RoleBinding>,
    config_maps: Store<ConfigMap>,
    services: Store<Service>,
    daemonsets: Store<DaemonSet>,
}

/// Why the caches are not usable.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// A watch has not completed its first list in time.
    #[error(
        "the {kind} watch has not completed its first list after {}s; check that the API \
         server is reachable and that the operator's RBAC allows list and watch on {kind}",
        SYNC_TIMEOUT.as_secs()
    )]
    NotSynced {
        /// The kind whose watch is behind.
        kind: &'static str,
    },
}

impl OwnedStores {
    /// Starts one watch per owned kind; operands live in `namespace`. The
    /// returned stream must be polled to keep the stores fed; it yields once
    /// per change to an owned object.
    pub fn start(client: &Client, namespace: &str) -> (Self, BoxStream<'static, ()>) {
        let owned = format!("{MANAGED_BY_LABEL}={MANAGED_BY}");
        let config = || watcher::Config::default().labels(&owned).any_semantic();
        let mut t = Vec::new();
        // Only the operand namespace is ours: a labelled namespace left by
        // another install must never be reported as owned (and so deleted).
        let only_ours = config().fields(&format!("metadata.name={namespace}"));
        let stores = Self {
            namespace: watch(Api::all(client.clone()), only_ours, &mut t),
            cluster_roles: watch(Api::all(client.clone()), config(), &mut t),
            cluster_role_bindings: watch(Api::all(client.clone()), config(), &mut t),
            runtime_classes: watch(Api::all(client.clone()), config(), &mut t),
            service_accounts: watch(Api::namespaced(client.clone(), namespace), config(), &mut t),
            roles: watch(Api::namespaced(client.clone(), namespace), config(), &mut t),
            role_bindings: watch(Api::namespaced(client.clone(), namespace), config(), &mut t),
            config_maps: watch(Api::namespaced(client.clone(), namespace), config(), &mut t),
            services: watch(Api::namespaced(client.clone(), namespace), config(), &mut t),
            daemonsets: watch(Api::namespaced(client.clone(), namespace), config(), &mut t),
        };
        (stores, futures::stream::select_all(t).boxed())
    }

    /// Waits until every watch has completed its first list.
    pub async fn wait_until_synced(&self) -> Result<(), CacheError> {
        synced("Namespace", &self.namespace).await?;
        synced("ClusterRole", &self.cluster_roles).await?;
        synced("ClusterRoleBinding", &self.cluster_role_bindings).await?;
        synced("RuntimeClass", &self.runtime_classes).await?;
        synced("ServiceAccount", &self.service_accounts).await?;
        synced("Role", &self.roles).await?;
        synced("RoleBinding", &self.role_bindings).await?;
        synced("ConfigMap", &self.config_maps).await?;
        synced("Service", &self.services).await?;
        synced("DaemonSet", &self.daemonsets).await
    }

    /// Every owned object as last seen, cluster-scoped kinds first.
    pub fn objects(&self) -> Vec<Object> {
        let mut out = Vec::new();
        copy(&self.namespace, Object::Namespace, &mut out);
        copy(&self.cluster_roles, Object::ClusterRole, &mut out);
        copy(
            &self.cluster_role_bindings,
            Object::ClusterRoleBinding,
            &mut out,
        );
        copy(&self.runtime_classes, Object::RuntimeClass, &mut out);
        copy(&self.service_accounts, Object::ServiceAccount, &mut out);
        copy(&self.roles, Object::Role, &mut out);
        copy(&self.role_bindings, Object::RoleBinding, &mut out);
        copy(&self.config_maps, Object::ConfigMap, &mut out);
        copy(&self.services, Object::Service, &mut out);
        copy(&self.daemonsets, Object::DaemonSet, &mut out);
        out
    }
}

/// Copies of the ClusterPolicies in `store`, for the rules that take a
/// slice of them.
pub fn policies_in(store: &Store<ClusterPolicy>) -> Vec<ClusterPolicy> {
    store
        .state()
        .iter()
        .map(|p| ClusterPolicy::clone(p))
        .collect()
}

/// What a reconcile pass reads, all from watch caches.
#[derive(Clone)]
pub struct Caches {
    /// Nodes: name, labels and taints.
    pub nodes: NodeStore,
    /// ClusterPolicies (the controller's store).
    pub policies: Store<ClusterPolicy>,
    /// Objects the operator owns.
    pub owned: OwnedStores,
    /// NVIDIADrivers. Not waited for: without their CRD the watch never
    /// completes, and a pass then reads them directly
    /// ([`crate::operator::cluster::kube_cluster::KubeCluster`]).
    pub nvidia_drivers: Store<NvidiaDriver>,
    /// MigConfigs, read the same way as NVIDIADrivers.
    pub mig_configs: Store<MigConfig>,
}

/// Watches of the resources the operator reads but does not wait for.
pub struct ResourceWatches {
    /// NVIDIADrivers.
    pub nvidia_drivers: Store<NvidiaDriver>,
    /// MigConfigs.
    pub mig_configs: Store<MigConfig>,
}

/// Starts the NVIDIADriver and MigConfig watches; the stream yields once
/// per change and must be polled to keep the stores fed.
pub fn resource_watches(client: &Client) -> (ResourceWatches, BoxStream<'static, ()>) {
    let mut t = Vec::new();
    let stores = ResourceWatches {
        nvidia_drivers: watch(Api::all(client.clone()), watcher::Config::default(), &mut t),
        mig_configs: watch(Api::all(client.clone()), watcher::Config::default(), &mut t),
    };
    (stores, futures::stream::select_all(t).boxed())
}

impl Caches {
    /// Waits until every watch has completed its first list, so that a pass
    /// never mistakes a cache still filling for a cluster without objects.
    pub async fn wait_until_synced(&self) -> Result<(), CacheError> {
        synced("Node", &self.nodes).await?;
        synced("ClusterPolicy", &self.policies).await?;
        self.owned.wait_until_synced().await
    }
}

/// Starts a watch of `api` into a new store (objects without their managed
/// fields) and adds its change stream to `triggers`.
fn watch<K>(
    api: Api<K>,
    config: watcher::Config,
    triggers: &mut Vec<BoxStream<'static, ()>>,
) -> Store<K>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    watch_stripped(
        api,
        config,
        |obj| obj.meta_mut().managed_fields = None,
        triggers,
    )
}

/// Starts a watch of `api` into a new store, each object cut down by
/// `strip` before it is stored, and adds its change stream (one item per
/// change, watch errors logged) to `triggers`.
pub(crate) fn watch_stripped<K>(
    api: Api<K>,
    config: watcher::Config,
    strip: fn(&mut K),
    triggers: &mut Vec<BoxStream<'static, ()>>,
) -> Store<K>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let (store, writer) = reflector::store();
    let changes = watcher(api, config)
        .default_backoff()
        .modify(strip)
        .reflect(writer)
        .touched_objects()
        .filter_map(|r| future::ready(logged(K::kind(&()).as_ref(), r).map(|_| ())))
        .boxed();
    triggers.push(changes);
    store
}

/// A watch event with its object turned into what a store keeps.
fn summarize_event<K, S>(event: watcher::Event<K>, summarize: fn(K) -> S) -> watcher::Event<S> {
    match event {
        watcher::Event::Apply(o) => watcher::Event::Apply(summarize(o)),
        watcher::Event::Delete(o) => watcher::Event::Delete(summarize(o)),
        watcher::Event::InitApply(o) => watcher::Event::InitApply(summarize(o)),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitDone => watcher::Event::InitDone,
    }
}

/// Starts a watch of `api` into a new store of summaries (`summarize` turns
/// each decoded object into what is kept; a summary type can be far smaller
/// than the object stripped), and adds its change stream to `triggers`.
pub(crate) fn watch_summarized<K, S>(
    api: Api<K>,
    config: watcher::Config,
    summarize: fn(K) -> S,
    triggers: &mut Vec<BoxStream<'static, ()>>,
) -> Store<S>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    S: Lookup<DynamicType = ()> + Clone + Send + Sync + 'static,
{
    let (store, mut writer) = reflector::store();
    let changes = watcher(api, config)
        .default_backoff()
        .map(move |event| {
            let event = event.map(|e| summarize_event(e, summarize))?;
            writer.apply_watcher_event(&event);
            Ok(())
        })
        .filter_map(|r| future::ready(logged(K::kind(&()).as_ref(), r)))
        .boxed();
    triggers.push(changes);
    store
}

/// Passes objects through; logs watch errors (the watch itself retries with
/// backoff) so that, say, a missing RBAC rule is visible.
fn logged<K>(kind: &str, result: Result<K, watcher::Error>) -> Option<K> {
    match result {
        Ok(obj) => Some(obj),
        Err(error) => {
            tracing::warn!(kind, %error, "watch failed; retrying with backoff");
            None
        }
    }
}

/// Waits (at most [`SYNC_TIMEOUT`]) until `store` has its first list.
pub(crate) async fn synced<K>(kind: &'static str, store: &Store<K>) -> Result<(), CacheError>
where
    K: Lookup + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    match tokio::time::timeout(SYNC_TIMEOUT, store.wait_until_ready()).await {
        Ok(Ok(())) => Ok(()),
        _ => Err(CacheError::NotSynced { kind }),
    }
}

fn copy<K>(store: &Store<K>, wrap: fn(K) -> Object, out: &mut Vec<Object>)
where
    K: Resource + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    out.extend(store.state().iter().map(|o| wrap(K::clone(o))));
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_stack_core::operator::upgrade::state::SAFE_LOAD_ANNOTATION;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, ObjectMeta, Time};

    fn full_node(taints: Option<Vec<Taint>>) -> Node {
        let mut n: Node = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "gpu-1",
                "uid": "u-1",
                "resourceVersion": "7",
                "labels": {"nvidia.com/gpu.present": "true"},
                "annotations": {
                    "node.alpha.kubernetes.io/ttl": "0",
                    "nvidia.com/gpu-driver-upgrade.driver-wait-for-safe-load": "true",
                },
            },
            "spec": {"podCIDR": "10.0.0.0/24", "providerID": "kwok://gpu-1", "unschedulable": true},
            "status": {
                "capacity": {"nvidia.com/gpu": "8"},
                "conditions": [
                    {"type": "MemoryPressure", "status": "False"},
                    {"type": "Ready", "status": "True", "reason": "KubeletReady",
                     "lastHeartbeatTime": "2026-12-07T10:00:00Z"},
                ],
            },
        }))
        .expect("a valid Node");
        n.metadata.managed_fields = Some(vec![ManagedFieldsEntry::default()]);
        if let Some(spec) = n.spec.as_mut() {
            spec.taints = taints;
        }
        n
    }

    fn taint(key: &str, effect: &str) -> Taint {
        Taint {
            key: key.into(),
            value: Some("v".into()),
            effect: effect.into(),
            time_added: Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH)),
        }
    }

    #[test]
    fn a_stored_node_keeps_labels_taints_and_what_the_upgrade_flow_reads() {
        let n = WatchedNode::from(full_node(Some(vec![taint("dedicated", "NoSchedule")])));
        let expected = WatchedNode {
            metadata: ObjectMeta {
                name: Some("gpu-1".into()),
                uid: Some("u-1".into()),
                resource_version: Some("7".into()),
                labels: Some([("nvidia.com/gpu.present".to_string(), "true".to_string())].into()),
                annotations: Some([(SAFE_LOAD_ANNOTATION.to_string(), "true".to_string())].into()),
                ..ObjectMeta::default()
            },
            taints: vec![Taint {
                time_added: None,
                ..taint("dedicated", "NoSchedule")
            }],
            unschedulable: true,
            ready: true,
        };
        assert_eq!(n, expected);
        let mut plain = full_node(None);
        if let Some(spec) = plain.spec.as_mut() {
            spec.unschedulable = Some(false);
        }
        plain.metadata.annotations = None;
        plain.status = None;
        let plain = WatchedNode::from(plain);
        assert!(plain.taints.is_empty() && !plain.unschedulable && plain.ready);
        assert_eq!(plain.metadata.annotations, None);
        let mut not_ready = full_node(None);
        not_ready.status = serde_json::from_value(
            serde_json::json!({"conditions": [{"type": "Ready", "status": "Unknown"}]}),
        )
        .ok();
        assert!(!WatchedNode::from(not_ready).ready);
    }

    #[test]
    fn the_fingerprint_follows_labels_and_taints_not_status() {
        let base = WatchedNode::from(full_node(None));
        let mut heartbeat = full_node(None);
        heartbeat.metadata.resource_version = Some("8".into());
        heartbeat.status = None;
        let heartbeat = WatchedNode::from(heartbeat);
        assert_eq!(node_fingerprint(&base), node_fingerprint(&heartbeat));
        let tainted = WatchedNode::from(full_node(Some(vec![taint("dedicated", "NoSchedule")])));
        assert_ne!(node_fingerprint(&base), node_fingerprint(&tainted));
        let other_effect =
            WatchedNode::from(full_node(Some(vec![taint("dedicated", "NoExecute")])));
        assert_ne!(node_fingerprint(&tainted), node_fingerprint(&other_effect));
        let mut relabelled = base.clone();
        relabelled
            .metadata
            .labels
            .get_or_insert_with(Default::default)
            .insert("nvidia.com/gpu.deploy.driver".into(), "true".into());
        assert_ne!(node_fingerprint(&base), node_fingerprint(&relabelled));
    }
}
