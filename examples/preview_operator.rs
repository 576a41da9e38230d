//! Preview what the gpu-stack operator would do to a cluster described in a
//! fleet file, without a cluster: another controller (or a CI check) can reuse
//! the desired-state function and the component graph the same way.
//!
//! ```sh
//! cargo run -p gpu-stack-examples --example preview_operator -- \
//!     examples/fleets/mixed.yaml [clusterpolicy.yaml]
//! ```
use std::process::ExitCode;

use gpu_stack_core::fleet::Fleet;
use gpu_stack_core::operator::components::{self, Component};
use gpu_stack_k8s::operator::cluster::fleet::nodes_from_fleet;
use gpu_stack_k8s::operator::clusterpolicy::{ClusterPolicy, ClusterPolicySpec};
use gpu_stack_k8s::operator::desired::{Options, desired_state};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("preview_operator: {e}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let fleet_path = args
        .next()
        .unwrap_or_else(|| concat!(env!("CARGO_MANIFEST_DIR"), "/fleets/mixed.yaml").to_string());
    let fleet = Fleet::from_yaml(&std::fs::read_to_string(&fleet_path)?)?;
    let policy: ClusterPolicy = match args.next() {
        Some(p) => gpu_stack_core::yaml_guard::from_str(&std::fs::read_to_string(p)?)?,
        None => ClusterPolicy::new("cluster-policy", ClusterPolicySpec::default()),
    };

    println!("Component graph (each after what it depends on):");
    for c in components::topological_order() {
        let deps: Vec<String> = c.depends_on().iter().map(Component::to_string).collect();
        let gates: Vec<&str> = c.gates().iter().map(|g| g.status_file()).collect();
        println!(
            "  {:<22} needs [{}], waits for [{}]",
            c.to_string(),
            deps.join(", "),
            gates.join(", ")
        );
    }

    let nodes = nodes_from_fleet(&fleet);
    let d = desired_state(&policy, &nodes, &[], &Options::default());

    println!("\nNode label changes:");
    for (node, patch) in &d.node_labels {
        let set: Vec<String> = patch
            .iter()
            .map(|(k, v)| match v {
                Some(v) => format!("{k}={v}"),
                None => format!("-{k}"),
            })
            .collect();
        println!("  {node}: {}", set.join(" "));
    }
    println!("\nDriver pools:");
    for p in &d.driver.pools {
        println!(
            "  {} -> {} ({} modules) on {:?}",
            p.name,
            p.image,
            p.kernel_module_type.as_str(),
            p.nodes
        );
    }
    for r in d.driver.refused.iter().chain(&d.driver.unpooled) {
        println!("  refused {}: {}", r.node, r.reason);
    }
    println!("\nObjects the operator would create ({}):", d.objects.len());
    for o in &d.objects {
        println!("  {}", o.key());
    }
    println!("\nStatus: {}", d.status.state);
    for c in &d.status.conditions {
        println!("  {}={} {}: {}", c.type_, c.status, c.reason, c.message);
    }
    for f in &d.status.unsupported_fields {
        println!("  unsupported: {f}");
    }
    Ok(())
}
