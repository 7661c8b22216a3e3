//! One GPU container's request, in the one shape every component uses: gpu-mps-shim resolves it
//! from the spec and the node config, the createRuntime hook carries it to gpu-mps-manager (its
//! arguments: [`crate::hook_invocation`]), the manager checks it at its socket
//! ([`ContainerRequest::from_acquire_request`]), admits it and records it as the lease's content.
//! A new per-container field is a field here, its codecs (to the hook's arguments and from them
//! to the proto: [`crate::hook_invocation`]; from the proto: [`ContainerRequest::from_acquire_request`])
//! and its source in the shim; nothing on the way copies fields one by one.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::limits::{self, LimitError, Limits};
use crate::{DaemonKey, proto};

/// Who the container is: the CRI plugin's annotations; empty strings for a container made
/// without CRI (ctr).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PodIdentity {
    /// The pod's namespace: the tenant (the node's per-namespace maximums).
    pub namespace: String,
    pub pod: String,
    pub container_name: String,
}

/// How the shim laid the container out: the policy and the digest of the node config it used
/// (`NodeConfig::digest`). The manager refuses a container laid out under another config.
/// Empty for a lease recorded before the layout was part of it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Layout {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub policy: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub config_digest: String,
}

/// MPS's client priority (`CUDA_MPS_CLIENT_PRIORITY`): the server schedules the work of a
/// below-normal client after that of normal ones. A process can set its own back to normal (the
/// variable is in its environment), so it is a courtesy a pod offers, never a limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClientPriority {
    #[default]
    Normal,
    BelowNormal,
}

impl ClientPriority {
    /// The annotation's words, in the order of MPS's numbers.
    pub const NAMES: [&'static str; 2] = ["normal", "below-normal"];

    pub fn parse(text: &str) -> Result<Self, LimitError> {
        (Self::NAMES.iter().position(|name| *name == text))
            .and_then(|value| Self::from_mps_value(value as u32))
            .ok_or_else(|| LimitError::Priority {
                value: text.to_string(),
            })
    }

    pub fn name(self) -> &'static str {
        Self::NAMES[self.mps_value() as usize]
    }

    /// The value of `CUDA_MPS_CLIENT_PRIORITY` (and of the proto's field): 0 normal, 1 below.
    pub fn mps_value(self) -> u32 {
        match self {
            ClientPriority::Normal => 0,
            ClientPriority::BelowNormal => 1,
        }
    }

    pub fn from_mps_value(value: u32) -> Option<Self> {
        match value {
            0 => Some(ClientPriority::Normal),
            1 => Some(ClientPriority::BelowNormal),
            _ => None,
        }
    }

    pub fn is_normal(&self) -> bool {
        *self == ClientPriority::Normal
    }
}

impl std::fmt::Display for ClientPriority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What one GPU container asks of its node. Serialized flat into the manager's lease records
/// (state.json and `<root>/leases/`): the names and defaults here are those records' format, and
/// a record written before a field existed reads with the field's default.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerRequest {
    /// The container's GPUs, as the daemon that serves them.
    pub key: DaemonKey,
    /// The container's limits: memory is the total of its CUDA processes.
    pub limits: Limits,
    /// How many CUDA processes it may run on the server (each gets [`Self::per_process`]).
    #[serde(default = "one")]
    pub cuda_processes: u32,
    #[serde(flatten)]
    pub identity: PodIdentity,
    /// The device plugin's `gpu-mps.io/memory` units on its one GPU; empty without.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub memory_units: Vec<u32>,
    #[serde(default, skip_serializing_if = "ClientPriority::is_normal")]
    pub priority: ClientPriority,
    #[serde(flatten)]
    pub layout: Layout,
}

fn one() -> u32 {
    1
}

/// Why an Acquire's request is refused at the manager's socket (each one line for the hook's
/// stderr, which runc passes up to the CRI caller).
#[derive(Debug, Error, PartialEq, Eq)]
pub enum RequestError {
    #[error("no GPU in the request")]
    NoGpu,
    #[error(transparent)]
    Limit(#[from] LimitError),
    #[error("cuda_processes {0} is out of range: expected 1 to {max}", max = limits::MAX_CUDA_PROCESSES)]
    CudaProcesses(u32),
    #[error("client_priority {0} is out of range: expected 0 (normal) or 1 (below-normal)")]
    Priority(u32),
}

impl ContainerRequest {
    /// What each of its CUDA processes gets: the limit class its server holds for each.
    pub fn per_process(&self) -> Limits {
        self.limits.per_process(self.cuda_processes)
    }

    /// Whether `other` asks for the same lease (a retried hook): the same GPUs, limits,
    /// processes, units and priority. Names and layout are not compared: they never change what
    /// the container holds.
    pub fn same_lease_as(&self, other: &ContainerRequest) -> bool {
        self.key == other.key
            && self.limits == other.limits
            && self.cuda_processes == other.cuda_processes
            && self.memory_units == other.memory_units
            && self.priority == other.priority
    }

    /// The request an Acquire carries, checked as anything from the socket must be: limits in
    /// range (the same checks as the annotations), a process count MPS can serve. A count of 0
    /// is what the hook of a shim older than the count sends: one process.
    pub fn from_acquire_request(req: &proto::AcquireRequest) -> Result<Self, RequestError> {
        if req.gpu_uuids.is_empty() {
            return Err(RequestError::NoGpu);
        }
        let limits = Limits::checked(req.memory_limit_bytes, req.active_thread_percentage)?;
        let cuda_processes = req.cuda_processes.max(1);
        if cuda_processes > limits::MAX_CUDA_PROCESSES {
            return Err(RequestError::CudaProcesses(cuda_processes));
        }
        let priority = ClientPriority::from_mps_value(req.client_priority)
            .ok_or(RequestError::Priority(req.client_priority))?;
        Ok(ContainerRequest {
            key: DaemonKey::new(req.gpu_uuids.iter().cloned()),
            limits,
            cuda_processes,
            identity: PodIdentity {
                namespace: req.namespace.clone(),
                pod: req.pod.clone(),
                container_name: req.container_name.clone(),
            },
            memory_units: req.memory_units.clone(),
            priority,
            layout: Layout {
                policy: req.policy.clone(),
                config_digest: req.config_digest.clone(),
            },
        })
    }

    #[doc(hidden)]
    /// A request on one GPU with these limits and nothing else, for tests.
    pub fn for_test(gpus: &[&str], limits: Limits, namespace: &str) -> Self {
        ContainerRequest {
            key: DaemonKey::new(gpus.iter().copied()),
            limits,
            cuda_processes: 1,
            identity: PodIdentity {
                namespace: namespace.to_string(),
                ..PodIdentity::default()
            },
            memory_units: Vec::new(),
            priority: ClientPriority::Normal,
            layout: Layout::default(),
        }
    }
}

#[cfg(test)]
mod tests;
