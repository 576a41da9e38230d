//! The operator: the ClusterPolicy CRD ([`clusterpolicy`]), the NVIDIADriver
//! CRD ([`nvidiadriver`]), the chart hooks' CRD upgrade and removal
//! ([`crds`]), the pure desired-state function ([`desired`]), the
//! [`cluster`] seam, the reconcile loop (this module), and what runs it on a
//! real cluster ([`controller`], [`leader`], [`metrics`]).
//!
//! The operator's reconcile loop over the [`Cluster`] seam.
//!
//! One pass: pick the ClusterPolicy in charge (oldest wins; the others are
//! marked `ignored`), compute the desired state from the policy, the nodes
//! and the owned objects, then act: node labels and objects at once (objects
//! in dependency stages), stale objects deleted, status last.
//! Passes are idempotent: a pass over a converged cluster writes nothing.

pub mod cluster;
pub mod clusterpolicy;
pub mod controller;
pub mod crds;
pub mod desired;
pub mod leader;
pub mod metrics;
pub mod migconfig;
pub mod nvidiadriver;
pub mod upgrade;

/// Committed files the unit tests compare with what the code generates.
#[cfg(test)]
pub(crate) mod committed {
    use std::path::PathBuf;

    /// Asserts that `deploy/<relative>` holds `actual`; `GPU_STACK_BLESS=1`
    /// rewrites it instead.
    pub fn check(relative: &str, actual: &str) {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy")
            .join(relative);
        if std::env::var_os("GPU_STACK_BLESS").is_some() {
            std::fs::write(&path, actual).unwrap();
            return;
        }
        let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e}; run with GPU_STACK_BLESS=1 to create it",
                path.display()
            )
        });
        assert!(
            expected == actual,
            "{} is out of date; run with GPU_STACK_BLESS=1 and review the diff.\n--- actual ---\n{actual}",
            path.display()
        );
    }
}

use std::collections::BTreeMap;

use futures::{Stream, StreamExt, TryStreamExt};
use gpu_stack_core::operator::driver::DriverPlan;
use gpu_stack_core::operator::labels::LabelPatch;
use serde::Serialize;

use crate::operator::cluster::{Cluster, ClusterError, Object, ObjectKey};
use crate::operator::clusterpolicy::status::{ClusterPolicyStatus, Condition};
use crate::operator::desired::{
    Options, active_policy, carry_condition_times, carry_times, ignored_status, is_deleting,
};
use crate::operator::migconfig::MigConfigStatus;
use crate::operator::nvidiadriver::NvidiaDriverStatus;

/// Errors of a reconcile pass.
#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    /// A cluster call failed.
    #[error("reconcile pass failed while {during}: {source}")]
    Cluster {
        /// What the pass was doing.
        during: String,
        /// The cluster error.
        #[source]
        source: ClusterError,
    },
    /// The cluster did not settle within the allowed number of passes.
    #[error(
        "the cluster still had changes after {passes} passes; something keeps rewriting owned objects or node labels"
    )]
    NotConverged {
        /// Passes run.
        passes: usize,
    },
}

/// Node label patches sent at once by a reconcile pass. Labels only need to
/// stay ahead of the DaemonSet controller, which starts pods on far fewer
/// nodes a second than this many patches label; each request in flight
/// holds its buffers, and the operator's memory is the budget that binds.
pub const NODE_PATCHES_IN_FLIGHT: usize = 8;

/// Object writes of one apply stage sent at once.
const OBJECT_APPLIES_IN_FLIGHT: usize = 8;

/// Node label patches prepared at a time.
const NODE_PATCH_BATCH: usize = 128;

fn during(what: impl Into<String>) -> impl FnOnce(ClusterError) -> OperatorError {
    let during = what.into();
    move |source| OperatorError::Cluster { during, source }
}

/// What one pass did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PassReport {
    /// The policy in charge, if any.
    pub policy: Option<String>,
    /// Policies marked ignored.
    pub ignored: Vec<String>,
    /// Objects created or replaced.
    pub applied: Vec<ObjectKey>,
    /// Objects deleted.
    pub deleted: Vec<ObjectKey>,
    /// Node label changes made.
    pub labelled: BTreeMap<String, LabelPatch>,
    /// Desired objects left untouched (hash unchanged).
    pub unchanged: usize,
    /// Status written to the policy in charge.
    pub status: Option<ClusterPolicyStatus>,
    /// Driver pools and refusals behind the driver DaemonSets.
    pub driver: DriverPlan,
    /// Status written to each NVIDIADriver, by name.
    pub nvidia_drivers: BTreeMap<String, NvidiaDriverStatus>,
    /// Status written to each MigConfig, by name.
    pub mig_configs: BTreeMap<String, MigConfigStatus>,
}

impl PassReport {
    /// Whether the pass changed objects or labels.
    pub fn changed(&self) -> bool {
        !self.applied.is_empty() || !self.deleted.is_empty() || !self.labelled.is_empty()
    }
}

/// A status with conditions, whose times carry over between passes.
pub trait WithConditions: Clone + PartialEq {
    /// The conditions.
    fn conditions(&self) -> &[Condition];
    /// The conditions, to set their times.
    fn conditions_mut(&mut self) -> &mut [Condition];
}

impl WithConditions for NvidiaDriverStatus {
    fn conditions(&self) -> &[Condition] {
        &self.conditions
    }
    fn conditions_mut(&mut self) -> &mut [Condition] {
        &mut self.conditions
    }
}

impl WithConditions for MigConfigStatus {
    fn conditions(&self) -> &[Condition] {
        &self.conditions
    }
    fn conditions_mut(&mut self) -> &mut [Condition] {
        &mut self.conditions
    }
}

/// `wanted` with the condition times of `current` carried over (`now` for
/// changed ones), and whether it differs from `current`.
fn with_condition_times<S: WithConditions>(
    wanted: &S,
    current: Option<&S>,
    now: &str,
) -> (S, bool) {
    let mut new = wanted.clone();
    carry_times(new.conditions_mut(), current.map(|c| c.conditions()), now);
    let changed = current != Some(&new);
    (new, changed)
}

/// Source of timestamps for condition transition times (RFC 3339).
pub type Clock = Box<dyn Fn() -> String + Send + Sync>;

/// The operator over a cluster.
pub struct Operator<C> {
    cluster: C,
    options: Options,
    clock: Clock,
}

/// The wall clock, as RFC 3339.
pub fn system_clock() -> Clock {
    Box::new(|| k8s_openapi::jiff::Timestamp::now().to_string())
}

impl<C: Cluster> Operator<C> {
    /// An operator with default options (namespace `gpu-operator`) and the
    /// wall clock.
    pub fn new(cluster: C) -> Operator<C> {
        Operator {
            cluster,
            options: Options::default(),
            clock: system_clock(),
        }
    }

    /// Replaces the options.
    pub fn with_options(mut self, options: Options) -> Self {
        self.options = options;
        self
    }

    /// Replaces the clock (deterministic output in tests and the demo).
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// The cluster.
    pub fn cluster(&self) -> &C {
        &self.cluster
    }

    /// Runs one reconcile pass.
    pub async fn reconcile_once(&self) -> Result<PassReport, OperatorError> {
        let mut report = PassReport::default();
        let policies = self
            .cluster
            .list_cluster_policies()
            .await
            .map_err(during("listing ClusterPolicies"))?;
        let Some(active) = active_policy(&policies).cloned() else {
            return Ok(report);
        };
        let active_name = active.metadata.name.clone().unwrap_or_default();
        for p in &policies {
            let name = p.metadata.name.clone().unwrap_or_default();
            // A deleted policy is on its way out: no status to keep.
            if name == active_name || is_deleting(p) {
                continue;
            }
            let mut st = ignored_status(p, &active_name);
            carry_condition_times(&mut st, p.status.as_ref(), &(self.clock)());
            let current = p.status.as_ref().map(|s| ClusterPolicyStatus {
                driver_upgrade: None,
                ..s.clone()
            });
            if current.as_ref() != Some(&st) {
                self.cluster
                    .update_policy_status(&name, &st)
                    .await
                    .map_err(during(format!("marking ClusterPolicy {name} ignored")))?;
            }
            report.ignored.push(name);
        }
        report.policy = Some(active_name.clone());

        let nodes = self
            .cluster
            .list_nodes()
            .await
            .map_err(during("listing nodes"))?;
        let owned = self
            .cluster
            .list_owned()
            .await
            .map_err(during("listing owned objects"))?;
        let drivers = self
            .cluster
            .list_nvidia_drivers()
            .await
            .map_err(during("listing NVIDIADrivers"))?;
        let mig_configs = self
            .cluster
            .list_mig_configs()
            .await
            .map_err(during("listing MigConfigs"))?;
        let drifted = self.cluster.drifted(&owned);
        let related = desired::Related {
            nvidia_drivers: &drivers,
            mig_configs: &mig_configs,
            drifted: Some(&drifted),
        };
        let want = desired::desired_state_with(&active, &nodes, &owned, &related, &self.options);

        // Labels and objects are written at once: a DaemonSet starts pods on
        // each node as its labels land, instead of after the last of a large
        // fleet's patches.
        futures::try_join!(
            self.patch_nodes(&want.node_labels, &want.node_annotations),
            self.apply_objects(&want.apply)
        )?;
        report.labelled = want.node_labels.clone();
        report.applied = want.apply.iter().map(|o| o.key()).collect();
        for key in &want.delete {
            self.cluster
                .delete(key)
                .await
                .map_err(during(format!("deleting {key}")))?;
            report.deleted.push(key.clone());
        }

        let mut status = want.status.clone();
        carry_condition_times(&mut status, active.status.as_ref(), &(self.clock)());
        // `driverUpgrade` belongs to the upgrade controller: not compared here.
        let current = active.status.as_ref().map(|s| ClusterPolicyStatus {
            driver_upgrade: None,
            ..s.clone()
        });
        if current.as_ref() != Some(&status) {
            self.cluster
                .update_policy_status(&active_name, &status)
                .await
                .map_err(during(format!(
                    "updating the status of ClusterPolicy {active_name}"
                )))?;
        }
        let now = (self.clock)();
        for d in &drivers {
            let Some(wanted) = want.nvidia_driver_status.get(d.name()) else {
                continue;
            };
            let name = d.name();
            let (new, changed) = with_condition_times(wanted, d.status.as_ref(), &now);
            if changed {
                self.cluster
                    .update_nvidia_driver_status(name, &new)
                    .await
                    .map_err(during(format!(
                        "updating the status of NVIDIADriver {name}"
                    )))?;
            }
            report.nvidia_drivers.insert(name.to_string(), new);
        }
        for m in &mig_configs {
            let Some(wanted) = want.mig_config_status.get(m.name()) else {
                continue;
            };
            let name = m.name();
            // `status.demand` belongs to the demand controller: not compared
            // (nor written: the pass leaves it out of its apply).
            let current = m.status.as_ref().map(|s| MigConfigStatus {
                demand: None,
                ..s.clone()
            });
            let (new, changed) = with_condition_times(wanted, current.as_ref(), &now);
            if changed {
                self.cluster
                    .update_mig_config_status(name, &new)
                    .await
                    .map_err(during(format!("updating the status of MigConfig {name}")))?;
            }
            report.mig_configs.insert(name.to_string(), new);
        }
        report.status = Some(status);
        report.unchanged = want.unchanged;
        report.driver = want.driver;
        Ok(report)
    }

    /// Patches node labels and annotations, one write per node, a bounded
    /// number in flight: the first pass over a large fleet stays short
    /// without a request storm.
    pub(crate) async fn patch_nodes(
        &self,
        labels: &BTreeMap<String, LabelPatch>,
        annotations: &BTreeMap<String, LabelPatch>,
    ) -> Result<(), OperatorError> {
        let none = LabelPatch::new();
        let mut nodes: Vec<&String> = labels.keys().chain(annotations.keys()).collect();
        nodes.sort_unstable();
        nodes.dedup();
        // Futures are built a batch at a time (a thousand at once were a
        // noticeable share of the operator's memory), in a loop rather than
        // a closure, which keeps the pass Send.
        for batch in nodes.chunks(NODE_PATCH_BATCH) {
            let mut patches = Vec::with_capacity(batch.len());
            for &node in batch {
                let labelled = during(format!("patching the labels of node {node}"));
                let cluster = &self.cluster;
                let label_patch = labels.get(node).unwrap_or(&none);
                let annotation_patch = annotations.get(node).unwrap_or(&none);
                patches.push(async move {
                    // The updated node is dropped at once: holding every
                    // response (managed fields and all) was the pass's peak.
                    cluster
                        .patch_node(node, label_patch, annotation_patch)
                        .await
                        .map(drop)
                        .map_err(labelled)
                });
            }
            futures::stream::iter(patches)
                .buffer_unordered(NODE_PATCHES_IN_FLIGHT)
                .try_collect::<Vec<_>>()
                .await?;
        }
        Ok(())
    }

    /// Applies objects stage by stage ([`Object::apply_stage`]), the objects
    /// of one stage at once.
    async fn apply_objects(&self, objects: &[Object]) -> Result<(), OperatorError> {
        let mut stages: Vec<u8> = objects.iter().map(Object::apply_stage).collect();
        stages.sort_unstable();
        stages.dedup();
        for stage in stages {
            let mut applies = Vec::new();
            for obj in objects.iter().filter(|o| o.apply_stage() == stage) {
                let applied = during(format!("applying {}", obj.key()));
                let cluster = &self.cluster;
                applies.push(
                    async move { cluster.apply(obj.clone()).await.map(drop).map_err(applied) },
                );
            }
            futures::stream::iter(applies)
                .buffer_unordered(OBJECT_APPLIES_IN_FLIGHT)
                .try_collect::<Vec<_>>()
                .await?;
        }
        Ok(())
    }

    /// Runs passes until one changes nothing (at most `max_passes`); returns
    /// every pass's report.
    pub async fn converge(&self, max_passes: usize) -> Result<Vec<PassReport>, OperatorError> {
        let mut reports = Vec::new();
        for _ in 0..max_passes.max(1) {
            let r = self.reconcile_once().await?;
            let changed = r.changed();
            reports.push(r);
            if !changed {
                return Ok(reports);
            }
        }
        Err(OperatorError::NotConverged {
            passes: reports.len(),
        })
    }

    /// Reconciles once, then again after every trigger (node events, timer
    /// ticks, ...) until the trigger stream ends. Pass errors are returned to
    /// `on_error` and do not stop the loop.
    pub async fn run<S, F>(&self, triggers: S, mut on_report: F)
    where
        S: Stream<Item = ()> + Unpin,
        F: FnMut(Result<PassReport, OperatorError>),
    {
        on_report(
            self.converge(8)
                .await
                .map(|mut r| r.pop().unwrap_or_default()),
        );
        let mut triggers = triggers;
        while triggers.next().await.is_some() {
            on_report(
                self.converge(8)
                    .await
                    .map(|mut r| r.pop().unwrap_or_default()),
            );
        }
    }
}
