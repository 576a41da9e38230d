//! gpu-stack-k8s: the cluster side effects of gpu-stack.
pub mod deviceplugin;
pub mod controller;
pub mod leader;
pub mod operator_metrics;
pub mod exporter;
pub mod podresources;
pub mod cluster;
pub mod clusterpolicy;
pub mod desired;
pub mod operator;
pub mod kubelet_standin;
pub mod migmanager;
pub mod demo;
