//! The shared-counter model of one MIG-capable GPU (KEP-4815 partitionable
//! devices): counters with capacities, and what each device consumes, chosen
//! so that a set of devices fits the counters exactly when its placements are
//! a layout [`crate::mig::validate`] accepts.
//!
//! Every rule of the validator that decides a placed layout is a sum bounded
//! by a capacity, so each becomes one counter:
//!
//! | rule | counter | capacity | a placement consumes |
//! |---|---|---|---|
//! | R2 no overlap | `memory-slice-<i>` | 1 | 1 for each slice it covers |
//! | R3 per-profile maximum | `profile-<id>-instances` | the profile's maximum | 1 |
//! | R4 compute slices | `compute-slices` | the GPU's compute slices | its compute slices |
//! | R4 instance count | `gpu-instances` | the GPU's maximum instances | 1 |
//! | R6 optical-flow engines | `ofa-engines` | the GPU's OFAs | its OFAs |
//! | R7 `+me.all` exclusivity | `media-exclusive` | the instance bound `K` | `K` for `+me.all`, 1 for any other not `-me`, 0 for `-me` |
//!
//! R1 (allowed placements) needs no counter: only allowed placements are
//! published as devices. R5 (no 4g with 3g before R510) is a driver switch the
//! published model does not carry: the plugin refuses such a layout at
//! prepare time (see [`crate::dra::prepare`]).
//!
//! A counter that the memory-slice counters already imply (no set of
//! non-overlapping placements can exceed it) is left out, so slices stay small:
//! on an H100 only the memory slices, `ofa-engines` and the `+me` profile's
//! maximum remain. The whole-GPU device consumes every counter's full capacity,
//! so it excludes every MIG device of its GPU and they exclude it.

use serde::Serialize;

use crate::mig::{MediaVariant, MigGeometry, PlacedInstance};

/// Most counters one GPU may publish: the per-ResourceSlice limit of
/// `resource.k8s.io/v1` (counters in all sets of one slice).
pub const MAX_COUNTERS_PER_GPU: usize = 32;

/// One shared counter of a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Counter {
    /// Counter name (a DNS label).
    pub name: String,
    /// What the whole GPU offers.
    pub capacity: u64,
}

/// One MIG device of the model: a GPU-instance profile at an allowed start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlacementDevice {
    /// Index into the geometry's `gi_profiles`.
    pub profile: usize,
    /// Start memory slice.
    pub start: u32,
    /// Memory slices it covers.
    pub size: u32,
    /// Consumption per counter, indexed like [`CounterModel::counters`].
    pub consumes: Vec<u64>,
}

/// The counters of one GPU and what its devices consume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CounterModel {
    /// Counters, memory slices first.
    pub counters: Vec<Counter>,
    /// Every allowed placement of every GPU-instance profile, in the
    /// geometry's profile order, then by start.
    pub placements: Vec<PlacementDevice>,
}

/// A device of the model: the whole GPU or one placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ModelDevice {
    /// The whole GPU (MIG off).
    WholeGpu,
    /// Index into [`CounterModel::placements`].
    Placement(usize),
}

/// A geometry the model cannot express.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CounterModelError {
    /// The geometry is malformed.
    #[error(transparent)]
    Geometry(#[from] crate::mig::GeometryError),
    /// More counters than one ResourceSlice may hold.
    #[error(
        "this GPU's MIG geometry needs {needed} shared counters, more than the {MAX_COUNTERS_PER_GPU} a ResourceSlice may hold; publish it without MIG devices"
    )]
    TooManyCounters {
        /// Counters the model needs.
        needed: usize,
    },
}

/// The counter name of memory slice `i`.
pub fn memory_slice_counter(i: u32) -> String {
    format!("memory-slice-{i}")
}

impl CounterModel {
    /// Derives the model from a geometry.
    pub fn derive(geometry: &MigGeometry) -> Result<CounterModel, CounterModelError> {
        geometry.check()?;
        let profiles = &geometry.gi_profiles;
        let axis = geometry.memory_slices;
        let all: Vec<(usize, u32, u32)> = profiles
            .iter()
            .enumerate()
            .flat_map(|(i, p)| p.placements.iter().map(move |pl| (i, pl.start, pl.size)))
            .collect();
        // Each candidate counter: name, capacity, per-placement consumption.
        let mut counters: Vec<(String, u64, Vec<u64>)> = (0..axis)
            .map(|s| {
                let use_ = all
                    .iter()
                    .map(|&(_, start, size)| u64::from(s >= start && s < start + size))
                    .collect();
                (memory_slice_counter(s), 1, use_)
            })
            .collect();
        let mut global = |name: String, capacity: u64, use_: Vec<u64>| {
            // Kept only where some set of non-overlapping placements exceeds
            // the capacity: otherwise the memory slices already imply it.
            if max_disjoint_weight(axis, &all, &use_) > capacity {
                counters.push((name, capacity, use_));
            }
        };
        global(
            "compute-slices".into(),
            u64::from(geometry.compute_slices),
            all.iter()
                .map(|&(i, _, _)| u64::from(profiles[i].compute_slices))
                .collect(),
        );
        global(
            "gpu-instances".into(),
            u64::from(geometry.max_instances),
            vec![1; all.len()],
        );
        global(
            "ofa-engines".into(),
            u64::from(geometry.ofa_engines),
            all.iter()
                .map(|&(i, _, _)| u64::from(profiles[i].media.ofa))
                .collect(),
        );
        if profiles
            .iter()
            .any(|p| p.media_variant() == MediaVariant::MeAll)
        {
            // K: no layout holds more instances, so K ones that are not `-me`
            // fit, and `+me.all` (K) plus any other that is not `-me` does not.
            let k = u64::from(geometry.max_instances.min(axis));
            counters.push((
                "media-exclusive".into(),
                k,
                all.iter()
                    .map(|&(i, _, _)| match profiles[i].media_variant() {
                        MediaVariant::MeAll => k,
                        MediaVariant::NoMe => 0,
                        _ => 1,
                    })
                    .collect(),
            ));
        }
        for (pi, p) in profiles.iter().enumerate() {
            let use_: Vec<u64> = all.iter().map(|&(i, _, _)| u64::from(i == pi)).collect();
            if max_disjoint_weight(axis, &all, &use_) > u64::from(p.max_instances) {
                counters.push((
                    format!("profile-{}-instances", p.id),
                    u64::from(p.max_instances),
                    use_,
                ));
            }
        }
        if counters.len() > MAX_COUNTERS_PER_GPU {
            return Err(CounterModelError::TooManyCounters {
                needed: counters.len(),
            });
        }
        let placements = all
            .iter()
            .enumerate()
            .map(|(d, &(profile, start, size))| PlacementDevice {
                profile,
                start,
                size,
                consumes: counters.iter().map(|(_, _, use_)| use_[d]).collect(),
            })
            .collect();
        Ok(CounterModel {
            counters: counters
                .into_iter()
                .map(|(name, capacity, _)| Counter { name, capacity })
                .collect(),
            placements,
        })
    }

    /// What a device consumes, per counter.
    pub fn consumption(&self, device: ModelDevice) -> Vec<u64> {
        match device {
            ModelDevice::WholeGpu => self.counters.iter().map(|c| c.capacity).collect(),
            ModelDevice::Placement(i) => self
                .placements
                .get(i)
                .map(|p| p.consumes.clone())
                .unwrap_or_else(|| self.counters.iter().map(|c| c.capacity).collect()),
        }
    }

    /// Whether the counters allow these devices together, as the scheduler
    /// decides: the sum of what they consume stays within every capacity.
    /// A device listed twice counts twice.
    pub fn allows(&self, devices: &[ModelDevice]) -> bool {
        self.allows_within(devices, &self.capacities())
    }

    /// [`Self::allows`] against reduced capacities (what instances the plugin
    /// did not create leave over).
    pub fn allows_within(&self, devices: &[ModelDevice], capacities: &[u64]) -> bool {
        let mut used = vec![0u64; self.counters.len()];
        for &d in devices {
            for (u, c) in used.iter_mut().zip(self.consumption(d)) {
                *u = u.saturating_add(c);
            }
        }
        used.iter().zip(capacities).all(|(u, c)| u <= c)
    }

    /// Every counter's capacity.
    pub fn capacities(&self) -> Vec<u64> {
        self.counters.iter().map(|c| c.capacity).collect()
    }

    /// The placed instance a placement device stands for.
    pub fn instance(&self, geometry: &MigGeometry, index: usize) -> Option<PlacedInstance> {
        let p = self.placements.get(index)?;
        let profile = geometry.gi_profiles.get(p.profile)?;
        Some(PlacedInstance::new(profile.name.clone(), p.start))
    }

    /// The placement device of a profile (by index) at a start.
    pub fn placement_index(&self, profile: usize, start: u32) -> Option<usize> {
        self.placements
            .iter()
            .position(|p| p.profile == profile && p.start == start)
    }

    /// Capacities left after existing instances (ones this plugin did not
    /// create) are taken out. An instance at a placement the model does not
    /// know takes its memory slices and one GPU instance.
    pub fn remaining_after(&self, geometry: &MigGeometry, existing: &[PlacedInstance]) -> Vec<u64> {
        let mut left = self.capacities();
        for inst in existing {
            let consumes = geometry
                .resolve_index(&inst.profile)
                .and_then(|pi| self.placement_index(pi, inst.start))
                .map(|d| self.placements[d].consumes.clone());
            let consumes = consumes.unwrap_or_else(|| {
                let size = geometry
                    .resolve(&inst.profile)
                    .map_or(geometry.memory_slices, |p| p.memory_slices);
                self.counters
                    .iter()
                    .map(|c| {
                        let in_span = (inst.start..inst.start.saturating_add(size))
                            .any(|s| c.name == memory_slice_counter(s));
                        u64::from(in_span || c.name == "gpu-instances")
                    })
                    .collect()
            });
            for (l, c) in left.iter_mut().zip(consumes) {
                *l = l.saturating_sub(c);
            }
        }
        left
    }
}

/// The largest total weight of placements that pairwise do not overlap
/// (weighted interval scheduling over the memory-slice axis).
fn max_disjoint_weight(axis: u32, placements: &[(usize, u32, u32)], weight: &[u64]) -> u64 {
    let axis = axis as usize;
    // best[x]: the most weight from placements that end at or before slice x.
    let mut best = vec![0u64; axis + 1];
    for x in 1..=axis {
        best[x] = best[x - 1];
        for (d, &(_, start, size)) in placements.iter().enumerate() {
            let end = (start + size) as usize;
            if end == x {
                best[x] = best[x].max(best[start as usize].saturating_add(weight[d]));
            }
        }
    }
    best[axis]
}

#[cfg(test)]
mod tests;
