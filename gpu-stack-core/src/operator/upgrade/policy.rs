//! NVIDIA's `driver.upgradePolicy`: its sections, the defaults NVIDIA's CRD
//! applies to unset fields, and what makes a policy unusable.
use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use super::selector::{LabelSelector, SelectorError};
use super::state::DRAIN_SKIP_SELECTOR;

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
