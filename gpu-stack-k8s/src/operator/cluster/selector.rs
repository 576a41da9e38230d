//! Which nodes a pod template lands on: node selectors, required node
//! affinity (match expressions and `metadata.name` match fields), and
//! taints/tolerations. Used by the in-memory cluster, by the desired state
//! (which nodes a DaemonSet reporting no pods should have pods on), and by
//! tests that check no DaemonSet ever selects a CPU-only node.
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, NodeSelectorRequirement, PodSpec, Taint, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

fn requirement_matches(req: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = req.values.as_deref().unwrap_or(&[]);
    match req.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| !values.iter().any(|x| x == v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(v), Some(bound)) = (
                value.and_then(|v| v.parse::<i64>().ok()),
                values.first().and_then(|b| b.parse::<i64>().ok()),
            ) else {
                return false;
            };
            if req.operator == "Gt" {
                v > bound
            } else {
                v < bound
            }
        }
        _ => false,
    }
}

/// Whether a toleration tolerates a taint.
pub fn tolerates(t: &Toleration, taint: &Taint) -> bool {
    if let Some(effect) = t.effect.as_deref()
        && !effect.is_empty()
        && effect != taint.effect
    {
        return false;
    }
    match t.key.as_deref() {
        None | Some("") => t.operator.as_deref() == Some("Exists"),
        Some(k) if k != taint.key => false,
        Some(_) => match t.operator.as_deref() {
            Some("Exists") => true,
            _ => t.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or(""),
        },
    }
}

/// Whether a pod with this spec would be placed on the node by the DaemonSet
/// controller (node selector, required affinity, NoSchedule/NoExecute taints).
pub fn pod_fits_node(spec: &PodSpec, node: &Node) -> bool {
    let name = node.metadata.name.as_deref().unwrap_or("");
    let no_labels = BTreeMap::new();
    let labels = node.metadata.labels.as_ref().unwrap_or(&no_labels);
    pod_selects_node(spec, name, labels) && pod_tolerates_node(spec, node)
}

/// Whether a pod's node selector and required node affinity accept a node
/// with this name and these labels (taints aside: for callers that keep only
/// node metadata).
pub fn pod_selects_node(spec: &PodSpec, name: &str, labels: &BTreeMap<String, String>) -> bool {
    if let Some(sel) = &spec.node_selector
        && !sel.iter().all(|(k, v)| labels.get(k) == Some(v))
    {
        return false;
    }
    if let Some(required) = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|na| {
            na.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
    {
        // Terms are ORed; requirements inside a term are ANDed.
        let any = required.node_selector_terms.iter().any(|term| {
            let exprs = term.match_expressions.as_deref().unwrap_or(&[]);
            let fields = term.match_fields.as_deref().unwrap_or(&[]);
            exprs
                .iter()
                .all(|r| requirement_matches(r, labels.get(&r.key).map(String::as_str)))
                && fields.iter().all(|r| {
                    let v = (r.key == "metadata.name").then_some(name);
                    requirement_matches(r, v)
                })
        });
        if !any {
            return false;
        }
    }
    true
}

/// Whether a pod tolerates every NoSchedule/NoExecute taint of the node.
fn pod_tolerates_node(spec: &PodSpec, node: &Node) -> bool {
    let taints = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_deref())
        .unwrap_or(&[]);
    pod_tolerates_taints(spec, taints)
}

/// Whether a pod tolerates every NoSchedule and NoExecute taint in `taints`,
/// as the DaemonSet controller decides where its pods go (PreferNoSchedule
/// taints do not keep a DaemonSet pod off a node).
pub fn pod_tolerates_taints(spec: &PodSpec, taints: &[Taint]) -> bool {
    let tolerations = spec.tolerations.as_deref().unwrap_or(&[]);
    taints.iter().all(|taint| {
        !(taint.effect == "NoSchedule" || taint.effect == "NoExecute")
            || tolerations.iter().any(|t| tolerates(t, taint))
    })
}

/// Whether labels match a `LabelSelector` (match labels and expressions).
pub fn label_selector_matches(sel: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    if let Some(ml) = &sel.match_labels
        && !ml.iter().all(|(k, v)| labels.get(k) == Some(v))
    {
        return false;
    }
    sel.match_expressions.iter().flatten().all(|e| {
        let value = labels.get(&e.key).map(String::as_str);
        let values = e.values.as_deref().unwrap_or(&[]);
        match e.operator.as_str() {
            "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
            "NotIn" => value.is_none_or(|v| !values.iter().any(|x| x == v)),
            "Exists" => value.is_some(),
            "DoesNotExist" => value.is_none(),
            _ => false,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        Affinity, NodeAffinity, NodeSelector, NodeSelectorTerm, NodeSpec,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn node(name: &str, labels: &[(&str, &str)], taints: Vec<Taint>) -> Node {
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
            spec: Some(NodeSpec {
                taints: Some(taints),
                ..Default::default()
            }),
            status: None,
        }
    }

    #[test]
    fn selector_affinity_and_taints() {
        let gpu_taint = Taint {
            key: "nvidia.com/gpu".into(),
            effect: "NoSchedule".into(),
            ..Default::default()
        };
        let n = node("g1", &[("a", "true")], vec![gpu_taint.clone()]);
        let mut spec = PodSpec {
            node_selector: Some([("a".to_string(), "true".to_string())].into()),
            ..Default::default()
        };
        assert!(!pod_fits_node(&spec, &n), "taint not tolerated");
        spec.tolerations = Some(vec![Toleration {
            key: Some("nvidia.com/gpu".into()),
            operator: Some("Exists".into()),
            effect: Some("NoSchedule".into()),
            ..Default::default()
        }]);
        assert!(pod_fits_node(&spec, &n));
        spec.affinity = Some(Affinity {
            node_affinity: Some(NodeAffinity {
                required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                    node_selector_terms: vec![NodeSelectorTerm {
                        match_fields: Some(vec![NodeSelectorRequirement {
                            key: "metadata.name".into(),
                            operator: "NotIn".into(),
                            values: Some(vec!["g1".into()]),
                        }]),
                        ..Default::default()
                    }],
                }),
                ..Default::default()
            }),
            ..Default::default()
        });
        assert!(!pod_fits_node(&spec, &n), "excluded by name");
        assert!(pod_fits_node(&spec, &node("g2", &[("a", "true")], vec![])));
        assert!(!pod_fits_node(
            &spec,
            &node("g3", &[("a", "false")], vec![])
        ));
    }

    fn taint(key: &str, value: Option<&str>, effect: &str) -> Taint {
        Taint {
            key: key.into(),
            value: value.map(Into::into),
            effect: effect.into(),
            ..Default::default()
        }
    }

    #[test]
    fn only_no_schedule_and_no_execute_taints_keep_a_pod_off() {
        let spec = PodSpec {
            tolerations: Some(vec![Toleration {
                key: Some("nvidia.com/gpu".into()),
                operator: Some("Exists".into()),
                effect: Some("NoSchedule".into()),
                ..Default::default()
            }]),
            ..Default::default()
        };
        assert!(pod_tolerates_taints(&spec, &[]));
        assert!(pod_tolerates_taints(
            &spec,
            &[taint("nvidia.com/gpu", None, "NoSchedule")]
        ));
        assert!(pod_tolerates_taints(
            &spec,
            &[taint("dedicated", Some("ml"), "PreferNoSchedule")]
        ));
        assert!(!pod_tolerates_taints(
            &spec,
            &[taint("dedicated", Some("ml"), "NoSchedule")]
        ));
        assert!(!pod_tolerates_taints(
            &spec,
            &[taint("nvidia.com/gpu", None, "NoExecute")]
        ));
        let everything = PodSpec {
            tolerations: Some(vec![Toleration {
                operator: Some("Exists".into()),
                ..Default::default()
            }]),
            ..Default::default()
        };
        assert!(pod_tolerates_taints(
            &everything,
            &[
                taint("dedicated", Some("ml"), "NoSchedule"),
                taint("node.kubernetes.io/unreachable", None, "NoExecute"),
            ]
        ));
    }
}
