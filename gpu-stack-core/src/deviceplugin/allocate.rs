//! `GetPreferredAllocation` and `Allocate` as pure functions of the resource's
//! devices and the settings.
//!
//! Preferred allocation is deterministic: the same devices and request give the
//! same answer whatever order the kubelet lists them in. Full GPUs are chosen to
//! span as few NUMA nodes as possible, then to maximise NVLink pairs; MIG
//! devices and replicas are kept on as few physical GPUs as possible (MIG: the
//! smallest GPU that fits the whole request; replicas: by the `distributed` or
//! `packed` policy).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::config::{
    DeviceIdStrategy, DeviceListStrategy, Settings, SharedAllocationPolicy, SharingStrategy,
};
use super::resources::{DeviceInfo, Resource};

/// CDI kind of the specs this project writes and names in `Allocate`.
pub const CDI_KIND: &str = "nvidia.com/gpu";
/// Mount directory of the `volume-mounts` strategy.
pub const VOLUME_MOUNT_DIR: &str = "/var/run/nvidia-container-devices";

/// Why an allocation request was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AllocateError {
    /// Ids the resource does not have.
    #[error(
        "resource {resource}: unknown device id(s) {}; ask only for ids sent in ListAndWatch",
        crate::echo::join_capped(.ids)
    )]
    Unknown {
        /// Resource name.
        resource: String,
        /// The unknown ids.
        ids: Vec<String>,
    },
    /// Ids listed more than once.
    #[error(
        "resource {resource}: device id(s) {} requested more than once; list each id once",
        crate::echo::join_capped(.ids)
    )]
    Duplicated {
        /// Resource name.
        resource: String,
        /// The duplicated ids.
        ids: Vec<String>,
    },
    /// Shared resource asked for more than one replica while that is refused.
    #[error(
        "resource {resource}: request for {count} devices; maximum request size for shared resources is 1"
    )]
    TooManyReplicas {
        /// Resource name.
        resource: String,
        /// Requested count.
        count: usize,
    },
    /// `GetPreferredAllocation` named more must-include devices than it asked for.
    #[error(
        "resource {resource}: {must} must-include device(s) but an allocation size of {size}; \
         the size must be at least the number of must-include ids"
    )]
    MustIncludeExceedsSize {
        /// Resource name.
        resource: String,
        /// Distinct must-include ids.
        must: usize,
        /// Requested allocation size.
        size: usize,
    },
    /// Nothing was requested.
    #[error("resource {resource}: empty device list in allocation request")]
    Empty {
        /// Resource name.
        resource: String,
    },
}

/// GPU-to-GPU links used to score full-GPU sets: NVLink peers by GPU index.
pub type NvlinkMap = BTreeMap<u32, BTreeSet<u32>>;

/// Chooses `size` device ids from `available`, always keeping `must_include`.
///
/// Every id in `available` and `must_include` must be one this resource
/// advertised ([`AllocateError::Unknown`] names the others), and `must_include`
/// may hold at most `size` distinct ids ([`AllocateError::MustIncludeExceedsSize`]).
/// Ids listed twice count once. The answer holds exactly
/// `min(size, |available ∪ must_include|)` ids, every must-include id among
/// them, sorted by id, and does not depend on the order of either list.
pub fn preferred_allocation(
    resource: &Resource,
    nvlinks: &NvlinkMap,
    policy: SharedAllocationPolicy,
    available: &[String],
    must_include: &[String],
    size: usize,
) -> Result<Vec<String>, AllocateError> {
    let unknown: BTreeSet<&String> = available
        .iter()
        .chain(must_include)
        .filter(|id| resource.device(id).is_none())
        .collect();
    if !unknown.is_empty() {
        return Err(AllocateError::Unknown {
            resource: resource.name.clone(),
            ids: unknown.into_iter().cloned().collect(),
        });
    }
    let must: BTreeSet<&String> = must_include.iter().collect();
    if must.len() > size {
        return Err(AllocateError::MustIncludeExceedsSize {
            resource: resource.name.clone(),
            must: must.len(),
            size,
        });
    }
    let mut chosen: Vec<&DeviceInfo> = must.iter().filter_map(|i| resource.device(i)).collect();
    let candidates: Vec<&DeviceInfo> = available
        .iter()
        .filter(|i| !must.contains(i))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .filter_map(|i| resource.device(i))
        .collect();
    let want = size.saturating_sub(chosen.len()).min(candidates.len());
    if want > 0 {
        let picked = if candidates
            .iter()
            .all(|d| d.mig.is_none() && d.replica.is_none())
        {
            pick_full_gpus(&chosen, &candidates, nvlinks, want)
        } else {
            pick_grouped(&chosen, &candidates, policy, resource.replicas > 1, want)
        };
        chosen.extend(picked);
    }
    let mut ids: Vec<String> = chosen.into_iter().map(|d| d.id.clone()).collect();
    ids.sort();
    ids.dedup();
    Ok(ids)
}

fn set_score(set: &[&DeviceInfo], nvlinks: &NvlinkMap) -> (usize, usize) {
    let numa: BTreeSet<Option<i64>> = set.iter().map(|d| d.numa_node).collect();
    let mut links = 0;
    for (i, a) in set.iter().enumerate() {
        for b in &set[i + 1..] {
            if nvlinks
                .get(&a.gpu_index)
                .is_some_and(|p| p.contains(&b.gpu_index))
            {
                links += 1;
            }
        }
    }
    (numa.len(), links)
}

/// Score of a full-GPU set: NUMA nodes spanned (fewer is better), then NVLink
/// pairs (more is better).
type SetKey = (usize, std::cmp::Reverse<usize>);

fn pick_full_gpus<'a>(
    chosen: &[&'a DeviceInfo],
    candidates: &[&'a DeviceInfo],
    nvlinks: &NvlinkMap,
    want: usize,
) -> Vec<&'a DeviceInfo> {
    // Greedy growth from every possible first pick; keep the best set
    // (fewest NUMA nodes, most NVLink pairs, then smallest ids).
    let starts: Vec<Option<usize>> = if chosen.is_empty() {
        (0..candidates.len()).map(Some).collect()
    } else {
        vec![None]
    };
    let mut best: Option<(SetKey, Vec<usize>)> = None;
    for start in starts {
        let mut picked: Vec<usize> = start.into_iter().collect();
        while picked.len() < want {
            let mut step: Option<(SetKey, usize)> = None;
            for (i, _) in candidates.iter().enumerate() {
                if picked.contains(&i) {
                    continue;
                }
                let mut set: Vec<&DeviceInfo> = chosen.to_vec();
                set.extend(picked.iter().map(|p| candidates[*p]));
                set.push(candidates[i]);
                let (numa, links) = set_score(&set, nvlinks);
                let key = (numa, std::cmp::Reverse(links));
                if step.as_ref().is_none_or(|(k, _)| key < *k) {
                    step = Some((key, i));
                }
            }
            match step {
                Some((_, i)) => picked.push(i),
                None => break,
            }
        }
        let mut set: Vec<&DeviceInfo> = chosen.to_vec();
        set.extend(picked.iter().map(|p| candidates[*p]));
        let (numa, links) = set_score(&set, nvlinks);
        let key = (numa, std::cmp::Reverse(links));
        picked.sort_unstable();
        let better = match &best {
            None => true,
            Some((k, p)) => key < *k || (key == *k && picked < *p),
        };
        if better {
            best = Some((key, picked));
        }
    }
    best.map(|(_, p)| p.into_iter().map(|i| candidates[i]).collect())
        .unwrap_or_default()
}

fn pick_grouped<'a>(
    chosen: &[&'a DeviceInfo],
    candidates: &[&'a DeviceInfo],
    policy: SharedAllocationPolicy,
    replicated: bool,
    want: usize,
) -> Vec<&'a DeviceInfo> {
    // Group candidates by physical GPU (for replicas: by physical device uuid).
    let key = |d: &DeviceInfo| {
        if replicated {
            d.uuid.clone()
        } else {
            d.gpu_uuid.clone()
        }
    };
    let mut groups: BTreeMap<String, Vec<&'a DeviceInfo>> = BTreeMap::new();
    for d in candidates {
        groups.entry(key(d)).or_default().push(d);
    }
    let preferred: BTreeSet<String> = chosen.iter().map(|d| key(d)).collect();
    let mut order: Vec<(String, Vec<&'a DeviceInfo>)> = groups.into_iter().collect();
    if replicated {
        // Replicas: distributed spreads over devices with the most free replicas,
        // packed fills the devices with the fewest.
        let mut out = Vec::new();
        let mut free: Vec<(String, Vec<&'a DeviceInfo>)> = order;
        while out.len() < want {
            free.retain(|(_, v)| !v.is_empty());
            let pick = match policy {
                SharedAllocationPolicy::Distributed => free
                    .iter()
                    .enumerate()
                    .max_by(|(_, a), (_, b)| a.1.len().cmp(&b.1.len()).then(b.0.cmp(&a.0)))
                    .map(|(i, _)| i),
                SharedAllocationPolicy::Packed => free
                    .iter()
                    .enumerate()
                    .min_by(|(_, a), (_, b)| {
                        (!preferred.contains(&a.0))
                            .cmp(&!preferred.contains(&b.0))
                            .then(a.1.len().cmp(&b.1.len()))
                            .then(a.0.cmp(&b.0))
                    })
                    .map(|(i, _)| i),
            };
            let Some(i) = pick else { break };
            let d = free[i].1.remove(0);
            out.push(d);
        }
        return out;
    }
    // MIG: GPUs already used by the request first; then the smallest GPU that
    // holds the rest; otherwise the fullest GPUs first.
    order.sort_by(|a, b| {
        let fits_a = a.1.len() >= want;
        let fits_b = b.1.len() >= want;
        (!preferred.contains(&a.0))
            .cmp(&!preferred.contains(&b.0))
            .then(fits_b.cmp(&fits_a))
            .then_with(|| {
                if fits_a && fits_b {
                    a.1.len().cmp(&b.1.len())
                } else {
                    b.1.len().cmp(&a.1.len())
                }
            })
            .then(a.0.cmp(&b.0))
    });
    order.into_iter().flat_map(|(_, v)| v).take(want).collect()
}

/// The driver's device nodes every container with a GPU gets (with
/// `pass_device_specs`), where they exist on the node: a headless node may
/// lack `nvidia-modeset`, and a device spec whose node is missing fails the
/// container. [`ContainerAllocation::without_absent_nodes`] drops those.
pub const OPTIONAL_DEVICE_NODES: [&str; 4] = [
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-modeset",
];

/// What one container gets, before it is turned into the gRPC message.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerAllocation {
    /// Environment variables.
    pub envs: BTreeMap<String, String>,
    /// Mounts.
    pub mounts: Vec<MountSpec>,
    /// Device nodes.
    pub devices: Vec<DeviceNodeSpec>,
    /// Container annotations.
    pub annotations: BTreeMap<String, String>,
    /// Fully-qualified CDI device names.
    pub cdi_devices: Vec<String>,
}

impl ContainerAllocation {
    /// Drops the device specs of [`OPTIONAL_DEVICE_NODES`] that `exists`
    /// (given the path in the plugin's view of `/dev`) says are absent, as
    /// NVIDIA's device plugin does; the GPU and MIG capability nodes stay.
    pub fn without_absent_nodes(mut self, exists: impl Fn(&str) -> bool) -> ContainerAllocation {
        self.devices.retain(|d| {
            !OPTIONAL_DEVICE_NODES.contains(&d.container_path.as_str()) || exists(&d.container_path)
        });
        self
    }
}

/// A bind mount.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MountSpec {
    /// Path in the container.
    pub container_path: String,
    /// Path on the host.
    pub host_path: String,
    /// Read-only.
    pub read_only: bool,
}

/// A device node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNodeSpec {
    /// Path in the container.
    pub container_path: String,
    /// Path on the host.
    pub host_path: String,
    /// cgroup permissions.
    pub permissions: String,
}

fn join_root(root: &str, path: &str) -> String {
    let root = root.trim_end_matches('/');
    format!("{root}{path}")
}

/// Builds the response for one container's device ids. Replica ids are reduced
/// to their physical device; the order is the request order, so the same request
/// always gives the same response (the kubelet replays it after a restart).
pub fn allocate_container(
    resource: &Resource,
    settings: &Settings,
    requested: &[String],
) -> Result<ContainerAllocation, AllocateError> {
    if requested.is_empty() {
        return Err(AllocateError::Empty {
            resource: resource.name.clone(),
        });
    }
    let mut seen = BTreeSet::new();
    let mut dups = BTreeSet::new();
    let mut unknown = Vec::new();
    for id in requested {
        if !seen.insert(id.as_str()) {
            dups.insert(id.clone());
        }
        if resource.device(id).is_none() && !unknown.contains(id) {
            unknown.push(id.clone());
        }
    }
    if !unknown.is_empty() {
        return Err(AllocateError::Unknown {
            resource: resource.name.clone(),
            ids: unknown,
        });
    }
    if !dups.is_empty() {
        return Err(AllocateError::Duplicated {
            resource: resource.name.clone(),
            ids: dups.into_iter().collect(),
        });
    }
    if resource.replicas > 1 && settings.fail_requests_greater_than_one && requested.len() > 1 {
        return Err(AllocateError::TooManyReplicas {
            resource: resource.name.clone(),
            count: requested.len(),
        });
    }

    let mut physical: Vec<&DeviceInfo> = Vec::new();
    for id in requested {
        if let Some(d) = resource.device(id)
            && !physical.iter().any(|p| p.uuid == d.uuid)
        {
            physical.push(d);
        }
    }
    let names: Vec<String> = physical
        .iter()
        .map(|d| match settings.device_id_strategy {
            DeviceIdStrategy::Uuid => d.uuid.clone(),
            DeviceIdStrategy::Index => d.index_name.clone(),
        })
        .collect();

    let mut out = ContainerAllocation::default();
    let strategies = &settings.device_list_strategies;
    let only_cdi = strategies.iter().all(|s| s.is_cdi());
    let cdi_names: Vec<String> = names.iter().map(|n| format!("{CDI_KIND}={n}")).collect();
    for s in strategies {
        match s {
            DeviceListStrategy::Envvar => {
                out.envs
                    .insert("NVIDIA_VISIBLE_DEVICES".into(), names.join(","));
            }
            DeviceListStrategy::VolumeMounts => {
                out.envs
                    .insert("NVIDIA_VISIBLE_DEVICES".into(), VOLUME_MOUNT_DIR.into());
                for n in &names {
                    out.mounts.push(MountSpec {
                        container_path: format!("{VOLUME_MOUNT_DIR}/{n}"),
                        host_path: "/dev/null".into(),
                        read_only: false,
                    });
                }
            }
            DeviceListStrategy::CdiAnnotations => {
                let key = format!(
                    "{}gpu-stack-device-plugin_{}",
                    settings.cdi_annotation_prefix,
                    resource.short_name().replace('/', "_")
                );
                out.annotations.insert(key, cdi_names.join(","));
            }
            DeviceListStrategy::CdiCri => {
                out.cdi_devices = cdi_names.clone();
            }
        }
    }
    if !only_cdi {
        for (on, var) in [
            (settings.gdrcopy_enabled, "NVIDIA_GDRCOPY"),
            (settings.gds_enabled, "NVIDIA_GDS"),
            (settings.mofed_enabled, "NVIDIA_MOFED"),
        ] {
            if on {
                out.envs.insert(var.into(), "enabled".into());
            }
        }
        if !settings.imex_channel_ids.is_empty() {
            let ids: Vec<String> = settings
                .imex_channel_ids
                .iter()
                .map(u32::to_string)
                .collect();
            out.envs
                .insert("NVIDIA_IMEX_CHANNELS".into(), ids.join(","));
        }
    }
    if settings.sharing_strategy == SharingStrategy::Mps && resource.replicas > 1 {
        let dir = format!(
            "{}/{}",
            settings.mps_root.trim_end_matches('/'),
            resource.short_name()
        );
        out.envs
            .insert("CUDA_MPS_PIPE_DIRECTORY".into(), "/mps/pipe".into());
        out.mounts.push(MountSpec {
            container_path: "/mps/pipe".into(),
            host_path: format!("{dir}/pipe"),
            read_only: false,
        });
        out.mounts.push(MountSpec {
            container_path: "/dev/shm".into(),
            host_path: format!("{dir}/shm"),
            read_only: false,
        });
    }
    if settings.pass_device_specs {
        let root = &settings.dev_root;
        let mut paths: Vec<String> = OPTIONAL_DEVICE_NODES
            .into_iter()
            .map(String::from)
            .collect();
        for d in &physical {
            let node = format!("/dev/nvidia{}", d.gpu_minor);
            if !paths.contains(&node) {
                paths.push(node);
            }
            if let Some(m) = &d.mig {
                for cap in [m.gi_cap_minor, m.ci_cap_minor].into_iter().flatten() {
                    paths.push(format!("/dev/nvidia-caps/nvidia-cap{cap}"));
                }
            }
        }
        out.devices = paths
            .into_iter()
            .map(|p| DeviceNodeSpec {
                host_path: join_root(root, &p),
                container_path: p,
                permissions: "rw".into(),
            })
            .collect();
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deviceplugin::config::{ConfigFile, Overrides};
    use crate::deviceplugin::resources::node_resources;
    use crate::deviceplugin::resources::tests::dgx_a100;
    use proptest::prelude::*;

    fn settings(yaml: &str, ov: Overrides) -> Settings {
        Settings::resolve(Some(&ConfigFile::parse("t", yaml).unwrap()), &ov).unwrap()
    }

    fn nvlinks_pairs(pairs: &[(u32, u32)]) -> NvlinkMap {
        let mut m = NvlinkMap::new();
        for (a, b) in pairs {
            m.entry(*a).or_default().insert(*b);
            m.entry(*b).or_default().insert(*a);
        }
        m
    }

    fn gpu_res() -> Resource {
        node_resources(&dgx_a100(false), &Settings::defaults())
            .unwrap()
            .remove(0)
    }

    fn ids(r: &Resource) -> Vec<String> {
        r.devices.iter().map(|d| d.id.clone()).collect()
    }

    #[test]
    fn full_gpus_stay_on_one_numa_node_and_follow_nvlink() {
        let r = gpu_res();
        // GPUs 0-3 on NUMA 0, 4-7 on NUMA 1; NVLink only 1-2 and 5-6.
        let nv = nvlinks_pairs(&[(1, 2), (5, 6)]);
        let all = ids(&r);
        let got = preferred_allocation(&r, &nv, SharedAllocationPolicy::Distributed, &all, &[], 2)
            .unwrap();
        assert_eq!(got, vec![r.devices[1].id.clone(), r.devices[2].id.clone()]);
        // must include GPU 5: partner is 6 (NVLink, same NUMA)
        let got = preferred_allocation(
            &r,
            &nv,
            SharedAllocationPolicy::Distributed,
            &all,
            &[r.devices[5].id.clone()],
            2,
        )
        .unwrap();
        assert_eq!(got, vec![r.devices[5].id.clone(), r.devices[6].id.clone()]);
        // 4 GPUs: one whole NUMA node
        let got = preferred_allocation(&r, &nv, SharedAllocationPolicy::Distributed, &all, &[], 4)
            .unwrap();
        let numa: BTreeSet<_> = got.iter().map(|i| r.device(i).unwrap().numa_node).collect();
        assert_eq!(numa.len(), 1);
    }

    #[test]
    fn mig_devices_stay_on_one_gpu() {
        let s = settings(
            "{}",
            Overrides {
                mig_strategy: Some("mixed".into()),
                ..Overrides::default()
            },
        );
        let r = node_resources(&dgx_a100(true), &s).unwrap().remove(0);
        // GPU 2 has only 3 free, GPU 5 has 7 free; ask for 3 → all on GPU 2 (best fit).
        let avail: Vec<String> = r
            .devices
            .iter()
            .filter(|d| {
                d.gpu_index == 5
                    || (d.gpu_index == 2
                        && d.index_name.ends_with(":0")
                            | d.index_name.ends_with(":1")
                            | d.index_name.ends_with(":2"))
            })
            .map(|d| d.id.clone())
            .collect();
        let got = preferred_allocation(
            &r,
            &NvlinkMap::new(),
            SharedAllocationPolicy::Distributed,
            &avail,
            &[],
            3,
        )
        .unwrap();
        assert!(
            got.iter().all(|i| r.device(i).unwrap().gpu_index == 2),
            "{got:?}"
        );
        let got = preferred_allocation(
            &r,
            &NvlinkMap::new(),
            SharedAllocationPolicy::Distributed,
            &avail,
            &[],
            5,
        )
        .unwrap();
        assert!(
            got.iter().all(|i| r.device(i).unwrap().gpu_index == 5),
            "{got:?}"
        );
    }

    #[test]
    fn replicas_distributed_and_packed() {
        let yaml = "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 4}]}}";
        let s = settings(yaml, Overrides::default());
        let r = node_resources(&dgx_a100(false), &s).unwrap().remove(0);
        let all = ids(&r);
        let got = preferred_allocation(
            &r,
            &NvlinkMap::new(),
            SharedAllocationPolicy::Distributed,
            &all,
            &[],
            3,
        )
        .unwrap();
        let gpus: BTreeSet<_> = got
            .iter()
            .map(|i| r.device(i).unwrap().uuid.clone())
            .collect();
        assert_eq!(gpus.len(), 3);
        let got = preferred_allocation(
            &r,
            &NvlinkMap::new(),
            SharedAllocationPolicy::Packed,
            &all,
            &[],
            3,
        )
        .unwrap();
        let gpus: BTreeSet<_> = got
            .iter()
            .map(|i| r.device(i).unwrap().uuid.clone())
            .collect();
        assert_eq!(gpus.len(), 1);
    }

    #[test]
    fn preferred_allocation_rejects_unknown_ids_and_oversized_must_include() {
        let r = gpu_res();
        let nv = NvlinkMap::new();
        let policy = SharedAllocationPolicy::Distributed;
        let all = ids(&r);
        let mut avail = all.clone();
        avail.push("GPU-nope".into());
        let e = preferred_allocation(&r, &nv, policy, &avail, &["GPU-gone".into()], 2).unwrap_err();
        assert_eq!(
            e,
            AllocateError::Unknown {
                resource: "nvidia.com/gpu".into(),
                ids: vec!["GPU-gone".into(), "GPU-nope".into()]
            }
        );
        let msg = e.to_string();
        assert!(msg.contains("GPU-gone, GPU-nope"), "{msg}");
        assert!(msg.contains("ListAndWatch"), "{msg}");

        let must = vec![all[0].clone(), all[1].clone(), all[0].clone()];
        let e = preferred_allocation(&r, &nv, policy, &all, &must, 1).unwrap_err();
        assert_eq!(
            e,
            AllocateError::MustIncludeExceedsSize {
                resource: "nvidia.com/gpu".into(),
                must: 2,
                size: 1
            }
        );
        assert!(e.to_string().contains("2 must-include"), "{e}");
        // repeated ids count once: two distinct must-include ids fit a size of 2
        let got = preferred_allocation(&r, &nv, policy, &all, &must, 2).unwrap();
        assert_eq!(got, vec![all[0].clone(), all[1].clone()]);
        // a size past what is available gives everything there is
        let got = preferred_allocation(&r, &nv, policy, &all[..3], &[], 10).unwrap();
        assert_eq!(got, all[..3].to_vec());
    }

    #[test]
    fn unknown_id_messages_stay_short() {
        let r = gpu_res();
        let many: Vec<String> = (0..10_000).map(|i| format!("GPU-fake-{i:05}")).collect();
        let e = preferred_allocation(
            &r,
            &NvlinkMap::new(),
            SharedAllocationPolicy::Distributed,
            &many,
            &[],
            1,
        )
        .unwrap_err();
        let msg = e.to_string();
        assert!(msg.len() < 1_000, "{} bytes", msg.len());
        assert!(
            msg.contains("GPU-fake-00000") && msg.contains("more"),
            "{msg}"
        );
        let e = allocate_container(&r, &Settings::defaults(), &many).unwrap_err();
        assert!(e.to_string().len() < 1_000);
    }

    #[test]
    fn allocate_per_strategy() {
        let r = gpu_res();
        let req = vec![r.devices[3].id.clone(), r.devices[1].id.clone()];
        let env = allocate_container(&r, &Settings::defaults(), &req).unwrap();
        assert_eq!(
            env.envs["NVIDIA_VISIBLE_DEVICES"],
            format!("{},{}", req[0], req[1])
        );
        assert!(env.cdi_devices.is_empty() && env.annotations.is_empty());

        let ov = Overrides {
            device_list_strategy: Some("cdi-annotations".into()),
            device_id_strategy: Some("index".into()),
            ..Overrides::default()
        };
        let a = allocate_container(&r, &settings("{}", ov), &req).unwrap();
        assert!(a.envs.is_empty());
        assert_eq!(
            a.annotations["cdi.k8s.io/gpu-stack-device-plugin_gpu"],
            "nvidia.com/gpu=3,nvidia.com/gpu=1"
        );

        let ov = Overrides {
            device_list_strategy: Some("cdi-cri".into()),
            ..Overrides::default()
        };
        let c = allocate_container(&r, &settings("{}", ov), &req).unwrap();
        assert_eq!(
            c.cdi_devices,
            vec![
                format!("nvidia.com/gpu={}", req[0]),
                format!("nvidia.com/gpu={}", req[1])
            ]
        );
        assert!(c.envs.is_empty());

        let ov = Overrides {
            device_list_strategy: Some("volume-mounts".into()),
            pass_device_specs: Some(true),
            ..Overrides::default()
        };
        let v = allocate_container(&r, &settings("{}", ov), &req).unwrap();
        assert_eq!(v.envs["NVIDIA_VISIBLE_DEVICES"], VOLUME_MOUNT_DIR);
        assert_eq!(v.mounts.len(), 2);
        assert!(v.devices.iter().any(|d| d.host_path == "/dev/nvidia3"));
        assert!(
            v.devices
                .iter()
                .any(|d| d.host_path == "/dev/nvidia-modeset")
        );

        // Optional nodes the node lacks are dropped; GPU nodes always stay.
        let present = v
            .clone()
            .without_absent_nodes(|p| p != "/dev/nvidia-modeset");
        let paths: Vec<&str> = present
            .devices
            .iter()
            .map(|d| d.container_path.as_str())
            .collect();
        assert!(!paths.contains(&"/dev/nvidia-modeset"), "{paths:?}");
        assert!(paths.contains(&"/dev/nvidiactl"), "{paths:?}");
        assert_eq!(paths.len(), v.devices.len() - 1);
        let none = v.without_absent_nodes(|_| false);
        assert!(
            none.devices
                .iter()
                .all(|d| !OPTIONAL_DEVICE_NODES.contains(&d.container_path.as_str())),
            "{:?}",
            none.devices
        );
        assert!(none.devices.iter().any(|d| d.host_path == "/dev/nvidia3"));
    }

    #[test]
    fn allocate_rejects_unknown_and_duplicates() {
        let r = gpu_res();
        let a = r.devices[0].id.clone();
        let e = allocate_container(&r, &Settings::defaults(), &[a.clone(), "GPU-nope".into()])
            .unwrap_err();
        assert_eq!(
            e,
            AllocateError::Unknown {
                resource: "nvidia.com/gpu".into(),
                ids: vec!["GPU-nope".into()]
            }
        );
        let e = allocate_container(&r, &Settings::defaults(), &[a.clone(), a.clone()]).unwrap_err();
        assert!(e.to_string().contains(&a));
        assert!(allocate_container(&r, &Settings::defaults(), &[]).is_err());
    }

    #[test]
    fn replicas_collapse_and_mps_limit() {
        let s = settings(
            "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}",
            Overrides::default(),
        );
        let r = node_resources(&dgx_a100(false), &s).unwrap().remove(0);
        let u = r.devices[0].uuid.clone();
        let got = allocate_container(&r, &s, &[format!("{u}::0"), format!("{u}::1")]).unwrap();
        assert_eq!(got.envs["NVIDIA_VISIBLE_DEVICES"], u);
        let s = settings(
            "flags: {mpsRoot: /run/nvidia/mps}\nsharing: {mps: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}",
            Overrides::default(),
        );
        let r = node_resources(&dgx_a100(false), &s).unwrap().remove(0);
        let e = allocate_container(&r, &s, &[format!("{u}::0"), format!("{u}::1")]).unwrap_err();
        assert!(matches!(e, AllocateError::TooManyReplicas { .. }));
        let ok = allocate_container(&r, &s, &[format!("{u}::1")]).unwrap();
        assert_eq!(ok.envs["CUDA_MPS_PIPE_DIRECTORY"], "/mps/pipe");
    }

    fn any_resource() -> impl Strategy<Value = (Resource, NvlinkMap)> {
        (0u8..3, proptest::collection::vec((0u32..8, 0u32..8), 0..10)).prop_map(|(kind, links)| {
            let yaml = match kind {
                0 => "{}",
                1 => "flags: {migStrategy: mixed}",
                _ => "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 3}]}}",
            };
            let s = Settings::resolve(
                Some(&ConfigFile::parse("p", yaml).unwrap()),
                &Overrides::default(),
            )
            .unwrap();
            let r = node_resources(&dgx_a100(kind == 1), &s).unwrap().remove(0);
            let mut nv = NvlinkMap::new();
            for (a, b) in links {
                if a != b {
                    nv.entry(a).or_default().insert(b);
                    nv.entry(b).or_default().insert(a);
                }
            }
            (r, nv)
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        #[test]
        fn preferred_allocation_is_sound_and_order_independent(
            (r, nv) in any_resource(),
            pick in proptest::collection::vec(any::<prop::sample::Index>(), 0..20),
            must_pick in proptest::collection::vec(any::<prop::sample::Index>(), 0..4),
            extra in 0usize..10,
            packed in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let policy = if packed { SharedAllocationPolicy::Packed } else { SharedAllocationPolicy::Distributed };
            let n_dev = r.devices.len();
            // The kubelet's lists may repeat ids, and must-include ids need not be
            // in the available list: both are still valid requests.
            let avail: Vec<String> = pick.iter().map(|i| r.devices[i.index(n_dev)].id.clone()).collect();
            let must: Vec<String> = must_pick.iter().map(|i| r.devices[i.index(n_dev)].id.clone()).collect();
            let must_set: BTreeSet<&String> = must.iter().collect();
            let size = must_set.len() + extra;
            let union: BTreeSet<&String> = avail.iter().chain(&must).collect();
            let got = preferred_allocation(&r, &nv, policy, &avail, &must, size).unwrap();
            prop_assert_eq!(got.len(), size.min(union.len()));
            for m in &must { prop_assert!(got.contains(m)); }
            for g in &got {
                prop_assert!(union.contains(g));
                prop_assert!(r.device(g).is_some());
            }
            let mut sorted = got.clone();
            sorted.sort();
            sorted.dedup();
            prop_assert_eq!(&sorted, &got);
            // permuting the kubelet's lists changes nothing
            let mut shuffled = avail.clone();
            let n = shuffled.len();
            for i in 0..n { shuffled.swap(i, (seed as usize).wrapping_add(i * 7) % n); }
            shuffled.reverse();
            let mut must_rev = must.clone();
            must_rev.reverse();
            prop_assert_eq!(preferred_allocation(&r, &nv, policy, &shuffled, &must_rev, size).unwrap(), got);
        }

        #[test]
        fn preferred_allocation_rejects_invalid_requests(
            (r, nv) in any_resource(),
            pick in proptest::collection::vec(any::<prop::sample::Index>(), 0..10),
            must_pick in proptest::collection::vec(any::<prop::sample::Index>(), 1..4),
            bogus in "[a-z]{1,8}",
            in_must in any::<bool>(),
        ) {
            let policy = SharedAllocationPolicy::Distributed;
            let n_dev = r.devices.len();
            let mut avail: Vec<String> = pick.iter().map(|i| r.devices[i.index(n_dev)].id.clone()).collect();
            let mut must: Vec<String> = must_pick.iter().map(|i| r.devices[i.index(n_dev)].id.clone()).collect();
            let must_n = must.iter().collect::<BTreeSet<_>>().len();
            // must-include larger than the size
            let e = preferred_allocation(&r, &nv, policy, &avail, &must, must_n - 1).unwrap_err();
            prop_assert_eq!(e, AllocateError::MustIncludeExceedsSize {
                resource: r.name.clone(), must: must_n, size: must_n - 1,
            });
            // an id never advertised, in either list
            let unknown = format!("not-advertised-{bogus}");
            if in_must { must.push(unknown.clone()) } else { avail.push(unknown.clone()) }
            let e = preferred_allocation(&r, &nv, policy, &avail, &must, must_n + 1).unwrap_err();
            prop_assert_eq!(e, AllocateError::Unknown { resource: r.name.clone(), ids: vec![unknown] });
        }

        #[test]
        fn allocate_is_deterministic_and_covers_each_device((r, _nv) in any_resource(), pick in proptest::collection::vec(any::<prop::sample::Index>(), 1..6)) {
            let mut req: Vec<String> = pick.iter().map(|i| r.devices[i.index(r.devices.len())].id.clone()).collect();
            let mut seen = BTreeSet::new();
            req.retain(|i| seen.insert(i.clone()));
            let s = Settings::defaults();
            let a = allocate_container(&r, &s, &req).unwrap();
            prop_assert_eq!(&allocate_container(&r, &s, &req).unwrap(), &a);
            let visible = &a.envs["NVIDIA_VISIBLE_DEVICES"];
            for id in &req {
                let d = r.device(id).unwrap();
                prop_assert!(visible.split(',').any(|v| v == d.uuid));
            }
        }
    }
}
