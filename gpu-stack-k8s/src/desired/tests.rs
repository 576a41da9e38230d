use super::*;

#[test]
fn stable_hash_is_stable() {
    assert_eq!(stable_hash(b""), "cbf29ce484222325");
    assert_ne!(stable_hash(b"a"), stable_hash(b"b"));
}

fn daemonset_selecting(selector: &[(&str, &str)], desired: i32, ready: i32) -> Object {
    let ds: k8s_openapi::api::apps::v1::DaemonSet = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "ds", "generation": 1},
        "spec": {
            "selector": {"matchLabels": {"app": "ds"}},
            "template": {"spec": {
                "nodeSelector": selector.iter().copied().collect::<BTreeMap<_, _>>(),
                "containers": [],
            }},
        },
        "status": {
            "currentNumberScheduled": desired, "numberMisscheduled": 0,
            "desiredNumberScheduled": desired, "numberReady": ready,
            "numberAvailable": ready, "updatedNumberScheduled": desired,
            "observedGeneration": 1,
        },
    }))
    .expect("a valid DaemonSet");
    Object::DaemonSet(ds)
}

fn labelled(name: &str, labels: &[(&str, &str)]) -> (String, Cow<'static, Labels>) {
    let l: Labels = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    (name.to_string(), Cow::Owned(l))
}

#[test]
fn a_daemonset_wanting_no_pods_is_ready_only_if_it_selects_no_node() {
    let nodes = vec![
        labelled("gpu-1", &[("deploy", "true")]),
        labelled("gpu-2", &[("deploy", "true")]),
        labelled("cpu-1", &[("deploy", "false")]),
    ];
    let fresh = daemonset_selecting(&[("deploy", "true")], 0, 0);
    assert_eq!(selected_nodes(&fresh, &nodes), 2);
    assert!(!daemonset_ready(&fresh, || selected_nodes(&fresh, &nodes)));
    let nowhere = daemonset_selecting(&[("deploy", "nowhere")], 0, 0);
    assert!(daemonset_ready(&nowhere, || selected_nodes(
        &nowhere, &nodes
    )));
    let rolled_out = daemonset_selecting(&[("deploy", "true")], 2, 2);
    assert!(daemonset_ready(&rolled_out, || 2));
    let rolling = daemonset_selecting(&[("deploy", "true")], 2, 1);
    assert!(!daemonset_ready(&rolling, || 2));
}
