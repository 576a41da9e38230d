//! `gpu-stack demo`: the operator against an in-memory cluster built from a
//! fleet file, step by step; then the node agents (GPU feature discovery,
//! device plugin, exporter, MIG manager) on each GPU node's simulated GPUs,
//! a MIG change, and a few changes converging. The scenario lives in
//! `gpu_stack_k8s::demo`; this file holds the flags.
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use gpu_stack_k8s::demo::{self, DemoOptions, FleetSource, Format};

/// Output format.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// Step-by-step narration.
    Text,
    /// The final state as JSON: nodes, objects, ClusterPolicy.
    Json,
}

/// Flags of `gpu-stack demo`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Fleet file with the cluster's nodes (default: a built-in mixed cluster
    /// of A100, H100 and L4 nodes on Ubuntu and RHEL, plus CPU-only nodes).
    #[arg(long, value_name = "FILE")]
    pub fleet: Option<PathBuf>,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
    pub output: Output,
    /// Run the device plugin, GFD, the exporter and the MIG manager as one
    /// node agent DaemonSet (`nodeAgent.enabled` in the ClusterPolicy).
    #[arg(long)]
    pub node_agent: bool,
}

/// Runs `gpu-stack demo`.
pub fn run(args: Args) -> Result<ExitCode> {
    let options = DemoOptions {
        fleet: args.fleet.map_or(FleetSource::BuiltIn, FleetSource::File),
        format: match args.output {
            Output::Text => Format::Text,
            Output::Json => Format::Json,
        },
        node_agent: args.node_agent,
    };
    match demo::run(&options, &mut std::io::stdout().lock()) {
        Ok(()) => Ok(ExitCode::SUCCESS),
        // A closed stdout (`| head`) ends the demo quietly.
        Err(e) if e.is_broken_pipe() => Ok(ExitCode::SUCCESS),
        Err(e) => Err(e.into()),
    }
}
