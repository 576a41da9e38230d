//! Subcommands of `gpu-stack`.
pub mod crdgen;
pub mod demo;
pub mod gpus;
pub mod mig;
pub mod mig_apply;
pub mod node_discovery;
pub mod node_status_exporter;
pub mod toolkit;
pub mod validator;
