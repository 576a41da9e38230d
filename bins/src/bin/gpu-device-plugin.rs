//! `gpu-device-plugin`: advertises `nvidia.com/gpu` and `nvidia.com/mig-*` to
//! the kubelet (device plugin API v1beta1), keeps device health current, and
//! writes the node's CDI spec. Flags, environment and config file follow
//! NVIDIA's k8s-device-plugin (flag > env > file).
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use gpu_stack_bins::backend_flags::BackendArgs;
use gpu_stack_core::backend::GpuBackend;
use gpu_stack_core::cdi::node_spec;
use gpu_stack_core::deviceplugin::{
    ConfigFile, HealthPolicy, NodeGpus, Overrides, Settings, node_resources,
};
use gpu_stack_k8s::deviceplugin::cdi::{DEFAULT_CDI_DIR, discover_host_files, write_spec};
use gpu_stack_k8s::deviceplugin::health::{BackendProbe, spawn_backend_health};
use gpu_stack_k8s::deviceplugin::node::{MIG_MINORS_PATH, read_node_gpus};
use gpu_stack_k8s::deviceplugin::plugin::DEFAULT_KUBELET_DIR;
use gpu_stack_k8s::deviceplugin::{DevicePlugins, PluginOptions};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

#[derive(Parser, Debug)]
#[command(
    name = "gpu-device-plugin",
    version,
    about = "Kubernetes device plugin for NVIDIA GPUs and MIG devices"
)]
struct Cli {
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Exit,
    Reload,
}

fn settings(cli: &Cli) -> Result<Settings> {
    let file = match &cli.config_file {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read config file {}", p.display()))?;
            Some(ConfigFile::parse(&p.display().to_string(), &text)?)
        }
        None => None,
    };
    let ov = Overrides {
        mig_strategy: cli.mig_strategy.clone(),
        fail_on_init_error: cli.fail_on_init_error,
        nvidia_driver_root: cli.nvidia_driver_root.clone(),
        nvidia_dev_root: cli.dev_root.clone(),
        mps_root: cli.mps_root.clone(),
        pass_device_specs: cli.pass_device_specs,
        device_list_strategy: cli.device_list_strategy.clone(),
        device_id_strategy: cli.device_id_strategy.clone(),
        cdi_annotation_prefix: cli.cdi_annotation_prefix.clone(),
        gdrcopy_enabled: cli.gdrcopy_enabled,
        gds_enabled: cli.gds_enabled,
        mofed_enabled: cli.mofed_enabled,
        ..Overrides::default()
    };
    let s = Settings::resolve(file.as_ref(), &ov)?;
    for n in &s.notices {
        tracing::warn!("{n}");
    }
    Ok(s)
}

async fn read_node(backend: &Arc<dyn GpuBackend>) -> Result<NodeGpus> {
    let b = backend.clone();
    let node = tokio::task::spawn_blocking(move || {
        read_node_gpus(b.as_ref(), Some(MIG_MINORS_PATH.as_ref()))
    })
    .await??;
    Ok(node)
}

/// Watches SIGTERM/SIGINT (exit), SIGHUP (reload) and, when given, the GPU
/// layout (a change reloads).
fn watch_stop(
    rescan: Option<(NodeGpus, Arc<dyn GpuBackend>, Duration)>,
) -> Result<watch::Receiver<Option<Stop>>> {
    let (tx, rx) = watch::channel(None);
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    tokio::spawn(async move {
        let period = rescan.as_ref().map_or(Duration::from_secs(3600), |r| r.2);
        let mut tick = tokio::time::interval(period);
        tick.tick().await;
        let stop = loop {
            tokio::select! {
                _ = term.recv() => break Stop::Exit,
                _ = int.recv() => break Stop::Exit,
                _ = hup.recv() => { tracing::info!("SIGHUP: reloading"); break Stop::Reload }
                _ = tick.tick() => {
                    let Some((node, backend, _)) = &rescan else { continue };
                    match read_node(backend).await {
                        Ok(now) if now != *node => { tracing::info!("GPU layout changed: reloading"); break Stop::Reload }
                        Ok(_) => {}
                        Err(e) => tracing::warn!(error = %e, "rescan failed"),
                    }
                }
            }
        };
        let _ = tx.send(Some(stop));
    });
    Ok(rx)
}

async fn wait_stop(mut rx: watch::Receiver<Option<Stop>>) -> Stop {
    match rx.wait_for(Option::is_some).await {
        Ok(v) => v.unwrap_or(Stop::Exit),
        Err(_) => Stop::Exit,
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let cli = Cli::parse();
    loop {
        let settings = settings(&cli)?;
        let health = HealthPolicy {
            recovery_quiet_ms: cli.health_recovery_seconds.saturating_mul(1000),
            ..HealthPolicy::from_env(
                cli.disable_healthchecks.as_deref(),
                cli.enable_healthchecks.as_deref(),
            )?
        };
        let backend = match cli.backend.build() {
            Ok(b) => b,
            Err(e) if !settings.fail_on_init_error => {
                tracing::error!(error = %e, "GPU backend unavailable; failOnInitError=false, so waiting for a signal");
                let rx = watch_stop(None)?;
                if wait_stop(rx).await == Stop::Exit {
                    return Ok(());
                }
                continue;
            }
            Err(e) => return Err(e),
        };
        let node = read_node(&backend).await?;
        let resources = node_resources(&node, &settings)?;
        let cdi_dir = cli.cdi_spec_dir.clone().or_else(|| {
            settings
                .device_list_strategies
                .iter()
                .any(|s| s.is_cdi())
                .then(|| PathBuf::from(DEFAULT_CDI_DIR))
        });
        if let Some(dir) = &cdi_dir {
            let host = discover_host_files(
                &settings.driver_root,
                &settings.dev_root,
                cli.container_driver_root
                    .as_deref()
                    .unwrap_or(&settings.driver_root),
                &cli.nvidia_cdi_hook_path,
                &node.driver_version,
            );
            let path = write_spec(dir, &node_spec(&node, &host))?;
            tracing::info!(path = %path.display(), "CDI spec written");
        }
        let rescan = Duration::from_secs(cli.rescan_interval_seconds.max(1));
        let stop_rx = watch_stop(Some((node.clone(), backend.clone(), rescan)))?;
        if resources.is_empty() {
            tracing::warn!("no devices found; waiting for a signal or a GPU layout change");
            if wait_stop(stop_rx).await == Stop::Exit {
                return Ok(());
            }
            continue;
        }
        for r in &resources {
            tracing::info!(resource = %r.name, devices = r.devices.len(), "advertising");
        }
        let options = PluginOptions {
            kubelet_dir: cli.kubelet_dir.clone(),
            register: !cli.no_register,
            health,
            probe_interval: Duration::from_secs(5),
        };
        let plugins = DevicePlugins::new(resources.clone(), settings, Default::default(), options)
            .with_probe(Arc::new(BackendProbe::new(backend.clone(), &resources)));
        let pump = spawn_backend_health(backend.clone(), &resources, plugins.health_sender());
        let rx = stop_rx.clone();
        plugins
            .run(async move {
                wait_stop(rx).await;
            })
            .await?;
        pump.stop();
        let stop = stop_rx.borrow().unwrap_or(Stop::Exit);
        if stop == Stop::Exit {
            tracing::info!("stopped");
            return Ok(());
        }
    }
}
