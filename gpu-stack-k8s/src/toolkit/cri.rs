//! The container runtime as it runs: its CRI `Status` (ready or not, and with
//! `verbose` its effective configuration) and the process behind its socket.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::kubelet::transport::unix_channel;

/// Types and gRPC stubs generated at build time from `proto/cri/v1/api.proto`.
pub mod api {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("runtime.v1");
}

/// How long one Status call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors talking to the runtime.
#[derive(Debug, thiserror::Error)]
pub enum CriError {
    /// The socket could not be reached.
    #[error(
        "cannot reach the container runtime at {socket}: {reason}; check that it runs and that \
         CONTAINERD_SOCKET (or --socket) names its socket"
    )]
    Unreachable {
        /// Socket path.
        socket: PathBuf,
        /// Cause.
        reason: String,
    },
    /// The runtime answered with an error.
    #[error("the container runtime at {socket} refused Status: {reason}")]
    Refused {
        /// Socket path.
        socket: PathBuf,
        /// Cause.
        reason: String,
    },
    /// The runtime's process is not visible from here.
    #[error(
        "cannot see the process behind {socket} (peer pid {pid}): the agent needs the host's \
         pid namespace (hostPID: true) to restart the runtime"
    )]
    PidHidden {
        /// Socket path.
        socket: PathBuf,
        /// What SO_PEERCRED returned.
        pid: i32,
    },
}

/// What the runtime reports about itself.
#[derive(Debug, Clone, Default)]
pub struct RuntimeState {
    /// Whether the `RuntimeReady` condition is true.
    pub ready: bool,
    /// The effective CRI configuration as JSON (`info["config"]`), when the
    /// runtime reports one (containerd does).
    pub config_json: Option<String>,
}

/// Which runtime serves a CRI socket.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RuntimeVersion {
    /// `containerd`, `cri-o`.
    pub name: String,
    /// Its release, as it reports it (`v2.3.7`).
    pub version: String,
}

/// Calls `Version` on the CRI socket.
pub async fn version(socket: &Path) -> Result<RuntimeVersion, CriError> {
    let mut client = client(socket).await?;
    let reply = tokio::time::timeout(
        CALL_TIMEOUT,
        client.version(api::VersionRequest {
            version: "v1".into(),
        }),
    )
    .await
    .map_err(|_| unreachable(socket, "no answer within 10 s".into()))?
    .map_err(|s| refused(socket, &s))?
    .into_inner();
    Ok(RuntimeVersion {
        name: reply.runtime_name.chars().take(64).collect(),
        version: reply.runtime_version.chars().take(64).collect(),
    })
}

fn unreachable(socket: &Path, reason: String) -> CriError {
    CriError::Unreachable {
        socket: socket.to_path_buf(),
        reason,
    }
}

fn refused(socket: &Path, status: &tonic::Status) -> CriError {
    CriError::Refused {
        socket: socket.to_path_buf(),
        reason: status.message().chars().take(300).collect(),
    }
}

async fn client(
    socket: &Path,
) -> Result<api::runtime_service_client::RuntimeServiceClient<tonic::transport::Channel>, CriError>
{
    let channel = tokio::time::timeout(CALL_TIMEOUT, unix_channel(socket))
        .await
        .map_err(|_| unreachable(socket, "no connection within 10 s".into()))?
        .map_err(|e| unreachable(socket, e.to_string()))?;
    Ok(api::runtime_service_client::RuntimeServiceClient::new(
        channel,
    ))
}

/// Calls `Status(verbose)` on the CRI socket.
pub async fn status(socket: &Path) -> Result<RuntimeState, CriError> {
    let mut client = client(socket).await?;
    let reply = tokio::time::timeout(
        CALL_TIMEOUT,
        client.status(api::StatusRequest { verbose: true }),
    )
    .await
    .map_err(|_| unreachable(socket, "no answer within 10 s".into()))?
    .map_err(|s| refused(socket, &s))?
    .into_inner();
    let ready = reply.status.is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.r#type == "RuntimeReady" && c.status)
    });
    Ok(RuntimeState {
        ready,
        config_json: reply.info.get("config").cloned(),
    })
}

/// The pid of the process serving `socket` (SO_PEERCRED), as seen from this
/// process's pid namespace.
pub fn server_pid(socket: &Path) -> Result<i32, CriError> {
    let stream =
        std::os::unix::net::UnixStream::connect(socket).map_err(|e| CriError::Unreachable {
            socket: socket.to_path_buf(),
            reason: e.to_string(),
        })?;
    let cred =
        nix::sys::socket::getsockopt(&stream.as_fd(), nix::sys::socket::sockopt::PeerCredentials)
            .map_err(|e| CriError::Unreachable {
            socket: socket.to_path_buf(),
            reason: format!("SO_PEERCRED: {e}"),
        })?;
    let pid = cred.pid();
    // Outside the runtime's pid namespace the kernel reports 0.
    if pid <= 0 || !Path::new(&format!("/proc/{pid}")).exists() {
        return Err(CriError::PidHidden {
            socket: socket.to_path_buf(),
            pid,
        });
    }
    Ok(pid)
}
