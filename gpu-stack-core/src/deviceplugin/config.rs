//! NVIDIA's device-plugin / GFD configuration file (`version: v1`, YAML or JSON),
//! and how flags, environment and file combine: a flag beats its environment
//! variable, which beats the file, which beats the default.
//!
//! Like NVIDIA's current plugin, resource renaming is accepted but switched off:
//! `resources` is dropped, `sharing.*.resources[].rename` becomes empty (or
//! `<name>.shared` with `renameByDefault`) and `devices` becomes `all`. Every such
//! change is reported in [`Settings::notices`].

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Errors in the configuration: what is wrong, where, and how to fix it.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// The file is not valid YAML/JSON of the expected shape.
    #[error(
        "config file {source_name}: cannot parse: {message}; expected NVIDIA's device-plugin config (version: v1)"
    )]
    Parse {
        /// File name or other origin.
        source_name: String,
        /// Parser message.
        message: String,
    },
    /// The file nests too deeply or is too large to parse safely.
    #[error(
        "config file {source_name}: refused before parsing: {source}; \
         expected NVIDIA's device-plugin config (version: v1)"
    )]
    Refused {
        /// File name or other origin.
        source_name: String,
        /// What the pre-parse check found.
        source: crate::yaml_guard::DepthError,
    },
    /// The `version` key is not `v1`.
    #[error(
        "config: unsupported version {}; only \"v1\" (or an empty version) is accepted",
        crate::echo::quoted(.0)
    )]
    Version(String),
    /// A value outside its allowed set.
    #[error(
        "config: {field} = {} is not valid; expected one of {expected}",
        crate::echo::quoted(.value)
    )]
    InvalidValue {
        /// Dotted field path.
        field: &'static str,
        /// Offending value.
        value: String,
        /// Allowed values.
        expected: &'static str,
    },
    /// A rule that spans several fields.
    #[error("config: {0}")]
    Rule(String),
}

/// How MIG devices are advertised.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum MigStrategy {
    /// Every GPU is `nvidia.com/gpu`; MIG mode is ignored.
    #[default]
    None,
    /// Every MIG device is `nvidia.com/gpu`; all GPUs must share one MIG layout.
    Single,
    /// MIG devices are `nvidia.com/mig-<profile>`, full GPUs `nvidia.com/gpu`.
    Mixed,
}

impl MigStrategy {
    /// The flag/label spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            MigStrategy::None => "none",
            MigStrategy::Single => "single",
            MigStrategy::Mixed => "mixed",
        }
    }
}

impl fmt::Display for MigStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for MigStrategy {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(MigStrategy::None),
            "single" => Ok(MigStrategy::Single),
            "mixed" => Ok(MigStrategy::Mixed),
            other => Err(ConfigError::InvalidValue {
                field: "flags.migStrategy",
                value: other.to_string(),
                expected: "none, single, mixed",
            }),
        }
    }
}

/// How `Allocate` tells the runtime which devices a container gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DeviceListStrategy {
    /// `NVIDIA_VISIBLE_DEVICES=<ids>`.
    #[serde(rename = "envvar")]
    Envvar,
    /// One `/dev/null` mount per device under `/var/run/nvidia-container-devices`.
    #[serde(rename = "volume-mounts")]
    VolumeMounts,
    /// CDI device names in a container annotation.
    #[serde(rename = "cdi-annotations")]
    CdiAnnotations,
    /// CDI device names in the CRI `cdi_devices` field.
    #[serde(rename = "cdi-cri")]
    CdiCri,
}

impl DeviceListStrategy {
    /// Whether this strategy uses CDI names.
    pub fn is_cdi(self) -> bool {
        matches!(
            self,
            DeviceListStrategy::CdiAnnotations | DeviceListStrategy::CdiCri
        )
    }
}

impl FromStr for DeviceListStrategy {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "envvar" => Ok(DeviceListStrategy::Envvar),
            "volume-mounts" => Ok(DeviceListStrategy::VolumeMounts),
            "cdi-annotations" => Ok(DeviceListStrategy::CdiAnnotations),
            "cdi-cri" => Ok(DeviceListStrategy::CdiCri),
            other => Err(ConfigError::InvalidValue {
                field: "flags.plugin.deviceListStrategy",
                value: other.to_string(),
                expected: "envvar, volume-mounts, cdi-annotations, cdi-cri",
            }),
        }
    }
}

/// Which name of a device goes into the env var or CDI name.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceIdStrategy {
    /// `GPU-…` / `MIG-…`.
    #[default]
    Uuid,
    /// `0` / `0:1`.
    Index,
}

impl FromStr for DeviceIdStrategy {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "uuid" => Ok(DeviceIdStrategy::Uuid),
            "index" => Ok(DeviceIdStrategy::Index),
            other => Err(ConfigError::InvalidValue {
                field: "flags.plugin.deviceIDStrategy",
                value: other.to_string(),
                expected: "uuid, index",
            }),
        }
    }
}

/// How replicas of shared GPUs are handed out by `GetPreferredAllocation`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SharedAllocationPolicy {
    /// Spread over the physical GPUs with the most free replicas.
    #[default]
    Distributed,
    /// Fill one physical GPU before the next.
    Packed,
}

/// `deviceListStrategy` accepts a string or a list of strings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    /// A single value.
    One(String),
    /// Several values.
    Many(Vec<String>),
}

impl OneOrMany {
    fn values(&self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => s.split(',').map(|v| v.trim().to_string()).collect(),
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

/// The config file as written (every field optional).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConfigFile {
    /// Must be `v1` or empty.
    #[serde(default)]
    pub version: Option<String>,
    /// Flags shared by the plugin and GFD.
    #[serde(default)]
    pub flags: FileFlags,
    /// Resource renaming; accepted and ignored, like NVIDIA's plugin.
    #[serde(default)]
    pub resources: Option<serde_json::Value>,
    /// GPU sharing.
    #[serde(default)]
    pub sharing: Sharing,
    /// IMEX channels.
    #[serde(default)]
    pub imex: Imex,
}

/// `flags:` of the config file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FileFlags {
    /// `none`, `single` or `mixed`.
    pub mig_strategy: Option<String>,
    /// Exit when NVML cannot be initialised.
    pub fail_on_init_error: Option<bool>,
    /// Root of the driver installation on the host.
    pub nvidia_driver_root: Option<String>,
    /// Root of the `/dev` tree on the host.
    pub nvidia_dev_root: Option<String>,
    /// Root of the MPS pipe directories.
    pub mps_root: Option<String>,
    /// Add `NVIDIA_GDRCOPY=enabled`.
    pub gdrcopy_enabled: Option<bool>,
    /// Add `NVIDIA_GDS=enabled`.
    pub gds_enabled: Option<bool>,
    /// Add `NVIDIA_MOFED=enabled`.
    pub mofed_enabled: Option<bool>,
    /// GFD writes a NodeFeature object instead of a feature file.
    pub use_node_feature_api: Option<bool>,
    /// `auto`, `nvml` or `tegra`.
    pub device_discovery_strategy: Option<String>,
    /// Device-plugin flags.
    #[serde(default)]
    pub plugin: PluginFlags,
    /// GFD flags.
    #[serde(default)]
    pub gfd: GfdFlags,
}

/// `flags.plugin:` of the config file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PluginFlags {
    /// Add `DeviceSpec`s to Allocate responses.
    pub pass_device_specs: Option<bool>,
    /// One or more device list strategies.
    pub device_list_strategy: Option<OneOrMany>,
    /// `uuid` or `index`.
    #[serde(rename = "deviceIDStrategy")]
    pub device_id_strategy: Option<String>,
    /// Prefix of CDI annotation keys.
    pub cdi_annotation_prefix: Option<String>,
    /// Path of `nvidia-ctk` on the host.
    #[serde(rename = "nvidiaCTKPath")]
    pub nvidia_ctk_path: Option<String>,
    /// Where the driver root is mounted inside the plugin container.
    pub container_driver_root: Option<String>,
    /// `distributed` or `packed`.
    pub shared_devices_allocation_policy: Option<String>,
}

/// `flags.gfd:` of the config file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GfdFlags {
    /// Label once and exit.
    pub oneshot: Option<bool>,
    /// Leave out `nvidia.com/gfd.timestamp`.
    pub no_timestamp: Option<bool>,
    /// Relabel interval, e.g. `60s`.
    pub sleep_interval: Option<String>,
    /// NFD feature file to write.
    pub output_file: Option<String>,
    /// File holding the machine type.
    pub machine_type_file: Option<String>,
}

/// `sharing:` of the config file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Sharing {
    /// Time-slicing.
    pub time_slicing: Option<SharingSpec>,
    /// CUDA MPS.
    pub mps: Option<SharingSpec>,
}

/// One sharing mechanism.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SharingSpec {
    /// Advertise shared resources as `<name>.shared`.
    #[serde(default)]
    pub rename_by_default: bool,
    /// Reject requests for more than one replica.
    #[serde(default)]
    pub fail_requests_greater_than_one: Option<bool>,
    /// Which resources are shared and how many times.
    #[serde(default)]
    pub resources: Vec<ReplicatedResource>,
}

/// One entry of `sharing.*.resources`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplicatedResource {
    /// Resource to share, e.g. `nvidia.com/gpu`.
    pub name: String,
    /// New name; ignored (renaming is disabled).
    #[serde(default)]
    pub rename: Option<String>,
    /// Which devices; ignored (always all).
    #[serde(default)]
    pub devices: Option<serde_json::Value>,
    /// Replicas per device, at least 2.
    pub replicas: u32,
}

/// `imex:` of the config file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Imex {
    /// `[]` or `[0]`.
    #[serde(default, rename = "channelIDs")]
    pub channel_ids: Vec<u32>,
    /// Fail when the channel is missing.
    #[serde(default)]
    pub required: bool,
}

impl ConfigFile {
    /// Parses a config file (YAML is a superset of JSON, so both work). Text
    /// nesting deeper than [`crate::yaml_guard::MAX_DEPTH`] or larger than
    /// [`crate::yaml_guard::MAX_BYTES`] is refused before parsing.
    pub fn parse(source_name: &str, text: &str) -> Result<ConfigFile, ConfigError> {
        if text.trim().is_empty() {
            return Ok(ConfigFile::default());
        }
        crate::yaml_guard::check(text).map_err(|source| ConfigError::Refused {
            source_name: source_name.to_string(),
            source,
        })?;
        crate::yaml_guard::from_str(text).map_err(|e| ConfigError::Parse {
            source_name: source_name.to_string(),
            message: crate::yaml_guard::message(&e),
        })
    }
}

/// Values that came from flags or their environment variables (a flag beats its
/// variable; the binary's flag parser already merged the two). Each set value
/// beats the config file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `--mig-strategy` / `MIG_STRATEGY`.
    pub mig_strategy: Option<String>,
    /// `--fail-on-init-error` / `FAIL_ON_INIT_ERROR`.
    pub fail_on_init_error: Option<bool>,
    /// `--nvidia-driver-root` / `NVIDIA_DRIVER_ROOT`.
    pub nvidia_driver_root: Option<String>,
    /// `--dev-root` / `NVIDIA_DEV_ROOT`.
    pub nvidia_dev_root: Option<String>,
    /// `--mps-root` / `MPS_ROOT`.
    pub mps_root: Option<String>,
    /// `--pass-device-specs` / `PASS_DEVICE_SPECS`.
    pub pass_device_specs: Option<bool>,
    /// `--device-list-strategy` / `DEVICE_LIST_STRATEGY` (comma-separated).
    pub device_list_strategy: Option<String>,
    /// `--device-id-strategy` / `DEVICE_ID_STRATEGY`.
    pub device_id_strategy: Option<String>,
    /// `--cdi-annotation-prefix` / `CDI_ANNOTATION_PREFIX`.
    pub cdi_annotation_prefix: Option<String>,
    /// `--gdrcopy-enabled` / `GDRCOPY_ENABLED`.
    pub gdrcopy_enabled: Option<bool>,
    /// `--gds-enabled` / `GDS_ENABLED`.
    pub gds_enabled: Option<bool>,
    /// `--mofed-enabled` / `MOFED_ENABLED`.
    pub mofed_enabled: Option<bool>,
    /// `--oneshot` / `GFD_ONESHOT`.
    pub oneshot: Option<bool>,
    /// `--no-timestamp` / `GFD_NO_TIMESTAMP`.
    pub no_timestamp: Option<bool>,
    /// `--sleep-interval` / `GFD_SLEEP_INTERVAL`.
    pub sleep_interval: Option<String>,
    /// `--output-file` / `GFD_OUTPUT_FILE`.
    pub output_file: Option<String>,
    /// `--machine-type-file` / `GFD_MACHINE_TYPE_FILE`.
    pub machine_type_file: Option<String>,
}

/// Which sharing mechanism is in effect.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SharingStrategy {
    /// No sharing.
    #[default]
    None,
    /// Time-slicing.
    TimeSlicing,
    /// CUDA MPS.
    Mps,
}

impl SharingStrategy {
    /// Label spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            SharingStrategy::None => "none",
            SharingStrategy::TimeSlicing => "time-slicing",
            SharingStrategy::Mps => "mps",
        }
    }
}

/// Most replicas one shared GPU may be advertised as (time-slicing or MPS):
/// each replica is a device the plugin lists to the kubelet.
pub const MAX_REPLICAS: u32 = 1_024;

/// One shared resource after renaming was neutralised.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedResource {
    /// Resource being shared, e.g. `nvidia.com/gpu`.
    pub name: String,
    /// Name it is advertised as (`name` or `name.shared`).
    pub advertised_name: String,
    /// Replicas per device.
    pub replicas: u32,
}

/// The effective settings after merging defaults, file and overrides.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Settings {
    /// MIG strategy.
    pub mig_strategy: MigStrategy,
    /// Exit on NVML init failure.
    pub fail_on_init_error: bool,
    /// Host driver root.
    pub driver_root: String,
    /// Host `/dev` root (defaults to the driver root).
    pub dev_root: String,
    /// MPS root.
    pub mps_root: String,
    /// Add `DeviceSpec`s.
    pub pass_device_specs: bool,
    /// Device list strategies, in order, without duplicates.
    pub device_list_strategies: Vec<DeviceListStrategy>,
    /// Device id strategy.
    pub device_id_strategy: DeviceIdStrategy,
    /// CDI annotation prefix.
    pub cdi_annotation_prefix: String,
    /// Replica placement policy.
    pub shared_allocation_policy: SharedAllocationPolicy,
    /// GDRCopy.
    pub gdrcopy_enabled: bool,
    /// GPUDirect Storage.
    pub gds_enabled: bool,
    /// MOFED.
    pub mofed_enabled: bool,
    /// Sharing mechanism.
    pub sharing_strategy: SharingStrategy,
    /// Shared resources.
    pub shared: Vec<SharedResource>,
    /// Reject requests for more than one replica.
    pub fail_requests_greater_than_one: bool,
    /// IMEX channel ids.
    pub imex_channel_ids: Vec<u32>,
    /// GFD: label once and exit.
    pub gfd_oneshot: bool,
    /// GFD: no timestamp label.
    pub gfd_no_timestamp: bool,
    /// GFD: relabel interval in seconds.
    pub gfd_sleep_interval_secs: u64,
    /// GFD: feature file path.
    pub gfd_output_file: String,
    /// GFD: machine type file.
    pub gfd_machine_type_file: String,
    /// Things the config asked for that were changed or ignored, for logging.
    pub notices: Vec<String>,
}

/// Default NFD feature file written by GFD.
pub const DEFAULT_GFD_OUTPUT_FILE: &str = "/etc/kubernetes/node-feature-discovery/features.d/gfd";
/// Default machine type file.
pub const DEFAULT_MACHINE_TYPE_FILE: &str = "/sys/class/dmi/id/product_name";

fn parse_bool(field: &'static str, v: &str) -> Result<bool, ConfigError> {
    match v.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" => Ok(true),
        "false" | "0" | "no" | "" => Ok(false),
        other => Err(ConfigError::InvalidValue {
            field,
            value: other.to_string(),
            expected: "true, false",
        }),
    }
}

/// Parses a boolean the way flags and env vars spell it.
pub fn parse_flag_bool(field: &'static str, v: &str) -> Result<bool, ConfigError> {
    parse_bool(field, v)
}

/// Parses a duration such as `60s`, `5m`, `1h` or a bare number of seconds.
pub fn parse_interval_secs(v: &str) -> Result<u64, ConfigError> {
    let v = v.trim();
    let err = || ConfigError::InvalidValue {
        field: "flags.gfd.sleepInterval",
        value: v.to_string(),
        expected: "a duration such as 60s, 5m or 1h",
    };
    let (num, mult) = if let Some(n) = v.strip_suffix("ms") {
        (n, 0)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1)
    } else if let Some(n) = v.strip_suffix('m') {
        (n, 60)
    } else if let Some(n) = v.strip_suffix('h') {
        (n, 3600)
    } else {
        (v, 1)
    };
    let n: u64 = num.parse().map_err(|_| err())?;
    if mult == 0 {
        return Ok(n.div_ceil(1000).max(1));
    }
    n.checked_mul(mult).filter(|s| *s > 0).ok_or_else(err)
}

impl Settings {
    /// Merges the config file (if any) under the overrides, applies defaults and
    /// validates the result. Nothing is partially applied: on error no settings exist.
    pub fn resolve(file: Option<&ConfigFile>, ov: &Overrides) -> Result<Settings, ConfigError> {
        let default_file = ConfigFile::default();
        let file = file.unwrap_or(&default_file);
        match file.version.as_deref() {
            None | Some("") | Some("v1") => {}
            Some(other) => return Err(ConfigError::Version(other.to_string())),
        }
        let f = &file.flags;
        let mut notices = Vec::new();

        let mig_strategy: MigStrategy = ov
            .mig_strategy
            .as_deref()
            .or(f.mig_strategy.as_deref())
            .map(str::parse)
            .transpose()?
            .unwrap_or_default();

        let driver_root = ov
            .nvidia_driver_root
            .clone()
            .or_else(|| f.nvidia_driver_root.clone())
            .unwrap_or_else(|| "/".to_string());
        let dev_root = ov
            .nvidia_dev_root
            .clone()
            .or_else(|| f.nvidia_dev_root.clone())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| driver_root.clone());
        let mps_root = ov
            .mps_root
            .clone()
            .or_else(|| f.mps_root.clone())
            .unwrap_or_default();

        let list_values: Vec<String> =
            match (&ov.device_list_strategy, &f.plugin.device_list_strategy) {
                (Some(s), _) => OneOrMany::One(s.clone()).values(),
                (None, Some(v)) => v.values(),
                (None, None) => vec!["envvar".to_string()],
            };
        let mut device_list_strategies = Vec::new();
        for v in list_values.iter().filter(|v| !v.is_empty()) {
            let s: DeviceListStrategy = v.parse()?;
            if !device_list_strategies.contains(&s) {
                device_list_strategies.push(s);
            }
        }
        if device_list_strategies.is_empty() {
            return Err(ConfigError::Rule(
                "flags.plugin.deviceListStrategy is empty; set at least one of envvar, volume-mounts, cdi-annotations, cdi-cri".into(),
            ));
        }

        let device_id_strategy: DeviceIdStrategy = ov
            .device_id_strategy
            .as_deref()
            .or(f.plugin.device_id_strategy.as_deref())
            .map(str::parse)
            .transpose()?
            .unwrap_or_default();

        let shared_allocation_policy = match f.plugin.shared_devices_allocation_policy.as_deref() {
            None | Some("") | Some("distributed") => SharedAllocationPolicy::Distributed,
            Some("packed") => SharedAllocationPolicy::Packed,
            Some(other) => {
                return Err(ConfigError::InvalidValue {
                    field: "flags.plugin.sharedDevicesAllocationPolicy",
                    value: other.to_string(),
                    expected: "distributed, packed",
                });
            }
        };

        if file.resources.is_some() {
            notices.push(
                "resources: resource renaming is disabled; the section is ignored (names stay nvidia.com/gpu and nvidia.com/mig-<profile>)".into(),
            );
        }

        let (sharing_strategy, spec) = match (&file.sharing.time_slicing, &file.sharing.mps) {
            (Some(t), Some(m)) if !t.resources.is_empty() && !m.resources.is_empty() => {
                return Err(ConfigError::Rule(
                    "sharing.timeSlicing and sharing.mps are both set; choose one".into(),
                ));
            }
            (Some(t), _) if !t.resources.is_empty() => (SharingStrategy::TimeSlicing, Some(t)),
            (_, Some(m)) if !m.resources.is_empty() => (SharingStrategy::Mps, Some(m)),
            _ => (SharingStrategy::None, None),
        };
        let mut shared = Vec::new();
        let mut fail_requests_greater_than_one = false;
        if let Some(spec) = spec {
            fail_requests_greater_than_one = spec
                .fail_requests_greater_than_one
                .unwrap_or(sharing_strategy == SharingStrategy::Mps);
            let mut seen = BTreeSet::new();
            for (i, r) in spec.resources.iter().enumerate() {
                if r.replicas < 2 || r.replicas > MAX_REPLICAS {
                    return Err(ConfigError::Rule(format!(
                        "sharing.{}.resources[{i}] ({}): replicas = {} but must be from 2 to {MAX_REPLICAS} (replicas per GPU); set replicas in that range",
                        sharing_key(sharing_strategy),
                        crate::echo::clipped(&r.name),
                        r.replicas
                    )));
                }
                if !is_sharable_name(&r.name) {
                    return Err(ConfigError::Rule(format!(
                        "sharing.{}.resources[{i}]: name {} is not a resource this plugin advertises; use nvidia.com/gpu or nvidia.com/mig-<profile>",
                        sharing_key(sharing_strategy),
                        crate::echo::quoted(&r.name)
                    )));
                }
                if !seen.insert(r.name.clone()) {
                    return Err(ConfigError::Rule(format!(
                        "sharing.{}.resources: {} is listed twice",
                        sharing_key(sharing_strategy),
                        r.name
                    )));
                }
                if r.rename.as_deref().is_some_and(|s| !s.is_empty()) {
                    notices.push(format!(
                        "sharing resource {}: rename is disabled and ignored",
                        r.name
                    ));
                }
                if r.devices
                    .as_ref()
                    .is_some_and(|d| d.as_str() != Some("all"))
                {
                    notices.push(format!(
                        "sharing resource {}: devices is ignored; all devices are shared",
                        r.name
                    ));
                }
                let advertised_name = if spec.rename_by_default {
                    format!("{}.shared", r.name)
                } else {
                    r.name.clone()
                };
                if advertised_name.len() > 63 {
                    return Err(ConfigError::Rule(format!(
                        "shared resource name {} is longer than 63 characters; shorten the name or rename",
                        crate::echo::quoted(&advertised_name)
                    )));
                }
                shared.push(SharedResource {
                    name: r.name.clone(),
                    advertised_name,
                    replicas: r.replicas,
                });
            }
        }
        if sharing_strategy == SharingStrategy::Mps {
            if mig_strategy == MigStrategy::Mixed {
                return Err(ConfigError::Rule(
                    "sharing.mps cannot be combined with migStrategy mixed; use none or single"
                        .into(),
                ));
            }
            if mps_root.is_empty() {
                return Err(ConfigError::Rule(
                    "sharing.mps needs flags.mpsRoot (or --mps-root / MPS_ROOT), e.g. /run/nvidia/mps".into(),
                ));
            }
        }

        match file.imex.channel_ids.as_slice() {
            [] | [0] => {}
            other => {
                return Err(ConfigError::InvalidValue {
                    field: "imex.channelIDs",
                    value: format!("[{}]", crate::echo::join_capped(other)),
                    expected: "[] or [0]",
                });
            }
        }

        let flag = |o: Option<bool>, fv: Option<bool>, d: bool| o.or(fv).unwrap_or(d);
        let sleep = ov
            .sleep_interval
            .as_deref()
            .or(f.gfd.sleep_interval.as_deref())
            .map(parse_interval_secs)
            .transpose()?
            .unwrap_or(60);

        Ok(Settings {
            mig_strategy,
            fail_on_init_error: flag(ov.fail_on_init_error, f.fail_on_init_error, true),
            driver_root,
            dev_root,
            mps_root,
            pass_device_specs: flag(ov.pass_device_specs, f.plugin.pass_device_specs, false),
            device_list_strategies,
            device_id_strategy,
            cdi_annotation_prefix: ov
                .cdi_annotation_prefix
                .clone()
                .or_else(|| f.plugin.cdi_annotation_prefix.clone())
                .unwrap_or_else(|| "cdi.k8s.io/".to_string()),
            shared_allocation_policy,
            gdrcopy_enabled: flag(ov.gdrcopy_enabled, f.gdrcopy_enabled, false),
            gds_enabled: flag(ov.gds_enabled, f.gds_enabled, false),
            mofed_enabled: flag(ov.mofed_enabled, f.mofed_enabled, false),
            sharing_strategy,
            shared,
            fail_requests_greater_than_one,
            imex_channel_ids: file.imex.channel_ids.clone(),
            gfd_oneshot: flag(ov.oneshot, f.gfd.oneshot, false),
            gfd_no_timestamp: flag(ov.no_timestamp, f.gfd.no_timestamp, false),
            gfd_sleep_interval_secs: sleep,
            gfd_output_file: ov
                .output_file
                .clone()
                .or_else(|| f.gfd.output_file.clone())
                .unwrap_or_else(|| DEFAULT_GFD_OUTPUT_FILE.to_string()),
            gfd_machine_type_file: ov
                .machine_type_file
                .clone()
                .or_else(|| f.gfd.machine_type_file.clone())
                .unwrap_or_else(|| DEFAULT_MACHINE_TYPE_FILE.to_string()),
            notices,
        })
    }

    /// Settings with every default (no file, no overrides).
    pub fn defaults() -> Settings {
        // The empty config always resolves; fall back to a literal only to avoid a panic path.
        Settings::resolve(None, &Overrides::default()).unwrap_or_else(|_| Settings {
            mig_strategy: MigStrategy::None,
            fail_on_init_error: true,
            driver_root: "/".into(),
            dev_root: "/".into(),
            mps_root: String::new(),
            pass_device_specs: false,
            device_list_strategies: vec![DeviceListStrategy::Envvar],
            device_id_strategy: DeviceIdStrategy::Uuid,
            cdi_annotation_prefix: "cdi.k8s.io/".into(),
            shared_allocation_policy: SharedAllocationPolicy::Distributed,
            gdrcopy_enabled: false,
            gds_enabled: false,
            mofed_enabled: false,
            sharing_strategy: SharingStrategy::None,
            shared: Vec::new(),
            fail_requests_greater_than_one: false,
            imex_channel_ids: Vec::new(),
            gfd_oneshot: false,
            gfd_no_timestamp: false,
            gfd_sleep_interval_secs: 60,
            gfd_output_file: DEFAULT_GFD_OUTPUT_FILE.into(),
            gfd_machine_type_file: DEFAULT_MACHINE_TYPE_FILE.into(),
            notices: Vec::new(),
        })
    }

    /// The sharing entry for a resource, if it is shared.
    pub fn shared_for(&self, resource: &str) -> Option<&SharedResource> {
        self.shared.iter().find(|s| s.name == resource)
    }
}

fn sharing_key(s: SharingStrategy) -> &'static str {
    match s {
        SharingStrategy::Mps => "mps",
        _ => "timeSlicing",
    }
}

fn is_sharable_name(name: &str) -> bool {
    name == "nvidia.com/gpu"
        || name.strip_prefix("nvidia.com/mig-").is_some_and(|p| {
            !p.is_empty() && p.chars().all(|c| c.is_ascii_alphanumeric() || c == '.')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deep_inputs() -> [String; 2] {
        [
            "[".repeat(100_000),
            format!("{}1{}", "{a: ".repeat(100_000), "}".repeat(100_000)),
        ]
    }

    #[test]
    fn deeply_nested_config_is_refused_before_parsing() {
        for text in deep_inputs() {
            let e = ConfigFile::parse("/etc/dp/config.yaml", &text).unwrap_err();
            assert!(
                matches!(&e, ConfigError::Refused { source_name, source: crate::yaml_guard::DepthError::TooDeep { .. } } if source_name == "/etc/dp/config.yaml"),
                "{e}"
            );
            assert!(
                e.to_string().contains(
                    "config file /etc/dp/config.yaml: refused before parsing: YAML nests deeper"
                ),
                "{e}"
            );
        }
    }

    const TS: &str = r#"
version: v1
flags:
  migStrategy: mixed
  plugin:
    deviceListStrategy: [envvar, cdi-cri]
    deviceIDStrategy: index
sharing:
  timeSlicing:
    renameByDefault: false
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"#;

    #[test]
    fn file_values_apply_and_flags_beat_file() {
        let file = ConfigFile::parse("ts.yaml", TS).unwrap();
        let s = Settings::resolve(Some(&file), &Overrides::default()).unwrap();
        assert_eq!(s.mig_strategy, MigStrategy::Mixed);
        assert_eq!(
            s.device_list_strategies,
            vec![DeviceListStrategy::Envvar, DeviceListStrategy::CdiCri]
        );
        assert_eq!(s.device_id_strategy, DeviceIdStrategy::Index);
        assert_eq!(s.sharing_strategy, SharingStrategy::TimeSlicing);
        assert_eq!(s.shared[0].advertised_name, "nvidia.com/gpu");
        assert_eq!(s.shared[0].replicas, 4);
        assert!(!s.fail_requests_greater_than_one);

        let ov = Overrides {
            mig_strategy: Some("single".into()),
            device_list_strategy: Some("cdi-annotations".into()),
            ..Overrides::default()
        };
        let s = Settings::resolve(Some(&file), &ov).unwrap();
        assert_eq!(s.mig_strategy, MigStrategy::Single);
        assert_eq!(
            s.device_list_strategies,
            vec![DeviceListStrategy::CdiAnnotations]
        );
        assert_eq!(s.device_id_strategy, DeviceIdStrategy::Index);
    }

    #[test]
    fn defaults_match_nvidia() {
        let s = Settings::defaults();
        assert_eq!(s.mig_strategy, MigStrategy::None);
        assert!(s.fail_on_init_error);
        assert_eq!(s.device_list_strategies, vec![DeviceListStrategy::Envvar]);
        assert_eq!(s.device_id_strategy, DeviceIdStrategy::Uuid);
        assert_eq!(s.cdi_annotation_prefix, "cdi.k8s.io/");
        assert_eq!(s.gfd_sleep_interval_secs, 60);
        assert_eq!(s.dev_root, "/");
    }

    #[test]
    fn json_config_parses() {
        let f = ConfigFile::parse(
            "c.json",
            r#"{"version":"v1","flags":{"migStrategy":"single","plugin":{"deviceListStrategy":"envvar,volume-mounts"}}}"#,
        )
        .unwrap();
        let s = Settings::resolve(Some(&f), &Overrides::default()).unwrap();
        assert_eq!(s.mig_strategy, MigStrategy::Single);
        assert_eq!(
            s.device_list_strategies,
            vec![DeviceListStrategy::Envvar, DeviceListStrategy::VolumeMounts]
        );
    }

    #[test]
    fn rename_is_neutralised_and_reported() {
        let f = ConfigFile::parse(
            "r.yaml",
            "resources:\n  gpus: [{pattern: '*', name: gpu}]\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n    - {name: nvidia.com/gpu, rename: fancy, devices: [0], replicas: 3}\n",
        )
        .unwrap();
        let s = Settings::resolve(Some(&f), &Overrides::default()).unwrap();
        assert_eq!(s.shared[0].advertised_name, "nvidia.com/gpu.shared");
        assert_eq!(s.notices.len(), 3, "{:?}", s.notices);
    }

    #[test]
    fn bad_inputs_are_named() {
        let bad = |text: &str, ov: Overrides| {
            let f = ConfigFile::parse("x", text)?;
            Settings::resolve(Some(&f), &ov)
        };
        assert_eq!(
            bad("version: v2", Overrides::default()).unwrap_err(),
            ConfigError::Version("v2".into())
        );
        let e = bad("flags: {migStrategy: both}", Overrides::default()).unwrap_err();
        assert!(e.to_string().contains("both"), "{e}");
        let e = bad(
            "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 1}]}}",
            Overrides::default(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("from 2 to 1024"), "{e}");
        for replicas in [1_025u64, 4_294_967_295] {
            let e = bad(
                &format!("sharing: {{timeSlicing: {{resources: [{{name: nvidia.com/gpu, replicas: {replicas}}}]}}}}"),
                Overrides::default(),
            )
            .unwrap_err()
            .to_string();
            assert!(
                e.contains(&format!("replicas = {replicas}")) && e.contains("1024"),
                "{e}"
            );
        }
        let e = bad(
            "sharing: {mps: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}",
            Overrides::default(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("mpsRoot"), "{e}");
        let e = bad(
            "flags: {mpsRoot: /run/nvidia/mps}\nsharing: {mps: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}",
            Overrides { mig_strategy: Some("mixed".into()), ..Overrides::default() },
        )
        .unwrap_err();
        assert!(e.to_string().contains("mixed"), "{e}");
        let e = bad("imex: {channelIDs: [1]}", Overrides::default()).unwrap_err();
        assert!(e.to_string().contains("imex.channelIDs"), "{e}");
        let e = bad(
            "{}",
            Overrides {
                device_list_strategy: Some("magic".into()),
                ..Overrides::default()
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("magic"), "{e}");
        let e = bad("bogus: 1", Overrides::default()).unwrap_err();
        assert!(matches!(e, ConfigError::Parse { .. }), "{e}");
    }

    #[test]
    fn mps_defaults_to_fail_requests_greater_than_one() {
        let f = ConfigFile::parse(
            "m",
            "flags: {mpsRoot: /run/nvidia/mps}\nsharing: {mps: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}",
        )
        .unwrap();
        let s = Settings::resolve(Some(&f), &Overrides::default()).unwrap();
        assert_eq!(s.sharing_strategy, SharingStrategy::Mps);
        assert!(s.fail_requests_greater_than_one);
    }

    #[test]
    fn intervals() {
        assert_eq!(parse_interval_secs("60s").unwrap(), 60);
        assert_eq!(parse_interval_secs("5m").unwrap(), 300);
        assert_eq!(parse_interval_secs("90").unwrap(), 90);
        assert!(parse_interval_secs("soon").is_err());
        assert!(parse_interval_secs("0s").is_err());
    }
}
