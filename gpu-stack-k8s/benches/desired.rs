//! Time to compute the desired state for large clusters: a first pass (no
//! objects yet) and a steady-state pass (everything already applied, the
//! common case on every reconcile).
use std::collections::BTreeMap;
use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use gpu_stack_core::operator::labels::apply_patch;
use gpu_stack_k8s::operator::cluster::Object;
use gpu_stack_k8s::operator::clusterpolicy::{ClusterPolicy, ClusterPolicySpec};
use gpu_stack_k8s::operator::desired::{Options, desired_state};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// `n` nodes: 70% GPU nodes spread over four OS pools and four GPU models,
/// 30% CPU-only.
fn cluster(n: usize) -> Vec<Node> {
    let oses = [
        ("ubuntu", "22.04"),
        ("ubuntu", "24.04"),
        ("rhel", "9.4"),
        ("rocky", "9.4"),
    ];
    let devices = ["20b0", "2330", "27b8", "2335"];
    (0..n)
        .map(|i| {
            let mut l = BTreeMap::new();
            let (id, v) = oses[i % oses.len()];
            l.insert(
                "feature.node.kubernetes.io/system-os_release.ID".to_string(),
                id.to_string(),
            );
            l.insert(
                "feature.node.kubernetes.io/system-os_release.VERSION_ID".to_string(),
                v.to_string(),
            );
            l.insert(
                "feature.node.kubernetes.io/system-os_release.VERSION_ID.major".to_string(),
                v.split('.').next().unwrap_or(v).to_string(),
            );
            l.insert("kubernetes.io/hostname".to_string(), format!("node-{i}"));
            if i % 10 < 7 {
                l.insert(
                    "feature.node.kubernetes.io/pci-10de.present".to_string(),
                    "true".to_string(),
                );
                l.insert(
                    format!(
                        "feature.node.kubernetes.io/pci-0302_10de_{}.present",
                        devices[i % devices.len()]
                    ),
                    "true".to_string(),
                );
            }
            Node {
                metadata: ObjectMeta {
                    name: Some(format!("node-{i}")),
                    labels: Some(l),
                    ..Default::default()
                },
                ..Default::default()
            }
        })
        .collect()
}

fn converged(policy: &ClusterPolicy, nodes: &mut [Node]) -> Vec<Object> {
    let d = desired_state(policy, nodes, &[], &Options::default());
    for n in nodes.iter_mut() {
        if let Some(p) = d.node_labels.get(n.metadata.name.as_deref().unwrap_or("")) {
            apply_patch(n.metadata.labels.get_or_insert_with(BTreeMap::new), p);
        }
    }
    d.objects
}

fn bench(c: &mut Criterion) {
    let policy = ClusterPolicy::new("cluster-policy", ClusterPolicySpec::default());
    let mut group = c.benchmark_group("desired_state");
    group.sample_size(10);
    for n in [1_000usize, 10_000] {
        let fresh = cluster(n);
        group.bench_with_input(BenchmarkId::new("first_pass", n), &fresh, |b, nodes| {
            b.iter(|| {
                desired_state(
                    black_box(&policy),
                    black_box(nodes),
                    &[],
                    &Options::default(),
                )
            })
        });
        let mut nodes = cluster(n);
        let current = converged(&policy, &mut nodes);
        group.bench_with_input(
            BenchmarkId::new("steady_state", n),
            &(nodes, current),
            |b, (nodes, current)| {
                b.iter(|| {
                    desired_state(
                        black_box(&policy),
                        black_box(nodes),
                        black_box(current),
                        &Options::default(),
                    )
                })
            },
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
