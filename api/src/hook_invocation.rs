//! The arguments the shim writes into a container's hooks and gpu-mps-hook reads back: a
//! [`ContainerRequest`] as command-line flags. Both directions are here ([`AcquireArgs`] writes,
//! [`RequestArgs`] is what the hook's parser reads), so the two binaries cannot drift apart;
//! container_request's tests check the round trip, through the proto too.

use std::path::Path;

use crate::container_request::{ClientPriority, ContainerRequest};
use crate::memory_units;
use crate::proto;

/// Hook stages gpu-mps-hook is installed at.
pub const STAGE_CREATE_RUNTIME: &str = "create-runtime";
pub const STAGE_POSTSTOP: &str = "poststop";

/// What the createRuntime hook asks the manager for, and where. Container id, pid and bundle
/// come from the OCI state runc writes to the hook's stdin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcquireArgs {
    pub socket: String,
    pub timeout_seconds: u64,
    pub request: ContainerRequest,
}

impl AcquireArgs {
    /// `args` of the OCI hook, argv[0] included.
    pub fn to_hook_args(&self) -> Vec<String> {
        let request = &self.request;
        let mut args = vec![
            "gpu-mps-hook".into(),
            STAGE_CREATE_RUNTIME.into(),
            format!("--socket={}", self.socket),
            format!("--timeout-seconds={}", self.timeout_seconds),
            format!("--gpus={}", request.key.gpu_uuids().join(",")),
            format!("--memory-limit-bytes={}", request.limits.memory_bytes),
            format!("--active-thread-percentage={}", request.limits.thread_percentage),
            format!("--namespace={}", request.identity.namespace),
            format!("--pod={}", request.identity.pod),
            format!("--container-name={}", request.identity.container_name),
            format!("--cuda-processes={}", request.cuda_processes),
            format!("--policy={}", request.layout.policy),
            format!("--config-digest={}", request.layout.config_digest),
        ];
        // Each only where it says something: a container without units or priority has the
        // hook arguments it had before they existed (and a spec laid out then reads the same).
        if !request.memory_units.is_empty() {
            args.push(format!(
                "--memory-units={}",
                memory_units::format_unit_list(&request.memory_units)
            ));
        }
        if !request.priority.is_normal() {
            args.push(format!("--priority={}", request.priority));
        }
        args
    }
}

/// The request's flags as gpu-mps-hook parses them (flattened into its `create-runtime`). Not
/// checked here: the manager checks what reaches its socket, whoever sent it.
#[derive(Debug, Clone, clap::Args)]
pub struct RequestArgs {
    /// GPU UUIDs, comma separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub gpus: Vec<String>,
    /// Pinned device memory of the container's CUDA processes together, in bytes.
    #[arg(long)]
    pub memory_limit_bytes: u64,
    /// Share of the GPU's SMs, in percent.
    #[arg(long)]
    pub active_thread_percentage: u32,
    /// The pod's namespace (for tenancy and the manager's log).
    #[arg(long, default_value = "")]
    pub namespace: String,
    /// The pod's name (for the manager's log and status).
    #[arg(long, default_value = "")]
    pub pod: String,
    /// The container's name in its pod.
    #[arg(long, default_value = "")]
    pub container_name: String,
    /// CUDA processes the container may run (its memory limit is their total).
    #[arg(long, default_value_t = 1)]
    pub cuda_processes: u32,
    /// The policy the shim laid the container out for.
    #[arg(long, default_value = "")]
    pub policy: String,
    /// The digest of the node config the shim used.
    #[arg(long, default_value = "")]
    pub config_digest: String,
    /// The device plugin's gpu-mps.io/memory units on the container's GPU, e.g. 3,4,5.
    #[arg(long, default_value = "", value_parser = parse_units)]
    pub memory_units: Units,
    /// MPS client priority of the container's processes: normal or below-normal.
    #[arg(long, default_value = "normal", value_parser = parse_priority)]
    pub priority: ClientPriority,
}

/// Unit numbers (clap takes a type whose parser returns it whole, not a Vec it would split).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Units(pub Vec<u32>);

fn parse_units(text: &str) -> Result<Units, String> {
    memory_units::parse_unit_list(text).map(Units)
}

fn parse_priority(text: &str) -> Result<ClientPriority, String> {
    ClientPriority::parse(text).map_err(|e| e.to_string())
}

impl RequestArgs {
    /// The Acquire for the container runc named in the OCI state.
    pub fn to_acquire_request(&self, container_id: &str, pid: u32, bundle: &str) -> proto::AcquireRequest {
        let mut req = proto::AcquireRequest::new();
        req.container_id = container_id.to_string();
        req.pid = pid;
        req.bundle = bundle.to_string();
        req.gpu_uuids = self.gpus.clone();
        req.memory_limit_bytes = self.memory_limit_bytes;
        req.active_thread_percentage = self.active_thread_percentage;
        req.namespace = self.namespace.clone();
        req.pod = self.pod.clone();
        req.container_name = self.container_name.clone();
        req.cuda_processes = self.cuda_processes;
        req.policy = self.policy.clone();
        req.config_digest = self.config_digest.clone();
        req.memory_units = self.memory_units.0.clone();
        req.client_priority = self.priority.mps_value();
        req
    }
}

/// `args` of the poststop hook; `gate_dir` is the container's gate dir (the hook asks the
/// manager to release only a container whose gate was opened).
pub fn release_hook_args(socket: &str, timeout_seconds: u64, gate_dir: &Path) -> Vec<String> {
    vec![
        "gpu-mps-hook".into(),
        STAGE_POSTSTOP.into(),
        format!("--socket={socket}"),
        format!("--timeout-seconds={timeout_seconds}"),
        format!("--gate-dir={}", gate_dir.display()),
    ]
}
