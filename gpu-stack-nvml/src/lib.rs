//! gpu-stack-nvml: the GPU side effects of gpu-stack.
//!
//! Two implementations of [`gpu_stack_core::backend::GpuBackend`]: [`sim`] over
//! simulated GPUs described by fleet files, and [`nvml`] over the NVIDIA driver
//! through nvml-wrapper.
pub mod migapply;
pub mod nvml;
pub mod sim;

pub use nvml::NvmlBackend;
pub use sim::{SimClock, SimError, SimGpuSpec, SimNodeSpec, SimulatedBackend};
