//! What the demo starts from and what it changes: the built-in fleet, the
//! default ClusterPolicy, the node that joins, and a deterministic clock.
use std::sync::atomic::{AtomicI64, Ordering};

use gpu_stack_core::fleet::{Fleet, FleetGpuSpec, FleetNode};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

use crate::operator::Clock;
use crate::operator::clusterpolicy::{ClusterPolicy, ClusterPolicySpec, MigSpec};

/// The default fleet: a few GPU nodes of different models on Ubuntu and RHEL,
/// plus CPU-only nodes.
pub const DEFAULT_FLEET: &str = include_str!("../../../examples/fleets/mixed.yaml");

/// Name of the demo's ClusterPolicy.
pub(super) const POLICY: &str = "cluster-policy";
/// A driver branch too old for H200 GPUs (they need R550).
pub(super) const IMPOSSIBLE_DRIVER: &str = "535.183.01";
/// MIG strategy of the demo's ClusterPolicy: MIG devices are advertised as
/// `nvidia.com/mig-<profile>`, whole GPUs as `nvidia.com/gpu`.
pub(super) const MIG_STRATEGY: &str = "mixed";

/// Seconds since the Unix epoch of the demo's first clock reading.
const EPOCH_S: i64 = 1_780_000_000;

/// A deterministic clock: one second per reading from a fixed epoch, so the
/// demo's output is the same on every run.
pub(super) fn demo_clock() -> Clock {
    let t = AtomicI64::new(EPOCH_S);
    Box::new(move || {
        let s = t.fetch_add(1, Ordering::Relaxed);
        k8s_openapi::jiff::Timestamp::from_second(s)
            .map(|ts| ts.to_string())
            .unwrap_or_default()
    })
}

/// The ClusterPolicy the operator starts with: defaults, MIG strategy
/// [`MIG_STRATEGY`].
pub(super) fn default_policy(node_agent: bool) -> ClusterPolicy {
    let spec = ClusterPolicySpec {
        mig: Some(MigSpec {
            strategy: Some(MIG_STRATEGY.into()),
            ..Default::default()
        }),
        node_agent: node_agent.then(|| crate::operator::clusterpolicy::ComponentSpec {
            enabled: Some(true),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut p = ClusterPolicy::new(POLICY, spec);
    p.metadata = ObjectMeta {
        name: Some(POLICY.into()),
        creation_timestamp: k8s_openapi::jiff::Timestamp::from_second(EPOCH_S)
            .ok()
            .map(Time),
        ..Default::default()
    };
    p
}

/// The node that joins the cluster: Ubuntu 24.04 with 8 H200 GPUs, named
/// `h200-<n>` with the first `n` no fleet node already uses.
pub(super) fn joining_node(existing: &Fleet) -> FleetNode {
    let mut name = "h200-0".to_string();
    let mut i = 0;
    while existing.nodes.iter().any(|n| n.name == name) {
        i += 1;
        name = format!("h200-{i}");
    }
    FleetNode {
        name,
        labels: [
            ("feature.node.kubernetes.io/system-os_release.ID", "ubuntu"),
            (
                "feature.node.kubernetes.io/system-os_release.VERSION_ID",
                "24.04",
            ),
            (
                "feature.node.kubernetes.io/kernel-version.full",
                "6.8.0-45-generic",
            ),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect(),
        gpus: vec![FleetGpuSpec {
            model: "H200-SXM-141GB".into(),
            count: 8,
            mig: None,
            telemetry: None,
        }],
        ..Default::default()
    }
}
