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
    dir: PathBuf,
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
        let dir = target.gate_dir.clone();
        let container = target.container.clone();
        info!(container = %container, owner = %target.owner, daemon = %target.daemon, limits = %target.limits, gate = %dir.display(), "gate open");
        let task = tokio::spawn(serve_gate(
            listener,
            Arc::new(target),
            admission,
            self.control.clone(),
            self.timings.handshake_timeout,
        ));
        if let Some(old) = lock(&self.open).insert(container, OpenGate { dir, task }) {
            old.task.abort();
        }
        Ok(())
    }

    /// Stops serving the container's gate and removes its dir. True if it was open.
    pub fn close(&self, container: &ContainerId) -> bool {
        let Some(gate) = lock(&self.open).remove(container) else {
            return false;
        };
        gate.task.abort();
        remove_gate_dir(&gate.dir);
        info!(container = %container, "gate closed");
        true
    }

    /// Stops every gate's task but leaves the sockets in place: a manager that stops with
    /// leases is replaced by one that re-opens them (a client that connects in between gets
    /// "connection refused", never a direct context).
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
            .or_insert_with(|| Arc::new(ServerAdmission::new(self.timings.admission)))
            .clone()
    }
}

/// Removes gate dirs under `gates_root` whose container `keep` does not know: left behind by a
/// manager that stopped before their containers' release.
pub fn remove_stale_gate_dirs(gates_root: &Path, keep: impl Fn(&str) -> bool) {
    let Ok(entries) = std::fs::read_dir(gates_root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !keep(&name) {
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
    handshake_timeout: Duration,
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
                        handshake_timeout,
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
    handshake_timeout: Duration,
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
    let mut ticket = match admission
        .enter(target.limits, daemon_pid, client_pid, apply)
        .await
    {
        Ok(t) => t,
        Err(EnterError::QueueTimeout { waited, holder }) => {
            warn!(container = %target.container, owner = %target.owner, client_pid, daemon = %target.daemon, waited_ms = waited.as_millis() as u64, holder = ?holder, "gate: the server stayed busy admitting another class; connection refused (the CUDA process gets an MPS connection error)");
            return;
        }
        Err(EnterError::Apply(e)) => {
            error!(container = %target.container, owner = %target.owner, client_pid, daemon = %target.daemon, error = %e, "gate: cannot set the server's limits; connection refused so that the client never runs under other limits");
            return;
        }
    };
    let upstream_path = target.daemon_pipe_dir.join(mps_control::CONTROL_SOCKET);
    let upstream = match seqpacket::connect(&upstream_path).and_then(seqpacket::watch) {
        Ok(u) => u,
        Err(e) => {
            error!(container = %target.container, client_pid, daemon = %target.daemon, socket = %upstream_path.display(), error = %e, "gate: the MPS control daemon does not answer; connection refused");
            return;
        }
    };
    let client = match seqpacket::watch(stream) {
        Ok(c) => c,
        Err(e) => {
            error!(container = %target.container, error = %e, "gate: cannot watch the client's connection");
            return;
        }
    };
    let mut counts = RelayCounts::default();
    let outcome = tokio::time::timeout(
        handshake_timeout,
        relay(
            &client,
            &upstream,
            peer,
            &mut counts,
            &target.container,
            client_pid,
        ),
    )
    .await;
    let held_ms = started.elapsed().as_millis() as u64;
    if counts.fds_to_client > 0 {
        ticket.mark_admitted();
    }
    match outcome {
        Ok(Ok(())) => {
            debug!(container = %target.container, client_pid, waited_ms = ticket.waited.as_millis() as u64, limits_set = ticket.applied_limits, held_ms, to_daemon = counts.to_daemon, to_client = counts.to_client, fds_to_client = counts.fds_to_client, "gate: control connection done")
        }
        Ok(Err(e)) => {
            warn!(container = %target.container, client_pid, held_ms, error = %e, to_daemon = counts.to_daemon, to_client = counts.to_client, "gate: relay failed; connection closed")
        }
        Err(_) => {
            warn!(container = %target.container, owner = %target.owner, client_pid, daemon = %target.daemon, timeout_s = handshake_timeout.as_secs_f64(), to_daemon = counts.to_daemon, to_client = counts.to_client, "gate: control connection still open after the handshake timeout; cut, and the server's lock released")
        }
    }
    drop(ticket);
}

async fn relay(
    client: &AsyncFd<UnixStream>,
    daemon: &AsyncFd<UnixStream>,
    peer: nix::sys::socket::UnixCredentials,
    counts: &mut RelayCounts,
    container: &ContainerId,
    client_pid: i32,
) -> std::io::Result<()> {
    loop {
        // Only readiness is awaited in the select: the message itself is moved in the branch,
        // which is never cancelled, so no message is lost between the two directions.
        tokio::select! {
            ready = client.readable() => {
                drop(ready?);
                match seqpacket::relay_one(client, daemon, Credentials::OfClient(peer)).await? {
                    Step::Moved(m) => {
                        counts.to_daemon += 1;
                        trace!(container = %container, client_pid, bytes = m.bytes, fds = m.fds, credentials_pid = ?m.credentials_pid, "gate: client -> daemon");
                    }
                    Step::Ended => return Ok(()),
                    Step::NotReady => {}
                }
            }
            ready = daemon.readable() => {
                drop(ready?);
                match seqpacket::relay_one(daemon, client, Credentials::None).await? {
                    Step::Moved(m) => {
                        counts.to_client += 1;
                        counts.fds_to_client += m.fds;
                        trace!(container = %container, client_pid, bytes = m.bytes, fds = m.fds, "gate: daemon -> client");
                    }
                    Step::Ended => return Ok(()),
                    Step::NotReady => {}
                }
            }
        }
    }
}

fn lock<T>(m: &StdMutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Plain maps: a panic elsewhere cannot leave them half-written.
    m.lock().unwrap_or_else(|e| e.into_inner())
}
