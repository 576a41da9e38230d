//! Where the control plane's sources, cached binaries and runtime state live,
//! and which loopback ports it uses.
use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

use crate::versions::{ContainerdRelease, KubeRelease};

/// Default first port; six consecutive ports from here are used.
pub const DEFAULT_PORT_BASE: u16 = 26440;

/// Environment variable the end-to-end helper reads to find the cluster.
pub const E2E_KUBECONFIG_ENV: &str = "GPU_STACK_E2E_KUBECONFIG";

/// Environment variable naming the real node's directory (`<state>/node`)
/// for the end-to-end tests that use it.
pub const E2E_NODE_DIR_ENV: &str = "GPU_STACK_E2E_NODE_DIR";

/// Environment variable telling the end-to-end tests the Kubernetes minor
/// of the cluster (`37`), for checks that differ by version.
pub const E2E_KUBE_MINOR_ENV: &str = "GPU_STACK_E2E_KUBE_MINOR";

/// Environment variable telling the end-to-end tests the real node's
/// containerd series (`2.3`).
pub const E2E_CONTAINERD_ENV: &str = "GPU_STACK_E2E_CONTAINERD";

/// Annotation kwok is told to manage; fake nodes carry it.
pub const KWOK_NODE_SELECTOR: &str = "kwok.x-k8s.io/node=fake";

/// The six loopback ports of a cluster.
#[derive(Clone, Copy, Debug)]
pub struct Ports {
    pub etcd_client: u16,
    pub etcd_peer: u16,
    pub apiserver: u16,
    pub controller_manager: u16,
    pub scheduler: u16,
    pub kwok: u16,
}

impl Ports {
    fn from_base(base: u16) -> Result<Self> {
        if !(1024..=u16::MAX - 6).contains(&base) {
            bail!(
                "port base {base} is out of range: pick a value between 1024 and {} \
                 (--port-base or GPU_STACK_CLUSTER_PORT_BASE)",
                u16::MAX - 6
            );
        }
        Ok(Self {
            etcd_client: base,
            etcd_peer: base + 1,
            apiserver: base + 2,
            controller_manager: base + 3,
            scheduler: base + 4,
            kwok: base + 5,
        })
    }

    /// Every port with the component that listens on it.
    pub fn all(&self) -> [(&'static str, u16); 6] {
        [
            ("etcd (client)", self.etcd_client),
            ("etcd (peer)", self.etcd_peer),
            ("kube-apiserver", self.apiserver),
            ("kube-controller-manager", self.controller_manager),
            ("kube-scheduler", self.scheduler),
            ("kwok", self.kwok),
        ]
    }
}

/// Resolved paths and ports for one invocation.
#[derive(Clone, Debug)]
pub struct Layout {
    pub repo: PathBuf,
    pub state: PathBuf,
    pub cache: PathBuf,
    pub ports: Ports,
    /// The Kubernetes release of the control plane and the real node's kubelet.
    pub kube: KubeRelease,
    /// The real node's containerd.
    pub containerd: ContainerdRelease,
}

impl Layout {
    pub fn new(
        state: Option<PathBuf>,
        cache: Option<PathBuf>,
        port_base: u16,
        kube: KubeRelease,
        containerd: ContainerdRelease,
    ) -> Result<Self> {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        let state = state.unwrap_or_else(|| repo.join(".cache").join("cluster"));
        let cache = match cache {
            Some(dir) => dir,
            None => default_cache_dir()?,
        };
        Ok(Self {
            state: absolute(&state),
            cache: absolute(&cache),
            repo,
            ports: Ports::from_base(port_base)?,
            kube,
            containerd,
        })
    }

    /// Go wrapper modules (committed).
    pub fn tools(&self) -> PathBuf {
        self.repo.join("tools").join("control-plane")
    }

    /// Where every release combination's binaries are cached.
    pub fn bins_root(&self) -> PathBuf {
        self.cache.join("bin")
    }

    /// Built binaries of this layout's releases (cached, never committed).
    pub fn bin(&self) -> PathBuf {
        self.bins_root().join(format!(
            "k8s-{}-containerd-{}",
            self.kube.version, self.containerd.version
        ))
    }

    /// The Kubernetes wrapper module of this layout's release.
    pub fn kube_module(&self) -> PathBuf {
        self.tools()
            .join("k8s")
            .join(format!("1.{}", self.kube.minor))
    }

    /// The containerd wrapper module of this layout's release.
    pub fn containerd_module(&self) -> PathBuf {
        self.repo
            .join("tools")
            .join("node")
            .join("containerd")
            .join(self.containerd.series)
    }

    pub fn binary(&self, name: &str) -> PathBuf {
        self.bin().join(name)
    }

    pub fn pki(&self) -> PathBuf {
        self.state.join("pki")
    }

    pub fn logs(&self) -> PathBuf {
        self.state.join("logs")
    }

    pub fn pids(&self) -> PathBuf {
        self.state.join("pids")
    }

    pub fn kubeconfig(&self) -> PathBuf {
        self.state.join("kubeconfig")
    }

    pub fn apiserver_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.ports.apiserver)
    }
}

/// `$XDG_CACHE_HOME/gpu-stack/control-plane`, else `~/.cache/...`: outside the
/// checkout so a fresh clone (as CI uses) reuses the binaries.
fn default_cache_dir() -> Result<PathBuf> {
    if let Some(xdg) = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(xdg).join("gpu-stack").join("control-plane"));
    }
    match std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        Some(home) => Ok(PathBuf::from(home)
            .join(".cache")
            .join("gpu-stack")
            .join("control-plane")),
        None => bail!(
            "neither XDG_CACHE_HOME nor HOME is set: pass --cache-dir (or set \
             GPU_STACK_CONTROL_PLANE_CACHE) to say where control-plane binaries are cached"
        ),
    }
}

fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn six_distinct_consecutive_ports() {
        let ports = Ports::from_base(DEFAULT_PORT_BASE).unwrap();
        let mut all: Vec<u16> = ports.all().iter().map(|(_, p)| *p).collect();
        all.dedup();
        assert_eq!(all.len(), 6);
        assert_eq!(all[0], DEFAULT_PORT_BASE);
        assert_eq!(all[5], DEFAULT_PORT_BASE + 5);
    }

    #[test]
    fn privileged_or_overflowing_port_bases_are_rejected() {
        for base in [0, 80, 1023, u16::MAX - 5, u16::MAX] {
            let err = Ports::from_base(base).unwrap_err().to_string();
            assert!(err.contains("--port-base"), "{base}: {err}");
        }
    }
}
