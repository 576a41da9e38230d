//! containerd edits of the toolkit agent on real-world configs (goldens),
//! generated configs (proptest), and the running config's gaps.
//!
//! Goldens live in `tests/data/toolkit/`: `<name>.toml` is the input,
//! `<name>.dropin.toml` the drop-in, `<name>.main.toml` the edited main
//! config. `UPDATE_GOLDEN=1 cargo test -p gpu-stack-core --test toolkit_containerd`
//! rewrites them; review the diff before committing.

use std::fs;
use std::path::{Path, PathBuf};

use gpu_stack_core::toolkit::containerd::{self, ConfigVersion, Gap};
use gpu_stack_core::toolkit::{ConfigError, RuntimeOptions};
use proptest::prelude::*;
use toml_edit::{DocumentMut, Item, Table, Value};

const IMPORT: &str = "/etc/containerd/conf.d/99-gpu-stack.toml";

/// The inputs: `containerd config default` of containerd 1.7.35, Debian
/// bookworm's packaged /etc/containerd/config.toml (containerd 1.6.20), a
/// containerd 2.x version 3 config, a k3s-generated config, and a user's
/// hand-kept file.
const CASES: [&str; 5] = [
    "containerd-1.7-default",
    "debian-bookworm",
    "containerd-2-v3",
    "k3s-generated",
    "user-custom",
];

fn data(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/toolkit")
        .join(file)
}

fn read(file: &str) -> String {
    fs::read_to_string(data(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

fn opts() -> RuntimeOptions {
    RuntimeOptions {
        cdi_spec_dirs: vec!["/var/run/cdi".into()],
        runtime_handler: Some("nvidia".into()),
    }
}

fn check_golden(file: &str, actual: &str) {
    let path = data(file);
    if std::env::var("UPDATE_GOLDEN").is_ok_and(|v| v == "1") {
        fs::write(&path, actual).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        return;
    }
    let expected = fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run with UPDATE_GOLDEN=1 to write it",
            path.display()
        )
    });
    assert!(
        actual == expected,
        "{} differs from the output; if the change is intended, rerun with UPDATE_GOLDEN=1 and review the diff\n--- output ---\n{actual}",
        path.display()
    );
}

fn table_at<'a>(doc: &'a DocumentMut, path: &[&str]) -> &'a Table {
    let mut t = doc.as_table();
    for key in path {
        t = t
            .get(key)
            .and_then(Item::as_table)
            .unwrap_or_else(|| panic!("no table {key} on the way to {path:?}"));
    }
    t
}

/// Every leaf of a table as (dotted path, value), values without formatting.
fn leaves(t: &Table, prefix: &str, out: &mut Vec<(String, String)>) {
    for (k, item) in t.iter() {
        let path = format!("{prefix}.{k}");
        match item {
            Item::Table(sub) => leaves(sub, &path, out),
            Item::Value(v) => out.push((path, plain(v))),
            other => out.push((path, format!("{other:?}"))),
        }
    }
}

fn plain(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{:?}", s.value()),
        Value::Integer(i) => i.value().to_string(),
        Value::Float(f) => f.value().to_string(),
        Value::Boolean(b) => b.value().to_string(),
        Value::Datetime(d) => d.value().to_string(),
        Value::Array(a) => format!("[{}]", a.iter().map(plain).collect::<Vec<_>>().join(",")),
        Value::InlineTable(t) => format!(
            "{{{}}}",
            t.iter()
                .map(|(k, v)| format!("{k}={}", plain(v)))
                .collect::<Vec<_>>()
                .join(",")
        ),
    }
}

#[test]
fn goldens_drop_in_and_main() {
    for name in CASES {
        let main = read(&format!("{name}.toml"));
        let drop_in = containerd::render_drop_in(Some(&main), &opts()).unwrap();
        check_golden(&format!("{name}.dropin.toml"), &drop_in);
        assert_eq!(
            drop_in,
            containerd::render_drop_in(Some(&main), &opts()).unwrap(),
            "{name}: deterministic"
        );

        let edited = containerd::add_import(Some(&main), IMPORT)
            .unwrap()
            .unwrap_or_else(|| panic!("{name}: does not import the drop-in yet"));
        check_golden(&format!("{name}.main.toml"), &edited);
        // The user's text survives byte for byte: the edit is one insertion,
        // and taking it out again gives the file back.
        let added_key = !main.parse::<DocumentMut>().unwrap().contains_key("imports");
        assert_eq!(
            containerd::remove_import(&edited, IMPORT, added_key).unwrap(),
            main,
            "{name}"
        );
        let common_prefix = main
            .bytes()
            .zip(edited.bytes())
            .take_while(|(a, b)| a == b)
            .count();
        let common_suffix = main
            .bytes()
            .rev()
            .zip(edited.bytes().rev())
            .take_while(|(a, b)| a == b)
            .count();
        assert!(
            common_prefix + common_suffix >= main.len(),
            "{name}: more than one place changed"
        );
        assert_eq!(
            containerd::add_import(Some(&edited), IMPORT).unwrap(),
            None,
            "{name}: idempotent"
        );
    }
}

#[test]
fn main_edits_are_only_the_imports_line() {
    // Spot checks of what the goldens hold, by eye once and by test since.
    let edit = |name: &str| {
        containerd::add_import(Some(&read(&format!("{name}.toml"))), IMPORT)
            .unwrap()
            .unwrap()
    };
    let default = edit("containerd-1.7-default");
    assert!(default.starts_with(&format!(
        "disabled_plugins = []\nimports = [\"{IMPORT}\"]\noom_score = 0\n"
    )));
    let debian = edit("debian-bookworm");
    assert!(debian.starts_with(&format!(
        "version = 2\nimports = [\"{IMPORT}\"]\n\n[plugins]\n"
    )));
    // A new line indented like the user's, their comment left on their line.
    let user = edit("user-custom");
    assert!(
        user.contains(&format!(
            "imports = [\n\t\"/etc/containerd/puppet/registries.toml\",  # puppet\n\t\"{IMPORT}\",\n]\n"
        )),
        "{user}"
    );
}

#[test]
fn drop_ins_carry_the_whole_cri_table() {
    for name in CASES {
        let main_text = read(&format!("{name}.toml"));
        let main: DocumentMut = main_text.parse().unwrap();
        let version = containerd::detect_version(Some(&main_text)).unwrap();
        let path = containerd::cri_table_path(version);
        let drop_in: DocumentMut = containerd::render_drop_in(Some(&main_text), &opts())
            .unwrap()
            .parse()
            .unwrap_or_else(|e| panic!("{name}: drop-in is not TOML: {e}"));
        assert_eq!(
            drop_in["version"].as_integer(),
            Some(version.number()),
            "{name}"
        );
        let plugins = table_at(&drop_in, &["plugins"]);
        assert_eq!(plugins.len(), 1, "{name}: only the CRI plugin table");
        let cri = table_at(&drop_in, path);
        assert_eq!(cri["enable_cdi"].as_bool(), Some(true), "{name}");

        // Every key of the user's CRI table is there, same value, except
        // what we set.
        let mut want = Vec::new();
        leaves(table_at(&main, path), "", &mut want);
        let mut got = Vec::new();
        leaves(cri, "", &mut got);
        for (k, v) in &want {
            if k == ".enable_cdi"
                || k == ".cdi_spec_dirs"
                || k.starts_with(".containerd.runtimes.nvidia.")
            {
                continue;
            }
            assert!(
                got.contains(&(k.clone(), v.clone())),
                "{name}: {k} = {v} lost"
            );
        }
        // Our dirs added, the user's kept.
        let dirs: Vec<&str> = cri["cdi_spec_dirs"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert!(dirs.contains(&"/var/run/cdi"), "{name}: {dirs:?}");
        if let Some(theirs) = table_at(&main, path)
            .get("cdi_spec_dirs")
            .and_then(Item::as_array)
        {
            for d in theirs.iter().filter_map(Value::as_str) {
                assert!(dirs.contains(&d), "{name}: {d} lost");
            }
        }
        // The handler: plain runc, never the default.
        let h = cri["containerd"]["runtimes"]["nvidia"].as_table().unwrap();
        assert_eq!(
            h["runtime_type"].as_str(),
            Some("io.containerd.runc.v2"),
            "{name}"
        );
        let binary = h
            .get("options")
            .and_then(|o| o.get("BinaryName"))
            .and_then(Item::as_str);
        assert!(
            !binary.is_some_and(|b| b.contains("nvidia")),
            "{name}: {binary:?}"
        );
        assert_eq!(
            cri.get("containerd")
                .and_then(|c| c.get("default_runtime_name"))
                .and_then(Item::as_str),
            table_at(&main, path)
                .get("containerd")
                .and_then(|c| c.get("default_runtime_name"))
                .and_then(Item::as_str),
            "{name}: default runtime untouched"
        );
    }
}

#[test]
fn systemd_cgroup_reaches_the_handler() {
    // Where the copied runtime has SystemdCgroup = true, the handler has it too.
    for (name, want) in [
        ("containerd-1.7-default", false),
        ("containerd-2-v3", true),
        ("k3s-generated", true),
        ("user-custom", true),
    ] {
        let text =
            containerd::render_drop_in(Some(&read(&format!("{name}.toml"))), &opts()).unwrap();
        let doc: DocumentMut = text.parse().unwrap();
        let version = containerd::detect_version(Some(&read(&format!("{name}.toml")))).unwrap();
        let cri = table_at(&doc, containerd::cri_table_path(version));
        let h = &cri["containerd"]["runtimes"]["nvidia"];
        assert_eq!(
            h["options"]["SystemdCgroup"].as_bool(),
            Some(want),
            "{name}"
        );
        assert_eq!(
            cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"].as_bool(),
            Some(want),
            "{name}"
        );
    }
    // The user file's default is the old NVIDIA shim: the handler copies runc
    // (its Root included), not the shim.
    let text = containerd::render_drop_in(Some(&read("user-custom.toml")), &opts()).unwrap();
    let doc: DocumentMut = text.parse().unwrap();
    let h = &doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["nvidia"];
    assert_eq!(h["options"]["Root"].as_str(), Some("/run/runc-k8s"));
    assert!(h["options"].get("BinaryName").is_none());
    assert_eq!(h["pod_annotations"].as_array().map(|a| a.len()), Some(1));
}

#[test]
fn no_main_config() {
    let created = containerd::add_import(None, IMPORT).unwrap();
    assert_eq!(
        created,
        Some(format!("version = 2\nimports = [\"{IMPORT}\"]\n"))
    );
    let drop_in = containerd::render_drop_in(None, &opts()).unwrap();
    let doc: DocumentMut = drop_in.parse().unwrap();
    let cri = table_at(&doc, &["plugins", "io.containerd.grpc.v1.cri"]);
    let dirs: Vec<&str> = cri["cdi_spec_dirs"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    // containerd's own defaults stay: setting the key replaces them.
    assert_eq!(dirs, ["/etc/cdi", "/var/run/cdi"]);
}

// ---- effective config -------------------------------------------------

/// Shaped like containerd 1.7's CRI Status verbose info["config"].
fn status_config(enable_cdi: bool, dirs: &[&str], runtimes: &[&str]) -> String {
    let runtimes: serde_json::Map<String, serde_json::Value> = runtimes
        .iter()
        .map(|r| {
            (
                r.to_string(),
                serde_json::json!({
                    "runtimeType": "io.containerd.runc.v2",
                    "runtimePath": "",
                    "options": {"SystemdCgroup": true},
                    "privileged_without_host_devices": false,
                    "sandboxMode": "podsandbox"
                }),
            )
        })
        .collect();
    serde_json::json!({
        "containerd": {
            "snapshotter": "overlayfs",
            "defaultRuntimeName": "runc",
            "runtimes": runtimes,
            "noPivot": false
        },
        "cni": {"binDir": "/opt/cni/bin", "confDir": "/etc/cni/net.d"},
        "registry": {"configPath": ""},
        "enableSelinux": false,
        "enableCDI": enable_cdi,
        "cdiSpecDirs": dirs,
        "sandboxImage": "registry.k8s.io/pause:3.8",
        "containerdRootDir": "/var/lib/containerd"
    })
    .to_string()
}

#[test]
fn gaps_of_the_running_config() {
    let o = opts();
    let off = status_config(false, &["/etc/cdi", "/var/run/cdi"], &["runc"]);
    assert_eq!(
        containerd::effective_gaps(&off, &o).unwrap(),
        [
            Gap::CdiDisabled,
            Gap::RuntimeHandlerMissing("nvidia".into())
        ]
    );
    let without_dir = status_config(true, &["/etc/cdi"], &["runc", "nvidia"]);
    assert_eq!(
        containerd::effective_gaps(&without_dir, &o).unwrap(),
        [Gap::SpecDirMissing("/var/run/cdi".into())]
    );
    let good = status_config(true, &["/etc/cdi", "/var/run/cdi/"], &["runc", "nvidia"]);
    assert_eq!(containerd::effective_gaps(&good, &o).unwrap(), []);
    let no_handler = status_config(true, &["/var/run/cdi"], &["runc"]);
    let gaps = containerd::effective_gaps(&no_handler, &o).unwrap();
    assert_eq!(gaps, [Gap::RuntimeHandlerMissing("nvidia".into())]);
    assert_eq!(
        gaps[0].to_string(),
        "the running containerd has no runtime handler \"nvidia\", so pods of a RuntimeClass with that handler cannot start"
    );
    assert!(Gap::CdiDisabled.to_string().contains("CDI turned off"));
    assert!(
        Gap::SpecDirMissing("/x".into())
            .to_string()
            .contains("from \"/x\"")
    );
    // Without a handler wanted, runtimes do not matter.
    let plain = RuntimeOptions {
        runtime_handler: None,
        ..opts()
    };
    assert_eq!(containerd::effective_gaps(&no_handler, &plain).unwrap(), []);
}

#[test]
fn gaps_tolerate_other_shapes() {
    let o = opts();
    // containerd 2.x-like: runtimes at the top level.
    let top = r#"{"enableCDI": true, "cdiSpecDirs": ["/var/run/cdi"], "runtimes": {"nvidia": {"runtimeType": "io.containerd.runc.v2"}}}"#;
    assert_eq!(containerd::effective_gaps(top, &o).unwrap(), []);
    // No runtimes at all, no CDI keys at all (containerd 1.6): all gaps, no error.
    assert_eq!(
        containerd::effective_gaps(r#"{"containerd": {"snapshotter": "overlayfs"}}"#, &o).unwrap(),
        [
            Gap::CdiDisabled,
            Gap::SpecDirMissing("/var/run/cdi".into()),
            Gap::RuntimeHandlerMissing("nvidia".into())
        ]
    );
}

#[test]
fn gaps_of_malformed_json_are_errors() {
    let o = opts();
    for (bad, want) in [
        ("{\"enableCDI\": tru", "it is not JSON"),
        ("[1, 2]", "it is an array, not a JSON object"),
        (
            "{\"enableCDI\": \"yes\"}",
            "enableCDI is a string, not a boolean",
        ),
        (
            "{\"enableCDI\": true, \"cdiSpecDirs\": \"/etc/cdi\"}",
            "cdiSpecDirs is a string",
        ),
        (
            "{\"enableCDI\": true, \"cdiSpecDirs\": [1]}",
            "cdiSpecDirs holds a number",
        ),
        (
            "{\"enableCDI\": true, \"containerd\": {\"runtimes\": []}}",
            "containerd.runtimes is an array",
        ),
    ] {
        let err = containerd::effective_gaps(bad, &o).unwrap_err();
        assert!(matches!(err, ConfigError::EffectiveConfig { .. }), "{bad}");
        let msg = err.to_string();
        assert!(msg.contains(want), "{bad}: {msg}");
        assert!(msg.contains("CRI Status"), "{msg}");
    }
}

// ---- generated configs -------------------------------------------------

const ENTRY_POOL: [&str; 6] = [
    "/etc/containerd/conf.d/*.toml",
    "/etc/containerd/conf.d/99-gpu-stack.toml",
    "/etc/containerd/conf.d/??-*",
    "/etc/containerd/other/*.toml",
    "/etc/containerd/puppet/registries.toml",
    "conf.d/*.toml",
];

const ROOT_KEYS: [&str; 5] = [
    "root = \"/var/lib/containerd\"",
    "state = '/run/containerd'",
    "oom_score = 0",
    "disabled_plugins = []",
    "required_plugins = [\n  \"io.containerd.grpc.v1.cri\",\n]",
];

const TABLES: [&str; 7] = [
    "[plugins.\"io.containerd.grpc.v1.cri\"]",
    "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]",
    "[plugins.\"io.containerd.grpc.v1.cri\".cni]",
    "[plugins.'io.containerd.cri.v1.runtime']",
    "[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]",
    "[grpc]",
    "[metrics]",
];

const TABLE_KEYS: [&str; 6] = [
    "SystemdCgroup = true",
    "sandbox_image = \"registry.k8s.io/pause:3.9\"",
    "enable_cdi = false",
    "cdi_spec_dirs = ['/opt/cdi', \"/etc/cdi\"]",
    "address = \"/run/containerd/containerd.sock\" # sock",
    "max_conf_num = 1",
];

#[derive(Debug, Clone)]
struct Imports {
    entries: Vec<&'static str>,
    literal: bool,
    multiline: bool,
    trailing_comma: bool,
    comment: bool,
    /// Index among the root keys where the key sits.
    at: usize,
}

#[derive(Debug, Clone)]
struct Config {
    text: String,
    version: Option<i64>,
    imports: Option<Imports>,
    empty_otherwise: bool,
}

fn filler() -> impl Strategy<Value = Vec<String>> {
    prop::collection::vec(
        prop_oneof![
            Just(String::new()),
            "[a-z ]{0,12}".prop_map(|c| format!("# {c}")),
            "[ \t]{1,3}".prop_map(|w| format!("{w}# indented")),
        ],
        0..3,
    )
}

fn imports_strategy() -> impl Strategy<Value = Imports> {
    (
        prop::sample::subsequence(ENTRY_POOL.to_vec(), 0..=3),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        0usize..6,
    )
        .prop_map(
            |(entries, literal, multiline, trailing_comma, comment, at)| Imports {
                entries,
                literal,
                multiline,
                trailing_comma,
                comment,
                at,
            },
        )
}

fn render_imports(i: &Imports, nl: &str) -> String {
    let q = |e: &str| {
        if i.literal {
            format!("'{e}'")
        } else {
            format!("\"{e}\"")
        }
    };
    let mut s = String::from("imports = [");
    if i.comment {
        s.push_str(" # ours and theirs");
        s.push_str(nl);
    }
    for (n, e) in i.entries.iter().enumerate() {
        if i.multiline {
            if !i.comment || n > 0 {
                s.push_str(nl);
            }
            s.push_str("    ");
        } else if n > 0 {
            s.push(' ');
        }
        s.push_str(&q(e));
        if n + 1 < i.entries.len() || i.trailing_comma {
            s.push(',');
        }
        // Per-entry notes, where a line end follows.
        if i.multiline && i.comment && n % 2 == 0 {
            s.push_str("  # note");
        }
    }
    if i.multiline || i.comment {
        s.push_str(nl);
    }
    s.push(']');
    s
}

fn config_strategy() -> impl Strategy<Value = Config> {
    (
        filler(),
        prop_oneof![Just(None), Just(Some(2i64)), Just(Some(3i64))],
        any::<bool>(),
        prop::sample::subsequence(ROOT_KEYS.to_vec(), 0..=3),
        prop::option::of(imports_strategy()),
        prop::collection::vec(
            (
                prop::sample::subsequence(TABLE_KEYS.to_vec(), 0..=3),
                prop_oneof![Just(""), Just("  "), Just("\t")],
                filler(),
            ),
            TABLES.len(),
        ),
        prop::sample::subsequence((0..TABLES.len()).collect::<Vec<_>>(), 0..=4),
        (any::<bool>(), prop::bool::weighted(0.15)),
    )
        .prop_map(
            |(lead, version, version_comment, roots, imports, bodies, tables, (final_nl, crlf))| {
                let nl = if crlf { "\r\n" } else { "\n" };
                let mut lines: Vec<String> = lead;
                if let Some(v) = version {
                    lines.push(if version_comment {
                        format!("version = {v}   # schema")
                    } else {
                        format!("version = {v}")
                    });
                }
                let mut root: Vec<String> = roots.iter().map(|r| r.replace('\n', nl)).collect();
                if let Some(i) = &imports {
                    root.insert(i.at.min(root.len()), render_imports(i, nl));
                }
                lines.extend(root);
                for t in &tables {
                    let (keys, indent, fill) = &bodies[*t];
                    lines.extend(fill.iter().cloned());
                    lines.push(TABLES[*t].to_string());
                    lines.extend(keys.iter().map(|k| format!("{indent}{k}")));
                }
                let empty_otherwise =
                    version.is_none() && roots.is_empty() && imports.is_none() && tables.is_empty();
                let mut text = lines.join(nl);
                if final_nl && !text.is_empty() {
                    text.push_str(nl);
                }
                Config {
                    text,
                    version,
                    imports,
                    empty_otherwise,
                }
            },
        )
}

/// The generator reaches every outcome: an edit, already imported, version 1.
#[test]
fn generator_covers_every_outcome() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let strategy = config_strategy();
    let (mut edited, mut covered, mut v1, mut fresh_key, mut crlf, mut v3) = (0, 0, 0, 0, 0, 0);
    for _ in 0..400 {
        let cfg = strategy.new_tree(&mut runner).unwrap().current();
        match containerd::add_import(Some(&cfg.text), IMPORT) {
            Ok(Some(_)) => edited += 1,
            Ok(None) => covered += 1,
            Err(_) => v1 += 1,
        }
        fresh_key += usize::from(cfg.imports.is_none() && cfg.version.is_some());
        crlf += usize::from(cfg.text.contains("\r\n"));
        v3 += usize::from(cfg.version == Some(3));
    }
    for (what, n) in [
        ("edited", edited),
        ("covered", covered),
        ("v1", v1),
        ("new key", fresh_key),
        ("crlf", crlf),
        ("v3", v3),
    ] {
        assert!(n >= 10, "{what}: {n}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// add_import is undone by remove_import byte for byte, is idempotent,
    /// and the drop-in always turns CDI on with our directories.
    #[test]
    fn import_round_trip_and_drop_in(cfg in config_strategy()) {
        let x = &cfg.text;
        prop_assert!(x.parse::<DocumentMut>().is_ok(), "generator made invalid TOML: {x:?}");
        let v1 = cfg.version.is_none() && !cfg.empty_otherwise;
        let covered = cfg.imports.as_ref().is_some_and(|i| {
            i.entries.iter().any(|e| matches!(*e, "/etc/containerd/conf.d/*.toml" | "/etc/containerd/conf.d/99-gpu-stack.toml" | "/etc/containerd/conf.d/??-*"))
        });
        match containerd::add_import(Some(x), IMPORT) {
            Err(e) => prop_assert!(v1 && matches!(e, ConfigError::Version1 { .. }), "{e}"),
            Ok(None) => prop_assert!(covered && !v1),
            Ok(Some(edited)) => {
                prop_assert!(!covered && !v1);
                prop_assert_eq!(containerd::add_import(Some(&edited), IMPORT).unwrap(), None);
                let doc: DocumentMut = edited.parse().unwrap();
                let imports: Vec<&str> = doc["imports"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
                prop_assert!(imports.contains(&IMPORT));
                let added_key = cfg.imports.is_none();
                prop_assert_eq!(&containerd::remove_import(&edited, IMPORT, added_key).unwrap(), x);
                // Without the key removal the rest still matches.
                let kept = containerd::remove_import(&edited, IMPORT, false).unwrap();
                prop_assert!(kept.parse::<DocumentMut>().is_ok());
            }
        }
        if !v1 {
            let drop_in = containerd::render_drop_in(Some(x), &opts()).unwrap();
            prop_assert_eq!(&drop_in, &containerd::render_drop_in(Some(x), &opts()).unwrap());
            let doc: DocumentMut = drop_in.parse().unwrap();
            let version = if cfg.version == Some(3) { ConfigVersion::V3 } else { ConfigVersion::V2 };
            prop_assert_eq!(containerd::detect_version(Some(x)).unwrap(), version);
            prop_assert_eq!(doc["version"].as_integer(), Some(version.number()));
            let cri = table_at(&doc, containerd::cri_table_path(version));
            prop_assert_eq!(cri["enable_cdi"].as_bool(), Some(true));
            let dirs: Vec<&str> = cri["cdi_spec_dirs"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
            prop_assert!(dirs.contains(&"/var/run/cdi"));
            prop_assert_eq!(
                cri["containerd"]["runtimes"]["nvidia"]["runtime_type"].as_str(),
                Some("io.containerd.runc.v2")
            );
        }
    }
}

/// With `CONTAINERD_BIN` set to a containerd binary (`cargo xtask test`
/// sets it to the real node's): containerd itself loads each golden main
/// config of the config version it reads (3 from containerd 2.0, 2 before)
/// with its drop-in (`config dump`) and ends up with CDI on, the handler,
/// the built-in `runc`, and the user's CRI settings. Without it the check is
/// skipped (it needs the binary).
#[test]
fn containerd_reads_the_goldens_as_meant() {
    let Ok(bin) = std::env::var("CONTAINERD_BIN") else {
        eprintln!("CONTAINERD_BIN not set: containerd's own reading of the goldens not checked");
        return;
    };
    let version = std::process::Command::new(&bin)
        .arg("--version")
        .output()
        .unwrap();
    let version = String::from_utf8_lossy(&version.stdout).into_owned();
    // "containerd github.com/containerd/containerd/v2 2.3.7 ..." or "... v1.7.35 ...".
    let config_version = if version.contains("containerd/containerd/v2 ") {
        3
    } else {
        2
    };
    let dir = std::env::temp_dir().join(format!("gpu-stack-toolkit-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let drop_in = dir.join("99-gpu-stack.toml");
    let elsewhere = dir.join("registries.toml");
    fs::write(&elsewhere, "version = 2\n").unwrap();
    let cases: &[(&str, &str)] = if config_version == 3 {
        &[("containerd-2-v3", "registry.k8s.io/pause:3.10")]
    } else {
        &[
            ("containerd-1.7-default", "registry.k8s.io/pause:3.8"),
            ("debian-bookworm", "registry.k8s.io/pause:3.8"),
            ("k3s-generated", "rancher/mirrored-pause:3.6"),
            ("user-custom", "registry.internal.example/pause:3.9"),
        ]
    };
    for &(name, sandbox_image) in cases {
        let main = read(&format!("{name}.main.toml"))
            .replace(IMPORT, drop_in.to_str().unwrap())
            .replace(
                "/etc/containerd/puppet/registries.toml",
                elsewhere.to_str().unwrap(),
            );
        let main_path = dir.join("config.toml");
        fs::write(&main_path, main).unwrap();
        fs::write(&drop_in, read(&format!("{name}.dropin.toml"))).unwrap();
        let out = std::process::Command::new(&bin)
            .arg("--config")
            .arg(&main_path)
            .args(["config", "dump"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{name} on {version}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dump: DocumentMut = String::from_utf8(out.stdout).unwrap().parse().unwrap();
        let (runtime, images, sandbox_key) = if config_version == 3 {
            (
                table_at(&dump, &["plugins", "io.containerd.cri.v1.runtime"]),
                table_at(
                    &dump,
                    &["plugins", "io.containerd.cri.v1.images", "pinned_images"],
                ),
                "sandbox",
            )
        } else {
            let cri = table_at(&dump, &["plugins", "io.containerd.grpc.v1.cri"]);
            (cri, cri, "sandbox_image")
        };
        // containerd 2.4 has no switch any more: CDI is always on there.
        let cdi = runtime.get("enable_cdi").map(|v| v.as_bool());
        assert!(
            matches!(cdi, Some(Some(true))) || (config_version == 3 && cdi.is_none()),
            "{name}: enable_cdi is {cdi:?}"
        );
        assert_eq!(images[sandbox_key].as_str(), Some(sandbox_image), "{name}");
        let runtimes = runtime["containerd"]["runtimes"].as_table().unwrap();
        assert!(
            runtimes.contains_key("runc") && runtimes.contains_key("nvidia"),
            "{name}"
        );
    }
    fs::remove_dir_all(&dir).unwrap();
}

/// NVIDIA's toolkit 1.19.1 wrote a drop-in whose `version` differed from the
/// root config's, and containerd refused to start: every drop-in gpu-stack
/// writes carries its root config's version.
#[test]
fn every_drop_in_has_its_root_configs_version() {
    let version = |text: &str| {
        text.parse::<DocumentMut>().unwrap()["version"]
            .as_integer()
            .unwrap_or(1)
    };
    for name in CASES {
        let main = version(&read(&format!("{name}.main.toml")));
        let drop_in = version(&read(&format!("{name}.dropin.toml")));
        assert_eq!(drop_in, main, "{name}");
    }
}
