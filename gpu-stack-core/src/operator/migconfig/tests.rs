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
        placements: None,
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
                placements: None,
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
                placements: None,
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
                placements: None,
            },
            LayoutRule {
                model: Some("Voodoo5".into()),
                source: LayoutSource::Disabled,
                placements: None,
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
                placements: None,
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

fn h100_rule(counts: &[(&str, u32)], placements: &str) -> LayoutRule {
    LayoutRule {
        model: Some("H100-SXM5-80GB".into()),
        source: profiles(counts),
        placements: Some(crate::mig::parse_layout(placements).unwrap()),
    }
}

#[test]
fn placements_travel_in_a_comment_nvidia_ignores_and_read_back() {
    let c = cr(
        "placed",
        "x",
        vec![h100_rule(
            &[("1g.10gb", 2), ("3g.40gb", 1)],
            "3g.40gb@4,1g.10gb@0,1g.10gb@1",
        )],
    );
    let entry = generate(&c, &shipped()).unwrap();
    let yaml = entries_yaml(std::slice::from_ref(&entry));
    assert!(
        yaml.contains(
            "      # gpustack.io/placements gpustack-placed[0]: 3g.40gb@4 1g.10gb@0 1g.10gb@1\n"
        ),
        "{yaml}"
    );
    let back = MigPartedConfig::from_yaml(&format!("{DEFAULT_CONFIG_YAML}{yaml}")).unwrap();
    assert_eq!(back.get("gpustack-placed"), Some(&entry));
    let h100 = catalog::lookup("H100-SXM5-80GB").unwrap();
    let EntryVerdict::Valid { layout } =
        check_entry(&back.get("gpustack-placed").unwrap().entries[0], h100)
    else {
        panic!("invalid");
    };
    assert_eq!(
        crate::mig::format_layout(&layout),
        "3g.40gb@4,1g.10gb@0,1g.10gb@1"
    );
}

#[test]
fn bad_placements_are_refused_with_the_reason() {
    // Overlapping: the geometry's reason names the instances.
    let e = generate(
        &cr(
            "o",
            "x",
            vec![h100_rule(
                &[("3g.40gb", 1), ("4g.40gb", 1)],
                "3g.40gb@0,4g.40gb@0",
            )],
        ),
        &shipped(),
    )
    .unwrap_err();
    let text = e[0].to_string();
    assert!(
        matches!(&e[0], MigConfigError::LayoutInvalid { index: 0, .. })
            && text.contains("placements 3g.40gb@0,4g.40gb@0"),
        "{text}"
    );
    // A start the profile does not allow.
    let e = generate(
        &cr("s", "x", vec![h100_rule(&[("3g.40gb", 1)], "3g.40gb@1")]),
        &shipped(),
    )
    .unwrap_err();
    assert!(e[0].to_string().contains("3g.40gb@1"), "{}", e[0]);
    // Counts and placements that differ.
    let e = generate(
        &cr("m", "x", vec![h100_rule(&[("1g.10gb", 2)], "1g.10gb@0")]),
        &shipped(),
    )
    .unwrap_err();
    assert!(
        matches!(&e[0], MigConfigError::PlacementsMismatch { .. })
            && e[0]
                .to_string()
                .contains("place 1 1g.10gb but the counts ask for 2"),
        "{}",
        e[0]
    );
    // Placements with a named config.
    let mut rule = h100_rule(&[("1g.10gb", 1)], "1g.10gb@0");
    rule.source = LayoutSource::Named("all-balanced".into());
    let e = generate(&cr("n", "x", vec![rule]), &shipped()).unwrap_err();
    assert!(
        e[0].to_string()
            .contains("placements go with profiles only"),
        "{}",
        e[0]
    );
    // The rule for every other model is checked per node.
    let mut rule = h100_rule(&[("3g.40gb", 1)], "3g.40gb@1");
    rule.model = None;
    let c = cr("rest", "x", vec![rule]);
    let node = MigNode {
        name: "n0".into(),
        labels: [("pool".to_string(), "x".to_string())].into(),
        models: vec!["H100-SXM5-80GB".into()],
    };
    let plan = plan_mig_configs(&[c], &[node], &shipped(), &MigPartedConfig::default());
    let st = &plan.statuses["rest"][0];
    assert_eq!(st.state, NodeState::Invalid);
    assert!(st.reason.contains("placements 3g.40gb@1"), "{}", st.reason);
    assert!(plan.labels.is_empty());
}

#[test]
fn placement_comments_that_name_nothing_or_disagree_are_refused() {
    let base = "version: v1\nmig-configs:\n  a:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {\"1g.10gb\": 1}\n";
    for (comment, want) in [
        (
            "# gpustack.io/placements b[0]: 1g.10gb@0",
            "mig-configs.b[0]",
        ),
        (
            "# gpustack.io/placements a[1]: 1g.10gb@0",
            "entry the file does not have",
        ),
        (
            "# gpustack.io/placements a[0]: 1g.10gb@0 1g.10gb@1",
            "place 2 1g.10gb",
        ),
        (
            "# gpustack.io/placements a[0]: 1g.10gb",
            "expected <profile>@<start>",
        ),
        (
            "# gpustack.io/placements a0: 1g.10gb@0",
            "expected `# gpustack.io/placements",
        ),
    ] {
        let e = MigPartedConfig::from_yaml(&format!("{base}      {comment}\n")).unwrap_err();
        assert!(e.to_string().contains(want), "{comment}: {e}");
    }
    let twice = format!(
        "{base}# gpustack.io/placements a[0]: 1g.10gb@0\n# gpustack.io/placements a[0]: 1g.10gb@1\n"
    );
    assert!(
        MigPartedConfig::from_yaml(&twice)
            .unwrap_err()
            .to_string()
            .contains("twice")
    );
    // Other comments stay comments.
    let ok =
        MigPartedConfig::from_yaml(&format!("{base}# gpustack.io/placement a[0]: x\n")).unwrap();
    assert_eq!(ok.mig_configs[0].entries[0].placements, None);
}

/// A random valid H100 layout: instances added while the geometry accepts them.
fn arb_h100_layout() -> impl Strategy<Value = Vec<PlacedInstance>> {
    prop::collection::vec((0usize..64, 0usize..64), 1..10).prop_map(|picks| {
        let geo = catalog::lookup("H100-SXM5-80GB")
            .unwrap()
            .mig
            .as_ref()
            .unwrap();
        let mut layout: Vec<PlacedInstance> = Vec::new();
        for (p, s) in picks {
            let gi = &geo.gi_profiles[p % geo.gi_profiles.len()];
            if gi.placements.is_empty() {
                continue;
            }
            let start = gi.placements[s % gi.placements.len()].start;
            let mut next = layout.clone();
            next.push(PlacedInstance::new(gi.name.clone(), start));
            if crate::mig::validate(geo, &next).is_ok() {
                layout = next;
            }
        }
        layout
    })
}

proptest! {
    /// Any valid placed layout, with the counts it gives, is accepted, read
    /// back unchanged from the emitted file, and selected by the MIG manager
    /// at exactly those starts.
    #[test]
    fn placements_round_trip_and_are_what_the_mig_manager_creates(layout in arb_h100_layout()) {
        prop_assume!(!layout.is_empty());
        let mut counts: Vec<(MigProfileName, u32)> = Vec::new();
        for i in &layout {
            match counts.iter_mut().find(|(p, _)| *p == i.profile) {
                Some((_, n)) => *n += 1,
                None => counts.push((i.profile.clone(), 1)),
            }
        }
        let rule = LayoutRule {
            model: Some("H100-SXM5-80GB".into()),
            source: LayoutSource::Profiles(counts),
            placements: Some(layout.clone()),
        };
        let entry = generate(&cr("r", "x", vec![rule]), &shipped()).unwrap();
        let text = format!("{DEFAULT_CONFIG_YAML}{}", entries_yaml(std::slice::from_ref(&entry)));
        let back = MigPartedConfig::from_yaml(&text).unwrap();
        prop_assert_eq!(back.get("gpustack-r"), Some(&entry));
        let h100 = catalog::lookup("H100-SXM5-80GB").unwrap();
        let gpus = [crate::migmanager::target::GpuFacts {
            index: 0,
            pci_device_id: h100.pci_device_ids[0],
            geometry: h100.mig.as_ref(),
            current: vec![],
        }];
        let sel = crate::migmanager::target::select(&back, "gpustack-r", &gpus).unwrap();
        prop_assert_eq!(&sel[0].1.layout, &layout);
        let mut starts: Vec<u32> = sel[0].1.target.gis.iter().map(|g| g.start).collect();
        let mut want: Vec<u32> = layout.iter().map(|p| p.start).collect();
        starts.sort_unstable();
        want.sort_unstable();
        prop_assert_eq!(starts, want);
    }
}
