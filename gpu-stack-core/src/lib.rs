//! gpu-stack-core: the pure decisions of gpu-stack.
//!
//! No I/O and no async runtime live here: every function takes data and returns
//! data, so the operator, the node agents and the CLI share one tested brain.
pub mod backend;
pub mod catalog;
pub mod cdi;
pub mod deviceplugin;
pub mod fleet;
pub mod gfd;
pub mod metrics;
pub mod mig;
pub mod migmanager;
pub mod migparted;
pub mod operator;
