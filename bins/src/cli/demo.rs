//! `gpu-stack demo`.
use std::process::ExitCode;

/// Flags of `gpu-stack demo`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Runs `gpu-stack demo`.
pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`gpu-stack demo` is not available in this build yet")
}
