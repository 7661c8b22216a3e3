//! gpu-mps-cli: the `gpu-mps` command line of a node. It reads the manager's status over its
//! socket, shows how gpu-mps-shim would rewrite a bundle, registers the `gpu-mps` runtime
//! handler with containerd, and checks the node (`doctor`). Kept apart from the daemon so that
//! gpu-mps-manager carries neither the shim's rewrite nor a TOML editor.

pub mod containerd_registration;
pub mod doctor;
pub mod explain;
pub mod host_paths;
pub mod installed;
pub mod live_leases;
pub mod remove_state;
