//! The MigConfig side of the desired state: the generated mig-parted
//! configs, the `nvidia.com/mig.config` labels and each MigConfig's status.
use std::collections::BTreeMap;

use gpu_stack_core::migparted::MigPartedConfig;
use gpu_stack_core::operator::labels::{LabelPatch, Labels, MIG_CONFIG};
use gpu_stack_core::operator::migconfig::{
    ENTRY_PREFIX, MigConfigInput, MigNode, entries_yaml, entry_name, plan_mig_configs,
};
use gpu_stack_core::operator::migdemand::apply_decisions;

use super::render::MIG_PARTED_CONFIG_KEY;
use super::{catalog_models_on_node, condition, reason};
use crate::operator::cluster::object::Object;
use crate::operator::clusterpolicy::ClusterPolicy;
use crate::operator::migconfig::{MigConfig, MigConfigNode, MigConfigStatus};

/// Reason of a MigConfig's conditions when the operator cannot act on it.
pub const REASON_NOT_MANAGED: &str = "MigManagerNotManaged";
/// Reason of `Error=True` for a refused MigConfig.
pub const REASON_INVALID_SPEC: &str = "InvalidSpec";
/// Reason of `Error=True` when some selected node cannot take the layout.
pub const REASON_INVALID_NODES: &str = "InvalidNodes";
/// Reason of `Ready=False` while the MIG manager has not applied every node.
pub const REASON_PENDING: &str = "LayoutPending";

/// What the MigConfigs add to a pass.
#[derive(Debug, Default)]
pub struct MigOutcome {
    /// `nvidia.com/mig.config` changes.
    pub labels: BTreeMap<String, LabelPatch>,
    /// Generated configs, as YAML lines to append to the mig-parted file.
    pub generated: String,
    /// Each MigConfig's status.
    pub statuses: BTreeMap<String, MigConfigStatus>,
}

fn count(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Plans the MigConfigs over the GPU nodes (`(name, labels)` as they will
/// look after this pass's deploy labels). Nothing is labelled when the
/// operator does not write the mig-parted ConfigMap the MIG manager reads
/// (the MIG manager off, or a ConfigMap of the user's); the statuses say why.
pub fn plan(
    policy: &ClusterPolicy,
    mig_configs: &[MigConfig],
    nodes: &[(&String, &Labels)],
    current: &[Object],
    namespace: &str,
) -> MigOutcome {
    let mut out = MigOutcome::default();
    // Nothing to do unless a MigConfig exists or a node still names the
    // generated config of a deleted one (whose config must stay).
    let named = nodes.iter().any(|(_, l)| {
        l.get(MIG_CONFIG)
            .is_some_and(|v| v.starts_with(ENTRY_PREFIX))
    });
    if mig_configs.is_empty() && !named {
        return out;
    }
    let spec = &policy.spec;
    let policy_name = policy.metadata.name.as_deref().unwrap_or_default();
    let config_name = spec.mig_config_name();
    let not_managed = if spec.dra_driver_enabled() {
        Some(format!(
            "ClusterPolicy {policy_name} has draDriver.enabled: true: the DRA plugin creates MIG instances for claims and no MIG manager applies layouts; disable the DRA plugin to use MigConfigs"
        ))
    } else if !spec.enablement().mig_manager {
        Some(format!(
            "ClusterPolicy {policy_name} has migManager.enabled: false, so no MIG manager applies layouts; enable it"
        ))
    } else if config_name != "default-mig-parted-config" {
        Some(format!(
            "ClusterPolicy {policy_name} points the MIG manager at ConfigMap {config_name}, which the operator does not write; remove migManager.config.name to let MigConfigs add their layouts"
        ))
    } else {
        None
    };
    if let Some(message) = not_managed {
        for m in mig_configs {
            out.statuses.insert(
                m.name().to_string(),
                MigConfigStatus {
                    conditions: vec![
                        condition("Ready", false, REASON_NOT_MANAGED, message.clone()),
                        condition("Error", true, REASON_NOT_MANAGED, message.clone()),
                    ],
                    observed_generation: m.metadata.generation,
                    ..MigConfigStatus::default()
                },
            );
        }
        return out;
    }
    let shipped = MigPartedConfig::default_config().unwrap_or_default();
    let previous = current
        .iter()
        .find_map(|o| match o {
            Object::ConfigMap(c)
                if c.metadata.name.as_deref() == Some(config_name.as_str())
                    && c.metadata.namespace.as_deref() == Some(namespace) =>
            {
                c.data.as_ref()?.get(MIG_PARTED_CONFIG_KEY).cloned()
            }
            _ => None,
        })
        .and_then(|text| MigPartedConfig::from_yaml(&text).ok())
        .unwrap_or_default();
    let admission: BTreeMap<&str, Vec<String>> = mig_configs
        .iter()
        .map(|m| (m.name(), m.profile_problems()))
        .collect();
    let inputs: Vec<MigConfigInput> = mig_configs
        .iter()
        .map(|m| {
            let mut input = m.input();
            if !admission[m.name()].is_empty() {
                // Refused whole; it still claims its nodes, so conflicts show.
                input.rules.clear();
            }
            input
        })
        .collect();
    let mig_nodes: Vec<MigNode> = nodes
        .iter()
        .map(|(name, labels)| MigNode {
            name: (*name).clone(),
            labels: (*labels).clone(),
            models: catalog_models_on_node(labels)
                .into_iter()
                .map(|m| m.name.clone())
                .collect(),
        })
        .collect();
    let mut plan = plan_mig_configs(&inputs, &mig_nodes, &shipped, &previous);
    // Demand mode: the layouts decided for nodes replace the starting one.
    for m in mig_configs
        .iter()
        .filter(|m| m.is_demand() && admission[m.name()].is_empty())
    {
        apply_decisions(&mut plan, m.name(), &m.decided(), &mig_nodes);
    }
    out.generated = entries_yaml(&plan.entries);
    out.labels = plan.labels;
    for m in mig_configs {
        let name = m.name();
        let mut problems: Vec<String> = admission[name].clone();
        if problems.is_empty() {
            problems.extend(
                plan.problems
                    .get(name)
                    .into_iter()
                    .flatten()
                    .map(ToString::to_string),
            );
        }
        let nodes: Vec<MigConfigNode> = plan
            .statuses
            .get(name)
            .into_iter()
            .flatten()
            .map(MigConfigNode::from_status)
            .collect();
        let c = plan.counts.get(name).copied().unwrap_or_default();
        let (applied, pending, invalid) = (count(c.applied), count(c.pending), count(c.invalid));
        let first_invalid = nodes.iter().find(|n| n.state == "Invalid");
        let error = if !problems.is_empty() {
            condition(
                "Error",
                true,
                REASON_INVALID_SPEC,
                format!("{}; nothing was changed", problems.join("; ")),
            )
        } else if let Some(first) = first_invalid {
            condition(
                "Error",
                true,
                REASON_INVALID_NODES,
                format!(
                    "{invalid} node(s) cannot take the layout and are left as they are, e.g. {}: {}",
                    first.name, first.reason
                ),
            )
        } else {
            condition("Error", false, reason::RECONCILED, String::new())
        };
        let ready = if !problems.is_empty() {
            condition(
                "Ready",
                false,
                REASON_INVALID_SPEC,
                "the MigConfig is refused".into(),
            )
        } else if pending > 0 {
            condition(
                "Ready",
                false,
                REASON_PENDING,
                format!("{applied} of {} node(s) applied", applied + pending),
            )
        } else {
            condition(
                "Ready",
                true,
                reason::RECONCILED,
                format!("{applied} node(s) applied"),
            )
        };
        out.statuses.insert(
            name.to_string(),
            MigConfigStatus {
                conditions: vec![ready, error],
                applied,
                pending,
                invalid,
                nodes,
                config_name: problems.is_empty().then(|| entry_name(name)),
                observed_generation: m.metadata.generation,
                // Owned by the demand controller; never written here.
                demand: None,
            },
        );
    }
    out
}
