//! MigConfigs over the in-memory cluster: the operator labels the selected
//! nodes and adds the generated config to the mig-parted ConfigMap the MIG
//! manager reads, reports each node Pending then Applied, refuses invalid
//! or conflicting MigConfigs without touching a node, and leaves the layout
//! when a MigConfig is deleted.
use futures::executor::block_on;
use gpu_stack_core::migmanager::labels::MIG_CONFIG_STATE_LABEL;
use gpu_stack_core::migparted::MigPartedConfig;
use gpu_stack_core::operator::labels::{LabelPatch, MIG_CONFIG};
use gpu_stack_k8s::operator::Operator;
use gpu_stack_k8s::operator::cluster::{Cluster, InMemoryCluster, Object};
use gpu_stack_k8s::operator::migconfig::{MigConfig, MigConfigStatus};

mod common;

fn mig_config(name: &str, spec: serde_json::Value) -> MigConfig {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "gpustack.io/v1alpha1",
        "kind": "MigConfig",
        "metadata": {"name": name},
        "spec": spec,
    }))
    .unwrap()
}

/// The mixed fleet with its A100 and H100 nodes labelled `pool=mig`.
fn operator(policy_spec: serde_json::Value) -> Operator<InMemoryCluster> {
    Operator::new(common::mixed_cluster("mig", policy_spec))
}

fn inference() -> MigConfig {
    mig_config(
        "inference",
        serde_json::json!({
            "nodeSelector": {"pool": "mig"},
            "layouts": [
                {"gpuModel": "H100-SXM5-80GB", "profiles": {"1g.10gb": 4, "3g.40gb": 1}},
                {"config": "all-1g.5gb"},
            ],
        }),
    )
}

fn label(op: &Operator<InMemoryCluster>, node: &str, key: &str) -> Option<String> {
    op.cluster()
        .nodes()
        .into_iter()
        .find(|n| n.metadata.name.as_deref() == Some(node))
        .and_then(|n| n.metadata.labels)
        .and_then(|l| l.get(key).cloned())
}

fn status(op: &Operator<InMemoryCluster>, name: &str) -> MigConfigStatus {
    op.cluster().mig_config(name).unwrap().status.unwrap()
}

fn mig_file(op: &Operator<InMemoryCluster>) -> MigPartedConfig {
    let text = op
        .cluster()
        .objects()
        .into_iter()
        .find_map(|o| match o {
            Object::ConfigMap(c)
                if c.metadata.name.as_deref() == Some("default-mig-parted-config") =>
            {
                c.data?.get("config.yaml").cloned()
            }
            _ => None,
        })
        .expect("the mig-parted ConfigMap");
    MigPartedConfig::from_yaml(&text).unwrap()
}

fn converge(op: &Operator<InMemoryCluster>) {
    block_on(op.converge(6)).unwrap();
}

/// What the MIG manager writes when it applied a node's layout.
fn report_applied(op: &Operator<InMemoryCluster>, node: &str) {
    let patch = LabelPatch::from([(MIG_CONFIG_STATE_LABEL.to_string(), Some("success".into()))]);
    block_on(op.cluster().patch_node_labels(node, &patch)).unwrap();
}

fn ready(st: &MigConfigStatus) -> (String, String) {
    let c = st.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
    (c.status.clone(), c.message.clone())
}

#[test]
fn a_migconfig_labels_its_nodes_writes_the_config_and_goes_applied() {
    let op = operator(serde_json::json!({}));
    op.cluster().upsert_mig_config(inference());
    converge(&op);
    for node in ["hgx-h100-0", "dgx-a100-0"] {
        assert_eq!(
            label(&op, node, MIG_CONFIG).as_deref(),
            Some("gpustack-inference"),
            "{node}"
        );
    }
    // The L4 nodes are not selected and keep the operator's default.
    assert_ne!(
        label(&op, "l4-rhel-0", MIG_CONFIG).as_deref(),
        Some("gpustack-inference")
    );
    let file = mig_file(&op);
    let entry = file
        .get("gpustack-inference")
        .expect("the generated config");
    assert!(file.get("all-balanced").is_some(), "shipped configs stay");
    assert!(!entry.entries.is_empty());
    let st = status(&op, "inference");
    assert_eq!((st.pending, st.applied, st.invalid), (2, 0, 0), "{st:?}");
    assert_eq!(st.config_name.as_deref(), Some("gpustack-inference"));
    assert_eq!(ready(&st).0, "False");
    report_applied(&op, "hgx-h100-0");
    report_applied(&op, "dgx-a100-0");
    converge(&op);
    let st = status(&op, "inference");
    assert_eq!((st.pending, st.applied), (0, 2), "{st:?}");
    assert_eq!(ready(&st), ("True".into(), "2 node(s) applied".into()));
    // Converged: another pass writes nothing.
    let writes = op.cluster().stats().writes;
    assert!(!block_on(op.reconcile_once()).unwrap().changed());
    assert_eq!(op.cluster().stats().writes, writes);
}

#[test]
fn an_invalid_migconfig_changes_no_node_and_says_why() {
    let op = operator(serde_json::json!({}));
    converge(&op);
    let before = label(&op, "hgx-h100-0", MIG_CONFIG);
    let bad = mig_config(
        "bad",
        serde_json::json!({
            "nodeSelector": {"pool": "mig"},
            "layouts": [{"gpuModel": "H100-SXM5-80GB", "profiles": {"1g.5gb": 7}}],
        }),
    );
    op.cluster().upsert_mig_config(bad);
    converge(&op);
    assert_eq!(label(&op, "hgx-h100-0", MIG_CONFIG), before);
    assert!(mig_file(&op).get("gpustack-bad").is_none());
    let st = status(&op, "bad");
    let error = st.conditions.iter().find(|c| c.type_ == "Error").unwrap();
    assert_eq!(
        (error.status.as_str(), error.reason.as_str()),
        ("True", "InvalidSpec")
    );
    assert!(
        error.message.contains("1g.5gb does not exist on this GPU"),
        "{}",
        error.message
    );
    assert!(st.nodes.iter().all(|n| n.state == "Invalid"));
}

#[test]
fn a_node_two_migconfigs_select_is_refused_for_both() {
    let op = operator(serde_json::json!({}));
    op.cluster().upsert_mig_config(inference());
    op.cluster().upsert_mig_config(mig_config(
        "h100-only",
        serde_json::json!({
            "nodeSelector": {"nvidia.com/gpu.deploy.operands": "true", "pool": "mig"},
            "layouts": [{"migEnabled": false}],
        }),
    ));
    // Select the H100 node by a label only it has.
    let patch = LabelPatch::from([(
        "nvidia.com/gpu.deploy.operands".to_string(),
        Some("true".into()),
    )]);
    block_on(op.cluster().patch_node_labels("hgx-h100-0", &patch)).unwrap();
    converge(&op);
    for name in ["inference", "h100-only"] {
        let st = status(&op, name);
        let h100 = st.nodes.iter().find(|n| n.name == "hgx-h100-0").unwrap();
        assert_eq!(h100.state, "Invalid", "{name}");
        assert!(
            h100.reason.contains("h100-only, inference"),
            "{}",
            h100.reason
        );
    }
    assert_ne!(
        label(&op, "hgx-h100-0", MIG_CONFIG).as_deref(),
        Some("gpustack-inference")
    );
    // The A100 node, selected by one only, is labelled.
    assert_eq!(
        label(&op, "dgx-a100-0", MIG_CONFIG).as_deref(),
        Some("gpustack-inference")
    );
}

#[test]
fn deleting_a_migconfig_leaves_the_layout_and_its_config() {
    let op = operator(serde_json::json!({}));
    op.cluster().upsert_mig_config(inference());
    converge(&op);
    assert!(op.cluster().remove_mig_config("inference"));
    converge(&op);
    assert_eq!(
        label(&op, "hgx-h100-0", MIG_CONFIG).as_deref(),
        Some("gpustack-inference")
    );
    assert!(mig_file(&op).get("gpustack-inference").is_some());
    // Once no node names it, the generated config goes.
    for node in ["hgx-h100-0", "dgx-a100-0"] {
        let patch = LabelPatch::from([(MIG_CONFIG.to_string(), Some("all-disabled".into()))]);
        block_on(op.cluster().patch_node_labels(node, &patch)).unwrap();
    }
    converge(&op);
    assert!(mig_file(&op).get("gpustack-inference").is_none());
}

#[test]
fn a_configmap_of_the_users_is_left_alone_and_the_status_says_so() {
    let op = operator(serde_json::json!({"migManager": {"config": {"name": "my-mig-config"}}}));
    op.cluster().upsert_mig_config(inference());
    converge(&op);
    assert_ne!(
        label(&op, "hgx-h100-0", MIG_CONFIG).as_deref(),
        Some("gpustack-inference")
    );
    let st = status(&op, "inference");
    let (state, message) = ready(&st);
    assert_eq!(state, "False");
    assert!(message.contains("my-mig-config"), "{message}");
}

#[test]
fn a_demand_decision_relabels_its_node_with_a_generated_per_node_config() {
    use gpu_stack_core::operator::migdemand::{Decided, node_config};
    use gpu_stack_k8s::operator::migconfig::{MigDemandNode, MigDemandStatus};

    let op = operator(serde_json::json!({}));
    op.cluster().upsert_mig_config(mig_config(
        "dem",
        serde_json::json!({
            "nodeSelector": {"pool": "mig"},
            "mode": "Demand",
            "demand": {"minIntervalSeconds": 0, "batchSeconds": 1},
            "layouts": [
                {"gpuModel": "H100-SXM5-80GB", "profiles": {"1g.10gb": 7}},
                {"config": "all-1g.5gb"},
            ],
        }),
    ));
    converge(&op);
    assert_eq!(
        label(&op, "hgx-h100-0", MIG_CONFIG).as_deref(),
        Some("gpustack-dem"),
        "the starting layout first"
    );
    // What the demand controller records for one node.
    let decided = Decided {
        node: "hgx-h100-0".into(),
        at: 1_700_000_000,
        gpus: vec![
            (
                0,
                vec!["3g.40gb@0".parse().unwrap(), "3g.40gb@4".parse().unwrap()],
            ),
            (
                1,
                (0..7)
                    .map(|s| format!("1g.10gb@{s}").parse().unwrap())
                    .collect(),
            ),
        ],
    };
    let name = node_config("dem", &decided.gpus).name;
    let mut st = status(&op, "dem");
    st.demand = Some(MigDemandStatus {
        message: "changed the layout of 1 node(s)".into(),
        nodes: vec![MigDemandNode::from_decided("dem", &decided)],
        ..MigDemandStatus::default()
    });
    block_on(op.cluster().update_mig_config_status("dem", &st)).unwrap();
    converge(&op);
    assert_eq!(label(&op, "hgx-h100-0", MIG_CONFIG), Some(name.clone()));
    assert_eq!(
        label(&op, "dgx-a100-0", MIG_CONFIG).as_deref(),
        Some("gpustack-dem"),
        "an undecided node keeps the starting layout"
    );
    let file = mig_file(&op);
    let entry = file.get(&name).expect("the per-node config");
    assert_eq!(entry.entries.len(), 2);
    assert_eq!(
        entry.entries[0].devices,
        gpu_stack_core::migparted::Devices::Indices(vec![0])
    );
    assert!(file.get("gpustack-dem").is_some());
    let st = status(&op, "dem");
    let node = st.nodes.iter().find(|n| n.name == "hgx-h100-0").unwrap();
    assert_eq!(node.state, "Pending");
    assert!(node.reason.contains(&name), "{}", node.reason);
    assert!(st.demand.is_some(), "the status pass keeps the decision");
    report_applied(&op, "hgx-h100-0");
    converge(&op);
    let st = status(&op, "dem");
    let node = st.nodes.iter().find(|n| n.name == "hgx-h100-0").unwrap();
    assert_eq!(node.state, "Applied");
    assert_eq!(st.demand.unwrap().nodes[0].config_name, name);
}

fn placed(name: &str, placements: serde_json::Value) -> MigConfig {
    mig_config(
        name,
        serde_json::json!({
            "nodeSelector": {"pool": "mig"},
            "layouts": [
                {"gpuModel": "H100-SXM5-80GB", "profiles": {"1g.10gb": 2, "3g.40gb": 1},
                 "placements": placements},
                {"config": "all-1g.5gb"},
            ],
        }),
    )
}

#[test]
fn placements_reach_the_generated_config_and_the_mig_managers_target() {
    let op = operator(serde_json::json!({}));
    op.cluster().upsert_mig_config(placed(
        "placed",
        serde_json::json!([
            {"profile": "3g.40gb", "start": 4},
            {"profile": "1g.10gb", "start": 0},
            {"profile": "1g.10gb", "start": 1},
        ]),
    ));
    converge(&op);
    assert_eq!(
        label(&op, "hgx-h100-0", MIG_CONFIG).as_deref(),
        Some("gpustack-placed")
    );
    let file = mig_file(&op);
    let entry = file.get("gpustack-placed").unwrap();
    let h100 = entry
        .entries
        .iter()
        .find(|e| e.placements.is_some())
        .expect("the H100 entry carries its placements");
    assert_eq!(
        gpu_stack_core::mig::format_layout(h100.placements.as_deref().unwrap()),
        "3g.40gb@4,1g.10gb@0,1g.10gb@1"
    );
    let st = status(&op, "placed");
    assert_eq!((st.pending, st.invalid), (2, 0), "{st:?}");
}

#[test]
fn invalid_placements_change_no_node_and_say_why() {
    let op = operator(serde_json::json!({}));
    converge(&op);
    let before = label(&op, "hgx-h100-0", MIG_CONFIG);
    // 3g.40gb may start at 0 or 4 only.
    op.cluster().upsert_mig_config(placed(
        "misplaced",
        serde_json::json!([
            {"profile": "3g.40gb", "start": 2},
            {"profile": "1g.10gb", "start": 0},
            {"profile": "1g.10gb", "start": 1},
        ]),
    ));
    converge(&op);
    assert_eq!(label(&op, "hgx-h100-0", MIG_CONFIG), before);
    assert!(mig_file(&op).get("gpustack-misplaced").is_none());
    let st = status(&op, "misplaced");
    let error = st.conditions.iter().find(|c| c.type_ == "Error").unwrap();
    assert_eq!(error.reason, "InvalidSpec");
    assert!(
        error
            .message
            .contains("placements 3g.40gb@2,1g.10gb@0,1g.10gb@1")
            && error.message.contains("3g.40gb@2"),
        "{}",
        error.message
    );
    assert!(st.nodes.iter().all(|n| n.state == "Invalid"));
}
