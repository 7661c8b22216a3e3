//! The keeper and its client together: a keeper in a thread of the test, or a process.
#![allow(clippy::unwrap_used)]
use std::ffi::OsString;
use std::fs::File;
use std::io::{self, IoSlice, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use nix::sys::socket::{
    self, AddressFamily, Backlog, ControlMessage, MsgFlags, SockFlag, SockType, UnixAddr,
};

use crate::protocol::MAX_MESSAGE;
use crate::*;

fn some_fd() -> OwnedFd {
    OwnedFd::from(File::open("/dev/null").unwrap())
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
    keeper.client.put_listener("gate-a", listener.as_fd()).unwrap();
    // The manager dies: its copy closes.
    drop(listener);

    // A CUDA client connects in the window: it waits in the backlog.
    let client = connect_to(&gate).unwrap();
    (&client).write_all(b"hello").unwrap();

    // The next manager takes the listener back and serves the waiting client.
    let held = keeper.client.take().unwrap();
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].name, "gate-a");
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
    assert_eq!(again[0].name, "gate-a");
}

#[test]
fn put_replaces_the_listener_of_a_name() {
    let keeper = start_keeper();
    let (old_path, new_path) = (keeper.root().join("old"), keeper.root().join("new"));
    let (old, new) = (listen_at(&old_path), listen_at(&new_path));
    keeper.client.put_listener("gate-a", old.as_fd()).unwrap();
    keeper.client.put_listener("gate-a", new.as_fd()).unwrap();
    drop((old, new));
    assert!(refused(connect_to(&old_path)), "the replaced listener is closed");
    assert!(connect_to(&new_path).is_ok());
    let held = keeper.client.take().unwrap();
    assert_eq!(held.len(), 1);
}

#[test]
fn drop_closes_the_listener_of_the_name_only() {
    let keeper = start_keeper();
    let gate = keeper.root().join("control");
    let listener = listen_at(&gate);
    keeper.client.put_listener("gate-a", listener.as_fd()).unwrap();
    let other = listen_at(&keeper.root().join("other"));
    keeper.client.put_listener("gate-b", other.as_fd()).unwrap();
    drop((listener, other));

    keeper.client.drop_name("gate-a").unwrap();
    assert!(refused(connect_to(&gate)));
    let held = keeper.client.take().unwrap();
    assert_eq!(
        held.iter().map(|h| h.name.as_str()).collect::<Vec<_>>(),
        vec!["gate-b"]
    );
    // Dropping what is not held is fine (a stop after a restart that lost nothing).
    keeper.client.drop_name("never-held").unwrap();
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
        (b"PUT parked gate-a", vec![fd], "ERR unknown kind \"parked\""),
        (b"VERSION 1", vec![], "ERR VERSION takes no argument"),
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
    let bad = keeper.client.put_listener("a/b", some_fd().as_fd()).unwrap_err();
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
    keeper.client.put_listener("gate-a", listener.as_fd()).unwrap();
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
    let other = listen_at(&keeper.root().join("other"));
    keeper.client.put_listener("gate-a", listener.as_fd()).unwrap();
    keeper.client.put_listener("gate-b", other.as_fd()).unwrap();
    assert!(!keeper.client.quit_if_empty().unwrap());
    // Handed over, a listener still keeps it: TAKE hands duplicates.
    assert_eq!(keeper.client.take().unwrap().len(), 2);
    assert!(!keeper.client.quit_if_empty().unwrap());
    keeper.client.drop_name("gate-b").unwrap();
    assert!(!keeper.client.quit_if_empty().unwrap(), "gate-a is still held");
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
    let e = KeeperClient::connect_or_spawn(dir.path(), Path::new("/nonexistent/keeper"), &[]).unwrap_err();
    assert!(matches!(e, KeeperError::Timeout { .. }), "{e}");
}

#[test]
fn a_keeper_that_cannot_start_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let e = KeeperClient::connect_or_spawn(dir.path(), Path::new("/nonexistent/keeper"), &[]).unwrap_err();
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
const KEEPER_PROCESS: &str = "tests::keeper_process";
const SPAWNER_PROCESS: &str = "tests::spawner_process";

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
    client.put_listener("gate-a", listener.as_fd()).unwrap();
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

#[test]
fn the_client_learns_the_keepers_protocol_version() {
    let keeper = start_keeper();
    assert_eq!(keeper.client.protocol_version().unwrap(), PROTOCOL_VERSION);
}

#[test]
fn a_keeper_older_than_version_requests_is_version_1() {
    // A version-1 keeper: it listens where a keeper does and answers VERSION as it answered
    // any unknown request.
    let dir = tempfile::tempdir().unwrap();
    let listener = listen_at(&dir.path().join(SOCKET_NAME));
    let old = std::thread::spawn(move || {
        let (conn, _) = listener.accept().unwrap();
        let request = read_message_long(&conn);
        assert_eq!(request, b"VERSION");
        (&conn)
            .write_all(b"ERR unknown request \"VERSION\" (PUT, DROP, TAKE, QUIT_IF_EMPTY, PING)")
            .unwrap();
    });
    let client = KeeperClient {
        socket: dir.path().join(SOCKET_NAME),
        timeout: CALL_TIMEOUT,
    };
    assert_eq!(client.protocol_version().unwrap(), 1);
    old.join().unwrap();
}
