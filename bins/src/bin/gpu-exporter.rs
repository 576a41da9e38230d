//! `gpu-exporter`: DCGM-compatible GPU metrics for Prometheus, without DCGM.
//! Flags, exit codes and process: `gpu_stack_bins::agents::exporter`.
#![forbid(unsafe_code)]
use clap::Parser;
use gpu_stack_bins::agents::exporter::{Args, main as exporter};

fn main() -> std::process::ExitCode {
    exporter(Args::parse())
}
