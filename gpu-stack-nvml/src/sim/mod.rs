//! Simulated GPUs: a [`GpuBackend`] over GPUs described by a fleet file.
//!
//! MIG operations obey the catalog geometry through `gpu_stack_core::mig::validate`
//! and fail the way NVML does; telemetry is deterministic for a seed; faults (Xid,
//! falling off the bus, failing or slow calls) come from the fleet file or are
//! injected at runtime. With a state file, several processes share one node.

pub mod state;
pub mod telemetry;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use gpu_stack_core::backend::{
    BackendError, CallClass, ComputeInstance, Fault, FaultError, FaultSpec, GpuBackend, GpuInfo,
    GpuInstance, GpuInstanceProfile, GpuProcess, GpuTelemetry, HealthEvent, HealthEventKind,
    HealthEvents, MigChangeLock, MigMode, MigModeChange, MigTelemetry, SimTelemetry,
    SlicePlacement, SystemInfo,
};
use gpu_stack_core::catalog::{self, GpuModel};
use gpu_stack_core::fleet::{Fleet, FleetNode, FleetProcess};
use gpu_stack_core::mig::{self, MigGeometry, PlacedInstance, Violation};

use state::{
    CiState, GiState, GpuState, NodeState, ProcState, STATE_VERSION, ScheduledFault, Store,
};
use telemetry::mix;

const MIB: u64 = 1 << 20;

/// Driver version the simulated node reports unless the spec says otherwise.
pub const DEFAULT_DRIVER_VERSION: &str = "570.133.20";

/// Problems in a simulated node description.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A GPU model is not in the catalog.
    #[error("node {node}, GPU {gpu}: {source}")]
    UnknownModel {
        /// Node.
        node: String,
        /// GPU index.
        gpu: u32,
        /// Catalog error.
        source: catalog::CatalogError,
    },
    /// An initial MIG layout is not valid on its GPU.
    #[error("node {node}, GPU {gpu} ({model}): initial MIG layout {layout} is invalid: {reasons}")]
    InvalidLayout {
        /// Node.
        node: String,
        /// GPU index.
        gpu: u32,
        /// Model.
        model: String,
        /// Layout as written.
        layout: String,
        /// Broken rules.
        reasons: String,
    },
    /// MIG is asked of a GPU without MIG.
    #[error("node {node}, GPU {gpu}: {model} has no MIG; remove its mig section")]
    NoMig {
        /// Node.
        node: String,
        /// GPU index.
        gpu: u32,
        /// Model.
        model: String,
    },
    /// A fault names a GPU the node does not have.
    #[error("node {node}: fault names GPU {gpu} but the node has {count} GPUs")]
    FaultGpu {
        /// Node.
        node: String,
        /// GPU index named.
        gpu: u32,
        /// GPUs on the node.
        count: usize,
    },
    /// A declared process cannot run where it is placed.
    #[error("node {node}, GPU {gpu}: process {pid}: {reason}")]
    BadProcess {
        /// Node.
        node: String,
        /// GPU index.
        gpu: u32,
        /// Process id.
        pid: u32,
        /// What is wrong.
        reason: String,
    },
    /// The fleet file could not be used.
    #[error("{0}")]
    Fleet(String),
    /// The state file could not be opened.
    #[error(transparent)]
    State(#[from] BackendError),
}

/// One GPU of a simulated node.
#[derive(Debug, Clone, PartialEq)]
pub struct SimGpuSpec {
    /// Catalog model name or PCI device id.
    pub model: String,
    /// MIG mode at start.
    pub mig_enabled: bool,
    /// GPU instances at start (each gets one full compute instance).
    pub instances: Vec<PlacedInstance>,
    /// Instances pods use now (a subset of `instances`): their compute instances
    /// cannot be destroyed and the GPU's MIG mode cannot change.
    pub in_use: Vec<PlacedInstance>,
    /// Telemetry profile; the node's when `None`.
    pub telemetry: Option<SimTelemetry>,
    /// Compute processes running at start (the `gpu` field is ignored; an
    /// `instance` must be one of `instances`). They end when their instance is
    /// destroyed or the MIG mode changes; a GPU reset is refused while any run.
    pub processes: Vec<FleetProcess>,
}

impl SimGpuSpec {
    /// A GPU of `model` with MIG off.
    pub fn new(model: &str) -> Self {
        SimGpuSpec {
            model: model.to_string(),
            mig_enabled: false,
            instances: Vec::new(),
            in_use: Vec::new(),
            telemetry: None,
            processes: Vec::new(),
        }
    }
}

/// A simulated node.
#[derive(Debug, Clone, PartialEq)]
pub struct SimNodeSpec {
    /// Node name (part of every UUID, so nodes differ).
    pub node: String,
    /// GPUs in index order.
    pub gpus: Vec<SimGpuSpec>,
    /// Faults, scheduled relative to the start of the simulation.
    pub faults: Vec<FaultSpec>,
    /// Telemetry profile of the node's GPUs.
    pub telemetry: SimTelemetry,
    /// MIG mode changes need a GPU reset before they take effect.
    pub mig_change_needs_reset: bool,
    /// Driver version reported.
    pub driver_version: String,
}

impl SimNodeSpec {
    /// A node with `count` GPUs of `model`, MIG off, no faults.
    pub fn uniform(node: &str, model: &str, count: u32) -> Self {
        SimNodeSpec {
            node: node.to_string(),
            gpus: (0..count).map(|_| SimGpuSpec::new(model)).collect(),
            faults: Vec::new(),
            telemetry: SimTelemetry::default(),
            mig_change_needs_reset: false,
            driver_version: DEFAULT_DRIVER_VERSION.to_string(),
        }
    }
}

impl SimNodeSpec {
    /// The node `node` of a fleet; `None` picks the only node that has GPUs.
    pub fn from_fleet(fleet: &Fleet, node: Option<&str>) -> Result<Self, SimError> {
        let with_gpus: Vec<&FleetNode> =
            fleet.nodes.iter().filter(|n| !n.gpus.is_empty()).collect();
        let n = match node {
            Some(name) => fleet.nodes.iter().find(|n| n.name == name).ok_or_else(|| {
                SimError::Fleet(format!(
                    "the fleet has no node {name:?} (nodes: {})",
                    fleet
                        .nodes
                        .iter()
                        .map(|n| n.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?,
            None => match with_gpus.as_slice() {
                [one] => *one,
                [] => return Err(SimError::Fleet("the fleet has no node with GPUs".into())),
                many => {
                    return Err(SimError::Fleet(format!(
                        "the fleet has {} nodes with GPUs; pick one with --node ({})",
                        many.len(),
                        gpu_stack_core::echo::join_capped(
                            &many.iter().map(|n| n.name.as_str()).collect::<Vec<_>>()
                        )
                    )));
                }
            },
        };
        let mut gpus = Vec::new();
        for g in &n.gpus {
            let mig = g.mig.clone().unwrap_or_default();
            for _ in 0..g.count {
                let index = gpus.len() as u32;
                gpus.push(SimGpuSpec {
                    model: g.model.clone(),
                    mig_enabled: mig.enabled,
                    instances: mig.instances.clone(),
                    in_use: mig.in_use.clone(),
                    telemetry: g.telemetry,
                    processes: n
                        .processes
                        .iter()
                        .filter(|p| p.gpu == index)
                        .cloned()
                        .collect(),
                });
            }
        }
        Ok(SimNodeSpec {
            node: n.name.clone(),
            gpus,
            faults: n.faults.clone(),
            telemetry: n.telemetry.unwrap_or_default(),
            mig_change_needs_reset: n.mig_change_needs_reset,
            driver_version: n
                .driver_version
                .clone()
                .unwrap_or_else(|| DEFAULT_DRIVER_VERSION.to_string()),
        })
    }

    /// Reads a fleet file and takes node `node` from it.
    pub fn from_fleet_file(path: &Path, node: Option<&str>) -> Result<Self, SimError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            SimError::Fleet(format!("cannot read fleet file {}: {e}", path.display()))
        })?;
        let fleet = Fleet::from_yaml(&text)
            .map_err(|e| SimError::Fleet(format!("{}: {e}", path.display())))?;
        Self::from_fleet(&fleet, node)
    }
}

/// Where "now" comes from: the wall clock, or a clock tests move by hand.
#[derive(Debug, Clone)]
pub enum SimClock {
    /// Real time.
    Wall,
    /// Milliseconds since the simulation started, set by the owner.
    Manual(Arc<AtomicU64>),
}

impl SimClock {
    /// A manual clock at 0 and a handle to move it.
    pub fn manual() -> (SimClock, Arc<AtomicU64>) {
        let handle = Arc::new(AtomicU64::new(0));
        (SimClock::Manual(handle.clone()), handle)
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Formats 128 bits of a hash as a UUID body `8-4-4-4-12`.
fn uuid_body(a: u64, b: u64) -> String {
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xffff,
        b >> 48,
        b & 0xffff_ffff_ffff
    )
}

fn str_hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn gpu_uuid(node: &str, index: u32) -> String {
    let a = mix(str_hash(node) ^ u64::from(index));
    format!("GPU-{}", uuid_body(a, mix(a)))
}

fn mig_uuid(gpu_uuid: &str, gi: u32, ci: u32) -> String {
    let a = mix(str_hash(gpu_uuid) ^ (u64::from(gi) << 32) ^ u64::from(ci));
    format!("MIG-{}", uuid_body(a, mix(a ^ 0x004d_4947)))
}

const BUS_IDS: [u32; 8] = [0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD];

fn bus_id(index: u32) -> String {
    let bus = BUS_IDS.get(index as usize).copied().unwrap_or(0xC0 + index);
    format!("00000000:{bus:02X}:00.0")
}

struct Shared {
    store: Store,
    clock: SimClock,
    /// Wall-clock start for [`SimClock::Wall`], per state epoch.
    epoch_unix_ms: u64,
    driver_version: String,
}

/// A [`GpuBackend`] over simulated GPUs.
#[derive(Clone)]
pub struct SimulatedBackend {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for SimulatedBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimulatedBackend").finish_non_exhaustive()
    }
}

fn model_of(gpu: &GpuState) -> Result<&'static GpuModel, BackendError> {
    catalog::lookup(&gpu.model).map_err(|e| BackendError::Other {
        message: format!("simulated GPU {}: {e}", gpu.index),
    })
}

fn geometry_of(gpu: &GpuState) -> Result<&'static MigGeometry, BackendError> {
    model_of(gpu)?
        .mig
        .as_ref()
        .ok_or_else(|| BackendError::NotSupported {
            gpu: gpu.index,
            operation: "MIG (this GPU model has no MIG)".into(),
        })
}

fn gi_memory_mib(model: &GpuModel, geo: &MigGeometry, p: &mig::GiProfile) -> u64 {
    p.memory_mib.unwrap_or_else(|| {
        model.memory_mib * u64::from(p.memory_slices) / u64::from(geo.memory_slices.max(1))
    })
}

fn placed_layout(geo: &MigGeometry, gpu: &GpuState) -> Vec<PlacedInstance> {
    gpu.gpu_instances
        .iter()
        .filter_map(|gi| {
            geo.by_id(gi.profile_id)
                .map(|p| PlacedInstance::new(p.name.clone(), gi.start))
        })
        .collect()
}

fn lowest_free(used: impl Iterator<Item = u32>, from: u32) -> u32 {
    let mut used: Vec<u32> = used.collect();
    used.sort_unstable();
    let mut id = from;
    for u in used {
        if u == id {
            id += 1;
        } else if u > id {
            break;
        }
    }
    id
}

fn proc_public(p: &ProcState) -> GpuProcess {
    GpuProcess {
        pid: p.pid,
        used_memory_bytes: p.used_memory_mib.map(|m| m * MIB),
        gpu_instance_id: p.gpu_instance,
        compute_instance_id: p.compute_instance,
    }
}

fn ci_public(gi: &GiState, ci: &CiState) -> ComputeInstance {
    let _ = gi;
    ComputeInstance {
        id: ci.id,
        profile_id: ci_profile_enum(ci.slice_count),
        slice_count: ci.slice_count,
        placement: SlicePlacement {
            start: ci.start,
            size: ci.slice_count,
        },
        uuid: ci.uuid.clone(),
    }
}

/// NVML compute-instance profile enum for `c` compute slices.
pub fn ci_profile_enum(c: u32) -> u32 {
    match c {
        1 => 0,
        2 => 1,
        3 => 2,
        4 => 3,
        7 => 4,
        8 => 5,
        6 => 6,
        other => other,
    }
}

fn gi_public(geo: &MigGeometry, gi: &GiState) -> GpuInstance {
    GpuInstance {
        id: gi.id,
        profile_id: gi.profile_id,
        profile_name: geo
            .by_id(gi.profile_id)
            .map(|p| p.name.to_string())
            .unwrap_or_else(|| format!("profile-{}", gi.profile_id)),
        placement: SlicePlacement {
            start: gi.start,
            size: gi.size,
        },
        compute_instances: gi
            .compute_instances
            .iter()
            .map(|ci| ci_public(gi, ci))
            .collect(),
    }
}

fn fault_error(gpu: u32, class: CallClass, e: FaultError) -> BackendError {
    let operation = format!("{class:?} call (injected fault)").to_lowercase();
    match e {
        FaultError::Unknown => BackendError::Other {
            message: format!("GPU {gpu}: unknown error on {operation}"),
        },
        FaultError::NoPermission => BackendError::NoPermission { gpu, operation },
        FaultError::NotSupported => BackendError::NotSupported { gpu, operation },
        FaultError::Timeout => BackendError::Timeout { operation },
        FaultError::GpuLost => BackendError::GpuLost { gpu },
    }
}

fn targets(spec: &FaultSpec, gpus: usize) -> Vec<u32> {
    match spec.gpu {
        Some(g) => vec![g],
        None => (0..gpus as u32).collect(),
    }
}

/// Applies every fault whose moment has come.
fn advance(state: &mut NodeState, now_ms: u64) {
    let mut fired = Vec::new();
    for f in state.faults.iter_mut() {
        if !f.fired && f.spec.at_ms <= now_ms {
            f.fired = true;
            fired.push(f.spec.clone());
        }
    }
    for spec in fired {
        for g in targets(&spec, state.gpus.len()) {
            let Some(gpu) = state.gpus.get_mut(g as usize) else {
                continue;
            };
            let uuid = gpu.uuid.clone();
            let event = |kind, gi: Option<u32>| HealthEvent {
                gpu: g,
                uuid: uuid.clone(),
                gpu_instance_id: gi,
                compute_instance_id: gi.map(|_| 0),
                kind,
            };
            match &spec.fault {
                Fault::Xid { xid, gpu_instance } => {
                    gpu.last_xid = *xid;
                    state.push_event(event(HealthEventKind::Xid { xid: *xid }, *gpu_instance));
                }
                Fault::FallOffBus => {
                    gpu.last_xid = 79;
                    gpu.lost = true;
                    state.push_event(event(HealthEventKind::Xid { xid: 79 }, None));
                    state.push_event(event(HealthEventKind::GpuLost, None));
                }
                Fault::FailCalls { .. } | Fault::SlowCalls { .. } => {}
            }
        }
    }
}

fn matches_class(fault: CallClass, call: CallClass) -> bool {
    fault == CallClass::All || fault == call
}

impl SimulatedBackend {
    /// A node in this process's memory, on the wall clock.
    pub fn new(spec: &SimNodeSpec) -> Result<Self, SimError> {
        Self::build(spec, None, SimClock::Wall)
    }

    /// A node with an explicit clock (tests move a manual clock).
    pub fn with_clock(spec: &SimNodeSpec, clock: SimClock) -> Result<Self, SimError> {
        Self::build(spec, None, clock)
    }

    /// A node kept in `state_file`, shared with other processes that open the same
    /// file: created from `spec` when the file is new, joined as it is otherwise.
    pub fn with_state_file(spec: &SimNodeSpec, state_file: &Path) -> Result<Self, SimError> {
        Self::build(spec, Some(state_file), SimClock::Wall)
    }

    /// Like [`SimulatedBackend::with_state_file`] with an explicit clock.
    pub fn with_state_file_and_clock(
        spec: &SimNodeSpec,
        state_file: &Path,
        clock: SimClock,
    ) -> Result<Self, SimError> {
        Self::build(spec, Some(state_file), clock)
    }

    fn build(spec: &SimNodeSpec, file: Option<&Path>, clock: SimClock) -> Result<Self, SimError> {
        let initial = initial_state(spec)?;
        let store = match file {
            None => Store::Memory(std::sync::Mutex::new(initial)),
            Some(path) => Store::open_file(path, initial)?,
        };
        let epoch_unix_ms = store.update(|s| Ok(s.epoch_unix_ms))?;
        let backend = SimulatedBackend {
            shared: Arc::new(Shared {
                store,
                clock,
                epoch_unix_ms,
                driver_version: spec.driver_version.clone(),
            }),
        };
        let now = backend.now_ms();
        backend.shared.store.update(|s| {
            advance(s, now);
            Ok(())
        })?;
        Ok(backend)
    }

    /// Milliseconds since the simulation started.
    pub fn now_ms(&self) -> u64 {
        match &self.shared.clock {
            SimClock::Wall => unix_ms().saturating_sub(self.shared.epoch_unix_ms),
            SimClock::Manual(ms) => ms.load(Ordering::SeqCst),
        }
    }

    /// Schedules a fault `spec.at_ms` milliseconds from now (0 = at once).
    pub fn inject(&self, mut spec: FaultSpec) -> Result<(), BackendError> {
        let now = self.now_ms();
        spec.at_ms = now.saturating_add(spec.at_ms);
        self.shared.store.update(|s| {
            if let Some(g) = spec.gpu
                && g as usize >= s.gpus.len()
            {
                return Err(BackendError::NotFound {
                    what: format!("GPU {g} (the node has {} GPUs)", s.gpus.len()),
                });
            }
            s.faults.push(ScheduledFault { spec, fired: false });
            advance(s, now);
            Ok(())
        })
    }

    /// Starts a simulated compute process on GPU `gpu`: on MIG device
    /// (`gpu_instance`, `compute_instance`) when MIG is on (the compute
    /// instance defaults to the GPU instance's first), on the whole GPU when it
    /// is off. `pid` defaults to the lowest free id from 4000. The process is
    /// listed by [`GpuBackend::running_processes`] until it is stopped, its
    /// instance is destroyed, the MIG mode changes or the node reboots; GPU
    /// resets are refused while it runs.
    pub fn start_process(
        &self,
        gpu: u32,
        gpu_instance: Option<u32>,
        compute_instance: Option<u32>,
        pid: Option<u32>,
        used_memory_mib: Option<u64>,
    ) -> Result<GpuProcess, BackendError> {
        self.on_gpu(gpu, CallClass::Inventory, |g, node, _| {
            let (gi, ci) = match (g.mig_current, gpu_instance) {
                (true, Some(gi_id)) => {
                    let gi = g
                        .gpu_instances
                        .iter()
                        .find(|x| x.id == gi_id)
                        .ok_or_else(|| BackendError::NotFound {
                            what: format!(
                                "GPU instance {gi_id} on GPU {gpu} (instances: {:?})",
                                g.gpu_instances.iter().map(|x| x.id).collect::<Vec<_>>()
                            ),
                        })?;
                    let ci = match compute_instance {
                        Some(c) => gi
                            .compute_instances
                            .iter()
                            .find(|x| x.id == c)
                            .map(|x| x.id),
                        None => gi.compute_instances.first().map(|x| x.id),
                    }
                    .ok_or_else(|| BackendError::NotFound {
                        what: format!(
                            "compute instance {} in GPU instance {gi_id} on GPU {gpu}; a process runs on a compute instance",
                            compute_instance.map_or("(any)".to_string(), |c| c.to_string())
                        ),
                    })?;
                    (Some(gi_id), Some(ci))
                }
                (true, None) => {
                    return Err(BackendError::InvalidArgument {
                        gpu,
                        detail: "MIG is on: a process runs on a MIG device; name its GPU instance (GPU:GI)".into(),
                    });
                }
                (false, Some(gi_id)) => {
                    return Err(BackendError::InvalidArgument {
                        gpu,
                        detail: format!(
                            "MIG is off, so there is no GPU instance {gi_id}; start the process on the whole GPU"
                        ),
                    });
                }
                (false, None) => (None, None),
            };
            let taken = |p: u32| {
                node.gpus
                    .iter()
                    .chain(std::iter::once(&*g))
                    .any(|x| x.processes.iter().any(|q| q.pid == p))
            };
            let pid = match pid {
                Some(0) => {
                    return Err(BackendError::InvalidArgument {
                        gpu,
                        detail: "pid 0 is not a process id".into(),
                    });
                }
                Some(p) if g.processes.iter().any(|q| q.pid == p) => {
                    return Err(BackendError::InvalidArgument {
                        gpu,
                        detail: format!("process {p} already runs on this GPU"),
                    });
                }
                Some(p) => p,
                None => (4000u32..).find(|p| !taken(*p)).unwrap_or(u32::MAX),
            };
            let proc = ProcState {
                pid,
                gpu_instance: gi,
                compute_instance: ci,
                used_memory_mib,
            };
            let out = proc_public(&proc);
            g.processes.push(proc);
            Ok(out)
        })
    }

    /// Stops simulated process `pid` on GPU `gpu`, or on every GPU of the node
    /// when `gpu` is `None`. Returns how many processes ended; `NotFound` when
    /// none had that pid.
    pub fn stop_process(&self, gpu: Option<u32>, pid: u32) -> Result<usize, BackendError> {
        let now = self.now_ms();
        self.shared.store.update(|s| {
            advance(s, now);
            if let Some(g) = gpu
                && g as usize >= s.gpus.len()
            {
                return Err(BackendError::NotFound {
                    what: format!("GPU {g} (the node has {} GPUs)", s.gpus.len()),
                });
            }
            let mut ended = 0;
            for g in s.gpus.iter_mut() {
                if gpu.is_some_and(|i| i != g.index) {
                    continue;
                }
                let before = g.processes.len();
                g.processes.retain(|p| p.pid != pid);
                ended += before - g.processes.len();
            }
            if ended == 0 {
                return Err(BackendError::NotFound {
                    what: format!(
                        "process {pid} on {}",
                        gpu.map_or("any GPU".to_string(), |g| format!("GPU {g}"))
                    ),
                });
            }
            Ok(ended)
        })
    }

    /// Simulates a node reboot: every GPU comes back with its pending MIG
    /// mode in force, no MIG instances (they do not survive a reboot, which
    /// is why the MIG manager applies its config at start), no processes, and
    /// answering again if it had fallen off the bus.
    pub fn reboot(&self) -> Result<(), BackendError> {
        let now = self.now_ms();
        self.shared.store.update(|s| {
            advance(s, now);
            for g in s.gpus.iter_mut() {
                g.mig_current = g.mig_pending;
                g.gpu_instances.clear();
                g.processes.clear();
                g.in_use = false;
                g.lost = false;
            }
            Ok(())
        })
    }

    /// A copy of the whole node state (for tests and debugging).
    pub fn snapshot(&self) -> Result<NodeState, BackendError> {
        let now = self.now_ms();
        self.shared.store.update(|s| {
            advance(s, now);
            Ok(s.clone())
        })
    }

    /// Runs `f` on one GPU under the state lock, after faults are applied.
    fn on_gpu<R>(
        &self,
        gpu: u32,
        class: CallClass,
        f: impl FnOnce(&mut GpuState, &mut NodeState, u64) -> Result<R, BackendError>,
    ) -> Result<R, BackendError> {
        let now = self.now_ms();
        let mut delay = 0u64;
        let out = self.shared.store.update(|s| {
            advance(s, now);
            let count = s.gpus.len();
            if gpu as usize >= count {
                return Err(BackendError::NotFound {
                    what: format!("GPU {gpu} (the node has {count} GPUs)"),
                });
            }
            let mut failure = None;
            for sf in s.faults.iter().filter(|f| f.fired) {
                if sf.spec.gpu.is_some_and(|g| g != gpu) {
                    continue;
                }
                match sf.spec.fault {
                    Fault::SlowCalls { calls, delay_ms } if matches_class(calls, class) => {
                        delay = delay.saturating_add(delay_ms);
                    }
                    Fault::FailCalls { calls, error } if matches_class(calls, class) => {
                        failure.get_or_insert(fault_error(gpu, class, error));
                    }
                    _ => {}
                }
            }
            if s.gpus[gpu as usize].lost {
                return Err(BackendError::GpuLost { gpu });
            }
            if let Some(e) = failure {
                return Err(e);
            }
            let mut g = s.gpus[gpu as usize].clone();
            let r = f(&mut g, s, now);
            s.gpus[gpu as usize] = g;
            r
        });
        if delay > 0 {
            std::thread::sleep(Duration::from_millis(delay));
        }
        out
    }

    fn tick(gpu: &GpuState, now_ms: u64) -> u64 {
        now_ms / gpu.telemetry.tick_ms.max(1)
    }

    /// Telemetry of a GPU at an explicit tick (deterministic for the seed).
    pub fn gpu_telemetry_at(&self, gpu: u32, tick: u64) -> Result<GpuTelemetry, BackendError> {
        self.on_gpu(gpu, CallClass::Telemetry, |g, _, _| {
            Ok(telemetry::gpu_sample(model_of(g)?, g, tick))
        })
    }
}

fn initial_state(spec: &SimNodeSpec) -> Result<NodeState, SimError> {
    let mut gpus = Vec::with_capacity(spec.gpus.len());
    let count = spec.gpus.len() as u32;
    for (i, g) in spec.gpus.iter().enumerate() {
        let index = i as u32;
        let model = catalog::lookup(&g.model).map_err(|source| SimError::UnknownModel {
            node: spec.node.clone(),
            gpu: index,
            source,
        })?;
        let uuid = gpu_uuid(&spec.node, index);
        let mut gis = Vec::new();
        if g.mig_enabled || !g.instances.is_empty() {
            let geo = model.mig.as_ref().ok_or_else(|| SimError::NoMig {
                node: spec.node.clone(),
                gpu: index,
                model: model.name.clone(),
            })?;
            let layout_text = mig::format_layout(&g.instances);
            mig::validate(geo, &g.instances).map_err(|v| SimError::InvalidLayout {
                node: spec.node.clone(),
                gpu: index,
                model: model.name.clone(),
                layout: layout_text.clone(),
                reasons: v
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; "),
            })?;
            for (k, inst) in g.instances.iter().enumerate() {
                let p = geo
                    .resolve(&inst.profile)
                    .ok_or_else(|| SimError::InvalidLayout {
                        node: spec.node.clone(),
                        gpu: index,
                        model: model.name.clone(),
                        layout: layout_text.clone(),
                        reasons: format!("unknown profile {}", inst.profile),
                    })?;
                let id = k as u32 + 1;
                gis.push(GiState {
                    id,
                    profile_id: p.id,
                    start: inst.start,
                    size: p.memory_slices,
                    in_use: g.in_use.contains(inst),
                    compute_instances: vec![CiState {
                        id: 0,
                        slice_count: p.compute_slices,
                        start: 0,
                        uuid: mig_uuid(&uuid, id, 0),
                    }],
                });
            }
        }
        let mut processes: Vec<ProcState> = Vec::new();
        for p in &g.processes {
            let bad = |reason: String| SimError::BadProcess {
                node: spec.node.clone(),
                gpu: index,
                pid: p.pid,
                reason,
            };
            if p.pid == 0 || processes.iter().any(|q| q.pid == p.pid) {
                return Err(bad("pid is 0 or appears twice on this GPU".into()));
            }
            let gpu_instance = match (&p.instance, g.mig_enabled) {
                (Some(inst), true) => {
                    let k = g.instances.iter().position(|i| i == inst).ok_or_else(|| {
                        bad(format!("instance {inst} is not one of the GPU's instances"))
                    })?;
                    Some(k as u32 + 1)
                }
                (None, false) => None,
                (None, true) => {
                    return Err(bad("MIG is on: name the instance it runs on".into()));
                }
                (Some(inst), false) => {
                    return Err(bad(format!("names instance {inst} but MIG is off")));
                }
            };
            processes.push(ProcState {
                pid: p.pid,
                gpu_instance,
                compute_instance: gpu_instance.map(|_| 0),
                used_memory_mib: p.used_memory_mib,
            });
        }
        let mut telemetry = g.telemetry.unwrap_or(spec.telemetry);
        telemetry.seed ^= mix(u64::from(index));
        gpus.push(GpuState {
            index,
            model: model.name.clone(),
            uuid,
            pci_bus_id: bus_id(index),
            numa_node: Some(if count >= 2 { index * 2 / count } else { 0 }),
            mig_current: g.mig_enabled,
            mig_pending: g.mig_enabled,
            in_use: false,
            lost: false,
            last_xid: 0,
            gpu_instances: gis,
            telemetry,
            processes,
        });
    }
    for f in &spec.faults {
        if let Some(g) = f.gpu
            && g >= count
        {
            return Err(SimError::FaultGpu {
                node: spec.node.clone(),
                gpu: g,
                count: count as usize,
            });
        }
    }
    Ok(NodeState {
        version: STATE_VERSION,
        node: spec.node.clone(),
        epoch_unix_ms: unix_ms(),
        mig_change_needs_reset: spec.mig_change_needs_reset,
        gpus,
        faults: spec
            .faults
            .iter()
            .map(|f| ScheduledFault {
                spec: f.clone(),
                fired: false,
            })
            .collect(),
        events: Vec::new(),
        next_seq: 0,
    })
}

fn require_mig_on(gpu: &GpuState, operation: &str) -> Result<(), BackendError> {
    if gpu.mig_current {
        Ok(())
    } else {
        Err(BackendError::NotSupported {
            gpu: gpu.index,
            operation: format!("{operation}: MIG mode is disabled (enable it first)"),
        })
    }
}

fn violation_error(
    gpu: u32,
    profile: &str,
    placement: SlicePlacement,
    v: &[Violation],
) -> BackendError {
    let detail = format!(
        "cannot place {profile} at {placement}: {}",
        v.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    );
    if v.iter()
        .all(|x| matches!(x, Violation::PlacementNotAllowed { .. }))
    {
        BackendError::InvalidArgument { gpu, detail }
    } else {
        BackendError::InsufficientResources { gpu, detail }
    }
}

impl GpuBackend for SimulatedBackend {
    fn name(&self) -> &str {
        "simulated"
    }

    fn system_info(&self) -> Result<SystemInfo, BackendError> {
        let v = &self.shared.driver_version;
        Ok(SystemInfo {
            driver_version: v.clone(),
            cuda_driver_version: cuda_for_driver(v).to_string(),
            nvml_version: format!("12.{v}"),
        })
    }

    fn device_count(&self) -> Result<u32, BackendError> {
        self.shared.store.update(|s| Ok(s.gpus.len() as u32))
    }

    fn gpu_info(&self, gpu: u32) -> Result<GpuInfo, BackendError> {
        self.on_gpu(gpu, CallClass::Inventory, |g, _, _| {
            let model = model_of(g)?;
            Ok(GpuInfo {
                index: g.index,
                uuid: g.uuid.clone(),
                name: model.product_name.clone(),
                pci_bus_id: g.pci_bus_id.clone(),
                pci_device_id: model.pci_device_ids.first().copied().unwrap_or(0),
                minor_number: g.index,
                memory_total_bytes: model.memory_mib * MIB,
                numa_node: g.numa_node,
                architecture: model.architecture.to_string(),
                compute_capability: model.compute_capability,
                mig_capable: model.mig.is_some(),
                mig_mode: model.mig.as_ref().map(|_| MigMode {
                    current: g.mig_current,
                    pending: g.mig_pending,
                }),
            })
        })
    }

    fn mig_mode(&self, gpu: u32) -> Result<MigMode, BackendError> {
        self.on_gpu(gpu, CallClass::Inventory, |g, _, _| {
            geometry_of(g)?;
            Ok(MigMode {
                current: g.mig_current,
                pending: g.mig_pending,
            })
        })
    }

    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<MigModeChange, BackendError> {
        self.on_gpu(gpu, CallClass::MigChange, |g, node, _| {
            geometry_of(g)?;
            if g.mig_current == enabled && g.mig_pending == enabled {
                return Ok(MigModeChange::Applied);
            }
            if g.in_use || g.gpu_instances.iter().any(|gi| gi.in_use) {
                return Err(BackendError::InUse {
                    gpu,
                    detail: "processes are running on the GPU; stop them before changing MIG mode"
                        .into(),
                });
            }
            if !enabled && !g.gpu_instances.is_empty() {
                return Err(BackendError::InUse {
                    gpu,
                    detail: format!(
                        "{} GPU instances exist; destroy them before disabling MIG",
                        g.gpu_instances.len()
                    ),
                });
            }
            g.mig_pending = enabled;
            if node.mig_change_needs_reset && g.mig_current != enabled {
                Ok(MigModeChange::PendingReset)
            } else {
                if g.mig_current != enabled {
                    // Processes do not survive a MIG mode change.
                    g.processes.clear();
                }
                g.mig_current = enabled;
                Ok(MigModeChange::Applied)
            }
        })
    }

    fn gpu_instance_profiles(&self, gpu: u32) -> Result<Vec<GpuInstanceProfile>, BackendError> {
        self.on_gpu(gpu, CallClass::Inventory, |g, _, _| {
            let model = model_of(g)?;
            let geo = geometry_of(g)?;
            Ok(geo
                .gi_profiles
                .iter()
                .map(|p| GpuInstanceProfile {
                    id: p.id,
                    name: p.name.to_string(),
                    slice_count: p.compute_slices,
                    memory_mib: gi_memory_mib(model, geo, p),
                    multiprocessor_count: p.multiprocessors.unwrap_or(p.compute_slices * 16),
                    instance_count: p.max_instances,
                    placements: p
                        .placements
                        .iter()
                        .map(|pl| SlicePlacement {
                            start: pl.start,
                            size: pl.size,
                        })
                        .collect(),
                })
                .collect::<Vec<_>>())
        })
        .map(|mut v| {
            sort_profiles(&mut v);
            v
        })
    }

    fn gpu_instances(&self, gpu: u32) -> Result<Vec<GpuInstance>, BackendError> {
        self.on_gpu(gpu, CallClass::Inventory, |g, _, _| {
            let geo = geometry_of(g)?;
            require_mig_on(g, "listing GPU instances")?;
            Ok(g.gpu_instances
                .iter()
                .map(|gi| gi_public(geo, gi))
                .collect())
        })
    }

    fn create_gpu_instance(
        &self,
        gpu: u32,
        profile_id: u32,
        placement: SlicePlacement,
    ) -> Result<GpuInstance, BackendError> {
        self.on_gpu(gpu, CallClass::MigChange, |g, _, _| {
            let geo = geometry_of(g)?;
            require_mig_on(g, "creating a GPU instance")?;
            let p = geo
                .by_id(profile_id)
                .ok_or_else(|| BackendError::InvalidArgument {
                    gpu,
                    detail: format!(
                        "no GPU-instance profile id {profile_id} on this GPU (profiles: {})",
                        geo.gi_profiles
                            .iter()
                            .map(|p| format!("{}={}", p.id, p.name))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                })?;
            if placement.size != p.memory_slices {
                return Err(BackendError::InvalidArgument {
                    gpu,
                    detail: format!(
                        "{} occupies {} memory slices, not {}",
                        p.name, p.memory_slices, placement.size
                    ),
                });
            }
            if !p
                .placements
                .iter()
                .any(|pl| pl.start == placement.start && pl.size == placement.size)
            {
                return Err(BackendError::InvalidArgument {
                    gpu,
                    detail: format!(
                        "{} cannot be placed at {placement} (possible placements: {})",
                        p.name,
                        p.placements
                            .iter()
                            .map(|pl| format!("{}:{}", pl.start, pl.size))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                });
            }
            let mut layout = placed_layout(geo, g);
            layout.push(PlacedInstance::new(p.name.clone(), placement.start));
            if let Err(v) = mig::validate(geo, &layout) {
                return Err(violation_error(gpu, &p.name.to_string(), placement, &v));
            }
            let id = lowest_free(g.gpu_instances.iter().map(|gi| gi.id), 1);
            let gi = GiState {
                id,
                profile_id,
                start: placement.start,
                size: placement.size,
                in_use: false,
                compute_instances: Vec::new(),
            };
            let out = gi_public(geo, &gi);
            g.gpu_instances.push(gi);
            g.gpu_instances.sort_by_key(|gi| gi.id);
            Ok(out)
        })
    }

    fn create_compute_instance(
        &self,
        gpu: u32,
        gpu_instance_id: u32,
        slice_count: u32,
    ) -> Result<ComputeInstance, BackendError> {
        self.on_gpu(gpu, CallClass::MigChange, |g, _, _| {
            let geo = geometry_of(g)?;
            require_mig_on(g, "creating a compute instance")?;
            let uuid = g.uuid.clone();
            let gi = g
                .gpu_instances
                .iter_mut()
                .find(|gi| gi.id == gpu_instance_id)
                .ok_or_else(|| BackendError::NotFound {
                    what: format!("GPU instance {gpu_instance_id} on GPU {gpu}"),
                })?;
            let p = geo
                .by_id(gi.profile_id)
                .ok_or_else(|| BackendError::Other {
                    message: format!("GPU instance {gpu_instance_id} has unknown profile"),
                })?;
            let cip = p
                .ci_profiles
                .iter()
                .find(|c| c.compute_slices == slice_count)
                .ok_or_else(|| BackendError::InvalidArgument {
                    gpu,
                    detail: format!(
                        "a {} GPU instance has no {slice_count}-slice compute instance (sizes: {:?})",
                        p.name,
                        p.ci_profiles
                            .iter()
                            .map(|c| c.compute_slices)
                            .collect::<Vec<_>>()
                    ),
                })?;
            let used: u32 = gi.compute_instances.iter().map(|c| c.slice_count).sum();
            let free_start = cip.placements.iter().find(|pl| {
                gi.compute_instances
                    .iter()
                    .all(|c| pl.start + pl.size <= c.start || c.start + c.slice_count <= pl.start)
            });
            let Some(start) = free_start.map(|pl| pl.start) else {
                return Err(BackendError::InsufficientResources {
                    gpu,
                    detail: format!(
                        "GPU instance {gpu_instance_id} ({}) has {used} of {} compute slices in use; no free {slice_count}-slice placement",
                        p.name, p.compute_slices
                    ),
                });
            };
            if used + slice_count > p.compute_slices {
                return Err(BackendError::InsufficientResources {
                    gpu,
                    detail: format!(
                        "GPU instance {gpu_instance_id} has {used} of {} compute slices in use",
                        p.compute_slices
                    ),
                });
            }
            let id = lowest_free(gi.compute_instances.iter().map(|c| c.id), 0);
            let ci = CiState {
                id,
                slice_count,
                start,
                uuid: mig_uuid(&uuid, gpu_instance_id, id),
            };
            let out = ci_public(gi, &ci);
            gi.compute_instances.push(ci);
            gi.compute_instances.sort_by_key(|c| c.id);
            Ok(out)
        })
    }

    fn destroy_compute_instance(
        &self,
        gpu: u32,
        gpu_instance_id: u32,
        compute_instance_id: u32,
    ) -> Result<(), BackendError> {
        self.on_gpu(gpu, CallClass::MigChange, |g, _, _| {
            geometry_of(g)?;
            require_mig_on(g, "destroying a compute instance")?;
            let gi = g
                .gpu_instances
                .iter_mut()
                .find(|gi| gi.id == gpu_instance_id)
                .ok_or_else(|| BackendError::NotFound {
                    what: format!("GPU instance {gpu_instance_id} on GPU {gpu}"),
                })?;
            if gi.in_use && gi.compute_instances.iter().any(|c| c.id == compute_instance_id) {
                return Err(BackendError::InUse {
                    gpu,
                    detail: format!(
                        "processes run on compute instance {compute_instance_id} of GPU instance {gpu_instance_id}; stop them first"
                    ),
                });
            }
            let before = gi.compute_instances.len();
            gi.compute_instances.retain(|c| c.id != compute_instance_id);
            if gi.compute_instances.len() == before {
                return Err(BackendError::NotFound {
                    what: format!(
                        "compute instance {compute_instance_id} in GPU instance {gpu_instance_id} on GPU {gpu}"
                    ),
                });
            }
            // Processes on a destroyed MIG device end with it.
            g.processes.retain(|p| {
                p.gpu_instance != Some(gpu_instance_id)
                    || p.compute_instance != Some(compute_instance_id)
            });
            Ok(())
        })
    }

    fn destroy_gpu_instance(&self, gpu: u32, gpu_instance_id: u32) -> Result<(), BackendError> {
        self.on_gpu(gpu, CallClass::MigChange, |g, _, _| {
            geometry_of(g)?;
            require_mig_on(g, "destroying a GPU instance")?;
            let pos = g
                .gpu_instances
                .iter()
                .position(|gi| gi.id == gpu_instance_id)
                .ok_or_else(|| BackendError::NotFound {
                    what: format!("GPU instance {gpu_instance_id} on GPU {gpu}"),
                })?;
            let cis = g.gpu_instances[pos].compute_instances.len();
            if cis > 0 {
                return Err(BackendError::InUse {
                    gpu,
                    detail: format!(
                        "GPU instance {gpu_instance_id} still has {cis} compute instances; destroy them first"
                    ),
                });
            }
            g.gpu_instances.remove(pos);
            g.processes
                .retain(|p| p.gpu_instance != Some(gpu_instance_id));
            Ok(())
        })
    }

    fn reset_gpu(&self, gpu: u32) -> Result<(), BackendError> {
        // A reset also revives a GPU that fell off the bus, so check by hand.
        let now = self.now_ms();
        self.shared.store.update(|s| {
            advance(s, now);
            let count = s.gpus.len();
            let g = s
                .gpus
                .get_mut(gpu as usize)
                .ok_or_else(|| BackendError::NotFound {
                    what: format!("GPU {gpu} (the node has {count} GPUs)"),
                })?;
            if g.in_use || g.gpu_instances.iter().any(|gi| gi.in_use) {
                return Err(BackendError::InUse {
                    gpu,
                    detail: "processes are running on the GPU; stop them before a reset".into(),
                });
            }
            if !g.processes.is_empty() {
                return Err(BackendError::InUse {
                    gpu,
                    detail: format!(
                        "processes {:?} are running on the GPU; stop them before a reset (or reboot the node)",
                        g.processes.iter().map(|p| p.pid).collect::<Vec<_>>()
                    ),
                });
            }
            g.lost = false;
            g.mig_current = g.mig_pending;
            if !g.mig_current {
                g.gpu_instances.clear();
            }
            Ok(())
        })
    }

    fn gpu_telemetry(&self, gpu: u32) -> Result<GpuTelemetry, BackendError> {
        self.on_gpu(gpu, CallClass::Telemetry, |g, _, now| {
            Ok(telemetry::gpu_sample(model_of(g)?, g, Self::tick(g, now)))
        })
    }

    fn mig_telemetry(&self, gpu: u32) -> Result<Vec<MigTelemetry>, BackendError> {
        self.on_gpu(gpu, CallClass::Telemetry, |g, _, now| {
            let model = model_of(g)?;
            let geo = geometry_of(g)?;
            require_mig_on(g, "MIG telemetry")?;
            let tick = Self::tick(g, now);
            Ok(g.gpu_instances
                .iter()
                .map(|gi| {
                    let mib = geo
                        .by_id(gi.profile_id)
                        .map(|p| gi_memory_mib(model, geo, p))
                        .unwrap_or(0);
                    telemetry::mig_sample(model, g, gi, mib, tick)
                })
                .collect())
        })
    }

    fn running_processes(&self, gpu: u32) -> Result<Vec<GpuProcess>, BackendError> {
        self.on_gpu(gpu, CallClass::Inventory, |g, _, _| {
            let mut out: Vec<GpuProcess> = g.processes.iter().map(proc_public).collect();
            out.sort_by_key(|p| (p.gpu_instance_id, p.compute_instance_id, p.pid));
            Ok(out)
        })
    }

    fn lock_mig_changes(&self) -> Result<MigChangeLock, BackendError> {
        Ok(match self.shared.store.lock_applies()? {
            Some(file) => MigChangeLock::holding(file),
            None => MigChangeLock::none(),
        })
    }

    fn health_events(&self) -> Result<Box<dyn HealthEvents>, BackendError> {
        let now = self.now_ms();
        let next = self.shared.store.update(|s| {
            advance(s, now);
            Ok(s.next_seq)
        })?;
        Ok(Box::new(SimEvents {
            backend: self.clone(),
            next,
        }))
    }
}

/// Canonical order of GPU-instance profiles, the same for every backend: by
/// compute slices, then memory, then hardware id.
pub fn sort_profiles(v: &mut [GpuInstanceProfile]) {
    v.sort_by_key(|p| (p.slice_count, p.memory_mib, p.id));
}

/// CUDA driver API version shipped with a driver branch.
fn cuda_for_driver(driver: &str) -> &'static str {
    let major: u32 = driver
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or(0);
    match major {
        580.. => "13.0",
        575..=579 => "12.9",
        570..=574 => "12.8",
        565..=569 => "12.7",
        560..=564 => "12.6",
        555..=559 => "12.5",
        550..=554 => "12.4",
        545..=549 => "12.3",
        535..=544 => "12.2",
        _ => "12.0",
    }
}

/// A subscription to a simulated node's event log.
struct SimEvents {
    backend: SimulatedBackend,
    next: u64,
}

impl HealthEvents for SimEvents {
    fn wait(&mut self, timeout: Duration) -> Result<Option<HealthEvent>, BackendError> {
        let deadline = Instant::now() + timeout;
        loop {
            let now = self.backend.now_ms();
            let next = self.next;
            let found = self.backend.shared.store.update(|s| {
                advance(s, now);
                Ok(s.events.iter().find(|e| e.seq >= next).cloned())
            })?;
            if let Some(e) = found {
                self.next = e.seq + 1;
                return Ok(Some(e.event));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            std::thread::sleep(left.min(Duration::from_millis(20)));
        }
    }
}
