//! The demand controller: for MigConfigs in `Demand` mode, decides which
//! selected nodes change layout so that pending pods asking for
//! `nvidia.com/mig-<profile>` can be scheduled, and records the decision in
//! `status.demand` (its own server-side apply field manager). The operator's
//! status pass then writes the decided layouts through the same path as
//! static ones: a generated per-node config in the mig-parted ConfigMap and
//! the node's `nvidia.com/mig.config` label.
//!
//! What it reads, all from watches or field-selected lists, never every pod
//! of the cluster:
//! - MigConfigs;
//! - pods the scheduler has not placed (`status.phase=Pending,spec.nodeName=`),
//!   watched only while a demand-mode MigConfig exists: without one the
//!   operator is sent none of the pods a rollout creates;
//! - per decision, the selected nodes' metadata, whose
//!   [`MIG_USAGE_ANNOTATION`] the node's MIG manager publishes (each GPU's
//!   layout and in-use instances).
//!
//! Triggers (a pending pod or a MigConfig changed) are gathered until the
//! batching window (`spec.demand.batchSeconds`) passes without one, or
//! four windows after the first; the decision is made then, and again
//! every [`RESYNC`] so that nodes the rate limit held come back. No
//! decision is made while an earlier one is still being applied, nor before
//! the pending pods have been listed once (an empty store is not "no
//! demand").
//! The decisions themselves are core's ([`gpu_stack_core::operator::migdemand`]).
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use gpu_stack_core::mig::Demand;
use gpu_stack_core::operator::labels::Labels;
use gpu_stack_core::operator::migdemand::{
    DemandNode, PendingPod, decide, decided_from, demand_node, in_flight, may_decide,
    merge_decided, pending_per_config, profile_of_resource,
};
use gpu_stack_core::operator::migusage::{self, MIG_USAGE_ANNOTATION};
use k8s_openapi::api::core::v1::{Container, Node, Pod, PodSpec};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};

use super::{DemandSettings, MAX_DEMAND_LIST, MigConfig, MigDemandNode, MigDemandStatus};
use crate::clock::unix_seconds;
use crate::operator::controller::control_loop::{Batching, LoopPass, run_loop};
use crate::operator::controller::ops::Progress;

/// Field manager of `status.demand`.
pub const FIELD_MANAGER: &str = "gpu-stack-mig-demand";

/// Field selector of the pods the controller watches: not yet placed.
pub const PENDING_SELECTOR: &str = "status.phase=Pending,spec.nodeName=";

/// A decision runs at least this often while a demand-mode MigConfig exists.
pub const RESYNC: Duration = Duration::from_secs(10);

/// Most nodes named in a status message.
const MAX_NAMED: usize = 10;

/// Why a decision could not be made or recorded.
#[derive(Debug, thiserror::Error)]
pub enum DemandError {
    /// An API call failed; the next trigger or resync retries.
    #[error("{what}: {source}; the next decision retries")]
    Api {
        /// What was being done.
        what: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

/// `nvidia.com/mig-<profile>` requests of a pod, `(resource, count)`,
/// summed over its containers (limits, else requests: extended resources
/// have both equal). Counts that are not whole numbers are left out.
pub fn pod_mig_requests(pod: &Pod) -> Vec<(String, u32)> {
    let mut out: BTreeMap<String, u32> = BTreeMap::new();
    for c in pod.spec.iter().flat_map(|s| &s.containers) {
        let Some(r) = &c.resources else { continue };
        let source = r
            .limits
            .as_ref()
            .filter(|l| !l.is_empty())
            .or(r.requests.as_ref());
        for (name, q) in source.into_iter().flatten() {
            if profile_of_resource(name).is_none() {
                continue;
            }
            if let Ok(n) = q.0.parse::<u32>() {
                let e = out.entry(name.clone()).or_default();
                *e = e.saturating_add(n);
            }
        }
    }
    out.into_iter().collect()
}

/// A pending pod reduced to what the decision reads: node selector and
/// container resources.
fn strip_pod(pod: &mut Pod) {
    pod.metadata.managed_fields = None;
    pod.metadata.annotations = None;
    pod.metadata.labels = None;
    pod.status = None;
    pod.spec = pod.spec.take().map(|s| PodSpec {
        node_name: s.node_name,
        node_selector: s.node_selector,
        containers: s
            .containers
            .into_iter()
            .map(|c| Container {
                name: c.name,
                resources: c.resources,
                ..Container::default()
            })
            .collect(),
        ..PodSpec::default()
    });
}

fn rfc3339(unix: u64) -> String {
    i64::try_from(unix)
        .ok()
        .and_then(|s| k8s_openapi::jiff::Timestamp::from_second(s).ok())
        .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH)
        .to_string()
}

fn as_map(d: &Demand) -> BTreeMap<String, u32> {
    d.iter()
        .filter(|(_, n)| *n > 0)
        .map(|(p, n)| (p.to_string(), *n))
        .take(MAX_DEMAND_LIST as usize)
        .collect()
}

fn named(nodes: &[String]) -> String {
    if nodes.len() > MAX_NAMED {
        format!(
            "{} and {} more",
            nodes[..MAX_NAMED].join(", "),
            nodes.len() - MAX_NAMED
        )
    } else {
        nodes.join(", ")
    }
}

fn demand_text(d: &BTreeMap<String, u32>) -> String {
    d.iter()
        .map(|(p, n)| format!("{n} {p}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The controller over a live cluster.
pub struct DemandController {
    client: Client,
    mig_configs: Store<MigConfig>,
}

impl DemandController {
    /// One decision over every demand-mode MigConfig, given the pods the
    /// scheduler has not placed.
    pub async fn decide_all(&self, pods: &[Arc<Pod>]) -> Result<(), DemandError> {
        let configs: Vec<Arc<MigConfig>> = self
            .mig_configs
            .state()
            .into_iter()
            .filter(|m| m.is_demand() && m.profile_problems().is_empty())
            .collect();
        if configs.is_empty() {
            return Ok(());
        }
        let pending: Vec<PendingPod> = pods
            .iter()
            .filter(|p| p.spec.as_ref().is_none_or(|s| s.node_name.is_none()))
            .map(|p| PendingPod {
                node_selector: p
                    .spec
                    .as_ref()
                    .and_then(|s| s.node_selector.clone())
                    .unwrap_or_default(),
                requests: pod_mig_requests(p),
            })
            .collect();
        let selectors: Vec<(String, Labels)> = configs
            .iter()
            .map(|m| (m.name().to_string(), m.spec.node_selector.clone()))
            .collect();
        let per = pending_per_config(&selectors, &pending);
        let now = unix_seconds();
        for m in &configs {
            let demand = per.get(m.name()).cloned().unwrap_or_default();
            self.decide_one(m, &demand, now).await?;
        }
        Ok(())
    }

    async fn decide_one(
        &self,
        m: &MigConfig,
        pending: &Demand,
        now: u64,
    ) -> Result<(), DemandError> {
        let name = m.name();
        let current = m.status.as_ref().and_then(|s| s.demand.clone());
        let old = m.decided();
        if pending.is_empty() && old.is_empty() && current.is_none() {
            return Ok(());
        }
        // The nodes the status pass holds for this MigConfig (not refused).
        let valid: BTreeSet<&str> = m
            .status
            .iter()
            .flat_map(|s| &s.nodes)
            .filter(|n| n.state != "Invalid")
            .map(|n| n.name.as_str())
            .collect();
        let selector = m
            .spec
            .node_selector
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");
        let api: Api<PartialObjectMeta<Node>> = Api::all(self.client.clone());
        let nodes = api
            .list_metadata(&ListParams::default().labels(&selector))
            .await
            .map_err(|source| DemandError::Api {
                what: format!("listing the nodes of MigConfig {name}"),
                source,
            })?;
        let mut planned: Vec<DemandNode<'static>> = Vec::new();
        let mut unreadable: Vec<String> = Vec::new();
        let mut flights: Vec<bool> = Vec::new();
        for n in &nodes.items {
            let node = n.name_any();
            if !valid.contains(node.as_str()) {
                continue;
            }
            let usage = match n.annotations().get(MIG_USAGE_ANNOTATION) {
                Some(text) => match migusage::decode(text) {
                    Ok(u) => Some(u),
                    Err(e) => {
                        tracing::warn!(node = %node, error = %e, "MIG usage annotation unreadable; node left out");
                        unreadable.push(node.clone());
                        None
                    }
                },
                None => None,
            };
            let decided = old.iter().find(|d| d.node == node);
            if let Some(u) = &usage {
                flights.push(in_flight(u, decided, n.labels(), name, now));
            }
            if let Some(d) = demand_node(&node, usage.as_ref(), decided, n.labels(), name, now) {
                planned.push(d);
            }
        }
        if !may_decide(flights.iter().copied()) {
            // Decided layouts are still being applied; decide once they are.
            return Ok(());
        }
        let selected: Vec<&str> = valid.iter().copied().collect();
        let limits = m.spec.demand.unwrap_or_default().limits();
        let pending_map = as_map(pending);
        let mut next = MigDemandStatus {
            last_decision_time: current.as_ref().and_then(|c| c.last_decision_time.clone()),
            pending: pending_map.clone(),
            nodes: current
                .as_ref()
                .map(|c| c.nodes.clone())
                .unwrap_or_default(),
            ..MigDemandStatus::default()
        };
        // Thousands of nodes make a decision long enough to hold up the
        // lease renewal on the operator's one thread: it runs beside it.
        let owned_pending = pending.clone();
        let decided =
            tokio::task::spawn_blocking(move || decide(&planned, &owned_pending, &limits, now))
                .await
                .map_err(|e| format!("the decision stopped: {e}"))
                .and_then(|r| r.map_err(|e| e.to_string()));
        match decided {
            Ok(decision) => {
                let fresh = decided_from(&decision, now);
                let merged = merge_decided(&old, &fresh, &selected);
                next.nodes = merged
                    .iter()
                    .map(|d| MigDemandNode::from_decided(name, d))
                    .collect();
                next.unmet = as_map(&decision.unmet);
                next.deferred = decision
                    .deferred
                    .iter()
                    .take(MAX_DEMAND_LIST as usize)
                    .cloned()
                    .collect();
                let changed: Vec<String> = fresh.iter().map(|d| d.node.clone()).collect();
                next.message = if !changed.is_empty() {
                    next.last_decision_time = Some(rfc3339(now));
                    format!(
                        "changed the layout of {} node(s) ({}) for pending {}",
                        changed.len(),
                        named(&changed),
                        demand_text(&pending_map)
                    )
                } else if pending_map.is_empty() {
                    "no pending pod asks for a MIG instance".into()
                } else if !next.deferred.is_empty() {
                    format!(
                        "pending {}; {} node(s) wait for the rate limit (minIntervalSeconds)",
                        demand_text(&pending_map),
                        next.deferred.len()
                    )
                } else if !next.unmet.is_empty() {
                    format!(
                        "pending {}; no layout change can serve {} now",
                        demand_text(&pending_map),
                        demand_text(&next.unmet)
                    )
                } else {
                    format!(
                        "pending {}: idle instances or decided layouts serve them; nothing changed",
                        demand_text(&pending_map)
                    )
                };
                if !unreadable.is_empty() {
                    next.message.push_str(&format!(
                        "; left out, usage unreadable: {}",
                        named(&unreadable)
                    ));
                }
                if !changed.is_empty() {
                    tracing::info!(migconfig = name, nodes = ?changed, pending = ?pending_map, "demand decision");
                }
            }
            Err(e) => {
                next.message = format!("no decision: {e}");
                tracing::warn!(migconfig = name, error = %e, "demand decision failed");
            }
        }
        if current.as_ref() == Some(&next) {
            return Ok(());
        }
        let body = serde_json::json!({
            "apiVersion": "gpustack.io/v1alpha1",
            "kind": "MigConfig",
            "status": {"demand": next},
        });
        Api::<MigConfig>::all(self.client.clone())
            .patch_status(
                name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&body),
            )
            .await
            .map_err(|source| DemandError::Api {
                what: format!("recording the demand decision of MigConfig {name}"),
                source,
            })?;
        Ok(())
    }
}

/// The shortest batching window of the demand-mode MigConfigs.
fn batch_window(configs: &Store<MigConfig>) -> Duration {
    configs
        .state()
        .iter()
        .filter(|m| m.is_demand())
        .map(|m| m.spec.demand.unwrap_or_default().batch())
        .min()
        .unwrap_or_else(|| DemandSettings::default().batch())
}

/// Whether the pending-pod watch should run: only while some MigConfig is
/// in demand mode.
fn wants_pending_pods<'a>(configs: impl IntoIterator<Item = &'a MigConfig>) -> bool {
    configs.into_iter().any(MigConfig::is_demand)
}

/// The watch of unplaced pods, held only while [`wants_pending_pods`].
struct PendingWatch {
    store: Store<Pod>,
    /// `true` for the event that ends a (re)list.
    events: BoxStream<'static, bool>,
    /// The first list has completed: the store holds every pending pod.
    listed: bool,
}

impl PendingWatch {
    fn start(client: &Client) -> Self {
        let (store, writer) = reflector::store();
        let events = watcher(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default().fields(PENDING_SELECTOR),
        )
        .default_backoff()
        .modify(strip_pod)
        .reflect(writer)
        .map(|e| matches!(e, Ok(watcher::Event::InitDone)))
        .boxed();
        PendingWatch {
            store,
            events,
            listed: false,
        }
    }
}

/// What the loop's pass sees of the pending-pod watch.
#[derive(Clone)]
struct PendingView {
    store: Store<Pod>,
    listed: bool,
}

/// The demand loop's triggers: MigConfig changes and pending-pod events.
/// It starts and stops the pending-pod watch as the MigConfigs ask
/// ([`wants_pending_pods`]) and shows the pass what the watch holds.
struct DemandTriggers {
    client: Client,
    mig_configs: Store<MigConfig>,
    mig_changes: BoxStream<'static, ()>,
    pending: Option<PendingWatch>,
    shown: Arc<std::sync::Mutex<Option<PendingView>>>,
}

impl DemandTriggers {
    /// Waits for the next trigger; `None` once the MigConfig watch ends.
    async fn next(&mut self) -> Option<()> {
        let Self {
            client,
            mig_configs,
            mig_changes,
            pending,
            shown,
        } = self;
        let pod_event = async {
            match pending.as_mut() {
                Some(w) => w.events.next().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            t = mig_changes.next() => {
                t?;
                let wanted = wants_pending_pods(mig_configs.state().iter().map(|m| &**m));
                match (wanted, pending.is_some()) {
                    (true, false) => *pending = Some(PendingWatch::start(client)),
                    (false, true) => *pending = None,
                    _ => {}
                }
            }
            e = pod_event => match e {
                Some(init_done) => {
                    if let Some(w) = pending.as_mut() {
                        w.listed |= init_done;
                    }
                }
                // A watch with backoff does not end; if it did, a new one
                // lists again rather than stopping the controller.
                None => *pending = Some(PendingWatch::start(client)),
            },
        }
        if let Ok(mut view) = shown.lock() {
            *view = pending.as_ref().map(|w| PendingView {
                store: w.store.clone(),
                listed: w.listed,
            });
        }
        Some(())
    }
}

/// The demand loop's pass ([`run_loop`]).
struct DemandPass {
    controller: DemandController,
    pending: Arc<std::sync::Mutex<Option<PendingView>>>,
}

impl LoopPass for DemandPass {
    type Error = DemandError;

    async fn run(&mut self) -> Result<Duration, DemandError> {
        // Without the watch there is no demand-mode MigConfig, so nothing
        // to decide; before its first list, wait for it.
        let view = self.pending.lock().ok().and_then(|v| v.clone());
        if let Some(v) = view.filter(|v| v.listed) {
            self.controller.decide_all(&v.store.state()).await?;
        }
        Ok(RESYNC)
    }

    fn batching(&self) -> Batching {
        let window = batch_window(&self.controller.mig_configs);
        Batching {
            quiet: window,
            at_most: window * 4,
        }
    }
}

/// Runs the demand controller until `shutdown` resolves.
pub async fn run_demand(
    client: Client,
    progress: Progress,
    shutdown: impl Future<Output = ()> + Send,
) {
    let (mig_configs, mig_writer) = reflector::store();
    let mig_changes = watcher(
        Api::<MigConfig>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .reflect(mig_writer)
    .map(|_| ())
    .boxed();
    let shown = Arc::new(std::sync::Mutex::new(None));
    let triggers = DemandTriggers {
        client: client.clone(),
        mig_configs: mig_configs.clone(),
        mig_changes,
        pending: None,
        shown: shown.clone(),
    };
    let triggers = futures::stream::unfold(triggers, |mut t| async move {
        t.next().await.map(|trigger| (trigger, t))
    });
    let pass = DemandPass {
        controller: DemandController {
            client,
            mig_configs,
        },
        pending: shown,
    };
    run_loop("mig-demand", pass, triggers, progress, shutdown).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mig_config(name: &str, mode: &str, deleting: bool) -> MigConfig {
        let mut meta = serde_json::json!({"name": name});
        if deleting {
            meta["deletionTimestamp"] = "2026-01-01T00:00:00Z".into();
        }
        serde_json::from_value(serde_json::json!({
            "apiVersion": "gpustack.io/v1alpha1",
            "kind": "MigConfig",
            "metadata": meta,
            "spec": {"mode": mode, "layouts": [{"config": "all-1g.10gb"}]},
        }))
        .unwrap()
    }

    /// A cluster without a demand-mode MigConfig sends the operator none
    /// of its pending pods: the watch runs only while one exists.
    #[test]
    fn pending_pods_are_watched_only_while_a_demand_mig_config_exists() {
        let fixed = mig_config("fixed", "Static", false);
        let demand = mig_config("on-demand", "Demand", false);
        let leaving = mig_config("leaving", "Demand", true);
        assert!(!wants_pending_pods([]));
        assert!(!wants_pending_pods([&fixed]));
        assert!(!wants_pending_pods([&fixed, &leaving]));
        assert!(wants_pending_pods([&fixed, &demand]));
    }

    #[test]
    fn mig_requests_sum_over_containers_and_skip_other_resources() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {"containers": [
                {"name": "a", "resources": {"limits": {"nvidia.com/mig-1g.10gb": "2", "cpu": "1"}}},
                {"name": "b", "resources": {"requests": {"nvidia.com/mig-1g.10gb": "1", "nvidia.com/mig-3g.40gb": "1"}}},
                {"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/mig-2g.20gb": "500m"}}},
            ]},
        }))
        .unwrap();
        assert_eq!(
            pod_mig_requests(&pod),
            vec![
                ("nvidia.com/mig-1g.10gb".to_string(), 3),
                ("nvidia.com/mig-3g.40gb".to_string(), 1)
            ]
        );
        let mut stripped = pod.clone();
        strip_pod(&mut stripped);
        assert_eq!(pod_mig_requests(&stripped), pod_mig_requests(&pod));
    }
}
