//! Catalog of NVIDIA data-center GPUs: names, PCI device ids, architecture,
//! memory, compute capability and MIG geometry.
//!
//! Keyed by PCI device id (`0x20B010DE`: device `0x20B0`, vendor `0x10DE`) as
//! NVML and mig-parted `device-filter`s spell it. MIG data that public sources
//! do not confirm (ids and placements of some Hopper/Blackwell parts) is kept
//! and flagged `inferred`; a runtime source can override it per device with
//! [`MigGeometry::with_runtime_profiles`].
//!
//! `memory_mib` is the nominal board memory; a device's exact total comes from
//! NVML at runtime.

use std::fmt;
use std::sync::LazyLock;

use serde::{Deserialize, Serialize};

use crate::mig::{
    GeometrySource, GiProfile, MediaEngines, MigGeometry, MigProfileName, Placement,
    derive_ci_profiles,
};

/// GPU architecture generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    /// Compute capability 7.0.
    Volta,
    /// 7.5.
    Turing,
    /// 8.0 / 8.6.
    Ampere,
    /// 8.9.
    Ada,
    /// 9.0.
    Hopper,
    /// 10.x / 12.x.
    Blackwell,
}

impl fmt::Display for Architecture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Architecture::Volta => "volta",
            Architecture::Turing => "turing",
            Architecture::Ampere => "ampere",
            Architecture::Ada => "ada-lovelace",
            Architecture::Hopper => "hopper",
            Architecture::Blackwell => "blackwell",
        })
    }
}

/// One GPU model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuModel {
    /// Canonical name used by gpu-stack, e.g. `A100-SXM4-40GB`.
    pub name: String,
    /// Product name as NVML reports it, e.g. `NVIDIA A100-SXM4-40GB`.
    pub product_name: String,
    /// PCI device ids (`0x<device><vendor>`), e.g. `0x20B010DE`.
    pub pci_device_ids: Vec<u32>,
    /// Architecture.
    pub architecture: Architecture,
    /// Nominal board memory in MiB.
    pub memory_mib: u64,
    /// CUDA compute capability (major, minor).
    pub compute_capability: (u32, u32),
    /// MIG geometry; `None` for GPUs without MIG.
    pub mig: Option<MigGeometry>,
}

impl GpuModel {
    /// The first PCI device id formatted as mig-parted writes it (`0x20B010DE`).
    pub fn pci_id_string(&self) -> String {
        self.pci_device_ids
            .first()
            .map(|id| format_pci_id(*id))
            .unwrap_or_default()
    }
}

/// Formats a PCI device id as `0x20B010DE`.
pub fn format_pci_id(id: u32) -> String {
    format!("0x{id:08X}")
}

/// Parses `0x20B010DE` (case-insensitive, `0x` required).
pub fn parse_pci_id(s: &str) -> Option<u32> {
    let hex = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X"))?;
    if hex.len() != 8 {
        return None;
    }
    u32::from_str_radix(hex, 16).ok()
}

/// A catalog lookup that found nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CatalogError {
    /// No model by that name or id.
    #[error(
        "unknown GPU model {}: give a catalog name (see `gpu-stack mig models`) or a PCI device id like 0x20B010DE",
        crate::echo::quoted(.0)
    )]
    UnknownModel(String),
}

/// All models, built once.
pub fn models() -> &'static [GpuModel] {
    static MODELS: LazyLock<Vec<GpuModel>> = LazyLock::new(build);
    &MODELS
}

/// Looks up a model by canonical name (case-insensitive), NVML product name,
/// or PCI device id (`0x20B010DE`).
pub fn lookup(name_or_pci: &str) -> Result<&'static GpuModel, CatalogError> {
    let key = name_or_pci.trim();
    if let Some(id) = parse_pci_id(key) {
        return by_pci_device_id(id).ok_or_else(|| CatalogError::UnknownModel(key.to_string()));
    }
    models()
        .iter()
        .find(|m| m.name.eq_ignore_ascii_case(key) || m.product_name.eq_ignore_ascii_case(key))
        .ok_or_else(|| CatalogError::UnknownModel(key.to_string()))
}

/// The model with this PCI device id.
pub fn by_pci_device_id(id: u32) -> Option<&'static GpuModel> {
    models().iter().find(|m| m.pci_device_ids.contains(&id))
}

/// Looks up a model by the product name NVML reports (exact, then
/// case-insensitive).
pub fn by_product_name(product: &str) -> Option<&'static GpuModel> {
    models()
        .iter()
        .find(|m| m.product_name == product)
        .or_else(|| {
            models()
                .iter()
                .find(|m| m.product_name.eq_ignore_ascii_case(product))
        })
}

// ---------------------------------------------------------------------------
// Static data. Sources and confidence per table: reference/mig.md §2 and §10.

const fn me(decoders: u32, encoders: u32, jpeg: u32, ofa: u32) -> MediaEngines {
    MediaEngines {
        decoders,
        encoders,
        jpeg,
        ofa,
    }
}

/// One GPU-instance profile row of the catalog, by field.
struct GiRow<'a> {
    name: MigProfileName,
    nvml_profile_enum: u32,
    id: u32,
    /// Compute slices (the `g` of the name).
    compute_slices: u32,
    /// Memory slices; also the size of every placement.
    memory_slices: u32,
    max_instances: u32,
    /// Placement starts.
    starts: &'a [u32],
    memory_mib: Option<u64>,
    multiprocessors: Option<u32>,
    media: MediaEngines,
    inferred: bool,
}

fn gi(row: GiRow<'_>) -> GiProfile {
    let GiRow {
        name,
        nvml_profile_enum,
        id,
        compute_slices,
        memory_slices,
        max_instances,
        starts,
        memory_mib,
        multiprocessors,
        media,
        inferred,
    } = row;
    let ci_profiles = derive_ci_profiles(&name, inferred);
    GiProfile {
        name,
        nvml_profile_enum,
        id,
        compute_slices,
        memory_slices,
        memory_mib,
        multiprocessors,
        max_instances,
        placements: starts
            .iter()
            .map(|&start| Placement {
                start,
                size: memory_slices,
            })
            .collect(),
        media,
        inferred,
        ci_profiles,
    }
}

/// Rows of the 8-memory-slice / 7-compute-slice family (A100, H100, H200,
/// GH200, B200, GB200, B300, GB300), in order 1g, 1g+me, 1g (double memory),
/// 2g, 3g, 4g, 7g.
struct EightSlot {
    /// Memory GB in the names: 1g, 1g-double, 2g, 3g, 4g, 7g.
    gb: [u32; 6],
    /// MiB for the same rows.
    mib: [Option<u64>; 6],
    /// SMs for the same rows.
    sm: [Option<u32>; 6],
    /// Media engines for 1g, 1g+me, 1g-double, 2g, 3g, 4g, 7g.
    media: [MediaEngines; 7],
    /// Whether the `+me` profile exists.
    has_me: bool,
    /// Whether the ids/placements are inferred (all rows).
    inferred: bool,
}

const A100_MEDIA: [MediaEngines; 7] = [
    me(0, 0, 0, 0),
    me(1, 0, 1, 1),
    me(1, 0, 0, 0),
    me(1, 0, 0, 0),
    me(2, 0, 0, 0),
    me(2, 0, 0, 0),
    me(5, 0, 1, 1),
];

const HOPPER_MEDIA: [MediaEngines; 7] = [
    me(1, 0, 1, 0),
    me(1, 0, 1, 1),
    me(1, 0, 1, 0),
    me(2, 0, 2, 0),
    me(3, 0, 3, 0),
    me(4, 0, 4, 0),
    me(7, 0, 7, 1),
];

fn eight_slot(s: EightSlot) -> MigGeometry {
    let n = |g: u32, gb: u32| MigProfileName::new(g, gb);
    let inf = s.inferred;
    let mut profiles = vec![gi(GiRow {
        name: n(1, s.gb[0]),
        nvml_profile_enum: 0x0,
        id: 19,
        compute_slices: 1,
        memory_slices: 1,
        max_instances: 7,
        starts: &[0, 1, 2, 3, 4, 5, 6],
        memory_mib: s.mib[0],
        multiprocessors: s.sm[0],
        media: s.media[0],
        inferred: inf,
    })];
    if s.has_me {
        profiles.push(gi(GiRow {
            name: n(1, s.gb[0]).with_attribute("me"),
            nvml_profile_enum: 0x7,
            id: 20,
            compute_slices: 1,
            memory_slices: 1,
            max_instances: 1,
            starts: &[0, 1, 2, 3, 4, 5, 6],
            memory_mib: s.mib[0],
            multiprocessors: s.sm[0],
            media: s.media[1],
            inferred: inf,
        }));
    }
    profiles.extend([
        gi(GiRow {
            name: n(1, s.gb[1]),
            nvml_profile_enum: 0x9,
            id: 15,
            compute_slices: 1,
            memory_slices: 2,
            max_instances: 4,
            starts: &[0, 2, 4, 6],
            memory_mib: s.mib[1],
            multiprocessors: s.sm[1],
            media: s.media[2],
            inferred: inf,
        }),
        gi(GiRow {
            name: n(2, s.gb[2]),
            nvml_profile_enum: 0x1,
            id: 14,
            compute_slices: 2,
            memory_slices: 2,
            max_instances: 3,
            starts: &[0, 2, 4],
            memory_mib: s.mib[2],
            multiprocessors: s.sm[2],
            media: s.media[3],
            inferred: inf,
        }),
        gi(GiRow {
            name: n(3, s.gb[3]),
            nvml_profile_enum: 0x2,
            id: 9,
            compute_slices: 3,
            memory_slices: 4,
            max_instances: 2,
            starts: &[0, 4],
            memory_mib: s.mib[3],
            multiprocessors: s.sm[3],
            media: s.media[4],
            inferred: inf,
        }),
        gi(GiRow {
            name: n(4, s.gb[4]),
            nvml_profile_enum: 0x3,
            id: 5,
            compute_slices: 4,
            memory_slices: 4,
            max_instances: 1,
            starts: &[0],
            memory_mib: s.mib[4],
            multiprocessors: s.sm[4],
            media: s.media[5],
            inferred: inf,
        }),
        gi(GiRow {
            name: n(7, s.gb[5]),
            nvml_profile_enum: 0x4,
            id: 0,
            compute_slices: 7,
            memory_slices: 8,
            max_instances: 1,
            starts: &[0],
            memory_mib: s.mib[5],
            multiprocessors: s.sm[5],
            media: s.media[6],
            inferred: inf,
        }),
    ]);
    MigGeometry {
        memory_slices: 8,
        compute_slices: 7,
        max_instances: 7,
        ofa_engines: 1,
        gi_profiles: profiles,
        source: GeometrySource::Catalog,
    }
}

fn a30() -> MigGeometry {
    let n = MigProfileName::new;
    MigGeometry {
        memory_slices: 4,
        compute_slices: 4,
        max_instances: 4,
        ofa_engines: 1,
        gi_profiles: vec![
            gi(GiRow {
                name: n(1, 6),
                nvml_profile_enum: 0x0,
                id: 14,
                compute_slices: 1,
                memory_slices: 1,
                max_instances: 4,
                starts: &[0, 1, 2, 3],
                memory_mib: Some(5952),
                multiprocessors: Some(14),
                media: me(0, 0, 0, 0),
                inferred: false,
            }),
            gi(GiRow {
                name: n(1, 6).with_attribute("me"),
                nvml_profile_enum: 0x7,
                id: 21,
                compute_slices: 1,
                memory_slices: 1,
                max_instances: 1,
                starts: &[0, 1, 2, 3],
                memory_mib: Some(5952),
                multiprocessors: Some(14),
                media: me(1, 0, 1, 1),
                inferred: false,
            }),
            gi(GiRow {
                name: n(2, 12),
                nvml_profile_enum: 0x1,
                id: 5,
                compute_slices: 2,
                memory_slices: 2,
                max_instances: 2,
                starts: &[0, 2],
                memory_mib: Some(11968),
                multiprocessors: Some(28),
                media: me(2, 0, 0, 0),
                inferred: false,
            }),
            gi(GiRow {
                name: n(2, 12).with_attribute("me"),
                nvml_profile_enum: 0x8,
                id: 6,
                compute_slices: 2,
                memory_slices: 2,
                max_instances: 1,
                starts: &[0, 2],
                memory_mib: Some(11968),
                multiprocessors: Some(28),
                media: me(2, 0, 1, 1),
                inferred: false,
            }),
            gi(GiRow {
                name: n(4, 24),
                nvml_profile_enum: 0x3,
                id: 0,
                compute_slices: 4,
                memory_slices: 4,
                max_instances: 1,
                starts: &[0],
                memory_mib: Some(24000),
                multiprocessors: Some(56),
                media: me(4, 0, 1, 1),
                inferred: false,
            }),
        ],
        source: GeometrySource::Catalog,
    }
}

fn rtx_pro_6000() -> MigGeometry {
    let n = MigProfileName::new;
    let q = [0, 3, 6, 9];
    let h = [0, 6];
    let (m1, m2, m4) = (Some(24192), Some(48512), Some(97408));
    let (s1, s2, s4) = (Some(46), Some(94), Some(188));
    MigGeometry {
        memory_slices: 12,
        compute_slices: 4,
        max_instances: 4,
        ofa_engines: 1,
        gi_profiles: vec![
            gi(GiRow {
                name: n(1, 24),
                nvml_profile_enum: 0x0,
                id: 14,
                compute_slices: 1,
                memory_slices: 3,
                max_instances: 4,
                starts: &q,
                memory_mib: m1,
                multiprocessors: s1,
                media: me(1, 1, 1, 0),
                inferred: false,
            }),
            gi(GiRow {
                name: n(1, 24).with_attribute("me"),
                nvml_profile_enum: 0x7,
                id: 21,
                compute_slices: 1,
                memory_slices: 3,
                max_instances: 1,
                starts: &q,
                memory_mib: m1,
                multiprocessors: s1,
                media: me(1, 1, 1, 1),
                inferred: false,
            }),
            gi(GiRow {
                name: n(1, 24).with_attribute("gfx"),
                nvml_profile_enum: 0xA,
                id: 47,
                compute_slices: 1,
                memory_slices: 3,
                max_instances: 4,
                starts: &q,
                memory_mib: m1,
                multiprocessors: s1,
                media: me(1, 1, 1, 0),
                inferred: false,
            }),
            gi(GiRow {
                name: n(1, 24).with_attribute("me.all"),
                nvml_profile_enum: 0xF,
                id: 65,
                compute_slices: 1,
                memory_slices: 3,
                max_instances: 1,
                starts: &q,
                memory_mib: m1,
                multiprocessors: s1,
                media: me(4, 4, 4, 1),
                inferred: false,
            }),
            gi(GiRow {
                name: n(1, 24).without_attribute("me"),
                nvml_profile_enum: 0xD,
                id: 67,
                compute_slices: 1,
                memory_slices: 3,
                max_instances: 4,
                starts: &q,
                memory_mib: m1,
                multiprocessors: s1,
                media: me(0, 0, 0, 0),
                inferred: false,
            }),
            gi(GiRow {
                name: n(2, 48),
                nvml_profile_enum: 0x1,
                id: 5,
                compute_slices: 2,
                memory_slices: 6,
                max_instances: 2,
                starts: &h,
                memory_mib: m2,
                multiprocessors: s2,
                media: me(2, 2, 2, 0),
                inferred: false,
            }),
            gi(GiRow {
                name: n(2, 48).with_attribute("gfx"),
                nvml_profile_enum: 0xB,
                id: 35,
                compute_slices: 2,
                memory_slices: 6,
                max_instances: 2,
                starts: &h,
                memory_mib: m2,
                multiprocessors: s2,
                media: me(2, 2, 2, 0),
                inferred: false,
            }),
            gi(GiRow {
                name: n(2, 48).with_attribute("me.all"),
                nvml_profile_enum: 0x10,
                id: 64,
                compute_slices: 2,
                memory_slices: 6,
                max_instances: 1,
                starts: &h,
                memory_mib: m2,
                multiprocessors: s2,
                media: me(4, 4, 4, 1),
                inferred: false,
            }),
            gi(GiRow {
                name: n(2, 48).without_attribute("me"),
                nvml_profile_enum: 0xE,
                id: 66,
                compute_slices: 2,
                memory_slices: 6,
                max_instances: 2,
                starts: &h,
                memory_mib: m2,
                multiprocessors: s2,
                media: me(0, 0, 0, 0),
                inferred: false,
            }),
            gi(GiRow {
                name: n(4, 96),
                nvml_profile_enum: 0x3,
                id: 0,
                compute_slices: 4,
                memory_slices: 12,
                max_instances: 1,
                starts: &[0],
                memory_mib: m4,
                multiprocessors: s4,
                media: me(4, 4, 4, 1),
                inferred: false,
            }),
            gi(GiRow {
                name: n(4, 96).with_attribute("gfx"),
                nvml_profile_enum: 0xC,
                id: 32,
                compute_slices: 4,
                memory_slices: 12,
                max_instances: 1,
                starts: &[0],
                memory_mib: m4,
                multiprocessors: s4,
                media: me(4, 4, 4, 1),
                inferred: false,
            }),
        ],
        source: GeometrySource::Catalog,
    }
}

fn model(
    name: &str,
    product_name: &str,
    pci: &[u32],
    architecture: Architecture,
    memory_mib: u64,
    cc: (u32, u32),
    mig: Option<MigGeometry>,
) -> GpuModel {
    GpuModel {
        name: name.to_string(),
        product_name: product_name.to_string(),
        pci_device_ids: pci.to_vec(),
        architecture,
        memory_mib,
        compute_capability: cc,
        mig,
    }
}

fn build() -> Vec<GpuModel> {
    use Architecture::*;
    let a100_40 = || {
        eight_slot(EightSlot {
            gb: [5, 10, 10, 20, 20, 40],
            mib: [
                Some(4864),
                Some(9856),
                Some(9856),
                Some(19968),
                Some(19968),
                Some(40192),
            ],
            sm: [Some(14), Some(14), Some(28), Some(42), Some(56), Some(98)],
            media: A100_MEDIA,
            has_me: true,
            inferred: false,
        })
    };
    let a100_80 = || {
        eight_slot(EightSlot {
            gb: [10, 20, 20, 40, 40, 80],
            mib: [
                Some(9856),
                Some(19968),
                Some(19968),
                Some(40192),
                Some(40192),
                Some(80384),
            ],
            sm: [Some(14), Some(14), Some(28), Some(42), Some(56), Some(98)],
            media: A100_MEDIA,
            has_me: true,
            inferred: false,
        })
    };
    let hopper_sm = [Some(16), Some(26), Some(32), Some(60), Some(64), Some(132)];
    let h100_80 = || {
        eight_slot(EightSlot {
            gb: [10, 20, 20, 40, 40, 80],
            mib: [
                Some(9984),
                Some(20096),
                Some(20096),
                Some(40448),
                Some(40448),
                Some(81152),
            ],
            sm: hopper_sm,
            media: HOPPER_MEDIA,
            has_me: true,
            inferred: false,
        })
    };
    let h100_94 = || {
        eight_slot(EightSlot {
            gb: [12, 24, 24, 47, 47, 94],
            mib: [
                Some(11008),
                Some(22144),
                Some(22144),
                Some(47488),
                Some(47488),
                Some(95360),
            ],
            sm: hopper_sm,
            media: HOPPER_MEDIA,
            has_me: true,
            inferred: false,
        })
    };
    let h100_96 = || {
        eight_slot(EightSlot {
            gb: [12, 24, 24, 48, 48, 96],
            mib: [None; 6],
            sm: [None; 6],
            media: HOPPER_MEDIA,
            has_me: true,
            inferred: true,
        })
    };
    let gh200_144 = || {
        eight_slot(EightSlot {
            gb: [18, 36, 36, 72, 72, 144],
            mib: [Some(17920), Some(36096), Some(36096), None, None, None],
            sm: [Some(16), Some(26), Some(32), None, None, None],
            media: HOPPER_MEDIA,
            has_me: true,
            inferred: true,
        })
    };
    let h200 = || {
        eight_slot(EightSlot {
            gb: [18, 35, 35, 71, 71, 141],
            mib: [
                Some(16384),
                Some(33024),
                Some(33024),
                Some(71168),
                Some(71168),
                Some(143104),
            ],
            sm: hopper_sm,
            media: HOPPER_MEDIA,
            has_me: true,
            inferred: true,
        })
    };
    let blackwell = |gb: [u32; 6], mib: [Option<u64>; 6], sm: [Option<u32>; 6]| {
        eight_slot(EightSlot {
            gb,
            mib,
            sm,
            media: HOPPER_MEDIA,
            has_me: true,
            inferred: true,
        })
    };
    let b200 = || {
        blackwell(
            [23, 45, 45, 90, 90, 180],
            [Some(22528), Some(45312), Some(45312), None, None, None],
            [Some(18), Some(30), Some(36), None, None, None],
        )
    };
    let gb200 = || {
        blackwell(
            [23, 47, 47, 93, 93, 186],
            [Some(22528), Some(46592), Some(46592), None, None, None],
            [Some(18), Some(32), Some(38), None, None, None],
        )
    };
    let b300 = || blackwell([34, 67, 67, 135, 135, 269], [None; 6], [None; 6]);
    let gb300 = || blackwell([35, 70, 70, 139, 139, 278], [None; 6], [None; 6]);

    vec![
        // Non-MIG parts, so labeling works everywhere.
        model(
            "V100-SXM2-16GB",
            "Tesla V100-SXM2-16GB",
            &[0x1DB110DE],
            Volta,
            16384,
            (7, 0),
            None,
        ),
        model(
            "V100-SXM2-32GB",
            "Tesla V100-SXM2-32GB",
            &[0x1DB510DE],
            Volta,
            32768,
            (7, 0),
            None,
        ),
        model(
            "V100-PCIE-16GB",
            "Tesla V100-PCIE-16GB",
            &[0x1DB410DE],
            Volta,
            16384,
            (7, 0),
            None,
        ),
        model(
            "V100-PCIE-32GB",
            "Tesla V100-PCIE-32GB",
            &[0x1DB610DE],
            Volta,
            32768,
            (7, 0),
            None,
        ),
        model("T4", "Tesla T4", &[0x1EB810DE], Turing, 15360, (7, 5), None),
        model(
            "A10",
            "NVIDIA A10",
            &[0x223610DE],
            Ampere,
            23028,
            (8, 6),
            None,
        ),
        model(
            "A40",
            "NVIDIA A40",
            &[0x223510DE],
            Ampere,
            46068,
            (8, 6),
            None,
        ),
        model("L4", "NVIDIA L4", &[0x27B810DE], Ada, 23034, (8, 9), None),
        model(
            "L40S",
            "NVIDIA L40S",
            &[0x26B910DE],
            Ada,
            46068,
            (8, 9),
            None,
        ),
        // Ampere MIG parts.
        model(
            "A100-SXM4-40GB",
            "NVIDIA A100-SXM4-40GB",
            &[0x20B010DE],
            Ampere,
            40960,
            (8, 0),
            Some(a100_40()),
        ),
        model(
            "A100-PCIE-40GB",
            "NVIDIA A100-PCIE-40GB",
            &[0x20B110DE, 0x20F110DE],
            Ampere,
            40960,
            (8, 0),
            Some(a100_40()),
        ),
        model(
            "A800-40GB",
            "NVIDIA A800 40GB PCIe",
            &[0x20F610DE],
            Ampere,
            40960,
            (8, 0),
            Some(a100_40()),
        ),
        model(
            "A100-SXM4-80GB",
            "NVIDIA A100-SXM4-80GB",
            &[0x20B210DE],
            Ampere,
            81920,
            (8, 0),
            Some(a100_80()),
        ),
        model(
            "A100-PCIE-80GB",
            "NVIDIA A100 80GB PCIe",
            &[0x20B510DE],
            Ampere,
            81920,
            (8, 0),
            Some(a100_80()),
        ),
        model(
            "A800-80GB",
            "NVIDIA A800 80GB PCIe",
            &[0x20F310DE, 0x20F510DE],
            Ampere,
            81920,
            (8, 0),
            Some(a100_80()),
        ),
        model(
            "A30",
            "NVIDIA A30",
            &[0x20B710DE],
            Ampere,
            24576,
            (8, 0),
            Some(a30()),
        ),
        // Hopper.
        model(
            "H100-SXM5-80GB",
            "NVIDIA H100 80GB HBM3",
            &[0x233010DE],
            Hopper,
            81559,
            (9, 0),
            Some(h100_80()),
        ),
        model(
            "H100-PCIE-80GB",
            "NVIDIA H100 PCIe",
            &[0x233110DE],
            Hopper,
            81559,
            (9, 0),
            Some(h100_80()),
        ),
        model(
            "H800-80GB",
            "NVIDIA H800",
            &[0x232210DE, 0x232410DE],
            Hopper,
            81559,
            (9, 0),
            Some(h100_80()),
        ),
        model(
            "H100-NVL-94GB",
            "NVIDIA H100 NVL",
            &[0x232110DE],
            Hopper,
            95830,
            (9, 0),
            Some(h100_94()),
        ),
        model(
            "H800-NVL-94GB",
            "NVIDIA H800 NVL",
            &[0x233A10DE],
            Hopper,
            95830,
            (9, 0),
            Some(h100_94()),
        ),
        model(
            "GH200-96GB",
            "NVIDIA GH200 480GB",
            &[0x234210DE],
            Hopper,
            97871,
            (9, 0),
            Some(h100_96()),
        ),
        model(
            "H100-96GB",
            "NVIDIA H100 96GB",
            &[0x233D10DE],
            Hopper,
            97871,
            (9, 0),
            Some(h100_96()),
        ),
        model(
            "PG506-96GB",
            "NVIDIA PG506-96GB",
            &[0x20B610DE],
            Hopper,
            97871,
            (9, 0),
            Some(h100_96()),
        ),
        model(
            "H20",
            "NVIDIA H20",
            &[0x232910DE],
            Hopper,
            97871,
            (9, 0),
            Some(h100_96()),
        ),
        model(
            "GH200-144GB",
            "NVIDIA GH200 144G HBM3e",
            &[0x234810DE],
            Hopper,
            146831,
            (9, 0),
            Some(gh200_144()),
        ),
        model(
            "H200-SXM-141GB",
            "NVIDIA H200",
            &[0x233510DE],
            Hopper,
            143771,
            (9, 0),
            Some(h200()),
        ),
        model(
            "H200-NVL-141GB",
            "NVIDIA H200 NVL",
            &[0x233B10DE],
            Hopper,
            143771,
            (9, 0),
            Some(h200()),
        ),
        // Blackwell.
        model(
            "B200",
            "NVIDIA B200",
            &[0x290110DE],
            Blackwell,
            183359,
            (10, 0),
            Some(b200()),
        ),
        model(
            "GB200",
            "NVIDIA GB200",
            &[0x294110DE],
            Blackwell,
            189471,
            (10, 0),
            Some(gb200()),
        ),
        model(
            "B300",
            "NVIDIA B300 SXM6 AC",
            &[0x318210DE],
            Blackwell,
            275040,
            (10, 3),
            Some(b300()),
        ),
        model(
            "GB300",
            "NVIDIA GB300",
            &[0x31C210DE],
            Blackwell,
            284208,
            (10, 3),
            Some(gb300()),
        ),
        model(
            "RTX-PRO-6000-Blackwell",
            "NVIDIA RTX PRO 6000 Blackwell Server Edition",
            &[0x2BB510DE],
            Blackwell,
            97887,
            (12, 0),
            Some(rtx_pro_6000()),
        ),
    ]
}
