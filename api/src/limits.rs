//! The two limits a pod asks for, in the units MPS takes them.

use std::fmt;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::quantity::{self, QuantityError};

/// Below this a CUDA context does not fit (it takes ~150 MiB of the limit on an H200), so a
/// smaller value is almost always a missing unit (`memory-limit: 4096` meaning MiB).
pub const MIN_MEMORY_LIMIT_BYTES: u64 = 64 << 20;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum LimitError {
    #[error(transparent)]
    Quantity(#[from] QuantityError),
    #[error("{value:?} is below the minimum memory limit of 64Mi (a CUDA context alone needs ~150Mi)")]
    MemoryTooSmall { value: String },
    #[error("{value:?} is not an active thread percentage: expected a whole number from 1 to 100")]
    ThreadPercentage { value: String },
    #[error("{value:?} is not a number of CUDA processes: expected a whole number from 1 to 48")]
    CudaProcesses { value: String },
    #[error("{value:?} is not a client priority: expected normal or below-normal")]
    Priority { value: String },
}

/// Per-CUDA-process limits: pinned device memory and the share of the GPU's SMs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Limits {
    pub memory_bytes: u64,
    pub thread_percentage: u8,
}

impl Limits {
    /// Limits from raw numbers (the manager's API), with the same checks as the annotations.
    pub fn checked(memory_bytes: u64, thread_percentage: u32) -> Result<Limits, LimitError> {
        if memory_bytes < MIN_MEMORY_LIMIT_BYTES {
            return Err(LimitError::MemoryTooSmall {
                value: quantity::format_bytes(memory_bytes),
            });
        }
        let thread_percentage = u8::try_from(thread_percentage)
            .ok()
            .filter(|p| (1..=100).contains(p))
            .ok_or_else(|| LimitError::ThreadPercentage {
                value: thread_percentage.to_string(),
            })?;
        Ok(Limits {
            memory_bytes,
            thread_percentage,
        })
    }

    /// The pinned memory limit as MPS takes it: whole MiB (`4096M`). MPS reads `G` as GiB
    /// (measured: `4G` and `4096M` read back the same), so MiB keeps every Kubernetes
    /// quantity exact to the MiB; a remainder below 1 MiB is dropped, never rounded up.
    pub fn mps_memory_value(&self) -> String {
        format!("{}M", self.memory_bytes >> 20)
    }

    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` for a client that sees `device_count` devices.
    pub fn mps_memory_env(&self, device_count: usize) -> String {
        let value = self.mps_memory_value();
        (0..device_count.max(1))
            .map(|ordinal| format!("{ordinal}={value}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The memory limit rounded down to MiB, as it is really applied.
    pub fn effective_memory_bytes(&self) -> u64 {
        (self.memory_bytes >> 20) << 20
    }

    /// What each of a container's `processes` CUDA processes gets when these are the
    /// container's limits: the memory split evenly (whole MiB, rounded down, so that the
    /// processes together never exceed the container's limit), the thread share unchanged (it
    /// is a cap on each process, not a reservation; docs/adr/0006).
    pub fn per_process(&self, processes: u32) -> Limits {
        let mib = (self.memory_bytes >> 20) / u64::from(processes.max(1));
        Limits {
            memory_bytes: mib << 20,
            thread_percentage: self.thread_percentage,
        }
    }
}

/// How many CUDA processes one container may run at most on MPS: MPS serves 48 clients per GPU
/// (Volta and newer, up to CUDA 13.0), and every process is one.
pub const MAX_CUDA_PROCESSES: u32 = 48;

/// `gpu-mps.io/cuda-processes`: a whole number from 1 to 48.
pub fn parse_cuda_processes(value: &str) -> Result<u32, LimitError> {
    let err = || LimitError::CudaProcesses {
        value: value.to_string(),
    };
    let n: u32 = value.trim().parse().map_err(|_| err())?;
    if (1..=MAX_CUDA_PROCESSES).contains(&n) {
        Ok(n)
    } else {
        Err(err())
    }
}

impl fmt::Display for Limits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}%",
            quantity::format_bytes(self.memory_bytes),
            self.thread_percentage
        )
    }
}

/// Parses a memory limit annotation value (a Kubernetes quantity) and checks its floor.
pub fn parse_memory_limit(value: &str) -> Result<u64, LimitError> {
    let bytes = quantity::parse_bytes(value)?;
    if bytes < MIN_MEMORY_LIMIT_BYTES {
        return Err(LimitError::MemoryTooSmall {
            value: value.to_string(),
        });
    }
    Ok(bytes)
}

/// Parses an active thread percentage: a whole number from 1 to 100.
pub fn parse_thread_percentage(value: &str) -> Result<u8, LimitError> {
    let err = || LimitError::ThreadPercentage {
        value: value.to_string(),
    };
    let n: u8 = value.trim().parse().map_err(|_| err())?;
    if THREAD_PERCENTAGE.contains(&n) {
        Ok(n)
    } else {
        Err(err())
    }
}

/// What an active thread percentage may be, in an annotation or the node config.
pub const THREAD_PERCENTAGE: std::ops::RangeInclusive<u8> = 1..=100;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mps_values_are_whole_mib() {
        let l = Limits {
            memory_bytes: 4 << 30,
            thread_percentage: 25,
        };
        assert_eq!(l.mps_memory_value(), "4096M");
        assert_eq!(l.mps_memory_env(2), "0=4096M,1=4096M");
        assert_eq!(l.to_string(), "4Gi/25%");
        let decimal = Limits {
            memory_bytes: 4_000_000_000,
            thread_percentage: 50,
        };
        assert_eq!(decimal.mps_memory_value(), "3814M");
        assert_eq!(decimal.effective_memory_bytes(), 3814 << 20);
    }

    #[test]
    fn per_process_limits_split_the_memory_and_keep_the_share() {
        let l = Limits {
            memory_bytes: 4 << 30,
            thread_percentage: 25,
        };
        assert_eq!(l.per_process(1), l);
        assert_eq!(l.per_process(0), l, "0 is taken as 1");
        assert_eq!(
            l.per_process(4),
            Limits {
                memory_bytes: 1 << 30,
                thread_percentage: 25
            }
        );
        // 4096 MiB / 3 = 1365.33: rounded down, 3 x 1365 MiB <= 4096 MiB.
        let third = l.per_process(3);
        assert_eq!(third.memory_bytes, 1365 << 20);
        assert!(3 * third.memory_bytes <= l.memory_bytes);
    }

    #[test]
    fn cuda_processes_is_1_to_48() {
        assert_eq!(parse_cuda_processes("1"), Ok(1));
        assert_eq!(parse_cuda_processes(" 48 "), Ok(48));
        for bad in ["0", "49", "2.5", "-1", "", "many"] {
            let e = parse_cuda_processes(bad).unwrap_err().to_string();
            assert!(e.contains("1 to 48"), "{bad}: {e}");
        }
    }

    #[test]
    fn thread_percentage_is_1_to_100() {
        assert_eq!(parse_thread_percentage("25"), Ok(25));
        assert_eq!(parse_thread_percentage("100"), Ok(100));
        for bad in ["0", "101", "25.5", "-1", "", "all"] {
            assert!(parse_thread_percentage(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn checked_applies_the_annotation_rules() {
        assert_eq!(
            Limits::checked(1 << 30, 25),
            Ok(Limits {
                memory_bytes: 1 << 30,
                thread_percentage: 25
            })
        );
        assert!(matches!(
            Limits::checked(1 << 20, 25),
            Err(LimitError::MemoryTooSmall { .. })
        ));
        assert!(matches!(
            Limits::checked(1 << 30, 0),
            Err(LimitError::ThreadPercentage { .. })
        ));
        assert!(matches!(
            Limits::checked(1 << 30, 356),
            Err(LimitError::ThreadPercentage { .. })
        ));
    }

    #[test]
    fn memory_limit_has_a_floor() {
        assert_eq!(parse_memory_limit("64Mi"), Ok(64 << 20));
        assert!(matches!(
            parse_memory_limit("4096"),
            Err(LimitError::MemoryTooSmall { .. })
        ));
        assert!(matches!(parse_memory_limit("4GB"), Err(LimitError::Quantity(_))));
    }
}
