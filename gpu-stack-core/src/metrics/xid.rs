//! Xid errors: the `err_msg` text for a code, and windowed per-code counts
//! (`DCGM_EXP_XID_ERRORS_COUNT`), which unlike the last-Xid gauge tell two
//! identical Xids in a row apart and fall back to zero once the window passes.

use std::collections::{BTreeMap, VecDeque};

/// Short description of an Xid code for the `err_msg` label. Codes without an
/// entry read "Unknown Error"; `err_code` always carries the number.
pub fn xid_message(code: u32) -> &'static str {
    match code {
        0 => "No Error",
        8 => "GPU stopped responding (timeout)",
        13 => "Graphics Engine Exception",
        31 => "GPU memory page fault",
        32 => "Invalid or corrupted push buffer stream",
        38 => "Driver firmware error",
        43 => "GPU stopped processing",
        45 => "Preemptive cleanup, due to previous errors",
        48 => "Double Bit ECC Error",
        61 => "Internal micro-controller breakpoint/warning",
        62 => "Internal micro-controller halt",
        63 => "ECC page retirement or row remapping recording event",
        64 => "ECC page retirement or row remapper recording failure",
        68 => "Video processor exception",
        69 => "Graphics Engine class error",
        74 => "NVLink Error",
        79 => "GPU has fallen off the bus",
        92 => "High single-bit ECC error rate",
        94 => "Contained ECC error",
        95 => "Uncontained ECC error",
        119 => "GSP RPC timeout",
        120 => "GSP error",
        _ => "Unknown Error",
    }
}

/// Coded events of one GPU (or MIG instance) within a sliding window: Xid
/// codes, or clock event reason bits seen at each collection.
///
/// Bounded: at most `capacity` events are kept; older ones are dropped first, so
/// an Xid storm cannot grow memory without limit.
#[derive(Debug, Clone)]
pub struct EventWindow {
    window_ms: u64,
    capacity: usize,
    events: VecDeque<(u64, u32)>,
    last: Option<u32>,
}

impl EventWindow {
    /// A window of `window_ms` milliseconds keeping at most `capacity` events.
    pub fn new(window_ms: u64, capacity: usize) -> Self {
        Self {
            window_ms,
            capacity: capacity.max(1),
            events: VecDeque::new(),
            last: None,
        }
    }

    /// The window length in milliseconds.
    pub fn window_ms(&self) -> u64 {
        self.window_ms
    }

    /// Records `code` seen at `at_ms` (any monotonic millisecond clock).
    pub fn record(&mut self, at_ms: u64, code: u32) {
        if self.events.len() == self.capacity {
            self.events.pop_front();
        }
        self.events.push_back((at_ms, code));
        self.last = Some(code);
    }

    /// The last code ever recorded (for Xids, what `DCGM_FI_DEV_XID_ERRORS` reports).
    pub fn last(&self) -> Option<u32> {
        self.last
    }

    /// Drops events older than the window and returns the count per code of
    /// those within `(now_ms - window_ms, now_ms]`.
    pub fn counts(&mut self, now_ms: u64) -> BTreeMap<u32, u64> {
        let start = now_ms.saturating_sub(self.window_ms);
        while let Some(&(t, _)) = self.events.front() {
            if t <= start && self.window_ms <= now_ms {
                self.events.pop_front();
            } else {
                break;
            }
        }
        let mut out = BTreeMap::new();
        for &(_, code) in &self.events {
            *out.entry(code).or_insert(0) += 1;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn messages_cover_common_codes() {
        assert_eq!(xid_message(79), "GPU has fallen off the bus");
        assert_eq!(xid_message(0), "No Error");
        assert_eq!(xid_message(9999), "Unknown Error");
    }

    #[test]
    fn counts_fall_off_after_the_window() {
        let mut w = EventWindow::new(1000, 16);
        w.record(10_000, 79);
        w.record(10_500, 79);
        w.record(10_600, 13);
        assert_eq!(w.counts(10_600), BTreeMap::from([(13, 1), (79, 2)]));
        assert_eq!(w.counts(11_200), BTreeMap::from([(13, 1), (79, 1)]));
        assert!(w.counts(20_000).is_empty());
        assert_eq!(w.last(), Some(13));
    }

    proptest! {
        #[test]
        fn counts_equal_a_naive_filter_and_stay_bounded(
            mut times in proptest::collection::vec(0u64..100_000, 0..200),
            codes in proptest::collection::vec(0u32..5, 200),
            window in 1u64..50_000,
            cap in 1usize..64,
        ) {
            times.sort_unstable();
            let mut w = EventWindow::new(window, cap);
            for (i, t) in times.iter().enumerate() { w.record(*t, codes[i]); }
            let now = times.last().copied().unwrap_or(0);
            let kept: Vec<(u64, u32)> = times.iter().enumerate().map(|(i, t)| (*t, codes[i])).collect();
            let kept = &kept[kept.len().saturating_sub(cap)..];
            let mut naive = BTreeMap::new();
            for &(t, c) in kept {
                if t + window > now { *naive.entry(c).or_insert(0u64) += 1; }
            }
            prop_assert_eq!(w.counts(now), naive);
            prop_assert!(w.events.len() <= cap);
        }
    }
}
