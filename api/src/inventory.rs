//! The GPU inventory the manager publishes at `<root>/inventory.json` and the shim reads to
//! turn `NVIDIA_VISIBLE_DEVICES=0` into a GPU UUID without loading NVML in every create.

use serde::{Deserialize, Serialize};
use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_bytes: u64,
    /// NVML's compute mode at the time the inventory was taken ("Default", "ExclusiveProcess", ...).
    #[serde(default)]
    pub compute_mode: String,
    /// True when MIG is enabled: MPS on a MIG-enabled GPU is not supported by gpu-mps.
    #[serde(default)]
    pub mig_enabled: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inventory {
    /// "nvml", or "file:<path>" for the test-only inventory from a file.
    pub source: String,
    pub gpus: Vec<GpuInfo>,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum LookupError {
    #[error("GPU {0:?} is not on this node (known: {1})")]
    Unknown(String, String),
}

impl Inventory {
    pub fn from_json(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// Finds a GPU by index ("0"), full UUID ("GPU-...") or unique UUID prefix, as
    /// NVIDIA_VISIBLE_DEVICES and CDI device names spell them.
    pub fn lookup(&self, name: &str) -> Result<&GpuInfo, LookupError> {
        let found = if let Ok(index) = name.parse::<u32>() {
            self.gpus.iter().find(|g| g.index == index)
        } else {
            let matches: Vec<_> = self.gpus.iter().filter(|g| g.uuid.starts_with(name)).collect();
            match matches.as_slice() {
                [one] => Some(*one),
                _ => self.gpus.iter().find(|g| g.uuid == name),
            }
        };
        found.ok_or_else(|| LookupError::Unknown(name.to_string(), self.known()))
    }

    fn known(&self) -> String {
        if self.gpus.is_empty() {
            return "none".into();
        }
        self.gpus
            .iter()
            .map(|g| format!("{}={}", g.index, g.uuid))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inv() -> Inventory {
        let gpu = |index: u32, uuid: &str| GpuInfo {
            index,
            uuid: uuid.into(),
            name: "NVIDIA H200".into(),
            memory_bytes: 141 << 30,
            compute_mode: "Default".into(),
            mig_enabled: false,
        };
        Inventory {
            source: "nvml".into(),
            gpus: vec![gpu(0, "GPU-aaaa-1111"), gpu(1, "GPU-bbbb-2222")],
        }
    }

    #[test]
    fn lookup_by_index_uuid_and_prefix() {
        let i = inv();
        assert_eq!(i.lookup("1").unwrap().uuid, "GPU-bbbb-2222");
        assert_eq!(i.lookup("GPU-aaaa-1111").unwrap().index, 0);
        assert_eq!(i.lookup("GPU-bbbb").unwrap().index, 1);
        let e = i.lookup("7").unwrap_err().to_string();
        assert!(e.contains("\"7\"") && e.contains("0=GPU-aaaa-1111"), "{e}");
        assert!(i.lookup("GPU-").is_err(), "an ambiguous prefix must not pick one");
    }

    #[test]
    fn round_trips_json() {
        let i = inv();
        assert_eq!(
            Inventory::from_json(&serde_json::to_string(&i).unwrap()).unwrap(),
            i
        );
    }
}
