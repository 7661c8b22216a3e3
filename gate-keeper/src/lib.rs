//! The gate keeper: a tiny process, separate from the manager, that holds a duplicate of every
//! gate's listening socket so that the gates keep listening while the manager restarts.
//!
//! Why: a CUDA process that connects to a gate (`<root>/gates/<name>/control`) while nobody
//! listens there neither waits nor fails: measured on the H200 (docs/gpu-results.md, X4 "while
//! the manager is down"; docs/adr/0005), it silently opens a direct context with the whole GPU,
//! outside MPS and its limits. A listening socket dies with the last process that holds it, so
//! every manager restart (upgrade, crash, SIGKILL) opened that window. With a second holder, a
//! connection made during the restart waits in the socket's listen backlog and the next manager
//! accepts it: the window becomes a pause. systemd's file descriptor store would do the same, but
//! only under systemd; the manager also runs in a Kubernetes DaemonSet and in tests.
//!
//! What it does not cover:
//! - A connection the manager had already accepted dies with the manager (stop, SIGKILL, crash)
//!   in the middle of the handshake: the client sees it close.
//! - Whatever kills all of the manager's processes at once kills the keeper too, as it kills the
//!   MPS daemons: systemd's default `KillMode=control-group` (our unit has `KillMode=process`) and
//!   a container runtime ending a hostPID container whose main process exited (it kills every
//!   process of the container: the DaemonSet's caveat in packaging/kubernetes/gpu-mps.yaml).
//!   There the keeper must run on its own (its own unit, or a second container of the pod running
//!   `gpu-mps-manager --gate-keeper <root>`); [`KeeperClient::connect_or_spawn`] then finds it and
//!   starts nothing.
//!
//! # Protocol
//! `<root>/gate-keeper.sock`, SOCK_SEQPACKET, mode 0600, and the peer's uid (SO_PEERCRED) must be
//! 0 (or the keeper's own, which is 0 in production). One request per connection. Each request
//! and each answer is one message of UTF-8 text, words separated by one space, no newline:
//!
//! | request | descriptors | answers |
//! |---|---|---|
//! | `PUT <kind> <name>` | exactly one | `OK` |
//! | `DROP <name>` | none | `OK` (also for a name not held) |
//! | `TAKE` | none | `HELD <kind> <name>` with one descriptor, per held one; then `END` |
//! | `QUIT_IF_EMPTY` | none | `OK` when nothing is held (then the keeper exits), else `BUSY <count held>` |
//! | `PING` | none | `PONG <pid>` |
//! | `VERSION` | none | `VERSION <n>` (since version 2) |
//!
//! Any request may also be answered `ERR <why>`. `<kind>` is `listener`, a gate's listening
//! socket: a new one replaces the one held under that name; TAKE hands a duplicate and keeps it.
//! `<name>` is the rest of the message: 1 to 128 bytes, no `/` or NUL, not `.` or `..`.
//!
//! # Versions
//! A keeper outlives manager upgrades, so a newer keeper answers every request of an older
//! version as that version did (tests/version_1_client.rs holds version 1's bytes).
//! - 1 (to 2026-12-06): the table without VERSION, and a second kind, `parked`, that no manager
//!   ever sent (a stopping manager was to hand over connections it had accepted).
//! - 2 ([`PROTOCOL_VERSION`]): VERSION added (a version-1 keeper answers it `ERR unknown
//!   request`, which [`KeeperClient::protocol_version`] reads as 1); `parked` refused, as
//!   nothing produced it.
//!
//! # The crate
//! [`fd_passing`] is the workspace's one place where a received descriptor becomes an owner;
//! the manager's connect gate passes descriptors through it too. The keeper's process is
//! [`run_keeper`] (`gpu-mps-manager --gate-keeper <root>`); the manager's side is
//! [`KeeperClient`]. Pure decisions (requests, names, who may talk) are in `protocol`, what is
//! held in `store`.

use std::io;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

mod client;
pub mod fd_passing;
mod keeper;
mod protocol;
mod store;
#[cfg(test)]
mod tests;
mod wire;

pub use client::{Held, KeeperClient};
pub use keeper::run_keeper;

/// The version of the protocol this keeper speaks (see the crate's doc: Versions).
pub const PROTOCOL_VERSION: u32 = 2;
/// The keeper's socket, in the manager's state root.
pub const SOCKET_NAME: &str = "gate-keeper.sock";
/// Held (flock) by the running keeper: one keeper per root.
pub const LOCK_NAME: &str = "gate-keeper.lock";
/// How long a call waits for each step (connect, send, each answer): a hung keeper costs the
/// manager this much, never a hang.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// How long connect_or_spawn waits for a keeper it started to answer.
pub const SPAWN_TIMEOUT: Duration = Duration::from_secs(2);
/// Most descriptors held at once, so that a bug cannot exhaust the keeper's descriptors. The
/// keeper's RLIMIT_NOFILE (inherited from the manager) may be the lower bound.
pub const MAX_HELD: usize = 65536;
/// Longest name, in bytes.
pub const MAX_NAME: usize = 128;

/// Everything that goes wrong in the keeper or in a call to it; each is one line with context.
#[derive(Debug, thiserror::Error)]
pub enum KeeperError {
    /// Nobody listens: no socket file, or a stale one (connect_or_spawn then starts a keeper).
    #[error("no gate keeper answers at {}: {source}", socket.display())]
    NotRunning {
        socket: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("gate keeper at {}: `{request}`: {source}", socket.display())]
    Io {
        socket: PathBuf,
        request: String,
        #[source]
        source: io::Error,
    },
    #[error(
        "the gate keeper at {} did not answer `{request}` within {timeout:?} (hung? `ss -xlp | grep {}` shows its pid)",
        socket.display(),
        SOCKET_NAME
    )]
    Timeout {
        socket: PathBuf,
        request: String,
        timeout: Duration,
    },
    #[error("the gate keeper at {} refused `{request}`: {why}", socket.display())]
    Refused {
        socket: PathBuf,
        request: String,
        why: String,
    },
    #[error(
        "the gate keeper at {} answered `{request}` with {answer:?}, expected {expected} (a keeper of another version?)",
        socket.display()
    )]
    Protocol {
        socket: PathBuf,
        request: String,
        answer: String,
        expected: &'static str,
    },
    #[error("gate keeper name {name:?}: {why} (1 to {MAX_NAME} bytes, no '/' or NUL, not . or ..)")]
    InvalidName { name: String, why: String },
    #[error("starting the gate keeper {}: {source}", exe.display())]
    Spawn {
        exe: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "the gate keeper {} exited ({status}) before {} answered; run it by hand, or give it a log file, to see why",
        exe.display(),
        socket.display()
    )]
    SpawnedExited {
        exe: PathBuf,
        socket: PathBuf,
        status: ExitStatus,
    },
    #[error(
        "the gate keeper {} started, but {} did not answer within {waited:?}",
        exe.display(),
        socket.display()
    )]
    SpawnedSilent {
        exe: PathBuf,
        socket: PathBuf,
        waited: Duration,
    },
    /// The keeper could not start serving (lock, socket, signal mask).
    #[error("gate keeper: {context} {}: {source}", path.display())]
    Setup {
        context: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl KeeperError {
    pub(crate) fn nobody_listens(&self) -> bool {
        matches!(self, KeeperError::NotRunning { .. })
    }
}
