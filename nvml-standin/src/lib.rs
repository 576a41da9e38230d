//! A stand-in libnvidia-ml for tests: a shared library (`libnvml_standin.so`)
//! exporting the NVML C functions gpu-stack's NVML backend calls, answered by the
//! simulated GPU backend. Loading it through `--nvml-lib` runs the real NVML code
//! path (nvml-wrapper's `dlopen`, symbol lookup, struct layouts, return codes)
//! on a machine without a GPU. Not shipped.
//!
//! Which GPUs it simulates comes from the environment, read by `nvmlInit`:
//! `GPU_STACK_STANDIN_FLEET` (fleet file, required), `GPU_STACK_STANDIN_NODE`
//! (node name, optional when one node has GPUs) and `GPU_STACK_STANDIN_STATE`
//! (state file shared with other processes, optional).
//!
//! Handles are integers with a kind tag, not pointers: device `1`, MIG device `2`,
//! GPU instance `3`, compute instance `4`, event set `5`, GPM sample `6` in the
//! top byte, then GPU, GPU-instance and compute-instance numbers (each +1)
//! below it (a table id for event sets and GPM samples).
//!
//! A GPM sample holds the simulated profiling of the moment it was taken;
//! `nvmlGpmMetricsGet` answers from the second sample (ratios as percent,
//! rates in MiB/s, as NVML reports them).
//!
//! [`gpu_stack_standin_calls`] (exported as a C function) counts the NVML
//! calls answered, so tests can tell how many calls an operation makes.
//!
//! Safety contract of every exported function: the caller follows NVML's C API
//! (valid out-pointers, buffer lengths as stated); null pointers are refused
//! with `NVML_ERROR_INVALID_ARGUMENT`, buffers too small for the answer with
//! `NVML_ERROR_INSUFFICIENT_SIZE`.
#![allow(clippy::missing_safety_doc, non_upper_case_globals, non_snake_case)]

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use gpu_stack_core::backend::{
    BackendError, DeviceStrings, GpuBackend, GpuTelemetry, HealthEventKind, HealthEvents,
    Profiling, Reading, SlicePlacement,
};
use gpu_stack_core::catalog;
use gpu_stack_core::mig::MigGeometry;
use gpu_stack_nvml::sim::ci_profile_enum;
use gpu_stack_nvml::{SimNodeSpec, SimulatedBackend};
use nvml_wrapper_sys::bindings::*;

type Ret = nvmlReturn_t;

mod compat;

/// Every NVML function listed in `nvml-functions.txt` that this library does
/// not implement, as a stub answering `NVML_ERROR_FUNCTION_NOT_FOUND`, so a
/// client that binds the whole API (go-nvml resolves each symbol when first
/// called and dies on an undefined one) gets an NVML error instead.
/// `build.rs` writes the list of stubs.
///
/// The stubs take no parameters: under the C calling conventions NVML ships
/// for (x86-64 System V, AArch64), arguments travel in registers or on a
/// stack the caller cleans up, so a function that ignores them may be called
/// with any argument list. Every listed function returns `nvmlReturn_t`
/// except `nvmlErrorString`, which is implemented.
mod stubs {
    use super::{Ret, run};
    use nvml_wrapper_sys::bindings::nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND;

    macro_rules! not_found {
        ($name:ident) => {
            /// Not simulated: answers `NVML_ERROR_FUNCTION_NOT_FOUND`.
            #[unsafe(no_mangle)]
            pub extern "C" fn $name() -> Ret {
                run(|| Err(nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND))
            }
        };
    }

    include!(concat!(env!("OUT_DIR"), "/stubs.rs"));
}

const KIND_DEVICE: u64 = 1;
const KIND_MIG: u64 = 2;
const KIND_GI: u64 = 3;
const KIND_CI: u64 = 4;
const KIND_SET: u64 = 5;
const KIND_SAMPLE: u64 = 6;

/// Environment variable naming the fleet file.
pub const ENV_FLEET: &str = "GPU_STACK_STANDIN_FLEET";
/// Environment variable naming the node.
pub const ENV_NODE: &str = "GPU_STACK_STANDIN_NODE";
/// Environment variable naming the shared state file.
pub const ENV_STATE: &str = "GPU_STACK_STANDIN_STATE";

static BACKEND: Mutex<Option<SimulatedBackend>> = Mutex::new(None);
static SETS: Mutex<Option<HashMap<u64, Box<dyn HealthEvents>>>> = Mutex::new(None);
static NEXT_SET: AtomicU64 = AtomicU64::new(1);
/// GPM samples by table id: the simulated profiling when taken, `None` before.
static SAMPLES: Mutex<Option<HashMap<u64, Option<Profiling>>>> = Mutex::new(None);
static NEXT_SAMPLE: AtomicU64 = AtomicU64::new(1);
/// NVML calls answered since the library was loaded.
static CALLS: AtomicU64 = AtomicU64::new(0);

/// How many NVML functions this library has answered since it was loaded
/// (each exported NVML function counts once per call, whatever it returns).
/// Not an NVML function: tests look it up by name to count the calls an
/// operation makes.
#[unsafe(no_mangle)]
pub extern "C" fn gpu_stack_standin_calls() -> u64 {
    CALLS.load(Ordering::SeqCst)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn handle(kind: u64, gpu: u32, gi: Option<u32>, ci: Option<u32>) -> u64 {
    (kind << 56)
        | ((u64::from(gpu) + 1) << 32)
        | (gi.map_or(0, |g| u64::from(g) + 1) << 16)
        | ci.map_or(0, |c| u64::from(c) + 1)
}

struct Decoded {
    kind: u64,
    gpu: u32,
    gi: u32,
    ci: u32,
}

fn decode<T>(p: *mut T) -> Decoded {
    let v = p as usize as u64;
    Decoded {
        kind: v >> 56,
        gpu: ((v >> 32) & 0xff_ffff).wrapping_sub(1) as u32,
        gi: ((v >> 16) & 0xffff).wrapping_sub(1) as u32,
        ci: (v & 0xffff).wrapping_sub(1) as u32,
    }
}

fn as_ptr<T>(v: u64) -> *mut T {
    v as usize as *mut T
}

fn code(e: &BackendError) -> Ret {
    match e {
        BackendError::NotFound { .. } => nvmlReturn_enum_NVML_ERROR_NOT_FOUND,
        BackendError::NotSupported { .. } => nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED,
        BackendError::NoPermission { .. } => nvmlReturn_enum_NVML_ERROR_NO_PERMISSION,
        BackendError::InUse { .. } => nvmlReturn_enum_NVML_ERROR_IN_USE,
        BackendError::InsufficientResources { .. } => {
            nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES
        }
        BackendError::InvalidArgument { .. } => nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
        BackendError::GpuLost { .. } => nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST,
        BackendError::Timeout { .. } => nvmlReturn_enum_NVML_ERROR_TIMEOUT,
        BackendError::LibraryUnavailable { .. } => nvmlReturn_enum_NVML_ERROR_UNINITIALIZED,
        BackendError::MissingFunction { .. } => nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND,
        BackendError::Other { .. } => nvmlReturn_enum_NVML_ERROR_UNKNOWN,
    }
}

fn backend() -> Result<SimulatedBackend, Ret> {
    lock(&BACKEND)
        .clone()
        .ok_or(nvmlReturn_enum_NVML_ERROR_UNINITIALIZED)
}

/// Counts one NVML call, runs `f` and turns its outcome into an NVML return
/// code.
fn run(f: impl FnOnce() -> Result<(), Ret>) -> Ret {
    CALLS.fetch_add(1, Ordering::SeqCst);
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => nvmlReturn_enum_NVML_SUCCESS,
        Ok(Err(c)) => c,
        Err(_) => nvmlReturn_enum_NVML_ERROR_UNKNOWN,
    }
}

trait OrCode<T> {
    fn c(self) -> Result<T, Ret>;
}

impl<T> OrCode<T> for Result<T, BackendError> {
    fn c(self) -> Result<T, Ret> {
        self.map_err(|e| code(&e))
    }
}

impl<T: Clone> OrCode<T> for Reading<T> {
    fn c(self) -> Result<T, Ret> {
        match self {
            Reading::Value(v) => Ok(v),
            Reading::NotSupported => Err(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED),
            Reading::Error(_) => Err(nvmlReturn_enum_NVML_ERROR_UNKNOWN),
        }
    }
}

unsafe fn put<T>(p: *mut T, v: T) -> Result<(), Ret> {
    if p.is_null() {
        return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null out-pointer supplied by the caller per the NVML contract.
    unsafe { p.write(v) };
    Ok(())
}

/// Writes instance handles into an NVML caller's array and their number into `count`.
///
/// # Safety
/// `out` must have room for every handle (NVML sizes it by the profile's instance count).
unsafe fn put_handles<T>(
    out: *mut T,
    count: *mut c_uint,
    handles: impl Iterator<Item = T>,
) -> Result<(), Ret> {
    if out.is_null() || count.is_null() {
        return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
    }
    let mut n: c_uint = 0;
    for h in handles {
        // SAFETY: the caller guarantees room for every handle.
        unsafe { *out.add(n as usize) = h };
        n += 1;
    }
    // SAFETY: checked non-null above; the caller passes a valid pointer.
    unsafe { *count = n };
    Ok(())
}

unsafe fn put_str(buf: *mut c_char, len: c_uint, s: &str) -> Result<(), Ret> {
    if buf.is_null() {
        return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
    }
    let bytes = s.as_bytes();
    if bytes.len() + 1 > len as usize {
        return Err(nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE);
    }
    // SAFETY: `buf` has room for `len` bytes, checked above.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), buf, bytes.len());
        *buf.add(bytes.len()) = 0;
    }
    Ok(())
}

fn fill_name(dst: &mut [c_char], s: &str) {
    let room = dst.len().saturating_sub(1);
    for (d, b) in dst.iter_mut().zip(s.bytes().take(room)) {
        *d = b as c_char;
    }
}

fn device(dev: nvmlDevice_t) -> Result<u32, Ret> {
    let d = decode(dev);
    if d.kind != KIND_DEVICE {
        return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
    }
    Ok(d.gpu)
}

fn geometry(b: &SimulatedBackend, gpu: u32) -> Result<&'static MigGeometry, Ret> {
    let info = b.gpu_info(gpu).c()?;
    catalog::by_pci_device_id(info.pci_device_id)
        .and_then(|m| m.mig.as_ref())
        .ok_or(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED)
}

fn telemetry(gpu: u32) -> Result<GpuTelemetry, Ret> {
    backend()?.gpu_telemetry(gpu).c()
}

// ---- init, system ----

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInit_v2() -> Ret {
    run(|| {
        let mut guard = lock(&BACKEND);
        if guard.is_some() {
            return Ok(());
        }
        let fleet = std::env::var_os(ENV_FLEET)
            .map(PathBuf::from)
            .ok_or(nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED)?;
        let node = std::env::var(ENV_NODE).ok();
        let spec = SimNodeSpec::from_fleet_file(&fleet, node.as_deref())
            .map_err(|_| nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED)?;
        let b = match std::env::var_os(ENV_STATE) {
            Some(state) => SimulatedBackend::with_state_file(&spec, &PathBuf::from(state)),
            None => SimulatedBackend::new(&spec),
        }
        .map_err(|_| nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED)?;
        *guard = Some(b);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> Ret {
    // SAFETY: no arguments.
    unsafe { nvmlInit_v2() }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlShutdown() -> Ret {
    run(|| Ok(()))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(buf: *mut c_char, len: c_uint) -> Ret {
    run(|| unsafe { put_str(buf, len, &backend()?.system_info().c()?.driver_version) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(buf: *mut c_char, len: c_uint) -> Ret {
    run(|| unsafe { put_str(buf, len, &backend()?.system_info().c()?.nvml_version) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(v: *mut c_int) -> Ret {
    run(|| {
        let s = backend()?.system_info().c()?.cuda_driver_version;
        let (maj, min) = s.split_once('.').unwrap_or((&s, "0"));
        let maj: c_int = maj.parse().unwrap_or(0);
        let min: c_int = min.parse().unwrap_or(0);
        unsafe { put(v, maj * 1000 + min * 10) }
    })
}

// ---- devices ----

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> Ret {
    run(|| unsafe { put(count, backend()?.device_count().c()?) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    dev: *mut nvmlDevice_t,
) -> Ret {
    run(|| {
        if index >= backend()?.device_count().c()? {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        unsafe { put(dev, as_ptr(handle(KIND_DEVICE, index, None, None))) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(dev: nvmlDevice_t, index: *mut c_uint) -> Ret {
    run(|| unsafe { put(index, device(dev)?) })
}

/// The MIG device UUID of (GPU, GI, CI).
fn mig_uuid(b: &SimulatedBackend, gpu: u32, gi: u32, ci: u32) -> Result<String, Ret> {
    b.gpu_instances(gpu)
        .c()?
        .into_iter()
        .find(|g| g.id == gi)
        .and_then(|g| g.compute_instances.into_iter().find(|c| c.id == ci))
        .map(|c| c.uuid)
        .ok_or(nvmlReturn_enum_NVML_ERROR_NOT_FOUND)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    dev: nvmlDevice_t,
    buf: *mut c_char,
    len: c_uint,
) -> Ret {
    run(|| {
        let b = backend()?;
        let d = decode(dev);
        let uuid = match d.kind {
            KIND_DEVICE => b.gpu_info(d.gpu).c()?.uuid,
            KIND_MIG => mig_uuid(&b, d.gpu, d.gi, d.ci)?,
            _ => return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT),
        };
        unsafe { put_str(buf, len, &uuid) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    dev: nvmlDevice_t,
    buf: *mut c_char,
    len: c_uint,
) -> Ret {
    run(|| unsafe { put_str(buf, len, &backend()?.gpu_info(device(dev)?).c()?.name) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    dev: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> Ret {
    run(|| {
        let info = backend()?.gpu_info(device(dev)?).c()?;
        // SAFETY: all-zero is a valid value of this plain C struct.
        let mut p: nvmlPciInfo_t = unsafe { std::mem::zeroed() };
        let mut parts = info.pci_bus_id.split([':', '.']);
        let domain = parts.next().and_then(|s| u32::from_str_radix(s, 16).ok());
        let bus = parts.next().and_then(|s| u32::from_str_radix(s, 16).ok());
        let dev_no = parts.next().and_then(|s| u32::from_str_radix(s, 16).ok());
        p.domain = domain.unwrap_or(0);
        p.bus = bus.unwrap_or(0);
        p.device = dev_no.unwrap_or(0);
        p.pciDeviceId = info.pci_device_id;
        p.pciSubSystemId = 0x1451_10DE;
        fill_name(&mut p.busId, &info.pci_bus_id);
        let legacy = info.pci_bus_id.get(4..).unwrap_or(&info.pci_bus_id);
        fill_name(&mut p.busIdLegacy, legacy);
        unsafe { put(pci, p) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(dev: nvmlDevice_t, minor: *mut c_uint) -> Ret {
    run(|| unsafe { put(minor, backend()?.gpu_info(device(dev)?).c()?.minor_number) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNumaNodeId(dev: nvmlDevice_t, node: *mut c_uint) -> Ret {
    run(|| {
        let n = backend()?
            .gpu_info(device(dev)?)
            .c()?
            .numa_node
            .ok_or(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED)?;
        unsafe { put(node, n) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetArchitecture(
    dev: nvmlDevice_t,
    arch: *mut nvmlDeviceArchitecture_t,
) -> Ret {
    run(|| {
        let a = match backend()?.gpu_info(device(dev)?).c()?.architecture.as_str() {
            "volta" => NVML_DEVICE_ARCH_VOLTA,
            "turing" => NVML_DEVICE_ARCH_TURING,
            "ampere" => NVML_DEVICE_ARCH_AMPERE,
            "ada-lovelace" => NVML_DEVICE_ARCH_ADA,
            "hopper" => NVML_DEVICE_ARCH_HOPPER,
            "blackwell" => NVML_DEVICE_ARCH_BLACKWELL,
            _ => NVML_DEVICE_ARCH_UNKNOWN,
        };
        unsafe { put(arch, a) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    dev: nvmlDevice_t,
    major: *mut c_int,
    minor: *mut c_int,
) -> Ret {
    run(|| {
        let (a, b) = backend()?.gpu_info(device(dev)?).c()?.compute_capability;
        unsafe {
            put(major, a as c_int)?;
            put(minor, b as c_int)
        }
    })
}

/// Framebuffer memory of a GPU or MIG device handle (a MIG device reports its
/// GPU instance's memory).
fn fb_memory(dev: nvmlDevice_t) -> Result<gpu_stack_core::backend::FbMemory, Ret> {
    let d = decode(dev);
    match d.kind {
        KIND_DEVICE => telemetry(d.gpu)?.fb_memory.c(),
        KIND_MIG => backend()?
            .mig_telemetry(d.gpu)
            .c()?
            .into_iter()
            .find(|t| t.gpu_instance_id == d.gi)
            .ok_or(nvmlReturn_enum_NVML_ERROR_NOT_FOUND)?
            .fb_memory
            .c(),
        _ => Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT),
    }
}

/// `nvmlDeviceGetMemoryInfo_v2`: `version` must be `nvmlMemory_v2`
/// (`NVML_ERROR_ARGUMENT_VERSION_MISMATCH` otherwise).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    dev: nvmlDevice_t,
    mem: *mut nvmlMemory_v2_t,
) -> Ret {
    run(|| {
        if mem.is_null() {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null; the caller set `version`.
        let version = unsafe { (*mem).version };
        if version != struct_version::<nvmlMemory_v2_t>(2) {
            return Err(nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let fb = fb_memory(dev)?;
        let v = nvmlMemory_v2_t {
            version,
            total: fb.total,
            reserved: fb.reserved,
            free: fb.free,
            used: fb.used,
        };
        unsafe { put(mem, v) }
    })
}

// ---- telemetry ----

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetClockInfo(
    dev: nvmlDevice_t,
    ty: nvmlClockType_t,
    mhz: *mut c_uint,
) -> Ret {
    run(|| {
        let t = telemetry(device(dev)?)?;
        let v = match ty {
            nvmlClockType_enum_NVML_CLOCK_SM | nvmlClockType_enum_NVML_CLOCK_GRAPHICS => {
                t.sm_clock_mhz.c()?
            }
            nvmlClockType_enum_NVML_CLOCK_MEM => t.mem_clock_mhz.c()?,
            _ => return Err(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED),
        };
        unsafe { put(mhz, v) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(
    dev: nvmlDevice_t,
    sensor: nvmlTemperatureSensors_t,
    temp: *mut c_uint,
) -> Ret {
    run(|| {
        if sensor != nvmlTemperatureSensors_enum_NVML_TEMPERATURE_GPU {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        unsafe { put(temp, telemetry(device(dev)?)?.gpu_temp_c.c()?) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(dev: nvmlDevice_t, mw: *mut c_uint) -> Ret {
    run(|| unsafe { put(mw, telemetry(device(dev)?)?.power_usage_mw.c()?) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTotalEnergyConsumption(
    dev: nvmlDevice_t,
    mj: *mut c_ulonglong,
) -> Ret {
    run(|| unsafe { put(mj, telemetry(device(dev)?)?.total_energy_mj.c()?) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPcieReplayCounter(dev: nvmlDevice_t, v: *mut c_uint) -> Ret {
    run(|| {
        let n = telemetry(device(dev)?)?.pcie_replay_count.c()?;
        unsafe { put(v, n.min(u64::from(u32::MAX)) as c_uint) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    dev: nvmlDevice_t,
    u: *mut nvmlUtilization_t,
) -> Ret {
    run(|| {
        let t = telemetry(device(dev)?)?;
        let v = nvmlUtilization_t {
            gpu: t.gpu_util_pct.c()?,
            memory: t.mem_copy_util_pct.c()?,
        };
        unsafe { put(u, v) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetEncoderUtilization(
    dev: nvmlDevice_t,
    u: *mut c_uint,
    period_us: *mut c_uint,
) -> Ret {
    run(|| unsafe {
        put(u, telemetry(device(dev)?)?.enc_util_pct.c()?)?;
        put(period_us, 1_000_000)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDecoderUtilization(
    dev: nvmlDevice_t,
    u: *mut c_uint,
    period_us: *mut c_uint,
) -> Ret {
    run(|| unsafe {
        put(u, telemetry(device(dev)?)?.dec_util_pct.c()?)?;
        put(period_us, 1_000_000)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPcieThroughput(
    dev: nvmlDevice_t,
    counter: nvmlPcieUtilCounter_t,
    v: *mut c_uint,
) -> Ret {
    run(|| {
        let t = telemetry(device(dev)?)?;
        let x = match counter {
            nvmlPcieUtilCounter_enum_NVML_PCIE_UTIL_TX_BYTES => t.pcie_tx_kib_per_s.c()?,
            nvmlPcieUtilCounter_enum_NVML_PCIE_UTIL_RX_BYTES => t.pcie_rx_kib_per_s.c()?,
            _ => return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT),
        };
        unsafe { put(v, x) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRemappedRows(
    dev: nvmlDevice_t,
    corr: *mut c_uint,
    unc: *mut c_uint,
    pending: *mut c_uint,
    failed: *mut c_uint,
) -> Ret {
    run(|| {
        let r = telemetry(device(dev)?)?.remapped_rows.c()?;
        unsafe {
            put(corr, r.correctable)?;
            put(unc, r.uncorrectable)?;
            put(pending, c_uint::from(r.pending))?;
            put(failed, c_uint::from(r.failed))
        }
    })
}

/// Field ids answered: HBM temperature and NVLink data throughput (scope id
/// = link number, or [`ALL_LINKS`]).
const FI_MEMORY_TEMP: u32 = 82;
const FI_NVLINK_TX: u32 = 138;
const FI_NVLINK_RX: u32 = 139;
/// Scope id of a field summed over all links.
const ALL_LINKS: u32 = u32::MAX;

/// NVLink data of one direction: the KiB moved over all links (`scope` =
/// [`ALL_LINKS`]) or over one link, split evenly between the two directions
/// (RX gets the odd KiB), so TX + RX is the simulated figure.
fn nvlink_direction(t: &GpuTelemetry, scope: u32, tx: bool) -> Result<u64, Ret> {
    let kib = if scope == ALL_LINKS {
        t.nvlink_total_kib.clone().c()?
    } else {
        *t.nvlink_link_kib
            .clone()
            .c()?
            .get(scope as usize)
            .ok_or(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT)?
    };
    Ok(if tx { kib / 2 } else { kib - kib / 2 })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetFieldValues(
    dev: nvmlDevice_t,
    count: c_int,
    values: *mut nvmlFieldValue_t,
) -> Ret {
    run(|| {
        if values.is_null() || count < 0 {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        let t = telemetry(device(dev)?)?;
        // SAFETY: the caller passes `count` field-value structs.
        let vals = unsafe { std::slice::from_raw_parts_mut(values, count as usize) };
        for v in vals {
            let r: Result<u64, Ret> = match v.fieldId {
                FI_MEMORY_TEMP => t.memory_temp_c.clone().c().map(u64::from),
                FI_NVLINK_TX => nvlink_direction(&t, v.scopeId, true),
                FI_NVLINK_RX => nvlink_direction(&t, v.scopeId, false),
                _ => Err(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED),
            };
            match r {
                Ok(x) => {
                    v.nvmlReturn = nvmlReturn_enum_NVML_SUCCESS;
                    v.valueType = nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
                    v.value.ullVal = x;
                }
                Err(c) => v.nvmlReturn = c,
            }
        }
        Ok(())
    })
}

// ---- MIG ----

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    dev: nvmlDevice_t,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> Ret {
    run(|| {
        let m = backend()?.mig_mode(device(dev)?).c()?;
        unsafe {
            put(current, c_uint::from(m.current))?;
            put(pending, c_uint::from(m.pending))
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceSetMigMode(
    dev: nvmlDevice_t,
    mode: c_uint,
    status: *mut Ret,
) -> Ret {
    run(|| {
        backend()?.set_mig_mode(device(dev)?, mode == 1).c()?;
        unsafe { put(status, nvmlReturn_enum_NVML_SUCCESS) }
    })
}

/// `NVML_STRUCT_VERSION(T, v)`: the size of the struct with the version in
/// the top byte, as NVML's headers define the `*_VERSION` constants.
fn struct_version<T>(v: u32) -> c_uint {
    (std::mem::size_of::<T>() as c_uint) | (v << 24)
}

/// What NVML reports for GPU-instance profile `profile` (the
/// `NVML_GPU_INSTANCE_PROFILE_*` enum value) of `dev`, in the v2 layout
/// (`version` left 0); the v1 and v2 functions copy from it.
fn gi_profile_info(
    dev: nvmlDevice_t,
    profile: c_uint,
) -> Result<nvmlGpuInstanceProfileInfo_v2_t, Ret> {
    let gpu = device(dev)?;
    if profile >= NVML_GPU_INSTANCE_PROFILE_COUNT {
        return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
    }
    let b = backend()?;
    let geo = geometry(&b, gpu)?;
    let gp = geo
        .gi_profiles
        .iter()
        .find(|p| p.nvml_profile_enum == profile)
        .ok_or(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED)?;
    let p = b
        .gpu_instance_profiles(gpu)
        .c()?
        .into_iter()
        .find(|p| p.id == gp.id)
        .ok_or(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED)?;
    // SAFETY: all-zero is a valid value of this plain C struct.
    let mut i: nvmlGpuInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
    i.id = p.id;
    i.isP2pSupported = 0;
    i.sliceCount = p.slice_count;
    i.instanceCount = p.instance_count;
    i.multiprocessorCount = p.multiprocessor_count;
    i.copyEngineCount = p.slice_count;
    i.decoderCount = gp.media.decoders;
    i.encoderCount = gp.media.encoders;
    i.jpegCount = gp.media.jpeg;
    i.ofaCount = gp.media.ofa;
    i.memorySizeMB = p.memory_mib;
    fill_name(&mut i.name, &format!("MIG {}", p.name));
    Ok(i)
}

/// `nvmlDeviceGetGpuInstanceProfileInfoV` with a v2 struct (the layout this
/// library knows); another `version` is refused with
/// `NVML_ERROR_ARGUMENT_VERSION_MISMATCH`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoV(
    dev: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> Ret {
    run(|| {
        if info.is_null() {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null; the caller set `version`.
        let version = unsafe { (*info).version };
        if version != struct_version::<nvmlGpuInstanceProfileInfo_v2_t>(2) {
            return Err(nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let mut v = gi_profile_info(dev, profile)?;
        v.version = version;
        unsafe { put(info, v) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    dev: nvmlDevice_t,
    profile_id: c_uint,
    placements: *mut nvmlGpuInstancePlacement_t,
    count: *mut c_uint,
) -> Ret {
    run(|| {
        let gpu = device(dev)?;
        let p = backend()?
            .gpu_instance_profiles(gpu)
            .c()?
            .into_iter()
            .find(|p| p.id == profile_id)
            .ok_or(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT)?;
        if count.is_null() {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        let n = p.placements.len() as c_uint;
        // SAFETY: `count` is non-null; when `placements` is non-null it holds
        // `*count` entries (NVML contract).
        unsafe {
            if placements.is_null() {
                *count = n;
                return Ok(());
            }
            if *count < n {
                *count = n;
                return Err(nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE);
            }
            for (i, pl) in p.placements.iter().enumerate() {
                *placements.add(i) = nvmlGpuInstancePlacement_t {
                    start: pl.start,
                    size: pl.size,
                };
            }
            *count = n;
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstances(
    dev: nvmlDevice_t,
    profile_id: c_uint,
    out: *mut nvmlGpuInstance_t,
    count: *mut c_uint,
) -> Ret {
    run(|| {
        let gpu = device(dev)?;
        let gis: Vec<u32> = backend()?
            .gpu_instances(gpu)
            .c()?
            .into_iter()
            .filter(|g| g.profile_id == profile_id)
            .map(|g| g.id)
            .collect();
        let handles = gis
            .iter()
            .map(|id| as_ptr(handle(KIND_GI, gpu, Some(*id), None)));
        // SAFETY: the caller's buffer holds the profile's instance count, which is
        // at least the number of instances of that profile.
        unsafe { put_handles(out, count, handles) }
    })
}

fn gi_of(gi: nvmlGpuInstance_t) -> Result<(u32, u32), Ret> {
    let d = decode(gi);
    if d.kind != KIND_GI {
        return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
    }
    Ok((d.gpu, d.gi))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstanceWithPlacement(
    dev: nvmlDevice_t,
    profile_id: c_uint,
    placement: *const nvmlGpuInstancePlacement_t,
    gi: *mut nvmlGpuInstance_t,
) -> Ret {
    run(|| {
        let gpu = device(dev)?;
        if placement.is_null() {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null in-struct.
        let pl = unsafe { *placement };
        let created = backend()?
            .create_gpu_instance(
                gpu,
                profile_id,
                SlicePlacement {
                    start: pl.start,
                    size: pl.size,
                },
            )
            .c()?;
        unsafe { put(gi, as_ptr(handle(KIND_GI, gpu, Some(created.id), None))) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceById(
    dev: nvmlDevice_t,
    id: c_uint,
    gi: *mut nvmlGpuInstance_t,
) -> Ret {
    run(|| {
        let gpu = device(dev)?;
        if !backend()?
            .gpu_instances(gpu)
            .c()?
            .iter()
            .any(|g| g.id == id)
        {
            return Err(nvmlReturn_enum_NVML_ERROR_NOT_FOUND);
        }
        unsafe { put(gi, as_ptr(handle(KIND_GI, gpu, Some(id), None))) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetInfo(
    gi: nvmlGpuInstance_t,
    info: *mut nvmlGpuInstanceInfo_t,
) -> Ret {
    run(|| {
        let (gpu, id) = gi_of(gi)?;
        let g = backend()?
            .gpu_instances(gpu)
            .c()?
            .into_iter()
            .find(|g| g.id == id)
            .ok_or(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT)?;
        let v = nvmlGpuInstanceInfo_t {
            device: as_ptr(handle(KIND_DEVICE, gpu, None, None)),
            id,
            profileId: g.profile_id,
            placement: nvmlGpuInstancePlacement_t {
                start: g.placement.start,
                size: g.placement.size,
            },
        };
        unsafe { put(info, v) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceDestroy(gi: nvmlGpuInstance_t) -> Ret {
    run(|| {
        let (gpu, id) = gi_of(gi)?;
        backend()?.destroy_gpu_instance(gpu, id).c()
    })
}

/// What NVML reports for compute-instance profile `profile` (the
/// `NVML_COMPUTE_INSTANCE_PROFILE_*` enum value) in GPU instance `gi`, in the
/// v2 layout (`version` left 0). `eng_profile` must be
/// `NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED` (0), the only one NVML has.
fn ci_profile_info(
    gi: nvmlGpuInstance_t,
    profile: c_uint,
    eng_profile: c_uint,
) -> Result<nvmlComputeInstanceProfileInfo_v2_t, Ret> {
    let (gpu, id) = gi_of(gi)?;
    if profile >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT
        || eng_profile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    {
        return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
    }
    let b = backend()?;
    let geo = geometry(&b, gpu)?;
    let g = b
        .gpu_instances(gpu)
        .c()?
        .into_iter()
        .find(|g| g.id == id)
        .ok_or(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT)?;
    let gp = geo
        .by_id(g.profile_id)
        .ok_or(nvmlReturn_enum_NVML_ERROR_UNKNOWN)?;
    let cp = gp
        .ci_profiles
        .iter()
        .find(|c| c.nvml_profile_enum == profile)
        .ok_or(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED)?;
    // SAFETY: all-zero is a valid value of this plain C struct.
    let mut i: nvmlComputeInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
    i.id = profile;
    i.sliceCount = cp.compute_slices;
    i.instanceCount = cp.max_instances;
    i.multiprocessorCount = ci_multiprocessors(gp, cp.compute_slices);
    i.sharedCopyEngineCount = gp.compute_slices;
    i.sharedDecoderCount = gp.media.decoders;
    i.sharedEncoderCount = gp.media.encoders;
    i.sharedJpegCount = gp.media.jpeg;
    i.sharedOfaCount = gp.media.ofa;
    fill_name(&mut i.name, &format!("MIG {}", cp.name));
    Ok(i)
}

/// Streaming multiprocessors of a compute instance of `slices` compute
/// slices in a GPU instance of profile `gp`.
fn ci_multiprocessors(gp: &gpu_stack_core::mig::GiProfile, slices: u32) -> u32 {
    gp.multiprocessors.unwrap_or(gp.compute_slices * 16) / gp.compute_slices.max(1) * slices
}

/// `nvmlGpuInstanceGetComputeInstanceProfileInfoV` with a v2 struct; another
/// `version` is refused with `NVML_ERROR_ARGUMENT_VERSION_MISMATCH`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfoV(
    gi: nvmlGpuInstance_t,
    profile: c_uint,
    eng_profile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_v2_t,
) -> Ret {
    run(|| {
        if info.is_null() {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null; the caller set `version`.
        let version = unsafe { (*info).version };
        if version != struct_version::<nvmlComputeInstanceProfileInfo_v2_t>(2) {
            return Err(nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let mut v = ci_profile_info(gi, profile, eng_profile)?;
        v.version = version;
        unsafe { put(info, v) }
    })
}

/// Slice count of compute-instance profile id `profile` (the enum value).
fn ci_slices(profile: u32) -> Result<u32, Ret> {
    (1..=8)
        .find(|&c| ci_profile_enum(c) == profile)
        .ok_or(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstances(
    gi: nvmlGpuInstance_t,
    profile_id: c_uint,
    out: *mut nvmlComputeInstance_t,
    count: *mut c_uint,
) -> Ret {
    run(|| {
        let (gpu, id) = gi_of(gi)?;
        let slices = ci_slices(profile_id)?;
        let g = backend()?
            .gpu_instances(gpu)
            .c()?
            .into_iter()
            .find(|g| g.id == id)
            .ok_or(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT)?;
        let cis: Vec<u32> = g
            .compute_instances
            .iter()
            .filter(|c| c.slice_count == slices)
            .map(|c| c.id)
            .collect();
        let handles = cis
            .iter()
            .map(|ci| as_ptr(handle(KIND_CI, gpu, Some(id), Some(*ci))));
        // SAFETY: the caller's buffer holds the profile's instance count.
        unsafe { put_handles(out, count, handles) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstance(
    gi: nvmlGpuInstance_t,
    profile_id: c_uint,
    ci: *mut nvmlComputeInstance_t,
) -> Ret {
    run(|| {
        let (gpu, id) = gi_of(gi)?;
        let c = backend()?
            .create_compute_instance(gpu, id, ci_slices(profile_id)?)
            .c()?;
        unsafe { put(ci, as_ptr(handle(KIND_CI, gpu, Some(id), Some(c.id)))) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceById(
    gi: nvmlGpuInstance_t,
    id: c_uint,
    ci: *mut nvmlComputeInstance_t,
) -> Ret {
    run(|| {
        let (gpu, gid) = gi_of(gi)?;
        let exists = backend()?
            .gpu_instances(gpu)
            .c()?
            .into_iter()
            .find(|g| g.id == gid)
            .is_some_and(|g| g.compute_instances.iter().any(|c| c.id == id));
        if !exists {
            return Err(nvmlReturn_enum_NVML_ERROR_NOT_FOUND);
        }
        unsafe { put(ci, as_ptr(handle(KIND_CI, gpu, Some(gid), Some(id)))) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo_v2(
    ci: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> Ret {
    run(|| {
        let d = decode(ci);
        if d.kind != KIND_CI {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        let c = backend()?
            .gpu_instances(d.gpu)
            .c()?
            .into_iter()
            .find(|g| g.id == d.gi)
            .and_then(|g| g.compute_instances.into_iter().find(|c| c.id == d.ci))
            .ok_or(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT)?;
        let v = nvmlComputeInstanceInfo_t {
            device: as_ptr(handle(KIND_DEVICE, d.gpu, None, None)),
            gpuInstance: as_ptr(handle(KIND_GI, d.gpu, Some(d.gi), None)),
            id: c.id,
            profileId: c.profile_id,
            placement: nvmlComputeInstancePlacement_t {
                start: c.placement.start,
                size: c.placement.size,
            },
        };
        unsafe { put(info, v) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceDestroy(ci: nvmlComputeInstance_t) -> Ret {
    run(|| {
        let d = decode(ci);
        if d.kind != KIND_CI {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        backend()?.destroy_compute_instance(d.gpu, d.gi, d.ci).c()
    })
}

/// The MIG device index range of a GPU: zero when MIG is not supported or
/// not currently enabled, as NVML's header documents for
/// `nvmlDeviceGetMaxMigDeviceCount` (and NVIDIA's go-nvml maintainers confirm
/// in go-nvml issue #60: "For a GPU with MIG disabled this is 0").
fn max_mig_devices(gpu: u32) -> Result<u32, Ret> {
    let b = backend()?;
    let Ok(geo) = geometry(&b, gpu) else {
        return Ok(0);
    };
    if !b.mig_mode(gpu).c()?.current {
        return Ok(0);
    }
    Ok(geo.max_instances.max(geo.compute_slices))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    dev: nvmlDevice_t,
    count: *mut c_uint,
) -> Ret {
    run(|| unsafe { put(count, max_mig_devices(device(dev)?)?) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    dev: nvmlDevice_t,
    index: c_uint,
    mig: *mut nvmlDevice_t,
) -> Ret {
    run(|| {
        let gpu = device(dev)?;
        if mig.is_null() {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        // A GPU without MIG does not support the query; an index outside the
        // range `nvmlDeviceGetMaxMigDeviceCount` gives (every index with MIG
        // off, where the range is empty) is an invalid argument (NVML's
        // header: "if device, index or migDevice reference is invalid"); an
        // index inside it with no MIG device is not found. go-nvlib's
        // VisitMigDevices skips the last two.
        geometry(&backend()?, gpu)?;
        if index >= max_mig_devices(gpu)? {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        let all: Vec<(u32, u32)> = backend()?
            .gpu_instances(gpu)
            .c()?
            .into_iter()
            .flat_map(|g| {
                let gid = g.id;
                g.compute_instances.into_iter().map(move |c| (gid, c.id))
            })
            .collect();
        let (gi, ci) = *all
            .get(index as usize)
            .ok_or(nvmlReturn_enum_NVML_ERROR_NOT_FOUND)?;
        unsafe { put(mig, as_ptr(handle(KIND_MIG, gpu, Some(gi), Some(ci)))) }
    })
}

fn mig_of(dev: nvmlDevice_t) -> Result<Decoded, Ret> {
    let d = decode(dev);
    if d.kind != KIND_MIG {
        return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
    }
    Ok(d)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(dev: nvmlDevice_t, id: *mut c_uint) -> Ret {
    run(|| unsafe { put(id, mig_of(dev)?.gi) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(dev: nvmlDevice_t, id: *mut c_uint) -> Ret {
    run(|| unsafe { put(id, mig_of(dev)?.ci) })
}

// ---- processes ----

/// `nvmlDeviceGetComputeRunningProcesses_v3`: on a GPU handle every process of
/// the GPU (with MIG ids when MIG is on, as NVML gives a privileged caller); on
/// a MIG device handle the processes of that MIG device. With `infos` null or
/// `*count` too small, `*count` gets the number needed and the answer is
/// `NVML_ERROR_INSUFFICIENT_SIZE` (success when there are none).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    dev: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> Ret {
    run(|| {
        if count.is_null() {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        let d = decode(dev);
        let all = match d.kind {
            KIND_DEVICE => backend()?.running_processes(d.gpu).c()?,
            KIND_MIG => backend()?
                .running_processes(d.gpu)
                .c()?
                .into_iter()
                .filter(|p| p.gpu_instance_id == Some(d.gi) && p.compute_instance_id == Some(d.ci))
                .collect(),
            _ => return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT),
        };
        // SAFETY: non-null, checked above; the caller passes the room it has.
        let room = unsafe { *count } as usize;
        unsafe { put(count, all.len() as c_uint)? };
        if all.is_empty() {
            return Ok(());
        }
        if infos.is_null() || room < all.len() {
            return Err(nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE);
        }
        const NO_VALUE: c_uint = 0xFFFF_FFFF;
        for (i, p) in all.iter().enumerate() {
            let info = nvmlProcessInfo_t {
                pid: p.pid,
                usedGpuMemory: p
                    .used_memory_bytes
                    .unwrap_or(NVML_VALUE_NOT_AVAILABLE as c_ulonglong),
                gpuInstanceId: p.gpu_instance_id.unwrap_or(NO_VALUE),
                computeInstanceId: p.compute_instance_id.unwrap_or(NO_VALUE),
            };
            // SAFETY: `infos` has room for `room >= all.len()` entries.
            unsafe { infos.add(i).write(info) };
        }
        Ok(())
    })
}

// ---- events ----

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> Ret {
    run(|| {
        let sub = backend()?.health_events().c()?;
        let id = NEXT_SET.fetch_add(1, Ordering::SeqCst);
        lock(&SETS).get_or_insert_with(HashMap::new).insert(id, sub);
        unsafe { put(set, as_ptr(handle(KIND_SET, 0, None, None) | id)) }
    })
}

fn set_id(set: nvmlEventSet_t) -> Result<u64, Ret> {
    let v = set as usize as u64;
    if v >> 56 != KIND_SET {
        return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
    }
    Ok(v & 0xffff_ffff)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceRegisterEvents(
    dev: nvmlDevice_t,
    types: c_ulonglong,
    set: nvmlEventSet_t,
) -> Ret {
    run(|| {
        device(dev)?;
        set_id(set)?;
        if types & u64::from(nvmlEventTypeXidCriticalError) == 0 {
            return Err(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeout_ms: c_uint,
) -> Ret {
    run(|| {
        let id = set_id(set)?;
        // Take the subscription out so other sets are not blocked while waiting.
        let mut sub = lock(&SETS)
            .as_mut()
            .and_then(|m| m.remove(&id))
            .ok_or(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT)?;
        let deadline = std::time::Instant::now() + Duration::from_millis(u64::from(timeout_ms));
        let result = loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match sub.wait(left) {
                Ok(Some(e)) => match e.kind {
                    HealthEventKind::Xid { xid } => break Ok(Some((e, xid))),
                    // NVML has no GPU-lost event; callers learn it from Xid 79.
                    HealthEventKind::GpuLost => continue,
                },
                Ok(None) => break Ok(None),
                Err(e) => break Err(code(&e)),
            }
        };
        if let Some(m) = lock(&SETS).as_mut() {
            m.insert(id, sub);
        }
        match result? {
            None => Err(nvmlReturn_enum_NVML_ERROR_TIMEOUT),
            Some((e, xid)) => {
                let v = nvmlEventData_t {
                    device: as_ptr(handle(KIND_DEVICE, e.gpu, None, None)),
                    eventType: u64::from(nvmlEventTypeXidCriticalError),
                    eventData: xid,
                    gpuInstanceId: e.gpu_instance_id.unwrap_or(u32::MAX),
                    computeInstanceId: e.compute_instance_id.unwrap_or(u32::MAX),
                };
                unsafe { put(data, v) }
            }
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> Ret {
    run(|| {
        let id = set_id(set)?;
        if let Some(m) = lock(&SETS).as_mut() {
            m.remove(&id);
        }
        Ok(())
    })
}

// ---- throttling, ECC, retired pages, clock event reasons ----

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetViolationStatus(
    dev: nvmlDevice_t,
    policy: nvmlPerfPolicyType_t,
    out: *mut nvmlViolationTime_t,
) -> Ret {
    run(|| {
        let v = telemetry(device(dev)?)?.violations.c()?;
        let ns = match policy {
            nvmlPerfPolicyType_enum_NVML_PERF_POLICY_POWER => v.power_ns,
            nvmlPerfPolicyType_enum_NVML_PERF_POLICY_THERMAL => v.thermal_ns,
            nvmlPerfPolicyType_enum_NVML_PERF_POLICY_SYNC_BOOST => v.sync_boost_ns,
            nvmlPerfPolicyType_enum_NVML_PERF_POLICY_BOARD_LIMIT => v.board_limit_ns,
            nvmlPerfPolicyType_enum_NVML_PERF_POLICY_LOW_UTILIZATION => v.low_util_ns,
            nvmlPerfPolicyType_enum_NVML_PERF_POLICY_RELIABILITY => v.reliability_ns,
            nvmlPerfPolicyType_enum_NVML_PERF_POLICY_TOTAL_APP_CLOCKS
            | nvmlPerfPolicyType_enum_NVML_PERF_POLICY_TOTAL_BASE_CLOCKS => None,
            _ => return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT),
        }
        .ok_or(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED)?;
        // The CPU timestamp of the reading, in microseconds.
        let now_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        let t = nvmlViolationTime_t {
            referenceTime: now_us,
            violationTime: ns,
        };
        unsafe { put(out, t) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTotalEccErrors(
    dev: nvmlDevice_t,
    kind: nvmlMemoryErrorType_t,
    counter: nvmlEccCounterType_t,
    out: *mut c_ulonglong,
) -> Ret {
    run(|| {
        let e = telemetry(device(dev)?)?.ecc_errors.c()?;
        let n = match (kind, counter) {
            (
                nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_CORRECTED,
                nvmlEccCounterType_enum_NVML_VOLATILE_ECC,
            ) => e.sbe_volatile,
            (
                nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nvmlEccCounterType_enum_NVML_VOLATILE_ECC,
            ) => e.dbe_volatile,
            (
                nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_CORRECTED,
                nvmlEccCounterType_enum_NVML_AGGREGATE_ECC,
            ) => e.sbe_aggregate,
            (
                nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nvmlEccCounterType_enum_NVML_AGGREGATE_ECC,
            ) => e.dbe_aggregate,
            _ => return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT),
        };
        unsafe { put(out, n) }
    })
}

/// Retired pages of `cause`: `*count` in is the room in `addresses` (and
/// `timestamps`, when not null), out the number retired; with too little room
/// the answer is `NVML_ERROR_INSUFFICIENT_SIZE`. The simulator counts pages,
/// so addresses are made up (one 4 KiB page after another, per cause).
///
/// # Safety
/// `count` must be null or valid; `addresses` and `timestamps` null or with
/// room for `*count` entries.
unsafe fn retired_pages(
    dev: nvmlDevice_t,
    cause: nvmlPageRetirementCause_t,
    count: *mut c_uint,
    addresses: *mut c_ulonglong,
    timestamps: *mut c_ulonglong,
) -> Result<(), Ret> {
    let r = telemetry(device(dev)?)?.retired_pages.c()?;
    let n = match cause {
        nvmlPageRetirementCause_enum_NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS => {
            r.single_bit
        }
        nvmlPageRetirementCause_enum_NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR => {
            r.double_bit
        }
        _ => return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT),
    };
    if count.is_null() {
        return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
    }
    let n = c_uint::try_from(n).unwrap_or(c_uint::MAX);
    // SAFETY: `count` is non-null (checked) and valid (the caller's contract).
    let room = unsafe { *count };
    unsafe { *count = n };
    if room < n {
        return Err(nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE);
    }
    if n > 0 && addresses.is_null() {
        return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
    }
    for i in 0..n as usize {
        let page = (u64::from(cause) << 32) + i as u64;
        // SAFETY: `addresses` (and `timestamps` when given) hold `room >= n`
        // entries.
        unsafe {
            addresses.add(i).write(page * 4096);
            if !timestamps.is_null() {
                timestamps.add(i).write(0);
            }
        }
    }
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRetiredPages(
    dev: nvmlDevice_t,
    cause: nvmlPageRetirementCause_t,
    count: *mut c_uint,
    addresses: *mut c_ulonglong,
) -> Ret {
    run(|| unsafe { retired_pages(dev, cause, count, addresses, std::ptr::null_mut()) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRetiredPages_v2(
    dev: nvmlDevice_t,
    cause: nvmlPageRetirementCause_t,
    count: *mut c_uint,
    addresses: *mut c_ulonglong,
    timestamps: *mut c_ulonglong,
) -> Ret {
    run(|| unsafe { retired_pages(dev, cause, count, addresses, timestamps) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRetiredPagesPendingStatus(
    dev: nvmlDevice_t,
    pending: *mut nvmlEnableState_t,
) -> Ret {
    run(|| {
        let r = telemetry(device(dev)?)?.retired_pages.c()?;
        unsafe { put(pending, enable_state(r.pending)) }
    })
}

fn enable_state(on: bool) -> nvmlEnableState_t {
    if on {
        nvmlEnableState_enum_NVML_FEATURE_ENABLED
    } else {
        nvmlEnableState_enum_NVML_FEATURE_DISABLED
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCurrentClocksEventReasons(
    dev: nvmlDevice_t,
    reasons: *mut c_ulonglong,
) -> Ret {
    run(|| unsafe { put(reasons, telemetry(device(dev)?)?.clocks_event_reasons.c()?) })
}

/// The older name of [`nvmlDeviceGetCurrentClocksEventReasons`], which
/// nvml-wrapper calls.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCurrentClocksThrottleReasons(
    dev: nvmlDevice_t,
    reasons: *mut c_ulonglong,
) -> Ret {
    // SAFETY: the same contract as the function it forwards to.
    unsafe { nvmlDeviceGetCurrentClocksEventReasons(dev, reasons) }
}

// ---- NVLink ----

/// The number of NVLink links of the simulated GPU (all of them up), or
/// `NVML_ERROR_NOT_SUPPORTED` when it has none.
fn link_count(t: &GpuTelemetry) -> Result<u32, Ret> {
    Ok(t.nvlink_link_kib.clone().c()?.len() as u32)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(
    dev: nvmlDevice_t,
    link: c_uint,
    active: *mut nvmlEnableState_t,
) -> Ret {
    run(|| {
        let t = telemetry(device(dev)?)?;
        if link >= link_count(&t)? {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        unsafe { put(active, nvmlEnableState_enum_NVML_FEATURE_ENABLED) }
    })
}

/// Error counters: the simulated sums split over the links (the remainder on
/// link 0), so the links add up to them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkErrorCounter(
    dev: nvmlDevice_t,
    link: c_uint,
    counter: nvmlNvLinkErrorCounter_t,
    value: *mut c_ulonglong,
) -> Ret {
    run(|| {
        let t = telemetry(device(dev)?)?;
        let links = link_count(&t)?;
        if link >= links {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        let e = t.nvlink_errors.c()?;
        let total = match counter {
            nvmlNvLinkErrorCounter_enum_NVML_NVLINK_ERROR_DL_REPLAY => e.replay,
            nvmlNvLinkErrorCounter_enum_NVML_NVLINK_ERROR_DL_RECOVERY => e.recovery,
            nvmlNvLinkErrorCounter_enum_NVML_NVLINK_ERROR_DL_CRC_FLIT => e.crc_flit,
            nvmlNvLinkErrorCounter_enum_NVML_NVLINK_ERROR_DL_CRC_DATA => e.crc_data,
            nvmlNvLinkErrorCounter_enum_NVML_NVLINK_ERROR_DL_ECC_DATA => {
                return Err(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED);
            }
            _ => return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT),
        };
        let n = u64::from(links);
        let share = total / n + if link == 0 { total % n } else { 0 };
        unsafe { put(value, share) }
    })
}

/// Peer-to-peer status over NVLink. Other capability indices are not
/// simulated and answer `NVML_ERROR_NOT_SUPPORTED`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetP2PStatus(
    dev: nvmlDevice_t,
    peer: nvmlDevice_t,
    index: nvmlGpuP2PCapsIndex_t,
    status: *mut nvmlGpuP2PStatus_t,
) -> Ret {
    run(|| {
        let (gpu, other) = (device(dev)?, device(peer)?);
        if index != nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_NVLINK {
            return Err(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED);
        }
        let s = backend()?.p2p_status(gpu, other).c()?;
        unsafe { put(status, s.code()) }
    })
}

// ---- device strings ----

fn strings(dev: nvmlDevice_t) -> Result<DeviceStrings, Ret> {
    backend()?.device_strings(device(dev)?).c()
}

/// A string the simulated GPU has, or `NVML_ERROR_NOT_SUPPORTED`.
fn present(s: Option<String>) -> Result<String, Ret> {
    s.ok_or(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED)
}

/// NVML's brand numbers by the names `nvidia-smi -q` prints.
const BRANDS: [(&str, nvmlBrandType_t); 16] = [
    ("Quadro", nvmlBrandType_enum_NVML_BRAND_QUADRO),
    ("Tesla", nvmlBrandType_enum_NVML_BRAND_TESLA),
    ("NVS", nvmlBrandType_enum_NVML_BRAND_NVS),
    ("Grid", nvmlBrandType_enum_NVML_BRAND_GRID),
    ("GeForce", nvmlBrandType_enum_NVML_BRAND_GEFORCE),
    ("Titan", nvmlBrandType_enum_NVML_BRAND_TITAN),
    (
        "NVIDIA Virtual Applications",
        nvmlBrandType_enum_NVML_BRAND_NVIDIA_VAPPS,
    ),
    (
        "NVIDIA Virtual PC",
        nvmlBrandType_enum_NVML_BRAND_NVIDIA_VPC,
    ),
    (
        "NVIDIA Virtual Compute Server",
        nvmlBrandType_enum_NVML_BRAND_NVIDIA_VCS,
    ),
    (
        "NVIDIA RTX Virtual Workstation",
        nvmlBrandType_enum_NVML_BRAND_NVIDIA_VWS,
    ),
    (
        "NVIDIA Cloud Gaming",
        nvmlBrandType_enum_NVML_BRAND_NVIDIA_CLOUD_GAMING,
    ),
    ("Quadro RTX", nvmlBrandType_enum_NVML_BRAND_QUADRO_RTX),
    ("NVIDIA RTX", nvmlBrandType_enum_NVML_BRAND_NVIDIA_RTX),
    ("NVIDIA", nvmlBrandType_enum_NVML_BRAND_NVIDIA),
    ("GeForce RTX", nvmlBrandType_enum_NVML_BRAND_GEFORCE_RTX),
    ("Titan RTX", nvmlBrandType_enum_NVML_BRAND_TITAN_RTX),
];

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetBrand(dev: nvmlDevice_t, brand: *mut nvmlBrandType_t) -> Ret {
    run(|| {
        let name = present(strings(dev)?.brand)?;
        let b = BRANDS
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(nvmlBrandType_enum_NVML_BRAND_UNKNOWN, |(_, b)| *b);
        unsafe { put(brand, b) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSerial(
    dev: nvmlDevice_t,
    buf: *mut c_char,
    len: c_uint,
) -> Ret {
    run(|| unsafe { put_str(buf, len, &present(strings(dev)?.serial)?) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetVbiosVersion(
    dev: nvmlDevice_t,
    buf: *mut c_char,
    len: c_uint,
) -> Ret {
    run(|| unsafe { put_str(buf, len, &present(strings(dev)?.vbios_version)?) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetInforomVersion(
    dev: nvmlDevice_t,
    object: nvmlInforomObject_t,
    buf: *mut c_char,
    len: c_uint,
) -> Ret {
    run(|| {
        let s = strings(dev)?;
        let v = match object {
            nvmlInforomObject_enum_NVML_INFOROM_OEM => s.oem_inforom_version,
            nvmlInforomObject_enum_NVML_INFOROM_ECC => s.ecc_inforom_version,
            nvmlInforomObject_enum_NVML_INFOROM_POWER => s.power_inforom_version,
            nvmlInforomObject_enum_NVML_INFOROM_DEN => None,
            _ => return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT),
        };
        unsafe { put_str(buf, len, &present(v)?) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetInforomImageVersion(
    dev: nvmlDevice_t,
    buf: *mut c_char,
    len: c_uint,
) -> Ret {
    run(|| unsafe { put_str(buf, len, &present(strings(dev)?.inforom_image_version)?) })
}

// ---- GPM ----

fn sample_id(sample: nvmlGpmSample_t) -> Result<u64, Ret> {
    let v = sample as usize as u64;
    if v >> 56 != KIND_SAMPLE {
        return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
    }
    Ok(v & 0xffff_ffff)
}

/// Keeps `p` in an allocated sample.
fn fill_sample(sample: nvmlGpmSample_t, p: Profiling) -> Result<(), Ret> {
    let id = sample_id(sample)?;
    let mut samples = lock(&SAMPLES);
    let slot = samples
        .as_mut()
        .and_then(|m| m.get_mut(&id))
        .ok_or(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT)?;
    *slot = Some(p);
    Ok(())
}

/// What a filled sample holds; an unknown or unfilled one is refused.
fn sample_profiling(sample: nvmlGpmSample_t) -> Result<Profiling, Ret> {
    let id = sample_id(sample)?;
    lock(&SAMPLES)
        .as_ref()
        .and_then(|m| m.get(&id).copied().flatten())
        .ok_or(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmSampleAlloc(sample: *mut nvmlGpmSample_t) -> Ret {
    run(|| {
        if sample.is_null() {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        let id = NEXT_SAMPLE.fetch_add(1, Ordering::SeqCst) & 0xffff_ffff;
        lock(&SAMPLES)
            .get_or_insert_with(HashMap::new)
            .insert(id, None);
        unsafe { put(sample, as_ptr((KIND_SAMPLE << 56) | id)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmSampleFree(sample: nvmlGpmSample_t) -> Ret {
    run(|| {
        let id = sample_id(sample)?;
        lock(&SAMPLES)
            .as_mut()
            .and_then(|m| m.remove(&id))
            .map(|_| ())
            .ok_or(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmQueryDeviceSupport(
    dev: nvmlDevice_t,
    support: *mut nvmlGpmSupport_t,
) -> Ret {
    run(|| {
        let gpu = device(dev)?;
        if support.is_null() {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null; the caller set `version`.
        if unsafe { (*support).version } != NVML_GPM_SUPPORT_VERSION {
            return Err(nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let supported = !telemetry(gpu)?.profiling.is_not_supported();
        // SAFETY: non-null out-struct; `version` is kept.
        unsafe { (*support).isSupportedDevice = c_uint::from(supported) };
        if supported {
            Ok(())
        } else {
            Err(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED)
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmSampleGet(dev: nvmlDevice_t, sample: nvmlGpmSample_t) -> Ret {
    run(|| {
        let p = telemetry(device(dev)?)?.profiling.c()?;
        fill_sample(sample, p)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmMigSampleGet(
    dev: nvmlDevice_t,
    gpu_instance_id: c_uint,
    sample: nvmlGpmSample_t,
) -> Ret {
    run(|| {
        let p = backend()?
            .mig_telemetry(device(dev)?)
            .c()?
            .into_iter()
            .find(|t| t.gpu_instance_id == gpu_instance_id)
            .ok_or(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT)?
            .profiling
            .c()?;
        fill_sample(sample, p)
    })
}

/// GPM reports NVLink rates in MiB/s.
const BYTES_PER_MIB: f64 = 1_048_576.0;

/// A metric as `nvmlGpmMetricsGet` reports it: value, short name, long name,
/// unit; `None` when the simulator has no value for it.
fn metric(p: &Profiling, id: c_uint) -> Option<(f64, &'static CStr, &'static CStr, &'static CStr)> {
    let pct = |r: Option<f64>| r.map(|r| r * 100.0);
    let mib = |b: Option<f64>| b.map(|b| b / BYTES_PER_MIB);
    let (v, short, long, unit) = match id {
        nvmlGpmMetricId_t_NVML_GPM_METRIC_GRAPHICS_UTIL => (
            pct(p.gr_engine_active),
            c"GR_UTIL",
            c"Graphics utilization",
            c"%",
        ),
        nvmlGpmMetricId_t_NVML_GPM_METRIC_SM_UTIL => {
            (pct(p.sm_active), c"SM_UTIL", c"SM utilization", c"%")
        }
        nvmlGpmMetricId_t_NVML_GPM_METRIC_SM_OCCUPANCY => {
            (pct(p.sm_occupancy), c"SM_OCCUP", c"SM occupancy", c"%")
        }
        nvmlGpmMetricId_t_NVML_GPM_METRIC_ANY_TENSOR_UTIL => (
            pct(p.tensor_active),
            c"TENSOR_UTIL",
            c"Any tensor utilization",
            c"%",
        ),
        nvmlGpmMetricId_t_NVML_GPM_METRIC_DRAM_BW_UTIL => (
            pct(p.dram_active),
            c"DRAM_BW_UTIL",
            c"DRAM bandwidth utilization",
            c"%",
        ),
        nvmlGpmMetricId_t_NVML_GPM_METRIC_FP64_UTIL => {
            (pct(p.fp64_active), c"FP64_UTIL", c"FP64 utilization", c"%")
        }
        nvmlGpmMetricId_t_NVML_GPM_METRIC_FP32_UTIL => {
            (pct(p.fp32_active), c"FP32_UTIL", c"FP32 utilization", c"%")
        }
        nvmlGpmMetricId_t_NVML_GPM_METRIC_FP16_UTIL => {
            (pct(p.fp16_active), c"FP16_UTIL", c"FP16 utilization", c"%")
        }
        nvmlGpmMetricId_t_NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC => (
            mib(p.nvlink_rx_bytes_per_s),
            c"NVLINK_TOTAL_RX",
            c"NvLink read bandwidth for all links",
            c"MiB/sec",
        ),
        nvmlGpmMetricId_t_NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC => (
            mib(p.nvlink_tx_bytes_per_s),
            c"NVLINK_TOTAL_TX",
            c"NvLink write bandwidth for all links",
            c"MiB/sec",
        ),
        _ => return None,
    };
    Some((v?, short, long, unit))
}

/// Metrics between two samples, answered from the second one. A metric the
/// simulator has no value for gets `NVML_ERROR_NOT_SUPPORTED` in its entry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmMetricsGet(request: *mut nvmlGpmMetricsGet_t) -> Ret {
    run(|| {
        if request.is_null() {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null; the caller passes a valid request it owns.
        let req = unsafe { &mut *request };
        if req.version != NVML_GPM_METRICS_GET_VERSION {
            return Err(nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let count = req.numMetrics as usize;
        if count > req.metrics.len() {
            return Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT);
        }
        sample_profiling(req.sample1)?;
        let p = sample_profiling(req.sample2)?;
        for m in &mut req.metrics[..count] {
            match metric(&p, m.metricId) {
                Some((v, short, long, unit)) => {
                    m.nvmlReturn = nvmlReturn_enum_NVML_SUCCESS;
                    m.value = v;
                    // Static strings, as NVML's are; callers only read them.
                    m.metricInfo.shortName = short.as_ptr().cast_mut();
                    m.metricInfo.longName = long.as_ptr().cast_mut();
                    m.metricInfo.unit = unit.as_ptr().cast_mut();
                }
                None => {
                    m.nvmlReturn = nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
                    m.value = 0.0;
                }
            }
        }
        Ok(())
    })
}
