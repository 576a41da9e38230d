//! gpu-stack-nvml: the GPU side effects of gpu-stack.
//!
//! Two implementations of [`gpu_stack_core::backend::GpuBackend`]: [`sim`] over
//! simulated GPUs described by fleet files, and [`nvml`] over the NVIDIA driver
//! through nvml-wrapper. [`migapply`] is the one MIG apply path shared by
//! `gpu-stack mig apply` and the MIG manager.
//!
//! ```
//! use gpu_stack_core::backend::GpuBackend;
//! use gpu_stack_core::fleet::Fleet;
//! use gpu_stack_nvml::{SimNodeSpec, SimulatedBackend};
//!
//! let fleet = Fleet::from_yaml(
//!     "nodes:\n  - name: n0\n    gpus:\n      - model: A100-SXM4-40GB\n        count: 2\n",
//! )?;
//! let backend = SimulatedBackend::new(&SimNodeSpec::from_fleet(&fleet, Some("n0"))?)?;
//! let inventory = backend.inventory()?;
//! assert_eq!(inventory.gpus.len(), 2);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
pub mod fsutil;
pub mod migapply;
pub mod nvml;
pub mod sim;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use nvml::NvmlBackend;
pub use sim::{SimClock, SimError, SimGpuSpec, SimNodeSpec, SimulatedBackend};
