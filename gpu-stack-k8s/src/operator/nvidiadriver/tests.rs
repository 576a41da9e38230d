use gpu_stack_core::operator::driver::DriverNode;
use gpu_stack_core::operator::labels::Labels;
use gpu_stack_core::operator::nvidiadriver::{OWNER_LABEL, route, validate};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::*;

/// NVIDIADrivers as the NVIDIA documentation writes them: a default and a
/// pool, with fields this operator does not act on.
const NVIDIA_DRIVERS: &str = r#"
apiVersion: nvidia.com/v1alpha1
kind: NVIDIADriver
metadata:
  name: h100-pool
spec:
  driverType: gpu
  default: false
  image: driver
  repository: nvcr.io/nvidia
  version: "570.172.08"
  kernelModuleType: open
  usePrecompiled: false
  imagePullPolicy: IfNotPresent
  nodeSelector:
    nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3
  manager:
    repository: nvcr.io/nvidia/cloud-native
    image: k8s-driver-manager
    version: v0.8.0
    env:
      - name: ENABLE_GPU_POD_EVICTION
        value: "true"
  startupProbe:
    initialDelaySeconds: 60
    periodSeconds: 10
    failureThreshold: 120
  rdma:
    enabled: false
    useHostMofed: false
  gds:
    enabled: false
  licensingConfig:
    secretName: licensing-config
    nlsEnabled: true
  upgradePolicy:
    autoUpgrade: true
    maxParallelUpgrades: 1
    maxUnavailable: 25%
    drain:
      enable: false
      timeoutSeconds: 300
  tolerations:
    - key: nvidia.com/gpu
      operator: Exists
      effect: NoSchedule
  priorityClassName: system-node-critical
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms:
        - matchExpressions:
            - key: kubernetes.io/arch
              operator: In
              values: [amd64]
  hostNetwork: false
  futureField: 1
"#;

#[test]
fn nvidia_document_deserializes_and_round_trips() {
    let d: NvidiaDriver = gpu_stack_core::yaml_guard::from_str(NVIDIA_DRIVERS).unwrap();
    assert_eq!(d.name(), "h100-pool");
    assert_eq!(d.spec.kernel_module_type, KernelModuleType::Open);
    assert_eq!(
        d.spec.manager.as_ref().unwrap().env[0].name,
        "ENABLE_GPU_POD_EVICTION"
    );
    let policy = d.spec.upgrade_policy();
    assert_eq!(
        policy.max_unavailable,
        gpu_stack_core::operator::upgrade::policy::IntOrString::String("25%".into())
    );
    let back = serde_json::to_value(&d).unwrap();
    assert_eq!(back["spec"]["futureField"], 1);
    assert_eq!(back["spec"]["driverType"], "gpu");
    assert_eq!(back["spec"]["licensingConfig"]["nlsEnabled"], true);
    assert_eq!(
        back["spec"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            [0]["matchExpressions"][0]["key"],
        "kubernetes.io/arch"
    );
    let again: NvidiaDriver = serde_json::from_value(back).unwrap();
    assert_eq!(again.spec, d.spec);
}

#[test]
fn defaults_follow_nvidia() {
    let spec: NvidiaDriverSpec = serde_json::from_value(serde_json::json!({})).unwrap();
    assert_eq!(spec, NvidiaDriverSpec::default());
    assert!(!spec.default);
    assert_eq!(spec.driver_type, DriverType::Gpu);
    assert_eq!(spec.kernel_module_type, KernelModuleType::Auto);
    assert_eq!(spec.image, DEFAULT_IMAGE);
    let req = spec.driver_request();
    assert_eq!(
        (req.repository.as_str(), req.image.as_str()),
        ("", DEFAULT_IMAGE)
    );
    assert!(spec.unsupported_fields().is_empty());
    // The enums take NVIDIA's spellings and nothing else.
    let vgpu: NvidiaDriverSpec =
        serde_json::from_value(serde_json::json!({"driverType": "vgpu-host-manager"})).unwrap();
    assert_eq!(vgpu.driver_type, DriverType::VgpuHostManager);
    assert!(
        serde_json::from_value::<NvidiaDriverSpec>(serde_json::json!({"driverType": "GPU"}))
            .is_err()
    );
    let st: NvidiaDriverStatus =
        serde_json::from_value(serde_json::json!({"state": "notReady"})).unwrap();
    assert_eq!(st.state, NvidiaDriverState::NotReady);
    assert_eq!(st.state.as_str(), "notReady");
}

#[test]
fn unsupported_fields_are_listed_not_dropped() {
    let d: NvidiaDriver = gpu_stack_core::yaml_guard::from_str(NVIDIA_DRIVERS).unwrap();
    let u = d.spec.unsupported_fields();
    assert_eq!(
        u,
        [
            "spec.futureField",
            "spec.licensingConfig",
            "spec.nodeAffinity",
        ]
    );
    // Disabled add-ons, hostNetwork=false and the upgrade policy are quiet.
    let vgpu: NvidiaDriverSpec = serde_json::from_value(serde_json::json!({
        "driverType": "vgpu",
        "gdrcopy": {"enabled": true},
        "rdma": {"useHostMofed": true},
        "hostNetwork": true,
        "secretEnv": "driver-secrets",
    }))
    .unwrap();
    assert_eq!(
        vgpu.unsupported_fields(),
        [
            "spec.driverType",
            "spec.gdrcopy",
            "spec.hostNetwork",
            "spec.rdma",
            "spec.secretEnv",
        ]
    );
}

fn driver(name: &str, spec: serde_json::Value) -> NvidiaDriver {
    let spec: NvidiaDriverSpec = serde_json::from_value(spec).unwrap();
    NvidiaDriver::new(name, spec)
}

fn node(name: &str, labels: &[(&str, &str)]) -> DriverNode {
    DriverNode {
        name: name.into(),
        labels: labels
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect::<Labels>(),
        gpus: vec![],
    }
}

#[test]
fn resources_route_and_report_conflicts() {
    let mut gone = driver("gone", serde_json::json!({"version": "570.1"}));
    gone.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
    let drivers = [
        driver(
            "default",
            serde_json::json!({"default": true, "version": "595.91.07"}),
        ),
        driver(
            "h100",
            serde_json::json!({"version": "570.1", "nodeSelector": {"pool": "h100"}}),
        ),
        driver(
            "zone-a",
            serde_json::json!({"version": "570.1", "nodeSelector": {"zone": "a"}}),
        ),
        gone,
    ];
    let crs = driver_crs(&drivers);
    assert_eq!(crs.len(), 3, "the deleting resource is left out");
    assert!(crs[0].is_default && crs[0].node_selector.is_empty());
    let nodes = [
        node("n1", &[("pool", "h100")]),
        node(
            "n2",
            &[("pool", "h100"), ("zone", "a"), (OWNER_LABEL, "h100")],
        ),
        node("n3", &[]),
    ];
    let r = route(&nodes, &crs);
    assert_eq!(r.owners["n1"], "h100");
    assert_eq!(r.owners["n2"], "h100");
    assert!(!r.labels.contains_key("n2"));
    assert_eq!(r.owners["n3"], "default");
    for name in ["h100", "zone-a"] {
        let c = conflict_condition(&r, name).unwrap();
        assert_eq!(c.reason, "ConflictingNodeSelector");
        assert_eq!(c.type_, condition::ERROR);
        assert!(c.message.contains("node n2"), "{}", c.message);
    }
    assert!(conflict_condition(&r, "default").is_none());
    for cr in &crs {
        assert!(validate(cr, &r, &nodes).is_empty(), "{}", cr.name);
    }
}

#[test]
fn refused_resources_get_an_error_condition() {
    let bad = driver(
        "bad",
        serde_json::json!({"default": true, "nodeSelector": {OWNER_LABEL: "x"}}),
    );
    let cr = bad.driver_cr();
    let r = route(&[], std::slice::from_ref(&cr));
    let problems = validate(&cr, &r, &[]);
    assert_eq!(problems.len(), 3, "{problems:?}");
    let c = refused_condition(&problems).unwrap();
    assert_eq!(c.reason, reason::INVALID_SPEC);
    assert!(c.message.contains("reserved label"), "{}", c.message);
    assert!(
        c.message.contains("must not set spec.nodeSelector"),
        "{}",
        c.message
    );
    assert!(c.message.contains("spec.version is empty"), "{}", c.message);
    assert!(refused_condition(&[]).is_none());
}

#[test]
fn crd_has_nvidia_names_rules_and_columns() {
    use kube::CustomResourceExt;
    let crd = NvidiaDriver::crd();
    assert_eq!(
        crd.metadata.name.as_deref(),
        Some("nvidiadrivers.nvidia.com")
    );
    assert_eq!(crd.spec.scope, "Cluster");
    assert_eq!(
        crd.spec.names.short_names.as_deref(),
        Some(&["nvd".to_string(), "nvdriver".into(), "nvdrivers".into()][..])
    );
    let v = &crd.spec.versions[0];
    assert_eq!(v.name, "v1alpha1");
    assert!(v.subresources.as_ref().unwrap().status.is_some());
    let cols: Vec<&str> = v
        .additional_printer_columns
        .iter()
        .flatten()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(cols, ["Status", "Default", "Age"]);
    let schema = serde_json::to_value(&v.schema).unwrap();
    let spec = &schema["openAPIV3Schema"]["properties"]["spec"];
    assert_eq!(
        spec["x-kubernetes-validations"][0]["message"],
        "default NVIDIADriver must not use nodeSelector"
    );
    let props = &spec["properties"];
    assert_eq!(
        props["driverType"]["x-kubernetes-validations"][0]["rule"],
        "self == oldSelf"
    );
    assert_eq!(
        props["usePrecompiled"]["x-kubernetes-validations"][0]["rule"],
        "self == oldSelf"
    );
    assert_eq!(props["driverType"]["default"], "gpu");
    assert_eq!(props["image"]["default"], DEFAULT_IMAGE);
    assert_eq!(
        props["kernelModuleType"]["enum"],
        serde_json::json!(["auto", "open", "proprietary"])
    );
    assert_eq!(
        schema["openAPIV3Schema"]["properties"]["status"]["properties"]["state"]["enum"],
        serde_json::json!(["ignored", "ready", "notReady", "disabled"])
    );
    // Every field of NVIDIA's NVIDIADriverSpec is in the schema.
    for field in [
        "default",
        "driverType",
        "usePrecompiled",
        "useOpenKernelModules",
        "kernelModuleType",
        "startupProbe",
        "livenessProbe",
        "readinessProbe",
        "rdma",
        "gds",
        "gdrcopy",
        "repository",
        "image",
        "version",
        "imagePullPolicy",
        "imagePullSecrets",
        "manager",
        "resources",
        "args",
        "env",
        "repoConfig",
        "certConfig",
        "licensingConfig",
        "virtualTopologyConfig",
        "kernelModuleConfig",
        "secretEnv",
        "upgradePolicy",
        "nodeSelector",
        "nodeAffinity",
        "labels",
        "annotations",
        "tolerations",
        "priorityClassName",
        "podSecurityContext",
        "hostNetwork",
    ] {
        assert!(
            props.get(field).is_some(),
            "{field} missing from the schema"
        );
    }
}

/// The committed CRD (deploy/crds, copied into the chart) is what the types
/// generate; `GPU_STACK_BLESS=1` rewrites it.
#[test]
fn crd_is_up_to_date() {
    crate::operator::committed::check("crds/nvidia.com_nvidiadrivers.yaml", &crd_yaml().unwrap());
}

#[test]
fn upgrade_policy_defaults_to_automatic_as_in_nvidia() {
    let none: NvidiaDriverSpec = serde_json::from_value(serde_json::json!({})).unwrap();
    let p = none.upgrade_policy();
    assert!(p.auto_upgrade);
    assert_eq!(p.max_parallel_upgrades, 1);
    // A policy written without autoUpgrade reads the same as the CRD defaults it.
    let partial: NvidiaDriverSpec =
        serde_json::from_value(serde_json::json!({"upgradePolicy": {"maxUnavailable": 2}}))
            .unwrap();
    assert!(partial.upgrade_policy().auto_upgrade);
    let off: NvidiaDriverSpec =
        serde_json::from_value(serde_json::json!({"upgradePolicy": {"autoUpgrade": false}}))
            .unwrap();
    assert!(!off.upgrade_policy().auto_upgrade);
}

#[test]
fn a_bad_upgrade_policy_refuses_the_resource_and_names_the_field() {
    let d: NvidiaDriver = serde_json::from_value(serde_json::json!({
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "NVIDIADriver",
        "metadata": {"name": "pool"},
        "spec": {"version": "595.91.07", "upgradePolicy": {"maxUnavailable": "150%", "surprise": 1}},
    }))
    .unwrap();
    let problems = gpu_stack_core::operator::nvidiadriver::validate_spec(&d.driver_cr());
    assert_eq!(problems.len(), 1, "{problems:?}");
    let text = problems[0].to_string();
    assert!(
        text.starts_with("NVIDIADriver pool: spec.upgradePolicy.maxUnavailable:"),
        "{text}"
    );
    assert_eq!(d.spec.unsupported_fields(), ["spec.upgradePolicy.surprise"]);
}
