//! The periodic housekeeping (every second): compute modes, stuck servers, leases whose
//! container is gone, dead daemons, server faults, idle daemons. Each daemon's slow work runs
//! in its turn and outside the books, so a hung daemon holds up only the reconcile itself.

use std::collections::HashMap;

use gpu_mps_api::{ContainerId, DaemonKey, Limits};
use tracing::{error, info, warn};

use super::{LEASE_RELEASE_GRACE_S, ManagerCore, ReconcileMemory, SERVER_LOG};
use crate::admission;
use crate::compute_mode;
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
        let stuck = std::mem::take(&mut memory.stuck_daemons);
        for report in stuck.into_iter().chain(self.gates.take_wedge_reports()) {
            self.recover_stuck_server(&report, now).await;
        }
        self.drop_leases_of_gone_containers(&mut memory, now);
        self.remove_orphaned_gate_dirs();
        self.restart_dead_daemons(now).await;
        self.note_faults(now);
        self.stop_idle_daemons(now).await;
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
            info!(leases = books.state.leases.len(), "the state is saved again");
        }
    }

    /// A daemon whose server stopped taking clients (docs/gpu-results.md section 7: a process took
    /// its channel and did not act as a CUDA client; the server then takes no new client, `quit`
    /// hangs, and only killing it helps). Its server and daemon are killed, which ends the
    /// server's running clients as MPS's own fault handling would; the daemon is started again
    /// on this tick, for the leases; the container whose process got the last channel before it
    /// stopped answering is refused from now on, so that it cannot do it again.
    async fn recover_stuck_server(&self, report: &WedgeReport, now: i64) {
        let Some(key) = self
            .books()
            .state
            .daemons
            .values()
            .find(|d| d.key.to_string() == report.daemon)
            .map(|d| d.key.clone())
        else {
            return;
        };
        let _turn = self.daemon_turns.take(&key).await;
        let dir = key.dir_name();
        let (record, leases) = {
            let books = self.books();
            let Some(record) = books.state.daemons.get(&dir).cloned() else {
                return;
            };
            let leases: Vec<String> = books.state.leases_of(&key).map(LeaseRecord::owner).collect();
            (record, leases)
        };
        // A dead daemon's pid may belong to another process by now: nothing is killed by it
        // (its servers went with it or were re-parented; the dead-daemon path starts it again).
        let daemon_alive = record.control.is_alive();
        let mut servers = if daemon_alive {
            crate::process_identity::children_of(record.control.pid)
        } else {
            Vec::new()
        };
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
        let daemon = daemon_alive.then_some(record.control.pid);
        for pid in servers.iter().copied().chain(daemon) {
            crate::mps_server_processes::kill(pid);
        }
        self.metrics.server_fault(&key, ServerFault::Stuck);
        let mut books = self.books();
        if let Some(record) = books.state.daemons.get_mut(&dir) {
            record.faults += 1;
            record.last_fault_unix = Some(now);
        }
        self.save_or_log(&mut books, "after replacing a stuck server");
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
            .state
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
            books.state.leases.remove(&lease.container_id);
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
                .state
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

    /// A daemon that died: dropped when nothing uses it; started again, with the limits of its
    /// leases, when containers use it. Running containers reach MPS through its pipe dir:
    /// without a daemon, a CUDA process that starts now would open a direct context (the whole
    /// GPU) unless EXCLUSIVE_PROCESS is on. The leases that were on it are marked: their
    /// running CUDA processes lost their server.
    async fn restart_dead_daemons(&self, now: i64) {
        // The limits its servers must hold again, from one of its leases (all have the same class).
        let needed: Vec<(DaemonKey, Option<Limits>)> = {
            let mut books = self.books();
            let dead: Vec<(String, DaemonKey, u32)> = books
                .state
                .daemons
                .iter()
                .filter(|(_, d)| !d.control.is_alive())
                .map(|(dir, d)| (dir.clone(), d.key.clone(), d.control.pid))
                .collect();
            let mut changed = false;
            for (dir, key, pid) in &dead {
                if !books.in_use(key) {
                    warn!(daemon = %key, pid, "idle MPS control daemon died");
                    books.state.daemons.remove(dir);
                    books.server_logs.remove(dir);
                    changed = true;
                    continue;
                }
                let marked: Vec<String> = books
                    .state
                    .leases
                    .values_mut()
                    .filter(|l| &l.request.key == key && l.daemon_lost_unix.is_none())
                    .map(|l| {
                        l.daemon_lost_unix = Some(now);
                        l.owner()
                    })
                    .collect();
                if !marked.is_empty() {
                    error!(daemon = %key, pid, leases = ?marked, "MPS control daemon died while containers use it: their running CUDA processes lost their server; starting a new daemon for them");
                    changed = true;
                }
            }
            if changed {
                self.save_or_log(&mut books, "after a daemon died");
            }
            // Leases whose daemon has no record at all: its start failed after it died.
            let mut keys: Vec<DaemonKey> = dead.into_iter().map(|(_, key, _)| key).collect();
            for lease in books.state.leases.values() {
                if !books.state.daemons.contains_key(&lease.request.key.dir_name())
                    && !keys.contains(&lease.request.key)
                {
                    keys.push(lease.request.key.clone());
                }
            }
            keys.into_iter()
                .filter_map(|key| {
                    let limits = books
                        .state
                        .leases_of(&key)
                        .map(|l| admission::server_limits(&self.policy, &l.request))
                        .next()?;
                    Some((key, limits))
                })
                .collect()
        };
        for (key, limits) in needed {
            let _turn = self.daemon_turns.take(&key).await;
            let still_dead = {
                let books = self.books();
                let alive = books
                    .state
                    .daemons
                    .get(&key.dir_name())
                    .is_some_and(|d| d.control.is_alive());
                !alive && books.state.leases_of(&key).next().is_some()
            };
            if !still_dead {
                continue;
            }
            match self.ensure_daemon(&key, limits).await {
                Ok(()) => {
                    let mut books = self.books();
                    if let Some(d) = books.state.daemons.get_mut(&key.dir_name()) {
                        d.idle_since_unix = None;
                    }
                    books.start_failures.remove(&key);
                    self.save_or_log(&mut books, "after a daemon's restart");
                }
                Err(e) => {
                    error!(daemon = %key, error = %e, "restarting the MPS control daemon failed; retrying on the next tick");
                    self.books().note_start_failure(&key, now, &e);
                }
            }
        }
    }

    /// Reports the fatal faults each live daemon's server logged since the last look. The log
    /// is read outside the books.
    fn note_faults(&self, now: i64) {
        let looks: Vec<(String, std::path::PathBuf, u32, fault_watch::LogCursor)> = {
            let books = self.books();
            books
                .state
                .daemons
                .iter()
                .filter(|(_, d)| d.control.is_alive())
                .map(|(dir, d)| {
                    let log = d.log_dir.join(SERVER_LOG);
                    let cursor = books
                        .server_logs
                        .get(dir)
                        .copied()
                        .unwrap_or_else(|| fault_watch::LogCursor::at_end(&log));
                    (dir.clone(), log, d.control.pid, cursor)
                })
                .collect()
        };
        for (dir, log, pid, mut cursor) in looks {
            let pids = fault_watch::fault_pids(&cursor.read_new(&log));
            let mut books = self.books();
            // A daemon replaced meanwhile has its own cursor, set at its start.
            if books.state.daemons.get(&dir).is_none_or(|d| d.control.pid != pid) {
                continue;
            }
            books.server_logs.insert(dir.clone(), cursor);
            if pids.is_empty() {
                continue;
            }
            let key = books.state.daemons[&dir].key.clone();
            let affected: Vec<String> = books.state.leases_of(&key).map(LeaseRecord::owner).collect();
            // MPS names every client it tears down "error trigging" (measured: 4 lines for one
            // illegal memory access among 4 clients), and writes them within milliseconds: the
            // lines of one read (one 1 s tick) are one fault. The faulted containers have often
            // exited by now, so the pids are the record, the leases only who is still there.
            error!(daemon = %key, torn_down_client_pids = ?pids, leases_now = ?affected, "the MPS server reported a fatal GPU fault: MPS tore down every client of this server (one fault domain per GPU; tenancy = \"exclusive\" keeps namespaces apart)");
            self.metrics.server_fault(&key, ServerFault::GpuFault);
            let record = books.state.daemons.get_mut(&dir).expect("checked above");
            record.faults += 1;
            record.last_fault_unix = Some(now);
            self.save_or_log(&mut books, "after a server fault");
        }
    }

    async fn stop_idle_daemons(&self, now: i64) {
        let grace = self.config.daemon.idle_grace_seconds as i64;
        let idle: Vec<(String, DaemonKey)> = self
            .books()
            .state
            .daemons
            .iter()
            .filter(|(_, d)| d.idle_since_unix.is_some_and(|since| now - since >= grace))
            .map(|(dir, d)| (dir.clone(), d.key.clone()))
            .collect();
        for (dir, key) in idle {
            self.stop_if_idle(&dir, &key, now, grace).await;
        }
    }
}
