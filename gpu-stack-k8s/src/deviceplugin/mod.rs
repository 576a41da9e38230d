//! The device plugin agent: the plugins of a node's resources over the
//! kubelet's device plugin API ([`plugin`]; the protocol itself is
//! [`crate::kubelet::deviceplugin`]), device health ([`health`]), the CDI
//! spec ([`cdi`]), node labels ([`labels`]), the agent loop ([`run`]) and GPU
//! feature discovery ([`gfd`]).

pub mod cdi;
pub mod gfd;
pub mod health;
pub mod labels;
pub mod node;
pub mod plugin;
pub mod run;

pub use plugin::{DevicePlugins, PluginError, PluginOptions, socket_name};
