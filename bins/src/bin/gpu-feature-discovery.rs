//! `gpu-feature-discovery`: computes NVIDIA's GFD node labels from the node's
//! GPUs and publishes them.
//! Flags and process: `gpu_stack_bins::agents::feature_discovery`.
#![forbid(unsafe_code)]
use clap::Parser;
use gpu_stack_bins::agents::feature_discovery::{Args, main as feature_discovery};

fn main() -> std::process::ExitCode {
    feature_discovery(Args::parse())
}
