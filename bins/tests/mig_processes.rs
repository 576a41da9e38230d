//! `gpu-stack mig apply` and `gpu-stack gpus` as processes sharing one
//! simulated node through a state file: a running process on an instance the
//! target config removes stops the apply (naming GPU, instance and pid, changing
//! nothing) until `--force`; a MIG mode change that needs a reset is finished
//! by the next apply after `gpu-stack gpus --reboot`.
use std::path::PathBuf;
use std::process::{Command, Output};

const FLEET: &str = r#"
nodes:
  - name: node-a
    gpus:
      - model: H100-SXM5-80GB
        count: 2
        mig:
          enabled: true
          instances: ["3g.40gb@0", "3g.40gb@4"]
    processes:
      - { gpu: 1, pid: 4242, instance: "3g.40gb@4", used-memory-mib: 4096 }
"#;

struct Node {
    _dir: tempfile::TempDir,
    fleet: PathBuf,
    state: PathBuf,
}

impl Node {
    fn new(fleet: &str) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fleet.yaml");
        std::fs::write(&path, fleet).unwrap();
        Node {
            fleet: path,
            state: dir.path().join("gpus.json"),
            _dir: dir,
        }
    }

    fn run(&self, args: &[&str]) -> Output {
        let mut c = Command::new(env!("CARGO_BIN_EXE_gpu-stack"));
        c.args(args)
            .args(["--backend", "simulated", "--fleet"])
            .arg(&self.fleet)
            .arg("--sim-state")
            .arg(&self.state)
            .env_remove("NODE_NAME")
            .env_remove("GPU_STACK_BACKEND");
        c.output().unwrap()
    }

    fn state(&self) -> String {
        std::fs::read_to_string(&self.state).unwrap()
    }
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn gi_id_at(node: &Node, gpu: usize, start: u32) -> u64 {
    let v: serde_json::Value = serde_json::from_str(&node.state()).unwrap();
    v["gpus"][gpu]["gpu_instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["start"] == start)
        .unwrap()["id"]
        .as_u64()
        .unwrap()
}

fn mig_apply(node: &Node, config: &str, force: bool) -> Output {
    let mut args = vec!["mig", "apply", "-f", "default", "-c", config];
    if force {
        args.push("--force");
    }
    node.run(&args)
}

fn mig_assert(node: &Node, config: &str) -> Option<i32> {
    node.run(&["mig", "assert", "-f", "default", "-c", config])
        .status
        .code()
}

#[test]
fn busy_instance_from_the_fleet_file_refuses_then_force_proceeds() {
    let node = Node::new(FLEET);
    // The table shows the process under its MIG device.
    let gpus = node.run(&["gpus"]);
    assert!(gpus.status.success(), "{}", text(&gpus));
    assert!(
        String::from_utf8_lossy(&gpus.stdout).contains("pid 4242  4096 MiB"),
        "{}",
        text(&gpus)
    );
    let before = node.state();
    let gi = gi_id_at(&node, 1, 4);

    let refused = mig_apply(&node, "all-1g.10gb", false);
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused));
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        err.contains(&format!(
            "GPU 1 GPU instance {gi} compute instance 0 has processes [4242]"
        )) && err.contains("--force")
            && err.contains("nothing was changed"),
        "{}",
        text(&refused)
    );
    assert_eq!(node.state(), before, "a refused apply changes nothing");

    // The layout the busy instance belongs to needs no destroy: no refusal.
    assert_eq!(mig_assert(&node, "all-3g.40gb"), Some(0));
    let keep = mig_apply(&node, "all-3g.40gb", false);
    assert!(keep.status.success(), "{}", text(&keep));
    assert_eq!(gi_id_at(&node, 1, 4), gi, "the busy instance was kept");

    let forced = mig_apply(&node, "all-1g.10gb", true);
    assert!(forced.status.success(), "{}", text(&forced));
    assert_eq!(mig_assert(&node, "all-1g.10gb"), Some(0));
    let gpus = node.run(&["gpus"]);
    assert!(
        !String::from_utf8_lossy(&gpus.stdout).contains("pid 4242"),
        "the process ended with its instance: {}",
        text(&gpus)
    );
}

#[test]
fn process_started_at_runtime_blocks_until_stopped() {
    let node = Node::new(FLEET);
    assert!(node.run(&["gpus"]).status.success());
    let gi = gi_id_at(&node, 0, 0);
    let start = node.run(&[
        "gpus",
        "--start-process",
        &format!("0:{gi}"),
        "--pid",
        "9001",
    ]);
    assert!(start.status.success(), "{}", text(&start));
    assert!(
        String::from_utf8_lossy(&start.stdout)
            .contains(&format!("started process 9001 on GPU 0 GPU instance {gi}")),
        "{}",
        text(&start)
    );
    let refused = mig_apply(&node, "all-1g.10gb", false);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        refused.status.code() == Some(2) && err.contains("[9001]") && err.contains("[4242]"),
        "{}",
        text(&refused)
    );
    for pid in ["9001", "4242"] {
        let stop = node.run(&["gpus", "--stop-process", pid]);
        assert!(stop.status.success(), "{}", text(&stop));
    }
    let done = mig_apply(&node, "all-1g.10gb", false);
    assert!(done.status.success(), "{}", text(&done));

    // Bad targets are refused with the reason and change nothing.
    let before = node.state();
    for (args, needle) in [
        (
            vec!["gpus", "--start-process", "0"],
            "name its GPU instance",
        ),
        (vec!["gpus", "--start-process", "0:99"], "GPU instance 99"),
        (vec!["gpus", "--start-process", "x"], "not a number"),
        (vec!["gpus", "--stop-process", "12345"], "process 12345"),
    ] {
        let o = node.run(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
        assert!(
            String::from_utf8_lossy(&o.stderr).contains(needle),
            "{args:?}: {}",
            text(&o)
        );
    }
    assert_eq!(node.state(), before);
}

#[test]
fn mode_change_waiting_for_a_reboot_finishes_after_it() {
    // GPU resets are refused while a process holds the GPU (MIG off), so the
    // enable waits for a reboot; the apply says so with exit code 1.
    let node = Node::new(
        "nodes:\n  - name: node-b\n    mig-change-needs-reset: true\n    gpus:\n      - model: H100-SXM5-80GB\n",
    );
    let start = node.run(&["gpus", "--start-process", "0", "--pid", "31"]);
    assert!(start.status.success(), "{}", text(&start));
    let forced = mig_apply(&node, "all-1g.10gb", true);
    assert_eq!(forced.status.code(), Some(1), "{}", text(&forced));
    assert!(
        String::from_utf8_lossy(&forced.stdout).contains("need a reset or reboot"),
        "{}",
        text(&forced)
    );
    assert_eq!(mig_assert(&node, "all-1g.10gb"), Some(1));
    let reboot = node.run(&["gpus", "--reboot"]);
    assert!(reboot.status.success(), "{}", text(&reboot));
    let done = mig_apply(&node, "all-1g.10gb", false);
    assert!(done.status.success(), "{}", text(&done));
    assert_eq!(mig_assert(&node, "all-1g.10gb"), Some(0));
}

/// `gpu-stack mig` with counts and layouts no GPU can hold: a fit count of
/// 4294967295 does not fit (exit 1) naming the count and the GPU's maximum,
/// not an abort on allocation; a count that does not parse (4294967296) is
/// bad input (exit 2); check-config reports the same per model;
/// validate refuses 10,000 instances in one short line; a 120 KB layout that
/// does not parse gives a short message.
#[test]
fn counts_and_layouts_beyond_any_gpu_are_refused_briefly() {
    let mig = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_gpu-stack"))
            .arg("mig")
            .args(args)
            .output()
            .unwrap()
    };
    let o = mig(&["fit", "--model", "H100-SXM5-80GB", "1g.10gb=4294967295"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.starts_with("does not fit: ")
            && out.contains("4294967295")
            && out.contains("at most 7"),
        "{}",
        text(&o)
    );
    assert!(o.stdout.len() < 2_000, "{} bytes", o.stdout.len());
    let o = mig(&["fit", "--model", "H100-SXM5-80GB", "1g.10gb=4294967296"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("not a whole number from 0 to 4294967295"),
        "{}",
        text(&o)
    );

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.yaml");
    std::fs::write(
        &file,
        "version: v1\nmig-configs:\n  big:\n    - {devices: all, mig-enabled: true, mig-devices: {1g.10gb: 4294967295}}\n",
    )
    .unwrap();
    let o = mig(&[
        "check-config",
        file.to_str().unwrap(),
        "--model",
        "H100-SXM5-80GB",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("invalid") && out.contains("at most 7"),
        "{}",
        text(&o)
    );

    let layout = vec!["1g.10gb@0"; 10_000].join(",");
    let o = mig(&["validate", "--model", "H100-SXM5-80GB", &layout]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(o.stdout.len() < 2_000, "{} bytes", o.stdout.len());
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("10000 instances"),
        "{}",
        text(&o)
    );

    let bad = "x".repeat(120_000);
    let o = mig(&["validate", "--model", "H100-SXM5-80GB", &bad]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(o.stderr.len() < 2_000, "{} bytes", o.stderr.len());
}

/// `gpu-stack mig fit` keeps the exit codes its help gives: a demand with more
/// of a profile than one GPU holds has no layout (exit 1, "does not fit" with
/// the maximum), in table and JSON output alike; the largest count that fits
/// exits 0; a profile the GPU lacks is bad input (exit 2).
#[test]
fn fit_counts_above_one_gpu_do_not_fit() {
    let fit = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_gpu-stack"))
            .args(["mig", "fit", "--model", "A100-SXM4-40GB"])
            .args(args)
            .output()
            .unwrap()
    };
    let o = fit(&["1g.5gb=8"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.starts_with("does not fit: 8 × 1g.5gb requested")
            && out.contains("holds at most 7 1g.5gb instances; lower the count to 7 or less"),
        "{}",
        text(&o)
    );
    assert!(o.stderr.is_empty(), "{}", text(&o));

    let o = fit(&["1g.5gb=8", "-o", "json"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["fits"], false, "{}", text(&o));
    assert_eq!(v["detail"]["reason"], "count-above-maximum", "{}", text(&o));
    assert_eq!(v["detail"]["max"], 7, "{}", text(&o));

    // A huge count is refused the same way, before anything is sized by it.
    let o = fit(&["1g.5gb=999999999"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("999999999 × 1g.5gb requested"),
        "{}",
        text(&o)
    );

    let o = fit(&["1g.5gb=7"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));

    let o = fit(&["1g.12gb=1"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}
