//! NVIDIADriver routing and validation: which NVIDIADriver resource owns each
//! GPU node's driver, and whether a resource can be rolled out at all.
//!
//! Routing follows the NVIDIA operator's `AssignOwners`: every GPU node is
//! labelled [`OWNER_LABEL`]`=<NVIDIADriver name>`; a non-default resource whose
//! `nodeSelector` matches the node takes precedence, otherwise the node goes to
//! the default resource (`spec.default: true`), and a node nobody claims loses
//! the label. Two claimants for one node fail closed: the node is not
//! relabelled and both resources are named, so each can report
//! `ConflictingNodeSelector` in its status.
//!
//! Unlike the NVIDIA operator, which abandons the whole pass on the first
//! conflict, a conflict here holds only the nodes it touches; every other node
//! is still routed.
//!
//! Validation refuses what the NVIDIA operator refuses (the reserved owner key
//! in a `nodeSelector`, a default resource with a `nodeSelector`) and adds the
//! GPU × driver-branch check of [`super::driver`]: a version the selected GPUs
//! cannot run is refused, naming the GPU model and the branch it needs.
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};

use super::driver::{
    DriverNode, DriverPlan, DriverRequest, GpuIdentity, Incompatibility, KernelModuleType,
    branch_of, check_gpu, is_digest, plan_driver, resolve_module_type, sanitize_name_part,
};
use super::labels::{LabelPatch, Labels};
use super::upgrade::policy::UpgradePolicy;

/// Node label naming the NVIDIADriver that owns the node's driver.
pub const OWNER_LABEL: &str = "nvidia.com/gpu-operator.driver.owner";

/// Condition reason for a node claimed by two NVIDIADrivers.
pub const REASON_CONFLICTING_NODE_SELECTOR: &str = "ConflictingNodeSelector";

/// Most node names one message lists before it says how many more there are.
pub const MAX_NODES_LISTED: usize = 5;

/// Most validation problems reported for one NVIDIADriver.
pub const MAX_PROBLEMS: usize = 8;

/// `spec.driverType` of an NVIDIADriver.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DriverType {
    /// The data-center GPU driver.
    #[default]
    Gpu,
    /// The vGPU guest driver.
    Vgpu,
    /// The vGPU host manager.
    VgpuHostManager,
}

impl DriverType {
    /// The spec value: `gpu`, `vgpu` or `vgpu-host-manager`.
    pub fn as_str(self) -> &'static str {
        match self {
            DriverType::Gpu => "gpu",
            DriverType::Vgpu => "vgpu",
            DriverType::VgpuHostManager => "vgpu-host-manager",
        }
    }
}

/// One NVIDIADriver resource, as routing and validation need it. Resources
/// being deleted are left out by the caller, as the NVIDIA operator does.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DriverCr {
    /// Resource name (the owner label's value).
    pub name: String,
    /// `spec.default`: the fallback for nodes no other resource selects.
    pub is_default: bool,
    /// `spec.nodeSelector`; empty selects every GPU node (the NVIDIA operator
    /// substitutes `nvidia.com/gpu.present=true`).
    pub node_selector: Labels,
    /// `spec.driverType`.
    pub driver_type: DriverType,
    /// `spec.version`: a version, a branch (precompiled) or a `sha256:` digest.
    pub version: String,
    /// `spec.kernelModuleType`.
    pub kernel_module_type: KernelModuleType,
    /// `spec.usePrecompiled`.
    pub use_precompiled: bool,
    /// `spec.upgradePolicy`, as read (NVIDIA's NVIDIADriver defaults
    /// `autoUpgrade` to true); checked by [`validate_spec`] when it is on.
    pub upgrade_policy: UpgradePolicy,
}

impl DriverCr {
    /// Whether the resource's selector matches a node's labels (every
    /// key/value pair present). Says nothing about the default fallback.
    pub fn selects(&self, labels: &Labels) -> bool {
        self.node_selector
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
    }
}

/// Node names in a message: the first [`MAX_NODES_LISTED`], then a count.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeList {
    /// Names shown, sorted.
    pub shown: Vec<String>,
    /// How many more there are.
    pub more: usize,
}

impl NodeList {
    /// A capped list from any node names (sorted and deduplicated here).
    pub fn new<I, S>(names: I) -> NodeList
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let all: BTreeSet<String> = names.into_iter().map(Into::into).collect();
        let more = all.len().saturating_sub(MAX_NODES_LISTED);
        NodeList {
            shown: all.into_iter().take(MAX_NODES_LISTED).collect(),
            more,
        }
    }
}

impl fmt::Display for NodeList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let word = if self.shown.len() + self.more == 1 {
            "node"
        } else {
            "nodes"
        };
        write!(f, "{word} {}", self.shown.join(", "))?;
        if self.more > 0 {
            write!(f, " and {} more", self.more)?;
        }
        Ok(())
    }
}

/// Why an NVIDIADriver is refused. Each message names the resource, the
/// field and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum NvidiaDriverError {
    /// The selector uses the label the operator writes to route nodes.
    #[error(
        "NVIDIADriver {cr}: spec.nodeSelector uses the reserved label {OWNER_LABEL}, which the operator writes to route nodes to their NVIDIADriver; select nodes by their own labels instead"
    )]
    ReservedSelectorKey {
        /// Resource name.
        cr: String,
    },
    /// A default resource with a selector.
    #[error(
        "NVIDIADriver {cr}: a default NVIDIADriver must not set spec.nodeSelector (it has {keys}); remove the nodeSelector, or set spec.default to false to scope this driver to those nodes"
    )]
    DefaultWithSelector {
        /// Resource name.
        cr: String,
        /// The selector keys, comma-separated.
        keys: String,
    },
    /// No version.
    #[error(
        "NVIDIADriver {cr}: spec.version is empty; set a driver version such as \"595.91.07\", a branch such as \"570\" with usePrecompiled, or a sha256 digest"
    )]
    EmptyVersion {
        /// Resource name.
        cr: String,
    },
    /// A digest with precompiled images.
    #[error(
        "NVIDIADriver {cr}: spec.version is a digest ({version}), which cannot be combined with spec.usePrecompiled=true because precompiled images are tagged per kernel; set a driver branch such as \"570\" or turn usePrecompiled off"
    )]
    DigestWithPrecompiled {
        /// Resource name.
        cr: String,
        /// The digest given.
        version: String,
    },
    /// The branch is older than a selected GPU's first supported branch.
    #[error(
        "NVIDIADriver {cr}: spec.version {version} (R{branch}) cannot drive {model} on {nodes}: {model} needs driver branch R{min_branch} or newer; set spec.version to R{min_branch} or newer, or narrow spec.nodeSelector"
    )]
    BranchTooOld {
        /// Resource name.
        cr: String,
        /// Requested version.
        version: String,
        /// Requested branch.
        branch: u32,
        /// GPU product.
        model: String,
        /// First branch that supports the GPU.
        min_branch: u32,
        /// Nodes with that GPU.
        nodes: NodeList,
    },
    /// Another GPU × driver incompatibility (branch too new, module flavour).
    #[error("NVIDIADriver {cr}: spec.version {version} cannot drive the GPUs on {nodes}: {reason}")]
    Incompatible {
        /// Resource name.
        cr: String,
        /// Requested version.
        version: String,
        /// Nodes with that GPU.
        nodes: NodeList,
        /// What the matrix says.
        reason: Incompatibility,
    },
    /// The upgrade policy cannot be used.
    #[error("NVIDIADriver {cr}: spec.upgradePolicy.{field}: {reason}")]
    UpgradePolicy {
        /// Resource name.
        cr: String,
        /// The field, relative to `upgradePolicy`.
        field: String,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// The image request cannot be planned (e.g. an empty image name).
    #[error("NVIDIADriver {cr}: {reason}")]
    Request {
        /// Resource name.
        cr: String,
        /// What the driver planner says, naming the field.
        reason: String,
    },
    /// More problems than one status can list.
    #[error("NVIDIADriver {cr}: {more} more problems not listed; fix the ones above first")]
    MoreProblems {
        /// Resource name.
        cr: String,
        /// How many were left out.
        more: usize,
    },
}

/// Checks a resource's own fields: the selector rules the NVIDIA operator
/// enforces, and the version. Node-independent.
pub fn validate_spec(cr: &DriverCr) -> Vec<NvidiaDriverError> {
    let mut out = Vec::new();
    if cr.node_selector.contains_key(OWNER_LABEL) {
        out.push(NvidiaDriverError::ReservedSelectorKey {
            cr: cr.name.clone(),
        });
    }
    if cr.is_default && !cr.node_selector.is_empty() {
        out.push(NvidiaDriverError::DefaultWithSelector {
            cr: cr.name.clone(),
            keys: cr
                .node_selector
                .keys()
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    let version = cr.version.trim();
    if version.is_empty() {
        out.push(NvidiaDriverError::EmptyVersion {
            cr: cr.name.clone(),
        });
    } else if cr.use_precompiled && is_digest(version) {
        out.push(NvidiaDriverError::DigestWithPrecompiled {
            cr: cr.name.clone(),
            version: version.to_string(),
        });
    }
    // As in the ClusterPolicy, with autoUpgrade off the rest is ignored.
    if cr.upgrade_policy.auto_upgrade {
        for e in cr.upgrade_policy.validate() {
            let text = e.to_string();
            let reason = text
                .strip_prefix(&format!("{}: ", e.field()))
                .unwrap_or(&text)
                .to_string();
            out.push(NvidiaDriverError::UpgradePolicy {
                cr: cr.name.clone(),
                field: e.field().to_string(),
                reason,
            });
        }
    }
    out
}

/// Whether [`validate_spec`] finds a selector problem, which keeps the
/// resource out of routing (its nodes stay as they are).
fn selector_refused(cr: &DriverCr) -> bool {
    cr.node_selector.contains_key(OWNER_LABEL) || (cr.is_default && !cr.node_selector.is_empty())
}

/// Checks the version against the GPUs on the nodes a resource owns, with the
/// GPU × driver-branch matrix of [`super::driver`]. One problem per GPU model
/// and kind, each naming its nodes; at most [`MAX_PROBLEMS`].
///
/// Only `driverType: gpu` is checked: vGPU software versions and the GPUs a
/// guest sees follow vGPU's own support lists. Nodes whose GPUs are unknown
/// are not checked, and a digest version has no branch to check (the kernel
/// module flavour still is). The module flavour is resolved per node, so a
/// node passes whenever some pool of its own could run it.
pub fn check_versions(cr: &DriverCr, nodes: &[&DriverNode]) -> Vec<NvidiaDriverError> {
    if cr.driver_type != DriverType::Gpu {
        return Vec::new();
    }
    let version = cr.version.trim();
    if version.is_empty() {
        return Vec::new();
    }
    let branch = branch_of(version);
    // (problem kind, model) -> (the problem, its nodes), sorted for stable output.
    let mut found: BTreeMap<(String, String), (Incompatibility, BTreeSet<String>)> =
        BTreeMap::new();
    for n in nodes {
        let modules = resolve_module_type(cr.kernel_module_type, branch, &n.gpus);
        for g in &n.gpus {
            if let Err(e) = check_gpu(g, branch, modules) {
                let key = (kind_of(&e).to_string(), g.model.clone());
                found
                    .entry(key)
                    .or_insert_with(|| (e, BTreeSet::new()))
                    .1
                    .insert(n.name.clone());
            }
        }
    }
    let mut out: Vec<NvidiaDriverError> = found
        .into_values()
        .map(|(e, names)| {
            let nodes = NodeList::new(names);
            match e {
                Incompatibility::BranchTooOld {
                    model,
                    branch,
                    min_branch,
                } => NvidiaDriverError::BranchTooOld {
                    cr: cr.name.clone(),
                    version: version.to_string(),
                    branch,
                    model,
                    min_branch,
                    nodes,
                },
                reason => NvidiaDriverError::Incompatible {
                    cr: cr.name.clone(),
                    version: version.to_string(),
                    nodes,
                    reason,
                },
            }
        })
        .collect();
    cap(&cr.name, &mut out);
    out
}

fn kind_of(e: &Incompatibility) -> &'static str {
    match e {
        Incompatibility::BranchTooOld { .. } => "branch-too-old",
        Incompatibility::BranchTooNew { .. } => "branch-too-new",
        Incompatibility::OpenRequired { .. } => "open-required",
        Incompatibility::OpenUnsupported { .. } => "open-unsupported",
    }
}

fn cap(cr: &str, out: &mut Vec<NvidiaDriverError>) {
    if out.len() > MAX_PROBLEMS {
        let more = out.len() - (MAX_PROBLEMS - 1);
        out.truncate(MAX_PROBLEMS - 1);
        out.push(NvidiaDriverError::MoreProblems {
            cr: cr.to_string(),
            more,
        });
    }
}

/// Every problem of one resource given the routing result: [`validate_spec`]
/// then [`check_versions`] over the nodes routed to it. At most
/// [`MAX_PROBLEMS`]. A refused resource is not rolled out; its nodes keep
/// their owner label, so no other resource takes them meanwhile.
pub fn validate(cr: &DriverCr, routing: &Routing, nodes: &[DriverNode]) -> Vec<NvidiaDriverError> {
    let mut out = validate_spec(cr);
    let owned: Vec<&DriverNode> = nodes
        .iter()
        .filter(|n| routing.owners.get(&n.name) == Some(&cr.name))
        .collect();
    out.extend(check_versions(cr, &owned));
    cap(&cr.name, &mut out);
    out
}

/// A node two or more resources claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeConflict {
    /// Node name.
    pub node: String,
    /// Every resource that claims it, sorted.
    pub claimants: Vec<String>,
    /// Whether the claimants are default resources (no non-default one
    /// selects the node, and more than one default exists).
    pub between_defaults: bool,
    /// The owner label the node keeps, if it has one.
    pub kept_owner: Option<String>,
}

/// The routing answer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Routing {
    /// Owner of each node after this pass: the resource routed to it or, for a
    /// node held back (conflict, refused owner), the owner label it keeps.
    /// Nodes without an owner are absent.
    pub owners: BTreeMap<String, String>,
    /// Owner-label changes, only for nodes whose label changes
    /// ([`OWNER_LABEL`] set to `Some(name)` or removed with `None`).
    pub labels: BTreeMap<String, LabelPatch>,
    /// Per resource, the nodes it claims together with another resource.
    /// Every claimant of a node is a key here.
    pub conflicts: BTreeMap<String, Vec<NodeConflict>>,
    /// Nodes held back because the resource owning them is refused
    /// ([`validate_spec`] selector problems): they keep their owner label.
    pub held: Vec<String>,
    /// GPU nodes that no resource selects and that have no default to fall
    /// back on; their owner label is removed.
    pub unowned: Vec<String>,
}

impl Routing {
    /// Nodes held back by a conflict, sorted.
    pub fn conflicted_nodes(&self) -> Vec<String> {
        let set: BTreeSet<&String> = self.conflicts.values().flatten().map(|c| &c.node).collect();
        set.into_iter().cloned().collect()
    }

    /// The message for a resource's `ConflictingNodeSelector` condition, or
    /// `None` when it has no conflict. Lists at most [`MAX_NODES_LISTED`]
    /// nodes and at most [`MAX_NODES_LISTED`] other resources.
    pub fn conflict_message(&self, cr: &str) -> Option<String> {
        let conflicts = self.conflicts.get(cr).filter(|c| !c.is_empty())?;
        let others: BTreeSet<&str> = conflicts
            .iter()
            .flat_map(|c| c.claimants.iter().map(String::as_str))
            .filter(|c| *c != cr)
            .collect();
        let more_others = others.len().saturating_sub(MAX_NODES_LISTED);
        let mut names: Vec<&str> = others.into_iter().take(MAX_NODES_LISTED).collect();
        let more = if more_others > 0 {
            format!(" and {more_others} more")
        } else {
            String::new()
        };
        names.sort_unstable();
        let others = format!("{}{more}", names.join(", "));
        let nodes = NodeList::new(conflicts.iter().map(|c| c.node.clone()));
        let (defaults, selects): (Vec<_>, Vec<_>) =
            conflicts.iter().partition(|c| c.between_defaults);
        let mut parts = Vec::new();
        if !selects.is_empty() {
            let n = NodeList::new(selects.iter().map(|c| c.node.clone()));
            parts.push(format!(
                "spec.nodeSelector of NVIDIADriver {cr} and of {others} both match {n}; make the nodeSelectors disjoint"
            ));
        }
        if !defaults.is_empty() {
            let n = NodeList::new(defaults.iter().map(|c| c.node.clone()));
            parts.push(format!(
                "NVIDIADriver {cr} and {others} are all default drivers, and the default takes {n}; set spec.default to false on all but one"
            ));
        }
        Some(format!(
            "{}. Until then {nodes} keep their current {OWNER_LABEL} label",
            parts.join("; ")
        ))
    }
}

/// Assigns each GPU node its owning NVIDIADriver.
///
/// - a non-default resource whose selector matches takes the node (an empty
///   selector matches every GPU node);
/// - otherwise the default resource takes it;
/// - two matching non-default resources, or no match and two defaults, is a
///   conflict: the node keeps its current owner label and every claimant is
///   named in [`Routing::conflicts`];
/// - a resource with a selector problem ([`validate_spec`]) claims no node,
///   and nodes it owns now keep their label ([`Routing::held`]);
/// - a node nobody claims loses its owner label ([`Routing::unowned`]).
///
/// `nodes` are the GPU nodes (their GPUs are not looked at here); resource
/// names are expected to be unique.
pub fn route(nodes: &[DriverNode], crs: &[DriverCr]) -> Routing {
    let refused: BTreeSet<&str> = crs
        .iter()
        .filter(|c| selector_refused(c))
        .map(|c| c.name.as_str())
        .collect();
    let live: Vec<&DriverCr> = crs
        .iter()
        .filter(|c| !refused.contains(c.name.as_str()))
        .collect();
    let defaults: Vec<&str> = live
        .iter()
        .filter(|c| c.is_default)
        .map(|c| c.name.as_str())
        .collect();
    let mut r = Routing::default();
    for n in nodes {
        let current = n.labels.get(OWNER_LABEL).filter(|v| !v.is_empty());
        if let Some(cur) = current
            && refused.contains(cur.as_str())
        {
            r.owners.insert(n.name.clone(), cur.clone());
            r.held.push(n.name.clone());
            continue;
        }
        let mut claimants: Vec<&str> = live
            .iter()
            .filter(|c| !c.is_default && c.selects(&n.labels))
            .map(|c| c.name.as_str())
            .collect();
        let between_defaults = claimants.is_empty();
        if claimants.is_empty() {
            claimants = defaults.clone();
        }
        claimants.sort_unstable();
        claimants.dedup();
        match claimants.as_slice() {
            [] => {
                r.unowned.push(n.name.clone());
                if current.is_some() {
                    r.labels.insert(
                        n.name.clone(),
                        LabelPatch::from([(OWNER_LABEL.to_string(), None)]),
                    );
                }
            }
            [one] => {
                r.owners.insert(n.name.clone(), (*one).to_string());
                if current.map(String::as_str) != Some(*one) {
                    r.labels.insert(
                        n.name.clone(),
                        LabelPatch::from([(OWNER_LABEL.to_string(), Some((*one).to_string()))]),
                    );
                }
            }
            many => {
                if let Some(cur) = current {
                    r.owners.insert(n.name.clone(), cur.clone());
                }
                let conflict = NodeConflict {
                    node: n.name.clone(),
                    claimants: many.iter().map(|s| (*s).to_string()).collect(),
                    between_defaults,
                    kept_owner: current.cloned(),
                };
                for c in many {
                    r.conflicts
                        .entry((*c).to_string())
                        .or_default()
                        .push(conflict.clone());
                }
            }
        }
    }
    r.held.sort();
    r.unowned.sort();
    for list in r.conflicts.values_mut() {
        list.sort_by(|a, b| a.node.cmp(&b.node));
    }
    r
}

/// The GPUs of the nodes a resource owns, deduplicated (for reports).
pub fn owned_gpus(cr: &str, routing: &Routing, nodes: &[DriverNode]) -> Vec<GpuIdentity> {
    let set: BTreeSet<GpuIdentity> = nodes
        .iter()
        .filter(|n| routing.owners.get(&n.name).map(String::as_str) == Some(cr))
        .flat_map(|n| n.gpus.iter().cloned())
        .collect();
    set.into_iter().collect()
}

/// Longest DaemonSet name: it is also the pods' `app` label value, which
/// Kubernetes caps at 63 characters.
pub const MAX_DAEMONSET_NAME: usize = 63;

/// The driver DaemonSet of one NVIDIADriver for one node pool:
/// `nvidia-<driverType>-driver-<resource>-<pool>`, shortened with a hash of
/// the full name when it is longer than [`MAX_DAEMONSET_NAME`], so two
/// resources never share a DaemonSet.
pub fn daemonset_name(cr: &str, driver_type: DriverType, pool: &str) -> String {
    let full = format!(
        "nvidia-{}-driver-{}-{pool}",
        driver_type.as_str(),
        sanitize_name_part(cr)
    );
    if full.len() <= MAX_DAEMONSET_NAME {
        return full;
    }
    // FNV-1a: stable across builds, so a name never changes under a DaemonSet.
    let hash = full.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let keep = MAX_DAEMONSET_NAME - 9;
    let mut head: String = full.chars().take(keep).collect();
    while head.ends_with(['-', '.']) {
        head.pop();
    }
    format!("{head}-{:08x}", hash as u32)
}

/// What one NVIDIADriver rolls out.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverRollout {
    /// Resource name.
    pub name: String,
    /// Why the resource is refused; empty when it rolls out. A refused
    /// resource changes nothing: its DaemonSets stay as they are.
    pub problems: Vec<NvidiaDriverError>,
    /// Nodes it owns after routing, sorted.
    pub nodes: Vec<String>,
    /// Its driver pools over those nodes, with DaemonSet names of their own
    /// ([`daemonset_name`]); empty when refused.
    pub plan: DriverPlan,
}

impl DriverRollout {
    /// Whether the resource is rolled out.
    pub fn accepted(&self) -> bool {
        self.problems.is_empty()
    }
}

/// The routing and the rollout of every NVIDIADriver.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriversPlan {
    /// Which resource owns each node, and the owner-label changes.
    pub routing: Routing,
    /// One entry per resource, in input order.
    pub drivers: Vec<DriverRollout>,
}

impl DriversPlan {
    /// The rollout of one resource.
    pub fn driver(&self, name: &str) -> Option<&DriverRollout> {
        self.drivers.iter().find(|d| d.name == name)
    }
}

/// Routes GPU nodes to resources ([`route`]), validates each resource
/// ([`validate`]) and plans the driver pools of each accepted one over the
/// nodes it owns ([`plan_driver`] with the resource's image request).
///
/// A node held back by a conflict keeps its current owner, so the DaemonSet
/// already running there keeps running; a resource that is refused plans
/// nothing and its nodes keep their owner label, so no other resource takes
/// them meanwhile.
pub fn plan_drivers(nodes: &[DriverNode], crs: &[(DriverCr, DriverRequest)]) -> DriversPlan {
    let only_crs: Vec<DriverCr> = crs.iter().map(|(c, _)| c.clone()).collect();
    let routing = route(nodes, &only_crs);
    let drivers = crs
        .iter()
        .map(|(cr, req)| {
            let mut problems = validate(cr, &routing, nodes);
            let owned: Vec<DriverNode> = nodes
                .iter()
                .filter(|n| routing.owners.get(&n.name) == Some(&cr.name))
                .cloned()
                .collect();
            let mut plan = DriverPlan::default();
            if problems.is_empty() {
                match plan_driver(req, &owned) {
                    Ok(mut p) => {
                        let prefix =
                            format!("{}-", super::components::Component::Driver.daemonset_name());
                        for pool in &mut p.pools {
                            let key = pool.name.strip_prefix(&prefix).unwrap_or(&pool.name);
                            pool.name = daemonset_name(&cr.name, cr.driver_type, key);
                        }
                        plan = p;
                    }
                    Err(e) => problems.push(NvidiaDriverError::Request {
                        cr: cr.name.clone(),
                        reason: e.to_string(),
                    }),
                }
            }
            let mut names: Vec<String> = owned.into_iter().map(|n| n.name).collect();
            names.sort();
            DriverRollout {
                name: cr.name.clone(),
                problems,
                nodes: names,
                plan,
            }
        })
        .collect();
    DriversPlan { routing, drivers }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn gpu(model: &str, arch: &str) -> GpuIdentity {
        GpuIdentity {
            model: model.into(),
            architecture: arch.into(),
        }
    }

    fn node(name: &str, labels: &[(&str, &str)], gpus: Vec<GpuIdentity>) -> DriverNode {
        DriverNode {
            name: name.into(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                .collect(),
            gpus,
        }
    }

    fn cr(name: &str, is_default: bool, selector: &[(&str, &str)]) -> DriverCr {
        DriverCr {
            name: name.into(),
            is_default,
            node_selector: selector
                .iter()
                .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                .collect(),
            version: "595.91.07".into(),
            ..DriverCr::default()
        }
    }

    fn owner_patch(v: Option<&str>) -> LabelPatch {
        LabelPatch::from([(OWNER_LABEL.to_string(), v.map(str::to_string))])
    }

    #[test]
    fn non_default_wins_and_default_catches_the_rest() {
        let nodes = [
            node("a", &[("pool", "h100")], vec![]),
            node("b", &[("pool", "a100")], vec![]),
            node("c", &[(OWNER_LABEL, "old")], vec![]),
        ];
        let r = route(
            &nodes,
            &[cr("h100", false, &[("pool", "h100")]), cr("def", true, &[])],
        );
        assert_eq!(r.owners["a"], "h100");
        assert_eq!(r.owners["b"], "def");
        assert_eq!(r.owners["c"], "def");
        assert_eq!(r.labels["a"], owner_patch(Some("h100")));
        assert_eq!(r.labels["c"], owner_patch(Some("def")));
        assert!(r.conflicts.is_empty() && r.unowned.is_empty());
        // Already labelled nodes are not patched again.
        let mut labelled = nodes.to_vec();
        for n in &mut labelled {
            n.labels
                .insert(OWNER_LABEL.into(), r.owners[&n.name].clone());
        }
        let again = route(
            &labelled,
            &[cr("h100", false, &[("pool", "h100")]), cr("def", true, &[])],
        );
        assert!(again.labels.is_empty());
        assert_eq!(again.owners, r.owners);
    }

    #[test]
    fn nodes_nobody_claims_lose_the_label() {
        let nodes = [
            node("a", &[(OWNER_LABEL, "gone")], vec![]),
            node("b", &[], vec![]),
        ];
        let r = route(&nodes, &[cr("x", false, &[("pool", "x")])]);
        assert_eq!(r.unowned, ["a", "b"]);
        assert_eq!(r.labels.len(), 1);
        assert_eq!(r.labels["a"], owner_patch(None));
    }

    #[test]
    fn empty_selector_takes_every_gpu_node() {
        let nodes = [node("a", &[], vec![]), node("b", &[("x", "y")], vec![])];
        let r = route(&nodes, &[cr("all", false, &[]), cr("def", true, &[])]);
        assert_eq!(r.owners["a"], "all");
        assert_eq!(r.owners["b"], "all");
    }

    #[test]
    fn conflicts_fail_closed_and_name_both() {
        let nodes = [
            node(
                "a",
                &[("pool", "p"), ("zone", "z"), (OWNER_LABEL, "one")],
                vec![],
            ),
            node("b", &[("pool", "p")], vec![]),
            node("c", &[], vec![]),
        ];
        let crs = [
            cr("one", false, &[("pool", "p")]),
            cr("two", false, &[("zone", "z")]),
            cr("def", true, &[]),
        ];
        let r = route(&nodes, &crs);
        assert!(!r.labels.contains_key("a"));
        assert_eq!(r.owners["a"], "one");
        assert_eq!(r.owners["b"], "one");
        assert_eq!(r.conflicts["one"][0].node, "a");
        assert_eq!(r.conflicts["two"][0].claimants, ["one", "two"]);
        assert_eq!(r.conflicts["two"][0].kept_owner.as_deref(), Some("one"));
        assert_eq!(r.conflicted_nodes(), ["a"]);
        let msg = r.conflict_message("two").unwrap();
        assert!(
            msg.contains("NVIDIADriver two and of one both match node a"),
            "{msg}"
        );
        assert!(msg.contains(OWNER_LABEL), "{msg}");
        assert!(r.conflict_message("def").is_none());

        // Two defaults: nodes that fall to the default are held; a node a
        // non-default selects is still routed.
        let r = route(
            &nodes,
            &[
                cr("one", false, &[("pool", "p")]),
                cr("d1", true, &[]),
                cr("d2", true, &[]),
            ],
        );
        assert_eq!(r.owners["a"], "one");
        assert_eq!(r.owners["b"], "one");
        assert!(!r.owners.contains_key("c") && !r.labels.contains_key("c"));
        assert!(r.conflicts["d1"][0].between_defaults);
        let msg = r.conflict_message("d2").unwrap();
        assert!(msg.contains("all default drivers"), "{msg}");
        assert!(
            msg.contains("set spec.default to false on all but one"),
            "{msg}"
        );
    }

    #[test]
    fn conflict_messages_are_capped() {
        let nodes: Vec<DriverNode> = (0..40)
            .map(|i| node(&format!("n{i:02}"), &[("pool", "p")], vec![]))
            .collect();
        let crs: Vec<DriverCr> = (0..12)
            .map(|i| cr(&format!("cr{i:02}"), false, &[("pool", "p")]))
            .collect();
        let r = route(&nodes, &crs);
        let msg = r.conflict_message("cr00").unwrap();
        assert!(msg.contains("and 35 more"), "{msg}");
        assert!(msg.contains("and 6 more"), "{msg}");
        assert!(msg.len() < 600, "{} chars: {msg}", msg.len());
    }

    #[test]
    fn spec_validation() {
        let e = validate_spec(&cr("x", false, &[(OWNER_LABEL, "y")]));
        assert!(matches!(
            e.as_slice(),
            [NvidiaDriverError::ReservedSelectorKey { .. }]
        ));
        assert!(e[0].to_string().contains(OWNER_LABEL));
        let e = validate_spec(&cr("d", true, &[("pool", "p"), ("zone", "z")]));
        assert_eq!(e.len(), 1);
        let msg = e[0].to_string();
        assert!(
            msg.contains("NVIDIADriver d") && msg.contains("pool, zone"),
            "{msg}"
        );
        assert!(msg.contains("spec.default to false"), "{msg}");
        let mut empty = cr("v", false, &[]);
        empty.version = " ".into();
        assert!(matches!(
            validate_spec(&empty).as_slice(),
            [NvidiaDriverError::EmptyVersion { .. }]
        ));
        let mut digest = cr("p", false, &[]);
        digest.version = "sha256:abc".into();
        digest.use_precompiled = true;
        assert!(matches!(
            validate_spec(&digest).as_slice(),
            [NvidiaDriverError::DigestWithPrecompiled { .. }]
        ));
        assert!(validate_spec(&cr("ok", true, &[])).is_empty());
    }

    #[test]
    fn refused_selectors_hold_their_nodes() {
        let nodes = [
            node("a", &[("pool", "p"), (OWNER_LABEL, "bad")], vec![]),
            node("b", &[("pool", "p")], vec![]),
        ];
        let r = route(
            &nodes,
            &[
                cr("bad", false, &[(OWNER_LABEL, "bad")]),
                cr("def", true, &[]),
            ],
        );
        assert_eq!(r.held, ["a"]);
        assert_eq!(r.owners["a"], "bad");
        assert!(!r.labels.contains_key("a"));
        assert_eq!(r.owners["b"], "def");
    }

    #[test]
    fn versions_the_gpus_cannot_run_are_refused() {
        let h200 = gpu("NVIDIA H200", "hopper");
        let nodes: Vec<DriverNode> = (0..7)
            .map(|i| node(&format!("h{i}"), &[("pool", "h200")], vec![h200.clone()]))
            .chain([
                node(
                    "v",
                    &[("pool", "h200")],
                    vec![gpu("Tesla V100-SXM2-32GB", "volta")],
                ),
                node("u", &[("pool", "h200")], vec![]),
            ])
            .collect();
        let mut c = cr("h200", false, &[("pool", "h200")]);
        c.version = "535.104.05".into();
        let r = route(&nodes, std::slice::from_ref(&c));
        let errs = validate(&c, &r, &nodes);
        assert_eq!(errs.len(), 1, "{errs:?}");
        let msg = errs[0].to_string();
        assert!(msg.contains("NVIDIA H200"), "{msg}");
        assert!(msg.contains("R550 or newer"), "{msg}");
        assert!(msg.contains("and 2 more"), "{msg}");
        assert!(matches!(
            &errs[0],
            NvidiaDriverError::BranchTooOld {
                min_branch: 550,
                branch: 535,
                ..
            }
        ));

        // Branch too new for Volta, named with its last branch.
        c.version = "595.91.07".into();
        let errs = validate(&c, &r, &nodes);
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert!(errs[0].to_string().contains("R580"), "{}", errs[0]);
        assert!(errs[0].to_string().contains("node v"), "{}", errs[0]);

        // vGPU resources and digests are not branch-checked.
        c.version = "535.104.05".into();
        c.driver_type = DriverType::Vgpu;
        assert!(validate(&c, &r, &nodes).is_empty());
        c.driver_type = DriverType::Gpu;
        c.version = "sha256:00".into();
        assert!(validate(&c, &r, &nodes).is_empty());

        // Nodes the resource does not own are not its concern.
        c.version = "535.104.05".into();
        let other = cr("other", false, &[]);
        assert!(validate(&other, &r, &nodes).is_empty());
        assert!(owned_gpus("h200", &r, &nodes).contains(&h200));
    }

    #[test]
    fn problems_are_capped() {
        let models = [
            "NVIDIA B200",
            "NVIDIA GB200",
            "NVIDIA H200",
            "NVIDIA H100",
            "NVIDIA L40S",
            "NVIDIA L4",
            "NVIDIA H20",
            "NVIDIA H800",
            "NVIDIA RTX PRO 6000",
            "NVIDIA B300",
        ];
        let nodes: Vec<DriverNode> = models
            .iter()
            .enumerate()
            .map(|(i, m)| node(&format!("n{i}"), &[], vec![gpu(m, "hopper")]))
            .collect();
        let mut c = cr("old", false, &[]);
        c.version = "470.1".into();
        let r = route(&nodes, std::slice::from_ref(&c));
        let errs = validate(&c, &r, &nodes);
        assert_eq!(errs.len(), MAX_PROBLEMS);
        assert!(matches!(
            errs.last(),
            Some(NvidiaDriverError::MoreProblems { more: 3, .. })
        ));
    }

    #[test]
    fn node_lists() {
        assert_eq!(NodeList::new(["a"]).to_string(), "node a");
        assert_eq!(NodeList::new(["b", "a", "a"]).to_string(), "nodes a, b");
        let many = NodeList::new((0..9).map(|i| format!("n{i}")));
        assert_eq!(many.to_string(), "nodes n0, n1, n2, n3, n4 and 4 more");
    }

    /// Nodes with a few labels out of a small vocabulary, some already
    /// labelled with an owner (possibly a stale one).
    fn arb_nodes() -> impl Strategy<Value = Vec<DriverNode>> {
        prop::collection::vec((0usize..3, 0usize..3, prop::option::of(0usize..6)), 0..20).prop_map(
            |specs| {
                specs
                    .into_iter()
                    .enumerate()
                    .map(|(i, (pool, zone, owner))| {
                        let mut labels = Labels::new();
                        labels.insert("pool".into(), format!("p{pool}"));
                        labels.insert("zone".into(), format!("z{zone}"));
                        if let Some(o) = owner {
                            labels.insert(OWNER_LABEL.into(), format!("cr{o}"));
                        }
                        DriverNode {
                            name: format!("n{i}"),
                            labels,
                            gpus: vec![],
                        }
                    })
                    .collect()
            },
        )
    }

    /// Resources with selectors over the same vocabulary; some defaults.
    fn arb_crs() -> impl Strategy<Value = Vec<DriverCr>> {
        prop::collection::vec(
            (
                any::<bool>(),
                prop::option::of(0usize..3),
                prop::option::of(0usize..3),
            ),
            0..5,
        )
        .prop_map(|specs| {
            specs
                .into_iter()
                .enumerate()
                .map(|(i, (is_default, pool, zone))| {
                    let mut node_selector = Labels::new();
                    if !is_default {
                        if let Some(p) = pool {
                            node_selector.insert("pool".into(), format!("p{p}"));
                        }
                        if let Some(z) = zone {
                            node_selector.insert("zone".into(), format!("z{z}"));
                        }
                    }
                    DriverCr {
                        name: format!("cr{i}"),
                        is_default,
                        node_selector,
                        version: "595.91.07".into(),
                        ..DriverCr::default()
                    }
                })
                .collect()
        })
    }

    proptest! {
        #[test]
        fn routing_invariants(nodes in arb_nodes(), crs in arb_crs()) {
            let r = route(&nodes, &crs);
            let conflicted = r.conflicted_nodes();
            for n in &nodes {
                let current = n.labels.get(OWNER_LABEL);
                let in_conflict = conflicted.contains(&n.name);
                let unowned = r.unowned.contains(&n.name);
                let routed = r.owners.contains_key(&n.name) && !in_conflict;
                // Exactly one outcome per node.
                prop_assert_eq!(usize::from(in_conflict) + usize::from(unowned) + usize::from(routed), 1);
                // Conflicts never relabel; the node keeps its owner.
                if in_conflict {
                    prop_assert!(!r.labels.contains_key(&n.name));
                    prop_assert_eq!(r.owners.get(&n.name), current);
                }
                // A routed node's owner selects it, or is the one default that
                // catches what no non-default selects.
                if routed {
                    let owner = &r.owners[&n.name];
                    let c = crs.iter().find(|c| &c.name == owner).unwrap();
                    let any_non_default = crs.iter().any(|c| !c.is_default && c.selects(&n.labels));
                    let rightful = if c.is_default { !any_non_default } else { c.selects(&n.labels) };
                    prop_assert!(rightful);
                }
                // The default catches every node no non-default selects.
                let defaults: Vec<&DriverCr> = crs.iter().filter(|c| c.is_default).collect();
                if defaults.len() == 1 && !crs.iter().any(|c| !c.is_default && c.selects(&n.labels)) {
                    prop_assert_eq!(r.owners.get(&n.name), Some(&defaults[0].name));
                }
                // Patches say exactly what changes.
                if let Some(p) = r.labels.get(&n.name) {
                    let want = p.get(OWNER_LABEL).cloned().flatten();
                    prop_assert_ne!(want.as_ref(), current);
                    prop_assert_eq!(want.as_ref(), r.owners.get(&n.name));
                } else if !in_conflict {
                    prop_assert_eq!(r.owners.get(&n.name), current);
                }
            }
            // Every claimant named in a conflict carries it.
            for list in r.conflicts.values() {
                for c in list {
                    prop_assert!(c.claimants.len() >= 2);
                    for name in &c.claimants {
                        prop_assert!(r.conflicts[name].contains(c));
                    }
                }
            }
        }

        #[test]
        fn unrelated_resources_change_nothing(nodes in arb_nodes(), crs in arb_crs()) {
            let before = route(&nodes, &crs);
            let mut more = crs.clone();
            more.push(DriverCr {
                name: "unrelated".into(),
                node_selector: Labels::from([("pool".to_string(), "nowhere".to_string())]),
                version: "595.91.07".into(),
                ..DriverCr::default()
            });
            let after = route(&nodes, &more);
            prop_assert_eq!(before, after);
        }
    }

    fn request(version: &str) -> DriverRequest {
        DriverRequest {
            repository: "nvcr.io/nvidia".into(),
            image: "driver".into(),
            version: version.into(),
            use_precompiled: false,
            kernel_module_type: KernelModuleType::Auto,
        }
    }

    fn with_os(mut n: DriverNode, id: &str, version: &str) -> DriverNode {
        use crate::operator::labels::{NFD_OS_ID, NFD_OS_VERSION};
        n.labels.insert(NFD_OS_ID.into(), id.into());
        n.labels.insert(NFD_OS_VERSION.into(), version.into());
        n
    }

    #[test]
    fn each_resource_gets_its_own_pools_and_versions() {
        let h100 = gpu("NVIDIA H100 80GB HBM3", "hopper");
        let nodes = [
            with_os(
                node("a", &[("pool", "h100")], vec![h100.clone()]),
                "ubuntu",
                "22.04",
            ),
            with_os(
                node("b", &[("pool", "h100")], vec![h100.clone()]),
                "ubuntu",
                "24.04",
            ),
            with_os(node("c", &[], vec![h100]), "ubuntu", "22.04"),
        ];
        let mut pinned = cr("h100", false, &[("pool", "h100")]);
        pinned.version = "570.172.08".into();
        let def = cr("default", true, &[]);
        let p = plan_drivers(
            &nodes,
            &[(pinned, request("570.172.08")), (def, request("595.91.07"))],
        );
        let h = p.driver("h100").unwrap();
        assert!(h.accepted());
        assert_eq!(h.nodes, ["a", "b"]);
        let names: Vec<&str> = h.plan.pools.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "nvidia-gpu-driver-h100-ubuntu22.04",
                "nvidia-gpu-driver-h100-ubuntu24.04"
            ]
        );
        assert!(h.plan.pools[0].image.ends_with(":570.172.08-ubuntu22.04"));
        let d = p.driver("default").unwrap();
        assert_eq!(d.nodes, ["c"]);
        assert_eq!(d.plan.pools.len(), 1);
        assert!(d.plan.pools[0].image.ends_with(":595.91.07-ubuntu22.04"));
    }

    #[test]
    fn a_refused_resource_plans_nothing_and_names_why() {
        let nodes = [with_os(node("a", &[], vec![]), "ubuntu", "22.04")];
        let mut bad = cr("bad", true, &[]);
        bad.version = String::new();
        let mut no_image = request("595.91.07");
        no_image.image = String::new();
        let p = plan_drivers(
            &nodes,
            &[
                (bad, request("")),
                (cr("x", false, &[("pool", "x")]), no_image),
            ],
        );
        let b = p.driver("bad").unwrap();
        assert!(!b.accepted() && b.plan.pools.is_empty());
        assert!(b.problems[0].to_string().contains("spec.version is empty"));
        let x = p.driver("x").unwrap();
        // Owns no node, but its request is still checked.
        assert!(x.nodes.is_empty());
        assert!(matches!(
            x.problems[..],
            [NvidiaDriverError::Request { .. }]
        ));
    }

    #[test]
    fn long_names_are_capped_and_stay_distinct() {
        let long_a = "a".repeat(70);
        let long_b = format!("{}b", "a".repeat(69));
        let a = daemonset_name(&long_a, DriverType::Gpu, "ubuntu22.04");
        let b = daemonset_name(&long_b, DriverType::Gpu, "ubuntu22.04");
        assert!(a.len() <= MAX_DAEMONSET_NAME && b.len() <= MAX_DAEMONSET_NAME);
        assert_ne!(a, b);
        assert_eq!(a, daemonset_name(&long_a, DriverType::Gpu, "ubuntu22.04"));
        assert_eq!(
            daemonset_name("My_Pool", DriverType::Vgpu, "rhel9.4"),
            "nvidia-vgpu-driver-my-pool-rhel9.4"
        );
    }

    proptest! {
        #[test]
        fn every_node_runs_at_most_one_driver(nodes in arb_nodes(), crs in arb_crs()) {
            let nodes: Vec<DriverNode> = nodes
                .into_iter()
                .map(|n| with_os(n, "ubuntu", "22.04"))
                .collect();
            let input: Vec<(DriverCr, DriverRequest)> =
                crs.iter().map(|c| (c.clone(), request(&c.version))).collect();
            let p = plan_drivers(&nodes, &input);
            let mut seen = BTreeSet::new();
            let mut names = BTreeSet::new();
            for d in &p.drivers {
                for pool in &d.plan.pools {
                    prop_assert!(pool.name.len() <= MAX_DAEMONSET_NAME);
                    prop_assert!(names.insert(pool.name.clone()), "two pools named {}", pool.name);
                    for n in &pool.nodes {
                        // A pool's nodes are nodes its resource owns.
                        prop_assert_eq!(p.routing.owners.get(n), Some(&d.name));
                        prop_assert!(seen.insert(n.clone()), "node {} in two pools", n);
                    }
                }
                if !d.accepted() {
                    prop_assert!(d.plan.pools.is_empty());
                }
            }
        }
    }
}
