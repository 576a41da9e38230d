//! Dynamic Resource Allocation in the end-to-end tests: simulated GPUs'
//! ResourceSlices published for kwok nodes as the DRA plugin publishes a real
//! node's (kwok runs no plugin), the chart's DeviceClasses, MIG
//! ResourceClaims and the pods that consume them, and allocations read back
//! as MIG placements.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use futures::{StreamExt, TryStreamExt};
use gpu_stack_core::backend::{GpuInfo, SystemInfo};
use gpu_stack_core::catalog::GpuModel;
use gpu_stack_core::dra::counters::ModelDevice;
use gpu_stack_core::dra::devices::{GpuDevices, PublishGpu, find_device, gpu_devices};
use gpu_stack_core::mig::{MigGeometry, PlacedInstance};
use gpu_stack_k8s::dra::slices::{SliceOwner, node_slices, publish, server_slice_shape};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};

use crate::chart::template;

pub use gpu_stack_core::dra::devices::DEFAULT_DRIVER_NAME as DRIVER;

/// The DeviceClass of MIG devices (NVIDIA's name, rendered by the chart).
pub const MIG_CLASS: &str = "mig.nvidia.com";

/// Applies the chart's DeviceClass `chart_name` under a name of this run,
/// `<run>.<chart_name>`, and returns that name. DeviceClasses are
/// cluster-wide: the real-node test installs the chart's own with Helm at
/// the same time, and Helm refuses to adopt a class another test applied.
/// Remove it with [`delete_run_class`].
pub async fn apply_chart_class(client: &Client, chart_name: &str, run: &str) -> Result<String> {
    let class = chart_device_classes()?
        .into_iter()
        .find(|c| c.name_any() == chart_name)
        .with_context(|| format!("the chart renders no DeviceClass {chart_name}"))?;
    let name = format!("{run}.{chart_name}");
    Api::<DeviceClass>::all(client.clone())
        .patch(
            &name,
            &PatchParams::apply("gpu-stack-e2e").force(),
            &Patch::Apply(&serde_json::json!({
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": name},
                "spec": class.spec,
            })),
        )
        .await
        .with_context(|| format!("applying the chart's DeviceClass {chart_name} as {name}"))?;
    Ok(name)
}

/// Deletes a DeviceClass [`apply_chart_class`] made (errors only logged:
/// it runs in cleanup).
pub async fn delete_run_class(client: &Client, name: &str) {
    if let Err(err) = Api::<DeviceClass>::all(client.clone())
        .delete(name, &DeleteParams::default())
        .await
    {
        eprintln!("cleanup: deleting the DeviceClass {name}: {err}");
    }
}

/// The request name in every claim and pod of these tests.
pub const REQUEST: &str = "mig";

/// What the simulated driver reports.
pub fn system() -> SystemInfo {
    SystemInfo {
        driver_version: "570.195.03".into(),
        cuda_driver_version: "12.8".into(),
        nvml_version: "12.570.195.03".into(),
    }
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// One GPU of `model` at `minor` on `node`, as the backend would report it:
/// its UUID is unique per node and GPU, as real UUIDs are.
pub fn simulated_gpu(model: &GpuModel, node: &str, minor: u32) -> GpuInfo {
    let h = fnv(&format!("{node}/{minor}"));
    GpuInfo {
        index: minor,
        uuid: format!(
            "GPU-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
            h >> 32,
            (h >> 16) & 0xffff,
            h & 0xffff,
            minor,
            fnv(node) & 0xffff_ffff_ffff
        ),
        name: model.product_name.clone(),
        pci_bus_id: format!("00000000:{:02X}:00.0", 0x18 + minor * 0x10),
        pci_device_id: model.pci_device_ids.first().copied().unwrap_or(0x10DE),
        minor_number: minor,
        memory_total_bytes: model.memory_mib << 20,
        numa_node: Some(minor / 4),
        architecture: model.architecture.to_string(),
        compute_capability: model.compute_capability,
        mig_capable: model.mig.is_some(),
        mig_mode: None,
    }
}

/// What each GPU publishes (no instances made outside claims).
pub fn devices_of(gpus: &[(GpuInfo, Option<&MigGeometry>)]) -> Vec<GpuDevices> {
    let system = system();
    gpus.iter()
        .map(|(info, geometry)| {
            gpu_devices(
                &PublishGpu {
                    info,
                    geometry: *geometry,
                    foreign: &[],
                },
                &system,
            )
        })
        .collect()
}

/// Publishes `gpus` as the ResourceSlices of `node` (owned by the node, so
/// they go with it) and returns the slices sent.
pub async fn publish_node(
    client: &Client,
    node: &str,
    node_uid: Option<String>,
    gpus: &[GpuDevices],
) -> Result<Vec<ResourceSlice>> {
    let owner = SliceOwner {
        node: node.to_string(),
        node_uid,
    };
    let (_, shape) = server_slice_shape(client, node).await?;
    let slices = node_slices(DRIVER, &owner, 1, shape, gpus);
    publish(client, DRIVER, node, &slices)
        .await
        .with_context(|| format!("publishing the ResourceSlices of {node}"))?;
    Ok(slices)
}

/// Deletes the driver's slices on each of `nodes` (16 requests in flight).
pub async fn delete_node_slices(client: &Client, nodes: &[String]) -> Result<()> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    futures::stream::iter(nodes.iter().map(|node| {
        let api = api.clone();
        async move {
            api.delete_collection(
                &DeleteParams::default(),
                &ListParams::default()
                    .fields(&format!("spec.nodeName={node},spec.driver={DRIVER}")),
            )
            .await
            .map(|_| ())
        }
    }))
    .buffer_unordered(16)
    .try_collect::<Vec<()>>()
    .await?;
    Ok(())
}

/// The chart's DeviceClasses (`dra.enabled=true`), as `helm template`
/// renders them.
pub fn chart_device_classes() -> Result<Vec<DeviceClass>> {
    template(
        "gpu-stack",
        &[
            "--set",
            "dra.enabled=true",
            "--show-only",
            "templates/deviceclasses.yaml",
        ],
    )?
    .into_iter()
    .map(|d| serde_json::from_value(d).context("a rendered DeviceClass"))
    .collect()
}

/// A claim for `count` MIG devices of `profile` from the DeviceClass
/// `class`, selected by the attribute NVIDIA's driver publishes too.
pub fn mig_claim(name: &str, class: &str, profile: &str, count: u32) -> Result<ResourceClaim> {
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "labels": {"profile": profile.replace('.', "-")}},
        "spec": {"devices": {"requests": [{
            "name": REQUEST,
            "exactly": {
                "deviceClassName": class,
                "allocationMode": "ExactCount",
                "count": count,
                "selectors": [{"cel": {
                    "expression": format!("device.attributes['{DRIVER}'].profile == '{profile}'"),
                }}],
            },
        }]}},
    }))?)
}

/// A pod that consumes the existing claim `claim` in its one container.
pub fn claim_pod(name: &str, claim: &str, node_selector: &BTreeMap<String, String>) -> Result<Pod> {
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": node_selector,
            "resourceClaims": [{"name": REQUEST, "resourceClaimName": claim}],
            "containers": [{
                "name": "infer",
                "image": "registry.example.com/infer:1",
                "resources": {"claims": [{"name": REQUEST}]},
            }],
        },
    }))?)
}

/// A quantity as an integer (plain digits, or a decimal or binary SI suffix
/// the API server may write when it canonicalizes).
pub fn quantity_u64(q: &Quantity) -> Option<u64> {
    let s = q.0.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, suffix) = s.split_at(split);
    let n: u64 = digits.parse().ok()?;
    let factor: u64 = match suffix {
        "" => 1,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "P" => 1_000_000_000_000_000,
        "E" => 1_000_000_000_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "Ei" => 1 << 60,
        _ => return None,
    };
    n.checked_mul(factor)
}

/// Where an allocated device is: its GPU's position among the node's GPUs and
/// the MIG instance it stands for; `None` for a device that is no MIG
/// placement of these GPUs.
pub fn placement_of(
    gpus: &[GpuDevices],
    geometry: &MigGeometry,
    device: &str,
) -> Option<(usize, PlacedInstance)> {
    let location = find_device(gpus, device)?;
    let ModelDevice::Placement(index) = location.kind else {
        return None;
    };
    let model = gpus[location.gpu_position].model.as_ref()?;
    let p = model.placements.get(index)?;
    let profile = geometry.gi_profiles.get(p.profile)?.name.clone();
    Some((location.gpu_position, PlacedInstance::new(profile, p.start)))
}

/// The devices allocated to `claim` as (pool, device), for this driver.
pub fn allocated_devices(claim: &ResourceClaim) -> Vec<(String, String)> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .map(|d| {
            d.results
                .iter()
                .flatten()
                .filter(|r| r.driver == DRIVER)
                .map(|r| (r.pool.clone(), r.device.clone()))
                .collect()
        })
        .unwrap_or_default()
}

/// Removes the claims in `namespace`, finalizers included: the scheduler
/// protects allocated claims with one that only the controller manager
/// removes once no pod uses them, and a test's leftovers must not wait for it.
pub async fn delete_claims(client: &Client, namespace: &str) -> Result<()> {
    let api: Api<ResourceClaim> = Api::namespaced(client.clone(), namespace);
    let _ = api
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    let left = api.list_metadata(&ListParams::default()).await?;
    futures::stream::iter(left.items.into_iter().map(|c| {
        let api = api.clone();
        async move {
            let name = c.name_any();
            let patch = serde_json::json!({"metadata": {"finalizers": null}});
            match api
                .patch(
                    &name,
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&patch),
                )
                .await
            {
                Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
                other => other.map(|_| ()),
            }
        }
    }))
    .buffer_unordered(16)
    .try_collect::<Vec<()>>()
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_stack_core::catalog;

    #[test]
    fn quantities_read_back_as_written_or_canonicalized() {
        for (s, n) in [("7", 7), ("1k", 1000), ("80Gi", 80 << 30), ("0", 0)] {
            assert_eq!(quantity_u64(&Quantity(s.into())), Some(n), "{s}");
        }
        assert_eq!(quantity_u64(&Quantity("1.5".into())), None);
    }

    #[test]
    fn simulated_gpus_have_unique_uuids_and_the_models_identity() {
        let h100 = catalog::lookup("H100-SXM5-80GB").unwrap();
        let a = simulated_gpu(h100, "dra-1", 0);
        let b = simulated_gpu(h100, "dra-1", 1);
        let c = simulated_gpu(h100, "dra-2", 0);
        assert!(a.uuid != b.uuid && a.uuid != c.uuid && b.uuid != c.uuid);
        assert_eq!(a.pci_device_id, 0x2330_10DE);
        assert!(a.mig_capable);
        assert_eq!(
            a.uuid.len(),
            "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".len()
        );
    }

    #[test]
    fn an_allocated_mig_device_maps_to_its_gpu_and_placement() {
        let h100 = catalog::lookup("H100-SXM5-80GB").unwrap();
        let geometry = h100.mig.as_ref().unwrap();
        let infos: Vec<_> = (0..2)
            .map(|m| (simulated_gpu(h100, "n", m), Some(geometry)))
            .collect();
        let gpus = devices_of(&infos);
        let (gpu, placed) = placement_of(&gpus, geometry, "gpu-1-mig-3g40gb-9-4").unwrap();
        assert_eq!(gpu, 1);
        assert_eq!(
            (placed.profile.to_string().as_str(), placed.start),
            ("3g.40gb", 4)
        );
        assert!(placement_of(&gpus, geometry, "gpu-1").is_none());
    }
}
