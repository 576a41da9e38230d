//! MigConfig (`gpustack.io/v1alpha1`, cluster-scoped): the MIG layout of the
//! GPU nodes a node selector picks, per GPU model, as a resource instead of a
//! hand-written mig-parted ConfigMap and node label.
//!
//! The group is gpu-stack's own, not `nvidia.com`: NVIDIA has no such kind,
//! and a kind of ours under NVIDIA's group could collide with one NVIDIA adds
//! later.
//!
//! The operator turns each MigConfig into NVIDIA's MIG manager contract (see
//! [`gpu_stack_core::operator::migconfig`]): a generated config
//! `gpustack-<name>` in the mig-parted ConfigMap it writes, and the
//! `nvidia.com/mig.config` label on each selected node whose GPUs can take
//! the layout. Status lists every selected node as `Invalid` (with the
//! reason; nothing on it changes), `Pending` or `Applied`.
use std::collections::BTreeMap;

use gpu_stack_core::operator::migconfig::{
    LayoutRule, LayoutSource, MigConfigInput, NodeState, NodeStatus,
};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::operator::clusterpolicy::status::Condition;

pub mod demand;

/// Pattern of a MIG profile name (`1g.10gb`, `1c.3g.40gb`, `1g.10gb+me`,
/// `7g.80gb-me`), checked at admission; the geometry is checked per GPU.
pub const PROFILE_PATTERN: &str = r"^([1-9][0-9]?c\.)?[1-9][0-9]?g\.[1-9][0-9]{0,3}gb([+-][a-z]+(\.[a-z]+)?(,[a-z]+(\.[a-z]+)?)*)?$";

/// Most layouts one MigConfig may hold.
pub const MAX_LAYOUTS: u32 = 32;

/// Spec of a MigConfig.
// Three integer print columns repeat `type_ = "integer"`, which the lint
// takes for a duplicated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "gpustack.io",
    version = "v1alpha1",
    kind = "MigConfig",
    plural = "migconfigs",
    shortname = "migc",
    status = "MigConfigStatus",
    doc = "MigConfig sets the MIG layout of the GPU nodes its nodeSelector matches, per GPU model.",
    printcolumn(name = "Applied", type_ = "integer", json_path = ".status.applied"),
    printcolumn(name = "Pending", type_ = "integer", json_path = ".status.pending"),
    printcolumn(name = "Invalid", type_ = "integer", json_path = ".status.invalid"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct MigConfigSpec {
    /// Labels a GPU node must carry; empty selects every GPU node.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// One layout per GPU model; the one without `gpuModel` applies to
    /// every other MIG-capable model.
    /// In `Demand` mode, the starting layout of nodes no decision has
    /// changed yet.
    #[schemars(extend("maxItems" = MAX_LAYOUTS, "minItems" = 1))]
    pub layouts: Vec<MigLayout>,
    /// `Static` (the default): the layouts apply as given. `Demand`: the
    /// layouts are where nodes start, and the operator then changes the
    /// layouts of selected nodes so that pending pods asking for
    /// `nvidia.com/mig-<profile>` can be scheduled, never removing an
    /// instance in use.
    #[serde(default, skip_serializing_if = "MigConfigMode::is_static")]
    pub mode: MigConfigMode,
    /// Limits of `Demand` mode (defaults apply when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub demand: Option<DemandSettings>,
}

/// How a MigConfig's layouts are chosen.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum MigConfigMode {
    /// The layouts as given.
    #[default]
    Static,
    /// Layouts follow pending pods' MIG requests.
    Demand,
}

impl MigConfigMode {
    /// `Static`.
    pub fn is_static(&self) -> bool {
        *self == MigConfigMode::Static
    }
}

/// Default of [`DemandSettings::min_interval_seconds`].
pub const DEFAULT_MIN_INTERVAL_SECONDS: u32 = 300;
/// Default of [`DemandSettings::max_nodes_per_pass`].
pub const DEFAULT_MAX_NODES_PER_PASS: u32 = 8;
/// Default of [`DemandSettings::batch_seconds`].
pub const DEFAULT_BATCH_SECONDS: u32 = 2;

/// Limits on how fast demand mode changes layouts.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DemandSettings {
    /// A node's layout changes at most once in this many seconds (default
    /// 300).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("minimum" = 0, "maximum" = 86400))]
    pub min_interval_seconds: Option<u32>,
    /// Most nodes one decision changes (default 8); the rest wait for the
    /// next decision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("minimum" = 1, "maximum" = 1000))]
    pub max_nodes_per_pass: Option<u32>,
    /// Pending pods are collected this many seconds after the first one is
    /// seen before a decision is made (default 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("minimum" = 0, "maximum" = 300))]
    pub batch_seconds: Option<u32>,
}

impl DemandSettings {
    /// The core limits these settings give.
    pub fn limits(&self) -> gpu_stack_core::operator::migdemand::DemandLimits {
        gpu_stack_core::operator::migdemand::DemandLimits {
            min_interval_seconds: u64::from(
                self.min_interval_seconds
                    .unwrap_or(DEFAULT_MIN_INTERVAL_SECONDS),
            ),
            max_nodes_per_pass: self
                .max_nodes_per_pass
                .unwrap_or(DEFAULT_MAX_NODES_PER_PASS)
                .clamp(1, 1000) as usize,
        }
    }

    /// The batching window.
    pub fn batch(&self) -> std::time::Duration {
        std::time::Duration::from_secs(u64::from(
            self.batch_seconds.unwrap_or(DEFAULT_BATCH_SECONDS).min(300),
        ))
    }
}

/// The layout of one GPU model.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "(has(self.profiles) ? 1 : 0) + (has(self.config) ? 1 : 0) + (has(self.migEnabled) && !self.migEnabled ? 1 : 0) == 1",
    "message": "set exactly one of profiles, config, or migEnabled: false"
}, {
    "rule": "!has(self.placements) || has(self.profiles)",
    "message": "placements go with profiles: give the profile counts they place"
}]))]
pub struct MigLayout {
    /// A GPU model (`H100-SXM5-80GB`, `A100-SXM4-40GB`); absent for every
    /// model no other layout names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxLength" = 64))]
    pub gpu_model: Option<String>,
    /// MIG on with these instances: profile name to count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "profiles_schema")]
    pub profiles: Option<BTreeMap<String, u32>>,
    /// Where each instance of `profiles` goes: its first memory slice, e.g.
    /// `[{profile: 3g.40gb, start: 4}, {profile: 1g.10gb, start: 0}]`. The
    /// same instances as `profiles` counts (GPU-instance profiles only), one
    /// entry each; absent lets the MIG manager choose the starts. Checked
    /// against each selected node's GPU geometry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxItems" = MAX_PLACEMENTS))]
    pub placements: Option<Vec<MigPlacement>>,
    /// A named config of the mig-parted file (`all-balanced`, `all-1g.10gb`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxLength" = 128))]
    pub config: Option<String>,
    /// `false` turns MIG off on these GPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_enabled: Option<bool>,
}

/// Most placements one layout may give (a GPU holds at most 7 instances).
pub const MAX_PLACEMENTS: u32 = 7;

/// One GPU instance at an explicit start slice.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigPlacement {
    /// A GPU-instance profile of `profiles` (`3g.40gb`, `1g.10gb+me`).
    #[schemars(extend("pattern" = PROFILE_PATTERN, "maxLength" = 64))]
    pub profile: String,
    /// Its first memory slice (0-7); the profile's allowed starts are
    /// checked per GPU model (`gpu-stack mig profiles --model MODEL`).
    #[schemars(extend("minimum" = 0, "maximum" = 7))]
    pub start: u32,
}

fn profiles_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "description": "MIG profile name to instance count.",
        "maxProperties": 16,
        "propertyNames": {"pattern": PROFILE_PATTERN},
        "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 64},
        "x-kubernetes-validations": [{
            "rule": "self.all(k, k.matches('^([1-9][0-9]?c\\\\.)?[1-9][0-9]?g\\\\.[1-9][0-9]{0,3}gb([+-][a-z]+(\\\\.[a-z]+)?(,[a-z]+(\\\\.[a-z]+)?)*)?$'))",
            "message": "profile names look like 1g.10gb, 3g.40gb, 1g.10gb+me or 1c.3g.40gb"
        }]
    })
}

/// Status of a MigConfig.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigConfigStatus {
    /// `Ready` (every selected node applied) and `Error` (the MigConfig is
    /// refused, or some node is invalid).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Selected nodes with their layout applied.
    #[serde(default)]
    pub applied: i64,
    /// Selected nodes waiting for the MIG manager.
    #[serde(default)]
    pub pending: i64,
    /// Selected nodes refused (nothing on them changes).
    #[serde(default)]
    pub invalid: i64,
    /// Every selected node, by name (at most 1,000; the counts cover all).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<MigConfigNode>,
    /// The mig-parted config generated for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_name: Option<String>,
    /// Generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Demand` mode: what was decided. Written by the demand controller
    /// alone (its own field manager), never by the status pass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub demand: Option<MigDemandStatus>,
}

/// Most nodes or profiles one [`MigDemandStatus`] list holds.
pub const MAX_DEMAND_LIST: u32 = 1000;

/// What demand mode decided last.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigDemandStatus {
    /// When the last decision was made (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_decision_time: Option<String>,
    /// What it decided, in words.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// Instances pending pods asked for then, per profile.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pending: BTreeMap<String, u32>,
    /// Of those, what no layout change could serve, per profile.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub unmet: BTreeMap<String, u32>,
    /// Nodes the plan would change that the rate limit held back.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("maxItems" = MAX_DEMAND_LIST))]
    pub deferred: Vec<String>,
    /// The layout decided for each node demand mode changed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("maxItems" = MAX_DEMAND_LIST))]
    pub nodes: Vec<MigDemandNode>,
}

/// A node's decided layout.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigDemandNode {
    /// Node name.
    pub name: String,
    /// When it was decided (RFC 3339).
    pub decided_at: String,
    /// The generated mig-parted config holding it.
    pub config_name: String,
    /// Each GPU's layout.
    #[schemars(extend("maxItems" = 32))]
    pub gpus: Vec<MigDemandGpu>,
}

/// One GPU of a decided layout.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigDemandGpu {
    /// GPU index on the node.
    pub index: u32,
    /// Instances as `profile@start`.
    #[schemars(extend("maxItems" = 16))]
    pub layout: Vec<String>,
}

impl MigDemandNode {
    /// The core record (`None` when a field does not parse).
    pub fn decided(&self) -> Option<gpu_stack_core::operator::migdemand::Decided> {
        let at: k8s_openapi::jiff::Timestamp = self.decided_at.parse().ok()?;
        Some(gpu_stack_core::operator::migdemand::Decided {
            node: self.name.clone(),
            at: u64::try_from(at.as_second()).ok()?,
            gpus: self
                .gpus
                .iter()
                .map(|g| {
                    let layout = g
                        .layout
                        .iter()
                        .map(|i| i.parse().ok())
                        .collect::<Option<Vec<_>>>()?;
                    Some((g.index, layout))
                })
                .collect::<Option<Vec<_>>>()?,
        })
    }

    /// The status entry of a core record for MigConfig `migconfig`.
    pub fn from_decided(migconfig: &str, d: &gpu_stack_core::operator::migdemand::Decided) -> Self {
        let at = i64::try_from(d.at)
            .ok()
            .and_then(|s| k8s_openapi::jiff::Timestamp::from_second(s).ok())
            .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
        MigDemandNode {
            name: d.node.clone(),
            decided_at: at.to_string(),
            config_name: gpu_stack_core::operator::migdemand::node_config(migconfig, &d.gpus).name,
            gpus: d
                .gpus
                .iter()
                .map(|(i, l)| MigDemandGpu {
                    index: *i,
                    layout: l.iter().map(ToString::to_string).collect(),
                })
                .collect(),
        }
    }
}

/// One node in a MigConfig's status.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigConfigNode {
    /// Node name.
    pub name: String,
    /// `Invalid`, `Pending` or `Applied`.
    pub state: String,
    /// Why it is invalid, or what it waits for.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
}

impl MigConfigNode {
    /// The status entry of a planner verdict.
    pub fn from_status(s: &NodeStatus) -> Self {
        MigConfigNode {
            name: s.node.clone(),
            state: match s.state {
                NodeState::Invalid => "Invalid",
                NodeState::Pending => "Pending",
                NodeState::Applied => "Applied",
            }
            .into(),
            reason: s.reason.clone(),
        }
    }
}

impl MigConfig {
    /// Whether it is in `Demand` mode and not being deleted.
    pub fn is_demand(&self) -> bool {
        self.spec.mode == MigConfigMode::Demand && self.metadata.deletion_timestamp.is_none()
    }

    /// The decisions its status remembers (entries that do not parse are
    /// left out).
    pub fn decided(&self) -> Vec<gpu_stack_core::operator::migdemand::Decided> {
        self.status
            .iter()
            .filter_map(|s| s.demand.as_ref())
            .flat_map(|d| &d.nodes)
            .filter_map(MigDemandNode::decided)
            .collect()
    }

    /// The resource's name (empty when the object has none).
    pub fn name(&self) -> &str {
        self.metadata.name.as_deref().unwrap_or_default()
    }

    /// The planner's input. A profile name that does not parse is kept out
    /// and reported by [`MigConfig::profile_problems`].
    pub fn input(&self) -> MigConfigInput {
        let rules = self
            .spec
            .layouts
            .iter()
            .map(|l| LayoutRule {
                model: l.gpu_model.clone(),
                source: match (&l.profiles, &l.config) {
                    (Some(p), _) => LayoutSource::Profiles(
                        p.iter()
                            .filter_map(|(name, n)| Some((name.parse().ok()?, *n)))
                            .collect(),
                    ),
                    (None, Some(c)) => LayoutSource::Named(c.clone()),
                    (None, None) => LayoutSource::Disabled,
                },
                placements: l.placements.as_ref().map(|list| {
                    list.iter()
                        .filter_map(|p| {
                            Some(gpu_stack_core::mig::PlacedInstance::new(
                                p.profile.parse().ok()?,
                                p.start,
                            ))
                        })
                        .collect()
                }),
            })
            .collect();
        MigConfigInput {
            name: self.name().to_string(),
            node_selector: self.spec.node_selector.clone(),
            rules,
        }
    }

    /// What admission cannot check in a document that reached the operator
    /// anyway (the in-memory cluster, or an older CRD): profile names that
    /// do not parse, and layouts that set more than one source.
    pub fn profile_problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (i, l) in self.spec.layouts.iter().enumerate() {
            let sources = usize::from(l.profiles.is_some())
                + usize::from(l.config.is_some())
                + usize::from(l.mig_enabled == Some(false));
            if sources != 1 {
                out.push(format!(
                    "MigConfig {}: spec.layouts[{i}]: set exactly one of profiles, config, or migEnabled: false",
                    self.name()
                ));
            }
            for (j, p) in l.placements.iter().flatten().enumerate() {
                if let Err(e) = p.profile.parse::<gpu_stack_core::mig::MigProfileName>() {
                    out.push(format!(
                        "MigConfig {}: spec.layouts[{i}].placements[{j}].profile: {e}",
                        self.name()
                    ));
                }
            }
            if l.placements
                .as_ref()
                .is_some_and(|p| p.len() > MAX_PLACEMENTS as usize)
            {
                out.push(format!(
                    "MigConfig {}: spec.layouts[{i}].placements has more than {MAX_PLACEMENTS} entries; a GPU holds at most {MAX_PLACEMENTS} instances",
                    self.name()
                ));
            }
            for name in l.profiles.iter().flat_map(|p| p.keys()) {
                if let Err(e) = name.parse::<gpu_stack_core::mig::MigProfileName>() {
                    out.push(format!(
                        "MigConfig {}: spec.layouts[{i}].profiles: {e}",
                        self.name()
                    ));
                }
            }
        }
        let max = gpu_stack_core::operator::migdemand::MAX_DEMAND_NAME;
        if self.spec.mode == MigConfigMode::Demand && self.name().len() > max {
            out.push(format!(
                "MigConfig {}: the name is {} characters; in Demand mode at most {max} fit in the nvidia.com/mig.config label with the generated suffix; use a shorter name",
                self.name(),
                self.name().len()
            ));
        }
        if self.spec.layouts.len() > MAX_LAYOUTS as usize {
            out.push(format!(
                "MigConfig {}: spec.layouts has {} entries; at most {MAX_LAYOUTS}",
                self.name(),
                self.spec.layouts.len()
            ));
        }
        out.truncate(8);
        out
    }
}

/// The MigConfig CRD as YAML, generated from these types (what
/// `gpu-stack crdgen --kind migconfig` prints and
/// `deploy/crds/gpustack.io_migconfigs.yaml` holds).
pub fn crd_yaml() -> Result<String, serde_saphyr::SerializeError> {
    use kube::CustomResourceExt;
    serde_saphyr::to_string(&MigConfig::crd())
}

#[cfg(test)]
mod tests;
