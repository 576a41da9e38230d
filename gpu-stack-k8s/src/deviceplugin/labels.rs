//! Publishing GFD labels on the Node object: which `nvidia.com/` labels to set
//! and which stale ones to remove, as a merge patch for the kube client.

use std::collections::BTreeMap;

use gpu_stack_core::gfd::Labels;

/// Label key prefixes GFD owns; a label under them that GFD no longer computes
/// is removed. Labels other components write (`gpu.present`, `gpu.deploy.*`,
/// `mig.config*`, `device-plugin.config`) are left alone.
pub const OWNED_PREFIXES: [&str; 9] = [
    "nvidia.com/gpu.product",
    "nvidia.com/gpu.count",
    "nvidia.com/gpu.replicas",
    "nvidia.com/gpu.sharing-strategy",
    "nvidia.com/gpu.memory",
    "nvidia.com/gpu.family",
    "nvidia.com/gpu.compute.",
    "nvidia.com/cuda.",
    "nvidia.com/mig-",
];

const OWNED_KEYS: [&str; 12] = [
    "nvidia.com/gpu.machine",
    "nvidia.com/gpu.multiprocessors",
    "nvidia.com/gpu.slices.gi",
    "nvidia.com/gpu.slices.ci",
    "nvidia.com/gpu.engines.copy",
    "nvidia.com/gpu.engines.decoder",
    "nvidia.com/gpu.engines.encoder",
    "nvidia.com/gpu.engines.jpeg",
    "nvidia.com/gpu.engines.ofa",
    "nvidia.com/gfd.timestamp",
    "nvidia.com/mig.capable",
    "nvidia.com/mig.strategy",
];

fn owned(key: &str) -> bool {
    key == "nvidia.com/mps.capable"
        || OWNED_KEYS.contains(&key)
        || OWNED_PREFIXES.iter().any(|p| key.starts_with(p))
}

/// The label changes that bring `current` to `desired`: `Some(v)` sets,
/// `None` removes. Unchanged labels are left out.
pub fn label_changes(
    current: &BTreeMap<String, String>,
    desired: &Labels,
) -> BTreeMap<String, Option<String>> {
    let mut out = BTreeMap::new();
    for (k, v) in desired {
        if current.get(k) != Some(v) {
            out.insert(k.clone(), Some(v.clone()));
        }
    }
    for k in current.keys() {
        if owned(k) && !desired.contains_key(k) {
            out.insert(k.clone(), None);
        }
    }
    out
}

/// The JSON merge patch for the Node (`metadata.labels`, `null` removes).
pub fn merge_patch(changes: &BTreeMap<String, Option<String>>) -> serde_json::Value {
    serde_json::json!({ "metadata": { "labels": changes } })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_owned_labels_are_removed_others_kept() {
        let current: BTreeMap<String, String> = [
            ("nvidia.com/gpu.product", "A"),
            ("nvidia.com/mig-1g.5gb.count", "7"),
            ("nvidia.com/gpu.present", "true"),
            ("nvidia.com/gpu.count", "8"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let desired: Labels = [
            ("nvidia.com/gpu.product", "B"),
            ("nvidia.com/gpu.count", "8"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let c = label_changes(&current, &desired);
        assert_eq!(c.len(), 2);
        assert_eq!(c["nvidia.com/gpu.product"], Some("B".into()));
        assert_eq!(c["nvidia.com/mig-1g.5gb.count"], None);
        let p = merge_patch(&c);
        assert!(p["metadata"]["labels"]["nvidia.com/mig-1g.5gb.count"].is_null());
    }
}
