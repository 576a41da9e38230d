//! `gpu-dra-plugin`: the DRA kubelet plugin with dynamic MIG (ResourceSlices
//! with shared counters; MIG instances created at prepare time).
//! Flags and process: `gpu_stack_bins::agents::dra_plugin`.
#![forbid(unsafe_code)]
use clap::Parser;
use gpu_stack_bins::agents::dra_plugin::{Args, main as dra_plugin};

fn main() -> std::process::ExitCode {
    dra_plugin(Args::parse())
}
