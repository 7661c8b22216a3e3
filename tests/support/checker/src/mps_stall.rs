//! `mps-stall --connections N --hold-seconds S [--read-hello]`: a hostile tenant that opens N
//! connections to `control` at once, says nothing on them (the real daemon serves one
//! connection at a time, so one silent connection holds everyone), holds them S seconds and
//! closes them. Each connect runs on its own thread: a connect blocked by a full listen
//! backlog is counted as blocked instead of stopping the report.

use std::collections::BTreeMap;
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use gpu_mps_checker::MpsStall;
use gpu_mps_checker::mps_framing::HELLO;
use nix::errno::Errno;
use nix::sys::signal::{SigSet, Signal};

use crate::control_connection::{self, ConnectionError, ControlConnection};
use crate::mps_client::pipe_dir;

/// What one connecting thread reports.
enum Event {
    Connected {
        index: usize,
        millis: f64,
    },
    ConnectFailed {
        errno: String,
    },
    /// The hello came (when asked to read it); the connection is handed over to be held.
    Holding {
        stream: UnixStream,
        got_hello: bool,
    },
}

/// How long after the hold the report waits for threads still reading their hello.
const GRACE: Duration = Duration::from_millis(500);

/// Returns the line and the signal that cut the hold short, if one did.
pub fn run(
    connections: u32,
    hold_seconds: f64,
    read_hello: bool,
    blocked: Option<SigSet>,
) -> (MpsStall, Option<Signal>) {
    let socket = pipe_dir().join("control");
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(hold_seconds);
    let (tx, rx) = mpsc::channel();
    for index in 0..connections as usize {
        let (tx, socket) = (tx.clone(), socket.clone());
        std::thread::spawn(move || {
            let connecting = Instant::now();
            let connection = match ControlConnection::open(&socket) {
                Ok(connection) => connection,
                Err(e) => {
                    let errno = match e {
                        ConnectionError::Connect { errno, .. } => format!("{errno:?}"),
                        other => other.to_string(),
                    };
                    let _ = tx.send(Event::ConnectFailed { errno });
                    return;
                }
            };
            let millis = connecting.elapsed().as_secs_f64() * 1000.0;
            let _ = tx.send(Event::Connected { index, millis });
            let got_hello = read_hello && hello_before(&connection.stream, deadline);
            let _ = tx.send(Event::Holding {
                stream: connection.stream,
                got_hello,
            });
        });
    }
    drop(tx);

    let mut connect_millis = Vec::new();
    let mut connected = std::collections::BTreeSet::new();
    let mut connect_errors: BTreeMap<String, u32> = BTreeMap::new();
    let mut held = Vec::new();
    let mut got_hello = 0;
    loop {
        // Every connect returned, and every connection is held.
        let failed = connect_errors.values().sum::<u32>() as usize;
        if connected.len() + failed == connections as usize && held.len() == connected.len() {
            break;
        }
        let wait = (deadline + GRACE).saturating_duration_since(Instant::now());
        match rx.recv_timeout(wait) {
            Ok(Event::Connected { index, millis }) => {
                connected.insert(index);
                connect_millis.push(millis);
            }
            Ok(Event::ConnectFailed { errno }) => *connect_errors.entry(errno).or_default() += 1,
            Ok(Event::Holding { stream, got_hello: g }) => {
                got_hello += u32::from(g);
                held.push(stream);
            }
            Err(_) => break,
        }
    }
    let interrupted = hold_until(deadline, blocked);
    let mut closed_by_peer = 0;
    for stream in &held {
        let seen = drain(stream);
        if !read_hello && seen.hello {
            got_hello += 1;
        }
        closed_by_peer += u32::from(seen.closed);
    }
    drop(held);
    connect_millis.sort_by(f64::total_cmp);
    let failed: u32 = connect_errors.values().sum();
    let line = MpsStall {
        socket_used: socket.to_string_lossy().into_owned(),
        connections,
        hold_seconds,
        read_hello,
        connected: connected.len() as u32,
        blocked: connections - connected.len() as u32 - failed,
        failed,
        connect_errors,
        got_hello,
        closed_by_peer,
        connect_ms_median: connect_millis.get(connect_millis.len() / 2).copied().map(round),
        connect_ms_max: connect_millis.last().copied().map(round),
    };
    (line, interrupted)
}

fn round(millis: f64) -> f64 {
    (millis * 1000.0).round() / 1000.0
}

/// Reads the hello, waiting no later than `deadline`.
fn hello_before(stream: &UnixStream, deadline: Instant) -> bool {
    let wait = deadline.saturating_duration_since(Instant::now());
    if wait.is_zero() || stream.set_read_timeout(Some(wait)).is_err() {
        return false;
    }
    matches!(control_connection::receive(stream), Ok(Some(m)) if m.bytes == HELLO)
}

/// Sleeps until `deadline` unless SIGTERM or SIGINT comes first (returned).
fn hold_until(deadline: Instant, blocked: Option<SigSet>) -> Option<Signal> {
    let left = deadline.saturating_duration_since(Instant::now());
    crate::sleep_or_signal(blocked, left.as_secs_f64())
}

struct Seen {
    hello: bool,
    closed: bool,
}

/// What is waiting on a held connection, without blocking: a hello, and whether the other
/// side closed it.
fn drain(stream: &UnixStream) -> Seen {
    let mut seen = Seen {
        hello: false,
        closed: false,
    };
    if stream.set_nonblocking(true).is_err() {
        return seen;
    }
    loop {
        match control_connection::receive(stream) {
            Ok(Some(m)) => seen.hello |= m.bytes == HELLO,
            Ok(None) => {
                seen.closed = true;
                return seen;
            }
            Err(Errno::EAGAIN) => return seen,
            Err(_) => {
                seen.closed = true;
                return seen;
            }
        }
    }
}
