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

use std::collections::BTreeMap;

use crate::backend::{GpuInstanceProfile, Inventory, MigState};
use crate::catalog;
use crate::mig::MigProfileName;

/// Capability device minors read from `/proc/driver/nvidia-caps/mig-minors`:
/// `(gpu, gi)` → GI access minor, `(gpu, gi, ci)` → CI access minor.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigMinors {
    gi: BTreeMap<(u32, u32), u32>,
    ci: BTreeMap<(u32, u32, u32), u32>,
}

impl MigMinors {
    /// Parses the file's `gpu<G>/gi<I>/access <minor>` and
    /// `gpu<G>/gi<I>/ci<C>/access <minor>` lines; other lines are skipped.
    pub fn parse(text: &str) -> MigMinors {
        let mut m = MigMinors::default();
        for line in text.lines() {
            let mut it = line.split_whitespace();
            let (Some(path), Some(minor)) = (it.next(), it.next()) else {
                continue;
            };
            let Ok(minor) = minor.parse::<u32>() else {
                continue;
            };
            let parts: Vec<&str> = path.split('/').collect();
            let num = |s: &str, p: &str| s.strip_prefix(p).and_then(|n| n.parse::<u32>().ok());
            match parts.as_slice() {
                [g, i, "access"] => {
                    if let (Some(g), Some(i)) = (num(g, "gpu"), num(i, "gi")) {
                        m.gi.insert((g, i), minor);
                    }
                }
                [g, i, c, "access"] => {
                    if let (Some(g), Some(i), Some(c)) = (num(g, "gpu"), num(i, "gi"), num(c, "ci"))
                    {
                        m.ci.insert((g, i, c), minor);
                    }
                }
                _ => {}
            }
        }
        m
    }
}

impl NodeGpus {
    /// Builds the view from what a GPU backend reports: the inventory, each
    /// MIG-capable GPU's MIG state and GPU-instance profiles (by GPU index), and
    /// optionally the capability minors. Profile attributes the backend does not
    /// carry (media engines) come from the GPU catalog; copy engines equal the
    /// GPU instance's compute slices (true for A100/H100-class parts). NVLink
    /// peers are not known to the backend and stay empty.
    pub fn from_backend(
        inventory: &Inventory,
        mig: &BTreeMap<u32, MigState>,
        profiles: &BTreeMap<u32, Vec<GpuInstanceProfile>>,
        minors: &MigMinors,
    ) -> NodeGpus {
        let gpus = inventory
            .gpus
            .iter()
            .map(|g| {
                let state = mig.get(&g.index);
                let mig_enabled = state.is_some_and(|s| s.mode.current);
                let model = catalog::by_product_name(&g.name);
                let mut mig_devices = Vec::new();
                if let (true, Some(state)) = (mig_enabled, state) {
                    let mut gis = state.gpu_instances.clone();
                    gis.sort_by_key(|gi| gi.id);
                    for gi in &gis {
                        let prof = profiles
                            .get(&g.index)
                            .and_then(|ps| ps.iter().find(|p| p.id == gi.profile_id));
                        let gi_slices = prof.map_or(0, |p| p.slice_count);
                        let media = model
                            .and_then(|m| m.mig.as_ref())
                            .zip(MigProfileName::parse(&gi.profile_name).ok())
                            .and_then(|(geo, name)| geo.resolve(&name).map(|p| p.media))
                            .unwrap_or_default();
                        let mut cis = gi.compute_instances.clone();
                        cis.sort_by_key(|ci| ci.id);
                        for ci in &cis {
                            let profile = if gi_slices == 0 || ci.slice_count == gi_slices {
                                gi.profile_name.clone()
                            } else {
                                format!("{}c.{}", ci.slice_count, gi.profile_name)
                            };
                            let sms = prof.map_or(0, |p| {
                                (p.multiprocessor_count * ci.slice_count)
                                    .checked_div(p.slice_count)
                                    .unwrap_or(p.multiprocessor_count)
                            });
                            mig_devices.push(MigDevice {
                                index: u32::try_from(mig_devices.len()).unwrap_or(u32::MAX),
                                uuid: ci.uuid.clone(),
                                profile,
                                gi: gi.id,
                                ci: ci.id,
                                memory_mib: prof.map_or(0, |p| p.memory_mib),
                                gi_cap_minor: minors.gi.get(&(g.index, gi.id)).copied(),
                                ci_cap_minor: minors.ci.get(&(g.index, gi.id, ci.id)).copied(),
                                attributes: MigAttributes {
                                    multiprocessors: sms,
                                    gi_slices,
                                    ci_slices: ci.slice_count,
                                    copy_engines: gi_slices,
                                    decoders: media.decoders,
                                    encoders: media.encoders,
                                    jpeg_engines: media.jpeg,
                                    ofa_engines: media.ofa,
                                },
                            });
                        }
                    }
                }
                Gpu {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    product: g.name.clone(),
                    minor: g.minor_number,
                    pci_bus_id: g.pci_bus_id.clone(),
                    numa_node: g.numa_node.map(i64::from),
                    memory_mib: g.memory_total_bytes / (1024 * 1024),
                    compute_capability: g.compute_capability,
                    mig_capable: g.mig_capable,
                    mig_enabled,
                    mig_devices,
                    nvlink_peers: Vec::new(),
                }
            })
            .collect();
        NodeGpus {
            driver_version: inventory.system.driver_version.clone(),
            cuda_version: inventory.system.cuda_driver_version.clone(),
            gpus,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mig_minors_parse() {
        let m = MigMinors::parse(
            "config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\nbad line\n",
        );
        assert_eq!(m.gi.get(&(0, 1)), Some(&12));
        assert_eq!(m.ci.get(&(0, 1, 0)), Some(&13));
    }

    #[test]
    fn compute_sliced_profiles() {
        let m = |p: &str| MigDevice {
            profile: p.into(),
            ..MigDevice::default()
        };
        assert!(m("1c.2g.10gb").is_compute_sliced());
        assert!(!m("1g.5gb").is_compute_sliced());
        assert!(!m("1g.10gb+me").is_compute_sliced());
        assert_eq!(m("1g.10gb+me").resource_profile(), "1g.10gb.me");
    }
}
