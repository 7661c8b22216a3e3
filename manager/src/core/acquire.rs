//! Acquire: admission in the books, the daemon made ready in its turn, the gate opened, the
//! lease recorded. Two Acquires on different daemons never wait for each other.

use gpu_mps_api::{ContainerId, ContainerRequest, Limits, proto};
use tracing::{error, info, warn};

use super::{Books, ManagerCore, ManagerError, now_unix};
use crate::admission;
use crate::daemon_life::Event;
use crate::lease::LeaseRecord;
use crate::metrics::AcquireOutcome;
use crate::process_identity::ProcessIdentity;

/// What the books say about an Acquire before any daemon is touched.
enum Reservation {
    /// The container holds this lease already (a retried hook): answered as it is.
    Held(proto::AcquireResponse),
    /// Admitted and counted as pending; its daemon must be made ready.
    Admitted {
        lease: Box<LeaseRecord>,
        server_limits: Option<Limits>,
    },
}

impl ManagerCore {
    /// Leases the container's daemon: admission, daemon start on demand, limits set and read
    /// back, lease recorded. Idempotent per container id.
    pub async fn acquire(&self, req: proto::AcquireRequest) -> Result<proto::AcquireResponse, ManagerError> {
        let started = std::time::Instant::now();
        let result = self.lease(req, started).await;
        let outcome = match &result {
            Ok(_) => AcquireOutcome::Acquired,
            Err(e) => e.acquire_outcome(),
        };
        self.metrics.acquire_finished(started.elapsed(), outcome);
        result
    }

    async fn lease(
        &self,
        req: proto::AcquireRequest,
        started: std::time::Instant,
    ) -> Result<proto::AcquireResponse, ManagerError> {
        let request = validate(&req)?;
        self.check_layout(&req)?;
        let (maxima, scope) = self.config.limits.maxima_for(&req.namespace);
        let maxima = if req.memory_units.is_empty() {
            maxima
        } else {
            maxima.for_allocated_units()
        };
        maxima
            .check(request.limits, request.cuda_processes, &scope)
            .map_err(|e| {
                warn!(container = %req.container_id, namespace = %req.namespace, pod = %req.pod, limits = %request.limits, cuda_processes = request.cuda_processes, refusal = %e, "lease refused");
                ManagerError::InvalidRequest(e.to_string())
            })?;
        // Under every policy a container reaches MPS only through its gate (docs/adr/0006).
        let gate_id =
            ContainerId::parse(&req.container_id).map_err(|e| ManagerError::InvalidRequest(e.to_string()))?;
        // The hook runs while the container's init process waits in runc: if it is gone, the
        // container is, and a lease without a live process could never be cleaned up.
        let process = ProcessIdentity::of(req.pid).ok_or_else(|| {
            ManagerError::InvalidRequest(format!(
                "container {} has no running process (pid {})",
                req.container_id, req.pid
            ))
        })?;
        let (lease, server_limits) = match self.reserve(&req, &request, process, &gate_id)? {
            Reservation::Held(response) => return Ok(response),
            Reservation::Admitted { lease, server_limits } => (lease, server_limits),
        };
        let ready = self.make_ready(&lease, server_limits, &gate_id).await;
        let response = self.record(&lease, &gate_id, ready)?;
        let server_limits = server_limits.map_or_else(|| "per client (gate)".to_string(), |l| l.to_string());
        info!(container = %req.container_id, namespace = %req.namespace, pod = %req.pod, gpus = %request.key, limits = %request.limits, cuda_processes = request.cuda_processes, server_limits = %server_limits, elapsed_us = started.elapsed().as_micros() as u64, "lease acquired");
        Ok(response)
    }

    /// In the books: answers a held lease again, drops leases whose container is gone and
    /// that stand in the way, admits the request against every lease recorded or pending, and
    /// counts it as pending.
    fn reserve(
        &self,
        req: &proto::AcquireRequest,
        request: &ContainerRequest,
        process: ProcessIdentity,
        gate_id: &ContainerId,
    ) -> Result<Reservation, ManagerError> {
        let mut books = self.books();
        if books.pending.contains_key(&req.container_id) {
            return Err(ManagerError::InProgress(format!(
                "container {} is already being given its lease (its daemon is starting); try again",
                req.container_id
            )));
        }
        if let Some(existing) = books.leases.get(&req.container_id).cloned() {
            let same_process = existing.process.is_none() || existing.process == Some(process);
            if same_process && existing.request.same_lease_as(request) {
                let response = self.response_for(&books, &existing);
                // Outside the books: opening asks the gate keeper to hold the socket.
                drop(books);
                if !self.gates.is_open(gate_id) {
                    self.gates.open(self.gate_target(gate_id, &existing), None)?;
                }
                return Ok(Reservation::Held(response));
            }
            if same_process || existing.container_alive() {
                return Err(ManagerError::InvalidRequest(format!(
                    "container {} already holds a lease on {} with {} (pid {})",
                    req.container_id,
                    existing.request.key,
                    existing.request.limits,
                    existing.process.map_or(0, |p| p.pid)
                )));
            }
            // The id was reused by a new container (its old process is gone, its release was
            // missed): the old lease goes.
            warn!(container = %req.container_id, old_pid = existing.process.map_or(0, |p| p.pid), new_pid = req.pid, "a new container reuses the id of a lease whose process is gone; the old lease is dropped");
            books.leases.remove(&req.container_id);
            books.mark_idle_if_unused(&existing.request.key);
        }
        // kubelet hands out units once their pod has ended, which can be before the manager has
        // dropped the lease of its container (release grace, a missed poststop): a holder whose
        // process is gone gives its units up now rather than get the new container refused.
        let gone_holders: Vec<LeaseRecord> = books
            .leases
            .values()
            .filter(|l| {
                l.request.key == request.key
                    && request
                        .memory_units
                        .iter()
                        .any(|u| l.request.memory_units.contains(u))
                    && !l.container_alive()
            })
            .cloned()
            .collect();
        for gone in gone_holders {
            warn!(container = %gone.container_id, new_container = %req.container_id, "the units of a lease whose container is gone are given to a new container; the old lease is dropped");
            books.leases.remove(&gone.container_id);
            books.mark_idle_if_unused(&gone.request.key);
        }
        let live = books.leases.values().chain(books.pending.values());
        let server_limits = admission::admit(&self.inventory.gpus, live, request, &self.policy)
            .inspect_err(|refusal| {
                warn!(container = %req.container_id, namespace = %req.namespace, pod = %req.pod, gpus = %request.key, limits = %request.limits, %refusal, "lease refused")
            })?;
        let lease = LeaseRecord {
            container_id: req.container_id.clone(),
            request: request.clone(),
            bundle: req.bundle.clone(),
            process: Some(process),
            acquired_unix: now_unix(),
            daemon_lost_unix: None,
        };
        books.pending.insert(lease.container_id.clone(), lease.clone());
        Ok(Reservation::Admitted {
            lease: Box::new(lease),
            server_limits,
        })
    }

    /// In the daemon's turn, outside the books: the daemon started if needed and its limits set;
    /// then the container's gate opened. A daemon that cannot start makes its GPUs unhealthy
    /// (`gpu-mps status`, the device plugin) until one starts.
    async fn make_ready(
        &self,
        lease: &LeaseRecord,
        server_limits: Option<Limits>,
        gate_id: &ContainerId,
    ) -> Result<(), NotReady> {
        {
            let _turn = self.take_turn(&lease.request.key).await;
            self.ensure_daemon(&lease.request.key, server_limits)
                .await
                .map_err(NotReady::Daemon)?;
        }
        // Before the lease is recorded: a container whose gate cannot open must not start (its
        // CUDA processes would find no control socket).
        self.gates
            .open(self.gate_target(gate_id, lease), None)
            .map_err(|e| {
                error!(container = %lease.container_id, namespace = %lease.request.identity.namespace, pod = %lease.request.identity.pod, error = %e, "lease failed: cannot open the container's gate");
                NotReady::Gate(e.into())
            })
    }

    /// In the books: the pending lease becomes a recorded one, or goes, with what failed.
    fn record(
        &self,
        lease: &LeaseRecord,
        gate_id: &ContainerId,
        ready: Result<(), NotReady>,
    ) -> Result<proto::AcquireResponse, ManagerError> {
        let mut books = self.books();
        let still_pending = books.pending.remove(&lease.container_id).is_some();
        if let Err(failed) = ready {
            books.mark_idle_if_unused(&lease.request.key);
            let error = match failed {
                NotReady::Daemon(e) => {
                    books.note_start_failure(&lease.request.key, now_unix(), &e);
                    e
                }
                NotReady::Gate(e) => e,
            };
            return Err(error);
        }
        if !still_pending {
            // Released while its daemon started (the container was deleted meanwhile).
            books.mark_idle_if_unused(&lease.request.key);
            drop(books);
            self.gates.close(gate_id, &self.config.gate_dir(gate_id));
            return Err(ManagerError::InvalidRequest(format!(
                "container {} was released while its lease was being acquired",
                lease.container_id
            )));
        }
        books.daemons.of(&lease.request.key).step(Event::Serving);
        books.leases.insert(lease.container_id.clone(), lease.clone());
        if let Err(e) = books.save(&self.config.state_path()) {
            // A lease the node could forget must not run: a restart would not count it.
            books.leases.remove(&lease.container_id);
            books.mark_idle_if_unused(&lease.request.key);
            self.save_or_log(&mut books, "after a lease that could not be recorded");
            drop(books);
            self.gates.close(gate_id, &self.config.gate_dir(gate_id));
            let message = format!(
                "container {} cannot get its lease: the manager cannot record it ({e}); free space under {} on the node",
                lease.container_id,
                self.config.root.display()
            );
            error!("{message}");
            return Err(ManagerError::Unrecorded(message));
        }
        Ok(self.response_for(&books, lease))
    }

    /// Refuses a container the shim laid out under another node config than the one this
    /// manager runs with (config.toml edited, the manager not restarted).
    fn check_layout(&self, req: &proto::AcquireRequest) -> Result<(), ManagerError> {
        let policy = self.config.limits.policy.to_string();
        let changed = (!req.policy.is_empty() && req.policy != policy)
            || (!req.config_digest.is_empty() && req.config_digest != self.config_digest);
        if changed {
            let message = format!(
                "node config changed since gpu-mps-manager started: restart it (container {} was laid out for policy {} with config {}, the manager runs policy {policy} with config {} from {})",
                req.container_id,
                if req.policy.is_empty() { "?" } else { &req.policy },
                if req.config_digest.is_empty() {
                    "?"
                } else {
                    &req.config_digest
                },
                self.config_digest,
                self.config_source.display()
            );
            warn!(container = %req.container_id, "lease refused: {message}");
            return Err(ManagerError::ConfigChanged(message));
        }
        Ok(())
    }

    pub(super) fn response_for(&self, books: &Books, lease: &LeaseRecord) -> proto::AcquireResponse {
        let mut resp = proto::AcquireResponse::new();
        resp.lease = Some(super::status::lease_proto(lease)).into();
        if let Some(d) = books.daemons.get(&lease.request.key).and_then(|d| d.record()) {
            resp.daemon = Some(super::status::daemon_proto(
                d,
                books.leases_of(&lease.request.key).count(),
            ))
            .into();
        }
        resp
    }
}

/// Why a pending lease could not be recorded.
enum NotReady {
    /// Its daemon could not be started or given its limits: the GPU reports unhealthy.
    Daemon(ManagerError),
    Gate(ManagerError),
}

/// Checks what the hook sent: the container named, its request as the socket must check it.
fn validate(req: &proto::AcquireRequest) -> Result<ContainerRequest, ManagerError> {
    if req.container_id.is_empty() {
        return Err(ManagerError::InvalidRequest("container_id is empty".into()));
    }
    ContainerRequest::from_acquire_request(req).map_err(|e| ManagerError::InvalidRequest(e.to_string()))
}
