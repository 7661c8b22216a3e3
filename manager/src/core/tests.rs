//! ManagerCore against an in-memory MPS control double whose "daemons" are real `sleep`
//! processes (so pid liveness checks are real) and whose answers follow the measured formats.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use gpu_mps_api::inventory::{GpuInfo, Inventory};
use gpu_mps_api::node_config::{LimitPolicy, NodeConfig, Tenancy};

use super::*;
use crate::gate;
use crate::gpu_backend::FileBackend;
use crate::gpu_backend::GpuBackend;
use crate::mps_control;
use crate::process_identity::ProcessIdentity;
use gpu_mps_api::{Limits, proto};

const GIB: u64 = 1 << 30;

/// A fake server: thread percentage, memory limit per device, client pids.
type FakeServer = (String, BTreeMap<String, String>, Vec<u32>);

#[derive(Default)]
struct FakeDaemon {
    child: Option<Child>,
    default_threads: String,
    default_mem: BTreeMap<String, String>,
    servers: BTreeMap<u32, FakeServer>,
}

/// In-memory stand-in for nvidia-cuda-mps-control.
#[derive(Default)]
struct FakeControl {
    daemons: Mutex<BTreeMap<PathBuf, FakeDaemon>>,
    log: Mutex<Vec<String>>,
    starts: Mutex<u32>,
    /// Pipe dirs whose daemon runs but answers nothing (its server stuck): every command
    /// times out, until a new daemon starts there.
    silent: Mutex<Vec<PathBuf>>,
    /// Pipe dirs whose daemon start and commands hang until `unstall` (a daemon stuck in
    /// start, a CLI call that waits out its timeout).
    stalled: Mutex<BTreeMap<PathBuf, Arc<tokio::sync::Semaphore>>>,
    /// Pipe dirs where a daemon fails to start.
    refuse_starts: Mutex<Vec<PathBuf>>,
}

impl FakeControl {
    fn add_server(&self, pipe: &Path, server: u32, clients: Vec<u32>) {
        let mut daemons = self.daemons.lock().unwrap();
        let d = daemons.get_mut(pipe).expect("daemon");
        let limits = (d.default_threads.clone(), d.default_mem.clone(), clients);
        d.servers.insert(server, limits);
    }

    fn stall(&self, pipe: &Path) {
        self.stalled
            .lock()
            .unwrap()
            .insert(pipe.into(), Arc::new(tokio::sync::Semaphore::new(0)));
    }

    fn unstall(&self, pipe: &Path) {
        if let Some(s) = self.stalled.lock().unwrap().remove(pipe) {
            s.close();
        }
    }

    async fn wait_if_stalled(&self, pipe: &Path) {
        let stall = self.stalled.lock().unwrap().get(pipe).cloned();
        if let Some(stall) = stall {
            // Closed by `unstall`: every waiter goes on.
            let _ = stall.acquire().await;
        }
    }

    fn commands(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    fn kill_all(&self) {
        for d in self.daemons.lock().unwrap().values_mut() {
            if let Some(mut c) = d.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

impl Drop for FakeControl {
    fn drop(&mut self) {
        self.kill_all();
    }
}

#[async_trait]
impl MpsControl for FakeControl {
    async fn start_daemon(
        &self,
        _key: &DaemonKey,
        pipe_dir: &Path,
        _log: &Path,
    ) -> Result<u32, ControlError> {
        self.wait_if_stalled(pipe_dir).await;
        if self.refuse_starts.lock().unwrap().iter().any(|p| p == pipe_dir) {
            return Err(ControlError::StartFailed {
                key: pipe_dir.display().to_string(),
                reason: "refused by the test".into(),
            });
        }
        // Like the real daemon, it runs with its pipe dir in its environment.
        let child = Command::new("sleep")
            .arg("600")
            .env("CUDA_MPS_PIPE_DIRECTORY", pipe_dir)
            .spawn()
            .expect("spawn sleep");
        let pid = child.id();
        self.silent.lock().unwrap().retain(|p| p != pipe_dir);
        std::fs::write(pipe_dir.join(mps_control::PID_FILE), pid.to_string()).unwrap();
        *self.starts.lock().unwrap() += 1;
        self.daemons.lock().unwrap().insert(
            pipe_dir.into(),
            FakeDaemon {
                child: Some(child),
                default_threads: "100.0".into(),
                ..Default::default()
            },
        );
        Ok(pid)
    }

    async fn command(&self, pipe_dir: &Path, command: &str) -> Result<String, ControlError> {
        self.wait_if_stalled(pipe_dir).await;
        self.log.lock().unwrap().push(command.to_string());
        if self.silent.lock().unwrap().iter().any(|p| p == pipe_dir) {
            return Err(ControlError::Timeout {
                binary: "nvidia-cuda-mps-control".into(),
                command: command.into(),
                seconds: 4,
            });
        }
        let mut daemons = self.daemons.lock().unwrap();
        let Some(d) = daemons.get_mut(pipe_dir).filter(|d| d.child.is_some()) else {
            return Err(ControlError::NoDaemon {
                pipe_dir: pipe_dir.display().to_string(),
                output: "Cannot find MPS control daemon process".into(),
            });
        };
        let w: Vec<&str> = command.split_whitespace().collect();
        let mem_out = |v: &str| -> String {
            // As the real CLI prints it back (measured): whole GiB, rounded down, from 1 GiB up.
            let mib: u64 = v.trim_end_matches('M').parse().unwrap();
            if mib >= 1024 {
                format!("{}G", mib / 1024)
            } else {
                format!("{mib}M")
            }
        };
        let answer = match w.as_slice() {
            ["get_server_list"] => d
                .servers
                .keys()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join("\n"),
            ["get_client_list", s] => match d.servers.get(&s.parse().unwrap()) {
                Some((_, _, c)) => c.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("\n"),
                None => format!("Server {s} not found"),
            },
            ["set_default_active_thread_percentage", p] => {
                d.default_threads = format!("{}.0", p);
                d.default_threads.clone()
            }
            ["get_default_active_thread_percentage"] => d.default_threads.clone(),
            ["set_default_device_pinned_mem_limit", dev, v] => {
                d.default_mem.insert(dev.to_string(), mem_out(v));
                String::new()
            }
            ["get_default_device_pinned_mem_limit", dev] => {
                d.default_mem.get(*dev).cloned().unwrap_or("0".into())
            }
            ["set_active_thread_percentage", s, p] => match d.servers.get_mut(&s.parse().unwrap()) {
                Some(srv) => {
                    srv.0 = format!("{p}.0");
                    srv.0.clone()
                }
                None => format!("Server {s} not found"),
            },
            ["get_active_thread_percentage", s] => match d.servers.get(&s.parse().unwrap()) {
                Some(srv) => srv.0.clone(),
                None => format!("Server {s} not found"),
            },
            ["set_device_pinned_mem_limit", s, dev, v] => match d.servers.get_mut(&s.parse().unwrap()) {
                Some(srv) => {
                    srv.1.insert(dev.to_string(), mem_out(v));
                    String::new()
                }
                None => format!("Server {s} not found"),
            },
            ["get_device_pinned_mem_limit", s, dev] => match d.servers.get(&s.parse().unwrap()) {
                Some(srv) => srv.1.get(*dev).cloned().unwrap_or("0".into()),
                None => format!("Server {s} not found"),
            },
            ["start_server", "-uid", _] => {
                // A server pid of its own that no real process has (the fake never signals it).
                let pid = 4_000_000 + d.servers.len() as u32;
                let limits = (d.default_threads.clone(), d.default_mem.clone(), Vec::new());
                d.servers.insert(pid, limits);
                String::new()
            }
            ["quit"] => {
                if let Some(mut c) = d.child.take() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                String::new()
            }
            _ => format!("Unknown command \"{command}\""),
        };
        Ok(answer)
    }
}

struct Env {
    _dir: tempfile::TempDir,
    config: NodeConfig,
    control: Arc<FakeControl>,
    backend: Arc<FileBackend>,
}

fn env(policy: LimitPolicy, tenancy: Tenancy) -> Env {
    let dir = tempfile::tempdir().unwrap();
    let inventory = Inventory {
        source: "test".into(),
        gpus: (0..2)
            .map(|i| GpuInfo {
                index: i,
                minor: i,
                uuid: format!("GPU-{i}"),
                name: "Fake GPU (test double)".into(),
                memory_bytes: 16 * GIB,
                compute_mode: "Default".into(),
                mig_enabled: false,
            })
            .collect(),
    };
    let inv_path = dir.path().join("inventory-src.json");
    std::fs::write(&inv_path, serde_json::to_string(&inventory).unwrap()).unwrap();
    let mut config = NodeConfig {
        root: dir.path().join("root"),
        ..NodeConfig::default()
    };
    config.limits.policy = policy;
    config.limits.tenancy = tenancy;
    config.limits.ceiling = Some(Limits {
        memory_bytes: 8 * GIB,
        thread_percentage: 50,
    });
    config.daemon.exclusive_process = false;
    config.daemon.idle_grace_seconds = 10;
    Env {
        config,
        control: Arc::new(FakeControl::default()),
        backend: Arc::new(FileBackend::new(&inv_path)),
        _dir: dir,
    }
}

async fn core(e: &Env) -> ManagerCore {
    ManagerCore::start(e.config.clone(), e.control.clone(), e.backend.clone())
        .await
        .unwrap()
}

fn request(id: &str, gpu: &str, gib: u64, pct: u32, ns: &str) -> proto::AcquireRequest {
    let mut r = proto::AcquireRequest::new();
    r.container_id = id.into();
    r.gpu_uuids = vec![gpu.into()];
    r.memory_limit_bytes = gib * GIB;
    r.active_thread_percentage = pct;
    r.namespace = ns.into();
    // A live process: a lease follows its container's process.
    r.pid = std::process::id();
    r
}

/// A stand-in for a container's init process (a `sleep`): a lease names its pid, and reconcile
/// drops the lease once it is gone. Killed on drop.
struct FakeContainer(Child);

impl FakeContainer {
    fn start() -> Self {
        FakeContainer(Command::new("sleep").arg("600").spawn().unwrap())
    }

    /// `request(...)`, made by this container's process.
    fn request(&self, id: &str, gpu: &str, gib: u64, pct: u32, ns: &str) -> proto::AcquireRequest {
        let mut r = request(id, gpu, gib, pct, ns);
        r.pid = self.0.id();
        r
    }

    /// Its process exits (and is reaped).
    fn stop(&mut self) {
        self.0.kill().unwrap();
        self.0.wait().unwrap();
    }
}

impl Drop for FakeContainer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn first_lease_starts_the_daemon_and_sets_limits_by_ordinal() {
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let m = core(&e).await;
    let resp = m.acquire(request("c1", "GPU-0", 4, 25, "ns")).await.unwrap();
    let daemon = resp.daemon.as_ref().unwrap();
    assert_eq!(daemon.key, "GPU-0");
    assert_eq!(daemon.memory_limit_bytes, 4 * GIB);
    assert_eq!(daemon.active_thread_percentage, 25);
    let cmds = e.control.commands();
    assert!(
        cmds.contains(&"set_default_active_thread_percentage 25".to_string()),
        "{cmds:?}"
    );
    assert!(
        cmds.contains(&"set_default_device_pinned_mem_limit 0 4096M".to_string()),
        "{cmds:?}"
    );
    assert!(
        cmds.contains(&"get_default_device_pinned_mem_limit 0".to_string()),
        "read back: {cmds:?}"
    );
    // The inventory is published for the shim.
    let inv = std::fs::read_to_string(e.config.inventory_path()).unwrap();
    assert!(inv.contains("GPU-1"));

    // The same GPU and class: the same daemon, no second start.
    m.acquire(request("c2", "GPU-0", 4, 25, "ns")).await.unwrap();
    assert_eq!(*e.control.starts.lock().unwrap(), 1);
    let status = m.status().await;
    assert_eq!(status.daemons.len(), 1);
    assert_eq!(status.daemons[0].leases, 2);
    assert_eq!(status.gpus[0].memory_reserved_bytes, 8 * GIB);
}

#[tokio::test]
async fn acquire_is_idempotent_per_container() {
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let m = core(&e).await;
    m.acquire(request("c1", "GPU-0", 4, 25, "ns")).await.unwrap();
    m.acquire(request("c1", "GPU-0", 4, 25, "ns")).await.unwrap();
    assert_eq!(m.status().await.leases.len(), 1);
    let err = m.acquire(request("c1", "GPU-0", 8, 25, "ns")).await.unwrap_err();
    assert_eq!(err.code(), ttrpc::Code::INVALID_ARGUMENT);
}

#[tokio::test]
async fn a_below_normal_container_keeps_its_priority_in_the_lease_and_status() {
    let e = env(LimitPolicy::Exact, Tenancy::Shared);
    let m = core(&e).await;
    let mut below = request("c1", "GPU-0", 4, 25, "ns");
    below.client_priority = 1;
    let lease = m.acquire(below.clone()).await.unwrap().lease.unwrap();
    assert_eq!(lease.client_priority, 1);
    assert_eq!(m.status().await.leases[0].client_priority, 1);
    // A retried hook must ask for the same lease: the same container at normal is refused.
    m.acquire(below).await.unwrap();
    let err = m.acquire(request("c1", "GPU-0", 4, 25, "ns")).await.unwrap_err();
    assert_eq!(err.code(), ttrpc::Code::INVALID_ARGUMENT);
    let mut unknown = request("c2", "GPU-0", 4, 25, "ns");
    unknown.client_priority = 2;
    let err = m.acquire(unknown).await.unwrap_err();
    assert!(
        err.to_string().contains("client_priority 2 is out of range"),
        "{err}"
    );
    assert_eq!(m.status().await.leases.len(), 1);
}

#[tokio::test]
async fn uniform_refuses_another_class_until_the_gpu_is_free_then_resets_limits() {
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let m = core(&e).await;
    m.acquire(request("small", "GPU-0", 4, 25, "ns")).await.unwrap();
    let pipe = e.config.pipe_dir(&DaemonKey::new(["GPU-0"]));
    e.control.add_server(&pipe, 4242, vec![]);
    let err = m.acquire(request("big", "GPU-0", 8, 50, "ns")).await.unwrap_err();
    assert_eq!(err.code(), ttrpc::Code::FAILED_PRECONDITION);
    assert!(err.to_string().contains("4Gi/25%"), "{err}");
    assert!(m.release("small").await.unwrap());
    m.acquire(request("big", "GPU-0", 8, 50, "ns")).await.unwrap();
    // The idle server that kept running gets the new class too, not only the defaults.
    let cmds = e.control.commands();
    assert!(
        cmds.contains(&"set_active_thread_percentage 4242 50".to_string()),
        "{cmds:?}"
    );
    assert!(
        cmds.contains(&"set_device_pinned_mem_limit 4242 0 8192M".to_string()),
        "{cmds:?}"
    );
}

#[tokio::test]
async fn ceiling_sets_the_ceiling_on_the_server_once() {
    let e = env(LimitPolicy::Ceiling, Tenancy::Shared);
    let m = core(&e).await;
    let a = m.acquire(request("a", "GPU-0", 4, 25, "ns")).await.unwrap();
    let b = m.acquire(request("b", "GPU-0", 8, 50, "ns")).await.unwrap();
    assert_eq!(a.daemon.as_ref().unwrap().active_thread_percentage, 50);
    assert_eq!(b.lease.as_ref().unwrap().memory_limit_bytes, 8 * GIB);
    let sets = e
        .control
        .commands()
        .iter()
        .filter(|c| c.starts_with("set_default_active"))
        .count();
    assert_eq!(sets, 1);
    let err = m.acquire(request("c", "GPU-0", 16, 50, "ns")).await.unwrap_err();
    assert_eq!(err.code(), ttrpc::Code::INVALID_ARGUMENT);
}

#[tokio::test]
async fn exclusive_tenancy_and_capacity_refusals() {
    let e = env(LimitPolicy::Ceiling, Tenancy::Exclusive);
    let m = core(&e).await;
    m.acquire(request("a", "GPU-0", 8, 50, "team-a")).await.unwrap();
    let err = m
        .acquire(request("b", "GPU-0", 4, 25, "team-b"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("exclusive"), "{err}");
    m.acquire(request("b", "GPU-0", 8, 50, "team-a")).await.unwrap();
    let err = m
        .acquire(request("c", "GPU-0", 1, 50, "team-a"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), ttrpc::Code::RESOURCE_EXHAUSTED);
    assert!(err.to_string().contains("16Gi of 16Gi"), "{err}");
}

#[tokio::test]
async fn idle_daemon_stops_after_the_grace_period_only() {
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let m = core(&e).await;
    m.acquire(request("c1", "GPU-0", 4, 25, "ns")).await.unwrap();
    let pid = m.status().await.daemons[0].control_pid;
    m.release("c1").await.unwrap();
    assert!(!m.release("c1").await.unwrap(), "a second release is a no-op");
    let idle_since = m.status().await.daemons[0].idle_since_unix;
    m.reconcile(idle_since + 5).await;
    assert_eq!(m.status().await.daemons.len(), 1, "still inside the grace period");
    m.reconcile(idle_since + 11).await;
    assert!(m.status().await.daemons.is_empty());
    assert!(!crate::process_identity::is_running(pid));
}

#[tokio::test]
async fn an_idle_daemon_with_unknown_clients_is_not_stopped() {
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let m = core(&e).await;
    m.acquire(request("c1", "GPU-0", 4, 25, "ns")).await.unwrap();
    e.control
        .add_server(&e.config.pipe_dir(&DaemonKey::new(["GPU-0"])), 777, vec![778]);
    m.release("c1").await.unwrap();
    m.reconcile(now_unix() + 1000).await;
    assert_eq!(m.status().await.daemons.len(), 1);
}

#[tokio::test]
async fn leases_of_dead_containers_are_dropped() {
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let m = core(&e).await;
    let mut container = FakeContainer::start();
    m.acquire(container.request("c1", "GPU-0", 4, 25, "ns"))
        .await
        .unwrap();
    m.reconcile(now_unix()).await;
    assert_eq!(m.status().await.leases.len(), 1);
    container.stop();
    // The poststop hook's release may still be on its way: the lease stays for a grace period.
    let gone = now_unix();
    m.reconcile(gone).await;
    m.reconcile(gone + LEASE_RELEASE_GRACE_S - 1).await;
    assert_eq!(m.status().await.leases.len(), 1);
    m.reconcile(gone + LEASE_RELEASE_GRACE_S).await;
    assert!(m.status().await.leases.is_empty());
    assert_eq!(m.status().await.daemons[0].state, "idle");
}

#[tokio::test]
async fn a_restarted_manager_adopts_daemons_and_leases_without_restarting_them() {
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let m = core(&e).await;
    let container = FakeContainer::start();
    m.acquire(container.request("c1", "GPU-0", 4, 25, "ns"))
        .await
        .unwrap();
    let pid = m.status().await.daemons[0].control_pid;
    drop(m); // the manager dies without shutdown

    let m2 = core(&e).await;
    let s = m2.status().await;
    assert_eq!(s.daemons.len(), 1);
    assert_eq!(s.daemons[0].control_pid, pid);
    assert_eq!(s.leases.len(), 1);
    assert_eq!(*e.control.starts.lock().unwrap(), 1, "no second daemon");
    // Same class still admitted; another class still refused. The new manager cannot know what
    // the server holds (another run's gates may have changed it): it sets the limits once more,
    // then trusts its own setting.
    m2.acquire(request("c2", "GPU-0", 4, 25, "ns")).await.unwrap();
    let before = e.control.commands().len();
    m2.acquire(request("c4", "GPU-0", 4, 25, "ns")).await.unwrap();
    assert!(
        !e.control.commands()[before..]
            .iter()
            .any(|c| c.starts_with("set_"))
    );
    assert!(m2.acquire(request("c3", "GPU-0", 8, 25, "ns")).await.is_err());
}

/// Seen on the H200 (20 manager restarts under load): a daemon that runs but answers nothing
/// was dropped as "gone" by the next manager, which then never replaced it; the running pods'
/// new CUDA processes were refused for the rest of the run, and its server ran on for good.
#[tokio::test]
async fn a_restarted_manager_replaces_a_daemon_that_runs_but_does_not_answer() {
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let m = core(&e).await;
    let container = FakeContainer::start();
    m.acquire(container.request("c1", "GPU-0", 4, 25, "ns"))
        .await
        .unwrap();
    let old = m.status().await.daemons[0].control_pid;
    drop(m);
    e.control
        .silent
        .lock()
        .unwrap()
        .push(e.config.pipe_dir(&DaemonKey::new(["GPU-0"])));

    let m2 = core(&e).await;
    let s = m2.status().await;
    assert_eq!(s.daemons.len(), 1, "kept, not dropped as gone: {s:#?}");
    assert_eq!(s.leases.len(), 1);
    // The first tick kills it; a later one starts a new daemon with the lease's limits.
    m2.reconcile(now_unix()).await;
    for _ in 0..50 {
        if !crate::process_identity::is_running(old) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    m2.reconcile(now_unix()).await;
    let s = m2.status().await;
    assert_eq!(*e.control.starts.lock().unwrap(), 2, "a new daemon: {s:#?}");
    assert_ne!(s.daemons[0].control_pid, old);
    assert_eq!(s.daemons[0].faults, 1, "counted as a stuck server");
    assert_eq!(s.daemons[0].active_thread_percentage, 25);
    assert_eq!(s.leases.len(), 1);
}

#[tokio::test]
async fn a_restarted_manager_starts_again_a_daemon_that_died_under_running_containers() {
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let m = core(&e).await;
    let container = FakeContainer::start();
    m.acquire(container.request("c1", "GPU-0", 4, 25, "ns"))
        .await
        .unwrap();
    drop(m);
    e.control.kill_all();

    let m2 = core(&e).await;
    assert_eq!(m2.status().await.leases.len(), 1);
    m2.reconcile(now_unix()).await;
    let s = m2.status().await;
    assert_eq!(*e.control.starts.lock().unwrap(), 2, "started again: {s:#?}");
    assert_eq!(s.daemons.len(), 1);
    assert_eq!(s.daemons[0].active_thread_percentage, 25);
}

#[tokio::test]
async fn a_restarted_manager_drops_what_died_meanwhile() {
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let m = core(&e).await;
    let mut container = FakeContainer::start();
    m.acquire(container.request("c1", "GPU-0", 4, 25, "ns"))
        .await
        .unwrap();
    drop(m);
    container.stop();
    e.control.kill_all();
    let m2 = core(&e).await;
    let s = m2.status().await;
    assert!(s.leases.is_empty() && s.daemons.is_empty());
    m2.acquire(request("c2", "GPU-0", 8, 50, "ns")).await.unwrap();
    assert_eq!(*e.control.starts.lock().unwrap(), 2);
}

#[tokio::test]
async fn shutdown_keeps_busy_daemons_and_stops_idle_ones() {
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let m = core(&e).await;
    m.acquire(request("busy", "GPU-0", 4, 25, "ns")).await.unwrap();
    m.acquire(request("gone", "GPU-1", 4, 25, "ns")).await.unwrap();
    m.release("gone").await.unwrap();
    m.shutdown().await;
    let m2 = core(&e).await;
    let s = m2.status().await;
    assert_eq!(
        s.daemons.iter().map(|d| d.key.as_str()).collect::<Vec<_>>(),
        ["GPU-0"]
    );
}

#[tokio::test]
async fn exclusive_process_is_set_at_start_and_restored_at_an_empty_shutdown() {
    let mut e = env(LimitPolicy::Uniform, Tenancy::Shared);
    e.config.daemon.exclusive_process = true;
    let m = core(&e).await;
    assert_eq!(e.backend.compute_mode("GPU-0").unwrap(), "ExclusiveProcess");
    m.acquire(request("c1", "GPU-0", 4, 25, "ns")).await.unwrap();
    m.shutdown().await;
    assert_eq!(
        e.backend.compute_mode("GPU-0").unwrap(),
        "ExclusiveProcess",
        "a lease remains"
    );
    let m2 = core(&e).await;
    m2.release("c1").await.unwrap();
    m2.shutdown().await;
    assert_eq!(e.backend.compute_mode("GPU-0").unwrap(), "Default");
    assert_eq!(e.backend.compute_mode("GPU-1").unwrap(), "Default");
}

#[tokio::test]
async fn a_daemon_that_rejects_a_limit_fails_the_lease() {
    struct Stubborn(FakeControl);
    #[async_trait]
    impl MpsControl for Stubborn {
        async fn start_daemon(&self, k: &DaemonKey, p: &Path, l: &Path) -> Result<u32, ControlError> {
            self.0.start_daemon(k, p, l).await
        }
        async fn command(&self, p: &Path, c: &str) -> Result<String, ControlError> {
            // Measured: a rejected value exits 0 and echoes the value still in force.
            if c.starts_with("set_default_active_thread_percentage") {
                return Ok("100.0".into());
            }
            self.0.command(p, c).await
        }
    }
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let m = ManagerCore::start(
        e.config.clone(),
        Arc::new(Stubborn(FakeControl::default())),
        e.backend.clone(),
    )
    .await
    .unwrap();
    let err = m.acquire(request("c1", "GPU-0", 4, 25, "ns")).await.unwrap_err();
    assert_eq!(err.code(), ttrpc::Code::UNAVAILABLE);
    assert!(err.to_string().contains("reads back"), "{err}");
    assert!(m.status().await.leases.is_empty());
}

#[tokio::test]
async fn invalid_requests_are_refused() {
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let m = core(&e).await;
    let mut r = request("c1", "GPU-0", 4, 0, "ns");
    assert_eq!(
        m.acquire(r.clone()).await.unwrap_err().code(),
        ttrpc::Code::INVALID_ARGUMENT
    );
    r.active_thread_percentage = 25;
    r.gpu_uuids.clear();
    assert_eq!(
        m.acquire(r).await.unwrap_err().code(),
        ttrpc::Code::INVALID_ARGUMENT
    );
    let err = m.acquire(request("c1", "GPU-7", 4, 25, "ns")).await.unwrap_err();
    assert!(err.to_string().contains("GPU-7"), "{err}");
}

#[tokio::test]
async fn a_daemon_that_dies_under_leases_is_restarted_with_their_limits() {
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let m = core(&e).await;
    let container = FakeContainer::start();
    let mut r = container.request("c1", "GPU-0", 4, 25, "ns");
    // Two processes: each gets half the container's memory, also from the restarted daemon.
    r.cuda_processes = 2;
    m.acquire(r).await.unwrap();
    let first = m.status().await.daemons[0].control_pid;
    e.control.kill_all();
    m.reconcile(now_unix()).await;
    let s = m.status().await;
    assert_eq!(s.daemons.len(), 1, "restarted");
    assert_ne!(s.daemons[0].control_pid, first);
    assert_eq!(s.daemons[0].state, "running", "its lease still holds it");
    assert_eq!(s.daemons[0].active_thread_percentage, 25);
    assert_eq!(
        s.daemons[0].memory_limit_bytes,
        2 * GIB,
        "the per-process share, not the container's"
    );
    assert_eq!(*e.control.starts.lock().unwrap(), 2);
}

#[tokio::test]
async fn an_idle_daemon_that_cannot_stop_is_retried_after_a_grace_period_not_every_tick() {
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let m = core(&e).await;
    m.acquire(request("c1", "GPU-0", 4, 25, "ns")).await.unwrap();
    e.control
        .add_server(&e.config.pipe_dir(&DaemonKey::new(["GPU-0"])), 777, vec![778]);
    m.release("c1").await.unwrap();
    let later = now_unix() + 100;
    m.reconcile(later).await;
    let asked = e
        .control
        .commands()
        .iter()
        .filter(|c| *c == "get_server_list")
        .count();
    assert_eq!(m.status().await.daemons[0].idle_since_unix, later);
    m.reconcile(later + 1).await;
    let asked_again = e
        .control
        .commands()
        .iter()
        .filter(|c| *c == "get_server_list")
        .count();
    // status() asks once per daemon; reconcile must not have asked again within the grace period.
    assert_eq!(
        asked_again,
        asked + 1,
        "reconcile asked MPS again inside the grace period"
    );
}

#[tokio::test]
async fn a_lease_for_a_container_whose_process_is_gone_is_refused() {
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let m = core(&e).await;
    let mut gone = Command::new("true").spawn().unwrap();
    let pid = gone.id();
    gone.wait().unwrap();
    let mut r = request("c1", "GPU-0", 4, 25, "ns");
    r.pid = pid;
    let err = m.acquire(r).await.unwrap_err();
    assert_eq!(err.code(), ttrpc::Code::INVALID_ARGUMENT);
    assert!(err.to_string().contains("no running process"), "{err}");
    assert!(m.status().await.leases.is_empty());
}

#[tokio::test]
async fn modes_switched_before_a_failure_are_saved_for_restoring() {
    /// Refuses to change GPU-1, like a GPU that does not support the mode.
    struct RefusesGpu1(Arc<FileBackend>);
    impl GpuBackend for RefusesGpu1 {
        fn inventory(&self) -> Result<Inventory, GpuBackendError> {
            self.0.inventory()
        }
        fn compute_mode(&self, uuid: &str) -> Result<String, GpuBackendError> {
            self.0.compute_mode(uuid)
        }
        fn set_compute_mode(&self, uuid: &str, mode: &str) -> Result<(), GpuBackendError> {
            if uuid == "GPU-1" {
                return Err(GpuBackendError::UnknownGpu(uuid.into()));
            }
            self.0.set_compute_mode(uuid, mode)
        }
    }
    let mut e = env(LimitPolicy::Uniform, Tenancy::Shared);
    e.config.daemon.exclusive_process = true;
    let backend = Arc::new(RefusesGpu1(e.backend.clone()));
    let started = ManagerCore::start(e.config.clone(), e.control.clone(), backend).await;
    assert!(started.is_err());
    let state = State::load(&e.config.state_path()).unwrap();
    assert_eq!(
        state.saved_compute_modes.get("GPU-0").map(String::as_str),
        Some("Default")
    );
}

#[tokio::test]
async fn a_fatal_fault_in_server_log_is_counted_and_reported() {
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let m = core(&e).await;
    m.acquire(request("c1", "GPU-0", 4, 25, "ns")).await.unwrap();
    let log = e.config.log_dir(&DaemonKey::new(["GPU-0"])).join("server.log");
    std::fs::write(
        &log,
        "[2026-12-03 09:37:50.889 Server 15871] Client {PID: 1, Context ID: 0} connected\n",
    )
    .unwrap();
    m.reconcile(now_unix()).await;
    assert_eq!(m.status().await.daemons[0].faults, 0);
    // Measured on the H200: what MPS writes when one client's fault tears down all of them.
    // One fault among several clients: MPS writes one such line per client it tears down.
    let fault = "[2026-12-03 09:37:50.889 Server 15871] All clients belonging to error trigging process 16886 will be torn down\n\
                 [2026-12-03 09:37:50.889 Server 15871] All clients belonging to error trigging process 16873 will be torn down\n";
    let mut text = std::fs::read_to_string(&log).unwrap();
    text.push_str(fault);
    std::fs::write(&log, text).unwrap();
    m.reconcile(now_unix()).await;
    let d = &m.status().await.daemons[0];
    assert_eq!(d.faults, 1);
    assert!(d.last_fault_unix > 0);
    m.reconcile(now_unix()).await;
    assert_eq!(m.status().await.daemons[0].faults, 1, "a fault is counted once");
}

#[tokio::test]
async fn exact_serves_a_gate_per_container_and_leaves_the_limits_to_it() {
    let e = env(LimitPolicy::Exact, Tenancy::Shared);
    let m = core(&e).await;
    let gate = |id: &str| e.config.gate_dir(&ContainerId::parse(id).unwrap());
    m.acquire(request("c-small", "GPU-0", 4, 25, "ns")).await.unwrap();
    // Another size on the same GPU is admitted under exact.
    m.acquire(request("c-large", "GPU-0", 8, 50, "ns")).await.unwrap();
    for id in ["c-small", "c-large"] {
        let control = gate(id).join("control");
        let kind = std::fs::metadata(&control).unwrap().file_type();
        assert!(
            std::os::unix::fs::FileTypeExt::is_socket(&kind),
            "{}",
            control.display()
        );
    }
    // Acquire starts the daemon but sets no limits: only a gate may, per connection.
    let cmds = e.control.commands();
    assert!(!cmds.iter().any(|c| c.starts_with("set_")), "{cmds:?}");
    assert_eq!(*e.control.starts.lock().unwrap(), 1);

    assert!(m.release("c-small").await.unwrap());
    assert!(!gate("c-small").exists(), "a released container's gate dir stays");

    // A restarted manager serves the remaining lease's gate again, removes a gate dir a previous
    // manager served for a container now gone, and keeps the fresh, empty dir of a container
    // whose Acquire is still to come (runc has mounted it already).
    let stray = e.config.gates_root().join("0123456789abcdef");
    std::fs::create_dir_all(&stray).unwrap();
    std::fs::write(stray.join("control"), "").unwrap();
    let pending = e.config.gates_root().join("fedcba9876543210");
    std::fs::create_dir_all(&pending).unwrap();
    let before = std::fs::metadata(gate("c-large").join("control")).unwrap();
    m.shutdown().await;
    drop(m);
    let m = core(&e).await;
    let after = std::fs::metadata(gate("c-large").join("control")).unwrap();
    assert_ne!(
        std::os::unix::fs::MetadataExt::ino(&before),
        std::os::unix::fs::MetadataExt::ino(&after),
        "the gate socket was not bound again"
    );
    assert!(!stray.exists(), "a served gate dir of no lease was left");
    assert!(
        pending.is_dir(),
        "the gate dir of a container being created was removed"
    );
    assert_eq!(m.status().await.leases.len(), 1);
}

#[tokio::test]
async fn a_container_laid_out_under_another_config_is_refused() {
    let e = env(LimitPolicy::Exact, Tenancy::Shared);
    let m = core(&e).await;
    let mut r = request("c1", "GPU-0", 4, 25, "ns");
    r.policy = "uniform".into();
    let err = m.acquire(r.clone()).await.unwrap_err();
    assert_eq!(err.code(), ttrpc::Code::FAILED_PRECONDITION);
    assert!(
        err.to_string()
            .starts_with("node config changed since gpu-mps-manager started: restart it"),
        "{err}"
    );
    r.policy = "exact".into();
    r.config_digest = "0000000000000000".into();
    assert_eq!(
        m.acquire(r.clone()).await.unwrap_err().code(),
        ttrpc::Code::FAILED_PRECONDITION
    );
    r.config_digest = e.config.digest();
    m.acquire(r).await.unwrap();
}

#[tokio::test]
async fn the_config_is_published_for_the_shim() {
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let _m = core(&e).await;
    let text = std::fs::read_to_string(e.config.published_path()).unwrap();
    let published = PublishedConfig::from_json(&text).unwrap();
    assert_eq!(published.config, e.config);
    assert_eq!(published.digest, e.config.digest());
    assert_eq!(published.manager_pid, std::process::id());
}

#[tokio::test]
async fn the_node_maximums_hold_at_acquire_too() {
    let mut e = env(LimitPolicy::Exact, Tenancy::Shared);
    e.config.limits.namespace_maxima.insert(
        "team-a".into(),
        gpu_mps_api::maxima::Maxima {
            memory_bytes: Some(4 * GIB),
            thread_percentage: 25,
            cuda_processes: 2,
        },
    );
    let m = core(&e).await;
    let err = m
        .acquire(request("c1", "GPU-0", 8, 25, "team-a"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), ttrpc::Code::INVALID_ARGUMENT);
    assert!(
        err.to_string()
            .contains("above the maximum 4Gi for namespace team-a"),
        "{err}"
    );
    let mut three = request("c2", "GPU-0", 4, 25, "team-a");
    three.cuda_processes = 3;
    assert!(m.acquire(three).await.is_err());
    // Another namespace has the node's maximums.
    m.acquire(request("c3", "GPU-0", 8, 50, "team-b")).await.unwrap();
}

#[tokio::test]
async fn a_lease_needs_the_containers_process() {
    let e = env(LimitPolicy::Exact, Tenancy::Shared);
    let m = core(&e).await;
    let mut r = request("c1", "GPU-0", 4, 25, "ns");
    r.pid = 0;
    let err = m.acquire(r).await.unwrap_err();
    assert_eq!(err.code(), ttrpc::Code::INVALID_ARGUMENT);
    assert!(err.to_string().contains("no running process"), "{err}");
    assert!(m.status().await.leases.is_empty());
}

#[tokio::test]
async fn units_of_a_gone_container_go_to_the_next_and_a_live_holder_keeps_them() {
    let e = env(LimitPolicy::Exact, Tenancy::Shared);
    let m = core(&e).await;
    let mut holder = Command::new("sleep").arg("600").spawn().unwrap();
    let mut first = request("c1", "GPU-0", 2, 25, "ns");
    first.pid = holder.id();
    first.memory_units = vec![0, 1];
    m.acquire(first).await.unwrap();
    let mut second = request("c2", "GPU-0", 2, 25, "ns");
    second.pid = std::process::id();
    second.memory_units = vec![1, 2];
    let refused = m.acquire(second.clone()).await.unwrap_err();
    assert!(
        refused.to_string().contains("is held by container c1"),
        "{refused}"
    );
    // c1's process is gone before the manager dropped its lease: c2 gets the unit.
    holder.kill().unwrap();
    holder.wait().unwrap();
    m.acquire(second).await.unwrap();
    let status = m.status().await;
    assert_eq!(status.leases.len(), 1);
    assert_eq!(status.leases[0].container_id, "c2");
    assert_eq!(status.leases[0].memory_units, vec![1, 2]);
}

#[tokio::test]
async fn a_corrupt_state_file_never_keeps_the_manager_from_starting() {
    let e = env(LimitPolicy::Exact, Tenancy::Shared);
    std::fs::create_dir_all(&e.config.root).unwrap();
    std::fs::write(e.config.state_path(), "{\"version\": 1, \"daemons\": {").unwrap();
    let m = core(&e).await;
    m.acquire(request("c1", "GPU-0", 4, 25, "ns")).await.unwrap();
    assert_eq!(m.status().await.leases.len(), 1);
    let kept = std::fs::read_dir(&e.config.root).unwrap().flatten().any(|f| {
        f.file_name()
            .to_string_lossy()
            .starts_with("state.json.unusable-")
    });
    assert!(kept, "the corrupt file was not kept aside");
}

#[tokio::test]
async fn a_pid_file_naming_a_reused_pid_never_gets_that_process_signalled() {
    let e = env(LimitPolicy::Exact, Tenancy::Shared);
    let m = core(&e).await;
    // A daemon that died long ago left its pid file; the kernel gave the pid to another process.
    let key = DaemonKey::new(["GPU-0"]);
    let pipe_dir = e.config.pipe_dir(&key);
    std::fs::create_dir_all(&pipe_dir).unwrap();
    let mut stranger = Command::new("sleep").arg("600").spawn().unwrap();
    std::fs::write(pipe_dir.join(mps_control::PID_FILE), stranger.id().to_string()).unwrap();
    m.acquire(request("c1", "GPU-0", 4, 25, "ns")).await.unwrap();
    assert!(
        stranger.try_wait().unwrap().is_none(),
        "the manager signalled an unrelated process named by a stale pid file"
    );
    assert_eq!(
        *e.control.starts.lock().unwrap(),
        1,
        "a daemon of its own was started"
    );
    stranger.kill().unwrap();
    stranger.wait().unwrap();
}

#[tokio::test]
async fn a_reused_id_replaces_the_lease_of_a_gone_process_only() {
    let e = env(LimitPolicy::Exact, Tenancy::Shared);
    let m = core(&e).await;
    let mut old = Command::new("sleep").arg("600").spawn().unwrap();
    let mut r = request("c1", "GPU-0", 4, 25, "ns");
    r.pid = old.id();
    m.acquire(r.clone()).await.unwrap();
    // Same id, another live process, while the first one lives: refused.
    let mut other = request("c1", "GPU-0", 4, 25, "ns");
    other.pid = std::process::id();
    assert_eq!(
        m.acquire(other.clone()).await.unwrap_err().code(),
        ttrpc::Code::INVALID_ARGUMENT
    );
    // The first process is gone (its release missed): the new container takes the id.
    old.kill().unwrap();
    old.wait().unwrap();
    let resp = m.acquire(other).await.unwrap();
    assert_eq!(resp.lease.as_ref().unwrap().pid, std::process::id());
    assert_eq!(m.status().await.leases.len(), 1);
}

#[tokio::test]
async fn every_policy_serves_a_gate_and_a_new_daemon_starts_its_server() {
    for policy in [LimitPolicy::Uniform, LimitPolicy::Ceiling, LimitPolicy::Exact] {
        let e = env(policy, Tenancy::Shared);
        let m = core(&e).await;
        let mut r = request("c1", "GPU-0", 4, 25, "ns");
        r.cuda_processes = 2;
        m.acquire(r).await.unwrap();
        let control = e
            .config
            .gate_dir(&ContainerId::parse("c1").unwrap())
            .join("control");
        let kind = std::fs::metadata(&control).unwrap().file_type();
        assert!(std::os::unix::fs::FileTypeExt::is_socket(&kind), "{policy}");
        assert!(
            e.control.commands().contains(&START_SERVER.to_string()),
            "{policy}: {:?}",
            e.control.commands()
        );
        let status = m.status().await;
        assert_eq!(status.daemons[0].server_pids.len(), 1, "{policy}");
        assert_eq!(status.leases[0].cuda_processes, 2, "{policy}");
    }
}

#[tokio::test]
async fn every_cuda_process_counts_against_the_clients_of_a_gpu() {
    let mut e = env(LimitPolicy::Exact, Tenancy::Shared);
    e.config.limits.maxima.cuda_processes = 48;
    let m = core(&e).await;
    let mut big = request("big", "GPU-0", 4, 5, "ns");
    big.cuda_processes = 40;
    m.acquire(big).await.unwrap();
    let mut nine = request("nine", "GPU-0", 1, 5, "ns");
    nine.cuda_processes = 9;
    let err = m.acquire(nine).await.unwrap_err();
    assert_eq!(err.code(), ttrpc::Code::RESOURCE_EXHAUSTED);
    assert!(err.to_string().contains("40 CUDA processes of 48"), "{err}");
}

#[tokio::test]
async fn a_drifted_compute_mode_is_set_again_on_reconcile() {
    let mut e = env(LimitPolicy::Exact, Tenancy::Shared);
    e.config.daemon.exclusive_process = true;
    let m = core(&e).await;
    assert_eq!(e.backend.compute_mode("GPU-0").unwrap(), "ExclusiveProcess");
    // Someone switches it back behind the manager.
    e.backend.set_compute_mode("GPU-0", "Default").unwrap();
    m.reconcile(now_unix()).await;
    assert_eq!(e.backend.compute_mode("GPU-0").unwrap(), "ExclusiveProcess");
}

/// Keeps a copy of every gate's listening socket, as the gate keeper does.
#[derive(Default)]
struct RecordingStore(Mutex<BTreeMap<String, OwnedFd>>);

impl ListenerStore for RecordingStore {
    fn keep(&self, name: &str, listener: std::os::fd::BorrowedFd<'_>) -> Result<(), String> {
        let copy = listener.try_clone_to_owned().map_err(|e| e.to_string())?;
        self.0.lock().unwrap().insert(name.into(), copy);
        Ok(())
    }
    fn forget(&self, name: &str) -> Result<(), String> {
        self.0.lock().unwrap().remove(name);
        Ok(())
    }
}

#[tokio::test]
async fn a_connection_made_while_the_manager_restarts_is_served_by_the_next_one() {
    use std::io::Read;
    let e = env(LimitPolicy::Exact, Tenancy::Shared);
    let store = Arc::new(RecordingStore::default());
    let options = || StartOptions {
        config_source: PathBuf::new(),
        inherited_gates: HashMap::new(),
        listener_store: Some(store.clone() as Arc<dyn ListenerStore>),
        ..StartOptions::default()
    };
    let m = ManagerCore::start_with(e.config.clone(), e.control.clone(), e.backend.clone(), options())
        .await
        .unwrap();
    m.acquire(request("c1", "GPU-0", 4, 25, "ns")).await.unwrap();
    let id = ContainerId::parse("c1").unwrap();
    let socket = e.config.gate_dir(&id).join("control");
    let before = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&socket).unwrap());
    m.shutdown().await;
    drop(m);
    // Nobody serves the gate now; the keeper's copy keeps it listening.
    let client = gate::seqpacket::connect(&socket).expect("connect while no manager runs");
    client.set_nonblocking(false).unwrap();
    client
        .set_read_timeout(Some(std::time::Duration::from_millis(200)))
        .unwrap();
    assert!(
        (&client).read(&mut [0u8; 16]).is_err(),
        "answered with no manager"
    );
    let inherited: HashMap<String, OwnedFd> = store
        .0
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.try_clone().unwrap()))
        .collect();
    assert_eq!(inherited.len(), 1);
    let m = ManagerCore::start_with(
        e.config.clone(),
        e.control.clone(),
        e.backend.clone(),
        StartOptions {
            inherited_gates: inherited,
            ..options()
        },
    )
    .await
    .unwrap();
    client
        .set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let mut hello = [0u8; 16];
    let n = tokio::task::spawn_blocking(move || (&client).read(&mut hello).map(|n| hello[..n].to_vec()))
        .await
        .unwrap()
        .expect("the waiting connection is served by the next manager");
    assert_eq!(n, gate::wire::HELLO);
    let after = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&socket).unwrap());
    assert_eq!(before, after, "the same socket, not a new one");
    assert!(m.release("c1").await.unwrap());
    assert!(
        store.0.lock().unwrap().is_empty(),
        "the keeper drops a released gate's socket"
    );
}

fn pipe_of(e: &Env, gpu: &str) -> PathBuf {
    e.config.pipe_dir(&DaemonKey::new([gpu]))
}

/// Issue 8, defect 1: one GPU's daemon hung in its start (or in a CLI call that waits out its
/// timeout) held the node-wide lock, and with it Acquire, Release and status on every GPU.
#[tokio::test]
async fn a_daemon_hung_in_its_start_holds_up_only_its_own_gpu() {
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let m = core(&e).await;
    m.acquire(request("c-before", "GPU-1", 2, 25, "ns"))
        .await
        .unwrap();
    e.control.stall(&pipe_of(&e, "GPU-0"));
    let quick = std::time::Duration::from_secs(2);
    let hung = m.acquire(request("c-hung", "GPU-0", 4, 25, "ns"));
    let others = async {
        // Let the hung Acquire reach its daemon's start first.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let other_gpu =
            tokio::time::timeout(quick, m.acquire(request("c-other", "GPU-1", 2, 25, "ns"))).await;
        let status = tokio::time::timeout(quick, m.status()).await;
        let released = tokio::time::timeout(quick, m.release("c-before")).await;
        let reconciled = tokio::time::timeout(quick, m.reconcile(now_unix())).await;
        let same_gpu_waits = tokio::time::timeout(std::time::Duration::from_millis(200), m.status()).await;
        e.control.unstall(&pipe_of(&e, "GPU-0"));
        (other_gpu, status, released, reconciled, same_gpu_waits)
    };
    let (hung, (other_gpu, status, released, reconciled, _)) = tokio::join!(hung, others);
    other_gpu
        .expect("an Acquire on another GPU waited for the hung daemon")
        .unwrap();
    let status = status.expect("status waited for the hung daemon");
    assert!(
        status.leases.iter().all(|l| l.container_id != "c-hung"),
        "a lease whose daemon is not ready is not shown as held"
    );
    assert!(released.expect("a release waited for the hung daemon").unwrap());
    reconciled.expect("reconcile waited for a daemon it had nothing to do with");
    hung.unwrap();
    let s = m.status().await;
    let mut held: Vec<&str> = s.leases.iter().map(|l| l.container_id.as_str()).collect();
    held.sort();
    assert_eq!(held, ["c-hung", "c-other"]);
}

/// Two Acquires for one daemon at once: the second waits for the first one's start and uses
/// that daemon; both containers' memory is counted while the start is in flight.
#[tokio::test]
async fn acquires_for_one_daemon_in_flight_start_it_once_and_count_each_other() {
    let e = env(LimitPolicy::Exact, Tenancy::Shared);
    let m = core(&e).await;
    e.control.stall(&pipe_of(&e, "GPU-0"));
    let first = m.acquire(request("c1", "GPU-0", 10, 25, "ns"));
    let rest = async {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        // 16 GiB GPU: 10 GiB pending leave no room for 8 more.
        let over = m.acquire(request("c-over", "GPU-0", 8, 25, "ns")).await;
        let retried = m.acquire(request("c1", "GPU-0", 10, 25, "ns")).await;
        let second = m.acquire(request("c2", "GPU-0", 4, 25, "ns"));
        let unstall = async {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            e.control.unstall(&pipe_of(&e, "GPU-0"));
        };
        let (second, ()) = tokio::join!(second, unstall);
        (over, retried, second)
    };
    let (first, (over, retried, second)) = tokio::join!(first, rest);
    first.unwrap();
    second.unwrap();
    let over = over.expect_err("memory of an Acquire in flight was not counted");
    assert!(matches!(over, ManagerError::Refused(_)), "{over}");
    let retried = retried.expect_err("a second Acquire of the same container while its first is in flight");
    assert_eq!(retried.code(), ttrpc::Code::UNAVAILABLE, "{retried}");
    assert!(
        retried.to_string().contains("already being given its lease"),
        "{retried}"
    );
    assert_eq!(*e.control.starts.lock().unwrap(), 1, "one daemon");
    assert_eq!(m.status().await.leases.len(), 2);
}

/// An idle daemon's stop and an Acquire for it cross: the Acquire waits for the stop, then
/// starts a new daemon; it never records a lease on a stopped daemon.
#[tokio::test]
async fn an_acquire_that_meets_an_idle_stop_gets_a_running_daemon() {
    let mut e = env(LimitPolicy::Uniform, Tenancy::Shared);
    e.config.daemon.idle_grace_seconds = 0;
    let m = core(&e).await;
    m.acquire(request("c1", "GPU-0", 4, 25, "ns")).await.unwrap();
    assert!(m.release("c1").await.unwrap());
    let first = m.status().await.daemons[0].control_pid;
    e.control.stall(&pipe_of(&e, "GPU-0"));
    let stop = m.reconcile(now_unix());
    let acquire = async {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let acquire = m.acquire(request("c2", "GPU-0", 4, 25, "ns"));
        let unstall = async {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            e.control.unstall(&pipe_of(&e, "GPU-0"));
        };
        tokio::join!(acquire, unstall).0
    };
    let ((), acquired) = tokio::join!(stop, acquire);
    acquired.unwrap();
    let s = m.status().await;
    assert_eq!(s.daemons.len(), 1);
    let daemon = &s.daemons[0];
    assert_ne!(daemon.control_pid, first, "the idle daemon was stopped");
    assert!(
        ProcessIdentity::of(daemon.control_pid).is_some_and(|p| p.is_alive()),
        "the lease's daemon runs"
    );
    assert_eq!(daemon.state, "running");
    assert_eq!(*e.control.starts.lock().unwrap(), 2);
}

/// Issue 8, defect 2: the record of a daemon kept the limits the manager last set and trusted
/// them across restarts, while the gates of a run under policy `exact` changed the server's
/// limits without it: back under `uniform`, a container of the recorded class got the server's
/// other limits. One cache now, in the daemon's owner, per daemon process.
#[tokio::test]
async fn limits_set_by_another_run_are_set_again_after_a_policy_switch() {
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let m = core(&e).await;
    let container = FakeContainer::start();
    m.acquire(container.request("c1", "GPU-0", 4, 25, "ns"))
        .await
        .unwrap();
    drop(m);
    let pipe = pipe_of(&e, "GPU-0");
    let held = |e: &Env| {
        let daemons = e.control.daemons.lock().unwrap();
        let d = &daemons[&pipe];
        (d.default_threads.clone(), d.default_mem.clone())
    };
    let set_by_uniform = held(&e);
    assert_eq!(set_by_uniform.0, "25.0");
    // The next run, under `exact`: a client of another container got its own limits, set by
    // its gate on the same (adopted) daemon.
    for command in [
        "set_default_active_thread_percentage 50",
        "set_default_device_pinned_mem_limit 0 8192M",
    ] {
        e.control.command(&pipe, command).await.unwrap();
    }
    // Back under `uniform`.
    let m = core(&e).await;
    assert_ne!(held(&e), set_by_uniform);
    m.acquire(request("c2", "GPU-0", 4, 25, "ns")).await.unwrap();
    assert_eq!(held(&e), set_by_uniform, "the server kept another run's limits");
}

/// Issue 8, fault 2: a control daemon dies under a running container. The next tick (1 s)
/// notices it, starts a new one with the lease's limits, and marks the lease: its processes
/// lost their server. New containers get the new daemon.
#[tokio::test]
async fn a_daemon_that_dies_under_a_lease_is_replaced_and_the_lease_marked() {
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let m = core(&e).await;
    let container = FakeContainer::start();
    m.acquire(container.request("c1", "GPU-0", 4, 25, "ns"))
        .await
        .unwrap();
    let first = m.status().await.daemons[0].control_pid;
    assert_eq!(m.status().await.leases[0].daemon_lost_unix, 0);
    e.control.kill_all();
    let died = now_unix();
    m.reconcile(died).await;
    let s = m.status().await;
    assert_ne!(s.daemons[0].control_pid, first);
    assert_eq!(s.leases[0].daemon_lost_unix, died, "the lease is marked");
    m.acquire(request("c2", "GPU-0", 4, 25, "ns")).await.unwrap();
    let s = m.status().await;
    let c2 = s.leases.iter().find(|l| l.container_id == "c2").unwrap();
    assert_eq!(c2.daemon_lost_unix, 0, "a new lease is on the new daemon");
    assert_eq!(*e.control.starts.lock().unwrap(), 2);
}

/// A daemon that cannot be started again under its leases is retried on every tick: the
/// failed start used to drop its record, and nothing tried again.
#[tokio::test]
async fn a_failed_restart_under_leases_is_retried() {
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let m = core(&e).await;
    let container = FakeContainer::start();
    m.acquire(container.request("c1", "GPU-0", 4, 25, "ns"))
        .await
        .unwrap();
    e.control.kill_all();
    e.control.refuse_starts.lock().unwrap().push(pipe_of(&e, "GPU-0"));
    m.reconcile(now_unix()).await;
    m.reconcile(now_unix()).await;
    assert_eq!(*e.control.starts.lock().unwrap(), 1, "no start succeeded");
    let s = m.status().await;
    assert!(
        s.gpus[0].unhealthy_reason.contains("could not start"),
        "{:?}",
        s.gpus[0].unhealthy_reason
    );
    e.control.refuse_starts.lock().unwrap().clear();
    m.reconcile(now_unix()).await;
    assert_eq!(
        *e.control.starts.lock().unwrap(),
        2,
        "tried again on a later tick"
    );
    let s = m.status().await;
    assert!(ProcessIdentity::of(s.daemons[0].control_pid).is_some_and(|p| p.is_alive()));
    assert_eq!(s.daemons[0].active_thread_percentage, 25);
    assert_eq!(s.gpus[0].unhealthy_reason, "");
}

/// A gate dir the shim made for a container whose create ended before its Acquire (containerd
/// 2.x removes such a container without the runc `delete` on which the shim removes it): the
/// running manager removes it once no Acquire can come for it any more, and keeps a fresh one
/// and a served one.
#[tokio::test]
async fn an_unserved_gate_dir_is_removed_once_no_acquire_can_come_for_it() {
    let e = env(LimitPolicy::Exact, Tenancy::Shared);
    let m = core(&e).await;
    m.acquire(request("c-served", "GPU-0", 4, 25, "ns"))
        .await
        .unwrap();
    let gate = |id: &str| e.config.gate_dir(&ContainerId::parse(id).unwrap());
    let (old, fresh) = (gate("c-killed-in-create"), gate("c-being-created"));
    for dir in [&old, &fresh] {
        std::fs::create_dir_all(dir).unwrap();
    }
    let age = unserved_gate_dir_age(&e.config) + std::time::Duration::from_secs(1);
    let long_ago = std::time::SystemTime::now() - age;
    std::fs::File::open(&old).unwrap().set_modified(long_ago).unwrap();
    m.reconcile(now_unix()).await;
    assert!(
        !old.exists(),
        "an unserved gate dir older than any create was kept"
    );
    assert!(
        fresh.is_dir(),
        "the gate dir of a container still being created was removed"
    );
    assert!(
        gate("c-served").join("control").exists(),
        "a served gate dir was touched"
    );
}

/// Fault 5: the state file is lost or unusable while containers run. The new manager starts,
/// rebuilds their leases from the lease files and adopts their daemon (the same process), so
/// their memory is still counted; a lease whose container ended meanwhile is not rebuilt.
#[tokio::test]
async fn leases_of_running_containers_are_rebuilt_when_the_state_file_is_unusable() {
    let state_file_faults: [(&str, Option<&[u8]>); 5] = [
        ("corrupt", Some(b"{ this is not json")),
        ("truncated", Some(b"{\"version\": 1, \"daemons\": {")),
        ("empty", Some(b"")),
        (
            "another version",
            Some(b"{\"version\": 99, \"daemons\": {}, \"leases\": {}, \"saved_compute_modes\": {}}"),
        ),
        ("deleted", None),
    ];
    for (fault, bytes) in state_file_faults {
        let e = env(LimitPolicy::Exact, Tenancy::Shared);
        let m = core(&e).await;
        let (a, b) = (FakeContainer::start(), FakeContainer::start());
        let mut ended = FakeContainer::start();
        m.acquire(a.request("a", "GPU-0", 6, 25, "ns")).await.unwrap();
        m.acquire(b.request("b", "GPU-0", 6, 50, "ns")).await.unwrap();
        m.acquire(ended.request("ended", "GPU-1", 2, 25, "ns"))
            .await
            .unwrap();
        let before = m.status().await;
        drop(m); // the manager dies without shutdown
        ended.stop();
        match bytes {
            Some(bytes) => std::fs::write(e.config.state_path(), bytes).unwrap(),
            None => std::fs::remove_file(e.config.state_path()).unwrap(),
        }

        let m2 = core(&e).await;
        let after = m2.status().await;
        let ids: Vec<&str> = after.leases.iter().map(|l| l.container_id.as_str()).collect();
        assert_eq!(ids, ["a", "b"], "{fault}: {after:#?}");
        for lease in &after.leases {
            let was = before
                .leases
                .iter()
                .find(|l| l.container_id == lease.container_id)
                .unwrap();
            assert_eq!(
                (
                    lease.memory_limit_bytes,
                    lease.active_thread_percentage,
                    lease.pid
                ),
                (was.memory_limit_bytes, was.active_thread_percentage, was.pid),
                "{fault}"
            );
        }
        let gpu0 = |s: &proto::StatusResponse| {
            s.daemons
                .iter()
                .find(|d| d.gpu_uuids == ["GPU-0"])
                .map(|d| d.control_pid)
        };
        assert_eq!(
            gpu0(&after),
            gpu0(&before),
            "{fault}: GPU-0's daemon was not adopted"
        );
        // 12 of 16 GiB are still counted: 6 more do not fit, 4 do.
        assert_eq!(
            m2.acquire(request("c", "GPU-0", 6, 10, "ns"))
                .await
                .unwrap_err()
                .code(),
            ttrpc::Code::RESOURCE_EXHAUSTED,
            "{fault}"
        );
        m2.acquire(request("d", "GPU-0", 4, 10, "ns")).await.unwrap();
        // The lease files follow the state again: a release removes its file.
        m2.release("a").await.unwrap();
        let (files, notes) = crate::lease_files::read_all(&e.config.lease_files_dir());
        let ids: Vec<&str> = files.iter().map(|l| l.container_id.as_str()).collect();
        assert_eq!((ids, notes), (vec!["b", "d"], vec![]), "{fault}");
    }
}

/// A full disk: a lease that cannot be recorded is refused in one line that says why (never
/// run unrecorded, which a restart would not count), a release still releases, the manager
/// starts anyway, and once there is room again everything is saved.
#[tokio::test]
async fn a_disk_that_cannot_be_written_refuses_new_leases_in_one_line_and_loses_nothing() {
    let e = env(LimitPolicy::Exact, Tenancy::Shared);
    let m = core(&e).await;
    let kept = FakeContainer::start();
    m.acquire(kept.request("kept", "GPU-0", 4, 25, "ns"))
        .await
        .unwrap();
    m.acquire(request("released", "GPU-0", 4, 25, "ns"))
        .await
        .unwrap();

    // The lease files' dir cannot be written: every save fails as on a full /run.
    let leases_dir = e.config.lease_files_dir();
    std::fs::rename(&leases_dir, e.config.root.join("leases.moved")).unwrap();
    std::fs::write(&leases_dir, b"in the way").unwrap();
    let error = m.acquire(request("new", "GPU-0", 4, 25, "ns")).await.unwrap_err();
    let text = error.to_string();
    assert_eq!(error.code(), ttrpc::Code::RESOURCE_EXHAUSTED, "{text}");
    assert!(
        !text.contains('\n') && text.contains("cannot get its lease") && text.contains("free space under"),
        "{text}"
    );
    assert!(
        m.release("released").await.unwrap(),
        "a release failed on the disk"
    );
    let leases = |s: &proto::StatusResponse| -> Vec<String> {
        s.leases.iter().map(|l| l.container_id.clone()).collect()
    };
    assert_eq!(leases(&m.status().await), ["kept"]);

    // A restart with the disk still full: the manager starts.
    drop(m);
    let m = core(&e).await;
    assert_eq!(leases(&m.status().await), ["kept"]);

    // Room again: the next tick saves, and a restart then finds exactly the live lease.
    std::fs::remove_file(&leases_dir).unwrap();
    m.reconcile(crate::core::now_unix()).await;
    let (files, _) = crate::lease_files::read_all(&leases_dir);
    assert_eq!(
        files.iter().map(|l| l.container_id.as_str()).collect::<Vec<_>>(),
        ["kept"]
    );
    m.acquire(request("new", "GPU-0", 4, 25, "ns")).await.unwrap();
    std::fs::remove_file(e.config.state_path()).unwrap();
    drop(m);
    let m = core(&e).await;
    assert_eq!(leases(&m.status().await), ["kept", "new"]);
}

/// The files the shim reads cannot be written at start (a full /run): the manager starts
/// anyway and serves, with the files of the last run.
#[tokio::test]
async fn the_manager_starts_when_it_cannot_publish_its_files() {
    let e = env(LimitPolicy::Exact, Tenancy::Shared);
    std::fs::create_dir_all(e.config.inventory_path()).unwrap();
    std::fs::create_dir_all(e.config.published_path()).unwrap();
    let m = core(&e).await;
    m.acquire(request("c1", "GPU-0", 4, 25, "ns")).await.unwrap();
}
/// The metrics a scrape would show, from the core's own paths: the levels computed from the
/// books, the events recorded where they happen.
#[tokio::test]
async fn metrics_follow_the_books_and_the_events_of_acquire_and_reconcile() {
    use crate::metrics::{Exposition, Format, LevelSource, Metrics};
    let e = env(LimitPolicy::Uniform, Tenancy::Shared);
    let metrics = Metrics::default();
    let options = StartOptions {
        metrics: metrics.clone(),
        ..StartOptions::default()
    };
    let m = Arc::new(
        ManagerCore::start_with(e.config.clone(), e.control.clone(), e.backend.clone(), options)
            .await
            .unwrap(),
    );
    let container = FakeContainer::start();
    let mut r = container.request("c1", "GPU-0", 4, 25, "ns");
    r.cuda_processes = 2;
    m.acquire(r).await.unwrap();
    // The same class (2Gi and 25% per process) in one process.
    m.acquire(container.request("c2", "GPU-0", 2, 25, "ns"))
        .await
        .unwrap();
    // Another class on a busy GPU under uniform, and a request beyond the GPU's memory.
    m.acquire(request("c3", "GPU-0", 2, 10, "ns")).await.unwrap_err();
    m.acquire(request("c4", "GPU-1", 17, 10, "ns")).await.unwrap_err();

    let levels = m.node_levels();
    assert_eq!(levels.policy, "uniform");
    let gpu0 = &levels.gpus[0];
    assert_eq!(
        (gpu0.uuid.as_str(), gpu0.leases, gpu0.memory_allocated_bytes),
        ("GPU-0", 2, 6 * GIB)
    );
    assert_eq!(
        (
            gpu0.threads_allocated_percent,
            gpu0.clients_allocated,
            gpu0.clients_capacity
        ),
        (50, 3, 48)
    );
    assert_eq!(gpu0.memory_capacity_bytes, 16 * GIB);
    assert_eq!(levels.gpus[1].leases, 0);
    assert_eq!(levels.daemons.len(), 1);
    assert_eq!(
        (
            levels.daemons[0].daemon.as_str(),
            levels.daemons[0].state,
            levels.daemons[0].leases
        ),
        ("GPU-0", "running", 2)
    );
    assert_eq!(levels.leases_pending, 0);

    // The daemon dies under its leases: the next tick starts it again.
    e.control.kill_all();
    m.reconcile(now_unix()).await;

    let source: Arc<dyn LevelSource> = m.clone();
    let text = Exposition::new(&metrics, Arc::downgrade(&source))
        .encode(Format::PrometheusText)
        .unwrap();
    for line in [
        r#"gpu_mps_acquire_duration_seconds_count{outcome="acquired"} 2"#,
        r#"gpu_mps_acquire_duration_seconds_count{outcome="refused"} 2"#,
        r#"gpu_mps_lease_refusals_total{reason="class_busy"} 1"#,
        r#"gpu_mps_lease_refusals_total{reason="memory_capacity"} 1"#,
        r#"gpu_mps_daemon_starts_total{daemon="GPU-0",how="started"} 1"#,
        r#"gpu_mps_daemon_starts_total{daemon="GPU-0",how="restarted"} 1"#,
        r#"gpu_mps_leases{daemon="GPU-0"} 2"#,
        r#"gpu_mps_daemons{state="running"} 1"#,
    ] {
        assert!(text.lines().any(|l| l == line), "no line {line} in:\n{text}");
    }
}

/// A gate keeper that takes its time to drop a socket.
struct SlowStore {
    forget_takes: std::time::Duration,
}

impl ListenerStore for SlowStore {
    fn keep(&self, _: &str, _: std::os::fd::BorrowedFd<'_>) -> Result<(), String> {
        Ok(())
    }
    fn forget(&self, _: &str) -> Result<(), String> {
        std::thread::sleep(self.forget_takes);
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_gate_keeper_does_not_hold_the_other_requests_of_the_node() {
    let e = env(LimitPolicy::Exact, Tenancy::Shared);
    let store = Arc::new(SlowStore {
        forget_takes: std::time::Duration::from_millis(1500),
    });
    let options = StartOptions {
        config_source: PathBuf::new(),
        inherited_gates: HashMap::new(),
        listener_store: Some(store as Arc<dyn ListenerStore>),
        ..StartOptions::default()
    };
    let m = Arc::new(
        ManagerCore::start_with(e.config.clone(), e.control.clone(), e.backend.clone(), options)
            .await
            .unwrap(),
    );
    m.acquire(request("c1", "GPU-0", 4, 25, "ns")).await.unwrap();
    let releasing = {
        let m = m.clone();
        tokio::spawn(async move { m.release("c1").await.unwrap() })
    };
    // The release is in the keeper's round trip now; another request of the node goes on.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let started = std::time::Instant::now();
    let status = m.status().await;
    let took = started.elapsed();
    assert!(
        took < std::time::Duration::from_millis(700),
        "status waited {took:?} for the keeper's round trip of another container's release"
    );
    assert!(!status.daemons.is_empty());
    assert!(releasing.await.unwrap(), "the release itself completes");
}
