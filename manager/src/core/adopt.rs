//! At start: the leases and daemons of the previous run adopted where they still live, and
//! their gates served again. Runs before the manager takes requests.

use std::collections::HashMap;
use std::os::fd::OwnedFd;

use gpu_mps_api::node_config::NodeConfig;
use gpu_mps_api::{ContainerId, DaemonKey};
use tracing::{error, info, warn};

use super::{gate_target, now_unix};
use crate::gate::daemon_admission::WedgeReport;
use crate::gate::{self, Gates, ListenerStore};
use crate::lease::LeaseRecord;
use crate::mps_control::{self, MpsControl};
use crate::process_identity::ProcessIdentity;
use crate::state::{DaemonRecord, State};

/// After a restart: serve the gates of the adopted leases again, on the listening sockets the
/// gate keeper held through the restart where it has them (the connections made meanwhile wait
/// on those), else on a socket bound in place; remove gate dirs no lease owns that a previous
/// manager served, and let the keeper drop their sockets.
pub(super) fn reopen_gates(
    config: &NodeConfig,
    state: &State,
    gates: &Gates,
    mut inherited: HashMap<String, OwnedFd>,
    store: Option<&dyn ListenerStore>,
    mut running: HashMap<String, Vec<ProcessIdentity>>,
) {
    let kept: std::collections::HashSet<String> = state
        .leases
        .keys()
        .filter_map(|id| ContainerId::parse(id).ok())
        .map(|id| id.gate_name())
        .collect();
    gate::remove_stale_gate_dirs(
        &config.gates_root(),
        super::unserved_gate_dir_age(config),
        gate::StaleGateDirs::ServedOrOld,
        |name| kept.contains(name),
    );
    for lease in state.leases.values() {
        let Ok(id) = ContainerId::parse(&lease.container_id) else {
            continue;
        };
        let mut target = gate_target(config, &id, lease);
        target.running = running.remove(&lease.container_id).unwrap_or_default();
        if !target.gate_dir.is_dir() {
            // Started by a gpu-mps before gates under every policy (docs/adr/0006): it reaches
            // the daemon's pipe dir directly until it is restarted.
            warn!(container = %id, "adopted lease has no gate dir (started by an older gpu-mps); its CUDA processes reach the daemon's pipe dir directly until it is restarted");
            continue;
        }
        let socket = inherited.remove(&id.gate_name());
        if let Err(e) = gates.open(target, socket) {
            error!(container = %id, error = %e, "cannot re-open the gate of an adopted lease; its new CUDA processes cannot connect");
        }
    }
    for (name, socket) in inherited {
        drop(socket);
        if let Some(store) = store {
            if let Err(e) = store.forget(&name) {
                warn!(gate = %name, error = %e, "the gate keeper did not drop the socket of a gate of no lease");
            }
        }
    }
}

/// After a restart: which container each CUDA process on the servers belongs to, by container
/// id. A gate counts a container's processes as they connect; a new manager would otherwise
/// forget the ones already running and let the container start more than it may. MPS lists
/// its clients by host pid; a process is the container's when it is in its init's cgroup.
pub(super) async fn running_clients_by_container(
    control: &dyn MpsControl,
    state: &State,
) -> HashMap<String, Vec<ProcessIdentity>> {
    let mut found: HashMap<String, Vec<ProcessIdentity>> = HashMap::new();
    for daemon in state.daemons.values() {
        let leases: Vec<(&LeaseRecord, String)> = state
            .leases_of(&daemon.key)
            .filter_map(|l| {
                let init = l.process?;
                Some((l, crate::process_identity::cgroup_of(init.pid)?))
            })
            .collect();
        if leases.is_empty() {
            continue;
        }
        let servers = mps_control::server_pids(control, &daemon.pipe_dir)
            .await
            .unwrap_or_default();
        for server in servers {
            let clients = mps_control::client_pids(control, &daemon.pipe_dir, server)
                .await
                .unwrap_or_default();
            for pid in clients {
                let (Some(identity), Some(cgroup)) =
                    (ProcessIdentity::of(pid), crate::process_identity::cgroup_of(pid))
                else {
                    continue;
                };
                match leases
                    .iter()
                    .find(|(_, init)| crate::process_identity::in_cgroup_of(&cgroup, init))
                {
                    Some((lease, _)) => found
                        .entry(lease.container_id.clone())
                        .or_default()
                        .push(identity),
                    None => {
                        warn!(daemon = %daemon.key, client_pid = pid, "an MPS client of no gated container (a process outside gpu-mps, or started before gates)")
                    }
                }
            }
        }
    }
    for (container, processes) in &found {
        info!(container = %container, pids = ?processes.iter().map(|p| p.pid).collect::<Vec<_>>(), "CUDA processes found on the server count against the container's cuda-processes");
    }
    found
}

/// The state file was unusable or missing at start: the leases come back from their own files
/// (crate::lease_files), and each daemon they name gets a record from its pipe dir's pid file.
/// [`adopt`] then treats them as it treats a saved state: a lease whose container is gone is
/// dropped, a daemon that answers is adopted, a dead one is started again for its leases.
pub(super) fn rebuild_from_lease_files(config: &NodeConfig, state: &mut State) {
    let dir = config.lease_files_dir();
    let (leases, notes) = crate::lease_files::read_all(&dir);
    for note in notes {
        warn!("{note}");
    }
    if leases.is_empty() {
        return;
    }
    let count = leases.len();
    for lease in leases {
        state
            .daemons
            .entry(lease.request.key.dir_name())
            .or_insert_with(|| daemon_from_pid_file(config, &lease.request.key));
        state.leases.insert(lease.container_id.clone(), lease);
    }
    warn!(leases = count, daemons = state.daemons.len(), dir = %dir.display(), "leases rebuilt from their files; the containers still running keep theirs");
}

/// What the pipe dir of `key` says of its daemon: the process its pid file names when that still
/// serves the pipe dir, else a record of no process (so [`adopt`] sees it gone).
fn daemon_from_pid_file(config: &NodeConfig, key: &DaemonKey) -> DaemonRecord {
    let pipe_dir = config.pipe_dir(key);
    let control = mps_control::read_pid_file(&pipe_dir)
        .and_then(ProcessIdentity::of)
        .filter(|p| crate::mps_server_processes::serves_pipe_dir(p.pid, &pipe_dir))
        .unwrap_or(ProcessIdentity {
            pid: 0,
            start_ticks: 0,
        });
    DaemonRecord {
        key: key.clone(),
        control,
        pipe_dir,
        log_dir: config.log_dir(key),
        started_unix: now_unix(),
        applied: None,
        idle_since_unix: None,
        faults: 0,
        last_fault_unix: None,
    }
}

/// After a manager restart: keep leases whose container still runs, and the daemons they or
/// anything else still need. A daemon that runs but does not answer is kept and returned: its
/// server is stuck (measured on the H200: a manager killed while it relayed a channel leaves
/// one), and the first reconcile replaces it. A dead daemon is kept while leases use it, so
/// the reconcile starts it again with their limits; without leases it is dropped, and a server
/// it left behind is killed.
pub(super) async fn adopt(state: &mut State, control: &dyn MpsControl) -> Vec<WedgeReport> {
    let leases = std::mem::take(&mut state.leases);
    for (id, lease) in leases {
        if lease.process.is_none() || lease.container_alive() {
            info!(container = %id, daemon = %lease.request.key, "adopted lease");
            state.leases.insert(id, lease);
        } else {
            warn!(container = %id, "container of a lease is gone; lease dropped");
        }
    }
    let mut stuck = Vec::new();
    let daemons = std::mem::take(&mut state.daemons);
    for (dir, record) in daemons {
        let leases = state.leases_of(&record.key).count();
        if record.control.is_alive() {
            // Asked twice, as a gate does before it takes a server as stuck: replacing it ends
            // its running clients.
            let mut answer = control.command(&record.pipe_dir, "get_server_list").await;
            if answer.is_err() {
                answer = control.command(&record.pipe_dir, "get_server_list").await;
            }
            match answer {
                Ok(_) => {
                    info!(daemon = %record.key, pid = record.control.pid, applied = ?record.applied, "adopted running MPS control daemon");
                }
                Err(e) => {
                    error!(daemon = %record.key, pid = record.control.pid, leases, error = %e, "the MPS control daemon of the previous run runs but does not answer; its server is taken as stuck and replaced");
                    stuck.push(WedgeReport {
                        daemon: record.key.clone(),
                        suspect: None,
                        detail: format!("no answer to get_server_list when the manager started: {e}"),
                    });
                }
            }
            state.daemons.insert(dir, record);
        } else if leases > 0 {
            warn!(daemon = %record.key, pid = record.control.pid, leases, "MPS control daemon of the previous run is gone; its leases' containers still run, so it is started again");
            state.daemons.insert(dir, record);
        } else {
            let killed = crate::mps_server_processes::kill_orphaned_servers(&record.pipe_dir);
            warn!(daemon = %record.key, pid = record.control.pid, killed_orphaned_servers = ?killed, "MPS control daemon of the previous run is gone");
        }
    }
    let keys: Vec<DaemonKey> = state.daemons.values().map(|d| d.key.clone()).collect();
    for key in keys {
        mark_idle_if_unused(state, &key);
    }
    stuck
}

/// The books do this for a running manager; at start there are no pending leases.
fn mark_idle_if_unused(state: &mut State, key: &DaemonKey) {
    if state.leases_of(key).next().is_none() {
        if let Some(d) = state.daemons.get_mut(&key.dir_name()) {
            d.idle_since_unix = Some(now_unix());
        }
    }
}
