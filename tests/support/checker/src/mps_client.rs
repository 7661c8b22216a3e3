//! `mps-client`: a fake CUDA client for fake-mps-control. It connects where CUDA would (the
//! pipe dir's `control` socket) the way a CUDA client does (three connections, measured on the
//! H200), says `CLIENT <pid> <uid>` with its OWN view of pid and uid (in a container the pid is
//! 1: the daemon uses the message's credentials instead), reads the
//! `SERVER <srv-pid> THREADS <p> MEM <dev>=<value>[,...]` line with its channel to the server,
//! and holds the channel.

use std::collections::BTreeMap;
use std::io::{IoSlice, IoSliceMut, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use gpu_mps_checker::{MpsClient, PIPE_DIR};
use nix::cmsg_space;
use nix::sys::socket::{
    self, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType, UnixAddr,
    UnixCredentials, setsockopt, sockopt,
};
use nix::sys::time::{TimeVal, TimeValLike};
use nix::unistd::{getpid, getuid};

use crate::errno_name;

const ANSWER_TIMEOUT_SECONDS: i64 = 30;
/// What the (fake) daemon says first on every connection; see fake-mps-control's protocol.rs.
const DAEMON_HELLO: &str = "HELLO";
const CLIENT_HELLO: &str = "CLIENT";
const CHANNEL_HELLO: &str = "CHANNEL";

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

/// The client's channel to its server: a descriptor the daemon passed, held while the client
/// "uses" the server (the fake daemon lists the client until it is closed).
#[derive(Debug)]
pub struct Channel(RawFd);

impl Drop for Channel {
    fn drop(&mut self) {
        let _ = nix::unistd::close(self.0);
    }
}

/// Returns the line to print, whether it succeeded, and the channel to hold. Makes the three
/// control connections of a CUDA client (see fake-mps-control's protocol.rs): a probe, the one
/// that gets the server's answer and the channel, and one more for a second descriptor.
pub fn connect() -> (MpsClient, bool, Option<Channel>) {
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
    let failed = |connected: bool, e: String| (result(connected, None, None, Some(e)), false, None);
    // 1: the probe.
    if let Err(e) = open(&control) {
        return failed(false, format!("connect {}: {e}", control.display()));
    }
    // 2: the answer and the channel.
    let stream = match open(&control) {
        Ok(stream) => stream,
        Err(e) => return failed(false, format!("connect {}: {e}", control.display())),
    };
    let (answer, fds) = match exchange(&stream, &format!("{CLIENT_HELLO} {pid} {uid}")) {
        Ok(got) => got,
        Err(e) => return failed(true, e),
    };
    drop(stream);
    let mut fds = fds.into_iter().map(Channel);
    let channel = fds.next();
    drop(fds);
    let server = match parse_server_line(&answer) {
        Ok(server) => server,
        Err(e) => return (result(true, None, Some(&answer), Some(e)), false, None),
    };
    let Some(channel) = channel else {
        let e = "the daemon passed no channel with its answer".to_string();
        return (result(true, Some(&server), Some(&answer), Some(e)), false, None);
    };
    // 3: the second descriptor, closed at once.
    match open(&control)
        .map_err(|e| format!("connect {}: {e}", control.display()))
        .and_then(|s| exchange(&s, CHANNEL_HELLO))
    {
        Ok((_, second)) if second.len() == 1 => second.into_iter().for_each(|fd| drop(Channel(fd))),
        Ok((text, second)) => {
            let e = format!("third connection: {text:?} with {} descriptors", second.len());
            return (result(true, Some(&server), Some(&answer), Some(e)), false, None);
        }
        Err(e) => {
            return (
                result(
                    true,
                    Some(&server),
                    Some(&answer),
                    Some(format!("third connection: {e}")),
                ),
                false,
                None,
            );
        }
    }
    (
        result(true, Some(&server), Some(&answer), None),
        true,
        Some(channel),
    )
}

/// Sends `message` with this process's credentials and reads the answer and the descriptors
/// that came with it.
fn exchange(stream: &UnixStream, message: &str) -> Result<(String, Vec<RawFd>), String> {
    let creds = UnixCredentials::new();
    socket::sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(message.as_bytes())],
        &[ControlMessage::ScmCredentials(&creds)],
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(|e| format!("send: {}", errno_name(&std::io::Error::from(e))))?;
    let mut buf = vec![0u8; 4096];
    let mut cmsg = cmsg_space!([RawFd; 4]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    let msg = socket::recvmsg::<()>(
        stream.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(|e| format!("receive: {}", errno_name(&std::io::Error::from(e))))?;
    let mut fds = Vec::new();
    for c in msg.cmsgs().map_err(|e| format!("receive: {e}"))? {
        if let ControlMessageOwned::ScmRights(r) = c {
            fds.extend(r);
        }
    }
    let n = msg.bytes;
    if n == 0 && fds.is_empty() {
        return Err("the daemon closed the connection".into());
    }
    Ok((String::from_utf8_lossy(&buf[..n]).trim().to_string(), fds))
}

/// Connects and reads the daemon's hello.
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
    let stream = UnixStream::from(fd);
    let mut buf = [0u8; 64];
    match (&stream).read(&mut buf) {
        Ok(n) if &buf[..n] == DAEMON_HELLO.as_bytes() => Ok(stream),
        Ok(0) => Err("the daemon closed the connection before its hello".into()),
        Ok(n) => Err(format!(
            "unexpected hello {:?}",
            String::from_utf8_lossy(&buf[..n])
        )),
        Err(e) => Err(format!("waiting for the daemon's hello: {}", errno_name(&e))),
    }
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
