//! Deterministic telemetry of simulated GPUs.
//!
//! Every value is a pure function of (seed, GPU, tick): the same seed and tick
//! give the same sample in every process. Values stay in plausible bounds for
//! the model, framebuffer parts add up to the total, and counters (energy,
//! NVLink, PCIe replays) never go down.

use gpu_stack_core::backend::{
    FbMemory, GpuTelemetry, MigTelemetry, NvlinkErrors, Profiling, Reading, RemappedRows,
    RetiredPages, Violations, clock_events,
};
use gpu_stack_core::catalog::{Architecture, GpuModel};

use super::state::{GiState, GpuState};

/// Ticks in one period of the load pattern (energy is summed per period).
const PERIOD: u64 = 64;
const MIB: u64 = 1 << 20;

/// SplitMix64: a small, well-mixed hash of one word.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn h(seed: u64, gpu: u32, field: u64, tick: u64) -> u64 {
    mix(seed ^ mix(u64::from(gpu) ^ mix(field ^ mix(tick))))
}

/// Per-model envelope.
struct Envelope {
    max_sm_mhz: u32,
    idle_sm_mhz: u32,
    mem_mhz: u32,
    idle_mw: u32,
    max_mw: u32,
    hbm: bool,
    nvlink: bool,
    nvlink_links: u32,
    gpm: bool,
}

/// Whether the model's GPUs are NVLink-connected (SXM and superchip boards).
pub fn has_nvlink(model: &GpuModel) -> bool {
    envelope(model).nvlink
}

fn envelope(model: &GpuModel) -> Envelope {
    let name = model.name.to_ascii_uppercase();
    let hbm = model.mig.is_some();
    let nvlink = name.contains("SXM") || name.contains("GH200") || name.contains("GB");
    let gpm = matches!(
        model.architecture,
        Architecture::Hopper | Architecture::Blackwell
    );
    let (max_sm_mhz, mem_mhz, max_mw) = match model.architecture {
        Architecture::Ampere => (1410, 1215, 400_000),
        Architecture::Hopper if name.contains("H200") => (1980, 3201, 700_000),
        Architecture::Hopper => (1980, 2619, 700_000),
        Architecture::Blackwell => (1965, 3996, 1_000_000),
        _ => (1755, 6251, 300_000),
    };
    Envelope {
        max_sm_mhz,
        idle_sm_mhz: 210,
        mem_mhz,
        idle_mw: max_mw / 8,
        max_mw,
        hbm,
        nvlink,
        nvlink_links: match model.architecture {
            Architecture::Ampere => 12,
            _ => 18,
        },
        gpm,
    }
}

/// Utilisation in percent at `tick`.
fn util(gpu: &GpuState, tick: u64) -> u32 {
    let t = &gpu.telemetry;
    let tick = tick % PERIOD;
    let spread = u64::from(t.jitter_pct) * 2 + 1;
    let j = (h(t.seed, gpu.index, 1, tick) % spread) as i64 - i64::from(t.jitter_pct);
    (i64::from(t.utilization_pct.min(100)) + j).clamp(0, 100) as u32
}

fn power_mw(env: &Envelope, gpu: &GpuState, tick: u64) -> u32 {
    let u = util(gpu, tick);
    let span = env.max_mw - env.idle_mw;
    let jitter = (h(gpu.telemetry.seed, gpu.index, 2, tick % PERIOD) % 5_000) as u32;
    (env.idle_mw + span / 100 * u + jitter).min(env.max_mw)
}

/// Energy in mJ from tick 0 up to (not including) `tick`, one tick being
/// `tick_ms` long.
fn energy_mj(env: &Envelope, gpu: &GpuState, tick: u64) -> u64 {
    let tick_ms = gpu.telemetry.tick_ms.max(1);
    let per = |k: u64| u64::from(power_mw(env, gpu, k)) * tick_ms / 1000;
    let period_sum: u64 = (0..PERIOD).map(per).sum();
    let partial: u64 = (0..tick % PERIOD).map(per).sum();
    (tick / PERIOD) * period_sum + partial
}

/// Framebuffer split of `total` bytes with `used_pct` of the usable part in use.
pub fn fb_split(total: u64, reserved_permille: u64, used_pct: u64, wobble: u64) -> FbMemory {
    let reserved = (total / 1000 * reserved_permille) / MIB * MIB;
    let usable = total - reserved;
    let used_pct = (used_pct + wobble).min(100);
    let used = (usable / 100 * used_pct) / MIB * MIB;
    FbMemory {
        total,
        used,
        free: usable - used,
        reserved,
    }
}

/// One sample of a whole GPU at `tick`.
pub fn gpu_sample(model: &GpuModel, gpu: &GpuState, tick: u64) -> GpuTelemetry {
    let env = envelope(model);
    let t = &gpu.telemetry;
    let u = util(gpu, tick);
    let seed = t.seed;
    let sm = env.idle_sm_mhz + (env.max_sm_mhz - env.idle_sm_mhz) * u / 100;
    let temp = match gpu.overheat {
        Some(o) => o.temp_c,
        None => 30 + u * 45 / 100 + (h(seed, gpu.index, 3, tick % PERIOD) % 3) as u32,
    };
    let total = model.memory_mib * MIB;
    let wobble = h(seed, gpu.index, 4, tick % PERIOD) % 3;
    let fb = fb_split(total, 6, u64::from(t.memory_used_pct), wobble);
    let pcie_tx = 1_000 + u * 2_000 + (h(seed, gpu.index, 5, tick % PERIOD) % 500) as u32;
    let pcie_rx = 2_000 + u * 3_000 + (h(seed, gpu.index, 6, tick % PERIOD) % 500) as u32;
    let nvlink_rate = 50_000 + h(seed, gpu.index, 7, 0) % 50_000;
    let if_hbm = |v: u32| {
        if env.hbm {
            Reading::Value(v)
        } else {
            Reading::NotSupported
        }
    };
    GpuTelemetry {
        gpu: gpu.index,
        sm_clock_mhz: Reading::Value(sm),
        mem_clock_mhz: Reading::Value(env.mem_mhz),
        gpu_temp_c: Reading::Value(temp),
        memory_temp_c: if_hbm(temp + 4),
        power_usage_mw: Reading::Value(power_mw(&env, gpu, tick)),
        total_energy_mj: Reading::Value(energy_mj(&env, gpu, tick)),
        pcie_replay_count: Reading::Value(tick / 3_600 * (h(seed, gpu.index, 8, 0) % 2)),
        gpu_util_pct: Reading::Value(u),
        mem_copy_util_pct: Reading::Value(u * 6 / 10),
        enc_util_pct: Reading::Value(0),
        dec_util_pct: Reading::Value((h(seed, gpu.index, 9, tick % PERIOD) % 5) as u32),
        fb_memory: Reading::Value(fb),
        nvlink_total_kib: if env.nvlink {
            Reading::Value(tick * nvlink_rate)
        } else {
            Reading::NotSupported
        },
        remapped_rows: if env.hbm {
            Reading::Value(RemappedRows {
                correctable: (h(seed, gpu.index, 10, 0) % 3) as u32,
                uncorrectable: 0,
                pending: false,
                failed: gpu.row_remap_failed,
            })
        } else {
            Reading::NotSupported
        },
        pcie_tx_kib_per_s: Reading::Value(pcie_tx),
        pcie_rx_kib_per_s: Reading::Value(pcie_rx),
        profiling: profiling(&env, seed, gpu.index, u, tick, 11),
        last_xid: Reading::Value(gpu.last_xid),
        violations: Reading::Value(violations(&env, gpu, tick)),
        ecc_errors: if env.hbm {
            Reading::Value(gpu.ecc)
        } else {
            Reading::NotSupported
        },
        // Ampere and newer remap rows instead of retiring pages.
        retired_pages: if env.hbm {
            Reading::NotSupported
        } else {
            Reading::Value(RetiredPages::default())
        },
        nvlink_errors: if env.nvlink {
            Reading::Value(NvlinkErrors {
                crc_flit: tick / 7_200 * (h(seed, gpu.index, 14, 0) % 2),
                ..NvlinkErrors::default()
            })
        } else {
            Reading::NotSupported
        },
        nvlink_link_kib: if env.nvlink {
            Reading::Value(link_split(tick * nvlink_rate, env.nvlink_links))
        } else {
            Reading::NotSupported
        },
        clocks_event_reasons: Reading::Value(clock_events(gpu, u, temp)),
    }
}

/// Profiling ratios that follow utilisation, plus NVLink rates, on GPUs with
/// GPM (Hopper and newer); `field` seeds the jitter so a GPU and each of its
/// instances differ.
fn profiling(
    env: &Envelope,
    seed: u64,
    gpu: u32,
    u: u32,
    tick: u64,
    field: u64,
) -> Reading<Profiling> {
    if !env.gpm {
        return Reading::NotSupported;
    }
    let ratio = |k: u64, scale: f64| {
        let base = f64::from(u) / 100.0 * scale;
        let j = (h(seed, gpu, field * 16 + k, tick % PERIOD) % 100) as f64 / 1000.0;
        Some((base + j).clamp(0.0, 1.0))
    };
    let sm_active = ratio(1, 0.95);
    Reading::Value(Profiling {
        gr_engine_active: ratio(0, 0.9),
        // Occupancy cannot exceed the share of SMs that have a warp at all.
        sm_occupancy: sm_active.map(|a| a * 0.6),
        sm_active,
        tensor_active: ratio(2, 0.5),
        dram_active: ratio(3, 0.6),
        fp64_active: ratio(4, 0.1),
        fp32_active: ratio(5, 0.3),
        fp16_active: ratio(6, 0.2),
        nvlink_tx_bytes_per_s: env.nvlink.then(|| f64::from(u) * 1.0e9 / 100.0),
        nvlink_rx_bytes_per_s: env.nvlink.then(|| f64::from(u) * 0.9e9 / 100.0),
    })
}

/// Splits a total over `links` links, remainder on link 0, so the parts add up.
fn link_split(total: u64, links: u32) -> Vec<u64> {
    let n = u64::from(links.max(1));
    let mut parts = vec![total / n; n as usize];
    parts[0] += total % n;
    parts
}

/// Throttling time so far (monotonic in `tick`): a tenth of the time power
/// capped on a GPU configured near full load, all of it "low utilisation" on
/// an idle one, and thermal time since an injected overheat.
fn violations(env: &Envelope, gpu: &GpuState, tick: u64) -> Violations {
    let tick_ms = gpu.telemetry.tick_ms.max(1);
    let tick_ns = tick_ms * 1_000_000;
    let load = gpu.telemetry.utilization_pct;
    let power = if load >= 90 { tick * tick_ns / 10 } else { 0 };
    let thermal = gpu.overheat.map_or(0, |o| {
        (tick * tick_ms).saturating_sub(o.since_ms) * 1_000_000
    });
    Violations {
        power_ns: Some(power),
        thermal_ns: Some(thermal),
        sync_boost_ns: Some(0),
        board_limit_ns: Some(0),
        low_util_ns: Some(if load < 5 { tick * tick_ns } else { 0 }),
        reliability_ns: env.hbm.then_some(0),
    }
}

fn clock_events(gpu: &GpuState, u: u32, temp: u32) -> u64 {
    let mut mask = 0;
    if u == 0 {
        mask |= clock_events::GPU_IDLE;
    }
    if u >= 90 {
        mask |= clock_events::SW_POWER_CAP;
    }
    if gpu.overheat.is_some() && temp >= 85 {
        mask |= clock_events::SW_THERMAL | clock_events::HW_THERMAL;
    }
    mask
}

/// One sample of a GPU instance at `tick`; `memory_mib` is the instance's size.
pub fn mig_sample(
    model: &GpuModel,
    gpu: &GpuState,
    gi: &GiState,
    memory_mib: u64,
    tick: u64,
) -> MigTelemetry {
    let env = envelope(model);
    let seed = gpu.telemetry.seed ^ mix(u64::from(gi.id) + 1);
    let u = util(gpu, tick);
    let wobble = h(seed, gpu.index, 20, tick % PERIOD) % 5;
    let fb = fb_split(
        memory_mib * MIB,
        4,
        u64::from(gpu.telemetry.memory_used_pct),
        wobble,
    );
    let profiling = profiling(&env, seed, gpu.index, u, tick, 21).map(|p| Profiling {
        // Link traffic is the GPU's, not an instance's.
        nvlink_tx_bytes_per_s: None,
        nvlink_rx_bytes_per_s: None,
        ..p
    });
    MigTelemetry {
        gpu: gpu.index,
        gpu_instance_id: gi.id,
        fb_memory: Reading::Value(fb),
        profiling,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fb_split_adds_up() {
        for total in [40_960 * MIB, 81_559 * MIB, 4_864 * MIB + 17] {
            for used in [0, 30, 100] {
                for wobble in 0..3 {
                    let fb = fb_split(total, 6, used, wobble);
                    assert!(fb.is_consistent(), "{fb:?}");
                }
            }
        }
    }
}
