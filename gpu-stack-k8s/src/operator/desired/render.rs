//! Rendering of the objects the operator owns: namespace, service accounts,
//! RBAC, RuntimeClass, ConfigMaps and one DaemonSet per enabled component
//! (per driver pool for the driver).
//!
//! Here: the namespace, RuntimeClass, ConfigMaps, the exporter's Service and
//! the DaemonSets. In `render/`: `rbac` (each component's ServiceAccount,
//! ClusterRole and binding), `gates` (the init containers that gate a
//! component's start) and `node_agent` (the combined node agent's objects).
use std::collections::BTreeMap;

use gpu_stack_core::operator::components::{Component, VALIDATIONS_DIR};
use gpu_stack_core::operator::driver::{DriverPool, KernelModuleType};
use k8s_openapi::api::apps::v1::{
    DaemonSet, DaemonSetSpec, DaemonSetUpdateStrategy, RollingUpdateDaemonSet,
};
use k8s_openapi::api::core::v1::{
    Affinity, ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EnvVar, EnvVarSource,
    ExecAction, HTTPGetAction, HostPathVolumeSource, Lifecycle, LifecycleHandler, Namespace,
    NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, ObjectFieldSelector,
    PodSpec, PodTemplateSpec, Probe, ResourceRequirements, SecurityContext, Service, ServicePort,
    ServiceSpec, Toleration, Volume, VolumeMount,
};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::operator::cluster::object::{MANAGED_BY, MANAGED_BY_LABEL, Object};
use crate::operator::clusterpolicy::{
    ClusterPolicy, ClusterPolicySpec, ComponentSpec, ContainerProbeSpec, DriverManagerSpec,
    DriverSpec,
};
use crate::operator::nvidiadriver::NvidiaDriver;
use gpu_stack_core::operator::nvidiadriver::OWNER_LABEL;

pub mod gates;
mod node_agent;
pub mod rbac;
pub use node_agent::{NODE_AGENT_COMPONENT, NODE_AGENT_NAME, node_agent_objects};

/// The key of the mig-parted file in its ConfigMap.
pub const MIG_PARTED_CONFIG_KEY: &str = "config.yaml";

/// The default mig-parted configuration shipped as the
/// `default-mig-parted-config` ConfigMap.
pub const DEFAULT_MIG_PARTED_CONFIG: &str = gpu_stack_core::migparted::DEFAULT_CONFIG_YAML;
/// Label naming the component on every object.
pub const COMPONENT_LABEL: &str = "nvidia.com/gpu-stack.component";
/// Label on per-pool driver DaemonSets built from precompiled images.
pub const PRECOMPILED_LABEL: &str = "nvidia.com/precompiled";
/// The entrypoint of the validator image (`gpu-stack`), for exec probes:
/// the image is distroless, there is no shell to find it.
pub const GPU_STACK_BIN: &str = "/usr/bin/gpu-stack";
/// Port of the node status exporter's `/metrics` (NVIDIA's node-status port).
pub const NODE_STATUS_PORT: i32 = 8000;

/// Common context of every rendered object.
pub struct RenderContext<'a> {
    /// The policy.
    pub policy: &'a ClusterPolicy,
    /// Operand namespace.
    pub namespace: &'a str,
}

impl RenderContext<'_> {
    fn spec(&self) -> &ClusterPolicySpec {
        &self.policy.spec
    }

    /// The owner references of every object but the Namespace: the policy.
    pub(crate) fn owner(&self) -> Option<Vec<OwnerReference>> {
        let uid = self.policy.metadata.uid.clone()?;
        Some(vec![OwnerReference {
            api_version: "nvidia.com/v1".into(),
            kind: "ClusterPolicy".into(),
            name: self.policy.metadata.name.clone().unwrap_or_default(),
            uid,
            controller: Some(true),
            block_owner_deletion: Some(true),
        }])
    }

    fn meta(&self, name: &str, namespaced: bool, component: Option<Component>) -> ObjectMeta {
        let mut labels = BTreeMap::new();
        labels.insert(MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string());
        labels.insert(
            "app.kubernetes.io/part-of".to_string(),
            "gpu-stack".to_string(),
        );
        if let Some(c) = component {
            labels.insert(
                COMPONENT_LABEL.to_string(),
                c.deploy_label_suffix().to_string(),
            );
        }
        ObjectMeta {
            name: Some(name.to_string()),
            namespace: namespaced.then(|| self.namespace.to_string()),
            labels: Some(labels),
            owner_references: self.owner(),
            ..Default::default()
        }
    }
}

/// The operand namespace, with Pod Security Admission labels when `psa.enabled`.
pub fn namespace(ctx: &RenderContext) -> Object {
    let mut meta = ctx.meta(ctx.namespace, false, None);
    // The namespace outlives the policy: no owner reference.
    meta.owner_references = None;
    if ctx
        .spec()
        .psa
        .as_ref()
        .and_then(|p| p.enabled)
        .unwrap_or(false)
        && let Some(l) = meta.labels.as_mut()
    {
        for mode in ["enforce", "audit", "warn"] {
            l.insert(
                format!("pod-security.kubernetes.io/{mode}"),
                "privileged".into(),
            );
        }
    }
    Object::Namespace(Namespace {
        metadata: meta,
        ..Default::default()
    })
}

/// The RuntimeClass operand pods use.
pub fn runtime_class(ctx: &RenderContext) -> Object {
    let name = ctx.spec().runtime_class();
    Object::RuntimeClass(RuntimeClass {
        metadata: ctx.meta(&name, false, None),
        handler: name.clone(),
        ..Default::default()
    })
}

/// NVIDIA's name, port name and port of the exporter's Service, which
/// Prometheus scrape configs and ServiceMonitors written for NVIDIA's stack
/// select.
pub const EXPORTER_SERVICE: &str = "nvidia-dcgm-exporter";
const EXPORTER_PORT_NAME: &str = "gpu-metrics";
const EXPORTER_PORT: i32 = 9400;

/// The exporter's metrics Service, as NVIDIA's operator makes it (ClusterIP,
/// `prometheus.io/scrape`), selecting the exporter's pods, or the node
/// agent's where it hosts the exporter. `dcgmExporter.service.type` and
/// `.internalTrafficPolicy` are NVIDIA's knobs.
pub fn exporter_service(ctx: &RenderContext, hosted_by_node_agent: bool) -> Object {
    let mut metadata = ctx.meta(EXPORTER_SERVICE, true, Some(Component::DcgmExporter));
    if let Some(labels) = metadata.labels.as_mut() {
        labels.insert("app".into(), EXPORTER_SERVICE.into());
    }
    metadata.annotations = Some([("prometheus.io/scrape".to_string(), "true".to_string())].into());
    let app = if hosted_by_node_agent {
        node_agent::NODE_AGENT_NAME.to_string()
    } else {
        Component::DcgmExporter.daemonset_name().to_string()
    };
    let knobs = ctx.spec().exporter_service();
    Object::Service(Service {
        metadata,
        spec: Some(ServiceSpec {
            type_: Some(knobs.type_.unwrap_or_else(|| "ClusterIP".into())),
            internal_traffic_policy: knobs.internal_traffic_policy,
            selector: Some([("app".to_string(), app)].into()),
            ports: Some(vec![ServicePort {
                name: Some(EXPORTER_PORT_NAME.into()),
                port: EXPORTER_PORT,
                target_port: Some(IntOrString::Int(EXPORTER_PORT)),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// The default mig-parted config ConfigMap.
pub fn mig_parted_config(ctx: &RenderContext) -> Object {
    mig_parted_config_with(ctx, "")
}

/// The mig-parted ConfigMap with `generated` (mig-parted configs as YAML
/// lines under `mig-configs:`, from MigConfigs) after the shipped file.
pub fn mig_parted_config_with(ctx: &RenderContext, generated: &str) -> Object {
    Object::ConfigMap(ConfigMap {
        metadata: ctx.meta(
            &ctx.spec().mig_config_name(),
            true,
            Some(Component::MigManager),
        ),
        data: Some(
            [(
                MIG_PARTED_CONFIG_KEY.to_string(),
                format!("{DEFAULT_MIG_PARTED_CONFIG}{generated}"),
            )]
            .into(),
        ),
        ..Default::default()
    })
}

fn env(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.into()),
        ..Default::default()
    }
}

fn node_name_env() -> EnvVar {
    field_env("NODE_NAME", "spec.nodeName")
}

/// A variable from the downward API.
fn field_env(name: &str, field_path: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: field_path.into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn host_volume(name: &str, path: &str, kind: Option<&str>) -> Volume {
    Volume {
        name: name.into(),
        host_path: Some(HostPathVolumeSource {
            path: path.into(),
            type_: kind.map(Into::into),
        }),
        ..Default::default()
    }
}

fn mount(name: &str, path: &str, read_only: bool, propagation: Option<&str>) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only: read_only.then_some(true),
        mount_propagation: propagation.map(Into::into),
        ..Default::default()
    }
}

fn privileged() -> Option<SecurityContext> {
    Some(SecurityContext {
        privileged: Some(true),
        ..Default::default()
    })
}

const VALIDATIONS_VOLUME: &str = "run-nvidia-validations";
const DRIVER_ROOT_VOLUME: &str = "driver-install-dir";
const HOST_ROOT_VOLUME: &str = "host-root";
/// The host's /dev/char, where the driver check links NVIDIA's device nodes.
const HOST_DEV_CHAR_VOLUME: &str = "host-dev-char";
/// Where the driver check sees it (NVIDIA's path).
const HOST_DEV_CHAR_DIR: &str = "/host-dev-char";
/// Where the device plugin's pod sees the host's driver root.
const PLUGIN_DRIVER_ROOT: &str = "/driver-root";
/// Where container runtimes read CDI specs (the DRA plugin writes one per claim).
const CDI_DIR: &str = "/var/run/cdi";

/// The kubelet's root directory (`hostPaths.kubeletRootDir`).
fn kubelet_root_dir(spec: &ClusterPolicySpec) -> String {
    spec.host_paths
        .as_ref()
        .and_then(|h| h.kubelet_root_dir.clone())
        .unwrap_or_else(|| "/var/lib/kubelet".into())
}

/// The DRA plugin's directories under the kubelet's root: `(plugins,
/// registry)`. The pod mounts them at the host's own paths, because the
/// plugin registers its socket with the kubelet by absolute path.
fn dra_plugin_dirs(spec: &ClusterPolicySpec) -> (String, String) {
    let root = kubelet_root_dir(spec);
    let root = root.trim_end_matches('/');
    (
        format!("{root}/plugins"),
        format!("{root}/plugins_registry"),
    )
}

/// The host's driver root (`hostPaths.driverInstallDir`).
fn driver_install_dir(spec: &ClusterPolicySpec) -> String {
    spec.host_paths
        .as_ref()
        .and_then(|h| h.driver_install_dir.clone())
        .unwrap_or_else(|| "/run/nvidia/driver".into())
}

/// Host paths that show a toolkit installed outside the operator, or a
/// runtime reading CDI specs: NVIDIA's runtime, its containerd drop-in, its
/// CDI spec, and the CDI spec directories themselves.
const PREINSTALLED_TOOLKIT_TRACES: [&str; 5] = [
    "/usr/bin/nvidia-container-runtime",
    "/etc/containerd/conf.d/99-nvidia.toml",
    "/etc/cdi/nvidia.yaml",
    "/etc/cdi",
    "/run/cdi",
];
/// The runtime's socket (host path) the toolkit check asks: NVIDIA's
/// `CONTAINERD_SOCKET` from `toolkit.env` when set.
fn toolkit_socket(spec: &ClusterPolicySpec) -> String {
    spec.component(Component::ContainerToolkit)
        .and_then(|c| c.env.iter().find(|e| e.name == "CONTAINERD_SOCKET"))
        .map(|e| e.value.clone())
        .filter(|v| v.starts_with('/'))
        .unwrap_or_else(|| "/run/containerd/containerd.sock".into())
}

/// Well-known node label carrying the node name; used to keep refused nodes
/// out of a driver pool.
const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";

fn tolerations(spec: &ClusterPolicySpec) -> Vec<Toleration> {
    match spec
        .daemonsets
        .as_ref()
        .and_then(|d| d.tolerations.as_ref())
    {
        Some(ts) => ts
            .iter()
            .map(|t| Toleration {
                key: t.key.clone(),
                operator: t.operator.clone(),
                value: t.value.clone(),
                effect: t.effect.clone(),
                toleration_seconds: t.toleration_seconds,
            })
            .collect(),
        None => vec![Toleration {
            key: Some("nvidia.com/gpu".into()),
            operator: Some("Exists".into()),
            effect: Some("NoSchedule".into()),
            ..Default::default()
        }],
    }
}

fn resources(spec: &ClusterPolicySpec, c: Component) -> Option<ResourceRequirements> {
    section_resources(spec.component(c))
}

/// The `resources` of a policy section as a container's.
fn section_resources(section: Option<&ComponentSpec>) -> Option<ResourceRequirements> {
    let r = section?.resources.as_ref()?;
    let q = |m: &BTreeMap<String, String>| {
        (!m.is_empty()).then(|| {
            m.iter()
                .map(|(k, v)| (k.clone(), Quantity(v.clone())))
                .collect::<BTreeMap<_, _>>()
        })
    };
    Some(ResourceRequirements {
        limits: q(&r.limits),
        requests: q(&r.requests),
        ..Default::default()
    })
}

/// Main-container env specific to a component (before user env).
fn component_env(ctx: &RenderContext, c: Component, pool: Option<&DriverPool>) -> Vec<EnvVar> {
    let spec = ctx.spec();
    let mut out = vec![node_name_env()];
    match c {
        Component::Driver => {
            if let Some(p) = pool {
                out.push(env("KERNEL_MODULE_TYPE", p.kernel_module_type.as_str()));
                if p.kernel_module_type == KernelModuleType::Open {
                    out.push(env("OPEN_KERNEL_MODULES_ENABLED", "true"));
                }
            }
        }
        Component::ContainerToolkit if spec.toolkit_is_gpu_stack() => {
            // `gpu-stack toolkit` reads NVIDIA's toolkit variables; the pod's
            // identity lets it tell a removal from a restart at SIGTERM.
            out.push(env("RUNTIME", "containerd"));
            out.push(env("CONTAINERD_RUNTIME_CLASS", spec.runtime_class()));
            out.push(env("NVIDIA_DRIVER_ROOT", driver_install_dir(spec)));
            out.push(field_env("POD_NAME", "metadata.name"));
            out.push(field_env("POD_NAMESPACE", "metadata.namespace"));
        }
        Component::ContainerToolkit => {
            out.push(env("CDI_ENABLED", spec.cdi_enabled().to_string()));
            out.push(env("NVIDIA_RUNTIME_SET_AS_DEFAULT", "false"));
            out.push(env("CONTAINERD_RUNTIME_CLASS", spec.runtime_class()));
            out.push(env("TOOLKIT_INSTALL_DIR", toolkit_install_dir(spec)));
        }
        Component::DevicePlugin | Component::GpuFeatureDiscovery => {
            out.push(env("MIG_STRATEGY", spec.mig_strategy()));
            if c == Component::DevicePlugin {
                // The CDI spec names host paths; the plugin finds the files
                // where its pod mounts the driver root (NVIDIA's variables).
                out.push(env("NVIDIA_DRIVER_ROOT", driver_install_dir(spec)));
                out.push(env("CONTAINER_DRIVER_ROOT", PLUGIN_DRIVER_ROOT));
                if spec.cdi_enabled() {
                    out.extend(device_plugin_cdi_env(spec));
                }
            }
        }
        Component::DraPlugin => {
            let (plugins, registry) = dra_plugin_dirs(spec);
            out.push(env("DRA_DRIVER_NAME", spec.dra_driver_name()));
            out.push(env("KUBELET_PLUGINS_DIR", plugins));
            out.push(env("KUBELET_REGISTRY_DIR", registry));
            out.push(env("CDI_SPEC_DIR", CDI_DIR));
            // The claims' CDI specs name host paths; the plugin finds the
            // files where its pod mounts the driver root, as the device
            // plugin does.
            out.push(env("NVIDIA_DRIVER_ROOT", driver_install_dir(spec)));
            out.push(env("CONTAINER_DRIVER_ROOT", PLUGIN_DRIVER_ROOT));
        }
        Component::MigManager => {
            out.push(env("CONFIG_FILE", "/mig-parted-config/config.yaml"));
            out.push(env("DEFAULT_MIG_CONFIG", spec.mig_config_default()));
            out.push(env("WITH_REBOOT", "false"));
        }
        Component::OperatorValidator | Component::DcgmExporter | Component::NodeStatusExporter => {}
    }
    with_user_env(&mut out, spec, c);
    out
}

/// With CDI on (`cdi.enabled`, the default), NVIDIA's rule: the device
/// plugin names its devices through CDI, so containerd injects them into any
/// pod, whatever its RuntimeClass (with `envvar` a pod on plain runc would
/// get `NVIDIA_VISIBLE_DEVICES` and no device node). NVIDIA's toolkit
/// installs the CDI hook under its install dir; the spec names it there.
fn device_plugin_cdi_env(spec: &ClusterPolicySpec) -> Vec<EnvVar> {
    let mut out = vec![
        env("DEVICE_LIST_STRATEGY", "cdi-annotations,cdi-cri"),
        env("CDI_ANNOTATION_PREFIX", "cdi.k8s.io/"),
    ];
    if spec.enablement().toolkit && !spec.toolkit_is_gpu_stack() {
        out.push(env(
            "NVIDIA_CDI_HOOK_PATH",
            format!("{}/toolkit/nvidia-cdi-hook", toolkit_install_dir(spec)),
        ));
    }
    out
}

/// Where NVIDIA's toolkit installs itself on the host (`toolkit.installDir`).
fn toolkit_install_dir(spec: &ClusterPolicySpec) -> String {
    spec.toolkit
        .as_ref()
        .and_then(|t| t.install_dir.clone())
        .unwrap_or_else(|| "/usr/local/nvidia".into())
}

/// A component's `env` from the policy, overriding by name.
fn with_user_env(out: &mut Vec<EnvVar>, spec: &ClusterPolicySpec, c: Component) {
    if let Some(cs) = spec.component(c) {
        merge_env(out, &cs.env);
    }
}

/// Whether a component's `env` from the policy names a path in the
/// validations directory.
fn user_env_names_validations_dir(spec: &ClusterPolicySpec, c: Component) -> bool {
    let prefix = format!("{VALIDATIONS_DIR}/");
    spec.component(c)
        .is_some_and(|cs| cs.env.iter().any(|e| e.value.starts_with(&prefix)))
}

/// Adds the user's `env` to `out`, each replacing a variable of its name.
fn merge_env(out: &mut Vec<EnvVar>, user: &[crate::operator::clusterpolicy::EnvVar]) {
    for e in user {
        out.retain(|x| x.name != e.name);
        out.push(env(&e.name, e.value.clone()));
    }
}

/// A probe's timing: the fields `given` sets over `defaults`.
fn probe_timing(given: Option<&ContainerProbeSpec>, defaults: ContainerProbeSpec) -> Probe {
    let g = given.cloned().unwrap_or_default();
    Probe {
        initial_delay_seconds: g.initial_delay_seconds.or(defaults.initial_delay_seconds),
        period_seconds: g.period_seconds.or(defaults.period_seconds),
        failure_threshold: g.failure_threshold.or(defaults.failure_threshold),
        timeout_seconds: g.timeout_seconds.or(defaults.timeout_seconds),
        success_threshold: g.success_threshold.or(defaults.success_threshold),
        ..Default::default()
    }
}

/// Volumes and main-container mounts of a component.
fn volumes(ctx: &RenderContext, c: Component) -> (Vec<Volume>, Vec<VolumeMount>) {
    let spec = ctx.spec();
    let hp = spec.host_paths.clone().unwrap_or_default();
    let driver_root = driver_install_dir(spec);
    let root_fs = hp.root_fs.unwrap_or_else(|| "/".into());
    let kubelet = kubelet_root_dir(spec);
    let mut vols = vec![
        host_volume(
            VALIDATIONS_VOLUME,
            VALIDATIONS_DIR,
            Some("DirectoryOrCreate"),
        ),
        host_volume(DRIVER_ROOT_VOLUME, &driver_root, Some("DirectoryOrCreate")),
        host_volume(HOST_ROOT_VOLUME, &root_fs, None),
        host_volume(HOST_DEV_CHAR_VOLUME, "/dev/char", Some("DirectoryOrCreate")),
    ];
    let mut mounts = vec![mount(
        VALIDATIONS_VOLUME,
        VALIDATIONS_DIR,
        false,
        Some("HostToContainer"),
    )];
    match c {
        Component::Driver => {
            mounts[0].mount_propagation = Some("Bidirectional".into());
            mounts.push(mount(
                DRIVER_ROOT_VOLUME,
                "/run/nvidia/driver",
                false,
                Some("Bidirectional"),
            ));
            mounts.push(mount(
                HOST_ROOT_VOLUME,
                "/host",
                true,
                Some("HostToContainer"),
            ));
            vols.push(host_volume("dev-log", "/dev/log", None));
            mounts.push(mount("dev-log", "/dev/log", false, None));
        }
        Component::ContainerToolkit if spec.toolkit_is_gpu_stack() => {
            // The agent edits the runtime's config and writes the CDI spec
            // through the host root, resolving the host's symlinks (such as
            // /var/run -> /run) inside it.
            mounts.push(mount(
                HOST_ROOT_VOLUME,
                "/host",
                false,
                Some("HostToContainer"),
            ));
        }
        Component::ContainerToolkit => {
            let dir = spec
                .toolkit
                .as_ref()
                .and_then(|t| t.install_dir.clone())
                .unwrap_or_else(|| "/usr/local/nvidia".into());
            vols.push(host_volume(
                "toolkit-install-dir",
                &dir,
                Some("DirectoryOrCreate"),
            ));
            vols.push(host_volume(
                "containerd-config",
                "/etc/containerd",
                Some("DirectoryOrCreate"),
            ));
            vols.push(host_volume("containerd-socket", "/run/containerd", None));
            vols.push(host_volume(
                "cdi-root",
                "/var/run/cdi",
                Some("DirectoryOrCreate"),
            ));
            mounts.push(mount(
                "toolkit-install-dir",
                "/usr/local/nvidia",
                false,
                None,
            ));
            mounts.push(mount(
                "containerd-config",
                "/runtime/config-dir",
                false,
                None,
            ));
            mounts.push(mount("containerd-socket", "/runtime/sock-dir", false, None));
            mounts.push(mount("cdi-root", "/var/run/cdi", false, None));
            mounts.push(mount(
                DRIVER_ROOT_VOLUME,
                "/run/nvidia/driver",
                false,
                Some("HostToContainer"),
            ));
            mounts.push(mount(
                HOST_ROOT_VOLUME,
                "/host",
                true,
                Some("HostToContainer"),
            ));
        }
        Component::DevicePlugin => {
            vols.push(host_volume(
                "device-plugin",
                &format!("{kubelet}/device-plugins"),
                None,
            ));
            vols.push(host_volume(
                "cdi-root",
                "/var/run/cdi",
                Some("DirectoryOrCreate"),
            ));
            mounts.push(mount(
                "device-plugin",
                "/var/lib/kubelet/device-plugins",
                false,
                None,
            ));
            mounts.push(mount("cdi-root", "/var/run/cdi", false, None));
            mounts.push(mount(
                DRIVER_ROOT_VOLUME,
                PLUGIN_DRIVER_ROOT,
                true,
                Some("HostToContainer"),
            ));
        }
        Component::DraPlugin => {
            // NVIDIA's kubelet plugin mounts: the registration directory
            // holds only sockets, so a plain bind does (as the device
            // plugin's); the plugins directory also holds the kubelet's own
            // mounts (CSI), so it is Bidirectional, which lets their
            // unmounts reach the pod. The MIG capability minors are read
            // from /proc, which a privileged container sees as the host's,
            // as the device plugin does.
            let (plugins, registry) = dra_plugin_dirs(spec);
            vols.push(host_volume("plugins", &plugins, Some("DirectoryOrCreate")));
            vols.push(host_volume(
                "plugins-registry",
                &registry,
                Some("DirectoryOrCreate"),
            ));
            vols.push(host_volume("cdi-root", CDI_DIR, Some("DirectoryOrCreate")));
            mounts.push(mount("plugins", &plugins, false, Some("Bidirectional")));
            mounts.push(mount("plugins-registry", &registry, false, None));
            mounts.push(mount("cdi-root", CDI_DIR, false, None));
            mounts.push(mount(
                DRIVER_ROOT_VOLUME,
                PLUGIN_DRIVER_ROOT,
                true,
                Some("HostToContainer"),
            ));
        }
        Component::DcgmExporter => {
            vols.push(host_volume(
                "pod-resources",
                &format!("{kubelet}/pod-resources"),
                None,
            ));
            mounts.push(mount(
                "pod-resources",
                "/var/lib/kubelet/pod-resources",
                true,
                None,
            ));
        }
        Component::MigManager => {
            vols.push(Volume {
                name: "mig-parted-config".into(),
                config_map: Some(ConfigMapVolumeSource {
                    name: spec.mig_config_name(),
                    ..Default::default()
                }),
                ..Default::default()
            });
            mounts.push(mount("mig-parted-config", "/mig-parted-config", true, None));
            mounts.push(mount(
                HOST_ROOT_VOLUME,
                "/host",
                false,
                Some("HostToContainer"),
            ));
            mounts.push(mount(
                DRIVER_ROOT_VOLUME,
                "/run/nvidia/driver",
                true,
                Some("HostToContainer"),
            ));
        }
        Component::GpuFeatureDiscovery
        | Component::NodeStatusExporter
        | Component::OperatorValidator => {
            mounts.push(mount(
                DRIVER_ROOT_VOLUME,
                "/run/nvidia/driver",
                true,
                Some("HostToContainer"),
            ));
        }
    }
    if matches!(
        c,
        Component::DevicePlugin
            | Component::GpuFeatureDiscovery
            | Component::DcgmExporter
            | Component::MigManager
            | Component::DraPlugin
    ) && !user_env_names_validations_dir(spec, c)
    {
        // These agents read no status file (their init containers wait for
        // them); the mount would only weigh on every pod. It stays when the
        // user's env points the agent at a file there (a simulated GPU
        // host's fleet and state files, shared by every operand).
        mounts.retain(|m| m.name != VALIDATIONS_VOLUME);
    }
    (vols, mounts)
}

/// A gpu-stack subcommand's arguments followed by the user's `args` from
/// the policy (which otherwise replace the container's arguments).
fn with_user_args(mut subcommand: Vec<String>, user: Option<Vec<String>>) -> Vec<String> {
    subcommand.extend(user.unwrap_or_default());
    subcommand
}

/// One DaemonSet of a component; for the driver, one per pool.
pub fn daemonset(ctx: &RenderContext, c: Component, pool: Option<&DriverPool>) -> Object {
    let spec = ctx.spec();
    let name = match pool {
        Some(p) => p.name.clone(),
        None => c.daemonset_name().to_string(),
    };
    let image = match pool {
        Some(p) => p.image.clone(),
        None => spec.image_settings(c).image,
    };
    let settings = spec.image_settings(c);
    let mut pod_labels: BTreeMap<String, String> = BTreeMap::new();
    pod_labels.insert("app".into(), name.clone());
    pod_labels.insert("app.kubernetes.io/part-of".into(), "gpu-stack".into());
    pod_labels.insert(COMPONENT_LABEL.into(), c.deploy_label_suffix().into());
    let ds_spec = spec.daemonsets.clone().unwrap_or_default();
    for (k, v) in &ds_spec.labels {
        pod_labels.entry(k.clone()).or_insert_with(|| v.clone());
    }
    let mut node_selector = BTreeMap::new();
    node_selector.insert(c.deploy_label(), "true".to_string());
    let mut affinity = None;
    if let Some(p) = pool {
        node_selector.extend(p.selector.clone());
        if !p.excluded.is_empty() {
            affinity = Some(Affinity {
                node_affinity: Some(NodeAffinity {
                    required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                        node_selector_terms: vec![NodeSelectorTerm {
                            // A field selector on metadata.name takes exactly one
                            // value with NotIn; the hostname label takes many.
                            match_expressions: Some(vec![NodeSelectorRequirement {
                                key: HOSTNAME_LABEL.into(),
                                operator: "NotIn".into(),
                                values: Some(p.excluded.clone()),
                            }]),
                            ..Default::default()
                        }],
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            });
        }
    }
    let (mut vols, mounts) = volumes(ctx, c);
    let mut init = gates::gate_containers(ctx, c.gates());
    let mut main = Container {
        name: c
            .daemonset_name()
            .trim_end_matches("-daemonset")
            .to_string(),
        image: Some(image),
        image_pull_policy: Some(settings.pull_policy.clone()),
        args: spec
            .component(c)
            .map(|s| s.args.clone())
            .filter(|a| !a.is_empty()),
        env: Some(component_env(ctx, c, pool)),
        resources: resources(spec, c),
        volume_mounts: Some(mounts),
        ..Default::default()
    };
    let mut host_pid = None;
    match c {
        Component::Driver => {
            let manager = spec.driver.as_ref().and_then(|d| d.manager.as_ref());
            let mut manager_env = vec![
                node_name_env(),
                env("NVIDIA_VISIBLE_DEVICES", "void"),
                env("ENABLE_GPU_POD_EVICTION", "true"),
                env("ENABLE_AUTO_DRAIN", "false"),
            ];
            if let Some(m) = manager {
                merge_env(&mut manager_env, &m.env);
            }
            init.insert(
                0,
                Container {
                    name: "k8s-driver-manager".into(),
                    image: Some(DriverManagerSpec::image_reference(manager)),
                    image_pull_policy: Some(
                        manager
                            .and_then(|m| m.image_pull_policy.clone())
                            .unwrap_or_else(|| "IfNotPresent".into()),
                    ),
                    command: Some(vec!["driver-manager".into()]),
                    args: Some(vec!["uninstall_driver".into()]),
                    env: Some(manager_env),
                    security_context: privileged(),
                    volume_mounts: Some(vec![
                        mount(
                            DRIVER_ROOT_VOLUME,
                            "/run/nvidia/driver",
                            false,
                            Some("Bidirectional"),
                        ),
                        mount(HOST_ROOT_VOLUME, "/host", true, Some("HostToContainer")),
                    ]),
                    ..Default::default()
                },
            );
            main.security_context = privileged();
            let ready = format!("{VALIDATIONS_DIR}/.driver-ctr-ready");
            main.startup_probe = Some(Probe {
                exec: Some(ExecAction {
                    command: Some(vec![
                        "sh".into(),
                        "-c".into(),
                        format!("nvidia-smi && touch {ready}"),
                    ]),
                }),
                ..probe_timing(
                    spec.driver.as_ref().and_then(|d| d.startup_probe.as_ref()),
                    ContainerProbeSpec {
                        initial_delay_seconds: Some(60),
                        period_seconds: Some(10),
                        failure_threshold: Some(120),
                        timeout_seconds: Some(60),
                        success_threshold: None,
                    },
                )
            });
            main.lifecycle = Some(Lifecycle {
                pre_stop: Some(LifecycleHandler {
                    exec: Some(ExecAction {
                        command: Some(vec![
                            "sh".into(),
                            "-c".into(),
                            format!("rm -f {ready} {VALIDATIONS_DIR}/.driver-daemons-status"),
                        ]),
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            });
            host_pid = Some(true);
        }
        Component::ContainerToolkit
        | Component::MigManager
        | Component::DevicePlugin
        | Component::DraPlugin => {
            main.security_context = privileged();
            if c == Component::MigManager {
                host_pid = Some(true);
            }
            if c == Component::ContainerToolkit && spec.toolkit_is_gpu_stack() {
                // The runtime is restarted by a signal to the process
                // behind its socket, so the agent sees the host's pids.
                host_pid = Some(true);
                main.args = Some(with_user_args(
                    vec!["toolkit".into(), "--host-root".into(), "/host".into()],
                    main.args.take(),
                ));
            }
        }
        Component::OperatorValidator => {
            // Holds after the init chain passed; on SIGTERM it removes the
            // `*-ready` files itself (NVIDIA's preStop `rm -f .../*-ready`),
            // as the image has no shell.
            main.args = Some(with_user_args(
                vec!["validator".into(), "--hold".into()],
                main.args.take(),
            ));
            // Ready while every status file of the init chain is there.
            let checked: Vec<&str> = c
                .gates()
                .iter()
                .filter_map(|g| g.validator_component())
                .collect();
            let mut probe = vec![GPU_STACK_BIN.to_string()];
            probe.extend(gates::wait_only_args(&checked.join(","), "0"));
            main.readiness_probe = Some(Probe {
                exec: Some(ExecAction {
                    command: Some(probe),
                }),
                period_seconds: Some(10),
                timeout_seconds: Some(5),
                ..Default::default()
            });
        }
        Component::GpuFeatureDiscovery => {
            // Labels go straight onto the Node (its role may patch nodes), so
            // no NFD worker is needed to apply them (`--output-file` in the
            // policy's args adds NFD's feature file).
            main.args = Some(with_user_args(vec!["--publish".into()], main.args.take()));
        }
        Component::NodeStatusExporter => {
            main.args = Some(with_user_args(
                vec![
                    "node-status-exporter".into(),
                    "--listen".into(),
                    format!("0.0.0.0:{NODE_STATUS_PORT}"),
                ],
                main.args.take(),
            ));
            main.ports = Some(vec![ContainerPort {
                name: Some("node-status".into()),
                container_port: NODE_STATUS_PORT,
                ..Default::default()
            }]);
        }
        Component::DcgmExporter => {
            // NVIDIA's probes and timings: `/health` fails until the first
            // sample is rendered and again once the exporter is wedged.
            let health = |period| Probe {
                http_get: Some(HTTPGetAction {
                    path: Some("/health".into()),
                    port: IntOrString::Int(EXPORTER_PORT),
                    scheme: Some("HTTP".into()),
                    ..Default::default()
                }),
                initial_delay_seconds: Some(45),
                period_seconds: Some(period),
                failure_threshold: Some(3),
                success_threshold: Some(1),
                timeout_seconds: Some(1),
                ..Default::default()
            };
            main.liveness_probe = Some(health(5));
            main.readiness_probe = Some(health(10));
        }
    }
    // Every pod carries its volumes: keep only those a container mounts.
    vols.retain(|v| {
        init.iter()
            .chain(std::iter::once(&main))
            .flat_map(|c| c.volume_mounts.iter().flatten())
            .any(|m| m.name == v.name)
    });
    // Operands other than the driver and the toolkit run through the NVIDIA runtime.
    let runtime_class = (!matches!(c, Component::Driver | Component::ContainerToolkit))
        .then(|| spec.runtime_class());
    let update_strategy = if c == Component::Driver {
        // Driver pods are replaced by the upgrade flow, never by a rolling update.
        DaemonSetUpdateStrategy {
            type_: Some("OnDelete".into()),
            ..Default::default()
        }
    } else {
        match ds_spec.update_strategy.as_deref() {
            Some("OnDelete") => DaemonSetUpdateStrategy {
                type_: Some("OnDelete".into()),
                ..Default::default()
            },
            _ => {
                let mu = ds_spec
                    .rolling_update
                    .as_ref()
                    .and_then(|r| r.max_unavailable.clone())
                    .unwrap_or_else(|| "1".into());
                let mu = match mu.parse::<i32>() {
                    Ok(n) => IntOrString::Int(n),
                    Err(_) => IntOrString::String(mu),
                };
                DaemonSetUpdateStrategy {
                    type_: Some("RollingUpdate".into()),
                    rolling_update: Some(RollingUpdateDaemonSet {
                        max_unavailable: Some(mu),
                        ..Default::default()
                    }),
                }
            }
        }
    };
    let mut meta = ctx.meta(&name, true, Some(c));
    if let Some(p) = pool
        && p.kernel.is_some()
        && let Some(l) = meta.labels.as_mut()
    {
        l.insert(PRECOMPILED_LABEL.into(), "true".into());
    }
    let annotations = (!ds_spec.annotations.is_empty()).then(|| ds_spec.annotations.clone());
    let mut pull_secrets = settings.pull_secrets.clone();
    if c == Component::Driver
        && let Some(m) = spec.driver.as_ref().and_then(|d| d.manager.as_ref())
    {
        // The driver manager's image may come from another registry.
        for s in &m.image_pull_secrets {
            if !pull_secrets.contains(s) {
                pull_secrets.push(s.clone());
            }
        }
    }
    let pull_secrets = (!pull_secrets.is_empty()).then(|| {
        pull_secrets
            .iter()
            .map(|s| k8s_openapi::api::core::v1::LocalObjectReference { name: s.clone() })
            .collect()
    });
    Object::DaemonSet(DaemonSet {
        metadata: meta,
        spec: DaemonSetSpec {
            selector: LabelSelector {
                match_labels: Some([("app".to_string(), name.clone())].into()),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    annotations,
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    service_account_name: Some(rbac::service_account_name(c)),
                    // A component that needs no API access (NVIDIA's toolkit)
                    // gets no token: nothing to steal from its pod, and about
                    // 600 bytes less of it for the control plane to store.
                    automount_service_account_token: rbac::rbac_rules(spec, c)
                        .is_empty()
                        .then_some(false),
                    node_selector: Some(node_selector),
                    affinity,
                    tolerations: Some(tolerations(spec)),
                    priority_class_name: Some(
                        ds_spec
                            .priority_class_name
                            .clone()
                            .unwrap_or_else(|| "system-node-critical".into()),
                    ),
                    runtime_class_name: runtime_class,
                    host_pid,
                    image_pull_secrets: pull_secrets,
                    init_containers: (!init.is_empty()).then_some(init),
                    containers: vec![main],
                    volumes: Some(vols),
                    ..Default::default()
                }),
            },
            update_strategy: Some(update_strategy),
            ..Default::default()
        },
        status: None,
    })
}

/// Label naming the NVIDIADriver a driver DaemonSet and its pods belong to.
pub const NVIDIA_DRIVER_LABEL: &str = "nvidia.com/gpu-stack.nvidiadriver";

/// The label NVIDIA's NVIDIADriver DaemonSets and pods carry, which its
/// tooling selects driver pods by.
pub const APP_COMPONENT_LABEL: &str = "app.kubernetes.io/component";

/// The policy an NVIDIADriver's DaemonSets are rendered from: the
/// ClusterPolicy with its driver section replaced by the resource's (pull
/// settings, resources, args, env, module type) and the resource's labels,
/// annotations, tolerations and priority class over `daemonsets`.
fn policy_for_driver(policy: &ClusterPolicy, driver: &NvidiaDriver) -> ClusterPolicy {
    let s = &driver.spec;
    let mut p = policy.clone();
    p.spec.driver = Some(DriverSpec {
        common: ComponentSpec {
            enabled: Some(true),
            image_pull_policy: s.image_pull_policy.clone(),
            image_pull_secrets: s.image_pull_secrets.clone(),
            resources: s.resources.clone(),
            args: s.args.clone(),
            env: s.env.clone(),
            ..ComponentSpec::default()
        },
        use_precompiled: s.use_precompiled,
        kernel_module_type: Some(s.kernel_module_type.as_str().to_string()),
        startup_probe: s.startup_probe.clone(),
        manager: s.manager.clone(),
        ..DriverSpec::default()
    });
    let ds = p.spec.daemonsets.get_or_insert_with(Default::default);
    for (k, v) in &s.labels {
        ds.labels.insert(k.clone(), v.clone());
    }
    for (k, v) in &s.annotations {
        ds.annotations.insert(k.clone(), v.clone());
    }
    if !s.tolerations.is_empty() {
        ds.tolerations = Some(s.tolerations.clone());
    }
    if let Some(pc) = &s.priority_class_name {
        ds.priority_class_name = Some(pc.clone());
    }
    p
}

/// One driver DaemonSet of an NVIDIADriver for one of its pools: the driver
/// DaemonSet the ClusterPolicy would render, from the resource's settings,
/// limited to the nodes routed to the resource (its owner label) and
/// labelled with the resource's name.
pub fn nvidia_driver_daemonset(
    ctx: &RenderContext,
    driver: &NvidiaDriver,
    pool: &DriverPool,
) -> Object {
    let policy = policy_for_driver(ctx.policy, driver);
    let own = RenderContext {
        policy: &policy,
        namespace: ctx.namespace,
    };
    let mut obj = daemonset(&own, Component::Driver, Some(pool));
    if let Object::DaemonSet(ds) = &mut obj {
        let name = driver.name().to_string();
        let marks = [
            (NVIDIA_DRIVER_LABEL, name.as_str()),
            (APP_COMPONENT_LABEL, "nvidia-driver"),
        ];
        let labels = ds.metadata.labels.get_or_insert_with(BTreeMap::new);
        for (k, v) in marks {
            labels.insert(k.into(), v.into());
        }
        {
            let spec = &mut ds.spec;
            if let Some(l) = spec
                .template
                .metadata
                .as_mut()
                .and_then(|m| m.labels.as_mut())
            {
                for (k, v) in marks {
                    l.insert(k.into(), v.into());
                }
            }
            if let Some(sel) = spec
                .template
                .spec
                .as_mut()
                .and_then(|p| p.node_selector.as_mut())
            {
                sel.insert(OWNER_LABEL.into(), name);
            }
        }
    }
    obj
}
