//! A node's ResourceSlices (`resource.k8s.io/v1`) from the devices core
//! decides, cut as the API server's version requires
//! ([`gpu_stack_core::dra::slices`]: counter sets with their devices on 1.34,
//! in slices of their own from 1.35), all in one pool named after the node,
//! and publishing them with server-side apply, each checked as stored;
//! slices of the driver on the node that are no longer wanted are deleted.

use std::collections::BTreeMap;

use gpu_stack_core::dra::devices::{AttributeValue, DraDevice, GpuDevices, dns_label_chars};
use gpu_stack_core::dra::slices::{
    KubeVersion, SliceShape, VersionError, plan_slices, slice_shape,
};
use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, Device, DeviceAttribute, DeviceCapacity, DeviceCounterConsumption,
    ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};

/// Field manager of the plugin's slice writes.
pub const FIELD_MANAGER: &str = "gpu-dra-plugin";

/// The node a slice set belongs to.
#[derive(Debug, Clone)]
pub struct SliceOwner {
    /// Node name (also the pool name).
    pub node: String,
    /// Node UID, for the owner reference (slices go with their node).
    pub node_uid: Option<String>,
}

/// Errors writing slices.
#[derive(Debug, thiserror::Error)]
pub enum SliceError {
    /// The API server refused a write or a list.
    #[error(
        "ResourceSlice {what} for node {node}: {source}; check the plugin's RBAC (resourceslices: get, list, watch, create, update, patch, delete) and that resource.k8s.io/v1 is served"
    )]
    Api {
        /// What was done.
        what: String,
        /// Node.
        node: String,
        /// Cause.
        #[source]
        source: kube::Error,
    },
    /// The API server's version cannot carry the plugin's slices.
    #[error("node {node}: {source}")]
    Version {
        /// Node.
        node: String,
        /// Why.
        #[source]
        source: VersionError,
    },
    /// The API server stored a slice without the counters it was sent.
    #[error(
        "node {node}: the API server dropped {field} from ResourceSlice {slice}: DRA partitionable devices (shared counters) are off; on Kubernetes 1.34 and 1.35 start kube-apiserver and kube-scheduler with --feature-gates=DRAPartitionableDevices=true (on by default from 1.36). The plugin published nothing and removed its slices, since devices without counters would let the scheduler hand out overlapping MIG placements"
    )]
    CountersDropped {
        /// Node.
        node: String,
        /// Slice.
        slice: String,
        /// What was dropped.
        field: &'static str,
    },
}

/// The name of the slice of `node` for `driver` with `suffix` (a
/// [`PlannedSlice::suffix`](gpu_stack_core::dra::slices::PlannedSlice)).
pub fn slice_name(node: &str, driver: &str, suffix: &str) -> String {
    let driver = dns_label_chars(driver);
    let name = format!("{node}-{driver}-{suffix}");
    if name.len() <= 253 {
        return name;
    }
    // Keep names unique when long node names would be cut.
    let tail = format!("-{:08x}-{suffix}", fnv(&name));
    format!("{}{tail}", &node[..node.len().min(253 - tail.len())])
}

fn fnv(s: &str) -> u32 {
    s.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

fn quantity(n: u64) -> Quantity {
    Quantity(n.to_string())
}

fn counters(list: &[(String, u64)]) -> BTreeMap<String, Counter> {
    list.iter()
        .map(|(k, v)| {
            (
                k.clone(),
                Counter {
                    value: quantity(*v),
                },
            )
        })
        .collect()
}

fn attribute(v: &AttributeValue) -> DeviceAttribute {
    match v {
        AttributeValue::String(s) => DeviceAttribute {
            string: Some(s.clone()),
            ..Default::default()
        },
        AttributeValue::Int(i) => DeviceAttribute {
            int: Some(*i),
            ..Default::default()
        },
        AttributeValue::Bool(b) => DeviceAttribute {
            bool: Some(*b),
            ..Default::default()
        },
        AttributeValue::Version(s) => DeviceAttribute {
            version: Some(s.clone()),
            ..Default::default()
        },
    }
}

fn device(d: &DraDevice, set: Option<&str>) -> Device {
    Device {
        name: d.name.clone(),
        attributes: Some(
            d.attributes
                .iter()
                .map(|(k, v)| (k.clone(), attribute(v)))
                .collect(),
        ),
        capacity: Some(
            d.capacity
                .iter()
                .map(|(k, v)| {
                    (
                        k.clone(),
                        DeviceCapacity {
                            value: quantity(*v),
                            ..Default::default()
                        },
                    )
                })
                .collect(),
        ),
        consumes_counters: match (set, d.consumes.is_empty()) {
            (Some(set), false) => Some(vec![DeviceCounterConsumption {
                counter_set: set.to_string(),
                counters: counters(&d.consumes),
                ..Default::default()
            }]),
            _ => None,
        },
        ..Default::default()
    }
}

/// The ResourceSlices of a node, in publishing order, all in one pool named
/// after the node, cut as `shape` says ([`plan_slices`]).
pub fn node_slices(
    driver: &str,
    owner: &SliceOwner,
    generation: i64,
    shape: SliceShape,
    gpus: &[GpuDevices],
) -> Vec<ResourceSlice> {
    let plan = plan_slices(shape, gpus);
    let count = plan.len() as i64;
    plan.into_iter()
        .map(|p| {
            let shared_counters = (!p.counter_sets.is_empty()).then(|| {
                p.counter_sets
                    .iter()
                    .filter_map(|&i| gpus[i].counter_set.as_ref())
                    .map(|s| CounterSet {
                        name: s.name.clone(),
                        counters: counters(&s.counters),
                    })
                    .collect()
            });
            let devices = p.devices.map(|run| {
                let gpu = &gpus[run.gpu];
                let set = gpu.counter_set.as_ref().map(|s| s.name.as_str());
                gpu.devices[run.start..run.end]
                    .iter()
                    .map(|d| device(d, set))
                    .collect()
            });
            ResourceSlice {
                metadata: ObjectMeta {
                    name: Some(slice_name(&owner.node, driver, &p.suffix)),
                    owner_references: owner.node_uid.as_ref().map(|uid| {
                        vec![OwnerReference {
                            api_version: "v1".into(),
                            kind: "Node".into(),
                            name: owner.node.clone(),
                            uid: uid.clone(),
                            controller: Some(true),
                            ..Default::default()
                        }]
                    }),
                    labels: Some(BTreeMap::from([(
                        "app.kubernetes.io/managed-by".to_string(),
                        FIELD_MANAGER.to_string(),
                    )])),
                    ..Default::default()
                },
                spec: ResourceSliceSpec {
                    driver: driver.to_string(),
                    node_name: Some(owner.node.clone()),
                    pool: ResourcePool {
                        name: owner.node.clone(),
                        generation,
                        resource_slice_count: count,
                    },
                    shared_counters,
                    devices,
                    ..Default::default()
                },
            }
        })
        .collect()
}

/// What the API server dropped of a slice it stored: the counter sets, or
/// the devices' counter consumptions. An API server without
/// `DRAPartitionableDevices` drops both silently; devices without their
/// counters would let the scheduler hand out overlapping MIG placements.
pub fn dropped_counters(sent: &ResourceSlice, stored: &ResourceSlice) -> Option<&'static str> {
    let sets = |s: &ResourceSlice| s.spec.shared_counters.as_ref().map_or(0, Vec::len);
    let consumptions = |s: &ResourceSlice| {
        s.spec
            .devices
            .iter()
            .flatten()
            .filter(|d| d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty()))
            .count()
    };
    if sets(stored) < sets(sent) {
        Some("sharedCounters")
    } else if consumptions(stored) < consumptions(sent) {
        Some("consumesCounters")
    } else {
        None
    }
}

/// The API server's version and the slice shape it accepts; an API server
/// too old for `resource.k8s.io/v1` is refused before anything is published.
pub async fn server_slice_shape(
    client: &kube::Client,
    node: &str,
) -> Result<(KubeVersion, SliceShape), SliceError> {
    let info = client
        .apiserver_version()
        .await
        .map_err(|source| SliceError::Api {
            what: "read the API server's version for".into(),
            node: node.to_string(),
            source,
        })?;
    let version_error = |source| SliceError::Version {
        node: node.to_string(),
        source,
    };
    let version = KubeVersion::from_info(&info.git_version, &info.major, &info.minor)
        .map_err(version_error)?;
    let shape = slice_shape(version).map_err(version_error)?;
    tracing::info!(node, kubernetes = %version, ?shape, "ResourceSlice shape for this API server");
    Ok((version, shape))
}

/// Applies a node's slices in order and deletes the driver's other slices on
/// it (all of them when `slices` is empty). Each slice is checked as stored:
/// one whose counters were dropped stops the publishing with
/// [`SliceError::CountersDropped`]. Returns how many writes it made.
pub async fn publish(
    client: &kube::Client,
    driver: &str,
    node: &str,
    slices: &[ResourceSlice],
) -> Result<usize, SliceError> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let err = |what: String, source| SliceError::Api {
        what,
        node: node.to_string(),
        source,
    };
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let mut writes = 0;
    for s in slices {
        let name = s.metadata.name.clone().unwrap_or_default();
        let mut body = serde_json::to_value(s)
            .map_err(|e| err(format!("encode {name}"), kube::Error::SerdeError(e)))?;
        if let Some(o) = body.as_object_mut() {
            o.insert("apiVersion".into(), "resource.k8s.io/v1".into());
            o.insert("kind".into(), "ResourceSlice".into());
        }
        let counters_only = s.spec.devices.is_none() && s.spec.shared_counters.is_some();
        let stored = match api.patch(&name, &params, &Patch::Apply(&body)).await {
            Ok(stored) => stored,
            // With the gate off the API server drops the sets and then
            // refuses a slice that holds nothing.
            Err(kube::Error::Api(e)) if counters_only && e.code == 422 => {
                return Err(SliceError::CountersDropped {
                    node: node.to_string(),
                    slice: name,
                    field: "sharedCounters",
                });
            }
            Err(e) => return Err(err(format!("apply {name}"), e)),
        };
        writes += 1;
        if let Some(field) = dropped_counters(s, &stored) {
            return Err(SliceError::CountersDropped {
                node: node.to_string(),
                slice: name,
                field,
            });
        }
    }
    let wanted: Vec<&str> = slices
        .iter()
        .filter_map(|s| s.metadata.name.as_deref())
        .collect();
    let existing = api
        .list(&ListParams::default().fields(&format!("spec.nodeName={node},spec.driver={driver}")))
        .await
        .map_err(|e| err("list".into(), e))?;
    for s in existing.items {
        let Some(name) = s.metadata.name.as_deref() else {
            continue;
        };
        if !wanted.contains(&name) {
            match api.delete(name, &DeleteParams::default()).await {
                Ok(_) => writes += 1,
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(err(format!("delete {name}"), e)),
            }
        }
    }
    Ok(writes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_stack_core::backend::{GpuInfo, SystemInfo};
    use gpu_stack_core::catalog;
    use gpu_stack_core::dra::devices::{PublishGpu, gpu_devices};

    #[test]
    fn combined_for_1_34_and_split_from_1_35_in_one_pool() {
        let geometry = catalog::lookup("H100-SXM5-80GB")
            .unwrap()
            .mig
            .as_ref()
            .unwrap();
        let system = SystemInfo {
            driver_version: "570.195.03".into(),
            cuda_driver_version: "12.8".into(),
            nvml_version: "12.570.195.03".into(),
        };
        let gpus: Vec<GpuDevices> = (0..2)
            .map(|i| {
                let info = GpuInfo {
                    index: i,
                    uuid: format!("GPU-{i}"),
                    name: "NVIDIA H100 80GB HBM3".into(),
                    pci_bus_id: format!("00000000:0{i}:00.0"),
                    pci_device_id: 0x2330_10DE,
                    minor_number: i,
                    memory_total_bytes: 80 << 30,
                    numa_node: None,
                    architecture: "hopper".into(),
                    compute_capability: (9, 0),
                    mig_capable: true,
                    mig_mode: None,
                };
                gpu_devices(
                    &PublishGpu {
                        info: &info,
                        geometry: Some(geometry),
                        foreign: &[],
                    },
                    &system,
                )
            })
            .collect();
        let owner = SliceOwner {
            node: "node-a".into(),
            node_uid: Some("uid".into()),
        };
        let slices = node_slices("gpu.nvidia.com", &owner, 3, SliceShape::Combined, &gpus);
        assert_eq!(slices.len(), 2);
        let s = &slices[1];
        assert_eq!(
            s.metadata.name.as_deref(),
            Some("node-a-gpu-nvidia-com-gpu-1")
        );
        assert_eq!(s.spec.pool.name, "node-a");
        assert_eq!(
            (s.spec.pool.generation, s.spec.pool.resource_slice_count),
            (3, 2)
        );
        let sets = s.spec.shared_counters.as_ref().unwrap();
        assert_eq!(sets[0].name, "gpu-1-counters");
        let devices = s.spec.devices.as_ref().unwrap();
        assert_eq!(devices.len(), 26);
        let d = devices
            .iter()
            .find(|d| d.name == "gpu-1-mig-3g40gb-9-4")
            .unwrap();
        let c = &d.consumes_counters.as_ref().unwrap()[0];
        assert_eq!(c.counter_set, "gpu-1-counters");
        assert_eq!(c.counters["memory-slice-7"].value, Quantity("1".into()));

        // 1.35 and later: the sets in a slice of their own, first; each
        // GPU's devices in another, naming its set.
        let split = node_slices("gpu.nvidia.com", &owner, 3, SliceShape::Split, &gpus);
        let names: Vec<_> = split
            .iter()
            .filter_map(|s| s.metadata.name.as_deref())
            .collect();
        assert_eq!(
            names,
            [
                "node-a-gpu-nvidia-com-counters-0",
                "node-a-gpu-nvidia-com-gpu-0",
                "node-a-gpu-nvidia-com-gpu-1"
            ]
        );
        assert!(split.iter().all(|s| s.spec.pool.resource_slice_count == 3));
        let sets = split[0].spec.shared_counters.as_ref().unwrap();
        assert_eq!(sets.len(), 2);
        assert!(split[0].spec.devices.is_none());
        assert!(split[2].spec.shared_counters.is_none());
        let devices = split[2].spec.devices.as_ref().unwrap();
        assert_eq!(devices.len(), 26);
        let d = devices
            .iter()
            .find(|d| d.name == "gpu-1-mig-3g40gb-9-4")
            .unwrap();
        assert_eq!(
            d.consumes_counters.as_ref().unwrap()[0].counter_set,
            "gpu-1-counters"
        );
        // What the API server would store without DRAPartitionableDevices.
        let mut stripped = split[2].clone();
        for d in stripped.spec.devices.iter_mut().flatten() {
            d.consumes_counters = None;
        }
        assert_eq!(
            dropped_counters(&split[2], &stripped),
            Some("consumesCounters")
        );
        let mut no_sets = split[0].clone();
        no_sets.spec.shared_counters = None;
        assert_eq!(
            dropped_counters(&split[0], &no_sets),
            Some("sharedCounters")
        );
        assert_eq!(dropped_counters(&split[2], &split[2]), None);
    }

    #[test]
    fn long_node_names_give_distinct_bounded_slice_names() {
        let a = slice_name(&"a".repeat(300), "gpu.nvidia.com", "gpu-0");
        let b = slice_name(&"a".repeat(301), "gpu.nvidia.com", "gpu-0");
        assert!(a.len() <= 253 && b.len() <= 253 && a != b);
    }
}
