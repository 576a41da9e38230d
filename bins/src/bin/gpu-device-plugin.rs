//! `gpu-device-plugin`: advertises `nvidia.com/gpu` and `nvidia.com/mig-*` to
//! the kubelet, keeps device health current, and writes the node's CDI spec.
//! Flags and process: `gpu_stack_bins::agents::device_plugin`.
#![forbid(unsafe_code)]
use clap::Parser;
use gpu_stack_bins::agents::device_plugin::{Args, main as device_plugin};

fn main() -> std::process::ExitCode {
    device_plugin(Args::parse())
}
