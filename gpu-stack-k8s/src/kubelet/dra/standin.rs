//! A kubelet stand-in for DRA protocol tests and demos: polls a registry
//! directory the way the kubelet's plugin watcher watches it, registers each
//! new socket as the 1.34 kubelet does (`GetInfo`, type and service checks,
//! `NotifyRegistrationStatus`), deregisters removed ones, and calls
//! `NodePrepareResources` / `NodeUnprepareResources` on a registered driver
//! over its unix socket.
//!
//! It is a little stricter than the kubelet, which connects to the endpoint
//! lazily: it refuses a plugin whose endpoint does not accept a connection.

use std::collections::BTreeMap;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::Status;
use tonic::transport::Channel;

use super::api::dra_plugin_client::DraPluginClient;
use super::driver::{ClaimRef, PrepareResults, UnprepareResults};
use super::registration::{DRA_PLUGIN_SERVICE_V1, PLUGIN_TYPE};
use super::registration_api as rapi;
use super::server::{prepare_results, unprepare_results};
use super::{api, registration_api::registration_client::RegistrationClient};
use crate::kubelet::deviceplugin::registration::socket_identity;
use crate::kubelet::transport::unix_channel;

/// How often the registry directory is scanned.
const POLL: Duration = Duration::from_millis(50);
/// Bound on each call of a registration (the kubelet allows 10 s to dial
/// and 1 s for `GetInfo`; a loaded test machine gets more).
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors of the stand-in.
#[derive(Debug, thiserror::Error)]
pub enum DraStandinError {
    /// The registry directory cannot be created.
    #[error("DRA kubelet stand-in cannot create {path}: {source}")]
    Dir {
        /// The directory.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// Waiting for a condition took longer than the given bound.
    #[error("DRA kubelet stand-in: timed out after {0:?} waiting for {1}")]
    Timeout(Duration, String),
    /// No plugin of the driver is registered.
    #[error("DRA kubelet stand-in: driver {0} is not registered")]
    NotRegistered(String),
    /// Connecting to a plugin failed.
    #[error("DRA kubelet stand-in: cannot connect to {endpoint}: {message}")]
    Connect {
        /// The plugin's endpoint.
        endpoint: PathBuf,
        /// Cause.
        message: String,
    },
}

/// One accepted registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StandinRegistration {
    /// The registration socket.
    pub socket: PathBuf,
    /// The driver name (`PluginInfo.name`).
    pub driver: String,
    /// The DRA service socket.
    pub endpoint: PathBuf,
    /// The `supported_versions` the plugin advertised.
    pub supported_versions: Vec<String>,
    /// The service chosen from them.
    pub chosen_service: String,
}

/// What the stand-in knows, as the kubelet's plugin manager would.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DraKubeletView {
    /// Every accepted registration, in order.
    pub registrations: Vec<StandinRegistration>,
    /// Every refusal: the registration socket and the error sent to it.
    pub rejections: Vec<(PathBuf, String)>,
    /// Registration sockets seen removed (or replaced), in order.
    pub deregistrations: Vec<PathBuf>,
    /// Registered plugins now: registration socket to registration.
    pub plugins: BTreeMap<PathBuf, StandinRegistration>,
}

impl DraKubeletView {
    /// The endpoint of the most recent plugin of `driver`, as the kubelet
    /// picks it.
    pub fn endpoint(&self, driver: &str) -> Option<PathBuf> {
        self.registrations
            .iter()
            .rev()
            .find(|r| r.driver == driver && self.plugins.get(&r.socket) == Some(*r))
            .map(|r| r.endpoint.clone())
    }
}

struct Shared {
    dir: PathBuf,
    services: Vec<String>,
    view: watch::Sender<DraKubeletView>,
}

/// A running DRA kubelet stand-in.
pub struct DraKubeletStandin {
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl DraKubeletStandin {
    /// Starts watching `registry_dir` (created if missing), supporting the
    /// v1 DRA service as the 1.34 kubelet does.
    pub async fn start(registry_dir: &Path) -> Result<DraKubeletStandin, DraStandinError> {
        Self::start_with(registry_dir, &[DRA_PLUGIN_SERVICE_V1, "v1beta1.DRAPlugin"]).await
    }

    /// Starts watching `registry_dir`, supporting only the DRA services in
    /// `services` (most preferred first), to see how a plugin takes a refusal.
    pub async fn start_with(
        registry_dir: &Path,
        services: &[&str],
    ) -> Result<DraKubeletStandin, DraStandinError> {
        std::fs::create_dir_all(registry_dir).map_err(|source| DraStandinError::Dir {
            path: registry_dir.to_path_buf(),
            source,
        })?;
        let shared = Arc::new(Shared {
            dir: registry_dir.to_path_buf(),
            services: services.iter().map(|s| s.to_string()).collect(),
            view: watch::channel(DraKubeletView::default()).0,
        });
        let task = tokio::spawn(watch_dir(shared.clone()));
        Ok(DraKubeletStandin { shared, task })
    }

    /// Current view.
    pub fn view(&self) -> DraKubeletView {
        self.shared.view.borrow().clone()
    }

    /// Waits (bounded) until `cond` holds on the view; returns that view.
    pub async fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        cond: impl Fn(&DraKubeletView) -> bool,
    ) -> Result<DraKubeletView, DraStandinError> {
        let mut rx = self.shared.view.subscribe();
        match tokio::time::timeout(timeout, rx.wait_for(|v| cond(v))).await {
            Ok(Ok(v)) => Ok(v.clone()),
            _ => Err(DraStandinError::Timeout(timeout, what.to_string())),
        }
    }

    /// A client to the registered plugin of `driver`, for raw requests.
    pub async fn client(&self, driver: &str) -> Result<DraPluginClient<Channel>, DraStandinError> {
        let endpoint = self
            .view()
            .endpoint(driver)
            .ok_or_else(|| DraStandinError::NotRegistered(driver.to_string()))?;
        let channel = unix_channel(&endpoint)
            .await
            .map_err(|e| DraStandinError::Connect {
                endpoint: endpoint.clone(),
                message: e.to_string(),
            })?;
        Ok(DraPluginClient::new(channel))
    }

    /// Calls `NodePrepareResources` on `driver`'s plugin; returns its
    /// per-claim results as sent (a claim missing from them is missing here).
    pub async fn prepare(
        &self,
        driver: &str,
        claims: &[ClaimRef],
    ) -> Result<PrepareResults, Status> {
        let mut client = self
            .client(driver)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let resp = client
            .node_prepare_resources(api::NodePrepareResourcesRequest {
                claims: claims.iter().cloned().map(api::Claim::from).collect(),
            })
            .await?
            .into_inner();
        Ok(prepare_results(resp))
    }

    /// Calls `NodeUnprepareResources` on `driver`'s plugin.
    pub async fn unprepare(
        &self,
        driver: &str,
        claims: &[ClaimRef],
    ) -> Result<UnprepareResults, Status> {
        let mut client = self
            .client(driver)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let resp = client
            .node_unprepare_resources(api::NodeUnprepareResourcesRequest {
                claims: claims.iter().cloned().map(api::Claim::from).collect(),
            })
            .await?
            .into_inner();
        Ok(unprepare_results(resp))
    }

    /// Stops watching.
    pub async fn stop(mut self) {
        self.task.abort();
        let _ = (&mut self.task).await;
    }
}

impl Drop for DraKubeletStandin {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The sockets in `dir` the plugin watcher would consider, with identities.
fn sockets(dir: &Path) -> BTreeMap<PathBuf, (u64, u64)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return BTreeMap::new();
    };
    entries
        .flatten()
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .filter(|e| e.file_type().is_ok_and(|t| t.is_socket()))
        .filter_map(|e| socket_identity(&e.path()).map(|id| (e.path(), id)))
        .collect()
}

async fn watch_dir(shared: Arc<Shared>) {
    // Sockets handled (registered or refused), by identity: a socket
    // created again at the same path is a new plugin.
    let mut known: BTreeMap<PathBuf, (u64, u64)> = BTreeMap::new();
    loop {
        let now = sockets(&shared.dir);
        let gone: Vec<PathBuf> = known
            .iter()
            .filter(|(p, id)| now.get(*p) != Some(*id))
            .map(|(p, _)| p.clone())
            .collect();
        for p in gone {
            known.remove(&p);
            shared.view.send_modify(|v| {
                if v.plugins.remove(&p).is_some() {
                    v.deregistrations.push(p.clone());
                }
            });
        }
        for (p, id) in now {
            if known.contains_key(&p) {
                continue;
            }
            // A socket that does not answer yet is tried again next scan,
            // as the kubelet retries a failed registration.
            if register(&shared, &p).await {
                known.insert(p, id);
            }
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Registers the plugin at `socket`; returns whether it is settled
/// (registered or refused) rather than to be tried again (it did not
/// answer `GetInfo`).
async fn register(shared: &Shared, socket: &Path) -> bool {
    let Ok(Ok(channel)) = tokio::time::timeout(CALL_TIMEOUT, unix_channel(socket)).await else {
        return false;
    };
    let mut client = RegistrationClient::new(channel);
    let info = match tokio::time::timeout(CALL_TIMEOUT, client.get_info(rapi::InfoRequest {})).await
    {
        Ok(Ok(info)) => info.into_inner(),
        _ => return false,
    };
    let endpoint = if info.endpoint.is_empty() {
        socket.to_path_buf()
    } else {
        PathBuf::from(&info.endpoint)
    };
    let verdict = check(shared, socket, &info, &endpoint).await;
    let notify = match &verdict {
        Ok(_) => rapi::RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        },
        Err(e) => rapi::RegistrationStatus {
            plugin_registered: false,
            error: e.clone(),
        },
    };
    // Like the kubelet: the plugin is registered (or the refusal recorded)
    // before it is told, and stays so if telling it fails.
    shared.view.send_modify(|v| match verdict {
        Ok(chosen_service) => {
            let r = StandinRegistration {
                socket: socket.to_path_buf(),
                driver: info.name.clone(),
                endpoint: endpoint.clone(),
                supported_versions: info.supported_versions.clone(),
                chosen_service,
            };
            v.registrations.push(r.clone());
            v.plugins.insert(socket.to_path_buf(), r);
        }
        Err(e) => v.rejections.push((socket.to_path_buf(), e)),
    });
    let _ = tokio::time::timeout(CALL_TIMEOUT, client.notify_registration_status(notify)).await;
    true
}

/// The kubelet's checks of a `GetInfo` answer; the chosen service, or the
/// error to send back.
async fn check(
    shared: &Shared,
    socket: &Path,
    info: &rapi::PluginInfo,
    endpoint: &Path,
) -> Result<String, String> {
    if info.r#type != PLUGIN_TYPE {
        return Err(format!(
            "RegisterPlugin error -- no handler registered for plugin type: {} at socket {}",
            info.r#type,
            socket.display()
        ));
    }
    if info.name.is_empty() {
        return Err("RegisterPlugin error -- DRA driver name is empty".to_string());
    }
    let Some(chosen) = info
        .supported_versions
        .iter()
        .find(|s| shared.services.contains(s))
    else {
        return Err(format!(
            "RegisterPlugin error -- plugin validation failed with err: invalid supported gRPC \
             versions of DRA driver plugin {} at endpoint {}: none of services supported by the \
             plugin ({:?}) are supported by the kubelet ({:?})",
            info.name,
            endpoint.display(),
            info.supported_versions,
            shared.services
        ));
    };
    let taken = shared
        .view
        .borrow()
        .plugins
        .values()
        .any(|r| r.driver == info.name && r.endpoint == endpoint && r.socket != socket);
    if taken {
        return Err(format!(
            "RegisterPlugin error -- plugin registration failed with err: endpoint {} already \
             registered for DRA driver plugin {}",
            endpoint.display(),
            info.name
        ));
    }
    match tokio::time::timeout(CALL_TIMEOUT, unix_channel(endpoint)).await {
        Ok(Ok(_)) => Ok(chosen.clone()),
        Ok(Err(e)) => Err(format!(
            "cannot connect to the DRA endpoint {}: {e}",
            endpoint.display()
        )),
        Err(_) => Err(format!(
            "connecting to the DRA endpoint {} timed out",
            endpoint.display()
        )),
    }
}
