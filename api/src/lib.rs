//! Types shared by gpu-mps-shim, gpu-mps-hook, gpu-mps-manager and gpu-mps-device-plugin. Pure,
//! except the manager client ([`client`], [`proto`]), the file writing every component shares
//! ([`files`]), the node files every component reads ([`node_files`]) and the `/proc` reads of
//! [`process_identity`] and [`mps_pipe_dir`].

pub mod annotations;
pub mod client;
pub mod container_id;
pub mod container_request;
pub mod daemon_key;
pub mod files;
pub mod hook_invocation;
pub mod inventory;
pub mod lease_record;
pub mod limits;
pub mod maxima;
pub mod memory_units;
pub mod message;
pub mod mps_pipe_dir;
pub mod node_config;
pub mod node_files;
pub mod process_identity;
pub mod quantity;
pub mod status_view;

pub use container_id::ContainerId;
pub use container_request::ContainerRequest;
pub use daemon_key::DaemonKey;
pub use limits::Limits;
pub use node_config::NodeConfig;

/// Generated from proto/manager.proto: messages in `manager`, the ttrpc client
/// (`ManagerClient`) and server trait (`Manager`, `create_manager`) in `manager_ttrpc`.
pub mod proto {
    #[allow(warnings, clippy::all, unsafe_code)]
    pub mod manager {
        include!(concat!(env!("OUT_DIR"), "/manager.rs"));
    }
    #[allow(warnings, clippy::all, unsafe_code)]
    pub mod manager_ttrpc {
        include!(concat!(env!("OUT_DIR"), "/manager_ttrpc.rs"));
    }
    pub use manager::*;
}

/// Where the container's gate dir is mounted, which CUDA inside the container takes as its MPS
/// pipe dir: the default path, so that a process that unsets CUDA_MPS_PIPE_DIRECTORY still lands
/// on MPS (through the gate).
pub const CONTAINER_PIPE_DIR: &str = "/tmp/nvidia-mps";
