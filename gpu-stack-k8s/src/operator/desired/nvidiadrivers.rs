//! The NVIDIADriver side of the desired state: which owned objects belong
//! to a resource, the refusals the ClusterPolicy reports, and each
//! resource's status.
use std::collections::BTreeMap;

use gpu_stack_core::operator::driver::{DriverPlan, NodeRefusal};
use gpu_stack_core::operator::nvidiadriver::{
    DriversPlan, NodeList, REASON_CONFLICTING_NODE_SELECTOR,
};

use super::render::NVIDIA_DRIVER_LABEL;
use super::{condition, reason, summarize};
use crate::operator::cluster::object::Object;
use crate::operator::clusterpolicy::ClusterPolicy;
use crate::operator::nvidiadriver::{
    NvidiaDriver, NvidiaDriverState, NvidiaDriverStatus, condition as nvd_condition,
    conflict_condition, reason as nvd_reason, refused_condition,
};

/// Reason of an NVIDIADriver's conditions when the ClusterPolicy does not
/// delegate drivers to NVIDIADrivers.
pub const REASON_CRD_DISABLED: &str = "NVIDIADriverCRDDisabled";
/// Reason of `Ready=False` while some of its DaemonSets are not ready.
pub const REASON_DRIVER_NOT_READY: &str = "DriverNotReady";

/// Whether an owned object is one of the resource's driver DaemonSets.
pub fn belongs_to(obj: &Object, driver: &str) -> bool {
    obj.as_daemonset()
        .and_then(|d| d.metadata.labels.as_ref())
        .and_then(|l| l.get(NVIDIA_DRIVER_LABEL))
        .is_some_and(|v| v == driver)
}

/// Folds every resource's pools and refused nodes into the ClusterPolicy's
/// driver plan, and adds the GPU nodes no resource takes: unowned ones, and
/// conflicted ones without a current owner.
pub fn merge_refusals(plan: &DriversPlan, driver: &mut DriverPlan) {
    for r in &plan.drivers {
        driver.pools.extend(r.plan.pools.iter().cloned());
        driver.refused.extend(r.plan.refused.iter().cloned());
        driver.unpooled.extend(r.plan.unpooled.iter().cloned());
        driver.unverified.extend(r.plan.unverified.iter().cloned());
    }
    for node in &plan.routing.unowned {
        driver.unpooled.push(NodeRefusal {
            node: node.clone(),
            reason: "no NVIDIADriver selects this node; create a default NVIDIADriver \
                     (spec.default: true) or one whose spec.nodeSelector matches it"
                .into(),
        });
    }
    let mut conflicted: BTreeMap<&str, &[String]> = BTreeMap::new();
    for c in plan.routing.conflicts.values().flatten() {
        if c.kept_owner.is_none() {
            conflicted.insert(&c.node, &c.claimants);
        }
    }
    for (node, claimants) in conflicted {
        driver.unpooled.push(NodeRefusal {
            node: node.to_string(),
            reason: format!(
                "NVIDIADrivers {} all select this node; make their nodeSelectors disjoint",
                claimants.join(", ")
            ),
        });
    }
    driver.pools.sort_by(|a, b| a.name.cmp(&b.name));
    driver.refused.sort_by(|a, b| a.node.cmp(&b.node));
    driver.unpooled.sort_by(|a, b| a.node.cmp(&b.node));
    driver.unverified.sort();
}

/// The status of every live resource. `plan` is `None` when the policy does
/// not delegate drivers, and `not_ready` names the DaemonSets not ready.
pub fn statuses(
    policy: &ClusterPolicy,
    live: &[&NvidiaDriver],
    plan: Option<&DriversPlan>,
    not_ready: &[String],
    namespace: &str,
) -> BTreeMap<String, NvidiaDriverStatus> {
    let policy_name = policy.metadata.name.as_deref().unwrap_or_default();
    live.iter()
        .enumerate()
        .map(|(i, d)| {
            let mut st = NvidiaDriverStatus {
                state: NvidiaDriverState::NotReady,
                namespace: Some(namespace.to_string()),
                conditions: Vec::new(),
                unsupported_fields: d.spec.unsupported_fields(),
                observed_generation: d.metadata.generation,
            };
            let Some(plan) = plan else {
                let message = format!(
                    "ClusterPolicy {policy_name} does not set spec.driver.useNvidiaDriverCRD: true, \
                     so NVIDIADrivers are not rolled out; set it to hand the driver to them"
                );
                st.conditions = vec![
                    condition(nvd_condition::READY, false, REASON_CRD_DISABLED, message.clone()),
                    condition(nvd_condition::ERROR, true, REASON_CRD_DISABLED, message),
                ];
                return (d.name().to_string(), st);
            };
            let rollout = &plan.drivers[i];
            let conflict = conflict_condition(&plan.routing, d.name());
            let refused = refused_condition(&rollout.problems);
            let waiting: Vec<String> = not_ready
                .iter()
                .filter(|n| rollout.plan.pools.iter().any(|p| &p.name == *n))
                .cloned()
                .collect();
            let unpooled = NodeList::new(rollout.plan.unpooled.iter().map(|r| r.node.clone()));
            let (ready, why, message) = if refused.is_some() {
                (
                    false,
                    nvd_reason::INVALID_SPEC,
                    "the spec is refused; nothing was changed on its nodes".to_string(),
                )
            } else if conflict.is_some() {
                (
                    false,
                    REASON_CONFLICTING_NODE_SELECTOR,
                    "nodes claimed by another NVIDIADriver keep their current driver".to_string(),
                )
            } else if !waiting.is_empty() {
                (
                    false,
                    REASON_DRIVER_NOT_READY,
                    format!("not ready: {}", summarize(&waiting, 5)),
                )
            } else if !rollout.plan.unpooled.is_empty() {
                (
                    false,
                    super::reason::DRIVER_POOL_UNKNOWN,
                    format!(
                        "no driver image for {unpooled}: {}",
                        rollout.plan.unpooled[0].reason
                    ),
                )
            } else {
                (
                    true,
                    reason::RECONCILED,
                    format!("driver ready on {} node(s)", rollout.nodes.len()),
                )
            };
            st.state = if ready {
                NvidiaDriverState::Ready
            } else {
                NvidiaDriverState::NotReady
            };
            let mut errors: Vec<_> = refused.into_iter().chain(conflict).collect();
            if errors.is_empty() {
                errors.push(condition(
                    nvd_condition::ERROR,
                    false,
                    reason::RECONCILED,
                    String::new(),
                ));
            }
            // One Error condition: a refusal explains more than a conflict.
            errors.truncate(1);
            st.conditions = vec![condition(nvd_condition::READY, ready, why, message)];
            st.conditions.extend(errors);
            (d.name().to_string(), st)
        })
        .collect()
}
