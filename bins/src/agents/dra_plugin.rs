//! `gpu-dra-plugin`: the DRA kubelet plugin with dynamic MIG. Publishes the
//! node's GPUs and every MIG placement in ResourceSlices (KEP-4815 shared
//! counters, so the scheduler only allocates valid layouts), creates the MIG
//! instance at the allocated placement when the kubelet prepares a claim,
//! and destroys it on unprepare.
//!
//! Flags and logging; the process is `gpu_stack_k8s::dra::run::run`.
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use gpu_stack_core::dra::devices::DEFAULT_DRIVER_NAME;
use gpu_stack_k8s::deviceplugin::cdi::{DEFAULT_CDI_DIR, discover_host_files};
use gpu_stack_k8s::deviceplugin::node::MIG_MINORS_PATH;
use gpu_stack_k8s::dra::run::{RunError, RunOptions, run};

use crate::agent::{Failure, LogFormat, init_logging, kube_client, run_main, shutdown_signal};
use crate::backend_flags::BackendArgs;

#[derive(Parser, Debug)]
#[command(
    name = "gpu-dra-plugin",
    version,
    about = "DRA kubelet plugin for NVIDIA GPUs with MIG instances created on demand"
)]
pub struct Args {
    #[command(flatten)]
    backend: BackendArgs,
    /// Node this plugin runs on (the ResourceSlice pool name).
    #[arg(long = "node-name", env = "NODE_NAME")]
    node_name: String,
    /// DRA driver name; NVIDIA's DeviceClasses select `gpu.nvidia.com`.
    #[arg(long, env = "DRA_DRIVER_NAME", default_value = DEFAULT_DRIVER_NAME)]
    driver_name: String,
    /// The kubelet's plugins directory (the DRA socket goes in `<dir>/<driver>`).
    #[arg(
        long,
        env = "KUBELET_PLUGINS_DIR",
        default_value = "/var/lib/kubelet/plugins"
    )]
    kubelet_plugins_dir: PathBuf,
    /// The kubelet's plugin registration directory.
    #[arg(
        long,
        env = "KUBELET_REGISTRY_DIR",
        default_value = "/var/lib/kubelet/plugins_registry"
    )]
    kubelet_registry_dir: PathBuf,
    /// Checkpoint of prepared claims (default `<plugins dir>/<driver>/checkpoint.json`).
    #[arg(long, env = "CHECKPOINT_FILE")]
    checkpoint: Option<PathBuf>,
    /// Where claim CDI specs are written.
    #[arg(long, env = "CDI_SPEC_DIR", default_value = DEFAULT_CDI_DIR)]
    cdi_spec_dir: PathBuf,
    /// Root of the driver installation on the host.
    #[arg(long, env = "NVIDIA_DRIVER_ROOT", default_value = "/")]
    nvidia_driver_root: String,
    /// Root of the host's /dev tree (defaults to the driver root).
    #[arg(long, env = "NVIDIA_DEV_ROOT")]
    dev_root: Option<String>,
    /// Where the driver root is mounted in this container (default: the driver root).
    #[arg(long, env = "CONTAINER_DRIVER_ROOT")]
    container_driver_root: Option<String>,
    /// Path of nvidia-cdi-hook on the host (used in the CDI specs).
    #[arg(
        long,
        env = "NVIDIA_CDI_HOOK_PATH",
        default_value = "/usr/bin/nvidia-cdi-hook"
    )]
    nvidia_cdi_hook_path: String,
    /// The driver's MIG capability minors file.
    #[arg(long, env = "MIG_MINORS_FILE", default_value = MIG_MINORS_PATH)]
    mig_minors: PathBuf,
    /// Never reset a GPU for a MIG mode change (the node is then rebooted by hand).
    #[arg(long, env = "NO_GPU_RESET")]
    no_gpu_reset: bool,
    /// Seconds between reads of the GPUs for the ResourceSlices.
    #[arg(long, env = "RESCAN_INTERVAL_SECONDS", default_value_t = 30)]
    rescan_interval_seconds: u64,
    /// Kubeconfig file (default: in-cluster, then $KUBECONFIG).
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
}

/// The process: logging, then [`serve`] on the agents' runtime.
pub fn main(args: Args) -> ExitCode {
    init_logging(LogFormat::Text);
    run_main(serve(args))
}

/// Serves claims until SIGTERM. A node the MIG manager owns exits with 2.
pub async fn serve(args: Args) -> Result<(), Failure> {
    let setup = async {
        let backend = args.backend.build()?;
        let system = backend
            .system_info()
            .context("reading the driver version")?;
        let dev_root = args
            .dev_root
            .clone()
            .unwrap_or_else(|| args.nvidia_driver_root.clone());
        let host = discover_host_files(
            &args.nvidia_driver_root,
            &dev_root,
            args.container_driver_root
                .as_deref()
                .unwrap_or(&args.nvidia_driver_root),
            &args.nvidia_cdi_hook_path,
            &system.driver_version,
        );
        let plugin_dir = args.kubelet_plugins_dir.join(&args.driver_name);
        let options = RunOptions {
            driver: args.driver_name.clone(),
            node: args.node_name.clone(),
            checkpoint: args
                .checkpoint
                .clone()
                .unwrap_or_else(|| plugin_dir.join("checkpoint.json")),
            plugin_dir,
            registry_dir: args.kubelet_registry_dir.clone(),
            cdi_dir: args.cdi_spec_dir.clone(),
            host,
            mig_minors: Some(args.mig_minors.clone()),
            reset_gpus: !args.no_gpu_reset,
            rescan: Duration::from_secs(args.rescan_interval_seconds.max(1)),
        };
        let client = kube_client(args.kubeconfig.as_deref()).await?;
        anyhow::Ok((options, client, backend))
    };
    let (options, client, backend) = setup.await.map_err(|e| Failure::new(1, e))?;
    match run(options, client, backend, shutdown_signal()).await {
        Ok(()) => Ok(()),
        Err(e @ RunError::Refused(_)) => Err(Failure::new(2, e)),
        Err(e) => Err(Failure::new(1, e)),
    }
}
