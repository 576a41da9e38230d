//! Builds the pure pass's [`NodeObservation`]s from what the API server
//! lists: nodes, the driver DaemonSets and their ControllerRevisions, the
//! driver and validator pods, and the pods of the nodes whose state looks at
//! their workload.
use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use gpu_stack_core::operator::upgrade::pass::{
    DriverPodObservation, NodeObservation, PodRef, ValidatorStatus,
};
use gpu_stack_core::operator::upgrade::policy::UpgradePolicy;
use gpu_stack_core::operator::upgrade::selector::LabelSelector;
use gpu_stack_core::operator::upgrade::state::{
    DRIVER_POD_FAILING_RESTARTS, STATE_LABEL, UpgradeMarks, UpgradeState,
};
use k8s_openapi::api::apps::v1::{ControllerRevision, DaemonSet};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::watches::WatchedPod;
use crate::operator::controller::watches::WatchedNode;

/// The label the DaemonSet controller puts on every pod (and revision) with
/// the hash of the template it was created from.
pub const REVISION_HASH_LABEL: &str = "controller-revision-hash";

/// Resource name prefixes that make a pod a GPU pod (NVIDIA's `gpuPodSpecFilter`).
pub const GPU_RESOURCE_PREFIXES: [&str; 2] = ["nvidia.com/gpu", "nvidia.com/mig-"];

/// Why the observations of a pass could not be built.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ObserveError {
    /// A driver DaemonSet's controller has not caught up with its spec, so
    /// its newest revision is not known yet.
    #[error(
        "driver DaemonSet {name} has not observed generation {generation} yet; the upgrade pass waits for its controller"
    )]
    DaemonSetNotObserved {
        /// DaemonSet name.
        name: String,
        /// Its generation.
        generation: i64,
    },
    /// A selector of the upgrade policy does not parse.
    #[error("spec.driver.upgradePolicy.{field}: {message}")]
    Selector {
        /// The policy field.
        field: &'static str,
        /// The parse error.
        message: String,
    },
}

/// The newest revision hash of each driver DaemonSet, by DaemonSet uid.
///
/// The DaemonSet controller keeps one ControllerRevision per template it has
/// run, owned by the DaemonSet; the one with the highest `revision` is the
/// current template, and its `controller-revision-hash` label is what the
/// pods created from it carry. A DaemonSet whose status has not observed its
/// generation may not have its newest revision yet: that is an error, and
/// the pass is retried shortly.
pub fn daemonset_revisions<D, R>(
    sets: &[D],
    revisions: &[R],
) -> Result<BTreeMap<String, String>, ObserveError>
where
    D: Borrow<DaemonSet>,
    R: Borrow<ControllerRevision>,
{
    let mut out = BTreeMap::new();
    for ds in sets {
        let ds = ds.borrow();
        let Some(uid) = ds.uid() else { continue };
        let generation = ds.metadata.generation.unwrap_or(0);
        let observed = ds
            .status
            .as_ref()
            .and_then(|s| s.observed_generation)
            .unwrap_or(0);
        if observed < generation {
            return Err(ObserveError::DaemonSetNotObserved {
                name: ds.name_any(),
                generation,
            });
        }
        let newest = revisions
            .iter()
            .map(Borrow::borrow)
            .filter(|r: &&ControllerRevision| r.owner_references().iter().any(|o| o.uid == uid))
            .max_by_key(|r| r.revision)
            .and_then(|r| r.labels().get(REVISION_HASH_LABEL).cloned());
        if let Some(hash) = newest {
            out.insert(uid, hash);
        }
    }
    Ok(out)
}

/// What the upgrade flow reads of a driver or validator pod: a [`Pod`] as
/// listed, or a [`WatchedPod`] from the caches.
pub trait PodView {
    /// Namespace.
    fn pod_namespace(&self) -> &str;
    /// Name.
    fn pod_name(&self) -> &str;
    /// The node it is bound to.
    fn node(&self) -> Option<&str>;
    /// Phase (`Running`, ...), empty when unknown.
    fn phase(&self) -> &str;
    /// Each container's readiness and restart count.
    fn containers(&self) -> impl Iterator<Item = (bool, i32)> + '_;
    /// Its `controller-revision-hash` label.
    fn revision(&self) -> Option<&str>;
    /// Kind and UID of its controller.
    fn controller(&self) -> Option<(&str, &str)>;
    /// Whether its deletion has begun.
    fn terminating(&self) -> bool;
}

impl PodView for Pod {
    fn pod_namespace(&self) -> &str {
        self.metadata.namespace.as_deref().unwrap_or_default()
    }

    fn pod_name(&self) -> &str {
        self.metadata.name.as_deref().unwrap_or_default()
    }

    fn node(&self) -> Option<&str> {
        self.spec.as_ref().and_then(|s| s.node_name.as_deref())
    }

    fn phase(&self) -> &str {
        self.status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .unwrap_or("")
    }

    fn containers(&self) -> impl Iterator<Item = (bool, i32)> + '_ {
        self.status
            .iter()
            .flat_map(|s| s.container_statuses.iter().flatten())
            .map(|c| (c.ready, c.restart_count))
    }

    fn revision(&self) -> Option<&str> {
        self.labels().get(REVISION_HASH_LABEL).map(String::as_str)
    }

    fn controller(&self) -> Option<(&str, &str)> {
        self.owner_references()
            .iter()
            .find(|o| o.controller == Some(true))
            .map(|o| (o.kind.as_str(), o.uid.as_str()))
    }

    fn terminating(&self) -> bool {
        self.metadata.deletion_timestamp.is_some()
    }
}

impl PodView for WatchedPod {
    fn pod_namespace(&self) -> &str {
        &self.namespace
    }

    fn pod_name(&self) -> &str {
        &self.name
    }

    fn node(&self) -> Option<&str> {
        self.node.as_deref()
    }

    fn phase(&self) -> &str {
        &self.phase
    }

    fn containers(&self) -> impl Iterator<Item = (bool, i32)> + '_ {
        self.containers.iter().copied()
    }

    fn revision(&self) -> Option<&str> {
        self.revision.as_deref()
    }

    fn controller(&self) -> Option<(&str, &str)> {
        self.controller
            .as_ref()
            .map(|(k, u)| (k.as_str(), u.as_str()))
    }

    fn terminating(&self) -> bool {
        self.terminating
    }
}

impl<T: PodView> PodView for Arc<T> {
    fn pod_namespace(&self) -> &str {
        T::pod_namespace(self)
    }

    fn pod_name(&self) -> &str {
        T::pod_name(self)
    }

    fn node(&self) -> Option<&str> {
        T::node(self)
    }

    fn phase(&self) -> &str {
        T::phase(self)
    }

    fn containers(&self) -> impl Iterator<Item = (bool, i32)> + '_ {
        T::containers(self)
    }

    fn revision(&self) -> Option<&str> {
        T::revision(self)
    }

    fn controller(&self) -> Option<(&str, &str)> {
        T::controller(self)
    }

    fn terminating(&self) -> bool {
        T::terminating(self)
    }
}

/// Running with every container Ready.
pub fn pod_ready(pod: &impl PodView) -> bool {
    let mut containers = pod.containers().peekable();
    pod.phase() == "Running" && containers.peek().is_some() && containers.all(|(ready, _)| ready)
}

fn pod_failing(pod: &impl PodView) -> bool {
    let limit = i32::try_from(DRIVER_POD_FAILING_RESTARTS).unwrap_or(i32::MAX);
    pod.containers()
        .any(|(ready, restarts)| !ready && restarts > limit)
}

/// The driver pod of each node: its pod that is not terminating if there is
/// one (a replacement may already run next to the old one), else the
/// terminating one.
fn driver_pods_by_node<P: PodView>(pods: &[P]) -> BTreeMap<&str, &P> {
    let mut out: BTreeMap<&str, &P> = BTreeMap::new();
    for pod in pods {
        let Some(node) = pod.node() else { continue };
        match out.get(node) {
            Some(seen) if !seen.terminating() || pod.terminating() => {}
            _ => {
                out.insert(node, pod);
            }
        }
    }
    out
}

fn driver_observation(
    pod: &impl PodView,
    revisions: &BTreeMap<String, String>,
) -> DriverPodObservation {
    let owner = pod.controller().filter(|(kind, _)| *kind == "DaemonSet");
    DriverPodObservation {
        namespace: pod.pod_namespace().to_string(),
        name: pod.pod_name().to_string(),
        revision: pod.revision().unwrap_or_default().to_string(),
        daemonset_revision: owner.and_then(|(_, uid)| revisions.get(uid).cloned()),
        ready: pod_ready(pod),
        terminating: pod.terminating(),
        failing: pod_failing(pod),
        missing: false,
    }
}

fn validator_status<P: PodView>(pods: &[&P]) -> ValidatorStatus {
    if pods.is_empty() {
        ValidatorStatus::Absent
    } else if pods.iter().all(|p| pod_ready(*p)) {
        ValidatorStatus::Ready
    } else {
        ValidatorStatus::NotReady
    }
}

/// Whether a pod asks for a GPU: a container (init containers included)
/// whose limits or requests name `nvidia.com/gpu*` or `nvidia.com/mig-*`.
pub fn uses_gpu(pod: &Pod) -> bool {
    let Some(spec) = &pod.spec else { return false };
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .filter_map(|c| c.resources.as_ref())
        .flat_map(|r| {
            r.limits
                .iter()
                .chain(r.requests.iter())
                .flat_map(|m| m.keys())
        })
        .any(|k| GPU_RESOURCE_PREFIXES.iter().any(|p| k.starts_with(p)))
}

/// The [`PodRef`] of a pod: what `kubectl drain` looks at.
pub fn pod_ref(pod: &Pod) -> PodRef {
    let controller = pod
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true));
    PodRef {
        namespace: pod.namespace().unwrap_or_default(),
        name: pod.name_any(),
        controlled: controller.is_some(),
        daemon_set: controller.is_some_and(|o| o.kind == "DaemonSet"),
        empty_dir: pod
            .spec
            .as_ref()
            .and_then(|s| s.volumes.as_ref())
            .is_some_and(|vs| vs.iter().any(|v| v.empty_dir.is_some())),
    }
}

fn selector(field: &'static str, text: &str) -> Result<Option<LabelSelector>, ObserveError> {
    if text.trim().is_empty() {
        return Ok(None);
    }
    LabelSelector::parse(text)
        .map(Some)
        .map_err(|e| ObserveError::Selector {
            field,
            message: e.to_string(),
        })
}

/// The selectors the policy sorts a node's pods with.
#[derive(Debug, Clone)]
pub struct PodSelectors {
    deletion: Option<LabelSelector>,
    wait: Option<LabelSelector>,
    drain: Option<LabelSelector>,
}

impl PodSelectors {
    /// Parses the policy's `podDeletion`, `waitForCompletion` and drain selectors.
    pub fn new(policy: &UpgradePolicy) -> Result<PodSelectors, ObserveError> {
        Ok(PodSelectors {
            deletion: selector("podDeletion.podSelector", &policy.pod_deletion.pod_selector)?,
            wait: selector(
                "waitForCompletion.podSelector",
                &policy.wait_for_completion.pod_selector,
            )?,
            drain: if policy.drain.enable {
                selector("drain.podSelector", &policy.drain_selector())?
            } else {
                None
            },
        })
    }
}

/// The states whose step looks at the node's pods: only nodes in these get
/// their pods listed.
pub fn needs_node_pods(state: UpgradeState) -> bool {
    matches!(
        state,
        UpgradeState::WaitForJobsRequired
            | UpgradeState::PodDeletionRequired
            | UpgradeState::DrainRequired
    )
}

/// A node's workload, sorted by what the pass does with it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodePods {
    /// GPU pods (and those `podDeletion.podSelector` selects).
    pub gpu: Vec<PodRef>,
    /// Pods `waitForCompletion.podSelector` selects.
    pub wait: Vec<PodRef>,
    /// Pods the drain selects.
    pub drain: Vec<PodRef>,
    /// Pods already being deleted (never evicted again).
    pub terminating: BTreeSet<(String, String)>,
}

/// Sorts the pods of one node (Running and Pending ones count; `driver`
/// names the node's driver pods, which are never workload).
pub fn sort_node_pods(
    pods: &[Pod],
    selectors: &PodSelectors,
    driver: &BTreeSet<String>,
) -> NodePods {
    let mut out = NodePods::default();
    for pod in pods {
        let ph = pod.phase();
        if ph == "Succeeded" || ph == "Failed" {
            continue;
        }
        if driver.contains(&pod.name_any())
            || pod
                .annotations()
                .contains_key("kubernetes.io/config.mirror")
        {
            continue;
        }
        let labels = pod.labels();
        let r = pod_ref(pod);
        if pod.metadata.deletion_timestamp.is_some() {
            out.terminating
                .insert((r.namespace.clone(), r.name.clone()));
        }
        let active = ph == "Running" || ph == "Pending";
        if active
            && (uses_gpu(pod)
                || selectors
                    .deletion
                    .as_ref()
                    .is_some_and(|s| s.matches(labels)))
        {
            out.gpu.push(r.clone());
        }
        if active && selectors.wait.as_ref().is_some_and(|s| s.matches(labels)) {
            out.wait.push(r.clone());
        }
        if !r.daemon_set && selectors.drain.as_ref().is_some_and(|s| s.matches(labels)) {
            out.drain.push(r);
        }
    }
    out
}

/// What the first phase of observation found: the managed nodes, plus the
/// nodes left out with the reason.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Observed {
    /// Managed nodes (with a driver pod), sorted by name; pods not filled in.
    pub nodes: Vec<NodeObservation>,
    /// Nodes with a driver pod that the pass leaves alone, with why.
    pub skipped: Vec<(String, String)>,
    /// The driver pod names per node (old and new), so they are never
    /// counted as workload.
    pub driver_pods: BTreeMap<String, BTreeSet<String>>,
}

/// Observations of every node that runs a pod of a driver DaemonSet, and
/// of every node mid-upgrade whose driver pod is being replaced, without
/// their workload pods (see [`needs_node_pods`] and [`sort_node_pods`]).
pub fn observe_nodes<N, P>(
    nodes: &[N],
    revisions: &BTreeMap<String, String>,
    driver_pods: &[P],
    validator_pods: &[P],
) -> Observed
where
    N: Borrow<WatchedNode>,
    P: PodView,
{
    let by_node = driver_pods_by_node(driver_pods);
    let mut validators: BTreeMap<&str, Vec<&P>> = BTreeMap::new();
    for p in validator_pods {
        if let Some(n) = p.node() {
            validators.entry(n).or_default().push(p);
        }
    }
    let mut out = Observed::default();
    for p in driver_pods {
        if let Some(n) = p.node() {
            out.driver_pods
                .entry(n.to_string())
                .or_default()
                .insert(p.pod_name().to_string());
        }
    }
    let empty = BTreeMap::new();
    for node in nodes {
        let node = node.borrow();
        let name = node.name_any();
        let pod = by_node.get(name.as_str());
        let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
        // A node without a driver pod is not managed, unless it is mid-upgrade
        // (see below): skip the rest before reading its marks.
        if pod.is_none() && !labels.contains_key(STATE_LABEL) {
            continue;
        }
        let annotations = node.metadata.annotations.as_ref().unwrap_or(&empty);
        let marks = match UpgradeMarks::read(labels, annotations) {
            Ok(m) => m,
            Err(e) => {
                out.skipped.push((name, e.to_string()));
                continue;
            }
        };
        // Between the deletion of its old driver pod and the DaemonSet
        // creating the new one, a node mid-upgrade has no driver pod. It is
        // still cordoned and still holds its upgrade slot: left out, it would
        // not count against maxUnavailable and its slot would go to another
        // node. It is observed with a missing pod, which holds its state.
        let driver_pod = match pod {
            Some(pod) => driver_observation(*pod, revisions),
            None if marks.state.in_progress() => DriverPodObservation {
                missing: true,
                ..DriverPodObservation::default()
            },
            None => continue,
        };
        out.nodes.push(NodeObservation {
            marks,
            node_ready: node.ready,
            unschedulable: node.unschedulable,
            driver_pod,
            validator: validator_status(
                validators.get(name.as_str()).map_or(&[][..], Vec::as_slice),
            ),
            gpu_pods: Vec::new(),
            wait_pods: Vec::new(),
            drain_pods: Vec::new(),
            name,
        });
    }
    out.nodes.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

#[cfg(test)]
mod missing_pod_tests {
    use super::*;
    use serde_json::json;

    fn node(name: &str, state: Option<&str>, unschedulable: bool) -> WatchedNode {
        let mut labels = serde_json::Map::new();
        if let Some(s) = state {
            labels.insert(STATE_LABEL.into(), json!(s));
        }
        let node: k8s_openapi::api::core::v1::Node = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": labels},
            "spec": {"unschedulable": unschedulable},
        }))
        .unwrap();
        WatchedNode::from(node)
    }

    #[test]
    fn a_node_mid_upgrade_without_a_driver_pod_is_observed_with_a_missing_pod() {
        let nodes = [
            node("restarting", Some("pod-restart-required"), true),
            node("done", Some("upgrade-done"), false),
            node("cpu", None, false),
        ];
        let observed = observe_nodes::<_, Pod>(&nodes, &BTreeMap::new(), &[], &[]);
        let names: Vec<&str> = observed.nodes.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(names, ["restarting"]);
        let n = &observed.nodes[0];
        assert!(n.driver_pod.missing && n.unschedulable);
        assert_eq!(n.marks.state, UpgradeState::PodRestartRequired);
        assert!(observed.skipped.is_empty());
    }
}
