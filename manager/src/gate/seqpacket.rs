//! SOCK_SEQPACKET unix sockets for the connect gate: the gate's listening `control` socket, the
//! connection to the daemon's, and moving one message with its credentials and passed file
//! descriptors from one socket to the other.
//!
//! What crosses an MPS control socket (measured on the H200, MPS-FACTS.md and
//! docs/gpu-results.md section 5): whole messages, the client's SCM_CREDENTIALS, and in the
//! daemon's answers SCM_RIGHTS descriptors (the client's own channel to the server). The gate
//! forwards each message as it came, with the client's credentials attached on the way to the
//! daemon: the daemon must see the client's pid and uid, never the manager's.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use nix::cmsg_space;
use nix::sys::socket::{
    self, AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
    UnixAddr, UnixCredentials, sockopt,
};
use tokio::io::unix::AsyncFd;

/// Largest message relayed. MPS control messages are far smaller (docs/gpu-results.md
/// section 5); a longer one is refused rather than cut.
pub const MAX_MESSAGE: usize = 64 * 1024;
/// Most descriptors one message may pass: the kernel's SCM_MAX_FD, so that no message can have
/// its descriptors cut off (a cut would leave them open in the manager, out of reach).
const MAX_FDS: usize = 253;

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

/// One message as it crossed the gate, for the trace log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relayed {
    pub bytes: usize,
    pub fds: usize,
    /// The pid in the credentials forwarded with it, if any.
    pub credentials_pid: Option<i32>,
    /// The pid in the credentials the message arrived with, if any.
    pub message_credentials_pid: Option<i32>,
}

/// Which credentials go with a message to the other side.
#[derive(Debug, Clone, Copy)]
pub enum Credentials {
    /// Toward the daemon: the client's, as the kernel recorded them when it connected
    /// (SO_PEERCRED). Not those in the message: a privileged process could write any pid there,
    /// and the manager sends them on as root.
    OfClient(UnixCredentials),
    /// Toward the client: none of the gate's own choosing (the kernel attaches the manager's,
    /// uid 0 like the daemon, if the client asks for them).
    None,
}

/// What one step of a relay did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Moved(Relayed),
    /// `from` reached end of stream.
    Ended,
    /// Readiness was stale; wait for it again.
    NotReady,
}

/// Moves one message from `from` to `to`, once `from` reported readiness. It never waits for
/// `from`, so a caller that selects on the readiness of both directions cannot lose a message
/// taken off one socket to the cancellation of its branch.
pub async fn relay_one(
    from: &AsyncFd<UnixStream>,
    to: &AsyncFd<UnixStream>,
    credentials: Credentials,
) -> io::Result<Step> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let received = {
        let mut guard = from.readable().await?;
        match guard.try_io(|s| receive(s.get_ref().as_raw_fd(), &mut buf)) {
            Ok(result) => result?,
            Err(_would_block) => return Ok(Step::NotReady),
        }
    };
    let Some(received) = received else {
        return Ok(Step::Ended);
    };
    let creds = match credentials {
        Credentials::OfClient(peer) => Some(peer),
        Credentials::None => None,
    };
    // Passed on (the receiver has its own copies) or not, ours are closed when `received`
    // drops, also when this future is dropped while it waits to send.
    send(to, &buf[..received.bytes], &received.fds.0, creds.as_ref()).await?;
    Ok(Step::Moved(Relayed {
        bytes: received.bytes,
        fds: received.fds.0.len(),
        credentials_pid: creds.map(|c| c.pid()),
        message_credentials_pid: received.credentials.map(|c| c.pid()),
    }))
}

/// Descriptors received with a message; closed on drop.
struct ReceivedFds(Vec<RawFd>);

impl Drop for ReceivedFds {
    fn drop(&mut self) {
        for fd in &self.0 {
            let _ = nix::unistd::close(*fd);
        }
    }
}

struct Received {
    bytes: usize,
    fds: ReceivedFds,
    credentials: Option<UnixCredentials>,
}

fn receive(fd: RawFd, buf: &mut [u8]) -> io::Result<Option<Received>> {
    let mut cmsg = cmsg_space!(libc::ucred, [RawFd; MAX_FDS]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = socket::recvmsg::<()>(
        fd,
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let mut fds = ReceivedFds(Vec::new());
    let mut credentials = None;
    for c in msg.cmsgs()? {
        match c {
            ControlMessageOwned::ScmRights(r) => fds.0.extend(r),
            ControlMessageOwned::ScmCredentials(c) => credentials = Some(c),
            _ => {}
        }
    }
    let (bytes, flags) = (msg.bytes, msg.flags);
    if flags.intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC) {
        return Err(io::Error::other(format!(
            "a message did not fit ({bytes} bytes read, flags {flags:?}; at most {MAX_MESSAGE} bytes and {MAX_FDS} descriptors)"
        )));
    }
    if bytes == 0 && fds.0.is_empty() && credentials.is_none() {
        return Ok(None);
    }
    Ok(Some(Received {
        bytes,
        fds,
        credentials,
    }))
}

/// One whole message taken off a socket, with what came with it. Its descriptors are closed
/// when it drops (after they were passed on, the receiver holds its own copies).
pub struct Message {
    pub bytes: Vec<u8>,
    fds: ReceivedFds,
    pub credentials: Option<UnixCredentials>,
}

impl Message {
    pub fn fd_count(&self) -> usize {
        self.fds.0.len()
    }

    pub fn raw_fds(&self) -> &[RawFd] {
        &self.fds.0
    }
}

/// Waits for one message and takes it; `None` at end of stream. Cancel-safe: the message is
/// taken off the socket only in the step that returns it.
pub async fn recv_message(from: &AsyncFd<UnixStream>) -> io::Result<Option<Message>> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let mut guard = from.readable().await?;
        match guard.try_io(|s| receive(s.get_ref().as_raw_fd(), &mut buf)) {
            Ok(received) => {
                return Ok(received?.map(|r| Message {
                    bytes: buf[..r.bytes].to_vec(),
                    fds: r.fds,
                    credentials: r.credentials,
                }));
            }
            Err(_would_block) => continue,
        }
    }
}

/// Sends one message, with descriptors and credentials if given.
pub async fn send_message(
    to: &AsyncFd<UnixStream>,
    data: &[u8],
    fds: &[RawFd],
    credentials: Option<&UnixCredentials>,
) -> io::Result<()> {
    send(to, data, fds, credentials).await
}

async fn send(
    to: &AsyncFd<UnixStream>,
    data: &[u8],
    fds: &[RawFd],
    credentials: Option<&UnixCredentials>,
) -> io::Result<()> {
    let mut cmsgs = Vec::new();
    if let Some(c) = credentials {
        cmsgs.push(ControlMessage::ScmCredentials(c));
    }
    if !fds.is_empty() {
        cmsgs.push(ControlMessage::ScmRights(fds));
    }
    let iov = [IoSlice::new(data)];
    loop {
        let mut guard = to.writable().await?;
        let sent = guard.try_io(|s| {
            socket::sendmsg::<()>(
                s.get_ref().as_raw_fd(),
                &iov,
                &cmsgs,
                MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
                None,
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

        // Two messages keep their boundaries.
        (&client).write_all(b"hello").unwrap();
        (&client).write_all(b"second").unwrap();
        let me = UnixCredentials::new();
        for expected in [5, 6] {
            let r = moved(&gate_in, &gate_out, Credentials::OfClient(me)).await;
            assert_eq!(r.bytes, expected);
            assert_eq!(r.credentials_pid, Some(std::process::id() as i32));
        }
        let mut buf = [0u8; 64];
        let mut cmsg = cmsg_space!(libc::ucred);
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg =
            socket::recvmsg::<()>(daemon.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::empty()).unwrap();
        assert_eq!(msg.bytes, 5);
        let creds: Vec<_> = msg
            .cmsgs()
            .unwrap()
            .filter_map(|c| match c {
                ControlMessageOwned::ScmCredentials(c) => Some(c.pid()),
                _ => None,
            })
            .collect();
        assert_eq!(creds, vec![std::process::id() as i32]);
        assert_eq!((&daemon).read(&mut buf).unwrap(), 6);

        // The daemon passes a descriptor; the client receives a working one.
        let (keep, pass) = pair();
        let fds = [pass.as_raw_fd()];
        socket::sendmsg::<()>(
            daemon.as_raw_fd(),
            &[IoSlice::new(b"fd")],
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::empty(),
            None,
        )
        .unwrap();
        drop(pass);
        let r = moved(&gate_out, &gate_in, Credentials::None).await;
        assert_eq!((r.bytes, r.fds, r.credentials_pid), (2, 1, None));
        let mut cmsg = cmsg_space!([RawFd; 2]);
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg =
            socket::recvmsg::<()>(client.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::empty()).unwrap();
        let got: Vec<RawFd> = msg
            .cmsgs()
            .unwrap()
            .flat_map(|c| match c {
                ControlMessageOwned::ScmRights(r) => r,
                _ => Vec::new(),
            })
            .collect();
        assert_eq!(got.len(), 1);
        let received = UnixStream::from(owned(got[0]));
        (&received).write_all(b"through").unwrap();
        assert_eq!((&keep).read(&mut buf).unwrap(), 7);

        // End of stream is reported, not relayed as a message.
        drop(client);
        assert_eq!(
            relay_one(&gate_in, &gate_out, Credentials::OfClient(me))
                .await
                .unwrap(),
            Step::Ended
        );
    }

    async fn moved(from: &AsyncFd<UnixStream>, to: &AsyncFd<UnixStream>, c: Credentials) -> Relayed {
        loop {
            match relay_one(from, to, c).await.unwrap() {
                Step::Moved(r) => return r,
                Step::NotReady => continue,
                Step::Ended => panic!("ended"),
            }
        }
    }

    fn owned(fd: RawFd) -> std::os::fd::OwnedFd {
        // A test-only adoption of a descriptor received over SCM_RIGHTS.
        #[allow(unsafe_code)]
        // SAFETY: `fd` was just received over SCM_RIGHTS; nothing else owns it.
        unsafe {
            std::os::fd::FromRawFd::from_raw_fd(fd)
        }
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
