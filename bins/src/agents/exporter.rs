//! `gpu-exporter`: DCGM-compatible GPU metrics for Prometheus, without DCGM.
//!
//! Flags follow dcgm-exporter's (`-a/--listen`, `-f/--collectors`,
//! `-c/--collect-interval`, the same environment variables) so its Helm values
//! and ServiceMonitors work unchanged. Exit codes: 2 bad flags or counters file,
//! 3 the listen address cannot be bound, 4 the GPUs cannot be listed.
//!
//! Flags, logging and exit codes; the exporter itself is
//! `gpu_stack_k8s::exporter`.
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use gpu_stack_core::metrics::{CounterSet, RenderOptions, ResourceMatcher, parse_counters};
use gpu_stack_k8s::exporter::{self, ExporterConfig, PodResourcesConfig};
use gpu_stack_k8s::kubelet::podresources::DEFAULT_SOCKET;

use crate::agent::{Failure, LogFormat, exit_code, init_logging, run_main, shutdown_signal};
use crate::backend_flags::BackendArgs;

#[derive(Parser, Debug)]
#[command(
    name = "gpu-exporter",
    about = "DCGM-compatible GPU metrics exporter (no DCGM needed)",
    after_help = "Exit codes: 2 bad flags or counters file, 3 listen address unusable, 4 GPUs cannot be listed."
)]
pub struct Args {
    /// Address to serve /metrics and /health on (`:PORT`, `HOST:PORT`, `[::]:PORT`).
    #[arg(
        short = 'a',
        long = "listen",
        visible_alias = "address",
        env = "DCGM_EXPORTER_LISTEN",
        default_value = ":9400"
    )]
    listen: String,
    /// dcgm-exporter counters CSV selecting the metrics (default: built-in set).
    #[arg(short = 'f', long = "collectors", env = "DCGM_EXPORTER_COLLECTORS")]
    collectors: Option<PathBuf>,
    /// Collection interval in milliseconds.
    #[arg(short = 'c', long = "collect-interval", env = "DCGM_EXPORTER_INTERVAL", default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    collect_interval_ms: u64,
    /// Kubelet pod-resources socket used for pod attribution.
    #[arg(long, env = "DCGM_POD_RESOURCES_KUBELET_SOCKET", default_value = DEFAULT_SOCKET)]
    pod_resources_socket: PathBuf,
    /// Turn pod attribution off.
    #[arg(long)]
    no_pod_attribution: bool,
    /// How often to refresh pod attribution, in milliseconds.
    #[arg(long, default_value_t = 5_000, value_parser = clap::value_parser!(u64).range(1..))]
    pod_resources_refresh_ms: u64,
    /// Extra resource names that are GPUs (comma separated), e.g. nvidia.com/gpu.shared.
    #[arg(long, env = "NVIDIA_RESOURCE_NAMES", value_delimiter = ',')]
    nvidia_resource_names: Vec<String>,
    /// Leave the hostname label out.
    #[arg(short = 'n', long)]
    no_hostname: bool,
    /// Node name for the hostname label (default: the machine's hostname).
    #[arg(long, env = "NODE_NAME")]
    hostname: Option<String>,
    /// Spelling of the hostname label: `Hostname` (released dcgm-exporter) or `hostname`.
    #[arg(long, default_value = "Hostname", value_parser = ["Hostname", "hostname"])]
    hostname_label: String,
    /// Window of DCGM_EXP_XID_ERRORS_COUNT in milliseconds.
    #[arg(long = "xid-count-window-size", default_value_t = 300_000)]
    xid_count_window_ms: u64,
    /// Window of DCGM_EXP_CLOCK_EVENTS_COUNT in milliseconds.
    #[arg(long = "clock-events-count-window-size", default_value_t = 300_000)]
    clock_events_count_window_ms: u64,
    /// Also serve OpenMetrics to scrapers that ask for it. Off by default, as
    /// in dcgm-exporter: OpenMetrics types the DCGM counters `unknown`.
    #[arg(long)]
    enable_openmetrics: bool,
    /// Close a connection that has not sent a request's headers within this
    /// many seconds (idle keep-alive and slow clients).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    header_read_timeout_seconds: u64,
    #[command(flatten)]
    backend: BackendArgs,
    /// Log as JSON lines.
    #[arg(long)]
    log_json: bool,
}

fn counters(args: &Args) -> Result<CounterSet, Failure> {
    let Some(path) = &args.collectors else {
        return Ok(CounterSet::default_set());
    };
    let text = std::fs::read_to_string(path)
        .with_context(|| {
            format!(
                "cannot read the counters file {} (-f/--collectors)",
                path.display()
            )
        })
        .map_err(exit_code(2))?;
    let report = parse_counters(&text)
        .with_context(|| format!("counters file {}", path.display()))
        .map_err(exit_code(2))?;
    for skipped in &report.skipped {
        tracing::warn!(file = %path.display(), "{skipped}");
    }
    Ok(report.set)
}

fn hostname(args: &Args) -> Option<String> {
    if args.no_hostname {
        return None;
    }
    args.hostname.clone().or_else(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_string())
    })
}

/// Serves the metrics until SIGTERM; fails with exit code 2 on bad flags or
/// counters file, 3 when the listen address cannot be bound, 4 when the GPUs
/// cannot be listed.
pub async fn run(args: Args, started: Instant) -> Result<(), Failure> {
    run_until(args, started, shutdown_signal()).await
}

/// [`run`], until `stop` resolves instead of SIGTERM.
pub async fn run_until(
    args: Args,
    started: Instant,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Failure> {
    let counters = counters(&args)?;
    let addr = exporter::parse_listen(&args.listen).map_err(exit_code(2))?;
    // Bind first: a port in use is reported before anything else starts.
    let listener = exporter::bind(addr).await.map_err(exit_code(3))?;
    let backend = args.backend.build().map_err(exit_code(4))?;
    let config = ExporterConfig {
        counters,
        interval: Duration::from_millis(args.collect_interval_ms),
        render: RenderOptions {
            hostname: hostname(&args),
            hostname_label: args.hostname_label.clone(),
            driver_version: None,
            nvml_version: None,
            xid_window_ms: args.xid_count_window_ms,
            clock_events_window_ms: args.clock_events_count_window_ms,
        },
        pod_resources: (!args.no_pod_attribution).then(|| PodResourcesConfig {
            socket: args.pod_resources_socket.clone(),
            refresh: Duration::from_millis(args.pod_resources_refresh_ms),
            timeout: Duration::from_secs(10),
            matcher: ResourceMatcher {
                extra: args.nvidia_resource_names.clone(),
            },
        }),
        openmetrics: args.enable_openmetrics,
        header_read_timeout: Duration::from_secs(args.header_read_timeout_seconds),
    };
    let exp = exporter::start(backend, config).map_err(exit_code(4))?;
    tracing::info!(
        %addr,
        startup_ms = started.elapsed().as_secs_f64() * 1000.0,
        "serving /metrics and /health"
    );
    exporter::serve(listener, &exp, stop)
        .await
        .context("HTTP server failed")
        .map_err(exit_code(1))?;
    exp.shutdown();
    Ok(())
}

/// The process: logging, then [`run`] on the agents' runtime.
pub fn main(args: Args) -> ExitCode {
    let started = Instant::now();
    init_logging(if args.log_json {
        LogFormat::Json
    } else {
        LogFormat::Text
    });
    run_main(run(args, started))
}
