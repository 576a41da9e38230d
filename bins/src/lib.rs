//! Command-line front ends of the gpu-stack binaries. Each module parses flags,
//! builds backends, calls library code and prints; decisions live in the crates.
#![forbid(unsafe_code)]
pub mod agent;
pub mod backend_flags;
pub mod cli;
