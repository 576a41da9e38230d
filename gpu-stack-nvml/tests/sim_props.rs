//! Properties of the simulated backend that hold for all inputs: telemetry stays
//! bounded and consistent for every seed and tick, and no sequence of MIG
//! operations leaves a layout the catalog geometry forbids.

use gpu_stack_core::backend::{GpuBackend, SimTelemetry, SlicePlacement};
use gpu_stack_core::catalog;
use gpu_stack_core::mig::{self, PlacedInstance};
use gpu_stack_nvml::{SimNodeSpec, SimulatedBackend};
use proptest::prelude::*;

fn node(model: &str, telemetry: SimTelemetry) -> SimulatedBackend {
    let mut spec = SimNodeSpec::uniform("p0", model, 1);
    spec.telemetry = telemetry;
    SimulatedBackend::new(&spec).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn telemetry_is_bounded_consistent_and_monotonic(
        seed in any::<u64>(),
        util in 0u32..=100,
        jitter in 0u32..=50,
        mem in 0u32..=100,
        tick in 0u64..10_000_000,
        model in prop::sample::select(vec!["A100-SXM4-40GB", "H100-SXM5-80GB", "H200-SXM-141GB", "L4"]),
    ) {
        let b = node(model, SimTelemetry { seed, utilization_pct: util, jitter_pct: jitter, memory_used_pct: mem, tick_ms: 1000 });
        let t = b.gpu_telemetry_at(0, tick).unwrap();
        let next = b.gpu_telemetry_at(0, tick + 1).unwrap();
        prop_assert_eq!(&t, &b.gpu_telemetry_at(0, tick).unwrap());
        let fb = *t.fb_memory.value().unwrap();
        prop_assert!(fb.is_consistent());
        prop_assert!(*t.gpu_util_pct.value().unwrap() <= 100);
        prop_assert!(*t.power_usage_mw.value().unwrap() <= 1_000_000);
        prop_assert!(next.total_energy_mj.value().unwrap() >= t.total_energy_mj.value().unwrap());
        if let (Some(a), Some(b)) = (t.nvlink_total_kib.value(), next.nvlink_total_kib.value()) {
            prop_assert!(b >= a);
        }
        if let Some(p) = t.profiling.value() {
            for (name, v) in p.ratios() {
                let v = v.unwrap();
                prop_assert!((0.0..=1.0).contains(&v), "{} = {}", name, v);
            }
            prop_assert!(p.sm_occupancy <= p.sm_active);
        }
        if let (Some(links), Some(total)) = (t.nvlink_link_kib.value(), t.nvlink_total_kib.value()) {
            prop_assert_eq!(links.iter().sum::<u64>(), *total);
        }
        if let (Some(a), Some(b)) = (t.violations.value(), next.violations.value()) {
            prop_assert!(b.power_ns >= a.power_ns && b.thermal_ns >= a.thermal_ns);
        }
    }

    #[test]
    fn mig_operations_never_break_the_geometry(
        ops in prop::collection::vec((0usize..16, 0u32..8, any::<bool>()), 1..40),
        model in prop::sample::select(vec!["A100-SXM4-40GB", "H100-SXM5-80GB", "H200-SXM-141GB"]),
    ) {
        let b = node(model, SimTelemetry::default());
        b.set_mig_mode(0, true).unwrap();
        let geo = catalog::lookup(model).unwrap().mig.as_ref().unwrap();
        for (pick, start, destroy) in ops {
            if destroy {
                let gis = b.gpu_instances(0).unwrap();
                if let Some(gi) = gis.get(pick % gis.len().max(1)) {
                    for ci in &gi.compute_instances {
                        b.destroy_compute_instance(0, gi.id, ci.id).unwrap();
                    }
                    b.destroy_gpu_instance(0, gi.id).unwrap();
                }
            } else {
                let p = &geo.gi_profiles[pick % geo.gi_profiles.len()];
                let placement = SlicePlacement { start, size: p.memory_slices };
                let mut layout: Vec<PlacedInstance> = b
                    .gpu_instances(0)
                    .unwrap()
                    .iter()
                    .map(|g| PlacedInstance::new(geo.by_id(g.profile_id).unwrap().name.clone(), g.placement.start))
                    .collect();
                layout.push(PlacedInstance::new(p.name.clone(), start));
                let allowed = mig::validate(geo, &layout).is_ok();
                let created = b.create_gpu_instance(0, p.id, placement);
                // The backend accepts exactly what the catalog geometry allows.
                prop_assert_eq!(created.is_ok(), allowed, "{:?}", created);
                if let Err(e) = created {
                    prop_assert!(matches!(e.kind(), "insufficient_resources" | "invalid_argument"));
                }
            }
        }
    }
}
