//! Nodes from a fleet file, labelled as node-feature-discovery would label
//! them: the fleet's own labels, plus PCI labels for each NVIDIA GPU model
//! (`pci-10de.present`, `pci-0302_10de_<device>.present`), the OS major
//! version when the OS version is given, and a generic NFD CPU label so every
//! node looks NFD-managed.
use std::collections::BTreeMap;

use gpu_stack_core::catalog;
use gpu_stack_core::fleet::{Fleet, FleetNode};
use gpu_stack_core::operator::labels::{NFD_OS_VERSION, NFD_OS_VERSION_MAJOR};
use k8s_openapi::api::core::v1::{Node, NodeSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// The NFD-style labels of one fleet node.
pub fn fleet_node_labels(node: &FleetNode) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    labels.insert("kubernetes.io/hostname".to_string(), node.name.clone());
    labels.insert("kubernetes.io/os".to_string(), "linux".to_string());
    labels.insert(
        "feature.node.kubernetes.io/cpu-model.vendor_id".to_string(),
        "Intel".to_string(),
    );
    for g in &node.gpus {
        if g.count == 0 {
            continue;
        }
        labels.insert(
            "feature.node.kubernetes.io/pci-10de.present".to_string(),
            "true".to_string(),
        );
        if let Ok(m) = catalog::lookup(&g.model)
            && let Some(id) = m.pci_device_ids.first()
        {
            let device = id >> 16;
            labels.insert(
                format!("feature.node.kubernetes.io/pci-0302_10de_{device:04x}.present"),
                "true".to_string(),
            );
        }
    }
    for (k, v) in &node.labels {
        labels.insert(k.clone(), v.clone());
    }
    if let Some(v) = labels.get(NFD_OS_VERSION).cloned()
        && !labels.contains_key(NFD_OS_VERSION_MAJOR)
        && let Some(major) = v.split('.').next()
    {
        labels.insert(NFD_OS_VERSION_MAJOR.to_string(), major.to_string());
    }
    labels
}

/// One node object for a fleet node.
pub fn node_from_fleet(node: &FleetNode) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(node.name.clone()),
            labels: Some(fleet_node_labels(node)),
            ..Default::default()
        },
        spec: Some(NodeSpec::default()),
        status: None,
    }
}

/// Node objects for every node of a fleet.
pub fn nodes_from_fleet(fleet: &Fleet) -> Vec<Node> {
    fleet.nodes.iter().map(node_from_fleet).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_and_cpu_nodes_get_nfd_labels() {
        let fleet = Fleet::from_yaml(
            r#"
nodes:
  - name: a
    labels: { feature.node.kubernetes.io/system-os_release.VERSION_ID: "9.4" }
    gpus: [{ model: A100-SXM4-40GB, count: 2 }]
  - name: c
"#,
        )
        .unwrap();
        let nodes = nodes_from_fleet(&fleet);
        let a = nodes[0].metadata.labels.clone().unwrap();
        assert_eq!(a["feature.node.kubernetes.io/pci-10de.present"], "true");
        assert_eq!(
            a["feature.node.kubernetes.io/pci-0302_10de_20b0.present"],
            "true"
        );
        assert_eq!(a[NFD_OS_VERSION_MAJOR], "9");
        let c = nodes[1].metadata.labels.clone().unwrap();
        assert!(!c.contains_key("feature.node.kubernetes.io/pci-10de.present"));
        assert!(
            c.keys()
                .any(|k| k.starts_with("feature.node.kubernetes.io/"))
        );
    }
}
