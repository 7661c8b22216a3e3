//! Drives the built fake-mps-control binary the way gpu-mps-manager drives the real one: `-d -M`
//! with the MPS environment, then one CLI run per batch of commands, and CUDA clients on the
//! pipe dir's `control` socket, framed byte for byte as measured (src/protocol.rs). The wire
//! helpers here are written from the measured bytes, not taken from the fake's own code, so
//! that a framing bug in the fake cannot pass by agreeing with itself.

use std::io::{BufRead, BufReader, IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::sys::socket::{
    self, AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
    UnixAddr, UnixCredentials,
};
use nix::unistd::Pid;

const BIN: &str = env!("CARGO_BIN_EXE_fake-mps-control");
const BANNER: &str = "FAKE nvidia-cuda-mps-control (gpu-mps test double; no GPU, no MPS)";

/// The measured bytes (docs/gpu-results.md section 7).
const HELLO: &[u8] = &[0x4f, 0x55, 0x54, 0x42, 0x48, 0x45, 0x4c, 0x4c, 0x00];
const CRED: &[u8] = &[0x4f, 0x55, 0x54, 0x42, 0x43, 0x52, 0x45, 0x44, 0x00];
const CUFD: &[u8] = &[0x4f, 0x55, 0x54, 0x42, 0x43, 0x55, 0x46, 0x44, 0x00];
/// The fake's own first message of a client on its channel.
const REGISTER: &[u8] = b"REGISTER";
const KIND_CUDA_CLIENT: &[u8] = &[2, 0, 0, 0];
const KIND_UI: &[u8] = &[4, 0, 0, 0];
const ACK: &[u8] = &[0, 0, 0, 0];
const END_OF_ANSWER: &[u8] = &[1, 0, 0, 0, 0, 0, 0, 0];
const END_OF_SESSION: &[u8] = &[0; 8];

const INSUFFICIENT: &str =
    "Control deamon settings can only be modified by the user who started it or by the root user.";

/// A daemon in its own temp pipe and log dirs. Dropping it quits the daemon, and kills it when
/// quit does not work, so a failing test leaks no process.
struct Daemon {
    dir: tempfile::TempDir,
    pipe: PathBuf,
    log: PathBuf,
    pid: i32,
}

impl Daemon {
    fn start(visible_devices: &str) -> Daemon {
        Daemon::start_with(visible_devices, &[])
    }

    fn start_with(visible_devices: &str, env: &[(&str, &str)]) -> Daemon {
        let dir = tempfile::tempdir().expect("tempdir");
        let (pipe, log) = (dir.path().join("pipe"), dir.path().join("log"));
        let out = start_daemon(&pipe, &log, visible_devices, env);
        assert!(out.status.success(), "-d failed: {out:?}");
        assert!(
            out.stdout.is_empty() && out.stderr.is_empty(),
            "-d printed: {out:?}"
        );
        let pid = std::fs::read_to_string(pipe.join("nvidia-cuda-mps-control.pid")).expect("pid file");
        let pid = pid.parse().expect("pid file holds a bare pid");
        Daemon { dir, pipe, log, pid }
    }

    /// Runs the CLI with `input` on stdin; returns (exit code, stdout).
    fn run(&self, input: &str) -> (i32, String) {
        run_cli(&self.pipe, input)
    }

    /// One command; asserts exit 0 and returns stdout.
    fn cmd(&self, command: &str) -> String {
        let (code, out) = self.run(&format!("{command}\n"));
        assert_eq!(code, 0, "{command}: {out}");
        out
    }

    fn control_log(&self) -> String {
        std::fs::read_to_string(self.log.join("control.log")).expect("control.log")
    }

    /// A pipe dir holding only `control` (a link to this daemon's): what a pod sees through a
    /// gate, where the CLI cannot reach `control_privileged`.
    fn control_only_view(&self) -> PathBuf {
        let view = self.dir.path().join("control-only");
        std::fs::create_dir_all(&view).expect("mkdir");
        let link = view.join("control");
        if !link.exists() {
            std::os::unix::fs::symlink(self.pipe.join("control"), link).expect("symlink");
        }
        view
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if alive(self.pid) {
            let _ = run_cli(&self.pipe, "quit\n");
        }
        if wait_gone(self.pid).is_err() {
            let _ = kill(Pid::from_raw(self.pid), Signal::SIGKILL);
        }
    }
}

fn start_daemon(pipe: &Path, log: &Path, visible_devices: &str, env: &[(&str, &str)]) -> Output {
    Command::new(BIN)
        .args(["-d", "-M"])
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .env("CUDA_MPS_LOG_DIRECTORY", log)
        .env("CUDA_VISIBLE_DEVICES", visible_devices)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("run fake-mps-control -d")
}

fn run_cli(pipe: &Path, input: &str) -> (i32, String) {
    let out = run_cli_output(pipe, input);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).expect("utf8"),
    )
}

fn run_cli_output(pipe: &Path, input: &str) -> Output {
    let mut child = Command::new(BIN)
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run fake-mps-control");
    // Without a daemon the CLI exits before it reads stdin: the write may then fail with EPIPE.
    let written = child.stdin.take().expect("stdin").write_all(input.as_bytes());
    if let Err(e) = written {
        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "write stdin: {e}");
    }
    child.wait_with_output().expect("wait")
}

/// A running process that is not a zombie (a daemon whose parent exited is reaped by init,
/// whenever init gets to it).
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

fn wait_gone(pid: i32) -> Result<(), ()> {
    wait_for(|| !alive(pid))
}

fn wait_for(mut cond: impl FnMut() -> bool) -> Result<(), ()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if cond() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(())
}

/// A SOCK_SEQPACKET connection to `socket`, with a read timeout so a test that waits for an
/// answer that never comes fails instead of hanging.
fn connect(socket: &Path) -> UnixStream {
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .expect("socket");
    socket::connect(fd.as_raw_fd(), &UnixAddr::new(socket).expect("addr")).expect("connect");
    let stream = UnixStream::from(fd);
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    stream
}

/// Connects and checks the daemon's first message.
fn connect_after_hello(socket: &Path) -> UnixStream {
    let stream = connect(socket);
    assert_eq!(recv(&stream).0, HELLO, "the daemon speaks first");
    stream
}

fn send(stream: &UnixStream, bytes: &[u8]) {
    let n = socket::sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(bytes)],
        &[],
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .expect("send");
    assert_eq!(n, bytes.len());
}

fn send_with_credentials(stream: &UnixStream, bytes: &[u8]) {
    let creds = UnixCredentials::new();
    let n = socket::sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(bytes)],
        &[ControlMessage::ScmCredentials(&creds)],
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .expect("send");
    assert_eq!(n, bytes.len());
}

/// One message and the descriptors that came with it; empty at end of stream (or when the
/// daemon closed with our messages unread, which reads as a reset).
fn recv(stream: &UnixStream) -> (Vec<u8>, Vec<UnixStream>) {
    let mut buf = vec![0u8; 65536];
    let mut cmsg = nix::cmsg_space!([RawFd; 4]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    // CLOEXEC: a channel inherited by a process the test starts later would keep its client
    // listed after the test dropped it.
    let flags = MsgFlags::MSG_CMSG_CLOEXEC;
    let msg = match socket::recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut cmsg), flags) {
        Ok(msg) => msg,
        Err(nix::errno::Errno::ECONNRESET) => return (Vec::new(), Vec::new()),
        Err(e) => panic!("recv: {e}"),
    };
    let mut fds = Vec::new();
    for c in msg.cmsgs().expect("cmsgs") {
        if let ControlMessageOwned::ScmRights(r) = c {
            fds.extend(r.into_iter().map(adopt));
        }
    }
    let n = msg.bytes;
    (buf[..n].to_vec(), fds)
}

/// Owns a descriptor received over SCM_RIGHTS.
fn adopt(fd: RawFd) -> UnixStream {
    #[allow(unsafe_code)]
    // SAFETY: `fd` was just received over SCM_RIGHTS; nothing else owns it.
    unsafe {
        std::os::fd::FromRawFd::from_raw_fd(fd)
    }
}

/// One kind-2 connection as a CUDA client makes it: hello, credentials, kind 2; returns what
/// the daemon answered (empty when it closed) with its descriptors, then acks and closes.
fn kind2_request(pipe: &Path) -> (Vec<u8>, Vec<UnixStream>) {
    let stream = connect_after_hello(&pipe.join("control"));
    send_with_credentials(&stream, CRED);
    send_with_credentials(&stream, KIND_CUDA_CLIENT);
    let (answer, fds) = recv(&stream);
    if !answer.is_empty() {
        send_with_credentials(&stream, ACK);
    }
    (answer, fds)
}

/// A CUDA client, the three measured connections: a probe, the request that registers it (its
/// channel carries the fake's SERVER line), and one more for a second descriptor. Returns the
/// channel (the client is listed until it is dropped) and the line, or `None` when the daemon
/// closed the request unanswered.
fn cuda_client(pipe: &Path) -> Option<(UnixStream, String)> {
    drop(connect_after_hello(&pipe.join("control")));
    let (answer, mut fds) = kind2_request(pipe);
    if answer.is_empty() {
        assert!(fds.is_empty());
        return None;
    }
    assert_eq!(answer, CUFD);
    assert_eq!(fds.len(), 1, "one descriptor");
    let channel = fds.remove(0);
    let line = String::from_utf8(recv(&channel).0).expect("utf8");
    // Registered on its channel, as a client must be: a channel nobody registers on leaves the
    // server stuck (measured on the real one, copied by the fake).
    send(&channel, REGISTER);
    let (answer, second) = kind2_request(pipe);
    assert_eq!((answer.as_slice(), second.len()), (CUFD, 1), "second descriptor");
    Some((channel, line))
}

fn server_pid_of(line: &str) -> u32 {
    line.split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .expect("SERVER <pid> ...")
}

/// A UI session on `socket`, framed as the real CLI frames it; returns every message the
/// daemon sent after the hello, up to its close.
fn ui_session(socket: &Path, commands: &[&str]) -> Vec<Vec<u8>> {
    let stream = connect_after_hello(socket);
    send_with_credentials(&stream, CRED);
    send_with_credentials(&stream, KIND_UI);
    for command in commands {
        let framed = format!("{command}\n\0");
        send(&stream, &(framed.len() as u64).to_le_bytes());
        send(&stream, framed.as_bytes());
    }
    send(&stream, END_OF_SESSION);
    let mut got = Vec::new();
    loop {
        let (message, _) = recv(&stream);
        if message.is_empty() {
            return got;
        }
        got.push(message);
    }
}

fn output(text: &str) -> Vec<u8> {
    [&[0u8, 0, 0, 0][..], text.as_bytes()].concat()
}

/// Env var that turns the test binary into one CUDA client process (see
/// [`cuda_client_process`]): the daemon tells clients apart by their pid.
const CLIENT_PROCESS_PIPE: &str = "FAKE_MPS_CONTROL_TEST_CLIENT_PIPE";
const CLIENT_LINE: &str = "CLIENT-LINE ";

/// Not a test: when [`CLIENT_PROCESS_PIPE`] is set, this test binary, run again by
/// [`ClientProcess::start`], is a CUDA client of its own pid that prints its line and holds its
/// channel until its stdin closes.
#[test]
fn cuda_client_process() {
    let Some(pipe) = std::env::var_os(CLIENT_PROCESS_PIPE) else {
        return;
    };
    let client = cuda_client(Path::new(&pipe));
    let line = client.as_ref().map_or("REFUSED", |(_, line)| line.trim());
    println!("{CLIENT_LINE}{} {line}", std::process::id());
    let _ = std::io::stdout().flush();
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    drop(client);
}

struct ClientProcess {
    child: Child,
    /// Kept open: the test harness still prints after the client's line.
    _stdout: BufReader<std::process::ChildStdout>,
    pid: u32,
    /// The SERVER line, or `REFUSED`.
    line: String,
}

impl ClientProcess {
    fn start(pipe: &Path) -> ClientProcess {
        let mut child = Command::new(std::env::current_exe().expect("test exe"))
            .args([
                "--exact",
                "cuda_client_process",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CLIENT_PROCESS_PIPE, pipe)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn a client process");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let line = (&mut stdout)
            .lines()
            .map_while(Result::ok)
            // The harness prints `test cuda_client_process ... ` first, on the same line.
            .find_map(|l| l.split_once(CLIENT_LINE).map(|(_, line)| line.to_string()))
            .expect("the client's line");
        let (pid, line) = line.split_once(' ').expect("pid and line");
        ClientProcess {
            pid: pid.parse().expect("pid"),
            line: line.to_string(),
            child,
            _stdout: stdout,
        }
    }
}

impl Drop for ClientProcess {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// A stand-in for a gate on `<dir>/control` that greets each connection (or not), reads the
/// two request messages, and closes without answering, as a gate that refuses does.
fn refusing_gate(dir: &Path, say_hello: bool) -> std::thread::JoinHandle<()> {
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .expect("socket");
    socket::bind(
        fd.as_raw_fd(),
        &UnixAddr::new(&dir.join("control")).expect("addr"),
    )
    .expect("bind");
    socket::listen(&fd, Backlog::new(4).expect("backlog")).expect("listen");
    let listener = std::os::unix::net::UnixListener::from(fd);
    std::thread::spawn(move || {
        let (stream, _) = listener.accept().expect("accept");
        if say_hello {
            send(&stream, HELLO);
            assert_eq!(recv(&stream).0, CRED);
            assert_eq!(recv(&stream).0, KIND_UI);
        }
    })
}

#[test]
fn help_says_it_is_a_fake() {
    let out = Command::new(BIN).arg("--help").output().expect("run");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("FAKE nvidia-cuda-mps-control"), "{text}");
    assert!(text.contains("test double"), "{text}");
}

#[test]
fn no_daemon_is_exit_1_with_the_real_message() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (code, out) = run_cli(&dir.path().join("pipe"), "get_server_list\n");
    assert_eq!(
        (code, out.as_str()),
        (1, "Cannot find MPS control daemon process\n")
    );
    // A socket that closes before its hello is no daemon either.
    let gate = refusing_gate(dir.path(), false);
    let (code, out) = run_cli(dir.path(), "get_server_list\n");
    gate.join().expect("gate");
    assert_eq!(
        (code, out.as_str()),
        (1, "Cannot find MPS control daemon process\n")
    );
}

#[test]
fn a_session_closed_after_the_request_is_cannot_send() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gate = refusing_gate(dir.path(), true);
    let out = run_cli_output(dir.path(), "get_server_list\n");
    gate.join().expect("gate");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "");
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "Cannot send command to MPS control daemon process\n"
    );
}

#[test]
fn pipe_dir_and_log_look_like_the_real_ones() {
    let d = Daemon::start("GPU-aaaa,GPU-bbbb");
    let mode = |name: &str| {
        std::fs::metadata(d.pipe.join(name))
            .expect(name)
            .permissions()
            .mode()
            & 0o7777
    };
    let kind = |name: &str| std::fs::metadata(d.pipe.join(name)).expect(name).file_type();
    assert!(kind("control").is_socket());
    assert_eq!(mode("control"), 0o666);
    assert!(kind("control_privileged").is_socket());
    assert_eq!(mode("control_privileged"), 0o755);
    assert!(kind("control_lock").is_file());
    assert_eq!(mode("control_lock"), 0o666);
    assert_eq!(
        std::fs::metadata(d.pipe.join("control_lock"))
            .expect("lock")
            .len(),
        0
    );
    assert!(kind("log").is_fifo());
    assert_eq!(mode("nvidia-cuda-mps-control.pid"), 0o666);
    assert_eq!(
        std::fs::read_to_string(d.pipe.join("nvidia-cuda-mps-control.pid")).expect("pid"),
        d.pid.to_string()
    );
    assert!(alive(d.pid));

    let log = d.control_log();
    assert_eq!(log.lines().next(), Some(BANNER));
    assert!(
        log.contains("CUDA_VISIBLE_DEVICES=\"GPU-aaaa,GPU-bbbb\""),
        "{log}"
    );
    d.cmd("get_server_list");
    let log = d.control_log();
    assert!(log.contains("Cmd:get_server_list"), "{log}");
    assert!(log.contains("NEW UI on control_privileged"), "{log}");
}

#[test]
fn a_second_daemon_for_the_same_pipe_dir_is_refused() {
    let d = Daemon::start("GPU-aaaa");
    let out = start_daemon(&d.pipe, &d.log, "GPU-aaaa", &[]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("already running") && err.contains(&d.pid.to_string()),
        "{err}"
    );
    // The first one is untouched.
    assert_eq!(
        std::fs::read_to_string(d.pipe.join("nvidia-cuda-mps-control.pid")).expect("pid"),
        d.pid.to_string()
    );
    assert_eq!(d.cmd("get_default_active_thread_percentage"), "100.0\n");
}

#[test]
fn stale_files_of_a_dead_daemon_do_not_block_a_new_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pipe = dir.path().join("pipe");
    std::fs::create_dir_all(&pipe).expect("mkdir");
    std::fs::write(pipe.join("nvidia-cuda-mps-control.pid"), "999999").expect("pid");
    std::fs::write(pipe.join("control"), "").expect("stale control");
    let out = start_daemon(&pipe, &dir.path().join("log"), "GPU-aaaa", &[]);
    assert!(out.status.success(), "{out:?}");
    let pid: i32 = std::fs::read_to_string(pipe.join("nvidia-cuda-mps-control.pid"))
        .expect("pid")
        .parse()
        .expect("pid");
    let (code, text) = run_cli(&pipe, "quit\n");
    assert_eq!((code, text.as_str()), (0, ""));
    assert!(wait_gone(pid).is_ok());
}

#[test]
fn command_answers_match_the_measured_formats() {
    let d = Daemon::start("GPU-aaaa");
    let table = [
        ("get_server_list", ""),
        ("get_default_active_thread_percentage", "100.0\n"),
        ("set_default_active_thread_percentage 25", "25.0\n"),
        ("get_default_active_thread_percentage", "25.0\n"),
        ("set_default_device_pinned_mem_limit 0 4096M", ""),
        ("get_default_device_pinned_mem_limit 0", "4G\n"),
        ("set_default_device_pinned_mem_limit 0 4G", ""),
        ("get_default_device_pinned_mem_limit 0", "4G\n"),
        ("set_default_device_pinned_mem_limit 7 4G", ""),
        ("get_default_device_pinned_mem_limit 7", "4G\n"),
        ("set_default_device_pinned_mem_limit 1 3000M", ""),
        ("get_default_device_pinned_mem_limit 1", "2G\n"),
        ("get_default_device_pinned_mem_limit 2", "0\n"),
        ("set_default_active_thread_percentage 250", "25.0\n"),
        ("get_default_active_thread_percentage", "25.0\n"),
        ("set_default_active_thread_percentage 25", "25.0\n"),
        ("bogus_command", "Unknown command \"bogus_command\"\n"),
        (
            "set_active_thread_percentage 99999 30",
            "Server 99999 not found\n",
        ),
        ("get_active_thread_percentage 99999", "Server 99999 not found\n"),
        (
            "set_device_pinned_mem_limit 99999 0 1G",
            "Server 99999 not found\n",
        ),
        ("get_device_pinned_mem_limit 99999 0", "Server 99999 not found\n"),
        ("get_client_list 99999", "Server 99999 not found\n"),
        ("shutdown_server 99999", "Server 99999 not found\n"),
        ("terminate_client 99999 1", "Server 99999 not found\n"),
        ("get_device_client_list", ""),
    ];
    for (command, want) in table {
        assert_eq!(d.cmd(command), want, "{command}");
    }
    // Several commands in one run, answered in order.
    let (code, out) =
        d.run("get_default_active_thread_percentage\n\nget_default_device_pinned_mem_limit 0\nbogus\n");
    assert_eq!((code, out.as_str()), (0, "25.0\n4G\nUnknown command \"bogus\"\n"));
}

#[test]
fn ui_sessions_are_framed_byte_for_byte() {
    let d = Daemon::start("GPU-aaaa");
    let privileged = d.pipe.join("control_privileged");
    // An empty answer is the end marker alone; then the daemon closes after the 0.
    assert_eq!(
        ui_session(&privileged, &["get_server_list"]),
        vec![END_OF_ANSWER.to_vec()]
    );
    assert_eq!(
        ui_session(&privileged, &["get_default_active_thread_percentage"]),
        vec![output("100.0"), END_OF_ANSWER.to_vec()]
    );
    // The daemon takes more than one command per session, answered in order.
    assert_eq!(
        ui_session(&privileged, &["set_default_active_thread_percentage 25", "bogus"]),
        vec![
            output("25.0"),
            END_OF_ANSWER.to_vec(),
            output("Unknown command \"bogus\""),
            END_OF_ANSWER.to_vec()
        ]
    );
    // A length that does not match its command closes the session.
    let stream = connect_after_hello(&privileged);
    send_with_credentials(&stream, CRED);
    send_with_credentials(&stream, KIND_UI);
    send(&stream, &99u64.to_le_bytes());
    send(&stream, b"get_server_list\n\0");
    assert!(recv(&stream).0.is_empty(), "closed");
    drop(stream);
    assert!(
        wait_for(|| d
            .control_log()
            .contains("UI closed: expected a command of 99 bytes"))
        .is_ok(),
        "{}",
        d.control_log()
    );
    assert_eq!(d.cmd("get_default_active_thread_percentage"), "25.0\n");
}

#[test]
fn changes_are_refused_on_control_with_the_real_texts() {
    let d = Daemon::start("GPU-aaaa");
    let control = d.pipe.join("control");
    let uid = nix::unistd::getuid().as_raw();
    let insufficient = output(&format!("Insufficient privileges for UID {uid}. {INSUFFICIENT}"));
    for command in [
        "set_default_active_thread_percentage 25",
        "set_default_device_pinned_mem_limit 0 4G",
        "set_active_thread_percentage 1 25",
        "set_device_pinned_mem_limit 1 0 4G",
        "start_server -uid 0",
        "shutdown_server 1",
        "terminate_client 1 1",
    ] {
        assert_eq!(
            ui_session(&control, &[command]),
            vec![insufficient.clone(), END_OF_ANSWER.to_vec()],
            "{command}"
        );
    }
    assert_eq!(
        ui_session(&control, &["quit"]),
        vec![
            output("Not enough privilege to execute quit command"),
            END_OF_ANSWER.to_vec()
        ]
    );
    assert!(alive(d.pid), "quit on control must not stop the daemon");
    // Reads work on control; nothing was changed.
    assert_eq!(
        ui_session(&control, &["get_default_active_thread_percentage"]),
        vec![output("100.0"), END_OF_ANSWER.to_vec()]
    );
    assert_eq!(d.cmd("get_server_list"), "");
    // The same change is taken on control_privileged.
    assert_eq!(
        ui_session(
            &d.pipe.join("control_privileged"),
            &["set_default_active_thread_percentage 25"]
        ),
        vec![output("25.0"), END_OF_ANSWER.to_vec()]
    );
    assert_eq!(d.cmd("get_default_active_thread_percentage"), "25.0\n");
}

#[test]
fn the_cli_falls_back_to_control_where_changes_are_refused() {
    let d = Daemon::start("GPU-aaaa");
    let view = d.control_only_view();
    let uid = nix::unistd::getuid().as_raw();
    let (code, out) = run_cli(
        &view,
        "get_default_active_thread_percentage\nset_default_active_thread_percentage 25\nquit\n",
    );
    assert_eq!(
        (code, out),
        (
            0,
            format!(
                "100.0\nInsufficient privileges for UID {uid}. {INSUFFICIENT}\nNot enough privilege to execute quit command\n"
            )
        )
    );
    assert!(alive(d.pid));
    assert_eq!(d.cmd("get_default_active_thread_percentage"), "100.0\n");
    assert!(d.control_log().contains("NEW UI on control from user"));
}

#[test]
fn servers_take_the_defaults_in_force_when_they_start() {
    let d = Daemon::start("GPU-aaaa,GPU-bbbb");
    d.cmd("set_default_active_thread_percentage 25");
    d.cmd("set_default_device_pinned_mem_limit 0 4096M");
    d.cmd("set_default_device_pinned_mem_limit 1 3000M");

    let (first, line) = cuda_client(&d.pipe).expect("admitted");
    let srv = server_pid_of(&line);
    assert_eq!(line, format!("SERVER {srv} THREADS 25.0 MEM 0=4G,1=3000M\n"));
    assert!(alive(srv as i32), "the server is a real process");
    assert_eq!(d.cmd("get_server_list"), format!("{srv}\n"));
    // Listed once, by the pid of its credentials, for all three connections.
    let me = std::process::id();
    assert_eq!(d.cmd(&format!("get_client_list {srv}")), format!("{me}\n"));
    assert_eq!(d.cmd(&format!("get_active_thread_percentage {srv}")), "25.0\n");
    assert_eq!(d.cmd(&format!("get_device_pinned_mem_limit {srv} 0")), "4G\n");
    assert_eq!(d.cmd(&format!("get_device_pinned_mem_limit {srv} 1")), "2G\n");
    assert_eq!(
        d.cmd(&format!("get_device_client_list {srv}")),
        format!(
            "[0] 00:00.0, FAKE GPU (gpu-mps test double)\n{me}.1\n[1] 01:00.0, FAKE GPU (gpu-mps test double)\n{me}.1\n"
        )
    );

    // New defaults do not change a running server.
    d.cmd("set_default_active_thread_percentage 75");
    assert_eq!(d.cmd(&format!("get_active_thread_percentage {srv}")), "25.0\n");

    // Server-level limits change what later clients are told.
    assert_eq!(d.cmd(&format!("set_active_thread_percentage {srv} 50")), "50.0\n");
    assert_eq!(
        d.cmd(&format!("set_active_thread_percentage {srv} 250")),
        "50.0\n"
    );
    assert_eq!(d.cmd(&format!("set_device_pinned_mem_limit {srv} 0 8192M")), "");
    assert_eq!(d.cmd(&format!("get_device_pinned_mem_limit {srv} 0")), "8G\n");
    let second = ClientProcess::start(&d.pipe);
    assert_eq!(second.line, format!("SERVER {srv} THREADS 50.0 MEM 0=8G,1=3000M"));
    assert_eq!(
        d.cmd(&format!("get_client_list {srv}")),
        format!("{me}\n{}\n", second.pid)
    );

    // A closed channel is a gone client; the idle server stays.
    drop(first);
    assert!(wait_for(|| d.cmd(&format!("get_client_list {srv}")) == format!("{}\n", second.pid)).is_ok());
    drop(second);
    assert!(wait_for(|| d.cmd(&format!("get_client_list {srv}")).is_empty()).is_ok());
    assert_eq!(d.cmd("get_server_list"), format!("{srv}\n"));
    assert!(alive(srv as i32));

    // The same pid, once gone, registers again and latches the limits of now.
    let (_again, line) = cuda_client(&d.pipe).expect("admitted");
    assert_eq!(line, format!("SERVER {srv} THREADS 50.0 MEM 0=8G,1=3000M\n"));
    assert!(d.control_log().contains(&format!("NEW CLIENT {me} from user")));
}

#[test]
fn a_second_request_of_a_live_client_only_gets_a_descriptor() {
    let d = Daemon::start("GPU-aaaa");
    let (channel, line) = cuda_client(&d.pipe).expect("admitted");
    let srv = server_pid_of(&line);
    let (answer, mut fds) = kind2_request(&d.pipe);
    assert_eq!((answer.as_slice(), fds.len()), (CUFD, 1));
    // Nothing on that descriptor: once the connection is closed the daemon lets go of its end.
    let extra = fds.remove(0);
    extra
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    assert_eq!(recv(&extra).0, b"", "no SERVER line on a second descriptor");
    let me = std::process::id();
    assert_eq!(d.cmd(&format!("get_client_list {srv}")), format!("{me}\n"));
    drop(extra);
    assert_eq!(d.cmd(&format!("get_client_list {srv}")), format!("{me}\n"));
    assert!(d.control_log().contains(&format!("Client {me} from user")));
    drop(channel);
    assert!(wait_for(|| d.cmd(&format!("get_client_list {srv}")).is_empty()).is_ok());
}

#[test]
fn a_refused_client_is_closed_after_its_request_unanswered() {
    let d = Daemon::start_with("GPU-aaaa", &[("FAKE_MPS_CONTROL_MAX_CLIENTS", "1")]);
    let (held, line) = cuda_client(&d.pipe).expect("admitted");
    let srv = server_pid_of(&line);
    let refused = ClientProcess::start(&d.pipe);
    assert_eq!(refused.line, "REFUSED");
    let log = d.control_log();
    assert!(
        log.contains(&format!(
            "NEW CLIENT {} from user {}: refused: server {srv} already has 1 clients, its limit",
            refused.pid,
            nix::unistd::getuid().as_raw()
        )),
        "{log}"
    );
    assert_eq!(
        d.cmd(&format!("get_client_list {srv}")),
        format!("{}\n", std::process::id())
    );
    drop(held);
    assert!(wait_for(|| d.cmd(&format!("get_client_list {srv}")).is_empty()).is_ok());
    let taken = ClientProcess::start(&d.pipe);
    assert_eq!(taken.line, format!("SERVER {srv} THREADS 100.0 MEM 0=0"));
}

#[test]
fn a_channel_nobody_registers_on_leaves_the_server_stuck() {
    let d = Daemon::start("GPU-aaaa");
    let (held, line) = cuda_client(&d.pipe).expect("admitted");
    let srv = server_pid_of(&line);
    // A process takes its channel and closes it without registering.
    let (answer, fds) = kind2_request_as_new_process(&d.pipe);
    assert_eq!((answer.as_slice(), fds.len()), (CUFD, 1));
    drop(fds);
    assert!(
        wait_for(|| d.control_log().contains("Server stuck")).is_ok(),
        "{}",
        d.control_log()
    );
    // Reads of the daemon's own state still answer; a new client waits, unanswered.
    assert_eq!(d.cmd("get_server_list"), format!("{srv}\n"));
    let stream = connect_after_hello(&d.pipe.join("control"));
    stream
        .set_read_timeout(Some(std::time::Duration::from_millis(500)))
        .expect("timeout");
    send_with_credentials(&stream, CRED);
    send_with_credentials(&stream, KIND_CUDA_CLIENT);
    let mut buf = [0u8; 16];
    let waited = (&stream).read(&mut buf);
    assert!(
        matches!(&waited, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "a new client of a stuck server got {waited:?}"
    );
    drop(held);
    // `quit` hangs on a stuck server (measured): only killing the daemon ends it.
    let _ = kill(Pid::from_raw(d.pid), Signal::SIGKILL);
    assert!(wait_gone(d.pid).is_ok());
}

/// A kind-2 request from another process (the test binary's pid already has a client).
fn kind2_request_as_new_process(pipe: &Path) -> (Vec<u8>, Vec<UnixStream>) {
    let stream = connect_after_hello(&pipe.join("control"));
    // The credentials of a pid that has no client: the daemon takes the message's pid.
    let other = nix::sys::socket::UnixCredentials::from(libc::ucred {
        pid: 1,
        uid: nix::unistd::getuid().as_raw(),
        gid: nix::unistd::getgid().as_raw(),
    });
    for message in [CRED, KIND_CUDA_CLIENT] {
        socket::sendmsg::<()>(
            stream.as_raw_fd(),
            &[std::io::IoSlice::new(message)],
            &[socket::ControlMessage::ScmCredentials(&other)],
            socket::MsgFlags::empty(),
            None,
        )
        .expect("send");
    }
    recv(&stream)
}

#[test]
fn terminate_client_and_shutdown_server() {
    let d = Daemon::start("GPU-aaaa");
    let (channel, line) = cuda_client(&d.pipe).expect("admitted");
    let srv = server_pid_of(&line);
    let me = std::process::id();
    assert_eq!(d.cmd(&format!("terminate_client {srv} {me}")), "");
    assert_eq!(d.cmd(&format!("get_client_list {srv}")), "");
    // The daemon closed the client's channel.
    assert_eq!(recv(&channel).0, b"");

    assert_eq!(d.cmd(&format!("shutdown_server {srv} -f")), "");
    assert_eq!(d.cmd("get_server_list"), "");
    assert!(wait_gone(srv as i32).is_ok());

    assert_eq!(d.cmd("start_server -uid 0"), "");
    let srv2: u32 = d.cmd("get_server_list").trim().parse().expect("one server");
    assert_ne!(srv2, srv);
    // A server killed from outside drops out of the list.
    kill(Pid::from_raw(srv2 as i32), Signal::SIGKILL).expect("kill");
    assert!(wait_for(|| d.cmd("get_server_list").is_empty()).is_ok());
}

#[test]
fn quit_stops_servers_removes_files_and_exits() {
    let d = Daemon::start("GPU-aaaa");
    let (_channel, line) = cuda_client(&d.pipe).expect("admitted");
    let srv = server_pid_of(&line);
    let (code, out) = d.run("quit\n");
    assert_eq!((code, out.as_str()), (0, ""));
    for name in ["nvidia-cuda-mps-control.pid", "control", "control_privileged"] {
        assert!(!d.pipe.join(name).exists(), "{name} still there");
    }
    assert!(wait_gone(d.pid).is_ok(), "daemon still running");
    assert!(wait_gone(srv as i32).is_ok(), "server still running");
    let (code, out) = d.run("get_server_list\n");
    assert_eq!(
        (code, out.as_str()),
        (1, "Cannot find MPS control daemon process\n")
    );
}

#[test]
fn sigterm_cleans_up_like_quit() {
    let d = Daemon::start("GPU-aaaa");
    d.cmd("start_server -uid 0");
    let srv: i32 = d.cmd("get_server_list").trim().parse().expect("one server");
    kill(Pid::from_raw(d.pid), Signal::SIGTERM).expect("kill");
    assert!(wait_gone(d.pid).is_ok());
    assert!(wait_gone(srv).is_ok());
    assert!(!d.pipe.join("nvidia-cuda-mps-control.pid").exists());
}

#[test]
fn servers_die_with_a_killed_daemon() {
    let d = Daemon::start("GPU-aaaa");
    d.cmd("start_server -uid 0");
    let srv: i32 = d.cmd("get_server_list").trim().parse().expect("one server");
    kill(Pid::from_raw(d.pid), Signal::SIGKILL).expect("kill");
    assert!(wait_gone(d.pid).is_ok());
    assert!(wait_gone(srv).is_ok(), "server outlived its daemon");
}

#[test]
fn anything_but_the_measured_shape_is_closed_unanswered() {
    let d = Daemon::start("GPU-aaaa");
    let control = d.pipe.join("control");
    // The old text protocol, a wrong first message, an unknown kind, a malformed kind.
    let cases: [&[&[u8]]; 4] = [
        &[&b"CLIENT 1 0"[..]],
        &[&b"HELLO"[..]],
        &[CRED, &[7, 0, 0, 0]],
        &[CRED, &[2, 0]],
    ];
    for messages in cases {
        let stream = connect_after_hello(&control);
        for m in messages {
            send_with_credentials(&stream, m);
        }
        let (answer, fds) = recv(&stream);
        assert!(answer.is_empty() && fds.is_empty(), "{messages:?}: {answer:?}");
    }
    let log = d.control_log();
    assert!(log.contains("unknown connection kind 7"), "{log}");
    assert!(
        log.contains("User did not send valid credentials: first message"),
        "{log}"
    );
    assert_eq!(d.cmd("get_server_list"), "");
}

#[test]
fn concurrent_clients_share_one_server() {
    let d = Daemon::start("GPU-aaaa");
    d.cmd("set_default_active_thread_percentage 25");
    let pipe = d.pipe.clone();
    let starting: Vec<_> = (0..6)
        .map(|_| {
            let pipe = pipe.clone();
            std::thread::spawn(move || ClientProcess::start(&pipe))
        })
        .collect();
    let held: Vec<ClientProcess> = starting
        .into_iter()
        .map(|c| c.join().expect("client thread"))
        .collect();
    let srv = server_pid_of(&held[0].line);
    for client in &held {
        assert_eq!(client.line, format!("SERVER {srv} THREADS 25.0 MEM 0=0"));
    }
    assert_eq!(d.cmd("get_server_list"), format!("{srv}\n"));
    let mut listed: Vec<u32> = d
        .cmd(&format!("get_client_list {srv}"))
        .lines()
        .map(|l| l.parse().expect("pid"))
        .collect();
    listed.sort_unstable();
    let mut pids: Vec<u32> = held.iter().map(|c| c.pid).collect();
    pids.sort_unstable();
    assert_eq!(listed, pids, "each client by its own pid");
    drop(held);
    assert!(wait_for(|| d.cmd(&format!("get_client_list {srv}")).is_empty()).is_ok());
}

#[test]
fn one_connection_at_a_time_like_the_real_daemon() {
    // Measured on the H200: a connection that has its hello and says nothing keeps every
    // command waiting until it closes (gpu-mps's gate must never set limits while it relays).
    let d = Daemon::start("GPU-aaaa");
    let stalled = connect_after_hello(&d.pipe.join("control"));
    let pipe = d.pipe.clone();
    let started = Instant::now();
    let command = std::thread::spawn(move || run_cli(&pipe, "get_server_list\n"));
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !command.is_finished(),
        "a command ran while another connection was open"
    );
    drop(stalled);
    assert_eq!(command.join().expect("cli"), (0, String::new()));
    assert!(started.elapsed() >= Duration::from_millis(500));
}
