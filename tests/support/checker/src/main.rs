//! gpu-mps-checker: a static binary run INSIDE test containers. Each subcommand prints exactly
//! one JSON object on one line to stdout (errors go into that object or to stderr); the types of
//! the lines are the library's (lib.rs).
//!
//!   report [--hold-seconds N]       what the container sees (see report.rs); with N, it then
//!                                   stays up, so that the container still runs (and holds its
//!                                   lease) while a test looks at it
//!   pid                             {"pid": getpid()}
//!   mps-client [--hold-seconds N]   fake CUDA client of fake-mps-control (see mps_client.rs); exit 1
//!                                   when not served, 128 + signo when SIGTERM/SIGINT cut the hold short
//!   pause                           sleep until SIGTERM or SIGINT, exit 0 (pause container)
//!   sleep <seconds>                 print, sleep, exit 0 (128 + signo when SIGTERM/SIGINT cut it short)
//!   exit <code>                     print, exit with <code>

mod mps_client;
mod report;

use std::fmt::Display;
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use gpu_mps_checker::{Exiting, Paused, Pid, Sleeping, UsageError};
use nix::errno::Errno;
use nix::sys::signal::{SigSet, Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::getpid;

const USAGE: &str = "usage: gpu-mps-checker report [--hold-seconds N] | pid | mps-client [--hold-seconds N] | pause | sleep <seconds> | exit <code>";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    match words.as_slice() {
        ["report", rest @ ..] => match hold_seconds(rest) {
            Ok(seconds) => {
                let blocked = block_stop_signals();
                emit(&report::report());
                exit_after(sleep_or_signal(blocked, seconds))
            }
            Err(e) => usage_error(&e),
        },
        ["pid"] => {
            emit(&Pid {
                pid: getpid().as_raw(),
            });
            ExitCode::SUCCESS
        }
        ["mps-client", rest @ ..] => match hold_seconds(rest) {
            Ok(seconds) => mps_client(seconds),
            Err(e) => usage_error(&e),
        },
        ["pause"] => pause(),
        ["sleep", seconds] => match seconds.parse::<f64>() {
            Ok(s) if s.is_finite() && s >= 0.0 => {
                let blocked = block_stop_signals();
                emit(&Sleeping {
                    sleep_seconds: s,
                    pid: getpid().as_raw(),
                });
                exit_after(sleep_or_signal(blocked, s))
            }
            _ => usage_error(&format!("bad seconds {seconds:?}")),
        },
        ["exit", code] => match code.parse::<i32>() {
            Ok(code) => {
                emit(&Exiting {
                    exit_code: code,
                    pid: getpid().as_raw(),
                });
                std::process::exit(code)
            }
            Err(_) => usage_error(&format!("bad exit code {code:?}")),
        },
        _ => usage_error("unknown subcommand"),
    }
}

/// Prints the one JSON line (the library's types display as their JSON). A closed stdout is
/// not worth a panic.
fn emit(line: &impl Display) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn usage_error(msg: &str) -> ExitCode {
    emit(&UsageError {
        error: format!("{msg}; {USAGE}"),
    });
    ExitCode::from(2)
}

/// The errno name of an I/O error (`EROFS`), or its text when it has none.
pub fn errno_name(e: &std::io::Error) -> String {
    e.raw_os_error()
        .map_or_else(|| e.to_string(), |n| format!("{:?}", Errno::from_raw(n)))
}

/// `--hold-seconds N` or `--hold-seconds=N`; 0 when not given.
fn hold_seconds(args: &[&str]) -> Result<f64, String> {
    let value = match args {
        [] => return Ok(0.0),
        ["--hold-seconds", v] => *v,
        [flag] if flag.starts_with("--hold-seconds=") => &flag["--hold-seconds=".len()..],
        _ => return Err(format!("bad arguments {args:?}")),
    };
    value
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s >= 0.0)
        .ok_or_else(|| format!("bad --hold-seconds {value:?}"))
}

fn mps_client(hold: f64) -> ExitCode {
    let blocked = block_stop_signals();
    let (value, ok, channel) = mps_client::connect();
    // Printed before holding, so a test can read it while the client is still connected.
    emit(&value);
    let Some(channel) = channel else {
        return if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE };
    };
    let interrupted = sleep_or_signal(blocked, hold);
    drop(channel);
    exit_after(interrupted)
}

/// Blocks SIGTERM and SIGINT (and SIGALRM, the timer of [`sleep_or_signal`]) BEFORE the JSON
/// line is printed, so that a test that signals as soon as it reads the line is never early.
/// As PID 1 of a container a signal without a handler would be ignored, and the container
/// could then only be stopped with SIGKILL.
fn block_stop_signals() -> Option<SigSet> {
    let mut signals = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGALRM] {
        signals.add(s);
    }
    signals.thread_block().ok().map(|()| signals)
}

/// Sleeps `seconds`, or less when SIGTERM or SIGINT comes first (returned).
fn sleep_or_signal(blocked: Option<SigSet>, seconds: f64) -> Option<Signal> {
    if seconds == 0.0 {
        return None;
    }
    let Some(signals) = blocked else {
        std::thread::sleep(Duration::from_secs_f64(seconds));
        return None;
    };
    // Spawned after blocking, so the timer thread has the same mask; its process-directed
    // SIGALRM reaches the sigwait below.
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs_f64(seconds));
        let _ = kill(getpid(), Signal::SIGALRM);
    });
    loop {
        match signals.wait() {
            Ok(Signal::SIGALRM) => return None,
            Ok(signal) => return Some(signal),
            Err(_) => continue,
        }
    }
}

/// 0 after the full time; 128 + signal number when cut short, as a shell reports a process
/// killed by that signal.
fn exit_after(interrupted: Option<Signal>) -> ExitCode {
    match interrupted {
        None => ExitCode::SUCCESS,
        Some(signal) => ExitCode::from(128u8.saturating_add(signal as u8)),
    }
}

/// The pause container. As PID 1 of a PID namespace a signal without a handler is dropped,
/// so the signals are blocked and taken with sigwait: the process then reacts to SIGTERM at
/// once. It also reaps children, as a pod's pause process does with a shared PID namespace.
fn pause() -> ExitCode {
    let mut signals = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGCHLD] {
        signals.add(s);
    }
    if let Err(e) = signals.thread_block() {
        eprintln!("gpu-mps-checker pause: cannot block signals: {e}");
        return ExitCode::FAILURE;
    }
    emit(&Paused {
        paused: true,
        pid: getpid().as_raw(),
    });
    loop {
        match signals.wait() {
            Ok(Signal::SIGCHLD) => reap_children(),
            Ok(_) => return ExitCode::SUCCESS,
            Err(_) => continue,
        }
    }
}

fn reap_children() {
    while let Ok(status) = waitpid(None, Some(WaitPidFlag::WNOHANG)) {
        if status == WaitStatus::StillAlive {
            break;
        }
    }
}
