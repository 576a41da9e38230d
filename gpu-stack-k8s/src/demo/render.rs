//! How the demo shows the cluster: the step-by-step narration (operator
//! passes, node labels, DaemonSets, ClusterPolicy status, the agents' results)
//! and the final state as JSON.
use std::collections::BTreeMap;
use std::io::Write;

use gpu_stack_core::operator::labels::{DEPLOY_PREFIX, GPU_PRESENT, MIG_CONFIG};

use super::DemoError;
use super::agents::{NodeAgentsReport, mig_succeeded};
use super::scenario::MigChange;
use super::setup::POLICY;
use crate::operator::PassReport;
use crate::operator::cluster::selector::pod_fits_node;
use crate::operator::cluster::{InMemoryCluster, Object};

/// Writes a line to `$out`, returning [`DemoError::Output`] when it fails.
macro_rules! say {
    ($out:expr, $($t:tt)*) => {
        writeln!($out, $($t)*).map_err(DemoError::Output)?
    };
}

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

/// A plain line of narration.
pub(super) fn line(out: &mut dyn Write, text: &str) -> Result<(), DemoError> {
    say!(out, "{text}");
    Ok(())
}

/// `== Step <n>: <text>`, after a blank line.
pub(super) fn heading(out: &mut dyn Write, n: usize, text: &str) -> Result<(), DemoError> {
    say!(out, "\n== Step {n}: {text}");
    Ok(())
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

/// What each node's agents did: GFD's labels, the device plugin's capacity,
/// the MIG manager's state, the exporter's series count.
pub(super) fn print_agents(
    out: &mut dyn Write,
    c: &InMemoryCluster,
    reports: &[NodeAgentsReport],
) -> Result<(), DemoError> {
    say!(out, "\n  Node agents:");
    for r in reports {
        let labels = c
            .nodes()
            .into_iter()
            .find(|n| n.metadata.name.as_deref() == Some(r.node.as_str()))
            .and_then(|n| n.metadata.labels)
            .unwrap_or_default();
        let get = |k: &str| labels.get(k).cloned().unwrap_or_default();
        say!(out, "    {}", r.node);
        if r.running.gpu_feature_discovery {
            let set = r.gfd_changes.values().filter(|v| v.is_some()).count();
            say!(
                out,
                "      gpu-feature-discovery  {set} labels: gpu.product={} gpu.count={} gpu.memory={} mig.capable={}",
                get("nvidia.com/gpu.product"),
                get("nvidia.com/gpu.count"),
                get("nvidia.com/gpu.memory"),
                get("nvidia.com/mig.capable"),
            );
        }
        if r.running.device_plugin {
            say!(
                out,
                "      device-plugin          capacity/allocatable: {}",
                capacity_summary(c, &r.node)
            );
        }
        if let Some(m) = &r.mig_manager {
            say!(
                out,
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
            say!(
                out,
                "      dcgm-exporter          {series} series for GPU 0"
            );
        }
    }
    Ok(())
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

/// A few of the exporter's series for GPU 0 of a node.
pub(super) fn print_series(
    out: &mut dyn Write,
    r: &NodeAgentsReport,
    mig: bool,
) -> Result<(), DemoError> {
    say!(
        out,
        "\n  Exporter on {}, GPU 0 (a few of its DCGM series):",
        r.node
    );
    for l in series_sample(r, mig) {
        say!(out, "    {l}");
    }
    Ok(())
}

/// A MIG change on one node: the manager's writes, the resulting layout,
/// GFD's relabelling, the device plugin's resources and the exporter's
/// per-instance series.
pub(super) fn print_mig_change(
    out: &mut dyn Write,
    c: &InMemoryCluster,
    r: &NodeAgentsReport,
) -> Result<(), DemoError> {
    let Some(m) = &r.mig_manager else {
        say!(out, "  the MIG manager does not run on {}", r.node);
        return Ok(());
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
            out,
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
                out,
                "  mig-manager: client pods left; applying {} on the GPUs",
                m.config
            );
        }
    }
    if !mig_succeeded(r) {
        say!(
            out,
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
        say!(out, "  GPU layout: {n} GPU(s) {layout}");
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
        out,
        "  gpu-feature-discovery relabelled ({} set, {removed} removed): {}",
        r.gfd_changes.len() - removed,
        set.join(" ")
    );
    say!(
        out,
        "  device-plugin advertises: {}",
        capacity_summary(c, &r.node)
    );
    print_series(out, r, true)
}

/// One operator pass: nodes labelled, objects applied by kind, objects
/// deleted, objects unchanged.
pub(super) fn print_pass(
    out: &mut dyn Write,
    what: &str,
    n: usize,
    r: &PassReport,
) -> Result<(), DemoError> {
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
    say!(out, "  {what} pass {n}: {}", parts.join("; "));
    Ok(())
}

/// A node's operator labels in one line: the components deployed, the
/// deploy labels kept as others wrote them, the selected MIG config.
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

/// Every node's operator labels.
pub(super) fn print_nodes(out: &mut dyn Write, c: &InMemoryCluster) -> Result<(), DemoError> {
    say!(out, "\n  Node labels written by the operator:");
    for n in c.nodes() {
        let labels = n.metadata.labels.clone().unwrap_or_default();
        say!(
            out,
            "    {:<12} {}",
            n.metadata.name.as_deref().unwrap_or(""),
            node_summary(&labels)
        );
    }
    Ok(())
}

/// The operator labels of the nodes named.
pub(super) fn print_nodes_named(
    out: &mut dyn Write,
    c: &InMemoryCluster,
    names: &[&str],
) -> Result<(), DemoError> {
    say!(out, "\n  Node labels:");
    for n in c.nodes() {
        let name = n.metadata.name.as_deref().unwrap_or("");
        if names.contains(&name) {
            let labels = n.metadata.labels.clone().unwrap_or_default();
            say!(out, "    {name:<12} {}", node_summary(&labels));
        }
    }
    Ok(())
}

/// The DaemonSets with their desired and ready counts and image; for driver
/// DaemonSets, their kernel module type and nodes.
pub(super) fn print_daemonsets(out: &mut dyn Write, c: &InMemoryCluster) -> Result<(), DemoError> {
    say!(out, "\n  DaemonSets (namespace gpu-operator):");
    say!(
        out,
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
        let spec = ds.spec.template.spec.as_ref();
        let image = spec
            .and_then(|s| s.containers.first())
            .and_then(|c| c.image.clone())
            .unwrap_or_default();
        say!(
            out,
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
                .filter(|n| pod_fits_node(spec, n))
                .filter_map(|n| n.metadata.name.clone())
                .collect();
            let modules = spec
                .containers
                .first()
                .and_then(|c| c.env.as_ref())
                .and_then(|e| e.iter().find(|v| v.name == "KERNEL_MODULE_TYPE"))
                .and_then(|v| v.value.clone())
                .unwrap_or_default();
            say!(out, "      modules {modules}, nodes: {}", on.join(", "));
        }
    }
    Ok(())
}

/// The demo ClusterPolicy's state and conditions (a `False` Error condition
/// left out) and its unsupported fields.
pub(super) fn print_status(out: &mut dyn Write, c: &InMemoryCluster) -> Result<(), DemoError> {
    let Some(p) = c.policy(POLICY) else {
        return Ok(());
    };
    let Some(st) = p.status else { return Ok(()) };
    say!(out, "\n  ClusterPolicy {POLICY}: {}", st.state);
    for cond in &st.conditions {
        if cond.type_ == "Error" && cond.status == "False" {
            continue;
        }
        say!(
            out,
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
            out,
            "    unsupported fields: {}",
            st.unsupported_fields.join(", ")
        );
    }
    Ok(())
}

/// The final state as pretty JSON: nodes with their capacity, agents and MIG
/// layout; every object; the ClusterPolicy; the MIG change, if any.
pub(super) fn print_json(
    out: &mut dyn Write,
    c: &InMemoryCluster,
    agents: &BTreeMap<String, NodeAgentsReport>,
    mig_change: Option<&MigChange>,
) -> Result<(), DemoError> {
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
    let mig = match mig_change {
        Some(MigChange {
            node,
            config,
            report: r,
        }) => serde_json::json!({
            "node": node,
            "config": config,
            "migManager": r.mig_manager,
            "gfdChanges": r.gfd_changes,
            "resources": r.resources,
            "exporterSample": series_sample(r, true),
        }),
        None => serde_json::Value::Null,
    };
    let state = serde_json::json!({
        "nodes": nodes,
        "objects": objects,
        "clusterPolicy": c.policy(POLICY),
        "migChange": mig,
    });
    say!(out, "{}", serde_json::to_string_pretty(&state)?);
    Ok(())
}
