//! `gpu-operator`: reconciles ClusterPolicy documents on a Kubernetes cluster.
//! Flags and process: `gpu_stack_bins::agents::operator`.
#![forbid(unsafe_code)]
use clap::Parser;
use gpu_stack_bins::agents::operator::{Args, main as operator};

fn main() -> std::process::ExitCode {
    operator(Args::parse())
}
