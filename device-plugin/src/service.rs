//! The DevicePlugin gRPC service kubelet calls. It holds no mutable state of its own: the device
//! list is owned by the health task and arrives through a watch channel.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;

use gpu_mps_api::memory_units::UnitLayout;
use tokio::sync::watch;
use tokio_stream::Stream;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::WatchStream;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use crate::allocate_response::container_response;
use crate::gpu_delivery::GpuDelivery;
use crate::kubelet_link;
use crate::v1beta1::device_plugin_server::DevicePlugin;
use crate::v1beta1::{
    AllocateRequest, AllocateResponse, ContainerPreferredAllocationResponse, Device, DevicePluginOptions,
    Empty, ListAndWatchResponse, PreStartContainerRequest, PreStartContainerResponse,
    PreferredAllocationRequest, PreferredAllocationResponse,
};

pub struct PluginService {
    layout: Arc<UnitLayout>,
    deliveries: Arc<HashMap<String, GpuDelivery>>,
    devices: watch::Receiver<Vec<Device>>,
}

impl PluginService {
    pub fn new(
        layout: Arc<UnitLayout>,
        deliveries: Arc<HashMap<String, GpuDelivery>>,
        devices: watch::Receiver<Vec<Device>>,
    ) -> Self {
        PluginService {
            layout,
            deliveries,
            devices,
        }
    }
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for PluginService {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(kubelet_link::options()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(&self, _: Request<Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
        // WatchStream yields the current list first, then each change.
        let stream =
            WatchStream::new(self.devices.clone()).map(|devices| Ok(ListAndWatchResponse { devices }));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let mut responses = Vec::new();
        for c in request.into_inner().container_requests {
            let size = u32::try_from(c.allocation_size).map_err(|_| {
                Status::invalid_argument(format!("allocation_size {} is negative", c.allocation_size))
            })?;
            // No single GPU with room: an empty answer leaves the choice to kubelet, and
            // Allocate then refuses a spread with its reason.
            let picked = self
                .layout
                .preferred(&c.available_device_i_ds, &c.must_include_device_i_ds, size)
                .unwrap_or_default();
            if picked.is_empty() {
                warn!(
                    size,
                    available = c.available_device_i_ds.len(),
                    "no single GPU has room for the request"
                );
            }
            responses.push(ContainerPreferredAllocationResponse { device_i_ds: picked });
        }
        Ok(Response::new(PreferredAllocationResponse {
            container_responses: responses,
        }))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let mut responses = Vec::new();
        for c in request.into_inner().container_requests {
            let allocation = self.layout.allocation(&c.devices_ids).map_err(|e| {
                warn!(devices = %c.devices_ids.join(","), refusal = %e, "allocate refused");
                Status::invalid_argument(format!("gpu-mps-device-plugin: {e}"))
            })?;
            let delivery = self.deliveries.get(&allocation.gpu_uuid).ok_or_else(|| {
                Status::internal(format!(
                    "no way to hand GPU {} to a container",
                    allocation.gpu_uuid
                ))
            })?;
            info!(gpu = %allocation.gpu_uuid, units = allocation.units.len(), memory_bytes = allocation.memory_bytes, via = %delivery.describe(), "allocated");
            responses.push(container_response(&allocation, delivery));
        }
        Ok(Response::new(AllocateResponse {
            container_responses: responses,
        }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}
