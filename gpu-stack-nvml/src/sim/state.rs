//! State of a simulated node and where it lives: in memory for one process, or in
//! a state file shared by several processes (the device plugin, the exporter and
//! the MIG manager of one node), guarded by an exclusive lock on a sibling lock
//! file ([`lock_path`]) and replaced atomically on every change, so a process
//! killed at any moment leaves the old state or the new one.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use gpu_stack_core::backend::{BackendError, EccErrors, FaultSpec, HealthEvent, SimTelemetry};
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
    /// Held hot by an injected fault.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overheat: Option<Overheat>,
    /// ECC error totals (raised by injected faults).
    #[serde(default)]
    pub ecc: EccErrors,
    /// Row remapping failed (an injected fault).
    #[serde(default)]
    pub row_remap_failed: bool,
    /// GPU instances.
    pub gpu_instances: Vec<GiState>,
    /// Telemetry profile.
    pub telemetry: SimTelemetry,
    /// Compute processes the process list reports (files written before
    /// processes existed read as none).
    #[serde(default)]
    pub processes: Vec<ProcState>,
}

/// An injected overheat: the temperature it holds, and since when.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Overheat {
    /// Temperature in °C.
    pub temp_c: u32,
    /// Simulation time it started, in milliseconds.
    pub since_ms: u64,
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

/// The lock file of state file `path`: `<path>.lock` in the same directory.
/// State writes replace the state file by rename, so a lock on the state file
/// itself would lock an inode that the next write unlinks; the lock file is
/// never replaced, and every process sharing the directory (also from other
/// containers through a bind mount) locks the same inode.
pub fn lock_path(path: &Path) -> PathBuf {
    sibling(path, ".lock")
}

/// The lock file that serialises whole MIG applies on state file `path`:
/// `<path>.apply.lock`.
pub fn apply_lock_path(path: &Path) -> PathBuf {
    sibling(path, ".apply.lock")
}

fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_os_string();
    name.push(suffix);
    PathBuf::from(name)
}

/// Opens (creating it when missing) and locks exclusively the lock file at
/// `lock`, for state file `state`. The lock lasts until the file is dropped.
pub(crate) fn lock_file(lock: &Path, state: &Path) -> Result<File, BackendError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(lock)
        .map_err(|e| lock_err(lock, state, "open", e))?;
    file.lock().map_err(|e| lock_err(lock, state, "lock", e))?;
    Ok(file)
}

fn lock_err(lock: &Path, state: &Path, what: &str, e: std::io::Error) -> BackendError {
    BackendError::Other {
        message: format!(
            "lock file {} of simulated GPU state file {}: {what}: {e} (the directory of the --sim-state file must be writable by every process sharing it)",
            lock.display(),
            state.display()
        ),
    }
}

/// Removes the temporary files a killed writer left beside state file `path`
/// ([`crate::fsutil::write_atomic`]'s `.<name>.*.tmp`). Called under the lock:
/// every writer holds it while its temporary file exists, so any found now is
/// stale. Failures only leave the files behind.
fn remove_stale_temporaries(path: &Path) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return;
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let prefix = format!(".{}.", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let file = entry.file_name();
        let file = file.to_string_lossy();
        if file.starts_with(&prefix) && file.ends_with(".tmp") {
            match std::fs::remove_file(entry.path()) {
                Ok(()) => {
                    tracing::debug!(file = %entry.path().display(), "removed a temporary file a killed writer left")
                }
                Err(e) => {
                    tracing::debug!(file = %entry.path().display(), "could not remove a stale temporary file: {e}")
                }
            }
        }
    }
}

impl Store {
    /// Takes the whole-apply lock of a file store ([`apply_lock_path`]),
    /// waiting while another process holds it; `None` for a memory store.
    pub fn lock_applies(&self) -> Result<Option<File>, BackendError> {
        let Store::File(path) = self else {
            return Ok(None);
        };
        let lock = apply_lock_path(path);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock)
            .map_err(|e| lock_err(&lock, path, "open", e))?;
        match file.try_lock() {
            Ok(()) => return Ok(Some(file)),
            Err(std::fs::TryLockError::WouldBlock) => {
                tracing::info!(
                    lock = %lock.display(),
                    "another MIG apply is running on this simulated node; waiting for it to finish"
                );
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(lock_err(&lock, path, "lock", e)),
        }
        file.lock().map_err(|e| lock_err(&lock, path, "lock", e))?;
        Ok(Some(file))
    }
}

/// Reads the state file: `None` when it does not exist.
fn read_state(path: &Path) -> Result<Option<NodeState>, BackendError> {
    match std::fs::read(path) {
        Ok(bytes) => parse_state(path, &bytes).map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err(path, "read", e)),
    }
}

impl Store {
    /// A state file at `path`: created from `initial` when missing, and left as
    /// it is when it already holds a node (so a second process joins the first
    /// one's GPUs). An empty or corrupt file, or one for another node or
    /// format, is refused (never silently replaced: it may hold instances and
    /// events that a reset would lose).
    pub fn open_file(path: &Path, initial: NodeState) -> Result<Store, BackendError> {
        let store = Store::File(path.to_path_buf());
        let _lock = lock_file(&lock_path(path), path)?;
        remove_stale_temporaries(path);
        let Some(existing) = read_state(path)? else {
            write_state(path, &initial)?;
            return Ok(store);
        };
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
        Ok(store)
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
            Store::File(path) => {
                let _lock = lock_file(&lock_path(path), path)?;
                let Some(mut state) = read_state(path)? else {
                    return Err(BackendError::Other {
                        message: format!(
                            "simulated GPU state file {} was removed while in use (restart the processes sharing it to start again from the fleet file)",
                            path.display()
                        ),
                    });
                };
                let before = state.clone();
                let out = f(&mut state);
                if state != before {
                    write_state(path, &state)?;
                }
                out
            }
        }
    }
}

/// How much of a bad state file an error message quotes.
const QUOTE_CHARS: usize = 200;

fn invalid(path: &Path, why: &str) -> BackendError {
    BackendError::Other {
        message: format!(
            "simulated GPU state file {} is not valid: {why} (delete it to start again from the fleet file; its MIG instances, processes and events are then lost)",
            path.display()
        ),
    }
}

/// Parses and checks a state file's content.
pub fn parse_state(path: &Path, bytes: &[u8]) -> Result<NodeState, BackendError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(invalid(
            path,
            "it is empty (a write was cut short, or something truncated it)",
        ));
    }
    let state: NodeState = serde_json::from_slice(bytes).map_err(|e| {
        let text = String::from_utf8_lossy(bytes);
        let quoted: String = text.chars().take(QUOTE_CHARS).collect();
        let more = text.chars().count().saturating_sub(QUOTE_CHARS);
        let tail = if more > 0 {
            format!(" … ({more} more characters)")
        } else {
            String::new()
        };
        invalid(path, &format!("{e}; it starts {quoted:?}{tail}"))
    })?;
    if state.version != STATE_VERSION {
        return Err(BackendError::Other {
            message: format!(
                "simulated GPU state file {} has format version {}, this build reads {STATE_VERSION} (delete it to start again from the fleet file)",
                path.display(),
                state.version
            ),
        });
    }
    check_ids(&state).map_err(|why| invalid(path, &why))?;
    Ok(state)
}

/// Every GPU sits at the position its index names and has a UUID of its own;
/// GPU-instance ids are unique on their GPU, compute-instance ids within their
/// GPU instance, MIG device UUIDs on the node.
pub fn check_ids(state: &NodeState) -> Result<(), String> {
    use std::collections::BTreeSet;
    let mut uuids = BTreeSet::new();
    for (pos, gpu) in state.gpus.iter().enumerate() {
        if gpu.index as usize != pos {
            return Err(format!(
                "GPU number {pos} in the list has index {} (indices must be 0, 1, 2, … in order, each once)",
                gpu.index
            ));
        }
        if !uuids.insert(gpu.uuid.as_str()) {
            return Err(format!(
                "GPU {} has UUID {} that another GPU also has",
                gpu.index, gpu.uuid
            ));
        }
        let mut gis = BTreeSet::new();
        for gi in &gpu.gpu_instances {
            if !gis.insert(gi.id) {
                return Err(format!(
                    "GPU {} has two GPU instances with id {}",
                    gpu.index, gi.id
                ));
            }
            let mut cis = BTreeSet::new();
            for ci in &gi.compute_instances {
                if !cis.insert(ci.id) {
                    return Err(format!(
                        "GPU {} GPU instance {} has two compute instances with id {}",
                        gpu.index, gi.id, ci.id
                    ));
                }
                if !uuids.insert(ci.uuid.as_str()) {
                    return Err(format!(
                        "GPU {} GPU instance {} compute instance {} has UUID {} that another device also has",
                        gpu.index, gi.id, ci.id, ci.uuid
                    ));
                }
            }
        }
    }
    Ok(())
}

fn write_state(path: &Path, state: &NodeState) -> Result<(), BackendError> {
    let text = serde_json::to_vec_pretty(state).map_err(|e| BackendError::Other {
        message: format!("could not encode simulated GPU state: {e}"),
    })?;
    match crate::fsutil::write_atomic(path, &text) {
        Ok(()) => Ok(()),
        Err(e @ crate::fsutil::AtomicWriteError::NotDurable { .. }) => {
            // Every reader already sees the new state; only durability is in doubt.
            tracing::warn!("{e}");
            Ok(())
        }
        Err(e) => Err(BackendError::Other {
            message: format!("simulated GPU state not saved, so the change was not made: {e}"),
        }),
    }
}
