//! The NVML calls NVIDIA's Go tools make that gpu-stack's own backend does
//! not, through the C ABI of the built stand-in, on examples/fleets/dgx-a100.yaml
//! (8x A100-SXM4-40GB; GPUs 0-5 MIG-capable with MIG off, GPUs 6-7 with
//! 3g.20gb@4, 2g.10gb@0, 1g.5gb@2, 1g.5gb@3) and, for GPU-instance creation
//! without a placement, on a fleet of one empty MIG-enabled A100.
//!
//! Everything runs in one test: the stand-in reads its fleet once per process.
#![allow(non_upper_case_globals)]

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_ulonglong};
use std::mem::{size_of, zeroed};

use libloading::Library;
use nvml_wrapper_sys::bindings::*;

const DGX_A100: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../examples/fleets/dgx-a100.yaml"
);

const EMPTY_MIG_A100: &str = r#"
nodes:
  - name: dgx-a100-0
    gpus:
      - model: A100-SXM4-40GB
        count: 8
        mig:
          enabled: true
          instances: []
"#;

fn version<T>(v: u32) -> c_uint {
    (size_of::<T>() as c_uint) | (v << 24)
}

/// Looks up `name` as a function of type `F`.
///
/// # Safety
/// `F` must be the function's C signature.
unsafe fn f<F: Copy>(lib: &Library, name: &str) -> F {
    // SAFETY: per the caller.
    *unsafe { lib.get::<F>(name.as_bytes()) }.unwrap_or_else(|e| panic!("{name}: {e}"))
}

type DevFn<T> = unsafe extern "C" fn(nvmlDevice_t, *mut T) -> nvmlReturn_t;
type LookupFn = unsafe extern "C" fn(*const c_char, *mut nvmlDevice_t) -> nvmlReturn_t;

fn str_of(buf: &[c_char]) -> String {
    // SAFETY: NVML fills NUL-terminated strings.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn calls_nvidia_tools_make() {
    let path = gpu_stack_nvml::testing::standin_lib();
    // Two copies of the library, so each reads its own fleet: dlopen of a
    // second path loads a second instance with its own statics.
    let dir = tempfile::tempdir().unwrap();
    let second = dir.path().join("libnvml_standin_empty.so");
    std::fs::copy(&path, &second).unwrap();
    let fleet = dir.path().join("empty.yaml");
    std::fs::write(&fleet, EMPTY_MIG_A100).unwrap();

    // SAFETY: this is the only test in this binary; nothing else reads the
    // environment concurrently. Each library reads it in its `nvmlInit_v2`.
    unsafe { std::env::set_var("GPU_STACK_STANDIN_FLEET", DGX_A100) };
    // SAFETY: the stand-in's initialisers only set up Rust statics.
    let lib = unsafe { Library::new(&path) }.unwrap();
    // SAFETY: NVML signatures below are those of nvml.h.
    unsafe {
        let init: unsafe extern "C" fn() -> nvmlReturn_t = f(&lib, "nvmlInit");
        assert_eq!(init(), nvmlReturn_enum_NVML_SUCCESS);
        dgx_a100(&lib);
    }

    // SAFETY: as above.
    unsafe { std::env::set_var("GPU_STACK_STANDIN_FLEET", &fleet) };
    // SAFETY: as above.
    let empty = unsafe { Library::new(&second) }.unwrap();
    // SAFETY: as above.
    unsafe {
        let init: unsafe extern "C" fn() -> nvmlReturn_t = f(&empty, "nvmlInit_v2");
        assert_eq!(init(), nvmlReturn_enum_NVML_SUCCESS);
        create_without_placement(&empty);
    }
}

/// # Safety
/// `lib` is an initialised stand-in.
unsafe fn dgx_a100(lib: &Library) {
    const OK: nvmlReturn_t = nvmlReturn_enum_NVML_SUCCESS;
    const INVALID: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
    const NOT_FOUND: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
    const NOT_SUPPORTED: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
    const MISMATCH: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    unsafe {
        let cuda_v1: unsafe extern "C" fn(*mut c_int) -> nvmlReturn_t =
            f(lib, "nvmlSystemGetCudaDriverVersion");
        let cuda_v2: unsafe extern "C" fn(*mut c_int) -> nvmlReturn_t =
            f(lib, "nvmlSystemGetCudaDriverVersion_v2");
        let (mut a, mut b) = (0, 0);
        assert_eq!((cuda_v1(&mut a), cuda_v2(&mut b)), (OK, OK));
        assert!(a >= 11000 && a == b, "CUDA driver version {a} / {b}");
        assert_eq!(cuda_v1(std::ptr::null_mut()), INVALID);

        let by_index: unsafe extern "C" fn(c_uint, *mut nvmlDevice_t) -> nvmlReturn_t =
            f(lib, "nvmlDeviceGetHandleByIndex");
        let dev = |i: u32| {
            let mut d: nvmlDevice_t = std::ptr::null_mut();
            assert_eq!(by_index(i, &mut d), OK);
            d
        };
        let (gpu0, gpu6) = (dev(0), dev(6));

        // Memory: v1 counts the reservation as used; v2 checks its version.
        let mem_v1: DevFn<nvmlMemory_t> = f(lib, "nvmlDeviceGetMemoryInfo");
        let mem_v2: DevFn<nvmlMemory_v2_t> = f(lib, "nvmlDeviceGetMemoryInfo_v2");
        let mut m1: nvmlMemory_t = zeroed();
        assert_eq!(mem_v1(gpu0, &mut m1), OK);
        assert_eq!(m1.total, 40 * 1024 * 1024 * 1024);
        assert_eq!(m1.used + m1.free, m1.total);
        let mut m2: nvmlMemory_v2_t = zeroed();
        assert_eq!(mem_v2(gpu0, &mut m2), MISMATCH);
        m2.version = version::<nvmlMemory_v2_t>(2);
        assert_eq!(mem_v2(gpu0, &mut m2), OK);
        assert_eq!(m2.version, version::<nvmlMemory_v2_t>(2));
        assert_eq!(m2.used + m2.free + m2.reserved, m2.total);
        assert_eq!(mem_v1(gpu0, std::ptr::null_mut()), INVALID);

        // Lookups by PCI bus id (full, short-domain and legacy forms) and UUID.
        let pci: DevFn<nvmlPciInfo_t> = f(lib, "nvmlDeviceGetPciInfo_v3");
        let by_bus: LookupFn = f(lib, "nvmlDeviceGetHandleByPciBusId_v2");
        let by_bus_v1: LookupFn = f(lib, "nvmlDeviceGetHandleByPciBusId");
        let by_uuid: LookupFn = f(lib, "nvmlDeviceGetHandleByUUID");
        let uuid_of: unsafe extern "C" fn(nvmlDevice_t, *mut c_char, c_uint) -> nvmlReturn_t =
            f(lib, "nvmlDeviceGetUUID");
        let lookup = |func: LookupFn, key: &str| {
            let key = CString::new(key).unwrap();
            let mut d: nvmlDevice_t = std::ptr::null_mut();
            (func(key.as_ptr(), &mut d), d)
        };
        for i in 0..8 {
            let d = dev(i);
            let mut p: nvmlPciInfo_t = zeroed();
            assert_eq!(pci(d, &mut p), OK);
            let bus = str_of(&p.busId);
            assert_eq!(lookup(by_bus, &bus), (OK, d), "{bus}");
            assert_eq!(lookup(by_bus_v1, &bus[4..]), (OK, d), "{bus}");
            assert_eq!(lookup(by_bus, &str_of(&p.busIdLegacy)), (OK, d));
            let mut buf = [0 as c_char; 96];
            assert_eq!(uuid_of(d, buf.as_mut_ptr(), 96), OK);
            assert_eq!(lookup(by_uuid, &str_of(&buf)), (OK, d));
        }
        assert_eq!(lookup(by_bus, "0000:01:00.0").0, NOT_FOUND);
        assert_eq!(lookup(by_bus, "not a bus id").0, INVALID);
        assert_eq!(
            lookup(by_uuid, "GPU-00000000-0000-0000-0000-000000000000").0,
            NOT_FOUND
        );
        let mut d: nvmlDevice_t = std::ptr::null_mut();
        assert_eq!(by_uuid(std::ptr::null(), &mut d), INVALID);

        // MIG handles: none with MIG off, four in a range of seven with it on.
        let max: DevFn<c_uint> = f(lib, "nvmlDeviceGetMaxMigDeviceCount");
        let mig_at: unsafe extern "C" fn(nvmlDevice_t, c_uint, *mut nvmlDevice_t) -> nvmlReturn_t =
            f(lib, "nvmlDeviceGetMigDeviceHandleByIndex");
        let (mut n0, mut n6) = (99, 0);
        assert_eq!((max(gpu0, &mut n0), max(gpu6, &mut n6)), (OK, OK));
        assert_eq!((n0, n6), (0, 7));
        let mig_handle = |d, i| {
            let mut m: nvmlDevice_t = std::ptr::null_mut();
            (mig_at(d, i, &mut m), m)
        };
        assert_eq!(mig_handle(gpu0, 0).0, INVALID, "MIG off");
        let migs: Vec<nvmlDevice_t> = (0..4)
            .map(|i| {
                let (r, m) = mig_handle(gpu6, i);
                assert_eq!(r, OK, "MIG device {i}");
                m
            })
            .collect();
        assert_eq!(mig_handle(gpu6, 4).0, NOT_FOUND);
        assert_eq!(mig_handle(gpu6, 7).0, INVALID);

        let is_mig: DevFn<c_uint> = f(lib, "nvmlDeviceIsMigDeviceHandle");
        let parent: DevFn<nvmlDevice_t> = f(lib, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle");
        let attrs: DevFn<nvmlDeviceAttributes_t> = f(lib, "nvmlDeviceGetAttributes_v2");
        let gi_id: DevFn<c_uint> = f(lib, "nvmlDeviceGetGpuInstanceId");
        let mut flag = 9;
        assert_eq!(is_mig(gpu6, &mut flag), OK);
        assert_eq!(flag, 0);
        let mut a: nvmlDeviceAttributes_t = zeroed();
        assert_eq!(attrs(gpu6, &mut a), NOT_SUPPORTED);
        let mut slices = Vec::new();
        for &m in &migs {
            assert_eq!(is_mig(m, &mut flag), OK);
            assert_eq!(flag, 1);
            let mut p: nvmlDevice_t = std::ptr::null_mut();
            assert_eq!(parent(m, &mut p), OK);
            assert_eq!(p, gpu6);
            let mut buf = [0 as c_char; 96];
            assert_eq!(uuid_of(m, buf.as_mut_ptr(), 96), OK);
            let uuid = str_of(&buf);
            assert!(uuid.starts_with("MIG-"), "{uuid}");
            assert_eq!(lookup(by_uuid, &uuid), (OK, m));
            assert_eq!(attrs(m, &mut a), OK);
            assert_eq!(a.gpuInstanceSliceCount, a.computeInstanceSliceCount);
            assert_eq!(a.multiprocessorCount, 14 * a.computeInstanceSliceCount);
            let mut id = 0;
            assert_eq!(gi_id(m, &mut id), OK);
            slices.push((a.gpuInstanceSliceCount, a.memorySizeMB));
        }
        slices.sort();
        assert_eq!(slices, [(1, 4864), (1, 4864), (2, 9856), (3, 19968)]);
        assert_eq!(parent(gpu6, &mut d), INVALID);

        // Profile info, v1 and V: the same numbers.
        let gi_v1: unsafe extern "C" fn(
            nvmlDevice_t,
            c_uint,
            *mut nvmlGpuInstanceProfileInfo_t,
        ) -> nvmlReturn_t = f(lib, "nvmlDeviceGetGpuInstanceProfileInfo");
        let gi_v: unsafe extern "C" fn(
            nvmlDevice_t,
            c_uint,
            *mut nvmlGpuInstanceProfileInfo_v2_t,
        ) -> nvmlReturn_t = f(lib, "nvmlDeviceGetGpuInstanceProfileInfoV");
        let mut p1: nvmlGpuInstanceProfileInfo_t = zeroed();
        let mut p2: nvmlGpuInstanceProfileInfo_v2_t = zeroed();
        assert_eq!(
            gi_v(gpu0, NVML_GPU_INSTANCE_PROFILE_1_SLICE, &mut p2),
            MISMATCH
        );
        p2.version = version::<nvmlGpuInstanceProfileInfo_v2_t>(2);
        assert_eq!(gi_v1(gpu0, NVML_GPU_INSTANCE_PROFILE_1_SLICE, &mut p1), OK);
        assert_eq!(gi_v(gpu0, NVML_GPU_INSTANCE_PROFILE_1_SLICE, &mut p2), OK);
        assert_eq!((p1.id, p1.sliceCount, p1.instanceCount), (19, 1, 7));
        assert_eq!(
            (p1.memorySizeMB, p1.multiprocessorCount),
            (p2.memorySizeMB, p2.multiprocessorCount)
        );
        assert_eq!(str_of(&p2.name), "MIG 1g.5gb");
        assert_eq!(
            gi_v1(gpu0, NVML_GPU_INSTANCE_PROFILE_COUNT, &mut p1),
            INVALID
        );

        let gi_by_id: unsafe extern "C" fn(
            nvmlDevice_t,
            c_uint,
            *mut nvmlGpuInstance_t,
        ) -> nvmlReturn_t = f(lib, "nvmlDeviceGetGpuInstanceById");
        let ci_v1: unsafe extern "C" fn(
            nvmlGpuInstance_t,
            c_uint,
            c_uint,
            *mut nvmlComputeInstanceProfileInfo_t,
        ) -> nvmlReturn_t = f(lib, "nvmlGpuInstanceGetComputeInstanceProfileInfo");
        let mut id = 0;
        assert_eq!(gi_id(migs[0], &mut id), OK);
        let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
        assert_eq!(gi_by_id(gpu6, id, &mut gi), OK);
        let mut c: nvmlComputeInstanceProfileInfo_t = zeroed();
        let shared = NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED;
        assert_eq!(
            ci_v1(gi, NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, shared, &mut c),
            OK
        );
        assert_eq!((c.sliceCount, c.multiprocessorCount), (1, 14));
        assert_eq!(
            ci_v1(gi, NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, 1, &mut c),
            INVALID
        );

        // Events and the features go-nvlib probes for.
        let events: DevFn<c_ulonglong> = f(lib, "nvmlDeviceGetSupportedEventTypes");
        let mut t = 0;
        assert_eq!(events(gpu0, &mut t), OK);
        assert_ne!(t & c_ulonglong::from(nvmlEventTypeXidCriticalError), 0);
        let fabric: DevFn<nvmlGpuFabricInfo_t> = f(lib, "nvmlDeviceGetGpuFabricInfo");
        let mut fi: nvmlGpuFabricInfo_t = zeroed();
        assert_eq!(fabric(gpu0, &mut fi), NOT_SUPPORTED);
        let addressing: DevFn<nvmlDeviceAddressingMode_t> = f(lib, "nvmlDeviceGetAddressingMode");
        let mut am: nvmlDeviceAddressingMode_t = zeroed();
        assert_eq!(addressing(gpu0, &mut am), NOT_SUPPORTED);
    }
}

/// `nvidia-smi mig -cgi 19,14,5` and `-cgi 9,19,14,19` from NVIDIA's MIG user
/// guide, through `nvmlDeviceCreateGpuInstance`: the placements match the
/// guide's.
///
/// # Safety
/// `lib` is an initialised stand-in on [`EMPTY_MIG_A100`].
unsafe fn create_without_placement(lib: &Library) {
    unsafe {
        let by_index: unsafe extern "C" fn(c_uint, *mut nvmlDevice_t) -> nvmlReturn_t =
            f(lib, "nvmlDeviceGetHandleByIndex_v2");
        let create: unsafe extern "C" fn(
            nvmlDevice_t,
            c_uint,
            *mut nvmlGpuInstance_t,
        ) -> nvmlReturn_t = f(lib, "nvmlDeviceCreateGpuInstance");
        let info: unsafe extern "C" fn(
            nvmlGpuInstance_t,
            *mut nvmlGpuInstanceInfo_t,
        ) -> nvmlReturn_t = f(lib, "nvmlGpuInstanceGetInfo");
        let cgi = |gpu: u32, profiles: &[u32]| -> Vec<Result<u32, nvmlReturn_t>> {
            let mut d: nvmlDevice_t = std::ptr::null_mut();
            assert_eq!(by_index(gpu, &mut d), nvmlReturn_enum_NVML_SUCCESS);
            profiles
                .iter()
                .map(|&p| {
                    let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
                    match create(d, p, &mut gi) {
                        nvmlReturn_enum_NVML_SUCCESS => {
                            let mut i: nvmlGpuInstanceInfo_t = zeroed();
                            assert_eq!(info(gi, &mut i), nvmlReturn_enum_NVML_SUCCESS);
                            assert_eq!(i.profileId, p);
                            Ok(i.placement.start)
                        }
                        e => Err(e),
                    }
                })
                .collect()
        };
        assert_eq!(cgi(0, &[19, 14, 5]), [Ok(6), Ok(4), Ok(0)]);
        assert_eq!(cgi(1, &[9, 19, 14, 19]), [Ok(4), Ok(0), Ok(2), Ok(1)]);
        assert_eq!(
            cgi(2, &[14, 19, 19, 19, 19, 19]),
            [Ok(4), Ok(6), Ok(0), Ok(1), Ok(2), Ok(3)]
        );
        let full = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES;
        assert_eq!(cgi(3, &[19, 19, 14, 9]), [Ok(6), Ok(4), Ok(0), Err(full)]);
        let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
        let mut d: nvmlDevice_t = std::ptr::null_mut();
        assert_eq!(by_index(4, &mut d), nvmlReturn_enum_NVML_SUCCESS);
        assert_eq!(
            create(d, 999, &mut gi),
            nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT
        );
        assert_eq!(
            create(d, 19, std::ptr::null_mut()),
            nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT
        );
    }
}
