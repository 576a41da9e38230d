//! Command-line front ends of the gpu-stack binaries. Each module parses flags,
//! builds backends, calls library code and prints; decisions live in the crates.
//! The binaries' mains only parse their `Args` and call the module's `main`:
//! [`agents`] for the agent binaries, [`cli`] for `gpu-stack`.
#![forbid(unsafe_code)]
pub mod agent;
pub mod agents;
pub mod backend_flags;
pub mod cli;
