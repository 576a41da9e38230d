//! The operator's view of the cluster, kept current by watches, so that a
//! reconcile pass reads memory and never lists: node metadata (labels only),
//! the ClusterPolicies (the controller's own store), and every object the
//! operator owns (one label-filtered watch per kind).
//!
//! Each watch also yields a trigger when something it sees changes (an owned
//! object edited or deleted by someone else, a DaemonSet's rollout status, a
//! node's labels), which the controller turns into a debounced pass.
use std::fmt::Debug;
use std::time::Duration;

use futures::stream::BoxStream;
use futures::{Stream, StreamExt, future};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, ServiceAccount};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, predicates, watcher};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;

use crate::cluster::Object;
use crate::cluster::object::{MANAGED_BY, MANAGED_BY_LABEL};
use crate::clusterpolicy::ClusterPolicy;

/// Node metadata the operator keeps: name, uid, resource version and labels
/// (no spec, status, annotations or managed fields), shared with the
/// reconcile pass so it never lists nodes itself.
pub type NodeStore = Store<PartialObjectMeta<Node>>;

/// How long a pass waits for the watches' first lists before it fails (and
/// is retried with backoff): long enough for a large cluster's first list,
/// short enough that a missing RBAC rule surfaces as an error.
pub const SYNC_TIMEOUT: Duration = Duration::from_secs(60);

/// Nodes per page of the node watch's list.
pub const NODE_LIST_PAGE: u32 = 100;

/// Starts the metadata-only node watch and returns its store plus the stream
/// that must be polled to keep it fed; every item is a node whose labels
/// changed (or that joined or left).
pub fn node_watch(
    client: Client,
) -> (
    NodeStore,
    impl Stream<Item = PartialObjectMeta<Node>> + Send + 'static,
) {
    let (store, writer) = reflector::store();
    // `Api<PartialObjectMeta<_>>` makes metadata-only list and watch requests.
    let api: Api<PartialObjectMeta<Node>> = Api::all(client);
    // Small pages from a consistent list: a cached (`any`) list ignores the
    // page size, and a whole large cluster in one response is the operator's
    // peak memory.
    let config = watcher::Config::default().page_size(NODE_LIST_PAGE);
    let stream = watcher(api, config)
        .default_backoff()
        // Only labels are read; the rest of a node's metadata (managed fields
        // above all) would be most of what a 1,000-node store holds.
        .modify(|meta: &mut PartialObjectMeta<Node>| {
            meta.metadata.managed_fields = None;
            meta.metadata.annotations = None;
        })
        .reflect(writer)
        .touched_objects()
        .predicate_filter(predicates::labels, Default::default())
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
        copy(&self.daemonsets, Object::DaemonSet, &mut out);
        out
    }
}

/// What a reconcile pass reads, all from watch caches.
#[derive(Clone)]
pub struct Caches {
    /// Node metadata.
    pub nodes: NodeStore,
    /// ClusterPolicies (the controller's store).
    pub policies: Store<ClusterPolicy>,
    /// Objects the operator owns.
    pub owned: OwnedStores,
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

/// Starts a watch of `api` into a new store and adds its change stream to
/// `triggers`.
fn watch<K>(
    api: Api<K>,
    config: watcher::Config,
    triggers: &mut Vec<BoxStream<'static, ()>>,
) -> Store<K>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let (store, writer) = reflector::store();
    let changes = watcher(api, config)
        .default_backoff()
        .modify(|obj: &mut K| obj.meta_mut().managed_fields = None)
        .reflect(writer)
        .touched_objects()
        .filter_map(|r| future::ready(logged(K::kind(&()).as_ref(), r).map(|_| ())))
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

async fn synced<K>(kind: &'static str, store: &Store<K>) -> Result<(), CacheError>
where
    K: Resource + Clone + 'static,
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
