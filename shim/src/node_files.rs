//! The node's files the shim reads: the node config the manager publishes (or config.toml
//! before any manager ran) and the manager's GPU inventory.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use gpu_mps_api::NodeConfig;
use gpu_mps_api::inventory::Inventory;
use gpu_mps_api::node_config::{ConfigError, PublishedConfig};
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
    #[error("cannot read the running manager's config {path}: {source}")]
    PublishedRead { path: PathBuf, source: io::Error },
    #[error(
        "the running manager's config {path} is not valid: {message} (gpu-mps-manager rewrites it when it starts: restart it)"
    )]
    PublishedInvalid { path: PathBuf, message: String },
}

/// Which config the shim used.
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

/// The config to lay a container out by: the one the running manager published under the root
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
        assert_eq!(c.policy, gpu_mps_api::node_config::LimitPolicy::Uniform);
        assert_eq!(origin, ConfigOrigin::File { path: path.clone() });
        // The manager started with another config and published it; config.toml was edited since.
        let mut running = c.clone();
        running.policy = gpu_mps_api::node_config::LimitPolicy::Exact;
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
