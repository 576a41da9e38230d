//! A kubelet stand-in for protocol tests and demos: serves `Registration` on
//! `<dir>/kubelet.sock` like the kubelet does, then dials each registered
//! plugin, reads its options and follows its `ListAndWatch` stream. It can
//! restart the way the kubelet does (delete every socket in the directory,
//! recreate `kubelet.sock`) and call `Allocate` / `GetPreferredAllocation`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::{Request, Response, Status};

use super::api;
use crate::kubelet::transport::{unix_channel, unix_incoming};

/// Errors of the stand-in.
#[derive(Debug, thiserror::Error)]
pub enum StandinError {
    /// Binding `kubelet.sock` failed.
    #[error("kubelet stand-in cannot listen on {path}: {source}")]
    Bind {
        /// Socket path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// Waiting for a condition took longer than the given bound.
    #[error("kubelet stand-in: timed out after {0:?} waiting for {1}")]
    Timeout(Duration, String),
    /// A resource is not registered.
    #[error("kubelet stand-in: resource {0} is not registered")]
    NotRegistered(String),
    /// Talking to a plugin failed.
    #[error("kubelet stand-in: plugin call failed: {0}")]
    Plugin(String),
}

/// One accepted registration.
#[derive(Debug, Clone, PartialEq)]
pub struct Registration {
    /// Resource name.
    pub resource: String,
    /// Endpoint file name.
    pub endpoint: String,
    /// Options read back with `GetDevicePluginOptions`.
    pub options: api::DevicePluginOptions,
    /// Stand-in generation (incremented on each restart) that accepted it.
    pub generation: u64,
}

/// What the stand-in knows, as the kubelet's device manager would.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KubeletView {
    /// Every registration, in order.
    pub registrations: Vec<Registration>,
    /// Latest device list per resource (from `ListAndWatch`).
    pub devices: BTreeMap<String, Vec<api::Device>>,
    /// Number of `ListAndWatch` messages per resource.
    pub updates: BTreeMap<String, u64>,
    /// Resources whose stream ended (plugin disconnected).
    pub disconnected: Vec<String>,
}

impl KubeletView {
    /// Healthy device ids of a resource.
    pub fn healthy(&self, resource: &str) -> Vec<String> {
        self.devices
            .get(resource)
            .map(|d| {
                d.iter()
                    .filter(|d| d.health == "Healthy")
                    .map(|d| d.id.clone())
                    .collect()
            })
            .unwrap_or_default()
    }
}

struct Shared {
    dir: PathBuf,
    generation: Mutex<u64>,
    view: watch::Sender<KubeletView>,
    plugins: Mutex<BTreeMap<String, PathBuf>>,
}

#[derive(Clone)]
struct RegistrationService {
    shared: Arc<Shared>,
}

#[tonic::async_trait]
impl api::registration_server::Registration for RegistrationService {
    async fn register(
        &self,
        request: Request<api::RegisterRequest>,
    ) -> Result<Response<api::Empty>, Status> {
        let r = request.into_inner();
        if r.version != "v1beta1" {
            return Err(Status::invalid_argument(format!(
                "unsupported version {:?}",
                r.version
            )));
        }
        let (domain, _) = r.resource_name.split_once('/').ok_or_else(|| {
            Status::invalid_argument(format!(
                "{:?} is not an extended resource name",
                r.resource_name
            ))
        })?;
        if !domain.contains('.') || domain.ends_with("kubernetes.io") {
            return Err(Status::invalid_argument(format!(
                "{:?} is not an extended resource name",
                r.resource_name
            )));
        }
        let path = self.shared.dir.join(&r.endpoint);
        // Like the kubelet: dial synchronously, read the options, then follow ListAndWatch.
        let channel = tokio::time::timeout(Duration::from_secs(10), unix_channel(&path))
            .await
            .map_err(|_| Status::unavailable("dial timed out"))?
            .map_err(|e| Status::unavailable(format!("cannot dial {}: {e}", path.display())))?;
        let mut client = api::device_plugin_client::DevicePluginClient::new(channel);
        let options = client
            .get_device_plugin_options(api::Empty {})
            .await?
            .into_inner();
        let mut stream = client.list_and_watch(api::Empty {}).await?.into_inner();
        let generation = *self
            .shared
            .generation
            .lock()
            .map_err(|_| Status::internal("poisoned"))?;
        self.shared
            .plugins
            .lock()
            .map_err(|_| Status::internal("poisoned"))?
            .insert(r.resource_name.clone(), path);
        let resource = r.resource_name.clone();
        self.shared.view.send_modify(|v| {
            v.registrations.push(Registration {
                resource: resource.clone(),
                endpoint: r.endpoint.clone(),
                options,
                generation,
            });
            v.disconnected.retain(|d| d != &resource);
        });
        let shared = self.shared.clone();
        tokio::spawn(async move {
            loop {
                match stream.message().await {
                    Ok(Some(msg)) => shared.view.send_modify(|v| {
                        v.devices.insert(resource.clone(), msg.devices);
                        *v.updates.entry(resource.clone()).or_default() += 1;
                    }),
                    _ => {
                        shared
                            .view
                            .send_modify(|v| v.disconnected.push(resource.clone()));
                        return;
                    }
                }
            }
        });
        Ok(Response::new(api::Empty {}))
    }
}

/// A running kubelet stand-in.
pub struct KubeletStandin {
    shared: Arc<Shared>,
    server: Option<(watch::Sender<bool>, JoinHandle<()>)>,
}

impl KubeletStandin {
    /// Starts serving `kubelet.sock` in `dir`.
    pub async fn start(dir: &Path) -> Result<KubeletStandin, StandinError> {
        let shared = Arc::new(Shared {
            dir: dir.to_path_buf(),
            generation: Mutex::new(1),
            view: watch::channel(KubeletView::default()).0,
            plugins: Mutex::new(BTreeMap::new()),
        });
        let mut k = KubeletStandin {
            shared,
            server: None,
        };
        k.serve()?;
        Ok(k)
    }

    fn serve(&mut self) -> Result<(), StandinError> {
        let path = self.socket_path();
        let _ = std::fs::remove_file(&path);
        let listener =
            UnixListener::bind(&path).map_err(|source| StandinError::Bind { path, source })?;
        let (stop, mut stop_rx) = watch::channel(false);
        let svc = RegistrationService {
            shared: self.shared.clone(),
        };
        let handle = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(api::registration_server::RegistrationServer::new(svc))
                .serve_with_incoming_shutdown(unix_incoming(listener), async move {
                    let _ = stop_rx.wait_for(|s| *s).await;
                })
                .await;
        });
        self.server = Some((stop, handle));
        Ok(())
    }

    /// Path of `kubelet.sock`.
    pub fn socket_path(&self) -> PathBuf {
        self.shared.dir.join("kubelet.sock")
    }

    /// Current view.
    pub fn view(&self) -> KubeletView {
        self.shared.view.borrow().clone()
    }

    /// Waits (bounded) until `cond` holds on the view; returns that view.
    pub async fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        cond: impl Fn(&KubeletView) -> bool,
    ) -> Result<KubeletView, StandinError> {
        let mut rx = self.shared.view.subscribe();
        match tokio::time::timeout(timeout, rx.wait_for(|v| cond(v))).await {
            Ok(Ok(v)) => Ok(v.clone()),
            _ => Err(StandinError::Timeout(timeout, what.to_string())),
        }
    }

    /// Restarts like the kubelet: stop serving, delete every socket in the
    /// directory (not other files), forget connections, recreate `kubelet.sock`.
    pub async fn restart(&mut self) -> Result<(), StandinError> {
        if let Some((stop, handle)) = self.server.take() {
            let _ = stop.send(true);
            handle.abort();
            let _ = handle.await;
        }
        if let Ok(entries) = std::fs::read_dir(&self.shared.dir) {
            use std::os::unix::fs::FileTypeExt;
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_socket()) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        if let Ok(mut g) = self.shared.generation.lock() {
            *g += 1;
        }
        self.serve()
    }

    /// Current generation (1 at start, +1 per restart).
    pub fn generation(&self) -> u64 {
        self.shared.generation.lock().map(|g| *g).unwrap_or(0)
    }

    async fn client(
        &self,
        resource: &str,
    ) -> Result<
        api::device_plugin_client::DevicePluginClient<tonic::transport::Channel>,
        StandinError,
    > {
        let path = self
            .shared
            .plugins
            .lock()
            .ok()
            .and_then(|p| p.get(resource).cloned())
            .ok_or_else(|| StandinError::NotRegistered(resource.to_string()))?;
        let channel = unix_channel(&path)
            .await
            .map_err(|e| StandinError::Plugin(e.to_string()))?;
        Ok(api::device_plugin_client::DevicePluginClient::new(channel))
    }

    /// A client to a registered plugin, for repeated calls.
    pub async fn plugin_client(
        &self,
        resource: &str,
    ) -> Result<
        api::device_plugin_client::DevicePluginClient<tonic::transport::Channel>,
        StandinError,
    > {
        self.client(resource).await
    }

    /// Calls `Allocate` for one container, as the kubelet does.
    pub async fn allocate(
        &self,
        resource: &str,
        ids: &[String],
    ) -> Result<api::ContainerAllocateResponse, Status> {
        let mut c = self
            .client(resource)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let resp = c
            .allocate(api::AllocateRequest {
                container_requests: vec![api::ContainerAllocateRequest {
                    devices_ids: ids.to_vec(),
                }],
            })
            .await?
            .into_inner();
        resp.container_responses
            .into_iter()
            .next()
            .ok_or_else(|| Status::internal("empty Allocate response"))
    }

    /// Calls `GetPreferredAllocation` for one container.
    pub async fn preferred(
        &self,
        resource: &str,
        available: &[String],
        must: &[String],
        size: i32,
    ) -> Result<Vec<String>, Status> {
        let mut c = self
            .client(resource)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let resp = c
            .get_preferred_allocation(api::PreferredAllocationRequest {
                container_requests: vec![api::ContainerPreferredAllocationRequest {
                    available_device_i_ds: available.to_vec(),
                    must_include_device_i_ds: must.to_vec(),
                    allocation_size: size,
                }],
            })
            .await?
            .into_inner();
        Ok(resp
            .container_responses
            .into_iter()
            .next()
            .map(|r| r.device_i_ds)
            .unwrap_or_default())
    }

    /// Stops serving and removes `kubelet.sock`.
    pub async fn stop(mut self) {
        if let Some((stop, handle)) = self.server.take() {
            let _ = stop.send(true);
            handle.abort();
            let _ = handle.await;
        }
        let _ = std::fs::remove_file(self.socket_path());
    }
}
