//! The node's maximums: the most a container may ask for, under every policy. A pod picks its
//! own limits through its annotations; without a maximum, one pod could take a whole GPU's
//! memory or all its SMs. Per namespace, the node config can lower or raise them
//! (`[limits.namespaces."<ns>"]`). Pure: the shim checks a request early (one line at the CRI
//! caller) and the manager checks it again at Acquire, against its own config.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::limits::{Limits, MAX_CUDA_PROCESSES};
use crate::quantity::format_bytes;

/// The most one container may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Maxima {
    /// Total memory limit of a container (all its CUDA processes). `None`: bounded only by the
    /// GPU's capacity.
    pub memory_bytes: Option<u64>,
    pub thread_percentage: u8,
    pub cuda_processes: u32,
}

impl Default for Maxima {
    fn default() -> Self {
        Maxima {
            memory_bytes: None,
            thread_percentage: 100,
            cuda_processes: 16,
        }
    }
}

/// A request above a maximum. One line each; `scope` says whose maximum it is.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum MaximaError {
    #[error(
        "memory limit {requested} is above the maximum {max} for {scope} (limits.max_memory_limit in the gpu-mps node config)"
    )]
    Memory {
        requested: String,
        max: String,
        scope: String,
    },
    #[error(
        "active thread percentage {requested} is above the maximum {max} for {scope} (limits.max_active_thread_percentage in the gpu-mps node config)"
    )]
    Threads { requested: u8, max: u8, scope: String },
    #[error(
        "{requested} CUDA processes is above the maximum {max} for {scope} (limits.max_cuda_processes in the gpu-mps node config)"
    )]
    CudaProcesses { requested: u32, max: u32, scope: String },
    #[error(
        "memory limit {total} split over {processes} CUDA processes leaves {each} each, below the 64Mi a process needs: ask for more memory or fewer processes"
    )]
    TooLittlePerProcess {
        total: String,
        processes: u32,
        each: String,
    },
}

impl Maxima {
    /// The maximums for a container that gpu-mps-device-plugin allocated units to: its memory
    /// was the scheduler's decision (a ResourceQuota or LimitRange on gpu-mps.io/memory limits
    /// it), so the memory maximum would refuse after scheduling; threads and processes still hold.
    /// The shim and the manager both use this, so they cannot disagree.
    pub fn for_allocated_units(self) -> Maxima {
        Maxima {
            memory_bytes: None,
            ..self
        }
    }

    /// Checks a container's total limits and number of CUDA processes; `scope` names where the
    /// maximums come from ("this node", "namespace team-a") for the message.
    pub fn check(&self, limits: Limits, processes: u32, scope: &str) -> Result<(), MaximaError> {
        if let Some(max) = self.memory_bytes {
            if limits.memory_bytes > max {
                return Err(MaximaError::Memory {
                    requested: format_bytes(limits.memory_bytes),
                    max: format_bytes(max),
                    scope: scope.to_string(),
                });
            }
        }
        if limits.thread_percentage > self.thread_percentage {
            return Err(MaximaError::Threads {
                requested: limits.thread_percentage,
                max: self.thread_percentage,
                scope: scope.to_string(),
            });
        }
        if processes > self.cuda_processes.min(MAX_CUDA_PROCESSES) {
            return Err(MaximaError::CudaProcesses {
                requested: processes,
                max: self.cuda_processes.min(MAX_CUDA_PROCESSES),
                scope: scope.to_string(),
            });
        }
        let each = limits.per_process(processes);
        if each.memory_bytes < crate::limits::MIN_MEMORY_LIMIT_BYTES {
            return Err(MaximaError::TooLittlePerProcess {
                total: format_bytes(limits.memory_bytes),
                processes,
                each: format_bytes(each.memory_bytes),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: Limits = Limits {
        memory_bytes: 8 << 30,
        thread_percentage: 50,
    };

    #[test]
    fn within_the_maximums_passes() {
        let m = Maxima {
            memory_bytes: Some(8 << 30),
            thread_percentage: 50,
            cuda_processes: 4,
        };
        assert_eq!(m.check(L, 4, "this node"), Ok(()));
        assert_eq!(Maxima::default().check(L, 1, "this node"), Ok(()));
    }

    #[test]
    fn each_maximum_refuses_with_its_key() {
        let m = Maxima {
            memory_bytes: Some(4 << 30),
            thread_percentage: 25,
            cuda_processes: 2,
        };
        let e = m.check(L, 1, "namespace team-a").unwrap_err().to_string();
        assert!(
            e.contains("8Gi")
                && e.contains("4Gi")
                && e.contains("namespace team-a")
                && e.contains("max_memory_limit"),
            "{e}"
        );
        let small = Limits {
            memory_bytes: 1 << 30,
            thread_percentage: 50,
        };
        let e = m.check(small, 1, "this node").unwrap_err().to_string();
        assert!(
            e.contains("50") && e.contains("max_active_thread_percentage"),
            "{e}"
        );
        let ok_threads = Limits {
            memory_bytes: 1 << 30,
            thread_percentage: 25,
        };
        let e = m.check(ok_threads, 3, "this node").unwrap_err().to_string();
        assert!(
            e.contains("3 CUDA processes") && e.contains("max_cuda_processes"),
            "{e}"
        );
    }

    #[test]
    fn the_mps_client_limit_caps_any_configured_maximum() {
        let m = Maxima {
            cuda_processes: 1000,
            ..Maxima::default()
        };
        assert!(m.check(L, MAX_CUDA_PROCESSES + 1, "this node").is_err());
        assert!(m.check(L, MAX_CUDA_PROCESSES, "this node").is_ok());
    }

    #[test]
    fn a_split_below_the_floor_is_refused() {
        let l = Limits {
            memory_bytes: 256 << 20,
            thread_percentage: 10,
        };
        let m = Maxima {
            cuda_processes: 48,
            ..Maxima::default()
        };
        assert!(m.check(l, 4, "this node").is_ok());
        let e = m.check(l, 8, "this node").unwrap_err().to_string();
        assert!(e.contains("32Mi each") && e.contains("64Mi"), "{e}");
    }
}
