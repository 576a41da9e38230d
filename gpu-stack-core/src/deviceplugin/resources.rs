//! Which extended resources a node advertises and which devices each carries:
//! NVIDIA's MIG strategies (`none`, `single`, `mixed`) and time-slicing/MPS
//! replicas (`<uuid>::<n>` ids).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::config::{MigStrategy, Settings};
use super::inventory::{Gpu, MigDevice, NodeGpus};

/// Resource name prefix used for every advertised resource.
pub const RESOURCE_PREFIX: &str = "nvidia.com/";
/// The full-GPU resource.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// Separator between a device UUID and its replica number.
pub const REPLICA_SEPARATOR: &str = "::";

/// Errors deciding the node's resources.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ResourceError {
    /// `single` needs every GPU in the same MIG mode.
    #[error(
        "migStrategy single: all GPUs must have the same MIG mode, but MIG is enabled on GPU(s) {enabled:?} and disabled on GPU(s) {disabled:?}; enable MIG everywhere or use migStrategy mixed"
    )]
    SingleMixedModes {
        /// GPUs with MIG on.
        enabled: Vec<u32>,
        /// GPUs with MIG off.
        disabled: Vec<u32>,
    },
    /// `single` needs at least one MIG device on every MIG-enabled GPU.
    #[error(
        "migStrategy single: GPU {0} has MIG enabled but no MIG devices; apply a MIG layout (e.g. all-1g.5gb) or use migStrategy mixed"
    )]
    SingleNoDevices(u32),
    /// `single` needs one profile for all MIG devices.
    #[error(
        "migStrategy single: MIG devices must all have one profile, found {0:?}; apply a uniform layout or use migStrategy mixed"
    )]
    SingleMixedProfiles(Vec<String>),
}

/// What a kubelet-facing device id stands for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceInfo {
    /// Kubelet-facing id: a UUID, or `<uuid>::<n>` for a replica.
    pub id: String,
    /// UUID of the physical GPU or MIG device.
    pub uuid: String,
    /// Index name: `0` for a GPU, `0:1` for a MIG device.
    pub index_name: String,
    /// Index of the (parent) physical GPU.
    pub gpu_index: u32,
    /// UUID of the (parent) physical GPU.
    pub gpu_uuid: String,
    /// Minor of the (parent) `/dev/nvidia<minor>`.
    pub gpu_minor: u32,
    /// MIG details when this is a MIG device.
    pub mig: Option<MigRef>,
    /// NUMA node (MIG devices inherit their parent's).
    pub numa_node: Option<i64>,
    /// Replica number when the device is shared.
    pub replica: Option<u32>,
}

/// The MIG part of a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigRef {
    /// GPU instance id.
    pub gi: u32,
    /// Compute instance id.
    pub ci: u32,
    /// GI capability device minor.
    pub gi_cap_minor: Option<u32>,
    /// CI capability device minor.
    pub ci_cap_minor: Option<u32>,
}

/// One advertised resource and its devices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Resource {
    /// Full name, e.g. `nvidia.com/mig-1g.5gb`.
    pub name: String,
    /// Replicas per device (1 when unshared).
    pub replicas: u32,
    /// Devices, sorted by id.
    pub devices: Vec<DeviceInfo>,
}

impl Resource {
    /// The part after `nvidia.com/`, used for socket names.
    pub fn short_name(&self) -> &str {
        self.name
            .strip_prefix(RESOURCE_PREFIX)
            .unwrap_or(&self.name)
    }

    /// Looks a device up by kubelet-facing id.
    pub fn device(&self, id: &str) -> Option<&DeviceInfo> {
        self.devices
            .binary_search_by(|d| d.id.as_str().cmp(id))
            .ok()
            .and_then(|i| self.devices.get(i))
    }
}

fn gpu_device(g: &Gpu) -> DeviceInfo {
    DeviceInfo {
        id: g.uuid.clone(),
        uuid: g.uuid.clone(),
        index_name: g.index_name(),
        gpu_index: g.index,
        gpu_uuid: g.uuid.clone(),
        gpu_minor: g.minor,
        mig: None,
        numa_node: g.numa_node,
        replica: None,
    }
}

fn mig_device(g: &Gpu, m: &MigDevice) -> DeviceInfo {
    DeviceInfo {
        id: m.uuid.clone(),
        uuid: m.uuid.clone(),
        index_name: format!("{}:{}", g.index, m.index),
        gpu_index: g.index,
        gpu_uuid: g.uuid.clone(),
        gpu_minor: g.minor,
        mig: Some(MigRef {
            gi: m.gi,
            ci: m.ci,
            gi_cap_minor: m.gi_cap_minor,
            ci_cap_minor: m.ci_cap_minor,
        }),
        numa_node: g.numa_node,
        replica: None,
    }
}

/// Decides the node's resources from its GPUs and the settings. Resources with
/// no devices are left out (NVIDIA does not start a plugin for them). Output is
/// sorted by resource name, devices by id.
pub fn node_resources(
    node: &NodeGpus,
    settings: &Settings,
) -> Result<Vec<Resource>, ResourceError> {
    let mut by_name: BTreeMap<String, Vec<DeviceInfo>> = BTreeMap::new();
    match settings.mig_strategy {
        MigStrategy::None => {
            for g in &node.gpus {
                by_name
                    .entry(GPU_RESOURCE.into())
                    .or_default()
                    .push(gpu_device(g));
            }
        }
        MigStrategy::Single => {
            let enabled: Vec<u32> = node
                .gpus
                .iter()
                .filter(|g| g.mig_enabled)
                .map(|g| g.index)
                .collect();
            if enabled.is_empty() {
                for g in &node.gpus {
                    by_name
                        .entry(GPU_RESOURCE.into())
                        .or_default()
                        .push(gpu_device(g));
                }
            } else {
                let disabled: Vec<u32> = node
                    .gpus
                    .iter()
                    .filter(|g| !g.mig_enabled)
                    .map(|g| g.index)
                    .collect();
                if !disabled.is_empty() {
                    return Err(ResourceError::SingleMixedModes { enabled, disabled });
                }
                let mut profiles: Vec<String> = Vec::new();
                for g in &node.gpus {
                    if g.mig_devices.is_empty() {
                        return Err(ResourceError::SingleNoDevices(g.index));
                    }
                    for m in &g.mig_devices {
                        if !profiles.contains(&m.profile) {
                            profiles.push(m.profile.clone());
                        }
                        by_name
                            .entry(GPU_RESOURCE.into())
                            .or_default()
                            .push(mig_device(g, m));
                    }
                }
                if profiles.len() > 1 {
                    profiles.sort();
                    return Err(ResourceError::SingleMixedProfiles(profiles));
                }
            }
        }
        MigStrategy::Mixed => {
            for g in &node.gpus {
                if !g.mig_enabled {
                    by_name
                        .entry(GPU_RESOURCE.into())
                        .or_default()
                        .push(gpu_device(g));
                    continue;
                }
                for m in g.mig_devices.iter().filter(|m| !m.is_compute_sliced()) {
                    let name = format!("{RESOURCE_PREFIX}mig-{}", m.resource_profile());
                    by_name.entry(name).or_default().push(mig_device(g, m));
                }
            }
        }
    }

    let mut out = Vec::new();
    for (name, devices) in by_name {
        let (name, replicas, mut devices) = match settings.shared_for(&name) {
            Some(shared) => {
                let mut replicated = Vec::with_capacity(devices.len() * shared.replicas as usize);
                for d in &devices {
                    for n in 0..shared.replicas {
                        let mut r = d.clone();
                        r.id = format!("{}{REPLICA_SEPARATOR}{n}", d.uuid);
                        r.replica = Some(n);
                        replicated.push(r);
                    }
                }
                (shared.advertised_name.clone(), shared.replicas, replicated)
            }
            None => (name, 1, devices),
        };
        devices.sort_by(|a, b| a.id.cmp(&b.id));
        out.push(Resource {
            name,
            replicas,
            devices,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Strips a replica suffix: `GPU-x::3` → `GPU-x`.
pub fn physical_id(id: &str) -> &str {
    id.split_once(REPLICA_SEPARATOR).map_or(id, |(u, _)| u)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::deviceplugin::config::{ConfigFile, Overrides};
    use crate::deviceplugin::inventory::MigAttributes;

    pub(crate) fn a100(index: u32, numa: i64) -> Gpu {
        Gpu {
            index,
            uuid: format!("GPU-a100-{index:04}-0000-0000-000000000000"),
            product: "NVIDIA A100-SXM4-40GB".into(),
            minor: index,
            pci_bus_id: format!("0000:{:02x}:00.0", 0x07 + index * 0x10),
            numa_node: Some(numa),
            memory_mib: 40960,
            compute_capability: (8, 0),
            mig_capable: true,
            mig_enabled: false,
            mig_devices: vec![],
            nvlink_peers: (0..8).filter(|p| *p != index).collect(),
        }
    }

    pub(crate) fn one_g(gpu: u32, i: u32) -> MigDevice {
        MigDevice {
            index: i,
            uuid: format!("MIG-a100-{gpu:04}-{i:04}-0000-000000000000"),
            profile: "1g.5gb".into(),
            gi: 7 + i,
            ci: 0,
            memory_mib: 4864,
            gi_cap_minor: Some(100 + gpu * 20 + i * 2),
            ci_cap_minor: Some(101 + gpu * 20 + i * 2),
            attributes: MigAttributes {
                multiprocessors: 14,
                gi_slices: 1,
                ci_slices: 1,
                copy_engines: 1,
                decoders: 0,
                encoders: 0,
                jpeg_engines: 0,
                ofa_engines: 0,
            },
        }
    }

    pub(crate) fn dgx_a100(mig: bool) -> NodeGpus {
        NodeGpus {
            driver_version: "550.107.02".into(),
            cuda_version: "12.4".into(),
            gpus: (0..8)
                .map(|i| {
                    let mut g = a100(i, if i < 4 { 0 } else { 1 });
                    if mig {
                        g.mig_enabled = true;
                        g.mig_devices = (0..7).map(|m| one_g(i, m)).collect();
                    }
                    g
                })
                .collect(),
        }
    }

    fn settings(strategy: &str) -> Settings {
        Settings::resolve(
            None,
            &Overrides {
                mig_strategy: Some(strategy.into()),
                ..Overrides::default()
            },
        )
        .unwrap()
    }

    #[test]
    fn none_advertises_every_gpu() {
        let r = node_resources(&dgx_a100(true), &settings("none")).unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].name, "nvidia.com/gpu");
        assert_eq!(r[0].devices.len(), 8);
        assert!(r[0].devices.iter().all(|d| d.id.starts_with("GPU-")));
    }

    #[test]
    fn single_advertises_mig_devices_as_gpu() {
        let r = node_resources(&dgx_a100(true), &settings("single")).unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].name, "nvidia.com/gpu");
        assert_eq!(r[0].devices.len(), 56);
        let d = r[0].device("MIG-a100-0002-0003-0000-000000000000").unwrap();
        assert_eq!(d.index_name, "2:3");
        assert_eq!(d.numa_node, Some(0));
        // no MIG anywhere: same as none
        let r = node_resources(&dgx_a100(false), &settings("single")).unwrap();
        assert_eq!(r[0].devices.len(), 8);
    }

    #[test]
    fn single_rejects_inconsistent_nodes() {
        let mut n = dgx_a100(true);
        n.gpus[7].mig_enabled = false;
        n.gpus[7].mig_devices.clear();
        assert!(matches!(
            node_resources(&n, &settings("single")),
            Err(ResourceError::SingleMixedModes { .. })
        ));
        let mut n = dgx_a100(true);
        n.gpus[3].mig_devices.clear();
        assert_eq!(
            node_resources(&n, &settings("single")),
            Err(ResourceError::SingleNoDevices(3))
        );
        let mut n = dgx_a100(true);
        n.gpus[1].mig_devices[0].profile = "2g.10gb".into();
        assert!(matches!(
            node_resources(&n, &settings("single")),
            Err(ResourceError::SingleMixedProfiles(_))
        ));
    }

    #[test]
    fn mixed_names_per_profile_and_skips_compute_slices() {
        let mut n = dgx_a100(true);
        n.gpus[0].mig_enabled = false;
        n.gpus[0].mig_devices.clear();
        n.gpus[1].mig_devices[0].profile = "1g.10gb+me".into();
        n.gpus[1].mig_devices[1].profile = "1c.2g.10gb".into();
        let r = node_resources(&n, &settings("mixed")).unwrap();
        let names: Vec<&str> = r.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(
            names,
            vec![
                "nvidia.com/gpu",
                "nvidia.com/mig-1g.10gb.me",
                "nvidia.com/mig-1g.5gb"
            ]
        );
        assert_eq!(r[0].devices.len(), 1);
        assert_eq!(r[1].devices.len(), 1);
        assert_eq!(r[2].devices.len(), 7 * 7 - 2);
        assert_eq!(r[1].short_name(), "mig-1g.10gb.me");
    }

    #[test]
    fn time_slicing_replicates_with_annotated_ids() {
        let f = ConfigFile::parse(
            "t",
            "sharing: {timeSlicing: {renameByDefault: true, resources: [{name: nvidia.com/gpu, replicas: 4}]}}",
        )
        .unwrap();
        let s = Settings::resolve(Some(&f), &Overrides::default()).unwrap();
        let r = node_resources(&dgx_a100(false), &s).unwrap();
        assert_eq!(r[0].name, "nvidia.com/gpu.shared");
        assert_eq!(r[0].replicas, 4);
        assert_eq!(r[0].devices.len(), 32);
        let d = r[0]
            .device("GPU-a100-0001-0000-0000-000000000000::3")
            .unwrap();
        assert_eq!(d.replica, Some(3));
        assert_eq!(physical_id(&d.id), d.uuid);
        assert!(r[0].devices.iter().all(|d| d.id.len() <= 63));
    }
}
