//! Subcommands of `gpu-stack`.
pub mod demo;
pub mod gpus;
pub mod mig;
pub mod mig_apply;
