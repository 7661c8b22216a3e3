//! gpu-mps-device-plugin: kubelet's device plugin API (v1beta1) for `gpu-mps.io/memory`, so that
//! the scheduler places GPU pods by the memory they ask for. The unit arithmetic lives in
//! gpu_mps_api::memory_units, shared with the manager; this crate is the kubelet front end.

pub mod allocate_response;
pub mod device_list;
pub mod gpu_delivery;
pub mod health;
pub mod kubelet_link;
pub mod node_view;
pub mod service;

/// Generated from proto/v1beta1.proto.
#[allow(clippy::all, missing_docs, unreachable_pub)]
pub mod v1beta1 {
    tonic::include_proto!("v1beta1");

    pub const VERSION: &str = "v1beta1";
    pub const HEALTHY: &str = "Healthy";
    pub const UNHEALTHY: &str = "Unhealthy";
    /// kubelet's registration socket, in the device-plugins dir.
    pub const KUBELET_SOCKET: &str = "kubelet.sock";
}
