//! The node's files the shim reads: the node config and the manager's GPU inventory.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use gpu_mps_api::NodeConfig;
use gpu_mps_api::inventory::Inventory;
use gpu_mps_api::node_config::ConfigError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum NodeFileError {
    #[error("invalid node config {0}")]
    Config(#[from] ConfigError),
    #[error(
        "the GPU inventory {path} does not exist: gpu-mps-manager publishes it when it starts and is probably not running (systemctl status gpu-mps-manager)"
    )]
    InventoryMissing { path: PathBuf },
    #[error("cannot read the GPU inventory {path}: {source}")]
    InventoryRead { path: PathBuf, source: io::Error },
    #[error("the GPU inventory {path} is not valid: {message} (gpu-mps-manager rewrites it when it starts)")]
    InventoryInvalid { path: PathBuf, message: String },
}

/// The node config at `path`; a missing file means all defaults.
pub fn load_config(path: &Path) -> Result<NodeConfig, NodeFileError> {
    Ok(NodeConfig::load(path)?)
}

/// The runc to exec, with as little work as possible: only `runc_path` is read, and a config
/// that fails validation elsewhere (a typo under `[limits]`) still gives it, so that `delete`
/// and `kill` keep reaching runc. The note says why the default was used, if it was.
pub fn runc_path(config_path: &Path) -> (PathBuf, Option<String>) {
    let default = || NodeConfig::default().runc_path;
    match fs::read_to_string(config_path) {
        Ok(text) => match runc_path_from_toml(&text) {
            Ok(Some(path)) => (path, None),
            Ok(None) => (default(), None),
            Err(message) => (default(), Some(format!("{}: {message}", config_path.display()))),
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => (default(), None),
        Err(e) => (
            default(),
            Some(format!("cannot read {}: {e}", config_path.display())),
        ),
    }
}

/// `runc_path` from config text, without validating the rest.
pub fn runc_path_from_toml(text: &str) -> Result<Option<PathBuf>, String> {
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| e.message().to_string())?;
    match table.get("runc_path") {
        None => Ok(None),
        Some(toml::Value::String(s)) => Ok(Some(PathBuf::from(s))),
        Some(other) => Err(format!("runc_path = {other}: expected a path string")),
    }
}

pub fn load_inventory(path: &Path) -> Result<Inventory, NodeFileError> {
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
        let path = dir.path().join("config.toml");
        assert_eq!(load_config(&path).unwrap(), NodeConfig::default());
        assert_eq!(runc_path(&path), (NodeConfig::default().runc_path, None));
    }

    #[test]
    fn runc_path_survives_errors_elsewhere_in_the_config() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        fs::write(
            &path,
            "runc_path = \"/opt/runc\"\n[limits]\npolcy = \"ceiling\"\n",
        )
        .unwrap();
        assert!(load_config(&path).unwrap_err().to_string().contains("polcy"));
        assert_eq!(runc_path(&path), (PathBuf::from("/opt/runc"), None));
        fs::write(&path, "runc_path = [").unwrap();
        let (runc, note) = runc_path(&path);
        assert_eq!(runc, NodeConfig::default().runc_path);
        assert!(note.unwrap().contains("config.toml"));
        assert!(runc_path_from_toml("runc_path = 1").is_err());
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
