//! gpu-stack-k8s: the cluster side effects of gpu-stack.
pub mod cluster;
pub mod clusterpolicy;
pub mod controller;
pub mod demo;
pub mod desired;
pub mod deviceplugin;
pub mod exporter;
pub mod kubelet_standin;
pub mod leader;
pub mod migmanager;
pub mod operator;
pub mod operator_metrics;
pub mod podresources;
