//! MigConfig on the real test control plane: the `gpu-operator` binary turns
//! a MigConfig into node labels and a generated entry of the mig-parted
//! ConfigMap, `gpu-mig-manager` processes on three kwok nodes of simulated
//! H100s apply it, and the MigConfig's status goes from Pending to Applied
//! per node, with its instances at exactly the placements it gives; an
//! invalid MigConfig (a profile, or a placement) changes nothing and says why.
//!
//! The test plays the kubelet's ConfigMap volume: it copies the ConfigMap's
//! file to each manager's `--config-file` before starting the managers.
//! The ClusterPolicy is a cluster-wide singleton: this test and the other
//! operator tests must not run against the same cluster at the same time.
use std::path::Path;
use std::time::Instant;

use anyhow::{Result, ensure};
use gpu_stack_e2e::binaries::{AgentProcess, workspace_binary};
use gpu_stack_e2e::chart::OperatorTestEnv;
use gpu_stack_e2e::migmanager::{mig_assert, start_mig_manager, write_mig_files};
use gpu_stack_e2e::upgrade::{LONG, OperatorProcess, apply_policy, fleet_nodes};
use gpu_stack_e2e::{GpuFleet, TestCluster, wait_for};
use gpu_stack_k8s::operator::migconfig::MigConfig;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::{Client, ResourceExt};

const MIG_CONFIG: &str = "nvidia.com/mig.config";
const MIG_STATE: &str = "nvidia.com/mig.config.state";
const NODES: usize = 3;
const CONFIG_MAP: &str = "default-mig-parted-config";

/// Operator, MIG manager and nothing else: no client pods to wait for.
fn cluster_policy() -> serde_json::Value {
    serde_json::json!({
        "driver": {"enabled": false},
        "toolkit": {"enabled": false},
        "devicePlugin": {"enabled": false},
        "gfd": {"enabled": false},
        "dcgmExporter": {"enabled": false},
        "migManager": {"enabled": true},
    })
}

fn mig_config(name: &str, pool: &str, profiles: serde_json::Value) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "gpustack.io/v1alpha1",
        "kind": "MigConfig",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"migc-pool": pool},
            "layouts": [{"gpuModel": "H100-SXM5-80GB", "profiles": profiles}],
        },
    })
}

/// `mig_config` with explicit placements (`(profile, start)`).
fn placed(
    name: &str,
    pool: &str,
    profiles: serde_json::Value,
    at: &[(&str, u32)],
) -> serde_json::Value {
    let mut body = mig_config(name, pool, profiles);
    body["spec"]["layouts"][0]["placements"] = at
        .iter()
        .map(|(p, s)| serde_json::json!({"profile": p, "start": s}))
        .collect();
    body
}

/// `(start, memory slices)` of every GPU instance of each simulated GPU.
fn instances(state: &Path) -> Result<Vec<Vec<(u64, u64)>>> {
    let body: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(state)?)?;
    let gpus = body["gpus"].as_array().cloned().unwrap_or_default();
    Ok(gpus
        .iter()
        .map(|g| {
            let mut v: Vec<(u64, u64)> = g["gpu_instances"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|i| {
                    (
                        i["start"].as_u64().unwrap_or(99),
                        i["size"].as_u64().unwrap_or(99),
                    )
                })
                .collect();
            v.sort_unstable();
            v
        })
        .collect())
}

async fn apply(admin: &Client, body: &serde_json::Value) -> Result<()> {
    let name = body["metadata"]["name"].as_str().unwrap_or_default();
    Api::<MigConfig>::all(admin.clone())
        .patch(
            name,
            &PatchParams::apply("gpu-stack-e2e").force(),
            &Patch::Apply(body),
        )
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migconfig_is_applied_by_the_mig_managers_and_an_invalid_one_changes_nothing()
-> Result<()> {
    let cluster = TestCluster::attach().await?;
    let env = OperatorTestEnv::setup(&cluster, "migc").await?;
    let (admin, prefix) = (&env.admin, &env.prefix);
    let result = scenario(
        &cluster,
        admin,
        &env.kubeconfig,
        &env.namespace,
        prefix,
        &env.tmp,
    )
    .await;

    let api = Api::<MigConfig>::all(admin.clone());
    for name in [format!("{prefix}-good"), format!("{prefix}-bad")] {
        let _ = api.delete(&name, &DeleteParams::default()).await;
    }
    env.teardown(&cluster, result).await
}

async fn scenario(
    cluster: &TestCluster,
    admin: &Client,
    kubeconfig: &Path,
    namespace: &str,
    prefix: &str,
    tmp: &Path,
) -> Result<()> {
    let good_pool = format!("{prefix}-good");
    let bad_pool = format!("{prefix}-bad");
    let product = ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3");
    let mut nodes = cluster
        .create_gpu_nodes(
            &GpuFleet::new(format!("{good_pool}-gpu"), NODES)
                .with_label("migc-fleet", prefix)
                .with_label("migc-pool", good_pool.as_str())
                .with_label(product.0, product.1),
        )
        .await?;
    let bad_node = cluster
        .create_gpu_nodes(
            &GpuFleet::new(format!("{bad_pool}-gpu"), 1)
                .with_label("migc-fleet", prefix)
                .with_label("migc-pool", bad_pool.as_str())
                .with_label(product.0, product.1),
        )
        .await?;
    nodes.sort();
    let bin = workspace_binary("gpu-operator")?;
    let _operator = OperatorProcess::start(&bin, kubeconfig, namespace, "migc-e2e", &[])?;
    apply_policy(admin, cluster_policy()).await?;

    let good = format!("{prefix}-good");
    let entry = format!("gpustack-{good}");
    let started = Instant::now();
    // Placements the planner would not choose by itself (it puts the
    // 3g.40gb at slice 0).
    apply(
        admin,
        &placed(
            &good,
            &good_pool,
            serde_json::json!({"1g.10gb": 3, "3g.40gb": 1}),
            &[
                ("3g.40gb", 4),
                ("1g.10gb", 0),
                ("1g.10gb", 1),
                ("1g.10gb", 2),
            ],
        ),
    )
    .await?;
    // The operator writes the generated config and labels the three nodes.
    let config_maps: Api<ConfigMap> = Api::namespaced(admin.clone(), namespace);
    let file = wait_for("the generated config in the ConfigMap", LONG, || async {
        let text = config_maps
            .get_opt(CONFIG_MAP)
            .await?
            .and_then(|c| c.data)
            .and_then(|d| d.get("config.yaml").cloned());
        Ok(text.filter(|t| t.contains(&format!("  {entry}:"))))
    })
    .await?;
    wait_for("the three nodes labelled", LONG, || async {
        let labelled = fleet_nodes(admin, &format!("migc-pool={good_pool}"))
            .await?
            .iter()
            .filter(|n| n.labels().get(MIG_CONFIG) == Some(&entry))
            .count();
        Ok((labelled == NODES).then_some(()))
    })
    .await?;
    let labelled_after = started.elapsed();

    // The kubelet would mount the ConfigMap; the managers then apply it.
    let mut files = Vec::new();
    let mut managers = Vec::new();
    for node in &nodes {
        let f = write_mig_files(&tmp.join(node), node, 2, "")?;
        std::fs::write(&f.config, &file)?;
        ensure!(!mig_assert(&f, node, &entry)?, "{node} starts without MIG");
        managers.push(start_mig_manager(cluster, node, &f, &[])?);
        files.push(f);
    }
    let outcome = wait_for(
        "every node applied in the MigConfig's status",
        LONG,
        || async {
            let st = Api::<MigConfig>::all(admin.clone())
                .get(&good)
                .await?
                .status
                .unwrap_or_default();
            Ok((st.applied == NODES as i64 && st.pending == 0).then_some(st))
        },
    )
    .await;
    let applied_after = started.elapsed();
    if let Err(e) = outcome {
        let logs: Vec<String> = managers.iter().map(AgentProcess::log_tail).collect();
        anyhow::bail!("{e}; manager logs:\n{}", logs.join("\n---\n"));
    }
    ensure!(
        file.contains(&format!(
            "# gpustack.io/placements {entry}[0]: 3g.40gb@4 1g.10gb@0 1g.10gb@1 1g.10gb@2"
        )),
        "the generated entry carries the placements:\n{file}"
    );
    for (node, f) in nodes.iter().zip(&files) {
        ensure!(mig_assert(f, node, &entry)?, "{node}'s GPUs match {entry}");
        let got = instances(&f.state)?;
        ensure!(
            got.len() == 2 && got.iter().all(|g| g == &[(0, 1), (1, 1), (2, 1), (4, 4)]),
            "{node}: instances (start, slices) {got:?}, not at the placements"
        );
    }
    for n in fleet_nodes(admin, &format!("migc-pool={good_pool}")).await? {
        ensure!(n.labels().get(MIG_STATE).map(String::as_str) == Some("success"));
    }
    let st = Api::<MigConfig>::all(admin.clone())
        .get(&good)
        .await?
        .status;
    let ready = st
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"))
        .map(|c| c.status.clone());
    ensure!(ready.as_deref() == Some("True"), "Ready: {st:?}");
    eprintln!(
        "MigConfig on {NODES} nodes: labelled after {:.1} s, applied on every node after {:.1} s",
        labelled_after.as_secs_f64(),
        applied_after.as_secs_f64()
    );

    // An invalid MigConfig: the reason in status, its node untouched.
    let bad = format!("{prefix}-bad");
    let before = fleet_nodes(admin, &format!("migc-pool={bad_pool}")).await?[0]
        .labels()
        .get(MIG_CONFIG)
        .cloned();
    apply(
        admin,
        &mig_config(&bad, &bad_pool, serde_json::json!({"1g.5gb": 7})),
    )
    .await?;
    let message = wait_for("the refusal in status", LONG, || async {
        let st = Api::<MigConfig>::all(admin.clone())
            .get(&bad)
            .await?
            .status
            .unwrap_or_default();
        Ok(st
            .conditions
            .iter()
            .find(|c| c.type_ == "Error" && c.status == "True")
            .map(|c| c.message.clone()))
    })
    .await?;
    ensure!(
        message.contains("1g.5gb does not exist on this GPU"),
        "{message}"
    );
    let after = fleet_nodes(admin, &format!("migc-pool={bad_pool}")).await?[0]
        .labels()
        .get(MIG_CONFIG)
        .cloned();
    ensure!(
        after == before,
        "{} relabelled: {before:?} -> {after:?}",
        bad_node[0]
    );
    let text = config_maps
        .get(CONFIG_MAP)
        .await?
        .data
        .and_then(|d| d.get("config.yaml").cloned())
        .unwrap_or_default();
    ensure!(
        !text.contains(&format!("gpustack-{bad}")),
        "no config for the refused MigConfig"
    );

    // A placement the geometry refuses (3g.40gb starts at 0 or 4 only).
    apply(
        admin,
        &placed(
            &bad,
            &bad_pool,
            serde_json::json!({"3g.40gb": 1}),
            &[("3g.40gb", 2)],
        ),
    )
    .await?;
    let message = wait_for("the placement's refusal in status", LONG, || async {
        let st = Api::<MigConfig>::all(admin.clone())
            .get(&bad)
            .await?
            .status
            .unwrap_or_default();
        Ok(st
            .conditions
            .iter()
            .find(|c| c.type_ == "Error" && c.status == "True" && c.message.contains("placements"))
            .map(|c| c.message.clone()))
    })
    .await?;
    ensure!(message.contains("placements 3g.40gb@2"), "{message}");
    let after = fleet_nodes(admin, &format!("migc-pool={bad_pool}")).await?[0]
        .labels()
        .get(MIG_CONFIG)
        .cloned();
    ensure!(
        after == before,
        "{} relabelled: {before:?} -> {after:?}",
        bad_node[0]
    );
    for mut m in managers {
        let _ = m.terminate();
    }
    Ok(())
}
