//! Winding down an upgrade nobody will finish: `autoUpgrade` turned off, the
//! policy deleted or the chart uninstalled while nodes are midway. Each
//! node is put back as the flow found it: uncordoned if the flow cordoned
//! it, left cordoned if it was cordoned before (or its upgrade failed, so
//! its driver may be broken), and stripped of the flow's state label and
//! bookkeeping annotations.
use std::collections::BTreeMap;

use super::state::{
    INITIAL_STATE_ANNOTATION, STATE_LABEL, STATE_START_TIME_ANNOTATION, UpgradeMarks, UpgradeState,
    VALIDATION_START_ANNOTATION, WAIT_FOR_COMPLETION_START_ANNOTATION,
};

/// The annotations the flow itself writes, removed when it winds down. The
/// driver pod's safe-load annotation and a person's upgrade request are not
/// the flow's and stay.
pub const FLOW_ANNOTATIONS: [&str; 4] = [
    INITIAL_STATE_ANNOTATION,
    WAIT_FOR_COMPLETION_START_ANNOTATION,
    VALIDATION_START_ANNOTATION,
    STATE_START_TIME_ANNOTATION,
];

/// What winding down does to one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WindDown {
    /// Make the node schedulable again (the flow cordoned it).
    pub uncordon: bool,
    /// Labels to remove.
    pub remove_labels: Vec<&'static str>,
    /// Annotations to remove.
    pub remove_annotations: Vec<&'static str>,
    /// What was undone, for the node's Event.
    pub note: String,
}

/// How `node`, with `marks` and `unschedulable`, winds down; `None` when the
/// flow left nothing on it. `labels` and `annotations` are the node's.
pub fn wind_down(
    marks: &UpgradeMarks,
    unschedulable: bool,
    labels: &BTreeMap<String, String>,
    annotations: &BTreeMap<String, String>,
) -> Option<WindDown> {
    let remove_labels: Vec<&'static str> = [STATE_LABEL]
        .into_iter()
        .filter(|k| labels.contains_key(*k))
        .collect();
    let remove_annotations: Vec<&'static str> = FLOW_ANNOTATIONS
        .into_iter()
        .filter(|k| annotations.contains_key(*k))
        .collect();
    if remove_labels.is_empty() && remove_annotations.is_empty() {
        return None;
    }
    let state = marks.state;
    let cordoned_by_flow = unschedulable
        && state.in_progress()
        && state != UpgradeState::Failed
        && !marks.initially_unschedulable;
    let cordon = if cordoned_by_flow {
        "uncordoned (the upgrade had cordoned it)"
    } else if unschedulable && state == UpgradeState::Failed {
        "left cordoned: its driver upgrade had failed, check the driver pod before uncordoning"
    } else if unschedulable {
        "left cordoned, as it was before the upgrade"
    } else {
        "schedulable"
    };
    Some(WindDown {
        uncordon: cordoned_by_flow,
        remove_labels,
        remove_annotations,
        note: format!(
            "driver upgrade stopped in state {state} (automatic upgrades are off or the \
             ClusterPolicy is gone): node {cordon}, the upgrade's labels and annotations removed"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn node(
        state: UpgradeState,
        initially_unschedulable: bool,
    ) -> (
        UpgradeMarks,
        BTreeMap<String, String>,
        BTreeMap<String, String>,
    ) {
        let mut labels = BTreeMap::new();
        if state != UpgradeState::Unknown {
            labels.insert(STATE_LABEL.to_string(), state.as_label().to_string());
        }
        let mut annotations = BTreeMap::new();
        annotations.insert(
            STATE_START_TIME_ANNOTATION.to_string(),
            format!("{}@100", state.as_label()),
        );
        if initially_unschedulable {
            annotations.insert(INITIAL_STATE_ANNOTATION.to_string(), "true".into());
        }
        let marks = UpgradeMarks::read(&labels, &annotations).expect("valid marks");
        (marks, labels, annotations)
    }

    #[test]
    fn a_node_the_flow_cordoned_is_uncordoned() {
        let (m, l, a) = node(UpgradeState::DrainRequired, false);
        let w = wind_down(&m, true, &l, &a).expect("something to undo");
        assert!(w.uncordon);
        assert_eq!(w.remove_labels, [STATE_LABEL]);
        assert_eq!(w.remove_annotations, [STATE_START_TIME_ANNOTATION]);
        assert!(w.note.contains("drain-required"), "{}", w.note);
        assert!(w.note.contains("uncordoned"), "{}", w.note);
    }

    #[test]
    fn a_node_cordoned_before_or_failed_stays_cordoned() {
        let (m, l, a) = node(UpgradeState::DrainRequired, true);
        let w = wind_down(&m, true, &l, &a).expect("something to undo");
        assert!(!w.uncordon);
        assert!(w.remove_annotations.contains(&INITIAL_STATE_ANNOTATION));
        assert!(w.note.contains("as it was before"), "{}", w.note);
        let (m, l, a) = node(UpgradeState::Failed, false);
        let w = wind_down(&m, true, &l, &a).expect("something to undo");
        assert!(!w.uncordon);
        assert!(w.note.contains("had failed"), "{}", w.note);
    }

    #[test]
    fn a_node_the_flow_never_touched_is_left_alone() {
        assert_eq!(
            wind_down(
                &UpgradeMarks::default(),
                true,
                &BTreeMap::new(),
                &BTreeMap::new()
            ),
            None
        );
    }

    proptest! {
        /// Whatever the state: the flow uncordons only a node it could have
        /// cordoned itself, never one cordoned before its upgrade, and
        /// removes every mark it wrote.
        #[test]
        fn winding_down_undoes_only_the_flows_own_work(
            state in proptest::sample::select(UpgradeState::ALL.to_vec()),
            initially in any::<bool>(),
            unschedulable in any::<bool>(),
        ) {
            let (m, l, a) = node(state, initially);
            let w = wind_down(&m, unschedulable, &l, &a);
            let w = w.expect("the state-time annotation is always there");
            if w.uncordon {
                prop_assert!(unschedulable && !initially && state.in_progress());
            }
            prop_assert!(!(initially && w.uncordon));
            for k in &w.remove_annotations {
                prop_assert!(a.contains_key(*k));
            }
            prop_assert_eq!(w.remove_annotations.len(), 1 + usize::from(initially));
            prop_assert_eq!(w.remove_labels.is_empty(), state == UpgradeState::Unknown);
        }
    }
}
