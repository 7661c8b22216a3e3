//! The checker's MPS subcommands (mps-client, mps-ui, mps-stall, mps-processes, mps-raw),
//! against stand-ins that script what a daemon or a gate does, and against the built
//! fake-mps-control. The stand-ins check the bytes the checker sends, written here from the
//! measurement (docs/gpu-results.md section 7), not from the checker's own constants.
//!
//! The fake is found next to the checker binary: `cargo test -p fake-mps-control -p
//! gpu-mps-checker` (or `--workspace`, as tests/run.sh does) builds both.

use std::io::{BufRead, BufReader, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use gpu_mps_checker::{
    CLI_CANNOT_SEND, CLI_NO_DAEMON, CUDA_REFUSED, MpsClient, MpsProcesses, MpsRaw, MpsStall, MpsUi,
};
use nix::sys::signal::{Signal, kill};
use nix::sys::socket::{
    self, AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
    UnixAddr, sockopt,
};
use nix::unistd::Pid;
use serde::de::DeserializeOwned;

const BIN: &str = env!("CARGO_BIN_EXE_gpu-mps-checker");

const HELLO: &[u8] = &[0x4f, 0x55, 0x54, 0x42, 0x48, 0x45, 0x4c, 0x4c, 0x00];
const CRED: &[u8] = &[0x4f, 0x55, 0x54, 0x42, 0x43, 0x52, 0x45, 0x44, 0x00];
const CUFD: &[u8] = &[0x4f, 0x55, 0x54, 0x42, 0x43, 0x55, 0x46, 0x44, 0x00];
const CUFD_HEX: &str = "4f5554424355464400";
const INSUFFICIENT: &str =
    "Control deamon settings can only be modified by the user who started it or by the root user.";

// ---- running the checker ----

fn checker(args: &[&str], pipe: &Path) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(args).env("CUDA_MPS_PIPE_DIRECTORY", pipe);
    cmd
}

/// Runs the checker to its end; returns (exit code, its one line, parsed).
fn run<T: DeserializeOwned>(args: &[&str], pipe: &Path) -> (i32, T) {
    let out = checker(args, pipe).output().expect("run checker");
    (out.status.code().unwrap_or(-1), one_line(&out))
}

fn one_line<T: DeserializeOwned>(out: &Output) -> T {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.lines().count(), 1, "exactly one line: {stdout:?}");
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// Starts the checker and returns it with its line, read while it still runs (it holds).
fn start<T: DeserializeOwned>(args: &[&str], pipe: &Path) -> (Child, T) {
    let mut child = checker(args, pipe)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn checker");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read");
    let parsed = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
    (child, parsed)
}

// ---- stand-ins ----

/// A SEQPACKET listener at `<dir>/control` that passes credentials, as the daemon's does.
fn listener(dir: &Path, backlog: i32) -> UnixListener {
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .expect("socket");
    socket::setsockopt(&fd, sockopt::PassCred, &true).expect("passcred");
    socket::bind(
        fd.as_raw_fd(),
        &UnixAddr::new(&dir.join("control")).expect("addr"),
    )
    .expect("bind");
    socket::listen(&fd, Backlog::new(backlog).expect("backlog")).expect("listen");
    UnixListener::from(fd)
}

fn send(stream: &UnixStream, bytes: &[u8], fd: Option<RawFd>) {
    let fds: Vec<RawFd> = fd.into_iter().collect();
    let cmsgs: Vec<ControlMessage<'_>> = if fds.is_empty() {
        Vec::new()
    } else {
        vec![ControlMessage::ScmRights(&fds)]
    };
    socket::sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(bytes)],
        &cmsgs,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .expect("send");
}

/// One message and the pid of its credentials; `None` at end of stream.
fn recv(stream: &UnixStream) -> Option<(Vec<u8>, Option<i32>)> {
    let mut buf = vec![0u8; 4096];
    let mut cmsg = nix::cmsg_space!(libc::ucred, [RawFd; 4]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    let msg = socket::recvmsg::<()>(
        stream.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .expect("recv");
    let mut pid = None;
    for c in msg.cmsgs().expect("cmsgs") {
        if let ControlMessageOwned::ScmCredentials(c) = c {
            pid = Some(c.pid());
        }
    }
    let n = msg.bytes;
    (n > 0).then(|| (buf[..n].to_vec(), pid))
}

fn seqpacket_pair() -> (UnixStream, UnixStream) {
    let (a, b) = socket::socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .expect("socketpair");
    (UnixStream::from(a), UnixStream::from(b))
}

/// A gate that greets, reads the two request messages and closes unanswered, `connections`
/// times; a probe (closed right after the hello) counts as one.
fn refusing_gate(dir: &Path, connections: usize) -> std::thread::JoinHandle<()> {
    let listener = listener(dir, 8);
    std::thread::spawn(move || {
        for _ in 0..connections {
            let (stream, _) = listener.accept().expect("accept");
            send(&stream, HELLO, None);
            for _ in 0..2 {
                if recv(&stream).is_none() {
                    break;
                }
            }
        }
    })
}

// ---- the fake daemon ----

fn fake_bin() -> PathBuf {
    let bin = Path::new(BIN).with_file_name("fake-mps-control");
    assert!(
        bin.exists(),
        "{} is not built: run cargo test -p fake-mps-control -p gpu-mps-checker",
        bin.display()
    );
    bin
}

/// fake-mps-control -d -M in its own temp dirs; dropping it quits (or kills) it.
struct Fake {
    dir: tempfile::TempDir,
    pipe: PathBuf,
    pid: i32,
}

impl Fake {
    fn start(env: &[(&str, &str)]) -> Fake {
        let dir = tempfile::tempdir().expect("tempdir");
        let pipe = dir.path().join("pipe");
        let out = Command::new(fake_bin())
            .args(["-d", "-M"])
            .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", dir.path().join("log"))
            .env("CUDA_VISIBLE_DEVICES", "GPU-aaaa")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .output()
            .expect("fake-mps-control -d");
        assert!(out.status.success(), "{out:?}");
        let pid = std::fs::read_to_string(pipe.join("nvidia-cuda-mps-control.pid"))
            .expect("pid file")
            .parse()
            .expect("pid");
        Fake { dir, pipe, pid }
    }

    /// One command through the fake's CLI (it reaches control_privileged); its stdout.
    fn cli(&self, command: &str) -> String {
        let mut child = Command::new(fake_bin())
            .env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("fake-mps-control");
        std::io::Write::write_all(
            child.stdin.as_mut().expect("stdin"),
            format!("{command}\n").as_bytes(),
        )
        .expect("write");
        let out = child.wait_with_output().expect("wait");
        assert!(out.status.success(), "{command}: {out:?}");
        String::from_utf8(out.stdout).expect("utf8")
    }

    fn client_pids(&self, server: u32) -> Vec<i32> {
        let mut pids: Vec<i32> = self
            .cli(&format!("get_client_list {server}"))
            .lines()
            .map(|l| l.parse().expect("pid"))
            .collect();
        pids.sort_unstable();
        pids
    }

    /// A pipe dir with only `control`, as a pod sees through a gate.
    fn control_only_view(&self) -> PathBuf {
        let view = self.dir.path().join("view");
        std::fs::create_dir_all(&view).expect("mkdir");
        std::os::unix::fs::symlink(self.pipe.join("control"), view.join("control")).expect("symlink");
        view
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        // `quit` never returns from a stuck server (a raw kind-2 request leaves it so): killed.
        let _ = kill(Pid::from_raw(self.pid), Signal::SIGKILL);
        let _ = Command::new(fake_bin())
            .env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .and_then(|mut c| {
                std::io::Write::write_all(c.stdin.as_mut().expect("stdin"), b"quit\n")?;
                c.wait()
            });
        std::thread::sleep(Duration::from_millis(50));
        let _ = kill(Pid::from_raw(self.pid), Signal::SIGKILL);
    }
}

fn wait_for(mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

// ---- mps-client ----

#[test]
fn mps_client_without_a_socket_is_a_direct_context() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (code, c): (_, MpsClient) = run(&["mps-client"], dir.path());
    assert_eq!(code, 1);
    assert!(
        c.direct_context && !c.connected && !c.admitted && !c.refused,
        "{c}"
    );
    assert!(c.mem.is_empty());
    assert_eq!(c.pipe_dir_used, dir.path().to_str().expect("utf8"));
    assert!(c.error.as_deref().is_some_and(|e| e.contains("ENOENT")), "{c}");
}

#[test]
fn mps_client_uses_the_default_pipe_dir_when_unset() {
    let out = Command::new(BIN)
        .arg("mps-client")
        .env_remove("CUDA_MPS_PIPE_DIRECTORY")
        .output()
        .expect("run");
    let c: MpsClient = one_line(&out);
    assert_eq!(c.pipe_dir_used, "/tmp/nvidia-mps");
}

#[test]
fn mps_client_closed_before_the_hello_is_a_direct_context() {
    let dir = tempfile::tempdir().expect("tempdir");
    let listener = listener(dir.path(), 4);
    let gate = std::thread::spawn(move || drop(listener.accept().expect("accept")));
    let (code, c): (_, MpsClient) = run(&["mps-client"], dir.path());
    gate.join().expect("gate");
    assert_eq!(code, 1);
    assert!(c.direct_context && !c.connected && !c.refused, "{c}");
    assert!(
        c.error.as_deref().is_some_and(|e| e.contains("before its hello")),
        "{c}"
    );
}

#[test]
fn mps_client_closed_after_its_request_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    // The probe, then the request that is closed unanswered.
    let gate = refusing_gate(dir.path(), 2);
    let (code, c): (_, MpsClient) = run(&["mps-client"], dir.path());
    gate.join().expect("gate");
    assert_eq!(code, 1);
    assert!(
        c.refused && c.connected && !c.admitted && !c.direct_context,
        "{c}"
    );
    assert_eq!(c.error.as_deref(), Some(CUDA_REFUSED));
    assert_eq!(c.descriptors, 0);
    assert!(
        c.detail
            .as_deref()
            .is_some_and(|d| d.contains("after the request")),
        "{c}"
    );
}

/// A stand-in daemon with the measured shape: it checks every byte the client sends and that
/// each message carries the client's credentials, and reports how long the channel was held.
#[test]
fn mps_client_speaks_the_measured_shape_and_holds_its_channel() {
    let dir = tempfile::tempdir().expect("tempdir");
    let listener = listener(dir.path(), 4);
    let daemon = std::thread::spawn(move || {
        let mut said = Vec::new();
        let mut channel = None;
        for connection in 0..3 {
            let (stream, _) = listener.accept().expect("accept");
            send(&stream, HELLO, None);
            if connection == 0 {
                assert!(recv(&stream).is_none(), "the probe sends nothing");
                continue;
            }
            said.push(recv(&stream).expect("credentials"));
            said.push(recv(&stream).expect("kind"));
            let (kept, passed) = seqpacket_pair();
            if connection == 1 {
                send(&kept, b"SERVER 607 THREADS 25.0 MEM 0=4G,1=3000M\n", None);
                channel = Some(kept);
            }
            send(&stream, CUFD, Some(passed.as_raw_fd()));
            said.push(recv(&stream).expect("ack"));
            assert!(recv(&stream).is_none(), "the client closes after its ack");
        }
        let answered = Instant::now();
        let channel = channel.expect("a channel");
        let first = recv(&channel).expect("the client registers on its channel");
        assert_eq!(first.0, b"REGISTER");
        assert!(recv(&channel).is_none(), "channel closed at the end of the hold");
        (said, answered.elapsed())
    });

    let started = Instant::now();
    let (mut child, c): (_, MpsClient) = start(&["mps-client", "--hold-seconds", "1"], dir.path());
    let status = child.wait().expect("wait");
    assert!(status.success(), "{c}");
    assert!(
        c.admitted && c.connected && !c.refused && !c.direct_context,
        "{c}"
    );
    assert_eq!(c.descriptors, 2);
    assert_eq!(c.server_pid, Some(607));
    assert_eq!(c.threads.as_deref(), Some("25.0"));
    assert_eq!(
        c.mem,
        [("0", "4G"), ("1", "3000M")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    );
    assert_eq!(
        c.answer.as_deref(),
        Some("SERVER 607 THREADS 25.0 MEM 0=4G,1=3000M")
    );
    assert_eq!((c.error, c.detail), (None, None));

    let (said, held) = daemon.join().expect("daemon thread");
    let pid = Some(child.id() as i32);
    let request = [
        (CRED.to_vec(), pid),
        (vec![2, 0, 0, 0], pid),
        (vec![0, 0, 0, 0], pid),
    ];
    assert_eq!(said, [request.clone(), request].concat());
    assert!(
        held >= Duration::from_millis(900) && started.elapsed() < Duration::from_secs(10),
        "held its channel {held:?}"
    );
}

#[test]
fn mps_client_against_the_fake_is_listed_while_it_holds() {
    let fake = Fake::start(&[]);
    fake.cli("set_default_active_thread_percentage 25");
    fake.cli("set_default_device_pinned_mem_limit 0 4G");
    let (mut child, c): (_, MpsClient) = start(&["mps-client", "--hold-seconds", "30"], &fake.pipe);
    assert!(c.admitted, "{c}");
    assert_eq!(c.descriptors, 2);
    assert_eq!((c.threads.as_deref(), c.mem["0"].as_str()), (Some("25.0"), "4G"));
    let srv = c.server_pid.expect("server");
    assert_eq!(fake.client_pids(srv), vec![child.id() as i32]);
    kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).expect("kill");
    assert_eq!(child.wait().expect("wait").code(), Some(128 + 15));
    assert!(wait_for(|| fake.client_pids(srv).is_empty()));
}

#[test]
fn mps_client_refused_by_the_fake() {
    let fake = Fake::start(&[("FAKE_MPS_CONTROL_MAX_CLIENTS", "1")]);
    let (mut holder, first): (_, MpsClient) = start(&["mps-client", "--hold-seconds", "30"], &fake.pipe);
    assert!(first.admitted, "{first}");
    let (code, c): (_, MpsClient) = run(&["mps-client"], &fake.pipe);
    assert_eq!(code, 1);
    assert!(c.refused && c.connected && !c.admitted, "{c}");
    assert_eq!(c.error.as_deref(), Some(CUDA_REFUSED));
    let _ = holder.kill();
    let _ = holder.wait();
}

// ---- mps-ui ----

#[test]
fn mps_ui_reads_and_changes_on_control_privileged() {
    let fake = Fake::start(&[]);
    let (code, ui): (_, MpsUi) = run(&["mps-ui", "get_default_active_thread_percentage"], &fake.pipe);
    assert_eq!(code, 0);
    assert!(ui.reached_daemon, "{ui}");
    assert_eq!(ui.answer.as_deref(), Some("100.0"));
    assert_eq!(ui.error, None);
    let privileged = fake.pipe.join("control_privileged");
    assert_eq!(ui.socket_used.as_deref(), privileged.to_str());
    // Arguments are one command, joined.
    let (_, ui): (_, MpsUi) = run(
        &["mps-ui", "set_default_active_thread_percentage", "30"],
        &fake.pipe,
    );
    assert_eq!(ui.command, "set_default_active_thread_percentage 30");
    assert_eq!(ui.answer.as_deref(), Some("30.0"));
    // An answer without output.
    let (_, ui): (_, MpsUi) = run(&["mps-ui", "get_server_list"], &fake.pipe);
    assert_eq!((ui.reached_daemon, ui.answer.as_deref()), (true, Some("")));
    assert_eq!(fake.cli("get_default_active_thread_percentage"), "30.0\n");
}

#[test]
fn mps_ui_from_a_pod_view_is_refused_changes_with_the_real_texts() {
    let fake = Fake::start(&[]);
    let view = fake.control_only_view();
    let uid = nix::unistd::getuid().as_raw();
    let (code, ui): (_, MpsUi) = run(&["mps-ui", "set_default_active_thread_percentage 5"], &view);
    assert_eq!(code, 0, "the daemon answered: {ui}");
    assert_eq!(ui.socket_used.as_deref(), view.join("control").to_str());
    assert_eq!(
        ui.answer,
        Some(format!("Insufficient privileges for UID {uid}. {INSUFFICIENT}"))
    );
    let (_, ui): (_, MpsUi) = run(&["mps-ui", "quit"], &view);
    assert_eq!(
        ui.answer.as_deref(),
        Some("Not enough privilege to execute quit command")
    );
    let (_, ui): (_, MpsUi) = run(&["mps-ui", "get_default_active_thread_percentage"], &view);
    assert_eq!(ui.answer.as_deref(), Some("100.0"));
    assert_eq!(fake.cli("get_default_active_thread_percentage"), "100.0\n");
}

#[test]
fn mps_ui_without_a_daemon_and_closed_after_the_request() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (code, ui): (_, MpsUi) = run(&["mps-ui", "get_server_list"], dir.path());
    assert_eq!(code, 1);
    assert!(!ui.reached_daemon && ui.socket_used.is_none(), "{ui}");
    assert_eq!(ui.error.as_deref(), Some(CLI_NO_DAEMON));

    let gate = refusing_gate(dir.path(), 1);
    let (code, ui): (_, MpsUi) = run(&["mps-ui", "get_server_list"], dir.path());
    gate.join().expect("gate");
    assert_eq!(code, 1);
    assert!(!ui.reached_daemon && ui.answer.is_none(), "{ui}");
    assert_eq!(ui.error.as_deref(), Some(CLI_CANNOT_SEND));
}

// ---- mps-stall ----

#[test]
fn mps_stall_holds_the_one_connection_the_fake_serves() {
    let fake = Fake::start(&[]);
    let pipe = fake.pipe.clone();
    let stall = std::thread::spawn(move || {
        run::<MpsStall>(
            &[
                "mps-stall",
                "--connections",
                "3",
                "--hold-seconds",
                "1.5",
                "--read-hello",
            ],
            &pipe,
        )
    });
    // The stall's first connection must be the one the fake serves before the CLI asks: wait
    // until the fake has accepted it (an accepted socket carries the listener's path in
    // /proc/net/unix, in state connected), not a fixed time that a loaded machine outruns.
    let control = fake.pipe.join("control");
    let deadline = Instant::now() + Duration::from_secs(10);
    while accepted_connections(&control) == 0 {
        assert!(
            Instant::now() < deadline,
            "the stall never connected to {}",
            control.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(100));
    let asked = Instant::now();
    assert_eq!(fake.cli("get_server_list"), "");
    let waited = asked.elapsed();
    let (code, s) = stall.join().expect("stall");
    assert_eq!(code, 0);
    assert_eq!(
        (s.connections, s.connected, s.blocked, s.failed),
        (3, 3, 0, 0),
        "{s}"
    );
    // One at a time: only the first connection was greeted while they were held.
    assert_eq!((s.got_hello, s.closed_by_peer), (1, 0), "{s}");
    assert!(s.connect_ms_max.is_some_and(|ms| ms < 1000.0), "{s}");
    assert!(
        waited >= Duration::from_millis(700),
        "the CLI got through a stall after {waited:?}"
    );
}

#[test]
fn mps_stall_reports_blocked_and_failed_connects() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (code, s): (_, MpsStall) = run(
        &["mps-stall", "--connections", "2", "--hold-seconds", "0"],
        dir.path(),
    );
    assert_eq!(code, 0);
    assert_eq!((s.connected, s.blocked, s.failed), (0, 0, 2), "{s}");
    assert_eq!(s.connect_errors.get("ENOENT"), Some(&2), "{s}");
    assert_eq!(s.connect_ms_median, None);

    // A listener that never accepts: connects beyond its backlog block.
    let listener = listener(dir.path(), 1);
    let (_, s): (_, MpsStall) = run(
        &["mps-stall", "--connections", "6", "--hold-seconds", "0.5"],
        dir.path(),
    );
    drop(listener);
    assert!(s.connected >= 1 && s.blocked >= 1, "{s}");
    assert_eq!(s.connected + s.blocked + s.failed, 6, "{s}");
    assert_eq!(s.got_hello, 0, "{s}");
}

// ---- mps-processes ----

#[test]
fn mps_processes_are_each_a_client_of_their_own() {
    let fake = Fake::start(&[]);
    fake.cli("set_default_active_thread_percentage 40");
    let (mut parent, p): (_, MpsProcesses) = start(
        &["mps-processes", "--count", "3", "--hold-seconds", "3"],
        &fake.pipe,
    );
    assert_eq!((p.count, p.admitted, p.refused, p.failed), (3, 3, 0, 0), "{p}");
    assert!(p.unreadable.is_empty(), "{p}");
    let srv = p.children[0].server_pid.expect("server");
    let mut pids: Vec<i32> = p.children.iter().map(|c| c.sent_pid).collect();
    pids.sort_unstable();
    pids.dedup();
    assert_eq!(pids.len(), 3, "three processes: {p}");
    for c in &p.children {
        assert_eq!(
            (c.server_pid, c.threads.as_deref()),
            (Some(srv), Some("40.0")),
            "{c}"
        );
    }
    // Printed while they hold their channels.
    assert_eq!(fake.client_pids(srv), pids);
    assert!(parent.wait().expect("wait").success());
    assert!(wait_for(|| fake.client_pids(srv).is_empty()));
}

#[test]
fn mps_processes_beyond_the_limit_are_refused() {
    let fake = Fake::start(&[("FAKE_MPS_CONTROL_MAX_CLIENTS", "2")]);
    let (code, p): (_, MpsProcesses) = run(
        &["mps-processes", "--count", "3", "--hold-seconds", "1"],
        &fake.pipe,
    );
    assert_eq!(code, 1);
    assert_eq!(
        (p.admitted, p.refused, p.direct_context, p.failed),
        (2, 1, 0, 0),
        "{p}"
    );
    let refused = p.children.iter().find(|c| c.refused).expect("one refused");
    assert_eq!(refused.error.as_deref(), Some(CUDA_REFUSED));
}

// ---- mps-raw ----

#[test]
fn mps_raw_shows_what_each_kind_gets_from_the_fake() {
    let fake = Fake::start(&[]);
    let raw = |kind: &str| run::<MpsRaw>(&["mps-raw", "--kind", kind, "--wait-seconds", "0.5"], &fake.pipe);

    let (code, r) = raw("2");
    assert_eq!(code, 0);
    assert_eq!(r.hello_hex.as_deref(), Some("4f55544248454c4c00"));
    assert_eq!(r.replies.len(), 1, "{r}");
    assert_eq!(
        (r.replies[0].hex.as_str(), r.replies[0].descriptors),
        (CUFD_HEX, 1)
    );
    assert!(!r.closed, "the fake waits for the ack: {r}");
    assert_eq!(r.error, None);

    let (_, r) = raw("7");
    assert!(r.closed && r.replies.is_empty(), "{r}");

    // A UI session waits for its command.
    let (_, r) = raw("4");
    assert!(!r.closed && r.replies.is_empty(), "{r}");

    let dir = tempfile::tempdir().expect("tempdir");
    let (_, r): (_, MpsRaw) = run(&["mps-raw", "--kind", "2"], dir.path());
    assert!(r.error.as_deref().is_some_and(|e| e.contains("ENOENT")), "{r}");
    assert_eq!(r.hello_hex, None);
    assert!(
        fake.cli("get_server_list").lines().count() == 1,
        "the raw kind-2 request started a server"
    );
}

/// The checker's own credentials go with the raw request too (a gate reads them).
#[test]
fn mps_raw_sends_credentials_and_the_kind() {
    let dir = tempfile::tempdir().expect("tempdir");
    let listener = listener(dir.path(), 4);
    let gate = std::thread::spawn(move || {
        let (stream, _) = listener.accept().expect("accept");
        send(&stream, HELLO, None);
        let got = [recv(&stream).expect("cred"), recv(&stream).expect("kind")];
        send(&stream, b"\x01\x02", None);
        got
    });
    let child = checker(&["mps-raw", "--kind", "7", "--wait-seconds", "5"], dir.path())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn");
    let pid = Some(child.id() as i32);
    let out = child.wait_with_output().expect("wait");
    let r: MpsRaw = one_line(&out);
    let got = gate.join().expect("gate");
    assert_eq!(got, [(CRED.to_vec(), pid), (vec![7, 0, 0, 0], pid)]);
    assert_eq!(r.replies.len(), 1, "{r}");
    assert_eq!((r.replies[0].hex.as_str(), r.replies[0].descriptors), ("0102", 0));
    assert!(r.closed, "{r}");
}

/// How many connections to the unix socket at `path` have been accepted and are open: lines of
/// /proc/net/unix in state 03 (connected) that carry the path.
fn accepted_connections(path: &std::path::Path) -> usize {
    let path = path.to_string_lossy();
    std::fs::read_to_string("/proc/net/unix")
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() >= 8 && f[5] == "03" && f[7] == path
        })
        .count()
}
