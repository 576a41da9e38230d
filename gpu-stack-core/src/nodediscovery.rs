//! Node discovery without NFD: the node feature discovery (NFD) labels the
//! operator reads, computed from the host itself, and the one node patch that
//! puts them on the node.
//!
//! The operator recognises GPU nodes, the OS and the kernel only through NFD
//! labels (see [`crate::operator::labels`]). Where NFD is not installed, the
//! node-discovery agent writes the same labels with NFD's exact rules:
//!
//! - **PCI** ([`pci_labels`]), from `bus/pci/devices/*/{vendor,class,device}`:
//!   ids lose their `0x` and are lowercased, the class keeps its first 4 hex
//!   digits (`0x030200` → `0302`). Devices whose class starts with one of
//!   [`PCI_CLASS_WHITELIST`] (the GPU operator's NFD worker config) give
//!   `pci-<vendor>.present` (the GPU operator's `deviceLabelFields: [vendor]`),
//!   `pci-<class>_<vendor>.present` (NFD's default fields) and
//!   `pci-<class>_<vendor>_<device>.present` (which the operator reads for the
//!   device id, e.g. to know a node is MIG-capable before GFD runs), all `true`.
//! - **OS** ([`os_release_labels`]): `system-os_release.ID`, `.VERSION_ID`, and
//!   `.VERSION_ID.major` / `.minor` when `VERSION_ID` is numeric
//!   (`^\d+(\.\d+)?(\..*)?$`: the digits before the first dot, and after it).
//!   Lines are parsed as NFD does (`^\w+=.+`, surrounding `"` and `'` trimmed,
//!   the last of repeated keys wins).
//! - **Kernel** ([`kernel_labels`]): `kernel-version.full` with characters
//!   outside `[-A-Za-z0-9_.]` replaced by `_` and leading or trailing `-_.`
//!   trimmed, then `.major`, `.minor`, `.revision` from
//!   `^\d+(\.\d+)?(\.\d+)?(-.*)?$`.
//!
//! A value that is not a valid Kubernetes label value (63 characters at most,
//! alphanumeric at both ends, `-_.` inside) is left out, as nfd-master drops it;
//! empty values are left out too.
//!
//! [`plan_node_patch`] then decides the node patch. If NFD manages the node
//! (nfd-master's annotations under [`NFD_ANNOTATION_NS`]) it writes nothing.
//! Otherwise it sets the computed labels, removes labels it wrote earlier that
//! are no longer true, and records the labels it owns in [`OWNED_ANNOTATION`],
//! so it never removes or changes a label someone else wrote. Inputs are
//! bounded ([`MAX_PCI_DEVICES`], [`MAX_OS_RELEASE_BYTES`],
//! [`MAX_KERNEL_RELEASE_BYTES`], [`MAX_LABELS`]); nothing here panics.
//!
//! ```
//! use std::collections::BTreeMap;
//! use gpu_stack_core::nodediscovery::{PciDevice, discover_labels, plan_node_patch};
//!
//! let h100 = PciDevice::new("0x10de", "0x030200", "0x2330");
//! let desired = discover_labels(&[h100], "ID=ubuntu\nVERSION_ID=\"22.04\"\n", "5.15.0-127-generic\n");
//! assert_eq!(desired["feature.node.kubernetes.io/pci-10de.present"], "true");
//! assert_eq!(desired["feature.node.kubernetes.io/system-os_release.VERSION_ID.major"], "22");
//!
//! let (mut labels, mut annotations) = (BTreeMap::new(), BTreeMap::new());
//! let patch = plan_node_patch(&desired, &labels, &annotations).ok_or("a new node needs labels")?;
//! patch.apply_to(&mut labels, &mut annotations);
//! assert_eq!(plan_node_patch(&desired, &labels, &annotations), None, "steady state: no write");
//! # Ok::<(), &str>(())
//! ```
use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::migmanager::LabelEdits;
use crate::operator::labels::{
    Labels, NFD_KERNEL, NFD_OS_ID, NFD_OS_VERSION, NFD_OS_VERSION_MAJOR, NFD_PREFIX,
};

/// NFD OS minor version (`04` of `22.04`).
pub const NFD_OS_VERSION_MINOR: &str =
    "feature.node.kubernetes.io/system-os_release.VERSION_ID.minor";
/// NFD kernel major version (`5` of `5.15.0-127-generic`).
pub const NFD_KERNEL_MAJOR: &str = "feature.node.kubernetes.io/kernel-version.major";
/// NFD kernel minor version (`15` of `5.15.0-127-generic`).
pub const NFD_KERNEL_MINOR: &str = "feature.node.kubernetes.io/kernel-version.minor";
/// NFD kernel revision (`0` of `5.15.0-127-generic`).
pub const NFD_KERNEL_REVISION: &str = "feature.node.kubernetes.io/kernel-version.revision";

/// Annotation listing the labels the node-discovery agent wrote (comma
/// separated, without the `feature.node.kubernetes.io/` prefix, as nfd-master's
/// own `feature-labels` annotation): the only labels it ever changes or removes.
pub const OWNED_ANNOTATION: &str = "gpu-stack/node-discovery.labels";

/// Annotation namespace of nfd-master (`nfd.node.kubernetes.io/feature-labels`,
/// `.../extended-resources`, `.../master.version` in older releases; with an
/// NFD instance name `<instance>.nfd.node.kubernetes.io/...`). Any of them on a
/// node means NFD manages it.
pub const NFD_ANNOTATION_NS: &str = "nfd.node.kubernetes.io";

/// PCI class prefixes that produce labels: the GPU operator's NFD worker
/// whitelist (`02`, `0200`, `0207`, `0300`, `0302`; `02` covers the first three):
/// network controllers, VGA and 3D controllers.
pub const PCI_CLASS_WHITELIST: [&str; 3] = ["02", "0300", "0302"];

/// PCI devices looked at; more are ignored (a large host has a few hundred).
pub const MAX_PCI_DEVICES: usize = 1024;
/// Bytes of an os-release file looked at (real ones are under 1 KiB).
pub const MAX_OS_RELEASE_BYTES: usize = 16 * 1024;
/// Bytes of a kernel release string looked at.
pub const MAX_KERNEL_RELEASE_BYTES: usize = 256;
/// Labels the agent writes and owns at most; further ones are left out.
pub const MAX_LABELS: usize = 256;

/// Longest Kubernetes label value, and longest label name after the prefix.
const LABEL_MAX: usize = 63;

/// One PCI device as read from sysfs (`vendor`, `class` and `device` files,
/// e.g. `0x10de`, `0x030200`, `0x2330`, whitespace allowed).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciDevice {
    /// Vendor id (`0x10de`).
    pub vendor: String,
    /// Class code (`0x030200`).
    pub class: String,
    /// Device id (`0x2330`).
    pub device: String,
}

impl PciDevice {
    /// A device from its three sysfs values.
    pub fn new(
        vendor: impl Into<String>,
        class: impl Into<String>,
        device: impl Into<String>,
    ) -> Self {
        Self {
            vendor: vendor.into(),
            class: class.into(),
            device: device.into(),
        }
    }
}

/// Everything the labels are computed from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostFacts {
    /// PCI devices.
    pub pci_devices: Vec<PciDevice>,
    /// Text of the host's os-release file.
    pub os_release: String,
    /// Kernel release (`/proc/sys/kernel/osrelease`, `uname -r`).
    pub kernel_release: String,
}

impl HostFacts {
    /// The NFD-compatible labels of these facts ([`discover_labels`]).
    pub fn labels(&self) -> Labels {
        discover_labels(&self.pci_devices, &self.os_release, &self.kernel_release)
    }
}

/// The NFD-compatible labels for a host: [`pci_labels`], [`os_release_labels`]
/// and [`kernel_labels`] together (at most [`MAX_LABELS`]).
pub fn discover_labels(pci: &[PciDevice], os_release: &str, kernel_release: &str) -> Labels {
    let mut labels = pci_labels(pci);
    labels.extend(os_release_labels(os_release));
    labels.extend(kernel_labels(kernel_release));
    labels.into_iter().take(MAX_LABELS).collect()
}

/// A sysfs id without `0x`, lowercase, of `min..=max` hex digits.
fn hex_id(raw: &str, min: usize, max: usize) -> Option<String> {
    let s = raw.trim();
    let s = s
        .strip_prefix("0x")
        .or_else(|| s.strip_prefix("0X"))
        .unwrap_or(s);
    let ok = (min..=max).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_hexdigit());
    ok.then(|| s.to_ascii_lowercase())
}

/// `(class, vendor, device)` in label form, or `None` for a malformed device.
fn pci_ids(dev: &PciDevice) -> Option<(String, String, String)> {
    // sysfs class codes are 6 digits (class, subclass, programming interface);
    // NFD keeps class and subclass.
    let class = hex_id(&dev.class, 4, 6)?.get(..4)?.to_string();
    let vendor = hex_id(&dev.vendor, 4, 4)?;
    let device = hex_id(&dev.device, 4, 4)?;
    Some((class, vendor, device))
}

/// PCI labels (`pci-<vendor>.present`, `pci-<class>_<vendor>.present`,
/// `pci-<class>_<vendor>_<device>.present`, all `true`) for the whitelisted
/// devices among the first [`MAX_PCI_DEVICES`]; malformed ids are skipped.
pub fn pci_labels(devices: &[PciDevice]) -> Labels {
    let mut labels = Labels::new();
    for dev in devices.iter().take(MAX_PCI_DEVICES) {
        let Some((class, vendor, device)) = pci_ids(dev) else {
            continue;
        };
        if !PCI_CLASS_WHITELIST.iter().any(|w| class.starts_with(w)) {
            continue;
        }
        for name in [
            format!("pci-{vendor}.present"),
            format!("pci-{class}_{vendor}.present"),
            format!("pci-{class}_{vendor}_{device}.present"),
        ] {
            labels.insert(format!("{NFD_PREFIX}{name}"), "true".to_string());
        }
    }
    labels
}

/// The longest prefix of `s` of at most `max` bytes ending on a char boundary.
fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The `KEY=value` pairs of an os-release file, parsed as NFD does: a line
/// matching `^\w+=.+`, the value with surrounding `"` and `'` trimmed; a later
/// line wins over an earlier one with the same key. Only the first
/// [`MAX_OS_RELEASE_BYTES`] are read.
pub fn parse_os_release(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for line in cut(text, MAX_OS_RELEASE_BYTES).split('\n') {
        let line = line.strip_suffix('\r').unwrap_or(line);
        let key_len = line
            .bytes()
            .take_while(|b| b.is_ascii_alphanumeric() || *b == b'_')
            .count();
        let (key, rest) = line.split_at(key_len);
        let Some(value) = rest.strip_prefix('=') else {
            continue;
        };
        if key.is_empty() || value.is_empty() {
            continue;
        }
        out.insert(key.to_string(), value.trim_matches(['"', '\'']).to_string());
    }
    out
}

/// Splits a leading run of ASCII digits off `s`.
fn digits(s: &str) -> (&str, &str) {
    let n = s.bytes().take_while(u8::is_ascii_digit).count();
    s.split_at(n)
}

/// NFD's split of `VERSION_ID` (`^(\d+)(\.(\d+))?(\..*)?$`): major, and minor
/// when present; `None` when the version does not start with digits then a dot
/// or its end.
fn split_os_version(version: &str) -> Option<(&str, Option<&str>)> {
    let (major, rest) = digits(version);
    if major.is_empty() {
        return None;
    }
    let Some(after_dot) = rest.strip_prefix('.') else {
        return rest.is_empty().then_some((major, None));
    };
    let (minor, tail) = digits(after_dot);
    // `(\.(\d+))?` only holds when what follows the digits is the end or
    // another dot; otherwise `(\..*)?` takes the whole rest and there is no minor.
    let minor = (!minor.is_empty() && (tail.is_empty() || tail.starts_with('.'))).then_some(minor);
    Some((major, minor))
}

/// OS labels from an os-release file's text: `system-os_release.ID`,
/// `.VERSION_ID`, `.VERSION_ID.major` and `.VERSION_ID.minor`, each only when
/// present, non-empty and a valid label value.
pub fn os_release_labels(text: &str) -> Labels {
    let release = parse_os_release(text);
    let mut labels = Labels::new();
    let mut put = |key: &str, value: &str| {
        if !value.is_empty() && is_valid_label_value(value) {
            labels.insert(key.to_string(), value.to_string());
        }
    };
    if let Some(id) = release.get("ID") {
        put(NFD_OS_ID, id);
    }
    if let Some(version) = release.get("VERSION_ID") {
        put(NFD_OS_VERSION, version);
        if let Some((major, minor)) = split_os_version(version) {
            put(NFD_OS_VERSION_MAJOR, major);
            if let Some(minor) = minor {
                put(NFD_OS_VERSION_MINOR, minor);
            }
        }
    }
    labels
}

/// The kernel release as NFD writes it in `kernel-version.full`: trimmed,
/// characters outside `[-A-Za-z0-9_.]` replaced by `_`, leading and trailing
/// `-`, `_`, `.` removed (only the first [`MAX_KERNEL_RELEASE_BYTES`] are read).
pub fn sanitize_kernel_release(release: &str) -> String {
    let replaced: String = cut(release, MAX_KERNEL_RELEASE_BYTES)
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    replaced.trim_matches(['-', '_', '.']).to_string()
}

/// NFD's kernel version components (`^(\d+)(\.(\d+))?(\.(\d+))?(-.*)?$`):
/// major, minor, revision; `None` when the release does not have that shape.
fn split_kernel_version(full: &str) -> Option<[Option<&str>; 3]> {
    let (major, mut rest) = digits(full);
    if major.is_empty() {
        return None;
    }
    let mut parts = [Some(major), None, None];
    for part in parts.iter_mut().skip(1) {
        let Some(after_dot) = rest.strip_prefix('.') else {
            break;
        };
        let (n, tail) = digits(after_dot);
        if n.is_empty() {
            break;
        }
        *part = Some(n);
        rest = tail;
    }
    (rest.is_empty() || rest.starts_with('-')).then_some(parts)
}

/// Kernel labels: `kernel-version.full` ([`sanitize_kernel_release`]) and
/// `.major`, `.minor`, `.revision` when the release has them; values that are
/// not valid label values (over 63 characters) are left out.
pub fn kernel_labels(release: &str) -> Labels {
    let full = sanitize_kernel_release(release);
    let mut labels = Labels::new();
    if full.is_empty() || !is_valid_label_value(&full) {
        return labels;
    }
    if let Some(parts) = split_kernel_version(&full) {
        let keys = [NFD_KERNEL_MAJOR, NFD_KERNEL_MINOR, NFD_KERNEL_REVISION];
        for (key, part) in keys.into_iter().zip(parts) {
            if let Some(part) = part {
                labels.insert(key.to_string(), part.to_string());
            }
        }
    }
    labels.insert(NFD_KERNEL.to_string(), full);
    labels
}

/// Whether `value` is a valid Kubernetes label value: empty, or at most 63
/// characters of `[A-Za-z0-9-_.]` starting and ending with an alphanumeric.
pub fn is_valid_label_value(value: &str) -> bool {
    value.is_empty() || is_label_name(value)
}

/// A non-empty label name (or value): at most 63 characters of
/// `[A-Za-z0-9-_.]`, alphanumeric at both ends.
fn is_label_name(s: &str) -> bool {
    let b = s.as_bytes();
    let (Some(first), Some(last)) = (b.first(), b.last()) else {
        return false;
    };
    b.len() <= LABEL_MAX
        && first.is_ascii_alphanumeric()
        && last.is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// Whether the agent may own `key`: a valid label name under
/// `feature.node.kubernetes.io/`. Nothing else is ever written or removed,
/// whatever the ownership annotation says.
pub fn is_ownable_label(key: &str) -> bool {
    key.strip_prefix(NFD_PREFIX).is_some_and(is_label_name)
}

/// Whether NFD manages the node: an annotation in nfd-master's namespace
/// (`nfd.node.kubernetes.io/...` or `<instance>.nfd.node.kubernetes.io/...`).
pub fn nfd_manages(annotations: &Labels) -> bool {
    annotations.keys().any(|k| {
        k.split_once('/').is_some_and(|(ns, _)| {
            ns == NFD_ANNOTATION_NS
                || ns
                    .strip_suffix(NFD_ANNOTATION_NS)
                    .is_some_and(|i| i.ends_with('.'))
        })
    })
}

/// The labels the agent owns on a node, from [`OWNED_ANNOTATION`]: entries
/// that are valid label names under `feature.node.kubernetes.io/` (full keys
/// returned), at most [`MAX_LABELS`] of them; anything else in the annotation
/// is ignored.
pub fn owned_labels(annotations: &Labels) -> BTreeSet<String> {
    let Some(value) = annotations.get(OWNED_ANNOTATION) else {
        return BTreeSet::new();
    };
    // Entries are at most 63 bytes plus a comma.
    cut(value, MAX_LABELS * (LABEL_MAX + 1))
        .split(',')
        .map(str::trim)
        .map(|name| format!("{NFD_PREFIX}{name}"))
        .filter(|key| is_ownable_label(key))
        .take(MAX_LABELS)
        .collect()
}

/// The [`OWNED_ANNOTATION`] value for a set of owned keys (sorted, without prefix).
fn owned_annotation_value(owned: &BTreeSet<String>) -> String {
    owned
        .iter()
        .filter_map(|k| k.strip_prefix(NFD_PREFIX))
        .collect::<Vec<_>>()
        .join(",")
}

/// One metadata patch of a node: label edits and annotation edits (`None`
/// removes), sent as a single JSON merge patch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeDiscoveryPatch {
    /// Labels to set and to remove.
    pub labels: LabelEdits,
    /// Annotations to set (`Some`) or remove (`None`): only [`OWNED_ANNOTATION`].
    pub annotations: BTreeMap<String, Option<String>>,
}

impl NodeDiscoveryPatch {
    /// Applies the patch to a node's labels and annotations, as the API server
    /// applies the merge patch.
    pub fn apply_to(&self, labels: &mut Labels, annotations: &mut Labels) {
        self.labels.apply_to(labels);
        for (k, v) in &self.annotations {
            match v {
                Some(v) => annotations.insert(k.clone(), v.clone()),
                None => annotations.remove(k),
            };
        }
    }
}

/// The patch that brings a node to the `desired` labels, or `None` when
/// nothing changes (a steady state writes nothing).
///
/// - NFD manages the node ([`nfd_manages`]): `None`, whatever else holds; NFD's
///   labels, and any this agent wrote before, are left as they are.
/// - A desired label the node lacks is set and owned; one the agent owns is
///   set when its value differs; one someone else wrote (present, not owned)
///   is left alone and not owned.
/// - An owned label that is no longer desired is removed.
/// - [`OWNED_ANNOTATION`] is rewritten when the owned set changes, and removed
///   when the agent owns nothing.
///
/// Only desired labels that [`is_ownable_label`] with a valid, non-empty value
/// are considered (at most [`MAX_LABELS`]). Applying the patch and calling
/// this again returns `None`.
pub fn plan_node_patch(
    desired: &Labels,
    labels: &Labels,
    annotations: &Labels,
) -> Option<NodeDiscoveryPatch> {
    if nfd_manages(annotations) {
        return None;
    }
    let owned_before = owned_labels(annotations);
    let desired = desired
        .iter()
        .filter(|(k, v)| is_ownable_label(k) && !v.is_empty() && is_valid_label_value(v))
        .take(MAX_LABELS);

    let mut patch = NodeDiscoveryPatch::default();
    let mut owned = BTreeSet::new();
    let mut wanted = BTreeSet::new();
    for (key, value) in desired {
        wanted.insert(key.as_str());
        let ours = owned_before.contains(key);
        match labels.get(key) {
            // Someone else's label: theirs to keep, not ours to own.
            Some(_) if !ours => continue,
            Some(current) if current == value => {}
            // Missing, or ours with another value.
            _ => {
                patch.labels.set.insert(key.clone(), value.clone());
            }
        }
        owned.insert(key.clone());
    }
    for key in &owned_before {
        if !wanted.contains(key.as_str()) && labels.contains_key(key) {
            patch.labels.remove.push(key.clone());
        }
    }

    let current = annotations.get(OWNED_ANNOTATION);
    if owned.is_empty() {
        if current.is_some() {
            patch.annotations.insert(OWNED_ANNOTATION.to_string(), None);
        }
    } else {
        let value = owned_annotation_value(&owned);
        if current != Some(&value) {
            patch
                .annotations
                .insert(OWNED_ANNOTATION.to_string(), Some(value));
        }
    }
    (!patch.labels.is_empty() || !patch.annotations.is_empty()).then_some(patch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::operator::labels::{NFD_GPU_LABELS, NodeFacts};
    use proptest::prelude::*;

    const UBUNTU: &str = "PRETTY_NAME=\"Ubuntu 22.04.5 LTS\"\nNAME=\"Ubuntu\"\nVERSION_ID=\"22.04\"\n\
        VERSION=\"22.04.5 LTS (Jammy Jellyfish)\"\nVERSION_CODENAME=jammy\nID=ubuntu\nID_LIKE=debian\n";
    const RHEL: &str = "NAME=\"Red Hat Enterprise Linux\"\r\nVERSION=\"9.4 (Plow)\"\r\nID=\"rhel\"\r\n\
        ID_LIKE=\"fedora\"\r\nVERSION_ID=\"9.4\"\r\n";

    fn map(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn nfd(name: &str) -> String {
        format!("{NFD_PREFIX}{name}")
    }

    fn h100() -> PciDevice {
        PciDevice::new("0x10de\n", "0x030200\n", "0x2330\n")
    }

    #[test]
    fn an_h100_ubuntu_node_gets_the_labels_the_operator_reads() {
        let host_bridge = PciDevice::new("0x8086", "0x060000", "0x09a2");
        let labels = discover_labels(
            &[h100(), h100(), host_bridge],
            UBUNTU,
            "5.15.0-127-generic\n",
        );
        let want = map(&[
            ("feature.node.kubernetes.io/pci-10de.present", "true"),
            ("feature.node.kubernetes.io/pci-0302_10de.present", "true"),
            (
                "feature.node.kubernetes.io/pci-0302_10de_2330.present",
                "true",
            ),
            (NFD_OS_ID, "ubuntu"),
            (NFD_OS_VERSION, "22.04"),
            (NFD_OS_VERSION_MAJOR, "22"),
            (NFD_OS_VERSION_MINOR, "04"),
            (NFD_KERNEL, "5.15.0-127-generic"),
            (NFD_KERNEL_MAJOR, "5"),
            (NFD_KERNEL_MINOR, "15"),
            (NFD_KERNEL_REVISION, "0"),
        ]);
        assert_eq!(labels, want);
        // The operator's own reading of these labels.
        let facts = NodeFacts::from_labels(&labels);
        assert!(facts.gpu && facts.nfd);
        assert_eq!(facts.pci_device_ids, vec!["2330".to_string()]);
        assert!(NFD_GPU_LABELS.iter().any(|k| labels.contains_key(*k)));
    }

    #[test]
    fn pci_ids_are_normalised_and_only_whitelisted_classes_count() {
        let devices = [
            PciDevice::new(" 0X10DE ", "0x030000", "0x1EB8"), // VGA, uppercase
            PciDevice::new("0x15b3", "0x020000", "0x101b"),   // Mellanox NIC
            PciDevice::new("0x10de", "0x0b4000", "0x1234"),   // coprocessor: not whitelisted
            PciDevice::new("0x10de", "0x03", "0x2330"),       // class too short
            PciDevice::new("0x10de", "0x030200", "0x23300"),  // device too long
            PciDevice::new("0xzzzz", "0x030200", "0x2330"),   // not hex
            PciDevice::new("", "", ""),
        ];
        let labels = pci_labels(&devices);
        let want: Labels = [
            "pci-10de.present",
            "pci-0300_10de.present",
            "pci-0300_10de_1eb8.present",
            "pci-15b3.present",
            "pci-0200_15b3.present",
            "pci-0200_15b3_101b.present",
        ]
        .into_iter()
        .map(|n| (nfd(n), "true".to_string()))
        .collect();
        assert_eq!(labels, want);
    }

    #[test]
    fn pci_devices_past_the_bound_are_ignored() {
        let mut devices = vec![PciDevice::new("0x8086", "0x060000", "0x0001"); MAX_PCI_DEVICES];
        devices.push(h100());
        assert!(pci_labels(&devices).is_empty());
    }

    #[test]
    fn os_release_is_read_as_nfd_reads_it() {
        assert_eq!(
            os_release_labels(RHEL),
            map(&[
                (NFD_OS_ID, "rhel"),
                (NFD_OS_VERSION, "9.4"),
                (NFD_OS_VERSION_MAJOR, "9"),
                (NFD_OS_VERSION_MINOR, "4"),
            ])
        );
        // Single quotes, comments, blank lines, a repeated key (the last wins),
        // `KEY = value` (not a match) and a key without a value.
        let text = "# comment\n\nID='sles'\nVERSION_ID=\"15.4\"\nVERSION_ID=\"15.5\"\n\
                    ID = opensuse\nVARIANT_ID=\n";
        assert_eq!(
            os_release_labels(text),
            map(&[
                (NFD_OS_ID, "sles"),
                (NFD_OS_VERSION, "15.5"),
                (NFD_OS_VERSION_MAJOR, "15"),
                (NFD_OS_VERSION_MINOR, "5"),
            ])
        );
    }

    #[test]
    fn version_components_follow_nfds_pattern() {
        let parts = split_os_version;
        assert_eq!(parts("22.04"), Some(("22", Some("04"))));
        assert_eq!(parts("9"), Some(("9", None)));
        assert_eq!(parts("9.4.1"), Some(("9", Some("4"))));
        assert_eq!(parts("9."), Some(("9", None)));
        assert_eq!(parts("9.4x"), Some(("9", None)));
        assert_eq!(parts("9.x"), Some(("9", None)));
        assert_eq!(parts("15-SP5"), None);
        assert_eq!(parts("rolling"), None);
        assert_eq!(parts(""), None);
        // No numeric version: ID and VERSION_ID only.
        assert_eq!(
            os_release_labels("ID=debian\nVERSION_ID=trixie\n"),
            map(&[(NFD_OS_ID, "debian"), (NFD_OS_VERSION, "trixie")])
        );
        // Arch has no VERSION_ID at all.
        assert_eq!(
            os_release_labels("NAME=\"Arch Linux\"\nID=arch\nBUILD_ID=rolling\n"),
            map(&[(NFD_OS_ID, "arch")])
        );
    }

    #[test]
    fn os_release_values_that_are_not_label_values_are_left_out() {
        // The ID has a space; the version is one character too long for a
        // label, its components are not.
        let minor = "2".repeat(LABEL_MAX - 1);
        let text = format!("ID=\"my distro\"\nVERSION_ID=\"1.{minor}\"\n");
        assert_eq!(
            os_release_labels(&text),
            map(&[(NFD_OS_VERSION_MAJOR, "1"), (NFD_OS_VERSION_MINOR, &minor)])
        );
    }

    #[test]
    fn kernel_release_is_sanitised_as_nfd_does() {
        assert_eq!(
            kernel_labels("4.18.0-553.el8_10.x86_64\n"),
            map(&[
                (NFD_KERNEL, "4.18.0-553.el8_10.x86_64"),
                (NFD_KERNEL_MAJOR, "4"),
                (NFD_KERNEL_MINOR, "18"),
                (NFD_KERNEL_REVISION, "0"),
            ])
        );
        assert_eq!(
            sanitize_kernel_release("6.8.0+rpt-rpi-v8"),
            "6.8.0_rpt-rpi-v8"
        );
        assert_eq!(sanitize_kernel_release("  -6.1.0~bpo+ "), "6.1.0_bpo");
        // `_` right after the version: not NFD's component pattern.
        assert_eq!(
            kernel_labels("6.8.0+rpt"),
            map(&[(NFD_KERNEL, "6.8.0_rpt")])
        );
        assert_eq!(
            kernel_labels("5.4"),
            map(&[
                (NFD_KERNEL, "5.4"),
                (NFD_KERNEL_MAJOR, "5"),
                (NFD_KERNEL_MINOR, "4"),
            ])
        );
        assert!(kernel_labels("").is_empty());
        assert!(kernel_labels("+++").is_empty());
        let long = format!("5.15.0-{}", "x".repeat(LABEL_MAX));
        assert!(kernel_labels(&long).is_empty(), "over 63 characters");
    }

    #[test]
    fn label_value_rules() {
        for ok in [
            "",
            "a",
            "22.04",
            "5.15.0-127-generic",
            "A_b-c.d",
            &"x".repeat(63),
        ] {
            assert!(is_valid_label_value(ok), "{ok:?}");
        }
        for bad in ["-a", "a-", ".a", "a b", "é", &"x".repeat(64), "a/b"] {
            assert!(!is_valid_label_value(bad), "{bad:?}");
        }
        assert!(is_ownable_label(
            "feature.node.kubernetes.io/pci-10de.present"
        ));
        assert!(!is_ownable_label("kubernetes.io/hostname"));
        assert!(!is_ownable_label("feature.node.kubernetes.io/"));
        assert!(!is_ownable_label("feature.node.kubernetes.io/a/b"));
    }

    fn desired() -> Labels {
        discover_labels(&[h100()], UBUNTU, "5.15.0-127-generic")
    }

    /// Applies `plan_node_patch` and returns the patch with the new state.
    fn step(
        desired: &Labels,
        labels: &mut Labels,
        annotations: &mut Labels,
    ) -> Option<NodeDiscoveryPatch> {
        let patch = plan_node_patch(desired, labels, annotations)?;
        patch.apply_to(labels, annotations);
        Some(patch)
    }

    #[test]
    fn a_new_node_gets_every_label_and_the_ownership_record_then_nothing() {
        let want = desired();
        let mut labels = map(&[("kubernetes.io/hostname", "gpu-0")]);
        let mut annotations = Labels::new();
        let patch = step(&want, &mut labels, &mut annotations).unwrap();
        assert_eq!(patch.labels.set, want);
        assert!(patch.labels.remove.is_empty());
        let owned = &annotations[OWNED_ANNOTATION];
        assert!(
            owned.starts_with("kernel-version.full,kernel-version.major"),
            "{owned}"
        );
        assert!(
            owned.contains("pci-10de.present") && !owned.contains(NFD_PREFIX),
            "{owned}"
        );
        assert_eq!(labels["kubernetes.io/hostname"], "gpu-0");
        assert_eq!(step(&want, &mut labels, &mut annotations), None);
    }

    #[test]
    fn nfd_managed_nodes_are_never_patched() {
        let want = desired();
        for key in [
            "nfd.node.kubernetes.io/feature-labels",
            "nfd.node.kubernetes.io/master.version",
            "nfd.node.kubernetes.io/extended-resources",
            "gpu.nfd.node.kubernetes.io/feature-labels",
        ] {
            let annotations = map(&[(key, "pci-10de.present")]);
            assert!(nfd_manages(&annotations), "{key}");
            assert_eq!(
                plan_node_patch(&want, &Labels::new(), &annotations),
                None,
                "{key}"
            );
        }
        // Not NFD's namespace.
        assert!(!nfd_manages(&map(&[(
            "xnfd.node.kubernetes.io/feature-labels",
            ""
        )])));
        assert!(!nfd_manages(&map(&[("nfd.node.kubernetes.io.evil/x", "")])));
    }

    #[test]
    fn a_removed_label_is_rewritten_and_a_stale_one_removed() {
        let want = desired();
        let (mut labels, mut annotations) = (Labels::new(), Labels::new());
        step(&want, &mut labels, &mut annotations);

        // Someone deletes one of ours: it comes back.
        labels.remove(NFD_OS_ID);
        let patch = step(&want, &mut labels, &mut annotations).unwrap();
        assert_eq!(patch.labels.set, map(&[(NFD_OS_ID, "ubuntu")]));
        assert!(
            patch.annotations.is_empty(),
            "still owned: no annotation write"
        );

        // The GPU leaves the host and the OS is upgraded.
        let want2 = discover_labels(&[], &UBUNTU.replace("22.04", "24.04"), "6.8.0-45-generic");
        let patch = step(&want2, &mut labels, &mut annotations).unwrap();
        let mut removed = patch.labels.remove.clone();
        removed.sort();
        assert_eq!(
            removed,
            vec![
                nfd("pci-0302_10de.present"),
                nfd("pci-0302_10de_2330.present"),
                nfd("pci-10de.present"),
            ]
        );
        assert_eq!(labels[NFD_OS_VERSION], "24.04");
        assert_eq!(labels[NFD_KERNEL_MINOR], "8");
        assert!(!annotations[OWNED_ANNOTATION].contains("pci-"));
        assert_eq!(step(&want2, &mut labels, &mut annotations), None);

        // Nothing left to own: the record goes too.
        let patch = step(&Labels::new(), &mut labels, &mut annotations).unwrap();
        assert_eq!(
            patch.annotations,
            BTreeMap::from([(OWNED_ANNOTATION.to_string(), None)])
        );
        assert!(!labels.keys().any(|k| k.starts_with(NFD_PREFIX)));
        assert_eq!(step(&Labels::new(), &mut labels, &mut annotations), None);
    }

    #[test]
    fn labels_someone_else_wrote_are_left_alone() {
        let want = desired();
        let mut labels = map(&[
            (NFD_OS_ID, "custom"),              // same key, another writer
            (NFD_KERNEL, "5.15.0-127-generic"), // same key and value, another writer
            ("feature.node.kubernetes.io/custom", "x"),
        ]);
        let mut annotations = Labels::new();
        let patch = step(&want, &mut labels, &mut annotations).unwrap();
        assert!(!patch.labels.set.contains_key(NFD_OS_ID));
        assert!(!patch.labels.set.contains_key(NFD_KERNEL));
        assert_eq!(labels[NFD_OS_ID], "custom");
        let owned = owned_labels(&annotations);
        assert!(!owned.contains(NFD_OS_ID) && !owned.contains(NFD_KERNEL));

        // Even once not desired, they stay: we never owned them.
        step(&Labels::new(), &mut labels, &mut annotations);
        assert_eq!(labels[NFD_OS_ID], "custom");
        assert_eq!(labels[NFD_KERNEL], "5.15.0-127-generic");
        assert_eq!(labels["feature.node.kubernetes.io/custom"], "x");
    }

    #[test]
    fn a_tampered_ownership_record_cannot_remove_other_labels() {
        let mut labels = map(&[
            ("kubernetes.io/hostname", "n"),
            ("nvidia.com/gpu.present", "true"),
            ("feature.node.kubernetes.io/cpu-model.id", "143"),
        ]);
        let mut annotations = map(&[(
            OWNED_ANNOTATION,
            " cpu-model.id ,kubernetes.io/hostname,,../nvidia.com/gpu.present,-bad-",
        )]);
        let patch = step(&Labels::new(), &mut labels, &mut annotations).unwrap();
        // Listed under the NFD prefix: ours by the record, so removed.
        assert_eq!(patch.labels.remove, vec![nfd("cpu-model.id")]);
        assert_eq!(labels["kubernetes.io/hostname"], "n");
        assert_eq!(labels["nvidia.com/gpu.present"], "true");
        assert!(!annotations.contains_key(OWNED_ANNOTATION));
    }

    #[test]
    fn a_garbled_record_is_rewritten_once() {
        let want = desired();
        let (mut labels, mut annotations) = (Labels::new(), Labels::new());
        step(&want, &mut labels, &mut annotations);
        let canonical = annotations[OWNED_ANNOTATION].clone();
        annotations.insert(OWNED_ANNOTATION.into(), canonical.replace(',', " , "));
        let patch = step(&want, &mut labels, &mut annotations).unwrap();
        assert!(patch.labels.is_empty());
        assert_eq!(annotations[OWNED_ANNOTATION], canonical);
        assert_eq!(step(&want, &mut labels, &mut annotations), None);
    }

    #[test]
    fn huge_inputs_are_bounded() {
        let big =
            "ID=ubuntu\n".to_string() + &"X=y\n".repeat(MAX_OS_RELEASE_BYTES) + "VERSION_ID=1\n";
        assert_eq!(os_release_labels(&big), map(&[(NFD_OS_ID, "ubuntu")]));
        assert!(kernel_labels(&"5".repeat(1 << 20)).is_empty());
        let many: Labels = (0..MAX_LABELS * 2)
            .map(|i| (nfd(&format!("l{i}")), "true".to_string()))
            .collect();
        let patch = plan_node_patch(&many, &Labels::new(), &Labels::new()).unwrap();
        assert_eq!(patch.labels.set.len(), MAX_LABELS);
        // A multi-byte character across the cut does not panic.
        let text = format!("ID=a\n{}é", "x".repeat(MAX_OS_RELEASE_BYTES - 6));
        assert_eq!(os_release_labels(&text), map(&[(NFD_OS_ID, "a")]));
    }

    fn label_key() -> impl Strategy<Value = String> {
        prop_oneof![
            // Keys the agent computes, and others under the NFD prefix.
            prop::sample::select(vec![
                "pci-10de.present",
                "pci-0302_10de.present",
                "pci-0302_10de_2330.present",
                "system-os_release.ID",
                "kernel-version.full",
                "custom",
            ])
            .prop_map(nfd),
            // Other labels, and malformed ones under the prefix.
            prop::sample::select(vec![
                "kubernetes.io/hostname",
                "nvidia.com/gpu.present",
                "feature.node.kubernetes.io/-bad",
                "feature.node.kubernetes.io/",
            ])
            .prop_map(String::from),
        ]
    }

    fn label_value() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("true".to_string()),
            Just("ubuntu".to_string()),
            Just(String::new()),
            Just("not valid".to_string()),
        ]
    }

    fn label_map() -> impl Strategy<Value = Labels> {
        prop::collection::btree_map(label_key(), label_value(), 0..8)
    }

    fn annotation_map() -> impl Strategy<Value = Labels> {
        let owned = prop::collection::vec(
            prop_oneof![
                label_key()
                    .prop_map(|k| k.strip_prefix(NFD_PREFIX).map(str::to_string).unwrap_or(k)),
                "[a-z ,./-]{0,12}",
            ],
            0..6,
        )
        .prop_map(|v| v.join(","));
        (prop::option::of(owned), any::<bool>()).prop_map(|(owned, nfd)| {
            let mut a = Labels::new();
            if let Some(owned) = owned {
                a.insert(OWNED_ANNOTATION.to_string(), owned);
            }
            if nfd {
                a.insert(
                    "nfd.node.kubernetes.io/feature-labels".to_string(),
                    String::new(),
                );
            }
            a
        })
    }

    proptest! {
        /// Applying the patch then deciding again yields no patch.
        #[test]
        fn planning_is_idempotent(want in label_map(), mut labels in label_map(), mut annotations in annotation_map()) {
            if let Some(patch) = plan_node_patch(&want, &labels, &annotations) {
                patch.apply_to(&mut labels, &mut annotations);
            }
            prop_assert_eq!(plan_node_patch(&want, &labels, &annotations), None);
        }

        /// Only labels the agent owned, or that were absent, are set; only
        /// owned ones are removed; only the ownership annotation is written.
        #[test]
        fn never_touches_labels_it_does_not_own(want in label_map(), labels in label_map(), annotations in annotation_map()) {
            let owned = owned_labels(&annotations);
            if let Some(patch) = plan_node_patch(&want, &labels, &annotations) {
                for key in patch.labels.set.keys() {
                    prop_assert!(is_ownable_label(key));
                    prop_assert!(!labels.contains_key(key) || owned.contains(key), "{}", key);
                }
                for key in &patch.labels.remove {
                    prop_assert!(owned.contains(key), "{}", key);
                }
                prop_assert!(patch.annotations.keys().all(|k| k == OWNED_ANNOTATION));
            }
        }

        /// NFD present: no patch at all.
        #[test]
        fn nfd_present_means_no_patch(want in label_map(), labels in label_map(), mut annotations in annotation_map()) {
            annotations.insert("nfd.node.kubernetes.io/feature-labels".into(), "pci-10de.present".into());
            prop_assert_eq!(plan_node_patch(&want, &labels, &annotations), None);
        }

        /// Any sysfs, os-release and kernel text gives valid labels, without panicking.
        #[test]
        fn computed_labels_are_valid(
            devices in prop::collection::vec(("(0x)?[0-9a-fA-F]{0,6}\\s?", "(0x)?[0-9a-f]{0,7}", ".{0,8}"), 0..6),
            os_release in "(([A-Z_]{0,10}=[\"']?[ -~é]{0,20}[\"']?)?\r?\n){0,6}",
            kernel in ".{0,80}",
        ) {
            let devices: Vec<PciDevice> = devices.into_iter().map(|(v, c, d)| PciDevice::new(v, c, d)).collect();
            for (key, value) in discover_labels(&devices, &os_release, &kernel) {
                prop_assert!(is_ownable_label(&key), "{}", key);
                prop_assert!(!value.is_empty() && is_valid_label_value(&value), "{}={}", key, value);
            }
        }
    }
}
