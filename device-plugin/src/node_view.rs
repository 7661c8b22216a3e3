//! What the plugin reads of the node: the config the manager runs with, its GPU inventory and
//! its status. The only file and manager I/O of the crate.

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpu_mps_api::NodeConfig;
use gpu_mps_api::client::ManagerConnection;
use gpu_mps_api::inventory::Inventory;
use gpu_mps_api::node_config::{ConfigError, PublishedConfig};
use gpu_mps_api::status_view::StatusView;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum NodeViewError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(
        "the GPU inventory {path} does not exist yet: gpu-mps-manager publishes it when it starts (systemctl status gpu-mps-manager)"
    )]
    InventoryMissing { path: PathBuf },
    #[error("cannot read the GPU inventory {path}: {message}")]
    Inventory { path: PathBuf, message: String },
}

/// The config the running manager published under its root, else the file's: the plugin must
/// lay units out exactly as the shim and the manager see them.
pub fn load_config(path: &Path) -> Result<NodeConfig, NodeViewError> {
    let from_file = NodeConfig::load(path)?;
    let published = match std::fs::read_to_string(from_file.published_path()) {
        Ok(text) => match PublishedConfig::from_json(&text) {
            Ok(p) => Some(p),
            Err(e) => {
                tracing::warn!(path = %from_file.published_path().display(), error = %e, "the manager's published config is not valid; using the config file");
                None
            }
        },
        Err(_) => None,
    };
    Ok(published.map_or(from_file, |p| p.config))
}

pub fn load_inventory(config: &NodeConfig) -> Result<Inventory, NodeViewError> {
    let path = config.inventory_path();
    let text = std::fs::read_to_string(&path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => NodeViewError::InventoryMissing { path: path.clone() },
        _ => NodeViewError::Inventory {
            path: path.clone(),
            message: e.to_string(),
        },
    })?;
    Inventory::from_json(&text).map_err(|e| NodeViewError::Inventory {
        path,
        message: e.to_string(),
    })
}

/// The manager's status, or why it could not be had (one line). Blocking: call it off the
/// async runtime.
pub fn manager_status(socket: &Path, budget: Duration) -> Result<StatusView, String> {
    let connection = ManagerConnection::connect(socket, budget).map_err(|e| e.to_string())?;
    let status = connection.status().map_err(|e| e.to_string())?;
    Ok(StatusView::from(&status))
}
