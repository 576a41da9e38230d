//! Validation of a placed layout against a GPU's geometry (reference/mig.md §4):
//! R1 allowed placements, R2 no overlap, R3 per-profile maximum, R4 totals,
//! R5 (optional) the pre-R510 4g+3g restriction, R6 the optical-flow budget,
//! R7 `+me.all` exclusivity.

use std::fmt;

use serde::Serialize;

use super::geometry::{MigGeometry, PlacedInstance};
use super::name::MediaVariant;

/// Driver-dependent switches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ValidateOptions {
    /// Forbid a 4g and a 3g instance together, as drivers before R510 did.
    pub pre_r510_driver: bool,
}

/// One broken rule, naming the instances involved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "rule", rename_all = "kebab-case")]
pub enum Violation {
    /// The profile does not exist on this GPU.
    UnknownProfile {
        /// The instance.
        instance: PlacedInstance,
        /// Profiles that do exist.
        available: String,
    },
    /// A compute-instance name was given where a GPU instance is placed.
    NotGpuInstance {
        /// The instance.
        instance: PlacedInstance,
    },
    /// R1: the start is not one of the profile's placements.
    PlacementNotAllowed {
        /// The instance.
        instance: PlacedInstance,
        /// Allowed starts.
        allowed_starts: Vec<u32>,
    },
    /// R2: two instances share memory slices.
    Overlap {
        /// First instance.
        first: PlacedInstance,
        /// Second instance.
        second: PlacedInstance,
        /// First shared slice.
        from: u32,
        /// One past the last shared slice.
        to: u32,
    },
    /// One instance overlaps several others (only the first
    /// [`crate::echo::MAX_LIST_ITEMS`] are named).
    OverlapsMany {
        /// The instance.
        instance: PlacedInstance,
        /// How many later instances (in canonical order) it overlaps.
        count: usize,
        /// The first of them.
        others: Vec<PlacedInstance>,
    },
    /// More instances overlap others than are reported one by one.
    MoreOverlaps {
        /// Instances with overlaps that were not reported.
        instances: usize,
    },
    /// More instances than the GPU can hold at all: refused before any
    /// rule is checked pair by pair.
    TooManyInstances {
        /// Instances in the layout.
        count: usize,
        /// Most GPU instances of the GPU.
        max_instances: u32,
        /// Memory slices of the GPU (each instance takes at least one).
        memory_slices: u32,
    },
    /// R3: more instances of a profile than the GPU allows.
    TooManyOfProfile {
        /// Profile name.
        profile: String,
        /// Allowed.
        max: u32,
        /// The instances of that profile.
        instances: Vec<PlacedInstance>,
    },
    /// R4: compute slices or instance count exceed the GPU.
    TotalsExceeded {
        /// Compute slices used.
        compute_used: u32,
        /// Compute slices available.
        compute_available: u32,
        /// Instances.
        instance_count: u32,
        /// Instances allowed.
        max_instances: u32,
    },
    /// R5: 4g and 3g together on a pre-R510 driver.
    FourPlusThreeOnOldDriver {
        /// The 4g instance.
        four: PlacedInstance,
        /// The 3g instance.
        three: PlacedInstance,
    },
    /// R6: more optical-flow-holding instances than the GPU has OFAs.
    MediaEnginesExceeded {
        /// OFAs of the GPU.
        available: u32,
        /// Instances holding one.
        instances: Vec<PlacedInstance>,
    },
    /// R7: a `+me.all` instance with another instance that is not `-me`.
    MeAllNotExclusive {
        /// The `+me.all` instance.
        me_all: PlacedInstance,
        /// Instances that are not `-me`.
        others: Vec<PlacedInstance>,
    },
}

/// Most overlap lines one validation reports; the rest are counted.
pub const MAX_OVERLAP_LINES: usize = 20;

fn list(v: &[PlacedInstance]) -> String {
    crate::echo::join_capped(v)
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::UnknownProfile {
                instance,
                available,
            } => write!(
                f,
                "{instance}: profile {} does not exist on this GPU (profiles: {available})",
                instance.profile
            ),
            Violation::NotGpuInstance { instance } => write!(
                f,
                "{instance}: {} is a compute-instance profile; place its GPU instance {} instead",
                instance.profile,
                instance.profile.gpu_instance()
            ),
            Violation::PlacementNotAllowed {
                instance,
                allowed_starts,
            } => write!(
                f,
                "{instance}: {} cannot start at slice {} (allowed starts: {:?})",
                instance.profile, instance.start, allowed_starts
            ),
            Violation::Overlap {
                first,
                second,
                from,
                to,
            } => {
                if to - from == 1 {
                    write!(f, "{first} and {second} overlap on memory slice {from}")
                } else {
                    write!(
                        f,
                        "{first} and {second} overlap on memory slices {from}-{}",
                        to - 1
                    )
                }
            }
            Violation::OverlapsMany {
                instance,
                count,
                others,
            } => {
                write!(
                    f,
                    "{instance} overlaps {count} other instances: {}",
                    list(others)
                )?;
                if *count > others.len() {
                    write!(f, ", ... and {} more", count - others.len())?;
                }
                Ok(())
            }
            Violation::MoreOverlaps { instances } => write!(
                f,
                "{instances} more instances overlap others (not listed; fix the overlaps above first)"
            ),
            Violation::TooManyInstances {
                count,
                max_instances,
                memory_slices,
            } => write!(
                f,
                "layout has {count} instances, but this GPU holds at most {} ({max_instances} instances on {memory_slices} memory slices); remove instances",
                instance_bound(*max_instances, *memory_slices)
            ),
            Violation::TooManyOfProfile {
                profile,
                max,
                instances,
            } => write!(
                f,
                "{} instances of {profile} ({}), at most {max} allowed",
                instances.len(),
                list(instances)
            ),
            Violation::TotalsExceeded {
                compute_used,
                compute_available,
                instance_count,
                max_instances,
            } => write!(
                f,
                "layout uses {compute_used} of {compute_available} compute slices with {instance_count} instances (at most {max_instances})"
            ),
            Violation::FourPlusThreeOnOldDriver { four, three } => write!(
                f,
                "{four} and {three}: a 4g and a 3g instance together need an R510 or newer driver"
            ),
            Violation::MediaEnginesExceeded {
                available,
                instances,
            } => write!(
                f,
                "{} hold an optical-flow engine each, but the GPU has {available}",
                list(instances)
            ),
            Violation::MeAllNotExclusive { me_all, others } => write!(
                f,
                "{me_all} takes all media engines, so only -me instances may coexist; not -me: {}",
                list(others)
            ),
        }
    }
}

/// Validates a layout on a modern (R510+) driver.
pub fn validate(geometry: &MigGeometry, layout: &[PlacedInstance]) -> Result<(), Vec<Violation>> {
    validate_with(geometry, layout, ValidateOptions::default())
}

/// Validates a layout. The verdict does not depend on the order of `layout`;
/// violations are reported in a canonical order.
pub fn validate_with(
    geometry: &MigGeometry,
    layout: &[PlacedInstance],
    options: ValidateOptions,
) -> Result<(), Vec<Violation>> {
    if quick_valid(geometry, layout, options) {
        return Ok(());
    }
    let bound = instance_bound(geometry.max_instances, geometry.memory_slices);
    if layout.len() as u64 > u64::from(bound) {
        return Err(vec![Violation::TooManyInstances {
            count: layout.len(),
            max_instances: geometry.max_instances,
            memory_slices: geometry.memory_slices,
        }]);
    }
    let mut sorted = layout.to_vec();
    sorted.sort();
    let violations = collect(geometry, &sorted, options);
    if violations.is_empty() {
        Ok(())
    } else {
        Err(violations)
    }
}

/// Most instances any valid layout can have: every instance takes at least
/// one memory slice of an axis of at most 64, and the GPU caps the count.
fn instance_bound(max_instances: u32, memory_slices: u32) -> u32 {
    max_instances.min(memory_slices).min(64)
}

/// Allocation-free check of the common case: every rule holds.
///
/// Returns `false` whenever it cannot prove the layout valid (including
/// malformed geometries); the caller then runs the full rule-by-rule check,
/// which decides and explains. Per instance it resolves the profile (trying the
/// previous instance's profile first), tests the start against a bit mask of
/// allowed starts and the slices against an occupancy mask; per-profile totals
/// are summed once per distinct profile at the end.
fn quick_valid(
    geometry: &MigGeometry,
    layout: &[PlacedInstance],
    options: ValidateOptions,
) -> bool {
    let profiles = &geometry.gi_profiles;
    if geometry.memory_slices > 64
        || profiles.len() > 32
        || layout.len() as u64 > u64::from(geometry.max_instances)
    {
        return false;
    }
    let mut occupied = 0u64;
    let mut counts = [0u32; 32];
    // Allowed-start masks, filled in for a profile when it is first seen.
    let mut starts = [0u64; 32];
    let mut seen = 0u32;
    let mut last = usize::MAX;
    for inst in layout {
        let name = &inst.profile;
        if name.has_explicit_compute() && !name.is_gpu_instance() {
            return false;
        }
        let idx = match profiles.get(last) {
            Some(p) if p.name.same_gpu_instance(name) => last,
            _ => match geometry.resolve_index(name) {
                Some(i) => i,
                None => return false,
            },
        };
        last = idx;
        let p = &profiles[idx];
        if seen & (1 << idx) == 0 {
            seen |= 1 << idx;
            starts[idx] = start_mask(p.placements.iter().map(|pl| pl.start), p.memory_slices);
        }
        if inst.start >= 64 || (starts[idx] >> inst.start) & 1 == 0 {
            return false;
        }
        let m = slice_mask(inst.start, p.memory_slices);
        if occupied & m != 0 {
            return false;
        }
        occupied |= m;
        counts[idx] += 1;
    }
    let (mut compute, mut ofa, mut me_all, mut not_no_me) = (0u64, 0u64, 0u64, 0u64);
    let (mut has4, mut has3) = (false, false);
    let mut used = seen;
    while used != 0 {
        let idx = used.trailing_zeros() as usize;
        used &= used - 1;
        let p = &profiles[idx];
        let n = counts[idx];
        if n > p.max_instances {
            return false;
        }
        let n = u64::from(n);
        compute += n * u64::from(p.compute_slices);
        ofa += n * u64::from(p.media.ofa);
        match p.media_variant() {
            MediaVariant::MeAll => {
                me_all += n;
                not_no_me += n;
            }
            MediaVariant::NoMe => {}
            _ => not_no_me += n,
        }
        has4 |= p.compute_slices == 4;
        has3 |= p.compute_slices == 3;
    }
    compute <= u64::from(geometry.compute_slices)
        && ofa <= u64::from(geometry.ofa_engines)
        && (me_all == 0 || not_no_me <= 1)
        && !(options.pre_r510_driver && has4 && has3)
}

/// Bit `s` set for every start `s` whose `size`-slice placement lies inside a
/// 64-slice mask. Starts that do not (only in malformed geometries) are left
/// out, so the quick check defers to the full one.
fn start_mask(starts: impl Iterator<Item = u32>, size: u32) -> u64 {
    starts
        .filter(|&s| s < 64 && u64::from(s) + u64::from(size) <= 64)
        .fold(0u64, |m, s| m | (1u64 << s))
}

pub(crate) fn slice_mask(start: u32, size: u32) -> u64 {
    if size >= 64 {
        return u64::MAX;
    }
    ((1u64 << size) - 1).checked_shl(start).unwrap_or(0)
}

fn collect(
    geometry: &MigGeometry,
    layout: &[PlacedInstance],
    options: ValidateOptions,
) -> Vec<Violation> {
    let mut out = Vec::new();
    // Resolved instances: (instance, profile index).
    let mut resolved = Vec::new();
    for inst in layout {
        if inst.profile.has_explicit_compute() && !inst.profile.is_gpu_instance() {
            out.push(Violation::NotGpuInstance {
                instance: inst.clone(),
            });
            continue;
        }
        match geometry.resolve_index(&inst.profile) {
            None => out.push(Violation::UnknownProfile {
                instance: inst.clone(),
                available: geometry.profile_list(),
            }),
            Some(idx) => {
                let p = &geometry.gi_profiles[idx];
                if !p.placements.iter().any(|pl| pl.start == inst.start) {
                    out.push(Violation::PlacementNotAllowed {
                        instance: inst.clone(),
                        allowed_starts: p.placements.iter().map(|pl| pl.start).collect(),
                    });
                }
                resolved.push((inst, idx));
            }
        }
    }
    // R2: overlap (by the profile's size, even at a disallowed start), one
    // line per instance that overlaps later ones, at most MAX_OVERLAP_LINES.
    let (mut lines, mut left_out) = (0usize, 0usize);
    for (i, (a, ai)) in resolved.iter().enumerate() {
        let a_end = a
            .start
            .saturating_add(geometry.gi_profiles[*ai].memory_slices);
        let hits: Vec<(&PlacedInstance, u32, u32)> = resolved[i + 1..]
            .iter()
            .filter_map(|(b, bi)| {
                let b_end = b
                    .start
                    .saturating_add(geometry.gi_profiles[*bi].memory_slices);
                let from = a.start.max(b.start);
                let to = a_end.min(b_end);
                (from < to).then_some((*b, from, to))
            })
            .collect();
        if hits.is_empty() {
            continue;
        }
        if lines == MAX_OVERLAP_LINES {
            left_out += 1;
            continue;
        }
        lines += 1;
        match hits.as_slice() {
            [(b, from, to)] => out.push(Violation::Overlap {
                first: (*a).clone(),
                second: (*b).clone(),
                from: *from,
                to: *to,
            }),
            _ => out.push(Violation::OverlapsMany {
                instance: (*a).clone(),
                count: hits.len(),
                others: hits
                    .iter()
                    .take(crate::echo::MAX_LIST_ITEMS)
                    .map(|(b, _, _)| (*b).clone())
                    .collect(),
            }),
        }
    }
    if left_out > 0 {
        out.push(Violation::MoreOverlaps {
            instances: left_out,
        });
    }
    // R3: per-profile maximum.
    for (idx, p) in geometry.gi_profiles.iter().enumerate() {
        let of: Vec<PlacedInstance> = resolved
            .iter()
            .filter(|(_, i)| *i == idx)
            .map(|(inst, _)| (*inst).clone())
            .collect();
        if of.len() as u32 > p.max_instances {
            out.push(Violation::TooManyOfProfile {
                profile: p.name.to_string(),
                max: p.max_instances,
                instances: of,
            });
        }
    }
    // R4: totals.
    let compute_used: u32 = resolved
        .iter()
        .map(|(_, i)| geometry.gi_profiles[*i].compute_slices)
        .sum();
    let instance_count = layout.len() as u32;
    if compute_used > geometry.compute_slices || instance_count > geometry.max_instances {
        out.push(Violation::TotalsExceeded {
            compute_used,
            compute_available: geometry.compute_slices,
            instance_count,
            max_instances: geometry.max_instances,
        });
    }
    // R5: 4g + 3g on old drivers.
    if options.pre_r510_driver {
        let find = |g: u32| {
            resolved
                .iter()
                .find(|(_, i)| geometry.gi_profiles[*i].compute_slices == g)
        };
        if let (Some((four, _)), Some((three, _))) = (find(4), find(3)) {
            out.push(Violation::FourPlusThreeOnOldDriver {
                four: (*four).clone(),
                three: (*three).clone(),
            });
        }
    }
    // R6: optical-flow budget.
    let ofa_holders: Vec<PlacedInstance> = resolved
        .iter()
        .filter(|(_, i)| geometry.gi_profiles[*i].media.ofa > 0)
        .map(|(inst, _)| (*inst).clone())
        .collect();
    let ofa_used: u32 = resolved
        .iter()
        .map(|(_, i)| geometry.gi_profiles[*i].media.ofa)
        .sum();
    if ofa_used > geometry.ofa_engines {
        out.push(Violation::MediaEnginesExceeded {
            available: geometry.ofa_engines,
            instances: ofa_holders,
        });
    }
    // R7: +me.all exclusivity.
    for (inst, idx) in &resolved {
        if geometry.gi_profiles[*idx].media_variant() == MediaVariant::MeAll {
            let others: Vec<PlacedInstance> = resolved
                .iter()
                .filter(|(o, oi)| {
                    !std::ptr::eq(*o, *inst)
                        && geometry.gi_profiles[*oi].media_variant() != MediaVariant::NoMe
                })
                .map(|(o, _)| (*o).clone())
                .collect();
            if !others.is_empty() {
                out.push(Violation::MeAllNotExclusive {
                    me_all: (*inst).clone(),
                    others,
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog;
    use crate::mig::MigProfileName;
    use proptest::prelude::*;

    fn mig_geometries() -> Vec<&'static MigGeometry> {
        catalog::models()
            .iter()
            .filter_map(|m| m.mig.as_ref())
            .collect()
    }

    fn h100() -> &'static MigGeometry {
        catalog::lookup("H100-SXM5-80GB")
            .unwrap()
            .mig
            .as_ref()
            .unwrap()
    }

    fn copies(n: usize) -> Vec<PlacedInstance> {
        vec![PlacedInstance::new(MigProfileName::new(1, 10), 0); n]
    }

    #[test]
    fn more_instances_than_the_gpu_holds_are_refused_outright() {
        let v = validate(h100(), &copies(5000)).unwrap_err();
        assert_eq!(
            v,
            vec![Violation::TooManyInstances {
                count: 5000,
                max_instances: 7,
                memory_slices: 8
            }]
        );
        let msg = v[0].to_string();
        assert!(
            msg.contains("5000 instances") && msg.contains("at most 7"),
            "{msg}"
        );
    }

    #[test]
    fn overlaps_are_grouped_per_instance_and_capped() {
        // Within the GPU's bound: one line per instance with later overlaps.
        let v = validate(h100(), &copies(3)).unwrap_err();
        let lines: Vec<String> = v.iter().map(ToString::to_string).collect();
        assert_eq!(
            lines[0],
            "1g.10gb@0 overlaps 2 other instances: 1g.10gb@0, 1g.10gb@0"
        );
        assert_eq!(
            lines[1],
            "1g.10gb@0 and 1g.10gb@0 overlap on memory slice 0"
        );
        // A (runtime) geometry with a long axis: at most MAX_OVERLAP_LINES lines.
        let mut g = h100().clone();
        g.memory_slices = 64;
        g.max_instances = 64;
        let v = validate(&g, &copies(64)).unwrap_err();
        let overlaps: Vec<&Violation> = v
            .iter()
            .filter(|x| {
                matches!(
                    x,
                    Violation::Overlap { .. }
                        | Violation::OverlapsMany { .. }
                        | Violation::MoreOverlaps { .. }
                )
            })
            .collect();
        assert_eq!(overlaps.len(), MAX_OVERLAP_LINES + 1);
        assert_eq!(
            overlaps[MAX_OVERLAP_LINES],
            &Violation::MoreOverlaps { instances: 43 }
        );
        let first = overlaps[0].to_string();
        assert!(
            first.contains("overlaps 63 other instances") && first.ends_with("and 43 more"),
            "{first}"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Whatever the number of instances, validation reports a bounded
        /// number of violations of bounded size.
        #[test]
        fn reports_stay_small_whatever_the_layout(
            model in any::<prop::sample::Index>(),
            long_axis in any::<bool>(),
            raw in prop::collection::vec((0usize..40, 0u32..14), 0..3000),
        ) {
            let mut g = (*model.get(&mig_geometries())).clone();
            if long_axis {
                g.memory_slices = 64;
                g.max_instances = 64;
            }
            let layout: Vec<PlacedInstance> = raw
                .iter()
                .map(|&(i, start)| {
                    let p = &g.gi_profiles[i % g.gi_profiles.len()];
                    PlacedInstance::new(p.name.clone(), start)
                })
                .collect();
            if let Err(v) = validate(&g, &layout) {
                let text: usize = v.iter().map(|x| x.to_string().len()).sum();
                prop_assert!(v.len() <= 3 * 64 + 10, "{} violations", v.len());
                prop_assert!(text < 200_000, "{text} bytes");
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// The allocation-free check accepts a layout exactly when the
        /// rule-by-rule check finds nothing, on catalog geometries with
        /// tightened totals and budgets and on random layouts (mostly real
        /// profiles at real starts, some unknown or compute-instance names).
        #[test]
        fn quick_check_agrees_with_full_check(
            model in any::<prop::sample::Index>(),
            compute_cut in 0u32..3,
            instance_cut in 0u32..3,
            ofa in 0u32..3,
            pre_r510 in any::<bool>(),
            raw in prop::collection::vec((0usize..40, 0u32..14, 0u8..12), 0..9),
        ) {
            let mut g = (*model.get(&mig_geometries())).clone();
            g.compute_slices = g.compute_slices.saturating_sub(compute_cut);
            g.max_instances = g.max_instances.saturating_sub(instance_cut);
            g.ofa_engines = ofa;
            let layout: Vec<PlacedInstance> = raw
                .iter()
                .map(|&(i, start, kind)| {
                    let p = &g.gi_profiles[i % g.gi_profiles.len()];
                    match kind {
                        0 => PlacedInstance::new(MigProfileName::new(5, 999), start),
                        1 => PlacedInstance::new(p.name.clone().with_compute(1), start),
                        2 => PlacedInstance::new(p.name.clone(), start),
                        _ => {
                            let pl = p.placements[start as usize % p.placements.len()];
                            PlacedInstance::new(p.name.clone(), pl.start)
                        }
                    }
                })
                .collect();
            let options = ValidateOptions { pre_r510_driver: pre_r510 };
            let mut sorted = layout.clone();
            sorted.sort();
            let full_ok = collect(&g, &sorted, options).is_empty();
            prop_assert_eq!(quick_valid(&g, &layout, options), full_ok);
            prop_assert_eq!(validate_with(&g, &layout, options).is_ok(), full_ok);
        }
    }
}
