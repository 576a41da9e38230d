//! NVIDIADriver resources with the `gpu-operator` binary on the real test
//! control plane: two node pools with two driver versions, a third resource
//! claiming one pool refused for both and changing nothing, a version bump
//! upgrading only its own pool under its own `upgradePolicy`, and a deleted
//! resource's DaemonSets gone.
//!
//! The operator runs as a process with the chart's ServiceAccount and RBAC.
//! The ClusterPolicy is a cluster-wide singleton: this test and the other
//! operator tests must not run against the same cluster at the same time.
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use anyhow::{Result, ensure};
use gpu_stack_core::operator::nvidiadriver::OWNER_LABEL;
use gpu_stack_e2e::binaries::workspace_binary;
use gpu_stack_e2e::chart::OperatorTestEnv;
use gpu_stack_e2e::upgrade::{
    DRIVER_SELECTOR, LONG, OperatorProcess, apply_policy, driver_pods, fleet_nodes, policy_spec,
    state_of,
};
use gpu_stack_e2e::{GpuFleet, TestCluster, wait_for};
use gpu_stack_k8s::operator::nvidiadriver::{NvidiaDriver, NvidiaDriverState};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};

/// Nodes per pool.
const POOL: usize = 6;
const ROLLOUT: Duration = Duration::from_secs(300);

/// The ClusterPolicy: drivers handed to NVIDIADrivers.
fn cluster_policy() -> serde_json::Value {
    let mut spec = policy_spec("550.54.15", "25%", serde_json::json!({}));
    spec["driver"]["useNvidiaDriverCRD"] = serde_json::json!(true);
    spec
}

/// An NVIDIADriver for the nodes labelled `nvd-pool=<pool>`.
fn nvidia_driver(name: &str, pool: &str, version: &str) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "NVIDIADriver",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"nvd-pool": pool},
            "version": version,
            "upgradePolicy": {"maxUnavailable": "50%", "maxParallelUpgrades": 0},
        },
    })
}

async fn apply_driver(admin: &Client, body: serde_json::Value) -> Result<()> {
    let name = body["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    Api::<NvidiaDriver>::all(admin.clone())
        .patch(
            &name,
            &PatchParams::apply("gpu-stack-e2e").force(),
            &Patch::Apply(&body),
        )
        .await?;
    Ok(())
}

/// A resource's state and its conditions, in one line for messages.
async fn driver_status(
    admin: &Client,
    name: &str,
) -> Result<(NvidiaDriverState, String), kube::Error> {
    let d = Api::<NvidiaDriver>::all(admin.clone()).get(name).await?;
    let Some(st) = d.status else {
        return Ok((NvidiaDriverState::NotReady, "no status yet".into()));
    };
    let text = st
        .conditions
        .iter()
        .map(|c| format!("{}={} {}: {}", c.type_, c.status, c.reason, c.message))
        .collect::<Vec<_>>()
        .join(" | ");
    Ok((st.state, text))
}

/// Driver DaemonSets by name: (uid, image).
async fn driver_sets(
    admin: &Client,
    ns: &str,
) -> Result<BTreeMap<String, (String, String)>, kube::Error> {
    let sets = Api::<DaemonSet>::namespaced(admin.clone(), ns)
        .list(&ListParams::default().labels(DRIVER_SELECTOR))
        .await?;
    Ok(sets
        .items
        .into_iter()
        .map(|ds| {
            let image = ds
                .spec
                .template
                .spec
                .as_ref()
                .and_then(|p| p.containers.first())
                .and_then(|c| c.image.clone())
                .unwrap_or_default();
            (ds.name_any(), (ds.uid().unwrap_or_default(), image))
        })
        .collect())
}

/// Driver pod uids on the nodes whose name starts with `prefix`.
async fn driver_pod_uids(
    admin: &Client,
    ns: &str,
    prefix: &str,
) -> Result<BTreeSet<String>, kube::Error> {
    let pods = Api::<Pod>::namespaced(admin.clone(), ns)
        .list(&ListParams::default().labels(DRIVER_SELECTOR))
        .await?;
    Ok(pods
        .items
        .iter()
        .filter(|p| {
            p.spec
                .as_ref()
                .and_then(|s| s.node_name.as_deref())
                .is_some_and(|n| n.starts_with(prefix))
        })
        .filter_map(|p| p.uid())
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvidiadrivers_roll_out_pools_refuse_conflicts_and_upgrade_per_resource() -> Result<()> {
    let cluster = TestCluster::attach().await?;
    let bin = workspace_binary("gpu-operator")?;
    let env = OperatorTestEnv::setup(&cluster, "nvd").await?;
    let (admin, prefix) = (&env.admin, &env.prefix);
    let result = scenario(
        &cluster,
        admin,
        &bin,
        &env.kubeconfig,
        &env.namespace,
        prefix,
    )
    .await;

    let drivers = Api::<NvidiaDriver>::all(admin.clone());
    for name in ["a", "b", "rival"].map(|p| format!("{prefix}-{p}")) {
        let _ = drivers.delete(&name, &DeleteParams::default()).await;
    }
    env.teardown(&cluster, result).await
}

async fn scenario(
    cluster: &TestCluster,
    admin: &Client,
    bin: &Path,
    kubeconfig: &Path,
    namespace: &str,
    prefix: &str,
) -> Result<()> {
    let (pool_a, pool_b) = (format!("{prefix}-a"), format!("{prefix}-b"));
    for pool in [&pool_a, &pool_b] {
        cluster
            .create_gpu_nodes(
                &GpuFleet::new(format!("{pool}-gpu"), POOL)
                    .with_label("nvd-fleet", prefix)
                    .with_label("nvd-pool", pool.as_str()),
            )
            .await?;
    }
    let _operator = OperatorProcess::start(bin, kubeconfig, namespace, "nvd-e2e", &[])?;
    apply_policy(admin, cluster_policy()).await?;
    apply_driver(admin, nvidia_driver(&pool_a, &pool_a, "550.54.15")).await?;
    apply_driver(admin, nvidia_driver(&pool_b, &pool_b, "570.124.06")).await?;

    // Two pools, each at its own version, on its own nodes.
    let ds_a = format!("nvidia-gpu-driver-{pool_a}-ubuntu22.04");
    let ds_b = format!("nvidia-gpu-driver-{pool_b}-ubuntu22.04");
    let all_ready = || async {
        let pods = driver_pods(admin, namespace, prefix).await?;
        let a = driver_status(admin, &pool_a).await?;
        let b = driver_status(admin, &pool_b).await?;
        Ok((pods.len() == 2 * POOL
            && pods.values().all(|ok| *ok)
            && a.0 == NvidiaDriverState::Ready
            && b.0 == NvidiaDriverState::Ready)
            .then_some(()))
    };
    wait_for(
        "both NVIDIADrivers ready on their pools",
        ROLLOUT,
        all_ready,
    )
    .await?;
    let sets = driver_sets(admin, namespace).await?;
    ensure!(
        sets.get(&ds_a).map(|s| s.1.as_str())
            == Some("nvcr.io/nvidia/driver:550.54.15-ubuntu22.04")
            && sets.get(&ds_b).map(|s| s.1.as_str())
                == Some("nvcr.io/nvidia/driver:570.124.06-ubuntu22.04"),
        "driver DaemonSets: {sets:?}"
    );
    ensure!(
        !sets
            .keys()
            .any(|n| n.starts_with("nvidia-driver-daemonset")),
        "the ClusterPolicy renders no driver of its own: {sets:?}"
    );
    for n in fleet_nodes(admin, &format!("nvd-fleet={prefix}")).await? {
        let pool = n.labels().get("nvd-pool").cloned();
        ensure!(
            n.labels().get(OWNER_LABEL) == pool.as_ref(),
            "{} is routed to {:?}",
            n.name_any(),
            n.labels().get(OWNER_LABEL)
        );
    }

    // A third resource claiming pool a: refused for both, nothing moves.
    let rival = format!("{prefix}-rival");
    let pods_a = driver_pod_uids(admin, namespace, &pool_a).await?;
    apply_driver(admin, nvidia_driver(&rival, &pool_a, "580.95.05")).await?;
    let (conflict_a, conflict_rival) = wait_for("the conflict reported on both", LONG, || async {
        let a = driver_status(admin, &pool_a).await?;
        let r = driver_status(admin, &rival).await?;
        Ok(
            (a.1.contains("ConflictingNodeSelector") && r.1.contains("ConflictingNodeSelector"))
                .then_some((a.1, r.1)),
        )
    })
    .await?;
    ensure!(
        conflict_a.contains(&rival) && conflict_rival.contains(&pool_a),
        "each names the other: {conflict_a} / {conflict_rival}"
    );
    let during = driver_sets(admin, namespace).await?;
    ensure!(
        during.get(&ds_a) == sets.get(&ds_a) && !during.keys().any(|n| n.contains("-rival-")),
        "the conflict changed DaemonSets: {during:?}"
    );
    ensure!(driver_pod_uids(admin, namespace, &pool_a).await? == pods_a);
    Api::<NvidiaDriver>::all(admin.clone())
        .delete(&rival, &DeleteParams::default())
        .await?;
    wait_for("pool a ready again without the rival", LONG, || async {
        Ok((driver_status(admin, &pool_a).await?.0 == NvidiaDriverState::Ready).then_some(()))
    })
    .await?;

    // A version bump of pool b upgrades pool b only, through the upgrade flow.
    let pods_b = driver_pod_uids(admin, namespace, &pool_b).await?;
    apply_driver(admin, nvidia_driver(&pool_b, &pool_b, "580.95.05")).await?;
    wait_for("pool b upgraded to 580.95.05", ROLLOUT, || async {
        let sets = driver_sets(admin, namespace).await?;
        let pods = driver_pods(admin, namespace, &pool_b).await?;
        let nodes = fleet_nodes(admin, &format!("nvd-pool={pool_b}")).await?;
        let now = driver_pod_uids(admin, namespace, &pool_b).await?;
        Ok((sets.get(&ds_b).map(|s| s.1.as_str())
            == Some("nvcr.io/nvidia/driver:580.95.05-ubuntu22.04")
            && pods.len() == POOL
            && pods.values().all(|ok| *ok)
            && now.is_disjoint(&pods_b)
            && nodes.iter().all(|n| state_of(n) == "upgrade-done"))
        .then_some(()))
    })
    .await?;
    ensure!(
        driver_pod_uids(admin, namespace, &pool_a).await? == pods_a,
        "pool a's driver pods were restarted by pool b's upgrade"
    );

    // Deleting pool b's resource removes its DaemonSets; its nodes lose the owner.
    Api::<NvidiaDriver>::all(admin.clone())
        .delete(&pool_b, &DeleteParams::default())
        .await?;
    wait_for(
        "pool b's DaemonSets gone and its nodes unrouted",
        LONG,
        || async {
            let sets = driver_sets(admin, namespace).await?;
            let nodes = fleet_nodes(admin, &format!("nvd-pool={pool_b}")).await?;
            Ok((!sets.contains_key(&ds_b)
                && sets.contains_key(&ds_a)
                && nodes.iter().all(|n| !n.labels().contains_key(OWNER_LABEL)))
            .then_some(()))
        },
    )
    .await?;
    Ok(())
}
