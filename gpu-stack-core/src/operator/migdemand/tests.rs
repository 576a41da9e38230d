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
