//! NVML functions NVIDIA's own clients call (gpu-feature-discovery, the
//! device plugin and nvidia-mig-parted, through go-nvml and go-nvlib) beyond
//! what gpu-stack's backend needs: the v1 forms go-nvml binds, handle
//! lookups by UUID and PCI bus id, MIG handle queries, device attributes,
//! event types, `nvmlErrorString`, GPU-instance creation without a placement,
//! and the queries go-nvlib probes by symbol (fabric info, addressing mode),
//! which answer `NVML_ERROR_NOT_SUPPORTED` as on a GPU without those features.
//!
//! Same safety contract as the rest of the library (see the crate header).

use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong};

use gpu_stack_core::backend::{BackendError, GpuBackend, SlicePlacement};
use nvml_wrapper_sys::bindings::*;

use super::{
    KIND_DEVICE, KIND_GI, KIND_MIG, OrCode, Ret, as_ptr, backend, ci_multiprocessors,
    ci_profile_info, code, decode, device, fb_memory, geometry, gi_profile_info, handle, mig_of,
    put, run,
};

// ---- v1 forms with the same arguments as the newer ones ----

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInit() -> Ret {
    // SAFETY: no arguments.
    unsafe { super::nvmlInit_v2() }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount(count: *mut c_uint) -> Ret {
    // SAFETY: the same contract as the function it forwards to.
    unsafe { super::nvmlDeviceGetCount_v2(count) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex(index: c_uint, dev: *mut nvmlDevice_t) -> Ret {
    // SAFETY: the same contract as the function it forwards to.
    unsafe { super::nvmlDeviceGetHandleByIndex_v2(index, dev) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(v: *mut c_int) -> Ret {
    // SAFETY: the same contract as the function it forwards to.
    unsafe { super::nvmlSystemGetCudaDriverVersion_v2(v) }
}

/// `nvmlDeviceGetMemoryInfo` (v1): `used` counts the driver's reservation too
/// (v1 has no `reserved` field), so `used + free == total`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(dev: nvmlDevice_t, mem: *mut nvmlMemory_t) -> Ret {
    run(|| {
        if mem.is_null() {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        let fb = fb_memory(dev)?;
        let v = nvmlMemory_t {
            total: fb.total,
            free: fb.free,
            used: fb.total - fb.free,
        };
        unsafe { put(mem, v) }
    })
}

/// `nvmlDeviceGetGpuInstanceProfileInfo` (v1: no version, no name).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    dev: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_t,
) -> Ret {
    run(|| {
        if info.is_null() {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        let i = gi_profile_info(dev, profile)?;
        let v = nvmlGpuInstanceProfileInfo_t {
            id: i.id,
            isP2pSupported: i.isP2pSupported,
            sliceCount: i.sliceCount,
            instanceCount: i.instanceCount,
            multiprocessorCount: i.multiprocessorCount,
            copyEngineCount: i.copyEngineCount,
            decoderCount: i.decoderCount,
            encoderCount: i.encoderCount,
            jpegCount: i.jpegCount,
            ofaCount: i.ofaCount,
            memorySizeMB: i.memorySizeMB,
        };
        unsafe { put(info, v) }
    })
}

/// `nvmlGpuInstanceGetComputeInstanceProfileInfo` (v1: no version, no name).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfo(
    gi: nvmlGpuInstance_t,
    profile: c_uint,
    eng_profile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_t,
) -> Ret {
    run(|| {
        if info.is_null() {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        let i = ci_profile_info(gi, profile, eng_profile)?;
        let v = nvmlComputeInstanceProfileInfo_t {
            id: i.id,
            sliceCount: i.sliceCount,
            instanceCount: i.instanceCount,
            multiprocessorCount: i.multiprocessorCount,
            sharedCopyEngineCount: i.sharedCopyEngineCount,
            sharedDecoderCount: i.sharedDecoderCount,
            sharedEncoderCount: i.sharedEncoderCount,
            sharedJpegCount: i.sharedJpegCount,
            sharedOfaCount: i.sharedOfaCount,
        };
        unsafe { put(info, v) }
    })
}

// ---- handle lookups ----

/// A C string argument, or `NVML_ERROR_INVALID_ARGUMENT` when null or not UTF-8.
///
/// # Safety
/// `s`, when non-null, is a NUL-terminated string (NVML contract).
unsafe fn arg_str<'a>(s: *const c_char) -> Result<&'a str, Ret> {
    if s.is_null() {
        return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null and NUL-terminated per the caller.
    unsafe { CStr::from_ptr(s) }
        .to_str()
        .map_err(|_| nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT)
}

/// `domain:bus:device.function` (domain optional, as NVML accepts the legacy
/// `bus:device.function` form too), each part hexadecimal.
fn parse_bus_id(s: &str) -> Option<(u32, u32, u32, u32)> {
    let (rest, function) = s.trim().rsplit_once('.')?;
    let parts: Vec<&str> = rest.split(':').collect();
    let (domain, bus, dev) = match parts.as_slice() {
        [d, b, v] => (*d, *b, *v),
        [b, v] => ("0", *b, *v),
        _ => return None,
    };
    let hex = |x: &str| u32::from_str_radix(x, 16).ok();
    Some((hex(domain)?, hex(bus)?, hex(dev)?, hex(function)?))
}

/// `nvmlDeviceGetHandleByPciBusId_v2`: the GPU at that address (compared by
/// value, so `0000:07:00.0`, `00000000:07:00.0` and `07:00.0` all match).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    bus_id: *const c_char,
    dev: *mut nvmlDevice_t,
) -> Ret {
    run(|| {
        let want = parse_bus_id(unsafe { arg_str(bus_id)? })
            .ok_or(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT)?;
        if dev.is_null() {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        let b = backend()?;
        for gpu in 0..b.device_count().c()? {
            if parse_bus_id(&b.gpu_info(gpu).c()?.pci_bus_id) == Some(want) {
                return unsafe { put(dev, as_ptr(handle(KIND_DEVICE, gpu, None, None))) };
            }
        }
        Err(nvmlReturn_enum_NVML_ERROR_NOT_FOUND)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId(
    bus_id: *const c_char,
    dev: *mut nvmlDevice_t,
) -> Ret {
    // SAFETY: the same contract as the function it forwards to.
    unsafe { nvmlDeviceGetHandleByPciBusId_v2(bus_id, dev) }
}

/// `nvmlDeviceGetHandleByUUID`: a GPU UUID gives the GPU's handle, a MIG
/// device UUID (`MIG-...`) the MIG device handle of that compute instance.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    dev: *mut nvmlDevice_t,
) -> Ret {
    run(|| {
        let want = unsafe { arg_str(uuid)? };
        if dev.is_null() {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        let b = backend()?;
        for gpu in 0..b.device_count().c()? {
            let info = b.gpu_info(gpu).c()?;
            if info.uuid == want {
                return unsafe { put(dev, as_ptr(handle(KIND_DEVICE, gpu, None, None))) };
            }
            if !info.mig_mode.is_some_and(|m| m.current) {
                continue;
            }
            for g in b.gpu_instances(gpu).c()? {
                if let Some(c) = g.compute_instances.iter().find(|c| c.uuid == want) {
                    let h = handle(KIND_MIG, gpu, Some(g.id), Some(c.id));
                    return unsafe { put(dev, as_ptr(h)) };
                }
            }
        }
        Err(nvmlReturn_enum_NVML_ERROR_NOT_FOUND)
    })
}

// ---- MIG device handles ----

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    dev: nvmlDevice_t,
    is_mig: *mut c_uint,
) -> Ret {
    run(|| {
        let kind = decode(dev).kind;
        if kind != KIND_DEVICE && kind != KIND_MIG {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        unsafe { put(is_mig, c_uint::from(kind == KIND_MIG)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    mig: nvmlDevice_t,
    dev: *mut nvmlDevice_t,
) -> Ret {
    run(|| {
        let d = mig_of(mig)?;
        unsafe { put(dev, as_ptr(handle(KIND_DEVICE, d.gpu, None, None))) }
    })
}

/// `nvmlDeviceGetAttributes_v2`: MIG device handles only (NVML's header: "This
/// API currently only supports MIG device handles"); a GPU handle answers
/// `NVML_ERROR_NOT_SUPPORTED`. Engines are the GPU instance's, shared by its
/// compute instances; SMs are the compute instance's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    dev: nvmlDevice_t,
    attrs: *mut nvmlDeviceAttributes_t,
) -> Ret {
    run(|| {
        let d = decode(dev);
        match d.kind {
            KIND_MIG => {}
            KIND_DEVICE => return Err(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED),
            _ => return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT),
        }
        if attrs.is_null() {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        let b = backend()?;
        let geo = geometry(&b, d.gpu)?;
        let g = b
            .gpu_instances(d.gpu)
            .c()?
            .into_iter()
            .find(|g| g.id == d.gi)
            .ok_or(nvmlReturn_enum_NVML_ERROR_NOT_FOUND)?;
        let c = g
            .compute_instances
            .iter()
            .find(|c| c.id == d.ci)
            .ok_or(nvmlReturn_enum_NVML_ERROR_NOT_FOUND)?;
        let gp = geo
            .by_id(g.profile_id)
            .ok_or(nvmlReturn_enum_NVML_ERROR_UNKNOWN)?;
        let memory = b
            .gpu_instance_profiles(d.gpu)
            .c()?
            .into_iter()
            .find(|p| p.id == g.profile_id)
            .map_or(0, |p| p.memory_mib);
        let v = nvmlDeviceAttributes_t {
            multiprocessorCount: ci_multiprocessors(gp, c.slice_count),
            sharedCopyEngineCount: gp.compute_slices,
            sharedDecoderCount: gp.media.decoders,
            sharedEncoderCount: gp.media.encoders,
            sharedJpegCount: gp.media.jpeg,
            sharedOfaCount: gp.media.ofa,
            gpuInstanceSliceCount: gp.compute_slices,
            computeInstanceSliceCount: c.slice_count,
            memorySizeMB: memory,
        };
        unsafe { put(attrs, v) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes(
    dev: nvmlDevice_t,
    attrs: *mut nvmlDeviceAttributes_t,
) -> Ret {
    // SAFETY: the same contract as the function it forwards to.
    unsafe { nvmlDeviceGetAttributes_v2(dev, attrs) }
}

// ---- GPU instance creation without a placement ----

/// The placements a new GPU instance of `profile_id` may take, best first, as
/// the driver orders them for `nvmlDeviceCreateGpuInstance`: the free
/// placement that leaves the most placements of every profile (this one
/// included) still free, ties to the lowest start.
///
/// How we know: NVIDIA's MIG user guide ("Getting Started with MIG", A100
/// 40GB examples of `nvidia-smi mig -cgi`, which creates without a
/// placement) shows, with GPU-instance ids that follow the placement (1g at
/// start s has id 7+s, 2g id 3+s/2, 3g/4g id 1+s/4):
/// `-cgi 19,14,5` → 1g at 6:1, 2g at 4:2, 4g at 0:4; `-cgi 9,3g.20gb` → ids
/// 2 then 1 (4:4, then 0:4); `-cgi 9,19,14,19` → 3g at 4:4, 1g at 0:1, 2g at
/// 2:2, 1g at 1:1; `-cgi 14,19,19,19,19,19` → 2g at 4:2, then 1g at 6, 0, 1,
/// 2, 3; `-cgi 19,19,14,9` → 1g at 6:1 and 4:1, 2g at 0:2, then 3g fails
/// with Insufficient Resources. This rule reproduces every one of them
/// (neither "lowest free" nor "highest free" does). The driver's own ids
/// are not reproduced: the simulator numbers instances itself.
fn creation_order(
    profiles: &[gpu_stack_core::backend::GpuInstanceProfile],
    profile_id: u32,
    taken: &[SlicePlacement],
) -> Vec<SlicePlacement> {
    let overlaps = |a: &SlicePlacement, b: &SlicePlacement| {
        a.start < b.start + b.size && b.start < a.start + a.size
    };
    let free = |p: &SlicePlacement, extra: Option<&SlicePlacement>| {
        !taken.iter().chain(extra).any(|t| overlaps(p, t))
    };
    let Some(profile) = profiles.iter().find(|p| p.id == profile_id) else {
        return Vec::new();
    };
    let mut candidates: Vec<(usize, SlicePlacement)> = profile
        .placements
        .iter()
        .filter(|p| free(p, None))
        .map(|cand| {
            let left = profiles
                .iter()
                .flat_map(|p| p.placements.iter())
                .filter(|p| free(p, Some(cand)))
                .count();
            (left, *cand)
        })
        .collect();
    candidates.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.start.cmp(&b.1.start)));
    candidates.into_iter().map(|(_, p)| p).collect()
}

/// `nvmlDeviceCreateGpuInstance`: at the placement the driver would choose
/// (see [`creation_order`]); when the simulator refuses that one (a profile
/// limit it models beyond overlap) the next is tried.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstance(
    dev: nvmlDevice_t,
    profile_id: c_uint,
    gi: *mut nvmlGpuInstance_t,
) -> Ret {
    run(|| {
        let gpu = device(dev)?;
        if gi.is_null() {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        let b = backend()?;
        geometry(&b, gpu)?;
        if !b.mig_mode(gpu).c()?.current {
            return Err(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED);
        }
        let profiles = b.gpu_instance_profiles(gpu).c()?;
        if !profiles.iter().any(|p| p.id == profile_id) {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        let taken: Vec<SlicePlacement> = b
            .gpu_instances(gpu)
            .c()?
            .into_iter()
            .map(|g| g.placement)
            .collect();
        let mut last = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES;
        for placement in creation_order(&profiles, profile_id, &taken) {
            match b.create_gpu_instance(gpu, profile_id, placement) {
                Ok(created) => {
                    let h = handle(KIND_GI, gpu, Some(created.id), None);
                    return unsafe { put(gi, as_ptr(h)) };
                }
                Err(e @ BackendError::InsufficientResources { .. })
                | Err(e @ BackendError::InvalidArgument { .. }) => {
                    last = match code(&e) {
                        nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT => {
                            nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES
                        }
                        c => c,
                    };
                }
                Err(e) => return Err(code(&e)),
            }
        }
        Err(last)
    })
}

// ---- events ----

/// The event types the simulator raises: Xid critical errors.
const SUPPORTED_EVENTS: c_ulonglong = nvmlEventTypeXidCriticalError as c_ulonglong;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    dev: nvmlDevice_t,
    types: *mut c_ulonglong,
) -> Ret {
    run(|| {
        device(dev)?;
        unsafe { put(types, SUPPORTED_EVENTS) }
    })
}

// ---- features go-nvlib probes by symbol ----

/// A device query the simulated GPUs do not support: the device handle and
/// out-pointer are checked as NVML does, then `NOT_SUPPORTED`.
fn not_supported<T>(dev: nvmlDevice_t, out: *mut T) -> Ret {
    run(|| {
        device(dev)?;
        if out.is_null() {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        Err(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED)
    })
}

/// `nvmlDeviceGetGpuFabricInfo`: the simulated GPUs are not attached to an
/// NVLink fabric (go-nvlib's IsFabricAttached reads this as "not attached").
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuFabricInfo(
    dev: nvmlDevice_t,
    info: *mut nvmlGpuFabricInfo_t,
) -> Ret {
    not_supported(dev, info)
}

/// `nvmlDeviceGetGpuFabricInfoV`: as [`nvmlDeviceGetGpuFabricInfo`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuFabricInfoV(
    dev: nvmlDevice_t,
    info: *mut nvmlGpuFabricInfoV_t,
) -> Ret {
    not_supported(dev, info)
}

/// `nvmlDeviceGetAddressingMode`: not supported, as on GPUs without ATS
/// (go-nvlib's IsCoherent reads this as "not coherent").
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAddressingMode(
    dev: nvmlDevice_t,
    mode: *mut nvmlDeviceAddressingMode_t,
) -> Ret {
    not_supported(dev, mode)
}

// ---- error strings ----

/// NVML's description of a return code, as a static C string (NVML's own
/// strings; an unknown code gets "Unknown Error").
pub fn error_string(result: Ret) -> &'static CStr {
    match result {
        nvmlReturn_enum_NVML_SUCCESS => c"Success",
        nvmlReturn_enum_NVML_ERROR_UNINITIALIZED => c"Uninitialized",
        nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT => c"Invalid Argument",
        nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED => c"Not Supported",
        nvmlReturn_enum_NVML_ERROR_NO_PERMISSION => c"Insufficient Permissions",
        nvmlReturn_enum_NVML_ERROR_ALREADY_INITIALIZED => c"Already Initialized",
        nvmlReturn_enum_NVML_ERROR_NOT_FOUND => c"Not Found",
        nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE => c"Insufficient Size",
        nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_POWER => c"Insufficient External Power",
        nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED => c"Driver Not Loaded",
        nvmlReturn_enum_NVML_ERROR_TIMEOUT => c"Timeout",
        nvmlReturn_enum_NVML_ERROR_IRQ_ISSUE => c"Interrupt request issue",
        nvmlReturn_enum_NVML_ERROR_LIBRARY_NOT_FOUND => c"NVML Shared Library Not Found",
        nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND => c"Function Not Found",
        nvmlReturn_enum_NVML_ERROR_CORRUPTED_INFOROM => c"Corrupted infoROM",
        nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST => c"GPU is lost",
        nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED => c"GPU requires restart",
        nvmlReturn_enum_NVML_ERROR_OPERATING_SYSTEM => {
            c"The operating system has blocked the request"
        }
        nvmlReturn_enum_NVML_ERROR_LIB_RM_VERSION_MISMATCH => {
            c"RM has detected an NVML/RM version mismatch"
        }
        nvmlReturn_enum_NVML_ERROR_IN_USE => c"In use by another client",
        nvmlReturn_enum_NVML_ERROR_MEMORY => c"Insufficient Memory",
        nvmlReturn_enum_NVML_ERROR_NO_DATA => c"No data",
        nvmlReturn_enum_NVML_ERROR_VGPU_ECC_NOT_SUPPORTED => {
            c"The requested vgpu operation is not available on target device, because ECC is enabled"
        }
        nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES => c"Insufficient Resources",
        nvmlReturn_enum_NVML_ERROR_FREQ_NOT_SUPPORTED => c"Frequency not supported",
        nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH => c"Argument version mismatch",
        nvmlReturn_enum_NVML_ERROR_DEPRECATED => c"Deprecated",
        nvmlReturn_enum_NVML_ERROR_NOT_READY => c"Not Ready",
        nvmlReturn_enum_NVML_ERROR_GPU_NOT_FOUND => c"GPU not found",
        nvmlReturn_enum_NVML_ERROR_INVALID_STATE => c"Invalid state",
        nvmlReturn_enum_NVML_ERROR_RESET_TYPE_NOT_SUPPORTED => c"Reset type not supported",
        _ => c"Unknown Error",
    }
}

/// `nvmlErrorString`: callable before `nvmlInit` and never fails; not
/// counted by `gpu_stack_standin_calls` (it is no device query).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: Ret) -> *const c_char {
    error_string(result).as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pl(start: u32, size: u32) -> SlicePlacement {
        SlicePlacement { start, size }
    }

    /// A100 40GB's profiles (ids and placements from `nvidia-smi mig -lgipp`
    /// in NVIDIA's MIG user guide).
    fn a100() -> Vec<gpu_stack_core::backend::GpuInstanceProfile> {
        let p = |id: u32, size: u32, starts: &[u32]| gpu_stack_core::backend::GpuInstanceProfile {
            id,
            name: String::new(),
            slice_count: size,
            memory_mib: 0,
            multiprocessor_count: 0,
            instance_count: starts.len() as u32,
            placements: starts.iter().map(|&s| pl(s, size)).collect(),
        };
        vec![
            p(19, 1, &[0, 1, 2, 3, 4, 5, 6]),
            p(20, 1, &[0, 1, 2, 3, 4, 5, 6]),
            p(15, 2, &[0, 2, 4, 6]),
            p(14, 2, &[0, 2, 4]),
            p(9, 4, &[0, 4]),
            p(5, 4, &[0]),
            p(0, 8, &[0]),
        ]
    }

    /// Creates each profile in turn like `nvidia-smi mig -cgi a,b,...`; the
    /// starts chosen, `None` where creation fails.
    fn cgi(profiles: &[u32]) -> Vec<Option<u32>> {
        let all = a100();
        let mut taken = Vec::new();
        profiles
            .iter()
            .map(|&id| {
                let p = creation_order(&all, id, &taken).first().copied()?;
                taken.push(p);
                Some(p.start)
            })
            .collect()
    }

    #[test]
    fn placements_follow_the_mig_user_guide_examples() {
        assert_eq!(cgi(&[19, 14, 5]), [Some(6), Some(4), Some(0)]);
        assert_eq!(cgi(&[9, 9]), [Some(4), Some(0)]);
        assert_eq!(cgi(&[9, 19, 14, 19]), [Some(4), Some(0), Some(2), Some(1)]);
        assert_eq!(
            cgi(&[14, 19, 19, 19, 19, 19]),
            [Some(4), Some(6), Some(0), Some(1), Some(2), Some(3)]
        );
        assert_eq!(cgi(&[19, 19, 14, 9]), [Some(6), Some(4), Some(0), None]);
    }

    #[test]
    fn bus_ids_parse_with_or_without_domain() {
        assert_eq!(parse_bus_id("00000000:07:00.0"), Some((0, 7, 0, 0)));
        assert_eq!(parse_bus_id("0000:B7:1f.3"), Some((0, 0xb7, 0x1f, 3)));
        assert_eq!(parse_bus_id("07:00.0"), Some((0, 7, 0, 0)));
        assert_eq!(parse_bus_id("07:00"), None);
        assert_eq!(parse_bus_id("x:07:00.0"), None);
    }

    #[test]
    fn every_return_code_has_its_own_string() {
        let codes = (0..=30).chain([999]);
        let strings: std::collections::BTreeSet<_> = codes.map(error_string).collect();
        assert_eq!(strings.len(), 32);
        assert_eq!(error_string(12345), c"Unknown Error");
    }
}
