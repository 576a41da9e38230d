//! Plumbing shared by the agent mains: log setup, the async runtime, the
//! shutdown signal and the Kubernetes client from `--kubeconfig`.

use std::future::Future;
use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::ValueEnum;

/// Log line format chosen with `--log-format`.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Logs to stderr at `RUST_LOG` (default `info`) in the given format.
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Runs `work` on a two-thread runtime; logs any error and maps it to a
/// failing exit code, so the mains stay a few lines long.
pub fn run_main<F>(work: F) -> ExitCode
where
    F: Future<Output = Result<()>>,
{
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.worker_threads(2);
    run_on(builder, work)
}

/// Like [`run_main`], on one thread: for agents that mostly wait on the API
/// server, where every extra thread is memory (a stack and a malloc arena)
/// and buys nothing.
pub fn run_main_single_threaded<F>(work: F) -> ExitCode
where
    F: Future<Output = Result<()>>,
{
    run_on(tokio::runtime::Builder::new_current_thread(), work)
}

fn run_on<F>(mut builder: tokio::runtime::Builder, work: F) -> ExitCode
where
    F: Future<Output = Result<()>>,
{
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(err) => {
            tracing::error!(%err, "cannot start the async runtime");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(work) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("{err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Resolves on SIGTERM (what the kubelet sends) or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
                _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
            }
        }
        Err(err) => {
            tracing::warn!(%err, "cannot listen for SIGTERM; only SIGINT stops the process");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Kubernetes configuration: `kubeconfig` when given, else kube's default
/// chain (in-cluster, `$KUBECONFIG`, `~/.kube/config`).
pub async fn kube_config(kubeconfig: Option<&Path>) -> Result<kube::Config> {
    match kubeconfig {
        Some(path) => {
            let raw = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(raw, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("using kubeconfig {}", path.display()))
        }
        None => kube::Config::infer()
            .await
            .context("no Kubernetes configuration (in-cluster, $KUBECONFIG or --kubeconfig)"),
    }
}

/// A Kubernetes client from [`kube_config`].
pub async fn kube_client(kubeconfig: Option<&Path>) -> Result<kube::Client> {
    let config = kube_config(kubeconfig).await?;
    kube::Client::try_from(config).context("building the Kubernetes client")
}
