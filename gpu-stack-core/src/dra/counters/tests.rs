use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;
use crate::catalog;
use crate::mig::{self, ValidateOptions};

fn mig_models() -> impl Iterator<Item = (&'static str, &'static MigGeometry)> {
    catalog::models()
        .iter()
        .filter_map(|m| m.mig.as_ref().map(|g| (m.name.as_str(), g)))
}

fn layout_of(model: &CounterModel, geometry: &MigGeometry, set: &[usize]) -> Vec<PlacedInstance> {
    set.iter()
        .map(|&i| model.instance(geometry, i).expect("index from the model"))
        .collect()
}

/// Every set of placement devices the counters allow, by depth-first search
/// (the memory-slice counters keep it small).
fn allowed_sets(model: &CounterModel) -> Vec<Vec<usize>> {
    fn walk(
        model: &CounterModel,
        next: usize,
        chosen: &mut Vec<usize>,
        left: &mut Vec<u64>,
        out: &mut Vec<Vec<usize>>,
    ) {
        out.push(chosen.clone());
        for d in next..model.placements.len() {
            let c = &model.placements[d].consumes;
            if c.iter().zip(left.iter()).all(|(c, l)| c <= l) {
                for (l, c) in left.iter_mut().zip(c) {
                    *l -= c;
                }
                chosen.push(d);
                walk(model, d + 1, chosen, left, out);
                chosen.pop();
                for (l, c) in left.iter_mut().zip(c) {
                    *l += c;
                }
            }
        }
    }
    let mut out = Vec::new();
    walk(model, 0, &mut Vec::new(), &mut model.capacities(), &mut out);
    out
}

fn canonical(mut layout: Vec<PlacedInstance>) -> Vec<PlacedInstance> {
    layout.sort();
    layout
}

/// The equivalence, exhaustively: the sets the counters allow are exactly the
/// layouts the validator accepts, on every MIG-capable GPU of the catalog.
#[test]
fn counters_allow_exactly_the_valid_layouts_on_every_catalog_gpu() {
    for (name, geometry) in mig_models() {
        let model = CounterModel::derive(geometry).expect(name);
        assert!(model.counters.len() <= MAX_COUNTERS_PER_GPU, "{name}");
        let allowed: BTreeSet<Vec<PlacedInstance>> = allowed_sets(&model)
            .iter()
            .map(|s| canonical(layout_of(&model, geometry, s)))
            .collect();
        for layout in &allowed {
            assert!(
                mig::validate(geometry, layout).is_ok(),
                "{name}: counters allow {} but the validator refuses it",
                mig::format_layout(layout)
            );
        }
        let valid: BTreeSet<Vec<PlacedInstance>> = mig::enumerate_layouts(geometry, None)
            .expect(name)
            .into_iter()
            .map(canonical)
            .collect();
        let missing: Vec<_> = valid.difference(&allowed).take(3).collect();
        assert!(
            missing.is_empty(),
            "{name}: valid layouts the counters refuse: {missing:?}"
        );
        // The empty set is allowed; the enumeration lists non-empty layouts.
        assert!(allowed.contains(&Vec::new()), "{name}");
        assert_eq!(allowed.len() - 1, valid.len(), "{name}");
    }
}

#[test]
fn the_whole_gpu_excludes_every_mig_device_and_fits_alone() {
    for (name, geometry) in mig_models() {
        let model = CounterModel::derive(geometry).expect(name);
        assert!(model.allows(&[ModelDevice::WholeGpu]), "{name}");
        assert!(
            !model.allows(&[ModelDevice::WholeGpu, ModelDevice::WholeGpu]),
            "{name}"
        );
        for d in 0..model.placements.len() {
            assert!(model.allows(&[ModelDevice::Placement(d)]), "{name} {d}");
            assert!(
                !model.allows(&[ModelDevice::WholeGpu, ModelDevice::Placement(d)]),
                "{name}: whole GPU with placement {d}"
            );
        }
    }
}

#[test]
fn an_h100_publishes_the_memory_slices_and_only_the_counters_they_do_not_imply() {
    let geometry = catalog::lookup("H100-SXM5-80GB")
        .unwrap()
        .mig
        .as_ref()
        .unwrap();
    let model = CounterModel::derive(geometry).unwrap();
    let names: Vec<&str> = model.counters.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "memory-slice-0",
            "memory-slice-1",
            "memory-slice-2",
            "memory-slice-3",
            "memory-slice-4",
            "memory-slice-5",
            "memory-slice-6",
            "memory-slice-7",
            "ofa-engines",
            "profile-20-instances",
        ]
    );
    // 1g.10gb x7, 1g.10gb+me x7, 1g.20gb x4, 2g.20gb x3, 3g.40gb x2, 4g.40gb, 7g.80gb.
    assert_eq!(model.placements.len(), 25);
}

/// R5 (no 4g with 3g before R510) is not in the counters: of the sets they
/// allow, exactly those with a 4g and a 3g instance are refused under the old
/// rule, and that is what the plugin refuses at prepare time.
#[test]
fn the_pre_r510_rule_refuses_exactly_the_allowed_sets_with_a_4g_and_a_3g() {
    let old = ValidateOptions {
        pre_r510_driver: true,
    };
    for (name, geometry) in mig_models() {
        let model = CounterModel::derive(geometry).expect(name);
        let sets = allowed_sets(&model);
        let mut refused = 0usize;
        for s in &sets {
            let layout = layout_of(&model, geometry, s);
            let has = |g: u32| layout.iter().any(|i| i.profile.gpu_slices() == g);
            let expect_refused = has(4) && has(3);
            let is_refused = mig::validate_with(geometry, &layout, old).is_err();
            assert_eq!(
                is_refused,
                expect_refused,
                "{name}: {}",
                mig::format_layout(&layout)
            );
            refused += usize::from(is_refused);
        }
        // Rare: the only 4g placement and the 3g beside it, at most one set.
        assert!(refused <= 1, "{name}: {refused} of {}", sets.len());
        println!(
            "figure: {name}: {} device sets the counters allow, {refused} refused at prepare on a pre-R510 driver",
            sets.len()
        );
    }
}

#[test]
fn capacities_left_by_existing_instances_refuse_what_overlaps_them() {
    let geometry = catalog::lookup("H100-SXM5-80GB")
        .unwrap()
        .mig
        .as_ref()
        .unwrap();
    let model = CounterModel::derive(geometry).unwrap();
    let existing = mig::parse_layout("3g.40gb@4,1g.10gb+me@0").unwrap();
    let left = model.remaining_after(geometry, &existing);
    for d in 0..model.placements.len() {
        let mut layout = existing.clone();
        layout.push(model.instance(geometry, d).unwrap());
        assert_eq!(
            model.allows_within(&[ModelDevice::Placement(d)], &left),
            mig::validate(geometry, &layout).is_ok(),
            "{}",
            mig::format_layout(&layout)
        );
    }
    assert!(!model.allows_within(&[ModelDevice::WholeGpu], &left));
}

fn model_and_subset() -> impl Strategy<Value = (usize, Vec<usize>)> {
    let models: Vec<&MigGeometry> = mig_models().map(|(_, g)| g).collect();
    (0..models.len()).prop_flat_map(move |m| {
        let n = CounterModel::derive(models[m]).unwrap().placements.len();
        (
            Just(m),
            prop::sample::subsequence((0..n).collect::<Vec<_>>(), 0..=n.min(9)),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    /// For random sets of placement devices on random catalog GPUs: the
    /// counters allow the set exactly when the validator accepts its layout.
    #[test]
    fn counters_allow_a_random_set_iff_its_layout_is_valid((m, set) in model_and_subset()) {
        let (_, geometry) = mig_models().nth(m).unwrap();
        let model = CounterModel::derive(geometry).unwrap();
        let devices: Vec<ModelDevice> = set.iter().map(|&d| ModelDevice::Placement(d)).collect();
        let layout = layout_of(&model, geometry, &set);
        prop_assert_eq!(model.allows(&devices), mig::validate(geometry, &layout).is_ok());
    }
}
