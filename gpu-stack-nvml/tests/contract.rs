//! The backend contract: one suite, run against the simulated backend directly
//! and against the NVML backend loaded (through nvml-wrapper's real `dlopen`
//! path) from the `nvml-standin` library, which answers from a simulated node
//! built from the same fleet file. Both must pass identically.
//!
//! The stand-in is built by this test with `cargo build -p nvml-standin` into the
//! same target directory, then loaded with `--nvml-lib`-style path override.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_stack_core::backend::{
    BackendError, Fault, FaultSpec, GpuBackend, GpuProcess, GpuTelemetry, HealthEvent,
    HealthEventKind, HealthEvents, MigModeChange, MigTelemetry, P2pStatus, Profiling, Reading,
    SlicePlacement, clock_events, node_snapshot,
};
use gpu_stack_nvml::{NvmlBackend, SimNodeSpec, SimulatedBackend};

const FLEET: &str = r#"
nodes:
  - name: contract-0
    telemetry: { seed: 42, utilization-pct: 50, jitter-pct: 20, memory-used-pct: 30, tick-ms: 1000 }
    gpus:
      - model: A100-SXM4-40GB
      - model: A100-SXM4-40GB
        mig:
          enabled: true
          instances: ["3g.20gb@4", "1g.5gb@0"]
      - model: H100-SXM5-80GB
        mig: { enabled: true }
      - model: L4
    processes:
      - { gpu: 1, pid: 4242, instance: "3g.20gb@4", used-memory-mib: 2048 }
      - { gpu: 3, pid: 77, used-memory-mib: 512 }
"#;

/// The fleet's telemetry tick: samples change from one tick to the next.
const TICK_MS: u64 = 1000;

struct Harness {
    label: &'static str,
    backend: Arc<dyn GpuBackend>,
    /// Injects faults into the simulated node behind the backend.
    injector: SimulatedBackend,
}

fn kind<T: std::fmt::Debug>(label: &str, r: Result<T, BackendError>) -> &'static str {
    match r {
        Ok(v) => panic!("{label}: expected an error, got {v:?}"),
        Err(e) => e.kind(),
    }
}

fn next_event(label: &str, events: &mut Box<dyn HealthEvents>) -> HealthEvent {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Some(e) = events.wait(Duration::from_millis(200)).unwrap() {
            return e;
        }
    }
    panic!("{label}: no health event within 10 s");
}

fn in_range<T: PartialOrd + std::fmt::Debug>(
    label: &str,
    what: &str,
    r: &Reading<T>,
    lo: T,
    hi: T,
) {
    match r {
        Reading::Value(v) => assert!(
            *v >= lo && *v <= hi,
            "{label}: {what} = {v:?} outside [{lo:?}, {hi:?}]"
        ),
        Reading::NotSupported => {}
        Reading::Error(e) => panic!("{label}: {what} failed: {e}"),
    }
}

/// `read` from the backend under test and from the simulated node behind it
/// within one telemetry tick (again when a tick boundary fell between them),
/// so both describe the same simulated state. For the simulated harness the
/// two are the same backend.
fn at_one_tick<T>(h: &Harness, read: impl Fn(&dyn GpuBackend) -> T) -> (T, T) {
    for _ in 0..20 {
        let tick = h.injector.now_ms() / TICK_MS;
        let got = read(h.backend.as_ref());
        let want = read(&h.injector);
        if h.injector.now_ms() / TICK_MS == tick {
            return (got, want);
        }
    }
    panic!("{}: no two reads within one tick in 20 tries", h.label);
}

/// GPM profiling as the two backends give it: the same metrics, and values
/// equal up to the rounding of NVML's units (percent, MiB/s) on the way.
fn assert_same_profiling(l: &str, what: &str, got: &Reading<Profiling>, want: &Reading<Profiling>) {
    let (Reading::Value(g), Reading::Value(w)) = (got, want) else {
        assert_eq!(got, want, "{l}: {what} profiling");
        return;
    };
    let rates = |p: &Profiling| {
        [
            ("nvlink_tx_bytes_per_s", p.nvlink_tx_bytes_per_s),
            ("nvlink_rx_bytes_per_s", p.nvlink_rx_bytes_per_s),
        ]
    };
    let all = |p: &Profiling| {
        let mut v = p.ratios().to_vec();
        v.extend(rates(p));
        v
    };
    for ((name, a), (_, b)) in all(g).into_iter().zip(all(w)) {
        match (a, b) {
            (Some(a), Some(b)) => assert!(
                (a - b).abs() <= 1e-9 * b.abs().max(1.0),
                "{l}: {what} {name}: {a} != {b}"
            ),
            _ => assert_eq!(a, b, "{l}: {what} {name}"),
        }
    }
}

/// Every deterministic field equal. The last Xid is left out: the NVML
/// backend knows it only from its own event subscriptions.
fn assert_same_telemetry(l: &str, got: &GpuTelemetry, want: &GpuTelemetry) {
    let what = format!("GPU {}", want.gpu);
    assert_same_profiling(l, &what, &got.profiling, &want.profiling);
    let plain = |t: &GpuTelemetry| GpuTelemetry {
        profiling: Reading::NotSupported,
        last_xid: Reading::NotSupported,
        ..t.clone()
    };
    assert_eq!(plain(got), plain(want), "{l}: {what} telemetry");
}

fn assert_same_mig(l: &str, mut got: Vec<MigTelemetry>, mut want: Vec<MigTelemetry>) {
    got.sort_by_key(|m| m.gpu_instance_id);
    want.sort_by_key(|m| m.gpu_instance_id);
    let ids = |v: &[MigTelemetry]| v.iter().map(|m| m.gpu_instance_id).collect::<Vec<_>>();
    assert_eq!(ids(&got), ids(&want), "{l}: GPU instances");
    for (g, w) in got.iter().zip(&want) {
        let what = format!("GPU {} instance {}", w.gpu, w.gpu_instance_id);
        assert_eq!(g.fb_memory, w.fb_memory, "{l}: {what} memory");
        assert_same_profiling(l, &what, &g.profiling, &w.profiling);
    }
}

/// GPM ratios present and in 0..=1, with SM occupancy within SM activity
/// (warps resident only on SMs that have one); the profiling read.
fn gpm_ratios<'a>(l: &str, what: &str, r: &'a Reading<Profiling>) -> &'a Profiling {
    let p = r
        .value()
        .unwrap_or_else(|| panic!("{l}: {what} has GPM profiling: {r:?}"));
    for (name, v) in p.ratios() {
        let v = v.unwrap_or_else(|| panic!("{l}: {what} {name} missing"));
        assert!((0.0..=1.0).contains(&v), "{l}: {what} {name} = {v}");
    }
    let (occupancy, active) = (p.sm_occupancy.unwrap(), p.sm_active.unwrap());
    assert!(
        occupancy <= active,
        "{l}: {what} SM occupancy {occupancy} above SM activity {active}"
    );
    p
}

/// Throttling, ECC, NVLink, clock events, GPM, device strings and P2P, and the
/// backend under test against the simulated node behind it.
fn extended_telemetry(h: &Harness) {
    let l = h.label;
    let b = h.backend.as_ref();
    let known = clock_events::NAMES.iter().fold(0, |m, (bit, _)| m | bit);
    for gpu in 0..4 {
        let t1 = b.gpu_telemetry(gpu).unwrap();
        let t2 = b.gpu_telemetry(gpu).unwrap();
        let (v1, v2) = (
            t1.violations.value().copied().unwrap(),
            t2.violations.value().copied().unwrap(),
        );
        let pairs = [
            ("power", v1.power_ns, v2.power_ns),
            ("thermal", v1.thermal_ns, v2.thermal_ns),
            ("sync boost", v1.sync_boost_ns, v2.sync_boost_ns),
            ("board limit", v1.board_limit_ns, v2.board_limit_ns),
            ("low utilisation", v1.low_util_ns, v2.low_util_ns),
            ("reliability", v1.reliability_ns, v2.reliability_ns),
        ];
        for (name, a, b) in pairs {
            assert_eq!(a.is_some(), b.is_some(), "{l}: GPU {gpu} {name}");
            assert!(b >= a, "{l}: GPU {gpu} {name} violation time went down");
        }
        assert!(
            v1.power_ns.is_some(),
            "{l}: GPU {gpu} reports power capping"
        );
        let hbm = gpu < 3;
        assert_eq!(
            t1.ecc_errors.value().is_some(),
            hbm,
            "{l}: GPU {gpu} ECC totals: {:?}",
            t1.ecc_errors
        );
        assert_eq!(
            t1.retired_pages.value().is_some(),
            !hbm,
            "{l}: GPU {gpu} retires pages only before HBM row remapping: {:?}",
            t1.retired_pages
        );
        match (&t1.nvlink_link_kib, &t1.nvlink_total_kib) {
            (Reading::Value(links), Reading::Value(total)) => {
                assert_eq!(links.len(), if gpu < 2 { 12 } else { 18 }, "{l}: GPU {gpu}");
                assert_eq!(
                    links.iter().sum::<u64>(),
                    *total,
                    "{l}: GPU {gpu} links add up to the total"
                );
                assert!(t1.nvlink_errors.value().is_some(), "{l}: GPU {gpu}");
            }
            (links, total) => {
                assert_eq!(gpu, 3, "{l}: GPU {gpu} has NVLink: {links:?} {total:?}");
                assert!(links.is_not_supported() && total.is_not_supported(), "{l}");
                assert!(t1.nvlink_errors.is_not_supported(), "{l}");
            }
        }
        let reasons = *t1.clocks_event_reasons.value().unwrap();
        assert_eq!(
            reasons & !known,
            0,
            "{l}: GPU {gpu} clock event reasons {reasons:#x} use unknown bits"
        );
        if gpu == 2 {
            let p = gpm_ratios(l, "H100", &t1.profiling);
            for (name, r) in [
                ("NVLink TX", p.nvlink_tx_bytes_per_s),
                ("NVLink RX", p.nvlink_rx_bytes_per_s),
            ] {
                assert!(r.is_some_and(|r| r >= 0.0), "{l}: H100 {name} = {r:?}");
            }
        } else {
            assert!(
                t1.profiling.is_not_supported(),
                "{l}: GPU {gpu} has no GPM: {:?}",
                t1.profiling
            );
        }

        let (got, want) = at_one_tick(h, |b| b.gpu_telemetry(gpu).unwrap());
        assert_same_telemetry(l, &got, &want);

        let strings = b.device_strings(gpu).unwrap();
        for (name, s) in [
            ("brand", &strings.brand),
            ("serial", &strings.serial),
            ("VBIOS version", &strings.vbios_version),
            ("inforom image version", &strings.inforom_image_version),
        ] {
            assert!(
                s.as_deref().is_some_and(|s| !s.is_empty()),
                "{l}: GPU {gpu} {name}: {s:?}"
            );
        }
        assert_eq!(
            strings,
            h.injector.device_strings(gpu).unwrap(),
            "{l}: GPU {gpu} strings"
        );
    }
    let (got, want) = at_one_tick(h, |b| b.mig_telemetry(1).unwrap());
    assert_same_mig(l, got, want);

    assert_eq!(
        b.p2p_status(0, 2).unwrap(),
        P2pStatus::Ok,
        "{l}: NVLink peers"
    );
    assert_eq!(
        b.p2p_status(2, 0).unwrap(),
        P2pStatus::Ok,
        "{l}: NVLink peers"
    );
    assert_eq!(
        b.p2p_status(0, 3).unwrap(),
        P2pStatus::NotSupported,
        "{l}: the L4 has no NVLink"
    );
    assert_eq!(b.p2p_status(2, 2).unwrap(), P2pStatus::NotSupported, "{l}");
    assert_eq!(kind(l, b.p2p_status(0, 9)), "not_found", "{l}");

    // Faults show through: an overheating GPU throttles for heat and accrues
    // thermal violation time (from the next tick on); corrected ECC errors
    // are counted.
    let before = b.gpu_telemetry(2).unwrap();
    for fault in [
        Fault::Overheat { temp_c: 95 },
        Fault::EccErrors {
            single_bit: 3,
            double_bit: 0,
        },
    ] {
        h.injector
            .inject(FaultSpec {
                gpu: Some(2),
                at_ms: 0,
                fault,
            })
            .unwrap();
    }
    std::thread::sleep(Duration::from_millis(TICK_MS + 100));
    let after = b.gpu_telemetry(2).unwrap();
    assert_eq!(after.gpu_temp_c, Reading::Value(95), "{l}");
    let thermal = clock_events::SW_THERMAL | clock_events::HW_THERMAL;
    let reasons = *after.clocks_event_reasons.value().unwrap();
    assert_eq!(reasons & thermal, thermal, "{l}: {reasons:#x}");
    let thermal_ns = |t: &GpuTelemetry| t.violations.value().unwrap().thermal_ns.unwrap();
    assert!(
        thermal_ns(&after) > thermal_ns(&before),
        "{l}: thermal violation time {} -> {}",
        thermal_ns(&before),
        thermal_ns(&after)
    );
    let (e0, e1) = (
        before.ecc_errors.value().copied().unwrap(),
        after.ecc_errors.value().copied().unwrap(),
    );
    assert_eq!(e1.sbe_volatile, e0.sbe_volatile + 3, "{l}");
    assert_eq!(e1.sbe_aggregate, e0.sbe_aggregate + 3, "{l}");
    assert_eq!(e1.dbe_volatile, e0.dbe_volatile, "{l}");
    let (got, want) = at_one_tick(h, |b| b.gpu_telemetry(2).unwrap());
    assert_same_telemetry(l, &got, &want);
}

fn contract(h: &Harness) {
    let l = h.label;
    let b = h.backend.as_ref();

    // Inventory.
    let sys = b.system_info().unwrap();
    assert_eq!(sys.driver_version, "570.133.20", "{l}");
    assert_eq!(sys.cuda_driver_version, "12.8", "{l}");
    let inv = b.inventory().unwrap();
    assert!(inv.errors.is_empty(), "{l}: {:?}", inv.errors);
    let names: Vec<_> = inv.gpus.iter().map(|g| g.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "NVIDIA A100-SXM4-40GB",
            "NVIDIA A100-SXM4-40GB",
            "NVIDIA H100 80GB HBM3",
            "NVIDIA L4"
        ],
        "{l}"
    );
    for (i, g) in inv.gpus.iter().enumerate() {
        assert_eq!(g.index, i as u32, "{l}");
        assert_eq!(g.minor_number, i as u32, "{l}");
        assert!(
            g.uuid.starts_with("GPU-") && g.uuid.len() == 40,
            "{l}: {}",
            g.uuid
        );
        assert!(g.pci_bus_id.starts_with("00000000:"), "{l}");
    }
    assert_eq!(inv.gpus[0].pci_device_id, 0x20B010DE, "{l}");
    assert_eq!(inv.gpus[0].architecture, "ampere", "{l}");
    assert_eq!(inv.gpus[2].architecture, "hopper", "{l}");
    assert_eq!(inv.gpus[2].compute_capability, (9, 0), "{l}");
    assert!(
        !inv.gpus[3].mig_capable && inv.gpus[3].mig_mode.is_none(),
        "{l}"
    );
    assert!(inv.gpus[1].mig_mode.unwrap().current, "{l}");
    assert!(!inv.gpus[0].mig_mode.unwrap().current, "{l}");

    // Profiles as the device reports them.
    let profiles = b.gpu_instance_profiles(0).unwrap();
    let p3 = profiles.iter().find(|p| p.name == "3g.20gb").unwrap();
    assert_eq!(p3.id, 9, "{l}");
    assert_eq!(p3.instance_count, 2, "{l}");
    assert_eq!(
        p3.placements,
        [
            SlicePlacement { start: 0, size: 4 },
            SlicePlacement { start: 4, size: 4 }
        ],
        "{l}"
    );
    let p1 = profiles.iter().find(|p| p.name == "1g.5gb").unwrap();
    assert_eq!((p1.id, p1.placements.len()), (19, 7), "{l}");
    assert_eq!(kind(l, b.gpu_instance_profiles(3)), "not_supported", "{l}");

    // MIG state from the fleet file.
    let gis = b.gpu_instances(1).unwrap();
    assert_eq!(gis.len(), 2, "{l}");
    assert_eq!(gis[0].profile_name, "3g.20gb", "{l}");
    assert_eq!(
        gis[0].placement,
        SlicePlacement { start: 4, size: 4 },
        "{l}"
    );
    assert_eq!(gis[1].profile_name, "1g.5gb", "{l}");
    for gi in &gis {
        assert_eq!(gi.compute_instances.len(), 1, "{l}");
        assert!(gi.compute_instances[0].uuid.starts_with("MIG-"), "{l}");
    }

    // Running processes: with MIG ids on a MIG GPU, without them otherwise.
    let mib = 1u64 << 20;
    let on_mig = b.running_processes(1).unwrap();
    assert_eq!(
        on_mig,
        vec![GpuProcess {
            pid: 4242,
            used_memory_bytes: Some(2048 * mib),
            gpu_instance_id: Some(gis[0].id),
            compute_instance_id: Some(gis[0].compute_instances[0].id),
        }],
        "{l}"
    );
    assert_eq!(
        b.running_processes(3).unwrap(),
        vec![GpuProcess {
            pid: 77,
            used_memory_bytes: Some(512 * mib),
            gpu_instance_id: None,
            compute_instance_id: None,
        }],
        "{l}"
    );
    assert!(b.running_processes(0).unwrap().is_empty(), "{l}");
    assert!(b.running_processes(2).unwrap().is_empty(), "{l}");
    assert_eq!(kind(l, b.running_processes(9)), "not_found", "{l}");
    // Started and stopped at runtime through the shared state, on the small
    // instance: two processes listed in (GPU instance, compute instance) order.
    let started = h
        .injector
        .start_process(1, Some(gis[1].id), None, Some(5151), None)
        .unwrap();
    let both = b.running_processes(1).unwrap();
    let mut expected = vec![on_mig[0].clone(), started.clone()];
    expected.sort_by_key(|p| (p.gpu_instance_id, p.compute_instance_id, p.pid));
    assert_eq!(both, expected, "{l}");
    assert_eq!(
        both.iter()
            .find(|p| p.pid == 5151)
            .unwrap()
            .used_memory_bytes,
        None,
        "{l}"
    );
    assert_eq!(h.injector.stop_process(Some(1), 5151).unwrap(), 1, "{l}");
    assert_eq!(b.running_processes(1).unwrap(), on_mig, "{l}");

    // Create / list / destroy round trip on the empty H100.
    let gi = b
        .create_gpu_instance(2, 9, SlicePlacement { start: 4, size: 4 })
        .unwrap();
    assert_eq!(gi.profile_name, "3g.40gb", "{l}");
    let ci = b.create_compute_instance(2, gi.id, 3).unwrap();
    assert_eq!(ci.slice_count, 3, "{l}");
    assert!(ci.uuid.starts_with("MIG-"), "{l}: {}", ci.uuid);
    let small: Vec<_> = (0..2)
        .map(|start| {
            let g = b
                .create_gpu_instance(2, 19, SlicePlacement { start, size: 1 })
                .unwrap();
            b.create_compute_instance(2, g.id, 1).unwrap();
            g.id
        })
        .collect();
    let listed = b.gpu_instances(2).unwrap();
    assert_eq!(listed.len(), 3, "{l}");
    let found = listed.iter().find(|g| g.id == gi.id).unwrap();
    assert_eq!(found.compute_instances, vec![ci.clone()], "{l}");

    // GPM per GPU instance on the MIG-enabled H100: every instance has its
    // ratios, in bounds, and no link rates (those are the GPU's).
    let mig_h100 = b.mig_telemetry(2).unwrap();
    let mut ids: Vec<u32> = mig_h100.iter().map(|m| m.gpu_instance_id).collect();
    ids.sort_unstable();
    let mut want: Vec<u32> = listed.iter().map(|g| g.id).collect();
    want.sort_unstable();
    assert_eq!(ids, want, "{l}: one sample per GPU instance");
    for m in &mig_h100 {
        let what = format!("H100 GPU instance {}", m.gpu_instance_id);
        let p = gpm_ratios(l, &what, &m.profiling);
        assert_eq!(
            (p.nvlink_tx_bytes_per_s, p.nvlink_rx_bytes_per_s),
            (None, None),
            "{l}: {what}"
        );
    }
    let (got, want) = at_one_tick(h, |b| b.mig_telemetry(2).unwrap());
    assert_same_mig(l, got, want);

    // Errors typed like NVML's.
    assert_eq!(
        kind(
            l,
            b.create_gpu_instance(2, 5, SlicePlacement { start: 0, size: 4 })
        ),
        "insufficient_resources",
        "{l}: 4g@0 overlaps 1g@0"
    );
    assert_eq!(
        kind(
            l,
            b.create_gpu_instance(2, 9, SlicePlacement { start: 4, size: 4 })
        ),
        "insufficient_resources",
        "{l}: same place twice"
    );
    assert_eq!(
        kind(
            l,
            b.create_gpu_instance(2, 14, SlicePlacement { start: 1, size: 2 })
        ),
        "invalid_argument",
        "{l}: 2g cannot start at 1"
    );
    assert_eq!(
        kind(
            l,
            b.create_gpu_instance(2, 99, SlicePlacement { start: 0, size: 1 })
        ),
        "invalid_argument",
        "{l}: unknown profile"
    );
    assert_eq!(
        kind(
            l,
            b.create_gpu_instance(0, 19, SlicePlacement { start: 0, size: 1 })
        ),
        "not_supported",
        "{l}: MIG off"
    );
    assert_eq!(
        kind(l, b.create_compute_instance(2, gi.id, 5)),
        "invalid_argument",
        "{l}"
    );
    assert_eq!(
        kind(l, b.create_compute_instance(2, small[0], 1)),
        "insufficient_resources",
        "{l}: 1g instance already has its compute instance"
    );
    assert_eq!(kind(l, b.destroy_gpu_instance(2, gi.id)), "in_use", "{l}");
    assert_eq!(kind(l, b.destroy_gpu_instance(2, 42)), "not_found", "{l}");
    assert_eq!(
        kind(l, b.destroy_compute_instance(2, gi.id, 7)),
        "not_found",
        "{l}"
    );
    assert_eq!(kind(l, b.mig_mode(3)), "not_supported", "{l}");
    assert_eq!(kind(l, b.gpu_info(99)), "not_found", "{l}");
    assert_eq!(
        kind(l, b.set_mig_mode(1, false)),
        "in_use",
        "{l}: instances exist"
    );

    // Tear down what was created.
    b.destroy_compute_instance(2, gi.id, ci.id).unwrap();
    b.destroy_gpu_instance(2, gi.id).unwrap();
    for id in small {
        b.destroy_compute_instance(2, id, 0).unwrap();
        b.destroy_gpu_instance(2, id).unwrap();
    }
    assert!(b.gpu_instances(2).unwrap().is_empty(), "{l}");

    // MIG mode.
    assert_eq!(
        b.set_mig_mode(0, true).unwrap(),
        MigModeChange::Applied,
        "{l}"
    );
    assert!(b.mig_mode(0).unwrap().current, "{l}");
    assert_eq!(
        b.set_mig_mode(0, false).unwrap(),
        MigModeChange::Applied,
        "{l}"
    );
    assert!(!b.mig_mode(0).unwrap().current, "{l}");

    // Telemetry: bounded and consistent.
    for gpu in 0..4 {
        let t = b.gpu_telemetry(gpu).unwrap();
        assert_eq!(t.gpu, gpu, "{l}");
        in_range(l, "SM clock", &t.sm_clock_mhz, 100, 3_000);
        in_range(l, "memory clock", &t.mem_clock_mhz, 100, 12_000);
        in_range(l, "GPU temperature", &t.gpu_temp_c, 15, 110);
        in_range(l, "memory temperature", &t.memory_temp_c, 15, 120);
        in_range(l, "power", &t.power_usage_mw, 1_000, 1_200_000);
        in_range(l, "GPU utilisation", &t.gpu_util_pct, 0, 100);
        in_range(l, "memory utilisation", &t.mem_copy_util_pct, 0, 100);
        in_range(l, "encoder", &t.enc_util_pct, 0, 100);
        in_range(l, "decoder", &t.dec_util_pct, 0, 100);
        if let Some(p) = t.profiling.value() {
            for (name, v) in p.ratios() {
                if let Some(v) = v {
                    assert!((0.0..=1.0).contains(&v), "{l}: {name} = {v}");
                }
            }
        }
        assert!(
            t.sm_clock_mhz.value().is_some(),
            "{l}: SM clock is always there"
        );
        let fb = t.fb_memory.value().copied().unwrap();
        assert!(fb.is_consistent(), "{l}: {fb:?}");
        assert_eq!(fb.total, inv.gpus[gpu as usize].memory_total_bytes, "{l}");
        let e1 = *t.total_energy_mj.value().unwrap();
        let e2 = *b
            .gpu_telemetry(gpu)
            .unwrap()
            .total_energy_mj
            .value()
            .unwrap();
        assert!(e2 >= e1, "{l}: energy went down");
    }
    let l4 = b.gpu_telemetry(3).unwrap();
    assert!(
        l4.memory_temp_c.is_not_supported(),
        "{l}: L4 has no HBM sensor"
    );
    assert!(l4.remapped_rows.is_not_supported(), "{l}");
    let mig = b.mig_telemetry(1).unwrap();
    assert_eq!(mig.len(), 2, "{l}");
    let fb = mig[0].fb_memory.value().copied().unwrap();
    assert!(fb.is_consistent(), "{l}");
    assert_eq!(fb.total, 19_968 << 20, "{l}: 3g.20gb memory");
    assert_eq!(kind(l, b.mig_telemetry(0)), "not_supported", "{l}");
    for m in &mig {
        assert!(
            m.profiling.is_not_supported(),
            "{l}: A100 GPU instance {} has no GPM: {:?}",
            m.gpu_instance_id,
            m.profiling
        );
    }
    extended_telemetry(h);

    // Health events: an Xid on demand, then a GPU falling off the bus.
    let mut events = b.health_events().unwrap();
    h.injector
        .inject(FaultSpec {
            gpu: Some(3),
            at_ms: 0,
            fault: Fault::Xid {
                xid: 48,
                gpu_instance: None,
            },
        })
        .unwrap();
    let e = next_event(l, &mut events);
    assert_eq!(
        (e.gpu, &e.kind),
        (3, &HealthEventKind::Xid { xid: 48 }),
        "{l}"
    );
    assert_eq!(e.uuid, inv.gpus[3].uuid, "{l}");
    assert_eq!(e.gpu_instance_id, None, "{l}");
    assert_eq!(
        b.gpu_telemetry(3).unwrap().last_xid,
        Reading::Value(48),
        "{l}"
    );
    h.injector
        .inject(FaultSpec {
            gpu: Some(1),
            at_ms: 0,
            fault: Fault::Xid {
                xid: 94,
                gpu_instance: Some(gis[1].id),
            },
        })
        .unwrap();
    let e = next_event(l, &mut events);
    assert_eq!((e.gpu, e.gpu_instance_id), (1, Some(gis[1].id)), "{l}");
    h.injector
        .inject(FaultSpec {
            gpu: Some(0),
            at_ms: 0,
            fault: Fault::FallOffBus,
        })
        .unwrap();
    let e = next_event(l, &mut events);
    assert_eq!(
        (e.gpu, &e.kind),
        (0, &HealthEventKind::Xid { xid: 79 }),
        "{l}"
    );
    let e = next_event(l, &mut events);
    assert_eq!((e.gpu, &e.kind), (0, &HealthEventKind::GpuLost), "{l}");
    assert_eq!(kind(l, b.gpu_info(0)), "gpu_lost", "{l}");
    assert_eq!(kind(l, b.gpu_telemetry(0)), "gpu_lost", "{l}");
    let inv = b.inventory().unwrap();
    assert_eq!(
        inv.gpus.len(),
        3,
        "{l}: one lost GPU does not hide the others"
    );
    assert_eq!(inv.errors[0].index, 0, "{l}");
    assert_eq!(inv.errors[0].error.kind(), "gpu_lost", "{l}");
}

fn write_fleet(dir: &Path) -> PathBuf {
    let path = dir.join("contract.yaml");
    std::fs::write(&path, FLEET).unwrap();
    path
}

#[test]
fn contract_holds_for_simulated_and_nvml_over_standin() {
    let dir = tempfile::tempdir().unwrap();
    let fleet = write_fleet(dir.path());
    let spec = SimNodeSpec::from_fleet_file(&fleet, None).unwrap();

    // 1. Simulated, directly.
    let sim = SimulatedBackend::new(&spec).unwrap();
    contract(&Harness {
        label: "simulated",
        backend: Arc::new(sim.clone()),
        injector: sim,
    });

    // 2. NVML over the stand-in, sharing a state file with the injector.
    let lib = gpu_stack_nvml::testing::standin_lib();
    let state = dir.path().join("state.json");
    // SAFETY: this is the only test in this binary that touches the environment,
    // and nothing else runs concurrently in it.
    unsafe {
        std::env::set_var("GPU_STACK_STANDIN_FLEET", &fleet);
        std::env::set_var("GPU_STACK_STANDIN_NODE", "contract-0");
        std::env::set_var("GPU_STACK_STANDIN_STATE", &state);
    }
    let nvml = NvmlBackend::open(Some(&lib)).unwrap();
    let injector = SimulatedBackend::with_state_file(&spec, &state).unwrap();
    // Before anything changes, both backends describe the node identically.
    let fresh = SimulatedBackend::new(&spec).unwrap();
    assert_eq!(
        serde_json::to_string_pretty(&node_snapshot(&nvml).unwrap()).unwrap(),
        serde_json::to_string_pretty(&node_snapshot(&fresh).unwrap()).unwrap(),
        "gpus -o json differs between backends"
    );
    contract(&Harness {
        label: "nvml-over-standin",
        backend: Arc::new(nvml),
        injector,
    });

    // A library that is not there is a clear, typed error.
    let err = NvmlBackend::open(Some(Path::new("/nonexistent/libnvidia-ml.so.1"))).unwrap_err();
    assert_eq!(err.kind(), "library_unavailable");
    assert!(
        err.to_string().contains("/nonexistent/libnvidia-ml.so.1"),
        "{err}"
    );
}
