use proptest::prelude::*;

use super::*;
use crate::mig::MigProfileName;

fn i(s: &str) -> PlacedInstance {
    s.parse().unwrap()
}

fn p(s: &str) -> MigProfileName {
    s.parse().unwrap()
}

fn gpu(index: u32, layout: &[&str], in_use: &[&str]) -> GpuUsage {
    GpuUsage {
        index,
        model: "H100-SXM5-80GB".into(),
        mig_enabled: true,
        layout: layout.iter().map(|s| i(s)).collect(),
        in_use: in_use.iter().map(|s| i(s)).collect(),
    }
}

#[test]
fn a_node_round_trips_in_index_and_start_order() {
    let usage = NodeUsage {
        gpus: vec![
            gpu(1, &["3g.40gb@4", "3g.40gb@0"], &[]),
            gpu(0, &["1g.10gb@1", "1g.10gb@0"], &["1g.10gb@1"]),
            GpuUsage {
                mig_enabled: false,
                ..gpu(2, &[], &[])
            },
        ],
    };
    let text = encode(&usage).unwrap();
    assert_eq!(
        text,
        "v1;0,H100-SXM5-80GB,on,1g.10gb@0,1g.10gb@1*;1,H100-SXM5-80GB,on,3g.40gb@0,3g.40gb@4;2,H100-SXM5-80GB,off"
    );
    assert_eq!(decode(&text).unwrap(), usage.normalized());
    assert_eq!(decode("v1").unwrap(), NodeUsage::default());
}

#[test]
fn bad_values_are_refused_with_the_reason() {
    assert!(matches!(
        decode("v2;0,x,on"),
        Err(UsageError::Version { .. })
    ));
    assert!(matches!(
        decode("v1;zero,H100-SXM5-80GB,on"),
        Err(UsageError::Malformed { part: 0, .. })
    ));
    assert!(matches!(
        decode("v1;0,H100-SXM5-80GB,maybe"),
        Err(UsageError::Malformed { .. })
    ));
    assert!(matches!(
        decode("v1;0,H100-SXM5-80GB,on,1g.10gb"),
        Err(UsageError::Malformed { .. })
    ));
    assert!(matches!(
        decode(&"v1;0,H,on".repeat(2000)),
        Err(UsageError::TooLarge { .. })
    ));
    let stray = NodeUsage {
        gpus: vec![gpu(0, &["1g.10gb@0"], &["1g.10gb@1"])],
    };
    assert!(matches!(
        encode(&stray),
        Err(UsageError::InUseNotInLayout { gpu: 0, .. })
    ));
    let bad_model = NodeUsage {
        gpus: vec![GpuUsage {
            model: "H100,80GB".into(),
            ..gpu(0, &[], &[])
        }],
    };
    assert!(matches!(
        encode(&bad_model),
        Err(UsageError::Malformed { .. })
    ));
}

#[test]
fn pods_mark_that_many_instances_processes_first() {
    let mut usage = NodeUsage {
        gpus: vec![
            gpu(0, &["1g.10gb@0", "1g.10gb@1", "3g.40gb@4"], &["1g.10gb@1"]),
            gpu(1, &["1g.10gb@0", "1g.10gb@1"], &[]),
        ],
    };
    mark_in_use(
        &mut usage,
        &vec![(p("1g.10gb"), 3), (p("3g.40gb"), 0), (p("7g.80gb"), 2)],
    );
    assert_eq!(usage.gpus[0].in_use, vec![i("1g.10gb@0"), i("1g.10gb@1")]);
    assert_eq!(usage.gpus[1].in_use, vec![i("1g.10gb@0")]);
    assert_eq!(usage.in_use_counts(), vec![(p("1g.10gb"), 3)]);
}

#[test]
fn a_layout_short_of_what_pods_use_is_named() {
    let after = [i("1g.10gb@0"), i("3g.40gb@4")];
    assert_eq!(first_shortfall(&after, &vec![(p("1g.10gb"), 1)]), None);
    assert_eq!(
        first_shortfall(&after, &vec![(p("1g.10gb"), 1), (p("2g.20gb"), 2)]),
        Some((p("2g.20gb"), 0, 2))
    );
}

fn arb_gpu() -> impl Strategy<Value = GpuUsage> {
    let profiles = ["1g.10gb", "2g.20gb", "3g.40gb", "1g.20gb", "7g.80gb"];
    (
        0u32..16,
        any::<bool>(),
        prop::collection::vec((0usize..profiles.len(), 0u32..8, any::<bool>()), 0..8),
    )
        .prop_map(move |(index, mig_enabled, inst)| {
            let layout: Vec<PlacedInstance> = inst
                .iter()
                .map(|(k, s, _)| PlacedInstance::new(p(profiles[*k]), *s))
                .collect();
            let in_use = inst
                .iter()
                .zip(&layout)
                .filter(|((_, _, u), _)| *u)
                .map(|(_, l)| l.clone())
                .collect();
            GpuUsage {
                index,
                model: "A100-SXM4-40GB".into(),
                mig_enabled,
                layout,
                in_use,
            }
        })
}

fn arb_usage() -> impl Strategy<Value = NodeUsage> {
    prop::collection::vec(arb_gpu(), 0..8).prop_map(|gpus| {
        // One entry per index, as a node has.
        let mut seen = std::collections::BTreeSet::new();
        NodeUsage {
            gpus: gpus.into_iter().filter(|g| seen.insert(g.index)).collect(),
        }
    })
}

proptest! {
    #[test]
    fn every_usage_round_trips(usage in arb_usage()) {
        let text = encode(&usage).unwrap();
        prop_assert!(text.len() <= MAX_USAGE_BYTES);
        prop_assert_eq!(decode(&text).unwrap(), usage.normalized());
    }

    #[test]
    fn decoding_never_panics(text in "v1(;[0-9a-z@.,*-]{0,30}){0,6}") {
        let _ = decode(&text);
    }

    #[test]
    fn marking_keeps_marks_and_reaches_the_count_where_it_can(
        usage in arb_usage(),
        want in prop::collection::vec((0usize..3, 0u32..10), 0..3),
    ) {
        let names = ["1g.10gb", "3g.40gb", "7g.80gb"];
        let requested: Demand = want.iter().map(|(k, n)| (p(names[*k]), *n)).collect();
        let before = usage.normalized();
        let mut after = usage.clone();
        mark_in_use(&mut after, &requested);
        for (b, a) in before.gpus.iter().zip(&after.gpus) {
            prop_assert_eq!(&b.layout, &a.layout);
            for u in &b.in_use {
                prop_assert!(a.in_use.contains(u));
            }
            for u in &a.in_use {
                prop_assert!(a.layout.contains(u));
            }
        }
        for (profile, n) in &requested {
            let present = after.gpus.iter().flat_map(|g| &g.layout).filter(|i| i.profile == *profile).count() as u32;
            let marked = after.gpus.iter().flat_map(|g| &g.in_use).filter(|i| i.profile == *profile).count() as u32;
            let marked_before = before.gpus.iter().flat_map(|g| &g.in_use).filter(|i| i.profile == *profile).count() as u32;
            // Each requested profile appears once or more in `requested`;
            // the largest ask decides.
            let ask = requested.iter().filter(|(q, _)| q == profile).map(|(_, m)| *m).max().unwrap_or(*n);
            prop_assert!(marked >= ask.min(present));
            prop_assert!(marked <= ask.max(marked_before));
        }
    }
}
