//! `gpu-stack crdgen`: prints the CRDs generated from the Rust types (the
//! ClusterPolicy by default, the NVIDIADriver and MigConfig with `--kind`).
use std::process::ExitCode;

use anyhow::{Context, Result};

/// Which CRD `gpu-stack crdgen` prints.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Kind {
    /// `clusterpolicies.nvidia.com` (deploy/crds/nvidia.com_clusterpolicies.yaml).
    #[default]
    Clusterpolicy,
    /// `nvidiadrivers.nvidia.com` (deploy/crds/nvidia.com_nvidiadrivers.yaml).
    Nvidiadriver,
    /// `migconfigs.gpustack.io` (deploy/crds/gpustack.io_migconfigs.yaml).
    Migconfig,
    /// Every CRD, as one multi-document YAML stream.
    All,
}

/// Flags of `gpu-stack crdgen`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The CRD to print.
    #[arg(long, value_enum, default_value_t = Kind::Clusterpolicy)]
    pub kind: Kind,
}

fn clusterpolicy() -> Result<String> {
    gpu_stack_k8s::operator::clusterpolicy::crd_yaml()
        .context("could not render the ClusterPolicy CRD as YAML")
}

fn nvidiadriver() -> Result<String> {
    gpu_stack_k8s::operator::nvidiadriver::crd_yaml()
        .context("could not render the NVIDIADriver CRD as YAML")
}

fn migconfig() -> Result<String> {
    gpu_stack_k8s::operator::migconfig::crd_yaml()
        .context("could not render the MigConfig CRD as YAML")
}

/// Runs `gpu-stack crdgen`.
pub fn run(args: Args) -> Result<ExitCode> {
    let yaml = match args.kind {
        Kind::Clusterpolicy => clusterpolicy()?,
        Kind::Nvidiadriver => nvidiadriver()?,
        Kind::Migconfig => migconfig()?,
        Kind::All => format!(
            "{}---\n{}---\n{}",
            clusterpolicy()?,
            nvidiadriver()?,
            migconfig()?
        ),
    };
    print!("{yaml}");
    Ok(ExitCode::SUCCESS)
}
