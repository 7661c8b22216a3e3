//! The connect gate: the only way a container's processes reach MPS, under every policy
//! (docs/adr/0005, docs/adr/0006).
//!
//! A container's /tmp/nvidia-mps is its own gate dir, holding one `control` socket that the
//! manager serves; the container never sees the daemon's pipe dir (whose `control_privileged`
//! lets a root pod change or quit the daemon, measured). On each connection the gate:
//! 1. answers the daemon's hello itself ([`wire::HELLO`]), so a connection that never speaks
//!    holds no daemon, only one of its own container's connection slots;
//! 2. reads the request and lets through only the measured request of a CUDA client, sent by
//!    the process that connected; a UI session's changes (set, quit, terminate_client) are
//!    answered as MPS answers an unprivileged user, its reads (which list other pods'
//!    processes) and anything else are refused: closed after the request, which a client
//!    reports as an error (measured), never as a fallback to a direct context;
//! 3. counts the container's CUDA processes ([`processes`]), with the clients its GPU's server
//!    lists for it; one beyond its `gpu-mps.io/cuda-processes` is refused the same way;
//! 4. hands the client to its daemon's owner ([`daemon_admission`]), which serves containers in
//!    turn, sets the server's limits to the client's share (policy `exact`) and relays the
//!    request and the daemon's answer, the client's channel to the server. The gate is never on
//!    the data path.
//!
//! Bounds: at most `connections_per_container` connections of a container are open at once
//! (the rest wait in the listen backlog, which costs the manager no descriptor), and at most
//! `max_connections` on the node. The listening sockets are also held by the gate keeper
//! (the gate keeper, crate gpu-mps-gate-keeper), so a connection made while the manager restarts waits in the backlog
//! for the next manager.

pub mod daemon_admission;
pub mod processes;
pub mod refusal_log;
pub mod seqpacket;
pub mod wire;

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use gpu_mps_api::{ContainerId, DaemonKey, Limits};
use thiserror::Error;
use tokio::io::unix::AsyncFd;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};
use tokio::task::JoinHandle;
use tracing::{debug, error, info, warn};

use crate::metrics::{GateRefusal, Metrics};
use crate::mps_control::{self, MpsControl};
use crate::process_identity::ProcessIdentity;
use daemon_admission::{
    DaemonAdmission, Job, JobDone, Outcome, QueueView, RelayTimings, WedgeReport, WedgeReports,
};
use processes::{Decision, ProcessBudget, ServerClients};
use wire::Request;

#[derive(Debug, Error)]
pub enum GateError {
    #[error("cannot open the gate of container {container} in {dir}: {source}")]
    Open {
        container: String,
        dir: String,
        source: std::io::Error,
    },
}

/// How long the gate waits, from the node config ([gate] section).
#[derive(Debug, Clone, Copy)]
pub struct GateTimings {
    /// Longest wait for the daemon's hello and answer on one relayed connection.
    pub handshake_timeout: Duration,
    /// Longest a CUDA client is kept waiting for its server (limits not set, daemon not
    /// answering) before the gate refuses it cleanly.
    pub queue_timeout: Duration,
}

/// How many connections the gates hold open.
#[derive(Debug, Clone, Copy)]
pub struct GateBounds {
    pub per_container: u32,
    pub node: u32,
}

/// Where a gate's listening socket is kept beside the manager, so that it outlives a restart
/// (the gate keeper, crate gpu-mps-gate-keeper). Failures are logged, never fatal: the gate
/// works without it, only a restart would leave its socket unserved.
pub trait ListenerStore: Send + Sync {
    fn keep(&self, name: &str, listener: BorrowedFd<'_>) -> Result<(), String>;
    fn forget(&self, name: &str) -> Result<(), String>;
}

/// The gates keep their listening sockets in the keeper. Blocking: a hung keeper costs a gate
/// open or close `CALL_TIMEOUT` or two, then an error the gate logs.
impl ListenerStore for gpu_mps_gate_keeper::KeeperClient {
    fn keep(&self, name: &str, listener: BorrowedFd<'_>) -> Result<(), String> {
        self.put_listener(name, listener).map_err(|e| e.to_string())
    }

    fn forget(&self, name: &str) -> Result<(), String> {
        self.drop_name(name).map_err(|e| e.to_string())
    }
}

/// What one container's gate admits to.
#[derive(Debug, Clone)]
pub struct GateTarget {
    pub container: ContainerId,
    pub gate_dir: PathBuf,
    pub daemon: DaemonKey,
    pub daemon_pipe_dir: PathBuf,
    /// The container's limits: memory is the total of its CUDA processes.
    pub limits: Limits,
    pub cuda_processes: u32,
    /// The limits the server must hold when one of the container's processes gets its channel:
    /// under `exact` each process's share, under `uniform` the same (every lease of the GPU has
    /// it), under `ceiling` the ceiling. The daemon's owner sets them whenever the server holds
    /// others or was started again since (a restarted daemon starts from its defaults), so no
    /// client ever reaches a server without them. `None`: the gate leaves them alone.
    pub server_class: Option<Limits>,
    /// The container's processes already on the server when the gate opens (a restarted
    /// manager finds them among the server's clients): they count against `cuda_processes`.
    pub running: Vec<ProcessIdentity>,
    /// The container's init process: the server's clients in its cgroup are the container's,
    /// whoever connected for them. `None`: only the processes the gate let through count.
    pub init: Option<ProcessIdentity>,
    /// namespace/pod or the container id, for logs.
    pub owner: String,
}

impl GateTarget {
    /// The limits the server must hold for each of the container's processes, if the gate
    /// sets them.
    pub fn class(&self) -> Option<Limits> {
        self.server_class
    }
}

/// What a gate did, for `gpu-mps status`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GateView {
    /// The container's CUDA processes with a channel to the server, alive now.
    pub admitted_pids: Vec<u32>,
    pub refusals: u32,
    pub last_refusal: String,
    pub connections: u32,
}

/// A gate's own counters; shared by its connections.
struct GateState {
    budget: StdMutex<ProcessBudget>,
    refusals: AtomicU32,
    last_refusal: StdMutex<String>,
    /// Folds a refusal repeated at once into a count, so a retrying process cannot flood the log.
    refusal_log: StdMutex<refusal_log::RefusalLog>,
    connections: AtomicU32,
    /// A waiting client is logged once, not at every retry.
    waiting_logged: AtomicBool,
    /// A daemon that cannot say which clients its server holds is logged once, until it can.
    listing_failed_logged: AtomicBool,
    /// Set when a process of this container left its GPU's MPS server stuck: every request of
    /// the container is refused from then on (it must not do it again after the recovery).
    /// Shared with the daemon's owner, which checks it again right before it serves a job
    /// that was queued before the block.
    blocked: Arc<StdMutex<Option<String>>>,
}

impl GateState {
    fn new(budget: ProcessBudget) -> Self {
        GateState {
            budget: StdMutex::new(budget),
            refusals: AtomicU32::new(0),
            last_refusal: StdMutex::new(String::new()),
            refusal_log: StdMutex::new(refusal_log::RefusalLog::default()),
            connections: AtomicU32::new(0),
            waiting_logged: AtomicBool::new(false),
            listing_failed_logged: AtomicBool::new(false),
            blocked: Arc::new(StdMutex::new(None)),
        }
    }
}

struct OpenGate {
    task: JoinHandle<()>,
    state: Arc<GateState>,
    name: String,
    /// Set to stop taking connections off the backlog; the gate then finishes the ones it has.
    stop_accepting: tokio::sync::watch::Sender<bool>,
}

/// The open gates of this manager and each daemon's owner of admission.
pub struct Gates {
    control: Arc<dyn MpsControl>,
    timings: GateTimings,
    bounds: GateBounds,
    node_budget: Arc<Semaphore>,
    node_budget_logged: Arc<AtomicBool>,
    store: Option<Arc<dyn ListenerStore>>,
    daemons: StdMutex<HashMap<String, DaemonAdmission>>,
    open: StdMutex<HashMap<ContainerId, OpenGate>>,
    wedges: WedgeReports,
    metrics: Metrics,
}

impl Gates {
    pub fn new(control: Arc<dyn MpsControl>, timings: GateTimings, bounds: GateBounds) -> Self {
        Gates {
            control,
            timings,
            bounds,
            node_budget: Arc::new(Semaphore::new(bounds.node as usize)),
            node_budget_logged: Arc::new(AtomicBool::new(false)),
            store: None,
            daemons: StdMutex::new(HashMap::new()),
            open: StdMutex::new(HashMap::new()),
            wedges: Arc::new(StdMutex::new(Vec::new())),
            metrics: Metrics::default(),
        }
    }

    /// Records the gates' admissions, refusals and waiting connections in `metrics`.
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// The stuck servers the daemons' owners noticed since the last call (and those filed
    /// with [`Gates::report_stuck`]).
    pub fn take_wedge_reports(&self) -> Vec<WedgeReport> {
        std::mem::take(&mut *lock(&self.wedges))
    }

    /// Files a stuck server found elsewhere (a daemon that did not answer at adoption) with
    /// the owners' reports, for the next tick: one queue for every stuck-server report.
    pub fn report_stuck(&self, report: WedgeReport) {
        lock(&self.wedges).push(report);
    }

    /// Refuses every further request of the container, with `reason` (it left its server stuck).
    /// False if it has no gate.
    pub fn block(&self, container: &ContainerId, reason: &str) -> bool {
        match lock(&self.open).get(container) {
            Some(gate) => {
                *lock(&gate.state.blocked) = Some(reason.to_string());
                *lock(&gate.state.last_refusal) = reason.to_string();
                true
            }
            None => false,
        }
    }

    /// Keeps every gate's listening socket in `store` too.
    pub fn with_listener_store(mut self, store: Arc<dyn ListenerStore>) -> Self {
        self.store = Some(store);
        self
    }

    /// Serves `<gate dir>/control` for the container; replaces a gate it already has.
    /// `inherited`: the listening socket a previous manager served (from the gate keeper),
    /// which connections made during the restart wait on. Must run in a tokio runtime.
    pub fn open(&self, target: GateTarget, inherited: Option<OwnedFd>) -> Result<(), GateError> {
        let open_err = |source| GateError::Open {
            container: target.container.to_string(),
            dir: target.gate_dir.display().to_string(),
            source,
        };
        let name = target.container.gate_name();
        let (listener, how) = match inherited {
            Some(fd) => (UnixListener::from(fd), "inherited"),
            None => {
                // The shim created it for the container's mount; a missing one (a lease adopted
                // after its dir was removed by hand) is recreated so the socket has a place.
                // 0755: the root of the container's /tmp/nvidia-mps, under 0700 parents.
                gpu_mps_api::files::create_dir_in_private_parents(
                    &target.gate_dir,
                    gpu_mps_api::files::GATE_DIR_MODE,
                )
                .map_err(open_err)?;
                let listener = seqpacket::bind_gate_socket(&target.gate_dir, mps_control::CONTROL_SOCKET)
                    .map_err(open_err)?;
                if let Some(store) = &self.store {
                    if let Err(e) = store.keep(&name, listener.as_fd()) {
                        warn!(container = %target.container, error = %e, "the gate keeper does not hold this gate's socket: a manager restart would leave it unserved for a moment");
                    }
                }
                (listener, "bound")
            }
        };
        listener.set_nonblocking(true).map_err(open_err)?;
        let listener = seqpacket::watch(listener).map_err(open_err)?;
        let admission = self.admission_of(&target);
        let mut budget = ProcessBudget::new(target.cuda_processes);
        for process in &target.running {
            budget.seed(*process);
        }
        let state = Arc::new(GateState::new(budget));
        info!(container = %target.container, owner = %target.owner, daemon = %target.daemon, limits = %target.limits, cuda_processes = target.cuda_processes, running = ?target.running.iter().map(|p| p.pid).collect::<Vec<_>>(), class = ?target.class(), gate = %target.gate_dir.display(), socket = how, "gate open");
        let serving = Serving {
            target: Arc::new(target),
            admission,
            state: state.clone(),
            timings: self.timings,
            per_container: Arc::new(Semaphore::new(self.bounds.per_container as usize)),
            node_budget: self.node_budget.clone(),
            node_budget_logged: self.node_budget_logged.clone(),
            metrics: self.metrics.clone(),
            control: self.control.clone(),
        };
        let container = serving.target.container.clone();
        let (stop_accepting, stop) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(serve_gate(listener, serving, stop));
        let gate = OpenGate {
            task,
            state,
            name,
            stop_accepting,
        };
        if let Some(old) = lock(&self.open).insert(container, gate) {
            old.task.abort();
        }
        Ok(())
    }

    /// Stops serving the container's gate, if it has one, and removes its dir `dir` (which the
    /// shim created even when the Acquire then failed). True if a gate was open.
    pub fn close(&self, container: &ContainerId, dir: &Path) -> bool {
        let open = lock(&self.open).remove(container);
        if let Some(gate) = &open {
            gate.task.abort();
            info!(container = %container, "gate closed");
        }
        if let Some(store) = &self.store {
            let name = open
                .as_ref()
                .map_or_else(|| container.gate_name(), |g| g.name.clone());
            if let Err(e) = store.forget(&name) {
                warn!(container = %container, error = %e, "the gate keeper did not drop this gate's socket");
            }
        }
        remove_gate_dir(dir);
        open.is_some()
    }

    /// Stops every gate's task but leaves the sockets in place (and in the gate keeper): a
    /// manager that stops with leases is replaced by one that serves them again, and the
    /// connections made meanwhile wait in the listen backlog.
    pub fn stop_serving(&self) {
        for (_, gate) in lock(&self.open).drain() {
            gate.task.abort();
        }
    }

    /// Stops taking connections (they wait in the backlog, on the keeper's copy of the socket,
    /// for the next manager) and gives the connections in flight up to `grace` to finish: a
    /// CUDA client's handshake takes milliseconds, and one cut before its request would fall
    /// back to a direct context. What is still open then (a connection that never sent its
    /// request) is closed with its gate.
    pub async fn drain(&self, grace: Duration) {
        let gates: Vec<OpenGate> = lock(&self.open).drain().map(|(_, g)| g).collect();
        for gate in &gates {
            let _ = gate.stop_accepting.send(true);
        }
        let deadline = tokio::time::Instant::now() + grace;
        for gate in gates {
            let mut task = gate.task;
            if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
                task.abort();
            }
        }
    }

    pub fn is_open(&self, container: &ContainerId) -> bool {
        lock(&self.open).contains_key(container)
    }

    /// What the container's gate did, for `gpu-mps status`.
    pub fn view(&self, container: &ContainerId) -> Option<GateView> {
        let open = lock(&self.open);
        let state = &open.get(container)?.state;
        let admitted_pids = lock(&state.budget).admitted(ProcessIdentity::is_alive);
        Some(GateView {
            admitted_pids,
            refusals: state.refusals.load(Ordering::Relaxed),
            last_refusal: lock(&state.last_refusal).clone(),
            connections: state.connections.load(Ordering::Relaxed),
        })
    }

    /// The daemon's admission queue, for `gpu-mps status`.
    pub fn queue(&self, daemon: &DaemonKey) -> Option<QueueView> {
        lock(&self.daemons)
            .get(&daemon.dir_name())
            .map(DaemonAdmission::view)
    }

    fn admission_of(&self, target: &GateTarget) -> DaemonAdmission {
        self.daemon_owner(&target.daemon, &target.daemon_pipe_dir)
    }

    /// The owner of the daemon of `key` (started on first use): the one that relays its clients
    /// and the only one that sets its servers' limits.
    pub fn daemon_owner(&self, key: &DaemonKey, pipe_dir: &Path) -> DaemonAdmission {
        lock(&self.daemons)
            .entry(key.dir_name())
            .or_insert_with(|| {
                DaemonAdmission::spawn(
                    key.clone(),
                    pipe_dir.to_path_buf(),
                    key.gpu_uuids().len(),
                    self.control.clone(),
                    RelayTimings {
                        answer_timeout: self.timings.handshake_timeout,
                        ack_timeout: daemon_admission::ACK_TIMEOUT,
                    },
                    self.wedges.clone(),
                )
            })
            .clone()
    }
}

impl Drop for Gates {
    fn drop(&mut self) {
        self.stop_serving();
    }
}

/// Which gate dirs of no lease [`remove_stale_gate_dirs`] removes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StaleGateDirs {
    /// At start: also the ones a previous manager served (nothing serves them now).
    ServedOrOld,
    /// While the manager runs: a served dir is its own gate's, removed at release; only
    /// unserved ones older than the age go.
    OldUnserved,
}

/// Removes gate dirs under `gates_root` whose container `keep` does not know: left behind by a
/// manager that stopped before their containers' release. A dir without a socket is a container
/// whose Acquire has not happened yet (it is mounted already: removing it would leave the
/// container an empty dir forever), unless it is older than `unserved_age`, which any create
/// takes less than. Returns the names removed.
pub fn remove_stale_gate_dirs(
    gates_root: &Path,
    unserved_age: Duration,
    which: StaleGateDirs,
    keep: impl Fn(&str) -> bool,
) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(gates_root) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let served_before = entry.path().join(mps_control::CONTROL_SOCKET).exists();
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > unserved_age);
        let served_too = which == StaleGateDirs::ServedOrOld;
        if !keep(&name) && ((served_too && served_before) || (!served_before && old)) {
            warn!(gate = %entry.path().display(), "gate dir of no lease removed");
            remove_gate_dir(&entry.path());
            removed.push(name);
        }
    }
    removed
}

fn remove_gate_dir(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            warn!(gate = %dir.display(), error = %e, "cannot remove the gate dir");
        }
    }
}

/// What a gate's task and its connections share.
#[derive(Clone)]
struct Serving {
    target: Arc<GateTarget>,
    admission: DaemonAdmission,
    state: Arc<GateState>,
    timings: GateTimings,
    per_container: Arc<Semaphore>,
    node_budget: Arc<Semaphore>,
    node_budget_logged: Arc<AtomicBool>,
    metrics: Metrics,
    /// Asks the daemon which clients its servers hold (`get_client_list`).
    control: Arc<dyn MpsControl>,
}

/// The permits one open connection holds; released when it closes.
struct Slot {
    _container: OwnedSemaphorePermit,
    _node: OwnedSemaphorePermit,
    state: Arc<GateState>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.state.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A request [`ProcessBudget::decide`] let through: it counts against the container's CUDA
/// processes until it is confirmed (the client got its channel) or dropped, which gives it back
/// on every other way out of the connection, its task aborted by a closing gate included.
struct ProcessReservation {
    state: Arc<GateState>,
    process: ProcessIdentity,
    confirmed: bool,
}

impl ProcessReservation {
    fn confirm(mut self) {
        lock(&self.state.budget).confirm(self.process);
        self.confirmed = true;
    }
}

impl Drop for ProcessReservation {
    fn drop(&mut self) {
        if !self.confirmed {
            lock(&self.state.budget).release(self.process);
        }
    }
}

async fn serve_gate(
    listener: AsyncFd<UnixListener>,
    serving: Serving,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    // Dropping this task (gate closed) drops the set, which aborts the connections in flight.
    let mut connections = tokio::task::JoinSet::new();
    loop {
        if *stop.borrow() {
            // Draining: no new connection; the ones in flight finish (or the drain's grace ends
            // and this task is aborted with them).
            while connections.join_next().await.is_some() {}
            return;
        }
        tokio::select! {
            Ok(()) = stop.changed() => continue,
            slot = next_connection(&listener, &serving) => match slot {
                Ok((stream, slot)) => {
                    connections.spawn(serve_connection(stream, slot, serving.clone()));
                }
                Err(e) => {
                    // Out of descriptors, most likely: back off instead of spinning.
                    error!(container = %serving.target.container, error = %e, "gate cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// Accepts the next connection once it may: a pending connection is taken off the backlog only
/// with a slot of its container and one of the node, so that connections beyond the bounds
/// wait in the backlog, where they cost no descriptor. An idle gate holds no slot.
async fn next_connection(
    listener: &AsyncFd<UnixListener>,
    serving: &Serving,
) -> std::io::Result<(UnixStream, Slot)> {
    loop {
        let mut ready = listener.readable().await?;
        let container = serving
            .per_container
            .clone()
            .acquire_owned()
            .await
            .map_err(std::io::Error::other)?;
        let node = match serving.node_budget.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                if !serving.node_budget_logged.swap(true, Ordering::Relaxed) {
                    warn!(container = %serving.target.container, "gate: the node's budget of gate connections ([gate] max_connections) is used up; new connections wait in their listen backlog");
                }
                let permit = serving
                    .node_budget
                    .clone()
                    .acquire_owned()
                    .await
                    .map_err(std::io::Error::other)?;
                serving.node_budget_logged.store(false, Ordering::Relaxed);
                permit
            }
        };
        match ready.try_io(|l| l.get_ref().accept()) {
            Ok(Ok((stream, _))) => {
                stream.set_nonblocking(true)?;
                serving.state.connections.fetch_add(1, Ordering::Relaxed);
                let slot = Slot {
                    _container: container,
                    _node: node,
                    state: serving.state.clone(),
                };
                return Ok((stream, slot));
            }
            Ok(Err(e)) => return Err(e),
            Err(_would_block) => continue,
        }
    }
}

/// First and longest wait between two attempts to reach a daemon that did not answer.
const RETRY_FIRST: Duration = Duration::from_millis(250);
const RETRY_MAX: Duration = Duration::from_secs(4);

async fn serve_connection(stream: UnixStream, slot: Slot, serving: Serving) {
    let target = &serving.target;
    let peer = match seqpacket::peer_credentials(&stream) {
        Ok(c) => c,
        Err(e) => {
            warn!(container = %target.container, error = %e, "gate: no peer credentials; connection dropped");
            return;
        }
    };
    let client_pid = peer.pid();
    let client = match seqpacket::watch(stream) {
        Ok(c) => c,
        Err(e) => {
            error!(container = %target.container, error = %e, "gate: cannot watch the client's connection");
            return;
        }
    };
    // From here on, never close the connection before the client's request: a CUDA client
    // whose connection ends before its request opens a DIRECT context with the whole GPU
    // (measured, Default compute mode). After its request, closing is a clean refusal.
    if seqpacket::send_message(&client, wire::HELLO, &[], None)
        .await
        .is_err()
    {
        return;
    }
    let request = match read_request(&client, client_pid).await {
        Ok(Some(request)) => request,
        // The probe of a CUDA client: the hello was all it wanted.
        Ok(None) => return,
        Err(e) => {
            debug!(container = %target.container, client_pid, error = %e, "gate: reading the request failed");
            return;
        }
    };
    if request == Request::UiSession {
        // A set, quit or terminate from the pod is answered as MPS answers a user who may not
        // change the daemon, so that a tenant is never told a change was made (the CLI exits 0
        // and prints nothing when the gate just closes, measured); a read is closed unanswered.
        let commands = answer_ui_session(&client, peer.uid()).await;
        refuse(
            &serving,
            client_pid,
            GateRefusal::NotACudaClient,
            &format!("{} (commands: {commands:?})", request.describe()),
        );
        return;
    }
    if request != Request::CudaClient {
        refuse(
            &serving,
            client_pid,
            GateRefusal::NotACudaClient,
            &request.describe(),
        );
        return;
    }
    if let Some(reason) = lock(&serving.state.blocked).clone() {
        refuse(&serving, client_pid, GateRefusal::Blocked, &reason);
        return;
    }
    let Some(process) = u32::try_from(client_pid).ok().and_then(ProcessIdentity::of) else {
        debug!(container = %target.container, client_pid, "gate: the client process is gone");
        return;
    };
    let decision = decide(&serving, process).await;
    match decision {
        Decision::Known | Decision::Reserved => {}
        Decision::TooManyChannels { channels } => {
            refuse(
                &serving,
                client_pid,
                GateRefusal::TooManyChannels,
                &format!(
                    "CUDA process {client_pid}: it already got {channels} channels to the server (a CUDA context takes 2)"
                ),
            );
            return;
        }
        Decision::OverBudget { limit, live, .. } => {
            refuse(
                &serving,
                client_pid,
                GateRefusal::OverCudaProcesses,
                &format!(
                    "CUDA process {client_pid}: the container already holds {} of its {limit} CUDA processes on the server (gpu-mps.io/cuda-processes; holders, as the gate counted them and the server lists them: {live:?})",
                    live.len()
                ),
            );
            return;
        }
    }
    // Every path that ends without a channel gives the request back to the budget.
    let reservation = ProcessReservation {
        state: serving.state.clone(),
        process,
        confirmed: false,
    };
    let started = Instant::now();
    let _waiting = serving.metrics.gate_connection_waits(&target.daemon);
    let mut client = client;
    let mut backoff = RETRY_FIRST;
    loop {
        // Checked again at every attempt: a retrying client must not outlive a block.
        if let Some(reason) = lock(&serving.state.blocked).clone() {
            refuse(&serving, client_pid, GateRefusal::Blocked, &reason);
            return;
        }
        let (done_tx, done_rx) = oneshot::channel();
        let job = Job {
            container: target.container.clone(),
            class: target.class(),
            client,
            credentials: peer,
            blocked: serving.state.blocked.clone(),
            done: done_tx,
        };
        if serving.admission.submit(job).is_err() {
            error!(container = %target.container, daemon = %target.daemon, "gate: the daemon's admission task is gone");
            return;
        }
        let Ok(JobDone {
            client: returned,
            outcome,
            waited,
            limits_set,
        }) = done_rx.await
        else {
            return;
        };
        client = returned;
        match outcome {
            Outcome::Admitted { answer_ms, acked } => {
                serving.metrics.gate_admitted(started.elapsed());
                reservation.confirm();
                serving.state.waiting_logged.store(false, Ordering::Relaxed);
                debug!(container = %target.container, client_pid, waited_ms = waited.as_millis() as u64, answer_ms, acked, limits_set, total_ms = started.elapsed().as_millis() as u64, "gate: client admitted");
                drop(slot);
                return;
            }
            Outcome::Blocked(reason) => {
                refuse(&serving, client_pid, GateRefusal::Blocked, &reason);
                return;
            }
            Outcome::Answered(what) => {
                warn!(container = %target.container, owner = %target.owner, client_pid, daemon = %target.daemon, "gate: the MPS daemon did not give the client a channel: {what}; passed on to the client");
                return;
            }
            Outcome::ClientGone => {
                debug!(container = %target.container, client_pid, "gate: the client left before it was served");
                return;
            }
            Outcome::Failed { why, .. } => {
                if started.elapsed() + backoff > serving.timings.queue_timeout {
                    refuse(
                        &serving,
                        client_pid,
                        GateRefusal::ServerUnreachable,
                        &format!(
                            "its server could not be reached for {} s: {why}",
                            serving.timings.queue_timeout.as_secs()
                        ),
                    );
                    return;
                }
                if !serving.state.waiting_logged.swap(true, Ordering::Relaxed) {
                    warn!(container = %target.container, owner = %target.owner, client_pid, daemon = %target.daemon, "gate: a CUDA client waits for its server: {why}; retrying for up to {} s, then it is refused cleanly", serving.timings.queue_timeout.as_secs());
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            () = client_left(&client) => {
                info!(container = %target.container, client_pid, "gate: a waiting client left");
                return;
            }
        }
        backoff = (backoff * 2).min(RETRY_MAX);
    }
}

/// Reads a connection's request: `None` if the client closed without one (a CUDA client's
/// probe). Waits as long as the client stays silent: that costs nobody but its container.
/// Every message must come from the process that connected (`connector`, its SO_PEERCRED
/// pid): the kernel stamps each message with its sender (SO_PASSCRED, and a pod cannot forge
/// another pid without CAP_SYS_ADMIN), so a connection handed to another process (a relay that
/// connects for others and passes the descriptor on) is refused, never counted as the relay.
async fn read_request(client: &AsyncFd<UnixStream>, connector: i32) -> std::io::Result<Option<Request>> {
    let Some(first) = seqpacket::recv_message(client).await? else {
        return Ok(None);
    };
    if let Some(other) = foreign(&first, connector) {
        return Ok(Some(other));
    }
    if let Some(other) = wire::classify_first(&first.bytes) {
        return Ok(Some(other));
    }
    let Some(second) = seqpacket::recv_message(client).await? else {
        return Ok(None);
    };
    if let Some(other) = foreign(&second, connector) {
        return Ok(Some(other));
    }
    Ok(Some(wire::classify(&first.bytes, &second.bytes)))
}

/// What is wrong with a message of a request that is not the connector's own plain message.
fn foreign(message: &seqpacket::Message, connector: i32) -> Option<Request> {
    if message.fd_count() > 0 {
        return Some(Request::Other("it passed descriptors".into()));
    }
    match message.credentials {
        Some(c) if c.pid() == connector => None,
        Some(c) => Some(Request::Other(format!(
            "a request sent by pid {} on a connection that pid {connector} opened (a connection passed to another process)",
            c.pid()
        ))),
        None => Some(Request::Other(
            "a message without its sender's credentials".into(),
        )),
    }
}

/// Serves a UI session's commands with the refusal MPS gives an unprivileged user, until it
/// ends, sends a read (closed unanswered) or anything not framed as measured. Never reaches the
/// daemon. Returns the commands it saw, for the log (at most [`UI_COMMANDS`]).
async fn answer_ui_session(client: &AsyncFd<UnixStream>, uid: u32) -> Vec<String> {
    // The CLI sends its command right after its request (measured: all in a row): a session
    // that says nothing more is closed unanswered, as a bare request always was.
    let next = || async { tokio::time::timeout(UI_COMMAND_WAIT, seqpacket::recv_message(client)).await };
    let mut seen = Vec::new();
    while seen.len() < UI_COMMANDS {
        let Ok(Ok(Some(length))) = next().await else {
            break;
        };
        let wire::UiStep::Length(length) = wire::ui_step(&length.bytes) else {
            break;
        };
        let Ok(Ok(Some(message))) = next().await else {
            break;
        };
        let Some(command) = wire::ui_command(&message.bytes, length) else {
            break;
        };
        let refusal = wire::ui_refusal(&command, uid);
        seen.push(command);
        let Some(text) = refusal else {
            break;
        };
        for part in wire::ui_answer(&text) {
            if seqpacket::send_message(client, &part, &[], None).await.is_err() {
                return seen;
            }
        }
    }
    seen
}

/// Commands one UI session gets answered before the gate closes it.
const UI_COMMANDS: usize = 16;
/// Longest wait for a UI session's next message.
const UI_COMMAND_WAIT: Duration = Duration::from_secs(1);

/// How long a process is kept waiting for a place that exited processes still hold on the
/// server (MPS lets a client go a moment after the process ends), before it is refused.
const LINGER_WAIT: Duration = Duration::from_secs(3);
const LINGER_POLL: Duration = Duration::from_millis(100);

/// Counts `process` against the container's budget. A process the gate knows already needs no
/// look at the server, nor does any before the gate issued its first channel (the server holds
/// no client of the container then: the first CUDA call pays nothing); a new one is decided on
/// what the server lists now, asked again while only exited processes the server still lists
/// stand in its way.
async fn decide(serving: &Serving, process: ProcessIdentity) -> Decision {
    {
        let mut budget = lock(&serving.state.budget);
        if budget.knows(process) {
            return budget.decide(process, ProcessIdentity::is_alive, None);
        }
        if !budget.needs_server_view() {
            return budget.decide(process, ProcessIdentity::is_alive, Some(ServerClients::default()));
        }
    }
    let deadline = Instant::now() + LINGER_WAIT;
    loop {
        let server = match server_clients(serving).await {
            Ok(server) => {
                serving
                    .state
                    .listing_failed_logged
                    .store(false, Ordering::Relaxed);
                Some(server)
            }
            // A stuck server leaves its daemon's server-bound commands hanging (measured), and
            // a restarting daemon answers nothing: the gate then counts what it let through
            // itself, and the daemon's owner goes on to notice the stall and recover.
            Err(why) => {
                if !serving.state.listing_failed_logged.swap(true, Ordering::Relaxed) {
                    warn!(container = %serving.target.container, owner = %serving.target.owner, daemon = %serving.target.daemon, "gate: {why}; counting only the processes the gate let through until the daemon answers again");
                }
                // Not an empty view: that would drop the exited processes the server listed
                // at the last look. The last view stands.
                None
            }
        };
        let decision = lock(&serving.state.budget).decide(process, ProcessIdentity::is_alive, server);
        match decision {
            Decision::OverBudget { lingering: true, .. } if Instant::now() < deadline => {
                tokio::time::sleep(LINGER_POLL).await;
            }
            other => return other,
        }
    }
}

/// What the daemon's servers hold now, and which of those clients run in the container. A
/// daemon that has no server yet lists none; one that cannot be asked refuses the process: the
/// gate cannot tell what the container already holds.
async fn server_clients(serving: &Serving) -> Result<ServerClients, String> {
    let target = &serving.target;
    let control = serving.control.as_ref();
    let pipe_dir = &target.daemon_pipe_dir;
    let failed = |e: mps_control::ControlError| {
        format!("the gate cannot ask the MPS control daemon which clients its server holds: {e}")
    };
    let mut listed = Vec::new();
    for server in mps_control::server_pids(control, pipe_dir)
        .await
        .map_err(failed)?
    {
        listed.extend(
            mps_control::client_pids(control, pipe_dir, server)
                .await
                .map_err(failed)?,
        );
    }
    let init_cgroup = target
        .init
        .filter(ProcessIdentity::is_alive)
        .and_then(|init| crate::process_identity::cgroup_of(init.pid));
    // A container in the manager's own cgroup (no cgroup of its own) would claim every client.
    let own_cgroup = crate::process_identity::cgroup_of(std::process::id());
    let init_cgroup = init_cgroup.filter(|c| Some(c) != own_cgroup.as_ref());
    let in_container = match &init_cgroup {
        Some(init) => listed
            .iter()
            .copied()
            .filter(|pid| {
                crate::process_identity::cgroup_of(*pid)
                    .is_some_and(|cgroup| crate::process_identity::in_cgroup_of(&cgroup, init))
            })
            .collect(),
        None => Vec::new(),
    };
    Ok(ServerClients { listed, in_container })
}

/// Refuses a connection after its request: dropping it closes it, which the client reports as
/// an error (measured: "MPS client failed to connect to the MPS control daemon or the MPS
/// server" from CUDA, "Cannot send command to MPS control daemon process" from the control CLI).
fn refuse(serving: &Serving, client_pid: i32, kind: GateRefusal, why: &str) {
    let target = &serving.target;
    serving.state.refusals.fetch_add(1, Ordering::Relaxed);
    serving.metrics.gate_refused(kind);
    let refusal = format!("pid {client_pid}: {why}");
    let logged = lock(&serving.state.refusal_log).note(&refusal, Instant::now());
    *lock(&serving.state.last_refusal) = refusal;
    match logged {
        Some(0) => {
            warn!(container = %target.container, owner = %target.owner, client_pid, daemon = %target.daemon, "gate: refused {why}; closed after its request (the process gets an MPS connection error, never a direct context)")
        }
        Some(folded) => {
            warn!(container = %target.container, owner = %target.owner, client_pid, daemon = %target.daemon, folded, "gate: refused {why}; closed after its request (the process gets an MPS connection error, never a direct context); {folded} refusal(s) repeating the one logged before were not logged")
        }
        None => debug!(container = %target.container, client_pid, "gate: refused again: {why}"),
    }
}

/// Resolves once the client closed its connection (a waiting client sends nothing).
async fn client_left(client: &AsyncFd<UnixStream>) {
    loop {
        let Ok(mut guard) = client.readable().await else {
            return;
        };
        match guard.try_io(|s| seqpacket::peek_closed(s.get_ref())) {
            Ok(Ok(true)) | Ok(Err(_)) => return,
            // It sent something while it waited: not gone; nothing more to watch.
            Ok(Ok(false)) => std::future::pending::<()>().await,
            Err(_would_block) => continue,
        }
    }
}

fn lock<T>(m: &StdMutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Plain data: a panic elsewhere cannot leave it half-written.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn reserve(state: &Arc<GateState>, process: ProcessIdentity) -> ProcessReservation {
        let decision = lock(&state.budget).decide(process, |_| true, Some(ServerClients::default()));
        assert!(
            matches!(decision, Decision::Reserved | Decision::Known),
            "{decision:?}"
        );
        ProcessReservation {
            state: state.clone(),
            process,
            confirmed: false,
        }
    }

    #[test]
    fn a_reservation_is_given_back_when_dropped_and_kept_when_confirmed() {
        let state = Arc::new(GateState::new(ProcessBudget::new(1)));
        let me = ProcessIdentity::of(std::process::id()).unwrap();
        let other = ProcessIdentity {
            pid: me.pid + 1,
            ..me
        };
        let over = |state: &Arc<GateState>, who| {
            matches!(
                lock(&state.budget).decide(who, |_| true, Some(ServerClients::default())),
                Decision::OverBudget { .. }
            )
        };

        // Dropped (every way out of a connection but a channel): the place is free again.
        drop(reserve(&state, me));
        assert!(
            !over(&state, other),
            "the dropped reservation gave its place back"
        );
        lock(&state.budget).release(other);

        // Confirmed: the process holds its place.
        reserve(&state, me).confirm();
        assert!(over(&state, other), "a confirmed process keeps its place");
    }
}
