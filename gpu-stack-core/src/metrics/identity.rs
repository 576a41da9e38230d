//! What identifies a metrics entity: a whole GPU or one MIG GPU instance. Shared
//! by pod attribution and rendering.

/// A MIG GPU instance's identity, as carried on its series.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigIdentity {
    /// Profile name for `GPU_I_PROFILE`, e.g. `1g.10gb`.
    pub profile: String,
    /// NVML GPU-instance id for `GPU_I_ID`.
    pub gi_id: u32,
    /// The MIG device UUID (`MIG-...`), used for pod attribution.
    pub uuid: String,
    /// MIG device UUIDs of further compute instances in the same GPU instance;
    /// pods holding them are attributed to this entity too.
    pub other_uuids: Vec<String>,
}

/// What identifies a series' entity: a whole GPU or one GPU instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntityIdentity {
    /// NVML index of the (parent) GPU: the `gpu` label.
    pub gpu: u32,
    /// The (parent) GPU UUID: the `UUID` label.
    pub uuid: String,
    /// `00000000:BB:DD.F`: the `pci_bus_id` label.
    pub pci_bus_id: String,
    /// `nvidia<gpu>`: the `device` label.
    pub device: String,
    /// The NVML product name: the `modelName` label.
    pub model_name: String,
    /// Set on MIG GPU-instance entities.
    pub mig: Option<MigIdentity>,
}

impl EntityIdentity {
    /// The UUID a device plugin hands out for this entity: the MIG UUID for a GPU
    /// instance, the GPU UUID otherwise.
    pub fn device_uuid(&self) -> &str {
        match &self.mig {
            Some(m) => &m.uuid,
            None => &self.uuid,
        }
    }
}
