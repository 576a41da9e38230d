//! The kube side of the operator: the API client, the HTTP endpoints, Events,
//! and the kube-runtime controller that drives one reconcile pass of the
//! operator logic whenever something it depends on changes.
//!
//! Triggers, event-driven except for the slow resync below:
//! - ClusterPolicy changes (the controller's main watch);
//! - node changes that alter labels or taints, or nodes joining and leaving
//!   (nodes are cached cut down: see [`watches::WatchedNode`]);
//! - changes to any object the operator owns (a DaemonSet's rollout status,
//!   an operand edited or deleted by someone else).
//!
//! The same watches feed the caches a pass reads ([`watches`]), so a pass
//! issues no reads of its own. Bursts of triggers are debounced into one pass.
//!
//! Errors are retried with exponential backoff (100 ms doubling to 30 s, as
//! NVIDIA's operator does up to its cap); a pass that reports operands not
//! ready asks to be requeued after a short delay, and any other successful
//! pass runs again after [`RESYNC_PERIOD`] (it writes only what differs).
pub mod client;
pub mod control_loop;
pub mod events;
pub mod node_writes;
pub mod operand_pods;
pub mod operator_pass;
pub mod ops;
pub mod runner;
pub mod uninstall;
pub mod watches;

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{StreamExt, future};
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};

use crate::operator::clusterpolicy::ClusterPolicy;
use crate::operator::metrics::{OperatorMetrics, ReconciliationStatus};
use events::{Decision, EventPublisher};

/// Period of the resync after a successful pass. Watches can miss a change
/// (a dropped watch, an edit the operator cannot see); a slow pass repairs
/// it, and costs no writes when the cluster already matches.
pub const RESYNC_PERIOD: Duration = Duration::from_secs(300);

/// After a pass that found operands not ready, the next one waits this many
/// times the pass's own duration (at most [`MAX_PACE`]). While a large
/// rollout runs its course every change of a DaemonSet's status is a
/// trigger, and at 5,000 nodes passes ran back to back for minutes; paced,
/// the operator spends at most about a tenth of its time in passes, and a
/// rollout's end is seen at most [`MAX_PACE`] later.
pub const PACE_FACTOR: u32 = 10;

/// The longest pause [`PACE_FACTOR`] imposes.
pub const MAX_PACE: Duration = Duration::from_secs(5);

/// The pause after a pass that took `took` and reported `status`: none once
/// the operands are ready (or the pass failed: the error backoff applies).
pub fn pace_after(took: Duration, status: ReconciliationStatus) -> Duration {
    if status == ReconciliationStatus::NotReady {
        took.saturating_mul(PACE_FACTOR).min(MAX_PACE)
    } else {
        Duration::ZERO
    }
}

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
    /// When to look again even if nothing changes (operands not ready yet);
    /// `None` waits for the periodic resync ([`RESYNC_PERIOD`]).
    pub requeue_after: Option<Duration>,
}

impl PassReport {
    /// The report of a pass that found no policy to run the stack for.
    pub fn unavailable() -> Self {
        Self {
            status: ReconciliationStatus::ClusterPolicyUnavailable,
            gpu_nodes: 0,
            has_nfd_labels: false,
            applied: 0,
            unchanged: 0,
            decisions: Vec::new(),
            requeue_after: None,
        }
    }
}

/// One reconcile pass of the operator for a ClusterPolicy. Implemented over
/// the kube `Cluster` in [`crate::operator::cluster::kube_cluster`].
pub trait Pass: Send + Sync + 'static {
    /// Why a pass failed.
    type Error: std::error::Error + Send + Sync + 'static;
    /// Runs one pass for `policy`; `None` when the policy is not in charge
    /// (nothing reconciled, nothing to record).
    fn run(
        &self,
        policy: Arc<ClusterPolicy>,
    ) -> impl Future<Output = Result<Option<PassReport>, Self::Error>> + Send;
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
    /// Quiet period before a burst of triggers runs one pass.
    pub debounce: Duration,
    /// Where each pass marks itself for `/healthz` ([`ops::Progress`]).
    pub progress: ops::Progress,
}

struct Ctx<P> {
    pass: P,
    progress: ops::Progress,
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

/// Runs the controller until `shutdown` resolves. `make_pass` builds the
/// operator logic over the controller's ClusterPolicy store; `triggers`
/// (changes to nodes and owned objects) each ask for a pass.
pub async fn run_controller<P: Pass>(
    client: Client,
    settings: ControllerSettings,
    triggers: impl futures::Stream<Item = ()> + Send + 'static,
    make_pass: impl FnOnce(Store<ClusterPolicy>) -> P,
    metrics: OperatorMetrics,
    events: EventPublisher,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) -> Result<(), ControllerError> {
    let policies: Api<ClusterPolicy> = Api::all(client);
    // Fail early with a clear message rather than a watch retrying forever.
    policies
        .list_metadata(&kube::api::ListParams::default().limit(1))
        .await
        .map_err(ControllerError::CrdMissing)?;
    let controller = Controller::new(policies, watcher::Config::default().any_semantic())
        .with_config(
            ControllerConfig::default()
                .debounce(settings.debounce)
                .concurrency(1),
        );
    let ctx = Arc::new(Ctx {
        pass: make_pass(controller.store()),
        progress: settings.progress.clone(),
        metrics,
        events,
        backoff: Mutex::new(Backoff::new()),
    });
    controller
        .reconcile_all_on(triggers)
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

#[tracing::instrument(level = "debug", name = "policy_pass", skip_all, fields(policy = %policy.name_any()))]
async fn reconcile<P: Pass>(
    policy: Arc<ClusterPolicy>,
    ctx: Arc<Ctx<P>>,
) -> Result<Action, PassFailed<P::Error>> {
    let name = policy.name_any();
    let started = std::time::Instant::now();
    let in_flight = ctx.progress.begin("reconcile");
    let report = ctx.pass.run(policy).await.map_err(|source| PassFailed {
        policy: name.clone(),
        source,
    })?;
    drop(in_flight);
    if let Ok(mut backoff) = ctx.backoff.lock() {
        backoff.reset();
    }
    ctx.metrics
        .record_policy_pass(&name, report.as_ref().map(|r| r.status));
    let Some(report) = report else {
        tracing::debug!(policy = %name, "not in charge; nothing reconciled");
        // The policy in charge runs on every trigger; this one waits for a
        // change of its own (its deletion, or becoming the oldest).
        return Ok(Action::await_change());
    };
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
    // Passes run one at a time: triggers that come during the pause are
    // gathered into the next pass.
    let pause = pace_after(started.elapsed(), report.status);
    if !pause.is_zero() {
        tokio::time::sleep(pause).await;
    }
    Ok(next_action(report.requeue_after))
}

/// When to run again after a successful pass: as the pass asked, else at the
/// periodic resync.
fn next_action(requeue_after: Option<Duration>) -> Action {
    Action::requeue(requeue_after.unwrap_or(RESYNC_PERIOD))
}

fn error_policy<P: Pass>(
    policy: Arc<ClusterPolicy>,
    error: &PassFailed<P::Error>,
    ctx: Arc<Ctx<P>>,
) -> Action {
    ctx.metrics
        .record_reconcile(ReconciliationStatus::OperatorError);
    ctx.metrics.record_policy_pass(
        &policy.name_any(),
        Some(ReconciliationStatus::OperatorError),
    );
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
    use super::{
        Action, Backoff, MAX_PACE, PACE_FACTOR, RESYNC_PERIOD, ReconciliationStatus, next_action,
        pace_after,
    };
    use proptest::prelude::*;
    use std::time::Duration;

    proptest! {
        #[test]
        fn only_a_not_ready_pass_is_paced_and_never_longer_than_the_cap(ms in 0u64..100_000) {
            let took = Duration::from_millis(ms);
            let pause = pace_after(took, ReconciliationStatus::NotReady);
            prop_assert!(pause <= MAX_PACE);
            prop_assert_eq!(pause, (took * PACE_FACTOR).min(MAX_PACE));
            prop_assert_eq!(pace_after(took, ReconciliationStatus::Success), Duration::ZERO);
            prop_assert_eq!(pace_after(took, ReconciliationStatus::OperatorError), Duration::ZERO);
        }
    }

    #[test]
    fn a_successful_pass_resyncs_slowly_unless_it_asks_for_sooner() {
        assert_eq!(next_action(None), Action::requeue(RESYNC_PERIOD));
        let soon = Duration::from_secs(5);
        assert_eq!(next_action(Some(soon)), Action::requeue(soon));
    }

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
