//! MIG engine: table tests from reference/mig.md §4.1 and property tests.

use gpu_stack_core::catalog;
use gpu_stack_core::mig::{
    self, FleetGpu, MigGeometry, MigProfileName, PlacedInstance, ValidateOptions, Violation,
    enumerate_layouts, enumerate_maximal_layouts, fit, parse_demand, parse_layout, plan_fleet,
    reconfigure, validate,
};
use proptest::prelude::*;

fn geo(model: &str) -> &'static MigGeometry {
    catalog::lookup(model).unwrap().mig.as_ref().unwrap()
}

fn layout(s: &str) -> Vec<PlacedInstance> {
    parse_layout(s).unwrap()
}

/// A100-40GB names, and the same layouts with H100-80GB names.
const TABLE: &[(&str, &str, bool)] = &[
    ("4g.20gb@0,3g.20gb@4", "4g.40gb@0,3g.40gb@4", true),
    (
        "1g.5gb@0,1g.5gb@1,1g.5gb@2,1g.5gb@3,3g.20gb@4",
        "1g.10gb@0,1g.10gb@1,1g.10gb@2,1g.10gb@3,3g.40gb@4",
        true,
    ),
    ("3g.20gb@0,1g.5gb@3", "3g.40gb@0,1g.10gb@3", false),
    ("2g.10gb@1", "2g.20gb@1", false),
    (
        "1g.5gb+me@0,1g.5gb+me@1",
        "1g.10gb+me@0,1g.10gb+me@1",
        false,
    ),
    ("3g.20gb@4,1g.10gb@6", "3g.40gb@4,1g.20gb@6", false),
    ("1g.10gb@6,1g.5gb@5", "1g.20gb@6,1g.10gb@5", true),
];

#[test]
fn reference_table_a100_and_h100() {
    for (a100, h100, valid) in TABLE {
        assert_eq!(
            validate(geo("A100-SXM4-40GB"), &layout(a100)).is_ok(),
            *valid,
            "A100 {a100}"
        );
        assert_eq!(
            validate(geo("H100-SXM5-80GB"), &layout(h100)).is_ok(),
            *valid,
            "H100 {h100}"
        );
    }
}

#[test]
fn violations_name_the_rule_and_instances() {
    let g = geo("A100-SXM4-40GB");
    let v = validate(g, &layout("3g.20gb@0,1g.5gb@3")).unwrap_err();
    assert!(
        matches!(&v[..], [Violation::Overlap { first, second, from: 3, to: 4 }]
        if first.to_string() == "3g.20gb@0" && second.to_string() == "1g.5gb@3")
    );
    let v = validate(g, &layout("2g.10gb@1")).unwrap_err();
    assert!(
        matches!(&v[..], [Violation::PlacementNotAllowed { allowed_starts, .. }] if allowed_starts == &vec![0, 2, 4])
    );
    let v = validate(g, &layout("1g.5gb+me@0,1g.5gb+me@1")).unwrap_err();
    assert!(v.iter().any(
        |x| matches!(x, Violation::TooManyOfProfile { profile, max: 1, instances } if profile == "1g.5gb+me" && instances.len() == 2)
    ));
    let v = validate(g, &layout("3g.40gb@0")).unwrap_err();
    assert!(matches!(&v[..], [Violation::UnknownProfile { .. }]));
    assert!(v[0].to_string().contains("3g.40gb@0"), "{}", v[0]);
}

#[test]
fn four_plus_three_needs_r510() {
    let g = geo("A100-SXM4-40GB");
    let l = layout("4g.20gb@0,3g.20gb@4");
    assert!(validate(g, &l).is_ok());
    let old = ValidateOptions {
        pre_r510_driver: true,
    };
    assert!(matches!(
        &mig::validate_with(g, &l, old).unwrap_err()[..],
        [Violation::FourPlusThreeOnOldDriver { .. }]
    ));
}

#[test]
fn media_engine_rules() {
    // A30: 1g.6gb+me and 2g.12gb+me each hold the only OFA.
    let a30 = geo("A30");
    assert!(validate(a30, &layout("1g.6gb+me@0,2g.12gb@2")).is_ok());
    assert!(matches!(
        &validate(a30, &layout("1g.6gb+me@0,2g.12gb+me@2")).unwrap_err()[..],
        [Violation::MediaEnginesExceeded { .. }]
    ));
    // RTX PRO 6000: +me.all admits only -me neighbours.
    let rtx = geo("RTX-PRO-6000-Blackwell");
    assert!(validate(rtx, &layout("1g.24gb+me.all@0,1g.24gb-me@3,2g.48gb-me@6")).is_ok());
    let v = validate(rtx, &layout("1g.24gb+me.all@0,1g.24gb@3")).unwrap_err();
    assert!(
        v.iter()
            .any(|x| matches!(x, Violation::MeAllNotExclusive { others, .. } if others.len() == 1))
    );
    assert!(validate(rtx, &layout("1g.24gb+me.all@0,2g.48gb+me.all@6")).is_err());
}

#[test]
fn mig_parted_multiset_vectors() {
    let g = geo("A100-SXM4-40GB");
    for (d, ok) in [
        ("1g.5gb=3,2g.10gb=2", true),
        ("1g.5gb=2,2g.10gb=2", true),
        ("1g.5gb=4,2g.10gb=2", false),
        ("1g.5gb=8", false),
        ("1g.5gb=7", true),
        ("3g.20gb=1,2g.10gb=1,1g.5gb=2", true),
        ("4g.20gb=1,3g.20gb=1", true),
        ("7g.40gb=1,1g.5gb=1", false),
    ] {
        let demand = parse_demand(d).unwrap();
        let r = fit(g, &demand);
        assert_eq!(r.is_ok(), ok, "{d}: {r:?}");
        if let Ok(l) = r {
            validate(g, &l).unwrap();
        }
    }
}

#[test]
fn fit_is_order_independent_where_hardware_is_not() {
    // The guide's failing creation order 19,19,14,9 and the working 9,19,14,19.
    let g = geo("A100-SXM4-40GB");
    let a = fit(g, &parse_demand("1g.5gb=2,2g.10gb=1,3g.20gb=1").unwrap()).unwrap();
    let b = fit(g, &parse_demand("3g.20gb=1,1g.5gb=2,2g.10gb=1").unwrap()).unwrap();
    assert_eq!(a, b);
    assert!(a.contains(&"3g.20gb@4".parse().unwrap()));
}

#[test]
fn fit_explains_impossibility() {
    let g = geo("A100-SXM4-40GB");
    let e = fit(g, &parse_demand("1g.5gb=8").unwrap()).unwrap_err();
    assert!(e.to_string().contains("at most 7"), "{e}");
    let e = fit(g, &parse_demand("3g.20gb=1,2g.10gb=2,1g.5gb=1").unwrap()).unwrap_err();
    assert!(e.to_string().contains("compute slices"), "{e}");
    let e = fit(g, &parse_demand("1g.10gb=1,2g.10gb=3").unwrap()).unwrap();
    validate(g, &e).unwrap();
    // 4g@0 leaves start 4 for the 2g and start 6 for the double-memory 1g.
    let e = fit(g, &parse_demand("4g.20gb=1,2g.10gb=1,1g.10gb=1").unwrap()).unwrap();
    assert_eq!(e.len(), 3);
    let e = fit(g, &parse_demand("1g.12gb=1").unwrap()).unwrap_err();
    assert!(e.to_string().contains("1g.12gb"), "{e}");
}

#[test]
fn fit_proves_placement_impossibility() {
    // A toy GPU whose 2g can only start at 0 and whose 1g can only start at 1.
    let mut g = geo("A30").clone();
    g.gi_profiles
        .retain(|p| p.name.to_string() == "2g.12gb" || p.name.to_string() == "1g.6gb");
    for p in &mut g.gi_profiles {
        p.placements
            .retain(|pl| pl.start == if p.compute_slices == 2 { 0 } else { 1 });
    }
    let e = fit(&g, &parse_demand("2g.12gb=1,1g.6gb=1").unwrap()).unwrap_err();
    assert!(matches!(e, mig::FitError::NoPlacement { .. }), "{e}");
    assert!(e.to_string().contains("2g.12gb=1,1g.6gb=1"), "{e}");
}

#[test]
fn compute_instance_profiles_pack_into_gpu_instances() {
    let g = geo("A100-SXM4-40GB");
    // Two 1c.2g.10gb share one 2g GPU instance.
    let l = fit(g, &parse_demand("1c.2g.10gb=2").unwrap()).unwrap();
    assert_eq!(l.len(), 1);
    let l = fit(g, &parse_demand("1c.7g.40gb=7").unwrap()).unwrap();
    assert_eq!(l.len(), 1);
}

#[test]
fn a100_layout_counts() {
    let g = geo("A100-SXM4-40GB");
    let all = enumerate_layouts(g, None).unwrap();
    let maximal = enumerate_maximal_layouts(g, None).unwrap();
    assert!(!all.is_empty() && !maximal.is_empty());
    assert!(maximal.len() < all.len());
    // Without +me and 1g.10gb, the classic A100 combinations.
    let classic: Vec<MigProfileName> = ["1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
    let max_classic = enumerate_maximal_layouts(g, Some(&classic)).unwrap();
    assert!(
        max_classic
            .iter()
            .any(|l| l.len() == 1 && l[0].to_string() == "7g.40gb@0")
    );
    assert!(max_classic.iter().any(|l| l.len() == 7));
    for l in &max_classic {
        validate(g, l).unwrap();
    }
}

#[test]
fn reconfigure_keeps_existing_instances() {
    let g = geo("A100-SXM4-40GB");
    let current = layout("1g.5gb@1,1g.5gb@0,3g.20gb@4");
    let r = reconfigure(
        g,
        &current,
        &parse_demand("3g.20gb=1,1g.5gb=2,2g.10gb=1").unwrap(),
    )
    .unwrap();
    assert_eq!(r.keep.len(), 3, "{r:?}");
    assert!(r.destroy.is_empty());
    assert_eq!(r.create, layout("2g.10gb@2"));
    // 3g@0 blocks the 2g: everything moves.
    let blocked = layout("1g.5gb@5,1g.5gb@6,3g.20gb@0");
    let r = reconfigure(
        g,
        &blocked,
        &parse_demand("3g.20gb=1,1g.5gb=2,2g.10gb=1").unwrap(),
    )
    .unwrap();
    validate(g, &r.target).unwrap();
    assert_eq!(r.target.len(), 4);
    let r = reconfigure(g, &current, &parse_demand("7g.40gb=1").unwrap()).unwrap();
    assert_eq!(r.destroy.len(), 3);
    assert_eq!(r.create, layout("7g.40gb@0"));
}

#[test]
fn plan_small_fleet() {
    let g = geo("A100-SXM4-40GB");
    let gpus = vec![
        FleetGpu {
            id: "a/0".into(),
            geometry: g,
            mig_enabled: true,
            current: layout("3g.20gb@4,1g.5gb@0"),
            in_use: layout("3g.20gb@4"),
        },
        FleetGpu {
            id: "a/1".into(),
            geometry: g,
            mig_enabled: true,
            current: vec![],
            in_use: vec![],
        },
        FleetGpu {
            id: "b/0".into(),
            geometry: geo("H100-SXM5-80GB"),
            mig_enabled: true,
            current: vec![],
            in_use: vec![],
        },
    ];
    let plan = plan_fleet(
        &gpus,
        &parse_demand("1g.5gb=8,3g.20gb=2,1g.10gb=3,9g.1gb=1").unwrap(),
    )
    .unwrap();
    // In-use instance kept.
    assert!(plan.gpus[0].target.contains(&"3g.20gb@4".parse().unwrap()));
    assert!(plan.gpus[0].keep.contains(&"1g.5gb@0".parse().unwrap()));
    let out = |p: &str| plan.profiles.iter().find(|o| o.profile == p).unwrap();
    assert_eq!(out("3g.20gb").planned, 2);
    assert_eq!(out("3g.20gb").in_use, 1);
    assert_eq!(out("1g.5gb").unmet, 0, "{:?}", plan);
    assert_eq!(out("9g.1gb").unmet, 1);
    assert!(
        out("9g.1gb")
            .reason
            .as_ref()
            .unwrap()
            .contains("no MIG-enabled GPU")
    );
    for (gp, gpu) in plan.gpus.iter().zip(&gpus) {
        validate(gpu.geometry, &gp.target).unwrap();
    }
}

// ---------------------------------------------------------------------------
// Properties.

const PROPTEST_CASES: u32 = 200;

fn name_strategy() -> impl Strategy<Value = String> {
    (
        prop::option::of(0u32..20),
        0u32..100,
        0u32..2000,
        prop_oneof![
            Just(String::new()),
            Just("+me".to_string()),
            Just("+gfx".to_string()),
            Just("+me.all".to_string()),
            Just("-me".to_string()),
            Just("+me,gfx".to_string()),
            "[+-][a-z][a-z0-9]{0,3}(\\.[a-z0-9]{1,3})?",
        ],
    )
        .prop_map(|(c, g, gb, attr)| {
            let c = c.map(|c| format!("{c}c.")).unwrap_or_default();
            format!("{c}{g}g.{gb}gb{attr}")
        })
}

fn mig_models() -> Vec<&'static str> {
    catalog::models()
        .iter()
        .filter(|m| m.mig.is_some())
        .map(|m| m.name.as_str())
        .collect()
}

/// A random demand on a random MIG model.
fn demand_strategy() -> impl Strategy<Value = (&'static str, Vec<(usize, u32)>)> {
    (
        prop::sample::select(mig_models()),
        prop::collection::vec((0usize..16, 0u32..4), 1..5),
    )
}

fn to_demand(g: &MigGeometry, raw: &[(usize, u32)]) -> mig::Demand {
    let mut d: mig::Demand = Vec::new();
    for (i, c) in raw {
        let name = g.gi_profiles[i % g.gi_profiles.len()].name.clone();
        if !d.iter().any(|(n, _)| *n == name) {
            d.push((name, *c));
        }
    }
    d
}

/// A random valid layout: fit a random demand, dropping what does not fit.
fn random_layout(g: &MigGeometry, raw: &[(usize, u32)]) -> Vec<PlacedInstance> {
    let mut acc: mig::Demand = Vec::new();
    for (name, c) in to_demand(g, raw) {
        for _ in 0..c {
            let mut trial = acc.clone();
            match trial.iter_mut().find(|(n, _)| *n == name) {
                Some((_, k)) => *k += 1,
                None => trial.push((name.clone(), 1)),
            }
            if fit(g, &trial).is_ok() {
                acc = trial;
            }
        }
    }
    fit(g, &acc).unwrap_or_default()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(PROPTEST_CASES))]

    #[test]
    fn parse_format_identity(s in name_strategy()) {
        let p = MigProfileName::parse(&s);
        prop_assert!(p.is_ok(), "{s}: {p:?}");
        let p = p.unwrap();
        prop_assert_eq!(p.to_string(), s.clone());
        prop_assert_eq!(MigProfileName::parse(&p.to_string()).unwrap(), p);
    }

    #[test]
    fn fit_results_validate((model, raw) in demand_strategy()) {
        let g = geo(model);
        let demand = to_demand(g, &raw);
        if let Ok(l) = fit(g, &demand) {
            prop_assert!(validate(g, &l).is_ok(), "{model} {l:?}");
            let want: u32 = demand.iter().map(|(_, c)| c).sum();
            prop_assert_eq!(l.len() as u32, want);
        }
        // Order independence of fit.
        let mut rev = demand.clone();
        rev.reverse();
        prop_assert_eq!(fit(g, &demand).is_ok(), fit(g, &rev).is_ok());
    }

    #[test]
    fn validate_is_order_independent(
        (model, raw) in demand_strategy(),
        extra in prop::collection::vec((0usize..16, 0u32..12), 0..3),
        seed in any::<u64>(),
    ) {
        let g = geo(model);
        let mut l = random_layout(g, &raw);
        // Add arbitrary (possibly invalid) instances.
        for (i, start) in extra {
            l.push(PlacedInstance::new(g.gi_profiles[i % g.gi_profiles.len()].name.clone(), start));
        }
        let a = validate(g, &l);
        let mut shuffled = l.clone();
        let n = shuffled.len();
        if n > 1 {
            let mut s = seed;
            for i in (1..n).rev() {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                shuffled.swap(i, (s >> 33) as usize % (i + 1));
            }
        }
        prop_assert_eq!(a, validate(g, &shuffled));
    }

    #[test]
    fn plan_keeps_in_use_and_stays_valid(
        gpus in prop::collection::vec((prop::sample::select(mig_models()), prop::collection::vec((0usize..16, 0u32..3), 0..4), any::<u8>()), 1..6),
        demand_raw in prop::collection::vec((0usize..16, 0u32..6), 1..4),
    ) {
        let fleet: Vec<FleetGpu<'static>> = gpus.iter().enumerate().map(|(i, (model, raw, mask))| {
            let g = geo(model);
            let current = random_layout(g, raw);
            let in_use = current.iter().enumerate().filter(|(k, _)| mask & (1 << (k % 8)) != 0).map(|(_, x)| x.clone()).collect();
            FleetGpu { id: format!("gpu{i}"), geometry: g, mig_enabled: true, current, in_use }
        }).collect();
        let demand = to_demand(fleet[0].geometry, &demand_raw);
        let plan = plan_fleet(&fleet, &demand).unwrap();
        prop_assert_eq!(plan.clone(), plan_fleet(&fleet, &demand).unwrap());
        for (p, gpu) in plan.gpus.iter().zip(&fleet) {
            prop_assert!(validate(gpu.geometry, &p.target).is_ok(), "{:?}", p);
            for u in &gpu.in_use {
                prop_assert!(p.target.contains(u), "in-use {u} removed on {}", gpu.id);
                prop_assert!(!p.destroy.contains(u));
            }
        }
        for o in &plan.profiles {
            prop_assert_eq!(o.unmet, o.wanted.saturating_sub(o.planned));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(8))]

    #[test]
    fn maximal_layouts_are_valid_and_full(model in prop::sample::select(mig_models())) {
        let g = geo(model);
        let maximal = enumerate_maximal_layouts(g, None).unwrap();
        prop_assert!(!maximal.is_empty());
        for l in &maximal {
            prop_assert!(validate(g, l).is_ok(), "{model}: {l:?}");
            for p in &g.gi_profiles {
                for pl in &p.placements {
                    let mut more = l.clone();
                    more.push(PlacedInstance::new(p.name.clone(), pl.start));
                    prop_assert!(validate(g, &more).is_err(), "{model}: {l:?} admits {}@{}", p.name, pl.start);
                }
            }
        }
    }
}
