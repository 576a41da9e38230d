//! Fleet planner: choose MIG layouts for many GPUs to meet a demand
//! (profile → number of instances), never removing an in-use instance and
//! changing as few idle instances as possible.
//!
//! Demand counts instances of a profile in the whole fleet, in use or idle:
//! `1g.10gb=20` asks for twenty `1g.10gb` instances to exist. The planner is
//! greedy over GPUs in the order given and optimal per GPU:
//! 1. in-use instances are fixed and count toward demand;
//! 2. idle instances that match still-unmet demand are reserved for it, so
//!    GPUs earlier in the list do not take that demand from them;
//! 3. each GPU in turn gets the layout that serves the most remaining demand
//!    (counted in compute slices, so one 3g outweighs a 1g), then destroys the
//!    fewest idle instances; an idle instance moves only when that serves
//!    more demand. Ties go to the first layout in a
//!    fixed search order, so the plan is deterministic.

use std::collections::HashMap;

use serde::Serialize;

use super::geometry::{Demand, MigGeometry, PlacedInstance};
use super::search::{Compiled, State, to_instance};

/// One GPU as the planner sees it.
#[derive(Debug, Clone)]
pub struct FleetGpu<'a> {
    /// Identifier used in the plan (e.g. `node-a/gpu0`).
    pub id: String,
    /// The GPU's geometry.
    pub geometry: &'a MigGeometry,
    /// Whether MIG mode is on; GPUs with MIG off are left alone.
    pub mig_enabled: bool,
    /// Current layout.
    pub current: Vec<PlacedInstance>,
    /// Which current instances are in use (never removed).
    pub in_use: Vec<PlacedInstance>,
}

/// A fleet that cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// A GPU's current layout is not valid on its geometry.
    #[error("GPU {gpu}: current MIG layout is invalid: {reason}")]
    InvalidCurrent {
        /// GPU id.
        gpu: String,
        /// What is wrong.
        reason: String,
    },
    /// An in-use instance is not in the current layout.
    #[error(
        "GPU {gpu}: in-use instance {instance} is not in the current layout; list it under instances too"
    )]
    InUseNotCurrent {
        /// GPU id.
        gpu: String,
        /// The instance.
        instance: String,
    },
    /// The geometry is unusable.
    #[error("GPU {gpu}: {reason}")]
    Geometry {
        /// GPU id.
        gpu: String,
        /// What is wrong.
        reason: String,
    },
}

/// The plan for one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuPlan {
    /// GPU id.
    pub gpu: String,
    /// Layout after the plan.
    pub target: Vec<PlacedInstance>,
    /// Current instances kept.
    pub keep: Vec<PlacedInstance>,
    /// Idle instances to destroy.
    pub destroy: Vec<PlacedInstance>,
    /// Instances to create.
    pub create: Vec<PlacedInstance>,
    /// Why a GPU was left alone, if it was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl GpuPlan {
    /// Whether the plan changes this GPU.
    pub fn changes(&self) -> bool {
        !self.destroy.is_empty() || !self.create.is_empty()
    }
}

/// How one demanded profile fares.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProfileOutcome {
    /// Profile name.
    pub profile: String,
    /// Instances demanded.
    pub wanted: u32,
    /// Instances in use now.
    pub in_use: u32,
    /// Instances in the planned fleet.
    pub planned: u32,
    /// Demand left unmet.
    pub unmet: u32,
    /// Why demand is unmet.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// A fleet plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FleetPlan {
    /// Per-GPU plans, in input order.
    pub gpus: Vec<GpuPlan>,
    /// Per-profile outcome, in demand order.
    pub profiles: Vec<ProfileOutcome>,
    /// Instances destroyed in total.
    pub destroyed: u32,
    /// Instances created in total.
    pub created: u32,
}

struct Prepared {
    compiled: Compiled,
    /// Demand entry → profile index on this geometry.
    demand_prof: Vec<Option<usize>>,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct CacheKey {
    geometry: usize,
    fixed: Vec<u16>,
    optional: Vec<u16>,
    wants: Vec<u8>,
}

#[derive(Clone)]
struct Choice {
    /// Optional (idle) candidates kept, as a bit set over the optional list.
    kept: u64,
    /// New candidates.
    new: Vec<u16>,
}

/// Plans a fleet; see the module docs for the rules.
pub fn plan_fleet(gpus: &[FleetGpu<'_>], demand: &Demand) -> Result<FleetPlan, PlanError> {
    let mut prepared: HashMap<usize, Prepared> = HashMap::new();
    // Resolve every GPU's current layout to candidate indices.
    let mut resolved: Vec<Option<(Vec<u16>, Vec<bool>)>> = Vec::with_capacity(gpus.len());
    for gpu in gpus {
        let key = gpu.geometry as *const MigGeometry as usize;
        if let std::collections::hash_map::Entry::Vacant(e) = prepared.entry(key) {
            let compiled = Compiled::new(gpu.geometry).map_err(|err| PlanError::Geometry {
                gpu: gpu.id.clone(),
                reason: err.to_string(),
            })?;
            let demand_prof = demand
                .iter()
                .map(|(name, _)| {
                    gpu.geometry
                        .resolve_index(name)
                        .filter(|_| name.is_gpu_instance())
                })
                .collect();
            e.insert(Prepared {
                compiled,
                demand_prof,
            });
        }
        if !gpu.mig_enabled {
            resolved.push(None);
            continue;
        }
        if let Err(v) = super::validate::validate(gpu.geometry, &gpu.current) {
            return Err(PlanError::InvalidCurrent {
                gpu: gpu.id.clone(),
                reason: v
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; "),
            });
        }
        let prep = &prepared[&key];
        let mut cands = Vec::with_capacity(gpu.current.len());
        let mut used = Vec::with_capacity(gpu.current.len());
        for inst in &gpu.current {
            let prof = gpu.geometry.resolve_index(&inst.profile);
            let cand = prof.and_then(|p| prep.compiled.cand_at(p, inst.start));
            let Some(cand) = cand else {
                return Err(PlanError::InvalidCurrent {
                    gpu: gpu.id.clone(),
                    reason: format!("{inst} does not resolve on this GPU"),
                });
            };
            cands.push(cand as u16);
            used.push(false);
        }
        for inst in &gpu.in_use {
            let pos = gpu
                .current
                .iter()
                .enumerate()
                .position(|(i, c)| c == inst && !used[i]);
            match pos {
                Some(i) => used[i] = true,
                None => {
                    return Err(PlanError::InUseNotCurrent {
                        gpu: gpu.id.clone(),
                        instance: inst.to_string(),
                    });
                }
            }
        }
        resolved.push(Some((cands, used)));
    }

    // Demand bookkeeping by demand entry.
    let mut remaining: Vec<u32> = demand.iter().map(|(_, c)| *c).collect();
    let mut in_use_count = vec![0u32; demand.len()];
    let demand_of = |gpu: &FleetGpu<'_>, cand: u16| -> Option<usize> {
        let prep = &prepared[&(gpu.geometry as *const MigGeometry as usize)];
        let prof = usize::from(prep.compiled.cands[usize::from(cand)].prof);
        prep.demand_prof.iter().position(|p| *p == Some(prof))
    };
    // 1. In-use instances count toward demand.
    for (gpu, r) in gpus.iter().zip(&resolved) {
        if let Some((cands, used)) = r {
            for (c, u) in cands.iter().zip(used) {
                if *u && let Some(d) = demand_of(gpu, *c) {
                    in_use_count[d] += 1;
                    remaining[d] = remaining[d].saturating_sub(1);
                }
            }
        }
    }
    // 2. Idle instances that serve remaining demand are reserved.
    let mut reserved: Vec<Vec<bool>> = Vec::with_capacity(gpus.len());
    for (gpu, r) in gpus.iter().zip(&resolved) {
        let mut res = Vec::new();
        if let Some((cands, used)) = r {
            for (c, u) in cands.iter().zip(used) {
                let mut keep = false;
                if !*u
                    && let Some(d) = demand_of(gpu, *c)
                    && remaining[d] > 0
                {
                    remaining[d] -= 1;
                    keep = true;
                }
                res.push(keep);
            }
        }
        reserved.push(res);
    }
    // 3. Per GPU, the best layout for what is still unmet.
    let mut cache: HashMap<CacheKey, Choice> = HashMap::new();
    let mut plans = Vec::with_capacity(gpus.len());
    for ((gpu, r), res) in gpus.iter().zip(&resolved).zip(&reserved) {
        let Some((cands, used)) = r else {
            plans.push(GpuPlan {
                gpu: gpu.id.clone(),
                target: Vec::new(),
                keep: Vec::new(),
                destroy: Vec::new(),
                create: Vec::new(),
                note: Some("MIG is disabled on this GPU; left unchanged".into()),
            });
            continue;
        };
        let gkey = gpu.geometry as *const MigGeometry as usize;
        let prep = &prepared[&gkey];
        let c = &prep.compiled;
        // In-use instances are fixed; idle ones (reserved or not) may move if
        // that serves more demand. Reserved ones return their demand here and
        // take it back if kept.
        let mut fixed: Vec<u16> = Vec::new();
        let mut optional: Vec<u16> = Vec::new();
        for (i, cand) in cands.iter().enumerate() {
            if used[i] {
                fixed.push(*cand);
            } else {
                optional.push(*cand);
                if res[i]
                    && let Some(d) = demand_of(gpu, *cand)
                {
                    remaining[d] += 1;
                }
            }
        }
        let mut wants = vec![0u8; c.profs.len()];
        for (d, prof) in prep.demand_prof.iter().enumerate() {
            if let Some(p) = prof {
                let w = remaining[d].min(c.profs[*p].max).min(255);
                wants[*p] = wants[*p].saturating_add(w as u8);
            }
        }
        let key = CacheKey {
            geometry: gkey,
            fixed: fixed.clone(),
            optional: optional.clone(),
            wants: wants.clone(),
        };
        let choice = match cache.get(&key) {
            Some(ch) => ch.clone(),
            None => {
                let ch = best_for_gpu(c, &fixed, &optional, &wants);
                cache.insert(key, ch.clone());
                ch
            }
        };
        // Apply.
        for (i, &o) in optional.iter().enumerate() {
            if choice.kept & (1u64 << i) != 0
                && let Some(d) = demand_of(gpu, o)
            {
                remaining[d] = remaining[d].saturating_sub(1);
            }
        }
        for &n in &choice.new {
            if let Some(d) = demand_of(gpu, n) {
                remaining[d] = remaining[d].saturating_sub(1);
            }
        }
        let inst = |cand: u16| to_instance(gpu.geometry, &c.cands[usize::from(cand)]);
        let mut keep: Vec<PlacedInstance> = fixed.iter().map(|&x| inst(x)).collect();
        let mut destroy = Vec::new();
        for (i, &o) in optional.iter().enumerate() {
            if choice.kept & (1u64 << i) != 0 {
                keep.push(inst(o));
            } else {
                destroy.push(inst(o));
            }
        }
        let create: Vec<PlacedInstance> = choice.new.iter().map(|&x| inst(x)).collect();
        let mut target: Vec<PlacedInstance> = keep.iter().chain(&create).cloned().collect();
        keep.sort();
        target.sort();
        plans.push(GpuPlan {
            gpu: gpu.id.clone(),
            target,
            keep,
            destroy,
            create,
            note: None,
        });
    }

    // Outcomes.
    let mut profiles = Vec::with_capacity(demand.len());
    for (d, (name, wanted)) in demand.iter().enumerate() {
        let planned = plans
            .iter()
            .flat_map(|p| &p.target)
            .filter(|i| i.profile == *name)
            .count() as u32;
        let unmet = wanted.saturating_sub(planned);
        let reason = (unmet > 0).then(|| {
            let offering = gpus
                .iter()
                .zip(&resolved)
                .filter(|(g, r)| {
                    r.is_some()
                        && prepared[&(g.geometry as *const MigGeometry as usize)].demand_prof[d]
                            .is_some()
                })
                .count();
            if !name.is_gpu_instance() {
                format!(
                    "{name} is a compute-instance profile; plan its GPU instance {} instead",
                    name.gpu_instance()
                )
            } else if offering == 0 {
                format!(
                    "no MIG-enabled GPU in the fleet has a profile named {name} (profile names are per GPU model)"
                )
            } else {
                format!(
                    "the {offering} MIG-enabled GPU(s) offering {name} have no room left without removing in-use instances or instances planned for other demand"
                )
            }
        });
        profiles.push(ProfileOutcome {
            profile: name.to_string(),
            wanted: *wanted,
            in_use: in_use_count[d],
            planned,
            unmet,
            reason,
        });
    }
    let destroyed = plans.iter().map(|p| p.destroy.len() as u32).sum();
    let created = plans.iter().map(|p| p.create.len() as u32).sum();
    Ok(FleetPlan {
        gpus: plans,
        profiles,
        destroyed,
        created,
    })
}

struct Search<'a> {
    c: &'a Compiled,
    optional: &'a [u16],
    wants: &'a [u8],
    /// New candidates worth trying (profiles with wants > 0).
    new_cands: Vec<u16>,
    /// Demand left on this GPU, in compute slices.
    total_wants: u32,
    best: Option<(u32, u32, Choice)>,
    new: Vec<u16>,
}

fn best_for_gpu(c: &Compiled, fixed: &[u16], optional: &[u16], wants: &[u8]) -> Choice {
    let mut st = State::EMPTY;
    for &f in fixed {
        let cand = c.cands[usize::from(f)];
        st = c.add(&st, usize::from(cand.prof), cand.mask);
    }
    let new_cands: Vec<u16> = (0..c.cands.len())
        .filter(|&i| wants[usize::from(c.cands[i].prof)] > 0)
        .map(|i| i as u16)
        .collect();
    let mut s = Search {
        c,
        optional,
        wants,
        new_cands,
        total_wants: wants
            .iter()
            .zip(&c.profs)
            .map(|(&w, p)| u32::from(w) * p.compute.max(1))
            .sum(),
        best: None,
        new: Vec::new(),
    };
    s.optional_dfs(0, &st, 0, 0, &[0u8; 32], 0);
    s.best.map(|(_, _, ch)| ch).unwrap_or(Choice {
        kept: (1u64 << optional.len().min(63)) - 1,
        new: Vec::new(),
    })
}

impl Search<'_> {
    fn done(&self) -> bool {
        matches!(&self.best, Some((served, destroyed, _)) if *served == self.total_wants && *destroyed == 0)
    }

    fn optional_dfs(
        &mut self,
        i: usize,
        st: &State,
        kept: u64,
        destroyed: u32,
        added: &[u8; 32],
        served: u32,
    ) {
        if self.done() {
            return;
        }
        if let Some((bs, bd, _)) = &self.best
            && *bs == self.total_wants
            && destroyed >= *bd
        {
            return;
        }
        if i == self.optional.len() {
            self.new_dfs(0, st, added, served, kept, destroyed);
            return;
        }
        let cand = self.c.cands[usize::from(self.optional[i])];
        let prof = usize::from(cand.prof);
        // Keep first (cheaper), then destroy.
        if self.c.can_add(st, prof, cand.mask) {
            let next = self.c.add(st, prof, cand.mask);
            let mut a = *added;
            let mut gain = 0;
            if a[prof] < self.wants[prof] {
                a[prof] += 1;
                gain = self.c.profs[prof].compute.max(1);
            }
            self.optional_dfs(
                i + 1,
                &next,
                kept | (1u64 << i),
                destroyed,
                &a,
                served + gain,
            );
        }
        self.optional_dfs(i + 1, st, kept, destroyed + 1, added, served);
    }

    fn new_dfs(
        &mut self,
        from: usize,
        st: &State,
        added: &[u8; 32],
        served: u32,
        kept: u64,
        destroyed: u32,
    ) {
        let better = match &self.best {
            None => true,
            Some((bs, bd, _)) => served > *bs || (served == *bs && destroyed < *bd),
        };
        if better {
            self.best = Some((
                served,
                destroyed,
                Choice {
                    kept,
                    new: self.new.clone(),
                },
            ));
        }
        if self.done() {
            return;
        }
        // Bound: the free slices cannot hold more than this many new instances.
        if let Some((bs, bd, _)) = &self.best {
            let free = self.c.compute_slices.saturating_sub(st.compute_used());
            let room = free.min(self.total_wants - served);
            let upper = served + room;
            if upper < *bs || (upper == *bs && destroyed >= *bd) {
                return;
            }
        }
        for k in from..self.new_cands.len() {
            let ci = self.new_cands[k];
            let cand = self.c.cands[usize::from(ci)];
            let prof = usize::from(cand.prof);
            if added[prof] >= self.wants[prof] || !self.c.can_add(st, prof, cand.mask) {
                continue;
            }
            let next = self.c.add(st, prof, cand.mask);
            let mut a = *added;
            a[prof] += 1;
            self.new.push(ci);
            let gain = self.c.profs[prof].compute.max(1);
            self.new_dfs(k + 1, &next, &a, served + gain, kept, destroyed);
            self.new.pop();
            if self.done() {
                return;
            }
        }
    }
}
