//! The driver upgrade flow: NVIDIA's `driver.upgradePolicy`, the per-node
//! state machine behind the `nvidia.com/gpu-driver-upgrade-state` label, and
//! one pure pass over every managed node.
//!
//! - [`policy`]: `driver.upgradePolicy`, its defaults and its validation.
//! - [`state`]: the node states and their transitions; the flow's labels, annotations and limits.
//! - `steps` (private): each state's step, the next state of a node and the actions it takes.
//! - [`pass`]: the pass over every node: observations, decisions, counts, groups, stuck nodes.
//! - [`abandon`]: winding down an upgrade nobody will finish (uncordon what the flow cordoned).
//! - [`selector`]: label selectors in their string form, as the policy's pod selectors are written.
//! - `tests`: unit and property tests of the flow.
pub mod abandon;
pub mod pass;
pub mod policy;
pub mod selector;
pub mod state;
mod steps;

#[cfg(test)]
mod tests;
