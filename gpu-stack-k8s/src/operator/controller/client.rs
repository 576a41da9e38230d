//! A kube client that counts every request it sends.
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
use kube::client::{Body, ClientBuilder};
use kube::{Client, Config};
use tower::util::MapRequestLayer;

use crate::operator::metrics::OperatorMetrics;

/// Builds a client for `config` whose requests are recorded in `metrics`,
/// without kube's default retries (see the module docs).
pub fn counting_client(
    mut config: Config,
    metrics: OperatorMetrics,
) -> Result<Client, kube::Error> {
    config.default_retry = false;
    let layer = MapRequestLayer::new(move |req: http::Request<Body>| {
        let uri = req.uri();
        metrics.record_request(req.method().as_str(), uri.path(), uri.query());
        req
    });
    Ok(ClientBuilder::try_from(config)?.with_layer(&layer).build())
}
