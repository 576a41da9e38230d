//! Smoke tests proving the test control plane is a real Kubernetes: DaemonSet
//! scheduling onto kwok GPU nodes, CRD OpenAPI validation and server-side apply
//! conflicts. They need the cluster that `cargo xtask test` starts.
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use gpu_stack_e2e::{
    E2eError, GpuFleet, TestCluster, gpu_probe_daemonset, unique_suffix, wait_for,
};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{
    ApiResource, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams,
};
use kube::{Api, ResourceExt};
use serde_json::json;

/// Bound on each wait, so a broken cluster fails the run instead of hanging it.
const WAIT: Duration = Duration::from_secs(240);

#[tokio::test]
async fn daemonset_with_node_selector_runs_exactly_one_pod_per_fake_gpu_node() {
    let cluster = TestCluster::attach().await.unwrap();
    let run = unique_suffix();
    let run_label = "e2e.gpu-stack.dev/run";
    let fleet = GpuFleet::new(format!("smoke-{run}"), 50).with_label(run_label, &run);
    let nodes = cluster.create_gpu_nodes(&fleet).await.unwrap();
    // A node outside the selector must get no pod.
    let outsider = GpuFleet::new(format!("smoke-other-{run}"), 1);
    let outsider_nodes = cluster.create_gpu_nodes(&outsider).await.unwrap();
    let ns = cluster.create_namespace("smoke-ds").await.unwrap();

    let ds = gpu_probe_daemonset("gpu-probe", &format!("probe-{run}"), run_label, &run);
    Api::<DaemonSet>::namespaced(cluster.client(), &ns)
        .create(&PostParams::default(), &ds)
        .await
        .unwrap();

    let pods_api = Api::<Pod>::namespaced(cluster.client(), &ns);
    let running = wait_for("50 DaemonSet pods Running", WAIT, || {
        let pods_api = pods_api.clone();
        async move {
            let pods = pods_api.list(&ListParams::default()).await?;
            let running: Vec<Pod> = pods
                .items
                .into_iter()
                .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
                .collect();
            Ok::<_, E2eError>((running.len() >= 50).then_some(running))
        }
    })
    .await
    .unwrap();

    assert_eq!(running.len(), 50, "exactly one pod per selected node");
    let on: BTreeSet<String> = running
        .iter()
        .filter_map(|p| p.spec.as_ref().and_then(|s| s.node_name.clone()))
        .collect();
    let expected: BTreeSet<String> = nodes.iter().cloned().collect();
    assert_eq!(
        on, expected,
        "one pod on each selected node, none elsewhere"
    );
    assert!(!on.contains(&outsider_nodes[0]));

    let ds_status = wait_for("DaemonSet status to count 50 ready pods", WAIT, || {
        let api = Api::<DaemonSet>::namespaced(cluster.client(), &ns);
        async move {
            let ds = api.get("gpu-probe").await?;
            let status = ds.status.unwrap_or_default();
            Ok::<_, E2eError>((status.number_ready == 50).then_some(status))
        }
    })
    .await
    .unwrap();
    assert_eq!(ds_status.desired_number_scheduled, 50);
    assert_eq!(ds_status.current_number_scheduled, 50);

    cluster.delete_namespace(&ns).await.unwrap();
    cluster.delete_nodes(&nodes).await.unwrap();
    cluster.delete_nodes(&outsider_nodes).await.unwrap();
}

#[tokio::test]
async fn crd_openapi_schema_rejects_an_invalid_object() {
    let cluster = TestCluster::attach().await.unwrap();
    let group = "e2e.gpu-stack.dev";
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": { "name": format!("gpuprobes.{group}") },
        "spec": {
            "group": group,
            "names": { "kind": "GpuProbe", "plural": "gpuprobes", "singular": "gpuprobe" },
            "scope": "Namespaced",
            "versions": [{
                "name": "v1",
                "served": true,
                "storage": true,
                "schema": { "openAPIV3Schema": {
                    "type": "object",
                    "properties": { "spec": {
                        "type": "object",
                        "required": ["gpus"],
                        "properties": {
                            "gpus": { "type": "integer", "minimum": 1, "maximum": 16 },
                            "mode": { "type": "string", "enum": ["full", "mig"] }
                        }
                    }}
                }}
            }]
        }
    }))
    .unwrap();
    // Apply, so reruns against a long-lived `cluster up` cluster are fine.
    let crds = Api::<CustomResourceDefinition>::all(cluster.client());
    crds.patch(
        &crd.name_any(),
        &PatchParams::apply("gpu-stack-e2e").force(),
        &Patch::Apply(&crd),
    )
    .await
    .unwrap();
    wait_for("the CRD to be Established", WAIT, || {
        let crds = crds.clone();
        let name = crd.name_any();
        async move {
            let crd = crds.get(&name).await?;
            let established = crd
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True");
            Ok::<_, E2eError>(established.then_some(()))
        }
    })
    .await
    .unwrap();

    let ns = cluster.create_namespace("smoke-crd").await.unwrap();
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(group, "v1", "GpuProbe"),
        "gpuprobes",
    );
    let api = Api::<DynamicObject>::namespaced_with(cluster.client(), &ns, &resource);
    let object = |name: &str, spec: serde_json::Value| {
        DynamicObject::new(name, &resource).data(json!({ "spec": spec }))
    };

    // A valid object is stored (retried while the new API is being published).
    wait_for("a valid GpuProbe to be accepted", WAIT, || {
        let api = api.clone();
        let valid = object("valid", json!({ "gpus": 8, "mode": "mig" }));
        async move {
            match api.create(&PostParams::default(), &valid).await {
                Ok(created) => Ok(Some(created)),
                Err(kube::Error::Api(status)) if status.is_not_found() => Ok(None),
                Err(err) => Err(err.into()),
            }
        }
    })
    .await
    .unwrap();

    for (name, spec, field) in [
        ("too-many", json!({ "gpus": 64 }), "spec.gpus"),
        ("wrong-type", json!({ "gpus": "eight" }), "spec.gpus"),
        (
            "bad-mode",
            json!({ "gpus": 1, "mode": "shared" }),
            "spec.mode",
        ),
        ("missing", json!({ "mode": "full" }), "spec.gpus"),
    ] {
        let err = api
            .create(&PostParams::default(), &object(name, spec))
            .await
            .expect_err(name);
        match err {
            kube::Error::Api(status) => {
                assert_eq!(status.code, 422, "{name}: {status:?}");
                assert!(status.is_invalid(), "{name}: {status:?}");
                assert!(status.message.contains(field), "{name}: {}", status.message);
            }
            other => panic!("{name}: expected a 422 Invalid, got {other:?}"),
        }
        let missing = api.get_opt(name).await.unwrap();
        assert!(missing.is_none(), "{name} must not be stored");
    }
    cluster.delete_namespace(&ns).await.unwrap();
}

#[tokio::test]
async fn server_side_apply_reports_conflicts_between_field_managers() {
    let cluster = TestCluster::attach().await.unwrap();
    let ns = cluster.create_namespace("smoke-ssa").await.unwrap();
    let api = Api::<ConfigMap>::namespaced(cluster.client(), &ns);
    let config = |value: &str| ConfigMap {
        metadata: ObjectMeta {
            name: Some("mig-config".into()),
            ..ObjectMeta::default()
        },
        data: Some(BTreeMap::from([("profile".to_string(), value.to_string())])),
        ..ConfigMap::default()
    };
    let apply = |manager: &str, force: bool, value: &str| {
        let api = api.clone();
        let mut params = PatchParams::apply(manager);
        params.force = force;
        let cm = config(value);
        async move { api.patch("mig-config", &params, &Patch::Apply(&cm)).await }
    };
    // Managers that own `data.profile` according to managedFields.
    let managers = |cm: &ConfigMap| -> BTreeSet<String> {
        cm.metadata
            .managed_fields
            .iter()
            .flatten()
            .filter(|m| {
                m.fields_v1
                    .as_ref()
                    .and_then(|f| f.0.get("f:data"))
                    .and_then(|d| d.get("f:profile"))
                    .is_some()
            })
            .filter_map(|m| m.manager.clone())
            .collect()
    };

    apply("operator", false, "all-1g.10gb").await.unwrap();

    // Another manager changing an owned field is refused with 409 Conflict
    // naming the owner, and nothing changes.
    match apply("admin", false, "all-disabled").await {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 409, "{status:?}");
            assert!(status.is_conflict(), "{status:?}");
            assert!(status.message.contains("operator"), "{}", status.message);
        }
        other => panic!("expected a conflict, got {other:?}"),
    }
    let unchanged = api.get("mig-config").await.unwrap();
    assert_eq!(unchanged.data.unwrap()["profile"], "all-1g.10gb");

    // Applying the same value is no conflict: both managers own the field.
    let shared = apply("auditor", false, "all-1g.10gb").await.unwrap();
    assert_eq!(
        managers(&shared),
        BTreeSet::from(["operator".to_string(), "auditor".to_string()])
    );

    // Forcing takes the field over: the value changes and the earlier owners
    // lose it.
    let forced = apply("admin", true, "all-disabled").await.unwrap();
    assert_eq!(forced.data.as_ref().unwrap()["profile"], "all-disabled");
    assert_eq!(managers(&forced), BTreeSet::from(["admin".to_string()]));

    cluster.delete_namespace(&ns).await.unwrap();
}
