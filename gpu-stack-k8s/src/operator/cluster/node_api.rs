//! The MIG manager's node API over the in-memory cluster, so the manager's
//! real pass ([`crate::migmanager::reconcile`]) runs against the same nodes
//! the operator labels.
//!
//! Label and annotation edits land in one node write, as the kube client's
//! merge patch does. GPU client pods are derived from the cluster's
//! DaemonSets: a pod of app `a` is on node `n` while a DaemonSet whose pod
//! template carries `app=a` fits `n` (its node selector, affinity and
//! tolerations). Pausing a deploy label therefore makes the pod leave at once,
//! as if the kubelet had finished terminating it.
use std::collections::BTreeMap;

use crate::migmanager::{ManagerError, NodeApi, NodePatch, NodeView};

use super::memory::InMemoryCluster;
use super::object::Object;
use super::selector::pod_fits_node;

fn cluster_error(node: &str, e: impl std::fmt::Display) -> ManagerError {
    ManagerError::Cluster {
        node: node.to_string(),
        detail: e.to_string(),
    }
}

impl NodeApi for InMemoryCluster {
    async fn get(&self, node: &str) -> Result<NodeView, ManagerError> {
        let n = self
            .nodes()
            .into_iter()
            .find(|n| n.metadata.name.as_deref() == Some(node))
            .ok_or_else(|| cluster_error(node, format!("Node/{node} not found")))?;
        Ok(NodeView {
            labels: n.metadata.labels.unwrap_or_default(),
            annotations: n.metadata.annotations.unwrap_or_default(),
        })
    }

    async fn patch(&self, node: &str, patch: &NodePatch) -> Result<(), ManagerError> {
        self.update_node(node, |n| {
            let mut labels = n.metadata.labels.take().unwrap_or_default();
            patch.labels.apply_to(&mut labels);
            n.metadata.labels = Some(labels);
            let mut annotations: BTreeMap<String, String> =
                n.metadata.annotations.take().unwrap_or_default();
            for (k, v) in &patch.annotations {
                match v {
                    Some(v) => annotations.insert(k.clone(), v.clone()),
                    None => annotations.remove(k),
                };
            }
            n.metadata.annotations = (!annotations.is_empty()).then_some(annotations);
        })
        .map(|_| ())
        .map_err(|e| cluster_error(node, e))
    }

    async fn pods_on_node(&self, node: &str, apps: &[&str]) -> Result<Vec<String>, ManagerError> {
        let Some(n) = self
            .nodes()
            .into_iter()
            .find(|n| n.metadata.name.as_deref() == Some(node))
        else {
            return Err(cluster_error(node, format!("Node/{node} not found")));
        };
        let mut pods = Vec::new();
        for o in self.objects() {
            let Object::DaemonSet(ds) = &o else { continue };
            let template = &ds.spec.template;
            let app = template
                .metadata
                .as_ref()
                .and_then(|m| m.labels.as_ref())
                .and_then(|l| l.get("app"));
            let Some(app) = app.filter(|a| apps.contains(&a.as_str())) else {
                continue;
            };
            if template.spec.as_ref().is_some_and(|s| pod_fits_node(s, &n)) {
                pods.push(format!("{app}-{node}"));
            }
        }
        pods.sort();
        Ok(pods)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::executor::block_on;
    use gpu_stack_core::migmanager::LabelEdits;
    use k8s_openapi::api::apps::v1::{DaemonSet, DaemonSetSpec};
    use k8s_openapi::api::core::v1::{Node, PodSpec, PodTemplateSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};

    use crate::operator::cluster::Cluster;

    const DP: &str = "nvidia.com/gpu.deploy.device-plugin";

    fn node(name: &str, labels: &[(&str, &str)]) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn daemonset(app: &str, selector: (&str, &str)) -> Object {
        let labels: BTreeMap<String, String> = [("app".to_string(), app.to_string())].into();
        Object::DaemonSet(DaemonSet {
            metadata: ObjectMeta {
                name: Some(app.into()),
                namespace: Some("gpu-operator".into()),
                ..Default::default()
            },
            spec: DaemonSetSpec {
                selector: LabelSelector {
                    match_labels: Some(labels.clone()),
                    ..Default::default()
                },
                template: PodTemplateSpec {
                    metadata: Some(ObjectMeta {
                        labels: Some(labels),
                        ..Default::default()
                    }),
                    spec: Some(PodSpec {
                        node_selector: Some(
                            [(selector.0.to_string(), selector.1.to_string())].into(),
                        ),
                        ..Default::default()
                    }),
                },
                ..Default::default()
            },
            status: None,
        })
    }

    #[test]
    fn patch_sets_and_removes_labels_and_annotations_in_one_write() {
        let c = InMemoryCluster::new();
        c.upsert_node(node("g", &[(DP, "true"), ("old", "x")]));
        let before = c.stats().writes;
        let mut patch = NodePatch {
            labels: LabelEdits {
                set: [(DP.to_string(), "paused-for-mig-change".to_string())].into(),
                remove: vec!["old".into()],
            },
            ..Default::default()
        };
        patch.annotations.insert("a".into(), Some("1".into()));
        block_on(NodeApi::patch(&c, "g", &patch)).unwrap();
        assert_eq!(c.stats().writes, before + 1);
        let view = block_on(NodeApi::get(&c, "g")).unwrap();
        assert_eq!(view.labels[DP], "paused-for-mig-change");
        assert!(!view.labels.contains_key("old"));
        assert_eq!(view.annotations["a"], "1");

        let mut clear = NodePatch::default();
        clear.annotations.insert("a".into(), None);
        block_on(NodeApi::patch(&c, "g", &clear)).unwrap();
        assert!(
            block_on(NodeApi::get(&c, "g"))
                .unwrap()
                .annotations
                .is_empty()
        );
    }

    #[test]
    fn unchanged_patch_writes_nothing_and_missing_node_is_an_error() {
        let c = InMemoryCluster::new();
        c.upsert_node(node("g", &[(DP, "true")]));
        let before = c.stats().writes;
        let mut patch = NodePatch::default();
        patch.labels.set.insert(DP.into(), "true".into());
        block_on(NodeApi::patch(&c, "g", &patch)).unwrap();
        assert_eq!(c.stats().writes, before);
        let err = block_on(NodeApi::patch(&c, "nope", &patch)).unwrap_err();
        assert!(err.to_string().contains("Node/nope"), "{err}");
        assert!(block_on(NodeApi::get(&c, "nope")).is_err());
    }

    #[test]
    fn client_pods_follow_their_daemonset_selector() {
        let c = InMemoryCluster::new();
        c.upsert_node(node("g", &[(DP, "true")]));
        c.upsert_node(node("cpu", &[]));
        block_on(c.apply(daemonset("nvidia-device-plugin-daemonset", (DP, "true")))).unwrap();
        block_on(c.apply(daemonset("other", (DP, "true")))).unwrap();
        let apps = ["nvidia-device-plugin-daemonset"];
        assert_eq!(
            block_on(c.pods_on_node("g", &apps)).unwrap(),
            vec!["nvidia-device-plugin-daemonset-g".to_string()]
        );
        assert!(block_on(c.pods_on_node("cpu", &apps)).unwrap().is_empty());

        // Pausing the deploy label makes the pod leave.
        let mut patch = NodePatch::default();
        patch
            .labels
            .set
            .insert(DP.into(), "paused-for-mig-change".into());
        block_on(NodeApi::patch(&c, "g", &patch)).unwrap();
        assert!(block_on(c.pods_on_node("g", &apps)).unwrap().is_empty());
    }
}
