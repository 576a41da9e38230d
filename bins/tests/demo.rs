//! `gpu-stack demo` as a process, end to end: with no flags it narrates the
//! operator and the node agents, the same way on every run; `-o json` shows
//! the final state: GPU nodes labelled by the operator and GPU feature
//! discovery, CPU nodes untouched, one driver DaemonSet per OS pool, and the
//! MIG change on the H100 node finished with the new resources advertised.
//! Every shipped fleet runs, with every GPU node in a driver pool.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn demo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpu-stack"))
        .arg("demo")
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("gpu-stack runs")
}

fn stdout_ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "demo failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).expect("utf-8 output")
}

fn json(args: &[&str]) -> Value {
    let mut all = vec!["-o", "json"];
    all.extend_from_slice(args);
    serde_json::from_str(&stdout_ok(&demo(&all))).expect("valid JSON")
}

fn node<'a>(state: &'a Value, name: &str) -> &'a Value {
    state["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .find(|n| n["name"] == name)
        .unwrap_or_else(|| panic!("node {name} in {}", state["nodes"]))
}

fn fleets() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/fleets");
    let mut out: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("examples/fleets")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    out.sort();
    assert!(out.len() >= 4, "{out:?}");
    out
}

#[test]
fn narration_shows_operator_agents_and_mig_change_and_is_deterministic() {
    let first = stdout_ok(&demo(&[]));
    let second = stdout_ok(&demo(&[]));
    assert_eq!(first, second, "the demo's output changed between runs");

    for expected in [
        "== Step 1: the operator starts",
        "the node agents run on each GPU node",
        "gpu-feature-discovery  ",
        "capacity/allocatable: nvidia.com/gpu=8",
        "DCGM_FI_DEV_GPU_TEMP{gpu=\"0\"",
        "a user labels hgx-h100-0 nvidia.com/mig.config=all-1g.10gb",
        "device-plugin=paused-for-mig-change",
        "mig.config.state=success; ",
        "GPU layout: 8 GPU(s) MIG on, 7x 1g.10gb",
        "nvidia.com/mig-1g.10gb.count=56",
        "device-plugin advertises: nvidia.com/gpu=0 nvidia.com/mig-1g.10gb=56",
        "GPU_I_PROFILE=\"1g.10gb\"",
        "a node joins: h200-0",
        "the exporter runs on 0 of 5 GPU nodes",
        "0 cluster writes",
    ] {
        assert!(
            first.contains(expected),
            "missing {expected:?} in:\n{first}"
        );
    }
    // The pause comes before the restore.
    let pause = first.find("paused-for-mig-change").unwrap();
    let success = first.find("mig.config.state=success; ").unwrap();
    assert!(pause < success);
}

#[test]
fn json_final_state_has_agents_results() {
    let state = json(&[]);
    assert_eq!(state, json(&[]), "the JSON changed between runs");

    // GPU nodes: operator labels, GFD labels, device plugin capacity.
    for (name, gpus) in [
        ("dgx-a100-0", "8"),
        ("l4-rhel-0", "2"),
        ("l4-rhel-1", "1"),
        ("h200-0", "8"),
    ] {
        let n = node(&state, name);
        assert_eq!(n["labels"]["nvidia.com/gpu.present"], "true", "{name}");
        assert_eq!(n["labels"]["nvidia.com/gpu.count"], gpus, "{name}");
        assert!(n["labels"]["nvidia.com/gpu.product"].is_string(), "{name}");
        assert_eq!(n["capacity"]["nvidia.com/gpu"], gpus, "{name}");
        assert_eq!(n["allocatable"]["nvidia.com/gpu"], gpus, "{name}");
        assert_eq!(n["agents"]["devicePlugin"], true, "{name}");
        // The exporter was disabled in a later step.
        assert_eq!(n["agents"]["dcgmExporter"], false, "{name}");
    }
    assert_eq!(
        node(&state, "dgx-a100-0")["labels"]["nvidia.com/mig.config.state"],
        "success"
    );

    // CPU nodes: no nvidia.com labels, no capacity, no agents.
    for name in ["cpu-0", "cpu-1"] {
        let n = node(&state, name);
        let labels = n["labels"].as_object().unwrap();
        assert!(
            labels.keys().all(|k| !k.starts_with("nvidia.com/")),
            "{name}: {labels:?}"
        );
        assert!(n["capacity"].is_null() && n["agents"].is_null(), "{name}");
    }

    // DaemonSets: one driver DaemonSet per OS pool, the agents' DaemonSets.
    let daemonsets: Vec<&str> = state["objects"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["kind"] == "DaemonSet")
        .map(|o| o["metadata"]["name"].as_str().unwrap())
        .collect();
    for ds in [
        "nvidia-driver-daemonset-rhel9",
        "nvidia-driver-daemonset-ubuntu22.04",
        "nvidia-driver-daemonset-ubuntu24.04",
        "nvidia-device-plugin-daemonset",
        "gpu-feature-discovery",
        "nvidia-mig-manager",
    ] {
        assert!(daemonsets.contains(&ds), "{ds} not in {daemonsets:?}");
    }
    assert!(!daemonsets.contains(&"nvidia-dcgm-exporter"));

    // The MIG change reached success with the new resources.
    let mig = &state["migChange"];
    assert_eq!(mig["node"], "hgx-h100-0");
    assert_eq!(mig["config"], "all-1g.10gb");
    assert_eq!(mig["migManager"]["state"], "success");
    let writes = mig["migManager"]["writes"].as_array().unwrap();
    assert_eq!(
        writes[0]["set"]["nvidia.com/gpu.deploy.device-plugin"],
        "paused-for-mig-change"
    );
    assert_eq!(
        writes.last().unwrap()["set"]["nvidia.com/gpu.deploy.device-plugin"],
        "true"
    );
    assert_eq!(mig["resources"]["nvidia.com/mig-1g.10gb"], 56);
    let samples = mig["exporterSample"].as_array().unwrap();
    assert!(!samples.is_empty());
    assert!(
        samples
            .iter()
            .all(|l| l.as_str().unwrap().contains("GPU_I_PROFILE=\"1g.10gb\""))
    );
    let h100 = node(&state, "hgx-h100-0");
    assert_eq!(h100["labels"]["nvidia.com/mig.config"], "all-1g.10gb");
    assert_eq!(h100["labels"]["nvidia.com/mig.config.state"], "success");
    assert_eq!(h100["labels"]["nvidia.com/mig.strategy"], "mixed");
    assert_eq!(h100["labels"]["nvidia.com/mig-1g.10gb.count"], "56");
    assert_eq!(
        h100["labels"]["nvidia.com/gpu.deploy.device-plugin"],
        "true"
    );
    assert_eq!(h100["capacity"]["nvidia.com/mig-1g.10gb"], "56");
    assert_eq!(h100["capacity"]["nvidia.com/gpu"], "0");
    let layout = h100["migLayout"].as_array().unwrap();
    assert_eq!(layout.len(), 8);
    for g in layout {
        assert_eq!(g["migEnabled"], true);
        assert_eq!(g["migDevices"].as_array().unwrap().len(), 7, "{g}");
    }
}

#[test]
fn every_shipped_fleet_runs_with_every_gpu_node_in_a_driver_pool() {
    for fleet in fleets() {
        let f = fleet.to_str().unwrap();
        let state = json(&["--fleet", f]);
        let text = state.to_string();
        assert!(!text.contains("DriverPoolUnknown"), "{f}: {text}");
        for n in state["nodes"].as_array().unwrap() {
            if n["labels"]["nvidia.com/gpu.present"] == "true" {
                assert!(
                    n["labels"]["nvidia.com/gpu.product"].is_string(),
                    "{f}: {n}"
                );
            }
        }
        let mig = &state["migChange"];
        if !mig.is_null() {
            assert_eq!(mig["migManager"]["state"], "success", "{f}: {mig}");
        }
    }
}

#[test]
fn unreadable_or_invalid_fleet_is_refused_with_a_message() {
    let out = demo(&["--fleet", "/nonexistent/fleet.yaml"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/fleet.yaml"), "{err}");
    assert!(out.stdout.is_empty());

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "nodes:\n  - name: g\n    gpus: [{ model: NoSuchGPU, count: 1 }]\n",
    )
    .unwrap();
    let out = demo(&["--fleet", bad.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.yaml"), "{err}");
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn the_node_agent_mode_keeps_every_node_result() {
    let separate = json(&[]);
    let combined = json(&["--node-agent"]);
    let daemonsets = |state: &Value| -> Vec<String> {
        state["objects"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|o| o["kind"] == "DaemonSet")
            .map(|o| o["metadata"]["name"].as_str().unwrap().to_string())
            .collect()
    };
    let names = daemonsets(&combined);
    assert!(
        names.contains(&"gpu-stack-node-agent".to_string()),
        "{names:?}"
    );
    for hosted in [
        "nvidia-device-plugin-daemonset",
        "gpu-feature-discovery",
        "nvidia-mig-manager",
        "nvidia-dcgm-exporter",
    ] {
        assert!(
            !names.contains(&hosted.to_string()),
            "{hosted} in {names:?}"
        );
    }
    // Every node ends with the same labels, capacity, agents and MIG layout,
    // and the MIG change went the same way.
    assert_eq!(separate["nodes"], combined["nodes"]);
    assert_eq!(separate["migChange"], combined["migChange"]);
}
