//! What the plugin asks the manager: its status, for the GPUs' health. (The node config and the
//! inventory come from gpu_mps_api::node_files, as the shim reads them.)

use std::path::Path;
use std::time::Duration;

use gpu_mps_api::client::ManagerConnection;
use gpu_mps_api::status_view::StatusView;

/// The manager's status, or why it could not be had (one line). Blocking: call it off the
/// async runtime.
pub fn manager_status(socket: &Path, budget: Duration) -> Result<StatusView, String> {
    let connection = ManagerConnection::connect(socket, budget).map_err(|e| e.to_string())?;
    let status = connection.status().map_err(|e| e.to_string())?;
    Ok(StatusView::from(&status))
}
