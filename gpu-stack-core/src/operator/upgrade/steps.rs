//! The step of each upgrade state: from what the pass observed of a node,
//! the state it moves to and the actions that take it there. The
//! transitions are drawn in [`super::state`]; [`super::pass::plan_pass`]
//! runs one step per node.
use super::pass::{
    EvictionPurpose, NodeObservation, PassOptions, PodRef, UpgradeAction, UpgradeCounts,
    ValidatorStatus,
};
use super::policy::UpgradePolicy;
use super::state::{
    DRIVER_POD_FAILING_RESTARTS, INITIAL_STATE_ANNOTATION, SAFE_LOAD_ANNOTATION, SKIP_LABEL,
    UPGRADE_REQUESTED_ANNOTATION, UpgradeState, VALIDATION_START_ANNOTATION,
    VALIDATION_TIMEOUT_SECONDS, VALIDATOR_POD_SELECTOR, WAIT_FOR_COMPLETION_START_ANNOTATION,
};

pub(super) struct Step {
    pub(super) next: UpgradeState,
    pub(super) actions: Vec<UpgradeAction>,
    pub(super) reason: String,
}

impl Step {
    pub(super) fn to(next: UpgradeState, reason: impl Into<String>) -> Step {
        Step {
            next,
            actions: Vec::new(),
            reason: reason.into(),
        }
    }
    pub(super) fn with(mut self, a: UpgradeAction) -> Step {
        self.actions.push(a);
        self
    }
}

pub(super) fn remove(key: &str) -> UpgradeAction {
    UpgradeAction::RemoveAnnotation {
        key: key.to_string(),
    }
}

pub(super) fn set(key: &str, value: String) -> UpgradeAction {
    UpgradeAction::SetAnnotation {
        key: key.to_string(),
        value,
    }
}

fn pod_list(pods: &[PodRef]) -> String {
    const SHOWN: usize = 3;
    let mut s: Vec<String> = pods.iter().take(SHOWN).map(ToString::to_string).collect();
    if pods.len() > SHOWN {
        s.push(format!("and {} more", pods.len() - SHOWN));
    }
    s.join(", ")
}

/// Why `kubectl drain` would refuse to delete a pod, if it would.
fn refusal(pod: &PodRef, force: bool, delete_empty_dir: bool, field: &str) -> Option<String> {
    if pod.empty_dir && !delete_empty_dir {
        Some(format!(
            "{pod} uses emptyDir (set {field}.deleteEmptyDir to delete it)"
        ))
    } else if !pod.controlled && !pod.daemon_set && !force {
        Some(format!(
            "{pod} has no controller (set {field}.force to delete it)"
        ))
    } else {
        None
    }
}

fn timed_out(since: Option<u64>, timeout: i64, now: u64) -> bool {
    match (since, u64::try_from(timeout)) {
        (Some(start), Ok(t)) if t > 0 => now > start.saturating_add(t),
        _ => false,
    }
}

/// The end of a successful upgrade: uncordon, or leave a node that was
/// cordoned before the upgrade as it was (NVIDIA's `updateNodeToUncordonOrDoneState`).
fn uncordon_or_done(n: &NodeObservation, reason: &str) -> Step {
    if n.marks.initially_unschedulable {
        Step::to(
            UpgradeState::Done,
            format!("{reason}; the node was cordoned before the upgrade, so it stays cordoned"),
        )
        .with(remove(INITIAL_STATE_ANNOTATION))
    } else {
        Step::to(UpgradeState::UncordonRequired, reason.to_string())
    }
}

pub(super) fn needs_upgrade(n: &NodeObservation) -> Option<String> {
    let pod = &n.driver_pod;
    if pod.daemonset_revision.is_some() && !pod.in_sync() {
        Some(format!(
            "driver pod {} runs revision {} but its DaemonSet is at {}",
            pod.name,
            pod.revision,
            pod.daemonset_revision.as_deref().unwrap_or("")
        ))
    } else if n.marks.waiting_for_safe_load {
        Some("the driver pod waits for a safe load".into())
    } else if n.marks.upgrade_requested {
        Some("an upgrade was requested".into())
    } else {
        None
    }
}

pub(super) fn step_done_or_unknown(n: &NodeObservation) -> Step {
    if let Some(why) = needs_upgrade(n) {
        let mut s = Step::to(UpgradeState::UpgradeRequired, why);
        if n.unschedulable && !n.marks.initially_unschedulable {
            s = s.with(set(INITIAL_STATE_ANNOTATION, "true".into()));
        }
        return s;
    }
    // A node whose driver never needed an upgrade keeps no label: `""` and
    // `upgrade-done` mean the same to NVIDIA's operator (its ClusterPolicy
    // readiness accepts both) and to this flow, and labelling every node
    // once would cost one more write per node of a fleet for nothing.
    Step::to(n.marks.state, "the driver pod is up to date")
}

pub(super) fn step_upgrade_required(
    n: &NodeObservation,
    available: &mut i64,
    c: &UpgradeCounts,
) -> Step {
    let mut pre = Vec::new();
    if n.marks.upgrade_requested {
        pre.push(remove(UPGRADE_REQUESTED_ANNOTATION));
    }
    let mut s = if n.marks.skip {
        Step::to(
            UpgradeState::UpgradeRequired,
            format!("the node is labelled {SKIP_LABEL}=true"),
        )
    } else if !n.node_ready {
        Step::to(
            UpgradeState::UpgradeRequired,
            "the node is NotReady; its upgrade starts once it is Ready",
        )
    } else if *available <= 0 && !n.unschedulable {
        Step::to(
            UpgradeState::UpgradeRequired,
            format!(
                "waiting for an upgrade slot: {} in progress, {} of at most {} nodes unavailable",
                c.in_progress, c.unavailable, c.max_unavailable
            ),
        )
    } else {
        *available -= 1;
        Step::to(UpgradeState::CordonRequired, "upgrade slot taken")
    };
    pre.append(&mut s.actions);
    s.actions = pre;
    s
}

pub(super) fn step_wait_for_jobs(
    n: &NodeObservation,
    policy: &UpgradePolicy,
    opts: &PassOptions,
    now: u64,
) -> Step {
    let wfc = &policy.wait_for_completion;
    if wfc.pod_selector.trim().is_empty() {
        let next = if opts.pod_deletion {
            UpgradeState::PodDeletionRequired
        } else {
            UpgradeState::DrainRequired
        };
        return Step::to(
            next,
            "no waitForCompletion.podSelector; nothing to wait for",
        );
    }
    let since = n.marks.wait_for_completion_since;
    let done = |reason: &str| {
        let s = Step::to(UpgradeState::PodDeletionRequired, reason.to_string());
        if n.marks.wait_for_completion_since.is_some() {
            s.with(remove(WAIT_FOR_COMPLETION_START_ANNOTATION))
        } else {
            s
        }
    };
    if n.wait_pods.is_empty() {
        return done("the pods matching waitForCompletion.podSelector have finished");
    }
    if timed_out(since, wfc.timeout_seconds, now) {
        return done(&format!(
            "waited more than {} s for {}; deleting GPU pods anyway",
            wfc.timeout_seconds,
            pod_list(&n.wait_pods)
        ));
    }
    let s = Step::to(
        UpgradeState::WaitForJobsRequired,
        format!(
            "waiting for {} to finish ({})",
            pod_list(&n.wait_pods),
            wfc.pod_selector
        ),
    );
    if since.is_none() {
        s.with(set(WAIT_FOR_COMPLETION_START_ANNOTATION, now.to_string()))
    } else {
        s
    }
}

pub(super) fn step_pod_deletion(
    n: &NodeObservation,
    policy: &UpgradePolicy,
    opts: &PassOptions,
    now: u64,
) -> Step {
    if !opts.pod_deletion {
        return Step::to(UpgradeState::DrainRequired, "pod deletion is not enabled");
    }
    let pd = &policy.pod_deletion;
    if n.gpu_pods.is_empty() {
        return Step::to(
            UpgradeState::PodRestartRequired,
            "no GPU pods left on the node",
        );
    }
    let fallback = if policy.drain.enable {
        UpgradeState::DrainRequired
    } else {
        UpgradeState::Failed
    };
    let then = if policy.drain.enable {
        "draining the node instead"
    } else {
        "the upgrade failed (enable drain to fall back to it)"
    };
    let refused: Vec<String> = n
        .gpu_pods
        .iter()
        .filter_map(|p| {
            if p.daemon_set {
                Some(format!("{p} belongs to a DaemonSet"))
            } else {
                refusal(p, pd.force, pd.delete_empty_dir, "podDeletion")
            }
        })
        .collect();
    if !refused.is_empty() {
        return Step::to(
            fallback,
            format!("cannot delete GPU pods: {}; {then}", refused.join("; ")),
        );
    }
    if timed_out(n.marks.current_state_since(), pd.timeout_seconds, now) {
        return Step::to(
            fallback,
            format!(
                "GPU pods still present after {} s: {}; {then}",
                pd.timeout_seconds,
                pod_list(&n.gpu_pods)
            ),
        );
    }
    Step::to(
        UpgradeState::PodDeletionRequired,
        format!("deleting GPU pods {}", pod_list(&n.gpu_pods)),
    )
    .with(UpgradeAction::Evict {
        purpose: EvictionPurpose::PodDeletion,
        pods: n.gpu_pods.clone(),
    })
}

pub(super) fn step_drain(n: &NodeObservation, policy: &UpgradePolicy, now: u64) -> Step {
    let dr = &policy.drain;
    if !dr.enable {
        return Step::to(
            UpgradeState::PodRestartRequired,
            "drain is disabled by the policy",
        );
    }
    let cordon = (!n.unschedulable).then_some(UpgradeAction::Cordon);
    let with_cordon = |mut s: Step| {
        if let Some(c) = cordon.clone() {
            s.actions.insert(0, c);
        }
        s
    };
    let pods: Vec<PodRef> = n
        .drain_pods
        .iter()
        .filter(|p| !p.daemon_set)
        .cloned()
        .collect();
    if pods.is_empty() {
        return with_cordon(Step::to(
            UpgradeState::PodRestartRequired,
            "the node is drained",
        ));
    }
    let refused: Vec<String> = pods
        .iter()
        .filter_map(|p| refusal(p, dr.force, dr.delete_empty_dir, "drain"))
        .collect();
    if !refused.is_empty() {
        return with_cordon(Step::to(
            UpgradeState::Failed,
            format!("cannot drain the node: {}", refused.join("; ")),
        ));
    }
    if timed_out(n.marks.current_state_since(), dr.timeout_seconds, now) {
        return with_cordon(Step::to(
            UpgradeState::Failed,
            format!(
                "drain did not finish within {} s: {} remain",
                dr.timeout_seconds,
                pod_list(&pods)
            ),
        ));
    }
    with_cordon(
        Step::to(
            UpgradeState::DrainRequired,
            format!("draining {}", pod_list(&pods)),
        )
        .with(UpgradeAction::Evict {
            purpose: EvictionPurpose::Drain,
            pods,
        }),
    )
}

fn unblock_safe_load(n: &NodeObservation, s: Step) -> Step {
    if n.marks.waiting_for_safe_load {
        let mut s = s;
        s.actions.insert(0, remove(SAFE_LOAD_ANNOTATION));
        s
    } else {
        s
    }
}

pub(super) fn step_pod_restart(n: &NodeObservation, opts: &PassOptions) -> Step {
    let pod = &n.driver_pod;
    if !pod.in_sync() {
        let s = Step::to(
            UpgradeState::PodRestartRequired,
            format!("replacing driver pod {} with the new revision", pod.name),
        );
        return if pod.terminating {
            Step {
                reason: format!("waiting for driver pod {} to terminate", pod.name),
                ..s
            }
        } else {
            s.with(UpgradeAction::DeleteDriverPod {
                namespace: pod.namespace.clone(),
                name: pod.name.clone(),
            })
        };
    }
    let s = if pod.ready {
        if opts.validation {
            Step::to(
                UpgradeState::ValidationRequired,
                "the new driver pod is Ready",
            )
        } else {
            uncordon_or_done(n, "the new driver pod is Ready")
        }
    } else if pod.failing {
        Step::to(
            UpgradeState::Failed,
            format!(
                "driver pod {} keeps restarting (more than {DRIVER_POD_FAILING_RESTARTS} restarts)",
                pod.name
            ),
        )
    } else {
        Step::to(
            UpgradeState::PodRestartRequired,
            format!("waiting for driver pod {} to be Ready", pod.name),
        )
    };
    unblock_safe_load(n, s)
}

pub(super) fn step_failed(n: &NodeObservation) -> Step {
    if n.driver_pod.in_sync_and_ready() {
        uncordon_or_done(n, "the driver pod is now in sync and Ready")
    } else {
        Step::to(
            UpgradeState::Failed,
            format!(
                "upgrade failed; recovers once driver pod {} is at the new revision and Ready",
                n.driver_pod.name
            ),
        )
    }
}

pub(super) fn step_validation(n: &NodeObservation, opts: &PassOptions, now: u64) -> Step {
    let since = n.marks.validation_since;
    let s = match (opts.validation, n.validator) {
        (false, _) | (true, ValidatorStatus::Ready) => {
            let s = uncordon_or_done(n, "the validator passed on the new driver");
            if since.is_some() {
                s.with(remove(VALIDATION_START_ANNOTATION))
            } else {
                s
            }
        }
        (true, ValidatorStatus::Absent) => Step::to(
            UpgradeState::ValidationRequired,
            format!("waiting for a validator pod ({VALIDATOR_POD_SELECTOR}) on the node"),
        ),
        (true, ValidatorStatus::NotReady) => match since {
            None => Step::to(
                UpgradeState::ValidationRequired,
                "waiting for the validator to be Ready",
            )
            .with(set(VALIDATION_START_ANNOTATION, now.to_string())),
            Some(start) if now > start.saturating_add(VALIDATION_TIMEOUT_SECONDS) => Step::to(
                UpgradeState::Failed,
                format!("the validator was not Ready within {VALIDATION_TIMEOUT_SECONDS} s"),
            )
            .with(remove(VALIDATION_START_ANNOTATION)),
            Some(_) => Step::to(
                UpgradeState::ValidationRequired,
                "waiting for the validator to be Ready",
            ),
        },
    };
    unblock_safe_load(n, s)
}
