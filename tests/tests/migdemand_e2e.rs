//! Demand-driven MIG on the real test control plane: a MigConfig in
//! `Demand` mode over eight kwok nodes of two simulated H100s each, all
//! starting as three `2g.20gb` per GPU, with a `gpu-mig-manager` process
//! per node publishing its GPUs' layouts and in-use instances. Six pods run
//! on the first two nodes. Forty pending pods ask for
//! `nvidia.com/mig-1g.10gb` (28) and `nvidia.com/mig-3g.40gb` (12): 64
//! compute slices, ten GPUs at the fewest (seven slices each), so five
//! nodes. The operator's demand controller changes the layouts of five
//! nodes, the pods schedule, and the running pods and their instances are
//! never disturbed.
//!
//! The test plays two node-side parts kwok does not: the kubelet's
//! ConfigMap volume (the mig-parted ConfigMap copied to each manager's
//! `--config-file` as it changes) and the device plugin's advertising (each
//! node's `nvidia.com/mig-<profile>` capacity set from the layout its MIG
//! manager published). The ClusterPolicy is a cluster-wide singleton: this
//! test and the other operator tests must not run against the same cluster
//! at the same time.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use gpu_stack_core::operator::migusage::{self, MIG_USAGE_ANNOTATION, NodeUsage};
use gpu_stack_e2e::binaries::{AgentProcess, workspace_binary};
use gpu_stack_e2e::chart::OperatorTestEnv;
use gpu_stack_e2e::migmanager::{mig_assert, start_mig_manager, write_mig_files};
use gpu_stack_e2e::upgrade::{LONG, OperatorProcess, apply_policy, fleet_nodes};
use gpu_stack_e2e::{GpuFleet, TestCluster, wait_for};
use gpu_stack_k8s::operator::migconfig::MigConfig;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};

const MIG_CONFIG: &str = "nvidia.com/mig.config";
const NODES: usize = 8;
const GPUS: u32 = 2;
const CONFIG_MAP: &str = "default-mig-parted-config";
const SMALL: &str = "1g.10gb";
const LARGE: &str = "3g.40gb";
/// The starting layout's profile (three per GPU), which the running pods use.
const BASE: &str = "2g.20gb";
/// The fewest nodes the pending pods need: 10 GPUs.
const FEWEST: usize = 5;
/// Pods running before the demand arrives: three on each of the first two nodes.
const RUNNING_PER_NODE: usize = 3;
/// The pending pods: 28 small and 12 large.
const PENDING_SMALL: usize = 28;
const PENDING_LARGE: usize = 12;

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

fn demand_config(name: &str, pool: &str) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "gpustack.io/v1alpha1",
        "kind": "MigConfig",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"migd-pool": pool},
            "mode": "Demand",
            "demand": {"minIntervalSeconds": 600, "maxNodesPerPass": 8, "batchSeconds": 2},
            "layouts": [{"gpuModel": "H100-SXM5-80GB", "profiles": {BASE: 3}}],
        },
    })
}

fn mig_pod(name: &str, profile: &str, selector: serde_json::Value) -> Result<Pod> {
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "migd"}},
        "spec": {
            "nodeSelector": selector,
            "containers": [{
                "name": "infer",
                "image": "registry.example.com/infer:1",
                "resources": {"limits": {format!("nvidia.com/mig-{profile}"): "1"}},
            }],
        },
    }))?)
}

fn usage_of(node: &Node) -> Option<NodeUsage> {
    migusage::decode(node.annotations().get(MIG_USAGE_ANNOTATION)?).ok()
}

/// Instances per profile on the node's MIG-enabled GPUs.
fn instance_counts(u: &NodeUsage) -> BTreeMap<String, u32> {
    let mut out = BTreeMap::new();
    for i in u
        .gpus
        .iter()
        .filter(|g| g.mig_enabled)
        .flat_map(|g| &g.layout)
    {
        *out.entry(i.profile.to_string()).or_insert(0) += 1;
    }
    out
}

fn requested(pod: &Pod) -> Option<(String, u32)> {
    let limits = pod
        .spec
        .as_ref()?
        .containers
        .first()?
        .resources
        .as_ref()?
        .limits
        .as_ref()?;
    limits.iter().find_map(|(k, v)| {
        Some((
            k.strip_prefix("nvidia.com/mig-")?.to_string(),
            v.0.parse().ok()?,
        ))
    })
}

/// What the node-side stand-ins saw.
#[derive(Default)]
struct Observed {
    /// When a node first published a large instance.
    first_large: Option<Instant>,
    /// A node advertising fewer instances of a profile than its bound pods use.
    violations: Vec<String>,
}

/// The kubelet's ConfigMap volume and the device plugin's advertising, every
/// 200 ms until the task is aborted.
async fn node_side(
    admin: Client,
    namespace: String,
    pool: String,
    configs: Vec<PathBuf>,
    observed: Arc<Mutex<Observed>>,
) {
    let maps: Api<ConfigMap> = Api::namespaced(admin.clone(), &namespace);
    let nodes: Api<Node> = Api::all(admin.clone());
    let pods: Api<Pod> = Api::namespaced(admin, &namespace);
    let mut last_file = String::new();
    loop {
        if let Ok(Some(text)) = maps.get_opt(CONFIG_MAP).await.map(|c| {
            c.and_then(|c| c.data)
                .and_then(|d| d.get("config.yaml").cloned())
        }) && text != last_file
        {
            for path in &configs {
                let tmp = path.with_extension("tmp");
                if std::fs::write(&tmp, &text).is_ok() {
                    let _ = std::fs::rename(&tmp, path);
                }
            }
            last_file = text;
        }
        let listed = nodes
            .list(&ListParams::default().labels(&format!("migd-pool={pool}")))
            .await;
        let bound = pods.list(&ListParams::default()).await;
        if let (Ok(listed), Ok(bound)) = (listed, bound) {
            for node in &listed.items {
                let Some(u) = usage_of(node) else { continue };
                let counts = instance_counts(&u);
                if counts.contains_key(LARGE) {
                    let mut o = observed.lock().unwrap_or_else(|e| e.into_inner());
                    o.first_large.get_or_insert_with(Instant::now);
                }
                // Used per profile by the pods bound here.
                let mut used: BTreeMap<String, u32> = BTreeMap::new();
                for p in bound.items.iter().filter(|p| {
                    p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(&node.name_any())
                }) {
                    if let Some((profile, n)) = requested(p) {
                        *used.entry(profile).or_insert(0) += n;
                    }
                }
                for (profile, n) in &used {
                    let have = counts.get(profile).copied().unwrap_or(0);
                    if have < *n {
                        let mut o = observed.lock().unwrap_or_else(|e| e.into_inner());
                        o.violations.push(format!(
                            "{}: {n} pod(s) use {profile}, the layout holds {have}",
                            node.name_any()
                        ));
                    }
                }
                let mut resources = serde_json::Map::new();
                for profile in [SMALL, LARGE, BASE] {
                    let n = counts.get(profile).copied().unwrap_or(0);
                    resources.insert(format!("nvidia.com/mig-{profile}"), n.to_string().into());
                }
                let advertised = node
                    .status
                    .as_ref()
                    .and_then(|s| s.allocatable.as_ref())
                    .map(|a| {
                        resources
                            .iter()
                            .all(|(k, v)| a.get(k).map(|q| q.0.as_str()) == v.as_str())
                    })
                    .unwrap_or(false);
                if !advertised {
                    let _ = nodes
                        .patch_status(
                            &node.name_any(),
                            &PatchParams::default(),
                            &Patch::Merge(serde_json::json!({"status": {
                                "capacity": resources,
                                "allocatable": resources,
                            }})),
                        )
                        .await;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_mig_pods_change_the_fewest_layouts_and_schedule() -> Result<()> {
    let cluster = TestCluster::attach().await?;
    let env = OperatorTestEnv::setup(&cluster, "migd").await?;
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

    let _ = Api::<MigConfig>::all(admin.clone())
        .delete(prefix, &DeleteParams::default())
        .await;
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
    let pool = prefix.to_string();
    let mut nodes = cluster
        .create_gpu_nodes(
            &GpuFleet::new(format!("{pool}-gpu"), NODES)
                .with_gpus(GPUS)
                .with_label("migd-fleet", prefix)
                .with_label("migd-pool", pool.as_str())
                .with_label("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
        )
        .await?;
    nodes.sort();
    let bin = workspace_binary("gpu-operator")?;
    let _operator = OperatorProcess::start(&bin, kubeconfig, namespace, "migd-e2e", &[])?;
    apply_policy(admin, cluster_policy()).await?;

    let name = prefix.to_string();
    let start_entry = format!("gpustack-{name}");
    let body = demand_config(&name, &pool);
    Api::<MigConfig>::all(admin.clone())
        .patch(
            &name,
            &PatchParams::apply("gpu-stack-e2e").force(),
            &Patch::Apply(&body),
        )
        .await?;
    let config_maps: Api<ConfigMap> = Api::namespaced(admin.clone(), namespace);
    let file = wait_for("the starting layout in the ConfigMap", LONG, || async {
        let text = config_maps
            .get_opt(CONFIG_MAP)
            .await?
            .and_then(|c| c.data)
            .and_then(|d| d.get("config.yaml").cloned());
        Ok(text.filter(|t| t.contains(&format!("  {start_entry}:"))))
    })
    .await?;

    let mut files = Vec::new();
    let mut managers = Vec::new();
    for node in &nodes {
        let f = write_mig_files(&tmp.join(node), node, GPUS, "")?;
        std::fs::write(&f.config, &file)?;
        managers.push(start_mig_manager(
            cluster,
            node,
            &f,
            &["--config-poll-ms", "200"],
        )?);
        files.push(f);
    }
    let observed = Arc::new(Mutex::new(Observed::default()));
    let stand_ins = tokio::spawn(node_side(
        admin.clone(),
        namespace.to_string(),
        pool.clone(),
        files.iter().map(|f| f.config.clone()).collect(),
        Arc::clone(&observed),
    ));
    let outcome = demand(admin, namespace, &pool, &name, &nodes, &files, &observed).await;
    stand_ins.abort();
    if outcome.is_err() {
        let logs: Vec<String> = managers.iter().map(AgentProcess::log_tail).collect();
        eprintln!("manager logs:\n{}", logs.join("\n---\n"));
    }
    for mut m in managers {
        let _ = m.terminate();
    }
    outcome
}

async fn demand(
    admin: &Client,
    namespace: &str,
    pool: &str,
    name: &str,
    nodes: &[String],
    files: &[gpu_stack_e2e::migmanager::MigFiles],
    observed: &Arc<Mutex<Observed>>,
) -> Result<()> {
    let selector = format!("migd-pool={pool}");
    let mig_configs = Api::<MigConfig>::all(admin.clone());
    // The starting layout, applied and advertised everywhere.
    wait_for(
        "the starting layout applied on every node",
        LONG,
        || async {
            let st = mig_configs.get(name).await?.status.unwrap_or_default();
            Ok((st.applied == NODES as i64).then_some(()))
        },
    )
    .await?;
    let base = format!("nvidia.com/mig-{BASE}");
    wait_for("the starting layout advertised", LONG, || async {
        let ok = fleet_nodes(admin, &selector).await?.iter().all(|n| {
            n.status
                .as_ref()
                .and_then(|s| s.allocatable.as_ref())
                .and_then(|a| a.get(&base))
                .map(|q| q.0.as_str())
                == Some("6")
        });
        Ok(ok.then_some(()))
    })
    .await?;

    // Pods already running on the first two nodes.
    let pods: Api<Pod> = Api::namespaced(admin.clone(), namespace);
    let mut running = Vec::new();
    for node in &nodes[..2] {
        for k in 0..RUNNING_PER_NODE {
            let pod_name = format!("running-{node}-{k}");
            let pod = mig_pod(
                &pod_name,
                BASE,
                serde_json::json!({"migd-pool": pool, "kubernetes.io/hostname": node}),
            )?;
            pods.create(&PostParams::default(), &pod).await?;
            running.push(pod_name);
        }
    }
    let before = wait_for("the running pods Running", LONG, || async {
        let mut out = BTreeMap::new();
        for p in &running {
            let pod = pods.get(p).await?;
            if pod.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Running") {
                return Ok(None);
            }
            out.insert(
                p.clone(),
                (
                    pod.uid().unwrap_or_default(),
                    pod.spec.and_then(|s| s.node_name).unwrap_or_default(),
                ),
            );
        }
        Ok(Some(out))
    })
    .await?;
    wait_for(
        "the running pods' instances published in use",
        LONG,
        || async {
            let ok = fleet_nodes(admin, &selector)
                .await?
                .iter()
                .filter(|n| nodes[..2].contains(&n.name_any()))
                .all(|n| {
                    usage_of(n).is_some_and(|u| {
                        u.in_use_counts()
                            .iter()
                            .map(|(_, c)| *c as usize)
                            .sum::<usize>()
                            == RUNNING_PER_NODE
                    })
                });
            Ok(ok.then_some(()))
        },
    )
    .await?;

    // Forty pending pods.
    let started = Instant::now();
    let mut pending = Vec::new();
    for (profile, count) in [(SMALL, PENDING_SMALL), (LARGE, PENDING_LARGE)] {
        for k in 0..count {
            let pod_name = format!("pending-{}-{k}", profile.replace('.', "-"));
            pods.create(
                &PostParams::default(),
                &mig_pod(&pod_name, profile, serde_json::json!({"migd-pool": pool}))?,
            )
            .await?;
            pending.push(pod_name);
        }
    }
    let scheduled = wait_for("all 40 pods scheduled", LONG, || async {
        let listed = pods.list(&ListParams::default()).await?;
        let placed = listed
            .items
            .iter()
            .filter(|p| pending.contains(&p.name_any()))
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some())
            .count();
        Ok((placed == pending.len()).then(|| started.elapsed()))
    })
    .await;
    let st = mig_configs.get(name).await?.status.unwrap_or_default();
    let decision = st.demand.clone().unwrap_or_default();
    let scheduled = match scheduled {
        Ok(s) => s,
        Err(e) => anyhow::bail!("{e}; demand status: {decision:?}"),
    };
    let changed_after = observed
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .first_large
        .map(|t| t.duration_since(started));

    // The fewest nodes: five.
    let start_entry = format!("gpustack-{name}");
    let fleet = fleet_nodes(admin, &selector).await?;
    let changed: Vec<&Node> = fleet
        .iter()
        .filter(|n| {
            n.labels()
                .get(MIG_CONFIG)
                .is_some_and(|l| *l != start_entry)
        })
        .collect();
    ensure!(
        changed.len() == FEWEST,
        "{} node(s) changed layout; the fewest is {FEWEST}: {:?}; {decision:?}",
        changed.len(),
        changed.iter().map(|n| n.name_any()).collect::<Vec<_>>()
    );
    ensure!(
        decision.message.starts_with("changed the layout of")
            || decision.message.contains("serve them"),
        "status says what was decided: {decision:?}"
    );
    ensure!(decision.nodes.len() == changed.len(), "{decision:?}");
    for n in &changed {
        let node = n.name_any();
        let k = nodes.iter().position(|x| *x == node).unwrap_or_default();
        let label = n.labels().get(MIG_CONFIG).cloned().unwrap_or_default();
        ensure!(
            mig_assert(&files[k], &node, &label)?,
            "{node}'s GPUs match {label}"
        );
    }
    // The pods that were running are untouched.
    for (p, (uid, node)) in &before {
        let pod = pods.get(p).await?;
        ensure!(
            pod.uid().as_deref() == Some(uid.as_str())
                && pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node.as_str())
                && pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"),
            "{p} was disturbed"
        );
    }
    let violations = observed
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .violations
        .clone();
    ensure!(
        violations.is_empty(),
        "instances in use were removed: {violations:?}"
    );
    eprintln!("demand decision: {}", decision.message);
    eprintln!(
        "figure: pending pod -> layout changed -> pod scheduled in {:.1} s (layout changed on {} of {NODES} nodes after {}; {} pending pods)",
        scheduled.as_secs_f64(),
        changed.len(),
        changed_after.map_or("?".to_string(), |d| format!("{:.1} s", d.as_secs_f64())),
        pending.len()
    );
    Ok(())
}
