//! The manager's Prometheus metrics (docs/metrics.md), served on `[metrics] listen` when set.
//!
//! Two kinds, and neither is a second writer of the manager's state (docs/adr/0008):
//! - events, recorded where they happen through the [`Metrics`] handle: its counters,
//!   histograms and gauge are atomics that belong to the metrics alone;
//! - levels (daemons, leases, memory, threads and clients against capacity, open gate
//!   connections), read at scrape time from the books and the gates ([`node_levels`]): the books
//!   lock is taken only to copy numbers out, never across an await.
//!
//! [`Exposition`] encodes both in the format the scraper asks for; [`http`] serves it.

pub mod http;
pub mod node_levels;

use std::sync::{Arc, Weak};
use std::time::Duration;

use gpu_mps_api::DaemonKey;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

pub use node_levels::{DaemonLevels, GpuLevels, LevelSource, NodeLevels};

/// Every reason a lease can be refused, as its `reason` label ([`crate::admission::Refusal`] and
/// the request errors of Acquire). Listed so that each starts at 0 in a scrape.
pub const LEASE_REFUSAL_REASONS: &[&str] = &[
    "unknown_gpu",
    "mig_enabled",
    "class_busy",
    "above_ceiling",
    "tenant_busy",
    "overlapping_gpu_set",
    "memory_capacity",
    "unit_held",
    "client_capacity",
    "invalid_request",
    "config_changed",
    "in_progress",
];

/// Why a gate refused a connection after its request (crate::gate).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateRefusal {
    /// A UI session or anything else that is not a CUDA client's request.
    NotACudaClient,
    /// Its container left its server stuck and is refused from then on.
    Blocked,
    /// One process asked for more channels than a CUDA context takes.
    TooManyChannels,
    /// One CUDA process more than the container's `gpu-mps.io/cuda-processes`.
    OverCudaProcesses,
    /// Its server could not be reached within `[gate] queue_timeout_seconds`.
    ServerUnreachable,
}

impl GateRefusal {
    pub const ALL: [GateRefusal; 5] = [
        GateRefusal::NotACudaClient,
        GateRefusal::Blocked,
        GateRefusal::TooManyChannels,
        GateRefusal::OverCudaProcesses,
        GateRefusal::ServerUnreachable,
    ];

    pub fn label(self) -> &'static str {
        match self {
            GateRefusal::NotACudaClient => "not_a_cuda_client",
            GateRefusal::Blocked => "blocked",
            GateRefusal::TooManyChannels => "too_many_channels",
            GateRefusal::OverCudaProcesses => "over_cuda_processes",
            GateRefusal::ServerUnreachable => "server_unreachable",
        }
    }
}

/// How an Acquire ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcquireOutcome {
    Acquired,
    /// Refused for the request or the node's capacity; the reason is one of
    /// [`LEASE_REFUSAL_REASONS`].
    Refused(&'static str),
    /// The node could not serve it (a daemon that did not start, a gate that did not open...).
    Failed,
}

/// How a daemon came to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DaemonStart {
    /// The first of its GPUs' daemons that this manager knows of.
    Started,
    /// In place of one that died or was stuck.
    Restarted,
    /// One that still ran unknown to the state (state file lost, a start cut short) was kept.
    Adopted,
}

impl DaemonStart {
    fn label(self) -> &'static str {
        match self {
            DaemonStart::Started => "started",
            DaemonStart::Restarted => "restarted",
            DaemonStart::Adopted => "adopted",
        }
    }
}

/// What a server's fault was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerFault {
    /// The server logged a fatal GPU fault and tore its clients down.
    GpuFault,
    /// The server took no new client and was killed and started again.
    Stuck,
}

impl ServerFault {
    fn label(self) -> &'static str {
        match self {
            ServerFault::GpuFault => "gpu_fault",
            ServerFault::Stuck => "stuck",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

/// A daemon by its GPUs (`GPU-a` or `GPU-a+GPU-b`): one per set of GPUs, a handful per node.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DaemonLabel {
    daemon: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DaemonStartLabels {
    daemon: String,
    how: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServerFaultLabels {
    daemon: String,
    kind: &'static str,
}

/// Buckets of Acquire's duration: milliseconds when the daemon runs, a few hundred when it
/// starts (measured on the H200: 0.15-0.3 s), up to the hook's timeout (10 s by default).
fn acquire_histogram() -> Histogram {
    Histogram::new([
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ])
}

/// Buckets of a CUDA client's wait at its gate, from its request to its channel: 0.2-0.4 ms
/// when the daemon is free, 150-250 ms when the server starts for it, up to
/// `[gate] queue_timeout_seconds` (30 s by default) while its server cannot be reached.
fn admission_histogram() -> Histogram {
    Histogram::new([
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    ])
}

struct Recorded {
    acquire_seconds: Family<OutcomeLabel, Histogram>,
    lease_refusals: Family<ReasonLabel, Counter>,
    gate_admission_wait_seconds: Histogram,
    gate_refusals: Family<ReasonLabel, Counter>,
    gate_connections_waiting: Family<DaemonLabel, Gauge>,
    daemon_starts: Family<DaemonStartLabels, Counter>,
    daemon_start_failures: Family<DaemonLabel, Counter>,
    server_faults: Family<ServerFaultLabels, Counter>,
}

/// The handle through which the manager records events. Cloning shares the metrics; every
/// record is an atomic update, so any task may record without a lock of the manager's.
#[derive(Clone)]
pub struct Metrics {
    recorded: Arc<Recorded>,
}

impl Default for Metrics {
    fn default() -> Self {
        let recorded = Recorded {
            acquire_seconds: Family::new_with_constructor(acquire_histogram),
            lease_refusals: Family::default(),
            gate_admission_wait_seconds: admission_histogram(),
            gate_refusals: Family::default(),
            gate_connections_waiting: Family::default(),
            daemon_starts: Family::default(),
            daemon_start_failures: Family::default(),
            server_faults: Family::default(),
        };
        // Known label values start at 0: a rate over a series that appears only with its first
        // event misses that event.
        for outcome in ["acquired", "refused", "failed"] {
            let _ = recorded.acquire_seconds.get_or_create(&OutcomeLabel { outcome });
        }
        for &reason in LEASE_REFUSAL_REASONS {
            let _ = recorded.lease_refusals.get_or_create(&ReasonLabel { reason });
        }
        for refusal in GateRefusal::ALL {
            let _ = recorded.gate_refusals.get_or_create(&ReasonLabel {
                reason: refusal.label(),
            });
        }
        Metrics {
            recorded: Arc::new(recorded),
        }
    }
}

impl Metrics {
    /// Starts the series of a daemon the node has (one per GPU of the inventory) at 0, so that
    /// every family is in a scrape before its first event and a rate sees that event.
    pub fn know_daemon(&self, daemon: &DaemonKey) {
        let r = &self.recorded;
        let name = daemon.to_string();
        let _ = r
            .gate_connections_waiting
            .get_or_create(&DaemonLabel { daemon: name.clone() });
        let _ = r
            .daemon_start_failures
            .get_or_create(&DaemonLabel { daemon: name.clone() });
        for how in [DaemonStart::Started, DaemonStart::Restarted, DaemonStart::Adopted] {
            let _ = r.daemon_starts.get_or_create(&DaemonStartLabels {
                daemon: name.clone(),
                how: how.label(),
            });
        }
        for fault in [ServerFault::GpuFault, ServerFault::Stuck] {
            let _ = r.server_faults.get_or_create(&ServerFaultLabels {
                daemon: name.clone(),
                kind: fault.label(),
            });
        }
    }

    /// An Acquire that took `elapsed` and ended in `outcome`.
    pub fn acquire_finished(&self, elapsed: Duration, outcome: AcquireOutcome) {
        let (label, refusal) = match outcome {
            AcquireOutcome::Acquired => ("acquired", None),
            AcquireOutcome::Refused(reason) => ("refused", Some(reason)),
            AcquireOutcome::Failed => ("failed", None),
        };
        self.recorded
            .acquire_seconds
            .get_or_create(&OutcomeLabel { outcome: label })
            .observe(elapsed.as_secs_f64());
        if let Some(reason) = refusal {
            self.recorded
                .lease_refusals
                .get_or_create(&ReasonLabel { reason })
                .inc();
        }
    }

    /// A CUDA client got its channel `waited` after its request reached its gate.
    pub fn gate_admitted(&self, waited: Duration) {
        self.recorded
            .gate_admission_wait_seconds
            .observe(waited.as_secs_f64());
    }

    pub fn gate_refused(&self, refusal: GateRefusal) {
        self.recorded
            .gate_refusals
            .get_or_create(&ReasonLabel {
                reason: refusal.label(),
            })
            .inc();
    }

    /// A CUDA client's connection waits for its channel from `daemon` until the returned guard
    /// is dropped.
    pub fn gate_connection_waits(&self, daemon: &DaemonKey) -> WaitingConnection {
        let gauge = self
            .recorded
            .gate_connections_waiting
            .get_or_create(&DaemonLabel {
                daemon: daemon.to_string(),
            })
            .clone();
        gauge.inc();
        WaitingConnection { gauge }
    }

    pub fn daemon_started(&self, daemon: &DaemonKey, how: DaemonStart) {
        self.recorded
            .daemon_starts
            .get_or_create(&DaemonStartLabels {
                daemon: daemon.to_string(),
                how: how.label(),
            })
            .inc();
    }

    pub fn daemon_start_failed(&self, daemon: &DaemonKey) {
        self.recorded
            .daemon_start_failures
            .get_or_create(&DaemonLabel {
                daemon: daemon.to_string(),
            })
            .inc();
    }

    pub fn server_fault(&self, daemon: &DaemonKey, fault: ServerFault) {
        self.recorded
            .server_faults
            .get_or_create(&ServerFaultLabels {
                daemon: daemon.to_string(),
                kind: fault.label(),
            })
            .inc();
    }
}

/// A connection counted in `gpu_mps_gate_connections_waiting` while it lives.
pub struct WaitingConnection {
    gauge: Gauge,
}

impl Drop for WaitingConnection {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// The wire format of a scrape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// What Prometheus asks for first (`Accept: application/openmetrics-text`).
    OpenMetrics,
    /// The Prometheus text format 0.0.4, for every other client (curl, promtool, older scrapers).
    PrometheusText,
}

impl Format {
    /// OpenMetrics when the `Accept` header names it, else the Prometheus text format.
    pub fn from_accept(accept: Option<&str>) -> Format {
        match accept {
            Some(accept) if accept.contains("application/openmetrics-text") => Format::OpenMetrics,
            _ => Format::PrometheusText,
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::PrometheusText => prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
        }
    }
}

/// Every metric family of the manager, registered once: the recorded ones and the levels read
/// from `source` at each scrape.
pub struct Exposition {
    registry: Registry,
}

impl Exposition {
    /// `source` is weak: once the manager is gone, a scrape gets the recorded families only.
    pub fn new(metrics: &Metrics, source: Weak<dyn LevelSource>) -> Exposition {
        let r = &metrics.recorded;
        let mut registry = Registry::default();
        registry.register(
            "gpu_mps_acquire_duration_seconds",
            "Time the manager took to answer an Acquire (a container's createRuntime hook), by outcome: acquired, refused, failed",
            r.acquire_seconds.clone(),
        );
        registry.register(
            "gpu_mps_lease_refusals",
            "Acquires refused, by reason (capacity, the GPU's class or tenant, a bad request...)",
            r.lease_refusals.clone(),
        );
        registry.register(
            "gpu_mps_gate_admission_wait_seconds",
            "Time from a CUDA client's request at its container's gate to its channel from the MPS daemon",
            r.gate_admission_wait_seconds.clone(),
        );
        registry.register(
            "gpu_mps_gate_refusals",
            "Gate connections refused after their request, by reason",
            r.gate_refusals.clone(),
        );
        registry.register(
            "gpu_mps_gate_connections_waiting",
            "CUDA clients' gate connections waiting for their channel now, by daemon",
            r.gate_connections_waiting.clone(),
        );
        registry.register(
            "gpu_mps_daemon_starts",
            "MPS control daemons this manager started (how: started, restarted in place of a dead or stuck one, adopted)",
            r.daemon_starts.clone(),
        );
        registry.register(
            "gpu_mps_daemon_start_failures",
            "MPS control daemon starts that failed (the GPU reports unhealthy for a while after each)",
            r.daemon_start_failures.clone(),
        );
        registry.register(
            "gpu_mps_server_faults",
            "MPS server faults (kind: gpu_fault, a fatal fault that tore the server's clients down; stuck, a server that took no new client and was replaced)",
            r.server_faults.clone(),
        );
        registry.register_collector(Box::new(node_levels::LevelCollector::new(source)));
        Exposition { registry }
    }

    /// The text of one scrape.
    pub fn encode(&self, format: Format) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        match format {
            Format::OpenMetrics => prometheus_client::encoding::text::encode(&mut text, &self.registry)?,
            Format::PrometheusText => {
                prometheus_client::encoding::prometheus_text::encode(&mut text, &self.registry)?
            }
        }
        Ok(text)
    }
}

#[cfg(test)]
mod tests;
