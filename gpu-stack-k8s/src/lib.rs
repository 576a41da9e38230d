//! gpu-stack-k8s: the cluster side effects of gpu-stack.
pub mod deviceplugin;
pub mod exporter;
pub mod podresources;
