//! Behaviour specific to the simulated backend: fleet files, shared state files,
//! faults, pending MIG mode changes and deterministic telemetry.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use gpu_stack_core::backend::{
    BackendError, CallClass, Fault, FaultError, FaultSpec, GpuBackend, HealthEventKind,
    MigModeChange, SlicePlacement,
};
use gpu_stack_nvml::{SimClock, SimNodeSpec, SimulatedBackend};

fn fleet(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/fleets")
        .join(name)
}

#[test]
fn example_fleets_load_with_expected_gpus() {
    for (file, node, product, count) in [
        ("dgx-a100.yaml", "dgx-a100-0", "NVIDIA A100-SXM4-40GB", 8),
        ("hgx-h100.yaml", "hgx-h100-0", "NVIDIA H100 80GB HBM3", 8),
        ("h200.yaml", "h200-0", "NVIDIA H200", 8),
    ] {
        let spec = SimNodeSpec::from_fleet_file(&fleet(file), None).unwrap();
        assert_eq!(spec.node, node);
        let b = SimulatedBackend::new(&spec).unwrap();
        let inv = b.inventory().unwrap();
        assert_eq!(inv.gpus.len(), count, "{file}");
        assert!(inv.errors.is_empty());
        assert!(inv.gpus.iter().all(|g| g.name == product), "{file}");
        let uuids: std::collections::BTreeSet<_> = inv.gpus.iter().map(|g| &g.uuid).collect();
        assert_eq!(uuids.len(), count);
    }
    let a100 = SimulatedBackend::new(
        &SimNodeSpec::from_fleet_file(&fleet("dgx-a100.yaml"), None).unwrap(),
    )
    .unwrap();
    let gis = a100.gpu_instances(6).unwrap();
    let names: Vec<_> = gis.iter().map(|g| g.profile_name.as_str()).collect();
    assert_eq!(names, ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"]);
    assert!(gis.iter().all(|g| g.compute_instances.len() == 1));
    assert!(
        gis.iter()
            .all(|g| g.compute_instances[0].uuid.starts_with("MIG-"))
    );
}

#[test]
fn unknown_node_and_ambiguous_fleet_are_clear_errors() {
    let err = SimNodeSpec::from_fleet_file(&fleet("dgx-a100.yaml"), Some("nope")).unwrap_err();
    assert!(err.to_string().contains("dgx-a100-0"), "{err}");
    let two = gpu_stack_core::fleet::Fleet::from_yaml(
        "nodes:\n  - {name: a, gpus: [{model: A100-SXM4-40GB}]}\n  - {name: b, gpus: [{model: A100-SXM4-40GB}]}\n",
    )
    .unwrap();
    let err = SimNodeSpec::from_fleet(&two, None).unwrap_err();
    assert!(err.to_string().contains("--node"), "{err}");
    let err =
        SimNodeSpec::from_fleet_file(&PathBuf::from("/nonexistent/f.yaml"), None).unwrap_err();
    assert!(err.to_string().contains("/nonexistent/f.yaml"), "{err}");
}

#[test]
fn state_file_is_shared_between_backends_and_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("node.json");
    let spec = SimNodeSpec::uniform("n0", "A100-SXM4-40GB", 2);
    let a = SimulatedBackend::with_state_file(&spec, &state).unwrap();
    let b = SimulatedBackend::with_state_file(&spec, &state).unwrap();
    a.set_mig_mode(0, true).unwrap();
    let gi = a
        .create_gpu_instance(0, 9, SlicePlacement { start: 4, size: 4 })
        .unwrap();
    a.create_compute_instance(0, gi.id, 3).unwrap();
    // b sees what a did.
    let seen = b.gpu_instances(0).unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].profile_name, "3g.20gb");
    drop((a, b));
    // A later "process" joins the same state.
    let c = SimulatedBackend::with_state_file(&spec, &state).unwrap();
    assert_eq!(c.gpu_instances(0).unwrap().len(), 1);
    // A state file for another node is refused.
    let other = SimNodeSpec::uniform("n1", "A100-SXM4-40GB", 2);
    let err = SimulatedBackend::with_state_file(&other, &state).unwrap_err();
    assert!(err.to_string().contains("n0"), "{err}");
}

#[test]
fn concurrent_writers_on_one_state_file_never_lose_updates() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("node.json");
    let spec = SimNodeSpec::uniform("n0", "A100-SXM4-40GB", 1);
    SimulatedBackend::with_state_file(&spec, &state)
        .unwrap()
        .set_mig_mode(0, true)
        .unwrap();
    // Seven writers, each with its own open file, race to create one 1g
    // instance each at its own placement.
    let handles: Vec<_> = (0..7u32)
        .map(|start| {
            let spec = spec.clone();
            let state = state.clone();
            std::thread::spawn(move || {
                let b = SimulatedBackend::with_state_file(&spec, &state).unwrap();
                b.create_gpu_instance(0, 19, SlicePlacement { start, size: 1 })
                    .unwrap()
            })
        })
        .collect();
    let mut ids: Vec<u32> = handles.into_iter().map(|h| h.join().unwrap().id).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 7);
    let b = SimulatedBackend::with_state_file(&spec, &state).unwrap();
    assert_eq!(b.gpu_instances(0).unwrap().len(), 7);
    // The GPU is full now.
    let err = b
        .create_gpu_instance(0, 19, SlicePlacement { start: 0, size: 1 })
        .unwrap_err();
    assert_eq!(err.kind(), "insufficient_resources");
}

#[test]
fn state_file_is_replaced_never_rewritten_in_place_and_locked_beside_it() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("node.json");
    let spec = SimNodeSpec::uniform("n0", "A100-SXM4-40GB", 1);
    let b = SimulatedBackend::with_state_file(&spec, &state).unwrap();
    let lock = gpu_stack_nvml::sim::state::lock_path(&state);
    assert_eq!(lock, dir.path().join("node.json.lock"));
    assert!(lock.exists());
    // A reader holding the old file keeps its complete old content after a write.
    let mut old = std::fs::File::open(&state).unwrap();
    b.set_mig_mode(0, true).unwrap();
    let mut text = String::new();
    std::io::Read::read_to_string(&mut old, &mut text).unwrap();
    let before: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(before["gpus"][0]["mig_current"], false);
    assert!(b.mig_mode(0).unwrap().current);
    // No temporary files are left beside it.
    let mut names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["node.json", "node.json.lock"]);
}

#[test]
fn an_empty_or_corrupt_state_file_is_refused_not_reset() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("node.json");
    let spec = SimNodeSpec::uniform("n0", "A100-SXM4-40GB", 1);
    for content in ["", "  \n", "{\"version\": 1, \"node\": \"n0\""] {
        std::fs::write(&state, content).unwrap();
        let err = SimulatedBackend::with_state_file(&spec, &state).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("node.json"), "{msg}");
        assert!(msg.contains("delete it"), "{msg}");
        // Left as it was, for a person to look at.
        assert_eq!(std::fs::read_to_string(&state).unwrap(), content);
    }
    // A huge corrupt file is quoted only in part.
    std::fs::write(&state, "x".repeat(100_000)).unwrap();
    let msg = SimulatedBackend::with_state_file(&spec, &state)
        .unwrap_err()
        .to_string();
    assert!(msg.len() < 2_000, "{} bytes", msg.len());
    assert!(msg.contains("more characters"), "{msg}");
    // A missing file starts from the spec.
    std::fs::remove_file(&state).unwrap();
    SimulatedBackend::with_state_file(&spec, &state).unwrap();
    assert!(state.exists());
}

#[test]
fn a_state_file_with_duplicate_ids_is_refused_on_load() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("node.json");
    let spec = SimNodeSpec::uniform("n0", "A100-SXM4-40GB", 2);
    let b = SimulatedBackend::with_state_file(&spec, &state).unwrap();
    b.set_mig_mode(0, true).unwrap();
    let gi = b
        .create_gpu_instance(0, 19, SlicePlacement { start: 0, size: 1 })
        .unwrap();
    b.create_compute_instance(0, gi.id, 1).unwrap();
    drop(b);
    let good: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    type Break = fn(&mut serde_json::Value);
    let cases: [(&str, Break); 4] = [
        ("UUID", |v| {
            v["gpus"][1]["uuid"] = v["gpus"][0]["uuid"].clone();
        }),
        ("index", |v| {
            v["gpus"][1]["index"] = 0.into();
        }),
        ("two GPU instances with id", |v| {
            let gi = v["gpus"][0]["gpu_instances"][0].clone();
            v["gpus"][0]["gpu_instances"]
                .as_array_mut()
                .unwrap()
                .push(gi);
        }),
        ("two compute instances with id", |v| {
            let ci = v["gpus"][0]["gpu_instances"][0]["compute_instances"][0].clone();
            let mut ci2 = ci.clone();
            ci2["uuid"] = "MIG-other".into();
            let list = v["gpus"][0]["gpu_instances"][0]["compute_instances"]
                .as_array_mut()
                .unwrap();
            list.push(ci2);
        }),
    ];
    for (needle, break_it) in cases {
        let mut v = good.clone();
        break_it(&mut v);
        std::fs::write(&state, serde_json::to_vec(&v).unwrap()).unwrap();
        let msg = SimulatedBackend::with_state_file(&spec, &state)
            .unwrap_err()
            .to_string();
        assert!(msg.contains(needle), "{needle}: {msg}");
        assert!(
            msg.contains("node.json") && msg.contains("delete it"),
            "{msg}"
        );
    }
}

#[test]
fn mig_mode_change_can_need_a_reset() {
    let mut spec = SimNodeSpec::uniform("n0", "H100-SXM5-80GB", 1);
    spec.mig_change_needs_reset = true;
    let b = SimulatedBackend::new(&spec).unwrap();
    assert_eq!(
        b.set_mig_mode(0, true).unwrap(),
        MigModeChange::PendingReset
    );
    let mode = b.mig_mode(0).unwrap();
    assert!(!mode.current && mode.pending && mode.reset_pending());
    // Instances cannot be created until the mode is in force.
    let err = b
        .create_gpu_instance(0, 0, SlicePlacement { start: 0, size: 8 })
        .unwrap_err();
    assert_eq!(err.kind(), "not_supported");
    b.reset_gpu(0).unwrap();
    assert!(b.mig_mode(0).unwrap().current);
    b.create_gpu_instance(0, 0, SlicePlacement { start: 0, size: 8 })
        .unwrap();
}

#[test]
fn in_use_instances_block_destroy_and_mode_change() {
    let spec = SimNodeSpec::from_fleet(
        &gpu_stack_core::fleet::Fleet::from_yaml(
            "nodes:\n  - name: n0\n    gpus:\n      - model: A100-SXM4-40GB\n        mig: {enabled: true, instances: [\"3g.20gb@4\", \"3g.20gb@0\"], in-use: [\"3g.20gb@4\"]}\n",
        )
        .unwrap(),
        None,
    )
    .unwrap();
    let b = SimulatedBackend::new(&spec).unwrap();
    let gis = b.gpu_instances(0).unwrap();
    let busy = gis.iter().find(|g| g.placement.start == 4).unwrap();
    let idle = gis.iter().find(|g| g.placement.start == 0).unwrap();
    let err = b.destroy_compute_instance(0, busy.id, 0).unwrap_err();
    assert_eq!(err.kind(), "in_use");
    b.destroy_compute_instance(0, idle.id, 0).unwrap();
    b.destroy_gpu_instance(0, idle.id).unwrap();
    assert_eq!(b.set_mig_mode(0, false).unwrap_err().kind(), "in_use");
}

#[test]
fn scheduled_xid_and_fall_off_bus_fire_at_their_time() {
    let mut spec = SimNodeSpec::uniform("n0", "A100-SXM4-40GB", 4);
    spec.faults = vec![
        FaultSpec {
            gpu: Some(1),
            at_ms: 1_000,
            fault: Fault::Xid {
                xid: 48,
                gpu_instance: None,
            },
        },
        FaultSpec {
            gpu: Some(2),
            at_ms: 5_000,
            fault: Fault::FallOffBus,
        },
    ];
    let (clock, now) = SimClock::manual();
    let b = SimulatedBackend::with_clock(&spec, clock).unwrap();
    let mut events = b.health_events().unwrap();
    assert_eq!(events.wait(Duration::from_millis(1)).unwrap(), None);
    now.store(1_000, Ordering::SeqCst);
    let e = events.wait(Duration::from_millis(200)).unwrap().unwrap();
    assert_eq!((e.gpu, &e.kind), (1, &HealthEventKind::Xid { xid: 48 }));
    assert_eq!(b.gpu_telemetry(1).unwrap().last_xid.value(), Some(&48));
    assert!(b.gpu_info(2).is_ok());
    now.store(5_000, Ordering::SeqCst);
    let e = events.wait(Duration::from_millis(200)).unwrap().unwrap();
    assert_eq!((e.gpu, &e.kind), (2, &HealthEventKind::Xid { xid: 79 }));
    let e = events.wait(Duration::from_millis(200)).unwrap().unwrap();
    assert_eq!((e.gpu, &e.kind), (2, &HealthEventKind::GpuLost));
    assert_eq!(b.gpu_info(2).unwrap_err(), BackendError::GpuLost { gpu: 2 });
    // One lost GPU does not hide the others.
    let inv = b.inventory().unwrap();
    assert_eq!(inv.gpus.len(), 3);
    assert_eq!(inv.errors.len(), 1);
    assert_eq!(inv.errors[0].index, 2);
    // A reset brings it back.
    b.reset_gpu(2).unwrap();
    assert!(b.gpu_info(2).is_ok());
}

#[test]
fn runtime_faults_fail_and_slow_calls() {
    let b = SimulatedBackend::new(&SimNodeSpec::uniform("n0", "H100-SXM5-80GB", 2)).unwrap();
    b.inject(FaultSpec {
        gpu: Some(0),
        at_ms: 0,
        fault: Fault::FailCalls {
            calls: CallClass::Telemetry,
            error: FaultError::Unknown,
        },
    })
    .unwrap();
    assert_eq!(b.gpu_telemetry(0).unwrap_err().kind(), "other");
    assert!(b.gpu_info(0).is_ok(), "only telemetry fails");
    assert!(b.gpu_telemetry(1).is_ok(), "only GPU 0 fails");
    b.inject(FaultSpec {
        gpu: Some(1),
        at_ms: 0,
        fault: Fault::SlowCalls {
            calls: CallClass::Inventory,
            delay_ms: 30,
        },
    })
    .unwrap();
    let t = std::time::Instant::now();
    b.gpu_info(1).unwrap();
    assert!(t.elapsed() >= Duration::from_millis(30));
    let err = b
        .inject(FaultSpec {
            gpu: Some(9),
            at_ms: 0,
            fault: Fault::FallOffBus,
        })
        .unwrap_err();
    assert_eq!(err.kind(), "not_found");
    // Xid on demand, attributed to a MIG instance.
    let mut events = b.health_events().unwrap();
    b.inject(FaultSpec {
        gpu: Some(1),
        at_ms: 0,
        fault: Fault::Xid {
            xid: 94,
            gpu_instance: Some(1),
        },
    })
    .unwrap();
    let e = events.wait(Duration::from_millis(100)).unwrap().unwrap();
    assert_eq!(e.gpu_instance_id, Some(1));
}

#[test]
fn telemetry_is_deterministic_for_a_seed_and_counters_are_monotonic() {
    let spec = SimNodeSpec::uniform("n0", "H200-SXM-141GB", 2);
    let a = SimulatedBackend::new(&spec).unwrap();
    let b = SimulatedBackend::new(&spec).unwrap();
    let mut last_energy = 0;
    for tick in [0u64, 1, 2, 63, 64, 65, 1000, 100_000] {
        let x = a.gpu_telemetry_at(1, tick).unwrap();
        assert_eq!(x, b.gpu_telemetry_at(1, tick).unwrap());
        let e = *x.total_energy_mj.value().unwrap();
        assert!(e >= last_energy);
        last_energy = e;
        let fb = x.fb_memory.value().unwrap();
        assert!(fb.is_consistent());
        assert!(*x.gpu_util_pct.value().unwrap() <= 100);
    }
    let mut other = spec.clone();
    other.telemetry.seed = 7;
    let c = SimulatedBackend::new(&other).unwrap();
    let differs = (0..20).any(|t| {
        a.gpu_telemetry_at(0, t).unwrap().gpu_util_pct
            != c.gpu_telemetry_at(0, t).unwrap().gpu_util_pct
    });
    assert!(differs, "another seed gives other samples");
}
