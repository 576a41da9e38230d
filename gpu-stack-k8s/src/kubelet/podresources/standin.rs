//! A stand-in kubelet serving pod-resources v1 over a unix socket, with an
//! answer the test sets. Used by tests and benchmarks; it listens only on the
//! given socket path.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tokio::net::UnixListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::{Request, Response, Status};

use crate::kubelet::transport::unix_incoming;

use super::api::pod_resources_lister_server::{PodResourcesLister, PodResourcesListerServer};
use super::api::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices,
    ContainerResources, GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest,
    ListPodResourcesResponse, PodResources,
};

#[derive(Clone, Default)]
struct Lister {
    answer: Arc<Mutex<ListPodResourcesResponse>>,
    calls: Arc<Mutex<u64>>,
}

#[tonic::async_trait]
impl PodResourcesLister for Lister {
    async fn list(
        &self,
        _: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        if let Ok(mut c) = self.calls.lock() {
            *c += 1;
        }
        let answer = self
            .answer
            .lock()
            .map_err(|_| Status::internal("stand-in state poisoned"))?
            .clone();
        Ok(Response::new(answer))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        Ok(Response::new(AllocatableResourcesResponse::default()))
    }

    async fn get(
        &self,
        req: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        let req = req.into_inner();
        let answer = self
            .answer
            .lock()
            .map_err(|_| Status::internal("stand-in state poisoned"))?;
        let pod = answer
            .pod_resources
            .iter()
            .find(|p| p.name == req.pod_name && p.namespace == req.pod_namespace)
            .cloned()
            .ok_or_else(|| Status::not_found("no such pod"))?;
        Ok(Response::new(GetPodResourcesResponse {
            pod_resources: Some(pod),
        }))
    }
}

/// A running stand-in kubelet. Dropping it stops the server and removes the socket.
pub struct StandinKubelet {
    path: PathBuf,
    lister: Lister,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl StandinKubelet {
    /// Serves on a new socket at `path` (an existing file there is replaced).
    /// Must be called inside a tokio runtime.
    pub fn start(path: &Path) -> std::io::Result<Self> {
        Self::start_with(path, Lister::default())
    }

    fn start_with(path: &Path, lister: Lister) -> std::io::Result<Self> {
        let _ = std::fs::remove_file(path);
        let listener = UnixListener::bind(path)?;
        let (stop, stopped) = oneshot::channel::<()>();
        let svc = PodResourcesListerServer::new(lister.clone());
        let task = tokio::spawn(async move {
            // Like the kubelet, any `:authority` is accepted.
            let incoming = unix_incoming(listener);
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(Self {
            path: path.to_path_buf(),
            lister,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// Replaces the `List` answer.
    pub fn set(&self, answer: ListPodResourcesResponse) {
        if let Ok(mut a) = self.lister.answer.lock() {
            *a = answer;
        }
    }

    /// How many `List` calls were served.
    pub fn list_calls(&self) -> u64 {
        self.lister.calls.lock().map(|c| *c).unwrap_or(0)
    }

    /// Stops serving and removes the socket (a kubelet going down).
    pub async fn stop(mut self) {
        self.shutdown().await;
    }

    async fn shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(mut task) = self.task.take() {
            // Graceful first (connections get GOAWAY), then abort.
            if tokio::time::timeout(std::time::Duration::from_secs(3), &mut task)
                .await
                .is_err()
            {
                task.abort();
            }
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for StandinKubelet {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.abort();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Builds a `List` answer: `(pod, namespace, container, resource, device ids)`.
pub fn answer(pods: &[(&str, &str, &str, &str, &[&str])]) -> ListPodResourcesResponse {
    ListPodResourcesResponse {
        pod_resources: pods
            .iter()
            .map(|(pod, ns, container, resource, ids)| PodResources {
                name: pod.to_string(),
                namespace: ns.to_string(),
                containers: vec![ContainerResources {
                    name: container.to_string(),
                    devices: vec![ContainerDevices {
                        resource_name: resource.to_string(),
                        device_ids: ids.iter().map(|s| s.to_string()).collect(),
                        topology: None,
                    }],
                    ..Default::default()
                }],
                ..Default::default()
            })
            .collect(),
    }
}
