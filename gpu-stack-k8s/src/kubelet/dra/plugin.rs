//! Serving a DRA plugin: the DRA service on `<plugin dir>/dra.sock` and the
//! registration service on `<registry dir>/<driver>-reg.sock`, until shutdown.
//!
//! The kubelet's plugin watcher only sees sockets being created: a
//! registration socket deleted while the plugin runs (by hand, or by a
//! cleanup of the directory) leaves the plugin unregistered for good. So the
//! sockets are checked every [`DraPlugin::with_socket_check_interval`] and
//! one that is gone is bound again, which the kubelet sees as a new plugin.
//! Each server takes its connections from a channel fed by whichever
//! listener is current, so binding again keeps the server and the kubelet's
//! open connections. A kubelet restart needs nothing: it keeps the
//! registry directory and registers the sockets it finds there.

use std::future::Future;
use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;

use super::api::dra_plugin_server::DraPluginServer;
use super::driver::DraDriver;
use super::registration::{
    DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR, DRA_SOCKET, RegistrationService, RegistrationState,
    registration_socket_name,
};
use super::registration_api::registration_server::RegistrationServer;
use super::server::DraService;
use crate::kubelet::authority::AnyAuthority;
use crate::kubelet::deviceplugin::registration::socket_identity;
use crate::kubelet::transport::unix_incoming;

/// The longest socket path a unix socket address holds (`sun_path` is 108
/// bytes with the terminating NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// How long the servers may take to finish their calls after shutdown.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Serving a DRA plugin failed.
#[derive(Debug, thiserror::Error)]
pub enum DraServeError {
    /// The driver name cannot name a DRA driver (nor a socket file).
    #[error(
        "invalid DRA driver name {name:?}: {reason}; use a DNS subdomain of at most 63 characters, \
         like gpu.example.com"
    )]
    InvalidDriverName {
        /// The name given.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A directory path cannot be used.
    #[error("cannot use {path}: {reason}")]
    InvalidPath {
        /// The path.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// Creating a directory failed.
    #[error(
        "cannot create directory {path}: {source}; check that it is writable (hostPath mounted)"
    )]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// Cause.
        source: io::Error,
    },
    /// Something other than a socket is where a socket goes.
    #[error("{path} exists and is not a socket; remove it or choose another directory")]
    NotASocket {
        /// The path.
        path: PathBuf,
    },
    /// A stale socket could not be removed.
    #[error("cannot remove the stale socket {path}: {source}")]
    RemoveStale {
        /// The socket path.
        path: PathBuf,
        /// Cause.
        source: io::Error,
    },
    /// Listening on a socket failed.
    #[error("cannot listen on {path}: {source}")]
    Bind {
        /// The socket path.
        path: PathBuf,
        /// Cause.
        source: io::Error,
    },
    /// A gRPC server stopped on its own.
    #[error("the gRPC server on {socket} stopped: {message}")]
    Server {
        /// The socket it served.
        socket: PathBuf,
        /// Why.
        message: String,
    },
}

/// A DRA plugin's sockets and registration state, ready to [`serve`](DraPlugin::serve).
pub struct DraPlugin {
    driver_name: String,
    dra_socket: PathBuf,
    endpoint: String,
    registration_socket: PathBuf,
    check_interval: Duration,
    state: Arc<watch::Sender<RegistrationState>>,
}

impl DraPlugin {
    /// A plugin of `driver_name` with its DRA socket in `plugin_dir` and its
    /// registration socket in `registry_dir`. A relative `plugin_dir` is
    /// made absolute, since the kubelet dials the endpoint path as given.
    pub fn new(
        driver_name: &str,
        plugin_dir: impl Into<PathBuf>,
        registry_dir: impl Into<PathBuf>,
    ) -> Result<DraPlugin, DraServeError> {
        check_driver_name(driver_name)?;
        let plugin_dir = plugin_dir.into();
        let plugin_dir =
            std::path::absolute(&plugin_dir).map_err(|e| DraServeError::InvalidPath {
                path: plugin_dir.clone(),
                reason: format!("cannot make it absolute: {e}"),
            })?;
        let dra_socket = plugin_dir.join(DRA_SOCKET);
        let registration_socket = registry_dir
            .into()
            .join(registration_socket_name(driver_name));
        for p in [&dra_socket, &registration_socket] {
            let len = p.as_os_str().len();
            if len > MAX_SOCKET_PATH {
                return Err(DraServeError::InvalidPath {
                    path: p.clone(),
                    reason: format!(
                        "a socket path holds at most {MAX_SOCKET_PATH} bytes, this one has {len}; \
                         choose a shorter directory"
                    ),
                });
            }
        }
        let endpoint = dra_socket
            .to_str()
            .ok_or_else(|| DraServeError::InvalidPath {
                path: dra_socket.clone(),
                reason: "the kubelet takes the endpoint as a UTF-8 string; choose a UTF-8 path"
                    .into(),
            })?
            .to_string();
        Ok(DraPlugin {
            driver_name: driver_name.to_string(),
            dra_socket,
            endpoint,
            registration_socket,
            check_interval: Duration::from_secs(1),
            state: Arc::new(watch::channel(RegistrationState::Pending).0),
        })
    }

    /// A plugin of `driver_name` in the kubelet's default directories:
    /// `/var/lib/kubelet/plugins/<driver>/dra.sock` and
    /// `/var/lib/kubelet/plugins_registry/<driver>-reg.sock`.
    pub fn with_default_dirs(driver_name: &str) -> Result<DraPlugin, DraServeError> {
        DraPlugin::new(
            driver_name,
            Path::new(DEFAULT_PLUGINS_DIR).join(driver_name),
            DEFAULT_REGISTRY_DIR,
        )
    }

    /// How often the sockets are checked (and bound again when gone);
    /// 1 s by default, about as often as the kubelet's plugin reconciler runs.
    pub fn with_socket_check_interval(mut self, interval: Duration) -> DraPlugin {
        self.check_interval = interval.max(Duration::from_millis(10));
        self
    }

    /// The driver name.
    pub fn driver_name(&self) -> &str {
        &self.driver_name
    }

    /// Path of the DRA service socket (the endpoint given to the kubelet).
    pub fn dra_socket(&self) -> &Path {
        &self.dra_socket
    }

    /// Path of the registration socket.
    pub fn registration_socket(&self) -> &Path {
        &self.registration_socket
    }

    /// What the kubelet answered; back to `Pending` when the registration
    /// socket is bound again and when serving ends.
    pub fn registration(&self) -> watch::Receiver<RegistrationState> {
        self.state.subscribe()
    }

    /// Serves `driver` until `shutdown` completes, then removes the sockets
    /// (those still ours). Stale sockets at the paths are removed first.
    pub async fn serve<D: DraDriver>(
        self,
        driver: D,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), DraServeError> {
        for dir in [self.dra_socket.parent(), self.registration_socket.parent()]
            .into_iter()
            .flatten()
        {
            std::fs::create_dir_all(dir).map_err(|source| DraServeError::CreateDir {
                path: dir.to_path_buf(),
                source,
            })?;
        }

        // The DRA service first, so it answers by the time the kubelet,
        // told of the registration socket, connects to it.
        let (dra_tx, dra_rx) = mpsc::channel(16);
        let mut dra = BoundSocket::bind(&self.dra_socket, dra_tx)?;
        let (reg_tx, reg_rx) = mpsc::channel(16);
        let mut reg = match BoundSocket::bind(&self.registration_socket, reg_tx) {
            Ok(reg) => reg.resetting(self.state.clone()),
            Err(e) => {
                dra.close();
                return Err(e);
            }
        };

        let (stop_tx, stop_rx) = watch::channel(false);
        let stopped = |mut rx: watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        let mut dra_server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(DraPluginServer::new(DraService::new(driver)))
                .serve_with_incoming_shutdown(
                    ReceiverStream::new(dra_rx),
                    stopped(stop_rx.clone()),
                ),
        );
        let registration =
            RegistrationService::new(&self.driver_name, &self.endpoint, self.state.clone());
        let mut reg_server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(RegistrationServer::new(registration))
                .serve_with_incoming_shutdown(ReceiverStream::new(reg_rx), stopped(stop_rx)),
        );
        tracing::info!(
            driver = %self.driver_name,
            dra_socket = %self.dra_socket.display(),
            registration_socket = %self.registration_socket.display(),
            "serving the DRA plugin"
        );

        let mut check = tokio::time::interval(self.check_interval);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut shutdown = std::pin::pin!(shutdown);
        let result = loop {
            tokio::select! {
                _ = &mut shutdown => break Ok(()),
                r = &mut dra_server => break Err(server_ended(&self.dra_socket, r)),
                r = &mut reg_server => break Err(server_ended(&self.registration_socket, r)),
                _ = check.tick() => {
                    dra.keep();
                    reg.keep();
                }
            }
        };

        // Registration first, so the kubelet stops routing to the plugin
        // before its DRA socket goes.
        reg.close();
        dra.close();
        let _ = stop_tx.send(true);
        for (server, socket) in [
            (dra_server, &self.dra_socket),
            (reg_server, &self.registration_socket),
        ] {
            if server.is_finished() {
                continue;
            }
            let abort = server.abort_handle();
            if tokio::time::timeout(DRAIN_TIMEOUT, server).await.is_err() {
                tracing::warn!(
                    socket = %socket.display(),
                    "calls still running {DRAIN_TIMEOUT:?} after shutdown; dropping them"
                );
                abort.abort();
            }
        }
        self.state.send_replace(RegistrationState::Pending);
        tracing::info!(driver = %self.driver_name, "stopped serving the DRA plugin");
        result
    }
}

/// Serves the DRA plugin `driver` of `driver_name` on
/// `<plugin_dir>/dra.sock`, registered through
/// `<registry_dir>/<driver_name>-reg.sock`, until `shutdown` completes; see
/// [`DraPlugin`] to also follow the registration.
pub async fn serve<D: DraDriver>(
    driver_name: &str,
    plugin_dir: &Path,
    registry_dir: &Path,
    driver: D,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), DraServeError> {
    DraPlugin::new(driver_name, plugin_dir, registry_dir)?
        .serve(driver, shutdown)
        .await
}

/// Checks that `name` is a DNS subdomain of at most 63 characters, as the
/// resource API wants of driver names; it also names a socket file.
fn check_driver_name(name: &str) -> Result<(), DraServeError> {
    let err = |reason: &str| {
        Err(DraServeError::InvalidDriverName {
            name: name.to_string(),
            reason: reason.to_string(),
        })
    };
    if name.is_empty() {
        return err("it is empty");
    }
    if name.len() > 63 {
        return err("it is longer than 63 characters");
    }
    for label in name.split('.') {
        if label.is_empty() {
            return err("it has an empty label");
        }
        if !label
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            return err("it may hold only lowercase letters, digits, '-' and '.'");
        }
        if label.starts_with('-') || label.ends_with('-') {
            return err("a label starts or ends with '-'");
        }
    }
    Ok(())
}

fn server_ended(
    socket: &Path,
    r: Result<Result<(), tonic::transport::Error>, tokio::task::JoinError>,
) -> DraServeError {
    let message = match r {
        Ok(Ok(())) => "it ended without being asked to".to_string(),
        Ok(Err(e)) => e.to_string(),
        Err(e) => e.to_string(),
    };
    DraServeError::Server {
        socket: socket.to_path_buf(),
        message,
    }
}

type Conn = io::Result<AnyAuthority<UnixStream>>;

/// A socket this plugin listens on: the listener's accept task, feeding the
/// server's channel, and the file's identity, to tell ours from another's.
struct BoundSocket {
    path: PathBuf,
    identity: Option<(u64, u64)>,
    accept: Option<JoinHandle<()>>,
    tx: mpsc::Sender<Conn>,
    // Warned already that another process's socket took the path.
    warned_replaced: bool,
    // The registration state to reset when the socket is bound again: a new
    // socket is a new plugin to the kubelet, which will ask and answer again.
    reset: Option<Arc<watch::Sender<RegistrationState>>>,
}

impl BoundSocket {
    /// Removes a stale socket at `path`, listens there, and feeds `tx`.
    fn bind(path: &Path, tx: mpsc::Sender<Conn>) -> Result<BoundSocket, DraServeError> {
        let mut s = BoundSocket {
            path: path.to_path_buf(),
            identity: None,
            accept: None,
            tx,
            warned_replaced: false,
            reset: None,
        };
        s.listen()?;
        Ok(s)
    }

    /// Resets `state` to `Pending` whenever the socket is bound again.
    fn resetting(mut self, state: Arc<watch::Sender<RegistrationState>>) -> BoundSocket {
        self.reset = Some(state);
        self
    }

    fn listen(&mut self) -> Result<(), DraServeError> {
        remove_stale(&self.path)?;
        // Before binding: the kubelet may answer as soon as the socket exists.
        if let Some(state) = &self.reset {
            state.send_replace(RegistrationState::Pending);
        }
        let listener = UnixListener::bind(&self.path).map_err(|source| DraServeError::Bind {
            path: self.path.clone(),
            source,
        })?;
        self.identity = socket_identity(&self.path);
        let tx = self.tx.clone();
        let path = self.path.clone();
        self.accept = Some(tokio::spawn(async move {
            let mut incoming = std::pin::pin!(unix_incoming(listener));
            while let Some(conn) = incoming.next().await {
                match conn {
                    Ok(conn) => {
                        if tx.send(Ok(conn)).await.is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        // Out of file descriptors and the like: pause
                        // rather than spin on the same error.
                        tracing::warn!(socket = %path.display(), error = %e, "accepting a connection failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }));
        Ok(())
    }

    /// Binds the socket again if its file is gone. A file of another identity is another process's socket (a newer
    /// instance of the plugin, say), left alone.
    fn keep(&mut self) {
        match socket_identity(&self.path) {
            Some(id) if Some(id) == self.identity => {}
            Some(_) => {
                if !self.warned_replaced {
                    tracing::warn!(
                        socket = %self.path.display(),
                        "another socket replaced this plugin's; leaving it"
                    );
                    self.warned_replaced = true;
                }
            }
            None => {
                tracing::warn!(socket = %self.path.display(), "socket removed; creating it again");
                if let Some(accept) = self.accept.take() {
                    accept.abort();
                }
                match self.listen() {
                    Ok(()) => self.warned_replaced = false,
                    Err(e) => {
                        tracing::error!(error = %e, "cannot create the socket again; retrying");
                    }
                }
            }
        }
    }

    /// Stops listening and removes the socket if it is still ours.
    fn close(&mut self) {
        if let Some(accept) = self.accept.take() {
            accept.abort();
        }
        if self.identity.is_some()
            && socket_identity(&self.path) == self.identity
            && let Err(e) = std::fs::remove_file(&self.path)
        {
            tracing::warn!(socket = %self.path.display(), error = %e, "cannot remove the socket");
        }
    }
}

/// Removes a socket left at `path` by an earlier run; refuses to remove
/// anything else.
fn remove_stale(path: &Path) -> Result<(), DraServeError> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(DraServeError::RemoveStale {
            path: path.to_path_buf(),
            source,
        }),
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path).or_else(|source| {
            if source.kind() == io::ErrorKind::NotFound {
                Ok(())
            } else {
                Err(DraServeError::RemoveStale {
                    path: path.to_path_buf(),
                    source,
                })
            }
        }),
        Ok(_) => Err(DraServeError::NotASocket {
            path: path.to_path_buf(),
        }),
    }
}
