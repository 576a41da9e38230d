//! Sampler threads, the Xid listener, the composer and the ready snapshot.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use gpu_stack_core::backend::{GpuBackend, HealthEventKind};
use gpu_stack_core::metrics::{
    ContainerDevices, EntitySample, Format, GpuRound, NvlinkMark, ReadError, XidWindow, attribute,
    gpu_samples, nvlink_rate_mib_s, render,
};

use super::selfmetrics::SelfMetrics;
use super::{ExporterConfig, ExporterError};
use crate::podresources::PodResourcesCache;

/// Most Xid events kept per window (older ones are dropped first).
const XID_CAPACITY: usize = 4096;

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
}

struct PodView {
    entries: Arc<Vec<ContainerDevices>>,
}

pub(super) struct Shared {
    pub(super) config: ExporterConfig,
    slots: Vec<Mutex<Option<GpuSlot>>>,
    xid: Mutex<BTreeMap<(u32, Option<u32>), XidWindow>>,
    pods: Mutex<PodView>,
    pub(super) snapshot: RwLock<Arc<Snapshot>>,
    pub(super) metrics: SelfMetrics,
    pub(super) ready: AtomicBool,
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

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
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

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl Exporter {
    pub(super) fn start(
        backend: Arc<dyn GpuBackend>,
        mut config: ExporterConfig,
    ) -> Result<Self, ExporterError> {
        let inventory = backend
            .inventory()
            .map_err(|reason| ExporterError::Inventory {
                backend: backend.name().to_string(),
                reason,
            })?;
        if config.render.driver_version.is_none() {
            config.render.driver_version = Some(inventory.system.driver_version.clone());
        }
        let metrics = SelfMetrics::new();
        for e in &inventory.errors {
            tracing::warn!(gpu = e.index, error = %e.error, "GPU left out of the inventory");
            metrics.nvml_error("gpu_info");
        }
        let indexes: Vec<u32> = inventory.gpus.iter().map(|g| g.index).collect();
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
            stop: Mutex::new(false),
            stop_cv: Condvar::new(),
            epoch: Instant::now(),
            config,
        });
        let (tx, rx) = mpsc::channel::<()>();
        let mut threads = Vec::new();
        for gpu in indexes {
            let (b, s, t) = (backend.clone(), shared.clone(), tx.clone());
            let h = std::thread::Builder::new()
                .name(format!("gpu-sampler-{gpu}"))
                .spawn(move || sampler_loop(b, s, gpu, t));
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

fn sample_gpu(
    backend: &dyn GpuBackend,
    gpu: u32,
    nvlink: &mut Option<NvlinkMark>,
    now_ms: u64,
    errors: &mut Vec<ReadError>,
) -> Result<Vec<EntitySample>, &'static str> {
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
    let rate = match telemetry.nvlink_total_kib.value() {
        Some(&total_kib) => {
            let cur = NvlinkMark {
                total_kib,
                at_ms: now_ms,
            };
            let rate = nvlink.and_then(|prev| nvlink_rate_mib_s(prev, cur));
            *nvlink = Some(cur);
            rate
        }
        None => None,
    };
    let round = GpuRound {
        info: &info,
        telemetry: &telemetry,
        mig: mig_on.then_some((gis.as_slice(), tel.as_slice())),
        nvlink_rate_mib_s: rate,
    };
    Ok(gpu_samples(round, errors))
}

fn sampler_loop(backend: Arc<dyn GpuBackend>, shared: Arc<Shared>, gpu: u32, tx: mpsc::Sender<()>) {
    let mut nvlink = None;
    let interval = shared.config.interval;
    loop {
        let started = Instant::now();
        let mut errors = Vec::new();
        let result = sample_gpu(&*backend, gpu, &mut nvlink, shared.now_ms(), &mut errors);
        for e in &errors {
            tracing::debug!(gpu, call = e.call, error = %e.message, "reading failed");
            shared.metrics.nvml_error(e.call);
        }
        let samples = match result {
            Ok(samples) => Some(GpuSlot { samples }),
            Err(call) => {
                tracing::warn!(
                    gpu,
                    call,
                    "GPU could not be sampled; its series are left out"
                );
                shared.metrics.nvml_error(call);
                None
            }
        };
        if let Some(slot) = shared.slots.get(gpu as usize)
            && let Ok(mut slot) = slot.lock()
        {
            *slot = samples;
        }
        shared
            .metrics
            .collected(gpu, started.elapsed().as_secs_f64(), unix_now());
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
                            .or_insert_with(|| XidWindow::new(window, XID_CAPACITY))
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
    while rx.recv().is_ok() {
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
    for slot in &shared.slots {
        if let Ok(slot) = slot.lock()
            && let Some(s) = slot.as_ref()
        {
            gpus += 1;
            samples.extend(s.samples.iter().cloned());
        }
    }
    let now = shared.now_ms();
    if let Ok(mut map) = shared.xid.lock() {
        let mut counts: BTreeMap<(u32, Option<u32>), BTreeMap<u32, u64>> = BTreeMap::new();
        for (key, w) in map.iter_mut() {
            let c = w.counts(now);
            if !c.is_empty() {
                counts.insert(*key, c);
            }
        }
        for s in &mut samples {
            let gpu = s.identity.gpu;
            let gi = s.identity.mig.as_ref().map(|m| m.gi_id);
            let mut keys = vec![(gpu, None)];
            if gi.is_some() {
                keys.push((gpu, gi));
            }
            for key in keys {
                if let Some(c) = counts.get(&key) {
                    for (code, n) in c {
                        *s.xid_counts.entry(*code).or_insert(0) += n;
                    }
                }
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
    let om = render(
        &cfg.counters,
        &samples,
        &attributions,
        &cfg.render,
        Format::OpenMetrics,
    );
    let series = prom.lines().filter(|l| !l.starts_with('#')).count();
    Snapshot {
        prometheus: Bytes::from(prom),
        openmetrics: Bytes::from(om),
        series,
        gpus,
    }
}
