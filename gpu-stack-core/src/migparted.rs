//! mig-parted configuration files (`version: v1`, `mig-configs`), parsed with
//! mig-parted's own validation rules, and checked against GPU geometries.
//!
//! The file NVIDIA ships for the MIG manager is embedded as
//! [`DEFAULT_CONFIG_YAML`]; the operator and MIG manager use it when no
//! config map is given.

use std::fmt;

use serde::Serialize;

use crate::catalog::{GpuModel, format_pci_id, parse_pci_id};
use crate::echo;
use crate::mig::{self, Demand, MigProfileName, PlacedInstance};

/// NVIDIA's published default mig-parted config file.
pub const DEFAULT_CONFIG_YAML: &str = include_str!("../data/mig-parted-config-default.yaml");

/// A parsed config file; configs keep file order.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct MigPartedConfig {
    /// Always `v1` (empty for an empty document).
    pub version: String,
    /// Named configs in file order.
    pub mig_configs: Vec<NamedConfig>,
}

/// One named config (`all-balanced`, ...).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NamedConfig {
    /// Config name.
    pub name: String,
    /// Entries, applied in order.
    pub entries: Vec<MigConfigSpec>,
}

/// One entry of a named config.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MigConfigSpec {
    /// GPUs it applies to by PCI id; empty = every GPU.
    pub device_filter: Vec<DeviceId>,
    /// GPU indices it applies to.
    pub devices: Devices,
    /// Whether MIG mode is on.
    pub mig_enabled: bool,
    /// Profile → count, in file order.
    pub mig_devices: Vec<(MigProfileName, u32)>,
    /// gpu-stack's extension: the exact GPU instances to create (start
    /// slices), when given; `None` lets the placement follow from the counts.
    /// They are the same instances as `mig_devices` counts. NVIDIA's
    /// mig-parted refuses unknown keys, so the file carries them in a
    /// comment it ignores ([`PLACEMENTS_MARKER`]).
    pub placements: Option<Vec<PlacedInstance>>,
}

/// Start of the comment line that carries an entry's placements:
/// `# gpustack.io/placements <config>[<entry>]: 3g.40gb@4 1g.10gb@0`
/// (instances separated by spaces: profile names may hold commas).
/// NVIDIA's mig-parted ignores comments (it refuses unknown keys), so a file
/// with placements still works with NVIDIA's MIG manager, which places the
/// counted instances itself.
pub const PLACEMENTS_MARKER: &str = "# gpustack.io/placements ";

/// Most placements one entry may carry (a GPU holds at most 7 GPU instances;
/// the bound leaves room for geometries with more memory slices).
pub const MAX_PLACEMENTS: usize = 16;

/// The comment line (without indent or newline) carrying `placements` of
/// entry `entry` of config `config`.
pub fn placements_comment(config: &str, entry: usize, placements: &[PlacedInstance]) -> String {
    let list: Vec<String> = placements.iter().map(ToString::to_string).collect();
    format!("{PLACEMENTS_MARKER}{config}[{entry}]: {}", list.join(" "))
}

/// Checks that `placements` are the instances `mig_devices` counts: only
/// GPU-instance profiles, each as often as its (non-zero) count. The reason
/// says what differs.
pub fn placements_agree(
    mig_devices: &[(MigProfileName, u32)],
    placements: &[PlacedInstance],
) -> Result<(), String> {
    if placements.len() > MAX_PLACEMENTS {
        return Err(format!(
            "{} placements; at most {MAX_PLACEMENTS}",
            placements.len()
        ));
    }
    if let Some((p, _)) = mig_devices
        .iter()
        .find(|(p, c)| *c > 0 && !p.is_gpu_instance())
    {
        return Err(format!(
            "placements give GPU instances, but the counts include the compute-instance profile {p}; use whole GPU-instance profiles with placements"
        ));
    }
    let mut placed: Vec<(&MigProfileName, u32)> = Vec::new();
    for i in placements {
        match placed.iter_mut().find(|(p, _)| **p == i.profile) {
            Some((_, n)) => *n += 1,
            None => placed.push((&i.profile, 1)),
        }
    }
    for (p, n) in &placed {
        let want = mig_devices
            .iter()
            .find(|(q, _)| q == *p)
            .map_or(0, |(_, c)| *c);
        if want != *n {
            return Err(format!(
                "placements place {n} {p} but the counts ask for {want}; give one placement per counted instance"
            ));
        }
    }
    for (p, c) in mig_devices.iter().filter(|(_, c)| *c > 0) {
        if !placed.iter().any(|(q, _)| *q == p) {
            return Err(format!(
                "the counts ask for {c} {p} but placements place none; give one placement per counted instance"
            ));
        }
    }
    Ok(())
}

/// `devices: all | [0, 1]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Devices {
    /// Every GPU.
    All,
    /// These indices.
    Indices(Vec<u32>),
}

impl Devices {
    /// Whether GPU `index` is selected.
    pub fn includes(&self, index: u32) -> bool {
        match self {
            Devices::All => true,
            Devices::Indices(v) => v.contains(&index),
        }
    }
}

impl fmt::Display for Devices {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Devices::All => f.write_str("all"),
            Devices::Indices(v) => write!(f, "[{}]", echo::join_capped(v)),
        }
    }
}

/// A `device-filter` entry: `0x20B010DE` or `0x20B010DE:0x147E10DE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DeviceId {
    /// PCI `<device><vendor>`.
    pub device: u32,
    /// PCI `<subdevice><subvendor>`, when given.
    pub subsystem: Option<u32>,
}

impl DeviceId {
    /// Parses `0x20B010DE[:0x147E10DE]`.
    pub fn parse(s: &str) -> Option<DeviceId> {
        let (dev, sub) = match s.split_once(':') {
            Some((d, s)) => (d, Some(s)),
            None => (s, None),
        };
        let device = parse_pci_id(dev)?;
        let subsystem = match sub {
            Some(s) => Some(parse_pci_id(s)?),
            None => None,
        };
        Some(DeviceId { device, subsystem })
    }

    /// Whether a GPU with these ids matches.
    pub fn matches(&self, device: u32, subsystem: Option<u32>) -> bool {
        self.device == device
            && match self.subsystem {
                None => true,
                Some(s) => subsystem == Some(s),
            }
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_pci_id(self.device))?;
        if let Some(s) = self.subsystem {
            write!(f, ":{}", format_pci_id(s))?;
        }
        Ok(())
    }
}

impl MigConfigSpec {
    /// Whether the entry's filter admits a GPU with these PCI ids.
    pub fn matches_device(&self, device: u32, subsystem: Option<u32>) -> bool {
        self.device_filter.is_empty()
            || self
                .device_filter
                .iter()
                .any(|f| f.matches(device, subsystem))
    }

    /// Whether the entry applies to a catalog model (any of its PCI ids).
    pub fn matches_model(&self, model: &GpuModel) -> bool {
        model
            .pci_device_ids
            .iter()
            .any(|id| self.matches_device(*id, None))
    }

    /// The profile counts as a demand.
    pub fn demand(&self) -> Demand {
        self.mig_devices.clone()
    }
}

/// A config file that mig-parted would reject.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("mig-parted config: {path}: {reason}")]
pub struct MigPartedError {
    /// Where in the file (`mig-configs.all-balanced[2].mig-devices`).
    pub path: String,
    /// What is wrong and how to fix it.
    pub reason: String,
}

fn err(path: impl Into<String>, reason: impl Into<String>) -> MigPartedError {
    MigPartedError {
        path: path.into(),
        reason: reason.into(),
    }
}

/// An untyped YAML value as a mig-parted file is read: mappings keep file
/// order and any key type, so messages can name what was written.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `~`, `null` or nothing.
    Null,
    /// `true` or `false`.
    Bool(bool),
    /// A number, as YAML wrote it.
    Number(serde_json::Number),
    /// A string.
    String(String),
    /// A list.
    Sequence(Vec<Value>),
    /// A mapping, in file order.
    Mapping(Vec<(Value, Value)>),
}

impl Value {
    fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    fn as_u64(&self) -> Option<u64> {
        match self {
            Value::Number(n) => n.as_u64(),
            _ => None,
        }
    }

    fn as_i64(&self) -> Option<i64> {
        match self {
            Value::Number(n) => n.as_i64(),
            _ => None,
        }
    }
}

impl<'de> serde::Deserialize<'de> for Value {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Value, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Value;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any YAML value")
            }
            fn visit_unit<E>(self) -> Result<Value, E> {
                Ok(Value::Null)
            }
            fn visit_none<E>(self) -> Result<Value, E> {
                Ok(Value::Null)
            }
            fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
                serde::Deserialize::deserialize(d)
            }
            fn visit_bool<E>(self, b: bool) -> Result<Value, E> {
                Ok(Value::Bool(b))
            }
            fn visit_i64<E>(self, n: i64) -> Result<Value, E> {
                Ok(Value::Number(n.into()))
            }
            fn visit_u64<E>(self, n: u64) -> Result<Value, E> {
                Ok(Value::Number(n.into()))
            }
            fn visit_f64<E>(self, n: f64) -> Result<Value, E> {
                // Non-finite floats have no JSON number; keep their spelling.
                Ok(serde_json::Number::from_f64(n)
                    .map(Value::Number)
                    .unwrap_or_else(|| Value::String(n.to_string())))
            }
            fn visit_str<E>(self, s: &str) -> Result<Value, E> {
                Ok(Value::String(s.to_string()))
            }
            fn visit_string<E>(self, s: String) -> Result<Value, E> {
                Ok(Value::String(s))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<Value, A::Error> {
                let mut out = Vec::new();
                while let Some(v) = a.next_element()? {
                    out.push(v);
                }
                Ok(Value::Sequence(out))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut a: A) -> Result<Value, A::Error> {
                let mut out = Vec::new();
                while let Some(kv) = a.next_entry()? {
                    out.push(kv);
                }
                Ok(Value::Mapping(out))
            }
        }
        d.deserialize_any(V)
    }
}

fn key_str(k: &Value, path: &str) -> Result<String, MigPartedError> {
    k.as_str()
        .map(str::to_string)
        .ok_or_else(|| err(path, format!("keys must be strings, found {}", describe(k))))
}

/// A YAML value in words, for messages: `the string "v2"`, `the number 2.5`,
/// `false`, `a list of 3 items`; echoed text is clipped.
pub fn describe(v: &Value) -> String {
    match v {
        Value::Null => "nothing (an empty value)".into(),
        Value::Bool(b) => format!("{b}"),
        // serde_json writes `1e+166`; YAML and mig-parted write `1e166`.
        Value::Number(n) => format!(
            "the number {}",
            echo::clipped(&n.to_string().replace("e+", "e"))
        ),
        Value::String(s) => format!("the string {}", echo::quoted(s)),
        Value::Sequence(l) => match l.len() {
            0 => "an empty list".into(),
            1 => "a list of 1 item".into(),
            n => format!("a list of {n} items"),
        },
        Value::Mapping(m) => match m.len() {
            0 => "an empty mapping".into(),
            1 => "a mapping of 1 key".into(),
            n => format!("a mapping of {n} keys"),
        },
    }
}

impl MigPartedConfig {
    /// The embedded default file, parsed.
    pub fn default_config() -> Result<MigPartedConfig, MigPartedError> {
        MigPartedConfig::from_yaml(DEFAULT_CONFIG_YAML)
    }

    /// Names of all configs.
    pub fn names(&self) -> Vec<&str> {
        self.mig_configs.iter().map(|c| c.name.as_str()).collect()
    }

    /// A config by name.
    pub fn get(&self, name: &str) -> Option<&NamedConfig> {
        self.mig_configs.iter().find(|c| c.name == name)
    }

    /// Parses with mig-parted's rules (reference/mig.md §8.1). Text nesting
    /// deeper than [`crate::yaml_guard::MAX_DEPTH`] or larger than
    /// [`crate::yaml_guard::MAX_BYTES`] is refused before parsing.
    pub fn from_yaml(text: &str) -> Result<MigPartedConfig, MigPartedError> {
        crate::yaml_guard::check(text)
            .map_err(|e| err("(document)", format!("refused before parsing: {e}")))?;
        let doc: Value = crate::yaml_guard::from_str(text).map_err(|e| {
            err(
                "(document)",
                format!("not YAML: {}", crate::yaml_guard::message(&e)),
            )
        })?;
        let map = match doc {
            Value::Null => {
                return Err(err(
                    "(document)",
                    "is empty (no YAML, `~` or only comments); a mig-parted file needs `version: v1` and at least one config under `mig-configs`",
                ));
            }
            Value::Mapping(m) => m,
            other => {
                return Err(err(
                    "(document)",
                    format!(
                        "expected a mapping with version and mig-configs, found {}",
                        describe(&other)
                    ),
                ));
            }
        };
        let mut version = None;
        let mut configs = None;
        for (k, v) in &map {
            match key_str(k, "(document)")?.as_str() {
                "version" => version = Some(v),
                "mig-configs" => configs = Some(v),
                other => {
                    return Err(err(
                        echo::clipped(other).to_string(),
                        "unknown top-level field; only version and mig-configs are allowed",
                    ));
                }
            }
        }
        let version = match version {
            Some(Value::String(s)) if s == "v1" => s.clone(),
            Some(v) => {
                return Err(err(
                    "version",
                    format!(
                        "unsupported version {}; only v1 exists, write `version: v1`",
                        describe(v)
                    ),
                ));
            }
            None => return Err(err("version", "missing; add `version: v1`")),
        };
        let configs = match configs {
            Some(Value::Mapping(m)) if !m.is_empty() => m,
            Some(Value::Mapping(_)) => {
                return Err(err("mig-configs", "is empty; define at least one config"));
            }
            Some(v) => {
                return Err(err(
                    "mig-configs",
                    format!("must map config names to lists, found {}", describe(v)),
                ));
            }
            None => return Err(err("mig-configs", "missing")),
        };
        let mut mig_configs = Vec::new();
        for (k, v) in configs {
            let name = key_str(k, "mig-configs")?;
            let path = format!("mig-configs.{}", echo::clipped(&name));
            let Value::Sequence(items) = v else {
                return Err(err(path, "must be a list of entries"));
            };
            if items.is_empty() {
                return Err(err(path, "has no entries"));
            }
            let entries = items
                .iter()
                .enumerate()
                .map(|(i, item)| parse_spec(item, &format!("{path}[{i}]")))
                .collect::<Result<Vec<_>, _>>()?;
            mig_configs.push(NamedConfig { name, entries });
        }
        apply_placement_comments(text, &mut mig_configs)?;
        Ok(MigPartedConfig {
            version,
            mig_configs,
        })
    }
}

/// Reads the [`PLACEMENTS_MARKER`] comment lines of `text` into the entries
/// they name; a line naming no entry, or placements that differ from the
/// entry's counts, is an error.
fn apply_placement_comments(text: &str, configs: &mut [NamedConfig]) -> Result<(), MigPartedError> {
    for (line_no, line) in text.lines().enumerate() {
        let Some(rest) = line.trim_start().strip_prefix(PLACEMENTS_MARKER) else {
            continue;
        };
        let at = format!("(comment on line {})", line_no + 1);
        let shape = "expected `# gpustack.io/placements <config>[<entry>]: <profile>@<start> ...`";
        let (target, layout) = rest
            .split_once("]:")
            .ok_or_else(|| err(&at, format!("{shape}, found {}", echo::quoted(rest))))?;
        let (config, entry) = target
            .split_once('[')
            .ok_or_else(|| err(&at, format!("{shape}, found {}", echo::quoted(rest))))?;
        let entry: usize = entry.parse().map_err(|_| {
            err(
                &at,
                format!("entry {} is not an index; {shape}", echo::quoted(entry)),
            )
        })?;
        let path = format!("mig-configs.{}[{entry}]", echo::clipped(config));
        let spec = configs
            .iter_mut()
            .find(|c| c.name == config)
            .and_then(|c| c.entries.get_mut(entry))
            .ok_or_else(|| {
                err(
                    &path,
                    "placements name an entry the file does not have; fix or remove the comment",
                )
            })?;
        let path = format!("{path}.placements");
        if spec.placements.is_some() {
            return Err(err(path, "placements are given twice; keep one comment"));
        }
        if !spec.mig_enabled {
            return Err(err(
                path,
                "given while mig-enabled is false; remove them or enable MIG",
            ));
        }
        let layout = layout
            .split_whitespace()
            .take(MAX_PLACEMENTS + 1)
            .map(str::parse::<PlacedInstance>)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| err(&path, e.to_string()))?;
        placements_agree(&spec.mig_devices, &layout).map_err(|e| err(&path, e))?;
        spec.placements = Some(layout);
    }
    Ok(())
}

fn parse_spec(v: &Value, path: &str) -> Result<MigConfigSpec, MigPartedError> {
    let Value::Mapping(m) = v else {
        return Err(err(path, "an entry must be a mapping"));
    };
    let (mut filter, mut devices, mut enabled, mut mig_devices) = (None, None, None, None);
    for (k, v) in m {
        match key_str(k, path)?.as_str() {
            "device-filter" => filter = Some(v),
            "devices" => devices = Some(v),
            "mig-enabled" => enabled = Some(v),
            "mig-devices" => mig_devices = Some(v),
            other => {
                return Err(err(
                    format!("{path}.{}", echo::clipped(other)),
                    "unknown field; allowed: device-filter, devices, mig-enabled, mig-devices",
                ));
            }
        }
    }
    let fpath = format!("{path}.device-filter");
    let device_filter = match filter {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![parse_filter(s, &fpath)?],
        Some(Value::Sequence(list)) => list
            .iter()
            .map(|x| match x {
                Value::String(s) => parse_filter(s, &fpath),
                other => Err(err(&fpath, format!("{} is not a string", describe(other)))),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(err(
                fpath,
                format!(
                    "must be a string or a list of strings, found {}",
                    describe(other)
                ),
            ));
        }
    };
    let dpath = format!("{path}.devices");
    let devices = match devices {
        None => return Err(err(dpath, "missing; use `all` or a list of GPU indices")),
        Some(Value::String(s)) if s == "all" => Devices::All,
        Some(Value::Sequence(list)) => Devices::Indices(
            list.iter()
                .map(|x| {
                    x.as_u64()
                        .and_then(|n| u32::try_from(n).ok())
                        .ok_or_else(|| {
                            err(
                                &dpath,
                                format!("{} is not a non-negative GPU index", describe(x)),
                            )
                        })
                })
                .collect::<Result<_, _>>()?,
        ),
        Some(other) => {
            return Err(err(
                dpath,
                format!(
                    "must be exactly \"all\" or a list of GPU indices, found {}",
                    describe(other)
                ),
            ));
        }
    };
    let epath = format!("{path}.mig-enabled");
    let mig_enabled = match enabled {
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(err(
                epath,
                format!("must be true or false, found {}", describe(other)),
            ));
        }
        None => return Err(err(epath, "missing; set true or false")),
    };
    let mpath = format!("{path}.mig-devices");
    let mut devices_list = Vec::new();
    let present = match mig_devices {
        None | Some(Value::Null) => false,
        Some(Value::Mapping(md)) => {
            for (k, v) in md {
                let raw = key_str(k, &mpath)?;
                // The key as echoed in paths (clipped when long).
                let key = echo::clipped(&raw).to_string();
                let name = MigProfileName::parse(&raw)
                    .map_err(|e| err(format!("{mpath}.{key}"), e.to_string()))?;
                let count = v.as_i64().ok_or_else(|| {
                    err(
                        format!("{mpath}.{key}"),
                        format!(
                            "count {} is not a whole number; give a count like 2",
                            describe(v)
                        ),
                    )
                })?;
                if count < 0 {
                    return Err(err(
                        format!("{mpath}.{key}"),
                        format!("count {count} is negative; give 0 or more"),
                    ));
                }
                let count = u32::try_from(count).map_err(|_| {
                    err(
                        format!("{mpath}.{key}"),
                        format!(
                            "count {count} is too large; one GPU holds a few instances of a profile (`gpu-stack mig profiles --model MODEL` lists each profile's maximum)"
                        ),
                    )
                })?;
                if devices_list.iter().any(|(n, _)| *n == name) {
                    return Err(err(format!("{mpath}.{key}"), "profile is listed twice"));
                }
                devices_list.push((name, count));
            }
            true
        }
        Some(other) => {
            return Err(err(
                mpath,
                format!(
                    "must map profile names to counts, found {}",
                    describe(other)
                ),
            ));
        }
    };
    if mig_enabled && !present {
        return Err(err(
            mpath,
            "missing while mig-enabled is true; list profiles (or {} for MIG on with no devices)",
        ));
    }
    if !mig_enabled && !devices_list.is_empty() {
        return Err(err(
            mpath,
            "given while mig-enabled is false; remove it or enable MIG",
        ));
    }
    if !devices_list.is_empty() && devices_list.iter().all(|(_, c)| *c == 0) {
        return Err(err(
            mpath,
            "all counts are 0; give at least one non-zero count",
        ));
    }
    Ok(MigConfigSpec {
        device_filter,
        devices,
        mig_enabled,
        mig_devices: devices_list,
        placements: None,
    })
}

fn parse_filter(s: &str, path: &str) -> Result<DeviceId, MigPartedError> {
    DeviceId::parse(s).ok_or_else(|| {
        err(
            path,
            format!(
                "{} is not a PCI id like 0x20B010DE or 0x20B010DE:0x147E10DE",
                echo::quoted(s)
            ),
        )
    })
}

/// Verdict on one config entry for one GPU model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "verdict", rename_all = "kebab-case")]
pub enum EntryVerdict {
    /// MIG off: nothing to place.
    Disabled,
    /// Fits; a placement that realises it.
    Valid {
        /// Explicit placements.
        layout: Vec<PlacedInstance>,
    },
    /// Cannot be applied.
    Invalid {
        /// Why not.
        reason: String,
    },
}

/// One entry checked against one model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EntryCheck {
    /// Index of the entry in the config.
    pub entry: usize,
    /// GPU indices it selects.
    pub devices: String,
    /// The verdict.
    #[serde(flatten)]
    pub verdict: EntryVerdict,
}

/// One named config checked against one model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConfigCheck {
    /// Config name.
    pub config: String,
    /// Model name.
    pub model: String,
    /// `valid`, `invalid` or `not-applicable` (no entry matches the model).
    pub status: CheckStatus,
    /// Matching entries.
    pub entries: Vec<EntryCheck>,
}

/// Summary of a [`ConfigCheck`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CheckStatus {
    /// Every matching entry can be applied.
    Valid,
    /// Some matching entry cannot.
    Invalid,
    /// No entry's device-filter matches the model.
    NotApplicable,
}

impl fmt::Display for CheckStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CheckStatus::Valid => "valid",
            CheckStatus::Invalid => "invalid",
            CheckStatus::NotApplicable => "not-applicable",
        })
    }
}

/// Checks one entry against a model's geometry.
pub fn check_entry(spec: &MigConfigSpec, model: &GpuModel) -> EntryVerdict {
    if !spec.mig_enabled {
        return EntryVerdict::Disabled;
    }
    let Some(geometry) = &model.mig else {
        return EntryVerdict::Invalid {
            reason: format!("{} does not support MIG", model.name),
        };
    };
    if let Some(layout) = &spec.placements {
        return match mig::validate(geometry, layout) {
            Ok(()) => EntryVerdict::Valid {
                layout: layout.clone(),
            },
            Err(v) => EntryVerdict::Invalid {
                reason: format!(
                    "placements {}: {}",
                    mig::format_layout(layout),
                    echo::join_capped(&v)
                ),
            },
        };
    }
    let demand: Demand = spec
        .mig_devices
        .iter()
        .filter(|(_, c)| *c > 0)
        .cloned()
        .collect();
    match mig::fit(geometry, &demand) {
        Ok(layout) => EntryVerdict::Valid { layout },
        Err(e) => EntryVerdict::Invalid {
            reason: e.to_string(),
        },
    }
}

/// Checks every named config against every given model.
pub fn check(config: &MigPartedConfig, models: &[&GpuModel]) -> Vec<ConfigCheck> {
    let mut out = Vec::new();
    for named in &config.mig_configs {
        for model in models {
            let entries: Vec<EntryCheck> = named
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| e.matches_model(model))
                .map(|(i, e)| EntryCheck {
                    entry: i,
                    devices: e.devices.to_string(),
                    verdict: check_entry(e, model),
                })
                .collect();
            let status = if entries.is_empty() {
                CheckStatus::NotApplicable
            } else if entries
                .iter()
                .all(|e| !matches!(e.verdict, EntryVerdict::Invalid { .. }))
            {
                CheckStatus::Valid
            } else {
                CheckStatus::Invalid
            };
            out.push(ConfigCheck {
                config: named.name.clone(),
                model: model.name.clone(),
                status,
                entries,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog;
    use proptest::prelude::*;

    fn deep_inputs() -> [String; 2] {
        [
            "[".repeat(100_000),
            format!("{}1{}", "{a: ".repeat(100_000), "}".repeat(100_000)),
        ]
    }

    #[test]
    fn deeply_nested_config_is_refused_before_parsing() {
        for text in deep_inputs() {
            let e = MigPartedConfig::from_yaml(&text).unwrap_err();
            assert_eq!(e.path, "(document)");
            assert!(
                e.reason
                    .starts_with("refused before parsing: YAML nests deeper than 64"),
                "{e}"
            );
        }
        // nested under a real key, too
        let text = format!("version: v1\nmig-configs: {}\n", "[".repeat(100_000));
        assert!(
            MigPartedConfig::from_yaml(&text)
                .unwrap_err()
                .reason
                .contains("line 2")
        );
    }

    fn reason(text: &str) -> String {
        MigPartedConfig::from_yaml(text).unwrap_err().to_string()
    }

    #[test]
    fn wrong_values_are_described_in_words() {
        for (text, want) in [
            ("version: v2\nmig-configs: {}\n", "the string \"v2\""),
            (
                "version: 1.11e166\nmig-configs: {}\n",
                "the number 1.11e166",
            ),
            (
                "version: v1\nmig-configs:\n  a:\n    - {devices: all, mig-enabled: 1}\n",
                "found the number 1",
            ),
            (
                "version: v1\nmig-configs:\n  a:\n    - {devices: false, mig-enabled: false}\n",
                "found false",
            ),
            (
                "version: v1\nmig-configs:\n  a:\n    - {devices: all, mig-enabled: true, mig-devices: {1g.10gb: x}}\n",
                "count the string \"x\" is not a whole number",
            ),
            (
                "version: v1\nmig-configs:\n  a:\n    - {devices: all, mig-enabled: true, mig-devices: [1, 2]}\n",
                "found a list of 2 items",
            ),
            ("[1]\n", "found a list of 1 item"),
        ] {
            let r = reason(text);
            assert!(r.contains(want), "{text:?}: {r}");
            for debug in ["String(", "Number(", "Bool(", "Sequence(", "Mapping("] {
                assert!(!r.contains(debug), "{text:?}: {r}");
            }
        }
    }

    #[test]
    fn a_huge_count_is_refused_per_gpu_without_allocating() {
        let c = MigPartedConfig::from_yaml(
            "version: v1\nmig-configs:\n  big:\n    - {devices: all, mig-enabled: true, mig-devices: {1g.10gb: 4294967295}}\n",
        )
        .unwrap();
        let h100 = catalog::lookup("H100-SXM5-80GB").unwrap();
        let report = check(&c, &[h100]);
        assert_eq!(report[0].status, CheckStatus::Invalid);
        let EntryVerdict::Invalid { reason: why } = &report[0].entries[0].verdict else {
            panic!("{report:?}");
        };
        assert!(
            why.contains("4294967295") && why.contains("at most 7"),
            "{why}"
        );
        let r = reason(
            "version: v1\nmig-configs:\n  a:\n    - {devices: all, mig-enabled: true, mig-devices: {1g.10gb: 4294967296}}\n",
        );
        assert!(r.contains("4294967296 is too large"), "{r}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Whatever the size of the names, keys and values in a broken file,
        /// the message stays small.
        #[test]
        fn messages_stay_small_whatever_the_input(
            len in 0usize..20_000,
            which in 0usize..6,
        ) {
            let big = "x".repeat(len);
            let text = match which {
                0 => format!("version: {big}\nmig-configs: {{}}\n"),
                1 => format!("{big}: 1\n"),
                2 => format!("version: v1\nmig-configs:\n  {big}: 1\n"),
                3 => format!("version: v1\nmig-configs:\n  a:\n    - {{devices: all, mig-enabled: true, mig-devices: {{{big}: 1}}}}\n"),
                4 => format!("version: v1\nmig-configs:\n  a:\n    - {{devices: all, device-filter: \"{big}\", mig-enabled: false}}\n"),
                _ => format!("version: v1\nmig-configs:\n  a:\n    - {{devices: all, {big}: 1, mig-enabled: false}}\n"),
            };
            if let Err(e) = MigPartedConfig::from_yaml(&text) {
                prop_assert!(e.to_string().len() < 1_500, "{} bytes", e.to_string().len());
            }
        }
    }
}
