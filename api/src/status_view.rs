//! What `gpu-mps status|daemons|leases` print: the manager's StatusResponse as JSON (for
//! scripts and tests) or as tables (for people). Pure. The one definition of
//! `gpu-mps status --json`: the CLI serializes it, scripts and the e2e tests deserialize it.

use serde::{Deserialize, Serialize};

use crate::container_request::ClientPriority;
use crate::proto;
use crate::quantity::format_bytes;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusView {
    pub manager_version: String,
    pub policy: String,
    pub tenancy: String,
    /// The digest of the config the manager runs with and the file it read it from.
    pub config_digest: String,
    pub config_source: String,
    /// Set when the file has changed since the manager read it.
    pub config_note: String,
    pub gpus: Vec<GpuView>,
    pub daemons: Vec<DaemonView>,
    pub leases: Vec<LeaseView>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuView {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_bytes: u64,
    pub compute_mode: String,
    pub leases: u32,
    pub max_clients: u32,
    pub memory_reserved_bytes: u64,
    pub memory_capacity_bytes: u64,
    /// Empty while the GPU takes new containers; otherwise why not.
    #[serde(default)]
    pub unhealthy_reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonView {
    pub key: String,
    pub gpu_uuids: Vec<String>,
    pub state: String,
    pub control_pid: u32,
    pub server_pids: Vec<u32>,
    pub memory_limit_bytes: u64,
    pub active_thread_percentage: u32,
    pub leases: u32,
    pub pipe_dir: String,
    pub started_unix: i64,
    pub idle_since_unix: i64,
    /// Fatal GPU faults its server reported (the lines of one reconcile tick count as one): each
    /// tore down every client of the server.
    pub faults: u32,
    pub last_fault_unix: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseView {
    pub container_id: String,
    pub namespace: String,
    pub pod: String,
    pub container_name: String,
    pub daemon: String,
    pub gpu_uuids: Vec<String>,
    pub memory_limit_bytes: u64,
    pub active_thread_percentage: u32,
    pub pid: u32,
    pub acquired_unix: i64,
    /// CUDA processes it may run; memory_limit_bytes is their total.
    pub cuda_processes: u32,
    /// Its CUDA processes the gate let through to the server, alive now.
    pub admitted_pids: Vec<u32>,
    /// Connections its gate refused, and the last reason.
    pub refusals: u32,
    pub last_refusal: String,
    pub gate_connections: u32,
    /// The device plugin's gpu-mps.io/memory units on its GPU; empty without.
    #[serde(default)]
    pub memory_units: Vec<u32>,
    /// When the MPS control daemon it used died under it (unix seconds; 0: never): its CUDA
    /// processes running then lost their server.
    #[serde(default)]
    pub daemon_lost_unix: i64,
    /// MPS client priority of its processes (gpu-mps.io/priority); absent when normal.
    #[serde(default, skip_serializing_if = "ClientPriority::is_normal")]
    pub priority: ClientPriority,
}

impl From<&proto::StatusResponse> for StatusView {
    fn from(s: &proto::StatusResponse) -> Self {
        StatusView {
            manager_version: s.manager_version.clone(),
            policy: s.policy.clone(),
            tenancy: s.tenancy.clone(),
            config_digest: s.config_digest.clone(),
            config_source: s.config_source.clone(),
            config_note: s.config_note.clone(),
            gpus: s
                .gpus
                .iter()
                .map(|g| GpuView {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    name: g.name.clone(),
                    memory_bytes: g.memory_bytes,
                    compute_mode: g.compute_mode.clone(),
                    leases: g.leases,
                    max_clients: g.max_clients,
                    memory_reserved_bytes: g.memory_reserved_bytes,
                    memory_capacity_bytes: g.memory_capacity_bytes,
                    unhealthy_reason: g.unhealthy_reason.clone(),
                })
                .collect(),
            daemons: s
                .daemons
                .iter()
                .map(|d| DaemonView {
                    key: d.key.clone(),
                    gpu_uuids: d.gpu_uuids.clone(),
                    state: d.state.clone(),
                    control_pid: d.control_pid,
                    server_pids: d.server_pids.clone(),
                    memory_limit_bytes: d.memory_limit_bytes,
                    active_thread_percentage: d.active_thread_percentage,
                    leases: d.leases,
                    pipe_dir: d.pipe_dir.clone(),
                    started_unix: d.started_unix,
                    idle_since_unix: d.idle_since_unix,
                    faults: d.faults,
                    last_fault_unix: d.last_fault_unix,
                })
                .collect(),
            leases: s
                .leases
                .iter()
                .map(|l| LeaseView {
                    container_id: l.container_id.clone(),
                    namespace: l.namespace.clone(),
                    pod: l.pod.clone(),
                    container_name: l.container_name.clone(),
                    daemon: l.daemon.clone(),
                    gpu_uuids: l.gpu_uuids.clone(),
                    memory_limit_bytes: l.memory_limit_bytes,
                    active_thread_percentage: l.active_thread_percentage,
                    pid: l.pid,
                    acquired_unix: l.acquired_unix,
                    cuda_processes: l.cuda_processes.max(1),
                    admitted_pids: l.admitted_pids.clone(),
                    refusals: l.refusals,
                    last_refusal: l.last_refusal.clone(),
                    gate_connections: l.gate_connections,
                    memory_units: l.memory_units.clone(),
                    daemon_lost_unix: l.daemon_lost_unix,
                    // A value this build does not know reads as normal: status never fails on it.
                    priority: ClientPriority::from_mps_value(l.client_priority).unwrap_or_default(),
                })
                .collect(),
        }
    }
}

fn table(header: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.len());
        }
    }
    let line = |cells: Vec<&str>| {
        cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<w$}", w = widths[i]))
            .collect::<Vec<_>>()
            .join("  ")
    };
    let mut out = line(header.to_vec()).trim_end().to_string() + "\n";
    for r in &rows {
        out += line(r.iter().map(String::as_str).collect()).trim_end();
        out += "\n";
    }
    out
}

fn limits(mem: u64, pct: u32) -> String {
    if mem == 0 && pct == 0 {
        "-".into()
    } else {
        format!("{}/{}%", format_bytes(mem), pct)
    }
}

fn short(id: &str) -> String {
    id.chars().take(13).collect()
}

impl StatusView {
    pub fn gpus_table(&self) -> String {
        table(
            &[
                "GPU",
                "UUID",
                "NAME",
                "MODE",
                "LEASES",
                "MEMORY RESERVED",
                "HEALTH",
            ],
            self.gpus
                .iter()
                .map(|g| {
                    vec![
                        g.index.to_string(),
                        g.uuid.clone(),
                        g.name.clone(),
                        g.compute_mode.clone(),
                        format!("{}/{}", g.leases, g.max_clients),
                        format!(
                            "{} of {}",
                            format_bytes(g.memory_reserved_bytes),
                            format_bytes(g.memory_capacity_bytes)
                        ),
                        if g.unhealthy_reason.is_empty() {
                            "ok".to_string()
                        } else {
                            format!("UNHEALTHY: {}", g.unhealthy_reason)
                        },
                    ]
                })
                .collect(),
        )
    }

    pub fn daemons_table(&self) -> String {
        table(
            &[
                "DAEMON", "STATE", "PID", "SERVERS", "LIMITS", "LEASES", "FAULTS", "PIPE DIR",
            ],
            self.daemons
                .iter()
                .map(|d| {
                    vec![
                        d.key.clone(),
                        d.state.clone(),
                        d.control_pid.to_string(),
                        d.server_pids
                            .iter()
                            .map(|p| p.to_string())
                            .collect::<Vec<_>>()
                            .join(","),
                        if self.policy == "exact" {
                            // The gate sets each client's own limits as it connects.
                            "per client".to_string()
                        } else {
                            limits(d.memory_limit_bytes, d.active_thread_percentage)
                        },
                        d.leases.to_string(),
                        d.faults.to_string(),
                        d.pipe_dir.clone(),
                    ]
                })
                .collect(),
        )
    }

    pub fn leases_table(&self) -> String {
        table(
            &[
                "CONTAINER",
                "NAMESPACE",
                "POD",
                "NAME",
                "DAEMON",
                "LIMITS",
                "CUDA PROCS",
                "UNITS",
                "PID",
                "REFUSED",
                "DAEMON LOST",
            ],
            self.leases
                .iter()
                .map(|l| {
                    vec![
                        short(&l.container_id),
                        l.namespace.clone(),
                        l.pod.clone(),
                        l.container_name.clone(),
                        l.daemon.clone(),
                        limits(l.memory_limit_bytes, l.active_thread_percentage),
                        format!("{}/{}", l.admitted_pids.len(), l.cuda_processes),
                        // The device plugin's gpu-mps.io/memory units; "-" without.
                        if l.memory_units.is_empty() {
                            "-".to_string()
                        } else {
                            l.memory_units.len().to_string()
                        },
                        l.pid.to_string(),
                        if l.refusals == 0 {
                            "0".to_string()
                        } else {
                            format!("{} (last: {})", l.refusals, l.last_refusal)
                        },
                        // Its processes running then lost their server; new ones use the new daemon.
                        if l.daemon_lost_unix == 0 {
                            "-".to_string()
                        } else {
                            format!("died (unix {})", l.daemon_lost_unix)
                        },
                    ]
                })
                .collect(),
        )
    }

    pub fn summary(&self) -> String {
        let note = if self.config_note.is_empty() {
            String::new()
        } else {
            format!("WARNING: {}\n", self.config_note)
        };
        format!(
            "gpu-mps-manager {}: policy {}, tenancy {}, {} GPU(s), {} daemon(s), {} lease(s)\n{note}\n{}\n{}\n{}",
            self.manager_version,
            self.policy,
            self.tenancy,
            self.gpus.len(),
            self.daemons.len(),
            self.leases.len(),
            self.gpus_table(),
            self.daemons_table(),
            self.leases_table()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_and_show_limits() {
        let mut s = proto::StatusResponse::new();
        s.policy = "uniform".into();
        let mut d = proto::Daemon::new();
        d.key = "GPU-0".into();
        d.state = "running".into();
        d.memory_limit_bytes = 4 << 30;
        d.active_thread_percentage = 25;
        d.leases = 2;
        s.daemons.push(d);
        let view = StatusView::from(&s);
        let t = view.daemons_table();
        assert!(t.contains("4Gi/25%"), "{t}");
        assert!(t.lines().next().unwrap().starts_with("DAEMON"));
        let json = serde_json::to_value(&view).unwrap();
        assert_eq!(json["daemons"][0]["leases"], 2);
        assert_eq!(json["policy"], "uniform");
    }

    #[test]
    fn gpu_health_and_lease_units_are_shown() {
        let mut s = proto::StatusResponse::new();
        for (uuid, reason) in [
            ("GPU-0", ""),
            ("GPU-1", "its MPS daemon cannot start: no such file"),
        ] {
            let mut g = proto::Gpu::new();
            g.uuid = uuid.into();
            g.unhealthy_reason = reason.into();
            s.gpus.push(g);
        }
        for (id, units) in [("c1", vec![3, 4, 5]), ("c2", vec![])] {
            let mut l = proto::Lease::new();
            l.container_id = id.into();
            l.memory_units = units;
            s.leases.push(l);
        }
        let view = StatusView::from(&s);
        let gpus = view.gpus_table();
        let rows: Vec<&str> = gpus.lines().collect();
        assert!(rows[0].ends_with("HEALTH"), "{gpus}");
        assert!(rows[1].ends_with("ok"), "{gpus}");
        assert!(
            rows[2].ends_with("UNHEALTHY: its MPS daemon cannot start: no such file"),
            "{gpus}"
        );
        let leases = view.leases_table();
        let units_col = leases.lines().next().unwrap().find("UNITS").unwrap();
        let rows: Vec<&str> = leases.lines().collect();
        assert_eq!(&rows[1][units_col..units_col + 1], "3", "{leases}");
        assert_eq!(&rows[2][units_col..units_col + 1], "-", "{leases}");
        assert_eq!(view.leases[0].memory_units, vec![3, 4, 5]);
    }

    #[test]
    fn json_reads_back_as_written() {
        let mut s = proto::StatusResponse::new();
        s.manager_version = "0.1.0".into();
        let mut g = proto::Gpu::new();
        g.uuid = "GPU-0".into();
        g.memory_bytes = 16 << 30;
        s.gpus.push(g);
        let mut l = proto::Lease::new();
        l.container_id = "c1".into();
        l.memory_limit_bytes = 4 << 30;
        l.cuda_processes = 2;
        l.admitted_pids = vec![41, 42];
        l.refusals = 1;
        l.last_refusal =
            "pid 43: CUDA process 43: the container already runs 2 of its 2 CUDA processes".into();
        s.leases.push(l);
        s.config_note = "/etc/gpu-mps/config.toml has changed".into();
        let view = StatusView::from(&s);
        let t = view.leases_table();
        assert!(t.contains("2/2") && t.contains("1 (last: pid 43"), "{t}");
        assert!(
            view.summary()
                .contains("WARNING: /etc/gpu-mps/config.toml has changed")
        );
        let text = serde_json::to_string(&view).unwrap();
        assert_eq!(serde_json::from_str::<StatusView>(&text).unwrap(), view);
        // A key the CLI no longer writes is an error, not a silent default.
        let mut json = serde_json::to_value(&view).unwrap();
        json["leases"][0]
            .as_object_mut()
            .unwrap()
            .remove("memory_limit_bytes");
        assert!(serde_json::from_value::<StatusView>(json).is_err());
    }
}
