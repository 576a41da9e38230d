//! gpu-stack-k8s: the cluster side effects of gpu-stack.
//!
//! Layout, one concern per folder:
//!
//! - [`operator`]: the ClusterPolicy CRD, the pure desired-state function, the
//!   reconcile loop over the [`operator::cluster::Cluster`] seam (in-memory and kube
//!   implementations), and the controller, leader election and metrics that
//!   run it on a real cluster.
//! - [`kubelet`]: the kubelet's protocols: the device plugin API v1beta1
//!   (service, registration), the pod-resources API, gRPC over unix sockets
//!   and, with the `testing` feature, the stand-in kubelets for tests.
//! - [`deviceplugin`]: the device plugin agent (health, CDI spec, labels,
//!   the agent loop) and GPU feature discovery.
//! - [`exporter`]: the DCGM-compatible GPU metrics exporter.
//! - [`migmanager`]: the MIG manager agent.
//! - [`nodediscovery`]: the agent that writes NFD's node labels where NFD is not installed.
//! - [`toolkit`]: the container toolkit agent (CDI-native runtime setup, no shim).
//! - [`demo`]: the operator and agents against an in-memory cluster and simulated GPUs.
//! - [`validator`] (validator/): the per-node validator's side effects and the plugin check's workload pod.
//! - [`node_status`] (node_status.rs): the node status exporter.
//! - [`clock`] (clock.rs): the wall clock in Unix seconds.
//! - [`api_client`] (api_client.rs): Kubernetes clients with a deadline on every request.
//!
//! ```
//! // The CRD users install is generated from the Rust types.
//! let crd = gpu_stack_k8s::operator::clusterpolicy::crd_yaml()?;
//! assert!(crd.contains("clusterpolicies.nvidia.com"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]
pub mod api_client;
pub mod clock;
pub mod demo;
pub mod deviceplugin;
pub mod dra;
pub mod exporter;
pub mod kubelet;
pub mod migmanager;
pub mod node_status;
pub mod nodediscovery;
pub mod operator;
pub mod toolkit;
pub mod validator;
