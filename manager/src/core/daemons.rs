//! A daemon's lifecycle: started on demand (or adopted when one the state does not know owns
//! its pipe dir), its servers' limits set through its owner task, stopped when idle. The slow
//! work runs in the daemon's turn and outside the node's bookkeeping lock.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex as StdMutex};

use gpu_mps_api::{DaemonKey, Limits};
use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};
use tracing::{error, info, warn};

use super::{ManagerCore, ManagerError, SERVER_LOG, START_SERVER, make_private_dir, now_unix};
use crate::fault_watch::LogCursor;
use crate::metrics::DaemonStart;
use crate::mps_control::{self, ControlError};
use crate::process_identity::ProcessIdentity;
use crate::state::DaemonRecord;

/// One turn per daemon, by daemon dir: whoever starts, stops or replaces a daemon holds its
/// turn meanwhile. A turn guards no data (the records are in the books); it orders the slow
/// work on one daemon so that an Acquire never finds it half started or half stopped. Turns
/// are kept for the manager's life: one per set of GPUs ever used, a handful.
#[derive(Default)]
pub(super) struct DaemonTurns {
    turns: StdMutex<HashMap<String, Arc<AsyncMutex<()>>>>,
}

impl DaemonTurns {
    pub(super) async fn take(&self, key: &DaemonKey) -> OwnedMutexGuard<()> {
        let turn = self
            .turns
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .entry(key.dir_name())
            .or_default()
            .clone();
        turn.lock_owned().await
    }
}

impl ManagerCore {
    /// Starts the daemon of `key` if none runs and makes its servers enforce `limits`; `None`
    /// (policy `exact`): the gates set them, per client. Call in the daemon's turn.
    pub(super) async fn ensure_daemon(
        &self,
        key: &DaemonKey,
        limits: Option<Limits>,
    ) -> Result<(), ManagerError> {
        let dir = key.dir_name();
        let pipe_dir = self.config.pipe_dir(key);
        let log_dir = self.config.log_dir(key);
        let alive = self
            .books()
            .state
            .daemons
            .get(&dir)
            .is_some_and(|d| d.control.is_alive());
        if !alive {
            // A GPU's fault count outlives the daemon process: a stuck server is replaced, and
            // `gpu-mps status` must still show that it happened.
            let history = self.books().state.daemons.get(&dir).map(|dead| {
                warn!(daemon = %key, pid = dead.control.pid, "MPS control daemon is gone; starting a new one");
                (dead.faults, dead.last_fault_unix)
            });
            make_private_dir(&self.config.daemon_dir(key))?;
            make_private_dir(&pipe_dir)?;
            make_private_dir(&log_dir)?;
            let (control, adopted) =
                self.start_or_adopt(key, &pipe_dir, &log_dir)
                    .await
                    .inspect_err(|e| {
                        self.metrics.daemon_start_failed(key);
                        error!(daemon = %key, error = %e, "cannot start the MPS control daemon")
                    })?;
            self.metrics.daemon_started(
                key,
                match (adopted, &history) {
                    (true, _) => DaemonStart::Adopted,
                    (false, Some(_)) => DaemonStart::Restarted,
                    (false, None) => DaemonStart::Started,
                },
            );
            match self.control.command(&pipe_dir, START_SERVER).await {
                Ok(answer) if answer.is_empty() => {
                    info!(daemon = %key, "MPS server started with its daemon")
                }
                Ok(answer) => {
                    warn!(daemon = %key, answer = %answer, "{START_SERVER} was not accepted; the server starts with its first client")
                }
                Err(e) => {
                    warn!(daemon = %key, error = %e, "{START_SERVER} failed; the server starts with its first client")
                }
            }
            let cursor = LogCursor::at_end(&log_dir.join(SERVER_LOG));
            let (faults, last_fault_unix) = history.unwrap_or((0, None));
            let mut books = self.books();
            books.server_logs.insert(dir.clone(), cursor);
            books.state.daemons.insert(
                dir.clone(),
                DaemonRecord {
                    key: key.clone(),
                    control,
                    pipe_dir: pipe_dir.clone(),
                    log_dir,
                    started_unix: now_unix(),
                    applied: None,
                    // Idle until a lease is recorded: a failed limit setting leaves it to the
                    // idle stop instead of leaking it.
                    idle_since_unix: Some(now_unix()),
                    faults,
                    last_fault_unix,
                },
            );
            books.save(&self.config.state_path())?;
        }
        let Some(limits) = limits else {
            return Ok(());
        };
        let owner = self.gates.daemon_owner(key, &pipe_dir);
        owner
            .set_limits(limits)
            .await
            .inspect_err(|e| error!(daemon = %key, limits = %limits, error = %e, "setting limits failed"))?;
        // What `gpu-mps status` shows; the owner task keeps the cache that decides.
        if let Some(d) = self.books().state.daemons.get_mut(&dir) {
            d.applied = Some(limits);
        }
        Ok(())
    }

    /// Starts the daemon of `key`, unless one the state does not know (state file lost, manager
    /// crashed mid-start) still owns the pipe dir and answers: that one is adopted rather than
    /// doubled. One that owns it but no longer answers is stopped first: two daemons must never
    /// share a pipe dir. True with a daemon that was adopted.
    async fn start_or_adopt(
        &self,
        key: &DaemonKey,
        pipe_dir: &Path,
        log_dir: &Path,
    ) -> Result<(ProcessIdentity, bool), ManagerError> {
        let named = mps_control::read_pid_file(pipe_dir)
            .and_then(ProcessIdentity::of)
            .filter(|p| p.is_alive());
        // Only a process started for this pipe dir is its daemon: the pid may have been reused.
        let orphan = named.filter(|p| {
            let ours = crate::mps_server_processes::serves_pipe_dir(p.pid, pipe_dir);
            if !ours {
                warn!(daemon = %key, pid = p.pid, "the daemon's pid file names a process that is not an MPS control daemon of this pipe dir (the pid was reused); leaving that process alone");
            }
            ours
        });
        if let Some(identity) = orphan {
            if self.control.command(pipe_dir, "get_server_list").await.is_ok() {
                warn!(daemon = %key, pid = identity.pid, "adopting an MPS control daemon missing from the state");
                return Ok((identity, true));
            }
            warn!(daemon = %key, pid = identity.pid, "an MPS control daemon owns the pipe dir but does not answer; stopping it");
            crate::process_identity::terminate(&identity, std::time::Duration::from_secs(2)).await;
        }
        // A server left by a dead daemon would run on beside the new one, holding GPU memory
        // and client slots for good; its clients already failed (measured).
        let orphans = crate::mps_server_processes::kill_orphaned_servers(pipe_dir);
        if !orphans.is_empty() {
            warn!(daemon = %key, server_pids = ?orphans, "killed MPS servers whose control daemon is gone");
        }
        remove_stale_daemon_files(pipe_dir);
        let started = std::time::Instant::now();
        let pid = self.control.start_daemon(key, pipe_dir, log_dir).await?;
        let identity = ProcessIdentity::of(pid).ok_or_else(|| ControlError::StartFailed {
            key: key.to_string(),
            reason: format!("daemon pid {pid} exited right after start"),
        })?;
        info!(daemon = %key, pid, pipe_dir = %pipe_dir.display(), elapsed_ms = started.elapsed().as_millis() as u64, "MPS control daemon started");
        Ok((identity, false))
    }

    /// Quits an idle daemon unless MPS still reports clients on it (a container gpu-mps does
    /// not know about, e.g. one started while the manager was down): those are never killed.
    /// Call in the daemon's turn.
    pub(super) async fn stop_daemon(&self, record: &DaemonRecord) -> Result<bool, ManagerError> {
        let control = self.control.as_ref();
        let mut clients = Vec::new();
        for server in mps_control::server_pids(control, &record.pipe_dir).await? {
            clients.extend(mps_control::client_pids(control, &record.pipe_dir, server).await?);
        }
        if !clients.is_empty() {
            warn!(daemon = %record.key, clients = ?clients, "idle daemon still has MPS clients without a lease; not stopping it");
            return Ok(false);
        }
        control.command(&record.pipe_dir, "quit").await?;
        for _ in 0..250 {
            if !record.control.is_alive() {
                info!(daemon = %record.key, pid = record.control.pid, "idle MPS control daemon stopped");
                return Ok(true);
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        warn!(daemon = %record.key, pid = record.control.pid, "daemon did not exit within 5 s after quit");
        Ok(false)
    }

    /// Stops the daemon of `dir` if it is still idle and unused once its turn comes (an Acquire
    /// may have taken it meanwhile), and drops its record. A daemon that does not stop is tried
    /// again after another grace period, not on every tick.
    pub(super) async fn stop_if_idle(&self, dir: &str, key: &DaemonKey, now: i64, grace_seconds: i64) {
        let _turn = self.daemon_turns.take(key).await;
        let record = {
            let books = self.books();
            let Some(record) = books.state.daemons.get(dir) else {
                return;
            };
            let idle_long_enough = record
                .idle_since_unix
                .is_some_and(|since| now - since >= grace_seconds);
            if !idle_long_enough || books.in_use(key) || !record.control.is_alive() {
                return;
            }
            record.clone()
        };
        let stopped = self.stop_daemon(&record).await.unwrap_or_else(|e| {
            error!(daemon = %record.key, error = %e, "stopping idle daemon failed");
            false
        });
        let mut books = self.books();
        if stopped {
            books.state.daemons.remove(dir);
            books.server_logs.remove(dir);
        } else if let Some(d) = books.state.daemons.get_mut(dir) {
            d.idle_since_unix = Some(now);
        }
        self.save_or_log(&mut books, "after an idle daemon's stop");
    }
}

/// A daemon that died leaves its pid file and sockets behind; a new one must not trip on them.
fn remove_stale_daemon_files(pipe_dir: &Path) {
    for name in [
        mps_control::PID_FILE,
        mps_control::CONTROL_SOCKET,
        "control_privileged",
        "control_lock",
        "log",
    ] {
        let _ = std::fs::remove_file(pipe_dir.join(name));
    }
}
