//! The operator logic ([`crate::operator::Operator`]) as a controller [`Pass`]
//! over [`KubeCluster`], plus what only a real cluster needs: a finalizer, on
//! the ClusterPolicy in charge only, so that deleting the last policy also
//! removes the node labels the operator added (deleting another one changes
//! nothing; deleting the one in charge while another lives hands the stack
//! over: [`crate::operator::desired::PolicyDuty`]), and Events for decisions
//! (published when a condition appears, not on every pass while it holds, and
//! again if it clears and comes back).
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpu_stack_core::operator::components::Component;
use gpu_stack_core::operator::labels::{
    DEPLOY_OPERANDS, DEPLOY_PREFIX, DRIVER_UPGRADE_ENABLED, GPU_PRESENT, LabelPatch,
    MIG_MANAGER_OFF, NodeFacts, WORKLOAD_CONFIG, Workload, node_workload, paused_operands,
};
use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{Patch, PatchParams};
use kube::{Api, Resource, ResourceExt};

use super::events::{Announced, Decision, Severity};
use super::operand_pods;
use super::watches::{CacheError, Caches, policies_in};
use super::{Pass, PassReport};
use crate::operator::cluster::kube_cluster::KubeCluster;
use crate::operator::cluster::{Cluster, ClusterError, Object};
use crate::operator::clusterpolicy::ClusterPolicy;
use crate::operator::clusterpolicy::status::state;
use crate::operator::desired::{Options, PolicyDuty, gpu_node_census, policy_duty};
use crate::operator::metrics::ReconciliationStatus;
use crate::operator::{Operator, OperatorError};

/// Finalizer on the ClusterPolicy in charge: node label cleanup runs before
/// the last policy goes.
pub const FINALIZER: &str = "nvidia.com/gpu-stack-cleanup";

/// Requeue delay while operands are not ready (NVIDIA's operator uses 5 s).
pub const NOT_READY_REQUEUE: Duration = Duration::from_secs(5);

/// Errors of a pass over a real cluster.
#[derive(Debug, thiserror::Error)]
pub enum KubePassError {
    /// The operator logic failed.
    #[error(transparent)]
    Operator(#[from] OperatorError),
    /// Cleanup of a deleted policy failed.
    #[error("cleanup of deleted ClusterPolicy {policy} failed while {during}: {source}")]
    Cleanup {
        /// The policy.
        policy: String,
        /// What was being done.
        during: String,
        /// The cluster error.
        #[source]
        source: ClusterError,
    },
    /// The watch caches are not filled yet.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// Adding or removing the finalizer failed.
    #[error("cannot update finalizers of ClusterPolicy {policy}: {source}")]
    Finalizer {
        /// The policy.
        policy: String,
        /// Underlying error.
        #[source]
        source: kube::Error,
    },
}

/// The operator pass over a live cluster.
pub struct OperatorPass {
    operator: Operator<KubeCluster>,
    caches: Caches,
    published: Mutex<Announced>,
    /// Operand pods, read only while the policy is not ready.
    pods: kube::Api<k8s_openapi::api::core::v1::Pod>,
}

impl OperatorPass {
    /// Builds the pass for operands in `namespace`.
    pub fn new(client: kube::Client, caches: Caches, namespace: &str) -> Self {
        let pods = kube::Api::namespaced(client.clone(), namespace);
        let cluster = KubeCluster::new(client, namespace, caches.clone());
        let operator = Operator::new(cluster).with_options(Options {
            namespace: namespace.to_string(),
        });
        Self {
            operator,
            caches,
            published: Mutex::new(Announced::new()),
            pods,
        }
    }

    fn cluster(&self) -> &KubeCluster {
        self.operator.cluster()
    }

    /// Warnings for operand images the nodes cannot pull (one bounded read
    /// of Pending operand pods; a failed read only loses the warning).
    async fn image_problems(&self, policy: &ClusterPolicy) -> Vec<(ObjectReference, Decision)> {
        let params = kube::api::ListParams::default()
            .labels(operand_pods::OPERAND_SELECTOR)
            .fields("status.phase=Pending")
            .limit(100);
        let pods = match self.pods.list(&params).await {
            Ok(list) => list.items,
            Err(err) => {
                tracing::debug!(%err, "cannot list pending operand pods");
                return Vec::new();
            }
        };
        let policy_ref = policy.object_ref(&());
        operand_pods::image_problems(&pods)
            .into_iter()
            .map(|p| {
                (
                    policy_ref.clone(),
                    Decision {
                        severity: Severity::Warning,
                        reason: "OperandImagePullFailed".into(),
                        note: p.note(),
                        action: "Pull".into(),
                    },
                )
            })
            .collect()
    }

    async fn set_finalizers(
        &self,
        policy: &ClusterPolicy,
        finalizers: Vec<String>,
    ) -> Result<(), KubePassError> {
        let api: Api<ClusterPolicy> = Api::all(self.cluster().client().clone());
        // The resourceVersion makes this fail rather than clobber a concurrent change.
        let body = serde_json::json!({
            "metadata": {
                "finalizers": finalizers,
                "resourceVersion": policy.resource_version(),
            }
        });
        api.patch_metadata(
            &policy.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&body),
        )
        .await
        .map(|_| ())
        .or_else(|source| match source {
            // Already gone (a second pass over a deleted policy): nothing to update.
            kube::Error::Api(ref status) if status.code == 404 => Ok(()),
            source => Err(source),
        })
        .map_err(|source| KubePassError::Finalizer {
            policy: policy.name_any(),
            source,
        })
    }

    /// Removes what the operator added: its node labels (leaving values
    /// other agents or people set: `false`, and the operands switch) and every
    /// owned object except the Namespace; then drops the finalizer.
    async fn cleanup(&self, policy: &ClusterPolicy) -> Result<PassReport, KubePassError> {
        let name = policy.name_any();
        let fail = |during: String| {
            let policy = name.clone();
            move |source| KubePassError::Cleanup {
                policy,
                during,
                source,
            }
        };
        // NVIDIA's driver manager, if anything still runs it, evicts by
        // itself again once the annotation is gone.
        let mut patches: BTreeMap<String, LabelPatch> = BTreeMap::new();
        let mut annotations: BTreeMap<String, LabelPatch> = BTreeMap::new();
        for node in self.caches.nodes.state() {
            let patch = cleanup_patch(node.labels());
            if !patch.is_empty() {
                patches.insert(node.name_any(), patch);
            }
            if node.annotations().contains_key(DRIVER_UPGRADE_ENABLED) {
                let removal = [(DRIVER_UPGRADE_ENABLED.to_string(), None)].into();
                annotations.insert(node.name_any(), removal);
            }
        }
        // The same bounded, batched writes as a pass's labels.
        self.operator
            .patch_nodes(&patches, &annotations)
            .await
            .map_err(|e| match e {
                OperatorError::Cluster { during, source } => KubePassError::Cleanup {
                    policy: name.clone(),
                    during,
                    source,
                },
                other => KubePassError::Operator(other),
            })?;
        let mut owned = self
            .cluster()
            .list_owned()
            .await
            .map_err(fail("listing owned objects".into()))?;
        owned.sort_by_key(Object::delete_stage);
        for obj in owned {
            if obj.kind() == "Namespace" {
                continue;
            }
            let key = obj.key();
            self.cluster()
                .delete(&key)
                .await
                .map_err(fail(format!("deleting {key}")))?;
        }
        self.set_finalizers(policy, without_finalizer(policy.finalizers()))
            .await?;
        tracing::info!(policy = %name, "cleaned up after deleted ClusterPolicy");
        Ok(PassReport::unavailable())
    }

    /// Keeps only decisions the previous pass did not already publish (by
    /// object, reason, note); those no longer reported are forgotten.
    fn fresh(&self, all: Vec<(ObjectReference, Decision)>) -> Vec<(ObjectReference, Decision)> {
        self.published
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .fresh(all)
    }

    /// Forgets every announced decision (the policy is going away, so a new
    /// one starts afresh).
    fn forget_announced(&self) {
        self.published
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clear();
    }
}

/// Whether the policy carries the operator's finalizer.
pub fn has_finalizer(policy: &ClusterPolicy) -> bool {
    policy.finalizers().iter().any(|f| f == FINALIZER)
}

/// A policy's finalizers without the operator's.
pub fn without_finalizer(finalizers: &[String]) -> Vec<String> {
    finalizers
        .iter()
        .filter(|f| f.as_str() != FINALIZER)
        .cloned()
        .collect()
}

/// The label patch that undoes the operator's node labels: the `true`
/// values it writes, and the MIG manager's `false` it wrote for the DRA
/// plugin (marked with [`MIG_MANAGER_OFF`]) with its mark. Every other
/// value is another agent's or a person's and stays: a `false`, the
/// `paused-for-*` values the MIG manager and the driver upgrade write, a
/// host driver's `pre-installed`.
pub fn cleanup_patch(labels: &std::collections::BTreeMap<String, String>) -> LabelPatch {
    let marked_off = labels.contains_key(MIG_MANAGER_OFF);
    let mig_manager = Component::MigManager.deploy_label();
    labels
        .iter()
        .filter(|(k, v)| {
            k.as_str() == MIG_MANAGER_OFF
                || ((k.as_str() == GPU_PRESENT
                    || (k.starts_with(DEPLOY_PREFIX) && k.as_str() != DEPLOY_OPERANDS))
                    && (v.as_str() == "true"
                        || (marked_off && **k == mig_manager && v.as_str() == "false")))
        })
        .map(|(k, _)| (k.clone(), None))
        .collect()
}

/// Decisions a person should see, derived from a pass.
fn decisions(
    policy: &ClusterPolicy,
    report: &crate::operator::PassReport,
) -> Vec<(ObjectReference, Decision)> {
    let mut out = Vec::new();
    let policy_ref = policy.object_ref(&());
    if !report.ignored.is_empty() {
        out.push((
            policy_ref.clone(),
            Decision {
                severity: Severity::Warning,
                reason: "DuplicatePolicy".into(),
                note: format!(
                    "this ClusterPolicy is in charge; {} ignored (only one policy runs the \
                     stack): delete the ones you do not want, which changes nothing here",
                    report.ignored.join(", ")
                ),
                action: "Reconcile".into(),
            },
        ));
    }
    if let Some(status) = &report.status {
        for c in &status.conditions {
            if c.type_ == "Error" && c.status == "True" {
                out.push((
                    policy_ref.clone(),
                    Decision {
                        severity: Severity::Warning,
                        reason: c.reason.clone(),
                        note: c.message.clone(),
                        action: "Reconcile".into(),
                    },
                ));
            }
        }
        if !status.unsupported_fields.is_empty() {
            out.push((
                policy_ref.clone(),
                Decision {
                    severity: Severity::Warning,
                    reason: "UnsupportedFields".into(),
                    note: format!(
                        "these fields are not acted on by gpu-stack: {}",
                        status.unsupported_fields.join(", ")
                    ),
                    action: "Reconcile".into(),
                },
            ));
        }
        for refused in &status.refused_nodes {
            out.push((
                policy_ref.clone(),
                Decision {
                    severity: Severity::Warning,
                    reason: "DriverRefused".into(),
                    note: format!("node {}: {}", refused.node, refused.reason),
                    action: "SelectDriver".into(),
                },
            ));
        }
    }
    out
}

fn status_of(report: &crate::operator::PassReport) -> ReconciliationStatus {
    match report.status.as_ref().map(|s| s.state.as_str()) {
        Some(state::READY) => ReconciliationStatus::Success,
        Some(_) => ReconciliationStatus::NotReady,
        None => ReconciliationStatus::ClusterPolicyUnavailable,
    }
}

impl Pass for OperatorPass {
    type Error = KubePassError;

    async fn run(&self, policy: Arc<ClusterPolicy>) -> Result<Option<PassReport>, KubePassError> {
        self.caches.wait_until_synced().await?;
        let all = policies_in(&self.caches.policies);
        match policy_duty(&policy, &all) {
            PolicyDuty::Reconcile => self.reconcile(&policy, Vec::new()).await.map(Some),
            PolicyDuty::StandBy => {
                // Only the policy in charge holds the finalizer.
                if has_finalizer(&policy) {
                    self.set_finalizers(&policy, without_finalizer(policy.finalizers()))
                        .await?;
                }
                Ok(None)
            }
            PolicyDuty::TearDown => {
                self.forget_announced();
                if has_finalizer(&policy) {
                    return self.cleanup(&policy).await.map(Some);
                }
                Ok(Some(PassReport::unavailable()))
            }
            PolicyDuty::HandOver { successor } => {
                let Some(next) = all
                    .iter()
                    .find(|p| p.metadata.name.as_deref() == Some(successor.as_str()))
                else {
                    return Ok(None);
                };
                let handed_over = (
                    next.object_ref(&()),
                    Decision {
                        severity: Severity::Normal,
                        reason: "HandedOver".into(),
                        note: format!(
                            "ClusterPolicy {} was deleted; {successor} is now in charge of the \
                             stack, which keeps running",
                            policy.name_any()
                        ),
                        action: "Reconcile".into(),
                    },
                );
                // The successor's pass re-owns every object before the
                // deleted policy goes, so the garbage collector keeps them.
                let report = self.reconcile(next, vec![handed_over]).await?;
                if has_finalizer(&policy) {
                    self.set_finalizers(&policy, without_finalizer(policy.finalizers()))
                        .await?;
                }
                tracing::info!(policy = %policy.name_any(), %successor, "handed over");
                Ok(Some(report))
            }
        }
    }
}

impl OperatorPass {
    /// One pass for the policy in charge, holding its finalizer; `decided`
    /// holds decisions already made for the Events.
    async fn reconcile(
        &self,
        policy: &ClusterPolicy,
        mut decided: Vec<(ObjectReference, Decision)>,
    ) -> Result<PassReport, KubePassError> {
        if !has_finalizer(policy) {
            let mut all = policy.finalizers().to_vec();
            all.push(FINALIZER.to_string());
            self.set_finalizers(policy, all).await?;
        }
        self.cluster().set_owner(policy);
        let report = self.operator.reconcile_once().await?;
        let nodes = self.caches.nodes.state();
        let (gpu_nodes, has_nfd) = gpu_node_census(&nodes);
        let status = status_of(&report);
        decided.extend(decisions(policy, &report));
        if status == ReconciliationStatus::NotReady {
            decided.extend(self.image_problems(policy).await);
        }
        // Nodes whose operands another agent paused, or that serve virtual
        // machines: say so once.
        let label_policy = policy.spec.label_policy();
        for n in nodes.iter() {
            let node_ref = || ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(n.name_any()),
                uid: n.uid(),
                ..ObjectReference::default()
            };
            for (k, v) in paused_operands(n.labels()) {
                decided.push((
                    node_ref(),
                    Decision {
                        severity: Severity::Normal,
                        reason: "OperandPaused".into(),
                        note: format!("{k}={v}: operand left alone on this node"),
                        action: "Reconcile".into(),
                    },
                ));
            }
            let workload = node_workload(n.labels(), &label_policy);
            if workload != Workload::Container && NodeFacts::from_labels(n.labels()).gpu {
                decided.push((
                    node_ref(),
                    Decision {
                        severity: Severity::Warning,
                        reason: "VmWorkload".into(),
                        note: format!(
                            "workload {}: gpu-stack runs no operands for virtual machines (VFIO \
                         manager, sandbox device plugin, vGPU manager), so this node gets none; \
                         label it {WORKLOAD_CONFIG}=container for the container operands",
                            workload.as_str()
                        ),
                        action: "Reconcile".into(),
                    },
                ));
            }
        }
        Ok(PassReport {
            status,
            gpu_nodes: i64::try_from(gpu_nodes).unwrap_or(i64::MAX),
            has_nfd_labels: has_nfd,
            applied: (report.applied.len() + report.deleted.len() + report.labelled.len()) as u64,
            unchanged: report.unchanged as u64,
            decisions: self.fresh(decided),
            requeue_after: match status {
                ReconciliationStatus::NotReady => Some(NOT_READY_REQUEUE),
                _ => None,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn cleanup_removes_only_the_values_the_operator_writes() {
        let labels: BTreeMap<String, String> = [
            (GPU_PRESENT, "true"),
            ("nvidia.com/gpu.deploy.device-plugin", "true"),
            ("nvidia.com/gpu.deploy.driver", "true"),
            ("nvidia.com/gpu.deploy.dcgm", "paused-for-driver-upgrade"),
            (
                "nvidia.com/gpu.deploy.gpu-feature-discovery",
                "paused-for-mig-change",
            ),
            ("nvidia.com/gpu.deploy.container-toolkit", "pre-installed"),
            ("nvidia.com/gpu.deploy.dcgm-exporter", "false"),
            (DEPLOY_OPERANDS, "true"),
            ("feature.node.kubernetes.io/pci-10de.present", "true"),
            ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let patch = cleanup_patch(&labels);
        let removed: Vec<&str> = patch.keys().map(String::as_str).collect();
        assert_eq!(
            removed,
            vec![
                "nvidia.com/gpu.deploy.device-plugin",
                "nvidia.com/gpu.deploy.driver",
                GPU_PRESENT,
            ]
        );
        assert!(patch.values().all(Option::is_none));
    }

    #[test]
    fn cleanup_removes_the_mig_manager_false_written_for_the_dra_plugin() {
        let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let ours = labels(&[
            ("nvidia.com/gpu.deploy.mig-manager", "false"),
            ("nvidia.com/gpu.deploy.dra-driver", "true"),
            (MIG_MANAGER_OFF, "dra-driver"),
        ]);
        let removed: Vec<String> = cleanup_patch(&ours).into_keys().collect();
        assert_eq!(
            removed,
            [
                "nvidia.com/gpu-stack.mig-manager-off",
                "nvidia.com/gpu.deploy.dra-driver",
                "nvidia.com/gpu.deploy.mig-manager",
            ]
        );
        // A person's `false`, unmarked, stays.
        let theirs = labels(&[("nvidia.com/gpu.deploy.mig-manager", "false")]);
        assert!(cleanup_patch(&theirs).is_empty());
    }
}
