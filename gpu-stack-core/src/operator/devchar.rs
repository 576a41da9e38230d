//! `/dev/char` links for NVIDIA's device nodes.
//!
//! With the systemd cgroup driver, runc re-applies a container's device
//! rules (on `systemctl daemon-reload`, for one) through
//! `/dev/char/<major>:<minor>`. The NVIDIA driver creates its device nodes
//! without udev, so they have no such links, and GPU containers lose their
//! devices: "Failed to initialize NVML: Unknown Error" (NVIDIA's notice on
//! gpu-operator issue 485). NVIDIA's driver validation creates the links;
//! the validator's driver check does the same. This module decides which
//! links; the validator reads the device nodes and writes them.

/// A character device node under `/dev`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct DeviceNode {
    /// Path relative to `/dev`: `nvidia0`, `nvidia-caps/nvidia-cap1`.
    pub path: String,
    /// Major number.
    pub major: u32,
    /// Minor number.
    pub minor: u32,
}

/// A link to create in `/dev/char`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct DevCharLink {
    /// Link name, `<major>:<minor>`.
    pub name: String,
    /// Its target, relative to `/dev/char`: `../nvidia0`.
    pub target: String,
}

/// At most this many device nodes are read (a node has one per GPU and MIG
/// capability plus a few; this bounds what a strange `/dev` can cost).
pub const MAX_DEVICE_NODES: usize = 4096;

/// Whether a path under `/dev` is one of the NVIDIA driver's device nodes:
/// `nvidia<N>`, `nvidiactl`, `nvidia-uvm`, `nvidia-uvm-tools`,
/// `nvidia-modeset`, `nvidia-nvswitch<N>`, `nvidia-nvlink`, or a MIG
/// capability `nvidia-caps/nvidia-cap<N>`.
pub fn is_nvidia_device(path: &str) -> bool {
    let numbered = |name: &str, prefix: &str| {
        name.strip_prefix(prefix)
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    match path.split_once('/') {
        Some(("nvidia-caps", cap)) => numbered(cap, "nvidia-cap"),
        Some(_) => false,
        None => {
            matches!(
                path,
                "nvidiactl"
                    | "nvidia-uvm"
                    | "nvidia-uvm-tools"
                    | "nvidia-modeset"
                    | "nvidia-nvlink"
            ) || numbered(path, "nvidia")
                || numbered(path, "nvidia-nvswitch")
        }
    }
}

/// The links for `nodes`: one per NVIDIA device node, named by its numbers
/// and pointing at it; where two nodes share numbers, the first by path
/// wins. Sorted by name.
pub fn dev_char_links(nodes: &[DeviceNode]) -> Vec<DevCharLink> {
    let mut nvidia: Vec<&DeviceNode> = nodes.iter().filter(|n| is_nvidia_device(&n.path)).collect();
    nvidia.sort();
    let mut links: Vec<DevCharLink> = Vec::with_capacity(nvidia.len());
    for n in nvidia {
        let name = format!("{}:{}", n.major, n.minor);
        if links.iter().all(|l| l.name != name) {
            links.push(DevCharLink {
                name,
                target: format!("../{}", n.path),
            });
        }
    }
    links.sort();
    links
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn node(path: &str, major: u32, minor: u32) -> DeviceNode {
        DeviceNode {
            path: path.into(),
            major,
            minor,
        }
    }

    #[test]
    fn links_name_nvidia_nodes_by_their_numbers() {
        let nodes = [
            node("nvidia1", 195, 1),
            node("nvidia0", 195, 0),
            node("nvidiactl", 195, 255),
            node("nvidia-uvm", 508, 0),
            node("nvidia-caps/nvidia-cap1", 511, 1),
            node("null", 1, 3),
            node("nvidia-caps/other", 511, 9),
            node("nvidiafoo", 195, 7),
        ];
        let links: Vec<(String, String)> = dev_char_links(&nodes)
            .into_iter()
            .map(|l| (l.name, l.target))
            .collect();
        let want = [
            ("195:0", "../nvidia0"),
            ("195:1", "../nvidia1"),
            ("195:255", "../nvidiactl"),
            ("508:0", "../nvidia-uvm"),
            ("511:1", "../nvidia-caps/nvidia-cap1"),
        ];
        assert_eq!(
            links,
            want.map(|(n, t)| (n.to_string(), t.to_string())).to_vec()
        );
    }

    proptest! {
        #[test]
        fn one_link_per_number_pair_and_only_to_nvidia_nodes(
            nodes in prop::collection::vec(
                (prop::sample::select(vec![
                    "nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "null", "tty0",
                    "nvidia-caps/nvidia-cap2", "nvidia-modeset", "nvidia-nvswitch3",
                ]), 0u32..3, 0u32..3),
                0..12,
            )
        ) {
            let nodes: Vec<DeviceNode> = nodes.into_iter().map(|(p, a, b)| node(p, a, b)).collect();
            let links = dev_char_links(&nodes);
            let mut names: Vec<&str> = links.iter().map(|l| l.name.as_str()).collect();
            names.dedup();
            prop_assert_eq!(names.len(), links.len());
            for l in &links {
                let target = l.target.strip_prefix("../").unwrap_or("");
                prop_assert!(is_nvidia_device(target));
                let pointed = nodes
                    .iter()
                    .any(|n| n.path == target && l.name == format!("{}:{}", n.major, n.minor));
                prop_assert!(pointed, "{:?} points at no node", l);
            }
            // Every NVIDIA node's numbers have a link.
            for n in nodes.iter().filter(|n| is_nvidia_device(&n.path)) {
                let name = format!("{}:{}", n.major, n.minor);
                prop_assert!(links.iter().any(|l| l.name == name));
            }
        }
    }
}
