//! A node's driver upgrade state (the `nvidia.com/gpu-driver-upgrade-state`
//! label), what its labels and annotations say about its upgrade, the keys
//! of every label and annotation the flow reads or writes, and the flow's
//! fixed limits (validator pods, validation timeout, driver pod restarts).
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
//! Each state's step lives in `steps.rs`; [`plan_pass`](super::pass::plan_pass)
//! runs them.
use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize};

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
