//! Small unsafe wrappers over NVML functions nvml-wrapper does not wrap (or wraps
//! wrongly): GPU- and compute-instance profiles, placements, create, list and
//! destroy; MIG device ids; remapped rows; field values; events with their MIG
//! instance ids.
//!
//! Every function here takes a raw handle obtained from nvml-wrapper (or from
//! another function here) that stays valid while the `Nvml` it came from lives,
//! passes correctly sized, zero-initialised out-parameters, and converts the
//! return code with [`check`]. Symbols are resolved per call through
//! `Nvml::lib()`, so a missing symbol is a typed error, not a failed load.

// NVML constant names come from the C header.
#![allow(non_upper_case_globals)]

use std::ffi::c_uint;
use std::mem;

use gpu_stack_core::backend::BackendError;
use nvml_wrapper::Nvml;
use nvml_wrapper_sys::bindings::*;

/// `NVML_STRUCT_VERSION(T, v)`: the size of the struct with the version in the top byte.
fn struct_version<T>(v: u32) -> c_uint {
    (mem::size_of::<T>() as u32) | (v << 24)
}

/// Maps an NVML return code to a [`BackendError`].
pub fn check(code: nvmlReturn_t, gpu: u32, operation: &str) -> Result<(), BackendError> {
    let op = || operation.to_string();
    Err(match code {
        nvmlReturn_enum_NVML_SUCCESS => return Ok(()),
        nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED => BackendError::NotSupported {
            gpu,
            operation: op(),
        },
        nvmlReturn_enum_NVML_ERROR_NO_PERMISSION => BackendError::NoPermission {
            gpu,
            operation: op(),
        },
        nvmlReturn_enum_NVML_ERROR_NOT_FOUND => BackendError::NotFound {
            what: format!("{operation} on GPU {gpu}"),
        },
        nvmlReturn_enum_NVML_ERROR_IN_USE => BackendError::InUse {
            gpu,
            detail: format!("{operation}: the resource is in use"),
        },
        nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES => BackendError::InsufficientResources {
            gpu,
            detail: format!("{operation}: not enough free slices"),
        },
        nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT => BackendError::InvalidArgument {
            gpu,
            detail: format!("{operation}: the driver rejected an argument"),
        },
        nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST => BackendError::GpuLost { gpu },
        nvmlReturn_enum_NVML_ERROR_TIMEOUT => BackendError::Timeout { operation: op() },
        nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND => {
            BackendError::MissingFunction { symbol: op() }
        }
        nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED
        | nvmlReturn_enum_NVML_ERROR_LIBRARY_NOT_FOUND
        | nvmlReturn_enum_NVML_ERROR_UNINITIALIZED => BackendError::LibraryUnavailable {
            detail: format!("{operation}: NVML return code {code}"),
        },
        other => BackendError::Other {
            message: format!("{operation} on GPU {gpu}: NVML return code {other}"),
        },
    })
}

/// Resolves a symbol of the loaded library or reports it missing.
macro_rules! sym {
    ($nvml:expr, $name:ident) => {
        $nvml
            .lib()
            .$name
            .as_ref()
            .map_err(|_| BackendError::MissingFunction {
                symbol: stringify!($name).to_string(),
            })?
    };
}

fn c_name(raw: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = raw
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// GPU-instance profile information (v2 struct, which carries the name).
#[derive(Debug, Clone)]
pub struct GiProfileInfo {
    /// Hardware profile id.
    pub id: u32,
    /// Compute slices.
    pub slice_count: u32,
    /// Instances possible.
    pub instance_count: u32,
    /// SMs.
    pub multiprocessor_count: u32,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// Name without the `MIG ` prefix.
    pub name: String,
}

/// `nvmlDeviceGetGpuInstanceProfileInfoV` for profile enum `profile`.
pub fn gi_profile_info(
    nvml: &Nvml,
    dev: nvmlDevice_t,
    gpu: u32,
    profile: u32,
) -> Result<GiProfileInfo, BackendError> {
    let f = sym!(nvml, nvmlDeviceGetGpuInstanceProfileInfoV);
    // SAFETY: `dev` is a live device handle; `info` is a zeroed v2 struct with its
    // version set, as the function requires.
    unsafe {
        let mut info: nvmlGpuInstanceProfileInfo_v2_t = mem::zeroed();
        info.version = struct_version::<nvmlGpuInstanceProfileInfo_v2_t>(2);
        check(f(dev, profile, &mut info), gpu, "GPU-instance profile info")?;
        let name = c_name(&info.name);
        Ok(GiProfileInfo {
            id: info.id,
            slice_count: info.sliceCount,
            instance_count: info.instanceCount,
            multiprocessor_count: info.multiprocessorCount,
            memory_mib: info.memorySizeMB,
            name: name.strip_prefix("MIG ").unwrap_or(&name).to_string(),
        })
    }
}

/// `nvmlDeviceGetGpuInstancePossiblePlacements_v2` (nvml-wrapper's version never
/// sets the vector length and so returns nothing).
pub fn possible_placements(
    nvml: &Nvml,
    dev: nvmlDevice_t,
    gpu: u32,
    profile_id: u32,
) -> Result<Vec<(u32, u32)>, BackendError> {
    let f = sym!(nvml, nvmlDeviceGetGpuInstancePossiblePlacements_v2);
    // SAFETY: first call with a null buffer asks for the count; the second passes a
    // buffer of exactly `count` zeroed entries, and the length is then set to the
    // count NVML reports it wrote (never above the capacity).
    unsafe {
        let mut count: c_uint = 0;
        let code = f(dev, profile_id, std::ptr::null_mut(), &mut count);
        if code != nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE {
            check(code, gpu, "possible placements")?;
        }
        let mut buf: Vec<nvmlGpuInstancePlacement_t> = vec![mem::zeroed(); count as usize];
        let mut written = count;
        check(
            f(dev, profile_id, buf.as_mut_ptr(), &mut written),
            gpu,
            "possible placements",
        )?;
        buf.truncate(written.min(count) as usize);
        Ok(buf.iter().map(|p| (p.start, p.size)).collect())
    }
}

/// A GPU instance as NVML describes it.
#[derive(Debug, Clone, Copy)]
pub struct GiInfo {
    /// Handle.
    pub handle: nvmlGpuInstance_t,
    /// Id.
    pub id: u32,
    /// Hardware profile id.
    pub profile_id: u32,
    /// Placement start.
    pub start: u32,
    /// Placement size.
    pub size: u32,
}

fn gi_info(nvml: &Nvml, gi: nvmlGpuInstance_t, gpu: u32) -> Result<GiInfo, BackendError> {
    let f = sym!(nvml, nvmlGpuInstanceGetInfo);
    // SAFETY: `gi` is a live GPU-instance handle; `info` is a zeroed out-struct.
    unsafe {
        let mut info: nvmlGpuInstanceInfo_t = mem::zeroed();
        check(f(gi, &mut info), gpu, "GPU-instance info")?;
        Ok(GiInfo {
            handle: gi,
            id: info.id,
            profile_id: info.profileId,
            start: info.placement.start,
            size: info.placement.size,
        })
    }
}

/// Every GPU instance of profile `profile_id`.
pub fn gpu_instances(
    nvml: &Nvml,
    dev: nvmlDevice_t,
    gpu: u32,
    profile_id: u32,
    max: u32,
) -> Result<Vec<GiInfo>, BackendError> {
    let f = sym!(nvml, nvmlDeviceGetGpuInstances);
    // SAFETY: the buffer holds `max` handles (the profile's instance count), and
    // NVML writes at most that many, reporting how many in `count`.
    let handles = unsafe {
        let mut buf: Vec<nvmlGpuInstance_t> = vec![std::ptr::null_mut(); max.max(1) as usize];
        let mut count: c_uint = 0;
        check(
            f(dev, profile_id, buf.as_mut_ptr(), &mut count),
            gpu,
            "list GPU instances",
        )?;
        buf.truncate((count as usize).min(buf.len()));
        buf
    };
    handles.into_iter().map(|h| gi_info(nvml, h, gpu)).collect()
}

/// `nvmlDeviceCreateGpuInstanceWithPlacement`.
pub fn create_gpu_instance(
    nvml: &Nvml,
    dev: nvmlDevice_t,
    gpu: u32,
    profile_id: u32,
    start: u32,
    size: u32,
) -> Result<GiInfo, BackendError> {
    let f = sym!(nvml, nvmlDeviceCreateGpuInstanceWithPlacement);
    // SAFETY: `placement` lives across the call; `gi` is an out-handle.
    let handle = unsafe {
        let placement = nvmlGpuInstancePlacement_t { start, size };
        let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
        check(
            f(dev, profile_id, &placement, &mut gi),
            gpu,
            "create GPU instance",
        )?;
        gi
    };
    gi_info(nvml, handle, gpu)
}

/// `nvmlDeviceGetGpuInstanceById`.
pub fn gpu_instance_by_id(
    nvml: &Nvml,
    dev: nvmlDevice_t,
    gpu: u32,
    id: u32,
) -> Result<GiInfo, BackendError> {
    let f = sym!(nvml, nvmlDeviceGetGpuInstanceById);
    // SAFETY: out-handle only.
    let handle = unsafe {
        let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
        check(f(dev, id, &mut gi), gpu, "find GPU instance").map_err(|e| match e {
            BackendError::NotFound { .. } | BackendError::InvalidArgument { .. } => {
                BackendError::NotFound {
                    what: format!("GPU instance {id} on GPU {gpu}"),
                }
            }
            other => other,
        })?;
        gi
    };
    gi_info(nvml, handle, gpu)
}

/// `nvmlGpuInstanceDestroy`.
pub fn destroy_gpu_instance(
    nvml: &Nvml,
    gi: nvmlGpuInstance_t,
    gpu: u32,
) -> Result<(), BackendError> {
    let f = sym!(nvml, nvmlGpuInstanceDestroy);
    // SAFETY: `gi` is a live GPU-instance handle; NVML invalidates it on success.
    unsafe { check(f(gi), gpu, "destroy GPU instance") }
}

/// A compute instance as NVML describes it.
#[derive(Debug, Clone, Copy)]
pub struct CiInfo {
    /// Handle.
    pub handle: nvmlComputeInstance_t,
    /// Id.
    pub id: u32,
    /// Compute-instance profile id.
    pub profile_id: u32,
    /// Placement start (compute slices).
    pub start: u32,
    /// Placement size.
    pub size: u32,
}

fn ci_info(nvml: &Nvml, ci: nvmlComputeInstance_t, gpu: u32) -> Result<CiInfo, BackendError> {
    let f = sym!(nvml, nvmlComputeInstanceGetInfo_v2);
    // SAFETY: `ci` is a live compute-instance handle; zeroed out-struct.
    unsafe {
        let mut info: nvmlComputeInstanceInfo_t = mem::zeroed();
        check(f(ci, &mut info), gpu, "compute-instance info")?;
        Ok(CiInfo {
            handle: ci,
            id: info.id,
            profile_id: info.profileId,
            start: info.placement.start,
            size: info.placement.size,
        })
    }
}

/// Compute-instance profile id and slice count for profile enum `profile`
/// (shared engine profile), or `None` when the GPU instance does not offer it.
pub fn ci_profile(
    nvml: &Nvml,
    gi: nvmlGpuInstance_t,
    gpu: u32,
    profile: u32,
) -> Result<Option<(u32, u32, u32)>, BackendError> {
    let f = sym!(nvml, nvmlGpuInstanceGetComputeInstanceProfileInfoV);
    // SAFETY: zeroed v2 out-struct with its version set.
    unsafe {
        let mut info: nvmlComputeInstanceProfileInfo_v2_t = mem::zeroed();
        info.version = struct_version::<nvmlComputeInstanceProfileInfo_v2_t>(2);
        let code = f(gi, profile, 0, &mut info);
        if code == nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED
            || code == nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT
            || code == nvmlReturn_enum_NVML_ERROR_NOT_FOUND
        {
            return Ok(None);
        }
        check(code, gpu, "compute-instance profile info")?;
        Ok(Some((info.id, info.sliceCount, info.instanceCount)))
    }
}

/// Compute instances of one compute-instance profile id.
pub fn compute_instances(
    nvml: &Nvml,
    gi: nvmlGpuInstance_t,
    gpu: u32,
    profile_id: u32,
    max: u32,
) -> Result<Vec<CiInfo>, BackendError> {
    let f = sym!(nvml, nvmlGpuInstanceGetComputeInstances);
    // SAFETY: buffer of `max` handles; NVML reports how many it wrote.
    let handles = unsafe {
        let mut buf: Vec<nvmlComputeInstance_t> = vec![std::ptr::null_mut(); max.max(1) as usize];
        let mut count: c_uint = 0;
        check(
            f(gi, profile_id, buf.as_mut_ptr(), &mut count),
            gpu,
            "list compute instances",
        )?;
        buf.truncate((count as usize).min(buf.len()));
        buf
    };
    handles.into_iter().map(|h| ci_info(nvml, h, gpu)).collect()
}

/// `nvmlGpuInstanceCreateComputeInstance` (the driver picks the placement).
pub fn create_compute_instance(
    nvml: &Nvml,
    gi: nvmlGpuInstance_t,
    gpu: u32,
    profile_id: u32,
) -> Result<CiInfo, BackendError> {
    let f = sym!(nvml, nvmlGpuInstanceCreateComputeInstance);
    // SAFETY: out-handle only.
    let handle = unsafe {
        let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
        check(f(gi, profile_id, &mut ci), gpu, "create compute instance")?;
        ci
    };
    ci_info(nvml, handle, gpu)
}

/// `nvmlGpuInstanceGetComputeInstanceById`.
pub fn compute_instance_by_id(
    nvml: &Nvml,
    gi: nvmlGpuInstance_t,
    gpu: u32,
    gi_id: u32,
    id: u32,
) -> Result<CiInfo, BackendError> {
    let f = sym!(nvml, nvmlGpuInstanceGetComputeInstanceById);
    // SAFETY: out-handle only.
    let handle = unsafe {
        let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
        check(f(gi, id, &mut ci), gpu, "find compute instance").map_err(|e| match e {
            BackendError::NotFound { .. } | BackendError::InvalidArgument { .. } => {
                BackendError::NotFound {
                    what: format!("compute instance {id} in GPU instance {gi_id} on GPU {gpu}"),
                }
            }
            other => other,
        })?;
        ci
    };
    ci_info(nvml, handle, gpu)
}

/// `nvmlComputeInstanceDestroy`.
pub fn destroy_compute_instance(
    nvml: &Nvml,
    ci: nvmlComputeInstance_t,
    gpu: u32,
) -> Result<(), BackendError> {
    let f = sym!(nvml, nvmlComputeInstanceDestroy);
    // SAFETY: `ci` is a live compute-instance handle.
    unsafe { check(f(ci), gpu, "destroy compute instance") }
}

/// GPU- and compute-instance ids of a MIG device handle.
pub fn mig_device_ids(
    nvml: &Nvml,
    mig_dev: nvmlDevice_t,
    gpu: u32,
) -> Result<(u32, u32), BackendError> {
    let gi_f = sym!(nvml, nvmlDeviceGetGpuInstanceId);
    let ci_f = sym!(nvml, nvmlDeviceGetComputeInstanceId);
    // SAFETY: `mig_dev` is a live MIG device handle; out-integers.
    unsafe {
        let mut gi: c_uint = 0;
        let mut ci: c_uint = 0;
        check(gi_f(mig_dev, &mut gi), gpu, "MIG device GPU-instance id")?;
        check(
            ci_f(mig_dev, &mut ci),
            gpu,
            "MIG device compute-instance id",
        )?;
        Ok((gi, ci))
    }
}

/// `nvmlDeviceGetRemappedRows`: (correctable, uncorrectable, pending, failed).
pub fn remapped_rows(
    nvml: &Nvml,
    dev: nvmlDevice_t,
    gpu: u32,
) -> Result<(u32, u32, bool, bool), BackendError> {
    let f = sym!(nvml, nvmlDeviceGetRemappedRows);
    // SAFETY: four out-integers.
    unsafe {
        let (mut c, mut u, mut p, mut fl) = (0, 0, 0, 0);
        check(
            f(dev, &mut c, &mut u, &mut p, &mut fl),
            gpu,
            "remapped rows",
        )?;
        Ok((c, u, p != 0, fl != 0))
    }
}

/// One field value as an unsigned integer, or the per-field error.
pub fn field_u64(
    nvml: &Nvml,
    dev: nvmlDevice_t,
    gpu: u32,
    field_id: u32,
    scope_id: u32,
) -> Result<u64, BackendError> {
    let f = sym!(nvml, nvmlDeviceGetFieldValues);
    // SAFETY: one zeroed field-value struct with its id and scope set; NVML fills
    // the value and a per-field return code.
    unsafe {
        let mut v: nvmlFieldValue_t = mem::zeroed();
        v.fieldId = field_id;
        v.scopeId = scope_id;
        check(f(dev, 1, &mut v), gpu, "field values")?;
        check(v.nvmlReturn, gpu, "field value")?;
        Ok(match v.valueType {
            nvmlValueType_enum_NVML_VALUE_TYPE_DOUBLE => v.value.dVal.max(0.0) as u64,
            nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_INT => u64::from(v.value.uiVal),
            nvmlValueType_enum_NVML_VALUE_TYPE_SIGNED_INT => v.value.siVal.max(0) as u64,
            nvmlValueType_enum_NVML_VALUE_TYPE_SIGNED_LONG_LONG => v.value.sllVal.max(0) as u64,
            _ => v.value.ullVal,
        })
    }
}

/// An NVML event set, freed on drop.
pub struct EventSet {
    /// Raw set handle.
    pub set: nvmlEventSet_t,
}

// SAFETY: NVML API calls are thread-safe; the set handle is an opaque token that
// is used from one thread at a time (the subscription owns it exclusively).
unsafe impl Send for EventSet {}

/// One event read from a set.
#[derive(Debug, Clone, Copy)]
pub struct RawEvent {
    /// Device handle (physical GPU).
    pub device: nvmlDevice_t,
    /// Event type bits.
    pub event_type: u64,
    /// Xid for Xid events.
    pub data: u64,
    /// GPU-instance id, `u32::MAX` when not attributed.
    pub gpu_instance_id: u32,
    /// Compute-instance id, `u32::MAX` when not attributed.
    pub compute_instance_id: u32,
}

/// `nvmlEventSetCreate`.
pub fn event_set_create(nvml: &Nvml) -> Result<EventSet, BackendError> {
    let f = sym!(nvml, nvmlEventSetCreate);
    // SAFETY: out-handle only.
    unsafe {
        let mut set: nvmlEventSet_t = std::ptr::null_mut();
        check(f(&mut set), 0, "create event set")?;
        Ok(EventSet { set })
    }
}

/// `nvmlDeviceRegisterEvents` for critical Xid errors.
pub fn register_xid(
    nvml: &Nvml,
    dev: nvmlDevice_t,
    gpu: u32,
    set: &EventSet,
) -> Result<(), BackendError> {
    let f = sym!(nvml, nvmlDeviceRegisterEvents);
    // SAFETY: live device and set handles.
    unsafe {
        check(
            f(dev, u64::from(nvmlEventTypeXidCriticalError), set.set),
            gpu,
            "register Xid events",
        )
    }
}

/// `nvmlEventSetWait_v2`; `Ok(None)` on timeout.
pub fn event_wait(
    nvml: &Nvml,
    set: &EventSet,
    timeout_ms: u32,
) -> Result<Option<RawEvent>, BackendError> {
    let f = sym!(nvml, nvmlEventSetWait_v2);
    // SAFETY: live set handle; zeroed out-struct.
    unsafe {
        let mut data: nvmlEventData_t = mem::zeroed();
        let code = f(set.set, &mut data, timeout_ms);
        if code == nvmlReturn_enum_NVML_ERROR_TIMEOUT {
            return Ok(None);
        }
        check(code, 0, "wait for events")?;
        Ok(Some(RawEvent {
            device: data.device,
            event_type: data.eventType,
            data: data.eventData,
            gpu_instance_id: data.gpuInstanceId,
            compute_instance_id: data.computeInstanceId,
        }))
    }
}

/// `nvmlEventSetFree`.
pub fn event_set_free(nvml: &Nvml, set: &EventSet) {
    if let Ok(f) = nvml.lib().nvmlEventSetFree.as_ref() {
        // SAFETY: the set is not used after this call.
        unsafe {
            f(set.set);
        }
    }
}

/// `nvmlDeviceGetIndex`.
pub fn device_index(nvml: &Nvml, dev: nvmlDevice_t) -> Result<u32, BackendError> {
    let f = sym!(nvml, nvmlDeviceGetIndex);
    // SAFETY: out-integer.
    unsafe {
        let mut i: c_uint = 0;
        check(f(dev, &mut i), 0, "device index")?;
        Ok(i)
    }
}
