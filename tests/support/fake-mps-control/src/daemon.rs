//! Daemon mode: `-d` starts it in the background and returns once it accepts commands; `-f`
//! runs it in the foreground. The daemon owns the pipe dir (flock on `control_lock`), serves
//! `control` and `control_privileged`, and keeps all state in memory.

use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::time::Duration;

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
use nix::sys::stat::Mode;

use crate::control_log::ControlLog;
use crate::paths::Paths;
use crate::privilege::{self, ControlSocket};
use crate::protocol;
use crate::server::ProcessLauncher;
use crate::state::{ClientLink, MAX_CLIENTS_PER_SERVER, State};

/// Internal flag: the re-executed binary that becomes the daemon.
pub const DAEMON_CHILD_FLAG: &str = "--daemon-child";
const READY: &str = "READY";
const FAILED: &str = "ERR ";
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Test-only: another client limit per server than MPS's 48, so that a test reaches it.
pub const MAX_CLIENTS_ENV: &str = "FAKE_MPS_CONTROL_MAX_CLIENTS";

/// `-d`: runs this binary again as the daemon (in its own session, stdio detached) and exits 0
/// once it accepts commands, 1 with its one-line reason when it could not start.
///
/// The daemon is a re-executed process rather than a fork so that no unsafe code is needed;
/// it holds none of the caller's stdio, so a caller that reads our output to the end is not
/// kept waiting by the daemon.
pub fn start_in_background(multiuser: bool) -> ExitCode {
    let fail = |msg: String| {
        eprintln!("fake-mps-control: {msg}");
        ExitCode::FAILURE
    };
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return fail(format!("cannot find my own executable: {e}")),
    };
    let mut cmd = Command::new(exe);
    cmd.arg(DAEMON_CHILD_FLAG);
    if multiuser {
        cmd.arg("-M");
    }
    let mut child = match cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
    {
        Ok(child) => child,
        Err(e) => return fail(format!("cannot start the daemon process: {e}")),
    };
    let Some(stdout) = child.stdout.take() else {
        return fail("no pipe from the daemon process".to_string());
    };
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    match rx.recv_timeout(READY_TIMEOUT) {
        Ok(line) if line.starts_with(READY) => ExitCode::SUCCESS,
        Ok(line) if line.starts_with(FAILED) => {
            let _ = child.wait();
            eprintln!("{}", line[FAILED.len()..].trim_end());
            ExitCode::FAILURE
        }
        Ok(_) => {
            let status = child
                .wait()
                .map(|s| s.to_string())
                .unwrap_or_else(|e| e.to_string());
            fail(format!(
                "the daemon exited before it was ready ({status}); see {}",
                Paths::from_env().control_log().display()
            ))
        }
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            fail(format!("the daemon was not ready within {READY_TIMEOUT:?}"))
        }
    }
}

/// The daemon itself. `detached`: started by `-d` (report readiness on stdout, then let go of
/// it); otherwise `-f` (foreground, errors on stderr).
pub fn run(multiuser: bool, detached: bool) -> ExitCode {
    if detached {
        // Own session: the caller's terminal and process group signals do not reach us.
        let _ = nix::unistd::setsid();
    }
    let paths = Paths::from_env();
    let started = match Startup::prepare(&paths, multiuser) {
        Ok(started) => started,
        Err(msg) => {
            if detached {
                println!("{FAILED}{msg}");
            } else {
                eprintln!("{msg}");
            }
            return ExitCode::FAILURE;
        }
    };
    if detached {
        println!("{READY} {}", std::process::id());
        let _ = std::io::stdout().flush();
        if let Ok(null) = OpenOptions::new().write(true).open("/dev/null") {
            let _ = nix::unistd::dup2(null.as_raw_fd(), std::io::stdout().as_raw_fd());
        }
    }
    let _ = std::env::set_current_dir("/");
    started.serve()
}

struct Startup {
    paths: Paths,
    log: ControlLog,
    /// Held for the daemon's lifetime; the kernel drops it when the process exits.
    lock: Flock<File>,
    control: UnixListener,
    privileged: UnixListener,
    signals: SigSet,
    state: State,
}

impl Startup {
    fn prepare(paths: &Paths, multiuser: bool) -> Result<Startup, String> {
        let exe = std::env::current_exe()
            .map_err(|e| format!("fake-mps-control: cannot find my own executable: {e}"))?;
        make_dir(&paths.pipe_dir)?;
        make_dir(&paths.log_dir)?;
        let log = ControlLog::open(&paths.control_log()).map_err(|e| {
            format!(
                "fake-mps-control: cannot open {}: {e}",
                paths.control_log().display()
            )
        })?;
        let log_path = paths.control_log();
        std::panic::set_hook(Box::new(move |info| {
            if let Ok(mut f) = OpenOptions::new().append(true).open(&log_path) {
                let _ = writeln!(f, "PANIC in fake-mps-control: {info}");
            }
        }));
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        log.line(&format!(
            "Starting control daemon (pid {}), CUDA_VISIBLE_DEVICES={}, multiuser={multiuser}, pipe dir {}",
            std::process::id(),
            visible
                .as_deref()
                .map_or("<unset>".to_string(), |v| format!("{v:?}")),
            paths.pipe_dir.display()
        ));

        let lock = lock_pipe_dir(paths).inspect_err(|msg| log.line(msg))?;
        for stale in [
            paths.control(),
            paths.control_privileged(),
            paths.log_fifo(),
            paths.pid_file(),
        ] {
            remove_if_present(&stale)
                .map_err(|e| format!("fake-mps-control: cannot remove {}: {e}", stale.display()))?;
        }
        // Block before any thread starts, so that every thread inherits the mask and only
        // the main thread's sigwait sees these.
        let mut signals = SigSet::empty();
        for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
            signals.add(s);
        }
        signals
            .thread_block()
            .map_err(|e| format!("fake-mps-control: cannot block signals: {e}"))?;

        let control = listen(&paths.control(), 0o666)?;
        let privileged = listen(&paths.control_privileged(), 0o755)?;
        if nix::unistd::mkfifo(&paths.log_fifo(), Mode::from_bits_truncate(0o777)).is_ok() {
            let _ = fs::set_permissions(paths.log_fifo(), fs::Permissions::from_mode(0o777));
        }
        write_file(&paths.pid_file(), &std::process::id().to_string(), 0o666)?;

        let device_count = visible
            .as_deref()
            .map_or(1, |v| v.split(',').filter(|d| !d.trim().is_empty()).count());
        let launcher = ProcessLauncher {
            exe,
            server_log: paths.server_log(),
        };
        let max_clients = match std::env::var(MAX_CLIENTS_ENV) {
            Ok(v) => v.trim().parse().map_err(|_| {
                format!("fake-mps-control: {MAX_CLIENTS_ENV}={v:?} is not a number of clients")
            })?,
            Err(_) => MAX_CLIENTS_PER_SERVER,
        };
        let state = State::new(multiuser, device_count, Box::new(launcher)).with_max_clients(max_clients);
        log.line(&format!(
            "Daemon ready (at most {max_clients} clients per server)"
        ));
        Ok(Startup {
            paths: paths.clone(),
            log,
            lock,
            control,
            privileged,
            signals,
            state,
        })
    }

    fn serve(self) -> ExitCode {
        let Startup {
            paths,
            log,
            lock: _held_until_exit,
            control,
            privileged,
            signals,
            state,
        } = self;
        let daemon = Arc::new(Daemon {
            wedged: Mutex::new(None),
            waiting: Mutex::new(Vec::new()),
            state: Mutex::new(state),
            one_connection: Mutex::new(()),
            log,
            paths,
        });
        for (socket, listener) in [
            (ControlSocket::Control, control),
            (ControlSocket::Privileged, privileged),
        ] {
            let daemon = daemon.clone();
            std::thread::spawn(move || accept_loop(daemon, listener, socket));
        }
        loop {
            if let Ok(signal) = signals.wait() {
                let state = daemon.lock_state();
                daemon.exit(state, &format!("received {signal}"), None);
            }
        }
    }
}

struct Daemon {
    state: Mutex<State>,
    /// Held for the whole of each connection: the real daemon serves one at a time (measured:
    /// a connection that sends nothing keeps every command waiting).
    one_connection: Mutex<()>,
    log: ControlLog,
    paths: Paths,
    /// Set once a process took its channel and did not register on it: the server is stuck.
    /// Measured on the H200 (docs/gpu-results.md section 7): every new client then waits,
    /// server-bound commands hang, `quit` hangs, reads of the daemon's own state answer, until
    /// the daemon and its server are killed.
    wedged: Mutex<Option<String>>,
    /// Requests of new clients that a stuck server never answers, kept open.
    waiting: Mutex<Vec<UnixStream>>,
}

impl Daemon {
    fn lock_state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn wedged_reason(&self) -> Option<String> {
        lock(&self.wedged).clone()
    }

    fn wedge(&self, why: &str) {
        let mut wedged = lock(&self.wedged);
        if wedged.is_none() {
            self.log.line(&format!("Server stuck: {why}"));
            *wedged = Some(why.to_string());
        }
    }

    /// A client gave up its channel (or was disconnected).
    fn forget_client(&self, id: crate::state::ClientId) {
        let mut state = self.lock_state();
        if let Some(pid) = state.remove_client(id) {
            self.log.line(&format!("Client {pid} disconnected"));
        }
        self.log_events(&mut state);
    }

    fn log_events(&self, state: &mut State) {
        for event in state.take_events() {
            self.log.line(&event);
        }
    }

    /// Stops the servers, removes the daemon's files, answers `quit` if it asked, and exits.
    /// Holding the state lock until the end keeps any other command from running meanwhile.
    fn exit(&self, mut state: MutexGuard<'_, State>, why: &str, answer_to: Option<&UnixStream>) -> ! {
        state.stop_all();
        self.log_events(&mut state);
        // control_lock stays, as a lock file does; what the real daemon leaves behind on quit
        // was not measured.
        for path in [
            self.paths.control(),
            self.paths.control_privileged(),
            self.paths.log_fifo(),
            self.paths.pid_file(),
        ] {
            let _ = remove_if_present(&path);
        }
        self.log.line(&format!("Exit ({why})"));
        if let Some(stream) = answer_to {
            // Take the rest of the session (its terminating 0) first: a socket closed with
            // messages unread resets the connection, and the CLI could lose the answer to it.
            let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
            while let Ok(Some(m)) = protocol::recv_message(stream) {
                if protocol::parse_u64(&m) == Some(protocol::END_OF_SESSION) {
                    break;
                }
            }
            let _ = protocol::send_message(stream, &protocol::u64_message(protocol::END_OF_ANSWER));
        }
        std::process::exit(0)
    }
}

impl ClientLink for UnixStream {
    fn disconnect(&self) {
        let _ = self.shutdown(std::net::Shutdown::Both);
    }
}

fn accept_loop(daemon: Arc<Daemon>, listener: UnixListener, socket: ControlSocket) {
    for conn in listener.incoming() {
        match conn {
            Ok(stream) => {
                let daemon = daemon.clone();
                std::thread::spawn(move || handle_connection(&daemon, stream, socket));
            }
            Err(e) => {
                daemon
                    .log
                    .line(&format!("accept on {} failed: {e}", socket.name()));
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// How long one connection may keep the daemon before it gives up on it: far longer than a
/// test's handshake, short enough that a stuck test does not hang the daemon for good.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a connection ended without being served; each is one line in control.log.
#[derive(Debug)]
enum ConnectionError {
    /// What a CUDA client's first connection (the probe) does.
    ClosedAfterHello,
    NotCredentials {
        got: Vec<u8>,
    },
    ClosedBeforeKind,
    MalformedKind {
        got: Vec<u8>,
    },
    UnknownKind(u32),
    NoIdentity(nix::Error),
    /// A UI session that broke its framing.
    MalformedUi {
        expected: String,
        got: Vec<u8>,
    },
    Io {
        context: &'static str,
        source: std::io::Error,
    },
}

impl std::fmt::Display for ConnectionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectionError::ClosedAfterHello => write!(f, "User did not send valid credentials"),
            ConnectionError::NotCredentials { got } => write!(
                f,
                "User did not send valid credentials: first message {} (expected OUTBCRED)",
                protocol::hex(got)
            ),
            ConnectionError::ClosedBeforeKind => {
                write!(f, "connection closed after its credentials, before its kind")
            }
            ConnectionError::MalformedKind { got } => write!(
                f,
                "malformed connection kind {} (expected 4 bytes); closed",
                protocol::hex(got)
            ),
            ConnectionError::UnknownKind(kind) => {
                write!(f, "unknown connection kind {kind}; closed without an answer")
            }
            ConnectionError::NoIdentity(e) => {
                write!(
                    f,
                    "User did not send valid credentials: no SO_PEERCRED either: {e}"
                )
            }
            ConnectionError::MalformedUi { expected, got } => {
                write!(f, "UI closed: expected {expected}, got {}", protocol::hex(got))
            }
            ConnectionError::Io { context, source } => write!(f, "connection dropped {context}: {source}"),
        }
    }
}

impl std::error::Error for ConnectionError {}

fn io_error(context: &'static str) -> impl FnOnce(std::io::Error) -> ConnectionError {
    move |source| ConnectionError::Io { context, source }
}

fn handle_connection(daemon: &Arc<Daemon>, stream: UnixStream, socket: ControlSocket) {
    let _one_at_a_time = daemon
        .one_connection
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    daemon.log.line("Accepting connection...");
    let _ = stream.set_read_timeout(Some(CONNECTION_TIMEOUT));
    let _ = stream.set_write_timeout(Some(CONNECTION_TIMEOUT));
    if let Err(e) = serve_connection(daemon, &stream, socket) {
        daemon.log.line(&e.to_string());
    }
}

fn serve_connection(
    daemon: &Arc<Daemon>,
    stream: &UnixStream,
    socket: ControlSocket,
) -> Result<(), ConnectionError> {
    protocol::send_message(stream, protocol::HELLO).map_err(io_error("sending the hello"))?;
    let request = read_request(stream)?;
    match request.kind {
        protocol::KIND_CUDA_CLIENT => serve_cuda_client(daemon, stream, request.pid, request.uid),
        protocol::KIND_UI => serve_ui(daemon, stream, socket, request.uid),
        other => Err(ConnectionError::UnknownKind(other)),
    }
}

/// What the connecting side asked for, and who it is.
struct Request {
    kind: u32,
    pid: i32,
    uid: u32,
}

/// `OUTBCRED\0` then the kind, each with credentials. The pid and uid are the credentials'
/// (what a relaying gate forwards), SO_PEERCRED's only when the messages carry none.
fn read_request(stream: &UnixStream) -> Result<Request, ConnectionError> {
    let Some((first, first_credentials)) =
        protocol::recv_with_credentials(stream).map_err(io_error("waiting for the credentials"))?
    else {
        return Err(ConnectionError::ClosedAfterHello);
    };
    if first != protocol::CREDENTIALS {
        return Err(ConnectionError::NotCredentials { got: first });
    }
    let Some((second, second_credentials)) =
        protocol::recv_with_credentials(stream).map_err(io_error("waiting for the kind"))?
    else {
        return Err(ConnectionError::ClosedBeforeKind);
    };
    let kind = protocol::parse_kind(&second).ok_or(ConnectionError::MalformedKind { got: second })?;
    let credentials = match second_credentials.or(first_credentials) {
        Some(credentials) => credentials,
        None => getsockopt(stream, PeerCredentials).map_err(ConnectionError::NoIdentity)?,
    };
    Ok(Request {
        kind,
        pid: credentials.pid(),
        uid: credentials.uid(),
    })
}

/// Kind 4: commands until the u64 0, each answered with its output (when not empty) and the
/// u64 1.
fn serve_ui(
    daemon: &Daemon,
    stream: &UnixStream,
    socket: ControlSocket,
    uid: u32,
) -> Result<(), ConnectionError> {
    daemon
        .log
        .line(&format!("NEW UI on {} from user {uid}", socket.name()));
    while let Some(length) = protocol::recv_message(stream).map_err(io_error("waiting for a command"))? {
        let length = protocol::parse_u64(&length).ok_or_else(|| ConnectionError::MalformedUi {
            expected: "a u64 length".to_string(),
            got: length.clone(),
        })?;
        if length == protocol::END_OF_SESSION {
            break;
        }
        let message = protocol::recv_message(stream)
            .map_err(io_error("waiting for a command after its length"))?
            .unwrap_or_default();
        let command = match protocol::parse_ui_command(&message) {
            Some(command) if message.len() as u64 == length => command,
            _ => {
                return Err(ConnectionError::MalformedUi {
                    expected: format!("a command of {length} bytes ending in \\n\\0"),
                    got: message,
                });
            }
        };
        let command = command.trim();
        daemon.log.line(&format!("Cmd:{command}"));
        answer_command(daemon, stream, socket, uid, command)?;
    }
    daemon.log.line("UI closed");
    Ok(())
}

fn answer_command(
    daemon: &Daemon,
    stream: &UnixStream,
    socket: ControlSocket,
    uid: u32,
    command: &str,
) -> Result<(), ConnectionError> {
    if let Some(why) = daemon.wedged_reason() {
        if crate::command::Command::parse(command).reaches_a_server() {
            // Holds this connection, and with it the daemon, for good (measured: a server-bound
            // command of a stuck server never answered, and later reads waited behind it).
            daemon
                .log
                .line(&format!("{command}: the server is stuck ({why}); no answer"));
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
    }
    let output = match privilege::refusal(&crate::command::Command::parse(command), socket, uid) {
        Some(refusal) => {
            daemon.log.line(&refusal);
            refusal
        }
        None => {
            let mut state = daemon.lock_state();
            let reply = state.execute(command);
            daemon.log_events(&mut state);
            if !reply.text.is_empty() {
                daemon.log.line(&reply.text);
            }
            if reply.quit {
                daemon.exit(state, "quit", Some(stream));
            }
            // The daemon sends the text without its last newline; the CLI adds it back.
            reply.text.strip_suffix('\n').unwrap_or(&reply.text).to_string()
        }
    };
    if !output.is_empty() {
        protocol::send_message(stream, &protocol::ui_output(&output))
            .map_err(io_error("sending an answer"))?;
    }
    protocol::send_message(stream, &protocol::u64_message(protocol::END_OF_ANSWER))
        .map_err(io_error("sending the end of an answer"))
}

/// Kind 2. The first request of a pid without a live client registers it (the server latches
/// its limits now) and its channel carries the fake's SERVER line; a later request of the
/// same pid only gets another descriptor. A refused client gets no answer at all.
fn serve_cuda_client(
    daemon: &Arc<Daemon>,
    stream: &UnixStream,
    pid: i32,
    uid: u32,
) -> Result<(), ConnectionError> {
    if let Some(why) = daemon.wedged_reason() {
        daemon.log.line(&format!(
            "NEW CLIENT {pid} from user {uid}: waits, the server is stuck ({why})"
        ));
        if let Ok(kept) = stream.try_clone() {
            lock(&daemon.waiting).push(kept);
        }
        return Ok(());
    }
    let (kept, passed) = protocol::channel_pair().map_err(io_error("creating a channel"))?;
    let channel = Arc::new(kept);
    let admitted = {
        let mut state = daemon.lock_state();
        if state.take_lost_client(pid) {
            // Its server died between its two connections: it gets nothing more from this
            // daemon (closed after the request: the client fails cleanly).
            drop(state);
            daemon.log.line(&format!(
                "Client {pid} from user {uid}: its server exited; refused"
            ));
            return Ok(());
        }
        if state.has_client(pid) {
            None
        } else {
            let admitted = state.admit_client(pid, uid, channel.clone());
            daemon.log_events(&mut state);
            Some(admitted)
        }
    };
    let Some(admitted) = admitted else {
        daemon
            .log
            .line(&format!("Client {pid} from user {uid}: second descriptor"));
        protocol::send_with_fd(stream, protocol::CHANNEL_PASSED, passed.as_raw_fd())
            .map_err(io_error("passing a second descriptor"))?;
        drop(passed);
        return await_client_close(daemon, stream, pid);
    };
    let admission = match admitted {
        Ok(admission) => admission,
        Err(why) => {
            // Closed after the request with no answer: what a real daemon that cannot take
            // the client does (the CUDA client then fails cleanly).
            daemon
                .log
                .line(&format!("NEW CLIENT {pid} from user {uid}: refused: {why}"));
            return Ok(());
        }
    };
    let how = if admission.new_server {
        "Starting new server"
    } else {
        "Server already exists"
    };
    daemon
        .log
        .line(&format!("NEW CLIENT {pid} from user {uid}: {how}"));
    daemon.log.line(&admission.line);
    // The line is queued on the client's end before the client gets that end.
    let sent = protocol::send_message(&channel, format!("{}\n", admission.line).as_bytes())
        .and_then(|()| protocol::send_with_fd(stream, protocol::CHANNEL_PASSED, passed.as_raw_fd()));
    drop(passed);
    if let Err(source) = sent {
        daemon.forget_client(admission.client_id);
        return Err(ConnectionError::Io {
            context: "passing the channel",
            source,
        });
    }
    // The client registers on its channel first, and is on the server for as long as it holds
    // it. A channel taken and not registered on leaves the server stuck (measured).
    let (watcher, id) = (daemon.clone(), admission.client_id);
    std::thread::spawn(move || {
        let _ = channel.set_read_timeout(Some(REGISTER_TIMEOUT));
        match protocol::recv_message(&channel) {
            Ok(Some(m)) if m == protocol::CHANNEL_REGISTER => {}
            // Its server died before it registered: the daemon closed the channel, not the
            // client; that leaves nothing stuck.
            Ok(None) if !watcher.lock_state().holds_client(id) => {
                watcher
                    .log
                    .line(&format!("Client {pid}: its server exited before it registered"));
            }
            other => {
                let why = match other {
                    Ok(Some(m)) => format!("client {pid} sent {} on its channel", protocol::hex(&m)),
                    Ok(None) => format!("client {pid} closed its channel without registering"),
                    Err(_) => format!("client {pid} did not register on its channel"),
                };
                watcher.wedge(&why);
            }
        }
        let _ = channel.set_read_timeout(None);
        while let Ok(Some(_)) = protocol::recv_message(&channel) {}
        watcher.forget_client(id);
    });
    await_client_close(daemon, stream, pid)
}

/// After its descriptor a CUDA client sends 4 zero bytes and closes.
fn await_client_close(daemon: &Daemon, stream: &UnixStream, pid: i32) -> Result<(), ConnectionError> {
    while let Some(message) =
        protocol::recv_message(stream).map_err(io_error("waiting for the client to close"))?
    {
        if message != protocol::CLIENT_ACK {
            daemon.log.line(&format!(
                "Client {pid}: unexpected message {} after its descriptor",
                protocol::hex(&message)
            ));
        }
    }
    Ok(())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// How long a new client has to register on its channel (a real one does it at once).
const REGISTER_TIMEOUT: Duration = Duration::from_secs(3);

fn lock_pipe_dir(paths: &Paths) -> Result<Flock<File>, String> {
    let path = paths.control_lock();
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| format!("fake-mps-control: cannot open {}: {e}", path.display()))?;
    let _ = file.set_permissions(fs::Permissions::from_mode(0o666));
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(lock),
        Err((_, Errno::EWOULDBLOCK)) => {
            let owner = fs::read_to_string(paths.pid_file())
                .map_or_else(|_| "unknown".to_string(), |p| p.trim().to_string());
            Err(format!(
                "fake-mps-control: an MPS control daemon (pid {owner}) is already running for pipe directory {}",
                paths.pipe_dir.display()
            ))
        }
        Err((_, e)) => Err(format!("fake-mps-control: cannot lock {}: {e}", path.display())),
    }
}

fn listen(path: &Path, mode: u32) -> Result<UnixListener, String> {
    let listener = protocol::listen(path)
        .map_err(|e| format!("fake-mps-control: cannot listen on {}: {e}", path.display()))?;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .map_err(|e| format!("fake-mps-control: cannot chmod {}: {e}", path.display()))?;
    Ok(listener)
}

fn make_dir(dir: &PathBuf) -> Result<(), String> {
    if dir.is_dir() {
        return Ok(());
    }
    fs::create_dir_all(dir).map_err(|e| format!("fake-mps-control: cannot create {}: {e}", dir.display()))?;
    let _ = fs::set_permissions(dir, fs::Permissions::from_mode(0o755));
    Ok(())
}

fn write_file(path: &Path, text: &str, mode: u32) -> Result<(), String> {
    fs::write(path, text)
        .and_then(|()| fs::set_permissions(path, fs::Permissions::from_mode(mode)))
        .map_err(|e| format!("fake-mps-control: cannot write {}: {e}", path.display()))
}

fn remove_if_present(path: &Path) -> std::io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}
