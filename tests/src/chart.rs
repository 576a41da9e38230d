//! The Helm chart in the end-to-end tests: rendering it with helm built from
//! its Go module, applying its ServiceAccount, RBAC and CRD, and a kubeconfig
//! that authenticates as the chart's ServiceAccount, so a missing RBAC rule
//! fails the test that needs it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use std::time::Duration;

use anyhow::{Context, Result, anyhow, ensure};
use gpu_stack_k8s::operator::clusterpolicy::ClusterPolicy;
use gpu_stack_k8s::operator::migconfig::MigConfig;
use gpu_stack_k8s::operator::nvidiadriver::NvidiaDriver;
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::{Client, CustomResourceExt, ResourceExt};

use crate::upgrade::force_delete_policy;
use crate::{TestCluster, wait_for};

/// How long the CRD may take to be served.
const ESTABLISHED: Duration = Duration::from_secs(120);

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

pub fn helm() -> Result<PathBuf> {
    let out = Command::new(repo_root().join("tools/helm/build.sh"))
        .stderr(Stdio::inherit())
        .output()
        .context("running tools/helm/build.sh")?;
    ensure!(out.status.success(), "tools/helm/build.sh failed");
    Ok(PathBuf::from(String::from_utf8(out.stdout)?.trim()))
}

/// The chart's documents as `helm template <release>` renders them with
/// `args` (the chart insists on an image repository; one is set), nulls left
/// out.
pub fn template(release: &str, args: &[&str]) -> Result<Vec<serde_json::Value>> {
    let out = Command::new(helm()?)
        .args(["template", release])
        .arg(repo_root().join("deploy/helm/gpu-stack"))
        .args(["--set", "imageRepository=registry.example.com/gpu-stack"])
        .args(args)
        .output()
        .context("helm template")?;
    ensure!(
        out.status.success(),
        "helm template failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout)?;
    let docs: Vec<serde_json::Value> =
        serde_saphyr::from_multiple_with_options(&text, gpu_stack_core::yaml_guard::options())
            .map_err(|e| {
                anyhow!(
                    "helm template output: {}",
                    gpu_stack_core::yaml_guard::message(&e)
                )
            })?;
    Ok(docs.into_iter().filter(|d| !d.is_null()).collect())
}

/// Renders the chart and applies its ServiceAccount and RBAC documents.
pub async fn install_chart_rbac(
    client: &Client,
    release: &str,
    namespace: &str,
) -> Result<Vec<DynamicObject>> {
    let docs = template(
        release,
        &[
            "--namespace",
            namespace,
            "--set",
            "clusterPolicy.deployCR=false",
            // Only the operator's RBAC is applied (the node-discovery agent's
            // is not needed).
            "--set",
            "nodeDiscovery.enabled=false",
        ],
    )?;
    let mut applied = Vec::new();
    for value in docs {
        if value.is_null() {
            continue;
        }
        let obj: DynamicObject = serde_json::from_value(value)?;
        let types = obj
            .types
            .clone()
            .ok_or_else(|| anyhow!("document without kind"))?;
        let wanted = [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",
            "RoleBinding",
        ];
        // Hook objects (the uninstall Job's account and roles) are helm's to
        // create at uninstall time, not part of the installed operator.
        if !wanted.contains(&types.kind.as_str()) || obj.annotations().contains_key("helm.sh/hook")
        {
            continue;
        }
        let gvk = GroupVersionKind::try_from(&types)?;
        let ar = ApiResource::from_gvk(&gvk);
        let api: Api<DynamicObject> = match obj.namespace() {
            Some(ns) => Api::namespaced_with(client.clone(), &ns, &ar),
            None => Api::all_with(client.clone(), &ar),
        };
        api.patch(
            &obj.name_any(),
            &PatchParams::apply("gpu-stack-e2e").force(),
            &Patch::Apply(&obj),
        )
        .await
        .with_context(|| format!("applying {} {}", types.kind, obj.name_any()))?;
        applied.push(obj);
    }
    ensure!(
        applied.len() >= 5,
        "the chart rendered only {} RBAC documents",
        applied.len()
    );
    Ok(applied)
}

pub async fn delete_applied(client: &Client, objs: &[DynamicObject]) {
    for obj in objs {
        let Some(types) = obj.types.clone() else {
            continue;
        };
        let Ok(gvk) = GroupVersionKind::try_from(&types) else {
            continue;
        };
        let ar = ApiResource::from_gvk(&gvk);
        let api: Api<DynamicObject> = match obj.namespace() {
            Some(ns) => Api::namespaced_with(client.clone(), &ns, &ar),
            None => Api::all_with(client.clone(), &ar),
        };
        let _ = api.delete(&obj.name_any(), &DeleteParams::default()).await;
    }
}

/// Server-side applies the generated ClusterPolicy CRD and waits until the API
/// server serves it (before that, requests for ClusterPolicies get a bare 404).
pub async fn apply_crd(crds: &Api<CustomResourceDefinition>) -> Result<()> {
    apply_generated_crd(crds, ClusterPolicy::crd()).await
}

/// Installs every CRD the operator watches (ClusterPolicy, NVIDIADriver,
/// MigConfig) and waits until each is served: without one, the operator's
/// watch of it retries a 404 list for the whole run, load on the control
/// plane and noise in its request count.
pub async fn apply_operator_crds(admin: &Client) -> Result<()> {
    let crds: Api<CustomResourceDefinition> = Api::all(admin.clone());
    for crd in [ClusterPolicy::crd(), NvidiaDriver::crd(), MigConfig::crd()] {
        apply_generated_crd(&crds, crd).await?;
    }
    Ok(())
}

async fn apply_generated_crd(
    crds: &Api<CustomResourceDefinition>,
    crd: CustomResourceDefinition,
) -> Result<()> {
    let name = crd.name_any();
    crds.patch(
        &name,
        &PatchParams::apply("gpu-stack-e2e").force(),
        &Patch::Apply(&crd),
    )
    .await?;
    wait_for(&format!("CRD {name} established"), ESTABLISHED, || async {
        let crd = crds.get(&name).await?;
        Ok(crd
            .status
            .and_then(|s| s.conditions)
            .is_some_and(|c| {
                c.iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
            })
            .then_some(()))
    })
    .await?;
    Ok(())
}

/// A kubeconfig for the chart's ServiceAccount (from `rbac`), so the operator
/// runs with exactly the permissions the chart grants.
pub async fn chart_kubeconfig(
    cluster: &TestCluster,
    admin: &Client,
    rbac: &[DynamicObject],
    namespace: &str,
    tmp: &Path,
) -> Result<PathBuf> {
    let sa = rbac
        .iter()
        .find(|o| o.types.as_ref().is_some_and(|t| t.kind == "ServiceAccount"))
        .map(ResourceExt::name_any)
        .ok_or_else(|| anyhow!("the chart has no ServiceAccount"))?;
    let token = Api::<ServiceAccount>::namespaced(admin.clone(), namespace)
        .create_token_request(
            &sa,
            &PostParams::default(),
            &TokenRequest {
                spec: Some(k8s_openapi::api::authentication::v1::TokenRequestSpec {
                    expiration_seconds: Some(3600),
                    ..Default::default()
                }),
                ..Default::default()
            },
        )
        .await?
        .status
        .and_then(|s| s.token)
        .ok_or_else(|| anyhow!("no token in TokenRequest answer"))?;
    token_kubeconfig(cluster.kubeconfig(), &token, tmp)
}

/// A kubeconfig for the test cluster that authenticates with `token`.
pub fn token_kubeconfig(admin: &Path, token: &str, dir: &Path) -> Result<PathBuf> {
    let mut kc = kube::config::Kubeconfig::read_from(admin)?;
    for auth in &mut kc.auth_infos {
        if let Some(info) = auth.auth_info.as_mut() {
            *info = kube::config::AuthInfo {
                token: Some(token.to_string().into()),
                ..Default::default()
            };
        }
    }
    let path = dir.join("operator.kubeconfig");
    std::fs::write(&path, serde_saphyr::to_string(&kc)?)?;
    Ok(path)
}

/// One operator test's share of the shared test cluster: the operator's
/// CRDs applied, no ClusterPolicy left by another test, a namespace of its
/// own holding the chart's ServiceAccount and RBAC, a kubeconfig that acts
/// as that ServiceAccount, and a scratch directory. The test names its
/// nodes `<prefix>-...`, and [`OperatorTestEnv::teardown`] deletes them.
pub struct OperatorTestEnv {
    /// The cluster admin's client.
    pub admin: Client,
    /// `<tag><unique suffix>`: the chart release and the nodes' name prefix.
    pub prefix: String,
    /// The operator's namespace.
    pub namespace: String,
    /// Kubeconfig of the chart's ServiceAccount, for the operator process.
    pub kubeconfig: PathBuf,
    /// Scratch directory (kept when the test fails).
    pub tmp: PathBuf,
    rbac: Vec<DynamicObject>,
}

impl OperatorTestEnv {
    /// Sets up the test's share; `tag` is a short name of the test (`op`, `upg`).
    pub async fn setup(cluster: &TestCluster, tag: &str) -> Result<Self> {
        let admin = cluster.client();
        let suffix = crate::unique_suffix();
        let prefix = format!("{tag}{suffix}");
        let namespace = cluster.create_namespace(&format!("gpu-{tag}")).await?;
        let tmp = std::env::temp_dir().join(format!("gpu-stack-{tag}-e2e-{suffix}"));
        std::fs::create_dir_all(&tmp)?;
        apply_operator_crds(&admin).await?;
        force_delete_policy(&admin).await?;
        let rbac = install_chart_rbac(&admin, &prefix, &namespace).await?;
        let kubeconfig = chart_kubeconfig(cluster, &admin, &rbac, &namespace, &tmp).await?;
        Ok(Self {
            admin,
            prefix,
            namespace,
            kubeconfig,
            tmp,
            rbac,
        })
    }

    /// Removes what the test made, whatever `result` is: the ClusterPolicy,
    /// the `<prefix>-...` nodes, the RBAC and the namespace; the scratch
    /// directory only when the test passed. Returns `result`.
    pub async fn teardown<T>(self, cluster: &TestCluster, result: Result<T>) -> Result<T> {
        let _ = force_delete_policy(&self.admin).await;
        let names = crate::nodes_with_prefix(&self.admin, &self.prefix).await;
        let _ = cluster.delete_nodes(&names).await;
        delete_applied(&self.admin, &self.rbac).await;
        let _ = cluster.delete_namespace(&self.namespace).await;
        if result.is_ok() {
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
        result
    }
}

/// The ClusterPolicy CRD's name.
pub const CLUSTER_POLICY_CRD: &str = "clusterpolicies.nvidia.com";

/// Where a ClusterPolicy CRD's schema keeps `status.unsupportedFields`.
const UNSUPPORTED_FIELDS_SCHEMA: &str =
    "/spec/versions/0/schema/openAPIV3Schema/properties/status/properties/unsupportedFields";

/// Whether a ClusterPolicy CRD's schema has gpu-stack's
/// `status.unsupportedFields` (NVIDIA's has not).
pub fn has_unsupported_fields(crd: &CustomResourceDefinition) -> Result<bool> {
    Ok(serde_json::to_value(crd)?
        .pointer(UNSUPPORTED_FIELDS_SCHEMA)
        .is_some())
}

/// Writes a ClusterPolicy CRD like one NVIDIA's chart left behind:
/// gpu-stack's without `status.unsupportedFields`, written as Helm 3 writes
/// CRDs (an update by the field manager `helm`, not an apply), over
/// whatever is there.
pub async fn leave_foreign_cluster_policy_crd(client: &Client) -> Result<()> {
    let mut crd = serde_json::to_value(ClusterPolicy::crd())?;
    let (parent, field) = UNSUPPORTED_FIELDS_SCHEMA
        .rsplit_once('/')
        .context("a JSON pointer")?;
    crd.pointer_mut(parent)
        .and_then(serde_json::Value::as_object_mut)
        .and_then(|props| props.remove(field))
        .context("gpu-stack's CRD has no status.unsupportedFields")?;
    let mut crd: CustomResourceDefinition = serde_json::from_value(crd)?;
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let as_helm_3 = PostParams {
        field_manager: Some("helm".into()),
        ..PostParams::default()
    };
    match api.get_opt(CLUSTER_POLICY_CRD).await? {
        Some(current) => {
            crd.metadata.resource_version = current.metadata.resource_version;
            api.replace(CLUSTER_POLICY_CRD, &as_helm_3, &crd).await?;
        }
        None => {
            api.create(&as_helm_3, &crd).await?;
        }
    }
    ensure!(
        !has_unsupported_fields(&api.get(CLUSTER_POLICY_CRD).await?)?,
        "the foreign ClusterPolicy CRD was not written"
    );
    Ok(())
}
