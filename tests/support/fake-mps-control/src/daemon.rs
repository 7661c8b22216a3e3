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
use crate::protocol::{self, ANSWER_PREFIX, CHANNEL_HELLO, CLIENT_HELLO, DAEMON_HELLO, UI_HELLO};
use crate::server::ProcessLauncher;
use crate::state::{ClientLink, State};

/// Internal flag: the re-executed binary that becomes the daemon.
pub const DAEMON_CHILD_FLAG: &str = "--daemon-child";
const READY: &str = "READY";
const FAILED: &str = "ERR ";
const READY_TIMEOUT: Duration = Duration::from_secs(30);

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
        let state = State::new(multiuser, device_count, Box::new(launcher));
        log.line("Daemon ready");
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
            state: Mutex::new(state),
            one_connection: Mutex::new(()),
            log,
            paths,
        });
        for (name, listener) in [("control", control), ("control_privileged", privileged)] {
            let daemon = daemon.clone();
            std::thread::spawn(move || accept_loop(daemon, listener, name));
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
}

impl Daemon {
    fn lock_state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
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
            let _ = protocol::send_message(stream, &ANSWER_PREFIX.to_string());
        }
        std::process::exit(0)
    }
}

impl ClientLink for UnixStream {
    fn disconnect(&self) {
        let _ = self.shutdown(std::net::Shutdown::Both);
    }
}

fn accept_loop(daemon: Arc<Daemon>, listener: UnixListener, name: &'static str) {
    for conn in listener.incoming() {
        match conn {
            Ok(stream) => {
                let daemon = daemon.clone();
                std::thread::spawn(move || handle_connection(&daemon, stream));
            }
            Err(e) => {
                daemon.log.line(&format!("accept on {name} failed: {e}"));
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// How long one connection may keep the daemon before it gives up on it: far longer than a
/// test's handshake, short enough that a stuck test does not hang the daemon for good.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);

fn handle_connection(daemon: &Arc<Daemon>, stream: UnixStream) {
    let _one_at_a_time = daemon
        .one_connection
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    daemon.log.line("Accepting connection...");
    let _ = stream.set_read_timeout(Some(CONNECTION_TIMEOUT));
    if protocol::send_message(&stream, DAEMON_HELLO).is_err() {
        return;
    }
    let Ok(Some((first, credentials))) = protocol::recv_with_credentials(&stream) else {
        // A CUDA client's first connection only reads the hello.
        daemon.log.line("User did not send valid credentials");
        return;
    };
    let first = first.trim();
    match first.split_whitespace().next() {
        Some(UI_HELLO) => serve_ui(daemon, stream),
        Some(CLIENT_HELLO) => serve_cuda_client(daemon, stream, first, credentials),
        Some(CHANNEL_HELLO) => serve_second_channel(daemon, &stream),
        _ => daemon.log.line("User did not send valid credentials"),
    }
}

fn serve_ui(daemon: &Daemon, stream: UnixStream) {
    daemon.log.line("NEW UI");
    while let Ok(Some(command)) = protocol::recv_message(&stream) {
        let command = command.trim();
        daemon.log.line(&format!("Cmd:{command}"));
        let mut state = daemon.lock_state();
        let reply = state.execute(command);
        daemon.log_events(&mut state);
        if !reply.text.is_empty() {
            daemon.log.line(&reply.text);
        }
        if reply.quit {
            daemon.exit(state, "quit", Some(&stream));
        }
        drop(state);
        if protocol::send_message(&stream, &format!("{ANSWER_PREFIX}{}", reply.text)).is_err() {
            break;
        }
    }
    daemon.log.line("UI closed");
}

fn serve_cuda_client(
    daemon: &Arc<Daemon>,
    stream: UnixStream,
    hello: &str,
    credentials: Option<nix::sys::socket::UnixCredentials>,
) {
    // The pid in the message text is the client's own view (1 in a container). The kernel's
    // view is in the message's credentials (what a relaying gate forwards), else SO_PEERCRED;
    // it is the one `get_client_list` and `terminate_client` use.
    let creds = match credentials
        .map(Ok)
        .unwrap_or_else(|| getsockopt(&stream, PeerCredentials))
    {
        Ok(creds) => creds,
        Err(e) => {
            daemon
                .log
                .line(&format!("User did not send valid credentials: {e}"));
            let _ = protocol::send_message(&stream, "ERROR no peer credentials\n");
            return;
        }
    };
    let (pid, uid) = (creds.pid(), creds.uid());
    let (kept, passed) = match protocol::channel_pair() {
        Ok(pair) => pair,
        Err(e) => {
            let _ = protocol::send_message(&stream, &format!("ERROR no channel: {e}\n"));
            return;
        }
    };
    let channel = Arc::new(kept);
    let admitted = {
        let mut state = daemon.lock_state();
        let admitted = state.admit_client(pid, uid, channel.clone());
        daemon.log_events(&mut state);
        admitted
    };
    let admission = match admitted {
        Ok(admission) => admission,
        Err(why) => {
            daemon
                .log
                .line(&format!("NEW CLIENT {pid} from user {uid}: refused: {why}"));
            let _ = protocol::send_message(&stream, &format!("ERROR {why}\n"));
            return;
        }
    };
    let how = if admission.new_server {
        "Starting new server"
    } else {
        "Server already exists"
    };
    daemon.log.line(&format!(
        "NEW CLIENT {pid} from user {uid} (it sent {hello:?}): {how}"
    ));
    daemon.log.line(&admission.line);
    let sent = protocol::send_with_fd(&stream, &format!("{}\n", admission.line), passed.as_raw_fd());
    drop(passed);
    if sent.is_ok() {
        // The client is on the server for as long as it holds its channel.
        let (watcher, id) = (daemon.clone(), admission.client_id);
        std::thread::spawn(move || {
            while let Ok(Some(_)) = protocol::recv_message(&channel) {}
            watcher.forget_client(id);
        });
        // The client closes this control connection once it has its channel.
        while let Ok(Some(_)) = protocol::recv_message(&stream) {}
    } else {
        daemon.forget_client(admission.client_id);
    }
}

/// A client's third connection: one more descriptor, nothing else changes.
fn serve_second_channel(daemon: &Daemon, stream: &UnixStream) {
    match protocol::channel_pair() {
        Ok((_kept, passed)) => {
            let _ = protocol::send_with_fd(stream, CHANNEL_HELLO, passed.as_raw_fd());
        }
        Err(e) => daemon.log.line(&format!("no second channel: {e}")),
    }
    while let Ok(Some(_)) = protocol::recv_message(stream) {}
}

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
