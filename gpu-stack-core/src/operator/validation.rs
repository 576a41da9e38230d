//! The per-node validator's decisions: what evidence makes each component
//! valid, and the status file it writes under
//! [`VALIDATIONS_DIR`](super::components::VALIDATIONS_DIR) when it is.
//!
//! Init containers of the operands wait for these files (`driver-ready`,
//! `toolkit-ready`, `cuda-ready`, `plugin-ready`), so the file names here match
//! [`Gate::status_file`](super::components::Gate::status_file). The adapter
//! gathers evidence (GPU backend, files on the node, the Node object) and
//! calls the `check_*` functions; a failed check names what is missing and how
//! to fix it, and the adapter writes nothing.
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Resource name the device plugin advertises for whole GPUs.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// Prefix of the resources advertised for MIG devices (mixed strategy).
pub const MIG_RESOURCE_PREFIX: &str = "nvidia.com/mig-";
/// CUDA driver API version the `cuda` check requires by default: the oldest
/// driver API the CUDA 12 workloads run against.
pub const DEFAULT_REQUIRED_CUDA: CudaVersion = CudaVersion {
    major: 12,
    minor: 0,
};

/// A component the validator checks (the `COMPONENT` value).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ValidationComponent {
    /// The driver answers: it lists GPUs and reports its version.
    Driver,
    /// The container toolkit is installed (runtime config, CDI spec or install dir).
    Toolkit,
    /// The driver supports the CUDA version workloads need.
    Cuda,
    /// The device plugin advertises GPU resources on the Node.
    Plugin,
}

impl ValidationComponent {
    /// Every component in the order the validator's init chain checks them.
    pub const ALL: [ValidationComponent; 4] = [
        ValidationComponent::Driver,
        ValidationComponent::Toolkit,
        ValidationComponent::Cuda,
        ValidationComponent::Plugin,
    ];

    /// The `COMPONENT` value.
    pub fn name(self) -> &'static str {
        match self {
            ValidationComponent::Driver => "driver",
            ValidationComponent::Toolkit => "toolkit",
            ValidationComponent::Cuda => "cuda",
            ValidationComponent::Plugin => "plugin",
        }
    }

    /// Status file written under the validations directory when valid.
    pub fn ready_file(self) -> &'static str {
        match self {
            ValidationComponent::Driver => "driver-ready",
            ValidationComponent::Toolkit => "toolkit-ready",
            ValidationComponent::Cuda => "cuda-ready",
            ValidationComponent::Plugin => "plugin-ready",
        }
    }
}

impl fmt::Display for ValidationComponent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which components a `COMPONENT` value selects: one, a comma-separated
/// list (in the order given, each once), or `all` in chain order.
pub fn parse_components(value: &str) -> Result<Vec<ValidationComponent>, ValidationError> {
    let mut out: Vec<ValidationComponent> = Vec::new();
    for v in value.split(',').map(str::trim) {
        let found: Vec<ValidationComponent> = if v == "all" {
            ValidationComponent::ALL.to_vec()
        } else {
            let one = ValidationComponent::ALL
                .into_iter()
                .find(|c| c.name() == v)
                .ok_or_else(|| ValidationError::UnknownComponent(v.to_string()))?;
            vec![one]
        };
        for c in found {
            if !out.contains(&c) {
                out.push(c);
            }
        }
    }
    Ok(out)
}

/// A CUDA driver API version `major.minor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct CudaVersion {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

impl FromStr for CudaVersion {
    type Err = ValidationError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ValidationError::BadCudaVersion(s.to_string());
        let mut parts = s.trim().split('.');
        let major = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let minor = match parts.next() {
            Some(p) => p.parse().map_err(|_| bad())?,
            None => 0,
        };
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(CudaVersion { major, minor })
    }
}

impl fmt::Display for CudaVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// Why a component is not valid (or the input was bad). Messages say what is
/// missing and how to fix it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValidationError {
    /// `COMPONENT` names no known check.
    #[error(
        "unknown validator component {0:?}: use driver, toolkit, cuda, plugin, a comma-separated list of them, or all (flag --component or env COMPONENT)"
    )]
    UnknownComponent(String),
    /// A CUDA version is not `major.minor`.
    #[error("CUDA version {0:?} is not major.minor (for example 12.4)")]
    BadCudaVersion(String),
    /// The GPU backend could not be read at all.
    #[error(
        "driver not ready: the GPU backend could not be read ({0}); check that the NVIDIA driver is loaded (nvidia-smi) or that the driver DaemonSet is running on this node"
    )]
    DriverUnreachable(String),
    /// The driver answered but lists no GPU.
    #[error(
        "driver not ready: the driver lists no GPU on this node; check that the GPUs are visible (lspci, nvidia-smi) and that the node is meant to run GPU operands"
    )]
    NoGpus,
    /// The driver answered without a version.
    #[error(
        "driver not ready: the driver reports no version; reinstall the driver or check the driver container's logs"
    )]
    NoDriverVersion,
    /// None of the toolkit's traces were found.
    #[error(
        "toolkit not ready: none of {} exists; wait for the container-toolkit DaemonSet to install the toolkit on this node (or pass --toolkit-evidence with the paths it writes)",
        checked.join(", ")
    )]
    NoToolkit {
        /// Paths that were looked at.
        checked: Vec<String>,
    },
    /// The driver reports no CUDA driver API version.
    #[error(
        "cuda not ready: the driver reports no CUDA driver version; install a driver with CUDA support"
    )]
    NoCudaVersion,
    /// The driver's CUDA version is older than required.
    #[error(
        "cuda not ready: the driver supports CUDA {found}, older than the required {required}; upgrade the driver (ClusterPolicy spec.driver.version) or lower --cuda-version"
    )]
    CudaTooOld {
        /// What the driver supports.
        found: CudaVersion,
        /// What was required.
        required: CudaVersion,
    },
    /// The Node advertises no GPU resource.
    #[error(
        "plugin not ready: node {node} has no allocatable nvidia.com/gpu or nvidia.com/mig-* resource; check that the device plugin pod runs on this node and registered with the kubelet (or, on a DRA node, that the DRA plugin published its ResourceSlices)"
    )]
    NoGpuResources {
        /// Node name.
        node: String,
    },
    /// The plugin's workload pod does not see exactly the one GPU it was
    /// allocated.
    #[error(
        "plugin not ready: a pod allocated one GPU and no RuntimeClass sees {} GPU device node(s){}{}; the runtime did not inject the allocated device: check that containerd has CDI on (the toolkit's job) and that the device plugin's DEVICE_LIST_STRATEGY is cdi-annotations or cdi-cri",
        gpu_nodes.len(),
        if gpu_nodes.is_empty() { String::new() } else { format!(" ({})", gpu_nodes.join(", ")) },
        if *control { "" } else { " and no /dev/nvidiactl" }
    )]
    WorkloadDevices {
        /// The `/dev/nvidia<N>` nodes it sees (at most [`MAX_ECHOED_DEVICES`]).
        gpu_nodes: Vec<String>,
        /// Whether it sees `/dev/nvidiactl`.
        control: bool,
    },
}

/// At most this many device names are echoed in an error.
pub const MAX_ECHOED_DEVICES: usize = 16;

/// The resource the plugin check's workload pod asks one of: a whole GPU
/// where the node advertises them, else the first MIG resource (by name).
pub fn workload_resource(allocatable: &BTreeMap<String, String>) -> Option<String> {
    let resources = gpu_resources(allocatable);
    if resources.contains_key(GPU_RESOURCE) {
        return Some(GPU_RESOURCE.to_string());
    }
    resources.into_keys().next()
}

/// Whether a `/dev` entry name is a GPU's device node (`nvidia<N>`).
fn is_gpu_node(name: &str) -> bool {
    name.strip_prefix("nvidia")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// What the workload pod sees in its `/dev`: it was allocated one GPU (or
/// one MIG device, whose parent GPU's node it gets), so it must see exactly
/// one `nvidia<N>` node and `nvidiactl`. Returns the GPU node's name.
pub fn check_workload_devices(dev_entries: &[String]) -> Result<String, ValidationError> {
    let mut gpu_nodes: Vec<&String> = dev_entries.iter().filter(|e| is_gpu_node(e)).collect();
    gpu_nodes.sort();
    gpu_nodes.dedup();
    let control = dev_entries.iter().any(|e| e == "nvidiactl");
    match gpu_nodes.as_slice() {
        [one] if control => Ok((*one).clone()),
        _ => Err(ValidationError::WorkloadDevices {
            gpu_nodes: gpu_nodes
                .into_iter()
                .take(MAX_ECHOED_DEVICES)
                .cloned()
                .collect(),
            control,
        }),
    }
}

/// A status file to write: its name under the validations directory and its content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadyFile {
    /// File name, e.g. `driver-ready`.
    pub name: &'static str,
    /// File content (an env file: `KEY=value` lines).
    pub content: String,
}

/// Where the driver lives: on the host, or installed by the driver container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverRoot {
    /// Driver root on the host: `/` for a host driver, `/run/nvidia/driver` for the driver container.
    pub host_path: String,
}

impl DriverRoot {
    /// Driver root the driver container uses.
    pub const CONTAINER: &'static str = "/run/nvidia/driver";

    /// Whether the driver was installed on the host (not by the driver container).
    pub fn is_host_driver(&self) -> bool {
        self.host_path.trim_end_matches('/').is_empty()
    }

    /// Where the validator and the MIG manager see the driver root: the host
    /// root is mounted at `/host`, the container driver root at its own path.
    pub fn container_path(&self) -> &str {
        if self.is_host_driver() {
            "/host"
        } else {
            &self.host_path
        }
    }
}

/// What the GPU backend said about the driver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverEvidence {
    /// GPUs the driver lists.
    pub gpu_count: u32,
    /// Kernel driver version (empty when unknown).
    pub driver_version: String,
    /// CUDA driver API version as reported (empty when unknown).
    pub cuda_driver_version: String,
}

/// The driver is valid when it lists at least one GPU and reports a version.
/// The `driver-ready` env file carries NVIDIA's variables (the MIG manager
/// sources it) plus the driver version.
pub fn check_driver(
    evidence: &DriverEvidence,
    root: &DriverRoot,
) -> Result<ReadyFile, ValidationError> {
    if evidence.gpu_count == 0 {
        return Err(ValidationError::NoGpus);
    }
    let version = evidence.driver_version.trim();
    if version.is_empty() {
        return Err(ValidationError::NoDriverVersion);
    }
    let host = root.is_host_driver();
    let host_root = if host { "/" } else { root.host_path.as_str() };
    let ctr = root.container_path();
    let content = format!(
        "IS_HOST_DRIVER={host}\nNVIDIA_DRIVER_ROOT={host_root}\nDRIVER_ROOT_CTR_PATH={ctr}\nNVIDIA_DEV_ROOT={host_root}\nDEV_ROOT_CTR_PATH={ctr}\nDRIVER_VERSION={version}\nGPU_COUNT={}\n",
        evidence.gpu_count
    );
    Ok(ReadyFile {
        name: ValidationComponent::Driver.ready_file(),
        content,
    })
}

/// Which of the toolkit's traces exist on the node.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ToolkitEvidence {
    /// Paths looked at (runtime config, CDI spec, toolkit install dir), in order.
    pub checked: Vec<String>,
    /// The subset of `checked` that exists.
    pub present: BTreeSet<String>,
}

/// The toolkit is valid when any of its traces exists; the file names the first one found.
pub fn check_toolkit(evidence: &ToolkitEvidence) -> Result<ReadyFile, ValidationError> {
    let found = evidence
        .checked
        .iter()
        .find(|p| evidence.present.contains(*p))
        .ok_or_else(|| ValidationError::NoToolkit {
            checked: evidence.checked.clone(),
        })?;
    Ok(ReadyFile {
        name: ValidationComponent::Toolkit.ready_file(),
        content: format!("TOOLKIT_EVIDENCE={found}\n"),
    })
}

/// Without a CUDA toolchain in the image the `cuda` check does not run a
/// workload: it is valid when the driver's CUDA driver API version is at least
/// `required`, which is what a CUDA runtime of that version needs to start.
pub fn check_cuda(
    evidence: &DriverEvidence,
    required: CudaVersion,
) -> Result<ReadyFile, ValidationError> {
    let reported = evidence.cuda_driver_version.trim();
    if reported.is_empty() {
        return Err(ValidationError::NoCudaVersion);
    }
    let found: CudaVersion = reported.parse()?;
    if found < required {
        return Err(ValidationError::CudaTooOld { found, required });
    }
    Ok(ReadyFile {
        name: ValidationComponent::Cuda.ready_file(),
        content: format!("CUDA_DRIVER_VERSION={found}\nCUDA_REQUIRED={required}\n"),
    })
}

/// The Node's allocatable resources as the API server reports them.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PluginEvidence {
    /// Node name.
    pub node: String,
    /// `status.allocatable` (resource name → quantity).
    pub allocatable: BTreeMap<String, String>,
    /// Devices the node's DRA plugin publishes in its ResourceSlices, where
    /// the node runs one (`nvidia.com/gpu.deploy.dra-driver=true`) instead of
    /// the device plugin: GPUs reach pods through claims there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dra_devices: Option<usize>,
}

/// Counts of GPU resources (`nvidia.com/gpu`, `nvidia.com/mig-*`) above zero.
/// Quantities of extended resources are whole numbers; anything else counts as zero.
pub fn gpu_resources(allocatable: &BTreeMap<String, String>) -> BTreeMap<String, u64> {
    allocatable
        .iter()
        .filter(|(k, _)| k.as_str() == GPU_RESOURCE || k.starts_with(MIG_RESOURCE_PREFIX))
        .filter_map(|(k, v)| {
            v.trim()
                .parse::<u64>()
                .ok()
                .filter(|n| *n > 0)
                .map(|n| (k.clone(), n))
        })
        .collect()
}

/// The device plugin is valid when the Node advertises a GPU resource above zero.
pub fn check_plugin(evidence: &PluginEvidence) -> Result<ReadyFile, ValidationError> {
    let resources = gpu_resources(&evidence.allocatable);
    if resources.is_empty() {
        if let Some(n) = evidence.dra_devices.filter(|n| *n > 0) {
            return Ok(ReadyFile {
                name: ValidationComponent::Plugin.ready_file(),
                content: format!("DRA_DEVICES={n}\n"),
            });
        }
        return Err(ValidationError::NoGpuResources {
            node: evidence.node.clone(),
        });
    }
    let list = resources
        .iter()
        .map(|(k, n)| format!("{k}={n}"))
        .collect::<Vec<_>>()
        .join(",");
    Ok(ReadyFile {
        name: ValidationComponent::Plugin.ready_file(),
        content: format!("GPU_RESOURCES={list}\n"),
    })
}

/// Status files of `wanted` not among `present` (for the wait mode), in order.
pub fn missing_ready_files(
    wanted: &[ValidationComponent],
    present: &BTreeSet<String>,
) -> Vec<&'static str> {
    wanted
        .iter()
        .map(|c| c.ready_file())
        .filter(|f| !present.contains(*f))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::operator::components::Gate;
    use proptest::prelude::*;

    fn driver(count: u32, version: &str, cuda: &str) -> DriverEvidence {
        DriverEvidence {
            gpu_count: count,
            driver_version: version.into(),
            cuda_driver_version: cuda.into(),
        }
    }

    fn host() -> DriverRoot {
        DriverRoot {
            host_path: "/".into(),
        }
    }

    #[test]
    fn file_names_match_the_gates() {
        for (c, g) in [
            (ValidationComponent::Driver, Gate::DriverValidation),
            (ValidationComponent::Toolkit, Gate::ToolkitValidation),
            (ValidationComponent::Cuda, Gate::CudaValidation),
            (ValidationComponent::Plugin, Gate::PluginValidation),
        ] {
            assert_eq!(c.ready_file(), g.status_file());
            assert_eq!(Some(c.name()), g.validator_component());
            assert_eq!(c.name(), g.status_component());
        }
        // A plain wait gate waits for the file its component's check writes.
        let waited = parse_components(Gate::ToolkitWait.status_component()).unwrap();
        assert_eq!(waited[0].ready_file(), Gate::ToolkitWait.status_file());
    }

    proptest! {
        #[test]
        fn component_lists_parse_in_order_each_once(
            picks in proptest::collection::vec(0usize..4, 1..8),
        ) {
            let names: Vec<&str> = picks.iter().map(|i| ValidationComponent::ALL[*i].name()).collect();
            let parsed = parse_components(&names.join(", ")).unwrap();
            let mut expected: Vec<ValidationComponent> = Vec::new();
            for i in &picks {
                if !expected.contains(&ValidationComponent::ALL[*i]) {
                    expected.push(ValidationComponent::ALL[*i]);
                }
            }
            prop_assert_eq!(parsed, expected);
        }
    }

    #[test]
    fn components_parse_one_or_all() {
        assert_eq!(
            parse_components("plugin").unwrap(),
            vec![ValidationComponent::Plugin]
        );
        assert_eq!(
            parse_components("all").unwrap(),
            ValidationComponent::ALL.to_vec()
        );
        let err = parse_components("mofed").unwrap_err().to_string();
        assert!(
            err.contains("\"mofed\"") && err.contains("driver, toolkit"),
            "{err}"
        );
    }

    #[test]
    fn host_driver_env_file() {
        let f = check_driver(&driver(8, "550.54.15", "12.4"), &host()).unwrap();
        assert_eq!(f.name, "driver-ready");
        assert_eq!(
            f.content,
            "IS_HOST_DRIVER=true\nNVIDIA_DRIVER_ROOT=/\nDRIVER_ROOT_CTR_PATH=/host\nNVIDIA_DEV_ROOT=/\nDEV_ROOT_CTR_PATH=/host\nDRIVER_VERSION=550.54.15\nGPU_COUNT=8\n"
        );
    }

    #[test]
    fn container_driver_env_file() {
        let root = DriverRoot {
            host_path: DriverRoot::CONTAINER.into(),
        };
        let f = check_driver(&driver(1, "570.86.15", "12.8"), &root).unwrap();
        assert!(f.content.starts_with(
            "IS_HOST_DRIVER=false\nNVIDIA_DRIVER_ROOT=/run/nvidia/driver\nDRIVER_ROOT_CTR_PATH=/run/nvidia/driver\n"
        ));
    }

    #[test]
    fn driver_without_gpus_or_version_is_invalid() {
        assert_eq!(
            check_driver(&driver(0, "550.54.15", "12.4"), &host()),
            Err(ValidationError::NoGpus)
        );
        assert_eq!(
            check_driver(&driver(2, " ", "12.4"), &host()),
            Err(ValidationError::NoDriverVersion)
        );
    }

    #[test]
    fn toolkit_needs_one_trace() {
        let mut e = ToolkitEvidence {
            checked: vec![
                "/etc/cdi/nvidia.yaml".into(),
                "/usr/local/nvidia/toolkit".into(),
            ],
            present: BTreeSet::new(),
        };
        let err = check_toolkit(&e).unwrap_err().to_string();
        assert!(
            err.contains("/etc/cdi/nvidia.yaml, /usr/local/nvidia/toolkit"),
            "{err}"
        );
        e.present.insert("/usr/local/nvidia/toolkit".into());
        let f = check_toolkit(&e).unwrap();
        assert_eq!(f.name, "toolkit-ready");
        assert_eq!(f.content, "TOOLKIT_EVIDENCE=/usr/local/nvidia/toolkit\n");
    }

    #[test]
    fn cuda_compares_versions_numerically() {
        let req: CudaVersion = "12.4".parse().unwrap();
        assert!(check_cuda(&driver(1, "x", "12.10"), req).is_ok());
        assert_eq!(
            check_cuda(&driver(1, "x", "11.8"), req),
            Err(ValidationError::CudaTooOld {
                found: CudaVersion {
                    major: 11,
                    minor: 8
                },
                required: req
            })
        );
        assert_eq!(
            check_cuda(&driver(1, "x", ""), req),
            Err(ValidationError::NoCudaVersion)
        );
        assert!(matches!(
            check_cuda(&driver(1, "x", "twelve"), req),
            Err(ValidationError::BadCudaVersion(_))
        ));
        assert_eq!(
            check_cuda(&driver(1, "x", "12.4"), req).unwrap().content,
            "CUDA_DRIVER_VERSION=12.4\nCUDA_REQUIRED=12.4\n"
        );
    }

    #[test]
    fn plugin_needs_a_gpu_resource_above_zero() {
        let mut e = PluginEvidence {
            node: "n1".into(),
            allocatable: BTreeMap::from([
                ("cpu".into(), "8".into()),
                ("nvidia.com/gpu".into(), "0".into()),
                ("nvidia.com/mig-1g.10gb".into(), "junk".into()),
            ]),
            dra_devices: None,
        };
        let err = check_plugin(&e).unwrap_err().to_string();
        assert!(err.contains("node n1"), "{err}");
        // A DRA node passes on the devices its plugin published, not on none.
        e.dra_devices = Some(0);
        assert!(check_plugin(&e).is_err());
        e.dra_devices = Some(26);
        assert_eq!(check_plugin(&e).unwrap().content, "DRA_DEVICES=26\n");
        e.dra_devices = None;
        e.allocatable
            .insert("nvidia.com/mig-1g.10gb".into(), "7".into());
        assert_eq!(
            check_plugin(&e).unwrap().content,
            "GPU_RESOURCES=nvidia.com/mig-1g.10gb=7\n"
        );
    }

    #[test]
    fn the_workload_asks_for_a_whole_gpu_first_then_a_mig_device() {
        let alloc = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert_eq!(
            workload_resource(&alloc(&[
                ("nvidia.com/mig-1g.10gb", "7"),
                ("nvidia.com/gpu", "1")
            ])),
            Some("nvidia.com/gpu".into())
        );
        assert_eq!(
            workload_resource(&alloc(&[
                ("nvidia.com/gpu", "0"),
                ("nvidia.com/mig-2g.20gb", "3"),
                ("nvidia.com/mig-1g.10gb", "7")
            ])),
            Some("nvidia.com/mig-1g.10gb".into())
        );
        assert_eq!(workload_resource(&alloc(&[("cpu", "8")])), None);
    }

    #[test]
    fn a_workload_must_see_exactly_its_gpu_and_the_control_node() {
        let dev = |names: &[&str]| -> Vec<String> { names.iter().map(|s| s.to_string()).collect() };
        assert_eq!(
            check_workload_devices(&dev(&["null", "nvidia1", "nvidiactl", "nvidia-uvm"])),
            Ok("nvidia1".into())
        );
        // A MIG device: its parent GPU's node and the capability nodes.
        assert_eq!(
            check_workload_devices(&dev(&["nvidia0", "nvidiactl", "nvidia-caps"])),
            Ok("nvidia0".into())
        );
        // envvar on plain runc: nothing injected.
        let err = check_workload_devices(&dev(&["null", "zero"])).unwrap_err();
        assert_eq!(
            err,
            ValidationError::WorkloadDevices {
                gpu_nodes: vec![],
                control: false
            }
        );
        assert!(
            err.to_string()
                .contains("0 GPU device node(s) and no /dev/nvidiactl")
        );
        // Every GPU of the node: not isolated.
        let err = check_workload_devices(&dev(&["nvidia0", "nvidia1", "nvidiactl"])).unwrap_err();
        assert!(
            err.to_string()
                .contains("2 GPU device node(s) (nvidia0, nvidia1)"),
            "{err}"
        );
        assert!(check_workload_devices(&dev(&["nvidia0"])).is_err());
    }

    #[test]
    fn missing_files_in_order() {
        let present = BTreeSet::from(["toolkit-ready".to_string()]);
        assert_eq!(
            missing_ready_files(&ValidationComponent::ALL, &present),
            vec!["driver-ready", "cuda-ready", "plugin-ready"]
        );
    }

    proptest! {
        #[test]
        fn cuda_check_agrees_with_version_order(
            fm in 0u32..20, fn_ in 0u32..20, rm in 0u32..20, rn in 0u32..20
        ) {
            let required = CudaVersion { major: rm, minor: rn };
            let r = check_cuda(&driver(1, "x", &format!("{fm}.{fn_}")), required);
            prop_assert_eq!(r.is_ok(), (fm, fn_) >= (rm, rn));
        }

        #[test]
        fn cuda_version_round_trips(major in 0u32..1000, minor in 0u32..1000) {
            let v = CudaVersion { major, minor };
            prop_assert_eq!(v.to_string().parse::<CudaVersion>().unwrap(), v);
        }

        #[test]
        fn a_workload_passes_iff_one_gpu_node_and_the_control_node(
            gpus in proptest::collection::vec(0u32..300, 0..40),
            control in any::<bool>(),
            others in proptest::collection::vec("[a-z-]{1,12}", 0..10),
        ) {
            let mut dev: Vec<String> = gpus.iter().map(|n| format!("nvidia{n}")).collect();
            dev.extend(others.iter().filter(|o| !o.starts_with("nvidia")).cloned());
            if control { dev.push("nvidiactl".into()); }
            let distinct: BTreeSet<&u32> = gpus.iter().collect();
            let r = check_workload_devices(&dev);
            prop_assert_eq!(r.is_ok(), distinct.len() == 1 && control);
            if let Err(ValidationError::WorkloadDevices { gpu_nodes, .. }) = r {
                prop_assert!(gpu_nodes.len() <= MAX_ECHOED_DEVICES);
            }
        }

        #[test]
        fn plugin_valid_iff_some_gpu_resource_positive(
            gpu in proptest::option::of(0u64..4),
            mig in proptest::option::of(0u64..4),
            other in 0u64..4,
        ) {
            let mut a = BTreeMap::new();
            a.insert("example.com/fpga".to_string(), other.to_string());
            if let Some(n) = gpu { a.insert(GPU_RESOURCE.into(), n.to_string()); }
            if let Some(n) = mig { a.insert("nvidia.com/mig-2g.20gb".into(), n.to_string()); }
            let ok = check_plugin(&PluginEvidence { node: "n".into(), allocatable: a, dra_devices: None }).is_ok();
            prop_assert_eq!(ok, gpu.unwrap_or(0) > 0 || mig.unwrap_or(0) > 0);
        }
    }
}
