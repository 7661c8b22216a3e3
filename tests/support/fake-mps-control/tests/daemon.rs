//! Drives the built fake-mps-control binary the way gpu-mps-manager drives the real one: `-d -M`
//! with the MPS environment, then one CLI run per batch of commands, and CUDA clients on the
//! pipe dir's `control` socket.

use std::io::{IoSlice, IoSliceMut, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::sys::socket::{
    self, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType, UnixAddr,
    UnixCredentials,
};
use nix::unistd::Pid;

const BIN: &str = env!("CARGO_BIN_EXE_fake-mps-control");
const BANNER: &str = "FAKE nvidia-cuda-mps-control (gpu-mps test double; no GPU, no MPS)";

/// A daemon in its own temp pipe and log dirs. Dropping it quits the daemon, and kills it when
/// quit does not work, so a failing test leaks no process.
struct Daemon {
    _dir: tempfile::TempDir,
    pipe: PathBuf,
    log: PathBuf,
    pid: i32,
}

impl Daemon {
    fn start(visible_devices: &str) -> Daemon {
        let dir = tempfile::tempdir().expect("tempdir");
        let (pipe, log) = (dir.path().join("pipe"), dir.path().join("log"));
        let out = start_daemon(&pipe, &log, visible_devices);
        assert!(out.status.success(), "-d failed: {out:?}");
        assert!(
            out.stdout.is_empty() && out.stderr.is_empty(),
            "-d printed: {out:?}"
        );
        let pid = std::fs::read_to_string(pipe.join("nvidia-cuda-mps-control.pid")).expect("pid file");
        let pid = pid.parse().expect("pid file holds a bare pid");
        Daemon {
            _dir: dir,
            pipe,
            log,
            pid,
        }
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

fn start_daemon(pipe: &Path, log: &Path, visible_devices: &str) -> Output {
    Command::new(BIN)
        .args(["-d", "-M"])
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .env("CUDA_MPS_LOG_DIRECTORY", log)
        .env("CUDA_VISIBLE_DEVICES", visible_devices)
        .stdin(Stdio::null())
        .output()
        .expect("run fake-mps-control -d")
}

fn run_cli(pipe: &Path, input: &str) -> (i32, String) {
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
    let out = child.wait_with_output().expect("wait");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).expect("utf8"),
    )
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

/// A fake CUDA client's main connection (see src/protocol.rs): connects to `<pipe>/control`,
/// reads the daemon's hello, sends `hello` with this process's credentials, and returns the
/// channel the daemon passed (the client is listed until it is dropped) and its one-line answer
/// (empty when it closed the connection instead).
fn cuda_client(pipe: &Path, hello: &str) -> (Option<UnixStream>, String) {
    let stream = connect_control(pipe);
    let mut buf = [0u8; 4096];
    let n = std::io::Read::read(&mut &stream, &mut buf).expect("hello");
    assert_eq!(&buf[..n], b"HELLO", "the daemon speaks first");
    let creds = UnixCredentials::new();
    let sent = socket::sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(hello.as_bytes())],
        &[ControlMessage::ScmCredentials(&creds)],
        MsgFlags::empty(),
        None,
    )
    .expect("send");
    assert_eq!(sent, hello.len());
    let mut cmsg = nix::cmsg_space!([RawFd; 2]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    let msg = socket::recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::empty())
        .expect("recv");
    let mut channel = None;
    for c in msg.cmsgs().expect("cmsgs") {
        if let ControlMessageOwned::ScmRights(fds) = c {
            channel = fds.first().copied().map(adopt);
        }
    }
    let n = msg.bytes;
    (channel, String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// A SOCK_SEQPACKET connection to `<pipe>/control`.
fn connect_control(pipe: &Path) -> UnixStream {
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .expect("socket");
    socket::connect(
        fd.as_raw_fd(),
        &UnixAddr::new(&pipe.join("control")).expect("addr"),
    )
    .expect("connect");
    UnixStream::from(fd)
}

/// Owns a descriptor received over SCM_RIGHTS.
fn adopt(fd: RawFd) -> UnixStream {
    #[allow(unsafe_code)]
    // SAFETY: `fd` was just received over SCM_RIGHTS; nothing else owns it.
    unsafe {
        std::os::fd::FromRawFd::from_raw_fd(fd)
    }
}

fn server_pid_of(answer: &str) -> u32 {
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .expect("SERVER <pid> ...")
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
}

#[test]
fn a_second_daemon_for_the_same_pipe_dir_is_refused() {
    let d = Daemon::start("GPU-aaaa");
    let out = start_daemon(&d.pipe, &d.log, "GPU-aaaa");
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
    let out = start_daemon(&pipe, &dir.path().join("log"), "GPU-aaaa");
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
fn servers_take_the_defaults_in_force_when_they_start() {
    let d = Daemon::start("GPU-aaaa,GPU-bbbb");
    d.cmd("set_default_active_thread_percentage 25");
    d.cmd("set_default_device_pinned_mem_limit 0 4096M");
    d.cmd("set_default_device_pinned_mem_limit 1 3000M");

    // The client claims pid 1 (its pid inside a container); the daemon uses its credentials.
    let (first, answer) = cuda_client(&d.pipe, "CLIENT 1 0");
    let srv = server_pid_of(&answer);
    assert_eq!(answer, format!("SERVER {srv} THREADS 25.0 MEM 0=4G,1=3000M\n"));
    assert!(alive(srv as i32), "the server is a real process");
    assert_eq!(d.cmd("get_server_list"), format!("{srv}\n"));
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
    let (second, answer) = cuda_client(&d.pipe, "CLIENT 1 0");
    assert_eq!(answer, format!("SERVER {srv} THREADS 50.0 MEM 0=8G,1=3000M\n"));
    assert_eq!(d.cmd(&format!("get_client_list {srv}")), format!("{me}\n{me}\n"));

    // A closed connection is a gone client; the idle server stays.
    drop(first);
    assert!(wait_for(|| d.cmd(&format!("get_client_list {srv}")) == format!("{me}\n")).is_ok());
    drop(second);
    assert!(wait_for(|| d.cmd(&format!("get_client_list {srv}")).is_empty()).is_ok());
    assert_eq!(d.cmd("get_server_list"), format!("{srv}\n"));
    assert!(alive(srv as i32));

    assert!(d.control_log().contains(&format!("NEW CLIENT {me} from user")));
}

#[test]
fn terminate_client_and_shutdown_server() {
    let d = Daemon::start("GPU-aaaa");
    let (client, answer) = cuda_client(&d.pipe, "CLIENT 1 0");
    let srv = server_pid_of(&answer);
    let me = std::process::id();
    assert_eq!(d.cmd(&format!("terminate_client {srv} {me}")), "");
    assert_eq!(d.cmd(&format!("get_client_list {srv}")), "");
    // The daemon closed the client's channel.
    let mut buf = [0u8; 16];
    let channel = client.as_ref().expect("a channel");
    assert_eq!(std::io::Read::read(&mut &*channel, &mut buf).expect("read"), 0);

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
    let (_client, answer) = cuda_client(&d.pipe, "CLIENT 1 0");
    let srv = server_pid_of(&answer);
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
fn garbage_on_the_control_socket_is_dropped() {
    let d = Daemon::start("GPU-aaaa");
    let (_conn, answer) = cuda_client(&d.pipe, "HELLO");
    assert_eq!(
        answer, "",
        "the daemon closes a connection that is neither UI nor CLIENT"
    );
    assert_eq!(d.cmd("get_server_list"), "");
}

#[test]
fn concurrent_clients_share_one_server() {
    let d = Daemon::start("GPU-aaaa");
    d.cmd("set_default_active_thread_percentage 25");
    let pipe = d.pipe.clone();
    let clients: Vec<_> = (0..8)
        .map(|_| {
            let pipe = pipe.clone();
            std::thread::spawn(move || cuda_client(&pipe, "CLIENT 1 0"))
        })
        .collect();
    let held: Vec<(Option<UnixStream>, String)> = clients
        .into_iter()
        .map(|c| c.join().expect("client thread"))
        .collect();
    let srv = server_pid_of(&held[0].1);
    for (_, answer) in &held {
        assert_eq!(answer, &format!("SERVER {srv} THREADS 25.0 MEM 0=0\n"));
    }
    assert_eq!(d.cmd("get_server_list"), format!("{srv}\n"));
    assert_eq!(d.cmd(&format!("get_client_list {srv}")).lines().count(), 8);
    drop(held);
    assert!(wait_for(|| d.cmd(&format!("get_client_list {srv}")).is_empty()).is_ok());
}

#[test]
fn one_connection_at_a_time_like_the_real_daemon() {
    // Measured on the H200: a connection that has its hello and says nothing keeps every
    // command waiting until it closes (gpu-mps's gate must never set limits while it relays).
    let d = Daemon::start("GPU-aaaa");
    let stalled = connect_control(&d.pipe);
    let mut buf = [0u8; 16];
    assert_eq!(std::io::Read::read(&mut &stalled, &mut buf).expect("hello"), 5);
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
