//! MIG views and rules shared by the MIG operations: the GPU's catalog model
//! and geometry, the public shape of its GPU and compute instances, and the
//! errors NVML gives for a refused placement.

use gpu_stack_core::backend::{
    BackendError, ComputeInstance, GpuInstance, GpuInstanceProfile, SlicePlacement,
};
use gpu_stack_core::catalog::{self, GpuModel};
use gpu_stack_core::mig::{self, MigGeometry, PlacedInstance, Violation};

use super::state::{CiState, GiState, GpuState};

pub(super) fn model_of(gpu: &GpuState) -> Result<&'static GpuModel, BackendError> {
    catalog::lookup(&gpu.model).map_err(|e| BackendError::Other {
        message: format!("simulated GPU {}: {e}", gpu.index),
    })
}

pub(super) fn geometry_of(gpu: &GpuState) -> Result<&'static MigGeometry, BackendError> {
    model_of(gpu)?
        .mig
        .as_ref()
        .ok_or_else(|| BackendError::NotSupported {
            gpu: gpu.index,
            operation: "MIG (this GPU model has no MIG)".into(),
        })
}

pub(super) fn gi_memory_mib(model: &GpuModel, geo: &MigGeometry, p: &mig::GiProfile) -> u64 {
    p.memory_mib.unwrap_or_else(|| {
        model.memory_mib * u64::from(p.memory_slices) / u64::from(geo.memory_slices.max(1))
    })
}

pub(super) fn placed_layout(geo: &MigGeometry, gpu: &GpuState) -> Vec<PlacedInstance> {
    gpu.gpu_instances
        .iter()
        .filter_map(|gi| {
            geo.by_id(gi.profile_id)
                .map(|p| PlacedInstance::new(p.name.clone(), gi.start))
        })
        .collect()
}

pub(super) fn lowest_free(used: impl Iterator<Item = u32>, from: u32) -> u32 {
    let mut used: Vec<u32> = used.collect();
    used.sort_unstable();
    let mut id = from;
    for u in used {
        if u == id {
            id += 1;
        } else if u > id {
            break;
        }
    }
    id
}

pub(super) fn ci_public(gi: &GiState, ci: &CiState) -> ComputeInstance {
    let _ = gi;
    ComputeInstance {
        id: ci.id,
        profile_id: ci_profile_enum(ci.slice_count),
        slice_count: ci.slice_count,
        placement: SlicePlacement {
            start: ci.start,
            size: ci.slice_count,
        },
        uuid: ci.uuid.clone(),
    }
}

/// NVML compute-instance profile enum for `c` compute slices.
pub fn ci_profile_enum(c: u32) -> u32 {
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

pub(super) fn gi_public(geo: &MigGeometry, gi: &GiState) -> GpuInstance {
    GpuInstance {
        id: gi.id,
        profile_id: gi.profile_id,
        profile_name: geo
            .by_id(gi.profile_id)
            .map(|p| p.name.to_string())
            .unwrap_or_else(|| format!("profile-{}", gi.profile_id)),
        placement: SlicePlacement {
            start: gi.start,
            size: gi.size,
        },
        compute_instances: gi
            .compute_instances
            .iter()
            .map(|ci| ci_public(gi, ci))
            .collect(),
    }
}

pub(super) fn require_mig_on(gpu: &GpuState, operation: &str) -> Result<(), BackendError> {
    if gpu.mig_current {
        Ok(())
    } else {
        Err(BackendError::NotSupported {
            gpu: gpu.index,
            operation: format!("{operation}: MIG mode is disabled (enable it first)"),
        })
    }
}

pub(super) fn violation_error(
    gpu: u32,
    profile: &str,
    placement: SlicePlacement,
    v: &[Violation],
) -> BackendError {
    let detail = format!(
        "cannot place {profile} at {placement}: {}",
        v.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    );
    if v.iter()
        .all(|x| matches!(x, Violation::PlacementNotAllowed { .. }))
    {
        BackendError::InvalidArgument { gpu, detail }
    } else {
        BackendError::InsufficientResources { gpu, detail }
    }
}

/// Canonical order of GPU-instance profiles, the same for every backend: by
/// compute slices, then memory, then hardware id.
pub fn sort_profiles(v: &mut [GpuInstanceProfile]) {
    v.sort_by_key(|p| (p.slice_count, p.memory_mib, p.id));
}
