//! Failures of the demo: reading its fleet, running its agents and operator
//! passes, and writing its output.
use std::path::PathBuf;

use gpu_stack_core::backend::BackendError;
use gpu_stack_core::fleet::FleetError;

use crate::migmanager::ManagerError;
use crate::operator::OperatorError;
use crate::operator::cluster::ClusterError;

/// Failures of the demo.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// The fleet file could not be read.
    #[error("could not read fleet file {}", path.display())]
    ReadFleet {
        /// Fleet file.
        path: PathBuf,
        /// Read failure.
        #[source]
        source: std::io::Error,
    },
    /// The fleet description is not a valid fleet.
    #[error("fleet file {fleet}")]
    Fleet {
        /// Where the fleet came from (a path, or the built-in cluster).
        fleet: String,
        /// What is wrong with it.
        #[source]
        source: FleetError,
    },
    /// The fleet's GPU nodes could not be simulated.
    #[error("fleet file {fleet}")]
    FleetNodes {
        /// Where the fleet came from (a path, or the built-in cluster).
        fleet: String,
        /// What is wrong with them.
        #[source]
        source: Box<DemoError>,
    },
    /// A fleet node could not be simulated.
    #[error(
        "cannot simulate the GPUs of fleet node {node}: {detail}; fix its entry in the fleet file"
    )]
    Simulation {
        /// Fleet node.
        node: String,
        /// What is wrong.
        detail: String,
    },
    /// The simulated GPUs could not be read.
    #[error("reading the simulated GPUs of node {node}: {source}")]
    Backend {
        /// Node.
        node: String,
        /// Backend failure.
        #[source]
        source: BackendError,
    },
    /// The ClusterPolicy's settings are not usable by the agents.
    #[error("the ClusterPolicy's agent settings are invalid: {0}; fix spec.mig.strategy")]
    Settings(String),
    /// The MIG manager's config could not be loaded.
    #[error("the mig-parted config could not be loaded: {0}")]
    MigConfig(String),
    /// A node write failed.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// The MIG manager's pass could not talk to the cluster.
    #[error(transparent)]
    Manager(#[from] ManagerError),
    /// The device plugin refused the node's GPU layout.
    #[error("device plugin on node {node}: {detail}")]
    Resources {
        /// Node.
        node: String,
        /// Why.
        detail: String,
    },
    /// An operator pass failed.
    #[error(transparent)]
    Operator(#[from] OperatorError),
    /// The runtime the agents' passes run on could not be started.
    #[error("could not start the demo's runtime")]
    Runtime(#[source] std::io::Error),
    /// The demo's ClusterPolicy is no longer in the cluster.
    #[error("demo policy vanished")]
    PolicyMissing,
    /// The node picked for the MIG change has no simulated GPUs.
    #[error("the MIG change's node {node} has no simulated GPUs")]
    MigNodeNotSimulated {
        /// Node.
        node: String,
    },
    /// The final state could not be serialized.
    #[error("could not serialize the demo's final state")]
    Json(#[from] serde_json::Error),
    /// The output could not be written.
    #[error("could not write the demo's output")]
    Output(#[source] std::io::Error),
}

impl DemoError {
    /// True when the output's reader went away (`gpu-stack demo | head`):
    /// the caller may end quietly.
    pub fn is_broken_pipe(&self) -> bool {
        matches!(self, DemoError::Output(e) if e.kind() == std::io::ErrorKind::BrokenPipe)
    }
}
