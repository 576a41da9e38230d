//! `gpu-stack demo`: the operator against an in-memory cluster built from a
//! fleet file, step by step, then a few changes converging.
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicI64, Ordering};

use std::io::Write;

use anyhow::{Context, Result};
use futures::executor::block_on;
use gpu_stack_core::fleet::{Fleet, FleetGpuSpec, FleetNode};
use gpu_stack_core::operator::labels::{DEPLOY_PREFIX, GPU_PRESENT, MIG_CONFIG};
use gpu_stack_k8s::cluster::fleet::{node_from_fleet, nodes_from_fleet};
use gpu_stack_k8s::cluster::{InMemoryCluster, Object};
use gpu_stack_k8s::clusterpolicy::{ClusterPolicy, ClusterPolicySpec, ComponentSpec, DriverSpec};
use gpu_stack_k8s::operator::{Clock, Operator, PassReport};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

/// The default fleet: a few GPU nodes of different models on Ubuntu and RHEL,
/// plus CPU-only nodes.
pub const DEFAULT_FLEET: &str = include_str!("../../../examples/fleets/mixed.yaml");

/// Prints a line; a closed stdout (`| head`) ends output quietly instead of panicking.
macro_rules! say {
    ($($t:tt)*) => {{
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

/// Name of the demo's ClusterPolicy.
const POLICY: &str = "cluster-policy";
/// A driver branch too old for H200 GPUs (they need R550).
const IMPOSSIBLE_DRIVER: &str = "535.183.01";

/// Output format.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// Step-by-step narration.
    Text,
    /// The final state as JSON: nodes, objects, ClusterPolicy.
    Json,
}

/// Flags of `gpu-stack demo`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Fleet file with the cluster's nodes (default: a built-in mixed cluster
    /// of A100, H100 and L4 nodes on Ubuntu and RHEL, plus CPU-only nodes).
    #[arg(long, value_name = "FILE")]
    pub fleet: Option<PathBuf>,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
    pub output: Output,
}

/// A deterministic clock: one second per reading from a fixed epoch, so the
/// demo's output is the same on every run.
fn demo_clock() -> Clock {
    let t = AtomicI64::new(1_780_000_000);
    Box::new(move || {
        let s = t.fetch_add(1, Ordering::Relaxed);
        k8s_openapi::jiff::Timestamp::from_second(s)
            .map(|ts| ts.to_string())
            .unwrap_or_default()
    })
}

fn default_policy() -> ClusterPolicy {
    let mut p = ClusterPolicy::new(POLICY, ClusterPolicySpec::default());
    p.metadata = ObjectMeta {
        name: Some(POLICY.into()),
        creation_timestamp: k8s_openapi::jiff::Timestamp::from_second(1_780_000_000)
            .ok()
            .map(Time),
        ..Default::default()
    };
    p
}

fn joining_node(existing: &Fleet) -> FleetNode {
    let mut name = "h200-0".to_string();
    let mut i = 0;
    while existing.nodes.iter().any(|n| n.name == name) {
        i += 1;
        name = format!("h200-{i}");
    }
    FleetNode {
        name,
        labels: [
            ("feature.node.kubernetes.io/system-os_release.ID", "ubuntu"),
            (
                "feature.node.kubernetes.io/system-os_release.VERSION_ID",
                "24.04",
            ),
            (
                "feature.node.kubernetes.io/kernel-version.full",
                "6.8.0-45-generic",
            ),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect(),
        gpus: vec![FleetGpuSpec {
            model: "H200-SXM-141GB".into(),
            count: 8,
            mig: None,
            telemetry: None,
        }],
        ..Default::default()
    }
}

/// Runs `gpu-stack demo`.
pub fn run(args: Args) -> Result<ExitCode> {
    let (text, source) = match &args.fleet {
        Some(path) => (
            std::fs::read_to_string(path)
                .with_context(|| format!("could not read fleet file {}", path.display()))?,
            path.display().to_string(),
        ),
        None => (
            DEFAULT_FLEET.to_string(),
            "built-in mixed cluster".to_string(),
        ),
    };
    let fleet = Fleet::from_yaml(&text).with_context(|| format!("fleet file {source}"))?;
    let say = args.output == Output::Text;

    let cluster = InMemoryCluster::new();
    for n in nodes_from_fleet(&fleet) {
        cluster.upsert_node(n);
    }
    cluster.upsert_policy(default_policy());
    let op = Operator::new(cluster).with_clock(demo_clock());

    let gpu_nodes = fleet
        .nodes
        .iter()
        .filter(|n| n.gpus.iter().any(|g| g.count > 0))
        .count();
    if say {
        say!(
            "gpu-stack demo: operator against an in-memory cluster ({source}: {} nodes, {gpu_nodes} with GPUs)",
            fleet.nodes.len()
        );
        heading(1, "the operator starts with a default ClusterPolicy");
    }
    converge(&op, say, "reconcile")?;
    if say {
        print_nodes(op.cluster());
        print_daemonsets(op.cluster());
        print_status(op.cluster());
        say!("\n  ... kubelets start the pods ...");
    }
    op.cluster().settle();
    converge(&op, say, "reconcile")?;
    if say {
        print_daemonsets(op.cluster());
        print_status(op.cluster());
    }

    // A node joins.
    let newcomer = joining_node(&fleet);
    if say {
        heading(
            2,
            &format!(
                "a node joins: {} (Ubuntu 24.04, 8x H200): it gets labels and its own driver pool",
                newcomer.name
            ),
        );
    }
    op.cluster().upsert_node(node_from_fleet(&newcomer));
    converge(&op, say, "reconcile")?;
    op.cluster().settle();
    converge(&op, say, "after pods start")?;
    if say {
        print_nodes_named(op.cluster(), &[newcomer.name.as_str()]);
        print_daemonsets(op.cluster());
        print_status(op.cluster());
    }

    // A component is disabled.
    if say {
        heading(
            3,
            "dcgmExporter.enabled=false: its DaemonSet, RBAC and ServiceAccount go away",
        );
    }
    let mut policy = op
        .cluster()
        .policy(POLICY)
        .context("demo policy vanished")?;
    policy.spec.dcgm_exporter = Some(ComponentSpec {
        enabled: Some(false),
        ..Default::default()
    });
    op.cluster().upsert_policy(policy);
    converge(&op, say, "reconcile")?;
    op.cluster().settle();
    converge(&op, say, "after pods start")?;
    if say {
        print_daemonsets(op.cluster());
        print_status(op.cluster());
    }

    // An impossible driver.
    if say {
        heading(
            4,
            &format!(
                "driver.version={IMPOSSIBLE_DRIVER} is requested: H200 needs R550, so {} is refused before anything rolls out",
                newcomer.name
            ),
        );
    }
    let mut policy = op
        .cluster()
        .policy(POLICY)
        .context("demo policy vanished")?;
    let mut driver = policy
        .spec
        .driver
        .clone()
        .unwrap_or_else(DriverSpec::default);
    driver.common.version = Some(IMPOSSIBLE_DRIVER.into());
    policy.spec.driver = Some(driver);
    op.cluster().upsert_policy(policy);
    converge(&op, say, "reconcile")?;
    op.cluster().settle();
    converge(&op, say, "after pods start")?;
    if say {
        print_daemonsets(op.cluster());
        print_status(op.cluster());
    }

    // Idle pass: nothing is rewritten.
    let before = op.cluster().stats().writes;
    let idle = block_on(op.reconcile_once())?;
    let after = op.cluster().stats().writes;
    if say {
        heading(5, "an idle reconcile pass");
        say!(
            "  {} objects unchanged (hash annotation matches), {} cluster writes",
            idle.unchanged,
            after - before
        );
    } else {
        print_json(op.cluster())?;
    }
    Ok(ExitCode::SUCCESS)
}

fn heading(n: usize, text: &str) {
    say!("\n== Step {n}: {text}");
}

fn converge(op: &Operator<InMemoryCluster>, say: bool, what: &str) -> Result<()> {
    let reports = block_on(op.converge(10))?;
    if say {
        for (i, r) in reports.iter().enumerate() {
            print_pass(what, i + 1, r);
        }
    }
    Ok(())
}

fn print_pass(what: &str, n: usize, r: &PassReport) {
    let mut parts = Vec::new();
    if !r.labelled.is_empty() {
        parts.push(format!("labelled {} node(s)", r.labelled.len()));
    }
    if !r.applied.is_empty() {
        let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
        for k in &r.applied {
            *kinds.entry(k.kind.as_str()).or_default() += 1;
        }
        let list: Vec<String> = kinds.iter().map(|(k, n)| format!("{n} {k}")).collect();
        parts.push(format!("applied {}", list.join(", ")));
    }
    if !r.deleted.is_empty() {
        let names: Vec<String> = r
            .deleted
            .iter()
            .map(|k| format!("{}/{}", k.kind, k.name))
            .collect();
        parts.push(format!("deleted {}", names.join(", ")));
    }
    parts.push(format!("{} unchanged", r.unchanged));
    say!("  {what} pass {n}: {}", parts.join("; "));
}

fn node_summary(labels: &BTreeMap<String, String>) -> String {
    if labels.get(GPU_PRESENT).map(String::as_str) != Some("true") {
        return "no GPU: no operator labels, no operands".into();
    }
    let mut on = Vec::new();
    let mut other = Vec::new();
    for (k, v) in labels {
        if let Some(c) = k.strip_prefix(DEPLOY_PREFIX) {
            if v == "true" {
                on.push(c.to_string());
            } else {
                other.push(format!("{c}={v}"));
            }
        }
    }
    let mut s = format!("deploy: {}", on.join(" "));
    if !other.is_empty() {
        s.push_str(&format!(" | kept: {}", other.join(" ")));
    }
    if let Some(m) = labels.get(MIG_CONFIG) {
        s.push_str(&format!(" | mig.config={m}"));
    }
    s
}

fn print_nodes(c: &InMemoryCluster) {
    say!("\n  Node labels written by the operator:");
    for n in c.nodes() {
        let labels = n.metadata.labels.clone().unwrap_or_default();
        say!(
            "    {:<12} {}",
            n.metadata.name.as_deref().unwrap_or(""),
            node_summary(&labels)
        );
    }
}

fn print_nodes_named(c: &InMemoryCluster, names: &[&str]) {
    say!("\n  Node labels:");
    for n in c.nodes() {
        let name = n.metadata.name.as_deref().unwrap_or("");
        if names.contains(&name) {
            let labels = n.metadata.labels.clone().unwrap_or_default();
            say!("    {name:<12} {}", node_summary(&labels));
        }
    }
}

fn print_daemonsets(c: &InMemoryCluster) {
    say!("\n  DaemonSets (namespace gpu-operator):");
    say!(
        "    {:<44} {:>7} {:>5}  {}",
        "NAME",
        "DESIRED",
        "READY",
        "IMAGE"
    );
    let nodes = c.nodes();
    for o in c.objects() {
        let Object::DaemonSet(ds) = &o else { continue };
        let st = ds.status.clone().unwrap_or_default();
        let spec = ds.spec.as_ref().and_then(|s| s.template.spec.as_ref());
        let image = spec
            .and_then(|s| s.containers.first())
            .and_then(|c| c.image.clone())
            .unwrap_or_default();
        say!(
            "    {:<44} {:>7} {:>5}  {}",
            o.name(),
            st.desired_number_scheduled,
            st.number_ready,
            image
        );
        if o.name().starts_with("nvidia-driver-daemonset")
            && let Some(spec) = spec
        {
            let on: Vec<String> = nodes
                .iter()
                .filter(|n| gpu_stack_k8s::cluster::selector::pod_fits_node(spec, n))
                .filter_map(|n| n.metadata.name.clone())
                .collect();
            let modules = spec
                .containers
                .first()
                .and_then(|c| c.env.as_ref())
                .and_then(|e| e.iter().find(|v| v.name == "KERNEL_MODULE_TYPE"))
                .and_then(|v| v.value.clone())
                .unwrap_or_default();
            say!("      modules {modules}, nodes: {}", on.join(", "));
        }
    }
}

fn print_status(c: &InMemoryCluster) {
    let Some(p) = c.policy(POLICY) else { return };
    let Some(st) = p.status else { return };
    say!("\n  ClusterPolicy {POLICY}: {}", st.state);
    for cond in &st.conditions {
        if cond.type_ == "Error" && cond.status == "False" {
            continue;
        }
        say!(
            "    {}={} ({}){}",
            cond.type_,
            cond.status,
            cond.reason,
            if cond.message.is_empty() {
                String::new()
            } else {
                format!(": {}", cond.message)
            }
        );
    }
    if !st.unsupported_fields.is_empty() {
        say!(
            "    unsupported fields: {}",
            st.unsupported_fields.join(", ")
        );
    }
}

fn print_json(c: &InMemoryCluster) -> Result<()> {
    let nodes: Vec<serde_json::Value> = c
        .nodes()
        .iter()
        .map(|n| {
            serde_json::json!({
                "name": n.metadata.name,
                "labels": n.metadata.labels,
            })
        })
        .collect();
    let objects: Vec<serde_json::Value> = c.objects().iter().map(Object::to_json).collect();
    let out = serde_json::json!({
        "nodes": nodes,
        "objects": objects,
        "clusterPolicy": c.policy(POLICY),
    });
    say!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
