//! The operator process: HTTP endpoints, leader election, then the controller,
//! until shutdown (SIGTERM) or loss of the lease.
//!
//! Order matters: the endpoints come up first so probes answer while a standby
//! waits; only the leader starts watches; on shutdown the controller finishes
//! the pass in flight, then the lease is released so the standby takes over at
//! once instead of after the lease expires.
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use futures::StreamExt;
use gpu_stack_core::dra::slices::{KubeVersion, VersionError};
use gpu_stack_core::operator::platform::{PlatformError, check_api_server};
use kube::Client;
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::client::{WriteGate, counting_client};
use super::events::EventPublisher;
use super::ops::{self, Progress, Readiness};
use super::watches::{Caches, OwnedStores, node_watch, resource_watches};
use super::{ControllerError, ControllerSettings, Pass, run_controller};
use crate::operator::leader::{LeaderConfig, LeaderError, Leadership};
use crate::operator::metrics::OperatorMetrics;
use crate::operator::migconfig::demand::run_demand;
use crate::operator::upgrade::controller::{UpgradeController, UpgradeSettings, run_upgrades};
use crate::operator::upgrade::watches::UpgradeStores;

/// Everything the operator process needs.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Namespace of the operator and its operands.
    pub namespace: String,
    /// This replica's identity (pod name) for the lease and Events.
    pub identity: String,
    /// Address of `/healthz`, `/readyz`, `/metrics`.
    pub listen: SocketAddr,
    /// Leader election; `None` runs without it (a single replica only).
    pub leader: Option<LeaderConfig>,
    /// Quiet period before a burst of triggers runs one pass.
    pub debounce: Duration,
    /// A node waiting in one driver upgrade state longer than this gets a
    /// Warning Event and is listed in `status.driverUpgrade.stuck`.
    pub upgrade_stuck_after: Duration,
}

/// Why the operator process stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The HTTP endpoint address could not be bound.
    #[error("cannot listen on {addr}: {source}; pick a free address with --listen")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The kube client could not be built from the configuration.
    #[error("cannot build a Kubernetes client: {0}")]
    Client(#[source] kube::Error),
    /// The API server is a release gpu-stack does not run on.
    #[error(transparent)]
    Platform(#[from] PlatformError),
    /// The API server's version reads as no Kubernetes version.
    #[error(transparent)]
    Version(#[from] VersionError),
    /// Leader election failed.
    #[error(transparent)]
    Leader(#[from] LeaderError),
    /// Another replica took the lease while this one was acting.
    #[error(
        "lost the leader lease; exiting so that only the new leader acts (the pod is restarted \
         and becomes a standby)"
    )]
    LostLease,
    /// The controller could not start.
    #[error(transparent)]
    Controller(#[from] ControllerError),
}

/// How long reading the API server's version may take at start.
const VERSION_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Refuses an API server older than gpu-stack supports, before anything is
/// written. An API server that does not answer in time is not refused here:
/// every later call has its own deadline and says why it failed.
async fn check_platform(client: &Client) -> Result<(), RunError> {
    let info = match tokio::time::timeout(VERSION_READ_TIMEOUT, client.apiserver_version()).await {
        Ok(Ok(info)) => info,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "cannot read the API server's version; going on");
            return Ok(());
        }
        Err(_) => {
            tracing::warn!(
                secs = VERSION_READ_TIMEOUT.as_secs(),
                "the API server's version did not come in time; going on"
            );
            return Ok(());
        }
    };
    let version = KubeVersion::from_info(&info.git_version, &info.major, &info.minor)?;
    check_api_server(version)?;
    tracing::info!(kubernetes = %version, "API server release supported");
    Ok(())
}

/// Runs the operator until `shutdown` resolves (then returns `Ok`) or a fatal
/// error. `make_pass` builds the operator logic over the client and the watch
/// caches once this replica leads.
pub async fn run<P, F>(
    config: kube::Config,
    options: RunOptions,
    make_pass: F,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError>
where
    P: Pass,
    F: FnOnce(Client, Caches, &str) -> P,
{
    let metrics = OperatorMetrics::new();
    let gate = match &options.leader {
        Some(l) => WriteGate::for_lease(
            &l.namespace,
            &l.lease_name,
            l.duration,
            l.grace,
            metrics.writes_dropped.clone(),
        ),
        None => WriteGate::open(),
    };
    let progress = Progress::default();
    let client = counting_client(config, metrics.clone(), gate.clone(), progress.clone())
        .map_err(RunError::Client)?;
    check_platform(&client).await?;

    // One watch channel fans the shutdown signal out to every task.
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    let listener = TcpListener::bind(options.listen)
        .await
        .map_err(|source| RunError::Listen {
            addr: options.listen,
            source,
        })?;
    let readiness = Readiness::default();
    let server = tokio::spawn(ops::serve(
        listener,
        metrics.clone(),
        readiness.clone(),
        progress.clone(),
        stopped(stop_rx.clone()),
    ));
    tracing::info!(listen = %options.listen, "serving /healthz, /readyz, /metrics");

    let mut leadership = match &options.leader {
        Some(leader) => {
            let mut l = Leadership::start(client.clone(), leader.clone()).await?;
            // A standby is ready: it is healthy and waiting for its turn.
            readiness.set(true);
            tracing::info!(identity = %options.identity, lease = %leader.lease_name, "waiting for leadership");
            tokio::select! {
                acquired = l.acquired() => acquired?,
                () = stopped(stop_rx.clone()) => {
                    l.release().await?;
                    let _ = server.await;
                    return Ok(());
                }
            }
            tracing::info!(identity = %options.identity, "acquired leadership");
            gate.set_leading(true);
            Some(l)
        }
        None => {
            readiness.set(true);
            None
        }
    };
    metrics.leader.set(1);

    // The controller stops on shutdown or when the lease is lost.
    let (lost_tx, lost_rx) = watch::channel(false);
    let mut stop_for_controller = stop_rx.clone();
    let mut lost_for_controller = lost_rx.clone();
    let controller_stop = async move {
        tokio::select! {
            _ = stop_for_controller.wait_for(|s| *s) => {}
            _ = lost_for_controller.wait_for(|l| *l) => {}
        }
    };
    let mut watch_lease = leadership.as_ref().map(Leadership::subscribe);
    let mut stop_for_lease = stop_rx.clone();
    let gate_for_lease = gate.clone();
    tokio::spawn(async move {
        if let Some(rx) = watch_lease.as_mut() {
            // Ends on shutdown too: this receiver must be dropped before the
            // lease can be released (the election task waits for every
            // receiver to go away).
            tokio::select! {
                _ = rx.wait_for(|leader| !*leader) => {
                    gate_for_lease.set_leading(false);
                    let _ = lost_tx.send(true);
                }
                _ = stop_for_lease.wait_for(|s| *s) => {}
            }
        } else {
            // No election: never lost; keep the sender alive until shutdown.
            std::future::pending::<()>().await;
        }
    });

    let (nodes, node_changes) = node_watch(client.clone());
    let (owned, owned_changes) = OwnedStores::start(&client, &options.namespace);
    let (resources, resource_changes) = resource_watches(&client);
    let triggers = futures::stream::select_all([
        node_changes.map(|_| ()).boxed(),
        owned_changes,
        resource_changes,
    ]);
    let events = EventPublisher::new(client.clone(), options.identity.clone());
    let settings = ControllerSettings {
        debounce: options.debounce,
        progress: progress.clone(),
    };
    let pass_client = client.clone();
    // The driver upgrade loop runs next to the reconcile loop, on the leader
    // only, and stops with it.
    let (upgrade_stores, upgrade_triggers) =
        UpgradeStores::start(&client, &options.namespace, nodes.clone());
    let upgrades = UpgradeController::new(
        client.clone(),
        upgrade_stores,
        UpgradeSettings {
            namespace: options.namespace.clone(),
            stuck_after: options.upgrade_stuck_after,
        },
        metrics.clone(),
        events.clone(),
    );
    let (upgrade_stop_tx, mut upgrade_stop_rx) = watch::channel(false);
    let upgrade_task = tokio::spawn(run_upgrades(
        upgrades,
        upgrade_triggers,
        progress.clone(),
        async move {
            let _ = upgrade_stop_rx.wait_for(|s| *s).await;
        },
    ));
    // Demand-driven MIG decisions, likewise on the leader only.
    let (demand_stop_tx, mut demand_stop_rx) = watch::channel(false);
    let demand_task = tokio::spawn(run_demand(client.clone(), progress, async move {
        let _ = demand_stop_rx.wait_for(|s| *s).await;
    }));
    let result = run_controller(
        client,
        settings,
        triggers,
        |policies| {
            let caches = Caches {
                nodes,
                policies,
                owned,
                nvidia_drivers: resources.nvidia_drivers,
                mig_configs: resources.mig_configs,
            };
            make_pass(pass_client, caches, &options.namespace)
        },
        metrics.clone(),
        events,
        controller_stop,
    )
    .await;
    let _ = upgrade_stop_tx.send(true);
    let _ = demand_stop_tx.send(true);
    let _ = upgrade_task.await;
    let _ = demand_task.await;
    metrics.leader.set(0);
    gate.set_leading(false);

    let lost = *lost_rx.borrow() && !*stop_rx.borrow();
    if lost {
        return Err(RunError::LostLease);
    }
    if let Some(l) = leadership.take() {
        if let Err(error) = l.release().await {
            tracing::warn!(%error, "could not release the lease; the standby takes over when it expires");
        } else {
            tracing::info!("released the lease");
        }
    }
    if result.is_err() {
        server.abort();
    } else {
        let _ = server.await;
    }
    result?;
    Ok(())
}
