//! A container's lease on an MPS daemon.

use gpu_mps_api::{DaemonKey, Limits};
use serde::{Deserialize, Serialize};

use crate::process_identity::ProcessIdentity;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    pub container_id: String,
    pub key: DaemonKey,
    /// The container's own limits (what it asked for): memory is the total of its CUDA
    /// processes.
    pub limits: Limits,
    /// How many CUDA processes it may run on the server (each gets its share).
    #[serde(default = "one")]
    pub cuda_processes: u32,
    pub namespace: String,
    pub pod: String,
    pub container_name: String,
    pub bundle: String,
    /// The container's init process; the lease is dropped once it is gone, in case the
    /// poststop hook never ran (runc killed, node crash, containerd restart).
    pub process: Option<ProcessIdentity>,
    pub acquired_unix: i64,
    /// The device plugin's `gpu-mps.io/memory` units on its GPU; empty without.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub memory_units: Vec<u32>,
    /// When the daemon its CUDA processes used died under it (unix seconds): MPS ended those
    /// processes' server with it; the ones started since reach the daemon started in its place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub daemon_lost_unix: Option<i64>,
}

fn one() -> u32 {
    1
}

impl LeaseRecord {
    /// What each of its CUDA processes gets.
    pub fn process_limits(&self) -> Limits {
        self.limits.per_process(self.cuda_processes)
    }

    /// namespace/pod, or the container id for a container started without CRI (ctr).
    pub fn owner(&self) -> String {
        if self.pod.is_empty() {
            self.container_id.clone()
        } else {
            format!("{}/{}", self.namespace, self.pod)
        }
    }

    /// False once the container's init process has exited.
    pub fn container_alive(&self) -> bool {
        self.process.is_some_and(|p| p.is_alive())
    }

    #[cfg(test)]
    pub fn for_test(id: &str, key: DaemonKey, limits: Limits, namespace: &str) -> Self {
        LeaseRecord {
            container_id: id.into(),
            key,
            limits,
            cuda_processes: 1,
            memory_units: Vec::new(),
            daemon_lost_unix: None,
            namespace: namespace.into(),
            pod: String::new(),
            container_name: String::new(),
            bundle: String::new(),
            process: None,
            acquired_unix: 0,
        }
    }
}
