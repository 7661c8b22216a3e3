//! Where the manager learns about GPUs and changes their compute mode: NVML on a real node,
//! or (TEST ONLY) a JSON file on machines without a GPU.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use gpu_mps_api::inventory::{GpuInfo, Inventory};
pub use gpu_mps_api::node_files::NVML_ERROR_FILE;
use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::ComputeMode;
use thiserror::Error;

pub const EXCLUSIVE_PROCESS: &str = "ExclusiveProcess";

#[derive(Debug, Error)]
pub enum GpuBackendError {
    #[error("NVML: {context}: {source}")]
    Nvml {
        context: String,
        source: nvml_wrapper::error::NvmlError,
    },
    #[error("reading the test inventory {path}: {message}")]
    InventoryFile { path: PathBuf, message: String },
    #[error("GPU {0} is not in the inventory")]
    UnknownGpu(String),
    #[error("{0:?} is not a compute mode (Default, ExclusiveProcess, Prohibited)")]
    UnknownMode(String),
}

/// Leaves NVML's reason where the shim looks when it reads the inventory
/// (`<root>/nvml-error`), so that a GPU pod on a node without a usable driver is told that, not
/// that the manager is not running.
pub fn record_nvml_failure(root: &Path, error: &GpuBackendError) -> std::io::Result<()> {
    let line = format!("{}\n", gpu_mps_api::message::one_line(&error.to_string()));
    gpu_mps_api::files::replace_file(
        &root.join(NVML_ERROR_FILE),
        line.as_bytes(),
        gpu_mps_api::files::FileMode::Set(0o644),
        gpu_mps_api::files::Durability::Volatile,
    )
}

/// Removes what [`record_nvml_failure`] left: NVML loads now.
pub fn clear_nvml_failure(root: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(root.join(NVML_ERROR_FILE)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

pub trait GpuBackend: Send + Sync {
    fn inventory(&self) -> Result<Inventory, GpuBackendError>;
    fn compute_mode(&self, uuid: &str) -> Result<String, GpuBackendError>;
    fn set_compute_mode(&self, uuid: &str, mode: &str) -> Result<(), GpuBackendError>;
}

/// The real GPUs, through NVML (libnvidia-ml.so.1, loaded at run time).
pub struct NvmlBackend {
    nvml: Nvml,
}

impl NvmlBackend {
    pub fn init() -> Result<Self, GpuBackendError> {
        let nvml = Nvml::init().map_err(|source| GpuBackendError::Nvml {
            context: "loading libnvidia-ml.so.1 (is the NVIDIA driver installed?)".into(),
            source,
        })?;
        Ok(NvmlBackend { nvml })
    }

    fn nvml_err(
        context: impl Into<String>,
    ) -> impl FnOnce(nvml_wrapper::error::NvmlError) -> GpuBackendError {
        let context = context.into();
        move |source| GpuBackendError::Nvml { context, source }
    }
}

fn mode_name(mode: ComputeMode) -> &'static str {
    match mode {
        ComputeMode::Default => "Default",
        ComputeMode::ExclusiveThread => "ExclusiveThread",
        ComputeMode::Prohibited => "Prohibited",
        ComputeMode::ExclusiveProcess => EXCLUSIVE_PROCESS,
    }
}

fn mode_from_name(name: &str) -> Result<ComputeMode, GpuBackendError> {
    match name {
        "Default" => Ok(ComputeMode::Default),
        "Prohibited" => Ok(ComputeMode::Prohibited),
        "ExclusiveProcess" => Ok(ComputeMode::ExclusiveProcess),
        other => Err(GpuBackendError::UnknownMode(other.into())),
    }
}

impl GpuBackend for NvmlBackend {
    fn inventory(&self) -> Result<Inventory, GpuBackendError> {
        let count = self
            .nvml
            .device_count()
            .map_err(Self::nvml_err("counting devices"))?;
        let mut gpus = Vec::new();
        for index in 0..count {
            let d = self
                .nvml
                .device_by_index(index)
                .map_err(Self::nvml_err(format!("device {index}")))?;
            gpus.push(GpuInfo {
                index,
                // The shim maps device nodes (/dev/nvidia<minor>) to GPUs by it: a guess from the
                // index could hand a container's node the limits of another GPU, so no fallback.
                minor: d
                    .minor_number()
                    .map_err(Self::nvml_err(format!("minor number of device {index}")))?,
                uuid: d
                    .uuid()
                    .map_err(Self::nvml_err(format!("UUID of device {index}")))?,
                name: d
                    .name()
                    .map_err(Self::nvml_err(format!("name of device {index}")))?,
                memory_bytes: d
                    .memory_info()
                    .map_err(Self::nvml_err(format!("memory of device {index}")))?
                    .total,
                compute_mode: d.compute_mode().map(mode_name).unwrap_or("Unknown").to_string(),
                // Not every GPU supports MIG; NotSupported means MIG is off.
                mig_enabled: d.mig_mode().map(|m| m.current == 1).unwrap_or(false),
            });
        }
        Ok(Inventory {
            source: "nvml".into(),
            gpus,
        })
    }

    fn compute_mode(&self, uuid: &str) -> Result<String, GpuBackendError> {
        let d = self
            .nvml
            .device_by_uuid(uuid)
            .map_err(Self::nvml_err(format!("device {uuid}")))?;
        Ok(mode_name(
            d.compute_mode()
                .map_err(Self::nvml_err(format!("compute mode of {uuid}")))?,
        )
        .into())
    }

    fn set_compute_mode(&self, uuid: &str, mode: &str) -> Result<(), GpuBackendError> {
        let mode = mode_from_name(mode)?;
        let mut d = self
            .nvml
            .device_by_uuid(uuid)
            .map_err(Self::nvml_err(format!("device {uuid}")))?;
        d.set_compute_mode(mode)
            .map_err(Self::nvml_err(format!("setting compute mode of {uuid}")))
    }
}

/// TEST ONLY: GPUs described by a JSON file (api::inventory::Inventory; a GPU without `minor`
/// has minor = index, as in an old inventory). Compute mode changes
/// are kept in memory and never reach a device. Exists so CI, which has no GPU, can run the
/// manager end to end; the manager logs a warning when it is used.
pub struct FileBackend {
    path: PathBuf,
    modes: Mutex<std::collections::BTreeMap<String, String>>,
}

impl FileBackend {
    pub fn new(path: &Path) -> Self {
        FileBackend {
            path: path.into(),
            modes: Mutex::new(Default::default()),
        }
    }
}

impl GpuBackend for FileBackend {
    fn inventory(&self) -> Result<Inventory, GpuBackendError> {
        let err = |message: String| GpuBackendError::InventoryFile {
            path: self.path.clone(),
            message,
        };
        let text = std::fs::read_to_string(&self.path).map_err(|e| err(e.to_string()))?;
        let mut inv = Inventory::from_json(&text).map_err(|e| err(e.to_string()))?;
        inv.source = format!("file:{} (TEST ONLY)", self.path.display());
        let modes = self.modes.lock().expect("modes lock");
        for g in &mut inv.gpus {
            if let Some(m) = modes.get(&g.uuid) {
                g.compute_mode = m.clone();
            }
        }
        Ok(inv)
    }

    fn compute_mode(&self, uuid: &str) -> Result<String, GpuBackendError> {
        let inv = self.inventory()?;
        let gpu = inv
            .gpus
            .iter()
            .find(|g| g.uuid == uuid)
            .ok_or_else(|| GpuBackendError::UnknownGpu(uuid.into()))?;
        Ok(gpu.compute_mode.clone())
    }

    fn set_compute_mode(&self, uuid: &str, mode: &str) -> Result<(), GpuBackendError> {
        mode_from_name(mode)?;
        self.modes
            .lock()
            .expect("modes lock")
            .insert(uuid.into(), mode.into());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_backend_reads_minors_defaulting_to_the_index() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("inventory.json");
        let text = r#"{"source":"x","gpus":[
            {"index":0,"uuid":"GPU-a","name":"n","memory_bytes":1},
            {"index":1,"minor":3,"uuid":"GPU-b","name":"n","memory_bytes":1}]}"#;
        std::fs::write(&path, text).expect("write");
        let inv = FileBackend::new(&path).inventory().expect("inventory");
        let minors: Vec<(u32, u32)> = inv.gpus.iter().map(|g| (g.index, g.minor)).collect();
        assert_eq!(minors, [(0, 0), (1, 3)]);
        assert!(inv.source.contains("TEST ONLY"));
    }
}
