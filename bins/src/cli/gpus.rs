//! `gpu-stack gpus`.
use std::process::ExitCode;

/// Flags of `gpu-stack gpus`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Runs `gpu-stack gpus`.
pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`gpu-stack gpus` is not available in this build yet")
}
