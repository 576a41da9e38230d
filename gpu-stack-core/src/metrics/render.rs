//! Rendering: a telemetry snapshot (one sample per GPU, or per GPU instance on
//! MIG GPUs), the selected counter set and the pod attributions become the
//! exposition text, with dcgm-exporter's label order:
//!
//! `gpu, UUID, pci_bus_id, device, modelName[, GPU_I_PROFILE, GPU_I_ID], Hostname,
//! <label fields>[, container, err_code, err_msg, namespace, pod]`
//!
//! Families come in counter-file order (dcgm-exporter's order is random); a
//! family with no value on any entity is left out entirely, as dcgm-exporter
//! does for fields the GPU does not support.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::attribution::{Attribution, Attributions};
use super::catalog::{Field, MetricKind};
use super::counters::CounterSet;
use super::format::{Value, write_help, write_label_value, write_value};
pub use super::identity::{EntityIdentity, MigIdentity};
use super::xid::xid_message;

/// One series of a labeled family ([`Field::is_labeled_family`]): its own
/// labels (printed after the label fields, sorted by name, as dcgm-exporter's
/// template does) and its value.
#[derive(Debug, Clone, PartialEq)]
pub struct LabeledValue {
    /// Label names and values, e.g. `("xid", "79")`.
    pub labels: Vec<(&'static str, String)>,
    /// The value.
    pub value: Value,
}

/// One entity's sampled values. Fields without a value (not supported, not
/// permitted, or failed) are simply absent and their series are omitted.
#[derive(Debug, Clone, PartialEq)]
pub struct EntitySample {
    /// Whose values these are.
    pub identity: EntityIdentity,
    values: Vec<Option<Value>>,
    /// Series of the labeled families (Xid and clock event counts, health,
    /// P2P status), per family.
    pub labeled: BTreeMap<Field, Vec<LabeledValue>>,
    /// Values of text fields, printed as labels when the counter set names
    /// them (`DCGM_FI_DEV_SERIAL`, ...).
    pub text: BTreeMap<Field, String>,
}

impl EntitySample {
    /// A sample with no values yet.
    pub fn new(identity: EntityIdentity) -> Self {
        Self {
            identity,
            values: vec![None; Field::COUNT],
            labeled: BTreeMap::new(),
            text: BTreeMap::new(),
        }
    }

    /// Sets a field's value (NaN and infinite doubles count as absent).
    pub fn set(&mut self, field: Field, value: Value) {
        let keep = !matches!(value, Value::Double(v) if !v.is_finite());
        if let Some(slot) = self.values.get_mut(field.index()) {
            *slot = keep.then_some(value);
        }
    }

    /// A field's value, if it has one.
    pub fn get(&self, field: Field) -> Option<Value> {
        self.values.get(field.index()).copied().flatten()
    }
}

/// Which exposition format to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Prometheus text format 0.0.4, what dcgm-exporter serves.
    Prometheus,
    /// OpenMetrics 1.0 text. dcgm counters keep their names (dashboards query
    /// them) and are typed `unknown`, because OpenMetrics counters must end in
    /// `_total`.
    OpenMetrics,
}

impl Format {
    /// The HTTP `Content-Type` of the format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Prometheus => "text/plain; version=0.0.4; charset=utf-8",
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }

    /// Picks the format from an HTTP `Accept` header: OpenMetrics when the
    /// client asks for `application/openmetrics-text` with at least the weight
    /// it gives `text/plain` (Prometheus servers do), else the Prometheus text
    /// format, which is also the answer to no header or `*/*`.
    pub fn negotiate(accept: Option<&str>) -> Format {
        let Some(accept) = accept else {
            return Format::Prometheus;
        };
        let mut om: Option<f32> = None;
        let mut text: Option<f32> = None;
        for part in accept.split(',') {
            let mut params = part.split(';').map(str::trim);
            let media = params.next().unwrap_or("").to_ascii_lowercase();
            let q = params
                .filter_map(|p| p.strip_prefix("q="))
                .find_map(|q| q.parse::<f32>().ok())
                .unwrap_or(1.0);
            let slot = match media.as_str() {
                "application/openmetrics-text" => &mut om,
                "text/plain" => &mut text,
                _ => continue,
            };
            *slot = Some(slot.map_or(q, |old: f32| old.max(q)));
        }
        match (om, text) {
            (Some(o), t) if o > 0.0 && o >= t.unwrap_or(0.0) => Format::OpenMetrics,
            _ => Format::Prometheus,
        }
    }
}

/// Node-level settings of the rendering.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderOptions {
    /// Value of the hostname label; `None` omits the label (dcgm's `-n`).
    pub hostname: Option<String>,
    /// Spelling of the hostname label: `Hostname` (released dcgm-exporter) or
    /// `hostname` (its newest main branch).
    pub hostname_label: String,
    /// Driver version for the `DCGM_FI_DRIVER_VERSION` label field.
    pub driver_version: Option<String>,
    /// NVML version for the `DCGM_FI_NVML_VERSION` label field.
    pub nvml_version: Option<String>,
    /// `window_size_in_ms` label of `DCGM_EXP_XID_ERRORS_COUNT`.
    pub xid_window_ms: u64,
    /// Window of `DCGM_EXP_CLOCK_EVENTS_COUNT` in milliseconds.
    pub clock_events_window_ms: u64,
}

impl Default for RenderOptions {
    fn default() -> Self {
        Self {
            hostname: None,
            hostname_label: "Hostname".to_string(),
            driver_version: None,
            nvml_version: None,
            xid_window_ms: 300_000,
            clock_events_window_ms: 300_000,
        }
    }
}

fn push_label(out: &mut String, name: &str, value: &str) {
    if !out.is_empty() {
        out.push(',');
    }
    out.push_str(name);
    out.push_str("=\"");
    write_label_value(out, value);
    out.push('"');
}

fn entity_prefix(sample: &EntitySample, set: &CounterSet, opts: &RenderOptions) -> String {
    let e = &sample.identity;
    let mut s = String::with_capacity(192);
    push_label(&mut s, "gpu", &e.gpu.to_string());
    push_label(&mut s, "UUID", &e.uuid);
    push_label(&mut s, "pci_bus_id", &e.pci_bus_id);
    push_label(&mut s, "device", &e.device);
    push_label(&mut s, "modelName", &e.model_name);
    if let Some(m) = &e.mig {
        push_label(&mut s, "GPU_I_PROFILE", &m.profile);
        push_label(&mut s, "GPU_I_ID", &m.gi_id.to_string());
    }
    if let Some(h) = &opts.hostname {
        push_label(&mut s, &opts.hostname_label, h);
    }
    // dcgm-exporter's template prints its label map in sorted key order.
    let mut labels: Vec<(&str, &str)> = set
        .labels
        .iter()
        .filter_map(|l| {
            let value = match l.field {
                Field::DriverVersion => opts.driver_version.as_deref(),
                Field::NvmlVersion => opts.nvml_version.as_deref(),
                f => sample.text.get(&f).map(String::as_str),
            };
            value.map(|v| (l.field.name(), v))
        })
        .collect();
    labels.sort_unstable();
    for (name, value) in labels {
        push_label(&mut s, name, value);
    }
    s
}

/// One series: the entity's prefix, the family's own labels (sorted; they
/// belong to dcgm-exporter's label map), then the attributes (`err_code`,
/// `err_msg` and the pod labels) in sorted key order, as dcgm-exporter's
/// template prints its attribute map.
fn write_series(
    out: &mut String,
    name: &str,
    prefix: &str,
    labels: &[(&str, &str)],
    extra: &[(&str, &str)],
    pod: Option<&Attribution>,
    value: Value,
) {
    let mut own: Vec<(&str, &str)> = labels.to_vec();
    own.sort_unstable_by(|a, b| a.0.cmp(b.0));
    let mut attrs: Vec<(&str, &str)> = extra.to_vec();
    if let Some(p) = pod {
        attrs.push(("container", &p.container));
        attrs.push(("namespace", &p.namespace));
        attrs.push(("pod", &p.pod));
    }
    attrs.sort_unstable_by(|a, b| a.0.cmp(b.0));
    out.push_str(name);
    out.push('{');
    out.push_str(prefix);
    for (k, v) in own.into_iter().chain(attrs) {
        out.push(',');
        out.push_str(k);
        out.push_str("=\"");
        write_label_value(out, v);
        out.push('"');
    }
    out.push_str("} ");
    let start = out.len();
    if write_value(out, value) {
        out.push('\n');
    } else {
        // Not reachable for values stored through `EntitySample::set`; keep the
        // output well formed anyway by dropping the half-written line.
        let line_start = out[..start].rfind('\n').map_or(0, |p| p + 1);
        out.truncate(line_start);
    }
}

/// Writes every selected family for `samples` into `out` (no `# EOF`).
pub fn render_into(
    out: &mut String,
    set: &CounterSet,
    samples: &[EntitySample],
    attributions: &Attributions,
    opts: &RenderOptions,
    format: Format,
) {
    let prefixes: Vec<String> = samples
        .iter()
        .map(|s| entity_prefix(s, set, opts))
        .collect();
    let openmetrics = format == Format::OpenMetrics;
    for spec in &set.metrics {
        let field = spec.field;
        let present = if field.is_labeled_family() {
            samples
                .iter()
                .any(|s| s.labeled.get(&field).is_some_and(|v| !v.is_empty()))
        } else {
            samples.iter().any(|s| s.get(field).is_some())
        };
        if !present {
            continue;
        }
        let type_name = match (spec.kind, openmetrics) {
            (MetricKind::Counter, true) => "unknown",
            (kind, _) => kind.as_str(),
        };
        let _ = write!(out, "# HELP {} ", field.name());
        write_help(out, &spec.help, openmetrics);
        let _ = writeln!(out, "\n# TYPE {} {}", field.name(), type_name);
        for (sample, prefix) in samples.iter().zip(&prefixes) {
            let pods = attributions.for_entity(&sample.identity);
            let pods: Vec<Option<&Attribution>> = if pods.is_empty() {
                vec![None]
            } else {
                pods.iter().map(Some).collect()
            };
            if field.is_labeled_family() {
                for series in sample.labeled.get(&field).into_iter().flatten() {
                    let labels: Vec<(&str, &str)> = series
                        .labels
                        .iter()
                        .map(|(k, v)| (*k, v.as_str()))
                        .collect();
                    for pod in &pods {
                        write_series(out, field.name(), prefix, &labels, &[], *pod, series.value);
                    }
                }
                continue;
            }
            let Some(value) = sample.get(field) else {
                continue;
            };
            if field == Field::XidErrors {
                let code = match value {
                    Value::Int(v) => v,
                    Value::Double(v) => v as i64,
                };
                let code_text = code.to_string();
                let msg = u32::try_from(code).map_or("Unknown Error", xid_message);
                let extra = [("err_code", code_text.as_str()), ("err_msg", msg)];
                for pod in &pods {
                    write_series(out, field.name(), prefix, &[], &extra, *pod, value);
                }
                continue;
            }
            for pod in &pods {
                write_series(out, field.name(), prefix, &[], &[], *pod, value);
            }
        }
    }
}

/// Renders every selected family for `samples` as a new string (no `# EOF`).
pub fn render(
    set: &CounterSet,
    samples: &[EntitySample],
    attributions: &Attributions,
    opts: &RenderOptions,
    format: Format,
) -> String {
    let mut out = String::with_capacity(256 * samples.len() * set.metrics.len().max(1));
    render_into(&mut out, set, samples, attributions, opts, format);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::attribution::{ContainerDevices, ResourceMatcher, attribute};
    use crate::metrics::counters::parse_counters;
    use proptest::prelude::*;

    fn a100(i: u32) -> EntityIdentity {
        EntityIdentity {
            gpu: i,
            uuid: format!("GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd"),
            pci_bus_id: format!("00000000:{:02X}:00.0", 0x07 + i),
            device: format!("nvidia{i}"),
            model_name: "NVIDIA A100-SXM4-40GB".into(),
            mig: None,
        }
    }

    fn opts() -> RenderOptions {
        RenderOptions {
            hostname: Some("node-1".into()),
            driver_version: Some("550.54.15".into()),
            ..RenderOptions::default()
        }
    }

    #[test]
    fn labels_come_in_dcgm_order_with_values_formatted_like_dcgm() {
        let set = CounterSet::default_set();
        let mut s = EntitySample::new(a100(0));
        s.set(Field::GpuTemp, Value::Int(34));
        s.set(Field::PowerUsage, Value::Double(61.072));
        let text = render(
            &set,
            &[s],
            &Attributions::default(),
            &opts(),
            Format::Prometheus,
        );
        let expected = "# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).\n\
# TYPE DCGM_FI_DEV_GPU_TEMP gauge\n\
DCGM_FI_DEV_GPU_TEMP{gpu=\"0\",UUID=\"GPU-00000000-aaaa-bbbb-cccc-dddddddddddd\",pci_bus_id=\"00000000:07:00.0\",device=\"nvidia0\",modelName=\"NVIDIA A100-SXM4-40GB\",Hostname=\"node-1\",DCGM_FI_DRIVER_VERSION=\"550.54.15\"} 34\n\
# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).\n\
# TYPE DCGM_FI_DEV_POWER_USAGE gauge\n\
DCGM_FI_DEV_POWER_USAGE{gpu=\"0\",UUID=\"GPU-00000000-aaaa-bbbb-cccc-dddddddddddd\",pci_bus_id=\"00000000:07:00.0\",device=\"nvidia0\",modelName=\"NVIDIA A100-SXM4-40GB\",Hostname=\"node-1\",DCGM_FI_DRIVER_VERSION=\"550.54.15\"} 61.072000\n";
        assert_eq!(text, expected);
    }

    #[test]
    fn mig_xid_and_pod_labels_are_ordered_like_dcgm() {
        let set = CounterSet::default_set();
        let mut id = a100(1);
        id.mig = Some(MigIdentity {
            profile: "3g.20gb".into(),
            gi_id: 2,
            uuid: "MIG-x".into(),
            other_uuids: Vec::new(),
        });
        let mut s = EntitySample::new(id.clone());
        s.set(Field::XidErrors, Value::Int(79));
        s.labeled.insert(
            Field::XidErrorsCount,
            vec![LabeledValue {
                labels: vec![("xid", "79".into()), ("window_size_in_ms", "300000".into())],
                value: Value::Int(2),
            }],
        );
        let pods = attribute(
            &[ContainerDevices {
                pod: "train-0".into(),
                namespace: "ml".into(),
                container: "cuda".into(),
                resource_name: "nvidia.com/mig-3g.20gb".into(),
                device_ids: vec!["MIG-x".into()],
            }],
            &ResourceMatcher::default(),
            &[id],
        );
        let mut o = opts();
        o.hostname_label = "hostname".into();
        let text = render(&set, &[s], &pods, &o, Format::Prometheus);
        assert!(text.contains("DCGM_FI_DEV_XID_ERRORS{gpu=\"1\",UUID=\"GPU-00000001-aaaa-bbbb-cccc-dddddddddddd\",pci_bus_id=\"00000000:08:00.0\",device=\"nvidia1\",modelName=\"NVIDIA A100-SXM4-40GB\",GPU_I_PROFILE=\"3g.20gb\",GPU_I_ID=\"2\",hostname=\"node-1\",DCGM_FI_DRIVER_VERSION=\"550.54.15\",container=\"cuda\",err_code=\"79\",err_msg=\"GPU has fallen off the bus\",namespace=\"ml\",pod=\"train-0\"} 79\n"), "{text}");
        assert!(text.contains(",DCGM_FI_DRIVER_VERSION=\"550.54.15\",window_size_in_ms=\"300000\",xid=\"79\",container=\"cuda\",namespace=\"ml\",pod=\"train-0\"} 2\n"), "{text}");
    }

    #[test]
    fn counters_are_unknown_in_openmetrics_and_names_are_kept() {
        let set = CounterSet::default_set();
        let mut s = EntitySample::new(a100(0));
        s.set(Field::TotalEnergyConsumption, Value::Int(123));
        let prom = render(
            &set,
            std::slice::from_ref(&s),
            &Attributions::default(),
            &opts(),
            Format::Prometheus,
        );
        let om = render(
            &set,
            &[s],
            &Attributions::default(),
            &opts(),
            Format::OpenMetrics,
        );
        assert!(prom.contains("# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\n"));
        assert!(om.contains("# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION unknown\n"));
        assert!(om.contains("\nDCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{"));
    }

    #[test]
    fn a_custom_set_selects_families_and_unsupported_values_are_omitted() {
        let set = parse_counters(
            "DCGM_FI_DEV_FB_USED, gauge, used\nDCGM_FI_PROF_GR_ENGINE_ACTIVE, gauge, gr\n",
        )
        .unwrap()
        .set;
        let mut a = EntitySample::new(a100(0));
        a.set(Field::FbUsed, Value::Int(5));
        a.set(Field::GpuTemp, Value::Int(40));
        let mut b = EntitySample::new(a100(1));
        b.set(Field::FbUsed, Value::Double(f64::NAN));
        let text = render(
            &set,
            &[a, b],
            &Attributions::default(),
            &RenderOptions::default(),
            Format::Prometheus,
        );
        assert_eq!(text.lines().filter(|l| !l.starts_with('#')).count(), 1);
        assert!(!text.contains("GPU_TEMP"));
        assert!(!text.contains("PROF_GR"));
        assert!(!text.contains("Hostname"));
        assert!(!text.contains("DRIVER_VERSION"));
    }

    #[test]
    fn negotiation_follows_accept_weights() {
        let prom = "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2";
        assert_eq!(Format::negotiate(Some(prom)), Format::OpenMetrics);
        assert_eq!(Format::negotiate(None), Format::Prometheus);
        assert_eq!(Format::negotiate(Some("*/*")), Format::Prometheus);
        assert_eq!(Format::negotiate(Some("text/plain")), Format::Prometheus);
        assert_eq!(
            Format::negotiate(Some("text/plain;q=0.9, application/openmetrics-text;q=0.1")),
            Format::Prometheus
        );
        assert_eq!(
            Format::negotiate(Some("application/openmetrics-text;q=0")),
            Format::Prometheus
        );
    }

    proptest! {
        #[test]
        fn every_series_line_is_well_formed(
            temps in proptest::collection::vec(proptest::option::of(-50i64..150), 1..8),
            power in proptest::collection::vec(proptest::option::of(-1.0e6f64..1.0e6), 8),
            host in "[a-zA-Z0-9\"\\\\ .-]{0,12}",
        ) {
            let set = CounterSet::default_set();
            let samples: Vec<EntitySample> = temps.iter().enumerate().map(|(i, t)| {
                let mut s = EntitySample::new(a100(i as u32));
                if let Some(t) = t { s.set(Field::GpuTemp, Value::Int(*t)); }
                if let Some(p) = power[i] { s.set(Field::PowerUsage, Value::Double(p)); }
                s
            }).collect();
            let o = RenderOptions { hostname: Some(host), ..RenderOptions::default() };
            let text = render(&set, &samples, &Attributions::default(), &o, Format::Prometheus);
            let expected = temps.iter().filter(|t| t.is_some()).count()
                + power.iter().take(temps.len()).filter(|p| p.is_some()).count();
            let series: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
            prop_assert_eq!(series.len(), expected);
            for line in series {
                let (_, value) = line.rsplit_once("} ").unwrap();
                prop_assert!(value.parse::<f64>().is_ok());
                prop_assert!(line.starts_with("DCGM_FI_DEV_"));
            }
        }
    }
}
