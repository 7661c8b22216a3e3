//! Policy `exact`: the connect gate (docs/adr/0005-policy-exact-connect-gate.md).
//!
//! An MPS server gives every client that connects the limits it holds at that moment. Under
//! `exact` a container does not see the daemon's pipe dir: its /tmp/nvidia-mps is its own gate
//! dir, holding one `control` socket that the manager serves. On each connection the manager
//! takes the server's admission lock ([`server_admission`]), sets the server's limits to the
//! container's (skipped when they are already set), connects to the daemon's real `control`
//! socket and relays the handshake message by message ([`seqpacket`]), with the client's own
//! credentials. The daemon hands the client its channel to the server in that handshake, so the
//! gate is never on the data path; it is out of the picture once the control connections close.

pub mod seqpacket;
pub mod server_admission;

use std::collections::HashMap;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use gpu_mps_api::{ContainerId, DaemonKey, Limits};
use thiserror::Error;
use tokio::io::unix::AsyncFd;
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, error, info, trace, warn};

use crate::mps_control::{self, ControlError, MpsControl};
use seqpacket::{Credentials, Step};
use server_admission::{AdmissionTimings, Applied, EnterError, ServerAdmission};

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
    /// Longest a control connection may stay open through the gate; then it is cut and the
    /// server's lock goes to the next class.
    pub handshake_timeout: Duration,
    pub admission: AdmissionTimings,
}

/// What one container's gate admits to.
#[derive(Debug, Clone)]
pub struct GateTarget {
    pub container: ContainerId,
    pub gate_dir: PathBuf,
    pub daemon: DaemonKey,
    pub daemon_pipe_dir: PathBuf,
    pub limits: Limits,
    /// namespace/pod or the container id, for logs.
    pub owner: String,
}

struct OpenGate {
    task: JoinHandle<()>,
}

/// The open gates of this manager and the admission lock of each daemon.
pub struct Gates {
    control: Arc<dyn MpsControl>,
    timings: GateTimings,
    servers: StdMutex<HashMap<String, Arc<ServerAdmission>>>,
    open: StdMutex<HashMap<ContainerId, OpenGate>>,
}

impl Gates {
    pub fn new(control: Arc<dyn MpsControl>, timings: GateTimings) -> Self {
        Gates {
            control,
            timings,
            servers: StdMutex::new(HashMap::new()),
            open: StdMutex::new(HashMap::new()),
        }
    }

    /// Serves `<gate dir>/control` for the container; replaces a gate it already has (a
    /// restarted manager re-opens the gates of the leases it adopted). Must run in a tokio
    /// runtime.
    pub fn open(&self, target: GateTarget) -> Result<(), GateError> {
        let open_err = |source| GateError::Open {
            container: target.container.to_string(),
            dir: target.gate_dir.display().to_string(),
            source,
        };
        // The shim created it for the container's mount; a missing one (a lease adopted after
        // its dir was removed by hand) is recreated so the socket has a place.
        gpu_mps_api::files::create_dirs(&target.gate_dir, 0o755).map_err(open_err)?;
        let listener = seqpacket::bind_gate_socket(&target.gate_dir, mps_control::CONTROL_SOCKET)
            .and_then(seqpacket::watch)
            .map_err(open_err)?;
        let admission = self.admission_of(&target.daemon);
        let container = target.container.clone();
        info!(container = %container, owner = %target.owner, daemon = %target.daemon, limits = %target.limits, gate = %target.gate_dir.display(), "gate open");
        let task = tokio::spawn(serve_gate(
            listener,
            Arc::new(target),
            admission,
            self.control.clone(),
            self.timings,
        ));
        if let Some(old) = lock(&self.open).insert(container, OpenGate { task }) {
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
        remove_gate_dir(dir);
        open.is_some()
    }

    /// Stops every gate's task but leaves the sockets in place: a manager that stops with
    /// leases is replaced by one that re-opens them. A CUDA process that connects in between is
    /// refused, and then opens a direct context in Default compute mode (measured); under
    /// EXCLUSIVE_PROCESS that context fails instead.
    pub fn stop_serving(&self) {
        for (_, gate) in lock(&self.open).drain() {
            gate.task.abort();
        }
    }

    pub fn is_open(&self, container: &ContainerId) -> bool {
        lock(&self.open).contains_key(container)
    }

    /// Which class holds a daemon's admission lock now, for `gpu-mps status`.
    pub fn admitting(&self, daemon: &DaemonKey) -> Option<Limits> {
        lock(&self.servers)
            .get(&daemon.dir_name())
            .and_then(|s| s.holder())
    }

    fn admission_of(&self, daemon: &DaemonKey) -> Arc<ServerAdmission> {
        lock(&self.servers)
            .entry(daemon.dir_name())
            .or_insert_with(|| Arc::new(ServerAdmission::new(daemon.to_string(), self.timings.admission)))
            .clone()
    }
}

impl Drop for Gates {
    fn drop(&mut self) {
        self.stop_serving();
    }
}

/// How long a gate dir without a socket may wait for its Acquire: the shim makes it before runc
/// creates the container, and the hook retries Acquire while a manager restarts. Far longer than
/// a hook's timeout.
const UNSERVED_GATE_DIR_AGE: Duration = Duration::from_secs(600);

/// Removes gate dirs under `gates_root` whose container `keep` does not know: left behind by a
/// manager that stopped before their containers' release. A dir without a socket is a container
/// whose Acquire has not happened yet (it is mounted already: removing it would leave the
/// container an empty dir forever), unless it is older than any create can take.
pub fn remove_stale_gate_dirs(gates_root: &Path, keep: impl Fn(&str) -> bool) {
    let Ok(entries) = std::fs::read_dir(gates_root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let served_before = entry.path().join(mps_control::CONTROL_SOCKET).exists();
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > UNSERVED_GATE_DIR_AGE);
        if !keep(&name) && (served_before || old) {
            warn!(gate = %entry.path().display(), "gate dir of no lease removed");
            remove_gate_dir(&entry.path());
        }
    }
}

fn remove_gate_dir(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            warn!(gate = %dir.display(), error = %e, "cannot remove the gate dir");
        }
    }
}

async fn serve_gate(
    listener: AsyncFd<UnixListener>,
    target: Arc<GateTarget>,
    admission: Arc<ServerAdmission>,
    control: Arc<dyn MpsControl>,
    timings: GateTimings,
) {
    // Dropping this task (gate closed) drops the set, which aborts the connections in flight.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = accept(&listener) => match accepted {
                Ok(stream) => {
                    connections.spawn(admit_connection(
                        stream,
                        target.clone(),
                        admission.clone(),
                        control.clone(),
                        timings,
                    ));
                }
                Err(e) => {
                    // Out of descriptors, most likely: back off instead of spinning.
                    error!(container = %target.container, error = %e, "gate cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn accept(listener: &AsyncFd<UnixListener>) -> std::io::Result<UnixStream> {
    loop {
        let mut guard = listener.readable().await?;
        if let Ok(result) = guard.try_io(|l| l.get_ref().accept()) {
            let (stream, _) = result?;
            stream.set_nonblocking(true)?;
            return Ok(stream);
        }
    }
}

/// First and longest wait between two attempts to admit a client the gate could not admit.
const ADMISSION_RETRY_FIRST: Duration = Duration::from_millis(500);
const ADMISSION_RETRY_MAX: Duration = Duration::from_secs(10);

/// One attempt: the server's lock for the container's class (its limits set on a class change),
/// then a connection to the daemon.
async fn admit_once(
    target: &Arc<GateTarget>,
    admission: &ServerAdmission,
    control: &Arc<dyn MpsControl>,
    client_pid: i32,
) -> Result<(server_admission::Ticket, AsyncFd<UnixStream>), String> {
    // A restarted daemon starts its servers from their defaults: its pid tells.
    let daemon_pid = mps_control::read_pid_file(&target.daemon_pipe_dir).unwrap_or(0);
    let apply = |before: Option<Applied>| {
        let (control, target) = (control.clone(), target.clone());
        async move {
            let t = std::time::Instant::now();
            let servers = mps_control::apply_limits_everywhere(
                control.as_ref(),
                &target.daemon_pipe_dir,
                target.limits,
                target.daemon.gpu_uuids().len(),
            )
            .await?;
            info!(daemon = %target.daemon, limits = %target.limits, before = ?before.map(|a| a.limits), servers = ?servers, for_container = %target.container, owner = %target.owner, client_pid, elapsed_ms = t.elapsed().as_millis() as u64, "gate: server limits set and read back");
            Ok::<(), ControlError>(())
        }
    };
    let ticket = match admission
        .enter(target.limits, daemon_pid, client_pid, apply)
        .await
    {
        Ok(t) => t,
        Err(EnterError::QueueTimeout { waited, holder }) => {
            return Err(format!(
                "the server stayed busy admitting class {} for {} ms",
                holder.map_or_else(|| "?".to_string(), |h| h.to_string()),
                waited.as_millis()
            ));
        }
        Err(EnterError::Apply(e)) => return Err(format!("setting the server's limits failed: {e}")),
    };
    let upstream_path = target.daemon_pipe_dir.join(mps_control::CONTROL_SOCKET);
    let unanswered = |e: std::io::Error| {
        format!(
            "the MPS control daemon at {} does not answer: {e}",
            upstream_path.display()
        )
    };
    // A unix connect blocks while the daemon's backlog is full (it serves one connection at a
    // time): not on a runtime thread.
    let path = upstream_path.clone();
    let upstream = tokio::task::spawn_blocking(move || seqpacket::connect(&path))
        .await
        .map_err(|e| unanswered(std::io::Error::other(e)))?
        .and_then(seqpacket::watch)
        .map_err(unanswered)?;
    Ok((ticket, upstream))
}

/// Resolves once the client closed its connection (a waiting client sends nothing).
async fn client_left(client: &AsyncFd<UnixStream>) {
    loop {
        let Ok(mut guard) = client.readable().await else {
            return;
        };
        match guard.try_io(|s| seqpacket::peek_closed(s.get_ref())) {
            Ok(Ok(true)) | Ok(Err(_)) => return,
            // It sent something before the daemon's hello: not gone; nothing more to watch.
            Ok(Ok(false)) => std::future::pending::<()>().await,
            Err(_would_block) => continue,
        }
    }
}

/// Counts of one relayed connection, for the logs.
#[derive(Debug, Default, Clone, Copy)]
struct RelayCounts {
    to_daemon: usize,
    to_client: usize,
    fds_to_client: usize,
}

async fn admit_connection(
    stream: UnixStream,
    target: Arc<GateTarget>,
    admission: Arc<ServerAdmission>,
    control: Arc<dyn MpsControl>,
    timings: GateTimings,
) {
    let started = std::time::Instant::now();
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
    // Never close a connection the gate could not admit: measured on the H200, a CUDA client
    // whose control connection is closed before the handshake opens a DIRECT context with the
    // whole GPU (in Default compute mode). A client kept waiting just waits (12 s and more
    // measured), so the gate retries until it can admit it, or the client leaves.
    let mut backoff = ADMISSION_RETRY_FIRST;
    let (mut ticket, upstream) = loop {
        let attempt = tokio::select! {
            attempt = admit_once(&target, &admission, &control, client_pid) => attempt,
            () = client_left(&client) => {
                debug!(container = %target.container, client_pid, "gate: the client left while it waited for the server");
                return;
            }
        };
        match attempt {
            Ok(admitted) => break admitted,
            Err(why) => {
                error!(container = %target.container, owner = %target.owner, client_pid, daemon = %target.daemon, retry_in_ms = backoff.as_millis() as u64, "gate: cannot admit the client yet: {why}; it is kept waiting (closing would let CUDA fall back to a direct context)");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            () = client_left(&client) => {
                info!(container = %target.container, client_pid, "gate: a waiting client left");
                return;
            }
        }
        backoff = (backoff * 2).min(ADMISSION_RETRY_MAX);
    };
    let mut counts = RelayCounts::default();
    let end = relay(
        &client,
        &upstream,
        peer,
        &mut counts,
        &target.container,
        client_pid,
        RelayLimits {
            before_hello: timings.admission.queue_timeout,
            handshake: timings.handshake_timeout,
        },
    )
    .await;
    // The daemon is free again as soon as its end is closed.
    drop(upstream);
    let held_ms = started.elapsed().as_millis() as u64;
    let admitted = counts.fds_to_client > 0;
    if admitted {
        ticket.mark_admitted();
    }
    let (waited_ms, limits_set) = (ticket.waited.as_millis() as u64, ticket.applied_limits);
    drop(ticket);
    if matches!(end, RelayEnd::ClientClosed) || admitted {
        debug!(container = %target.container, client_pid, waited_ms, limits_set, held_ms, to_daemon = counts.to_daemon, to_client = counts.to_client, fds_to_client = counts.fds_to_client, end = %end, "gate: control connection done");
        return;
    }
    // Not admitted, and the client did not close: closing now would let CUDA open a direct
    // context with the whole GPU (measured). Keep its connection until it leaves; the daemon
    // and the server's lock are already free.
    warn!(container = %target.container, owner = %target.owner, client_pid, daemon = %target.daemon, held_ms, to_daemon = counts.to_daemon, to_client = counts.to_client, end = %end, "gate: the handshake did not complete; the daemon is freed, and the client's connection is kept open, unanswered, until it leaves (closing it would let CUDA fall back to a direct context)");
    client_left(&client).await;
    debug!(container = %target.container, client_pid, "gate: an unanswered client left");
}

/// How long a relayed connection may take.
#[derive(Debug, Clone, Copy)]
struct RelayLimits {
    /// Until the daemon's first message: the connection waits in the daemon's backlog while it
    /// serves others, which holds up no one.
    before_hello: Duration,
    /// From the daemon's first message: the daemon serves this connection only, so a stall here
    /// holds up every pod on the GPU.
    handshake: Duration,
}

/// Why a relay ended.
#[derive(Debug)]
enum RelayEnd {
    ClientClosed,
    DaemonClosed,
    NoHello(Duration),
    HandshakeTimeout(Duration),
    Failed(std::io::Error),
}

impl std::fmt::Display for RelayEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RelayEnd::ClientClosed => f.write_str("the client closed it"),
            RelayEnd::DaemonClosed => f.write_str("the daemon closed it"),
            RelayEnd::NoHello(d) => write!(f, "the daemon did not get to it within {} s", d.as_secs()),
            RelayEnd::HandshakeTimeout(d) => write!(
                f,
                "still open {} s after the daemon's hello (handshake timeout)",
                d.as_secs()
            ),
            RelayEnd::Failed(e) => write!(f, "relay failed: {e}"),
        }
    }
}

async fn relay(
    client: &AsyncFd<UnixStream>,
    daemon: &AsyncFd<UnixStream>,
    peer: nix::sys::socket::UnixCredentials,
    counts: &mut RelayCounts,
    container: &ContainerId,
    client_pid: i32,
    limits: RelayLimits,
) -> RelayEnd {
    let mut deadline = tokio::time::Instant::now() + limits.before_hello;
    loop {
        // Only readiness is awaited in the select: the message itself is moved in the branch,
        // which is never cancelled, so no message is lost between the two directions.
        tokio::select! {
            ready = client.readable() => {
                if let Err(e) = ready {
                    return RelayEnd::Failed(e);
                }
                match seqpacket::relay_one(client, daemon, Credentials::OfClient(peer)).await {
                    Ok(Step::Moved(m)) => {
                        counts.to_daemon += 1;
                        trace!(container = %container, client_pid, bytes = m.bytes, fds = m.fds, credentials_pid = ?m.credentials_pid, message_credentials_pid = ?m.message_credentials_pid, "gate: client -> daemon");
                    }
                    Ok(Step::Ended) => return RelayEnd::ClientClosed,
                    Ok(Step::NotReady) => {}
                    Err(e) => return RelayEnd::Failed(e),
                }
            }
            ready = daemon.readable() => {
                if let Err(e) = ready {
                    return RelayEnd::Failed(e);
                }
                match seqpacket::relay_one(daemon, client, Credentials::None).await {
                    Ok(Step::Moved(m)) => {
                        if counts.to_client == 0 {
                            deadline = tokio::time::Instant::now() + limits.handshake;
                        }
                        counts.to_client += 1;
                        counts.fds_to_client += m.fds;
                        trace!(container = %container, client_pid, bytes = m.bytes, fds = m.fds, "gate: daemon -> client");
                    }
                    Ok(Step::Ended) => return RelayEnd::DaemonClosed,
                    Ok(Step::NotReady) => {}
                    Err(e) => return RelayEnd::Failed(e),
                }
            }
            () = tokio::time::sleep_until(deadline) => {
                return if counts.to_client == 0 {
                    RelayEnd::NoHello(limits.before_hello)
                } else {
                    RelayEnd::HandshakeTimeout(limits.handshake)
                };
            }
        }
    }
}

fn lock<T>(m: &StdMutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Plain maps: a panic elsewhere cannot leave them half-written.
    m.lock().unwrap_or_else(|e| e.into_inner())
}
