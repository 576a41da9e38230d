//! Node labels of the MIG manager: the `nvidia.com/mig.config.state` values, and
//! the pause/restore of GPU clients through their `nvidia.com/gpu.deploy.*` labels.
//!
//! The pause is recorded (original value of every label it changed) so that a
//! restart after a crash restores exactly what was changed and nothing else.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::operator::components::DEPLOY_PREFIX;
use crate::operator::labels::PAUSED_FOR_MIG_CHANGE;

/// Label where the manager reports progress, with NVIDIA's values.
pub const MIG_CONFIG_STATE_LABEL: &str = "nvidia.com/mig.config.state";
/// Annotation holding the reason of the last `failed` state, for people.
pub const FAILURE_REASON_ANNOTATION: &str = "gpu-stack/mig-manager.failure-reason";
/// Annotation holding the [`PauseRecord`] while GPU clients are paused, so a
/// restarted manager knows exactly what to restore.
pub const PAUSE_RECORD_ANNOTATION: &str = "gpu-stack/mig-manager.paused-labels";

/// The GPU clients the manager pauses, as NVIDIA's mig-manager does: each is a
/// deploy label and the `app` label of the pods it controls (empty when the
/// component has no pod to wait for).
pub const GPU_CLIENTS: &[GpuClient] = &[
    GpuClient {
        deploy_label: "nvidia.com/gpu.deploy.device-plugin",
        app: "nvidia-device-plugin-daemonset",
    },
    GpuClient {
        deploy_label: "nvidia.com/gpu.deploy.gpu-feature-discovery",
        app: "gpu-feature-discovery",
    },
    GpuClient {
        deploy_label: "nvidia.com/gpu.deploy.dcgm-exporter",
        app: "nvidia-dcgm-exporter",
    },
    GpuClient {
        deploy_label: "nvidia.com/gpu.deploy.dcgm",
        app: "nvidia-dcgm",
    },
    GpuClient {
        deploy_label: "nvidia.com/gpu.deploy.nvsm",
        app: "",
    },
    // Third-party GPU clients (NVIDIA's mig-parted pauses them too): their
    // DaemonSets select `gpu.deploy.client=true`; their pods are not waited
    // for by name.
    GpuClient {
        deploy_label: "nvidia.com/gpu.deploy.client",
        app: "",
    },
];

/// A component that uses the GPUs and must leave the node during a MIG change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuClient {
    /// Its `nvidia.com/gpu.deploy.<component>` label.
    pub deploy_label: &'static str,
    /// The `app` label of its pods (empty: nothing to wait for).
    pub app: &'static str,
}

/// Values of `nvidia.com/mig.config.state`, exactly as NVIDIA's manager writes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MigConfigState {
    /// A change is in progress.
    Pending,
    /// A MIG mode change needs a GPU reset or a reboot; the manager resumes after.
    Rebooting,
    /// The GPUs match the selected config.
    Success,
    /// The last attempt failed; the reason is in [`FAILURE_REASON_ANNOTATION`].
    Failed,
}

impl MigConfigState {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Rebooting => "rebooting",
            Self::Success => "success",
            Self::Failed => "failed",
        }
    }
}

impl fmt::Display for MigConfigState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A label value that is not one of the four states.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{MIG_CONFIG_STATE_LABEL}={0}` is not a known state; expected pending, rebooting, success or failed"
)]
pub struct UnknownState(pub String);

impl FromStr for MigConfigState {
    type Err = UnknownState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "pending" => Ok(Self::Pending),
            "rebooting" => Ok(Self::Rebooting),
            "success" => Ok(Self::Success),
            "failed" => Ok(Self::Failed),
            other => Err(UnknownState(other.to_string())),
        }
    }
}

/// The original value of every deploy label the manager changed when it paused
/// the GPU clients (`None`: the label was absent). Stored on the node in
/// [`PAUSE_RECORD_ANNOTATION`] in the same patch that pauses.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PauseRecord {
    /// label key → value before the pause.
    pub originals: BTreeMap<String, Option<String>>,
}

impl PauseRecord {
    /// JSON text for the annotation.
    pub fn to_annotation(&self) -> String {
        // A map of strings always serializes.
        serde_json::to_string(self).unwrap_or_else(|_| "{}".to_string())
    }

    /// Reads the annotation back.
    pub fn from_annotation(text: &str) -> Result<Self, BadPauseRecord> {
        serde_json::from_str(text).map_err(|e| BadPauseRecord(e.to_string()))
    }
}

/// The pause-record annotation could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "annotation `{PAUSE_RECORD_ANNOTATION}` is not a valid pause record ({0}); \
     deploy labels still set to `{PAUSED_FOR_MIG_CHANGE}` will be restored to `true`"
)]
pub struct BadPauseRecord(pub String);

/// A set of node label edits: values to set and keys to remove. Applied as one patch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelEdits {
    /// key → new value.
    pub set: BTreeMap<String, String>,
    /// keys to delete.
    pub remove: Vec<String>,
}

impl LabelEdits {
    /// True when there is nothing to patch.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty() && self.remove.is_empty()
    }

    /// Applies the edits to a label map (what the cluster will hold after the patch).
    pub fn apply_to(&self, labels: &mut BTreeMap<String, String>) {
        for key in &self.remove {
            labels.remove(key);
        }
        for (k, v) in &self.set {
            labels.insert(k.clone(), v.clone());
        }
    }
}

/// Whether the manager pauses a deploy label holding `value` (`None`: absent).
///
/// `true` is paused (its pods run). An absent label is paused too, so the
/// operator cannot add `true` and start a client in the middle of a change.
/// Any other value (`false`, another agent's `paused-for-*`, `pre-installed`)
/// already keeps the pods off the node and belongs to someone else: left alone.
pub fn should_pause(value: Option<&str>) -> bool {
    matches!(value, None | Some("true"))
}

/// Decides the pause: which labels to set to [`PAUSED_FOR_MIG_CHANGE`] and the
/// record of what they held. `existing` is a record left by an earlier run that
/// did not finish: labels it holds keep their recorded original (the node now
/// shows them paused, which is not their real value).
pub fn plan_pause(
    labels: &BTreeMap<String, String>,
    clients: &[GpuClient],
    existing: Option<&PauseRecord>,
) -> (LabelEdits, PauseRecord) {
    let mut record = existing.cloned().unwrap_or_default();
    let mut edits = LabelEdits::default();
    for client in clients {
        let key = client.deploy_label;
        let current = labels.get(key).map(String::as_str);
        if record.originals.contains_key(key) {
            if current != Some(PAUSED_FOR_MIG_CHANGE) && should_pause(current) {
                // Someone re-enabled it meanwhile: pause it again, keep the first original.
                edits
                    .set
                    .insert(key.to_string(), PAUSED_FOR_MIG_CHANGE.to_string());
            }
            continue;
        }
        if current == Some(PAUSED_FOR_MIG_CHANGE) {
            // Paused by an earlier run whose record was lost: NVIDIA's restore value.
            record
                .originals
                .insert(key.to_string(), Some("true".to_string()));
            continue;
        }
        if should_pause(current) {
            record
                .originals
                .insert(key.to_string(), current.map(str::to_string));
            edits
                .set
                .insert(key.to_string(), PAUSED_FOR_MIG_CHANGE.to_string());
        }
    }
    (edits, record)
}

/// Decides the restore: every label the record paused that still holds
/// [`PAUSED_FOR_MIG_CHANGE`] goes back to its original value (removed when it
/// was absent). A label someone changed meanwhile (for example to `false`) is
/// theirs now and is left alone. Deploy labels still paused by an earlier run
/// with no record are restored to `true`, as NVIDIA's manager does.
pub fn plan_restore(
    labels: &BTreeMap<String, String>,
    record: Option<&PauseRecord>,
    clients: &[GpuClient],
) -> LabelEdits {
    let mut edits = LabelEdits::default();
    let is_paused = |key: &str| labels.get(key).map(String::as_str) == Some(PAUSED_FOR_MIG_CHANGE);
    if let Some(record) = record {
        for (key, original) in &record.originals {
            if !is_paused(key) {
                continue;
            }
            match original {
                Some(v) => {
                    edits.set.insert(key.clone(), v.clone());
                }
                None => edits.remove.push(key.clone()),
            }
        }
    }
    for client in clients {
        let key = client.deploy_label;
        let recorded = record.is_some_and(|r| r.originals.contains_key(key));
        if !recorded && is_paused(key) {
            edits.set.insert(key.to_string(), "true".to_string());
        }
    }
    edits
}

/// True when any deploy label still holds [`PAUSED_FOR_MIG_CHANGE`].
pub fn any_paused(labels: &BTreeMap<String, String>) -> bool {
    labels
        .iter()
        .any(|(k, v)| k.starts_with(DEPLOY_PREFIX) && v == PAUSED_FOR_MIG_CHANGE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn state_round_trips() {
        for s in [
            MigConfigState::Pending,
            MigConfigState::Rebooting,
            MigConfigState::Success,
            MigConfigState::Failed,
        ] {
            assert_eq!(s.as_str().parse::<MigConfigState>(), Ok(s));
        }
        assert!("done".parse::<MigConfigState>().is_err());
    }

    #[test]
    fn pause_true_and_absent_never_false() {
        let l = labels(&[
            ("nvidia.com/gpu.deploy.device-plugin", "true"),
            ("nvidia.com/gpu.deploy.gpu-feature-discovery", "false"),
            (
                "nvidia.com/gpu.deploy.dcgm-exporter",
                "paused-for-driver-upgrade",
            ),
            ("nvidia.com/gpu.deploy.dcgm", "true"),
        ]);
        let (edits, record) = plan_pause(&l, GPU_CLIENTS, None);
        assert_eq!(
            edits.set.keys().map(String::as_str).collect::<Vec<_>>(),
            vec![
                "nvidia.com/gpu.deploy.client",
                "nvidia.com/gpu.deploy.dcgm",
                "nvidia.com/gpu.deploy.device-plugin",
                "nvidia.com/gpu.deploy.nvsm"
            ]
        );
        assert!(edits.set.values().all(|v| v == PAUSED_FOR_MIG_CHANGE));
        assert_eq!(
            record.originals.get("nvidia.com/gpu.deploy.nvsm"),
            Some(&None)
        );
        let mut after = l.clone();
        edits.apply_to(&mut after);
        let restore = plan_restore(&after, Some(&record), GPU_CLIENTS);
        restore.apply_to(&mut after);
        assert_eq!(after, l);
    }

    #[test]
    fn restore_leaves_labels_changed_by_others() {
        let l = labels(&[("nvidia.com/gpu.deploy.device-plugin", "true")]);
        let (edits, record) = plan_pause(&l, GPU_CLIENTS, None);
        let mut after = l.clone();
        edits.apply_to(&mut after);
        after.insert("nvidia.com/gpu.deploy.device-plugin".into(), "false".into());
        let restore = plan_restore(&after, Some(&record), GPU_CLIENTS);
        assert!(
            !restore
                .set
                .contains_key("nvidia.com/gpu.deploy.device-plugin")
        );
    }

    #[test]
    fn lost_record_restores_true() {
        let l = labels(&[("nvidia.com/gpu.deploy.dcgm", PAUSED_FOR_MIG_CHANGE)]);
        let restore = plan_restore(&l, None, GPU_CLIENTS);
        assert_eq!(
            restore
                .set
                .get("nvidia.com/gpu.deploy.dcgm")
                .map(String::as_str),
            Some("true")
        );
    }

    #[test]
    fn record_annotation_round_trips() {
        let l = labels(&[("nvidia.com/gpu.deploy.device-plugin", "true")]);
        let (_, record) = plan_pause(&l, GPU_CLIENTS, None);
        let back = PauseRecord::from_annotation(&record.to_annotation());
        assert_eq!(back, Ok(record));
        assert!(PauseRecord::from_annotation("{").is_err());
    }

    fn value() -> impl Strategy<Value = Option<String>> {
        prop_oneof![
            Just(None),
            Just(Some("true".to_string())),
            Just(Some("false".to_string())),
            Just(Some("paused-for-driver-upgrade".to_string())),
            Just(Some("pre-installed".to_string())),
            Just(Some(PAUSED_FOR_MIG_CHANGE.to_string())),
        ]
    }

    fn node_labels() -> impl Strategy<Value = BTreeMap<String, String>> {
        proptest::collection::vec(value(), GPU_CLIENTS.len()).prop_map(|values| {
            let mut m = BTreeMap::new();
            m.insert("kubernetes.io/hostname".to_string(), "n1".to_string());
            for (c, v) in GPU_CLIENTS.iter().zip(values) {
                if let Some(v) = v {
                    m.insert(c.deploy_label.to_string(), v);
                }
            }
            m
        })
    }

    proptest! {
        /// Pausing never touches `false`, leaves no client label `true`, and
        /// pause-then-restore gives back the labels we started from, except
        /// labels that were paused by a run whose record is gone (they come back `true`).
        #[test]
        fn pause_restore_round_trip(start in node_labels(), crash_twice in any::<bool>()) {
            let (edits, record) = plan_pause(&start, GPU_CLIENTS, None);
            for (k, v) in &edits.set {
                prop_assert_ne!(start.get(k).map(String::as_str), Some("false"));
                prop_assert_eq!(v.as_str(), PAUSED_FOR_MIG_CHANGE);
            }
            let mut node = start.clone();
            edits.apply_to(&mut node);
            for c in GPU_CLIENTS {
                prop_assert_ne!(node.get(c.deploy_label).map(String::as_str), Some("true"));
                prop_assert!(node.contains_key(c.deploy_label));
            }
            if crash_twice {
                // A second run pauses again with the stored record: no edits, same record.
                let (again, record2) = plan_pause(&node, GPU_CLIENTS, Some(&record));
                prop_assert!(again.is_empty());
                prop_assert_eq!(&record2, &record);
            }
            let restore = plan_restore(&node, Some(&record), GPU_CLIENTS);
            restore.apply_to(&mut node);
            let mut expected = start.clone();
            for c in GPU_CLIENTS {
                if start.get(c.deploy_label).map(String::as_str) == Some(PAUSED_FOR_MIG_CHANGE) {
                    expected.insert(c.deploy_label.to_string(), "true".to_string());
                }
            }
            prop_assert_eq!(&node, &expected);
            prop_assert!(!any_paused(&node));
            // Restoring twice changes nothing more.
            prop_assert!(plan_restore(&node, Some(&record), GPU_CLIENTS).is_empty());
        }
    }
}
