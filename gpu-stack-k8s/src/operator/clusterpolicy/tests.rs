use super::*;
use gpu_stack_core::operator::labels::Workload;

/// A ClusterPolicy as the NVIDIA chart renders it (abridged), including
/// sections this operator does not implement.
const NVIDIA_POLICY: &str = r#"
apiVersion: nvidia.com/v1
kind: ClusterPolicy
metadata:
  name: cluster-policy
spec:
  operator:
    defaultRuntime: containerd
    runtimeClass: nvidia
    initContainer:
      repository: nvcr.io/nvidia
      image: cuda
      version: 12.8.1-base-ubi9
  daemonsets:
    priorityClassName: system-node-critical
    tolerations:
      - key: nvidia.com/gpu
        operator: Exists
        effect: NoSchedule
    updateStrategy: RollingUpdate
    rollingUpdate:
      maxUnavailable: "1"
  validator:
    repository: nvcr.io/nvidia/cloud-native
    image: gpu-operator-validator
    version: v25.3.0
    plugin:
      env:
        - name: WITH_WORKLOAD
          value: "false"
  mig:
    strategy: single
  psa:
    enabled: false
  cdi:
    enabled: true
    default: false
  driver:
    enabled: true
    useNvidiaDriverCRD: false
    kernelModuleType: auto
    usePrecompiled: false
    repository: nvcr.io/nvidia
    image: driver
    version: "570.124.06"
    manager:
      repository: nvcr.io/nvidia/cloud-native
      image: k8s-driver-manager
      version: v0.8.0
    rdma:
      enabled: false
    upgradePolicy:
      autoUpgrade: true
      maxParallelUpgrades: 1
  toolkit:
    enabled: true
    repository: nvcr.io/nvidia/k8s
    image: container-toolkit
    version: v1.17.5-ubuntu20.04
    installDir: /usr/local/nvidia
  devicePlugin:
    enabled: true
    config:
      name: ""
      default: ""
  dcgm:
    enabled: false
  dcgmExporter:
    enabled: true
    serviceMonitor:
      enabled: false
  gfd:
    enabled: true
  migManager:
    enabled: true
    config:
      default: all-disabled
      name: default-mig-parted-config
  nodeStatusExporter:
    enabled: false
  gds:
    enabled: false
  gdrcopy:
    enabled: false
  sandboxWorkloads:
    enabled: true
    defaultWorkload: container
  vgpuManager:
    enabled: false
  hostPaths:
    rootFS: /
    driverInstallDir: /run/nvidia/driver
"#;

#[test]
fn nvidia_policy_deserializes_and_round_trips_unknown_fields() {
    let cp: ClusterPolicy = gpu_stack_core::yaml_guard::from_str(NVIDIA_POLICY).unwrap();
    assert_eq!(cp.spec.driver_request().version, "570.124.06");
    assert_eq!(
        cp.spec.sandbox_default_workload(),
        Some(Workload::Container)
    );
    let back = serde_json::to_value(&cp).unwrap();
    assert_eq!(
        back["spec"]["sandboxWorkloads"]["defaultWorkload"],
        "container"
    );
    assert_eq!(back["spec"]["driver"]["rdma"]["enabled"], false);
    assert_eq!(
        back["spec"]["validator"]["plugin"]["env"][0]["name"],
        "WITH_WORKLOAD"
    );
    assert_eq!(back["spec"]["driver"]["useNvidiaDriverCRD"], false);
    let again: ClusterPolicy = serde_json::from_value(back).unwrap();
    assert_eq!(again.spec, cp.spec);
}

#[test]
fn unsupported_fields_are_listed_not_dropped() {
    let cp: ClusterPolicy = gpu_stack_core::yaml_guard::from_str(NVIDIA_POLICY).unwrap();
    let u = cp.spec.unsupported_fields();
    for want in [
        "spec.driver.rdma",
        "spec.operator.initContainer",
        "spec.dcgmExporter.serviceMonitor",
    ] {
        assert!(u.iter().any(|f| f == want), "{want} missing from {u:?}");
    }
    // Disabled unsupported sections, the disabled standalone DCGM, the
    // driver manager (rendered) and the plugin check's WITH_WORKLOAD
    // (honoured) are quiet.
    for quiet in [
        "spec.validator.plugin",
        "spec.gds",
        "spec.vgpuManager",
        "spec.sandboxWorkloads",
        "spec.dcgm.enabled",
        "spec.driver.manager",
    ] {
        assert!(!u.iter().any(|f| f == quiet), "{quiet} listed in {u:?}");
    }
    assert!(cp.spec.validate().is_empty(), "{:?}", cp.spec.validate());
    assert!(!cp.spec.plugin_workload_wanted());
}

#[test]
fn configs_nvidias_chart_would_create_are_reported_not_dropped() {
    let spec = |v: serde_json::Value| -> ClusterPolicySpec { serde_json::from_value(v).unwrap() };
    // NVIDIA's defaults ask for nothing.
    let defaults = spec(serde_json::json!({
        "devicePlugin": {"config": {"create": false, "name": "", "default": "", "data": {}}},
        "migManager": {"config": {"create": false, "name": "default-mig-parted-config",
                                  "default": "all-disabled", "data": {}}},
        "sandboxWorkloads": {"enabled": false, "mode": "kata"},
    }));
    assert_eq!(defaults.unsupported_fields(), Vec::<String>::new());
    // Time-slicing as NVIDIA's docs write it, and a MIG config to create.
    let asked = spec(serde_json::json!({
        "devicePlugin": {"config": {"create": true, "name": "time-slicing-config",
                                    "default": "any", "data": {"any": "version: v1"}}},
        "migManager": {"config": {"create": true, "name": "custom-mig-config",
                                  "data": {"config.yaml": "version: v1"}}},
        "sandboxWorkloads": {"enabled": true, "mode": "kata"},
    }));
    assert_eq!(
        asked.unsupported_fields(),
        [
            "spec.devicePlugin.config.create",
            "spec.devicePlugin.config.data",
            "spec.devicePlugin.config.name",
            "spec.migManager.config.create",
            "spec.migManager.config.data",
            "spec.sandboxWorkloads.mode",
        ]
    );
    // Round trip keeps them.
    let back = serde_json::to_value(&asked).unwrap();
    assert_eq!(back["devicePlugin"]["config"]["create"], true);
}

#[test]
fn host_paths_take_nvidias_root_fs_and_report_unknown_fields() {
    let spec = |host_paths: serde_json::Value| -> ClusterPolicySpec {
        serde_json::from_value(serde_json::json!({"hostPaths": host_paths})).unwrap()
    };
    for key in ["rootFS", "rootFs"] {
        let s = spec(serde_json::json!({key: "/host-root"}));
        assert_eq!(
            s.host_paths.as_ref().and_then(|h| h.root_fs.as_deref()),
            Some("/host-root"),
            "{key}"
        );
        assert!(s.unsupported_fields().is_empty());
    }
    // Written back under NVIDIA's name.
    let back = serde_json::to_value(spec(serde_json::json!({"rootFs": "/r"}))).unwrap();
    assert_eq!(back["hostPaths"]["rootFS"], "/r");
    let odd = spec(serde_json::json!({"rootFS": "/", "somethingElse": "/x"}));
    assert_eq!(odd.unsupported_fields(), ["spec.hostPaths.somethingElse"]);
}

#[test]
fn the_driver_checks_dev_char_switch_is_honoured_and_the_rest_reported() {
    let spec = |driver: serde_json::Value| -> ClusterPolicySpec {
        serde_json::from_value(serde_json::json!({"validator": {"driver": driver}})).unwrap()
    };
    let off = spec(serde_json::json!({"env": [
        {"name": "DISABLE_DEV_CHAR_SYMLINK_CREATION", "value": "true"}
    ]}));
    assert!(!off.dev_char_links_wanted());
    assert!(off.unsupported_fields().is_empty());
    let on = spec(serde_json::json!({"env": [
        {"name": "DISABLE_DEV_CHAR_SYMLINK_CREATION", "value": "false"}
    ]}));
    assert!(on.dev_char_links_wanted());
    assert!(ClusterPolicySpec::default().dev_char_links_wanted());
    let other = spec(serde_json::json!({"env": [{"name": "OTHER", "value": "1"}]}));
    assert_eq!(other.unsupported_fields(), ["spec.validator.driver"]);
}

#[test]
fn vm_operand_sections_are_reported_only_with_sandbox_workloads_on() {
    // NVIDIA's chart defaults: several VM operands say `enabled: true`, and
    // NVIDIA's operator deploys none of them while sandbox workloads are off.
    let spec = |sandbox: serde_json::Value| -> ClusterPolicySpec {
        serde_json::from_value(serde_json::json!({
            "sandboxWorkloads": sandbox,
            "vfioManager": {"enabled": true},
            "sandboxDevicePlugin": {"enabled": true},
            "vgpuDeviceManager": {"enabled": true},
            "kataManager": {"enabled": false},
            "gdrcopy": {"enabled": true},
        }))
        .unwrap()
    };
    let off = spec(serde_json::json!({"enabled": false, "defaultWorkload": "container"}));
    assert_eq!(off.sandbox_default_workload(), None);
    assert_eq!(off.label_policy().sandbox_default, None);
    assert_eq!(off.unsupported_fields(), ["spec.gdrcopy"]);
    let on = spec(
        serde_json::json!({"enabled": true, "defaultWorkload": "vm-passthrough", "mode": "kubevirt"}),
    );
    assert_eq!(
        on.label_policy().sandbox_default,
        Some(Workload::VmPassthrough)
    );
    assert_eq!(
        on.unsupported_fields(),
        [
            "spec.gdrcopy",
            "spec.sandboxDevicePlugin",
            "spec.vfioManager",
            "spec.vgpuDeviceManager"
        ]
    );
    assert!(on.validate().is_empty());
    let bad =
        spec(serde_json::json!({"enabled": true, "defaultWorkload": "vm", "mode": "qemu", "x": 1}));
    let paths: Vec<String> = bad.validate().into_iter().map(|e| e.path).collect();
    assert_eq!(
        paths,
        [
            "spec.sandboxWorkloads.defaultWorkload",
            "spec.sandboxWorkloads.mode"
        ]
    );
    assert!(
        bad.unsupported_fields()
            .contains(&"spec.sandboxWorkloads.x".to_string())
    );
}

#[test]
fn the_plugin_checks_workload_switch_is_honoured_and_the_rest_reported() {
    let spec = |plugin: serde_json::Value| -> ClusterPolicySpec {
        serde_json::from_value(serde_json::json!({"validator": {"plugin": plugin}})).unwrap()
    };
    let workload = spec(serde_json::json!({"env": [{"name": "WITH_WORKLOAD", "value": "true"}]}));
    assert!(workload.plugin_workload_wanted());
    assert!(workload.unsupported_fields().is_empty());
    let other = spec(serde_json::json!({"env": [
        {"name": "WITH_WORKLOAD", "value": "false"},
        {"name": "SLEEP_INTERVAL_SECONDS", "value": "10"}]}));
    assert!(!other.plugin_workload_wanted());
    assert_eq!(other.unsupported_fields(), ["spec.validator.plugin"]);
    assert!(ClusterPolicySpec::default().plugin_workload_wanted());
}

#[test]
fn the_exporter_services_knobs_are_honoured_and_the_rest_reported() {
    let spec = |service: serde_json::Value| -> ClusterPolicySpec {
        serde_json::from_value(serde_json::json!({"dcgmExporter": {"service": service}})).unwrap()
    };
    let knobs = spec(serde_json::json!({"type": "NodePort", "internalTrafficPolicy": "Local"}));
    assert!(knobs.unsupported_fields().is_empty());
    assert_eq!(knobs.exporter_service().type_.as_deref(), Some("NodePort"));
    let other = spec(serde_json::json!({"type": "ClusterIP", "loadBalancerIP": "10.0.0.9"}));
    assert_eq!(other.unsupported_fields(), ["spec.dcgmExporter.service"]);
}

#[test]
fn defaults_follow_nvidia() {
    let spec = ClusterPolicySpec::default();
    let en = spec.enablement();
    assert!(
        en.driver && en.toolkit && en.device_plugin && en.gfd && en.dcgm_exporter && en.mig_manager
    );
    assert!(!en.node_status_exporter);
    assert_eq!(spec.mig_strategy(), "single");
    assert_eq!(spec.mig_config_default(), "all-disabled");
    assert_eq!(spec.runtime_class(), "nvidia");
    assert!(spec.cdi_enabled());
    assert_eq!(
        spec.image_settings(Component::ContainerToolkit).image,
        "nvcr.io/nvidia/k8s/container-toolkit:v1.20.0"
    );
    assert!(
        spec.image_settings(Component::DevicePlugin)
            .image
            .starts_with("ghcr.io/gpu-stack/gpu-device-plugin:")
    );
    let d = spec.driver_request();
    assert_eq!(
        (d.repository.as_str(), d.image.as_str()),
        ("nvcr.io/nvidia", "driver")
    );
}

#[test]
fn image_overrides_and_digests() {
    let spec: ClusterPolicySpec = serde_json::from_value(serde_json::json!({
        "devicePlugin": {"repository": "registry.local/gpu", "version": "sha256:abc"},
        "gfd": {"image": "registry.local/gfd:1.2"},
    }))
    .unwrap();
    assert_eq!(
        spec.image_settings(Component::DevicePlugin).image,
        "registry.local/gpu/gpu-device-plugin@sha256:abc"
    );
    assert_eq!(
        spec.image_settings(Component::GpuFeatureDiscovery).image,
        "registry.local/gfd:1.2"
    );
}

#[test]
fn validation_names_field_and_fix() {
    let spec: ClusterPolicySpec = serde_json::from_value(serde_json::json!({
        "mig": {"strategy": "Mixed"},
        "driver": {"kernelModuleType": "closed", "usePrecompiled": true, "version": "sha256:00"},
        "daemonsets": {"updateStrategy": "Recreate", "rollingUpdate": {"maxUnavailable": "a lot"}},
        "cdi": {"enabled": false, "nriPluginEnabled": true},
        "dcgmExporter": {"env": [{"name": "", "value": "x"}], "imagePullPolicy": "always"},
    }))
    .unwrap();
    let errs = spec.validate();
    let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
    for want in [
        "spec.mig.strategy",
        "spec.driver.kernelModuleType",
        "spec.driver.version",
        "spec.daemonsets.updateStrategy",
        "spec.daemonsets.rollingUpdate.maxUnavailable",
        "spec.cdi.nriPluginEnabled",
        "spec.dcgmExporter.env[0].name",
        "spec.dcgmExporter.imagePullPolicy",
    ] {
        assert!(paths.contains(&want), "{want} not in {paths:?}");
    }
    let mig = errs.iter().find(|e| e.path == "spec.mig.strategy").unwrap();
    assert!(mig.to_string().contains("none, single, mixed"));
}

#[test]
fn driver_delegated_to_nvidiadriver_leaves_the_policy_driver_out() {
    let spec: ClusterPolicySpec =
        serde_json::from_value(serde_json::json!({"driver": {"useNvidiaDriverCRD": true}}))
            .unwrap();
    assert!(!spec.enablement().driver);
    assert!(spec.uses_nvidia_driver_crd());
    assert!(spec.unsupported_fields().is_empty());
    let off: ClusterPolicySpec = serde_json::from_value(
        serde_json::json!({"driver": {"enabled": false, "useNvidiaDriverCRD": true}}),
    )
    .unwrap();
    assert!(!off.uses_nvidia_driver_crd());
}

#[test]
fn upgrade_policy_is_typed_with_nvidia_defaults() {
    let cp: ClusterPolicy = gpu_stack_core::yaml_guard::from_str(NVIDIA_POLICY).unwrap();
    let u = cp.spec.upgrade_policy().unwrap();
    assert!(u.auto_upgrade);
    assert_eq!(u.max_parallel_upgrades, 1);
    // Unset fields take the defaults NVIDIA's CRD writes.
    assert_eq!(
        u.max_unavailable,
        gpu_stack_core::operator::upgrade::policy::IntOrString::String("25%".into())
    );
    assert_eq!(u.pod_deletion.timeout_seconds, 300);
    assert!(!u.drain.enable);
    assert!(ClusterPolicySpec::default().upgrade_policy().is_none());
}

#[test]
fn upgrade_policy_unknown_keys_are_reported() {
    // `gpuPodDeletion` is the Helm values key; in a ClusterPolicy it is `podDeletion`.
    let spec: ClusterPolicySpec = serde_json::from_value(serde_json::json!({
        "driver": {"upgradePolicy": {
            "autoUpgrade": true,
            "maxUnavailable": 2,
            "gpuPodDeletion": {"force": true},
            "drain": {"enable": true, "skipWaitForDeleteTimeout": 10},
        }},
    }))
    .unwrap();
    let u = spec.unsupported_fields();
    for want in [
        "spec.driver.upgradePolicy.gpuPodDeletion",
        "spec.driver.upgradePolicy.drain.skipWaitForDeleteTimeout",
    ] {
        assert!(u.iter().any(|f| f == want), "{want} missing from {u:?}");
    }
    assert!(!u.iter().any(|f| f == "spec.driver.upgradePolicy"), "{u:?}");
    assert!(spec.validate().is_empty(), "{:?}", spec.validate());
    // Kept verbatim.
    let back = serde_json::to_value(&spec).unwrap();
    assert_eq!(
        back["driver"]["upgradePolicy"]["gpuPodDeletion"]["force"],
        true
    );
    assert_eq!(back["driver"]["upgradePolicy"]["maxUnavailable"], 2);
}

#[test]
fn upgrade_policy_errors_name_the_field_when_auto_upgrade_is_on() {
    let bad = serde_json::json!({
        "maxUnavailable": "half",
        "maxParallelUpgrades": -2,
        "drain": {"podSelector": "app in (a"},
    });
    let mut doc = serde_json::json!({"driver": {"upgradePolicy": bad}});
    // Off: NVIDIA ignores every other field, and so do we.
    let spec: ClusterPolicySpec = serde_json::from_value(doc.clone()).unwrap();
    assert!(spec.validate().is_empty(), "{:?}", spec.validate());
    doc["driver"]["upgradePolicy"]["autoUpgrade"] = true.into();
    let spec: ClusterPolicySpec = serde_json::from_value(doc).unwrap();
    let errs = spec.validate();
    let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(
        paths,
        vec![
            "spec.driver.upgradePolicy.maxParallelUpgrades",
            "spec.driver.upgradePolicy.maxUnavailable",
            "spec.driver.upgradePolicy.drain.podSelector",
        ]
    );
    let mu = &errs[1];
    assert!(mu.message.contains("\"25%\""), "{}", mu.message);
    assert!(
        mu.to_string()
            .starts_with("spec.driver.upgradePolicy.maxUnavailable: ")
    );
}

#[test]
fn crd_schema_carries_nvidia_upgrade_defaults() {
    let crd = serde_json::to_value(<ClusterPolicy as kube::CustomResourceExt>::crd()).unwrap();
    let u = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        ["driver"]["properties"]["upgradePolicy"];
    assert_eq!(u["x-kubernetes-preserve-unknown-fields"], true);
    let p = &u["properties"];
    assert_eq!(p["maxParallelUpgrades"]["default"], 1);
    assert_eq!(p["maxParallelUpgrades"]["minimum"].as_f64(), Some(0.0));
    assert_eq!(p["maxUnavailable"]["default"], "25%");
    assert_eq!(p["maxUnavailable"]["x-kubernetes-int-or-string"], true);
    assert_eq!(
        p["podDeletion"]["properties"]["timeoutSeconds"]["default"],
        300
    );
    assert_eq!(p["drain"]["properties"]["timeoutSeconds"]["default"], 300);
    assert_eq!(
        p["waitForCompletion"]["properties"]["timeoutSeconds"]["default"],
        0
    );
    assert_eq!(p["autoUpgrade"]["default"], false);
}

#[test]
fn dra_driver_is_off_by_default_and_owns_mig_layouts_when_on() {
    let spec = ClusterPolicySpec::default();
    assert!(!spec.dra_driver_enabled());
    assert!(!spec.enablement().dra_plugin);
    assert_eq!(spec.dra_driver_name(), "gpu.nvidia.com");
    assert!(
        spec.image_settings(Component::DraPlugin)
            .image
            .starts_with("ghcr.io/gpu-stack/gpu-dra-plugin:")
    );

    // The NVIDIA document is untouched by the extension.
    let cp: ClusterPolicy = gpu_stack_core::yaml_guard::from_str(NVIDIA_POLICY).unwrap();
    assert!(cp.spec.enablement().mig_manager);
    assert!(
        !cp.spec
            .unsupported_fields()
            .iter()
            .any(|f| f.contains("draDriver"))
    );

    let mut on = cp.spec.clone();
    on.dra_driver = Some(DraDriverSpec {
        common: ComponentSpec {
            enabled: Some(true),
            ..ComponentSpec::default()
        },
        driver_name: Some("gpu.example.com".into()),
    });
    let en = on.enablement();
    assert!(en.dra_plugin);
    assert!(!en.mig_manager, "one owner of a GPU layout");
    assert!(en.device_plugin, "the device plugin stays as configured");
    assert_eq!(on.dra_driver_name(), "gpu.example.com");
    // The MIG manager asked for is reported as not acted on ...
    assert!(
        on.unsupported_fields()
            .iter()
            .any(|f| f == "spec.migManager")
    );
    // ... unless it is switched off, or not asked for at all.
    on.mig_manager = Some(MigManagerSpec {
        common: ComponentSpec {
            enabled: Some(false),
            ..ComponentSpec::default()
        },
        ..MigManagerSpec::default()
    });
    assert!(
        !on.unsupported_fields()
            .iter()
            .any(|f| f.starts_with("spec.migManager"))
    );
    on.mig_manager = None;
    assert!(
        !on.unsupported_fields()
            .iter()
            .any(|f| f.starts_with("spec.migManager"))
    );
    assert!(on.validate().is_empty(), "{:?}", on.validate());
}

#[test]
fn dra_driver_round_trips_and_reports_unknown_keys() {
    let spec: ClusterPolicySpec = serde_json::from_value(serde_json::json!({
        "draDriver": {
            "enabled": true,
            "repository": "registry.local/gpu-stack",
            "version": "1.2.3",
            "imagePullPolicy": "Always",
            "env": [{"name": "GPU_STACK_BACKEND", "value": "simulated"}],
            "resources": {"limits": {"memory": "256Mi"}},
            "featureGates": {"MPSSupport": true},
        }
    }))
    .unwrap();
    let d = spec.dra_driver.as_ref().expect("typed, not in extra");
    assert!(spec.extra.is_empty());
    assert_eq!(d.common.env[0].value, "simulated");
    let image = spec.image_settings(Component::DraPlugin);
    assert_eq!(image.image, "registry.local/gpu-stack/gpu-dra-plugin:1.2.3");
    assert_eq!(image.pull_policy, "Always");
    assert_eq!(
        spec.unsupported_fields(),
        ["spec.draDriver.featureGates"],
        "unknown keys of the section are listed like any other section's"
    );
    let back: ClusterPolicySpec =
        serde_json::from_value(serde_json::to_value(&spec).unwrap()).unwrap();
    assert_eq!(back, spec);
}

#[test]
fn dra_driver_name_and_common_fields_are_validated() {
    for bad in ["GPU.example.com", "a..b", "-a.com", "a/b"] {
        let spec: ClusterPolicySpec = serde_json::from_value(serde_json::json!({
            "draDriver": {"enabled": true, "driverName": bad}
        }))
        .unwrap();
        let errs = spec.validate();
        assert!(
            errs.iter()
                .any(|e| e.path == "spec.draDriver.driverName"
                    && e.message.contains("DNS subdomain")),
            "{bad}: {errs:?}"
        );
    }
    let spec: ClusterPolicySpec = serde_json::from_value(serde_json::json!({
        "draDriver": {"imagePullPolicy": "sometimes", "driverName": "a".repeat(64)}
    }))
    .unwrap();
    let paths: Vec<String> = spec.validate().into_iter().map(|e| e.path).collect();
    assert_eq!(
        paths,
        [
            "spec.draDriver.imagePullPolicy",
            "spec.draDriver.driverName"
        ]
    );
}

#[test]
fn crd_schema_documents_the_dra_driver_section() {
    let crd = serde_json::to_value(<ClusterPolicy as kube::CustomResourceExt>::crd()).unwrap();
    let d = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        ["draDriver"];
    assert_eq!(d["x-kubernetes-preserve-unknown-fields"], true);
    assert!(
        d["description"]
            .as_str()
            .is_some_and(|s| s.contains("MIG manager is not deployed")),
        "{d}"
    );
    let p = &d["properties"];
    assert_eq!(p["driverName"]["maxLength"], 63);
    assert!(p["driverName"]["pattern"].is_string());
    for common in [
        "enabled",
        "repository",
        "image",
        "version",
        "env",
        "resources",
        "args",
    ] {
        assert!(p[common].is_object(), "{common} missing from {p}");
    }
}
