//! Shutdown (SIGTERM): idle daemons stopped, busy ones left for the next manager.

use tracing::{error, info, warn};

use super::{ManagerCore, SHUTDOWN_DRAIN};
use crate::compute_mode;
use crate::daemon_life::Event;

impl ManagerCore {
    /// Idle daemons are stopped. Daemons with leases keep running, and so does
    /// EXCLUSIVE_PROCESS: the next manager adopts them (an upgrade must not break pods). With
    /// no lease left, the compute mode is restored.
    pub async fn shutdown(&self) {
        self.gates.drain(SHUTDOWN_DRAIN).await;
        let keys = self.books().daemons.keys();
        for key in keys {
            let _turn = self.take_turn(&key).await;
            let record = {
                let books = self.books();
                let Some(record) = books.daemons.get(&key).and_then(|d| d.record()) else {
                    continue;
                };
                if books.in_use(&key) {
                    info!(daemon = %key, "daemon has leases; left running for the next manager");
                    continue;
                }
                record.clone()
            };
            match self.stop_daemon(&record).await {
                Ok(true) => {
                    self.books().daemons.of(&key).step(Event::Stopped);
                }
                Ok(false) => {}
                Err(e) => warn!(daemon = %key, error = %e, "could not stop daemon at shutdown"),
            }
        }
        let (leases, mut saved_modes) = {
            let books = self.books();
            (books.leases.len(), books.saved_compute_modes.clone())
        };
        if leases == 0 {
            for (uuid, e) in compute_mode::restore_compute_modes(self.backend.as_ref(), &mut saved_modes) {
                error!(gpu = %uuid, error = %e, "cannot restore the compute mode");
            }
            self.books().saved_compute_modes = saved_modes;
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
