//! The driver upgrade flow of the `gpu-operator` binary on the real test
//! control plane: kwok GPU nodes running a GPU workload under a
//! PodDisruptionBudget, a driver version bump, and a rollout that must stay
//! within `maxUnavailable`, evict the workload, restart every driver pod at
//! the new revision and leave every node schedulable and `upgrade-done`.
//!
//! The operator runs as a process with the chart's ServiceAccount and RBAC.
//! The ClusterPolicy is a cluster-wide singleton: this test and
//! `operator_e2e` must not run against the same cluster at the same time.
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, ensure};
use gpu_stack_e2e::binaries::workspace_binary;
use gpu_stack_e2e::chart::{apply_crd, chart_kubeconfig, delete_applied, install_chart_rbac};
use gpu_stack_e2e::{GpuFleet, TestCluster, unique_suffix, wait_for};
use gpu_stack_k8s::clusterpolicy::ClusterPolicy;
use k8s_openapi::api::apps::v1::{ControllerRevision, DaemonSet};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::{Client, ResourceExt};

/// GPU nodes in the fleet.
const NODES: usize = 50;
/// `maxUnavailable: 20%` of [`NODES`], rounded up.
const BUDGET: usize = NODES.div_ceil(5);
const LONG: Duration = Duration::from_secs(120);
const ROLLOUT: Duration = Duration::from_secs(600);
const STATE_LABEL: &str = "nvidia.com/gpu-driver-upgrade-state";
const DRIVER_SELECTOR: &str = "nvidia.com/gpu-stack.component=driver";

struct Operator(Child);

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

async fn apply_policy(client: &Client, spec: serde_json::Value) -> Result<()> {
    let body = serde_json::json!({
        "apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy",
        "metadata": { "name": "cluster-policy" },
        "spec": spec,
    });
    Api::<ClusterPolicy>::all(client.clone())
        .patch(
            "cluster-policy",
            &PatchParams::apply("gpu-stack-e2e").force(),
            &Patch::Apply(&body),
        )
        .await?;
    Ok(())
}

fn policy_spec(version: &str) -> serde_json::Value {
    serde_json::json!({
        "driver": {
            "enabled": true,
            "version": version,
            "upgradePolicy": {
                "autoUpgrade": true,
                "maxUnavailable": "20%",
                "maxParallelUpgrades": 0,
            },
        },
        "dcgmExporter": { "enabled": false },
        "migManager": { "enabled": false },
    })
}

async fn force_delete_policy(client: &Client) -> Result<()> {
    let api = Api::<ClusterPolicy>::all(client.clone());
    if api.get_opt("cluster-policy").await?.is_none() {
        return Ok(());
    }
    let _ = api.delete("cluster-policy", &DeleteParams::default()).await;
    let _ = api
        .patch_metadata(
            "cluster-policy",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"finalizers": null}})),
        )
        .await;
    wait_for("leftover ClusterPolicy gone", LONG, || async {
        Ok(api.get_opt("cluster-policy").await?.is_none().then_some(()))
    })
    .await?;
    Ok(())
}

/// The newest revision hash of each driver DaemonSet, by DaemonSet uid.
async fn driver_revisions(
    client: &Client,
    ns: &str,
) -> Result<BTreeMap<String, String>, kube::Error> {
    let sets = Api::<DaemonSet>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(DRIVER_SELECTOR))
        .await?
        .items;
    let revs = Api::<ControllerRevision>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(DRIVER_SELECTOR))
        .await?
        .items;
    let mut out = BTreeMap::new();
    for ds in sets {
        let uid = ds.uid().unwrap_or_default();
        if let Some(hash) = revs
            .iter()
            .filter(|r| r.owner_references().iter().any(|o| o.uid == uid))
            .max_by_key(|r| r.revision)
            .and_then(|r| r.labels().get("controller-revision-hash").cloned())
        {
            out.insert(uid, hash);
        }
    }
    Ok(out)
}

/// Driver pods (not terminating) on this test's nodes: node -> (revision, ready, in sync).
async fn driver_pods(
    client: &Client,
    ns: &str,
    prefix: &str,
) -> Result<BTreeMap<String, bool>, kube::Error> {
    let revs = driver_revisions(client, ns).await?;
    let pods = Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(DRIVER_SELECTOR))
        .await?
        .items;
    let mut out = BTreeMap::new();
    for p in pods {
        if p.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let Some(node) = p.spec.as_ref().and_then(|s| s.node_name.clone()) else {
            continue;
        };
        if !node.starts_with(prefix) {
            continue;
        }
        let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        let owner = p
            .owner_references()
            .iter()
            .find(|o| o.kind == "DaemonSet")
            .map(|o| o.uid.clone())
            .unwrap_or_default();
        let in_sync = revs.get(&owner) == p.labels().get("controller-revision-hash");
        out.insert(node, running && in_sync);
    }
    Ok(out)
}

async fn fleet_nodes(client: &Client, selector: &str) -> Result<Vec<Node>, kube::Error> {
    Ok(Api::<Node>::all(client.clone())
        .list(&ListParams::default().labels(selector))
        .await?
        .items)
}

fn state_of(n: &Node) -> &str {
    n.labels().get(STATE_LABEL).map_or("", String::as_str)
}

fn unschedulable(n: &Node) -> bool {
    n.spec
        .as_ref()
        .and_then(|s| s.unschedulable)
        .unwrap_or(false)
}

/// A Deployment of `NODES` GPU pods on the fleet and a PodDisruptionBudget over them.
async fn create_workload(admin: &Client, ns: &str, fleet_label: &str, fleet: &str) -> Result<()> {
    let deploy: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "trainer", "namespace": ns},
        "spec": {
            "replicas": NODES,
            "selector": {"matchLabels": {"app": "trainer"}},
            "template": {
                "metadata": {"labels": {"app": "trainer"}},
                "spec": {
                    "nodeSelector": {fleet_label: fleet},
                    "topologySpreadConstraints": [{
                        "maxSkew": 1,
                        "topologyKey": "kubernetes.io/hostname",
                        "whenUnsatisfiable": "ScheduleAnyway",
                        "labelSelector": {"matchLabels": {"app": "trainer"}},
                    }],
                    "containers": [{
                        "name": "train",
                        "image": "registry.example.com/trainer:1",
                        "resources": {"limits": {"nvidia.com/gpu": "1"}},
                    }],
                },
            },
        },
    }))?;
    let pdb: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "trainer", "namespace": ns},
        "spec": {"maxUnavailable": 5, "selector": {"matchLabels": {"app": "trainer"}}},
    }))?;
    for (obj, group, version, kind) in [
        (&deploy, "apps", "v1", "Deployment"),
        (&pdb, "policy", "v1", "PodDisruptionBudget"),
    ] {
        let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, kind));
        Api::<DynamicObject>::namespaced_with(admin.clone(), ns, &ar)
            .patch(
                &obj.name_any(),
                &PatchParams::apply("gpu-stack-e2e").force(),
                &Patch::Apply(obj),
            )
            .await
            .with_context(|| format!("creating {kind}"))?;
    }
    Ok(())
}

async fn running_workload(admin: &Client, ns: &str) -> Result<BTreeSet<String>, kube::Error> {
    Ok(Api::<Pod>::namespaced(admin.clone(), ns)
        .list(&ListParams::default().labels("app=trainer"))
        .await?
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .map(|p| p.name_any())
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_version_bump_rolls_out_within_the_budget() -> Result<()> {
    let cluster = TestCluster::attach().await?;
    let admin = cluster.client();
    let bin = workspace_binary("gpu-operator")?;
    let suffix = unique_suffix();
    let prefix = format!("upg{suffix}");
    let namespace = cluster.create_namespace("gpu-upg").await?;
    let workload_ns = cluster.create_namespace("gpu-upg-work").await?;
    let release = format!("upg{suffix}");
    let tmp = std::env::temp_dir().join(format!("gpu-stack-upg-e2e-{suffix}"));
    std::fs::create_dir_all(&tmp)?;

    let crds: Api<CustomResourceDefinition> = Api::all(admin.clone());
    apply_crd(&crds).await?;
    force_delete_policy(&admin).await?;
    let rbac = install_chart_rbac(&admin, &release, &namespace).await?;
    let kubeconfig = chart_kubeconfig(&cluster, &admin, &rbac, &namespace, &tmp).await?;

    let result = rollout(
        &cluster,
        &admin,
        &bin,
        &kubeconfig,
        &namespace,
        &workload_ns,
        &prefix,
    )
    .await;

    let _ = force_delete_policy(&admin).await;
    let names: Vec<String> = fleet_nodes(&admin, &format!("upg-fleet={prefix}"))
        .await
        .unwrap_or_default()
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    let _ = cluster.delete_nodes(&names).await;
    delete_applied(&admin, &rbac).await;
    let _ = cluster.delete_namespace(&workload_ns).await;
    let _ = cluster.delete_namespace(&namespace).await;
    let _ = std::fs::remove_dir_all(&tmp);
    result
}

async fn rollout(
    cluster: &TestCluster,
    admin: &Client,
    bin: &Path,
    kubeconfig: &Path,
    namespace: &str,
    workload_ns: &str,
    prefix: &str,
) -> Result<()> {
    let selector = format!("upg-fleet={prefix}");
    cluster
        .create_gpu_nodes(
            &GpuFleet::new(format!("{prefix}-gpu"), NODES).with_label("upg-fleet", prefix),
        )
        .await?;
    let listen = format!("127.0.0.1:{}", free_port()?);
    let _operator = Operator(
        Command::new(bin)
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--namespace={namespace}"))
            .arg("--identity=upgrade-e2e")
            .arg(format!("--listen={listen}"))
            .arg(format!("--lease-name=gpu-stack-upg-{namespace}"))
            .env("RUST_LOG", "info,kube=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?,
    );
    apply_policy(admin, policy_spec("550.54.15")).await?;
    wait_for(
        "a driver pod in sync on every node, every node upgrade-done",
        ROLLOUT,
        || async {
            let pods = driver_pods(admin, namespace, prefix).await?;
            let nodes = fleet_nodes(admin, &selector).await?;
            Ok((pods.len() == NODES
                && pods.values().all(|ok| *ok)
                && nodes.iter().all(|n| state_of(n) == "upgrade-done"))
            .then_some(()))
        },
    )
    .await?;
    create_workload(admin, workload_ns, "upg-fleet", prefix).await?;
    let before = wait_for("the GPU workload running", LONG, || async {
        let running = running_workload(admin, workload_ns).await?;
        Ok((running.len() == NODES).then_some(running))
    })
    .await?;

    // Sample unschedulable nodes every 100 ms during the rollout.
    let done = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let (done, peak, client, selector) =
            (done.clone(), peak.clone(), admin.clone(), selector.clone());
        tokio::spawn(async move {
            while !done.load(Ordering::Relaxed) {
                if let Ok(nodes) = fleet_nodes(&client, &selector).await {
                    let cordoned = nodes.iter().filter(|n| unschedulable(n)).count();
                    peak.fetch_max(cordoned, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let old_revisions = driver_revisions(admin, namespace).await?;
    let started = Instant::now();
    apply_policy(admin, policy_spec("570.124.06")).await?;
    wait_for("the driver DaemonSet at a new revision", LONG, || async {
        let now = driver_revisions(admin, namespace).await?;
        Ok((!now.is_empty() && now != old_revisions).then_some(()))
    })
    .await?;
    let outcome = wait_for(
        "every node upgraded to the new driver revision",
        ROLLOUT,
        || async {
            let pods = driver_pods(admin, namespace, prefix).await?;
            let nodes = fleet_nodes(admin, &selector).await?;
            Ok((pods.len() == NODES
                && pods.values().all(|ok| *ok)
                && nodes.len() == NODES
                && nodes
                    .iter()
                    .all(|n| state_of(n) == "upgrade-done" && !unschedulable(n)))
            .then_some(()))
        },
    )
    .await;
    let took = started.elapsed();
    done.store(true, Ordering::Relaxed);
    let _ = sampler.await;
    let peak = peak.load(Ordering::Relaxed);
    if let Err(e) = outcome {
        let nodes = fleet_nodes(admin, &selector).await.unwrap_or_default();
        let mut states: BTreeMap<String, usize> = BTreeMap::new();
        for n in &nodes {
            *states.entry(state_of(n).to_string()).or_default() += 1;
        }
        return Err(anyhow!(
            "{e}; node states: {states:?}, peak unschedulable {peak}"
        ));
    }
    eprintln!(
        "driver upgrade of {NODES} nodes took {:.1} s; peak unschedulable nodes {peak} (budget {BUDGET})",
        took.as_secs_f64()
    );
    ensure!(
        peak <= BUDGET,
        "{peak} nodes were unschedulable at once; the budget is {BUDGET}"
    );
    ensure!(
        peak > 0,
        "no node was ever seen cordoned: the sampler missed the rollout"
    );
    let after = wait_for("the GPU workload running again", LONG, || async {
        let running = running_workload(admin, workload_ns).await?;
        Ok((running.len() == NODES).then_some(running))
    })
    .await?;
    let evicted = before.difference(&after).count();
    ensure!(
        evicted == NODES,
        "only {evicted} of {NODES} workload pods were evicted (every node ran one)"
    );
    let policy = Api::<ClusterPolicy>::all(admin.clone())
        .get("cluster-policy")
        .await?;
    let progress = policy
        .status
        .and_then(|s| s.driver_upgrade)
        .ok_or_else(|| anyhow!("no status.driverUpgrade"))?;
    ensure!(
        progress.upgraded as usize == NODES && progress.total as usize == NODES,
        "status.driverUpgrade says {}",
        progress.message
    );
    Ok(())
}
