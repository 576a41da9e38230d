//! The device plugin's main loop: resolve the settings, build the GPU backend,
//! write the CDI spec, serve the plugins, and start over on SIGHUP or when the
//! GPU layout changes (a MIG reconfiguration); SIGTERM or SIGINT end it.
//!
//! ```ignore
//! let signals = UnixSignals::new()?;
//! run(&options, || backend_args.build(), signals).await?;
//! ```

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpu_stack_core::backend::{BackendError, GpuBackend};
use gpu_stack_core::cdi::node_spec;
use gpu_stack_core::deviceplugin::health::HealthError;
use gpu_stack_core::deviceplugin::{
    ConfigError, ConfigFile, HealthPolicy, NodeGpus, Overrides, ResourceError, Settings,
    node_resources,
};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tracing::instrument;

use super::cdi::{CdiError, DEFAULT_CDI_DIR, discover_host_files, write_spec};
use super::health::{BackendProbe, spawn_backend_health};
use super::node::{MIG_MINORS_PATH, read_node_gpus};
use super::{DevicePlugins, PluginError, PluginOptions};

/// Log target of the loop's own lines (the binary's name, as before the loop
/// moved into this crate, so `RUST_LOG` filters keep working).
const TARGET: &str = "gpu_device_plugin";

/// How often the plugins probe device health.
const PROBE_INTERVAL: Duration = Duration::from_secs(5);

/// Errors resolving the settings from the config file and flags.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// The config file could not be read.
    #[error("cannot read config file {}", path.display())]
    Read {
        /// The config file.
        path: PathBuf,
        /// Why it could not be read.
        #[source]
        source: std::io::Error,
    },
    /// The config file or a flag is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

/// Resolves the settings (flag > env > file, NVIDIA's precedence); the
/// caller logs `notices`.
pub fn resolve_settings(
    config_file: Option<&Path>,
    overrides: &Overrides,
) -> Result<Settings, SettingsError> {
    let file = match config_file {
        Some(p) => {
            let text = std::fs::read_to_string(p).map_err(|source| SettingsError::Read {
                path: p.to_path_buf(),
                source,
            })?;
            Some(ConfigFile::parse(&p.display().to_string(), &text)?)
        }
        None => None,
    };
    Ok(Settings::resolve(file.as_ref(), overrides)?)
}

/// Errors that end [`run`]. Each shows its cause's own message.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Settings could not be resolved.
    #[error(transparent)]
    Settings(#[from] SettingsError),
    /// The health-check flags are invalid.
    #[error(transparent)]
    Health(#[from] HealthError),
    /// The GPU backend could not be built (and `failOnInitError` is set).
    #[error(transparent)]
    Backend(Box<dyn std::error::Error + Send + Sync + 'static>),
    /// The node's GPUs could not be read.
    #[error(transparent)]
    ReadNode(#[from] BackendError),
    /// The task reading the node's GPUs failed.
    #[error(transparent)]
    Join(#[from] tokio::task::JoinError),
    /// The node's resources could not be computed.
    #[error(transparent)]
    Resources(#[from] ResourceError),
    /// The CDI spec could not be written.
    #[error(transparent)]
    Cdi(#[from] CdiError),
    /// Serving or registering the plugins failed.
    #[error(transparent)]
    Plugin(#[from] PluginError),
}

/// What the device plugin was started with (its flags, after clap).
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Kubelet device-plugins directory (holds kubelet.sock and our sockets).
    pub kubelet_dir: PathBuf,
    /// Register with the kubelet (false: only serve the sockets).
    pub register: bool,
    /// NVIDIA device-plugin config file (version: v1, YAML or JSON).
    pub config_file: Option<PathBuf>,
    /// Flag and environment values, which win over the config file.
    pub overrides: Overrides,
    /// Where the driver root is mounted in this container (default: the
    /// driver root itself).
    pub container_driver_root: Option<String>,
    /// Where to write the CDI spec; default [`DEFAULT_CDI_DIR`] when a CDI
    /// device-list strategy is used, none otherwise.
    pub cdi_spec_dir: Option<PathBuf>,
    /// Path of nvidia-cdi-hook on the host (used in the CDI spec).
    pub nvidia_cdi_hook_path: String,
    /// Health checks to disable (`DP_DISABLE_HEALTHCHECKS`).
    pub disable_healthchecks: Option<String>,
    /// Xids that always mark a device Unhealthy (`DP_ENABLE_HEALTHCHECKS`).
    pub enable_healthchecks: Option<String>,
    /// Seconds without a critical Xid, after the fault cleared, before a
    /// device is Healthy again.
    pub health_recovery_seconds: u64,
    /// Seconds between checks of the GPU layout (at least 1 is used).
    pub rescan_interval_seconds: u64,
}

/// A process signal the loop reacts to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// SIGTERM (what the kubelet sends).
    Terminate,
    /// SIGINT.
    Interrupt,
    /// SIGHUP: reload the configuration and the GPU layout.
    Hangup,
}

/// Where the loop's signals come from: [`UnixSignals`] in the binary, a
/// channel in tests.
pub trait SignalSource {
    /// The next signal.
    fn recv(&mut self) -> impl Future<Output = Signal> + Send;
}

/// SIGTERM, SIGINT and SIGHUP of this process.
#[derive(Debug)]
pub struct UnixSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl UnixSignals {
    /// Installs the handlers (needs a Tokio runtime).
    pub fn new() -> std::io::Result<UnixSignals> {
        Ok(UnixSignals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            hup: signal(SignalKind::hangup())?,
        })
    }
}

impl SignalSource for UnixSignals {
    async fn recv(&mut self) -> Signal {
        tokio::select! {
            _ = self.term.recv() => Signal::Terminate,
            _ = self.int.recv() => Signal::Interrupt,
            _ = self.hup.recv() => Signal::Hangup,
        }
    }
}

/// Signals sent on a (bounded) channel; once every sender is gone, no more
/// come. A full channel makes its sender wait: signals are few, and each
/// one counts.
impl SignalSource for mpsc::Receiver<Signal> {
    async fn recv(&mut self) -> Signal {
        match mpsc::Receiver::recv(self).await {
            Some(s) => s,
            None => std::future::pending().await,
        }
    }
}

/// How a serving pass ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Stop the process.
    Exit,
    /// Start a new pass: settings, backend, CDI spec and plugins again.
    Reload,
}

/// What the watcher saw while a pass was serving.
#[derive(Debug, Clone, PartialEq)]
pub enum Watched {
    /// A process signal arrived.
    Signal(Signal),
    /// The GPU layout was read again.
    Layout(NodeGpus),
}

/// What a signal does: SIGTERM and SIGINT exit, SIGHUP reloads.
pub fn on_signal(signal: Signal) -> Stop {
    match signal {
        Signal::Terminate | Signal::Interrupt => Stop::Exit,
        Signal::Hangup => Stop::Reload,
    }
}

/// The reload decision while `serving` a layout: a signal as [`on_signal`]
/// says, and a GPU layout different from `serving` reloads; the same layout
/// keeps the pass going (`None`).
pub fn decide(serving: &NodeGpus, watched: &Watched) -> Option<Stop> {
    match watched {
        Watched::Signal(s) => Some(on_signal(*s)),
        Watched::Layout(now) => (now != serving).then_some(Stop::Reload),
    }
}

/// Reads the node's GPUs off the async threads.
async fn read_node(backend: &Arc<dyn GpuBackend>) -> Result<NodeGpus, RunError> {
    let b = backend.clone();
    let node = tokio::task::spawn_blocking(move || {
        read_node_gpus(b.as_ref(), Some(MIG_MINORS_PATH.as_ref()))
    })
    .await??;
    Ok(node)
}

/// The layout a pass serves and how to re-read it.
struct Rescan<'a> {
    node: &'a NodeGpus,
    backend: &'a Arc<dyn GpuBackend>,
    period: Duration,
}

/// Waits for a reason to end the pass: a signal or, with `rescan`, a change
/// of the GPU layout (checked every `rescan.period`).
async fn wait_stop<S: SignalSource>(signals: &mut S, rescan: Option<Rescan<'_>>) -> Stop {
    let period = rescan
        .as_ref()
        .map_or(Duration::from_secs(3600), |r| r.period);
    let mut tick = tokio::time::interval(period);
    tick.tick().await;
    loop {
        let watched = tokio::select! {
            s = signals.recv() => Watched::Signal(s),
            _ = tick.tick() => {
                let Some(r) = &rescan else { continue };
                match read_node(r.backend).await {
                    Ok(now) => Watched::Layout(now),
                    Err(e) => {
                        tracing::warn!(target: TARGET, error = %e, "rescan failed");
                        continue;
                    }
                }
            }
        };
        let stop = match (&rescan, &watched) {
            (Some(r), w) => decide(r.node, w),
            (None, Watched::Signal(s)) => Some(on_signal(*s)),
            (None, Watched::Layout(_)) => None,
        };
        match (stop, &watched) {
            (Some(Stop::Reload), Watched::Signal(_)) => {
                tracing::info!(target: TARGET, "SIGHUP: reloading");
            }
            (Some(Stop::Reload), Watched::Layout(_)) => {
                tracing::info!(target: TARGET, "GPU layout changed: reloading");
            }
            _ => {}
        }
        if let Some(stop) = stop {
            return stop;
        }
    }
}

/// Runs the device plugin until SIGTERM or SIGINT: each pass resolves the
/// settings, builds the backend with `backend_factory`, writes the CDI spec
/// (when a CDI strategy or `cdi_spec_dir` asks for one) and serves the
/// plugins; SIGHUP or a GPU layout change starts the next pass.
///
/// When the backend cannot be built and `failOnInitError` is false, the pass
/// waits for a signal instead of failing; with no devices it waits for a
/// signal or a layout change.
pub async fn run<F, E, S>(
    options: &RunOptions,
    mut backend_factory: F,
    mut signals: S,
) -> Result<(), RunError>
where
    F: FnMut() -> Result<Arc<dyn GpuBackend>, E>,
    E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    S: SignalSource,
{
    let mut pass: u64 = 0;
    loop {
        pass += 1;
        if serve_pass(options, &mut backend_factory, &mut signals, pass).await? == Stop::Exit {
            return Ok(());
        }
    }
}

/// One pass of [`run`]; returns how it ended.
#[instrument(level = "debug", name = "pass", skip_all, fields(n = pass))]
async fn serve_pass<F, E, S>(
    options: &RunOptions,
    backend_factory: &mut F,
    signals: &mut S,
    pass: u64,
) -> Result<Stop, RunError>
where
    F: FnMut() -> Result<Arc<dyn GpuBackend>, E>,
    E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    S: SignalSource,
{
    let settings = resolve_settings(options.config_file.as_deref(), &options.overrides)?;
    for n in &settings.notices {
        tracing::warn!(target: TARGET, "{n}");
    }
    let health = HealthPolicy {
        recovery_quiet_ms: options.health_recovery_seconds.saturating_mul(1000),
        ..HealthPolicy::from_env(
            options.disable_healthchecks.as_deref(),
            options.enable_healthchecks.as_deref(),
        )?
    };
    let backend = match backend_factory() {
        Ok(b) => b,
        Err(e) if !settings.fail_on_init_error => {
            let e: Box<dyn std::error::Error + Send + Sync> = e.into();
            tracing::error!(target: TARGET, error = %e, "GPU backend unavailable; failOnInitError=false, so waiting for a signal");
            return Ok(wait_stop(signals, None).await);
        }
        Err(e) => return Err(RunError::Backend(e.into())),
    };
    let node = read_node(&backend).await?;
    let resources = node_resources(&node, &settings)?;
    let cdi_dir = options.cdi_spec_dir.clone().or_else(|| {
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
            options
                .container_driver_root
                .as_deref()
                .unwrap_or(&settings.driver_root),
            &options.nvidia_cdi_hook_path,
            &node.driver_version,
        );
        let path = write_spec(dir, &node_spec(&node, &host))?;
        tracing::info!(target: TARGET, path = %path.display(), "CDI spec written");
    }
    let rescan = Rescan {
        node: &node,
        backend: &backend,
        period: Duration::from_secs(options.rescan_interval_seconds.max(1)),
    };
    if resources.is_empty() {
        tracing::warn!(target: TARGET, "no devices found; waiting for a signal or a GPU layout change");
        return Ok(wait_stop(signals, Some(rescan)).await);
    }
    for r in &resources {
        tracing::info!(target: TARGET, resource = %r.name, devices = r.devices.len(), "advertising");
    }
    let plugin_options = PluginOptions {
        kubelet_dir: options.kubelet_dir.clone(),
        register: options.register,
        health,
        probe_interval: PROBE_INTERVAL,
    };
    let plugins = DevicePlugins::new(
        resources.clone(),
        settings,
        Default::default(),
        plugin_options,
    )
    .with_probe(Arc::new(BackendProbe::new(backend.clone(), &resources)));
    let pump = spawn_backend_health(backend.clone(), &resources, plugins.health_sender());
    let mut stop = None;
    let served = plugins
        .run(async {
            stop = Some(wait_stop(signals, Some(rescan)).await);
        })
        .await;
    pump.stop();
    served?;
    let stop = stop.unwrap_or(Stop::Exit);
    if stop == Stop::Exit {
        tracing::info!(target: TARGET, "stopped");
    }
    Ok(stop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_stack_nvml::{SimNodeSpec, SimulatedBackend};

    /// Signals a test queues ahead of the run (at most two here).
    const SIGNALS: usize = 4;

    fn backend() -> Arc<dyn GpuBackend> {
        Arc::new(SimulatedBackend::new(&SimNodeSpec::uniform("n0", "0x233010DE", 1)).unwrap())
    }

    fn node(backend: &Arc<dyn GpuBackend>) -> NodeGpus {
        read_node_gpus(backend.as_ref(), None).unwrap()
    }

    #[test]
    fn sigterm_and_sigint_exit_sighup_reloads() {
        let serving = node(&backend());
        let signal = |s| decide(&serving, &Watched::Signal(s));
        assert_eq!(signal(Signal::Terminate), Some(Stop::Exit));
        assert_eq!(signal(Signal::Interrupt), Some(Stop::Exit));
        assert_eq!(signal(Signal::Hangup), Some(Stop::Reload));
    }

    #[test]
    fn a_layout_change_reloads_the_same_layout_does_not() {
        let b = backend();
        let serving = node(&b);
        assert_eq!(decide(&serving, &Watched::Layout(serving.clone())), None);
        b.set_mig_mode(0, true).unwrap();
        let changed = node(&b);
        assert_ne!(changed, serving);
        assert_eq!(
            decide(&serving, &Watched::Layout(changed)),
            Some(Stop::Reload)
        );
    }

    #[tokio::test]
    async fn wait_stop_follows_the_signals() {
        let (tx, mut rx) = mpsc::channel(SIGNALS);
        tx.send(Signal::Hangup).await.unwrap();
        assert_eq!(wait_stop(&mut rx, None).await, Stop::Reload);
        tx.send(Signal::Terminate).await.unwrap();
        assert_eq!(wait_stop(&mut rx, None).await, Stop::Exit);
    }

    #[tokio::test]
    async fn wait_stop_reloads_when_the_rescan_sees_a_new_layout() {
        let (_tx, mut rx) = mpsc::channel::<Signal>(SIGNALS);
        let b = backend();
        let serving = node(&b);
        b.set_mig_mode(0, true).unwrap();
        let rescan = Rescan {
            node: &serving,
            backend: &b,
            // Short, so the first rescan comes at once; nothing is timed.
            period: Duration::from_millis(1),
        };
        assert_eq!(wait_stop(&mut rx, Some(rescan)).await, Stop::Reload);
    }

    #[tokio::test]
    async fn a_missing_backend_waits_for_a_signal_unless_fail_on_init_error() {
        let options = RunOptions {
            kubelet_dir: PathBuf::from("/nonexistent"),
            register: false,
            config_file: None,
            overrides: Overrides::default(),
            container_driver_root: None,
            cdi_spec_dir: None,
            nvidia_cdi_hook_path: "/usr/bin/nvidia-cdi-hook".into(),
            disable_healthchecks: None,
            enable_healthchecks: None,
            health_recovery_seconds: 60,
            rescan_interval_seconds: 30,
        };
        // failOnInitError defaults to true: the backend's error ends the run.
        let (tx, rx) = mpsc::channel(SIGNALS);
        let err = run(&options, || Err::<Arc<dyn GpuBackend>, _>("no driver"), rx)
            .await
            .unwrap_err();
        assert!(matches!(err, RunError::Backend(_)), "{err:?}");
        assert_eq!(err.to_string(), "no driver");
        drop(tx);

        // failOnInitError=false: SIGHUP builds the backend again, SIGTERM exits.
        let options = RunOptions {
            overrides: Overrides {
                fail_on_init_error: Some(false),
                ..Overrides::default()
            },
            ..options
        };
        let (tx, rx) = mpsc::channel(SIGNALS);
        tx.send(Signal::Hangup).await.unwrap();
        tx.send(Signal::Terminate).await.unwrap();
        let mut builds = 0;
        run(
            &options,
            || {
                builds += 1;
                Err::<Arc<dyn GpuBackend>, _>("no driver")
            },
            rx,
        )
        .await
        .unwrap();
        assert_eq!(builds, 2);
    }
}
