//! A kube client that counts every request it sends.
//!
//! The count feeds `gpu_stack_operator_api_requests_total{verb,resource}`,
//! which is how the benchmark checks "no writes on resync" from outside.
use kube::client::{Body, ClientBuilder};
use kube::{Client, Config};
use tower::util::MapRequestLayer;

use crate::operator_metrics::OperatorMetrics;

/// Builds a client for `config` whose requests are recorded in `metrics`.
pub fn counting_client(config: Config, metrics: OperatorMetrics) -> Result<Client, kube::Error> {
    let layer = MapRequestLayer::new(move |req: http::Request<Body>| {
        let uri = req.uri();
        metrics.record_request(req.method().as_str(), uri.path(), uri.query());
        req
    });
    Ok(ClientBuilder::try_from(config)?.with_layer(&layer).build())
}
