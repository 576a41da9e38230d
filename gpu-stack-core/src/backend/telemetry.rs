//! Telemetry types: what one sample of a GPU or GPU instance carries, and the
//! static strings and peer-to-peer status the exporter reads once.

use serde::{Deserialize, Serialize};

/// One telemetry field: a value, "this GPU does not have it", or a read error.
/// Exporters omit unsupported series instead of printing sentinels.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reading<T> {
    /// The value read.
    Value(T),
    /// The device or driver does not provide this field.
    NotSupported,
    /// Reading failed; the message says why.
    Error(String),
}

impl<T> Reading<T> {
    /// The value, if there is one.
    pub fn value(&self) -> Option<&T> {
        match self {
            Reading::Value(v) => Some(v),
            _ => None,
        }
    }

    /// True for [`Reading::NotSupported`].
    pub fn is_not_supported(&self) -> bool {
        matches!(self, Reading::NotSupported)
    }

    /// Applies `f` to a value, keeping the other cases.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Reading<U> {
        match self {
            Reading::Value(v) => Reading::Value(f(v)),
            Reading::NotSupported => Reading::NotSupported,
            Reading::Error(e) => Reading::Error(e),
        }
    }
}

/// Framebuffer memory in bytes. Invariant: `used + free + reserved == total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FbMemory {
    /// Total memory.
    pub total: u64,
    /// Memory in use by processes and the driver's per-context allocations.
    pub used: u64,
    /// Memory free for allocation.
    pub free: u64,
    /// Memory reserved by the driver and firmware.
    pub reserved: u64,
}

impl FbMemory {
    /// Whether the parts add up to the total.
    pub fn is_consistent(&self) -> bool {
        self.used
            .checked_add(self.free)
            .and_then(|s| s.checked_add(self.reserved))
            == Some(self.total)
    }
}

/// Row-remapping counters (HBM GPUs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemappedRows {
    /// Rows remapped for correctable errors.
    pub correctable: u32,
    /// Rows remapped for uncorrectable errors.
    pub uncorrectable: u32,
    /// A remapping waits for the next reset.
    pub pending: bool,
    /// A remapping failed.
    pub failed: bool,
}

/// One telemetry sample of a whole GPU: the fields of the DCGM default counter
/// set. Units are NVML's; exporters convert (W = mW / 1000, MiB = bytes / 2^20).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuTelemetry {
    /// GPU index.
    pub gpu: u32,
    /// SM clock in MHz.
    pub sm_clock_mhz: Reading<u32>,
    /// Memory clock in MHz.
    pub mem_clock_mhz: Reading<u32>,
    /// GPU temperature in °C.
    pub gpu_temp_c: Reading<u32>,
    /// Memory (HBM) temperature in °C.
    pub memory_temp_c: Reading<u32>,
    /// Power draw in mW.
    pub power_usage_mw: Reading<u32>,
    /// Energy since driver load in mJ (monotonic).
    pub total_energy_mj: Reading<u64>,
    /// PCIe replay count (monotonic).
    pub pcie_replay_count: Reading<u64>,
    /// GPU utilisation in percent.
    pub gpu_util_pct: Reading<u32>,
    /// Memory-copy utilisation in percent.
    pub mem_copy_util_pct: Reading<u32>,
    /// Encoder utilisation in percent.
    pub enc_util_pct: Reading<u32>,
    /// Decoder utilisation in percent.
    pub dec_util_pct: Reading<u32>,
    /// Framebuffer memory.
    pub fb_memory: Reading<FbMemory>,
    /// NVLink data moved over all links, TX + RX, in KiB since driver load (monotonic).
    pub nvlink_total_kib: Reading<u64>,
    /// Row remapping.
    pub remapped_rows: Reading<RemappedRows>,
    /// PCIe transmit throughput in KiB/s.
    pub pcie_tx_kib_per_s: Reading<u32>,
    /// PCIe receive throughput in KiB/s.
    pub pcie_rx_kib_per_s: Reading<u32>,
    /// Profiling ratios and rates (NVML GPM on Hopper and newer).
    pub profiling: Reading<Profiling>,
    /// The last Xid seen on this GPU, 0 when none.
    pub last_xid: Reading<u64>,
    /// Time spent throttled, per cause (`nvmlDeviceGetViolationStatus`).
    pub violations: Reading<Violations>,
    /// ECC error totals; `NotSupported` when ECC is off or absent.
    pub ecc_errors: Reading<EccErrors>,
    /// Retired pages (GPUs before Ampere; later ones remap rows instead).
    pub retired_pages: Reading<RetiredPages>,
    /// NVLink error counters summed over the GPU's links.
    pub nvlink_errors: Reading<NvlinkErrors>,
    /// NVLink data moved per link, TX + RX, in KiB since driver load
    /// (monotonic; index = link number; sums to `nvlink_total_kib`).
    pub nvlink_link_kib: Reading<Vec<u64>>,
    /// Active clock event (throttle) reasons, a bitmask of [`clock_events`] bits.
    pub clocks_event_reasons: Reading<u64>,
}

/// A compute process on a GPU as the driver lists it. On a MIG-enabled GPU it
/// names the GPU instance and compute instance (the MIG device) it runs on, so
/// a MIG change can tell which instances are busy.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GpuProcess {
    /// Process id (in the host's PID namespace).
    pub pid: u32,
    /// GPU memory the process uses in bytes; `None` when the driver does not say
    /// (e.g. unprivileged callers, some virtualised setups).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_memory_bytes: Option<u64>,
    /// GPU-instance id on a MIG-enabled GPU; `None` when MIG is off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_instance_id: Option<u32>,
    /// Compute-instance id on a MIG-enabled GPU; `None` when MIG is off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_instance_id: Option<u32>,
}

/// One telemetry sample of a MIG GPU instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigTelemetry {
    /// Parent GPU index.
    pub gpu: u32,
    /// GPU-instance id.
    pub gpu_instance_id: u32,
    /// Framebuffer memory of the instance.
    pub fb_memory: Reading<FbMemory>,
    /// Profiling ratios of the instance (NVML GPM per GPU instance).
    pub profiling: Reading<Profiling>,
}

/// Throttling time per cause in nanoseconds since driver load (monotonic), as
/// `nvmlDeviceGetViolationStatus` reports it; `None` where the GPU does not
/// report that cause.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Violations {
    /// Power capping (`NVML_PERF_POLICY_POWER`).
    pub power_ns: Option<u64>,
    /// Thermal limits (`NVML_PERF_POLICY_THERMAL`).
    pub thermal_ns: Option<u64>,
    /// Sync boost (`NVML_PERF_POLICY_SYNC_BOOST`).
    pub sync_boost_ns: Option<u64>,
    /// Board power limit (`NVML_PERF_POLICY_BOARD_LIMIT`).
    pub board_limit_ns: Option<u64>,
    /// Low utilisation (`NVML_PERF_POLICY_LOW_UTILIZATION`).
    pub low_util_ns: Option<u64>,
    /// Board reliability limit (`NVML_PERF_POLICY_RELIABILITY`).
    pub reliability_ns: Option<u64>,
}

/// ECC error totals (`nvmlDeviceGetTotalEccErrors`): volatile since the last
/// driver load, aggregate over the GPU's life.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EccErrors {
    /// Corrected (single-bit) errors since driver load.
    pub sbe_volatile: u64,
    /// Uncorrected (double-bit) errors since driver load.
    pub dbe_volatile: u64,
    /// Corrected errors over the GPU's life.
    pub sbe_aggregate: u64,
    /// Uncorrected errors over the GPU's life.
    pub dbe_aggregate: u64,
}

/// Retired framebuffer pages (`nvmlDeviceGetRetiredPages`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetiredPages {
    /// Pages retired for multiple single-bit errors.
    pub single_bit: u64,
    /// Pages retired for double-bit errors.
    pub double_bit: u64,
    /// A retirement waits for the next driver reload.
    pub pending: bool,
}

/// NVLink error counters summed over links (`nvmlDeviceGetNvLinkErrorCounter`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvlinkErrors {
    /// Flow-control CRC errors (`NVML_NVLINK_ERROR_DL_CRC_FLIT`).
    pub crc_flit: u64,
    /// Data CRC errors (`NVML_NVLINK_ERROR_DL_CRC_DATA`).
    pub crc_data: u64,
    /// Replays (`NVML_NVLINK_ERROR_DL_REPLAY`).
    pub replay: u64,
    /// Recoveries (`NVML_NVLINK_ERROR_DL_RECOVERY`).
    pub recovery: u64,
}

/// Profiling figures over the last sampling interval, from two NVML GPM
/// samples (`nvmlGpmMetricsGet`): ratios in 0..=1 (GPM reports percent) and
/// rates in bytes per second. `None` where GPM does not provide the metric.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Profiling {
    /// Graphics/compute engine active (`GRAPHICS_UTIL`).
    pub gr_engine_active: Option<f64>,
    /// SMs with at least one warp assigned (`SM_UTIL`).
    pub sm_active: Option<f64>,
    /// Resident warps over the maximum (`SM_OCCUPANCY`).
    pub sm_occupancy: Option<f64>,
    /// Any tensor pipe active (`ANY_TENSOR_UTIL`).
    pub tensor_active: Option<f64>,
    /// Memory interface busy (`DRAM_BW_UTIL`).
    pub dram_active: Option<f64>,
    /// FP64 pipes active (`FP64_UTIL`).
    pub fp64_active: Option<f64>,
    /// FP32 pipes active (`FP32_UTIL`).
    pub fp32_active: Option<f64>,
    /// FP16 pipes active (`FP16_UTIL`).
    pub fp16_active: Option<f64>,
    /// NVLink bytes sent per second over all links (`NVLINK_TOTAL_TX_PER_SEC`).
    pub nvlink_tx_bytes_per_s: Option<f64>,
    /// NVLink bytes received per second over all links (`NVLINK_TOTAL_RX_PER_SEC`).
    pub nvlink_rx_bytes_per_s: Option<f64>,
}

impl Profiling {
    /// The ratios, each with its name, for bound checks.
    pub fn ratios(&self) -> [(&'static str, Option<f64>); 8] {
        [
            ("gr_engine_active", self.gr_engine_active),
            ("sm_active", self.sm_active),
            ("sm_occupancy", self.sm_occupancy),
            ("tensor_active", self.tensor_active),
            ("dram_active", self.dram_active),
            ("fp64_active", self.fp64_active),
            ("fp32_active", self.fp32_active),
            ("fp16_active", self.fp16_active),
        ]
    }
}

/// Clock event (throttle) reason bits, NVML's and DCGM's
/// (`nvmlClocksEventReason*`, `DCGM_CLOCKS_EVENT_REASON_*`), with the names
/// dcgm-exporter prints in the `clock_event` label.
pub mod clock_events {
    /// Nothing runs; clocks drop to idle.
    pub const GPU_IDLE: u64 = 0x1;
    /// Limited by the application clocks setting.
    pub const CLOCKS_SETTING: u64 = 0x2;
    /// Software power capping.
    pub const SW_POWER_CAP: u64 = 0x4;
    /// Hardware slowdown (clocks halved or more).
    pub const HW_SLOWDOWN: u64 = 0x8;
    /// Sync boost.
    pub const SYNC_BOOST: u64 = 0x10;
    /// Software thermal slowdown.
    pub const SW_THERMAL: u64 = 0x20;
    /// Hardware thermal slowdown.
    pub const HW_THERMAL: u64 = 0x40;
    /// Hardware power brake.
    pub const HW_POWER_BRAKE: u64 = 0x80;
    /// Limited by display clocks.
    pub const DISPLAY_CLOCKS: u64 = 0x100;

    /// Every reason bit with its `clock_event` label value, in bit order.
    pub const NAMES: [(u64, &str); 9] = [
        (GPU_IDLE, "gpu_idle"),
        (CLOCKS_SETTING, "clocks_setting"),
        (SW_POWER_CAP, "power_cap"),
        (HW_SLOWDOWN, "hw_slowdown"),
        (SYNC_BOOST, "sync_boost"),
        (SW_THERMAL, "sw_thermal"),
        (HW_THERMAL, "hw_thermal"),
        (HW_POWER_BRAKE, "hw_power_brake"),
        (DISPLAY_CLOCKS, "display_clocks"),
    ];

    /// The label value of one reason bit.
    pub fn name(bit: u64) -> Option<&'static str> {
        NAMES.iter().find(|(b, _)| *b == bit).map(|(_, n)| *n)
    }
}

/// Static strings of a GPU that dcgm-exporter can print as labels; `None`
/// where the GPU or driver does not report one.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceStrings {
    /// Brand, e.g. `NVIDIA` or `Tesla` (`nvmlDeviceGetBrand`).
    pub brand: Option<String>,
    /// Board serial number.
    pub serial: Option<String>,
    /// VBIOS version.
    pub vbios_version: Option<String>,
    /// OEM inforom object version.
    pub oem_inforom_version: Option<String>,
    /// ECC inforom object version.
    pub ecc_inforom_version: Option<String>,
    /// Power-management inforom object version.
    pub power_inforom_version: Option<String>,
    /// Inforom image version.
    pub inforom_image_version: Option<String>,
}

/// Whether two GPUs can reach each other peer to peer over NVLink
/// (`nvmlDeviceGetP2PStatus` with `NVML_P2P_CAPS_INDEX_NVLINK`). The numbers
/// are NVML's `nvmlGpuP2PStatus_t`, which dcgm-exporter prints as the value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum P2pStatus {
    /// Peer access works.
    Ok,
    /// The chipset does not support it.
    ChipsetNotSupported,
    /// The GPU does not support it.
    GpuNotSupported,
    /// The PCIe/NVLink topology does not allow it.
    TopologyNotSupported,
    /// Disabled by a driver registry key.
    DisabledByRegKey,
    /// Not supported.
    NotSupported,
    /// Unknown.
    Unknown,
}

impl P2pStatus {
    /// NVML's number for the status.
    pub fn code(self) -> u32 {
        match self {
            Self::Ok => 0,
            Self::ChipsetNotSupported => 1,
            Self::GpuNotSupported => 2,
            Self::TopologyNotSupported => 3,
            Self::DisabledByRegKey => 4,
            Self::NotSupported => 5,
            Self::Unknown => 6,
        }
    }

    /// From NVML's number; anything else is `Unknown`.
    pub fn from_code(code: u32) -> Self {
        match code {
            0 => Self::Ok,
            1 => Self::ChipsetNotSupported,
            2 => Self::GpuNotSupported,
            3 => Self::TopologyNotSupported,
            4 => Self::DisabledByRegKey,
            5 => Self::NotSupported,
            _ => Self::Unknown,
        }
    }

    /// dcgm-exporter's `link_status` label value.
    pub fn label(self) -> &'static str {
        match self {
            Self::Ok => "OK",
            Self::ChipsetNotSupported => "ChipsetNotSupported",
            Self::GpuNotSupported => "GPUNotSupported",
            Self::TopologyNotSupported => "TopologyNotSupported",
            Self::DisabledByRegKey => "DisabledByRegKey",
            Self::NotSupported => "NotSupported",
            Self::Unknown => "Unknown",
        }
    }
}
