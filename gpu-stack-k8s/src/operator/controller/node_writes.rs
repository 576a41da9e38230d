//! The operator's own node writes, until the node watch shows them.
//!
//! Both the reconcile pass and the upgrade controller read nodes from the
//! watch cache ([`NodeStore`]) and patch them. A pass that read a node older
//! than its own last patch would decide again from stale labels: patch the
//! same labels twice or, in the upgrade flow, hand out an upgrade slot the
//! previous pass already gave. So each writer records the merge patch it
//! sent, and the next pass first waits (bounded) until the cached node
//! shows it. The check is on content, not resource versions: a cache that
//! lags moves through older versions (status heartbeats) before it reaches
//! the patch, and versions may not be ordered by clients.
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpu_stack_core::operator::upgrade::state::ANNOTATION_PREFIX;
use kube::runtime::reflector::ObjectRef;
use serde_json::Value;

use super::watches::{NodeStore, WatchedNode};

/// How often the node cache is checked while waiting for it to catch up.
const CATCH_UP_POLL: Duration = Duration::from_millis(20);

/// Nodes one writer patched whose change the node watch has not delivered
/// yet, each with what its patch set.
#[derive(Clone)]
pub struct NodeWriteFence {
    nodes: NodeStore,
    unseen: Arc<Mutex<Unseen>>,
}

/// The recorded patches, and the strings they share.
#[derive(Default)]
struct Unseen {
    nodes: HashMap<String, Expected>,
    /// Keys and values of the patches: a large first pass patches every
    /// node with the same dozen labels. Emptied with `nodes`, so it holds
    /// no more than the patches in flight.
    strings: HashSet<Arc<str>>,
}

/// A label or annotation a patch sets (`Some`) or removes (`None`).
type Entry = (Arc<str>, Option<Arc<str>>);

/// What a merge patch set that the node cache keeps: its labels, its
/// annotations of the upgrade flow (the only ones the cache keeps) and
/// `spec.unschedulable`.
#[derive(Debug, Default)]
struct Expected {
    labels: Vec<Entry>,
    annotations: Vec<Entry>,
    unschedulable: Option<bool>,
}

fn intern(strings: &mut HashSet<Arc<str>>, s: &str) -> Arc<str> {
    if let Some(shared) = strings.get(s) {
        return shared.clone();
    }
    let shared: Arc<str> = Arc::from(s);
    strings.insert(shared.clone());
    shared
}

impl Expected {
    fn of(patch: &Value, strings: &mut HashSet<Arc<str>>) -> Self {
        let mut entries = |field: &str, kept: fn(&str) -> bool| -> Vec<Entry> {
            patch["metadata"][field]
                .as_object()
                .into_iter()
                .flatten()
                .filter(|(k, _)| kept(k))
                .map(|(k, v)| (intern(strings, k), v.as_str().map(|v| intern(strings, v))))
                .collect()
        };
        Expected {
            labels: entries("labels", |_| true),
            annotations: entries("annotations", |k| k.starts_with(ANNOTATION_PREFIX)),
            unschedulable: patch["spec"]["unschedulable"].as_bool(),
        }
    }

    fn shown_by(&self, node: &WatchedNode) -> bool {
        let meta = &node.metadata;
        let matches = |map: Option<&BTreeMap<String, String>>, wanted: &[Entry]| {
            wanted
                .iter()
                .all(|(k, v)| map.and_then(|m| m.get(&**k)).map(String::as_str) == v.as_deref())
        };
        matches(meta.labels.as_ref(), &self.labels)
            && matches(meta.annotations.as_ref(), &self.annotations)
            && self.unschedulable.is_none_or(|u| u == node.unschedulable)
    }
}

/// Whether `node` shows a merge `patch` of its labels, its annotations of
/// the upgrade flow (the only ones the cache keeps) and
/// `spec.unschedulable`: what the operator writes and reads back.
pub fn shows(node: &WatchedNode, patch: &Value) -> bool {
    Expected::of(patch, &mut HashSet::new()).shown_by(node)
}

impl NodeWriteFence {
    /// A fence over the shared node cache.
    pub fn new(nodes: NodeStore) -> Self {
        Self {
            nodes,
            unseen: Arc::default(),
        }
    }

    /// Records a merge patch of `node` the API server accepted.
    pub fn wrote(&self, node: &str, patch: &Value) {
        if let Ok(mut unseen) = self.unseen.lock() {
            let expected = Expected::of(patch, &mut unseen.strings);
            unseen.nodes.insert(node.to_string(), expected);
        }
    }

    /// Waits at most `limit` until the node cache shows every recorded patch
    /// (or the node is gone). Returns how many were still unseen when the
    /// wait gave up (then forgotten, so one lost event or someone else's
    /// later change cannot stall every later pass), and says so in a
    /// warning naming `writer`.
    pub async fn catch_up(&self, limit: Duration, writer: &str) -> usize {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let pending = match self.unseen.lock() {
                Ok(mut unseen) => {
                    unseen.nodes.retain(|node, expected| {
                        self.nodes
                            .get(&ObjectRef::new(node))
                            .is_some_and(|n| !expected.shown_by(&n))
                    });
                    if unseen.nodes.is_empty() {
                        unseen.strings = HashSet::new();
                    }
                    unseen.nodes.len()
                }
                Err(_) => 0,
            };
            if pending == 0 {
                return 0;
            }
            if tokio::time::Instant::now() >= deadline {
                if let Ok(mut unseen) = self.unseen.lock() {
                    *unseen = Unseen::default();
                }
                tracing::warn!(
                    nodes = pending,
                    writer,
                    "the node watch has not shown these node writes after {}s; reading the \
                     node cache as it is",
                    limit.as_secs()
                );
                return pending;
            }
            tokio::time::sleep(CATCH_UP_POLL).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_stack_core::operator::upgrade::state::SAFE_LOAD_ANNOTATION;
    use kube::runtime::reflector::{self, store::Writer};
    use kube::runtime::watcher::Event;
    use serde_json::json;

    fn node(name: &str, version: &str) -> WatchedNode {
        let mut n = WatchedNode::default();
        n.metadata.name = Some(name.into());
        n.metadata.resource_version = Some(version.into());
        n
    }

    fn cache(nodes: &[WatchedNode]) -> (NodeStore, Writer<WatchedNode>) {
        let (store, mut writer) = reflector::store();
        writer.apply_watcher_event(&Event::Init);
        for n in nodes {
            writer.apply_watcher_event(&Event::InitApply(n.clone()));
        }
        writer.apply_watcher_event(&Event::InitDone);
        (store, writer)
    }

    #[tokio::test]
    async fn a_write_is_pending_until_the_cached_node_shows_it() {
        let (store, mut writer) = cache(&[node("a", "1"), node("b", "1")]);
        let fence = NodeWriteFence::new(store);
        let cordon = json!({
            "metadata": {"labels": {"s": "cordon-required"}},
            "spec": {"unschedulable": true},
        });
        fence.wrote("a", &cordon);
        // A patch the cache already shows: nothing to wait for.
        fence.wrote("b", &json!({"metadata": {"labels": {"gone": null}}}));
        assert_eq!(fence.catch_up(Duration::ZERO, "test").await, 1);
        // Given up: forgotten, the next pass does not wait again.
        assert_eq!(fence.catch_up(Duration::ZERO, "test").await, 0);

        fence.wrote("a", &cordon);
        // An older change (a heartbeat) moves the version, not the content.
        writer.apply_watcher_event(&Event::Apply(node("a", "2")));
        assert_eq!(fence.catch_up(Duration::ZERO, "test").await, 1);
        fence.wrote("a", &cordon);
        let mut patched = node("a", "3");
        patched.metadata.labels = Some([("s".to_string(), "cordon-required".to_string())].into());
        patched.unschedulable = true;
        writer.apply_watcher_event(&Event::Apply(patched));
        assert_eq!(fence.catch_up(Duration::from_secs(1), "test").await, 0);
    }

    #[test]
    fn shows_reads_labels_upgrade_annotations_and_unschedulable() {
        let mut n = node("a", "1");
        n.metadata.labels = Some([("l".to_string(), "v".to_string())].into());
        let safe_load = SAFE_LOAD_ANNOTATION;
        assert!(shows(
            &n,
            &json!({"metadata": {"labels": {"l": "v", "x": null}}})
        ));
        assert!(!shows(&n, &json!({"metadata": {"labels": {"l": null}}})));
        assert!(!shows(
            &n,
            &json!({"metadata": {"annotations": {safe_load: "true"}}})
        ));
        // Other annotations are not cached, so not waited for.
        assert!(shows(
            &n,
            &json!({"metadata": {"annotations": {"other": "1"}}})
        ));
        assert!(shows(&n, &json!({"spec": {"unschedulable": false}})));
        assert!(!shows(&n, &json!({"spec": {"unschedulable": true}})));
    }
}
