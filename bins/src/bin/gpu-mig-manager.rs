//! `gpu-mig-manager`: applies the mig-parted config named by its node's
//! `nvidia.com/mig.config` label and reports `nvidia.com/mig.config.state`.
//! Flags and process: `gpu_stack_bins::agents::mig_manager`.
#![forbid(unsafe_code)]
use clap::Parser;
use gpu_stack_bins::agents::mig_manager::{Args, main as mig_manager};

fn main() -> std::process::ExitCode {
    mig_manager(Args::parse())
}
