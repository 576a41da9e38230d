//! The kube side of the operator: the API client, the HTTP endpoints, Events,
//! and the kube-runtime controller that drives one reconcile pass of the
//! operator logic whenever something it depends on changes.
//!
//! Triggers, all event-driven (no polling loop):
//! - ClusterPolicy changes (the controller's main watch);
//! - node *metadata* changes that alter labels, or nodes joining and leaving
//!   (a metadata-only watch: no Node specs or statuses are cached);
//! - changes to the DaemonSets the operator owns in its namespace.
//!
//! Errors are retried with exponential backoff (100 ms doubling to 30 s, as
//! NVIDIA's operator does up to its cap); a pass that reports operands not
//! ready asks to be requeued after a short delay.
pub mod client;
pub mod events;
pub mod operator_pass;
pub mod ops;
pub mod runner;

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{StreamExt, future};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Node, ObjectReference};
use kube::core::PartialObjectMeta;
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, predicates, watcher};
use kube::{Api, Client, Resource, ResourceExt};

use crate::clusterpolicy::ClusterPolicy;
use crate::operator_metrics::{OperatorMetrics, ReconciliationStatus};
use events::{Decision, EventPublisher};

/// Node metadata the controller keeps (labels, annotations, owner data; no spec
/// or status), shared with the reconcile pass so it never lists nodes itself.
pub type NodeStore = Store<PartialObjectMeta<Node>>;

/// What one reconcile pass reports back to the controller.
#[derive(Clone, Debug, PartialEq)]
pub struct PassReport {
    /// Value for `gpu_operator_reconciliation_status`.
    pub status: ReconciliationStatus,
    /// Nodes treated as GPU nodes.
    pub gpu_nodes: i64,
    /// Whether any node carries node-feature-discovery labels.
    pub has_nfd_labels: bool,
    /// Objects written because their desired-state hash changed.
    pub applied: u64,
    /// Objects left alone because their hash was unchanged.
    pub unchanged: u64,
    /// Decisions to publish as Events, with the object each is about.
    pub decisions: Vec<(ObjectReference, Decision)>,
    /// When to look again even if nothing changes (operands not ready yet).
    pub requeue_after: Option<Duration>,
}

/// One reconcile pass of the operator for a ClusterPolicy. Implemented over
/// the kube `Cluster` in [`crate::cluster::kube`].
pub trait Pass: Send + Sync + 'static {
    /// Why a pass failed.
    type Error: std::error::Error + Send + Sync + 'static;
    /// Runs one pass for `policy`.
    fn run(
        &self,
        policy: Arc<ClusterPolicy>,
    ) -> impl Future<Output = Result<PassReport, Self::Error>> + Send;
}

/// Errors of the controller loop as a whole.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// The ClusterPolicy CRD is not installed.
    #[error(
        "the ClusterPolicy CRD (clusterpolicies.nvidia.com) is not installed or not readable: \
         {0}; install the chart's CRD (deploy/crds) and check the operator's RBAC"
    )]
    CrdMissing(#[source] kube::Error),
}

/// Settings of the controller loop.
#[derive(Clone, Debug)]
pub struct ControllerSettings {
    /// Namespace of the operands (and of the operator).
    pub namespace: String,
    /// Quiet period before a burst of triggers runs one pass.
    pub debounce: Duration,
}

struct Ctx<P> {
    pass: P,
    metrics: OperatorMetrics,
    events: EventPublisher,
    backoff: Mutex<Backoff>,
}

/// Exponential error backoff shared by the (singleton) policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    next: Duration,
}

impl Backoff {
    const MIN: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(30);

    /// A fresh backoff.
    pub fn new() -> Self {
        Self { next: Self::MIN }
    }

    /// The delay before the next retry; doubles up to 30 s.
    pub fn fail(&mut self) -> Duration {
        let now = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        now
    }

    /// Forget earlier failures.
    pub fn reset(&mut self) {
        self.next = Self::MIN;
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new()
    }
}

/// Starts the metadata-only node watch and returns its store plus the stream
/// that must be polled to keep it fed; every item is a node whose labels
/// changed (or that joined or left).
pub fn node_watch(
    client: Client,
) -> (
    NodeStore,
    impl futures::Stream<Item = PartialObjectMeta<Node>> + Send + 'static,
) {
    let (store, writer) = reflector::store();
    // `Api<PartialObjectMeta<_>>` makes metadata-only list and watch requests.
    let api: Api<PartialObjectMeta<Node>> = Api::all(client);
    let stream = watcher(api, watcher::Config::default().any_semantic())
        .default_backoff()
        // managedFields are the bulk of a node's metadata and we never read them.
        .modify(|meta: &mut PartialObjectMeta<Node>| {
            meta.metadata.managed_fields = None;
        })
        .reflect(writer)
        .touched_objects()
        .predicate_filter(predicates::labels, Default::default())
        .filter_map(|r| future::ready(r.ok()));
    (store, stream)
}

/// Runs the controller until `shutdown` resolves. `pass` is the operator logic.
pub async fn run_controller<P: Pass>(
    client: Client,
    settings: ControllerSettings,
    node_changes: impl futures::Stream<Item = PartialObjectMeta<Node>> + Send + 'static,
    pass: P,
    metrics: OperatorMetrics,
    events: EventPublisher,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) -> Result<(), ControllerError> {
    let policies: Api<ClusterPolicy> = Api::all(client.clone());
    // Fail early with a clear message rather than a watch retrying forever.
    policies
        .list_metadata(&kube::api::ListParams::default().limit(1))
        .await
        .map_err(ControllerError::CrdMissing)?;
    let daemonsets: Api<DaemonSet> = Api::namespaced(client, &settings.namespace);
    let ctx = Arc::new(Ctx {
        pass,
        metrics,
        events,
        backoff: Mutex::new(Backoff::new()),
    });
    Controller::new(policies, watcher::Config::default().any_semantic())
        .with_config(
            ControllerConfig::default()
                .debounce(settings.debounce)
                .concurrency(1),
        )
        .owns(daemonsets, watcher::Config::default().any_semantic())
        .reconcile_all_on(node_changes.map(|_| ()))
        .graceful_shutdown_on(shutdown)
        .run(reconcile::<P>, error_policy::<P>, ctx)
        .for_each(|result| {
            if let Err(error) = result {
                tracing::debug!(%error, "controller event");
            }
            future::ready(())
        })
        .await;
    Ok(())
}

/// Error type carried from a pass to the error policy.
#[derive(Debug, thiserror::Error)]
#[error("reconcile of ClusterPolicy {policy} failed: {source}")]
pub struct PassFailed<E: std::error::Error + 'static> {
    policy: String,
    #[source]
    source: E,
}

async fn reconcile<P: Pass>(
    policy: Arc<ClusterPolicy>,
    ctx: Arc<Ctx<P>>,
) -> Result<Action, PassFailed<P::Error>> {
    let name = policy.name_any();
    let report = ctx.pass.run(policy).await.map_err(|source| PassFailed {
        policy: name.clone(),
        source,
    })?;
    if let Ok(mut backoff) = ctx.backoff.lock() {
        backoff.reset();
    }
    let m = &ctx.metrics;
    m.record_reconcile(report.status);
    m.gpu_nodes_total.set(report.gpu_nodes);
    m.reconciliation_has_nfd_labels
        .set(i64::from(report.has_nfd_labels));
    m.objects_applied.inc_by(report.applied);
    m.objects_unchanged.inc_by(report.unchanged);
    for (regarding, decision) in &report.decisions {
        ctx.events.publish(regarding, decision).await;
    }
    tracing::info!(
        policy = %name,
        status = ?report.status,
        gpu_nodes = report.gpu_nodes,
        applied = report.applied,
        unchanged = report.unchanged,
        "reconciled"
    );
    Ok(match report.requeue_after {
        Some(after) => Action::requeue(after),
        None => Action::await_change(),
    })
}

fn error_policy<P: Pass>(
    policy: Arc<ClusterPolicy>,
    error: &PassFailed<P::Error>,
    ctx: Arc<Ctx<P>>,
) -> Action {
    ctx.metrics
        .record_reconcile(ReconciliationStatus::OperatorError);
    let delay = ctx
        .backoff
        .lock()
        .map(|mut b| b.fail())
        .unwrap_or(Backoff::MAX);
    tracing::warn!(policy = %policy.name_any(), %error, retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

/// A reference to `obj` for Events.
pub fn reference_to<K: Resource<DynamicType = ()>>(obj: &K) -> ObjectReference {
    obj.object_ref(&())
}

#[cfg(test)]
mod tests {
    use super::Backoff;
    use std::time::Duration;

    #[test]
    fn backoff_doubles_to_a_cap_and_resets() {
        let mut b = Backoff::new();
        assert_eq!(b.fail(), Duration::from_millis(100));
        assert_eq!(b.fail(), Duration::from_millis(200));
        for _ in 0..20 {
            b.fail();
        }
        assert_eq!(b.fail(), Duration::from_secs(30));
        b.reset();
        assert_eq!(b.fail(), Duration::from_millis(100));
    }
}
