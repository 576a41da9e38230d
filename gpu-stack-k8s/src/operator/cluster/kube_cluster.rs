//! The [`Cluster`] seam over a real API server.
//!
//! - Writes use server-side apply with one field manager
//!   ([`FIELD_MANAGER`]), forced, as controllers should: the operator owns the
//!   fields it sets and drops the ones it no longer sets.
//! - Every object except the Namespace gets an owner reference to the
//!   ClusterPolicy being reconciled, so deleting the policy garbage-collects
//!   them. (Owning the Namespace would let garbage collection delete the
//!   operator's own namespace.)
//! - Reads come from the watch caches ([`Caches`]), never from a list per
//!   pass; nodes are never cached whole, so a Node here has its name,
//!   labels and taints only.
//! - Node labels are changed with a JSON merge patch of `metadata.labels`,
//!   touching no other field and no label we did not name.
//! - An owned object whose spec someone else changed is applied again on
//!   the next pass (its change is a trigger), putting the edit back
//!   ([`SpecVersions`], decided in the core).
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use gpu_stack_core::operator::drift::SpecVersions;
use gpu_stack_core::operator::labels::LabelPatch;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Service, ServiceAccount};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{DeleteParams, Patch, PatchParams, PropagationPolicy};
use kube::{Api, Client, Resource};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Cluster, ClusterError, Object, ObjectKey};
use crate::operator::clusterpolicy::ClusterPolicy;
use crate::operator::clusterpolicy::status::ClusterPolicyStatus;
use crate::operator::controller::node_writes::NodeWriteFence;
use crate::operator::controller::watches::{Caches, WatchedNode, policies_in};
use crate::operator::migconfig::{MigConfig, MigConfigStatus};
use crate::operator::nvidiadriver::{NvidiaDriver, NvidiaDriverStatus};

/// The field manager of every write the operator makes.
pub const FIELD_MANAGER: &str = "gpu-stack-operator";

/// A [`Cluster`] backed by the Kubernetes API.
#[derive(Clone)]
pub struct KubeCluster {
    client: Client,
    namespace: String,
    caches: Caches,
    owner: Arc<RwLock<Option<OwnerReference>>>,
    /// Nodes this pass patched whose change the node watch has not
    /// delivered yet (see `catch_up_with_label_writes`).
    label_writes: NodeWriteFence,
    /// Owned objects' spec versions around the operator's writes, which
    /// tell a hand edit from the operator's own ([`SpecVersions`]).
    spec_versions: Arc<Mutex<SpecVersions<ObjectKey>>>,
}

/// The version that moves when an object's spec moves: a DaemonSet's
/// generation (its status changes all the time), else the resource
/// version (the other kinds the operator owns have no status that moves).
pub fn spec_version(obj: &Object) -> Option<String> {
    match obj {
        Object::DaemonSet(d) => d.metadata.generation.map(|g| format!("generation {g}")),
        other => other.meta().resource_version.clone(),
    }
}

/// How long a pass waits for the node watch to deliver the operator's own
/// label writes before it reads the node cache anyway.
pub const LABEL_WRITES_CATCH_UP: Duration = Duration::from_secs(10);

impl KubeCluster {
    /// A cluster over `client`, whose operands live in `namespace`, reading
    /// from the controller's watch caches.
    pub fn new(client: Client, namespace: impl Into<String>, caches: Caches) -> Self {
        Self {
            client,
            namespace: namespace.into(),
            owner: Arc::new(RwLock::new(None)),
            label_writes: NodeWriteFence::new(caches.nodes.clone()),
            spec_versions: Arc::default(),
            caches,
        }
    }

    /// Makes `policy` the owner of every object applied from now on.
    pub fn set_owner(&self, policy: &ClusterPolicy) {
        let owner = policy.controller_owner_ref(&()).map(|mut o| {
            // Deleting an operand must not wait for the policy.
            o.block_owner_deletion = Some(false);
            o
        });
        if let Ok(mut slot) = self.owner.write() {
            *slot = owner;
        }
    }

    /// The namespace of the operands.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The client in use.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Waits (at most [`LABEL_WRITES_CATCH_UP`]) until the node cache shows
    /// every label patch this pass sent (see [`NodeWriteFence`]). A pass
    /// that read labels older than its own writes would patch the same
    /// nodes again, as it did on 1,000 nodes while a rollout slowed the
    /// watch.
    async fn catch_up_with_label_writes(&self) {
        self.label_writes
            .catch_up(LABEL_WRITES_CATCH_UP, "the reconcile pass")
            .await;
    }

    fn owner(&self) -> Option<OwnerReference> {
        self.owner.read().ok().and_then(|o| o.clone())
    }

    fn api<K>(&self, namespace: Option<&str>) -> Api<K>
    where
        K: Resource<DynamicType = ()>,
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    {
        Api::namespaced(self.client.clone(), namespace.unwrap_or(&self.namespace))
    }
}

fn backend(what: &str, e: kube::Error) -> ClusterError {
    match &e {
        kube::Error::Api(s) if s.code == 404 => ClusterError::NotFound {
            what: what.to_string(),
        },
        kube::Error::Api(s) if s.code == 422 || s.code == 400 => ClusterError::Invalid {
            what: what.to_string(),
            reason: s.message.clone(),
        },
        _ => ClusterError::Backend(Box::new(WithContext {
            what: what.to_string(),
            source: e,
        })),
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
struct WithContext {
    what: String,
    #[source]
    source: kube::Error,
}

/// Strips what the server owns so the object can be sent as an apply patch.
fn for_apply(mut obj: Object, owner: Option<OwnerReference>) -> Object {
    let is_namespace = matches!(obj, Object::Namespace(_));
    let meta = obj.meta_mut();
    meta.resource_version = None;
    meta.uid = None;
    meta.creation_timestamp = None;
    meta.managed_fields = None;
    meta.generation = None;
    if let (Some(owner), false) = (owner, is_namespace) {
        meta.owner_references = Some(vec![owner]);
    }
    match &mut obj {
        Object::DaemonSet(d) => d.status = None,
        Object::Namespace(n) => n.status = None,
        _ => {}
    }
    obj
}

async fn apply_one<K>(api: Api<K>, name: &str, obj: &K) -> Result<K, kube::Error>
where
    K: Resource + Clone + DeserializeOwned + Serialize + std::fmt::Debug,
{
    api.patch(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(obj),
    )
    .await
}

impl Cluster for KubeCluster {
    /// Shared with the watch cache (stripped nodes): a pass copies no node.
    type Node = Arc<WatchedNode>;

    async fn list_nodes(&self) -> Result<Vec<Self::Node>, ClusterError> {
        self.catch_up_with_label_writes().await;
        Ok(self.caches.nodes.state())
    }

    async fn list_owned(&self) -> Result<Vec<Object>, ClusterError> {
        Ok(self.caches.owned.objects())
    }

    async fn apply(&self, obj: Object) -> Result<Object, ClusterError> {
        let key = obj.key();
        let what = key.to_string();
        let obj = for_apply(obj, self.owner());
        let name = key.name.clone();
        let ns = key.namespace.as_deref();
        let c = self.client.clone();
        let result = match &obj {
            Object::Namespace(o) => apply_one(Api::all(c), &name, o)
                .await
                .map(Object::Namespace),
            Object::ClusterRole(o) => apply_one(Api::all(c), &name, o)
                .await
                .map(Object::ClusterRole),
            Object::ClusterRoleBinding(o) => apply_one(Api::all(c), &name, o)
                .await
                .map(Object::ClusterRoleBinding),
            Object::RuntimeClass(o) => apply_one(Api::all(c), &name, o)
                .await
                .map(Object::RuntimeClass),
            Object::ServiceAccount(o) => apply_one(self.api(ns), &name, o)
                .await
                .map(Object::ServiceAccount),
            Object::Role(o) => apply_one(self.api(ns), &name, o).await.map(Object::Role),
            Object::RoleBinding(o) => apply_one(self.api(ns), &name, o)
                .await
                .map(Object::RoleBinding),
            Object::ConfigMap(o) => apply_one(self.api(ns), &name, o)
                .await
                .map(Object::ConfigMap),
            Object::Service(o) => apply_one(self.api(ns), &name, o).await.map(Object::Service),
            Object::DaemonSet(o) => apply_one(self.api(ns), &name, o)
                .await
                .map(Object::DaemonSet),
        };
        let stored = result.map_err(|e| backend(&format!("apply {what}"), e))?;
        if let (Ok(mut versions), Some(after)) = (self.spec_versions.lock(), spec_version(&stored))
        {
            versions.applied(stored.key(), after);
        }
        Ok(stored)
    }

    fn drifted(&self, owned: &[Object]) -> BTreeSet<ObjectKey> {
        self.spec_versions
            .lock()
            .map(|mut versions| {
                versions.drifted(
                    owned
                        .iter()
                        .filter_map(|o| Some((o.key(), spec_version(o)?))),
                )
            })
            .unwrap_or_default()
    }

    async fn delete(&self, key: &ObjectKey) -> Result<(), ClusterError> {
        let dp = DeleteParams {
            propagation_policy: Some(PropagationPolicy::Background),
            ..DeleteParams::default()
        };
        let c = self.client.clone();
        let ns = key.namespace.as_deref();
        let name = key.name.as_str();
        let result = match key.kind.as_str() {
            "Namespace" => Api::<Namespace>::all(c).delete(name, &dp).await.map(|_| ()),
            "ClusterRole" => Api::<ClusterRole>::all(c)
                .delete(name, &dp)
                .await
                .map(|_| ()),
            "ClusterRoleBinding" => Api::<ClusterRoleBinding>::all(c)
                .delete(name, &dp)
                .await
                .map(|_| ()),
            "RuntimeClass" => Api::<RuntimeClass>::all(c)
                .delete(name, &dp)
                .await
                .map(|_| ()),
            "ServiceAccount" => self
                .api::<ServiceAccount>(ns)
                .delete(name, &dp)
                .await
                .map(|_| ()),
            "Role" => self.api::<Role>(ns).delete(name, &dp).await.map(|_| ()),
            "RoleBinding" => self
                .api::<RoleBinding>(ns)
                .delete(name, &dp)
                .await
                .map(|_| ()),
            "ConfigMap" => self
                .api::<ConfigMap>(ns)
                .delete(name, &dp)
                .await
                .map(|_| ()),
            "Service" => self.api::<Service>(ns).delete(name, &dp).await.map(|_| ()),
            "DaemonSet" => self
                .api::<DaemonSet>(ns)
                .delete(name, &dp)
                .await
                .map(|_| ()),
            other => {
                return Err(ClusterError::Invalid {
                    what: key.to_string(),
                    reason: format!("the operator does not manage objects of kind {other}"),
                });
            }
        };
        if let Ok(mut versions) = self.spec_versions.lock() {
            versions.deleted(key);
        }
        match result {
            Ok(()) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(backend(&format!("delete {key}"), e)),
        }
    }

    async fn patch_node(
        &self,
        node: &str,
        labels: &LabelPatch,
        annotations: &LabelPatch,
    ) -> Result<Node, ClusterError> {
        let api: Api<Node> = Api::all(self.client.clone());
        let mut metadata = serde_json::Map::new();
        for (field, patch) in [("labels", labels), ("annotations", annotations)] {
            if !patch.is_empty() {
                metadata.insert(field.into(), serde_json::json!(patch));
            }
        }
        let body = serde_json::json!({ "metadata": metadata });
        let meta = api
            .patch_metadata(node, &PatchParams::default(), &Patch::Merge(&body))
            .await
            .map_err(|e| backend(&format!("patch labels of Node/{node}"), e))?;
        self.label_writes.wrote(node, &body);
        Ok(Node {
            metadata: meta.metadata,
            spec: None,
            status: None,
        })
    }

    async fn list_cluster_policies(&self) -> Result<Vec<ClusterPolicy>, ClusterError> {
        let policies = policies_in(&self.caches.policies);
        // The policy in charge owns what this pass applies.
        if let Some(active) = crate::operator::desired::active_policy(&policies) {
            self.set_owner(active);
        }
        Ok(policies)
    }

    async fn update_policy_status(
        &self,
        name: &str,
        status: &ClusterPolicyStatus,
    ) -> Result<(), ClusterError> {
        let api: Api<ClusterPolicy> = Api::all(self.client.clone());
        // Apply (not merge): fields dropped from the status disappear.
        let body = serde_json::json!({
            "apiVersion": "nvidia.com/v1",
            "kind": "ClusterPolicy",
            "status": status,
        });
        api.patch_status(
            name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await
        .map(|_| ())
        .map_err(|e| backend(&format!("update status of ClusterPolicy/{name}"), e))
    }

    async fn list_nvidia_drivers(&self) -> Result<Vec<NvidiaDriver>, ClusterError> {
        self.list_watched(&self.caches.nvidia_drivers, "NVIDIADrivers")
            .await
    }

    async fn update_nvidia_driver_status(
        &self,
        name: &str,
        status: &NvidiaDriverStatus,
    ) -> Result<(), ClusterError> {
        self.apply_status::<NvidiaDriver>(name, "nvidia.com/v1alpha1", "NVIDIADriver", status)
            .await
    }

    async fn list_mig_configs(&self) -> Result<Vec<MigConfig>, ClusterError> {
        self.list_watched(&self.caches.mig_configs, "MigConfigs")
            .await
    }

    async fn update_mig_config_status(
        &self,
        name: &str,
        status: &MigConfigStatus,
    ) -> Result<(), ClusterError> {
        self.apply_status::<MigConfig>(name, "gpustack.io/v1alpha1", "MigConfig", status)
            .await
    }
}

impl KubeCluster {
    /// A cluster-scoped kind the operator watches without waiting for it:
    /// from the watch's store once it has listed, else read once (none
    /// where the CRD is not installed).
    async fn list_watched<K>(
        &self,
        store: &kube::runtime::reflector::Store<K>,
        what: &str,
    ) -> Result<Vec<K>, ClusterError>
    where
        K: Resource<DynamicType = (), Scope = k8s_openapi::ClusterResourceScope>
            + Clone
            + DeserializeOwned
            + std::fmt::Debug
            + Send
            + Sync
            + 'static,
    {
        if futures::FutureExt::now_or_never(store.wait_until_ready()).is_some_and(|r| r.is_ok()) {
            return Ok(store.state().iter().map(|d| (**d).clone()).collect());
        }
        let api: Api<K> = Api::all(self.client.clone());
        match api.list(&kube::api::ListParams::default()).await {
            Ok(list) => Ok(list.items),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(Vec::new()),
            Err(e) => Err(backend(&format!("list {what}"), e)),
        }
    }

    /// Server-side applies the status of a cluster-scoped custom resource.
    async fn apply_status<K>(
        &self,
        name: &str,
        api_version: &str,
        kind: &str,
        status: &impl Serialize,
    ) -> Result<(), ClusterError>
    where
        K: Resource<DynamicType = (), Scope = k8s_openapi::ClusterResourceScope>
            + Clone
            + DeserializeOwned
            + std::fmt::Debug,
    {
        let api: Api<K> = Api::all(self.client.clone());
        let body = serde_json::json!({
            "apiVersion": api_version,
            "kind": kind,
            "status": status,
        });
        api.patch_status(
            name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await
        .map(|_| ())
        .map_err(|e| backend(&format!("update status of {kind}/{name}"), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn daemonset(generation: i64, resource_version: &str) -> Object {
        Object::DaemonSet(DaemonSet {
            metadata: ObjectMeta {
                name: Some("ds".into()),
                namespace: Some("ns".into()),
                generation: Some(generation),
                resource_version: Some(resource_version.into()),
                ..ObjectMeta::default()
            },
            ..DaemonSet::default()
        })
    }

    fn config_map(resource_version: &str) -> Object {
        Object::ConfigMap(ConfigMap {
            metadata: ObjectMeta {
                name: Some("cm".into()),
                namespace: Some("ns".into()),
                resource_version: Some(resource_version.into()),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        })
    }

    #[test]
    fn a_daemonsets_spec_version_is_its_generation_others_their_resource_version() {
        // Status moves a DaemonSet's resource version, not its generation.
        assert_eq!(
            spec_version(&daemonset(3, "100")),
            spec_version(&daemonset(3, "150"))
        );
        assert_ne!(
            spec_version(&daemonset(3, "100")),
            spec_version(&daemonset(4, "100"))
        );
        assert_eq!(spec_version(&config_map("7")).as_deref(), Some("7"));
    }

    fn owner() -> OwnerReference {
        OwnerReference {
            api_version: "nvidia.com/v1".into(),
            kind: "ClusterPolicy".into(),
            name: "cluster-policy".into(),
            uid: "u-1".into(),
            controller: Some(true),
            block_owner_deletion: Some(false),
        }
    }

    #[test]
    fn apply_body_drops_server_fields_and_sets_owner() {
        let ds = DaemonSet {
            metadata: ObjectMeta {
                name: Some("nvidia-device-plugin-daemonset".into()),
                namespace: Some("gpu-operator".into()),
                resource_version: Some("42".into()),
                uid: Some("x".into()),
                ..ObjectMeta::default()
            },
            spec: Default::default(),
            status: Some(Default::default()),
        };
        let out = for_apply(Object::DaemonSet(ds), Some(owner()));
        let meta = out.meta();
        assert_eq!(meta.resource_version, None);
        assert_eq!(meta.uid, None);
        assert_eq!(meta.owner_references.as_ref().map(Vec::len), Some(1));
        assert!(out.as_daemonset().is_some_and(|d| d.status.is_none()));
    }

    #[test]
    fn namespace_is_never_owned_by_the_policy() {
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some("gpu-operator".into()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        let out = for_apply(Object::Namespace(ns), Some(owner()));
        assert_eq!(out.meta().owner_references, None);
    }
}
