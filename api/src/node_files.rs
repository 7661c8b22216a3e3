//! The node's files every component reads: the node config the running manager publishes (or
//! config.toml before any manager ran) and the manager's GPU inventory. The shim lays containers
//! out by them and gpu-mps-device-plugin lays out its units by them, so both see what the
//! manager sees.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::NodeConfig;
use crate::inventory::Inventory;
use crate::node_config::{ConfigError, PublishedConfig};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum NodeFileError {
    #[error("invalid node config {0}")]
    Config(#[from] ConfigError),
    #[error(
        "the GPU inventory {path} does not exist: gpu-mps-manager publishes it when it starts and is probably not running (systemctl status gpu-mps-manager)"
    )]
    InventoryMissing { path: PathBuf },
    #[error(
        "this node has no usable NVIDIA driver: gpu-mps-manager could not load NVML ({reason}; recorded in {path}), so no GPU container can run here: install or repair the driver until nvidia-smi works, then restart gpu-mps-manager, or keep GPU pods off this node"
    )]
    NoDriver { path: PathBuf, reason: String },
    #[error("cannot read the GPU inventory {path}: {source}")]
    InventoryRead { path: PathBuf, source: io::Error },
    #[error("the GPU inventory {path} is not valid: {message} (gpu-mps-manager rewrites it when it starts)")]
    InventoryInvalid { path: PathBuf, message: String },
    #[error("cannot read the running manager's config {path}: {source}")]
    PublishedRead { path: PathBuf, source: io::Error },
    #[error(
        "the running manager's config {path} is not valid: {message} (gpu-mps-manager rewrites it when it starts: restart it)"
    )]
    PublishedInvalid { path: PathBuf, message: String },
}

/// Which config was used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigOrigin {
    /// The one the running manager published (`<root>/node-config.json`).
    Published { path: PathBuf, manager_pid: u32 },
    /// config.toml itself: no manager has published one under its root yet.
    File { path: PathBuf },
}

impl std::fmt::Display for ConfigOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConfigOrigin::Published { path, manager_pid } => {
                write!(
                    f,
                    "{} (published by gpu-mps-manager pid {manager_pid})",
                    path.display()
                )
            }
            ConfigOrigin::File { path } => {
                write!(f, "{} (no manager has published its config yet)", path.display())
            }
        }
    }
}

/// The config to lay containers (and units) out by: the one the running manager published under the root
/// that `config_path` names, so that the shim and the manager always agree (an edit of
/// config.toml takes effect for both at the manager's restart). config.toml itself only when no
/// manager has published one yet (its Acquire then tells whether one runs).
pub fn load_effective_config(config_path: &Path) -> Result<(NodeConfig, ConfigOrigin), NodeFileError> {
    let file = load_config(config_path)?;
    let published = file.published_path();
    match fs::read_to_string(&published) {
        Ok(text) => {
            let p = PublishedConfig::from_json(&text).map_err(|message| NodeFileError::PublishedInvalid {
                path: published.clone(),
                message,
            })?;
            Ok((
                p.config,
                ConfigOrigin::Published {
                    path: published,
                    manager_pid: p.manager_pid,
                },
            ))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok((
            file,
            ConfigOrigin::File {
                path: config_path.to_path_buf(),
            },
        )),
        Err(source) => Err(NodeFileError::PublishedRead {
            path: published,
            source,
        }),
    }
}

/// The node config at `path`; a missing file means all defaults.
pub fn load_config(path: &Path) -> Result<NodeConfig, NodeFileError> {
    Ok(NodeConfig::load(path)?)
}

pub use crate::node_config::NVML_ERROR_FILE;

/// The inventory at `path`. When the manager's last start found no driver (its NVML error file
/// next to `path`), that is the error: any inventory there is from before and names GPUs that
/// cannot be used.
pub fn load_inventory(path: &Path) -> Result<Inventory, NodeFileError> {
    let nvml_error = path.with_file_name(NVML_ERROR_FILE);
    if let Ok(reason) = fs::read_to_string(&nvml_error) {
        return Err(NodeFileError::NoDriver {
            path: nvml_error,
            reason: crate::message::one_line(reason.trim()),
        });
    }
    let text = fs::read_to_string(path).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound => NodeFileError::InventoryMissing {
            path: path.to_path_buf(),
        },
        _ => NodeFileError::InventoryRead {
            path: path.to_path_buf(),
            source,
        },
    })?;
    Inventory::from_json(&text).map_err(|e| NodeFileError::InventoryInvalid {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_config_means_defaults() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            load_config(&dir.path().join("config.toml")).unwrap(),
            NodeConfig::default()
        );
    }

    #[test]
    fn the_published_config_wins_over_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("r");
        fs::create_dir(&root).unwrap();
        let path = dir.path().join("config.toml");
        fs::write(
            &path,
            format!("root = \"{}\"\n[limits]\npolicy = \"uniform\"\n", root.display()),
        )
        .unwrap();
        let (c, origin) = load_effective_config(&path).unwrap();
        assert_eq!(c.limits.policy, crate::node_config::LimitPolicy::Uniform);
        assert_eq!(origin, ConfigOrigin::File { path: path.clone() });
        // The manager started with another config and published it; config.toml was edited since.
        let mut running = c.clone();
        running.limits.policy = crate::node_config::LimitPolicy::Exact;
        let published = PublishedConfig::new(running.clone(), &path, 77);
        fs::write(c.published_path(), serde_json::to_string(&published).unwrap()).unwrap();
        let (c2, origin) = load_effective_config(&path).unwrap();
        assert_eq!(c2, running);
        assert!(matches!(origin, ConfigOrigin::Published { manager_pid: 77, .. }));
        fs::write(c.published_path(), "{").unwrap();
        let e = load_effective_config(&path).unwrap_err().to_string();
        assert!(e.contains("node-config.json") && e.contains("restart"), "{e}");
    }

    #[test]
    fn a_node_without_a_driver_says_so_not_that_the_manager_is_down() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("inventory.json");
        fs::write(
            dir.path().join(NVML_ERROR_FILE),
            "NVML: loading libnvidia-ml.so.1 (is the NVIDIA driver installed?): a libloading error occurred\n",
        )
        .unwrap();
        for inventory in [None, Some(r#"{"source":"nvml","gpus":[]}"#)] {
            if let Some(text) = inventory {
                fs::write(&path, text).unwrap();
            }
            let e = load_inventory(&path).unwrap_err().to_string();
            assert!(
                e.contains("no usable NVIDIA driver")
                    && e.contains("libnvidia-ml.so.1")
                    && !e.contains("not running"),
                "{e}"
            );
            assert!(!e.contains('\n'), "{e}");
        }
        fs::remove_file(dir.path().join(NVML_ERROR_FILE)).unwrap();
        assert!(load_inventory(&path).is_ok());
    }

    #[test]
    fn a_missing_inventory_points_at_the_manager() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("inventory.json");
        let e = load_inventory(&path).unwrap_err().to_string();
        assert!(
            e.contains("inventory.json") && e.contains("gpu-mps-manager") && e.contains("not running"),
            "{e}"
        );
        fs::write(&path, "{").unwrap();
        let e = load_inventory(&path).unwrap_err().to_string();
        assert!(e.contains("not valid"), "{e}");
        fs::write(&path, r#"{"source":"nvml","gpus":[]}"#).unwrap();
        assert!(load_inventory(&path).unwrap().gpus.is_empty());
    }
}
