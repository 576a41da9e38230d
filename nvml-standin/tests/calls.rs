//! How many NVML calls one telemetry collection makes: the NVML backend over
//! the stand-in on a fully partitioned HGX H100 node (8 GPUs, 7 MIG instances
//! each), counted by the stand-in's `gpu_stack_standin_calls`.
//!
//! The stand-in is built by this test with `cargo build -p nvml-standin` into
//! the same target directory, as the backend contract suite does.

use gpu_stack_core::backend::GpuBackend;
use gpu_stack_nvml::NvmlBackend;

const GPUS: u32 = 8;
const INSTANCES: usize = 7;

const FLEET: &str = r#"
nodes:
  - name: calls-0
    telemetry: { seed: 300, utilization-pct: 65, jitter-pct: 15, memory-used-pct: 50 }
    gpus:
      - model: H100-SXM5-80GB
        count: 8
        mig:
          enabled: true
          instances: ["1g.10gb@0", "1g.10gb@1", "1g.10gb@2", "1g.10gb@3", "1g.10gb@4", "1g.10gb@5", "1g.10gb@6"]
"#;

/// Calls the NVML backend may make for one GPU's `gpu_telemetry` on an
/// 18-link NVLink GPU with GPM (125 now, 72 of them the four NVLink error
/// counters of each link); a change that needs more should say so here.
const GPU_TELEMETRY_BUDGET: u64 = 130;
/// Calls the NVML backend may make for one GPU's `mig_telemetry` with seven
/// GPU instances (219 now: 169 to list the instances, 50 for GPM).
const MIG_TELEMETRY_BUDGET: u64 = 230;

/// Calls made by `f`, per the stand-in's counter.
fn calls(counter: &dyn Fn() -> u64, f: impl FnOnce()) -> u64 {
    let before = counter();
    f();
    counter() - before
}

#[test]
fn nvml_calls_per_collection_on_8_gpus_with_7_instances_each() {
    let dir = tempfile::tempdir().unwrap();
    let fleet = dir.path().join("calls.yaml");
    std::fs::write(&fleet, FLEET).unwrap();
    let path = gpu_stack_nvml::testing::standin_lib();
    // SAFETY: this is the only test in this binary, and nothing else in it
    // reads the environment concurrently.
    unsafe {
        std::env::set_var("GPU_STACK_STANDIN_FLEET", &fleet);
        std::env::set_var("GPU_STACK_STANDIN_NODE", "calls-0");
    }
    let nvml = NvmlBackend::open(Some(&path)).unwrap();
    // SAFETY: the stand-in's initialisers only set up Rust statics; the
    // library is the one NVML loaded (same path, so the same counter).
    let lib = unsafe { libloading::Library::new(&path) }.unwrap();
    // SAFETY: the stand-in exports `gpu_stack_standin_calls` with this
    // signature; `lib` outlives every use of the symbol below.
    let counter_fn = unsafe {
        lib.get::<unsafe extern "C" fn() -> u64>(b"gpu_stack_standin_calls")
            .unwrap()
    };
    // SAFETY: as above; the function only reads an atomic.
    let counter = || unsafe { counter_fn() };

    assert_eq!(nvml.device_count().unwrap(), GPUS);
    let per_gpu: Vec<u64> = (0..GPUS)
        .map(|gpu| {
            calls(&counter, || {
                let t = nvml.gpu_telemetry(gpu).unwrap();
                assert!(t.profiling.value().is_some(), "GPU {gpu}: {t:?}");
                assert_eq!(t.nvlink_link_kib.value().map(Vec::len), Some(18));
            })
        })
        .collect();
    let per_mig: Vec<u64> = (0..GPUS)
        .map(|gpu| {
            calls(&counter, || {
                let m = nvml.mig_telemetry(gpu).unwrap();
                assert_eq!(m.len(), INSTANCES, "GPU {gpu}");
                assert!(m.iter().all(|i| i.profiling.value().is_some()));
            })
        })
        .collect();
    // One exporter round per GPU: info, telemetry, instances, MIG telemetry.
    let round = calls(&counter, || {
        for gpu in 0..GPUS {
            nvml.gpu_info(gpu).unwrap();
            nvml.gpu_telemetry(gpu).unwrap();
            nvml.gpu_instances(gpu).unwrap();
            nvml.mig_telemetry(gpu).unwrap();
        }
    });
    let once = calls(&counter, || {
        for gpu in 0..GPUS {
            nvml.device_strings(gpu).unwrap();
            for peer in 0..GPUS {
                nvml.p2p_status(gpu, peer).unwrap();
            }
        }
    });
    let telemetry: u64 = per_gpu.iter().sum();
    let mig: u64 = per_mig.iter().sum();
    eprintln!(
        "NVML calls, {GPUS} GPUs x {INSTANCES} MIG instances: gpu_telemetry {} per GPU \
         ({telemetry} in all), mig_telemetry {} per GPU ({mig} in all), \
         telemetry per collection {}, exporter round (with gpu_info and gpu_instances) {round}, \
         device strings and P2P matrix (read once) {once}",
        per_gpu[0],
        per_mig[0],
        telemetry + mig,
    );
    assert!(
        per_gpu.iter().all(|&c| c == per_gpu[0]),
        "the same GPUs cost the same: {per_gpu:?}"
    );
    assert!(
        per_mig.iter().all(|&c| c == per_mig[0]),
        "the same layouts cost the same: {per_mig:?}"
    );
    assert!(
        per_gpu[0] <= GPU_TELEMETRY_BUDGET,
        "gpu_telemetry makes {} NVML calls (budget {GPU_TELEMETRY_BUDGET})",
        per_gpu[0]
    );
    assert!(
        per_mig[0] <= MIG_TELEMETRY_BUDGET,
        "mig_telemetry makes {} NVML calls (budget {MIG_TELEMETRY_BUDGET})",
        per_mig[0]
    );
}
