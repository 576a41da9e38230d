//! The `gpu-feature-discovery` binary against the real test control plane.
//!
//! One kwok GPU node; a fleet file written for that node name simulates 8
//! A100-SXM4-40GB behind it, with a `--sim-state` file so `gpu-stack mig apply`
//! (another process, as the MIG manager would be) changes the layout GFD sees.
//! GFD runs as a long-lived process with `--publish --kubeconfig` and a 1 s
//! sleep interval; the test checks that the GPU labels land on the Node, that
//! a MIG layout change adds the `mig-<profile>.*` labels and that going back
//! removes them, that a stale GFD label present before the first run is
//! removed, and that labels GFD does not own are left alone. A `--oneshot`
//! run publishes the same labels it prints with `-o json`.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use gpu_stack_e2e::binaries::{AgentProcess, workspace_binary};
use gpu_stack_e2e::{GpuFleet, TestCluster, unique_suffix, wait_for};
use k8s_openapi::api::core::v1::Node;
use kube::Api;

const LONG: Duration = Duration::from_secs(60);
/// A label under GFD's prefixes that it no longer computes: must go.
const STALE: &str = "nvidia.com/mig-2g.10gb.count";
/// Labels other components own: must stay as they are.
const FOREIGN: [(&str, &str); 3] = [
    ("nvidia.com/device-plugin.config", "custom"),
    ("nvidia.com/mig.config", "all-1g.5gb"),
    ("gfd-e2e.gpu-stack.dev/owner", "test"),
];

/// Environment variables the binaries read; cleared so the caller's shell
/// cannot change what the test runs.
const ENV: [&str; 8] = [
    "NODE_NAME",
    "CONFIG_FILE",
    "MIG_STRATEGY",
    "GFD_ONESHOT",
    "GFD_OUTPUT_FILE",
    "GPU_STACK_BACKEND",
    "GPU_STACK_FLEET",
    "GPU_STACK_SIM_STATE",
];

struct Files {
    dir: PathBuf,
    fleet: PathBuf,
    state: PathBuf,
}

fn write_files(node: &str) -> Result<Files> {
    let dir = std::env::temp_dir().join(format!("gpu-stack-gfd-e2e-{}", unique_suffix()));
    std::fs::create_dir_all(&dir)?;
    let fleet = dir.join("fleet.yaml");
    std::fs::write(
        &fleet,
        format!(
            "nodes:\n  - name: {node}\n    driver-version: \"550.107.02\"\n    gpus:\n      \
             - model: A100-SXM4-40GB\n        count: 8\n"
        ),
    )?;
    Ok(Files {
        state: dir.join("gpus.json"),
        dir,
        fleet,
    })
}

/// A command for a workspace binary simulating `node`'s GPUs.
fn simulated(bin: &str, files: &Files, node: &str) -> Result<Command> {
    let mut c = Command::new(workspace_binary(bin)?);
    for k in ENV {
        c.env_remove(k);
    }
    c.env("RUST_LOG", "info")
        .env("RUST_BACKTRACE", "0")
        .args(["--backend", "simulated", "--node", node, "--fleet"])
        .arg(&files.fleet)
        .arg("--sim-state")
        .arg(&files.state);
    Ok(c)
}

/// GFD's flags for publishing to `node` on the test cluster.
fn gfd(cluster: &TestCluster, files: &Files, node: &str) -> Result<Command> {
    let mut c = simulated("gpu-feature-discovery", files, node)?;
    c.args(["--mig-strategy", "mixed", "--no-timestamp", "--publish"])
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig());
    Ok(c)
}

fn mig_apply(files: &Files, node: &str, config: &str) -> Result<()> {
    let mut c = Command::new(workspace_binary("gpu-stack")?);
    for k in ENV {
        c.env_remove(k);
    }
    let out = c
        .env("RUST_BACKTRACE", "0")
        .args(["mig", "apply", "-f", "default", "-c", config])
        .args(["--backend", "simulated", "--node", node, "--fleet"])
        .arg(&files.fleet)
        .arg("--sim-state")
        .arg(&files.state)
        .output()
        .context("running gpu-stack mig apply")?;
    ensure!(
        out.status.success(),
        "gpu-stack mig apply -c {config} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Starts the long-running GFD process with its stderr in `dir`/gfd.log.
fn start_gfd(mut cmd: Command, dir: &Path) -> Result<AgentProcess> {
    let log = dir.join("gfd.log");
    let child = cmd
        .args(["--sleep-interval", "1s"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()
        .context("starting gpu-feature-discovery")?;
    Ok(AgentProcess::new("gpu-feature-discovery", child, log))
}

async fn node_labels(api: &Api<Node>, node: &str) -> Result<BTreeMap<String, String>> {
    Ok(api.get(node).await?.metadata.labels.unwrap_or_default())
}

/// Waits until the Node's labels satisfy `cond`; returns them.
async fn wait_labels(
    api: &Api<Node>,
    node: &str,
    what: &str,
    cond: impl Fn(&BTreeMap<String, String>) -> bool,
) -> Result<BTreeMap<String, String>> {
    Ok(wait_for(what, LONG, || async {
        let labels = api.get(node).await?.metadata.labels.unwrap_or_default();
        Ok(cond(&labels).then_some(labels))
    })
    .await?)
}

fn assert_foreign_untouched(labels: &BTreeMap<String, String>) {
    for (k, v) in FOREIGN {
        assert_eq!(labels.get(k).map(String::as_str), Some(v), "label {k}");
    }
    assert_eq!(
        labels["feature.node.kubernetes.io/pci-10de.present"],
        "true"
    );
}

#[tokio::test]
async fn gfd_publishes_labels_and_follows_mig_layout_changes() -> Result<()> {
    let cluster = TestCluster::attach().await?;
    let mut fleet = GpuFleet::new(format!("gfd-e2e-{}", unique_suffix()), 1)
        .with_gpus(8)
        .with_label(STALE, "3");
    for (k, v) in FOREIGN {
        fleet = fleet.with_label(k, v);
    }
    let nodes = cluster.create_gpu_nodes(&fleet).await?;
    let node = nodes[0].clone();
    let files = write_files(&node)?;
    let result = scenario(&cluster, &node, &files).await;
    cluster.delete_nodes(&nodes).await?;
    if result.is_ok() {
        let _ = std::fs::remove_dir_all(&files.dir);
    }
    result
}

async fn scenario(cluster: &TestCluster, node: &str, files: &Files) -> Result<()> {
    let api: Api<Node> = Api::all(cluster.client());

    // One-shot: what lands on the Node is what `-o json` prints.
    let out = gfd(cluster, files, node)?
        .args(["--oneshot", "-o", "json"])
        .output()
        .context("running gpu-feature-discovery --oneshot")?;
    ensure!(
        out.status.success(),
        "gpu-feature-discovery --oneshot --publish failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed: BTreeMap<String, String> = serde_json::from_slice(&out.stdout)?;
    let labels = node_labels(&api, node).await?;
    for (k, v) in &printed {
        assert_eq!(labels.get(k), Some(v), "label {k} on Node {node}");
    }
    for (k, v) in [
        ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-40GB"),
        ("nvidia.com/gpu.count", "8"),
        ("nvidia.com/gpu.memory", "40960"),
        ("nvidia.com/gpu.family", "ampere"),
        ("nvidia.com/gpu.compute.major", "8"),
        ("nvidia.com/gpu.compute.minor", "0"),
        ("nvidia.com/cuda.driver.major", "550"),
        ("nvidia.com/cuda.runtime.major", "12"),
        ("nvidia.com/mig.capable", "true"),
        ("nvidia.com/mig.strategy", "mixed"),
        ("nvidia.com/gpu.sharing-strategy", "none"),
    ] {
        assert_eq!(labels.get(k).map(String::as_str), Some(v), "label {k}");
    }
    assert!(!labels.contains_key(STALE), "stale {STALE} was not removed");
    assert!(
        !labels.keys().any(|k| k.starts_with("nvidia.com/mig-")),
        "no MIG devices yet: {labels:?}"
    );
    assert_foreign_untouched(&labels);

    // Long-running: a MIG layout change made by another process shows up.
    let mut gfd_proc = start_gfd(gfd(cluster, files, node)?, &files.dir)?;
    mig_apply(files, node, "all-1g.5gb")?;
    let labels = wait_labels(&api, node, "mig-1g.5gb labels after all-1g.5gb", |l| {
        l.get("nvidia.com/mig-1g.5gb.count").map(String::as_str) == Some("56")
    })
    .await
    .with_context(|| format!("gpu-feature-discovery log:\n{}", gfd_proc.log_tail()))?;
    for (k, v) in [
        ("nvidia.com/mig-1g.5gb.memory", "4864"),
        ("nvidia.com/mig-1g.5gb.multiprocessors", "14"),
        ("nvidia.com/mig-1g.5gb.slices.gi", "1"),
        (
            "nvidia.com/mig-1g.5gb.product",
            "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb",
        ),
        ("nvidia.com/gpu.count", "8"),
        ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-40GB"),
        ("nvidia.com/mig.strategy", "mixed"),
    ] {
        assert_eq!(labels.get(k).map(String::as_str), Some(v), "label {k}");
    }
    assert_foreign_untouched(&labels);

    // Another layout: the 1g labels go, the 3g ones come.
    mig_apply(files, node, "all-3g.20gb")?;
    let labels = wait_labels(&api, node, "mig-3g.20gb labels after all-3g.20gb", |l| {
        l.get("nvidia.com/mig-3g.20gb.count").map(String::as_str) == Some("16")
            && !l.contains_key("nvidia.com/mig-1g.5gb.count")
    })
    .await
    .with_context(|| format!("gpu-feature-discovery log:\n{}", gfd_proc.log_tail()))?;
    assert!(
        !labels
            .keys()
            .any(|k| k.starts_with("nvidia.com/mig-1g.5gb.")),
        "stale 1g.5gb labels: {labels:?}"
    );
    assert_foreign_untouched(&labels);

    // MIG off again: every mig-<profile> label is removed.
    mig_apply(files, node, "all-disabled")?;
    let labels = wait_labels(&api, node, "no mig-* labels after all-disabled", |l| {
        !l.keys().any(|k| k.starts_with("nvidia.com/mig-"))
    })
    .await
    .with_context(|| format!("gpu-feature-discovery log:\n{}", gfd_proc.log_tail()))?;
    assert_eq!(labels["nvidia.com/gpu.count"], "8");
    assert_eq!(labels["nvidia.com/gpu.product"], "NVIDIA-A100-SXM4-40GB");
    assert_foreign_untouched(&labels);

    let status = gfd_proc.terminate()?;
    ensure!(
        status.success(),
        "gpu-feature-discovery exited with {status} after SIGTERM; log:\n{}",
        gfd_proc.log_tail()
    );
    Ok(())
}
