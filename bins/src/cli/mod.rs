//! Subcommands of `gpu-stack`: one module per subcommand, and the
//! command line that dispatches to them ([`Cli`], [`main`]).
pub mod crdgen;
pub mod demo;
pub mod gpus;
pub mod mig;
pub mod mig_apply;
pub mod node_discovery;
pub mod node_status_exporter;
pub mod toolkit;
pub mod validator;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// gpu-stack: run NVIDIA GPUs on Kubernetes.
#[derive(Parser)]
#[command(name = "gpu-stack", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Plan, validate and apply MIG layouts.
    Mig(mig::Args),
    /// Show GPUs, MIG state and health events from a GPU backend.
    Gpus(gpus::Args),
    /// Run the operator and node agents against an in-memory cluster and simulated GPUs.
    Demo(demo::Args),
    /// Print a CRD (YAML) generated from the Rust types: the ClusterPolicy, or --kind nvidiadriver.
    Crdgen(crdgen::Args),
    /// Check the driver, toolkit, CUDA and device plugin on this node and write the validation status files.
    Validator(validator::Args),
    /// Write the NFD labels the operator reads (PCI, OS, kernel) on this node where NFD is not installed.
    NodeDiscovery(node_discovery::Args),
    /// Serve this node's validation status as Prometheus gauges on /metrics.
    NodeStatusExporter(node_status_exporter::Args),
    /// Make this node's container runtime inject GPUs through CDI (the toolkit agent, no runtime shim).
    Toolkit(toolkit::Args),
}

/// Runs the subcommand and ends with its exit code; an error is printed.
pub fn main(cli: Cli) -> ExitCode {
    let result = match cli.command {
        Command::Mig(args) => mig::run(args),
        Command::Gpus(args) => gpus::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Crdgen(args) => crdgen::run(args),
        Command::Validator(args) => validator::run(args),
        Command::NodeDiscovery(args) => node_discovery::run(args),
        Command::NodeStatusExporter(args) => node_status_exporter::run(args),
        Command::Toolkit(args) => toolkit::run(args),
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
