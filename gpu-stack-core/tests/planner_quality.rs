//! Fleet planner quality: `plan_fleet` against the exact optimum on small
//! random fleets.
//!
//! The optimum is found by complete search: every valid layout of each
//! geometry comes from `enumerate_layouts` (checked once with `validate`),
//! each GPU may take any of them that keeps all of its in-use instances, and
//! a dynamic programme over GPUs (state: instances per demanded profile,
//! capped at the demand) finds the best combination.
//!
//! Both sides are measured the way the planner measures itself: served
//! demand is `Σ_d min(planned_d, wanted_d) × compute_slices(d)` over the
//! demand entries `d`, where `planned_d` counts the instances of that profile
//! in the fleet after the plan, in use or not. In-use instances therefore
//! count on both sides, and a 3g instance outweighs a 1g one.

use std::collections::{HashMap, HashSet};

use gpu_stack_core::catalog;
use gpu_stack_core::mig::{
    Demand, FleetGpu, MigGeometry, MigProfileName, PlacedInstance, enumerate_layouts,
    enumerate_maximal_layouts, plan_fleet, validate,
};

const MODELS: [&str; 2] = ["H100-SXM5-80GB", "A100-SXM4-40GB"];
const CASES: usize = 3000;
const SEED: u64 = 0x6d69_6766_6c65_6574;

fn geo(model: &str) -> &'static MigGeometry {
    catalog::lookup(model).unwrap().mig.as_ref().unwrap()
}

/// SplitMix64: small, seeded, reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, num: u64, den: u64) -> bool {
        self.next() % den < num
    }
}

/// Every valid layout of one geometry, the empty one included.
struct Layouts {
    geometry: &'static MigGeometry,
    all: Vec<Vec<PlacedInstance>>,
    maximal: Vec<Vec<PlacedInstance>>,
}

impl Layouts {
    fn new(model: &str) -> Layouts {
        let geometry = geo(model);
        let mut all = vec![Vec::new()];
        all.extend(enumerate_layouts(geometry, None).unwrap());
        for l in &all {
            assert!(validate(geometry, l).is_ok(), "{model}: {l:?}");
        }
        let maximal = enumerate_maximal_layouts(geometry, None).unwrap();
        Layouts {
            geometry,
            all,
            maximal,
        }
    }
}

/// A random fleet GPU: a random valid current layout (full half the time),
/// each instance in use with probability 1/3.
fn random_gpu(rng: &mut Rng, id: usize, layouts: &Layouts) -> FleetGpu<'static> {
    let current = if rng.chance(1, 2) {
        layouts.maximal[rng.below(layouts.maximal.len())].clone()
    } else {
        layouts.all[rng.below(layouts.all.len())].clone()
    };
    let in_use = current
        .iter()
        .filter(|_| rng.chance(1, 3))
        .cloned()
        .collect();
    FleetGpu {
        id: format!("gpu{id}"),
        geometry: layouts.geometry,
        mig_enabled: true,
        current,
        in_use,
    }
}

/// A random demand: one to four distinct GPU-instance profiles offered by
/// the fleet's models, each wanting 1..=3 per GPU in the fleet.
fn random_demand(rng: &mut Rng, fleet: &[FleetGpu<'static>]) -> Demand {
    let mut names: Vec<MigProfileName> = Vec::new();
    for gpu in fleet {
        for p in &gpu.geometry.gi_profiles {
            if !names.contains(&p.name) {
                names.push(p.name.clone());
            }
        }
    }
    let k = 1 + rng.below(4.min(names.len()));
    let mut demand = Demand::new();
    while demand.len() < k {
        let name = names.swap_remove(rng.below(names.len()));
        let count = 1 + rng.below(3 * fleet.len()) as u32;
        demand.push((name, count));
    }
    demand
}

/// Compute slices of each demand entry, from the geometries that offer it
/// (the planner's weight; a name means the same slices on every model here).
fn weights(fleet: &[FleetGpu<'static>], demand: &Demand) -> Vec<u32> {
    demand
        .iter()
        .map(|(name, _)| {
            let mut w = None;
            for gpu in fleet {
                if let Some(p) = gpu.geometry.resolve(name) {
                    let c = p.compute_slices.max(1);
                    assert!(w.is_none() || w == Some(c), "{name}: slices differ");
                    w = Some(c);
                }
            }
            w.unwrap_or(0)
        })
        .collect()
}

/// Served demand in compute slices for per-entry instance counts.
fn served(counts: &[u32], demand: &Demand, w: &[u32]) -> u32 {
    counts
        .iter()
        .zip(demand)
        .zip(w)
        .map(|((c, (_, wanted)), w)| (*c).min(*wanted) * w)
        .sum()
}

fn counts_of(layout: &[PlacedInstance], demand: &Demand) -> Vec<u32> {
    demand
        .iter()
        .map(|(name, wanted)| {
            (layout.iter().filter(|i| i.profile == *name).count() as u32).min(*wanted)
        })
        .collect()
}

/// One DP step: capped totals after a GPU → (totals before it, the layout
/// it takes).
type Steps = HashMap<Vec<u32>, (Vec<u32>, usize)>;

/// The exact optimum: served demand, and one layout per GPU reaching it.
fn optimum(
    fleet: &[FleetGpu<'static>],
    demand: &Demand,
    w: &[u32],
    layouts: &HashMap<usize, Layouts>,
) -> (u32, Vec<Vec<PlacedInstance>>) {
    // Per GPU: the distinct demand-count vectors of its allowed layouts
    // (those keeping every in-use instance), with one layout for each.
    let mut options: Vec<Vec<(Vec<u32>, usize)>> = Vec::with_capacity(fleet.len());
    for gpu in fleet {
        let all = &layouts[&(gpu.geometry as *const MigGeometry as usize)].all;
        let mut seen: HashMap<Vec<u32>, usize> = HashMap::new();
        for (i, l) in all.iter().enumerate() {
            if gpu.in_use.iter().all(|u| l.contains(u)) {
                seen.entry(counts_of(l, demand)).or_insert(i);
            }
        }
        assert!(
            !seen.is_empty(),
            "{}: no layout keeps its in-use instances",
            gpu.id
        );
        // Dominated vectors can never do better; drop them.
        let vecs: Vec<(Vec<u32>, usize)> = seen.into_iter().collect();
        let kept = vecs
            .iter()
            .filter(|(v, _)| {
                !vecs
                    .iter()
                    .any(|(o, _)| o != v && o.iter().zip(v).all(|(a, b)| a >= b))
            })
            .cloned()
            .collect();
        options.push(kept);
    }
    // DP over GPUs: capped totals → (per-GPU option chosen, previous state).
    let zero = vec![0u32; demand.len()];
    let mut frontier: HashSet<Vec<u32>> = HashSet::from([zero.clone()]);
    let mut back: Vec<Steps> = Vec::with_capacity(fleet.len());
    for opts in &options {
        let mut next: Steps = HashMap::new();
        for s in &frontier {
            for (v, layout) in opts {
                let t: Vec<u32> = s
                    .iter()
                    .zip(v)
                    .zip(demand)
                    .map(|((a, b), (_, wanted))| (a + b).min(*wanted))
                    .collect();
                next.entry(t).or_insert((s.clone(), *layout));
            }
        }
        frontier = next.keys().cloned().collect();
        back.push(next);
    }
    let best = frontier
        .iter()
        .max_by_key(|s| (served(s, demand, w), std::cmp::Reverse((*s).clone())))
        .unwrap()
        .clone();
    let value = served(&best, demand, w);
    // Walk back for the layouts.
    let mut chosen = vec![Vec::new(); fleet.len()];
    let mut s = best;
    for g in (0..fleet.len()).rev() {
        let (prev, layout) = back[g][&s].clone();
        let all = &layouts[&(fleet[g].geometry as *const MigGeometry as usize)].all;
        chosen[g] = all[layout].clone();
        s = prev;
    }
    assert_eq!(s, zero);
    (value, chosen)
}

struct Worst {
    ratio: f64,
    plan: u32,
    opt: u32,
    fleet: Vec<(String, String, String, String)>,
    demand: String,
    planned: Vec<String>,
    optimal: Vec<String>,
}

fn layout_str(l: &[PlacedInstance]) -> String {
    if l.is_empty() {
        "-".into()
    } else {
        l.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    }
}

#[test]
fn plan_fleet_is_near_the_exact_optimum_on_small_fleets() {
    let mut layouts: HashMap<usize, Layouts> = HashMap::new();
    let mut by_model: Vec<usize> = Vec::new();
    for model in MODELS {
        let l = Layouts::new(model);
        let key = l.geometry as *const MigGeometry as usize;
        by_model.push(key);
        layouts.insert(key, l);
    }
    let mut rng = Rng(SEED);
    let mut sum = 0.0;
    let mut optimal_cases = 0usize;
    // Short cases by kind: one GPU, one model, mixed models.
    let mut short = [0usize; 3];
    let mut kinds = [0usize; 3];
    let mut kind_sum = [0f64; 3];
    let mut kind_worst = [1f64; 3];
    let mut worst: Option<Worst> = None;
    for case in 0..CASES {
        let n = 1 + rng.below(4);
        let fleet: Vec<FleetGpu<'static>> = (0..n)
            .map(|i| {
                let key = by_model[rng.below(by_model.len())];
                random_gpu(&mut rng, i, &layouts[&key])
            })
            .collect();
        let demand = random_demand(&mut rng, &fleet);
        let w = weights(&fleet, &demand);
        let plan = plan_fleet(&fleet, &demand).unwrap();

        // The plan is valid and keeps every in-use instance.
        for (p, gpu) in plan.gpus.iter().zip(&fleet) {
            assert!(
                validate(gpu.geometry, &p.target).is_ok(),
                "case {case}: {p:?}"
            );
            for u in &gpu.in_use {
                assert!(
                    p.target.contains(u) && !p.destroy.contains(u),
                    "case {case}: in-use {u} removed on {}",
                    gpu.id
                );
            }
        }
        // Planner's served demand, from the targets (and its own outcome).
        let targets: Vec<PlacedInstance> =
            plan.gpus.iter().flat_map(|p| p.target.clone()).collect();
        let plan_counts = counts_of(&targets, &demand);
        for (o, c) in plan.profiles.iter().zip(&plan_counts) {
            assert_eq!(o.planned.min(o.wanted), *c, "case {case}");
        }
        let got = served(&plan_counts, &demand, &w);

        let (opt, optimal_layouts) = optimum(&fleet, &demand, &w, &layouts);
        assert!(
            got <= opt,
            "case {case}: planner {got} exceeds the optimum {opt}"
        );
        let ratio = if opt == 0 {
            1.0
        } else {
            f64::from(got) / f64::from(opt)
        };
        let mixed = fleet
            .iter()
            .any(|g| !std::ptr::eq(g.geometry, fleet[0].geometry));
        let kind = if n == 1 {
            0
        } else if mixed {
            2
        } else {
            1
        };
        kinds[kind] += 1;
        kind_sum[kind] += ratio;
        kind_worst[kind] = kind_worst[kind].min(ratio);
        if got == opt {
            optimal_cases += 1;
        } else {
            short[kind] += 1;
        }
        // Optimal per GPU: a one-GPU fleet is planned exactly.
        assert!(
            n > 1 || got == opt,
            "case {case}: one GPU, planner {got} < optimum {opt}"
        );
        sum += ratio;
        if worst.as_ref().is_none_or(|w| ratio < w.ratio) {
            worst = Some(Worst {
                ratio,
                plan: got,
                opt,
                fleet: fleet
                    .iter()
                    .map(|g| {
                        let model = MODELS[by_model
                            .iter()
                            .position(|k| *k == g.geometry as *const MigGeometry as usize)
                            .unwrap()];
                        (
                            g.id.clone(),
                            model.to_string(),
                            layout_str(&g.current),
                            layout_str(&g.in_use),
                        )
                    })
                    .collect(),
                demand: demand
                    .iter()
                    .map(|(n, c)| format!("{n}={c}"))
                    .collect::<Vec<_>>()
                    .join(","),
                planned: plan.gpus.iter().map(|p| layout_str(&p.target)).collect(),
                optimal: optimal_layouts.iter().map(|l| layout_str(l)).collect(),
            });
        }
    }
    let average = sum / CASES as f64;
    let worst = worst.unwrap();
    eprintln!(
        "planner quality: {CASES} fleets of 1-4 GPUs ({}), served demand in compute slices",
        MODELS.join(", ")
    );
    eprintln!(
        "  average ratio {average:.5}; optimal in {optimal_cases}/{CASES}; worst {:.4} ({} of {} slices)",
        worst.ratio, worst.plan, worst.opt
    );
    for (k, label) in ["one GPU", "one model", "mixed models"].iter().enumerate() {
        eprintln!(
            "  {label}: {} fleets, below optimum {}, average {:.5}, worst {:.4}",
            kinds[k],
            short[k],
            kind_sum[k] / kinds[k].max(1) as f64,
            kind_worst[k]
        );
    }
    eprintln!("  worst case demand {}", worst.demand);
    for (i, (id, model, current, in_use)) in worst.fleet.iter().enumerate() {
        eprintln!(
            "    {id} {model}: current {current}; in use {in_use}; planned {}; optimal {}",
            worst.planned[i], worst.optimal[i]
        );
    }
    assert!(average >= 0.99, "average ratio {average}");
}
