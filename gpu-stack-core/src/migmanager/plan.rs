//! Per-GPU step plans: from what a GPU actually holds to what the selected config
//! asks for, as an ordered list of single backend calls.
//!
//! The planner is generic over the GPU-instance profile key `P` and the
//! compute-instance profile key `C`, so it works with whatever identifies a
//! profile on the device (an NVML profile id, a resolved profile). Instances are
//! named by their placement start: two GPU instances of one GPU never share a
//! start, so a start survives a crash and a restart while NVML ids may not.
//!
//! Crash safety comes from the shape of the plan: each step is one backend call,
//! every prefix of the plan leaves the GPU in a layout the driver accepted, and
//! planning again from the state after any prefix yields the rest of the work
//! (never more). The tests check that property for all inputs.

use std::fmt;

/// MIG mode of one GPU as the driver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MigMode {
    /// Mode in effect now.
    pub current: bool,
    /// Mode that takes effect after the next GPU reset (equals `current` when nothing is pending).
    pub pending: bool,
}

/// A compute instance found on a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedCi<C> {
    /// Compute-instance id inside its GPU instance.
    pub id: u32,
    /// Its profile.
    pub profile: C,
    /// Processes running on it (empty: idle).
    pub processes: Vec<u32>,
}

/// A GPU instance found on a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedGi<P, C> {
    /// GPU-instance id as the driver numbers it.
    pub id: u32,
    /// Its profile.
    pub profile: P,
    /// First memory slice of its placement.
    pub start: u32,
    /// Its compute instances.
    pub cis: Vec<ObservedCi<C>>,
}

/// What one GPU holds now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedGpu<P, C> {
    /// GPU index on the node.
    pub index: u32,
    /// MIG mode.
    pub mode: MigMode,
    /// GPU instances (empty when MIG is off).
    pub gis: Vec<ObservedGi<P, C>>,
    /// Processes on the whole GPU when MIG is off (they block a mode change).
    pub processes: Vec<u32>,
}

/// One GPU instance of the target layout, at an explicit placement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetGi<P, C> {
    /// Its profile.
    pub profile: P,
    /// First memory slice of its placement (from the core fit, never left to the driver).
    pub start: u32,
    /// Compute instances to create in it (one full-size CI for mig-parted's `<G>g.<N>gb`).
    pub cis: Vec<C>,
}

/// What one GPU must hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetGpu<P, C> {
    /// GPU index on the node.
    pub index: u32,
    /// MIG mode wanted.
    pub mig_enabled: bool,
    /// GPU instances wanted (ignored when `mig_enabled` is false).
    pub gis: Vec<TargetGi<P, C>>,
}

/// One backend call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step<P, C> {
    /// Turn MIG mode on (may only become pending until a GPU reset).
    EnableMig,
    /// Turn MIG mode off (may only become pending until a GPU reset).
    DisableMig,
    /// Destroy a compute instance.
    DestroyCi {
        /// Placement start of its GPU instance.
        gi_start: u32,
        /// GPU-instance id at planning time.
        gi_id: u32,
        /// Compute-instance id.
        ci_id: u32,
    },
    /// Destroy a GPU instance that has no compute instances left.
    DestroyGi {
        /// Its placement start.
        gi_start: u32,
        /// Its id at planning time.
        gi_id: u32,
    },
    /// Create a GPU instance at an explicit placement.
    CreateGi {
        /// Profile.
        profile: P,
        /// Placement start.
        start: u32,
    },
    /// Create a compute instance in the GPU instance placed at `gi_start`.
    CreateCi {
        /// Placement start of the GPU instance.
        gi_start: u32,
        /// Compute-instance profile.
        profile: C,
    },
}

impl<P: fmt::Debug, C: fmt::Debug> fmt::Display for Step<P, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::EnableMig => write!(f, "enable MIG mode"),
            Step::DisableMig => write!(f, "disable MIG mode"),
            Step::DestroyCi {
                gi_start,
                gi_id,
                ci_id,
            } => write!(
                f,
                "destroy compute instance {ci_id} of GPU instance {gi_id} (at slice {gi_start})"
            ),
            Step::DestroyGi { gi_start, gi_id } => {
                write!(f, "destroy GPU instance {gi_id} (at slice {gi_start})")
            }
            Step::CreateGi { profile, start } => {
                write!(f, "create GPU instance {profile:?} at slice {start}")
            }
            Step::CreateCi { gi_start, profile } => write!(
                f,
                "create compute instance {profile:?} in the GPU instance at slice {gi_start}"
            ),
        }
    }
}

/// A running process that the plan would kill, with where it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BusyInstance {
    /// GPU index.
    pub gpu: u32,
    /// GPU-instance id (`None`: the whole GPU, for a MIG mode change).
    pub gi_id: Option<u32>,
    /// Compute-instance id, when the process is on one.
    pub ci_id: Option<u32>,
    /// The processes.
    pub processes: Vec<u32>,
}

impl fmt::Display for BusyInstance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.gi_id, self.ci_id) {
            (Some(gi), Some(ci)) => write!(
                f,
                "GPU {} GPU instance {gi} compute instance {ci} has processes {:?}",
                self.gpu, self.processes
            ),
            (Some(gi), None) => write!(
                f,
                "GPU {} GPU instance {gi} has processes {:?}",
                self.gpu, self.processes
            ),
            _ => write!(f, "GPU {} has processes {:?}", self.gpu, self.processes),
        }
    }
}

/// The work for one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuPlan<P, C> {
    /// GPU index.
    pub index: u32,
    /// MIG mode is already switched and only a GPU reset is left (state
    /// `rebooting`); never set together with steps.
    pub needs_reset: bool,
    /// Backend calls in order. After a mode step the GPU must be observed again
    /// (the rest of the plan assumes the mode took effect).
    pub steps: Vec<Step<P, C>>,
    /// GPU instances kept as they are.
    pub kept: usize,
    /// Instances with running processes that the steps would destroy.
    pub busy: Vec<BusyInstance>,
}

impl<P, C> GpuPlan<P, C> {
    /// True when the GPU already matches its target.
    pub fn is_converged(&self) -> bool {
        self.steps.is_empty() && !self.needs_reset
    }

    /// Number of steps that destroy something.
    pub fn destroys(&self) -> usize {
        self.steps
            .iter()
            .filter(|s| matches!(s, Step::DestroyCi { .. } | Step::DestroyGi { .. }))
            .count()
    }

    /// Number of steps that create something.
    pub fn creates(&self) -> usize {
        self.steps
            .iter()
            .filter(|s| matches!(s, Step::CreateCi { .. } | Step::CreateGi { .. }))
            .count()
    }
}

/// Plans one GPU: the minimal ordered calls that turn `actual` into `target`.
///
/// A GPU instance stays when a target instance has the same profile and
/// placement start; inside it, compute instances are matched as a multiset of
/// profiles. Everything else is destroyed (compute instances first) and the
/// missing instances are created at their explicit placements, each GPU
/// instance followed by its compute instances. A GPU instance left without
/// compute instances by an interrupted run is completed, not recreated.
///
/// MIG mode: when the wanted mode is already pending, the plan is
/// `needs_reset` with no steps. When the mode must change, the plan holds the
/// instance cleanup (for a disable) and the mode step, and ends there: plan
/// again once the mode is in effect.
pub fn plan_gpu<P, C>(actual: &ObservedGpu<P, C>, target: &TargetGpu<P, C>) -> GpuPlan<P, C>
where
    P: Clone + PartialEq,
    C: Clone + PartialEq,
{
    let mut plan = GpuPlan {
        index: actual.index,
        needs_reset: false,
        steps: Vec::new(),
        kept: 0,
        busy: Vec::new(),
    };
    let want = target.mig_enabled;
    if actual.mode.current != want {
        // Instances block a disable; destroy them first (they exist only when MIG is on).
        if !want {
            destroy_all(actual, &mut plan);
        }
        if actual.mode.pending == want {
            // Only the reset is left once the instances are gone.
            plan.needs_reset = plan.steps.is_empty();
            return plan;
        }
        if !actual.processes.is_empty() {
            plan.busy.push(BusyInstance {
                gpu: actual.index,
                gi_id: None,
                ci_id: None,
                processes: actual.processes.clone(),
            });
        }
        plan.steps.push(if want {
            Step::EnableMig
        } else {
            Step::DisableMig
        });
        return plan;
    }
    if actual.mode.pending != actual.mode.current {
        // The opposite mode is pending (an earlier run or a person asked for it):
        // set the mode again so a reset does not flip it.
        plan.steps.push(if want {
            Step::EnableMig
        } else {
            Step::DisableMig
        });
    }
    if !want {
        return plan;
    }

    // Match target GPU instances to existing ones by (profile, start).
    let mut matched: Vec<Option<usize>> = vec![None; target.gis.len()];
    let mut keep = vec![false; actual.gis.len()];
    for (ti, t) in target.gis.iter().enumerate() {
        if let Some(ai) = actual
            .gis
            .iter()
            .enumerate()
            .position(|(ai, a)| !keep[ai] && a.start == t.start && a.profile == t.profile)
        {
            keep[ai] = true;
            matched[ti] = Some(ai);
        }
    }

    // Destroy: compute instances not wanted in kept GIs, then whole GIs not kept.
    let mut ci_destroys = Vec::new();
    let mut ci_creates = Vec::new();
    for (ti, t) in target.gis.iter().enumerate() {
        let Some(ai) = matched[ti] else { continue };
        let a = &actual.gis[ai];
        plan.kept += 1;
        let mut wanted: Vec<Option<&C>> = t.cis.iter().map(Some).collect();
        for ci in &a.cis {
            if let Some(slot) = wanted
                .iter_mut()
                .find(|w| w.is_some_and(|p| *p == ci.profile))
            {
                *slot = None;
            } else {
                if !ci.processes.is_empty() {
                    plan.busy.push(BusyInstance {
                        gpu: actual.index,
                        gi_id: Some(a.id),
                        ci_id: Some(ci.id),
                        processes: ci.processes.clone(),
                    });
                }
                ci_destroys.push(Step::DestroyCi {
                    gi_start: a.start,
                    gi_id: a.id,
                    ci_id: ci.id,
                });
            }
        }
        for p in wanted.into_iter().flatten() {
            ci_creates.push(Step::CreateCi {
                gi_start: t.start,
                profile: p.clone(),
            });
        }
    }
    for (ai, a) in actual.gis.iter().enumerate() {
        if !keep[ai] {
            destroy_gi(actual.index, a, &mut plan);
        }
    }
    plan.steps.extend(ci_destroys);
    plan.steps.extend(ci_creates);
    for (ti, t) in target.gis.iter().enumerate() {
        if matched[ti].is_some() {
            continue;
        }
        plan.steps.push(Step::CreateGi {
            profile: t.profile.clone(),
            start: t.start,
        });
        for p in &t.cis {
            plan.steps.push(Step::CreateCi {
                gi_start: t.start,
                profile: p.clone(),
            });
        }
    }
    plan
}

fn destroy_all<P, C>(actual: &ObservedGpu<P, C>, plan: &mut GpuPlan<P, C>) {
    for gi in &actual.gis {
        destroy_gi(actual.index, gi, plan);
    }
}

fn destroy_gi<P, C>(gpu: u32, gi: &ObservedGi<P, C>, plan: &mut GpuPlan<P, C>) {
    for ci in &gi.cis {
        if !ci.processes.is_empty() {
            plan.busy.push(BusyInstance {
                gpu,
                gi_id: Some(gi.id),
                ci_id: Some(ci.id),
                processes: ci.processes.clone(),
            });
        }
        plan.steps.push(Step::DestroyCi {
            gi_start: gi.start,
            gi_id: gi.id,
            ci_id: ci.id,
        });
    }
    plan.steps.push(Step::DestroyGi {
        gi_start: gi.start,
        gi_id: gi.id,
    });
}

/// Backend calls a create-everything-from-scratch apply makes for `target`
/// (what mig-parted does: clear the GPU, then create every instance), for
/// comparison with [`plan_gpu`]. Counts only MIG instance calls; a mode change
/// costs the same either way.
pub fn from_scratch_calls<P, C>(actual: &ObservedGpu<P, C>, target: &TargetGpu<P, C>) -> usize {
    let clear: usize = actual.gis.iter().map(|g| g.cis.len() + 1).sum();
    let create: usize = if target.mig_enabled {
        target.gis.iter().map(|g| g.cis.len() + 1).sum()
    } else {
        0
    };
    clear + create
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    type Gpu = ObservedGpu<u32, u32>;
    type Target = TargetGpu<u32, u32>;

    fn mig_on() -> MigMode {
        MigMode {
            current: true,
            pending: true,
        }
    }

    fn gpu(gis: &[(u32, u32)]) -> Gpu {
        ObservedGpu {
            index: 0,
            mode: mig_on(),
            gis: gis
                .iter()
                .enumerate()
                .map(|(i, &(profile, start))| ObservedGi {
                    id: i as u32 + 1,
                    profile,
                    start,
                    cis: vec![ObservedCi {
                        id: 0,
                        profile,
                        processes: vec![],
                    }],
                })
                .collect(),
            processes: vec![],
        }
    }

    fn target(gis: &[(u32, u32)]) -> Target {
        TargetGpu {
            index: 0,
            mig_enabled: true,
            gis: gis
                .iter()
                .map(|&(profile, start)| TargetGi {
                    profile,
                    start,
                    cis: vec![profile],
                })
                .collect(),
        }
    }

    /// Applies a step the way a driver would (ids are fresh, CIs need their GI).
    fn apply(gpu: &mut Gpu, step: &Step<u32, u32>, next_id: &mut u32) {
        match step {
            Step::EnableMig => gpu.mode.pending = true,
            Step::DisableMig => gpu.mode.pending = false,
            Step::DestroyCi {
                gi_start, ci_id, ..
            } => {
                let gi = gpu.gis.iter_mut().find(|g| g.start == *gi_start).unwrap();
                gi.cis.retain(|c| c.id != *ci_id);
            }
            Step::DestroyGi { gi_start, .. } => {
                let gi = gpu.gis.iter().find(|g| g.start == *gi_start).unwrap();
                assert!(
                    gi.cis.is_empty(),
                    "GPU instance destroyed with compute instances"
                );
                gpu.gis.retain(|g| g.start != *gi_start);
            }
            Step::CreateGi { profile, start } => {
                assert!(gpu.gis.iter().all(|g| g.start != *start), "overlap");
                *next_id += 1;
                gpu.gis.push(ObservedGi {
                    id: *next_id,
                    profile: *profile,
                    start: *start,
                    cis: vec![],
                });
            }
            Step::CreateCi { gi_start, profile } => {
                let gi = gpu.gis.iter_mut().find(|g| g.start == *gi_start).unwrap();
                let id = gi.cis.iter().map(|c| c.id + 1).max().unwrap_or(0);
                gi.cis.push(ObservedCi {
                    id,
                    profile: *profile,
                    processes: vec![],
                });
            }
        }
    }

    fn reset(gpu: &mut Gpu) {
        gpu.mode.current = gpu.mode.pending;
    }

    #[test]
    fn identical_layout_is_converged() {
        let g = gpu(&[(19, 0), (19, 1), (14, 2)]);
        let p = plan_gpu(&g, &target(&[(14, 2), (19, 1), (19, 0)]));
        assert!(p.is_converged());
        assert_eq!(p.kept, 3);
    }

    #[test]
    fn switching_changes_only_the_difference() {
        // all-balanced-like → keep the 3g at 4, replace 1g,1g,2g at 0..4 with a 4g? no: with 2g,2g.
        let g = gpu(&[(19, 0), (19, 1), (14, 2), (9, 4)]);
        let p = plan_gpu(&g, &target(&[(14, 0), (14, 2), (9, 4)]));
        assert_eq!(p.kept, 2);
        assert_eq!(
            p.steps,
            vec![
                Step::DestroyCi {
                    gi_start: 0,
                    gi_id: 1,
                    ci_id: 0
                },
                Step::DestroyGi {
                    gi_start: 0,
                    gi_id: 1
                },
                Step::DestroyCi {
                    gi_start: 1,
                    gi_id: 2,
                    ci_id: 0
                },
                Step::DestroyGi {
                    gi_start: 1,
                    gi_id: 2
                },
                Step::CreateGi {
                    profile: 14,
                    start: 0
                },
                Step::CreateCi {
                    gi_start: 0,
                    profile: 14
                },
            ]
        );
    }

    #[test]
    fn enable_then_plan_again() {
        let mut g = gpu(&[]);
        g.mode = MigMode {
            current: false,
            pending: false,
        };
        let t = target(&[(0, 0)]);
        let p = plan_gpu(&g, &t);
        assert_eq!(p.steps, vec![Step::EnableMig]);
        g.mode.pending = true;
        let p = plan_gpu(&g, &t);
        assert!(p.needs_reset && p.steps.is_empty());
        reset(&mut g);
        let p = plan_gpu(&g, &t);
        assert_eq!(p.creates(), 2);
    }

    #[test]
    fn busy_instances_are_named() {
        let mut g = gpu(&[(19, 0), (19, 1)]);
        g.gis[1].cis[0].processes = vec![4242];
        let p = plan_gpu(&g, &target(&[(14, 0)]));
        assert_eq!(p.busy.len(), 1);
        assert_eq!(p.busy[0].gi_id, Some(2));
        assert!(p.busy[0].to_string().contains("4242"));
        // Kept busy instances are fine.
        let p = plan_gpu(&g, &target(&[(19, 1)]));
        assert!(p.busy.is_empty());
    }

    #[test]
    fn gi_without_ci_is_completed() {
        let mut g = gpu(&[(19, 0)]);
        g.gis[0].cis.clear();
        let p = plan_gpu(&g, &target(&[(19, 0)]));
        assert_eq!(
            p.steps,
            vec![Step::CreateCi {
                gi_start: 0,
                profile: 19
            }]
        );
    }

    #[test]
    fn disable_destroys_then_switches_mode() {
        let g = gpu(&[(19, 0), (14, 2)]);
        let t = TargetGpu {
            index: 0,
            mig_enabled: false,
            gis: vec![],
        };
        let p = plan_gpu(&g, &t);
        assert_eq!(p.steps.last(), Some(&Step::DisableMig));
        assert_eq!(p.destroys(), 4);
        assert_eq!(from_scratch_calls(&g, &t), 4);
    }

    /// Layouts on an 8-slice grid: (profile, start) with profile p of size p-slices
    /// encoded as the profile key (1, 2, 4 or 8), placements aligned to the size.
    fn layout() -> impl Strategy<Value = Vec<(u32, u32)>> {
        proptest::collection::vec(
            (prop_oneof![Just(1u32), Just(2), Just(4), Just(8)], 0u32..8),
            0..8,
        )
        .prop_map(|cands| {
            let mut used = [false; 8];
            let mut out = Vec::new();
            for (size, raw) in cands {
                let start = (raw / size) * size;
                if start + size > 8 {
                    continue;
                }
                let range = start as usize..(start + size) as usize;
                if used[range.clone()].iter().any(|u| *u) {
                    continue;
                }
                used[range].iter_mut().for_each(|u| *u = true);
                out.push((size, start));
            }
            out
        })
    }

    fn mode() -> impl Strategy<Value = MigMode> {
        (any::<bool>(), any::<bool>()).prop_map(|(current, pending)| MigMode { current, pending })
    }

    proptest! {
        /// Running the plan (re-planning after each mode change and reset) reaches
        /// the target, and a second plan is empty.
        #[test]
        fn plan_converges(from in layout(), to in layout(), m in mode(), want in any::<bool>()) {
            let mut g = gpu(&from);
            g.mode = m;
            if !m.current { g.gis.clear(); }
            let mut t = target(&to);
            t.mig_enabled = want;
            let mut next_id = 100;
            for _round in 0..4 {
                let p = plan_gpu(&g, &t);
                if p.needs_reset { reset(&mut g); continue; }
                if p.is_converged() { break; }
                for s in &p.steps { apply(&mut g, s, &mut next_id); }
                if p.steps.iter().any(|s| matches!(s, Step::EnableMig | Step::DisableMig)) {
                    reset(&mut g);
                }
            }
            prop_assert!(plan_gpu(&g, &t).is_converged());
            prop_assert_eq!(g.mode.current, want);
            if want {
                let mut have: Vec<(u32, u32)> = g.gis.iter().map(|x| (x.profile, x.start)).collect();
                let mut exp = to.clone();
                have.sort(); exp.sort();
                prop_assert_eq!(have, exp);
            } else {
                prop_assert!(g.gis.is_empty());
            }
        }

        /// Kill after any step: planning again from the state reached gives no
        /// more steps than were left, and the GPU never holds a GI destroyed with CIs.
        #[test]
        fn crash_after_any_step_resumes(from in layout(), to in layout(), cut in 0usize..40) {
            let mut g = gpu(&from);
            let t = target(&to);
            let p = plan_gpu(&g, &t);
            let cut = cut.min(p.steps.len());
            let mut next_id = 100;
            for s in &p.steps[..cut] { apply(&mut g, s, &mut next_id); }
            let again = plan_gpu(&g, &t);
            prop_assert!(again.steps.len() <= p.steps.len() - cut);
            for s in &again.steps { apply(&mut g, s, &mut next_id); }
            prop_assert!(plan_gpu(&g, &t).is_converged());
        }

        /// The minimal plan never makes more calls than clearing and recreating.
        #[test]
        fn never_more_calls_than_from_scratch(from in layout(), to in layout()) {
            let g = gpu(&from);
            let t = target(&to);
            let p = plan_gpu(&g, &t);
            prop_assert!(p.steps.len() <= from_scratch_calls(&g, &t));
            prop_assert_eq!(p.kept + p.creates() / 2, to.len());
        }
    }
}
