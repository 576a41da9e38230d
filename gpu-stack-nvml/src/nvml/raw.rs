//! Small unsafe wrappers over NVML functions nvml-wrapper does not wrap (or wraps
//! wrongly): GPU- and compute-instance profiles, placements, create, list and
//! destroy; MIG device ids; remapped rows; field values (several per call);
//! events with their MIG instance ids.
//!
//! Private to the crate. Every function that takes a raw NVML handle
//! (`nvmlDevice_t`, `nvmlGpuInstance_t`, `nvmlComputeInstance_t`) is an
//! `unsafe fn`: NVML cannot tell a live handle from a dangling one, so the
//! caller promises, per each function's `# Safety` section, that the handle came
//! from the same `Nvml` (through nvml-wrapper or another function here), that
//! the `Nvml` is still alive, and that the instance was not destroyed. Handle
//! buffers are sized by this module from NVML's own instance counts (never
//! below [`MIN_INSTANCE_SLOTS`]), and lengths read back are clamped to the
//! buffer. The event set is the owned, non-`Copy` [`EventSet`], freed exactly
//! once when it is dropped. Out-parameters are zero-initialised and return codes
//! go through [`check`]. Symbols are resolved per call through `Nvml::lib()`, so
//! a missing symbol is a typed error, not a failed load.

// NVML constant names come from the C header.
#![allow(non_upper_case_globals)]

use std::ffi::{c_int, c_uint};
use std::mem;
use std::sync::Arc;

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

/// Smallest handle buffer passed to NVML's instance-listing calls. Those calls
/// take no capacity argument: NVML writes as many handles as there are
/// instances, up to the profile's instance count. No MIG GPU has more than 8
/// compute slices, so no profile has more instances than this; the floor keeps
/// an undersized (or zero) instance count from becoming a buffer overflow.
pub const MIN_INSTANCE_SLOTS: usize = 32;

/// Number of handle slots to allocate for a listing whose profile reports
/// `instance_count` possible instances: at least [`MIN_INSTANCE_SLOTS`].
pub fn instance_slots(instance_count: u32) -> usize {
    usize::try_from(instance_count)
        .unwrap_or(usize::MAX)
        .max(MIN_INSTANCE_SLOTS)
}

/// How many entries of a `capacity`-entry buffer to keep after NVML reported
/// writing `reported`: never more than the buffer holds.
pub fn written_len(reported: c_uint, capacity: usize) -> usize {
    usize::try_from(reported)
        .unwrap_or(usize::MAX)
        .min(capacity)
}

/// A buffer of `slots` null handles and the count to pass with it (the count
/// is derived from the buffer, so the two cannot disagree).
fn handle_buffer<T>(slots: usize) -> (Vec<*mut T>, c_uint) {
    let buf = vec![std::ptr::null_mut(); slots];
    let count = c_uint::try_from(buf.len()).unwrap_or(c_uint::MAX);
    (buf, count)
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
///
/// # Safety
/// `dev` must be a live device handle obtained from `nvml`, which must outlive
/// the call.
pub unsafe fn gi_profile_info(
    nvml: &Nvml,
    dev: nvmlDevice_t,
    gpu: u32,
    profile: u32,
) -> Result<GiProfileInfo, BackendError> {
    let f = sym!(nvml, nvmlDeviceGetGpuInstanceProfileInfoV);
    // SAFETY: `dev` is a live device handle (the caller's contract); `info` is a
    // zeroed v2 struct with its version set, as the function requires.
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
///
/// # Safety
/// `dev` must be a live device handle obtained from `nvml`, which must outlive
/// the call.
pub unsafe fn possible_placements(
    nvml: &Nvml,
    dev: nvmlDevice_t,
    gpu: u32,
    profile_id: u32,
) -> Result<Vec<(u32, u32)>, BackendError> {
    let f = sym!(nvml, nvmlDeviceGetGpuInstancePossiblePlacements_v2);
    // SAFETY: `dev` is live (the caller's contract). The first call passes a null
    // buffer to ask for the count; the second passes a buffer this function
    // allocated, with the count in/out-parameter set from that buffer's own
    // length, and the result is clamped to the buffer.
    unsafe {
        let mut count: c_uint = 0;
        let code = f(dev, profile_id, std::ptr::null_mut(), &mut count);
        if code != nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE {
            check(code, gpu, "possible placements")?;
        }
        let mut buf: Vec<nvmlGpuInstancePlacement_t> =
            vec![mem::zeroed(); usize::try_from(count).unwrap_or(0)];
        let mut written = c_uint::try_from(buf.len()).unwrap_or(c_uint::MAX);
        check(
            f(dev, profile_id, buf.as_mut_ptr(), &mut written),
            gpu,
            "possible placements",
        )?;
        buf.truncate(written_len(written, buf.len()));
        Ok(buf.iter().map(|p| (p.start, p.size)).collect())
    }
}

/// A GPU instance as NVML describes it. Not `Copy` or `Clone`: destroying it
/// consumes it.
#[derive(Debug)]
pub struct GiInfo {
    /// Handle, valid while the `Nvml` lives and the instance is not destroyed.
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

/// # Safety
/// `gi` must be a live GPU-instance handle obtained from `nvml`.
unsafe fn gi_info(nvml: &Nvml, gi: nvmlGpuInstance_t, gpu: u32) -> Result<GiInfo, BackendError> {
    let f = sym!(nvml, nvmlGpuInstanceGetInfo);
    // SAFETY: `gi` is a live GPU-instance handle (the caller's contract); `info`
    // is a zeroed out-struct.
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

/// Every GPU instance of `profile` (as [`gi_profile_info`] returned it). The
/// handle buffer is sized by this function: [`instance_slots`] of the profile's
/// instance count.
///
/// # Safety
/// `dev` must be a live device handle obtained from `nvml`, which must outlive
/// the call and the returned handles.
pub unsafe fn gpu_instances(
    nvml: &Nvml,
    dev: nvmlDevice_t,
    gpu: u32,
    profile: &GiProfileInfo,
) -> Result<Vec<GiInfo>, BackendError> {
    let f = sym!(nvml, nvmlDeviceGetGpuInstances);
    let (mut buf, mut count) = handle_buffer(instance_slots(profile.instance_count));
    // SAFETY: `dev` is live (the caller's contract). The buffer holds at least
    // the profile's instance count and never fewer than MIN_INSTANCE_SLOTS
    // handles, more than NVML writes for one profile; the count it reports is
    // clamped to the buffer.
    unsafe {
        check(
            f(dev, profile.id, buf.as_mut_ptr(), &mut count),
            gpu,
            "list GPU instances",
        )?;
    }
    buf.truncate(written_len(count, buf.len()));
    buf.into_iter()
        // SAFETY: each handle was just returned by NVML for this live device.
        .map(|h| unsafe { gi_info(nvml, h, gpu) })
        .collect()
}

/// `nvmlDeviceCreateGpuInstanceWithPlacement`.
///
/// # Safety
/// `dev` must be a live device handle obtained from `nvml`, which must outlive
/// the call and the returned handle.
pub unsafe fn create_gpu_instance(
    nvml: &Nvml,
    dev: nvmlDevice_t,
    gpu: u32,
    profile_id: u32,
    start: u32,
    size: u32,
) -> Result<GiInfo, BackendError> {
    let f = sym!(nvml, nvmlDeviceCreateGpuInstanceWithPlacement);
    // SAFETY: `dev` is live (the caller's contract); `placement` lives across the
    // call; `gi` is an out-handle.
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
    // SAFETY: NVML just created the instance and returned its handle.
    unsafe { gi_info(nvml, handle, gpu) }
}

/// `nvmlDeviceGetGpuInstanceById`.
///
/// # Safety
/// `dev` must be a live device handle obtained from `nvml`, which must outlive
/// the call and the returned handle.
pub unsafe fn gpu_instance_by_id(
    nvml: &Nvml,
    dev: nvmlDevice_t,
    gpu: u32,
    id: u32,
) -> Result<GiInfo, BackendError> {
    let f = sym!(nvml, nvmlDeviceGetGpuInstanceById);
    // SAFETY: `dev` is live (the caller's contract); out-handle only.
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
    // SAFETY: NVML just returned this handle for a live device.
    unsafe { gi_info(nvml, handle, gpu) }
}

/// `nvmlGpuInstanceDestroy`. Consumes `gi`, so its handle cannot be used
/// through it again.
///
/// # Safety
/// `gi.handle` must be a live GPU-instance handle obtained from `nvml` (not
/// destroyed before, and no copy of the handle used afterwards).
pub unsafe fn destroy_gpu_instance(nvml: &Nvml, gi: GiInfo, gpu: u32) -> Result<(), BackendError> {
    let f = sym!(nvml, nvmlGpuInstanceDestroy);
    // SAFETY: `gi.handle` is live (the caller's contract); NVML invalidates it on
    // success, and `gi` is consumed here.
    unsafe { check(f(gi.handle), gpu, "destroy GPU instance") }
}

/// A compute instance as NVML describes it. Not `Copy` or `Clone`: destroying
/// it consumes it.
#[derive(Debug)]
pub struct CiInfo {
    /// Handle, valid while the `Nvml` lives and the instance is not destroyed.
    pub handle: nvmlComputeInstance_t,
    /// Id.
    pub id: u32,
    /// Placement start (compute slices).
    pub start: u32,
    /// Placement size.
    pub size: u32,
}

/// # Safety
/// `ci` must be a live compute-instance handle obtained from `nvml`.
unsafe fn ci_info(
    nvml: &Nvml,
    ci: nvmlComputeInstance_t,
    gpu: u32,
) -> Result<CiInfo, BackendError> {
    let f = sym!(nvml, nvmlComputeInstanceGetInfo_v2);
    // SAFETY: `ci` is a live compute-instance handle (the caller's contract);
    // zeroed out-struct.
    unsafe {
        let mut info: nvmlComputeInstanceInfo_t = mem::zeroed();
        check(f(ci, &mut info), gpu, "compute-instance info")?;
        Ok(CiInfo {
            handle: ci,
            id: info.id,
            start: info.placement.start,
            size: info.placement.size,
        })
    }
}

/// A compute-instance profile of a GPU instance (shared engine profile).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CiProfileInfo {
    /// Compute-instance profile id.
    pub id: u32,
    /// Compute slices.
    pub slice_count: u32,
    /// Instances possible in the GPU instance.
    pub instance_count: u32,
}

/// The compute-instance profile for profile enum `profile` (shared engine
/// profile), or `None` when the GPU instance does not offer it.
///
/// # Safety
/// `gi` must be a live GPU-instance handle obtained from `nvml`.
pub unsafe fn ci_profile(
    nvml: &Nvml,
    gi: nvmlGpuInstance_t,
    gpu: u32,
    profile: u32,
) -> Result<Option<CiProfileInfo>, BackendError> {
    let f = sym!(nvml, nvmlGpuInstanceGetComputeInstanceProfileInfoV);
    // SAFETY: `gi` is live (the caller's contract); zeroed v2 out-struct with its
    // version set.
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
        Ok(Some(CiProfileInfo {
            id: info.id,
            slice_count: info.sliceCount,
            instance_count: info.instanceCount,
        }))
    }
}

/// Compute instances of one compute-instance profile (as [`ci_profile`]
/// returned it). The handle buffer is sized by this function:
/// [`instance_slots`] of the profile's instance count.
///
/// # Safety
/// `gi` must be a live GPU-instance handle obtained from `nvml`, which must
/// outlive the call and the returned handles.
pub unsafe fn compute_instances(
    nvml: &Nvml,
    gi: nvmlGpuInstance_t,
    gpu: u32,
    profile: &CiProfileInfo,
) -> Result<Vec<CiInfo>, BackendError> {
    let f = sym!(nvml, nvmlGpuInstanceGetComputeInstances);
    let (mut buf, mut count) = handle_buffer(instance_slots(profile.instance_count));
    // SAFETY: `gi` is live (the caller's contract). The buffer holds at least the
    // profile's instance count and never fewer than MIN_INSTANCE_SLOTS handles;
    // the count NVML reports is clamped to the buffer.
    unsafe {
        check(
            f(gi, profile.id, buf.as_mut_ptr(), &mut count),
            gpu,
            "list compute instances",
        )?;
    }
    buf.truncate(written_len(count, buf.len()));
    buf.into_iter()
        // SAFETY: each handle was just returned by NVML for this live GPU instance.
        .map(|h| unsafe { ci_info(nvml, h, gpu) })
        .collect()
}

/// `nvmlGpuInstanceCreateComputeInstance` (the driver picks the placement).
///
/// # Safety
/// `gi` must be a live GPU-instance handle obtained from `nvml`, which must
/// outlive the call and the returned handle.
pub unsafe fn create_compute_instance(
    nvml: &Nvml,
    gi: nvmlGpuInstance_t,
    gpu: u32,
    profile_id: u32,
) -> Result<CiInfo, BackendError> {
    let f = sym!(nvml, nvmlGpuInstanceCreateComputeInstance);
    // SAFETY: `gi` is live (the caller's contract); out-handle only.
    let handle = unsafe {
        let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
        check(f(gi, profile_id, &mut ci), gpu, "create compute instance")?;
        ci
    };
    // SAFETY: NVML just created the instance and returned its handle.
    unsafe { ci_info(nvml, handle, gpu) }
}

/// `nvmlGpuInstanceGetComputeInstanceById`.
///
/// # Safety
/// `gi` must be a live GPU-instance handle obtained from `nvml`, which must
/// outlive the call and the returned handle.
pub unsafe fn compute_instance_by_id(
    nvml: &Nvml,
    gi: nvmlGpuInstance_t,
    gpu: u32,
    gi_id: u32,
    id: u32,
) -> Result<CiInfo, BackendError> {
    let f = sym!(nvml, nvmlGpuInstanceGetComputeInstanceById);
    // SAFETY: `gi` is live (the caller's contract); out-handle only.
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
    // SAFETY: NVML just returned this handle for a live GPU instance.
    unsafe { ci_info(nvml, handle, gpu) }
}

/// `nvmlComputeInstanceDestroy`. Consumes `ci`, so its handle cannot be used
/// through it again.
///
/// # Safety
/// `ci.handle` must be a live compute-instance handle obtained from `nvml` (not
/// destroyed before, and no copy of the handle used afterwards).
pub unsafe fn destroy_compute_instance(
    nvml: &Nvml,
    ci: CiInfo,
    gpu: u32,
) -> Result<(), BackendError> {
    let f = sym!(nvml, nvmlComputeInstanceDestroy);
    // SAFETY: `ci.handle` is live (the caller's contract); NVML invalidates it on
    // success, and `ci` is consumed here.
    unsafe { check(f(ci.handle), gpu, "destroy compute instance") }
}

/// GPU- and compute-instance ids of a MIG device handle.
///
/// # Safety
/// `mig_dev` must be a live MIG device handle obtained from `nvml`.
pub unsafe fn mig_device_ids(
    nvml: &Nvml,
    mig_dev: nvmlDevice_t,
    gpu: u32,
) -> Result<(u32, u32), BackendError> {
    let gi_f = sym!(nvml, nvmlDeviceGetGpuInstanceId);
    let ci_f = sym!(nvml, nvmlDeviceGetComputeInstanceId);
    // SAFETY: `mig_dev` is a live MIG device handle (the caller's contract);
    // out-integers.
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
///
/// # Safety
/// `dev` must be a live device handle obtained from `nvml`.
pub unsafe fn remapped_rows(
    nvml: &Nvml,
    dev: nvmlDevice_t,
    gpu: u32,
) -> Result<(u32, u32, bool, bool), BackendError> {
    let f = sym!(nvml, nvmlDeviceGetRemappedRows);
    // SAFETY: `dev` is live (the caller's contract); four out-integers.
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

/// A field value's union read by the type NVML reports, as an unsigned integer
/// (negative and fractional values clamp to 0 and truncate).
///
/// # Safety
/// `v` must have been zero-initialised before NVML filled it, so every byte of
/// the union is initialised whichever member NVML wrote.
unsafe fn field_u64(v: &nvmlFieldValue_t) -> u64 {
    // SAFETY: every member is a plain number and every byte is initialised
    // (the caller's contract), so any member may be read; the one named by
    // `valueType` is the one NVML wrote.
    unsafe {
        match v.valueType {
            nvmlValueType_enum_NVML_VALUE_TYPE_DOUBLE => v.value.dVal.max(0.0) as u64,
            nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_INT => u64::from(v.value.uiVal),
            nvmlValueType_enum_NVML_VALUE_TYPE_SIGNED_INT => v.value.siVal.max(0) as u64,
            nvmlValueType_enum_NVML_VALUE_TYPE_SIGNED_LONG_LONG => v.value.sllVal.max(0) as u64,
            _ => v.value.ullVal,
        }
    }
}

/// Several field values in one `nvmlDeviceGetFieldValues` call: one result
/// per requested `(field id, scope id)`, in request order, each with its own
/// NVML return code (a field the GPU lacks is `NotSupported` there and does
/// not fail the others). An empty request makes no call.
///
/// # Safety
/// `dev` must be a live device handle obtained from `nvml`.
pub unsafe fn field_values(
    nvml: &Nvml,
    dev: nvmlDevice_t,
    gpu: u32,
    fields: &[(u32, u32)],
) -> Result<Vec<Result<u64, BackendError>>, BackendError> {
    if fields.is_empty() {
        return Ok(Vec::new());
    }
    let f = sym!(nvml, nvmlDeviceGetFieldValues);
    let mut values: Vec<nvmlFieldValue_t> = fields
        .iter()
        .map(|&(id, scope)| {
            // SAFETY: all-zero is a valid value of this plain C struct.
            let mut v: nvmlFieldValue_t = unsafe { mem::zeroed() };
            v.fieldId = id;
            v.scopeId = scope;
            v
        })
        .collect();
    let count = c_int::try_from(values.len()).map_err(|_| BackendError::InvalidArgument {
        gpu,
        detail: format!("{} field values asked for in one call", values.len()),
    })?;
    // SAFETY: `dev` is live (the caller's contract); the buffer holds exactly
    // `count` zeroed field-value structs with ids and scopes set, which NVML
    // fills in place (value, type and a per-field return code).
    unsafe {
        check(f(dev, count, values.as_mut_ptr()), gpu, "field values")?;
    }
    Ok(values
        .iter()
        // SAFETY: each struct was zeroed above before NVML filled it.
        .map(|v| check(v.nvmlReturn, gpu, "field value").map(|()| unsafe { field_u64(v) }))
        .collect())
}

/// An NVML event set, owned: it keeps its `Nvml` alive and frees the set
/// exactly once, when dropped. Neither `Copy` nor `Clone`, and its handle is
/// private, so it cannot be freed twice or used after it is freed.
pub struct EventSet {
    nvml: Arc<Nvml>,
    set: nvmlEventSet_t,
}

// SAFETY: NVML API calls are thread-safe; the set handle is an opaque token
// owned exclusively by this value (it is not `Clone`), so moving it to another
// thread cannot create shared use. `Arc<Nvml>` is itself `Send`.
unsafe impl Send for EventSet {}

impl std::fmt::Debug for EventSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventSet").finish_non_exhaustive()
    }
}

/// One event read from a set.
#[derive(Debug, Clone, Copy)]
pub struct RawEvent {
    /// Device handle (physical GPU), valid while the set's `Nvml` lives.
    pub device: nvmlDevice_t,
    /// Xid for Xid events.
    pub data: u64,
    /// GPU-instance id, `u32::MAX` when not attributed.
    pub gpu_instance_id: u32,
    /// Compute-instance id, `u32::MAX` when not attributed.
    pub compute_instance_id: u32,
}

impl EventSet {
    /// `nvmlEventSetCreate`.
    pub fn create(nvml: Arc<Nvml>) -> Result<Self, BackendError> {
        let f = sym!(nvml, nvmlEventSetCreate);
        let mut set: nvmlEventSet_t = std::ptr::null_mut();
        // SAFETY: `set` is an out-handle that lives across the call.
        check(unsafe { f(&mut set) }, 0, "create event set")?;
        Ok(EventSet { nvml, set })
    }

    /// `nvmlDeviceRegisterEvents` for critical Xid errors.
    ///
    /// # Safety
    /// `dev` must be a live device handle obtained from the same `Nvml` as this
    /// set.
    pub unsafe fn register_xid(&self, dev: nvmlDevice_t, gpu: u32) -> Result<(), BackendError> {
        let f = sym!(self.nvml, nvmlDeviceRegisterEvents);
        // SAFETY: `dev` is live (the caller's contract); the set is live because
        // `self` owns it and frees it only in `drop`.
        unsafe {
            check(
                f(dev, u64::from(nvmlEventTypeXidCriticalError), self.set),
                gpu,
                "register Xid events",
            )
        }
    }

    /// `nvmlEventSetWait_v2`; `Ok(None)` on timeout.
    pub fn wait(&self, timeout_ms: u32) -> Result<Option<RawEvent>, BackendError> {
        let f = sym!(self.nvml, nvmlEventSetWait_v2);
        // SAFETY: the set is live (owned by `self`, freed only in `drop`);
        // `data` is a zeroed out-struct that lives across the call.
        unsafe {
            let mut data: nvmlEventData_t = mem::zeroed();
            let code = f(self.set, &mut data, timeout_ms);
            if code == nvmlReturn_enum_NVML_ERROR_TIMEOUT {
                return Ok(None);
            }
            check(code, 0, "wait for events")?;
            Ok(Some(RawEvent {
                device: data.device,
                data: data.eventData,
                gpu_instance_id: data.gpuInstanceId,
                compute_instance_id: data.computeInstanceId,
            }))
        }
    }

    /// The raw handle, for tests that check the set was freed.
    #[cfg(test)]
    fn raw_handle(&self) -> nvmlEventSet_t {
        self.set
    }
}

impl Drop for EventSet {
    /// `nvmlEventSetFree`, exactly once; the `Nvml` is still alive because the
    /// set holds it.
    fn drop(&mut self) {
        if let Ok(f) = self.nvml.lib().nvmlEventSetFree.as_ref() {
            // SAFETY: the set is live and owned by `self`; it is dropped once and
            // its private handle is not reachable afterwards.
            let code = unsafe { f(self.set) };
            if let Err(e) = check(code, 0, "free event set") {
                tracing::debug!(error = %e, "NVML event set not freed cleanly");
            }
        }
    }
}

/// `nvmlDeviceGetIndex`.
///
/// # Safety
/// `dev` must be a live device handle obtained from `nvml` (for example a
/// [`RawEvent::device`] of a set created from it).
pub unsafe fn device_index(nvml: &Nvml, dev: nvmlDevice_t) -> Result<u32, BackendError> {
    let f = sym!(nvml, nvmlDeviceGetIndex);
    // SAFETY: `dev` is live (the caller's contract); out-integer.
    unsafe {
        let mut i: c_uint = 0;
        check(f(dev, &mut i), 0, "device index")?;
        Ok(i)
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;
    use std::marker::PhantomData;

    use super::*;

    /// `CloneProbe::<T>::CLONE` and `CopyProbe::<T>::COPY` are true only when
    /// `T` implements the trait: the inherent constant (bounded on the trait)
    /// wins over the blanket fallback when it applies. Checked in `const`
    /// blocks, so a regression fails the build of the tests.
    struct Probe<T>(PhantomData<T>);
    trait Fallback {
        const CLONE: bool = false;
        const COPY: bool = false;
    }
    impl<T> Fallback for Probe<T> {}
    struct CloneProbe<T>(PhantomData<T>);
    impl<T: Clone> CloneProbe<T> {
        const CLONE: bool = true;
    }
    impl<T> Fallback for CloneProbe<T> {}
    struct CopyProbe<T>(PhantomData<T>);
    impl<T: Copy> CopyProbe<T> {
        const COPY: bool = true;
    }
    impl<T> Fallback for CopyProbe<T> {}

    #[test]
    fn the_probes_detect_clone_and_copy() {
        const { assert!(CloneProbe::<u32>::CLONE) };
        const { assert!(CopyProbe::<u32>::COPY) };
        const { assert!(!CloneProbe::<Probe<()>>::CLONE) };
        const { assert!(!CopyProbe::<String>::COPY) };
    }

    #[test]
    fn owned_handles_are_neither_copy_nor_clone() {
        const { assert!(!CloneProbe::<EventSet>::CLONE, "EventSet must not be Clone") };
        const { assert!(!CopyProbe::<EventSet>::COPY, "EventSet must not be Copy") };
        const { assert!(!CloneProbe::<GiInfo>::CLONE, "GiInfo must not be Clone") };
        const { assert!(!CopyProbe::<GiInfo>::COPY, "GiInfo must not be Copy") };
        const { assert!(!CloneProbe::<CiInfo>::CLONE, "CiInfo must not be Clone") };
        const { assert!(!CopyProbe::<CiInfo>::COPY, "CiInfo must not be Copy") };
    }

    #[test]
    fn instance_buffers_never_fall_below_the_floor() {
        assert_eq!(instance_slots(0), MIN_INSTANCE_SLOTS);
        assert_eq!(instance_slots(1), MIN_INSTANCE_SLOTS);
        assert_eq!(instance_slots(7), MIN_INSTANCE_SLOTS);
        assert_eq!(instance_slots(100), 100);
    }

    #[test]
    fn reported_lengths_are_clamped_to_the_buffer() {
        assert_eq!(written_len(0, 8), 0);
        assert_eq!(written_len(3, 8), 3);
        assert_eq!(written_len(8, 8), 8);
        assert_eq!(written_len(9, 8), 8);
        assert_eq!(written_len(c_uint::MAX, 0), 0);
    }

    #[test]
    fn the_count_passed_with_a_buffer_is_its_length() {
        let (buf, count) = handle_buffer::<nvmlGpuInstance_st>(instance_slots(3));
        assert_eq!(buf.len(), MIN_INSTANCE_SLOTS);
        assert_eq!(count as usize, buf.len());
        assert!(buf.iter().all(|h| h.is_null()));
    }

    const FLEET: &str = r#"
nodes:
  - name: raw-0
    gpus:
      - model: A100-SXM4-40GB
        mig:
          enabled: true
          instances: ["1g.5gb@0", "1g.5gb@1", "1g.5gb@2"]
"#;

    /// The raw wrappers over the stand-in libnvidia-ml, loaded through
    /// nvml-wrapper's real `dlopen` path. One test, so the environment the
    /// stand-in reads at `nvmlInit` is set once.
    #[test]
    fn raw_wrappers_over_the_standin() {
        let dir = tempfile::tempdir().unwrap();
        let fleet = dir.path().join("raw.yaml");
        std::fs::write(&fleet, FLEET).unwrap();
        let lib = crate::testing::standin_lib();
        // SAFETY: this is the only test in this binary that touches the
        // environment, and no code in this crate reads it.
        unsafe {
            std::env::set_var("GPU_STACK_STANDIN_FLEET", &fleet);
            std::env::set_var("GPU_STACK_STANDIN_NODE", "raw-0");
        }
        let nvml = Arc::new(
            Nvml::builder()
                .lib_path(OsStr::new(lib.as_os_str()))
                .init()
                .unwrap(),
        );
        let dev = nvml.device_by_index(0).unwrap();
        // SAFETY: `dev` (and `nvml`) outlive every use of the handle below.
        let h = unsafe { dev.handle() };

        // An undersized instance count still gets a buffer with room for
        // every instance NVML writes.
        // SAFETY: `h` is live; enum 0 is the one-slice profile.
        let profile = unsafe { gi_profile_info(&nvml, h, 0, 0) }.unwrap();
        assert_eq!(profile.slice_count, 1);
        let undersized = GiProfileInfo {
            instance_count: 0,
            ..profile.clone()
        };
        // SAFETY: `h` is live.
        let gis = unsafe { gpu_instances(&nvml, h, 0, &undersized) }.unwrap();
        let mut starts: Vec<u32> = gis.iter().map(|g| g.start).collect();
        starts.sort_unstable();
        assert_eq!(starts, vec![0, 1, 2]);
        // SAFETY: `h` is live.
        let full = unsafe { gpu_instances(&nvml, h, 0, &profile) }.unwrap();
        assert_eq!(full.len(), 3);

        // Several field values in one call, each with its own outcome: an
        // unknown field fails alone; an empty request makes no call.
        // SAFETY: `h` is live.
        let got =
            unsafe { field_values(&nvml, h, 0, &[(82, 0), (0xFFFF, 0), (138, u32::MAX)]) }.unwrap();
        assert_eq!(got.len(), 3);
        assert!(got[0].is_ok() && got[2].is_ok(), "{got:?}");
        assert_eq!(got[1].as_ref().unwrap_err().kind(), "not_supported");
        // SAFETY: `h` is live.
        assert!(
            unsafe { field_values(&nvml, h, 0, &[]) }
                .unwrap()
                .is_empty()
        );

        // The event set is usable while owned and freed exactly once on drop:
        // afterwards the stand-in no longer knows its handle.
        let set = EventSet::create(Arc::clone(&nvml)).unwrap();
        // SAFETY: `h` is a live device of the set's `Nvml`.
        unsafe { set.register_xid(h, 0) }.unwrap();
        assert!(set.wait(0).unwrap().is_none(), "no event was injected");
        let stale = set.raw_handle();
        drop(set);
        let wait = nvml.lib().nvmlEventSetWait_v2.as_ref().unwrap();
        // SAFETY: the stand-in's handles are tagged integers, not pointers: a
        // freed one is refused, not dereferenced; `data` is a zeroed out-struct.
        let code = unsafe {
            let mut data: nvmlEventData_t = mem::zeroed();
            wait(stale, &mut data, 0)
        };
        assert_eq!(
            code, nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
            "the dropped set was not freed"
        );
    }
}
