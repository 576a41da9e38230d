//! Driver selection matrix: which driver image each GPU node gets, how nodes
//! group into driver DaemonSets, and whether the requested driver can drive the
//! node's GPUs at all.
//!
//! Image rules follow the NVIDIA operator so existing registries and mirrors
//! keep working: `<repo>/<image>:<version>-<os-tag>` where the OS tag is
//! `<ID><VERSION_ID>` (major version only for rhel, rocky and ol), a digest
//! version is used as is, and precompiled drivers are
//! `<repo>/<image>:<version>-<kernel>-<os-tag>` with one DaemonSet per kernel.
//! Unlike the NVIDIA operator (one OS per cluster) every OS gets its own pool.
//!
//! The GPU × driver-branch matrix is this project's addition: a driver branch
//! older than a GPU's first supported branch, newer than an architecture's last
//! branch, or with the wrong kernel-module flavour is refused for that node
//! before anything rolls out.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::labels::{Labels, NFD_KERNEL, NFD_OS_ID, NFD_OS_VERSION, NFD_OS_VERSION_MAJOR};

/// Driver branch from which the driver container's `auto` picks open modules.
pub const AUTO_OPEN_FROM_BRANCH: u32 = 560;
/// Driver branch from which only open kernel modules exist.
pub const OPEN_ONLY_FROM_BRANCH: u32 = 615;

/// Kernel module flavour requested by `driver.kernelModuleType`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KernelModuleType {
    /// Let the branch and the GPUs decide.
    #[default]
    Auto,
    /// NVIDIA open GPU kernel modules.
    Open,
    /// The closed (proprietary) modules.
    Proprietary,
}

impl KernelModuleType {
    /// The `KERNEL_MODULE_TYPE` env value.
    pub fn as_str(self) -> &'static str {
        match self {
            KernelModuleType::Auto => "auto",
            KernelModuleType::Open => "open",
            KernelModuleType::Proprietary => "proprietary",
        }
    }
}

/// The driver part of a policy, as the selection matrix needs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverRequest {
    /// Registry and path, e.g. `nvcr.io/nvidia`.
    pub repository: String,
    /// Image name, e.g. `driver`; a full reference when `repository` is empty.
    pub image: String,
    /// A version (`595.91.07`, or a branch `535` for precompiled) or a `sha256:` digest.
    pub version: String,
    /// Use precompiled per-kernel images.
    pub use_precompiled: bool,
    /// Requested kernel module flavour.
    pub kernel_module_type: KernelModuleType,
}

/// Errors in the driver part of a policy. Each names the field and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum DriverError {
    /// `usePrecompiled` with a digest version.
    #[error(
        "spec.driver.version: a digest ({version}) cannot be combined with spec.driver.usePrecompiled=true, because precompiled images are tagged per kernel; set a driver branch such as \"570\" or turn usePrecompiled off"
    )]
    DigestWithPrecompiled {
        /// The digest given.
        version: String,
    },
    /// Empty version.
    #[error(
        "spec.driver.version is empty: set a driver version such as \"595.91.07\" or a sha256 digest"
    )]
    EmptyVersion,
    /// Empty image.
    #[error("spec.driver.image is empty: set the image name, e.g. \"driver\"")]
    EmptyImage,
}

/// A node's OS as NFD reports it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct OsInfo {
    /// `ID` from os-release (`ubuntu`, `rhel`).
    pub id: String,
    /// `VERSION_ID` (`22.04`, `9.4`).
    pub version_id: String,
    /// `VERSION_ID.major` when NFD published it.
    pub version_major: Option<String>,
}

/// OS ids whose image tag uses only the major version.
pub const MAJOR_ONLY_OS: [&str; 3] = ["rhel", "rocky", "ol"];

impl OsInfo {
    /// Reads the OS from NFD labels; `None` when `ID` or `VERSION_ID` is missing.
    pub fn from_labels(labels: &Labels) -> Option<OsInfo> {
        Some(OsInfo {
            id: labels.get(NFD_OS_ID)?.clone(),
            version_id: labels.get(NFD_OS_VERSION)?.clone(),
            version_major: labels.get(NFD_OS_VERSION_MAJOR).cloned(),
        })
    }

    fn major_only(&self) -> bool {
        MAJOR_ONLY_OS.contains(&self.id.as_str())
    }

    fn major(&self) -> &str {
        match &self.version_major {
            Some(m) => m,
            None => self
                .version_id
                .split('.')
                .next()
                .unwrap_or(&self.version_id),
        }
    }

    /// The image OS tag: `ubuntu22.04`, `rhel9`.
    pub fn tag(&self) -> String {
        if self.major_only() {
            format!("{}{}", self.id, self.major())
        } else {
            format!("{}{}", self.id, self.version_id)
        }
    }

    /// Node labels a pool of this OS selects on. For major-only OSes the
    /// `VERSION_ID.major` label is used when NFD publishes it, so `rhel 9.2`
    /// and `rhel 9.4` share one pool.
    pub fn pool_selector(&self) -> Labels {
        let mut s = Labels::new();
        s.insert(NFD_OS_ID.to_string(), self.id.clone());
        match (&self.version_major, self.major_only()) {
            (Some(m), true) => {
                s.insert(NFD_OS_VERSION_MAJOR.to_string(), m.clone());
            }
            _ => {
                s.insert(NFD_OS_VERSION.to_string(), self.version_id.clone());
            }
        }
        s
    }

    /// Name part of a pool: the tag, or the full version when pools of one tag
    /// are split by exact version.
    fn pool_name(&self) -> String {
        match (&self.version_major, self.major_only()) {
            (Some(_), true) => self.tag(),
            _ => format!("{}{}", self.id, self.version_id),
        }
    }
}

/// Whether a version string is a digest.
pub fn is_digest(version: &str) -> bool {
    version.starts_with("sha256:")
}

/// The driver branch of a version (`595.91.07` → 595, `535` → 535); `None`
/// for digests or unparseable versions.
pub fn branch_of(version: &str) -> Option<u32> {
    if is_digest(version) {
        return None;
    }
    let v = version.strip_prefix('v').unwrap_or(version);
    v.split(['.', '-']).next()?.parse().ok()
}

fn base_ref(req: &DriverRequest) -> String {
    let repo = req.repository.trim_end_matches('/');
    if repo.is_empty() {
        req.image.clone()
    } else {
        format!("{repo}/{}", req.image)
    }
}

/// Checks the request's own fields (independent of nodes).
pub fn validate_request(req: &DriverRequest) -> Result<(), DriverError> {
    if req.image.trim().is_empty() {
        return Err(DriverError::EmptyImage);
    }
    if req.version.trim().is_empty() {
        return Err(DriverError::EmptyVersion);
    }
    if req.use_precompiled && is_digest(&req.version) {
        return Err(DriverError::DigestWithPrecompiled {
            version: req.version.clone(),
        });
    }
    Ok(())
}

/// Image reference for one pool.
pub fn image_ref(
    req: &DriverRequest,
    os: &OsInfo,
    kernel: Option<&str>,
) -> Result<String, DriverError> {
    validate_request(req)?;
    let base = base_ref(req);
    if is_digest(&req.version) {
        return Ok(format!("{base}@{}", req.version));
    }
    Ok(match kernel {
        Some(k) if req.use_precompiled => format!("{base}:{}-{k}-{}", req.version, os.tag()),
        _ => format!("{base}:{}-{}", req.version, os.tag()),
    })
}

/// Lower-case DNS-label-safe form of a kernel version for object names.
pub fn sanitize_name_part(s: &str) -> String {
    let mut out: String = s
        .to_ascii_lowercase()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect();
    while out.ends_with(['-', '.']) {
        out.pop();
    }
    out
}

/// A GPU as the matrix sees it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct GpuIdentity {
    /// Product name, e.g. `NVIDIA H100 80GB HBM3`.
    pub model: String,
    /// Architecture in lower case (`hopper`, `blackwell`, ...).
    pub architecture: String,
}

/// What driver branches a GPU works with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Support {
    /// First branch that supports the GPU.
    pub min_branch: u32,
    /// Last branch that supports the architecture, for retired ones.
    pub last_branch: Option<u32>,
    /// Only open kernel modules drive this GPU.
    pub open_required: bool,
    /// Open kernel modules can drive this GPU (Turing and newer).
    pub open_supported: bool,
}

/// Minimum branch by model, most specific names first (so `h200` is tried
/// before `h20`, `l40s` before `l4`).
const MODEL_MIN_BRANCH: &[(&str, u32, bool)] = &[
    ("gb300", 580, true),
    ("b300", 580, true),
    ("gb200", 570, true),
    ("b200", 570, true),
    ("rtx pro 6000", 575, true),
    ("gh200", 535, true),
    ("h200", 550, false),
    ("h100", 525, false),
    ("h800", 525, false),
    ("h20", 550, false),
    ("l40s", 525, false),
    ("l40", 525, false),
    ("l4", 525, false),
    ("a100", 450, false),
    ("a800", 470, false),
    ("a30", 460, false),
    ("a40", 460, false),
    ("a10", 460, false),
    ("a16", 460, false),
    ("t4", 410, false),
    ("v100", 384, false),
];

/// Per-architecture fallback: (architecture, min branch, last branch, open required, open supported).
const ARCH_SUPPORT: &[(&str, u32, Option<u32>, bool, bool)] = &[
    ("kepler", 0, Some(470), false, false),
    ("maxwell", 0, Some(580), false, false),
    ("pascal", 0, Some(580), false, false),
    ("volta", 384, Some(580), false, false),
    ("turing", 410, None, false, true),
    ("ampere", 450, None, false, true),
    ("ada", 525, None, false, true),
    ("ada-lovelace", 525, None, false, true),
    ("hopper", 525, None, false, true),
    ("blackwell", 570, None, true, true),
];

fn normalize(model: &str) -> String {
    model.to_ascii_lowercase().replace(['-', '_'], " ")
}

fn contains_token_prefix(hay: &str, needle: &str) -> bool {
    // `needle` must start a word; a following character may be anything but a
    // digit (so "a10" matches "a10g" but not "a100", "l4" not "l40").
    let mut start = 0;
    while let Some(pos) = hay[start..].find(needle) {
        let at = start + pos;
        let before_ok = at == 0 || !hay.as_bytes()[at - 1].is_ascii_alphanumeric();
        let after = hay.as_bytes().get(at + needle.len());
        let after_ok = after.is_none_or(|c| !c.is_ascii_digit());
        if before_ok && after_ok {
            return true;
        }
        start = at + 1;
    }
    false
}

/// The support record of a GPU: the model table when the name is known, else
/// the architecture's defaults; unknown GPUs get permissive defaults.
pub fn support_for(gpu: &GpuIdentity) -> Support {
    let arch = gpu.architecture.to_ascii_lowercase();
    let arch_row = ARCH_SUPPORT.iter().find(|r| r.0 == arch);
    let mut s = match arch_row {
        Some(&(_, min, last, open_req, open_ok)) => Support {
            min_branch: min,
            last_branch: last,
            open_required: open_req,
            open_supported: open_ok,
        },
        None => Support {
            min_branch: 0,
            last_branch: None,
            open_required: false,
            open_supported: true,
        },
    };
    let name = normalize(&gpu.model);
    if let Some(&(_, min, open_req)) = MODEL_MIN_BRANCH
        .iter()
        .find(|(k, _, _)| contains_token_prefix(&name, k))
    {
        s.min_branch = s.min_branch.max(min);
        s.open_required |= open_req;
        if open_req {
            s.open_supported = true;
        }
    }
    s
}

/// Why a driver cannot drive a GPU.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum Incompatibility {
    /// Branch older than the GPU's first supported branch.
    #[error("{model} needs driver branch R{min_branch} or newer, the policy asks for R{branch}")]
    BranchTooOld {
        /// GPU product.
        model: String,
        /// Requested branch.
        branch: u32,
        /// First supported branch.
        min_branch: u32,
    },
    /// Branch newer than the architecture's last one.
    #[error(
        "{model} ({architecture}) is supported up to driver branch R{last_branch}, the policy asks for R{branch}"
    )]
    BranchTooNew {
        /// GPU product.
        model: String,
        /// Architecture.
        architecture: String,
        /// Requested branch.
        branch: u32,
        /// Last supported branch.
        last_branch: u32,
    },
    /// Proprietary modules requested for a GPU that needs open ones.
    #[error(
        "{model} runs only with open kernel modules, the policy asks for {requested}; set spec.driver.kernelModuleType to open or auto"
    )]
    OpenRequired {
        /// GPU product.
        model: String,
        /// What was requested or resolved.
        requested: String,
    },
    /// Open modules (requested or forced by the branch) on a GPU older than Turing.
    #[error("{model} ({architecture}) cannot run open kernel modules, which {why}")]
    OpenUnsupported {
        /// GPU product.
        model: String,
        /// Architecture.
        architecture: String,
        /// Why open modules would be used.
        why: String,
    },
}

/// The module flavour the driver will load for a set of GPUs.
///
/// - branch ≥ R615: open only;
/// - `open` / `proprietary`: as requested;
/// - `auto`: open if any GPU needs it or the branch is ≥ R560, else proprietary.
///   Unknown branch (digest) with `auto` stays `auto` (the container decides).
pub fn resolve_module_type(
    requested: KernelModuleType,
    branch: Option<u32>,
    gpus: &[GpuIdentity],
) -> KernelModuleType {
    if branch.is_some_and(|b| b >= OPEN_ONLY_FROM_BRANCH) {
        return KernelModuleType::Open;
    }
    match requested {
        KernelModuleType::Auto => {
            if gpus.iter().any(|g| support_for(g).open_required) {
                KernelModuleType::Open
            } else {
                match branch {
                    Some(b) if b >= AUTO_OPEN_FROM_BRANCH => KernelModuleType::Open,
                    Some(_) => KernelModuleType::Proprietary,
                    None => KernelModuleType::Auto,
                }
            }
        }
        other => other,
    }
}

/// Checks one GPU against a branch and a resolved module flavour.
pub fn check_gpu(
    gpu: &GpuIdentity,
    branch: Option<u32>,
    modules: KernelModuleType,
) -> Result<(), Incompatibility> {
    let s = support_for(gpu);
    if let Some(b) = branch {
        if b < s.min_branch {
            return Err(Incompatibility::BranchTooOld {
                model: gpu.model.clone(),
                branch: b,
                min_branch: s.min_branch,
            });
        }
        if let Some(last) = s.last_branch
            && b > last
        {
            return Err(Incompatibility::BranchTooNew {
                model: gpu.model.clone(),
                architecture: gpu.architecture.clone(),
                branch: b,
                last_branch: last,
            });
        }
    }
    match modules {
        KernelModuleType::Proprietary if s.open_required => Err(Incompatibility::OpenRequired {
            model: gpu.model.clone(),
            requested: "proprietary".into(),
        }),
        KernelModuleType::Open if !s.open_supported => Err(Incompatibility::OpenUnsupported {
            model: gpu.model.clone(),
            architecture: gpu.architecture.clone(),
            why: if branch.is_some_and(|b| b >= OPEN_ONLY_FROM_BRANCH) {
                format!("driver branch R{OPEN_ONLY_FROM_BRANCH} and newer always use")
            } else {
                "this policy selects".into()
            },
        }),
        _ => Ok(()),
    }
}

/// A GPU node as the driver planner needs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverNode {
    /// Node name.
    pub name: String,
    /// Node labels.
    pub labels: Labels,
    /// GPUs identified on the node (empty when unknown).
    pub gpus: Vec<GpuIdentity>,
}

/// One driver DaemonSet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverPool {
    /// DaemonSet name, `nvidia-driver-daemonset-<pool>`.
    pub name: String,
    /// The pool's OS.
    pub os: OsInfo,
    /// Kernel, for precompiled pools.
    pub kernel: Option<String>,
    /// Labels the DaemonSet selects on, besides the deploy label.
    pub selector: Labels,
    /// Image reference.
    pub image: String,
    /// `KERNEL_MODULE_TYPE` the driver container gets.
    pub kernel_module_type: KernelModuleType,
    /// Nodes that match and can run this driver.
    pub nodes: Vec<String>,
    /// Nodes that match the selector but whose GPUs this driver cannot drive;
    /// the DaemonSet excludes them by name.
    pub excluded: Vec<String>,
}

/// A node the driver will not be deployed to, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRefusal {
    /// Node name.
    pub node: String,
    /// Human-readable reason.
    pub reason: String,
}

/// The planner's answer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverPlan {
    /// One entry per DaemonSet.
    pub pools: Vec<DriverPool>,
    /// GPU nodes refused because of GPU × driver incompatibility.
    pub refused: Vec<NodeRefusal>,
    /// GPU nodes that fit no pool (missing OS or kernel labels).
    pub unpooled: Vec<NodeRefusal>,
    /// GPU nodes whose GPUs could not be identified, so compatibility was not checked.
    pub unverified: Vec<String>,
}

/// Groups GPU nodes into driver pools and applies the compatibility matrix.
///
/// Nodes are expected to be GPU nodes; pools and their node lists come out
/// sorted by name so the result is deterministic.
pub fn plan_driver(req: &DriverRequest, nodes: &[DriverNode]) -> Result<DriverPlan, DriverError> {
    validate_request(req)?;
    let branch = branch_of(&req.version);
    let mut plan = DriverPlan::default();
    let mut groups: BTreeMap<String, (OsInfo, Option<String>, Vec<&DriverNode>)> = BTreeMap::new();
    for n in nodes {
        let Some(os) = OsInfo::from_labels(&n.labels) else {
            plan.unpooled.push(NodeRefusal {
                node: n.name.clone(),
                reason: format!(
                    "no OS labels ({NFD_OS_ID}, {NFD_OS_VERSION}); is node-feature-discovery running on it?"
                ),
            });
            continue;
        };
        let kernel = if req.use_precompiled {
            match n.labels.get(NFD_KERNEL) {
                Some(k) => Some(k.clone()),
                None => {
                    plan.unpooled.push(NodeRefusal {
                        node: n.name.clone(),
                        reason: format!("precompiled drivers need the {NFD_KERNEL} label"),
                    });
                    continue;
                }
            }
        } else {
            None
        };
        let key = match &kernel {
            Some(k) => format!("{}-{}", sanitize_name_part(k), os.pool_name()),
            None => os.pool_name(),
        };
        groups
            .entry(key)
            .or_insert_with(|| (os.clone(), kernel.clone(), Vec::new()))
            .2
            .push(n);
    }
    for (key, (os, kernel, members)) in groups {
        let all_gpus: Vec<GpuIdentity> = members
            .iter()
            .flat_map(|n| n.gpus.iter().cloned())
            .collect();
        let modules = resolve_module_type(req.kernel_module_type, branch, &all_gpus);
        let mut selector = os.pool_selector();
        if let Some(k) = &kernel {
            selector.insert(NFD_KERNEL.to_string(), k.clone());
        }
        let mut pool = DriverPool {
            name: format!(
                "{}-{key}",
                super::components::Component::Driver.daemonset_name()
            ),
            image: image_ref(req, &os, kernel.as_deref())?,
            os,
            kernel,
            selector,
            kernel_module_type: modules,
            nodes: Vec::new(),
            excluded: Vec::new(),
        };
        for n in members {
            if n.gpus.is_empty() {
                plan.unverified.push(n.name.clone());
            }
            let problems: Vec<String> = n
                .gpus
                .iter()
                .filter_map(|g| check_gpu(g, branch, modules).err())
                .map(|e| e.to_string())
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            if problems.is_empty() {
                pool.nodes.push(n.name.clone());
            } else {
                pool.excluded.push(n.name.clone());
                plan.refused.push(NodeRefusal {
                    node: n.name.clone(),
                    reason: problems.join("; "),
                });
            }
        }
        pool.nodes.sort();
        pool.excluded.sort();
        plan.pools.push(pool);
    }
    plan.refused.sort_by(|a, b| a.node.cmp(&b.node));
    plan.unpooled.sort_by(|a, b| a.node.cmp(&b.node));
    plan.unverified.sort();
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn req(version: &str) -> DriverRequest {
        DriverRequest {
            repository: "nvcr.io/nvidia".into(),
            image: "driver".into(),
            version: version.into(),
            use_precompiled: false,
            kernel_module_type: KernelModuleType::Auto,
        }
    }

    fn os(id: &str, v: &str, major: Option<&str>) -> OsInfo {
        OsInfo {
            id: id.into(),
            version_id: v.into(),
            version_major: major.map(Into::into),
        }
    }

    fn gpu(model: &str, arch: &str) -> GpuIdentity {
        GpuIdentity {
            model: model.into(),
            architecture: arch.into(),
        }
    }

    #[test]
    fn image_references() {
        let r = req("595.91.07");
        assert_eq!(
            image_ref(&r, &os("ubuntu", "22.04", None), None).unwrap(),
            "nvcr.io/nvidia/driver:595.91.07-ubuntu22.04"
        );
        assert_eq!(
            image_ref(&r, &os("rhel", "9.4", Some("9")), None).unwrap(),
            "nvcr.io/nvidia/driver:595.91.07-rhel9"
        );
        assert_eq!(
            image_ref(&r, &os("rocky", "8.10", None), None).unwrap(),
            "nvcr.io/nvidia/driver:595.91.07-rocky8"
        );
        let d = req("sha256:abcd");
        assert_eq!(
            image_ref(&d, &os("ubuntu", "24.04", None), None).unwrap(),
            "nvcr.io/nvidia/driver@sha256:abcd"
        );
        let mut p = req("535");
        p.use_precompiled = true;
        assert_eq!(
            image_ref(&p, &os("ubuntu", "22.04", None), Some("5.15.0-100-generic")).unwrap(),
            "nvcr.io/nvidia/driver:535-5.15.0-100-generic-ubuntu22.04"
        );
        let mut bad = req("sha256:abcd");
        bad.use_precompiled = true;
        let err = image_ref(&bad, &os("ubuntu", "22.04", None), Some("k")).unwrap_err();
        assert!(err.to_string().contains("spec.driver.version"));
        let mut full = req("1.0");
        full.repository.clear();
        full.image = "registry.local/drv".into();
        assert_eq!(
            image_ref(&full, &os("ubuntu", "22.04", None), None).unwrap(),
            "registry.local/drv:1.0-ubuntu22.04"
        );
    }

    #[test]
    fn branches() {
        assert_eq!(branch_of("595.91.07"), Some(595));
        assert_eq!(branch_of("535"), Some(535));
        assert_eq!(branch_of("sha256:00"), None);
        assert_eq!(branch_of("latest"), None);
    }

    #[test]
    fn compatibility_matrix() {
        let h100 = gpu("NVIDIA H100 80GB HBM3", "hopper");
        let h200 = gpu("NVIDIA H200", "hopper");
        let b200 = gpu("NVIDIA B200", "blackwell");
        let pro = gpu("NVIDIA RTX PRO 6000 Blackwell Server Edition", "blackwell");
        let v100 = gpu("Tesla V100-SXM2-32GB", "volta");
        let l4 = gpu("NVIDIA L4", "ada");
        let gh200 = gpu("NVIDIA GH200 480GB", "hopper");
        assert!(check_gpu(&h100, Some(525), KernelModuleType::Proprietary).is_ok());
        assert!(matches!(
            check_gpu(&h100, Some(470), KernelModuleType::Proprietary),
            Err(Incompatibility::BranchTooOld {
                min_branch: 525,
                ..
            })
        ));
        assert!(check_gpu(&h200, Some(535), KernelModuleType::Open).is_err());
        assert!(check_gpu(&h200, Some(550), KernelModuleType::Open).is_ok());
        assert!(check_gpu(&b200, Some(570), KernelModuleType::Proprietary).is_err());
        assert!(check_gpu(&b200, Some(570), KernelModuleType::Open).is_ok());
        assert_eq!(support_for(&pro).min_branch, 575);
        assert_eq!(support_for(&l4).min_branch, 525);
        assert!(support_for(&gh200).open_required);
        assert!(matches!(
            check_gpu(&v100, Some(595), KernelModuleType::Proprietary),
            Err(Incompatibility::BranchTooNew {
                last_branch: 580,
                ..
            })
        ));
        assert!(matches!(
            check_gpu(&v100, Some(570), KernelModuleType::Open),
            Err(Incompatibility::OpenUnsupported { .. })
        ));
        // "a10" must not match an A100, "l4" not an L40S.
        assert_eq!(
            support_for(&gpu("NVIDIA A100-SXM4-80GB", "ampere")).min_branch,
            450
        );
        assert_eq!(support_for(&gpu("NVIDIA A10G", "ampere")).min_branch, 460);
        assert_eq!(support_for(&gpu("NVIDIA L40S", "ada")).min_branch, 525);
    }

    #[test]
    fn module_type_resolution() {
        let b200 = gpu("NVIDIA B200", "blackwell");
        let a100 = gpu("NVIDIA A100", "ampere");
        use KernelModuleType::*;
        assert_eq!(
            resolve_module_type(Auto, Some(550), std::slice::from_ref(&a100)),
            Proprietary
        );
        assert_eq!(
            resolve_module_type(Auto, Some(570), std::slice::from_ref(&a100)),
            Open
        );
        assert_eq!(resolve_module_type(Auto, Some(550), &[b200]), Open);
        assert_eq!(
            resolve_module_type(Proprietary, Some(620), std::slice::from_ref(&a100)),
            Open
        );
        assert_eq!(resolve_module_type(Auto, None, &[a100]), Auto);
    }

    fn node(
        name: &str,
        id: &str,
        v: &str,
        major: Option<&str>,
        gpus: Vec<GpuIdentity>,
    ) -> DriverNode {
        let mut labels = Labels::new();
        labels.insert(NFD_OS_ID.into(), id.into());
        labels.insert(NFD_OS_VERSION.into(), v.into());
        if let Some(m) = major {
            labels.insert(NFD_OS_VERSION_MAJOR.into(), m.into());
        }
        labels.insert(NFD_KERNEL.into(), format!("5.15.0-{name}"));
        DriverNode {
            name: name.into(),
            labels,
            gpus,
        }
    }

    #[test]
    fn pools_per_os_and_refusals() {
        let nodes = vec![
            node(
                "a",
                "ubuntu",
                "22.04",
                Some("22"),
                vec![gpu("NVIDIA A100", "ampere")],
            ),
            node(
                "b",
                "ubuntu",
                "22.04",
                Some("22"),
                vec![gpu("NVIDIA H200", "hopper")],
            ),
            node("c", "rhel", "9.4", Some("9"), vec![gpu("NVIDIA L4", "ada")]),
            node("d", "rhel", "9.2", Some("9"), vec![]),
            DriverNode {
                name: "e".into(),
                labels: Labels::new(),
                gpus: vec![],
            },
        ];
        let plan = plan_driver(&req("535.104.05"), &nodes).unwrap();
        let names: Vec<_> = plan.pools.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "nvidia-driver-daemonset-rhel9",
                "nvidia-driver-daemonset-ubuntu22.04"
            ]
        );
        assert_eq!(plan.pools[0].nodes, ["c", "d"]);
        assert_eq!(plan.pools[1].nodes, ["a"]);
        assert_eq!(plan.pools[1].excluded, ["b"]);
        assert_eq!(plan.refused.len(), 1);
        assert!(plan.refused[0].reason.contains("R550"));
        assert_eq!(plan.unpooled[0].node, "e");
        assert_eq!(plan.unverified, ["d"]);

        let mut pre = req("535");
        pre.use_precompiled = true;
        let plan = plan_driver(&pre, &nodes[..2]).unwrap();
        assert_eq!(plan.pools.len(), 2);
        assert!(
            plan.pools[0]
                .name
                .starts_with("nvidia-driver-daemonset-5.15.0-a")
        );
        assert!(plan.pools[0].selector.contains_key(NFD_KERNEL));
    }

    proptest! {
        #[test]
        fn every_gpu_node_lands_in_exactly_one_place(
            specs in prop::collection::vec((0usize..4, 0usize..4, any::<bool>()), 0..30),
            version in prop::sample::select(vec!["470.1", "535.1", "550.1", "570.1", "595.1", "620.1"]),
            precompiled in any::<bool>(),
        ) {
            let oses = [("ubuntu", "22.04"), ("ubuntu", "24.04"), ("rhel", "9.4"), ("rocky", "8.10")];
            let gpus = [gpu("NVIDIA A100", "ampere"), gpu("NVIDIA B200", "blackwell"), gpu("Tesla V100", "volta"), gpu("NVIDIA H100", "hopper")];
            let nodes: Vec<DriverNode> = specs.iter().enumerate().map(|(i, (o, g, labelled))| {
                let mut n = node(&format!("n{i}"), oses[*o].0, oses[*o].1, None, vec![gpus[*g].clone()]);
                if !labelled { n.labels.clear(); }
                n
            }).collect();
            let mut r = req(version);
            r.use_precompiled = precompiled;
            let plan = plan_driver(&r, &nodes).unwrap();
            for n in &nodes {
                let in_pools = plan.pools.iter().filter(|p| p.nodes.contains(&n.name)).count();
                let excluded = plan.pools.iter().filter(|p| p.excluded.contains(&n.name)).count();
                let unpooled = plan.unpooled.iter().filter(|u| u.node == n.name).count();
                prop_assert_eq!(in_pools + excluded + unpooled, 1);
                prop_assert_eq!(excluded, plan.refused.iter().filter(|u| u.node == n.name).count());
            }
            for p in &plan.pools {
                // A pool's selector matches each of its nodes.
                for name in p.nodes.iter().chain(&p.excluded) {
                    let n = nodes.iter().find(|n| &n.name == name).unwrap();
                    for (k, v) in &p.selector {
                        prop_assert_eq!(n.labels.get(k), Some(v));
                    }
                }
            }
        }
    }
}
