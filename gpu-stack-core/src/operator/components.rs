//! Operands of the GPU stack, their dependencies, and the per-node contract
//! that enforces the order.
//!
//! The operator creates every DaemonSet at once; ordering happens on each node:
//! a pod's init containers wait for status files under
//! [`VALIDATIONS_DIR`] that an earlier operand (or the validator) writes. This
//! module is the single description of that contract, so the DaemonSet renderer
//! and the validator agree on file names.
use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// Prefix of every deploy label.
pub const DEPLOY_PREFIX: &str = "nvidia.com/gpu.deploy.";

/// Host directory where per-node validation status files live.
pub const VALIDATIONS_DIR: &str = "/run/nvidia/validations";

/// One operand the operator deploys to GPU nodes (one DaemonSet, or one per
/// driver pool for [`Component::Driver`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Component {
    /// Containerized NVIDIA kernel driver.
    Driver,
    /// NVIDIA container toolkit: configures the container runtime.
    ContainerToolkit,
    /// Per-node validator: checks driver, toolkit, CUDA and device plugin.
    OperatorValidator,
    /// Kubelet device plugin advertising `nvidia.com/gpu` and MIG resources.
    DevicePlugin,
    /// GPU feature discovery: `nvidia.com/gpu.*` node labels.
    GpuFeatureDiscovery,
    /// DCGM-compatible metrics exporter.
    DcgmExporter,
    /// MIG manager: applies `nvidia.com/mig.config` layouts.
    MigManager,
    /// Node status exporter: validation status as metrics.
    NodeStatusExporter,
    /// DRA kubelet plugin (`gpu-dra-plugin`): publishes GPUs and MIG
    /// placements as ResourceSlices and creates MIG instances for claims.
    /// Named after its deploy label, like every other component.
    #[serde(rename = "dra-driver")]
    DraPlugin,
}

impl Component {
    /// Every component, in the order the operator walks them.
    pub const ALL: [Component; 9] = [
        Component::Driver,
        Component::ContainerToolkit,
        Component::OperatorValidator,
        Component::DevicePlugin,
        Component::DcgmExporter,
        Component::GpuFeatureDiscovery,
        Component::MigManager,
        Component::NodeStatusExporter,
        Component::DraPlugin,
    ];

    /// The `<component>` part of the `nvidia.com/gpu.deploy.<component>` label.
    pub fn deploy_label_suffix(self) -> &'static str {
        match self {
            Component::Driver => "driver",
            Component::ContainerToolkit => "container-toolkit",
            Component::OperatorValidator => "operator-validator",
            Component::DevicePlugin => "device-plugin",
            Component::GpuFeatureDiscovery => "gpu-feature-discovery",
            Component::DcgmExporter => "dcgm-exporter",
            Component::MigManager => "mig-manager",
            Component::NodeStatusExporter => "node-status-exporter",
            // NVIDIA's label for its DRA kubelet plugin (the GPUCluster's
            // `state-dra-driver`), so a node pool switched off for NVIDIA's
            // DRA driver stays off for this one.
            Component::DraPlugin => "dra-driver",
        }
    }

    /// The full deploy label key every DaemonSet of this component selects on.
    pub fn deploy_label(self) -> String {
        format!("{}{}", DEPLOY_PREFIX, self.deploy_label_suffix())
    }

    /// DaemonSet name (the NVIDIA operator's names, so dashboards and runbooks
    /// that refer to them keep working). Driver pools append a pool suffix.
    pub fn daemonset_name(self) -> &'static str {
        match self {
            Component::Driver => "nvidia-driver-daemonset",
            Component::ContainerToolkit => "nvidia-container-toolkit-daemonset",
            Component::OperatorValidator => "nvidia-operator-validator",
            Component::DevicePlugin => "nvidia-device-plugin-daemonset",
            Component::GpuFeatureDiscovery => "gpu-feature-discovery",
            Component::DcgmExporter => "nvidia-dcgm-exporter",
            Component::MigManager => "nvidia-mig-manager",
            Component::NodeStatusExporter => "nvidia-node-status-exporter",
            // The kubelet plugin DaemonSet of NVIDIA's DRA driver chart.
            Component::DraPlugin => "nvidia-dra-driver-gpu-kubelet-plugin",
        }
    }

    /// The `app` label of this component's pods.
    pub fn app_label(self) -> &'static str {
        self.daemonset_name()
    }

    /// Components that must be working on a node before this one can be.
    pub fn depends_on(self) -> &'static [Component] {
        match self {
            Component::Driver => &[],
            Component::ContainerToolkit => &[Component::Driver],
            Component::OperatorValidator => &[Component::Driver, Component::ContainerToolkit],
            Component::DevicePlugin
            | Component::GpuFeatureDiscovery
            | Component::DcgmExporter
            | Component::MigManager
            | Component::DraPlugin => &[Component::Driver, Component::ContainerToolkit],
            Component::NodeStatusExporter => &[Component::Driver],
        }
    }

    /// The init containers (in order) that gate this component's pod on a node.
    pub fn gates(self) -> &'static [Gate] {
        match self {
            Component::Driver => &[],
            Component::ContainerToolkit | Component::NodeStatusExporter => {
                &[Gate::DriverValidation]
            }
            Component::OperatorValidator => &[
                Gate::DriverValidation,
                Gate::ToolkitValidation,
                Gate::CudaValidation,
                Gate::PluginValidation,
            ],
            Component::MigManager => &[Gate::DriverValidation, Gate::ToolkitWait],
            Component::DevicePlugin
            | Component::GpuFeatureDiscovery
            | Component::DcgmExporter
            | Component::DraPlugin => &[Gate::ToolkitWait],
        }
    }

    /// Parses a deploy-label suffix (`device-plugin`) back into a component.
    pub fn from_deploy_label_suffix(s: &str) -> Option<Component> {
        Component::ALL
            .into_iter()
            .find(|c| c.deploy_label_suffix() == s)
    }
}

impl std::fmt::Display for Component {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.deploy_label_suffix())
    }
}

/// An init container that blocks a pod until a status file exists on the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Gate {
    /// Validator `COMPONENT=driver`, waits for a working driver, writes `driver-ready`.
    DriverValidation,
    /// Validator `COMPONENT=toolkit`: runs `nvidia-smi` through the runtime, writes `toolkit-ready`.
    ToolkitValidation,
    /// Validator `COMPONENT=cuda`: runs a CUDA workload, writes `cuda-ready`.
    CudaValidation,
    /// Validator `COMPONENT=plugin`: waits for GPU capacity on the node, writes `plugin-ready`.
    PluginValidation,
    /// A plain wait for `toolkit-ready` (no check of its own).
    ToolkitWait,
}

impl Gate {
    /// Init container name.
    pub fn container_name(self) -> &'static str {
        match self {
            Gate::DriverValidation => "driver-validation",
            Gate::ToolkitValidation => "toolkit-validation",
            Gate::CudaValidation => "cuda-validation",
            Gate::PluginValidation => "plugin-validation",
            Gate::ToolkitWait => "toolkit-validation",
        }
    }

    /// The validator's `COMPONENT` value for checks, `None` for a plain wait.
    pub fn validator_component(self) -> Option<&'static str> {
        match self {
            Gate::DriverValidation => Some("driver"),
            Gate::ToolkitValidation => Some("toolkit"),
            Gate::CudaValidation => Some("cuda"),
            Gate::PluginValidation => Some("plugin"),
            Gate::ToolkitWait => None,
        }
    }

    /// Status file (under [`VALIDATIONS_DIR`]) this gate waits for or writes.
    pub fn status_file(self) -> &'static str {
        match self {
            Gate::DriverValidation => "driver-ready",
            Gate::ToolkitValidation | Gate::ToolkitWait => "toolkit-ready",
            Gate::CudaValidation => "cuda-ready",
            Gate::PluginValidation => "plugin-ready",
        }
    }

    /// The component whose health this gate establishes.
    pub fn checks(self) -> Component {
        match self {
            Gate::DriverValidation => Component::Driver,
            Gate::ToolkitValidation | Gate::ToolkitWait => Component::ContainerToolkit,
            Gate::CudaValidation => Component::ContainerToolkit,
            Gate::PluginValidation => Component::DevicePlugin,
        }
    }

    /// The validator component (`--component`) whose status file this gate
    /// writes or waits for: a plain wait gate runs
    /// `gpu-stack validator --wait-only --component <this>`.
    pub fn status_component(self) -> &'static str {
        match self {
            Gate::DriverValidation => "driver",
            Gate::ToolkitValidation | Gate::ToolkitWait => "toolkit",
            Gate::CudaValidation => "cuda",
            Gate::PluginValidation => "plugin",
        }
    }
}

/// Which operands a policy turns on. Built from a ClusterPolicy by the
/// kube-facing crate; the operator validator is always on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Enablement {
    /// `driver.enabled` (and not delegated to NVIDIADriver resources).
    pub driver: bool,
    /// `toolkit.enabled`.
    pub toolkit: bool,
    /// `devicePlugin.enabled`.
    pub device_plugin: bool,
    /// `gfd.enabled`.
    pub gfd: bool,
    /// `dcgmExporter.enabled`.
    pub dcgm_exporter: bool,
    /// `migManager.enabled`.
    pub mig_manager: bool,
    /// `nodeStatusExporter.enabled`.
    pub node_status_exporter: bool,
    /// `draDriver.enabled` (a gpu-stack extension).
    #[serde(default)]
    pub dra_plugin: bool,
}

impl Default for Enablement {
    /// The NVIDIA defaults when `enabled` is unset: everything on except the
    /// node status exporter (and the DRA plugin, which NVIDIA's ClusterPolicy
    /// does not have).
    fn default() -> Self {
        Enablement {
            driver: true,
            toolkit: true,
            device_plugin: true,
            gfd: true,
            dcgm_exporter: true,
            mig_manager: true,
            node_status_exporter: false,
            dra_plugin: false,
        }
    }
}

impl Enablement {
    /// Whether a component gets a DaemonSet under this policy.
    pub fn is_enabled(&self, c: Component) -> bool {
        match c {
            Component::Driver => self.driver,
            Component::ContainerToolkit => self.toolkit,
            Component::OperatorValidator => true,
            Component::DevicePlugin => self.device_plugin,
            Component::GpuFeatureDiscovery => self.gfd,
            Component::DcgmExporter => self.dcgm_exporter,
            Component::MigManager => self.mig_manager,
            Component::NodeStatusExporter => self.node_status_exporter,
            Component::DraPlugin => self.dra_plugin,
        }
    }

    /// Enabled components in walk order.
    pub fn enabled(&self) -> Vec<Component> {
        Component::ALL
            .into_iter()
            .filter(|c| self.is_enabled(*c))
            .collect()
    }
}

/// Where a dependency of an enabled component is expected to come from when its
/// own DaemonSet is disabled (for example a host-installed driver).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExternalDependency {
    /// The enabled component.
    pub component: Component,
    /// The disabled component it depends on, which must then be provided by the host.
    pub provided_by_host: Component,
}

/// Dependencies of enabled components whose DaemonSet is disabled: the policy
/// then relies on the host (pre-installed driver, host toolkit). Reported, not
/// refused, because that is a supported set-up.
pub fn external_dependencies(en: &Enablement) -> Vec<ExternalDependency> {
    let mut out = Vec::new();
    for c in en.enabled() {
        for d in c.depends_on() {
            if !en.is_enabled(*d) {
                out.push(ExternalDependency {
                    component: c,
                    provided_by_host: *d,
                });
            }
        }
    }
    out
}

/// Components in dependency order (every component after all it depends on).
/// The graph is static and acyclic; this is what status reports and the demo
/// walk.
pub fn topological_order() -> Vec<Component> {
    let mut done: BTreeSet<Component> = BTreeSet::new();
    let mut out = Vec::new();
    while out.len() < Component::ALL.len() {
        let before = out.len();
        for c in Component::ALL {
            if !done.contains(&c) && c.depends_on().iter().all(|d| done.contains(d)) {
                done.insert(c);
                out.push(c);
            }
        }
        if out.len() == before {
            // Unreachable for the static graph (a test checks acyclicity); stop
            // rather than loop forever.
            break;
        }
    }
    out
}

/// The dependency graph as adjacency lists, for display and embedding.
pub fn graph() -> BTreeMap<Component, Vec<Component>> {
    Component::ALL
        .into_iter()
        .map(|c| (c, c.depends_on().to_vec()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topological_order_covers_all_and_respects_dependencies() {
        let order = topological_order();
        assert_eq!(order.len(), Component::ALL.len());
        for (i, c) in order.iter().enumerate() {
            for d in c.depends_on() {
                let j = order.iter().position(|x| x == d).unwrap();
                assert!(j < i, "{d} must come before {c}");
            }
        }
        assert_eq!(order[0], Component::Driver);
    }

    #[test]
    fn deploy_labels_round_trip() {
        for c in Component::ALL {
            assert_eq!(
                Component::from_deploy_label_suffix(c.deploy_label_suffix()),
                Some(c)
            );
            assert!(c.deploy_label().starts_with("nvidia.com/gpu.deploy."));
        }
        assert_eq!(Component::from_deploy_label_suffix("dcgm"), None);
    }

    #[test]
    fn serde_names_are_the_deploy_label_suffixes() {
        for c in Component::ALL {
            assert_eq!(
                serde_json::to_value(c).unwrap(),
                serde_json::Value::String(c.deploy_label_suffix().into())
            );
        }
    }

    #[test]
    fn dra_plugin_waits_for_the_toolkit_like_the_device_plugin() {
        let c = Component::DraPlugin;
        assert_eq!(c.gates(), Component::DevicePlugin.gates());
        assert_eq!(c.depends_on(), Component::DevicePlugin.depends_on());
        assert_eq!(c.deploy_label(), "nvidia.com/gpu.deploy.dra-driver");
        assert_eq!(c.daemonset_name(), "nvidia-dra-driver-gpu-kubelet-plugin");
    }

    #[test]
    fn every_gate_checks_a_dependency_or_itself() {
        for c in Component::ALL {
            for g in c.gates() {
                let checked = g.checks();
                assert!(
                    checked == c
                        || c.depends_on().contains(&checked)
                        || c == Component::OperatorValidator,
                    "{c} gates on {g:?} which checks {checked}"
                );
            }
        }
    }

    #[test]
    fn validator_chain_order_matches_nvidia() {
        let names: Vec<_> = Component::OperatorValidator
            .gates()
            .iter()
            .map(|g| g.container_name())
            .collect();
        assert_eq!(
            names,
            [
                "driver-validation",
                "toolkit-validation",
                "cuda-validation",
                "plugin-validation"
            ]
        );
    }

    #[test]
    fn defaults_and_external_dependencies() {
        let en = Enablement::default();
        assert!(!en.is_enabled(Component::NodeStatusExporter));
        assert!(!en.is_enabled(Component::DraPlugin));
        assert!(external_dependencies(&en).is_empty());
        let host_driver = Enablement {
            driver: false,
            ..Enablement::default()
        };
        let ext = external_dependencies(&host_driver);
        assert!(ext.iter().all(|e| e.provided_by_host == Component::Driver));
        assert!(
            ext.iter()
                .any(|e| e.component == Component::ContainerToolkit)
        );
    }

    #[test]
    fn status_components_name_the_files() {
        for g in [
            Gate::DriverValidation,
            Gate::ToolkitValidation,
            Gate::CudaValidation,
            Gate::PluginValidation,
            Gate::ToolkitWait,
        ] {
            assert_eq!(format!("{}-ready", g.status_component()), g.status_file());
        }
    }
}
