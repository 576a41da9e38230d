//! HTTP side: `/metrics` with content negotiation, `/health`, and a landing page.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use gpu_stack_core::metrics::Format;

use super::state::{Exporter, Shared};

async fn metrics(State(shared): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    let started = Instant::now();
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    let format = Format::negotiate(accept);
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

/// Serves the exporter on `listener` until `shutdown` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    exporter: &Exporter,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(exporter))
        .with_graceful_shutdown(shutdown)
        .await
}
