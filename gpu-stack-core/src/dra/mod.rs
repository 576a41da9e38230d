//! Dynamic Resource Allocation with dynamic MIG: what a node publishes in its
//! ResourceSlices and what preparing a claim does to its GPUs.
//!
//! Each MIG-capable GPU publishes itself whole and one device per MIG
//! placement (profile at start slice), with KEP-4815 shared counters derived
//! from the MIG geometry ([`counters`]) so that the devices the scheduler may
//! allocate together are exactly the layouts [`crate::mig::validate`]
//! accepts; [`devices`] names the devices and gives them NVIDIA's attributes;
//! [`prepare`] turns an allocation into per-GPU targets and keeps the
//! crash-safe checkpoint.
//!
//! ```
//! use gpu_stack_core::{catalog, dra::counters::{CounterModel, ModelDevice}, mig};
//!
//! let h100 = catalog::lookup("H100-SXM5-80GB")?.mig.as_ref().ok_or("no MIG")?;
//! let model = CounterModel::derive(h100)?;
//! let three_g_at_4 = model.placements.iter().position(|p| {
//!     h100.gi_profiles[p.profile].name.to_string() == "3g.40gb" && p.start == 4
//! }).ok_or("no such placement")?;
//! let one_g_at_6 = model.placements.iter().position(|p| {
//!     h100.gi_profiles[p.profile].name.to_string() == "1g.10gb" && p.start == 6
//! }).ok_or("no such placement")?;
//! // 3g.40gb@4 covers slices 4-7: the counters refuse a 1g.10gb at 6 beside
//! // it, as the validator does.
//! let pair = [ModelDevice::Placement(three_g_at_4), ModelDevice::Placement(one_g_at_6)];
//! assert!(!model.allows(&pair));
//! assert!(mig::validate(h100, &mig::parse_layout("3g.40gb@4,1g.10gb@6")?).is_err());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod cdi;
pub mod counters;
pub mod devices;
pub mod prepare;
pub mod slices;
