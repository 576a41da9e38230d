//! gRPC over unix sockets: a tonic channel to a socket path (the URI is a
//! placeholder; the connector ignores it) and a listener stream for servers.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

/// Opens a gRPC channel to a unix socket.
pub async fn unix_channel(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path: PathBuf = path.to_path_buf();
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
}
