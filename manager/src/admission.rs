//! Whether a container may have a lease on its GPUs: the limit policy, the tenancy and the
//! capacity check. Pure: it looks at the inventory and the live leases and decides.

use gpu_mps_api::inventory::GpuInfo;
use gpu_mps_api::node_config::{LimitPolicy, NodeConfig, Tenancy};
use gpu_mps_api::quantity::format_bytes;
use gpu_mps_api::{ContainerRequest, DaemonKey, Limits};
use thiserror::Error;

use crate::lease::LeaseRecord;

/// The part of the node config admission depends on.
#[derive(Debug, Clone, PartialEq)]
pub struct AdmissionPolicy {
    pub policy: LimitPolicy,
    pub tenancy: Tenancy,
    pub ceiling: Option<Limits>,
    pub overcommit: f64,
    pub max_clients_per_gpu: u32,
    pub allow_overlapping_gpu_sets: bool,
}

impl From<&NodeConfig> for AdmissionPolicy {
    fn from(c: &NodeConfig) -> Self {
        AdmissionPolicy {
            policy: c.limits.policy,
            tenancy: c.limits.tenancy,
            ceiling: c.limits.ceiling,
            overcommit: c.limits.overcommit,
            max_clients_per_gpu: c.limits.max_clients_per_gpu,
            allow_overlapping_gpu_sets: c.limits.allow_overlapping_gpu_sets,
        }
    }
}

/// Why a lease is refused. Each message is one line a user sees in `kubectl describe pod`.
#[derive(Debug, Clone, Error, PartialEq)]
pub enum Refusal {
    #[error("GPU {0} is not in gpu-mps-manager's inventory of this node")]
    UnknownGpu(String),
    #[error("GPU {0} has MIG enabled; gpu-mps does not run MPS on MIG-enabled GPUs")]
    MigEnabled(String),
    #[error(
        "GPU {gpu} serves limit class {current} ({leases} container(s)) under policy uniform; this container asks {requested}: it starts once that class has left the GPU (or ask for {current})"
    )]
    ClassBusy {
        gpu: String,
        current: Limits,
        leases: usize,
        requested: Limits,
    },
    #[error(
        "this container asks {requested}, above the node ceiling {ceiling} of policy ceiling (limits.ceiling_* in the gpu-mps node config)"
    )]
    AboveCeiling { requested: Limits, ceiling: Limits },
    #[error(
        "GPU {gpu} is in use by namespace {holder:?} and tenancy is exclusive; namespace {requested:?} can use it once it is free"
    )]
    TenantBusy {
        gpu: String,
        holder: String,
        requested: String,
    },
    #[error(
        "GPUs {requested} would add a second MPS server on GPU {gpu}, which daemon {other} already serves (servers on one GPU time-slice); wait for it to go idle, or set limits.allow_overlapping_gpu_sets = true"
    )]
    OverlappingGpuSet {
        requested: DaemonKey,
        gpu: String,
        other: DaemonKey,
    },
    #[error(
        "GPU {gpu} has {reserved} of {capacity} memory reserved by {leases} container(s); this container asks {requested} more (capacity = GPU memory x overcommit {overcommit})"
    )]
    MemoryCapacity {
        gpu: String,
        reserved: String,
        capacity: String,
        leases: usize,
        requested: String,
        overcommit: f64,
    },
    #[error(
        "gpu-mps.io/memory unit {unit} of GPU {gpu} is held by container {holder} ({owner}), which is still running: the device plugin handed it out twice (is kubelet's device checkpoint lost?)"
    )]
    UnitHeld {
        gpu: String,
        unit: u32,
        holder: String,
        owner: String,
    },
    #[error(
        "GPU {gpu} already serves {used} CUDA processes of {max} allowed per GPU (limits.max_clients_per_gpu; MPS serves 48); this container asks for {requested} more (gpu-mps.io/cuda-processes)"
    )]
    ClientCapacity {
        gpu: String,
        used: u32,
        max: u32,
        requested: u32,
    },
}

impl Refusal {
    /// Its `reason` label in the metrics (crate::metrics::LEASE_REFUSAL_REASONS).
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::UnknownGpu(_) => "unknown_gpu",
            Refusal::MigEnabled(_) => "mig_enabled",
            Refusal::ClassBusy { .. } => "class_busy",
            Refusal::AboveCeiling { .. } => "above_ceiling",
            Refusal::TenantBusy { .. } => "tenant_busy",
            Refusal::OverlappingGpuSet { .. } => "overlapping_gpu_set",
            Refusal::MemoryCapacity { .. } => "memory_capacity",
            Refusal::UnitHeld { .. } => "unit_held",
            Refusal::ClientCapacity { .. } => "client_capacity",
        }
    }

    /// The ttrpc status code the hook and the CLI get.
    pub fn code(&self) -> ttrpc::Code {
        match self {
            Refusal::UnknownGpu(_) | Refusal::MigEnabled(_) | Refusal::AboveCeiling { .. } => {
                ttrpc::Code::INVALID_ARGUMENT
            }
            Refusal::ClassBusy { .. } | Refusal::TenantBusy { .. } | Refusal::OverlappingGpuSet { .. } => {
                ttrpc::Code::FAILED_PRECONDITION
            }
            Refusal::MemoryCapacity { .. } | Refusal::ClientCapacity { .. } | Refusal::UnitHeld { .. } => {
                ttrpc::Code::RESOURCE_EXHAUSTED
            }
        }
    }
}

/// Decides a lease request against the live leases. Returns the limits the daemon's server
/// must enforce for it (see [`server_limits`]).
pub fn admit<'a>(
    gpus: &[GpuInfo],
    leases: impl IntoIterator<Item = &'a LeaseRecord> + Clone,
    request: &ContainerRequest,
    policy: &AdmissionPolicy,
) -> Result<Option<Limits>, Refusal> {
    let mut targets = Vec::new();
    for uuid in request.key.gpu_uuids() {
        let gpu = gpus
            .iter()
            .find(|g| &g.uuid == uuid)
            .ok_or_else(|| Refusal::UnknownGpu(uuid.clone()))?;
        if gpu.mig_enabled {
            return Err(Refusal::MigEnabled(uuid.clone()));
        }
        targets.push(gpu);
    }

    match policy.policy {
        LimitPolicy::Uniform => {
            let same_daemon: Vec<&LeaseRecord> = leases
                .clone()
                .into_iter()
                .filter(|l| l.request.key == request.key)
                .collect();
            // A class is what each process gets: the server holds one for all.
            if let Some(other) = same_daemon
                .iter()
                .find(|l| l.request.per_process() != request.per_process())
            {
                return Err(Refusal::ClassBusy {
                    gpu: request.key.to_string(),
                    current: other.request.per_process(),
                    leases: same_daemon.len(),
                    requested: request.per_process(),
                });
            }
        }
        LimitPolicy::Ceiling => {
            let ceiling = ceiling_of(policy);
            let each = request.per_process();
            if each.memory_bytes > ceiling.memory_bytes || each.thread_percentage > ceiling.thread_percentage
            {
                return Err(Refusal::AboveCeiling {
                    requested: each,
                    ceiling,
                });
            }
        }
        // Any mix of limits: each client is held to its own by the connect gate.
        LimitPolicy::Exact => {}
    }
    let server_limits = server_limits(policy, request);

    for gpu in targets {
        let on_gpu: Vec<&LeaseRecord> = leases
            .clone()
            .into_iter()
            .filter(|l| l.request.key.contains(&gpu.uuid))
            .collect();
        if !policy.allow_overlapping_gpu_sets {
            if let Some(other) = on_gpu.iter().find(|l| l.request.key != request.key) {
                return Err(Refusal::OverlappingGpuSet {
                    requested: request.key.clone(),
                    gpu: gpu.uuid.clone(),
                    other: other.request.key.clone(),
                });
            }
        }
        if policy.tenancy == Tenancy::Exclusive {
            if let Some(other) = on_gpu
                .iter()
                .find(|l| l.request.identity.namespace != request.identity.namespace)
            {
                return Err(Refusal::TenantBusy {
                    gpu: gpu.uuid.clone(),
                    holder: other.request.identity.namespace.clone(),
                    requested: request.identity.namespace.clone(),
                });
            }
        }
        if let Some((holder, unit)) = on_gpu.iter().find_map(|l| {
            request
                .memory_units
                .iter()
                .find(|u| l.request.memory_units.contains(u))
                .map(|u| (l, *u))
        }) {
            return Err(Refusal::UnitHeld {
                gpu: gpu.uuid.clone(),
                unit,
                holder: holder.container_id.clone(),
                owner: holder.owner(),
            });
        }
        // Every CUDA process is one MPS client.
        let used: u32 = on_gpu.iter().map(|l| l.request.cuda_processes.max(1)).sum();
        if used.saturating_add(request.cuda_processes.max(1)) > policy.max_clients_per_gpu {
            return Err(Refusal::ClientCapacity {
                gpu: gpu.uuid.clone(),
                used,
                max: policy.max_clients_per_gpu,
                requested: request.cuda_processes.max(1),
            });
        }
        let capacity = memory_capacity(gpu.memory_bytes, policy.overcommit);
        let reserved: u64 = on_gpu
            .iter()
            .map(|l| l.request.limits.effective_memory_bytes())
            .sum();
        if reserved.saturating_add(request.limits.effective_memory_bytes()) > capacity {
            return Err(Refusal::MemoryCapacity {
                gpu: gpu.uuid.clone(),
                reserved: format_bytes(reserved),
                capacity: format_bytes(capacity),
                leases: on_gpu.len(),
                requested: format_bytes(request.limits.effective_memory_bytes()),
                overcommit: policy.overcommit,
            });
        }
    }
    Ok(server_limits)
}

/// What a daemon's servers are set to for `request`'s lease and every other of its class:
/// each process's limits under `uniform` (one class per daemon), the node ceiling under
/// `ceiling`. `None` under `exact`: the connect gate sets each client's own limits just before
/// it connects, and nothing else may change them in between (crate::gate).
pub fn server_limits(policy: &AdmissionPolicy, request: &ContainerRequest) -> Option<Limits> {
    match policy.policy {
        LimitPolicy::Uniform => Some(request.per_process()),
        LimitPolicy::Ceiling => Some(ceiling_of(policy)),
        LimitPolicy::Exact => None,
    }
}

/// The limits the server must hold when one of `request`'s processes connects: the servers'
/// own where the policy sets them ([`server_limits`]), else (`exact`) each process's share.
/// The one place that says it, for the gate and for the daemon's start.
pub fn server_class(policy: &AdmissionPolicy, request: &ContainerRequest) -> Limits {
    server_limits(policy, request).unwrap_or_else(|| request.per_process())
}

fn ceiling_of(policy: &AdmissionPolicy) -> Limits {
    // NodeConfig refuses policy = ceiling without a ceiling; a default keeps this total.
    policy.ceiling.unwrap_or(Limits {
        memory_bytes: u64::MAX,
        thread_percentage: 100,
    })
}

pub use gpu_mps_api::memory_units::memory_capacity;

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn gpu(index: u32) -> GpuInfo {
        GpuInfo {
            index,
            minor: index,
            uuid: format!("GPU-{index}"),
            name: "test".into(),
            memory_bytes: 16 * GIB,
            compute_mode: "Default".into(),
            mig_enabled: false,
        }
    }

    fn limits(gib: u64, pct: u8) -> Limits {
        Limits {
            memory_bytes: gib * GIB,
            thread_percentage: pct,
        }
    }

    fn lease(id: &str, gpus: &[&str], l: Limits, ns: &str) -> LeaseRecord {
        LeaseRecord::for_test(id, DaemonKey::new(gpus.iter().copied()), l, ns)
    }

    fn request(gpus: &[&str], l: Limits, ns: &str) -> ContainerRequest {
        ContainerRequest::for_test(gpus, l, ns)
    }

    fn policy(p: LimitPolicy) -> AdmissionPolicy {
        AdmissionPolicy {
            policy: p,
            tenancy: Tenancy::Shared,
            ceiling: Some(limits(8, 50)),
            overcommit: 1.0,
            max_clients_per_gpu: 48,
            allow_overlapping_gpu_sets: false,
        }
    }

    #[test]
    fn uniform_admits_the_same_class_and_refuses_another() {
        let gpus = [gpu(0)];
        let leases = [lease("a", &["GPU-0"], limits(4, 25), "ns")];
        let p = policy(LimitPolicy::Uniform);
        assert_eq!(
            admit(&gpus, &leases, &request(&["GPU-0"], limits(4, 25), "ns"), &p),
            Ok(Some(limits(4, 25)))
        );
        let refusal = admit(&gpus, &leases, &request(&["GPU-0"], limits(8, 50), "ns"), &p).unwrap_err();
        assert_eq!(refusal.code(), ttrpc::Code::FAILED_PRECONDITION);
        let msg = refusal.to_string();
        assert!(
            msg.contains("GPU-0") && msg.contains("4Gi/25%") && msg.contains("8Gi/50%"),
            "{msg}"
        );
        // Once the GPU is free, any class may take it.
        assert_eq!(
            admit(&gpus, &[], &request(&["GPU-0"], limits(8, 50), "ns"), &p),
            Ok(Some(limits(8, 50)))
        );
    }

    #[test]
    fn exact_mixes_any_sizes_and_leaves_the_limits_to_the_gate() {
        let gpus = [gpu(0)];
        let leases = [lease("a", &["GPU-0"], limits(4, 25), "ns")];
        let p = policy(LimitPolicy::Exact);
        for other in [limits(8, 50), limits(2, 100), limits(4, 25)] {
            assert_eq!(
                admit(&gpus, &leases, &request(&["GPU-0"], other, "ns"), &p),
                Ok(None)
            );
        }
        // Capacity still counts each container's own memory: 4 + 13 > 16 GiB.
        let refusal = admit(&gpus, &leases, &request(&["GPU-0"], limits(13, 10), "ns"), &p).unwrap_err();
        assert!(matches!(refusal, Refusal::MemoryCapacity { .. }), "{refusal}");
    }

    #[test]
    fn ceiling_mixes_sizes_under_the_ceiling() {
        let gpus = [gpu(0)];
        let leases = [lease("a", &["GPU-0"], limits(4, 25), "ns")];
        let p = policy(LimitPolicy::Ceiling);
        assert_eq!(
            admit(&gpus, &leases, &request(&["GPU-0"], limits(8, 50), "ns"), &p),
            Ok(Some(limits(8, 50)))
        );
        let refusal = admit(&gpus, &leases, &request(&["GPU-0"], limits(8, 75), "ns"), &p).unwrap_err();
        assert!(matches!(refusal, Refusal::AboveCeiling { .. }));
        assert_eq!(refusal.code(), ttrpc::Code::INVALID_ARGUMENT);
    }

    #[test]
    fn exclusive_tenancy_keeps_one_namespace_per_gpu() {
        let gpus = [gpu(0), gpu(1)];
        let leases = [lease("a", &["GPU-0"], limits(4, 25), "team-a")];
        let mut p = policy(LimitPolicy::Uniform);
        p.tenancy = Tenancy::Exclusive;
        let refusal = admit(&gpus, &leases, &request(&["GPU-0"], limits(4, 25), "team-b"), &p).unwrap_err();
        assert!(refusal.to_string().contains("\"team-a\""), "{refusal}");
        assert!(admit(&gpus, &leases, &request(&["GPU-1"], limits(4, 25), "team-b"), &p).is_ok());
        assert!(admit(&gpus, &leases, &request(&["GPU-0"], limits(4, 25), "team-a"), &p).is_ok());
        p.tenancy = Tenancy::Shared;
        assert!(admit(&gpus, &leases, &request(&["GPU-0"], limits(4, 25), "team-b"), &p).is_ok());
    }

    #[test]
    fn a_unit_held_by_a_live_lease_is_refused() {
        let gpus = [gpu(0)];
        let mut holder = lease("a", &["GPU-0"], limits(2, 50), "ns");
        holder.request.memory_units = vec![0, 1];
        let p = policy(LimitPolicy::Exact);
        let mut req = request(&["GPU-0"], limits(2, 50), "ns");
        req.memory_units = vec![1, 2];
        let refusal = admit(&gpus, [&holder], &req, &p).unwrap_err();
        assert_eq!(refusal.code(), ttrpc::Code::RESOURCE_EXHAUSTED);
        let msg = refusal.to_string();
        assert!(
            msg.contains("unit 1 of GPU GPU-0 is held by container a"),
            "{msg}"
        );
        req.memory_units = vec![2, 3];
        assert!(admit(&gpus, [&holder], &req, &p).is_ok());
        // Leases without units (no device plugin) never clash.
        req.memory_units = Vec::new();
        assert!(admit(&gpus, [&holder], &req, &p).is_ok());
    }

    #[test]
    fn memory_capacity_counts_every_lease_on_the_gpu() {
        let gpus = [gpu(0)];
        let leases = [
            lease("a", &["GPU-0"], limits(8, 50), "ns"),
            lease("b", &["GPU-0"], limits(4, 50), "ns"),
        ];
        let p = policy(LimitPolicy::Ceiling);
        assert!(admit(&gpus, &leases, &request(&["GPU-0"], limits(4, 50), "ns"), &p).is_ok());
        let refusal = admit(&gpus, &leases, &request(&["GPU-0"], limits(5, 50), "ns"), &p).unwrap_err();
        assert_eq!(refusal.code(), ttrpc::Code::RESOURCE_EXHAUSTED);
        let msg = refusal.to_string();
        assert!(msg.contains("12Gi of 16Gi") && msg.contains("5Gi"), "{msg}");
        let mut generous = p.clone();
        generous.overcommit = 1.5;
        assert!(
            admit(
                &gpus,
                &leases,
                &request(&["GPU-0"], limits(5, 50), "ns"),
                &generous
            )
            .is_ok()
        );
    }

    #[test]
    fn at_most_max_clients() {
        let gpus = [gpu(0)];
        let l = Limits {
            memory_bytes: 64 << 20,
            thread_percentage: 2,
        };
        let leases: Vec<_> = (0..48)
            .map(|i| lease(&format!("c{i}"), &["GPU-0"], l, "ns"))
            .collect();
        let refusal = admit(
            &gpus,
            &leases,
            &request(&["GPU-0"], l, "ns"),
            &policy(LimitPolicy::Uniform),
        )
        .unwrap_err();
        assert!(matches!(
            refusal,
            Refusal::ClientCapacity {
                max: 48,
                used: 48,
                ..
            }
        ));
        assert!(
            admit(
                &gpus,
                &leases[..47],
                &request(&["GPU-0"], l, "ns"),
                &policy(LimitPolicy::Uniform)
            )
            .is_ok()
        );
    }

    #[test]
    fn every_cuda_process_counts_against_the_clients_of_a_gpu() {
        let gpus = [gpu(0)];
        let l = limits(1, 2);
        let mut big = lease("big", &["GPU-0"], l, "ns");
        big.request.cuda_processes = 40;
        let leases = [big];
        let p = policy(LimitPolicy::Exact);
        let mut eight = request(&["GPU-0"], l, "ns");
        eight.cuda_processes = 8;
        assert!(admit(&gpus, &leases, &eight, &p).is_ok(), "40 + 8 = 48");
        eight.cuda_processes = 9;
        let refusal = admit(&gpus, &leases, &eight, &p).unwrap_err();
        assert_eq!(
            refusal,
            Refusal::ClientCapacity {
                gpu: "GPU-0".into(),
                used: 40,
                max: 48,
                requested: 9
            }
        );
        assert!(refusal.to_string().contains("cuda-processes"), "{refusal}");
    }

    #[test]
    fn classes_and_ceilings_are_per_process() {
        let gpus = [gpu(0)];
        // 8Gi in 2 processes is 4Gi/25% each: the same class as a 4Gi/25% container.
        let mut two = request(&["GPU-0"], limits(8, 25), "ns");
        two.cuda_processes = 2;
        let leases = [lease("a", &["GPU-0"], limits(4, 25), "ns")];
        assert_eq!(
            admit(&gpus, &leases, &two, &policy(LimitPolicy::Uniform)),
            Ok(Some(limits(4, 25)))
        );
        // 16Gi in 2 processes is 8Gi each: within the 8Gi/50% ceiling.
        let mut big = request(&["GPU-0"], limits(16, 50), "ns");
        big.cuda_processes = 2;
        assert!(admit(&gpus, &[], &big, &policy(LimitPolicy::Ceiling)).is_ok());
        big.cuda_processes = 1;
        assert!(admit(&gpus, &[], &big, &policy(LimitPolicy::Ceiling)).is_err());
    }

    #[test]
    fn overlapping_gpu_sets_are_refused_unless_allowed() {
        let gpus = [gpu(0), gpu(1)];
        let leases = [lease("a", &["GPU-0"], limits(4, 25), "ns")];
        let mut p = policy(LimitPolicy::Uniform);
        let refusal = admit(
            &gpus,
            &leases,
            &request(&["GPU-0", "GPU-1"], limits(4, 25), "ns"),
            &p,
        )
        .unwrap_err();
        assert!(matches!(refusal, Refusal::OverlappingGpuSet { .. }), "{refusal}");
        p.allow_overlapping_gpu_sets = true;
        assert!(
            admit(
                &gpus,
                &leases,
                &request(&["GPU-0", "GPU-1"], limits(4, 25), "ns"),
                &p
            )
            .is_ok()
        );
    }

    #[test]
    fn unknown_and_mig_gpus_are_refused() {
        let mut g = gpu(0);
        let p = policy(LimitPolicy::Uniform);
        assert!(matches!(
            admit(&[g.clone()], &[], &request(&["GPU-9"], limits(4, 25), "ns"), &p),
            Err(Refusal::UnknownGpu(_))
        ));
        g.mig_enabled = true;
        assert!(matches!(
            admit(&[g], &[], &request(&["GPU-0"], limits(4, 25), "ns"), &p),
            Err(Refusal::MigEnabled(_))
        ));
    }

    #[test]
    fn capacity_is_whole_mib() {
        assert_eq!(memory_capacity(16 * GIB, 1.0), 16 * GIB);
        assert_eq!(memory_capacity(16 * GIB, 1.5), 24 * GIB);
        assert_eq!(memory_capacity(143_771 << 20, 1.0), 143_771 << 20);
    }
}
