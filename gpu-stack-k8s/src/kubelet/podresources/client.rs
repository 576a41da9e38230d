//! A `List` client for the kubelet pod-resources socket.

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpu_stack_core::metrics::ContainerDevices;
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

use super::api::pod_resources_lister_client::PodResourcesListerClient;
use super::api::{ListPodResourcesRequest, ListPodResourcesResponse};

/// The kubelet's default pod-resources socket.
pub const DEFAULT_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";

/// Why a `List` call failed.
#[derive(Debug, thiserror::Error)]
pub enum PodResourcesError {
    /// The socket could not be reached.
    #[error(
        "cannot connect to the kubelet pod-resources socket {path}: {reason}; check that the kubelet runs and the socket is mounted (see --pod-resources-socket)"
    )]
    Connect {
        /// Socket path.
        path: PathBuf,
        /// Transport error.
        reason: tonic::transport::Error,
    },
    /// The kubelet answered with an error or the call timed out.
    #[error("kubelet pod-resources List on {path} failed: {status}")]
    Call {
        /// Socket path.
        path: PathBuf,
        /// gRPC status.
        status: Box<tonic::Status>,
    },
}

/// A client for one kubelet socket. The connection is made on first use and
/// re-made after a failure, so a restarted kubelet is picked up.
#[derive(Debug)]
pub struct PodResourcesClient {
    path: PathBuf,
    timeout: Duration,
    channel: Option<Channel>,
}

async fn unix_channel(path: &Path, timeout: Duration) -> Result<Channel, tonic::transport::Error> {
    let path = path.to_path_buf();
    Endpoint::from_static("http://localhost")
        .connect_timeout(timeout)
        .timeout(timeout)
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
}

impl PodResourcesClient {
    /// A client for the socket at `path`; each call gives up after `timeout`.
    pub fn new(path: impl Into<PathBuf>, timeout: Duration) -> Self {
        Self {
            path: path.into(),
            timeout,
            channel: None,
        }
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Calls `List` and returns the raw answer.
    pub async fn list_raw(&mut self) -> Result<ListPodResourcesResponse, PodResourcesError> {
        let channel = match &self.channel {
            Some(c) => c.clone(),
            None => {
                let c = unix_channel(&self.path, self.timeout)
                    .await
                    .map_err(|reason| PodResourcesError::Connect {
                        path: self.path.clone(),
                        reason,
                    })?;
                self.channel = Some(c.clone());
                c
            }
        };
        let mut client = PodResourcesListerClient::new(channel);
        match client.list(ListPodResourcesRequest {}).await {
            Ok(resp) => Ok(resp.into_inner()),
            Err(status) => {
                // Drop the channel so the next call reconnects (kubelet restart).
                self.channel = None;
                Err(PodResourcesError::Call {
                    path: self.path.clone(),
                    status: Box::new(status),
                })
            }
        }
    }

    /// Calls `List` and flattens the answer to one entry per container and resource.
    pub async fn list(&mut self) -> Result<Vec<ContainerDevices>, PodResourcesError> {
        Ok(flatten(&self.list_raw().await?))
    }
}

/// One [`ContainerDevices`] per container and device resource of the answer.
pub fn flatten(resp: &ListPodResourcesResponse) -> Vec<ContainerDevices> {
    let mut out = Vec::new();
    for pod in &resp.pod_resources {
        for c in &pod.containers {
            for d in &c.devices {
                out.push(ContainerDevices {
                    pod: pod.name.clone(),
                    namespace: pod.namespace.clone(),
                    container: c.name.clone(),
                    resource_name: d.resource_name.clone(),
                    device_ids: d.device_ids.clone(),
                });
            }
        }
    }
    out
}
