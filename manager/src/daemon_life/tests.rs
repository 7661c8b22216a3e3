//! Every state and event of a daemon, without a process (docs/internals.md's table).

use gpu_mps_api::{ContainerId, DaemonKey, Limits};

use super::*;
use crate::process_identity::ProcessIdentity;

const GRACE: i64 = 30;

fn key() -> DaemonKey {
    DaemonKey::new(["GPU-0"])
}

fn record(pid: u32, started: i64) -> DaemonRecord {
    DaemonRecord {
        key: key(),
        control: ProcessIdentity { pid, start_ticks: 7 },
        pipe_dir: "/run/gpu-mps/daemons/GPU-0/pipe".into(),
        log_dir: "/run/gpu-mps/daemons/GPU-0/log".into(),
        started_unix: started,
        applied: None,
        idle_since_unix: None,
        faults: 0,
        last_fault_unix: None,
    }
}

fn started(pid: u32, at: i64) -> Event {
    Event::Started {
        record: record(pid, at),
        server_log: LogCursor { offset: 10 },
    }
}

fn tick(now: i64, alive: bool, recorded: usize, pending: usize) -> Event {
    Event::Tick {
        now,
        alive,
        recorded_leases: recorded,
        pending_leases: pending,
        idle_grace_seconds: GRACE,
    }
}

fn report() -> WedgeReport {
    WedgeReport {
        daemon: key(),
        suspect: Some((ContainerId::parse("abc").unwrap(), 42)),
        detail: "no answer".into(),
    }
}

/// A daemon that runs for one recorded lease since `at`.
fn serving(pid: u32, at: i64) -> Daemon {
    let mut d = Daemon::new(key());
    d.step(started(pid, at));
    d.step(Event::Serving);
    d
}

#[test]
fn a_daemon_nobody_started_is_absent_and_a_container_that_wants_it_starts_it() {
    let mut d = Daemon::new(key());
    assert_eq!(d.phase(), Phase::Absent);
    assert_eq!(d.step(Event::Wanted { alive: false }), [Action::Start]);
    // Nothing was started yet: the step changed nothing.
    assert_eq!(d.phase(), Phase::Absent);
    assert_eq!(
        d.step(tick(100, false, 0, 1)),
        [],
        "an Acquire in flight starts it itself"
    );
}

#[test]
fn a_started_daemon_is_idle_until_a_lease_is_recorded_then_running() {
    let mut d = Daemon::new(key());
    assert_eq!(d.step(started(11, 100)), []);
    assert_eq!(d.phase(), Phase::Idle(100));
    assert_eq!(d.server_log(), Some(LogCursor { offset: 10 }));
    assert_eq!(d.step(Event::Wanted { alive: true }), []);
    d.step(Event::Serving);
    assert_eq!(d.phase(), Phase::Running);
    assert_eq!(
        d.step(Event::Wanted { alive: false }),
        [Action::Start],
        "its process died"
    );
}

#[test]
fn an_idle_daemon_is_stopped_only_after_the_grace_period_with_nothing_pending() {
    let mut d = serving(11, 100);
    d.step(Event::Unused { now: 200 });
    assert_eq!(d.phase(), Phase::Idle(200));
    assert_eq!(d.step(tick(200 + GRACE - 1, true, 0, 0)), []);
    assert_eq!(
        d.step(tick(200 + GRACE, true, 0, 1)),
        [],
        "an Acquire in flight keeps it"
    );
    assert_eq!(d.step(tick(200 + GRACE, true, 0, 0)), [Action::StopIdle]);
    // The step says what to do; only the stop's outcome changes the daemon.
    assert_eq!(d.phase(), Phase::Idle(200));
    assert_eq!(d.step(Event::Stopped), []);
    assert_eq!(d.phase(), Phase::Absent);
    assert_eq!(d.server_log(), None);
}

#[test]
fn a_daemon_that_declines_to_stop_waits_another_grace_period() {
    let mut d = serving(11, 100);
    d.step(Event::Unused { now: 200 });
    assert_eq!(d.step(tick(240, true, 0, 0)), [Action::StopIdle]);
    assert_eq!(d.step(Event::StopDeclined { now: 240 }), []);
    assert_eq!(d.step(tick(241, true, 0, 0)), [], "not on every tick");
    assert_eq!(d.step(tick(240 + GRACE, true, 0, 0)), [Action::StopIdle]);
}

#[test]
fn a_running_daemon_with_leases_is_never_stopped() {
    let mut d = serving(11, 100);
    assert_eq!(d.step(tick(100_000, true, 2, 0)), []);
    assert_eq!(d.phase(), Phase::Running);
}

#[test]
fn a_daemon_that_died_unused_is_forgotten() {
    let mut d = serving(11, 100);
    d.step(Event::Unused { now: 150 });
    assert_eq!(
        d.step(tick(160, false, 0, 0)),
        [Action::Forgotten { dead_pid: 11 }]
    );
    assert_eq!(d.phase(), Phase::Absent);
    assert!(d.record().is_none());
}

#[test]
fn a_daemon_that_died_under_leases_has_them_marked_and_is_started_again_with_its_history() {
    let mut d = serving(11, 100);
    d.step(Event::ServerLogRead {
        process: 11,
        cursor: LogCursor { offset: 50 },
        faults: 1,
        now: 120,
    });
    assert_eq!(
        d.step(tick(130, false, 2, 0)),
        [Action::MarkLeasesLost { dead_pid: 11 }, Action::Start]
    );
    // Dead with only an Acquire in flight: that Acquire starts it.
    assert_eq!(d.step(tick(130, false, 0, 1)), []);
    d.step(started(12, 131));
    d.step(Event::Serving);
    let r = d.record().unwrap();
    assert_eq!((r.control.pid, r.faults, r.last_fault_unix), (12, 1, Some(120)));
    assert_eq!(
        d.server_log(),
        Some(LogCursor { offset: 10 }),
        "the new process's log"
    );
}

#[test]
fn leases_whose_daemon_has_no_process_start_one_on_the_tick() {
    let mut d = Daemon::new(key());
    assert_eq!(d.step(tick(10, false, 1, 0)), [Action::Start]);
    assert_eq!(d.step(tick(10, false, 0, 0)), []);
}

#[test]
fn a_failed_start_makes_the_gpus_unhealthy_for_a_while_unless_a_daemon_runs() {
    let mut d = Daemon::new(key());
    d.step(Event::StartFailed(StartFailure {
        at_unix: 100,
        why: "no nvidia-cuda-mps-control".into(),
    }));
    assert_eq!(d.phase(), Phase::Failed);
    assert_eq!(
        d.unhealthy_reason(105, false).as_deref(),
        Some("its MPS daemon could not start 5s ago: no nvidia-cuda-mps-control")
    );
    assert_eq!(
        d.unhealthy_reason(100 + START_FAILURE_UNHEALTHY_SECONDS, false),
        None
    );
    // A daemon that runs by then (another start succeeded) makes it healthy at once, and a
    // lease recorded on it forgets the failure.
    d.step(started(11, 106));
    assert_eq!(d.unhealthy_reason(107, true), None);
    assert_eq!(
        d.unhealthy_reason(107, false)
            .map(|r| r.contains("could not start")),
        Some(true)
    );
    d.step(Event::Serving);
    assert_eq!(d.unhealthy_reason(107, false), None);
}

#[test]
fn a_fault_in_the_server_log_counts_once_per_read_and_makes_the_gpus_unhealthy() {
    let mut d = serving(11, 100);
    let read = |faults, now| Event::ServerLogRead {
        process: 11,
        cursor: LogCursor { offset: 99 },
        faults,
        now,
    };
    assert_eq!(d.step(read(0, 110)), []);
    assert_eq!(d.server_log(), Some(LogCursor { offset: 99 }));
    assert_eq!(d.step(read(4, 120)), [Action::ReportFault]);
    assert_eq!(d.record().unwrap().faults, 1, "four teardown lines are one fault");
    assert_eq!(
        d.unhealthy_reason(125, true).as_deref(),
        Some("its MPS server reported a fatal fault 5s ago")
    );
    assert_eq!(d.unhealthy_reason(120 + FAULT_UNHEALTHY_SECONDS, true), None);
}

#[test]
fn a_log_read_of_a_process_replaced_meanwhile_changes_nothing() {
    let mut d = serving(11, 100);
    d.step(started(12, 110));
    let stale = Event::ServerLogRead {
        process: 11,
        cursor: LogCursor { offset: 500 },
        faults: 3,
        now: 111,
    };
    assert_eq!(d.step(stale), []);
    assert_eq!(d.server_log(), Some(LogCursor { offset: 10 }));
    assert_eq!(d.record().unwrap().faults, 0);
}

#[test]
fn a_stuck_server_is_replaced_and_counted_and_a_dead_daemons_pid_is_never_killed() {
    let mut d = serving(11, 100);
    assert_eq!(
        d.step(Event::Stuck {
            report: report(),
            alive: true,
            now: 130
        }),
        [Action::ReplaceStuck {
            report: report(),
            daemon_pid: Some(11)
        }]
    );
    assert_eq!(d.record().unwrap().last_fault_unix, Some(130));
    let actions = d.step(Event::Stuck {
        report: report(),
        alive: false,
        now: 140,
    });
    assert_eq!(
        actions[0],
        Action::ReplaceStuck {
            report: report(),
            daemon_pid: None
        },
        "its pid may be another process's by now"
    );
    assert_eq!(d.record().unwrap().faults, 2);
    // A report about a daemon with no process (stopped meanwhile) is dropped.
    let mut gone = Daemon::new(key());
    assert_eq!(
        gone.step(Event::Stuck {
            report: report(),
            alive: false,
            now: 1
        }),
        []
    );
}

#[test]
fn the_limits_applied_are_what_status_shows() {
    let mut d = serving(11, 100);
    let limits = Limits {
        memory_bytes: 4 << 30,
        thread_percentage: 25,
    };
    d.step(Event::LimitsApplied(limits));
    assert_eq!(d.record().unwrap().applied, Some(limits));
    // Without a process there is nothing to show them on.
    let mut absent = Daemon::new(key());
    absent.step(Event::LimitsApplied(limits));
    assert!(absent.record().is_none());
}

#[test]
fn the_book_keeps_each_daemon_by_key_for_the_managers_life() {
    let mut book = DaemonBook::adopted([record(11, 100)], |_| LogCursor { offset: 3 });
    assert_eq!(book.records().count(), 1);
    assert_eq!(
        book.get(&key()).unwrap().server_log(),
        Some(LogCursor { offset: 3 })
    );
    let turn = book.of(&key()).turn();
    book.of(&key()).step(Event::Stopped);
    assert_eq!(book.records().count(), 0);
    assert_eq!(book.keys(), [key()], "its turn and facts stay");
    assert!(
        Arc::ptr_eq(&turn, &book.of(&key()).turn()),
        "one turn per daemon, ever"
    );
    let other = DaemonKey::new(["GPU-1"]);
    assert!(book.get(&other).is_none());
    book.of(&other);
    assert_eq!(book.keys().len(), 2);
}

#[test]
fn status_names_a_daemon_with_a_process_running_or_idle() {
    let mut d = serving(11, 100);
    assert_eq!(d.phase().status_name(), "running");
    d.step(Event::Unused { now: 200 });
    assert_eq!(d.phase().status_name(), "idle");
    assert_eq!(Phase::of_record(d.record().unwrap()), Phase::Idle(200));
}
