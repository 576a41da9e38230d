//! Fault injection: scheduled faults fire as the clock passes them (Xid events,
//! a GPU falling off the bus), failing or slow calls are matched per call
//! class, and health-event subscribers read the node's event log.

use std::time::{Duration, Instant};

use gpu_stack_core::backend::{
    BackendError, CallClass, Fault, FaultError, FaultSpec, HealthEvent, HealthEventKind,
    HealthEvents,
};

use super::SimulatedBackend;
use super::state::{NodeState, Overheat, ScheduledFault};

pub(super) fn fault_error(gpu: u32, class: CallClass, e: FaultError) -> BackendError {
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

pub(super) fn targets(spec: &FaultSpec, gpus: usize) -> Vec<u32> {
    match spec.gpu {
        Some(g) => vec![g],
        None => (0..gpus as u32).collect(),
    }
}

/// Applies every fault whose moment has come.
pub(super) fn advance(state: &mut NodeState, now_ms: u64) {
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
                Fault::Overheat { temp_c } => {
                    gpu.overheat = Some(Overheat {
                        temp_c: *temp_c,
                        since_ms: now_ms,
                    });
                }
                Fault::RowRemapFailure => gpu.row_remap_failed = true,
                Fault::EccErrors {
                    single_bit,
                    double_bit,
                } => {
                    let ecc = &mut gpu.ecc;
                    ecc.sbe_volatile = ecc.sbe_volatile.saturating_add(*single_bit);
                    ecc.sbe_aggregate = ecc.sbe_aggregate.saturating_add(*single_bit);
                    ecc.dbe_volatile = ecc.dbe_volatile.saturating_add(*double_bit);
                    ecc.dbe_aggregate = ecc.dbe_aggregate.saturating_add(*double_bit);
                    if *double_bit > 0 {
                        gpu.last_xid = 48;
                        state.push_event(event(HealthEventKind::Xid { xid: 48 }, None));
                    }
                }
                Fault::FailCalls { .. } | Fault::SlowCalls { .. } => {}
            }
        }
    }
}

pub(super) fn matches_class(fault: CallClass, call: CallClass) -> bool {
    fault == CallClass::All || fault == call
}

impl SimulatedBackend {
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
}

/// A subscription to a simulated node's event log.
pub(super) struct SimEvents {
    pub(super) backend: SimulatedBackend,
    pub(super) next: u64,
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
