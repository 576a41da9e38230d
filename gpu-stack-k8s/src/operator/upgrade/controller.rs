//! The upgrade loop of the operator process: one pass when the ClusterPolicy
//! or a driver DaemonSet or revision changes, soon again while nodes are
//! mid-upgrade, and every two minutes regardless (NVIDIA's planned requeue).
//! A pass reads the watch caches ([`UpgradeStores`]); its only reads of the
//! API server are the pods of the few nodes whose step looks at them.
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::time::Duration;

use futures::stream::BoxStream;
use futures::{StreamExt, stream};
use gpu_stack_core::operator::nvidiadriver::OWNER_LABEL;
use gpu_stack_core::operator::upgrade::abandon::wind_down;
use gpu_stack_core::operator::upgrade::pass::{
    NodeObservation, PassOptions, UpgradeGroup, UpgradePlan, plan_groups, stuck_in_groups,
};
use gpu_stack_core::operator::upgrade::policy::UpgradePolicy;
use gpu_stack_core::operator::upgrade::state::{UpgradeMarks, UpgradeState};
use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod};
use kube::api::{DeleteParams, EvictParams, ListParams, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use super::apply::{NodeWork, node_work, wind_down_patch};
use super::observe::{
    ObserveError, PodSelectors, daemonset_revisions, needs_node_pods, observe_nodes, sort_node_pods,
};
use super::watches::UpgradeStores;
use super::{FIELD_MANAGER, UpgradeError, upgrade_status};
use crate::clock::unix_seconds;
use crate::operator::clusterpolicy::ClusterPolicy;
use crate::operator::clusterpolicy::status::DriverUpgradeStatus;
use crate::operator::controller::control_loop::{Batching, LoopPass, run_loop};
use crate::operator::controller::events::{Announced, Decision, EventPublisher, Severity};
use crate::operator::controller::node_writes::NodeWriteFence;
use crate::operator::controller::ops::Progress;
use crate::operator::controller::watches::policies_in;
use crate::operator::desired::active_policy;
use crate::operator::metrics::OperatorMetrics;
use crate::operator::nvidiadriver::NvidiaDriver;

/// NVIDIA's planned requeue: a pass at least this often.
pub const IDLE_INTERVAL: Duration = Duration::from_secs(120);
/// The next pass while a node waits on something outside the operator
/// (pods terminating, the validator).
pub const BUSY_INTERVAL: Duration = Duration::from_secs(5);
/// The next pass after one that changed something: the flow moves each node
/// one state per pass, so the next step is usually ready at once.
pub const CHANGED_INTERVAL: Duration = Duration::from_secs(1);
/// How long a trigger waits for its pass (the burst it starts is one pass).
pub const DEBOUNCE: Duration = Duration::from_millis(300);
/// Nodes written at once.
pub const WRITE_CONCURRENCY: usize = 8;
/// How long a pass waits for the node cache to show this controller's own
/// node writes: a pass that decided from older labels could hand out an
/// upgrade slot the previous pass already gave.
pub const NODE_WRITES_CATCH_UP: Duration = Duration::from_secs(10);

/// Settings of the upgrade loop.
#[derive(Debug, Clone)]
pub struct UpgradeSettings {
    /// Namespace of the driver DaemonSets and the validator.
    pub namespace: String,
    /// A node waiting in one state longer than this is reported stuck.
    pub stuck_after: Duration,
}

/// What one pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PassSummary {
    /// Managed nodes.
    pub nodes: usize,
    /// Nodes patched.
    pub patched: usize,
    /// Pods evicted (accepted by the API server).
    pub evicted: usize,
    /// Evictions a disruption budget refused (retried next pass).
    pub eviction_blocked: usize,
    /// Driver pods deleted.
    pub driver_pods_deleted: usize,
    /// Nodes that are between `upgrade-required` and done.
    pub busy: bool,
    /// API read requests the pass made (the caches answer everything but
    /// the pods of nodes whose step looks at them).
    pub reads: usize,
}

impl PassSummary {
    /// When to run the next pass, absent triggers.
    pub fn next_in(&self) -> Duration {
        if self.patched + self.evicted + self.driver_pods_deleted > 0 {
            CHANGED_INTERVAL
        } else if self.busy {
            BUSY_INTERVAL
        } else {
            IDLE_INTERVAL
        }
    }
}

/// The upgrade controller over a live cluster.
pub struct UpgradeController {
    client: Client,
    stores: UpgradeStores,
    node_writes: NodeWriteFence,
    settings: UpgradeSettings,
    metrics: OperatorMetrics,
    events: EventPublisher,
    announced: Announced,
}

fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

impl UpgradeController {
    /// The controller for operands in `settings.namespace`, reading `stores`
    /// (started with [`UpgradeStores::start`] for that namespace).
    pub fn new(
        client: Client,
        stores: UpgradeStores,
        settings: UpgradeSettings,
        metrics: OperatorMetrics,
        events: EventPublisher,
    ) -> Self {
        Self {
            client,
            node_writes: NodeWriteFence::new(stores.nodes.clone()),
            stores,
            settings,
            metrics,
            events,
            announced: Announced::new(),
        }
    }

    async fn list<K>(
        &self,
        api: &Api<K>,
        params: &ListParams,
        what: &str,
    ) -> Result<Vec<K>, UpgradeError>
    where
        K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        api.list(params)
            .await
            .map(|l| l.items)
            .map_err(|source| UpgradeError::Api {
                during: format!("listing {what}"),
                source,
            })
    }

    /// One pass: read the caches, plan, write.
    pub async fn pass(&mut self) -> Result<PassSummary, UpgradeError> {
        let mut summary = PassSummary::default();
        self.stores.wait_until_synced().await?;
        self.node_writes
            .catch_up(NODE_WRITES_CATCH_UP, "the driver upgrade controller")
            .await;
        let all = policies_in(&self.stores.policies);
        let Some(policy) = active_policy(&all).cloned() else {
            self.wind_down_all(&mut summary).await?;
            self.metrics.driver_auto_upgrade_enabled.set(0);
            return Ok(summary);
        };
        if policy.metadata.deletion_timestamp.is_some() {
            return Ok(summary);
        }
        let policies = self.policies(&policy, &mut summary).await?;
        let auto_upgrade = policies.values().flatten().any(|p| p.auto_upgrade);
        self.metrics
            .driver_auto_upgrade_enabled
            .set(i64::from(auto_upgrade));
        if !auto_upgrade {
            self.wind_down_all(&mut summary).await?;
            self.write_status(&policy, None).await?;
            return Ok(summary);
        }
        let revisions = match daemonset_revisions(
            &self.stores.daemonsets.state(),
            &self.stores.revisions.state(),
        ) {
            Ok(r) => r,
            Err(e @ ObserveError::DaemonSetNotObserved { .. }) => {
                tracing::debug!(%e, "upgrade pass deferred");
                summary.busy = true;
                return Ok(summary);
            }
            Err(e) => return Err(e.into()),
        };
        let nodes = self.stores.nodes.state();
        let driver_pods = self.stores.driver_pods.state();
        let validators = self.stores.validator_pods.state();
        let observed = observe_nodes(&nodes, &revisions, &driver_pods, &validators);
        for (node, why) in &observed.skipped {
            tracing::warn!(%node, %why, "node left out of the upgrade pass");
        }
        let owners: BTreeMap<String, String> = nodes
            .iter()
            .filter_map(|n| Some((n.name_any(), n.labels().get(OWNER_LABEL)?.clone())))
            .collect();
        let mut groups = group_nodes(observed.nodes, &owners, &policies);
        let all_pods: Api<Pod> = Api::all(self.client.clone());
        let mut terminating = BTreeSet::new();
        let empty = BTreeSet::new();
        for g in &mut groups {
            let selectors = PodSelectors::new(&g.policy)?;
            for n in g
                .nodes
                .iter_mut()
                .filter(|n| needs_node_pods(n.marks.state))
            {
                let params = ListParams::default().fields(&format!(
                    "spec.nodeName={},status.phase!=Succeeded,status.phase!=Failed",
                    n.name
                ));
                let pods = self.list(&all_pods, &params, "pods of a node").await?;
                summary.reads += 1;
                let sorted = sort_node_pods(
                    &pods,
                    &selectors,
                    observed.driver_pods.get(&n.name).unwrap_or(&empty),
                );
                n.gpu_pods = sorted.gpu;
                n.wait_pods = sorted.wait;
                n.drain_pods = sorted.drain;
                terminating.extend(sorted.terminating);
            }
        }
        let now = unix_seconds();
        let opts = PassOptions::default();
        let plan = plan_groups(&groups, now, &opts)?;
        let stuck = stuck_in_groups(&groups, now, self.settings.stuck_after.as_secs(), &opts)?;
        summary.nodes = groups.iter().map(|g| g.nodes.len()).sum();
        summary.busy = plan
            .decisions
            .iter()
            .any(|d| !matches!(d.next, UpgradeState::Unknown | UpgradeState::Done));
        self.record_counts(&plan);
        self.apply(&plan, &terminating, &mut summary).await;
        let status = upgrade_status(auto_upgrade, &plan, &stuck, now);
        self.write_status(&policy, Some(status)).await?;
        self.publish_stuck(&stuck).await;
        Ok(summary)
    }

    /// The upgrade policy of each group of nodes: the ClusterPolicy's for
    /// every node (key `None`), or with NVIDIADrivers each resource's for
    /// the nodes it owns (key: its name), as NVIDIA upgrades per resource.
    /// A resource whose policy is refused maps to `None`: its nodes are left
    /// as they are (its status says why).
    async fn policies(
        &self,
        policy: &ClusterPolicy,
        summary: &mut PassSummary,
    ) -> Result<Policies, UpgradeError> {
        if !policy.spec.uses_nvidia_driver_crd() {
            let p = policy.spec.upgrade_policy().cloned().unwrap_or_default();
            return Ok(BTreeMap::from([(None, Some(p))]));
        }
        let api: Api<NvidiaDriver> = Api::all(self.client.clone());
        summary.reads += 1;
        let drivers = match api.list(&ListParams::default()).await {
            Ok(l) => l.items,
            Err(e) if is_status(&e, 404) => Vec::new(),
            Err(source) => {
                return Err(UpgradeError::Api {
                    during: "listing NVIDIADrivers".into(),
                    source,
                });
            }
        };
        Ok(drivers
            .iter()
            .filter(|d| !d.is_deleting())
            .map(|d| {
                let p = d.spec.upgrade_policy();
                let usable = !p.auto_upgrade || p.validate().is_empty();
                (Some(d.name().to_string()), usable.then_some(p))
            })
            .collect())
    }

    fn record_counts(&self, plan: &UpgradePlan) {
        let c = &plan.counts;
        let m = &self.metrics;
        let g = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
        m.nodes_upgrades_in_progress.set(g(c.in_progress));
        m.nodes_upgrades_done.set(g(c.done));
        m.nodes_upgrades_failed.set(g(c.failed));
        m.nodes_upgrades_pending.set(g(c.pending));
        m.nodes_upgrades_available.set(c.available);
    }

    async fn apply(
        &self,
        plan: &UpgradePlan,
        terminating: &BTreeSet<(String, String)>,
        summary: &mut PassSummary,
    ) {
        let work: Vec<NodeWork> = plan
            .decisions
            .iter()
            .filter(|d| d.has_changes())
            .map(|d| {
                if d.from != d.next {
                    tracing::info!(node = %d.node, from = %d.from.as_label(), to = %d.next.as_label(), reason = %d.reason, "driver upgrade");
                }
                node_work(d, terminating)
            })
            .filter(|w| !w.is_empty())
            .collect();
        let results: Vec<NodeOutcome> = stream::iter(work)
            .map(|w| self.apply_node(w))
            .buffer_unordered(WRITE_CONCURRENCY)
            .collect()
            .await;
        for r in results {
            summary.patched += usize::from(r.patched);
            summary.evicted += r.evicted;
            summary.eviction_blocked += r.blocked;
            summary.driver_pods_deleted += r.deleted;
        }
    }

    async fn apply_node(&self, w: NodeWork) -> NodeOutcome {
        let mut out = NodeOutcome::default();
        if let Some(patch) = &w.patch {
            match self.patch_node(&w.node, patch).await {
                Ok(()) => out.patched = true,
                Err(error) => {
                    // The pod work follows the state written; without it, wait.
                    tracing::warn!(node = %w.node, %error, "cannot patch node for the driver upgrade; retried next pass");
                    return out;
                }
            }
        }
        for p in &w.evict {
            let api: Api<Pod> = Api::namespaced(self.client.clone(), &p.namespace);
            match api.evict(&p.name, &EvictParams::default()).await {
                Ok(_) => out.evicted += 1,
                Err(e) if is_status(&e, 404) => {}
                Err(e) if is_status(&e, 429) => {
                    tracing::debug!(pod = %p, "eviction refused by a disruption budget; retried next pass");
                    out.blocked += 1;
                }
                Err(error) => {
                    tracing::warn!(pod = %p, %error, "cannot evict pod; retried next pass")
                }
            }
        }
        for (ns, name) in &w.delete {
            let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
            match api.delete(name, &DeleteParams::default()).await {
                Ok(_) => out.deleted += 1,
                Err(e) if is_status(&e, 404) => {}
                Err(error) => {
                    tracing::warn!(pod = %format!("{ns}/{name}"), %error, "cannot delete driver pod; retried next pass")
                }
            }
        }
        out
    }

    /// Winds every node's upgrade down: with automatic upgrades off or no
    /// policy in charge nobody finishes them. Nodes the flow cordoned are
    /// uncordoned, its labels and annotations removed, and each node whose
    /// upgrade was under way gets an Event saying what was undone.
    async fn wind_down_all(&mut self, summary: &mut PassSummary) -> Result<(), UpgradeError> {
        let mut undone = Vec::new();
        for node in self.stores.nodes.state().iter() {
            // A state label that is no state still goes.
            let marks = UpgradeMarks::read(node.labels(), node.annotations()).unwrap_or_default();
            let Some(w) = wind_down(
                &marks,
                node.unschedulable,
                node.labels(),
                node.annotations(),
            ) else {
                continue;
            };
            let name = node.name_any();
            match self.patch_node(&name, &wind_down_patch(&w)).await {
                Ok(()) => summary.patched += 1,
                Err(e) if is_status(&e, 404) => continue,
                Err(source) => {
                    return Err(UpgradeError::Api {
                        during: format!("winding down the driver upgrade of node {name}"),
                        source,
                    });
                }
            }
            if marks.state.in_progress() {
                tracing::info!(node = %name, uncordoned = w.uncordon, "{}", w.note);
                undone.push((
                    ObjectReference {
                        api_version: Some("v1".into()),
                        kind: Some("Node".into()),
                        name: Some(name),
                        uid: node.uid(),
                        ..ObjectReference::default()
                    },
                    Decision {
                        severity: Severity::Normal,
                        reason: "DriverUpgradeAbandoned".into(),
                        note: w.note,
                        action: "Upgrade".into(),
                    },
                ));
            }
        }
        for (regarding, decision) in undone {
            self.events.publish(&regarding, &decision).await;
        }
        Ok(())
    }

    /// A merge patch of a node, recorded so the next pass waits for the
    /// node cache to show it.
    async fn patch_node(&self, name: &str, patch: &serde_json::Value) -> Result<(), kube::Error> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        nodes
            .patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await?;
        self.node_writes.wrote(name, patch);
        Ok(())
    }

    /// Writes `status.driverUpgrade` when it differs (server-side apply under
    /// the upgrade controller's own field manager; `None` removes it).
    async fn write_status(
        &self,
        policy: &ClusterPolicy,
        status: Option<DriverUpgradeStatus>,
    ) -> Result<(), UpgradeError> {
        // Before the reconcile pass wrote the status there is no `state`,
        // which the schema requires: wait for it.
        let Some(current) = policy.status.as_ref() else {
            return Ok(());
        };
        if current.driver_upgrade.as_ref() == status.as_ref() {
            return Ok(());
        }
        let api: Api<ClusterPolicy> = Api::all(self.client.clone());
        let body = json!({
            "apiVersion": "nvidia.com/v1",
            "kind": "ClusterPolicy",
            "status": match &status {
                Some(s) => json!({"driverUpgrade": s}),
                None => json!({}),
            },
        });
        api.patch_status(
            &policy.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await
        .map(|_| ())
        .or_else(|e| if is_status(&e, 404) { Ok(()) } else { Err(e) })
        .map_err(|source| UpgradeError::Api {
            during: format!(
                "writing status.driverUpgrade of ClusterPolicy {}",
                policy.name_any()
            ),
            source,
        })
    }

    async fn publish_stuck(
        &mut self,
        stuck: &[gpu_stack_core::operator::upgrade::pass::StuckNode],
    ) {
        let all: Vec<(ObjectReference, Decision)> = stuck
            .iter()
            .map(|s| {
                (
                    ObjectReference {
                        api_version: Some("v1".into()),
                        kind: Some("Node".into()),
                        name: Some(s.node.clone()),
                        ..ObjectReference::default()
                    },
                    Decision {
                        severity: Severity::Warning,
                        reason: "DriverUpgradeStuck".into(),
                        note: format!(
                            "node {} is in driver upgrade state {} for over {} s: {}",
                            s.node,
                            s.state.as_label(),
                            self.settings.stuck_after.as_secs(),
                            s.waiting_for
                        ),
                        action: "Upgrade".into(),
                    },
                )
            })
            .collect();
        for (regarding, decision) in self.announced.fresh(all) {
            self.events.publish(&regarding, &decision).await;
        }
    }
}

/// Upgrade policies by group: `None` for the ClusterPolicy's, else an
/// NVIDIADriver's name; a `None` value leaves the group's nodes alone.
pub type Policies = BTreeMap<Option<String>, Option<UpgradePolicy>>;

/// Splits the observed nodes into one group per policy: every node under
/// the ClusterPolicy's (key `None`), or each node under the policy of the
/// NVIDIADriver its owner label names. A node whose owner has no entry (no
/// label, a deleted resource) gets automatic upgrades off, which removes its
/// state label; one whose owner's policy is refused is left out.
pub fn group_nodes(
    nodes: Vec<NodeObservation>,
    owners: &BTreeMap<String, String>,
    policies: &Policies,
) -> Vec<UpgradeGroup> {
    let shared = policies.contains_key(&None);
    let mut by_key: BTreeMap<Option<String>, Vec<NodeObservation>> = BTreeMap::new();
    let mut orphans = Vec::new();
    for n in nodes {
        let key = if shared {
            None
        } else {
            match owners.get(&n.name).map(|o| Some(o.clone())) {
                Some(k) if policies.contains_key(&k) => k,
                _ => {
                    orphans.push(n);
                    continue;
                }
            }
        };
        by_key.entry(key).or_default().push(n);
    }
    let mut out: Vec<UpgradeGroup> = by_key
        .into_iter()
        .filter_map(|(key, nodes)| {
            let policy = policies.get(&key).cloned().flatten()?;
            Some(UpgradeGroup { policy, nodes })
        })
        .collect();
    if !orphans.is_empty() {
        out.push(UpgradeGroup {
            policy: UpgradePolicy::default(),
            nodes: orphans,
        });
    }
    out
}

#[derive(Debug, Default)]
struct NodeOutcome {
    patched: bool,
    evicted: usize,
    blocked: usize,
    deleted: usize,
}

/// One pass of the upgrade loop ([`run_loop`]): the flow's pass, logged
/// when it changed something; the next one as [`PassSummary::next_in`] says.
impl LoopPass for UpgradeController {
    type Error = UpgradeError;

    async fn run(&mut self) -> Result<Duration, UpgradeError> {
        let started = std::time::Instant::now();
        let s = self.pass().await?;
        if s.patched + s.evicted + s.driver_pods_deleted + s.eviction_blocked > 0 {
            tracing::info!(
                nodes = s.nodes,
                patched = s.patched,
                evicted = s.evicted,
                eviction_blocked = s.eviction_blocked,
                driver_pods_deleted = s.driver_pods_deleted,
                reads = s.reads,
                took_ms = started.elapsed().as_millis() as u64,
                "driver upgrade pass"
            );
        }
        Ok(s.next_in())
    }

    fn batching(&self) -> Batching {
        Batching {
            quiet: DEBOUNCE,
            at_most: DEBOUNCE,
        }
    }
}

/// Runs the upgrade loop until `shutdown` resolves; `triggers` is the
/// stream [`UpgradeStores::start`] returned with the controller's stores.
pub async fn run_upgrades(
    controller: UpgradeController,
    triggers: BoxStream<'static, ()>,
    progress: Progress,
    shutdown: impl Future<Output = ()> + Send,
) {
    run_loop("driver-upgrade", controller, triggers, progress, shutdown).await;
}
