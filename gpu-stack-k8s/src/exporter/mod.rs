//! The DCGM-compatible GPU metrics exporter: background sampling (one thread
//! per GPU, so a hung GPU call stalls only that GPU's series), a composer that
//! turns the latest samples, Xid windows and pod attributions into a ready
//! snapshot in both exposition formats, and the HTTP side (`/metrics`,
//! `/health`). A scrape only copies the ready snapshot; it never waits on the
//! GPU backend or the kubelet.

mod http;
pub mod selfmetrics;
mod state;

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gpu_stack_core::backend::{BackendError, GpuBackend};
use gpu_stack_core::metrics::{CounterSet, RenderOptions, ResourceMatcher};

pub use http::{router, serve};
pub use state::{Exporter, Snapshot};

/// Where and how to read pod attributions.
#[derive(Debug, Clone)]
pub struct PodResourcesConfig {
    /// Kubelet pod-resources socket.
    pub socket: PathBuf,
    /// How often to call `List`.
    pub refresh: Duration,
    /// Timeout of one `List` call.
    pub timeout: Duration,
    /// Which resource names are GPUs.
    pub matcher: ResourceMatcher,
}

/// Exporter settings.
#[derive(Debug, Clone)]
pub struct ExporterConfig {
    /// The metric set (from `-f FILE` or the default).
    pub counters: CounterSet,
    /// Collection interval.
    pub interval: Duration,
    /// Hostname label and Xid window; the driver version is filled in at start.
    pub render: RenderOptions,
    /// Pod attribution; `None` turns it off.
    pub pod_resources: Option<PodResourcesConfig>,
    /// Serve OpenMetrics to clients that ask for it. Off by default, as in
    /// dcgm-exporter: OpenMetrics would type the DCGM counters `unknown`.
    pub openmetrics: bool,
    /// Longest a connection may take to send a request's headers.
    pub header_read_timeout: Duration,
}

/// dcgm-exporter's read timeout.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

impl Default for ExporterConfig {
    fn default() -> Self {
        Self {
            counters: CounterSet::default_set(),
            interval: Duration::from_secs(30),
            render: RenderOptions::default(),
            pod_resources: None,
            openmetrics: false,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
        }
    }
}

/// Why the exporter could not start.
#[derive(Debug, thiserror::Error)]
pub enum ExporterError {
    /// The GPU backend could not list the GPUs.
    #[error("cannot list the GPUs through the {backend} backend: {reason}")]
    Inventory {
        /// Backend name.
        backend: String,
        /// What failed.
        reason: BackendError,
    },
    /// The listen address is not valid.
    #[error(
        "invalid listen address `{addr}`: use HOST:PORT, :PORT or [IPv6]:PORT (for example :9400)"
    )]
    BadAddress {
        /// What was given.
        addr: String,
    },
    /// The listen address could not be bound.
    #[error(
        "cannot listen on {addr}: {reason}; is another exporter already running there? choose another address with --listen"
    )]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// What the OS said.
        reason: std::io::Error,
    },
}

/// Parses a listen address the way dcgm-exporter accepts it: `:9400` means
/// every IPv4 interface, `[::]:9400` every IPv6 one, `host:port` as usual.
pub fn parse_listen(addr: &str) -> Result<SocketAddr, ExporterError> {
    let bad = || ExporterError::BadAddress {
        addr: addr.to_string(),
    };
    let full = if let Some(port) = addr.strip_prefix(':') {
        format!("0.0.0.0:{port}")
    } else {
        addr.to_string()
    };
    full.to_socket_addrs()
        .map_err(|_| bad())?
        .next()
        .ok_or_else(bad)
}

/// Binds the listen socket before anything else starts, so a port in use is
/// reported before any thread or task exists.
pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, ExporterError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|reason| ExporterError::Listen { addr, reason })
}

/// Starts sampling `backend` (inside a tokio runtime, for pod attribution).
pub fn start(
    backend: Arc<dyn GpuBackend>,
    config: ExporterConfig,
) -> Result<Exporter, ExporterError> {
    Exporter::start(backend, config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addresses_parse_like_dcgm_exporter() {
        assert_eq!(parse_listen(":9400").unwrap().to_string(), "0.0.0.0:9400");
        assert_eq!(parse_listen("127.0.0.1:1").unwrap().port(), 1);
        assert_eq!(parse_listen("[::]:9400").unwrap().to_string(), "[::]:9400");
        let err = parse_listen("9400").unwrap_err().to_string();
        assert!(err.contains("invalid listen address `9400`"), "{err}");
        assert!(parse_listen(":notaport").is_err());
    }
}
