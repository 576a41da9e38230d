//! Simulated compute processes: started and stopped by hand or declared in the
//! fleet file, and their public view.

use gpu_stack_core::backend::{BackendError, CallClass, GpuProcess};

use super::MIB;
use super::SimulatedBackend;
use super::faults::advance;
use super::state::ProcState;

pub(super) fn proc_public(p: &ProcState) -> GpuProcess {
    GpuProcess {
        pid: p.pid,
        used_memory_bytes: p.used_memory_mib.map(|m| m * MIB),
        gpu_instance_id: p.gpu_instance,
        compute_instance_id: p.compute_instance,
    }
}

impl SimulatedBackend {
    /// Starts a simulated compute process on GPU `gpu`: on MIG device
    /// (`gpu_instance`, `compute_instance`) when MIG is on (the compute
    /// instance defaults to the GPU instance's first), on the whole GPU when it
    /// is off. `pid` defaults to the lowest free id from 4000. The process is
    /// listed by [`GpuBackend::running_processes`](gpu_stack_core::backend::GpuBackend::running_processes) until it is stopped, its
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
}
