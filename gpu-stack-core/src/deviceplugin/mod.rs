//! Device plugin decisions: the config file model, which resources a node
//! advertises (MIG strategies, time-slicing replicas), device health, preferred
//! allocation and `Allocate` contents. The gRPC adapter in `gpu-stack-k8s`
//! only translates these to and from the wire.

pub mod allocate;
pub mod config;
pub mod health;
pub mod inventory;
pub mod resources;

pub use allocate::{
    AllocateError, ContainerAllocation, NvlinkMap, allocate_container, preferred_allocation,
};
pub use config::{ConfigError, ConfigFile, MigStrategy, Overrides, Settings};
pub use health::{HealthEvent, HealthPolicy, HealthTracker};
pub use inventory::{Gpu, MigAttributes, MigDevice, MigMinors, NodeGpus};
pub use resources::{DeviceInfo, Resource, ResourceError, node_resources};
