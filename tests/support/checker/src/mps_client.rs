//! `mps-client`: a fake CUDA client. It connects where CUDA would (the pipe dir's `control`)
//! and makes the three connections a real CUDA client makes, framed as measured on the H200
//! (lib's mps_framing): a probe that reads the hello and closes; a kind-2 request that gets
//! the client's channel to the server as a passed descriptor (the fake daemon puts its line
//! `SERVER <srv-pid> THREADS <p> MEM <dev>=<value>[,...]` on that channel); and a second
//! kind-2 request that gets a second descriptor, dropped at once. It then holds the channel.
//!
//! It tells apart what a real CUDA client would do: no daemon, or a close before the hello,
//! is a direct context on the whole GPU; a close after the request is a clean failure.

use std::collections::BTreeMap;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use gpu_mps_checker::mps_framing::{self, CHANNEL_PASSED, CLIENT_ACK, KIND_CUDA_CLIENT};
use gpu_mps_checker::{CUDA_REFUSED, MpsClient, PIPE_DIR};
use nix::unistd::{getpid, getuid};

use crate::control_connection::{self, ConnectionError, ControlConnection, RECEIVE_TIMEOUT};

/// What the daemon told the client.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerLine {
    pub server_pid: u32,
    pub threads: String,
    pub mem: BTreeMap<String, String>,
}

/// `SERVER 607 THREADS 25.0 MEM 0=4G,1=3000M`
pub fn parse_server_line(line: &str) -> Result<ServerLine, String> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let malformed = || format!("malformed server line {line:?}");
    match words.as_slice() {
        ["SERVER", pid, "THREADS", threads, "MEM", mem @ ..] if mem.len() <= 1 => {
            let mut map = BTreeMap::new();
            for entry in mem
                .first()
                .map(|m| m.split(','))
                .into_iter()
                .flatten()
                .filter(|e| !e.is_empty())
            {
                let (dev, value) = entry.split_once('=').ok_or_else(malformed)?;
                map.insert(dev.to_string(), value.to_string());
            }
            Ok(ServerLine {
                server_pid: pid.parse().map_err(|_| malformed())?,
                threads: threads.to_string(),
                mem: map,
            })
        }
        _ => Err(malformed()),
    }
}

/// The pipe dir CUDA would use: CUDA_MPS_PIPE_DIRECTORY, else the default.
pub fn pipe_dir() -> PathBuf {
    match std::env::var_os("CUDA_MPS_PIPE_DIRECTORY") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => PathBuf::from(PIPE_DIR),
    }
}

/// How the client's connections ended.
enum Outcome {
    Admitted {
        channel: UnixStream,
        server: ServerLine,
        answer: String,
    },
    Refused {
        detail: String,
    },
    DirectContext {
        error: String,
    },
    Failed {
        error: String,
    },
}

/// Returns the line to print and, when admitted, the channel to hold.
pub fn connect() -> (MpsClient, Option<UnixStream>) {
    let pipe_dir = pipe_dir();
    let mut progress = Progress::default();
    let outcome = run(&pipe_dir.join("control"), &mut progress);
    let mut line = MpsClient {
        connected: progress.got_hello,
        admitted: false,
        refused: false,
        direct_context: false,
        descriptors: progress.descriptors,
        server_pid: None,
        threads: None,
        mem: BTreeMap::new(),
        pipe_dir_used: pipe_dir.to_string_lossy().into_owned(),
        sent_pid: getpid().as_raw(),
        sent_uid: getuid().as_raw(),
        answer: None,
        error: None,
        detail: None,
    };
    match outcome {
        Outcome::Admitted {
            channel,
            server,
            answer,
        } => {
            line.admitted = true;
            line.server_pid = Some(server.server_pid);
            line.threads = Some(server.threads);
            line.mem = server.mem;
            line.answer = Some(answer);
            (line, Some(channel))
        }
        Outcome::Refused { detail } => {
            line.refused = true;
            line.error = Some(CUDA_REFUSED.to_string());
            line.detail = Some(detail);
            (line, None)
        }
        Outcome::DirectContext { error } => {
            line.direct_context = true;
            line.detail = Some(
                "a real CUDA client would now open a direct context on the whole GPU, without MPS"
                    .to_string(),
            );
            line.error = Some(error);
            (line, None)
        }
        Outcome::Failed { error } => {
            line.error = Some(error);
            (line, None)
        }
    }
}

/// What was seen along the way, reported whatever the outcome.
#[derive(Default)]
struct Progress {
    got_hello: bool,
    descriptors: u32,
}

fn run(control: &Path, progress: &mut Progress) -> Outcome {
    // 1: the probe.
    match open(control, progress, "probe") {
        Ok(probe) => drop(probe),
        Err(outcome) => return outcome,
    }
    // 2: the request that registers the client; its channel carries the server's line.
    let (answer, mut descriptors) = match request_descriptor(control, progress, "request") {
        Ok(got) => got,
        Err(outcome) => return outcome,
    };
    let channel = descriptors.remove(0);
    let _ = channel.set_read_timeout(Some(RECEIVE_TIMEOUT));
    let answer_line = match control_connection::receive(&channel) {
        Ok(Some(m)) => String::from_utf8_lossy(&m.bytes).trim().to_string(),
        Ok(None) => {
            return Outcome::Failed {
                error: format!("the channel passed with {answer} closed before the server's line"),
            };
        }
        Err(e) => {
            return Outcome::Failed {
                error: format!("waiting for the server's line on the channel: {e:?}"),
            };
        }
    };
    let server = match parse_server_line(&answer_line) {
        Ok(server) => server,
        Err(error) => return Outcome::Failed { error },
    };
    // A client registers on its channel (the fake's word for what a real client does there):
    // a channel nobody registers on leaves the (fake) server stuck, as measured on the real one.
    if let Err(e) = std::io::Write::write_all(&mut &channel, gpu_mps_checker::mps_framing::CHANNEL_REGISTER) {
        return Outcome::Failed {
            error: format!("registering on the channel: {e}"),
        };
    }
    // 3: the second descriptor, dropped at once.
    if let Err(outcome) = request_descriptor(control, progress, "second request") {
        return outcome;
    }
    Outcome::Admitted {
        channel,
        server,
        answer: answer_line,
    }
}

/// Connects and reads the hello; a failure there is a direct context (no socket, nobody
/// listening, closed before the hello) or, for anything else, a failure.
fn open(control: &Path, progress: &mut Progress, which: &str) -> Result<ControlConnection, Outcome> {
    match ControlConnection::open_after_hello(control) {
        Ok(connection) => {
            progress.got_hello = true;
            Ok(connection)
        }
        Err(e @ (ConnectionError::Connect { .. } | ConnectionError::ClosedBeforeHello { .. })) => {
            Err(Outcome::DirectContext {
                error: format!("{which} connection: {e}"),
            })
        }
        Err(e) => Err(Outcome::Failed {
            error: format!("{which} connection: {e}"),
        }),
    }
}

/// A kind-2 connection: hello, request, `OUTBCUFD` with one descriptor, ack, close. Returns
/// the answer's hex and the descriptor.
fn request_descriptor(
    control: &Path,
    progress: &mut Progress,
    which: &str,
) -> Result<(String, Vec<UnixStream>), Outcome> {
    let connection = open(control, progress, which)?;
    let failed = |e: ConnectionError| Outcome::Failed {
        error: format!("{which} connection: {e}"),
    };
    // A send that fails here means the other side has already closed: it did not answer.
    if let Err(e) = connection.send_request(KIND_CUDA_CLIENT) {
        return Err(Outcome::Refused {
            detail: format!("{which} connection closed at the request: {e}"),
        });
    }
    let Some(answer) = connection.recv("answer to the request").map_err(failed)? else {
        return Err(Outcome::Refused {
            detail: format!("{which} connection closed after the request, unanswered"),
        });
    };
    progress.descriptors += answer.descriptors.len() as u32;
    let hex = mps_framing::hex(&answer.bytes);
    if answer.bytes != CHANNEL_PASSED || answer.descriptors.len() != 1 {
        return Err(Outcome::Failed {
            error: format!(
                "{which} connection: answer {hex} with {} descriptors, expected {} with 1",
                answer.descriptors.len(),
                mps_framing::hex(CHANNEL_PASSED)
            ),
        });
    }
    connection.send_with_credentials(&CLIENT_ACK).map_err(failed)?;
    Ok((hex, answer.descriptors))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_server_line() {
        let s = parse_server_line("SERVER 607 THREADS 25.0 MEM 0=4G,1=3000M").expect("ok");
        assert_eq!(s.server_pid, 607);
        assert_eq!(s.threads, "25.0");
        assert_eq!(
            s.mem,
            BTreeMap::from([("0".into(), "4G".into()), ("1".into(), "3000M".into())])
        );
        let s = parse_server_line("SERVER 1 THREADS 100.0 MEM").expect("ok");
        assert!(s.mem.is_empty());
    }

    #[test]
    fn refuses_garbage() {
        for bad in [
            "",
            "ERROR busy",
            "SERVER x THREADS 1 MEM 0=1G",
            "SERVER 1 THREADS 1 MEM 0",
            "HELLO",
        ] {
            assert!(parse_server_line(bad).is_err(), "{bad}");
        }
    }
}
