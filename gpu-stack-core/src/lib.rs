//! gpu-stack-core: the pure decisions of gpu-stack.
//!
//! No I/O and no async runtime live here: every function takes data and returns
//! data, so the operator, the node agents and the CLI share one tested brain.
//!
//! - [`catalog`] and [`mig`]: GPU models, MIG geometry, layout validation, fit,
//!   enumeration and fleet planning; [`migparted`] reads mig-parted config files.
//! - [`dra`]: Dynamic Resource Allocation with dynamic MIG: the ResourceSlice
//!   devices and shared counters of a node, and what preparing a claim does.
//! - [`backend`]: the `GpuBackend` trait every GPU implementation serves.
//! - [`operator`], [`deviceplugin`], [`gfd`], [`cdi`], [`metrics`], [`migmanager`]:
//!   what the operator and the node agents decide.
//! - [`yaml_guard`]: a linear check of nesting depth and size that every YAML
//!   input passes before it is parsed, and the parser options it is read with.
//! - [`nodeagent`]: which components the combined node agent runs, from the
//!   node's deploy labels, and its command line.
//! - [`nodediscovery`]: the NFD-compatible node labels the node-discovery agent
//!   writes where NFD is not installed, and when it writes them.
//! - [`toolkit`]: the container-runtime edits of the CDI-native toolkit agent
//!   (containerd drop-in and `imports`, CRI-O drop-in, node layouts).
//!
//! ```
//! use gpu_stack_core::{catalog, mig};
//!
//! let h100 = catalog::lookup("H100-SXM5-80GB")?;
//! let geometry = h100.mig.as_ref().ok_or("no MIG on this model")?;
//!
//! // 3g.40gb at slice 0 covers slices 0-3, so a 1g.10gb at slice 3 overlaps it.
//! let layout = mig::parse_layout("3g.40gb@0,1g.10gb@3")?;
//! assert!(mig::validate(geometry, &layout).is_err());
//!
//! // Let the engine place the same request instead.
//! let placed = mig::fit(geometry, &mig::parse_demand("3g.40gb=1,1g.10gb=1")?)?;
//! assert!(mig::validate(geometry, &placed).is_ok());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A longer program: `examples/check_layout.rs` (`cargo run -p gpu-stack-examples --example check_layout`).
#![forbid(unsafe_code)]
pub mod backend;
pub mod catalog;
pub mod cdi;
pub mod deviceplugin;
pub mod dra;
pub mod echo;
pub mod fleet;
pub mod gfd;
pub mod metrics;
pub mod mig;
pub mod migmanager;
pub mod migparted;
pub mod nodeagent;
pub mod nodediscovery;
pub mod operator;
pub mod toolkit;
pub mod yaml_guard;
