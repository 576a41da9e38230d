//! A node's ResourceSlices (`resource.k8s.io/v1`) from the devices core
//! decides, and publishing them: one slice per GPU (its counter set with its
//! devices, as 1.34 requires both in one slice), all in one pool named after
//! the node, applied with server-side apply; slices of the driver on the node
//! that are no longer wanted are deleted.

use std::collections::BTreeMap;

use gpu_stack_core::dra::devices::{AttributeValue, GpuDevices, dns_label_chars};
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
}

/// The slice name of GPU `index` of `node` for `driver`.
pub fn slice_name(node: &str, driver: &str, gpu: u32) -> String {
    let driver = dns_label_chars(driver);
    let name = format!("{node}-{driver}-gpu-{gpu}");
    if name.len() <= 253 {
        return name;
    }
    // Keep names unique when long node names would be cut.
    let tail = format!("-{:08x}-gpu-{gpu}", fnv(&name));
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

/// The ResourceSlices of a node: one per GPU, in GPU order.
pub fn node_slices(
    driver: &str,
    owner: &SliceOwner,
    generation: i64,
    gpus: &[GpuDevices],
) -> Vec<ResourceSlice> {
    gpus.iter()
        .map(|g| {
            let set_name = g.counter_set.as_ref().map(|s| s.name.clone());
            let devices = g
                .devices
                .iter()
                .map(|d| Device {
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
                    consumes_counters: match (&set_name, d.consumes.is_empty()) {
                        (Some(set), false) => Some(vec![DeviceCounterConsumption {
                            counter_set: set.clone(),
                            counters: counters(&d.consumes),
                        }]),
                        _ => None,
                    },
                    ..Default::default()
                })
                .collect();
            ResourceSlice {
                metadata: ObjectMeta {
                    name: Some(slice_name(&owner.node, driver, g.gpu)),
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
                        resource_slice_count: gpus.len() as i64,
                    },
                    shared_counters: g.counter_set.as_ref().map(|s| {
                        vec![CounterSet {
                            name: s.name.clone(),
                            counters: counters(&s.counters),
                        }]
                    }),
                    devices: Some(devices),
                    ..Default::default()
                },
            }
        })
        .collect()
}

/// Applies a node's slices and deletes the driver's other slices on it.
/// Returns how many writes it made (applies and deletes).
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
        api.patch(&name, &params, &Patch::Apply(&body))
            .await
            .map_err(|e| err(format!("apply {name}"), e))?;
        writes += 1;
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
    fn one_slice_per_gpu_in_one_pool_with_its_counter_set() {
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
        let slices = node_slices("gpu.nvidia.com", &owner, 3, &gpus);
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
        // Within the API's limits.
        let consumptions: usize = devices
            .iter()
            .flat_map(|d| d.consumes_counters.iter().flatten())
            .map(|c| c.counters.len())
            .sum();
        assert!(devices.len() <= 128 && consumptions <= 1024 && sets[0].counters.len() <= 32);
    }

    #[test]
    fn long_node_names_give_distinct_bounded_slice_names() {
        let a = slice_name(&"a".repeat(300), "gpu.nvidia.com", 0);
        let b = slice_name(&"a".repeat(301), "gpu.nvidia.com", 0);
        assert!(a.len() <= 253 && b.len() <= 253 && a != b);
    }
}
