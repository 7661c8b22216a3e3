//! Host users (non-root on the node) reach no gate and no MPS daemon (issue 21, item 4): the
//! gates' sockets are 0666 for containers of any uid and MPS makes a daemon's `control` 0666,
//! so the state root's directories (0700) are what refuses them. A process of uid 65534,
//! forked from this test, connects to a container's gate and to its daemon's sockets and gets
//! EACCES, also after a manager restart that adopts a tree an earlier version left 0755.
//! Needs root (it switches uid); skipped otherwise, with a line.

// Test helpers may unwrap: a panic that shows the value is the clearest failure here.
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use gpu_mps_api::inventory::{GpuInfo, Inventory};
use gpu_mps_api::node_config::{LimitPolicy, NodeConfig};
use gpu_mps_api::{ContainerId, DaemonKey, proto};
use gpu_mps_manager::core::ManagerCore;
use gpu_mps_manager::gate::seqpacket;
use gpu_mps_manager::gpu_backend::FileBackend;
use gpu_mps_manager::mps_control::{self, ControlError, MpsControl};
use nix::errno::Errno;
use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr};
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::{ForkResult, Gid, Uid, fork, setgid, setgroups, setuid};

const NOBODY: u32 = 65534;
const GPU: &str = "GPU-host-users-0";
const CONTAINER: &str = "host-users-c1";

/// A control daemon as MPS makes one: `control` 0666 and `control_privileged` 0755 in the pipe
/// dir (docs/gpu-runs/2026-12-03-probe.log), a live process behind the pid file. It answers
/// the commands the manager sends at start and adoption with what an idle daemon says.
#[derive(Default)]
struct MpsLikeControl {
    daemons: Mutex<Vec<(Child, Vec<std::os::unix::net::UnixListener>)>>,
}

#[async_trait]
impl MpsControl for MpsLikeControl {
    async fn start_daemon(&self, _: &DaemonKey, pipe: &Path, _log: &Path) -> Result<u32, ControlError> {
        let child = Command::new("sleep").arg("600").spawn().unwrap();
        let control = seqpacket::bind_gate_socket(pipe, mps_control::CONTROL_SOCKET).unwrap();
        let privileged = seqpacket::bind_gate_socket(pipe, "control_privileged").unwrap();
        std::fs::set_permissions(
            pipe.join("control_privileged"),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        std::fs::write(pipe.join(mps_control::PID_FILE), child.id().to_string()).unwrap();
        let pid = child.id();
        self.daemons
            .lock()
            .unwrap()
            .push((child, vec![control, privileged]));
        Ok(pid)
    }

    async fn command(&self, _: &Path, command: &str) -> Result<String, ControlError> {
        Ok(match command.split_whitespace().next() {
            Some("get_server_list") | Some("start_server") => String::new(),
            _ => format!("Unknown command \"{command}\""),
        })
    }
}

impl Drop for MpsLikeControl {
    fn drop(&mut self) {
        for (child, _) in self.daemons.lock().unwrap().iter_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// What a connect to the SOCK_SEQPACKET socket at `path` gives a process of `uid` (gid `uid`, no
/// supplementary groups): `None` when it connected. Forked so that only the child changes uid;
/// the child does nothing but syscalls and reports the errno as its exit status.
fn connect_as(uid: u32, path: &Path) -> Option<Errno> {
    let address = UnixAddr::new(path).unwrap();
    // SAFETY: the child only makes syscalls (no allocation, no lock) and ends with _exit.
    #[allow(unsafe_code)]
    match unsafe { fork() }.unwrap() {
        ForkResult::Child => {
            let errno = setgroups(&[])
                .and_then(|()| setgid(Gid::from_raw(uid)))
                .and_then(|()| setuid(Uid::from_raw(uid)))
                .and_then(|()| {
                    socket::socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::empty(), None)
                })
                .and_then(|fd| socket::connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &address));
            let code = match errno {
                Ok(()) => 0,
                Err(e) => e as i32,
            };
            // SAFETY: ends the forked child without running the parent's destructors.
            #[allow(unsafe_code)]
            unsafe {
                nix::libc::_exit(code)
            }
        }
        ForkResult::Parent { child } => match waitpid(child, None).unwrap() {
            WaitStatus::Exited(_, 0) => None,
            WaitStatus::Exited(_, code) => Some(Errno::from_raw(code)),
            other => panic!("the uid {uid} child ended as {other:?}"),
        },
    }
}

struct Node {
    _dir: tempfile::TempDir,
    config: NodeConfig,
    control: Arc<MpsLikeControl>,
    backend: Arc<FileBackend>,
}

fn node() -> Node {
    let dir = tempfile::tempdir().unwrap();
    // tempfile makes it 0700, which alone would keep uid 65534 out: the root's parents must let
    // host users through, as /run does, so that the root's own modes decide.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let inventory = Inventory {
        source: "test".into(),
        gpus: vec![GpuInfo {
            index: 0,
            minor: 0,
            uuid: GPU.into(),
            name: "Fake GPU (test double)".into(),
            memory_bytes: 16 << 30,
            compute_mode: "Default".into(),
            mig_enabled: false,
        }],
    };
    let inventory_path = dir.path().join("inventory-src.json");
    std::fs::write(&inventory_path, serde_json::to_string(&inventory).unwrap()).unwrap();
    let mut config = NodeConfig {
        root: dir.path().join("root"),
        ..NodeConfig::default()
    };
    config.limits.policy = LimitPolicy::Exact;
    Node {
        config,
        control: Arc::new(MpsLikeControl::default()),
        backend: Arc::new(FileBackend::new(&inventory_path)),
        _dir: dir,
    }
}

impl Node {
    async fn start(&self) -> ManagerCore {
        ManagerCore::start(self.config.clone(), self.control.clone(), self.backend.clone())
            .await
            .unwrap()
    }

    fn gate_socket(&self) -> PathBuf {
        self.config
            .gate_dir(&ContainerId::parse(CONTAINER).unwrap())
            .join(mps_control::CONTROL_SOCKET)
    }

    fn pipe_dir(&self) -> PathBuf {
        self.config.pipe_dir(&DaemonKey::new([GPU.to_string()]))
    }

    /// Every directory of the layout with the mode it must have.
    fn layout(&self) -> Vec<(PathBuf, u32)> {
        let root = &self.config.root;
        let key = DaemonKey::new([GPU.to_string()]);
        vec![
            (root.clone(), 0o700),
            (root.join("daemons"), 0o700),
            (self.config.daemon_dir(&key), 0o700),
            (self.pipe_dir(), 0o700),
            (self.config.log_dir(&key), 0o700),
            (root.join("gates"), 0o700),
            (self.gate_socket().parent().unwrap().to_path_buf(), 0o755),
            (self.config.lease_files_dir(), 0o700),
        ]
    }

    /// The host user is refused at the gate and at each of the daemon's sockets; root is not
    /// (the sockets exist and listen).
    fn assert_host_user_refused(&self, when: &str) {
        for socket in [
            self.gate_socket(),
            self.pipe_dir().join(mps_control::CONTROL_SOCKET),
            self.pipe_dir().join("control_privileged"),
        ] {
            assert_eq!(
                connect_as(0, &socket),
                None,
                "{when}: root at {}",
                socket.display()
            );
            assert_eq!(
                connect_as(NOBODY, &socket),
                Some(Errno::EACCES),
                "{when}: uid {NOBODY} at {}",
                socket.display()
            );
        }
    }

    fn assert_layout(&self, when: &str) {
        for (dir, wanted) in self.layout() {
            let meta = std::fs::symlink_metadata(&dir).unwrap();
            assert_eq!(
                (meta.mode() & 0o7777, meta.uid()),
                (wanted, 0),
                "{when}: {}",
                dir.display()
            );
        }
    }
}

fn request() -> proto::AcquireRequest {
    let mut r = proto::AcquireRequest::new();
    r.container_id = CONTAINER.into();
    r.gpu_uuids = vec![GPU.into()];
    r.memory_limit_bytes = 4 << 30;
    r.active_thread_percentage = 25;
    r.namespace = "default".into();
    r.pid = std::process::id();
    r
}

fn skipped_without_root() -> bool {
    if !nix::unistd::geteuid().is_root() {
        println!("skipped: switching to uid {NOBODY} needs root");
        return true;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_user_reaches_no_gate_and_no_daemon_also_after_a_restart() {
    if skipped_without_root() {
        return;
    }
    let n = node();
    let m = n.start().await;
    m.acquire(request()).await.unwrap();
    n.assert_host_user_refused("after the first lease");
    n.assert_layout("after the first lease");
    drop(m);

    // What a8a6adc left on a node: every directory 0755. The next manager adopts the daemon
    // and the lease, and narrows the tree before it serves the gate again.
    for (dir, _) in n.layout() {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let m = n.start().await;
    n.assert_host_user_refused("after a restart on a 0755 tree");
    n.assert_layout("after a restart on a 0755 tree");
    let status = m.status().await;
    assert_eq!(status.leases.len(), 1, "the lease was adopted: {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_another_uid_owns_or_others_can_write_is_refused_at_start() {
    if skipped_without_root() {
        return;
    }
    let n = node();
    std::fs::create_dir(&n.config.root).unwrap();
    std::fs::set_permissions(&n.config.root, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(&n.config.root, Some(NOBODY), Some(NOBODY)).unwrap();
    let e = ManagerCore::start(n.config.clone(), n.control.clone(), n.backend.clone())
        .await
        .err()
        .expect("a root of uid 65534 was accepted")
        .to_string();
    assert!(e.contains("belongs to uid 65534, not to uid 0"), "{e}");
    assert!(!n.config.root.join("daemons").exists(), "nothing was made in it");

    std::os::unix::fs::chown(&n.config.root, Some(0), Some(0)).unwrap();
    std::fs::set_permissions(&n.config.root, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let e = ManagerCore::start(n.config.clone(), n.control.clone(), n.backend.clone())
        .await
        .err()
        .expect("a world-writable root was accepted")
        .to_string();
    assert!(e.contains("writable by group or others (mode 1777)"), "{e}");
}
