//! The chart's CRD hooks as processes against the test cluster's API server:
//! `gpu-operator --apply-crds` serves gpu-stack's schema over a ClusterPolicy
//! CRD another chart left (NVIDIA's has no `status.unsupportedFields`), as
//! Helm 3 wrote it; `gpu-operator
//! --delete-crds` removes every CRD of the stack and the objects of them. The
//! CRDs are applied again at the end, so later tests find them. The one test
//! of this binary is alone with the CRDs while it runs (test binaries run one
//! after another).
use std::process::{Command, Output};
use std::time::Duration;

use gpu_stack_e2e::binaries::workspace_binary;
use gpu_stack_e2e::chart::{
    CLUSTER_POLICY_CRD, has_unsupported_fields, leave_foreign_cluster_policy_crd,
};
use gpu_stack_e2e::{TestCluster, wait_for};
use gpu_stack_k8s::operator::crds::{FIELD_MANAGER, crds};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};

fn hook(cluster: &TestCluster, mode: &str) -> Output {
    Command::new(workspace_binary("gpu-operator").unwrap())
        .arg(mode)
        .args(["--namespace", "gpu-operator", "--crd-timeout-seconds", "60"])
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig())
        .output()
        .unwrap()
}

fn said(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[tokio::test]
async fn the_crd_hooks_take_over_a_foreign_schema_and_remove_the_stacks_crds() {
    let cluster = TestCluster::attach().await.unwrap();
    let api: Api<CustomResourceDefinition> = Api::all(cluster.client());

    // Another chart's ClusterPolicy CRD, as Helm 3 leaves it.
    leave_foreign_cluster_policy_crd(&cluster.client())
        .await
        .unwrap();

    // The upgrade hook: gpu-stack's schema, applied as Helm's manager (the
    // conflict with the fields Helm 3 wrote taken over), and every CRD of
    // the stack served.
    let out = hook(&cluster, "--apply-crds");
    assert!(out.status.success(), "{}", said(&out));
    let crd = api.get(CLUSTER_POLICY_CRD).await.unwrap();
    assert!(
        has_unsupported_fields(&crd).unwrap(),
        "the foreign schema stayed"
    );
    assert!(crd.managed_fields().iter().any(|m| {
        m.manager.as_deref() == Some(FIELD_MANAGER) && m.operation.as_deref() == Some("Apply")
    }));
    for wanted in crds() {
        let served = api.get(&wanted.name_any()).await.unwrap();
        assert!(
            served
                .status
                .iter()
                .flat_map(|s| s.conditions.iter().flatten())
                .any(|c| c.type_ == "Established" && c.status == "True"),
            "{} is not served",
            wanted.name_any()
        );
    }
    // Run again: nothing to change, still a success.
    let again = hook(&cluster, "--apply-crds");
    assert!(again.status.success(), "{}", said(&again));

    // The cleanup hook: the CRDs go, and the objects of them with them.
    let migconfigs: Api<DynamicObject> = Api::all_with(
        cluster.client(),
        &ApiResource::from_gvk(&GroupVersionKind::gvk(
            "gpustack.io",
            "v1alpha1",
            "MigConfig",
        )),
    );
    let left: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "gpustack.io/v1alpha1",
        "kind": "MigConfig",
        "metadata": {"name": "crds-e2e-left-behind"},
        "spec": {
            "nodeSelector": {"crds-e2e": "none"},
            "layouts": [{"gpuModel": "H100-SXM5-80GB", "profiles": {"1g.10gb": 7}}],
        },
    }))
    .unwrap();
    migconfigs
        .create(&PostParams::default(), &left)
        .await
        .unwrap();
    let out = hook(&cluster, "--delete-crds");
    assert!(out.status.success(), "{}", said(&out));
    for gone in crds() {
        assert!(
            api.get_opt(&gone.name_any()).await.unwrap().is_none(),
            "{} is still there",
            gone.name_any()
        );
    }
    // Nothing left to delete: a second run succeeds too.
    let again = hook(&cluster, "--delete-crds");
    assert!(again.status.success(), "{}", said(&again));

    // As found: the CRDs again, served (later tests use them).
    let out = hook(&cluster, "--apply-crds");
    assert!(out.status.success(), "{}", said(&out));
    wait_for(
        "the MigConfig API to be served again",
        Duration::from_secs(60),
        || {
            let migconfigs = migconfigs.clone();
            async move {
                Ok(migconfigs
                    .list(&Default::default())
                    .await
                    .ok()
                    .map(|l| assert!(l.items.is_empty(), "a MigConfig outlived its CRD")))
            }
        },
    )
    .await
    .unwrap();
}
