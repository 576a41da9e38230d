//! `gpu-stack crdgen`: prints the ClusterPolicy CRD generated from the Rust types.
use std::process::ExitCode;

use anyhow::{Context, Result};

/// Flags of `gpu-stack crdgen` (none).
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Runs `gpu-stack crdgen`.
pub fn run(_args: Args) -> Result<ExitCode> {
    let yaml = gpu_stack_k8s::clusterpolicy::crd_yaml()
        .context("could not render the ClusterPolicy CRD as YAML")?;
    print!("{yaml}");
    Ok(ExitCode::SUCCESS)
}
