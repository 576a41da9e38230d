//! Exhaustive placement search on a GPU's memory-slice axis: fit a multiset,
//! enumerate layouts, and reconfigure with as few changes as possible.
//!
//! The axis is at most 12 slices on shipping GPUs, so complete depth-first
//! search over bit masks is fast and, unlike creating instances one by one on
//! hardware, proves impossibility and does not depend on input order.

use serde::Serialize;

use super::geometry::{Demand, GeometryError, MigGeometry, PlacedInstance};
use super::name::{MediaVariant, MigProfileName};
use super::validate::slice_mask;

/// A geometry compiled for search: per-profile constants and every
/// (profile, placement) candidate as a bit mask.
#[derive(Debug, Clone)]
pub(crate) struct Compiled {
    pub(crate) profs: Vec<Prof>,
    /// Candidates ordered by profile, then start.
    pub(crate) cands: Vec<Cand>,
    pub(crate) compute_slices: u32,
    max_instances: u32,
    ofa_engines: u32,
}

#[derive(Debug, Clone)]
pub(crate) struct Prof {
    pub(crate) compute: u32,
    pub(crate) max: u32,
    ofa: u32,
    me_all: bool,
    no_me: bool,
    /// Index range into `cands`.
    pub(crate) cand_from: usize,
    pub(crate) cand_to: usize,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Cand {
    pub(crate) prof: u8,
    pub(crate) start: u8,
    pub(crate) mask: u64,
}

/// Incremental layout state.
#[derive(Debug, Clone, Copy)]
pub(crate) struct State {
    mask: u64,
    counts: [u8; 32],
    compute: u32,
    n: u32,
    ofa: u32,
    me_all: u32,
    not_no_me: u32,
}

impl State {
    /// Compute slices used.
    pub(crate) fn compute_used(&self) -> u32 {
        self.compute
    }

    pub(crate) const EMPTY: State = State {
        mask: 0,
        counts: [0; 32],
        compute: 0,
        n: 0,
        ofa: 0,
        me_all: 0,
        not_no_me: 0,
    };
}

impl Compiled {
    pub(crate) fn new(geometry: &MigGeometry) -> Result<Compiled, GeometryError> {
        geometry.check()?;
        let mut profs = Vec::with_capacity(geometry.gi_profiles.len());
        let mut cands = Vec::new();
        for (i, p) in geometry.gi_profiles.iter().enumerate() {
            let from = cands.len();
            let mut starts: Vec<u32> = p.placements.iter().map(|pl| pl.start).collect();
            starts.sort_unstable();
            starts.dedup();
            for start in starts {
                cands.push(Cand {
                    prof: i as u8,
                    start: start as u8,
                    mask: slice_mask(start, p.memory_slices),
                });
            }
            let variant = p.media_variant();
            profs.push(Prof {
                compute: p.compute_slices,
                max: p.max_instances,
                ofa: p.media.ofa,
                me_all: variant == MediaVariant::MeAll,
                no_me: variant == MediaVariant::NoMe,
                cand_from: from,
                cand_to: cands.len(),
            });
        }
        Ok(Compiled {
            profs,
            cands,
            compute_slices: geometry.compute_slices,
            max_instances: geometry.max_instances,
            ofa_engines: geometry.ofa_engines,
        })
    }

    /// Whether `prof` at `mask` can join `st` (every rule of §4 except R5).
    #[inline]
    pub(crate) fn can_add(&self, st: &State, prof: usize, mask: u64) -> bool {
        let p = &self.profs[prof];
        st.mask & mask == 0
            && u32::from(st.counts[prof]) < p.max
            && st.compute + p.compute <= self.compute_slices
            && st.n < self.max_instances
            && st.ofa + p.ofa <= self.ofa_engines
            && if p.me_all {
                st.not_no_me == 0
            } else {
                p.no_me || st.me_all == 0
            }
    }

    #[inline]
    pub(crate) fn add(&self, st: &State, prof: usize, mask: u64) -> State {
        let p = &self.profs[prof];
        let mut s = *st;
        s.mask |= mask;
        s.counts[prof] += 1;
        s.compute += p.compute;
        s.n += 1;
        s.ofa += p.ofa;
        if p.me_all {
            s.me_all += 1;
        }
        if !p.no_me {
            s.not_no_me += 1;
        }
        s
    }

    /// The candidate index of `prof` at `start`.
    pub(crate) fn cand_at(&self, prof: usize, start: u32) -> Option<usize> {
        let p = &self.profs[prof];
        (p.cand_from..p.cand_to).find(|&c| u32::from(self.cands[c].start) == start)
    }
}

/// Why no layout was found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize)]
#[serde(tag = "reason", rename_all = "kebab-case")]
pub enum FitError {
    /// A profile does not exist on this GPU.
    #[error("profile {profile} does not exist on this GPU (profiles: {available})")]
    UnknownProfile {
        /// Profile name.
        profile: String,
        /// Profiles that do exist.
        available: String,
    },
    /// The geometry itself is unusable.
    #[error("{message}")]
    Geometry {
        /// What is wrong.
        message: String,
    },
    /// More of a profile than the GPU allows.
    #[error("{count} × {profile} requested, but this GPU allows at most {max}")]
    TooMany {
        /// Profile name.
        profile: String,
        /// Requested.
        count: u32,
        /// Allowed.
        max: u32,
    },
    /// A demand asks for more of a profile than one GPU can ever hold; refused
    /// before any work (or allocation) sized by the count.
    #[error(
        "{count} × {profile} requested, but one GPU of this model holds at most {max} {profile} instances; lower the count to {max} or less"
    )]
    CountAboveMaximum {
        /// Profile name.
        profile: String,
        /// Requested.
        count: u32,
        /// Most instances of the profile one GPU can hold.
        max: u32,
    },
    /// The totals cannot fit.
    #[error(
        "the request needs {compute} compute slices, {memory} memory slices and {instances} instances; this GPU has {compute_available}, {memory_available} and {instances_available}"
    )]
    Totals {
        /// Compute slices needed.
        compute: u32,
        /// Memory slices needed.
        memory: u32,
        /// Instances needed.
        instances: u32,
        /// Compute slices of the GPU.
        compute_available: u32,
        /// Memory slices of the GPU.
        memory_available: u32,
        /// Instance limit of the GPU.
        instances_available: u32,
    },
    /// Media-engine rules rule the mix out.
    #[error("{message}")]
    MediaEngines {
        /// Which instances conflict.
        message: String,
    },
    /// Exhaustive search found no arrangement.
    #[error(
        "no arrangement of {request} on this GPU's placements avoids overlapping memory slices (all {tried} partial placements were tried)"
    )]
    NoPlacement {
        /// The request.
        request: String,
        /// Search nodes visited.
        tried: u64,
    },
    /// A current instance to keep is not valid.
    #[error("current layout is invalid: {message}")]
    InvalidCurrent {
        /// What is wrong.
        message: String,
    },
}

/// Expands a demand into GI profile indices (largest first). Compute-instance
/// profiles (`1c.2g.10gb`) are packed into as few GPU instances as their
/// compute slices allow.
pub(crate) fn expand_demand(
    geometry: &MigGeometry,
    demand: &Demand,
) -> Result<Vec<usize>, FitError> {
    // Bounds every count first: the expansion below allocates per instance.
    check_demand(geometry, demand)?;
    let mut gi_counts = vec![0u32; geometry.gi_profiles.len()];
    let mut ci_slices: Vec<Vec<u32>> = vec![Vec::new(); geometry.gi_profiles.len()];
    for (name, count) in demand {
        let idx = geometry
            .resolve_index(name)
            .ok_or_else(|| FitError::UnknownProfile {
                profile: name.to_string(),
                available: geometry.profile_list(),
            })?;
        let gi = &geometry.gi_profiles[idx];
        if name.is_gpu_instance() {
            gi_counts[idx] = gi_counts[idx].saturating_add(*count);
        } else {
            let c = name.compute_slices();
            let g = gi.compute_slices;
            if c == 0 || c > g {
                return Err(FitError::UnknownProfile {
                    profile: name.to_string(),
                    available: geometry.profile_list(),
                });
            }
            ci_slices[idx].extend(std::iter::repeat_n(c, *count as usize));
        }
    }
    // First-fit decreasing of compute instances into GPU instances.
    for (idx, slices) in ci_slices.iter_mut().enumerate() {
        slices.sort_unstable_by(|a, b| b.cmp(a));
        let cap = geometry.gi_profiles[idx].compute_slices;
        let mut bins: Vec<u32> = Vec::new();
        for &c in slices.iter() {
            match bins.iter_mut().find(|used| **used + c <= cap) {
                Some(used) => *used += c,
                None => bins.push(c),
            }
        }
        gi_counts[idx] += bins.len() as u32;
    }
    let mut items = Vec::new();
    for (idx, count) in gi_counts.iter().enumerate() {
        items.extend(std::iter::repeat_n(idx, *count as usize));
    }
    // Largest first, then profile order: canonical, so fit is order-independent.
    items.sort_by(|a, b| {
        let (pa, pb) = (&geometry.gi_profiles[*a], &geometry.gi_profiles[*b]);
        pb.memory_slices
            .cmp(&pa.memory_slices)
            .then(pb.compute_slices.cmp(&pa.compute_slices))
            .then(a.cmp(b))
    });
    Ok(items)
}

/// Refuses a count above what one GPU can hold, before anything is sized by it.
fn check_count(name: &MigProfileName, count: u32, max: u32) -> Result<(), FitError> {
    if count > max {
        return Err(FitError::CountAboveMaximum {
            profile: name.to_string(),
            count,
            max,
        });
    }
    Ok(())
}

/// Checks every count of a demand against the most instances of its profile
/// one GPU of `geometry` can hold, and every profile exists. `fit` and
/// `reconfigure` run this check first, so a count above the maximum is
/// refused as [`FitError::CountAboveMaximum`] (the demand does not fit)
/// before anything is sized by the count.
pub fn check_demand(geometry: &MigGeometry, demand: &Demand) -> Result<(), FitError> {
    for (name, count) in demand {
        let idx = geometry
            .resolve_index(name)
            .ok_or_else(|| FitError::UnknownProfile {
                profile: name.to_string(),
                available: geometry.profile_list(),
            })?;
        let gi = &geometry.gi_profiles[idx];
        if name.is_gpu_instance() {
            check_count(name, *count, gi.max_instances)?;
        } else {
            let c = name.compute_slices();
            if c == 0 || c > gi.compute_slices {
                return Err(FitError::UnknownProfile {
                    profile: name.to_string(),
                    available: geometry.profile_list(),
                });
            }
            // Each GPU instance holds at most g / c compute instances of c slices.
            check_count(
                name,
                *count,
                gi.max_instances.saturating_mul(gi.compute_slices / c),
            )?;
        }
    }
    Ok(())
}

fn precheck(geometry: &MigGeometry, items: &[usize]) -> Result<(), FitError> {
    let mut counts = vec![0u32; geometry.gi_profiles.len()];
    for &i in items {
        counts[i] += 1;
    }
    for (i, &count) in counts.iter().enumerate() {
        let p = &geometry.gi_profiles[i];
        if count > p.max_instances {
            return Err(FitError::TooMany {
                profile: p.name.to_string(),
                count,
                max: p.max_instances,
            });
        }
    }
    let compute: u32 = items
        .iter()
        .map(|&i| geometry.gi_profiles[i].compute_slices)
        .sum();
    let memory: u32 = items
        .iter()
        .map(|&i| geometry.gi_profiles[i].memory_slices)
        .sum();
    let instances = items.len() as u32;
    if compute > geometry.compute_slices
        || memory > geometry.memory_slices
        || instances > geometry.max_instances
    {
        return Err(FitError::Totals {
            compute,
            memory,
            instances,
            compute_available: geometry.compute_slices,
            memory_available: geometry.memory_slices,
            instances_available: geometry.max_instances,
        });
    }
    let ofa: Vec<String> = items
        .iter()
        .filter(|&&i| geometry.gi_profiles[i].media.ofa > 0)
        .map(|&i| geometry.gi_profiles[i].name.to_string())
        .collect();
    let ofa_used: u32 = items
        .iter()
        .map(|&i| geometry.gi_profiles[i].media.ofa)
        .sum();
    if ofa_used > geometry.ofa_engines {
        return Err(FitError::MediaEngines {
            message: format!(
                "{} each hold an optical-flow engine, but this GPU has {}",
                ofa.join(", "),
                geometry.ofa_engines
            ),
        });
    }
    let variant = |i: usize| geometry.gi_profiles[i].media_variant();
    if let Some(&m) = items.iter().find(|&&i| variant(i) == MediaVariant::MeAll) {
        let others: Vec<String> = items
            .iter()
            .filter(|&&i| variant(i) != MediaVariant::NoMe)
            .map(|&i| geometry.gi_profiles[i].name.to_string())
            .collect();
        if others.len() > 1 {
            return Err(FitError::MediaEngines {
                message: format!(
                    "{} takes all media engines, so every other instance must be a -me profile (got {})",
                    geometry.gi_profiles[m].name,
                    others.join(", ")
                ),
            });
        }
    }
    Ok(())
}

fn describe(geometry: &MigGeometry, items: &[usize]) -> String {
    let mut parts: Vec<(String, u32)> = Vec::new();
    for &i in items {
        let n = geometry.gi_profiles[i].name.to_string();
        match parts.iter_mut().find(|(p, _)| *p == n) {
            Some((_, c)) => *c += 1,
            None => parts.push((n, 1)),
        }
    }
    parts
        .iter()
        .map(|(p, c)| format!("{p}={c}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Finds explicit placements for a multiset of profiles, or proves none exist.
/// The answer depends only on the multiset, not on the order it is given in.
pub fn fit(geometry: &MigGeometry, demand: &Demand) -> Result<Vec<PlacedInstance>, FitError> {
    let compiled = Compiled::new(geometry).map_err(|e| FitError::Geometry {
        message: e.to_string(),
    })?;
    let items = expand_demand(geometry, demand)?;
    precheck(geometry, &items)?;
    let mut chosen = Vec::with_capacity(items.len());
    let mut tried = 0u64;
    if fit_dfs(
        &compiled,
        &items,
        0,
        &State::EMPTY,
        0,
        &mut chosen,
        &mut tried,
    ) {
        Ok(chosen
            .iter()
            .map(|&c: &usize| to_instance(geometry, &compiled.cands[c]))
            .collect())
    } else {
        Err(FitError::NoPlacement {
            request: describe(geometry, &items),
            tried,
        })
    }
}

fn fit_dfs(
    c: &Compiled,
    items: &[usize],
    k: usize,
    st: &State,
    min_cand: usize,
    chosen: &mut Vec<usize>,
    tried: &mut u64,
) -> bool {
    if k == items.len() {
        return true;
    }
    let prof = items[k];
    let p = &c.profs[prof];
    // Identical consecutive items take increasing placements (symmetry).
    let from = if k > 0 && items[k - 1] == prof {
        min_cand
    } else {
        p.cand_from
    };
    for ci in from..p.cand_to {
        let cand = c.cands[ci];
        *tried += 1;
        if c.can_add(st, prof, cand.mask) {
            let next = c.add(st, prof, cand.mask);
            chosen.push(ci);
            if fit_dfs(c, items, k + 1, &next, ci + 1, chosen, tried) {
                return true;
            }
            chosen.pop();
        }
    }
    false
}

pub(crate) fn to_instance(geometry: &MigGeometry, cand: &Cand) -> PlacedInstance {
    PlacedInstance {
        profile: geometry.gi_profiles[usize::from(cand.prof)].name.clone(),
        start: u32::from(cand.start),
    }
}

/// Why layouts cannot be enumerated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnumerateError {
    /// A requested profile does not exist on this GPU.
    #[error("profile {profile} does not exist on this GPU (profiles: {available})")]
    UnknownProfile {
        /// Profile name.
        profile: String,
        /// Profiles that do exist.
        available: String,
    },
    /// The geometry itself is unusable.
    #[error(transparent)]
    Geometry(#[from] GeometryError),
}

fn selected_cands(
    geometry: &MigGeometry,
    compiled: &Compiled,
    profiles: Option<&[MigProfileName]>,
) -> Result<Vec<Cand>, EnumerateError> {
    let Some(profiles) = profiles else {
        return Ok(compiled.cands.clone());
    };
    let mut wanted = vec![false; geometry.gi_profiles.len()];
    for name in profiles {
        let idx = geometry
            .resolve_index(name)
            .ok_or_else(|| EnumerateError::UnknownProfile {
                profile: name.to_string(),
                available: geometry.profile_list(),
            })?;
        wanted[idx] = true;
    }
    Ok(compiled
        .cands
        .iter()
        .filter(|c| wanted[usize::from(c.prof)])
        .copied()
        .collect())
}

/// Every valid non-empty layout using only `profiles` (all profiles when
/// `None`), each sorted by profile order then start.
pub fn enumerate_layouts(
    geometry: &MigGeometry,
    profiles: Option<&[MigProfileName]>,
) -> Result<Vec<Vec<PlacedInstance>>, EnumerateError> {
    enumerate(geometry, profiles, false)
}

/// Every valid layout using only `profiles` to which no further instance of
/// those profiles can be added.
pub fn enumerate_maximal_layouts(
    geometry: &MigGeometry,
    profiles: Option<&[MigProfileName]>,
) -> Result<Vec<Vec<PlacedInstance>>, EnumerateError> {
    enumerate(geometry, profiles, true)
}

fn enumerate(
    geometry: &MigGeometry,
    profiles: Option<&[MigProfileName]>,
    maximal: bool,
) -> Result<Vec<Vec<PlacedInstance>>, EnumerateError> {
    let compiled = Compiled::new(geometry)?;
    let cands = selected_cands(geometry, &compiled, profiles)?;
    let insts: Vec<PlacedInstance> = cands.iter().map(|c| to_instance(geometry, c)).collect();
    if cands.len() > 64 {
        let mut out = Vec::new();
        enum_dfs(
            &compiled,
            &cands,
            0,
            &State::EMPTY,
            &mut Vec::new(),
            maximal,
            &mut |layout: &[usize]| out.push(layout.iter().map(|&i| insts[i].clone()).collect()),
        );
        return Ok(out);
    }
    // A layout as the set of its candidates' indices, expanded in index order.
    let expand = |set: u64| -> Vec<PlacedInstance> {
        let mut layout = Vec::with_capacity(set.count_ones() as usize);
        let mut rest = set;
        while rest != 0 {
            layout.push(insts[rest.trailing_zeros() as usize].clone());
            rest &= rest - 1;
        }
        layout
    };
    if !maximal {
        // Every node is a layout: search in the output order.
        let bits = CandBits::new(&compiled, cands.clone(), (0..cands.len()).collect());
        let mut out = Vec::new();
        let mut emit = |set| out.push(expand(set));
        let mut walk = Walk::new(&bits, &mut emit);
        bits.dfs(
            &compiled,
            0,
            bits.initial(&compiled),
            &State::EMPTY,
            0,
            false,
            &mut walk,
        );
        return Ok(out);
    }
    // Maximal layouts: search slice by slice (candidates by start), where
    // pruning bites early, then put the layouts in the output order, the
    // lexicographic order of their increasing index sequences. Between two
    // sets, the one holding the lowest index of their symmetric difference
    // comes first: the bit-reversed set is larger.
    let mut order: Vec<usize> = (0..cands.len()).collect();
    order.sort_by_key(|&i| (cands[i].start, cands[i].prof));
    let search_cands = order.iter().map(|&i| cands[i]).collect();
    let bits = CandBits::new(&compiled, search_cands, order);
    let mut found: Vec<u64> = Vec::new();
    let mut emit = |set: u64| found.push(set.reverse_bits());
    let mut walk = Walk::new(&bits, &mut emit);
    bits.dfs(
        &compiled,
        0,
        bits.initial(&compiled),
        &State::EMPTY,
        0,
        true,
        &mut walk,
    );
    found.sort_unstable_by(|a, b| b.cmp(a));
    Ok(found
        .iter()
        .map(|&key| expand(key.reverse_bits()))
        .collect())
}

/// Scratch space and output of one bit-set search.
struct Walk<'e> {
    /// Interval packing table of [`CandBits::most_added`], reused across nodes.
    best: Vec<(u64, u64)>,
    /// Receives each layout as a set of output-order candidate indices.
    emit: &'e mut dyn FnMut(u64),
}

impl<'e> Walk<'e> {
    fn new(bits: &CandBits, emit: &'e mut dyn FnMut(u64)) -> Walk<'e> {
        Walk {
            best: vec![(0, 0); bits.starting_at.len() + 1],
            emit,
        }
    }
}

/// The candidates of an enumeration as bit sets (bit `i` is `cands[i]`), so
/// the set of candidates that can still join a layout is updated with a few
/// mask operations per added instance instead of re-checking every rule for
/// every candidate. Used when there are at most 64 candidates (every shipping
/// GPU); [`enum_dfs`] handles the rest.
struct CandBits {
    /// The candidates, in search order.
    cands: Vec<Cand>,
    /// Per candidate: its bit in the output order.
    out_bit: Vec<u64>,
    /// Whether `cands` are in order of start.
    by_start: bool,
    /// Per candidate: one past its last memory slice.
    end: Vec<usize>,
    /// Per candidate: its compute slices.
    compute: Vec<u32>,
    /// Per memory slice: the candidates starting there.
    starting_at: Vec<u64>,
    /// Per candidate: the candidates sharing a memory slice with it (itself included).
    overlap: Vec<u64>,
    /// Per profile index: its candidates.
    of_prof: Vec<u64>,
    /// `[k]`: candidates using at most `k` compute slices (last entry: all).
    compute_fit: Vec<u64>,
    /// `[k]`: candidates holding at most `k` optical-flow engines (last entry: all).
    ofa_fit: Vec<u64>,
    /// Candidates of `+me.all` profiles.
    me_all: u64,
    /// Candidates of profiles that are not `-me`.
    not_no_me: u64,
    /// Per candidate: the candidates whose addition can make it unaddable
    /// through a rule other than the GPU-wide totals (memory, per-profile
    /// maximum, media-engine rules, optical-flow budget). A per-profile
    /// maximum of at least the GPU's instance limit is left out: reaching it
    /// means reaching the instance limit, which the totals bound covers.
    related: Vec<u64>,
}

impl CandBits {
    /// Bit sets for at most 64 candidates (the caller checks), in search
    /// order; `out_index[i]` is candidate `i`'s index in the output order.
    fn new(c: &Compiled, cands: Vec<Cand>, out_index: Vec<usize>) -> CandBits {
        let bit = |i: usize| 1u64 << i;
        let mut of_prof = vec![0u64; c.profs.len()];
        let (mut me_all, mut not_no_me, mut ofa_holders) = (0u64, 0u64, 0u64);
        let (mut max_compute, mut max_ofa, mut axis) = (0u32, 0u32, 0usize);
        let mut end = Vec::with_capacity(cands.len());
        let mut compute = Vec::with_capacity(cands.len());
        for (i, cand) in cands.iter().enumerate() {
            let p = &c.profs[usize::from(cand.prof)];
            of_prof[usize::from(cand.prof)] |= bit(i);
            if p.me_all {
                me_all |= bit(i);
            }
            if !p.no_me {
                not_no_me |= bit(i);
            }
            if p.ofa > 0 {
                ofa_holders |= bit(i);
            }
            max_compute = max_compute.max(p.compute);
            max_ofa = max_ofa.max(p.ofa);
            // Masks are contiguous runs (a checked geometry has no empty placement).
            let e = 64 - cand.mask.leading_zeros() as usize;
            axis = axis.max(e);
            end.push(e);
            compute.push(p.compute);
        }
        let mut starting_at = vec![0u64; axis];
        for (i, cand) in cands.iter().enumerate() {
            starting_at[cand.mask.trailing_zeros() as usize] |= bit(i);
        }
        let fit = |limit: u32, value: &dyn Fn(&Prof) -> u32| -> Vec<u64> {
            (0..=limit)
                .map(|k| {
                    cands
                        .iter()
                        .enumerate()
                        .filter(|(_, cand)| value(&c.profs[usize::from(cand.prof)]) <= k)
                        .fold(0u64, |m, (i, _)| m | bit(i))
                })
                .collect()
        };
        let compute_fit = fit(max_compute, &|p| p.compute);
        let ofa_fit = fit(max_ofa, &|p| p.ofa);
        let overlap: Vec<u64> = cands
            .iter()
            .map(|a| {
                cands
                    .iter()
                    .enumerate()
                    .filter(|(_, b)| a.mask & b.mask != 0)
                    .fold(0u64, |m, (i, _)| m | bit(i))
            })
            .collect();
        let related = cands
            .iter()
            .enumerate()
            .map(|(i, cand)| {
                let p = &c.profs[usize::from(cand.prof)];
                let mut r = overlap[i];
                if p.max < c.max_instances {
                    r |= of_prof[usize::from(cand.prof)];
                }
                if p.me_all {
                    r |= not_no_me;
                } else if !p.no_me {
                    r |= me_all;
                }
                if p.ofa > 0 {
                    r |= ofa_holders;
                }
                r
            })
            .collect();
        let by_start = cands.windows(2).all(|w| w[0].start <= w[1].start);
        CandBits {
            cands,
            out_bit: out_index.iter().map(|&i| bit(i)).collect(),
            by_start,
            end,
            compute,
            starting_at,
            overlap,
            of_prof,
            compute_fit,
            ofa_fit,
            me_all,
            not_no_me,
            related,
        }
    }

    /// Candidates that can form a layout on their own.
    fn initial(&self, c: &Compiled) -> u64 {
        self.cands
            .iter()
            .enumerate()
            .filter(|(_, cand)| c.can_add(&State::EMPTY, usize::from(cand.prof), cand.mask))
            .fold(0u64, |m, (i, _)| m | (1u64 << i))
    }

    /// `addable` (the candidates that could join the layout before candidate
    /// `i` was added) narrowed to those that can still join `st`, the state
    /// after adding it. Every rule is monotone, so nothing is ever re-added.
    #[inline]
    fn after(&self, c: &Compiled, addable: u64, i: usize, st: &State) -> u64 {
        if st.n >= c.max_instances {
            return 0;
        }
        let prof = usize::from(self.cands[i].prof);
        let p = &c.profs[prof];
        let mut a = addable & !self.overlap[i];
        if u32::from(st.counts[prof]) >= p.max {
            a &= !self.of_prof[prof];
        }
        let compute_left = c.compute_slices.saturating_sub(st.compute) as usize;
        a &= self.compute_fit[compute_left.min(self.compute_fit.len() - 1)];
        let ofa_left = c.ofa_engines.saturating_sub(st.ofa) as usize;
        a &= self.ofa_fit[ofa_left.min(self.ofa_fit.len() - 1)];
        if p.me_all {
            a &= !self.not_no_me;
        } else if !p.no_me {
            a &= !self.me_all;
        }
        a
    }

    /// Upper bounds on the compute slices and on the instances that any
    /// set of disjoint candidates from `future` adds: the best packing of
    /// those intervals on the memory-slice axis, ignoring every other rule.
    #[inline]
    fn most_added(&self, future: u64, best: &mut [(u64, u64)]) -> (u64, u64) {
        let axis = self.starting_at.len();
        // In start order the lowest future candidate starts lowest.
        let lo = if self.by_start && future != 0 {
            self.cands[future.trailing_zeros() as usize].start as usize
        } else {
            0
        };
        // best[s]: most (compute, instances) using slices at or after s.
        best[axis] = (0, 0);
        for s in (lo..axis).rev() {
            let (mut bc, mut bn) = best[s + 1];
            let mut m = self.starting_at[s] & future;
            while m != 0 {
                let k = m.trailing_zeros() as usize;
                m &= m - 1;
                let (ec, en) = best[self.end[k]];
                bc = bc.max(ec + u64::from(self.compute[k]));
                bn = bn.max(en + 1);
            }
            best[s] = (bc, bn);
        }
        best[lo.min(axis)]
    }

    /// The highest candidate index a child of this node may take if a
    /// maximal layout is to lie below it, or `None` when none can.
    ///
    /// Every candidate that is still addable must be blocked by the time the
    /// layout is complete, and instances added below this node come from
    /// `future`. A candidate the GPU-wide totals cannot block any more
    /// ("needy") needs a later instance among its `related` candidates;
    /// choosing a child past the last of those skips it for good.
    #[inline]
    fn child_limit(
        &self,
        c: &Compiled,
        st: &State,
        addable: u64,
        future: u64,
        best: &mut [(u64, u64)],
    ) -> Option<usize> {
        let (most_compute, most_instances) = self.most_added(future, best);
        if u64::from(st.n) + 1 + most_instances > u64::from(c.max_instances) {
            // The instance limit may still block anything.
            return Some(usize::MAX);
        }
        let used = u64::from(st.compute) + most_compute;
        let Some(room) = u64::from(c.compute_slices).checked_sub(used) else {
            return Some(usize::MAX);
        };
        let room = room.min(self.compute_fit.len() as u64 - 1) as usize;
        let mut needy = addable & self.compute_fit[room];
        let mut limit = usize::MAX;
        while needy != 0 {
            let k = needy.trailing_zeros() as usize;
            needy &= needy - 1;
            let blockers = self.related[k] & future;
            if blockers == 0 {
                return None;
            }
            limit = limit.min(63 - blockers.leading_zeros() as usize);
        }
        Some(limit)
    }

    /// Depth-first search over the candidates in index order; each layout is
    /// reached once, as an increasing index sequence. With `maximal`, only
    /// layouts that admit no further candidate are emitted, and branches
    /// that cannot lead to one are cut.
    #[allow(clippy::too_many_arguments)]
    fn dfs(
        &self,
        c: &Compiled,
        from: usize,
        addable: u64,
        st: &State,
        chosen: u64,
        maximal: bool,
        walk: &mut Walk,
    ) {
        let below = if from >= 64 {
            u64::MAX
        } else {
            (1u64 << from) - 1
        };
        let mut rest = addable & !below;
        if maximal {
            if addable == 0 {
                if chosen != 0 {
                    (walk.emit)(chosen);
                }
                return;
            }
            match self.child_limit(c, st, addable, rest, &mut walk.best) {
                None => return,
                Some(limit) if limit < 63 => rest &= (2u64 << limit) - 1,
                Some(_) => {}
            }
        } else if chosen != 0 {
            (walk.emit)(chosen);
        }
        while rest != 0 {
            let i = rest.trailing_zeros() as usize;
            rest &= rest - 1;
            let cand = self.cands[i];
            let next = c.add(st, usize::from(cand.prof), cand.mask);
            let next_addable = self.after(c, addable, i, &next);
            let next_chosen = chosen | self.out_bit[i];
            self.dfs(c, i + 1, next_addable, &next, next_chosen, maximal, walk);
        }
    }
}

/// Straightforward enumeration: at every node, every candidate is checked
/// with every rule. The reference the bit-set search is tested against, and
/// the search for geometries with more than 64 candidates.
fn enum_dfs(
    c: &Compiled,
    cands: &[Cand],
    from: usize,
    st: &State,
    chosen: &mut Vec<usize>,
    maximal: bool,
    emit: &mut dyn FnMut(&[usize]),
) {
    if !chosen.is_empty() {
        if !maximal {
            emit(chosen);
        } else if !cands
            .iter()
            .any(|cand| c.can_add(st, usize::from(cand.prof), cand.mask))
        {
            emit(chosen);
            return;
        }
    }
    for i in from..cands.len() {
        let cand = cands[i];
        let prof = usize::from(cand.prof);
        if c.can_add(st, prof, cand.mask) {
            let next = c.add(st, prof, cand.mask);
            chosen.push(i);
            enum_dfs(c, cands, i + 1, &next, chosen, maximal, emit);
            chosen.pop();
        }
    }
}

/// A reconfiguration of one GPU: what to keep, destroy and create, at
/// explicit placements.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Reconfiguration {
    /// The layout after the change.
    pub target: Vec<PlacedInstance>,
    /// Current instances left untouched.
    pub keep: Vec<PlacedInstance>,
    /// Current instances to destroy (destroy these first).
    pub destroy: Vec<PlacedInstance>,
    /// Instances to create with `CreateGpuInstanceWithPlacement`.
    pub create: Vec<PlacedInstance>,
}

fn resolve_current(
    geometry: &MigGeometry,
    compiled: &Compiled,
    current: &[PlacedInstance],
) -> Result<Vec<(usize, usize)>, FitError> {
    current
        .iter()
        .map(|inst| {
            let prof =
                geometry
                    .resolve_index(&inst.profile)
                    .ok_or_else(|| FitError::InvalidCurrent {
                        message: format!("{inst}: unknown profile"),
                    })?;
            let cand =
                compiled
                    .cand_at(prof, inst.start)
                    .ok_or_else(|| FitError::InvalidCurrent {
                        message: format!("{inst}: start is not an allowed placement"),
                    })?;
            Ok((prof, cand))
        })
        .collect()
}

/// Target placements for a multiset that keep as many `current` instances as
/// possible, with the (destroy, create) diff. Deterministic.
pub fn reconfigure(
    geometry: &MigGeometry,
    current: &[PlacedInstance],
    target: &Demand,
) -> Result<Reconfiguration, FitError> {
    let compiled = Compiled::new(geometry).map_err(|e| FitError::Geometry {
        message: e.to_string(),
    })?;
    let items = expand_demand(geometry, target)?;
    precheck(geometry, &items)?;
    let cur = resolve_current(geometry, &compiled, current)?;
    let mut is_current = vec![false; compiled.cands.len()];
    for &(_, cand) in &cur {
        is_current[cand] = true;
    }
    let mut best: Option<(usize, Vec<usize>)> = None;
    let mut chosen = Vec::new();
    let mut tried = 0u64;
    keep_dfs(
        &compiled,
        &items,
        &is_current,
        0,
        &State::EMPTY,
        0,
        0,
        &mut chosen,
        &mut best,
        &mut tried,
    );
    let Some((_, cands)) = best else {
        return Err(FitError::NoPlacement {
            request: describe(geometry, &items),
            tried,
        });
    };
    let mut target_layout: Vec<PlacedInstance> = cands
        .iter()
        .map(|&c| to_instance(geometry, &compiled.cands[c]))
        .collect();
    target_layout.sort();
    Ok(diff(current, target_layout))
}

#[allow(clippy::too_many_arguments)]
fn keep_dfs(
    c: &Compiled,
    items: &[usize],
    is_current: &[bool],
    k: usize,
    st: &State,
    min_cand: usize,
    kept: usize,
    chosen: &mut Vec<usize>,
    best: &mut Option<(usize, Vec<usize>)>,
    tried: &mut u64,
) {
    if let Some((b, _)) = best
        && (kept + (items.len() - k) <= *b)
    {
        return;
    }
    if k == items.len() {
        *best = Some((kept, chosen.clone()));
        return;
    }
    let prof = items[k];
    let p = &c.profs[prof];
    let from = if k > 0 && items[k - 1] == prof {
        min_cand
    } else {
        p.cand_from
    };
    // Current placements first, so a good answer is found early.
    for pass in [true, false] {
        for ci in from..p.cand_to {
            if is_current[ci] != pass {
                continue;
            }
            let cand = c.cands[ci];
            *tried += 1;
            if c.can_add(st, prof, cand.mask) {
                let next = c.add(st, prof, cand.mask);
                chosen.push(ci);
                keep_dfs(
                    c,
                    items,
                    is_current,
                    k + 1,
                    &next,
                    ci + 1,
                    kept + usize::from(pass),
                    chosen,
                    best,
                    tried,
                );
                chosen.pop();
            }
        }
    }
}

fn diff(current: &[PlacedInstance], target: Vec<PlacedInstance>) -> Reconfiguration {
    let keep: Vec<PlacedInstance> = target
        .iter()
        .filter(|t| current.contains(t))
        .cloned()
        .collect();
    let mut destroy: Vec<PlacedInstance> = current
        .iter()
        .filter(|c| !target.contains(c))
        .cloned()
        .collect();
    destroy.sort();
    let create = target
        .iter()
        .filter(|t| !current.contains(t))
        .cloned()
        .collect();
    Reconfiguration {
        target,
        keep,
        destroy,
        create,
    }
}

/// The (destroy, create) diff from `current` to an explicit `target` layout,
/// after checking the target is valid.
pub fn reconfigure_to_layout(
    geometry: &MigGeometry,
    current: &[PlacedInstance],
    target: &[PlacedInstance],
) -> Result<Reconfiguration, Vec<super::validate::Violation>> {
    super::validate::validate(geometry, target)?;
    let mut t = target.to_vec();
    t.sort();
    Ok(diff(current, t))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog;
    use proptest::prelude::*;

    fn mig_geometries() -> Vec<&'static MigGeometry> {
        catalog::models()
            .iter()
            .filter_map(|m| m.mig.as_ref())
            .collect()
    }

    /// Enumeration with the straightforward search only.
    fn reference(
        geometry: &MigGeometry,
        profiles: Option<&[MigProfileName]>,
        maximal: bool,
    ) -> Vec<Vec<PlacedInstance>> {
        let compiled = Compiled::new(geometry).unwrap();
        let cands = selected_cands(geometry, &compiled, profiles).unwrap();
        let mut out = Vec::new();
        enum_dfs(
            &compiled,
            &cands,
            0,
            &State::EMPTY,
            &mut Vec::new(),
            maximal,
            &mut |layout: &[usize]| {
                out.push(
                    layout
                        .iter()
                        .map(|&i| to_instance(geometry, &cands[i]))
                        .collect(),
                )
            },
        );
        out
    }

    #[test]
    fn every_catalog_geometry_uses_the_bit_set_search() {
        for g in mig_geometries() {
            let compiled = Compiled::new(g).unwrap();
            assert!(compiled.cands.len() <= 64);
        }
    }

    #[test]
    fn catalog_enumerations_match_the_reference() {
        for g in mig_geometries() {
            for maximal in [false, true] {
                let fast = enumerate(g, None, maximal).unwrap();
                assert_eq!(fast, reference(g, None, maximal));
            }
        }
    }

    #[test]
    fn a_count_of_u32_max_is_refused_with_the_maximum() {
        let g = catalog::lookup("H100-SXM5-80GB")
            .unwrap()
            .mig
            .as_ref()
            .unwrap();
        let demand = crate::mig::parse_demand("1g.10gb=4294967295").unwrap();
        let e = fit(g, &demand).unwrap_err();
        assert_eq!(
            e,
            FitError::CountAboveMaximum {
                profile: "1g.10gb".into(),
                count: u32::MAX,
                max: 7
            }
        );
        let msg = e.to_string();
        assert!(
            msg.contains("4294967295") && msg.contains("at most 7"),
            "{msg}"
        );
        let ci = crate::mig::parse_demand("1c.7g.80gb=4294967295").unwrap();
        assert!(matches!(
            reconfigure(g, &[], &ci),
            Err(FitError::CountAboveMaximum { max: 7, .. })
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Any count above what one GPU holds is refused by `check_demand`,
        /// `fit` and `reconfigure` alike, naming the profile, count and maximum,
        /// before anything is sized by the count (counts up to u32::MAX).
        #[test]
        fn counts_above_the_maximum_are_refused(
            model in any::<prop::sample::Index>(),
            profile in any::<prop::sample::Index>(),
            excess in 1u32..=u32::MAX,
            compute in any::<bool>(),
        ) {
            let g = *model.get(&mig_geometries());
            let p = profile.get(&g.gi_profiles);
            let (name, max) = if compute {
                (p.name.clone().with_compute(1), p.max_instances * p.compute_slices)
            } else {
                (p.name.clone(), p.max_instances)
            };
            let count = max.saturating_add(excess);
            prop_assume!(count > max);
            let demand = vec![(name.clone(), count)];
            let want = FitError::CountAboveMaximum { profile: name.to_string(), count, max };
            prop_assert_eq!(check_demand(g, &demand), Err(want.clone()));
            prop_assert_eq!(fit(g, &demand), Err(want.clone()));
            prop_assert_eq!(reconfigure(g, &[], &demand).map(|_| ()), Err(want));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// On catalog geometries with tightened totals, budgets and
        /// per-profile maxima, and random profile subsets, the bit-set search
        /// returns exactly the reference's layouts in the same order.
        #[test]
        fn bit_set_enumeration_matches_reference(
            model in any::<prop::sample::Index>(),
            subset in any::<u32>(),
            compute_cut in 0u32..4,
            instance_cut in 0u32..4,
            ofa in 0u32..3,
            max_cuts in prop::collection::vec(0u32..3, 32),
            maximal in any::<bool>(),
        ) {
            let mut g = (*model.get(&mig_geometries())).clone();
            g.compute_slices = g.compute_slices.saturating_sub(compute_cut).max(1);
            g.max_instances = g.max_instances.saturating_sub(instance_cut).max(1);
            g.ofa_engines = ofa;
            for (p, cut) in g.gi_profiles.iter_mut().zip(&max_cuts) {
                p.max_instances = p.max_instances.saturating_sub(*cut);
            }
            let names: Vec<MigProfileName> = g
                .gi_profiles
                .iter()
                .enumerate()
                .filter(|(i, _)| subset & (1 << i) != 0)
                .map(|(_, p)| p.name.clone())
                .collect();
            let profiles = if subset % 3 == 0 { None } else { Some(names.as_slice()) };
            let fast = enumerate(&g, profiles, maximal).unwrap();
            prop_assert_eq!(fast, reference(&g, profiles, maximal));
        }
    }
}
