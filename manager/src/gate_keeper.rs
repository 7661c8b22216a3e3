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
//! - A connection the manager had already accepted dies with the manager when it is killed
//!   (SIGKILL, crash) in the middle of the handshake: the client sees it close. A manager that
//!   stops cleanly hands such connections over as `parked`.
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
//!
//! Any request may also be answered `ERR <why>`. `<kind>` is `listener` (a gate's listening
//! socket; a new one replaces the one held under that name; TAKE hands a duplicate and keeps it)
//! or `parked` (a client connection a stopping manager had accepted and greeted; several may be
//! held under one name; TAKE hands each over once and forgets it). `<name>` is the rest of the
//! message: 1 to 128 bytes, no `/` or NUL, not `.` or `..`. A new keeper must keep answering
//! this version of the protocol: a keeper outlives manager upgrades.
//!
//! The manager's side is [`KeeperClient`], also the gates' [`crate::gate::ListenerStore`].

use std::collections::{BTreeMap, VecDeque};
use std::ffi::OsString;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice, IoSliceMut, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::cmsg_space;
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use nix::sys::signal::{SigSet, SigmaskHow, Signal, pthread_sigmask};
use nix::sys::socket::{
    self, AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
    UnixAddr, sockopt,
};
use nix::sys::time::{TimeVal, TimeValLike};

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

/// Largest request or answer: `PUT listener ` and a 128-byte name fit several times. A longer
/// message arrives cut (MSG_TRUNC) and is refused.
const MAX_MESSAGE: usize = 512;
/// Room for the kernel's SCM_MAX_FD descriptors, so that a message carrying more than one
/// (refused) never has some cut off: those would stay open in the receiver, out of reach.
const MAX_FDS: usize = 253;

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
    fn nobody_listens(&self) -> bool {
        matches!(self, KeeperError::NotRunning { .. })
    }
}

/// What a held descriptor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum HeldKind {
    /// A gate's listening socket: kept across TAKEs, for every restart to come.
    Listener,
    /// A client connection a stopping manager had accepted and greeted, but whose request had
    /// not come: handed to the next manager once.
    Parked,
}

impl HeldKind {
    fn as_str(self) -> &'static str {
        match self {
            HeldKind::Listener => "listener",
            HeldKind::Parked => "parked",
        }
    }

    fn parse(word: &str) -> Option<Self> {
        match word {
            "listener" => Some(HeldKind::Listener),
            "parked" => Some(HeldKind::Parked),
            _ => None,
        }
    }
}

impl fmt::Display for HeldKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A descriptor handed back by TAKE; the caller owns this duplicate.
#[derive(Debug)]
pub struct Held {
    pub name: String,
    pub kind: HeldKind,
    pub fd: OwnedFd,
}

// ---------------------------------------------------------------------------------------------
// Pure decisions: names, requests, who may talk.

/// Why `name` cannot be held, if it cannot.
fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        Err("empty name".to_string())
    } else if name.len() > MAX_NAME {
        Err(format!("name of {} bytes (at most {MAX_NAME})", name.len()))
    } else if name.contains('/') {
        Err("name contains '/'".to_string())
    } else if name.contains('\0') {
        Err("name contains NUL".to_string())
    } else if name == "." || name == ".." {
        Err(format!("name is {name:?}"))
    } else {
        Ok(())
    }
}

/// `<kind> <name>`, as in PUT and HELD.
fn parse_kind_name(rest: &str) -> Result<(HeldKind, &str), String> {
    let (kind, name) = rest
        .split_once(' ')
        .ok_or_else(|| "expected <kind> <name>".to_string())?;
    let kind =
        HeldKind::parse(kind).ok_or_else(|| format!("unknown kind {:?} (listener or parked)", clip(kind)))?;
    check_name(name)?;
    Ok((kind, name))
}

#[derive(Debug, PartialEq, Eq)]
enum Request {
    Put { kind: HeldKind, name: String },
    Drop { name: String },
    Take,
    QuitIfEmpty,
    Ping,
}

/// Decodes one request message that came with `fds` descriptors.
fn parse_request(message: &[u8], fds: usize) -> Result<Request, String> {
    let text = std::str::from_utf8(message).map_err(|_| "request is not UTF-8".to_string())?;
    let (verb, rest) = match text.split_once(' ') {
        Some((verb, rest)) => (verb, Some(rest)),
        None => (text, None),
    };
    let request = match (verb, rest) {
        ("PUT", Some(rest)) => {
            let (kind, name) = parse_kind_name(rest)?;
            Request::Put {
                kind,
                name: name.to_string(),
            }
        }
        ("DROP", Some(name)) => {
            check_name(name)?;
            Request::Drop {
                name: name.to_string(),
            }
        }
        ("TAKE", None) => Request::Take,
        ("QUIT_IF_EMPTY", None) => Request::QuitIfEmpty,
        ("PING", None) => Request::Ping,
        ("PUT" | "DROP", None) => return Err(format!("{verb} needs arguments")),
        ("TAKE" | "QUIT_IF_EMPTY" | "PING", Some(_)) => return Err(format!("{verb} takes no argument")),
        _ => {
            return Err(format!(
                "unknown request {:?} (PUT, DROP, TAKE, QUIT_IF_EMPTY, PING)",
                clip(verb)
            ));
        }
    };
    let wanted = usize::from(matches!(request, Request::Put { .. }));
    if fds != wanted {
        return Err(format!("{verb} carries {wanted} descriptor(s), this one {fds}"));
    }
    Ok(request)
}

/// Whether a peer of this uid may talk to the keeper: root, or the keeper's own user (root in
/// production; the user running the tests elsewhere). The socket's mode 0600 says the same.
fn peer_allowed(peer_uid: u32, own_uid: u32) -> bool {
    peer_uid == 0 || peer_uid == own_uid
}

/// A client's word, short enough to echo in an error.
fn clip(word: &str) -> &str {
    match word.char_indices().nth(32) {
        Some((end, _)) => &word[..end],
        None => word,
    }
}

// ---------------------------------------------------------------------------------------------
// What the keeper holds.

#[derive(Default)]
struct Entry {
    listener: Option<OwnedFd>,
    parked: VecDeque<OwnedFd>,
}

impl Entry {
    fn count(&self) -> usize {
        usize::from(self.listener.is_some()) + self.parked.len()
    }
}

/// Descriptors by name; dropping one closes the keeper's duplicate.
struct Store {
    entries: BTreeMap<String, Entry>,
    cap: usize,
}

impl Store {
    fn new(cap: usize) -> Self {
        Store {
            entries: BTreeMap::new(),
            cap,
        }
    }

    fn count(&self) -> usize {
        self.entries.values().map(Entry::count).sum()
    }

    fn put(&mut self, name: String, kind: HeldKind, fd: OwnedFd) -> Result<(), String> {
        let grows = match kind {
            HeldKind::Listener => self.entries.get(&name).is_none_or(|e| e.listener.is_none()),
            // Never replaced: that would close a waiting client's connection.
            HeldKind::Parked => true,
        };
        if grows && self.count() >= self.cap {
            return Err(format!(
                "full: {} descriptors held (at most {})",
                self.count(),
                self.cap
            ));
        }
        let entry = self.entries.entry(name).or_default();
        match kind {
            // The previous listener of that name, if any, is closed here.
            HeldKind::Listener => entry.listener = Some(fd),
            HeldKind::Parked => entry.parked.push_back(fd),
        }
        Ok(())
    }

    fn drop_name(&mut self, name: &str) {
        self.entries.remove(name);
    }

    /// Hands every descriptor to `send`. A parked one is forgotten (closed here) once `send`
    /// took it, and kept when `send` failed: it went nowhere.
    fn take(
        &mut self,
        mut send: impl FnMut(&str, HeldKind, BorrowedFd<'_>) -> io::Result<()>,
    ) -> io::Result<()> {
        let mut result = Ok(());
        'names: for (name, entry) in &mut self.entries {
            if let Some(listener) = &entry.listener {
                if let Err(e) = send(name, HeldKind::Listener, listener.as_fd()) {
                    result = Err(e);
                    break;
                }
            }
            while let Some(parked) = entry.parked.front() {
                if let Err(e) = send(name, HeldKind::Parked, parked.as_fd()) {
                    result = Err(e);
                    break 'names;
                }
                entry.parked.pop_front();
            }
        }
        self.entries.retain(|_, e| e.count() > 0);
        result
    }
}

// ---------------------------------------------------------------------------------------------
// Messages on the wire.

/// One message as received; its descriptors are ours and close when it drops.
struct Message {
    text: Vec<u8>,
    fds: Vec<OwnedFd>,
    /// The message or its descriptors did not fit: refused, never half-read.
    cut: bool,
}

/// Takes ownership of descriptors the kernel just installed for a recvmsg (SCM_RIGHTS).
///
/// The module's one `unsafe`: nix 0.29 hands received descriptors over as bare numbers, and
/// only `from_raw_fd` turns a number into an owner.
#[allow(unsafe_code)]
fn adopt(received: Vec<RawFd>) -> Vec<OwnedFd> {
    received
        .into_iter()
        // SAFETY: the kernel installed each of these descriptors in this process for the
        // recvmsg that returned them; nothing else knows their numbers, so each gets exactly
        // one owner, which closes it once.
        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect()
}

/// Receives one message; `None` at end of stream. Waits at most the socket's receive timeout.
fn receive(conn: &UnixStream) -> io::Result<Option<Message>> {
    loop {
        match receive_once(conn) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

fn receive_once(conn: &UnixStream) -> io::Result<Option<Message>> {
    let mut buf = [0u8; MAX_MESSAGE];
    let mut cmsg = cmsg_space!([RawFd; MAX_FDS]);
    let (bytes, flags, raw) = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = socket::recvmsg::<()>(
            conn.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )?;
        let mut raw = Vec::new();
        // With MSG_CTRUNC (only when this process is out of descriptors: the buffer holds
        // SCM_MAX_FD) nix does not list what did arrive; the message is refused below.
        if let Ok(cmsgs) = msg.cmsgs() {
            for c in cmsgs {
                if let ControlMessageOwned::ScmRights(fds) = c {
                    raw.extend(fds);
                }
            }
        }
        (msg.bytes, msg.flags, raw)
    };
    let fds = adopt(raw);
    if bytes == 0 && fds.is_empty() {
        return Ok(None);
    }
    Ok(Some(Message {
        text: buf[..bytes].to_vec(),
        fds,
        cut: flags.intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC),
    }))
}

/// Sends one message with at most one descriptor; waits at most the socket's send timeout.
fn send(conn: &UnixStream, text: &str, fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let raw: Vec<RawFd> = fd.iter().map(|fd| fd.as_raw_fd()).collect();
    let cmsgs: Vec<ControlMessage<'_>> = if raw.is_empty() {
        Vec::new()
    } else {
        vec![ControlMessage::ScmRights(&raw)]
    };
    let iov = [IoSlice::new(text.as_bytes())];
    loop {
        match socket::sendmsg::<()>(conn.as_raw_fd(), &iov, &cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(n) if n == text.len() => return Ok(()),
            Ok(n) => {
                return Err(io::Error::other(format!(
                    "short send: {n} of {} bytes",
                    text.len()
                )));
            }
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

fn text_of(message: &Message) -> String {
    String::from_utf8_lossy(&message.text).into_owned()
}

// ---------------------------------------------------------------------------------------------
// The keeper process.

/// Runs the keeper of `root` until QUIT_IF_EMPTY empties it; returns at once, with Ok, when
/// another keeper holds the root. Blocking, one thread. Errors go to `log` (a file, appended)
/// or else to stderr, nothing else to disk.
///
/// Call it from the process's main thread before any other thread exists: SIGHUP and SIGPIPE
/// are blocked on the calling thread only, and a process-wide signal is delivered to any thread
/// that does not block it.
pub fn run_keeper(root: &Path, log: Option<&Path>) -> Result<(), KeeperError> {
    let log = Log::open(log);
    let result = keep(root, &log);
    if let Err(e) = &result {
        log.line(format_args!("{e}"));
    }
    result
}

fn keep(root: &Path, log: &Log) -> Result<(), KeeperError> {
    block_hangup_and_pipe(root)?;
    let Some(_lock) = lock_root(root)? else {
        return Ok(());
    };
    let socket_path = root.join(SOCKET_NAME);
    let listener = bind_private(root)?;
    let own_socket = socket_identity(&socket_path);
    // Wakes the accept now and then to look whether the root still exists.
    let _ = socket::setsockopt(
        &listener,
        sockopt::ReceiveTimeout,
        &TimeVal::seconds(ROOT_CHECK_SECONDS),
    );
    let own_uid = nix::unistd::geteuid().as_raw();
    let mut store = Store::new(MAX_HELD);
    loop {
        let conn = match listener.accept() {
            Ok((conn, _)) => conn,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                // The root was removed (a test's, or an uninstall) or another keeper took the
                // socket's place: nobody can reach this one any more.
                if own_socket.is_none() || socket_identity(&socket_path) != own_socket {
                    log.line(format_args!(
                        "{} is gone or no longer this keeper's: exiting",
                        socket_path.display()
                    ));
                    return Ok(());
                }
                continue;
            }
            Err(e) => {
                // EMFILE and the like pass; the pause keeps a lasting one from spinning.
                log.line(format_args!("accepting a connection: {e}"));
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        match serve(&conn, &mut store, own_uid) {
            Ok(Served::Continue) => {}
            Ok(Served::Quit) => break,
            Err(e) => log.line(format_args!("{e}")),
        }
    }
    // Removed while the lock is still held: a keeper that starts next binds its own socket, and
    // this one can never remove that.
    let _ = std::fs::remove_file(&socket_path);
    Ok(())
}

enum Served {
    Continue,
    Quit,
}

/// Serves the one request of a connection; an error is a line for the log.
fn serve(conn: &UnixStream, store: &mut Store, own_uid: u32) -> Result<Served, String> {
    conn.set_read_timeout(Some(CALL_TIMEOUT))
        .and_then(|()| conn.set_write_timeout(Some(CALL_TIMEOUT)))
        .map_err(|e| format!("setting timeouts: {e}"))?;
    let peer = socket::getsockopt(conn, sockopt::PeerCredentials).map_err(|e| format!("SO_PEERCRED: {e}"))?;
    if !peer_allowed(peer.uid(), own_uid) {
        let _ = send(
            conn,
            &format!("ERR permission denied: uid {} (only root)", peer.uid()),
            None,
        );
        return Err(format!(
            "refused pid {} uid {}: only root",
            peer.pid(),
            peer.uid()
        ));
    }
    let Some(mut message) = receive(conn).map_err(|e| format!("reading a request: {e}"))? else {
        return Ok(Served::Continue);
    };
    let parsed = if message.cut {
        Err(format!(
            "message cut (at most {MAX_MESSAGE} bytes and {MAX_FDS} descriptors, or the keeper is out of descriptors)"
        ))
    } else {
        parse_request(&message.text, message.fds.len())
    };
    let request = match parsed {
        Ok(request) => request,
        Err(why) => {
            // Closed before the answer: once refused, nothing of the request is held.
            message.fds.clear();
            let _ = send(conn, &format!("ERR {why}"), None);
            return Err(format!("refused {:?}: {why}", clip(&text_of(&message))));
        }
    };
    let answered = match request {
        Request::Put { kind, name } => match message.fds.pop() {
            Some(fd) => match store.put(name, kind, fd) {
                Ok(()) => send(conn, "OK", None),
                Err(why) => send(conn, &format!("ERR {why}"), None),
            },
            None => send(conn, "ERR PUT carries 1 descriptor(s), this one 0", None),
        },
        Request::Drop { name } => {
            store.drop_name(&name);
            send(conn, "OK", None)
        }
        Request::Take => store
            .take(|name, kind, fd| send(conn, &format!("HELD {kind} {name}"), Some(fd)))
            .and_then(|()| send(conn, "END", None)),
        Request::QuitIfEmpty => {
            let held = store.count();
            if held == 0 {
                // Quits even if the OK does not arrive: the keeper holds nothing to lose.
                let _ = send(conn, "OK", None);
                return Ok(Served::Quit);
            }
            send(conn, &format!("BUSY {held}"), None)
        }
        Request::Ping => send(conn, &format!("PONG {}", std::process::id()), None),
    };
    answered
        .map(|()| Served::Continue)
        .map_err(|e| format!("answering {:?}: {e}", clip(&text_of(&message))))
}

/// A SIGHUP (closed terminal, session leader gone) or SIGPIPE must not end the keeper. Blocked
/// rather than ignored: nix's `signal()` is unsafe, a blocked signal stays pending for ever.
fn block_hangup_and_pipe(root: &Path) -> Result<(), KeeperError> {
    let mut set = SigSet::empty();
    set.add(Signal::SIGHUP);
    set.add(Signal::SIGPIPE);
    pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&set), None).map_err(|e| KeeperError::Setup {
        context: "blocking SIGHUP and SIGPIPE for",
        path: root.to_path_buf(),
        source: e.into(),
    })
}

/// The lock of `root`, or None when another keeper holds it. Never removed: removing a lock
/// file races with the next process that opens it.
fn lock_root(root: &Path) -> Result<Option<Flock<File>>, KeeperError> {
    let path = root.join(LOCK_NAME);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(|source| KeeperError::Setup {
            context: "opening the lock",
            path: path.clone(),
            source,
        })?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(Some(lock)),
        Err((_, errno)) if errno == Errno::EWOULDBLOCK => Ok(None),
        Err((_, errno)) => Err(KeeperError::Setup {
            context: "locking",
            path,
            source: errno.into(),
        }),
    }
}

/// The keeper's socket: bound under a temporary name, made 0600, listening, then renamed over
/// whatever a previous keeper left (this one holds the lock: that keeper is gone).
/// How often an idle keeper looks whether its socket is still there.
const ROOT_CHECK_SECONDS: i64 = 5;

/// The socket file's device and inode, to tell it from a new one at the same path.
fn socket_identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

fn bind_private(root: &Path) -> Result<UnixListener, KeeperError> {
    let path = root.join(SOCKET_NAME);
    let tmp = root.join(format!(".{SOCKET_NAME}.new"));
    let setup = |context: &'static str, source: io::Error| KeeperError::Setup {
        context,
        path: path.clone(),
        source,
    };
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| setup("creating the socket", e.into()))?;
    let _ = std::fs::remove_file(&tmp);
    UnixAddr::new(&tmp)
        .and_then(|addr| socket::bind(fd.as_raw_fd(), &addr))
        .map_err(|e| setup("binding the socket", e.into()))?;
    let placed = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
        .and_then(|()| Ok(socket::listen(&fd, Backlog::new(128)?)?))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&tmp);
        return Err(setup("placing the socket", e));
    }
    Ok(UnixListener::from(fd))
}

/// Where the keeper's error lines go.
struct Log(Option<File>);

impl Log {
    fn open(path: Option<&Path>) -> Self {
        let Some(path) = path else { return Log(None) };
        match OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(path)
        {
            Ok(file) => Log(Some(file)),
            Err(e) => {
                let log = Log(None);
                log.line(format_args!(
                    "cannot open the log file {}: {e}; logging to stderr",
                    path.display()
                ));
                log
            }
        }
    }

    fn line(&self, what: fmt::Arguments<'_>) {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default();
        let line = format!(
            "{secs} gpu-mps gate keeper (pid {}): {what}\n",
            std::process::id()
        );
        let _ = match &self.0 {
            Some(file) => (&*file).write_all(line.as_bytes()),
            None => io::stderr().write_all(line.as_bytes()),
        };
    }
}

// ---------------------------------------------------------------------------------------------
// The manager's side.

/// The manager's handle on the keeper: one connection per call, every step under a timeout.
/// Calls block (at most a few times [`CALL_TIMEOUT`]): from async code, use spawn_blocking.
#[derive(Debug, Clone)]
pub struct KeeperClient {
    socket: PathBuf,
    timeout: Duration,
}

impl KeeperClient {
    /// The keeper of `root`, which must answer PING.
    pub fn connect(root: &Path) -> Result<KeeperClient, KeeperError> {
        let client = KeeperClient {
            socket: root.join(SOCKET_NAME),
            timeout: CALL_TIMEOUT,
        };
        client.ping()?;
        Ok(client)
    }

    /// The keeper of `root`; when nobody listens (no socket, or a stale one), first starts
    /// `keeper_exe keeper_args` (for the manager: its own executable and `--gate-keeper <root>`)
    /// in a new process group, stdio on /dev/null, cwd /, and waits up to [`SPAWN_TIMEOUT`] for
    /// it to answer. A keeper that answers slowly or wrongly is an error, not a reason to start
    /// a second one (it could not take the lock anyway).
    pub fn connect_or_spawn(
        root: &Path,
        keeper_exe: &Path,
        keeper_args: &[OsString],
    ) -> Result<KeeperClient, KeeperError> {
        match KeeperClient::connect(root) {
            Err(e) if e.nobody_listens() => {}
            connected => return connected,
        }
        let socket = root.join(SOCKET_NAME);
        let mut child = spawn_detached(keeper_exe, keeper_args)?;
        let deadline = Instant::now() + SPAWN_TIMEOUT;
        loop {
            std::thread::sleep(Duration::from_millis(10));
            match KeeperClient::connect(root) {
                Err(e) if e.nobody_listens() => {}
                connected => {
                    reap_in_background(child);
                    return connected;
                }
            }
            match child.try_wait() {
                Ok(Some(status)) if !status.success() => {
                    return Err(KeeperError::SpawnedExited {
                        exe: keeper_exe.to_path_buf(),
                        socket,
                        status,
                    });
                }
                // It found the lock taken, and the keeper holding it did not answer: one that
                // was quitting (QUIT_IF_EMPTY). Start another.
                Ok(Some(_)) => child = spawn_detached(keeper_exe, keeper_args)?,
                Ok(None) | Err(_) => {}
            }
            if Instant::now() >= deadline {
                reap_in_background(child);
                return Err(KeeperError::SpawnedSilent {
                    exe: keeper_exe.to_path_buf(),
                    socket,
                    waited: SPAWN_TIMEOUT,
                });
            }
        }
    }

    /// The keeper's pid.
    pub fn ping(&self) -> Result<u32, KeeperError> {
        let request = "PING";
        let conn = self.call(request, None)?;
        let answer = self.answer(&conn, request)?;
        let text = text_of(&answer);
        match text.strip_prefix("PONG ").map(str::parse::<u32>) {
            Some(Ok(pid)) => Ok(pid),
            _ => Err(self.unexpected(request, text, "PONG <pid>")),
        }
    }

    /// Every descriptor held: listeners (the keeper keeps its own duplicate) and parked
    /// connections (now the caller's only).
    pub fn take(&self) -> Result<Vec<Held>, KeeperError> {
        let request = "TAKE";
        let conn = self.call(request, None)?;
        let mut held = Vec::new();
        loop {
            let mut answer = self.answer(&conn, request)?;
            let text = text_of(&answer);
            if text == "END" {
                return Ok(held);
            }
            let parsed = text.strip_prefix("HELD ").map(parse_kind_name);
            match (parsed, answer.fds.len()) {
                (Some(Ok((kind, name))), 1) => {
                    if let Some(fd) = answer.fds.pop() {
                        held.push(Held {
                            name: name.to_string(),
                            kind,
                            fd,
                        });
                    }
                }
                _ => {
                    return Err(self.unexpected(
                        request,
                        text,
                        "HELD <kind> <name> with one descriptor, or END",
                    ));
                }
            }
        }
    }

    /// Hands the keeper a duplicate of `fd` (the caller keeps its own).
    pub fn put(&self, name: &str, kind: HeldKind, fd: BorrowedFd<'_>) -> Result<(), KeeperError> {
        valid_name(name)?;
        let request = format!("PUT {kind} {name}");
        let conn = self.call(&request, Some(fd))?;
        self.expect_ok(&conn, &request)
    }

    /// Closes and forgets every descriptor held under `name`.
    pub fn drop_name(&self, name: &str) -> Result<(), KeeperError> {
        valid_name(name)?;
        let request = format!("DROP {name}");
        let conn = self.call(&request, None)?;
        self.expect_ok(&conn, &request)
    }

    /// Ends the keeper if it holds nothing: true when it quit, false when it holds descriptors.
    pub fn quit_if_empty(&self) -> Result<bool, KeeperError> {
        let request = "QUIT_IF_EMPTY";
        let conn = self.call(request, None)?;
        let answer = self.answer(&conn, request)?;
        let text = text_of(&answer);
        if text == "OK" {
            Ok(true)
        } else if text
            .strip_prefix("BUSY ")
            .is_some_and(|n| n.parse::<usize>().is_ok())
        {
            Ok(false)
        } else {
            Err(self.unexpected(request, text, "OK or BUSY <count>"))
        }
    }

    /// Connects and sends one request.
    fn call(&self, request: &str, fd: Option<BorrowedFd<'_>>) -> Result<UnixStream, KeeperError> {
        let conn = socket::socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .map(UnixStream::from)
        .map_err(|e| self.failed(request, e.into()))?;
        // SO_SNDTIMEO also bounds a connect that waits on a full backlog.
        conn.set_read_timeout(Some(self.timeout))
            .and_then(|()| conn.set_write_timeout(Some(self.timeout)))
            .map_err(|e| self.failed(request, e))?;
        let addr = UnixAddr::new(&self.socket).map_err(|e| self.failed(request, e.into()))?;
        loop {
            match socket::connect(conn.as_raw_fd(), &addr) {
                Ok(()) => break,
                Err(Errno::EINTR) => continue,
                Err(e @ (Errno::ENOENT | Errno::ECONNREFUSED)) => {
                    return Err(KeeperError::NotRunning {
                        socket: self.socket.clone(),
                        source: e.into(),
                    });
                }
                Err(e) => return Err(self.failed(request, e.into())),
            }
        }
        send(&conn, request, fd).map_err(|e| self.failed(request, e))?;
        Ok(conn)
    }

    /// The next answer to `request`; an end of stream is an error.
    fn answer(&self, conn: &UnixStream, request: &str) -> Result<Message, KeeperError> {
        match receive(conn) {
            Ok(Some(message)) if message.cut => {
                Err(self.unexpected(request, text_of(&message), "an answer that fits"))
            }
            Ok(Some(message)) => Ok(message),
            Ok(None) => Err(self.failed(
                request,
                io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the keeper closed the connection without an answer",
                ),
            )),
            Err(e) => Err(self.failed(request, e)),
        }
    }

    fn expect_ok(&self, conn: &UnixStream, request: &str) -> Result<(), KeeperError> {
        let answer = self.answer(conn, request)?;
        let text = text_of(&answer);
        if text == "OK" {
            Ok(())
        } else {
            Err(self.unexpected(request, text, "OK"))
        }
    }

    fn failed(&self, request: &str, source: io::Error) -> KeeperError {
        match source.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => KeeperError::Timeout {
                socket: self.socket.clone(),
                request: request.to_string(),
                timeout: self.timeout,
            },
            _ => KeeperError::Io {
                socket: self.socket.clone(),
                request: request.to_string(),
                source,
            },
        }
    }

    /// An ERR answer is a refusal; anything else not expected, a protocol error.
    fn unexpected(&self, request: &str, answer: String, expected: &'static str) -> KeeperError {
        match answer.strip_prefix("ERR ") {
            Some(why) => KeeperError::Refused {
                socket: self.socket.clone(),
                request: request.to_string(),
                why: why.to_string(),
            },
            None => KeeperError::Protocol {
                socket: self.socket.clone(),
                request: request.to_string(),
                answer,
                expected,
            },
        }
    }
}

/// The gates keep their listening sockets in the keeper. Blocking: a hung keeper costs a gate
/// open or close [`CALL_TIMEOUT`] or two, then an error the gate logs.
impl crate::gate::ListenerStore for KeeperClient {
    fn keep(&self, name: &str, listener: BorrowedFd<'_>) -> Result<(), String> {
        self.put(name, HeldKind::Listener, listener)
            .map_err(|e| e.to_string())
    }

    fn forget(&self, name: &str) -> Result<(), String> {
        self.drop_name(name).map_err(|e| e.to_string())
    }
}

fn valid_name(name: &str) -> Result<(), KeeperError> {
    check_name(name).map_err(|why| KeeperError::InvalidName {
        name: name.to_string(),
        why,
    })
}

/// Starts the keeper out of reach of signals meant for the manager: its own process group, so
/// that a kill of the manager's group (a terminal's ^C, `kill -- -pgid`) misses it. Not its own
/// session: setsid() needs a fork between (pre_exec or fork, both unsafe) and fails in a group
/// leader; the session only brings a terminal's SIGHUP, which the keeper blocks. std resets the
/// signal mask in the child; the keeper sets its own.
fn spawn_detached(exe: &Path, args: &[OsString]) -> Result<Child, KeeperError> {
    Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .current_dir("/")
        .process_group(0)
        .spawn()
        .map_err(|source| KeeperError::Spawn {
            exe: exe.to_path_buf(),
            source,
        })
}

/// The keeper is the manager's child until the manager exits: wait for it so that a keeper
/// that quits does not stay a zombie.
fn reap_in_background(mut child: Child) {
    let _ = std::thread::Builder::new()
        .name("gate-keeper-reaper".to_string())
        .spawn(move || {
            let _ = child.wait();
        });
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::io::Read;
    use std::sync::mpsc;
    use std::thread::JoinHandle;

    use super::*;

    // --- pure decisions ---

    #[test]
    fn requests_are_parsed_strictly() {
        let long = "x".repeat(MAX_NAME + 1);
        let longest = "x".repeat(MAX_NAME);
        let put = |kind, name: &str| Request::Put {
            kind,
            name: name.to_string(),
        };
        let cases: Vec<(Vec<u8>, usize, Result<Request, &str>)> = vec![
            (
                b"PUT listener gate-a".to_vec(),
                1,
                Ok(put(HeldKind::Listener, "gate-a")),
            ),
            (
                b"PUT parked gate a b".to_vec(),
                1,
                Ok(put(HeldKind::Parked, "gate a b")),
            ),
            (
                format!("PUT listener {longest}").into_bytes(),
                1,
                Ok(put(HeldKind::Listener, &longest)),
            ),
            (
                b"DROP gate-a".to_vec(),
                0,
                Ok(Request::Drop {
                    name: "gate-a".to_string(),
                }),
            ),
            (b"TAKE".to_vec(), 0, Ok(Request::Take)),
            (b"QUIT_IF_EMPTY".to_vec(), 0, Ok(Request::QuitIfEmpty)),
            (b"PING".to_vec(), 0, Ok(Request::Ping)),
            (
                b"PUT listener gate-a".to_vec(),
                0,
                Err("PUT carries 1 descriptor(s), this one 0"),
            ),
            (
                b"PUT listener gate-a".to_vec(),
                2,
                Err("PUT carries 1 descriptor(s), this one 2"),
            ),
            (
                b"PING".to_vec(),
                1,
                Err("PING carries 0 descriptor(s), this one 1"),
            ),
            (
                b"PUT socket gate-a".to_vec(),
                1,
                Err("unknown kind \"socket\" (listener or parked)"),
            ),
            (b"PUT listener".to_vec(), 1, Err("expected <kind> <name>")),
            (b"PUT listener ".to_vec(), 1, Err("empty name")),
            (b"PUT".to_vec(), 1, Err("PUT needs arguments")),
            (b"PUT listener a/b".to_vec(), 1, Err("name contains '/'")),
            (b"PUT listener a\0b".to_vec(), 1, Err("name contains NUL")),
            (
                format!("PUT listener {long}").into_bytes(),
                1,
                Err("name of 129 bytes (at most 128)"),
            ),
            (b"DROP ..".to_vec(), 0, Err("name is \"..\"")),
            (b"DROP".to_vec(), 0, Err("DROP needs arguments")),
            (b"TAKE all".to_vec(), 0, Err("TAKE takes no argument")),
            (
                b"take".to_vec(),
                0,
                Err("unknown request \"take\" (PUT, DROP, TAKE, QUIT_IF_EMPTY, PING)"),
            ),
            (
                b"".to_vec(),
                0,
                Err("unknown request \"\" (PUT, DROP, TAKE, QUIT_IF_EMPTY, PING)"),
            ),
            (
                b"PING\n".to_vec(),
                0,
                Err("unknown request \"PING\\n\" (PUT, DROP, TAKE, QUIT_IF_EMPTY, PING)"),
            ),
            (b"\xff\xfe".to_vec(), 0, Err("request is not UTF-8")),
        ];
        for (message, fds, expected) in cases {
            let got = parse_request(&message, fds);
            assert_eq!(
                got,
                expected.map_err(str::to_string),
                "{:?} with {fds} descriptors",
                String::from_utf8_lossy(&message)
            );
        }
    }

    #[test]
    fn only_root_or_the_keepers_own_user_may_talk() {
        assert!(peer_allowed(0, 0));
        assert!(!peer_allowed(1000, 0));
        assert!(!peer_allowed(65534, 0));
        // A keeper run by an unprivileged user (tests): root and that user.
        assert!(peer_allowed(0, 1000));
        assert!(peer_allowed(1000, 1000));
        assert!(!peer_allowed(1001, 1000));
    }

    fn some_fd() -> OwnedFd {
        OwnedFd::from(File::open("/dev/null").unwrap())
    }

    #[test]
    fn the_store_is_capped_and_a_listener_replaces_its_name() {
        let mut store = Store::new(2);
        store.put("a".into(), HeldKind::Listener, some_fd()).unwrap();
        store.put("a".into(), HeldKind::Parked, some_fd()).unwrap();
        let full = store.put("b".into(), HeldKind::Parked, some_fd()).unwrap_err();
        assert_eq!(full, "full: 2 descriptors held (at most 2)");
        // Replacing does not grow.
        store.put("a".into(), HeldKind::Listener, some_fd()).unwrap();
        assert_eq!(store.count(), 2);
        store.drop_name("a");
        assert_eq!(store.count(), 0);
        assert!(store.entries.is_empty());
    }

    #[test]
    fn a_parked_descriptor_is_forgotten_only_once_sent() {
        let mut store = Store::new(MAX_HELD);
        store.put("g".into(), HeldKind::Listener, some_fd()).unwrap();
        for _ in 0..3 {
            store.put("g".into(), HeldKind::Parked, some_fd()).unwrap();
        }
        let mut sent = Vec::new();
        let failed = store.take(|name, kind, _| {
            if sent.len() == 2 {
                return Err(io::Error::other("peer gone"));
            }
            sent.push((name.to_string(), kind));
            Ok(())
        });
        assert!(failed.is_err());
        assert_eq!(
            sent,
            vec![
                ("g".to_string(), HeldKind::Listener),
                ("g".to_string(), HeldKind::Parked)
            ]
        );
        // The listener stays, one parked went, two wait for the next TAKE.
        assert_eq!(store.count(), 3);
        let mut kinds = Vec::new();
        store
            .take(|_, kind, _| {
                kinds.push(kind);
                Ok(())
            })
            .unwrap();
        assert_eq!(
            kinds,
            vec![HeldKind::Listener, HeldKind::Parked, HeldKind::Parked]
        );
        assert_eq!(store.count(), 1);
    }

    // --- a keeper in a thread ---

    struct Keeper {
        dir: tempfile::TempDir,
        client: KeeperClient,
        done: mpsc::Receiver<Result<(), KeeperError>>,
        _thread: JoinHandle<()>,
    }

    impl Keeper {
        fn root(&self) -> &Path {
            self.dir.path()
        }
    }

    fn start_keeper_in(dir: tempfile::TempDir) -> Keeper {
        start_keeper_logging(dir, None)
    }

    fn start_keeper_logging(dir: tempfile::TempDir, log: Option<PathBuf>) -> Keeper {
        let root = dir.path().to_path_buf();
        let (tx, done) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            let _ = tx.send(run_keeper(&root, log.as_deref()));
        });
        let client = wait_for_keeper(dir.path());
        Keeper {
            dir,
            client,
            done,
            _thread: thread,
        }
    }

    fn start_keeper() -> Keeper {
        start_keeper_in(tempfile::tempdir().unwrap())
    }

    fn wait_for_keeper(root: &Path) -> KeeperClient {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match KeeperClient::connect(root) {
                Ok(client) => return client,
                Err(e) if Instant::now() > deadline => panic!("no keeper: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }

    fn seqpacket() -> OwnedFd {
        socket::socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap()
    }

    /// A gate's listening socket at `path`.
    fn listen_at(path: &Path) -> UnixListener {
        let fd = seqpacket();
        socket::bind(fd.as_raw_fd(), &UnixAddr::new(path).unwrap()).unwrap();
        socket::listen(&fd, Backlog::new(16).unwrap()).unwrap();
        UnixListener::from(fd)
    }

    fn connect_to(path: &Path) -> io::Result<UnixStream> {
        let fd = seqpacket();
        socket::connect(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
        Ok(UnixStream::from(fd))
    }

    fn pair() -> (UnixStream, UnixStream) {
        let (a, b) = socket::socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .unwrap();
        (UnixStream::from(a), UnixStream::from(b))
    }

    fn read_message(stream: &UnixStream) -> Vec<u8> {
        stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 64];
        let n = (&*stream).read(&mut buf).unwrap();
        buf[..n].to_vec()
    }

    fn refused(result: io::Result<UnixStream>) -> bool {
        matches!(result, Err(e) if e.kind() == io::ErrorKind::ConnectionRefused)
    }

    #[test]
    fn a_held_listener_keeps_the_gate_listening_and_comes_back_on_take() {
        let keeper = start_keeper();
        let gate = keeper.root().join("control");
        let listener = listen_at(&gate);
        keeper
            .client
            .put("gate-a", HeldKind::Listener, listener.as_fd())
            .unwrap();
        // The manager dies: its copy closes.
        drop(listener);

        // A CUDA client connects in the window: it waits in the backlog.
        let client = connect_to(&gate).unwrap();
        (&client).write_all(b"hello").unwrap();

        // The next manager takes the listener back and serves the waiting client.
        let held = keeper.client.take().unwrap();
        assert_eq!(held.len(), 1);
        assert_eq!(
            (held[0].name.as_str(), held[0].kind),
            ("gate-a", HeldKind::Listener)
        );
        let taken = UnixListener::from(held.into_iter().next().unwrap().fd);
        taken.set_nonblocking(true).unwrap();
        let (served, _) = taken.accept().expect("the connection made in the window waits");
        served.set_nonblocking(false).unwrap();
        assert_eq!(read_message(&served), b"hello");
        (&served).write_all(b"welcome").unwrap();
        assert_eq!(read_message(&client), b"welcome");

        // The keeper kept its duplicate for the next restart.
        drop(taken);
        assert!(connect_to(&gate).is_ok());
        let again = keeper.client.take().unwrap();
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].kind, HeldKind::Listener);
    }

    #[test]
    fn the_gates_keep_and_forget_listeners_through_the_store_trait() {
        use crate::gate::ListenerStore;
        let keeper = start_keeper();
        let gate = keeper.root().join("control");
        let listener = listen_at(&gate);
        let store: &dyn ListenerStore = &keeper.client;
        store.keep("gate-a", listener.as_fd()).unwrap();
        drop(listener);
        assert!(connect_to(&gate).is_ok());
        let held = keeper.client.take().unwrap();
        assert_eq!(
            (held[0].name.as_str(), held[0].kind),
            ("gate-a", HeldKind::Listener)
        );
        drop(held);
        store.forget("gate-a").unwrap();
        assert!(refused(connect_to(&gate)));
        let bad = store.keep("a/b", some_fd().as_fd()).unwrap_err();
        assert!(bad.contains("name contains '/'"), "{bad}");
    }

    #[test]
    fn put_replaces_the_listener_of_a_name() {
        let keeper = start_keeper();
        let (old_path, new_path) = (keeper.root().join("old"), keeper.root().join("new"));
        let (old, new) = (listen_at(&old_path), listen_at(&new_path));
        keeper
            .client
            .put("gate-a", HeldKind::Listener, old.as_fd())
            .unwrap();
        keeper
            .client
            .put("gate-a", HeldKind::Listener, new.as_fd())
            .unwrap();
        drop((old, new));
        assert!(refused(connect_to(&old_path)), "the replaced listener is closed");
        assert!(connect_to(&new_path).is_ok());
        let held = keeper.client.take().unwrap();
        assert_eq!(held.len(), 1);
    }

    #[test]
    fn drop_closes_every_descriptor_of_the_name() {
        let keeper = start_keeper();
        let gate = keeper.root().join("control");
        let listener = listen_at(&gate);
        let (client_end, parked) = pair();
        keeper
            .client
            .put("gate-a", HeldKind::Listener, listener.as_fd())
            .unwrap();
        keeper
            .client
            .put("gate-a", HeldKind::Parked, parked.as_fd())
            .unwrap();
        let other = listen_at(&keeper.root().join("other"));
        keeper
            .client
            .put("gate-b", HeldKind::Listener, other.as_fd())
            .unwrap();
        drop((listener, parked, other));

        keeper.client.drop_name("gate-a").unwrap();
        assert!(refused(connect_to(&gate)));
        assert_eq!(read_message(&client_end), b"", "the parked connection is closed");
        let held = keeper.client.take().unwrap();
        assert_eq!(
            held.iter().map(|h| h.name.as_str()).collect::<Vec<_>>(),
            vec!["gate-b"]
        );
        // Dropping what is not held is fine (a stop after a restart that lost nothing).
        keeper.client.drop_name("never-held").unwrap();
    }

    #[test]
    fn parked_connections_are_handed_over_once() {
        let keeper = start_keeper();
        let (a1, b1) = pair();
        let (a2, b2) = pair();
        keeper.client.put("gate-a", HeldKind::Parked, b1.as_fd()).unwrap();
        keeper.client.put("gate-a", HeldKind::Parked, b2.as_fd()).unwrap();
        drop((b1, b2));
        let held = keeper.client.take().unwrap();
        assert_eq!(held.len(), 2, "both parked under one name are kept");
        for (h, client) in held.into_iter().zip([&a1, &a2]) {
            assert_eq!((h.name.as_str(), h.kind), ("gate-a", HeldKind::Parked));
            let taken = UnixStream::from(h.fd);
            (&taken).write_all(b"served").unwrap();
            assert_eq!(read_message(client), b"served");
        }
        assert!(keeper.client.take().unwrap().is_empty(), "handed over once");
    }

    /// Sends raw bytes and descriptors, returns the answer's text.
    fn raw_request(root: &Path, message: &[u8], fds: &[BorrowedFd<'_>]) -> String {
        let conn = connect_to(&root.join(SOCKET_NAME)).unwrap();
        let raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
        let cmsgs: Vec<ControlMessage<'_>> = if raw.is_empty() {
            Vec::new()
        } else {
            vec![ControlMessage::ScmRights(&raw)]
        };
        socket::sendmsg::<()>(
            conn.as_raw_fd(),
            &[IoSlice::new(message)],
            &cmsgs,
            MsgFlags::empty(),
            None,
        )
        .unwrap();
        String::from_utf8(read_message_long(&conn)).unwrap()
    }

    fn read_message_long(stream: &UnixStream) -> Vec<u8> {
        stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 1024];
        let n = (&*stream).read(&mut buf).unwrap();
        buf[..n].to_vec()
    }

    #[test]
    fn malformed_requests_are_refused_and_their_descriptors_closed() {
        let keeper = start_keeper();
        let root = keeper.root();
        let gate = root.join("control");
        let listener = listen_at(&gate);
        let fd = listener.as_fd();
        let long = format!("PUT listener {}", "x".repeat(MAX_NAME + 1));
        let huge = format!("PUT listener {}", "x".repeat(MAX_MESSAGE));
        let cases: Vec<(&[u8], Vec<BorrowedFd<'_>>, &str)> = vec![
            (b"HELLO", vec![], "ERR unknown request \"HELLO\""),
            (b"PUT listener", vec![fd], "ERR expected <kind> <name>"),
            (b"PUT socket gate-a", vec![fd], "ERR unknown kind"),
            (
                b"PUT listener gate-a",
                vec![],
                "ERR PUT carries 1 descriptor(s), this one 0",
            ),
            (
                b"PUT listener gate-a",
                vec![fd, fd],
                "ERR PUT carries 1 descriptor(s), this one 2",
            ),
            (b"PUT listener gates/a", vec![fd], "ERR name contains '/'"),
            (b"PUT listener gate\0a", vec![fd], "ERR name contains NUL"),
            (long.as_bytes(), vec![fd], "ERR name of 129 bytes (at most 128)"),
            (huge.as_bytes(), vec![fd], "ERR message cut"),
            (b"\xffPING", vec![], "ERR request is not UTF-8"),
            (b"DROP ..", vec![], "ERR name is \"..\""),
            (b"TAKE now", vec![], "ERR TAKE takes no argument"),
            (b"PING", vec![fd], "ERR PING carries 0 descriptor(s), this one 1"),
        ];
        for (message, fds, expected) in cases {
            let answer = raw_request(root, message, &fds);
            assert!(
                answer.starts_with(expected),
                "{:?}: got {answer:?}, expected {expected:?}",
                String::from_utf8_lossy(message)
            );
        }
        // Nothing was kept: every descriptor that came with a refused request was closed.
        drop(listener);
        assert!(refused(connect_to(&gate)));
        assert!(keeper.client.take().unwrap().is_empty());
        keeper.client.ping().unwrap();
        // The client refuses a bad name before sending it.
        let (_a, b) = pair();
        let bad = keeper.client.put("a/b", HeldKind::Parked, b.as_fd()).unwrap_err();
        assert!(matches!(bad, KeeperError::InvalidName { .. }), "{bad}");
    }

    #[test]
    fn errors_go_to_the_log_file_and_only_errors() {
        let logs = tempfile::tempdir().unwrap();
        let log = logs.path().join("keeper.log");
        let keeper = start_keeper_logging(tempfile::tempdir().unwrap(), Some(log.clone()));
        keeper.client.take().unwrap();
        assert_eq!(
            std::fs::read_to_string(&log).unwrap(),
            "",
            "nothing logged on success"
        );
        assert!(raw_request(keeper.root(), b"HELLO", &[]).starts_with("ERR "));
        // The keeper logs after it answered.
        let deadline = Instant::now() + Duration::from_secs(5);
        let logged = loop {
            let logged = std::fs::read_to_string(&log).unwrap();
            if logged.ends_with('\n') || Instant::now() > deadline {
                break logged;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(logged.lines().count(), 1, "{logged}");
        assert!(logged.contains("gpu-mps gate keeper (pid "), "{logged}");
        assert!(logged.contains("refused \"HELLO\": unknown request"), "{logged}");
    }

    #[test]
    fn the_socket_is_private_and_nothing_else_is_written() {
        let keeper = start_keeper();
        let mode = std::fs::metadata(keeper.root().join(SOCKET_NAME))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let mut names: Vec<_> = std::fs::read_dir(keeper.root())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, vec![LOCK_NAME, SOCKET_NAME]);
        assert_eq!(keeper.client.ping().unwrap(), std::process::id());
    }

    #[test]
    fn one_keeper_per_root() {
        let keeper = start_keeper();
        let listener = listen_at(&keeper.root().join("control"));
        keeper
            .client
            .put("gate-a", HeldKind::Listener, listener.as_fd())
            .unwrap();
        let root = keeper.root().to_path_buf();
        let (tx, second) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(run_keeper(&root, None));
        });
        let result = second
            .recv_timeout(Duration::from_secs(5))
            .expect("a second keeper of the same root returns at once");
        assert!(result.is_ok(), "{result:?}");
        // The first one still serves, with what it held.
        assert_eq!(keeper.client.take().unwrap().len(), 1);
    }

    #[test]
    fn quit_if_empty_quits_only_when_nothing_is_held() {
        let keeper = start_keeper();
        let listener = listen_at(&keeper.root().join("control"));
        let (_client_end, parked) = pair();
        keeper
            .client
            .put("gate-a", HeldKind::Listener, listener.as_fd())
            .unwrap();
        keeper
            .client
            .put("gate-b", HeldKind::Parked, parked.as_fd())
            .unwrap();
        assert!(!keeper.client.quit_if_empty().unwrap());
        // Handed over, the parked connection no longer keeps it; the listener does.
        assert_eq!(keeper.client.take().unwrap().len(), 2);
        assert!(!keeper.client.quit_if_empty().unwrap());
        assert!(
            keeper.done.recv_timeout(Duration::from_millis(200)).is_err(),
            "still running"
        );
        keeper.client.drop_name("gate-a").unwrap();
        assert!(keeper.client.quit_if_empty().unwrap());
        let ended = keeper
            .done
            .recv_timeout(Duration::from_secs(5))
            .expect("the keeper ended");
        assert!(ended.is_ok(), "{ended:?}");
        assert!(!keeper.root().join(SOCKET_NAME).exists());
        let gone = KeeperClient::connect(keeper.root()).unwrap_err();
        assert!(gone.nobody_listens(), "{gone}");
        // The lock is free again: a new keeper starts in the same root.
        let Keeper { dir, .. } = keeper;
        let next = start_keeper_in(dir);
        next.client.ping().unwrap();
    }

    #[test]
    fn a_stale_socket_is_nobody_and_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        drop(listen_at(&dir.path().join(SOCKET_NAME)));
        let stale = KeeperClient::connect(dir.path()).unwrap_err();
        assert!(stale.nobody_listens(), "{stale}");
        let keeper = start_keeper_in(dir);
        keeper.client.ping().unwrap();
    }

    #[test]
    fn a_hung_keeper_times_out_and_is_not_replaced() {
        let dir = tempfile::tempdir().unwrap();
        // Listens, never accepts.
        let _hung = listen_at(&dir.path().join(SOCKET_NAME));
        let client = KeeperClient {
            socket: dir.path().join(SOCKET_NAME),
            timeout: Duration::from_millis(300),
        };
        let started = Instant::now();
        let e = client.ping().unwrap_err();
        assert!(matches!(e, KeeperError::Timeout { .. }), "{e}");
        assert!(started.elapsed() < Duration::from_secs(2));
        // No spawn either: the executable does not exist, so trying would be a Spawn error.
        let e =
            KeeperClient::connect_or_spawn(dir.path(), Path::new("/nonexistent/keeper"), &[]).unwrap_err();
        assert!(matches!(e, KeeperError::Timeout { .. }), "{e}");
    }

    #[test]
    fn a_keeper_that_cannot_start_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let e =
            KeeperClient::connect_or_spawn(dir.path(), Path::new("/nonexistent/keeper"), &[]).unwrap_err();
        assert!(matches!(e, KeeperError::Spawn { .. }), "{e}");
        let e = KeeperClient::connect_or_spawn(dir.path(), Path::new("/bin/false"), &[]).unwrap_err();
        assert!(matches!(e, KeeperError::SpawnedExited { .. }), "{e}");
    }

    // --- a keeper process that outlives its spawner ---
    //
    // The test binary plays both processes: run with `--exact <one of the two tests below>` and
    // KEEPER_TEST_ROOT set, it is a keeper or a spawner; in a normal run (no variable) both tests
    // pass at once.

    const KEEPER_TEST_ROOT: &str = "GPU_MPS_GATE_KEEPER_TEST_ROOT";
    const KEEPER_PROCESS: &str = "gate_keeper::tests::keeper_process";
    const SPAWNER_PROCESS: &str = "gate_keeper::tests::spawner_process";

    fn harness_args(test: &str) -> Vec<OsString> {
        ["--exact", test, "--test-threads=1", "--quiet"]
            .map(OsString::from)
            .to_vec()
    }

    #[test]
    fn keeper_process() {
        let Some(root) = std::env::var_os(KEEPER_TEST_ROOT) else {
            return;
        };
        let result = run_keeper(Path::new(&root), None);
        std::process::exit(i32::from(result.is_err()));
    }

    #[test]
    fn spawner_process() {
        let Some(root) = std::env::var_os(KEEPER_TEST_ROOT) else {
            return;
        };
        let exe = std::env::current_exe().unwrap();
        match KeeperClient::connect_or_spawn(Path::new(&root), &exe, &harness_args(KEEPER_PROCESS)) {
            // Stays, like a manager, until the test kills its process group (bounded, should
            // the test die first).
            Ok(_) => {
                std::thread::sleep(Duration::from_secs(120));
                std::process::exit(0);
            }
            Err(e) => {
                eprintln!("spawner: {e}");
                std::process::exit(3);
            }
        }
    }

    /// What a failing test leaves running is killed: the keeper by its pid, the spawner by its
    /// process group (its own, the spawner's pid).
    #[derive(Default)]
    struct Cleanup {
        keeper: Option<nix::unistd::Pid>,
        spawner_group: Option<nix::unistd::Pid>,
    }

    impl Drop for Cleanup {
        fn drop(&mut self) {
            if let Some(group) = self.spawner_group {
                let _ = nix::sys::signal::killpg(group, Signal::SIGKILL);
            }
            if let Some(pid) = self.keeper {
                let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
            }
        }
    }

    #[test]
    fn a_spawned_keeper_outlives_its_spawner() {
        let dir = tempfile::tempdir().unwrap();
        // A dead keeper's socket: the spawner must see nobody and start one.
        drop(listen_at(&dir.path().join(SOCKET_NAME)));
        let mut spawner = Command::new(std::env::current_exe().unwrap())
            .args(harness_args(SPAWNER_PROCESS))
            .env(KEEPER_TEST_ROOT, dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap();
        let spawner_pid = nix::unistd::Pid::from_raw(i32::try_from(spawner.id()).unwrap());
        let mut cleanup = Cleanup {
            spawner_group: Some(spawner_pid),
            ..Cleanup::default()
        };

        let deadline = Instant::now() + Duration::from_secs(10);
        let client = loop {
            if let Ok(client) = KeeperClient::connect(dir.path()) {
                break client;
            }
            if let Some(status) = spawner.try_wait().unwrap() {
                let mut why = String::new();
                let _ = spawner.stderr.take().unwrap().read_to_string(&mut why);
                panic!("the spawner ended before a keeper answered: {status}: {why}");
            }
            assert!(Instant::now() < deadline, "no keeper answered");
            std::thread::sleep(Duration::from_millis(20));
        };
        let keeper_pid = client.ping().unwrap();
        let keeper = nix::unistd::Pid::from_raw(i32::try_from(keeper_pid).unwrap());
        cleanup.keeper = Some(keeper);
        assert_ne!(keeper_pid, spawner.id());
        assert_ne!(keeper_pid, std::process::id());

        // The manager's whole process group is killed.
        nix::sys::signal::killpg(spawner_pid, Signal::SIGKILL).unwrap();
        spawner.wait().unwrap();
        cleanup.spawner_group = None;
        std::thread::sleep(Duration::from_millis(100));

        let after = client.ping();
        assert_eq!(
            after.ok(),
            Some(keeper_pid),
            "the keeper survived the kill of its spawner's group"
        );
        assert_eq!(
            nix::unistd::getpgid(Some(keeper)).unwrap(),
            keeper,
            "its own process group"
        );
        // And it holds descriptors across processes.
        let gate = dir.path().join("control");
        let listener = listen_at(&gate);
        client
            .put("gate-a", HeldKind::Listener, listener.as_fd())
            .unwrap();
        drop(listener);
        let waiting = connect_to(&gate).unwrap();
        let held = client.take().unwrap();
        assert_eq!(held.len(), 1);
        let taken = UnixListener::from(held.into_iter().next().unwrap().fd);
        taken.set_nonblocking(true).unwrap();
        let (served, _) = taken.accept().unwrap();
        served.set_nonblocking(false).unwrap();
        (&served).write_all(b"ok").unwrap();
        assert_eq!(read_message(&waiting), b"ok");

        client.drop_name("gate-a").unwrap();
        assert!(client.quit_if_empty().unwrap());
        let deadline = Instant::now() + Duration::from_secs(5);
        while KeeperClient::connect(dir.path()).is_ok() {
            assert!(Instant::now() < deadline, "the keeper did not quit");
            std::thread::sleep(Duration::from_millis(20));
        }
        // It quit: its pid may be reused from now on, never kill it.
        cleanup.keeper = None;
    }
}
