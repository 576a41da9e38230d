//! `gpu-stack demo`: the operator against an in-memory cluster built from a
//! fleet file, step by step; then the node agents (GPU feature discovery,
//! device plugin, exporter, MIG manager) on each GPU node's simulated GPUs,
//! a MIG change, and a few changes converging. The orchestration lives in
//! `gpu_stack_k8s::demo`; this file holds the flags and the printing.
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
use gpu_stack_k8s::clusterpolicy::{
    ClusterPolicy, ClusterPolicySpec, ComponentSpec, DriverSpec, MigSpec,
};
use gpu_stack_k8s::demo::{
    AgentSettings, NodeAgentsReport, mig_succeeded, pick_mig_change, run_agents, run_node_agents,
    simulated_nodes,
};
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

/// MIG strategy of the demo's ClusterPolicy: MIG devices are advertised as
/// `nvidia.com/mig-<profile>`, whole GPUs as `nvidia.com/gpu`.
const MIG_STRATEGY: &str = "mixed";
/// Metrics shown from a whole GPU.
const GPU_SERIES: [&str; 4] = [
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_POWER_USAGE",
];
/// Metrics shown per GPU instance of a MIG GPU.
const MIG_SERIES: [&str; 2] = ["DCGM_FI_DEV_FB_USED", "DCGM_FI_PROF_GR_ENGINE_ACTIVE"];
/// GPU instances whose series are shown.
const MIG_INSTANCES_SHOWN: [&str; 2] = ["GPU_I_ID=\"1\"", "GPU_I_ID=\"2\""];
/// Series lines shown per GPU.
const SERIES_SHOWN: usize = 4;

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
    let spec = ClusterPolicySpec {
        mig: Some(MigSpec {
            strategy: Some(MIG_STRATEGY.into()),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut p = ClusterPolicy::new(POLICY, spec);
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
    // The agents' passes run on a runtime of their own (the MIG manager may
    // wait, bounded, for client pods to leave).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .context("could not start the demo's runtime")?;
    let mut sim_nodes = simulated_nodes(&fleet).with_context(|| format!("fleet file {source}"))?;

    let cluster = InMemoryCluster::new();
    for n in nodes_from_fleet(&fleet) {
        cluster.upsert_node(n);
    }
    let policy = default_policy();
    let settings = AgentSettings::from_policy(&policy)?;
    cluster.upsert_policy(policy);
    let op = Operator::new(cluster).with_clock(demo_clock());
    // Latest agent results per node.
    let mut agents: BTreeMap<String, NodeAgentsReport> = BTreeMap::new();

    let gpu_nodes = sim_nodes.len();
    if say {
        say!(
            "gpu-stack demo: operator and node agents against an in-memory cluster ({source}: {} nodes, {gpu_nodes} with simulated GPUs)",
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

    // The node agents start.
    if say {
        heading(
            2,
            &format!(
                "the node agents run on each GPU node's simulated GPUs (MIG strategy {MIG_STRATEGY})"
            ),
        );
    }
    let reports = rt.block_on(run_agents(op.cluster(), &sim_nodes, &settings))?;
    if say {
        print_agents(op.cluster(), &reports);
        if let Some(r) = reports.iter().find(|r| r.metrics.is_some()) {
            print_series(r, false);
        }
    }
    remember(&mut agents, reports);
    converge(&op, say, "operator reconcile")?;

    // A MIG change.
    let mig_change = pick_mig_change(&sim_nodes, &settings.mig_config);
    let mut mig_report = None;
    match &mig_change {
        Some((node, config)) => {
            if say {
                heading(
                    3,
                    &format!(
                        "a user labels {node} {MIG_CONFIG}={config}: the MIG manager takes over"
                    ),
                );
            }
            let patch = [(MIG_CONFIG.to_string(), Some(config.clone()))].into();
            block_on(gpu_stack_k8s::cluster::Cluster::patch_node_labels(
                op.cluster(),
                node,
                &patch,
            ))?;
            let sim = sim_nodes
                .iter()
                .find(|n| &n.name == node)
                .context("the MIG change's node has no simulated GPUs")?;
            let r = rt.block_on(run_node_agents(op.cluster(), sim, &settings))?;
            if say {
                print_mig_change(op.cluster(), &r);
            }
            converge(&op, say, "operator reconcile")?;
            if say {
                print_nodes_named(op.cluster(), &[node.as_str()]);
            }
            mig_report = Some(r.clone());
            remember(&mut agents, vec![r]);
        }
        None => {
            if say {
                heading(
                    3,
                    "no GPU in this fleet takes an all-1g MIG layout: no MIG change to show",
                );
            }
        }
    }

    // A node joins.
    let newcomer = joining_node(&fleet);
    if say {
        heading(
            4,
            &format!(
                "a node joins: {} (Ubuntu 24.04, 8x H200): it gets labels, its own driver pool and its agents",
                newcomer.name
            ),
        );
    }
    op.cluster().upsert_node(node_from_fleet(&newcomer));
    converge(&op, say, "reconcile")?;
    op.cluster().settle();
    converge(&op, say, "after pods start")?;
    let mut joined_fleet = fleet.clone();
    joined_fleet.nodes = vec![newcomer.clone()];
    let joined = simulated_nodes(&joined_fleet)?;
    let reports = rt.block_on(run_agents(op.cluster(), &joined, &settings))?;
    if say {
        print_nodes_named(op.cluster(), &[newcomer.name.as_str()]);
        print_daemonsets(op.cluster());
        print_status(op.cluster());
        print_agents(op.cluster(), &reports);
    }
    remember(&mut agents, reports);
    sim_nodes.extend(joined);

    // A component is disabled.
    if say {
        heading(
            5,
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
    let reports = rt.block_on(run_agents(op.cluster(), &sim_nodes, &settings))?;
    if say {
        print_daemonsets(op.cluster());
        print_status(op.cluster());
        let exporting = reports.iter().filter(|r| r.running.dcgm_exporter).count();
        say!(
            "\n  Node agents pass: the exporter runs on {exporting} of {} GPU nodes",
            reports.len()
        );
    }
    remember(&mut agents, reports);

    // An impossible driver.
    if say {
        heading(
            6,
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
        heading(7, "an idle reconcile pass");
        say!(
            "  {} objects unchanged (hash annotation matches), {} cluster writes",
            idle.unchanged,
            after - before
        );
    } else {
        print_json(
            op.cluster(),
            &agents,
            mig_change.as_ref(),
            mig_report.as_ref(),
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

fn remember(agents: &mut BTreeMap<String, NodeAgentsReport>, reports: Vec<NodeAgentsReport>) {
    for r in reports {
        agents.insert(r.node.clone(), r);
    }
}

/// `nvidia.com/gpu=8 nvidia.com/mig-1g.10gb=56` from a Node's capacity.
fn capacity_summary(c: &InMemoryCluster, node: &str) -> String {
    let Some(n) = c
        .nodes()
        .into_iter()
        .find(|n| n.metadata.name.as_deref() == Some(node))
    else {
        return String::new();
    };
    let cap = n.status.and_then(|s| s.capacity).unwrap_or_default();
    let parts: Vec<String> = cap
        .iter()
        .filter(|(k, _)| k.starts_with("nvidia.com/"))
        .map(|(k, v)| format!("{k}={}", v.0))
        .collect();
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(" ")
    }
}

fn print_agents(c: &InMemoryCluster, reports: &[NodeAgentsReport]) {
    say!("\n  Node agents:");
    for r in reports {
        let labels = c
            .nodes()
            .into_iter()
            .find(|n| n.metadata.name.as_deref() == Some(r.node.as_str()))
            .and_then(|n| n.metadata.labels)
            .unwrap_or_default();
        let get = |k: &str| labels.get(k).cloned().unwrap_or_default();
        say!("    {}", r.node);
        if r.running.gpu_feature_discovery {
            let set = r.gfd_changes.values().filter(|v| v.is_some()).count();
            say!(
                "      gpu-feature-discovery  {set} labels: gpu.product={} gpu.count={} gpu.memory={} mig.capable={}",
                get("nvidia.com/gpu.product"),
                get("nvidia.com/gpu.count"),
                get("nvidia.com/gpu.memory"),
                get("nvidia.com/mig.capable"),
            );
        }
        if r.running.device_plugin {
            say!(
                "      device-plugin          capacity/allocatable: {}",
                capacity_summary(c, &r.node)
            );
        }
        if let Some(m) = &r.mig_manager {
            say!(
                "      mig-manager            {MIG_CONFIG}={} -> mig.config.state={}{}",
                m.config,
                m.state,
                m.reason
                    .as_ref()
                    .map(|r| format!(" ({r})"))
                    .unwrap_or_default()
            );
        }
        if r.running.dcgm_exporter {
            let series = r
                .metrics
                .as_deref()
                .map(|t| t.lines().filter(|l| !l.starts_with('#')).count())
                .unwrap_or(0);
            say!("      dcgm-exporter          {series} series for GPU 0");
        }
    }
}

/// A few of the exporter's lines for GPU 0: whole-GPU metrics, or the
/// per-GPU-instance series of a MIG GPU.
fn series_sample(r: &NodeAgentsReport, mig: bool) -> Vec<String> {
    let Some(text) = r.metrics.as_deref() else {
        return Vec::new();
    };
    let series: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    let of = |names: &[&str], l: &str| names.iter().any(|m| l.starts_with(&format!("{m}{{")));
    let mut picked: Vec<&str> = if mig {
        series
            .iter()
            .copied()
            .filter(|l| of(&MIG_SERIES, l))
            .filter(|l| MIG_INSTANCES_SHOWN.iter().any(|i| l.contains(i)))
            .collect()
    } else {
        series
            .iter()
            .copied()
            .filter(|l| of(&GPU_SERIES, l))
            .collect()
    };
    if picked.is_empty() && mig {
        picked = series
            .iter()
            .copied()
            .filter(|l| l.contains("GPU_I_PROFILE="))
            .collect();
    }
    picked
        .into_iter()
        .take(SERIES_SHOWN)
        .map(str::to_string)
        .collect()
}

fn print_series(r: &NodeAgentsReport, mig: bool) {
    say!(
        "\n  Exporter on {}, GPU 0 (a few of its DCGM series):",
        r.node
    );
    for l in series_sample(r, mig) {
        say!("    {l}");
    }
}

fn print_mig_change(c: &InMemoryCluster, r: &NodeAgentsReport) {
    let Some(m) = &r.mig_manager else {
        say!("  the MIG manager does not run on {}", r.node);
        return;
    };
    for (i, w) in m.writes.iter().enumerate() {
        let state = w
            .set
            .get("nvidia.com/mig.config.state")
            .cloned()
            .unwrap_or_default();
        let mut deploy: Vec<String> = w
            .set
            .iter()
            .filter_map(|(k, v)| k.strip_prefix(DEPLOY_PREFIX).map(|c| format!("{c}={v}")))
            .collect();
        let removed: Vec<&str> = w
            .removed
            .iter()
            .filter_map(|k| k.strip_prefix(DEPLOY_PREFIX))
            .collect();
        if !removed.is_empty() {
            deploy.push(format!("(removed {}: absent before)", removed.join(" ")));
        }
        say!(
            "  mig-manager write {}: mig.config.state={state}{}",
            i + 1,
            if deploy.is_empty() {
                String::new()
            } else {
                format!("; {}", deploy.join(" "))
            }
        );
        if state == "pending" {
            say!(
                "  mig-manager: client pods left; applying {} on the GPUs",
                m.config
            );
        }
    }
    if !mig_succeeded(r) {
        say!(
            "  mig-manager: {}{}",
            m.state,
            m.reason
                .as_ref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default()
        );
    }
    let mut per_gpu: BTreeMap<String, usize> = BTreeMap::new();
    for g in &r.layout {
        let key = if g.mig_enabled {
            let mut profiles: BTreeMap<&str, usize> = BTreeMap::new();
            for p in &g.mig_devices {
                *profiles.entry(p.as_str()).or_default() += 1;
            }
            let list: Vec<String> = profiles.iter().map(|(p, n)| format!("{n}x {p}")).collect();
            format!("MIG on, {}", list.join(" + "))
        } else {
            "MIG off".into()
        };
        *per_gpu.entry(key).or_default() += 1;
    }
    for (layout, n) in per_gpu {
        say!("  GPU layout: {n} GPU(s) {layout}");
    }
    let set: Vec<String> = r
        .gfd_changes
        .iter()
        .filter_map(|(k, v)| v.as_ref().map(|v| (k, v)))
        .filter(|(k, _)| {
            k.ends_with(".count") || k.ends_with("strategy") || k.ends_with(".product")
        })
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let removed = r.gfd_changes.values().filter(|v| v.is_none()).count();
    say!(
        "  gpu-feature-discovery relabelled ({} set, {removed} removed): {}",
        r.gfd_changes.len() - removed,
        set.join(" ")
    );
    say!(
        "  device-plugin advertises: {}",
        capacity_summary(c, &r.node)
    );
    print_series(r, true);
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

fn print_json(
    c: &InMemoryCluster,
    agents: &BTreeMap<String, NodeAgentsReport>,
    mig_change: Option<&(String, String)>,
    mig_report: Option<&NodeAgentsReport>,
) -> Result<()> {
    let nodes: Vec<serde_json::Value> = c
        .nodes()
        .iter()
        .map(|n| {
            let name = n.metadata.name.clone().unwrap_or_default();
            let status = n.status.clone().unwrap_or_default();
            let agent = agents.get(&name);
            serde_json::json!({
                "name": n.metadata.name,
                "labels": n.metadata.labels,
                "annotations": n.metadata.annotations,
                "capacity": status.capacity,
                "allocatable": status.allocatable,
                "agents": agent.map(|a| a.running),
                "migLayout": agent.map(|a| &a.layout),
            })
        })
        .collect();
    let objects: Vec<serde_json::Value> = c.objects().iter().map(Object::to_json).collect();
    let mig = match (mig_change, mig_report) {
        (Some((node, config)), Some(r)) => serde_json::json!({
            "node": node,
            "config": config,
            "migManager": r.mig_manager,
            "gfdChanges": r.gfd_changes,
            "resources": r.resources,
            "exporterSample": series_sample(r, true),
        }),
        _ => serde_json::Value::Null,
    };
    let out = serde_json::json!({
        "nodes": nodes,
        "objects": objects,
        "clusterPolicy": c.policy(POLICY),
        "migChange": mig,
    });
    say!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
