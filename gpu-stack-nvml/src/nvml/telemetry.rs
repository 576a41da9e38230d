//! Readers for the telemetry beyond the basic counters: throttling time, ECC
//! and retired-page totals, NVLink link state, errors and per-link traffic,
//! and NVML GPM profiling. All through nvml-wrapper's safe API.
//!
//! Each reader returns `Result<_, BackendError>`; the caller turns it into a
//! [`Reading`](gpu_stack_core::backend::Reading) with `reading()`, so "the GPU
//! does not have this" stays distinct from a failed read and a lost GPU aborts
//! the sample.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use gpu_stack_core::backend::{
    BackendError, EccErrors, NvlinkErrors, Profiling, RetiredPages, Violations,
};
use nvml_wrapper::enum_wrappers::device::{
    EccCounter, MemoryError, PerformancePolicy, RetirementCause,
};
use nvml_wrapper::enum_wrappers::nv_link::ErrorCounter;
use nvml_wrapper::enums::gpm::GpmMetricId;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::gpm::gpm_metrics_get;
use nvml_wrapper::{Device, GpmSample, Nvml};
use nvml_wrapper_sys::bindings::NVML_NVLINK_MAX_LINKS;

use super::map_err;

/// Field ids of NVLink data throughput in KiB (`..._THROUGHPUT_DATA_TX/RX`).
pub(super) const FI_NVLINK_TX: u32 = 138;
pub(super) const FI_NVLINK_RX: u32 = 139;

/// Interval between the two GPM samples a profiling reading is computed from.
/// GPM metrics are averages over the time between two samples, and the
/// backend keeps no sample from one call to the next (a sample borrows the
/// library, and a caller may ask at any pace), so each call takes both. 100 ms
/// is long enough for the ratios to average over many GPM updates and short
/// enough that a collection round (the exporter samples GPUs in parallel)
/// stays well under a second. The call's other reads run inside the interval.
pub(super) const GPM_INTERVAL: Duration = Duration::from_millis(100);

/// GPM reports NVLink rates in MiB/s (nvml.h: "NvLink read bandwidth for all
/// links in MiB/sec"); [`Profiling`] carries bytes/s.
const BYTES_PER_MIB: f64 = 1_048_576.0;

/// The metrics read for a whole GPU.
const GPU_METRICS: [GpmMetricId; 10] = [
    GpmMetricId::GraphicsUtil,
    GpmMetricId::SmUtil,
    GpmMetricId::SmOccupancy,
    GpmMetricId::AnyTensorUtil,
    GpmMetricId::DramBwUtil,
    GpmMetricId::Fp64Util,
    GpmMetricId::Fp32Util,
    GpmMetricId::Fp16Util,
    GpmMetricId::NvlinkTotalTxPerSec,
    GpmMetricId::NvlinkTotalRxPerSec,
];

/// The metrics read for a GPU instance: link traffic is the GPU's, not an
/// instance's.
const MIG_METRICS: [GpmMetricId; 8] = [
    GpmMetricId::GraphicsUtil,
    GpmMetricId::SmUtil,
    GpmMetricId::SmOccupancy,
    GpmMetricId::AnyTensorUtil,
    GpmMetricId::DramBwUtil,
    GpmMetricId::Fp64Util,
    GpmMetricId::Fp32Util,
    GpmMetricId::Fp16Util,
];

fn is_not_supported(e: &NvmlError) -> bool {
    matches!(
        e,
        NvmlError::NotSupported | NvmlError::FunctionNotFound | NvmlError::FailedToLoadSymbol(_)
    )
}

fn not_supported(gpu: u32, operation: &str) -> BackendError {
    BackendError::NotSupported {
        gpu,
        operation: operation.to_string(),
    }
}

/// A read where "not supported" is an answer (`None`), not a failure.
pub(super) fn optional<T>(
    r: Result<T, NvmlError>,
    gpu: u32,
    operation: &str,
) -> Result<Option<T>, BackendError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if is_not_supported(&e) => Ok(None),
        Err(e) => Err(map_err(e, gpu, operation)),
    }
}

/// Throttling time per perf policy (`nvmlDeviceGetViolationStatus`, six
/// calls); a policy the GPU does not report is `None`, and a GPU that reports
/// none is `NotSupported`.
pub(super) fn violations(dev: &Device<'_>, gpu: u32) -> Result<Violations, BackendError> {
    let read = |policy: PerformancePolicy, op: &str| {
        optional(
            dev.violation_status(policy).map(|v| v.violation_time),
            gpu,
            op,
        )
    };
    let v = Violations {
        power_ns: read(PerformancePolicy::Power, "power violation time")?,
        thermal_ns: read(PerformancePolicy::Thermal, "thermal violation time")?,
        sync_boost_ns: read(PerformancePolicy::SyncBoost, "sync boost violation time")?,
        board_limit_ns: read(PerformancePolicy::BoardLimit, "board limit violation time")?,
        low_util_ns: read(
            PerformancePolicy::LowUtilization,
            "low utilisation violation time",
        )?,
        reliability_ns: read(PerformancePolicy::Reliability, "reliability violation time")?,
    };
    if v == Violations::default() {
        return Err(not_supported(gpu, "violation status"));
    }
    Ok(v)
}

/// ECC totals (`nvmlDeviceGetTotalEccErrors`, four calls): `NotSupported`
/// when ECC is off or absent.
pub(super) fn ecc_errors(dev: &Device<'_>, gpu: u32) -> Result<EccErrors, BackendError> {
    let read = |kind: MemoryError, counter: EccCounter, op: &str| {
        dev.total_ecc_errors(kind, counter)
            .map_err(|e| map_err(e, gpu, op))
    };
    Ok(EccErrors {
        sbe_volatile: read(
            MemoryError::Corrected,
            EccCounter::Volatile,
            "volatile corrected ECC errors",
        )?,
        dbe_volatile: read(
            MemoryError::Uncorrected,
            EccCounter::Volatile,
            "volatile uncorrected ECC errors",
        )?,
        sbe_aggregate: read(
            MemoryError::Corrected,
            EccCounter::Aggregate,
            "aggregate corrected ECC errors",
        )?,
        dbe_aggregate: read(
            MemoryError::Uncorrected,
            EccCounter::Aggregate,
            "aggregate uncorrected ECC errors",
        )?,
    })
}

/// Retired pages per cause (`nvmlDeviceGetRetiredPages`: one call per cause
/// when none are retired, two otherwise) and whether a retirement is pending
/// (`nvmlDeviceGetRetiredPagesPendingStatus`). GPUs from Ampere on remap rows
/// instead and answer `NotSupported`.
pub(super) fn retired_pages(dev: &Device<'_>, gpu: u32) -> Result<RetiredPages, BackendError> {
    let count = |cause: RetirementCause, op: &str| {
        dev.retired_pages(cause)
            .map(|pages| pages.len() as u64)
            .map_err(|e| map_err(e, gpu, op))
    };
    Ok(RetiredPages {
        single_bit: count(
            RetirementCause::MultipleSingleBitEccErrors,
            "pages retired for single-bit errors",
        )?,
        double_bit: count(
            RetirementCause::DoubleBitEccError,
            "pages retired for double-bit errors",
        )?,
        pending: dev
            .are_pages_pending_retired()
            .map_err(|e| map_err(e, gpu, "retired pages pending"))?,
    })
}

/// The GPU's NVLink links by number (`nvmlDeviceGetNvLinkState` for each of
/// `NVML_NVLINK_MAX_LINKS`): `Some(active)` for a link the GPU has, `None` for
/// a number it does not (a 12-link A100 refuses 12 to 17).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Links(Vec<Option<bool>>);

impl Links {
    /// Links 0 up to and including the last active one; 0 when none is.
    pub(super) fn span(&self) -> u32 {
        self.0
            .iter()
            .rposition(|s| *s == Some(true))
            .map_or(0, |i| i as u32 + 1)
    }

    /// Whether `link` is up.
    pub(super) fn is_active(&self, link: u32) -> bool {
        self.0.get(link as usize) == Some(&Some(true))
    }

    fn active(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.0.len() as u32).filter(|&l| self.is_active(l))
    }
}

/// Link states; `NotSupported` when the GPU has no NVLink (link 0 is refused
/// as not supported).
pub(super) fn links(dev: &Device<'_>, gpu: u32) -> Result<Links, BackendError> {
    let mut states = Vec::with_capacity(NVML_NVLINK_MAX_LINKS as usize);
    for link in 0..NVML_NVLINK_MAX_LINKS {
        match dev.link_wrapper_for(link).is_active() {
            Ok(active) => states.push(Some(active)),
            Err(e) if link == 0 && is_not_supported(&e) => {
                return Err(not_supported(gpu, "NVLink state"));
            }
            Err(NvmlError::NotSupported | NvmlError::InvalidArg | NvmlError::NotFound) => {
                states.push(None)
            }
            Err(e) => return Err(map_err(e, gpu, "NVLink state")),
        }
    }
    Ok(Links(states))
}

/// NVLink error counters summed over the active links
/// (`nvmlDeviceGetNvLinkErrorCounter`, four calls per active link). A counter
/// a link does not keep adds nothing; when no active link keeps any, the
/// reading is `NotSupported`.
pub(super) fn nvlink_errors(
    dev: &Device<'_>,
    gpu: u32,
    links: &Links,
) -> Result<NvlinkErrors, BackendError> {
    let mut sum = NvlinkErrors::default();
    let mut kept = false;
    let mut any_active = false;
    for link in links.active() {
        any_active = true;
        let l = dev.link_wrapper_for(link);
        for (counter, slot, op) in [
            (
                ErrorCounter::DlCrcFlit,
                &mut sum.crc_flit,
                "NVLink CRC flit errors",
            ),
            (
                ErrorCounter::DlCrcData,
                &mut sum.crc_data,
                "NVLink CRC data errors",
            ),
            (ErrorCounter::DlReplay, &mut sum.replay, "NVLink replays"),
            (
                ErrorCounter::DlRecovery,
                &mut sum.recovery,
                "NVLink recoveries",
            ),
        ] {
            if let Some(v) = optional(l.error_counter(counter), gpu, op)? {
                *slot = slot.saturating_add(v);
                kept = true;
            }
        }
    }
    if any_active && !kept {
        return Err(not_supported(gpu, "NVLink error counters"));
    }
    Ok(sum)
}

/// Field-value requests for the data each link of `0..span` moved: TX then RX
/// per link (scope id = link number).
pub(super) fn link_fields(span: u32) -> impl Iterator<Item = (u32, u32)> {
    (0..span).flat_map(|l| [(FI_NVLINK_TX, l), (FI_NVLINK_RX, l)])
}

/// Per-link TX + RX in KiB from the results of [`link_fields`], in the same
/// order. A link that is down and keeps no counter counts 0; an active link's
/// failed read fails the reading.
pub(super) fn link_kib(
    links: &Links,
    results: &[Result<u64, BackendError>],
) -> Result<Vec<u64>, BackendError> {
    results
        .chunks(2)
        .enumerate()
        .map(|(link, pair)| {
            let sum = match pair {
                [Ok(tx), Ok(rx)] => Ok(tx.saturating_add(*rx)),
                [Err(e), _] | [_, Err(e)] => Err(e.clone()),
                _ => Ok(0),
            };
            match sum {
                Err(BackendError::NotSupported { .. }) if !links.is_active(link as u32) => Ok(0),
                other => other,
            }
        })
        .collect()
}

static NO_GPM_LOGGED: AtomicBool = AtomicBool::new(false);

/// Whether the GPU has NVML GPM (`nvmlGpmQueryDeviceSupport`; Hopper and
/// newer): `NotSupported` when it does not, which is logged once per process.
pub(super) fn gpm_available(dev: &Device<'_>, gpu: u32) -> Result<(), BackendError> {
    match dev.gpm_support() {
        Ok(true) => Ok(()),
        Ok(false) => Err(no_gpm(gpu)),
        Err(e) if is_not_supported(&e) => Err(no_gpm(gpu)),
        Err(e) => Err(map_err(e, gpu, "GPM support")),
    }
}

fn no_gpm(gpu: u32) -> BackendError {
    if !NO_GPM_LOGGED.swap(true, Ordering::Relaxed) {
        tracing::info!(
            gpu,
            "GPU has no NVML GPM (Hopper and newer do): its profiling metrics \
             (DCGM_FI_PROF_*) need DCGM and are left out"
        );
    }
    not_supported(gpu, "GPM profiling")
}

/// The first or second GPM sample of the whole GPU (`nvmlGpmSampleAlloc` and
/// `nvmlGpmSampleGet`).
pub(super) fn gpm_sample<'n>(dev: &Device<'n>, gpu: u32) -> Result<GpmSample<'n>, BackendError> {
    dev.gpm_sample().map_err(|e| map_err(e, gpu, "GPM sample"))
}

/// The first or second GPM sample of GPU instance `gi`
/// (`nvmlGpmMigSampleGet`).
pub(super) fn gpm_mig_sample<'n>(
    dev: &Device<'n>,
    gpu: u32,
    gi: u32,
) -> Result<GpmSample<'n>, BackendError> {
    dev.gpm_mig_sample(gi)
        .map_err(|e| map_err(e, gpu, "GPM sample of a GPU instance"))
}

/// Sleeps out what is left of [`GPM_INTERVAL`] since `started`.
pub(super) fn wait_out_interval(started: Instant) {
    std::thread::sleep(GPM_INTERVAL.saturating_sub(started.elapsed()));
}

/// Whether the metrics are for a whole GPU (with NVLink rates) or a GPU
/// instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GpmScope {
    /// The whole GPU.
    Gpu,
    /// One GPU instance.
    GpuInstance,
}

/// Profiling between two samples (`nvmlGpmMetricsGet`, one call): percent
/// becomes a ratio clamped to 0..=1, MiB/s becomes bytes/s; a metric the GPU
/// does not provide (or fails to compute) is `None`.
pub(super) fn gpm_profiling(
    nvml: &Nvml,
    gpu: u32,
    first: &GpmSample<'_>,
    second: &GpmSample<'_>,
    scope: GpmScope,
) -> Result<Profiling, BackendError> {
    let ids: &[GpmMetricId] = match scope {
        GpmScope::Gpu => &GPU_METRICS,
        GpmScope::GpuInstance => &MIG_METRICS,
    };
    let results =
        gpm_metrics_get(nvml, first, second, ids).map_err(|e| map_err(e, gpu, "GPM metrics"))?;
    let mut p = Profiling::default();
    for (id, r) in ids.iter().zip(results) {
        let v = match r {
            Ok(m) if m.value.is_finite() => m.value,
            Ok(m) => {
                tracing::debug!(gpu, metric = ?id, value = m.value, "GPM metric not a number");
                continue;
            }
            Err(e) if is_not_supported(&e) => continue,
            Err(e) => {
                tracing::debug!(gpu, metric = ?id, error = %e, "GPM metric failed");
                continue;
            }
        };
        let ratio = Some((v / 100.0).clamp(0.0, 1.0));
        let rate = Some(v.max(0.0) * BYTES_PER_MIB);
        match id {
            GpmMetricId::GraphicsUtil => p.gr_engine_active = ratio,
            GpmMetricId::SmUtil => p.sm_active = ratio,
            GpmMetricId::SmOccupancy => p.sm_occupancy = ratio,
            GpmMetricId::AnyTensorUtil => p.tensor_active = ratio,
            GpmMetricId::DramBwUtil => p.dram_active = ratio,
            GpmMetricId::Fp64Util => p.fp64_active = ratio,
            GpmMetricId::Fp32Util => p.fp32_active = ratio,
            GpmMetricId::Fp16Util => p.fp16_active = ratio,
            GpmMetricId::NvlinkTotalTxPerSec => p.nvlink_tx_bytes_per_s = rate,
            GpmMetricId::NvlinkTotalRxPerSec => p.nvlink_rx_bytes_per_s = rate,
            _ => {}
        }
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns(gpu: u32) -> Result<u64, BackendError> {
        Err(not_supported(gpu, "field value"))
    }

    #[test]
    fn span_ends_at_the_last_active_link() {
        assert_eq!(Links(vec![]).span(), 0);
        assert_eq!(Links(vec![Some(false), None]).span(), 0);
        assert_eq!(
            Links(vec![Some(true), Some(false), Some(true), None]).span(),
            3
        );
        assert_eq!(Links(vec![None, Some(true), Some(false)]).span(), 2);
    }

    #[test]
    fn link_fields_ask_tx_then_rx_per_link() {
        let f: Vec<_> = link_fields(2).collect();
        assert_eq!(
            f,
            [
                (FI_NVLINK_TX, 0),
                (FI_NVLINK_RX, 0),
                (FI_NVLINK_TX, 1),
                (FI_NVLINK_RX, 1)
            ]
        );
    }

    #[test]
    fn link_kib_adds_directions_and_zeroes_idle_links_without_counters() {
        let links = Links(vec![Some(true), Some(false), Some(true)]);
        let got = link_kib(&links, &[Ok(3), Ok(4), ns(0), ns(0), Ok(1), Ok(2)]).unwrap();
        assert_eq!(got, [7, 0, 3]);
        let err = link_kib(&links, &[ns(0), Ok(4), Ok(0), Ok(0), Ok(1), Ok(2)]).unwrap_err();
        assert_eq!(
            err.kind(),
            "not_supported",
            "an active link's counter is missing"
        );
    }
}
