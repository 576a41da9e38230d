//! The Kubernetes and containerd releases the test cluster and the real node
//! are built at: the supported matrix, its default, and what differs by
//! version (feature gates, containerd's config version).
use std::fmt;

use anyhow::{Result, bail};

/// A Kubernetes release with a wrapper module in `tools/control-plane/k8s/1.<minor>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KubeRelease {
    /// Minor (1.<minor>).
    pub minor: u32,
    /// The `k8s.io/kubernetes` tag the module pins.
    pub version: &'static str,
    /// Feature gates every component gets (empty: none).
    pub feature_gates: &'static str,
}

/// Supported Kubernetes minors, oldest first (the newest is the default).
///
/// `DRAPartitionableDevices` (KEP-4815: shared counters, which make one
/// GPU's MIG devices exclude each other) is alpha and off in 1.35: without
/// it the API server drops `sharedCounters` and `consumesCounters` and the
/// scheduler allocates no device that consumes counters. It is beta and on
/// from 1.36, which needs no gate at all.
pub const KUBE_RELEASES: [KubeRelease; 3] = [
    KubeRelease {
        minor: 35,
        version: "v1.35.4",
        feature_gates: "DRAPartitionableDevices=true",
    },
    KubeRelease {
        minor: 36,
        version: "v1.36.3",
        feature_gates: "",
    },
    KubeRelease {
        minor: 37,
        version: "v1.37.2",
        feature_gates: "",
    },
];

/// The Kubernetes minor used unless `--kube-version` says otherwise.
pub const DEFAULT_KUBE: &str = "1.37";

impl fmt::Display for KubeRelease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "1.{}", self.minor)
    }
}

/// A containerd release with a wrapper module in `tools/node/containerd/<series>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContainerdRelease {
    /// `major.minor`.
    pub series: &'static str,
    /// The tag the module pins.
    pub version: &'static str,
    /// The Go module the commands come from.
    pub module: &'static str,
    /// The config version it reads (`version = N` in config.toml).
    pub config_version: u32,
}

/// Supported containerd series: 2.3 (long-term support, the default), 2.4
/// (the newest) and 1.7 (past its support, still on many nodes).
pub const CONTAINERD_RELEASES: [ContainerdRelease; 3] = [
    ContainerdRelease {
        series: "2.3",
        version: "v2.3.7",
        module: "github.com/containerd/containerd/v2",
        config_version: 3,
    },
    ContainerdRelease {
        series: "2.4",
        version: "v2.4.2",
        module: "github.com/containerd/containerd/v2",
        config_version: 3,
    },
    ContainerdRelease {
        series: "1.7",
        version: "v1.7.35",
        module: "github.com/containerd/containerd",
        config_version: 2,
    },
];

/// The containerd series used unless `--containerd-version` says otherwise.
pub const DEFAULT_CONTAINERD: &str = "2.3";

impl fmt::Display for ContainerdRelease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.series)
    }
}

/// `1.37`, `v1.37` or `1.37.2` (the patch must be the pinned one).
pub fn kube(text: &str) -> Result<KubeRelease> {
    let wanted = text.trim().trim_start_matches('v');
    for release in KUBE_RELEASES {
        let minor = format!("1.{}", release.minor);
        if wanted == minor || wanted == release.version.trim_start_matches('v') {
            return Ok(release);
        }
    }
    bail!(
        "Kubernetes {text:?} is not in the test matrix: pass --kube-version with one of {} \
         (to add a release, run tools/control-plane/k8s/new-version.sh v1.MINOR.PATCH and \
         list it in xtask/src/versions.rs)",
        KUBE_RELEASES
            .iter()
            .map(|r| format!("1.{} ({})", r.minor, r.version))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// `2.3`, `v2.3` or `2.3.7` (the patch must be the pinned one).
pub fn containerd(text: &str) -> Result<ContainerdRelease> {
    let wanted = text.trim().trim_start_matches('v');
    for release in CONTAINERD_RELEASES {
        if wanted == release.series || wanted == release.version.trim_start_matches('v') {
            return Ok(release);
        }
    }
    bail!(
        "containerd {text:?} is not in the test matrix: pass --containerd-version with one of {}",
        CONTAINERD_RELEASES
            .iter()
            .map(|r| format!("{} ({})", r.series, r.version))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::path::Path;

    fn repo() -> &'static Path {
        Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
    }

    #[test]
    fn names_resolve_and_unknown_ones_list_the_matrix() {
        assert_eq!(kube("1.37").unwrap().version, "v1.37.2");
        assert_eq!(kube("v1.35").unwrap().minor, 35);
        assert_eq!(kube("1.36.3").unwrap().minor, 36);
        assert_eq!(kube(DEFAULT_KUBE).unwrap().minor, 37);
        let err = kube("1.34").unwrap_err().to_string();
        assert!(
            err.contains("1.35 (v1.35.4)") && err.contains("--kube-version"),
            "{err}"
        );
        assert!(kube("1.36.1").is_err());
        assert_eq!(containerd("2.3").unwrap().config_version, 3);
        assert_eq!(containerd("1.7.35").unwrap().config_version, 2);
        let err = containerd("2.0").unwrap_err().to_string();
        assert!(err.contains("2.4 (v2.4.2)"), "{err}");
    }

    #[test]
    fn only_1_35_needs_the_partitionable_devices_gate() {
        for r in KUBE_RELEASES {
            assert_eq!(
                r.feature_gates.contains("DRAPartitionableDevices=true"),
                r.minor < 36,
                "{r}"
            );
        }
    }

    /// Each release's wrapper module pins the version listed here, with every
    /// staging module replaced at the matching v0 version.
    #[test]
    fn wrapper_modules_pin_the_listed_versions() {
        for r in KUBE_RELEASES {
            let go_mod = fs::read_to_string(
                repo().join(format!("tools/control-plane/k8s/1.{}/go.mod", r.minor)),
            )
            .unwrap();
            assert!(
                go_mod.contains(&format!("k8s.io/kubernetes {}", r.version)),
                "{r}"
            );
            let patch = r.version.trim_start_matches("v1.");
            let replaces: Vec<&str> = go_mod
                .lines()
                .filter(|l| l.contains("=> k8s.io/"))
                .collect();
            assert!(replaces.len() >= 29, "{r}: {replaces:?}");
            assert!(
                replaces.iter().all(|l| l.ends_with(&format!("v0.{patch}"))),
                "{r}"
            );
        }
        for r in CONTAINERD_RELEASES {
            let go_mod = fs::read_to_string(
                repo().join(format!("tools/node/containerd/{}/go.mod", r.series)),
            )
            .unwrap();
            assert!(
                go_mod.contains(&format!("{} {}", r.module, r.version)),
                "{r}"
            );
        }
    }
}
