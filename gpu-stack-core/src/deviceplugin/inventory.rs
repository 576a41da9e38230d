//! The node's GPUs as the device plugin, GPU feature discovery and the CDI
//! generator see them: only the facts those decisions need, in one plain shape
//! that any GPU backend can be converted into.

use serde::{Deserialize, Serialize};

/// Everything the node agents know about the GPUs of one node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeGpus {
    /// Kernel driver version, e.g. `550.107.02`.
    pub driver_version: String,
    /// CUDA driver API version, e.g. `12.4`; empty when unknown.
    #[serde(default)]
    pub cuda_version: String,
    /// Physical GPUs, in NVML index order.
    pub gpus: Vec<Gpu>,
}

/// One physical GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Gpu {
    /// NVML index.
    pub index: u32,
    /// `GPU-…` UUID; the kubelet-facing device id.
    pub uuid: String,
    /// Marketing name as NVML reports it, e.g. `NVIDIA A100-SXM4-40GB`.
    pub product: String,
    /// Minor number of `/dev/nvidia<minor>`.
    pub minor: u32,
    /// PCI bus id, e.g. `0000:07:00.0`.
    #[serde(default)]
    pub pci_bus_id: String,
    /// NUMA node the GPU is attached to, when the platform reports one.
    #[serde(default)]
    pub numa_node: Option<i64>,
    /// Total framebuffer memory in MiB.
    pub memory_mib: u64,
    /// CUDA compute capability (major, minor).
    pub compute_capability: (u32, u32),
    /// Whether the GPU supports MIG at all.
    #[serde(default)]
    pub mig_capable: bool,
    /// Whether MIG mode is currently enabled.
    #[serde(default)]
    pub mig_enabled: bool,
    /// MIG devices present when MIG mode is on.
    #[serde(default)]
    pub mig_devices: Vec<MigDevice>,
    /// Indices of GPUs this one has a direct NVLink connection to.
    #[serde(default)]
    pub nvlink_peers: Vec<u32>,
}

/// One MIG device (a GPU instance plus a compute instance).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigDevice {
    /// Index of the MIG device on its parent GPU (the `1` in `0:1`).
    pub index: u32,
    /// `MIG-…` UUID; the kubelet-facing device id.
    pub uuid: String,
    /// Profile name, e.g. `1g.5gb`, `1g.10gb+me`, `1c.2g.10gb`.
    pub profile: String,
    /// GPU instance id.
    pub gi: u32,
    /// Compute instance id.
    pub ci: u32,
    /// Memory of the MIG device in MiB.
    pub memory_mib: u64,
    /// Minor of `/dev/nvidia-caps/nvidia-cap<N>` for the GPU instance, if known.
    #[serde(default)]
    pub gi_cap_minor: Option<u32>,
    /// Minor of `/dev/nvidia-caps/nvidia-cap<N>` for the compute instance, if known.
    #[serde(default)]
    pub ci_cap_minor: Option<u32>,
    /// Profile attributes published as GFD labels.
    #[serde(default)]
    pub attributes: MigAttributes,
}

/// Attributes of a MIG profile (NVML's device attributes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigAttributes {
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// GPU instance slices.
    pub gi_slices: u32,
    /// Compute instance slices.
    pub ci_slices: u32,
    /// Copy engines.
    pub copy_engines: u32,
    /// Video decoders.
    pub decoders: u32,
    /// Video encoders.
    pub encoders: u32,
    /// JPEG engines.
    pub jpeg_engines: u32,
    /// Optical flow accelerators.
    pub ofa_engines: u32,
}

impl Gpu {
    /// The CDI/`NVIDIA_VISIBLE_DEVICES` index name of the GPU, e.g. `0`.
    pub fn index_name(&self) -> String {
        self.index.to_string()
    }
}

impl MigDevice {
    /// Whether the profile slices compute inside a GPU instance (`<n>c.<m>g.…`),
    /// which NVIDIA's plugin never advertises as a resource.
    pub fn is_compute_sliced(&self) -> bool {
        let mut parts = self.profile.split('.');
        match (parts.next(), parts.next()) {
            (Some(first), Some(second)) => first.ends_with('c') && second.ends_with('g'),
            _ => false,
        }
    }

    /// The resource-name form of the profile: `+` becomes `.` (`1g.10gb+me` → `1g.10gb.me`).
    pub fn resource_profile(&self) -> String {
        self.profile.replace('+', ".")
    }
}
