//! `gpu-operator`: reconciles ClusterPolicy documents on a Kubernetes cluster.
//!
//! Thin main: flags, logging, signals; the process itself is
//! `gpu_stack_k8s::controller::runner::run`.
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, ValueEnum};
use gpu_stack_k8s::controller::operator_pass::OperatorPass;
use gpu_stack_k8s::controller::runner::{RunOptions, run};
use gpu_stack_k8s::leader::LeaderConfig;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// gpu-operator: deploys and maintains the NVIDIA GPU stack on every GPU node.
#[derive(Parser, Debug)]
#[command(name = "gpu-operator", version, about)]
struct Args {
    /// Namespace of the operator and its operands.
    #[arg(long, env = "OPERATOR_NAMESPACE")]
    namespace: String,
    /// This replica's identity for leader election and Events (the pod name).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Address serving /healthz, /readyz and /metrics.
    #[arg(long, default_value = "0.0.0.0:8080")]
    listen: SocketAddr,
    /// Kubeconfig to use; without it, in-cluster config or $KUBECONFIG.
    #[arg(long, env = "GPU_OPERATOR_KUBECONFIG")]
    kubeconfig: Option<std::path::PathBuf>,
    /// Name of the Lease used for leader election.
    #[arg(long, default_value = "gpu-stack-operator")]
    lease_name: String,
    /// How long a leader's claim lasts without renewal (failover time).
    #[arg(long, default_value_t = 15)]
    lease_duration_seconds: u64,
    /// How long before expiry the leader renews.
    #[arg(long, default_value_t = 5)]
    renew_grace_seconds: u64,
    /// Run without leader election (only safe with a single replica).
    #[arg(long)]
    no_leader_election: bool,
    /// Quiet period (milliseconds) before a burst of changes runs one pass.
    #[arg(long, default_value_t = 200)]
    debounce_ms: u64,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

fn main() -> ExitCode {
    let args = Args::parse();
    init_logging(args.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(err) => {
            tracing::error!(%err, "cannot start the async runtime");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(operate(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("{err:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(format: LogFormat) {
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

async fn operate(args: Args) -> Result<()> {
    let config = match &args.kubeconfig {
        Some(path) => {
            let raw = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(raw, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("using kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer()
            .await
            .context("no Kubernetes configuration (in-cluster, $KUBECONFIG or --kubeconfig)")?,
    };
    let identity = match args.identity {
        Some(id) => id,
        None => std::env::var("HOSTNAME")
            .unwrap_or_else(|_| format!("gpu-operator-{}", std::process::id())),
    };
    let leader = (!args.no_leader_election).then(|| LeaderConfig {
        lease_name: args.lease_name.clone(),
        namespace: args.namespace.clone(),
        identity: identity.clone(),
        duration: Duration::from_secs(args.lease_duration_seconds),
        grace: Duration::from_secs(args.renew_grace_seconds),
    });
    let options = RunOptions {
        namespace: args.namespace,
        identity,
        listen: args.listen,
        leader,
        debounce: Duration::from_millis(args.debounce_ms),
    };
    run(config, options, OperatorPass::new, shutdown_signal())
        .await
        .context("gpu-operator stopped")?;
    tracing::info!("shut down cleanly");
    Ok(())
}

/// Resolves on SIGTERM (what the kubelet sends) or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
                _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
            }
        }
        Err(err) => {
            tracing::warn!(%err, "cannot listen for SIGTERM; only SIGINT stops the operator");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
