//! The exporter's own health metrics (`gpu_exporter_*`), kept in a
//! prometheus-client registry and encoded with its OpenMetrics encoder.

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

type Labels = Vec<(String, String)>;

/// Health metrics of the exporter itself.
#[derive(Debug)]
pub struct SelfMetrics {
    registry: Registry,
    /// Seconds the last collection round of each GPU took.
    pub collection_duration: Family<Labels, Gauge<f64, AtomicU64>>,
    /// Unix time of each GPU's last completed collection round.
    pub last_collection: Family<Labels, Gauge<f64, AtomicU64>>,
    /// Failed backend (NVML) calls, by call.
    pub nvml_errors: Family<Labels, Counter>,
    /// 1 while the kubelet pod-resources API answers, 0 when it does not.
    pub pod_resources_up: Gauge,
    /// Failed pod-resources `List` calls.
    pub pod_resources_errors: Counter,
    /// Seconds the last snapshot rendering took.
    pub render_duration: Gauge<f64, AtomicU64>,
    /// Series in the current snapshot.
    pub series: Gauge,
    /// Server-side time to answer `/metrics`.
    pub scrape_duration: Histogram,
}

fn gpu_label(gpu: u32) -> Labels {
    vec![("gpu".to_string(), gpu.to_string())]
}

impl SelfMetrics {
    /// Registers every metric in a fresh registry.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let collection_duration = Family::<Labels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "gpu_exporter_collection_duration_seconds",
            "Time the last collection round of a GPU took",
            collection_duration.clone(),
        );
        let last_collection = Family::<Labels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "gpu_exporter_last_collection_timestamp_seconds",
            "Unix time the last collection round of a GPU completed",
            last_collection.clone(),
        );
        let nvml_errors = Family::<Labels, Counter>::default();
        registry.register(
            "gpu_exporter_nvml_errors",
            "Failed GPU backend calls by call",
            nvml_errors.clone(),
        );
        let pod_resources_up = Gauge::default();
        registry.register(
            "gpu_exporter_pod_resources_up",
            "Whether the kubelet pod-resources API answered the last List call (1) or not (0)",
            pod_resources_up.clone(),
        );
        let pod_resources_errors = Counter::default();
        registry.register(
            "gpu_exporter_pod_resources_errors",
            "Failed kubelet pod-resources List calls",
            pod_resources_errors.clone(),
        );
        let render_duration = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "gpu_exporter_render_duration_seconds",
            "Time the last rendering of the metrics snapshot took",
            render_duration.clone(),
        );
        let series = Gauge::default();
        registry.register(
            "gpu_exporter_series",
            "GPU series in the current snapshot",
            series.clone(),
        );
        let scrape_duration = Histogram::new(exponential_buckets(0.000_01, 2.0, 16));
        registry.register(
            "gpu_exporter_scrape_duration_seconds",
            "Server-side time to answer a metrics request",
            scrape_duration.clone(),
        );
        Self {
            registry,
            collection_duration,
            last_collection,
            nvml_errors,
            pod_resources_up,
            pod_resources_errors,
            render_duration,
            series,
            scrape_duration,
        }
    }

    /// Records a finished collection round of `gpu`.
    pub fn collected(&self, gpu: u32, seconds: f64, unix_now: f64) {
        self.collection_duration
            .get_or_create(&gpu_label(gpu))
            .set(seconds);
        self.last_collection
            .get_or_create(&gpu_label(gpu))
            .set(unix_now);
    }

    /// Counts a failed backend call.
    pub fn nvml_error(&self, call: &str) {
        self.nvml_errors
            .get_or_create(&vec![("call".to_string(), call.to_string())])
            .inc();
    }

    /// Appends the OpenMetrics text of the registry (no `# EOF`).
    pub fn encode_openmetrics(&self, out: &mut String) {
        let _ = prometheus_client::encoding::text::encode_registry(out, &self.registry);
    }

    /// Appends the registry in Prometheus text format 0.0.4: the OpenMetrics
    /// text with counter families named like their `_total` samples.
    pub fn encode_prometheus(&self, out: &mut String) {
        let mut om = String::new();
        self.encode_openmetrics(&mut om);
        out.push_str(&openmetrics_to_prometheus(&om));
    }
}

impl Default for SelfMetrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Rewrites prometheus-client's OpenMetrics text for the 0.0.4 text format:
/// counter families get the `_total` name their samples carry, `# UNIT` and
/// `# EOF` lines go.
pub fn openmetrics_to_prometheus(om: &str) -> String {
    let counters: Vec<&str> = om
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(om.len() + 16 * counters.len());
    for line in om.lines() {
        if line.starts_with("# EOF") || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (*p, rest)));
        if let Some((p, rest)) = meta {
            let name = rest.split(' ').next().unwrap_or("");
            if counters.contains(&name) {
                out.push_str(p);
                out.push_str(name);
                out.push_str("_total");
                out.push_str(&rest[name.len()..]);
                out.push('\n');
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_get_total_names_in_prometheus_text() {
        let m = SelfMetrics::new();
        m.nvml_error("gpu_temp");
        let mut prom = String::new();
        m.encode_prometheus(&mut prom);
        assert!(
            prom.contains("# TYPE gpu_exporter_nvml_errors_total counter\n"),
            "{prom}"
        );
        assert!(
            prom.contains("gpu_exporter_nvml_errors_total{call=\"gpu_temp\"} 1\n"),
            "{prom}"
        );
        assert!(!prom.contains("# EOF"));
        let mut om = String::new();
        m.encode_openmetrics(&mut om);
        assert!(om.contains("# TYPE gpu_exporter_nvml_errors counter\n"));
    }
}
