//! What `helm uninstall` needs before the chart's objects go (the chart's
//! pre-delete hook runs `gpu-operator --uninstall`): the ClusterPolicies are
//! deleted while the operator still runs, so its finalizer removes the node
//! labels it added and garbage collection the operands; once the operand
//! pods are gone, the node-discovery agent is stopped and the labels it and
//! GFD wrote are removed. The operator is stopped (its Deployment scaled to
//! zero) before the last sweep of its labels: an operator that was slow
//! rather than gone could otherwise finish a pass begun before the deletion
//! and label the nodes again after its cleanup. The MIG layout and its
//! `nvidia.com/mig.config` labels stay: the GPUs keep their layout.
//! Deleting the chart's objects first would kill the operator with the
//! finalizer still pending, leaving every policy stuck in deletion.
use std::time::Duration;

use gpu_stack_core::nodediscovery::{OWNED_ANNOTATION, plan_node_patch};
use gpu_stack_core::operator::labels::Labels;
use gpu_stack_core::operator::upgrade::abandon::wind_down;
use gpu_stack_core::operator::upgrade::state::UpgradeMarks;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use tracing::{info, warn};

use crate::deviceplugin::labels::label_changes;
use crate::migmanager::NodePatch;
use crate::migmanager::kube_node::merge_patch_body;
use crate::operator::clusterpolicy::ClusterPolicy;
use crate::operator::controller::operator_pass::{cleanup_patch, without_finalizer};
use crate::operator::upgrade::apply::wind_down_patch;

/// Errors of the uninstall steps.
#[derive(Debug, thiserror::Error)]
pub enum UninstallError {
    /// An API call failed.
    #[error(
        "{what}: {source}; check that the API server is reachable from the uninstall Job and \
         that its role (the chart's uninstall-hook.yaml) allows this"
    )]
    Api {
        /// The step.
        what: String,
        /// Cause.
        source: kube::Error,
    },
    /// A step did not finish in time.
    #[error("{what} did not finish within {secs}s; {hint}")]
    Timeout {
        /// The step.
        what: &'static str,
        /// The bound.
        secs: u64,
        /// What to look at.
        hint: &'static str,
    },
}

fn api(what: impl Into<String>) -> impl FnOnce(kube::Error) -> UninstallError {
    let what = what.into();
    move |source| UninstallError::Api { what, source }
}

/// What to remove besides the policies.
#[derive(Debug, Clone)]
pub struct UninstallOptions {
    /// Namespace of the chart (and of the node-discovery DaemonSet).
    pub namespace: String,
    /// Name of the chart's node-discovery DaemonSet, if it is installed.
    pub node_discovery: Option<String>,
    /// Name of the operator's Deployment (in `namespace`), stopped before
    /// the last sweep of its labels.
    pub operator_deployment: Option<String>,
    /// Bound of each wait.
    pub timeout: Duration,
    /// How long the operator gets to clean up after the policies before this
    /// does it in its place.
    pub operator_grace: Duration,
}

async fn wait_until<F, Fut>(
    what: &'static str,
    hint: &'static str,
    timeout: Duration,
    mut done: F,
) -> Result<(), UninstallError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool, UninstallError>>,
{
    // An API error here is taken as "not yet" (a dropped connection, an API
    // server busy with the deletions): the bound decides, and its error says
    // what was last seen.
    let mut last_error: Option<UninstallError> = None;
    let wait = async {
        loop {
            match done().await {
                Ok(true) => return,
                Ok(false) => {}
                Err(e) => {
                    warn!(error = %e, "{what}: retrying");
                    last_error = Some(e);
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };
    match tokio::time::timeout(timeout, wait).await {
        Ok(()) => Ok(()),
        Err(_) => Err(match last_error {
            Some(e) => e,
            None => UninstallError::Timeout {
                what,
                secs: timeout.as_secs(),
                hint,
            },
        }),
    }
}

/// Runs every step; returns how many node labels were removed.
pub async fn uninstall(
    client: Client,
    options: &UninstallOptions,
) -> Result<usize, UninstallError> {
    let policies: Api<ClusterPolicy> = Api::all(client.clone());
    for policy in policies
        .list_metadata(&ListParams::default())
        .await
        .map_err(api("listing ClusterPolicies"))?
    {
        let name = policy.name_any();
        info!(policy = %name, "deleting ClusterPolicy");
        match policies.delete(&name, &DeleteParams::background()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(api(format!("deleting ClusterPolicy {name}"))(e)),
        }
    }
    let policies_gone = || async {
        Ok(policies
            .list_metadata(&ListParams::default())
            .await
            .map_err(api("listing ClusterPolicies"))?
            .items
            .is_empty())
    };
    let operator_done = wait_until(
        "the operator's cleanup",
        "the operator did not remove the ClusterPolicies",
        options.operator_grace,
        policies_gone,
    )
    .await;
    if operator_done.is_err() {
        // The operator is not running (a failed install, a crash loop): do
        // its cleanup in its place, or the policies stay stuck for good.
        warn!(
            secs = options.operator_grace.as_secs(),
            "the operator did not remove the ClusterPolicies; removing its node labels and \
             finalizer in its place"
        );
        cleanup_in_place_of_operator(&client, &policies).await?;
    }
    wait_until(
        "removing every ClusterPolicy",
        "a finalizer other than gpu-stack's holds a ClusterPolicy: see its metadata.finalizers",
        options.timeout,
        policies_gone,
    )
    .await?;
    // GFD writes its labels again until its pod is gone (garbage collection
    // of the operands follows the policy).
    let pods: Api<Pod> = Api::namespaced(client.clone(), &options.namespace);
    wait_until(
        "stopping the operand pods",
        "the operands' DaemonSets are removed by garbage collection once their ClusterPolicy \
         is gone: check the controller-manager and the operands' nodes",
        options.timeout,
        || async {
            Ok(pods
                .list_metadata(&ListParams::default().labels(OPERAND_SELECTOR))
                .await
                .map_err(api("listing operand pods"))?
                .items
                .is_empty())
        },
    )
    .await?;
    if let Some(deployment) = &options.operator_deployment {
        stop_operator(&client, &options.namespace, deployment, options.timeout).await?;
        remove_operator_labels(&client).await?;
    }

    let Some(daemonset) = &options.node_discovery else {
        return remove_node_labels(&client).await;
    };
    let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), &options.namespace);
    // Stopped first: a running agent would write its labels again.
    let selector = match daemonsets.get_opt(daemonset).await.map_err(api(format!(
        "reading DaemonSet {}/{daemonset}",
        options.namespace
    )))? {
        Some(ds) => {
            let selector = ds
                .spec
                .selector
                .match_labels
                .unwrap_or_default()
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(",");
            info!(daemonset = %daemonset, "stopping node discovery");
            match daemonsets
                .delete(daemonset, &DeleteParams::foreground())
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(api(format!("deleting DaemonSet {daemonset}"))(e)),
            }
            Some(selector)
        }
        None => None,
    };
    if let Some(selector) = selector.filter(|s| !s.is_empty()) {
        wait_until(
            "stopping the node-discovery pods",
            "the pods of the node-discovery DaemonSet did not terminate: check their nodes",
            options.timeout,
            || async {
                Ok(pods
                    .list_metadata(&ListParams::default().labels(&selector))
                    .await
                    .map_err(api("listing node-discovery pods"))?
                    .items
                    .is_empty())
            },
        )
        .await?;
    }
    remove_node_labels(&client).await
}

/// Scales the operator's Deployment to zero and waits until its pods are
/// gone (a Deployment already gone is stopped).
async fn stop_operator(
    client: &Client,
    namespace: &str,
    name: &str,
    timeout: Duration,
) -> Result<(), UninstallError> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), namespace);
    let scaled = deployments
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "spec": { "replicas": 0 } })),
        )
        .await;
    let deployment = match scaled {
        Ok(d) => d,
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(()),
        Err(e) => {
            return Err(api(format!(
                "scaling the operator's Deployment {namespace}/{name} to zero"
            ))(e));
        }
    };
    info!(deployment = %name, "stopping the operator");
    let selector = deployment
        .spec
        .selector
        .match_labels
        .unwrap_or_default()
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    if selector.is_empty() {
        return Ok(());
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    wait_until(
        "stopping the operator",
        "the operator's pods did not terminate: check their node",
        timeout,
        || async {
            Ok(pods
                .list_metadata(&ListParams::default().labels(&selector))
                .await
                .map_err(api("listing the operator's pods"))?
                .items
                .is_empty())
        },
    )
    .await
}

/// Removes the labels the operator added ([`cleanup_patch`]) from every
/// node, and winds down a driver upgrade left midway (a node the flow
/// cordoned is uncordoned: see
/// [`gpu_stack_core::operator::upgrade::abandon`]); returns how many labels
/// went.
async fn remove_operator_labels(client: &Client) -> Result<usize, UninstallError> {
    let nodes: Api<Node> = Api::all(client.clone());
    let mut removed = 0;
    for node in nodes
        .list_metadata(&ListParams::default())
        .await
        .map_err(api("listing nodes"))?
    {
        let name = node.name_any();
        let labels: Labels = node.labels().clone().into_iter().collect();
        let annotations: Labels = node.annotations().clone().into_iter().collect();
        let patch = cleanup_patch(&labels);
        let marks = UpgradeMarks::read(&labels, &annotations).unwrap_or_default();
        // Only a node midway may have been cordoned by the flow: read it whole.
        let unschedulable = marks.state.in_progress()
            && nodes
                .get(&name)
                .await
                .map_err(api(format!("reading node {name}")))?
                .spec
                .and_then(|s| s.unschedulable)
                .unwrap_or(false);
        let wind = wind_down(&marks, unschedulable, &labels, &annotations);
        if patch.is_empty() && wind.is_none() {
            continue;
        }
        removed += patch.len();
        let mut body = match &wind {
            Some(w) => {
                info!(node = %name, uncordoned = w.uncordon, "{}", w.note);
                wind_down_patch(w)
            }
            None => serde_json::json!({ "metadata": { "labels": {} } }),
        };
        if let Some(l) = body
            .pointer_mut("/metadata/labels")
            .and_then(serde_json::Value::as_object_mut)
        {
            l.extend(patch.into_keys().map(|k| (k, serde_json::Value::Null)));
        }
        nodes
            .patch(&name, &PatchParams::default(), &Patch::Merge(&body))
            .await
            .map_err(api(format!(
                "removing the operator's labels from node {name}"
            )))?;
    }
    Ok(removed)
}

/// What the operator's finalizer does, done here: the labels the operator
/// added are removed from every node, then its finalizer from every policy.
async fn cleanup_in_place_of_operator(
    client: &Client,
    policies: &Api<ClusterPolicy>,
) -> Result<(), UninstallError> {
    remove_operator_labels(client).await?;
    for policy in policies
        .list_metadata(&ListParams::default())
        .await
        .map_err(api("listing ClusterPolicies"))?
    {
        let rest = without_finalizer(policy.finalizers());
        if rest.len() == policy.finalizers().len() {
            continue;
        }
        let name = policy.name_any();
        let body = serde_json::json!({ "metadata": { "finalizers": rest } });
        match policies
            .patch_metadata(&name, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => {
                return Err(api(format!(
                    "removing the finalizer of ClusterPolicy {name}"
                ))(e));
            }
        }
    }
    Ok(())
}

/// Every operand pod carries this label (`desired::render`).
const OPERAND_SELECTOR: &str = "app.kubernetes.io/part-of=gpu-stack";

/// The merge patch removing, from one node, the labels GFD computes and
/// those the node-discovery agent wrote (as its ownership annotation records
/// them, the annotation too); labels others wrote stay. `None`: nothing to do.
pub fn node_cleanup_patch(labels: &Labels, annotations: &Labels) -> Option<NodePatch> {
    let mut patch = NodePatch::default();
    if annotations.contains_key(OWNED_ANNOTATION)
        && let Some(discovered) = plan_node_patch(&Labels::new(), labels, annotations)
    {
        patch.labels = discovered.labels;
        patch.annotations = discovered.annotations;
    }
    let gfd = label_changes(labels, &Labels::new());
    patch.labels.remove.extend(gfd.into_keys());
    (!patch.labels.remove.is_empty() || !patch.annotations.is_empty()).then_some(patch)
}

/// Removes what [`node_cleanup_patch`] names from every node; returns how
/// many labels went.
pub async fn remove_node_labels(client: &Client) -> Result<usize, UninstallError> {
    let nodes: Api<Node> = Api::all(client.clone());
    let mut removed = 0;
    for node in nodes
        .list_metadata(&ListParams::default())
        .await
        .map_err(api("listing nodes"))?
    {
        let annotations: Labels = node.annotations().clone().into_iter().collect();
        let labels: Labels = node.labels().clone().into_iter().collect();
        let Some(patch) = node_cleanup_patch(&labels, &annotations) else {
            continue;
        };
        removed += patch.labels.remove.len();
        let body = merge_patch_body(&patch);
        let name = node.name_any();
        nodes
            .patch_metadata(&name, &PatchParams::default(), &Patch::Merge(&body))
            .await
            .map_err(api(format!(
                "removing node-discovery labels from node {name}"
            )))?;
    }
    info!(removed, "removed the labels GFD and node discovery wrote");
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn cleanup_removes_gfd_and_discovered_labels_only() {
        let node = labels(&[
            ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
            ("nvidia.com/cuda.driver.major", "570"),
            ("feature.node.kubernetes.io/pci-10de.present", "true"),
            ("feature.node.kubernetes.io/system-os_release.ID", "debian"),
            ("nvidia.com/mig.config", "all-1g.10gb"),
            ("team", "ml"),
        ]);
        let annotations = labels(&[(OWNED_ANNOTATION, "pci-10de.present")]);
        let patch = node_cleanup_patch(&node, &annotations).expect("a patch");
        let removed: Vec<&str> = patch.labels.remove.iter().map(String::as_str).collect();
        for key in [
            "nvidia.com/gpu.product",
            "nvidia.com/cuda.driver.major",
            "feature.node.kubernetes.io/pci-10de.present",
        ] {
            assert!(removed.contains(&key), "{key} stays: {removed:?}");
        }
        // Written by someone else (not in the annotation), the MIG layout, and
        // a user's label stay.
        for key in [
            "feature.node.kubernetes.io/system-os_release.ID",
            "nvidia.com/mig.config",
            "team",
        ] {
            assert!(!removed.contains(&key), "{key} removed");
        }
        assert_eq!(patch.annotations.get(OWNED_ANNOTATION), Some(&None));
    }

    #[test]
    fn a_clean_node_needs_no_patch() {
        assert!(node_cleanup_patch(&labels(&[("team", "ml")]), &Labels::new()).is_none());
    }
}
