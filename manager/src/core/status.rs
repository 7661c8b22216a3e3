//! Status: a snapshot of the books; the MPS and NVML queries run after the lock is released,
//! so `gpu-mps status` never delays a container start.

use std::path::Path;

use gpu_mps_api::node_config::NodeConfig;
use gpu_mps_api::{ContainerId, proto};

use super::{Books, ManagerCore, now_unix};
use crate::admission;
use crate::lease::LeaseRecord;
use crate::metrics::{DaemonLevels, GpuLevels, LevelSource, NodeLevels};
use crate::mps_control;
use crate::state::DaemonRecord;

impl ManagerCore {
    pub async fn status(&self) -> proto::StatusResponse {
        let mut resp = proto::StatusResponse::new();
        resp.policy = self.config.limits.policy.to_string();
        resp.tenancy = self.config.limits.tenancy.to_string();
        resp.manager_version = env!("CARGO_PKG_VERSION").to_string();
        resp.config_digest = self.config_digest.clone();
        resp.config_source = self.config_source.display().to_string();
        {
            let books = self.books();
            for g in &self.inventory.gpus {
                let on_gpu: Vec<&LeaseRecord> = books
                    .leases
                    .values()
                    .filter(|l| l.request.key.contains(&g.uuid))
                    .collect();
                let mut gpu = proto::Gpu::new();
                gpu.index = g.index;
                gpu.uuid = g.uuid.clone();
                gpu.name = g.name.clone();
                gpu.memory_bytes = g.memory_bytes;
                gpu.leases = on_gpu.len() as u32;
                gpu.memory_reserved_bytes = on_gpu
                    .iter()
                    .map(|l| l.request.limits.effective_memory_bytes())
                    .sum();
                gpu.memory_capacity_bytes =
                    admission::memory_capacity(g.memory_bytes, self.config.limits.overcommit);
                gpu.max_clients = self.config.limits.max_clients_per_gpu;
                gpu.compute_mode = g.compute_mode.clone();
                gpu.unhealthy_reason = unhealthy_reason(&books, &g.uuid, now_unix());
                resp.gpus.push(gpu);
            }
            for d in books.daemons.records() {
                resp.daemons
                    .push(daemon_proto(d, books.leases_of(&d.key).count()));
            }
            resp.leases = books.leases.values().map(lease_proto).collect();
        }
        for lease in &mut resp.leases {
            let Some(view) = ContainerId::parse(&lease.container_id)
                .ok()
                .and_then(|id| self.gates.view(&id))
            else {
                continue;
            };
            lease.admitted_pids = view.admitted_pids;
            lease.refusals = view.refusals;
            lease.last_refusal = view.last_refusal;
            lease.gate_connections = view.connections;
        }
        resp.config_note = config_note(&self.config_source, &self.config);
        for gpu in &mut resp.gpus {
            if let Ok(mode) = self.backend.compute_mode(&gpu.uuid) {
                gpu.compute_mode = mode;
            }
        }
        for daemon in &mut resp.daemons {
            let pipe_dir = Path::new(&daemon.pipe_dir);
            daemon.server_pids = mps_control::server_pids(self.control.as_ref(), pipe_dir)
                .await
                .unwrap_or_default();
        }
        resp
    }
}

/// The levels a metrics scrape shows: numbers copied out of the books, then the gates' counts
/// read after the lock is released (as [`ManagerCore::status`] does).
impl LevelSource for ManagerCore {
    fn node_levels(&self) -> NodeLevels {
        let mut levels = NodeLevels {
            version: env!("CARGO_PKG_VERSION").to_string(),
            policy: self.config.limits.policy.to_string(),
            tenancy: self.config.limits.tenancy.to_string(),
            ..NodeLevels::default()
        };
        let leases: Vec<(String, String)> = {
            let books = self.books();
            let now = now_unix();
            for g in &self.inventory.gpus {
                let on_gpu: Vec<&LeaseRecord> = books
                    .leases
                    .values()
                    .filter(|l| l.request.key.contains(&g.uuid))
                    .collect();
                levels.gpus.push(GpuLevels {
                    uuid: g.uuid.clone(),
                    index: g.index,
                    name: g.name.clone(),
                    memory_bytes: g.memory_bytes,
                    memory_capacity_bytes: admission::memory_capacity(
                        g.memory_bytes,
                        self.config.limits.overcommit,
                    ),
                    memory_allocated_bytes: on_gpu
                        .iter()
                        .map(|l| l.request.limits.effective_memory_bytes())
                        .sum(),
                    threads_allocated_percent: on_gpu
                        .iter()
                        .map(|l| u64::from(l.request.limits.thread_percentage))
                        .sum(),
                    clients_allocated: on_gpu.iter().map(|l| u64::from(l.request.cuda_processes)).sum(),
                    clients_capacity: u64::from(self.config.limits.max_clients_per_gpu),
                    leases: on_gpu.len() as u64,
                    unhealthy: !unhealthy_reason(&books, &g.uuid, now).is_empty(),
                });
            }
            for d in books.daemons.records() {
                levels.daemons.push(DaemonLevels {
                    daemon: d.key.to_string(),
                    state: crate::daemon_life::Phase::of_record(d).status_name(),
                    leases: books.leases_of(&d.key).count() as u64,
                    clients: 0,
                });
            }
            levels.leases_pending = books.pending.len() as u64;
            books
                .leases
                .values()
                .map(|l| (l.container_id.clone(), l.request.key.to_string()))
                .collect()
        };
        for (container, daemon) in leases {
            let Some(view) = ContainerId::parse(&container)
                .ok()
                .and_then(|id| self.gates.view(&id))
            else {
                continue;
            };
            levels.gate_connections_open += u64::from(view.connections);
            if let Some(d) = levels.daemons.iter_mut().find(|d| d.daemon == daemon) {
                d.clients += view.admitted_pids.len() as u64;
            }
        }
        levels
    }
}

pub(super) fn daemon_proto(d: &DaemonRecord, leases: usize) -> proto::Daemon {
    let mut daemon = proto::Daemon::new();
    daemon.key = d.key.dir_name();
    daemon.gpu_uuids = d.key.gpu_uuids().to_vec();
    daemon.pipe_dir = d.pipe_dir.display().to_string();
    daemon.control_pid = d.control.pid;
    if let Some(l) = d.applied {
        daemon.memory_limit_bytes = l.memory_bytes;
        daemon.active_thread_percentage = u32::from(l.thread_percentage);
    }
    daemon.leases = leases as u32;
    daemon.state = crate::daemon_life::Phase::of_record(d).status_name().into();
    daemon.idle_since_unix = d.idle_since_unix.unwrap_or(0);
    daemon.started_unix = d.started_unix;
    daemon.faults = d.faults;
    daemon.last_fault_unix = d.last_fault_unix.unwrap_or(0);
    daemon
}

/// Why `gpu` cannot take new containers now, or empty.
fn unhealthy_reason(books: &Books, gpu: &str, now: i64) -> String {
    books
        .daemons
        .all()
        .filter(|d| d.key().contains(gpu))
        .find_map(|d| {
            let alive = d.record().is_some_and(|r| r.control.is_alive());
            d.unhealthy_reason(now, alive)
        })
        .unwrap_or_default()
}

pub(super) fn lease_proto(l: &LeaseRecord) -> proto::Lease {
    let mut lease = proto::Lease::new();
    lease.container_id = l.container_id.clone();
    lease.daemon = l.request.key.dir_name();
    lease.gpu_uuids = l.request.key.gpu_uuids().to_vec();
    lease.memory_limit_bytes = l.request.limits.memory_bytes;
    lease.active_thread_percentage = u32::from(l.request.limits.thread_percentage);
    lease.namespace = l.request.identity.namespace.clone();
    lease.pod = l.request.identity.pod.clone();
    lease.container_name = l.request.identity.container_name.clone();
    lease.pid = l.process.map(|p| p.pid).unwrap_or(0);
    lease.acquired_unix = l.acquired_unix;
    lease.cuda_processes = l.request.cuda_processes;
    lease.memory_units = l.request.memory_units.clone();
    lease.daemon_lost_unix = l.daemon_lost_unix.unwrap_or(0);
    lease.client_priority = l.request.priority.mps_value();
    lease
}

/// A warning when the config file no longer says what the manager runs with.
fn config_note(source: &Path, running: &NodeConfig) -> String {
    if source.as_os_str().is_empty() {
        return String::new();
    }
    match NodeConfig::load(source) {
        Ok(now) if &now == running => String::new(),
        Ok(_) => format!(
            "{} has changed since gpu-mps-manager started; it runs with the config it read then (restart it to apply the change)",
            source.display()
        ),
        Err(e) => format!(
            "{} is no longer valid ({e}); gpu-mps-manager runs with the config it read at start",
            source.display()
        ),
    }
}
