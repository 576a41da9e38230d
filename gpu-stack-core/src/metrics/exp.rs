//! The families dcgm-exporter computes rather than reads (`DCGM_EXP_*`):
//! windowed and cumulative Xid and clock event counts, GPU health per watch,
//! and NVLink P2P status per peer, as the labeled series the renderer prints.
//!
//! An entity with no event yet still gets one series of value 0 carrying only
//! the window label, as dcgm-exporter does, so alerts see a 0 before the first
//! event instead of no data.

use std::collections::BTreeMap;

use crate::backend::{GpuTelemetry, P2pStatus, clock_events};

use super::format::Value;
use super::render::LabeledValue;
use super::xid::EventWindow;

/// Most events kept per window (older ones are dropped first).
pub const WINDOW_CAPACITY: usize = 4096;

fn count(v: u64) -> Value {
    Value::Int(i64::try_from(v).unwrap_or(i64::MAX))
}

/// Xid events of one entity: the window behind `DCGM_EXP_XID_ERRORS_COUNT` and
/// the totals behind `DCGM_EXP_XID_ERRORS_TOTAL`.
#[derive(Debug, Clone)]
pub struct XidCounts {
    window: EventWindow,
    totals: BTreeMap<u32, u64>,
}

impl XidCounts {
    /// Counts over a window of `window_ms` milliseconds.
    pub fn new(window_ms: u64) -> Self {
        Self {
            window: EventWindow::new(window_ms, WINDOW_CAPACITY),
            totals: BTreeMap::new(),
        }
    }

    /// Records Xid `code` at `at_ms`.
    pub fn record(&mut self, at_ms: u64, code: u32) {
        self.window.record(at_ms, code);
        let total = self.totals.entry(code).or_insert(0);
        *total = total.saturating_add(1);
    }

    /// The last Xid recorded.
    pub fn last(&self) -> Option<u32> {
        self.window.last()
    }

    /// Count per code within the window ending at `now_ms`.
    pub fn windowed(&mut self, now_ms: u64) -> BTreeMap<u32, u64> {
        self.window.counts(now_ms)
    }

    /// Count per code since the start.
    pub fn totals(&self) -> &BTreeMap<u32, u64> {
        &self.totals
    }
}

/// Adds `from` into `into`, code by code.
pub fn merge_counts(into: &mut BTreeMap<u32, u64>, from: &BTreeMap<u32, u64>) {
    for (code, n) in from {
        let e = into.entry(*code).or_insert(0);
        *e = e.saturating_add(*n);
    }
}

/// Series of `DCGM_EXP_XID_ERRORS_COUNT` from counts per code.
pub fn xid_count_series(counts: &BTreeMap<u32, u64>, window_ms: u64) -> Vec<LabeledValue> {
    coded_series(counts, Some(window_ms), "xid", |c| c.to_string())
}

/// Series of `DCGM_EXP_XID_ERRORS_TOTAL` from totals per code.
pub fn xid_total_series(totals: &BTreeMap<u32, u64>) -> Vec<LabeledValue> {
    coded_series(totals, None, "xid", |c| c.to_string())
}

fn coded_series(
    counts: &BTreeMap<u32, u64>,
    window_ms: Option<u64>,
    label: &'static str,
    name: impl Fn(u32) -> String,
) -> Vec<LabeledValue> {
    let window = window_ms.map(|w| ("window_size_in_ms", w.to_string()));
    if counts.is_empty() {
        return vec![LabeledValue {
            labels: window.into_iter().collect(),
            value: Value::Int(0),
        }];
    }
    counts
        .iter()
        .map(|(code, n)| LabeledValue {
            labels: std::iter::once((label, name(*code)))
                .chain(window.clone())
                .collect(),
            value: count(*n),
        })
        .collect()
}

/// Clock event reasons of one GPU as seen at each collection: the window
/// counts the samples that showed each reason (`DCGM_EXP_CLOCK_EVENTS_COUNT`),
/// the totals count the times a reason came on (`DCGM_EXP_CLOCK_EVENTS_TOTAL`,
/// edge-counted, so a reason that stays on counts once).
#[derive(Debug, Clone)]
pub struct ClockEventCounts {
    window: EventWindow,
    totals: BTreeMap<u32, u64>,
    previous: u64,
}

impl ClockEventCounts {
    /// Counts over a window of `window_ms` milliseconds.
    pub fn new(window_ms: u64) -> Self {
        Self {
            window: EventWindow::new(window_ms, WINDOW_CAPACITY),
            totals: BTreeMap::new(),
            previous: 0,
        }
    }

    /// Records the reason bitmask sampled at `at_ms`; unknown bits are ignored.
    pub fn observe(&mut self, at_ms: u64, mask: u64) {
        for (bit, _) in clock_events::NAMES {
            if mask & bit == 0 {
                continue;
            }
            let code = bit as u32;
            self.window.record(at_ms, code);
            if self.previous & bit == 0 {
                let t = self.totals.entry(code).or_insert(0);
                *t = t.saturating_add(1);
            }
        }
        self.previous = mask;
    }

    /// Series of `DCGM_EXP_CLOCK_EVENTS_COUNT` for the window ending at `now_ms`.
    pub fn count_series(&mut self, now_ms: u64, window_ms: u64) -> Vec<LabeledValue> {
        let counts = self.window.counts(now_ms);
        coded_series(&counts, Some(window_ms), "clock_event", reason_name)
    }

    /// Series of `DCGM_EXP_CLOCK_EVENTS_TOTAL`.
    pub fn total_series(&self) -> Vec<LabeledValue> {
        coded_series(&self.totals, None, "clock_event", reason_name)
    }
}

fn reason_name(bit: u32) -> String {
    clock_events::name(u64::from(bit))
        .unwrap_or("unknown")
        .to_string()
}

/// A DCGM health watch result: the value of `DCGM_EXP_GPU_HEALTH_STATUS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum HealthResult {
    /// Healthy (0).
    Pass,
    /// Degraded, keep an eye on it (10).
    Warn,
    /// Failed (20).
    Fail,
}

impl HealthResult {
    /// DCGM's number for the result.
    pub fn code(self) -> i64 {
        match self {
            Self::Pass => 0,
            Self::Warn => 10,
            Self::Fail => 20,
        }
    }
}

/// One watch's verdict, with DCGM's error code name (`DCGM_FR_OK` when it passes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchStatus {
    /// Watch name as dcgm-exporter prints it (`PCIE`, `MEM`, ...).
    pub watch: &'static str,
    /// The verdict.
    pub result: HealthResult,
    /// Why, as a DCGM error code name.
    pub error_code: &'static str,
}

/// The watches dcgm-exporter reports, in its order.
pub const HEALTH_WATCHES: [&str; 10] = [
    "PCIE", "NVLINK", "PMU", "MCU", "MEM", "SM", "INFOROM", "THERMAL", "POWER", "DRIVER",
];

/// PCIe replays between two samples above which the PCIe watch warns (DCGM's
/// default replay-rate threshold is 8 per minute; collections are at most
/// minutes apart).
const PCIE_REPLAY_WARN: u64 = 8;

/// GPU health per watch, computed from what NVML reports (DCGM runs its own
/// health checks; this is the same verdict from the same underlying signals):
/// the current and previous sample and the Xids seen in the recent window.
/// Each watch keeps its worst finding.
pub fn gpu_health(
    current: &GpuTelemetry,
    previous: Option<&GpuTelemetry>,
    recent_xids: &BTreeMap<u32, u64>,
) -> Vec<WatchStatus> {
    let mut out: Vec<WatchStatus> = HEALTH_WATCHES
        .iter()
        .map(|w| WatchStatus {
            watch: w,
            result: HealthResult::Pass,
            error_code: "DCGM_FR_OK",
        })
        .collect();
    let mut find = |watch: &str, result: HealthResult, code: &'static str| {
        if let Some(w) = out.iter_mut().find(|w| w.watch == watch)
            && result > w.result
        {
            w.result = result;
            w.error_code = code;
        }
    };
    let xid = |code: u32| recent_xids.get(&code).is_some_and(|n| *n > 0);

    // PCIe: the GPU fell off the bus, or replays climb.
    if xid(79) {
        find("PCIE", HealthResult::Fail, "DCGM_FR_XID_ERROR");
    }
    if let (Some(cur), Some(prev)) = (
        current.pcie_replay_count.value(),
        previous.and_then(|p| p.pcie_replay_count.value()),
    ) && cur.saturating_sub(*prev) >= PCIE_REPLAY_WARN
    {
        find("PCIE", HealthResult::Warn, "DCGM_FR_PCI_REPLAY_RATE");
    }
    // NVLink: Xid 74, or error counters growing.
    if xid(74) {
        find(
            "NVLINK",
            HealthResult::Fail,
            "DCGM_FR_NVLINK_ERROR_CRITICAL",
        );
    }
    if let (Some(cur), Some(prev)) = (
        current.nvlink_errors.value(),
        previous.and_then(|p| p.nvlink_errors.value()),
    ) {
        let grew = cur.crc_flit > prev.crc_flit
            || cur.crc_data > prev.crc_data
            || cur.replay > prev.replay
            || cur.recovery > prev.recovery;
        if grew {
            find(
                "NVLINK",
                HealthResult::Warn,
                "DCGM_FR_NVLINK_ERROR_THRESHOLD",
            );
        }
    }
    // Micro-controllers: Xid 61 (breakpoint/warning) and 62 (halt).
    if xid(62) {
        find("MCU", HealthResult::Fail, "DCGM_FR_XID_ERROR");
    } else if xid(61) {
        find("MCU", HealthResult::Warn, "DCGM_FR_XID_ERROR");
    }
    // Memory: double-bit errors, uncontained errors, failed or pending
    // remapping, pending page retirement.
    if current
        .ecc_errors
        .value()
        .is_some_and(|e| e.dbe_volatile > 0)
        || xid(48)
    {
        find("MEM", HealthResult::Fail, "DCGM_FR_VOLATILE_DBE_DETECTED");
    }
    if xid(95) {
        find("MEM", HealthResult::Fail, "DCGM_FR_UNCONTAINED_ERROR");
    }
    if let Some(r) = current.remapped_rows.value() {
        if r.failed {
            find("MEM", HealthResult::Fail, "DCGM_FR_ROW_REMAP_FAILURE");
        } else if r.pending {
            find("MEM", HealthResult::Warn, "DCGM_FR_PENDING_ROW_REMAP");
        }
    }
    if current.retired_pages.value().is_some_and(|r| r.pending) {
        find(
            "MEM",
            HealthResult::Warn,
            "DCGM_FR_PENDING_PAGE_RETIREMENTS",
        );
    }
    // Thermal: thermal slowdown now, or thermal throttling time growing.
    let reasons = current.clocks_event_reasons.value().copied().unwrap_or(0);
    let thermal_bits = clock_events::SW_THERMAL | clock_events::HW_THERMAL;
    let thermal_grew = match (
        current.violations.value().and_then(|v| v.thermal_ns),
        previous
            .and_then(|p| p.violations.value())
            .and_then(|v| v.thermal_ns),
    ) {
        (Some(cur), Some(prev)) => cur > prev,
        _ => false,
    };
    if reasons & thermal_bits != 0 || thermal_grew {
        find(
            "THERMAL",
            HealthResult::Warn,
            "DCGM_FR_CLOCK_THROTTLE_THERMAL",
        );
    }
    // Power: unreadable, or the hardware power brake engaged.
    if matches!(current.power_usage_mw, crate::backend::Reading::Error(_)) {
        find("POWER", HealthResult::Warn, "DCGM_FR_POWER_UNREADABLE");
    }
    if reasons & clock_events::HW_POWER_BRAKE != 0 {
        find("POWER", HealthResult::Warn, "DCGM_FR_CLOCK_THROTTLE_POWER");
    }
    // Driver and firmware: GSP timeouts and errors.
    if xid(119) || xid(120) {
        find("DRIVER", HealthResult::Fail, "DCGM_FR_XID_ERROR");
    }
    out
}

/// Series of `DCGM_EXP_GPU_HEALTH_STATUS`.
pub fn health_series(watches: &[WatchStatus]) -> Vec<LabeledValue> {
    watches
        .iter()
        .map(|w| LabeledValue {
            labels: vec![
                ("health_watch", w.watch.to_string()),
                ("health_error_code", w.error_code.to_string()),
            ],
            value: Value::Int(w.result.code()),
        })
        .collect()
}

/// Series of `DCGM_EXP_P2P_STATUS`: one per peer GPU.
pub fn p2p_series(peers: &[(u32, P2pStatus)]) -> Vec<LabeledValue> {
    peers
        .iter()
        .map(|(peer, status)| LabeledValue {
            labels: vec![
                ("peer_gpu", peer.to_string()),
                ("link_status", status.label().to_string()),
            ],
            value: Value::Int(i64::from(status.code())),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{
        EccErrors, FbMemory, NvlinkErrors, Reading, RemappedRows, RetiredPages, Violations,
    };
    use proptest::prelude::*;

    fn pristine() -> GpuTelemetry {
        GpuTelemetry {
            gpu: 0,
            sm_clock_mhz: Reading::Value(1980),
            mem_clock_mhz: Reading::Value(2619),
            gpu_temp_c: Reading::Value(40),
            memory_temp_c: Reading::Value(44),
            power_usage_mw: Reading::Value(300_000),
            total_energy_mj: Reading::Value(1),
            pcie_replay_count: Reading::Value(0),
            gpu_util_pct: Reading::Value(50),
            mem_copy_util_pct: Reading::Value(20),
            enc_util_pct: Reading::Value(0),
            dec_util_pct: Reading::Value(0),
            fb_memory: Reading::Value(FbMemory {
                total: 4,
                used: 1,
                free: 2,
                reserved: 1,
            }),
            nvlink_total_kib: Reading::Value(0),
            remapped_rows: Reading::Value(RemappedRows {
                correctable: 0,
                uncorrectable: 0,
                pending: false,
                failed: false,
            }),
            pcie_tx_kib_per_s: Reading::Value(1),
            pcie_rx_kib_per_s: Reading::Value(1),
            profiling: Reading::NotSupported,
            last_xid: Reading::Value(0),
            violations: Reading::Value(Violations::default()),
            ecc_errors: Reading::Value(EccErrors::default()),
            retired_pages: Reading::NotSupported,
            nvlink_errors: Reading::Value(NvlinkErrors::default()),
            nvlink_link_kib: Reading::NotSupported,
            clocks_event_reasons: Reading::Value(0),
        }
    }

    fn status(h: &[WatchStatus], watch: &str) -> (HealthResult, &'static str) {
        let w = h.iter().find(|w| w.watch == watch).unwrap();
        (w.result, w.error_code)
    }

    #[test]
    fn xid_counts_and_totals_start_with_a_zero_series() {
        let mut x = XidCounts::new(1000);
        let count = xid_count_series(&x.windowed(0), 1000);
        assert_eq!(count.len(), 1);
        assert_eq!(
            count[0].labels,
            vec![("window_size_in_ms", "1000".to_string())]
        );
        assert_eq!(count[0].value, Value::Int(0));
        assert_eq!(xid_total_series(x.totals())[0].labels, vec![]);
        x.record(10, 79);
        x.record(20, 79);
        let count = xid_count_series(&x.windowed(30), 1000);
        assert_eq!(
            count[0].labels,
            vec![
                ("xid", "79".to_string()),
                ("window_size_in_ms", "1000".to_string())
            ]
        );
        assert_eq!(count[0].value, Value::Int(2));
        // The window empties; the total stays.
        assert_eq!(
            xid_count_series(&x.windowed(5000), 1000)[0].value,
            Value::Int(0)
        );
        assert_eq!(xid_total_series(x.totals())[0].value, Value::Int(2));
        assert_eq!(x.last(), Some(79));
    }

    #[test]
    fn clock_events_count_samples_in_the_window_and_edges_in_the_total() {
        let mut c = ClockEventCounts::new(10_000);
        let thermal = clock_events::SW_THERMAL;
        for t in 0..5 {
            c.observe(t * 1000, thermal);
        }
        c.observe(5000, 0);
        c.observe(6000, thermal | 0x8000_0000);
        let count = c.count_series(6000, 10_000);
        assert_eq!(count.len(), 1, "unknown bits are ignored");
        assert_eq!(
            count[0].labels[0],
            ("clock_event", "sw_thermal".to_string())
        );
        assert_eq!(count[0].value, Value::Int(6));
        assert_eq!(c.total_series()[0].value, Value::Int(2));
    }

    #[test]
    fn a_pristine_gpu_passes_every_watch() {
        let h = gpu_health(&pristine(), Some(&pristine()), &BTreeMap::new());
        assert_eq!(h.len(), HEALTH_WATCHES.len());
        assert!(
            h.iter()
                .all(|w| w.result == HealthResult::Pass && w.error_code == "DCGM_FR_OK")
        );
        let series = health_series(&h);
        assert_eq!(
            series[0].labels,
            vec![
                ("health_watch", "PCIE".to_string()),
                ("health_error_code", "DCGM_FR_OK".to_string())
            ]
        );
    }

    #[test]
    fn findings_land_on_their_watch_and_the_worst_wins() {
        let mut t = pristine();
        t.ecc_errors = Reading::Value(EccErrors {
            dbe_volatile: 1,
            ..EccErrors::default()
        });
        t.remapped_rows = Reading::Value(RemappedRows {
            correctable: 0,
            uncorrectable: 0,
            pending: true,
            failed: false,
        });
        t.clocks_event_reasons = Reading::Value(clock_events::HW_THERMAL);
        t.retired_pages = Reading::Value(RetiredPages {
            pending: true,
            ..RetiredPages::default()
        });
        let xids = BTreeMap::from([(79, 1), (74, 2)]);
        let h = gpu_health(&t, Some(&pristine()), &xids);
        assert_eq!(
            status(&h, "MEM"),
            (HealthResult::Fail, "DCGM_FR_VOLATILE_DBE_DETECTED")
        );
        assert_eq!(
            status(&h, "THERMAL"),
            (HealthResult::Warn, "DCGM_FR_CLOCK_THROTTLE_THERMAL")
        );
        assert_eq!(
            status(&h, "PCIE"),
            (HealthResult::Fail, "DCGM_FR_XID_ERROR")
        );
        assert_eq!(
            status(&h, "NVLINK"),
            (HealthResult::Fail, "DCGM_FR_NVLINK_ERROR_CRITICAL")
        );
        assert_eq!(status(&h, "SM"), (HealthResult::Pass, "DCGM_FR_OK"));
        assert_eq!(health_series(&h)[4].value, Value::Int(20));
    }

    #[test]
    fn p2p_series_name_the_peer_and_status() {
        let s = p2p_series(&[(1, P2pStatus::Ok), (2, P2pStatus::NotSupported)]);
        assert_eq!(s[1].labels[0], ("peer_gpu", "2".to_string()));
        assert_eq!(s[1].labels[1], ("link_status", "NotSupported".to_string()));
        assert_eq!(s[1].value, Value::Int(5));
    }

    proptest! {
        #[test]
        fn health_is_one_verdict_per_watch_with_dcgm_values(
            dbe in 0u64..3, pending in any::<bool>(), failed in any::<bool>(),
            reasons in any::<u64>(), replays in 0u64..20,
            xids in proptest::collection::btree_map(0u32..130, 1u64..4, 0..6),
        ) {
            let mut t = pristine();
            t.ecc_errors = Reading::Value(EccErrors { dbe_volatile: dbe, ..EccErrors::default() });
            t.remapped_rows = Reading::Value(RemappedRows { correctable: 0, uncorrectable: 0, pending, failed });
            t.clocks_event_reasons = Reading::Value(reasons);
            t.pcie_replay_count = Reading::Value(replays);
            let h = gpu_health(&t, Some(&pristine()), &xids);
            prop_assert_eq!(h.iter().map(|w| w.watch).collect::<Vec<_>>(), HEALTH_WATCHES.to_vec());
            for w in &h {
                prop_assert_eq!(w.result == HealthResult::Pass, w.error_code == "DCGM_FR_OK");
                prop_assert!([0, 10, 20].contains(&w.result.code()));
            }
            let mem = h.iter().find(|w| w.watch == "MEM").unwrap();
            prop_assert_eq!(mem.result == HealthResult::Fail, dbe > 0 || failed || xids.contains_key(&48) || xids.contains_key(&95));
        }

        #[test]
        fn clock_event_totals_never_exceed_window_counts_within_one_window(
            masks in proptest::collection::vec(any::<u16>(), 1..60),
        ) {
            let mut c = ClockEventCounts::new(u64::MAX / 2);
            for (i, m) in masks.iter().enumerate() {
                c.observe(i as u64 * 1000, u64::from(*m));
            }
            let now = masks.len() as u64 * 1000;
            let counts: BTreeMap<String, i64> = c.count_series(now, 1).into_iter()
                .filter_map(|s| s.labels.first().map(|l| (l.1.clone(), match s.value { Value::Int(v) => v, Value::Double(v) => v as i64 })))
                .collect();
            for s in c.total_series() {
                if let Some((_, name)) = s.labels.first() {
                    let total = match s.value { Value::Int(v) => v, Value::Double(v) => v as i64 };
                    prop_assert!(total <= counts[name]);
                }
            }
        }
    }
}
