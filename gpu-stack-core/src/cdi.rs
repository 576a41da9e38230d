//! CDI (Container Device Interface) spec for the node's GPUs and MIG devices,
//! kind `nvidia.com/gpu`, in the shape `nvidia-ctk cdi generate` produces:
//! devices named by index (`0`, `0:1`), by UUID (`GPU-…`, `MIG-…`) and `all`;
//! per-device device nodes; node-wide control nodes, driver library mounts and
//! an `update-ldcache` hook.
//!
//! The model is a small serde subset of CDI spec 0.5.0 written here rather than
//! taken from the `container-device-interface` crate: this crate stays free of
//! anything but serde, the output is golden-tested field by field, and we only
//! ever write specs (the runtime parses and validates them).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::deviceplugin::inventory::NodeGpus;

/// CDI version written: the lowest that allows `hostPath` on device nodes and
/// device names starting with a digit.
pub const CDI_VERSION: &str = "0.5.0";
/// Kind of the spec.
pub const KIND: &str = "nvidia.com/gpu";
/// Mount options for driver files.
pub const MOUNT_OPTIONS: [&str; 5] = ["ro", "nosuid", "nodev", "rbind", "rprivate"];

/// A CDI spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    /// Spec version.
    pub cdi_version: String,
    /// `vendor/class`.
    pub kind: String,
    /// Devices.
    pub devices: Vec<Device>,
    /// Edits applied when any device of the spec is requested.
    #[serde(default, skip_serializing_if = "ContainerEdits::is_empty")]
    pub container_edits: ContainerEdits,
}

/// A named device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    /// Device name, unique in the spec.
    pub name: String,
    /// Edits for this device.
    pub container_edits: ContainerEdits,
}

/// Changes made to a container.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    /// `KEY=VALUE` entries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Device nodes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    /// Mounts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
    /// Hooks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<Hook>,
}

impl ContainerEdits {
    /// No edits at all.
    pub fn is_empty(&self) -> bool {
        self.env.is_empty()
            && self.device_nodes.is_empty()
            && self.mounts.is_empty()
            && self.hooks.is_empty()
    }
}

/// A device node.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    /// Path in the container.
    pub path: String,
    /// Path on the host.
    pub host_path: String,
}

/// A bind mount.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    /// Path on the host.
    pub host_path: String,
    /// Path in the container.
    pub container_path: String,
    /// Mount options.
    pub options: Vec<String>,
}

/// An OCI hook.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hook {
    /// OCI hook point.
    pub hook_name: String,
    /// Executable.
    pub path: String,
    /// Arguments, including argv[0].
    pub args: Vec<String>,
}

/// Host facts the spec needs besides the GPUs (found by the adapter).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostFiles {
    /// Root the driver files live under on the host (`/` or `/run/nvidia/driver`).
    pub driver_root: String,
    /// Root of the host's `/dev` tree.
    pub dev_root: String,
    /// Path of `nvidia-cdi-hook` on the host.
    pub hook_path: String,
    /// Control device nodes that exist (`/dev/nvidiactl`, `/dev/nvidia-uvm`, …).
    pub control_nodes: Vec<String>,
    /// Driver libraries and binaries to mount, as container paths (the host
    /// path is the same under `driver_root`).
    pub driver_files: Vec<String>,
}

impl Default for HostFiles {
    fn default() -> Self {
        HostFiles {
            driver_root: "/".into(),
            dev_root: "/".into(),
            hook_path: "/usr/bin/nvidia-cdi-hook".into(),
            control_nodes: [
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools",
                "/dev/nvidia-modeset",
            ]
            .map(String::from)
            .to_vec(),
            driver_files: Vec::new(),
        }
    }
}

fn under(root: &str, path: &str) -> String {
    format!("{}{path}", root.trim_end_matches('/'))
}

fn node(root: &str, path: String) -> DeviceNode {
    DeviceNode {
        host_path: under(root, &path),
        path,
    }
}

/// Builds the spec. Deterministic: GPUs in index order, index name before UUID
/// name, `all` last.
pub fn node_spec(gpus: &NodeGpus, host: &HostFiles) -> Spec {
    let mut devices = Vec::new();
    let mut all: BTreeSet<DeviceNode> = BTreeSet::new();
    let root = &host.dev_root;
    for g in &gpus.gpus {
        let gpu_node = node(root, format!("/dev/nvidia{}", g.minor));
        let edits = ContainerEdits {
            device_nodes: vec![gpu_node.clone()],
            ..ContainerEdits::default()
        };
        all.insert(gpu_node.clone());
        devices.push(Device {
            name: g.index_name(),
            container_edits: edits.clone(),
        });
        devices.push(Device {
            name: g.uuid.clone(),
            container_edits: edits,
        });
        if g.mig_enabled {
            for m in &g.mig_devices {
                let mut nodes = vec![gpu_node.clone()];
                for cap in [m.gi_cap_minor, m.ci_cap_minor].into_iter().flatten() {
                    nodes.push(node(root, format!("/dev/nvidia-caps/nvidia-cap{cap}")));
                }
                all.extend(nodes.iter().cloned());
                let edits = ContainerEdits {
                    device_nodes: nodes,
                    ..ContainerEdits::default()
                };
                devices.push(Device {
                    name: format!("{}:{}", g.index, m.index),
                    container_edits: edits.clone(),
                });
                devices.push(Device {
                    name: m.uuid.clone(),
                    container_edits: edits,
                });
            }
        }
    }
    if !devices.is_empty() {
        devices.push(Device {
            name: "all".into(),
            container_edits: ContainerEdits {
                device_nodes: all.into_iter().collect(),
                ..ContainerEdits::default()
            },
        });
    }
    let mounts: Vec<Mount> = host
        .driver_files
        .iter()
        .map(|p| Mount {
            host_path: under(&host.driver_root, p),
            container_path: p.clone(),
            options: MOUNT_OPTIONS.map(String::from).to_vec(),
        })
        .collect();
    let mut folders: Vec<String> = host
        .driver_files
        .iter()
        .filter(|p| p.contains(".so"))
        .filter_map(|p| p.rsplit_once('/').map(|(d, _)| d.to_string()))
        .collect();
    folders.sort();
    folders.dedup();
    let mut hooks = Vec::new();
    if !folders.is_empty() {
        let mut args = vec!["nvidia-cdi-hook".to_string(), "update-ldcache".to_string()];
        for f in folders {
            args.push("--folder".into());
            args.push(f);
        }
        hooks.push(Hook {
            hook_name: "createContainer".into(),
            path: host.hook_path.clone(),
            args,
        });
    }
    Spec {
        cdi_version: CDI_VERSION.into(),
        kind: KIND.into(),
        devices,
        container_edits: ContainerEdits {
            env: vec!["NVIDIA_VISIBLE_DEVICES=void".into()],
            device_nodes: host
                .control_nodes
                .iter()
                .map(|p| node(root, p.clone()))
                .collect(),
            mounts,
            hooks,
        },
    }
}

/// What makes `spec` unusable as the node's host spec for the toolkit
/// check: the wrong kind, no GPU device, or device nodes `exists` does not
/// find on the host (listed once each, capped). Empty when it is usable.
pub fn host_spec_problems(spec: &Spec, exists: &dyn Fn(&str) -> bool) -> Vec<String> {
    let mut problems = Vec::new();
    if spec.kind != KIND {
        problems.push(format!(
            "it is of kind {:?}, not {KIND}",
            crate::echo::clipped(&spec.kind).to_string()
        ));
    }
    if !spec.devices.iter().any(|d| d.name != "all") {
        problems.push("it names no GPU".into());
    }
    let missing: Vec<&str> = spec
        .devices
        .iter()
        .flat_map(|d| &d.container_edits.device_nodes)
        .chain(&spec.container_edits.device_nodes)
        .map(|n| n.host_path.as_str())
        .filter(|p| !exists(p))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    if !missing.is_empty() {
        problems.push(format!(
            "device nodes missing on the host: {}",
            crate::echo::join_capped(&missing)
        ));
    }
    problems
}

/// Renders the spec as YAML (for people; files are written as JSON).
pub fn to_yaml(spec: &Spec) -> Result<String, serde_saphyr::SerializeError> {
    serde_saphyr::to_string(spec)
}

/// Renders the spec as JSON, the form written to disk: JSON leaves no doubt
/// that a name like `1:0` is a string (a YAML 1.1 reader may take it for a
/// base-60 number).
pub fn to_json(spec: &Spec) -> Result<String, serde_json::Error> {
    serde_json::to_string_pretty(spec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deviceplugin::inventory::{Gpu, MigDevice};

    fn node_gpus() -> NodeGpus {
        let gpu = |i: u32| Gpu {
            index: i,
            uuid: format!("GPU-{i}"),
            minor: i,
            ..Gpu::default()
        };
        let mut g1 = gpu(1);
        g1.mig_enabled = true;
        g1.mig_devices = vec![MigDevice {
            index: 0,
            uuid: "MIG-1-0".into(),
            profile: "3g.20gb".into(),
            gi: 1,
            ci: 0,
            gi_cap_minor: Some(21),
            ci_cap_minor: Some(22),
            ..MigDevice::default()
        }];
        NodeGpus {
            driver_version: "550.107.02".into(),
            cuda_version: "12.4".into(),
            gpus: vec![gpu(0), g1],
        }
    }

    #[test]
    fn golden_spec() {
        let host = HostFiles {
            driver_root: "/run/nvidia/driver".into(),
            control_nodes: vec!["/dev/nvidiactl".into()],
            driver_files: vec![
                "/usr/lib/x86_64-linux-gnu/libcuda.so.550.107.02".into(),
                "/usr/bin/nvidia-smi".into(),
            ],
            ..HostFiles::default()
        };
        let yaml = to_yaml(&node_spec(&node_gpus(), &host)).unwrap();
        let expected = r#"cdiVersion: "0.5.0"
kind: nvidia.com/gpu
devices:
- name: "0"
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
      hostPath: /dev/nvidia0
- name: GPU-0
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
      hostPath: /dev/nvidia0
- name: "1"
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia1
      hostPath: /dev/nvidia1
- name: GPU-1
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia1
      hostPath: /dev/nvidia1
- name: "1:0"
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia1
      hostPath: /dev/nvidia1
    - path: /dev/nvidia-caps/nvidia-cap21
      hostPath: /dev/nvidia-caps/nvidia-cap21
    - path: /dev/nvidia-caps/nvidia-cap22
      hostPath: /dev/nvidia-caps/nvidia-cap22
- name: MIG-1-0
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia1
      hostPath: /dev/nvidia1
    - path: /dev/nvidia-caps/nvidia-cap21
      hostPath: /dev/nvidia-caps/nvidia-cap21
    - path: /dev/nvidia-caps/nvidia-cap22
      hostPath: /dev/nvidia-caps/nvidia-cap22
- name: all
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia-caps/nvidia-cap21
      hostPath: /dev/nvidia-caps/nvidia-cap21
    - path: /dev/nvidia-caps/nvidia-cap22
      hostPath: /dev/nvidia-caps/nvidia-cap22
    - path: /dev/nvidia0
      hostPath: /dev/nvidia0
    - path: /dev/nvidia1
      hostPath: /dev/nvidia1
containerEdits:
  env:
  - NVIDIA_VISIBLE_DEVICES=void
  deviceNodes:
  - path: /dev/nvidiactl
    hostPath: /dev/nvidiactl
  mounts:
  - hostPath: /run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.550.107.02
    containerPath: /usr/lib/x86_64-linux-gnu/libcuda.so.550.107.02
    options:
    - ro
    - nosuid
    - nodev
    - rbind
    - rprivate
  - hostPath: /run/nvidia/driver/usr/bin/nvidia-smi
    containerPath: /usr/bin/nvidia-smi
    options:
    - ro
    - nosuid
    - nodev
    - rbind
    - rprivate
  hooks:
  - hookName: createContainer
    path: /usr/bin/nvidia-cdi-hook
    args:
    - nvidia-cdi-hook
    - update-ldcache
    - --folder
    - /usr/lib/x86_64-linux-gnu
"#;
        assert_eq!(yaml, expected, "got:\n{yaml}");
        let back: Spec = serde_saphyr::from_str(&yaml).unwrap();
        assert_eq!(back, node_spec(&node_gpus(), &host));
        let json = to_json(&back).unwrap();
        assert!(json.contains(r#""name": "1:0""#));
        assert_eq!(serde_json::from_str::<Spec>(&json).unwrap(), back);
    }

    #[test]
    fn every_allocate_name_exists_in_the_spec() {
        use crate::deviceplugin::{Overrides, Settings, node_resources};
        let spec = node_spec(&node_gpus(), &HostFiles::default());
        let names: BTreeSet<&str> = spec.devices.iter().map(|d| d.name.as_str()).collect();
        let s = Settings::resolve(
            None,
            &Overrides {
                mig_strategy: Some("mixed".into()),
                ..Overrides::default()
            },
        )
        .unwrap();
        for r in node_resources(&node_gpus(), &s).unwrap() {
            for d in &r.devices {
                assert!(
                    names.contains(d.uuid.as_str()) && names.contains(d.index_name.as_str()),
                    "{}",
                    d.id
                );
            }
        }
        assert_eq!(names.len(), spec.devices.len(), "names are unique");
    }

    #[test]
    fn no_gpus_no_all_device() {
        let spec = node_spec(&NodeGpus::default(), &HostFiles::default());
        assert!(spec.devices.is_empty());
    }

    #[test]
    fn host_spec_problems_name_kind_devices_and_missing_nodes() {
        let node = NodeGpus {
            gpus: vec![Gpu {
                uuid: "GPU-0".into(),
                ..Default::default()
            }],
            ..NodeGpus::default()
        };
        let host = HostFiles {
            driver_root: "/".into(),
            dev_root: "/".into(),
            hook_path: "/usr/bin/nvidia-cdi-hook".into(),
            control_nodes: vec!["/dev/nvidiactl".into()],
            driver_files: Vec::new(),
        };
        let spec = node_spec(&node, &host);
        assert!(host_spec_problems(&spec, &|_| true).is_empty());
        let missing = host_spec_problems(&spec, &|p| p != "/dev/nvidiactl");
        assert_eq!(missing.len(), 1);
        assert!(missing[0].contains("/dev/nvidiactl"), "{missing:?}");
        let other = Spec {
            kind: "example.com/x".into(),
            devices: Vec::new(),
            ..spec
        };
        let problems = host_spec_problems(&other, &|_| true);
        assert!(
            problems.iter().any(|p| p.contains("example.com/x")),
            "{problems:?}"
        );
        assert!(
            problems.iter().any(|p| p.contains("no GPU")),
            "{problems:?}"
        );
    }
}
