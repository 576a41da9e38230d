//! Operator brain: golden tests of the desired state for representative
//! clusters, property tests (idempotence, no operand on CPU-only nodes), the
//! reconcile loop over the in-memory cluster, and the committed CRD.
//!
//! Set `GPU_STACK_BLESS=1` to rewrite the golden files and the CRD after an
//! intended change, then review the diff.
use std::collections::BTreeMap;
use std::path::PathBuf;

use futures::executor::block_on;
use gpu_stack_core::fleet::Fleet;
use gpu_stack_core::operator::labels::apply_patch;
use gpu_stack_k8s::operator::Operator;
use gpu_stack_k8s::operator::cluster::fleet::nodes_from_fleet;
use gpu_stack_k8s::operator::cluster::selector::pod_fits_node;
use gpu_stack_k8s::operator::cluster::{Cluster, InMemoryCluster, Object};
use gpu_stack_k8s::operator::clusterpolicy::status::state;
use gpu_stack_k8s::operator::clusterpolicy::{ClusterPolicy, ClusterPolicySpec};
use gpu_stack_k8s::operator::desired::{Desired, Options, desired_state};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use proptest::prelude::*;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn bless() -> bool {
    std::env::var_os("GPU_STACK_BLESS").is_some()
}

fn check_file(path: PathBuf, actual: &str) {
    if bless() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run with GPU_STACK_BLESS=1 to create it",
            path.display()
        )
    });
    assert!(
        expected == actual,
        "{} is out of date; run with GPU_STACK_BLESS=1 and review the diff.\n--- actual ---\n{actual}",
        path.display()
    );
}

fn policy(name: &str, spec: serde_json::Value, created_s: i64) -> ClusterPolicy {
    let spec: ClusterPolicySpec = serde_json::from_value(spec).unwrap();
    let mut p = ClusterPolicy::new(name, spec);
    p.metadata = ObjectMeta {
        name: Some(name.into()),
        uid: Some(format!("uid-{name}")),
        generation: Some(1),
        creation_timestamp: k8s_openapi::jiff::Timestamp::from_second(created_s)
            .ok()
            .map(Time),
        ..Default::default()
    };
    p
}

fn fleet_nodes(yaml: &str) -> Vec<Node> {
    nodes_from_fleet(&Fleet::from_yaml(yaml).unwrap())
}

const MIXED: &str = include_str!("../../examples/fleets/mixed.yaml");

/// A compact, reviewable view of a desired state.
fn summary(d: &Desired) -> String {
    /// One object: its key, and for a DaemonSet what a review looks at.
    #[derive(serde::Serialize)]
    struct Obj<'a> {
        key: String,
        #[serde(flatten)]
        ds: Option<Ds<'a>>,
    }
    #[derive(serde::Serialize)]
    #[serde(rename_all = "camelCase")]
    struct Ds<'a> {
        image: String,
        node_selector: &'a Option<BTreeMap<String, String>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        affinity: Option<&'a k8s_openapi::api::core::v1::Affinity>,
        init: Vec<String>,
        env: BTreeMap<String, String>,
        update_strategy: String,
    }
    #[derive(serde::Serialize)]
    #[serde(rename_all = "camelCase")]
    struct Summary<'a, L: serde::Serialize, S: serde::Serialize> {
        objects: Vec<Obj<'a>>,
        node_labels: &'a L,
        status: &'a S,
        delete: Vec<String>,
    }
    let objects = d
        .objects
        .iter()
        .map(|o| Obj {
            key: o.key().to_string(),
            ds: match o {
                Object::DaemonSet(ds) => {
                    let spec = ds.spec.template.spec.as_ref().unwrap();
                    Some(Ds {
                        image: spec.containers[0].image.clone().unwrap_or_default(),
                        node_selector: &spec.node_selector,
                        affinity: spec.affinity.as_ref(),
                        init: spec
                            .init_containers
                            .iter()
                            .flatten()
                            .map(|c| c.name.clone())
                            .collect(),
                        env: spec.containers[0]
                            .env
                            .iter()
                            .flatten()
                            .filter_map(|e| Some((e.name.clone(), e.value.clone()?)))
                            .collect(),
                        update_strategy: ds
                            .spec
                            .update_strategy
                            .as_ref()
                            .unwrap()
                            .type_
                            .clone()
                            .unwrap_or_default(),
                    })
                }
                _ => None,
            },
        })
        .collect();
    // One line per value: long object keys stay greppable, not folded.
    serde_saphyr::to_string_with_options(
        &Summary {
            objects,
            node_labels: &d.node_labels,
            status: &d.status,
            delete: d.delete.iter().map(|k| k.to_string()).collect(),
        },
        serde_saphyr::ser_options! { prefer_block_scalars: false },
    )
    .unwrap()
}

/// Rules the API server enforces on pod templates that the in-memory cluster
/// does not: Bidirectional mount propagation only in privileged containers, and
/// node field selectors with In/NotIn take exactly one value.
fn assert_admissible(d: &Desired) {
    for o in &d.objects {
        let Object::DaemonSet(ds) = o else { continue };
        let name = ds.metadata.name.clone().unwrap_or_default();
        let spec = ds.spec.template.spec.as_ref().unwrap();
        let all = spec
            .init_containers
            .iter()
            .flatten()
            .chain(spec.containers.iter());
        for c in all {
            let privileged = c
                .security_context
                .as_ref()
                .and_then(|s| s.privileged)
                .unwrap_or(false);
            for m in c.volume_mounts.iter().flatten() {
                assert!(
                    privileged || m.mount_propagation.as_deref() != Some("Bidirectional"),
                    "{name}/{}: Bidirectional mount {} in an unprivileged container",
                    c.name,
                    m.mount_path
                );
            }
        }
        let terms = spec
            .affinity
            .as_ref()
            .and_then(|a| a.node_affinity.as_ref())
            .and_then(|n| {
                n.required_during_scheduling_ignored_during_execution
                    .as_ref()
            })
            .map(|s| s.node_selector_terms.clone())
            .unwrap_or_default();
        for t in terms {
            for r in t.match_fields.iter().flatten() {
                if r.operator == "In" || r.operator == "NotIn" {
                    assert_eq!(
                        r.values.as_ref().map(Vec::len),
                        Some(1),
                        "{name}: field selector {} {} needs exactly one value",
                        r.key,
                        r.operator
                    );
                }
            }
        }
    }
}

fn golden(name: &str, p: &ClusterPolicy, nodes: &[Node]) -> Desired {
    let d = desired_state(p, nodes, &[], &Options::default());
    assert_admissible(&d);
    check_file(
        root().join("tests/golden").join(format!("{name}.yaml")),
        &summary(&d),
    );
    d
}

#[test]
fn golden_ubuntu_and_rhel_pools() {
    let d = golden(
        "ubuntu-rhel-pools",
        &policy("cp", serde_json::json!({}), 0),
        &fleet_nodes(MIXED),
    );
    let pools: Vec<&str> = d.driver.pools.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        pools,
        [
            "nvidia-driver-daemonset-rhel9",
            "nvidia-driver-daemonset-ubuntu22.04"
        ]
    );
    assert_eq!(
        d.driver.pools[0].image,
        "nvcr.io/nvidia/driver:595.91.07-rhel9"
    );
    assert_eq!(d.driver.pools[0].nodes, ["l4-rhel-0", "l4-rhel-1"]);
}

#[test]
fn golden_precompiled() {
    let p = policy(
        "cp",
        serde_json::json!({"driver": {"usePrecompiled": true, "version": "570"}}),
        0,
    );
    let d = golden("precompiled", &p, &fleet_nodes(MIXED));
    assert_eq!(d.driver.pools.len(), 3, "one pool per kernel and OS");
    assert!(
        d.driver
            .pools
            .iter()
            .any(|p| p.image == "nvcr.io/nvidia/driver:570-5.15.0-105-generic-ubuntu22.04")
    );
}

const MIG_AND_PAUSED: &str = r#"
nodes:
  - name: a100-mig
    labels:
      feature.node.kubernetes.io/system-os_release.ID: ubuntu
      feature.node.kubernetes.io/system-os_release.VERSION_ID: "22.04"
    gpus: [{ model: A100-SXM4-40GB, count: 8 }]
  - name: a100-configured
    labels:
      feature.node.kubernetes.io/system-os_release.ID: ubuntu
      feature.node.kubernetes.io/system-os_release.VERSION_ID: "22.04"
      nvidia.com/mig.config: all-1g.5gb
      nvidia.com/gpu.deploy.device-plugin: paused-for-mig-change
      nvidia.com/gpu.deploy.gpu-feature-discovery: paused-for-mig-change
    gpus: [{ model: A100-SXM4-40GB, count: 8 }]
  - name: h100-upgrading
    labels:
      feature.node.kubernetes.io/system-os_release.ID: ubuntu
      feature.node.kubernetes.io/system-os_release.VERSION_ID: "22.04"
      nvidia.com/gpu.deploy.driver: paused-for-driver-upgrade
      nvidia.com/gpu.deploy.dcgm-exporter: "false"
    gpus: [{ model: H100-SXM5-80GB, count: 8 }]
  - name: l4-host-driver
    labels:
      feature.node.kubernetes.io/system-os_release.ID: ubuntu
      feature.node.kubernetes.io/system-os_release.VERSION_ID: "22.04"
      nvidia.com/gpu.deploy.driver: pre-installed
    gpus: [{ model: L4 }]
  - name: opted-out
    labels:
      feature.node.kubernetes.io/system-os_release.ID: ubuntu
      feature.node.kubernetes.io/system-os_release.VERSION_ID: "22.04"
      nvidia.com/gpu.deploy.operands: "false"
      nvidia.com/gpu.deploy.driver: "true"
    gpus: [{ model: L4 }]
"#;

#[test]
fn golden_mig_nodes_and_paused_labels() {
    let d = golden(
        "mig-and-paused",
        &policy("cp", serde_json::json!({}), 0),
        &fleet_nodes(MIG_AND_PAUSED),
    );
    let a100 = &d.node_labels["a100-mig"];
    assert_eq!(
        a100["nvidia.com/mig.config"].as_deref(),
        Some("all-disabled")
    );
    assert_eq!(
        a100["nvidia.com/gpu.deploy.mig-manager"].as_deref(),
        Some("true")
    );
    let conf = &d.node_labels["a100-configured"];
    assert!(!conf.contains_key("nvidia.com/mig.config"));
    assert!(!conf.contains_key("nvidia.com/gpu.deploy.device-plugin"));
    let up = &d.node_labels["h100-upgrading"];
    assert!(!up.contains_key("nvidia.com/gpu.deploy.driver"));
    assert!(!up.contains_key("nvidia.com/gpu.deploy.dcgm-exporter"));
    assert!(!d.node_labels["l4-host-driver"].contains_key("nvidia.com/gpu.deploy.driver"));
    assert_eq!(
        d.node_labels["opted-out"]["nvidia.com/gpu.deploy.driver"], None,
        "gpu.deploy.operands=false removes deploy labels"
    );
}

#[test]
fn golden_disabled_components() {
    let p = policy(
        "cp",
        serde_json::json!({
            "dcgmExporter": {"enabled": false},
            "gfd": {"enabled": false},
            "driver": {"enabled": false},
            "nodeStatusExporter": {"enabled": true},
            "daemonsets": {"updateStrategy": "OnDelete", "priorityClassName": "gpu-critical"},
        }),
        0,
    );
    let d = golden("disabled-components", &p, &fleet_nodes(MIXED));
    let names: Vec<String> = d.objects.iter().map(|o| o.name().to_string()).collect();
    assert!(
        !names
            .iter()
            .any(|n| n.starts_with("nvidia-driver-daemonset"))
    );
    assert!(!names.contains(&"nvidia-dcgm-exporter".to_string()));
    assert!(!names.contains(&"gpu-feature-discovery".to_string()));
    assert!(names.contains(&"nvidia-node-status-exporter".to_string()));
}

#[test]
fn golden_impossible_driver() {
    let nodes = fleet_nodes(
        r#"
nodes:
  - name: h200-0
    labels:
      feature.node.kubernetes.io/system-os_release.ID: ubuntu
      feature.node.kubernetes.io/system-os_release.VERSION_ID: "24.04"
    gpus: [{ model: H200-SXM-141GB, count: 8 }]
  - name: b200-0
    labels:
      feature.node.kubernetes.io/system-os_release.ID: ubuntu
      feature.node.kubernetes.io/system-os_release.VERSION_ID: "24.04"
    gpus: [{ model: B200, count: 8 }]
  - name: a100-0
    labels:
      feature.node.kubernetes.io/system-os_release.ID: ubuntu
      feature.node.kubernetes.io/system-os_release.VERSION_ID: "24.04"
    gpus: [{ model: A100-SXM4-40GB }]
"#,
    );
    let p = policy(
        "cp",
        serde_json::json!({"driver": {"version": "550.127.05", "kernelModuleType": "proprietary"}}),
        0,
    );
    let d = golden("impossible-driver", &p, &nodes);
    assert_eq!(d.status.state, state::NOT_READY);
    let refused: Vec<&str> = d
        .status
        .refused_nodes
        .iter()
        .map(|r| r.node.as_str())
        .collect();
    assert_eq!(refused, ["b200-0"]);
    let err = d
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Error")
        .unwrap();
    assert_eq!(err.reason, "DriverIncompatible");
    assert!(err.message.contains("b200-0"), "{}", err.message);
    // The pool still serves the other nodes, and excludes the refused one by name.
    let pool = &d.driver.pools[0];
    assert_eq!(pool.nodes, ["a100-0", "h200-0"]);
    assert_eq!(pool.excluded, ["b200-0"]);
}

#[test]
fn invalid_spec_changes_nothing() {
    let nodes = fleet_nodes(MIXED);
    let good = desired_state(
        &policy("cp", serde_json::json!({}), 0),
        &nodes,
        &[],
        &Options::default(),
    );
    let current: Vec<Object> = good.objects.clone();
    let bad = policy(
        "cp",
        serde_json::json!({"mig": {"strategy": "everything"}}),
        0,
    );
    let d = desired_state(&bad, &nodes, &current, &Options::default());
    assert!(!d.has_changes());
    let err = d
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Error")
        .unwrap();
    assert!(err.message.contains("spec.mig.strategy"), "{}", err.message);
}

#[test]
fn crd_is_up_to_date() {
    let yaml = gpu_stack_k8s::operator::clusterpolicy::crd_yaml().unwrap();
    assert!(yaml.contains("x-kubernetes-preserve-unknown-fields"));
    assert!(yaml.contains("subresources"));
    check_file(
        root().join("../deploy/crds/nvidia.com_clusterpolicies.yaml"),
        &yaml,
    );
}

#[test]
fn reconcile_loop_converges_and_goes_ready() {
    let cluster = InMemoryCluster::new();
    for n in fleet_nodes(MIXED) {
        cluster.upsert_node(n);
    }
    cluster.upsert_policy(policy("newer", serde_json::json!({}), 200));
    cluster.upsert_policy(policy("older", serde_json::json!({}), 100));
    let op = Operator::new(cluster);
    let passes = block_on(op.converge(5)).unwrap();
    assert!(passes.len() >= 2);
    assert_eq!(passes[0].policy.as_deref(), Some("older"));
    assert_eq!(
        op.cluster().policy("newer").unwrap().status.unwrap().state,
        state::IGNORED
    );
    assert_eq!(
        op.cluster().policy("older").unwrap().status.unwrap().state,
        state::NOT_READY
    );
    op.cluster().settle();
    block_on(op.converge(5)).unwrap();
    let st = op.cluster().policy("older").unwrap().status.unwrap();
    assert_eq!(st.state, state::READY, "{st:?}");
    // A converged cluster is not written to.
    let writes = op.cluster().stats().writes;
    let r = block_on(op.reconcile_once()).unwrap();
    assert!(!r.changed());
    assert_eq!(op.cluster().stats().writes, writes);
    // No operand lands on a CPU-only node.
    let nodes = block_on(op.cluster().list_nodes()).unwrap();
    for o in op.cluster().objects() {
        if let Object::DaemonSet(ds) = &o {
            let spec = ds.spec.template.spec.as_ref().unwrap();
            for n in nodes
                .iter()
                .filter(|n| n.metadata.name.as_deref().unwrap().starts_with("cpu-"))
            {
                assert!(
                    !pod_fits_node(spec, n),
                    "{} selects {:?}",
                    o.name(),
                    n.metadata.name
                );
            }
        }
    }
}

#[test]
fn gpu_nodes_tainted_against_the_operands_leave_the_policy_ready() {
    // Every GPU node carries a NoSchedule taint no operand tolerates (the
    // default tolerations cover `nvidia.com/gpu` only): each DaemonSet's
    // controller rightly schedules nothing, and reports 0 of 0.
    let cluster = InMemoryCluster::new();
    for mut n in fleet_nodes(MIXED) {
        if !n.metadata.name.as_deref().unwrap_or("").starts_with("cpu-") {
            n.spec.get_or_insert_with(Default::default).taints = Some(vec![
                k8s_openapi::api::core::v1::Taint {
                    key: "dedicated".into(),
                    value: Some("training".into()),
                    effect: "NoSchedule".into(),
                    ..Default::default()
                },
                k8s_openapi::api::core::v1::Taint {
                    key: "spot".into(),
                    effect: "PreferNoSchedule".into(),
                    ..Default::default()
                },
            ]);
        }
        cluster.upsert_node(n);
    }
    cluster.upsert_policy(policy("cluster-policy", serde_json::json!({}), 100));
    let op = Operator::new(cluster);
    block_on(op.converge(5)).unwrap();
    op.cluster().settle();
    block_on(op.converge(5)).unwrap();
    let daemonsets: Vec<_> = op
        .cluster()
        .objects()
        .into_iter()
        .filter_map(|o| o.as_daemonset().cloned())
        .collect();
    assert!(!daemonsets.is_empty());
    for ds in &daemonsets {
        let st = ds.status.as_ref().unwrap();
        assert_eq!(st.desired_number_scheduled, 0, "{:?}", ds.metadata.name);
    }
    let st = op
        .cluster()
        .policy("cluster-policy")
        .unwrap()
        .status
        .unwrap();
    assert_eq!(st.state, state::READY, "{st:?}");
}

// ---- properties ----

fn arb_node(i: usize) -> impl Strategy<Value = Node> {
    let os = prop::sample::select(vec![
        Some(("ubuntu", "22.04")),
        Some(("ubuntu", "24.04")),
        Some(("rhel", "9.4")),
        Some(("rhel", "8.10")),
        None,
    ]);
    let gpu = prop::sample::select(vec![
        None,
        Some("A100-SXM4-40GB"),
        Some("H100-SXM5-80GB"),
        Some("H200-SXM-141GB"),
        Some("B200"),
        Some("L4"),
        Some("V100-SXM2-16GB"),
    ]);
    let deploy = prop::sample::select(vec![
        None,
        Some("true"),
        Some("false"),
        Some("paused-for-mig-change"),
        Some("paused-for-driver-upgrade"),
        Some("pre-installed"),
    ]);
    (os, gpu, deploy, any::<bool>(), any::<bool>()).prop_map(move |(os, gpu, deploy, opt_out, kernel)| {
        let mut yaml = format!("nodes:\n  - name: n{i}\n    labels: {{");
        if let Some((id, v)) = os {
            yaml.push_str(&format!(
                "feature.node.kubernetes.io/system-os_release.ID: {id}, feature.node.kubernetes.io/system-os_release.VERSION_ID: \"{v}\", "
            ));
        }
        if kernel {
            yaml.push_str("feature.node.kubernetes.io/kernel-version.full: 5.15.0-1-generic, ");
        }
        if let Some(d) = deploy {
            yaml.push_str(&format!("nvidia.com/gpu.deploy.device-plugin: \"{d}\", nvidia.com/gpu.deploy.driver: \"{d}\", "));
        }
        if opt_out {
            yaml.push_str("nvidia.com/gpu.deploy.operands: \"false\", ");
        }
        yaml.push_str("}\n");
        if let Some(g) = gpu {
            yaml.push_str(&format!("    gpus: [{{ model: {g} }}]\n"));
        }
        let mut nodes = fleet_nodes(&yaml);
        let mut n = nodes.remove(0);
        // CPU-only nodes sometimes carry stale operator labels.
        if gpu.is_none() && deploy.is_some() {
            n.metadata.labels.as_mut().unwrap().insert("nvidia.com/gpu.present".into(), "true".into());
        }
        n
    })
}

fn arb_nodes() -> impl Strategy<Value = Vec<Node>> {
    (0usize..12).prop_flat_map(|len| (0..len).map(arb_node).collect::<Vec<_>>())
}

fn arb_policy() -> impl Strategy<Value = ClusterPolicy> {
    (
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        prop::sample::select(vec!["470.256.02", "535.183.01", "550.127.05", "570.124.06", "595.91.07", "sha256:0123"]),
        prop::sample::select(vec!["auto", "open", "proprietary"]),
        any::<bool>(),
    )
        .prop_map(|(driver, dcgm, nse, version, kmt, precompiled)| {
            let precompiled = precompiled && !version.starts_with("sha256:");
            policy(
                "cp",
                serde_json::json!({
                    "driver": {"enabled": driver, "version": version, "kernelModuleType": kmt, "usePrecompiled": precompiled},
                    "dcgmExporter": {"enabled": dcgm},
                    "nodeStatusExporter": {"enabled": nse},
                }),
                0,
            )
        })
}

/// Applies a desired state to plain data, as the reconcile loop would.
fn apply(d: &Desired, nodes: &mut [Node], current: &mut Vec<Object>) {
    for n in nodes.iter_mut() {
        if let Some(p) = d.node_labels.get(n.metadata.name.as_deref().unwrap()) {
            apply_patch(n.metadata.labels.get_or_insert_with(BTreeMap::new), p);
        }
    }
    current.retain(|o| !d.delete.contains(&o.key()));
    for o in &d.apply {
        current.retain(|c| c.key() != o.key());
        current.push(o.clone());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn applying_the_result_and_recomputing_changes_nothing(mut nodes in arb_nodes(), p in arb_policy(), p2 in arb_policy()) {
        let opts = Options::default();
        let mut current = Vec::new();
        // Start from another policy's state, then move to `p`.
        let d0 = desired_state(&p2, &nodes, &current, &opts);
        apply(&d0, &mut nodes, &mut current);
        let d1 = desired_state(&p, &nodes, &current, &opts);
        apply(&d1, &mut nodes, &mut current);
        let d2 = desired_state(&p, &nodes, &current, &opts);
        prop_assert!(!d2.has_changes(), "apply {:?} delete {:?} labels {:?}", d2.apply.iter().map(|o| o.key()).collect::<Vec<_>>(), d2.delete, d2.node_labels);
        prop_assert_eq!(d2.objects.len(), current.len());
    }

    #[test]
    fn no_daemonset_selects_a_cpu_only_node(mut nodes in arb_nodes(), p in arb_policy()) {
        let opts = Options::default();
        let mut current = Vec::new();
        let d = desired_state(&p, &nodes, &current, &opts);
        apply(&d, &mut nodes, &mut current);
        for o in &current {
            if let Object::DaemonSet(ds) = o {
                let spec = ds.spec.template.spec.as_ref().unwrap();
                for n in &nodes {
                    let gpu = n.metadata.labels.as_ref().unwrap().get("feature.node.kubernetes.io/pci-10de.present").is_some();
                    if !gpu {
                        prop_assert!(!pod_fits_node(spec, n), "{} selects CPU node {:?}", o.name(), n.metadata.name);
                    }
                }
            }
        }
    }
}

#[test]
fn run_loop_reconciles_on_each_trigger_and_stops_when_triggers_end() {
    let cluster = InMemoryCluster::new();
    cluster.upsert_policy(policy("cp", serde_json::json!({}), 0));
    let op = Operator::new(cluster);
    let mut reports = Vec::new();
    // Two triggers: a node joins between them.
    let triggers = futures::stream::iter(vec![(), ()]);
    block_on(op.run(triggers, |r| {
        reports.push(r.unwrap());
    }));
    assert_eq!(reports.len(), 3);
    for n in fleet_nodes(MIXED) {
        op.cluster().upsert_node(n);
    }
    // Nodes joined after the loop ended: the next pass picks them up, then settles.
    let r = block_on(op.reconcile_once()).unwrap();
    assert_eq!(r.labelled.len(), 4);
    assert!(
        r.applied
            .iter()
            .any(|k| k.name == "nvidia-driver-daemonset-rhel9")
    );
    let r = block_on(op.reconcile_once()).unwrap();
    assert!(!r.changed(), "{r:?}");
}

#[test]
fn mig_manager_service_account_may_patch_its_node_list_pods_and_record_events() {
    let d = desired_state(
        &policy("cp", serde_json::json!({}), 0),
        &fleet_nodes(MIXED),
        &[],
        &Options::default(),
    );
    let role = d
        .objects
        .iter()
        .find_map(|o| match o {
            Object::ClusterRole(r) if r.metadata.name.as_deref() == Some("nvidia-mig-manager") => {
                Some(r.clone())
            }
            _ => None,
        })
        .expect("a ClusterRole for the MIG manager");
    let allows = |group: &str, resource: &str, verb: &str| {
        role.rules.iter().flatten().any(|r| {
            r.api_groups.iter().flatten().any(|g| g == group)
                && r.resources.iter().flatten().any(|x| x == resource)
                && r.verbs.iter().any(|v| v == verb)
        })
    };
    for (group, resource, verb) in [
        ("", "nodes", "get"),
        ("", "nodes", "patch"),
        ("", "pods", "list"),
        ("events.k8s.io", "events", "create"),
    ] {
        assert!(allows(group, resource, verb), "{verb} {group}/{resource}");
    }
    let bound = d.objects.iter().any(|o| match o {
        Object::ClusterRoleBinding(b) => {
            b.role_ref.name == "nvidia-mig-manager"
                && b.subjects
                    .iter()
                    .flatten()
                    .any(|s| s.kind == "ServiceAccount" && s.name == "nvidia-mig-manager")
        }
        _ => false,
    });
    assert!(bound, "binding to the nvidia-mig-manager ServiceAccount");
}
