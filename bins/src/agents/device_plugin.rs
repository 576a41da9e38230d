//! `gpu-device-plugin`: advertises `nvidia.com/gpu` and `nvidia.com/mig-*` to
//! the kubelet (device plugin API v1beta1), keeps device health current, and
//! writes the node's CDI spec. Flags, environment and config file follow
//! NVIDIA's k8s-device-plugin (flag > env > file).
//!
//! Flags and logging; the process is `gpu_stack_k8s::deviceplugin::run::run`.
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::Parser;
use gpu_stack_core::deviceplugin::Overrides;
use gpu_stack_k8s::deviceplugin::run::{RunOptions, SignalSource, UnixSignals, run};
use gpu_stack_k8s::kubelet::deviceplugin::DEFAULT_KUBELET_DIR;

use crate::agent::{LogFormat, init_logging, run_main};
use crate::backend_flags::BackendArgs;

#[derive(Parser, Debug)]
#[command(
    name = "gpu-device-plugin",
    version,
    about = "Kubernetes device plugin for NVIDIA GPUs and MIG devices"
)]
pub struct Args {
    #[command(flatten)]
    backend: BackendArgs,
    /// Kubelet device-plugins directory (holds kubelet.sock and our sockets).
    #[arg(long, env = "KUBELET_DIR", default_value = DEFAULT_KUBELET_DIR)]
    kubelet_dir: PathBuf,
    /// Serve the plugin sockets without registering with the kubelet.
    #[arg(long)]
    no_register: bool,
    /// NVIDIA device-plugin config file (version: v1, YAML or JSON).
    #[arg(long, env = "CONFIG_FILE")]
    config_file: Option<PathBuf>,
    /// MIG strategy: none, single or mixed.
    #[arg(long, env = "MIG_STRATEGY")]
    mig_strategy: Option<String>,
    /// Exit when the GPU backend cannot be initialised.
    #[arg(long, env = "FAIL_ON_INIT_ERROR", num_args = 0..=1, default_missing_value = "true")]
    fail_on_init_error: Option<bool>,
    /// Root of the driver installation on the host.
    #[arg(long, env = "NVIDIA_DRIVER_ROOT")]
    nvidia_driver_root: Option<String>,
    /// Root of the host's /dev tree (defaults to the driver root).
    #[arg(long, env = "NVIDIA_DEV_ROOT")]
    dev_root: Option<String>,
    /// Where the driver root is mounted in this container (default: the
    /// driver root itself, i.e. running on the host).
    #[arg(long, env = "CONTAINER_DRIVER_ROOT")]
    container_driver_root: Option<String>,
    /// Root of the MPS pipe directories.
    #[arg(long, env = "MPS_ROOT")]
    mps_root: Option<String>,
    /// Add device nodes (DeviceSpecs) to Allocate responses.
    #[arg(long, env = "PASS_DEVICE_SPECS", num_args = 0..=1, default_missing_value = "true")]
    pass_device_specs: Option<bool>,
    /// Device list strategies, comma-separated: envvar, volume-mounts, cdi-annotations, cdi-cri.
    #[arg(long, env = "DEVICE_LIST_STRATEGY")]
    device_list_strategy: Option<String>,
    /// Device id strategy: uuid or index.
    #[arg(long, env = "DEVICE_ID_STRATEGY")]
    device_id_strategy: Option<String>,
    /// Prefix of CDI annotation keys.
    #[arg(long, env = "CDI_ANNOTATION_PREFIX")]
    cdi_annotation_prefix: Option<String>,
    /// Add NVIDIA_GDRCOPY=enabled.
    #[arg(long, env = "GDRCOPY_ENABLED", num_args = 0..=1, default_missing_value = "true")]
    gdrcopy_enabled: Option<bool>,
    /// Add NVIDIA_GDS=enabled.
    #[arg(long, env = "GDS_ENABLED", num_args = 0..=1, default_missing_value = "true")]
    gds_enabled: Option<bool>,
    /// Add NVIDIA_MOFED=enabled.
    #[arg(long, env = "MOFED_ENABLED", num_args = 0..=1, default_missing_value = "true")]
    mofed_enabled: Option<bool>,
    /// Where to write the CDI spec; default /var/run/cdi when a CDI strategy is used.
    #[arg(long, env = "CDI_SPEC_DIR")]
    cdi_spec_dir: Option<PathBuf>,
    /// Path of nvidia-cdi-hook on the host (used in the CDI spec).
    #[arg(
        long,
        env = "NVIDIA_CDI_HOOK_PATH",
        default_value = "/usr/bin/nvidia-cdi-hook"
    )]
    nvidia_cdi_hook_path: String,
    /// Health checks to disable: all, xids, or extra Xids to ignore (comma-separated).
    #[arg(long, env = "DP_DISABLE_HEALTHCHECKS")]
    disable_healthchecks: Option<String>,
    /// Xids that always mark a device Unhealthy (comma-separated), or all.
    #[arg(long, env = "DP_ENABLE_HEALTHCHECKS")]
    enable_healthchecks: Option<String>,
    /// Seconds without a critical Xid, after the fault cleared, before a device is Healthy again.
    #[arg(long, env = "HEALTH_RECOVERY_SECONDS", default_value_t = 60)]
    health_recovery_seconds: u64,
    /// Seconds between checks of the GPU layout (a MIG change restarts the plugins and rewrites the CDI spec).
    #[arg(long, default_value_t = 30)]
    rescan_interval_seconds: u64,
}

impl Args {
    /// What [`run`] is to do.
    pub fn options(&self) -> RunOptions {
        RunOptions {
            kubelet_dir: self.kubelet_dir.clone(),
            register: !self.no_register,
            config_file: self.config_file.clone(),
            overrides: Overrides {
                mig_strategy: self.mig_strategy.clone(),
                fail_on_init_error: self.fail_on_init_error,
                nvidia_driver_root: self.nvidia_driver_root.clone(),
                nvidia_dev_root: self.dev_root.clone(),
                mps_root: self.mps_root.clone(),
                pass_device_specs: self.pass_device_specs,
                device_list_strategy: self.device_list_strategy.clone(),
                device_id_strategy: self.device_id_strategy.clone(),
                cdi_annotation_prefix: self.cdi_annotation_prefix.clone(),
                gdrcopy_enabled: self.gdrcopy_enabled,
                gds_enabled: self.gds_enabled,
                mofed_enabled: self.mofed_enabled,
                ..Overrides::default()
            },
            container_driver_root: self.container_driver_root.clone(),
            cdi_spec_dir: self.cdi_spec_dir.clone(),
            nvidia_cdi_hook_path: self.nvidia_cdi_hook_path.clone(),
            disable_healthchecks: self.disable_healthchecks.clone(),
            enable_healthchecks: self.enable_healthchecks.clone(),
            health_recovery_seconds: self.health_recovery_seconds,
            rescan_interval_seconds: self.rescan_interval_seconds,
        }
    }
}

/// The process: logging, then [`serve`] on the agents' runtime.
pub fn main(args: Args) -> ExitCode {
    init_logging(LogFormat::Text);
    run_main(serve(args))
}

/// Serves the node's devices to the kubelet until SIGTERM.
pub async fn serve(args: Args) -> Result<()> {
    serve_until(args, UnixSignals::new()?).await
}

/// Serves the node's devices to the kubelet until `signals` says to stop.
pub async fn serve_until(args: Args, signals: impl SignalSource) -> Result<()> {
    run(&args.options(), || args.backend.build(), signals).await?;
    Ok(())
}
