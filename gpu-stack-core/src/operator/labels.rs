//! Node labels the operator reads (NFD, GFD, user intent) and the deploy labels
//! it writes.
//!
//! Deploy labels are shared with other agents: the driver manager and the MIG
//! manager pause operands by rewriting `nvidia.com/gpu.deploy.<component>`
//! (`paused-for-driver-upgrade`, `paused-for-mig-change`), a host driver is
//! marked `pre-installed`, and a person can write `false`. The operator only
//! ever fills a missing or empty value, so it never undoes those.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::components::Component;
pub use super::components::DEPLOY_PREFIX;

/// `true` on nodes with an NVIDIA GPU.
pub const GPU_PRESENT: &str = "nvidia.com/gpu.present";
/// `false` removes every deploy label from a node.
pub const DEPLOY_OPERANDS: &str = "nvidia.com/gpu.deploy.operands";
/// The node's workload type (`container`, `vm-passthrough`, `vm-vgpu`).
pub const WORKLOAD_CONFIG: &str = "nvidia.com/gpu.workload.config";
/// Written by GFD on MIG-capable nodes.
pub const MIG_CAPABLE: &str = "nvidia.com/mig.capable";
/// Written by GFD: the GPU product name.
pub const GPU_PRODUCT: &str = "nvidia.com/gpu.product";
/// Desired MIG layout name, read by the MIG manager.
pub const MIG_CONFIG: &str = "nvidia.com/mig.config";
/// vGPU host driver present: the node is not MIG-managed by us.
pub const VGPU_HOST_DRIVER: &str = "nvidia.com/vgpu.host-driver-version";
/// NFD OS id (`ubuntu`, `rhel`, ...).
pub const NFD_OS_ID: &str = "feature.node.kubernetes.io/system-os_release.ID";
/// NFD OS version (`22.04`, `9.4`).
pub const NFD_OS_VERSION: &str = "feature.node.kubernetes.io/system-os_release.VERSION_ID";
/// NFD OS major version (`9`).
pub const NFD_OS_VERSION_MAJOR: &str =
    "feature.node.kubernetes.io/system-os_release.VERSION_ID.major";
/// NFD full kernel version.
pub const NFD_KERNEL: &str = "feature.node.kubernetes.io/kernel-version.full";
/// Prefix shared by every NFD label.
pub const NFD_PREFIX: &str = "feature.node.kubernetes.io/";

/// NFD labels that mark a node as having an NVIDIA PCI device.
pub const NFD_GPU_LABELS: [&str; 3] = [
    "feature.node.kubernetes.io/pci-10de.present",
    "feature.node.kubernetes.io/pci-0302_10de.present",
    "feature.node.kubernetes.io/pci-0300_10de.present",
];

/// Deploy labels NVIDIA's operator also sets on container-workload GPU
/// nodes, for pods it does not deploy itself: `dcgm` (a standalone DCGM)
/// and `client` (third-party GPU clients, whose DaemonSets select
/// `gpu.deploy.client=true`, so that a MIG change or a driver upgrade
/// pausing the label moves them off the node and back).
pub const CONTAINER_CLIENT_DEPLOY_LABELS: [&str; 2] = ["nvidia.com/gpu.deploy.dcgm", DEPLOY_CLIENT];

/// The deploy label of third-party GPU clients, set for every workload.
pub const DEPLOY_CLIENT: &str = "nvidia.com/gpu.deploy.client";

/// Value another agent writes to pause an operand during a MIG change.
pub const PAUSED_FOR_MIG_CHANGE: &str = "paused-for-mig-change";
/// Value the driver manager writes to pause an operand during a driver upgrade.
pub const PAUSED_FOR_DRIVER_UPGRADE: &str = "paused-for-driver-upgrade";
/// Value the driver manager writes on `gpu.deploy.driver` when the host has a driver.
pub const PRE_INSTALLED: &str = "pre-installed";
/// Written by the operator next to the `gpu.deploy.mig-manager=false` it
/// writes for the DRA plugin. It tells that `false` from one a person
/// wrote: only the operator's own is turned back to `true` when the DRA
/// plugin is switched off again, or removed with the operator's labels.
pub const MIG_MANAGER_OFF: &str = "nvidia.com/gpu-stack.mig-manager-off";
/// Value of [`MIG_MANAGER_OFF`]: the DRA plugin owns the node's MIG layout.
pub const MIG_MANAGER_OFF_FOR_DRA: &str = "dra-driver";

/// Node annotation NVIDIA's k8s-driver-manager (the driver pod's init
/// container) reads: `true` leaves draining and pausing the node to the
/// operator's upgrade controller; without it the driver manager evicts GPU
/// pods and pauses operands itself at every driver pod start.
pub const DRIVER_UPGRADE_ENABLED: &str = "nvidia.com/gpu-driver-upgrade-enabled";

/// Node labels as a sorted map.
pub type Labels = BTreeMap<String, String>;

/// A label change: `Some(value)` sets, `None` removes.
pub type LabelPatch = BTreeMap<String, Option<String>>;

/// What the operator learns about a node from its labels.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeFacts {
    /// An NFD NVIDIA PCI label is `true`.
    pub gpu: bool,
    /// Any NFD label at all (NFD is installed on this node).
    pub nfd: bool,
    /// GPUs on this node can be partitioned with MIG.
    pub mig_capable: bool,
    /// `nvidia.com/gpu.deploy.operands=false`.
    pub operands_disabled: bool,
    /// NVIDIA PCI device ids seen in NFD labels (`pci-<class>_10de_<device>.present`), lowercase hex.
    pub pci_device_ids: Vec<String>,
    /// GFD product name, when GFD already labelled this node.
    pub product: Option<String>,
}

impl NodeFacts {
    /// Reads the facts from a node's labels.
    pub fn from_labels(labels: &Labels) -> NodeFacts {
        let is_true = |k: &str| labels.get(k).is_some_and(|v| v == "true");
        let gpu = NFD_GPU_LABELS.iter().any(|k| is_true(k));
        let nfd = labels.keys().any(|k| k.starts_with(NFD_PREFIX));
        let product = labels.get(GPU_PRODUCT).cloned();
        let pci_device_ids = nvidia_pci_device_ids(labels);
        let vgpu_host = labels.contains_key(VGPU_HOST_DRIVER);
        let mig_capable = !vgpu_host
            && match labels.get(MIG_CAPABLE) {
                Some(v) => v == "true",
                None => {
                    product.as_deref().is_some_and(product_is_mig_capable)
                        || pci_device_ids.iter().any(|d| pci_device_has_mig(d))
                }
            };
        NodeFacts {
            gpu,
            nfd,
            mig_capable,
            operands_disabled: labels.get(DEPLOY_OPERANDS).is_some_and(|v| v == "false"),
            pci_device_ids,
            product,
        }
    }
}

/// Whether the catalog knows this NVIDIA PCI device (`20b0`) as MIG-capable.
/// Lets the operator label MIG nodes before GFD has run.
pub fn pci_device_has_mig(device: &str) -> bool {
    u32::from_str_radix(device, 16)
        .ok()
        .and_then(|d| crate::catalog::by_pci_device_id((d << 16) | 0x10de))
        .is_some_and(|m| m.mig.is_some())
}

/// The NVIDIA operator's fallback when `nvidia.com/mig.capable` is absent: a
/// product name naming an A100, A30 or H100 (extended here to H200 and B200).
pub fn product_is_mig_capable(product: &str) -> bool {
    let p = product.to_ascii_lowercase();
    ["a100", "a30", "h100", "h200", "b200", "gb200"]
        .iter()
        .any(|m| p.contains(m))
}

/// NVIDIA PCI device ids from NFD labels of the form
/// `feature.node.kubernetes.io/pci-<class>_10de_<device>.present=true`.
pub fn nvidia_pci_device_ids(labels: &Labels) -> Vec<String> {
    let mut ids: Vec<String> = labels
        .iter()
        .filter(|(_, v)| v.as_str() == "true")
        .filter_map(|(k, _)| {
            let rest = k.strip_prefix("feature.node.kubernetes.io/pci-")?;
            let rest = rest.strip_suffix(".present")?;
            let mut parts = rest.split('_');
            let _class = parts.next()?;
            let vendor = parts.next()?;
            let device = parts.next()?;
            if vendor != "10de" || parts.next().is_some() || device.is_empty() {
                return None;
            }
            Some(device.to_ascii_lowercase())
        })
        .collect();
    ids.sort();
    ids.dedup();
    ids
}

/// The set of operands a GPU node is for, as `nvidia.com/gpu.workload.config`
/// names it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Workload {
    /// Containers: the driver, toolkit, device plugin and the rest.
    #[default]
    Container,
    /// Whole GPUs passed through to virtual machines (VFIO).
    VmPassthrough,
    /// vGPU devices for virtual machines.
    VmVgpu,
}

impl Workload {
    /// Every workload, in label-value order.
    pub const ALL: [Workload; 3] = [
        Workload::Container,
        Workload::VmPassthrough,
        Workload::VmVgpu,
    ];

    /// The label value (`container`, `vm-passthrough`, `vm-vgpu`).
    pub fn as_str(self) -> &'static str {
        match self {
            Workload::Container => "container",
            Workload::VmPassthrough => "vm-passthrough",
            Workload::VmVgpu => "vm-vgpu",
        }
    }

    /// Reads a label value; `None` for anything else.
    pub fn parse(value: &str) -> Option<Workload> {
        Workload::ALL.into_iter().find(|w| w.as_str() == value)
    }
}

/// The workload a node's operands are chosen for. With sandbox workloads
/// off ([`LabelPolicy::sandbox_default`] `None`) every node runs containers,
/// whatever its label says; on, the node's `nvidia.com/gpu.workload.config`
/// decides, and a node without it, or with a value that is no workload, gets
/// the policy's default (NVIDIA's operator does the same and logs it).
pub fn node_workload(labels: &Labels, policy: &LabelPolicy) -> Workload {
    match policy.sandbox_default {
        None => Workload::Container,
        Some(default) => labels
            .get(WORKLOAD_CONFIG)
            .and_then(|v| Workload::parse(v))
            .unwrap_or(default),
    }
}

/// Inputs of [`deploy_label_patch`] that come from the policy.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LabelPolicy {
    /// `migManager.config.default`: when `all-disabled`, MIG-capable nodes
    /// without `nvidia.com/mig.config` get that value.
    pub mig_config_default: Option<String>,
    /// `draDriver.enabled`: the DRA plugin is deployed and owns MIG layouts,
    /// so the MIG manager is switched off on every GPU node.
    #[serde(default)]
    pub dra_driver: bool,
    /// `sandboxWorkloads.defaultWorkload` when `sandboxWorkloads.enabled`:
    /// nodes then run the workload their `nvidia.com/gpu.workload.config`
    /// names ([`node_workload`]). `None`: every GPU node runs containers.
    #[serde(default)]
    pub sandbox_default: Option<Workload>,
    /// `driver.upgradePolicy.autoUpgrade`: the operator's upgrade controller
    /// drains nodes for driver upgrades (with sandbox workloads off).
    #[serde(default)]
    pub auto_upgrade: bool,
}

impl LabelPolicy {
    /// Whether the upgrade controller, not NVIDIA's driver manager, drains
    /// nodes: `autoUpgrade` without sandbox workloads, NVIDIA's rule.
    pub fn upgrade_controller_drains(&self) -> bool {
        self.auto_upgrade && self.sandbox_default.is_none()
    }
}

/// The label changes the operator makes on one node, given its current labels.
///
/// Rules (the NVIDIA operator's, kept so other agents keep working):
/// - a node without an NVIDIA GPU loses `gpu.present` and every deploy label;
/// - a GPU node gets `gpu.present=true`;
/// - `gpu.deploy.operands=false` removes every deploy label;
/// - otherwise each container-workload component's deploy label is set to
///   `true` only when missing or empty: `false`, `paused-for-*`, `pre-installed`
///   and any other value written by someone else are kept;
/// - `gpu.deploy.mig-manager` only on MIG-capable nodes (removed elsewhere);
/// - [`CONTAINER_CLIENT_DEPLOY_LABELS`] (`dcgm`, `client`) filled the same way;
/// - `nvidia.com/mig.config=all-disabled` on MIG-capable nodes that have none,
///   when the policy's default MIG config is `all-disabled`;
/// - a node whose [`node_workload`] is a VM workload loses every deploy
///   label but `client` (which NVIDIA's VM label sets keep, filled the same
///   way): gpu-stack runs no VM operands (VFIO manager, sandbox device
///   plugin, vGPU manager), and NVIDIA's operator removes the container
///   operands' labels from such a node whatever their value.
///
/// With the DRA plugin ([`LabelPolicy::dra_driver`]), one owner of a GPU
/// layout:
/// - `gpu.deploy.dra-driver` is filled like the others (and without the DRA
///   plugin a `true` is removed, so a cluster that never enables it sees no
///   new label; any other value is kept);
/// - `gpu.deploy.mig-manager` becomes `false` on every GPU node where it is
///   missing, empty or `true`, marked with [`MIG_MANAGER_OFF`]; `false` and
///   `paused-for-*` written by others are kept (a paused value comes back as
///   `true` and is then switched);
/// - no default `nvidia.com/mig.config` is written, as no MIG manager reads it.
///
/// Without the DRA plugin a marked `false` counts as unset (it becomes `true`
/// on MIG-capable nodes) and the mark goes.
///
/// The returned patch holds only real changes: applying it and calling this
/// again yields an empty patch.
pub fn deploy_label_patch(labels: &Labels, policy: &LabelPolicy) -> LabelPatch {
    let facts = NodeFacts::from_labels(labels);
    let mut want: LabelPatch = BTreeMap::new();
    let deploy_keys = || labels.keys().filter(|k| is_operator_deploy_label(k));

    // The mark goes wherever the operator does not keep the MIG manager off.
    let marked_off = labels.contains_key(MIG_MANAGER_OFF);
    if marked_off {
        want.insert(MIG_MANAGER_OFF.to_string(), None);
    }

    if !facts.gpu {
        if labels.contains_key(GPU_PRESENT) {
            want.insert(GPU_PRESENT.to_string(), None);
        }
        for k in deploy_keys() {
            want.insert(k.clone(), None);
        }
        return want;
    }

    want.insert(GPU_PRESENT.to_string(), Some("true".to_string()));
    if facts.operands_disabled {
        for k in deploy_keys() {
            want.insert(k.clone(), None);
        }
    } else if node_workload(labels, policy) != Workload::Container {
        for k in deploy_keys().filter(|k| k.as_str() != DEPLOY_CLIENT) {
            want.insert(k.clone(), None);
        }
        if labels.get(DEPLOY_CLIENT).is_none_or(|v| v.is_empty()) {
            want.insert(DEPLOY_CLIENT.to_string(), Some("true".to_string()));
        }
    } else {
        for c in Component::ALL {
            let key = c.deploy_label();
            let mut current = labels.get(&key).map(String::as_str);
            if c == Component::MigManager {
                // The operator's own `false` is not a person's choice.
                if marked_off && current == Some("false") {
                    current = None;
                }
                if policy.dra_driver {
                    if matches!(current, None | Some("") | Some("true")) {
                        want.insert(key, Some("false".to_string()));
                        want.insert(
                            MIG_MANAGER_OFF.to_string(),
                            Some(MIG_MANAGER_OFF_FOR_DRA.to_string()),
                        );
                    } else if marked_off {
                        // Paused by another agent while off: keep the mark
                        // until the value comes back.
                        want.remove(MIG_MANAGER_OFF);
                    }
                    continue;
                }
                if !facts.mig_capable {
                    if labels.contains_key(&key) {
                        want.insert(key, None);
                    }
                    continue;
                }
            }
            if c == Component::DraPlugin && !policy.dra_driver {
                if matches!(current, Some("" | "true")) {
                    want.insert(key, None);
                }
                continue;
            }
            match current {
                Some(v) if !v.is_empty() => {}
                _ => {
                    want.insert(key, Some("true".to_string()));
                }
            }
        }
        for key in CONTAINER_CLIENT_DEPLOY_LABELS {
            if labels.get(key).is_none_or(|v| v.is_empty()) {
                want.insert(key.to_string(), Some("true".to_string()));
            }
        }
        if facts.mig_capable
            && !policy.dra_driver
            && !labels.contains_key(MIG_CONFIG)
            && policy.mig_config_default.as_deref() == Some("all-disabled")
        {
            want.insert(MIG_CONFIG.to_string(), Some("all-disabled".to_string()));
        }
    }

    // Keep only real changes.
    want.retain(|k, v| labels.get(k) != v.as_ref());
    want
}

/// The change to a node's [`DRIVER_UPGRADE_ENABLED`] annotation, kept as
/// NVIDIA's operator keeps it: on a node labelled `gpu.present=true` it is
/// `true` while the upgrade controller drains nodes
/// ([`LabelPolicy::upgrade_controller_drains`]) and absent otherwise; other
/// nodes are left as they are. `labels` are the node's labels after the
/// operator's patch.
pub fn upgrade_annotation_patch(
    labels: &Labels,
    annotations: Option<&Labels>,
    policy: &LabelPolicy,
) -> LabelPatch {
    let controller_on = policy.upgrade_controller_drains();
    let mut want = LabelPatch::new();
    if labels.get(GPU_PRESENT).is_none_or(|v| v != "true") {
        return want;
    }
    let current = annotations.and_then(|a| a.get(DRIVER_UPGRADE_ENABLED));
    match (controller_on, current) {
        (true, Some(v)) if v == "true" => {}
        (true, _) => {
            want.insert(DRIVER_UPGRADE_ENABLED.into(), Some("true".into()));
        }
        (false, Some(_)) => {
            want.insert(DRIVER_UPGRADE_ENABLED.into(), None);
        }
        (false, None) => {}
    }
    want
}

/// Whether a label key is one of the per-component deploy labels the operator
/// manages (not `gpu.deploy.operands`, which is user intent).
pub fn is_operator_deploy_label(key: &str) -> bool {
    CONTAINER_CLIENT_DEPLOY_LABELS.contains(&key)
        || key
            .strip_prefix(DEPLOY_PREFIX)
            .and_then(Component::from_deploy_label_suffix)
            .is_some()
}

/// Applies a patch to a label map.
pub fn apply_patch(labels: &mut Labels, patch: &LabelPatch) {
    for (k, v) in patch {
        match v {
            Some(v) => {
                labels.insert(k.clone(), v.clone());
            }
            None => {
                labels.remove(k);
            }
        }
    }
}

/// Whether a node with these labels would run the given component's pod: the
/// deploy label must be exactly `true`.
pub fn schedules(labels: &Labels, c: Component) -> bool {
    labels.get(&c.deploy_label()).is_some_and(|v| v == "true")
}

/// The operand switches another agent has paused on a node
/// (`nvidia.com/gpu.deploy.<operand>=paused-for-*`), as (label, value): the
/// operator leaves these operands alone and says so.
pub fn paused_operands(labels: &Labels) -> impl Iterator<Item = (&str, &str)> {
    labels
        .iter()
        .filter(|(k, v)| k.starts_with(DEPLOY_PREFIX) && v.starts_with("paused-"))
        .map(|(k, v)| (k.as_str(), v.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn gpu_node() -> Labels {
        labels(&[
            ("feature.node.kubernetes.io/pci-10de.present", "true"),
            (NFD_OS_ID, "ubuntu"),
        ])
    }

    #[test]
    fn fresh_gpu_node_gets_all_container_labels_but_mig() {
        let p = deploy_label_patch(&gpu_node(), &LabelPolicy::default());
        assert_eq!(p.get(GPU_PRESENT), Some(&Some("true".into())));
        assert_eq!(
            p.get("nvidia.com/gpu.deploy.device-plugin"),
            Some(&Some("true".into()))
        );
        assert!(!p.contains_key("nvidia.com/gpu.deploy.mig-manager"));
        // Neither the MIG manager (not MIG-capable) nor the DRA plugin (off).
        assert!(!p.contains_key("nvidia.com/gpu.deploy.dra-driver"));
        // NVIDIA's labels for a standalone DCGM and third-party GPU clients.
        for key in CONTAINER_CLIENT_DEPLOY_LABELS {
            assert_eq!(p.get(key), Some(&Some("true".into())), "{key}");
        }
        assert_eq!(p.len(), 1 + Component::ALL.len() - 2 + 2);
        // Paused by the MIG manager or a driver upgrade: kept; and every one
        // goes with `gpu.deploy.operands=false`.
        let mut l = gpu_node();
        l.insert(
            "nvidia.com/gpu.deploy.client".into(),
            PAUSED_FOR_MIG_CHANGE.into(),
        );
        let p = deploy_label_patch(&l, &LabelPolicy::default());
        assert!(!p.contains_key("nvidia.com/gpu.deploy.client"));
        l.insert("nvidia.com/gpu.deploy.dcgm".into(), "true".into());
        l.insert(DEPLOY_OPERANDS.into(), "false".into());
        let p = deploy_label_patch(&l, &LabelPolicy::default());
        for key in CONTAINER_CLIENT_DEPLOY_LABELS {
            assert_eq!(p.get(key), Some(&None), "{key}");
        }
    }

    #[test]
    fn values_written_by_other_agents_are_kept() {
        let mut l = gpu_node();
        l.insert("nvidia.com/mig.capable".into(), "true".into());
        l.insert(
            "nvidia.com/gpu.deploy.device-plugin".into(),
            PAUSED_FOR_MIG_CHANGE.into(),
        );
        l.insert("nvidia.com/gpu.deploy.driver".into(), PRE_INSTALLED.into());
        l.insert("nvidia.com/gpu.deploy.dcgm-exporter".into(), "false".into());
        l.insert(
            "nvidia.com/gpu.deploy.gpu-feature-discovery".into(),
            PAUSED_FOR_DRIVER_UPGRADE.into(),
        );
        l.insert("nvidia.com/gpu.deploy.container-toolkit".into(), "".into());
        let p = deploy_label_patch(&l, &LabelPolicy::default());
        for k in [
            "device-plugin",
            "driver",
            "dcgm-exporter",
            "gpu-feature-discovery",
        ] {
            assert!(
                !p.contains_key(&format!("{DEPLOY_PREFIX}{k}")),
                "{k} was touched"
            );
        }
        // Empty counts as absent.
        assert_eq!(
            p.get("nvidia.com/gpu.deploy.container-toolkit"),
            Some(&Some("true".into()))
        );
        assert_eq!(
            p.get("nvidia.com/gpu.deploy.mig-manager"),
            Some(&Some("true".into()))
        );
    }

    #[test]
    fn operands_false_removes_deploy_labels_and_cpu_nodes_lose_everything() {
        let mut l = gpu_node();
        l.insert("nvidia.com/gpu.deploy.driver".into(), "true".into());
        l.insert(DEPLOY_OPERANDS.into(), "false".into());
        let p = deploy_label_patch(&l, &LabelPolicy::default());
        assert_eq!(p.get("nvidia.com/gpu.deploy.driver"), Some(&None));
        assert!(!p.contains_key(DEPLOY_OPERANDS));

        let cpu = labels(&[
            (GPU_PRESENT, "true"),
            ("nvidia.com/gpu.deploy.driver", "true"),
            ("kubernetes.io/os", "linux"),
        ]);
        let p = deploy_label_patch(&cpu, &LabelPolicy::default());
        assert_eq!(p.get(GPU_PRESENT), Some(&None));
        assert_eq!(p.get("nvidia.com/gpu.deploy.driver"), Some(&None));
        assert_eq!(p.len(), 2);
    }

    #[test]
    fn mig_config_default_only_when_absent() {
        let mut l = gpu_node();
        l.insert(GPU_PRODUCT.into(), "NVIDIA-A100-SXM4-40GB".into());
        let pol = LabelPolicy {
            mig_config_default: Some("all-disabled".into()),
            ..LabelPolicy::default()
        };
        let p = deploy_label_patch(&l, &pol);
        assert_eq!(p.get(MIG_CONFIG), Some(&Some("all-disabled".into())));
        l.insert(MIG_CONFIG.into(), "all-1g.5gb".into());
        assert!(!deploy_label_patch(&l, &pol).contains_key(MIG_CONFIG));
    }

    #[test]
    fn mig_capability_from_pci_ids() {
        let mut l = gpu_node();
        l.insert(
            "feature.node.kubernetes.io/pci-0302_10de_20b0.present".into(),
            "true".into(),
        );
        assert!(NodeFacts::from_labels(&l).mig_capable);
        let mut l4 = gpu_node();
        l4.insert(
            "feature.node.kubernetes.io/pci-0302_10de_27b8.present".into(),
            "true".into(),
        );
        assert!(!NodeFacts::from_labels(&l4).mig_capable);
    }

    #[test]
    fn pci_device_ids_from_nfd() {
        let l = labels(&[
            (
                "feature.node.kubernetes.io/pci-0302_10de_20B0.present",
                "true",
            ),
            (
                "feature.node.kubernetes.io/pci-0200_15b3_1017.present",
                "true",
            ),
            ("feature.node.kubernetes.io/pci-10de.present", "true"),
        ]);
        assert_eq!(nvidia_pci_device_ids(&l), vec!["20b0".to_string()]);
    }

    fn arb_labels() -> impl Strategy<Value = Labels> {
        let keys = prop::sample::select(vec![
            "feature.node.kubernetes.io/pci-10de.present".to_string(),
            GPU_PRESENT.to_string(),
            DEPLOY_OPERANDS.to_string(),
            MIG_CAPABLE.to_string(),
            MIG_CONFIG.to_string(),
            "nvidia.com/gpu.deploy.driver".to_string(),
            "nvidia.com/gpu.deploy.device-plugin".to_string(),
            "nvidia.com/gpu.deploy.mig-manager".to_string(),
            "nvidia.com/gpu.deploy.dcgm-exporter".to_string(),
            "nvidia.com/gpu.deploy.dra-driver".to_string(),
            MIG_MANAGER_OFF.to_string(),
            WORKLOAD_CONFIG.to_string(),
            DEPLOY_CLIENT.to_string(),
        ]);
        let values = prop::sample::select(vec![
            "true".to_string(),
            "false".to_string(),
            "".to_string(),
            PAUSED_FOR_MIG_CHANGE.to_string(),
            PAUSED_FOR_DRIVER_UPGRADE.to_string(),
            PRE_INSTALLED.to_string(),
            "vm-passthrough".to_string(),
            "vm-vgpu".to_string(),
            "container".to_string(),
        ]);
        prop::collection::btree_map(keys, values, 0..13)
    }

    fn arb_sandbox() -> impl Strategy<Value = Option<Workload>> {
        prop::option::of(prop::sample::select(Workload::ALL.to_vec()))
    }

    proptest! {
        #[test]
        fn patch_is_idempotent(
            l in arb_labels(),
            all_disabled in any::<bool>(),
            dra_driver in any::<bool>(),
            sandbox_default in arb_sandbox(),
        ) {
            let pol = LabelPolicy {
                mig_config_default: all_disabled.then(|| "all-disabled".to_string()),
                dra_driver,
                sandbox_default,
                ..LabelPolicy::default()
            };
            let p = deploy_label_patch(&l, &pol);
            let mut after = l.clone();
            apply_patch(&mut after, &p);
            prop_assert!(deploy_label_patch(&after, &pol).is_empty());
        }

        #[test]
        fn foreign_values_survive(
            l in arb_labels(),
            dra_driver in any::<bool>(),
            sandbox_default in arb_sandbox(),
        ) {
            let pol = LabelPolicy { dra_driver, sandbox_default, ..LabelPolicy::default() };
            let container = node_workload(&l, &pol) == Workload::Container;
            let p = deploy_label_patch(&l, &pol);
            let mut after = l.clone();
            apply_patch(&mut after, &p);
            let facts = NodeFacts::from_labels(&l);
            let mig = "nvidia.com/gpu.deploy.mig-manager";
            let ours = l.contains_key(MIG_MANAGER_OFF) && l.get(mig).is_some_and(|v| v == "false");
            for (k, v) in &l {
                if is_operator_deploy_label(k) && !v.is_empty() && v != "true" && facts.gpu
                    && !facts.operands_disabled
                    && (container || k == DEPLOY_CLIENT)
                    && (k != mig || ((facts.mig_capable || dra_driver) && !ours))
                {
                    prop_assert_eq!(after.get(k), Some(v));
                }
            }
        }

        #[test]
        fn with_dra_the_mig_manager_never_schedules(l in arb_labels()) {
            let pol = LabelPolicy { dra_driver: true, ..LabelPolicy::default() };
            let mig = "nvidia.com/gpu.deploy.mig-manager";
            let before = l.get(mig).cloned();
            let mut after = l.clone();
            apply_patch(&mut after, &deploy_label_patch(&l, &pol));
            prop_assert!(!schedules(&after, Component::MigManager));
            // Wherever the plugin runs, the label its ownership check reads
            // is `false` unless someone else wrote another value.
            if schedules(&after, Component::DraPlugin)
                && matches!(before.as_deref(), None | Some("" | "true"))
            {
                prop_assert_eq!(after.get(mig).map(String::as_str), Some("false"));
            }
        }

        #[test]
        fn vm_nodes_never_schedule_operands(
            l in arb_labels(),
            dra_driver in any::<bool>(),
            sandbox_default in arb_sandbox(),
        ) {
            let pol = LabelPolicy { dra_driver, sandbox_default, ..LabelPolicy::default() };
            let mut after = l.clone();
            apply_patch(&mut after, &deploy_label_patch(&l, &pol));
            if node_workload(&l, &pol) != Workload::Container {
                for c in Component::ALL {
                    prop_assert!(!schedules(&after, c));
                }
                if NodeFacts::from_labels(&l).gpu && !NodeFacts::from_labels(&l).operands_disabled {
                    prop_assert!(after.get(DEPLOY_CLIENT).is_some_and(|v| !v.is_empty()));
                }
            }
            // Sandbox workloads off: the label is not read.
            if sandbox_default.is_none() {
                let mut relabelled = l.clone();
                relabelled.insert(WORKLOAD_CONFIG.into(), "vm-passthrough".into());
                prop_assert_eq!(
                    deploy_label_patch(&relabelled, &pol),
                    deploy_label_patch(&l, &pol)
                );
            }
        }

        #[test]
        fn upgrade_annotation_follows_the_controller_on_gpu_nodes_only(
            l in arb_labels(),
            before in prop::option::of(prop::sample::select(vec!["true", "false", ""])),
            auto_upgrade in any::<bool>(),
            sandbox_default in arb_sandbox(),
        ) {
            let pol = LabelPolicy { auto_upgrade, sandbox_default, ..LabelPolicy::default() };
            let on = auto_upgrade && sandbox_default.is_none();
            let mut annotations: Labels = before
                .map(|v| (DRIVER_UPGRADE_ENABLED.to_string(), v.to_string()))
                .into_iter()
                .collect();
            let p = upgrade_annotation_patch(&l, Some(&annotations), &pol);
            apply_patch(&mut annotations, &p);
            prop_assert!(upgrade_annotation_patch(&l, Some(&annotations), &pol).is_empty());
            let now = annotations.get(DRIVER_UPGRADE_ENABLED).map(String::as_str);
            if l.get(GPU_PRESENT).is_some_and(|v| v == "true") {
                prop_assert_eq!(now, on.then_some("true"));
            } else {
                prop_assert!(p.is_empty());
            }
        }

        #[test]
        fn cpu_nodes_never_schedule_operands(l in arb_labels()) {
            let mut l = l;
            l.remove("feature.node.kubernetes.io/pci-10de.present");
            let p = deploy_label_patch(&l, &LabelPolicy::default());
            apply_patch(&mut l, &p);
            for c in Component::ALL {
                prop_assert!(!schedules(&l, c));
            }
        }
    }

    #[test]
    fn workload_label_picks_the_operand_set_only_with_sandbox_workloads_on() {
        let gpu = [
            ("feature.node.kubernetes.io/pci-10de.present", "true"),
            ("nvidia.com/gpu.deploy.driver", "true"),
            ("nvidia.com/gpu.deploy.device-plugin", "false"),
        ];
        let on = LabelPolicy {
            sandbox_default: Some(Workload::Container),
            ..LabelPolicy::default()
        };
        let mut vm = labels(&gpu);
        vm.insert(WORKLOAD_CONFIG.into(), "vm-passthrough".into());
        assert_eq!(node_workload(&vm, &on), Workload::VmPassthrough);
        assert_eq!(
            node_workload(&vm, &LabelPolicy::default()),
            Workload::Container
        );
        let p = deploy_label_patch(&vm, &on);
        // Container operands go, a person's `false` included, as NVIDIA does.
        assert_eq!(p.get("nvidia.com/gpu.deploy.driver"), Some(&None));
        assert_eq!(p.get("nvidia.com/gpu.deploy.device-plugin"), Some(&None));
        assert_eq!(p.get(DEPLOY_CLIENT), Some(&Some("true".into())));
        assert_eq!(p.get(GPU_PRESENT), Some(&Some("true".into())));
        // An unknown value falls back to the policy's default.
        vm.insert(WORKLOAD_CONFIG.into(), "vm".into());
        let vgpu_default = LabelPolicy {
            sandbox_default: Some(Workload::VmVgpu),
            ..LabelPolicy::default()
        };
        assert_eq!(node_workload(&vm, &vgpu_default), Workload::VmVgpu);
        assert_eq!(node_workload(&vm, &on), Workload::Container);
        assert!(!deploy_label_patch(&vm, &on).contains_key("nvidia.com/gpu.deploy.driver"));
    }

    #[test]
    fn dra_driver_switches_the_mig_manager_off_and_back() {
        let mig = "nvidia.com/gpu.deploy.mig-manager";
        let dra = "nvidia.com/gpu.deploy.dra-driver";
        let off = LabelPolicy::default();
        let on = LabelPolicy {
            dra_driver: true,
            mig_config_default: Some("all-disabled".into()),
            ..LabelPolicy::default()
        };
        let mut l = gpu_node();
        l.insert(MIG_CAPABLE.into(), "true".into());
        // Without the DRA plugin nothing about it appears.
        let p = deploy_label_patch(&l, &off);
        apply_patch(&mut l, &p);
        assert_eq!(l.get(mig).map(String::as_str), Some("true"));
        assert!(!l.contains_key(dra));
        assert!(!l.contains_key(MIG_MANAGER_OFF));

        // Enabled: the operator's `true` becomes a marked `false`.
        let p = deploy_label_patch(&l, &on);
        assert_eq!(p.get(mig), Some(&Some("false".into())));
        assert_eq!(p.get(dra), Some(&Some("true".into())));
        assert_eq!(
            p.get(MIG_MANAGER_OFF),
            Some(&Some(MIG_MANAGER_OFF_FOR_DRA.into()))
        );
        assert!(!p.contains_key(MIG_CONFIG));
        apply_patch(&mut l, &p);
        assert!(deploy_label_patch(&l, &on).is_empty());

        // Disabled again: the MIG manager comes back, the plugin's label goes.
        let p = deploy_label_patch(&l, &off);
        assert_eq!(p.get(mig), Some(&Some("true".into())));
        assert_eq!(p.get(dra), Some(&None));
        assert_eq!(p.get(MIG_MANAGER_OFF), Some(&None));
        apply_patch(&mut l, &p);
        assert!(!l.contains_key(MIG_MANAGER_OFF));

        // A person's `false` (no mark) stays `false` either way, unmarked.
        l.insert(mig.into(), "false".into());
        l.insert(dra.into(), "false".into());
        for pol in [&on, &off] {
            let p = deploy_label_patch(&l, pol);
            assert!(!p.contains_key(mig), "{p:?}");
            assert!(!p.contains_key(dra), "{p:?}");
            assert!(!p.contains_key(MIG_MANAGER_OFF), "{p:?}");
        }
    }

    #[test]
    fn dra_driver_turns_the_mig_manager_off_on_nodes_not_known_mig_capable() {
        let on = LabelPolicy {
            dra_driver: true,
            ..LabelPolicy::default()
        };
        let mut l = gpu_node();
        let p = deploy_label_patch(&l, &on);
        apply_patch(&mut l, &p);
        assert_eq!(
            l.get("nvidia.com/gpu.deploy.mig-manager")
                .map(String::as_str),
            Some("false")
        );
        // Back off: removed as on any node that is not MIG-capable.
        let p = deploy_label_patch(&l, &LabelPolicy::default());
        assert_eq!(p.get("nvidia.com/gpu.deploy.mig-manager"), Some(&None));
        assert_eq!(p.get(MIG_MANAGER_OFF), Some(&None));
    }

    #[test]
    fn paused_operands_are_deploy_switches_set_to_paused() {
        let labels: Labels = [
            ("nvidia.com/gpu.deploy.device-plugin", PAUSED_FOR_MIG_CHANGE),
            ("nvidia.com/gpu.deploy.driver", "true"),
            ("nvidia.com/gpu.deploy.dcgm-exporter", "false"),
            ("nvidia.com/mig.config.state", "paused-elsewhere"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let paused: Vec<_> = paused_operands(&labels).collect();
        assert_eq!(
            paused,
            [("nvidia.com/gpu.deploy.device-plugin", PAUSED_FOR_MIG_CHANGE)]
        );
    }
}
