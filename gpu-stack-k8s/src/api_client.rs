//! Kubernetes API clients with a deadline on every request.
//!
//! kube's client sets no timeout by default: a request the API server never
//! answers (a hung or stopped server, a connection lost without a reset)
//! holds its caller for good, and with it a whole reconcile pass, the driver
//! upgrade pass, the lease release on shutdown, or an agent's label write.
//! [`DeadlineLayer`] bounds each request from sending it to the last byte of
//! its answer, so every call fails with [`DeadlineExceeded`] instead and the
//! caller's own retry takes over.
//!
//! Watches (`watch=true`) and followed logs (`follow=true`) are left
//! unbounded: they are meant to stay open, and kube's watcher bounds them
//! itself (the server's `timeoutSeconds` and an idle timeout).
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body as HttpBody, Frame, SizeHint};
use kube::client::{Body, ClientBuilder};
use kube::{Client, Config};
use tokio::time::{Instant, Sleep};
use tower::{BoxError, Layer, Service};

/// The deadline of one API request unless a caller picks another: far above
/// what a healthy API server takes (the server's own default limit for a
/// request is 60 s; a large list answers in a few seconds), short enough
/// that a stalled server frees its callers within a minute.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(30);

/// A request got no complete answer in time.
#[derive(Debug, thiserror::Error)]
#[error(
    "the API server did not answer {method} {path} within {deadline:?}; it may be overloaded, \
     stopped or unreachable (the call is retried by its caller)"
)]
pub struct DeadlineExceeded {
    /// The request's method.
    pub method: String,
    /// The request's path, without the query.
    pub path: String,
    /// The deadline that passed.
    pub deadline: Duration,
}

/// A client for `config` whose requests, watches aside, each have
/// [`REQUEST_DEADLINE`].
pub fn bounded_client(config: Config) -> Result<Client, kube::Error> {
    Ok(ClientBuilder::try_from(config)?
        .with_layer(&DeadlineLayer::new(REQUEST_DEADLINE))
        .build())
}

/// Whether a request is meant to stay open (a watch or a followed log).
pub fn is_long_lived(query: Option<&str>) -> bool {
    query.is_some_and(|q| {
        q.split('&')
            .any(|pair| matches!(pair, "watch=true" | "watch=1" | "follow=true" | "follow=1"))
    })
}

/// Bounds each request, watches aside (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct DeadlineLayer {
    deadline: Duration,
}

impl DeadlineLayer {
    /// Every bounded request must be answered in full within `deadline`.
    pub fn new(deadline: Duration) -> Self {
        Self { deadline }
    }
}

impl<S> Layer<S> for DeadlineLayer {
    type Service = Deadline<S>;

    fn layer(&self, inner: S) -> Deadline<S> {
        Deadline {
            inner,
            deadline: self.deadline,
        }
    }
}

/// The service [`DeadlineLayer`] builds.
#[derive(Clone, Debug)]
pub struct Deadline<S> {
    inner: S,
    deadline: Duration,
}

impl<S, B> Service<Request<Body>> for Deadline<S>
where
    S: Service<Request<Body>, Response = Response<B>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    B: HttpBody<Data = Bytes> + Unpin + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<DeadlineBody<B>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let bounded = !is_long_lived(req.uri().query());
        let exceeded = DeadlineExceeded {
            method: req.method().to_string(),
            path: req.uri().path().chars().take(200).collect(),
            deadline: self.deadline,
        };
        let until = Instant::now() + self.deadline;
        let answer = self.inner.call(req);
        Box::pin(async move {
            if !bounded {
                let response = answer.await.map_err(Into::into)?;
                return Ok(response.map(|body| DeadlineBody {
                    inner: body,
                    until: None,
                }));
            }
            match tokio::time::timeout_at(until, answer).await {
                Ok(response) => Ok(response.map_err(Into::into)?.map(|body| DeadlineBody {
                    inner: body,
                    until: Some((Box::pin(tokio::time::sleep_until(until)), exceeded)),
                })),
                Err(_) => Err(exceeded.into()),
            }
        })
    }
}

/// A response body that fails once its request's deadline passes.
pub struct DeadlineBody<B> {
    inner: B,
    until: Option<(Pin<Box<Sleep>>, DeadlineExceeded)>,
}

impl<B> HttpBody for DeadlineBody<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        if let Some((sleep, exceeded)) = this.until.as_mut()
            && sleep.as_mut().poll(cx).is_ready()
        {
            let error = DeadlineExceeded {
                method: std::mem::take(&mut exceeded.method),
                path: std::mem::take(&mut exceeded.path),
                deadline: exceeded.deadline,
            };
            this.until = None;
            return Poll::Ready(Some(Err(error.into())));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    #[test]
    fn only_watches_and_followed_logs_stay_open() {
        assert!(is_long_lived(Some("watch=true&resourceVersion=5")));
        assert!(is_long_lived(Some("labelSelector=a&watch=1")));
        assert!(is_long_lived(Some("follow=true")));
        assert!(!is_long_lived(None));
        assert!(!is_long_lived(Some("limit=500")));
        assert!(!is_long_lived(Some("watch=false")));
        assert!(!is_long_lived(Some("labelSelector=watch%3Dtrue")));
    }

    proptest! {
        /// A query without a `watch` or `follow` pair is always bounded.
        #[test]
        fn queries_without_watch_are_bounded(q in "[a-z=&%0-9]{0,40}") {
            let open = q.split('&').any(|p| p.starts_with("watch=") || p.starts_with("follow="));
            if !open {
                prop_assert!(!is_long_lived(Some(&q)));
            }
        }
    }

    /// A loopback API server: `/stall` never answers, `/half` sends headers
    /// and then nothing, a watch sends its one event after `late`.
    async fn fake_api_server(late: Duration) -> std::io::Result<std::net::SocketAddr> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let Ok(n) = conn.read(&mut buf).await else {
                        return;
                    };
                    let head = String::from_utf8_lossy(&buf[..n]).to_string();
                    if head.starts_with("GET /stall") {
                        tokio::time::sleep(Duration::from_secs(3600)).await;
                    } else if head.starts_with("GET /half") {
                        let _ = conn
                            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{")
                            .await;
                        tokio::time::sleep(Duration::from_secs(3600)).await;
                    } else {
                        let _ = conn
                            .write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                            .await;
                        tokio::time::sleep(late).await;
                        let event = b"{\"type\":\"BOOKMARK\"}\n";
                        let chunk = format!("{:x}\r\n", event.len());
                        let _ = conn.write_all(chunk.as_bytes()).await;
                        let _ = conn.write_all(event).await;
                        let _ = conn.write_all(b"\r\n0\r\n\r\n").await;
                    }
                });
            }
        });
        Ok(addr)
    }

    fn client_for(addr: std::net::SocketAddr, deadline: Duration) -> Client {
        let url = format!("http://{addr}").parse().expect("a loopback URL");
        let mut config = Config::new(url);
        config.default_retry = false;
        ClientBuilder::try_from(config)
            .expect("a client for a plain-HTTP loopback URL")
            .with_layer(&DeadlineLayer::new(deadline))
            .build()
    }

    async fn get(client: &Client, path: &str) -> Result<String, kube::Error> {
        let req = Request::get(path).body(Vec::new()).expect("a request");
        client.request_text(req).await
    }

    #[tokio::test]
    async fn a_request_without_an_answer_fails_at_its_deadline() {
        let addr = fake_api_server(Duration::ZERO).await.expect("listening");
        let client = client_for(addr, Duration::from_millis(200));
        for path in ["/stall", "/half"] {
            let outcome = tokio::time::timeout(Duration::from_secs(60), get(&client, path))
                .await
                .expect("the deadline ends the call");
            let err = outcome.expect_err("no complete answer").to_string();
            assert!(err.contains("did not answer GET"), "{path}: {err}");
            assert!(err.contains(path), "{path}: {err}");
        }
    }

    #[tokio::test]
    async fn a_watch_outlives_the_deadline() {
        let addr = fake_api_server(Duration::from_millis(600))
            .await
            .expect("listening");
        let client = client_for(addr, Duration::from_millis(100));
        let body = get(&client, "/api/v1/pods?watch=true&timeoutSeconds=290")
            .await
            .expect("the watch is not cut");
        assert!(body.contains("BOOKMARK"), "{body}");
        // The same answer to a plain list is cut.
        assert!(get(&client, "/api/v1/pods?limit=500").await.is_err());
    }
}
