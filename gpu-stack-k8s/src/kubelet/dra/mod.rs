//! The kubelet side of a DRA (Dynamic Resource Allocation) driver, as the
//! Kubernetes 1.34 to 1.37 kubelets speak it: the `DRAPlugin` v1 gRPC service a
//! driver's kubelet plugin serves ([`server`], translating to and from the
//! plain types of [`driver`] that the plugin logic implements), the plugin
//! registration service the kubelet's plugin watcher calls
//! ([`registration`]), one function serving both on their unix sockets
//! ([`plugin::serve`]), and, for tests (the `testing` feature), a stand-in
//! kubelet that discovers, registers and calls a plugin (`standin`).
//!
//! How the kubelet finds and talks to a DRA plugin (from `k8s.io/kubernetes`
//! v1.34.4, `pkg/kubelet/pluginmanager` and `pkg/kubelet/cm/dra/plugin`, and
//! the upstream helper `k8s.io/dynamic-resource-allocation` v0.34.4
//! `kubeletplugin`; unchanged in v1.37.2, whose kubelet still offers exactly
//! `v1.DRAPlugin` and `v1beta1.DRAPlugin`, and reads the optional
//! `dra-health` stream where a plugin serves it; this one does not):
//!
//! - The plugin watcher watches `/var/lib/kubelet/plugins_registry` (the
//!   kubelet's `plugins_registry` directory) with fsnotify. Every unix socket
//!   created there whose name does not start with `.` is a plugin; its name
//!   is free, the upstream helper uses `<driver>-reg.sock`. At start the
//!   kubelet walks the directory and registers the sockets already there; it
//!   never deletes them (unlike the device-plugin directory), so a plugin
//!   does nothing when the kubelet restarts. A socket removed from the
//!   directory deregisters the plugin; one created again registers it again.
//! - It dials the socket (the socket path is the gRPC target, so the HTTP/2
//!   `:authority` is that path) and calls `pluginregistration.Registration/GetInfo`.
//!   `type` must be `DRAPlugin` (the handler key), `name` is the DRA driver
//!   name, `endpoint` the path of the socket serving the DRA service (an
//!   empty endpoint means the registration socket itself). The kubelet
//!   dials `unix:<endpoint>`, so the endpoint must be an absolute path as the
//!   kubelet sees it (in a container: the same path as on the host).
//! - `supported_versions` lists gRPC services as `<proto package's last
//!   element>.<service>`: `v1.DRAPlugin` for this API, `v1beta1.DRAPlugin`
//!   for the older one. The kubelet takes the first entry it supports (it
//!   supports `v1.DRAPlugin` and `v1beta1.DRAPlugin`) and refuses the plugin
//!   when there is none. That string is only a name: on the wire the service
//!   is `/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources`
//!   ([`DRA_GRPC_SERVICE`]).
//! - It then calls `NotifyRegistrationStatus` with `plugin_registered` and,
//!   on refusal, the reason. An endpoint already registered for the same
//!   driver is refused.
//! - It calls `NodePrepareResources` / `NodeUnprepareResources` with a 45 s
//!   deadline, with the claims of one pod for this driver. A response must
//!   have an entry for every claim and none for a claim it did not send (a
//!   non-empty `error` is that claim's failure; a missing entry fails the
//!   pod's preparation, which the kubelet retries later).
//!
//! The upstream helper puts the DRA socket at
//! `/var/lib/kubelet/plugins/<driver>/dra.sock`; [`plugin::DraPlugin`] does
//! the same by default.

/// Types and gRPC stubs generated at build time from `proto/dra/v1/api.proto`
/// (package `k8s.io.kubelet.pkg.apis.dra.v1`, upstream names and numbers).
pub mod api {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
}

/// Types and gRPC stubs generated at build time from
/// `proto/pluginregistration/v1/api.proto` (package `pluginregistration`).
pub mod registration_api {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("pluginregistration");
}

pub mod driver;
pub mod plugin;
pub mod registration;
pub mod server;
#[cfg(any(test, feature = "testing"))]
pub mod standin;
#[cfg(test)]
mod tests;

pub use driver::{ClaimRef, DraDriver, PrepareResults, PreparedDevice, UnprepareResults};
pub use plugin::{DraPlugin, DraServeError, serve};
pub use registration::{
    DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR, DRA_GRPC_SERVICE, DRA_PLUGIN_SERVICE_V1, DRA_SOCKET,
    PLUGIN_TYPE, RegistrationState, SUPPORTED_VERSIONS, registration_socket_name,
};
pub use server::{DraService, MAX_CLAIMS_PER_REQUEST};
#[cfg(any(test, feature = "testing"))]
pub use standin::DraKubeletStandin;
