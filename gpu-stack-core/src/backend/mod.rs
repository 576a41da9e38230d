//! The GPU seam: the [`GpuBackend`] trait every node agent is composed on, and the
//! plain data it speaks.
//!
//! Two implementations live in `gpu-stack-nvml`: one over the NVIDIA driver (NVML)
//! and one over simulated GPUs described by a fleet file. Agents only see this
//! trait, so the device plugin, the exporter, feature discovery and the MIG manager
//! run unchanged on a laptop.
//!
//! The trait is synchronous (NVML is) and object-safe; async callers wrap calls in
//! `spawn_blocking`. Nothing NVIDIA-library specific leaks through: profile and
//! placement numbers are the hardware's (the ones `nvidia-smi mig -lgip/-lgipp`
//! print), errors are a small closed set modelled on NVML's return codes, and every
//! telemetry field says separately whether it is unsupported or failed.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

mod faults;
mod telemetry;

pub use faults::{CallClass, Fault, FaultError, FaultSpec};
pub use telemetry::*;

/// Why a backend call failed. The variants mirror the NVML return codes an agent
/// has to react to differently; everything else is [`BackendError::Other`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum BackendError {
    /// The GPU library could not be loaded or initialised (no driver, wrong path).
    #[error(
        "GPU library unavailable: {detail} (is the NVIDIA driver installed? pass --nvml-lib PATH to point at libnvidia-ml.so.1)"
    )]
    LibraryUnavailable {
        /// What failed, with the path tried.
        detail: String,
    },
    /// The library lacks a function this call needs (driver too old).
    #[error(
        "the GPU library has no function {symbol} (driver too old for this operation; upgrade the driver)"
    )]
    MissingFunction {
        /// The missing C symbol.
        symbol: String,
    },
    /// No GPU with this index, or no instance with this id.
    #[error("not found: {what}")]
    NotFound {
        /// What was looked up.
        what: String,
    },
    /// The device or the driver does not support the operation.
    #[error("not supported on GPU {gpu}: {operation}")]
    NotSupported {
        /// GPU index.
        gpu: u32,
        /// The operation refused.
        operation: String,
    },
    /// The caller lacks the privilege (MIG changes need root / CAP_SYS_ADMIN).
    #[error("no permission on GPU {gpu} for {operation} (run as root or with CAP_SYS_ADMIN)")]
    NoPermission {
        /// GPU index.
        gpu: u32,
        /// The operation refused.
        operation: String,
    },
    /// The resource is busy: processes are running, or a GPU instance still has
    /// compute instances, or MIG mode is not in the state the call needs.
    #[error("in use on GPU {gpu}: {detail}")]
    InUse {
        /// GPU index.
        gpu: u32,
        /// What holds it.
        detail: String,
    },
    /// Not enough free slices (overlapping placement, profile count exhausted).
    #[error("insufficient resources on GPU {gpu}: {detail}")]
    InsufficientResources {
        /// GPU index.
        gpu: u32,
        /// What did not fit.
        detail: String,
    },
    /// An argument is invalid for this device (unknown profile id, placement not
    /// offered by the device).
    #[error("invalid argument for GPU {gpu}: {detail}")]
    InvalidArgument {
        /// GPU index.
        gpu: u32,
        /// What was wrong and what is allowed.
        detail: String,
    },
    /// The GPU fell off the bus or stopped answering; it needs a reset or reboot.
    #[error(
        "GPU {gpu} is lost (fell off the bus or stopped answering); reset the GPU or reboot the node"
    )]
    GpuLost {
        /// GPU index.
        gpu: u32,
    },
    /// The call did not finish in time.
    #[error("timed out: {operation}")]
    Timeout {
        /// The operation.
        operation: String,
    },
    /// Any other failure, with the library's own message.
    #[error("GPU backend error: {message}")]
    Other {
        /// The underlying message.
        message: String,
    },
}

impl BackendError {
    /// Short stable name of the variant, for logs and metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            BackendError::LibraryUnavailable { .. } => "library_unavailable",
            BackendError::MissingFunction { .. } => "missing_function",
            BackendError::NotFound { .. } => "not_found",
            BackendError::NotSupported { .. } => "not_supported",
            BackendError::NoPermission { .. } => "no_permission",
            BackendError::InUse { .. } => "in_use",
            BackendError::InsufficientResources { .. } => "insufficient_resources",
            BackendError::InvalidArgument { .. } => "invalid_argument",
            BackendError::GpuLost { .. } => "gpu_lost",
            BackendError::Timeout { .. } => "timeout",
            BackendError::Other { .. } => "other",
        }
    }
}

/// Driver-wide facts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SystemInfo {
    /// Kernel driver version, e.g. `550.54.15`.
    pub driver_version: String,
    /// CUDA driver API version as `major.minor`, e.g. `12.4`.
    pub cuda_driver_version: String,
    /// NVML library version, e.g. `12.550.54.15`.
    pub nvml_version: String,
}

/// MIG mode of one GPU: the mode in force, and the one that takes effect after
/// the next GPU reset (they differ while a change is pending).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigMode {
    /// MIG mode in force now.
    pub current: bool,
    /// MIG mode after the next reset.
    pub pending: bool,
}

impl MigMode {
    /// True while a requested mode waits for a GPU reset or reboot.
    pub fn reset_pending(&self) -> bool {
        self.current != self.pending
    }
}

/// What a MIG mode change did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MigModeChange {
    /// The new mode is in force now.
    Applied,
    /// The new mode is recorded but needs a GPU reset (or reboot) to take effect.
    PendingReset,
}

/// One physical GPU as an agent needs to know it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// Index in driver enumeration order (`nvidia-smi -i`).
    pub index: u32,
    /// `GPU-xxxxxxxx-...`.
    pub uuid: String,
    /// Marketing name as the driver reports it, e.g. `NVIDIA A100-SXM4-40GB`.
    pub name: String,
    /// PCI bus id `00000000:BB:DD.F`.
    pub pci_bus_id: String,
    /// Combined PCI device and vendor id, e.g. `0x20B010DE`.
    pub pci_device_id: u32,
    /// Minor number: the GPU is `/dev/nvidia<minor>`.
    pub minor_number: u32,
    /// Total framebuffer memory in bytes.
    pub memory_total_bytes: u64,
    /// NUMA node of the GPU, when the platform reports one.
    pub numa_node: Option<u32>,
    /// Architecture name in lower case (`ampere`, `hopper`, `blackwell`, ...).
    pub architecture: String,
    /// CUDA compute capability `(major, minor)`.
    pub compute_capability: (u32, u32),
    /// Whether the GPU can be partitioned with MIG.
    pub mig_capable: bool,
    /// MIG mode; `None` when the GPU is not MIG capable.
    pub mig_mode: Option<MigMode>,
}

/// One GPU that could not be read while listing the others.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuReadError {
    /// Index of the failing GPU.
    pub index: u32,
    /// Why it could not be read.
    pub error: BackendError,
}

/// Everything [`GpuBackend::inventory`] found. A GPU that errors lands in
/// `errors` and does not hide the others.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inventory {
    /// Driver-wide facts.
    pub system: SystemInfo,
    /// GPUs that answered, in index order.
    pub gpus: Vec<GpuInfo>,
    /// GPUs that did not.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<GpuReadError>,
}

/// A span of memory slices a GPU instance occupies (hardware units, as
/// `nvidia-smi mig -lgipp` prints `start:size`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SlicePlacement {
    /// First occupied slice.
    pub start: u32,
    /// Number of occupied slices.
    pub size: u32,
}

impl fmt::Display for SlicePlacement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.start, self.size)
    }
}

/// A GPU-instance profile as the device reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInstanceProfile {
    /// Hardware profile id (the one `nvidia-smi mig -cgi` takes), e.g. 19 for 1g.
    pub id: u32,
    /// Profile name, e.g. `1g.10gb` or `1g.10gb+me`.
    pub name: String,
    /// Compute slices (`g`).
    pub slice_count: u32,
    /// Memory of one instance in MiB.
    pub memory_mib: u64,
    /// Streaming multiprocessors of one instance.
    pub multiprocessor_count: u32,
    /// Most instances of this profile the GPU can hold at once.
    pub instance_count: u32,
    /// Placements the device offers for this profile.
    pub placements: Vec<SlicePlacement>,
}

/// A compute instance inside a GPU instance; with MIG on, each one is a MIG device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ComputeInstance {
    /// Compute-instance id within its GPU instance.
    pub id: u32,
    /// Compute-instance profile id (slice-count enum as nvidia-smi prints it).
    pub profile_id: u32,
    /// Compute slices it uses.
    pub slice_count: u32,
    /// Placement in compute-slice units within the GPU instance.
    pub placement: SlicePlacement,
    /// `MIG-xxxxxxxx-...` UUID of the MIG device, as containers see it.
    pub uuid: String,
}

/// A GPU instance and its compute instances.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInstance {
    /// GPU-instance id (`GPU_I_ID`).
    pub id: u32,
    /// Hardware profile id.
    pub profile_id: u32,
    /// Profile name (`GPU_I_PROFILE`), e.g. `3g.40gb`.
    pub profile_name: String,
    /// Memory slices it occupies.
    pub placement: SlicePlacement,
    /// Its compute instances.
    pub compute_instances: Vec<ComputeInstance>,
}

/// MIG state of one GPU: mode, the profiles the device offers, and what exists.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigState {
    /// GPU index.
    pub gpu: u32,
    /// Current and pending MIG mode.
    pub mode: MigMode,
    /// Instances present now (empty when MIG is off).
    pub gpu_instances: Vec<GpuInstance>,
}

/// What happened to a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum HealthEventKind {
    /// A critical Xid error (e.g. 48 double-bit ECC, 79 fell off the bus).
    Xid {
        /// The Xid number.
        xid: u64,
    },
    /// The GPU no longer answers.
    GpuLost,
}

/// A health event on one GPU, with the MIG instance when known.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthEvent {
    /// GPU index.
    pub gpu: u32,
    /// GPU UUID.
    pub uuid: String,
    /// GPU-instance id, when the event is attributed to one.
    pub gpu_instance_id: Option<u32>,
    /// Compute-instance id, when the event is attributed to one.
    pub compute_instance_id: Option<u32>,
    /// What happened.
    pub kind: HealthEventKind,
}

/// A live subscription to health events of every GPU of a backend.
/// Events that happen after the subscription was made are delivered once, in order.
pub trait HealthEvents: Send {
    /// Blocks for up to `timeout` for the next event; `Ok(None)` when none came.
    fn wait(&mut self, timeout: Duration) -> Result<Option<HealthEvent>, BackendError>;
}

/// A held [`GpuBackend::lock_mig_changes`] lock: released when dropped.
pub struct MigChangeLock {
    held: Option<Box<dyn Send>>,
}

impl MigChangeLock {
    /// A lock that holds nothing.
    pub fn none() -> Self {
        MigChangeLock { held: None }
    }

    /// A lock that lasts as long as `held` (a backend's lock guard or file).
    pub fn holding(held: impl Send + 'static) -> Self {
        MigChangeLock {
            held: Some(Box::new(held)),
        }
    }

    /// Whether it holds anything.
    pub fn is_held(&self) -> bool {
        self.held.is_some()
    }
}

impl std::fmt::Debug for MigChangeLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MigChangeLock")
            .field("held", &self.is_held())
            .finish()
    }
}

/// The GPUs of one node, as every agent sees them.
///
/// Implementations must be cheap to share (`Arc<dyn GpuBackend>`) and safe to call
/// from several threads. Indexes are the driver's enumeration order.
pub trait GpuBackend: Send + Sync {
    /// Short name of the implementation (`simulated`, `nvml`), for logs.
    fn name(&self) -> &str;

    /// Driver-wide facts.
    fn system_info(&self) -> Result<SystemInfo, BackendError>;

    /// Number of GPUs.
    fn device_count(&self) -> Result<u32, BackendError>;

    /// One GPU.
    fn gpu_info(&self, gpu: u32) -> Result<GpuInfo, BackendError>;

    /// Every GPU; one that fails is reported in [`Inventory::errors`], not fatal.
    fn inventory(&self) -> Result<Inventory, BackendError> {
        let system = self.system_info()?;
        let count = self.device_count()?;
        let mut gpus = Vec::with_capacity(count as usize);
        let mut errors = Vec::new();
        for index in 0..count {
            match self.gpu_info(index) {
                Ok(info) => gpus.push(info),
                Err(error) => errors.push(GpuReadError { index, error }),
            }
        }
        Ok(Inventory {
            system,
            gpus,
            errors,
        })
    }

    /// Current and pending MIG mode. `NotSupported` on GPUs without MIG.
    fn mig_mode(&self, gpu: u32) -> Result<MigMode, BackendError>;

    /// Requests MIG mode on or off. Fails `InUse` while instances exist (disable)
    /// or processes run.
    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<MigModeChange, BackendError>;

    /// GPU-instance profiles the device offers, with their possible placements.
    fn gpu_instance_profiles(&self, gpu: u32) -> Result<Vec<GpuInstanceProfile>, BackendError>;

    /// GPU instances (with their compute instances) present now.
    fn gpu_instances(&self, gpu: u32) -> Result<Vec<GpuInstance>, BackendError>;

    /// MIG mode and instances of one GPU.
    fn mig_state(&self, gpu: u32) -> Result<MigState, BackendError> {
        let mode = self.mig_mode(gpu)?;
        let gpu_instances = if mode.current {
            self.gpu_instances(gpu)?
        } else {
            Vec::new()
        };
        Ok(MigState {
            gpu,
            mode,
            gpu_instances,
        })
    }

    /// Creates a GPU instance of hardware profile `profile_id` at `placement`.
    /// Overlap or an exhausted profile count fails `InsufficientResources`; a
    /// placement the device does not offer fails `InvalidArgument`.
    fn create_gpu_instance(
        &self,
        gpu: u32,
        profile_id: u32,
        placement: SlicePlacement,
    ) -> Result<GpuInstance, BackendError>;

    /// Creates a compute instance of `slice_count` compute slices in a GPU
    /// instance, at the first free placement.
    fn create_compute_instance(
        &self,
        gpu: u32,
        gpu_instance_id: u32,
        slice_count: u32,
    ) -> Result<ComputeInstance, BackendError>;

    /// Destroys a compute instance.
    fn destroy_compute_instance(
        &self,
        gpu: u32,
        gpu_instance_id: u32,
        compute_instance_id: u32,
    ) -> Result<(), BackendError>;

    /// Destroys a GPU instance; fails `InUse` while it has compute instances.
    fn destroy_gpu_instance(&self, gpu: u32, gpu_instance_id: u32) -> Result<(), BackendError>;

    /// Resets a GPU so a pending MIG mode takes effect. Backends that cannot
    /// reset answer `NotSupported` (the node then needs a reboot).
    fn reset_gpu(&self, gpu: u32) -> Result<(), BackendError>;

    /// One telemetry sample of a whole GPU.
    fn gpu_telemetry(&self, gpu: u32) -> Result<GpuTelemetry, BackendError>;

    /// One telemetry sample of each GPU instance of a MIG-enabled GPU.
    fn mig_telemetry(&self, gpu: u32) -> Result<Vec<MigTelemetry>, BackendError>;

    /// Subscribes to Xid and GPU-lost events of every GPU.
    fn health_events(&self) -> Result<Box<dyn HealthEvents>, BackendError>;

    /// Brand, serial, VBIOS and inforom versions of a GPU (read once, printed
    /// as labels). The default reports none.
    fn device_strings(&self, gpu: u32) -> Result<DeviceStrings, BackendError> {
        let _ = gpu;
        Ok(DeviceStrings::default())
    }

    /// Whether `gpu` reaches `peer` peer to peer over NVLink. The default
    /// answers `NotSupported`.
    fn p2p_status(&self, gpu: u32, peer: u32) -> Result<P2pStatus, BackendError> {
        let _ = peer;
        Err(BackendError::NotSupported {
            gpu,
            operation: "NVLink peer-to-peer status".into(),
        })
    }

    /// Holds off every other MIG apply on this node (in any process) until the
    /// returned lock drops, waiting while another one holds it, so two applies
    /// serialise instead of interleaving step by step. Other calls are not
    /// held off. The default holds nothing (the driver has no such lock).
    fn lock_mig_changes(&self) -> Result<MigChangeLock, BackendError> {
        Ok(MigChangeLock::none())
    }

    /// Compute processes running on a GPU, each with its MIG instance when MIG
    /// is on (the MIG manager refuses to destroy busy instances). Backends
    /// that cannot list processes answer `NotSupported` (the default).
    fn running_processes(&self, gpu: u32) -> Result<Vec<GpuProcess>, BackendError> {
        Err(BackendError::NotSupported {
            gpu,
            operation: "listing running processes".into(),
        })
    }
}

/// MIG view of one GPU in a [`NodeSnapshot`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigSnapshot {
    /// Current and pending mode.
    pub mode: MigMode,
    /// Profiles the device offers, with placements.
    pub profiles: Vec<GpuInstanceProfile>,
    /// Instances present now.
    pub gpu_instances: Vec<GpuInstance>,
}

/// One GPU in a [`NodeSnapshot`]: its inventory plus MIG state when capable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuSnapshot {
    /// Inventory.
    #[serde(flatten)]
    pub info: GpuInfo,
    /// MIG view; `None` on GPUs without MIG.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigSnapshot>,
}

/// Everything a backend says about a node's GPUs, in one serialisable value:
/// what `gpu-stack gpus -o json` prints. Identical for equal GPUs, whichever
/// backend reads them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSnapshot {
    /// Driver-wide facts.
    pub system: SystemInfo,
    /// GPUs that answered.
    pub gpus: Vec<GpuSnapshot>,
    /// GPUs that did not (inventory or MIG reads failed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<GpuReadError>,
}

/// Reads a [`NodeSnapshot`]. A GPU whose inventory or MIG state fails is listed
/// under `errors` and the others are still read.
pub fn node_snapshot(backend: &dyn GpuBackend) -> Result<NodeSnapshot, BackendError> {
    let inv = backend.inventory()?;
    let mut gpus = Vec::with_capacity(inv.gpus.len());
    let mut errors = inv.errors;
    for info in inv.gpus {
        let index = info.index;
        let mig = match info.mig_mode {
            None => Ok(None),
            Some(mode) => backend.gpu_instance_profiles(index).and_then(|profiles| {
                let gpu_instances = if mode.current {
                    backend.gpu_instances(index)?
                } else {
                    Vec::new()
                };
                Ok(Some(MigSnapshot {
                    mode,
                    profiles,
                    gpu_instances,
                }))
            }),
        };
        match mig {
            Ok(mig) => gpus.push(GpuSnapshot { info, mig }),
            Err(error) => errors.push(GpuReadError { index, error }),
        }
    }
    errors.sort_by_key(|e| e.index);
    Ok(NodeSnapshot {
        system: inv.system,
        gpus,
        errors,
    })
}

/// Telemetry profile of a simulated GPU: the centre and spread of its load.
/// Written in fleet files under a node or a GPU (`telemetry:`); all fields optional.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct SimTelemetry {
    /// Seed of the deterministic generator; the same seed gives the same samples.
    pub seed: u64,
    /// Mean GPU utilisation in percent (0..=100).
    pub utilization_pct: u32,
    /// Spread around the mean, in percent points.
    pub jitter_pct: u32,
    /// Share of usable framebuffer memory in use, in percent (0..=100).
    pub memory_used_pct: u32,
    /// Milliseconds per telemetry tick (a new sample every tick).
    pub tick_ms: u64,
}

impl Default for SimTelemetry {
    fn default() -> Self {
        SimTelemetry {
            seed: 0x5eed,
            utilization_pct: 40,
            jitter_pct: 15,
            memory_used_pct: 30,
            tick_ms: 1000,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fb_memory_consistency_detects_mismatch_and_overflow() {
        let ok = FbMemory {
            total: 100,
            used: 30,
            free: 60,
            reserved: 10,
        };
        assert!(ok.is_consistent());
        let bad = FbMemory { free: 61, ..ok };
        assert!(!bad.is_consistent());
        let overflow = FbMemory {
            total: u64::MAX,
            used: u64::MAX,
            free: 1,
            reserved: 0,
        };
        assert!(!overflow.is_consistent());
    }

    #[test]
    fn reading_serializes_not_supported_distinct_from_error() {
        let ns: Reading<u32> = Reading::NotSupported;
        let err: Reading<u32> = Reading::Error("boom".into());
        let v: Reading<u32> = Reading::Value(7);
        assert_eq!(serde_json::to_string(&ns).unwrap(), "\"not_supported\"");
        assert_eq!(serde_json::to_string(&err).unwrap(), "{\"error\":\"boom\"}");
        assert_eq!(serde_json::to_string(&v).unwrap(), "{\"value\":7}");
        assert_eq!(v.clone().map(|x| x * 2), Reading::Value(14));
        assert!(ns.is_not_supported());
        assert_eq!(v.value(), Some(&7));
    }

    #[test]
    fn fault_specs_parse_from_yaml() {
        let yaml = "- {gpu: 0, at-ms: 5000, fault: {type: xid, xid: 48}}\n- {gpu: 3, fault: {type: fall-off-bus}}\n- {fault: {type: slow-calls, calls: telemetry, delay-ms: 20}}\n";
        let faults: Vec<FaultSpec> = serde_saphyr::from_str(yaml).unwrap();
        assert_eq!(faults.len(), 3);
        assert_eq!(
            faults[0].fault,
            Fault::Xid {
                xid: 48,
                gpu_instance: None
            }
        );
        assert_eq!(faults[1].at_ms, 0);
        assert_eq!(faults[2].gpu, None);
        let bad: Result<Vec<FaultSpec>, _> = serde_saphyr::from_str("- {fault: {type: melt}}\n");
        assert!(bad.is_err());
        let t: SimTelemetry = serde_saphyr::from_str("utilization-pct: 90\n").unwrap();
        assert_eq!(t.utilization_pct, 90);
        assert_eq!(t.tick_ms, SimTelemetry::default().tick_ms);
    }

    #[test]
    fn mig_mode_reports_pending_reset() {
        assert!(
            MigMode {
                current: false,
                pending: true
            }
            .reset_pending()
        );
        assert!(
            !MigMode {
                current: true,
                pending: true
            }
            .reset_pending()
        );
    }

    struct Broken;
    impl GpuBackend for Broken {
        fn name(&self) -> &str {
            "broken"
        }
        fn system_info(&self) -> Result<SystemInfo, BackendError> {
            Ok(SystemInfo {
                driver_version: "1".into(),
                cuda_driver_version: "12.0".into(),
                nvml_version: "12.1".into(),
            })
        }
        fn device_count(&self) -> Result<u32, BackendError> {
            Ok(2)
        }
        fn gpu_info(&self, gpu: u32) -> Result<GpuInfo, BackendError> {
            if gpu == 0 {
                return Err(BackendError::GpuLost { gpu });
            }
            Ok(GpuInfo {
                index: gpu,
                uuid: "GPU-1".into(),
                name: "x".into(),
                pci_bus_id: "00000000:01:00.0".into(),
                pci_device_id: 0x20B010DE,
                minor_number: gpu,
                memory_total_bytes: 1,
                numa_node: None,
                architecture: "ampere".into(),
                compute_capability: (8, 0),
                mig_capable: false,
                mig_mode: None,
            })
        }
        fn mig_mode(&self, gpu: u32) -> Result<MigMode, BackendError> {
            Err(BackendError::NotSupported {
                gpu,
                operation: "mig".into(),
            })
        }
        fn set_mig_mode(&self, gpu: u32, _: bool) -> Result<MigModeChange, BackendError> {
            self.mig_mode(gpu).map(|_| MigModeChange::Applied)
        }
        fn gpu_instance_profiles(&self, _: u32) -> Result<Vec<GpuInstanceProfile>, BackendError> {
            Ok(vec![])
        }
        fn gpu_instances(&self, _: u32) -> Result<Vec<GpuInstance>, BackendError> {
            Ok(vec![])
        }
        fn create_gpu_instance(
            &self,
            gpu: u32,
            _: u32,
            _: SlicePlacement,
        ) -> Result<GpuInstance, BackendError> {
            Err(BackendError::GpuLost { gpu })
        }
        fn create_compute_instance(
            &self,
            gpu: u32,
            _: u32,
            _: u32,
        ) -> Result<ComputeInstance, BackendError> {
            Err(BackendError::GpuLost { gpu })
        }
        fn destroy_compute_instance(&self, _: u32, _: u32, _: u32) -> Result<(), BackendError> {
            Ok(())
        }
        fn destroy_gpu_instance(&self, _: u32, _: u32) -> Result<(), BackendError> {
            Ok(())
        }
        fn reset_gpu(&self, gpu: u32) -> Result<(), BackendError> {
            Err(BackendError::NotSupported {
                gpu,
                operation: "reset".into(),
            })
        }
        fn gpu_telemetry(&self, gpu: u32) -> Result<GpuTelemetry, BackendError> {
            Err(BackendError::GpuLost { gpu })
        }
        fn mig_telemetry(&self, _: u32) -> Result<Vec<MigTelemetry>, BackendError> {
            Ok(vec![])
        }
        fn health_events(&self) -> Result<Box<dyn HealthEvents>, BackendError> {
            Err(BackendError::Other {
                message: "none".into(),
            })
        }
    }

    #[test]
    fn inventory_keeps_working_gpus_when_one_fails() {
        let backend: std::sync::Arc<dyn GpuBackend> = std::sync::Arc::new(Broken);
        let inv = backend.inventory().unwrap();
        assert_eq!(inv.gpus.len(), 1);
        assert_eq!(inv.gpus[0].index, 1);
        assert_eq!(inv.errors.len(), 1);
        assert_eq!(inv.errors[0].error.kind(), "gpu_lost");
        let state = backend.mig_state(1);
        assert!(matches!(state, Err(BackendError::NotSupported { .. })));
        // A backend that does not list processes says so instead of "none".
        assert_eq!(
            backend.running_processes(1).unwrap_err().kind(),
            "not_supported"
        );
    }

    #[test]
    fn gpu_process_omits_unknown_fields_in_json() {
        let p = GpuProcess {
            pid: 7,
            used_memory_bytes: None,
            gpu_instance_id: Some(1),
            compute_instance_id: Some(0),
        };
        let text = serde_json::to_string(&p).unwrap();
        assert_eq!(
            text,
            r#"{"pid":7,"gpu_instance_id":1,"compute_instance_id":0}"#
        );
        assert_eq!(serde_json::from_str::<GpuProcess>(&text).unwrap(), p);
    }
}
