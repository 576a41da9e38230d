//! Fixtures shared by the operator's in-memory cluster tests.
use gpu_stack_core::fleet::Fleet;
use gpu_stack_k8s::operator::cluster::InMemoryCluster;
use gpu_stack_k8s::operator::cluster::fleet::nodes_from_fleet;
use gpu_stack_k8s::operator::clusterpolicy::{ClusterPolicy, ClusterPolicySpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// The mixed example fleet.
pub const MIXED: &str = include_str!("../../../examples/fleets/mixed.yaml");

/// The ClusterPolicy `cluster-policy` with `spec`.
pub fn policy(spec: serde_json::Value) -> ClusterPolicy {
    let spec: ClusterPolicySpec = serde_json::from_value(spec).unwrap();
    let mut p = ClusterPolicy::new("cluster-policy", spec);
    p.metadata = ObjectMeta {
        name: Some("cluster-policy".into()),
        uid: Some("uid-cluster-policy".into()),
        generation: Some(1),
        ..Default::default()
    };
    p
}

/// The mixed fleet with its A100 and H100 nodes labelled `pool=<pool>`, and
/// the ClusterPolicy with `spec`.
pub fn mixed_cluster(pool: &str, spec: serde_json::Value) -> InMemoryCluster {
    let cluster = InMemoryCluster::new();
    for mut n in nodes_from_fleet(&Fleet::from_yaml(MIXED).unwrap()) {
        let name = n.metadata.name.clone().unwrap();
        if name.starts_with("dgx-") || name.starts_with("hgx-") {
            n.metadata
                .labels
                .get_or_insert_with(Default::default)
                .insert("pool".into(), pool.into());
        }
        cluster.upsert_node(n);
    }
    cluster.upsert_policy(policy(spec));
    cluster
}
