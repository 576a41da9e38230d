//! `gpu-stack node-status-exporter`: the validation status of this node as
//! Prometheus gauges on `/metrics` (the operator's `nodeStatusExporter`
//! DaemonSet). Reads the status files at each scrape; needs no GPU, no
//! Kubernetes access and no privileges. Stops cleanly on SIGTERM or SIGINT.
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use gpu_stack_core::operator::components::VALIDATIONS_DIR;
use gpu_stack_k8s::node_status::{NodeStatusConfig, serve};

use crate::agent::{LogFormat, init_logging, shutdown_signal};

/// Flags of `gpu-stack node-status-exporter`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Address to serve `/metrics` and `/health` on.
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:8000")]
    listen: SocketAddr,
    /// Directory of the status files.
    #[arg(long, value_name = "DIR", default_value = VALIDATIONS_DIR)]
    validations_dir: PathBuf,
    /// This node's name (the `node` label of every series).
    #[arg(long, value_name = "NAME", env = "NODE_NAME", default_value = "")]
    node: String,
    /// Log line format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

/// Serves until SIGTERM or SIGINT; exit 3 when the address cannot be used.
pub fn run(args: Args) -> Result<ExitCode> {
    init_logging(args.log_format);
    let started_unix_secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let listener = match tokio::net::TcpListener::bind(args.listen).await {
            Ok(l) => l,
            Err(err) => {
                eprintln!(
                    "error: cannot listen on {}: {err}; pick a free address with --listen",
                    args.listen
                );
                return Ok(ExitCode::from(3));
            }
        };
        if let Ok(addr) = listener.local_addr() {
            println!("serving validation status on http://{addr}/metrics");
        }
        if !args.validations_dir.is_dir() {
            tracing::warn!(
                dir = %args.validations_dir.display(),
                "the validations directory does not exist (yet); every check reads 0 until it does"
            );
        }
        let config = NodeStatusConfig {
            dir: args.validations_dir,
            node: args.node,
            started_unix_secs,
        };
        serve(listener, config, shutdown_signal())
            .await
            .context("serving /metrics")?;
        Ok(ExitCode::SUCCESS)
    })
}
