//! gRPC over unix sockets: a tonic channel to a socket path (the URI is a
//! placeholder; the connector ignores it), and the incoming connections of a
//! server on a socket, which accept any `:authority` (see [`super::authority`]).

use std::path::{Path, PathBuf};

use futures::{Stream, TryStreamExt};
use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Channel, Endpoint, Uri};

use super::authority::AnyAuthority;

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

/// The connections a gRPC server accepts on `listener`, for
/// `serve_with_incoming`: whatever `:authority` a client sends (the socket
/// path, as gRPC C-core clients do, or `localhost`), its requests reach the
/// service.
pub fn unix_incoming(
    listener: UnixListener,
) -> impl Stream<Item = std::io::Result<AnyAuthority<UnixStream>>> + Send + 'static {
    UnixListenerStream::new(listener).map_ok(AnyAuthority::new)
}
