//! The arguments the shim writes into a container's hooks and gpu-mps-hook reads back.
//! One definition on both sides, so the two binaries cannot drift apart.

use std::path::Path;

use crate::limits::Limits;

/// Hook stages gpu-mps-hook is installed at.
pub const STAGE_CREATE_RUNTIME: &str = "create-runtime";
pub const STAGE_POSTSTOP: &str = "poststop";

/// What the createRuntime hook asks the manager for. Container id, pid and bundle come from
/// the OCI state runc writes to the hook's stdin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcquireArgs {
    pub socket: String,
    pub timeout_seconds: u64,
    pub gpu_uuids: Vec<String>,
    pub limits: Limits,
    pub namespace: String,
    pub pod: String,
    pub container_name: String,
    /// CUDA processes the container may run; `limits.memory_bytes` is their total.
    pub cuda_processes: u32,
    /// The policy and config digest the shim laid the container out with.
    pub policy: String,
    pub config_digest: String,
    /// The device plugin's `gpu-mps.io/memory` units on the container's GPU; empty without.
    pub memory_units: Vec<u32>,
}

impl AcquireArgs {
    /// `args` of the OCI hook, argv[0] included.
    pub fn to_hook_args(&self) -> Vec<String> {
        let mut args = vec![
            "gpu-mps-hook".into(),
            STAGE_CREATE_RUNTIME.into(),
            format!("--socket={}", self.socket),
            format!("--timeout-seconds={}", self.timeout_seconds),
            format!("--gpus={}", self.gpu_uuids.join(",")),
            format!("--memory-limit-bytes={}", self.limits.memory_bytes),
            format!("--active-thread-percentage={}", self.limits.thread_percentage),
            format!("--namespace={}", self.namespace),
            format!("--pod={}", self.pod),
            format!("--container-name={}", self.container_name),
            format!("--cuda-processes={}", self.cuda_processes),
            format!("--policy={}", self.policy),
            format!("--config-digest={}", self.config_digest),
        ];
        // Only with the device plugin: a container laid out without units has the same hook
        // arguments as before units existed.
        if !self.memory_units.is_empty() {
            args.push(format!(
                "--memory-units={}",
                crate::memory_units::format_unit_list(&self.memory_units)
            ));
        }
        args
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
