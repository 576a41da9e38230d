//! Faults the simulated backend injects: which calls they hit, what goes wrong
//! and when. Written in fleet files under a node (`faults:`) or injected at
//! runtime; the simulator in `gpu-stack-nvml` applies them.

use serde::{Deserialize, Serialize};

/// A class of backend calls a fault applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CallClass {
    /// Inventory: `gpu_info`, `mig_mode`, profiles, instance lists.
    Inventory,
    /// MIG changes: mode, create, destroy, reset.
    MigChange,
    /// Telemetry samples.
    Telemetry,
    /// Every call on the GPU.
    All,
}

/// The error a failing call returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultError {
    /// [`BackendError::Other`](super::BackendError::Other) ("unknown error", as NVML_ERROR_UNKNOWN).
    Unknown,
    /// [`BackendError::NoPermission`](super::BackendError::NoPermission).
    NoPermission,
    /// [`BackendError::NotSupported`](super::BackendError::NotSupported).
    NotSupported,
    /// [`BackendError::Timeout`](super::BackendError::Timeout).
    Timeout,
    /// [`BackendError::GpuLost`](super::BackendError::GpuLost).
    GpuLost,
}

/// What goes wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Fault {
    /// An Xid error is raised (a health event; `last_xid` changes).
    Xid {
        /// The Xid number.
        xid: u64,
        /// The GPU instance it is attributed to, if any.
        #[serde(default, rename = "gpu-instance")]
        gpu_instance: Option<u32>,
    },
    /// The GPU falls off the bus: Xid 79, a GPU-lost event, then every call fails.
    FallOffBus,
    /// The GPU is held at `temp-c` °C from then on (cooling failure): thermal
    /// clock events and thermal violation time follow.
    Overheat {
        /// Temperature in °C.
        #[serde(rename = "temp-c")]
        temp_c: u32,
    },
    /// Row remapping fails (the GPU ran out of spare rows): the remapped-rows
    /// reading reports the failure.
    RowRemapFailure,
    /// ECC errors are counted (volatile and aggregate totals grow); a
    /// double-bit error also raises Xid 48, as the driver does.
    EccErrors {
        /// Corrected errors to add.
        #[serde(default, rename = "single-bit")]
        single_bit: u64,
        /// Uncorrected errors to add.
        #[serde(default, rename = "double-bit")]
        double_bit: u64,
    },
    /// Calls of a class start failing with `error`.
    FailCalls {
        /// Which calls.
        calls: CallClass,
        /// With what.
        error: FaultError,
    },
    /// Calls of a class become slow.
    SlowCalls {
        /// Which calls.
        calls: CallClass,
        /// Added latency per call in milliseconds.
        #[serde(rename = "delay-ms")]
        delay_ms: u64,
    },
}

/// A fault scheduled on a simulated node. Written in fleet files under a node
/// (`faults:`), or injected at runtime.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct FaultSpec {
    /// GPU index; `None` means every GPU of the node.
    #[serde(default)]
    pub gpu: Option<u32>,
    /// When, in milliseconds after the node's simulation started (0 = at once).
    #[serde(default)]
    pub at_ms: u64,
    /// What goes wrong.
    pub fault: Fault,
}
