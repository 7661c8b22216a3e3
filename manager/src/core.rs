//! The manager's behaviour: leases, daemons, limits, idle shutdown and restart adoption.
//! Side effects go through `MpsControl` and `GpuBackend`, so this is tested without a GPU.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use gpu_mps_api::files::{self, Durability, FileMode};
use gpu_mps_api::inventory::Inventory;
use gpu_mps_api::node_config::{NodeConfig, PublishedConfig};
use gpu_mps_api::proto;
use gpu_mps_api::{ContainerId, DaemonKey, Limits};
use thiserror::Error;
use tokio::sync::Mutex;
use tracing::{error, info, warn};

use crate::admission::{self, AdmissionPolicy, LeaseRequest, Refusal};
use crate::compute_mode;
use crate::fault_watch::{self, LogCursor};
use crate::gate::daemon_admission::WedgeReport;
use crate::gate::{self, GateBounds, GateError, GateTarget, GateTimings, Gates, ListenerStore};
use crate::gpu_backend::{GpuBackend, GpuBackendError};
use crate::lease::LeaseRecord;
use crate::mps_control::{self, ControlError, MpsControl};
use crate::process_identity::ProcessIdentity;
use crate::state::{DaemonRecord, State, StateError};

#[derive(Debug, Error)]
pub enum ManagerError {
    #[error("{0}")]
    Refused(#[from] Refusal),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("{0}")]
    ConfigChanged(String),
    #[error("{0}")]
    Control(#[from] ControlError),
    #[error("{0}")]
    State(#[from] StateError),
    #[error("{0}")]
    Gpu(#[from] GpuBackendError),
    #[error("{0}")]
    ComputeMode(#[from] compute_mode::EnforceError),
    #[error("{0}")]
    Gate(#[from] GateError),
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
}

impl ManagerError {
    pub fn code(&self) -> ttrpc::Code {
        match self {
            ManagerError::Refused(r) => r.code(),
            ManagerError::InvalidRequest(_) => ttrpc::Code::INVALID_ARGUMENT,
            ManagerError::ConfigChanged(_) => ttrpc::Code::FAILED_PRECONDITION,
            ManagerError::Control(_) => ttrpc::Code::UNAVAILABLE,
            _ => ttrpc::Code::INTERNAL,
        }
    }
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> ManagerError {
    let context = context.into();
    move |source| ManagerError::Io { context, source }
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

struct Inner {
    state: State,
    inventory: Inventory,
    /// Where each daemon's server.log was read up to, by daemon dir (not persisted: a restarted
    /// manager starts at the end, the faults before were reported by the one that saw them).
    server_logs: HashMap<String, LogCursor>,
    /// What the last compute mode check found out of order, by GPU: logged once per change.
    compute_mode_drift: HashMap<String, String>,
    /// Leases whose container process was first seen gone, and when (unix seconds).
    lease_gone_since: HashMap<String, i64>,
    /// Daemons found stuck outside a gate (at adoption): replaced at the next reconcile.
    stuck_daemons: Vec<WedgeReport>,
    /// The last failed start of each daemon, when (unix seconds) and why: its GPUs report
    /// unhealthy for a while after it, unless a daemon of that key runs by then.
    start_failures: HashMap<DaemonKey, (i64, String)>,
}

/// How long a GPU reports unhealthy after its daemon failed to start. Short: the device plugin
/// turns the GPU's units Unhealthy meanwhile, so no new container comes to retry the start, and
/// the GPU must come back by itself for the next one to try.
const START_FAILURE_UNHEALTHY_SECONDS: i64 = 15;

/// How long a GPU reports unhealthy after its server's last fatal fault: the server refuses new
/// clients until the faulted ones have exited, which takes the framework seconds.
const FAULT_UNHEALTHY_SECONDS: i64 = 30;

pub struct ManagerCore {
    config: NodeConfig,
    /// Where the config was read from, and its digest then (the shim passes the digest of
    /// the config it laid a container out by).
    config_source: PathBuf,
    config_digest: String,
    policy: AdmissionPolicy,
    control: Arc<dyn MpsControl>,
    backend: Arc<dyn GpuBackend>,
    /// Policy `exact` only: the containers' connect gates.
    gates: Gates,
    inner: Mutex<Inner>,
}

fn gate_timings(config: &NodeConfig) -> GateTimings {
    GateTimings {
        handshake_timeout: std::time::Duration::from_secs(config.gate_handshake_timeout_seconds),
        queue_timeout: std::time::Duration::from_secs(config.gate_queue_timeout_seconds),
    }
}

fn gate_bounds(config: &NodeConfig) -> GateBounds {
    GateBounds {
        per_container: config.gate_connections_per_container,
        node: config.gate_max_connections,
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
        make_dir(&config.root, 0o755)?;
        make_dir(&config.root.join("daemons"), 0o755)?;
        let inventory = backend.inventory()?;
        for g in &inventory.gpus {
            info!(index = g.index, uuid = %g.uuid, name = %g.name, memory = g.memory_bytes, compute_mode = %g.compute_mode, mig = g.mig_enabled, "GPU");
        }
        if inventory.gpus.is_empty() {
            warn!(source = %inventory.source, "no GPU found: every lease will be refused");
        }
        let text = serde_json::to_vec_pretty(&inventory).expect("inventory serializes");
        files::replace_file(
            &config.inventory_path(),
            &text,
            FileMode::Set(0o644),
            Durability::Volatile,
        )
        .map_err(io_err(format!("writing {}", config.inventory_path().display())))?;
        let published = PublishedConfig::new(config.clone(), &options.config_source, std::process::id());
        let text = serde_json::to_vec_pretty(&published).expect("the config serializes");
        files::replace_file(
            &config.published_path(),
            &text,
            FileMode::Set(0o644),
            Durability::Volatile,
        )
        .map_err(io_err(format!("writing {}", config.published_path().display())))?;
        info!(path = %config.published_path().display(), digest = %published.digest, policy = %config.policy, "node config published for gpu-mps-shim");

        let (mut state, state_note) = State::load_or_set_aside(&config.state_path(), now_unix());
        if let Some(note) = state_note {
            warn!("{note}");
        }
        let stuck_daemons = adopt(&mut state, control.as_ref()).await;
        if config.exclusive_process {
            let enforced = compute_mode::enforce_exclusive_process(
                backend.as_ref(),
                &inventory.gpus,
                &mut state.saved_compute_modes,
            );
            // GPUs switched before a failure must still be restored later: their saved modes
            // go to disk before the error ends the start.
            state.save(&config.state_path())?;
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
        state.save(&config.state_path())?;
        let policy = AdmissionPolicy::from(&config);
        let mut gates = Gates::new(control.clone(), gate_timings(&config), gate_bounds(&config));
        if let Some(store) = &options.listener_store {
            gates = gates.with_listener_store(store.clone());
        }
        let running = running_clients_by_container(control.as_ref(), &state).await;
        reopen_gates(
            &config,
            &state,
            &gates,
            options.inherited_gates,
            options.listener_store.as_deref(),
            running,
        );
        let server_logs = state
            .daemons
            .iter()
            .map(|(dir, d)| (dir.clone(), LogCursor::at_end(&d.log_dir.join(SERVER_LOG))))
            .collect();
        let config_digest = config.digest();
        Ok(ManagerCore {
            config,
            config_source: options.config_source,
            config_digest,
            policy,
            control,
            backend,
            gates,
            inner: Mutex::new(Inner {
                state,
                inventory,
                server_logs,
                compute_mode_drift: HashMap::new(),
                lease_gone_since: HashMap::new(),
                stuck_daemons,
                start_failures: HashMap::new(),
            }),
        })
    }

    pub fn config(&self) -> &NodeConfig {
        &self.config
    }

    /// Leases the container's daemon: admission, daemon start on demand, limits set and read
    /// back, lease recorded. Idempotent per container id.
    pub async fn acquire(&self, req: proto::AcquireRequest) -> Result<proto::AcquireResponse, ManagerError> {
        let started = std::time::Instant::now();
        let request = validate(&req)?;
        self.check_layout(&req)?;
        let (maxima, scope) = self.config.maxima_for(&req.namespace);
        let maxima = if req.memory_units.is_empty() {
            maxima
        } else {
            maxima.for_allocated_units()
        };
        maxima
            .check(request.limits, request.cuda_processes, &scope)
            .map_err(|e| {
                warn!(container = %req.container_id, namespace = %req.namespace, pod = %req.pod, limits = %request.limits, cuda_processes = request.cuda_processes, refusal = %e, "lease refused");
                ManagerError::InvalidRequest(e.to_string())
            })?;
        // Under every policy a container reaches MPS only through its gate (docs/adr/0006).
        let gate_id =
            ContainerId::parse(&req.container_id).map_err(|e| ManagerError::InvalidRequest(e.to_string()))?;
        // The hook runs while the container's init process waits in runc: if it is gone, the
        // container is, and a lease without a live process could never be cleaned up.
        let process = ProcessIdentity::of(req.pid);
        if process.is_none() {
            return Err(ManagerError::InvalidRequest(format!(
                "container {} has no running process (pid {})",
                req.container_id, req.pid
            )));
        }
        let mut inner = self.inner.lock().await;
        if let Some(existing) = inner.state.leases.get(&req.container_id).cloned() {
            let same_process = existing.process.is_none() || existing.process == process;
            if same_process
                && existing.key == request.key
                && existing.limits == request.limits
                && existing.cuda_processes == request.cuda_processes
                && existing.memory_units == request.memory_units
            {
                if !self.gates.is_open(&gate_id) {
                    self.gates.open(self.gate_target(&gate_id, &existing), None)?;
                }
                let response = self.response_for(&inner, &existing);
                return Ok(response);
            }
            if same_process || existing.container_alive() {
                return Err(ManagerError::InvalidRequest(format!(
                    "container {} already holds a lease on {} with {} (pid {})",
                    req.container_id,
                    existing.key,
                    existing.limits,
                    existing.process.map_or(0, |p| p.pid)
                )));
            }
            // The id was reused by a new container (its old process is gone, its release was
            // missed): the old lease goes.
            warn!(container = %req.container_id, old_pid = existing.process.map_or(0, |p| p.pid), new_pid = req.pid, "a new container reuses the id of a lease whose process is gone; the old lease is dropped");
            inner.state.leases.remove(&req.container_id);
            mark_idle_if_unused(&mut inner.state, &existing.key);
        }
        // kubelet hands out units once their pod has ended, which can be before the manager has
        // dropped the lease of its container (release grace, a missed poststop): a holder whose
        // process is gone gives its units up now rather than get the new container refused.
        let gone_holders: Vec<LeaseRecord> = inner
            .state
            .leases
            .values()
            .filter(|l| {
                l.key == request.key
                    && request.memory_units.iter().any(|u| l.memory_units.contains(u))
                    && !l.container_alive()
            })
            .cloned()
            .collect();
        for gone in gone_holders {
            warn!(container = %gone.container_id, new_container = %req.container_id, "the units of a lease whose container is gone are given to a new container; the old lease is dropped");
            inner.state.leases.remove(&gone.container_id);
            mark_idle_if_unused(&mut inner.state, &gone.key);
        }
        let live: Vec<&LeaseRecord> = inner.state.leases.values().collect();
        let server_limits = admission::admit(&inner.inventory.gpus, live.iter().copied(), &request, &self.policy)
            .inspect_err(|refusal| {
                warn!(container = %req.container_id, namespace = %req.namespace, pod = %req.pod, gpus = %request.key, limits = %request.limits, %refusal, "lease refused")
            })?;
        let dir = request.key.dir_name();
        // A daemon that cannot start makes its GPUs unhealthy (gpu-mps status, the device
        // plugin) until one starts.
        match self.ensure_daemon(&mut inner, &request.key, server_limits).await {
            Ok(()) => {
                inner.start_failures.remove(&request.key);
            }
            Err(e) => {
                inner.start_failures.insert(
                    request.key.clone(),
                    (now_unix(), gpu_mps_api::message::one_line(&e.to_string())),
                );
                return Err(e);
            }
        }

        let lease = LeaseRecord {
            container_id: req.container_id.clone(),
            key: request.key.clone(),
            limits: request.limits,
            cuda_processes: request.cuda_processes,
            namespace: req.namespace.clone(),
            pod: req.pod.clone(),
            container_name: req.container_name.clone(),
            bundle: req.bundle.clone(),
            process,
            acquired_unix: now_unix(),
            memory_units: request.memory_units.clone(),
        };
        // Before the lease is recorded: a container whose gate cannot open must not start (its
        // CUDA processes would find no control socket).
        self.gates
            .open(self.gate_target(&gate_id, &lease), None)
            .inspect_err(|e| {
                error!(container = %req.container_id, namespace = %req.namespace, pod = %req.pod, error = %e, "lease failed: cannot open the container's gate")
            })?;
        if let Some(d) = inner.state.daemons.get_mut(&dir) {
            d.idle_since_unix = None;
        }
        inner.state.leases.insert(req.container_id.clone(), lease.clone());
        inner.state.save(&self.config.state_path())?;
        let server_limits = server_limits.map_or_else(|| "per client (gate)".to_string(), |l| l.to_string());
        info!(container = %req.container_id, namespace = %req.namespace, pod = %req.pod, gpus = %request.key, limits = %request.limits, cuda_processes = request.cuda_processes, server_limits = %server_limits, elapsed_us = started.elapsed().as_micros() as u64, "lease acquired");
        Ok(self.response_for(&inner, &lease))
    }

    fn gate_target(&self, id: &ContainerId, lease: &LeaseRecord) -> GateTarget {
        gate_target(&self.config, id, lease)
    }

    /// Refuses a container the shim laid out under another node config than the one this
    /// manager runs with (config.toml edited, the manager not restarted).
    fn check_layout(&self, req: &proto::AcquireRequest) -> Result<(), ManagerError> {
        let policy = self.config.policy.to_string();
        let changed = (!req.policy.is_empty() && req.policy != policy)
            || (!req.config_digest.is_empty() && req.config_digest != self.config_digest);
        if changed {
            let message = format!(
                "node config changed since gpu-mps-manager started: restart it (container {} was laid out for policy {} with config {}, the manager runs policy {policy} with config {} from {})",
                req.container_id,
                if req.policy.is_empty() { "?" } else { &req.policy },
                if req.config_digest.is_empty() {
                    "?"
                } else {
                    &req.config_digest
                },
                self.config_digest,
                self.config_source.display()
            );
            warn!(container = %req.container_id, "lease refused: {message}");
            return Err(ManagerError::ConfigChanged(message));
        }
        Ok(())
    }

    /// Starts the daemon if needed and makes its servers enforce `limits`; `None` (policy
    /// `exact`): the gates set them, per client.
    async fn ensure_daemon(
        &self,
        inner: &mut Inner,
        key: &DaemonKey,
        limits: Option<Limits>,
    ) -> Result<(), ManagerError> {
        let dir = key.dir_name();
        let pipe_dir = self.config.pipe_dir(key);
        let log_dir = self.config.log_dir(key);
        let alive = inner
            .state
            .daemons
            .get(&dir)
            .is_some_and(|d| d.control.is_alive());
        if !alive {
            // A GPU's fault count outlives the daemon process: a stuck server is replaced, and
            // `gpu-mps status` must still show that it happened.
            let mut history = (0, None);
            if let Some(dead) = inner.state.daemons.remove(&dir) {
                warn!(daemon = %key, pid = dead.control.pid, "MPS control daemon is gone; starting a new one");
                history = (dead.faults, dead.last_fault_unix);
            }
            make_dir(&self.config.daemon_dir(key), 0o755)?;
            make_dir(&pipe_dir, 0o755)?;
            make_dir(&log_dir, 0o755)?;
            let control = self
                .start_or_adopt(key, &pipe_dir, &log_dir)
                .await
                .inspect_err(|e| error!(daemon = %key, error = %e, "cannot start the MPS control daemon"))?;
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
            inner
                .server_logs
                .insert(dir.clone(), LogCursor::at_end(&log_dir.join(SERVER_LOG)));
            inner.state.daemons.insert(
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
                    faults: history.0,
                    last_fault_unix: history.1,
                },
            );

            inner.state.save(&self.config.state_path())?;
        }
        let record = inner.state.daemons.get_mut(&dir).expect("daemon record present");
        let Some(limits) = limits else {
            return Ok(());
        };
        if record.applied != Some(limits) {
            let servers = mps_control::apply_limits_everywhere(
                self.control.as_ref(),
                &pipe_dir,
                limits,
                key.gpu_uuids().len(),
            )
            .await
            .inspect_err(|e| error!(daemon = %key, limits = %limits, error = %e, "setting limits failed"))?;
            info!(daemon = %key, limits = %limits, servers = ?servers, "server limits set and read back");
            record.applied = Some(limits);
        }
        Ok(())
    }

    /// Starts the daemon of `key`, unless one the state does not know (state file lost, manager
    /// crashed mid-start) still owns the pipe dir and answers: that one is adopted rather than
    /// doubled. One that owns it but no longer answers is stopped first: two daemons must never
    /// share a pipe dir.
    async fn start_or_adopt(
        &self,
        key: &DaemonKey,
        pipe_dir: &Path,
        log_dir: &Path,
    ) -> Result<ProcessIdentity, ManagerError> {
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
                return Ok(identity);
            }
            warn!(daemon = %key, pid = identity.pid, "an MPS control daemon owns the pipe dir but does not answer; stopping it");
            identity.terminate(std::time::Duration::from_secs(2)).await;
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
        Ok(identity)
    }

    /// Drops a container's lease. Unknown containers are not an error (release is retried by
    /// runc on delete, and the reconciler may have dropped it already).
    pub async fn release(&self, container_id: &str) -> Result<bool, ManagerError> {
        let started = std::time::Instant::now();
        let mut inner = self.inner.lock().await;
        if let Ok(id) = ContainerId::parse(container_id) {
            // Also when no gate is open: the shim made the dir, and the Acquire may have failed.
            self.gates.close(&id, &self.config.gate_dir(&id));
        }
        let Some(lease) = inner.state.leases.remove(container_id) else {
            return Ok(false);
        };
        mark_idle_if_unused(&mut inner.state, &lease.key);
        inner.state.save(&self.config.state_path())?;
        info!(container = %container_id, daemon = %lease.key, elapsed_us = started.elapsed().as_micros() as u64, "lease released");
        Ok(true)
    }

    /// A snapshot taken under the lock; the MPS and NVML queries run after it is released, so
    /// `gpu-mps status` never delays a container start.
    pub async fn status(&self) -> proto::StatusResponse {
        let inner = self.inner.lock().await;
        let mut resp = proto::StatusResponse::new();
        resp.policy = self.config.policy.to_string();
        resp.tenancy = self.config.tenancy.to_string();
        resp.manager_version = env!("CARGO_PKG_VERSION").to_string();
        resp.config_digest = self.config_digest.clone();
        resp.config_source = self.config_source.display().to_string();
        for g in &inner.inventory.gpus {
            let on_gpu: Vec<&LeaseRecord> = inner
                .state
                .leases
                .values()
                .filter(|l| l.key.contains(&g.uuid))
                .collect();
            let mut gpu = proto::Gpu::new();
            gpu.index = g.index;
            gpu.uuid = g.uuid.clone();
            gpu.name = g.name.clone();
            gpu.memory_bytes = g.memory_bytes;
            gpu.leases = on_gpu.len() as u32;
            gpu.memory_reserved_bytes = on_gpu.iter().map(|l| l.limits.effective_memory_bytes()).sum();
            gpu.memory_capacity_bytes = admission::memory_capacity(g.memory_bytes, self.config.overcommit);
            gpu.max_clients = self.config.max_clients_per_gpu;
            gpu.compute_mode = g.compute_mode.clone();
            gpu.unhealthy_reason = unhealthy_reason(&inner, &g.uuid, now_unix());
            resp.gpus.push(gpu);
        }
        for d in inner.state.daemons.values() {
            resp.daemons
                .push(daemon_proto(d, inner.state.leases_of(&d.key).count()));
        }
        resp.leases = inner.state.leases.values().map(lease_proto).collect();
        drop(inner);
        for lease in &mut resp.leases {
            let Some(view) = ContainerId::parse(&lease.container_id)
                .ok()
                .and_then(|id| self.gates.view(&id))
            else {
                continue;
            };
            lease.admitted_pids = view.admitted_pids;
            lease.refusals = view.refusals;
            lease.last_refusal = view.last_refusal;
            lease.gate_connections = view.connections;
        }
        resp.config_note = config_note(&self.config_source, &self.config);
        for gpu in &mut resp.gpus {
            if let Ok(mode) = self.backend.compute_mode(&gpu.uuid) {
                gpu.compute_mode = mode;
            }
        }
        for daemon in &mut resp.daemons {
            let pipe_dir = Path::new(&daemon.pipe_dir);
            daemon.server_pids = mps_control::server_pids(self.control.as_ref(), pipe_dir)
                .await
                .unwrap_or_default();
        }
        resp
    }

    /// Periodic housekeeping: drops leases of containers whose process is gone, notices dead
    /// daemons, and stops daemons idle for longer than the grace period.
    pub async fn reconcile(&self, now: i64) {
        let mut inner = self.inner.lock().await;
        if self.config.exclusive_process {
            self.reassert_exclusive_process(&mut inner);
        }
        let mut changed = false;
        let stuck = std::mem::take(&mut inner.stuck_daemons);
        for report in stuck.into_iter().chain(self.gates.take_wedge_reports()) {
            self.recover_stuck_server(&mut inner, &report, now);
            changed = true;
        }
        let gone: Vec<LeaseRecord> = inner
            .state
            .leases
            .values()
            .filter(|l| l.process.is_some() && !l.container_alive())
            .cloned()
            .collect();
        let gone_now: HashMap<String, i64> = gone
            .iter()
            .map(|l| {
                let since = inner.lease_gone_since.get(&l.container_id).copied();
                (l.container_id.clone(), since.unwrap_or(now))
            })
            .collect();
        inner.lease_gone_since = gone_now;
        for lease in gone {
            // The poststop hook releases a lease just after its container's process exits, and
            // the tick often falls in between (measured on the H200: a WARN for a clean exit).
            // Only a lease that outlives that is the hook's miss.
            let since = inner.lease_gone_since[&lease.container_id];
            if now - since < LEASE_RELEASE_GRACE_S {
                continue;
            }
            inner.lease_gone_since.remove(&lease.container_id);
            warn!(container = %lease.container_id, pod = %lease.pod, namespace = %lease.namespace, gone_for_s = now - since, "container process is gone and no release came (poststop hook missed?); lease dropped");
            inner.state.leases.remove(&lease.container_id);
            if let Ok(id) = ContainerId::parse(&lease.container_id) {
                self.gates.close(&id, &self.config.gate_dir(&id));
            }
            mark_idle_if_unused(&mut inner.state, &lease.key);
            changed = true;
        }
        let dirs: Vec<String> = inner.state.daemons.keys().cloned().collect();
        for dir in dirs {
            let record = inner.state.daemons[&dir].clone();
            if !record.control.is_alive() {
                changed = true;
                let lease_limits = inner
                    .state
                    .leases_of(&record.key)
                    .map(LeaseRecord::process_limits)
                    .next();
                let Some(lease_limits) = lease_limits else {
                    warn!(daemon = %record.key, pid = record.control.pid, "idle MPS control daemon died");
                    inner.state.daemons.remove(&dir);
                    continue;
                };
                // Running containers reach MPS through this daemon's pipe dir: without it, a CUDA
                // process that starts now would open a direct context (the whole GPU) unless
                // EXCLUSIVE_PROCESS is on. Bring it back with the limits its leases were given.
                error!(daemon = %record.key, pid = record.control.pid, leases = inner.state.leases_of(&record.key).count(), "MPS control daemon died while containers use it; restarting it");
                let limits = admission::server_limits(&self.policy, lease_limits);
                match self.ensure_daemon(&mut inner, &record.key, limits).await {
                    Ok(()) => {
                        if let Some(d) = inner.state.daemons.get_mut(&dir) {
                            d.idle_since_unix = None;
                        }
                    }
                    Err(e) => {
                        error!(daemon = %record.key, error = %e, "restarting the MPS control daemon failed; retrying")
                    }
                }
                continue;
            }
            if self.note_faults(&mut inner, &dir, now) {
                changed = true;
            }
            let Some(idle_since) = record.idle_since_unix else {
                continue;
            };
            if now - idle_since < self.config.idle_grace_seconds as i64 {
                continue;
            }
            let stopped = self.stop_daemon(&record).await.unwrap_or_else(|e| {
                error!(daemon = %record.key, error = %e, "stopping idle daemon failed");
                false
            });
            if stopped {
                inner.state.daemons.remove(&dir);
            } else if let Some(d) = inner.state.daemons.get_mut(&dir) {
                // Try again after another grace period, not on every tick.
                d.idle_since_unix = Some(now);
            }
            changed = true;
        }
        if changed {
            if let Err(e) = inner.state.save(&self.config.state_path()) {
                error!(error = %e, "saving state failed");
            }
        }
    }

    /// A daemon whose server stopped taking clients (docs/gpu-results.md section 7: a process took
    /// its channel and did not act as a CUDA client; the server then takes no new client, `quit`
    /// hangs, and only killing it helps). Its server and daemon are killed, which ends the
    /// server's running clients as MPS's own fault handling would; the daemon is started again
    /// below, on this tick, for the leases; the container whose process got the last channel
    /// before it stopped answering is refused from now on, so that it cannot do it again.
    fn recover_stuck_server(&self, inner: &mut Inner, report: &WedgeReport, now: i64) {
        let Some(dir) = inner
            .state
            .daemons
            .iter()
            .find(|(_, d)| d.key.to_string() == report.daemon)
            .map(|(dir, _)| dir.clone())
        else {
            return;
        };
        let leases: Vec<String> = inner
            .state
            .leases_of(&inner.state.daemons[&dir].key)
            .map(LeaseRecord::owner)
            .collect();
        let record = inner.state.daemons.get_mut(&dir).expect("found above");
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
        record.faults += 1;
        record.last_fault_unix = Some(now);
    }

    /// EXCLUSIVE_PROCESS is checked on every tick, not only at start: a mode changed behind the
    /// manager's back would let a process that misses MPS take the whole GPU.
    fn reassert_exclusive_process(&self, inner: &mut Inner) {
        let drifts = compute_mode::reassert_exclusive_process(self.backend.as_ref(), &inner.inventory.gpus);
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
            if inner.compute_mode_drift.get(&d.uuid) != Some(&line) {
                error!(gpu = %d.uuid, found = %found, action = %reset, "compute mode is not EXCLUSIVE_PROCESS (changed behind gpu-mps-manager's back?): a process that misses MPS could take the whole GPU");
            }
            seen.insert(d.uuid, line);
        }
        for uuid in inner.compute_mode_drift.keys() {
            if !seen.contains_key(uuid) {
                info!(gpu = %uuid, "compute mode is EXCLUSIVE_PROCESS again");
            }
        }
        inner.compute_mode_drift = seen;
    }

    /// Reports the fatal faults the daemon's server logged since the last look. True if any.
    fn note_faults(&self, inner: &mut Inner, dir: &str, now: i64) -> bool {
        let Some(record) = inner.state.daemons.get(dir) else {
            return false;
        };
        let log = record.log_dir.join(SERVER_LOG);
        let cursor = inner
            .server_logs
            .entry(dir.to_string())
            .or_insert_with(|| LogCursor::at_end(&log));
        let pids = fault_watch::fault_pids(&cursor.read_new(&log));
        if pids.is_empty() {
            return false;
        }
        let affected: Vec<String> = inner
            .state
            .leases_of(&record.key)
            .map(LeaseRecord::owner)
            .collect();
        // MPS names every client it tears down "error trigging" (measured: 4 lines for one illegal
        // memory access among 4 clients), and writes them within milliseconds: the lines of one
        // read (one 1 s tick) are one fault. The faulted containers have often exited by now, so
        // the pids are the record, the leases only who is still there.
        error!(daemon = %record.key, torn_down_client_pids = ?pids, leases_now = ?affected, "the MPS server reported a fatal GPU fault: MPS tore down every client of this server (one fault domain per GPU; tenancy = \"exclusive\" keeps namespaces apart)");
        let record = inner.state.daemons.get_mut(dir).expect("checked above");
        record.faults += 1;
        record.last_fault_unix = Some(now);
        true
    }

    /// Quits an idle daemon unless MPS still reports clients on it (a container gpu-mps does
    /// not know about, e.g. one started while the manager was down): those are never killed.
    async fn stop_daemon(&self, record: &DaemonRecord) -> Result<bool, ManagerError> {
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

    /// Called on SIGTERM. Idle daemons are stopped. Daemons with leases keep running, and so
    /// does EXCLUSIVE_PROCESS: the next manager adopts them (an upgrade must not break pods).
    /// With no lease left, the compute mode is restored.
    pub async fn shutdown(&self) {
        self.gates.drain(SHUTDOWN_DRAIN).await;
        let mut inner = self.inner.lock().await;
        let dirs: Vec<String> = inner.state.daemons.keys().cloned().collect();
        for dir in dirs {
            let record = inner.state.daemons[&dir].clone();
            if inner.state.leases_of(&record.key).count() > 0 {
                info!(daemon = %record.key, "daemon has leases; left running for the next manager");
                continue;
            }
            match self.stop_daemon(&record).await {
                Ok(true) => {
                    inner.state.daemons.remove(&dir);
                }
                Ok(false) => {}
                Err(e) => warn!(daemon = %record.key, error = %e, "could not stop daemon at shutdown"),
            }
        }
        if inner.state.leases.is_empty() {
            for (uuid, e) in compute_mode::restore_compute_modes(
                self.backend.as_ref(),
                &mut inner.state.saved_compute_modes,
            ) {
                error!(gpu = %uuid, error = %e, "cannot restore the compute mode");
            }
        } else if !inner.state.saved_compute_modes.is_empty() {
            info!(
                leases = inner.state.leases.len(),
                "leases remain: EXCLUSIVE_PROCESS stays until they are gone"
            );
        }
        if let Err(e) = inner.state.save(&self.config.state_path()) {
            error!(error = %e, "saving state at shutdown failed");
        }
    }

    fn response_for(&self, inner: &Inner, lease: &LeaseRecord) -> proto::AcquireResponse {
        let mut resp = proto::AcquireResponse::new();
        resp.lease = Some(lease_proto(lease)).into();
        if let Some(d) = inner.state.daemons.get(&lease.key.dir_name()) {
            resp.daemon = Some(daemon_proto(d, inner.state.leases_of(&lease.key).count())).into();
        }
        resp
    }
}

/// Checks what the hook sent and turns it into an admission request.
fn validate(req: &proto::AcquireRequest) -> Result<LeaseRequest, ManagerError> {
    let bad = |m: String| Err(ManagerError::InvalidRequest(m));
    if req.container_id.is_empty() {
        return bad("container_id is empty".into());
    }
    if req.gpu_uuids.is_empty() {
        return bad("no GPU in the request".into());
    }
    let limits = Limits::checked(req.memory_limit_bytes, req.active_thread_percentage)
        .map_err(|e| ManagerError::InvalidRequest(e.to_string()))?;
    // 0 is what the hook of an older shim sends: one process.
    let cuda_processes = req.cuda_processes.max(1);
    if cuda_processes > gpu_mps_api::limits::MAX_CUDA_PROCESSES {
        return bad(format!(
            "cuda_processes {cuda_processes} is out of range: expected 1 to {}",
            gpu_mps_api::limits::MAX_CUDA_PROCESSES
        ));
    }
    Ok(LeaseRequest {
        key: DaemonKey::new(req.gpu_uuids.iter().cloned()),
        limits,
        cuda_processes,
        namespace: req.namespace.clone(),
        memory_units: req.memory_units.clone(),
    })
}

fn mark_idle_if_unused(state: &mut State, key: &DaemonKey) {
    if state.leases_of(key).count() == 0 {
        if let Some(d) = state.daemons.get_mut(&key.dir_name()) {
            d.idle_since_unix = Some(now_unix());
        }
    }
}

fn gate_target(config: &NodeConfig, id: &ContainerId, lease: &LeaseRecord) -> GateTarget {
    GateTarget {
        container: id.clone(),
        gate_dir: config.gate_dir(id),
        daemon: lease.key.clone(),
        daemon_pipe_dir: config.pipe_dir(&lease.key),
        limits: lease.limits,
        cuda_processes: lease.cuda_processes,
        server_class: Some(
            admission::server_limits(&AdmissionPolicy::from(config), lease.process_limits())
                .unwrap_or_else(|| lease.process_limits()),
        ),
        running: Vec::new(),
        owner: lease.owner(),
    }
}

/// After a restart: serve the gates of the adopted leases again, on the listening sockets the
/// gate keeper held through the restart where it has them (the connections made meanwhile wait
/// on those), else on a socket bound in place; remove gate dirs no lease owns that a previous
/// manager served, and let the keeper drop their sockets.
fn reopen_gates(
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
    gate::remove_stale_gate_dirs(&config.gates_root(), |name| kept.contains(name));
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
async fn running_clients_by_container(
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

/// After a manager restart: keep leases whose container still runs, and the daemons they or
/// anything else still need. A daemon that runs but does not answer is kept and returned: its
/// server is stuck (measured on the H200: a manager killed while it relayed a channel leaves
/// one), and the first reconcile replaces it. A dead daemon is kept while leases use it, so
/// the reconcile starts it again with their limits; without leases it is dropped, and a server
/// it left behind is killed.
async fn adopt(state: &mut State, control: &dyn MpsControl) -> Vec<WedgeReport> {
    let leases = std::mem::take(&mut state.leases);
    for (id, lease) in leases {
        if lease.process.is_none() || lease.container_alive() {
            info!(container = %id, daemon = %lease.key, "adopted lease");
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
                        daemon: record.key.to_string(),
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

fn daemon_proto(d: &DaemonRecord, leases: usize) -> proto::Daemon {
    let mut daemon = proto::Daemon::new();
    daemon.key = d.key.dir_name();
    daemon.gpu_uuids = d.key.gpu_uuids().to_vec();
    daemon.pipe_dir = d.pipe_dir.display().to_string();
    daemon.control_pid = d.control.pid;
    if let Some(l) = d.applied {
        daemon.memory_limit_bytes = l.memory_bytes;
        daemon.active_thread_percentage = u32::from(l.thread_percentage);
    }
    daemon.leases = leases as u32;
    daemon.state = if d.idle_since_unix.is_some() {
        "idle"
    } else {
        "running"
    }
    .into();
    daemon.idle_since_unix = d.idle_since_unix.unwrap_or(0);
    daemon.started_unix = d.started_unix;
    daemon.faults = d.faults;
    daemon.last_fault_unix = d.last_fault_unix.unwrap_or(0);
    daemon
}

/// Why `gpu` cannot take new containers now, or empty.
fn unhealthy_reason(inner: &Inner, gpu: &str, now: i64) -> String {
    for (key, (at, error)) in &inner.start_failures {
        let running = inner
            .state
            .daemons
            .get(&key.dir_name())
            .is_some_and(|d| d.control.is_alive());
        if key.contains(gpu) && now - at < START_FAILURE_UNHEALTHY_SECONDS && !running {
            return format!("its MPS daemon could not start {}s ago: {error}", now - at);
        }
    }
    for d in inner.state.daemons.values().filter(|d| d.key.contains(gpu)) {
        if let Some(at) = d.last_fault_unix.filter(|at| now - at < FAULT_UNHEALTHY_SECONDS) {
            return format!("its MPS server reported a fatal fault {}s ago", now - at);
        }
    }
    String::new()
}

fn lease_proto(l: &LeaseRecord) -> proto::Lease {
    let mut lease = proto::Lease::new();
    lease.container_id = l.container_id.clone();
    lease.daemon = l.key.dir_name();
    lease.gpu_uuids = l.key.gpu_uuids().to_vec();
    lease.memory_limit_bytes = l.limits.memory_bytes;
    lease.active_thread_percentage = u32::from(l.limits.thread_percentage);
    lease.namespace = l.namespace.clone();
    lease.pod = l.pod.clone();
    lease.container_name = l.container_name.clone();
    lease.pid = l.process.map(|p| p.pid).unwrap_or(0);
    lease.acquired_unix = l.acquired_unix;
    lease.cuda_processes = l.cuda_processes;
    lease.memory_units = l.memory_units.clone();
    lease
}

/// A warning when the config file no longer says what the manager runs with.
fn config_note(source: &Path, running: &NodeConfig) -> String {
    if source.as_os_str().is_empty() {
        return String::new();
    }
    match NodeConfig::load(source) {
        Ok(now) if &now == running => String::new(),
        Ok(_) => format!(
            "{} has changed since gpu-mps-manager started; it runs with the config it read then (restart it to apply the change)",
            source.display()
        ),
        Err(e) => format!(
            "{} is no longer valid ({e}); gpu-mps-manager runs with the config it read at start",
            source.display()
        ),
    }
}

fn make_dir(path: &Path, mode: u32) -> Result<(), ManagerError> {
    use std::os::unix::fs::PermissionsExt;
    files::create_dirs(path, mode).map_err(io_err(format!("creating {}", path.display())))?;
    // Also when it existed: non-root clients must traverse every directory on the pipe path.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(io_err(format!("setting the mode of {}", path.display())))
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

#[cfg(test)]
mod tests;
