//! mig-parted config parsing (mig-parted's rules) and the shipped default file.

use gpu_stack_core::catalog;
use gpu_stack_core::migparted::{
    CheckStatus, DEFAULT_CONFIG_YAML, Devices, EntryVerdict, MigPartedConfig, check,
};

fn parse(s: &str) -> Result<MigPartedConfig, String> {
    MigPartedConfig::from_yaml(s).map_err(|e| e.to_string())
}

#[test]
fn default_file_parses() {
    let c = MigPartedConfig::default_config().unwrap();
    assert_eq!(c.version, "v1");
    assert!(c.mig_configs.len() > 50);
    let names = c.names();
    for n in [
        "all-disabled",
        "all-enabled",
        "all-balanced",
        "all-1g.10gb",
        "all-1g.24gb.me.all",
    ] {
        assert!(names.contains(&n), "{n}");
    }
    let balanced = c.get("all-balanced").unwrap();
    assert!(balanced.entries.iter().all(|e| !e.device_filter.is_empty()));
    assert_eq!(
        c.get("all-disabled").unwrap().entries[0].devices,
        Devices::All
    );
}

/// The shipped per-GPU configs of reference/mig.md §8.3 are valid on their GPUs.
#[test]
fn shipped_configs_valid_on_their_gpus() {
    let c = MigPartedConfig::default_config().unwrap();
    let expect_valid: &[(&str, &[&str])] = &[
        (
            "A100-SXM4-40GB",
            &[
                "all-1g.5gb",
                "all-1g.5gb.me",
                "all-1g.10gb",
                "all-2g.10gb",
                "all-3g.20gb",
                "all-4g.20gb",
                "all-7g.40gb",
                "all-balanced",
            ],
        ),
        (
            "A100-SXM4-80GB",
            &[
                "all-1g.10gb",
                "all-1g.10gb.me",
                "all-1g.20gb",
                "all-2g.20gb",
                "all-3g.40gb",
                "all-4g.40gb",
                "all-7g.80gb",
                "all-balanced",
            ],
        ),
        (
            "H100-SXM5-80GB",
            &[
                "all-1g.10gb",
                "all-1g.20gb",
                "all-3g.40gb",
                "all-7g.80gb",
                "all-balanced",
            ],
        ),
        (
            "A30",
            &[
                "all-1g.6gb",
                "all-1g.6gb.me",
                "all-2g.12gb",
                "all-2g.12gb.me",
                "all-4g.24gb",
                "all-balanced",
            ],
        ),
        (
            "H100-NVL-94GB",
            &[
                "all-1g.12gb",
                "all-1g.24gb",
                "all-2g.24gb",
                "all-3g.47gb",
                "all-7g.94gb",
                "all-balanced",
            ],
        ),
        (
            "GH200-96GB",
            &["all-3g.48gb", "all-4g.48gb", "all-7g.96gb", "all-balanced"],
        ),
        (
            "GH200-144GB",
            &["all-1g.18gb", "all-1g.36gb", "all-3g.72gb", "all-balanced"],
        ),
        (
            "H200-SXM-141GB",
            &[
                "all-1g.18gb",
                "all-1g.35gb",
                "all-2g.35gb",
                "all-7g.141gb",
                "all-balanced",
            ],
        ),
        (
            "B200",
            &["all-1g.23gb", "all-1g.45gb", "all-3g.90gb", "all-balanced"],
        ),
        (
            "GB200",
            &["all-1g.47gb", "all-3g.93gb", "all-7g.186gb", "all-balanced"],
        ),
        ("B300", &["all-1g.34gb", "all-3g.135gb", "all-balanced"]),
        ("GB300", &["all-1g.35gb", "all-7g.278gb", "all-balanced"]),
        (
            "RTX-PRO-6000-Blackwell",
            &[
                "all-1g.24gb",
                "all-1g.24gb.gfx",
                "all-1g.24gb.me.all",
                "all-1g.24gb-me",
                "all-2g.48gb",
                "all-2g.48gb.me.all",
                "all-4g.96gb.gfx",
                "all-balanced",
            ],
        ),
    ];
    for (model, configs) in expect_valid {
        let m = catalog::lookup(model).unwrap();
        let report = check(&c, &[m]);
        for name in *configs {
            let r = report.iter().find(|r| r.config == *name).unwrap();
            assert_eq!(r.status, CheckStatus::Valid, "{model} {name}: {r:?}");
        }
        // all-disabled / all-enabled apply everywhere.
        for name in ["all-disabled", "all-enabled"] {
            let r = report.iter().find(|r| r.config == name).unwrap();
            assert_eq!(r.status, CheckStatus::Valid);
        }
    }
}

#[test]
fn every_config_reported_for_every_gpu() {
    let c = MigPartedConfig::default_config().unwrap();
    let models: Vec<_> = catalog::models()
        .iter()
        .filter(|m| m.mig.is_some())
        .collect();
    let report = check(&c, &models);
    assert_eq!(report.len(), c.mig_configs.len() * models.len());
    for r in &report {
        for e in &r.entries {
            if let EntryVerdict::Invalid { reason } = &e.verdict {
                assert!(!reason.is_empty());
            }
        }
    }
    // A profile of another GPU is reported invalid with the reason.
    let a100 = catalog::lookup("A100-SXM4-40GB").unwrap();
    let r = check(&c, &[a100]);
    let x = r.iter().find(|r| r.config == "all-2g.48gb").unwrap();
    assert_eq!(x.status, CheckStatus::Invalid);
    // all-1g.10gb has per-device entries: only the A100-40GB one applies (4 instances).
    let x = r.iter().find(|r| r.config == "all-1g.10gb").unwrap();
    assert_eq!(x.entries.len(), 1);
    assert!(matches!(&x.entries[0].verdict, EntryVerdict::Valid { layout } if layout.len() == 4));
}

#[test]
fn validation_rules() {
    let ok = |s: &str| assert!(parse(s).is_ok(), "{s}: {:?}", parse(s));
    let bad = |s: &str, why: &str| {
        let e = parse(s).unwrap_err();
        assert!(e.contains(why), "{s}: {e}");
    };
    bad("", "is empty");
    ok(
        "version: v1\nmig-configs:\n  a:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {}\n",
    );
    ok(
        "version: v1\nmig-configs:\n  a:\n    - devices: [0, 1]\n      device-filter: \"0x20B010DE:0x147E10DE\"\n      mig-enabled: true\n      mig-devices:\n        \"1g.5gb\": 2\n        \"2g.10gb\": 0\n",
    );
    bad("version: v2\nmig-configs: {}\n", "version");
    bad("mig-configs:\n  a: []\n", "version");
    bad("version: v1\nmig-configs: {}\n", "empty");
    bad(
        "version: v1\nextra: 1\nmig-configs:\n  a:\n    - devices: all\n      mig-enabled: false\n",
        "unknown top-level",
    );
    bad("version: v1\nmig-configs:\n  a: []\n", "no entries");
    bad(
        "version: v1\nmig-configs:\n  a:\n    - devices: all\n      mig-enabled: true\n",
        "mig-devices",
    );
    bad(
        "version: v1\nmig-configs:\n  a:\n    - devices: all\n      mig-enabled: false\n      mig-devices: {\"1g.5gb\": 1}\n",
        "mig-enabled is false",
    );
    bad(
        "version: v1\nmig-configs:\n  a:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {\"1g.5gb\": -1}\n",
        "negative",
    );
    bad(
        "version: v1\nmig-configs:\n  a:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {\"1g.5gb\": 0}\n",
        "all counts are 0",
    );
    bad(
        "version: v1\nmig-configs:\n  a:\n    - devices: some\n      mig-enabled: false\n",
        "all",
    );
    bad(
        "version: v1\nmig-configs:\n  a:\n    - devices: all\n      mig-enabled: false\n      colour: red\n",
        "unknown field",
    );
    bad(
        "version: v1\nmig-configs:\n  a:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {\"1g.5gbk\": 1}\n",
        "a[0].mig-devices.1g.5gbk",
    );
    bad(
        "version: v1\nmig-configs:\n  a:\n    - devices: all\n      device-filter: 20B010DE\n      mig-enabled: false\n",
        "PCI id",
    );
    bad(
        "version: v1\nmig-configs:\n  a:\n    - mig-enabled: false\n",
        "devices",
    );
}

#[test]
fn embedded_file_is_the_shipped_file() {
    assert!(DEFAULT_CONFIG_YAML.starts_with("version: v1"));
}

#[test]
fn an_empty_or_comment_only_file_is_refused() {
    for text in [
        "",
        "  \n",
        "~",
        "# only a comment\n# and another\n",
        "---\n",
    ] {
        let e = MigPartedConfig::from_yaml(text).unwrap_err();
        assert_eq!(e.path, "(document)", "{text:?}");
        assert!(e.reason.contains("is empty"), "{text:?}: {e}");
        assert!(e.reason.contains("version: v1"), "{text:?}: {e}");
    }
}
