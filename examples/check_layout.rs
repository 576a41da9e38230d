//! A downstream tool that embeds gpu-stack-core: check a proposed MIG layout,
//! place a request, and plan a small fleet.
//!
//! Run: `cargo run -p gpu-stack-examples --example check_layout`

use gpu_stack_core::catalog;
use gpu_stack_core::fleet::Fleet;
use gpu_stack_core::mig;

const FLEET: &str = r#"
nodes:
  - name: train-1
    gpus:
      - model: H100-SXM5-80GB
        count: 2
        mig:
          enabled: true
          instances: ["3g.40gb@4", "1g.10gb@0"]
          in-use: ["3g.40gb@4"]
  - name: infer-1
    gpus:
      - model: "0x20B010DE"
        mig: { enabled: true }
"#;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = catalog::lookup("H100-SXM5-80GB")?;
    let geometry = model.mig.as_ref().ok_or("model has no MIG")?;

    // 1. A proposed layout with a mistake in it.
    let proposed = mig::parse_layout("3g.40gb@0,1g.10gb@3,2g.20gb@4")?;
    match mig::validate(geometry, &proposed) {
        Ok(()) => println!(
            "{} is valid on {}",
            mig::format_layout(&proposed),
            model.name
        ),
        Err(violations) => {
            println!(
                "{} is invalid on {}:",
                mig::format_layout(&proposed),
                model.name
            );
            for v in violations {
                println!("  - {v}");
            }
        }
    }

    // 2. Let the engine place the same request.
    let request = mig::parse_demand("3g.40gb=1,1g.10gb=1,2g.20gb=1")?;
    let placed = mig::fit(geometry, &request)?;
    println!("placed: {}", mig::format_layout(&placed));

    // 3. Plan a small fleet for a demand.
    let fleet = Fleet::from_yaml(FLEET)?;
    let gpus = fleet.planner_gpus();
    let plan = mig::plan_fleet(&gpus, &mig::parse_demand("3g.40gb=4,1g.10gb=6,1g.5gb=7")?)?;
    for gpu in plan.gpus.iter().filter(|g| g.changes()) {
        println!(
            "{}: destroy [{}] create [{}]",
            gpu.gpu,
            mig::format_layout(&gpu.destroy),
            mig::format_layout(&gpu.create)
        );
    }
    for p in &plan.profiles {
        println!(
            "{}: wanted {}, planned {}, unmet {}{}",
            p.profile,
            p.wanted,
            p.planned,
            p.unmet,
            p.reason
                .as_deref()
                .map(|r| format!(" ({r})"))
                .unwrap_or_default()
        );
    }
    Ok(())
}
