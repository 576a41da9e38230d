//! The operator's kube client: it counts every request it sends, bounds each
//! one with a deadline, and lets writes through only while this replica
//! leads.
//!
//! The count feeds `gpu_stack_operator_api_requests_total{verb,resource}`,
//! which is how the benchmark checks "no writes on resync" from outside.
//!
//! kube's default retry layer is off: it retries 429, 503 and 504 up to 15
//! times, honouring `Retry-After`, inside a single call. An eviction that a
//! PodDisruptionBudget refuses answers 429 with `Retry-After: 10`, so one
//! refused eviction held the whole driver upgrade pass for about five
//! minutes instead of being tried again on the next pass; and the retried
//! attempts never reached the count. The operator's loops retry on their
//! own (the reconcile requeue, the next upgrade pass, the watchers' backoff,
//! the lease renewal), so every request here is sent, and counted, once.
//!
//! Every request but a watch has [`REQUEST_DEADLINE`] ([`crate::api_client`]).
//!
//! [`WriteGate`]: a replica that lost its lease learns so only when a
//! renewal fails, and its loops would go on writing until their passes end:
//! two replicas could each hand out the driver upgrade's `maxUnavailable`
//! slots. The gate refuses every write but the lease's own unless this
//! replica leads and its last successful lease write is recent enough that
//! no other replica can have taken the lease since; refused writes are
//! counted in `gpu_stack_operator_writes_dropped_total`.
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::{Method, Request, Response};
use kube::client::{Body, ClientBuilder};
use kube::{Client, Config};
use prometheus_client::metrics::counter::Counter;
use tower::util::{MapRequestLayer, MapResponseLayer};
use tower::{BoxError, Layer, Service};

use gpu_stack_core::operator::lease::LeaseTrust;

use super::ops::Progress;
use crate::api_client::{DeadlineLayer, REQUEST_DEADLINE};
use crate::operator::metrics::OperatorMetrics;

/// Builds a client for `config` whose requests are recorded in `metrics`,
/// without kube's default retries, with a deadline on each request, and
/// whose writes pass `gate` (see the module docs). Every answer is recorded
/// in `progress`, so `/healthz` can say when the API server went silent.
pub fn counting_client(
    mut config: Config,
    metrics: OperatorMetrics,
    gate: WriteGate,
    progress: Progress,
) -> Result<Client, kube::Error> {
    config.default_retry = false;
    let layer = MapRequestLayer::new(move |req: http::Request<Body>| {
        let uri = req.uri();
        metrics.record_request(req.method().as_str(), uri.path(), uri.query());
        req
    });
    Ok(ClientBuilder::try_from(config)?
        .with_layer(&DeadlineLayer::new(REQUEST_DEADLINE))
        .with_layer(&records_answers(progress))
        .with_layer(&layer)
        .with_layer(&gate)
        .build())
}

/// A layer that records each answer (its headers came, whatever the status)
/// in `progress`.
fn records_answers<B>(
    progress: Progress,
) -> MapResponseLayer<impl Fn(Response<B>) -> Response<B> + Clone> {
    MapResponseLayer::new(move |response| {
        progress.api_answered();
        response
    })
}

/// A write refused because this replica may not write now.
#[derive(Debug, thiserror::Error)]
#[error(
    "write {method} {path} refused: this replica does not hold the leader lease, or has not \
     renewed it recently enough to be sure no other replica took it"
)]
pub struct NotLeading {
    /// The refused request's method.
    pub method: String,
    /// The refused request's path.
    pub path: String,
}

/// Whether writes may go out now (see the module docs). Cloned handles share
/// one state.
#[derive(Clone, Debug, Default)]
pub struct WriteGate {
    state: Option<Arc<GateState>>,
}

#[derive(Debug)]
struct GateState {
    /// `/apis/coordination.k8s.io/v1/namespaces/<ns>/leases`.
    leases: String,
    /// `<leases>/<name>`.
    lease: String,
    trust: Mutex<LeaseTrust>,
    dropped: Counter,
}

impl WriteGate {
    /// No leader election (a single replica): every write goes out.
    pub fn open() -> Self {
        Self { state: None }
    }

    /// Writes go out only while this replica leads through Lease
    /// `namespace/name` of `duration`, renewed `grace` before it expires
    /// ([`LeaseTrust`]); refused writes are counted in `dropped`.
    pub fn for_lease(
        namespace: &str,
        name: &str,
        duration: Duration,
        grace: Duration,
        dropped: Counter,
    ) -> Self {
        let leases = format!("/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases");
        Self {
            state: Some(Arc::new(GateState {
                lease: format!("{leases}/{name}"),
                leases,
                trust: Mutex::new(LeaseTrust::new(duration, grace)),
                dropped,
            })),
        }
    }

    /// Records whether the election says this replica leads.
    pub fn set_leading(&self, leading: bool) {
        if let Some(s) = &self.state
            && let Ok(mut trust) = s.trust.lock()
        {
            trust.set_leading(leading);
        }
    }

    /// Whether a write to `path` may go out at `now` (the lease's own always
    /// does: that is how the lead is won).
    pub fn admits(&self, path: &str, now: Instant) -> bool {
        let Some(s) = &self.state else {
            return true;
        };
        s.is_lease(path) || s.trust.lock().is_ok_and(|t| t.admits_write(now))
    }

    /// A lease write sent at `sent_at` succeeded.
    fn renewed(&self, sent_at: Instant) {
        if let Some(s) = &self.state
            && let Ok(mut trust) = s.trust.lock()
        {
            trust.renewed(sent_at);
        }
    }
}

impl GateState {
    fn is_lease(&self, path: &str) -> bool {
        path == self.lease || path == self.leases
    }
}

fn is_write(method: &Method) -> bool {
    !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

impl<S> Layer<S> for WriteGate {
    type Service = Gated<S>;

    fn layer(&self, inner: S) -> Gated<S> {
        Gated {
            inner,
            gate: self.clone(),
        }
    }
}

/// The service [`WriteGate`] builds.
#[derive(Clone, Debug)]
pub struct Gated<S> {
    inner: S,
    gate: WriteGate,
}

impl<S, B> Service<Request<Body>> for Gated<S>
where
    S: Service<Request<Body>, Response = Response<B>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = Response<B>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<B>, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let Some(state) = self.gate.state.clone() else {
            let answer = self.inner.call(req);
            return Box::pin(async move { answer.await.map_err(Into::into) });
        };
        let now = Instant::now();
        let path = req.uri().path();
        if is_write(req.method()) && !self.gate.admits(path, now) {
            state.dropped.inc();
            let refused = NotLeading {
                method: req.method().to_string(),
                path: path.chars().take(200).collect(),
            };
            return Box::pin(async move { Err(refused.into()) });
        }
        let lease_write = is_write(req.method()) && state.is_lease(path);
        let gate = self.gate.clone();
        let answer = self.inner.call(req);
        Box::pin(async move {
            let response = answer.await.map_err(Into::into)?;
            if lease_write && response.status().is_success() {
                gate.renewed(now);
            }
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const LEASE: &str = "/apis/coordination.k8s.io/v1/namespaces/ns/leases/op";
    const NODE: &str = "/api/v1/nodes/n1";

    fn gate() -> WriteGate {
        WriteGate::for_lease(
            "ns",
            "op",
            Duration::from_secs(15),
            Duration::from_secs(5),
            Counter::default(),
        )
    }

    #[test]
    fn without_election_every_write_goes_out() {
        assert!(WriteGate::open().admits(NODE, Instant::now()));
    }

    #[test]
    fn only_the_lease_itself_is_written_without_the_lead() {
        let g = gate();
        let t0 = Instant::now();
        // The lease is written to win the lead (create, then renewals).
        assert!(g.admits(LEASE, t0));
        assert!(g.admits("/apis/coordination.k8s.io/v1/namespaces/ns/leases", t0));
        assert!(!g.admits(NODE, t0));
        // Another lease in the namespace is no exemption.
        assert!(!g.admits(
            "/apis/coordination.k8s.io/v1/namespaces/ns/leases/other",
            t0
        ));
        // The rule itself (LeaseTrust) is the core's, tested there.
        g.renewed(t0);
        g.set_leading(true);
        assert!(g.admits(NODE, t0 + Duration::from_secs(12)));
        assert!(!g.admits(NODE, t0 + Duration::from_secs(13)));
    }

    #[tokio::test]
    async fn a_refused_write_is_counted_and_never_sent() {
        let dropped = Counter::default();
        let g = WriteGate::for_lease(
            "ns",
            "op",
            Duration::from_secs(15),
            Duration::from_secs(5),
            dropped.clone(),
        );
        let sent = Arc::new(AtomicUsize::new(0));
        let seen = sent.clone();
        let inner = tower::service_fn(move |_req: Request<Body>| {
            seen.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, BoxError>(Response::new(())) }
        });
        let mut svc = g.layer(inner);
        let patch = Request::patch(NODE).body(Body::empty()).expect("a request");
        let err = svc.call(patch).await.expect_err("refused");
        assert!(err.to_string().contains("refused"), "{err}");
        let read = Request::get(NODE).body(Body::empty()).expect("a request");
        assert!(svc.call(read).await.is_ok(), "reads always go out");
        let renew = Request::patch(LEASE)
            .body(Body::empty())
            .expect("a request");
        assert!(svc.call(renew).await.is_ok());
        g.set_leading(true);
        let patch = Request::patch(NODE).body(Body::empty()).expect("a request");
        assert!(svc.call(patch).await.is_ok(), "leading after a lease write");
        assert_eq!(dropped.get(), 1);
        assert_eq!(sent.load(Ordering::SeqCst), 3);
    }
}
