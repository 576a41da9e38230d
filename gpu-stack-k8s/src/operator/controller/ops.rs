//! The operator's HTTP endpoints: `/healthz`, `/readyz` and `/metrics`.
//!
//! Liveness is "the process answers and no loop is wedged": each loop marks
//! when its current pass began ([`Progress`]), and `/healthz` fails while a
//! pass has run longer than [`WEDGED_AFTER`], so the kubelet restarts a
//! process stuck in a wait that never ends. A loop idle between passes is
//! healthy. `/healthz` also says how long the API server has been silent
//! (no answer to any request), without failing for it: a restart does not
//! bring an API server back, and the loops retry on their own. Readiness is
//! set by the binary once the API server answered
//! and, on the leader, the watches have synced; a standby replica is ready
//! as soon as it is competing for the lease, so a rolling update does not
//! wait for leadership that cannot come.
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::time::Instant;

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

/// How long one pass of a loop may run before `/healthz` fails. Every API
/// call has its own deadline ([`crate::api_client::REQUEST_DEADLINE`]) and
/// the longest passes (a reconcile at 5,000 nodes, an upgrade pass draining
/// a node) take well under a minute; a pass this old waits on something
/// that will not come.
pub const WEDGED_AFTER: Duration = Duration::from_secs(300);

/// How long the API server may be silent before `/healthz` says so.
pub const SILENT_AFTER: Duration = Duration::from_secs(10);

/// When each loop's pass in flight began, and when the API server last
/// answered (see the module docs). Cloned handles share one state.
#[derive(Clone, Debug)]
pub struct Progress {
    passes: Arc<Mutex<BTreeMap<&'static str, Instant>>>,
    wedged_after: Duration,
    /// When a request last got an answer (any status), and when this
    /// process started (the silence counts from there before any answer).
    last_answer: Arc<Mutex<Instant>>,
}

impl Default for Progress {
    fn default() -> Self {
        Self::new(WEDGED_AFTER)
    }
}

/// A pass in flight; dropping it (the pass ended, failed or was cancelled)
/// clears the mark.
#[must_use = "the pass counts as running until this is dropped"]
pub struct PassInFlight {
    progress: Progress,
    name: &'static str,
}

impl Drop for PassInFlight {
    fn drop(&mut self) {
        if let Ok(mut passes) = self.progress.passes.lock() {
            passes.remove(self.name);
        }
    }
}

impl Progress {
    /// A pass of any loop may run `wedged_after` before the process counts
    /// as wedged.
    pub fn new(wedged_after: Duration) -> Self {
        Self {
            passes: Arc::default(),
            wedged_after,
            last_answer: Arc::new(Mutex::new(Instant::now())),
        }
    }

    /// Records that the API server answered a request.
    pub fn api_answered(&self) {
        if let Ok(mut last) = self.last_answer.lock() {
            *last = Instant::now();
        }
    }

    /// How long the API server has been silent at `now`, when that is
    /// longer than [`SILENT_AFTER`].
    pub fn api_silence(&self, now: Instant) -> Option<Duration> {
        let last = *self.last_answer.lock().ok()?;
        Some(now.saturating_duration_since(last)).filter(|s| *s > SILENT_AFTER)
    }

    /// Marks the start of a pass of loop `name`.
    pub fn begin(&self, name: &'static str) -> PassInFlight {
        if let Ok(mut passes) = self.passes.lock() {
            passes.insert(name, Instant::now());
        }
        PassInFlight {
            progress: self.clone(),
            name,
        }
    }

    /// The loops whose pass in flight began longer than the bound before
    /// `now`, with how long it has run.
    pub fn wedged(&self, now: Instant) -> Vec<(&'static str, Duration)> {
        let Ok(passes) = self.passes.lock() else {
            return Vec::new();
        };
        passes
            .iter()
            .map(|(name, began)| (*name, now.saturating_duration_since(*began)))
            .filter(|(_, running)| *running > self.wedged_after)
            .collect()
    }
}

#[derive(Clone)]
struct OpsState {
    metrics: OperatorMetrics,
    readiness: Readiness,
    progress: Progress,
}

/// The router, separate from [`serve`] so tests can drive it without a socket.
pub fn router(metrics: OperatorMetrics, readiness: Readiness, progress: Progress) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_handler))
        .with_state(OpsState {
            metrics,
            readiness,
            progress,
        })
}

async fn healthz(State(state): State<OpsState>) -> impl IntoResponse {
    let now = Instant::now();
    let wedged = state.progress.wedged(now);
    if wedged.is_empty() {
        let body = match state.progress.api_silence(now) {
            None => "ok".to_string(),
            Some(silent) => format!(
                "ok; the API server has not answered for {}s (each request fails at its \
                 deadline and the loops retry)",
                silent.as_secs()
            ),
        };
        return (StatusCode::OK, body);
    }
    let loops: Vec<String> = wedged
        .iter()
        .map(|(name, running)| format!("{name} (one pass for {}s)", running.as_secs()))
        .collect();
    (
        StatusCode::SERVICE_UNAVAILABLE,
        format!("wedged: {}", loops.join(", ")),
    )
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
    progress: Progress,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(metrics, readiness, progress))
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn only_a_pass_older_than_the_bound_is_wedged() {
        let progress = Progress::new(Duration::from_secs(300));
        let now = Instant::now();
        assert!(progress.wedged(now).is_empty(), "idle loops are healthy");
        let _reconcile = progress.begin("reconcile");
        let upgrade = progress.begin("upgrade");
        assert!(progress.wedged(now + Duration::from_secs(299)).is_empty());
        let later = now + Duration::from_secs(301);
        let names: Vec<&str> = progress.wedged(later).iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["reconcile", "upgrade"]);
        drop(upgrade);
        let names: Vec<&str> = progress.wedged(later).iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["reconcile"]);
    }

    #[test]
    fn the_api_server_counts_as_silent_only_past_the_bound() {
        let progress = Progress::default();
        let now = Instant::now();
        progress.api_answered();
        assert_eq!(progress.api_silence(now), None);
        assert_eq!(progress.api_silence(now + SILENT_AFTER / 2), None);
        let silent = progress
            .api_silence(now + SILENT_AFTER * 3)
            .expect("silent past the bound");
        assert!(silent > SILENT_AFTER * 2, "{silent:?}");
        // Any answer ends the silence.
        progress.api_answered();
        assert_eq!(progress.api_silence(Instant::now()), None);
    }

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
        let progress = Progress::new(Duration::from_millis(50));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(
            listener,
            metrics,
            readiness.clone(),
            progress.clone(),
            async {
                let _ = rx.await;
            },
        ));

        assert!(get(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
        // A pass running past the bound fails liveness; once it ends, healthy.
        let pass = progress.begin("reconcile");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let wedged = get(addr, "/healthz").await;
        assert!(wedged.starts_with("HTTP/1.1 503"), "{wedged}");
        assert!(
            wedged.contains("wedged: reconcile (one pass for"),
            "{wedged}"
        );
        drop(pass);
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
