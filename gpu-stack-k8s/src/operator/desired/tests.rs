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
    let untainted: Vec<&[Taint]> = vec![&[]; nodes.len()];
    let fresh = daemonset_selecting(&[("deploy", "true")], 0, 0);
    assert_eq!(selected_nodes(&fresh, &nodes, &untainted), 2);
    assert!(!daemonset_ready(&fresh, || selected_nodes(
        &fresh, &nodes, &untainted
    )));
    let nowhere = daemonset_selecting(&[("deploy", "nowhere")], 0, 0);
    assert!(daemonset_ready(&nowhere, || selected_nodes(
        &nowhere, &nodes, &untainted
    )));
    let rolled_out = daemonset_selecting(&[("deploy", "true")], 2, 2);
    assert!(daemonset_ready(&rolled_out, || 2));
    let rolling = daemonset_selecting(&[("deploy", "true")], 2, 1);
    assert!(!daemonset_ready(&rolling, || 2));
}

fn taint(key: &str, effect: &str) -> Taint {
    Taint {
        key: key.into(),
        value: Some("x".into()),
        effect: effect.into(),
        ..Default::default()
    }
}

#[test]
fn selected_nodes_whose_taints_are_not_tolerated_hold_no_daemonset_back() {
    let nodes = vec![
        labelled("gpu-1", &[("deploy", "true")]),
        labelled("gpu-2", &[("deploy", "true")]),
    ];
    let fresh = daemonset_selecting(&[("deploy", "true")], 0, 0);
    let no_schedule = [taint("dedicated", "NoSchedule")];
    let no_execute = [taint("maintenance", "NoExecute")];
    let prefer = [taint("dedicated", "PreferNoSchedule")];
    // Every selected node is tainted away: 0 of 0 is the truth, and ready.
    let tainted: Vec<&[Taint]> = vec![&no_schedule, &no_execute];
    assert_eq!(selected_nodes(&fresh, &nodes, &tainted), 0);
    assert!(daemonset_ready(&fresh, || selected_nodes(
        &fresh, &nodes, &tainted
    )));
    // PreferNoSchedule does not keep a DaemonSet pod off: still waiting.
    let preferred: Vec<&[Taint]> = vec![&no_schedule, &prefer];
    assert_eq!(selected_nodes(&fresh, &nodes, &preferred), 1);
    assert!(!daemonset_ready(&fresh, || selected_nodes(
        &fresh, &nodes, &preferred
    )));
}

proptest::proptest! {
    /// For any taints on any selected nodes, a DaemonSet reporting 0 of 0 is
    /// ready exactly when none of those nodes is free of NoSchedule and
    /// NoExecute taints (the pod template here tolerates nothing).
    #[test]
    fn zero_of_zero_is_ready_iff_no_selected_node_is_schedulable(
        effects in proptest::collection::vec(
            proptest::collection::vec(
                proptest::sample::select(vec!["NoSchedule", "NoExecute", "PreferNoSchedule"]),
                0..3,
            ),
            1..6,
        ),
    ) {
        let nodes: Vec<(String, Cow<'static, Labels>)> = (0..effects.len())
            .map(|i| labelled(&format!("gpu-{i}"), &[("deploy", "true")]))
            .collect();
        let taints: Vec<Vec<Taint>> = effects
            .iter()
            .map(|es| es.iter().map(|e| taint("k", e)).collect())
            .collect();
        let views: Vec<&[Taint]> = taints.iter().map(Vec::as_slice).collect();
        let fresh = daemonset_selecting(&[("deploy", "true")], 0, 0);
        let schedulable = effects
            .iter()
            .filter(|es| es.iter().all(|e| *e == "PreferNoSchedule"))
            .count();
        proptest::prop_assert_eq!(selected_nodes(&fresh, &nodes, &views), schedulable);
        proptest::prop_assert_eq!(
            daemonset_ready(&fresh, || selected_nodes(&fresh, &nodes, &views)),
            schedulable == 0
        );
    }
}

fn policy_with(spec: serde_json::Value) -> ClusterPolicy {
    let spec: crate::operator::clusterpolicy::ClusterPolicySpec =
        serde_json::from_value(spec).expect("a valid spec");
    ClusterPolicy::new("cluster-policy", spec)
}

fn pod_of(obj: &Object) -> &k8s_openapi::api::core::v1::PodSpec {
    obj.as_daemonset()
        .and_then(|d| d.spec.template.spec.as_ref())
        .expect("a DaemonSet with a pod template")
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// Every command a container of a gpu-stack image runs: its command and
/// args, its probes' and hooks' exec commands.
fn commands(c: &k8s_openapi::api::core::v1::Container) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    out.extend(c.command.clone());
    out.extend(c.args.clone());
    for p in [&c.readiness_probe, &c.liveness_probe, &c.startup_probe]
        .into_iter()
        .flatten()
    {
        out.extend(p.exec.as_ref().and_then(|e| e.command.clone()));
    }
    if let Some(l) = &c.lifecycle {
        for h in [&l.pre_stop, &l.post_start].into_iter().flatten() {
            out.extend(h.exec.as_ref().and_then(|e| e.command.clone()));
        }
    }
    out
}

#[test]
fn gpu_stack_images_run_no_shell() {
    let policy = policy_with(serde_json::json!({"nodeStatusExporter": {"enabled": true}}));
    let ctx = render::RenderContext {
        policy: &policy,
        namespace: "gpu-operator",
    };
    // The driver runs NVIDIA's driver image, which has a shell.
    for c in Component::ALL
        .into_iter()
        .filter(|c| *c != Component::Driver)
    {
        let ds = render::daemonset(&ctx, c, None);
        let pod = pod_of(&ds);
        for container in pod.init_containers.iter().flatten().chain(&pod.containers) {
            for cmd in commands(container) {
                assert!(
                    !cmd.iter().any(|a| a == "sh" || a == "/bin/sh" || a == "-c"),
                    "{c}/{}: {cmd:?} needs a shell",
                    container.name
                );
            }
        }
        // Every gate runs the validator image's entrypoint with a subcommand.
        for gate in pod.init_containers.iter().flatten() {
            assert_eq!(gate.command, None, "{c}/{}", gate.name);
            let args = gate.args.clone().unwrap_or_default();
            assert_eq!(
                args.first().map(String::as_str),
                Some("validator"),
                "{c}/{}",
                gate.name
            );
        }
    }
}

#[test]
fn wait_gates_wait_with_the_validator_forever_and_unprivileged() {
    let policy = policy_with(serde_json::json!({}));
    let ctx = render::RenderContext {
        policy: &policy,
        namespace: "gpu-operator",
    };
    let ds = render::daemonset(&ctx, Component::DevicePlugin, None);
    let gate = &pod_of(&ds).init_containers.as_ref().expect("a gate")[0];
    assert_eq!(gate.name, "toolkit-validation");
    assert_eq!(
        gate.args.clone().unwrap_or_default(),
        strings(&[
            "validator",
            "--wait-only",
            "--component",
            "toolkit",
            "--timeout",
            "never",
            "--poll-interval-ms",
            "5000"
        ])
    );
    assert_eq!(gate.security_context, None);
    let mounts = gate.volume_mounts.clone().unwrap_or_default();
    assert_eq!(mounts.len(), 1);
    assert_eq!(mounts[0].read_only, Some(true));
    assert_eq!(
        mounts[0].mount_propagation.as_deref(),
        Some("HostToContainer")
    );
    assert_eq!(
        gate.env, None,
        "a wait needs no node name, GPU or API access"
    );
}

#[test]
fn the_exporter_is_probed_on_health_as_nvidia_renders_it() {
    let policy = policy_with(serde_json::json!({}));
    let ctx = render::RenderContext {
        policy: &policy,
        namespace: "gpu-operator",
    };
    let ds = render::daemonset(&ctx, Component::DcgmExporter, None);
    let main = &pod_of(&ds).containers[0];
    for (probe, period) in [(&main.liveness_probe, 5), (&main.readiness_probe, 10)] {
        let probe = probe.as_ref().expect("a probe");
        let get = probe.http_get.as_ref().expect("an HTTP probe");
        assert_eq!(get.path.as_deref(), Some("/health"));
        assert_eq!(
            get.port,
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(9400)
        );
        assert_eq!(
            (
                probe.initial_delay_seconds,
                probe.period_seconds,
                probe.failure_threshold,
                probe.timeout_seconds
            ),
            (Some(45), Some(period), Some(3), Some(1))
        );
    }
}

#[test]
fn validator_holds_and_is_ready_while_its_status_files_exist() {
    let policy = policy_with(serde_json::json!({}));
    let ctx = render::RenderContext {
        policy: &policy,
        namespace: "gpu-operator",
    };
    let ds = render::daemonset(&ctx, Component::OperatorValidator, None);
    let main = &pod_of(&ds).containers[0];
    assert_eq!(main.command, None);
    assert_eq!(
        main.args.clone().unwrap_or_default(),
        strings(&["validator", "--hold"])
    );
    assert_eq!(main.lifecycle, None, "the process removes the files itself");
    let probe = main
        .readiness_probe
        .as_ref()
        .and_then(|p| p.exec.as_ref())
        .and_then(|e| e.command.clone())
        .expect("an exec readiness probe");
    assert_eq!(
        probe,
        strings(&[
            render::GPU_STACK_BIN,
            "validator",
            "--wait-only",
            "--component",
            "driver,toolkit,cuda,plugin",
            "--timeout",
            "0",
            "--poll-interval-ms",
            "5000"
        ])
    );
}

#[test]
fn node_status_exporter_runs_its_subcommand_on_its_port() {
    let policy = policy_with(serde_json::json!({
        "nodeStatusExporter": {"enabled": true, "args": ["--log-format", "json"]}
    }));
    let ctx = render::RenderContext {
        policy: &policy,
        namespace: "gpu-operator",
    };
    let ds = render::daemonset(&ctx, Component::NodeStatusExporter, None);
    let main = &pod_of(&ds).containers[0];
    assert_eq!(
        main.args.clone().unwrap_or_default(),
        strings(&[
            "node-status-exporter",
            "--listen",
            "0.0.0.0:8000",
            "--log-format",
            "json"
        ])
    );
    let port = &main.ports.as_ref().expect("a port")[0];
    assert_eq!(port.container_port, render::NODE_STATUS_PORT);
    assert_eq!(port.name.as_deref(), Some("node-status"));
    assert!(
        main.env
            .iter()
            .flatten()
            .any(|e| e.name == "NODE_NAME" && e.value_from.is_some())
    );
}

#[test]
fn gfd_patches_its_node_itself_so_no_nfd_worker_is_needed() {
    let policy = policy_with(serde_json::json!({
        "gfd": {"args": ["--sleep-interval", "30s"]}
    }));
    let ctx = render::RenderContext {
        policy: &policy,
        namespace: "gpu-operator",
    };
    let ds = render::daemonset(&ctx, Component::GpuFeatureDiscovery, None);
    let main = &pod_of(&ds).containers[0];
    assert_eq!(
        main.args.clone().unwrap_or_default(),
        strings(&["--publish", "--sleep-interval", "30s"])
    );
}

#[test]
fn toolkit_check_looks_at_host_traces_only_without_a_toolkit_daemonset() {
    let check_of = |spec: serde_json::Value| {
        let policy = policy_with(spec);
        let ctx = render::RenderContext {
            policy: &policy,
            namespace: "gpu-operator",
        };
        let ds = render::daemonset(&ctx, Component::OperatorValidator, None);
        pod_of(&ds)
            .init_containers
            .clone()
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.name == VALIDATOR_CHECKS)
            .expect("the validator's check container")
    };
    let preinstalled = check_of(serde_json::json!({"toolkit": {"enabled": false}}));
    let args = preinstalled.args.clone().unwrap_or_default();
    assert!(
        args.windows(2)
            .any(|w| w == ["--toolkit-evidence", "/host/run/cdi"]),
        "{args:?}"
    );
    assert!(
        preinstalled
            .volume_mounts
            .iter()
            .flatten()
            .any(|m| m.mount_path == "/host" && m.read_only == Some(true))
    );
    let managed = check_of(serde_json::json!({"toolkit": {"enabled": true}}));
    assert!(
        !managed
            .args
            .unwrap_or_default()
            .iter()
            .any(|a| a == "--toolkit-evidence")
    );
}

#[test]
fn validator_env_reaches_every_check() {
    let policy = policy_with(serde_json::json!({
        "validator": {"env": [{"name": "GPU_STACK_BACKEND", "value": "simulated"}]}
    }));
    let ctx = render::RenderContext {
        policy: &policy,
        namespace: "gpu-operator",
    };
    let ds = render::daemonset(&ctx, Component::OperatorValidator, None);
    for check in pod_of(&ds).init_containers.clone().unwrap_or_default() {
        if check.env.is_none() {
            // Wait-only gates read status files and need no backend.
            continue;
        }
        assert!(
            check
                .env
                .iter()
                .flatten()
                .any(|e| e.name == "GPU_STACK_BACKEND" && e.value.as_deref() == Some("simulated")),
            "{} lacks the validator's env",
            check.name
        );
    }
}

#[test]
fn a_gpu_stack_toolkit_image_runs_the_cdi_native_agent() {
    let policy = policy_with(serde_json::json!({"toolkit": {
        "repository": "localhost/gpu-stack", "image": "gpu-stack", "version": "0.1.0",
        "env": [{"name": "CONTAINERD_SOCKET", "value": "/run/k3s/containerd/containerd.sock"}],
    }}));
    assert!(policy.spec.toolkit_is_gpu_stack());
    let ctx = render::RenderContext {
        policy: &policy,
        namespace: "gpu-operator",
    };
    let ds = render::daemonset(&ctx, Component::ContainerToolkit, None);
    let pod = pod_of(&ds);
    assert_eq!(
        pod.host_pid,
        Some(true),
        "the agent signals the runtime by pid"
    );
    assert_eq!(pod.runtime_class_name, None);
    let main = &pod.containers[0];
    assert_eq!(
        main.args.clone().unwrap_or_default(),
        strings(&["toolkit", "--host-root", "/host"])
    );
    let env: Vec<&str> = main.env.iter().flatten().map(|e| e.name.as_str()).collect();
    for name in [
        "POD_NAME",
        "POD_NAMESPACE",
        "NODE_NAME",
        "NVIDIA_DRIVER_ROOT",
        "CONTAINERD_RUNTIME_CLASS",
    ] {
        assert!(env.contains(&name), "{name} missing: {env:?}");
    }
    assert!(
        !env.contains(&"TOOLKIT_INSTALL_DIR"),
        "NVIDIA's variables stay out: {env:?}"
    );
    assert!(
        main.volume_mounts
            .iter()
            .flatten()
            .any(|m| m.mount_path == "/host" && m.read_only != Some(true)),
        "the agent writes through the host root"
    );
    // The check asks the runtime the agent configured, at the user's socket.
    let validator = render::daemonset(&ctx, Component::OperatorValidator, None);
    let check = pod_of(&validator)
        .init_containers
        .clone()
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.name == VALIDATOR_CHECKS)
        .expect("the validator's check container");
    let args = check.args.unwrap_or_default();
    assert!(
        args.windows(2).any(|w| w
            == [
                "--toolkit-cri-socket",
                "/run/k3s/containerd/containerd.sock"
            ]),
        "{args:?}"
    );
    assert!(
        args.windows(2).any(|w| w[0] == "--toolkit-cdi-spec"),
        "{args:?}"
    );
    // The agent's role lets it tell a removal from a restart, with the
    // token its pod is given.
    assert_eq!(pod.automount_service_account_token, None);
    let rules = render::rbac::rbac_rules(&policy.spec, Component::ContainerToolkit);
    assert!(
        rules
            .iter()
            .any(|r| r.resources.iter().flatten().any(|x| x == "daemonsets"))
    );
}

#[test]
fn nvidias_toolkit_image_keeps_nvidias_toolkit_contract() {
    let policy = policy_with(serde_json::json!({}));
    assert!(!policy.spec.toolkit_is_gpu_stack());
    let ctx = render::RenderContext {
        policy: &policy,
        namespace: "gpu-operator",
    };
    let ds = render::daemonset(&ctx, Component::ContainerToolkit, None);
    let main = &pod_of(&ds).containers[0];
    assert!(
        main.image
            .as_deref()
            .is_some_and(|i| i.contains("container-toolkit"))
    );
    assert_eq!(main.args, None);
    let env: Vec<&str> = main.env.iter().flatten().map(|e| e.name.as_str()).collect();
    assert!(env.contains(&"TOOLKIT_INSTALL_DIR") && env.contains(&"CDI_ENABLED"));
    assert!(
        render::rbac::rbac_rules(&policy.spec, Component::ContainerToolkit).is_empty(),
        "NVIDIA's toolkit needs no API access"
    );
    // So its pod gets no token.
    assert_eq!(pod_of(&ds).automount_service_account_token, Some(false));
}

fn driver_pod_of(policy: &ClusterPolicy) -> k8s_openapi::api::core::v1::PodSpec {
    let ctx = render::RenderContext {
        policy,
        namespace: "gpu-operator",
    };
    let pool = gpu_stack_core::operator::driver::DriverPool {
        name: "nvidia-driver-daemonset-ubuntu22.04".into(),
        os: gpu_stack_core::operator::driver::OsInfo {
            id: "ubuntu".into(),
            version_id: "22.04".into(),
            version_major: None,
        },
        kernel: None,
        selector: Default::default(),
        image: "nvcr.io/nvidia/driver:570.124.06-ubuntu22.04".into(),
        kernel_module_type: gpu_stack_core::operator::driver::KernelModuleType::Open,
        nodes: vec!["gpu-0".into()],
        excluded: vec![],
    };
    pod_of(&render::daemonset(&ctx, Component::Driver, Some(&pool))).clone()
}

#[test]
fn driver_manager_and_startup_probe_follow_the_policy_over_nvidias_defaults() {
    let stock = driver_pod_of(&policy_with(serde_json::json!({})));
    let manager = &stock.init_containers.as_ref().expect("init containers")[0];
    assert_eq!(
        manager.image.as_deref(),
        Some("nvcr.io/nvidia/cloud-native/k8s-driver-manager:v0.12.0")
    );
    let probe = stock.containers[0]
        .startup_probe
        .as_ref()
        .expect("a startup probe");
    assert_eq!(
        (
            probe.initial_delay_seconds,
            probe.period_seconds,
            probe.failure_threshold
        ),
        (Some(60), Some(10), Some(120))
    );

    let tuned = driver_pod_of(&policy_with(serde_json::json!({"driver": {
        "manager": {
            "repository": "registry.example/mirror",
            "image": "driver-manager",
            "version": "v9",
            "imagePullPolicy": "Never",
            "imagePullSecrets": ["mirror-pull"],
            "env": [
                {"name": "ENABLE_GPU_POD_EVICTION", "value": "false"},
                {"name": "DRAIN_USE_FORCE", "value": "true"},
            ],
        },
        "startupProbe": {"initialDelaySeconds": 1, "periodSeconds": 2},
    }})));
    let manager = &tuned.init_containers.as_ref().expect("init containers")[0];
    assert_eq!(manager.name, "k8s-driver-manager");
    assert_eq!(
        manager.image.as_deref(),
        Some("registry.example/mirror/driver-manager:v9")
    );
    assert_eq!(manager.image_pull_policy.as_deref(), Some("Never"));
    let env: Vec<(String, Option<String>)> = manager
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.clone(), e.value.clone()))
        .collect();
    let value = |name: &str| {
        let hits: Vec<_> = env.iter().filter(|(n, _)| n == name).collect();
        assert_eq!(hits.len(), 1, "{name} once in {env:?}");
        hits[0].1.clone()
    };
    assert_eq!(value("ENABLE_GPU_POD_EVICTION").as_deref(), Some("false"));
    assert_eq!(value("DRAIN_USE_FORCE").as_deref(), Some("true"));
    assert_eq!(value("ENABLE_AUTO_DRAIN").as_deref(), Some("false"));
    let secrets: Vec<String> = tuned
        .image_pull_secrets
        .iter()
        .flatten()
        .map(|s| s.name.clone())
        .collect();
    assert_eq!(secrets, ["mirror-pull"]);
    let probe = tuned.containers[0]
        .startup_probe
        .as_ref()
        .expect("a startup probe");
    assert_eq!(
        (
            probe.initial_delay_seconds,
            probe.period_seconds,
            probe.failure_threshold,
            probe.timeout_seconds
        ),
        (Some(1), Some(2), Some(120), Some(60))
    );
    // The probe still checks the driver the NVIDIA way.
    let cmd = probe
        .exec
        .as_ref()
        .and_then(|e| e.command.clone())
        .unwrap_or_default();
    assert!(cmd.join(" ").contains("nvidia-smi && touch"), "{cmd:?}");
}

/// A MIG-capable GPU node as NFD and GFD label it.
fn mig_gpu_node(name: &str) -> Node {
    let labels: Labels = [
        ("feature.node.kubernetes.io/pci-10de.present", "true"),
        (NFD_OS_ID, "ubuntu"),
        (NFD_OS_VERSION, "22.04"),
        ("nvidia.com/mig.capable", "true"),
        ("kubernetes.io/hostname", name),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(labels),
            ..Default::default()
        },
        ..Default::default()
    }
}

fn daemonset_named<'a>(d: &'a Desired, name: &str) -> Option<&'a Object> {
    d.objects
        .iter()
        .find(|o| o.as_daemonset().is_some() && o.key().name == name)
}

/// The validator pod's one init container: its four checks in order.
const VALIDATOR_CHECKS: &str = "driver-toolkit-cuda-plugin-validation";

#[test]
fn the_validator_runs_its_checks_in_one_init_container_in_order() {
    let policy = policy_with(serde_json::json!({}));
    let ctx = render::RenderContext {
        policy: &policy,
        namespace: "gpu-operator",
    };
    let ds = render::daemonset(&ctx, Component::OperatorValidator, None);
    let init = pod_of(&ds).init_containers.clone().unwrap_or_default();
    let names: Vec<&str> = init.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, [VALIDATOR_CHECKS]);
    let args = init[0].args.clone().unwrap_or_default();
    assert_eq!(
        args[..4],
        strings(&[
            "validator",
            "--component",
            "driver,toolkit,cuda,plugin",
            "--wait"
        ])
    );
    // The driver check's Bidirectional status mount, and the driver and host roots.
    let mounts: Vec<(&str, Option<&str>)> = init[0]
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| (m.mount_path.as_str(), m.mount_propagation.as_deref()))
        .collect();
    assert!(
        mounts.contains(&(
            gpu_stack_core::operator::components::VALIDATIONS_DIR,
            Some("Bidirectional")
        )),
        "{mounts:?}"
    );
    assert!(
        mounts.iter().any(|m| m.0 == "/run/nvidia/driver"),
        "{mounts:?}"
    );
    assert!(mounts.iter().any(|m| m.0 == "/host"), "{mounts:?}");
    assert_eq!(
        init[0].security_context.as_ref().and_then(|s| s.privileged),
        Some(true)
    );
    // NVIDIA's unused WITH_WORKLOAD and MIG_STRATEGY stay out; the node name is in.
    let env: Vec<&str> = init[0]
        .env
        .iter()
        .flatten()
        .map(|e| e.name.as_str())
        .collect();
    assert_eq!(env, ["NODE_NAME"]);
    // The MIG manager's check and wait stay two containers (a check, then a wait).
    let mig = render::daemonset(&ctx, Component::MigManager, None);
    let names: Vec<String> = pod_of(&mig)
        .init_containers
        .iter()
        .flatten()
        .map(|c| c.name.clone())
        .collect();
    assert_eq!(names, strings(&["driver-validation", "toolkit-validation"]));
}

#[test]
fn every_volume_of_every_operand_is_mounted_by_a_container() {
    let policy = policy_with(serde_json::json!({
        "driver": {"enabled": true},
        "nodeStatusExporter": {"enabled": true},
        "draDriver": {"enabled": true}
    }));
    let ctx = render::RenderContext {
        policy: &policy,
        namespace: "gpu-operator",
    };
    for c in Component::ALL {
        let ds = render::daemonset(&ctx, c, None);
        let pod = pod_of(&ds);
        let mounted: Vec<&str> = pod
            .init_containers
            .iter()
            .flatten()
            .chain(&pod.containers)
            .flat_map(|c| c.volume_mounts.iter().flatten())
            .map(|m| m.name.as_str())
            .collect();
        for v in pod.volumes.iter().flatten() {
            assert!(
                mounted.contains(&v.name.as_str()),
                "{c}: {} unmounted",
                v.name
            );
        }
        for m in &mounted {
            assert!(
                pod.volumes.iter().flatten().any(|v| v.name == *m),
                "{c}: mount of a missing volume {m}"
            );
        }
    }
}

#[test]
fn an_agent_mounts_the_validations_dir_only_when_its_env_names_a_file_there() {
    let main_mounts = |policy: &ClusterPolicy| -> Vec<String> {
        let ctx = render::RenderContext {
            policy,
            namespace: "gpu-operator",
        };
        let ds = render::daemonset(&ctx, Component::DevicePlugin, None);
        pod_of(&ds).containers[0]
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| m.mount_path.clone())
            .collect()
    };
    let plain = policy_with(serde_json::json!({}));
    assert!(
        !main_mounts(&plain)
            .iter()
            .any(|p| p == gpu_stack_core::operator::components::VALIDATIONS_DIR)
    );
    let simulated = policy_with(serde_json::json!({"devicePlugin": {"env": [
        {"name": "GPU_STACK_FLEET", "value": "/run/nvidia/validations/sim/fleet.yaml"}
    ]}}));
    assert!(
        main_mounts(&simulated)
            .iter()
            .any(|p| p == gpu_stack_core::operator::components::VALIDATIONS_DIR)
    );
}

const DRA_DS: &str = "nvidia-dra-driver-gpu-kubelet-plugin";

#[test]
fn dra_driver_renders_its_kubelet_plugin_instead_of_the_mig_manager() {
    let policy = policy_with(serde_json::json!({"draDriver": {
        "enabled": true,
        "env": [{"name": "GPU_STACK_BACKEND", "value": "simulated"}],
    }}));
    let nodes = [mig_gpu_node("gpu-1")];
    let d = desired_state(&policy, &nodes, &[], &Options::default());
    assert!(
        d.status
            .conditions
            .iter()
            .all(|c| c.type_ != "Error" || c.status == "False"),
        "{:?}",
        d.status.conditions
    );

    // One owner of a GPU layout: no MIG manager, no mig-parted ConfigMap.
    assert!(daemonset_named(&d, Component::MigManager.daemonset_name()).is_none());
    assert!(
        !d.objects
            .iter()
            .any(|o| o.key().name == "default-mig-parted-config")
    );
    let patch = &d.node_labels["gpu-1"];
    assert_eq!(
        patch.get("nvidia.com/gpu.deploy.mig-manager"),
        Some(&Some("false".to_string()))
    );
    assert_eq!(
        patch.get("nvidia.com/gpu.deploy.dra-driver"),
        Some(&Some("true".to_string()))
    );
    assert!(
        !patch.contains_key(gpu_stack_core::operator::labels::MIG_CONFIG),
        "no MIG manager reads a default layout: {patch:?}"
    );
    // The device plugin stays as configured.
    assert!(daemonset_named(&d, Component::DevicePlugin.daemonset_name()).is_some());

    let ds = daemonset_named(&d, DRA_DS).expect("the DRA plugin DaemonSet");
    let pod = pod_of(ds);
    assert_eq!(
        pod.node_selector
            .clone()
            .unwrap_or_default()
            .get("nvidia.com/gpu.deploy.dra-driver"),
        Some(&"true".to_string())
    );
    assert_eq!(
        pod.service_account_name.as_deref(),
        Some("nvidia-dra-driver-gpu-kubelet-plugin")
    );
    assert_eq!(pod.host_pid, None);
    let gates: Vec<&str> = pod
        .init_containers
        .iter()
        .flatten()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(gates, ["toolkit-validation"]);
    let main = &pod.containers[0];
    assert_eq!(
        main.image.as_deref(),
        Some(
            format!(
                "ghcr.io/gpu-stack/gpu-dra-plugin:{}",
                crate::operator::clusterpolicy::GPU_STACK_VERSION
            )
            .as_str()
        )
    );
    assert_eq!(
        main.security_context.as_ref().and_then(|s| s.privileged),
        Some(true)
    );
    let env: BTreeMap<&str, &k8s_openapi::api::core::v1::EnvVar> = main
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.as_str(), e))
        .collect();
    let value = |name: &str| env.get(name).and_then(|e| e.value.as_deref());
    assert_eq!(
        env["NODE_NAME"]
            .value_from
            .as_ref()
            .and_then(|v| v.field_ref.as_ref())
            .map(|f| f.field_path.as_str()),
        Some("spec.nodeName")
    );
    assert_eq!(value("DRA_DRIVER_NAME"), Some("gpu.nvidia.com"));
    assert_eq!(value("GPU_STACK_BACKEND"), Some("simulated"));
    assert_eq!(
        value("KUBELET_PLUGINS_DIR"),
        Some("/var/lib/kubelet/plugins")
    );
    assert_eq!(
        value("KUBELET_REGISTRY_DIR"),
        Some("/var/lib/kubelet/plugins_registry")
    );
    assert_eq!(value("CDI_SPEC_DIR"), Some("/var/run/cdi"));
    assert_eq!(value("NVIDIA_DRIVER_ROOT"), Some("/run/nvidia/driver"));
    assert_eq!(value("CONTAINER_DRIVER_ROOT"), Some("/driver-root"));

    // Each mount, with the host path behind it and its propagation.
    let host: BTreeMap<&str, &str> = pod
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| Some((v.name.as_str(), v.host_path.as_ref()?.path.as_str())))
        .collect();
    let mounts: BTreeMap<&str, (&str, Option<&str>)> = main
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| {
            (
                m.mount_path.as_str(),
                (host[m.name.as_str()], m.mount_propagation.as_deref()),
            )
        })
        .collect();
    for (path, want) in [
        (
            "/var/lib/kubelet/plugins",
            ("/var/lib/kubelet/plugins", Some("Bidirectional")),
        ),
        (
            "/var/lib/kubelet/plugins_registry",
            ("/var/lib/kubelet/plugins_registry", None),
        ),
        ("/var/run/cdi", ("/var/run/cdi", None)),
        (
            "/driver-root",
            ("/run/nvidia/driver", Some("HostToContainer")),
        ),
    ] {
        assert_eq!(mounts.get(path), Some(&want), "{path}: {mounts:?}");
    }
    // Its init container waits for the status files; the plugin reads none.
    assert!(
        !mounts.contains_key(gpu_stack_core::operator::components::VALIDATIONS_DIR),
        "{mounts:?}"
    );

    // Its role: its Node, its ResourceSlices, the claims it prepares.
    let role = d
        .objects
        .iter()
        .find_map(|o| match o {
            Object::ClusterRole(r) if r.metadata.name.as_deref() == Some(DRA_DS) => Some(r),
            _ => None,
        })
        .expect("a ClusterRole for the DRA plugin");
    let allows = |group: &str, resource: &str, verb: &str| {
        role.rules.iter().flatten().any(|r| {
            r.api_groups.iter().flatten().any(|g| g == group)
                && r.resources.iter().flatten().any(|x| x == resource)
                && r.verbs.iter().any(|v| v == verb)
        })
    };
    assert!(allows("", "nodes", "get"));
    assert!(!allows("", "nodes", "patch"));
    for verb in [
        "get", "list", "watch", "create", "update", "patch", "delete",
    ] {
        assert!(allows("resource.k8s.io", "resourceslices", verb), "{verb}");
    }
    for verb in ["get", "list", "watch"] {
        assert!(allows("resource.k8s.io", "resourceclaims", verb), "{verb}");
    }
    assert!(!allows("resource.k8s.io", "resourceclaims", "update"));
    assert!(d.objects.iter().any(|o| matches!(
        o,
        Object::ClusterRoleBinding(b) if b.role_ref.name == DRA_DS
    )));
}

#[test]
fn dra_driver_name_reaches_the_plugin() {
    let policy = policy_with(serde_json::json!({"draDriver": {
        "enabled": true, "driverName": "gpu.example.com", "version": "v9",
    }}));
    let ctx = render::RenderContext {
        policy: &policy,
        namespace: "gpu-operator",
    };
    let ds = render::daemonset(&ctx, Component::DraPlugin, None);
    let main = &pod_of(&ds).containers[0];
    assert!(
        main.env
            .iter()
            .flatten()
            .any(|e| e.name == "DRA_DRIVER_NAME" && e.value.as_deref() == Some("gpu.example.com"))
    );
    assert_eq!(
        main.image.as_deref(),
        Some("ghcr.io/gpu-stack/gpu-dra-plugin:v9")
    );
}

#[test]
fn dra_plugin_sockets_are_at_the_kubelets_own_paths() {
    // The plugin registers its socket by absolute path: the pod sees the
    // kubelet's directories where the host has them.
    let policy = policy_with(serde_json::json!({
        "draDriver": {"enabled": true},
        "hostPaths": {"kubeletRootDir": "/var/lib/k0s/kubelet"},
    }));
    let ctx = render::RenderContext {
        policy: &policy,
        namespace: "gpu-operator",
    };
    let ds = render::daemonset(&ctx, Component::DraPlugin, None);
    let pod = pod_of(&ds);
    let main = &pod.containers[0];
    for (var, dir, volume) in [
        (
            "KUBELET_PLUGINS_DIR",
            "/var/lib/k0s/kubelet/plugins",
            "plugins",
        ),
        (
            "KUBELET_REGISTRY_DIR",
            "/var/lib/k0s/kubelet/plugins_registry",
            "plugins-registry",
        ),
    ] {
        assert!(
            main.env
                .iter()
                .flatten()
                .any(|e| e.name == var && e.value.as_deref() == Some(dir)),
            "{var}"
        );
        assert!(
            main.volume_mounts
                .iter()
                .flatten()
                .any(|m| m.name == volume && m.mount_path == dir),
            "{volume}"
        );
        assert!(pod.volumes.iter().flatten().any(
            |v| v.name == volume && v.host_path.as_ref().map(|h| h.path.as_str()) == Some(dir)
        ));
    }
}

#[test]
fn without_dra_driver_nothing_changes() {
    let nodes = [mig_gpu_node("gpu-1")];
    let plain = desired_state(
        &policy_with(serde_json::json!({})),
        &nodes,
        &[],
        &Options::default(),
    );
    let off = desired_state(
        &policy_with(
            serde_json::json!({"draDriver": {"enabled": false, "driverName": "x.example.com"}}),
        ),
        &nodes,
        &[],
        &Options::default(),
    );
    assert_eq!(
        serde_json::to_value(&plain.objects).unwrap(),
        serde_json::to_value(&off.objects).unwrap()
    );
    assert_eq!(plain.node_labels, off.node_labels);
    assert!(daemonset_named(&plain, DRA_DS).is_none());
    assert!(daemonset_named(&plain, Component::MigManager.daemonset_name()).is_some());
    assert!(
        !plain.node_labels["gpu-1"]
            .keys()
            .any(|k| k.contains("dra") || k.contains("gpu-stack")),
        "{:?}",
        plain.node_labels
    );
}

#[test]
fn switching_dra_driver_off_brings_the_mig_manager_back() {
    let on = policy_with(serde_json::json!({"draDriver": {"enabled": true}}));
    let off = policy_with(serde_json::json!({"draDriver": {"enabled": false}}));
    let mut nodes = [mig_gpu_node("gpu-1")];
    let first = desired_state(&on, &nodes, &[], &Options::default());
    let labels = nodes[0].metadata.labels.get_or_insert_with(BTreeMap::new);
    apply_patch(labels, &first.node_labels["gpu-1"]);
    // Applied: nothing more to do.
    let again = desired_state(&on, &nodes, &first.objects, &Options::default());
    assert!(!again.has_changes(), "{:?}", again.node_labels);

    let back = desired_state(&off, &nodes, &first.objects, &Options::default());
    let patch = &back.node_labels["gpu-1"];
    assert_eq!(
        patch.get("nvidia.com/gpu.deploy.mig-manager"),
        Some(&Some("true".to_string()))
    );
    assert_eq!(patch.get("nvidia.com/gpu.deploy.dra-driver"), Some(&None));
    assert!(back.delete.iter().any(|k| k.name == DRA_DS));
    // Its DaemonSet goes before the account and role its pods use.
    let kinds: Vec<&str> = back.delete.iter().map(|k| k.kind.as_str()).collect();
    let first_access = kinds
        .iter()
        .position(|k| k.contains("Role") || *k == "ServiceAccount");
    assert!(
        first_access.is_some_and(|i| kinds[..i].contains(&"DaemonSet")),
        "{kinds:?}"
    );
    assert!(
        back.apply
            .iter()
            .any(|o| o.key().name == Component::MigManager.daemonset_name())
    );
}

#[test]
fn mig_configs_say_the_dra_plugin_owns_mig_layouts() {
    let policy = policy_with(serde_json::json!({"draDriver": {"enabled": true}}));
    let mig: crate::operator::migconfig::MigConfig = serde_json::from_value(serde_json::json!({
        "apiVersion": "gpustack.io/v1alpha1",
        "kind": "MigConfig",
        "metadata": {"name": "small", "generation": 1},
        "spec": {"nodeSelector": {}, "layouts": [{"profiles": {"1g.10gb": 7}}]},
    }))
    .expect("a MigConfig");
    let nodes = [mig_gpu_node("gpu-1")];
    let d = desired_state_with(
        &policy,
        &nodes,
        &[],
        &Related {
            mig_configs: std::slice::from_ref(&mig),
            ..Related::default()
        },
        &Options::default(),
    );
    let status = &d.mig_config_status["small"];
    assert!(
        status
            .conditions
            .iter()
            .any(|c| c.type_ == "Error" && c.message.contains("draDriver.enabled")),
        "{:?}",
        status.conditions
    );
    assert!(!d.node_labels["gpu-1"].contains_key(gpu_stack_core::operator::labels::MIG_CONFIG));
}

mod node_agent;

/// The device plugin's env as (name, value), in order.
fn plugin_env(spec: serde_json::Value) -> Vec<(String, String)> {
    let policy = policy_with(spec);
    let ctx = render::RenderContext {
        policy: &policy,
        namespace: "gpu-operator",
    };
    let ds = render::daemonset(&ctx, Component::DevicePlugin, None);
    pod_of(&ds).containers[0]
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
        .collect()
}

fn env_value<'a>(env: &'a [(String, String)], name: &str) -> Option<&'a str> {
    env.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
}

#[test]
fn with_cdi_on_the_device_plugin_names_devices_through_cdi_as_nvidias_operator_does() {
    // The defaults (CDI on, NVIDIA's toolkit image): both CDI strategies,
    // the annotation prefix and the hook where NVIDIA's toolkit installs it.
    let env = plugin_env(serde_json::json!({}));
    assert_eq!(
        env_value(&env, "DEVICE_LIST_STRATEGY"),
        Some("cdi-annotations,cdi-cri")
    );
    assert_eq!(
        env_value(&env, "CDI_ANNOTATION_PREFIX"),
        Some("cdi.k8s.io/")
    );
    assert_eq!(
        env_value(&env, "NVIDIA_CDI_HOOK_PATH"),
        Some("/usr/local/nvidia/toolkit/nvidia-cdi-hook")
    );
    let env = plugin_env(serde_json::json!({"toolkit": {"installDir": "/opt/nvidia"}}));
    assert_eq!(
        env_value(&env, "NVIDIA_CDI_HOOK_PATH"),
        Some("/opt/nvidia/toolkit/nvidia-cdi-hook")
    );
    // gpu-stack's toolkit installs no hook: the plugin's own default stays.
    let env = plugin_env(serde_json::json!({"toolkit": {
        "repository": "localhost/gpu-stack", "image": "gpu-stack", "version": "0.1.0"}}));
    assert_eq!(
        env_value(&env, "DEVICE_LIST_STRATEGY"),
        Some("cdi-annotations,cdi-cri")
    );
    assert_eq!(env_value(&env, "NVIDIA_CDI_HOOK_PATH"), None);
    // No toolkit from the operator: no hook path of its install dir.
    let env = plugin_env(serde_json::json!({"toolkit": {"enabled": false}}));
    assert_eq!(env_value(&env, "NVIDIA_CDI_HOOK_PATH"), None);
    // CDI off: the plugin's own default (envvar).
    let env = plugin_env(serde_json::json!({"cdi": {"enabled": false}}));
    assert_eq!(env_value(&env, "DEVICE_LIST_STRATEGY"), None);
    assert_eq!(env_value(&env, "CDI_ANNOTATION_PREFIX"), None);
    // The policy's env wins, once.
    let env = plugin_env(serde_json::json!({"devicePlugin": {"env": [
        {"name": "DEVICE_LIST_STRATEGY", "value": "envvar"}]}}));
    let strategies: Vec<&str> = env
        .iter()
        .filter(|(n, _)| n == "DEVICE_LIST_STRATEGY")
        .map(|(_, v)| v.as_str())
        .collect();
    assert_eq!(strategies, ["envvar"]);
}

/// The validator's check container's args for `spec`.
fn check_args(spec: serde_json::Value) -> Vec<String> {
    let policy = policy_with(spec);
    let ctx = render::RenderContext {
        policy: &policy,
        namespace: "gpu-operator",
    };
    let ds = render::daemonset(&ctx, Component::OperatorValidator, None);
    pod_of(&ds).init_containers.as_ref().unwrap()[0]
        .args
        .clone()
        .unwrap_or_default()
}

#[test]
fn the_plugin_check_runs_a_workload_pod_where_pods_get_devices_through_cdi() {
    let args = check_args(serde_json::json!({
        "validator": {"imagePullSecrets": ["regcred"]}
    }));
    let at = args
        .iter()
        .position(|a| a == "--plugin-workload-image")
        .expect("a workload pod with the defaults");
    assert!(args[at + 1].contains("gpu-stack"), "{args:?}");
    let ns = args
        .iter()
        .position(|a| a == "--plugin-workload-namespace")
        .unwrap();
    assert_eq!(args[ns + 1], "gpu-operator");
    let secret = args
        .iter()
        .position(|a| a == "--plugin-workload-pull-secret")
        .unwrap();
    assert_eq!(args[secret + 1], "regcred");
    // NVIDIA's switch, honoured.
    for off in ["false", "FALSE"] {
        let args = check_args(serde_json::json!({"validator": {"plugin": {"env": [
            {"name": "WITH_WORKLOAD", "value": off}]}}}));
        assert!(
            !args.iter().any(|a| a == "--plugin-workload-image"),
            "{args:?}"
        );
    }
    let args = check_args(serde_json::json!({"validator": {"plugin": {"env": [
        {"name": "WITH_WORKLOAD", "value": "true"}]}}}));
    assert!(args.iter().any(|a| a == "--plugin-workload-image"));
    // envvar (CDI off, or the policy's own strategy): only a runtime shim
    // injects devices, for pods of its RuntimeClass; no workload pod.
    for spec in [
        serde_json::json!({"cdi": {"enabled": false}}),
        serde_json::json!({"devicePlugin": {"env": [
            {"name": "DEVICE_LIST_STRATEGY", "value": "envvar"}]}}),
    ] {
        let args = check_args(spec);
        assert!(
            !args.iter().any(|a| a == "--plugin-workload-image"),
            "{args:?}"
        );
    }
    let args = check_args(serde_json::json!({"devicePlugin": {"env": [
        {"name": "DEVICE_LIST_STRATEGY", "value": "envvar,cdi-cri"}]}}));
    assert!(args.iter().any(|a| a == "--plugin-workload-image"));
}

/// The exporter's Service in the desired state of `spec`, if any.
fn exporter_service(spec: serde_json::Value) -> Option<k8s_openapi::api::core::v1::Service> {
    let policy = policy_with(spec);
    let d = desired_state(&policy, &[mig_gpu_node("gpu-1")], &[], &Options::default());
    d.objects.iter().find_map(|o| match o {
        Object::Service(s) if s.metadata.name.as_deref() == Some(render::EXPORTER_SERVICE) => {
            Some(s.clone())
        }
        _ => None,
    })
}

#[test]
fn the_exporter_gets_nvidias_metrics_service() {
    let service = exporter_service(serde_json::json!({})).expect("a Service with the defaults");
    let annotations = service.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(
        annotations.get("prometheus.io/scrape").map(String::as_str),
        Some("true")
    );
    let labels = service.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels.get("app").map(String::as_str),
        Some("nvidia-dcgm-exporter")
    );
    let spec = service.spec.unwrap();
    assert_eq!(spec.type_.as_deref(), Some("ClusterIP"));
    let port = &spec.ports.as_ref().unwrap()[0];
    assert_eq!(
        (port.name.as_deref(), port.port),
        (Some("gpu-metrics"), 9400)
    );
    assert_eq!(
        spec.selector.unwrap().get("app").map(String::as_str),
        Some("nvidia-dcgm-exporter")
    );
    // NVIDIA's knobs.
    let spec = exporter_service(serde_json::json!({"dcgmExporter": {"service": {
        "type": "NodePort", "internalTrafficPolicy": "Local"}}}))
    .unwrap()
    .spec
    .unwrap();
    assert_eq!(spec.type_.as_deref(), Some("NodePort"));
    assert_eq!(spec.internal_traffic_policy.as_deref(), Some("Local"));
    // Hosted by the node agent: its pods serve the metrics.
    let spec = exporter_service(serde_json::json!({"nodeAgent": {"enabled": true}}))
        .unwrap()
        .spec
        .unwrap();
    assert_eq!(
        spec.selector.unwrap().get("app").map(String::as_str),
        Some(render::NODE_AGENT_NAME)
    );
    // No exporter, no Service.
    assert!(exporter_service(serde_json::json!({"dcgmExporter": {"enabled": false}})).is_none());
}

#[test]
fn nodes_labelled_for_virtual_machines_get_no_container_operands() {
    let mut vm = mig_gpu_node("vm-1");
    vm.metadata.labels.get_or_insert_default().extend([
        (
            "nvidia.com/gpu.workload.config".to_string(),
            "vm-passthrough".to_string(),
        ),
        (
            "nvidia.com/gpu.deploy.driver".to_string(),
            "true".to_string(),
        ),
    ]);
    let nodes = [mig_gpu_node("gpu-1"), vm];
    let sandbox = policy_with(serde_json::json!({"sandboxWorkloads": {"enabled": true}}));
    let d = desired_state(&sandbox, &nodes, &[], &Options::default());
    let vm_patch = &d.node_labels["vm-1"];
    assert_eq!(
        vm_patch.get("nvidia.com/gpu.deploy.driver"),
        Some(&None),
        "{vm_patch:?}"
    );
    assert!(
        vm_patch.iter().all(|(k, v)| v.is_none()
            || !k.starts_with("nvidia.com/gpu.deploy.")
            || k == "nvidia.com/gpu.deploy.client"),
        "{vm_patch:?}"
    );
    assert_eq!(
        d.node_labels["gpu-1"].get("nvidia.com/gpu.deploy.driver"),
        Some(&Some("true".to_string()))
    );
    let driven: Vec<&String> = d.driver.pools.iter().flat_map(|p| &p.nodes).collect();
    assert_eq!(driven, ["gpu-1"]);

    // Sandbox workloads off (NVIDIA's default): the label is not read.
    let plain = desired_state(
        &policy_with(serde_json::json!({})),
        &nodes,
        &[],
        &Options::default(),
    );
    let driven: Vec<&String> = plain.driver.pools.iter().flat_map(|p| &p.nodes).collect();
    assert_eq!(driven, ["gpu-1", "vm-1"]);
}

#[test]
fn gpu_nodes_say_whether_the_upgrade_controller_drains_them() {
    let annotation = gpu_stack_core::operator::labels::DRIVER_UPGRADE_ENABLED;
    let nodes = [mig_gpu_node("gpu-1")];
    let auto = policy_with(serde_json::json!({"driver": {"upgradePolicy": {"autoUpgrade": true}}}));
    let d = desired_state(&auto, &nodes, &[], &Options::default());
    assert_eq!(
        d.node_annotations["gpu-1"].get(annotation),
        Some(&Some("true".to_string()))
    );
    // Written with the node's labels, as one patch.
    assert!(d.node_labels.contains_key("gpu-1"));

    // autoUpgrade off, or sandbox workloads on: the annotation goes.
    let mut annotated = mig_gpu_node("gpu-1");
    annotated.metadata.annotations = Some([(annotation.to_string(), "true".to_string())].into());
    let annotated = [annotated];
    for spec in [
        serde_json::json!({}),
        serde_json::json!({"driver": {"upgradePolicy": {"autoUpgrade": true}},
                           "sandboxWorkloads": {"enabled": true}}),
    ] {
        let d = desired_state(&policy_with(spec), &annotated, &[], &Options::default());
        assert_eq!(d.node_annotations["gpu-1"].get(annotation), Some(&None));
    }
    let d = desired_state(&auto, &annotated, &[], &Options::default());
    assert!(d.node_annotations.is_empty());
}

#[test]
fn the_driver_check_links_device_nodes_into_the_hosts_dev_char_unless_switched_off() {
    let driver_check = |spec: serde_json::Value| {
        let policy = policy_with(spec);
        let ctx = render::RenderContext {
            policy: &policy,
            namespace: "gpu-operator",
        };
        let ds = render::daemonset(&ctx, Component::OperatorValidator, None);
        let pod = pod_of(&ds).clone();
        let check = pod
            .init_containers
            .clone()
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.name.starts_with("driver-"))
            .expect("a driver check");
        (pod, check)
    };
    let (pod, check) = driver_check(serde_json::json!({}));
    let args = check.args.clone().unwrap_or_default();
    assert!(
        args.windows(2)
            .any(|w| w == ["--dev-char-dir", "/host-dev-char"]),
        "{args:?}"
    );
    assert!(
        check
            .volume_mounts
            .iter()
            .flatten()
            .any(|m| m.name == "host-dev-char"
                && m.mount_path == "/host-dev-char"
                && m.read_only != Some(true))
    );
    assert!(
        pod.volumes
            .iter()
            .flatten()
            .any(|v| v.name == "host-dev-char"
                && v.host_path.as_ref().map(|h| h.path.as_str()) == Some("/dev/char"))
    );

    // NVIDIA's switch, in NVIDIA's place: no flag, no mount, no volume.
    let (pod, check) = driver_check(serde_json::json!({"validator": {"driver": {"env": [
        {"name": "DISABLE_DEV_CHAR_SYMLINK_CREATION", "value": "true"}
    ]}}}));
    assert!(!check.args.iter().flatten().any(|a| a == "--dev-char-dir"));
    assert!(
        !pod.volumes
            .iter()
            .flatten()
            .any(|v| v.name == "host-dev-char")
    );
}

/// A policy created at `minute` past midnight, deleted when `deleting`.
fn policy_at(name: &str, minute: u32, deleting: bool) -> ClusterPolicy {
    let at = |m: u32| format!("2026-01-01T00:{m:02}:00Z");
    let mut meta = serde_json::json!({"name": name, "creationTimestamp": at(minute)});
    if deleting {
        meta["deletionTimestamp"] = serde_json::json!(at(59));
    }
    serde_json::from_value(serde_json::json!({
        "apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy",
        "metadata": meta, "spec": {},
    }))
    .expect("a valid ClusterPolicy")
}

fn duty_of(all: &[ClusterPolicy], name: &str) -> PolicyDuty {
    let policy = all
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some(name))
        .expect("listed");
    policy_duty(policy, all)
}

#[test]
fn deleting_a_policy_not_in_charge_touches_nothing() {
    let all = [policy_at("a", 1, false), policy_at("b", 2, true)];
    assert_eq!(duty_of(&all, "a"), PolicyDuty::Reconcile);
    assert_eq!(duty_of(&all, "b"), PolicyDuty::StandBy);
    let live = [policy_at("a", 1, false), policy_at("b", 2, false)];
    assert_eq!(duty_of(&live, "b"), PolicyDuty::StandBy);
}

#[test]
fn deleting_the_policy_in_charge_hands_over_to_the_oldest_live_one() {
    let all = [
        policy_at("a", 1, true),
        policy_at("b", 2, true),
        policy_at("c", 3, false),
        policy_at("d", 4, false),
    ];
    assert_eq!(
        duty_of(&all, "a"),
        PolicyDuty::HandOver {
            successor: "c".into()
        }
    );
    assert_eq!(duty_of(&all, "b"), PolicyDuty::StandBy);
    assert_eq!(duty_of(&all, "c"), PolicyDuty::Reconcile);
    assert_eq!(duty_of(&all, "d"), PolicyDuty::StandBy);
    assert_eq!(
        active_policy(&all).and_then(|p| p.metadata.name.as_deref()),
        Some("c")
    );
}

#[test]
fn deleting_the_last_policy_tears_the_stack_down() {
    let all = [policy_at("a", 1, true), policy_at("b", 2, true)];
    assert_eq!(duty_of(&all, "a"), PolicyDuty::TearDown);
    assert_eq!(duty_of(&all, "b"), PolicyDuty::StandBy);
    assert!(active_policy(&all).is_none());
    // A policy the cache no longer lists still decides from itself.
    assert_eq!(
        policy_duty(&policy_at("z", 9, true), &[]),
        PolicyDuty::TearDown
    );
}

proptest::proptest! {
    /// Whatever the policies: one live policy reconciles when any lives,
    /// at most one policy tears down or hands over, a hand-over names the
    /// one that reconciles, and a teardown happens only with none alive.
    #[test]
    fn exactly_one_policy_is_in_charge(
        policies in proptest::collection::vec((0u32..5, proptest::bool::ANY), 1..6)
    ) {
        let all: Vec<ClusterPolicy> = policies
            .iter()
            .enumerate()
            .map(|(i, (minute, deleting))| policy_at(&format!("p{i}"), *minute, *deleting))
            .collect();
        let duties: Vec<(String, PolicyDuty)> = all
            .iter()
            .map(|p| (p.metadata.name.clone().unwrap_or_default(), policy_duty(p, &all)))
            .collect();
        let reconciling: Vec<&String> = duties
            .iter()
            .filter(|(_, d)| *d == PolicyDuty::Reconcile)
            .map(|(n, _)| n)
            .collect();
        let any_live = all.iter().any(|p| !is_deleting(p));
        proptest::prop_assert_eq!(reconciling.len(), usize::from(any_live));
        let active = active_policy(&all).and_then(|p| p.metadata.name.clone());
        proptest::prop_assert_eq!(reconciling.first().map(|n| (*n).clone()), active);
        let leaving: Vec<&PolicyDuty> = duties
            .iter()
            .map(|(_, d)| d)
            .filter(|d| matches!(d, PolicyDuty::HandOver { .. } | PolicyDuty::TearDown))
            .collect();
        proptest::prop_assert!(leaving.len() <= 1);
        for d in leaving {
            match d {
                PolicyDuty::HandOver { successor } => {
                    proptest::prop_assert_eq!(Some(successor), reconciling.first().copied());
                }
                _ => proptest::prop_assert!(!any_live),
            }
        }
    }
}

#[test]
fn a_drifted_object_is_applied_again_though_its_hash_matches() {
    const NO_NODES: &[Node] = &[];
    let policy = policy_with(serde_json::json!({}));
    let first = desired_state(&policy, NO_NODES, &[], &Options::default());
    assert!(!first.apply.is_empty());
    let current = first.apply.clone();
    let again = desired_state(&policy, NO_NODES, &current, &Options::default());
    assert!(again.apply.is_empty(), "hashes match: nothing to write");
    let edited = current
        .iter()
        .find(|o| o.as_daemonset().is_some())
        .expect("a DaemonSet")
        .key();
    let drifted: BTreeSet<ObjectKey> = [edited.clone()].into();
    let repaired = desired_state_with(
        &policy,
        NO_NODES,
        &current,
        &Related {
            drifted: Some(&drifted),
            ..Related::default()
        },
        &Options::default(),
    );
    let applied: Vec<ObjectKey> = repaired.apply.iter().map(Object::key).collect();
    assert_eq!(applied, [edited]);
    assert_eq!(repaired.unchanged, again.unchanged - 1);
}
