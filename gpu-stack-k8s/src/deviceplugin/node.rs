//! Reading the node's GPUs from a backend into the core view the device plugin,
//! GFD and the CDI generator decide on.

use std::collections::BTreeMap;
use std::path::Path;

use gpu_stack_core::backend::{BackendError, GpuBackend};
use gpu_stack_core::deviceplugin::{MigMinors, NodeGpus};

/// Where the driver lists MIG capability device minors.
pub const MIG_MINORS_PATH: &str = "/proc/driver/nvidia-caps/mig-minors";

/// Reads inventory and MIG state from the backend. A GPU whose MIG state cannot
/// be read is treated as MIG-off (and logged) rather than failing the node.
pub fn read_node_gpus(
    backend: &dyn GpuBackend,
    mig_minors: Option<&Path>,
) -> Result<NodeGpus, BackendError> {
    let inventory = backend.inventory()?;
    for e in &inventory.errors {
        tracing::warn!(gpu = e.index, error = %e.error, "GPU could not be read; it is left out");
    }
    let mut mig = BTreeMap::new();
    let mut profiles = BTreeMap::new();
    for g in inventory.gpus.iter().filter(|g| g.mig_capable) {
        match backend.mig_state(g.index) {
            Ok(s) => {
                mig.insert(g.index, s);
            }
            Err(e) => tracing::warn!(gpu = g.index, error = %e, "MIG state unreadable"),
        }
        match backend.gpu_instance_profiles(g.index) {
            Ok(p) => {
                profiles.insert(g.index, p);
            }
            Err(e) => tracing::debug!(gpu = g.index, error = %e, "no GPU-instance profiles"),
        }
    }
    let minors = mig_minors
        .and_then(|p| std::fs::read_to_string(p).ok())
        .map(|t| MigMinors::parse(&t))
        .unwrap_or_default();
    Ok(NodeGpus::from_backend(&inventory, &mig, &profiles, &minors))
}
