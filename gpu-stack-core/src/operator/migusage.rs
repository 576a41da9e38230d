//! What a node's MIG manager publishes for demand-driven MIG: each GPU's
//! current layout and which of its instances are in use, as one node
//! annotation of bounded size ([`MIG_USAGE_ANNOTATION`]). The operator reads
//! it from the node objects it already watches instead of listing every pod
//! of the cluster.
//!
//! The value is one line: `v1`, then per GPU
//! `;<index>,<model>,<on|off>` and its instances `,<profile>@<start>`, an
//! instance in use marked with a trailing `*`:
//!
//! ```
//! use gpu_stack_core::operator::migusage::{GpuUsage, NodeUsage, decode, encode};
//!
//! let usage = NodeUsage {
//!     gpus: vec![GpuUsage {
//!         index: 0,
//!         model: "H100-SXM5-80GB".into(),
//!         mig_enabled: true,
//!         layout: vec!["3g.40gb@4".parse().unwrap(), "1g.10gb@0".parse().unwrap()],
//!         in_use: vec!["1g.10gb@0".parse().unwrap()],
//!     }],
//! };
//! let text = encode(&usage).unwrap();
//! assert_eq!(text, "v1;0,H100-SXM5-80GB,on,1g.10gb@0*,3g.40gb@4");
//! assert_eq!(decode(&text).unwrap(), usage.normalized());
//! ```
//!
//! Which instances are in use comes from the node itself: instances with
//! processes on them, and, per profile, as many more instances as the pods
//! bound to the node request ([`mark_in_use`]; without the kubelet's
//! allocations the manager knows how many instances of a profile pods hold,
//! not which, so it marks that many, lowest GPU and start first).
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::mig::{Demand, MigProfileName, PlacedInstance};

/// Node annotation holding the encoded [`NodeUsage`].
pub const MIG_USAGE_ANNOTATION: &str = "gpustack.io/mig-usage";

/// Longest encoded value (bytes); a node with more to say publishes nothing
/// and demand mode leaves it alone.
pub const MAX_USAGE_BYTES: usize = 8192;

/// Most GPUs one node may publish.
pub const MAX_GPUS: usize = 32;

/// Most instances one GPU may list (a GPU holds at most 7 GPU instances
/// today; the bound leaves room).
pub const MAX_INSTANCES: usize = 16;

/// Longest model name.
pub const MAX_MODEL: usize = 64;

/// One GPU of a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuUsage {
    /// GPU index on the node.
    pub index: u32,
    /// Catalog model name (`H100-SXM5-80GB`).
    pub model: String,
    /// MIG mode on.
    pub mig_enabled: bool,
    /// The GPU instances present.
    pub layout: Vec<PlacedInstance>,
    /// Those of them in use (a subset of `layout`).
    pub in_use: Vec<PlacedInstance>,
}

/// Every GPU of a node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeUsage {
    /// GPUs, in index order once normalized.
    pub gpus: Vec<GpuUsage>,
}

/// Why a value cannot be written or read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UsageError {
    /// More bytes than [`MAX_USAGE_BYTES`].
    #[error(
        "the {MIG_USAGE_ANNOTATION} value is {len} bytes, more than {MAX_USAGE_BYTES}; the node is left out of demand-driven MIG"
    )]
    TooLarge {
        /// Its length.
        len: usize,
    },
    /// More GPUs than [`MAX_GPUS`], or instances than [`MAX_INSTANCES`].
    #[error(
        "the {MIG_USAGE_ANNOTATION} value lists {count} {what}, more than {max}; the node is left out of demand-driven MIG"
    )]
    TooMany {
        /// What there are too many of.
        what: &'static str,
        /// How many.
        count: usize,
        /// The bound.
        max: usize,
    },
    /// Not a version this code reads.
    #[error(
        "the {MIG_USAGE_ANNOTATION} value starts with {found:?}, not v1; run MIG managers and an operator of one release"
    )]
    Version {
        /// What it starts with (capped).
        found: String,
    },
    /// A GPU's part does not parse.
    #[error("the {MIG_USAGE_ANNOTATION} value, GPU part {part}: {detail}")]
    Malformed {
        /// Part number (0 is the first GPU).
        part: usize,
        /// What is wrong.
        detail: String,
    },
    /// An in-use instance that is not in the layout.
    #[error("GPU {gpu}: instance {instance} is marked in use but is not in the layout")]
    InUseNotInLayout {
        /// GPU index.
        gpu: u32,
        /// The instance.
        instance: String,
    },
}

fn sorted(v: &[PlacedInstance]) -> Vec<PlacedInstance> {
    let mut v = v.to_vec();
    v.sort_by(|a, b| {
        a.start
            .cmp(&b.start)
            .then_with(|| a.profile.to_string().cmp(&b.profile.to_string()))
    });
    v.dedup();
    v
}

impl NodeUsage {
    /// GPUs by index, instances by start, duplicates dropped: the form
    /// [`decode`] returns.
    pub fn normalized(&self) -> NodeUsage {
        let mut gpus: Vec<GpuUsage> = self
            .gpus
            .iter()
            .map(|g| GpuUsage {
                layout: sorted(&g.layout),
                in_use: sorted(&g.in_use),
                ..g.clone()
            })
            .collect();
        gpus.sort_by_key(|g| g.index);
        NodeUsage { gpus }
    }

    /// Instances in use, per profile, over every GPU.
    pub fn in_use_counts(&self) -> Demand {
        let mut out: Demand = Vec::new();
        for i in self.gpus.iter().flat_map(|g| &g.in_use) {
            match out.iter_mut().find(|(p, _)| *p == i.profile) {
                Some((_, n)) => *n = n.saturating_add(1),
                None => out.push((i.profile.clone(), 1)),
            }
        }
        out.sort_by_key(|(p, _)| p.to_string());
        out
    }
}

/// Encodes `usage` as the annotation value.
pub fn encode(usage: &NodeUsage) -> Result<String, UsageError> {
    let usage = usage.normalized();
    if usage.gpus.len() > MAX_GPUS {
        return Err(UsageError::TooMany {
            what: "GPUs",
            count: usage.gpus.len(),
            max: MAX_GPUS,
        });
    }
    let mut out = String::from("v1");
    for (part, g) in usage.gpus.iter().enumerate() {
        if g.model.is_empty()
            || g.model.len() > MAX_MODEL
            || !g
                .model
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(UsageError::Malformed {
                part,
                detail: format!(
                    "model {:?} must be 1 to {MAX_MODEL} letters, digits, '-', '_' or '.'",
                    g.model.chars().take(80).collect::<String>()
                ),
            });
        }
        if g.layout.len() > MAX_INSTANCES {
            return Err(UsageError::TooMany {
                what: "instances on one GPU",
                count: g.layout.len(),
                max: MAX_INSTANCES,
            });
        }
        if let Some(i) = g.in_use.iter().find(|i| !g.layout.contains(i)) {
            return Err(UsageError::InUseNotInLayout {
                gpu: g.index,
                instance: i.to_string(),
            });
        }
        let mode = if g.mig_enabled { "on" } else { "off" };
        let _ = write!(out, ";{},{},{mode}", g.index, g.model);
        for i in &g.layout {
            let mark = if g.in_use.contains(i) { "*" } else { "" };
            let _ = write!(out, ",{i}{mark}");
        }
    }
    if out.len() > MAX_USAGE_BYTES {
        return Err(UsageError::TooLarge { len: out.len() });
    }
    Ok(out)
}

/// Reads an annotation value written by [`encode`].
pub fn decode(text: &str) -> Result<NodeUsage, UsageError> {
    if text.len() > MAX_USAGE_BYTES {
        return Err(UsageError::TooLarge { len: text.len() });
    }
    let mut parts = text.split(';');
    let version = parts.next().unwrap_or_default();
    if version != "v1" {
        return Err(UsageError::Version {
            found: version.chars().take(16).collect(),
        });
    }
    let mut gpus = Vec::new();
    for (part, gpu) in parts.enumerate() {
        if part >= MAX_GPUS {
            return Err(UsageError::TooMany {
                what: "GPUs",
                count: part + 1,
                max: MAX_GPUS,
            });
        }
        let bad = |detail: String| UsageError::Malformed { part, detail };
        let mut fields = gpu.split(',');
        let index: u32 = fields
            .next()
            .unwrap_or_default()
            .parse()
            .map_err(|_| bad("the GPU index is not a number".into()))?;
        let model = fields.next().unwrap_or_default();
        if model.is_empty() || model.len() > MAX_MODEL {
            return Err(bad("the model is missing or too long".into()));
        }
        let mig_enabled = match fields.next() {
            Some("on") => true,
            Some("off") => false,
            other => {
                return Err(bad(format!(
                    "the MIG mode is {:?}, not on or off",
                    other
                        .unwrap_or_default()
                        .chars()
                        .take(16)
                        .collect::<String>()
                )));
            }
        };
        let mut layout = Vec::new();
        let mut in_use = Vec::new();
        for f in fields {
            if layout.len() >= MAX_INSTANCES {
                return Err(UsageError::TooMany {
                    what: "instances on one GPU",
                    count: layout.len() + 1,
                    max: MAX_INSTANCES,
                });
            }
            let (name, used) = match f.strip_suffix('*') {
                Some(n) => (n, true),
                None => (f, false),
            };
            let i: PlacedInstance = name.parse().map_err(|e| bad(format!("{e}")))?;
            if used {
                in_use.push(i.clone());
            }
            layout.push(i);
        }
        gpus.push(GpuUsage {
            index,
            model: model.to_string(),
            mig_enabled,
            layout,
            in_use,
        });
    }
    Ok(NodeUsage { gpus }.normalized())
}

/// Marks instances in use for the MIG instances the node's pods request
/// (`requested`, per profile): instances already marked (processes run on
/// them) count first, then further idle instances of the profile are marked,
/// lowest GPU index and start first, until the count is reached or none is
/// left. Never unmarks anything.
pub fn mark_in_use(usage: &mut NodeUsage, requested: &Demand) {
    *usage = usage.normalized();
    for (profile, want) in requested {
        let mut have: u32 = u32::try_from(
            usage
                .gpus
                .iter()
                .flat_map(|g| &g.in_use)
                .filter(|i| i.profile == *profile)
                .count(),
        )
        .unwrap_or(u32::MAX);
        for g in &mut usage.gpus {
            for i in &g.layout {
                if have >= *want {
                    break;
                }
                if i.profile == *profile && !g.in_use.contains(i) {
                    g.in_use.push(i.clone());
                    have += 1;
                }
            }
        }
    }
    *usage = usage.normalized();
}

/// The first profile of which a layout (`after`, every instance a node
/// would hold) keeps fewer instances than the node's pods use (`in_use`):
/// `(profile, kept, used)`. The MIG manager refuses such a change.
pub fn first_shortfall<'a>(
    after: impl IntoIterator<Item = &'a PlacedInstance>,
    in_use: &Demand,
) -> Option<(MigProfileName, u32, u32)> {
    let after: Vec<&PlacedInstance> = after.into_iter().collect();
    in_use.iter().find_map(|(p, used)| {
        let kept =
            u32::try_from(after.iter().filter(|i| i.profile == *p).count()).unwrap_or(u32::MAX);
        (kept < *used).then(|| (p.clone(), kept, *used))
    })
}

#[cfg(test)]
mod tests;
