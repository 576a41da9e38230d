//! Catalog coverage and fleet files.

use gpu_stack_core::catalog::{self, Architecture};
use gpu_stack_core::fleet::{Fleet, FleetError};
use gpu_stack_core::mig::{self, Placement};

#[test]
fn catalog_covers_the_listed_gpus() {
    for (name, mig) in [
        ("A100-SXM4-40GB", true),
        ("A100-PCIE-40GB", true),
        ("A100-SXM4-80GB", true),
        ("A100-PCIE-80GB", true),
        ("A30", true),
        ("H100-SXM5-80GB", true),
        ("H100-PCIE-80GB", true),
        ("H100-NVL-94GB", true),
        ("H100-96GB", true),
        ("GH200-96GB", true),
        ("GH200-144GB", true),
        ("H200-SXM-141GB", true),
        ("H200-NVL-141GB", true),
        ("B200", true),
        ("GB200", true),
        ("RTX-PRO-6000-Blackwell", true),
        ("B300", true),
        ("GB300", true),
        ("V100-SXM2-16GB", false),
        ("T4", false),
        ("A10", false),
        ("A40", false),
        ("L4", false),
        ("L40S", false),
    ] {
        let m = catalog::lookup(name).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(m.mig.is_some(), mig, "{name}");
    }
    for m in catalog::models() {
        if let Some(g) = &m.mig {
            g.check().unwrap_or_else(|e| panic!("{}: {e}", m.name));
            // Every profile alone fits at each of its placements.
            for p in &g.gi_profiles {
                for pl in &p.placements {
                    mig::validate(g, &[mig::PlacedInstance::new(p.name.clone(), pl.start)])
                        .unwrap();
                }
            }
        }
    }
}

#[test]
fn lookup_by_name_pci_and_product() {
    assert_eq!(
        catalog::lookup("a100-sxm4-40gb").unwrap().name,
        "A100-SXM4-40GB"
    );
    assert_eq!(
        catalog::lookup("0x20B010DE").unwrap().name,
        "A100-SXM4-40GB"
    );
    assert_eq!(
        catalog::lookup("0x20b010de").unwrap().name,
        "A100-SXM4-40GB"
    );
    assert_eq!(
        catalog::lookup("NVIDIA H100 80GB HBM3").unwrap().name,
        "H100-SXM5-80GB"
    );
    assert_eq!(
        catalog::by_pci_device_id(0x2BB510DE).unwrap().architecture,
        Architecture::Blackwell
    );
    assert_eq!(catalog::lookup("T4").unwrap().compute_capability, (7, 5));
    let e = catalog::lookup("Z9000").unwrap_err();
    assert!(e.to_string().contains("Z9000"));
    assert!(catalog::lookup("0x00000000").is_err());
}

#[test]
fn names_collide_across_gpus_and_resolve_per_device() {
    let a40 = catalog::lookup("A100-SXM4-40GB")
        .unwrap()
        .mig
        .as_ref()
        .unwrap();
    let h80 = catalog::lookup("H100-SXM5-80GB")
        .unwrap()
        .mig
        .as_ref()
        .unwrap();
    let name = "1g.10gb".parse().unwrap();
    let (a, h) = (a40.resolve(&name).unwrap(), h80.resolve(&name).unwrap());
    assert_eq!((a.id, a.max_instances), (15, 4));
    assert_eq!((h.id, h.max_instances), (19, 7));
    let rtx = catalog::lookup("RTX-PRO-6000-Blackwell")
        .unwrap()
        .mig
        .as_ref()
        .unwrap();
    assert_eq!(rtx.memory_slices, 12);
    assert_eq!(rtx.resolve(&"1g.24gb".parse().unwrap()).unwrap().id, 14);
}

#[test]
fn inferred_data_is_flagged_and_runtime_data_overrides() {
    let h200 = catalog::lookup("H200-SXM-141GB")
        .unwrap()
        .mig
        .as_ref()
        .unwrap();
    assert!(h200.gi_profiles.iter().all(|p| p.inferred));
    let a100 = catalog::lookup("A100-SXM4-40GB")
        .unwrap()
        .mig
        .as_ref()
        .unwrap();
    assert!(a100.gi_profiles.iter().all(|p| !p.inferred));
    // A device that reports only 1g profiles at even starts.
    let mut p = h200.gi_profiles[0].clone();
    p.inferred = false;
    p.placements = vec![
        Placement { start: 0, size: 1 },
        Placement { start: 2, size: 1 },
    ];
    let runtime = h200.with_runtime_profiles(vec![p]).unwrap();
    assert_eq!(runtime.source, mig::GeometrySource::Runtime);
    assert!(mig::validate(&runtime, &mig::parse_layout("1g.18gb@1").unwrap()).is_err());
    assert!(mig::validate(&runtime, &mig::parse_layout("1g.18gb@2").unwrap()).is_ok());
    // Bad runtime data is refused.
    let mut bad = h200.gi_profiles[0].clone();
    bad.placements = vec![Placement { start: 8, size: 1 }];
    let mut g = h200.clone();
    g.memory_slices = 8;
    assert!(g.with_runtime_profiles(vec![bad.clone(), bad]).is_err());
}

const FLEET: &str = r#"
nodes:
  - name: node-a
    labels: { example.com/rack: "r1" }
    gpus:
      - model: A100-SXM4-40GB
        count: 2
        mig:
          enabled: true
          instances: ["3g.20gb@4", "1g.5gb@0"]
          in-use: ["3g.20gb@4"]
      - model: T4
  - name: node-b
    gpus:
      - model: "0x233010DE"
        mig: { enabled: true }
"#;

#[test]
fn fleet_parses_and_plans() {
    let fleet = Fleet::from_yaml(FLEET).unwrap();
    let gpus = fleet.gpus();
    assert_eq!(gpus.len(), 4);
    assert_eq!(gpus[2].model.name, "T4");
    assert_eq!(gpus[3].id(), "node-b/gpu0");
    let planner = fleet.planner_gpus();
    assert_eq!(planner.len(), 3);
    let plan =
        mig::plan_fleet(&planner, &mig::parse_demand("3g.20gb=3,1g.10gb=7").unwrap()).unwrap();
    assert_eq!(plan.profiles[0].planned, 3);
    assert_eq!(plan.profiles[1].planned, 7);
    assert!(Fleet::from_yaml("").unwrap().nodes.is_empty());
}

#[test]
fn fleet_errors_name_node_and_gpu() {
    let err = |s: &str| Fleet::from_yaml(s).unwrap_err();
    let e = err("nodes:\n  - name: n1\n    gpus:\n      - model: Z9000\n");
    assert!(
        matches!(&e, FleetError::Gpu { node, index: 0, .. } if node == "n1"),
        "{e}"
    );
    let e = err(
        "nodes:\n  - name: n1\n    gpus:\n      - model: A30\n      - model: A100-SXM4-40GB\n        mig: { enabled: true, instances: [\"3g.20gb@0\", \"1g.5gb@3\"] }\n",
    );
    assert!(matches!(&e, FleetError::Gpu { index: 1, .. }), "{e}");
    assert!(e.to_string().contains("overlap"), "{e}");
    let e = err(
        "nodes:\n  - name: n1\n    gpus:\n      - model: A30\n        mig: { enabled: true, in-use: [\"1g.6gb@0\"] }\n",
    );
    assert!(e.to_string().contains("in-use"), "{e}");
    let e =
        err("nodes:\n  - name: n1\n    gpus:\n      - model: T4\n        mig: { enabled: true }\n");
    assert!(e.to_string().contains("does not support MIG"), "{e}");
    let e = err("nodes:\n  - name: n1\n  - name: n1\n");
    assert!(e.to_string().contains("twice"), "{e}");
    let e = err("nodes:\n  - name: n1\n    colour: red\n");
    assert!(matches!(e, FleetError::Parse(_)), "{e}");
}

#[test]
fn idle_instances_move_when_that_serves_more_demand() {
    let text = r#"
nodes:
  - name: a
    gpus:
      - model: A100-SXM4-40GB
        count: 3
        mig: { enabled: true, instances: ["3g.20gb@4", "1g.5gb@0"], in-use: ["3g.20gb@4"] }
"#;
    let fleet = Fleet::from_yaml(text).unwrap();
    let plan = mig::plan_fleet(
        &fleet.planner_gpus(),
        &mig::parse_demand("1g.5gb=6,3g.20gb=4").unwrap(),
    )
    .unwrap();
    let p = |n: &str| plan.profiles.iter().find(|o| o.profile == n).unwrap();
    assert_eq!(p("3g.20gb").planned, 4, "{plan:#?}");
    assert_eq!(p("3g.20gb").in_use, 3);
    // One idle 1g.5gb gives way to the 3g; the others stay.
    assert_eq!(plan.destroyed, 1, "{plan:#?}");
    for g in &plan.gpus {
        assert!(g.target.contains(&"3g.20gb@4".parse().unwrap()));
    }
}
