//! Kubernetes Events for decisions a person should see.
//!
//! A thin wrapper over kube's `Recorder`, which deduplicates repeats (same
//! object, reason and note) into a count on one Event instead of a new object
//! per reconcile. Events about cluster-scoped objects (the ClusterPolicy, Nodes)
//! land in the `default` namespace (the API server accepts new-style Events
//! about cluster-scoped objects only in `default` or `kube-system`), so the
//! operator needs event rights there only.
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
    use super::truncate;

    #[test]
    fn truncates_on_char_boundary() {
        assert_eq!(truncate("abc", 10), "abc");
        assert_eq!(truncate("abcdef", 3), "abc");
        // 'é' is two bytes; cutting at 2 would split it.
        assert_eq!(truncate("aé", 2), "a");
    }
}
