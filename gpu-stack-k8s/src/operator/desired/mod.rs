//! The desired cluster state: one pure function from (ClusterPolicy, nodes,
//! currently owned objects) to the objects that should exist, what to apply
//! and delete, the node label patches, and the ClusterPolicy status.
//!
//! Every desired object carries a hash of itself in
//! `nvidia.com/last-applied-hash`; an existing object with the same hash is
//! left alone, so an unchanged object is never rewritten. Applying the result
//! and calling the function again yields no changes (tested as a property).
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};

use gpu_stack_core::catalog;
use gpu_stack_core::operator::components::Component;
use gpu_stack_core::operator::driver::{
    DriverNode, DriverPlan, DriverRequest, GpuIdentity, plan_driver,
};
use gpu_stack_core::operator::labels::{
    GPU_PRODUCT, LabelPatch, Labels, NFD_KERNEL, NFD_OS_ID, NFD_OS_VERSION, NFD_OS_VERSION_MAJOR,
    NodeFacts, Workload, apply_patch, deploy_label_patch, node_workload, upgrade_annotation_patch,
};
use gpu_stack_core::operator::nvidiadriver::{DriverCr, DriversPlan, plan_drivers};
use k8s_openapi::api::core::v1::{Node, Taint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use serde::Serialize;

use crate::operator::cluster::object::{HASH_ANNOTATION, Object, ObjectKey};
use crate::operator::cluster::selector::{pod_selects_node, pod_tolerates_taints};
use crate::operator::clusterpolicy::status::{ClusterPolicyStatus, Condition, RefusedNode, state};
use crate::operator::clusterpolicy::{ClusterPolicy, DEFAULT_NAMESPACE};
use crate::operator::migconfig::{MigConfig, MigConfigStatus};
use crate::operator::nvidiadriver::{NvidiaDriver, NvidiaDriverStatus};

mod migconfigs;
mod nvidiadrivers;

pub mod render;

use render::RenderContext;

/// Reasons used in status conditions.
pub mod reason {
    /// Everything is deployed and ready.
    pub const RECONCILED: &str = "Reconciled";
    /// The spec is invalid; nothing was changed.
    pub const RECONCILE_FAILED: &str = "ReconcileFailed";
    /// No node carries any NFD label.
    pub const NFD_LABELS_MISSING: &str = "NFDLabelsMissing";
    /// No node has an NVIDIA GPU.
    pub const NO_GPU_NODES: &str = "NoGPUNodes";
    /// Some DaemonSet is not ready yet.
    pub const OPERAND_NOT_READY: &str = "OperandNotReady";
    /// The requested driver cannot drive some nodes' GPUs.
    pub const DRIVER_INCOMPATIBLE: &str = "DriverIncompatible";
    /// Some GPU nodes lack the labels needed to pick a driver image.
    pub const DRIVER_POOL_UNKNOWN: &str = "DriverPoolUnknown";
    /// Another ClusterPolicy is older and in charge.
    pub const IGNORED: &str = "Ignored";
}

/// Node labels the driver planner reads.
const DRIVER_LABELS: [&str; 4] = [NFD_OS_ID, NFD_OS_VERSION, NFD_OS_VERSION_MAJOR, NFD_KERNEL];

/// Options of [`desired_state`].
#[derive(Debug, Clone)]
pub struct Options {
    /// Namespace of the operands.
    pub namespace: String,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            namespace: DEFAULT_NAMESPACE.to_string(),
        }
    }
}

/// The answer of [`desired_state`].
#[derive(Debug, Clone, Serialize)]
pub struct Desired {
    /// Every object that should exist (with hash annotations).
    pub objects: Vec<Object>,
    /// Objects to create or replace (those whose hash differs from the current one).
    pub apply: Vec<Object>,
    /// Owned objects that should no longer exist.
    pub delete: Vec<ObjectKey>,
    /// Label changes per node (only nodes with changes).
    pub node_labels: BTreeMap<String, LabelPatch>,
    /// Annotation changes per node (only nodes with changes), written with
    /// the node's label changes.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub node_annotations: BTreeMap<String, LabelPatch>,
    /// Status of the policy (condition times are left to the caller).
    pub status: ClusterPolicyStatus,
    /// The driver plan behind the driver DaemonSets (with NVIDIADrivers,
    /// every resource's pools and refusals together).
    pub driver: DriverPlan,
    /// With NVIDIADrivers: the routing and each resource's rollout.
    pub nvidia_drivers: Option<DriversPlan>,
    /// Status of each NVIDIADriver not being deleted, by name (condition
    /// times are left to the caller).
    pub nvidia_driver_status: BTreeMap<String, NvidiaDriverStatus>,
    /// Status of each MigConfig, by name (condition times left to the caller).
    pub mig_config_status: BTreeMap<String, MigConfigStatus>,
    /// Number of desired objects left untouched because their hash matched.
    pub unchanged: usize,
}

impl Desired {
    /// Whether applying this changes anything in the cluster (status aside).
    pub fn has_changes(&self) -> bool {
        !self.apply.is_empty()
            || !self.delete.is_empty()
            || !self.node_labels.is_empty()
            || !self.node_annotations.is_empty()
    }
}

/// The policy in charge: the oldest not being deleted, by creation time,
/// name as tie-breaker. Every other live policy is `ignored`.
pub fn active_policy(policies: &[ClusterPolicy]) -> Option<&ClusterPolicy> {
    oldest(policies.iter().filter(|p| !is_deleting(p)))
}

/// Whether `policy` carries a deletion timestamp.
pub fn is_deleting(policy: &ClusterPolicy) -> bool {
    policy.metadata.deletion_timestamp.is_some()
}

/// What a pass does for one ClusterPolicy. Only the policy in charge holds
/// the operator's finalizer, so deleting any other one changes nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PolicyDuty {
    /// In charge: reconcile the stack (and hold the finalizer).
    Reconcile,
    /// The policy in charge is being deleted while `successor` lives: the
    /// successor takes over every object (re-owned, nothing torn down),
    /// then the deleted one may go.
    HandOver {
        /// The live policy now in charge.
        successor: String,
    },
    /// The policy in charge is being deleted and none other lives: remove
    /// what the operator wrote, then let it go.
    TearDown,
    /// Not in charge (ignored, or deleted while another was in charge):
    /// hold no finalizer and touch nothing else.
    StandBy,
}

/// The duty of `policy` among `all` (the cached policies; `policy` itself
/// may be newer than its cached copy). A deleted policy was in charge when
/// it is the oldest of every policy still present, deleted ones included.
pub fn policy_duty(policy: &ClusterPolicy, all: &[ClusterPolicy]) -> PolicyDuty {
    let name = policy.metadata.name.as_deref();
    let others = || all.iter().filter(|p| p.metadata.name.as_deref() != name);
    if !is_deleting(policy) {
        return if oldest_among(policy, others().filter(|p| !is_deleting(p))) {
            PolicyDuty::Reconcile
        } else {
            PolicyDuty::StandBy
        };
    }
    if !oldest_among(policy, others()) {
        return PolicyDuty::StandBy;
    }
    match oldest(others().filter(|p| !is_deleting(p))) {
        Some(successor) => PolicyDuty::HandOver {
            successor: successor.metadata.name.clone().unwrap_or_default(),
        },
        None => PolicyDuty::TearDown,
    }
}

/// Whether `policy` is older than every one of `rivals`.
fn oldest_among<'a>(
    policy: &'a ClusterPolicy,
    rivals: impl Iterator<Item = &'a ClusterPolicy>,
) -> bool {
    oldest(rivals.chain([policy])).is_some_and(|o| o.metadata.name == policy.metadata.name)
}

/// The oldest policy by creation time, name as tie-breaker; one without a
/// timestamp sorts last.
fn oldest<'a>(policies: impl Iterator<Item = &'a ClusterPolicy>) -> Option<&'a ClusterPolicy> {
    policies.min_by(|a, b| {
        let ta = a.metadata.creation_timestamp.as_ref().map(|t| t.0);
        let tb = b.metadata.creation_timestamp.as_ref().map(|t| t.0);
        // A policy without a timestamp sorts last.
        let ord = match (ta, tb) {
            (Some(x), Some(y)) => x.cmp(&y),
            (Some(_), None) => std::cmp::Ordering::Less,
            (None, Some(_)) => std::cmp::Ordering::Greater,
            (None, None) => std::cmp::Ordering::Equal,
        };
        ord.then_with(|| a.metadata.name.cmp(&b.metadata.name))
    })
}

/// Status of a policy that is not in charge.
pub fn ignored_status(policy: &ClusterPolicy, active: &str) -> ClusterPolicyStatus {
    ClusterPolicyStatus {
        state: state::IGNORED.into(),
        namespace: None,
        conditions: vec![condition(
            "Ready",
            false,
            reason::IGNORED,
            format!(
                "ClusterPolicy {active} is older and in charge; deleting this one changes \
                 nothing, deleting that one hands the running stack over to the oldest left"
            ),
        )],
        unsupported_fields: Vec::new(),
        refused_nodes: Vec::new(),
        observed_generation: policy.metadata.generation,
        driver_upgrade: None,
    }
}

fn condition(type_: &str, status: bool, reason: &str, message: String) -> Condition {
    Condition {
        type_: type_.into(),
        status: if status { "True" } else { "False" }.into(),
        reason: reason.into(),
        message,
        last_transition_time: None,
    }
}

/// A stable 64-bit FNV-1a hash (stable across Rust versions and platforms,
/// unlike `DefaultHasher`), hex-encoded. Used for change detection only.
pub fn stable_hash(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Stamps the hash annotation on a desired object and returns the hash.
pub fn stamp_hash(obj: &mut Object) -> String {
    if let Some(a) = obj.meta_mut().annotations.as_mut() {
        a.remove(HASH_ANNOTATION);
    }
    let bytes = serde_json::to_vec(&obj.to_json()).unwrap_or_default();
    let hash = stable_hash(&bytes);
    obj.meta_mut()
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(HASH_ANNOTATION.to_string(), hash.clone());
    hash
}

/// Catalog models of a node's GPUs, from NFD PCI device labels or, failing
/// that, the GFD product label; empty when neither names a known model.
pub fn catalog_models_on_node(labels: &Labels) -> Vec<&'static catalog::GpuModel> {
    let facts = NodeFacts::from_labels(labels);
    let mut out: Vec<&'static catalog::GpuModel> = facts
        .pci_device_ids
        .iter()
        .filter_map(|dev| u32::from_str_radix(dev, 16).ok())
        .filter_map(|dev| catalog::by_pci_device_id((dev << 16) | 0x10de))
        .collect();
    if out.is_empty()
        && let Some(product) = labels.get(GPU_PRODUCT)
    {
        let spaced = product.replace('-', " ");
        out.extend(
            catalog::by_product_name(product)
                .or_else(|| catalog::by_product_name(&spaced))
                .or_else(|| catalog::lookup(product).ok()),
        );
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out.dedup_by(|a, b| a.name == b.name);
    out
}

/// GPUs on a node, from NFD PCI device labels or, failing that, the GFD product
/// label, looked up in the GPU catalog.
pub fn gpus_on_node(labels: &Labels) -> Vec<GpuIdentity> {
    let mut out: Vec<GpuIdentity> = catalog_models_on_node(labels)
        .into_iter()
        .map(|m| GpuIdentity {
            model: m.product_name.clone(),
            architecture: m.architecture.to_string(),
        })
        .collect();
    if out.is_empty()
        && let Some(product) = labels.get(GPU_PRODUCT)
    {
        out.push(GpuIdentity {
            model: product.clone(),
            architecture: String::new(),
        });
    }
    out.sort();
    out.dedup();
    out
}

fn node_name(n: &impl NodeMeta) -> String {
    n.node_metadata().name.clone().unwrap_or_default()
}

/// A node as the desired state reads it: its metadata (name and labels)
/// and its taints, nothing else. Implemented for Nodes, whole or stripped
/// down to just that (the operator's node cache), shared or not, so a large
/// cluster's nodes need not be copied for a pass.
pub trait NodeMeta {
    /// The node's metadata.
    fn node_metadata(&self) -> &ObjectMeta;
    /// The node's taints (`spec.taints`).
    fn node_taints(&self) -> &[Taint];
}

impl NodeMeta for Node {
    fn node_metadata(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn node_taints(&self) -> &[Taint] {
        self.spec
            .as_ref()
            .and_then(|s| s.taints.as_deref())
            .unwrap_or(&[])
    }
}

impl<T: NodeMeta> NodeMeta for std::sync::Arc<T> {
    fn node_metadata(&self) -> &ObjectMeta {
        T::node_metadata(self)
    }

    fn node_taints(&self) -> &[Taint] {
        T::node_taints(self)
    }
}

/// How many of `nodes` are GPU nodes, and whether any carries
/// node-feature-discovery labels, by the rules the desired state applies.
pub fn gpu_node_census(nodes: &[impl NodeMeta]) -> (usize, bool) {
    let empty = Labels::new();
    nodes.iter().fold((0, false), |(gpus, nfd), n| {
        let facts = NodeFacts::from_labels(n.node_metadata().labels.as_ref().unwrap_or(&empty));
        (gpus + usize::from(facts.gpu), nfd || facts.nfd)
    })
}

/// Readiness of a DaemonSet status, as the NVIDIA operator judges it, but
/// never on a status that predates the nodes the DaemonSet selects.
///
/// `selected` counts the nodes the DaemonSet's controller would put a pod on
/// (asked only for a DaemonSet reporting no pods wanted, as matching every
/// node is most of a pass's work). Such a DaemonSet is ready only if there
/// is none: right after it is created, or after the labels its selector
/// reads were set, its status says 0 of 0 until its controller catches up.
fn daemonset_ready(obj: &Object, selected: impl FnOnce() -> usize) -> bool {
    let Some(ds) = obj.as_daemonset() else {
        return true;
    };
    let Some(st) = &ds.status else {
        return false;
    };
    let desired = st.desired_number_scheduled;
    if desired == 0 {
        return selected() == 0;
    }
    if st.number_unavailable.unwrap_or(0) != 0 {
        return false;
    }
    st.observed_generation.unwrap_or(0) >= ds.metadata.generation.unwrap_or(0)
        && st.updated_number_scheduled.unwrap_or(0) == desired
        && st.number_available.unwrap_or(0) == desired
}

/// How many of `nodes` (name, labels, with their `taints`) a DaemonSet's
/// controller would put a pod on: its node selector and required node
/// affinity accept the node, and its pods tolerate the node's NoSchedule and
/// NoExecute taints (a node it cannot tolerate never gets a pod, so it must
/// not hold the DaemonSet's readiness back).
fn selected_nodes(obj: &Object, nodes: &[(String, Cow<'_, Labels>)], taints: &[&[Taint]]) -> usize {
    let Some(pod) = obj
        .as_daemonset()
        .and_then(|d| d.spec.template.spec.as_ref())
    else {
        return 0;
    };
    nodes
        .iter()
        .zip(taints)
        .filter(|((name, labels), taints)| {
            pod_selects_node(pod, name, labels) && pod_tolerates_taints(pod, taints)
        })
        .count()
}

fn summarize(names: &[String], max: usize) -> String {
    if names.len() <= max {
        names.join(", ")
    } else {
        format!("{} and {} more", names[..max].join(", "), names.len() - max)
    }
}

/// Computes the desired state of a cluster without NVIDIADriver resources.
/// Pure: the same inputs always give the same answer.
pub fn desired_state(
    policy: &ClusterPolicy,
    nodes: &[impl NodeMeta],
    current: &[Object],
    opts: &Options,
) -> Desired {
    desired_state_with(policy, nodes, current, &Related::default(), opts)
}

/// Cluster resources besides the ClusterPolicy that the desired state reads.
#[derive(Debug, Clone, Copy, Default)]
pub struct Related<'a> {
    /// Every NVIDIADriver.
    pub nvidia_drivers: &'a [NvidiaDriver],
    /// Every MigConfig.
    pub mig_configs: &'a [MigConfig],
    /// Owned objects whose live spec may no longer be what the operator
    /// applied (edited by someone else, or not written since the operator
    /// started): applied again even when their hash matches, which puts a
    /// hand edit back (server-side apply changes nothing when nothing
    /// differs).
    pub drifted: Option<&'a BTreeSet<ObjectKey>>,
}

/// Computes the desired state, with the cluster's NVIDIADrivers and
/// MigConfigs. When the policy sets `driver.useNvidiaDriverCRD`, GPU nodes
/// are routed to NVIDIADrivers (the owner label) and each accepted one
/// renders the driver DaemonSets of its nodes. MigConfigs add generated
/// configs to the mig-parted ConfigMap and set `nvidia.com/mig.config` on
/// their nodes. Each resource gets a status either way. Pure.
pub fn desired_state_with(
    policy: &ClusterPolicy,
    nodes: &[impl NodeMeta],
    current: &[Object],
    related: &Related<'_>,
    opts: &Options,
) -> Desired {
    let drivers = related.nvidia_drivers;
    let spec = &policy.spec;
    let mut status = ClusterPolicyStatus {
        state: state::NOT_READY.into(),
        namespace: Some(opts.namespace.clone()),
        conditions: Vec::new(),
        unsupported_fields: spec.unsupported_fields(),
        refused_nodes: Vec::new(),
        observed_generation: policy.metadata.generation,
        driver_upgrade: None,
    };

    // Bad input changes nothing.
    let errors = spec.validate();
    if !errors.is_empty() {
        let msg = errors
            .iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join("; ");
        status.conditions = vec![
            condition(
                "Ready",
                false,
                reason::RECONCILE_FAILED,
                "the spec is invalid; nothing was changed".into(),
            ),
            condition("Error", true, reason::RECONCILE_FAILED, msg),
        ];
        return Desired {
            objects: current.to_vec(),
            apply: Vec::new(),
            delete: Vec::new(),
            node_labels: BTreeMap::new(),
            node_annotations: BTreeMap::new(),
            status,
            driver: DriverPlan::default(),
            nvidia_drivers: None,
            nvidia_driver_status: BTreeMap::new(),
            mig_config_status: BTreeMap::new(),
            unchanged: current.len(),
        };
    }

    // Node labels, then the nodes as they will look.
    let label_policy = spec.label_policy();
    let mut node_labels = BTreeMap::new();
    let empty = Labels::new();
    // Borrow each node's labels; copy only the ones that change.
    let mut effective: Vec<(String, Cow<'_, Labels>)> = Vec::with_capacity(nodes.len());
    for n in nodes {
        let current_labels = n.node_metadata().labels.as_ref().unwrap_or(&empty);
        let patch = deploy_label_patch(current_labels, &label_policy);
        let labels = if patch.is_empty() {
            Cow::Borrowed(current_labels)
        } else {
            let mut l = current_labels.clone();
            apply_patch(&mut l, &patch);
            node_labels.insert(node_name(n), patch);
            Cow::Owned(l)
        };
        effective.push((node_name(n), labels));
    }
    let taints: Vec<&[Taint]> = nodes.iter().map(|n| n.node_taints()).collect();
    let facts: Vec<NodeFacts> = effective
        .iter()
        .map(|(_, l)| NodeFacts::from_labels(l))
        .collect();
    let any_nfd = facts.iter().any(|f| f.nfd);
    let gpu_nodes: Vec<usize> = (0..effective.len()).filter(|i| facts[*i].gpu).collect();
    // GPU nodes the container operands are for: not switched off, not
    // serving virtual machines.
    let container: Vec<bool> = effective
        .iter()
        .zip(&facts)
        .map(|((_, l), f)| {
            !f.operands_disabled && node_workload(l, &label_policy) == Workload::Container
        })
        .collect();
    let runs_operands = |i: &&usize| container[**i];

    // Driver plan over GPU nodes that run operands.
    let enablement = spec.enablement();
    let crd_mode = spec.uses_nvidia_driver_crd();
    let driver_nodes = |all_labels: bool| -> Vec<DriverNode> {
        gpu_nodes
            .iter()
            .filter(runs_operands)
            .map(|i| DriverNode {
                name: effective[*i].0.clone(),
                // Only the labels the driver planner reads; NVIDIADriver
                // selectors may read any.
                labels: effective[*i]
                    .1
                    .iter()
                    .filter(|(k, _)| all_labels || DRIVER_LABELS.contains(&k.as_str()))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
                gpus: gpus_on_node(&effective[*i].1),
            })
            .collect()
    };
    let mut driver = if enablement.driver {
        // validate() already checked the request, so this cannot fail here.
        plan_driver(&spec.driver_request(), &driver_nodes(false)).unwrap_or_default()
    } else {
        DriverPlan::default()
    };
    let live: Vec<&NvidiaDriver> = drivers.iter().filter(|d| !d.is_deleting()).collect();
    let drivers_plan = crd_mode.then(|| {
        let input: Vec<(DriverCr, DriverRequest)> = live
            .iter()
            .map(|d| (d.driver_cr(), d.spec.driver_request()))
            .collect();
        plan_drivers(&driver_nodes(true), &input)
    });
    if let Some(plan) = &drivers_plan {
        // Owner labels, on the nodes as they will look too.
        for (name, labels) in effective.iter_mut() {
            if let Some(patch) = plan.routing.labels.get(name.as_str()) {
                node_labels
                    .entry(name.clone())
                    .or_insert_with(LabelPatch::new)
                    .extend(patch.clone());
                apply_patch(labels.to_mut(), patch);
            }
        }
        nvidiadrivers::merge_refusals(plan, &mut driver);
    }
    let mig = migconfigs::plan(
        policy,
        related.mig_configs,
        &gpu_nodes
            .iter()
            .filter(runs_operands)
            .map(|i| (&effective[*i].0, effective[*i].1.as_ref()))
            .collect::<Vec<_>>(),
        current,
        &opts.namespace,
    );
    for (name, patch) in &mig.labels {
        node_labels
            .entry(name.clone())
            .or_insert_with(LabelPatch::new)
            .extend(patch.clone());
    }
    // NVIDIA's driver manager reads from each GPU node whether the upgrade
    // controller drains it, or whether it must evict by itself.
    let mut node_annotations = BTreeMap::new();
    for (n, (name, labels)) in nodes.iter().zip(&effective) {
        let annotations = n.node_metadata().annotations.as_ref();
        let patch = upgrade_annotation_patch(labels, annotations, &label_policy);
        if !patch.is_empty() {
            node_annotations.insert(name.clone(), patch);
        }
    }

    // Objects.
    let ctx = RenderContext {
        policy,
        namespace: &opts.namespace,
    };
    let mut objects = vec![render::namespace(&ctx), render::runtime_class(&ctx)];
    // Objects of refused NVIDIADrivers, kept as they are.
    let mut kept: Vec<&Object> = Vec::new();
    if let Some(plan) = &drivers_plan {
        objects.push(render::rbac::service_account(&ctx, Component::Driver));
        objects.extend(render::rbac::rbac(&ctx, Component::Driver));
        for (d, rollout) in live.iter().zip(&plan.drivers) {
            if rollout.accepted() {
                for pool in &rollout.plan.pools {
                    objects.push(render::nvidia_driver_daemonset(&ctx, d, pool));
                }
            } else {
                kept.extend(
                    current
                        .iter()
                        .filter(|o| nvidiadrivers::belongs_to(o, d.name())),
                );
            }
        }
    }
    // With `nodeAgent.enabled` the components it hosts run in its one
    // DaemonSet instead of their own.
    let hosted = spec.node_agent_components();
    for c in enablement.enabled() {
        if hosted.contains(&c) {
            if c == Component::MigManager && uses_default_mig_config(spec) {
                objects.push(render::mig_parted_config_with(&ctx, &mig.generated));
            }
            continue;
        }
        objects.push(render::rbac::service_account(&ctx, c));
        objects.extend(render::rbac::rbac(&ctx, c));
        if c == Component::Driver {
            for pool in &driver.pools {
                objects.push(render::daemonset(&ctx, c, Some(pool)));
            }
        } else {
            objects.push(render::daemonset(&ctx, c, None));
        }
        if c == Component::MigManager && uses_default_mig_config(spec) {
            objects.push(render::mig_parted_config_with(&ctx, &mig.generated));
        }
    }
    objects.extend(render::node_agent_objects(&ctx, &hosted));
    if enablement.enabled().contains(&Component::DcgmExporter) {
        objects.push(render::exporter_service(
            &ctx,
            hosted.contains(&Component::DcgmExporter),
        ));
    }

    // Diff by hash.
    let current_by_key: BTreeMap<ObjectKey, &Object> =
        current.iter().map(|o| (o.key(), o)).collect();
    let mut apply = Vec::new();
    let mut unchanged = 0;
    let mut desired_keys = BTreeSet::new();
    let mut not_ready = Vec::new();
    for obj in objects.iter_mut() {
        let hash = stamp_hash(obj);
        let key = obj.key();
        desired_keys.insert(key.clone());
        match current_by_key.get(&key) {
            Some(cur) if cur.spec_hash() == Some(hash.as_str()) => {
                if !daemonset_ready(cur, || selected_nodes(obj, &effective, &taints)) {
                    not_ready.push(key.name.clone());
                }
                if related.drifted.is_some_and(|d| d.contains(&key)) {
                    apply.push(obj.clone());
                } else {
                    unchanged += 1;
                }
            }
            _ => {
                if obj.as_daemonset().is_some() {
                    not_ready.push(key.name.clone());
                }
                apply.push(obj.clone());
            }
        }
    }
    let owner = ctx.owner();
    for cur in &kept {
        desired_keys.insert(cur.key());
        // Kept as it is, but owned by the policy in charge: after a hand-over
        // the garbage collector would delete what the deleted policy owns.
        let owner_uid = |refs: &Option<Vec<OwnerReference>>| {
            refs.as_ref().and_then(|r| r.first()).map(|o| o.uid.clone())
        };
        if owner.is_some() && owner_uid(&cur.meta().owner_references) != owner_uid(&owner) {
            let mut reowned = Object::clone(cur);
            reowned.meta_mut().owner_references.clone_from(&owner);
            apply.push(reowned);
        }
        if !daemonset_ready(cur, || selected_nodes(cur, &effective, &taints)) {
            not_ready.push(cur.key().name.clone());
        }
    }
    let mut leaving: Vec<&Object> = current
        .iter()
        .filter(|o| o.is_managed() && !desired_keys.contains(&o.key()))
        .collect();
    leaving.sort_by_key(|o| o.delete_stage());
    let delete: Vec<ObjectKey> = leaving.into_iter().map(Object::key).collect();

    // Status.
    for r in &driver.refused {
        status.refused_nodes.push(RefusedNode {
            node: r.node.clone(),
            reason: r.reason.clone(),
        });
    }
    for r in &driver.unpooled {
        status.refused_nodes.push(RefusedNode {
            node: r.node.clone(),
            reason: r.reason.clone(),
        });
    }
    let (ready, reason_, message) = if !any_nfd {
        (
            true,
            reason::NFD_LABELS_MISSING,
            "no node has node-feature-discovery labels; install NFD so GPU nodes can be found"
                .to_string(),
        )
    } else if gpu_nodes.is_empty() {
        (
            true,
            reason::NO_GPU_NODES,
            "no node has an NVIDIA GPU".to_string(),
        )
    } else if !not_ready.is_empty() {
        (
            false,
            reason::OPERAND_NOT_READY,
            format!("not ready: {}", summarize(&not_ready, 5)),
        )
    } else {
        (
            true,
            reason::RECONCILED,
            format!("{} GPU node(s) ready", gpu_nodes.len()),
        )
    };
    let error = if !driver.refused.is_empty() {
        let names: Vec<String> = driver
            .refused
            .iter()
            .map(|r| format!("{} ({})", r.node, r.reason))
            .collect();
        Some((
            reason::DRIVER_INCOMPATIBLE,
            if crd_mode {
                format!("no driver is deployed to: {}", summarize(&names, 5))
            } else {
                format!(
                    "driver {} is not deployed to: {}",
                    spec.driver_request().version,
                    summarize(&names, 5)
                )
            },
        ))
    } else if !driver.unpooled.is_empty() {
        let names: Vec<String> = driver
            .unpooled
            .iter()
            .map(|r| format!("{} ({})", r.node, r.reason))
            .collect();
        Some((
            reason::DRIVER_POOL_UNKNOWN,
            format!("no driver image for: {}", summarize(&names, 5)),
        ))
    } else {
        None
    };
    let ready = ready && error.is_none();
    status.state = if ready {
        state::READY
    } else {
        state::NOT_READY
    }
    .into();
    status.conditions = match &error {
        Some((r, m)) => {
            // When operands are otherwise fine, the error explains "not ready".
            let (rr, rm) = if reason_ == reason::RECONCILED {
                (
                    *r,
                    format!("operands are ready, but {}", lowercase_first(m)),
                )
            } else {
                (reason_, message)
            };
            vec![
                condition("Ready", false, rr, rm),
                condition("Error", true, r, m.clone()),
            ]
        }
        None => vec![
            condition("Ready", ready, reason_, message),
            condition("Error", false, reason::RECONCILED, String::new()),
        ],
    };

    let nvidia_driver_status = nvidiadrivers::statuses(
        policy,
        &live,
        drivers_plan.as_ref(),
        &not_ready,
        &opts.namespace,
    );
    objects.extend(kept.into_iter().cloned());
    Desired {
        objects,
        apply,
        delete,
        node_labels,
        node_annotations,
        status,
        driver,
        nvidia_drivers: drivers_plan,
        nvidia_driver_status,
        mig_config_status: mig.statuses,
        unchanged,
    }
}

/// Whether the MIG manager reads the operator's own mig-parted ConfigMap
/// (no `migManager.config.name`, or the default one).
fn uses_default_mig_config(spec: &crate::operator::clusterpolicy::ClusterPolicySpec) -> bool {
    spec.mig_manager
        .as_ref()
        .and_then(|m| m.config.as_ref())
        .and_then(|c| c.name.as_deref())
        .is_none_or(|n| n.is_empty() || n == "default-mig-parted-config")
}

fn lowercase_first(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_lowercase().chain(c).collect(),
        None => String::new(),
    }
}

/// Merges condition times: a condition whose status did not change keeps its
/// previous time; a changed or new one gets `now`.
pub fn carry_condition_times(
    new: &mut ClusterPolicyStatus,
    old: Option<&ClusterPolicyStatus>,
    now: &str,
) {
    carry_times(
        &mut new.conditions,
        old.map(|o| o.conditions.as_slice()),
        now,
    );
}

/// [`carry_condition_times`] over any list of conditions.
pub fn carry_times(new: &mut [Condition], old: Option<&[Condition]>, now: &str) {
    for c in new.iter_mut() {
        let prev = old.and_then(|o| o.iter().find(|p| p.type_ == c.type_));
        c.last_transition_time = match prev {
            Some(p) if p.status == c.status => p.last_transition_time.clone(),
            _ => Some(now.to_string()),
        };
    }
}

#[cfg(test)]
mod tests;
