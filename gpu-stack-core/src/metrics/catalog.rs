//! The metric catalog: every DCGM field this exporter knows how to produce, the
//! metric types a counters CSV may name, and the default counter set.
//!
//! Names, types and help texts are those of NVIDIA's dcgm-exporter, so existing
//! dashboards and alerts keep working unchanged.

use std::fmt;

/// A Prometheus metric type as written in the second column of a counters CSV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetricKind {
    /// A value that goes up and down.
    Gauge,
    /// A value that only goes up (dcgm-exporter also uses it for some rates).
    Counter,
    /// Accepted by the CSV format; no DCGM field this exporter knows is one.
    Histogram,
    /// Accepted by the CSV format; no DCGM field this exporter knows is one.
    Summary,
    /// Not a series: the field's value becomes a label on every series.
    Label,
}

impl MetricKind {
    /// Parses the CSV spelling (`gauge`, `counter`, `histogram`, `summary`, `label`).
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "gauge" => Some(Self::Gauge),
            "counter" => Some(Self::Counter),
            "histogram" => Some(Self::Histogram),
            "summary" => Some(Self::Summary),
            "label" => Some(Self::Label),
            _ => None,
        }
    }

    /// The spelling used in CSV files and in `# TYPE` lines.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Gauge => "gauge",
            Self::Counter => "counter",
            Self::Histogram => "histogram",
            Self::Summary => "summary",
            Self::Label => "label",
        }
    }
}

impl fmt::Display for MetricKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How dcgm-exporter prints a field's value: integers with `%d`, doubles with `%f`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueKind {
    /// Printed as a plain integer.
    Int,
    /// Printed with six decimals.
    Double,
    /// A string, only usable as a label (for example the driver version).
    Text,
}

macro_rules! fields {
    ($( $variant:ident => $name:literal, $vk:ident, $doc:literal; )*) => {
        /// A DCGM field this exporter can produce.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Field {
            $( #[doc = $doc] $variant, )*
        }

        impl Field {
            /// Every known field, in catalog order.
            pub const ALL: &'static [Field] = &[ $( Field::$variant, )* ];

            /// The field's DCGM name, which is also the metric name.
            pub fn name(self) -> &'static str {
                match self { $( Field::$variant => $name, )* }
            }

            /// How the field's value is printed.
            pub fn value_kind(self) -> ValueKind {
                match self { $( Field::$variant => ValueKind::$vk, )* }
            }

            /// Looks a field up by its DCGM name (exact spelling).
            pub fn from_name(name: &str) -> Option<Field> {
                match name { $( $name => Some(Field::$variant), )* _ => None }
            }
        }
    };
}

fields! {
    SmClock => "DCGM_FI_DEV_SM_CLOCK", Int, "SM clock in MHz.";
    MemClock => "DCGM_FI_DEV_MEM_CLOCK", Int, "Memory clock in MHz.";
    MemoryTemp => "DCGM_FI_DEV_MEMORY_TEMP", Int, "Memory temperature in C.";
    GpuTemp => "DCGM_FI_DEV_GPU_TEMP", Int, "GPU temperature in C.";
    PowerUsage => "DCGM_FI_DEV_POWER_USAGE", Double, "Power draw in W.";
    TotalEnergyConsumption => "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", Int, "Energy since boot in mJ.";
    PcieReplayCounter => "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", Int, "PCIe retries.";
    GpuUtil => "DCGM_FI_DEV_GPU_UTIL", Int, "GPU utilization in percent.";
    MemCopyUtil => "DCGM_FI_DEV_MEM_COPY_UTIL", Int, "Memory utilization in percent.";
    EncUtil => "DCGM_FI_DEV_ENC_UTIL", Int, "Encoder utilization in percent.";
    DecUtil => "DCGM_FI_DEV_DEC_UTIL", Int, "Decoder utilization in percent.";
    XidErrors => "DCGM_FI_DEV_XID_ERRORS", Int, "The last Xid error seen.";
    FbFree => "DCGM_FI_DEV_FB_FREE", Int, "Free framebuffer in MiB.";
    FbUsed => "DCGM_FI_DEV_FB_USED", Int, "Used framebuffer in MiB.";
    FbReserved => "DCGM_FI_DEV_FB_RESERVED", Int, "Reserved framebuffer in MiB.";
    FbTotal => "DCGM_FI_DEV_FB_TOTAL", Int, "Total framebuffer in MiB.";
    NvlinkBandwidthTotal => "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", Int, "NVLink bandwidth over all lanes.";
    VgpuLicenseStatus => "DCGM_FI_DEV_VGPU_LICENSE_STATUS", Int, "vGPU license status.";
    UncorrectableRemappedRows => "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", Int, "Rows remapped for uncorrectable errors.";
    CorrectableRemappedRows => "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", Int, "Rows remapped for correctable errors.";
    RowRemapFailure => "DCGM_FI_DEV_ROW_REMAP_FAILURE", Int, "Whether row remapping failed.";
    DriverVersion => "DCGM_FI_DRIVER_VERSION", Text, "Driver version (a label).";
    ProfGrEngineActive => "DCGM_FI_PROF_GR_ENGINE_ACTIVE", Double, "Graphics engine active ratio.";
    ProfPipeTensorActive => "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", Double, "Tensor pipe active ratio.";
    ProfDramActive => "DCGM_FI_PROF_DRAM_ACTIVE", Double, "Memory interface active ratio.";
    ProfPcieTxBytes => "DCGM_FI_PROF_PCIE_TX_BYTES", Int, "PCIe bytes sent per second.";
    ProfPcieRxBytes => "DCGM_FI_PROF_PCIE_RX_BYTES", Int, "PCIe bytes received per second.";
    XidErrorsCount => "DCGM_EXP_XID_ERRORS_COUNT", Int, "Xid errors per code within the count window.";
    PcieTxThroughput => "DCGM_FI_DEV_PCIE_TX_THROUGHPUT", Int, "PCIe transmit throughput in KB/s.";
    PcieRxThroughput => "DCGM_FI_DEV_PCIE_RX_THROUGHPUT", Int, "PCIe receive throughput in KB/s.";
    PowerViolation => "DCGM_FI_DEV_POWER_VIOLATION", Int, "Time throttled by power capping in ns.";
    ThermalViolation => "DCGM_FI_DEV_THERMAL_VIOLATION", Int, "Time throttled by thermal limits in ns.";
    SyncBoostViolation => "DCGM_FI_DEV_SYNC_BOOST_VIOLATION", Int, "Time throttled by sync boost in ns.";
    BoardLimitViolation => "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION", Int, "Time throttled by the board limit in ns.";
    LowUtilViolation => "DCGM_FI_DEV_LOW_UTIL_VIOLATION", Int, "Time throttled for low utilisation in ns.";
    ReliabilityViolation => "DCGM_FI_DEV_RELIABILITY_VIOLATION", Int, "Time throttled by reliability limits in ns.";
    ClocksEventReasons => "DCGM_FI_DEV_CLOCKS_EVENT_REASONS", Int, "Active clock event (throttle) reasons, a bitmask.";
    EccSbeVolTotal => "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", Int, "Single-bit ECC errors since driver load.";
    EccDbeVolTotal => "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", Int, "Double-bit ECC errors since driver load.";
    EccSbeAggTotal => "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", Int, "Single-bit ECC errors over the GPU's life.";
    EccDbeAggTotal => "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", Int, "Double-bit ECC errors over the GPU's life.";
    RetiredSbe => "DCGM_FI_DEV_RETIRED_SBE", Int, "Pages retired for single-bit errors.";
    RetiredDbe => "DCGM_FI_DEV_RETIRED_DBE", Int, "Pages retired for double-bit errors.";
    RetiredPending => "DCGM_FI_DEV_RETIRED_PENDING", Int, "Whether a page retirement is pending.";
    NvlinkCrcFlitErrorCountTotal => "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", Int, "NVLink flow-control CRC errors.";
    NvlinkCrcDataErrorCountTotal => "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", Int, "NVLink data CRC errors.";
    NvlinkReplayErrorCountTotal => "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", Int, "NVLink replays.";
    NvlinkRecoveryErrorCountTotal => "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", Int, "NVLink recoveries.";
    NvlinkBandwidthL0 => "DCGM_FI_DEV_NVLINK_BANDWIDTH_L0", Int, "NVLink bandwidth of link 0 in MiB/s.";
    NvlinkBandwidthL1 => "DCGM_FI_DEV_NVLINK_BANDWIDTH_L1", Int, "NVLink bandwidth of link 1 in MiB/s.";
    NvlinkBandwidthL2 => "DCGM_FI_DEV_NVLINK_BANDWIDTH_L2", Int, "NVLink bandwidth of link 2 in MiB/s.";
    NvlinkBandwidthL3 => "DCGM_FI_DEV_NVLINK_BANDWIDTH_L3", Int, "NVLink bandwidth of link 3 in MiB/s.";
    NvlinkBandwidthL4 => "DCGM_FI_DEV_NVLINK_BANDWIDTH_L4", Int, "NVLink bandwidth of link 4 in MiB/s.";
    NvlinkBandwidthL5 => "DCGM_FI_DEV_NVLINK_BANDWIDTH_L5", Int, "NVLink bandwidth of link 5 in MiB/s.";
    NvlinkBandwidthL6 => "DCGM_FI_DEV_NVLINK_BANDWIDTH_L6", Int, "NVLink bandwidth of link 6 in MiB/s.";
    NvlinkBandwidthL7 => "DCGM_FI_DEV_NVLINK_BANDWIDTH_L7", Int, "NVLink bandwidth of link 7 in MiB/s.";
    NvlinkBandwidthL8 => "DCGM_FI_DEV_NVLINK_BANDWIDTH_L8", Int, "NVLink bandwidth of link 8 in MiB/s.";
    NvlinkBandwidthL9 => "DCGM_FI_DEV_NVLINK_BANDWIDTH_L9", Int, "NVLink bandwidth of link 9 in MiB/s.";
    NvlinkBandwidthL10 => "DCGM_FI_DEV_NVLINK_BANDWIDTH_L10", Int, "NVLink bandwidth of link 10 in MiB/s.";
    NvlinkBandwidthL11 => "DCGM_FI_DEV_NVLINK_BANDWIDTH_L11", Int, "NVLink bandwidth of link 11 in MiB/s.";
    NvlinkBandwidthL12 => "DCGM_FI_DEV_NVLINK_BANDWIDTH_L12", Int, "NVLink bandwidth of link 12 in MiB/s.";
    NvlinkBandwidthL13 => "DCGM_FI_DEV_NVLINK_BANDWIDTH_L13", Int, "NVLink bandwidth of link 13 in MiB/s.";
    NvlinkBandwidthL14 => "DCGM_FI_DEV_NVLINK_BANDWIDTH_L14", Int, "NVLink bandwidth of link 14 in MiB/s.";
    NvlinkBandwidthL15 => "DCGM_FI_DEV_NVLINK_BANDWIDTH_L15", Int, "NVLink bandwidth of link 15 in MiB/s.";
    NvlinkBandwidthL16 => "DCGM_FI_DEV_NVLINK_BANDWIDTH_L16", Int, "NVLink bandwidth of link 16 in MiB/s.";
    NvlinkBandwidthL17 => "DCGM_FI_DEV_NVLINK_BANDWIDTH_L17", Int, "NVLink bandwidth of link 17 in MiB/s.";
    NvmlVersion => "DCGM_FI_NVML_VERSION", Text, "NVML version (a label).";
    DevBrand => "DCGM_FI_DEV_BRAND", Text, "Device brand (a label).";
    DevSerial => "DCGM_FI_DEV_SERIAL", Text, "Board serial number (a label).";
    OemInforomVer => "DCGM_FI_DEV_OEM_INFOROM_VER", Text, "OEM inforom version (a label).";
    EccInforomVer => "DCGM_FI_DEV_ECC_INFOROM_VER", Text, "ECC inforom version (a label).";
    PowerInforomVer => "DCGM_FI_DEV_POWER_INFOROM_VER", Text, "Power inforom version (a label).";
    InforomImageVer => "DCGM_FI_DEV_INFOROM_IMAGE_VER", Text, "Inforom image version (a label).";
    VbiosVersion => "DCGM_FI_DEV_VBIOS_VERSION", Text, "VBIOS version (a label).";
    ProfSmActive => "DCGM_FI_PROF_SM_ACTIVE", Double, "SMs with at least one warp assigned, a ratio.";
    ProfSmOccupancy => "DCGM_FI_PROF_SM_OCCUPANCY", Double, "Resident warps over the maximum, a ratio.";
    ProfPipeFp64Active => "DCGM_FI_PROF_PIPE_FP64_ACTIVE", Double, "FP64 pipes active, a ratio.";
    ProfPipeFp32Active => "DCGM_FI_PROF_PIPE_FP32_ACTIVE", Double, "FP32 pipes active, a ratio.";
    ProfPipeFp16Active => "DCGM_FI_PROF_PIPE_FP16_ACTIVE", Double, "FP16 pipes active, a ratio.";
    ProfNvlinkTxBytes => "DCGM_FI_PROF_NVLINK_TX_BYTES", Int, "NVLink bytes sent per second.";
    ProfNvlinkRxBytes => "DCGM_FI_PROF_NVLINK_RX_BYTES", Int, "NVLink bytes received per second.";
    XidErrorsTotal => "DCGM_EXP_XID_ERRORS_TOTAL", Int, "Xid errors per code since the exporter started.";
    ClockEventsCount => "DCGM_EXP_CLOCK_EVENTS_COUNT", Int, "Samples with each clock event reason within the window.";
    ClockEventsTotal => "DCGM_EXP_CLOCK_EVENTS_TOTAL", Int, "Clock events per reason since the exporter started (edge-counted).";
    GpuHealthStatus => "DCGM_EXP_GPU_HEALTH_STATUS", Int, "Health per watch: 0 pass, 10 warn, 20 fail.";
    P2pStatus => "DCGM_EXP_P2P_STATUS", Int, "NVLink P2P status per peer GPU.";
}

impl Field {
    /// Number of known fields; values are stored in arrays of this size.
    pub const COUNT: usize = Field::ALL.len();

    /// Position of the field in [`Field::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

impl Field {
    /// The per-link NVLink bandwidth fields, by link number.
    pub const NVLINK_LINKS: [Field; 18] = [
        Field::NvlinkBandwidthL0,
        Field::NvlinkBandwidthL1,
        Field::NvlinkBandwidthL2,
        Field::NvlinkBandwidthL3,
        Field::NvlinkBandwidthL4,
        Field::NvlinkBandwidthL5,
        Field::NvlinkBandwidthL6,
        Field::NvlinkBandwidthL7,
        Field::NvlinkBandwidthL8,
        Field::NvlinkBandwidthL9,
        Field::NvlinkBandwidthL10,
        Field::NvlinkBandwidthL11,
        Field::NvlinkBandwidthL12,
        Field::NvlinkBandwidthL13,
        Field::NvlinkBandwidthL14,
        Field::NvlinkBandwidthL15,
        Field::NvlinkBandwidthL16,
        Field::NvlinkBandwidthL17,
    ];

    /// Families whose series carry their own labels (Xid code, clock event,
    /// health watch, peer GPU) and which the exporter computes rather than
    /// reads; one entity may have several series of them.
    pub fn is_labeled_family(self) -> bool {
        matches!(
            self,
            Field::XidErrorsCount
                | Field::XidErrorsTotal
                | Field::ClockEventsCount
                | Field::ClockEventsTotal
                | Field::GpuHealthStatus
                | Field::P2pStatus
        )
    }
}

/// DCGM fields that exist but that nothing in NVML supplies, with the reason a
/// counters file row naming them is refused (dcgm-exporter skips such rows as
/// "metric not enabled").
pub fn unsupported_reason(name: &str) -> Option<&'static str> {
    const CYCLES: &str = "NVML GPM reports ratios over an interval, not cumulative cycle counters; this field needs DCGM's profiling module";
    let exact = match name {
        "DCGM_FI_PROF_PCIE_TX_BYTES_TOTAL" | "DCGM_FI_PROF_PCIE_RX_BYTES_TOTAL" => Some(
            "NVML has no cumulative PCIe byte counter; use DCGM_FI_PROF_PCIE_TX_BYTES/RX_BYTES (bytes per second)",
        ),
        "DCGM_FI_PROF_NVLINK_TX_BYTES_TOTAL" | "DCGM_FI_PROF_NVLINK_RX_BYTES_TOTAL" => Some(
            "NVML has no cumulative NVLink byte counter; use DCGM_FI_PROF_NVLINK_TX_BYTES/RX_BYTES (bytes per second)",
        ),
        "DCGM_FI_DEV_COUNT" => {
            Some("a host-level count, not a per-GPU field; count the series instead")
        }
        _ => None,
    };
    if exact.is_some() {
        return exact;
    }
    if name.starts_with("DCGM_FI_PROF_") && name.ends_with("_CYCLES_ACTIVE_TOTAL")
        || name == "DCGM_FI_PROF_SM_CYCLES_ELAPSED_TOTAL"
    {
        return Some(CYCLES);
    }
    if name.starts_with("DCGM_FI_DEV_NVSWITCH_") {
        return Some("NVSwitch fields come from DCGM's NVSwitch module (fabric manager), not NVML");
    }
    if name.starts_with("DCGM_FI_DEV_CPU_") {
        return Some("Grace CPU fields come from DCGM's sysfs module, not NVML");
    }
    if name.starts_with("DCGM_FI_DEV_VGPU_") && name != "DCGM_FI_DEV_VGPU_LICENSE_STATUS" {
        return Some("per-vGPU fields need a vGPU host driver and DCGM's vGPU support");
    }
    None
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The counter set used when no `-f FILE` is given: dcgm-exporter's default 26
/// lines (25 metrics and the driver-version label) plus the windowed Xid count,
/// which this exporter turns on by default.
pub const DEFAULT_COUNTERS_CSV: &str = "\
# Format
# If a line starts with a '#' it is a comment.
# DCGM FIELD, Prometheus metric type, help message

# Clocks
DCGM_FI_DEV_SM_CLOCK,  gauge, SM clock frequency (in MHz).
DCGM_FI_DEV_MEM_CLOCK, gauge, Memory clock frequency (in MHz).

# Temperature
DCGM_FI_DEV_MEMORY_TEMP, gauge, Memory temperature (in C).
DCGM_FI_DEV_GPU_TEMP,    gauge, GPU temperature (in C).

# Power
DCGM_FI_DEV_POWER_USAGE,              gauge, Power draw (in W).
DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION, counter, Total energy consumption since boot (in mJ).

# PCIE
DCGM_FI_DEV_PCIE_REPLAY_COUNTER, counter, Total number of PCIe retries.

# Utilization (the sample period varies depending on the product)
DCGM_FI_DEV_GPU_UTIL,      gauge, GPU utilization (in %).
DCGM_FI_DEV_MEM_COPY_UTIL, gauge, Memory utilization (in %).
DCGM_FI_DEV_ENC_UTIL,      gauge, Encoder utilization (in %).
DCGM_FI_DEV_DEC_UTIL ,     gauge, Decoder utilization (in %).

# Errors and violations
DCGM_FI_DEV_XID_ERRORS, gauge, Value of the last XID error encountered.

# Memory usage
DCGM_FI_DEV_FB_FREE, gauge, Framebuffer memory free (in MiB).
DCGM_FI_DEV_FB_USED, gauge, Framebuffer memory used (in MiB).
DCGM_FI_DEV_FB_RESERVED, gauge, Framebuffer memory reserved (in MiB).

# NVLink
DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL, counter, Total number of NVLink bandwidth counters for all lanes.

# vGPU
DCGM_FI_DEV_VGPU_LICENSE_STATUS, gauge, vGPU License status

# Remapped rows
DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS, counter, Number of remapped rows for uncorrectable errors
DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS,   counter, Number of remapped rows for correctable errors
DCGM_FI_DEV_ROW_REMAP_FAILURE,           gauge,   Whether remapping of rows has failed

# Static configuration information, emitted as labels
DCGM_FI_DRIVER_VERSION, label, Driver Version

# Profiling (DCP) metrics: emitted only where the GPU provides them
DCGM_FI_PROF_GR_ENGINE_ACTIVE,   gauge, Ratio of time the graphics engine is active.
DCGM_FI_PROF_PIPE_TENSOR_ACTIVE, gauge, Ratio of cycles the tensor (HMMA) pipe is active.
DCGM_FI_PROF_DRAM_ACTIVE,        gauge, Ratio of cycles the device memory interface is active sending or receiving data.
DCGM_FI_PROF_PCIE_TX_BYTES,      gauge, The rate of data transmitted over the PCIe bus - including both protocol headers and data payloads - in bytes per second.
DCGM_FI_PROF_PCIE_RX_BYTES,      gauge, The rate of data received over the PCIe bus - including both protocol headers and data payloads - in bytes per second.

# Windowed Xid counts (on by default here; opt-in in dcgm-exporter)
DCGM_EXP_XID_ERRORS_COUNT, gauge, Count of XID Errors within user-specified time window (see xid-count-window-size param).
";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_indexes_match_positions() {
        for (i, f) in Field::ALL.iter().enumerate() {
            assert_eq!(Field::from_name(f.name()), Some(*f));
            assert_eq!(f.index(), i);
        }
        assert_eq!(Field::from_name("DCGM_FI_DEV_NOPE"), None);
    }

    #[test]
    fn kinds_parse_only_the_csv_spellings() {
        for k in ["gauge", "counter", "histogram", "summary", "label"] {
            assert_eq!(MetricKind::parse(k).map(MetricKind::as_str), Some(k));
        }
        assert_eq!(MetricKind::parse("Gauge"), None);
    }
}
