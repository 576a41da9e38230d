//! The `gpu-dra-plugin` binary against the real control plane, for a kwok
//! node: it publishes the node's ResourceSlices, the scheduler allocates a
//! MIG device to a claim from them, and a stand-in kubelet (kwok runs none)
//! prepares the claim over the plugin's real gRPC socket: the instance is
//! created at the allocated placement and destroyed on unprepare. Then the
//! plugin is SIGKILLed after it created a claim's GPU instance and before it
//! recorded the claim prepared (MIG changes are slowed on the simulated GPU
//! to hold that window open): started again, it destroys the instance, and
//! the kubelet's retry creates it exactly once. Last, a prepared claim is
//! deleted while the plugin is stopped: started again, the plugin destroys
//! its instance and removes its CDI spec.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use gpu_stack_e2e::binaries::{AgentProcess, workspace_binary};
use gpu_stack_e2e::dra::{
    DRIVER, MIG_CLASS, allocated_devices, apply_chart_class, claim_pod, delete_claims,
    delete_node_slices, delete_run_class, mig_claim,
};
use gpu_stack_e2e::{E2eError, GpuFleet, TestCluster, unique_suffix, wait_for};
use gpu_stack_k8s::kubelet::dra::{ClaimRef, DraKubeletStandin};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};

const STEP: Duration = Duration::from_secs(120);
/// Added to every MIG change of the simulated GPU in the kill scenario.
const SLOW_MS: u64 = 3000;

struct Node {
    name: String,
    dir: PathBuf,
    fleet: PathBuf,
    state: PathBuf,
    /// The run's copy of the chart's MIG DeviceClass.
    class: String,
}

fn write_fleet(node: &Node, faults: &str) -> Result<()> {
    std::fs::write(
        &node.fleet,
        format!(
            "nodes:\n  - name: {}\n{faults}    gpus:\n      - model: H100-SXM5-80GB\n        count: 1\n        mig:\n          enabled: true\n",
            node.name
        ),
    )?;
    Ok(())
}

fn start_plugin(cluster: &TestCluster, node: &Node, log_name: &str) -> Result<AgentProcess> {
    let log = node.dir.join(log_name);
    let out = std::fs::File::create(&log)?;
    let child = Command::new(workspace_binary("gpu-dra-plugin")?)
        .args(["--node-name", &node.name])
        .args(["--backend", "simulated", "--fleet"])
        .arg(&node.fleet)
        .arg("--sim-state")
        .arg(&node.state)
        .arg("--kubelet-plugins-dir")
        .arg(node.dir.join("plugins"))
        .arg("--kubelet-registry-dir")
        .arg(node.dir.join("registry"))
        .arg("--cdi-spec-dir")
        .arg(node.dir.join("cdi"))
        .arg("--mig-minors")
        .arg(node.dir.join("no-mig-minors"))
        .args(["--rescan-interval-seconds", "1"])
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig())
        .env_remove("NODE_NAME")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(out)
        .spawn()
        .context("starting gpu-dra-plugin")?;
    Ok(AgentProcess::new("gpu-dra-plugin", child, log))
}

/// The simulated GPU's instances: (profile, start, compute instances).
fn instances(node: &Node) -> Result<Vec<(String, u64, usize)>> {
    let out = Command::new(workspace_binary("gpu-stack")?)
        .args(["gpus", "--backend", "simulated", "-o", "json", "--fleet"])
        .arg(&node.fleet)
        .arg("--sim-state")
        .arg(&node.state)
        .output()?;
    ensure!(
        out.status.success(),
        "gpu-stack gpus: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let body: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let mut found: Vec<(String, u64, usize)> = body["gpus"][0]["mig"]["gpu_instances"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|gi| {
            (
                gi["profile_name"].as_str().unwrap_or_default().to_string(),
                gi["placement"]["start"].as_u64().unwrap_or(u64::MAX),
                gi["compute_instances"].as_array().map_or(0, Vec::len),
            )
        })
        .collect();
    found.sort();
    Ok(found)
}

/// Creates a 1g.10gb claim and a pod on `node` using it; returns the claim
/// once the scheduler allocated it, and the allocated placement start.
async fn allocated_claim(
    client: &Client,
    ns: &str,
    name: &str,
    node: &Node,
) -> Result<(ClaimRef, u64)> {
    let class = &node.class;
    let node = &node.name;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    claims
        .create(
            &PostParams::default(),
            &mig_claim(name, class, "1g.10gb", 1)?,
        )
        .await?;
    let selector = BTreeMap::from([("kubernetes.io/hostname".to_string(), node.to_string())]);
    let mut pod = claim_pod(name, name, &selector)?;
    if let Some(spec) = pod.spec.as_mut() {
        spec.tolerations = Some(vec![k8s_openapi::api::core::v1::Toleration {
            operator: Some("Exists".into()),
            ..Default::default()
        }]);
    }
    pods.create(&PostParams::default(), &pod).await?;
    let claim = wait_for(&format!("claim {name} to be allocated"), STEP, || {
        let claims = claims.clone();
        async move {
            let c = claims.get(name).await?;
            Ok((!allocated_devices(&c).is_empty()).then_some(c))
        }
    })
    .await?;
    let devices = allocated_devices(&claim);
    let [(pool, device)] = devices.as_slice() else {
        bail!("claim {name} allocated {devices:?}");
    };
    ensure!(pool == node, "allocated from pool {pool}, not {node}");
    let start = device
        .strip_prefix("gpu-0-mig-1g10gb-19-")
        .and_then(|s| s.parse::<u64>().ok())
        .with_context(|| format!("allocated device {device} is not a 1g.10gb placement"))?;
    Ok((
        ClaimRef {
            namespace: ns.to_string(),
            uid: claim.uid().context("claim without uid")?,
            name: name.to_string(),
        },
        start,
    ))
}

async fn registered(registry: &Path) -> Result<DraKubeletStandin> {
    let standin = DraKubeletStandin::start(registry).await?;
    standin
        .wait_for("the plugin to register", STEP, |v| {
            v.endpoint(DRIVER).is_some()
        })
        .await?;
    Ok(standin)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plugin_binary_prepares_what_the_scheduler_allocated_and_survives_a_kill() -> Result<()>
{
    let cluster = TestCluster::attach().await?;
    let client = cluster.client();
    let prefix = format!("drap-{}", unique_suffix());
    let names = cluster
        .create_gpu_nodes(&GpuFleet::new(prefix.clone(), 1).with_gpus(1))
        .await?;
    let ns = cluster.create_namespace(&prefix).await?;
    let class = apply_chart_class(&client, MIG_CLASS, &prefix).await?;
    // Short: socket paths under it must fit a unix socket address.
    let dir = std::env::temp_dir().join(&prefix);
    std::fs::create_dir_all(&dir)?;
    let node = Node {
        name: names[0].clone(),
        fleet: dir.join("fleet.yaml"),
        state: dir.join("gpus.json"),
        dir,
        class,
    };
    let result = scenario(&cluster, &client, &ns, &node).await;
    let _ = delete_claims(&client, &ns).await;
    let _ = cluster.delete_namespace(&ns).await;
    let _ = delete_node_slices(&client, &names).await;
    let _ = cluster.delete_nodes(&names).await;
    delete_run_class(&client, &node.class).await;
    if result.is_err() {
        for log in ["plugin-1.log", "plugin-2.log", "plugin-3.log"] {
            let text = std::fs::read_to_string(node.dir.join(log)).unwrap_or_default();
            eprintln!("---- {log} ----\n{text}");
        }
    } else {
        let _ = std::fs::remove_dir_all(&node.dir);
    }
    result
}

async fn scenario(cluster: &TestCluster, client: &Client, ns: &str, node: &Node) -> Result<()> {
    write_fleet(node, "")?;
    let mut plugin = start_plugin(cluster, node, "plugin-1.log")?;
    let standin = registered(&node.dir.join("registry")).await?;
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let published = wait_for("the plugin's ResourceSlice", STEP, || {
        let slices = slices.clone();
        let node = node.name.clone();
        async move {
            let list = slices
                .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
                .await?;
            // The whole pool: from 1.35 a counter slice and a device slice.
            let complete = list
                .items
                .first()
                .is_some_and(|s| s.spec.pool.resource_slice_count == list.items.len() as i64);
            Ok(complete.then_some(list.items))
        }
    })
    .await?;
    let devices: usize = published
        .iter()
        .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
        .sum();
    ensure!(
        devices == 26,
        "the H100 publishes {devices} devices, not 26"
    );

    // The scheduler allocates; the plugin creates exactly that instance.
    let (claim, start) = allocated_claim(client, ns, "first", node).await?;
    let out = standin
        .prepare(DRIVER, std::slice::from_ref(&claim))
        .await?;
    let prepared = out[&claim.uid]
        .as_ref()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    ensure!(
        prepared[0].cdi_device_ids
            == [format!(
                "k8s.gpu.nvidia.com/claim={}-gpu-0-mig-1g10gb-19-{start}",
                claim.uid
            )],
        "{prepared:?}"
    );
    ensure!(
        instances(node)? == [("1g.10gb".to_string(), start, 1)],
        "after prepare: {:?}",
        instances(node)?
    );
    ensure!(
        node.dir
            .join(format!("cdi/gpu.nvidia.com-claim_{}.json", claim.uid))
            .exists(),
        "no CDI spec for the claim"
    );
    let out = standin
        .unprepare(DRIVER, std::slice::from_ref(&claim))
        .await?;
    ensure!(out[&claim.uid].is_ok(), "{:?}", out[&claim.uid]);
    ensure!(
        instances(node)?.is_empty(),
        "after unprepare: {:?}",
        instances(node)?
    );
    plugin.terminate()?;

    // Killed between creating the GPU instance and recording the claim.
    write_fleet(
        node,
        &format!(
            "    faults:\n      - fault: {{type: slow-calls, calls: mig-change, delay-ms: {SLOW_MS}}}\n"
        ),
    )?;
    let _ = std::fs::remove_file(&node.state);
    let mut plugin = start_plugin(cluster, node, "plugin-2.log")?;
    let standin = registered(&node.dir.join("registry")).await?;
    let (claim, start) = allocated_claim(client, ns, "second", node).await?;
    let preparing = {
        let claim = claim.clone();
        tokio::spawn(async move { standin.prepare(DRIVER, &[claim]).await })
    };
    // The GPU instance exists and its compute instance does not yet: the
    // plugin sits in the slowed call between the two.
    wait_for(
        "the GPU instance without its compute instance",
        STEP,
        || async {
            let now = instances(node).map_err(|e| E2eError::Check(format!("{e:#}")))?;
            Ok((now == [("1g.10gb".to_string(), start, 0)]).then_some(()))
        },
    )
    .await?;
    plugin.kill()?;
    let _ = preparing.await;
    let checkpoint =
        std::fs::read_to_string(node.dir.join("plugins/gpu.nvidia.com/checkpoint.json"))?;
    ensure!(
        checkpoint.contains("\"preparing\""),
        "the claim is not recorded as preparing: {checkpoint}"
    );

    // Started again: the half-made instance is rolled back...
    let mut plugin = start_plugin(cluster, node, "plugin-3.log")?;
    let standin = registered(&node.dir.join("registry")).await?;
    ensure!(
        instances(node)?.is_empty(),
        "after restart: {:?}",
        instances(node)?
    );
    // ...and the kubelet's retry creates it once, where it was allocated.
    let out = standin
        .prepare(DRIVER, std::slice::from_ref(&claim))
        .await?;
    ensure!(out[&claim.uid].is_ok(), "{:?}", out[&claim.uid]);
    ensure!(
        instances(node)? == [("1g.10gb".to_string(), start, 1)],
        "after the retried prepare: {:?}",
        instances(node)?
    );
    let out = standin
        .unprepare(DRIVER, std::slice::from_ref(&claim))
        .await?;
    ensure!(out[&claim.uid].is_ok(), "{:?}", out[&claim.uid]);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let _ = pods
        .delete_collection(
            &DeleteParams::default().grace_period(0),
            &ListParams::default(),
        )
        .await;

    // A claim deleted while its plugin is down: no unprepare ever comes,
    // and the plugin gives the instance back once it starts again.
    let (claim, start) = allocated_claim(client, ns, "third", node).await?;
    let out = standin
        .prepare(DRIVER, std::slice::from_ref(&claim))
        .await?;
    ensure!(out[&claim.uid].is_ok(), "{:?}", out[&claim.uid]);
    plugin.terminate()?;
    ensure!(
        instances(node)? == [("1g.10gb".to_string(), start, 1)],
        "before the claim goes: {:?}",
        instances(node)?
    );
    let _ = pods
        .delete_collection(
            &DeleteParams::default().grace_period(0),
            &ListParams::default(),
        )
        .await;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), ns);
    claims.delete("third", &DeleteParams::default()).await?;
    wait_for("the third claim gone", STEP, || {
        let claims = claims.clone();
        async move { Ok(claims.get_opt("third").await?.is_none().then_some(())) }
    })
    .await?;
    let mut plugin = start_plugin(cluster, node, "plugin-4.log")?;
    let spec = node
        .dir
        .join(format!("cdi/gpu.nvidia.com-claim_{}.json", claim.uid));
    wait_for(
        "the deleted claim's instance and CDI spec released",
        STEP,
        || async {
            let now = instances(node).map_err(|e| E2eError::Check(format!("{e:#}")))?;
            Ok((now.is_empty() && !spec.exists()).then_some(()))
        },
    )
    .await?;
    plugin.terminate()?;
    Ok(())
}
