//! What the operator reports on a ClusterPolicy: its state, conditions,
//! unsupported fields and driver upgrade progress.
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Status of a ClusterPolicy.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterPolicyStatus {
    /// `ready`, `notReady` or `ignored`.
    pub state: String,
    /// Namespace of the operands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// `Ready` and `Error` conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Field paths present in the spec that this operator does not act on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unsupported_fields: Vec<String>,
    /// GPU nodes the driver is not deployed to, with the reason.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused_nodes: Vec<RefusedNode>,
    /// Generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Progress of the driver upgrade flow (`spec.driver.upgradePolicy`).
    /// Written by the upgrade controller under its own field manager; the
    /// reconcile pass neither writes nor compares it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_upgrade: Option<DriverUpgradeStatus>,
}

/// Progress of the driver upgrade flow over the nodes that run a driver pod.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DriverUpgradeStatus {
    /// `spec.driver.upgradePolicy.autoUpgrade`.
    pub auto_upgrade: bool,
    /// Nodes that run a driver pod.
    pub total: i64,
    /// Nodes whose driver pod runs the DaemonSet's newest revision and that
    /// are not in the middle of an upgrade.
    pub upgraded: i64,
    /// Nodes between `cordon-required` and `uncordon-required`.
    pub in_progress: i64,
    /// Nodes in `upgrade-required`, waiting for a slot.
    pub pending: i64,
    /// Nodes in `upgrade-failed`.
    pub failed: i64,
    /// `n of m nodes up to date`, with what is in flight.
    pub message: String,
    /// Nodes that waited in one state longer than the stuck limit.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stuck: Vec<StuckUpgradeNode>,
    /// `DriverUpgradeStuck`: `True` while any node is stuck.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// A node the upgrade flow has waited on too long.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StuckUpgradeNode {
    /// Node name.
    pub node: String,
    /// Its upgrade state.
    pub state: String,
    /// Unix seconds since it is in that state.
    pub since: i64,
    /// What it waits for.
    pub waiting_for: String,
}

/// A node the operator will not deploy the driver to.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct RefusedNode {
    /// Node name.
    pub node: String,
    /// Why.
    pub reason: String,
}

/// A status condition (the shape of `metav1.Condition`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// `Ready` or `Error`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// CamelCase reason.
    pub reason: String,
    /// Human-readable detail.
    #[serde(default)]
    pub message: String,
    /// When the status last changed (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
}

/// Policy states.
pub mod state {
    /// All operands are ready.
    pub const READY: &str = "ready";
    /// Some operand is not ready, or the policy has errors.
    pub const NOT_READY: &str = "notReady";
    /// Another ClusterPolicy is in charge.
    pub const IGNORED: &str = "ignored";
}
