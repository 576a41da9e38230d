//! The node agents of the embedded demo (`gpu-stack demo`): after the operator
//! has labelled the nodes of an [`InMemoryCluster`] and its DaemonSets run,
//! each GPU node's agents run in-process against that node's simulated GPUs,
//! through the same library code the agent binaries use:
//!
//! - the MIG manager's pass ([`crate::migmanager::reconcile`]) over the
//!   cluster's [`NodeApi`] implementation;
//! - GPU feature discovery ([`gpu_stack_core::gfd::labels`]) publishing its
//!   label changes ([`crate::deviceplugin::labels::label_changes`]);
//! - the device plugin's resources ([`gpu_stack_core::deviceplugin::node_resources`]),
//!   shown as the Node's capacity and allocatable, as the kubelet would;
//! - the exporter's DCGM series ([`gpu_stack_core::metrics::render()`]) for one GPU.
//!
//! An agent runs on a node only while its DaemonSet's pod template fits that
//! node, so a paused or disabled component does nothing there. Every
//! simulated node runs on a manual clock fixed at [`SIM_TIME_MS`], so the
//! telemetry, and with it the whole demo, is the same on every run.
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use gpu_stack_core::backend::GpuBackend;
use gpu_stack_core::deviceplugin::{NodeGpus, Overrides, Settings, node_resources};
use gpu_stack_core::fleet::Fleet;
use gpu_stack_core::gfd::{self, GfdContext};
use gpu_stack_core::metrics::{
    Attributions, CounterSet, Format, GpuRound, RenderOptions, gpu_samples, render,
};
use gpu_stack_core::migmanager::{LabelEdits, MigConfigState};
use gpu_stack_core::migparted::MigPartedConfig;
use gpu_stack_core::operator::components::Component;
use gpu_stack_core::operator::labels::MIG_CONFIG;
use gpu_stack_nvml::migapply::{self, NoProcesses};
use gpu_stack_nvml::{SimClock, SimNodeSpec, SimulatedBackend};
use k8s_openapi::api::core::v1::{Node, NodeStatus};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde::Serialize;

use super::DemoError;
use crate::deviceplugin::labels::label_changes;
use crate::deviceplugin::node::read_node_gpus;
use crate::migmanager::{
    ManagerError, ManagerOptions, NodeApi, NodePatch, NodeView, PassResult, reconcile,
};
use crate::operator::cluster::selector::pod_fits_node;
use crate::operator::cluster::{ClusterError, InMemoryCluster, Object};
use crate::operator::clusterpolicy::ClusterPolicy;
use crate::operator::desired::render::NODE_AGENT_NAME;

/// Simulated time of every demo node, in milliseconds since its start.
pub const SIM_TIME_MS: u64 = 60_000;

/// Resource-name prefix the device plugin owns in a Node's capacity.
const RESOURCE_PREFIX: &str = "nvidia.com/";

/// One GPU node of the demo and its simulated GPUs.
#[derive(Debug, Clone)]
pub struct DemoNode {
    /// Node name (as in the fleet and the cluster).
    pub name: String,
    /// The node's simulated GPUs.
    pub backend: SimulatedBackend,
}

/// A simulated backend for every fleet node with GPUs, in fleet order, on a
/// manual clock fixed at [`SIM_TIME_MS`].
pub fn simulated_nodes(fleet: &Fleet) -> Result<Vec<DemoNode>, DemoError> {
    let mut out = Vec::new();
    for n in fleet
        .nodes
        .iter()
        .filter(|n| n.gpus.iter().any(|g| g.count > 0))
    {
        let err = |detail: String| DemoError::Simulation {
            node: n.name.clone(),
            detail,
        };
        let spec = SimNodeSpec::from_fleet(fleet, Some(&n.name)).map_err(|e| err(e.to_string()))?;
        let clock = SimClock::Manual(Arc::new(AtomicU64::new(SIM_TIME_MS)));
        let backend = SimulatedBackend::with_clock(&spec, clock).map_err(|e| err(e.to_string()))?;
        out.push(DemoNode {
            name: n.name.clone(),
            backend,
        });
    }
    Ok(out)
}

/// What the agents are configured with, as the operator's DaemonSets would
/// configure them from the ClusterPolicy.
#[derive(Debug, Clone)]
pub struct AgentSettings {
    /// Device plugin and GFD settings (`MIG_STRATEGY` from `spec.mig.strategy`).
    pub device_plugin: Settings,
    /// The MIG manager's mig-parted config (NVIDIA's shipped default).
    pub mig_config: MigPartedConfig,
}

impl AgentSettings {
    /// Settings from a ClusterPolicy.
    pub fn from_policy(policy: &ClusterPolicy) -> Result<AgentSettings, DemoError> {
        let overrides = Overrides {
            mig_strategy: Some(policy.spec.mig_strategy().to_string()),
            ..Default::default()
        };
        let device_plugin =
            Settings::resolve(None, &overrides).map_err(|e| DemoError::Settings(e.to_string()))?;
        let mig_config =
            MigPartedConfig::default_config().map_err(|e| DemoError::MigConfig(e.to_string()))?;
        Ok(AgentSettings {
            device_plugin,
            mig_config,
        })
    }
}

/// Which agents have a pod on a node (their DaemonSet's template fits it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RunningAgents {
    /// GPU feature discovery.
    pub gpu_feature_discovery: bool,
    /// Device plugin.
    pub device_plugin: bool,
    /// DCGM exporter.
    pub dcgm_exporter: bool,
    /// MIG manager.
    pub mig_manager: bool,
}

/// The agents whose DaemonSet schedules a pod on `node`.
pub fn running_agents(cluster: &InMemoryCluster, node: &str) -> RunningAgents {
    let Some(n) = cluster
        .nodes()
        .into_iter()
        .find(|n| n.metadata.name.as_deref() == Some(node))
    else {
        return RunningAgents::default();
    };
    let objects = cluster.objects();
    let labels = n.metadata.labels.clone().unwrap_or_default();
    let runs = |c: Component| {
        objects.iter().any(|o| {
            let Object::DaemonSet(ds) = o else {
                return false;
            };
            let Some(pod) = ds.spec.template.spec.as_ref() else {
                return false;
            };
            if !pod_fits_node(pod, &n) {
                return false;
            }
            if o.name() == c.daemonset_name() {
                return true;
            }
            // The node agent runs a component it hosts while its label is true.
            o.name() == NODE_AGENT_NAME
                && gpu_stack_core::nodeagent::should_run(&labels, c)
                && gpu_stack_core::nodeagent::binary_name(c).is_some_and(|b| {
                    pod.containers
                        .iter()
                        .any(|k| k.args.iter().flatten().any(|a| a == b))
                })
        })
    };
    RunningAgents {
        gpu_feature_discovery: runs(Component::GpuFeatureDiscovery),
        device_plugin: runs(Component::DevicePlugin),
        dcgm_exporter: runs(Component::DcgmExporter),
        mig_manager: runs(Component::MigManager),
    }
}

/// One GPU's MIG layout as the agents saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuLayout {
    /// NVML index.
    pub index: u32,
    /// Marketing name.
    pub product: String,
    /// MIG mode in effect.
    pub mig_enabled: bool,
    /// Profiles of its MIG devices, in device order.
    pub mig_devices: Vec<String>,
}

/// The layout of a node's GPUs.
pub fn layout(gpus: &NodeGpus) -> Vec<GpuLayout> {
    gpus.gpus
        .iter()
        .map(|g| GpuLayout {
            index: g.index,
            product: g.product.clone(),
            mig_enabled: g.mig_enabled,
            mig_devices: g.mig_devices.iter().map(|m| m.profile.clone()).collect(),
        })
        .collect()
}

/// One node write of the MIG manager: labels set and removed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ManagerWrite {
    /// Labels set.
    pub set: BTreeMap<String, String>,
    /// Labels removed.
    pub removed: Vec<String>,
}

/// What the MIG manager did on a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ManagerReport {
    /// The selected config (`nvidia.com/mig.config`).
    pub config: String,
    /// The state it reported (`nvidia.com/mig.config.state`).
    pub state: String,
    /// The failure reason, for `failed`.
    pub reason: Option<String>,
    /// Its label writes, in order.
    pub writes: Vec<ManagerWrite>,
}

/// What one node's agents did in one pass.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeAgentsReport {
    /// Node.
    pub node: String,
    /// Agents that ran.
    pub running: RunningAgents,
    /// The MIG manager's pass, when it ran and the node selects a config.
    pub mig_manager: Option<ManagerReport>,
    /// GFD's label changes (`None` removes); empty when nothing changed.
    pub gfd_changes: BTreeMap<String, Option<String>>,
    /// Resources the device plugin advertises, with their device counts.
    pub resources: BTreeMap<String, u64>,
    /// The GPUs' MIG layout after the pass.
    pub layout: Vec<GpuLayout>,
    /// The exporter's Prometheus text for GPU 0 (`None` when it does not run).
    pub metrics: Option<String>,
}

/// The node API with a record of the manager's label writes.
struct Recording<'a> {
    cluster: &'a InMemoryCluster,
    writes: std::sync::Mutex<Vec<LabelEdits>>,
}

impl NodeApi for Recording<'_> {
    async fn get(&self, node: &str) -> Result<NodeView, ManagerError> {
        NodeApi::get(self.cluster, node).await
    }

    async fn patch(&self, node: &str, patch: &NodePatch) -> Result<(), ManagerError> {
        NodeApi::patch(self.cluster, node, patch).await?;
        if let Ok(mut w) = self.writes.lock() {
            w.push(patch.labels.clone());
        }
        Ok(())
    }

    async fn pods_on_node(&self, node: &str, apps: &[&str]) -> Result<Vec<String>, ManagerError> {
        self.cluster.pods_on_node(node, apps).await
    }
}

fn read_gpus(node: &DemoNode) -> Result<NodeGpus, DemoError> {
    read_node_gpus(&node.backend, None).map_err(|source| DemoError::Backend {
        node: node.name.clone(),
        source,
    })
}

fn node_labels(
    cluster: &InMemoryCluster,
    node: &str,
) -> Result<BTreeMap<String, String>, DemoError> {
    cluster
        .nodes()
        .into_iter()
        .find(|n| n.metadata.name.as_deref() == Some(node))
        .map(|n| n.metadata.labels.unwrap_or_default())
        .ok_or_else(|| {
            DemoError::Cluster(ClusterError::NotFound {
                what: format!("Node/{node}"),
            })
        })
}

/// Runs the MIG manager's pass on a node when the node selects a config.
async fn run_mig_manager(
    cluster: &InMemoryCluster,
    node: &DemoNode,
    settings: &AgentSettings,
) -> Result<Option<ManagerReport>, DemoError> {
    let Some(config) = node_labels(cluster, &node.name)?.get(MIG_CONFIG).cloned() else {
        return Ok(None);
    };
    let api = Recording {
        cluster,
        writes: std::sync::Mutex::new(Vec::new()),
    };
    let opts = ManagerOptions {
        node: node.name.clone(),
        force: false,
        client_timeout: Duration::from_secs(5),
        poll: Duration::from_millis(10),
        // As the manager binary does by default: a MIG mode change that waits
        // for a reset gets one.
        reset_gpus: true,
        signal_file: None,
    };
    let result = reconcile(
        &api,
        &node.backend,
        &settings.mig_config,
        &opts,
        &NoProcesses,
    )
    .await?;
    let (state, reason) = match result {
        PassResult::NoConfig => return Ok(None),
        PassResult::State(s, r) => (s, r),
    };
    let writes = api
        .writes
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .into_iter()
        .map(|e| ManagerWrite {
            set: e.set,
            removed: e.remove,
        })
        .collect();
    Ok(Some(ManagerReport {
        config,
        state: state.to_string(),
        reason,
        writes,
    }))
}

/// Writes the device plugin's resources as the Node's capacity and
/// allocatable, as the kubelet does: a resource no longer advertised stays
/// with quantity 0.
fn publish_resources(
    cluster: &InMemoryCluster,
    node: &str,
    resources: &BTreeMap<String, u64>,
) -> Result<Node, DemoError> {
    Ok(cluster.update_node(node, |n| {
        let status = n.status.get_or_insert_with(NodeStatus::default);
        for map in [&mut status.capacity, &mut status.allocatable] {
            let m = map.get_or_insert_with(BTreeMap::new);
            for (k, v) in m.iter_mut() {
                if k.starts_with(RESOURCE_PREFIX) && !resources.contains_key(k) {
                    *v = Quantity("0".into());
                }
            }
            for (k, count) in resources {
                m.insert(k.clone(), Quantity(count.to_string()));
            }
        }
    })?)
}

/// The exporter's Prometheus text for one GPU.
fn exporter_text(node: &DemoNode, gpu: u32) -> Result<String, DemoError> {
    let b: &dyn GpuBackend = &node.backend;
    let err = |source| DemoError::Backend {
        node: node.name.clone(),
        source,
    };
    let info = b.gpu_info(gpu).map_err(err)?;
    let telemetry = b.gpu_telemetry(gpu).map_err(err)?;
    let mig_on = info.mig_mode.map(|m| m.current).unwrap_or(false);
    let (gis, tel) = if mig_on {
        (
            b.gpu_instances(gpu).map_err(err)?,
            b.mig_telemetry(gpu).map_err(err)?,
        )
    } else {
        (Vec::new(), Vec::new())
    };
    let round = GpuRound {
        info: &info,
        telemetry: &telemetry,
        mig: mig_on.then_some((gis.as_slice(), tel.as_slice())),
        nvlink_rate_mib_s: None,
        nvlink_link_rates_mib_s: &[],
        strings: None,
    };
    let mut errors = Vec::new();
    let samples = gpu_samples(round, &mut errors);
    for e in &errors {
        tracing::warn!(node = %node.name, gpu = e.gpu, call = e.call, error = %e.message, "telemetry read failed");
    }
    let opts = RenderOptions {
        hostname: Some(node.name.clone()),
        driver_version: b.system_info().ok().map(|s| s.driver_version),
        ..Default::default()
    };
    Ok(render(
        &CounterSet::default_set(),
        &samples,
        &Attributions::default(),
        &opts,
        Format::Prometheus,
    ))
}

/// Runs one node's agents once, in the order a MIG change needs: the MIG
/// manager, then GFD, the device plugin and the exporter on the resulting
/// layout.
pub async fn run_node_agents(
    cluster: &InMemoryCluster,
    node: &DemoNode,
    settings: &AgentSettings,
) -> Result<NodeAgentsReport, DemoError> {
    let running = running_agents(cluster, &node.name);
    let mig_manager = if running.mig_manager {
        run_mig_manager(cluster, node, settings).await?
    } else {
        None
    };
    // The clients start again only after the manager restored their labels.
    let running = RunningAgents {
        mig_manager: running.mig_manager,
        ..running_agents(cluster, &node.name)
    };
    let gpus = read_gpus(node)?;
    let dp = &settings.device_plugin;

    let mut gfd_changes = BTreeMap::new();
    if running.gpu_feature_discovery {
        let desired = gfd::labels(&gpus, dp, &GfdContext::default());
        gfd_changes = label_changes(&node_labels(cluster, &node.name)?, &desired);
        if !gfd_changes.is_empty() {
            crate::operator::cluster::Cluster::patch_node_labels(cluster, &node.name, &gfd_changes)
                .await?;
        }
    }

    let mut resources = BTreeMap::new();
    if running.device_plugin {
        let list = node_resources(&gpus, dp).map_err(|e| DemoError::Resources {
            node: node.name.clone(),
            detail: e.to_string(),
        })?;
        resources = list
            .iter()
            .map(|r| (r.name.clone(), r.devices.len() as u64))
            .collect();
        publish_resources(cluster, &node.name, &resources)?;
    }

    let metrics = if running.dcgm_exporter && !gpus.gpus.is_empty() {
        Some(exporter_text(node, gpus.gpus[0].index)?)
    } else {
        None
    };

    Ok(NodeAgentsReport {
        node: node.name.clone(),
        running,
        mig_manager,
        gfd_changes,
        resources,
        layout: layout(&gpus),
        metrics,
    })
}

/// Runs every node's agents once, in the given order.
pub async fn run_agents(
    cluster: &InMemoryCluster,
    nodes: &[DemoNode],
    settings: &AgentSettings,
) -> Result<Vec<NodeAgentsReport>, DemoError> {
    let mut out = Vec::with_capacity(nodes.len());
    for n in nodes {
        out.push(run_node_agents(cluster, n, settings).await?);
    }
    Ok(out)
}

/// A MIG change worth showing: the first node (H100 nodes first) whose GPUs a
/// single-profile `all-1g.*` config of `config` would change, and that
/// config's name (`all-1g.10gb` first).
pub fn pick_mig_change(nodes: &[DemoNode], config: &MigPartedConfig) -> Option<(String, String)> {
    let mut candidates: Vec<&str> = config
        .names()
        .into_iter()
        .filter(|n| n.starts_with("all-1g.") && !n.contains(".me") && !n.contains("-me"))
        .collect();
    candidates.sort_by_key(|n| (*n != "all-1g.10gb", n.to_string()));
    let is_h100 = |n: &DemoNode| {
        n.backend
            .inventory()
            .map(|inv| inv.gpus.iter().any(|g| g.name.contains("H100")))
            .unwrap_or(false)
    };
    let mut ordered: Vec<&DemoNode> = nodes.iter().collect();
    ordered.sort_by_key(|n| !is_h100(n));
    for n in ordered {
        for c in &candidates {
            if let Ok(plan) = migapply::plan_node(&n.backend, config, c, &NoProcesses)
                && !plan.gpus.is_empty()
                && !plan.is_converged()
            {
                return Some((n.name.clone(), c.to_string()));
            }
        }
    }
    None
}

/// True when a report says the MIG manager reached `success`.
pub fn mig_succeeded(report: &NodeAgentsReport) -> bool {
    report
        .mig_manager
        .as_ref()
        .is_some_and(|m| m.state == MigConfigState::Success.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::operator::Operator;
    use crate::operator::cluster::fleet::nodes_from_fleet;
    use crate::operator::clusterpolicy::{ClusterPolicySpec, MigSpec};
    use futures::executor::block_on;

    const MIXED: &str = include_str!("../../../examples/fleets/mixed.yaml");

    /// The mixed fleet after the operator converged and its pods started.
    fn cluster() -> (Operator<InMemoryCluster>, Vec<DemoNode>, AgentSettings) {
        let fleet = Fleet::from_yaml(MIXED).unwrap();
        let c = InMemoryCluster::new();
        for n in nodes_from_fleet(&fleet) {
            c.upsert_node(n);
        }
        let spec = ClusterPolicySpec {
            mig: Some(MigSpec {
                strategy: Some("mixed".into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let policy = ClusterPolicy::new("cluster-policy", spec);
        let settings = AgentSettings::from_policy(&policy).unwrap();
        c.upsert_policy(policy);
        let op = Operator::new(c);
        block_on(op.converge(10)).unwrap();
        op.cluster().settle();
        let nodes = simulated_nodes(&fleet).unwrap();
        (op, nodes, settings)
    }

    fn node(c: &InMemoryCluster, name: &str) -> Node {
        c.nodes()
            .into_iter()
            .find(|n| n.metadata.name.as_deref() == Some(name))
            .unwrap()
    }

    fn capacity(c: &InMemoryCluster, name: &str, res: &str) -> Option<String> {
        node(c, name)
            .status
            .and_then(|s| s.capacity)
            .and_then(|m| m.get(res).map(|q| q.0.clone()))
    }

    #[test]
    fn agents_label_gpu_nodes_and_publish_capacity() {
        let (op, nodes, settings) = cluster();
        let c = op.cluster();
        assert_eq!(
            nodes.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(),
            ["dgx-a100-0", "hgx-h100-0", "l4-rhel-0", "l4-rhel-1"]
        );
        let reports = block_on(run_agents(c, &nodes, &settings)).unwrap();
        for r in &reports {
            assert!(
                r.running.gpu_feature_discovery && r.running.device_plugin,
                "{r:?}"
            );
            assert!(
                r.metrics
                    .as_deref()
                    .unwrap()
                    .contains("DCGM_FI_DEV_GPU_TEMP{")
            );
        }
        let h100 = node(c, "hgx-h100-0").metadata.labels.unwrap();
        assert_eq!(h100["nvidia.com/gpu.product"], "NVIDIA-H100-80GB-HBM3");
        assert_eq!(h100["nvidia.com/gpu.count"], "8");
        assert_eq!(h100["nvidia.com/mig.strategy"], "mixed");
        // The manager found all-disabled already in place.
        assert_eq!(h100["nvidia.com/mig.config.state"], "success");
        assert_eq!(
            capacity(c, "hgx-h100-0", "nvidia.com/gpu").as_deref(),
            Some("8")
        );
        assert_eq!(
            capacity(c, "l4-rhel-1", "nvidia.com/gpu").as_deref(),
            Some("1")
        );
        // L4 nodes have no MIG manager.
        assert!(reports[2].mig_manager.is_none() && !reports[2].running.mig_manager);
        // CPU nodes are untouched.
        let cpu = node(c, "cpu-0");
        assert!(cpu.status.is_none());
        assert!(
            !cpu.metadata
                .labels
                .unwrap()
                .keys()
                .any(|k| k.starts_with("nvidia.com/"))
        );
        // A second pass changes nothing.
        let writes = c.stats().writes;
        let again = block_on(run_agents(c, &nodes, &settings)).unwrap();
        assert!(again.iter().all(|r| r.gfd_changes.is_empty()));
        assert_eq!(c.stats().writes, writes);
    }

    #[test]
    fn mig_change_pauses_applies_restores_and_relabels() {
        let (op, nodes, settings) = cluster();
        let c = op.cluster();
        block_on(run_agents(c, &nodes, &settings)).unwrap();
        let (name, config) = pick_mig_change(&nodes, &settings.mig_config).unwrap();
        assert_eq!(
            (name.as_str(), config.as_str()),
            ("hgx-h100-0", "all-1g.10gb")
        );
        let patch = [(MIG_CONFIG.to_string(), Some(config.clone()))].into();
        block_on(crate::operator::cluster::Cluster::patch_node_labels(
            c, &name, &patch,
        ))
        .unwrap();
        let n = nodes.iter().find(|n| n.name == name).unwrap();
        let r = block_on(run_node_agents(c, n, &settings)).unwrap();

        let m = r.mig_manager.as_ref().unwrap();
        assert!(mig_succeeded(&r), "{m:?}");
        assert_eq!(m.writes.len(), 2, "{m:?}");
        assert_eq!(
            m.writes[0].set["nvidia.com/gpu.deploy.device-plugin"],
            "paused-for-mig-change"
        );
        assert_eq!(m.writes[0].set["nvidia.com/mig.config.state"], "pending");
        assert_eq!(
            m.writes[1].set["nvidia.com/gpu.deploy.device-plugin"],
            "true"
        );
        assert_eq!(m.writes[1].set["nvidia.com/mig.config.state"], "success");

        assert!(
            r.layout
                .iter()
                .all(|g| g.mig_enabled && g.mig_devices.len() == 7)
        );
        assert_eq!(r.resources["nvidia.com/mig-1g.10gb"], 56);
        assert_eq!(
            r.gfd_changes["nvidia.com/mig-1g.10gb.count"],
            Some("56".to_string())
        );
        assert_eq!(
            capacity(c, &name, "nvidia.com/mig-1g.10gb").as_deref(),
            Some("56")
        );
        // kubelet keeps a resource no longer advertised at 0.
        assert_eq!(capacity(c, &name, "nvidia.com/gpu").as_deref(), Some("0"));
        assert!(r.metrics.unwrap().contains("GPU_I_PROFILE=\"1g.10gb\""));
        // The operator does not undo any of it.
        let reports = block_on(op.converge(10)).unwrap();
        assert!(reports.iter().all(|p| p.labelled.is_empty()));
        let labels = node(c, &name).metadata.labels.unwrap();
        assert_eq!(labels[MIG_CONFIG], "all-1g.10gb");
        assert_eq!(labels["nvidia.com/gpu.deploy.device-plugin"], "true");
    }

    #[test]
    fn paused_agents_do_nothing() {
        let (op, nodes, settings) = cluster();
        let c = op.cluster();
        let patch = [(
            "nvidia.com/gpu.deploy.device-plugin".to_string(),
            Some("false".to_string()),
        )]
        .into();
        block_on(crate::operator::cluster::Cluster::patch_node_labels(
            c,
            "l4-rhel-0",
            &patch,
        ))
        .unwrap();
        let n = nodes.iter().find(|n| n.name == "l4-rhel-0").unwrap();
        let r = block_on(run_node_agents(c, n, &settings)).unwrap();
        assert!(!r.running.device_plugin && r.resources.is_empty());
        assert!(node(c, "l4-rhel-0").status.is_none());
        assert!(!r.gfd_changes.is_empty());
    }
}
