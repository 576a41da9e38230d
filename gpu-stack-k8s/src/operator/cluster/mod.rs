//! The cluster seam: everything the operator reads from or writes to a
//! cluster, behind one trait, with an in-memory implementation that behaves
//! like an API server where it matters (resource versions, conflicts, label
//! selectors, DaemonSet status as a function of matching nodes).
//!
//! The trait is async (methods return `Send` futures) because the kube
//! implementation is; the in-memory implementation completes immediately, so
//! callers without a runtime can drive it with `futures::executor::block_on`.
//! It is used through generics (`C: Cluster`), not `dyn`.
use std::collections::BTreeSet;
use std::future::Future;

use gpu_stack_core::operator::labels::LabelPatch;
use k8s_openapi::api::core::v1::Node;

use crate::operator::clusterpolicy::ClusterPolicy;
use crate::operator::clusterpolicy::status::ClusterPolicyStatus;
use crate::operator::desired::NodeMeta;
use crate::operator::migconfig::{MigConfig, MigConfigStatus};
use crate::operator::nvidiadriver::{NvidiaDriver, NvidiaDriverStatus};

pub mod fleet;
pub mod kube_cluster;
pub mod memory;
pub mod node_api;
pub mod object;
pub mod selector;

pub use memory::InMemoryCluster;
pub use object::{Object, ObjectKey};

/// Errors from a cluster backend.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The object does not exist.
    #[error("{what} not found; it may have been deleted meanwhile, the next reconcile will retry")]
    NotFound {
        /// What was looked for (`Node/gpu-1`).
        what: String,
    },
    /// Optimistic concurrency failure.
    #[error(
        "conflict writing {what}: resource version {given} is stale (current {current}); re-read and retry"
    )]
    Conflict {
        /// The object.
        what: String,
        /// Version the writer had.
        given: String,
        /// Version stored.
        current: String,
    },
    /// The object was rejected as invalid.
    #[error("invalid {what}: {reason}")]
    Invalid {
        /// The object.
        what: String,
        /// Why.
        reason: String,
    },
    /// Any other backend failure (network, authorization, ...).
    #[error("cluster backend error: {0}")]
    Backend(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// A patch that changes nothing.
static NO_CHANGE: LabelPatch = LabelPatch::new();

/// A change to a node, as a watch reports it.
#[derive(Debug, Clone, PartialEq)]
pub enum NodeEvent {
    /// The node was added or changed.
    Applied(Box<Node>),
    /// The node was deleted.
    Deleted(Box<Node>),
}

/// What the operator needs from a cluster.
pub trait Cluster: Send + Sync {
    /// A node as [`Cluster::list_nodes`] returns it: a whole [`Node`], or
    /// only its metadata where the cluster keeps no more.
    type Node: NodeMeta + Send + Sync;

    /// All nodes.
    fn list_nodes(&self) -> impl Future<Output = Result<Vec<Self::Node>, ClusterError>> + Send;

    /// Every object the operator owns (label `app.kubernetes.io/managed-by=gpu-stack`),
    /// cluster-scoped ones included, with their current status.
    fn list_owned(&self) -> impl Future<Output = Result<Vec<Object>, ClusterError>> + Send;

    /// The objects among `owned` whose live spec may differ from what the
    /// operator last applied (see [`crate::operator::desired::Related`]).
    /// None by default: a cluster that nobody else edits.
    fn drifted(&self, owned: &[Object]) -> BTreeSet<ObjectKey> {
        let _ = owned;
        BTreeSet::new()
    }

    /// Creates or replaces an object; returns it as stored (with its new
    /// resource version). A resource version set on the input must match the
    /// stored one.
    fn apply(&self, obj: Object) -> impl Future<Output = Result<Object, ClusterError>> + Send;

    /// Deletes an object; deleting a missing object is not an error.
    fn delete(&self, key: &ObjectKey) -> impl Future<Output = Result<(), ClusterError>> + Send;

    /// Sets (`Some`) or removes (`None`) node labels and annotations in one
    /// write; returns the updated node.
    fn patch_node(
        &self,
        node: &str,
        labels: &LabelPatch,
        annotations: &LabelPatch,
    ) -> impl Future<Output = Result<Node, ClusterError>> + Send;

    /// Sets (`Some`) or removes (`None`) node labels; returns the updated node.
    fn patch_node_labels(
        &self,
        node: &str,
        labels: &LabelPatch,
    ) -> impl Future<Output = Result<Node, ClusterError>> + Send {
        self.patch_node(node, labels, &NO_CHANGE)
    }

    /// All ClusterPolicies.
    fn list_cluster_policies(
        &self,
    ) -> impl Future<Output = Result<Vec<ClusterPolicy>, ClusterError>> + Send;

    /// Replaces a ClusterPolicy's status (the status subresource).
    fn update_policy_status(
        &self,
        name: &str,
        status: &ClusterPolicyStatus,
    ) -> impl Future<Output = Result<(), ClusterError>> + Send;

    /// All NVIDIADrivers; none where their CRD is not installed.
    fn list_nvidia_drivers(
        &self,
    ) -> impl Future<Output = Result<Vec<NvidiaDriver>, ClusterError>> + Send;

    /// Replaces an NVIDIADriver's status (the status subresource).
    fn update_nvidia_driver_status(
        &self,
        name: &str,
        status: &NvidiaDriverStatus,
    ) -> impl Future<Output = Result<(), ClusterError>> + Send;

    /// All MigConfigs; none where their CRD is not installed.
    fn list_mig_configs(&self)
    -> impl Future<Output = Result<Vec<MigConfig>, ClusterError>> + Send;

    /// Replaces a MigConfig's status (the status subresource).
    fn update_mig_config_status(
        &self,
        name: &str,
        status: &MigConfigStatus,
    ) -> impl Future<Output = Result<(), ClusterError>> + Send;
}
