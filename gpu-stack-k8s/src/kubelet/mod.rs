//! The kubelet's protocols, as the node agents speak them: the device plugin
//! API ([`deviceplugin`]), the DRA kubelet plugin API and plugin
//! registration ([`dra`]), the pod-resources API ([`podresources`]), and gRPC
//! over the kubelet's unix sockets ([`transport`], with the `:authority`
//! rewrite of [`authority`]) that they and the CRI client share. The stand-in
//! kubelets for tests (`deviceplugin::standin`, `dra::standin`,
//! `podresources::standin`) are built with the `testing` feature.

pub mod authority;
pub mod deviceplugin;
pub mod dra;
pub mod podresources;
pub mod transport;
