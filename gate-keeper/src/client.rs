//! The manager's side of the keeper: one connection per call, every step under a timeout.

use std::ffi::OsString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr};

use crate::protocol::{LISTENER, check_name, parse_kind_name};
use crate::wire::{Message, receive, send};
use crate::{CALL_TIMEOUT, KeeperError, SOCKET_NAME, SPAWN_TIMEOUT};

/// A listener handed back by TAKE; the caller owns this duplicate.
#[derive(Debug)]
pub struct Held {
    pub name: String,
    pub fd: OwnedFd,
}

/// The manager's handle on the keeper: one connection per call, every step under a timeout.
/// Calls block (at most a few times [`CALL_TIMEOUT`]): from async code, use spawn_blocking.
#[derive(Debug, Clone)]
pub struct KeeperClient {
    pub(crate) socket: PathBuf,
    pub(crate) timeout: Duration,
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
        let text = answer.text();
        match text.strip_prefix("PONG ").map(str::parse::<u32>) {
            Some(Ok(pid)) => Ok(pid),
            _ => Err(self.unexpected(request, text, "PONG <pid>")),
        }
    }

    /// The keeper's protocol version: 1 for a keeper older than the VERSION request.
    pub fn protocol_version(&self) -> Result<u32, KeeperError> {
        let request = "VERSION";
        let conn = self.call(request, None)?;
        let answer = self.answer(&conn, request)?;
        let text = answer.text();
        if text.starts_with("ERR unknown request") {
            return Ok(1);
        }
        match text.strip_prefix("VERSION ").map(str::parse::<u32>) {
            Some(Ok(version)) => Ok(version),
            _ => Err(self.unexpected(request, text, "VERSION <n>")),
        }
    }

    /// Every listener held (the keeper keeps its own duplicates).
    pub fn take(&self) -> Result<Vec<Held>, KeeperError> {
        let request = "TAKE";
        let conn = self.call(request, None)?;
        let mut held = Vec::new();
        loop {
            let mut answer = self.answer(&conn, request)?;
            let text = answer.text();
            if text == "END" {
                return Ok(held);
            }
            let parsed = text.strip_prefix("HELD ").map(parse_kind_name);
            match (parsed, answer.fds.pop(), answer.fds.is_empty()) {
                (Some(Ok(name)), Some(fd), true) => held.push(Held {
                    name: name.to_string(),
                    fd,
                }),
                _ => {
                    return Err(self.unexpected(
                        request,
                        text,
                        "HELD listener <name> with one descriptor, or END",
                    ));
                }
            }
        }
    }

    /// Hands the keeper a duplicate of a gate's listening socket (the caller keeps its own); it
    /// replaces the one held under `name`, if any.
    pub fn put_listener(&self, name: &str, fd: BorrowedFd<'_>) -> Result<(), KeeperError> {
        valid_name(name)?;
        let request = format!("PUT {LISTENER} {name}");
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
        let text = answer.text();
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
                Err(self.unexpected(request, message.text(), "an answer that fits"))
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
        let text = answer.text();
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
