//! How a node's DRA devices are cut into ResourceSlices, by the API server's
//! version.
//!
//! Kubernetes 1.34 takes a GPU's counter set and the devices that consume it
//! in one slice ([`SliceShape::Combined`]). Since 1.35 a slice holds devices
//! or shared counters, never both, and devices that consume counters name a
//! counter set of another slice of the same pool ([`SliceShape::Split`]);
//! such a slice holds at most [`MAX_COUNTER_DEVICES_PER_SLICE`] devices. The
//! plan keeps each GPU's devices in slices of their own, named after the GPU,
//! so the scheduler (first fit over slices by name) still meets the GPUs in
//! index order.

use std::fmt;

use thiserror::Error;

use super::devices::GpuDevices;

/// The oldest minor whose API server serves `resource.k8s.io/v1`.
pub const OLDEST_MINOR: u32 = 34;
/// The first minor that refuses devices and shared counters in one slice.
pub const SPLIT_SINCE_MINOR: u32 = 35;
/// The first minor where `DRAPartitionableDevices` is on by default (beta).
pub const PARTITIONABLE_DEFAULT_SINCE_MINOR: u32 = 36;
/// Devices per slice when none consumes counters.
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// Devices per slice when any consumes counters.
pub const MAX_COUNTER_DEVICES_PER_SLICE: usize = 64;
/// Counter sets per slice.
pub const MAX_COUNTER_SETS_PER_SLICE: usize = 8;
/// Counter consumptions (one per counter a device consumes) per slice.
pub const MAX_CONSUMED_COUNTERS_PER_SLICE: usize = 2048;

/// A Kubernetes API server's version, as `/version` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct KubeVersion {
    /// Major (1).
    pub major: u32,
    /// Minor.
    pub minor: u32,
}

impl fmt::Display for KubeVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// Why an API server's version cannot carry the plugin's slices.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum VersionError {
    /// `/version` said nothing this reads as a version.
    #[error(
        "the API server reported version {git_version:?} (major {major:?}, minor {minor:?}), which is not a Kubernetes version; check that the kubeconfig points at a Kubernetes API server"
    )]
    Unreadable {
        /// `gitVersion`, cut to 64 characters.
        git_version: String,
        /// `major`, cut.
        major: String,
        /// `minor`, cut.
        minor: String,
    },
    /// Older than the first version with `resource.k8s.io/v1`.
    #[error(
        "the API server is Kubernetes {found}, older than 1.{OLDEST_MINOR}: it does not serve resource.k8s.io/v1 ResourceSlices; upgrade the control plane to a supported version (1.35, 1.36 or 1.37)"
    )]
    TooOld {
        /// The version found.
        found: KubeVersion,
    },
}

fn cut(s: &str) -> String {
    s.chars().take(64).collect()
}

fn leading_number(s: &str) -> Option<u32> {
    let digits: String = s.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

impl KubeVersion {
    /// Reads `/version`: `gitVersion` (`v1.37.2`, `v1.36.3-eks-1`) first,
    /// then `major` and `minor` (`"1"`, `"37+"`), as managed clusters vary.
    pub fn from_info(git_version: &str, major: &str, minor: &str) -> Result<Self, VersionError> {
        let from_git = git_version.strip_prefix('v').and_then(|rest| {
            let mut parts = rest.splitn(3, '.');
            let major = parts.next()?.parse().ok()?;
            let minor = leading_number(parts.next()?)?;
            Some(KubeVersion { major, minor })
        });
        from_git
            .or_else(|| {
                Some(KubeVersion {
                    major: leading_number(major)?,
                    minor: leading_number(minor)?,
                })
            })
            .ok_or_else(|| VersionError::Unreadable {
                git_version: cut(git_version),
                major: cut(major),
                minor: cut(minor),
            })
    }

    /// True from `1.<minor>` on.
    pub fn at_least(self, minor: u32) -> bool {
        self >= KubeVersion { major: 1, minor }
    }
}

/// Where a GPU's counter set goes relative to its devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SliceShape {
    /// Counter set and devices in one slice (1.34).
    Combined,
    /// Counter sets in slices of their own, devices in others (1.35+).
    Split,
}

/// The slice shape the API server of `version` accepts.
pub fn slice_shape(version: KubeVersion) -> Result<SliceShape, VersionError> {
    if !version.at_least(OLDEST_MINOR) {
        return Err(VersionError::TooOld { found: version });
    }
    Ok(if version.at_least(SPLIT_SINCE_MINOR) {
        SliceShape::Split
    } else {
        SliceShape::Combined
    })
}

/// The devices of one GPU that go in one slice: `gpus[gpu].devices[start..end]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceRun {
    /// Index into the node's GPU list.
    pub gpu: usize,
    /// First device.
    pub start: usize,
    /// One past the last device.
    pub end: usize,
}

/// One slice of the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedSlice {
    /// The name's suffix after `<node>-<driver>-`: `gpu-<index>` (then
    /// `gpu-<index>-<n>` for a GPU's further device slices) or `counters-<n>`.
    pub suffix: String,
    /// Indices into the node's GPU list whose counter sets this slice holds.
    pub counter_sets: Vec<usize>,
    /// The devices it holds (one GPU's, in the GPU's order).
    pub devices: Option<DeviceRun>,
}

/// Cuts a node's GPUs into slices of `shape`, in publishing order (counter
/// slices before the devices that consume them).
pub fn plan_slices(shape: SliceShape, gpus: &[GpuDevices]) -> Vec<PlannedSlice> {
    let mut plan = Vec::new();
    if shape == SliceShape::Split {
        let with_sets: Vec<usize> = (0..gpus.len())
            .filter(|&i| gpus[i].counter_set.is_some())
            .collect();
        for (n, chunk) in with_sets.chunks(MAX_COUNTER_SETS_PER_SLICE).enumerate() {
            plan.push(PlannedSlice {
                suffix: format!("counters-{n}"),
                counter_sets: chunk.to_vec(),
                devices: None,
            });
        }
    }
    for (i, gpu) in gpus.iter().enumerate() {
        if shape == SliceShape::Combined {
            // 1.34 resolves a consumed counter set only within its slice, so
            // a GPU's set and all its devices stay together.
            plan.push(PlannedSlice {
                suffix: format!("gpu-{}", gpu.gpu),
                counter_sets: if gpu.counter_set.is_some() {
                    vec![i]
                } else {
                    vec![]
                },
                devices: (!gpu.devices.is_empty()).then_some(DeviceRun {
                    gpu: i,
                    start: 0,
                    end: gpu.devices.len(),
                }),
            });
            continue;
        }
        for (n, run) in device_runs(i, gpu).into_iter().enumerate() {
            plan.push(PlannedSlice {
                suffix: if n == 0 {
                    format!("gpu-{}", gpu.gpu)
                } else {
                    format!("gpu-{}-{n}", gpu.gpu)
                },
                counter_sets: vec![],
                devices: Some(run),
            });
        }
    }
    plan
}

/// A GPU's devices in runs that each fit one slice.
fn device_runs(gpu_index: usize, gpu: &GpuDevices) -> Vec<DeviceRun> {
    let mut runs = Vec::new();
    let mut start = 0;
    while start < gpu.devices.len() {
        let mut end = start;
        let mut consumed = 0;
        let mut any_counters = false;
        while end < gpu.devices.len() {
            let d = &gpu.devices[end];
            let counters = !d.consumes.is_empty();
            let limit = if any_counters || counters {
                MAX_COUNTER_DEVICES_PER_SLICE
            } else {
                MAX_DEVICES_PER_SLICE
            };
            if end - start + 1 > limit
                || consumed + d.consumes.len() > MAX_CONSUMED_COUNTERS_PER_SLICE
            {
                break;
            }
            consumed += d.consumes.len();
            any_counters |= counters;
            end += 1;
        }
        // A device alone always fits (a device consumes at most 32 counters).
        let end = end.max(start + 1);
        runs.push(DeviceRun {
            gpu: gpu_index,
            start,
            end,
        });
        start = end;
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dra::counters::ModelDevice;
    use crate::dra::devices::{CounterSet, DraDevice};
    use proptest::prelude::*;

    fn gpu(index: u32, with_set: bool, consumes: &[usize]) -> GpuDevices {
        GpuDevices {
            gpu: index,
            uuid: format!("GPU-{index}"),
            counter_set: with_set.then(|| CounterSet {
                name: format!("gpu-{index}-counters"),
                counters: vec![("memory-slice-0".into(), 1)],
            }),
            devices: consumes
                .iter()
                .enumerate()
                .map(|(d, &n)| DraDevice {
                    name: format!("gpu-{index}-dev-{d}"),
                    kind: ModelDevice::WholeGpu,
                    attributes: Default::default(),
                    capacity: Default::default(),
                    consumes: (0..n).map(|c| (format!("c{c}"), 1)).collect(),
                })
                .collect(),
            model: None,
            mig_left_out: None,
        }
    }

    #[test]
    fn versions_read_from_what_managed_clusters_report() {
        let v = |g, ma, mi| KubeVersion::from_info(g, ma, mi);
        assert_eq!(
            v("v1.37.2", "1", "37"),
            Ok(KubeVersion {
                major: 1,
                minor: 37
            })
        );
        assert_eq!(
            v("v1.36.3-eks-4a1b2c", "1", "36+"),
            Ok(KubeVersion {
                major: 1,
                minor: 36
            })
        );
        assert_eq!(
            v("", "1", "35+"),
            Ok(KubeVersion {
                major: 1,
                minor: 35
            })
        );
        let err = v(&"x".repeat(500), "", "").unwrap_err().to_string();
        assert!(
            err.contains("not a Kubernetes version") && err.len() < 400,
            "{err}"
        );
    }

    #[test]
    fn the_shape_follows_the_version() {
        let at = |minor| slice_shape(KubeVersion { major: 1, minor });
        assert_eq!(at(34), Ok(SliceShape::Combined));
        for minor in [35, 36, 37, 40] {
            assert_eq!(at(minor), Ok(SliceShape::Split));
        }
        let err = at(33).unwrap_err().to_string();
        assert!(
            err.contains("Kubernetes 1.33") && err.contains("resource.k8s.io/v1"),
            "{err}"
        );
        assert_eq!(
            slice_shape(KubeVersion { major: 2, minor: 0 }),
            Ok(SliceShape::Split)
        );
    }

    #[test]
    fn an_h100_node_splits_into_one_counter_slice_and_a_device_slice_per_gpu() {
        let gpus: Vec<_> = (0..8).map(|i| gpu(i, true, &[10; 26])).collect();
        let plan = plan_slices(SliceShape::Split, &gpus);
        assert_eq!(plan.len(), 9);
        assert_eq!(plan[0].suffix, "counters-0");
        assert_eq!(plan[0].counter_sets, (0..8).collect::<Vec<_>>());
        assert_eq!(plan[1].suffix, "gpu-0");
        assert_eq!(
            plan[8].devices,
            Some(DeviceRun {
                gpu: 7,
                start: 0,
                end: 26
            })
        );
        let combined = plan_slices(SliceShape::Combined, &gpus);
        assert_eq!(combined.len(), 8);
        assert_eq!(combined[3].counter_sets, vec![3]);
        assert_eq!(combined[3].suffix, "gpu-3");
    }

    proptest! {
        /// Every device and counter set is published exactly once, in GPU
        /// order, and every slice keeps the API's limits for its shape.
        #[test]
        fn every_device_once_within_the_limits(
            layout in prop::collection::vec(
                (any::<bool>(), prop::collection::vec(prop_oneof![Just(0usize), 1usize..=32], 0..200)),
                0..20,
            ),
            split in any::<bool>(),
        ) {
            let gpus: Vec<_> = layout
                .iter()
                .enumerate()
                .map(|(i, (set, consumes))| gpu(i as u32, *set, consumes))
                .collect();
            let shape = if split { SliceShape::Split } else { SliceShape::Combined };
            let plan = plan_slices(shape, &gpus);
            let mut sets = Vec::new();
            let mut devices: Vec<(usize, usize)> = Vec::new();
            let mut names = std::collections::BTreeSet::new();
            for s in &plan {
                prop_assert!(names.insert(s.suffix.clone()), "duplicate {}", s.suffix);
                prop_assert!(s.counter_sets.len() <= MAX_COUNTER_SETS_PER_SLICE);
                                if shape == SliceShape::Split {
                    prop_assert!(s.counter_sets.is_empty() || s.devices.is_none());
                }
                sets.extend(s.counter_sets.iter().copied());
                if let Some(run) = &s.devices {
                    let slice = &gpus[run.gpu].devices[run.start..run.end];
                    prop_assert!(!slice.is_empty());
                    if shape == SliceShape::Split {
                        let counted = slice.iter().any(|d| !d.consumes.is_empty());
                        let limit = if counted { MAX_COUNTER_DEVICES_PER_SLICE } else { MAX_DEVICES_PER_SLICE };
                        prop_assert!(slice.len() <= limit);
                        prop_assert!(slice.iter().map(|d| d.consumes.len()).sum::<usize>() <= MAX_CONSUMED_COUNTERS_PER_SLICE);
                    } else {
                        // 1.34: a GPU's devices sit with its own counter set.
                        prop_assert_eq!((run.start, run.end), (0, slice.len()));
                        let own = gpus[run.gpu].counter_set.is_some();
                        prop_assert_eq!(s.counter_sets.clone(), if own { vec![run.gpu] } else { vec![] });
                    }
                    devices.extend((run.start..run.end).map(|d| (run.gpu, d)));
                }
            }
            let want_sets: Vec<usize> = (0..gpus.len()).filter(|&i| gpus[i].counter_set.is_some()).collect();
            sets.sort_unstable();
            prop_assert_eq!(sets, want_sets);
            let want_devices: Vec<(usize, usize)> = gpus
                .iter()
                .enumerate()
                .flat_map(|(g, gpu)| (0..gpu.devices.len()).map(move |d| (g, d)))
                .collect();
            prop_assert_eq!(devices, want_devices);
        }
    }
}
