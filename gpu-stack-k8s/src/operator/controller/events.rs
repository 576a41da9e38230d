//! Kubernetes Events for decisions a person should see.
//!
//! A thin wrapper over kube's `Recorder`, which deduplicates repeats (same
//! object, reason and note) into a count on one Event instead of a new object
//! per reconcile. Events about cluster-scoped objects (the ClusterPolicy, Nodes)
//! land in the `default` namespace (the API server accepts new-style Events
//! about cluster-scoped objects only in `default` or `kube-system`), so the
//! operator needs event rights there only.
//!
//! [`Announced`] keeps a decision from being re-published on every pass while
//! its condition holds, and forgets it once a pass no longer reports it, so a
//! condition that clears and comes back is announced again.
use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

/// The field manager / reporting controller name of every gpu-stack operator write.
pub const CONTROLLER_NAME: &str = "gpu-stack-operator";

/// How serious an event is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Severity {
    /// Expected progress (e.g. a node paused by another agent).
    Normal,
    /// Something a person should act on (impossible driver, unsupported field).
    Warning,
}

/// One decision to publish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Normal or Warning.
    pub severity: Severity,
    /// CamelCase reason, e.g. `DriverRefused`.
    pub reason: String,
    /// Human-readable message.
    pub note: String,
    /// What the operator did, e.g. `Reconcile`.
    pub action: String,
}

/// Publishes [`Decision`]s as `events.k8s.io/v1` Events.
#[derive(Clone)]
pub struct EventPublisher {
    recorder: Recorder,
}

impl EventPublisher {
    /// Creates a publisher reporting as `instance` (the pod name).
    pub fn new(client: Client, instance: impl Into<String>) -> Self {
        let reporter = Reporter {
            controller: CONTROLLER_NAME.to_string(),
            instance: Some(instance.into()),
        };
        Self {
            recorder: Recorder::new(client, reporter),
        }
    }

    /// Publishes `decision` about the object `regarding`. Failures are logged
    /// and swallowed: an Event is a courtesy, never a reason to fail a reconcile.
    pub async fn publish(&self, regarding: &ObjectReference, decision: &Decision) {
        let event = Event {
            type_: match decision.severity {
                Severity::Normal => EventType::Normal,
                Severity::Warning => EventType::Warning,
            },
            reason: decision.reason.clone(),
            note: Some(truncate(&decision.note, 1024)),
            action: decision.action.clone(),
            secondary: None,
        };
        if let Err(error) = self.recorder.publish(&event, regarding).await {
            tracing::warn!(%error, reason = %decision.reason, "could not publish event");
        }
    }
}

/// Identity of an announced decision: the object (`Kind/name`), reason and note.
type AnnouncedKey = (String, String, String);

/// The decisions published while their condition still holds.
///
/// Only the latest pass's decisions are kept, so its size is bounded by what
/// one pass reports, and a decision missing from a pass is forgotten: when its
/// condition returns it is published again.
#[derive(Debug, Default)]
pub struct Announced {
    current: BTreeSet<AnnouncedKey>,
}

impl Announced {
    /// An empty set: every decision of the first pass is new.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes every decision of one pass and returns those not announced by
    /// the previous pass (each once, in order); the rest are forgotten.
    pub fn fresh(
        &mut self,
        all: Vec<(ObjectReference, Decision)>,
    ) -> Vec<(ObjectReference, Decision)> {
        let mut now = BTreeSet::new();
        let mut fresh = Vec::new();
        for (regarding, decision) in all {
            let key = key_of(&regarding, &decision);
            let first_in_pass = now.insert(key.clone());
            if first_in_pass && !self.current.contains(&key) {
                fresh.push((regarding, decision));
            }
        }
        self.current = now;
        fresh
    }

    /// Forgets everything, e.g. when the policy goes away.
    pub fn clear(&mut self) {
        self.current.clear();
    }

    /// How many decisions are held (those of the last pass).
    pub fn len(&self) -> usize {
        self.current.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.current.is_empty()
    }
}

fn key_of(regarding: &ObjectReference, decision: &Decision) -> AnnouncedKey {
    (
        format!(
            "{}/{}",
            regarding.kind.as_deref().unwrap_or_default(),
            regarding.name.as_deref().unwrap_or_default()
        ),
        decision.reason.clone(),
        decision.note.clone(),
    )
}

/// Events carry at most 1 KiB of note; cut on a character boundary.
fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str) -> ObjectReference {
        ObjectReference {
            kind: Some("Node".into()),
            name: Some(name.into()),
            ..ObjectReference::default()
        }
    }

    fn paused(node_name: &str) -> (ObjectReference, Decision) {
        (
            node(node_name),
            Decision {
                severity: Severity::Normal,
                reason: "OperandPaused".into(),
                note: "nvidia.com/gpu.deploy.driver=false: operand left alone".into(),
                action: "Reconcile".into(),
            },
        )
    }

    fn reasons(d: &[(ObjectReference, Decision)]) -> Vec<String> {
        d.iter()
            .map(|(r, d)| format!("{}:{}", r.name.as_deref().unwrap_or(""), d.reason))
            .collect()
    }

    #[test]
    fn a_condition_that_clears_and_returns_is_announced_again() {
        let mut seen = Announced::new();
        assert_eq!(reasons(&seen.fresh(vec![paused("a")])), ["a:OperandPaused"]);
        // Still present: a resync announces nothing.
        assert!(seen.fresh(vec![paused("a")]).is_empty());
        // Cleared for one pass: forgotten.
        assert!(seen.fresh(Vec::new()).is_empty());
        assert!(seen.is_empty());
        // Back: announced again, once.
        assert_eq!(reasons(&seen.fresh(vec![paused("a")])), ["a:OperandPaused"]);
        assert!(seen.fresh(vec![paused("a")]).is_empty());
    }

    #[test]
    fn only_new_decisions_are_announced_and_repeats_in_one_pass_count_once() {
        let mut seen = Announced::new();
        assert_eq!(
            reasons(&seen.fresh(vec![paused("a"), paused("a")])),
            ["a:OperandPaused"]
        );
        // `b` is new, `a` still holds; only `b` is announced.
        assert_eq!(
            reasons(&seen.fresh(vec![paused("a"), paused("b")])),
            ["b:OperandPaused"]
        );
        assert_eq!(seen.len(), 2);
        // A changed note is a different decision.
        let mut changed = paused("a");
        changed.1.note = "nvidia.com/gpu.deploy.driver=paused: operand left alone".into();
        assert_eq!(reasons(&seen.fresh(vec![changed])), ["a:OperandPaused"]);
        assert_eq!(seen.len(), 1, "only the last pass's decisions are held");
        seen.clear();
        assert_eq!(reasons(&seen.fresh(vec![paused("a")])), ["a:OperandPaused"]);
    }

    #[test]
    fn truncates_on_char_boundary() {
        assert_eq!(truncate("abc", 10), "abc");
        assert_eq!(truncate("abcdef", 3), "abc");
        // 'é' is two bytes; cutting at 2 would split it.
        assert_eq!(truncate("aé", 2), "a");
    }
}
