//! The node's GPUs at start: identities (UUIDs, PCI bus ids) and the initial
//! state built from a [`SimNodeSpec`], checked against the catalog geometry.

use std::time::{SystemTime, UNIX_EPOCH};

use gpu_stack_core::catalog;
use gpu_stack_core::mig;

use super::spec::{SimError, SimNodeSpec};
use super::state::{
    CiState, GiState, GpuState, NodeState, ProcState, STATE_VERSION, ScheduledFault,
};
use super::telemetry::mix;

pub(super) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Formats 128 bits of a hash as a UUID body `8-4-4-4-12`.
pub(super) fn uuid_body(a: u64, b: u64) -> String {
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xffff,
        b >> 48,
        b & 0xffff_ffff_ffff
    )
}

pub(super) fn str_hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

pub(super) fn gpu_uuid(node: &str, index: u32) -> String {
    let a = mix(str_hash(node) ^ u64::from(index));
    format!("GPU-{}", uuid_body(a, mix(a)))
}

pub(super) fn mig_uuid(gpu_uuid: &str, gi: u32, ci: u32) -> String {
    let a = mix(str_hash(gpu_uuid) ^ (u64::from(gi) << 32) ^ u64::from(ci));
    format!("MIG-{}", uuid_body(a, mix(a ^ 0x004d_4947)))
}

pub(super) const BUS_IDS: [u32; 8] = [0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD];

pub(super) fn bus_id(index: u32) -> String {
    let bus = BUS_IDS.get(index as usize).copied().unwrap_or(0xC0 + index);
    format!("00000000:{bus:02X}:00.0")
}

pub(super) fn initial_state(spec: &SimNodeSpec) -> Result<NodeState, SimError> {
    let mut gpus = Vec::with_capacity(spec.gpus.len());
    let count = spec.gpus.len() as u32;
    for (i, g) in spec.gpus.iter().enumerate() {
        let index = i as u32;
        let model = catalog::lookup(&g.model).map_err(|source| SimError::UnknownModel {
            node: spec.node.clone(),
            gpu: index,
            source,
        })?;
        let uuid = gpu_uuid(&spec.node, index);
        let mut gis = Vec::new();
        if g.mig_enabled || !g.instances.is_empty() {
            let geo = model.mig.as_ref().ok_or_else(|| SimError::NoMig {
                node: spec.node.clone(),
                gpu: index,
                model: model.name.clone(),
            })?;
            let layout_text = mig::format_layout(&g.instances);
            mig::validate(geo, &g.instances).map_err(|v| SimError::InvalidLayout {
                node: spec.node.clone(),
                gpu: index,
                model: model.name.clone(),
                layout: layout_text.clone(),
                reasons: v
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; "),
            })?;
            for (k, inst) in g.instances.iter().enumerate() {
                let p = geo
                    .resolve(&inst.profile)
                    .ok_or_else(|| SimError::InvalidLayout {
                        node: spec.node.clone(),
                        gpu: index,
                        model: model.name.clone(),
                        layout: layout_text.clone(),
                        reasons: format!("unknown profile {}", inst.profile),
                    })?;
                let id = k as u32 + 1;
                gis.push(GiState {
                    id,
                    profile_id: p.id,
                    start: inst.start,
                    size: p.memory_slices,
                    in_use: g.in_use.contains(inst),
                    compute_instances: vec![CiState {
                        id: 0,
                        slice_count: p.compute_slices,
                        start: 0,
                        uuid: mig_uuid(&uuid, id, 0),
                    }],
                });
            }
        }
        let mut processes: Vec<ProcState> = Vec::new();
        for p in &g.processes {
            let bad = |reason: String| SimError::BadProcess {
                node: spec.node.clone(),
                gpu: index,
                pid: p.pid,
                reason,
            };
            if p.pid == 0 || processes.iter().any(|q| q.pid == p.pid) {
                return Err(bad("pid is 0 or appears twice on this GPU".into()));
            }
            let gpu_instance = match (&p.instance, g.mig_enabled) {
                (Some(inst), true) => {
                    let k = g.instances.iter().position(|i| i == inst).ok_or_else(|| {
                        bad(format!("instance {inst} is not one of the GPU's instances"))
                    })?;
                    Some(k as u32 + 1)
                }
                (None, false) => None,
                (None, true) => {
                    return Err(bad("MIG is on: name the instance it runs on".into()));
                }
                (Some(inst), false) => {
                    return Err(bad(format!("names instance {inst} but MIG is off")));
                }
            };
            processes.push(ProcState {
                pid: p.pid,
                gpu_instance,
                compute_instance: gpu_instance.map(|_| 0),
                used_memory_mib: p.used_memory_mib,
            });
        }
        let mut telemetry = g.telemetry.unwrap_or(spec.telemetry);
        telemetry.seed ^= mix(u64::from(index));
        gpus.push(GpuState {
            index,
            model: model.name.clone(),
            uuid,
            pci_bus_id: bus_id(index),
            numa_node: Some(if count >= 2 { index * 2 / count } else { 0 }),
            mig_current: g.mig_enabled,
            mig_pending: g.mig_enabled,
            in_use: false,
            lost: false,
            last_xid: 0,
            overheat: None,
            ecc: Default::default(),
            row_remap_failed: false,
            gpu_instances: gis,
            telemetry,
            processes,
        });
    }
    for f in &spec.faults {
        if let Some(g) = f.gpu
            && g >= count
        {
            return Err(SimError::FaultGpu {
                node: spec.node.clone(),
                gpu: g,
                count: count as usize,
            });
        }
    }
    Ok(NodeState {
        version: STATE_VERSION,
        node: spec.node.clone(),
        epoch_unix_ms: unix_ms(),
        mig_change_needs_reset: spec.mig_change_needs_reset,
        gpus,
        faults: spec
            .faults
            .iter()
            .map(|f| ScheduledFault {
                spec: f.clone(),
                fired: false,
            })
            .collect(),
        events: Vec::new(),
        next_seq: 0,
    })
}
