//! The agent binaries' flags and processes, one module per binary: each
//! holds the binary's `Args` and a `main` that sets up logging and runs the
//! agent on [`crate::agent::run_main`] (or its single-threaded sibling).
pub mod device_plugin;
pub mod dra_plugin;
pub mod exporter;
pub mod feature_discovery;
pub mod mig_manager;
pub mod node_agent;
pub mod operator;
