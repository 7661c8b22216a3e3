//! The levels of the node, read at each scrape: daemons, leases, each GPU's memory, threads
//! and clients against its capacity, each server's clients, open gate connections. Computed
//! from the books (and the gates) when asked, never kept: nothing here can drift from them.

use std::sync::Weak;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::gauge::ConstGauge;

/// A copy of the numbers a scrape shows, taken at once.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeLevels {
    pub version: String,
    pub policy: String,
    pub tenancy: String,
    pub gpus: Vec<GpuLevels>,
    pub daemons: Vec<DaemonLevels>,
    /// Leases admitted whose daemon or gate is still being made ready.
    pub leases_pending: u64,
    /// Connections open at the node's gates now (each holds a slot of `[gate] max_connections`).
    pub gate_connections_open: u64,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuLevels {
    pub uuid: String,
    pub index: u32,
    pub name: String,
    pub memory_bytes: u64,
    /// GPU memory x overcommit: what the leases' memory limits may add up to.
    pub memory_capacity_bytes: u64,
    pub memory_allocated_bytes: u64,
    /// The thread caps of its leases added up (a cap, not a reservation: may pass 100).
    pub threads_allocated_percent: u64,
    /// The CUDA processes its leases may run (`gpu-mps.io/cuda-processes`), added up.
    pub clients_allocated: u64,
    pub clients_capacity: u64,
    pub leases: u64,
    /// It takes no new container now (its daemon failed to start, or its server faulted).
    pub unhealthy: bool,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct DaemonLevels {
    /// Its GPUs, `GPU-a` or `GPU-a+GPU-b`.
    pub daemon: String,
    /// "running" or "idle" (no lease; stopped after the idle grace).
    pub state: &'static str,
    pub leases: u64,
    /// CUDA processes that got a channel to its server through the gates and still run.
    pub clients: u64,
}

/// Where the levels come from: the manager's core.
pub trait LevelSource: Send + Sync {
    fn node_levels(&self) -> NodeLevels;
}

pub(super) struct LevelCollector {
    source: Weak<dyn LevelSource>,
}

impl LevelCollector {
    pub(super) fn new(source: Weak<dyn LevelSource>) -> Self {
        LevelCollector { source }
    }
}

impl std::fmt::Debug for LevelCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LevelCollector")
    }
}

impl Collector for LevelCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(source) = self.source.upgrade() else {
            return Ok(());
        };
        encode_levels(&source.node_levels(), &mut encoder)
    }
}

const NO_LABELS: [(&str, &str); 0] = [];

/// One gauge family: its descriptor, then one sample per label set.
fn gauges<L>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, u64)>,
) -> Result<(), std::fmt::Error>
where
    L: prometheus_client::encoding::EncodeLabelSet,
{
    // Ended with a period, as the registry ends the help of the recorded families.
    let help = format!("{help}.");
    let mut family = encoder.encode_descriptor(name, &help, None, MetricType::Gauge)?;
    for (labels, value) in samples {
        ConstGauge::new(value).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// The levels as gauge families. Pure: tested on a fixed [`NodeLevels`].
pub(super) fn encode_levels(
    levels: &NodeLevels,
    encoder: &mut DescriptorEncoder,
) -> Result<(), std::fmt::Error> {
    gauges(
        encoder,
        "gpu_mps_manager_info",
        "The manager's version and node policy; always 1",
        [(
            [
                ("version", levels.version.as_str()),
                ("policy", levels.policy.as_str()),
                ("tenancy", levels.tenancy.as_str()),
            ],
            1,
        )],
    )?;
    let gpu = |g: &GpuLevels| [("gpu", g.uuid.clone())];
    let per_gpu = |f: fn(&GpuLevels) -> u64| levels.gpus.iter().map(move |g| (gpu(g), f(g)));
    gauges(
        encoder,
        "gpu_mps_gpu_info",
        "Each GPU of the inventory, by UUID, with its index and model; always 1",
        levels.gpus.iter().map(|g| {
            (
                [
                    ("gpu", g.uuid.clone()),
                    ("index", g.index.to_string()),
                    ("name", g.name.clone()),
                ],
                1,
            )
        }),
    )?;
    gauges(
        encoder,
        "gpu_mps_gpu_memory_bytes",
        "Each GPU's memory",
        per_gpu(|g| g.memory_bytes),
    )?;
    gauges(
        encoder,
        "gpu_mps_gpu_memory_capacity_bytes",
        "What the memory limits of a GPU's leases may add up to: its memory x [limits] overcommit",
        per_gpu(|g| g.memory_capacity_bytes),
    )?;
    gauges(
        encoder,
        "gpu_mps_gpu_memory_allocated_bytes",
        "The memory limits of a GPU's leases, added up",
        per_gpu(|g| g.memory_allocated_bytes),
    )?;
    gauges(
        encoder,
        "gpu_mps_gpu_threads_allocated_percent",
        "The active thread percentages of a GPU's leases, added up (caps, not reservations: may pass 100)",
        per_gpu(|g| g.threads_allocated_percent),
    )?;
    gauges(
        encoder,
        "gpu_mps_gpu_clients_allocated",
        "The CUDA processes a GPU's leases may run (gpu-mps.io/cuda-processes), added up",
        per_gpu(|g| g.clients_allocated),
    )?;
    gauges(
        encoder,
        "gpu_mps_gpu_clients_capacity",
        "The CUDA processes a GPU may serve ([limits] max_clients_per_gpu)",
        per_gpu(|g| g.clients_capacity),
    )?;
    gauges(
        encoder,
        "gpu_mps_gpu_leases",
        "Leases on a GPU (a lease on a set of GPUs counts on each)",
        per_gpu(|g| g.leases),
    )?;
    gauges(
        encoder,
        "gpu_mps_gpu_unhealthy",
        "1 while a GPU takes no new container (its daemon failed to start, or its server faulted), else 0",
        per_gpu(|g| u64::from(g.unhealthy)),
    )?;
    let mut by_state = [("running", 0u64), ("idle", 0u64)];
    for d in &levels.daemons {
        if let Some(count) = by_state.iter_mut().find(|(s, _)| *s == d.state) {
            count.1 += 1;
        }
    }
    gauges(
        encoder,
        "gpu_mps_daemons",
        "MPS control daemons the manager runs, by state: running (with leases) or idle (stopped after [daemon] idle_grace_seconds)",
        by_state.map(|(state, count)| ([("state", state)], count)),
    )?;
    gauges(
        encoder,
        "gpu_mps_leases",
        "Leases recorded, by daemon",
        levels
            .daemons
            .iter()
            .map(|d| ([("daemon", d.daemon.as_str())], d.leases)),
    )?;
    gauges(
        encoder,
        "gpu_mps_leases_pending",
        "Leases admitted whose daemon or gate is still being made ready",
        [(NO_LABELS, levels.leases_pending)],
    )?;
    gauges(
        encoder,
        "gpu_mps_server_clients",
        "CUDA processes that got a channel to a daemon's server through their gates and still run",
        levels
            .daemons
            .iter()
            .map(|d| ([("daemon", d.daemon.as_str())], d.clients)),
    )?;
    gauges(
        encoder,
        "gpu_mps_gate_connections_open",
        "Connections open at the node's gates now, each holding one of [gate] max_connections",
        [(NO_LABELS, levels.gate_connections_open)],
    )
}
