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
//!     processes:                      # simulated GPUs: compute processes running
//!       - { gpu: 0, pid: 4242, instance: "3g.20gb@4", used-memory-mib: 2048 }
//! ```
//!
//! Every struct denies unknown fields, and every optional field has a serde
//! default, so new optional fields can be added without breaking files.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::backend::{FaultSpec, SimTelemetry};
use crate::catalog::{self, GpuModel};
use crate::mig::{self, FleetGpu, PlacedInstance};

/// Most nodes one fleet file may describe.
pub const MAX_NODES: usize = 10_000;

/// Most GPUs one node may have (the sum of its `count`s); real servers have 8
/// or 16.
pub const MAX_GPUS_PER_NODE: u32 = 64;

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
    /// Simulated GPUs: compute processes running on the node's GPUs (on a MIG
    /// instance when MIG is on), as the driver's process list reports them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub processes: Vec<FleetProcess>,
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

/// A compute process on a simulated GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct FleetProcess {
    /// Index of the GPU on the node (after `count` is expanded).
    pub gpu: u32,
    /// Process id (not 0).
    pub pid: u32,
    /// The MIG instance it runs on (`profile@start`, one of the GPU's
    /// `instances`); required when MIG is on, absent when it is off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<PlacedInstance>,
    /// GPU memory it uses, in MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_memory_mib: Option<u64>,
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
    /// The file nests too deeply or is too large to parse safely.
    #[error("fleet file refused before parsing: {0}")]
    Refused(#[from] crate::yaml_guard::DepthError),
    /// A node-level problem.
    #[error("fleet node {}: {reason}", crate::echo::quoted(.node))]
    Node {
        /// Node name.
        node: String,
        /// What is wrong.
        reason: String,
    },
    /// A GPU-level problem.
    #[error(
        "fleet node {}, gpus[{index}] ({}): {reason}",
        crate::echo::quoted(.node),
        crate::echo::clipped(.model)
    )]
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

/// Checks a node's `processes` against its GPUs and their MIG state.
fn validate_processes(node: &FleetNode) -> Result<(), String> {
    let mut gpus: Vec<Option<&MigState>> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for spec in &node.gpus {
        for _ in 0..spec.count {
            gpus.push(spec.mig.as_ref());
        }
    }
    for (i, p) in node.processes.iter().enumerate() {
        let what = format!("processes[{i}] (pid {} on GPU {})", p.pid, p.gpu);
        if p.pid == 0 {
            return Err(format!("{what}: pid 0 is not a process id"));
        }
        if !seen.insert((p.pid, p.gpu)) {
            return Err(format!(
                "{what}: the pid appears twice on this GPU; give each process its own pid"
            ));
        }
        let Some(mig) = gpus.get(p.gpu as usize) else {
            return Err(format!(
                "{what}: the node has {} GPUs; use an index below that",
                gpus.len()
            ));
        };
        let mig_on = mig.is_some_and(|m| m.enabled);
        match (&p.instance, mig_on) {
            (None, true) => {
                return Err(format!(
                    "{what}: MIG is on, so the process runs on a MIG instance; add instance: \"PROFILE@START\" naming one of the GPU's instances"
                ));
            }
            (Some(inst), false) => {
                return Err(format!(
                    "{what}: names instance {inst} but MIG is off on that GPU; drop instance or enable MIG"
                ));
            }
            (Some(inst), true) => {
                if !mig.is_some_and(|m| m.instances.contains(inst)) {
                    return Err(format!(
                        "{what}: instance {inst} is not listed under the GPU's mig.instances"
                    ));
                }
            }
            (None, false) => {}
        }
    }
    Ok(())
}

impl Fleet {
    /// Parses and validates a fleet file. Text nesting deeper than
    /// [`crate::yaml_guard::MAX_DEPTH`] or larger than
    /// [`crate::yaml_guard::MAX_BYTES`] is refused before parsing.
    pub fn from_yaml(text: &str) -> Result<Fleet, FleetError> {
        let fleet: Fleet = if text.trim().is_empty() {
            Fleet::default()
        } else {
            crate::yaml_guard::check(text)?;
            crate::yaml_guard::from_str(text)
                .map_err(|e| FleetError::Parse(crate::yaml_guard::message(&e)))?
        };
        fleet.validate()?;
        Ok(fleet)
    }

    /// Checks names, models and MIG layouts.
    pub fn validate(&self) -> Result<(), FleetError> {
        if self.nodes.len() > MAX_NODES {
            return Err(FleetError::Parse(format!(
                "nodes lists {} nodes, more than the {MAX_NODES} one fleet file may have; split the fleet into several files",
                self.nodes.len()
            )));
        }
        let mut names = std::collections::HashSet::new();
        for (i, node) in self.nodes.iter().enumerate() {
            if node.name.trim().is_empty() {
                return Err(FleetError::Node {
                    node: format!("nodes[{i}]"),
                    reason: "name is empty".into(),
                });
            }
            if !names.insert(node.name.as_str()) {
                return Err(FleetError::Node {
                    node: node.name.clone(),
                    reason: "node name appears twice; node names must be unique".into(),
                });
            }
            // Bounds the GPUs before anything is sized by the counts.
            let mut total = 0u32;
            for (gi, spec) in node.gpus.iter().enumerate() {
                total = total.saturating_add(spec.count);
                if total > MAX_GPUS_PER_NODE {
                    return Err(FleetError::Gpu {
                        node: node.name.clone(),
                        index: gi,
                        model: spec.model.clone(),
                        reason: format!(
                            "count {} brings the node to {total} GPUs, more than the {MAX_GPUS_PER_NODE} a node may have; lower count",
                            spec.count
                        ),
                    });
                }
            }
            validate_processes(node).map_err(|reason| FleetError::Node {
                node: node.name.clone(),
                reason,
            })?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn deep_inputs() -> [String; 2] {
        [
            "[".repeat(100_000),
            format!("{}1{}", "{a: ".repeat(100_000), "}".repeat(100_000)),
        ]
    }

    #[test]
    fn deeply_nested_fleet_is_refused_before_parsing() {
        for text in deep_inputs() {
            let e = Fleet::from_yaml(&text).unwrap_err();
            assert!(
                matches!(
                    e,
                    FleetError::Refused(crate::yaml_guard::DepthError::TooDeep { .. })
                ),
                "{e}"
            );
            assert!(
                e.to_string()
                    .starts_with("fleet file refused before parsing: YAML nests deeper than 64"),
                "{e}"
            );
        }
    }

    fn node(processes: &str) -> String {
        format!(
            "nodes:\n  - name: n\n    gpus:\n      - model: A100-SXM4-40GB\n        count: 2\n        mig: {{enabled: true, instances: [\"3g.20gb@4\", \"1g.5gb@0\"]}}\n      - model: A100-SXM4-40GB\n    processes: {processes}\n"
        )
    }

    #[test]
    fn processes_parse_and_resolve_per_gpu() {
        let fleet = Fleet::from_yaml(&node(
            "[{gpu: 1, pid: 7, instance: \"3g.20gb@4\", used-memory-mib: 512}, {gpu: 2, pid: 8}]",
        ))
        .unwrap();
        let p = &fleet.nodes[0].processes;
        assert_eq!(p.len(), 2);
        assert_eq!(
            p[0].instance,
            Some("3g.20gb@4".parse::<PlacedInstance>().unwrap())
        );
        assert_eq!(p[0].used_memory_mib, Some(512));
        assert_eq!(p[1].instance, None);
    }

    #[test]
    fn gpu_and_node_counts_are_bounded_before_anything_is_sized_by_them() {
        let text = "nodes:\n  - name: n\n    gpus:\n      - model: A100-SXM4-40GB\n        count: 4294967295\n";
        let e = Fleet::from_yaml(text).unwrap_err().to_string();
        assert!(
            e.contains("count 4294967295") && e.contains("more than the 64"),
            "{e}"
        );
        let two = "nodes:\n  - name: n\n    gpus:\n      - {model: A100-SXM4-40GB, count: 40}\n      - {model: A100-SXM4-40GB, count: 40}\n";
        let e = Fleet::from_yaml(two).unwrap_err().to_string();
        assert!(e.contains("gpus[1]") && e.contains("80 GPUs"), "{e}");
        let ok = "nodes:\n  - name: n\n    gpus:\n      - {model: A100-SXM4-40GB, count: 64}\n";
        assert_eq!(Fleet::from_yaml(ok).unwrap().gpus().len(), 64);
        let many = Fleet {
            nodes: (0..=MAX_NODES)
                .map(|i| FleetNode {
                    name: format!("n{i}"),
                    ..FleetNode::default()
                })
                .collect(),
        };
        let e = many.validate().unwrap_err().to_string();
        assert!(e.contains("10001 nodes") && e.contains("10000"), "{e}");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Any per-node GPU total above the bound is refused, whatever the
        /// split into groups; the message names the count and the bound.
        #[test]
        fn any_gpu_total_above_the_bound_is_refused(
            counts in proptest::collection::vec(1u32..=u32::MAX, 1..4),
            name_len in 1usize..5_000,
        ) {
            let name = "n".repeat(name_len);
            let fleet = Fleet {
                nodes: vec![FleetNode {
                    name,
                    gpus: counts
                        .iter()
                        .map(|&count| FleetGpuSpec {
                            model: "A100-SXM4-40GB".into(),
                            count,
                            mig: None,
                            telemetry: None,
                        })
                        .collect(),
                    ..FleetNode::default()
                }],
            };
            let total: u64 = counts.iter().map(|&c| u64::from(c)).sum();
            let r = fleet.validate();
            proptest::prop_assert_eq!(r.is_ok(), total <= u64::from(MAX_GPUS_PER_NODE));
            if let Err(e) = r {
                let e = e.to_string();
                proptest::prop_assert!(e.contains("more than the 64") && e.len() < 600, "{e}");
            }
        }
    }

    #[test]
    fn bad_processes_are_refused_with_the_reason() {
        for (processes, needle) in [
            ("[{gpu: 0, pid: 7}]", "add instance"),
            ("[{gpu: 2, pid: 7, instance: \"1g.5gb@0\"}]", "MIG is off"),
            ("[{gpu: 0, pid: 7, instance: \"1g.5gb@6\"}]", "not listed"),
            ("[{gpu: 3, pid: 7}]", "has 3 GPUs"),
            ("[{gpu: 2, pid: 0}]", "pid 0"),
            ("[{gpu: 2, pid: 5}, {gpu: 2, pid: 5}]", "twice"),
        ] {
            let err = Fleet::from_yaml(&node(processes)).unwrap_err().to_string();
            assert!(err.contains(needle), "{processes}: {err}");
        }
    }
}
