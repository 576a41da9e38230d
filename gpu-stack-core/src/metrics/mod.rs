//! DCGM-compatible GPU metrics, as pure data transformations: the metric
//! catalog and default counter set, counters-CSV parsing, value formatting, pod
//! attribution from kubelet pod-resources data, windowed Xid and clock event
//! counts, GPU health per watch, and the
//! rendering of a telemetry snapshot into dcgm-exporter's exposition text.

pub mod attribution;
pub mod catalog;
pub mod counters;
pub mod exp;
pub mod format;
pub mod identity;
pub mod render;
pub mod snapshot;
pub mod xid;

pub use attribution::{
    Attribution, Attributions, ContainerDevices, ResourceMatcher, attribute, base_device_id,
};
pub use catalog::{DEFAULT_COUNTERS_CSV, Field, MetricKind, ValueKind};
pub use counters::{
    CounterSet, CounterSpec, CountersError, ParseReport, SkippedLine, parse_counters,
};
pub use format::Value;
pub use identity::{EntityIdentity, MigIdentity};
pub use render::{EntitySample, Format, LabeledValue, RenderOptions, render, render_into};
pub use snapshot::{
    GpuRound, NvlinkMark, ReadError, device_string_fields, gpu_identity, gpu_samples,
    nvlink_rate_mib_s, wants_device_strings,
};
pub use xid::{EventWindow, xid_message};
