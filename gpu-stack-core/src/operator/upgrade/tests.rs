use std::collections::BTreeMap;

use proptest::prelude::*;

use super::{pass::*, policy::*, selector::LabelSelector, state::*};

fn yaml(text: &str) -> UpgradePolicy {
    crate::yaml_guard::from_str(text).unwrap()
}

/// `driver.upgradePolicy` as NVIDIA's Helm values.yaml writes it (the chart
/// renders `gpuPodDeletion` into the ClusterPolicy's `podDeletion`).
const NVIDIA_VALUES: &str = r#"
autoUpgrade: true
maxParallelUpgrades: 1
maxUnavailable: 25%
waitForCompletion:
  timeoutSeconds: 0
  podSelector: ""
podDeletion:
  force: false
  timeoutSeconds: 300
  deleteEmptyDir: false
drain:
  enable: false
  force: false
  podSelector: ""
  timeoutSeconds: 300
  deleteEmptyDir: false
"#;

/// The example of k8s-operator-libs' automatic upgrade document.
const NVIDIA_LIBS_EXAMPLE: &str = r#"
autoUpgrade: true
maxParallelUpgrades: 2
maxUnavailable: 3
drain:
  enable: true
  force: true
  podSelector: "app=training"
  timeoutSeconds: 120
  deleteEmptyDir: true
"#;

#[test]
fn nvidia_values_parse_to_the_defaults() {
    let p = yaml(NVIDIA_VALUES);
    let defaults = UpgradePolicy {
        auto_upgrade: true,
        ..UpgradePolicy::default()
    };
    assert_eq!(p, defaults);
    assert!(p.validate().is_empty());
    assert!(p.unknown_fields().is_empty());
    assert_eq!(p.max_unavailable, IntOrString::String("25%".into()));
    assert_eq!(p.pod_deletion.timeout_seconds, 300);
    assert_eq!(p.drain.timeout_seconds, 300);
    assert_eq!(p.wait_for_completion.timeout_seconds, 0);
}

#[test]
fn nvidia_libs_example_parses() {
    let p = yaml(NVIDIA_LIBS_EXAMPLE);
    assert_eq!(p.max_parallel_upgrades, 2);
    assert_eq!(p.max_unavailable, IntOrString::Int(3));
    assert!(p.drain.enable && p.drain.force && p.drain.delete_empty_dir);
    assert_eq!(p.drain.timeout_seconds, 120);
    assert_eq!(
        p.drain_selector(),
        "app=training,nvidia.com/gpu-driver-upgrade-drain.skip!=true"
    );
    // podDeletion absent: NVIDIA's CRD defaults.
    assert_eq!(p.pod_deletion, PodDeletionPolicy::default());
    assert!(p.validate().is_empty());
}

#[test]
fn empty_and_null_sections_take_defaults() {
    let p: UpgradePolicy = serde_json::from_value(serde_json::json!({})).unwrap();
    assert_eq!(p, UpgradePolicy::default());
    assert!(!p.auto_upgrade);
    assert_eq!(p.max_parallel_upgrades, 1);
    let p: UpgradePolicy = serde_json::from_value(serde_json::json!({
        "autoUpgrade": null, "maxParallelUpgrades": null, "maxUnavailable": null,
        "podDeletion": null, "drain": {"timeoutSeconds": null}, "waitForCompletion": null,
    }))
    .unwrap();
    assert_eq!(p, UpgradePolicy::default());
    // Explicit zeroes mean "no limit" / "forever", not the default.
    let p: UpgradePolicy = serde_json::from_value(serde_json::json!({
        "maxParallelUpgrades": 0, "podDeletion": {"timeoutSeconds": 0},
    }))
    .unwrap();
    assert_eq!(p.max_parallel_upgrades, 0);
    assert_eq!(p.pod_deletion.timeout_seconds, 0);
}

#[test]
fn unknown_keys_are_kept_and_listed() {
    let p: UpgradePolicy = serde_json::from_value(serde_json::json!({
        "autoUpgrade": true,
        "gpuPodDeletion": {"force": true},
        "drain": {"enable": true, "gracePeriod": 5},
        "waitForCompletion": {"podSelector": "job=x", "extra": 1},
    }))
    .unwrap();
    assert_eq!(
        p.unknown_fields(),
        vec![
            "drain.gracePeriod",
            "gpuPodDeletion",
            "waitForCompletion.extra"
        ]
    );
    let back = serde_json::to_value(&p).unwrap();
    assert_eq!(back["gpuPodDeletion"]["force"], true);
    assert_eq!(back["drain"]["gracePeriod"], 5);
    let again: UpgradePolicy = serde_json::from_value(back).unwrap();
    assert_eq!(again, p);
}

#[test]
fn percent_rounds_up_over_managed_nodes() {
    let pct = |s: &str, total| IntOrString::String(s.into()).scaled(total).unwrap();
    assert_eq!(pct("25%", 0), 0);
    assert_eq!(pct("25%", 1), 1);
    assert_eq!(pct("25%", 4), 1);
    assert_eq!(pct("25%", 5), 2);
    assert_eq!(pct("25%", 8), 2);
    assert_eq!(pct("25%", 9), 3);
    assert_eq!(pct("1%", 1000), 10);
    assert_eq!(pct("1%", 1001), 11);
    assert_eq!(pct("0%", 50), 0);
    assert_eq!(pct("100%", 7), 7);
    assert_eq!(pct("33%", 3), 1);
    assert_eq!(pct("34%", 3), 2);
    assert_eq!(IntOrString::Int(5).scaled(2).unwrap(), 5);
}

#[test]
fn bad_policies_name_the_field_and_the_fix() {
    let p: UpgradePolicy = serde_json::from_value(serde_json::json!({
        "maxParallelUpgrades": -1,
        "maxUnavailable": "lots",
        "podDeletion": {"timeoutSeconds": -5},
        "drain": {"podSelector": "app in (a,b"},
        "waitForCompletion": {"podSelector": "=x"},
    }))
    .unwrap();
    let errs = p.validate();
    let fields: Vec<&str> = errs.iter().map(|e| e.field()).collect();
    assert_eq!(
        fields,
        vec![
            "maxParallelUpgrades",
            "maxUnavailable",
            "podDeletion.timeoutSeconds",
            "waitForCompletion.podSelector",
            "drain.podSelector",
        ]
    );
    for e in &errs {
        let text = e.to_string();
        assert!(text.starts_with(&format!("{}: ", e.field())), "{text}");
    }
    assert!(errs[1].to_string().contains("\"25%\""));
    for (value, want) in [
        (serde_json::json!(-1), "negative"),
        (serde_json::json!("-10%"), "negative"),
        (serde_json::json!("101%"), "over 100%"),
        (serde_json::json!("5"), "not an integer or a percentage"),
        (serde_json::json!(" 5%"), "not an integer or a percentage"),
        (serde_json::json!("%"), "not an integer or a percentage"),
    ] {
        let p: UpgradePolicy =
            serde_json::from_value(serde_json::json!({ "maxUnavailable": value })).unwrap();
        let errs = p.validate();
        assert_eq!(errs.len(), 1, "{value}: {errs:?}");
        assert!(errs[0].to_string().contains(want), "{value}: {}", errs[0]);
        // The pass refuses the same policies.
        assert!(plan_pass(&[], &p, 0, &PassOptions::default()).is_err());
    }
}

#[test]
fn selectors_parse_and_match() {
    let labels: BTreeMap<String, String> = [("app", "train"), ("tier", "gpu"), ("n", "5")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    for (sel, want) in [
        ("", true),
        ("   ", true),
        ("app=train", true),
        ("app == train", true),
        ("app!=train", false),
        ("missing!=x", true),
        ("app in (train, serve)", true),
        ("app notin (train)", false),
        ("tier,app", true),
        ("!tier", false),
        ("!nvidia.com/gpu-driver-upgrade-drain.skip", true),
        ("n>4,n<6", true),
        ("n>5", false),
        (
            "app=train,nvidia.com/gpu-driver-upgrade-drain.skip!=true",
            true,
        ),
        ("app=", false),
        ("x in (,a)", false),
    ] {
        let s = LabelSelector::parse(sel).unwrap_or_else(|e| panic!("{sel}: {e}"));
        assert_eq!(s.matches(&labels), want, "{sel}");
        // Display writes a selector that parses to the same thing.
        assert_eq!(LabelSelector::parse(&s.to_string()).unwrap(), s, "{sel}");
    }
    for bad in [
        "app=train,",
        ",",
        "=x",
        "app in a",
        "app in (a",
        "app notin (a,b",
        "Bad_Prefix/app=x",
        "app=-x",
        "n>abc",
        "app = x y",
        "a!b",
        "app=(x)",
    ] {
        let e = LabelSelector::parse(bad).expect_err(bad);
        assert!(e.to_string().contains(bad), "{e}");
    }
}

#[test]
fn state_labels_round_trip() {
    for s in UpgradeState::ALL {
        assert_eq!(UpgradeState::from_label(s.as_label()), Ok(s));
        let json = serde_json::to_value(s).unwrap();
        assert_eq!(serde_json::from_value::<UpgradeState>(json).unwrap(), s);
    }
    assert_eq!(UpgradeState::from_label(""), Ok(UpgradeState::Unknown));
    let e = UpgradeState::from_label("upgrade-in-progress").unwrap_err();
    assert!(e.to_string().contains(STATE_LABEL));
    assert_eq!(UpgradeState::Done.as_label(), "upgrade-done");
    assert_eq!(UpgradeState::Failed.as_label(), "upgrade-failed");
}

#[test]
fn marks_read_nvidia_labels_and_annotations() {
    let map = |kv: &[(&str, &str)]| -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let labels = map(&[(STATE_LABEL, "validation-required"), (SKIP_LABEL, "true")]);
    let ann = map(&[
        (UPGRADE_REQUESTED_ANNOTATION, "true"),
        (SAFE_LOAD_ANNOTATION, "true"),
        (INITIAL_STATE_ANNOTATION, "true"),
        (WAIT_FOR_COMPLETION_START_ANNOTATION, "1700000000"),
        (VALIDATION_START_ANNOTATION, "garbage"),
        (
            STATE_START_TIME_ANNOTATION,
            "validation-required@1700000100",
        ),
    ]);
    let m = UpgradeMarks::read(&labels, &ann).unwrap();
    assert_eq!(m.state, UpgradeState::ValidationRequired);
    assert!(m.skip && m.upgrade_requested && m.waiting_for_safe_load && m.initially_unschedulable);
    assert_eq!(m.wait_for_completion_since, Some(1_700_000_000));
    assert_eq!(m.validation_since, None);
    assert_eq!(m.current_state_since(), Some(1_700_000_100));
    let bad = map(&[(STATE_LABEL, "bogus")]);
    assert!(UpgradeMarks::read(&bad, &BTreeMap::new()).is_err());
    let m = UpgradeMarks::read(&BTreeMap::new(), &BTreeMap::new()).unwrap();
    assert_eq!(m, UpgradeMarks::default());
}

fn pod(name: &str) -> PodRef {
    PodRef {
        namespace: "default".into(),
        name: name.into(),
        controlled: true,
        daemon_set: false,
        empty_dir: false,
    }
}

fn node(name: &str, state: UpgradeState, in_sync: bool) -> NodeObservation {
    NodeObservation {
        name: name.into(),
        marks: UpgradeMarks {
            state,
            ..Default::default()
        },
        node_ready: true,
        unschedulable: false,
        driver_pod: DriverPodObservation {
            namespace: "gpu-operator".into(),
            name: format!("nvidia-driver-{name}"),
            revision: if in_sync { "new" } else { "old" }.into(),
            daemonset_revision: Some("new".into()),
            ready: true,
            terminating: false,
            failing: false,
            missing: false,
        },
        validator: ValidatorStatus::Ready,
        gpu_pods: vec![],
        wait_pods: vec![],
        drain_pods: vec![],
    }
}

fn on() -> UpgradePolicy {
    UpgradePolicy {
        auto_upgrade: true,
        ..UpgradePolicy::default()
    }
}

fn pass1(n: &NodeObservation, p: &UpgradePolicy, now: u64) -> NodeDecision {
    plan_pass(std::slice::from_ref(n), p, now, &PassOptions::default())
        .unwrap()
        .decisions
        .remove(0)
}

fn has(d: &NodeDecision, f: impl Fn(&UpgradeAction) -> bool) -> bool {
    d.actions.iter().any(f)
}

#[test]
fn in_sync_nodes_keep_their_label_and_out_of_sync_ones_need_an_upgrade() {
    // No label and an up-to-date driver: nothing to write, ever.
    let d = pass1(&node("a", UpgradeState::Unknown, true), &on(), 0);
    assert_eq!(d.next, UpgradeState::Unknown);
    assert!(!d.has_changes());
    let d = pass1(&node("a", UpgradeState::Done, true), &on(), 0);
    assert_eq!(d.next, UpgradeState::Done);
    assert!(!d.has_changes());
    let d = pass1(&node("a", UpgradeState::Unknown, false), &on(), 0);
    assert_eq!(d.next, UpgradeState::UpgradeRequired);
    let mut n = node("a", UpgradeState::Done, false);
    n.unschedulable = true;
    let d = pass1(&n, &on(), 0);
    assert_eq!(d.next, UpgradeState::UpgradeRequired);
    assert!(has(
        &d,
        |a| matches!(a, UpgradeAction::SetAnnotation { key, .. } if key == INITIAL_STATE_ANNOTATION)
    ));
    // An orphaned pod is not an upgrade by itself; a request makes it one.
    let mut n = node("a", UpgradeState::Done, false);
    n.driver_pod.daemonset_revision = None;
    assert_eq!(pass1(&n, &on(), 0).next, UpgradeState::Done);
    n.marks.upgrade_requested = true;
    assert_eq!(pass1(&n, &on(), 0).next, UpgradeState::UpgradeRequired);
    // Safe load pending on an in-sync pod starts the flow too.
    let mut n = node("a", UpgradeState::Done, true);
    n.marks.waiting_for_safe_load = true;
    assert_eq!(pass1(&n, &on(), 0).next, UpgradeState::UpgradeRequired);
}

#[test]
fn auto_upgrade_off_clears_every_label() {
    let p = UpgradePolicy::default();
    let nodes = vec![
        node("a", UpgradeState::DrainRequired, false),
        node("b", UpgradeState::Done, true),
    ];
    let plan = plan_pass(&nodes, &p, 0, &PassOptions::default()).unwrap();
    for d in &plan.decisions {
        assert_eq!(d.next, UpgradeState::Unknown);
        assert!(d.actions.is_empty());
    }
}

#[test]
fn slots_follow_max_parallel_and_max_unavailable() {
    // 8 nodes pending, 25% -> 2 unavailable, 3 parallel: 2 start.
    let p = UpgradePolicy {
        max_parallel_upgrades: 3,
        ..on()
    };
    let nodes: Vec<_> = (0..8)
        .map(|i| node(&format!("n{i}"), UpgradeState::UpgradeRequired, false))
        .collect();
    let plan = plan_pass(&nodes, &p, 0, &PassOptions::default()).unwrap();
    assert_eq!(plan.counts.max_unavailable, 2);
    assert_eq!(plan.counts.available, 2);
    let started: Vec<_> = plan
        .decisions
        .iter()
        .filter(|d| d.next == UpgradeState::CordonRequired)
        .map(|d| d.node.as_str())
        .collect();
    assert_eq!(started, vec!["n0", "n1"]);
    // A skipped node, a NotReady node and a manually cordoned node.
    let mut nodes = nodes;
    nodes[0].marks.skip = true;
    nodes[1].node_ready = false;
    nodes[2].unschedulable = true;
    let p = UpgradePolicy {
        max_parallel_upgrades: 1,
        max_unavailable: IntOrString::Int(8),
        ..on()
    };
    let plan = plan_pass(&nodes, &p, 0, &PassOptions::default()).unwrap();
    let next = |n: &str| plan.decision(n).unwrap().next;
    assert_eq!(next("n0"), UpgradeState::UpgradeRequired);
    assert_eq!(next("n1"), UpgradeState::UpgradeRequired);
    assert_eq!(next("n2"), UpgradeState::CordonRequired); // uses the slot
    // No slot left, but an already cordoned node always proceeds (NVIDIA).
    assert_eq!(next("n3"), UpgradeState::UpgradeRequired);
    nodes[4].unschedulable = true;
    let plan = plan_pass(&nodes, &p, 0, &PassOptions::default()).unwrap();
    assert_eq!(
        plan.decision("n4").unwrap().next,
        UpgradeState::CordonRequired
    );
    // maxParallelUpgrades 0: every pending node, still capped by maxUnavailable.
    let p = UpgradePolicy {
        max_parallel_upgrades: 0,
        max_unavailable: IntOrString::String("50%".into()),
        ..on()
    };
    let nodes: Vec<_> = (0..6)
        .map(|i| node(&format!("n{i}"), UpgradeState::UpgradeRequired, false))
        .collect();
    let plan = plan_pass(&nodes, &p, 0, &PassOptions::default()).unwrap();
    assert_eq!(plan.counts.available, 3);
}

#[test]
fn groups_are_planned_with_their_own_policy_and_budget() {
    let pending = |prefix: &str, n: usize| -> Vec<NodeObservation> {
        (0..n)
            .map(|i| {
                node(
                    &format!("{prefix}{i}"),
                    UpgradeState::UpgradeRequired,
                    false,
                )
            })
            .collect()
    };
    let wide = UpgradePolicy {
        max_parallel_upgrades: 0,
        max_unavailable: IntOrString::String("50%".into()),
        ..on()
    };
    let groups = [
        UpgradeGroup {
            policy: wide.clone(),
            nodes: pending("a", 4),
        },
        UpgradeGroup {
            policy: UpgradePolicy {
                auto_upgrade: false,
                ..wide
            },
            nodes: pending("b", 4),
        },
        UpgradeGroup {
            policy: on(),
            nodes: pending("c", 4),
        },
    ];
    let opts = PassOptions::default();
    let plan = plan_groups(&groups, 0, &opts).unwrap();
    let started = |prefix: &str| {
        plan.decisions
            .iter()
            .filter(|d| d.node.starts_with(prefix) && d.next == UpgradeState::CordonRequired)
            .count()
    };
    // 50% of a's 4 nodes; none of b's (off); one of c's (one at a time).
    assert_eq!((started("a"), started("b"), started("c")), (2, 0, 1));
    assert!(
        plan.decisions
            .iter()
            .filter(|d| d.node.starts_with('b'))
            .all(|d| d.next == UpgradeState::Unknown)
    );
    assert!(plan.decisions.windows(2).all(|w| w[0].node < w[1].node));
    // One group is exactly plan_pass.
    let one = plan_groups(&groups[..1], 0, &opts).unwrap();
    assert_eq!(
        one,
        plan_pass(&groups[0].nodes, &groups[0].policy, 0, &opts).unwrap()
    );
}

#[test]
fn wait_for_completion_times_out_into_pod_deletion() {
    let p = UpgradePolicy {
        wait_for_completion: WaitForCompletionPolicy {
            pod_selector: "job=train".into(),
            timeout_seconds: 100,
            extra: Extra::new(),
        },
        ..on()
    };
    let mut n = node("a", UpgradeState::WaitForJobsRequired, false);
    n.unschedulable = true;
    n.wait_pods = vec![pod("train-0")];
    let d = pass1(&n, &p, 1000);
    assert_eq!(d.next, UpgradeState::WaitForJobsRequired);
    assert!(d.reason.contains("default/train-0"));
    assert!(has(
        &d,
        |a| matches!(a, UpgradeAction::SetAnnotation { key, value } if key == WAIT_FOR_COMPLETION_START_ANNOTATION && value == "1000")
    ));
    n.marks.wait_for_completion_since = Some(1000);
    assert_eq!(pass1(&n, &p, 1100).next, UpgradeState::WaitForJobsRequired);
    let d = pass1(&n, &p, 1101);
    assert_eq!(d.next, UpgradeState::PodDeletionRequired);
    assert!(has(
        &d,
        |a| matches!(a, UpgradeAction::RemoveAnnotation { key } if key == WAIT_FOR_COMPLETION_START_ANNOTATION)
    ));
    // Timeout 0 waits forever.
    let mut p0 = p.clone();
    p0.wait_for_completion.timeout_seconds = 0;
    assert_eq!(
        pass1(&n, &p0, 1_000_000).next,
        UpgradeState::WaitForJobsRequired
    );
}

#[test]
fn pod_deletion_refusals_and_timeouts() {
    let mut n = node("a", UpgradeState::PodDeletionRequired, false);
    n.unschedulable = true;
    n.gpu_pods = vec![pod("p0")];
    n.marks.state_since = Some((UpgradeState::PodDeletionRequired, 1000));
    let d = pass1(&n, &on(), 1200);
    assert_eq!(d.next, UpgradeState::PodDeletionRequired);
    assert!(has(
        &d,
        |a| matches!(a, UpgradeAction::Evict { purpose: EvictionPurpose::PodDeletion, pods } if pods.len() == 1)
    ));
    // 300 s default timeout; without drain the upgrade fails.
    let d = pass1(&n, &on(), 1301);
    assert_eq!(d.next, UpgradeState::Failed);
    let mut drain = on();
    drain.drain.enable = true;
    assert_eq!(pass1(&n, &drain, 1301).next, UpgradeState::DrainRequired);
    // emptyDir without deleteEmptyDir cannot be deleted.
    n.gpu_pods[0].empty_dir = true;
    let d = pass1(&n, &on(), 1000);
    assert_eq!(d.next, UpgradeState::Failed);
    assert!(
        d.reason.contains("podDeletion.deleteEmptyDir"),
        "{}",
        d.reason
    );
    let mut p = on();
    p.pod_deletion.delete_empty_dir = true;
    assert_eq!(pass1(&n, &p, 1000).next, UpgradeState::PodDeletionRequired);
    // No GPU pods: straight to the driver restart.
    n.gpu_pods.clear();
    assert_eq!(
        pass1(&n, &on(), 1000).next,
        UpgradeState::PodRestartRequired
    );
}

#[test]
fn drain_failure_and_success() {
    let mut p = on();
    p.drain.enable = true;
    let mut n = node("a", UpgradeState::DrainRequired, false);
    n.unschedulable = true;
    let mut unmanaged = pod("bare");
    unmanaged.controlled = false;
    let mut ds = pod("ds");
    ds.daemon_set = true;
    n.drain_pods = vec![unmanaged.clone(), ds];
    let d = pass1(&n, &p, 0);
    assert_eq!(d.next, UpgradeState::Failed);
    assert!(d.reason.contains("drain.force"));
    p.drain.force = true;
    let d = pass1(&n, &p, 0);
    assert_eq!(d.next, UpgradeState::DrainRequired);
    // DaemonSet pods are skipped by the drain.
    assert!(has(
        &d,
        |a| matches!(a, UpgradeAction::Evict { purpose: EvictionPurpose::Drain, pods } if pods == &vec![unmanaged.clone()])
    ));
    n.drain_pods.retain(|p| p.daemon_set);
    assert_eq!(pass1(&n, &p, 0).next, UpgradeState::PodRestartRequired);
    p.drain.enable = false;
    assert_eq!(pass1(&n, &p, 0).next, UpgradeState::PodRestartRequired);
}

#[test]
fn pod_restart_and_validation() {
    let mut n = node("a", UpgradeState::PodRestartRequired, false);
    n.unschedulable = true;
    let d = pass1(&n, &on(), 0);
    assert_eq!(d.next, UpgradeState::PodRestartRequired);
    assert!(has(&d, |a| matches!(
        a,
        UpgradeAction::DeleteDriverPod { .. }
    )));
    n.driver_pod.terminating = true;
    assert!(!has(&pass1(&n, &on(), 0), |a| matches!(
        a,
        UpgradeAction::DeleteDriverPod { .. }
    )));
    // Already at the new revision: no restart, on to validation.
    let mut n = node("a", UpgradeState::PodRestartRequired, true);
    n.marks.waiting_for_safe_load = true;
    let d = pass1(&n, &on(), 0);
    assert_eq!(d.next, UpgradeState::ValidationRequired);
    assert!(has(
        &d,
        |a| matches!(a, UpgradeAction::RemoveAnnotation { key } if key == SAFE_LOAD_ANNOTATION)
    ));
    n.driver_pod.ready = false;
    n.driver_pod.failing = true;
    assert_eq!(pass1(&n, &on(), 0).next, UpgradeState::Failed);
    // Validation: 600 s, then failed.
    let mut n = node("a", UpgradeState::ValidationRequired, true);
    n.validator = ValidatorStatus::NotReady;
    n.marks.validation_since = Some(100);
    assert_eq!(pass1(&n, &on(), 700).next, UpgradeState::ValidationRequired);
    assert_eq!(pass1(&n, &on(), 701).next, UpgradeState::Failed);
    n.validator = ValidatorStatus::Ready;
    assert_eq!(pass1(&n, &on(), 701).next, UpgradeState::UncordonRequired);
    n.marks.initially_unschedulable = true;
    let d = pass1(&n, &on(), 701);
    assert_eq!(d.next, UpgradeState::Done);
    assert!(has(
        &d,
        |a| matches!(a, UpgradeAction::RemoveAnnotation { key } if key == INITIAL_STATE_ANNOTATION)
    ));
    // Validation off: a Ready pod ends the upgrade.
    let n = node("a", UpgradeState::PodRestartRequired, true);
    let opts = PassOptions {
        validation: false,
        ..PassOptions::default()
    };
    let d = plan_pass(&[n], &on(), 0, &opts).unwrap();
    assert_eq!(d.decisions[0].next, UpgradeState::UncordonRequired);
}

#[test]
fn failed_recovers_once_in_sync() {
    let mut n = node("a", UpgradeState::Failed, false);
    assert_eq!(pass1(&n, &on(), 0).next, UpgradeState::Failed);
    n.driver_pod.revision = "new".into();
    n.driver_pod.ready = false;
    assert_eq!(pass1(&n, &on(), 0).next, UpgradeState::Failed);
    n.driver_pod.ready = true;
    assert_eq!(pass1(&n, &on(), 0).next, UpgradeState::UncordonRequired);
}

#[test]
fn requestor_states_are_left_alone_and_not_counted() {
    let nodes = vec![
        node("a", UpgradeState::NodeMaintenanceRequired, false),
        node("b", UpgradeState::Unknown, true),
    ];
    let plan = plan_pass(&nodes, &on(), 0, &PassOptions::default()).unwrap();
    assert_eq!(plan.counts.total, 1);
    let d = plan.decision("a").unwrap();
    assert!(!d.has_changes());
    assert!(d.reason.contains("not implemented"));
}

#[test]
fn stuck_detector_names_what_a_node_waits_for() {
    let mut p = on();
    p.wait_for_completion.pod_selector = "job=train".into();
    let mut a = node("a", UpgradeState::WaitForJobsRequired, false);
    a.unschedulable = true;
    a.wait_pods = vec![pod("train-0"), pod("train-1")];
    a.marks.state_since = Some((UpgradeState::WaitForJobsRequired, 0));
    a.marks.wait_for_completion_since = Some(0);
    let mut b = node("b", UpgradeState::ValidationRequired, true);
    b.validator = ValidatorStatus::Absent;
    b.marks.validation_since = Some(3000);
    // Moves on this pass: not stuck.
    let mut c = node("c", UpgradeState::UncordonRequired, true);
    c.marks.state_since = Some((UpgradeState::UncordonRequired, 0));
    let stuck = stuck_nodes(&[a, b, c], &p, 3600, 1800, &PassOptions::default()).unwrap();
    assert_eq!(stuck.len(), 1);
    assert_eq!(stuck[0].node, "a");
    assert_eq!(stuck[0].waited_seconds, 3600);
    assert!(
        stuck[0]
            .waiting_for
            .contains("default/train-0, default/train-1")
    );
    let stuck = stuck_nodes(
        &[node("b", UpgradeState::ValidationRequired, true)],
        &p,
        3600,
        10,
        &PassOptions::default(),
    )
    .unwrap();
    assert!(stuck.is_empty(), "no start time known: {stuck:?}");
}

#[test]
fn nodes_queued_for_a_slot_are_not_stuck_but_a_not_ready_one_is() {
    let mut p = on();
    p.max_unavailable = IntOrString::Int(1);
    let queued = |name: &str| {
        let mut n = node(name, UpgradeState::UpgradeRequired, false);
        n.marks.state_since = Some((UpgradeState::UpgradeRequired, 0));
        n
    };
    // "a" holds the only slot; "b" waits for it; "c" is skipped; "d" is NotReady.
    let mut a = node("a", UpgradeState::PodDeletionRequired, false);
    a.unschedulable = true;
    a.gpu_pods = vec![pod("train-0")];
    a.marks.state_since = Some((UpgradeState::PodDeletionRequired, 0));
    p.pod_deletion.timeout_seconds = 0;
    let b = queued("b");
    let mut c = queued("c");
    c.marks.skip = true;
    let mut d = queued("d");
    d.node_ready = false;
    let stuck = stuck_nodes(&[a, b, c, d], &p, 3600, 1800, &PassOptions::default()).unwrap();
    let names: Vec<&str> = stuck.iter().map(|s| s.node.as_str()).collect();
    assert_eq!(names, ["a", "d"], "{stuck:?}");
    assert!(stuck[0].waiting_for.contains("default/train-0"));
    assert_eq!(stuck[1].state, UpgradeState::UpgradeRequired);
    assert!(stuck[1].waiting_for.contains("NotReady"), "{stuck:?}");
}

#[test]
fn a_node_mid_upgrade_without_a_driver_pod_holds_and_keeps_its_slot() {
    let mut p = on();
    p.max_unavailable = IntOrString::Int(1);
    // "a" had its old driver pod deleted; the DaemonSet has not created the
    // new one yet.
    let mut a = node("a", UpgradeState::PodRestartRequired, false);
    a.unschedulable = true;
    a.driver_pod = DriverPodObservation {
        missing: true,
        ..DriverPodObservation::default()
    };
    let b = node("b", UpgradeState::UpgradeRequired, false);
    let plan = plan_pass(&[a.clone(), b], &p, 0, &PassOptions::default()).unwrap();
    assert_eq!(plan.counts.unavailable, 1);
    assert_eq!(plan.counts.in_progress, 1);
    let da = plan.decision("a").unwrap();
    assert_eq!(da.next, UpgradeState::PodRestartRequired);
    assert!(
        !has(da, |x| matches!(x, UpgradeAction::DeleteDriverPod { .. })),
        "{da:?}"
    );
    assert!(da.reason.contains("create the node's driver pod"));
    assert_eq!(
        plan.decision("b").unwrap().next,
        UpgradeState::UpgradeRequired
    );
    // Every in-progress state holds the same way.
    for state in [
        UpgradeState::CordonRequired,
        UpgradeState::PodDeletionRequired,
        UpgradeState::ValidationRequired,
        UpgradeState::UncordonRequired,
        UpgradeState::Failed,
    ] {
        a.marks.state = state;
        assert_eq!(pass1(&a, &p, 0).next, state, "{state:?}");
    }
}

// ---- the simulated world ----

/// One node of the simulated cluster: what the API server holds, plus how
/// the node's pods behave.
#[derive(Debug, Clone)]
struct SimNode {
    name: String,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
    ready: bool,
    unschedulable: bool,
    pod_revision: String,
    pod_ready: bool,
    pod_terminating: bool,
    /// Passes until a new driver pod becomes Ready.
    pod_warmup: u32,
    /// Passes until the validator is Ready after the pod is.
    validator_warmup: u32,
    gpu_pods: Vec<PodRef>,
    /// Passes until each job finishes.
    jobs: Vec<(PodRef, u32)>,
    other_pods: Vec<PodRef>,
    /// Times the node entered cordon-required.
    upgrades_started: u32,
    driver_pod_deletions: u32,
}

const DS_REVISION: &str = "rev-2";

impl SimNode {
    fn observe(&self, policy: &UpgradePolicy) -> NodeObservation {
        let marks = UpgradeMarks::read(&self.labels, &self.annotations).unwrap();
        let drain_sel = LabelSelector::parse(&policy.drain_selector()).unwrap();
        let no_labels = BTreeMap::new();
        NodeObservation {
            name: self.name.clone(),
            marks,
            node_ready: self.ready,
            unschedulable: self.unschedulable,
            driver_pod: DriverPodObservation {
                namespace: "gpu-operator".into(),
                name: format!("nvidia-driver-{}-{}", self.name, self.pod_revision),
                revision: self.pod_revision.clone(),
                daemonset_revision: Some(DS_REVISION.into()),
                ready: self.pod_ready,
                terminating: self.pod_terminating,
                failing: false,
                missing: false,
            },
            validator: if self.pod_ready && self.validator_warmup == 0 {
                ValidatorStatus::Ready
            } else {
                ValidatorStatus::NotReady
            },
            gpu_pods: self.gpu_pods.clone(),
            wait_pods: if policy.wait_for_completion.pod_selector.is_empty() {
                vec![]
            } else {
                self.jobs.iter().map(|(p, _)| p.clone()).collect()
            },
            drain_pods: if policy.drain.enable && drain_sel.matches(&no_labels) {
                self.gpu_pods
                    .iter()
                    .chain(self.other_pods.iter())
                    .cloned()
                    .collect()
            } else {
                vec![]
            },
        }
    }

    fn apply(&mut self, d: &NodeDecision) {
        if d.next != d.from && d.next == UpgradeState::CordonRequired {
            self.upgrades_started += 1;
        }
        if d.next == UpgradeState::Unknown {
            self.labels.remove(STATE_LABEL);
        } else {
            self.labels
                .insert(STATE_LABEL.into(), d.next.as_label().into());
        }
        for a in &d.actions {
            match a {
                UpgradeAction::Cordon => self.unschedulable = true,
                UpgradeAction::Uncordon => self.unschedulable = false,
                UpgradeAction::SetAnnotation { key, value } => {
                    self.annotations.insert(key.clone(), value.clone());
                }
                UpgradeAction::RemoveAnnotation { key } => {
                    self.annotations.remove(key);
                }
                UpgradeAction::Evict { pods, .. } => {
                    // A cooperating cluster: evictions succeed at once.
                    self.gpu_pods.retain(|p| !pods.contains(p));
                    self.other_pods.retain(|p| !pods.contains(p));
                    self.jobs.retain(|(p, _)| !pods.contains(p));
                }
                UpgradeAction::DeleteDriverPod { .. } => {
                    self.pod_terminating = true;
                    self.driver_pod_deletions += 1;
                }
            }
        }
    }

    /// Time passes on the node (a NotReady node's pods never get Ready).
    fn tick(&mut self) {
        if self.pod_terminating {
            self.pod_terminating = false;
            self.pod_revision = DS_REVISION.into();
            self.pod_ready = false;
        } else if !self.pod_ready && self.ready {
            if self.pod_warmup == 0 {
                self.pod_ready = true;
            } else {
                self.pod_warmup -= 1;
            }
        } else if self.pod_ready && self.validator_warmup > 0 {
            self.validator_warmup -= 1;
        }
        for (_, left) in &mut self.jobs {
            *left = left.saturating_sub(1);
        }
        self.jobs.retain(|(_, left)| *left > 0);
    }

    fn state(&self) -> UpgradeState {
        UpgradeState::from_label(self.labels.get(STATE_LABEL).map_or("", String::as_str))
            .unwrap_or_default()
    }
}

#[derive(Debug, Clone)]
struct SimSpec {
    up_to_date: bool,
    ready: bool,
    cordoned: bool,
    start_done: bool,
    gpu_pods: u8,
    jobs: Vec<u32>,
    other_pods: u8,
    warmup: u32,
    validator_warmup: u32,
}

fn sim_spec() -> impl Strategy<Value = SimSpec> {
    (
        proptest::bool::weighted(0.2),
        proptest::bool::weighted(0.1),
        proptest::bool::weighted(0.1),
        any::<bool>(),
        0u8..3,
        proptest::collection::vec(1u32..6, 0..3),
        0u8..3,
        0u32..4,
        0u32..3,
    )
        .prop_map(
            |(up_to_date, cordoned, not_ready, start_done, g, jobs, o, w, v)| SimSpec {
                up_to_date,
                ready: !not_ready,
                cordoned,
                start_done,
                gpu_pods: g,
                jobs,
                other_pods: o,
                warmup: w,
                validator_warmup: v,
            },
        )
}

fn world(specs: &[SimSpec]) -> Vec<SimNode> {
    specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let name = format!("node-{i:02}");
            let mut labels = BTreeMap::new();
            if s.start_done {
                labels.insert(STATE_LABEL.to_string(), "upgrade-done".to_string());
            }
            let p = |k: &str, j: u8| PodRef {
                namespace: "work".into(),
                name: format!("{name}-{k}-{j}"),
                controlled: true,
                daemon_set: false,
                empty_dir: false,
            };
            SimNode {
                labels,
                annotations: BTreeMap::new(),
                ready: s.ready,
                unschedulable: s.cordoned,
                pod_revision: if s.up_to_date { DS_REVISION } else { "rev-1" }.into(),
                pod_ready: true,
                pod_terminating: false,
                pod_warmup: s.warmup,
                validator_warmup: s.validator_warmup,
                gpu_pods: (0..s.gpu_pods).map(|j| p("gpu", j)).collect(),
                jobs: s
                    .jobs
                    .iter()
                    .enumerate()
                    .map(|(j, t)| (p("job", j as u8), *t))
                    .collect(),
                other_pods: (0..s.other_pods).map(|j| p("web", j)).collect(),
                upgrades_started: 0,
                driver_pod_deletions: 0,
                name,
            }
        })
        .collect()
}

fn sim_policy() -> impl Strategy<Value = UpgradePolicy> {
    (
        0i64..4,
        prop_oneof![
            (1i64..5).prop_map(IntOrString::Int),
            (1i64..=100).prop_map(|p| IntOrString::String(format!("{p}%"))),
        ],
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(par, mu, drain, wait)| {
            let mut p = UpgradePolicy {
                auto_upgrade: true,
                max_parallel_upgrades: par,
                max_unavailable: mu,
                ..UpgradePolicy::default()
            };
            p.drain.enable = drain;
            if wait {
                p.wait_for_completion.pod_selector = "kind=job".into();
            }
            p
        })
}

fn unavailable(w: &[SimNode]) -> usize {
    w.iter().filter(|n| n.unschedulable || !n.ready).count()
}

/// Runs passes until nothing changes or `max` passes; checks the budget
/// after every pass. Returns the passes it took.
fn run(w: &mut [SimNode], p: &UpgradePolicy, max: usize) -> Result<usize, TestCaseError> {
    let total = w.len();
    let budget = p
        .max_unavailable_nodes(total)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let start_unavailable = unavailable(w);
    let mut now = 1_700_000_000u64;
    for pass in 0..max {
        let obs: Vec<_> = w.iter().map(|n| n.observe(p)).collect();
        let plan = plan_pass(&obs, p, now, &PassOptions::default())
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        // Idempotent and order-independent.
        let again = plan_pass(&obs, p, now, &PassOptions::default()).unwrap();
        prop_assert_eq!(&plan, &again);
        let mut rev = obs.clone();
        rev.reverse();
        prop_assert_eq!(
            &plan,
            &plan_pass(&rev, p, now, &PassOptions::default()).unwrap()
        );
        let mut changed = false;
        for (n, d) in w.iter_mut().zip(plan.decisions.iter()) {
            prop_assert_eq!(&n.name, &d.node);
            changed |= d.has_changes();
            n.apply(d);
        }
        let un = unavailable(w);
        prop_assert!(
            un <= budget.max(start_unavailable),
            "pass {}: {} unavailable, budget {} (started with {})",
            pass,
            un,
            budget,
            start_unavailable
        );
        if p.max_parallel_upgrades > 0 {
            let ours = w
                .iter()
                .filter(|n| n.state().in_progress())
                .filter(|n| !n.annotations.contains_key(INITIAL_STATE_ANNOTATION))
                .count() as i64;
            prop_assert!(
                ours <= p.max_parallel_upgrades,
                "pass {}: {} nodes upgrading with maxParallelUpgrades {}",
                pass,
                ours,
                p.max_parallel_upgrades
            );
        }
        // Settled: no decision changed anything and the world has nothing pending.
        let quiet = w.iter().all(|n| {
            n.jobs.is_empty() && n.pod_ready && !n.pod_terminating && n.validator_warmup == 0
        });
        if !changed && quiet {
            return Ok(pass);
        }
        for n in w.iter_mut() {
            n.tick();
        }
        now += 37;
    }
    Ok(max)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn cooperating_fleet_finishes_within_budget(
        mut specs in proptest::collection::vec(sim_spec(), 1..10),
        mut p in sim_policy(),
        empty_dir in any::<bool>(),
    ) {
        // A cooperating cluster: every node Ready, and the nodes cordoned by
        // hand leave room in maxUnavailable (they hold it for good).
        let budget = p.max_unavailable_nodes(specs.len()).unwrap();
        let mut room = budget.saturating_sub(1);
        for s in &mut specs {
            s.ready = true;
            if s.cordoned {
                if room == 0 {
                    s.cordoned = false;
                } else {
                    room -= 1;
                }
            }
        }
        let mut w = world(&specs);
        if empty_dir {
            // GPU pods pod deletion may not delete: the drain takes over.
            p.drain.enable = true;
            p.drain.delete_empty_dir = true;
            for n in &mut w {
                for g in &mut n.gpu_pods {
                    g.empty_dir = true;
                }
            }
        }
        let bound = 40 * w.len() + 40;
        let passes = run(&mut w, &p, bound)?;
        prop_assert!(passes < bound, "did not settle in {} passes", bound);
        for n in &w {
            let spec = &specs[n.name[5..].parse::<usize>().unwrap()];
            // Upgraded: done. Never needed one: its label as it was.
            let rest = if spec.up_to_date && !spec.start_done {
                UpgradeState::Unknown
            } else {
                UpgradeState::Done
            };
            prop_assert_eq!(n.state(), rest, "{}", n.name);
            prop_assert_eq!(&n.pod_revision, DS_REVISION);
            prop_assert!(n.upgrades_started <= 1, "{} upgraded {} times", n.name, n.upgrades_started);
            prop_assert!(n.driver_pod_deletions <= 1);
            // Cordoned before the upgrade: still cordoned; otherwise schedulable again.
            prop_assert_eq!(n.unschedulable, spec.cordoned, "{}", n.name);
            prop_assert!(!n.annotations.contains_key(STATE_START_TIME_ANNOTATION));
            if spec.up_to_date {
                // Already at the new revision: never cordoned, pod never replaced.
                prop_assert_eq!(n.upgrades_started, 0);
                prop_assert_eq!(n.driver_pod_deletions, 0);
            }
        }
        // Done nodes with in-sync pods stay done: more passes change nothing.
        let obs: Vec<_> = w.iter().map(|n| n.observe(&p)).collect();
        let plan = plan_pass(&obs, &p, 1_800_000_000, &PassOptions::default()).unwrap();
        for d in &plan.decisions {
            prop_assert!(!d.has_changes(), "{:?}", d);
        }
    }

    #[test]
    fn not_ready_nodes_count_but_never_block(
        specs in proptest::collection::vec(sim_spec(), 2..10),
        mut p in sim_policy(),
    ) {
        let total = specs.len();
        let not_ready = specs.iter().filter(|s| !s.ready || s.cordoned).count();
        // Room for at least one more unavailable node.
        if p.max_unavailable_nodes(total).unwrap() <= not_ready {
            p.max_unavailable = IntOrString::Int(not_ready as i64 + 1);
        }
        let mut w = world(&specs);
        let bound = 40 * w.len() + 40;
        run(&mut w, &p, bound)?;
        for (n, s) in w.iter().zip(specs.iter()) {
            if s.ready {
                prop_assert!(n.state().at_rest(), "{} is {}", n.name, n.state());
            } else if !s.up_to_date {
                prop_assert_eq!(n.state(), UpgradeState::UpgradeRequired, "{}", n.name);
                prop_assert_eq!(n.upgrades_started, 0);
                prop_assert_eq!(n.unschedulable, s.cordoned);
            }
        }
    }

    #[test]
    fn pass_counts_never_exceed_budget(
        states in proptest::collection::vec(0usize..13, 1..20),
        flags in proptest::collection::vec((any::<bool>(), any::<bool>(), any::<bool>()), 20),
        p in sim_policy(),
    ) {
        // Arbitrary fleets (any states, cordoned, NotReady, in sync or not):
        // the slots handed to schedulable nodes fit the remaining budget.
        let nodes: Vec<_> = states
            .iter()
            .zip(flags.iter())
            .enumerate()
            .map(|(i, (s, (cordoned, ready, sync)))| {
                let mut n = node(&format!("n{i:02}"), UpgradeState::ALL[*s], *sync);
                n.unschedulable = *cordoned;
                n.node_ready = *ready;
                n
            })
            .collect();
        let plan = plan_pass(&nodes, &p, 0, &PassOptions::default()).unwrap();
        let c = &plan.counts;
        let by_name = |name: &str| nodes.iter().find(|n| n.name == name).unwrap();
        // Managed nodes really unavailable now, or about to be cordoned (the
        // budget is over managed nodes; requestor-state nodes are not).
        let actual = nodes
            .iter()
            .filter(|n| n.marks.state.managed())
            .filter(|n| {
                n.unschedulable || !n.node_ready || n.marks.state == UpgradeState::CordonRequired
            })
            .count();
        let new_unavailable = plan
            .decisions
            .iter()
            .filter(|d| d.from == UpgradeState::UpgradeRequired && d.next == UpgradeState::CordonRequired)
            .filter(|d| {
                let n = by_name(&d.node);
                !n.unschedulable && n.node_ready
            })
            .count();
        prop_assert!(
            actual + new_unavailable <= c.max_unavailable.max(actual),
            "{:?}: {} unavailable, {} new", c, actual, new_unavailable
        );
        if p.max_parallel_upgrades > 0 {
            prop_assert!(new_unavailable as i64 <= (p.max_parallel_upgrades - c.in_progress as i64).max(0));
        }
        for d in &plan.decisions {
            // No node moves more than one state, and NotReady nodes never start.
            let n = nodes.iter().find(|n| n.name == d.node).unwrap();
            if d.from == UpgradeState::UpgradeRequired && !n.node_ready {
                prop_assert_eq!(d.next, UpgradeState::UpgradeRequired);
            }
            if d.from.at_rest() && n.driver_pod.in_sync() {
                prop_assert_eq!(d.next, d.from);
                prop_assert!(d.actions.is_empty());
            }
        }
    }

    #[test]
    fn in_sync_pod_goes_straight_to_validation(
        others in proptest::collection::vec((0usize..13, any::<bool>()), 0..8),
        safe_load in any::<bool>(),
    ) {
        let mut nodes: Vec<_> = others
            .iter()
            .enumerate()
            .map(|(i, (s, sync))| node(&format!("o{i}"), UpgradeState::ALL[*s], *sync))
            .collect();
        let mut target = node("target", UpgradeState::PodRestartRequired, true);
        target.unschedulable = true;
        target.marks.waiting_for_safe_load = safe_load;
        nodes.push(target);
        let plan = plan_pass(&nodes, &on(), 0, &PassOptions::default()).unwrap();
        let d = plan.decision("target").unwrap();
        prop_assert_eq!(d.next, UpgradeState::ValidationRequired);
        let restarts = has(d, |a| matches!(a, UpgradeAction::DeleteDriverPod { .. }));
        prop_assert!(!restarts, "driver pod restarted: {:?}", d);
        prop_assert_eq!(
            has(d, |a| matches!(a, UpgradeAction::RemoveAnnotation { key } if key == SAFE_LOAD_ANNOTATION)),
            safe_load
        );
    }
}

#[test]
fn every_node_annotation_of_the_flow_has_the_prefix() {
    for key in [
        SAFE_LOAD_ANNOTATION,
        INITIAL_STATE_ANNOTATION,
        WAIT_FOR_COMPLETION_START_ANNOTATION,
        VALIDATION_START_ANNOTATION,
        UPGRADE_REQUESTED_ANNOTATION,
        REQUESTOR_MODE_ANNOTATION,
        STATE_START_TIME_ANNOTATION,
    ] {
        assert!(key.starts_with(ANNOTATION_PREFIX), "{key}");
    }
}
