//! `gpu-feature-discovery --oneshot` as a process over simulated GPUs: the
//! labels it prints (`-o json`, `-o nfd`) and writes (`--output-file`) are the
//! core golden label sets (DGX A100 with MIG off, `all-1g.5gb` under `single`
//! and `mixed`, HGX H100, time-slicing on T4s) and, for the shipped DGX A100
//! fleet, exactly what `gpu_stack_core::gfd::labels` computes for the same
//! node. Bad input exits non-zero with a message and writes nothing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use gpu_stack_core::deviceplugin::{Overrides, Settings};
use gpu_stack_core::gfd::{GfdContext, feature_file, labels};
use gpu_stack_k8s::deviceplugin::node::read_node_gpus;
use gpu_stack_nvml::{SimNodeSpec, SimulatedBackend};

type Labels = BTreeMap<String, String>;

/// Environment variables the binary reads; cleared so the caller's shell
/// cannot change what the test runs.
const ENV: [&str; 11] = [
    "NODE_NAME",
    "CONFIG_FILE",
    "MIG_STRATEGY",
    "GFD_ONESHOT",
    "GFD_NO_TIMESTAMP",
    "GFD_SLEEP_INTERVAL",
    "GFD_OUTPUT_FILE",
    "GFD_MACHINE_TYPE_FILE",
    "GPU_STACK_BACKEND",
    "GPU_STACK_FLEET",
    "GPU_STACK_SIM_STATE",
];

fn gfd(fleet: &Path, args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpu-feature-discovery"));
    for k in ENV {
        c.env_remove(k);
    }
    c.env("RUST_LOG", "warn")
        .env("RUST_BACKTRACE", "0")
        .args(["--backend", "simulated", "--oneshot", "--fleet"])
        .arg(fleet)
        .args(args)
        .output()
        .unwrap()
}

fn json_labels(fleet: &Path, args: &[&str]) -> Labels {
    let out = gfd(fleet, &[&["-o", "json"], args].concat());
    assert!(
        out.status.success(),
        "gpu-feature-discovery failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not a JSON label map ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// A one-node fleet file: `count` GPUs of `model`, optionally MIG-partitioned.
fn fleet(dir: &Path, driver: &str, model: &str, count: u32, mig: Option<&[&str]>) -> PathBuf {
    let mut text = format!(
        "nodes:\n  - name: node-a\n    driver-version: \"{driver}\"\n    gpus:\n      - model: {model}\n        count: {count}\n"
    );
    if let Some(instances) = mig {
        let list: Vec<String> = instances.iter().map(|i| format!("{i:?}")).collect();
        text.push_str(&format!(
            "        mig:\n          enabled: true\n          instances: [{}]\n",
            list.join(", ")
        ));
    }
    let path = dir.join(format!("{model}-{}.yaml", mig.is_some()));
    std::fs::write(&path, text).unwrap();
    path
}

/// Golden labels: the CUDA driver/runtime labels for `driver` and `cuda`, plus `rest`.
fn golden(driver: &str, cuda: &str, rest: &[(&str, &str)]) -> Labels {
    let d: Vec<&str> = driver.split('.').collect();
    let c: Vec<&str> = cuda.split('.').collect();
    [
        ("cuda.driver-version.full", driver),
        ("cuda.driver-version.major", d[0]),
        ("cuda.driver-version.minor", d[1]),
        ("cuda.driver-version.revision", d[2]),
        ("cuda.driver.major", d[0]),
        ("cuda.driver.minor", d[1]),
        ("cuda.driver.rev", d[2]),
        ("cuda.runtime-version.full", cuda),
        ("cuda.runtime-version.major", c[0]),
        ("cuda.runtime-version.minor", c[1]),
        ("cuda.runtime.major", c[0]),
        ("cuda.runtime.minor", c[1]),
    ]
    .into_iter()
    .chain(rest.iter().copied())
    .map(|(k, v)| (format!("nvidia.com/{k}"), v.to_string()))
    .collect()
}

const DRIVER: &str = "550.107.02";
const CUDA: &str = "12.4";
const ALL_1G: [&str; 7] = [
    "1g.5gb@0", "1g.5gb@1", "1g.5gb@2", "1g.5gb@3", "1g.5gb@4", "1g.5gb@5", "1g.5gb@6",
];

#[test]
fn dgx_a100_mig_off_matches_the_golden_labels() {
    let dir = tempfile::tempdir().unwrap();
    let f = fleet(dir.path(), DRIVER, "A100-SXM4-40GB", 8, None);
    let machine = dir.path().join("product_name");
    std::fs::write(&machine, "DGX A100\n").unwrap();
    let machine_arg = machine.display().to_string();
    let got = json_labels(&f, &["--machine-type-file", &machine_arg, "--no-timestamp"]);
    let want = golden(
        DRIVER,
        CUDA,
        &[
            ("gpu.compute.major", "8"),
            ("gpu.compute.minor", "0"),
            ("gpu.count", "8"),
            ("gpu.family", "ampere"),
            ("gpu.machine", "DGX-A100"),
            ("gpu.memory", "40960"),
            ("gpu.product", "NVIDIA-A100-SXM4-40GB"),
            ("gpu.replicas", "1"),
            ("gpu.sharing-strategy", "none"),
            ("mig.capable", "true"),
            ("mps.capable", "false"),
        ],
    );
    assert_eq!(got, want);

    // Without --no-timestamp the run time is labelled too, and nothing else changes.
    let mut stamped = json_labels(&f, &["--machine-type-file", &machine_arg]);
    let stamp = stamped.remove("nvidia.com/gfd.timestamp").unwrap();
    assert!(stamp.parse::<u64>().is_ok_and(|s| s > 0), "{stamp}");
    assert_eq!(stamped, want);
}

#[test]
fn dgx_a100_all_1g_single_and_mixed_match_the_golden_labels() {
    let dir = tempfile::tempdir().unwrap();
    let f = fleet(dir.path(), DRIVER, "A100-SXM4-40GB", 8, Some(&ALL_1G));

    let single = json_labels(&f, &["--mig-strategy", "single", "--no-timestamp"]);
    let want = golden(
        DRIVER,
        CUDA,
        &[
            ("gpu.compute.major", "8"),
            ("gpu.compute.minor", "0"),
            ("gpu.count", "56"),
            ("gpu.engines.copy", "1"),
            ("gpu.engines.decoder", "0"),
            ("gpu.engines.encoder", "0"),
            ("gpu.engines.jpeg", "0"),
            ("gpu.engines.ofa", "0"),
            ("gpu.family", "ampere"),
            ("gpu.memory", "4864"),
            ("gpu.multiprocessors", "14"),
            ("gpu.product", "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"),
            ("gpu.replicas", "1"),
            ("gpu.sharing-strategy", "none"),
            ("gpu.slices.ci", "1"),
            ("gpu.slices.gi", "1"),
            ("mig.capable", "true"),
            ("mig.strategy", "single"),
            ("mps.capable", "false"),
        ],
    );
    assert_eq!(single, want);

    let mixed = json_labels(&f, &["--mig-strategy", "mixed", "--no-timestamp"]);
    let want = golden(
        DRIVER,
        CUDA,
        &[
            ("gpu.compute.major", "8"),
            ("gpu.compute.minor", "0"),
            ("gpu.count", "8"),
            ("gpu.family", "ampere"),
            ("gpu.memory", "40960"),
            ("gpu.product", "NVIDIA-A100-SXM4-40GB"),
            ("gpu.replicas", "1"),
            ("gpu.sharing-strategy", "none"),
            ("mig-1g.5gb.count", "56"),
            ("mig-1g.5gb.engines.copy", "1"),
            ("mig-1g.5gb.engines.decoder", "0"),
            ("mig-1g.5gb.engines.encoder", "0"),
            ("mig-1g.5gb.engines.jpeg", "0"),
            ("mig-1g.5gb.engines.ofa", "0"),
            ("mig-1g.5gb.memory", "4864"),
            ("mig-1g.5gb.multiprocessors", "14"),
            ("mig-1g.5gb.product", "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"),
            ("mig-1g.5gb.replicas", "1"),
            ("mig-1g.5gb.sharing-strategy", "none"),
            ("mig-1g.5gb.slices.ci", "1"),
            ("mig-1g.5gb.slices.gi", "1"),
            ("mig.capable", "true"),
            ("mig.strategy", "mixed"),
            ("mps.capable", "false"),
        ],
    );
    assert_eq!(mixed, want);
}

#[test]
fn hgx_h100_matches_the_golden_labels() {
    let dir = tempfile::tempdir().unwrap();
    let f = fleet(dir.path(), "560.35.03", "H100-SXM5-80GB", 8, None);
    let got = json_labels(&f, &["--no-timestamp"]);
    let want = golden(
        "560.35.03",
        "12.6",
        &[
            ("gpu.compute.major", "9"),
            ("gpu.compute.minor", "0"),
            ("gpu.count", "8"),
            ("gpu.family", "hopper"),
            ("gpu.memory", "81559"),
            ("gpu.product", "NVIDIA-H100-80GB-HBM3"),
            ("gpu.replicas", "1"),
            ("gpu.sharing-strategy", "none"),
            ("mig.capable", "true"),
            ("mps.capable", "false"),
        ],
    );
    assert_eq!(got, want);
}

#[test]
fn time_slicing_config_file_matches_the_golden_labels() {
    let dir = tempfile::tempdir().unwrap();
    let f = fleet(dir.path(), DRIVER, "T4", 2, None);
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n      - name: nvidia.com/gpu\n        replicas: 4\n",
    )
    .unwrap();
    let config_arg = config.display().to_string();
    let got = json_labels(&f, &["--config-file", &config_arg, "--no-timestamp"]);
    let want = golden(
        DRIVER,
        CUDA,
        &[
            ("gpu.compute.major", "7"),
            ("gpu.compute.minor", "5"),
            ("gpu.count", "2"),
            ("gpu.family", "turing"),
            ("gpu.memory", "15360"),
            ("gpu.product", "Tesla-T4-SHARED"),
            ("gpu.replicas", "4"),
            ("gpu.sharing-strategy", "time-slicing"),
            ("mig.capable", "false"),
            ("mps.capable", "false"),
        ],
    );
    assert_eq!(got, want);
}

/// The shipped DGX A100 fleet (GPUs 6 and 7 partitioned): what the binary
/// prints, in both formats and in the feature file, is what the core computes
/// for the node the simulated backend reports.
#[test]
fn shipped_dgx_fleet_output_is_the_core_label_function() {
    let fleet = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/fleets/dgx-a100.yaml");
    let spec = SimNodeSpec::from_fleet_file(&fleet, Some("dgx-a100-0")).unwrap();
    let node = read_node_gpus(&SimulatedBackend::new(&spec).unwrap(), None).unwrap();
    for strategy in ["none", "single", "mixed"] {
        let settings = Settings::resolve(
            None,
            &Overrides {
                mig_strategy: Some(strategy.to_string()),
                ..Overrides::default()
            },
        )
        .unwrap();
        let want = labels(&node, &settings, &GfdContext::default());
        let args = [
            "--node",
            "dgx-a100-0",
            "--mig-strategy",
            strategy,
            "--no-timestamp",
        ];
        assert_eq!(json_labels(&fleet, &args), want, "strategy {strategy}");

        let out = gfd(&fleet, &[&["-o", "nfd"], &args[..]].concat());
        assert!(out.status.success());
        assert_eq!(String::from_utf8(out.stdout).unwrap(), feature_file(&want));
    }
    // single on a mixed layout is labelled INVALID, as NVIDIA's GFD does.
    let got = json_labels(
        &fleet,
        &[
            "--mig-strategy",
            "single",
            "--no-timestamp",
            "--node",
            "dgx-a100-0",
        ],
    );
    assert_eq!(
        got["nvidia.com/gpu.product"],
        "NVIDIA-A100-SXM4-40GB-MIG-INVALID"
    );

    // --output-file writes the NFD feature file (and prints nothing).
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("features.d/gfd");
    let file_arg = file.display().to_string();
    let out = gfd(
        &fleet,
        &[
            "--node",
            "dgx-a100-0",
            "--no-timestamp",
            "--output-file",
            &file_arg,
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.stdout.is_empty());
    let settings = Settings::resolve(None, &Overrides::default()).unwrap();
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        feature_file(&labels(&node, &settings, &GfdContext::default()))
    );
}

#[test]
fn bad_input_exits_non_zero_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let f = fleet(dir.path(), DRIVER, "A100-SXM4-40GB", 1, None);
    let out = gfd(&f, &["-o", "json", "--mig-strategy", "diagonal"]);
    assert!(!out.status.success());
    assert!(out.stdout.is_empty());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("diagonal"), "{err}");

    let out = gfd(&dir.path().join("missing.yaml"), &["-o", "json"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("missing.yaml"), "{err}");

    // --publish needs to know which Node to label.
    let out = gfd(&f, &["--publish"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--node"), "{err}");
}
