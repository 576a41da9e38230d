//! HTTP side: `/metrics` (Prometheus text, or OpenMetrics when enabled and
//! asked for), `/health`, and a landing page. Connections that do not send
//! their request headers in time are closed, so idle or slow clients cannot
//! hold sockets open.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use gpu_stack_core::metrics::Format;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;

use super::state::{Exporter, Shared};

async fn metrics(State(shared): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    let started = Instant::now();
    let format = if shared.config.openmetrics {
        let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
        Format::negotiate(accept)
    } else {
        // dcgm-exporter serves only this format; Prometheus then keeps the
        // counters' types instead of recording them as `unknown`.
        Format::Prometheus
    };
    let snapshot = shared
        .snapshot
        .read()
        .map(|s| s.clone())
        .unwrap_or_default();
    let gpu = match format {
        Format::Prometheus => &snapshot.prometheus,
        Format::OpenMetrics => &snapshot.openmetrics,
    };
    let mut own = String::with_capacity(4096);
    match format {
        Format::Prometheus => shared.metrics.encode_prometheus(&mut own),
        Format::OpenMetrics => {
            shared.metrics.encode_openmetrics(&mut own);
            own.push_str("# EOF\n");
        }
    }
    let mut body = Vec::with_capacity(gpu.len() + own.len());
    body.extend_from_slice(gpu);
    body.extend_from_slice(own.as_bytes());
    shared
        .metrics
        .scrape_duration
        .observe(started.elapsed().as_secs_f64());
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(format.content_type()),
        )],
        body,
    )
        .into_response()
}

async fn health(State(shared): State<Arc<Shared>>) -> Response {
    if let Some(since) = shared.wedged_for() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("wedged: nothing rendered for {}s", since.as_secs()),
        )
            .into_response();
    }
    if shared.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "OK").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "collecting the first sample",
        )
            .into_response()
    }
}

async fn index() -> Response {
    (
        [(header::CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"))],
        "<html><head><title>gpu-exporter</title></head><body><h1>gpu-exporter</h1><p><a href=\"/metrics\">Metrics</a> · <a href=\"/health\">Health</a></p></body></html>\n",
    )
        .into_response()
}

/// The exporter's routes.
pub fn router(exporter: &Exporter) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/health", get(health))
        .route("/", get(index))
        .with_state(exporter.shared.clone())
}

/// How long in-flight requests get to finish at shutdown.
const DRAIN: Duration = Duration::from_secs(5);

/// Serves the exporter on `listener` until `shutdown` completes. Each
/// connection must send a request's headers within the configured header-read
/// timeout, or it is closed.
pub async fn serve(
    listener: tokio::net::TcpListener,
    exporter: &Exporter,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(exporter);
    let timeout = exporter.shared.config.header_read_timeout;
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(err) => {
                    // Out of file descriptors and the like: wait, then go on.
                    tracing::warn!(%err, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let service = TowerToHyperService::new(app.clone());
        let conn = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(timeout)
            .serve_connection(TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            // Errors here are the client's (closed, timed out, malformed).
            let _ = conn.await;
        });
    }
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(DRAIN) => {}
    }
    Ok(())
}
