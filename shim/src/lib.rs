//! gpu-mps-shim: an OCI runtime in front of runc. On `create` it rewrites the bundle's
//! config.json for a container that got a GPU (MPS gate dir, env, masked nvidia-smi, hooks),
//! then runc runs with the same arguments.
//!
//! The pure parts (argument parsing, GPU detection, limit resolution, the rewrite, log lines)
//! are separate from the I/O ([`bundle`], [`node_files`]) so that they are table- and
//! golden-tested; [`plan_rewrite`] is the whole decision for one spec, also used by
//! `gpu-mps explain`.

pub mod allocation;
pub mod bundle;
pub mod error;
pub mod gpu_devices;
pub mod node_files;
pub mod plan;
pub mod request;
pub mod rewrite;
pub mod runc_args;
pub mod runc_log;
pub mod spec_fields;

pub use error::ShimError;
pub use plan::{ParsedSpec, RewritePlan, parse_spec, plan_rewrite};
pub use request::ResolvedRequest;
pub use rewrite::rewrite;

/// Set (to anything but empty or `0`) to make the shim log what it does to stderr.
pub const DEBUG_ENV: &str = "GPU_MPS_SHIM_DEBUG";
/// Prefix of every line the shim writes, so the message is recognised in kubelet events.
pub const MESSAGE_PREFIX: &str = "gpu-mps: ";
