//! MIG engine benchmarks: validation, maximal-layout enumeration, fleet planning.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use gpu_stack_core::catalog;
use gpu_stack_core::mig::{
    FleetGpu, enumerate_maximal_layouts, fit, parse_demand, parse_layout, plan_fleet, validate,
};

fn benches(c: &mut Criterion) {
    let a100 = catalog::lookup("A100-SXM4-40GB")
        .unwrap()
        .mig
        .as_ref()
        .unwrap();
    let h100 = catalog::lookup("H100-SXM5-80GB")
        .unwrap()
        .mig
        .as_ref()
        .unwrap();

    let seven =
        parse_layout("1g.5gb@0,1g.5gb@1,1g.5gb@2,1g.5gb@3,1g.5gb@4,1g.5gb@5,1g.5gb@6").unwrap();
    c.bench_function("validate 7-instance A100 layout", |b| {
        b.iter(|| validate(black_box(a100), black_box(&seven)))
    });

    c.bench_function(
        "enumerate all maximal A100-40GB layouts (all profiles)",
        |b| b.iter(|| enumerate_maximal_layouts(black_box(a100), None).unwrap()),
    );

    let balanced = parse_demand("1g.5gb=2,2g.10gb=1,3g.20gb=1").unwrap();
    c.bench_function("fit A100 balanced", |b| {
        b.iter(|| fit(black_box(a100), black_box(&balanced)))
    });

    // 10,000 GPUs: half A100-40GB, half H100-80GB; a third partly in use.
    let busy_a = parse_layout("3g.20gb@4,1g.5gb@0").unwrap();
    let busy_h = parse_layout("2g.20gb@0,1g.10gb@6").unwrap();
    let gpus: Vec<FleetGpu<'static>> = (0..10_000)
        .map(|i| {
            let (geometry, busy) = if i % 2 == 0 {
                (a100, &busy_a)
            } else {
                (h100, &busy_h)
            };
            let in_use = if i % 3 == 0 { busy.clone() } else { Vec::new() };
            FleetGpu {
                id: format!("gpu{i}"),
                geometry,
                mig_enabled: true,
                current: in_use.clone(),
                in_use,
            }
        })
        .collect();
    let demand = parse_demand(
        "1g.5gb=9000,2g.10gb=4000,3g.20gb=3000,1g.10gb=12000,3g.40gb=2500,7g.80gb=500",
    )
    .unwrap();
    let mut group = c.benchmark_group("plan");
    group.sample_size(10);
    group.bench_function("plan 10,000 GPUs mixed demand", |b| {
        b.iter(|| plan_fleet(black_box(&gpus), black_box(&demand)).unwrap())
    });
    group.finish();
}

criterion_group!(mig, benches);
criterion_main!(mig);
