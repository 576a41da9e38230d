//! ClusterPolicy (`nvidia.com/v1`, cluster-scoped): the document users already
//! have for the NVIDIA GPU operator.
//!
//! Sections we implement are typed, with NVIDIA's `enabled` defaults. Every
//! section (and the spec itself) keeps the fields it does not know in a
//! flattened map, and the CRD schema preserves unknown fields, so a policy
//! written for the NVIDIA operator deserializes unchanged and the fields we do
//! not act on are listed in status instead of being silently dropped.
//!
//! Enum-like fields are strings on purpose: a typo must become a status
//! condition naming the field, not a document the operator cannot read.
use std::collections::BTreeMap;

use gpu_stack_core::dra::devices::DEFAULT_DRIVER_NAME;
use gpu_stack_core::operator::components::{Component, Enablement};
use gpu_stack_core::operator::driver::{DriverRequest, KernelModuleType};
use gpu_stack_core::operator::upgrade::policy::UpgradePolicy;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use gpu_stack_core::operator::labels::{LabelPolicy, Workload};

pub mod status;
use status::ClusterPolicyStatus;

/// Fields a section does not model, kept verbatim.
pub type Extra = BTreeMap<String, Value>;

/// Repository of gpu-stack's own operand images.
pub const GPU_STACK_REPOSITORY: &str = "ghcr.io/gpu-stack";
/// Version of gpu-stack's own operand images (this build's version).
pub const GPU_STACK_VERSION: &str = env!("CARGO_PKG_VERSION");
/// Default namespace of the operands.
pub const DEFAULT_NAMESPACE: &str = "gpu-operator";

/// Spec of a ClusterPolicy.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "nvidia.com",
    version = "v1",
    kind = "ClusterPolicy",
    plural = "clusterpolicies",
    status = "ClusterPolicyStatus",
    doc = "ClusterPolicy configures the GPU stack on every GPU node of the cluster.",
    printcolumn(name = "Status", type_ = "string", json_path = ".status.state"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct ClusterPolicySpec {
    /// Operator-wide settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operator: Option<OperatorSpec>,
    /// Settings shared by every operand DaemonSet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub daemonsets: Option<DaemonsetsSpec>,
    /// Containerized driver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<DriverSpec>,
    /// Container toolkit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub toolkit: Option<ToolkitSpec>,
    /// Device plugin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_plugin: Option<DevicePluginSpec>,
    /// DCGM exporter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dcgm_exporter: Option<ComponentSpec>,
    /// Standalone DCGM host engine (not supported: the exporter embeds its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dcgm: Option<ComponentSpec>,
    /// GPU feature discovery.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gfd: Option<ComponentSpec>,
    /// MIG strategy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigSpec>,
    /// MIG manager.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_manager: Option<MigManagerSpec>,
    /// Node status exporter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_status_exporter: Option<ComponentSpec>,
    /// Operator validator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validator: Option<ComponentSpec>,
    /// Container Device Interface.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cdi: Option<CdiSpec>,
    /// Host paths.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_paths: Option<HostPathsSpec>,
    /// Pod Security Admission labels on the operand namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub psa: Option<PsaSpec>,
    /// DRA kubelet plugin (a gpu-stack extension; NVIDIA's ClusterPolicy
    /// has no such section). Off by default; when on, it owns MIG layouts
    /// and the MIG manager is not deployed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dra_driver: Option<DraDriverSpec>,
    /// The combined node agent (`gpu-node-agent`, a gpu-stack extension):
    /// the device plugin, GFD, the exporter, the MIG manager and the
    /// validator as one process in one DaemonSet, each run while its deploy
    /// label is `true`, the validator's checks gating the others in the process.
    /// Off by default. Its `args` and `env` are the agent's own; each hosted
    /// component keeps its section's `args` and `env`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_agent: Option<ComponentSpec>,
    /// Which nodes run VM workloads instead of containers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_workloads: Option<SandboxWorkloadsSpec>,
    /// Sections this operator does not implement (vgpu*, vfioManager, gds, ...).
    #[serde(flatten, default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(skip)]
    pub extra: Extra,
}

/// An environment variable.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct EnvVar {
    /// Name.
    pub name: String,
    /// Value.
    #[serde(default)]
    pub value: String,
}

/// Resource limits and requests (quantities as strings).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct Resources {
    /// Limits, e.g. `{cpu: 500m}`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, String>,
    /// Requests.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub requests: BTreeMap<String, String>,
}

/// A pod toleration.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Toleration {
    /// Taint key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// `Exists` or `Equal`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operator: Option<String>,
    /// Taint value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// Taint effect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<String>,
    /// Seconds a NoExecute taint is tolerated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub toleration_seconds: Option<i64>,
}

/// Fields common to every operand section.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct ComponentSpec {
    /// Deploy this operand (default depends on the section).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Image registry and path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repository: Option<String>,
    /// Image name (a full reference when `repository` is empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Image tag or `sha256:` digest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// `Always`, `IfNotPresent` or `Never`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    /// Pull secret names.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<String>,
    /// Container resources.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Resources>,
    /// Extra container args.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// Extra container env.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    /// Fields this operator does not implement.
    #[serde(flatten, default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(skip)]
    pub extra: Extra,
}

/// `spec.operator`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct OperatorSpec {
    /// RuntimeClass operand pods use (default `nvidia`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_class: Option<String>,
    /// Deprecated: the runtime is detected from nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_runtime: Option<String>,
    /// Labels added to every operand pod.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Annotations added to every operand pod.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Fields this operator does not implement.
    #[serde(flatten, default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(skip)]
    pub extra: Extra,
}

/// `spec.daemonsets`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct DaemonsetsSpec {
    /// Labels on every operand pod.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Annotations on every operand pod.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Tolerations of every operand pod (default: `nvidia.com/gpu` NoSchedule).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerations: Option<Vec<Toleration>>,
    /// Priority class (default `system-node-critical`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// `RollingUpdate` (default) or `OnDelete`; the driver is always `OnDelete`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update_strategy: Option<String>,
    /// Rolling update settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rolling_update: Option<RollingUpdateSpec>,
    /// Fields this operator does not implement.
    #[serde(flatten, default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(skip)]
    pub extra: Extra,
}

/// `spec.daemonsets.rollingUpdate`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RollingUpdateSpec {
    /// An integer or a percentage (default `"1"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_unavailable: Option<String>,
}

/// `spec.driver`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct DriverSpec {
    /// Common operand fields.
    #[serde(flatten)]
    pub common: ComponentSpec,
    /// Use precompiled per-kernel images.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_precompiled: Option<bool>,
    /// `auto` (default), `open` or `proprietary`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_module_type: Option<String>,
    /// Deprecated no-op kept for old documents.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_open_kernel_modules: Option<bool>,
    /// Delegate drivers to NVIDIADriver resources: each renders the driver
    /// DaemonSets of the nodes it owns, and this section's image, env and
    /// upgrade settings are not used.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "useNvidiaDriverCRD"
    )]
    pub use_nvidia_driver_crd: Option<bool>,
    /// Driver upgrade policy (NVIDIA's `DriverUpgradePolicySpec`), read by
    /// the upgrade controller. Fields it does not model are kept and listed
    /// in status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "upgrade_policy_schema")]
    pub upgrade_policy: Option<UpgradePolicy>,
    /// Timing of the driver container's startup probe (the probe runs
    /// `nvidia-smi`); unset fields keep NVIDIA's defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub startup_probe: Option<ContainerProbeSpec>,
    /// Image and env of the k8s-driver-manager init container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manager: Option<DriverManagerSpec>,
}

/// The CRD schema of the ClusterPolicy's `upgradePolicy`: NVIDIA's, with
/// its defaults (`autoUpgrade` off) and minimums, plus unknown fields
/// preserved so they can be reported.
pub fn upgrade_policy_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    upgrade_policy_schema_with(false)
}

/// The `upgradePolicy` schema with `autoUpgrade` defaulting to
/// `auto_upgrade` (false in the ClusterPolicy, true in the NVIDIADriver).
pub fn upgrade_policy_schema_with(auto_upgrade: bool) -> schemars::Schema {
    let timeout = |default: i64, what: &str| {
        serde_json::json!({
            "type": "integer",
            "minimum": 0,
            "default": default,
            "description": what,
        })
    };
    let flag =
        |what: &str| serde_json::json!({"type": "boolean", "default": false, "description": what});
    schemars::json_schema!({
        "type": "object",
        "nullable": true,
        "description": "Driver upgrade policy: how driver pods are rolled to a new version node by node.",
        "x-kubernetes-preserve-unknown-fields": true,
        "properties": {
            "autoUpgrade": {
                "type": "boolean",
                "default": auto_upgrade,
                "description": "Upgrade drivers automatically; when false the other fields are ignored."
            },
            "maxParallelUpgrades": {
                "type": "integer",
                "minimum": 0,
                "default": 1,
                "description": "Nodes upgraded at once; 0 means no limit."
            },
            "maxUnavailable": {
                "x-kubernetes-int-or-string": true,
                "default": "25%",
                "description": "Nodes that may be unavailable at once: a number, or a percentage of the managed nodes rounded up."
            },
            "podDeletion": {
                "type": "object",
                "x-kubernetes-preserve-unknown-fields": true,
                "description": "Deletion of the pods that use GPUs before the driver restarts.",
                "properties": {
                    "force": flag("Delete pods no controller manages."),
                    "timeoutSeconds": timeout(300, "Seconds to wait for the pods to go; 0 waits forever."),
                    "deleteEmptyDir": flag("Delete pods that use emptyDir volumes (their data is lost)."),
                    "podSelector": {"type": "string", "description": "Further pods to delete, by label selector."}
                }
            },
            "waitForCompletion": {
                "type": "object",
                "x-kubernetes-preserve-unknown-fields": true,
                "description": "Waiting for jobs to finish before GPU pods are deleted.",
                "properties": {
                    "podSelector": {"type": "string", "description": "Pods to wait for; empty waits for none."},
                    "timeoutSeconds": timeout(0, "Seconds to wait; 0 waits forever.")
                }
            },
            "drain": {
                "type": "object",
                "x-kubernetes-preserve-unknown-fields": true,
                "description": "Node drain, used when GPU pods cannot be deleted.",
                "properties": {
                    "enable": flag("Allow draining the node."),
                    "force": flag("Evict pods no controller manages."),
                    "podSelector": {"type": "string", "description": "Pods to drain; empty drains all."},
                    "timeoutSeconds": timeout(300, "Seconds the drain may take; 0 waits forever."),
                    "deleteEmptyDir": flag("Evict pods that use emptyDir volumes (their data is lost).")
                }
            }
        }
    })
}

/// A container probe's timing (the probe itself is the driver container's).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContainerProbeSpec {
    /// Seconds after the container starts before the first probe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial_delay_seconds: Option<i32>,
    /// Seconds after which a probe times out (at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub timeout_seconds: Option<i32>,
    /// Seconds between probes (at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub period_seconds: Option<i32>,
    /// Successes after a failure before the probe passes (at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub success_threshold: Option<i32>,
    /// Failures after a success before the probe fails (at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub failure_threshold: Option<i32>,
}

/// `driver.manager` (`spec.manager` of an NVIDIADriver): the k8s-driver-manager
/// init container of driver pods.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DriverManagerSpec {
    /// Image registry and path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repository: Option<String>,
    /// Image name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"[a-zA-Z0-9\-]+"))]
    pub image: Option<String>,
    /// Image tag.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// `Always`, `IfNotPresent` or `Never`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    /// Pull secret names.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<String>,
    /// Env of the driver manager.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
}

/// `spec.toolkit`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct ToolkitSpec {
    /// Common operand fields.
    #[serde(flatten)]
    pub common: ComponentSpec,
    /// Host directory of the toolkit (default `/usr/local/nvidia`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub install_dir: Option<String>,
}

/// `spec.devicePlugin`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct DevicePluginSpec {
    /// Common operand fields.
    #[serde(flatten)]
    pub common: ComponentSpec,
    /// ConfigMap of plugin configurations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<NamedConfig>,
}

/// A reference to a ConfigMap with a default key.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct NamedConfig {
    /// ConfigMap name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Default configuration (key or profile name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<String>,
    /// Fields this operator does not act on: NVIDIA's chart-level `create`
    /// and `data`, which this chart copies as written.
    #[serde(flatten, default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(skip)]
    pub extra: Extra,
}

impl NamedConfig {
    /// Its fields that ask for something this operator does not do, as
    /// paths under `section`: `create: true` or non-empty `data` (NVIDIA's
    /// chart makes a ConfigMap of them; their defaults ask for nothing),
    /// and any other unknown field.
    fn unsupported(&self, section: &str) -> Vec<String> {
        self.extra
            .iter()
            .filter(|(k, v)| match k.as_str() {
                "create" => v.as_bool() != Some(false),
                "data" => !(v.is_null() || v.as_object().is_some_and(|m| m.is_empty())),
                _ => true,
            })
            .map(|(k, _)| format!("spec.{section}.config.{k}"))
            .collect()
    }
}

/// `spec.mig`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct MigSpec {
    /// `none`, `single` (default) or `mixed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<String>,
    /// Fields this operator does not implement.
    #[serde(flatten, default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(skip)]
    pub extra: Extra,
}

/// `spec.migManager`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct MigManagerSpec {
    /// Common operand fields.
    #[serde(flatten)]
    pub common: ComponentSpec,
    /// mig-parted config ConfigMap and default profile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<NamedConfig>,
}

/// `spec.draDriver`, a gpu-stack extension: the DRA kubelet plugin
/// (`gpu-dra-plugin`, DaemonSet `nvidia-dra-driver-gpu-kubelet-plugin`,
/// deploy label `nvidia.com/gpu.deploy.dra-driver`), which publishes the
/// GPUs and their MIG placements as ResourceSlices and creates MIG instances
/// for the claims it prepares.
///
/// One owner of a GPU layout: with `enabled: true` the MIG manager is not
/// deployed whatever `migManager.enabled` says, and every GPU node gets
/// `nvidia.com/gpu.deploy.mig-manager=false` (the plugin refuses a node with
/// `nvidia.com/mig.config` otherwise). The device plugin stays as
/// configured: on one node both would hand out the same GPUs, so switch one
/// of them off per node pool (`nvidia.com/gpu.deploy.device-plugin=false`
/// on DRA nodes, or `devicePlugin.enabled: false`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct DraDriverSpec {
    /// Common operand fields (`enabled` defaults to false here).
    #[serde(flatten)]
    pub common: ComponentSpec,
    /// The DRA driver name the devices are published under, which
    /// DeviceClasses select (default `gpu.nvidia.com`, NVIDIA's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    )]
    pub driver_name: Option<String>,
}

/// `spec.cdi`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct CdiSpec {
    /// Use CDI to inject devices (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Deprecated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<bool>,
    /// NRI plugin instead of a runtime class (requires cdi and toolkit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nri_plugin_enabled: Option<bool>,
}

/// `spec.hostPaths`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct HostPathsSpec {
    /// Host root filesystem (default `/`). NVIDIA's field is `rootFS`;
    /// `rootFs`, which earlier gpu-stack releases read, is accepted too.
    #[serde(
        default,
        rename = "rootFS",
        alias = "rootFs",
        skip_serializing_if = "Option::is_none"
    )]
    pub root_fs: Option<String>,
    /// Where the driver container installs the driver (default `/run/nvidia/driver`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_install_dir: Option<String>,
    /// Kubelet root directory (default `/var/lib/kubelet`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubelet_root_dir: Option<String>,
    /// Fields this operator does not know.
    #[serde(flatten, default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(skip)]
    pub extra: Extra,
}

/// `spec.psa`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct PsaSpec {
    /// Label the namespace `pod-security.kubernetes.io/*=privileged`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
}

/// `spec.sandboxWorkloads`, NVIDIA's switch for nodes that serve virtual
/// machines. gpu-stack honours the node selection (a node labelled
/// `nvidia.com/gpu.workload.config=vm-passthrough` or `vm-vgpu`, or every
/// unlabelled node when that is the default, gets no container operands) but
/// runs none of NVIDIA's VM operands; their sections are reported when this
/// is on ([`VM_OPERAND_SECTIONS`]).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct SandboxWorkloadsSpec {
    /// Read each GPU node's `nvidia.com/gpu.workload.config` (default
    /// `false`: every GPU node runs the container operands).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Workload of a node without a valid label: `container` (default),
    /// `vm-passthrough` or `vm-vgpu`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_workload: Option<String>,
    /// `kubevirt` (default) or `kata`: how NVIDIA's VM operands hand GPUs
    /// to virtual machines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// Fields this operator does not know.
    #[serde(flatten, default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(skip)]
    pub extra: Extra,
}

/// NVIDIA's sections for operands that serve virtual machines. NVIDIA's
/// operator deploys them only with `sandboxWorkloads.enabled`, so only then
/// are they reported (several are `enabled: true` in NVIDIA's chart defaults).
pub const VM_OPERAND_SECTIONS: [&str; 7] = [
    "sandboxDevicePlugin",
    "kataSandboxDevicePlugin",
    "vfioManager",
    "vgpuManager",
    "vgpuDeviceManager",
    "kataManager",
    "ccManager",
];

/// A problem in a ClusterPolicy spec, naming the field path and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[error("{path}: {message}")]
pub struct ValidationError {
    /// Field path, e.g. `spec.mig.strategy`.
    pub path: String,
    /// What is wrong and how to fix it.
    pub message: String,
}

fn one_of(path: &str, value: Option<&str>, allowed: &[&str], out: &mut Vec<ValidationError>) {
    if let Some(v) = value
        && !allowed.contains(&v)
    {
        out.push(ValidationError {
            path: path.to_string(),
            message: format!("{v:?} is not valid; use one of {}", allowed.join(", ")),
        });
    }
}

fn common_fields(path: &str, c: &ComponentSpec, out: &mut Vec<ValidationError>) {
    one_of(
        &format!("{path}.imagePullPolicy"),
        c.image_pull_policy.as_deref(),
        &["Always", "IfNotPresent", "Never"],
        out,
    );
    for (i, e) in c.env.iter().enumerate() {
        if e.name.trim().is_empty() {
            out.push(ValidationError {
                path: format!("{path}.env[{i}].name"),
                message: "is empty; give every environment variable a name".into(),
            });
        }
    }
    if let Some(v) = &c.version
        && v.trim().is_empty()
    {
        // Empty means "use the default"; nothing to report.
    }
}

fn is_int_or_percent(s: &str) -> bool {
    let digits = s.strip_suffix('%').unwrap_or(s);
    !digits.is_empty() && digits.chars().all(|c| c.is_ascii_digit())
}

/// NVIDIA's `dcgmExporter.service`: how the exporter's Service is exposed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExporterService {
    /// `type` (ClusterIP when unset, as NVIDIA's).
    pub type_: Option<String>,
    /// `internalTrafficPolicy`.
    pub internal_traffic_policy: Option<String>,
}

/// The keys of `dcgmExporter.service` gpu-stack acts on.
const EXPORTER_SERVICE_KEYS: [&str; 2] = ["type", "internalTrafficPolicy"];

/// The variable of NVIDIA's `validator.plugin.env` that turns the plugin
/// check's workload pod on or off.
const WITH_WORKLOAD: &str = "WITH_WORKLOAD";

/// NVIDIA's `validator.driver.env` switch: `true` leaves `/dev/char` as it is.
const DISABLE_DEV_CHAR_SYMLINK_CREATION: &str = "DISABLE_DEV_CHAR_SYMLINK_CREATION";

/// The variables of NVIDIA's per-check validator sections gpu-stack acts
/// on: `validator.plugin.env` `WITH_WORKLOAD`, `validator.driver.env`
/// `DISABLE_DEV_CHAR_SYMLINK_CREATION`.
const VALIDATOR_CHECK_VARS: [(&str, &str); 2] = [
    ("plugin", WITH_WORKLOAD),
    ("driver", DISABLE_DEV_CHAR_SYMLINK_CREATION),
];

/// The last value `validator.<check>.env` gives `var` (those sections are
/// kept among the validator's unmodelled fields).
fn validator_check_var<'a>(
    validator: Option<&'a ComponentSpec>,
    check: &str,
    var: &str,
) -> Option<&'a str> {
    validator?
        .extra
        .get(check)?
        .get("env")?
        .as_array()?
        .iter()
        .filter(|e| e.get("name").and_then(Value::as_str) == Some(var))
        .filter_map(|e| e.get("value").and_then(Value::as_str))
        .next_back()
}

/// Whether a `validator.<check>` section holds nothing but `env` entries
/// naming `var`, which gpu-stack acts on.
fn validator_check_only_sets(section: &Value, var: &str) -> bool {
    let Some(fields) = section.as_object() else {
        return false;
    };
    fields.iter().all(|(k, v)| {
        k == "env"
            && v.as_array().is_some_and(|env| {
                env.iter()
                    .all(|e| e.get("name").and_then(Value::as_str) == Some(var))
            })
    })
}

/// Names of the top-level sections we model (used for the unsupported list).
pub const KNOWN_SECTIONS: [&str; 17] = [
    "operator",
    "daemonsets",
    "driver",
    "toolkit",
    "devicePlugin",
    "dcgmExporter",
    "dcgm",
    "gfd",
    "mig",
    "migManager",
    "nodeStatusExporter",
    "validator",
    "cdi",
    "hostPaths",
    "psa",
    "draDriver",
    "nodeAgent",
];

fn on(c: Option<&ComponentSpec>, default: bool) -> bool {
    c.and_then(|c| c.enabled).unwrap_or(default)
}

fn nonempty(s: &Option<String>) -> Option<&str> {
    s.as_deref().map(str::trim).filter(|s| !s.is_empty())
}

/// Effective image settings of one operand after defaults.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageSettings {
    /// Full image reference.
    pub image: String,
    /// Pull policy.
    pub pull_policy: String,
    /// Pull secrets.
    pub pull_secrets: Vec<String>,
}

/// Builds `repo/image:version` or `repo/image@sha256:...`.
pub fn image_path(repository: &str, image: &str, version: &str) -> String {
    let base = if repository.trim().is_empty() {
        image.to_string()
    } else {
        format!("{}/{}", repository.trim_end_matches('/'), image)
    };
    if version.is_empty() {
        base
    } else if version.starts_with("sha256:") {
        format!("{base}@{version}")
    } else {
        format!("{base}:{version}")
    }
}

/// `repo/image:version` from the given parts over `defaults`. An image
/// given without a repository is a full path, and then takes no default
/// version either.
fn image_with_defaults(
    repository: Option<&str>,
    image: Option<&str>,
    version: Option<&str>,
    (drepo, dimage, dversion): (&str, &str, &str),
) -> String {
    let repo = repository
        .map(str::trim)
        .unwrap_or(if image.is_some() { "" } else { drepo });
    let version = version.unwrap_or(if image.is_some() && repo.is_empty() {
        ""
    } else {
        dversion
    });
    image_path(repo, image.unwrap_or(dimage), version)
}

/// Image settings of a section after `defaults`.
fn settings_with_defaults(
    spec: Option<&ComponentSpec>,
    defaults: (&str, &str, &str),
) -> ImageSettings {
    ImageSettings {
        image: image_with_defaults(
            spec.and_then(|s| s.repository.as_deref()),
            spec.and_then(|s| nonempty(&s.image)),
            spec.and_then(|s| nonempty(&s.version)),
            defaults,
        ),
        pull_policy: spec
            .and_then(|s| nonempty(&s.image_pull_policy))
            .unwrap_or("IfNotPresent")
            .to_string(),
        pull_secrets: spec
            .map(|s| s.image_pull_secrets.clone())
            .unwrap_or_default(),
    }
}

/// The name of an image reference without its repository, tag or digest.
fn image_name(image: &str) -> &str {
    let name = image.rsplit('/').next().unwrap_or(image);
    name.split(['@', ':']).next().unwrap_or(name)
}

impl DriverManagerSpec {
    /// NVIDIA's driver manager image: `(repository, image, version)`.
    pub const DEFAULT_IMAGE: (&'static str, &'static str, &'static str) = (
        "nvcr.io/nvidia/cloud-native",
        "k8s-driver-manager",
        "v0.12.0",
    );

    /// The init container's image reference, NVIDIA's when `spec` names none.
    pub fn image_reference(spec: Option<&Self>) -> String {
        image_with_defaults(
            spec.and_then(|s| s.repository.as_deref()),
            spec.and_then(|s| nonempty(&s.image)),
            spec.and_then(|s| nonempty(&s.version)),
            Self::DEFAULT_IMAGE,
        )
    }
}

impl ClusterPolicySpec {
    /// The common fields of a component's section, if present.
    pub fn component(&self, c: Component) -> Option<&ComponentSpec> {
        match c {
            Component::Driver => self.driver.as_ref().map(|d| &d.common),
            Component::ContainerToolkit => self.toolkit.as_ref().map(|t| &t.common),
            Component::OperatorValidator => self.validator.as_ref(),
            Component::DevicePlugin => self.device_plugin.as_ref().map(|d| &d.common),
            Component::GpuFeatureDiscovery => self.gfd.as_ref(),
            Component::DcgmExporter => self.dcgm_exporter.as_ref(),
            Component::MigManager => self.mig_manager.as_ref().map(|m| &m.common),
            Component::NodeStatusExporter => self.node_status_exporter.as_ref(),
            Component::DraPlugin => self.dra_driver.as_ref().map(|d| &d.common),
        }
    }

    /// Which operands this policy deploys, with NVIDIA's defaults for unset
    /// `enabled` fields.
    pub fn enablement(&self) -> Enablement {
        Enablement {
            driver: on(self.component(Component::Driver), true)
                && !self
                    .driver
                    .as_ref()
                    .and_then(|d| d.use_nvidia_driver_crd)
                    .unwrap_or(false),
            toolkit: on(self.component(Component::ContainerToolkit), true),
            device_plugin: on(self.component(Component::DevicePlugin), true),
            gfd: on(self.component(Component::GpuFeatureDiscovery), true),
            dcgm_exporter: on(self.component(Component::DcgmExporter), true),
            // One owner of a GPU layout: the DRA plugin creates MIG
            // instances itself, so the MIG manager must not apply layouts.
            mig_manager: on(self.component(Component::MigManager), true)
                && !self.dra_driver_enabled(),
            node_status_exporter: on(self.component(Component::NodeStatusExporter), false),
            dra_plugin: self.dra_driver_enabled(),
        }
    }

    /// `draDriver.enabled` (default false).
    pub fn dra_driver_enabled(&self) -> bool {
        on(self.component(Component::DraPlugin), false)
    }

    /// The DRA driver name (`draDriver.driverName`, default `gpu.nvidia.com`).
    pub fn dra_driver_name(&self) -> String {
        self.dra_driver
            .as_ref()
            .and_then(|d| nonempty(&d.driver_name))
            .unwrap_or(DEFAULT_DRIVER_NAME)
            .to_string()
    }

    /// Whether drivers are deployed per NVIDIADriver resource
    /// (`driver.useNvidiaDriverCRD: true` with the driver enabled); the
    /// ClusterPolicy's own driver DaemonSets are then not rendered.
    pub fn uses_nvidia_driver_crd(&self) -> bool {
        on(self.component(Component::Driver), true)
            && self
                .driver
                .as_ref()
                .and_then(|d| d.use_nvidia_driver_crd)
                .unwrap_or(false)
    }

    /// The built-in default `(repository, image, version)` of a component.
    pub fn default_image(c: Component) -> (&'static str, &'static str, &'static str) {
        match c {
            Component::Driver => ("nvcr.io/nvidia", "driver", "595.91.07"),
            Component::ContainerToolkit => ("nvcr.io/nvidia/k8s", "container-toolkit", "v1.20.0"),
            Component::DevicePlugin => {
                (GPU_STACK_REPOSITORY, "gpu-device-plugin", GPU_STACK_VERSION)
            }
            Component::GpuFeatureDiscovery => (
                GPU_STACK_REPOSITORY,
                "gpu-feature-discovery",
                GPU_STACK_VERSION,
            ),
            Component::DcgmExporter => (GPU_STACK_REPOSITORY, "gpu-exporter", GPU_STACK_VERSION),
            Component::MigManager => (GPU_STACK_REPOSITORY, "gpu-mig-manager", GPU_STACK_VERSION),
            Component::DraPlugin => (GPU_STACK_REPOSITORY, "gpu-dra-plugin", GPU_STACK_VERSION),
            Component::OperatorValidator | Component::NodeStatusExporter => {
                (GPU_STACK_REPOSITORY, "gpu-stack", GPU_STACK_VERSION)
            }
        }
    }

    /// Image settings of a component after defaults (for the driver this is
    /// the base `repository/image`; the selection matrix adds the tag).
    pub fn image_settings(&self, c: Component) -> ImageSettings {
        settings_with_defaults(self.component(c), Self::default_image(c))
    }

    /// The combined node agent's default `(repository, image, version)`.
    pub const NODE_AGENT_IMAGE: (&'static str, &'static str, &'static str) =
        (GPU_STACK_REPOSITORY, "gpu-node-agent", GPU_STACK_VERSION);

    /// `nodeAgent.enabled` (default false).
    pub fn node_agent_enabled(&self) -> bool {
        on(self.node_agent.as_ref(), false)
    }

    /// The combined node agent's image settings after defaults.
    pub fn node_agent_image_settings(&self) -> ImageSettings {
        settings_with_defaults(self.node_agent.as_ref(), Self::NODE_AGENT_IMAGE)
    }

    /// The components the combined node agent runs, in its order: with
    /// `nodeAgent.enabled`, every enabled component it can host whose image
    /// is gpu-stack's own (a section naming another image, NVIDIA's say,
    /// keeps its own DaemonSet, as that image is what the user asked for).
    /// Empty when the agent is off.
    pub fn node_agent_components(&self) -> Vec<Component> {
        if !self.node_agent_enabled() {
            return Vec::new();
        }
        let enabled = self.enablement();
        gpu_stack_core::nodeagent::HOSTED
            .iter()
            .map(|(c, _)| *c)
            .filter(|c| enabled.is_enabled(*c))
            .filter(|c| {
                let image = self.image_settings(*c).image;
                image_name(&image) == Self::default_image(*c).1
            })
            .collect()
    }

    /// True when the toolkit image is gpu-stack's own (image name `gpu-stack`):
    /// the toolkit DaemonSet then runs `gpu-stack toolkit`, which configures
    /// the runtime for CDI with no runtime shim, instead of NVIDIA's toolkit.
    pub fn toolkit_is_gpu_stack(&self) -> bool {
        image_name(&self.image_settings(Component::ContainerToolkit).image) == "gpu-stack"
    }

    /// The driver request for the selection matrix.
    pub fn driver_request(&self) -> DriverRequest {
        let d = self.driver.as_ref();
        let (drepo, dimage, dversion) = Self::default_image(Component::Driver);
        let c = d.map(|d| &d.common);
        let image_given = c.and_then(|s| nonempty(&s.image));
        DriverRequest {
            repository: c
                .and_then(|s| s.repository.as_deref())
                .map(str::trim)
                .unwrap_or(if image_given.is_some() { "" } else { drepo })
                .to_string(),
            image: image_given.unwrap_or(dimage).to_string(),
            version: c
                .and_then(|s| nonempty(&s.version))
                .unwrap_or(dversion)
                .to_string(),
            use_precompiled: d.and_then(|d| d.use_precompiled).unwrap_or(false),
            kernel_module_type: match d.and_then(|d| d.kernel_module_type.as_deref()) {
                Some("open") => KernelModuleType::Open,
                Some("proprietary") => KernelModuleType::Proprietary,
                _ => KernelModuleType::Auto,
            },
        }
    }

    /// MIG strategy (`single` by default).
    pub fn mig_strategy(&self) -> &str {
        self.mig
            .as_ref()
            .and_then(|m| nonempty(&m.strategy))
            .unwrap_or("single")
    }

    /// `sandboxWorkloads.defaultWorkload` while `sandboxWorkloads.enabled`
    /// (`container` when unset); `None` when sandbox workloads are off.
    pub fn sandbox_default_workload(&self) -> Option<Workload> {
        let s = self.sandbox_workloads.as_ref()?;
        (s.enabled == Some(true)).then(|| {
            s.default_workload
                .as_deref()
                .and_then(Workload::parse)
                .unwrap_or_default()
        })
    }

    /// What the node labels the operator writes depend on.
    pub fn label_policy(&self) -> LabelPolicy {
        LabelPolicy {
            mig_config_default: Some(self.mig_config_default()),
            dra_driver: self.dra_driver_enabled(),
            sandbox_default: self.sandbox_default_workload(),
            auto_upgrade: self.upgrade_policy().is_some_and(|u| u.auto_upgrade),
        }
    }

    /// Default MIG config profile of the MIG manager (`all-disabled`).
    pub fn mig_config_default(&self) -> String {
        self.mig_manager
            .as_ref()
            .and_then(|m| m.config.as_ref())
            .and_then(|c| nonempty(&c.default))
            .unwrap_or("all-disabled")
            .to_string()
    }

    /// Name of the mig-parted config ConfigMap (`default-mig-parted-config`).
    pub fn mig_config_name(&self) -> String {
        self.mig_manager
            .as_ref()
            .and_then(|m| m.config.as_ref())
            .and_then(|c| nonempty(&c.name))
            .unwrap_or("default-mig-parted-config")
            .to_string()
    }

    /// NVIDIA's `dcgmExporter.service` knobs gpu-stack acts on.
    pub fn exporter_service(&self) -> ExporterService {
        let service = self
            .dcgm_exporter
            .as_ref()
            .and_then(|e| e.extra.get("service"));
        let text = |key: &str| {
            service
                .and_then(|s| s.get(key))
                .and_then(Value::as_str)
                .filter(|v| !v.is_empty())
                .map(String::from)
        };
        ExporterService {
            type_: text("type"),
            internal_traffic_policy: text("internalTrafficPolicy"),
        }
    }

    /// NVIDIA's `validator.plugin.env` entry `WITH_WORKLOAD`: whether the
    /// plugin check runs a workload pod. gpu-stack runs one unless it is
    /// `false`.
    pub fn plugin_workload_wanted(&self) -> bool {
        validator_check_var(self.validator.as_ref(), "plugin", WITH_WORKLOAD)
            .is_none_or(|v| !v.trim().eq_ignore_ascii_case("false"))
    }

    /// Whether the driver check links NVIDIA's device nodes into
    /// `/dev/char`: unless NVIDIA's `validator.driver.env` says
    /// `DISABLE_DEV_CHAR_SYMLINK_CREATION=true`.
    pub fn dev_char_links_wanted(&self) -> bool {
        validator_check_var(
            self.validator.as_ref(),
            "driver",
            DISABLE_DEV_CHAR_SYMLINK_CREATION,
        )
        .is_none_or(|v| !v.trim().eq_ignore_ascii_case("true"))
    }

    /// Whether CDI is on (default true).
    pub fn cdi_enabled(&self) -> bool {
        self.cdi.as_ref().and_then(|c| c.enabled).unwrap_or(true)
    }

    /// The driver upgrade policy, when the document has one (no policy means
    /// automatic upgrades are off).
    pub fn upgrade_policy(&self) -> Option<&UpgradePolicy> {
        self.driver.as_ref().and_then(|d| d.upgrade_policy.as_ref())
    }

    /// RuntimeClass operand pods use.
    pub fn runtime_class(&self) -> String {
        self.operator
            .as_ref()
            .and_then(|o| nonempty(&o.runtime_class))
            .unwrap_or("nvidia")
            .to_string()
    }

    /// Checks the spec; every problem names its field path and the fix.
    pub fn validate(&self) -> Vec<ValidationError> {
        let mut out = Vec::new();
        for c in Component::ALL {
            if let Some(spec) = self.component(c) {
                common_fields(&format!("spec.{}", section_name(c)), spec, &mut out);
            }
        }
        if let Some(spec) = &self.node_agent {
            common_fields("spec.nodeAgent", spec, &mut out);
        }
        if let Some(m) = &self.mig {
            one_of(
                "spec.mig.strategy",
                m.strategy.as_deref(),
                &["none", "single", "mixed"],
                &mut out,
            );
        }
        if let Some(d) = &self.driver {
            one_of(
                "spec.driver.kernelModuleType",
                d.kernel_module_type.as_deref(),
                &["auto", "open", "proprietary"],
                &mut out,
            );
        }
        if self.enablement().driver
            && let Err(e) =
                gpu_stack_core::operator::driver::validate_request(&self.driver_request())
        {
            let text = e.to_string();
            let (path, message) = text.split_once(": ").unwrap_or(("spec.driver", &text));
            out.push(ValidationError {
                path: path.to_string(),
                message: message.to_string(),
            });
        }
        // With autoUpgrade off NVIDIA ignores every other field, so do we.
        if let Some(u) = self.upgrade_policy()
            && u.auto_upgrade
        {
            for e in u.validate() {
                let text = e.to_string();
                let message = text
                    .strip_prefix(&format!("{}: ", e.field()))
                    .unwrap_or(&text);
                out.push(ValidationError {
                    path: format!("spec.driver.upgradePolicy.{}", e.field()),
                    message: message.to_string(),
                });
            }
        }
        if let Some(ds) = &self.daemonsets {
            one_of(
                "spec.daemonsets.updateStrategy",
                ds.update_strategy.as_deref(),
                &["RollingUpdate", "OnDelete"],
                &mut out,
            );
            if let Some(mu) = ds
                .rolling_update
                .as_ref()
                .and_then(|r| r.max_unavailable.as_deref())
                && !is_int_or_percent(mu)
            {
                out.push(ValidationError {
                    path: "spec.daemonsets.rollingUpdate.maxUnavailable".into(),
                    message: format!(
                        "{mu:?} is not an integer or a percentage such as \"1\" or \"25%\""
                    ),
                });
            }
            for (i, t) in ds.tolerations.iter().flatten().enumerate() {
                one_of(
                    &format!("spec.daemonsets.tolerations[{i}].operator"),
                    t.operator.as_deref(),
                    &["Exists", "Equal"],
                    &mut out,
                );
                one_of(
                    &format!("spec.daemonsets.tolerations[{i}].effect"),
                    t.effect.as_deref(),
                    &["NoSchedule", "PreferNoSchedule", "NoExecute"],
                    &mut out,
                );
            }
        }
        if let Some(name) = self
            .dra_driver
            .as_ref()
            .and_then(|d| nonempty(&d.driver_name))
            && let Err(why) = check_dra_driver_name(name)
        {
            out.push(ValidationError {
                path: "spec.draDriver.driverName".into(),
                message: format!(
                    "{name:?} is not a DRA driver name: {why}; use a DNS subdomain such as gpu.nvidia.com"
                ),
            });
        }
        if let Some(s) = &self.sandbox_workloads {
            let workloads = Workload::ALL.map(Workload::as_str);
            one_of(
                "spec.sandboxWorkloads.defaultWorkload",
                s.default_workload.as_deref(),
                &workloads,
                &mut out,
            );
            one_of(
                "spec.sandboxWorkloads.mode",
                s.mode.as_deref(),
                &["kubevirt", "kata"],
                &mut out,
            );
        }
        if let Some(cdi) = &self.cdi
            && cdi.nri_plugin_enabled == Some(true)
            && (!self.cdi_enabled() || !self.enablement().toolkit)
        {
            out.push(ValidationError {
                path: "spec.cdi.nriPluginEnabled".into(),
                message: "requires spec.cdi.enabled=true and spec.toolkit.enabled=true; enable both or turn the NRI plugin off".into(),
            });
        }
        out
    }

    /// Field paths present in the document that this operator does not act
    /// on, sorted. Sections that are present but disabled are not listed.
    pub fn unsupported_fields(&self) -> Vec<String> {
        let mut out = Vec::new();
        let sandbox = self.sandbox_default_workload().is_some();
        for (k, v) in &self.extra {
            // A disabled unsupported section changes nothing; do not nag.
            let disabled = v.get("enabled") == Some(&Value::Bool(false));
            let vm_operand_unused = VM_OPERAND_SECTIONS.contains(&k.as_str()) && !sandbox;
            if !disabled && !vm_operand_unused {
                out.push(format!("spec.{k}"));
            }
        }
        let mut section = |name: &str, extra: &Extra| {
            for k in extra.keys() {
                out.push(format!("spec.{name}.{k}"));
            }
        };
        if let Some(o) = &self.operator {
            section("operator", &o.extra);
        }
        if let Some(d) = &self.daemonsets {
            section("daemonsets", &d.extra);
        }
        if let Some(m) = &self.mig {
            section("mig", &m.extra);
        }
        if let Some(s) = &self.sandbox_workloads {
            section("sandboxWorkloads", &s.extra);
        }
        if let Some(h) = &self.host_paths {
            section("hostPaths", &h.extra);
        }
        for c in Component::ALL {
            if let Some(spec) = self.component(c) {
                section(section_name(c), &spec.extra);
            }
        }

        if let Some(spec) = &self.node_agent {
            section("nodeAgent", &spec.extra);
        }
        if let Some(s) = &self.sandbox_workloads
            && s.enabled == Some(true)
            && s.mode.as_deref() == Some("kata")
        {
            // Kata Containers need NVIDIA's kata manager and sandbox device
            // plugin; the node selection is honoured, the mode is not.
            out.push("spec.sandboxWorkloads.mode".into());
        }
        if let Some(c) = self.device_plugin.as_ref().and_then(|d| d.config.as_ref()) {
            out.extend(c.unsupported("devicePlugin"));
            // The plugin's config file (time-slicing, MPS, per-node configs
            // by label) is not read yet.
            if c.name.as_deref().is_some_and(|n| !n.trim().is_empty()) {
                out.push("spec.devicePlugin.config.name".into());
            }
        }
        if let Some(c) = self.mig_manager.as_ref().and_then(|m| m.config.as_ref()) {
            out.extend(c.unsupported("migManager"));
        }
        // `dcgmExporter.service` is honoured when it holds only what the
        // exporter's Service takes.
        if let Some(service) = self
            .dcgm_exporter
            .as_ref()
            .and_then(|e| e.extra.get("service"))
            .and_then(Value::as_object)
            && service
                .keys()
                .all(|k| EXPORTER_SERVICE_KEYS.contains(&k.as_str()))
        {
            out.retain(|f| f != "spec.dcgmExporter.service");
        }
        // `validator.plugin` and `validator.driver` are honoured when they
        // only set the variable gpu-stack acts on.
        for (check, var) in VALIDATOR_CHECK_VARS {
            if let Some(section) = self.validator.as_ref().and_then(|v| v.extra.get(check))
                && validator_check_only_sets(section, var)
            {
                out.retain(|f| *f != format!("spec.validator.{check}"));
            }
        }
        if self.dcgm.as_ref().and_then(|d| d.enabled) == Some(true) {
            out.push("spec.dcgm.enabled".into());
        }
        // The DRA plugin owns MIG layouts: a MIG manager asked for is not
        // deployed, and its settings are not acted on.
        if self.dra_driver_enabled()
            && let Some(m) = &self.mig_manager
            && m.common.enabled != Some(false)
        {
            out.push("spec.migManager".into());
        }
        if self.cdi.as_ref().and_then(|c| c.nri_plugin_enabled) == Some(true) {
            out.push("spec.cdi.nriPluginEnabled".into());
        }
        if let Some(u) = self.upgrade_policy() {
            for k in u.unknown_fields() {
                out.push(format!("spec.driver.upgradePolicy.{k}"));
            }
        }
        out.sort();
        out.dedup();
        out
    }
}

/// The spec section name of a component (`devicePlugin`, `gfd`, ...).
pub fn section_name(c: Component) -> &'static str {
    match c {
        Component::Driver => "driver",
        Component::ContainerToolkit => "toolkit",
        Component::OperatorValidator => "validator",
        Component::DevicePlugin => "devicePlugin",
        Component::GpuFeatureDiscovery => "gfd",
        Component::DcgmExporter => "dcgmExporter",
        Component::MigManager => "migManager",
        Component::NodeStatusExporter => "nodeStatusExporter",
        Component::DraPlugin => "draDriver",
    }
}

/// Why `name` cannot be a DRA driver name (the kubelet plugin's own check:
/// a DNS subdomain of at most 63 characters, which also names its socket
/// directory), so a bad name is reported in status rather than by a
/// crash-looping pod.
fn check_dra_driver_name(name: &str) -> Result<(), &'static str> {
    if name.len() > 63 {
        return Err("it is longer than 63 characters");
    }
    for label in name.split('.') {
        if label.is_empty() {
            return Err("it has an empty label");
        }
        if !label
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            return Err("it may hold only lowercase letters, digits, '-' and '.'");
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err("a label starts or ends with '-'");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;

/// The ClusterPolicy CRD as YAML, generated from these types (what
/// `gpu-stack crdgen` prints and `deploy/crds/nvidia.com_clusterpolicies.yaml` holds).
pub fn crd_yaml() -> Result<String, serde_saphyr::SerializeError> {
    use kube::CustomResourceExt;
    serde_saphyr::to_string(&ClusterPolicy::crd())
}
