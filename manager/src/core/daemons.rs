//! A daemon's lifecycle: started on demand (or adopted when one the state does not know owns
//! its pipe dir), its servers' limits set through its owner task, stopped when idle. The slow
//! work runs in the daemon's turn and outside the node's bookkeeping lock.

use std::path::Path;

use gpu_mps_api::{DaemonKey, Limits};
use tracing::{error, info, warn};

use super::{ManagerCore, ManagerError, SERVER_LOG, START_SERVER, make_private_dir, now_unix};
use crate::daemon_life::{Action, Event};
use crate::fault_watch::LogCursor;
use crate::metrics::DaemonStart;
use crate::mps_control::{self, ControlError};
use crate::process_identity::ProcessIdentity;
use crate::state::DaemonRecord;

impl ManagerCore {
    /// Starts the daemon of `key` if none runs and makes its servers enforce `limits`; `None`
    /// (policy `exact`): the gates set them, per client. Call in the daemon's turn.
    pub(super) async fn ensure_daemon(
        &self,
        key: &DaemonKey,
        limits: Option<Limits>,
    ) -> Result<(), ManagerError> {
        let pipe_dir = self.config.pipe_dir(key);
        let log_dir = self.config.log_dir(key);
        let (actions, earlier) = {
            let mut books = self.books();
            let daemon = books.daemons.of(key);
            let alive = daemon.record().is_some_and(|d| d.control.is_alive());
            let earlier = daemon.record().map(|d| d.control.pid);
            (daemon.step(Event::Wanted { alive }), earlier)
        };
        if actions.contains(&Action::Start) {
            if let Some(pid) = earlier {
                warn!(daemon = %key, pid, "MPS control daemon is gone; starting a new one");
            }
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
                match (adopted, earlier) {
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
            let server_log = LogCursor::at_end(&log_dir.join(SERVER_LOG));
            let record = DaemonRecord {
                key: key.clone(),
                control,
                pipe_dir: pipe_dir.clone(),
                log_dir,
                started_unix: now_unix(),
                applied: None,
                idle_since_unix: None,
                faults: 0,
                last_fault_unix: None,
            };
            let mut books = self.books();
            books.daemons.of(key).step(Event::Started { record, server_log });
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
        self.books().daemons.of(key).step(Event::LimitsApplied(limits));
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
