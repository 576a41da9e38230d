//! The driver upgrade flow: NVIDIA's `driver.upgradePolicy`, the per-node
//! state machine behind the `nvidia.com/gpu-driver-upgrade-state` label, and
//! one pure pass over every managed node.
//!
//! The rules follow NVIDIA's k8s-operator-libs (`pkg/upgrade`) as the GPU
//! operator configures it (driver name `gpu`, pod deletion and validation
//! states enabled):
//!
//! ```text
//! ""/upgrade-done ──(pod out of sync, upgrade requested, or waiting for safe load)──▶ upgrade-required
//! upgrade-required ──(a slot is free, or the node is already cordoned)──▶ cordon-required
//! cordon-required ──cordon──▶ wait-for-jobs-required ──(jobs done or timed out)──▶ pod-deletion-required
//! pod-deletion-required ──(GPU pods gone)──▶ pod-restart-required
//!                       ──(cannot delete / timed out)──▶ drain-required if drain.enable, else upgrade-failed
//! drain-required ──(drained, or drain disabled)──▶ pod-restart-required   (drain failure ▶ upgrade-failed)
//! pod-restart-required ──delete the old driver pod, or lift the safe-load block──▶ validation-required
//! validation-required ──(validator Ready)──▶ uncordon-required, or upgrade-done if the node was cordoned before
//! uncordon-required ──uncordon──▶ upgrade-done
//! upgrade-failed ──(driver pod in sync and Ready)──▶ uncordon-required / upgrade-done
//! ```
//!
//! [`plan_pass`] is stateless: every decision is a function of the
//! observations, the policy and `now`. A node moves at most one state per
//! pass, because, as in NVIDIA's `ApplyState`, each node is handled by the
//! state it had when the pass began. The caller writes the returned state
//! labels, performs the actions, and runs the next pass when something
//! changed (NVIDIA also re-runs every two minutes as a safety net).
//!
//! Not implemented: the "requestor" mode that hands cordon and drain to an
//! external maintenance operator. Nodes labelled `node-maintenance-required`
//! or `post-maintenance-required` parse, are left alone and are not counted,
//! as NVIDIA's in-place mode does.
//!
//! Beyond NVIDIA:
//! - a NotReady node is not handed an upgrade slot (it still counts against
//!   `maxUnavailable`), so a dead node cannot hold the only slot forever;
//! - the pass records when a node entered its state
//!   ([`STATE_START_TIME_ANNOTATION`]), which bounds the pod deletion and
//!   drain timeouts across operator restarts (NVIDIA keeps those timers in
//!   memory) and lets [`stuck_nodes`] say how long a node has waited;
//! - the wait-for-completion start time is recorded even when the timeout is
//!   0 (NVIDIA records it only with a timeout), for the same reason.
use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

pub mod selector;

pub use selector::{LabelSelector, SelectorError};

/// What every node annotation of the upgrade flow starts with: a node cache
/// that keeps only these keeps all the flow reads.
pub const ANNOTATION_PREFIX: &str = "nvidia.com/gpu-driver-upgrade";
/// Node label holding the upgrade state.
pub const STATE_LABEL: &str = "nvidia.com/gpu-driver-upgrade-state";
/// Node label: `true` keeps the node out of driver upgrades.
pub const SKIP_LABEL: &str = "nvidia.com/gpu-driver-upgrade.skip";
/// Pod label: `true` keeps the pod from being drained (the operator's own pod carries it).
pub const DRAIN_SKIP_LABEL: &str = "nvidia.com/gpu-driver-upgrade-drain.skip";
/// The selector ANDed into every drain selector, as NVIDIA's upgrade controller does.
pub const DRAIN_SKIP_SELECTOR: &str = "nvidia.com/gpu-driver-upgrade-drain.skip!=true";
/// Node annotation set by a driver pod that waits for the node to be emptied
/// before it loads the driver (safe driver load); removing it lets the driver load.
pub const SAFE_LOAD_ANNOTATION: &str = "nvidia.com/gpu-driver-upgrade.driver-wait-for-safe-load";
/// Node annotation: the node was already unschedulable when its upgrade began,
/// so it is left cordoned afterwards.
pub const INITIAL_STATE_ANNOTATION: &str =
    "nvidia.com/gpu-driver-upgrade.node-initial-state.unschedulable";
/// Node annotation: unix seconds when waiting for `waitForCompletion` pods began.
pub const WAIT_FOR_COMPLETION_START_ANNOTATION: &str =
    "nvidia.com/gpu-driver-upgrade-wait-for-pod-completion-start-time";
/// Node annotation: unix seconds when waiting for the validator began.
pub const VALIDATION_START_ANNOTATION: &str = "nvidia.com/gpu-driver-upgrade-validation-start-time";
/// Node annotation: `true` asks for an upgrade even when the driver pod is in
/// sync (NVIDIA uses it for orphaned driver pods).
pub const UPGRADE_REQUESTED_ANNOTATION: &str = "nvidia.com/gpu-driver-upgrade-requested";
/// Node annotation of NVIDIA's requestor mode (not implemented here).
pub const REQUESTOR_MODE_ANNOTATION: &str = "nvidia.com/gpu-driver-upgrade-requestor-mode";
/// Node annotation written by this pass (not by NVIDIA): `<state>@<unix seconds>`,
/// when the node entered its current state.
pub const STATE_START_TIME_ANNOTATION: &str = "nvidia.com/gpu-driver-upgrade-state-start-time";
/// Pods the validation state waits for (`WithValidationEnabled` in the GPU
/// operator): the validator's, and the node agent's, which hosts the
/// validator with `nodeAgent.enabled` and is Ready once its checks passed.
pub const VALIDATOR_POD_SELECTOR: &str = "app in (nvidia-operator-validator,gpu-stack-node-agent)";
/// Seconds a node may wait for the validator before the upgrade fails (NVIDIA's constant).
pub const VALIDATION_TIMEOUT_SECONDS: u64 = 600;
/// A driver pod container that restarted more often than this and is not
/// ready makes the upgrade fail (NVIDIA's `isDriverPodFailing`).
pub const DRIVER_POD_FAILING_RESTARTS: u32 = 10;

/// `maxParallelUpgrades` when unset.
pub const DEFAULT_MAX_PARALLEL_UPGRADES: i64 = 1;
/// `maxUnavailable` when unset.
pub const DEFAULT_MAX_UNAVAILABLE: &str = "25%";
/// `podDeletion.timeoutSeconds` and `drain.timeoutSeconds` when unset.
pub const DEFAULT_TIMEOUT_SECONDS: i64 = 300;

/// Fields a policy section does not model, kept verbatim and reported.
pub type Extra = BTreeMap<String, Value>;

fn null_as_default<'de, D: Deserializer<'de>, T: Default + Deserialize<'de>>(
    d: D,
) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

fn de_max_parallel<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    Ok(Option::<i64>::deserialize(d)?.unwrap_or(DEFAULT_MAX_PARALLEL_UPGRADES))
}

fn de_timeout<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    Ok(Option::<i64>::deserialize(d)?.unwrap_or(DEFAULT_TIMEOUT_SECONDS))
}

fn default_max_parallel() -> i64 {
    DEFAULT_MAX_PARALLEL_UPGRADES
}

fn default_timeout() -> i64 {
    DEFAULT_TIMEOUT_SECONDS
}

/// An integer or a string, as Kubernetes' `IntOrString` (`maxUnavailable: 2`
/// or `maxUnavailable: "25%"`). Kept as written; [`IntOrString::scaled`]
/// interprets it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum IntOrString {
    /// A number.
    Int(i64),
    /// A string; only a percentage such as `"25%"` is meaningful.
    String(String),
}

impl Default for IntOrString {
    fn default() -> Self {
        IntOrString::String(DEFAULT_MAX_UNAVAILABLE.to_string())
    }
}

impl fmt::Display for IntOrString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IntOrString::Int(i) => write!(f, "{i}"),
            IntOrString::String(s) => write!(f, "{s:?}"),
        }
    }
}

impl IntOrString {
    /// The absolute number this value stands for among `total` nodes: an
    /// integer as is, a percentage of `total` rounded up (Kubernetes'
    /// `GetScaledValueFromIntOrPercent(v, total, true)`). Refuses negative
    /// values, percentages over 100 and strings that are not percentages.
    pub fn scaled(&self, total: usize) -> Result<usize, UpgradePolicyError> {
        match self {
            IntOrString::Int(i) => {
                usize::try_from(*i).map_err(|_| UpgradePolicyError::MaxUnavailableNegative {
                    value: self.to_string(),
                })
            }
            IntOrString::String(s) => {
                let Some(digits) = s.strip_suffix('%') else {
                    return Err(UpgradePolicyError::MaxUnavailableUnparsable { value: s.clone() });
                };
                let pct: i64 =
                    digits
                        .parse()
                        .map_err(|_| UpgradePolicyError::MaxUnavailableUnparsable {
                            value: s.clone(),
                        })?;
                if pct < 0 {
                    return Err(UpgradePolicyError::MaxUnavailableNegative { value: s.clone() });
                }
                if pct > 100 {
                    return Err(UpgradePolicyError::MaxUnavailableOver100 { value: s.clone() });
                }
                // pct <= 100, so the product fits easily.
                let pct = pct as usize;
                Ok((pct * total).div_ceil(100))
            }
        }
    }
}

/// `driver.upgradePolicy` (NVIDIA's `DriverUpgradePolicySpec`), with the
/// defaults NVIDIA's CRD applies to unset fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UpgradePolicy {
    /// Global switch; when false the other fields are ignored and the state
    /// labels are removed (default false in the ClusterPolicy CRD; the Helm
    /// chart and NVIDIADriver default it to true).
    #[serde(default, deserialize_with = "null_as_default")]
    pub auto_upgrade: bool,
    /// Nodes upgraded at once; 0 means no limit (default 1).
    #[serde(default = "default_max_parallel", deserialize_with = "de_max_parallel")]
    pub max_parallel_upgrades: i64,
    /// Nodes that may be unavailable at once, an integer or a percentage of
    /// the managed nodes rounded up (default `"25%"`).
    #[serde(default, deserialize_with = "null_as_default")]
    pub max_unavailable: IntOrString,
    /// Deletion of the pods that use GPUs.
    #[serde(default, deserialize_with = "null_as_default")]
    pub pod_deletion: PodDeletionPolicy,
    /// Waiting for jobs to finish before GPU pods are deleted.
    #[serde(default, deserialize_with = "null_as_default")]
    pub wait_for_completion: WaitForCompletionPolicy,
    /// Node drain, the fallback when GPU pods cannot be deleted.
    #[serde(default, deserialize_with = "null_as_default")]
    pub drain: DrainPolicy,
    /// Fields this implementation does not model.
    #[serde(flatten, default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extra: Extra,
}

impl Default for UpgradePolicy {
    fn default() -> Self {
        UpgradePolicy {
            auto_upgrade: false,
            max_parallel_upgrades: DEFAULT_MAX_PARALLEL_UPGRADES,
            max_unavailable: IntOrString::default(),
            pod_deletion: PodDeletionPolicy::default(),
            wait_for_completion: WaitForCompletionPolicy::default(),
            drain: DrainPolicy::default(),
            extra: Extra::new(),
        }
    }
}

/// `upgradePolicy.podDeletion` (the Helm chart calls it `gpuPodDeletion`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodDeletionPolicy {
    /// Delete pods that no controller manages (default false).
    #[serde(default, deserialize_with = "null_as_default")]
    pub force: bool,
    /// Seconds to wait for the pods to go; 0 waits forever (default 300).
    #[serde(default = "default_timeout", deserialize_with = "de_timeout")]
    pub timeout_seconds: i64,
    /// Delete pods that use `emptyDir` volumes, losing that data (default false).
    #[serde(default, deserialize_with = "null_as_default")]
    pub delete_empty_dir: bool,
    /// Extra pods to delete besides those using GPUs (newer NVIDIA releases); empty adds none.
    #[serde(default, deserialize_with = "null_as_default")]
    pub pod_selector: String,
    /// Fields this implementation does not model.
    #[serde(flatten, default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extra: Extra,
}

impl Default for PodDeletionPolicy {
    fn default() -> Self {
        PodDeletionPolicy {
            force: false,
            timeout_seconds: DEFAULT_TIMEOUT_SECONDS,
            delete_empty_dir: false,
            pod_selector: String::new(),
            extra: Extra::new(),
        }
    }
}

/// `upgradePolicy.waitForCompletion`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WaitForCompletionPolicy {
    /// Pods to wait for; empty waits for none (default empty).
    #[serde(default, deserialize_with = "null_as_default")]
    pub pod_selector: String,
    /// Seconds to wait before deleting them anyway; 0 waits forever (default 0).
    #[serde(default, deserialize_with = "null_as_default")]
    pub timeout_seconds: i64,
    /// Fields this implementation does not model.
    #[serde(flatten, default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extra: Extra,
}

/// `upgradePolicy.drain`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DrainPolicy {
    /// Drain the node when GPU pods cannot be deleted (default false).
    #[serde(default, deserialize_with = "null_as_default")]
    pub enable: bool,
    /// Evict pods that no controller manages (default false).
    #[serde(default, deserialize_with = "null_as_default")]
    pub force: bool,
    /// Pods to drain; empty drains all (always ANDed with [`DRAIN_SKIP_SELECTOR`]).
    #[serde(default, deserialize_with = "null_as_default")]
    pub pod_selector: String,
    /// Seconds the drain may take; 0 waits forever (default 300).
    #[serde(default = "default_timeout", deserialize_with = "de_timeout")]
    pub timeout_seconds: i64,
    /// Evict pods that use `emptyDir` volumes, losing that data (default false).
    #[serde(default, deserialize_with = "null_as_default")]
    pub delete_empty_dir: bool,
    /// Fields this implementation does not model.
    #[serde(flatten, default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extra: Extra,
}

impl Default for DrainPolicy {
    fn default() -> Self {
        DrainPolicy {
            enable: false,
            force: false,
            pod_selector: String::new(),
            timeout_seconds: DEFAULT_TIMEOUT_SECONDS,
            delete_empty_dir: false,
            extra: Extra::new(),
        }
    }
}

/// A problem in an upgrade policy. Display is `<field>: <what to do>`, the
/// field relative to `upgradePolicy`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpgradePolicyError {
    /// `maxUnavailable` is neither an integer nor a percentage.
    #[error(
        "maxUnavailable: {value:?} is not an integer or a percentage; write a number such as 1 or a percentage such as \"25%\""
    )]
    MaxUnavailableUnparsable {
        /// As written.
        value: String,
    },
    /// `maxUnavailable` is negative.
    #[error("maxUnavailable: {value} is negative; use 0 or more")]
    MaxUnavailableNegative {
        /// As written.
        value: String,
    },
    /// `maxUnavailable` is a percentage over 100.
    #[error("maxUnavailable: {value} is over 100%; use a percentage from \"0%\" to \"100%\"")]
    MaxUnavailableOver100 {
        /// As written.
        value: String,
    },
    /// `maxParallelUpgrades` is negative.
    #[error("maxParallelUpgrades: {0} is negative; use 0 (no limit) or a number of nodes")]
    MaxParallelNegative(i64),
    /// A timeout is negative.
    #[error("{field}: {value} is negative; use 0 (wait forever) or a number of seconds")]
    TimeoutNegative {
        /// Field path, e.g. `drain.timeoutSeconds`.
        field: &'static str,
        /// As written.
        value: i64,
    },
    /// A pod selector does not parse.
    #[error("{field}: {source}")]
    Selector {
        /// Field path, e.g. `drain.podSelector`.
        field: &'static str,
        /// The parse error.
        source: SelectorError,
    },
}

impl UpgradePolicyError {
    /// The field the problem is in, relative to `upgradePolicy`.
    pub fn field(&self) -> &'static str {
        match self {
            UpgradePolicyError::MaxUnavailableUnparsable { .. }
            | UpgradePolicyError::MaxUnavailableNegative { .. }
            | UpgradePolicyError::MaxUnavailableOver100 { .. } => "maxUnavailable",
            UpgradePolicyError::MaxParallelNegative(_) => "maxParallelUpgrades",
            UpgradePolicyError::TimeoutNegative { field, .. }
            | UpgradePolicyError::Selector { field, .. } => field,
        }
    }
}

impl UpgradePolicy {
    /// Every problem in the policy (empty when it is usable).
    pub fn validate(&self) -> Vec<UpgradePolicyError> {
        let mut out = Vec::new();
        if self.max_parallel_upgrades < 0 {
            out.push(UpgradePolicyError::MaxParallelNegative(
                self.max_parallel_upgrades,
            ));
        }
        // Any node count shows a malformed value; 100 keeps percentages meaningful.
        if let Err(e) = self.max_unavailable.scaled(100) {
            out.push(e);
        }
        for (field, value) in [
            (
                "podDeletion.timeoutSeconds",
                self.pod_deletion.timeout_seconds,
            ),
            (
                "waitForCompletion.timeoutSeconds",
                self.wait_for_completion.timeout_seconds,
            ),
            ("drain.timeoutSeconds", self.drain.timeout_seconds),
        ] {
            if value < 0 {
                out.push(UpgradePolicyError::TimeoutNegative { field, value });
            }
        }
        for (field, s) in [
            ("podDeletion.podSelector", &self.pod_deletion.pod_selector),
            (
                "waitForCompletion.podSelector",
                &self.wait_for_completion.pod_selector,
            ),
            ("drain.podSelector", &self.drain.pod_selector),
        ] {
            if let Err(source) = LabelSelector::parse(s) {
                out.push(UpgradePolicyError::Selector { field, source });
            }
        }
        out
    }

    /// Paths (relative to `upgradePolicy`) of fields this implementation does
    /// not model, sorted.
    pub fn unknown_fields(&self) -> Vec<String> {
        let mut out: Vec<String> = self.extra.keys().cloned().collect();
        for (section, extra) in [
            ("podDeletion", &self.pod_deletion.extra),
            ("waitForCompletion", &self.wait_for_completion.extra),
            ("drain", &self.drain.extra),
        ] {
            out.extend(extra.keys().map(|k| format!("{section}.{k}")));
        }
        out.sort();
        out
    }

    /// The selector the drain lists pods with: the policy's, ANDed with
    /// [`DRAIN_SKIP_SELECTOR`] so the operator's own pod is never drained.
    pub fn drain_selector(&self) -> String {
        let own = self.drain.pod_selector.trim();
        if own.is_empty() {
            DRAIN_SKIP_SELECTOR.to_string()
        } else {
            format!("{own},{DRAIN_SKIP_SELECTOR}")
        }
    }

    /// `maxUnavailable` as a node count among `total` managed nodes.
    pub fn max_unavailable_nodes(&self, total: usize) -> Result<usize, UpgradePolicyError> {
        self.max_unavailable.scaled(total)
    }
}

/// The value of [`STATE_LABEL`] is not one of NVIDIA's states.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{value:?} is not a driver upgrade state; remove the {STATE_LABEL} label to restart the node's upgrade from the beginning"
)]
pub struct UpgradeStateError {
    /// The label value.
    pub value: String,
}

/// A node's driver upgrade state: the value of [`STATE_LABEL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum UpgradeState {
    /// `""` (no label): not processed yet, or auto-upgrade is off.
    #[default]
    Unknown,
    /// `upgrade-required`: the driver pod is out of date; waiting for a slot.
    UpgradeRequired,
    /// `cordon-required`: about to be cordoned.
    CordonRequired,
    /// `wait-for-jobs-required`: waiting for `waitForCompletion` pods.
    WaitForJobsRequired,
    /// `pod-deletion-required`: GPU pods are being deleted.
    PodDeletionRequired,
    /// `drain-required`: the node is being drained.
    DrainRequired,
    /// `node-maintenance-required`: requestor mode only (not implemented).
    NodeMaintenanceRequired,
    /// `post-maintenance-required`: requestor mode only (not implemented).
    PostMaintenanceRequired,
    /// `pod-restart-required`: the driver pod is being replaced.
    PodRestartRequired,
    /// `validation-required`: waiting for the validator on the new driver.
    ValidationRequired,
    /// `uncordon-required`: about to be uncordoned.
    UncordonRequired,
    /// `upgrade-done`: the driver pod is up to date.
    Done,
    /// `upgrade-failed`: recovers once the driver pod is in sync and Ready.
    Failed,
}

impl UpgradeState {
    /// Every state.
    pub const ALL: [UpgradeState; 13] = [
        UpgradeState::Unknown,
        UpgradeState::UpgradeRequired,
        UpgradeState::CordonRequired,
        UpgradeState::WaitForJobsRequired,
        UpgradeState::PodDeletionRequired,
        UpgradeState::DrainRequired,
        UpgradeState::NodeMaintenanceRequired,
        UpgradeState::PostMaintenanceRequired,
        UpgradeState::PodRestartRequired,
        UpgradeState::ValidationRequired,
        UpgradeState::UncordonRequired,
        UpgradeState::Done,
        UpgradeState::Failed,
    ];

    /// The label value (`""` for [`UpgradeState::Unknown`], which means no label).
    pub fn as_label(self) -> &'static str {
        match self {
            UpgradeState::Unknown => "",
            UpgradeState::UpgradeRequired => "upgrade-required",
            UpgradeState::CordonRequired => "cordon-required",
            UpgradeState::WaitForJobsRequired => "wait-for-jobs-required",
            UpgradeState::PodDeletionRequired => "pod-deletion-required",
            UpgradeState::DrainRequired => "drain-required",
            UpgradeState::NodeMaintenanceRequired => "node-maintenance-required",
            UpgradeState::PostMaintenanceRequired => "post-maintenance-required",
            UpgradeState::PodRestartRequired => "pod-restart-required",
            UpgradeState::ValidationRequired => "validation-required",
            UpgradeState::UncordonRequired => "uncordon-required",
            UpgradeState::Done => "upgrade-done",
            UpgradeState::Failed => "upgrade-failed",
        }
    }

    /// Parses a label value; `""` is [`UpgradeState::Unknown`].
    pub fn from_label(value: &str) -> Result<UpgradeState, UpgradeStateError> {
        UpgradeState::ALL
            .into_iter()
            .find(|s| s.as_label() == value)
            .ok_or_else(|| UpgradeStateError {
                value: value.to_string(),
            })
    }

    /// Between `cordon-required` and `uncordon-required`, or failed: the node
    /// holds an upgrade slot (NVIDIA's "in progress").
    pub fn in_progress(self) -> bool {
        !matches!(
            self,
            UpgradeState::Unknown
                | UpgradeState::Done
                | UpgradeState::UpgradeRequired
                | UpgradeState::NodeMaintenanceRequired
                | UpgradeState::PostMaintenanceRequired
        )
    }

    /// Up to date and holding no slot: `upgrade-done`, or no label (a node
    /// whose driver never needed an upgrade).
    pub fn at_rest(self) -> bool {
        matches!(self, UpgradeState::Unknown | UpgradeState::Done)
    }

    /// Handled by the in-place flow (the requestor-mode states are not).
    pub fn managed(self) -> bool {
        !matches!(
            self,
            UpgradeState::NodeMaintenanceRequired | UpgradeState::PostMaintenanceRequired
        )
    }
}

impl fmt::Display for UpgradeState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UpgradeState::Unknown => f.write_str("unknown"),
            s => f.write_str(s.as_label()),
        }
    }
}

impl Serialize for UpgradeState {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_label())
    }
}

impl<'de> Deserialize<'de> for UpgradeState {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        UpgradeState::from_label(&s).map_err(serde::de::Error::custom)
    }
}

/// What a node's labels and annotations say about its upgrade.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct UpgradeMarks {
    /// [`STATE_LABEL`].
    pub state: UpgradeState,
    /// [`SKIP_LABEL`] is `true`.
    pub skip: bool,
    /// [`UPGRADE_REQUESTED_ANNOTATION`] is `true`.
    pub upgrade_requested: bool,
    /// [`SAFE_LOAD_ANNOTATION`] is set (non-empty).
    pub waiting_for_safe_load: bool,
    /// [`INITIAL_STATE_ANNOTATION`] is present.
    pub initially_unschedulable: bool,
    /// [`WAIT_FOR_COMPLETION_START_ANNOTATION`], when it holds unix seconds.
    pub wait_for_completion_since: Option<u64>,
    /// [`VALIDATION_START_ANNOTATION`], when it holds unix seconds.
    pub validation_since: Option<u64>,
    /// [`STATE_START_TIME_ANNOTATION`]: the state it was written for, and when.
    pub state_since: Option<(UpgradeState, u64)>,
}

impl UpgradeMarks {
    /// Reads the marks from a node's labels and annotations. Fails only when
    /// the state label holds a value that is not a state; NVIDIA leaves such
    /// a node alone, so a caller should leave it out of the pass.
    pub fn read(
        labels: &BTreeMap<String, String>,
        annotations: &BTreeMap<String, String>,
    ) -> Result<UpgradeMarks, UpgradeStateError> {
        let state = UpgradeState::from_label(labels.get(STATE_LABEL).map_or("", String::as_str))?;
        let secs = |key: &str| annotations.get(key).and_then(|v| v.trim().parse().ok());
        let state_since = annotations
            .get(STATE_START_TIME_ANNOTATION)
            .and_then(|v| v.rsplit_once('@'))
            .and_then(|(s, t)| Some((UpgradeState::from_label(s).ok()?, t.parse().ok()?)));
        Ok(UpgradeMarks {
            state,
            skip: labels.get(SKIP_LABEL).is_some_and(|v| v == "true"),
            upgrade_requested: annotations
                .get(UPGRADE_REQUESTED_ANNOTATION)
                .is_some_and(|v| v == "true"),
            waiting_for_safe_load: annotations
                .get(SAFE_LOAD_ANNOTATION)
                .is_some_and(|v| !v.is_empty()),
            initially_unschedulable: annotations.contains_key(INITIAL_STATE_ANNOTATION),
            wait_for_completion_since: secs(WAIT_FOR_COMPLETION_START_ANNOTATION),
            validation_since: secs(VALIDATION_START_ANNOTATION),
            state_since,
        })
    }

    /// When the node entered its current state, if recorded for that state.
    pub fn current_state_since(&self) -> Option<u64> {
        self.state_since
            .filter(|(s, _)| *s == self.state)
            .map(|(_, t)| t)
    }
}

/// The value the pass writes to [`STATE_START_TIME_ANNOTATION`].
pub fn state_start_time_value(state: UpgradeState, now: u64) -> String {
    format!("{}@{now}", state.as_label())
}

/// A pod on a node, with what decides whether it may be evicted (the rules of
/// `kubectl drain`, which NVIDIA uses for both pod deletion and drain).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PodRef {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// A controller (ReplicaSet, Job, StatefulSet, ...) owns it; without one
    /// it is deleted only with `force`.
    pub controlled: bool,
    /// A DaemonSet owns it; drains skip such pods, and pod deletion cannot delete them.
    pub daemon_set: bool,
    /// It mounts an `emptyDir` volume; deleted only with `deleteEmptyDir`.
    pub empty_dir: bool,
}

impl fmt::Display for PodRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The driver pod on a node.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DriverPodObservation {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Its `controller-revision-hash` label.
    pub revision: String,
    /// The owning DaemonSet's newest revision hash; `None` for an orphaned pod
    /// (no owning DaemonSet), which is never in sync.
    pub daemonset_revision: Option<String>,
    /// Running, with every container Ready.
    pub ready: bool,
    /// Being deleted (deletion timestamp set).
    pub terminating: bool,
    /// A container is not Ready and restarted more than
    /// [`DRIVER_POD_FAILING_RESTARTS`] times.
    pub failing: bool,
    /// The node has no driver pod right now: the old one is gone and the
    /// DaemonSet has not created the new one yet (the other fields are
    /// empty). Only a node mid-upgrade is observed like this; it holds its
    /// state, and still counts against the budget, until the pod is back.
    #[serde(default)]
    pub missing: bool,
}

impl DriverPodObservation {
    /// The pod runs the DaemonSet's newest revision.
    pub fn in_sync(&self) -> bool {
        self.daemonset_revision.as_deref() == Some(self.revision.as_str())
    }

    /// In sync and Ready (NVIDIA's `isDriverPodInSync`).
    pub fn in_sync_and_ready(&self) -> bool {
        self.in_sync() && self.ready
    }
}

/// The validator pods ([`VALIDATOR_POD_SELECTOR`]) on a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ValidatorStatus {
    /// No validator pod on the node (NVIDIA waits with no timeout).
    #[default]
    Absent,
    /// A validator pod is not Running with every container Ready.
    NotReady,
    /// Every validator pod is Ready.
    Ready,
}

/// Everything the pass needs to know about one managed node (a node that
/// runs a driver pod).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NodeObservation {
    /// Node name.
    pub name: String,
    /// Its upgrade label and annotations.
    pub marks: UpgradeMarks,
    /// The node's `Ready` condition is not False/Unknown.
    pub node_ready: bool,
    /// `spec.unschedulable` (cordoned).
    pub unschedulable: bool,
    /// The driver pod.
    pub driver_pod: DriverPodObservation,
    /// The validator pods.
    pub validator: ValidatorStatus,
    /// Running or Pending pods the pod deletion selects: those requesting
    /// `nvidia.com/gpu*` or `nvidia.com/mig-*` or holding a GPU resource
    /// claim, plus those matching `podDeletion.podSelector`.
    pub gpu_pods: Vec<PodRef>,
    /// Running or Pending pods matching `waitForCompletion.podSelector`
    /// (empty when the selector is empty).
    pub wait_pods: Vec<PodRef>,
    /// Pods matching [`UpgradePolicy::drain_selector`] (empty when drain is off).
    pub drain_pods: Vec<PodRef>,
}

/// What the caller does to a node, beyond writing its state label.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "action")]
pub enum UpgradeAction {
    /// Mark the node unschedulable.
    Cordon,
    /// Mark the node schedulable.
    Uncordon,
    /// Set a node annotation.
    SetAnnotation {
        /// Key.
        key: String,
        /// Value.
        value: String,
    },
    /// Remove a node annotation.
    RemoveAnnotation {
        /// Key.
        key: String,
    },
    /// Evict these pods (the eviction API, so disruption budgets hold;
    /// `force` and `deleteEmptyDir` were already checked). Pods already
    /// terminating need nothing more.
    Evict {
        /// Why: pod deletion or drain.
        purpose: EvictionPurpose,
        /// The pods.
        pods: Vec<PodRef>,
    },
    /// Delete the driver pod so the DaemonSet recreates it at the new revision.
    DeleteDriverPod {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
    },
}

/// Why pods are evicted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum EvictionPurpose {
    /// The pod-deletion state: pods that use GPUs.
    PodDeletion,
    /// The drain state.
    Drain,
}

/// The pass's decision for one node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeDecision {
    /// Node name.
    pub node: String,
    /// State at the start of the pass.
    pub from: UpgradeState,
    /// State to write ([`UpgradeState::Unknown`]: remove the label).
    pub next: UpgradeState,
    /// Actions, in order.
    pub actions: Vec<UpgradeAction>,
    /// What happened or what the node waits for, for logs, events and status.
    pub reason: String,
}

impl NodeDecision {
    /// The state label changes or there is something to do.
    pub fn has_changes(&self) -> bool {
        self.from != self.next || !self.actions.is_empty()
    }
}

/// Fleet-wide numbers at the start of a pass (the `gpu_operator_nodes_upgrades_*` figures).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct UpgradeCounts {
    /// Managed nodes (all but the requestor-mode states).
    pub total: usize,
    /// Nodes holding an upgrade slot (see [`UpgradeState::in_progress`]).
    pub in_progress: usize,
    /// At rest with an up-to-date driver pod: `upgrade-done`, or no label
    /// (see [`UpgradeState::at_rest`]).
    pub done: usize,
    /// `upgrade-failed`.
    pub failed: usize,
    /// `upgrade-required`.
    pub pending: usize,
    /// Cordoned or NotReady nodes, plus those in `cordon-required`.
    pub unavailable: usize,
    /// `maxUnavailable` as a node count.
    pub max_unavailable: usize,
    /// Upgrades that may start in this pass.
    pub available: i64,
}

/// The result of one pass.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct UpgradePlan {
    /// One decision per observed node, sorted by node name.
    pub decisions: Vec<NodeDecision>,
    /// Numbers at the start of the pass.
    pub counts: UpgradeCounts,
}

impl UpgradePlan {
    /// The decision for a node.
    pub fn decision(&self, node: &str) -> Option<&NodeDecision> {
        self.decisions.iter().find(|d| d.node == node)
    }
}

/// Which optional states the flow uses. The GPU operator enables both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PassOptions {
    /// `pod-deletion-required` deletes GPU pods; when off, nodes go from
    /// waiting for jobs straight to drain.
    pub pod_deletion: bool,
    /// `validation-required` waits for the validator; when off, a Ready
    /// driver pod finishes the upgrade.
    pub validation: bool,
}

impl Default for PassOptions {
    fn default() -> Self {
        PassOptions {
            pod_deletion: true,
            validation: true,
        }
    }
}

/// Counts at the start of a pass, as NVIDIA's `GetUpgradesAvailable` computes them.
pub fn upgrade_counts(
    nodes: &[NodeObservation],
    policy: &UpgradePolicy,
) -> Result<UpgradeCounts, UpgradePolicyError> {
    let managed = || nodes.iter().filter(|n| n.marks.state.managed());
    let count = |s: UpgradeState| managed().filter(|n| n.marks.state == s).count();
    let total = managed().count();
    let in_progress = managed().filter(|n| n.marks.state.in_progress()).count();
    let pending = count(UpgradeState::UpgradeRequired);
    // NVIDIA counts every node with a driver pod here, requestor states included.
    let unavailable = nodes
        .iter()
        .filter(|n| n.unschedulable || !n.node_ready)
        .count()
        + count(UpgradeState::CordonRequired);
    let max_unavailable = policy.max_unavailable_nodes(total)?;
    let mut available = if policy.max_parallel_upgrades == 0 {
        pending as i64
    } else {
        policy.max_parallel_upgrades - in_progress as i64
    };
    let max_u = max_unavailable as i64;
    let unavail = unavailable as i64;
    available = available.min(max_u);
    if unavail >= max_u {
        available = 0;
    } else if max_unavailable < total && unavail + available > max_u {
        available = max_u - unavail;
    }
    Ok(UpgradeCounts {
        total,
        in_progress,
        done: managed()
            .filter(|n| n.marks.state.at_rest() && needs_upgrade(n).is_none())
            .count(),
        failed: count(UpgradeState::Failed),
        pending,
        unavailable,
        max_unavailable,
        available,
    })
}

struct Step {
    next: UpgradeState,
    actions: Vec<UpgradeAction>,
    reason: String,
}

impl Step {
    fn to(next: UpgradeState, reason: impl Into<String>) -> Step {
        Step {
            next,
            actions: Vec::new(),
            reason: reason.into(),
        }
    }
    fn with(mut self, a: UpgradeAction) -> Step {
        self.actions.push(a);
        self
    }
}

fn remove(key: &str) -> UpgradeAction {
    UpgradeAction::RemoveAnnotation {
        key: key.to_string(),
    }
}

fn set(key: &str, value: String) -> UpgradeAction {
    UpgradeAction::SetAnnotation {
        key: key.to_string(),
        value,
    }
}

fn pod_list(pods: &[PodRef]) -> String {
    const SHOWN: usize = 3;
    let mut s: Vec<String> = pods.iter().take(SHOWN).map(ToString::to_string).collect();
    if pods.len() > SHOWN {
        s.push(format!("and {} more", pods.len() - SHOWN));
    }
    s.join(", ")
}

/// Why `kubectl drain` would refuse to delete a pod, if it would.
fn refusal(pod: &PodRef, force: bool, delete_empty_dir: bool, field: &str) -> Option<String> {
    if pod.empty_dir && !delete_empty_dir {
        Some(format!(
            "{pod} uses emptyDir (set {field}.deleteEmptyDir to delete it)"
        ))
    } else if !pod.controlled && !pod.daemon_set && !force {
        Some(format!(
            "{pod} has no controller (set {field}.force to delete it)"
        ))
    } else {
        None
    }
}

fn timed_out(since: Option<u64>, timeout: i64, now: u64) -> bool {
    match (since, u64::try_from(timeout)) {
        (Some(start), Ok(t)) if t > 0 => now > start.saturating_add(t),
        _ => false,
    }
}

/// The end of a successful upgrade: uncordon, or leave a node that was
/// cordoned before the upgrade as it was (NVIDIA's `updateNodeToUncordonOrDoneState`).
fn uncordon_or_done(n: &NodeObservation, reason: &str) -> Step {
    if n.marks.initially_unschedulable {
        Step::to(
            UpgradeState::Done,
            format!("{reason}; the node was cordoned before the upgrade, so it stays cordoned"),
        )
        .with(remove(INITIAL_STATE_ANNOTATION))
    } else {
        Step::to(UpgradeState::UncordonRequired, reason.to_string())
    }
}

fn needs_upgrade(n: &NodeObservation) -> Option<String> {
    let pod = &n.driver_pod;
    if pod.daemonset_revision.is_some() && !pod.in_sync() {
        Some(format!(
            "driver pod {} runs revision {} but its DaemonSet is at {}",
            pod.name,
            pod.revision,
            pod.daemonset_revision.as_deref().unwrap_or("")
        ))
    } else if n.marks.waiting_for_safe_load {
        Some("the driver pod waits for a safe load".into())
    } else if n.marks.upgrade_requested {
        Some("an upgrade was requested".into())
    } else {
        None
    }
}

fn step_done_or_unknown(n: &NodeObservation) -> Step {
    if let Some(why) = needs_upgrade(n) {
        let mut s = Step::to(UpgradeState::UpgradeRequired, why);
        if n.unschedulable && !n.marks.initially_unschedulable {
            s = s.with(set(INITIAL_STATE_ANNOTATION, "true".into()));
        }
        return s;
    }
    // A node whose driver never needed an upgrade keeps no label: `""` and
    // `upgrade-done` mean the same to NVIDIA's operator (its ClusterPolicy
    // readiness accepts both) and to this flow, and labelling every node
    // once would cost one more write per node of a fleet for nothing.
    Step::to(n.marks.state, "the driver pod is up to date")
}

fn step_upgrade_required(n: &NodeObservation, available: &mut i64, c: &UpgradeCounts) -> Step {
    let mut pre = Vec::new();
    if n.marks.upgrade_requested {
        pre.push(remove(UPGRADE_REQUESTED_ANNOTATION));
    }
    let mut s = if n.marks.skip {
        Step::to(
            UpgradeState::UpgradeRequired,
            format!("the node is labelled {SKIP_LABEL}=true"),
        )
    } else if !n.node_ready {
        Step::to(
            UpgradeState::UpgradeRequired,
            "the node is NotReady; its upgrade starts once it is Ready",
        )
    } else if *available <= 0 && !n.unschedulable {
        Step::to(
            UpgradeState::UpgradeRequired,
            format!(
                "waiting for an upgrade slot: {} in progress, {} of at most {} nodes unavailable",
                c.in_progress, c.unavailable, c.max_unavailable
            ),
        )
    } else {
        *available -= 1;
        Step::to(UpgradeState::CordonRequired, "upgrade slot taken")
    };
    pre.append(&mut s.actions);
    s.actions = pre;
    s
}

fn step_wait_for_jobs(
    n: &NodeObservation,
    policy: &UpgradePolicy,
    opts: &PassOptions,
    now: u64,
) -> Step {
    let wfc = &policy.wait_for_completion;
    if wfc.pod_selector.trim().is_empty() {
        let next = if opts.pod_deletion {
            UpgradeState::PodDeletionRequired
        } else {
            UpgradeState::DrainRequired
        };
        return Step::to(
            next,
            "no waitForCompletion.podSelector; nothing to wait for",
        );
    }
    let since = n.marks.wait_for_completion_since;
    let done = |reason: &str| {
        let s = Step::to(UpgradeState::PodDeletionRequired, reason.to_string());
        if n.marks.wait_for_completion_since.is_some() {
            s.with(remove(WAIT_FOR_COMPLETION_START_ANNOTATION))
        } else {
            s
        }
    };
    if n.wait_pods.is_empty() {
        return done("the pods matching waitForCompletion.podSelector have finished");
    }
    if timed_out(since, wfc.timeout_seconds, now) {
        return done(&format!(
            "waited more than {} s for {}; deleting GPU pods anyway",
            wfc.timeout_seconds,
            pod_list(&n.wait_pods)
        ));
    }
    let s = Step::to(
        UpgradeState::WaitForJobsRequired,
        format!(
            "waiting for {} to finish ({})",
            pod_list(&n.wait_pods),
            wfc.pod_selector
        ),
    );
    if since.is_none() {
        s.with(set(WAIT_FOR_COMPLETION_START_ANNOTATION, now.to_string()))
    } else {
        s
    }
}

fn step_pod_deletion(
    n: &NodeObservation,
    policy: &UpgradePolicy,
    opts: &PassOptions,
    now: u64,
) -> Step {
    if !opts.pod_deletion {
        return Step::to(UpgradeState::DrainRequired, "pod deletion is not enabled");
    }
    let pd = &policy.pod_deletion;
    if n.gpu_pods.is_empty() {
        return Step::to(
            UpgradeState::PodRestartRequired,
            "no GPU pods left on the node",
        );
    }
    let fallback = if policy.drain.enable {
        UpgradeState::DrainRequired
    } else {
        UpgradeState::Failed
    };
    let then = if policy.drain.enable {
        "draining the node instead"
    } else {
        "the upgrade failed (enable drain to fall back to it)"
    };
    let refused: Vec<String> = n
        .gpu_pods
        .iter()
        .filter_map(|p| {
            if p.daemon_set {
                Some(format!("{p} belongs to a DaemonSet"))
            } else {
                refusal(p, pd.force, pd.delete_empty_dir, "podDeletion")
            }
        })
        .collect();
    if !refused.is_empty() {
        return Step::to(
            fallback,
            format!("cannot delete GPU pods: {}; {then}", refused.join("; ")),
        );
    }
    if timed_out(n.marks.current_state_since(), pd.timeout_seconds, now) {
        return Step::to(
            fallback,
            format!(
                "GPU pods still present after {} s: {}; {then}",
                pd.timeout_seconds,
                pod_list(&n.gpu_pods)
            ),
        );
    }
    Step::to(
        UpgradeState::PodDeletionRequired,
        format!("deleting GPU pods {}", pod_list(&n.gpu_pods)),
    )
    .with(UpgradeAction::Evict {
        purpose: EvictionPurpose::PodDeletion,
        pods: n.gpu_pods.clone(),
    })
}

fn step_drain(n: &NodeObservation, policy: &UpgradePolicy, now: u64) -> Step {
    let dr = &policy.drain;
    if !dr.enable {
        return Step::to(
            UpgradeState::PodRestartRequired,
            "drain is disabled by the policy",
        );
    }
    let cordon = (!n.unschedulable).then_some(UpgradeAction::Cordon);
    let with_cordon = |mut s: Step| {
        if let Some(c) = cordon.clone() {
            s.actions.insert(0, c);
        }
        s
    };
    let pods: Vec<PodRef> = n
        .drain_pods
        .iter()
        .filter(|p| !p.daemon_set)
        .cloned()
        .collect();
    if pods.is_empty() {
        return with_cordon(Step::to(
            UpgradeState::PodRestartRequired,
            "the node is drained",
        ));
    }
    let refused: Vec<String> = pods
        .iter()
        .filter_map(|p| refusal(p, dr.force, dr.delete_empty_dir, "drain"))
        .collect();
    if !refused.is_empty() {
        return with_cordon(Step::to(
            UpgradeState::Failed,
            format!("cannot drain the node: {}", refused.join("; ")),
        ));
    }
    if timed_out(n.marks.current_state_since(), dr.timeout_seconds, now) {
        return with_cordon(Step::to(
            UpgradeState::Failed,
            format!(
                "drain did not finish within {} s: {} remain",
                dr.timeout_seconds,
                pod_list(&pods)
            ),
        ));
    }
    with_cordon(
        Step::to(
            UpgradeState::DrainRequired,
            format!("draining {}", pod_list(&pods)),
        )
        .with(UpgradeAction::Evict {
            purpose: EvictionPurpose::Drain,
            pods,
        }),
    )
}

fn unblock_safe_load(n: &NodeObservation, s: Step) -> Step {
    if n.marks.waiting_for_safe_load {
        let mut s = s;
        s.actions.insert(0, remove(SAFE_LOAD_ANNOTATION));
        s
    } else {
        s
    }
}

fn step_pod_restart(n: &NodeObservation, opts: &PassOptions) -> Step {
    let pod = &n.driver_pod;
    if !pod.in_sync() {
        let s = Step::to(
            UpgradeState::PodRestartRequired,
            format!("replacing driver pod {} with the new revision", pod.name),
        );
        return if pod.terminating {
            Step {
                reason: format!("waiting for driver pod {} to terminate", pod.name),
                ..s
            }
        } else {
            s.with(UpgradeAction::DeleteDriverPod {
                namespace: pod.namespace.clone(),
                name: pod.name.clone(),
            })
        };
    }
    let s = if pod.ready {
        if opts.validation {
            Step::to(
                UpgradeState::ValidationRequired,
                "the new driver pod is Ready",
            )
        } else {
            uncordon_or_done(n, "the new driver pod is Ready")
        }
    } else if pod.failing {
        Step::to(
            UpgradeState::Failed,
            format!(
                "driver pod {} keeps restarting (more than {DRIVER_POD_FAILING_RESTARTS} restarts)",
                pod.name
            ),
        )
    } else {
        Step::to(
            UpgradeState::PodRestartRequired,
            format!("waiting for driver pod {} to be Ready", pod.name),
        )
    };
    unblock_safe_load(n, s)
}

fn step_failed(n: &NodeObservation) -> Step {
    if n.driver_pod.in_sync_and_ready() {
        uncordon_or_done(n, "the driver pod is now in sync and Ready")
    } else {
        Step::to(
            UpgradeState::Failed,
            format!(
                "upgrade failed; recovers once driver pod {} is at the new revision and Ready",
                n.driver_pod.name
            ),
        )
    }
}

fn step_validation(n: &NodeObservation, opts: &PassOptions, now: u64) -> Step {
    let since = n.marks.validation_since;
    let s = match (opts.validation, n.validator) {
        (false, _) | (true, ValidatorStatus::Ready) => {
            let s = uncordon_or_done(n, "the validator passed on the new driver");
            if since.is_some() {
                s.with(remove(VALIDATION_START_ANNOTATION))
            } else {
                s
            }
        }
        (true, ValidatorStatus::Absent) => Step::to(
            UpgradeState::ValidationRequired,
            format!("waiting for a validator pod ({VALIDATOR_POD_SELECTOR}) on the node"),
        ),
        (true, ValidatorStatus::NotReady) => match since {
            None => Step::to(
                UpgradeState::ValidationRequired,
                "waiting for the validator to be Ready",
            )
            .with(set(VALIDATION_START_ANNOTATION, now.to_string())),
            Some(start) if now > start.saturating_add(VALIDATION_TIMEOUT_SECONDS) => Step::to(
                UpgradeState::Failed,
                format!("the validator was not Ready within {VALIDATION_TIMEOUT_SECONDS} s"),
            )
            .with(remove(VALIDATION_START_ANNOTATION)),
            Some(_) => Step::to(
                UpgradeState::ValidationRequired,
                "waiting for the validator to be Ready",
            ),
        },
    };
    unblock_safe_load(n, s)
}

/// One pass of the upgrade flow over every managed node (NVIDIA's
/// `ApplyState`): for each node, the state to write and the actions to take.
///
/// `nodes` are the nodes that run a driver pod; `now` is unix seconds. The
/// slot-limited step hands slots out in node-name order. With
/// `autoUpgrade: false` every node goes to [`UpgradeState::Unknown`] (remove
/// the label) with no actions. Fails only on a policy the flow cannot use
/// (an unusable `maxUnavailable`; see [`UpgradePolicy::validate`]).
pub fn plan_pass(
    nodes: &[NodeObservation],
    policy: &UpgradePolicy,
    now: u64,
    opts: &PassOptions,
) -> Result<UpgradePlan, UpgradePolicyError> {
    let counts = upgrade_counts(nodes, policy)?;
    let mut order: Vec<&NodeObservation> = nodes.iter().collect();
    order.sort_by(|a, b| a.name.cmp(&b.name));
    let mut available = counts.available;
    let mut decisions = Vec::with_capacity(order.len());
    for n in order {
        let from = n.marks.state;
        let step = if !policy.auto_upgrade {
            Step::to(UpgradeState::Unknown, "autoUpgrade is off")
        } else if n.driver_pod.missing && from.in_progress() {
            Step::to(
                from,
                "waiting for the driver DaemonSet to create the node's driver pod",
            )
        } else {
            match from {
                UpgradeState::Unknown | UpgradeState::Done => step_done_or_unknown(n),
                UpgradeState::UpgradeRequired => step_upgrade_required(n, &mut available, &counts),
                UpgradeState::CordonRequired => {
                    let s = Step::to(UpgradeState::WaitForJobsRequired, "cordoned");
                    if n.unschedulable {
                        s
                    } else {
                        s.with(UpgradeAction::Cordon)
                    }
                }
                UpgradeState::WaitForJobsRequired => step_wait_for_jobs(n, policy, opts, now),
                UpgradeState::PodDeletionRequired => step_pod_deletion(n, policy, opts, now),
                UpgradeState::DrainRequired => step_drain(n, policy, now),
                UpgradeState::NodeMaintenanceRequired | UpgradeState::PostMaintenanceRequired => {
                    Step::to(
                        from,
                        "requestor mode (an external maintenance operator) is not implemented; the node is left alone",
                    )
                }
                UpgradeState::PodRestartRequired => step_pod_restart(n, opts),
                UpgradeState::Failed => step_failed(n),
                UpgradeState::ValidationRequired => step_validation(n, opts, now),
                UpgradeState::UncordonRequired => {
                    let s = Step::to(UpgradeState::Done, "uncordoned");
                    if n.unschedulable {
                        s.with(UpgradeAction::Uncordon)
                    } else {
                        s
                    }
                }
            }
        };
        let Step {
            next,
            mut actions,
            reason,
        } = step;
        if policy.auto_upgrade && from.managed() {
            track_state_time(n, next, now, &mut actions);
        }
        decisions.push(NodeDecision {
            node: n.name.clone(),
            from,
            next,
            actions,
            reason,
        });
    }
    Ok(UpgradePlan { decisions, counts })
}

/// Keeps [`STATE_START_TIME_ANNOTATION`] naming the node's current state.
fn track_state_time(
    n: &NodeObservation,
    next: UpgradeState,
    now: u64,
    actions: &mut Vec<UpgradeAction>,
) {
    let at_rest = next.at_rest();
    let recorded = n.marks.state_since;
    if at_rest {
        if recorded.is_some() {
            actions.push(remove(STATE_START_TIME_ANNOTATION));
        }
    } else if next != n.marks.state || recorded.map(|(s, _)| s) != Some(next) {
        actions.push(set(
            STATE_START_TIME_ANNOTATION,
            state_start_time_value(next, now),
        ));
    }
}

/// Nodes that follow one upgrade policy: with NVIDIADrivers, the nodes one
/// resource owns and its `upgradePolicy` (NVIDIA's per-CR upgrade state).
#[derive(Debug, Clone, PartialEq)]
pub struct UpgradeGroup {
    /// The policy.
    pub policy: UpgradePolicy,
    /// Its nodes.
    pub nodes: Vec<NodeObservation>,
}

/// [`plan_pass`] over several groups, each with its own policy and its own
/// budget (`maxUnavailable` counts the group's nodes, as NVIDIA counts a
/// resource's): one plan, decisions sorted by node, counts added up.
pub fn plan_groups(
    groups: &[UpgradeGroup],
    now: u64,
    opts: &PassOptions,
) -> Result<UpgradePlan, UpgradePolicyError> {
    let mut out = UpgradePlan::default();
    for g in groups {
        let plan = plan_pass(&g.nodes, &g.policy, now, opts)?;
        out.decisions.extend(plan.decisions);
        let (a, b) = (&mut out.counts, plan.counts);
        a.total += b.total;
        a.in_progress += b.in_progress;
        a.done += b.done;
        a.failed += b.failed;
        a.pending += b.pending;
        a.unavailable += b.unavailable;
        a.max_unavailable += b.max_unavailable;
        a.available += b.available;
    }
    out.decisions.sort_by(|a, b| a.node.cmp(&b.node));
    Ok(out)
}

/// [`stuck_nodes`] over several groups, sorted by node.
pub fn stuck_in_groups(
    groups: &[UpgradeGroup],
    now: u64,
    limit_seconds: u64,
    opts: &PassOptions,
) -> Result<Vec<StuckNode>, UpgradePolicyError> {
    let mut out = Vec::new();
    for g in groups {
        out.extend(stuck_nodes(&g.nodes, &g.policy, now, limit_seconds, opts)?);
    }
    out.sort_by(|a, b| a.node.cmp(&b.node));
    Ok(out)
}

/// A node that has waited in one state longer than the limit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StuckNode {
    /// Node name.
    pub node: String,
    /// The state it waits in.
    pub state: UpgradeState,
    /// Seconds in that state.
    pub waited_seconds: u64,
    /// What it waits for (names pods where known).
    pub waiting_for: String,
}

/// Nodes that have been in one state for more than `limit_seconds` and that
/// this pass would not move on, with what they wait for. Time in state comes
/// from [`STATE_START_TIME_ANNOTATION`], or NVIDIA's wait-for-completion and
/// validation start times; nodes with neither are not reported. Nodes at
/// rest (unknown, done) are never stuck, and neither is a node in
/// `upgrade-required` that is Ready (it waits for an upgrade slot: the
/// policy's own pacing, which on a large cluster lasts most of the rollout)
/// or that carries the skip label. A NotReady node in `upgrade-required` is
/// reported: its upgrade cannot start until the node is back.
pub fn stuck_nodes(
    nodes: &[NodeObservation],
    policy: &UpgradePolicy,
    now: u64,
    limit_seconds: u64,
    opts: &PassOptions,
) -> Result<Vec<StuckNode>, UpgradePolicyError> {
    let plan = plan_pass(nodes, policy, now, opts)?;
    let mut out = Vec::new();
    for n in nodes {
        let state = n.marks.state;
        if state.at_rest() || !policy.auto_upgrade {
            continue;
        }
        if state == UpgradeState::UpgradeRequired && (n.node_ready || n.marks.skip) {
            continue;
        }
        let Some(d) = plan.decision(&n.name) else {
            continue;
        };
        if d.next != state {
            continue;
        }
        let since = n.marks.current_state_since().or(match state {
            UpgradeState::WaitForJobsRequired => n.marks.wait_for_completion_since,
            UpgradeState::ValidationRequired => n.marks.validation_since,
            _ => None,
        });
        let Some(since) = since else { continue };
        let waited = now.saturating_sub(since);
        if waited > limit_seconds {
            out.push(StuckNode {
                node: n.name.clone(),
                state,
                waited_seconds: waited,
                waiting_for: d.reason.clone(),
            });
        }
    }
    out.sort_by(|a, b| a.node.cmp(&b.node));
    Ok(out)
}

#[cfg(test)]
mod tests;
