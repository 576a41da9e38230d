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

use super::labels::{Labels, MIG_CONFIG};
use super::migconfig::{MAX_NAME, MigConfigPlan, MigNode, NodeState, NodeStatus, entry_name};
use super::migusage::NodeUsage;
use crate::catalog;
use crate::mig::{
    Demand, FleetGpu, FleetPlan, MigProfileName, PlacedInstance, PlanError, plan_fleet,
};
use crate::migmanager::labels::MIG_CONFIG_STATE_LABEL;
use crate::migparted::{Devices, MigConfigSpec, NamedConfig};

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

/// Most planning passes one decision makes (each serves strictly more).
const MAX_PASSES: usize = 16;

/// Decides which nodes change layout for `pending` (from
/// [`demand_from_requests`]) at unix time `now`.
pub fn decide(
    nodes: &[DemandNode<'_>],
    pending: &Demand,
    limits: &DemandLimits,
    now: u64,
) -> Result<DemandDecision, PlanError> {
    // A plan fills GPUs one after another, so carrying it out can leave room
    // that planning again would use. Planning again from its result until a
    // pass serves no more makes a carried-out decision settle: the next
    // decision on the same demand changes nothing.
    let mut state: Vec<DemandNode<'_>> = nodes.to_vec();
    let mut changed_order: Vec<usize> = Vec::new();
    let mut unmet = Demand::new();
    for _ in 0..MAX_PASSES {
        let pass = plan_pass(&state, pending, limits, now)?;
        unmet = pass.unmet;
        if pass.changes.is_empty() {
            break;
        }
        for (node, targets) in pass.changes {
            if !changed_order.contains(&node) {
                changed_order.push(node);
            }
            for (gpu, target) in state[node].gpus.iter_mut().zip(targets) {
                gpu.current = target;
            }
        }
    }
    let mut changes: Vec<NodeLayout> = changed_order
        .into_iter()
        .filter(|&k| {
            state[k]
                .gpus
                .iter()
                .zip(&nodes[k].gpus)
                .any(|(a, b)| !same_layout(&a.current, &b.current))
        })
        .map(|k| NodeLayout {
            node: state[k].name.clone(),
            gpus: state[k]
                .gpus
                .iter()
                .map(|g| (g.id.clone(), g.current.clone()))
                .collect(),
        })
        .collect();
    let mut out = DemandDecision {
        unmet,
        ..DemandDecision::default()
    };
    if changes.len() > limits.max_nodes_per_pass {
        out.deferred = changes
            .split_off(limits.max_nodes_per_pass)
            .into_iter()
            .map(|c| c.node)
            .collect();
    }
    changes.sort_by(|a, b| a.node.cmp(&b.node));
    out.changes = changes;
    Ok(out)
}

/// Whether two layouts hold the same instances, in any order.
fn same_layout(a: &[PlacedInstance], b: &[PlacedInstance]) -> bool {
    sorted(a) == sorted(b)
}

/// One planning pass: the nodes to change (node index and the target of
/// each of its GPUs in the node's order, most idle room first) and what its
/// plan leaves unmet.
struct Pass {
    changes: Vec<(usize, Vec<Vec<PlacedInstance>>)>,
    unmet: Demand,
}

fn plan_pass(
    nodes: &[DemandNode<'_>],
    pending: &Demand,
    limits: &DemandLimits,
    now: u64,
) -> Result<Pass, PlanError> {
    let mut out = Pass {
        changes: Vec::new(),
        unmet: Demand::new(),
    };
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
    let mut order: Vec<usize> = (0..nodes.len()).collect();
    let room = |n: &DemandNode<'_>| -> usize {
        n.gpus
            .iter()
            .map(|g| g.current.len().saturating_sub(g.in_use.len()))
            .sum::<usize>()
            + n.gpus.iter().filter(|g| g.current.is_empty()).count() * 8
    };
    order.sort_by(|&a, &b| {
        let (a, b) = (&nodes[a], &nodes[b]);
        held(a)
            .cmp(&held(b))
            .then(room(b).cmp(&room(a)))
            .then(a.name.cmp(&b.name))
    });
    // The fewest nodes: the first `k` nodes not held may change, the rest
    // are planned as fixed; the smallest `k` that serves as much as letting
    // every node change wins (a binary search: letting more nodes change
    // never serves less).
    let free = order.iter().filter(|&&n| !held(&nodes[n])).count();
    let plan_with = |k: usize| -> Result<(FleetPlan, Vec<usize>), PlanError> {
        let mut fleet: Vec<FleetGpu<'_>> = Vec::new();
        let mut owner: Vec<usize> = Vec::new();
        for (j, &n) in order.iter().enumerate() {
            let n = &nodes[n];
            for g in &n.gpus {
                let mut g = g.clone();
                if held(n) || j >= k {
                    g.in_use = g.current.clone();
                }
                fleet.push(g);
                owner.push(j);
            }
        }
        Ok((plan_fleet(&fleet, &demand)?, owner))
    };
    let unmet_of = |p: &FleetPlan| -> u64 { p.profiles.iter().map(|o| u64::from(o.unmet)).sum() };
    let nodes_changed = |(p, o): &(FleetPlan, Vec<usize>)| -> usize {
        let mut v: Vec<usize> = p
            .gpus
            .iter()
            .zip(o)
            .filter(|(g, _)| g.changes())
            .map(|(_, k)| *k)
            .collect();
        v.dedup();
        v.len()
    };
    let unchanged = plan_with(0)?;
    let all = plan_with(free)?;
    let target = unmet_of(&all.0);
    let (mut lo, mut hi) = (0usize, free);
    let mut best: Option<(FleetPlan, Vec<usize>)> = None;
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        let candidate = plan_with(mid)?;
        if unmet_of(&candidate.0) <= target {
            best = Some(candidate);
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    let (plan, owner) = match best {
        Some(b) if nodes_changed(&b) <= nodes_changed(&all) => b,
        _ => all,
    };
    // A change must serve more than the layouts as they are.
    let (plan, owner) = if unmet_of(&plan) < unmet_of(&unchanged.0) {
        (plan, owner)
    } else {
        unchanged
    };
    // Per node in plan order: whether any GPU changes, and every GPU's target.
    let mut targets: BTreeMap<usize, (bool, Vec<Vec<PlacedInstance>>)> = BTreeMap::new();
    for (gp, &k) in plan.gpus.iter().zip(&owner) {
        let (changes, gpus) = targets.entry(k).or_default();
        *changes |= gp.changes();
        gpus.push(gp.target.clone());
    }
    out.changes = targets
        .into_iter()
        .filter(|(_, (changes, _))| *changes)
        .map(|(k, (_, gpus))| (order[k], gpus))
        .collect();
    out.unmet = plan
        .profiles
        .iter()
        .filter(|p| p.unmet > 0)
        .filter_map(|p| Some((p.profile.parse().ok()?, p.unmet)))
        .collect();
    Ok(out)
}

/// Longest name of a MigConfig in demand mode: its generated per-node
/// configs add `_` and eight hex digits to [`entry_name`].
pub const MAX_DEMAND_NAME: usize = MAX_NAME - 9;

/// How long an unapplied decision is planned as the node's layout.
pub const IN_FLIGHT_SECONDS: u64 = 600;

/// Most decided nodes a MigConfig's status keeps.
pub const MAX_DECIDED_NODES: usize = 1000;

/// Whether two node selectors can hold on one node: every key both name
/// has the same value in both.
pub fn selector_compatible(a: &Labels, b: &Labels) -> bool {
    a.iter().all(|(k, v)| b.get(k).is_none_or(|w| w == v))
}

/// A pod the scheduler has not placed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PendingPod {
    /// Its `spec.nodeSelector`.
    pub node_selector: Labels,
    /// Its extended resource requests, `(resource, count)`, summed over
    /// its containers.
    pub requests: Vec<(String, u32)>,
}

/// Pending MIG demand per demand-mode MigConfig (`(name, nodeSelector)`).
/// A pod asking for `nvidia.com/mig-<profile>` counts for the first
/// MigConfig, by name, whose selector is compatible with the pod's, so no
/// pod is counted twice; pods without MIG requests, or that no MigConfig
/// fits, count for none.
pub fn pending_per_config(
    configs: &[(String, Labels)],
    pods: &[PendingPod],
) -> BTreeMap<String, Demand> {
    let mut order: Vec<&(String, Labels)> = configs.iter().collect();
    order.sort_by(|a, b| a.0.cmp(&b.0));
    let mut per: BTreeMap<String, Vec<(&str, u32)>> = BTreeMap::new();
    for pod in pods {
        if !pod
            .requests
            .iter()
            .any(|(r, n)| *n > 0 && profile_of_resource(r).is_some())
        {
            continue;
        }
        if let Some((name, _)) = order
            .iter()
            .find(|(_, sel)| selector_compatible(sel, &pod.node_selector))
        {
            per.entry(name.clone())
                .or_default()
                .extend(pod.requests.iter().map(|(r, n)| (r.as_str(), *n)));
        }
    }
    per.into_iter()
        .map(|(name, reqs)| (name, demand_from_requests(reqs)))
        .collect()
}

/// A layout decided for one node, as a MigConfig's status remembers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decided {
    /// Node name.
    pub node: String,
    /// When it was decided (unix seconds).
    pub at: u64,
    /// Each GPU's target layout, by index.
    pub gpus: Vec<(u32, Vec<PlacedInstance>)>,
}

fn counts(layout: &[PlacedInstance]) -> Demand {
    let mut out: Demand = Vec::new();
    for i in layout {
        match out.iter_mut().find(|(p, _)| *p == i.profile) {
            Some((_, n)) => *n += 1,
            None => out.push((i.profile.clone(), 1)),
        }
    }
    out.sort_by_key(|(p, _)| p.to_string());
    out
}

/// Whether a layout can be written as placements: GPU instances only (the
/// planner's exact starts; compute-instance profiles go by count).
fn placeable(layout: &[PlacedInstance]) -> bool {
    !layout.is_empty() && layout.iter().all(|i| i.profile.is_gpu_instance())
}

/// A layout in start order, so equal layouts read and hash alike.
fn sorted(layout: &[PlacedInstance]) -> Vec<PlacedInstance> {
    let mut v = layout.to_vec();
    v.sort_by_key(|i| (i.start, i.profile.to_string()));
    v
}

/// The generated mig-parted config of a decided node layout: one entry per
/// GPU (`devices: [i]`, MIG on, the layout's profile counts, and the
/// planner's exact placements, so the MIG manager creates the instances
/// where the plan put them and keeps those in use where they are), named
/// `gpustack-<migconfig>_<hash>` after its content, so the node label
/// changes whenever the layout does and nodes with one layout share a name.
pub fn node_config(migconfig: &str, gpus: &[(u32, Vec<PlacedInstance>)]) -> NamedConfig {
    let mut gpus: Vec<&(u32, Vec<PlacedInstance>)> = gpus.iter().collect();
    gpus.sort_by_key(|(i, _)| *i);
    let entries: Vec<MigConfigSpec> = gpus
        .iter()
        .map(|(i, layout)| MigConfigSpec {
            device_filter: Vec::new(),
            devices: Devices::Indices(vec![*i]),
            mig_enabled: true,
            mig_devices: counts(layout),
            placements: placeable(layout).then(|| sorted(layout)),
        })
        .collect();
    // FNV-1a over the content: stable across releases and platforms.
    let mut h: u32 = 0x811c_9dc5;
    for (i, layout) in &gpus {
        let part = format!(
            "{i}:{};",
            sorted(layout)
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(",")
        );
        for b in part.bytes() {
            h ^= u32::from(b);
            h = h.wrapping_mul(0x0100_0193);
        }
    }
    NamedConfig {
        name: format!("{}_{h:08x}", entry_name(migconfig)),
        entries,
    }
}

/// The planner's view of one node of a demand-mode MigConfig, from what its
/// MIG manager published (`usage`) and the last layout decided for it.
/// While a decision younger than [`IN_FLIGHT_SECONDS`] is not applied yet
/// (the label does not name it, the MIG manager has not reported success,
/// or the published layout differs; a `failed` state may be a config file
/// not yet synced),
/// the node is planned as holding the decided layout, so a later decision
/// neither undoes it nor serves its pending pods a second time elsewhere.
/// GPUs of models without MIG geometry are left out; `None` without usage.
pub fn demand_node(
    name: &str,
    usage: Option<&NodeUsage>,
    decided: Option<&Decided>,
    labels: &Labels,
    migconfig: &str,
    now: u64,
) -> Option<DemandNode<'static>> {
    let usage = usage?.normalized();
    let settled = !in_flight(&usage, decided, labels, migconfig, now);
    let gpus = usage
        .gpus
        .iter()
        .filter_map(|g| {
            let geometry = catalog::lookup(&g.model).ok()?.mig.as_ref()?;
            let target = decided
                .filter(|_| !settled)
                .and_then(|d| d.gpus.iter().find(|(i, _)| *i == g.index))
                .map(|(_, t)| t.clone());
            let (mig_enabled, current) = match target {
                Some(t) => (true, t),
                None => (g.mig_enabled, g.layout.clone()),
            };
            let in_use = g
                .in_use
                .iter()
                .filter(|i| current.contains(i))
                .cloned()
                .collect();
            Some(FleetGpu {
                id: g.index.to_string(),
                geometry,
                mig_enabled,
                current,
                in_use,
            })
        })
        .collect();
    Some(DemandNode {
        name: name.to_string(),
        gpus,
        last_change: decided.map(|d| d.at),
    })
}

/// Whether the node's last decision is still being applied: younger than
/// [`IN_FLIGHT_SECONDS`] and not yet applied (the label does not name it,
/// the MIG manager has not reported success, or the published layout
/// differs). Older decisions never applied (the MIG manager refused or
/// could not apply them) give way to what the node publishes.
pub fn in_flight(
    usage: &NodeUsage,
    decided: Option<&Decided>,
    labels: &Labels,
    migconfig: &str,
    now: u64,
) -> bool {
    let state = labels.get(MIG_CONFIG_STATE_LABEL).map(String::as_str);
    decided.is_some_and(|d| {
        now.saturating_sub(d.at) < IN_FLIGHT_SECONDS
            && !(labels.get(MIG_CONFIG) == Some(&node_config(migconfig, &d.gpus).name)
                && state == Some("success")
                && d.gpus.iter().all(|(i, target)| {
                    usage
                        .gpus
                        .iter()
                        .find(|g| g.index == *i)
                        .is_some_and(|g| counts(&g.layout) == counts(target))
                }))
    })
}

/// Whether a new decision may be made for a MigConfig whose nodes are in
/// `in_flight` states: only once every earlier decision is applied (or has
/// given way), so that pods being scheduled onto new layouts, seen both as
/// pending and as in use for a moment, never cause a second change.
pub fn may_decide(in_flight: impl IntoIterator<Item = bool>) -> bool {
    !in_flight.into_iter().any(|b| b)
}

/// The decisions of one [`decide`] as [`Decided`] records at `now`.
pub fn decided_from(decision: &DemandDecision, now: u64) -> Vec<Decided> {
    decision
        .changes
        .iter()
        .map(|c| Decided {
            node: c.node.clone(),
            at: now,
            gpus: c
                .gpus
                .iter()
                .filter_map(|(id, t)| Some((id.parse().ok()?, t.clone())))
                .collect(),
        })
        .collect()
}

/// Merges new decisions into the remembered ones: a node's newest decision
/// wins; nodes no longer selected are dropped; at most
/// [`MAX_DECIDED_NODES`], newest first kept.
pub fn merge_decided(old: &[Decided], new: &[Decided], selected: &[&str]) -> Vec<Decided> {
    let mut by: BTreeMap<&str, &Decided> = BTreeMap::new();
    for d in old.iter().chain(new) {
        if selected.contains(&d.node.as_str()) {
            by.insert(d.node.as_str(), d);
        }
    }
    let mut out: Vec<Decided> = by.into_values().cloned().collect();
    if out.len() > MAX_DECIDED_NODES {
        out.sort_by(|a, b| b.at.cmp(&a.at).then(a.node.cmp(&b.node)));
        out.truncate(MAX_DECIDED_NODES);
        out.sort_by(|a, b| a.node.cmp(&b.node));
    }
    out
}

/// Lays the decided layouts of demand-mode MigConfig `migconfig` over the
/// static plan: each decided node it validly holds gets its generated
/// config (added to the entries) in its label instead of the MigConfig's
/// starting layout, and its status says whether the MIG manager applied
/// it. A node whose label already names one of its generated configs keeps
/// it (the config stays in the file while named). Nodes refused in the plan
/// are left as they are.
pub fn apply_decisions(
    plan: &mut MigConfigPlan,
    migconfig: &str,
    decided: &[Decided],
    nodes: &[MigNode],
) {
    let prefix = format!("{}_", entry_name(migconfig));
    let Some(statuses) = plan.statuses.get_mut(migconfig) else {
        return;
    };
    let counts = plan.counts.entry(migconfig.to_string()).or_default();
    for status in statuses.iter_mut() {
        if status.state == NodeState::Invalid {
            continue;
        }
        let Some(node) = nodes.iter().find(|n| n.name == status.node) else {
            continue;
        };
        let label = node.labels.get(MIG_CONFIG);
        let wanted = match decided.iter().find(|d| d.node == node.name) {
            Some(d) => {
                let cfg = node_config(migconfig, &d.gpus);
                let name = cfg.name.clone();
                if !plan.entries.iter().any(|e| e.name == name) {
                    plan.entries.push(cfg);
                }
                name
            }
            None => match label {
                Some(l) if l.starts_with(&prefix) => l.clone(),
                _ => continue,
            },
        };
        if label == Some(&wanted) {
            plan.labels.remove(&node.name);
        } else {
            plan.labels.insert(
                node.name.clone(),
                [(MIG_CONFIG.to_string(), Some(wanted.clone()))].into(),
            );
        }
        let state = node.labels.get(MIG_CONFIG_STATE_LABEL).map(String::as_str);
        let applied = label == Some(&wanted) && state == Some("success");
        let new = NodeStatus {
            node: node.name.clone(),
            state: if applied {
                NodeState::Applied
            } else {
                NodeState::Pending
            },
            reason: if applied {
                String::new()
            } else if label == Some(&wanted) && state == Some("failed") {
                format!(
                    "the MIG manager failed to apply the demand layout {wanted}; see its log and the node's events"
                )
            } else {
                format!("waiting for the MIG manager to apply the demand layout {wanted}")
            },
        };
        match status.state {
            NodeState::Applied => counts.applied = counts.applied.saturating_sub(1),
            NodeState::Pending => counts.pending = counts.pending.saturating_sub(1),
            NodeState::Invalid => {}
        }
        match new.state {
            NodeState::Applied => counts.applied += 1,
            _ => counts.pending += 1,
        }
        *status = new;
    }
    plan.entries.sort_by(|a, b| a.name.cmp(&b.name));
}

#[cfg(test)]
mod tests;
