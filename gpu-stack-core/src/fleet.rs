//! Fleet description files: nodes, their GPUs and MIG state, in YAML.
//!
//! One format serves `gpu-stack mig plan --fleet`, the simulated GPU backend
//! and the demo:
//!
//! ```yaml
//! nodes:
//!   - name: node-a
//!     labels: { feature.node.kubernetes.io/kernel-version.full: "6.8.0" }
//!     gpus:
//!       - model: A100-SXM4-40GB       # catalog name or PCI id (0x20B010DE)
//!         count: 2                    # default 1
//!         mig:
//!           enabled: true
//!           instances: ["3g.20gb@4", "1g.5gb@0"]
//!           in-use: ["3g.20gb@4"]
//! ```
//!
//! Every struct denies unknown fields, and every optional field has a serde
//! default, so new optional fields can be added without breaking files.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::backend::{FaultSpec, SimTelemetry};
use crate::catalog::{self, GpuModel};
use crate::mig::{self, FleetGpu, PlacedInstance};

/// A whole fleet file.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fleet {
    /// Nodes in the fleet.
    #[serde(default)]
    pub nodes: Vec<FleetNode>,
}

/// One node.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetNode {
    /// Node name (unique in the fleet).
    pub name: String,
    /// Extra node labels (e.g. OS release, kernel) for the operator.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// GPU groups on the node.
    #[serde(default)]
    pub gpus: Vec<FleetGpuSpec>,
    /// Simulated GPUs: telemetry profile of the node's GPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub telemetry: Option<SimTelemetry>,
    /// Simulated GPUs: faults to inject (Xid, falling off the bus, failing or slow calls).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub faults: Vec<FaultSpec>,
    /// Simulated GPUs: MIG mode changes wait for a GPU reset.
    #[serde(
        default,
        rename = "mig-change-needs-reset",
        skip_serializing_if = "std::ops::Not::not"
    )]
    pub mig_change_needs_reset: bool,
    /// Simulated GPUs: the driver version the node reports.
    #[serde(
        default,
        rename = "driver-version",
        skip_serializing_if = "Option::is_none"
    )]
    pub driver_version: Option<String>,
}

/// A group of identical GPUs on a node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetGpuSpec {
    /// Catalog name or PCI device id.
    pub model: String,
    /// How many GPUs of this kind (each gets the same MIG state).
    #[serde(default = "one")]
    pub count: u32,
    /// MIG state; absent means MIG disabled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigState>,
    /// Simulated GPUs: telemetry profile of these GPUs (the node's when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub telemetry: Option<SimTelemetry>,
}

fn one() -> u32 {
    1
}

/// MIG state of a GPU.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigState {
    /// Whether MIG mode is on.
    #[serde(default)]
    pub enabled: bool,
    /// Current GPU instances at explicit placements.
    #[serde(default)]
    pub instances: Vec<PlacedInstance>,
    /// Instances that pods use now (a subset of `instances`).
    #[serde(default, rename = "in-use")]
    pub in_use: Vec<PlacedInstance>,
}

/// A fleet file that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FleetError {
    /// Not YAML of the expected shape.
    #[error("fleet file is malformed: {0}")]
    Parse(String),
    /// A node-level problem.
    #[error("fleet node {node:?}: {reason}")]
    Node {
        /// Node name.
        node: String,
        /// What is wrong.
        reason: String,
    },
    /// A GPU-level problem.
    #[error("fleet node {node:?}, gpus[{index}] ({model}): {reason}")]
    Gpu {
        /// Node name.
        node: String,
        /// Index in the node's `gpus` list.
        index: usize,
        /// Model as written.
        model: String,
        /// What is wrong.
        reason: String,
    },
}

/// One physical GPU of a fleet, with its model resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedGpu {
    /// Node name.
    pub node: String,
    /// GPU index on the node (after expanding `count`).
    pub index: u32,
    /// Catalog model.
    pub model: &'static GpuModel,
    /// MIG state (default: disabled).
    pub mig: MigState,
}

impl ResolvedGpu {
    /// `node/gpuN`, the id used in plans.
    pub fn id(&self) -> String {
        format!("{}/gpu{}", self.node, self.index)
    }
}

impl Fleet {
    /// Parses and validates a fleet file.
    pub fn from_yaml(text: &str) -> Result<Fleet, FleetError> {
        let fleet: Fleet = if text.trim().is_empty() {
            Fleet::default()
        } else {
            serde_yaml::from_str(text).map_err(|e| FleetError::Parse(e.to_string()))?
        };
        fleet.validate()?;
        Ok(fleet)
    }

    /// Checks names, models and MIG layouts.
    pub fn validate(&self) -> Result<(), FleetError> {
        for (i, node) in self.nodes.iter().enumerate() {
            if node.name.trim().is_empty() {
                return Err(FleetError::Node {
                    node: format!("nodes[{i}]"),
                    reason: "name is empty".into(),
                });
            }
            if self.nodes[..i].iter().any(|n| n.name == node.name) {
                return Err(FleetError::Node {
                    node: node.name.clone(),
                    reason: "node name appears twice; node names must be unique".into(),
                });
            }
            for (gi, spec) in node.gpus.iter().enumerate() {
                let err = |reason: String| FleetError::Gpu {
                    node: node.name.clone(),
                    index: gi,
                    model: spec.model.clone(),
                    reason,
                };
                let model = catalog::lookup(&spec.model).map_err(|e| err(e.to_string()))?;
                if spec.count == 0 {
                    return Err(err("count is 0; omit the entry or give at least 1".into()));
                }
                let Some(state) = &spec.mig else { continue };
                let Some(geometry) = &model.mig else {
                    if state.enabled || !state.instances.is_empty() {
                        return Err(err(format!(
                            "{} does not support MIG; remove the mig section",
                            model.name
                        )));
                    }
                    continue;
                };
                if !state.enabled && !state.instances.is_empty() {
                    return Err(err(
                        "MIG instances are listed but MIG is not enabled; set enabled: true".into(),
                    ));
                }
                if let Err(violations) = mig::validate(geometry, &state.instances) {
                    let reasons: Vec<String> = violations.iter().map(|v| v.to_string()).collect();
                    return Err(err(format!("invalid MIG layout: {}", reasons.join("; "))));
                }
                let mut pool = state.instances.clone();
                for inst in &state.in_use {
                    match pool.iter().position(|p| p == inst) {
                        Some(i) => {
                            pool.swap_remove(i);
                        }
                        None => {
                            return Err(err(format!(
                                "in-use instance {inst} is not listed under instances"
                            )));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Every physical GPU, in file order (`count` expanded). Call on a fleet
    /// that passed [`Fleet::validate`]; GPUs with unknown models are skipped.
    pub fn gpus(&self) -> Vec<ResolvedGpu> {
        let mut out = Vec::new();
        for node in &self.nodes {
            let mut index = 0u32;
            for spec in &node.gpus {
                let Ok(model) = catalog::lookup(&spec.model) else {
                    continue;
                };
                for _ in 0..spec.count {
                    out.push(ResolvedGpu {
                        node: node.name.clone(),
                        index,
                        model,
                        mig: spec.mig.clone().unwrap_or_default(),
                    });
                    index += 1;
                }
            }
        }
        out
    }

    /// The MIG-capable GPUs as input for [`mig::plan_fleet`].
    pub fn planner_gpus(&self) -> Vec<FleetGpu<'static>> {
        self.gpus()
            .into_iter()
            .filter_map(|g| {
                let geometry = g.model.mig.as_ref()?;
                Some(FleetGpu {
                    id: g.id(),
                    geometry,
                    mig_enabled: g.mig.enabled,
                    current: g.mig.instances,
                    in_use: g.mig.in_use,
                })
            })
            .collect()
    }
}
