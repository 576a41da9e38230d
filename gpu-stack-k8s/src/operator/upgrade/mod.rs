//! The driver upgrade controller: the kube side of
//! [`gpu_stack_core::operator::upgrade`].
//!
//! Each pass reads the watch caches ([`watches`]), builds one
//! [`NodeObservation`](gpu_stack_core::operator::upgrade::pass::NodeObservation)
//! per node that runs a driver pod ([`observe`]), runs the pure
//! [`plan_pass`](gpu_stack_core::operator::upgrade::pass::plan_pass), and applies
//! the decisions ([`apply`]).
//!
//! Reads per pass: none from the API server but one list of pods by
//! `spec.nodeName` for each node in `wait-for-jobs-required`,
//! `pod-deletion-required` or `drain-required` (at most `maxUnavailable`
//! nodes), and the NVIDIADrivers with `driver.useNvidiaDriverCRD`. The
//! ClusterPolicies, the driver DaemonSets, their ControllerRevisions, the
//! driver and validator pods come from label-filtered watches, stripped to
//! what the flow reads; the nodes from the reconcile pass's node cache.
//! Writes: at most one merge patch per node that changes (state label,
//! annotations and `spec.unschedulable` together; a node whose driver is up
//! to date gets none), one eviction per pod to remove, one delete per driver
//! pod to restart, and the ClusterPolicy's `status.driverUpgrade` when it
//! changed. A pass first waits (bounded) for the node cache to show the
//! previous pass's node writes, so it never hands out a slot twice.
//!
//! A pod's revision is its `controller-revision-hash` label; the DaemonSet's
//! is that label on its newest ControllerRevision. Evictions go through the
//! Eviction API, so PodDisruptionBudgets hold: a 429 is expected and the pod
//! is tried again on the next pass.
//!
//! With `autoUpgrade` off, or no ClusterPolicy in charge, the state label is
//! removed from every node that has it, as NVIDIA does, and so is the rest
//! of an upgrade left midway: a node the flow cordoned is uncordoned (one
//! cordoned before, or whose upgrade failed, stays cordoned), the flow's
//! annotations go, and the node gets a `DriverUpgradeAbandoned` Event
//! ([`gpu_stack_core::operator::upgrade::abandon`]). With NVIDIADrivers
//! (`driver.useNvidiaDriverCRD`), each resource's nodes (its owner label)
//! follow that resource's `upgradePolicy` with a budget of their own, as
//! NVIDIA's per-CR upgrade state does; one more list reads the resources.
pub mod apply;
pub mod controller;
pub mod observe;
pub mod watches;

use gpu_stack_core::operator::upgrade::pass::{StuckNode, UpgradePlan};
use gpu_stack_core::operator::upgrade::policy::UpgradePolicyError;
use gpu_stack_core::operator::upgrade::state::UpgradeState;

use crate::operator::clusterpolicy::status::{Condition, DriverUpgradeStatus, StuckUpgradeNode};
use crate::operator::controller::watches::CacheError;
use observe::ObserveError;

/// Selects the driver DaemonSets, their pods and their ControllerRevisions.
pub const DRIVER_SELECTOR: &str = "nvidia.com/gpu-stack.component=driver";

/// Field manager of `status.driverUpgrade` (the reconcile pass owns the rest).
pub const FIELD_MANAGER: &str = "gpu-stack-upgrade";

/// Default of `--upgrade-stuck-after-seconds`.
pub const DEFAULT_STUCK_AFTER_SECONDS: u64 = 1800;

/// Why an upgrade pass failed.
#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    /// An API request failed.
    #[error("driver upgrade: {during} failed: {source}")]
    Api {
        /// What was being done.
        during: String,
        /// Underlying error.
        #[source]
        source: kube::Error,
    },
    /// The policy cannot be used (also reported in the ClusterPolicy status).
    #[error("driver upgrade: {0}")]
    Policy(#[from] UpgradePolicyError),
    /// The observations could not be built.
    #[error("driver upgrade: {0}")]
    Observe(#[from] ObserveError),
    /// A watch cache is not filled yet.
    #[error("driver upgrade: {0}")]
    Cache(#[from] CacheError),
}

/// The `status.driverUpgrade` a pass reports: counts of the states it wrote.
pub fn upgrade_status(
    auto_upgrade: bool,
    plan: &UpgradePlan,
    stuck: &[StuckNode],
    now: u64,
) -> DriverUpgradeStatus {
    let count = |f: &dyn Fn(UpgradeState) -> bool| {
        let n = plan.decisions.iter().filter(|d| f(d.next)).count();
        i64::try_from(n).unwrap_or(i64::MAX)
    };
    let total = count(&|s| s.managed());
    // Up to date: `upgrade-done`, or never needed an upgrade (no label).
    let upgraded = count(&|s| s.at_rest());
    let in_progress = count(&|s| s.in_progress());
    let pending = count(&|s| s == UpgradeState::UpgradeRequired);
    let failed = count(&|s| s == UpgradeState::Failed);
    let mut message = format!("{upgraded} of {total} nodes up to date");
    if in_progress + pending + failed > 0 {
        message.push_str(&format!(
            "; {in_progress} in progress, {pending} pending, {failed} failed"
        ));
    }
    let stuck_nodes: Vec<StuckUpgradeNode> = stuck
        .iter()
        .map(|s| StuckUpgradeNode {
            node: s.node.clone(),
            state: s.state.as_label().to_string(),
            since: i64::try_from(now.saturating_sub(s.waited_seconds)).unwrap_or(i64::MAX),
            waiting_for: s.waiting_for.clone(),
        })
        .collect();
    let conditions = vec![Condition {
        type_: "DriverUpgradeStuck".into(),
        status: if stuck.is_empty() { "False" } else { "True" }.into(),
        reason: if stuck.is_empty() {
            "NoneStuck"
        } else {
            "NodesStuck"
        }
        .into(),
        message: if stuck.is_empty() {
            String::new()
        } else {
            let names: Vec<&str> = stuck.iter().take(5).map(|s| s.node.as_str()).collect();
            format!(
                "{} node(s) wait longer than the stuck limit: {}",
                stuck.len(),
                names.join(", ")
            )
        },
        last_transition_time: None,
    }];
    DriverUpgradeStatus {
        auto_upgrade,
        total,
        upgraded,
        in_progress,
        pending,
        failed,
        message,
        stuck: stuck_nodes,
        conditions,
    }
}

#[cfg(test)]
mod tests;
