//! `gpu-stack`: the command-line entry point (MIG planning, GPUs, demo).
use clap::Parser;

/// gpu-stack: run NVIDIA GPUs on Kubernetes.
#[derive(Parser)]
#[command(name = "gpu-stack", version, about)]
struct Cli {}

fn main() -> anyhow::Result<()> {
    let _cli = Cli::parse();
    Ok(())
}
