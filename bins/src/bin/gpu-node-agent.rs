//! `gpu-node-agent`: the device plugin, GFD, the metrics exporter and the
//! MIG manager in one process, each run while its deploy label is `true`.
//! Flags and process: `gpu_stack_bins::agents::node_agent`.
#![forbid(unsafe_code)]
use clap::Parser;
use gpu_stack_bins::agents::node_agent::{Args, main as node_agent};

fn main() -> std::process::ExitCode {
    node_agent(Args::parse())
}
