//! `gpu-stack mig`.
use std::process::ExitCode;

/// Flags of `gpu-stack mig`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Runs `gpu-stack mig`.
pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`gpu-stack mig` is not available in this build yet")
}
