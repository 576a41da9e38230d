//! The DRA kubelet plugin with dynamic MIG: ResourceSlices for the node
//! ([`slices`]), and claims prepared by creating MIG instances at the
//! placements the scheduler allocated ([`node`]).

pub mod node;
pub mod run;
pub mod slices;
