//! `nodeAgent.enabled`: one DaemonSet for the hosted components.
use super::*;
use crate::operator::cluster::selector::pod_selects_node;
use render::NODE_AGENT_NAME;

fn desired_for(spec: serde_json::Value) -> Desired {
    let policy = policy_with(spec);
    desired_state(&policy, &[mig_gpu_node("gpu-1")], &[], &Options::default())
}

fn daemonset_names(d: &Desired) -> Vec<String> {
    d.objects
        .iter()
        .filter(|o| o.as_daemonset().is_some())
        .map(|o| o.key().name)
        .collect()
}

fn agent_container(d: &Desired) -> k8s_openapi::api::core::v1::Container {
    let ds = daemonset_named(d, NODE_AGENT_NAME).expect("the node agent's DaemonSet");
    pod_of(ds).containers[0].clone()
}

/// The agent's command line split into its components' parts.
fn segments(c: &k8s_openapi::api::core::v1::Container) -> Vec<Vec<String>> {
    let args = c.args.clone().unwrap_or_default();
    args.split(|a| a == "--")
        .skip(1)
        .map(<[String]>::to_vec)
        .collect()
}

#[test]
fn the_node_agent_replaces_the_hosted_daemonsets() {
    let d = desired_for(serde_json::json!({"nodeAgent": {"enabled": true}}));
    let names = daemonset_names(&d);
    for c in [
        Component::DevicePlugin,
        Component::GpuFeatureDiscovery,
        Component::DcgmExporter,
        Component::MigManager,
        Component::OperatorValidator,
    ] {
        assert!(
            !names.contains(&c.daemonset_name().to_string()),
            "{names:?}"
        );
    }
    assert!(names.contains(&NODE_AGENT_NAME.to_string()), "{names:?}");
    // The MIG manager still reads the operator's mig-parted ConfigMap.
    assert!(
        d.objects
            .iter()
            .any(|o| o.key().name == "default-mig-parted-config")
    );
    let main = agent_container(&d);
    assert!(
        main.image
            .as_deref()
            .is_some_and(|i| i.contains("/gpu-node-agent:"))
    );
    let segs = segments(&main);
    let binaries: Vec<&str> = segs.iter().map(|s| s[0].as_str()).collect();
    assert_eq!(
        binaries,
        [
            "gpu-device-plugin",
            "gpu-feature-discovery",
            "gpu-exporter",
            "gpu-mig-manager",
            "validator"
        ]
    );
    // The validator's part is its pod's check chain.
    assert_eq!(
        segs[4][..4],
        strings(&[
            "validator",
            "--component",
            "driver,toolkit,cuda,plugin",
            "--wait"
        ])
    );
    // Each component's own variables go to it alone; the shared node name
    // is the container's.
    assert!(segs[3].contains(&"CONFIG_FILE=/mig-parted-config/config.yaml".to_string()));
    assert!(segs[0].contains(&"MIG_STRATEGY=single".to_string()));
    assert!(segs[1].contains(&"--publish".to_string()), "{:?}", segs[1]);
    let env: Vec<&str> = main.env.iter().flatten().map(|e| e.name.as_str()).collect();
    assert_eq!(env, ["NODE_NAME"]);
    // The pod can do what each component's could.
    let pod = pod_of(daemonset_named(&d, NODE_AGENT_NAME).expect("DaemonSet"));
    assert_eq!(
        main.security_context.as_ref().and_then(|s| s.privileged),
        Some(true)
    );
    assert_eq!(pod.host_pid, Some(true));
    assert_eq!(pod.service_account_name.as_deref(), Some(NODE_AGENT_NAME));
    let paths: Vec<(&str, bool)> = main
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| (m.mount_path.as_str(), m.read_only == Some(true)))
        .collect();
    for want in [
        ("/var/lib/kubelet/device-plugins", false),
        ("/var/lib/kubelet/pod-resources", true),
        ("/mig-parted-config", true),
        ("/host", false),
        ("/driver-root", true),
        ("/run/nvidia/validations", false),
    ] {
        assert!(paths.contains(&want), "{want:?} not in {paths:?}");
    }
    // The validator writes the status files other pods' gates wait for.
    let validations = main
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == "/run/nvidia/validations")
        .expect("the validations mount");
    assert_eq!(
        validations.mount_propagation.as_deref(),
        Some("Bidirectional")
    );
    // The agent runs the gates itself, and says when all is up.
    assert!(pod.init_containers.is_none(), "{:?}", pod.init_containers);
    let probe = main
        .readiness_probe
        .as_ref()
        .and_then(|p| p.exec.as_ref())
        .and_then(|e| e.command.clone());
    assert_eq!(
        probe,
        Some(strings(&["/usr/bin/gpu-node-agent", "--check-ready"]))
    );
    for v in pod.volumes.iter().flatten() {
        assert!(
            pod.init_containers
                .iter()
                .flatten()
                .chain(&pod.containers)
                .flat_map(|c| c.volume_mounts.iter().flatten())
                .any(|m| m.name == v.name),
            "{} unmounted",
            v.name
        );
    }
    // One role with every component's access, each rule once.
    let role = d
        .objects
        .iter()
        .find_map(|o| match o {
            Object::ClusterRole(r) if o.key().name == NODE_AGENT_NAME => Some(r.clone()),
            _ => None,
        })
        .expect("the node agent's ClusterRole");
    let rules = role.rules.unwrap_or_default();
    let nodes = rules
        .iter()
        .find(|r| r.resources.as_deref() == Some(&["nodes".to_string()][..]))
        .expect("a nodes rule");
    assert!(nodes.verbs.contains(&"patch".to_string()));
    assert!(rules.iter().any(|r| {
        r.resources.as_deref() == Some(&["pods".to_string()][..])
            && r.verbs.contains(&"delete".to_string())
    }));
    assert_eq!(
        rules
            .iter()
            .filter(|r| r.resources.as_deref() == Some(&["nodes".to_string()][..]))
            .count(),
        1
    );
}

#[test]
fn the_pod_stays_while_any_hosted_label_is_true() {
    let d = desired_for(serde_json::json!({"nodeAgent": {"enabled": true}}));
    let pod = pod_of(daemonset_named(&d, NODE_AGENT_NAME).expect("DaemonSet"));
    let labels = |values: [&str; 4]| -> Labels {
        [
            "device-plugin",
            "gpu-feature-discovery",
            "dcgm-exporter",
            "mig-manager",
        ]
        .iter()
        .zip(values)
        .map(|(c, v)| (format!("nvidia.com/gpu.deploy.{c}"), v.to_string()))
        .collect()
    };
    let paused = "paused-for-mig-change";
    // The MIG manager pausing its clients keeps the pod (and itself) running.
    assert!(pod_selects_node(
        pod,
        "gpu-1",
        &labels([paused, paused, paused, "true"])
    ));
    assert!(pod_selects_node(
        pod,
        "gpu-1",
        &labels(["false", "false", "true", "false"])
    ));
    assert!(!pod_selects_node(
        pod,
        "gpu-1",
        &labels(["false", paused, "false", "false"])
    ));
}

#[test]
fn a_component_of_another_image_keeps_its_own_daemonset() {
    let d = desired_for(serde_json::json!({
        "nodeAgent": {"enabled": true},
        "devicePlugin": {"repository": "nvcr.io/nvidia", "image": "k8s-device-plugin", "version": "v0.17.0"},
        "migManager": {"enabled": false},
    }));
    let names = daemonset_names(&d);
    assert!(names.contains(&"nvidia-device-plugin-daemonset".to_string()));
    assert!(!names.contains(&"nvidia-mig-manager".to_string()));
    let segs = segments(&agent_container(&d));
    let binaries: Vec<&str> = segs.iter().map(|s| s[0].as_str()).collect();
    assert_eq!(
        binaries,
        ["gpu-feature-discovery", "gpu-exporter", "validator"]
    );
}

#[test]
fn without_the_validator_the_pods_init_containers_run_the_gates() {
    let d = desired_for(serde_json::json!({
        "nodeAgent": {"enabled": true},
        "validator": {"repository": "nvcr.io/nvidia/cloud-native", "image": "gpu-operator-validator", "version": "v25.10.0"},
    }));
    assert!(daemonset_names(&d).contains(&"nvidia-operator-validator".to_string()));
    let pod = pod_of(daemonset_named(&d, NODE_AGENT_NAME).expect("DaemonSet"));
    let init: Vec<&str> = pod
        .init_containers
        .iter()
        .flatten()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(init, ["driver-validation", "toolkit-validation"]);
    assert!(pod.containers[0].readiness_probe.is_none());
    let segs = segments(&pod.containers[0]);
    assert!(segs.iter().all(|s| s[0] != "validator"), "{segs:?}");
}

#[test]
fn the_policys_args_and_env_reach_the_agent_and_each_component() {
    let d = desired_for(serde_json::json!({
        "nodeAgent": {
            "enabled": true,
            "args": ["--log-format=json"],
            "env": [{"name": "RUST_LOG", "value": "debug"}],
            "resources": {"limits": {"memory": "128Mi"}},
        },
        "devicePlugin": {"env": [{"name": "GPU_STACK_FLEET", "value": "/f.json"}]},
        "dcgmExporter": {"args": ["--collect-interval=1000"]},
    }));
    let main = agent_container(&d);
    let args = main.args.clone().unwrap_or_default();
    assert_eq!(args[..2], strings(&["--log-format=json", "--"]));
    let segs = segments(&main);
    assert!(segs[0].contains(&"GPU_STACK_FLEET=/f.json".to_string()));
    assert!(segs[2].contains(&"--collect-interval=1000".to_string()));
    assert!(
        main.env
            .iter()
            .flatten()
            .any(|e| e.name == "RUST_LOG" && e.value.as_deref() == Some("debug"))
    );
    assert!(main.resources.is_some());
}

#[test]
fn switching_the_node_agent_on_and_off_swaps_the_daemonsets() {
    let policy = policy_with(serde_json::json!({}));
    let nodes = [mig_gpu_node("gpu-1")];
    let separate = desired_state(&policy, &nodes, &[], &Options::default());
    let combined_policy = policy_with(serde_json::json!({"nodeAgent": {"enabled": true}}));
    let combined = desired_state(
        &combined_policy,
        &nodes,
        &separate.objects,
        &Options::default(),
    );
    let deleted: Vec<&str> = combined.delete.iter().map(|k| k.name.as_str()).collect();
    for name in [
        "nvidia-device-plugin-daemonset",
        "nvidia-mig-manager",
        "gpu-feature-discovery",
        "nvidia-dcgm-exporter",
    ] {
        assert!(deleted.contains(&name), "{name} not deleted: {deleted:?}");
    }
    assert!(!deleted.contains(&"default-mig-parted-config"));
    assert!(
        combined
            .apply
            .iter()
            .any(|o| o.key().name == NODE_AGENT_NAME)
    );
    // Applied, the combined state asks for nothing more.
    let again = desired_state(
        &combined_policy,
        &nodes,
        &combined.objects,
        &Options::default(),
    );
    assert!(again.apply.is_empty() && again.delete.is_empty());
    // And back: the agent's objects go, the components' come back.
    let back = desired_state(&policy, &nodes, &combined.objects, &Options::default());
    assert!(back.delete.iter().any(|k| k.name == NODE_AGENT_NAME));
    assert!(
        back.apply
            .iter()
            .any(|o| o.key().name == "nvidia-device-plugin-daemonset")
    );
}

#[test]
fn an_invalid_node_agent_section_is_refused() {
    let d = desired_for(serde_json::json!({
        "nodeAgent": {"enabled": true, "imagePullPolicy": "Sometimes"},
    }));
    assert!(d.apply.is_empty());
    assert!(
        d.status
            .conditions
            .iter()
            .any(|c| c.type_ == "Error" && c.message.contains("spec.nodeAgent.imagePullPolicy"))
    );
}
