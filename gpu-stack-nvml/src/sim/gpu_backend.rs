//! [`GpuBackend`] over the simulated node: inventory, MIG mode and instance
//! operations, resets, telemetry and health events.

use gpu_stack_core::backend::{
    BackendError, CallClass, ComputeInstance, DeviceStrings, GpuBackend, GpuInfo, GpuInstance,
    GpuInstanceProfile, GpuProcess, GpuTelemetry, HealthEvents, MigChangeLock, MigMode,
    MigModeChange, MigTelemetry, P2pStatus, SlicePlacement, SystemInfo,
};
use gpu_stack_core::mig::{self, PlacedInstance};

use super::faults::{SimEvents, advance};
use super::mig::{
    ci_public, geometry_of, gi_memory_mib, gi_public, lowest_free, model_of, placed_layout,
    require_mig_on, sort_profiles, violation_error,
};
use super::node::mig_uuid;
use super::processes::proc_public;
use super::state::{CiState, GiState, GpuState};
use super::telemetry;
use super::{MIB, SimulatedBackend};

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

    fn device_strings(&self, gpu: u32) -> Result<DeviceStrings, BackendError> {
        self.on_gpu(gpu, CallClass::Inventory, |g, _, _| {
            // Stable per GPU: the serial is the UUID's first group as digits.
            let digits: String = g
                .uuid
                .trim_start_matches("GPU-")
                .chars()
                .filter(char::is_ascii_hexdigit)
                .take(8)
                .map(|c| char::from(b'0' + (c.to_digit(16).unwrap_or(0) % 10) as u8))
                .collect();
            Ok(DeviceStrings {
                brand: Some("NVIDIA".into()),
                serial: Some(format!("165{:0>10}", digits)),
                vbios_version: Some("96.00.89.00.01".into()),
                oem_inforom_version: Some("1.1".into()),
                ecc_inforom_version: Some("7.16".into()),
                power_inforom_version: None,
                inforom_image_version: Some("G520.0200.00.05".into()),
            })
        })
    }

    fn p2p_status(&self, gpu: u32, peer: u32) -> Result<P2pStatus, BackendError> {
        let has_nvlink = |g: &GpuState| model_of(g).map(telemetry::has_nvlink);
        let peer_nvlink = self.on_gpu(peer, CallClass::Inventory, |g, _, _| has_nvlink(g))?;
        self.on_gpu(gpu, CallClass::Inventory, |g, _, _| {
            Ok(if gpu == peer {
                P2pStatus::NotSupported
            } else if has_nvlink(g)? && peer_nvlink {
                P2pStatus::Ok
            } else {
                P2pStatus::NotSupported
            })
        })
    }
}

/// CUDA driver API version shipped with a driver branch.
pub(super) fn cuda_for_driver(driver: &str) -> &'static str {
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
