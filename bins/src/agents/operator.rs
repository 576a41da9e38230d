//! `gpu-operator`: reconciles ClusterPolicy documents on a Kubernetes cluster.
//!
//! Flags, logging, signals; the process itself is
//! `gpu_stack_k8s::operator::controller::runner::run`.
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use gpu_stack_k8s::api_client::bounded_client;
use gpu_stack_k8s::operator::controller::operator_pass::OperatorPass;
use gpu_stack_k8s::operator::controller::runner::{RunOptions, run};
use gpu_stack_k8s::operator::controller::uninstall::{UninstallOptions, uninstall};
use gpu_stack_k8s::operator::crds;
use gpu_stack_k8s::operator::leader::LeaderConfig;

use crate::agent::{
    LogFormat, init_logging, kube_config, run_main_single_threaded, shutdown_signal,
};

/// gpu-operator: deploys and maintains the NVIDIA GPU stack on every GPU node.
#[derive(Parser, Debug)]
#[command(name = "gpu-operator", version, about)]
pub struct Args {
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
    /// A node waiting in one driver upgrade state longer than this gets a
    /// Warning Event and a `DriverUpgradeStuck` condition on the policy.
    #[arg(long, default_value_t = gpu_stack_k8s::operator::upgrade::DEFAULT_STUCK_AFTER_SECONDS)]
    upgrade_stuck_after_seconds: u64,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Instead of operating: delete every ClusterPolicy and wait until the
    /// running operator has cleaned up after it, then stop node discovery and
    /// remove its labels (the chart's pre-delete hook).
    #[arg(long)]
    uninstall: bool,
    /// With --uninstall: the chart's node-discovery DaemonSet, in --namespace.
    #[arg(long, requires = "uninstall")]
    node_discovery_daemonset: Option<String>,
    /// With --uninstall: the operator's Deployment, in --namespace, scaled
    /// to zero before the last sweep of its node labels.
    #[arg(long, requires = "uninstall")]
    operator_deployment: Option<String>,
    /// With --uninstall: how long each step may take.
    #[arg(long, default_value_t = 120, requires = "uninstall")]
    uninstall_timeout_seconds: u64,
    /// With --uninstall: how long the running operator gets to clean up after
    /// the policies; past it (no operator running) the labels it added and
    /// its finalizer are removed here.
    #[arg(long, default_value_t = 30, requires = "uninstall")]
    uninstall_operator_grace_seconds: u64,
    /// Instead of operating: apply the stack's CRDs from this binary's types
    /// (server-side, taking over fields others wrote) and wait until they
    /// are served (the chart's pre-install and pre-upgrade hook,
    /// `operator.upgradeCRD`).
    #[arg(long, conflicts_with_all = ["uninstall", "delete_crds"])]
    apply_crds: bool,
    /// Instead of operating: delete the stack's CRDs, and with them every
    /// object of them (the chart's post-delete hook, `operator.cleanupCRD`).
    #[arg(long, conflicts_with = "uninstall")]
    delete_crds: bool,
    /// With --apply-crds or --delete-crds: how long it may take.
    #[arg(long, default_value_t = 120)]
    crd_timeout_seconds: u64,
}

/// The process: logging, then [`operate`] on one thread (the operator
/// mostly waits on the API server).
pub fn main(args: Args) -> ExitCode {
    init_logging(args.log_format);
    run_main_single_threaded(operate(args))
}

/// A chart hook's request bounds: short, so a request lost with a dropped
/// connection fails (and is retried) instead of holding the hook for minutes.
fn hook_config(mut config: kube::Config) -> kube::Config {
    config.read_timeout = Some(Duration::from_secs(15));
    config.connect_timeout = Some(Duration::from_secs(10));
    config
}

/// Operates until SIGTERM; or, as a chart hook, removes the stack
/// (`--uninstall`) or applies or deletes its CRDs.
pub async fn operate(args: Args) -> Result<()> {
    let config = kube_config(args.kubeconfig.as_deref()).await?;
    if args.apply_crds || args.delete_crds {
        let client = bounded_client(hook_config(config)).context("building the API client")?;
        let timeout = Duration::from_secs(args.crd_timeout_seconds);
        if args.apply_crds {
            let names = crds::apply(&client, timeout)
                .await
                .context("gpu-operator --apply-crds")?;
            tracing::info!(crds = ?names, "CRDs applied and served");
        } else {
            let names = crds::delete(&client, timeout)
                .await
                .context("gpu-operator --delete-crds")?;
            tracing::info!(crds = ?names, "CRDs deleted");
        }
        return Ok(());
    }
    if args.uninstall {
        let client = bounded_client(hook_config(config)).context("building the API client")?;
        let options = UninstallOptions {
            namespace: args.namespace,
            node_discovery: args.node_discovery_daemonset,
            operator_deployment: args.operator_deployment,
            timeout: Duration::from_secs(args.uninstall_timeout_seconds),
            operator_grace: Duration::from_secs(args.uninstall_operator_grace_seconds),
        };
        let removed = uninstall(client, &options)
            .await
            .context("gpu-operator --uninstall")?;
        tracing::info!(labels_removed = removed, "uninstalled");
        return Ok(());
    }
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
        upgrade_stuck_after: Duration::from_secs(args.upgrade_stuck_after_seconds),
    };
    run(config, options, OperatorPass::new, shutdown_signal())
        .await
        .context("gpu-operator stopped")?;
    tracing::info!("shut down cleanly");
    Ok(())
}
