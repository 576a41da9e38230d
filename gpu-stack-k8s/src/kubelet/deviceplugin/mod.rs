//! Kubelet device plugin API v1beta1: the generated gRPC types ([`api`]), the
//! `DevicePlugin` service of one resource ([`server`]), registration with the
//! kubelet and the meaning of changes in its directory ([`registration`]),
//! and, for tests (the `testing` feature), a stand-in kubelet that speaks
//! the registration protocol (`standin`). The agent that serves a node's
//! GPUs over it is [`crate::deviceplugin`].

/// Types and gRPC stubs generated at build time from
/// `proto/deviceplugin/v1beta1/api.proto` (upstream field names and numbers).
pub mod api {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("v1beta1");
}

pub mod registration;
pub mod server;
#[cfg(any(test, feature = "testing"))]
pub mod standin;

pub use registration::{API_VERSION, DEFAULT_KUBELET_DIR, KUBELET_SOCKET, RegisterError, register};
