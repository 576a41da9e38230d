//! NVIDIA's gpu-feature-discovery against ours, label for label, on the same
//! simulated nodes: NVIDIA's reads the stand-in libnvidia-ml, ours the
//! simulated backend of the same fleet file. Both run `--oneshot
//! --no-timestamp --output-file` once per MIG strategy (none, single, mixed).
//!
//! The differences known today are asserted one by one in
//! [`known_differences`] (so a change on either side shows up); every other
//! label must be equal, and a new difference fails with a per-label diff.

mod oracles;

use std::collections::BTreeMap;
use std::process::Command;

use oracles::{Node, fleet, map_diff, oracle, ours, shown};

/// How many of a node's GPUs have MIG mode on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MigOn {
    None,
    Some,
    All,
}

/// The nodes compared: a fleet file and what MIG looks like on it.
const NODES: &[(&str, MigOn)] = &[
    // 8x A100-SXM4-40GB, MIG off on GPUs 0-5, on (3g + 2g + 2x 1g) on 6-7.
    ("dgx-a100", MigOn::Some),
    // 8x H100-SXM5-80GB, MIG off.
    ("hgx-h100", MigOn::None),
    // 8x H100-SXM5-80GB, each split into seven 1g.10gb.
    ("hgx-h100-mig", MigOn::All),
    // 8x H200-SXM-141GB, MIG off on 0-3, on on 4-7 (two of them empty).
    ("h200", MigOn::Some),
];

const STRATEGIES: &[&str] = &["none", "single", "mixed"];

/// Labels that depend on host facts the stand-in does not fake, left out of
/// the comparison: `gpu.machine` is NVIDIA's reading of the DMI product name
/// (/sys/class/dmi/id/product_name; ours reads `--machine-type-file`), and the
/// timestamp is the time of the run (both run with `--no-timestamp`).
const HOST_LABELS: &[&str] = &["nvidia.com/gpu.machine", "nvidia.com/gfd.timestamp"];

/// Parses a feature file (`key=value` lines).
fn parse(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (k, v) = l.split_once('=').unwrap_or((l, ""));
            (k.to_string(), v.to_string())
        })
        .collect()
}

/// Runs NVIDIA's GFD (`nvidia`) and ours on `node` with `strategy`; returns
/// both label sets.
fn labels(
    node: &Node,
    nvidia: &std::path::Path,
    strategy: &str,
) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let dir = tempfile::tempdir().unwrap();
    let files = [dir.path().join("nvidia"), dir.path().join("ours")];
    let flags = |file: &std::path::Path| {
        vec![
            "--oneshot".to_string(),
            "--no-timestamp".to_string(),
            format!("--mig-strategy={strategy}"),
            format!("--output-file={}", file.display()),
        ]
    };
    let mut theirs = Command::new(nvidia);
    theirs.args(flags(&files[0]));
    let out = node.nvidia(theirs);
    assert!(
        out.status.success(),
        "NVIDIA's gpu-feature-discovery failed: {}",
        shown(&out)
    );
    let mut mine = Command::new(ours("gpu-feature-discovery"));
    mine.args(flags(&files[1]));
    let out = node.ours(mine);
    assert!(
        out.status.success(),
        "our gpu-feature-discovery failed: {}",
        shown(&out)
    );
    let read = |f: &std::path::Path| parse(&std::fs::read_to_string(f).unwrap());
    (read(&files[0]), read(&files[1]))
}

/// Checks the differences known today and takes them out of both sets, so the
/// rest can be compared for equality.
fn known_differences(
    mig: MigOn,
    strategy: &str,
    nvidia: &mut BTreeMap<String, String>,
    ours: &mut BTreeMap<String, String>,
) {
    let case = format!("{mig:?} GPUs in MIG mode, --mig-strategy={strategy}");
    // NVIDIA reads the PCI class from sysfs for gpu.mode ("unknown" here,
    // where sysfs has no such device) and labels vGPU presence; ours emits
    // neither label.
    for key in ["nvidia.com/gpu.mode", "nvidia.com/vgpu.present"] {
        assert!(
            nvidia.contains_key(key),
            "{case}: NVIDIA no longer emits {key}"
        );
        assert!(!ours.contains_key(key), "{case}: ours now emits {key}");
        nvidia.remove(key);
    }
    // With every GPU in MIG mode under none/mixed, NVIDIA builds the
    // nvidia.com/gpu labels of the MIG-enabled GPUs without a sharing config
    // (internal/lm/mig-strategy.go), which it reads as 0 replicas; a full GPU
    // of the same model would override them. Ours says 1.
    if mig == MigOn::All && strategy != "single" {
        let key = "nvidia.com/gpu.replicas";
        assert_eq!(
            nvidia.get(key).map(String::as_str),
            Some("0"),
            "{case}: NVIDIA {key}"
        );
        assert_eq!(
            ours.get(key).map(String::as_str),
            Some("1"),
            "{case}: ours {key}"
        );
        nvidia.remove(key);
        ours.remove(key);
    }
    // `single` on a node with MIG on some GPUs only is an invalid
    // configuration (product ...-MIG-INVALID, count 0 on both sides): NVIDIA
    // keeps the full-GPU compute, family and memory labels (memory 0) and an
    // empty sharing strategy; ours drops them.
    if mig == MigOn::Some && strategy == "single" {
        assert_eq!(
            nvidia.get("nvidia.com/gpu.memory").map(String::as_str),
            Some("0"),
            "{case}"
        );
        assert_eq!(
            nvidia
                .get("nvidia.com/gpu.sharing-strategy")
                .map(String::as_str),
            Some(""),
            "{case}"
        );
        for key in [
            "nvidia.com/gpu.compute.major",
            "nvidia.com/gpu.compute.minor",
            "nvidia.com/gpu.family",
            "nvidia.com/gpu.memory",
            "nvidia.com/gpu.sharing-strategy",
        ] {
            assert!(
                nvidia.contains_key(key),
                "{case}: NVIDIA no longer emits {key}"
            );
            assert!(!ours.contains_key(key), "{case}: ours now emits {key}");
            nvidia.remove(key);
        }
    }
}

#[test]
fn our_gfd_labels_match_nvidias_on_every_node_and_strategy() {
    let Some(nvidia) = oracle("gpu-feature-discovery") else {
        return;
    };
    let mut failures = Vec::new();
    for &(name, mig) in NODES {
        let node = Node::new(fleet(name), None);
        for strategy in STRATEGIES {
            let (mut theirs, mut mine) = labels(&node, &nvidia, strategy);
            for key in HOST_LABELS {
                theirs.remove(*key);
                mine.remove(*key);
            }
            known_differences(mig, strategy, &mut theirs, &mut mine);
            assert!(
                theirs.contains_key("nvidia.com/gpu.count"),
                "{name} {strategy}: {theirs:?}"
            );
            if theirs != mine {
                failures.push(format!(
                    "{name}, --mig-strategy={strategy}:\n{}",
                    map_diff("NVIDIA", &theirs, "ours", &mine)
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "labels differ from NVIDIA's gpu-feature-discovery:\n{}",
        failures.join("\n")
    );
}
