//! MIG engine benchmarks: validation, maximal-layout enumeration, fleet planning
//! (a mixed A100/H100 fleet and an all-H100 one, 10,000 GPUs each), and the
//! operator's demand decision over 1,000 and 10,000 nodes.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use gpu_stack_core::catalog;
use gpu_stack_core::mig::{
    FleetGpu, PlacedInstance, enumerate_maximal_layouts, fit, parse_demand, parse_layout,
    plan_fleet, validate,
};
use gpu_stack_core::operator::migdemand::{DemandLimits, DemandNode, decide};

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

    // 10,000 H100-80GB (1,250 nodes x 8): layouts as a cluster accumulates
    // them (seven 1g, 3g+3g, 4g+2g+1g, one 7g, 2g+2g+2g+1g, or none), about
    // two in five instances in use, and demand over six profiles near the
    // fleet's 70,000 compute slices.
    let h100_layouts: Vec<Vec<PlacedInstance>> = [
        "1g.10gb@0,1g.10gb@1,1g.10gb@2,1g.10gb@3,1g.10gb@4,1g.10gb@5,1g.10gb@6",
        "3g.40gb@0,3g.40gb@4",
        "4g.40gb@0,2g.20gb@4,1g.10gb@6",
        "7g.80gb@0",
        "2g.20gb@0,2g.20gb@2,2g.20gb@4,1g.10gb@6",
        "",
    ]
    .iter()
    .map(|s| parse_layout(s).unwrap())
    .collect();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        seed >> 33
    };
    let h100_fleet: Vec<FleetGpu<'static>> = (0..1_250)
        .flat_map(|node| (0..8).map(move |gpu| (node, gpu)))
        .map(|(node, gpu)| {
            let current = h100_layouts[next() as usize % h100_layouts.len()].clone();
            let in_use = current.iter().filter(|_| next() % 5 < 2).cloned().collect();
            FleetGpu {
                id: format!("node-{node}/gpu{gpu}"),
                geometry: h100,
                mig_enabled: true,
                current,
                in_use,
            }
        })
        .collect();
    let h100_demand = parse_demand(
        "1g.10gb=21000,1g.20gb=3000,2g.20gb=4000,3g.40gb=5000,4g.40gb=1000,7g.80gb=1500",
    )
    .unwrap();
    group.bench_function(
        "plan 10,000 H100 GPUs (1,250 nodes x 8) mixed demand",
        |b| b.iter(|| plan_fleet(black_box(&h100_fleet), black_box(&h100_demand)).unwrap()),
    );
    group.finish();

    // The operator's demand decision (`migdemand::decide`) over 1,000 and
    // 10,000 nodes of 8 H100s laid out as above, for a queue of pending
    // pods: what one decision costs the operator's thread.
    let pending = parse_demand("1g.10gb=64,2g.20gb=16,3g.40gb=16,7g.80gb=8").unwrap();
    let limits = DemandLimits::default();
    let mut group = c.benchmark_group("migdemand decide");
    group.sample_size(10);
    for nodes in [1_000usize, 10_000] {
        let fleet: Vec<DemandNode<'static>> = (0..nodes)
            .map(|node| DemandNode {
                name: format!("node-{node}"),
                gpus: (0..8)
                    .map(|gpu| {
                        let current = h100_layouts[next() as usize % h100_layouts.len()].clone();
                        let in_use = current.iter().filter(|_| next() % 5 < 2).cloned().collect();
                        FleetGpu {
                            id: gpu.to_string(),
                            geometry: h100,
                            mig_enabled: true,
                            current,
                            in_use,
                        }
                    })
                    .collect(),
                last_change: None,
            })
            .collect();
        group.bench_function(
            format!("{nodes} nodes x 8 H100, 104 pending instances"),
            |b| {
                b.iter(|| {
                    decide(black_box(&fleet), black_box(&pending), &limits, 1_000_000).unwrap()
                })
            },
        );
    }
    group.finish();
}

criterion_group!(mig, benches);
criterion_main!(mig);
