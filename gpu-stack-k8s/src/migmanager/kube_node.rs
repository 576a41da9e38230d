//! [`NodeApi`] over a real API server, for the manager's own node only.
//!
//! - Reads are metadata-only (`GET` with the `PartialObjectMetadata` accept
//!   header): the manager needs labels and annotations, not the node status.
//! - Writes are one JSON merge patch of `metadata.labels` and
//!   `metadata.annotations` (`null` deletes a key), so no other field and no
//!   key the manager did not name is touched, and nothing else competes with
//!   the manager for field ownership.
//! - GPU client pods are listed across namespaces by field selector
//!   `spec.nodeName=<node>` and label selector `app in (...)`; pods that have
//!   finished (`Succeeded`, `Failed`) no longer hold a GPU and are not counted.
//! - Failures are also published as Events regarding the node, next to the
//!   failure annotation [`reconcile`](super::reconcile) writes.
//!
//! The operator's [`KubeCluster`](crate::operator::cluster::kube_cluster::KubeCluster) is
//! not reused: it needs the controller's cluster-wide node store and patches
//! labels only, while the manager reads one node and patches annotations too.
use gpu_stack_core::mig::Demand;
use gpu_stack_core::migmanager::MigConfigState;
use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod};
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Api, Client};
use serde_json::{Map, Value, json};

use super::{ManagerError, NodeApi, NodePatch, NodeView};

/// The name the manager reports Events and writes under.
pub const MANAGER_NAME: &str = "gpu-mig-manager";

/// Longest Event note the API server accepts (1 kB); longer reasons are cut.
const EVENT_NOTE_MAX: usize = 1024;

/// The manager's view of its node through the Kubernetes API.
#[derive(Clone)]
pub struct KubeNode {
    nodes: Api<Node>,
    pods: Api<Pod>,
    recorder: Recorder,
    local_clients: Option<LocalClients>,
}

/// The `app` names of GPU clients running in this process (the combined
/// node agent's components), current until each has fully stopped.
pub type LocalClients = tokio::sync::watch::Receiver<std::collections::BTreeSet<&'static str>>;

impl KubeNode {
    /// A node API over `client`; `instance` names this replica in Events
    /// (the pod name, when known).
    pub fn new(client: Client, instance: Option<String>) -> Self {
        let reporter = Reporter {
            controller: MANAGER_NAME.to_string(),
            instance,
        };
        Self {
            nodes: Api::all(client.clone()),
            pods: Api::all(client.clone()),
            recorder: Recorder::new(client, reporter),
            local_clients: None,
        }
    }

    /// Also waits for the GPU clients of this process to stop: while one of
    /// the paused apps still runs here, it counts as a pod on the node.
    pub fn with_local_clients(mut self, local: LocalClients) -> Self {
        self.local_clients = Some(local);
        self
    }

    /// Publishes the end of a pass as an Event regarding the node: `Warning
    /// MigConfigFailed` with the reason, or `Normal MigConfigApplied`. Events
    /// are best effort: a failure to publish is returned for logging only.
    pub async fn record_outcome(
        &self,
        node: &str,
        selected: Option<&str>,
        state: MigConfigState,
        reason: Option<&str>,
    ) -> Result<(), ManagerError> {
        let Some(event) = outcome_event(selected, state, reason) else {
            return Ok(());
        };
        let meta = self
            .nodes
            .get_metadata(node)
            .await
            .map_err(|e| cluster(node, "reading the node for an Event", e))?;
        let reference = ObjectReference {
            api_version: Some("v1".to_string()),
            kind: Some("Node".to_string()),
            name: Some(node.to_string()),
            uid: meta.metadata.uid,
            ..ObjectReference::default()
        };
        self.recorder
            .publish(&event, &reference)
            .await
            .map_err(|e| cluster(node, "publishing an Event", e))
    }
}

/// The Event for the end of a pass (`None` for states that are not an end).
pub fn outcome_event(
    selected: Option<&str>,
    state: MigConfigState,
    reason: Option<&str>,
) -> Option<Event> {
    let config = selected.unwrap_or("<none>");
    let (type_, reason_word, note) = match state {
        MigConfigState::Failed => (
            EventType::Warning,
            "MigConfigFailed",
            format!(
                "applying MIG config {config} failed: {}",
                reason.unwrap_or("no reason given")
            ),
        ),
        MigConfigState::Success => (
            EventType::Normal,
            "MigConfigApplied",
            format!("the GPUs match MIG config {config}"),
        ),
        MigConfigState::Rebooting => (
            EventType::Normal,
            "MigConfigRebooting",
            format!("MIG config {config} waits for a GPU reset or a node reboot"),
        ),
        MigConfigState::Pending => return None,
    };
    Some(Event {
        type_,
        reason: reason_word.to_string(),
        note: Some(truncate(note, EVENT_NOTE_MAX)),
        action: "ApplyMigConfig".to_string(),
        secondary: None,
    })
}

fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max.saturating_sub(3);
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str("...");
    }
    s
}

/// The JSON merge patch body for `patch`: `{"metadata":{"labels":{..},
/// "annotations":{..}}}` with `null` for removed keys; sections without edits
/// are left out.
pub fn merge_patch_body(patch: &NodePatch) -> Value {
    let mut labels = Map::new();
    for (k, v) in &patch.labels.set {
        labels.insert(k.clone(), Value::String(v.clone()));
    }
    for k in &patch.labels.remove {
        labels.insert(k.clone(), Value::Null);
    }
    let annotations: Map<String, Value> = patch
        .annotations
        .iter()
        .map(|(k, v)| {
            let v = v.as_ref().map_or(Value::Null, |s| Value::String(s.clone()));
            (k.clone(), v)
        })
        .collect();
    let mut meta = Map::new();
    if !labels.is_empty() {
        meta.insert("labels".to_string(), Value::Object(labels));
    }
    if !annotations.is_empty() {
        meta.insert("annotations".to_string(), Value::Object(annotations));
    }
    json!({ "metadata": meta })
}

/// Label selector `app in (a,b,...)` for the client pods (`None` when there
/// is no app to wait for).
pub fn app_selector(apps: &[&str]) -> Option<String> {
    let apps: Vec<&str> = apps.iter().copied().filter(|a| !a.is_empty()).collect();
    (!apps.is_empty()).then(|| format!("app in ({})", apps.join(",")))
}

/// Whether a pod still occupies its node's GPUs (it has not finished).
pub fn pod_is_live(pod: &Pod) -> bool {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    !matches!(phase, Some("Succeeded") | Some("Failed"))
}

fn cluster(node: &str, what: &str, e: kube::Error) -> ManagerError {
    let hint = match &e {
        kube::Error::Api(s) if s.code == 403 => {
            "; give the manager's ServiceAccount get/patch on nodes, list on pods and create on events"
        }
        kube::Error::Api(s) if s.code == 404 => "; check --node-name (NODE_NAME) names this node",
        _ => "",
    };
    ManagerError::Cluster {
        node: node.to_string(),
        detail: format!("{what}: {e}{hint}"),
    }
}

impl NodeApi for KubeNode {
    async fn get(&self, node: &str) -> Result<NodeView, ManagerError> {
        let meta = self
            .nodes
            .get_metadata(node)
            .await
            .map_err(|e| cluster(node, "reading the node", e))?;
        Ok(NodeView {
            labels: meta.metadata.labels.unwrap_or_default(),
            annotations: meta.metadata.annotations.unwrap_or_default(),
        })
    }

    async fn patch(&self, node: &str, patch: &NodePatch) -> Result<(), ManagerError> {
        if patch.labels.is_empty() && patch.annotations.is_empty() {
            return Ok(());
        }
        let body = merge_patch_body(patch);
        self.nodes
            .patch_metadata(node, &PatchParams::default(), &Patch::Merge(&body))
            .await
            .map_err(|e| cluster(node, "patching node labels and annotations", e))?;
        Ok(())
    }

    async fn mig_in_use(&self, node: &str) -> Result<Demand, ManagerError> {
        let params = ListParams::default().fields(&format!("spec.nodeName={node}"));
        let pods = self
            .pods
            .list(&params)
            .await
            .map_err(|e| cluster(node, "listing the pods bound to the node", e))?;
        Ok(super::usage::requested_on_node(&pods.items))
    }

    async fn pods_on_node(&self, node: &str, apps: &[&str]) -> Result<Vec<String>, ManagerError> {
        let Some(selector) = app_selector(apps) else {
            return Ok(Vec::new());
        };
        let params = ListParams::default()
            .fields(&format!("spec.nodeName={node}"))
            .labels(&selector);
        let pods = self
            .pods
            .list(&params)
            .await
            .map_err(|e| cluster(node, "listing GPU client pods", e))?;
        let mut names: Vec<String> = pods
            .items
            .iter()
            .filter(|p| pod_is_live(p))
            .map(|p| {
                let ns = p.metadata.namespace.as_deref().unwrap_or("default");
                let name = p.metadata.name.as_deref().unwrap_or("<unnamed>");
                format!("{ns}/{name}")
            })
            .collect();
        if let Some(local) = &self.local_clients {
            names.extend(
                local
                    .borrow()
                    .iter()
                    .filter(|app| apps.contains(app))
                    .map(|app| format!("{app} (in this node agent)")),
            );
        }
        names.sort();
        Ok(names)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_stack_core::migmanager::LabelEdits;
    use k8s_openapi::api::core::v1::PodStatus;
    use std::collections::BTreeMap;

    #[test]
    fn merge_patch_sets_and_nulls_labels_and_annotations() {
        let patch = NodePatch {
            labels: LabelEdits {
                set: BTreeMap::from([("a".to_string(), "1".to_string())]),
                remove: vec!["b".to_string()],
            },
            annotations: BTreeMap::from([
                ("x".to_string(), Some("v".to_string())),
                ("y".to_string(), None),
            ]),
        };
        assert_eq!(
            merge_patch_body(&patch),
            json!({"metadata": {
                "labels": {"a": "1", "b": null},
                "annotations": {"x": "v", "y": null}
            }})
        );
    }

    #[test]
    fn merge_patch_leaves_out_untouched_sections() {
        let mut patch = NodePatch::default();
        patch.labels.set.insert("a".into(), "1".into());
        assert_eq!(
            merge_patch_body(&patch),
            json!({"metadata": {"labels": {"a": "1"}}})
        );
    }

    #[test]
    fn app_selector_skips_empty_apps() {
        assert_eq!(
            app_selector(&["dp", "", "gfd"]).as_deref(),
            Some("app in (dp,gfd)")
        );
        assert_eq!(app_selector(&["", ""]), None);
    }

    #[test]
    fn finished_pods_do_not_count() {
        let with_phase = |phase: Option<&str>| Pod {
            status: Some(PodStatus {
                phase: phase.map(str::to_string),
                ..PodStatus::default()
            }),
            ..Pod::default()
        };
        assert!(pod_is_live(&with_phase(Some("Running"))));
        assert!(pod_is_live(&with_phase(Some("Pending"))));
        assert!(pod_is_live(&with_phase(None)));
        assert!(!pod_is_live(&with_phase(Some("Succeeded"))));
        assert!(!pod_is_live(&with_phase(Some("Failed"))));
    }

    #[test]
    fn events_name_the_config_and_the_reason() {
        let e = outcome_event(Some("all-1g.10gb"), MigConfigState::Failed, Some("no fit")).unwrap();
        assert_eq!(e.type_, EventType::Warning);
        assert_eq!(e.reason, "MigConfigFailed");
        let note = e.note.unwrap();
        assert!(
            note.contains("all-1g.10gb") && note.contains("no fit"),
            "{note}"
        );
        let ok = outcome_event(Some("c"), MigConfigState::Success, None).unwrap();
        assert_eq!(ok.type_, EventType::Normal);
        assert!(outcome_event(Some("c"), MigConfigState::Pending, None).is_none());
    }

    #[test]
    fn long_event_notes_are_cut_on_a_char_boundary() {
        let reason = "é".repeat(2000);
        let e = outcome_event(Some("c"), MigConfigState::Failed, Some(&reason)).unwrap();
        let note = e.note.unwrap();
        assert!(note.len() <= EVENT_NOTE_MAX, "{}", note.len());
        assert!(note.ends_with("..."));
    }
}
