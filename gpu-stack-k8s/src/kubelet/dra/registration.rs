//! Registration of a DRA plugin with the kubelet's plugin watcher: the
//! `pluginregistration.Registration` service on a socket in the kubelet's
//! `plugins_registry` directory, and what the kubelet answered.
//!
//! The kubelet calls `GetInfo` when the socket appears (or when it starts
//! and finds it), checks the answer, then calls `NotifyRegistrationStatus`;
//! [`RegistrationService`] publishes that answer as a [`RegistrationState`].

use std::sync::Arc;

use tokio::sync::watch;
use tonic::{Request, Response, Status};

use super::registration_api as rapi;

/// `PluginInfo.type` of a DRA plugin: the key of the kubelet's DRA handler
/// (`pluginregistration/v1.DRAPlugin` upstream).
pub const PLUGIN_TYPE: &str = "DRAPlugin";

/// The `supported_versions` entry naming the DRA v1 `DRAPlugin` service
/// (`dra/v1.DRAPluginService` upstream): `<package's last element>.<service>`.
pub const DRA_PLUGIN_SERVICE_V1: &str = "v1.DRAPlugin";

/// What this plugin advertises in `supported_versions`: only the v1
/// service, the one it serves. The 1.34 to 1.37 kubelets support `v1.DRAPlugin` and
/// `v1beta1.DRAPlugin` and prefers the plugin's first supported entry.
pub const SUPPORTED_VERSIONS: &[&str] = &[DRA_PLUGIN_SERVICE_V1];

/// The full gRPC name of the DRA v1 service on the wire (its proto package
/// and service), unlike the short [`DRA_PLUGIN_SERVICE_V1`].
pub const DRA_GRPC_SERVICE: &str = "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin";

/// The kubelet's plugin registration directory (its root directory's
/// `plugins_registry`), which its plugin watcher watches.
pub const DEFAULT_REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";

/// The kubelet's plugins directory; a driver's sockets and data go in
/// `<this>/<driver name>`.
pub const DEFAULT_PLUGINS_DIR: &str = "/var/lib/kubelet/plugins";

/// File name of the DRA service socket in the driver's plugin directory.
pub const DRA_SOCKET: &str = "dra.sock";

/// File name of a driver's registration socket in the registry directory
/// (`<driver>-reg.sock`, as the upstream helper names it).
pub fn registration_socket_name(driver_name: &str) -> String {
    format!("{driver_name}-reg.sock")
}

/// What the kubelet said about the registration socket now served.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum RegistrationState {
    /// No answer yet (also after the socket was created again).
    #[default]
    Pending,
    /// The kubelet registered the plugin.
    Registered,
    /// The kubelet refused the plugin, for this reason.
    Rejected(String),
}

impl RegistrationState {
    /// Whether the kubelet registered the plugin.
    pub fn is_registered(&self) -> bool {
        matches!(self, RegistrationState::Registered)
    }
}

/// The `Registration` service of one DRA plugin.
#[derive(Clone)]
pub struct RegistrationService {
    info: rapi::PluginInfo,
    state: Arc<watch::Sender<RegistrationState>>,
}

impl RegistrationService {
    /// Answers `GetInfo` with `driver_name` and `endpoint` (the absolute
    /// path of the DRA socket) and publishes the kubelet's answers to `state`.
    pub fn new(
        driver_name: &str,
        endpoint: &str,
        state: Arc<watch::Sender<RegistrationState>>,
    ) -> RegistrationService {
        RegistrationService {
            info: rapi::PluginInfo {
                r#type: PLUGIN_TYPE.to_string(),
                name: driver_name.to_string(),
                endpoint: endpoint.to_string(),
                supported_versions: SUPPORTED_VERSIONS.iter().map(|s| s.to_string()).collect(),
            },
            state,
        }
    }

    /// The `GetInfo` answer.
    pub fn info(&self) -> &rapi::PluginInfo {
        &self.info
    }
}

#[tonic::async_trait]
impl rapi::registration_server::Registration for RegistrationService {
    async fn get_info(
        &self,
        _request: Request<rapi::InfoRequest>,
    ) -> Result<Response<rapi::PluginInfo>, Status> {
        tracing::debug!(driver = %self.info.name, "the kubelet asked for the plugin's info");
        Ok(Response::new(self.info.clone()))
    }

    async fn notify_registration_status(
        &self,
        request: Request<rapi::RegistrationStatus>,
    ) -> Result<Response<rapi::RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        let state = if status.plugin_registered {
            tracing::info!(
                driver = %self.info.name,
                endpoint = %self.info.endpoint,
                "registered with the kubelet"
            );
            RegistrationState::Registered
        } else {
            tracing::error!(
                driver = %self.info.name,
                endpoint = %self.info.endpoint,
                error = %status.error,
                "the kubelet refused the DRA plugin"
            );
            RegistrationState::Rejected(if status.error.is_empty() {
                "the kubelet refused the plugin without a reason".to_string()
            } else {
                status.error
            })
        };
        self.state.send_replace(state);
        Ok(Response::new(rapi::RegistrationStatusResponse {}))
    }
}
