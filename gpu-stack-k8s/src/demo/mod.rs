//! The embedded demo (`gpu-stack demo`): the node agents on each GPU node's
//! simulated GPUs ([`agents`]) and the demo's errors ([`DemoError`]).
pub mod agents;
mod error;

pub use agents::{
    AgentSettings, DemoNode, GpuLayout, ManagerReport, ManagerWrite, NodeAgentsReport,
    RunningAgents, SIM_TIME_MS, layout, mig_succeeded, pick_mig_change, run_agents,
    run_node_agents, running_agents, simulated_nodes,
};
pub use error::DemoError;
