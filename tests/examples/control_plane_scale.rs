//! Scale figure for the test control plane: creates N fake GPU nodes (1,000 by
//! default), applies a DaemonSet selecting them and reports how long the
//! cluster takes until its pods are Running on every node. This is the floor
//! the operator's convergence is measured against. Run it through
//! `scripts/bench-control-plane.sh`, which starts and stops the cluster.
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpu_stack_e2e::{
    E2eError, GpuFleet, TestCluster, gpu_probe_daemonset, unique_suffix, wait_for,
};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{ListParams, PostParams};

/// Upper bound per phase so a broken cluster ends the run.
const PHASE_LIMIT: Duration = Duration::from_secs(1800);

#[tokio::main]
async fn main() -> Result<()> {
    let nodes: usize = match std::env::args().nth(1) {
        Some(arg) => arg
            .parse()
            .with_context(|| format!("node count {arg:?} is not a number; pass e.g. 1000"))?,
        None => 1000,
    };
    if nodes == 0 || nodes > 5000 {
        bail!("node count {nodes} is out of range: use 1 to 5000");
    }
    let cluster = TestCluster::attach().await?;
    let run = unique_suffix();
    let run_label = "bench.gpu-stack.dev/run";
    let fleet = GpuFleet::new(format!("scale-{run}"), nodes).with_label(run_label, &run);
    let selector = format!("{run_label}={run}");

    let total = Instant::now();
    let names = cluster.create_gpu_nodes(&fleet).await?;
    let created = total.elapsed();
    println!(
        "created {nodes} fake GPU nodes in {:.1}s",
        created.as_secs_f64()
    );

    let node_api = Api::<Node>::all(cluster.client());
    let lp = ListParams::default().labels(&selector);
    wait_for("every node Ready", PHASE_LIMIT, || {
        let node_api = node_api.clone();
        let lp = lp.clone();
        async move {
            let list = node_api.list(&lp).await?;
            let ready = list
                .items
                .iter()
                .filter(|n| {
                    n.status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
                })
                .count();
            Ok::<_, E2eError>((ready == nodes).then_some(()))
        }
    })
    .await?;
    println!(
        "all {nodes} nodes Ready {:.1}s after the first create",
        total.elapsed().as_secs_f64()
    );

    let ns = cluster.create_namespace("scale").await?;
    let ds = gpu_probe_daemonset("scale-probe", "scale-probe", run_label, &run);
    let ds_start = Instant::now();
    Api::<DaemonSet>::namespaced(cluster.client(), &ns)
        .create(&PostParams::default(), &ds)
        .await?;
    let pod_api = Api::<Pod>::namespaced(cluster.client(), &ns);
    let last_report = std::cell::Cell::new(0usize);
    wait_for("DaemonSet pods Running on every node", PHASE_LIMIT, || {
        let pod_api = pod_api.clone();
        let report = &last_report;
        let elapsed = ds_start.elapsed();
        async move {
            let list = pod_api.list(&ListParams::default()).await?;
            let running = list
                .items
                .iter()
                .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
                .count();
            if running >= report.get() + nodes.div_ceil(10) || running == nodes {
                println!(
                    "  {running:>5}/{nodes} pods Running at {:.1}s",
                    elapsed.as_secs_f64()
                );
                report.set(running);
            }
            Ok::<_, E2eError>((running == nodes).then_some(()))
        }
    })
    .await?;
    let converged = ds_start.elapsed();
    println!(
        "RESULT nodes={nodes} daemonset_all_running_s={:.1} node_create_s={:.1}",
        converged.as_secs_f64(),
        created.as_secs_f64()
    );

    let cleanup = Instant::now();
    cluster.delete_namespace(&ns).await?;
    cluster.delete_nodes(&names).await?;
    println!("cleaned up in {:.1}s", cleanup.elapsed().as_secs_f64());
    Ok(())
}
