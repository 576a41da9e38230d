//! The devices one node publishes in its ResourceSlices: each GPU as a whole
//! device and, on MIG-capable GPUs, one device per MIG placement, with the
//! counter set of [`CounterModel`] so that every set the scheduler allocates
//! together is a valid layout.
//!
//! Names and attributes follow NVIDIA's DRA driver where it has them
//! (`gpu-<minor>`, `gpu-<minor>-mig-<profile>-<profile id>-<start>`; `type`,
//! `uuid`, `parentUUID`, `profile`, `productName`, `architecture`,
//! `cudaComputeCapability`, `driverVersion`, `cudaDriverVersion`; capacities
//! `memory`, `multiprocessors`, `decoders`, `encoders`, `jpegEngines`,
//! `ofaEngines`), so DeviceClasses and CEL selectors written for it select
//! the same devices here. `index`, `parentIndex`, `placementStart` and
//! `placementSize` are gpu-stack's own.

use std::collections::BTreeMap;

use serde::Serialize;

use super::counters::{CounterModel, CounterModelError, ModelDevice};
use crate::backend::{GpuInfo, SystemInfo};
use crate::mig::{MigGeometry, PlacedInstance};

/// The driver name NVIDIA's DRA driver uses, kept so its DeviceClasses work.
pub const DEFAULT_DRIVER_NAME: &str = "gpu.nvidia.com";

/// The Kubernetes-wide PCI bus id attribute (KEP-5491 standard attributes).
pub const PCI_BUS_ID_ATTRIBUTE: &str = "resource.kubernetes.io/pciBusID";

/// A device attribute value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum AttributeValue {
    /// A string.
    String(String),
    /// An integer.
    Int(i64),
    /// A boolean.
    Bool(bool),
    /// A semantic version (`major.minor.patch`).
    Version(String),
}

/// A counter set: one per MIG-capable GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CounterSet {
    /// Set name (a DNS label).
    pub name: String,
    /// Counters and their capacities, in the model's order.
    pub counters: Vec<(String, u64)>,
}

/// One published device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DraDevice {
    /// Device name, unique in the node's pool (a DNS label).
    pub name: String,
    /// Which device of its GPU's model it is.
    #[serde(skip)]
    pub kind: ModelDevice,
    /// Attributes.
    pub attributes: BTreeMap<String, AttributeValue>,
    /// Capacities (memory in bytes).
    pub capacity: BTreeMap<String, u64>,
    /// Counters consumed from the GPU's counter set (non-zero only).
    pub consumes: Vec<(String, u64)>,
}

/// What one GPU publishes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuDevices {
    /// GPU index.
    pub gpu: u32,
    /// GPU UUID.
    pub uuid: String,
    /// The counter set, on MIG-capable GPUs.
    pub counter_set: Option<CounterSet>,
    /// The whole GPU first, then MIG devices.
    pub devices: Vec<DraDevice>,
    /// The counter model behind the MIG devices.
    #[serde(skip)]
    pub model: Option<CounterModel>,
    /// Why MIG devices are not published, where they could have been.
    pub mig_left_out: Option<String>,
}

/// One GPU to publish.
#[derive(Debug, Clone)]
pub struct PublishGpu<'a> {
    /// What the backend reports.
    pub info: &'a GpuInfo,
    /// Its MIG geometry (catalog or runtime), if MIG capable.
    pub geometry: Option<&'a MigGeometry>,
    /// Instances on the GPU that no prepared claim owns: they stay, so the
    /// counters offer only what they leave.
    pub foreign: &'a [PlacedInstance],
}

/// The name of GPU `minor`'s whole-GPU device.
pub fn gpu_device_name(minor: u32) -> String {
    format!("gpu-{minor}")
}

/// The name of a MIG placement device (NVIDIA's canonical form: the profile
/// without dots, other characters that a DNS label lacks as `-`).
pub fn mig_device_name(minor: u32, profile: &str, profile_id: u32, start: u32) -> String {
    let p = dns_label_chars(&profile.replace('.', ""));
    format!("gpu-{minor}-mig-{p}-{profile_id}-{start}")
}

/// `s` in lower case with every character a DNS label lacks as `-`.
pub fn dns_label_chars(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect()
}

/// A version as `major.minor.patch` without leading zeros (`570.195.03` ->
/// `570.195.3`, `12.4` -> `12.4.0`); `None` if it is not one.
pub fn semver(version: &str) -> Option<String> {
    let parts: Vec<&str> = version.trim().split('.').collect();
    if parts.is_empty() || parts.len() > 3 {
        return None;
    }
    let mut nums = Vec::with_capacity(3);
    for p in &parts {
        if p.is_empty() || p.len() > 9 || !p.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        nums.push(p.parse::<u64>().ok()?);
    }
    nums.resize(3, 0);
    Some(format!("{}.{}.{}", nums[0], nums[1], nums[2]))
}

/// `00000000:3B:00.0` -> `0000:3b:00.0`, the form the standard attribute takes.
fn pci_bus_id(id: &str) -> Option<String> {
    let (domain, rest) = id.split_once(':')?;
    let domain = domain.get(domain.len().saturating_sub(4)..)?;
    Some(format!("{domain}:{rest}").to_ascii_lowercase())
}

fn common_attributes(info: &GpuInfo, system: &SystemInfo) -> BTreeMap<String, AttributeValue> {
    let mut a = BTreeMap::new();
    a.insert(
        "productName".into(),
        AttributeValue::String(info.name.clone()),
    );
    a.insert(
        "architecture".into(),
        AttributeValue::String(info.architecture.clone()),
    );
    let (major, minor) = info.compute_capability;
    a.insert(
        "cudaComputeCapability".into(),
        AttributeValue::Version(format!("{major}.{minor}.0")),
    );
    if let Some(v) = semver(&system.driver_version) {
        a.insert("driverVersion".into(), AttributeValue::Version(v));
    }
    if let Some(v) = semver(&system.cuda_driver_version) {
        a.insert("cudaDriverVersion".into(), AttributeValue::Version(v));
    }
    if let Some(id) = pci_bus_id(&info.pci_bus_id) {
        a.insert(PCI_BUS_ID_ATTRIBUTE.into(), AttributeValue::String(id));
    }
    a
}

/// The devices of one GPU.
pub fn gpu_devices(gpu: &PublishGpu<'_>, system: &SystemInfo) -> GpuDevices {
    let info = gpu.info;
    let mut whole_attrs = common_attributes(info, system);
    whole_attrs.insert("type".into(), AttributeValue::String("gpu".into()));
    whole_attrs.insert("uuid".into(), AttributeValue::String(info.uuid.clone()));
    whole_attrs.insert("index".into(), AttributeValue::Int(info.index.into()));
    whole_attrs.insert(
        "minor".into(),
        AttributeValue::Int(info.minor_number.into()),
    );
    whole_attrs.insert("migCapable".into(), AttributeValue::Bool(info.mig_capable));
    let mut whole = DraDevice {
        name: gpu_device_name(info.minor_number),
        kind: ModelDevice::WholeGpu,
        attributes: whole_attrs,
        capacity: BTreeMap::from([("memory".to_string(), info.memory_total_bytes)]),
        consumes: Vec::new(),
    };
    let mut out = GpuDevices {
        gpu: info.index,
        uuid: info.uuid.clone(),
        counter_set: None,
        devices: Vec::new(),
        model: None,
        mig_left_out: None,
    };
    let geometry = match (info.mig_capable, gpu.geometry) {
        (true, Some(g)) => g,
        (true, None) => {
            out.mig_left_out = Some(format!(
                "GPU {} ({}) is MIG capable but its MIG geometry is unknown",
                info.index, info.name
            ));
            out.devices.push(whole);
            return out;
        }
        _ => {
            out.devices.push(whole);
            return out;
        }
    };
    let model = match CounterModel::derive(geometry) {
        Ok(m) => m,
        Err(e @ CounterModelError::TooManyCounters { .. } | e @ CounterModelError::Geometry(_)) => {
            out.mig_left_out = Some(format!("GPU {}: {e}", info.index));
            out.devices.push(whole);
            return out;
        }
    };
    let capacities = model.remaining_after(geometry, gpu.foreign);
    let set_name = format!("gpu-{}-counters", info.minor_number);
    out.counter_set = Some(CounterSet {
        name: set_name,
        counters: model
            .counters
            .iter()
            .zip(&capacities)
            .map(|(c, &cap)| (c.name.clone(), cap))
            .collect(),
    });
    let consumes = |kind: ModelDevice| -> Vec<(String, u64)> {
        model
            .counters
            .iter()
            .zip(model.consumption(kind))
            .filter(|(_, n)| *n > 0)
            .map(|(c, n)| (c.name.clone(), n))
            .collect()
    };
    // A device that cannot fit even alone (foreign instances hold its
    // slices) is not published.
    if model.allows_within(&[ModelDevice::WholeGpu], &capacities) {
        whole.consumes = consumes(ModelDevice::WholeGpu);
        out.devices.push(whole);
    }
    for d in preference_order(&model) {
        let kind = ModelDevice::Placement(d);
        if !model.allows_within(&[kind], &capacities) {
            continue;
        }
        let p = &model.placements[d];
        let profile = &geometry.gi_profiles[p.profile];
        let name = profile.name.to_string();
        let mut attrs = common_attributes(info, system);
        attrs.insert("type".into(), AttributeValue::String("mig".into()));
        attrs.insert("profile".into(), AttributeValue::String(name.clone()));
        attrs.insert(
            "parentUUID".into(),
            AttributeValue::String(info.uuid.clone()),
        );
        attrs.insert("parentIndex".into(), AttributeValue::Int(info.index.into()));
        attrs.insert("placementStart".into(), AttributeValue::Int(p.start.into()));
        attrs.insert("placementSize".into(), AttributeValue::Int(p.size.into()));
        let mut capacity = BTreeMap::new();
        if let Some(mib) = profile.memory_mib {
            capacity.insert("memory".to_string(), mib.saturating_mul(1 << 20));
        }
        if let Some(sm) = profile.multiprocessors {
            capacity.insert("multiprocessors".to_string(), sm.into());
        }
        capacity.insert("decoders".to_string(), profile.media.decoders.into());
        capacity.insert("encoders".to_string(), profile.media.encoders.into());
        capacity.insert("jpegEngines".to_string(), profile.media.jpeg.into());
        capacity.insert("ofaEngines".to_string(), profile.media.ofa.into());
        out.devices.push(DraDevice {
            name: mig_device_name(info.minor_number, &name, profile.id, p.start),
            kind,
            attributes: attrs,
            capacity,
            consumes: consumes(kind),
        });
    }
    out.model = Some(model);
    out
}

/// MIG devices in the order the scheduler should try them: it takes the first
/// device that matches, so within a profile the placement that blocks the
/// fewest smallest instances goes first (a 3g at slice 4 before slice 0: it
/// leaves four 1g slots, not three), then by start.
fn preference_order(model: &CounterModel) -> Vec<usize> {
    let smallest = model.placements.iter().map(|p| p.size).min().unwrap_or(1);
    let blocks = |d: usize| {
        let p = &model.placements[d];
        model
            .placements
            .iter()
            .filter(|q| {
                q.size == smallest && q.start < p.start + p.size && p.start < q.start + q.size
            })
            .count()
    };
    let mut order: Vec<usize> = (0..model.placements.len()).collect();
    order.sort_by_key(|&d| {
        (
            model.placements[d].profile,
            blocks(d),
            model.placements[d].start,
        )
    });
    order
}

/// Where a published device lives: its GPU and its kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceLocation {
    /// Index into the node's [`GpuDevices`] list.
    pub gpu_position: usize,
    /// Device kind.
    pub kind: ModelDevice,
}

/// Finds a device by name among a node's published GPUs.
pub fn find_device(gpus: &[GpuDevices], name: &str) -> Option<DeviceLocation> {
    gpus.iter().enumerate().find_map(|(gpu_position, g)| {
        g.devices
            .iter()
            .find(|d| d.name == name)
            .map(|d| DeviceLocation {
                gpu_position,
                kind: d.kind,
            })
    })
}

#[cfg(test)]
pub(crate) mod tests;
