//! Applying mig-parted configs to the GPUs of one node through any
//! [`GpuBackend`]: the one apply path shared by `gpu-mig-manager` and
//! `gpu-stack mig apply/assert/export`.
//!
//! Every round reads the actual GPU state, resolves the selected config against
//! it ([`gpu_stack_core::migmanager::select`]), plans each GPU
//! ([`gpu_stack_core::migmanager::plan_gpu`]) and runs the steps. Nothing is
//! remembered between rounds or between runs, so a run killed after any backend
//! call is finished by the next run, which starts again from what the GPUs hold.
//!
//! Every read also lists the compute processes of each MIG-capable GPU
//! ([`GpuBackend::running_processes`], through [`BackendProcesses`]); an
//! instance the change would destroy while a process runs on it stops the
//! apply before anything changes unless it is forced ([`ApplyError::Busy`]
//! names the GPU, the instance and the pids).

use std::collections::BTreeMap;
use std::fmt;

use gpu_stack_core::backend::{
    BackendError, GpuBackend, GpuInfo, GpuProcess, MigModeChange, MigState, SlicePlacement,
};
use gpu_stack_core::catalog;
use gpu_stack_core::mig::{MigGeometry, MigProfileName, PlacedInstance};
use gpu_stack_core::migmanager::{
    BusyInstance, GpuFacts, GpuPlan, MigMode, ObservedCi, ObservedGi, ObservedGpu, SelectError,
    Step, from_scratch_calls, plan_gpu, select,
};
use gpu_stack_core::migparted::MigPartedConfig;
use serde::Serialize;

/// Who runs on a MIG instance or GPU. The apply path always asks the backend
/// ([`BackendProcesses`]); a caller's probe adds processes the driver cannot
/// see (the union counts).
pub trait ProcessProbe {
    /// Process ids on GPU `gpu`, GPU instance `gi`, compute instance `ci`
    /// (`None`s: anywhere on that GPU / GPU instance).
    fn processes(&self, gpu: u32, gi: Option<u32>, ci: Option<u32>) -> Vec<u32>;
}

/// A probe that adds no processes to those the backend lists.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoProcesses;

/// The [`ProcessProbe`] over [`GpuBackend::running_processes`]: the process
/// lists of some GPUs, read once, answered from memory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackendProcesses {
    by_gpu: BTreeMap<u32, Vec<GpuProcess>>,
}

impl BackendProcesses {
    /// Reads the process list of each GPU in `gpus`. A backend or driver that
    /// cannot list processes (`NotSupported`, `MissingFunction`) counts as
    /// none running on that GPU; any other error is returned with its GPU.
    pub fn read(
        backend: &dyn GpuBackend,
        gpus: impl IntoIterator<Item = u32>,
    ) -> Result<Self, (u32, BackendError)> {
        let mut by_gpu = BTreeMap::new();
        for gpu in gpus {
            match backend.running_processes(gpu) {
                Ok(list) => {
                    by_gpu.insert(gpu, list);
                }
                Err(BackendError::NotSupported { .. })
                | Err(BackendError::MissingFunction { .. }) => {
                    tracing::debug!(
                        gpu,
                        backend = backend.name(),
                        "the backend cannot list processes; none are known to run"
                    );
                }
                Err(e) => return Err((gpu, e)),
            }
        }
        Ok(BackendProcesses { by_gpu })
    }

    /// The processes read for `gpu`.
    pub fn of(&self, gpu: u32) -> &[GpuProcess] {
        self.by_gpu.get(&gpu).map(Vec::as_slice).unwrap_or(&[])
    }
}

impl ProcessProbe for BackendProcesses {
    fn processes(&self, gpu: u32, gi: Option<u32>, ci: Option<u32>) -> Vec<u32> {
        let mut pids: Vec<u32> = self
            .of(gpu)
            .iter()
            .filter(|p| match gi {
                None => true,
                Some(gi) => {
                    p.gpu_instance_id == Some(gi)
                        && ci.is_none_or(|ci| p.compute_instance_id == Some(ci))
                }
            })
            .map(|p| p.pid)
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }
}

/// Both probes' processes, sorted, once each.
fn union(
    a: &dyn ProcessProbe,
    b: &dyn ProcessProbe,
    gpu: u32,
    gi: Option<u32>,
    ci: Option<u32>,
) -> Vec<u32> {
    let mut pids = a.processes(gpu, gi, ci);
    pids.extend(b.processes(gpu, gi, ci));
    pids.sort_unstable();
    pids.dedup();
    pids
}

impl ProcessProbe for NoProcesses {
    fn processes(&self, _: u32, _: Option<u32>, _: Option<u32>) -> Vec<u32> {
        Vec::new()
    }
}

/// How to apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApplyOptions {
    /// Destroy instances even when processes run on them.
    pub force: bool,
    /// When a MIG mode change waits for a GPU reset, try resetting the GPU
    /// (when the reset is refused the result is [`ApplyOutcome::NeedsReboot`]).
    pub reset_gpus: bool,
    /// Only switch MIG modes; leave instances alone (mig-parted's `--mode-only`).
    pub mode_only: bool,
}

impl Default for ApplyOptions {
    fn default() -> Self {
        ApplyOptions {
            force: false,
            reset_gpus: true,
            mode_only: false,
        }
    }
}

/// Why an apply, assert or export did not complete.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The config cannot be applied to these GPUs; nothing was changed.
    #[error("{0}; nothing was changed")]
    Select(SelectError),
    /// Instances the change would destroy have running processes.
    #[error(
        "refusing to destroy busy MIG instances: {}; stop those workloads or pass --force; nothing was changed",
        list(.0)
    )]
    Busy(Vec<BusyInstance>),
    /// Reading the GPUs failed.
    #[error("could not read GPU{}: {source}", gpu_suffix(*.gpu))]
    Read {
        /// GPU index, when one GPU failed.
        gpu: Option<u32>,
        /// The backend error.
        source: BackendError,
    },
    /// A step failed; steps before it are in effect and the GPU holds a layout
    /// the driver accepted. Running apply again resumes from there.
    #[error(
        "GPU {gpu}: {step} failed after {done} change(s) on this node: {source}; the GPU keeps a valid layout, apply again to resume"
    )]
    Step {
        /// GPU index.
        gpu: u32,
        /// The step, in words.
        step: String,
        /// Steps done before it, over all GPUs.
        done: usize,
        /// The backend error.
        source: BackendError,
    },
    /// The GPUs did not reach the target within the round limit (something
    /// else is changing them).
    #[error(
        "GPUs {gpus:?} still differ from the config after {rounds} rounds; is another process changing MIG on this node?"
    )]
    NotConverged {
        /// GPUs that differ.
        gpus: Vec<u32>,
        /// Rounds run.
        rounds: u32,
    },
}

impl From<SelectError> for ApplyError {
    fn from(e: SelectError) -> Self {
        ApplyError::Select(e)
    }
}

fn list(b: &[BusyInstance]) -> String {
    b.iter()
        .map(|b| b.to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

fn gpu_suffix(gpu: Option<u32>) -> String {
    gpu.map(|g| format!(" {g}"))
        .unwrap_or_else(|| "s".to_string())
}

/// One GPU as read from the backend.
#[derive(Debug, Clone)]
pub struct GpuSnapshot {
    /// Inventory facts.
    pub info: GpuInfo,
    /// MIG state (`None`: not MIG capable).
    pub mig: Option<MigState>,
    /// Planner view.
    pub observed: ObservedGpu<u32, u32>,
    /// Present GPU instances by name and start.
    pub layout: Vec<PlacedInstance>,
}

impl GpuSnapshot {
    /// The catalog geometry of this GPU.
    pub fn geometry(&self) -> Option<&'static MigGeometry> {
        catalog::by_pci_device_id(self.info.pci_device_id).and_then(|m| m.mig.as_ref())
    }
}

/// Reads every GPU: inventory, MIG mode, instances and the processes on
/// them (the backend's list plus `probe`'s). Costs one inventory call plus two
/// reads (MIG state, processes) per MIG-capable GPU.
pub fn observe(
    backend: &dyn GpuBackend,
    probe: &dyn ProcessProbe,
) -> Result<Vec<GpuSnapshot>, ApplyError> {
    observe_with(backend, probe, true)
}

fn observe_with(
    backend: &dyn GpuBackend,
    extra: &dyn ProcessProbe,
    list_processes: bool,
) -> Result<Vec<GpuSnapshot>, ApplyError> {
    let inventory = backend
        .inventory()
        .map_err(|source| ApplyError::Read { gpu: None, source })?;
    if let Some(bad) = inventory.errors.first() {
        return Err(ApplyError::Read {
            gpu: Some(bad.index),
            source: bad.error.clone(),
        });
    }
    let listed = if list_processes {
        let capable = inventory
            .gpus
            .iter()
            .filter(|g| g.mig_capable)
            .map(|g| g.index);
        BackendProcesses::read(backend, capable).map_err(|(gpu, source)| ApplyError::Read {
            gpu: Some(gpu),
            source,
        })?
    } else {
        BackendProcesses::default()
    };
    let probe = |gpu: u32, gi: Option<u32>, ci: Option<u32>| union(extra, &listed, gpu, gi, ci);
    let mut out = Vec::new();
    for info in inventory.gpus {
        let index = info.index;
        let mig = if info.mig_capable {
            Some(
                backend
                    .mig_state(index)
                    .map_err(|source| ApplyError::Read {
                        gpu: Some(index),
                        source,
                    })?,
            )
        } else {
            None
        };
        let geometry = catalog::by_pci_device_id(info.pci_device_id).and_then(|m| m.mig.as_ref());
        let mode = mig
            .as_ref()
            .map(|m| m.mode)
            .unwrap_or(gpu_stack_core::backend::MigMode {
                current: false,
                pending: false,
            });
        let gis = mig
            .as_ref()
            .map(|m| m.gpu_instances.as_slice())
            .unwrap_or(&[]);
        let observed = ObservedGpu {
            index,
            mode: MigMode {
                current: mode.current,
                pending: mode.pending,
            },
            gis: gis
                .iter()
                .map(|gi| ObservedGi {
                    id: gi.id,
                    profile: gi.profile_id,
                    start: gi.placement.start,
                    cis: gi
                        .compute_instances
                        .iter()
                        .map(|ci| ObservedCi {
                            id: ci.id,
                            profile: ci.slice_count,
                            processes: probe(index, Some(gi.id), Some(ci.id)),
                        })
                        .collect(),
                })
                .collect(),
            processes: probe(index, None, None),
        };
        let layout = gis
            .iter()
            .filter_map(|gi| {
                let name = geometry
                    .and_then(|g| g.by_id(gi.profile_id))
                    .map(|p| p.name.clone())
                    .or_else(|| MigProfileName::parse(&gi.profile_name).ok())?;
                Some(PlacedInstance::new(name, gi.placement.start))
            })
            .collect();
        out.push(GpuSnapshot {
            info,
            mig,
            observed,
            layout,
        });
    }
    Ok(out)
}

/// The plan of one GPU with what it is for.
#[derive(Debug, Clone, Serialize)]
pub struct GpuReport {
    /// GPU index.
    pub gpu: u32,
    /// PCI id, e.g. `0x233010DE`.
    pub device: String,
    /// Config entry that applies.
    pub entry: usize,
    /// MIG mode wanted.
    pub mig_enabled: bool,
    /// Target layout (`profile@start`).
    pub target: Vec<String>,
    /// Present layout (`profile@start`).
    pub current: Vec<String>,
    /// Steps left, in words.
    pub steps: Vec<String>,
    /// GPU instances kept.
    pub kept: usize,
    /// A GPU reset (or reboot) is the only thing left.
    pub needs_reset: bool,
}

/// Plans for every GPU the config selects, after checking all of them.
#[derive(Debug, Clone)]
pub struct NodePlan {
    /// Snapshots the plan was made from.
    pub snapshots: Vec<GpuSnapshot>,
    /// (plan, report) per selected GPU, in GPU order.
    pub gpus: Vec<(GpuPlan<u32, u32>, GpuReport, usize)>,
}

impl NodePlan {
    /// True when every selected GPU matches the config.
    pub fn is_converged(&self) -> bool {
        self.gpus.iter().all(|(p, _, _)| p.is_converged())
    }

    /// True when every selected GPU has the wanted MIG mode in effect.
    pub fn mode_converged(&self) -> bool {
        self.gpus.iter().all(|(p, r, _)| {
            !p.needs_reset
                && !p
                    .steps
                    .iter()
                    .any(|s| matches!(s, Step::EnableMig | Step::DisableMig))
                && r.mig_enabled == self.mode_of(r.gpu)
        })
    }

    fn mode_of(&self, gpu: u32) -> bool {
        self.snapshots
            .iter()
            .find(|s| s.info.index == gpu)
            .is_some_and(|s| s.observed.mode.current)
    }

    /// Busy instances the plans would destroy.
    pub fn busy(&self) -> Vec<BusyInstance> {
        self.gpus
            .iter()
            .flat_map(|(p, _, _)| p.busy.iter().cloned())
            .collect()
    }

    /// Reports, in GPU order.
    pub fn reports(&self) -> Vec<GpuReport> {
        self.gpus.iter().map(|(_, r, _)| r.clone()).collect()
    }
}

/// Reads the GPUs and plans config `name` on them. Changes nothing.
pub fn plan_node(
    backend: &dyn GpuBackend,
    config: &MigPartedConfig,
    name: &str,
    probe: &dyn ProcessProbe,
) -> Result<NodePlan, ApplyError> {
    let snapshots = observe(backend, probe)?;
    plan_from(snapshots, config, name)
}

fn plan_from(
    snapshots: Vec<GpuSnapshot>,
    config: &MigPartedConfig,
    name: &str,
) -> Result<NodePlan, ApplyError> {
    let facts: Vec<GpuFacts<'_>> = snapshots
        .iter()
        .map(|s| GpuFacts {
            index: s.info.index,
            pci_device_id: s.info.pci_device_id,
            geometry: if s.info.mig_capable {
                s.geometry()
            } else {
                None
            },
            current: s.layout.clone(),
        })
        .collect();
    let selected = select(config, name, &facts)?;
    let mut gpus = Vec::new();
    for (index, sel) in selected {
        let Some(snap) = snapshots.iter().find(|s| s.info.index == index) else {
            continue;
        };
        let plan = plan_gpu(&snap.observed, &sel.target);
        let scratch = from_scratch_calls(&snap.observed, &sel.target);
        let report = GpuReport {
            gpu: index,
            device: catalog::format_pci_id(snap.info.pci_device_id),
            entry: sel.entry,
            mig_enabled: sel.target.mig_enabled,
            target: sel.layout.iter().map(|p| p.to_string()).collect(),
            current: snap.layout.iter().map(|p| p.to_string()).collect(),
            steps: plan.steps.iter().map(|s| s.to_string()).collect(),
            kept: plan.kept,
            needs_reset: plan.needs_reset,
        };
        gpus.push((plan, report, scratch));
    }
    Ok(NodePlan { snapshots, gpus })
}

/// How an apply ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "kebab-case")]
pub enum ApplyOutcome {
    /// The GPUs match the config.
    Converged,
    /// MIG mode changes wait for a reset the backend refused: reboot the node
    /// (state `rebooting`) and apply again.
    NeedsReboot {
        /// GPUs waiting.
        gpus: Vec<u32>,
    },
}

/// What an apply did.
#[derive(Debug, Clone, Serialize)]
pub struct ApplyReport {
    /// How it ended.
    #[serde(flatten)]
    pub outcome: ApplyOutcome,
    /// Backend calls that changed something (mode, reset, create, destroy).
    pub change_calls: usize,
    /// Backend calls that only read.
    pub read_calls: usize,
    /// Calls a clear-and-recreate apply would have made for the same change.
    pub from_scratch_calls: usize,
    /// GPU instances kept.
    pub kept: usize,
    /// Instances created (GPU and compute).
    pub created: usize,
    /// Instances destroyed (GPU and compute).
    pub destroyed: usize,
    /// Rounds (observe, plan, run).
    pub rounds: u32,
    /// The final per-GPU view.
    pub gpus: Vec<GpuReport>,
}

impl fmt::Display for ApplyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.outcome {
            ApplyOutcome::Converged => write!(f, "converged")?,
            ApplyOutcome::NeedsReboot { gpus } => {
                write!(f, "GPUs {gpus:?} need a reset or reboot")?
            }
        }
        write!(
            f,
            ": {} change call(s) ({} created, {} destroyed, {} kept), {} from scratch",
            self.change_calls, self.created, self.destroyed, self.kept, self.from_scratch_calls
        )
    }
}

/// Progress of an apply, for logs.
#[derive(Debug, Clone)]
pub enum ApplyEvent<'a> {
    /// A step is about to run.
    Step {
        /// GPU index.
        gpu: u32,
        /// The step.
        step: &'a Step<u32, u32>,
    },
    /// A GPU is being reset so its pending MIG mode takes effect.
    Reset {
        /// GPU index.
        gpu: u32,
    },
}

/// Applies config `name`: validates it against every GPU first (nothing
/// changes when any GPU cannot take it), refuses to destroy busy instances
/// unless `force`, then runs the minimal steps, re-reading the GPUs after MIG
/// mode changes. Safe to run again at any time; a converged node costs only
/// the reads. Holds [`GpuBackend::lock_mig_changes`] throughout, so two
/// applies on one node run one after the other.
pub fn apply(
    backend: &dyn GpuBackend,
    config: &MigPartedConfig,
    name: &str,
    options: ApplyOptions,
    probe: &dyn ProcessProbe,
    on_event: &mut dyn FnMut(ApplyEvent<'_>),
) -> Result<ApplyReport, ApplyError> {
    apply_planned(backend, options, probe, on_event, &|s| {
        plan_from(s, config, name)
    })
}

/// Per GPU index, the layout it must hold: `None` for MIG off (the whole
/// GPU), `Some` for MIG on with exactly these GPU instances.
pub type LayoutTargets = BTreeMap<u32, Option<Vec<PlacedInstance>>>;

/// Brings the listed GPUs to explicit layouts, the way [`apply`] brings a
/// node to a config: the same rounds, busy-instance refusal, MIG mode
/// changes and GPU resets. GPUs not listed are left alone; instances a GPU
/// holds that its layout keeps stay as they are, compute instances included.
pub fn apply_targets(
    backend: &dyn GpuBackend,
    targets: &LayoutTargets,
    options: ApplyOptions,
    probe: &dyn ProcessProbe,
    on_event: &mut dyn FnMut(ApplyEvent<'_>),
) -> Result<ApplyReport, ApplyError> {
    apply_planned(backend, options, probe, on_event, &|s| {
        Ok(plan_targets(s, targets))
    })
}

/// Plans explicit layouts on the GPUs a snapshot holds (see [`apply_targets`]).
pub fn plan_targets(snapshots: Vec<GpuSnapshot>, targets: &LayoutTargets) -> NodePlan {
    let mut gpus = Vec::new();
    for (index, layout) in targets {
        let Some(snap) = snapshots.iter().find(|s| s.info.index == *index) else {
            continue;
        };
        let Some(geometry) = snap.geometry() else {
            continue;
        };
        let target =
            gpu_stack_core::dra::prepare::target_gpu(&snap.observed, geometry, layout.as_deref());
        let plan = plan_gpu(&snap.observed, &target);
        let scratch = from_scratch_calls(&snap.observed, &target);
        let report = GpuReport {
            gpu: *index,
            device: catalog::format_pci_id(snap.info.pci_device_id),
            entry: 0,
            mig_enabled: target.mig_enabled,
            target: layout.iter().flatten().map(|p| p.to_string()).collect(),
            current: snap.layout.iter().map(|p| p.to_string()).collect(),
            steps: plan.steps.iter().map(|s| s.to_string()).collect(),
            kept: plan.kept,
            needs_reset: plan.needs_reset,
        };
        gpus.push((plan, report, scratch));
    }
    NodePlan { snapshots, gpus }
}

type Planner<'a> = dyn Fn(Vec<GpuSnapshot>) -> Result<NodePlan, ApplyError> + 'a;

fn apply_planned(
    backend: &dyn GpuBackend,
    options: ApplyOptions,
    probe: &dyn ProcessProbe,
    on_event: &mut dyn FnMut(ApplyEvent<'_>),
    planner: &Planner<'_>,
) -> Result<ApplyReport, ApplyError> {
    const MAX_ROUNDS: u32 = 4;
    // Another apply on this node would interleave its steps with ours.
    let _held = backend
        .lock_mig_changes()
        .map_err(|source| ApplyError::Read { gpu: None, source })?;
    let mut report = ApplyReport {
        outcome: ApplyOutcome::Converged,
        change_calls: 0,
        read_calls: 0,
        from_scratch_calls: 0,
        kept: 0,
        created: 0,
        destroyed: 0,
        rounds: 0,
        gpus: Vec::new(),
    };
    let mut first = true;
    let mut refused_reset: Vec<u32> = Vec::new();
    for round in 1..=MAX_ROUNDS {
        report.rounds = round;
        let snapshots = observe(backend, probe)?;
        report.read_calls += 1 + 2 * snapshots.iter().filter(|s| s.mig.is_some()).count();
        let plan = planner(snapshots)?;
        report.gpus = plan.reports();
        if first {
            report.from_scratch_calls = plan.gpus.iter().map(|(_, _, s)| *s).sum();
            report.kept = plan.gpus.iter().map(|(p, _, _)| p.kept).sum();
            first = false;
        }
        let converged = if options.mode_only {
            plan.mode_converged()
        } else {
            plan.is_converged()
        };
        if converged {
            return Ok(report);
        }
        let busy = plan.busy();
        if !busy.is_empty() && !options.force {
            return Err(ApplyError::Busy(busy));
        }
        let mut progressed = false;
        for (gpu_plan, _, _) in &plan.gpus {
            let gpu = gpu_plan.index;
            if gpu_plan.needs_reset {
                if options.reset_gpus && !refused_reset.contains(&gpu) {
                    on_event(ApplyEvent::Reset { gpu });
                    report.change_calls += 1;
                    match backend.reset_gpu(gpu) {
                        Ok(()) => progressed = true,
                        Err(_) => refused_reset.push(gpu),
                    }
                } else if !refused_reset.contains(&gpu) {
                    refused_reset.push(gpu);
                }
                continue;
            }
            let snap = plan.snapshots.iter().find(|s| s.info.index == gpu);
            let geometry = snap.and_then(|s| s.geometry());
            let mut created_gis: BTreeMap<u32, u32> = BTreeMap::new();
            for step in &gpu_plan.steps {
                let is_mode = matches!(step, Step::EnableMig | Step::DisableMig);
                if options.mode_only
                    && !is_mode
                    && !matches!(step, Step::DestroyCi { .. } | Step::DestroyGi { .. })
                {
                    continue;
                }
                if options.mode_only
                    && !is_mode
                    && !gpu_plan.steps.iter().any(|s| matches!(s, Step::DisableMig))
                {
                    continue;
                }
                on_event(ApplyEvent::Step { gpu, step });
                let fail = |source: BackendError, done: usize| ApplyError::Step {
                    gpu,
                    step: step.to_string(),
                    done,
                    source,
                };
                report.change_calls += 1;
                let done = report.change_calls - 1;
                match step {
                    Step::EnableMig | Step::DisableMig => {
                        let enable = matches!(step, Step::EnableMig);
                        match backend
                            .set_mig_mode(gpu, enable)
                            .map_err(|e| fail(e, done))?
                        {
                            MigModeChange::Applied => {}
                            MigModeChange::PendingReset => {
                                if options.reset_gpus {
                                    on_event(ApplyEvent::Reset { gpu });
                                    report.change_calls += 1;
                                    if backend.reset_gpu(gpu).is_err() {
                                        refused_reset.push(gpu);
                                    }
                                } else {
                                    refused_reset.push(gpu);
                                }
                            }
                        }
                    }
                    Step::DestroyCi { gi_id, ci_id, .. } => {
                        backend
                            .destroy_compute_instance(gpu, *gi_id, *ci_id)
                            .map_err(|e| fail(e, done))?;
                        report.destroyed += 1;
                    }
                    Step::DestroyGi { gi_id, .. } => {
                        backend
                            .destroy_gpu_instance(gpu, *gi_id)
                            .map_err(|e| fail(e, done))?;
                        report.destroyed += 1;
                    }
                    Step::CreateGi { profile, start } => {
                        let size = geometry
                            .and_then(|g| g.by_id(*profile))
                            .map(|p| p.memory_slices)
                            .unwrap_or(1);
                        let gi = backend
                            .create_gpu_instance(
                                gpu,
                                *profile,
                                SlicePlacement {
                                    start: *start,
                                    size,
                                },
                            )
                            .map_err(|e| fail(e, done))?;
                        created_gis.insert(*start, gi.id);
                        report.created += 1;
                    }
                    Step::CreateCi { gi_start, profile } => {
                        let gi_id = created_gis.get(gi_start).copied().or_else(|| {
                            snap.and_then(|s| {
                                s.observed
                                    .gis
                                    .iter()
                                    .find(|g| g.start == *gi_start)
                                    .map(|g| g.id)
                            })
                        });
                        let Some(gi_id) = gi_id else {
                            return Err(fail(
                                BackendError::NotFound {
                                    what: format!("GPU instance at slice {gi_start}"),
                                },
                                done,
                            ));
                        };
                        backend
                            .create_compute_instance(gpu, gi_id, *profile)
                            .map_err(|e| fail(e, done))?;
                        report.created += 1;
                    }
                }
                progressed = true;
                if is_mode {
                    // The rest of this GPU's plan assumed the old mode: re-read first.
                    break;
                }
            }
        }
        if !refused_reset.is_empty() && !progressed {
            refused_reset.sort_unstable();
            refused_reset.dedup();
            report.outcome = ApplyOutcome::NeedsReboot {
                gpus: refused_reset,
            };
            return Ok(report);
        }
    }
    let plan = planner(observe(backend, probe)?)?;
    report.gpus = plan.reports();
    let gpus = plan
        .gpus
        .iter()
        .filter(|(p, _, _)| !p.is_converged())
        .map(|(p, _, _)| p.index)
        .collect::<Vec<_>>();
    if gpus.is_empty() {
        return Ok(report);
    }
    if gpus.iter().all(|g| refused_reset.contains(g)) {
        report.outcome = ApplyOutcome::NeedsReboot { gpus };
        return Ok(report);
    }
    Err(ApplyError::NotConverged {
        gpus,
        rounds: MAX_ROUNDS,
    })
}

/// The current MIG layout of the node as a mig-parted config named `name`:
/// one entry per group of GPUs (same PCI id and same layout), with the GPU
/// indices. Applying it to the same node changes nothing.
pub fn export(backend: &dyn GpuBackend, name: &str) -> Result<ExportedConfig, ApplyError> {
    let snapshots = observe_with(backend, &NoProcesses, false)?;
    // (PCI id, MIG on, profile counts, GPU indices) per group of identical GPUs.
    type Group = (u32, bool, BTreeMap<String, u32>, Vec<u32>);
    let mut groups: Vec<Group> = Vec::new();
    for s in snapshots.iter().filter(|s| s.mig.is_some()) {
        let enabled = s.observed.mode.current;
        let mut devices: BTreeMap<String, u32> = BTreeMap::new();
        let geometry = s.geometry();
        if let Some(state) = &s.mig {
            for gi in &state.gpu_instances {
                let gi_name = geometry
                    .and_then(|g| g.by_id(gi.profile_id))
                    .map(|p| (p.name.clone(), p.compute_slices))
                    .or_else(|| {
                        MigProfileName::parse(&gi.profile_name).ok().map(|n| {
                            let g = n.gpu_slices();
                            (n, g)
                        })
                    });
                let Some((gi_name, g)) = gi_name else {
                    continue;
                };
                let cis = &gi.compute_instances;
                if cis.len() == 1 && cis[0].slice_count == g {
                    *devices.entry(gi_name.to_string()).or_default() += 1;
                } else {
                    for ci in cis {
                        let n = gi_name.clone().with_compute(ci.slice_count);
                        *devices.entry(n.to_string()).or_default() += 1;
                    }
                }
            }
        }
        let device = s.info.pci_device_id;
        match groups
            .iter_mut()
            .find(|(d, e, m, _)| *d == device && *e == enabled && *m == devices)
        {
            Some(g) => g.3.push(s.info.index),
            None => groups.push((device, enabled, devices, vec![s.info.index])),
        }
    }
    let total = snapshots.iter().filter(|s| s.mig.is_some()).count();
    let entries = groups
        .into_iter()
        .map(|(device, enabled, devices, indices)| ExportedEntry {
            device_filter: catalog::format_pci_id(device),
            devices: if indices.len() == total {
                serde_json::Value::String("all".into())
            } else {
                serde_json::Value::Array(indices.into_iter().map(|i| i.into()).collect())
            },
            mig_enabled: enabled,
            mig_devices: if enabled { Some(devices) } else { None },
        })
        .collect();
    let mut mig_configs = BTreeMap::new();
    mig_configs.insert(name.to_string(), entries);
    Ok(ExportedConfig {
        version: "v1".to_string(),
        mig_configs,
    })
}

/// A mig-parted config file as `export` writes it.
#[derive(Debug, Clone, Serialize)]
pub struct ExportedConfig {
    /// Always `v1`.
    pub version: String,
    /// One named config.
    #[serde(rename = "mig-configs")]
    pub mig_configs: BTreeMap<String, Vec<ExportedEntry>>,
}

/// One entry of an exported config.
#[derive(Debug, Clone, Serialize)]
pub struct ExportedEntry {
    /// PCI id of the GPUs.
    #[serde(rename = "device-filter")]
    pub device_filter: String,
    /// `all` or indices.
    pub devices: serde_json::Value,
    /// MIG mode.
    #[serde(rename = "mig-enabled")]
    pub mig_enabled: bool,
    /// Profile → count.
    #[serde(rename = "mig-devices", skip_serializing_if = "Option::is_none")]
    pub mig_devices: Option<BTreeMap<String, u32>>,
}

impl ExportedConfig {
    /// YAML text.
    pub fn to_yaml(&self) -> String {
        serde_saphyr::to_string(self).unwrap_or_default()
    }
}
