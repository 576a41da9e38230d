//! NVIDIADriver (`nvidia.com/v1alpha1`, cluster-scoped): per-node-pool driver
//! settings, the resource the NVIDIA operator uses when the ClusterPolicy sets
//! `driver.useNvidiaDriverCRD: true`.
//!
//! Every field of NVIDIA's `NVIDIADriverSpec` is typed under NVIDIA's name,
//! with the same defaults, enums and CEL rules (`driverType` and
//! `usePrecompiled` are immutable; a default driver has no `nodeSelector`),
//! so documents written for the NVIDIA operator apply unchanged. Fields the
//! driver rendering does not act on are listed by
//! [`NvidiaDriverSpec::unsupported_fields`] for `status.unsupportedFields`,
//! and fields unknown to both are kept and listed too, never dropped.
//!
//! Which resource owns which node, and whether a resource can be rolled out,
//! is decided in [`gpu_stack_core::operator::nvidiadriver`]; this module turns
//! resources into its inputs ([`NvidiaDriver::driver_cr`]) and its answers into
//! status conditions ([`conflict_condition`], [`refused_condition`]).
use std::collections::BTreeMap;

use gpu_stack_core::operator::driver::{DriverRequest, KernelModuleType};
use gpu_stack_core::operator::nvidiadriver::{
    DriverCr, DriverType, NvidiaDriverError, REASON_CONFLICTING_NODE_SELECTOR, Routing,
};
use gpu_stack_core::operator::upgrade::policy::UpgradePolicy;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::operator::clusterpolicy::status::Condition;
pub use crate::operator::clusterpolicy::{ContainerProbeSpec, DriverManagerSpec};
use crate::operator::clusterpolicy::{EnvVar, Extra, Resources, Toleration};

/// The image NVIDIA's CRD defaults `spec.image` to (a full path: with no
/// `repository`, it is used as is).
pub const DEFAULT_IMAGE: &str = "nvcr.io/nvidia/driver";

/// Spec of an NVIDIADriver.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "nvidia.com",
    version = "v1alpha1",
    kind = "NVIDIADriver",
    root = "NvidiaDriver",
    plural = "nvidiadrivers",
    shortname = "nvd",
    shortname = "nvdriver",
    shortname = "nvdrivers",
    status = "NvidiaDriverStatus",
    doc = "NVIDIADriver configures the driver of the GPU nodes its nodeSelector matches, or of every GPU node no other NVIDIADriver matches when it is the default.",
    printcolumn(name = "Status", type_ = "string", json_path = ".status.state"),
    printcolumn(name = "Default", type_ = "boolean", json_path = ".spec.default"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend(
    "x-kubernetes-preserve-unknown-fields" = true,
    "x-kubernetes-validations" = [{
        "rule": "has(self.default) && self.default ? !has(self.nodeSelector) || size(self.nodeSelector) == 0 : true",
        "message": "default NVIDIADriver must not use nodeSelector"
    }]
))]
pub struct NvidiaDriverSpec {
    /// This driver is the fallback for GPU nodes that no non-default
    /// NVIDIADriver's nodeSelector matches.
    #[serde(default)]
    pub default: bool,
    /// `gpu`, `vgpu` (guest) or `vgpu-host-manager`; immutable.
    #[serde(default)]
    #[schemars(schema_with = "driver_type_schema")]
    pub driver_type: DriverType,
    /// Use precompiled per-kernel driver images; immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "self == oldSelf",
        "message": "usePrecompiled is an immutable field. Please create a new NvidiaDriver resource instead when you want to change this setting."
    }]))]
    pub use_precompiled: Option<bool>,
    /// Deprecated no-op kept for old documents; use kernelModuleType.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_open_kernel_modules: Option<bool>,
    /// `auto` (the branch and the GPUs decide), `open` or `proprietary`.
    #[serde(default)]
    #[schemars(schema_with = "kernel_module_type_schema")]
    pub kernel_module_type: KernelModuleType,
    /// Driver container startup probe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub startup_probe: Option<ContainerProbeSpec>,
    /// Driver container liveness probe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub liveness_probe: Option<ContainerProbeSpec>,
    /// Driver container readiness probe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readiness_probe: Option<ContainerProbeSpec>,
    /// GPUDirect RDMA (nvidia-peermem).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma: Option<GpuDirectRdmaSpec>,
    /// GPUDirect Storage (nvidia-fs) driver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gds: Option<AddonDriverSpec>,
    /// GDRCopy driver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gdrcopy: Option<AddonDriverSpec>,
    /// Image registry and path; with none, `image` is a full path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repository: Option<String>,
    /// Driver image name, or a full path when `repository` is empty.
    #[serde(default = "default_image")]
    pub image: String,
    /// Driver version (a branch such as `570` with usePrecompiled) or a
    /// `sha256:` digest; the OS tag is appended to versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// `Always`, `IfNotPresent` or `Never`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    /// Pull secret names.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<String>,
    /// k8s-driver-manager init container image and env.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manager: Option<DriverManagerSpec>,
    /// Driver container resources.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Resources>,
    /// Extra driver container args.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// Extra driver container env.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    /// ConfigMap of custom package repository files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repo_config: Option<NamedRef>,
    /// ConfigMap of custom certificates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_config: Option<NamedRef>,
    /// vGPU licensing configuration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub licensing_config: Option<LicensingConfigSpec>,
    /// ConfigMap of the vGPU virtual topology daemon configuration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_topology_config: Option<NamedRef>,
    /// ConfigMap of kernel module parameters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_module_config: Option<NamedRef>,
    /// Secret whose keys become driver container env variables.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_env: Option<String>,
    /// How this resource's nodes are upgraded to a new driver: the
    /// ClusterPolicy's `driver.upgradePolicy` fields, with `autoUpgrade`
    /// defaulting to true as in NVIDIA's NVIDIADriver.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "auto_upgrade_by_default"
    )]
    #[schemars(schema_with = "nvidia_driver_upgrade_policy_schema")]
    pub upgrade_policy: Option<UpgradePolicy>,
    /// Labels of the GPU nodes this driver manages (empty: every GPU node).
    /// The reserved key `nvidia.com/gpu-operator.driver.owner` is refused.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Node affinity of the driver pods (a `core/v1` NodeAffinity).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
    pub node_affinity: Option<Value>,
    /// Labels added to the driver pods.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Annotations added to the driver pods.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Tolerations of the driver pods.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Priority class of the driver pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// Pod security context of the driver pods (a `core/v1` PodSecurityContext).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
    pub pod_security_context: Option<Value>,
    /// Run the driver pods in the host's network namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
    /// Fields neither NVIDIA's NVIDIADriver nor this one defines, kept verbatim.
    #[serde(flatten, default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(skip)]
    pub extra: Extra,
}

impl Default for NvidiaDriverSpec {
    fn default() -> Self {
        NvidiaDriverSpec {
            default: false,
            driver_type: DriverType::Gpu,
            use_precompiled: None,
            use_open_kernel_modules: None,
            kernel_module_type: KernelModuleType::Auto,
            startup_probe: None,
            liveness_probe: None,
            readiness_probe: None,
            rdma: None,
            gds: None,
            gdrcopy: None,
            repository: None,
            image: default_image(),
            version: None,
            image_pull_policy: None,
            image_pull_secrets: Vec::new(),
            manager: None,
            resources: None,
            args: Vec::new(),
            env: Vec::new(),
            repo_config: None,
            cert_config: None,
            licensing_config: None,
            virtual_topology_config: None,
            kernel_module_config: None,
            secret_env: None,
            upgrade_policy: None,
            node_selector: BTreeMap::new(),
            node_affinity: None,
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            tolerations: Vec::new(),
            priority_class_name: None,
            pod_security_context: None,
            host_network: None,
            extra: Extra::new(),
        }
    }
}

/// NVIDIA's NVIDIADriver defaults `autoUpgrade` to true; a document that
/// leaves it out (one the API server did not default, as in the in-memory
/// cluster) reads the same.
fn auto_upgrade_by_default<'de, D>(d: D) -> Result<Option<UpgradePolicy>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    let Some(mut v) = Option::<Value>::deserialize(d)? else {
        return Ok(None);
    };
    if let Value::Object(m) = &mut v
        && !matches!(m.get("autoUpgrade"), Some(Value::Bool(_)))
    {
        m.insert("autoUpgrade".into(), Value::Bool(true));
    }
    serde_json::from_value(v)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

fn nvidia_driver_upgrade_policy_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    crate::operator::clusterpolicy::upgrade_policy_schema_with(true)
}

fn default_image() -> String {
    DEFAULT_IMAGE.to_string()
}

fn driver_type_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "enum": ["gpu", "vgpu", "vgpu-host-manager"],
        "default": "gpu",
        "description": "`gpu`, `vgpu` (guest) or `vgpu-host-manager`; immutable.",
        "x-kubernetes-validations": [{
            "rule": "self == oldSelf",
            "message": "driverType is an immutable field. Please create a new NvidiaDriver resource instead when you want to change this setting."
        }]
    })
}

fn kernel_module_type_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "enum": ["auto", "open", "proprietary"],
        "default": "auto",
        "description": "`auto` (the branch and the GPUs decide), `open` or `proprietary`."
    })
}

fn state_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "enum": ["ignored", "ready", "notReady", "disabled"],
        "description": "`ready`, `notReady`, `disabled` or `ignored`."
    })
}

/// `spec.rdma`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuDirectRdmaSpec {
    /// Deploy nvidia-peermem.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Use the MOFED driver installed on the host.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "useHostMofed"
    )]
    pub use_host_mofed: Option<bool>,
}

/// `spec.gds` and `spec.gdrcopy`: an extra driver container.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AddonDriverSpec {
    /// Deploy this driver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
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
    /// Extra container args.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// Extra container env.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
}

/// A reference to a ConfigMap by name.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct NamedRef {
    /// ConfigMap name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// `spec.licensingConfig`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LicensingConfigSpec {
    /// Secret with the licensing configuration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_name: Option<String>,
    /// Deprecated: a ConfigMap with the licensing configuration; use secretName.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Licensing through the NVIDIA Licensing System.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "nlsEnabled"
    )]
    pub nls_enabled: Option<bool>,
}

/// State of an NVIDIADriver.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[serde(rename_all = "camelCase")]
pub enum NvidiaDriverState {
    /// The driver is ready on every node this resource owns.
    Ready,
    /// Some owned node's driver is not ready, or the resource is refused.
    #[default]
    NotReady,
    /// The ClusterPolicy does not delegate drivers to NVIDIADrivers.
    Disabled,
    /// Not acted on.
    Ignored,
}

impl NvidiaDriverState {
    /// The status value: `ready`, `notReady`, `disabled` or `ignored`.
    pub fn as_str(self) -> &'static str {
        match self {
            NvidiaDriverState::Ready => "ready",
            NvidiaDriverState::NotReady => "notReady",
            NvidiaDriverState::Disabled => "disabled",
            NvidiaDriverState::Ignored => "ignored",
        }
    }
}

/// Status of an NVIDIADriver.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NvidiaDriverStatus {
    /// `ready`, `notReady`, `disabled` or `ignored`.
    #[schemars(schema_with = "state_schema")]
    pub state: NvidiaDriverState,
    /// Namespace of the driver pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// `Ready` and `Error` conditions; `Error` with reason
    /// `ConflictingNodeSelector` when another NVIDIADriver claims some of the
    /// same nodes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Field paths present in the spec that this operator does not act on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unsupported_fields: Vec<String>,
    /// Generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

fn present_and_enabled(enabled: Option<Option<bool>>) -> bool {
    // Present with `enabled` unset or true; a disabled section changes nothing.
    matches!(enabled, Some(e) if e != Some(false))
}

impl NvidiaDriverSpec {
    /// The driver image request for the selection matrix, with NVIDIA's
    /// image rules: no `repository` makes `image` a full path.
    pub fn driver_request(&self) -> DriverRequest {
        let image = self.image.trim();
        DriverRequest {
            repository: self
                .repository
                .as_deref()
                .map(str::trim)
                .unwrap_or_default()
                .to_string(),
            image: if image.is_empty() {
                DEFAULT_IMAGE.to_string()
            } else {
                image.to_string()
            },
            version: self
                .version
                .as_deref()
                .map(str::trim)
                .unwrap_or_default()
                .to_string(),
            use_precompiled: self.use_precompiled.unwrap_or(false),
            kernel_module_type: self.kernel_module_type,
        }
    }

    /// The upgrade policy of this resource's nodes: the one written, or
    /// NVIDIA's NVIDIADriver default (automatic upgrades on, one node at a
    /// time, at most 25% unavailable) when there is none.
    pub fn upgrade_policy(&self) -> UpgradePolicy {
        self.upgrade_policy
            .clone()
            .unwrap_or_else(|| UpgradePolicy {
                auto_upgrade: true,
                ..UpgradePolicy::default()
            })
    }

    /// Field paths present in the document that the driver rendering does
    /// not act on, sorted. Disabled sections (`enabled: false`) are quiet.
    pub fn unsupported_fields(&self) -> Vec<String> {
        let mut out: Vec<String> = self.extra.keys().map(|k| format!("spec.{k}")).collect();
        if self.driver_type != DriverType::Gpu {
            out.push("spec.driverType".into());
        }
        let mut present = |name: &str, here: bool| {
            if here {
                out.push(format!("spec.{name}"));
            }
        };
        present("livenessProbe", self.liveness_probe.is_some());
        present("readinessProbe", self.readiness_probe.is_some());
        present(
            "rdma",
            present_and_enabled(self.rdma.as_ref().map(|r| r.enabled)),
        );
        present(
            "gds",
            present_and_enabled(self.gds.as_ref().map(|g| g.enabled)),
        );
        present(
            "gdrcopy",
            present_and_enabled(self.gdrcopy.as_ref().map(|g| g.enabled)),
        );
        present("repoConfig", self.repo_config.is_some());
        present("certConfig", self.cert_config.is_some());
        present("licensingConfig", self.licensing_config.is_some());
        present(
            "virtualTopologyConfig",
            self.virtual_topology_config.is_some(),
        );
        present("kernelModuleConfig", self.kernel_module_config.is_some());
        present(
            "secretEnv",
            self.secret_env.as_deref().is_some_and(|s| !s.is_empty()),
        );
        present("nodeAffinity", self.node_affinity.is_some());
        present("podSecurityContext", self.pod_security_context.is_some());
        present("hostNetwork", self.host_network == Some(true));
        if let Some(u) = &self.upgrade_policy {
            out.extend(
                u.unknown_fields()
                    .into_iter()
                    .map(|k| format!("spec.upgradePolicy.{k}")),
            );
        }
        out.sort();
        out.dedup();
        out
    }
}

impl NvidiaDriver {
    /// The resource's name (empty when the object has none).
    pub fn name(&self) -> &str {
        self.metadata.name.as_deref().unwrap_or_default()
    }

    /// Whether the resource is being deleted (routing leaves it out).
    pub fn is_deleting(&self) -> bool {
        self.metadata.deletion_timestamp.is_some()
    }

    /// The routing and validation input of this resource.
    pub fn driver_cr(&self) -> DriverCr {
        let req = self.spec.driver_request();
        DriverCr {
            name: self.name().to_string(),
            is_default: self.spec.default,
            node_selector: self.spec.node_selector.clone(),
            driver_type: self.spec.driver_type,
            version: req.version,
            kernel_module_type: req.kernel_module_type,
            use_precompiled: req.use_precompiled,
            upgrade_policy: self.spec.upgrade_policy(),
        }
    }
}

/// Routing inputs of the resources not being deleted, as the NVIDIA operator
/// leaves deleting resources out of routing.
pub fn driver_crs(drivers: &[NvidiaDriver]) -> Vec<DriverCr> {
    drivers
        .iter()
        .filter(|d| !d.is_deleting())
        .map(NvidiaDriver::driver_cr)
        .collect()
}

/// Condition types.
pub mod condition {
    /// The driver is ready on every owned node.
    pub const READY: &str = "Ready";
    /// The resource cannot be acted on as written.
    pub const ERROR: &str = "Error";
}

/// Condition reasons besides [`REASON_CONFLICTING_NODE_SELECTOR`].
pub mod reason {
    /// The spec is refused (selector rules, versions the GPUs cannot run).
    pub const INVALID_SPEC: &str = "InvalidSpec";
}

/// The `Error` condition with reason `ConflictingNodeSelector` for a
/// resource some of whose nodes another resource also claims, or `None`.
pub fn conflict_condition(routing: &Routing, cr: &str) -> Option<Condition> {
    routing.conflict_message(cr).map(|message| Condition {
        type_: condition::ERROR.into(),
        status: "True".into(),
        reason: REASON_CONFLICTING_NODE_SELECTOR.into(),
        message,
        last_transition_time: None,
    })
}

/// The `Error` condition for a refused resource (the problems joined, each
/// already capped), or `None` when there are none.
pub fn refused_condition(problems: &[NvidiaDriverError]) -> Option<Condition> {
    if problems.is_empty() {
        return None;
    }
    Some(Condition {
        type_: condition::ERROR.into(),
        status: "True".into(),
        reason: reason::INVALID_SPEC.into(),
        message: problems
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; "),
        last_transition_time: None,
    })
}

#[cfg(test)]
mod tests;

/// The NVIDIADriver CRD as YAML, generated from these types (what
/// `gpu-stack crdgen --kind nvidiadriver` prints and
/// `deploy/crds/nvidia.com_nvidiadrivers.yaml` holds).
pub fn crd_yaml() -> Result<String, serde_saphyr::SerializeError> {
    use kube::CustomResourceExt;
    serde_saphyr::to_string(&NvidiaDriver::crd())
}
