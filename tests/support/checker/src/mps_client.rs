//! `mps-client`: a fake CUDA client for fake-mps-control. It connects where CUDA would (the
//! pipe dir's `control` socket), says `CLIENT <pid> <uid>` with its OWN view of pid and uid (in a
//! container the pid is 1: the daemon uses SO_PEERCRED instead), reads the
//! `SERVER <srv-pid> THREADS <p> MEM <dev>=<value>[,...]` line, and holds the connection.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use gpu_mps_checker::{MpsClient, PIPE_DIR};
use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr, setsockopt, sockopt};
use nix::sys::time::{TimeVal, TimeValLike};
use nix::unistd::{getpid, getuid};

use crate::errno_name;

const ANSWER_TIMEOUT_SECONDS: i64 = 30;

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
    let malformed = || format!("malformed answer {line:?}");
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
        ["ERROR", ..] => Err(format!("daemon refused the client: {line}")),
        _ => Err(malformed()),
    }
}

/// Returns the line to print, whether it succeeded, and the open connection to hold.
pub fn connect() -> (MpsClient, bool, Option<UnixStream>) {
    let pipe_dir = match std::env::var_os("CUDA_MPS_PIPE_DIRECTORY") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        // Where CUDA looks when CUDA_MPS_PIPE_DIRECTORY is unset.
        _ => PathBuf::from(PIPE_DIR),
    };
    let (pid, uid) = (getpid().as_raw(), getuid().as_raw());
    let result =
        |connected: bool, server: Option<&ServerLine>, answer: Option<&str>, error: Option<String>| {
            MpsClient {
                connected,
                server_pid: server.map(|s| s.server_pid),
                threads: server.map(|s| s.threads.clone()),
                mem: server.map(|s| s.mem.clone()).unwrap_or_default(),
                pipe_dir_used: pipe_dir.to_string_lossy().into_owned(),
                sent_pid: pid,
                sent_uid: uid,
                answer: answer.map(str::to_string),
                error,
            }
        };
    let control = pipe_dir.join("control");
    let stream = match open(&control) {
        Ok(stream) => stream,
        Err(e) => {
            return (
                result(
                    false,
                    None,
                    None,
                    Some(format!("connect {}: {e}", control.display())),
                ),
                false,
                None,
            );
        }
    };
    let hello = format!("CLIENT {pid} {uid}");
    if let Err(e) = (&stream).write_all(hello.as_bytes()) {
        return (
            result(true, None, None, Some(format!("send: {}", errno_name(&e)))),
            false,
            None,
        );
    }
    let mut buf = vec![0u8; 4096];
    let answer = match (&stream).read(&mut buf) {
        Ok(0) => {
            return (
                result(true, None, None, Some("the daemon closed the connection".into())),
                false,
                None,
            );
        }
        Ok(n) => String::from_utf8_lossy(&buf[..n]).trim().to_string(),
        Err(e) => {
            return (
                result(true, None, None, Some(format!("receive: {}", errno_name(&e)))),
                false,
                None,
            );
        }
    };
    match parse_server_line(&answer) {
        Ok(server) => (
            result(true, Some(&server), Some(&answer), None),
            true,
            Some(stream),
        ),
        Err(e) => (result(true, None, Some(&answer), Some(e)), false, None),
    }
}

fn open(control: &std::path::Path) -> Result<UnixStream, String> {
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| format!("{e:?}"))?;
    let addr = UnixAddr::new(control).map_err(|e| format!("{e:?}"))?;
    socket::connect(fd.as_raw_fd(), &addr).map_err(|e| format!("{e:?}"))?;
    let _ = setsockopt(
        &fd,
        sockopt::ReceiveTimeout,
        &TimeVal::seconds(ANSWER_TIMEOUT_SECONDS),
    );
    Ok(UnixStream::from(fd))
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
    fn refuses_errors_and_garbage() {
        assert!(
            parse_server_line("ERROR busy")
                .expect_err("err")
                .contains("refused")
        );
        for bad in [
            "",
            "SERVER x THREADS 1 MEM 0=1G",
            "SERVER 1 THREADS 1 MEM 0",
            "HELLO",
        ] {
            assert!(parse_server_line(bad).is_err(), "{bad}");
        }
    }
}
