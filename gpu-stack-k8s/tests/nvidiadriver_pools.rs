//! NVIDIADriver resources over the in-memory cluster: per-pool driver
//! DaemonSets with their own versions, conflicts failing closed, refused
//! resources changing nothing, deletion removing a resource's DaemonSets,
//! and the switch from the ClusterPolicy's own driver.
use futures::executor::block_on;
use gpu_stack_core::operator::nvidiadriver::OWNER_LABEL;
use gpu_stack_k8s::operator::Operator;
use gpu_stack_k8s::operator::cluster::{InMemoryCluster, Object};
use gpu_stack_k8s::operator::clusterpolicy::ClusterPolicy;
use gpu_stack_k8s::operator::desired::render::NVIDIA_DRIVER_LABEL;
use gpu_stack_k8s::operator::nvidiadriver::{NvidiaDriver, NvidiaDriverState};

mod common;

fn policy(crd: bool) -> ClusterPolicy {
    common::policy(serde_json::json!({"driver": {"useNvidiaDriverCRD": crd}}))
}

fn driver(name: &str, spec: serde_json::Value) -> NvidiaDriver {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "NVIDIADriver",
        "metadata": {"name": name},
        "spec": spec,
    }))
    .unwrap()
}

/// The mixed fleet, with the A100 and H100 nodes labelled `pool=training`.
fn cluster(crd: bool) -> InMemoryCluster {
    common::mixed_cluster(
        "training",
        serde_json::json!({"driver": {"useNvidiaDriverCRD": crd}}),
    )
}

/// Driver DaemonSets: (name, image, owner-label value in the node selector).
fn driver_sets(c: &InMemoryCluster) -> Vec<(String, String, Option<String>)> {
    let mut out: Vec<_> = c
        .objects()
        .into_iter()
        .filter_map(|o| match o {
            Object::DaemonSet(ds) if ds.metadata.name.as_deref().unwrap().contains("driver") => {
                let pod = ds.spec.template.spec.unwrap();
                Some((
                    ds.metadata.name.unwrap(),
                    pod.containers[0].image.clone().unwrap(),
                    pod.node_selector.unwrap().get(OWNER_LABEL).cloned(),
                ))
            }
            _ => None,
        })
        .collect();
    out.sort();
    out
}

fn owner(c: &InMemoryCluster, node: &str) -> Option<String> {
    c.nodes()
        .into_iter()
        .find(|n| n.metadata.name.as_deref() == Some(node))
        .and_then(|n| n.metadata.labels)
        .and_then(|l| l.get(OWNER_LABEL).cloned())
}

fn status(c: &InMemoryCluster, name: &str) -> (NvidiaDriverState, String) {
    let st = c.nvidia_driver(name).unwrap().status.unwrap();
    let messages: Vec<String> = st
        .conditions
        .iter()
        .filter(|c| c.status == "True" || c.type_ == "Ready")
        .map(|c| format!("{}={} {}: {}", c.type_, c.status, c.reason, c.message))
        .collect();
    (st.state, messages.join(" | "))
}

fn converge(op: &Operator<InMemoryCluster>) {
    block_on(op.converge(6)).unwrap();
    op.cluster().settle();
    block_on(op.converge(6)).unwrap();
}

fn two_pools() -> Operator<InMemoryCluster> {
    let c = cluster(true);
    c.upsert_nvidia_driver(driver(
        "training",
        serde_json::json!({"nodeSelector": {"pool": "training"}, "version": "570.172.08",
            "env": [{"name": "EXTRA", "value": "1"}], "priorityClassName": "gpu-critical"}),
    ));
    c.upsert_nvidia_driver(driver(
        "default",
        serde_json::json!({"default": true, "version": "595.91.07"}),
    ));
    let op = Operator::new(c);
    converge(&op);
    op
}

#[test]
fn two_pools_get_their_own_versions_and_go_ready() {
    let op = two_pools();
    let c = op.cluster();
    assert_eq!(
        driver_sets(c),
        [
            // RHEL pools go by major version, as NVIDIA's images are tagged.
            (
                "nvidia-gpu-driver-default-rhel9".to_string(),
                "nvcr.io/nvidia/driver:595.91.07-rhel9".to_string(),
                Some("default".to_string())
            ),
            (
                "nvidia-gpu-driver-training-ubuntu22.04".into(),
                "nvcr.io/nvidia/driver:570.172.08-ubuntu22.04".into(),
                Some("training".into())
            ),
        ]
    );
    assert_eq!(owner(c, "hgx-h100-0").as_deref(), Some("training"));
    assert_eq!(owner(c, "l4-rhel-0").as_deref(), Some("default"));
    assert_eq!(owner(c, "cpu-0"), None, "CPU nodes are not routed");
    // The resource's own settings reach its pods.
    let ds = c
        .objects()
        .into_iter()
        .find(|o| o.name() == "nvidia-gpu-driver-training-ubuntu22.04")
        .unwrap();
    let Object::DaemonSet(ds) = ds else {
        unreachable!()
    };
    assert_eq!(
        ds.metadata.labels.as_ref().unwrap()[NVIDIA_DRIVER_LABEL],
        "training"
    );
    let pod = ds.spec.template.spec.unwrap();
    assert_eq!(pod.priority_class_name.as_deref(), Some("gpu-critical"));
    let env = pod.containers[0].env.clone().unwrap();
    assert!(env.iter().any(|e| e.name == "EXTRA"));
    for name in ["training", "default"] {
        let (state, why) = status(c, name);
        assert_eq!(state, NvidiaDriverState::Ready, "{name}: {why}");
    }
    let cp = c.policy("cluster-policy").unwrap().status.unwrap();
    assert_eq!(cp.state, "ready", "{cp:?}");
    assert!(cp.unsupported_fields.is_empty());
    // Converged: another pass writes nothing.
    let writes = c.stats().writes;
    assert!(!block_on(op.reconcile_once()).unwrap().changed());
    assert_eq!(c.stats().writes, writes);
}

#[test]
fn a_conflicting_resource_is_refused_for_both_and_nothing_moves() {
    let op = two_pools();
    let c = op.cluster();
    let before = driver_sets(c);
    c.upsert_nvidia_driver(driver(
        "rival",
        serde_json::json!({"nodeSelector": {"pool": "training"}, "version": "580.95.05"}),
    ));
    converge(&op);
    assert_eq!(driver_sets(c), before, "no DaemonSet changed or appeared");
    assert_eq!(owner(c, "hgx-h100-0").as_deref(), Some("training"));
    for (name, other) in [("training", "rival"), ("rival", "training")] {
        let (state, why) = status(c, name);
        assert_eq!(state, NvidiaDriverState::NotReady, "{name}: {why}");
        assert!(why.contains("ConflictingNodeSelector"), "{why}");
        assert!(why.contains(other) && why.contains("hgx-h100-0"), "{why}");
    }
    assert_eq!(status(c, "default").0, NvidiaDriverState::Ready);
    // Removing the rival resolves it.
    assert!(c.remove_nvidia_driver("rival"));
    converge(&op);
    assert_eq!(status(c, "training").0, NvidiaDriverState::Ready);
}

#[test]
fn a_refused_resource_keeps_what_runs_and_says_why() {
    let op = two_pools();
    let c = op.cluster();
    let before = driver_sets(c);
    // R450 cannot drive H100s.
    c.upsert_nvidia_driver(driver(
        "training",
        serde_json::json!({"nodeSelector": {"pool": "training"}, "version": "450.80.02"}),
    ));
    converge(&op);
    assert_eq!(driver_sets(c), before, "the running driver stays");
    let (state, why) = status(c, "training");
    assert_eq!(state, NvidiaDriverState::NotReady);
    assert!(why.contains("InvalidSpec") && why.contains("R450"), "{why}");
    assert_eq!(owner(c, "hgx-h100-0").as_deref(), Some("training"));
}

#[test]
fn deleting_a_resource_removes_its_daemonsets_and_the_default_takes_over() {
    let op = two_pools();
    let c = op.cluster();
    assert!(c.remove_nvidia_driver("training"));
    converge(&op);
    let sets = driver_sets(c);
    assert!(
        sets.iter().all(|(name, _, _)| !name.contains("-training-")),
        "{sets:?}"
    );
    assert!(
        sets.iter().any(
            |(name, image, _)| name == "nvidia-gpu-driver-default-ubuntu22.04"
                && image.ends_with(":595.91.07-ubuntu22.04")
        ),
        "{sets:?}"
    );
    assert_eq!(owner(c, "hgx-h100-0").as_deref(), Some("default"));
}

#[test]
fn switching_to_nvidiadrivers_replaces_the_policy_driver() {
    let c = cluster(false);
    c.upsert_nvidia_driver(driver(
        "default",
        serde_json::json!({"default": true, "version": "595.91.07"}),
    ));
    let op = Operator::new(c);
    converge(&op);
    let c = op.cluster();
    assert!(
        driver_sets(c).iter().all(
            |(name, _, owner)| name.starts_with("nvidia-driver-daemonset-") && owner.is_none()
        )
    );
    let (state, why) = status(c, "default");
    assert_eq!(state, NvidiaDriverState::NotReady);
    assert!(why.contains("useNvidiaDriverCRD"), "{why}");
    c.upsert_policy(policy(true));
    converge(&op);
    let sets = driver_sets(c);
    assert!(!sets.is_empty());
    assert!(
        sets.iter().all(
            |(name, _, owner)| name.starts_with("nvidia-gpu-driver-default-")
                && owner.as_deref() == Some("default")
        ),
        "{sets:?}"
    );
    assert_eq!(status(c, "default").0, NvidiaDriverState::Ready);
}

#[test]
fn gpu_nodes_without_a_driver_resource_are_named_in_the_policy() {
    let c = cluster(true);
    c.upsert_nvidia_driver(driver(
        "training",
        serde_json::json!({"nodeSelector": {"pool": "training"}, "version": "595.91.07"}),
    ));
    let op = Operator::new(c);
    converge(&op);
    let cp = op
        .cluster()
        .policy("cluster-policy")
        .unwrap()
        .status
        .unwrap();
    assert_eq!(cp.state, "notReady");
    let refused: Vec<&str> = cp.refused_nodes.iter().map(|r| r.node.as_str()).collect();
    assert_eq!(refused, ["l4-rhel-0", "l4-rhel-1"]);
    assert!(
        cp.refused_nodes[0]
            .reason
            .contains("no NVIDIADriver selects this node")
    );
}
