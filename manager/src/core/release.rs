//! Release: the container's gate closed and its lease dropped, in the books only.

use gpu_mps_api::ContainerId;
use tracing::info;

use super::{ManagerCore, ManagerError};

impl ManagerCore {
    /// Drops a container's lease. Unknown containers are not an error (release is retried by
    /// runc on delete, and the reconciler may have dropped it already). A lease still being
    /// acquired is dropped too: its Acquire then fails and closes what it opened.
    pub async fn release(&self, container_id: &str) -> Result<bool, ManagerError> {
        let started = std::time::Instant::now();
        if let Ok(id) = ContainerId::parse(container_id) {
            // Also when no gate is open: the shim made the dir, and the Acquire may have failed.
            // Before the books are taken: closing asks the gate keeper to drop the socket, a
            // round trip that must not hold every other GPU's requests.
            self.gates.close(&id, &self.config.gate_dir(&id));
        }
        let mut books = self.books();
        if let Some(pending) = books.pending.remove(container_id) {
            info!(container = %container_id, daemon = %pending.request.key, "lease released while it was being acquired");
            return Ok(true);
        }
        let Some(lease) = books.leases.remove(container_id) else {
            return Ok(false);
        };
        books.mark_idle_if_unused(&lease.request.key);
        // Released in the books whatever the disk says: the container is gone, and a lease
        // file left by a failed save is dropped by the next save that succeeds.
        self.save_or_log(&mut books, "after a release");
        info!(container = %container_id, daemon = %lease.request.key, elapsed_us = started.elapsed().as_micros() as u64, "lease released");
        Ok(true)
    }
}
