//! The periodic housekeeping (every second): compute modes, stuck servers, leases whose
//! container is gone, then each daemon's tick (dead, idle, faults). What to do with a daemon
//! is its own pure step's answer (crate::daemon_life); the slow work on it runs in its turn and
//! outside the books, so a hung daemon holds up only the reconcile itself.

use std::collections::HashMap;

use gpu_mps_api::{ContainerId, DaemonKey};
use tracing::{error, info, warn};

use super::{Books, LEASE_RELEASE_GRACE_S, ManagerCore, ReconcileMemory, SERVER_LOG};
use crate::admission;
use crate::compute_mode;
use crate::daemon_life::{Action, Event};
use crate::fault_watch;
use crate::gate::daemon_admission::WedgeReport;
use crate::lease::LeaseRecord;
use crate::metrics::ServerFault;

impl ManagerCore {
    /// Drops leases of containers whose process is gone, restarts daemons that died under
    /// leases, reports server faults, and stops daemons idle for longer than the grace period.
    pub async fn reconcile(&self, now: i64) {
        let mut memory = self.reconciler.lock().await;
        if self.config.daemon.exclusive_process {
            self.reassert_exclusive_process(&mut memory);
        }
        for report in self.gates.take_wedge_reports() {
            self.recover_stuck_server(report, now).await;
        }
        self.drop_leases_of_gone_containers(&mut memory, now);
        self.remove_orphaned_gate_dirs();
        let keys = {
            let books = self.books();
            let mut keys = books.daemons.keys();
            for lease in books.leases.values() {
                if !keys.contains(&lease.request.key) {
                    keys.push(lease.request.key.clone());
                }
            }
            keys
        };
        for key in keys {
            self.tend_daemon(&key, now).await;
        }
        self.note_faults(now);
        self.save_again_if_unsaved();
    }

    /// A save that failed (a full /run) is tried again every tick until one succeeds, and
    /// the recovery is logged: until then a restart would rebuild from older files.
    fn save_again_if_unsaved(&self) {
        let mut books = self.books();
        if books.unsaved.is_none() {
            return;
        }
        if books.save(&self.config.state_path()).is_ok() {
            info!(leases = books.leases.len(), "the state is saved again");
        }
    }

    /// A daemon whose server stopped taking clients (docs/gpu-results.md section 7: a process took
    /// its channel and did not act as a CUDA client; the server then takes no new client, `quit`
    /// hangs, and only killing it helps). Its server and daemon are killed, which ends the
    /// server's running clients as MPS's own fault handling would; the daemon is started again
    /// on this tick, for the leases; the container whose process got the last channel before it
    /// stopped answering is refused from now on, so that it cannot do it again.
    async fn recover_stuck_server(&self, report: WedgeReport, now: i64) {
        let key = report.daemon.clone();
        let _turn = self.take_turn(&key).await;
        let (actions, record, leases) = {
            let mut books = self.books();
            let leases: Vec<String> = books.leases_of(&key).map(LeaseRecord::owner).collect();
            let daemon = books.daemons.of(&key);
            let Some(record) = daemon.record().cloned() else {
                return;
            };
            let alive = record.control.is_alive();
            (daemon.step(Event::Stuck { report, alive, now }), record, leases)
        };
        for action in actions {
            let Action::ReplaceStuck { report, daemon_pid } = action else {
                continue;
            };
            let mut servers = daemon_pid
                .map(crate::process_identity::children_of)
                .unwrap_or_default();
            // Its servers by their environment too: one whose daemon died is no child of anyone.
            for server in crate::mps_server_processes::servers_of(&record.pipe_dir) {
                if !servers.contains(&server.pid) {
                    servers.push(server.pid);
                }
            }
            let blamed = report.suspect.as_ref().map(|(container, pid)| {
                let reason = format!(
                    "its process {pid} took a channel to the MPS server of {} and left the server stuck (every new client waited); it is refused until it is restarted",
                    report.daemon
                );
                let blocked = self.gates.block(container, &reason);
                (container.to_string(), *pid, blocked)
            });
            error!(daemon = %report.daemon, control_pid = record.control.pid, server_pids = ?servers, blamed = ?blamed, leases = ?leases, detail = %report.detail, "the MPS server takes no new client (a channel taken and not used as a CUDA client leaves it stuck); killing the server and its daemon, which ends the server's running clients, and starting them again");
            for pid in servers.iter().copied().chain(daemon_pid) {
                crate::mps_server_processes::kill(pid);
            }
            self.metrics.server_fault(&key, ServerFault::Stuck);
            let mut books = self.books();
            self.save_or_log(&mut books, "after replacing a stuck server");
        }
    }

    /// EXCLUSIVE_PROCESS is checked on every tick, not only at start: a mode changed behind the
    /// manager's back would let a process that misses MPS take the whole GPU.
    fn reassert_exclusive_process(&self, memory: &mut ReconcileMemory) {
        let drifts = compute_mode::reassert_exclusive_process(self.backend.as_ref(), &self.inventory.gpus);
        let mut seen = HashMap::new();
        for d in drifts {
            let found = match &d.found {
                Ok(mode) => mode.clone(),
                Err(e) => format!("unreadable: {e}"),
            };
            let reset = match &d.reset {
                Some(Ok(())) => "set to EXCLUSIVE_PROCESS again".to_string(),
                Some(Err(e)) => format!("cannot set it again: {e}"),
                None => "not changed".to_string(),
            };
            let line = format!("{found}; {reset}");
            if memory.compute_mode_drift.get(&d.uuid) != Some(&line) {
                error!(gpu = %d.uuid, found = %found, action = %reset, "compute mode is not EXCLUSIVE_PROCESS (changed behind gpu-mps-manager's back?): a process that misses MPS could take the whole GPU");
            }
            seen.insert(d.uuid, line);
        }
        for uuid in memory.compute_mode_drift.keys() {
            if !seen.contains_key(uuid) {
                info!(gpu = %uuid, "compute mode is EXCLUSIVE_PROCESS again");
            }
        }
        memory.compute_mode_drift = seen;
    }

    /// Leases whose container process has been gone for longer than the poststop hook's
    /// release takes: the hook missed it.
    fn drop_leases_of_gone_containers(&self, memory: &mut ReconcileMemory, now: i64) {
        let mut books = self.books();
        let gone: Vec<LeaseRecord> = books
            .leases
            .values()
            .filter(|l| l.process.is_some() && !l.container_alive())
            .cloned()
            .collect();
        memory.lease_gone_since = gone
            .iter()
            .map(|l| {
                let since = memory.lease_gone_since.get(&l.container_id).copied();
                (l.container_id.clone(), since.unwrap_or(now))
            })
            .collect();
        let mut changed = false;
        let mut to_close = Vec::new();
        for lease in gone {
            // The poststop hook releases a lease just after its container's process exits, and
            // the tick often falls in between (measured on the H200: a WARN for a clean exit).
            // Only a lease that outlives that is the hook's miss.
            let since = memory.lease_gone_since[&lease.container_id];
            if now - since < LEASE_RELEASE_GRACE_S {
                continue;
            }
            memory.lease_gone_since.remove(&lease.container_id);
            warn!(container = %lease.container_id, pod = %lease.request.identity.pod, namespace = %lease.request.identity.namespace, gone_for_s = now - since, "container process is gone and no release came (poststop hook missed?); lease dropped");
            books.leases.remove(&lease.container_id);
            if let Ok(id) = ContainerId::parse(&lease.container_id) {
                to_close.push(id);
            }
            books.mark_idle_if_unused(&lease.request.key);
            changed = true;
        }
        if changed {
            self.save_or_log(&mut books, "after dropping leases of gone containers");
        }
        // Outside the books: each close is a round trip to the gate keeper.
        drop(books);
        for id in to_close {
            self.gates.close(&id, &self.config.gate_dir(&id));
        }
    }

    /// Gate dirs of containers whose create ended before their Acquire (the runtime killed
    /// between the shim and runc, a failed hook): containerd 2.x removes such a container
    /// without the runc `delete` on which gpu-mps-shim removes them itself.
    fn remove_orphaned_gate_dirs(&self) {
        let kept: std::collections::HashSet<String> = {
            let books = self.books();
            books
                .leases
                .keys()
                .chain(books.pending.keys())
                .filter_map(|id| ContainerId::parse(id).ok())
                .map(|id| id.gate_name())
                .collect()
        };
        crate::gate::remove_stale_gate_dirs(
            &self.config.gates_root(),
            super::unserved_gate_dir_age(&self.config),
            crate::gate::StaleGateDirs::OldUnserved,
            |name| kept.contains(name),
        );
    }

    /// One daemon's tick: a daemon that died is dropped when nothing uses it and started again,
    /// with the limits of its leases, when containers use it (their running CUDA processes lost
    /// their server, and the leases are marked so); one idle for the grace period is stopped.
    /// What its step asks for that needs the daemon is done in its turn, once the step, asked
    /// again there, still asks for it (an Acquire may have started or taken it meanwhile).
    async fn tend_daemon(&self, key: &DaemonKey, now: i64) {
        let first = self.tick_step(key, now);
        if !first
            .iter()
            .any(|a| matches!(a, Action::Start | Action::StopIdle))
        {
            return;
        }
        let _turn = self.take_turn(key).await;
        for action in self.tick_step(key, now) {
            match action {
                Action::Start => self.restart_for_leases(key, now).await,
                Action::StopIdle => self.stop_idle(key, now).await,
                _ => {}
            }
        }
    }

    /// The daemon's step on what a tick sees now, with what needs only the books done at once
    /// (a dead daemon forgotten, leases marked as having lost their server); returns the rest.
    fn tick_step(&self, key: &DaemonKey, now: i64) -> Vec<Action> {
        let mut books = self.books();
        let tick = self.tick_of(&books, key, now);
        let actions = books.daemons.of(key).step(tick);
        let mut changed = false;
        for action in &actions {
            match action {
                Action::Forgotten { dead_pid } => {
                    warn!(daemon = %key, pid = dead_pid, "idle MPS control daemon died");
                    changed = true;
                }
                Action::MarkLeasesLost { dead_pid } => {
                    let marked = mark_leases_lost(&mut books, key, now);
                    if !marked.is_empty() {
                        error!(daemon = %key, pid = dead_pid, leases = ?marked, "MPS control daemon died while containers use it: their running CUDA processes lost their server; starting a new daemon for them");
                        changed = true;
                    }
                }
                _ => {}
            }
        }
        if changed {
            self.save_or_log(&mut books, "after a daemon died");
        }
        actions
    }

    /// What a tick sees of the daemon of `key` now (its process read from /proc).
    fn tick_of(&self, books: &Books, key: &DaemonKey, now: i64) -> Event {
        let alive = books
            .daemons
            .get(key)
            .and_then(|d| d.record())
            .is_some_and(|r| r.control.is_alive());
        Event::Tick {
            now,
            alive,
            recorded_leases: books.leases_of(key).count(),
            pending_leases: books.pending_of(key),
            idle_grace_seconds: self.config.daemon.idle_grace_seconds as i64,
        }
    }

    /// In the daemon's turn: a new daemon for the recorded leases, with their server limits
    /// (all of one daemon's leases have the same class).
    async fn restart_for_leases(&self, key: &DaemonKey, now: i64) {
        let limits = {
            let books = self.books();
            let Some(limits) = books
                .leases_of(key)
                .map(|l| admission::server_limits(&self.policy, &l.request))
                .next()
            else {
                return;
            };
            limits
        };
        match self.ensure_daemon(key, limits).await {
            Ok(()) => {
                let mut books = self.books();
                books.daemons.of(key).step(Event::Serving);
                self.save_or_log(&mut books, "after a daemon's restart");
            }
            Err(e) => {
                error!(daemon = %key, error = %e, "restarting the MPS control daemon failed; retrying on the next tick");
                self.books().note_start_failure(key, now, &e);
            }
        }
    }

    /// In the daemon's turn: an idle daemon asked to quit. One that does not is tried again
    /// after another grace period, not on every tick.
    async fn stop_idle(&self, key: &DaemonKey, now: i64) {
        let Some(record) = self.books().daemons.get(key).and_then(|d| d.record().cloned()) else {
            return;
        };
        let stopped = self.stop_daemon(&record).await.unwrap_or_else(|e| {
            error!(daemon = %record.key, error = %e, "stopping idle daemon failed");
            false
        });
        let mut books = self.books();
        let event = if stopped {
            Event::Stopped
        } else {
            Event::StopDeclined { now }
        };
        books.daemons.of(key).step(event);
        self.save_or_log(&mut books, "after an idle daemon's stop");
    }

    /// Reports the fatal faults each live daemon's server logged since the last look. The log
    /// is read outside the books.
    fn note_faults(&self, now: i64) {
        let looks: Vec<(DaemonKey, std::path::PathBuf, u32, fault_watch::LogCursor)> = {
            let books = self.books();
            books
                .daemons
                .all()
                .filter_map(|d| {
                    let r = d.record().filter(|r| r.control.is_alive())?;
                    let log = r.log_dir.join(SERVER_LOG);
                    let cursor = d
                        .server_log()
                        .unwrap_or_else(|| fault_watch::LogCursor::at_end(&log));
                    Some((r.key.clone(), log, r.control.pid, cursor))
                })
                .collect()
        };
        for (key, log, pid, mut cursor) in looks {
            let pids = fault_watch::fault_pids(&cursor.read_new(&log));
            let mut books = self.books();
            let read = Event::ServerLogRead {
                process: pid,
                cursor,
                faults: pids.len(),
                now,
            };
            if !books.daemons.of(&key).step(read).contains(&Action::ReportFault) {
                continue;
            }
            let affected: Vec<String> = books.leases_of(&key).map(LeaseRecord::owner).collect();
            // The faulted containers have often exited by now, so the pids are the record, the
            // leases only who is still there.
            error!(daemon = %key, torn_down_client_pids = ?pids, leases_now = ?affected, "the MPS server reported a fatal GPU fault: MPS tore down every client of this server (one fault domain per GPU; tenancy = \"exclusive\" keeps namespaces apart)");
            self.metrics.server_fault(&key, ServerFault::GpuFault);
            self.save_or_log(&mut books, "after a server fault");
        }
    }
}

/// Marks the recorded leases of `key` as having lost their daemon at `now` (once); returns them.
fn mark_leases_lost(books: &mut Books, key: &DaemonKey, now: i64) -> Vec<String> {
    books
        .leases
        .values_mut()
        .filter(|l| &l.request.key == key && l.daemon_lost_unix.is_none())
        .map(|l| {
            l.daemon_lost_unix = Some(now);
            l.owner()
        })
        .collect()
}
