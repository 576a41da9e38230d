//! Sampler threads, the Xid listener, the composer and the ready snapshot.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use gpu_stack_core::backend::{
    DeviceStrings, GpuBackend, GpuTelemetry, HealthEventKind, P2pStatus,
};
use gpu_stack_core::metrics::exp::{
    ClockEventCounts, XidCounts, gpu_health, health_series, merge_counts, p2p_series,
    xid_count_series, xid_total_series,
};
use gpu_stack_core::metrics::{
    ContainerDevices, EntitySample, Field, Format, GpuRound, NvlinkMark, ReadError, Value,
    attribute, gpu_samples, nvlink_rate_mib_s, render, wants_device_strings,
};

use super::selfmetrics::SelfMetrics;
use super::{ExporterConfig, ExporterError};
use crate::clock::unix_seconds_f64;
use crate::kubelet::podresources::PodResourcesCache;

/// A rendered snapshot, ready to serve.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Prometheus text format 0.0.4.
    pub prometheus: Bytes,
    /// OpenMetrics text (without the exporter's own metrics and `# EOF`).
    pub openmetrics: Bytes,
    /// Number of GPU series.
    pub series: usize,
    /// Number of GPUs whose latest sample is in the snapshot.
    pub gpus: usize,
}

struct GpuSlot {
    samples: Vec<EntitySample>,
    /// The GPU stopped answering (fallen off the bus, hung): `samples` hold
    /// only the identities of its last good round, for its Xid series.
    lost: bool,
    /// When its sampler wrote it.
    at: Instant,
}

/// The most GPUs one exporter samples (a bound on what a backend's device
/// count may make it allocate; the largest systems have 16).
pub const MAX_GPUS: u32 = 256;

/// Intervals without a rendering after which the exporter counts as wedged.
pub const WEDGED_AFTER_ROUNDS: u32 = 10;
/// The shortest time without a rendering that counts as wedged.
pub const WEDGED_AFTER_AT_LEAST: Duration = Duration::from_secs(60);

/// How long the composer may go without rendering at `interval`.
fn wedged_after(interval: Duration) -> Duration {
    interval
        .saturating_mul(WEDGED_AFTER_ROUNDS)
        .max(WEDGED_AFTER_AT_LEAST)
}

/// Rounds a GPU's samples outlive their interval before they count as
/// stale: a sampler stuck in a call that never returns (a hung GPU) would
/// otherwise leave its last values on show as if they were current.
pub const STALE_AFTER_ROUNDS: u32 = 3;

/// Whether samples written at `at` are stale at `now` for `interval`.
fn is_stale(at: Instant, now: Instant, interval: Duration) -> bool {
    now.saturating_duration_since(at) > interval.saturating_mul(STALE_AFTER_ROUNDS)
}

struct PodView {
    entries: Arc<Vec<ContainerDevices>>,
}

pub(super) struct Shared {
    pub(super) config: ExporterConfig,
    slots: Vec<Mutex<Option<GpuSlot>>>,
    xid: Mutex<BTreeMap<(u32, Option<u32>), XidCounts>>,
    pods: Mutex<PodView>,
    pub(super) snapshot: RwLock<Arc<Snapshot>>,
    pub(super) metrics: SelfMetrics,
    pub(super) ready: AtomicBool,
    /// When the composer last rendered ([`Shared::now_ms`]).
    rendered_at_ms: AtomicU64,
    stop: Mutex<bool>,
    stop_cv: Condvar,
    epoch: Instant,
}

impl Shared {
    fn stopped(&self) -> bool {
        self.stop.lock().map(|s| *s).unwrap_or(true)
    }

    /// Sleeps up to `d`; returns true when asked to stop.
    fn sleep(&self, d: Duration) -> bool {
        let Ok(guard) = self.stop.lock() else {
            return true;
        };
        match self.stop_cv.wait_timeout_while(guard, d, |stop| !*stop) {
            Ok((guard, _)) => *guard,
            Err(_) => true,
        }
    }

    /// How long the composer has not rendered, once that is past
    /// [`WEDGED_AFTER_ROUNDS`] intervals (at least [`WEDGED_AFTER_AT_LEAST`]):
    /// it renders every interval whatever the GPUs do, so it is stuck and
    /// `/health` fails for the kubelet to restart the exporter.
    pub(super) fn wedged_for(&self) -> Option<Duration> {
        if !self.ready.load(Ordering::Acquire) {
            return None;
        }
        let since = self
            .now_ms()
            .saturating_sub(self.rendered_at_ms.load(Ordering::Acquire));
        let since = Duration::from_millis(since);
        (since > wedged_after(self.config.interval)).then_some(since)
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Xids per code in the window on a GPU and all its instances.
    fn recent_xids(&self, gpu: u32, now_ms: u64) -> BTreeMap<u32, u64> {
        let mut out = BTreeMap::new();
        if let Ok(mut map) = self.xid.lock() {
            for (_, counts) in map.range_mut((gpu, None)..=(gpu, Some(u32::MAX))) {
                merge_counts(&mut out, &counts.windowed(now_ms));
            }
        }
        out
    }
}

/// A running exporter. Dropping it stops the background work (a GPU thread
/// stuck in a driver call is left to finish on its own).
pub struct Exporter {
    pub(super) shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    pods: Option<PodResourcesCache>,
    pod_task: Option<tokio::task::JoinHandle<()>>,
}

impl Exporter {
    pub(super) fn start(
        backend: Arc<dyn GpuBackend>,
        mut config: ExporterConfig,
    ) -> Result<Self, ExporterError> {
        // Only the system and the GPU count are read here: each GPU is read
        // by its own sampler thread, so a GPU that hangs (a call that never
        // returns) holds up only its own series, even at start.
        let inventory_error = |reason| ExporterError::Inventory {
            backend: backend.name().to_string(),
            reason,
        };
        let system = backend.system_info().map_err(inventory_error)?;
        let count = backend.device_count().map_err(inventory_error)?;
        if count > MAX_GPUS {
            tracing::warn!(
                count,
                max = MAX_GPUS,
                "more GPUs than the exporter samples; the rest are left out"
            );
        }
        if config.render.driver_version.is_none() {
            config.render.driver_version = Some(system.driver_version.clone());
        }
        if config.render.nvml_version.is_none() {
            config.render.nvml_version = Some(system.nvml_version);
        }
        let metrics = SelfMetrics::new();
        let indexes: Vec<u32> = (0..count.min(MAX_GPUS)).collect();
        let max_index = indexes.iter().copied().max().map_or(0, |m| m as usize + 1);
        let shared = Arc::new(Shared {
            slots: (0..max_index).map(|_| Mutex::new(None)).collect(),
            xid: Mutex::new(BTreeMap::new()),
            pods: Mutex::new(PodView {
                entries: Arc::new(Vec::new()),
            }),
            snapshot: RwLock::new(Arc::new(Snapshot::default())),
            metrics,
            ready: AtomicBool::new(false),
            rendered_at_ms: AtomicU64::new(0),
            stop: Mutex::new(false),
            stop_cv: Condvar::new(),
            epoch: Instant::now(),
            config,
        });
        let (tx, rx) = mpsc::channel::<()>();
        let mut threads = Vec::new();
        let peers = u32::try_from(max_index).unwrap_or(u32::MAX);
        for gpu in indexes {
            let (b, s, t) = (backend.clone(), shared.clone(), tx.clone());
            let h = std::thread::Builder::new()
                .name(format!("gpu-sampler-{gpu}"))
                .spawn(move || sampler_loop(b, s, gpu, peers, t));
            match h {
                Ok(h) => threads.push(h),
                Err(e) => tracing::error!(gpu, error = %e, "cannot start the sampler thread"),
            }
        }
        {
            let (b, s, t) = (backend.clone(), shared.clone(), tx.clone());
            if let Ok(h) = std::thread::Builder::new()
                .name("xid-events".into())
                .spawn(move || xid_loop(b, s, t))
            {
                threads.push(h);
            }
        }
        let mut pods = None;
        let mut pod_task = None;
        if let Some(pc) = shared.config.pod_resources.clone() {
            let cache = PodResourcesCache::start(pc.socket.clone(), pc.refresh, pc.timeout);
            let mut rx_pods = cache.subscribe();
            let (s, t) = (shared.clone(), tx.clone());
            pod_task = Some(tokio::spawn(async move {
                let mut seen_errors = 0u64;
                loop {
                    {
                        let state = rx_pods.borrow_and_update().clone();
                        s.metrics.pod_resources_up.set(i64::from(state.up));
                        if state.errors > seen_errors {
                            s.metrics
                                .pod_resources_errors
                                .inc_by(state.errors - seen_errors);
                            seen_errors = state.errors;
                        }
                        if let Ok(mut p) = s.pods.lock() {
                            p.entries = state.entries.clone();
                        }
                        let _ = t.send(());
                    }
                    if rx_pods.changed().await.is_err() {
                        break;
                    }
                }
            }));
            pods = Some(cache);
        }
        {
            let s = shared.clone();
            if let Ok(h) = std::thread::Builder::new()
                .name("composer".into())
                .spawn(move || composer_loop(s, rx))
            {
                threads.push(h);
            }
        }
        drop(tx);
        Ok(Self {
            shared,
            threads,
            pods,
            pod_task,
        })
    }

    /// The snapshot a scrape would serve now.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.shared
            .snapshot
            .read()
            .map(|s| s.clone())
            .unwrap_or_default()
    }

    /// Whether a first snapshot has been rendered.
    pub fn is_ready(&self) -> bool {
        self.shared.ready.load(Ordering::Acquire)
    }

    /// The exporter's own health metrics.
    pub fn self_metrics(&self) -> &SelfMetrics {
        &self.shared.metrics
    }

    /// Stops the background work and waits for threads that are not stuck.
    pub fn shutdown(mut self) {
        self.stop_all();
    }

    fn stop_all(&mut self) {
        if let Ok(mut s) = self.shared.stop.lock() {
            *s = true;
        }
        self.shared.stop_cv.notify_all();
        if let Some(t) = self.pod_task.take() {
            t.abort();
        }
        self.pods = None;
        for h in self.threads.drain(..) {
            if h.is_finished() {
                let _ = h.join();
            }
        }
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// What one GPU's sampler keeps between rounds.
struct GpuSampler {
    gpu: u32,
    peers: u32,
    nvlink: Option<NvlinkMark>,
    links: Vec<Option<NvlinkMark>>,
    clock_events: ClockEventCounts,
    previous: Option<GpuTelemetry>,
    strings: Option<DeviceStrings>,
    p2p: Option<Vec<(u32, P2pStatus)>>,
    /// Entities of the last good round, kept for a GPU that stops answering.
    last_entities: Vec<EntitySample>,
}

impl GpuSampler {
    fn new(gpu: u32, peers: u32, clock_window_ms: u64) -> Self {
        Self {
            gpu,
            peers,
            nvlink: None,
            links: Vec::new(),
            clock_events: ClockEventCounts::new(clock_window_ms),
            previous: None,
            strings: None,
            p2p: None,
            last_entities: Vec::new(),
        }
    }

    /// NVLink MiB/s since the previous round, in total and per link.
    fn nvlink_rates(&mut self, t: &GpuTelemetry, now_ms: u64) -> (Option<i64>, Vec<i64>) {
        let rate = |prev: &mut Option<NvlinkMark>, total_kib: u64| {
            let cur = NvlinkMark {
                total_kib,
                at_ms: now_ms,
            };
            let r = prev.and_then(|p| nvlink_rate_mib_s(p, cur));
            *prev = Some(cur);
            r
        };
        let total = t
            .nvlink_total_kib
            .value()
            .and_then(|&kib| rate(&mut self.nvlink, kib));
        let mut per_link = Vec::new();
        if let Some(links) = t.nvlink_link_kib.value() {
            self.links.resize(links.len(), None);
            for (mark, &kib) in self.links.iter_mut().zip(links) {
                per_link.push(rate(mark, kib));
            }
        }
        // A link without a rate yet leaves the whole list out, so the link
        // series appear together from the second round on.
        let per_link = per_link.into_iter().collect::<Option<Vec<i64>>>();
        (total, per_link.unwrap_or_default())
    }

    fn sample(
        &mut self,
        backend: &dyn GpuBackend,
        shared: &Shared,
        errors: &mut Vec<ReadError>,
    ) -> Result<Vec<EntitySample>, &'static str> {
        let gpu = self.gpu;
        let now_ms = shared.now_ms();
        let set = &shared.config.counters;
        let info = backend.gpu_info(gpu).map_err(|_| "gpu_info")?;
        let telemetry = backend.gpu_telemetry(gpu).map_err(|_| "gpu_telemetry")?;
        let mig_on = info.mig_mode.map(|m| m.current).unwrap_or(false);
        let (gis, tel) = if mig_on {
            let gis = backend.gpu_instances(gpu).map_err(|_| "gpu_instances")?;
            let tel = match backend.mig_telemetry(gpu) {
                Ok(t) => t,
                Err(e) => {
                    errors.push(ReadError {
                        gpu,
                        call: "mig_telemetry",
                        message: e.to_string(),
                    });
                    Vec::new()
                }
            };
            (gis, tel)
        } else {
            (Vec::new(), Vec::new())
        };
        if self.strings.is_none() && wants_device_strings(set) {
            match backend.device_strings(gpu) {
                Ok(d) => self.strings = Some(d),
                Err(e) => errors.push(ReadError {
                    gpu,
                    call: "device_strings",
                    message: e.to_string(),
                }),
            }
        }
        if self.p2p.is_none() && set.has_metric(Field::P2pStatus) {
            // Static for the life of the driver: asked once.
            let peers = (0..self.peers)
                .filter(|p| *p != gpu)
                .filter_map(|p| backend.p2p_status(gpu, p).ok().map(|s| (p, s)))
                .collect();
            self.p2p = Some(peers);
        }
        let (rate, link_rates) = self.nvlink_rates(&telemetry, now_ms);
        let round = GpuRound {
            info: &info,
            telemetry: &telemetry,
            mig: mig_on.then_some((gis.as_slice(), tel.as_slice())),
            nvlink_rate_mib_s: rate,
            nvlink_link_rates_mib_s: &link_rates,
            strings: self.strings.as_ref(),
        };
        let mut samples = gpu_samples(round, errors);
        // The families computed here are the GPU's; in MIG mode they repeat on
        // each instance, as dcgm-exporter repeats device fields.
        if let Some(&mask) = telemetry.clocks_event_reasons.value() {
            self.clock_events.observe(now_ms, mask);
        }
        let window = shared.config.render.clock_events_window_ms;
        let clock_count = self.clock_events.count_series(now_ms, window);
        let clock_total = self.clock_events.total_series();
        let recent = shared.recent_xids(gpu, now_ms);
        let health = health_series(&gpu_health(&telemetry, self.previous.as_ref(), &recent));
        let p2p = self.p2p.as_deref().map(p2p_series);
        for s in &mut samples {
            s.labeled
                .insert(Field::ClockEventsCount, clock_count.clone());
            s.labeled
                .insert(Field::ClockEventsTotal, clock_total.clone());
            s.labeled.insert(Field::GpuHealthStatus, health.clone());
            if let Some(p2p) = &p2p {
                s.labeled.insert(Field::P2pStatus, p2p.clone());
            }
        }
        self.previous = Some(telemetry);
        self.last_entities = samples
            .iter()
            .map(|s| EntitySample::new(s.identity.clone()))
            .collect();
        Ok(samples)
    }
}

fn sampler_loop(
    backend: Arc<dyn GpuBackend>,
    shared: Arc<Shared>,
    gpu: u32,
    peers: u32,
    tx: mpsc::Sender<()>,
) {
    let mut sampler = GpuSampler::new(gpu, peers, shared.config.render.clock_events_window_ms);
    let interval = shared.config.interval;
    loop {
        let started = Instant::now();
        let mut errors = Vec::new();
        let result = sampler.sample(&*backend, &shared, &mut errors);
        for e in &errors {
            tracing::debug!(gpu, call = e.call, error = %e.message, "reading failed");
            shared.metrics.nvml_error(e.call);
        }
        let slot = match result {
            Ok(samples) => Some(GpuSlot {
                samples,
                lost: false,
                at: Instant::now(),
            }),
            Err(call) => {
                tracing::warn!(
                    gpu,
                    call,
                    "GPU could not be sampled; only its Xid series are kept"
                );
                shared.metrics.nvml_error(call);
                (!sampler.last_entities.is_empty()).then(|| GpuSlot {
                    samples: sampler.last_entities.clone(),
                    lost: true,
                    at: Instant::now(),
                })
            }
        };
        if let Some(s) = shared.slots.get(gpu as usize)
            && let Ok(mut s) = s.lock()
        {
            *s = slot;
        }
        shared
            .metrics
            .collected(gpu, started.elapsed().as_secs_f64(), unix_seconds_f64());
        if tx.send(()).is_err() {
            return;
        }
        let spent = started.elapsed();
        if shared.sleep(interval.saturating_sub(spent)) {
            return;
        }
    }
}

fn xid_loop(backend: Arc<dyn GpuBackend>, shared: Arc<Shared>, tx: mpsc::Sender<()>) {
    let mut events = match backend.health_events() {
        Ok(e) => e,
        Err(e) => {
            tracing::warn!(error = %e, "no Xid events from this backend; Xid counts stay empty");
            shared.metrics.nvml_error("health_events");
            return;
        }
    };
    let window = shared.config.render.xid_window_ms;
    while !shared.stopped() {
        match events.wait(Duration::from_millis(250)) {
            Ok(Some(ev)) => {
                if let HealthEventKind::Xid { xid } = ev.kind {
                    let code = u32::try_from(xid).unwrap_or(u32::MAX);
                    if let Ok(mut map) = shared.xid.lock() {
                        map.entry((ev.gpu, ev.gpu_instance_id))
                            .or_insert_with(|| XidCounts::new(window))
                            .record(shared.now_ms(), code);
                    }
                    if tx.send(()).is_err() {
                        return;
                    }
                }
            }
            Ok(None) => {}
            Err(e) => {
                shared.metrics.nvml_error("health_events");
                tracing::warn!(error = %e, "waiting for Xid events failed");
                if shared.sleep(Duration::from_secs(1)) {
                    return;
                }
            }
        }
    }
}

fn composer_loop(shared: Arc<Shared>, rx: mpsc::Receiver<()>) {
    // Also once an interval without news (after the first): a GPU whose
    // sampler hangs sends none, and its series must still go stale.
    let mut heard = false;
    loop {
        match rx.recv_timeout(shared.config.interval) {
            Ok(()) => heard = true,
            Err(mpsc::RecvTimeoutError::Timeout) if heard => {}
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
        // Coalesce a burst (every GPU finishing its round) into one rendering.
        while rx.try_recv().is_ok() {}
        if shared.stopped() {
            return;
        }
        let started = Instant::now();
        let snapshot = compose(&shared);
        let series = snapshot.series;
        if let Ok(mut s) = shared.snapshot.write() {
            *s = Arc::new(snapshot);
        }
        shared
            .rendered_at_ms
            .store(shared.now_ms(), Ordering::Release);
        shared.ready.store(true, Ordering::Release);
        shared
            .metrics
            .render_duration
            .set(started.elapsed().as_secs_f64());
        shared
            .metrics
            .series
            .set(i64::try_from(series).unwrap_or(i64::MAX));
    }
}

fn compose(shared: &Shared) -> Snapshot {
    let mut samples: Vec<EntitySample> = Vec::new();
    let mut gpus = 0;
    let now_instant = Instant::now();
    for slot in &shared.slots {
        if let Ok(slot) = slot.lock()
            && let Some(s) = slot.as_ref()
        {
            if !s.lost && is_stale(s.at, now_instant, shared.config.interval) {
                // Stale: only the identities stay, for the Xid series, as
                // for a GPU that stopped answering.
                samples.extend(
                    s.samples
                        .iter()
                        .map(|e| EntitySample::new(e.identity.clone())),
                );
                continue;
            }
            gpus += usize::from(!s.lost);
            samples.extend(s.samples.iter().cloned());
        }
    }
    let now = shared.now_ms();
    let xid_window = shared.config.render.xid_window_ms;
    if let Ok(mut map) = shared.xid.lock() {
        let mut windowed: BTreeMap<(u32, Option<u32>), BTreeMap<u32, u64>> = BTreeMap::new();
        for (key, counts) in map.iter_mut() {
            windowed.insert(*key, counts.windowed(now));
        }
        for s in &mut samples {
            let gpu = s.identity.gpu;
            let gi = s.identity.mig.as_ref().map(|m| m.gi_id);
            // An instance sees its own Xids and the GPU's; the GPU sees its own.
            let keys = [Some((gpu, None)), gi.map(|g| (gpu, Some(g)))];
            let mut counts = BTreeMap::new();
            let mut totals = BTreeMap::new();
            let mut last = None;
            for key in keys.into_iter().flatten() {
                if let Some(c) = windowed.get(&key) {
                    merge_counts(&mut counts, c);
                }
                if let Some(x) = map.get(&key) {
                    merge_counts(&mut totals, x.totals());
                    last = x.last().or(last);
                }
            }
            s.labeled
                .insert(Field::XidErrorsCount, xid_count_series(&counts, xid_window));
            s.labeled
                .insert(Field::XidErrorsTotal, xid_total_series(&totals));
            if s.get(Field::XidErrors).is_none()
                && let Some(code) = last
            {
                // A GPU that stopped answering still reports its last Xid (79
                // when it fell off the bus).
                s.set(Field::XidErrors, Value::Int(i64::from(code)));
            }
        }
    }
    let entries = shared
        .pods
        .lock()
        .map(|p| p.entries.clone())
        .unwrap_or_default();
    let attributions = match &shared.config.pod_resources {
        Some(pc) => {
            let ids: Vec<_> = samples.iter().map(|s| s.identity.clone()).collect();
            attribute(&entries, &pc.matcher, &ids)
        }
        None => Default::default(),
    };
    let cfg = &shared.config;
    let prom = render(
        &cfg.counters,
        &samples,
        &attributions,
        &cfg.render,
        Format::Prometheus,
    );
    let om = if cfg.openmetrics {
        render(
            &cfg.counters,
            &samples,
            &attributions,
            &cfg.render,
            Format::OpenMetrics,
        )
    } else {
        String::new()
    };
    let series = prom.lines().filter(|l| !l.starts_with('#')).count();
    Snapshot {
        prometheus: Bytes::from(prom),
        openmetrics: Bytes::from(om),
        series,
        gpus,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exporter_is_wedged_after_ten_silent_intervals_and_never_sooner_than_a_minute() {
        assert_eq!(
            wedged_after(Duration::from_secs(30)),
            Duration::from_secs(300)
        );
        assert_eq!(
            wedged_after(Duration::from_secs(1)),
            Duration::from_secs(60)
        );
        assert_eq!(wedged_after(Duration::MAX), Duration::MAX);
    }

    #[test]
    fn samples_go_stale_after_three_intervals() {
        let at = Instant::now();
        let interval = Duration::from_secs(30);
        assert!(!is_stale(at, at, interval));
        assert!(!is_stale(at, at + Duration::from_secs(90), interval));
        assert!(is_stale(at, at + Duration::from_secs(91), interval));
        // A clock read before the write is not stale.
        assert!(!is_stale(at + Duration::from_secs(5), at, interval));
    }
}
