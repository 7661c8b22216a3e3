//! Shutdown (SIGTERM): idle daemons stopped, busy ones left for the next manager.

use tracing::{error, info, warn};

use super::{ManagerCore, SHUTDOWN_DRAIN};
use crate::compute_mode;

impl ManagerCore {
    /// Idle daemons are stopped. Daemons with leases keep running, and so does
    /// EXCLUSIVE_PROCESS: the next manager adopts them (an upgrade must not break pods). With
    /// no lease left, the compute mode is restored.
    pub async fn shutdown(&self) {
        self.gates.drain(SHUTDOWN_DRAIN).await;
        let daemons: Vec<(String, gpu_mps_api::DaemonKey)> = self
            .books()
            .state
            .daemons
            .iter()
            .map(|(dir, d)| (dir.clone(), d.key.clone()))
            .collect();
        for (dir, key) in daemons {
            let _turn = self.daemon_turns.take(&key).await;
            let record = {
                let books = self.books();
                if books.in_use(&key) {
                    info!(daemon = %key, "daemon has leases; left running for the next manager");
                    continue;
                }
                match books.state.daemons.get(&dir) {
                    Some(record) => record.clone(),
                    None => continue,
                }
            };
            match self.stop_daemon(&record).await {
                Ok(true) => {
                    self.books().state.daemons.remove(&dir);
                }
                Ok(false) => {}
                Err(e) => warn!(daemon = %key, error = %e, "could not stop daemon at shutdown"),
            }
        }
        let (leases, mut saved_modes) = {
            let books = self.books();
            (books.state.leases.len(), books.state.saved_compute_modes.clone())
        };
        if leases == 0 {
            for (uuid, e) in compute_mode::restore_compute_modes(self.backend.as_ref(), &mut saved_modes) {
                error!(gpu = %uuid, error = %e, "cannot restore the compute mode");
            }
            self.books().state.saved_compute_modes = saved_modes;
        } else if !saved_modes.is_empty() {
            info!(
                leases,
                "leases remain: EXCLUSIVE_PROCESS stays until they are gone"
            );
        }
        let mut books = self.books();
        self.save_or_log(&mut books, "at shutdown");
    }
}
