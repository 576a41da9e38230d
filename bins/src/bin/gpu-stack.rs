//! `gpu-stack`: MIG planning, GPU inventory, the embedded demo, and the
//! validator, node discovery, node status exporter and toolkit agents of the
//! operator's images. Subcommands: `gpu_stack_bins::cli`.
#![forbid(unsafe_code)]
use clap::Parser;
use gpu_stack_bins::cli::{Cli, main as gpu_stack};

fn main() -> std::process::ExitCode {
    gpu_stack(Cli::parse())
}
