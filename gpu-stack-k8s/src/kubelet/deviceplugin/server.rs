//! The `v1beta1.DevicePlugin` gRPC service for one resource: translates the
//! core decisions (device health, preferred allocation, Allocate contents) to
//! and from the wire.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use gpu_stack_core::deviceplugin::allocate::{ContainerAllocation, NvlinkMap};
use gpu_stack_core::deviceplugin::{Resource, Settings, allocate_container, preferred_allocation};
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use super::api;

/// Health string the kubelet expects for a usable device.
pub const HEALTHY: &str = "Healthy";
/// Health string the kubelet expects for an unusable device.
pub const UNHEALTHY: &str = "Unhealthy";

/// The options this plugin advertises, both in `Register` and in
/// `GetDevicePluginOptions` (older kubelets read the former).
pub fn plugin_options() -> api::DevicePluginOptions {
    api::DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

/// Builds the `ListAndWatch` device list of a resource from per-device health.
pub fn wire_devices(resource: &Resource, healthy: impl Fn(&str, &str) -> bool) -> Vec<api::Device> {
    resource
        .devices
        .iter()
        .map(|d| api::Device {
            id: d.id.clone(),
            health: if healthy(&d.uuid, &d.gpu_uuid) {
                HEALTHY
            } else {
                UNHEALTHY
            }
            .to_string(),
            topology: d.numa_node.map(|n| api::TopologyInfo {
                nodes: vec![api::NumaNode { id: n }],
            }),
        })
        .collect()
}

/// Converts a core allocation into the wire message.
pub fn wire_allocation(a: ContainerAllocation) -> api::ContainerAllocateResponse {
    api::ContainerAllocateResponse {
        envs: a.envs.into_iter().collect(),
        mounts: a
            .mounts
            .into_iter()
            .map(|m| api::Mount {
                container_path: m.container_path,
                host_path: m.host_path,
                read_only: m.read_only,
            })
            .collect(),
        devices: a
            .devices
            .into_iter()
            .map(|d| api::DeviceSpec {
                container_path: d.container_path,
                host_path: d.host_path,
                permissions: d.permissions,
            })
            .collect(),
        annotations: a.annotations.into_iter().collect(),
        cdi_devices: a
            .cdi_devices
            .into_iter()
            .map(|name| api::CdiDevice { name })
            .collect(),
    }
}

/// The gRPC service of one resource.
#[derive(Clone)]
pub struct PluginService {
    resource: Arc<Resource>,
    settings: Arc<Settings>,
    nvlinks: Arc<NvlinkMap>,
    devices: watch::Receiver<Arc<Vec<api::Device>>>,
    stop: watch::Receiver<bool>,
}

impl PluginService {
    /// A service that streams `devices` until `stop` becomes true.
    pub fn new(
        resource: Arc<Resource>,
        settings: Arc<Settings>,
        nvlinks: Arc<NvlinkMap>,
        devices: watch::Receiver<Arc<Vec<api::Device>>>,
        stop: watch::Receiver<bool>,
    ) -> PluginService {
        PluginService {
            resource,
            settings,
            nvlinks,
            devices,
            stop,
        }
    }
}

type DeviceStream =
    Pin<Box<dyn Stream<Item = Result<api::ListAndWatchResponse, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl api::device_plugin_server::DevicePlugin for PluginService {
    async fn get_device_plugin_options(
        &self,
        _request: Request<api::Empty>,
    ) -> Result<Response<api::DevicePluginOptions>, Status> {
        Ok(Response::new(plugin_options()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _request: Request<api::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let rx = self.devices.clone();
        let stop = self.stop.clone();
        let stream =
            futures::stream::unfold((rx, stop, true), |(mut rx, mut stop, first)| async move {
                if *stop.borrow() {
                    return None;
                }
                if !first {
                    tokio::select! {
                        changed = rx.changed() => if changed.is_err() { return None },
                        _ = stop.wait_for(|s| *s) => return None,
                    }
                }
                let devices = rx.borrow_and_update().as_ref().clone();
                Some((Ok(api::ListAndWatchResponse { devices }), (rx, stop, false)))
            });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<api::PreferredAllocationRequest>,
    ) -> Result<Response<api::PreferredAllocationResponse>, Status> {
        let mut container_responses = Vec::new();
        for c in request.into_inner().container_requests {
            let size = usize::try_from(c.allocation_size).map_err(|_| {
                Status::invalid_argument(format!(
                    "resource {}: allocation size {} is negative; ask for 0 or more devices",
                    self.resource.name, c.allocation_size
                ))
            })?;
            let device_i_ds = preferred_allocation(
                &self.resource,
                &self.nvlinks,
                self.settings.shared_allocation_policy,
                &c.available_device_i_ds,
                &c.must_include_device_i_ds,
                size,
            )
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
            container_responses.push(api::ContainerPreferredAllocationResponse { device_i_ds });
        }
        Ok(Response::new(api::PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        request: Request<api::AllocateRequest>,
    ) -> Result<Response<api::AllocateResponse>, Status> {
        let mut container_responses = Vec::new();
        for c in request.into_inner().container_requests {
            let a = allocate_container(&self.resource, &self.settings, &c.devices_ids)
                .map_err(|e| Status::invalid_argument(e.to_string()))?
                // Like NVIDIA's plugin: only the optional driver nodes this
                // plugin sees in /dev.
                .without_absent_nodes(|p| std::path::Path::new(p).exists());
            container_responses.push(wire_allocation(a));
        }
        Ok(Response::new(api::AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        _request: Request<api::PreStartContainerRequest>,
    ) -> Result<Response<api::PreStartContainerResponse>, Status> {
        Ok(Response::new(api::PreStartContainerResponse {}))
    }
}
