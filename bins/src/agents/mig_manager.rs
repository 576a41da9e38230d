//! `gpu-mig-manager`: applies the mig-parted config named by its node's
//! `nvidia.com/mig.config` label and reports `nvidia.com/mig.config.state`.
//!
//! Flags, logging, signals; the process loop is
//! `gpu_stack_k8s::migmanager::agent::run`.
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use gpu_stack_k8s::migmanager::ManagerOptions;
use gpu_stack_k8s::migmanager::agent::{
    AgentOptions, DEFAULT_REBOOT_HOOK_TIMEOUT, load_config, run,
};
use gpu_stack_k8s::migmanager::kube_node::LocalClients;

use crate::agent::{LogFormat, init_logging, kube_client, run_main, shutdown_signal};
use crate::backend_flags::BackendArgs;

/// gpu-mig-manager: applies mig-parted configs selected by node label.
#[derive(Parser, Debug)]
#[command(name = "gpu-mig-manager", version, about)]
pub struct Args {
    /// This node's name (the Node object to watch and label).
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// mig-parted config file (a mounted ConfigMap; re-read on change), or
    /// `default` for NVIDIA's shipped configs.
    #[arg(long, short = 'f', env = "CONFIG_FILE")]
    config_file: PathBuf,
    /// GPU backend.
    #[command(flatten)]
    backend: BackendArgs,
    /// Kubeconfig to use; without it, in-cluster config or $KUBECONFIG.
    #[arg(long, env = "GPU_MIG_MANAGER_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Longest wait for GPU client pods to leave the node before `failed`.
    #[arg(long, default_value_t = 300)]
    client_timeout_seconds: u64,
    /// Poll interval while waiting for GPU client pods, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    poll_ms: u64,
    /// How often the config file is checked for changes, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    config_poll_ms: u64,
    /// Pause before retrying a pass that failed talking to the API server, in seconds.
    #[arg(long, default_value_t = 10)]
    retry_seconds: u64,
    /// Never reset GPUs for MIG mode changes: report `rebooting` instead.
    #[arg(long)]
    no_gpu_reset: bool,
    /// Command run with `sh -c` when a MIG mode change needs a reboot
    /// (NODE_NAME and MIG_CONFIG are set).
    #[arg(long, value_name = "CMD", env = "REBOOT_HOOK")]
    reboot_hook: Option<String>,
    /// Longest the reboot hook may run before it is killed and reported, in seconds.
    #[arg(long, default_value_t = DEFAULT_REBOOT_HOOK_TIMEOUT.as_secs())]
    reboot_hook_timeout_seconds: u64,
    /// Destroy MIG instances even when processes run on them.
    #[arg(long)]
    force: bool,
    /// File rewritten after every MIG change, for the device plugin and CDI
    /// spec generator to re-read the MIG devices.
    #[arg(long, value_name = "PATH", env = "MIG_SIGNAL_FILE")]
    signal_file: Option<PathBuf>,
    /// Do not publish the GPUs' layouts and in-use instances in the node's
    /// `gpustack.io/mig-usage` annotation (demand-driven MIG reads it).
    #[arg(long)]
    no_publish_usage: bool,
    /// This replica's name in Events.
    #[arg(long, env = "POD_NAME")]
    pod_name: Option<String>,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

/// The process: logging, then [`manage`] on the agents' runtime.
pub fn main(args: Args) -> ExitCode {
    init_logging(args.log_format);
    run_main(manage(args))
}

/// Applies MIG configs as the node's label asks until SIGTERM.
pub async fn manage(args: Args) -> Result<()> {
    manage_until(args, shutdown_signal(), None).await
}

/// [`manage`] until `stop` resolves; with `local_clients`, the GPU clients
/// of this process are waited for as client pods are.
pub async fn manage_until(
    args: Args,
    stop: impl Future<Output = ()>,
    local_clients: Option<LocalClients>,
) -> Result<()> {
    // Fail early, before touching the cluster, on a bad file.
    load_config(&args.config_file)?;
    let mut backend_args = args.backend.clone();
    if backend_args.node.is_none() {
        backend_args.node = Some(args.node_name.clone());
    }
    let backend = backend_args.build()?;
    let client = kube_client(args.kubeconfig.as_deref()).await?;
    let options = AgentOptions {
        manager: ManagerOptions {
            node: args.node_name,
            force: args.force,
            client_timeout: Duration::from_secs(args.client_timeout_seconds),
            poll: Duration::from_millis(args.poll_ms.max(1)),
            reset_gpus: !args.no_gpu_reset,
            signal_file: args.signal_file,
        },
        config_file: args.config_file,
        config_poll: Duration::from_millis(args.config_poll_ms.max(10)),
        retry: Duration::from_secs(args.retry_seconds.max(1)),
        reboot_hook: args.reboot_hook,
        reboot_hook_timeout: Duration::from_secs(args.reboot_hook_timeout_seconds.max(1)),
        instance: args.pod_name,
        publish_usage: !args.no_publish_usage,
        local_clients,
    };
    run(client, backend, options, stop)
        .await
        .context("gpu-mig-manager stopped")?;
    tracing::info!("shut down cleanly");
    Ok(())
}
