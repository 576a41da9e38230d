//! The `gpu-mig-manager` binary against the real test control plane.
//!
//! One kwok GPU node (8 simulated H100-SXM5-80GB from a fleet file written for
//! this test) and one GPU client pod on it (`app=nvidia-device-plugin-daemonset`).
//! The manager runs as a separate process with a simulated-GPU state file,
//! once as `gpu-mig-manager` and once hosted by `gpu-node-agent`
//! (`nodeAgent.enabled`), which must keep the same contract;
//! `gpu-stack mig assert` reads the same file afterwards, as a second process
//! on the node would. The test plays the DaemonSet controller: it removes the
//! client pod once the manager paused its deploy label, so the manager's wait
//! for clients to leave is on the path.
use std::collections::BTreeMap;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail, ensure};
use futures::StreamExt;
use gpu_stack_e2e::binaries::workspace_binary;
use gpu_stack_e2e::migmanager::{
    ManagerHost, MigFiles, mig_assert, start_mig_manager_on, write_mig_files,
};
use gpu_stack_e2e::{GpuFleet, TestCluster, unique_suffix, wait_for};
use k8s_openapi::api::core::v1::{Container, Node, Pod, PodSpec};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};

const LONG: Duration = Duration::from_secs(90);
const MIG_CONFIG: &str = "nvidia.com/mig.config";
const MIG_STATE: &str = "nvidia.com/mig.config.state";
const PAUSE_RECORD: &str = "gpu-stack/mig-manager.paused-labels";
const FAILURE: &str = "gpu-stack/mig-manager.failure-reason";
const DEPLOY_DP: &str = "nvidia.com/gpu.deploy.device-plugin";
const DEPLOY_GFD: &str = "nvidia.com/gpu.deploy.gpu-feature-discovery";
const DEPLOY_EXPORTER: &str = "nvidia.com/gpu.deploy.dcgm-exporter";
const DEPLOY_MIG: &str = "nvidia.com/gpu.deploy.mig-manager";
const PAUSED: &str = "paused-for-mig-change";

type Files = MigFiles;

fn write_files(node: &str) -> Result<Files> {
    write_files_for(node, 8, "")
}

/// Files for a node of `count` H100s; `node_extra` is more YAML under the node.
fn write_files_for(node: &str, count: u32, node_extra: &str) -> Result<Files> {
    let dir = std::env::temp_dir().join(format!("gpu-stack-mig-e2e-{}", unique_suffix()));
    write_mig_files(&dir, node, count, node_extra)
}

fn labels(node: &Node) -> BTreeMap<String, String> {
    node.metadata.labels.clone().unwrap_or_default()
}

fn deploy_labels(l: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    l.iter()
        .filter(|(k, _)| k.starts_with("nvidia.com/gpu.deploy."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

async fn label_node(client: &Client, node: &str, key: &str, value: &str) -> Result<()> {
    let body = serde_json::json!({"metadata": {"labels": {key: value}}});
    Api::<Node>::all(client.clone())
        .patch(node, &PatchParams::default(), &Patch::Merge(&body))
        .await?;
    Ok(())
}

async fn wait_label(client: &Client, node: &str, key: &str, want: &str) -> Result<Node> {
    let api = Api::<Node>::all(client.clone());
    let what = format!("{key}={want} on {node}");
    Ok(wait_for(&what, LONG, || {
        let api = api.clone();
        async move {
            let n = api.get(node).await?;
            Ok((labels(&n).get(key).map(String::as_str) == Some(want)).then_some(n))
        }
    })
    .await?)
}

/// Every (state, device-plugin deploy label) pair the node went through, in order.
type History = Arc<Mutex<Vec<(Option<String>, Option<String>)>>>;

fn record_history(client: &Client, node: &str) -> (History, tokio::task::JoinHandle<()>) {
    let history: History = Arc::default();
    let api = Api::<Node>::all(client.clone());
    let cfg = watcher::Config::default().fields(&format!("metadata.name={node}"));
    let sink = history.clone();
    let task = tokio::spawn(async move {
        let mut stream = watcher(api, cfg)
            .default_backoff()
            .applied_objects()
            .boxed();
        while let Some(Ok(n)) = stream.next().await {
            let l = labels(&n);
            let entry = (l.get(MIG_STATE).cloned(), l.get(DEPLOY_DP).cloned());
            let mut h = sink.lock().unwrap_or_else(|p| p.into_inner());
            if h.last() != Some(&entry) {
                h.push(entry);
            }
        }
    });
    (history, task)
}

fn client_pod(node: &str) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some("device-plugin".to_string()),
            labels: Some(BTreeMap::from([(
                "app".to_string(),
                "nvidia-device-plugin-daemonset".to_string(),
            )])),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.to_string()),
            containers: vec![Container {
                name: "plugin".to_string(),
                image: Some("registry.invalid/device-plugin:test".to_string()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}

#[tokio::test]
async fn mig_manager_applies_the_labelled_config_and_fails_cleanly() -> Result<()> {
    let cluster = TestCluster::attach().await?;
    let client = cluster.client();
    for host in ManagerHost::BOTH {
        let prefix = format!("mig-{}", unique_suffix());
        let fleet = GpuFleet::new(prefix, 1)
            .with_label(DEPLOY_DP, "true")
            .with_label(DEPLOY_GFD, "true")
            .with_label(DEPLOY_EXPORTER, "false")
            .with_label(DEPLOY_MIG, "true");
        let names = cluster.create_gpu_nodes(&fleet).await?;
        let node = names[0].clone();
        let namespace = cluster.create_namespace("mig-e2e").await?;
        let files = write_files(&node)?;

        let outcome = scenario(host, &cluster, &client, &node, &namespace, &files).await;

        cluster.delete_nodes(&names).await?;
        cluster.delete_namespace(&namespace).await?;
        outcome.with_context(|| format!("MIG manager on {host:?}"))?;
        let _ = std::fs::remove_dir_all(&files.dir);
    }
    Ok(())
}

async fn scenario(
    host: ManagerHost,
    cluster: &TestCluster,
    client: &Client,
    node: &str,
    namespace: &str,
    files: &Files,
) -> Result<()> {
    let nodes = Api::<Node>::all(client.clone());
    let pods = Api::<Pod>::namespaced(client.clone(), namespace);
    pods.create(&PostParams::default(), &client_pod(node))
        .await?;
    let before = deploy_labels(&labels(&nodes.get(node).await?));
    ensure!(
        !mig_assert(files, node, "all-1g.10gb")?,
        "GPUs start without MIG"
    );

    let (history, watch) = record_history(client, node);
    let mut manager = start_mig_manager_on(host, cluster, node, files, &[])?;
    let run = async {
        // 1. all-1g.10gb: pause, wait for the client pod, apply, restore.
        label_node(client, node, MIG_CONFIG, "all-1g.10gb").await?;
        let paused = wait_label(client, node, DEPLOY_DP, PAUSED).await?;
        let l = labels(&paused);
        ensure!(
            l.get(MIG_STATE).map(String::as_str) == Some("pending"),
            "clients paused while {MIG_STATE}={:?}",
            l.get(MIG_STATE)
        );
        ensure!(
            l.get(DEPLOY_EXPORTER).map(String::as_str) == Some("false"),
            "a `false` deploy label is never overridden"
        );
        // The manager waits for the pod; the DaemonSet controller would delete it now.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let still = labels(&nodes.get(node).await?);
        ensure!(
            still.get(MIG_STATE).map(String::as_str) == Some("pending"),
            "the manager went on while a client pod was still on the node"
        );
        let dp = DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::default()
        };
        pods.delete("device-plugin", &dp).await?;
        let done = wait_label(client, node, MIG_STATE, "success").await?;
        let l = labels(&done);
        ensure!(
            deploy_labels(&l) == before,
            "deploy labels restored exactly: {l:?}"
        );
        let annotations = done.annotations();
        ensure!(
            !annotations.contains_key(PAUSE_RECORD) && !annotations.contains_key(FAILURE),
            "no pause record or failure left: {annotations:?}"
        );
        ensure!(
            mig_assert(files, node, "all-1g.10gb")?,
            "GPUs have all-1g.10gb"
        );
        ensure!(
            files.signal.is_file(),
            "signal file written for the device plugin"
        );

        // 2. A config that cannot apply to H100s: failed, nothing paused, GPUs untouched.
        label_node(client, node, MIG_CONFIG, "all-1g.6gb").await?;
        let failed = wait_label(client, node, MIG_STATE, "failed").await?;
        ensure!(
            deploy_labels(&labels(&failed)) == before,
            "labels restored on failure"
        );
        let reason = failed
            .annotations()
            .get(FAILURE)
            .cloned()
            .unwrap_or_default();
        ensure!(
            reason.contains("1g.6gb"),
            "failure reason names the profile: {reason:?}"
        );
        ensure!(
            mig_assert(files, node, "all-1g.10gb")?,
            "GPUs keep their layout"
        );
        let events = Api::<Event>::namespaced(client.clone(), "default");
        wait_for("a MigConfigFailed Event for the node", LONG, || {
            let events = events.clone();
            async move {
                let list = events.list(&ListParams::default()).await?;
                Ok(list
                    .items
                    .iter()
                    .any(|e| {
                        e.reason.as_deref() == Some("MigConfigFailed")
                            && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(node)
                    })
                    .then_some(()))
            }
        })
        .await?;

        // 3. SIGTERM stops it cleanly.
        let status = manager.terminate()?;
        ensure!(status.success(), "gpu-mig-manager exited with {status}");
        Ok::<(), anyhow::Error>(())
    };
    let result = run.await;
    watch.abort();
    if let Err(e) = result {
        bail!("{e:#}\n--- gpu-mig-manager log ---\n{}", manager.log_tail());
    }

    let h = history.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let position = |state: &str, dp: Option<&str>| {
        h.iter()
            .position(|(s, d)| s.as_deref() == Some(state) && (dp.is_none() || d.as_deref() == dp))
    };
    let pending = position("pending", Some(PAUSED)).ok_or_else(|| anyhow!("no pending: {h:?}"))?;
    let success = position("success", Some("true")).ok_or_else(|| anyhow!("no success: {h:?}"))?;
    let failed = position("failed", Some("true")).ok_or_else(|| anyhow!("no failed: {h:?}"))?;
    ensure!(pending < success && success < failed, "order: {h:?}");
    ensure!(
        h[success..]
            .iter()
            .all(|(s, _)| s.as_deref() != Some("pending")),
        "the impossible config never went pending: {h:?}"
    );
    Ok(())
}

/// The `rebooting` path: MIG mode changes on this node need a GPU reset the
/// manager is told not to do, so the first pass ends `rebooting` with the
/// clients still paused and the reboot hook run; after the simulated reboot
/// (`gpu-stack gpus --reboot` on the node's state file) the restarted manager
/// finishes the change and restores the labels.
#[tokio::test]
async fn mig_manager_reports_rebooting_runs_the_hook_and_resumes_after_reboot() -> Result<()> {
    let cluster = TestCluster::attach().await?;
    let client = cluster.client();
    for host in ManagerHost::BOTH {
        let prefix = format!("migr-{}", unique_suffix());
        let fleet = GpuFleet::new(prefix, 1)
            .with_label(DEPLOY_DP, "true")
            .with_label(DEPLOY_EXPORTER, "false")
            .with_label(DEPLOY_MIG, "true");
        let names = cluster.create_gpu_nodes(&fleet).await?;
        let node = names[0].clone();
        let files = write_files_for(&node, 2, "    mig-change-needs-reset: true\n")?;

        let outcome = reboot_scenario(host, &cluster, &client, &node, &files).await;

        cluster.delete_nodes(&names).await?;
        outcome.with_context(|| format!("MIG manager on {host:?}"))?;
        let _ = std::fs::remove_dir_all(&files.dir);
    }
    Ok(())
}

async fn reboot_scenario(
    host: ManagerHost,
    cluster: &TestCluster,
    client: &Client,
    node: &str,
    files: &Files,
) -> Result<()> {
    let nodes = Api::<Node>::all(client.clone());
    let before = deploy_labels(&labels(&nodes.get(node).await?));
    let marker = files.dir.join("rebooted-by-hook");
    let hook = format!("echo \"$NODE_NAME $MIG_CONFIG\" > '{}'", marker.display());
    let mut manager = start_mig_manager_on(
        host,
        cluster,
        node,
        files,
        &["--no-gpu-reset", "--reboot-hook", &hook],
    )?;
    let first = async {
        label_node(client, node, MIG_CONFIG, "all-1g.10gb").await?;
        let rebooting = wait_label(client, node, MIG_STATE, "rebooting").await?;
        let l = labels(&rebooting);
        ensure!(
            l.get(DEPLOY_DP).map(String::as_str) == Some(PAUSED),
            "clients stay paused across the reboot: {l:?}"
        );
        ensure!(
            rebooting.annotations().contains_key(PAUSE_RECORD),
            "the pause record survives for the next start"
        );
        let text = wait_for("the reboot hook's marker file", LONG, || {
            let marker = marker.clone();
            async move {
                Ok(std::fs::read_to_string(&marker)
                    .ok()
                    .filter(|t| !t.is_empty()))
            }
        })
        .await?;
        ensure!(
            text.trim() == format!("{node} all-1g.10gb"),
            "the hook saw NODE_NAME and MIG_CONFIG: {text:?}"
        );
        ensure!(
            !mig_assert(files, node, "all-1g.10gb")?,
            "nothing is done before the reboot"
        );
        let status = manager.terminate()?;
        ensure!(status.success(), "gpu-mig-manager exited with {status}");
        Ok::<(), anyhow::Error>(())
    };
    if let Err(e) = first.await {
        bail!("{e:#}\n--- gpu-mig-manager log ---\n{}", manager.log_tail());
    }

    // The node reboots: pending MIG modes take effect, instances are gone.
    let out = Command::new(workspace_binary("gpu-stack")?)
        .args(["gpus", "--reboot", "--backend", "simulated", "--fleet"])
        .arg(&files.fleet)
        .args(["--node", node, "--sim-state"])
        .arg(&files.state)
        .output()
        .context("running gpu-stack gpus --reboot")?;
    ensure!(
        out.status.success(),
        "gpu-stack gpus --reboot failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let mut manager = start_mig_manager_on(host, cluster, node, files, &["--no-gpu-reset"])?;
    let second = async {
        let done = wait_label(client, node, MIG_STATE, "success").await?;
        let l = labels(&done);
        ensure!(
            deploy_labels(&l) == before,
            "deploy labels restored exactly: {l:?}"
        );
        ensure!(
            !done.annotations().contains_key(PAUSE_RECORD),
            "pause record cleared"
        );
        ensure!(
            mig_assert(files, node, "all-1g.10gb")?,
            "GPUs have all-1g.10gb after the reboot"
        );
        let status = manager.terminate()?;
        ensure!(status.success(), "gpu-mig-manager exited with {status}");
        Ok::<(), anyhow::Error>(())
    };
    if let Err(e) = second.await {
        bail!("{e:#}\n--- gpu-mig-manager log ---\n{}", manager.log_tail());
    }
    Ok(())
}
