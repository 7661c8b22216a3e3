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
//!   mps-ui <command...>             one control CLI command from inside the pod (mps_ui.rs); exit 1
//!                                   when no answer came
//!   mps-stall --connections N --hold-seconds S [--read-hello]
//!                                   N silent connections held S seconds (mps_stall.rs)
//!   mps-processes --count N [--hold-seconds S]
//!                                   N mps-client processes at once (mps_processes.rs); exit 1 unless
//!                                   all were admitted
//!   mps-raw --kind K [--socket NAME] [--wait-seconds W]
//!                                   hello, credentials and kind K, unframed; what came back (mps_raw.rs)
//!   pause                           sleep until SIGTERM or SIGINT, exit 0 (pause container)
//!   sleep <seconds>                 print, sleep, exit 0 (128 + signo when SIGTERM/SIGINT cut it short)
//!   exit <code>                     print, exit with <code>

mod control_connection;
mod mps_client;
mod mps_processes;
mod mps_raw;
mod mps_stall;
mod mps_ui;
mod report;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Display;
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use gpu_mps_checker::{Exiting, Paused, Pid, Sleeping, UsageError};
use nix::errno::Errno;
use nix::sys::signal::{SigSet, Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::getpid;

const USAGE: &str = "usage: gpu-mps-checker report [--hold-seconds N] | pid | mps-client [--hold-seconds N] | mps-ui <command...> | mps-stall --connections N --hold-seconds S [--read-hello] | mps-processes --count N [--hold-seconds S] | mps-raw --kind K [--socket NAME] [--wait-seconds W] | pause | sleep <seconds> | exit <code>";

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
        ["mps-ui"] => usage_error("mps-ui needs a command"),
        ["mps-ui", command @ ..] => {
            let line = mps_ui::run(&command.join(" "));
            emit(&line);
            if line.reached_daemon {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        ["mps-stall", rest @ ..] => {
            match Flags::parse(rest, &["--connections", "--hold-seconds"], &["--read-hello"]).and_then(|f| {
                Ok((
                    f.number("--connections")?.ok_or("--connections is required")?,
                    f.seconds("--hold-seconds")?.ok_or("--hold-seconds is required")?,
                    f.switch("--read-hello"),
                ))
            }) {
                Ok((connections, hold, read_hello)) => {
                    let blocked = block_stop_signals();
                    let (line, interrupted) = mps_stall::run(connections, hold, read_hello, blocked);
                    emit(&line);
                    exit_after(interrupted)
                }
                Err(e) => usage_error(&e),
            }
        }
        ["mps-processes", rest @ ..] => match Flags::parse(rest, &["--count", "--hold-seconds"], &[])
            .and_then(|f| {
                Ok((
                    f.number("--count")?.ok_or("--count is required")?,
                    f.seconds("--hold-seconds")?.unwrap_or(0.0),
                ))
            }) {
            Ok((count, hold)) => mps_processes(count, hold),
            Err(e) => usage_error(&e),
        },
        ["mps-raw", rest @ ..] => match Flags::parse(rest, &["--kind", "--socket", "--wait-seconds"], &[])
            .and_then(|f| {
                Ok((
                    f.number("--kind")?.ok_or("--kind is required")?,
                    f.value("--socket").unwrap_or("control").to_string(),
                    f.seconds("--wait-seconds")?.unwrap_or(2.0),
                ))
            }) {
            Ok((kind, socket, wait)) => {
                emit(&mps_raw::run(kind, &socket, Duration::from_secs_f64(wait)));
                ExitCode::SUCCESS
            }
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

/// `--name value` and `--name=value` options and bare switches, each at most once.
struct Flags {
    values: BTreeMap<String, String>,
    switches: BTreeSet<String>,
}

impl Flags {
    fn parse(args: &[&str], valued: &[&str], switches: &[&str]) -> Result<Flags, String> {
        let mut flags = Flags {
            values: BTreeMap::new(),
            switches: BTreeSet::new(),
        };
        let mut args = args.iter();
        while let Some(arg) = args.next() {
            let (name, inline) = match arg.split_once('=') {
                Some((name, value)) => (name, Some(value)),
                None => (*arg, None),
            };
            if valued.contains(&name) {
                let value = match inline {
                    Some(v) => v,
                    None => args.next().ok_or(format!("{name} needs a value"))?,
                };
                if flags.values.insert(name.to_string(), value.to_string()).is_some() {
                    return Err(format!("{name} given twice"));
                }
            } else if switches.contains(&name) && inline.is_none() {
                flags.switches.insert(name.to_string());
            } else {
                return Err(format!("unknown argument {arg:?}"));
            }
        }
        Ok(flags)
    }

    fn value(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(String::as_str)
    }

    fn number(&self, name: &str) -> Result<Option<u32>, String> {
        self.value(name)
            .map(|v| v.parse().map_err(|_| format!("bad {name} {v:?}")))
            .transpose()
    }

    fn seconds(&self, name: &str) -> Result<Option<f64>, String> {
        self.value(name)
            .map(|v| {
                v.parse::<f64>()
                    .ok()
                    .filter(|s| s.is_finite() && *s >= 0.0)
                    .ok_or_else(|| format!("bad {name} {v:?}"))
            })
            .transpose()
    }

    fn switch(&self, name: &str) -> bool {
        self.switches.contains(name)
    }
}

fn mps_client(hold: f64) -> ExitCode {
    let blocked = block_stop_signals();
    let (value, channel) = mps_client::connect();
    // Printed before holding, so a test can read it while the client is still connected.
    emit(&value);
    let Some(channel) = channel else {
        return ExitCode::FAILURE;
    };
    let interrupted = sleep_or_signal(blocked, hold);
    drop(channel);
    exit_after(interrupted)
}

fn mps_processes(count: u32, hold: f64) -> ExitCode {
    // Blocked before the children start: they block their own, and a SIGTERM meant for the
    // container's PID 1 is passed on to them instead of being lost.
    let blocked = block_stop_signals();
    let started = std::time::Instant::now();
    let (line, children) = mps_processes::run(count, hold);
    let all_admitted = line.admitted == count;
    // Printed while the children still hold their channels; they let go about `hold` after
    // they started.
    emit(&line);
    let left = (hold - started.elapsed().as_secs_f64()).max(0.0);
    let interrupted = sleep_or_signal(blocked, left);
    children.wait(interrupted);
    match interrupted {
        Some(_) => exit_after(interrupted),
        None if all_admitted => ExitCode::SUCCESS,
        None => ExitCode::FAILURE,
    }
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
pub fn sleep_or_signal(blocked: Option<SigSet>, seconds: f64) -> Option<Signal> {
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
