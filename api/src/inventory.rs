//! The GPU inventory the manager publishes at `<root>/inventory.json` and the shim reads to
//! turn `NVIDIA_VISIBLE_DEVICES=0`, or a device node `/dev/nvidia0` (char 195:0), into a GPU
//! UUID without loading NVML in every create.

use serde::{Deserialize, Serialize};
use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "GpuRecord")]
pub struct GpuInfo {
    pub index: u32,
    /// The minor number of the GPU's device node `/dev/nvidia<minor>` (char 195:<minor>), from
    /// NVML: how the shim knows which GPU a device node handed to a container is. It is not the
    /// index in general (NVML orders GPUs by PCI bus, the driver numbers nodes as it probes).
    /// An inventory written before minors were recorded reads as minor = index; restart
    /// gpu-mps-manager to write the real ones.
    pub minor: u32,
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

/// `GpuInfo` as inventory.json spells it, where `minor` may be missing (older managers).
#[derive(Deserialize)]
struct GpuRecord {
    index: u32,
    minor: Option<u32>,
    uuid: String,
    name: String,
    memory_bytes: u64,
    #[serde(default)]
    compute_mode: String,
    #[serde(default)]
    mig_enabled: bool,
}

impl From<GpuRecord> for GpuInfo {
    fn from(r: GpuRecord) -> Self {
        GpuInfo {
            index: r.index,
            minor: r.minor.unwrap_or(r.index),
            uuid: r.uuid,
            name: r.name,
            memory_bytes: r.memory_bytes,
            compute_mode: r.compute_mode,
            mig_enabled: r.mig_enabled,
        }
    }
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
    #[error("no GPU of this node has device minor {0} (known minors: {1})")]
    UnknownMinor(i64, String),
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

    /// Finds a GPU by the minor number of its device node (`/dev/nvidia<minor>`, char 195).
    /// `minor` is an OCI spec's number, hence signed.
    pub fn lookup_minor(&self, minor: i64) -> Result<&GpuInfo, LookupError> {
        self.gpus
            .iter()
            .find(|g| i64::from(g.minor) == minor)
            .ok_or_else(|| LookupError::UnknownMinor(minor, self.known_minors()))
    }

    fn known_minors(&self) -> String {
        if self.gpus.is_empty() {
            return "none".into();
        }
        self.gpus
            .iter()
            .map(|g| format!("{}=GPU {} {}", g.minor, g.index, g.uuid))
            .collect::<Vec<_>>()
            .join(", ")
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
            minor: index + 4,
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
    fn lookup_by_minor() {
        let i = inv();
        assert_eq!(i.lookup_minor(5).unwrap().uuid, "GPU-bbbb-2222");
        for minor in [0, 1, -1, i64::from(u32::MAX) + 4] {
            let e = i.lookup_minor(minor).unwrap_err().to_string();
            assert!(
                e.contains(&format!("minor {minor} ")) && e.contains("4=GPU 0 GPU-aaaa-1111, 5=GPU 1"),
                "{e}"
            );
        }
    }

    #[test]
    fn an_inventory_without_minors_reads_minor_as_index() {
        let old = r#"{"source":"nvml","gpus":[
            {"index":0,"uuid":"GPU-a","name":"n","memory_bytes":1},
            {"index":1,"minor":7,"uuid":"GPU-b","name":"n","memory_bytes":1,"compute_mode":"Default"}]}"#;
        let i = Inventory::from_json(old).unwrap();
        assert_eq!((i.gpus[0].minor, i.gpus[1].minor), (0, 7));
        assert_eq!(i.gpus[1].compute_mode, "Default");
        let written = serde_json::to_value(&i).unwrap();
        assert_eq!(written["gpus"][0]["minor"], 0, "minors are always written");
        assert!(Inventory::from_json(r#"{"source":"x","gpus":[{"index":0}]}"#).is_err());
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
