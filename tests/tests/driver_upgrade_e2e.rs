//! The driver upgrade flow of the `gpu-operator` binary on the real test
//! control plane: kwok GPU nodes running a GPU workload under a
//! PodDisruptionBudget, a driver version bump, and a rollout that must stay
//! within `maxUnavailable`, evict the workload, restart every driver pod at
//! the new revision and leave every node schedulable and `upgrade-done`
//! (before the bump, a node whose driver never needed an upgrade carries no
//! state label). Then a second bump is abandoned midway (`autoUpgrade`
//! turned off), and a third by uninstalling the stack (`gpu-operator
//! --uninstall`), each of which must leave no node cordoned by the flow.
//! (The API server stalling mid-rollout is `driver_upgrade_scale_e2e`'s.)
//!
//! The operator runs as a process with the chart's ServiceAccount and RBAC.
//! The ClusterPolicy is a cluster-wide singleton: this test and
//! `operator_e2e` must not run against the same cluster at the same time.
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, ensure};
use gpu_stack_core::operator::labels::DRIVER_UPGRADE_ENABLED;
use gpu_stack_e2e::binaries::workspace_binary;
use gpu_stack_e2e::chart::OperatorTestEnv;
use gpu_stack_e2e::upgrade::{
    LONG, OperatorProcess, apply_objects, apply_policy, driver_pods, driver_revisions, fleet_nodes,
    gpu_deployment, pod_disruption_budget, policy, policy_spec, running_pods, state_of,
    unschedulable,
};
use gpu_stack_e2e::{GpuFleet, TestCluster, wait_for};
use k8s_openapi::api::core::v1::{Event, Node};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};

/// GPU nodes in the fleet.
const NODES: usize = 50;
/// `maxUnavailable: 20%` of [`NODES`], rounded up.
const BUDGET: usize = NODES.div_ceil(5);
const ROLLOUT: Duration = Duration::from_secs(600);

fn spec(version: &str) -> serde_json::Value {
    policy_spec(version, "20%", serde_json::json!({}))
}

/// A Deployment of `NODES` GPU pods on the fleet and a PodDisruptionBudget over them.
async fn create_workload(admin: &Client, ns: &str, fleet_label: &str, fleet: &str) -> Result<()> {
    apply_objects(
        admin,
        ns,
        &[
            gpu_deployment(
                "trainer",
                ns,
                NODES,
                serde_json::json!({fleet_label: fleet}),
            ),
            pod_disruption_budget(
                "trainer",
                ns,
                "trainer",
                serde_json::json!({"maxUnavailable": 5}),
            ),
        ],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_version_bump_rolls_out_within_the_budget() -> Result<()> {
    let cluster = TestCluster::attach().await?;
    let bin = workspace_binary("gpu-operator")?;
    let env = OperatorTestEnv::setup(&cluster, "upg").await?;
    let workload_ns = cluster.create_namespace("gpu-upg-work").await?;
    let result = rollout(
        &cluster,
        &env.admin,
        &bin,
        &env.kubeconfig,
        &env.namespace,
        &workload_ns,
        &env.prefix,
    )
    .await;
    let _ = cluster.delete_namespace(&workload_ns).await;
    env.teardown(&cluster, result).await
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
    let _operator = OperatorProcess::start(bin, kubeconfig, namespace, "upgrade-e2e", &[])?;
    apply_policy(admin, spec("550.54.15")).await?;
    wait_for(
        "a driver pod in sync on every node, no node labelled (none needed an upgrade), \
         each telling NVIDIA's driver manager that the controller drains it",
        ROLLOUT,
        || async {
            let pods = driver_pods(admin, namespace, prefix).await?;
            let nodes = fleet_nodes(admin, &selector).await?;
            Ok((pods.len() == NODES
                && pods.values().all(|ok| *ok)
                && nodes.iter().all(|n| {
                    state_of(n).is_empty()
                        && n.annotations()
                            .get(DRIVER_UPGRADE_ENABLED)
                            .map(String::as_str)
                            == Some("true")
                }))
            .then_some(()))
        },
    )
    .await?;
    create_workload(admin, workload_ns, "upg-fleet", prefix).await?;
    let before = wait_for("the GPU workload running", LONG, || async {
        let running = running_pods(admin, workload_ns, "app=trainer").await?;
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
    apply_policy(admin, spec("570.124.06")).await?;
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
        let running = running_pods(admin, workload_ns, "app=trainer").await?;
        Ok((running.len() == NODES).then_some(running))
    })
    .await?;
    let evicted = before.difference(&after).count();
    ensure!(
        evicted == NODES,
        "only {evicted} of {NODES} workload pods were evicted (every node ran one)"
    );
    let progress = policy(admin)
        .await?
        .ok_or_else(|| anyhow!("no ClusterPolicy"))?
        .status
        .and_then(|s| s.driver_upgrade)
        .ok_or_else(|| anyhow!("no status.driverUpgrade"))?;
    ensure!(
        progress.upgraded as usize == NODES && progress.total as usize == NODES,
        "status.driverUpgrade says {}",
        progress.message
    );
    let by_hand = abandoned_midway(admin, &selector).await?;
    uninstalled_midway(cluster, admin, bin, namespace, &selector, &by_hand).await
}

/// The stack uninstalled in the middle of a rollout (what the chart's
/// pre-delete hook runs, `gpu-operator --uninstall`, with the operator
/// still running): no node is left cordoned by the flow, and none keeps a
/// state label; the node cordoned by hand stays cordoned.
async fn uninstalled_midway(
    cluster: &TestCluster,
    admin: &Client,
    bin: &Path,
    namespace: &str,
    selector: &str,
    by_hand: &str,
) -> Result<()> {
    bump_until_cordoning(admin, selector, by_hand, "580.65.06").await?;
    let status = tokio::process::Command::new(bin)
        .arg(format!("--kubeconfig={}", cluster.kubeconfig().display()))
        .arg(format!("--namespace={namespace}"))
        .args(["--uninstall", "--uninstall-timeout-seconds=120"])
        .status()
        .await?;
    ensure!(
        status.success(),
        "gpu-operator --uninstall exited with {status}"
    );
    wound_down(admin, selector, by_hand, "after the uninstall").await
}

/// Bumps the driver to `version` and waits until the flow has cordoned a
/// node other than `by_hand`.
async fn bump_until_cordoning(
    admin: &Client,
    selector: &str,
    by_hand: &str,
    version: &str,
) -> Result<()> {
    apply_policy(admin, spec(version)).await?;
    wait_for(
        &format!("the upgrade to {version} cordoning nodes"),
        LONG,
        || async {
            let fleet = fleet_nodes(admin, selector).await?;
            Ok(fleet
                .iter()
                .any(|n| n.name_any() != by_hand && unschedulable(n))
                .then_some(()))
        },
    )
    .await?;
    Ok(())
}

/// Waits until no node keeps a state label and only `by_hand` is cordoned.
async fn wound_down(admin: &Client, selector: &str, by_hand: &str, when: &str) -> Result<()> {
    wait_for(
        &format!("no node marked by the upgrade {when}"),
        LONG,
        || async {
            let fleet = fleet_nodes(admin, selector).await?;
            Ok(fleet
                .iter()
                .all(|n| state_of(n).is_empty() && unschedulable(n) == (n.name_any() == by_hand))
                .then_some(()))
        },
    )
    .await?;
    Ok(())
}

/// An upgrade abandoned midway (`autoUpgrade` turned off) winds down: the
/// nodes the flow cordoned are uncordoned, a node cordoned by hand before
/// stays cordoned, no state label is left, and the nodes get an Event.
async fn abandoned_midway(admin: &Client, selector: &str) -> Result<String> {
    let by_hand = fleet_nodes(admin, selector)
        .await?
        .first()
        .map(ResourceExt::name_any)
        .ok_or_else(|| anyhow!("no fleet node"))?;
    let nodes: Api<Node> = Api::all(admin.clone());
    nodes
        .patch(
            &by_hand,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"unschedulable": true}})),
        )
        .await?;
    bump_until_cordoning(admin, selector, &by_hand, "575.51.03").await?;
    let mut off = spec("575.51.03");
    off["driver"]["upgradePolicy"]["autoUpgrade"] = serde_json::json!(false);
    apply_policy(admin, off).await?;
    wound_down(admin, selector, &by_hand, "once autoUpgrade is off").await?;
    let events = Api::<Event>::all(admin.clone())
        .list(&ListParams::default().fields("reason=DriverUpgradeAbandoned"))
        .await?;
    ensure!(
        events.items.iter().any(|e| e
            .message
            .as_deref()
            .is_some_and(|m| m.contains("uncordoned"))),
        "no DriverUpgradeAbandoned Event says a node was uncordoned"
    );
    Ok(by_hand)
}
