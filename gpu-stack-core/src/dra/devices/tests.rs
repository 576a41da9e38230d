use super::*;
use crate::catalog;

pub(crate) fn system() -> SystemInfo {
    SystemInfo {
        driver_version: "570.195.03".into(),
        cuda_driver_version: "12.8".into(),
        nvml_version: "12.570.195.03".into(),
    }
}

pub(crate) fn h100(index: u32) -> GpuInfo {
    GpuInfo {
        index,
        uuid: format!("GPU-0000000{index}-1111-2222-3333-444444444444"),
        name: "NVIDIA H100 80GB HBM3".into(),
        pci_bus_id: format!("00000000:1{index}:00.0"),
        pci_device_id: 0x2330_10DE,
        minor_number: index,
        memory_total_bytes: 80 << 30,
        numa_node: Some(0),
        architecture: "hopper".into(),
        compute_capability: (9, 0),
        mig_capable: true,
        mig_mode: None,
    }
}

fn h100_geometry() -> &'static MigGeometry {
    catalog::lookup("H100-SXM5-80GB")
        .unwrap()
        .mig
        .as_ref()
        .unwrap()
}

#[test]
fn an_h100_publishes_itself_whole_and_every_placement_with_nvidia_names() {
    let info = h100(3);
    let out = gpu_devices(
        &PublishGpu {
            info: &info,
            geometry: Some(h100_geometry()),
            foreign: &[],
        },
        &system(),
    );
    assert_eq!(out.devices.len(), 26);
    let whole = &out.devices[0];
    assert_eq!(whole.name, "gpu-3");
    assert_eq!(
        whole.attributes["type"],
        AttributeValue::String("gpu".into())
    );
    assert_eq!(
        whole.attributes["driverVersion"],
        AttributeValue::Version("570.195.3".into())
    );
    assert_eq!(
        whole.attributes["cudaComputeCapability"],
        AttributeValue::Version("9.0.0".into())
    );
    assert_eq!(
        whole.attributes[PCI_BUS_ID_ATTRIBUTE],
        AttributeValue::String("0000:13:00.0".into())
    );
    // The whole GPU consumes every counter in full.
    let set = out.counter_set.as_ref().unwrap();
    assert_eq!(set.name, "gpu-3-counters");
    assert_eq!(whole.consumes, set.counters);
    let names: Vec<&str> = out.devices.iter().map(|d| d.name.as_str()).collect();
    assert!(names.contains(&"gpu-3-mig-1g10gb-19-0"));
    assert!(names.contains(&"gpu-3-mig-1g10gb-me-20-6"));
    assert!(names.contains(&"gpu-3-mig-7g80gb-0-0"));
    // A 3g at slice 4 is offered before the one at slice 0.
    let three: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| n.contains("-3g40gb-"))
        .collect();
    assert_eq!(three, ["gpu-3-mig-3g40gb-9-4", "gpu-3-mig-3g40gb-9-0"]);
    let mig = out
        .devices
        .iter()
        .find(|d| d.name == "gpu-3-mig-3g40gb-9-4")
        .unwrap();
    assert_eq!(
        mig.attributes["profile"],
        AttributeValue::String("3g.40gb".into())
    );
    assert_eq!(mig.attributes["placementStart"], AttributeValue::Int(4));
    assert_eq!(
        mig.attributes["parentUUID"],
        AttributeValue::String(info.uuid.clone())
    );
    assert_eq!(
        mig.consumes,
        [
            ("memory-slice-4".to_string(), 1),
            ("memory-slice-5".to_string(), 1),
            ("memory-slice-6".to_string(), 1),
            ("memory-slice-7".to_string(), 1),
        ]
    );
    for d in &out.devices {
        assert!(
            d.name.len() <= 63 && d.attributes.len() + d.capacity.len() <= 32,
            "{}",
            d.name
        );
    }
    assert_eq!(
        find_device(std::slice::from_ref(&out), "gpu-3-mig-3g40gb-9-4"),
        Some(DeviceLocation {
            gpu_position: 0,
            kind: mig.kind
        })
    );
}

#[test]
fn device_names_are_dns_labels_and_unique_on_every_catalog_gpu() {
    for model in catalog::models() {
        let Some(geometry) = model.mig.as_ref() else {
            continue;
        };
        let mut info = h100(7);
        info.name = model.product_name.clone();
        let out = gpu_devices(
            &PublishGpu {
                info: &info,
                geometry: Some(geometry),
                foreign: &[],
            },
            &system(),
        );
        assert!(
            out.mig_left_out.is_none(),
            "{}: {:?}",
            model.name,
            out.mig_left_out
        );
        let mut names: Vec<&str> = out.devices.iter().map(|d| d.name.as_str()).collect();
        for n in &names {
            assert!(
                n.len() <= 63
                    && n.bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                    && !n.ends_with('-'),
                "{}: {n}",
                model.name
            );
        }
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), out.devices.len(), "{}", model.name);
    }
}

#[test]
fn foreign_instances_lower_the_counters_and_hide_devices_that_cannot_fit() {
    let info = h100(0);
    let foreign = crate::mig::parse_layout("3g.40gb@4").unwrap();
    let out = gpu_devices(
        &PublishGpu {
            info: &info,
            geometry: Some(h100_geometry()),
            foreign: &foreign,
        },
        &system(),
    );
    let names: Vec<&str> = out.devices.iter().map(|d| d.name.as_str()).collect();
    assert!(!names.contains(&"gpu-0"), "the whole GPU cannot be had");
    assert!(!names.contains(&"gpu-0-mig-1g10gb-19-5"));
    assert!(names.contains(&"gpu-0-mig-1g10gb-19-3"));
    let set = out.counter_set.unwrap();
    assert!(set.counters.contains(&("memory-slice-5".to_string(), 0)));
    assert!(set.counters.contains(&("memory-slice-0".to_string(), 1)));
}

#[test]
fn a_gpu_without_mig_publishes_only_itself() {
    let mut info = h100(1);
    info.mig_capable = false;
    let out = gpu_devices(
        &PublishGpu {
            info: &info,
            geometry: None,
            foreign: &[],
        },
        &system(),
    );
    assert_eq!(out.devices.len(), 1);
    assert!(out.counter_set.is_none() && out.devices[0].consumes.is_empty());
}

#[test]
fn versions_become_semver() {
    assert_eq!(semver("570.195.03").as_deref(), Some("570.195.3"));
    assert_eq!(semver("12.4").as_deref(), Some("12.4.0"));
    assert_eq!(semver("9").as_deref(), Some("9.0.0"));
    assert_eq!(semver("1.2.3.4"), None);
    assert_eq!(semver("r570"), None);
    assert_eq!(semver(""), None);
}
