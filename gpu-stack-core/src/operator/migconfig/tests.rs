use proptest::prelude::*;

use super::*;
use crate::migparted::DEFAULT_CONFIG_YAML;

fn shipped() -> MigPartedConfig {
    MigPartedConfig::default_config().unwrap()
}

fn profiles(p: &[(&str, u32)]) -> LayoutSource {
    LayoutSource::Profiles(p.iter().map(|(n, c)| (n.parse().unwrap(), *c)).collect())
}

fn cr(name: &str, pool: &str, rules: Vec<LayoutRule>) -> MigConfigInput {
    MigConfigInput {
        name: name.into(),
        node_selector: [("pool".to_string(), pool.to_string())].into(),
        rules,
    }
}

fn all(source: LayoutSource) -> LayoutRule {
    LayoutRule {
        model: None,
        source,
    }
}

fn node(name: &str, pool: &str, models: &[&str], extra: &[(&str, &str)]) -> MigNode {
    let mut labels: Labels = [("pool".to_string(), pool.to_string())].into();
    for (k, v) in extra {
        labels.insert((*k).into(), (*v).into());
    }
    MigNode {
        name: name.into(),
        labels,
        models: models.iter().map(|m| (*m).to_string()).collect(),
    }
}

fn label(plan: &MigConfigPlan, node: &str) -> Option<String> {
    plan.labels
        .get(node)
        .and_then(|p| p.get(MIG_CONFIG))
        .cloned()
        .flatten()
}

#[test]
fn generated_entries_read_back_from_the_file_the_mig_manager_gets() {
    let c = cr(
        "mixed",
        "x",
        vec![
            LayoutRule {
                model: Some("A100-SXM4-40GB".into()),
                source: LayoutSource::Named("all-balanced".into()),
            },
            all(profiles(&[("1g.10gb", 2), ("3g.40gb", 1)])),
        ],
    );
    let entry = generate(&c, &shipped()).unwrap();
    assert_eq!(entry.name, "gpustack-mixed");
    let text = format!(
        "{DEFAULT_CONFIG_YAML}{}",
        entries_yaml(std::slice::from_ref(&entry))
    );
    let back = MigPartedConfig::from_yaml(&text).unwrap();
    assert_eq!(back.get("gpustack-mixed"), Some(&entry));
    // The shipped configs are all still there.
    assert_eq!(back.mig_configs.len(), shipped().mig_configs.len() + 1);
}

#[test]
fn each_mig_model_takes_exactly_one_rule() {
    let c = cr(
        "split",
        "x",
        vec![
            LayoutRule {
                model: Some("H100-SXM5-80GB".into()),
                source: profiles(&[("1g.10gb", 7)]),
            },
            all(LayoutSource::Disabled),
        ],
    );
    let entry = generate(&c, &shipped()).unwrap();
    for m in mig_models() {
        let matching: Vec<&MigConfigSpec> = entry
            .entries
            .iter()
            .filter(|e| e.matches_model(m))
            .collect();
        assert_eq!(matching.len(), 1, "{}", m.name);
        assert_eq!(
            matching[0].mig_enabled,
            m.name == "H100-SXM5-80GB",
            "{}",
            m.name
        );
    }
}

#[test]
fn bad_rules_are_refused_with_the_field_and_the_fix() {
    let bad = cr(
        "bad",
        "x",
        vec![
            LayoutRule {
                model: Some("H100-SXM5-80GB".into()),
                source: profiles(&[("1g.5gb", 1)]),
            },
            LayoutRule {
                model: Some("Voodoo5".into()),
                source: LayoutSource::Disabled,
            },
            all(LayoutSource::Disabled),
            all(LayoutSource::Disabled),
        ],
    );
    let problems = generate(&bad, &shipped()).unwrap_err();
    let text: Vec<String> = problems.iter().map(ToString::to_string).collect();
    assert_eq!(problems.len(), 3, "{text:#?}");
    assert!(
        text.iter()
            .any(|t| t.contains("\"Voodoo5\" is not a known GPU model"))
    );
    assert!(text.iter().any(|t| t.contains("layouts[3] repeats")));
    assert!(
        text.iter()
            .any(|t| t.starts_with("MigConfig bad: spec.layouts[0] on H100-SXM5-80GB:")),
        "{text:#?}"
    );
    let unknown = cr(
        "u",
        "x",
        vec![all(LayoutSource::Named("all-nothing".into()))],
    );
    let text = generate(&unknown, &shipped()).unwrap_err()[0].to_string();
    assert!(text.contains("\"all-nothing\" is not a config"), "{text}");
    let empty = cr("e", "x", vec![]);
    assert!(matches!(
        generate(&empty, &shipped()).unwrap_err()[..],
        [MigConfigError::NoLayouts { .. }]
    ));
    let long = cr(&"n".repeat(60), "x", vec![all(LayoutSource::Disabled)]);
    assert!(matches!(
        generate(&long, &shipped()).unwrap_err()[..],
        [MigConfigError::NameTooLong { len: 60, .. }]
    ));
}

#[test]
fn nodes_are_labelled_pending_then_applied_and_invalid_ones_untouched() {
    let c = cr("infer", "a", vec![all(profiles(&[("1g.10gb", 7)]))]);
    let nodes = [
        node("h100", "a", &["H100-SXM5-80GB"], &[]),
        node(
            "done",
            "a",
            &["H100-SXM5-80GB"],
            &[
                (MIG_CONFIG, "gpustack-infer"),
                (MIG_CONFIG_STATE_LABEL, "success"),
            ],
        ),
        // 7 x 1g.10gb does not exist on an A30 (4 slices, 1g.6gb).
        node("a30", "a", &["A30"], &[(MIG_CONFIG, "all-disabled")]),
        node("other", "b", &["H100-SXM5-80GB"], &[]),
        node("no-gpus", "a", &[], &[]),
    ];
    let p = plan_mig_configs(&[c], &nodes, &shipped(), &MigPartedConfig::default());
    assert_eq!(label(&p, "h100").as_deref(), Some("gpustack-infer"));
    assert!(!p.labels.contains_key("done"), "already labelled");
    assert!(
        !p.labels.contains_key("a30"),
        "invalid nodes are not touched"
    );
    assert!(!p.labels.contains_key("other") && !p.labels.contains_key("no-gpus"));
    let st: BTreeMap<&str, &NodeStatus> = p.statuses["infer"]
        .iter()
        .map(|s| (s.node.as_str(), s))
        .collect();
    assert_eq!(st.len(), 3);
    assert_eq!(st["h100"].state, NodeState::Pending);
    assert_eq!(st["done"].state, NodeState::Applied);
    assert_eq!(st["a30"].state, NodeState::Invalid);
    assert!(st["a30"].reason.starts_with("A30:"), "{}", st["a30"].reason);
    assert_eq!(p.entries.len(), 1);
}

#[test]
fn a_node_two_migconfigs_select_is_refused_for_both() {
    let one = cr("one", "a", vec![all(LayoutSource::Disabled)]);
    let mut two = cr("two", "a", vec![all(profiles(&[("7g.80gb", 1)]))]);
    two.node_selector.clear();
    let nodes = [node("n", "a", &["H100-SXM5-80GB"], &[])];
    let p = plan_mig_configs(&[one, two], &nodes, &shipped(), &MigPartedConfig::default());
    assert!(p.labels.is_empty());
    for name in ["one", "two"] {
        let s = &p.statuses[name][0];
        assert_eq!(s.state, NodeState::Invalid);
        assert!(s.reason.contains("one, two"), "{}", s.reason);
    }
}

#[test]
fn a_deleted_migconfig_keeps_its_entry_while_a_node_names_it() {
    let c = cr("gone", "a", vec![all(profiles(&[("1g.10gb", 7)]))]);
    let entry = generate(&c, &shipped()).unwrap();
    let previous = MigPartedConfig::from_yaml(&format!(
        "{DEFAULT_CONFIG_YAML}{}",
        entries_yaml(std::slice::from_ref(&entry))
    ))
    .unwrap();
    let labelled = [node(
        "n",
        "a",
        &["H100-SXM5-80GB"],
        &[(MIG_CONFIG, "gpustack-gone")],
    )];
    let p = plan_mig_configs(&[], &labelled, &shipped(), &previous);
    assert_eq!(p.entries, [entry]);
    assert!(p.labels.is_empty(), "the layout is left as it is");
    let relabelled = [node(
        "n",
        "a",
        &["H100-SXM5-80GB"],
        &[(MIG_CONFIG, "all-disabled")],
    )];
    let p = plan_mig_configs(&[], &relabelled, &shipped(), &previous);
    assert!(p.entries.is_empty());
}

fn arb_rules() -> impl Strategy<Value = Vec<LayoutRule>> {
    const MODELS: [&str; 5] = [
        "H100-SXM5-80GB",
        "A100-SXM4-40GB",
        "A100-SXM4-80GB",
        "A30",
        "H200-SXM5-141GB",
    ];
    let source = prop_oneof![
        Just(LayoutSource::Disabled),
        Just(LayoutSource::Named("all-balanced".into())),
        Just(LayoutSource::Named("all-1g.10gb".into())),
        (1u32..4).prop_map(|n| LayoutSource::Profiles(vec![("1g.10gb".parse().unwrap(), n)])),
    ];
    prop::collection::vec(
        (prop::option::of(prop::sample::select(&MODELS[..])), source),
        0..4,
    )
    .prop_map(|rules| {
        rules
            .into_iter()
            .map(|(m, source)| LayoutRule {
                model: m.map(str::to_string),
                source,
            })
            .collect()
    })
}

proptest! {
    /// Whatever the rules, an accepted MigConfig gives no MIG-capable GPU
    /// entries from two rules, its entries read back from the file, and
    /// every entry it applies to a model a rule names fits that model (the
    /// rule for the other models is checked per node).
    #[test]
    fn accepted_configs_are_unambiguous_and_round_trip(rules in arb_rules()) {
        let named: BTreeSet<String> = rules
            .iter()
            .filter_map(|r| r.model.as_deref())
            .filter_map(|m| catalog::lookup(m).ok())
            .map(|m| m.name.clone())
            .collect();
        let c = cr("p", "x", rules);
        if let Ok(entry) = generate(&c, &shipped()) {
            for m in mig_models() {
                let filters: BTreeSet<String> = entry
                    .entries
                    .iter()
                    .filter(|e| e.matches_model(m))
                    .map(|e| format!("{:?}", e.device_filter))
                    .collect();
                prop_assert!(filters.len() <= 1, "{} matched by {:?}", m.name, filters);
                for e in entry
                    .entries
                    .iter()
                    .filter(|e| named.contains(&m.name) && e.matches_model(m))
                {
                    let fits = !matches!(check_entry(e, m), EntryVerdict::Invalid { .. });
                    prop_assert!(fits, "{} cannot take {:?}", m.name, e);
                }
            }
            let text = format!("{DEFAULT_CONFIG_YAML}{}", entries_yaml(std::slice::from_ref(&entry)));
            let back = MigPartedConfig::from_yaml(&text).unwrap();
            prop_assert_eq!(back.get("gpustack-p"), Some(&entry));
        }
    }
}
