//! Kubelet device plugin API v1beta1: generated gRPC types, the plugin server,
//! registration with the kubelet and the kubelet-restart watch; the agent loop
//! ([`run`]) and GPU feature discovery ([`gfd`]).

/// Types and gRPC stubs generated at build time from
/// `proto/deviceplugin/v1beta1/api.proto` (upstream field names and numbers).
pub mod api {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("v1beta1");
}

pub mod authority;
pub mod cdi;
pub mod gfd;
pub mod health;
pub mod labels;
pub mod node;
pub mod plugin;
pub mod run;
pub mod server;
pub mod transport;

pub use plugin::{DevicePlugins, PluginError, PluginOptions, socket_name};
