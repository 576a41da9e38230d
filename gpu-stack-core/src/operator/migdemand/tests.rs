use proptest::prelude::*;

use super::*;
use crate::catalog;
use crate::mig::{MigGeometry, fit};

fn h100() -> &'static MigGeometry {
    catalog::lookup("H100-SXM5-80GB")
        .unwrap()
        .mig
        .as_ref()
        .unwrap()
}

fn p(name: &str) -> MigProfileName {
    name.parse().unwrap()
}

fn gpu(id: &str, current: Vec<PlacedInstance>, in_use: Vec<PlacedInstance>) -> FleetGpu<'static> {
    FleetGpu {
        id: id.into(),
        geometry: h100(),
        mig_enabled: true,
        current,
        in_use,
    }
}

fn empty_node(name: &str, gpus: usize) -> DemandNode<'static> {
    DemandNode {
        name: name.into(),
        gpus: (0..gpus)
            .map(|i| gpu(&format!("{name}/{i}"), vec![], vec![]))
            .collect(),
        last_change: None,
    }
}

fn limits() -> DemandLimits {
    DemandLimits {
        min_interval_seconds: 60,
        max_nodes_per_pass: 8,
    }
}

#[test]
fn requests_become_demand_per_profile() {
    let d = demand_from_requests([
        ("nvidia.com/mig-1g.10gb", 2),
        ("nvidia.com/gpu", 1),
        ("nvidia.com/mig-3g.40gb", 1),
        ("nvidia.com/mig-1g.10gb", 3),
        ("nvidia.com/mig-nonsense", 9),
        ("cpu", 4),
    ]);
    assert_eq!(d, vec![(p("1g.10gb"), 5), (p("3g.40gb"), 1)]);
}

#[test]
fn nothing_changes_without_unmet_demand() {
    let layout = fit(h100(), &vec![(p("1g.10gb"), 7)]).unwrap();
    let nodes = [DemandNode {
        name: "a".into(),
        gpus: vec![gpu("a/0", layout.clone(), layout[..2].to_vec())],
        last_change: None,
    }];
    // Five idle 1g.10gb exist: five pending are served without a change.
    let d = decide(&nodes, &vec![(p("1g.10gb"), 5)], &limits(), 0).unwrap();
    assert_eq!(d, DemandDecision::default());
    let d = decide(&nodes, &Vec::new(), &limits(), 0).unwrap();
    assert_eq!(d, DemandDecision::default());
}

#[test]
fn demand_lands_on_the_fewest_nodes() {
    let nodes = [empty_node("b", 2), empty_node("a", 2), empty_node("c", 2)];
    let d = decide(
        &nodes,
        &vec![(p("1g.10gb"), 7), (p("3g.40gb"), 2)],
        &limits(),
        0,
    )
    .unwrap();
    assert!(d.unmet.is_empty(), "{d:?}");
    // 7 x 1g.10gb fill one GPU, 2 x 3g.40gb the other: one node.
    assert_eq!(d.changes.len(), 1, "{d:?}");
    assert_eq!(d.changes[0].node, "a");
}

#[test]
fn whole_nodes_change_rather_than_parts_of_many() {
    // Eight nodes of two GPUs at 3 x 2g.20gb; the first GPU of two nodes
    // fully in use. 28 x 1g.10gb and 12 x 3g.40gb take 64 compute slices,
    // ten GPUs at the fewest: five nodes, although changing parts of more
    // would keep more idle instances.
    let base: Vec<PlacedInstance> = [0, 2, 4]
        .iter()
        .map(|s| PlacedInstance::new(p("2g.20gb"), *s))
        .collect();
    let nodes: Vec<DemandNode<'static>> = (0..8)
        .map(|k| DemandNode {
            name: format!("n{k}"),
            gpus: (0..2)
                .map(|g| {
                    let used = if k < 2 && g == 0 {
                        base.clone()
                    } else {
                        vec![]
                    };
                    gpu(&g.to_string(), base.clone(), used)
                })
                .collect(),
            last_change: None,
        })
        .collect();
    let d = decide(
        &nodes,
        &vec![(p("1g.10gb"), 28), (p("3g.40gb"), 12)],
        &limits(),
        0,
    )
    .unwrap();
    assert!(d.unmet.is_empty(), "{d:?}");
    assert_eq!(d.changes.len(), 5, "{d:?}");
    assert!(d.changes.iter().all(|c| c.node != "n0" && c.node != "n1"));
}

#[test]
fn recently_changed_nodes_wait_and_passes_are_capped() {
    let mut nodes = vec![empty_node("a", 1), empty_node("b", 1)];
    nodes[0].last_change = Some(100);
    let d = decide(&nodes, &vec![(p("7g.80gb"), 1)], &limits(), 120).unwrap();
    assert_eq!(d.changes.len(), 1);
    assert_eq!(d.changes[0].node, "b", "a changed 20 s ago");
    let capped = DemandLimits {
        max_nodes_per_pass: 1,
        ..limits()
    };
    let nodes = [empty_node("a", 1), empty_node("b", 1)];
    let d = decide(&nodes, &vec![(p("7g.80gb"), 2)], &capped, 0).unwrap();
    assert_eq!(d.changes.len(), 1);
    assert_eq!(d.deferred.len(), 1);
}

/// A node of 1-3 H100s with a random valid layout, some instances in use.
fn arb_node(name: String) -> impl Strategy<Value = DemandNode<'static>> {
    const PROFILES: [&str; 4] = ["1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"];
    prop::collection::vec(
        (
            prop::collection::vec((prop::sample::select(&PROFILES[..]), 0u32..3), 0..3),
            any::<u8>(),
        ),
        1..3,
    )
    .prop_map(move |gpus| DemandNode {
        name: name.clone(),
        gpus: gpus
            .into_iter()
            .enumerate()
            .map(|(i, (want, mask))| {
                let demand: Demand = want.iter().map(|(n, c)| (p(n), *c)).collect();
                let current = fit(h100(), &demand).unwrap_or_default();
                let in_use = current
                    .iter()
                    .enumerate()
                    .filter(|(k, _)| mask & (1 << (k % 8)) != 0)
                    .map(|(_, x)| x.clone())
                    .collect();
                gpu(&format!("{name}/{i}"), current, in_use)
            })
            .collect(),
        last_change: None,
    })
}

fn arb_fleet() -> impl Strategy<Value = Vec<DemandNode<'static>>> {
    (1usize..4).prop_flat_map(|n| {
        (0..n)
            .map(|i| arb_node(format!("n{i}")))
            .collect::<Vec<_>>()
    })
}

fn arb_pending() -> impl Strategy<Value = Demand> {
    prop::collection::vec(
        (
            prop::sample::select(&["1g.10gb", "2g.20gb", "3g.40gb"][..]),
            1u32..6,
        ),
        0..3,
    )
    .prop_map(|v| {
        let named: Vec<(String, u32)> = v
            .iter()
            .map(|(n, c)| (format!("{MIG_RESOURCE_PREFIX}{n}"), *c))
            .collect();
        demand_from_requests(named.iter().map(|(r, c)| (r.as_str(), *c)))
    })
}

/// The fleet after a decision is carried out (changed GPUs take their targets).
fn applied(nodes: &[DemandNode<'static>], d: &DemandDecision) -> Vec<DemandNode<'static>> {
    let mut out = nodes.to_vec();
    for c in &d.changes {
        let n = out.iter_mut().find(|n| n.name == c.node).unwrap();
        for (id, target) in &c.gpus {
            let g = n.gpus.iter_mut().find(|g| &g.id == id).unwrap();
            g.current = target.clone();
        }
    }
    out
}

fn served(nodes: &[DemandNode<'_>], pending: &Demand) -> u32 {
    // Pending instances an idle instance of the fleet can take.
    pending
        .iter()
        .map(|(p, n)| {
            let idle: u32 = nodes
                .iter()
                .flat_map(|x| &x.gpus)
                .map(|g| count(&g.current, p).saturating_sub(count(&g.in_use, p)))
                .sum();
            idle.min(*n)
        })
        .sum()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// No in-use instance is ever removed, and once a decision is carried
    /// out the same demand changes nothing more.
    #[test]
    fn in_use_is_kept_and_a_stable_demand_settles(nodes in arb_fleet(), pending in arb_pending()) {
        let d = decide(&nodes, &pending, &limits(), 0).unwrap();
        for c in &d.changes {
            let n = nodes.iter().find(|n| n.name == c.node).unwrap();
            for (id, target) in &c.gpus {
                let g = n.gpus.iter().find(|g| &g.id == id).unwrap();
                for i in &g.in_use {
                    prop_assert!(target.contains(i), "{id}: in-use {i:?} removed");
                }
            }
        }
        let after = applied(&nodes, &d);
        let again = decide(&after, &pending, &limits(), 0).unwrap();
        prop_assert!(again.changes.is_empty(), "second decision changes {:?}", again.changes);
    }

    /// Adding an empty node never serves less of the pending demand.
    #[test]
    fn more_capacity_never_serves_less(nodes in arb_fleet(), pending in arb_pending()) {
        let d = decide(&nodes, &pending, &limits(), 0).unwrap();
        let before = served(&applied(&nodes, &d), &pending);
        let mut bigger = nodes.clone();
        bigger.push(empty_node("z-new", 2));
        let d2 = decide(&bigger, &pending, &limits(), 0).unwrap();
        let after = served(&applied(&bigger, &d2), &pending);
        prop_assert!(after >= before, "{after} < {before}");
    }
}

mod cluster_side {
    use super::*;
    use crate::migparted::MigPartedConfig;
    use crate::operator::migconfig::{
        LayoutRule, LayoutSource, MigConfigInput, MigNode, NodeState, plan_mig_configs,
    };
    use crate::operator::migusage::{GpuUsage, NodeUsage};

    fn i(s: &str) -> PlacedInstance {
        s.parse().unwrap()
    }

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn all_1g() -> Vec<PlacedInstance> {
        (0..7)
            .map(|s| PlacedInstance::new(p("1g.10gb"), s))
            .collect()
    }

    fn usage(gpus: &[(Vec<PlacedInstance>, Vec<PlacedInstance>)]) -> NodeUsage {
        NodeUsage {
            gpus: gpus
                .iter()
                .enumerate()
                .map(|(k, (layout, in_use))| GpuUsage {
                    index: k as u32,
                    model: "H100-SXM5-80GB".into(),
                    mig_enabled: true,
                    layout: layout.clone(),
                    in_use: in_use.clone(),
                })
                .collect(),
        }
    }

    #[test]
    fn a_pod_counts_for_the_first_compatible_migconfig_only() {
        let configs = vec![
            ("b".to_string(), labels(&[("pool", "x")])),
            ("a".to_string(), labels(&[("pool", "y")])),
        ];
        let pods = vec![
            PendingPod {
                node_selector: labels(&[("pool", "x")]),
                requests: vec![("nvidia.com/mig-1g.10gb".into(), 2)],
            },
            PendingPod {
                node_selector: Labels::new(),
                requests: vec![("nvidia.com/mig-3g.40gb".into(), 1)],
            },
            PendingPod {
                node_selector: labels(&[("pool", "z")]),
                requests: vec![("nvidia.com/mig-3g.40gb".into(), 1)],
            },
            PendingPod {
                node_selector: Labels::new(),
                requests: vec![("nvidia.com/gpu".into(), 1)],
            },
        ];
        let per = pending_per_config(&configs, &pods);
        assert_eq!(per["b"], vec![(p("1g.10gb"), 2)]);
        assert_eq!(per["a"], vec![(p("3g.40gb"), 1)]);
        assert_eq!(per.len(), 2);
    }

    #[test]
    fn a_node_config_names_its_content_and_lists_each_gpu() {
        let a = node_config("inf", &[(1, vec![i("3g.40gb@4")]), (0, all_1g())]);
        let b = node_config("inf", &[(0, all_1g()), (1, vec![i("3g.40gb@0")])]);
        let c = node_config(
            "inf",
            &[(0, all_1g()), (1, vec![i("3g.40gb@4"), i("1g.10gb@0")])],
        );
        let a_again = node_config("inf", &[(0, all_1g()), (1, vec![i("3g.40gb@4")])]);
        assert_eq!(a.name, a_again.name, "GPU order does not change the name");
        assert_ne!(a.name, b.name, "placements are part of the content");
        assert_ne!(a.name, c.name);
        assert_eq!(a.entries[1].placements, Some(vec![i("3g.40gb@4")]));
        assert!(a.name.starts_with("gpustack-inf_") && a.name.len() == "gpustack-inf_".len() + 8);
        assert_eq!(a.entries.len(), 2);
        assert_eq!(a.entries[0].devices, Devices::Indices(vec![0]));
        assert_eq!(a.entries[0].mig_devices, vec![(p("1g.10gb"), 7)]);
        assert_eq!(a.entries[1].mig_devices, vec![(p("3g.40gb"), 1)]);
        // mig-parted reads what entries_yaml writes.
        let text = format!(
            "version: v1\nmig-configs:{}",
            crate::operator::migconfig::entries_yaml(std::slice::from_ref(&a))
        );
        let parsed = MigPartedConfig::from_yaml(&text).unwrap();
        assert_eq!(parsed.get(&a.name).unwrap().entries, a.entries);
    }

    #[test]
    fn an_unapplied_decision_is_planned_as_the_decided_layout() {
        let d = Decided {
            node: "n".into(),
            at: 100,
            gpus: vec![(0, vec![i("3g.40gb@0"), i("3g.40gb@4")])],
        };
        let u = usage(&[(all_1g(), vec![i("1g.10gb@6")])]);
        let cfg = node_config("m", &d.gpus).name;
        let pending = labels(&[
            (MIG_CONFIG, cfg.as_str()),
            (MIG_CONFIG_STATE_LABEL, "pending"),
        ]);
        let n = demand_node("n", Some(&u), Some(&d), &pending, "m", 200).unwrap();
        assert_eq!(n.gpus[0].current, d.gpus[0].1);
        assert!(n.gpus[0].in_use.is_empty());
        assert_eq!(n.last_change, Some(100));
        // Applied and published: the published layout is the truth.
        let done = labels(&[
            (MIG_CONFIG, cfg.as_str()),
            (MIG_CONFIG_STATE_LABEL, "success"),
        ]);
        let u2 = usage(&[(d.gpus[0].1.clone(), vec![i("3g.40gb@0")])]);
        let n = demand_node("n", Some(&u2), Some(&d), &done, "m", 200).unwrap();
        assert_eq!(n.gpus[0].in_use, vec![i("3g.40gb@0")]);
        assert!(demand_node("n", None, Some(&d), &done, "m", 200).is_none());
        assert!(in_flight(&u, Some(&d), &pending, "m", 200));
        assert!(!in_flight(&u2, Some(&d), &done, "m", 200));
        assert!(!may_decide([false, true]));
        assert!(may_decide([false, false]));
        // Never applied and old: what the node publishes wins.
        let late = 100 + IN_FLIGHT_SECONDS;
        let n = demand_node("n", Some(&u), Some(&d), &pending, "m", late).unwrap();
        assert_eq!(n.gpus[0].current, all_1g());
    }

    #[test]
    fn decisions_replace_the_starting_layout_in_labels_and_status() {
        let shipped = MigPartedConfig::default_config().unwrap();
        let cr = MigConfigInput {
            name: "m".into(),
            node_selector: labels(&[("pool", "d")]),
            rules: vec![LayoutRule {
                model: None,
                source: LayoutSource::Profiles(vec![(p("1g.10gb"), 7)]),
                placements: None,
            }],
        };
        let d = Decided {
            node: "a".into(),
            at: 5,
            gpus: vec![(0, vec![i("3g.40gb@0"), i("3g.40gb@4")])],
        };
        let cfg = node_config("m", &d.gpus).name;
        let nodes = vec![
            MigNode {
                name: "a".into(),
                labels: labels(&[("pool", "d"), (MIG_CONFIG, "gpustack-m")]),
                models: vec!["H100-SXM5-80GB".into()],
            },
            MigNode {
                name: "b".into(),
                labels: labels(&[("pool", "d")]),
                models: vec!["H100-SXM5-80GB".into()],
            },
            MigNode {
                name: "c".into(),
                labels: labels(&[
                    ("pool", "d"),
                    (MIG_CONFIG, "gpustack-m_0badc0de"),
                    (MIG_CONFIG_STATE_LABEL, "success"),
                ]),
                models: vec!["H100-SXM5-80GB".into()],
            },
        ];
        let mut plan = plan_mig_configs(&[cr], &nodes, &shipped, &MigPartedConfig::default());
        apply_decisions(&mut plan, "m", &[d], &nodes);
        assert_eq!(plan.labels["a"][MIG_CONFIG], Some(cfg.clone()));
        assert_eq!(plan.labels["b"][MIG_CONFIG], Some("gpustack-m".into()));
        assert!(!plan.labels.contains_key("c"), "a generated layout stays");
        assert!(plan.entries.iter().any(|e| e.name == cfg));
        let st = &plan.statuses["m"];
        assert_eq!(st[0].state, NodeState::Pending);
        assert!(st[0].reason.contains(&cfg));
        assert_eq!(st[2].state, NodeState::Applied);
        let c = plan.counts["m"];
        assert_eq!((c.applied, c.pending, c.invalid), (1, 2, 0));
    }

    #[test]
    fn merging_keeps_the_newest_decision_of_selected_nodes() {
        let d = |node: &str, at| Decided {
            node: node.into(),
            at,
            gpus: vec![],
        };
        let merged = merge_decided(
            &[d("a", 1), d("b", 1)],
            &[d("a", 9), d("c", 9)],
            &["a", "c"],
        );
        assert_eq!(merged, vec![d("a", 9), d("c", 9)]);
    }

    proptest! {
        /// Compatibility is symmetric, and a selector is compatible with
        /// any superset of itself.
        #[test]
        fn compatibility_is_symmetric(
            a in prop::collection::btree_map("[ab]", "[xy]", 0..3),
            b in prop::collection::btree_map("[ab]", "[xy]", 0..3),
        ) {
            prop_assert_eq!(selector_compatible(&a, &b), selector_compatible(&b, &a));
            let mut sup = a.clone();
            sup.extend(b.iter().filter(|(k, _)| !a.contains_key(*k)).map(|(k, v)| (k.clone(), v.clone())));
            prop_assert!(selector_compatible(&a, &sup));
        }

        /// An in-flight decision keeps every instance in use that it kept,
        /// and the node is planned on the decided layout.
        #[test]
        fn in_flight_nodes_keep_in_use_instances(used in prop::collection::vec(0u32..7, 0..7)) {
            let in_use: Vec<PlacedInstance> = used.iter().map(|s| PlacedInstance::new(p("1g.10gb"), *s)).collect();
            let mut target: Vec<PlacedInstance> = in_use.clone();
            target.sort_by_key(|x| x.start);
            target.dedup();
            let d = Decided { node: "n".into(), at: 1, gpus: vec![(0, target.clone())] };
            let u = usage(&[(all_1g(), in_use.clone())]);
            let n = demand_node("n", Some(&u), Some(&d), &Labels::new(), "m", 2).unwrap();
            prop_assert_eq!(&n.gpus[0].current, &target);
            for x in &n.gpus[0].in_use {
                prop_assert!(target.contains(x));
            }
            prop_assert_eq!(n.gpus[0].in_use.len(), u.normalized().gpus[0].in_use.len());
        }
    }
}
