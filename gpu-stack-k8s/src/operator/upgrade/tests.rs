use std::collections::{BTreeMap, BTreeSet};

use gpu_stack_core::operator::upgrade::pass::{
    NodeDecision, PassOptions, UpgradeAction, ValidatorStatus, plan_pass,
};
use gpu_stack_core::operator::upgrade::policy::UpgradePolicy;
use gpu_stack_core::operator::upgrade::state::{STATE_LABEL, UpgradeState};
use k8s_openapi::api::apps::v1::{ControllerRevision, DaemonSet, DaemonSetStatus};
use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::json;

use super::apply::{node_work, wind_down_patch};
use super::observe::{
    ObserveError, PodSelectors, daemonset_revisions, observe_nodes, sort_node_pods,
};
use super::upgrade_status;
use crate::operator::controller::watches::WatchedNode;

fn ds(name: &str, uid: &str, generation: i64, observed: i64) -> DaemonSet {
    let mut d: DaemonSet = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "gpu", "uid": uid, "generation": generation},
    }))
    .unwrap();
    d.status = Some(DaemonSetStatus {
        observed_generation: Some(observed),
        ..DaemonSetStatus::default()
    });
    d
}

fn revision(owner: &str, hash: &str, rev: i64) -> ControllerRevision {
    serde_json::from_value(json!({
        "metadata": {
            "name": format!("driver-{hash}"),
            "labels": {"controller-revision-hash": hash},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "driver", "uid": owner, "controller": true}],
        },
        "revision": rev,
    }))
    .unwrap()
}

fn pod(name: &str, node: &str, extra: serde_json::Value) -> Pod {
    let mut v = json!({
        "metadata": {"name": name, "namespace": "gpu", "labels": {}},
        "spec": {"nodeName": node, "containers": [{"name": "c"}]},
        "status": {"phase": "Running", "containerStatuses": [{
            "name": "c", "ready": true, "restartCount": 0, "image": "i", "imageID": ""
        }]},
    });
    merge(&mut v, extra);
    serde_json::from_value(v).unwrap()
}

fn merge(a: &mut serde_json::Value, b: serde_json::Value) {
    match (a, b) {
        (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(serde_json::Value::Null), v);
            }
        }
        (a, b) => *a = b,
    }
}

fn driver_pod(name: &str, node: &str, hash: &str) -> Pod {
    pod(
        name,
        node,
        json!({"metadata": {
            "labels": {"controller-revision-hash": hash},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "driver", "uid": "ds-1", "controller": true}],
        }}),
    )
}

fn node(name: &str, extra: serde_json::Value) -> WatchedNode {
    let mut v = json!({"metadata": {"name": name}});
    merge(&mut v, extra);
    WatchedNode::from(serde_json::from_value::<Node>(v).unwrap())
}

#[test]
fn the_newest_controller_revision_is_the_daemonsets_revision() {
    let sets = [ds("driver", "ds-1", 2, 2)];
    let revs = [
        revision("ds-1", "old", 1),
        revision("ds-1", "new", 2),
        revision("other", "x", 9),
    ];
    let got = daemonset_revisions(&sets, &revs).unwrap();
    assert_eq!(got.get("ds-1").map(String::as_str), Some("new"));
}

#[test]
fn a_daemonset_its_controller_has_not_caught_up_with_defers_the_pass() {
    let sets = [ds("driver", "ds-1", 3, 2)];
    assert!(matches!(
        daemonset_revisions::<_, ControllerRevision>(&sets, &[]),
        Err(ObserveError::DaemonSetNotObserved { generation: 3, .. })
    ));
}

#[test]
fn observations_cover_nodes_with_a_driver_pod_and_read_their_state() {
    let revs = BTreeMap::from([("ds-1".to_string(), "new".to_string())]);
    let nodes = [
        node(
            "a",
            json!({"metadata": {"labels": {STATE_LABEL: "upgrade-done"}}, "spec": {"unschedulable": true}}),
        ),
        node(
            "b",
            json!({"status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}}),
        ),
        node("cpu", json!({})),
        node(
            "bad",
            json!({"metadata": {"labels": {STATE_LABEL: "no-such-state"}}}),
        ),
    ];
    let mut old_terminating = driver_pod("drv-a-old", "a", "old");
    old_terminating.metadata.deletion_timestamp =
        Some(serde_json::from_value(json!("2024-01-01T00:00:00Z")).unwrap());
    let drivers = [
        old_terminating,
        driver_pod("drv-a", "a", "new"),
        driver_pod("drv-b", "b", "old"),
        driver_pod("drv-bad", "bad", "new"),
    ];
    let validators = [pod(
        "val-a",
        "a",
        json!({"metadata": {"labels": {"app": "nvidia-operator-validator"}}}),
    )];
    let o = observe_nodes(&nodes, &revs, &drivers, &validators);
    let names: Vec<&str> = o.nodes.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(o.skipped.len(), 1);
    let a = &o.nodes[0];
    assert_eq!(a.marks.state, UpgradeState::Done);
    assert!(a.unschedulable && a.node_ready);
    assert_eq!(a.driver_pod.name, "drv-a");
    assert!(a.driver_pod.in_sync_and_ready());
    assert_eq!(a.validator, ValidatorStatus::Ready);
    let b = &o.nodes[1];
    assert!(!b.node_ready && !b.driver_pod.in_sync());
    assert_eq!(b.validator, ValidatorStatus::Absent);
    assert_eq!(
        o.driver_pods.get("a").map(BTreeSet::len),
        Some(2),
        "old and new driver pods are both excluded from the workload"
    );
}

#[test]
fn node_pods_are_sorted_into_gpu_wait_and_drain() {
    let policy: UpgradePolicy = serde_json::from_value(json!({
        "autoUpgrade": true,
        "waitForCompletion": {"podSelector": "job=train"},
        "drain": {"enable": true},
    }))
    .unwrap();
    let selectors = PodSelectors::new(&policy).unwrap();
    let gpu = json!({"spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
        "metadata": {"ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs", "uid": "u", "controller": true}]}});
    let mig = json!({"spec": {"containers": [{"name": "c", "resources": {"requests": {"nvidia.com/mig-1g.10gb": "1"}}}]}});
    let mut gone = pod("gpu-gone", "n", gpu.clone());
    gone.metadata.deletion_timestamp =
        Some(serde_json::from_value(json!("2024-01-01T00:00:00Z")).unwrap());
    let pods = [
        pod("gpu-1", "n", gpu.clone()),
        pod("mig-1", "n", mig),
        pod(
            "plain",
            "n",
            json!({"metadata": {"labels": {"job": "train"}}}),
        ),
        pod("done", "n", json!({"status": {"phase": "Succeeded"}})),
        pod(
            "skip",
            "n",
            json!({"metadata": {"labels": {"nvidia.com/gpu-driver-upgrade-drain.skip": "true"}}}),
        ),
        pod("drv", "n", gpu),
        gone,
    ];
    let driver = BTreeSet::from(["drv".to_string()]);
    let sorted = sort_node_pods(&pods, &selectors, &driver);
    let names = |v: &[gpu_stack_core::operator::upgrade::pass::PodRef]| {
        v.iter().map(|p| p.name.clone()).collect::<Vec<_>>()
    };
    assert_eq!(names(&sorted.gpu), ["gpu-1", "mig-1", "gpu-gone"]);
    assert!(sorted.gpu[0].controlled && !sorted.gpu[1].controlled);
    assert_eq!(names(&sorted.wait), ["plain"]);
    assert_eq!(
        names(&sorted.drain),
        ["gpu-1", "mig-1", "plain", "gpu-gone"]
    );
    assert!(
        sorted
            .terminating
            .contains(&("gpu".into(), "gpu-gone".into()))
    );
}

#[test]
fn an_abandoned_upgrade_winds_down_in_one_node_patch() {
    use gpu_stack_core::operator::upgrade::abandon::WindDown;
    let w = WindDown {
        uncordon: true,
        remove_labels: vec![STATE_LABEL],
        remove_annotations: vec!["a"],
        note: String::new(),
    };
    assert_eq!(
        wind_down_patch(&w),
        json!({
            "metadata": {"labels": {STATE_LABEL: null}, "annotations": {"a": null}},
            "spec": {"unschedulable": false},
        })
    );
    let kept = WindDown {
        uncordon: false,
        ..w
    };
    assert!(wind_down_patch(&kept).get("spec").is_none());
}

#[test]
fn a_decision_becomes_one_node_patch_then_pod_work() {
    let d = NodeDecision {
        node: "a".into(),
        from: UpgradeState::CordonRequired,
        next: UpgradeState::WaitForJobsRequired,
        actions: vec![
            UpgradeAction::Cordon,
            UpgradeAction::SetAnnotation {
                key: "k".into(),
                value: "v".into(),
            },
            UpgradeAction::RemoveAnnotation { key: "gone".into() },
        ],
        reason: String::new(),
    };
    let w = node_work(&d, &BTreeSet::new());
    assert_eq!(
        w.patch,
        Some(json!({
            "metadata": {
                "labels": {STATE_LABEL: "wait-for-jobs-required"},
                "annotations": {"k": "v", "gone": null},
            },
            "spec": {"unschedulable": true},
        }))
    );
    let evict = NodeDecision {
        node: "a".into(),
        from: UpgradeState::PodDeletionRequired,
        next: UpgradeState::PodDeletionRequired,
        actions: vec![
            UpgradeAction::Evict {
                purpose: gpu_stack_core::operator::upgrade::pass::EvictionPurpose::PodDeletion,
                pods: vec![
                    gpu_stack_core::operator::upgrade::pass::PodRef {
                        namespace: "w".into(),
                        name: "p1".into(),
                        controlled: true,
                        daemon_set: false,
                        empty_dir: false,
                    },
                    gpu_stack_core::operator::upgrade::pass::PodRef {
                        namespace: "w".into(),
                        name: "p2".into(),
                        controlled: true,
                        daemon_set: false,
                        empty_dir: false,
                    },
                ],
            },
            UpgradeAction::DeleteDriverPod {
                namespace: "gpu".into(),
                name: "drv".into(),
            },
        ],
        reason: String::new(),
    };
    let w = node_work(&evict, &BTreeSet::from([("w".into(), "p2".into())]));
    assert_eq!(w.patch, None);
    assert_eq!(w.evict.len(), 1);
    assert_eq!(w.evict[0].name, "p1");
    assert_eq!(w.delete, [("gpu".to_string(), "drv".to_string())]);
    // Back at rest: the label is removed.
    let off = NodeDecision {
        node: "a".into(),
        from: UpgradeState::Done,
        next: UpgradeState::Unknown,
        actions: Vec::new(),
        reason: String::new(),
    };
    assert_eq!(
        node_work(&off, &BTreeSet::new()).patch,
        Some(json!({"metadata": {"labels": {STATE_LABEL: null}}}))
    );
}

#[test]
fn a_version_bump_over_observed_nodes_starts_within_the_budget_and_reports_progress() {
    let revs = BTreeMap::from([("ds-1".to_string(), "new".to_string())]);
    let nodes: Vec<WatchedNode> = (0..10)
        .map(|i| {
            node(
                &format!("n{i}"),
                json!({"metadata": {"labels": {STATE_LABEL: "upgrade-required"}}}),
            )
        })
        .collect();
    let drivers: Vec<Pod> = (0..10)
        .map(|i| driver_pod(&format!("d{i}"), &format!("n{i}"), "old"))
        .collect();
    let o = observe_nodes(&nodes, &revs, &drivers, &[]);
    let policy: UpgradePolicy = serde_json::from_value(json!({
        "autoUpgrade": true, "maxUnavailable": "20%", "maxParallelUpgrades": 0,
    }))
    .unwrap();
    let plan = plan_pass(&o.nodes, &policy, 1000, &PassOptions::default()).unwrap();
    let started = plan
        .decisions
        .iter()
        .filter(|d| d.next == UpgradeState::CordonRequired)
        .count();
    assert_eq!(started, 2);
    let st = upgrade_status(policy.auto_upgrade, &plan, &[], 1000);
    assert_eq!(st.total, 10);
    assert_eq!(
        st.message,
        "0 of 10 nodes up to date; 2 in progress, 8 pending, 0 failed"
    );
    assert_eq!(st.conditions[0].status, "False");
}

#[test]
fn nodes_are_grouped_by_the_nvidiadriver_that_owns_them() {
    use super::controller::{Policies, group_nodes};
    use gpu_stack_core::operator::upgrade::pass::NodeObservation;
    use gpu_stack_core::operator::upgrade::policy::UpgradePolicy;
    let obs = |name: &str| NodeObservation {
        name: name.into(),
        ..NodeObservation::default()
    };
    let on = UpgradePolicy {
        auto_upgrade: true,
        ..UpgradePolicy::default()
    };
    let owners: BTreeMap<String, String> = [("a", "pool-a"), ("b", "pool-b"), ("c", "gone")]
        .into_iter()
        .map(|(n, o)| (n.to_string(), o.to_string()))
        .collect();
    let nodes = || ["a", "b", "c", "d"].map(obs).to_vec();
    // The ClusterPolicy's policy covers every node.
    let shared: Policies = BTreeMap::from([(None, Some(on.clone()))]);
    let g = group_nodes(nodes(), &owners, &shared);
    assert_eq!(g.len(), 1);
    assert_eq!(g[0].nodes.len(), 4);
    // Per resource: a refused policy leaves its nodes alone; nodes of no
    // known resource get upgrades off (their state label goes).
    let per_cr: Policies = BTreeMap::from([
        (Some("pool-a".to_string()), Some(on.clone())),
        (Some("pool-b".to_string()), None),
    ]);
    let g = group_nodes(nodes(), &owners, &per_cr);
    let names: Vec<(bool, Vec<&str>)> = g
        .iter()
        .map(|g| {
            (
                g.policy.auto_upgrade,
                g.nodes.iter().map(|n| n.name.as_str()).collect(),
            )
        })
        .collect();
    assert_eq!(names, [(true, vec!["a"]), (false, vec!["c", "d"])]);
}
