//! Demand-driven MIG: which nodes of a MigConfig in demand mode change
//! layout, and to what, so that pending pods asking for
//! `nvidia.com/mig-<profile>` can be scheduled. Pure decisions over the
//! fleet planner ([`crate::mig::plan_fleet`]):
//!
//! - **Demand** is what runs now plus what waits: the instances in use, per
//!   profile, and the instances pending pods request ([`demand_from_requests`]).
//!   Idle instances count for nothing, so a layout is never grown for them.
//! - **Only unmet demand moves anything** (the hysteresis): with every
//!   pending request servable by idle instances that exist, or none pending,
//!   nothing changes, so a stable demand causes no further changes and
//!   layouts do not flap back when pods finish.
//! - **In-use instances are never touched**: the planner keeps them fixed.
//! - **Rate limit**: a node changed less than `min_interval_seconds` ago
//!   keeps its layout (its GPUs are planned as fixed), and at most
//!   `max_nodes_per_pass` nodes change in one decision; the rest wait for
//!   the next one.
//! - **Fewest nodes**: nodes are offered to the planner with the most idle
//!   room first (then by name), so demand lands on as few nodes as it can.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::mig::{Demand, FleetGpu, MigProfileName, PlacedInstance, PlanError, plan_fleet};

/// Resource name prefix of MIG devices under the `mixed` strategy.
pub const MIG_RESOURCE_PREFIX: &str = "nvidia.com/mig-";

/// The profile a resource name asks for (`nvidia.com/mig-1g.10gb`).
pub fn profile_of_resource(resource: &str) -> Option<MigProfileName> {
    resource.strip_prefix(MIG_RESOURCE_PREFIX)?.parse().ok()
}

/// Instances pending pods request, per profile, from `(resource, count)`
/// pairs; other resources are ignored. Counts saturate instead of wrapping.
pub fn demand_from_requests<'a>(requests: impl IntoIterator<Item = (&'a str, u32)>) -> Demand {
    let mut by: Vec<(MigProfileName, u32)> = Vec::new();
    for (resource, n) in requests {
        let Some(p) = profile_of_resource(resource) else {
            continue;
        };
        match by.iter_mut().find(|(q, _)| *q == p) {
            Some((_, c)) => *c = c.saturating_add(n),
            None => by.push((p, n)),
        }
    }
    by.sort_by_key(|(p, _)| p.to_string());
    by
}

/// One node of a demand-mode MigConfig.
#[derive(Debug, Clone)]
pub struct DemandNode<'a> {
    /// Node name.
    pub name: String,
    /// Its MIG-enabled GPUs, with their current layouts and in-use instances.
    pub gpus: Vec<FleetGpu<'a>>,
    /// When its layout last changed (unix seconds).
    pub last_change: Option<u64>,
}

/// Limits on how fast layouts change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DemandLimits {
    /// A node changes at most once in this many seconds.
    pub min_interval_seconds: u64,
    /// Nodes changed by one decision.
    pub max_nodes_per_pass: usize,
}

impl Default for DemandLimits {
    fn default() -> Self {
        DemandLimits {
            min_interval_seconds: 300,
            max_nodes_per_pass: 8,
        }
    }
}

/// The new layout of one node, GPU by GPU (ids as given).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeLayout {
    /// Node name.
    pub node: String,
    /// Each of its GPUs' target layout, in input order.
    pub gpus: Vec<(String, Vec<PlacedInstance>)>,
}

/// What a decision says.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DemandDecision {
    /// Nodes to change now.
    pub changes: Vec<NodeLayout>,
    /// Pending instances no layout change can serve now, per profile.
    pub unmet: Demand,
    /// Nodes the plan would change but the rate limit holds back.
    pub deferred: Vec<String>,
}

fn count(layout: &[PlacedInstance], p: &MigProfileName) -> u32 {
    u32::try_from(layout.iter().filter(|i| i.profile == *p).count()).unwrap_or(u32::MAX)
}

/// Decides which nodes change layout for `pending` (from
/// [`demand_from_requests`]) at unix time `now`.
pub fn decide(
    nodes: &[DemandNode<'_>],
    pending: &Demand,
    limits: &DemandLimits,
    now: u64,
) -> Result<DemandDecision, PlanError> {
    let mut out = DemandDecision::default();
    // Pending requests idle instances already serve need no change.
    let unmet_now: Demand = pending
        .iter()
        .filter_map(|(p, n)| {
            let idle: u32 = nodes
                .iter()
                .flat_map(|node| &node.gpus)
                .map(|g| count(&g.current, p).saturating_sub(count(&g.in_use, p)))
                .sum();
            let left = n.saturating_sub(idle);
            (left > 0).then(|| (p.clone(), left))
        })
        .collect();
    if unmet_now.is_empty() {
        return Ok(out);
    }
    // Demand: everything in use, plus every pending request.
    let mut demand: Demand = pending.clone();
    for g in nodes.iter().flat_map(|n| &n.gpus) {
        for i in &g.in_use {
            match demand.iter_mut().find(|(p, _)| *p == i.profile) {
                Some((_, c)) => *c = c.saturating_add(1),
                None => demand.push((i.profile.clone(), 1)),
            }
        }
    }
    // Rate-limited nodes are planned as fixed; the rest, most idle room first.
    let held = |n: &DemandNode<'_>| {
        n.last_change
            .is_some_and(|t| now.saturating_sub(t) < limits.min_interval_seconds)
    };
    let mut order: Vec<&DemandNode<'_>> = nodes.iter().collect();
    let room = |n: &DemandNode<'_>| -> usize {
        n.gpus
            .iter()
            .map(|g| g.current.len().saturating_sub(g.in_use.len()))
            .sum::<usize>()
            + n.gpus.iter().filter(|g| g.current.is_empty()).count() * 8
    };
    order.sort_by(|a, b| {
        held(a)
            .cmp(&held(b))
            .then(room(b).cmp(&room(a)))
            .then(a.name.cmp(&b.name))
    });
    let mut fleet: Vec<FleetGpu<'_>> = Vec::new();
    let mut owner: Vec<usize> = Vec::new();
    for (k, n) in order.iter().enumerate() {
        for g in &n.gpus {
            let mut g = g.clone();
            if held(n) {
                g.in_use = g.current.clone();
            }
            fleet.push(g);
            owner.push(k);
        }
    }
    let plan = plan_fleet(&fleet, &demand)?;
    let mut changed: BTreeMap<usize, NodeLayout> = BTreeMap::new();
    for (i, gp) in plan.gpus.iter().enumerate() {
        if gp.changes() {
            let k = owner[i];
            changed.entry(k).or_insert_with(|| NodeLayout {
                node: order[k].name.clone(),
                gpus: Vec::new(),
            });
        }
    }
    for (k, layout) in changed.iter_mut() {
        for (i, gp) in plan.gpus.iter().enumerate() {
            if owner[i] == *k {
                layout.gpus.push((gp.gpu.clone(), gp.target.clone()));
            }
        }
    }
    let mut changes: Vec<NodeLayout> = changed.into_values().collect();
    if changes.len() > limits.max_nodes_per_pass {
        out.deferred = changes
            .split_off(limits.max_nodes_per_pass)
            .into_iter()
            .map(|c| c.node)
            .collect();
    }
    changes.sort_by(|a, b| a.node.cmp(&b.node));
    out.changes = changes;
    out.unmet = plan
        .profiles
        .iter()
        .filter(|p| p.unmet > 0)
        .filter_map(|p| Some((p.profile.parse().ok()?, p.unmet)))
        .collect();
    Ok(out)
}

#[cfg(test)]
mod tests;
