//! MigConfig: MIG layouts chosen per node selector and GPU model, turned into
//! NVIDIA's MIG manager contract (the `nvidia.com/mig.config` node label and a
//! named entry in the mig-parted config file), so NVIDIA's MIG manager would
//! apply them as well as ours.
//!
//! Each MigConfig becomes one generated mig-parted config,
//! `gpustack-<name>` ([`entry_name`]). Its entries give each GPU model its
//! layout: a model-specific rule filters on that model's PCI ids; the rule
//! for every other model filters on the ids of every other MIG-capable model
//! in the catalog, so no GPU matches two entries (mig-parted applies every
//! entry that matches). A rule is either explicit profile counts or the
//! entries of a named config of the shipped file.
//!
//! Per node the verdict is [`NodeState::Invalid`] (nothing is written),
//! [`NodeState::Pending`] (the label is set, the MIG manager has not reported
//! success yet) or [`NodeState::Applied`]. A node selected by two MigConfigs
//! is refused for both. Deleting a MigConfig stops managing its nodes and
//! leaves their layout: the label stays, and its generated entry stays in the
//! file while some node's label still names it ([`plan_mig_configs`] keeps
//! it from the previous file).
//!
//! ```
//! use gpu_stack_core::migparted::MigPartedConfig;
//! use gpu_stack_core::operator::migconfig::{
//!     LayoutRule, LayoutSource, MigConfigInput, MigNode, NodeState, plan_mig_configs,
//! };
//!
//! let shipped = MigPartedConfig::default_config().unwrap();
//! let cr = MigConfigInput {
//!     name: "inference".into(),
//!     node_selector: [("pool".to_string(), "inference".to_string())].into(),
//!     rules: vec![LayoutRule {
//!         model: None,
//!         source: LayoutSource::Profiles(vec![("1g.10gb".parse().unwrap(), 7)]),
//!         placements: None,
//!     }],
//! };
//! let node = MigNode {
//!     name: "gpu-0".into(),
//!     labels: [("pool".to_string(), "inference".to_string())].into(),
//!     models: vec!["H100-SXM5-80GB".into()],
//! };
//! let plan = plan_mig_configs(&[cr], &[node], &shipped, &MigPartedConfig::default());
//! assert_eq!(plan.statuses["inference"][0].state, NodeState::Pending);
//! assert_eq!(
//!     plan.labels["gpu-0"].get("nvidia.com/mig.config"),
//!     Some(&Some("gpustack-inference".to_string()))
//! );
//! ```
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::labels::{LabelPatch, Labels, MIG_CONFIG};
use crate::catalog::{self, GpuModel, format_pci_id};
use crate::mig::{MigProfileName, PlacedInstance};
use crate::migmanager::labels::MIG_CONFIG_STATE_LABEL;
use crate::migparted::{
    DeviceId, Devices, EntryVerdict, MigConfigSpec, MigPartedConfig, NamedConfig, check_entry,
    placements_agree, placements_comment,
};

/// Prefix of generated mig-parted config names.
pub const ENTRY_PREFIX: &str = "gpustack-";

/// Longest MigConfig name: the generated name is a label value (63 at most).
pub const MAX_NAME: usize = 63 - ENTRY_PREFIX.len();

/// Most nodes one MigConfig's status lists.
pub const MAX_NODES_IN_STATUS: usize = 1000;

/// The mig-parted config name generated for a MigConfig.
pub fn entry_name(migconfig: &str) -> String {
    format!("{ENTRY_PREFIX}{migconfig}")
}

/// Where a rule's layout comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LayoutSource {
    /// MIG off on these GPUs.
    Disabled,
    /// MIG on with these profile counts (the mig-parted `mig-devices`).
    Profiles(Vec<(MigProfileName, u32)>),
    /// The entries of this named config of the shipped mig-parted file.
    Named(String),
}

/// The layout of one GPU model, or of every model no other rule names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutRule {
    /// A catalog model name or alias (`H100-SXM5-80GB`, `A100-SXM4-40GB`);
    /// `None` for every other MIG-capable model.
    pub model: Option<String>,
    /// The layout.
    pub source: LayoutSource,
    /// The exact GPU instances (start slices) of a [`LayoutSource::Profiles`]
    /// layout: the same instances the counts give, at these starts. `None`
    /// lets the MIG manager choose the starts. Checked against each covered
    /// model's geometry ([`crate::mig::validate`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placements: Option<Vec<PlacedInstance>>,
}

/// One MigConfig, as the planner needs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigConfigInput {
    /// Resource name.
    pub name: String,
    /// Labels a node must carry (empty: every node with GPUs).
    pub node_selector: Labels,
    /// Layouts by model.
    pub rules: Vec<LayoutRule>,
}

/// A node as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigNode {
    /// Node name.
    pub name: String,
    /// Its labels.
    pub labels: Labels,
    /// Catalog model names of its GPUs (empty when unknown).
    pub models: Vec<String>,
}

/// What a MigConfig does to one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeState {
    /// Refused; nothing on the node changes.
    Invalid,
    /// The label names the layout; the MIG manager has not applied it yet.
    Pending,
    /// The MIG manager reports the layout applied.
    Applied,
}

/// One node in a MigConfig's status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// Node name.
    pub node: String,
    /// The verdict.
    pub state: NodeState,
    /// Why it is invalid, or what is pending (empty when applied).
    pub reason: String,
}

/// Why a MigConfig as a whole is refused (before any node is looked at).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum MigConfigError {
    /// The name does not fit in a label value with the prefix.
    #[error(
        "MigConfig {name}: the name is {len} characters; at most {MAX_NAME} fit in the nvidia.com/mig.config label after \"{ENTRY_PREFIX}\"; use a shorter name"
    )]
    NameTooLong {
        /// The name (capped).
        name: String,
        /// Its length.
        len: usize,
    },
    /// A rule names a model the catalog does not know.
    #[error(
        "MigConfig {name}: spec.layouts[{index}].gpuModel {model:?} is not a known GPU model; use a name such as H100-SXM5-80GB or A100-SXM4-40GB (`gpu-stack mig profiles` lists them)"
    )]
    UnknownModel {
        /// Resource name.
        name: String,
        /// Rule index.
        index: usize,
        /// The model given.
        model: String,
    },
    /// Two rules for one model, or two for every other model.
    #[error(
        "MigConfig {name}: spec.layouts[{index}] repeats the layout for {what}; give each GPU model one layout"
    )]
    DuplicateRule {
        /// Resource name.
        name: String,
        /// Rule index.
        index: usize,
        /// The model, or "every other model".
        what: String,
    },
    /// A named config the shipped file does not have.
    #[error(
        "MigConfig {name}: spec.layouts[{index}].config {config:?} is not a config of the mig-parted file; use one of its names such as all-1g.10gb or all-balanced, or give profiles"
    )]
    UnknownConfig {
        /// Resource name.
        name: String,
        /// Rule index.
        index: usize,
        /// The config given.
        config: String,
    },
    /// Nothing to write: no rule, or none that applies to a MIG-capable model.
    #[error(
        "MigConfig {name}: spec.layouts gives no layout for any MIG-capable GPU; add profiles or a config, per gpuModel or for all"
    )]
    NoLayouts {
        /// Resource name.
        name: String,
    },
    /// Placements that do not match the layout's profile counts, or given
    /// with a named config or MIG off.
    #[error("MigConfig {name}: spec.layouts[{index}].placements: {reason}")]
    PlacementsMismatch {
        /// Resource name.
        name: String,
        /// Rule index.
        index: usize,
        /// What differs and how to fix it.
        reason: String,
    },
    /// A layout the model's geometry cannot hold.
    #[error("MigConfig {name}: spec.layouts[{index}] on {model}: {reason}")]
    LayoutInvalid {
        /// Resource name.
        name: String,
        /// Rule index.
        index: usize,
        /// The model.
        model: String,
        /// What the geometry says.
        reason: String,
    },
}

/// The planner's answer.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct MigConfigPlan {
    /// Generated configs for the mig-parted file: one per accepted MigConfig,
    /// plus those of deleted ones some node's label still names.
    pub entries: Vec<NamedConfig>,
    /// `nvidia.com/mig.config` changes, only where the label changes.
    pub labels: BTreeMap<String, LabelPatch>,
    /// Per MigConfig: problems refusing it whole (empty when accepted).
    pub problems: BTreeMap<String, Vec<MigConfigError>>,
    /// Per MigConfig: its nodes, by name, at most [`MAX_NODES_IN_STATUS`].
    pub statuses: BTreeMap<String, Vec<NodeStatus>>,
    /// Per MigConfig: how many selected nodes are in each state (all of
    /// them, also those the capped status list leaves out).
    pub counts: BTreeMap<String, StateCounts>,
}

/// Selected nodes per state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateCounts {
    /// [`NodeState::Invalid`].
    pub invalid: usize,
    /// [`NodeState::Pending`].
    pub pending: usize,
    /// [`NodeState::Applied`].
    pub applied: usize,
}

/// Catalog models with MIG.
fn mig_models() -> impl Iterator<Item = &'static GpuModel> {
    catalog::models().iter().filter(|m| m.mig.is_some())
}

fn filter_for(models: &[&GpuModel]) -> Vec<DeviceId> {
    let ids: BTreeSet<u32> = models
        .iter()
        .flat_map(|m| m.pci_device_ids.iter().copied())
        .collect();
    ids.into_iter()
        .map(|device| DeviceId {
            device,
            subsystem: None,
        })
        .collect()
}

/// The entries of one rule for the models it covers, or why the rule cannot
/// drive one of them.
fn rule_entries(
    cr: &str,
    index: usize,
    rule: &LayoutRule,
    covered: &[&GpuModel],
    shipped: &MigPartedConfig,
) -> Result<Vec<MigConfigSpec>, MigConfigError> {
    let filter = filter_for(covered);
    let mismatch = |reason: String| MigConfigError::PlacementsMismatch {
        name: cr.to_string(),
        index,
        reason,
    };
    if let Some(placements) = &rule.placements {
        match &rule.source {
            LayoutSource::Profiles(p) => placements_agree(p, placements).map_err(mismatch)?,
            _ => {
                return Err(mismatch(
                    "placements go with profiles only; give the profile counts they place, or remove them".into(),
                ));
            }
        }
    }
    let specs: Vec<MigConfigSpec> = match &rule.source {
        LayoutSource::Disabled => vec![MigConfigSpec {
            device_filter: filter,
            devices: Devices::All,
            mig_enabled: false,
            mig_devices: Vec::new(),
            placements: None,
        }],
        LayoutSource::Profiles(p) => vec![MigConfigSpec {
            device_filter: filter,
            devices: Devices::All,
            mig_enabled: true,
            mig_devices: p.clone(),
            placements: rule.placements.clone(),
        }],
        LayoutSource::Named(config) => {
            let named = shipped
                .get(config)
                .ok_or_else(|| MigConfigError::UnknownConfig {
                    name: cr.to_string(),
                    index,
                    config: config.clone(),
                })?;
            // Each shipped entry, narrowed to the covered models it applies to.
            named
                .entries
                .iter()
                .filter_map(|e| {
                    let models: Vec<&GpuModel> = covered
                        .iter()
                        .copied()
                        .filter(|m| e.matches_model(m))
                        .collect();
                    (!models.is_empty()).then(|| MigConfigSpec {
                        device_filter: filter_for(&models),
                        ..e.clone()
                    })
                })
                .collect()
        }
    };
    // A rule for one named model must fit it; the rule for every other
    // model is checked per node, against the models the node has.
    for m in covered.iter().filter(|_| rule.model.is_some()) {
        for s in specs.iter().filter(|s| s.matches_model(m)) {
            if let EntryVerdict::Invalid { reason } = check_entry(s, m) {
                return Err(MigConfigError::LayoutInvalid {
                    name: cr.to_string(),
                    index,
                    model: m.name.clone(),
                    reason,
                });
            }
        }
    }
    Ok(specs)
}

/// The generated config of one MigConfig, or every reason it is refused.
pub fn generate(
    cr: &MigConfigInput,
    shipped: &MigPartedConfig,
) -> Result<NamedConfig, Vec<MigConfigError>> {
    let mut problems = Vec::new();
    if cr.name.len() > MAX_NAME {
        problems.push(MigConfigError::NameTooLong {
            name: cr.name.chars().take(80).collect(),
            len: cr.name.len(),
        });
    }
    // Model-specific rules first, then the rest.
    let mut specific: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut rest: Option<usize> = None;
    for (i, r) in cr.rules.iter().enumerate() {
        match &r.model {
            Some(m) => match catalog::lookup(m) {
                Ok(model) => {
                    if specific.insert(model.name.as_str(), i).is_some() {
                        problems.push(MigConfigError::DuplicateRule {
                            name: cr.name.clone(),
                            index: i,
                            what: model.name.clone(),
                        });
                    }
                }
                Err(_) => problems.push(MigConfigError::UnknownModel {
                    name: cr.name.clone(),
                    index: i,
                    model: m.chars().take(80).collect(),
                }),
            },
            None => {
                if rest.replace(i).is_some() {
                    problems.push(MigConfigError::DuplicateRule {
                        name: cr.name.clone(),
                        index: i,
                        what: "every other model".into(),
                    });
                }
            }
        }
    }
    let mut entries = Vec::new();
    for (model, i) in &specific {
        let Ok(m) = catalog::lookup(model) else {
            continue;
        };
        match rule_entries(&cr.name, *i, &cr.rules[*i], &[m], shipped) {
            Ok(e) => entries.extend(e),
            Err(e) => problems.push(e),
        }
    }
    if let Some(i) = rest {
        let others: Vec<&GpuModel> = mig_models()
            .filter(|m| !specific.contains_key(m.name.as_str()))
            .collect();
        match rule_entries(&cr.name, i, &cr.rules[i], &others, shipped) {
            Ok(e) => entries.extend(e),
            Err(e) => problems.push(e),
        }
    }
    if problems.is_empty() && entries.is_empty() {
        problems.push(MigConfigError::NoLayouts {
            name: cr.name.clone(),
        });
    }
    if problems.is_empty() {
        Ok(NamedConfig {
            name: entry_name(&cr.name),
            entries,
        })
    } else {
        Err(problems)
    }
}

fn selects(cr: &MigConfigInput, node: &MigNode) -> bool {
    !node.models.is_empty()
        && cr
            .node_selector
            .iter()
            .all(|(k, v)| node.labels.get(k) == Some(v))
}

/// Plans every MigConfig over the nodes: the generated configs, the label
/// changes, and each resource's per-node status. `previous` is the
/// mig-parted file the MIG manager reads now, whose generated configs are
/// kept while a node's label still names them. Pure.
pub fn plan_mig_configs(
    crs: &[MigConfigInput],
    nodes: &[MigNode],
    shipped: &MigPartedConfig,
    previous: &MigPartedConfig,
) -> MigConfigPlan {
    let mut plan = MigConfigPlan::default();
    let mut accepted: BTreeMap<&str, NamedConfig> = BTreeMap::new();
    for cr in crs {
        match generate(cr, shipped) {
            Ok(e) => {
                accepted.insert(cr.name.as_str(), e);
                plan.problems.insert(cr.name.clone(), Vec::new());
            }
            Err(p) => {
                plan.problems.insert(cr.name.clone(), p);
            }
        }
        plan.statuses.insert(cr.name.clone(), Vec::new());
        plan.counts.insert(cr.name.clone(), StateCounts::default());
    }
    for node in nodes {
        let claimants: Vec<&MigConfigInput> = crs.iter().filter(|c| selects(c, node)).collect();
        let current = node.labels.get(MIG_CONFIG);
        for cr in &claimants {
            let status = if claimants.len() > 1 {
                let names: Vec<&str> = claimants.iter().map(|c| c.name.as_str()).collect();
                NodeStatus {
                    node: node.name.clone(),
                    state: NodeState::Invalid,
                    reason: format!(
                        "selected by MigConfigs {}; make their nodeSelectors disjoint",
                        names.join(", ")
                    ),
                }
            } else if let Some(entry) = accepted.get(cr.name.as_str()) {
                node_status(node, entry, current)
            } else {
                NodeStatus {
                    node: node.name.clone(),
                    state: NodeState::Invalid,
                    reason: "the MigConfig is refused; see its conditions".into(),
                }
            };
            if claimants.len() == 1
                && status.state != NodeState::Invalid
                && current != Some(&entry_name(&cr.name))
            {
                plan.labels.insert(
                    node.name.clone(),
                    LabelPatch::from([(MIG_CONFIG.to_string(), Some(entry_name(&cr.name)))]),
                );
            }
            let c = plan.counts.entry(cr.name.clone()).or_default();
            match status.state {
                NodeState::Invalid => c.invalid += 1,
                NodeState::Pending => c.pending += 1,
                NodeState::Applied => c.applied += 1,
            }
            let list = plan.statuses.entry(cr.name.clone()).or_default();
            if list.len() < MAX_NODES_IN_STATUS {
                list.push(status);
            }
        }
    }
    // Generated configs: the accepted ones, and earlier ones still named.
    let named: BTreeSet<&str> = nodes
        .iter()
        .filter_map(|n| n.labels.get(MIG_CONFIG).map(String::as_str))
        .collect();
    let mut entries: BTreeMap<String, NamedConfig> = previous
        .mig_configs
        .iter()
        .filter(|c| c.name.starts_with(ENTRY_PREFIX) && named.contains(c.name.as_str()))
        .map(|c| (c.name.clone(), c.clone()))
        .collect();
    for e in accepted.into_values() {
        entries.insert(e.name.clone(), e);
    }
    plan.entries = entries.into_values().collect();
    plan
}

fn node_status(node: &MigNode, entry: &NamedConfig, current: Option<&String>) -> NodeStatus {
    // Every GPU model on the node must take its layout.
    for model in &node.models {
        let Ok(m) = catalog::lookup(model) else {
            continue;
        };
        for spec in entry.entries.iter().filter(|s| s.matches_model(m)) {
            if let EntryVerdict::Invalid { reason } = check_entry(spec, m) {
                return NodeStatus {
                    node: node.name.clone(),
                    state: NodeState::Invalid,
                    reason: format!("{}: {reason}", m.name),
                };
            }
        }
    }
    let state = node.labels.get(MIG_CONFIG_STATE_LABEL).map(String::as_str);
    if current == Some(&entry.name) && state == Some("success") {
        NodeStatus {
            node: node.name.clone(),
            state: NodeState::Applied,
            reason: String::new(),
        }
    } else {
        NodeStatus {
            node: node.name.clone(),
            state: NodeState::Pending,
            reason: match state {
                Some("failed") if current == Some(&entry.name) => {
                    "the MIG manager failed to apply the layout; see its log and the node's events"
                        .into()
                }
                _ => "waiting for the MIG manager to apply the layout".into(),
            },
        }
    }
}

/// Generated configs as mig-parted YAML lines under `mig-configs:` (two
/// spaces of indent), to append to a file whose last key is `mig-configs`.
pub fn entries_yaml(entries: &[NamedConfig]) -> String {
    let mut out = String::new();
    for c in entries {
        let _ = writeln!(out, "\n  {}:", c.name);
        for (i, e) in c.entries.iter().enumerate() {
            let devices = match &e.devices {
                Devices::All => "all".to_string(),
                Devices::Indices(v) => format!(
                    "[{}]",
                    v.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
                ),
            };
            let _ = writeln!(out, "    - devices: {devices}");
            if !e.device_filter.is_empty() {
                let ids: Vec<String> = e
                    .device_filter
                    .iter()
                    .map(|d| match d.subsystem {
                        Some(s) => format!("\"{}:{}\"", format_pci_id(d.device), format_pci_id(s)),
                        None => format!("\"{}\"", format_pci_id(d.device)),
                    })
                    .collect();
                let _ = writeln!(out, "      device-filter: [{}]", ids.join(", "));
            }
            let _ = writeln!(out, "      mig-enabled: {}", e.mig_enabled);
            if e.mig_enabled {
                if e.mig_devices.is_empty() {
                    let _ = writeln!(out, "      mig-devices: {{}}");
                } else {
                    let _ = writeln!(out, "      mig-devices:");
                    for (p, n) in &e.mig_devices {
                        let _ = writeln!(out, "        \"{p}\": {n}");
                    }
                }
                if let Some(placements) = &e.placements {
                    let _ = writeln!(out, "      {}", placements_comment(&c.name, i, placements));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests;
