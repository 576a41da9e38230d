//! From backend readings to entity samples: unit conversions (mW to W, bytes to
//! MiB, KiB/s to B/s), dcgm-exporter's MIG flex mode (a MIG-enabled GPU shows
//! up only as its GPU instances, with GPU-level fields repeated on each), and
//! the list of read errors for the exporter's own error counters.

use crate::backend::{
    DeviceStrings, FbMemory, GpuInfo, GpuInstance, GpuTelemetry, MigTelemetry, Profiling, Reading,
};

use super::catalog::Field;
use super::counters::CounterSet;
use super::format::Value;
use super::render::{EntityIdentity, EntitySample, MigIdentity};

const MIB: u64 = 1024 * 1024;

/// A telemetry field that failed to read (not "not supported", which is normal).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadError {
    /// GPU index.
    pub gpu: u32,
    /// The reading that failed, e.g. `gpu_temp` (the `call` label of the error counter).
    pub call: &'static str,
    /// What the backend said.
    pub message: String,
}

/// The previous NVLink total of a GPU, for turning the monotonic KiB counter
/// into the MiB/s figure dcgm-exporter reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NvlinkMark {
    /// KiB moved since driver load.
    pub total_kib: u64,
    /// When it was read, in milliseconds of a monotonic clock.
    pub at_ms: u64,
}

/// NVLink bandwidth in MiB/s between two marks; `None` when time did not
/// advance or the counter went backwards (driver reload).
pub fn nvlink_rate_mib_s(prev: NvlinkMark, cur: NvlinkMark) -> Option<i64> {
    let dt = cur.at_ms.checked_sub(prev.at_ms).filter(|d| *d > 0)?;
    let dk = cur.total_kib.checked_sub(prev.total_kib)?;
    let rate = (dk as f64 / 1024.0) / (dt as f64 / 1000.0);
    Some(rate.round() as i64)
}

/// The identity of a whole GPU.
pub fn gpu_identity(info: &GpuInfo) -> EntityIdentity {
    EntityIdentity {
        gpu: info.index,
        uuid: info.uuid.clone(),
        pci_bus_id: info.pci_bus_id.clone(),
        device: format!("nvidia{}", info.index),
        model_name: info.name.clone(),
        mig: None,
    }
}

struct Sink<'a> {
    gpu: u32,
    errors: &'a mut Vec<ReadError>,
}

impl Sink<'_> {
    fn take<T: Clone>(&mut self, call: &'static str, r: &Reading<T>) -> Option<T> {
        match r {
            Reading::Value(v) => Some(v.clone()),
            Reading::NotSupported => None,
            Reading::Error(message) => {
                self.errors.push(ReadError {
                    gpu: self.gpu,
                    call,
                    message: message.clone(),
                });
                None
            }
        }
    }
}

fn set_fb(sample: &mut EntitySample, fb: Option<FbMemory>) {
    if let Some(fb) = fb {
        let mib = |b: u64| Value::Int(i64::try_from(b / MIB).unwrap_or(i64::MAX));
        sample.set(Field::FbFree, mib(fb.free));
        sample.set(Field::FbUsed, mib(fb.used));
        sample.set(Field::FbReserved, mib(fb.reserved));
        sample.set(Field::FbTotal, mib(fb.total));
    }
}

fn int(v: impl Into<i64>) -> Value {
    Value::Int(v.into())
}

fn int_u64(v: u64) -> Value {
    Value::Int(i64::try_from(v).unwrap_or(i64::MAX))
}

/// Sets the profiling ratios an entity has (GPM gives them per GPU and per GPU
/// instance).
fn set_profiling(sample: &mut EntitySample, p: &Profiling) {
    let ratios = [
        (Field::ProfGrEngineActive, p.gr_engine_active),
        (Field::ProfSmActive, p.sm_active),
        (Field::ProfSmOccupancy, p.sm_occupancy),
        (Field::ProfPipeTensorActive, p.tensor_active),
        (Field::ProfDramActive, p.dram_active),
        (Field::ProfPipeFp64Active, p.fp64_active),
        (Field::ProfPipeFp32Active, p.fp32_active),
        (Field::ProfPipeFp16Active, p.fp16_active),
    ];
    for (field, v) in ratios {
        if let Some(v) = v {
            sample.set(field, Value::Double(v.clamp(0.0, 1.0)));
        }
    }
    let rates = [
        (Field::ProfNvlinkTxBytes, p.nvlink_tx_bytes_per_s),
        (Field::ProfNvlinkRxBytes, p.nvlink_rx_bytes_per_s),
    ];
    for (field, v) in rates {
        if let Some(v) = v.filter(|v| v.is_finite() && *v >= 0.0) {
            sample.set(field, Value::Int(v.round().min(i64::MAX as f64) as i64));
        }
    }
}

/// The label fields a [`DeviceStrings`] supplies, each with its value.
pub fn device_string_fields(d: &DeviceStrings) -> [(Field, Option<&str>); 7] {
    [
        (Field::DevBrand, d.brand.as_deref()),
        (Field::DevSerial, d.serial.as_deref()),
        (Field::VbiosVersion, d.vbios_version.as_deref()),
        (Field::OemInforomVer, d.oem_inforom_version.as_deref()),
        (Field::EccInforomVer, d.ecc_inforom_version.as_deref()),
        (Field::PowerInforomVer, d.power_inforom_version.as_deref()),
        (Field::InforomImageVer, d.inforom_image_version.as_deref()),
    ]
}

/// Whether the counter set prints any label field that comes from
/// [`DeviceStrings`] (so they are worth reading from the GPU).
pub fn wants_device_strings(set: &CounterSet) -> bool {
    let none = DeviceStrings::default();
    let fields = device_string_fields(&none);
    set.labels
        .iter()
        .any(|l| fields.iter().any(|(f, _)| *f == l.field))
}

/// Sets the text fields (printed as labels when the counter set asks).
fn set_strings(sample: &mut EntitySample, d: &DeviceStrings) {
    for (field, v) in device_string_fields(d) {
        if let Some(v) = v {
            sample.text.insert(field, v.to_string());
        }
    }
}

/// The error, throttling and NVLink fields beyond dcgm-exporter's defaults.
fn set_health_fields(sample: &mut EntitySample, t: &GpuTelemetry, sink: &mut Sink<'_>) {
    if let Some(v) = sink.take("violation_status", &t.violations) {
        let causes = [
            (Field::PowerViolation, v.power_ns),
            (Field::ThermalViolation, v.thermal_ns),
            (Field::SyncBoostViolation, v.sync_boost_ns),
            (Field::BoardLimitViolation, v.board_limit_ns),
            (Field::LowUtilViolation, v.low_util_ns),
            (Field::ReliabilityViolation, v.reliability_ns),
        ];
        for (field, ns) in causes {
            if let Some(ns) = ns {
                sample.set(field, int_u64(ns));
            }
        }
    }
    if let Some(v) = sink.take("clocks_event_reasons", &t.clocks_event_reasons) {
        sample.set(Field::ClocksEventReasons, int_u64(v));
    }
    if let Some(e) = sink.take("total_ecc_errors", &t.ecc_errors) {
        sample.set(Field::EccSbeVolTotal, int_u64(e.sbe_volatile));
        sample.set(Field::EccDbeVolTotal, int_u64(e.dbe_volatile));
        sample.set(Field::EccSbeAggTotal, int_u64(e.sbe_aggregate));
        sample.set(Field::EccDbeAggTotal, int_u64(e.dbe_aggregate));
    }
    if let Some(r) = sink.take("retired_pages", &t.retired_pages) {
        sample.set(Field::RetiredSbe, int_u64(r.single_bit));
        sample.set(Field::RetiredDbe, int_u64(r.double_bit));
        sample.set(Field::RetiredPending, int(i64::from(r.pending)));
    }
    if let Some(n) = sink.take("nvlink_error_counter", &t.nvlink_errors) {
        sample.set(Field::NvlinkCrcFlitErrorCountTotal, int_u64(n.crc_flit));
        sample.set(Field::NvlinkCrcDataErrorCountTotal, int_u64(n.crc_data));
        sample.set(Field::NvlinkReplayErrorCountTotal, int_u64(n.replay));
        sample.set(Field::NvlinkRecoveryErrorCountTotal, int_u64(n.recovery));
    }
}

/// Fills the GPU-level fields of `sample` (everything but utilizations, FB and
/// profiling ratios, which the caller sets per entity kind).
fn set_device_fields(sample: &mut EntitySample, round: &GpuRound<'_>, sink: &mut Sink<'_>) {
    let t = round.telemetry;
    set_health_fields(sample, t, sink);
    for (field, rate) in Field::NVLINK_LINKS
        .iter()
        .zip(round.nvlink_link_rates_mib_s)
    {
        sample.set(*field, Value::Int(*rate));
    }
    if let Some(d) = round.strings {
        set_strings(sample, d);
    }
    let nvlink_rate = round.nvlink_rate_mib_s;
    if let Some(v) = sink.take("sm_clock", &t.sm_clock_mhz) {
        sample.set(Field::SmClock, int(v));
    }
    if let Some(v) = sink.take("mem_clock", &t.mem_clock_mhz) {
        sample.set(Field::MemClock, int(v));
    }
    if let Some(v) = sink.take("gpu_temp", &t.gpu_temp_c) {
        sample.set(Field::GpuTemp, int(v));
    }
    if let Some(v) = sink.take("memory_temp", &t.memory_temp_c) {
        sample.set(Field::MemoryTemp, int(v));
    }
    if let Some(v) = sink.take("power_usage", &t.power_usage_mw) {
        sample.set(Field::PowerUsage, Value::Double(f64::from(v) / 1000.0));
    }
    if let Some(v) = sink.take("total_energy_consumption", &t.total_energy_mj) {
        sample.set(Field::TotalEnergyConsumption, int_u64(v));
    }
    if let Some(v) = sink.take("pcie_replay_counter", &t.pcie_replay_count) {
        sample.set(Field::PcieReplayCounter, int_u64(v));
    }
    if let Some(v) = nvlink_rate {
        sample.set(Field::NvlinkBandwidthTotal, Value::Int(v));
    }
    if let Some(rows) = sink.take("remapped_rows", &t.remapped_rows) {
        sample.set(Field::CorrectableRemappedRows, int(rows.correctable));
        sample.set(Field::UncorrectableRemappedRows, int(rows.uncorrectable));
        sample.set(Field::RowRemapFailure, int(i64::from(rows.failed)));
    }
    if let Some(v) = sink.take("pcie_tx_throughput", &t.pcie_tx_kib_per_s) {
        sample.set(Field::PcieTxThroughput, int(v));
        sample.set(Field::ProfPcieTxBytes, int(i64::from(v) * 1024));
    }
    if let Some(v) = sink.take("pcie_rx_throughput", &t.pcie_rx_kib_per_s) {
        sample.set(Field::PcieRxThroughput, int(v));
        sample.set(Field::ProfPcieRxBytes, int(i64::from(v) * 1024));
    }
    if let Some(v) = sink.take("last_xid", &t.last_xid) {
        sample.set(Field::XidErrors, int_u64(v));
    }
}

/// Everything sampled for one GPU in one collection round.
#[derive(Debug, Clone, Copy)]
pub struct GpuRound<'a> {
    /// Identity and MIG mode.
    pub info: &'a GpuInfo,
    /// The whole-GPU sample.
    pub telemetry: &'a GpuTelemetry,
    /// With MIG on: the GPU instances and their samples.
    pub mig: Option<(&'a [GpuInstance], &'a [MigTelemetry])>,
    /// NVLink MiB/s computed from the previous round, if any.
    pub nvlink_rate_mib_s: Option<i64>,
    /// The same per link (empty before the second round).
    pub nvlink_link_rates_mib_s: &'a [i64],
    /// Brand, serial, VBIOS and inforom versions, read once at start.
    pub strings: Option<&'a DeviceStrings>,
}

/// Entity samples of one GPU: one for the whole GPU, or, with MIG on and at
/// least one GPU instance, one per GPU instance (dcgm-exporter's flex mode).
/// Read errors are appended to `errors`.
pub fn gpu_samples(round: GpuRound<'_>, errors: &mut Vec<ReadError>) -> Vec<EntitySample> {
    let t = round.telemetry;
    let mut sink = Sink {
        gpu: round.info.index,
        errors,
    };
    let instances = match round.mig {
        Some((gis, tel)) if !gis.is_empty() => Some((gis, tel)),
        _ => None,
    };
    let Some((gis, tel)) = instances else {
        let mut s = EntitySample::new(gpu_identity(round.info));
        set_device_fields(&mut s, &round, &mut sink);
        if let Some(v) = sink.take("gpu_util", &t.gpu_util_pct) {
            s.set(Field::GpuUtil, int(v));
        }
        if let Some(v) = sink.take("mem_copy_util", &t.mem_copy_util_pct) {
            s.set(Field::MemCopyUtil, int(v));
        }
        if let Some(v) = sink.take("enc_util", &t.enc_util_pct) {
            s.set(Field::EncUtil, int(v));
        }
        if let Some(v) = sink.take("dec_util", &t.dec_util_pct) {
            s.set(Field::DecUtil, int(v));
        }
        let fb = sink.take("memory_info", &t.fb_memory);
        set_fb(&mut s, fb);
        if let Some(p) = sink.take("gpm_metrics", &t.profiling) {
            set_profiling(&mut s, &p);
        }
        return vec![s];
    };
    // Device-level fields are read once and repeated on every GPU instance.
    let mut device = EntitySample::new(gpu_identity(round.info));
    set_device_fields(&mut device, &round, &mut sink);
    let mut out = Vec::with_capacity(gis.len());
    for gi in gis {
        let mut s = device.clone();
        let mut uuids = gi.compute_instances.iter().map(|ci| ci.uuid.clone());
        let uuid = uuids.next().unwrap_or_default();
        s.identity.mig = Some(MigIdentity {
            profile: gi.profile_name.clone(),
            gi_id: gi.id,
            uuid,
            other_uuids: uuids.collect(),
        });
        if let Some(m) = tel.iter().find(|m| m.gpu_instance_id == gi.id) {
            let fb = sink.take("mig_memory_info", &m.fb_memory);
            set_fb(&mut s, fb);
            if let Some(p) = sink.take("mig_gpm_metrics", &m.profiling) {
                set_profiling(&mut s, &p);
            }
        }
        out.push(s);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{ComputeInstance, MigMode, RemappedRows, SlicePlacement};

    fn info(mig: bool) -> GpuInfo {
        GpuInfo {
            index: 2,
            uuid: "GPU-2".into(),
            name: "NVIDIA A100-SXM4-40GB".into(),
            pci_bus_id: "00000000:47:00.0".into(),
            pci_device_id: 0x20b0,
            minor_number: 2,
            memory_total_bytes: 40 * 1024 * MIB,
            numa_node: Some(0),
            architecture: "ampere".into(),
            compute_capability: (8, 0),
            mig_capable: true,
            mig_mode: Some(MigMode {
                current: mig,
                pending: mig,
            }),
        }
    }

    fn telemetry() -> GpuTelemetry {
        GpuTelemetry {
            gpu: 2,
            sm_clock_mhz: Reading::Value(1410),
            mem_clock_mhz: Reading::Value(1215),
            gpu_temp_c: Reading::Value(33),
            memory_temp_c: Reading::Value(31),
            power_usage_mw: Reading::Value(61072),
            total_energy_mj: Reading::Value(9_000_000),
            pcie_replay_count: Reading::Value(0),
            gpu_util_pct: Reading::Value(40),
            mem_copy_util_pct: Reading::Value(5),
            enc_util_pct: Reading::Value(0),
            dec_util_pct: Reading::Value(0),
            fb_memory: Reading::Value(FbMemory {
                total: 40960 * MIB,
                used: 1000 * MIB,
                free: 39000 * MIB,
                reserved: 960 * MIB,
            }),
            nvlink_total_kib: Reading::Value(0),
            remapped_rows: Reading::Value(RemappedRows {
                correctable: 0,
                uncorrectable: 1,
                pending: false,
                failed: false,
            }),
            pcie_tx_kib_per_s: Reading::Value(2),
            pcie_rx_kib_per_s: Reading::Value(3),
            profiling: Reading::Error("timeout".into()),
            last_xid: Reading::Value(0),
            violations: Reading::NotSupported,
            ecc_errors: Reading::NotSupported,
            retired_pages: Reading::NotSupported,
            nvlink_errors: Reading::NotSupported,
            nvlink_link_kib: Reading::NotSupported,
            clocks_event_reasons: Reading::NotSupported,
        }
    }

    fn gi(id: u32, cis: &[&str]) -> GpuInstance {
        GpuInstance {
            id,
            profile_id: 19,
            profile_name: "1g.5gb".into(),
            placement: SlicePlacement { start: id, size: 1 },
            compute_instances: cis
                .iter()
                .enumerate()
                .map(|(i, u)| ComputeInstance {
                    id: i as u32,
                    profile_id: 0,
                    slice_count: 1,
                    placement: SlicePlacement { start: 0, size: 1 },
                    uuid: u.to_string(),
                })
                .collect(),
        }
    }

    #[test]
    fn whole_gpu_units_are_converted_and_errors_collected() {
        let (i, t) = (info(false), telemetry());
        let mut errors = Vec::new();
        let round = GpuRound {
            info: &i,
            telemetry: &t,
            mig: None,
            nvlink_rate_mib_s: None,
            nvlink_link_rates_mib_s: &[],
            strings: None,
        };
        let s = gpu_samples(round, &mut errors);
        assert_eq!(s.len(), 1);
        let s = &s[0];
        assert_eq!(s.get(Field::PowerUsage), Some(Value::Double(61.072)));
        assert_eq!(s.get(Field::FbUsed), Some(Value::Int(1000)));
        assert_eq!(s.get(Field::FbReserved), Some(Value::Int(960)));
        assert_eq!(s.get(Field::ProfPcieRxBytes), Some(Value::Int(3072)));
        assert_eq!(s.get(Field::UncorrectableRemappedRows), Some(Value::Int(1)));
        assert_eq!(s.get(Field::ProfGrEngineActive), None);
        assert_eq!(s.get(Field::NvlinkBandwidthTotal), None);
        assert_eq!(s.identity.device, "nvidia2");
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].call, "gpm_metrics");
    }

    #[test]
    fn mig_gpus_become_their_instances_with_device_fields_repeated() {
        let (i, t) = (info(true), telemetry());
        let gis = vec![gi(1, &["MIG-a"]), gi(2, &["MIG-b", "MIG-c"])];
        let tel = vec![MigTelemetry {
            gpu: 2,
            gpu_instance_id: 2,
            fb_memory: Reading::Value(FbMemory {
                total: 4864 * MIB,
                used: 13 * MIB,
                free: 4851 * MIB,
                reserved: 0,
            }),
            profiling: Reading::Value(Profiling {
                gr_engine_active: Some(0.25),
                ..Profiling::default()
            }),
        }];
        let mut errors = Vec::new();
        let round = GpuRound {
            info: &i,
            telemetry: &t,
            mig: Some((&gis, &tel)),
            nvlink_rate_mib_s: Some(7),
            nvlink_link_rates_mib_s: &[3, 4],
            strings: None,
        };
        let s = gpu_samples(round, &mut errors);
        assert_eq!(s.len(), 2);
        for e in &s {
            assert_eq!(e.get(Field::GpuTemp), Some(Value::Int(33)));
            assert_eq!(e.get(Field::NvlinkBandwidthTotal), Some(Value::Int(7)));
            assert_eq!(
                e.get(Field::GpuUtil),
                None,
                "not supported on GPU instances"
            );
            assert_eq!(e.identity.uuid, "GPU-2");
        }
        assert_eq!(s[0].get(Field::FbUsed), None);
        assert_eq!(s[1].get(Field::FbUsed), Some(Value::Int(13)));
        assert_eq!(
            s[1].get(Field::ProfGrEngineActive),
            Some(Value::Double(0.25))
        );
        let m = s[1].identity.mig.as_ref().unwrap();
        assert_eq!((m.gi_id, m.uuid.as_str()), (2, "MIG-b"));
        assert_eq!(m.other_uuids, vec!["MIG-c".to_string()]);
        // MIG on but no instance yet: the whole GPU is shown.
        let round = GpuRound {
            mig: Some((&[], &[])),
            ..round
        };
        assert_eq!(gpu_samples(round, &mut errors).len(), 1);
    }

    #[test]
    fn device_strings_are_read_only_when_a_label_field_asks() {
        use crate::metrics::counters::parse_counters;
        let serial =
            parse_counters("DCGM_FI_DEV_GPU_TEMP, gauge, t\nDCGM_FI_DEV_SERIAL, label, s\n")
                .unwrap()
                .set;
        assert!(wants_device_strings(&serial));
        assert!(!wants_device_strings(&CounterSet::default_set()));
        let d = DeviceStrings {
            serial: Some("1650".into()),
            ..DeviceStrings::default()
        };
        let set: Vec<_> = device_string_fields(&d)
            .into_iter()
            .filter_map(|(f, v)| v.map(|v| (f, v)))
            .collect();
        assert_eq!(set, vec![(Field::DevSerial, "1650")]);
    }

    #[test]
    fn nvlink_rate_needs_time_and_a_growing_counter() {
        let a = NvlinkMark {
            total_kib: 0,
            at_ms: 1000,
        };
        let b = NvlinkMark {
            total_kib: 2048 * 10,
            at_ms: 3000,
        };
        assert_eq!(nvlink_rate_mib_s(a, b), Some(10));
        assert_eq!(nvlink_rate_mib_s(b, a), None);
        assert_eq!(nvlink_rate_mib_s(a, a), None);
    }
}
