//! The kubelet side of the node agents: the pod-resources API
//! ([`podresources`]) and, for tests (the `testing` feature), a stand-in
//! kubelet that speaks the device-plugin registration protocol (`standin`).

pub mod podresources;
#[cfg(any(test, feature = "testing"))]
pub mod standin;
