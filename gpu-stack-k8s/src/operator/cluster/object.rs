//! The kinds of object the operator owns, as one enum over the k8s-openapi
//! types, with a key and access to metadata.
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Service, ServiceAccount};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

/// Label on every object the operator creates.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// Value of [`MANAGED_BY_LABEL`].
pub const MANAGED_BY: &str = "gpu-stack";
/// Annotation holding the hash of the desired object, so an unchanged object
/// is never rewritten (the NVIDIA operator's annotation name).
pub const HASH_ANNOTATION: &str = "nvidia.com/last-applied-hash";

/// An object the operator owns.
// DaemonSets dominate the size; objects are few (tens) and moved rarely, so
// boxing would only add noise at every construction site.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Object {
    /// The operand namespace.
    Namespace(Namespace),
    /// Operand service accounts.
    ServiceAccount(ServiceAccount),
    /// Cluster roles of operands.
    ClusterRole(ClusterRole),
    /// Bindings of the cluster roles.
    ClusterRoleBinding(ClusterRoleBinding),
    /// Namespaced roles of operands.
    Role(Role),
    /// Bindings of namespaced roles.
    RoleBinding(RoleBinding),
    /// The `nvidia` RuntimeClass.
    RuntimeClass(RuntimeClass),
    /// Configuration (mig-parted config, ...).
    ConfigMap(ConfigMap),
    /// Services of operands (the exporter's metrics).
    Service(Service),
    /// Operand DaemonSets.
    DaemonSet(DaemonSet),
}

/// Identity of an object: kind, namespace (for namespaced kinds), name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ObjectKey {
    /// Kind, e.g. `DaemonSet`.
    pub kind: String,
    /// Namespace; `None` for cluster-scoped kinds.
    pub namespace: Option<String>,
    /// Name.
    pub name: String,
}

impl std::fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{}/{}/{}", self.kind, ns, self.name),
            None => write!(f, "{}/{}", self.kind, self.name),
        }
    }
}

macro_rules! each {
    ($self:expr, $o:ident => $e:expr) => {
        match $self {
            Object::Namespace($o) => $e,
            Object::ServiceAccount($o) => $e,
            Object::ClusterRole($o) => $e,
            Object::ClusterRoleBinding($o) => $e,
            Object::Role($o) => $e,
            Object::RoleBinding($o) => $e,
            Object::RuntimeClass($o) => $e,
            Object::ConfigMap($o) => $e,
            Object::Service($o) => $e,
            Object::DaemonSet($o) => $e,
        }
    };
}

impl Object {
    /// Kind name.
    pub fn kind(&self) -> &'static str {
        match self {
            Object::Namespace(_) => "Namespace",
            Object::ServiceAccount(_) => "ServiceAccount",
            Object::ClusterRole(_) => "ClusterRole",
            Object::ClusterRoleBinding(_) => "ClusterRoleBinding",
            Object::Role(_) => "Role",
            Object::RoleBinding(_) => "RoleBinding",
            Object::RuntimeClass(_) => "RuntimeClass",
            Object::ConfigMap(_) => "ConfigMap",
            Object::Service(_) => "Service",
            Object::DaemonSet(_) => "DaemonSet",
        }
    }

    /// Metadata.
    pub fn meta(&self) -> &ObjectMeta {
        each!(self, o => &o.metadata)
    }

    /// When this object may be applied in a pass: objects of one stage are
    /// independent of each other and may be written at once; each stage
    /// needs the ones before it. The namespace holds the rest; a binding is
    /// refused while its role is missing (unless the writer may `bind`); a
    /// DaemonSet's pods are refused while their ServiceAccount is missing,
    /// and its controller then backs off.
    pub fn apply_stage(&self) -> u8 {
        match self {
            Object::Namespace(_) => 0,
            Object::ServiceAccount(_)
            | Object::ClusterRole(_)
            | Object::Role(_)
            | Object::RuntimeClass(_)
            | Object::ConfigMap(_)
            | Object::Service(_) => 1,
            Object::ClusterRoleBinding(_) | Object::RoleBinding(_) => 2,
            Object::DaemonSet(_) => 3,
        }
    }

    /// When this object may be deleted, in the order of [`Self::apply_stage`]
    /// reversed: a DaemonSet goes before the account, role and binding its
    /// pods use, so a pod stopping with its DaemonSet can still ask the API
    /// server why (the toolkit agent does, to undo its runtime changes).
    pub fn delete_stage(&self) -> std::cmp::Reverse<u8> {
        std::cmp::Reverse(self.apply_stage())
    }

    /// Mutable metadata.
    pub fn meta_mut(&mut self) -> &mut ObjectMeta {
        each!(self, o => &mut o.metadata)
    }

    /// Name (empty if unset).
    pub fn name(&self) -> &str {
        self.meta().name.as_deref().unwrap_or("")
    }

    /// Key of this object.
    pub fn key(&self) -> ObjectKey {
        ObjectKey {
            kind: self.kind().to_string(),
            namespace: self.meta().namespace.clone(),
            name: self.name().to_string(),
        }
    }

    /// The desired-spec hash annotation, if set.
    pub fn spec_hash(&self) -> Option<&str> {
        self.meta()
            .annotations
            .as_ref()
            .and_then(|a| a.get(HASH_ANNOTATION))
            .map(String::as_str)
    }

    /// Whether the operator owns this object.
    pub fn is_managed(&self) -> bool {
        self.meta()
            .labels
            .as_ref()
            .and_then(|l| l.get(MANAGED_BY_LABEL))
            .is_some_and(|v| v == MANAGED_BY)
    }

    /// The object as JSON with `apiVersion` and `kind`.
    pub fn to_json(&self) -> serde_json::Value {
        // k8s-openapi types serialize their apiVersion and kind themselves.
        each!(self, o => serde_json::to_value(o).unwrap_or(serde_json::Value::Null))
    }

    /// The DaemonSet inside, if this is one.
    pub fn as_daemonset(&self) -> Option<&DaemonSet> {
        match self {
            Object::DaemonSet(d) => Some(d),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(obj: Object) -> u8 {
        obj.apply_stage()
    }

    #[test]
    fn dependencies_are_applied_in_earlier_stages() {
        let namespace = stage(Object::Namespace(Namespace::default()));
        let account = stage(Object::ServiceAccount(ServiceAccount::default()));
        let roles = [
            stage(Object::ClusterRole(ClusterRole::default())),
            stage(Object::Role(Role::default())),
        ];
        let bindings = [
            stage(Object::ClusterRoleBinding(ClusterRoleBinding::default())),
            stage(Object::RoleBinding(RoleBinding::default())),
        ];
        let config = [
            stage(Object::ConfigMap(ConfigMap::default())),
            stage(Object::RuntimeClass(RuntimeClass::default())),
            stage(Object::Service(Service::default())),
        ];
        let daemonset = stage(Object::DaemonSet(DaemonSet::default()));
        let every = [
            Object::Namespace(Namespace::default()),
            Object::ServiceAccount(ServiceAccount::default()),
            Object::ClusterRole(ClusterRole::default()),
            Object::ClusterRoleBinding(ClusterRoleBinding::default()),
            Object::ConfigMap(ConfigMap::default()),
            Object::Service(Service::default()),
            Object::DaemonSet(DaemonSet::default()),
        ];
        // Deleted in the reverse order: the DaemonSet first, the namespace last.
        for a in &every {
            for b in &every {
                assert_eq!(
                    a.apply_stage() < b.apply_stage(),
                    a.delete_stage() > b.delete_stage(),
                    "{} {}",
                    a.kind(),
                    b.kind()
                );
            }
        }
        // Everything namespaced lives in the namespace.
        assert!(account > namespace && roles.iter().all(|r| *r > namespace));
        // A binding needs its role; a DaemonSet's pods need their account,
        // bindings and configuration.
        assert!(bindings.iter().all(|b| roles.iter().all(|r| b > r)));
        assert!(
            [account]
                .iter()
                .chain(&roles)
                .chain(&bindings)
                .chain(&config)
                .all(|s| daemonset > *s)
        );
    }
}
