//! Helpers for gpu-stack's end-to-end tests against a real Kubernetes control
//! plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler built
//! from their Go modules, kwok simulating the kubelets).
//!
//! [`TestCluster::attach`] finds the cluster that `cargo xtask test` (or
//! `cargo xtask cluster up`) started; without one it fails with a message that
//! says how to start it, so end-to-end tests never pass silently.
//! [`GpuFleet`] describes fake GPU nodes as node feature discovery would label
//! them; kwok keeps them Ready and runs the pods bound to them.
pub mod binaries;
pub mod chart;
pub mod dra;
pub mod migmanager;
pub mod partition;
pub mod upgrade;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::{DaemonSet, DaemonSetSpec};
use k8s_openapi::api::core::v1::{
    Container, Namespace, Node, NodeAddress, NodeStatus, NodeSystemInfo, PodSpec, PodTemplateSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kube::ResourceExt;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};

/// Environment variable naming the test cluster's kubeconfig (set by
/// `cargo xtask test`).
pub const KUBECONFIG_ENV: &str = "GPU_STACK_E2E_KUBECONFIG";

/// Annotation key kwok is started with (`--manage-nodes-with-annotation-selector`).
pub const KWOK_ANNOTATION: &str = "kwok.x-k8s.io/node";
/// Annotation value that hands a node to kwok.
pub const KWOK_ANNOTATION_VALUE: &str = "fake";

/// NFD label that marks a node with an NVIDIA (PCI vendor 10de) device.
pub const NFD_NVIDIA_PCI_LABEL: &str = "feature.node.kubernetes.io/pci-10de.present";
/// Extended resource the device plugin advertises.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// Container runtime version the fake nodes report.
pub const CONTAINER_RUNTIME_VERSION: &str = "containerd://1.7.24";
/// Kernel the fake nodes report (and label, as NFD does).
pub const KERNEL_VERSION: &str = "5.15.0-127-generic";

/// Errors of the end-to-end helpers.
#[derive(Debug, thiserror::Error)]
pub enum E2eError {
    /// No cluster to attach to.
    #[error(
        "no test cluster: {0}. Run the end-to-end tests with `cargo xtask test`, or start a \
         cluster with `cargo xtask cluster up` and run `cargo test` again"
    )]
    NoCluster(String),
    /// The kubeconfig could not be read or used.
    #[error("test cluster kubeconfig {path}: {message}")]
    Kubeconfig {
        /// The kubeconfig path.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// An API call failed.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// A condition did not hold in time.
    #[error("timed out after {secs}s waiting for {what}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// The bound, in seconds.
        secs: u64,
    },
    /// The fleet description cannot produce valid nodes.
    #[error("invalid fake GPU fleet: {0}")]
    InvalidFleet(String),
    /// A check inside a wait found a state that cannot turn good.
    #[error("{0}")]
    Check(String),
}

/// A running test cluster and a client for it.
#[derive(Clone)]
pub struct TestCluster {
    client: Client,
    kubeconfig: PathBuf,
}

impl TestCluster {
    /// Attaches to the test cluster: `$GPU_STACK_E2E_KUBECONFIG` if set, else
    /// the kubeconfig of a cluster started by `cargo xtask cluster up` in this
    /// checkout. Fails (never skips) when neither answers.
    pub async fn attach() -> Result<Self, E2eError> {
        let kubeconfig = match std::env::var_os(KUBECONFIG_ENV).filter(|v| !v.is_empty()) {
            Some(path) => PathBuf::from(path),
            None => {
                let default = default_kubeconfig();
                if !default.is_file() {
                    return Err(E2eError::NoCluster(format!(
                        "{KUBECONFIG_ENV} is not set and {} does not exist",
                        default.display()
                    )));
                }
                default
            }
        };
        let config_err = |message: String| E2eError::Kubeconfig {
            path: kubeconfig.clone(),
            message,
        };
        let raw = Kubeconfig::read_from(&kubeconfig).map_err(|e| config_err(e.to_string()))?;
        let config = Config::from_custom_kubeconfig(raw, &KubeConfigOptions::default())
            .await
            .map_err(|e| config_err(e.to_string()))?;
        let client = Client::try_from(config).map_err(|e| config_err(e.to_string()))?;
        if let Err(err) = client.apiserver_version().await {
            return Err(E2eError::NoCluster(format!(
                "the API server of {} does not answer ({err})",
                kubeconfig.display()
            )));
        }
        Ok(Self { client, kubeconfig })
    }

    /// A client with admin rights on the cluster.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// The kubeconfig in use.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Creates a namespace named `<prefix>-<unique suffix>` and returns its name.
    pub async fn create_namespace(&self, prefix: &str) -> Result<String, E2eError> {
        let name = format!("{prefix}-{}", unique_suffix());
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        Api::<Namespace>::all(self.client())
            .create(&PostParams::default(), &ns)
            .await?;
        Ok(name)
    }

    /// Deletes a namespace (its objects go with it).
    pub async fn delete_namespace(&self, name: &str) -> Result<(), E2eError> {
        ignore_not_found(
            Api::<Namespace>::all(self.client())
                .delete(name, &DeleteParams::default())
                .await
                .map(|_| ()),
        )
    }

    /// Creates every node of `fleet` (16 requests in flight) and returns their names.
    pub async fn create_gpu_nodes(&self, fleet: &GpuFleet) -> Result<Vec<String>, E2eError> {
        let nodes = fleet.nodes()?;
        let api = Api::<Node>::all(self.client());
        let names: Vec<String> = nodes
            .iter()
            .filter_map(|n| n.metadata.name.clone())
            .collect();
        futures::stream::iter(nodes.into_iter().map(|node| {
            let api = api.clone();
            async move { api.create(&PostParams::default(), &node).await.map(|_| ()) }
        }))
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await?;
        Ok(names)
    }

    /// Deletes the named nodes (missing ones are fine).
    pub async fn delete_nodes(&self, names: &[String]) -> Result<(), E2eError> {
        let api = Api::<Node>::all(self.client());
        futures::stream::iter(
            names.iter().map(|name| {
                let api = api.clone();
                async move {
                    ignore_not_found(api.delete(name, &DeleteParams::default()).await.map(|_| ()))
                }
            }),
        )
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await?;
        Ok(())
    }
}

fn ignore_not_found(result: Result<(), kube::Error>) -> Result<(), E2eError> {
    match result {
        Err(kube::Error::Api(status)) if status.is_not_found() => Ok(()),
        other => other.map_err(E2eError::from),
    }
}

/// Kubeconfig written by `cargo xtask cluster up` in this checkout.
fn default_kubeconfig() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(".cache")
        .join("cluster")
        .join("kubeconfig")
}

/// Names of the nodes `<prefix>-...` (a test's own), or none when they cannot
/// be listed (for teardown, which goes on whatever happened).
pub async fn nodes_with_prefix(client: &Client, prefix: &str) -> Vec<String> {
    let own = format!("{prefix}-");
    match Api::<Node>::all(client.clone())
        .list_metadata(&ListParams::default())
        .await
    {
        Ok(list) => list
            .items
            .iter()
            .map(ResourceExt::name_any)
            .filter(|n| n.starts_with(&own))
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// The whole answer to a plain HTTP `GET path` from `addr` (`host:port` on
/// loopback), or an empty string when there is none within 5 s.
pub async fn http_get(addr: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let get = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream.write_all(req.as_bytes()).await.ok()?;
        let mut answer = String::new();
        let _ = stream.read_to_string(&mut answer).await;
        Some(answer)
    };
    tokio::time::timeout(Duration::from_secs(5), get)
        .await
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// `line` without its terminal colour codes (`ESC [ ... m`), as agents'
/// logs carry them.
pub fn strip_ansi(line: &str) -> String {
    let mut out = String::new();
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// A suffix unique within this machine for this run: process id, clock and a
/// counter, in lowercase hex (valid in DNS-1123 names).
pub fn unique_suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{:x}{:x}{n:x}", std::process::id(), nanos & 0xff_ffff_ffff)
}

/// A set of fake GPU nodes, labelled as node feature discovery labels a real
/// GPU node, handed to kwok through its annotation.
#[derive(Clone, Debug)]
pub struct GpuFleet {
    /// Node names are `<prefix>-<index>`.
    pub name_prefix: String,
    /// How many nodes.
    pub count: usize,
    /// `nvidia.com/gpu` capacity per node.
    pub gpus_per_node: u32,
    /// Labels added to every node (e.g. a per-test label to select them by).
    pub extra_labels: BTreeMap<String, String>,
}

impl GpuFleet {
    /// `count` nodes with 8 GPUs each, named `<name_prefix>-<index>`.
    pub fn new(name_prefix: impl Into<String>, count: usize) -> Self {
        Self {
            name_prefix: name_prefix.into(),
            count,
            gpus_per_node: 8,
            extra_labels: BTreeMap::new(),
        }
    }

    /// Sets the GPU count per node.
    pub fn with_gpus(mut self, gpus: u32) -> Self {
        self.gpus_per_node = gpus;
        self
    }

    /// Adds a label to every node.
    pub fn with_label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.extra_labels.insert(key.into(), value.into());
        self
    }

    /// The Node objects to create.
    pub fn nodes(&self) -> Result<Vec<Node>, E2eError> {
        // "-<index>" must still fit the 63-character label value limit
        // (kubernetes.io/hostname carries the name).
        let longest = format!("{}-{}", self.name_prefix, self.count.saturating_sub(1));
        if self.name_prefix.is_empty() || longest.len() > 63 {
            return Err(E2eError::InvalidFleet(format!(
                "node name prefix {:?} gives names up to {} characters; use 1 to {} characters",
                self.name_prefix,
                longest.len(),
                63usize.saturating_sub(longest.len() - self.name_prefix.len())
            )));
        }
        Ok((0..self.count)
            .map(|i| {
                fake_gpu_node(
                    &format!("{}-{i}", self.name_prefix),
                    self.gpus_per_node,
                    &self.extra_labels,
                )
            })
            .collect())
    }
}

/// One fake GPU node: NFD labels (NVIDIA PCI device, OS release, kernel),
/// `containerd://` runtime, `nvidia.com/gpu` capacity and the kwok annotation.
pub fn fake_gpu_node(name: &str, gpus: u32, extra_labels: &BTreeMap<String, String>) -> Node {
    let mut labels: BTreeMap<String, String> = [
        ("kubernetes.io/hostname", name),
        ("kubernetes.io/os", "linux"),
        ("kubernetes.io/arch", "amd64"),
        ("type", "kwok"),
        (NFD_NVIDIA_PCI_LABEL, "true"),
        ("feature.node.kubernetes.io/system-os_release.ID", "ubuntu"),
        (
            "feature.node.kubernetes.io/system-os_release.VERSION_ID",
            "22.04",
        ),
        (
            "feature.node.kubernetes.io/system-os_release.VERSION_ID.major",
            "22",
        ),
        (
            "feature.node.kubernetes.io/system-os_release.VERSION_ID.minor",
            "04",
        ),
        (
            "feature.node.kubernetes.io/kernel-version.full",
            KERNEL_VERSION,
        ),
        ("feature.node.kubernetes.io/kernel-version.major", "5"),
        ("feature.node.kubernetes.io/kernel-version.minor", "15"),
        ("feature.node.kubernetes.io/kernel-version.revision", "0"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    labels.extend(extra_labels.clone());

    let resources: BTreeMap<String, Quantity> = [
        ("cpu", "64".to_string()),
        ("memory", "512Gi".to_string()),
        ("pods", "110".to_string()),
        ("ephemeral-storage", "1Ti".to_string()),
        (GPU_RESOURCE, gpus.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), Quantity(v)))
    .collect();

    Node {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            labels: Some(labels),
            annotations: Some(BTreeMap::from([(
                KWOK_ANNOTATION.to_string(),
                KWOK_ANNOTATION_VALUE.to_string(),
            )])),
            ..ObjectMeta::default()
        },
        status: Some(NodeStatus {
            capacity: Some(resources.clone()),
            allocatable: Some(resources),
            addresses: Some(vec![NodeAddress {
                type_: "Hostname".to_string(),
                address: name.to_string(),
            }]),
            node_info: Some(NodeSystemInfo {
                architecture: "amd64".to_string(),
                operating_system: "linux".to_string(),
                os_image: "Ubuntu 22.04.5 LTS".to_string(),
                kernel_version: KERNEL_VERSION.to_string(),
                container_runtime_version: CONTAINER_RUNTIME_VERSION.to_string(),
                kubelet_version: kubelet_version(),
                ..NodeSystemInfo::default()
            }),
            ..NodeStatus::default()
        }),
        ..Node::default()
    }
}

/// The cluster's Kubernetes minor (`GPU_STACK_E2E_KUBE_MINOR`, which
/// `cargo xtask test` and `cargo xtask matrix` set), else 37, the default.
pub fn kube_minor() -> u32 {
    std::env::var("GPU_STACK_E2E_KUBE_MINOR")
        .ok()
        .and_then(|m| m.parse().ok())
        .unwrap_or(37)
}

/// The version fake nodes report for their kubelet: the cluster's minor.
fn kubelet_version() -> String {
    format!("v1.{}.0", kube_minor())
}

/// A DaemonSet named `name` whose pods (label `app=<app>`, one container
/// `probe`) go to the fake GPU nodes labelled `run_label=<run>`: the workload
/// the smoke test and the scale example roll out to check scheduling.
pub fn gpu_probe_daemonset(name: &str, app: &str, run_label: &str, run: &str) -> DaemonSet {
    let labels = BTreeMap::from([("app".to_string(), app.to_string())]);
    DaemonSet {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        spec: DaemonSetSpec {
            selector: LabelSelector {
                match_labels: Some(labels.clone()),
                ..LabelSelector::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    node_selector: Some(BTreeMap::from([
                        (NFD_NVIDIA_PCI_LABEL.to_string(), "true".to_string()),
                        (run_label.to_string(), run.to_string()),
                    ])),
                    containers: vec![Container {
                        name: "probe".into(),
                        image: Some("gpu-stack/e2e-probe:0".into()),
                        ..Container::default()
                    }],
                    ..PodSpec::default()
                }),
            },
            ..DaemonSetSpec::default()
        },
        ..DaemonSet::default()
    }
}

/// Polls `probe` every 250 ms until it yields `Some`, for at most `timeout`.
/// The bound only keeps a broken cluster from hanging the run; it is not a
/// speed assertion.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> Result<T, E2eError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>, E2eError>>,
{
    let poll = async {
        loop {
            if let Some(value) = probe().await? {
                return Ok(value);
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    };
    match tokio::time::timeout(timeout, poll).await {
        Ok(result) => result,
        Err(_) => Err(E2eError::Timeout {
            what: what.to_string(),
            secs: timeout.as_secs(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_node_carries_nfd_labels_runtime_capacity_and_kwok_marker() {
        let extra = BTreeMap::from([("run".to_string(), "x1".to_string())]);
        let node = fake_gpu_node("gpu-0", 4, &extra);
        let labels = node.metadata.labels.as_ref().unwrap();
        assert_eq!(labels[NFD_NVIDIA_PCI_LABEL], "true");
        assert_eq!(
            labels["feature.node.kubernetes.io/system-os_release.ID"],
            "ubuntu"
        );
        assert_eq!(
            labels["feature.node.kubernetes.io/kernel-version.full"],
            KERNEL_VERSION
        );
        assert_eq!(labels["run"], "x1");
        let annotations = node.metadata.annotations.as_ref().unwrap();
        assert_eq!(annotations[KWOK_ANNOTATION], KWOK_ANNOTATION_VALUE);
        let status = node.status.as_ref().unwrap();
        assert_eq!(status.capacity.as_ref().unwrap()[GPU_RESOURCE].0, "4");
        assert_eq!(status.allocatable.as_ref().unwrap()[GPU_RESOURCE].0, "4");
        let info = status.node_info.as_ref().unwrap();
        assert!(info.container_runtime_version.starts_with("containerd://"));
    }

    #[test]
    fn fleet_names_nodes_by_index() {
        let names: Vec<String> = GpuFleet::new("gpu", 3)
            .with_gpus(2)
            .nodes()
            .unwrap()
            .into_iter()
            .map(|n| n.metadata.name.unwrap())
            .collect();
        assert_eq!(names, ["gpu-0", "gpu-1", "gpu-2"]);
    }

    #[test]
    fn fleet_rejects_names_longer_than_a_label_value() {
        let err = GpuFleet::new("x".repeat(62), 10).nodes().unwrap_err();
        assert!(matches!(err, E2eError::InvalidFleet(_)), "{err}");
        assert!(GpuFleet::new("", 1).nodes().is_err());
    }

    #[test]
    fn unique_suffixes_differ_and_are_dns_safe() {
        let a = unique_suffix();
        let b = unique_suffix();
        assert_ne!(a, b);
        assert!(
            a.chars()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
    }
}
