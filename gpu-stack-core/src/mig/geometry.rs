//! MIG geometry of one GPU model: GPU-instance profiles, their placements on
//! the memory-slice axis, and the compute-instance profiles inside them.
//!
//! The catalog ships a static geometry per model; a runtime source (NVML profile
//! and placement queries) can replace it for a device with
//! [`MigGeometry::with_runtime_profiles`], because the driver is the authority.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::name::{MediaVariant, MigProfileName, ProfileNameError};

/// A GPU-instance placement: `size` memory slices starting at `start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Placement {
    /// Index of the first occupied memory slice.
    pub start: u32,
    /// Number of memory slices occupied.
    pub size: u32,
}

/// Media engines a GPU instance owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MediaEngines {
    /// Video decoders (NVDEC).
    pub decoders: u32,
    /// Video encoders (NVENC).
    pub encoders: u32,
    /// JPEG decoders (NVJPG).
    pub jpeg: u32,
    /// Optical-flow accelerators (OFA).
    pub ofa: u32,
}

/// A compute-instance profile inside a GPU instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CiProfile {
    /// Name, e.g. `1c.3g.20gb` (or the GI name when it spans the whole GI).
    pub name: MigProfileName,
    /// NVML compute-instance profile enum (`NVML_COMPUTE_INSTANCE_PROFILE_*`),
    /// which nvidia-smi also prints as the CI profile id.
    pub nvml_profile_enum: u32,
    /// Compute slices it uses.
    pub compute_slices: u32,
    /// How many fit in one GPU instance.
    pub max_instances: u32,
    /// Placements in compute-slice units.
    pub placements: Vec<Placement>,
    /// True where the data is inferred rather than read from hardware.
    pub inferred: bool,
}

/// A GPU-instance profile of one GPU model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GiProfile {
    /// Name, e.g. `3g.40gb`, `1g.24gb+me.all`.
    pub name: MigProfileName,
    /// NVML GPU-instance profile enum (`NVML_GPU_INSTANCE_PROFILE_*`), the
    /// argument of `nvmlDeviceGetGpuInstanceProfileInfo`.
    pub nvml_profile_enum: u32,
    /// Device GI profile id (`info.id`; what `nvidia-smi mig -lgip`/`-cgi` use).
    pub id: u32,
    /// Compute slices (`g`).
    pub compute_slices: u32,
    /// Memory slices occupied, i.e. the placement size.
    pub memory_slices: u32,
    /// Memory in MiB as NVML reports it, where known; varies slightly by driver.
    pub memory_mib: Option<u64>,
    /// Streaming multiprocessors, where known.
    pub multiprocessors: Option<u32>,
    /// Most instances of this profile on one GPU.
    pub max_instances: u32,
    /// Allowed placements.
    pub placements: Vec<Placement>,
    /// Media engines of one instance.
    pub media: MediaEngines,
    /// True where the id or placements are inferred rather than read from hardware.
    pub inferred: bool,
    /// Compute-instance profiles inside one instance.
    pub ci_profiles: Vec<CiProfile>,
}

impl GiProfile {
    /// The media variant this profile is (from its name).
    pub fn media_variant(&self) -> MediaVariant {
        self.name.media_variant()
    }
}

/// Where a geometry came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GeometrySource {
    /// The built-in catalog.
    Catalog,
    /// Profile and placement queries against the device.
    Runtime,
}

/// The MIG geometry of a GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigGeometry {
    /// Length of the placement axis in memory slices (8 on A100/H100/B200, 4 on
    /// A30, 12 on RTX PRO 6000 Blackwell).
    pub memory_slices: u32,
    /// Compute slices of the whole GPU (7, 4, 4).
    pub compute_slices: u32,
    /// Most GPU instances on one GPU.
    pub max_instances: u32,
    /// Optical-flow accelerators of the whole GPU: at most this many OFA-holding
    /// instances can coexist.
    pub ofa_engines: u32,
    /// GPU-instance profiles, in the catalog's order.
    pub gi_profiles: Vec<GiProfile>,
    /// Where this geometry came from.
    pub source: GeometrySource,
}

/// A geometry that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GeometryError {
    /// The placement axis does not fit the engine's 64-slice bit masks.
    #[error("MIG geometry has {0} memory slices; at most 64 are supported")]
    AxisTooLong(u32),
    /// A placement runs past the axis or has the wrong size.
    #[error(
        "MIG profile {profile}: placement {start}:{size} does not fit a {axis}-slice GPU with profile size {profile_size}; fix the profile table"
    )]
    BadPlacement {
        /// Profile name.
        profile: String,
        /// Placement start.
        start: u32,
        /// Placement size.
        size: u32,
        /// Profile size.
        profile_size: u32,
        /// Axis length.
        axis: u32,
    },
    /// Two profiles share a name.
    #[error("MIG profile {0} appears twice in one geometry; names must be unique per GPU")]
    DuplicateProfile(String),
    /// A profile is a compute-instance name.
    #[error(
        "MIG profile {0} is a compute-instance profile; GPU-instance profiles have no <C>c. prefix"
    )]
    NotGpuInstance(String),
    /// Too many profiles for the engine.
    #[error("MIG geometry has {0} GPU-instance profiles; at most 32 are supported")]
    TooManyProfiles(usize),
}

impl MigGeometry {
    /// Checks the geometry is self-consistent (used by the planners before
    /// they build bit masks).
    pub fn check(&self) -> Result<(), GeometryError> {
        if self.memory_slices > 64 {
            return Err(GeometryError::AxisTooLong(self.memory_slices));
        }
        if self.gi_profiles.len() > 32 {
            return Err(GeometryError::TooManyProfiles(self.gi_profiles.len()));
        }
        for (i, p) in self.gi_profiles.iter().enumerate() {
            if !p.name.is_gpu_instance() || p.name.has_explicit_compute() {
                return Err(GeometryError::NotGpuInstance(p.name.to_string()));
            }
            if self.gi_profiles[..i].iter().any(|q| q.name == p.name) {
                return Err(GeometryError::DuplicateProfile(p.name.to_string()));
            }
            for pl in &p.placements {
                if pl.size != p.memory_slices
                    || pl.size == 0
                    || pl.start.saturating_add(pl.size) > self.memory_slices
                {
                    return Err(GeometryError::BadPlacement {
                        profile: p.name.to_string(),
                        start: pl.start,
                        size: pl.size,
                        profile_size: p.memory_slices,
                        axis: self.memory_slices,
                    });
                }
            }
        }
        Ok(())
    }

    /// This geometry with its profiles replaced by what the device reports
    /// (NVML `GetGpuInstanceProfileInfo` + `GetGpuInstancePossiblePlacements`).
    /// Compute-instance profiles missing from the runtime data are derived.
    pub fn with_runtime_profiles(
        &self,
        mut profiles: Vec<GiProfile>,
    ) -> Result<MigGeometry, GeometryError> {
        for p in &mut profiles {
            if p.ci_profiles.is_empty() {
                p.ci_profiles = derive_ci_profiles(&p.name, p.inferred);
            }
        }
        let memory_slices = profiles
            .iter()
            .flat_map(|p| p.placements.iter().map(|pl| pl.start + pl.size))
            .max()
            .unwrap_or(self.memory_slices)
            .max(self.memory_slices);
        let geometry = MigGeometry {
            memory_slices,
            gi_profiles: profiles,
            source: GeometrySource::Runtime,
            ..self.clone()
        };
        geometry.check()?;
        Ok(geometry)
    }

    /// The GPU-instance profile a name denotes on this GPU. A compute-instance
    /// name (`1c.3g.20gb`) resolves to its GPU instance.
    pub fn resolve(&self, name: &MigProfileName) -> Option<&GiProfile> {
        self.resolve_index(name).map(|i| &self.gi_profiles[i])
    }

    /// Index into `gi_profiles` of the profile a name denotes on this GPU.
    pub fn resolve_index(&self, name: &MigProfileName) -> Option<usize> {
        self.gi_profiles
            .iter()
            .position(|p| p.name.same_gpu_instance(name))
    }

    /// A profile by device GI profile id.
    pub fn by_id(&self, id: u32) -> Option<&GiProfile> {
        self.gi_profiles.iter().find(|p| p.id == id)
    }

    /// Names of all GPU-instance profiles, comma separated (for error messages).
    pub fn profile_list(&self) -> String {
        self.gi_profiles
            .iter()
            .map(|p| p.name.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Compute-instance profiles of a GI, by NVIDIA's rule: `C ≤ G` and
/// (`C == G` or `2C ≤ G + 1`); `floor(G / C)` per GI; placements at multiples of
/// `C` (placements are inferred).
pub fn derive_ci_profiles(gi: &MigProfileName, inferred: bool) -> Vec<CiProfile> {
    let g = gi.gpu_slices();
    let base = gi.gpu_instance();
    (1..=g)
        .filter(|&c| c == g || 2 * c <= g + 1)
        .map(|c| {
            let name = if c == g {
                base.clone()
            } else {
                base.clone().with_compute(c)
            };
            let placements = if c == g {
                vec![Placement { start: 0, size: c }]
            } else {
                (0..=g - c)
                    .step_by(c as usize)
                    .map(|start| Placement { start, size: c })
                    .collect()
            };
            CiProfile {
                name,
                nvml_profile_enum: ci_enum(c),
                compute_slices: c,
                max_instances: g / c,
                placements,
                inferred: inferred || c != g,
            }
        })
        .collect()
}

fn ci_enum(c: u32) -> u32 {
    match c {
        1 => 0,
        2 => 1,
        3 => 2,
        4 => 3,
        7 => 4,
        8 => 5,
        6 => 6,
        other => other,
    }
}

/// One GPU instance at an explicit placement: `3g.40gb@4`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PlacedInstance {
    /// Profile name (resolved per device).
    pub profile: MigProfileName,
    /// First memory slice.
    pub start: u32,
}

impl PlacedInstance {
    /// A placed instance.
    pub fn new(profile: MigProfileName, start: u32) -> Self {
        PlacedInstance { profile, start }
    }
}

/// Why a string is not `profile@start`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacedInstanceError {
    /// No `@start`.
    #[error(
        "invalid placed MIG instance {}: expected <profile>@<start>, e.g. \"3g.40gb@4\"",
        crate::echo::quoted(.0)
    )]
    MissingStart(String),
    /// Start is not a number.
    #[error(
        "invalid placed MIG instance {}: start {} is not a non-negative integer",
        crate::echo::quoted(.input),
        crate::echo::quoted(.start)
    )]
    BadStart {
        /// The whole input.
        input: String,
        /// The start text.
        start: String,
    },
    /// Bad profile name.
    #[error(transparent)]
    Profile(#[from] ProfileNameError),
}

impl FromStr for PlacedInstance {
    type Err = PlacedInstanceError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (name, start) = s
            .rsplit_once('@')
            .ok_or_else(|| PlacedInstanceError::MissingStart(s.to_string()))?;
        let profile = MigProfileName::parse(name)?;
        let start_num = if start.len() > 1 && start.starts_with('0') {
            None
        } else {
            start.parse::<u32>().ok()
        };
        let start = start_num.ok_or_else(|| PlacedInstanceError::BadStart {
            input: s.to_string(),
            start: start.to_string(),
        })?;
        Ok(PlacedInstance { profile, start })
    }
}

impl fmt::Display for PlacedInstance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.profile, self.start)
    }
}

impl Serialize for PlacedInstance {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PlacedInstance {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Parses a comma-separated layout: `"3g.40gb@4,1g.10gb@0"` (spaces around
/// commas allowed; an empty string is the empty layout).
pub fn parse_layout(s: &str) -> Result<Vec<PlacedInstance>, PlacedInstanceError> {
    s.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(str::parse)
        .collect()
}

/// Formats a layout as `"profile@start,…"`.
pub fn format_layout(layout: &[PlacedInstance]) -> String {
    layout
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// A multiset of profiles: `1g.10gb=2,3g.40gb=1`.
pub type Demand = Vec<(MigProfileName, u32)>;

/// Why a demand string is malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DemandError {
    /// No `=count`.
    #[error(
        "invalid MIG demand entry {}: expected <profile>=<count>, e.g. \"1g.10gb=2\"",
        crate::echo::quoted(.0)
    )]
    MissingCount(String),
    /// Count is not a number.
    #[error(
        "invalid MIG demand entry {}: the count is not a whole number from 0 to 4294967295",
        crate::echo::quoted(.0)
    )]
    BadCount(String),
    /// A profile is listed twice.
    #[error("MIG demand lists profile {0} twice; give each profile once")]
    Duplicate(String),
    /// Bad profile name.
    #[error(transparent)]
    Profile(#[from] ProfileNameError),
}

/// Parses `"1g.10gb=2,3g.40gb=1"` into a demand (order kept, duplicates rejected).
pub fn parse_demand(s: &str) -> Result<Demand, DemandError> {
    let mut out: Demand = Vec::new();
    for entry in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
        let (name, count) = entry
            .split_once('=')
            .ok_or_else(|| DemandError::MissingCount(entry.to_string()))?;
        let name = MigProfileName::parse(name.trim())?;
        let count = count
            .trim()
            .parse::<u32>()
            .map_err(|_| DemandError::BadCount(entry.to_string()))?;
        if out.iter().any(|(n, _)| *n == name) {
            return Err(DemandError::Duplicate(name.to_string()));
        }
        out.push((name, count));
    }
    Ok(out)
}
