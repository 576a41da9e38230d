//! Pod attribution: which pod and container hold each GPU or MIG instance,
//! computed from the kubelet pod-resources `List` answer.
//!
//! Device ids are matched against GPU UUIDs, MIG UUIDs and `nvidiaN` device
//! names; shared-replica suffixes (`::N`, `/vgpuN`) are stripped first, so a
//! time-sliced GPU is attributed to every pod sharing it.

use std::collections::BTreeMap;

use super::identity::EntityIdentity;

/// The resource name of whole GPUs.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// The prefix of MIG resource names (`nvidia.com/mig-1g.10gb`, ...).
pub const MIG_RESOURCE_PREFIX: &str = "nvidia.com/mig-";

/// One container's devices of one resource, as the kubelet reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerDevices {
    /// Pod name.
    pub pod: String,
    /// Pod namespace.
    pub namespace: String,
    /// Container name.
    pub container: String,
    /// Extended resource name, e.g. `nvidia.com/gpu`.
    pub resource_name: String,
    /// Device ids the device plugin handed out.
    pub device_ids: Vec<String>,
}

/// The pod labels added to a series.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Attribution {
    /// `container` label.
    pub container: String,
    /// `namespace` label.
    pub namespace: String,
    /// `pod` label.
    pub pod: String,
}

/// Which resource names count as GPUs: `nvidia.com/gpu`, `nvidia.com/mig-*`,
/// and any configured extra names (e.g. `nvidia.com/gpu.shared`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResourceMatcher {
    /// Extra resource names accepted besides the built-in ones.
    pub extra: Vec<String>,
}

impl ResourceMatcher {
    /// Whether devices of `resource_name` are GPUs or MIG instances.
    pub fn accepts(&self, resource_name: &str) -> bool {
        resource_name == GPU_RESOURCE
            || resource_name.starts_with(MIG_RESOURCE_PREFIX)
            || self.extra.iter().any(|e| e == resource_name)
    }
}

/// Strips a shared-replica suffix from a device id: `GPU-x::3` and
/// `GPU-x/vgpu3` both become `GPU-x`.
pub fn base_device_id(id: &str) -> &str {
    let id = match id.rfind("::") {
        Some(pos) if id[pos + 2..].bytes().all(|b| b.is_ascii_digit()) => &id[..pos],
        _ => id,
    };
    match id.rfind("/vgpu") {
        Some(pos) if id[pos + 5..].bytes().all(|b| b.is_ascii_digit()) => &id[..pos],
        _ => id,
    }
}

/// Attributions keyed by device UUID (the GPU UUID for whole GPUs, the MIG UUID
/// for MIG instances). Each list is sorted and free of duplicates.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attributions {
    by_device: BTreeMap<String, Vec<Attribution>>,
}

impl Attributions {
    /// The pods holding the entity, empty when none does.
    pub fn for_entity(&self, entity: &EntityIdentity) -> &[Attribution] {
        self.by_device
            .get(entity.device_uuid())
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// Number of devices with at least one pod.
    pub fn len(&self) -> usize {
        self.by_device.len()
    }

    /// Whether no device is attributed.
    pub fn is_empty(&self) -> bool {
        self.by_device.is_empty()
    }
}

/// Maps the kubelet's container devices onto the node's entities.
///
/// Devices of other resources and ids matching no entity are ignored: the
/// kubelet lists every extended resource, and a GPU may have left the node.
pub fn attribute(
    entries: &[ContainerDevices],
    matcher: &ResourceMatcher,
    entities: &[EntityIdentity],
) -> Attributions {
    let mut by_id: BTreeMap<&str, &str> = BTreeMap::new();
    for e in entities {
        by_id.insert(e.device_uuid(), e.device_uuid());
        match &e.mig {
            None => {
                by_id.insert(e.device.as_str(), e.device_uuid());
            }
            Some(m) => {
                for other in &m.other_uuids {
                    by_id.insert(other.as_str(), e.device_uuid());
                }
            }
        }
    }
    let mut by_device: BTreeMap<String, Vec<Attribution>> = BTreeMap::new();
    for entry in entries.iter().filter(|e| matcher.accepts(&e.resource_name)) {
        for id in &entry.device_ids {
            let Some(uuid) = by_id.get(base_device_id(id)) else {
                continue;
            };
            by_device
                .entry((*uuid).to_string())
                .or_default()
                .push(Attribution {
                    container: entry.container.clone(),
                    namespace: entry.namespace.clone(),
                    pod: entry.pod.clone(),
                });
        }
    }
    for list in by_device.values_mut() {
        list.sort();
        list.dedup();
    }
    Attributions { by_device }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::identity::MigIdentity;
    use proptest::prelude::*;

    fn gpu(i: u32) -> EntityIdentity {
        EntityIdentity {
            gpu: i,
            uuid: format!("GPU-{i}"),
            pci_bus_id: format!("00000000:{i:02X}:00.0"),
            device: format!("nvidia{i}"),
            model_name: "NVIDIA A100-SXM4-40GB".into(),
            mig: None,
        }
    }

    fn mig(i: u32, gi: u32) -> EntityIdentity {
        EntityIdentity {
            mig: Some(MigIdentity {
                profile: "1g.5gb".into(),
                gi_id: gi,
                uuid: format!("MIG-{i}-{gi}"),
                other_uuids: vec![format!("MIG-{i}-{gi}-ci1")],
            }),
            ..gpu(i)
        }
    }

    fn entry(pod: &str, res: &str, ids: &[&str]) -> ContainerDevices {
        ContainerDevices {
            pod: pod.into(),
            namespace: "ml".into(),
            container: "main".into(),
            resource_name: res.into(),
            device_ids: ids.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn gpus_migs_device_names_and_replicas_are_matched() {
        let ents = vec![gpu(0), gpu(1), mig(2, 7), gpu(3)];
        let entries = vec![
            entry("a", "nvidia.com/gpu", &["GPU-0"]),
            entry("b", "nvidia.com/mig-1g.5gb", &["MIG-2-7"]),
            entry("b2", "nvidia.com/mig-1g.5gb", &["MIG-2-7-ci1"]),
            entry("c", "nvidia.com/gpu", &["nvidia1"]),
            entry("d", "nvidia.com/gpu.shared", &["GPU-3::1"]),
            entry("e", "nvidia.com/gpu.shared", &["GPU-3::2"]),
            entry("x", "example.com/fpga", &["GPU-0"]),
            entry("y", "nvidia.com/gpu", &["GPU-gone"]),
        ];
        let matcher = ResourceMatcher {
            extra: vec!["nvidia.com/gpu.shared".into()],
        };
        let a = attribute(&entries, &matcher, &ents);
        assert_eq!(a.for_entity(&ents[0])[0].pod, "a");
        assert_eq!(a.for_entity(&ents[0]).len(), 1);
        assert_eq!(a.for_entity(&ents[1])[0].pod, "c");
        let mig_pods: Vec<&str> = a
            .for_entity(&ents[2])
            .iter()
            .map(|x| x.pod.as_str())
            .collect();
        assert_eq!(mig_pods, vec!["b", "b2"]);
        let shared: Vec<&str> = a
            .for_entity(&ents[3])
            .iter()
            .map(|x| x.pod.as_str())
            .collect();
        assert_eq!(shared, vec!["d", "e"]);
        let without_extra = attribute(&entries, &ResourceMatcher::default(), &ents);
        assert!(without_extra.for_entity(&ents[3]).is_empty());
    }

    #[test]
    fn replica_suffixes_are_stripped_only_when_numeric() {
        assert_eq!(base_device_id("GPU-a::4"), "GPU-a");
        assert_eq!(base_device_id("GPU-a/vgpu12"), "GPU-a");
        assert_eq!(base_device_id("GPU-a::x"), "GPU-a::x");
        assert_eq!(base_device_id("MIG-b"), "MIG-b");
    }

    proptest! {
        #[test]
        fn every_attribution_names_a_listed_pod(
            picks in proptest::collection::vec((0u32..6, 0u32..4, proptest::bool::ANY), 0..30)
        ) {
            let ents: Vec<EntityIdentity> = (0..4).map(gpu).collect();
            let entries: Vec<ContainerDevices> = picks.iter().map(|(p, g, shared)| {
                let id = if *shared { format!("GPU-{g}::{p}") } else { format!("GPU-{g}") };
                entry(&format!("pod{p}"), "nvidia.com/gpu", &[id.as_str()])
            }).collect();
            let a = attribute(&entries, &ResourceMatcher::default(), &ents);
            for e in &ents {
                let list = a.for_entity(e);
                let mut sorted = list.to_vec();
                sorted.sort();
                sorted.dedup();
                prop_assert_eq!(sorted.as_slice(), list);
                for att in list {
                    let listed = picks.iter().any(|(p, g, _)| format!("pod{p}") == att.pod && format!("GPU-{g}") == e.uuid);
                    prop_assert!(listed);
                }
            }
        }
    }
}
