//! Telling a hand edit of an operator-owned object from the operator's own
//! write, so the edit can be put back.
//!
//! Each object has a spec version (the kube side picks it: a DaemonSet's
//! generation, another kind's resource version). The operator remembers the
//! version its cache showed before it applied an object and the one the
//! apply answered: the cache shows one of the two until someone else
//! changes the spec. An object the operator has not written since it
//! started counts as changed, so a new leader applies everything once (a
//! no-op where nothing differs).
use std::collections::{BTreeMap, BTreeSet};

/// The spec versions around the operator's writes, by object key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecVersions<K: Ord> {
    seen: BTreeMap<K, String>,
    written: BTreeMap<K, (Option<String>, String)>,
}

impl<K: Ord> Default for SpecVersions<K> {
    fn default() -> Self {
        Self {
            seen: BTreeMap::new(),
            written: BTreeMap::new(),
        }
    }
}

impl<K: Ord + Clone> SpecVersions<K> {
    /// The objects among `cached` (key, spec version) whose spec moved
    /// since the operator's last write, or that it never wrote; remembers
    /// what it saw for the next [`SpecVersions::applied`].
    pub fn drifted(&mut self, cached: impl IntoIterator<Item = (K, String)>) -> BTreeSet<K> {
        let mut out = BTreeSet::new();
        self.seen.clear();
        for (key, now) in cached {
            let ours = self
                .written
                .get(&key)
                .is_some_and(|(before, after)| *after == now || before.as_ref() == Some(&now));
            if !ours {
                out.insert(key.clone());
            }
            self.seen.insert(key, now);
        }
        out
    }

    /// The operator applied `key`, and the apply answered spec version `after`.
    pub fn applied(&mut self, key: K, after: String) {
        let before = self.seen.get(&key).cloned();
        self.written.insert(key, (before, after));
    }

    /// The operator deleted `key`.
    pub fn deleted(&mut self, key: &K) {
        self.written.remove(key);
        self.seen.remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drifted(
        v: &mut SpecVersions<&'static str>,
        cached: &[(&'static str, &str)],
    ) -> Vec<&'static str> {
        v.drifted(cached.iter().map(|(k, s)| (*k, s.to_string())))
            .into_iter()
            .collect()
    }

    #[test]
    fn only_a_spec_changed_by_someone_else_counts_as_drift() {
        let mut v = SpecVersions::default();
        // Never written since start: applied once.
        assert_eq!(drifted(&mut v, &[("ds", "g3"), ("cm", "7")]), ["cm", "ds"]);
        v.applied("ds", "g3".into());
        v.applied("cm", "7".into());
        assert!(drifted(&mut v, &[("ds", "g3"), ("cm", "7")]).is_empty());
        // The operator changes the spec; the cache still shows the old one.
        v.applied("ds", "g4".into());
        assert!(drifted(&mut v, &[("ds", "g3"), ("cm", "7")]).is_empty());
        assert!(drifted(&mut v, &[("ds", "g4"), ("cm", "7")]).is_empty());
        // Someone edits both: both drift until the operator writes them.
        assert_eq!(drifted(&mut v, &[("ds", "g5"), ("cm", "9")]), ["cm", "ds"]);
        v.applied("ds", "g6".into());
        v.applied("cm", "10".into());
        assert!(drifted(&mut v, &[("ds", "g6"), ("cm", "10")]).is_empty());
        // A deleted object is forgotten: recreated, it is applied again.
        v.deleted(&"cm");
        assert_eq!(drifted(&mut v, &[("cm", "11")]), ["cm"]);
    }

    proptest::proptest! {
        /// Right after the operator writes an object, neither the cached
        /// version it saw before nor the one it wrote counts as drift; any
        /// other version does.
        #[test]
        fn the_operators_own_versions_never_drift(before in 0u32..5, after in 0u32..5, other in 0u32..5) {
            let mut v = SpecVersions::default();
            let _ = v.drifted([("o", before.to_string())]);
            v.applied("o", after.to_string());
            proptest::prop_assert!(v.drifted([("o", before.to_string())]).is_empty());
            let mut v2 = v.clone();
            proptest::prop_assert!(v2.drifted([("o", after.to_string())]).is_empty());
            let moved = v.drifted([("o", other.to_string())]);
            proptest::prop_assert_eq!(moved.is_empty(), other == before || other == after);
        }
    }
}
