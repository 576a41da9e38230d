//! What a simulated node is made of: its GPUs, faults and telemetry profile,
//! read from a fleet file or built by hand, and the errors in such a description.

use std::path::Path;

use gpu_stack_core::backend::{FaultSpec, SimTelemetry};
use gpu_stack_core::catalog;
use gpu_stack_core::fleet::{Fleet, FleetNode, FleetProcess};
use gpu_stack_core::mig::PlacedInstance;

use gpu_stack_core::backend::BackendError;

/// Driver version the simulated node reports unless the spec says otherwise.
pub const DEFAULT_DRIVER_VERSION: &str = "570.133.20";

/// Problems in a simulated node description.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A GPU model is not in the catalog.
    #[error("node {node}, GPU {gpu}: {source}")]
    UnknownModel {
        /// Node.
        node: String,
        /// GPU index.
        gpu: u32,
        /// Catalog error.
        source: catalog::CatalogError,
    },
    /// An initial MIG layout is not valid on its GPU.
    #[error("node {node}, GPU {gpu} ({model}): initial MIG layout {layout} is invalid: {reasons}")]
    InvalidLayout {
        /// Node.
        node: String,
        /// GPU index.
        gpu: u32,
        /// Model.
        model: String,
        /// Layout as written.
        layout: String,
        /// Broken rules.
        reasons: String,
    },
    /// MIG is asked of a GPU without MIG.
    #[error("node {node}, GPU {gpu}: {model} has no MIG; remove its mig section")]
    NoMig {
        /// Node.
        node: String,
        /// GPU index.
        gpu: u32,
        /// Model.
        model: String,
    },
    /// A fault names a GPU the node does not have.
    #[error("node {node}: fault names GPU {gpu} but the node has {count} GPUs")]
    FaultGpu {
        /// Node.
        node: String,
        /// GPU index named.
        gpu: u32,
        /// GPUs on the node.
        count: usize,
    },
    /// A declared process cannot run where it is placed.
    #[error("node {node}, GPU {gpu}: process {pid}: {reason}")]
    BadProcess {
        /// Node.
        node: String,
        /// GPU index.
        gpu: u32,
        /// Process id.
        pid: u32,
        /// What is wrong.
        reason: String,
    },
    /// The fleet file could not be used.
    #[error("{0}")]
    Fleet(String),
    /// The state file could not be opened.
    #[error(transparent)]
    State(#[from] BackendError),
}

/// One GPU of a simulated node.
#[derive(Debug, Clone, PartialEq)]
pub struct SimGpuSpec {
    /// Catalog model name or PCI device id.
    pub model: String,
    /// MIG mode at start.
    pub mig_enabled: bool,
    /// GPU instances at start (each gets one full compute instance).
    pub instances: Vec<PlacedInstance>,
    /// Instances pods use now (a subset of `instances`): their compute instances
    /// cannot be destroyed and the GPU's MIG mode cannot change.
    pub in_use: Vec<PlacedInstance>,
    /// Telemetry profile; the node's when `None`.
    pub telemetry: Option<SimTelemetry>,
    /// Compute processes running at start (the `gpu` field is ignored; an
    /// `instance` must be one of `instances`). They end when their instance is
    /// destroyed or the MIG mode changes; a GPU reset is refused while any run.
    pub processes: Vec<FleetProcess>,
}

impl SimGpuSpec {
    /// A GPU of `model` with MIG off.
    pub fn new(model: &str) -> Self {
        SimGpuSpec {
            model: model.to_string(),
            mig_enabled: false,
            instances: Vec::new(),
            in_use: Vec::new(),
            telemetry: None,
            processes: Vec::new(),
        }
    }
}

/// A simulated node.
#[derive(Debug, Clone, PartialEq)]
pub struct SimNodeSpec {
    /// Node name (part of every UUID, so nodes differ).
    pub node: String,
    /// GPUs in index order.
    pub gpus: Vec<SimGpuSpec>,
    /// Faults, scheduled relative to the start of the simulation.
    pub faults: Vec<FaultSpec>,
    /// Telemetry profile of the node's GPUs.
    pub telemetry: SimTelemetry,
    /// MIG mode changes need a GPU reset before they take effect.
    pub mig_change_needs_reset: bool,
    /// Driver version reported.
    pub driver_version: String,
}

impl SimNodeSpec {
    /// A node with `count` GPUs of `model`, MIG off, no faults.
    pub fn uniform(node: &str, model: &str, count: u32) -> Self {
        SimNodeSpec {
            node: node.to_string(),
            gpus: (0..count).map(|_| SimGpuSpec::new(model)).collect(),
            faults: Vec::new(),
            telemetry: SimTelemetry::default(),
            mig_change_needs_reset: false,
            driver_version: DEFAULT_DRIVER_VERSION.to_string(),
        }
    }
}

impl SimNodeSpec {
    /// The node `node` of a fleet; `None` picks the only node that has GPUs.
    pub fn from_fleet(fleet: &Fleet, node: Option<&str>) -> Result<Self, SimError> {
        let with_gpus: Vec<&FleetNode> =
            fleet.nodes.iter().filter(|n| !n.gpus.is_empty()).collect();
        let n = match node {
            Some(name) => fleet.nodes.iter().find(|n| n.name == name).ok_or_else(|| {
                SimError::Fleet(format!(
                    "the fleet has no node {name:?} (nodes: {})",
                    fleet
                        .nodes
                        .iter()
                        .map(|n| n.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?,
            None => match with_gpus.as_slice() {
                [one] => *one,
                [] => return Err(SimError::Fleet("the fleet has no node with GPUs".into())),
                many => {
                    return Err(SimError::Fleet(format!(
                        "the fleet has {} nodes with GPUs; pick one with --node ({})",
                        many.len(),
                        gpu_stack_core::echo::join_capped(
                            &many.iter().map(|n| n.name.as_str()).collect::<Vec<_>>()
                        )
                    )));
                }
            },
        };
        let mut gpus = Vec::new();
        for g in &n.gpus {
            let mig = g.mig.clone().unwrap_or_default();
            for _ in 0..g.count {
                let index = gpus.len() as u32;
                gpus.push(SimGpuSpec {
                    model: g.model.clone(),
                    mig_enabled: mig.enabled,
                    instances: mig.instances.clone(),
                    in_use: mig.in_use.clone(),
                    telemetry: g.telemetry,
                    processes: n
                        .processes
                        .iter()
                        .filter(|p| p.gpu == index)
                        .cloned()
                        .collect(),
                });
            }
        }
        Ok(SimNodeSpec {
            node: n.name.clone(),
            gpus,
            faults: n.faults.clone(),
            telemetry: n.telemetry.unwrap_or_default(),
            mig_change_needs_reset: n.mig_change_needs_reset,
            driver_version: n
                .driver_version
                .clone()
                .unwrap_or_else(|| DEFAULT_DRIVER_VERSION.to_string()),
        })
    }

    /// Reads a fleet file and takes node `node` from it.
    pub fn from_fleet_file(path: &Path, node: Option<&str>) -> Result<Self, SimError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            SimError::Fleet(format!("cannot read fleet file {}: {e}", path.display()))
        })?;
        let fleet = Fleet::from_yaml(&text)
            .map_err(|e| SimError::Fleet(format!("{}: {e}", path.display())))?;
        Self::from_fleet(&fleet, node)
    }
}
