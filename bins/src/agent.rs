//! Plumbing shared by the agent mains: log setup, the async runtime and the
//! exit code of a failure, the shutdown signal and the Kubernetes client from
//! `--kubeconfig`.

use std::future::Future;
use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::ValueEnum;
use gpu_stack_k8s::api_client::bounded_client;

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

/// Why an agent stopped, and the exit code that says so: 1 unless the
/// agent documents others (as `gpu-exporter` does for bad flags, an unusable
/// listen address and unlisted GPUs).
#[derive(Debug)]
pub struct Failure {
    code: u8,
    error: anyhow::Error,
}

impl Failure {
    /// `error`, ending the process with `code`.
    pub fn new(code: u8, error: impl Into<anyhow::Error>) -> Failure {
        Failure {
            code,
            error: error.into(),
        }
    }

    /// The exit code.
    pub fn code(&self) -> u8 {
        self.code
    }

    /// What went wrong.
    pub fn error(&self) -> &anyhow::Error {
        &self.error
    }
}

impl From<anyhow::Error> for Failure {
    fn from(error: anyhow::Error) -> Failure {
        Failure::new(1, error)
    }
}

/// For `map_err`: the error as a [`Failure`] with exit code `code`.
pub fn exit_code<E: Into<anyhow::Error>>(code: u8) -> impl FnOnce(E) -> Failure {
    move |error| Failure::new(code, error)
}

/// Runs `work` on a two-thread runtime; logs any error and ends with its
/// exit code (1 for a plain error, the [`Failure`]'s own otherwise), so the
/// mains stay a few lines long.
pub fn run_main<F, E>(work: F) -> ExitCode
where
    F: Future<Output = Result<(), E>>,
    E: Into<Failure>,
{
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.worker_threads(2);
    run_on(builder, work)
}

/// Like [`run_main`], on one thread: for agents that mostly wait on the API
/// server, where every extra thread is memory (a stack and a malloc arena)
/// and buys nothing.
pub fn run_main_single_threaded<F, E>(work: F) -> ExitCode
where
    F: Future<Output = Result<(), E>>,
    E: Into<Failure>,
{
    run_on(tokio::runtime::Builder::new_current_thread(), work)
}

fn run_on<F, E>(mut builder: tokio::runtime::Builder, work: F) -> ExitCode
where
    F: Future<Output = Result<(), E>>,
    E: Into<Failure>,
{
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(err) => {
            tracing::error!(%err, "cannot start the async runtime");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(work).map_err(Into::into) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            tracing::error!("{:#}", failure.error);
            ExitCode::from(failure.code)
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

/// A Kubernetes client from [`kube_config`], with a deadline on every
/// request but watches.
pub async fn kube_client(kubeconfig: Option<&Path>) -> Result<kube::Client> {
    let config = kube_config(kubeconfig).await?;
    bounded_client(config).context("building the Kubernetes client")
}
