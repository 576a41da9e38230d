//! The embedded demo (`gpu-stack demo`): the operator against an
//! [`InMemoryCluster`](crate::operator::cluster::InMemoryCluster) built from a fleet,
//! step by step, then the node agents (GPU feature discovery, device plugin,
//! exporter, MIG manager) on each GPU node's simulated GPUs, a MIG change,
//! and a few changes converging.
//!
//! - [`run`] with [`DemoOptions`]: the whole scenario, narrated or as the
//!   final state in JSON, written to any [`std::io::Write`];
//! - [`agents`]: one pass of a node's agents through the same library code
//!   the agent binaries use;
//! - [`DEFAULT_FLEET`]: the built-in cluster.
//!
//! ```no_run
//! use gpu_stack_k8s::demo::{DemoOptions, Format, run};
//!
//! let options = DemoOptions { format: Format::Json, ..Default::default() };
//! run(&options, &mut std::io::stdout().lock())?;
//! # Ok::<(), gpu_stack_k8s::demo::DemoError>(())
//! ```
pub mod agents;
mod error;
mod render;
mod scenario;
mod setup;

pub use agents::{
    AgentSettings, DemoNode, GpuLayout, ManagerReport, ManagerWrite, NodeAgentsReport,
    RunningAgents, SIM_TIME_MS, layout, mig_succeeded, pick_mig_change, run_agents,
    run_node_agents, running_agents, simulated_nodes,
};
pub use error::DemoError;
pub use scenario::{DemoOptions, FleetSource, Format, run};
pub use setup::DEFAULT_FLEET;
