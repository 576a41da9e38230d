//! State of a simulated node and where it lives: in memory for one process, or in
//! a state file shared by several processes (the device plugin, the exporter and
//! the MIG manager of one node), guarded by an exclusive file lock.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use gpu_stack_core::backend::{BackendError, FaultSpec, HealthEvent, SimTelemetry};
use serde::{Deserialize, Serialize};

/// Version of the state-file format; a file with another version is refused.
pub const STATE_VERSION: u32 = 1;

/// How many health events the log keeps; older ones are dropped.
pub const EVENT_LOG_LEN: usize = 1024;

/// A compute instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CiState {
    /// Id within its GPU instance.
    pub id: u32,
    /// Compute slices.
    pub slice_count: u32,
    /// First compute slice.
    pub start: u32,
    /// MIG device UUID.
    pub uuid: String,
}

/// A GPU instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GiState {
    /// GPU-instance id.
    pub id: u32,
    /// Hardware profile id.
    pub profile_id: u32,
    /// First memory slice.
    pub start: u32,
    /// Memory slices.
    pub size: u32,
    /// Processes run on it.
    #[serde(default)]
    pub in_use: bool,
    /// Compute instances.
    pub compute_instances: Vec<CiState>,
}

/// A compute process on a simulated GPU, as the process list reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcState {
    /// Process id.
    pub pid: u32,
    /// GPU instance it runs on (MIG on).
    #[serde(default)]
    pub gpu_instance: Option<u32>,
    /// Compute instance it runs on (MIG on).
    #[serde(default)]
    pub compute_instance: Option<u32>,
    /// GPU memory it uses, in MiB.
    #[serde(default)]
    pub used_memory_mib: Option<u64>,
}

/// One simulated GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuState {
    /// Index on the node.
    pub index: u32,
    /// Catalog model name.
    pub model: String,
    /// GPU UUID.
    pub uuid: String,
    /// PCI bus id.
    pub pci_bus_id: String,
    /// NUMA node.
    pub numa_node: Option<u32>,
    /// MIG mode in force.
    pub mig_current: bool,
    /// MIG mode after the next reset.
    pub mig_pending: bool,
    /// Processes run on the whole GPU (MIG mode changes fail with "in use").
    pub in_use: bool,
    /// Fell off the bus.
    pub lost: bool,
    /// Last Xid raised, 0 when none.
    pub last_xid: u64,
    /// GPU instances.
    pub gpu_instances: Vec<GiState>,
    /// Telemetry profile.
    pub telemetry: SimTelemetry,
    /// Compute processes the process list reports (files written before
    /// processes existed read as none).
    #[serde(default)]
    pub processes: Vec<ProcState>,
}

/// A health event in the node's log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoggedEvent {
    /// Sequence number, increasing from 0.
    pub seq: u64,
    /// The event.
    pub event: HealthEvent,
}

/// A fault and whether it has taken effect.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduledFault {
    /// The fault.
    pub spec: FaultSpec,
    /// Whether its moment has passed and it was applied.
    pub fired: bool,
}

/// Everything about one simulated node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeState {
    /// Format version.
    pub version: u32,
    /// Node name.
    pub node: String,
    /// Wall-clock milliseconds since the Unix epoch when the simulation started.
    pub epoch_unix_ms: u64,
    /// MIG mode changes need a GPU reset to take effect.
    pub mig_change_needs_reset: bool,
    /// GPUs.
    pub gpus: Vec<GpuState>,
    /// Faults, scheduled and fired.
    pub faults: Vec<ScheduledFault>,
    /// Recent health events.
    pub events: Vec<LoggedEvent>,
    /// Sequence number of the next event.
    pub next_seq: u64,
}

impl NodeState {
    /// Appends an event to the log, dropping the oldest beyond [`EVENT_LOG_LEN`].
    pub fn push_event(&mut self, event: HealthEvent) {
        self.events.push(LoggedEvent {
            seq: self.next_seq,
            event,
        });
        self.next_seq += 1;
        if self.events.len() > EVENT_LOG_LEN {
            let drop = self.events.len() - EVENT_LOG_LEN;
            self.events.drain(..drop);
        }
    }
}

/// Where the state lives.
#[derive(Debug)]
pub enum Store {
    /// In this process only.
    Memory(Mutex<NodeState>),
    /// In a file shared by processes.
    File(PathBuf),
}

fn io_err(path: &Path, what: &str, e: std::io::Error) -> BackendError {
    BackendError::Other {
        message: format!(
            "simulated GPU state file {}: {what}: {e} (check the --sim-state path and its permissions)",
            path.display()
        ),
    }
}

impl Store {
    /// A state file at `path`: created from `initial` when missing or empty, and
    /// left as it is when it already holds a node (so a second process joins the
    /// first one's GPUs). A file for another node or format is refused.
    pub fn open_file(path: &Path, initial: NodeState) -> Result<Store, BackendError> {
        let store = Store::File(path.to_path_buf());
        store.with_file(|file| {
            let mut text = String::new();
            file.read_to_string(&mut text)
                .map_err(|e| io_err(path, "read", e))?;
            if text.trim().is_empty() {
                write_state(file, path, &initial)?;
                return Ok(());
            }
            let existing = parse_state(path, &text)?;
            if existing.node != initial.node {
                return Err(BackendError::InvalidArgument {
                    gpu: 0,
                    detail: format!(
                        "state file {} belongs to node {:?}, not {:?}; use another --sim-state file per node",
                        path.display(),
                        existing.node,
                        initial.node
                    ),
                });
            }
            Ok(())
        })?;
        Ok(store)
    }

    fn with_file<R>(
        &self,
        f: impl FnOnce(&mut File) -> Result<R, BackendError>,
    ) -> Result<R, BackendError> {
        let Store::File(path) = self else {
            return Err(BackendError::Other {
                message: "internal: not a file store".into(),
            });
        };
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| io_err(path, "open", e))?;
        file.lock().map_err(|e| io_err(path, "lock", e))?;
        let out = f(&mut file);
        // Closing the file releases the lock; an explicit unlock reports errors.
        let _ = file.unlock();
        out
    }

    /// Runs `f` on the state under the lock; writes it back when `f` changed it.
    pub fn update<R>(
        &self,
        f: impl FnOnce(&mut NodeState) -> Result<R, BackendError>,
    ) -> Result<R, BackendError> {
        match self {
            Store::Memory(m) => {
                let mut guard = m.lock().map_err(|_| BackendError::Other {
                    message: "simulated GPU state lock poisoned by a panic in another thread"
                        .into(),
                })?;
                f(&mut guard)
            }
            Store::File(path) => self.with_file(|file| {
                let mut text = String::new();
                file.read_to_string(&mut text)
                    .map_err(|e| io_err(path, "read", e))?;
                let mut state = parse_state(path, &text)?;
                let before = state.clone();
                let out = f(&mut state);
                if state != before {
                    write_state(file, path, &state)?;
                }
                out
            }),
        }
    }
}

fn parse_state(path: &Path, text: &str) -> Result<NodeState, BackendError> {
    let state: NodeState = serde_json::from_str(text).map_err(|e| BackendError::Other {
        message: format!(
            "simulated GPU state file {} is not valid: {e} (delete it to start over)",
            path.display()
        ),
    })?;
    if state.version != STATE_VERSION {
        return Err(BackendError::Other {
            message: format!(
                "simulated GPU state file {} has format version {}, this build reads {STATE_VERSION} (delete it to start over)",
                path.display(),
                state.version
            ),
        });
    }
    Ok(state)
}

fn write_state(file: &mut File, path: &Path, state: &NodeState) -> Result<(), BackendError> {
    let text = serde_json::to_vec_pretty(state).map_err(|e| BackendError::Other {
        message: format!("could not encode simulated GPU state: {e}"),
    })?;
    file.set_len(0).map_err(|e| io_err(path, "truncate", e))?;
    file.seek(SeekFrom::Start(0))
        .map_err(|e| io_err(path, "seek", e))?;
    file.write_all(&text)
        .map_err(|e| io_err(path, "write", e))?;
    file.flush().map_err(|e| io_err(path, "flush", e))?;
    Ok(())
}
