//! The keeper's process: one thread, one request per connection, nothing on disk but its
//! socket, its lock and (if given) its log.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use nix::sys::signal::{SigSet, SigmaskHow, Signal, pthread_sigmask};
use nix::sys::socket::{self, AddressFamily, Backlog, SockFlag, SockType, UnixAddr, sockopt};
use nix::sys::time::{TimeVal, TimeValLike};

use crate::fd_passing::MAX_FDS;
use crate::protocol::{LISTENER, MAX_MESSAGE, Request, clip, parse_request, peer_allowed};
use crate::store::Store;
use crate::wire::{receive, send};
use crate::{CALL_TIMEOUT, KeeperError, LOCK_NAME, MAX_HELD, PROTOCOL_VERSION, SOCKET_NAME};

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
            return Err(format!("refused {:?}: {why}", clip(&message.text())));
        }
    };
    let answered = match request {
        Request::Put { name } => match message.fds.pop() {
            Some(fd) => match store.put(name, fd) {
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
            .take(|name, fd| send(conn, &format!("HELD {LISTENER} {name}"), Some(fd)))
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
        Request::Version => send(conn, &format!("VERSION {PROTOCOL_VERSION}"), None),
    };
    answered
        .map(|()| Served::Continue)
        .map_err(|e| format!("answering {:?}: {e}", clip(&message.text())))
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

/// How often an idle keeper looks whether its socket is still there.
const ROOT_CHECK_SECONDS: i64 = 5;

/// The socket file's device and inode, to tell it from a new one at the same path.
fn socket_identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// The keeper's socket: bound under a temporary name, made 0600, listening, then renamed over
/// whatever a previous keeper left (this one holds the lock: that keeper is gone).
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
