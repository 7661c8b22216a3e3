//! The manager's behaviour: leases, daemons, limits, idle shutdown and restart adoption.
//! Side effects go through `MpsControl` and `GpuBackend`, so this is tested without a GPU.
//!
//! Who owns what (docs/adr/0008-daemon-owners.md):
//! - `books`: the node's bookkeeping (leases, the daemons' book, the state file). One lock for
//!   the node, held only for in-memory changes and the state file's write: never across a call
//!   to a daemon, so a slow or hung daemon never stalls Acquire, Release or status elsewhere.
//! - each daemon's facts (process, limits shown, server.log cursor, failed start, turn) in one
//!   `daemon_life::Daemon`, changed only through its pure `step`; its turn is taken for the slow
//!   work on it (start, stop, replace): a second Acquire for the same daemon waits for the start
//!   in progress; other daemons do not wait.
//! - the daemon's owner task (`gate::daemon_admission`): the one writer of its servers' limits,
//!   under every policy, and the one that tells a stuck server.
//! - `reconciler`: what only the periodic housekeeping remembers.
//!
//! One file per verb: acquire, release, status, reconcile, adopt (at start), shutdown; the
//! daemon lifecycle (start, limits, stop) in daemons.

mod acquire;
mod adopt;
mod daemons;
mod reconcile;
mod release;
mod shutdown;
mod status;

use std::collections::{BTreeMap, HashMap};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex as StdMutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use gpu_mps_api::files::{self, Durability, FileMode};
use gpu_mps_api::inventory::Inventory;
use gpu_mps_api::node_config::{NodeConfig, PublishedConfig};
use gpu_mps_api::{ContainerId, DaemonKey};
use thiserror::Error;
use tracing::{error, info, warn};

use crate::admission::{self, AdmissionPolicy, Refusal};
use crate::compute_mode;
use crate::daemon_life::{DaemonBook, Event, Turn};
use crate::fault_watch::LogCursor;
use crate::gate::{GateBounds, GateError, GateTarget, GateTimings, Gates, ListenerStore};
use crate::gpu_backend::{GpuBackend, GpuBackendError};
use crate::lease::LeaseRecord;
use crate::lease_files::LeaseFiles;
use crate::metrics::{AcquireOutcome, Metrics};
use crate::mps_control::{ControlError, MpsControl};
use crate::state::{State, StateError, StateOnDisk};

#[derive(Debug, Error)]
pub enum ManagerError {
    #[error("{0}")]
    Refused(#[from] Refusal),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("{0}")]
    ConfigChanged(String),
    /// The same container's Acquire is being served already (a retried hook).
    #[error("{0}")]
    InProgress(String),
    #[error("{0}")]
    Control(#[from] ControlError),
    #[error("{0}")]
    State(#[from] StateError),
    #[error("{0}")]
    LeaseFiles(#[from] crate::lease_files::LeaseFilesError),
    /// A lease that could not be written down (a full disk): refused, not run unrecorded.
    #[error("{0}")]
    Unrecorded(String),
    #[error("{0}")]
    Gpu(#[from] GpuBackendError),
    #[error("{0}")]
    ComputeMode(#[from] compute_mode::EnforceError),
    #[error("{0}")]
    Gate(#[from] GateError),
    #[error("{0}")]
    Limits(#[from] crate::gate::daemon_admission::SetLimitsError),
    #[error("{0}")]
    StateRoot(#[from] crate::state_root::StateRootError),
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
}

impl ManagerError {
    /// How an Acquire that ended in this error shows in the metrics: refused for the request
    /// or the node's capacity (with its reason), or failed on the node's side.
    pub fn acquire_outcome(&self) -> AcquireOutcome {
        match self {
            ManagerError::Refused(r) => AcquireOutcome::Refused(r.reason()),
            ManagerError::InvalidRequest(_) => AcquireOutcome::Refused("invalid_request"),
            ManagerError::ConfigChanged(_) => AcquireOutcome::Refused("config_changed"),
            ManagerError::InProgress(_) => AcquireOutcome::Refused("in_progress"),
            _ => AcquireOutcome::Failed,
        }
    }

    pub fn code(&self) -> ttrpc::Code {
        match self {
            ManagerError::Refused(r) => r.code(),
            ManagerError::InvalidRequest(_) => ttrpc::Code::INVALID_ARGUMENT,
            ManagerError::ConfigChanged(_) => ttrpc::Code::FAILED_PRECONDITION,
            ManagerError::Unrecorded(_) => ttrpc::Code::RESOURCE_EXHAUSTED,
            ManagerError::Control(_) | ManagerError::Limits(_) | ManagerError::InProgress(_) => {
                ttrpc::Code::UNAVAILABLE
            }
            _ => ttrpc::Code::INTERNAL,
        }
    }
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> ManagerError {
    let context = context.into();
    move |source| ManagerError::Io { context, source }
}

/// Writes a file the shim reads (the inventory, the published config) unless it already holds
/// `bytes`. A failure (a full /run) is logged, never fatal: a manager that refused to start would
/// strand every GPU pod of the node, and the shim still reads the file of the last run.
fn publish(path: &Path, bytes: &[u8], what: &str) {
    if std::fs::read(path).is_ok_and(|old| old == bytes) {
        return;
    }
    if let Err(e) = files::replace_file(path, bytes, FileMode::Set(0o644), Durability::Volatile) {
        error!(path = %path.display(), error = %e, "cannot write {what} for gpu-mps-shim; it reads the one there is until a restart writes it");
    }
}

/// The state and lease files at start. A failure (a full /run) is logged and returned, never
/// fatal: the reconcile saves again every tick until it succeeds.
fn save_at_start(config: &NodeConfig, state: &State, lease_files: &mut LeaseFiles) -> Option<String> {
    let saved = state
        .save(&config.state_path())
        .map_err(ManagerError::from)
        .and_then(|()| lease_files.sync(&state.leases).map_err(ManagerError::from));
    saved.err().map(|e| {
        let reason = gpu_mps_api::message::one_line(&e.to_string());
        error!(error = %reason, "cannot save the state at start; the manager runs on and saves again every second");
        reason
    })
}

/// The MPS server's log, in the daemon's CUDA_MPS_LOG_DIRECTORY.
const SERVER_LOG: &str = "server.log";
/// How long a lease outlives its container's process before reconcile drops it: the poststop
/// hook's release normally comes within a second of the exit.
const LEASE_RELEASE_GRACE_S: i64 = 5;

pub fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// How long a gate dir nobody serves may wait for its container's Acquire. The shim makes it
/// before runc creates the container; the hook asks (and retries while a manager restarts) for
/// at most its timeout, and then runc kills the container's init, so a later Acquire is refused
/// on its process. Removing it sooner would leave a container that is still to get its lease
/// with a mount of a deleted dir: its CUDA processes would find no control socket.
fn unserved_gate_dir_age(config: &NodeConfig) -> std::time::Duration {
    std::time::Duration::from_secs((2 * config.hook.timeout_seconds).max(20))
}

/// The node's bookkeeping, under one lock that is never held across an await.
struct Books {
    /// The recorded leases, by container id.
    leases: BTreeMap<String, LeaseRecord>,
    /// Compute modes found before the manager set EXCLUSIVE_PROCESS (crate::state::State).
    saved_compute_modes: BTreeMap<String, String>,
    /// Every daemon's facts.
    daemons: DaemonBook,
    /// Leases being acquired (their daemon starting, their limits being set): admission counts
    /// them, so two Acquires in flight never share out the same memory or units, but they
    /// reach the state file only once their daemon and gate are ready.
    pending: BTreeMap<String, LeaseRecord>,
    /// One file per recorded lease, kept in line with `leases` at every save.
    lease_files: LeaseFiles,
    /// Why the last save failed (a full disk), while it stays failed: the reconcile saves
    /// again every tick until one succeeds.
    unsaved: Option<String>,
}

impl Books {
    fn leases_of<'a>(&'a self, key: &'a DaemonKey) -> impl Iterator<Item = &'a LeaseRecord> + 'a {
        self.leases.values().filter(move |l| &l.request.key == key)
    }

    fn pending_of(&self, key: &DaemonKey) -> usize {
        self.pending.values().filter(|l| &l.request.key == key).count()
    }

    /// Whether a lease, recorded or being acquired, uses the daemon of `key`.
    fn in_use(&self, key: &DaemonKey) -> bool {
        self.leases_of(key).next().is_some() || self.pending_of(key) > 0
    }

    /// Marks the daemon idle (its stop then waits for the grace period) once nothing uses it.
    fn mark_idle_if_unused(&mut self, key: &DaemonKey) {
        if !self.in_use(key) {
            self.daemons.of(key).step(Event::Unused { now: now_unix() });
        }
    }

    /// A daemon of `key` failed to start (or to take its limits) at `now`: its GPUs report
    /// unhealthy for a while, with `error` as the reason.
    fn note_start_failure(&mut self, key: &DaemonKey, now: i64, error: &ManagerError) {
        self.daemons
            .of(key)
            .step(Event::StartFailed(crate::daemon_life::StartFailure {
                at_unix: now,
                why: gpu_mps_api::message::one_line(&error.to_string()),
            }));
    }

    /// Writes the state file, then brings the lease files in line with it. A failure is kept
    /// in `unsaved` (the reconcile tries again) and returned.
    fn save(&mut self, path: &Path) -> Result<(), ManagerError> {
        let saved = StateOnDisk::new(self.daemons.records(), &self.leases, &self.saved_compute_modes)
            .save(path)
            .map_err(ManagerError::from)
            .and_then(|()| self.lease_files.sync(&self.leases).map_err(ManagerError::from));
        self.unsaved = saved
            .as_ref()
            .err()
            .map(|e| gpu_mps_api::message::one_line(&e.to_string()));
        saved
    }
}

/// What only the periodic reconcile reads and writes.
#[derive(Default)]
struct ReconcileMemory {
    /// What the last compute mode check found out of order, by GPU: logged once per change.
    compute_mode_drift: HashMap<String, String>,
    /// Leases whose container process was first seen gone, and when (unix seconds).
    lease_gone_since: HashMap<String, i64>,
}

pub struct ManagerCore {
    config: NodeConfig,
    /// Where the config was read from, and its digest then (the shim passes the digest of
    /// the config it laid a container out by).
    config_source: PathBuf,
    config_digest: String,
    policy: AdmissionPolicy,
    control: Arc<dyn MpsControl>,
    backend: Arc<dyn GpuBackend>,
    /// The GPUs found at start; the manager is restarted for a new inventory.
    inventory: Inventory,
    /// Every container's connect gate, and every daemon's owner task.
    gates: Gates,
    books: StdMutex<Books>,
    /// Also keeps two reconciles from overlapping.
    reconciler: tokio::sync::Mutex<ReconcileMemory>,
    /// Where events are recorded (crate::metrics); it holds none of the state above.
    metrics: Metrics,
}

fn gate_timings(config: &NodeConfig) -> GateTimings {
    GateTimings {
        handshake_timeout: std::time::Duration::from_secs(config.gate.handshake_timeout_seconds),
        queue_timeout: std::time::Duration::from_secs(config.gate.queue_timeout_seconds),
    }
}

fn gate_bounds(config: &NodeConfig) -> GateBounds {
    GateBounds {
        per_container: config.gate.connections_per_container,
        node: config.gate.max_connections,
    }
}

/// What the binary hands the core beyond the config: where the config came from, and the gate
/// sockets a previous manager served (from the gate keeper) with where to keep new ones.
#[derive(Default)]
pub struct StartOptions {
    pub config_source: PathBuf,
    /// By gate name ([`ContainerId::gate_name`]).
    pub inherited_gates: HashMap<String, OwnedFd>,
    pub listener_store: Option<Arc<dyn ListenerStore>>,
    /// Where the core and its gates record events; the binary serves it when configured.
    pub metrics: Metrics,
}

/// The server started with every new daemon: measured on the H200, `start_server -uid 0` under
/// `-M` starts a server before any client, which serves clients of every uid. With it the GPU
/// belongs to MPS from the daemon's start: under EXCLUSIVE_PROCESS no direct context can take
/// the GPU before the first client.
const START_SERVER: &str = "start_server -uid 0";

/// How long a stopping manager lets its gates finish the connections in flight (a handshake
/// takes milliseconds; the daemon's answer at most the handshake timeout).
const SHUTDOWN_DRAIN: std::time::Duration = std::time::Duration::from_secs(2);

impl ManagerCore {
    /// [`ManagerCore::start_with`] without gate sockets to inherit or keep.
    pub async fn start(
        config: NodeConfig,
        control: Arc<dyn MpsControl>,
        backend: Arc<dyn GpuBackend>,
    ) -> Result<Self, ManagerError> {
        Self::start_with(config, control, backend, StartOptions::default()).await
    }

    /// Starts the manager's logic: takes the inventory, publishes it and the config for the
    /// shim, loads the state of a previous run and adopts what still lives, serves the gates of
    /// the leases again, and sets EXCLUSIVE_PROCESS if configured. Never touches a running
    /// client.
    pub async fn start_with(
        config: NodeConfig,
        control: Arc<dyn MpsControl>,
        backend: Arc<dyn GpuBackend>,
        options: StartOptions,
    ) -> Result<Self, ManagerError> {
        // Before anything under the root is trusted: what an earlier version left (0755) is
        // narrowed, what others could write is refused (state_root.rs).
        for n in crate::state_root::secure_tree(&config.root)? {
            warn!(path = %n.path.display(), from = format_args!("{:04o}", n.from), to = format_args!("{:04o}", n.to), "narrowed a directory of the state root: host users must reach no gate and no MPS daemon");
        }
        let inventory = backend.inventory()?;
        for g in &inventory.gpus {
            info!(index = g.index, uuid = %g.uuid, name = %g.name, memory = g.memory_bytes, compute_mode = %g.compute_mode, mig = g.mig_enabled, "GPU");
        }
        if inventory.gpus.is_empty() {
            warn!(source = %inventory.source, "no GPU found: every lease will be refused");
        }
        let text = serde_json::to_vec_pretty(&inventory).expect("inventory serializes");
        publish(&config.inventory_path(), &text, "the GPU inventory");
        let published = PublishedConfig::new(config.clone(), &options.config_source, std::process::id());
        let text = serde_json::to_vec_pretty(&published).expect("the config serializes");
        publish(&config.published_path(), &text, "the node config");
        info!(path = %config.published_path().display(), digest = %published.digest, policy = %config.limits.policy, "node config published for gpu-mps-shim");

        let state_existed = config.state_path().exists();
        let (mut state, state_note) = State::load_or_set_aside(&config.state_path(), now_unix());
        if let Some(note) = &state_note {
            warn!("{note}");
        }
        if state_note.is_some() || !state_existed {
            adopt::rebuild_from_lease_files(&config, &mut state);
        }
        let stuck_daemons = adopt::adopt(&mut state, control.as_ref()).await;
        let mut lease_files = LeaseFiles::new(config.lease_files_dir());
        if config.daemon.exclusive_process {
            let enforced = compute_mode::enforce_exclusive_process(
                backend.as_ref(),
                &inventory.gpus,
                &mut state.saved_compute_modes,
            );
            // GPUs switched before a failure must still be restored later: their saved modes
            // go to disk before the error ends the start.
            save_at_start(&config, &state, &mut lease_files);
            for uuid in enforced? {
                info!(gpu = %uuid, "compute mode set to EXCLUSIVE_PROCESS");
            }
        } else if !state.saved_compute_modes.is_empty() {
            // Exclusive mode was switched off in the config since the last run: give the
            // operator's modes back now that nothing asks for it.
            for (uuid, e) in
                compute_mode::restore_compute_modes(backend.as_ref(), &mut state.saved_compute_modes)
            {
                error!(gpu = %uuid, error = %e, "cannot restore the compute mode");
            }
        }
        let unsaved = save_at_start(&config, &state, &mut lease_files);
        for g in &inventory.gpus {
            options.metrics.know_daemon(&DaemonKey::new([g.uuid.clone()]));
        }
        let policy = AdmissionPolicy::from(&config);
        let mut gates = Gates::new(control.clone(), gate_timings(&config), gate_bounds(&config))
            .with_metrics(options.metrics.clone());
        if let Some(store) = &options.listener_store {
            gates = gates.with_listener_store(store.clone());
        }
        for report in stuck_daemons {
            gates.report_stuck(report);
        }
        let running = adopt::running_clients_by_container(control.as_ref(), &state).await;
        adopt::reopen_gates(
            &config,
            &state,
            &gates,
            options.inherited_gates,
            options.listener_store.as_deref(),
            running,
        );
        let daemons = DaemonBook::adopted(std::mem::take(&mut state.daemons).into_values(), |d| {
            LogCursor::at_end(&d.log_dir.join(SERVER_LOG))
        });
        let config_digest = config.digest();
        Ok(ManagerCore {
            config,
            config_source: options.config_source,
            config_digest,
            policy,
            control,
            backend,
            inventory,
            gates,
            books: StdMutex::new(Books {
                leases: state.leases,
                saved_compute_modes: state.saved_compute_modes,
                daemons,
                pending: BTreeMap::new(),
                lease_files,
                unsaved,
            }),
            reconciler: tokio::sync::Mutex::new(ReconcileMemory::default()),
            metrics: options.metrics,
        })
    }

    pub fn config(&self) -> &NodeConfig {
        &self.config
    }

    /// The bookkeeping. A panic elsewhere while it was held leaves it as it was then; the
    /// manager goes on with it rather than refuse every container from then on.
    fn books(&self) -> MutexGuard<'_, Books> {
        self.books.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Takes the daemon's turn, waiting outside the books for whoever holds it.
    async fn take_turn(&self, key: &DaemonKey) -> Turn {
        let turn = self.books().daemons.of(key).turn();
        turn.lock_owned().await
    }

    fn gate_target(&self, id: &ContainerId, lease: &LeaseRecord) -> GateTarget {
        gate_target(&self.config, id, lease)
    }

    /// Saves the state, logging a failure: for the paths that must go on regardless.
    fn save_or_log(&self, books: &mut Books, when: &str) {
        if let Err(e) = books.save(&self.config.state_path()) {
            error!(error = %e, "saving state {when} failed");
        }
    }
}

fn gate_target(config: &NodeConfig, id: &ContainerId, lease: &LeaseRecord) -> GateTarget {
    GateTarget {
        container: id.clone(),
        gate_dir: config.gate_dir(id),
        daemon: lease.request.key.clone(),
        daemon_pipe_dir: config.pipe_dir(&lease.request.key),
        limits: lease.request.limits,
        cuda_processes: lease.request.cuda_processes,
        server_class: Some(admission::server_class(
            &AdmissionPolicy::from(config),
            &lease.request,
        )),
        running: Vec::new(),
        init: lease.process,
        owner: lease.owner(),
    }
}

/// A directory of a daemon (its dir, pipe dir, log dir): 0700, also when it existed. Only the
/// manager's gates reach a daemon; MPS makes its `control` 0666, so this mode is what keeps host
/// users (and their CUDA processes, which would bypass every gate) away from it.
fn make_private_dir(path: &Path) -> Result<(), ManagerError> {
    use std::os::unix::fs::PermissionsExt;
    let mode = files::PRIVATE_DIR_MODE;
    files::create_dir_in_private_parents(path, mode)
        .map_err(io_err(format!("creating {}", path.display())))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(io_err(format!("setting the mode of {}", path.display())))
}

#[cfg(test)]
mod tests;
