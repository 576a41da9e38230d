//! `gpu-stack`: MIG planning, GPU inventory, the embedded demo, and the
//! validator and node status exporter of the operator's validator image.
#![forbid(unsafe_code)]
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use gpu_stack_bins::cli;

/// gpu-stack: run NVIDIA GPUs on Kubernetes.
#[derive(Parser)]
#[command(name = "gpu-stack", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Plan, validate and apply MIG layouts.
    Mig(cli::mig::Args),
    /// Show GPUs, MIG state and health events from a GPU backend.
    Gpus(cli::gpus::Args),
    /// Run the operator and node agents against an in-memory cluster and simulated GPUs.
    Demo(cli::demo::Args),
    /// Print the ClusterPolicy CRD (YAML) generated from the Rust types.
    Crdgen(cli::crdgen::Args),
    /// Check the driver, toolkit, CUDA and device plugin on this node and write the validation status files.
    Validator(cli::validator::Args),
    /// Write the NFD labels the operator reads (PCI, OS, kernel) on this node where NFD is not installed.
    NodeDiscovery(cli::node_discovery::Args),
    /// Serve this node's validation status as Prometheus gauges on /metrics.
    NodeStatusExporter(cli::node_status_exporter::Args),
    /// Make this node's container runtime inject GPUs through CDI (the toolkit agent, no runtime shim).
    Toolkit(cli::toolkit::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Mig(args) => cli::mig::run(args),
        Command::Gpus(args) => cli::gpus::run(args),
        Command::Demo(args) => cli::demo::run(args),
        Command::Crdgen(args) => cli::crdgen::run(args),
        Command::Validator(args) => cli::validator::run(args),
        Command::NodeDiscovery(args) => cli::node_discovery::run(args),
        Command::NodeStatusExporter(args) => cli::node_status_exporter::run(args),
        Command::Toolkit(args) => cli::toolkit::run(args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            // 2 = bad input or a failure to act; 1 is reserved for "checked, and the answer is no".
            ExitCode::from(2)
        }
    }
}
