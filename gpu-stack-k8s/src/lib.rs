//! gpu-stack-k8s: the cluster side effects of gpu-stack.
//!
//! - [`clusterpolicy`], [`desired`], [`operator`]: the ClusterPolicy CRD, the pure
//!   desired-state function and the reconcile loop over the [`cluster::Cluster`]
//!   seam (in-memory and kube implementations); [`controller`] and [`leader`] run
//!   it on a real cluster.
//! - [`deviceplugin`], [`podresources`], [`exporter`], [`migmanager`],
//!   [`validator`], [`node_status`]: the node agents' kubelet protocols and loops.
//! - [`demo`]: the operator and agents against an in-memory cluster and simulated GPUs.
//! - [`nodediscovery`]: the agent that writes NFD's node labels where NFD is not installed.
//! - [`toolkit`]: the container toolkit agent (CDI-native runtime setup, no shim).
//!
//! ```
//! // The CRD users install is generated from the Rust types.
//! let crd = gpu_stack_k8s::clusterpolicy::crd_yaml()?;
//! assert!(crd.contains("clusterpolicies.nvidia.com"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
pub mod demo;
pub mod deviceplugin;
pub mod exporter;
pub mod kubelet;
pub mod migmanager;
pub mod node_status;
pub mod nodediscovery;
pub mod operator;
pub mod toolkit;
pub mod validator;

// The operator's modules live under `operator/`; their old paths stay.
pub use operator::metrics as operator_metrics;
pub use operator::{cluster, clusterpolicy, controller, desired, leader};

// The kubelet's protocols live under `kubelet/`; their old paths stay.
pub use kubelet::podresources;
#[cfg(any(test, feature = "testing"))]
pub use kubelet::standin as kubelet_standin;
