//! The demo's steps: the operator converges on the fleet with a default
//! ClusterPolicy, the node agents run, a MIG change, a node joins, a
//! component is disabled, an impossible driver is refused, and an idle pass
//! rewrites nothing. Each step is narrated in [`Format::Text`]; in
//! [`Format::Json`] only the final state is written.
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use futures::executor::block_on;
use gpu_stack_core::fleet::Fleet;
use gpu_stack_core::operator::labels::MIG_CONFIG;

use super::DemoError;
use super::agents::{
    AgentSettings, DemoNode, NodeAgentsReport, pick_mig_change, run_agents, run_node_agents,
    simulated_nodes,
};
use super::render;
use super::setup::{
    DEFAULT_FLEET, IMPOSSIBLE_DRIVER, MIG_STRATEGY, POLICY, default_policy, demo_clock,
    joining_node,
};
use crate::operator::Operator;
use crate::operator::cluster::fleet::{node_from_fleet, nodes_from_fleet};
use crate::operator::cluster::{Cluster, InMemoryCluster};
use crate::operator::clusterpolicy::{ComponentSpec, DriverSpec};

/// Most operator passes one convergence may take.
const MAX_PASSES: usize = 10;

/// Where the demo's cluster comes from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum FleetSource {
    /// The built-in mixed cluster ([`DEFAULT_FLEET`](super::DEFAULT_FLEET)).
    #[default]
    BuiltIn,
    /// A fleet file.
    File(PathBuf),
}

/// What the demo writes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Format {
    /// Step-by-step narration.
    #[default]
    Text,
    /// The final state as JSON: nodes, objects, ClusterPolicy, MIG change.
    Json,
}

/// How to run the demo.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DemoOptions {
    /// The cluster's nodes.
    pub fleet: FleetSource,
    /// Output format.
    pub format: Format,
    /// Run the device plugin, GFD, the exporter and the MIG manager as the
    /// one node agent DaemonSet (`nodeAgent.enabled` in the ClusterPolicy).
    pub node_agent: bool,
}

/// The fleet and how to name where it came from in messages.
fn load_fleet(source: &FleetSource) -> Result<(Fleet, String), DemoError> {
    let (text, name) = match source {
        FleetSource::File(path) => (
            std::fs::read_to_string(path).map_err(|source| DemoError::ReadFleet {
                path: path.clone(),
                source,
            })?,
            path.display().to_string(),
        ),
        FleetSource::BuiltIn => (
            DEFAULT_FLEET.to_string(),
            "built-in mixed cluster".to_string(),
        ),
    };
    let fleet = Fleet::from_yaml(&text).map_err(|source| DemoError::Fleet {
        fleet: name.clone(),
        source,
    })?;
    Ok((fleet, name))
}

/// Runs the demo, writing its narration or final state to `out`.
///
/// Output is the same on every run: the operator's clock and the simulated
/// GPUs' clocks are fixed. A failure to write is [`DemoError::Output`]
/// (see [`DemoError::is_broken_pipe`]).
pub fn run(options: &DemoOptions, out: &mut dyn Write) -> Result<(), DemoError> {
    let (fleet, source) = load_fleet(&options.fleet)?;
    let text = options.format == Format::Text;
    // The agents' passes run on a runtime of their own (the MIG manager may
    // wait, bounded, for client pods to leave).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(DemoError::Runtime)?;
    let mut sim_nodes = simulated_nodes(&fleet).map_err(|e| DemoError::FleetNodes {
        fleet: source.clone(),
        source: Box::new(e),
    })?;

    let cluster = InMemoryCluster::new();
    for n in nodes_from_fleet(&fleet) {
        cluster.upsert_node(n);
    }
    let policy = default_policy(options.node_agent);
    let settings = AgentSettings::from_policy(&policy)?;
    cluster.upsert_policy(policy);
    let mut demo = Scenario {
        op: Operator::new(cluster).with_clock(demo_clock()),
        rt,
        settings,
        out,
        text,
        agents: BTreeMap::new(),
    };

    let gpu_nodes = sim_nodes.len();
    let nodes = fleet.nodes.len();
    demo.show(|out, _| {
        render::line(
            out,
            &format!(
                "gpu-stack demo: operator and node agents against an in-memory cluster ({source}: {nodes} nodes, {gpu_nodes} with simulated GPUs)"
            ),
        )
    })?;
    demo.start()?;
    demo.agents_start(&sim_nodes)?;
    let mig = demo.mig_change(&sim_nodes)?;
    let (newcomer, joined) = demo.node_joins(&fleet)?;
    sim_nodes.extend(joined);
    demo.disable_exporter(&sim_nodes)?;
    demo.impossible_driver(&newcomer)?;
    demo.idle_pass()?;
    if !demo.text {
        render::print_json(
            &mut *demo.out,
            demo.op.cluster(),
            &demo.agents,
            mig.as_ref(),
        )?;
    }
    Ok(())
}

/// The MIG change of step 3: the node, the config it was labelled with, and
/// its agents' pass.
pub(super) struct MigChange {
    /// Node.
    pub(super) node: String,
    /// The selected mig-parted config.
    pub(super) config: String,
    /// The node's agents' pass after the change.
    pub(super) report: NodeAgentsReport,
}

/// The demo's cluster, agents and output as the steps go.
struct Scenario<'w> {
    /// The operator over the in-memory cluster.
    op: Operator<InMemoryCluster>,
    /// Runtime of the agents' passes.
    rt: tokio::runtime::Runtime,
    /// The agents' settings from the ClusterPolicy.
    settings: AgentSettings,
    /// Where narration and the final state go.
    out: &'w mut dyn Write,
    /// Narrate each step ([`Format::Text`]).
    text: bool,
    /// Latest agent results per node.
    agents: BTreeMap<String, NodeAgentsReport>,
}

impl Scenario<'_> {
    /// Runs `f` on the output and the cluster when narrating.
    fn show(
        &mut self,
        f: impl FnOnce(&mut dyn Write, &InMemoryCluster) -> Result<(), DemoError>,
    ) -> Result<(), DemoError> {
        if self.text {
            f(&mut *self.out, self.op.cluster())
        } else {
            Ok(())
        }
    }

    /// The operator converges; each pass is narrated as `<what> pass <n>`.
    fn converge(&mut self, what: &str) -> Result<(), DemoError> {
        let reports = block_on(self.op.converge(MAX_PASSES))?;
        self.show(|out, _| {
            for (i, r) in reports.iter().enumerate() {
                render::print_pass(out, what, i + 1, r)?;
            }
            Ok(())
        })
    }

    /// The operator converges, the kubelets start the pods, and it converges
    /// again.
    fn converge_and_settle(&mut self) -> Result<(), DemoError> {
        self.converge("reconcile")?;
        self.op.cluster().settle();
        self.converge("after pods start")
    }

    /// One pass of the agents of `nodes`.
    fn run_agents(&self, nodes: &[DemoNode]) -> Result<Vec<NodeAgentsReport>, DemoError> {
        self.rt
            .block_on(run_agents(self.op.cluster(), nodes, &self.settings))
    }

    /// Keeps the latest agent results per node.
    fn remember(&mut self, reports: Vec<NodeAgentsReport>) {
        for r in reports {
            self.agents.insert(r.node.clone(), r);
        }
    }

    /// Step 1: the operator starts with a default ClusterPolicy.
    fn start(&mut self) -> Result<(), DemoError> {
        self.show(|out, _| {
            render::heading(out, 1, "the operator starts with a default ClusterPolicy")
        })?;
        self.converge("reconcile")?;
        self.show(|out, c| {
            render::print_nodes(out, c)?;
            render::print_daemonsets(out, c)?;
            render::print_status(out, c)?;
            render::line(out, "\n  ... kubelets start the pods ...")
        })?;
        self.op.cluster().settle();
        self.converge("reconcile")?;
        self.show(|out, c| {
            render::print_daemonsets(out, c)?;
            render::print_status(out, c)
        })
    }

    /// Step 2: the node agents run on each GPU node's simulated GPUs.
    fn agents_start(&mut self, sim_nodes: &[DemoNode]) -> Result<(), DemoError> {
        self.show(|out, _| {
            render::heading(
                out,
                2,
                &format!(
                    "the node agents run on each GPU node's simulated GPUs (MIG strategy {MIG_STRATEGY})"
                ),
            )
        })?;
        let reports = self.run_agents(sim_nodes)?;
        self.show(|out, c| {
            render::print_agents(out, c, &reports)?;
            match reports.iter().find(|r| r.metrics.is_some()) {
                Some(r) => render::print_series(out, r, false),
                None => Ok(()),
            }
        })?;
        self.remember(reports);
        self.converge("operator reconcile")
    }

    /// Step 3: a user selects an all-1g MIG layout on one node and the MIG
    /// manager applies it; the change, if a node of the fleet takes such a
    /// layout.
    fn mig_change(&mut self, sim_nodes: &[DemoNode]) -> Result<Option<MigChange>, DemoError> {
        let Some((node, config)) = pick_mig_change(sim_nodes, &self.settings.mig_config) else {
            self.show(|out, _| {
                render::heading(
                    out,
                    3,
                    "no GPU in this fleet takes an all-1g MIG layout: no MIG change to show",
                )
            })?;
            return Ok(None);
        };
        self.show(|out, _| {
            render::heading(
                out,
                3,
                &format!("a user labels {node} {MIG_CONFIG}={config}: the MIG manager takes over"),
            )
        })?;
        let patch = [(MIG_CONFIG.to_string(), Some(config.clone()))].into();
        block_on(Cluster::patch_node_labels(self.op.cluster(), &node, &patch))?;
        let sim = sim_nodes
            .iter()
            .find(|n| n.name == node)
            .ok_or_else(|| DemoError::MigNodeNotSimulated { node: node.clone() })?;
        let r = self
            .rt
            .block_on(run_node_agents(self.op.cluster(), sim, &self.settings))?;
        self.show(|out, c| render::print_mig_change(out, c, &r))?;
        self.converge("operator reconcile")?;
        self.show(|out, c| render::print_nodes_named(out, c, &[node.as_str()]))?;
        self.remember(vec![r.clone()]);
        Ok(Some(MigChange {
            node,
            config,
            report: r,
        }))
    }

    /// Step 4: a node joins, gets its labels, its own driver pool and its
    /// agents; its name and simulated GPUs.
    fn node_joins(&mut self, fleet: &Fleet) -> Result<(String, Vec<DemoNode>), DemoError> {
        let newcomer = joining_node(fleet);
        self.show(|out, _| {
            render::heading(
                out,
                4,
                &format!(
                    "a node joins: {} (Ubuntu 24.04, 8x H200): it gets labels, its own driver pool and its agents",
                    newcomer.name
                ),
            )
        })?;
        self.op.cluster().upsert_node(node_from_fleet(&newcomer));
        self.converge_and_settle()?;
        let mut joined_fleet = fleet.clone();
        joined_fleet.nodes = vec![newcomer.clone()];
        let joined = simulated_nodes(&joined_fleet)?;
        let reports = self.run_agents(&joined)?;
        self.show(|out, c| {
            render::print_nodes_named(out, c, &[newcomer.name.as_str()])?;
            render::print_daemonsets(out, c)?;
            render::print_status(out, c)?;
            render::print_agents(out, c, &reports)
        })?;
        self.remember(reports);
        Ok((newcomer.name, joined))
    }

    /// Step 5: the exporter is disabled; its objects go away and it stops on
    /// every node.
    fn disable_exporter(&mut self, sim_nodes: &[DemoNode]) -> Result<(), DemoError> {
        let c_has_node_agent = self
            .op
            .cluster()
            .policy(POLICY)
            .is_some_and(|p| p.spec.node_agent_enabled());
        self.show(|out, _| {
            render::heading(
                out,
                5,
                if c_has_node_agent {
                    "dcgmExporter.enabled=false: the node agent stops running it"
                } else {
                    "dcgmExporter.enabled=false: its DaemonSet, RBAC and ServiceAccount go away"
                },
            )
        })?;
        let mut policy = self
            .op
            .cluster()
            .policy(POLICY)
            .ok_or(DemoError::PolicyMissing)?;
        policy.spec.dcgm_exporter = Some(ComponentSpec {
            enabled: Some(false),
            ..Default::default()
        });
        self.op.cluster().upsert_policy(policy);
        self.converge_and_settle()?;
        let reports = self.run_agents(sim_nodes)?;
        self.show(|out, c| {
            render::print_daemonsets(out, c)?;
            render::print_status(out, c)?;
            let exporting = reports.iter().filter(|r| r.running.dcgm_exporter).count();
            render::line(
                out,
                &format!(
                    "\n  Node agents pass: the exporter runs on {exporting} of {} GPU nodes",
                    reports.len()
                ),
            )
        })?;
        self.remember(reports);
        Ok(())
    }

    /// Step 6: a driver too old for the joined node's H200 GPUs is requested
    /// and refused for that node before anything rolls out.
    fn impossible_driver(&mut self, newcomer: &str) -> Result<(), DemoError> {
        self.show(|out, _| {
            render::heading(
                out,
                6,
                &format!(
                    "driver.version={IMPOSSIBLE_DRIVER} is requested: H200 needs R550, so {newcomer} is refused before anything rolls out"
                ),
            )
        })?;
        let mut policy = self
            .op
            .cluster()
            .policy(POLICY)
            .ok_or(DemoError::PolicyMissing)?;
        let mut driver = policy
            .spec
            .driver
            .clone()
            .unwrap_or_else(DriverSpec::default);
        driver.common.version = Some(IMPOSSIBLE_DRIVER.into());
        policy.spec.driver = Some(driver);
        self.op.cluster().upsert_policy(policy);
        self.converge_and_settle()?;
        self.show(|out, c| {
            render::print_daemonsets(out, c)?;
            render::print_status(out, c)
        })
    }

    /// Step 7: an idle pass rewrites nothing.
    fn idle_pass(&mut self) -> Result<(), DemoError> {
        let before = self.op.cluster().stats().writes;
        let idle = block_on(self.op.reconcile_once())?;
        let after = self.op.cluster().stats().writes;
        self.show(|out, _| {
            render::heading(out, 7, "an idle reconcile pass")?;
            render::line(
                out,
                &format!(
                    "  {} objects unchanged (hash annotation matches), {} cluster writes",
                    idle.unchanged,
                    after.saturating_sub(before)
                ),
            )
        })
    }
}
