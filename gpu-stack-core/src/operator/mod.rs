//! The operator's decisions, as pure functions of data.
//!
//! - [`components`]: the operands, their dependency graph, the per-node gates
//!   that enforce the order, and which operands a policy enables.
//! - [`labels`]: what the operator reads from a node's labels, and the deploy
//!   labels it writes (respecting values other agents wrote).
//! - [`driver`]: the driver selection matrix: image references, OS and kernel
//!   pools, and GPU × driver-branch compatibility.
//! - [`migconfig`]: MigConfig layouts turned into the MIG manager's label
//!   and mig-parted config, with a per-node verdict.
//! - [`migdemand`]: demand-driven MIG, which nodes change layout for the
//!   MIG instances pending pods ask for.
//! - [`migusage`]: the annotation a node's MIG manager publishes: its
//!   GPUs' layouts and which instances are in use.
//! - [`nvidiadriver`]: NVIDIADriver routing (which resource owns each GPU
//!   node's driver) and its validation.
//! - [`validation`]: the per-node validator's checks and the status files it writes.
//! - [`devchar`]: the `/dev/char` links the driver check makes for NVIDIA's
//!   device nodes.
//! - [`platform`]: the Kubernetes releases the operator runs against.
//! - [`drift`]: which owned objects someone else edited since the operator wrote them.
//! - [`lease`]: when a replica may trust it still leads, so it may write.
//! - [`upgrade`]: the driver upgrade policy and state machine: one pure pass
//!   decides each node's next upgrade state and what to do to it.
//!
//! The kube-facing crate turns a ClusterPolicy and node objects into these
//! inputs, so every rule here is testable without a cluster.
pub mod components;
pub mod devchar;
pub mod drift;
pub mod driver;
pub mod labels;
pub mod lease;
pub mod migconfig;
pub mod migdemand;
pub mod migusage;
pub mod nvidiadriver;
pub mod platform;
pub mod upgrade;
pub mod validation;
