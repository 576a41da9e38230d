//! The operator's HTTP endpoints: `/healthz`, `/readyz` and `/metrics`.
//!
//! Liveness is "the process answers". Readiness is set by the binary once the
//! API server answered and, on the leader, the watches have synced; a standby
//! replica is ready as soon as it is competing for the lease, so a rolling
//! update does not wait for leadership that cannot come.
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;

use crate::operator::metrics::OperatorMetrics;

/// Shared readiness flag.
#[derive(Clone, Debug, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    /// Marks the process ready (or not).
    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::Release);
    }

    /// Whether `/readyz` answers 200.
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

#[derive(Clone)]
struct OpsState {
    metrics: OperatorMetrics,
    readiness: Readiness,
}

/// The router, separate from [`serve`] so tests can drive it without a socket.
pub fn router(metrics: OperatorMetrics, readiness: Readiness) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_handler))
        .with_state(OpsState { metrics, readiness })
}

async fn readyz(State(state): State<OpsState>) -> impl IntoResponse {
    if state.readiness.get() {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
    }
}

async fn metrics_handler(State(state): State<OpsState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
}

/// Serves the endpoints on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    metrics: OperatorMetrics,
    readiness: Readiness,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(metrics, readiness))
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn get(addr: std::net::SocketAddr, path: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn endpoints_over_loopback() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let metrics = OperatorMetrics::new();
        metrics.gpu_nodes_total.set(7);
        let readiness = Readiness::default();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, metrics, readiness.clone(), async {
            let _ = rx.await;
        }));

        assert!(get(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
        assert!(get(addr, "/readyz").await.starts_with("HTTP/1.1 503"));
        readiness.set(true);
        assert!(get(addr, "/readyz").await.starts_with("HTTP/1.1 200"));
        let body = get(addr, "/metrics").await;
        assert!(body.contains("application/openmetrics-text"), "{body}");
        assert!(body.contains("gpu_operator_gpu_nodes_total 7"), "{body}");
        assert!(get(addr, "/nope").await.starts_with("HTTP/1.1 404"));

        tx.send(()).unwrap();
        server.await.unwrap().unwrap();
    }
}
