//! The `gpu-mig-manager` binary in the end-to-end tests: a node's files (a
//! fleet of simulated H100s, the mig-parted file, the simulated-GPU state),
//! the manager as a process, and `gpu-stack mig assert` on the same GPUs.
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, ensure};

use crate::TestCluster;
use crate::binaries::{AgentProcess, workspace_binary};

/// One node's files, under `dir`.
pub struct MigFiles {
    /// The directory (the manager's log goes here too).
    pub dir: PathBuf,
    /// The fleet file: the node and its GPUs.
    pub fleet: PathBuf,
    /// The mig-parted file the manager reads (`--config-file`).
    pub config: PathBuf,
    /// The simulated GPUs' state.
    pub state: PathBuf,
    /// The file the manager touches after a MIG change.
    pub signal: PathBuf,
}

/// Writes the files of `node` with `count` H100s under `dir` (`node_extra`
/// is more YAML under the node), the mig-parted file being NVIDIA's shipped
/// one.
pub fn write_mig_files(dir: &Path, node: &str, count: u32, node_extra: &str) -> Result<MigFiles> {
    std::fs::create_dir_all(dir)?;
    let fleet = dir.join("fleet.yaml");
    std::fs::write(
        &fleet,
        format!(
            "nodes:\n  - name: {node}\n{node_extra}    gpus:\n      - model: H100-SXM5-80GB\n        count: {count}\n"
        ),
    )?;
    let config = dir.join("config.yaml");
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../gpu-stack-core/data/mig-parted-config-default.yaml");
    std::fs::copy(&shipped, &config).with_context(|| format!("copying {}", shipped.display()))?;
    Ok(MigFiles {
        state: dir.join("gpus.json"),
        signal: dir.join("mig-changed"),
        dir: dir.to_path_buf(),
        fleet,
        config,
    })
}

/// Where the MIG manager runs: as its own binary, or hosted by
/// `gpu-node-agent` (`nodeAgent.enabled`), which starts it while the node's
/// `nvidia.com/gpu.deploy.mig-manager` label is `true`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ManagerHost {
    /// `gpu-mig-manager`.
    Own,
    /// `gpu-node-agent -- gpu-mig-manager ...`.
    NodeAgent,
}

impl ManagerHost {
    /// Both, for tests of the node contract in each mode.
    pub const BOTH: [ManagerHost; 2] = [ManagerHost::Own, ManagerHost::NodeAgent];
}

/// Starts `gpu-mig-manager` for `node` on its simulated GPUs, with `extra`
/// flags; its log goes to `manager.log` in the node's directory.
pub fn start_mig_manager(
    cluster: &TestCluster,
    node: &str,
    files: &MigFiles,
    extra: &[&str],
) -> Result<AgentProcess> {
    start_mig_manager_on(ManagerHost::Own, cluster, node, files, extra)
}

/// [`start_mig_manager`] on `host`: the same flags, given to the MIG manager
/// hosted by the node agent when `host` says so.
pub fn start_mig_manager_on(
    host: ManagerHost,
    cluster: &TestCluster,
    node: &str,
    files: &MigFiles,
    extra: &[&str],
) -> Result<AgentProcess> {
    let kubeconfig = cluster.kubeconfig().as_os_str().to_owned();
    let path = |p: &Path| p.as_os_str().to_owned();
    let mut args: Vec<OsString> = Vec::new();
    let binary = match host {
        ManagerHost::Own => "gpu-mig-manager",
        ManagerHost::NodeAgent => {
            args.extend(["--node-name".into(), node.into(), "--kubeconfig".into()]);
            args.push(kubeconfig.clone());
            args.push("--ready-file".into());
            args.push(path(&files.dir.join("ready")));
            args.extend(["--".into(), "gpu-mig-manager".into()]);
            "gpu-node-agent"
        }
    };
    args.extend(["--node-name".into(), node.into(), "--config-file".into()]);
    args.push(path(&files.config));
    args.extend(["--backend".into(), "simulated".into(), "--fleet".into()]);
    args.push(path(&files.fleet));
    args.push("--sim-state".into());
    args.push(path(&files.state));
    args.push("--signal-file".into());
    args.push(path(&files.signal));
    args.push("--kubeconfig".into());
    args.push(kubeconfig);
    args.extend(
        ["--client-timeout-seconds", "60", "--poll-ms", "200"]
            .iter()
            .map(OsString::from),
    );
    args.extend(extra.iter().map(OsString::from));
    AgentProcess::spawn(binary, &args, files.dir.join("manager.log"))
}

/// `gpu-stack mig assert` of `config` against the node's simulated GPUs:
/// true when they match.
pub fn mig_assert(files: &MigFiles, node: &str, config: &str) -> Result<bool> {
    let out = Command::new(workspace_binary("gpu-stack")?)
        .args(["mig", "assert", "-f"])
        .arg(&files.config)
        .args(["-c", config, "--backend", "simulated", "--fleet"])
        .arg(&files.fleet)
        .args(["--node", node, "--sim-state"])
        .arg(&files.state)
        .args(["-o", "json"])
        .output()
        .context("running gpu-stack mig assert")?;
    let code = out.status.code();
    ensure!(
        matches!(code, Some(0) | Some(1)),
        "gpu-stack mig assert failed ({:?}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let body: serde_json::Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("assert output {}", String::from_utf8_lossy(&out.stdout)))?;
    let matches = body["matches"].as_bool() == Some(true);
    ensure!(
        matches == (code == Some(0)),
        "exit code {code:?} disagrees with {body}"
    );
    Ok(matches)
}
