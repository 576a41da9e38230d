//! Turns the pure pass's decisions into API requests: one merge patch per
//! node (state label, annotations and `spec.unschedulable` together), then
//! evictions and driver pod deletions.
use std::collections::BTreeSet;

use gpu_stack_core::operator::upgrade::abandon::WindDown;
use gpu_stack_core::operator::upgrade::pass::{NodeDecision, PodRef, UpgradeAction};
use gpu_stack_core::operator::upgrade::state::{STATE_LABEL, UpgradeState};
use serde_json::{Map, Value, json};

/// The requests one node's decision needs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeWork {
    /// Node name.
    pub node: String,
    /// The merge patch of the node, if anything on it changes.
    pub patch: Option<Value>,
    /// Pods to evict (those already terminating left out).
    pub evict: Vec<PodRef>,
    /// Driver pods to delete, as `(namespace, name)`.
    pub delete: Vec<(String, String)>,
}

impl NodeWork {
    /// Nothing to do.
    pub fn is_empty(&self) -> bool {
        self.patch.is_none() && self.evict.is_empty() && self.delete.is_empty()
    }
}

/// The one merge patch that winds a node's abandoned upgrade down (see
/// [`gpu_stack_core::operator::upgrade::abandon`]).
pub fn wind_down_patch(w: &WindDown) -> Value {
    let nulls = |keys: &[&str]| -> Map<String, Value> {
        keys.iter().map(|k| (k.to_string(), Value::Null)).collect()
    };
    let mut patch = json!({"metadata": {
        "labels": nulls(&w.remove_labels),
        "annotations": nulls(&w.remove_annotations),
    }});
    if w.uncordon {
        patch["spec"] = json!({ "unschedulable": false });
    }
    patch
}

/// The requests for one decision. `terminating` names the pods already
/// being deleted (`(namespace, name)`), which need no eviction.
pub fn node_work(d: &NodeDecision, terminating: &BTreeSet<(String, String)>) -> NodeWork {
    let mut labels = Map::new();
    let mut annotations = Map::new();
    let mut unschedulable = None;
    let mut work = NodeWork {
        node: d.node.clone(),
        ..NodeWork::default()
    };
    if d.from != d.next {
        let value = match d.next {
            UpgradeState::Unknown => Value::Null,
            s => Value::String(s.as_label().to_string()),
        };
        labels.insert(STATE_LABEL.to_string(), value);
    }
    for a in &d.actions {
        match a {
            UpgradeAction::Cordon => unschedulable = Some(true),
            UpgradeAction::Uncordon => unschedulable = Some(false),
            UpgradeAction::SetAnnotation { key, value } => {
                annotations.insert(key.clone(), Value::String(value.clone()));
            }
            UpgradeAction::RemoveAnnotation { key } => {
                annotations.insert(key.clone(), Value::Null);
            }
            UpgradeAction::Evict { pods, .. } => work.evict.extend(
                pods.iter()
                    .filter(|p| !terminating.contains(&(p.namespace.clone(), p.name.clone())))
                    .cloned(),
            ),
            UpgradeAction::DeleteDriverPod { namespace, name } => {
                work.delete.push((namespace.clone(), name.clone()));
            }
        }
    }
    let mut meta = Map::new();
    if !labels.is_empty() {
        meta.insert("labels".into(), Value::Object(labels));
    }
    if !annotations.is_empty() {
        meta.insert("annotations".into(), Value::Object(annotations));
    }
    let mut patch = Map::new();
    if !meta.is_empty() {
        patch.insert("metadata".into(), Value::Object(meta));
    }
    if let Some(u) = unschedulable {
        // `false` rather than null: a merge patch that removes the field
        // works too, but `false` reads plainly in audit logs.
        patch.insert("spec".into(), json!({ "unschedulable": u }));
    }
    if !patch.is_empty() {
        work.patch = Some(Value::Object(patch));
    }
    work
}
