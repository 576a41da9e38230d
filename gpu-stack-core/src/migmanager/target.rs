//! From a named mig-parted config and the GPUs of a node to one target per GPU,
//! at explicit placements that keep as many existing instances as possible.
//!
//! Every GPU is checked before anything is touched: an unknown config name, a
//! GPU without MIG, or a config that cannot fit fails here with the reason.

use crate::catalog;
use crate::mig::{self, MigGeometry, MigProfileName, PlacedInstance};
use crate::migparted::MigPartedConfig;

use super::plan::{TargetGi, TargetGpu};

/// What the selection needs to know about one GPU.
#[derive(Debug, Clone)]
pub struct GpuFacts<'a> {
    /// GPU index on the node.
    pub index: u32,
    /// Combined PCI device and vendor id, e.g. `0x233010DE`.
    pub pci_device_id: u32,
    /// Its MIG geometry (`None`: not MIG capable).
    pub geometry: Option<&'a MigGeometry>,
    /// GPU instances present now, by name and start (what the minimal change keeps).
    pub current: Vec<PlacedInstance>,
}

/// The selected config, resolved for one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SelectedGpu {
    /// Which entry of the named config applies (the last matching one, as mig-parted).
    pub entry: usize,
    /// Target layout by name (for reports and `assert`).
    pub layout: Vec<PlacedInstance>,
    /// Target for the planner: GPU-instance profile ids, starts and
    /// compute-instance slice counts.
    pub target: TargetGpu<u32, u32>,
}

/// Why a config cannot be applied to this node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectError {
    /// The name is not in the file.
    #[error(
        "MIG config {} is not in the config file ({available}); fix the nvidia.com/mig.config label or the file",
        crate::echo::quoted(.name)
    )]
    UnknownConfig {
        /// Requested name.
        name: String,
        /// Names in the file.
        available: String,
    },
    /// No entry of the config matches any GPU of the node.
    #[error(
        "MIG config {name:?} has no entry for any GPU of this node ({devices}); pick a config written for these GPUs"
    )]
    NoMatchingGpu {
        /// Config name.
        name: String,
        /// PCI ids of the node's GPUs.
        devices: String,
    },
    /// An entry enables MIG on a GPU that has none.
    #[error(
        "MIG config {name:?} entry {entry} enables MIG on GPU {gpu} ({device}), which does not support MIG"
    )]
    NotMigCapable {
        /// Config name.
        name: String,
        /// Entry index.
        entry: usize,
        /// GPU index.
        gpu: u32,
        /// PCI id.
        device: String,
    },
    /// The entry's profiles cannot be placed on the GPU.
    #[error("MIG config {name:?} entry {entry} does not fit GPU {gpu} ({device}): {reason}")]
    DoesNotFit {
        /// Config name.
        name: String,
        /// Entry index.
        entry: usize,
        /// GPU index.
        gpu: u32,
        /// PCI id.
        device: String,
        /// Why.
        reason: String,
    },
}

/// Resolves config `name` for each GPU. GPUs that no entry selects are left
/// out (mig-parted leaves them alone). The result is in GPU order.
pub fn select(
    config: &MigPartedConfig,
    name: &str,
    gpus: &[GpuFacts<'_>],
) -> Result<Vec<(u32, SelectedGpu)>, SelectError> {
    let named = config.get(name).ok_or_else(|| SelectError::UnknownConfig {
        name: name.to_string(),
        available: if config.mig_configs.is_empty() {
            "the file defines no configs".into()
        } else {
            format!(
                "configs in the file: {}",
                crate::echo::join_capped_at(&config.names(), 100)
            )
        },
    })?;
    let mut out = Vec::new();
    for gpu in gpus {
        let device = catalog::format_pci_id(gpu.pci_device_id);
        let Some((entry, spec)) = named.entries.iter().enumerate().rev().find(|(_, e)| {
            e.devices.includes(gpu.index) && e.matches_device(gpu.pci_device_id, None)
        }) else {
            continue;
        };
        if !spec.mig_enabled {
            out.push((
                gpu.index,
                SelectedGpu {
                    entry,
                    layout: Vec::new(),
                    target: TargetGpu {
                        index: gpu.index,
                        mig_enabled: false,
                        gis: Vec::new(),
                    },
                },
            ));
            continue;
        }
        let Some(geometry) = gpu.geometry else {
            return Err(SelectError::NotMigCapable {
                name: name.to_string(),
                entry,
                gpu: gpu.index,
                device,
            });
        };
        let fit_error = |reason: String| SelectError::DoesNotFit {
            name: name.to_string(),
            entry,
            gpu: gpu.index,
            device: device.clone(),
            reason,
        };
        let demand: mig::Demand = spec
            .mig_devices
            .iter()
            .filter(|(_, c)| *c > 0)
            .cloned()
            .collect();
        // Instances the catalog does not know cannot be kept; the planner destroys them.
        let current: Vec<PlacedInstance> = gpu
            .current
            .iter()
            .filter(|p| {
                geometry
                    .resolve(&p.profile)
                    .is_some_and(|g| g.placements.iter().any(|pl| pl.start == p.start))
            })
            .cloned()
            .collect();
        // Explicit placements are the target as given; otherwise the
        // placement that keeps the most current instances.
        let layout = match &spec.placements {
            Some(placements) => {
                crate::migparted::placements_agree(&spec.mig_devices, placements)
                    .map_err(&fit_error)?;
                mig::validate(geometry, placements).map_err(|v| {
                    fit_error(format!(
                        "placements {}: {}",
                        mig::format_layout(placements),
                        crate::echo::join_capped(&v)
                    ))
                })?;
                placements.clone()
            }
            None => {
                mig::reconfigure(geometry, &current, &demand)
                    .map_err(|e| fit_error(e.to_string()))?
                    .target
            }
        };
        let gis = with_compute_instances(geometry, &demand, &layout).map_err(fit_error)?;
        out.push((
            gpu.index,
            SelectedGpu {
                entry,
                layout,
                target: TargetGpu {
                    index: gpu.index,
                    mig_enabled: true,
                    gis,
                },
            },
        ));
    }
    if out.is_empty() {
        let mut ids: Vec<String> = gpus
            .iter()
            .map(|g| catalog::format_pci_id(g.pci_device_id))
            .collect();
        ids.dedup();
        return Err(SelectError::NoMatchingGpu {
            name: name.to_string(),
            devices: if ids.is_empty() {
                "the node reports no GPUs".into()
            } else {
                format!("PCI ids {}", crate::echo::join_capped(&ids))
            },
        });
    }
    Ok(out)
}

/// Gives each target GPU instance its compute instances: one full-size compute
/// instance per plain `<G>g.<N>gb` entry; compute-instance entries
/// (`1c.3g.20gb`) packed first-fit-decreasing into the remaining instances of
/// that profile, the way the fit counted them.
fn with_compute_instances(
    geometry: &MigGeometry,
    demand: &mig::Demand,
    layout: &[PlacedInstance],
) -> Result<Vec<TargetGi<u32, u32>>, String> {
    let mut out = Vec::new();
    for (idx, profile) in geometry.gi_profiles.iter().enumerate() {
        let placed: Vec<&PlacedInstance> = layout
            .iter()
            .filter(|p| geometry.resolve_index(&p.profile) == Some(idx))
            .collect();
        if placed.is_empty() {
            continue;
        }
        let mine = |n: &MigProfileName| geometry.resolve_index(n) == Some(idx);
        let plain: u32 = demand
            .iter()
            .filter(|(n, _)| mine(n) && n.is_gpu_instance())
            .map(|(_, c)| *c)
            .sum();
        let mut slices: Vec<u32> = demand
            .iter()
            .filter(|(n, _)| mine(n) && !n.is_gpu_instance())
            .flat_map(|(n, c)| std::iter::repeat_n(n.compute_slices(), *c as usize))
            .collect();
        slices.sort_unstable_by(|a, b| b.cmp(a));
        let g = profile.compute_slices;
        let packed_count = placed.len().saturating_sub(plain as usize);
        let mut bins: Vec<Vec<u32>> = vec![Vec::new(); packed_count];
        for s in slices {
            let bin = bins
                .iter_mut()
                .find(|b| b.iter().sum::<u32>() + s <= g)
                .ok_or_else(|| {
                    format!(
                        "the compute instances of {} do not pack into {packed_count} GPU instances",
                        profile.name
                    )
                })?;
            bin.push(s);
        }
        for (i, p) in placed.iter().enumerate() {
            let cis = if i < plain as usize {
                vec![g]
            } else {
                bins.get(i - plain as usize).cloned().unwrap_or_default()
            };
            out.push(TargetGi {
                profile: profile.id,
                start: p.start,
                cis,
            });
        }
    }
    out.sort_by_key(|t| t.start);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migmanager::plan::{MigMode, ObservedCi, ObservedGi, ObservedGpu, plan_gpu};

    fn h100() -> &'static catalog::GpuModel {
        catalog::lookup("0x233010DE").unwrap()
    }

    fn facts(model: &'static catalog::GpuModel, n: u32) -> Vec<GpuFacts<'static>> {
        (0..n)
            .map(|i| GpuFacts {
                index: i,
                pci_device_id: model.pci_device_ids[0],
                geometry: model.mig.as_ref(),
                current: vec![],
            })
            .collect()
    }

    #[test]
    fn shipped_configs_resolve_for_h100_and_a100() {
        let cfg = MigPartedConfig::default_config().unwrap();
        for model in ["0x233010DE", "0x20B010DE"] {
            let m = catalog::lookup(model).unwrap();
            let mut applicable = 0;
            for name in cfg.names() {
                match select(&cfg, name, &facts(m, 2)) {
                    Ok(sel) => {
                        applicable += 1;
                        assert_eq!(sel.len(), 2, "{name}");
                    }
                    Err(SelectError::DoesNotFit { .. } | SelectError::NoMatchingGpu { .. }) => {}
                    Err(e) => panic!("{model} {name}: {e}"),
                }
            }
            assert!(applicable >= 9, "{model}: only {applicable} configs apply");
        }
    }

    #[test]
    fn all_1g_10gb_differs_per_model() {
        let cfg = MigPartedConfig::default_config().unwrap();
        let h = select(&cfg, "all-1g.10gb", &facts(h100(), 1)).unwrap();
        assert_eq!(h[0].1.target.gis.len(), 7);
        let a = select(
            &cfg,
            "all-1g.10gb",
            &facts(catalog::lookup("0x20B010DE").unwrap(), 1),
        )
        .unwrap();
        assert_eq!(a[0].1.target.gis.len(), 4);
    }

    #[test]
    fn unknown_and_impossible_configs_fail_with_reason() {
        let cfg = MigPartedConfig::default_config().unwrap();
        let e = select(&cfg, "no-such", &facts(h100(), 1)).unwrap_err();
        assert!(e.to_string().contains("all-balanced"));
        let cfg = MigPartedConfig::from_yaml(
            "version: v1\nmig-configs:\n  too-big:\n    - devices: all\n      mig-enabled: true\n      mig-devices:\n        \"3g.40gb\": 3\n",
        )
        .unwrap();
        let e = select(&cfg, "too-big", &facts(h100(), 1)).unwrap_err();
        assert!(matches!(e, SelectError::DoesNotFit { gpu: 0, .. }), "{e}");
    }

    #[test]
    fn keeps_existing_instances() {
        let cfg = MigPartedConfig::default_config().unwrap();
        let m = h100();
        let geo = m.mig.as_ref().unwrap();
        let balanced = select(&cfg, "all-balanced", &facts(m, 1)).unwrap();
        let layout = balanced[0].1.layout.clone();
        let mut f = facts(m, 1);
        f[0].current = layout.clone();
        let again = select(&cfg, "all-balanced", &f).unwrap();
        assert_eq!(again[0].1.layout, layout);
        // Observed GPU holding that layout: the plan is empty.
        let observed = ObservedGpu {
            index: 0,
            mode: MigMode {
                current: true,
                pending: true,
            },
            gis: layout
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let gp = geo.resolve(&p.profile).unwrap();
                    ObservedGi {
                        id: i as u32,
                        profile: gp.id,
                        start: p.start,
                        cis: vec![ObservedCi {
                            id: 0,
                            profile: gp.compute_slices,
                            processes: vec![],
                        }],
                    }
                })
                .collect(),
            processes: vec![],
        };
        assert!(plan_gpu(&observed, &again[0].1.target).is_converged());
    }
}
