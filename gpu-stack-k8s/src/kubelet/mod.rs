//! The kubelet side of the node agents: the pod-resources API
//! ([`podresources`]) and a stand-in kubelet that speaks the device-plugin
//! registration protocol ([`standin`]).

pub mod podresources;
pub mod standin;
