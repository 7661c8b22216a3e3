//! The connect gate against a daemon that speaks the measured shape of the MPS control
//! protocol (docs/gpu-results.md section 7), in one process: what passes, what is refused and
//! how, that a stalled container holds nobody else up, and that each client reaches the
//! daemon under its own limits.

// Test helpers may unwrap: a panic that shows the value is the clearest failure here.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use gpu_mps_api::{ContainerId, DaemonKey, Limits};
use gpu_mps_gate_keeper::fd_passing;
use gpu_mps_manager::gate::{GateBounds, GateTarget, GateTimings, Gates, seqpacket, wire};
use gpu_mps_manager::mps_control::{self, ControlError, MpsControl};
use nix::cmsg_space;
use nix::sys::socket::{self, ControlMessage, ControlMessageOwned, MsgFlags, UnixCredentials};

/// The limits the daemon's server holds, as the manager's CLI calls set them.
#[derive(Default)]
struct ServerLimits {
    threads: String,
    memory: BTreeMap<String, String>,
}

/// The channels the daemon issued, by the pid it was given: one server's clients, as long as
/// the other end of the channel is open (what MPS lists with `get_client_list`).
type Channels = Arc<Mutex<Vec<(i32, UnixStream)>>>;

/// The server's pid in `get_server_list`, while `lists` is set.
const SERVER_PID: &str = "4242";

/// The control CLI: what setting defaults needs, and, while `lists` is set, one server whose
/// clients are the channels the daemon issued and someone still holds.
#[derive(Default)]
struct StubControl {
    limits: Arc<Mutex<ServerLimits>>,
    channels: Channels,
    lists: Arc<AtomicBool>,
}

/// The pids whose channel is still held by someone.
fn held(channels: &Channels) -> Vec<i32> {
    let mut c = channels.lock().unwrap();
    c.retain(|(_, keep)| {
        let mut b = [0u8; 1];
        // 0 bytes: the other end is closed; EAGAIN: open.
        !matches!(
            socket::recv(
                keep.as_raw_fd(),
                &mut b,
                MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT
            ),
            Ok(0)
        )
    });
    c.iter().map(|(pid, _)| *pid).collect()
}

#[async_trait]
impl MpsControl for StubControl {
    async fn start_daemon(&self, _: &DaemonKey, _: &Path, _: &Path) -> Result<u32, ControlError> {
        unreachable!("the test starts its own daemon")
    }
    async fn command(&self, _: &Path, command: &str) -> Result<String, ControlError> {
        let mut l = self.limits.lock().unwrap();
        let w: Vec<&str> = command.split_whitespace().collect();
        let lists = self.lists.load(Ordering::SeqCst);
        Ok(match w.as_slice() {
            ["get_server_list"] if lists => SERVER_PID.to_string(),
            ["get_server_list"] => String::new(),
            ["get_client_list", server] if lists && *server == SERVER_PID => held(&self.channels)
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join("\n"),
            // The one server's own limits: kept with the defaults (one server, set the same).
            ["set_active_thread_percentage", SERVER_PID, p] | ["set_default_active_thread_percentage", p] => {
                l.threads = format!("{p}.0");
                l.threads.clone()
            }
            ["get_default_active_thread_percentage"] | ["get_active_thread_percentage", SERVER_PID] => {
                l.threads.clone()
            }
            ["set_default_device_pinned_mem_limit", dev, v]
            | ["set_device_pinned_mem_limit", SERVER_PID, dev, v] => {
                let mib: u64 = v.trim_end_matches('M').parse().unwrap();
                l.memory.insert(dev.to_string(), format!("{}G", mib / 1024));
                String::new()
            }
            ["get_default_device_pinned_mem_limit", dev]
            | ["get_device_pinned_mem_limit", SERVER_PID, dev] => {
                l.memory.get(*dev).cloned().unwrap_or_default()
            }
            _ => format!("Unknown command \"{command}\""),
        })
    }
}

/// What the daemon saw of one request: the client's pid from its credentials and the limits
/// the server held at that moment.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    pid: i32,
    threads: String,
}

/// A control daemon with the measured shape: hello first, one connection at a time, a channel
/// descriptor for a CUDA client's request, then the client's acknowledgement.
struct Daemon {
    pipe: PathBuf,
    seen: Arc<Mutex<Vec<Seen>>>,
    connections: Arc<Mutex<u32>>,
    /// While set, the daemon takes connections and says nothing: what a stuck server looks
    /// like from the gate (docs/gpu-results.md section 7).
    mute: Arc<AtomicBool>,
}

fn start_daemon(pipe: &Path, limits: Arc<Mutex<ServerLimits>>, channels: Channels) -> Daemon {
    std::fs::create_dir_all(pipe).unwrap();
    std::fs::write(pipe.join(mps_control::PID_FILE), std::process::id().to_string()).unwrap();
    let listener = seqpacket::bind_gate_socket(pipe, mps_control::CONTROL_SOCKET).unwrap();
    listener.set_nonblocking(false).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let connections = Arc::new(Mutex::new(0));
    let mute = Arc::new(AtomicBool::new(false));
    let (s, c, m) = (seen.clone(), connections.clone(), mute.clone());
    std::thread::spawn(move || {
        let mut unanswered = Vec::new();
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            *c.lock().unwrap() += 1;
            if m.load(Ordering::SeqCst) {
                unanswered.push(stream);
                continue;
            }
            stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            send(&stream, wire::HELLO, None);
            let Some((first, creds, _)) = recv(&stream) else {
                continue;
            };
            let Some((kind, _, _)) = recv(&stream) else {
                continue;
            };
            if first != wire::CREDENTIALS || kind != [2, 0, 0, 0] {
                continue;
            }
            let pid = creds.map_or(0, |c| c.pid());
            s.lock().unwrap().push(Seen {
                pid,
                threads: limits.lock().unwrap().threads.clone(),
            });
            let (keep, pass) = UnixStream::pair().unwrap();
            send(&stream, wire::CHANNEL_ANSWER, Some(pass.as_raw_fd()));
            drop(pass);
            channels.lock().unwrap().push((pid, keep));
            // The acknowledgement, then the end of the connection.
            while recv(&stream).is_some() {}
        }
    });
    Daemon {
        pipe: pipe.to_path_buf(),
        seen,
        connections,
        mute,
    }
}

fn send(stream: &UnixStream, data: &[u8], fd: Option<RawFd>) {
    let fds: Vec<RawFd> = fd.into_iter().collect();
    let creds = UnixCredentials::new();
    let mut cmsgs = vec![ControlMessage::ScmCredentials(&creds)];
    if !fds.is_empty() {
        cmsgs.push(ControlMessage::ScmRights(&fds));
    }
    let _ = socket::sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(data)],
        &cmsgs,
        MsgFlags::MSG_NOSIGNAL,
        None,
    );
}

/// One message, its credentials and how many descriptors came with it; `None` at the end.
fn recv(stream: &UnixStream) -> Option<(Vec<u8>, Option<UnixCredentials>, usize)> {
    let mut buf = vec![0u8; 4096];
    let mut cmsg = cmsg_space!(libc::ucred, [RawFd; 4]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    let msg = socket::recvmsg::<()>(
        stream.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .ok()?;
    let mut creds = None;
    let mut fds = 0;
    for c in msg.cmsgs().ok()? {
        match c {
            ControlMessageOwned::ScmCredentials(c) => creds = Some(c),
            ControlMessageOwned::ScmRights(r) => {
                fds += r.len();
                r.into_iter().for_each(|fd| {
                    let _ = nix::unistd::close(fd);
                });
            }
            _ => {}
        }
    }
    let n = msg.bytes;
    if n == 0 && fds == 0 && creds.is_none() {
        return None;
    }
    Some((buf[..n].to_vec(), creds, fds))
}

/// A client's connection, greeted.
fn open(gate: &Path) -> UnixStream {
    let s = seqpacket::connect(&gate.join("control")).unwrap();
    s.set_nonblocking(false).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let (hello, _, _) = recv(&s).expect("a hello");
    assert_eq!(hello, wire::HELLO);
    s
}

/// What a connection got for its request: the answer's descriptors, or `None` if it was closed.
fn request(gate: &Path, kind: u32, ack: bool) -> Option<usize> {
    let s = open(gate);
    send(&s, wire::CREDENTIALS, None);
    send(&s, &kind.to_le_bytes(), None);
    let (answer, _, fds) = recv(&s)?;
    assert_eq!(answer, wire::CHANNEL_ANSWER);
    if ack {
        send(&s, wire::CLIENT_ACK, None);
    }
    Some(fds)
}

/// The measured client: a probe, then two requests.
fn cuda_client(gate: &Path) -> bool {
    drop(open(gate));
    request(gate, wire::KIND_CUDA_CLIENT, true) == Some(1)
        && request(gate, wire::KIND_CUDA_CLIENT, true) == Some(1)
}

struct Node {
    dir: tempfile::TempDir,
    gates: Arc<Gates>,
    daemon: Daemon,
    key: DaemonKey,
    /// Set: the stub CLI lists the server's clients (the channels still held).
    lists: Arc<AtomicBool>,
}

fn node(per_container: u32) -> Node {
    node_with(
        per_container,
        GateTimings {
            handshake_timeout: Duration::from_secs(5),
            queue_timeout: Duration::from_secs(5),
        },
    )
}

fn node_with(per_container: u32, timings: GateTimings) -> Node {
    let dir = tempfile::tempdir().unwrap();
    let control = StubControl::default();
    let daemon = start_daemon(
        &dir.path().join("pipe"),
        control.limits.clone(),
        control.channels.clone(),
    );
    let lists = control.lists.clone();
    let gates = Gates::new(
        Arc::new(control),
        timings,
        GateBounds {
            per_container,
            node: 4096,
        },
    );
    Node {
        dir,
        gates: Arc::new(gates),
        daemon,
        key: DaemonKey::new(["GPU-test"]),
        lists,
    }
}

impl Node {
    fn open(&self, id: &str, gib: u64, pct: u8, processes: u32) -> PathBuf {
        let container = ContainerId::parse(id).unwrap();
        let gate_dir = self.dir.path().join("gates").join(container.gate_name());
        let limits = Limits {
            memory_bytes: gib << 30,
            thread_percentage: pct,
        };
        self.gates
            .open(
                GateTarget {
                    container,
                    gate_dir: gate_dir.clone(),
                    daemon: self.key.clone(),
                    daemon_pipe_dir: self.daemon.pipe.clone(),
                    limits,
                    cuda_processes: processes,
                    server_class: Some(limits.per_process(processes)),
                    running: Vec::new(),
                    init: None,
                    owner: id.into(),
                },
                None,
            )
            .unwrap();
        gate_dir
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_client_reaches_the_daemon_under_its_own_limits() {
    let n = node(4);
    let small = n.open("small", 4, 25, 1);
    let large = n.open("large", 8, 50, 1);
    for gate in [small.clone(), large, small] {
        assert!(blocking(move || cuda_client(&gate)).await);
    }
    let seen = n.daemon.seen.lock().unwrap().clone();
    let threads: Vec<&str> = seen.iter().map(|s| s.threads.as_str()).collect();
    assert_eq!(threads, ["25.0", "25.0", "50.0", "50.0", "25.0", "25.0"]);
    assert!(
        seen.iter().all(|s| s.pid == std::process::id() as i32),
        "the daemon sees the client's pid: {seen:?}"
    );
    assert_eq!(
        *n.daemon.connections.lock().unwrap(),
        6,
        "the probes never reach the daemon"
    );
    let view = n.gates.view(&ContainerId::parse("small").unwrap()).unwrap();
    assert_eq!(view.admitted_pids, vec![std::process::id()]);
    assert_eq!(view.refusals, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ui_session_or_anything_else_is_refused_after_its_request_and_never_reaches_the_daemon() {
    let n = node(4);
    let gate = n.open("c", 4, 25, 1);
    let g = gate.clone();
    let refused = blocking(move || {
        let mut closed = Vec::new();
        for (first, second) in [
            (wire::CREDENTIALS.to_vec(), 4u32.to_le_bytes().to_vec()),
            (wire::CREDENTIALS.to_vec(), 7u32.to_le_bytes().to_vec()),
            (b"get_server_list\n\0".to_vec(), Vec::new()),
        ] {
            let s = open(&g);
            send(&s, &first, None);
            if !second.is_empty() {
                send(&s, &second, None);
            }
            closed.push(recv(&s).is_none());
        }
        closed
    })
    .await;
    assert_eq!(
        refused,
        [true, true, true],
        "closed after the request, not answered"
    );
    assert_eq!(*n.daemon.connections.lock().unwrap(), 0);
    let view = n.gates.view(&ContainerId::parse("c").unwrap()).unwrap();
    assert_eq!(view.refusals, 3);
    assert!(
        view.last_refusal.contains("not a CUDA client"),
        "{}",
        view.last_refusal
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_connections_hold_only_their_own_containers_slots() {
    let n = node(4);
    let hostile = n.open("hostile", 4, 25, 1);
    let victim = n.open("victim", 8, 50, 1);
    // 64 connections that never send their request: 4 are taken in, 60 wait in the backlog.
    let h = hostile.clone();
    let stalled = blocking(move || {
        (0..64)
            .map(|_| {
                let s = seqpacket::connect(&h.join("control")).unwrap();
                s.set_nonblocking(false).unwrap();
                s
            })
            .collect::<Vec<_>>()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let view = n.gates.view(&ContainerId::parse("hostile").unwrap()).unwrap();
    assert_eq!(
        view.connections, 4,
        "connections beyond the bound stay in the backlog"
    );
    let started = Instant::now();
    let v = victim.clone();
    assert!(blocking(move || cuda_client(&v)).await);
    let took = started.elapsed();
    // Without the gate's own hello each stalled connection held the daemon for the handshake
    // timeout (5 s here): 64 of them, minutes.
    assert!(took < Duration::from_secs(3), "the victim took {took:?}");
    assert_eq!(*n.daemon.connections.lock().unwrap(), 2);
    drop(stalled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_acknowledges_holds_the_daemon_only_briefly() {
    let n = node(4);
    let slow = n.open("slow", 4, 25, 1);
    let other = n.open("other", 8, 50, 1);
    let s = slow.clone();
    let held = blocking(move || {
        let c = open(&s);
        send(&c, wire::CREDENTIALS, None);
        send(&c, &2u32.to_le_bytes(), None);
        let (answer, _, fds) = recv(&c).unwrap();
        assert_eq!((answer.as_slice(), fds), (wire::CHANNEL_ANSWER, 1));
        c // never acknowledged, kept open
    })
    .await;
    let started = Instant::now();
    let o = other.clone();
    assert!(blocking(move || cuda_client(&o)).await);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_gate_removes_its_dir_and_stops_answering() {
    let n = node(4);
    let gate = n.open("c", 4, 25, 1);
    let g = gate.clone();
    assert!(blocking(move || cuda_client(&g)).await);
    let id = ContainerId::parse("c").unwrap();
    assert!(n.gates.close(&id, &gate));
    assert!(!gate.exists());
    assert!(n.gates.view(&id).is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_daemon_is_reported_once_naming_the_last_channel_and_a_blocked_container_is_refused() {
    let n = node_with(
        4,
        GateTimings {
            handshake_timeout: Duration::from_millis(300),
            queue_timeout: Duration::from_secs(4),
        },
    );
    let bad = n.open("bad", 4, 25, 1);
    let victim = n.open("victim", 8, 50, 1);
    let b = bad.clone();
    assert!(blocking(move || cuda_client(&b)).await);
    n.daemon.mute.store(true, Ordering::SeqCst);
    // The victim's request times out again and again (four times in its 4 s), then it is
    // refused cleanly.
    let v = victim.clone();
    let got = blocking(move || request(&v, wire::KIND_CUDA_CLIENT, true)).await;
    assert_eq!(got, None, "refused after its queue timeout");
    let reports = n.gates.take_wedge_reports();
    assert_eq!(reports.len(), 1, "one report per stuck daemon: {reports:?}");
    let (suspect, pid) = reports[0].suspect.clone().expect("a suspect");
    assert_eq!(suspect.as_str(), "bad");
    assert_eq!(pid, std::process::id() as i32);

    let bad_id = ContainerId::parse("bad").unwrap();
    assert!(n.gates.block(&bad_id, "left its server stuck"));
    n.daemon.mute.store(false, Ordering::SeqCst);
    let before = *n.daemon.connections.lock().unwrap();
    let b = bad.clone();
    assert_eq!(
        blocking(move || request(&b, wire::KIND_CUDA_CLIENT, true)).await,
        None,
        "a blocked container is refused"
    );
    assert_eq!(
        *n.daemon.connections.lock().unwrap(),
        before,
        "never reaches the daemon"
    );
    let v = victim.clone();
    assert!(blocking(move || cuda_client(&v)).await, "the others go on");
    let view = n.gates.view(&bad_id).unwrap();
    assert!(
        view.last_refusal.contains("left its server stuck"),
        "{}",
        view.last_refusal
    );
}

/// Set in a child of this test binary: the role [`relay_child`] plays, against the gate at
/// [`RELAY_GATE_ENV`].
const RELAY_ROLE_ENV: &str = "GPU_MPS_TEST_RELAY_ROLE";
const RELAY_GATE_ENV: &str = "GPU_MPS_TEST_RELAY_GATE";

/// Runs [`relay_child`] in a child process of this test binary (a process of its own, so the
/// gate sees another pid; exec'd, so it holds none of this process's descriptors) with one end
/// of a socket pair as its stdin, and waits for it to exit. What it passed back on that
/// socket: a descriptor, or `None`.
fn run_relay_child(role: &str, gate: &Path) -> Option<UnixStream> {
    let (here, there) = UnixStream::pair().unwrap();
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "relay_child", "--nocapture", "--test-threads=1"])
        .env(RELAY_ROLE_ENV, role)
        .env(RELAY_GATE_ENV, gate.join("control"))
        .stdin(std::process::Stdio::from(std::os::fd::OwnedFd::from(there)))
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "the {role} child failed: {status}");
    here.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let got = recv_fd(&here).map(UnixStream::from);
    if let Some(s) = &got {
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    }
    got
}

/// A relay's part, in a child process (nothing without [`RELAY_ROLE_ENV`]): passes a
/// descriptor back on its stdin and exits.
/// - `connect`: connects to the gate and passes the connection on: the parent then asks on
///   it, as a process behind a relay does.
/// - `broker`: connects, asks for a channel and acknowledges it as a CUDA client does, passes
///   the channel on (nothing if it got none).
#[test]
fn relay_child() {
    let (Some(role), Some(gate)) = (std::env::var_os(RELAY_ROLE_ENV), std::env::var_os(RELAY_GATE_ENV))
    else {
        return;
    };
    let back = UnixStream::from(std::io::stdin().as_fd().try_clone_to_owned().unwrap());
    let s = seqpacket::connect(Path::new(&gate)).unwrap();
    s.set_nonblocking(false).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    match role.to_str().unwrap() {
        "connect" => send(&back, b"connection", Some(s.as_raw_fd())),
        "broker" => {
            recv(&s).expect("the gate's hello");
            send(&s, wire::CREDENTIALS, None);
            send(&s, &wire::KIND_CUDA_CLIENT.to_le_bytes(), None);
            if let Some(channel) = recv_fd(&s) {
                send(&s, wire::CLIENT_ACK, None);
                send(&back, b"channel", Some(channel.as_raw_fd()));
            }
        }
        other => panic!("unknown role {other}"),
    }
}

/// One message's first descriptor, owned (the rest, if any, closed).
fn recv_fd(stream: &UnixStream) -> Option<std::os::fd::OwnedFd> {
    let mut buf = vec![0u8; 4096];
    let received = fd_passing::receive(stream.as_fd(), &mut buf, MsgFlags::empty()).ok()?;
    received.fds.into_iter().next()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_passed_on_by_the_process_that_made_it_is_refused() {
    let n = node(4);
    let gate = n.open("relay", 4, 25, 1);
    let g = gate.clone();
    let answered = blocking(move || {
        let s = run_relay_child("connect", &g).expect("the child's connection");
        let (hello, _, _) = recv(&s).expect("the gate's hello");
        assert_eq!(hello, wire::HELLO);
        // This process asks on the child's connection (the kernel stamps its own pid).
        send(&s, wire::CREDENTIALS, None);
        send(&s, &wire::KIND_CUDA_CLIENT.to_le_bytes(), None);
        recv(&s).is_some()
    })
    .await;
    assert!(!answered, "a relayed request is refused, closed after it");
    assert_eq!(
        *n.daemon.connections.lock().unwrap(),
        0,
        "never reaches the daemon"
    );
    let view = n.gates.view(&ContainerId::parse("relay").unwrap()).unwrap();
    assert_eq!(view.refusals, 1);
    assert!(
        view.last_refusal.contains("passed to another process"),
        "{}",
        view.last_refusal
    );
    // The container's own process still gets its channels.
    let g = gate.clone();
    assert!(blocking(move || cuda_client(&g)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_a_broker_passed_on_holds_its_place_until_the_server_lets_it_go() {
    let n = node(4);
    n.lists.store(true, Ordering::SeqCst);
    let gate = n.open("relay", 4, 25, 1);
    let g = gate.clone();
    let first = blocking(move || run_relay_child("broker", &g)).await;
    let first = first.expect("the first broker gets the container's one channel");
    let g = gate.clone();
    let second = blocking(move || run_relay_child("broker", &g)).await;
    assert!(
        second.is_none(),
        "a second broker is refused while the server lists the first channel's client"
    );
    let view = n.gates.view(&ContainerId::parse("relay").unwrap()).unwrap();
    assert_eq!(view.admitted_pids.len(), 1, "the held channel counts: {view:?}");
    assert!(
        view.last_refusal.contains("1 of its 1 CUDA processes"),
        "{}",
        view.last_refusal
    );
    // The holder closes the channel: the server lets the client go, the place is free again.
    drop(first);
    let g = gate.clone();
    let third = blocking(move || run_relay_child("broker", &g)).await;
    assert!(third.is_some(), "the place came back once the channel was closed");
}
