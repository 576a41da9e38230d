//! What preparing and unpreparing a claim means for a node's GPUs, and the
//! checkpoint that makes it survive a plugin restart.
//!
//! Prepare turns the devices the scheduler allocated into per-GPU targets: a
//! MIG device becomes a GPU instance (with one full compute instance) at the
//! allocated placement, kept beside everything the GPU already holds; a
//! whole GPU needs MIG off and no instances. The layout each GPU would hold
//! is checked with [`crate::mig::validate_with`] for the node's driver, so a
//! rule the counters do not carry (R5 on drivers before R510) refuses the
//! claim with the validator's reason before anything changes.
//!
//! The checkpoint records a claim as `preparing` (with the placements it
//! will create) before any instance is created, and as `prepared` after: a
//! restart rolls `preparing` claims back (destroys what they may have
//! created) and keeps `prepared` ones, so nothing leaks and nothing is made
//! twice.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::counters::ModelDevice;
use super::devices::{GpuDevices, find_device};
use crate::mig::{MigGeometry, PlacedInstance, ValidateOptions, format_layout, validate_with};
use crate::migmanager::{ObservedGpu, TargetGi, TargetGpu};

/// Checkpoint format version.
pub const CHECKPOINT_VERSION: u32 = 1;
/// Most claims one checkpoint holds (a node cannot run more MIG devices and
/// GPUs than this).
pub const MAX_CHECKPOINT_CLAIMS: usize = 4096;
/// Largest checkpoint file read back.
pub const MAX_CHECKPOINT_BYTES: usize = 8 << 20;
/// Most devices one claim may be allocated on a node.
pub const MAX_DEVICES_PER_CLAIM: usize = 64;

/// Where a claim stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClaimState {
    /// Instances may be partly created; a restart rolls them back.
    Preparing,
    /// Everything exists; the CDI devices were handed to the kubelet.
    Prepared,
}

/// One device of a prepared claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedDevice {
    /// The requests of the claim this device serves.
    pub requests: Vec<String>,
    /// Published device name.
    pub device: String,
    /// GPU index.
    pub gpu: u32,
    /// GPU UUID (the GPU a restart must find again).
    pub gpu_uuid: String,
    /// The MIG instance: profile name, hardware profile id and placement;
    /// `None` for a whole GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<PreparedMig>,
    /// CDI device names handed to the kubelet.
    #[serde(default)]
    pub cdi_devices: Vec<String>,
}

/// The MIG instance behind a prepared device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedMig {
    /// GPU-instance profile name.
    pub profile: String,
    /// Hardware GPU-instance profile id.
    pub profile_id: u32,
    /// Placement start.
    pub start: u32,
    /// Placement size.
    pub size: u32,
    /// MIG device UUID once created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
}

/// One claim in the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimEntry {
    /// Claim namespace.
    pub namespace: String,
    /// Claim name.
    pub name: String,
    /// State.
    pub state: ClaimState,
    /// Its devices.
    pub devices: Vec<PreparedDevice>,
}

/// The plugin's record of prepared claims, by claim UID.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Checkpoint {
    /// Format version.
    pub version: u32,
    /// Claims by UID.
    pub claims: BTreeMap<String, ClaimEntry>,
}

/// A checkpoint that cannot be read back.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Too large to be ours.
    #[error(
        "checkpoint is {0} bytes, more than {MAX_CHECKPOINT_BYTES}; move it aside and restart the plugin (prepared claims are then re-prepared by the kubelet)"
    )]
    TooLarge(usize),
    /// Not JSON of the expected shape.
    #[error("checkpoint is not valid: {0}; move it aside and restart the plugin")]
    Invalid(String),
    /// Written by a newer plugin.
    #[error(
        "checkpoint version {0} is newer than this plugin's {CHECKPOINT_VERSION}; run the newer plugin"
    )]
    Version(u32),
    /// More claims than any node holds.
    #[error("checkpoint holds {0} claims, more than {MAX_CHECKPOINT_CLAIMS}")]
    TooManyClaims(usize),
    /// No room for another claim.
    #[error(
        "the node already holds {MAX_CHECKPOINT_CLAIMS} prepared claims, the most its checkpoint \
         records; delete finished pods so their claims are unprepared, then retry"
    )]
    Full,
}

impl Checkpoint {
    /// An empty checkpoint.
    pub fn new() -> Self {
        Checkpoint {
            version: CHECKPOINT_VERSION,
            claims: BTreeMap::new(),
        }
    }

    /// Reads a checkpoint, bounded.
    pub fn decode(bytes: &[u8]) -> Result<Checkpoint, CheckpointError> {
        if bytes.len() > MAX_CHECKPOINT_BYTES {
            return Err(CheckpointError::TooLarge(bytes.len()));
        }
        let c: Checkpoint = serde_json::from_slice(bytes).map_err(|e| {
            CheckpointError::Invalid(crate::echo::clipped(&e.to_string()).to_string())
        })?;
        if c.version > CHECKPOINT_VERSION {
            return Err(CheckpointError::Version(c.version));
        }
        if c.claims.len() > MAX_CHECKPOINT_CLAIMS {
            return Err(CheckpointError::TooManyClaims(c.claims.len()));
        }
        Ok(c)
    }

    /// Refuses a claim the checkpoint has no room for: a new claim once it
    /// holds [`MAX_CHECKPOINT_CLAIMS`] (a checkpoint past the bound could
    /// not be read back at the next start). A claim already recorded always
    /// fits.
    pub fn room_for(&self, uid: &str) -> Result<(), CheckpointError> {
        if self.claims.contains_key(uid) || self.claims.len() < MAX_CHECKPOINT_CLAIMS {
            Ok(())
        } else {
            Err(CheckpointError::Full)
        }
    }

    /// The checkpoint as JSON.
    pub fn encode(&self) -> Vec<u8> {
        // Plain data of strings and integers: serialising cannot fail.
        serde_json::to_vec_pretty(self).unwrap_or_default()
    }

    /// MIG instances that prepared or preparing claims own on GPU `uuid`.
    pub fn owned_on(&self, uuid: &str) -> Vec<(&str, &PreparedMig)> {
        self.claims
            .iter()
            .flat_map(|(uid, c)| {
                c.devices
                    .iter()
                    .filter(move |d| d.gpu_uuid == uuid)
                    .filter_map(move |d| d.mig.as_ref().map(|m| (uid.as_str(), m)))
            })
            .collect()
    }

    /// Whether a claim holds GPU `uuid` whole.
    pub fn whole_gpu_owner(&self, uuid: &str) -> Option<&str> {
        self.claims.iter().find_map(|(uid, c)| {
            c.devices
                .iter()
                .any(|d| d.gpu_uuid == uuid && d.mig.is_none())
                .then_some(uid.as_str())
        })
    }
}

/// A device the scheduler allocated to a claim, for this driver and pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocatedDevice {
    /// Request name.
    pub request: String,
    /// Device name.
    pub device: String,
}

/// Why a claim cannot be prepared. Nothing was changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PrepareError {
    /// No device of ours was allocated.
    #[error("claim has no device of this driver allocated on this node")]
    NothingAllocated,
    /// Too many devices.
    #[error(
        "claim is allocated {0} devices on this node, at most {MAX_DEVICES_PER_CLAIM} are supported"
    )]
    TooManyDevices(usize),
    /// A device name this node does not publish.
    #[error(
        "device {0} is not published by this node (its GPUs changed since the claim was allocated); delete the pod so the claim is allocated again"
    )]
    UnknownDevice(String),
    /// The layout the GPU would hold breaks a MIG rule.
    #[error("GPU {gpu}: the MIG layout {layout} is not valid: {reason}")]
    InvalidLayout {
        /// GPU index.
        gpu: u32,
        /// The layout the GPU would hold.
        layout: String,
        /// The validator's reasons.
        reason: String,
    },
    /// A whole GPU that holds MIG instances, or one another claim holds.
    #[error("GPU {gpu}: {reason}")]
    GpuBusy {
        /// GPU index.
        gpu: u32,
        /// Why.
        reason: String,
    },
}

/// What preparing one claim creates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimPlan {
    /// The devices, in allocation order.
    pub devices: Vec<PreparedDevice>,
    /// Per GPU index: the layout the GPU must hold afterwards (its current
    /// instances plus the new ones); `None` for a GPU wanted whole (MIG off).
    pub targets: BTreeMap<u32, Option<Vec<PlacedInstance>>>,
}

/// One GPU as prepare sees it.
#[derive(Debug, Clone)]
pub struct PrepareGpu<'a> {
    /// What it publishes.
    pub published: &'a GpuDevices,
    /// Its geometry, where MIG capable.
    pub geometry: Option<&'a MigGeometry>,
    /// Instances it holds now (ours and foreign).
    pub current: Vec<PlacedInstance>,
}

/// Plans a claim: resolves its allocated devices, and checks the layout
/// every touched GPU would hold. Pure: nothing changes until the plan runs.
pub fn plan_claim(
    gpus: &[PrepareGpu<'_>],
    checkpoint: &Checkpoint,
    claim_uid: &str,
    allocated: &[AllocatedDevice],
    options: ValidateOptions,
) -> Result<ClaimPlan, PrepareError> {
    if allocated.is_empty() {
        return Err(PrepareError::NothingAllocated);
    }
    if allocated.len() > MAX_DEVICES_PER_CLAIM {
        return Err(PrepareError::TooManyDevices(allocated.len()));
    }
    let published: Vec<GpuDevices> = gpus.iter().map(|g| g.published.clone()).collect();
    let mut devices: Vec<PreparedDevice> = Vec::new();
    let mut targets: BTreeMap<u32, Option<Vec<PlacedInstance>>> = BTreeMap::new();
    for a in allocated {
        if let Some(d) = devices.iter_mut().find(|d| d.device == a.device) {
            // One device serving several requests (the scheduler never does
            // this without shared allocation, but the wire allows it).
            d.requests.push(a.request.clone());
            continue;
        }
        let loc = find_device(&published, &a.device).ok_or_else(|| {
            PrepareError::UnknownDevice(crate::echo::clipped(&a.device).to_string())
        })?;
        let gpu = &gpus[loc.gpu_position];
        let index = gpu.published.gpu;
        let uuid = gpu.published.uuid.clone();
        match loc.kind {
            ModelDevice::WholeGpu => {
                if let Some(owner) = checkpoint
                    .whole_gpu_owner(&uuid)
                    .filter(|o| *o != claim_uid)
                {
                    return Err(PrepareError::GpuBusy {
                        gpu: index,
                        reason: format!("claim {owner} holds this GPU"),
                    });
                }
                if !gpu.current.is_empty() {
                    return Err(PrepareError::GpuBusy {
                        gpu: index,
                        reason: format!(
                            "allocated whole but it holds MIG instances {}; they must be gone first",
                            format_layout(&gpu.current)
                        ),
                    });
                }
                targets.insert(index, None);
                devices.push(PreparedDevice {
                    requests: vec![a.request.clone()],
                    device: a.device.clone(),
                    gpu: index,
                    gpu_uuid: uuid,
                    mig: None,
                    cdi_devices: Vec::new(),
                });
            }
            ModelDevice::Placement(p) => {
                let (Some(geometry), Some(model)) = (gpu.geometry, gpu.published.model.as_ref())
                else {
                    return Err(PrepareError::UnknownDevice(
                        crate::echo::clipped(&a.device).to_string(),
                    ));
                };
                let Some(instance) = model.instance(geometry, p) else {
                    return Err(PrepareError::UnknownDevice(
                        crate::echo::clipped(&a.device).to_string(),
                    ));
                };
                if let Some(owner) = checkpoint.whole_gpu_owner(&uuid) {
                    return Err(PrepareError::GpuBusy {
                        gpu: index,
                        reason: format!("claim {owner} holds this GPU whole"),
                    });
                }
                let placement = &model.placements[p];
                let profile = &geometry.gi_profiles[placement.profile];
                let target = targets
                    .entry(index)
                    .or_insert_with(|| Some(gpu.current.clone()));
                let Some(layout) = target else {
                    return Err(PrepareError::GpuBusy {
                        gpu: index,
                        reason: "allocated whole and as MIG devices in one claim".into(),
                    });
                };
                // Already there (a retried prepare): keep, do not add twice.
                if !layout.contains(&instance) {
                    layout.push(instance);
                }
                devices.push(PreparedDevice {
                    requests: vec![a.request.clone()],
                    device: a.device.clone(),
                    gpu: index,
                    gpu_uuid: uuid,
                    mig: Some(PreparedMig {
                        profile: profile.name.to_string(),
                        profile_id: profile.id,
                        start: placement.start,
                        size: placement.size,
                        uuid: None,
                    }),
                    cdi_devices: Vec::new(),
                });
            }
        }
    }
    for (index, target) in &targets {
        let Some(layout) = target else { continue };
        let Some(geometry) = gpus
            .iter()
            .find(|g| g.published.gpu == *index)
            .and_then(|g| g.geometry)
        else {
            continue;
        };
        if let Err(violations) = validate_with(geometry, layout, options) {
            return Err(PrepareError::InvalidLayout {
                gpu: *index,
                layout: format_layout(layout),
                reason: crate::echo::join_capped(&violations),
            });
        }
    }
    Ok(ClaimPlan { devices, targets })
}

/// The planner target for one GPU: `None` wants it whole (MIG off, no
/// instances); `Some(layout)` wants MIG on with exactly these GPU instances.
/// An instance the GPU already holds keeps its compute instances as they are
/// (a foreign instance may be split into several); a new one gets one
/// compute instance spanning it.
pub fn target_gpu(
    observed: &ObservedGpu<u32, u32>,
    geometry: &MigGeometry,
    layout: Option<&[PlacedInstance]>,
) -> TargetGpu<u32, u32> {
    let Some(layout) = layout else {
        return TargetGpu {
            index: observed.index,
            mig_enabled: false,
            gis: Vec::new(),
        };
    };
    let mut gis: Vec<TargetGi<u32, u32>> = layout
        .iter()
        .filter_map(|inst| {
            let p = geometry.resolve(&inst.profile)?;
            let cis = observed
                .gis
                .iter()
                .find(|g| g.profile == p.id && g.start == inst.start && !g.cis.is_empty())
                .map(|g| g.cis.iter().map(|c| c.profile).collect())
                .unwrap_or_else(|| vec![p.compute_slices]);
            Some(TargetGi {
                profile: p.id,
                start: inst.start,
                cis,
            })
        })
        .collect();
    gis.sort_by_key(|g| g.start);
    TargetGpu {
        index: observed.index,
        mig_enabled: true,
        gis,
    }
}

/// Whether a driver version predates R510 (the 4g+3g rule, R5).
pub fn pre_r510(driver_version: &str) -> bool {
    driver_version
        .split('.')
        .next()
        .and_then(|m| m.trim().parse::<u32>().ok())
        .is_some_and(|major| major < 510)
}

#[cfg(test)]
mod tests;
