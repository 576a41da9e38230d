//! The CDI spec of one prepared claim: one CDI device per allocated device,
//! named `<claim uid>-<device>`, with the GPU's device node (and, for a MIG
//! device, its capability nodes) and `NVIDIA_VISIBLE_DEVICES` set to the
//! device's UUID; the driver files and control nodes of the node's host spec
//! are shared by all of them.

use crate::cdi::{CDI_VERSION, ContainerEdits, Device, DeviceNode, HostFiles, Spec, node_spec};
use crate::deviceplugin::NodeGpus;

/// One device of a claim, as the container gets it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimCdiDevice {
    /// Published device name.
    pub device: String,
    /// GPU minor (`/dev/nvidia<minor>`).
    pub minor: u32,
    /// GPU or MIG device UUID.
    pub uuid: String,
    /// MIG capability minors (`/dev/nvidia-caps/nvidia-cap<N>`).
    pub caps: Vec<u32>,
}

/// The CDI kind of a driver's claim specs.
pub fn kind(driver: &str) -> String {
    format!("k8s.{driver}/claim")
}

/// The CDI device name of a claim's device.
pub fn device_name(claim_uid: &str, device: &str) -> String {
    format!("{claim_uid}-{device}")
}

/// The fully qualified CDI id the kubelet hands to the runtime.
pub fn qualified_id(driver: &str, claim_uid: &str, device: &str) -> String {
    format!("{}={}", kind(driver), device_name(claim_uid, device))
}

/// The spec of one claim.
pub fn claim_spec(
    driver: &str,
    claim_uid: &str,
    devices: &[ClaimCdiDevice],
    host: &HostFiles,
) -> Spec {
    let root = host.dev_root.trim_end_matches('/');
    let node = |path: String| DeviceNode {
        host_path: format!("{root}{path}"),
        path,
    };
    let mut common = node_spec(&NodeGpus::default(), host).container_edits;
    // The node spec's `void` default would compete with each device's value.
    common
        .env
        .retain(|e| !e.starts_with("NVIDIA_VISIBLE_DEVICES="));
    Spec {
        cdi_version: CDI_VERSION.into(),
        kind: kind(driver),
        devices: devices
            .iter()
            .map(|d| {
                let mut nodes = vec![node(format!("/dev/nvidia{}", d.minor))];
                nodes.extend(
                    d.caps
                        .iter()
                        .map(|c| node(format!("/dev/nvidia-caps/nvidia-cap{c}"))),
                );
                Device {
                    name: device_name(claim_uid, &d.device),
                    container_edits: ContainerEdits {
                        env: vec![format!("NVIDIA_VISIBLE_DEVICES={}", d.uuid)],
                        device_nodes: nodes,
                        ..ContainerEdits::default()
                    },
                }
            })
            .collect(),
        container_edits: common,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mig_device_gets_its_gpu_and_capability_nodes_and_its_uuid() {
        let host = HostFiles {
            dev_root: "/run/sim".into(),
            ..HostFiles::default()
        };
        let spec = claim_spec(
            "gpu.nvidia.com",
            "uid-1",
            &[ClaimCdiDevice {
                device: "gpu-0-mig-1g10gb-19-0".into(),
                minor: 0,
                uuid: "MIG-abc".into(),
                caps: vec![21, 22],
            }],
            &host,
        );
        assert_eq!(spec.kind, "k8s.gpu.nvidia.com/claim");
        let d = &spec.devices[0];
        assert_eq!(d.name, "uid-1-gpu-0-mig-1g10gb-19-0");
        assert_eq!(d.container_edits.env, ["NVIDIA_VISIBLE_DEVICES=MIG-abc"]);
        let paths: Vec<&str> = d
            .container_edits
            .device_nodes
            .iter()
            .map(|n| n.host_path.as_str())
            .collect();
        assert_eq!(
            paths,
            [
                "/run/sim/dev/nvidia0",
                "/run/sim/dev/nvidia-caps/nvidia-cap21",
                "/run/sim/dev/nvidia-caps/nvidia-cap22"
            ]
        );
        assert!(spec.container_edits.env.is_empty());
        assert!(!spec.container_edits.device_nodes.is_empty());
        assert_eq!(
            qualified_id("gpu.nvidia.com", "uid-1", "gpu-0"),
            "k8s.gpu.nvidia.com/claim=uid-1-gpu-0"
        );
    }
}
