//! Simulated GPUs: a [`GpuBackend`] over GPUs described by a fleet file.
//!
//! MIG operations obey the catalog geometry through `gpu_stack_core::mig::validate`
//! and fail the way NVML does; telemetry is deterministic for a seed; faults (Xid,
//! falling off the bus, failing or slow calls) come from the fleet file or are
//! injected at runtime. With a state file, several processes share one node.

mod faults;
mod gpu_backend;
mod mig;
mod node;
mod processes;
mod spec;
pub mod state;
pub mod telemetry;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use gpu_stack_core::backend::{BackendError, CallClass, Fault, GpuTelemetry};

pub use mig::{ci_profile_enum, sort_profiles};
pub use spec::{DEFAULT_DRIVER_VERSION, SimError, SimGpuSpec, SimNodeSpec};

use faults::{advance, fault_error, matches_class};
use mig::model_of;
use node::{initial_state, unix_ms};
use state::{GpuState, NodeState, Store};

const MIB: u64 = 1 << 20;

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
