//! gpu-mps-manager: the node daemon that runs one MPS control daemon per GPU set, enforces
//! each pod's limits on the MPS server, and accounts capacity. The `gpu-mps` CLI is the
//! gpu-mps-cli crate.

pub mod admission;
pub mod compute_mode;
pub mod core;
pub mod daemon_life;
pub mod fault_watch;
pub mod gate;
pub mod gpu_backend;
pub mod lease;
pub mod lease_files;
pub mod metrics;
pub mod mps_control;
pub mod mps_server_processes;
pub mod node_guard;
pub mod process_identity;
pub mod server;
pub mod state;
pub mod state_root;
