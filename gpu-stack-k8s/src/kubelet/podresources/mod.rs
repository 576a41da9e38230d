//! Kubelet pod-resources API v1: the generated gRPC types, a client over the
//! kubelet's unix socket, a background cache (so no scrape ever waits on the
//! kubelet), and a stand-in kubelet server for tests and benchmarks (the `testing`
//! feature).

/// Types and gRPC stubs generated at build time from
/// `proto/podresources/v1/api.proto`.
pub mod api {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("v1");
}

pub mod cache;
pub mod client;
#[cfg(any(test, feature = "testing"))]
pub mod standin;

pub use cache::{PodResourcesCache, PodResourcesState};
pub use client::{DEFAULT_SOCKET, PodResourcesClient, PodResourcesError, flatten};
#[cfg(any(test, feature = "testing"))]
pub use standin::StandinKubelet;
