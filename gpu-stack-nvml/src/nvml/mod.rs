//! The NVML backend: a [`GpuBackend`] over the NVIDIA driver's libnvidia-ml,
//! loaded at runtime through nvml-wrapper (so binaries run, and fail clearly, on
//! machines without a driver).
//!
//! nvml-wrapper covers inventory and most telemetry (the readers beyond the
//! basic counters, GPM profiling among them, are in `telemetry`); MIG instance
//! management, placements, remapped rows, field values and events with MIG
//! attribution go through the crate-private `raw` module: small wrappers whose
//! functions on raw NVML handles are `unsafe fn`s, called here only with
//! handles of live nvml-wrapper devices (or instances NVML just returned for
//! them).

mod raw;
mod telemetry;

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpu_stack_core::backend::{
    BackendError, ComputeInstance, DeviceStrings, FbMemory, GpuBackend, GpuInfo, GpuInstance,
    GpuInstanceProfile, GpuProcess, GpuTelemetry, HealthEvent, HealthEventKind, HealthEvents,
    MigMode, MigModeChange, MigTelemetry, P2pStatus, Reading, RemappedRows, SlicePlacement,
    SystemInfo,
};
use nvml_wrapper::enum_wrappers::device::{
    Brand, Clock, InfoRom, P2pCapabilitiesIndex, PcieUtilCounter, TemperatureSensor,
};
use nvml_wrapper::enums::device::{DeviceArchitecture, UsedGpuMemory};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProcessInfo;
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::nvmlDevice_t;

/// Library loaded when no path is given.
pub const DEFAULT_LIB: &str = "libnvidia-ml.so.1";

/// NVML GPU-instance profile enum values to probe (`NVML_GPU_INSTANCE_PROFILE_COUNT`).
const GI_PROFILE_ENUMS: u32 = 0x12;
/// NVML compute-instance profile enum values to probe.
const CI_PROFILE_ENUMS: u32 = 0x9;
/// Field id of HBM temperature (`NVML_FI_DEV_MEMORY_TEMP`).
const FI_MEMORY_TEMP: u32 = 82;
/// Scope id meaning "all links".
const ALL_LINKS: u32 = u32::MAX;

fn map_err(e: NvmlError, gpu: u32, operation: &str) -> BackendError {
    let op = || operation.to_string();
    match e {
        NvmlError::NotSupported => BackendError::NotSupported {
            gpu,
            operation: op(),
        },
        NvmlError::NoPermission => BackendError::NoPermission {
            gpu,
            operation: op(),
        },
        NvmlError::NotFound => BackendError::NotFound {
            what: format!("{operation} on GPU {gpu}"),
        },
        NvmlError::InvalidArg => BackendError::InvalidArgument {
            gpu,
            detail: format!("{operation}: the driver rejected an argument"),
        },
        NvmlError::InUse => BackendError::InUse {
            gpu,
            detail: format!("{operation}: the resource is in use"),
        },
        NvmlError::GpuLost => BackendError::GpuLost { gpu },
        NvmlError::Timeout => BackendError::Timeout { operation: op() },
        NvmlError::FailedToLoadSymbol(s) => BackendError::MissingFunction { symbol: s },
        NvmlError::FunctionNotFound => BackendError::MissingFunction { symbol: op() },
        NvmlError::DriverNotLoaded | NvmlError::LibraryNotFound | NvmlError::Uninitialized => {
            BackendError::LibraryUnavailable {
                detail: format!("{operation}: {e}"),
            }
        }
        other => BackendError::Other {
            message: format!("{operation} on GPU {gpu}: {other}"),
        },
    }
}

/// A field read: not-supported stays distinct from an error; a lost GPU aborts
/// the whole sample.
fn reading<T>(r: Result<T, BackendError>) -> Result<Reading<T>, BackendError> {
    match r {
        Ok(v) => Ok(Reading::Value(v)),
        Err(BackendError::NotSupported { .. }) | Err(BackendError::MissingFunction { .. }) => {
            Ok(Reading::NotSupported)
        }
        Err(e @ BackendError::GpuLost { .. }) => Err(e),
        Err(e) => Ok(Reading::Error(e.to_string())),
    }
}

/// A process from NVML's list, attributed to MIG device `ids` when it was
/// listed through one (NVML fills the ids itself only on parent handles).
fn process(p: ProcessInfo, ids: Option<(u32, u32)>) -> GpuProcess {
    GpuProcess {
        pid: p.pid,
        used_memory_bytes: match p.used_gpu_memory {
            UsedGpuMemory::Used(b) => Some(b),
            UsedGpuMemory::Unavailable => None,
        },
        gpu_instance_id: ids.map(|i| i.0).or(p.gpu_instance_id),
        compute_instance_id: ids.map(|i| i.1).or(p.compute_instance_id),
    }
}

/// The brand as `nvidia-smi -q` prints it ("Product Brand"); `None` for
/// `NVML_BRAND_UNKNOWN`.
fn brand_name(b: Brand) -> Option<&'static str> {
    Some(match b {
        Brand::Unknown => return None,
        Brand::Quadro => "Quadro",
        Brand::Tesla => "Tesla",
        Brand::NVS => "NVS",
        Brand::GRID => "Grid",
        Brand::GeForce => "GeForce",
        Brand::Titan => "Titan",
        Brand::VApps => "NVIDIA Virtual Applications",
        Brand::VPC => "NVIDIA Virtual PC",
        Brand::VCS => "NVIDIA Virtual Compute Server",
        Brand::VWS => "NVIDIA RTX Virtual Workstation",
        Brand::CloudGaming | Brand::VGaming => "NVIDIA Cloud Gaming",
        Brand::QuadroRTX => "Quadro RTX",
        Brand::NvidiaRTX => "NVIDIA RTX",
        Brand::Nvidia => "NVIDIA",
        Brand::GeForceRTX => "GeForce RTX",
        Brand::TitanRTX => "Titan RTX",
    })
}

fn arch_name(a: DeviceArchitecture) -> &'static str {
    match a {
        DeviceArchitecture::Kepler => "kepler",
        DeviceArchitecture::Maxwell => "maxwell",
        DeviceArchitecture::Pascal => "pascal",
        DeviceArchitecture::Volta => "volta",
        DeviceArchitecture::Turing => "turing",
        DeviceArchitecture::Ampere => "ampere",
        DeviceArchitecture::Ada => "ada-lovelace",
        DeviceArchitecture::Hopper => "hopper",
        DeviceArchitecture::Blackwell => "blackwell",
        DeviceArchitecture::Unknown => "unknown",
    }
}

/// What the backend remembers between calls.
#[derive(Default)]
struct Seen {
    /// Last Xid per GPU index, from this backend's event subscriptions.
    last_xid: HashMap<u32, u64>,
    /// Whether any subscription exists (before one does, `last_xid` is unknown).
    subscribed: bool,
}

/// A MIG device's (GPU-instance id, compute-instance id).
type MigDeviceIds = (u32, u32);

/// A [`GpuBackend`] over libnvidia-ml.
#[derive(Clone)]
pub struct NvmlBackend {
    nvml: Arc<Nvml>,
    lib: PathBuf,
    seen: Arc<Mutex<Seen>>,
}

impl std::fmt::Debug for NvmlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlBackend")
            .field("lib", &self.lib)
            .finish_non_exhaustive()
    }
}

impl NvmlBackend {
    /// Loads and initialises NVML from `lib` (default `libnvidia-ml.so.1` on the
    /// loader path). A missing library or driver is
    /// [`BackendError::LibraryUnavailable`] naming the path.
    pub fn open(lib: Option<&Path>) -> Result<Self, BackendError> {
        let path = lib
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_LIB));
        let nvml = Nvml::builder()
            .lib_path(OsStr::new(path.as_os_str()))
            .init()
            .map_err(|e| BackendError::LibraryUnavailable {
                detail: format!("loading {}: {e}", path.display()),
            })?;
        tracing::debug!(lib = %path.display(), "NVML initialised");
        Ok(NvmlBackend {
            nvml: Arc::new(nvml),
            lib: path,
            seen: Arc::new(Mutex::new(Seen::default())),
        })
    }

    /// The library path in use.
    pub fn lib_path(&self) -> &Path {
        &self.lib
    }

    fn device(&self, gpu: u32) -> Result<Device<'_>, BackendError> {
        self.nvml.device_by_index(gpu).map_err(|e| match e {
            NvmlError::InvalidArg | NvmlError::NotFound => BackendError::NotFound {
                what: format!(
                    "GPU {gpu} (the node has {} GPUs)",
                    self.nvml.device_count().unwrap_or(0)
                ),
            },
            other => map_err(other, gpu, "get device handle"),
        })
    }

    fn handle(dev: &Device<'_>) -> nvmlDevice_t {
        // SAFETY: the handle is only passed to NVML functions while `dev` (and so
        // the `Nvml` it borrows) is alive.
        unsafe { dev.handle() }
    }

    /// Profiles the device offers, with the hardware ids NVML reports.
    fn profiles(
        &self,
        gpu: u32,
        dev: &Device<'_>,
    ) -> Result<Vec<raw::GiProfileInfo>, BackendError> {
        let h = Self::handle(dev);
        let mut out = Vec::new();
        for e in 0..GI_PROFILE_ENUMS {
            // SAFETY: `h` is the handle of `dev`, which (with the `Nvml` it
            // borrows) outlives the call.
            match unsafe { raw::gi_profile_info(&self.nvml, h, gpu, e) } {
                Ok(info) => {
                    if !out.iter().any(|p: &raw::GiProfileInfo| p.id == info.id) {
                        out.push(info);
                    }
                }
                Err(BackendError::NotSupported { .. })
                | Err(BackendError::InvalidArgument { .. })
                | Err(BackendError::NotFound { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// MIG device UUIDs by (GI id, CI id).
    fn mig_uuids(
        &self,
        gpu: u32,
        dev: &Device<'_>,
    ) -> Result<HashMap<(u32, u32), String>, BackendError> {
        let mut out = HashMap::new();
        for (ids, mig) in self.mig_devices(gpu, dev)? {
            let uuid = mig.uuid().map_err(|e| map_err(e, gpu, "MIG device UUID"))?;
            out.insert(ids, uuid);
        }
        Ok(out)
    }

    /// The MIG device handles of a GPU with their (GI id, CI id); empty slots
    /// in NVML's index range are skipped.
    fn mig_devices<'n>(
        &'n self,
        gpu: u32,
        dev: &Device<'n>,
    ) -> Result<Vec<(MigDeviceIds, Device<'n>)>, BackendError> {
        let max = dev
            .mig_device_count()
            .map_err(|e| map_err(e, gpu, "MIG device count"))?;
        let mut out = Vec::new();
        for i in 0..max {
            let mig = match dev.mig_device_by_index(i) {
                Ok(m) => m,
                Err(NvmlError::NotFound) | Err(NvmlError::InvalidArg) => continue,
                Err(e) => return Err(map_err(e, gpu, "MIG device handle")),
            };
            // SAFETY: `mig` is a live MIG device handle from nvml-wrapper.
            let ids = unsafe { raw::mig_device_ids(&self.nvml, Self::handle(&mig), gpu)? };
            out.push((ids, mig));
        }
        Ok(out)
    }

    fn instances(&self, gpu: u32, dev: &Device<'_>) -> Result<Vec<GpuInstance>, BackendError> {
        let h = Self::handle(dev);
        let profiles = self.profiles(gpu, dev)?;
        let uuids = self.mig_uuids(gpu, dev)?;
        let mut out = Vec::new();
        for p in &profiles {
            // SAFETY: `h` is the handle of `dev`, alive for this whole loop.
            for gi in unsafe { raw::gpu_instances(&self.nvml, h, gpu, p)? } {
                let mut cis = Vec::new();
                let mut seen_profiles = Vec::new();
                for e in 0..CI_PROFILE_ENUMS {
                    // SAFETY: NVML just listed `gi` on the live device; nothing
                    // here destroys it.
                    let Some(cp) = (unsafe { raw::ci_profile(&self.nvml, gi.handle, gpu, e)? })
                    else {
                        continue;
                    };
                    if seen_profiles.contains(&cp.id) {
                        continue;
                    }
                    seen_profiles.push(cp.id);
                    // SAFETY: as above, `gi.handle` is live.
                    for ci in unsafe { raw::compute_instances(&self.nvml, gi.handle, gpu, &cp)? } {
                        cis.push(ComputeInstance {
                            id: ci.id,
                            profile_id: e,
                            slice_count: cp.slice_count,
                            placement: SlicePlacement {
                                start: ci.start,
                                size: ci.size,
                            },
                            uuid: uuids.get(&(gi.id, ci.id)).cloned().unwrap_or_default(),
                        });
                    }
                }
                cis.sort_by_key(|c| c.id);
                out.push(GpuInstance {
                    id: gi.id,
                    profile_id: gi.profile_id,
                    profile_name: p.name.clone(),
                    placement: SlicePlacement {
                        start: gi.start,
                        size: gi.size,
                    },
                    compute_instances: cis,
                });
            }
        }
        out.sort_by_key(|g| g.id);
        Ok(out)
    }

    fn require_mig_on(
        &self,
        gpu: u32,
        dev: &Device<'_>,
        operation: &str,
    ) -> Result<(), BackendError> {
        let m = dev.mig_mode().map_err(|e| map_err(e, gpu, "MIG mode"))?;
        if m.current == 1 {
            Ok(())
        } else {
            Err(BackendError::NotSupported {
                gpu,
                operation: format!("{operation}: MIG mode is disabled (enable it first)"),
            })
        }
    }
}

impl GpuBackend for NvmlBackend {
    fn name(&self) -> &str {
        "nvml"
    }

    fn system_info(&self) -> Result<SystemInfo, BackendError> {
        let driver_version = self
            .nvml
            .sys_driver_version()
            .map_err(|e| map_err(e, 0, "driver version"))?;
        let cuda = self
            .nvml
            .sys_cuda_driver_version()
            .map_err(|e| map_err(e, 0, "CUDA driver version"))?;
        let nvml_version = self
            .nvml
            .sys_nvml_version()
            .map_err(|e| map_err(e, 0, "NVML version"))?;
        Ok(SystemInfo {
            driver_version,
            cuda_driver_version: format!("{}.{}", cuda / 1000, (cuda % 1000) / 10),
            nvml_version,
        })
    }

    fn device_count(&self) -> Result<u32, BackendError> {
        self.nvml
            .device_count()
            .map_err(|e| map_err(e, 0, "device count"))
    }

    fn gpu_info(&self, gpu: u32) -> Result<GpuInfo, BackendError> {
        let dev = self.device(gpu)?;
        let e = |op: &'static str| move |err: NvmlError| map_err(err, gpu, op);
        let pci = dev.pci_info().map_err(e("PCI info"))?;
        let mem = dev.memory_info().map_err(e("memory info"))?;
        let cc = dev
            .cuda_compute_capability()
            .map_err(e("compute capability"))?;
        let numa_node = match dev.numa_node_id() {
            Ok(n) => Some(n),
            Err(NvmlError::NotSupported) | Err(NvmlError::FailedToLoadSymbol(_)) => None,
            Err(err) => return Err(map_err(err, gpu, "NUMA node")),
        };
        let mig_mode = match dev.mig_mode() {
            Ok(m) => Some(MigMode {
                current: m.current == 1,
                pending: m.pending == 1,
            }),
            Err(NvmlError::NotSupported) => None,
            Err(err) => return Err(map_err(err, gpu, "MIG mode")),
        };
        Ok(GpuInfo {
            index: gpu,
            uuid: dev.uuid().map_err(e("UUID"))?,
            name: dev.name().map_err(e("name"))?,
            pci_bus_id: pci.bus_id,
            pci_device_id: pci.pci_device_id,
            minor_number: dev.minor_number().map_err(e("minor number"))?,
            memory_total_bytes: mem.total,
            numa_node,
            architecture: arch_name(dev.architecture().map_err(e("architecture"))?).to_string(),
            compute_capability: (cc.major.max(0) as u32, cc.minor.max(0) as u32),
            mig_capable: mig_mode.is_some(),
            mig_mode,
        })
    }

    fn mig_mode(&self, gpu: u32) -> Result<MigMode, BackendError> {
        let dev = self.device(gpu)?;
        let m = dev.mig_mode().map_err(|e| map_err(e, gpu, "MIG mode"))?;
        Ok(MigMode {
            current: m.current == 1,
            pending: m.pending == 1,
        })
    }

    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<MigModeChange, BackendError> {
        let dev = self.device(gpu)?;
        dev.set_mig_mode(enabled)
            .map_err(|e| map_err(e, gpu, "set MIG mode"))?;
        let m = self.mig_mode(gpu)?;
        Ok(if m.current == enabled {
            MigModeChange::Applied
        } else {
            MigModeChange::PendingReset
        })
    }

    fn gpu_instance_profiles(&self, gpu: u32) -> Result<Vec<GpuInstanceProfile>, BackendError> {
        let dev = self.device(gpu)?;
        // A GPU without MIG answers "not supported", not an empty list.
        dev.mig_mode()
            .map_err(|e| map_err(e, gpu, "MIG profiles"))?;
        let h = Self::handle(&dev);
        self.profiles(gpu, &dev)?
            .into_iter()
            .map(|p| {
                // SAFETY: `h` is the handle of `dev`, alive across the call.
                let placements = unsafe { raw::possible_placements(&self.nvml, h, gpu, p.id)? }
                    .into_iter()
                    .map(|(start, size)| SlicePlacement { start, size })
                    .collect();
                Ok(GpuInstanceProfile {
                    id: p.id,
                    name: p.name,
                    slice_count: p.slice_count,
                    memory_mib: p.memory_mib,
                    multiprocessor_count: p.multiprocessor_count,
                    instance_count: p.instance_count,
                    placements,
                })
            })
            .collect::<Result<Vec<_>, BackendError>>()
            .map(|mut v| {
                crate::sim::sort_profiles(&mut v);
                v
            })
    }

    fn gpu_instances(&self, gpu: u32) -> Result<Vec<GpuInstance>, BackendError> {
        let dev = self.device(gpu)?;
        self.require_mig_on(gpu, &dev, "listing GPU instances")?;
        self.instances(gpu, &dev)
    }

    fn create_gpu_instance(
        &self,
        gpu: u32,
        profile_id: u32,
        placement: SlicePlacement,
    ) -> Result<GpuInstance, BackendError> {
        let dev = self.device(gpu)?;
        self.require_mig_on(gpu, &dev, "creating a GPU instance")?;
        let profiles = self.profiles(gpu, &dev)?;
        let p = profiles
            .iter()
            .find(|p| p.id == profile_id)
            .ok_or_else(|| BackendError::InvalidArgument {
                gpu,
                detail: format!(
                    "no GPU-instance profile id {profile_id} on this GPU (profiles: {})",
                    profiles
                        .iter()
                        .map(|p| format!("{}={}", p.id, p.name))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })?;
        // SAFETY: `dev` is a live device handle from nvml-wrapper.
        let gi = unsafe {
            raw::create_gpu_instance(
                &self.nvml,
                Self::handle(&dev),
                gpu,
                profile_id,
                placement.start,
                placement.size,
            )?
        };
        Ok(GpuInstance {
            id: gi.id,
            profile_id: gi.profile_id,
            profile_name: p.name.clone(),
            placement: SlicePlacement {
                start: gi.start,
                size: gi.size,
            },
            compute_instances: Vec::new(),
        })
    }

    fn create_compute_instance(
        &self,
        gpu: u32,
        gpu_instance_id: u32,
        slice_count: u32,
    ) -> Result<ComputeInstance, BackendError> {
        let dev = self.device(gpu)?;
        self.require_mig_on(gpu, &dev, "creating a compute instance")?;
        // SAFETY: `dev` is a live device handle from nvml-wrapper.
        let gi = unsafe {
            raw::gpu_instance_by_id(&self.nvml, Self::handle(&dev), gpu, gpu_instance_id)?
        };
        let mut sizes = Vec::new();
        let mut chosen = None;
        for e in 0..CI_PROFILE_ENUMS {
            // SAFETY: NVML just returned `gi` for the live device.
            if let Some(cp) = unsafe { raw::ci_profile(&self.nvml, gi.handle, gpu, e)? } {
                sizes.push(cp.slice_count);
                if cp.slice_count == slice_count && chosen.is_none() {
                    chosen = Some((e, cp.id));
                }
            }
        }
        let Some((profile_enum, ci_profile_id)) = chosen else {
            return Err(BackendError::InvalidArgument {
                gpu,
                detail: format!(
                    "GPU instance {gpu_instance_id} has no {slice_count}-slice compute instance (sizes: {sizes:?})"
                ),
            });
        };
        // SAFETY: `gi.handle` is live (returned above, not destroyed).
        let ci =
            unsafe { raw::create_compute_instance(&self.nvml, gi.handle, gpu, ci_profile_id)? };
        let uuid = self
            .mig_uuids(gpu, &dev)?
            .remove(&(gpu_instance_id, ci.id))
            .unwrap_or_default();
        Ok(ComputeInstance {
            id: ci.id,
            profile_id: profile_enum,
            slice_count,
            placement: SlicePlacement {
                start: ci.start,
                size: ci.size,
            },
            uuid,
        })
    }

    fn destroy_compute_instance(
        &self,
        gpu: u32,
        gpu_instance_id: u32,
        compute_instance_id: u32,
    ) -> Result<(), BackendError> {
        let dev = self.device(gpu)?;
        self.require_mig_on(gpu, &dev, "destroying a compute instance")?;
        // SAFETY: `dev` is a live device handle; `gi` and `ci` were just returned
        // by NVML for it, and `ci` is consumed by the destroy.
        unsafe {
            let gi = raw::gpu_instance_by_id(&self.nvml, Self::handle(&dev), gpu, gpu_instance_id)?;
            let ci = raw::compute_instance_by_id(
                &self.nvml,
                gi.handle,
                gpu,
                gpu_instance_id,
                compute_instance_id,
            )?;
            raw::destroy_compute_instance(&self.nvml, ci, gpu)
        }
    }

    fn destroy_gpu_instance(&self, gpu: u32, gpu_instance_id: u32) -> Result<(), BackendError> {
        let dev = self.device(gpu)?;
        self.require_mig_on(gpu, &dev, "destroying a GPU instance")?;
        // SAFETY: `dev` is a live device handle; `gi` was just returned by NVML
        // for it and is consumed by the destroy.
        let destroyed = unsafe {
            let gi = raw::gpu_instance_by_id(&self.nvml, Self::handle(&dev), gpu, gpu_instance_id)?;
            raw::destroy_gpu_instance(&self.nvml, gi, gpu)
        };
        destroyed.map_err(|e| match e {
            BackendError::InUse { gpu, .. } => BackendError::InUse {
                gpu,
                detail: format!(
                    "GPU instance {gpu_instance_id} still has compute instances or processes; destroy them first"
                ),
            },
            other => other,
        })
    }

    fn reset_gpu(&self, gpu: u32) -> Result<(), BackendError> {
        Err(BackendError::NotSupported {
            gpu,
            operation: "GPU reset through NVML (use `nvidia-smi -r -i <gpu>` or reboot the node)"
                .into(),
        })
    }

    /// One sample. Profiling comes from two GPM samples [`GPM_INTERVAL`] apart
    /// (the first taken before the other reads, the second after them), so on
    /// GPUs with GPM the call takes at least that long.
    ///
    /// [`GPM_INTERVAL`]: telemetry::GPM_INTERVAL
    fn gpu_telemetry(&self, gpu: u32) -> Result<GpuTelemetry, BackendError> {
        let dev = self.device(gpu)?;
        let h = Self::handle(&dev);
        let n = &self.nvml;
        let m = |op: &'static str| move |e: NvmlError| map_err(e, gpu, op);
        let started = Instant::now();
        let gpm_first =
            telemetry::gpm_available(&dev, gpu).and_then(|()| telemetry::gpm_sample(&dev, gpu));
        let util = reading(dev.utilization_rates().map_err(m("utilization")))?;
        let links = telemetry::links(&dev, gpu);
        let span = links.as_ref().map_or(0, |l| l.span());
        // One field-value call: HBM temperature, NVLink data over all links,
        // then per link up to the last active one.
        let mut requests = vec![
            (FI_MEMORY_TEMP, 0),
            (telemetry::FI_NVLINK_TX, ALL_LINKS),
            (telemetry::FI_NVLINK_RX, ALL_LINKS),
        ];
        requests.extend(telemetry::link_fields(span));
        // SAFETY: `h` is the handle of `dev`, which outlives the call.
        let fields = unsafe { raw::field_values(n, h, gpu, &requests) };
        let field = |i: usize| match &fields {
            Ok(v) => v[i].clone(),
            Err(e) => Err(e.clone()),
        };
        let nvlink = match (field(1), field(2)) {
            (Ok(tx), Ok(rx)) => Ok(tx.saturating_add(rx)),
            (Err(e), _) | (_, Err(e)) => Err(e),
        };
        let link_kib = links.clone().and_then(|l| match &fields {
            Ok(v) => telemetry::link_kib(&l, &v[3..]),
            Err(e) => Err(e.clone()),
        });
        let last_xid = {
            let seen = self.seen.lock().map_err(|_| BackendError::Other {
                message: "NVML backend state lock poisoned".into(),
            })?;
            if seen.subscribed {
                Reading::Value(seen.last_xid.get(&gpu).copied().unwrap_or(0))
            } else {
                Reading::NotSupported
            }
        };
        let mut t = GpuTelemetry {
            gpu,
            sm_clock_mhz: reading(dev.clock_info(Clock::SM).map_err(m("SM clock")))?,
            mem_clock_mhz: reading(dev.clock_info(Clock::Memory).map_err(m("memory clock")))?,
            gpu_temp_c: reading(
                dev.temperature(TemperatureSensor::Gpu)
                    .map_err(m("GPU temperature")),
            )?,
            memory_temp_c: reading(field(0).map(|v| v as u32))?,
            power_usage_mw: reading(dev.power_usage().map_err(m("power usage")))?,
            total_energy_mj: reading(
                dev.total_energy_consumption()
                    .map_err(m("energy consumption")),
            )?,
            pcie_replay_count: reading(
                dev.pcie_replay_counter()
                    .map(u64::from)
                    .map_err(m("PCIe replay counter")),
            )?,
            gpu_util_pct: util.clone().map(|u| u.gpu),
            mem_copy_util_pct: util.map(|u| u.memory),
            enc_util_pct: reading(
                dev.encoder_utilization()
                    .map(|u| u.utilization)
                    .map_err(m("encoder utilization")),
            )?,
            dec_util_pct: reading(
                dev.decoder_utilization()
                    .map(|u| u.utilization)
                    .map_err(m("decoder utilization")),
            )?,
            fb_memory: reading(
                dev.memory_info()
                    .map(|i| FbMemory {
                        total: i.total,
                        used: i.used,
                        free: i.free,
                        reserved: i.reserved,
                    })
                    .map_err(m("memory info")),
            )?,
            nvlink_total_kib: reading(nvlink)?,
            // SAFETY: `h` is the handle of `dev`, alive across the call.
            remapped_rows: reading(unsafe { raw::remapped_rows(n, h, gpu) }.map(
                |(c, u, p, f)| RemappedRows {
                    correctable: c,
                    uncorrectable: u,
                    pending: p,
                    failed: f,
                },
            ))?,
            pcie_tx_kib_per_s: reading(
                dev.pcie_throughput(PcieUtilCounter::Send)
                    .map_err(m("PCIe TX throughput")),
            )?,
            pcie_rx_kib_per_s: reading(
                dev.pcie_throughput(PcieUtilCounter::Receive)
                    .map_err(m("PCIe RX throughput")),
            )?,
            // Filled in last, once the GPM interval has passed.
            profiling: Reading::NotSupported,
            last_xid,
            violations: reading(telemetry::violations(&dev, gpu))?,
            ecc_errors: reading(telemetry::ecc_errors(&dev, gpu))?,
            retired_pages: reading(telemetry::retired_pages(&dev, gpu))?,
            nvlink_errors: reading(
                links
                    .as_ref()
                    .map_err(Clone::clone)
                    .and_then(|l| telemetry::nvlink_errors(&dev, gpu, l)),
            )?,
            nvlink_link_kib: reading(link_kib)?,
            // nvml-wrapper's name for nvmlDeviceGetCurrentClocksEventReasons
            // (the same call and bits under NVML's older name).
            clocks_event_reasons: reading(
                dev.current_throttle_reasons()
                    .map(|r| r.bits())
                    .map_err(m("clock event reasons")),
            )?,
        };
        t.profiling = reading(gpm_first.and_then(|first| {
            telemetry::wait_out_interval(started);
            let second = telemetry::gpm_sample(&dev, gpu)?;
            telemetry::gpm_profiling(n, gpu, &first, &second, telemetry::GpmScope::Gpu)
        }))?;
        Ok(t)
    }

    /// One sample per GPU instance. Profiling comes from two GPM samples per
    /// instance: all first samples are taken before, all second ones after one
    /// shared [`GPM_INTERVAL`].
    ///
    /// [`GPM_INTERVAL`]: telemetry::GPM_INTERVAL
    fn mig_telemetry(&self, gpu: u32) -> Result<Vec<MigTelemetry>, BackendError> {
        let dev = self.device(gpu)?;
        self.require_mig_on(gpu, &dev, "MIG telemetry")?;
        let instances = self.instances(gpu, &dev)?;
        let started = Instant::now();
        let gpm = telemetry::gpm_available(&dev, gpu);
        let firsts: Vec<_> = instances
            .iter()
            .map(|gi| {
                gpm.clone()
                    .and_then(|()| telemetry::gpm_mig_sample(&dev, gpu, gi.id))
            })
            .collect();
        // Memory of a GPU instance, read through the first MIG device in it.
        let mut fb: HashMap<u32, Reading<FbMemory>> = HashMap::new();
        for ((gi, _), mig) in self.mig_devices(gpu, &dev)? {
            if fb.contains_key(&gi) {
                continue;
            }
            let r = reading(
                mig.memory_info()
                    .map(|m| FbMemory {
                        total: m.total,
                        used: m.used,
                        free: m.free,
                        reserved: m.reserved,
                    })
                    .map_err(|e| map_err(e, gpu, "MIG memory info")),
            )?;
            fb.insert(gi, r);
        }
        if firsts.iter().any(Result::is_ok) {
            telemetry::wait_out_interval(started);
        }
        instances
            .iter()
            .zip(firsts)
            .map(|(gi, first)| {
                let profiling = reading(first.and_then(|first| {
                    let second = telemetry::gpm_mig_sample(&dev, gpu, gi.id)?;
                    telemetry::gpm_profiling(
                        &self.nvml,
                        gpu,
                        &first,
                        &second,
                        telemetry::GpmScope::GpuInstance,
                    )
                }))?;
                Ok(MigTelemetry {
                    gpu,
                    gpu_instance_id: gi.id,
                    fb_memory: fb.remove(&gi.id).unwrap_or(Reading::NotSupported),
                    profiling,
                })
            })
            .collect()
    }

    /// Brand, serial, VBIOS and inforom versions (nvml-wrapper's calls for
    /// `nvmlDeviceGetBrand`, `nvmlDeviceGetSerial`, `nvmlDeviceGetVbiosVersion`,
    /// `nvmlDeviceGetInforomVersion` for the OEM, ECC and power objects, and
    /// `nvmlDeviceGetInforomImageVersion`); what the GPU does not report is
    /// `None`.
    fn device_strings(&self, gpu: u32) -> Result<DeviceStrings, BackendError> {
        let dev = self.device(gpu)?;
        let opt = |r: Result<String, NvmlError>, op: &str| telemetry::optional(r, gpu, op);
        let brand = match dev.brand() {
            // A brand newer than nvml-wrapper knows.
            Err(NvmlError::UnexpectedVariant(code)) => {
                tracing::debug!(gpu, code, "brand unknown to nvml-wrapper");
                None
            }
            r => telemetry::optional(r, gpu, "brand")?
                .and_then(brand_name)
                .map(str::to_string),
        };
        Ok(DeviceStrings {
            brand,
            serial: opt(dev.serial(), "serial number")?,
            vbios_version: opt(dev.vbios_version(), "VBIOS version")?,
            oem_inforom_version: opt(dev.info_rom_version(InfoRom::OEM), "OEM inforom version")?,
            ecc_inforom_version: opt(dev.info_rom_version(InfoRom::ECC), "ECC inforom version")?,
            power_inforom_version: opt(
                dev.info_rom_version(InfoRom::Power),
                "power inforom version",
            )?,
            inforom_image_version: opt(dev.info_rom_image_version(), "inforom image version")?,
        })
    }

    /// `nvmlDeviceGetP2PStatus` with `NVML_P2P_CAPS_INDEX_NVLINK`.
    fn p2p_status(&self, gpu: u32, peer: u32) -> Result<P2pStatus, BackendError> {
        let dev = self.device(gpu)?;
        let other = self.device(peer)?;
        match dev.p2p_status(&other, P2pCapabilitiesIndex::NvLink) {
            Ok(s) => Ok(P2pStatus::from_code(s.as_c())),
            // A status newer than nvml-wrapper knows.
            Err(NvmlError::UnexpectedVariant(_)) => Ok(P2pStatus::Unknown),
            Err(e) => Err(map_err(e, gpu, "NVLink peer-to-peer status")),
        }
    }

    /// With MIG on, each MIG device handle is asked for its compute processes
    /// (`nvmlDeviceGetComputeRunningProcesses_v3` per MIG device), so every
    /// process carries its GPU- and compute-instance ids whatever the caller's
    /// privileges; with MIG off (or on GPUs without MIG) the GPU itself is asked.
    fn running_processes(&self, gpu: u32) -> Result<Vec<GpuProcess>, BackendError> {
        let dev = self.device(gpu)?;
        let mig_on = match dev.mig_mode() {
            Ok(m) => m.current == 1,
            Err(NvmlError::NotSupported) | Err(NvmlError::FunctionNotFound) => false,
            Err(e) => return Err(map_err(e, gpu, "MIG mode")),
        };
        if !mig_on {
            let list = dev
                .running_compute_processes()
                .map_err(|e| map_err(e, gpu, "running compute processes"))?;
            return Ok(list.into_iter().map(|p| process(p, None)).collect());
        }
        let mut out = Vec::new();
        for (ids, mig) in self.mig_devices(gpu, &dev)? {
            let list = mig
                .running_compute_processes()
                .map_err(|e| map_err(e, gpu, "running compute processes on a MIG device"))?;
            out.extend(list.into_iter().map(|p| process(p, Some(ids))));
        }
        out.sort_by_key(|p| (p.gpu_instance_id, p.compute_instance_id, p.pid));
        Ok(out)
    }

    fn health_events(&self) -> Result<Box<dyn HealthEvents>, BackendError> {
        let set = raw::EventSet::create(Arc::clone(&self.nvml))?;
        let count = self.device_count()?;
        let mut uuids = HashMap::new();
        for gpu in 0..count {
            let dev = match self.device(gpu) {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!(gpu, error = %e, "GPU not watched for Xid events");
                    continue;
                }
            };
            // SAFETY: `dev` is a live device handle of the set's own `Nvml`.
            match unsafe { set.register_xid(Self::handle(&dev), gpu) } {
                Ok(()) => {}
                Err(BackendError::NotSupported { .. }) => {
                    tracing::info!(gpu, "GPU does not report Xid events");
                }
                // The set is freed when it is dropped here.
                Err(e) => return Err(e),
            }
            if let Ok(u) = dev.uuid() {
                uuids.insert(gpu, u);
            }
        }
        if let Ok(mut seen) = self.seen.lock() {
            seen.subscribed = true;
        }
        Ok(Box::new(NvmlEvents {
            backend: self.clone(),
            set,
            uuids,
            queued: None,
        }))
    }
}

/// A subscription to Xid events of every GPU.
struct NvmlEvents {
    backend: NvmlBackend,
    /// Freed when the subscription is dropped.
    set: raw::EventSet,
    uuids: HashMap<u32, String>,
    /// A GPU-lost event that follows an Xid 79.
    queued: Option<HealthEvent>,
}

/// Xid 79: "GPU has fallen off the bus".
const XID_FELL_OFF_BUS: u64 = 79;

impl HealthEvents for NvmlEvents {
    fn wait(&mut self, timeout: Duration) -> Result<Option<HealthEvent>, BackendError> {
        if let Some(e) = self.queued.take() {
            return Ok(Some(e));
        }
        let ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        let Some(ev) = self.set.wait(ms)? else {
            return Ok(None);
        };
        // SAFETY: NVML reported `ev.device` for a device registered with the set,
        // whose `Nvml` (the backend's) is alive.
        let gpu = unsafe { raw::device_index(&self.backend.nvml, ev.device)? };
        let uuid = self.uuids.get(&gpu).cloned().unwrap_or_default();
        let id = |v: u32| (v != u32::MAX).then_some(v);
        let event = HealthEvent {
            gpu,
            uuid: uuid.clone(),
            gpu_instance_id: id(ev.gpu_instance_id),
            compute_instance_id: id(ev.compute_instance_id),
            kind: HealthEventKind::Xid { xid: ev.data },
        };
        if let Ok(mut seen) = self.backend.seen.lock() {
            seen.last_xid.insert(gpu, ev.data);
        }
        if ev.data == XID_FELL_OFF_BUS {
            self.queued = Some(HealthEvent {
                gpu,
                uuid,
                gpu_instance_id: None,
                compute_instance_id: None,
                kind: HealthEventKind::GpuLost,
            });
        }
        Ok(Some(event))
    }
}
