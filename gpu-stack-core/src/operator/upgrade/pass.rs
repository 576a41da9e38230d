//! One pure pass of the upgrade flow over every managed node: what it
//! observes of a node, the decision and actions it returns per node, the
//! fleet-wide counts, the per-policy groups, and the nodes stuck in a state.
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
use std::fmt;

use serde::{Deserialize, Serialize};

use super::policy::{UpgradePolicy, UpgradePolicyError};
use super::state::{
    STATE_START_TIME_ANNOTATION, UpgradeMarks, UpgradeState, state_start_time_value,
};
use super::steps::{
    Step, needs_upgrade, remove, set, step_done_or_unknown, step_drain, step_failed,
    step_pod_deletion, step_pod_restart, step_upgrade_required, step_validation,
    step_wait_for_jobs,
};

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
    /// [`DRIVER_POD_FAILING_RESTARTS`](super::state::DRIVER_POD_FAILING_RESTARTS) times.
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

/// The validator pods ([`VALIDATOR_POD_SELECTOR`](super::state::VALIDATOR_POD_SELECTOR)) on a node.
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
