//! Cost of one full telemetry sample of an 8-GPU node through each backend, and
//! of single NVML calls answered by the stand-in library.
//!
//! Run: `cargo bench -p gpu-stack-nvml --bench telemetry`. The NVML cases build
//! `libnvml_standin.so` first (into the same target directory).

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{Criterion, criterion_group, criterion_main};
use gpu_stack_core::backend::GpuBackend;
use gpu_stack_nvml::{NvmlBackend, SimNodeSpec, SimulatedBackend};

fn fleet() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/fleets/hgx-h100.yaml"
    ))
}

fn sample_all(b: &dyn GpuBackend) {
    for gpu in 0..8 {
        black_box(b.gpu_telemetry(gpu).expect("telemetry"));
    }
}

fn benches(c: &mut Criterion) {
    let spec = SimNodeSpec::from_fleet_file(&fleet(), None).expect("fleet");
    let sim = SimulatedBackend::new(&spec).expect("simulated backend");
    c.bench_function("telemetry_8gpu/simulated", |b| b.iter(|| sample_all(&sim)));

    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state.json");
    let shared = SimulatedBackend::with_state_file(&spec, &state).expect("state file");
    c.bench_function("telemetry_8gpu/simulated_state_file", |b| {
        b.iter(|| sample_all(&shared))
    });

    let lib = gpu_stack_nvml::testing::standin_lib();
    // SAFETY: set before any thread of this process reads the environment.
    unsafe {
        std::env::set_var("GPU_STACK_STANDIN_FLEET", fleet());
        std::env::remove_var("GPU_STACK_STANDIN_STATE");
        std::env::remove_var("GPU_STACK_STANDIN_NODE");
    }
    let nvml = NvmlBackend::open(Some(&lib)).expect("NVML over the stand-in");
    c.bench_function("telemetry_8gpu/nvml_over_standin", |b| {
        b.iter(|| sample_all(&nvml))
    });
    c.bench_function("standin_call/gpu_info", |b| {
        b.iter(|| black_box(nvml.gpu_info(3).expect("gpu_info")))
    });
    c.bench_function("standin_call/device_count", |b| {
        b.iter(|| black_box(nvml.device_count().expect("count")))
    });
    c.bench_function("standin_call/mig_mode", |b| {
        b.iter(|| black_box(nvml.mig_mode(3).expect("mig mode")))
    });
}

criterion_group!(telemetry, benches);
criterion_main!(telemetry);
