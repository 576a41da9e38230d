//! The kube side of the operator: the API client, the HTTP endpoints, and
//! Events. The controller loop joins them once the operator logic lands.
pub mod client;
pub mod events;
pub mod ops;
