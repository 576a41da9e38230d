//! The `gpu-node-agent` binary against the real test control plane: one
//! kwok GPU node of 2 simulated H100s, and the device plugin (serving its
//! sockets without a kubelet), GFD, the exporter and the MIG manager in one
//! process. Each component must run exactly while its deploy label is
//! `true`, and the hosted MIG manager must wait for the in-process stop of
//! the clients it pauses before it changes the GPUs. With the validator
//! hosted, the agent runs the gates itself: nothing starts before the
//! validator's checks have written the status files it waits for, and the
//! agent is ready exactly while every component that should run is up.
//! With one GPU hung, the exporter drops only that GPU's series and the
//! supervisor goes on around the components stuck on it.
use std::collections::BTreeMap;
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use gpu_stack_e2e::binaries::{AgentProcess, workspace_binary};
use gpu_stack_e2e::migmanager::{MigFiles, mig_assert, write_mig_files};
use gpu_stack_e2e::{GpuFleet, TestCluster, http_get, unique_suffix, wait_for};
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};

const LONG: Duration = Duration::from_secs(90);
const DEPLOY_DP: &str = "nvidia.com/gpu.deploy.device-plugin";
const DEPLOY_GFD: &str = "nvidia.com/gpu.deploy.gpu-feature-discovery";
const DEPLOY_EXPORTER: &str = "nvidia.com/gpu.deploy.dcgm-exporter";
const DEPLOY_MIG: &str = "nvidia.com/gpu.deploy.mig-manager";
const GFD_PRODUCT: &str = "nvidia.com/gpu.product";
const DEPLOY_VALIDATOR: &str = "nvidia.com/gpu.deploy.operator-validator";
const DP_SOCKET: &str = "nvidia-gpu.sock";
const STATUS_FILES: [&str; 4] = [
    "driver-ready",
    "toolkit-ready",
    "cuda-ready",
    "plugin-ready",
];

fn start_node_agent(
    cluster: &TestCluster,
    node: &str,
    files: &MigFiles,
    port: u16,
) -> Result<AgentProcess> {
    let log = files.dir.join("node-agent.log");
    let kubelet_dir = files.dir.join("device-plugins");
    std::fs::create_dir_all(&kubelet_dir)?;
    let kubeconfig = cluster.kubeconfig().display().to_string();
    let backend = |args: &mut Vec<String>| {
        args.extend([
            "--backend".into(),
            "simulated".into(),
            "--fleet".into(),
            files.fleet.display().to_string(),
            "--sim-state".into(),
            files.state.display().to_string(),
            "--node".into(),
            node.to_string(),
        ]);
    };
    let mut args: Vec<String> = vec![
        "--node-name".into(),
        node.into(),
        "--kubeconfig".into(),
        kubeconfig.clone(),
        "--ready-file".into(),
        files.dir.join("ready").display().to_string(),
        "--".into(),
        "gpu-device-plugin".into(),
        "--no-register".into(),
        "--kubelet-dir".into(),
        kubelet_dir.display().to_string(),
        "--mig-strategy".into(),
        "mixed".into(),
        "--rescan-interval-seconds".into(),
        "1".into(),
    ];
    backend(&mut args);
    args.extend([
        "--".into(),
        "gpu-feature-discovery".into(),
        "--publish".into(),
        "--kubeconfig".into(),
        kubeconfig.clone(),
        "--mig-strategy".into(),
        "mixed".into(),
        "--sleep-interval".into(),
        "1s".into(),
    ]);
    backend(&mut args);
    args.extend([
        "--".into(),
        "gpu-exporter".into(),
        "--listen".into(),
        format!("127.0.0.1:{port}"),
        "--no-pod-attribution".into(),
        "--collect-interval".into(),
        "1000".into(),
    ]);
    backend(&mut args);
    args.extend([
        "--".into(),
        "gpu-mig-manager".into(),
        "--node-name".into(),
        node.into(),
        "--config-file".into(),
        files.config.display().to_string(),
        "--signal-file".into(),
        files.signal.display().to_string(),
        "--kubeconfig".into(),
        kubeconfig,
        "--client-timeout-seconds".into(),
        "60".into(),
        "--poll-ms".into(),
        "200".into(),
    ]);
    backend(&mut args);
    AgentProcess::spawn("gpu-node-agent", &args, log)
}

async fn label_node(client: &Client, node: &str, key: &str, value: &str) -> Result<()> {
    let body = serde_json::json!({"metadata": {"labels": {key: value}}});
    Api::<Node>::all(client.clone())
        .patch(node, &PatchParams::default(), &Patch::Merge(&body))
        .await?;
    Ok(())
}

async fn node_labels(client: &Client, node: &str) -> Result<BTreeMap<String, String>, kube::Error> {
    let n = Api::<Node>::all(client.clone()).get(node).await?;
    Ok(n.metadata.labels.unwrap_or_default())
}

fn exporter_up(port: u16) -> bool {
    TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(200),
    )
    .is_ok()
}

async fn wait_true(what: &str, mut probe: impl FnMut() -> bool) -> Result<()> {
    wait_for(what, LONG, || {
        let ok = probe();
        async move { Ok(ok.then_some(())) }
    })
    .await?;
    Ok(())
}

/// Lines of the agent's log, without colour codes.
fn log_lines(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines().map(gpu_stack_e2e::strip_ansi).collect()
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// One kwok node of 2 simulated H100s (`node_extra`: more of its fleet
/// entry) with `labels`, and the agent of [`start_node_agent`] on it.
struct AgentRun {
    cluster: TestCluster,
    client: Client,
    names: Vec<String>,
    node: String,
    dir: std::path::PathBuf,
    files: MigFiles,
    port: u16,
    agent: AgentProcess,
}

impl AgentRun {
    async fn start(tag: &str, labels: &[&str], node_extra: &str) -> Result<Self> {
        let cluster = TestCluster::attach().await?;
        let client = cluster.client();
        let mut fleet = GpuFleet::new(format!("{tag}-{}", unique_suffix()), 1).with_gpus(2);
        for label in labels {
            fleet = fleet.with_label(*label, "true");
        }
        let names = cluster.create_gpu_nodes(&fleet).await?;
        let node = names[0].clone();
        let dir = std::env::temp_dir().join(format!("gpu-stack-node-agent-{}", unique_suffix()));
        let files = write_mig_files(&dir, &node, 2, node_extra)?;
        let port = free_port()?;
        let agent = start_node_agent(&cluster, &node, &files, port)?;
        Ok(Self {
            cluster,
            client,
            names,
            node,
            dir,
            files,
            port,
            agent,
        })
    }

    /// Stops the agent with SIGTERM (waiting at most `within`), removes the
    /// node, and returns `outcome`, or the agent's unclean exit.
    async fn finish(mut self, outcome: Result<()>, within: Duration) -> Result<()> {
        let stopped = self.agent.terminate_within(within);
        self.cluster.delete_nodes(&self.names).await?;
        if let Err(err) = outcome {
            return Err(err.context(format!("--- node agent log ---\n{}", self.agent.log_tail())));
        }
        ensure!(
            stopped?.success(),
            "the node agent did not exit cleanly on SIGTERM:\n{}",
            self.agent.log_tail()
        );
        let _ = std::fs::remove_dir_all(&self.dir);
        Ok(())
    }
}

#[tokio::test]
async fn node_agent_runs_each_component_while_its_deploy_label_is_true() -> Result<()> {
    let run = AgentRun::start(
        "agent",
        &[DEPLOY_DP, DEPLOY_GFD, DEPLOY_EXPORTER, DEPLOY_MIG],
        "",
    )
    .await?;
    let outcome = scenario(&run.client, &run.node, &run.files, run.port, &run.agent).await;
    run.finish(outcome, Duration::from_secs(10)).await
}

/// GPU 1 of the node hangs [`HANG_AFTER_MS`] after the simulation starts:
/// every call on it then takes an hour, as on a GPU whose driver stopped
/// answering.
const HANG_AFTER_MS: u64 = 4_000;

/// A hung GPU under the agent: the exporter keeps serving, GPU 1's series
/// go stale and are dropped while GPU 0's stay; components stuck in a call
/// on the hung GPU never hold up the supervisor: a label change for another
/// component is carried out while they are still stopping, each stuck one
/// is left behind after the stop deadline, and SIGTERM ends the process
/// within that deadline (30 s) and a margin.
#[tokio::test]
async fn a_hung_gpu_stalls_only_its_own_series_and_never_the_supervisor() -> Result<()> {
    let hang = format!(
        "    faults:\n      - gpu: 1\n        at-ms: {HANG_AFTER_MS}\n        \
         fault: {{type: slow-calls, calls: all, delay-ms: 3600000}}\n"
    );
    let run = AgentRun::start("hung", &[DEPLOY_DP, DEPLOY_GFD, DEPLOY_EXPORTER], &hang).await?;
    let outcome = hung_gpu_scenario(&run.client, &run.node, run.port, &run.agent).await;
    run.finish(outcome, Duration::from_secs(45)).await
}

/// Waits until the exporter's `/metrics` page satisfies `holds`.
async fn wait_page(port: u16, what: &str, holds: impl Fn(&str) -> bool) -> Result<()> {
    let addr = format!("127.0.0.1:{port}");
    wait_for(what, LONG, || async {
        Ok(holds(&http_get(&addr, "/metrics").await).then_some(()))
    })
    .await?;
    Ok(())
}

/// Whether the page holds a temperature series of GPU `gpu`.
fn has_gpu_series(page: &str, gpu: u32) -> bool {
    page.lines()
        .any(|l| l.starts_with("DCGM_FI_DEV_GPU_TEMP{") && l.contains(&format!("gpu=\"{gpu}\"")))
}

async fn hung_gpu_scenario(
    client: &Client,
    node: &str,
    port: u16,
    agent: &AgentProcess,
) -> Result<()> {
    wait_page(port, "both GPUs' series", |page| {
        has_gpu_series(page, 0) && has_gpu_series(page, 1)
    })
    .await?;
    // GPU 1 hangs: its series go stale and are dropped; GPU 0's stay.
    wait_page(port, "GPU 1's series dropped, GPU 0's served", |page| {
        has_gpu_series(page, 0) && !has_gpu_series(page, 1)
    })
    .await?;
    // GFD reads every GPU each pass, so it is stuck in a call on GPU 1 by
    // now. It is told to stop, and then the exporter: the exporter stops
    // while GFD is still stopping.
    label_node(client, node, DEPLOY_GFD, "false").await?;
    label_node(client, node, DEPLOY_EXPORTER, "false").await?;
    wait_true("the exporter's port to close", || !exporter_up(port)).await?;
    wait_true("GFD left behind", || {
        log_lines(agent.log_path())
            .iter()
            .any(|l| l.contains("left behind") && l.contains("\"gpu-feature-discovery\""))
    })
    .await?;
    let lines = log_lines(agent.log_path());
    let find = |component: &str, what: &str| {
        lines
            .iter()
            .position(|l| l.contains(what) && l.contains(&format!("\"{component}\"")))
    };
    let exporter_stopped = find("dcgm-exporter", "deploy label is not true: stopped")
        .context("the exporter's stop is not in the log")?;
    let gfd_left = find("gpu-feature-discovery", "left behind").context("no GFD line")?;
    ensure!(
        exporter_stopped < gfd_left,
        "the exporter was stopped only after GFD was given up: the supervisor waited on GFD"
    );
    // The supervisor still follows the labels: the exporter comes back
    // (serving GPU 0) though GFD's thread is still stuck.
    label_node(client, node, DEPLOY_EXPORTER, "true").await?;
    wait_page(port, "the exporter serving GPU 0 again", |page| {
        has_gpu_series(page, 0)
    })
    .await?;
    Ok(())
}

async fn scenario(
    client: &Client,
    node: &str,
    files: &MigFiles,
    port: u16,
    agent: &AgentProcess,
) -> Result<()> {
    let socket = files.dir.join("device-plugins").join(DP_SOCKET);
    // 1. Every label true: all four run.
    wait_true("the device plugin's socket", || socket.exists()).await?;
    wait_true("the exporter's port", || exporter_up(port)).await?;
    wait_for("GFD's labels", LONG, || async {
        Ok(node_labels(client, node)
            .await?
            .contains_key(GFD_PRODUCT)
            .then_some(()))
    })
    .await?;

    // 2. One label off: that component stops for real (its socket is
    // removed), the others keep running; back on, it starts again.
    label_node(client, node, DEPLOY_DP, "false").await?;
    wait_true("the device plugin's socket to go", || !socket.exists()).await?;
    ensure!(
        exporter_up(port),
        "the exporter stopped with the device plugin"
    );
    label_node(client, node, DEPLOY_EXPORTER, "paused-for-driver-upgrade").await?;
    wait_true("the exporter's port to close", || !exporter_up(port)).await?;
    label_node(client, node, DEPLOY_DP, "true").await?;
    label_node(client, node, DEPLOY_EXPORTER, "true").await?;
    wait_true("the device plugin's socket again", || socket.exists()).await?;
    wait_true("the exporter's port again", || exporter_up(port)).await?;

    // 3. A MIG change: the hosted MIG manager pauses the clients, waits for
    // their in-process stop, changes the GPUs and restores the labels.
    ensure!(
        !mig_assert(files, node, "all-1g.10gb")?,
        "GPUs start without MIG"
    );
    label_node(client, node, "nvidia.com/mig.config", "all-1g.10gb").await?;
    wait_for("mig.config.state=success", LONG, || async {
        let l = node_labels(client, node).await?;
        Ok(
            (l.get("nvidia.com/mig.config.state").map(String::as_str) == Some("success"))
                .then_some(l),
        )
    })
    .await?;
    ensure!(
        mig_assert(files, node, "all-1g.10gb")?,
        "the GPUs were not changed"
    );
    let l = node_labels(client, node).await?;
    for key in [DEPLOY_DP, DEPLOY_GFD, DEPLOY_EXPORTER] {
        ensure!(
            l.get(key).map(String::as_str) == Some("true"),
            "{key} not restored: {:?}",
            l.get(key)
        );
    }
    let mig_socket = files
        .dir
        .join("device-plugins")
        .join("nvidia-mig-1g.10gb.sock");
    wait_true("the device plugin serving MIG devices", || {
        mig_socket.exists()
    })
    .await?;
    wait_true("the exporter's port after the change", || exporter_up(port)).await?;

    // Each paused client was stopped after the pass began and before the
    // manager touched the GPUs.
    let lines = log_lines(agent.log_path());
    let find = |what: &str| lines.iter().position(|l| l.contains(what));
    let began = find("nvidia.com/mig.config changed").context("no MIG pass in the log")?;
    let applying = find("GPU clients gone; applying").context("no MIG apply in the log")?;
    for name in ["device-plugin", "gpu-feature-discovery", "dcgm-exporter"] {
        let stopped = lines
            .iter()
            .enumerate()
            .skip(began)
            .position(|(_, l)| {
                l.contains("deploy label is not true: stopped")
                    && l.contains(&format!("\"{name}\""))
            })
            .map(|i| i + began)
            .with_context(|| format!("{name} was not stopped for the MIG change"))?;
        ensure!(
            stopped < applying,
            "{name} stopped after the MIG manager began changing the GPUs"
        );
    }
    Ok(())
}

/// The agent hosting the device plugin, the exporter and the validator,
/// whose checks look for the toolkit at `toolkit` and write their status
/// files under `validations`.
fn start_validating_agent(
    cluster: &TestCluster,
    node: &str,
    files: &MigFiles,
    port: u16,
    toolkit: &Path,
    validations: &Path,
) -> Result<AgentProcess> {
    let log = files.dir.join("node-agent.log");
    let kubelet_dir = files.dir.join("device-plugins");
    std::fs::create_dir_all(&kubelet_dir)?;
    let kubeconfig = cluster.kubeconfig().display().to_string();
    let path = |p: &Path| p.display().to_string();
    let backend = [
        "--backend".to_string(),
        "simulated".into(),
        "--fleet".into(),
        path(&files.fleet),
        "--sim-state".into(),
        path(&files.state),
        "--node".into(),
        node.to_string(),
    ];
    let mut args: Vec<String> = vec![
        "--node-name".into(),
        node.into(),
        "--kubeconfig".into(),
        kubeconfig.clone(),
        "--ready-file".into(),
        path(&files.dir.join("ready")),
        "--".into(),
        "gpu-device-plugin".into(),
        "--no-register".into(),
        "--kubelet-dir".into(),
        path(&kubelet_dir),
    ];
    args.extend(backend.iter().cloned());
    args.extend([
        "--".into(),
        "gpu-exporter".into(),
        "--listen".into(),
        format!("127.0.0.1:{port}"),
        "--no-pod-attribution".into(),
    ]);
    args.extend(backend.iter().cloned());
    args.extend([
        "--".into(),
        "validator".into(),
        "--component".into(),
        "driver,toolkit,cuda,plugin".into(),
        "--wait".into(),
        "--timeout".into(),
        "never".into(),
        "--poll-interval-ms".into(),
        "200".into(),
        "--validations-dir".into(),
        path(validations),
        "--toolkit-evidence".into(),
        path(toolkit),
        "--kubeconfig".into(),
        kubeconfig,
    ]);
    args.extend(backend.iter().cloned());
    AgentProcess::spawn("gpu-node-agent", &args, log)
}

/// `gpu-node-agent --check-ready`, the readiness probe: whether it passes.
fn probe_ready(files: &MigFiles) -> Result<bool> {
    let status = Command::new(workspace_binary("gpu-node-agent")?)
        .args(["--check-ready", "--ready-file"])
        .arg(files.dir.join("ready"))
        .stderr(Stdio::null())
        .status()?;
    Ok(status.success())
}

fn status_files(dir: &Path) -> Vec<String> {
    STATUS_FILES
        .iter()
        .filter(|f| dir.join(f).exists())
        .map(|f| f.to_string())
        .collect()
}

#[tokio::test]
async fn the_hosted_validator_gates_the_components_and_the_agents_readiness() -> Result<()> {
    let cluster = TestCluster::attach().await?;
    let client = cluster.client();
    let fleet = GpuFleet::new(format!("agentv-{}", unique_suffix()), 1)
        .with_gpus(2)
        .with_label(DEPLOY_DP, "true")
        .with_label(DEPLOY_EXPORTER, "true")
        .with_label(DEPLOY_VALIDATOR, "true");
    let names = cluster.create_gpu_nodes(&fleet).await?;
    let node = names[0].clone();
    let dir = std::env::temp_dir().join(format!("gpu-stack-node-agentv-{}", unique_suffix()));
    let files = write_mig_files(&dir, &node, 2, "")?;
    let toolkit = dir.join("toolkit-installed");
    let validations = dir.join("validations");
    let port = free_port()?;
    let mut agent = start_validating_agent(&cluster, &node, &files, port, &toolkit, &validations)?;
    let outcome = validator_scenario(&client, &node, &files, port, &toolkit, &validations).await;
    let stopped = agent.terminate();
    cluster.delete_nodes(&names).await?;
    if let Err(err) = outcome {
        return Err(err.context(format!("--- node agent log ---\n{}", agent.log_tail())));
    }
    ensure!(
        stopped?.success(),
        "the node agent did not exit cleanly on SIGTERM:\n{}",
        agent.log_tail()
    );
    ensure!(
        !files.dir.join("ready").exists(),
        "the ready file outlived the agent"
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

async fn validator_scenario(
    client: &Client,
    node: &str,
    files: &MigFiles,
    port: u16,
    toolkit: &Path,
    validations: &Path,
) -> Result<()> {
    let socket = files.dir.join("device-plugins").join(DP_SOCKET);
    // 1. No toolkit yet: the driver check passes, the toolkit check keeps
    // failing, and what waits for toolkit-ready does not start.
    wait_true("driver-ready", || validations.join("driver-ready").exists()).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    ensure!(
        !validations.join("toolkit-ready").exists(),
        "toolkit-ready written with no toolkit"
    );
    ensure!(
        !socket.exists(),
        "the device plugin started before its gate"
    );
    ensure!(!exporter_up(port), "the exporter started before its gate");
    ensure!(!probe_ready(files)?, "ready before the validations passed");

    // 2. The toolkit appears: every check passes, the gated components
    // start, and the agent becomes ready.
    std::fs::write(toolkit, b"")?;
    wait_true("every status file", || {
        status_files(validations).len() == STATUS_FILES.len()
    })
    .await?;
    wait_true("the device plugin's socket", || socket.exists()).await?;
    wait_true("the exporter's port", || exporter_up(port)).await?;
    wait_true("the readiness probe to pass", || {
        probe_ready(files).unwrap_or(false)
    })
    .await?;

    // 3. The validator paused (as for a MIG change): it stops and removes
    // the status files, as its pod does; the others keep running and the
    // agent stays ready, as a paused component is not waited for.
    label_node(client, node, DEPLOY_VALIDATOR, "paused-for-mig-change").await?;
    wait_true("the status files to go", || {
        status_files(validations).is_empty()
    })
    .await?;
    ensure!(
        socket.exists(),
        "the device plugin stopped with the validator"
    );
    ensure!(exporter_up(port), "the exporter stopped with the validator");
    ensure!(
        probe_ready(files)?,
        "not ready while only the validator is paused"
    );

    // 4. The device plugin stops: the agent is still ready (its label says
    // it should not run). Back on with the validator, everything returns.
    label_node(client, node, DEPLOY_DP, "false").await?;
    wait_true("the device plugin's socket to go", || !socket.exists()).await?;
    ensure!(probe_ready(files)?, "not ready with nothing wanted missing");
    label_node(client, node, DEPLOY_VALIDATOR, "true").await?;
    label_node(client, node, DEPLOY_DP, "true").await?;
    wait_true("every status file again", || {
        status_files(validations).len() == STATUS_FILES.len()
    })
    .await?;
    wait_true("the device plugin's socket again", || socket.exists()).await?;
    wait_true("the readiness probe to pass again", || {
        probe_ready(files).unwrap_or(false)
    })
    .await?;
    Ok(())
}
