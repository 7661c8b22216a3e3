//! SOCK_SEQPACKET unix sockets for the connect gate: the gate's listening `control` socket, the
//! connection to the daemon's, and moving one message with its credentials and passed file
//! descriptors from one socket to the other (through the gate keeper's `fd_passing`, the one
//! place that owns received descriptors).
//!
//! What crosses an MPS control socket (measured on the H200, MPS-FACTS.md and
//! docs/gpu-results.md section 5): whole messages, the client's SCM_CREDENTIALS, and in the
//! daemon's answers SCM_RIGHTS descriptors (the client's own channel to the server). The gate
//! forwards each message as it came, with the client's credentials attached on the way to the
//! daemon: the daemon must see the client's pid and uid, never the manager's.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use gpu_mps_gate_keeper::fd_passing;
use nix::sys::socket::{
    self, AddressFamily, Backlog, MsgFlags, SockFlag, SockType, UnixAddr, UnixCredentials, sockopt,
};
use tokio::io::unix::AsyncFd;

/// Largest message relayed. MPS control messages are far smaller (docs/gpu-results.md
/// section 5); a longer one is refused rather than cut.
pub const MAX_MESSAGE: usize = 64 * 1024;

/// The socket a container connects to: bound under a temporary name and renamed over
/// `<dir>/control`, so that a manager restart replaces the old socket without a moment in which
/// the gate dir is empty (an MPS client that finds no control socket may fall back to a direct
/// context; see docs/adr/0005). Mode 0666: a container's processes run as any uid.
pub fn bind_gate_socket(dir: &Path, socket_name: &str) -> io::Result<UnixListener> {
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    // Accepted connections inherit it: each message from a client then carries its
    // credentials, translated into the manager's (host) PID namespace.
    socket::setsockopt(&fd, sockopt::PassCred, &true)?;
    // One manager per root (the manager socket says so): a fixed temporary name does.
    let tmp = dir.join(format!(".{socket_name}.new"));
    let _ = std::fs::remove_file(&tmp);
    socket::bind(fd.as_raw_fd(), &UnixAddr::new(&tmp)?)?;
    socket::listen(&fd, Backlog::new(128)?)?;
    let placed = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o666))
        .and_then(|()| std::fs::rename(&tmp, dir.join(socket_name)));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(UnixListener::from(fd))
}

/// Registers a socket with tokio's reactor (non-blocking already).
pub fn watch<T>(socket: T) -> io::Result<AsyncFd<T>>
where
    T: AsRawFd + Into<std::os::fd::OwnedFd>,
{
    #[allow(unsafe_code)]
    // SAFETY: T is a std socket that owns its descriptor (it converts into an OwnedFd), so the
    // descriptor stays open for as long as the AsyncFd holds T.
    let registered = unsafe { AsyncFd::register(socket) };
    registered.map_err(io::Error::from)
}

/// A blocking connect to the daemon's socket (a unix connect returns at once unless the
/// daemon's backlog is full), then non-blocking for the relay.
pub fn connect(path: &Path) -> io::Result<UnixStream> {
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    socket::connect(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
    let stream = UnixStream::from(fd);
    stream.set_nonblocking(true)?;
    Ok(stream)
}

/// The credentials of the process that connected, in the manager's PID namespace.
pub fn peer_credentials(stream: &UnixStream) -> io::Result<UnixCredentials> {
    Ok(socket::getsockopt(stream, sockopt::PeerCredentials)?)
}

/// Whether the peer closed (end of stream), without taking a message off the socket.
pub fn peek_closed(stream: &UnixStream) -> io::Result<bool> {
    let mut byte = [0u8; 1];
    let n = socket::recv(
        stream.as_raw_fd(),
        &mut byte,
        MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT,
    )?;
    Ok(n == 0)
}

/// One whole message taken off a socket, with what came with it. Its descriptors are closed
/// when it drops (after they were passed on, the receiver holds its own copies).
pub struct Message {
    pub bytes: Vec<u8>,
    fds: Vec<OwnedFd>,
    pub credentials: Option<UnixCredentials>,
}

impl Message {
    pub fn fd_count(&self) -> usize {
        self.fds.len()
    }

    pub fn fds(&self) -> Vec<BorrowedFd<'_>> {
        self.fds.iter().map(|fd| fd.as_fd()).collect()
    }
}

/// One message off a non-blocking socket; `None` at end of stream. A message that did not fit
/// is an error: relayed cut, it would be another message.
fn receive(socket: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<Option<Message>> {
    let received = fd_passing::receive(socket, buf, MsgFlags::MSG_DONTWAIT)?;
    if received.cut {
        return Err(io::Error::other(format!(
            "a message did not fit ({} bytes read; at most {MAX_MESSAGE} bytes and {} descriptors)",
            received.bytes,
            fd_passing::MAX_FDS
        )));
    }
    if received.is_end_of_stream() {
        return Ok(None);
    }
    Ok(Some(Message {
        bytes: buf[..received.bytes].to_vec(),
        fds: received.fds,
        credentials: received.credentials,
    }))
}

/// Waits for one message and takes it; `None` at end of stream. Cancel-safe: the message is
/// taken off the socket only in the step that returns it.
pub async fn recv_message(from: &AsyncFd<UnixStream>) -> io::Result<Option<Message>> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let mut guard = from.readable().await?;
        match guard.try_io(|s| receive(s.get_ref().as_fd(), &mut buf)) {
            Ok(received) => return received,
            Err(_would_block) => continue,
        }
    }
}

/// Sends one message, with descriptors (the receiver gets its own) and credentials if given.
pub async fn send_message(
    to: &AsyncFd<UnixStream>,
    data: &[u8],
    fds: &[BorrowedFd<'_>],
    credentials: Option<&UnixCredentials>,
) -> io::Result<()> {
    loop {
        let mut guard = to.writable().await?;
        let sent = guard.try_io(|s| {
            fd_passing::send(
                s.get_ref().as_fd(),
                data,
                fds,
                credentials,
                MsgFlags::MSG_DONTWAIT,
            )
            .map_err(io::Error::from)
        });
        match sent {
            Ok(Ok(n)) if n == data.len() => return Ok(()),
            Ok(Ok(n)) => {
                return Err(io::Error::other(format!(
                    "short send: {n} of {} bytes",
                    data.len()
                )));
            }
            Ok(Err(e)) => return Err(e),
            Err(_would_block) => continue,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::io::{Read, Write};

    use super::*;

    fn pair() -> (UnixStream, UnixStream) {
        let (a, b) = socket::socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .unwrap();
        (UnixStream::from(a), UnixStream::from(b))
    }

    fn nonblocking(s: UnixStream) -> AsyncFd<UnixStream> {
        s.set_nonblocking(true).unwrap();
        watch(s).unwrap()
    }

    #[tokio::test]
    async fn relays_bytes_credentials_and_descriptors_message_by_message() {
        // client <-> (gate_in | gate_out) <-> daemon
        let (client, gate_in) = pair();
        let (gate_out, daemon) = pair();
        socket::setsockopt(&daemon, sockopt::PassCred, &true).unwrap();
        socket::setsockopt(&gate_in, sockopt::PassCred, &true).unwrap();
        let (gate_in, gate_out) = (nonblocking(gate_in), nonblocking(gate_out));
        let me = UnixCredentials::new();

        // Two messages keep their boundaries; each arrives with the sender's credentials and
        // leaves with those the gate chose (the client's, as SO_PEERCRED recorded them).
        (&client).write_all(b"hello").unwrap();
        (&client).write_all(b"second").unwrap();
        for expected in [&b"hello"[..], b"second"] {
            let m = recv_message(&gate_in).await.unwrap().unwrap();
            assert_eq!(m.bytes, expected);
            assert_eq!(m.credentials.map(|c| c.pid()), Some(std::process::id() as i32));
            send_message(&gate_out, &m.bytes, &m.fds(), Some(&me))
                .await
                .unwrap();
        }
        let mut buf = [0u8; 64];
        let first = fd_passing::receive(daemon.as_fd(), &mut buf, MsgFlags::empty()).unwrap();
        assert_eq!(first.bytes, 5);
        assert_eq!(
            first.credentials.map(|c| c.pid()),
            Some(std::process::id() as i32)
        );
        assert_eq!((&daemon).read(&mut buf).unwrap(), 6);

        // The daemon passes a descriptor; the client receives a working one, and the gate
        // keeps no copy once the message is dropped.
        let (keep, pass) = pair();
        fd_passing::send(daemon.as_fd(), b"fd", &[pass.as_fd()], None, MsgFlags::empty()).unwrap();
        drop(pass);
        let with_fd = recv_message(&gate_out).await.unwrap().unwrap();
        assert_eq!((with_fd.bytes.as_slice(), with_fd.fd_count()), (&b"fd"[..], 1));
        send_message(&gate_in, &with_fd.bytes, &with_fd.fds(), None)
            .await
            .unwrap();
        drop(with_fd);
        let got = fd_passing::receive(client.as_fd(), &mut buf, MsgFlags::empty()).unwrap();
        assert_eq!(got.fds.len(), 1);
        let received = UnixStream::from(got.fds.into_iter().next().unwrap());
        (&received).write_all(b"through").unwrap();
        assert_eq!((&keep).read(&mut buf).unwrap(), 7);
        drop(received);
        keep.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        assert_eq!(
            (&keep).read(&mut buf).unwrap(),
            0,
            "no copy left open in the gate"
        );

        // End of stream is reported, not relayed as a message.
        drop(client);
        assert!(recv_message(&gate_in).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn a_message_longer_than_the_largest_is_refused_not_cut() {
        let (client, gate_in) = pair();
        let gate_in = nonblocking(gate_in);
        (&client).write_all(&vec![7u8; MAX_MESSAGE + 1]).unwrap();
        let e = recv_message(&gate_in).await.err().expect("refused");
        assert!(e.to_string().contains("did not fit"), "{e}");
    }

    #[test]
    fn the_gate_socket_replaces_an_old_one_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let first = bind_gate_socket(dir.path(), "control").unwrap();
        drop(first);
        // A dead socket file from a previous manager is replaced, never removed first.
        let second = bind_gate_socket(dir.path(), "control").unwrap();
        let meta = std::fs::metadata(dir.path().join("control")).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o666);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, vec!["control"]);
        let _client = connect(&dir.path().join("control")).unwrap();
        second.set_nonblocking(false).unwrap();
        assert!(second.accept().is_ok());
    }
}
