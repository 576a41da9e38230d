//! NVIDIA's nvidia-mig-parted against `gpu-stack mig` on one simulated node
//! both act on: NVIDIA's through the stand-in libnvidia-ml, ours through the
//! simulated backend, sharing one state file (`GPU_STACK_STANDIN_STATE` /
//! `--sim-state`), so what one side applies the other sees.
//!
//! For configs of NVIDIA's shipped mig-parted file
//! (`gpu-stack-core/data/mig-parted-config-default.yaml`, which ours embeds as
//! `default`), in sequence, so each apply is also a transition from the
//! previous layout: NVIDIA's `apply` is followed by our `assert` passing, our
//! `apply` by NVIDIA's `assert` passing, each side's `assert` of the previous
//! config failing, and after every step both `export`s meaning the same
//! per GPU (mig-enabled and mig-devices of the entry that selects it).
//!
//! mig-parted reads /proc/modules and the PCI devices in sysfs besides NVML:
//! `tools/nvidia-oracles/fake-host.sh` fakes them under `unshare -m` (root);
//! without that, or without the binaries, the tests are skipped (a failure
//! with `GPU_STACK_NVIDIA_ORACLES_REQUIRED=1`).

mod oracles;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Output};

use gpu_stack_core::migparted::{DeviceId, MigPartedConfig};
use oracles::{Node, fleet, map_diff, oracle, ours, shown, unshare_works};

/// NVIDIA's shipped config file, as ours embeds it.
const CONFIG_FILE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../gpu-stack-core/data/mig-parted-config-default.yaml"
);

const FAKE_HOST: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tools/nvidia-oracles/fake-host.sh"
);

/// What an export says about one GPU: MIG mode and profile → count.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Layout {
    mig_enabled: bool,
    mig_devices: BTreeMap<String, u32>,
}

/// One simulated node, its state file, and both tools.
struct Bench {
    node: Node,
    parted: PathBuf,
    gpus: Vec<(String, u32)>,
    fake_host_gpus: String,
    _dir: tempfile::TempDir,
}

/// Writes `<dir>/bin/nvidia-smi` for `node`: nvidia-mig-parted resets the
/// GPUs after a MIG mode change that waits for one (h200.yaml) with
/// `nvidia-smi -r -i <every GPU's bus id>`; on the simulated node that is
/// `gpu-stack gpus --reboot` (pending MIG modes take effect, MIG instances
/// are gone, as after a reset of every GPU).
fn nvidia_smi_standin(node: &Node, dir: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let args: Vec<String> = node
        .backend_args()
        .iter()
        .map(|a| format!("'{a}'"))
        .collect();
    let script = format!(
        "#!/bin/sh\n\
         # nvidia-smi -r -i BUS,... as nvidia-mig-parted runs it, on the simulated node.\n\
         [ \"$1\" = -r ] || {{ echo \"nvidia-smi stand-in: only -r\" >&2; exit 2; }}\n\
         exec '{}' gpus {} --reboot\n",
        ours("gpu-stack").display(),
        args.join(" ")
    );
    let path = bin.join("nvidia-smi");
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

impl Bench {
    /// The node of `fleet_name` with a fresh state file; `None` when the test
    /// is skipped.
    fn new(fleet_name: &str) -> Option<Bench> {
        let parted = oracle("nvidia-mig-parted")?;
        if !unshare_works() {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let node = Node::new(fleet(fleet_name), Some(dir.path().join("gpus.json")));
        let gpus = node.gpus();
        let fake_host_gpus = node.fake_host_gpus();
        nvidia_smi_standin(&node, dir.path());
        Some(Bench {
            node,
            parted,
            gpus,
            fake_host_gpus,
            _dir: dir,
        })
    }

    /// `nvidia-mig-parted ARGS` on the node, under fake-host.sh, with the
    /// `nvidia-smi` of [`nvidia_smi_standin`] first on PATH.
    fn nvidia(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new("unshare");
        let path = std::env::var_os("PATH").unwrap_or_default();
        let mut dirs = vec![self._dir.path().join("bin")];
        dirs.extend(std::env::split_paths(&path));
        cmd.args(["-m", FAKE_HOST, &self.fake_host_gpus])
            .arg(&self.parted)
            .args(args)
            .env("PATH", std::env::join_paths(dirs).unwrap());
        self.node.nvidia(cmd)
    }

    /// `gpu-stack mig ARGS` on the node.
    fn ours(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new(ours("gpu-stack"));
        cmd.arg("mig").args(args);
        self.node.ours(cmd)
    }

    fn nvidia_apply(&self, config: &str) {
        let out = self.nvidia(&["apply", "-f", CONFIG_FILE, "-c", config]);
        assert!(
            out.status.success(),
            "nvidia-mig-parted apply -c {config}: {}",
            shown(&out)
        );
    }

    fn our_apply(&self, config: &str) {
        let out = self.ours(&["apply", "-f", "default", "-c", config]);
        assert!(
            out.status.success(),
            "gpu-stack mig apply -c {config}: {}",
            shown(&out)
        );
    }

    /// NVIDIA's assert: true when it matches, false when it says it does
    /// not; anything else fails the test.
    fn nvidia_asserts(&self, config: &str) -> bool {
        let out = self.nvidia(&["assert", "-f", CONFIG_FILE, "-c", config]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if out.status.success() {
            return true;
        }
        assert!(
            stderr.contains("selected configuration not currently applied"),
            "nvidia-mig-parted assert -c {config}: {}",
            shown(&out)
        );
        false
    }

    /// Our assert: exit 0 true, exit 1 false, anything else fails the test.
    fn our_asserts(&self, config: &str) -> bool {
        let out = self.ours(&["assert", "-f", "default", "-c", config]);
        match out.status.code() {
            Some(0) => true,
            Some(1) => false,
            _ => panic!("gpu-stack mig assert -c {config}: {}", shown(&out)),
        }
    }

    /// Both exports, per GPU (`GPU <index>`); checks the one known difference
    /// of form: ours names each entry's device id in `device-filter`,
    /// NVIDIA's never writes one (both select the same GPUs).
    fn exports(&self) -> (BTreeMap<String, Layout>, BTreeMap<String, Layout>) {
        let out = self.nvidia(&["export"]);
        assert!(
            out.status.success(),
            "nvidia-mig-parted export: {}",
            shown(&out)
        );
        let theirs = String::from_utf8_lossy(&out.stdout).to_string();
        let out = self.ours(&["export"]);
        assert!(
            out.status.success(),
            "gpu-stack mig export: {}",
            shown(&out)
        );
        let mine = String::from_utf8_lossy(&out.stdout).to_string();
        let (theirs_layout, theirs_filters) = self.per_gpu("NVIDIA's", &theirs);
        let (mine_layout, mine_filters) = self.per_gpu("our", &mine);
        for (i, (_, id)) in self.gpus.iter().enumerate() {
            let gpu = format!("GPU {i}");
            assert_eq!(
                theirs_filters[&gpu],
                vec![],
                "{gpu}: NVIDIA's export:\n{theirs}"
            );
            assert_eq!(
                mine_filters[&gpu],
                vec![DeviceId {
                    device: *id,
                    subsystem: None
                }],
                "{gpu}: our export:\n{mine}"
            );
        }
        (theirs_layout, mine_layout)
    }

    /// The entry of config `current` in `yaml` that selects each GPU (by
    /// index and device id): its layout and its device filter.
    fn per_gpu(
        &self,
        whose: &str,
        yaml: &str,
    ) -> (BTreeMap<String, Layout>, BTreeMap<String, Vec<DeviceId>>) {
        let config = MigPartedConfig::from_yaml(yaml)
            .unwrap_or_else(|e| panic!("{whose} export does not parse: {e}\n{yaml}"));
        let current = config
            .get("current")
            .unwrap_or_else(|| panic!("{whose} export has no config `current`:\n{yaml}"));
        let mut layouts = BTreeMap::new();
        let mut filters = BTreeMap::new();
        for (i, (_, id)) in self.gpus.iter().enumerate() {
            let selecting: Vec<_> = current
                .entries
                .iter()
                .filter(|e| e.devices.includes(i as u32) && e.matches_device(*id, None))
                .collect();
            assert_eq!(
                selecting.len(),
                1,
                "{whose} export: GPU {i} is selected by {} entries:\n{yaml}",
                selecting.len()
            );
            let e = selecting[0];
            let gpu = format!("GPU {i}");
            layouts.insert(
                gpu.clone(),
                Layout {
                    mig_enabled: e.mig_enabled,
                    mig_devices: e
                        .mig_devices
                        .iter()
                        .map(|(p, n)| (p.to_string(), *n))
                        .collect(),
                },
            );
            filters.insert(gpu, e.device_filter.clone());
        }
        (layouts, filters)
    }

    /// Both exports mean the same; returns the layout.
    fn exports_agree(&self, after: &str) -> BTreeMap<String, Layout> {
        let (theirs, mine) = self.exports();
        assert!(
            theirs == mine,
            "after {after}, the exports differ per GPU:\n{}",
            map_diff("NVIDIA", &theirs, "ours", &mine)
        );
        theirs
    }

    /// Every GPU has `layout`.
    fn assert_all(
        &self,
        layouts: &BTreeMap<String, Layout>,
        mig_enabled: bool,
        devices: &[(&str, u32)],
    ) {
        let want = Layout {
            mig_enabled,
            mig_devices: devices.iter().map(|(p, n)| (p.to_string(), *n)).collect(),
        };
        for (gpu, l) in layouts {
            assert_eq!(l, &want, "{gpu}");
        }
        assert_eq!(layouts.len(), self.gpus.len());
    }
}

/// The sequence of applies, asserts and exports described at the top, on
/// one node; `first`, `second`, `third` are MIG configs of the shipped file
/// that fit its GPUs, given with the per-GPU layout each means.
fn differential(
    bench: &Bench,
    first: (&str, &[(&str, u32)]),
    second: (&str, &[(&str, u32)]),
    third: (&str, &[(&str, u32)]),
) {
    // The fleet's own layout, before either side changed anything.
    bench.exports_agree("nothing");

    // NVIDIA applies, ours asserts.
    bench.nvidia_apply(first.0);
    assert!(
        bench.our_asserts(first.0),
        "ours after NVIDIA applied {}",
        first.0
    );
    assert!(
        !bench.our_asserts(second.0),
        "ours: {} is not applied",
        second.0
    );
    let l = bench.exports_agree(&format!("NVIDIA's apply of {}", first.0));
    bench.assert_all(&l, true, first.1);

    // Ours applies (a transition), NVIDIA asserts.
    bench.our_apply(second.0);
    assert!(
        bench.nvidia_asserts(second.0),
        "NVIDIA after ours applied {}",
        second.0
    );
    assert!(
        !bench.nvidia_asserts(first.0),
        "NVIDIA: {} is no longer applied",
        first.0
    );
    let l = bench.exports_agree(&format!("our apply of {}", second.0));
    bench.assert_all(&l, true, second.1);

    // NVIDIA transitions from our layout.
    bench.nvidia_apply(third.0);
    assert!(
        bench.our_asserts(third.0),
        "ours after NVIDIA applied {}",
        third.0
    );
    assert!(
        !bench.our_asserts(second.0),
        "ours: {} is no longer applied",
        second.0
    );
    let l = bench.exports_agree(&format!("NVIDIA's apply of {}", third.0));
    bench.assert_all(&l, true, third.1);

    // Ours turns MIG off.
    bench.our_apply("all-disabled");
    assert!(bench.nvidia_asserts("all-disabled"));
    assert!(!bench.nvidia_asserts(third.0));
    let l = bench.exports_agree("our apply of all-disabled");
    bench.assert_all(&l, false, &[]);
}

/// A config of the shipped file whose profile the node's GPUs lack: ours
/// refuses it and changes nothing; NVIDIA's reports success after turning MIG
/// on and creating no instance. Kept as a difference: ours does not report a
/// config it cannot apply as applied.
fn lacking_profile(bench: &Bench, config: &str, profile: &str) {
    let before = bench.exports_agree("the earlier steps");
    let out = bench.ours(&["apply", "-f", "default", "-c", config]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "ours: {}", shown(&out));
    assert!(
        stderr.contains(&format!("profile {profile} does not exist on this GPU"))
            && stderr.contains("nothing was changed"),
        "ours: {}",
        shown(&out)
    );
    assert_eq!(
        bench.exports_agree(&format!("our refused {config}")),
        before
    );

    bench.nvidia_apply(config);
    let after = bench.exports_agree(&format!("NVIDIA's apply of {config}"));
    bench.assert_all(&after, true, &[]);
    assert!(bench.our_asserts("all-enabled"), "MIG on, no instances");
}

#[test]
fn dgx_a100_mig_parted_and_ours_agree() {
    let Some(bench) = Bench::new("dgx-a100") else {
        return;
    };
    differential(
        &bench,
        ("all-1g.5gb", &[("1g.5gb", 7)]),
        (
            "all-balanced",
            &[("1g.5gb", 2), ("2g.10gb", 1), ("3g.20gb", 1)],
        ),
        ("all-3g.20gb", &[("3g.20gb", 2)]),
    );
    // 3g.40gb is a profile of the 80 GB parts.
    lacking_profile(&bench, "all-3g.40gb", "3g.40gb");
}

#[test]
fn hgx_h100_mig_parted_and_ours_agree() {
    let Some(bench) = Bench::new("hgx-h100") else {
        return;
    };
    differential(
        &bench,
        // The entry for the 80 GB parts (device-filter with 0x233010DE).
        ("all-1g.10gb", &[("1g.10gb", 7)]),
        (
            "all-balanced",
            &[("1g.10gb", 2), ("2g.20gb", 1), ("3g.40gb", 1)],
        ),
        ("all-2g.20gb", &[("2g.20gb", 3)]),
    );
    // 1g.5gb is a profile of the 40 GB A100.
    lacking_profile(&bench, "all-1g.5gb", "1g.5gb");
}

#[test]
fn h200_mig_parted_and_ours_agree() {
    // MIG on GPUs 4-7 (6-7 with no instances), off on 0-3; a MIG mode change
    // on this node waits for a GPU reset, which both sides then do.
    let Some(bench) = Bench::new("h200") else {
        return;
    };
    differential(
        &bench,
        ("all-1g.18gb", &[("1g.18gb", 7)]),
        (
            "all-balanced",
            &[("1g.18gb", 2), ("2g.35gb", 1), ("3g.71gb", 1)],
        ),
        ("all-3g.71gb", &[("3g.71gb", 2)]),
    );
    // 1g.5gb is a profile of the 40 GB A100.
    lacking_profile(&bench, "all-1g.5gb", "1g.5gb");
}

/// Every config of the shipped file that fits the node's GPU model, in file
/// order, each one a transition from the one before: NVIDIA's and our
/// `apply` alternate, the other side's `assert` passes after each, and both
/// exports mean the same. Configs that do not fit the model are the
/// `lacking_profile` difference above.
fn every_fitting_config(fleet_name: &str) {
    use gpu_stack_core::migparted::{CheckStatus, check};
    let Some(bench) = Bench::new(fleet_name) else {
        return;
    };
    let text = std::fs::read_to_string(fleet(fleet_name)).unwrap();
    let parsed = gpu_stack_core::fleet::Fleet::from_yaml(&text).unwrap();
    let model = gpu_stack_core::catalog::lookup(&parsed.nodes[0].gpus[0].model).unwrap();
    let shipped =
        MigPartedConfig::from_yaml(&std::fs::read_to_string(CONFIG_FILE).unwrap()).unwrap();
    let fitting: Vec<String> = check(&shipped, &[model])
        .into_iter()
        .filter(|c| c.status == CheckStatus::Valid)
        .map(|c| c.config)
        .filter(|c| c != "all-disabled" && c != "all-enabled")
        .collect();
    assert!(fitting.len() >= 6, "{}: only {fitting:?}", model.name);
    for (i, config) in fitting.iter().enumerate() {
        if i % 2 == 0 {
            bench.nvidia_apply(config);
            assert!(
                bench.our_asserts(config),
                "ours after NVIDIA applied {config}"
            );
        } else {
            bench.our_apply(config);
            assert!(
                bench.nvidia_asserts(config),
                "NVIDIA after ours applied {config}"
            );
        }
        bench.exports_agree(&format!("the apply of {config}"));
    }
    eprintln!(
        "{}: {} configs of the shipped file applied in turn by both sides: {}",
        model.name,
        fitting.len(),
        fitting.join(", ")
    );
}

#[test]
fn dgx_a100_every_fitting_config_agrees() {
    every_fitting_config("dgx-a100");
}

#[test]
fn hgx_h100_every_fitting_config_agrees() {
    every_fitting_config("hgx-h100");
}

/// A generated MigConfig entry with placements (carried in a comment)
/// works with NVIDIA's mig-parted, which applies and asserts its counts,
/// while ours creates exactly the placed instances.
#[test]
fn hgx_h100_placements_are_ignored_by_mig_parted_and_applied_by_ours() {
    use gpu_stack_core::operator::migconfig::{
        LayoutRule, LayoutSource, MigConfigInput, entries_yaml, generate,
    };
    let Some(bench) = Bench::new("hgx-h100") else {
        return;
    };
    let shipped = MigPartedConfig::default_config().unwrap();
    let rule = LayoutRule {
        model: Some("H100-SXM5-80GB".into()),
        source: LayoutSource::Profiles(vec![
            ("1g.10gb".parse().unwrap(), 3),
            ("3g.40gb".parse().unwrap(), 1),
        ]),
        placements: Some(
            gpu_stack_core::mig::parse_layout("3g.40gb@4,1g.10gb@0,1g.10gb@1,1g.10gb@2").unwrap(),
        ),
    };
    let cr = MigConfigInput {
        name: "placed".into(),
        node_selector: Default::default(),
        rules: vec![rule],
    };
    let entry = generate(&cr, &shipped).unwrap();
    let text = format!(
        "{}{}",
        std::fs::read_to_string(CONFIG_FILE).unwrap(),
        entries_yaml(std::slice::from_ref(&entry))
    );
    assert!(text.contains("# gpustack.io/placements gpustack-placed[0]:"));
    let file = bench._dir.path().join("placed.yaml");
    std::fs::write(&file, &text).unwrap();
    let file = file.to_str().unwrap();
    let nvidia_asserts = || {
        let out = bench.nvidia(&["assert", "-f", file, "-c", "gpustack-placed"]);
        out.status.success()
    };
    let out = bench.nvidia(&["apply", "-f", file, "-c", "gpustack-placed"]);
    assert!(
        out.status.success(),
        "nvidia-mig-parted apply: {}",
        shown(&out)
    );
    assert!(nvidia_asserts(), "NVIDIA's assert after its apply");
    let out = bench.ours(&["apply", "-f", file, "-c", "gpustack-placed"]);
    assert!(out.status.success(), "gpu-stack mig apply: {}", shown(&out));
    let out = bench.ours(&["assert", "-f", file, "-c", "gpustack-placed"]);
    assert!(
        out.status.success(),
        "gpu-stack mig assert: {}",
        shown(&out)
    );
    // NVIDIA's assert checks the counts only: it still matches.
    assert!(nvidia_asserts(), "NVIDIA's assert after our apply");
    let path = bench._dir.path().join("gpus.json");
    let state =
        gpu_stack_nvml::sim::state::parse_state(&path, &std::fs::read(&path).unwrap()).unwrap();
    for g in &state.gpus {
        let mut got: Vec<(u32, u32)> = g.gpu_instances.iter().map(|i| (i.start, i.size)).collect();
        got.sort_unstable();
        assert_eq!(got, [(0, 1), (1, 1), (2, 1), (4, 4)], "GPU {}", g.index);
    }
}
