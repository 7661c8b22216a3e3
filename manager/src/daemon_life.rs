//! One MPS daemon's facts in one place, and every change to them as a pure step.
//!
//! What the manager knows of a daemon, besides its leases: its process and the limits its
//! servers hold (persisted in state.json as a [`DaemonRecord`]), where its server.log was read
//! up to, its last failed start, and the turn for the slow work on it. All of it is one
//! [`Daemon`], kept by its [`DaemonKey`] in a [`DaemonBook`] for the manager's life.
//!
//! [`Daemon::step`] takes an [`Event`] (what a tick saw, a start that succeeded or failed, a
//! lease recorded or given up, a stop, a fault, a stuck server) and returns the [`Action`]s the
//! manager's I/O side must take. It reads no clock and no /proc: the caller brings what it
//! observed, so every state and transition is tested here without a process (the model is
//! shim/src/plan.rs). The states and events are tabled in docs/internals.md.
//!
//! Two pieces stay elsewhere, each with one owner: the daemon's admission queue and the limit
//! cache that decides (the owner task in gate::daemon_admission), and the stuck-server reports
//! that task files (`Gates`' report queue) until the next tick turns each into
//! [`Event::Stuck`].

use std::collections::BTreeMap;
use std::sync::Arc;

use gpu_mps_api::{DaemonKey, Limits};
use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

use crate::fault_watch::LogCursor;
use crate::gate::daemon_admission::WedgeReport;
use crate::state::DaemonRecord;

/// How long a GPU reports unhealthy after its daemon failed to start. Short: the device plugin
/// turns the GPU's units Unhealthy meanwhile, so no new container comes to retry the start, and
/// the GPU must come back by itself for the next one to try.
pub const START_FAILURE_UNHEALTHY_SECONDS: i64 = 15;

/// How long a GPU reports unhealthy after its server's last fatal fault: the server refuses new
/// clients until the faulted ones have exited, which takes the framework seconds.
pub const FAULT_UNHEALTHY_SECONDS: i64 = 30;

/// A start of the daemon that failed, when (unix seconds) and why (one line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartFailure {
    pub at_unix: i64,
    pub why: String,
}

/// Everything about one MPS daemon but its leases and its admission queue.
#[derive(Debug)]
pub struct Daemon {
    key: DaemonKey,
    /// Its process and what it was given; `None` while no process runs for it (never started,
    /// stopped when idle, dead and unused, or its start failed).
    record: Option<DaemonRecord>,
    /// Where its server.log was read up to (not persisted: a restarted manager starts at the
    /// end, the faults before were reported by the manager that saw them).
    server_log: Option<LogCursor>,
    start_failure: Option<StartFailure>,
    /// Whoever starts, stops or replaces the daemon holds it meanwhile, outside the books: an
    /// Acquire never finds the daemon half started or half stopped, and other daemons do not
    /// wait. Kept for the manager's life with the rest (one per set of GPUs ever used).
    turn: Arc<AsyncMutex<()>>,
}

/// What the I/O side observed or did, in the order it happened.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A container needs the daemon (an Acquire, in the daemon's turn): is its process alive?
    Wanted {
        alive: bool,
    },
    /// The periodic reconcile's look, in the daemon's turn or before taking it: the process,
    /// the leases recorded on the daemon and those being acquired.
    Tick {
        now: i64,
        alive: bool,
        recorded_leases: usize,
        pending_leases: usize,
        idle_grace_seconds: i64,
    },
    /// A process runs for the daemon now: started, or an orphan adopted. `server_log` is the
    /// end of its server.log at that moment.
    Started {
        record: DaemonRecord,
        server_log: LogCursor,
    },
    StartFailed(StartFailure),
    /// Its servers hold these limits now (set through its owner task and read back).
    LimitsApplied(Limits),
    /// A lease on it was recorded, or its restart for recorded leases succeeded: it serves, and
    /// its last start is good.
    Serving,
    /// Nothing uses it any more (its last lease released, dropped, or failed to be recorded).
    Unused {
        now: i64,
    },
    /// Its process quit when asked (idle, or at shutdown).
    Stopped,
    /// Asked to stop, it did not (MPS clients without a lease, a `quit` that failed): it is
    /// tried again after another grace period, not on every tick.
    StopDeclined {
        now: i64,
    },
    /// Its server.log was read from `process`'s start up to `cursor`; `faults` is how many
    /// teardown lines the read found.
    ServerLogRead {
        process: u32,
        cursor: LogCursor,
        faults: usize,
        now: i64,
    },
    /// Its server stopped taking clients (the owner task's report, or the adoption's); `alive`:
    /// its process was alive when the report was taken up.
    Stuck {
        report: WedgeReport,
        alive: bool,
        now: i64,
    },
}

/// What the manager must do after a step, in this order. (Writing the state file after a change
/// is the books' rule for every change, so it is no action here.)
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Start a process for it (or adopt an orphan that owns its pipe dir).
    Start,
    /// Its recorded leases lost their server: mark them (`daemon_lost_unix`).
    MarkLeasesLost { dead_pid: u32 },
    /// It died with nothing using it: its record went.
    Forgotten { dead_pid: u32 },
    /// Idle for the grace period: ask it to quit.
    StopIdle,
    /// Kill its servers and its process (`daemon_pid`, when it was alive), and block the
    /// suspect's container.
    ReplaceStuck {
        report: WedgeReport,
        daemon_pid: Option<u32>,
    },
    /// Its server reported a fatal GPU fault.
    ReportFault,
}

/// The daemon's state, as `gpu-mps status` and docs/internals.md name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// No process, and no failed start to report.
    Absent,
    /// No process: its last start failed.
    Failed,
    /// A process, with leases.
    Running,
    /// A process, with no lease since the time given.
    Idle(i64),
}

impl Phase {
    /// The phase of a daemon with this process record.
    pub fn of_record(record: &DaemonRecord) -> Phase {
        record.idle_since_unix.map_or(Phase::Running, Phase::Idle)
    }

    /// What `gpu-mps status` and the `gpu_mps_daemons{state}` metric call a daemon that has a
    /// process: "running" with leases, "idle" without.
    pub fn status_name(self) -> &'static str {
        match self {
            Phase::Idle(_) => "idle",
            Phase::Running => "running",
            Phase::Absent => "absent",
            Phase::Failed => "failed",
        }
    }
}

impl Daemon {
    pub fn new(key: DaemonKey) -> Self {
        Daemon {
            key,
            record: None,
            server_log: None,
            start_failure: None,
            turn: Arc::default(),
        }
    }

    pub fn key(&self) -> &DaemonKey {
        &self.key
    }

    pub fn record(&self) -> Option<&DaemonRecord> {
        self.record.as_ref()
    }

    pub fn server_log(&self) -> Option<LogCursor> {
        self.server_log
    }

    pub fn phase(&self) -> Phase {
        match (&self.record, &self.start_failure) {
            (Some(r), _) => Phase::of_record(r),
            (None, Some(_)) => Phase::Failed,
            (None, None) => Phase::Absent,
        }
    }

    /// The daemon's turn, to be awaited outside the books.
    pub fn turn(&self) -> Arc<AsyncMutex<()>> {
        self.turn.clone()
    }

    /// Applies `event` and says what the I/O side must do.
    pub fn step(&mut self, event: Event) -> Vec<Action> {
        match event {
            Event::Wanted { alive } => match (&self.record, alive) {
                (Some(_), true) => Vec::new(),
                _ => vec![Action::Start],
            },
            Event::Tick {
                now,
                alive,
                recorded_leases,
                pending_leases,
                idle_grace_seconds,
            } => self.tick(now, alive, recorded_leases, pending_leases, idle_grace_seconds),
            Event::Started {
                mut record,
                server_log,
            } => {
                // A GPU's fault count outlives the daemon process: a stuck or dead one is
                // replaced, and `gpu-mps status` must still show that it happened.
                if let Some(old) = &self.record {
                    record.faults = old.faults;
                    record.last_fault_unix = old.last_fault_unix;
                }
                // Idle until a lease is recorded: a failed limit setting leaves it to the idle
                // stop instead of leaking it.
                record.idle_since_unix = Some(record.started_unix);
                self.record = Some(record);
                self.server_log = Some(server_log);
                Vec::new()
            }
            Event::StartFailed(failure) => {
                self.start_failure = Some(failure);
                Vec::new()
            }
            Event::LimitsApplied(limits) => {
                if let Some(r) = &mut self.record {
                    r.applied = Some(limits);
                }
                Vec::new()
            }
            Event::Serving => {
                self.start_failure = None;
                if let Some(r) = &mut self.record {
                    r.idle_since_unix = None;
                }
                Vec::new()
            }
            Event::Unused { now } => {
                if let Some(r) = &mut self.record {
                    r.idle_since_unix = Some(now);
                }
                Vec::new()
            }
            Event::Stopped => {
                self.record = None;
                self.server_log = None;
                Vec::new()
            }
            Event::StopDeclined { now } => {
                if let Some(r) = &mut self.record {
                    r.idle_since_unix = Some(now);
                }
                Vec::new()
            }
            Event::ServerLogRead {
                process,
                cursor,
                faults,
                now,
            } => {
                // A daemon replaced meanwhile has its own cursor, set at its start.
                let Some(r) = self.record.as_mut().filter(|r| r.control.pid == process) else {
                    return Vec::new();
                };
                self.server_log = Some(cursor);
                if faults == 0 {
                    return Vec::new();
                }
                // MPS names every client it tears down (measured: 4 lines for one illegal memory
                // access among 4 clients) within milliseconds: the lines of one read are one fault.
                r.faults += 1;
                r.last_fault_unix = Some(now);
                vec![Action::ReportFault]
            }
            Event::Stuck { report, alive, now } => {
                let Some(r) = &mut self.record else {
                    return Vec::new();
                };
                r.faults += 1;
                r.last_fault_unix = Some(now);
                vec![Action::ReplaceStuck {
                    report,
                    // A dead daemon's pid may belong to another process by now.
                    daemon_pid: alive.then_some(r.control.pid),
                }]
            }
        }
    }

    fn tick(
        &mut self,
        now: i64,
        alive: bool,
        recorded_leases: usize,
        pending_leases: usize,
        idle_grace_seconds: i64,
    ) -> Vec<Action> {
        let Some(record) = &self.record else {
            // Leases whose daemon has no process at all: its start failed after it died.
            return if recorded_leases > 0 {
                vec![Action::Start]
            } else {
                Vec::new()
            };
        };
        let pid = record.control.pid;
        if !alive {
            if recorded_leases + pending_leases == 0 {
                self.record = None;
                self.server_log = None;
                return vec![Action::Forgotten { dead_pid: pid }];
            }
            // Running containers reach MPS through its pipe dir: without a daemon, a CUDA
            // process that starts now would open a direct context (the whole GPU) unless
            // EXCLUSIVE_PROCESS is on. An Acquire in flight starts it itself.
            return if recorded_leases > 0 {
                vec![Action::MarkLeasesLost { dead_pid: pid }, Action::Start]
            } else {
                Vec::new()
            };
        }
        let idle_long_enough = record
            .idle_since_unix
            .is_some_and(|since| now - since >= idle_grace_seconds);
        if idle_long_enough && recorded_leases + pending_leases == 0 {
            vec![Action::StopIdle]
        } else {
            Vec::new()
        }
    }

    /// Why the GPUs of this daemon cannot take new containers at `now`, if they cannot: a start
    /// that failed lately (while no process runs), or a fatal fault lately.
    pub fn unhealthy_reason(&self, now: i64, alive: bool) -> Option<String> {
        if let Some(f) = &self.start_failure {
            let running = self.record.is_some() && alive;
            if now - f.at_unix < START_FAILURE_UNHEALTHY_SECONDS && !running {
                return Some(format!(
                    "its MPS daemon could not start {}s ago: {}",
                    now - f.at_unix,
                    f.why
                ));
            }
        }
        let at = self.record.as_ref()?.last_fault_unix?;
        (now - at < FAULT_UNHEALTHY_SECONDS)
            .then(|| format!("its MPS server reported a fatal fault {}s ago", now - at))
    }
}

/// Every daemon the manager has known since it started, by key.
#[derive(Debug, Default)]
pub struct DaemonBook {
    daemons: BTreeMap<DaemonKey, Daemon>,
}

impl DaemonBook {
    /// The book of a manager that starts with these records (adopted from the last run), each
    /// with its server.log read from `server_log(record)`.
    pub fn adopted(
        records: impl IntoIterator<Item = DaemonRecord>,
        server_log: impl Fn(&DaemonRecord) -> LogCursor,
    ) -> Self {
        let daemons = records
            .into_iter()
            .map(|record| {
                let mut daemon = Daemon::new(record.key.clone());
                daemon.server_log = Some(server_log(&record));
                daemon.record = Some(record);
                (daemon.key.clone(), daemon)
            })
            .collect();
        DaemonBook { daemons }
    }

    /// The daemon of `key`, known from now on.
    pub fn of(&mut self, key: &DaemonKey) -> &mut Daemon {
        self.daemons
            .entry(key.clone())
            .or_insert_with(|| Daemon::new(key.clone()))
    }

    pub fn get(&self, key: &DaemonKey) -> Option<&Daemon> {
        self.daemons.get(key)
    }

    /// The daemons with a process (alive or not yet seen dead).
    pub fn records(&self) -> impl Iterator<Item = &DaemonRecord> {
        self.daemons.values().filter_map(Daemon::record)
    }

    pub fn all(&self) -> impl Iterator<Item = &Daemon> {
        self.daemons.values()
    }

    /// The keys of every daemon known.
    pub fn keys(&self) -> Vec<DaemonKey> {
        self.daemons.keys().cloned().collect()
    }
}

/// A held turn of a daemon; dropping it lets the next one take it.
pub type Turn = OwnedMutexGuard<()>;

#[cfg(test)]
mod tests;
