//! The fake's own messages on the control socket. The real MPS wire protocol is not public and
//! its bytes are not imitated; what the fake does copy is its SHAPE, measured on the H200
//! (docs/gpu-results.md section 5), because gpu-mps's connect gate depends on it:
//! SOCK_SEQPACKET, the daemon speaks first, it serves ONE connection at a time, it takes the
//! client's identity from SCM_CREDENTIALS, and a CUDA client makes three connections: a probe,
//! one that gets its channel to the server as a passed descriptor (the server's limits are
//! taken then), and one more that gets a second descriptor. The client's presence on the server
//! is its channel, not a control connection.
//!
//! - Every connection starts with the daemon's `HELLO`.
//! - The control CLI sends `UI`, then one message per command; every answer is `=` followed by
//!   exactly what the CLI prints (a zero-length SEQPACKET message reads like end of stream, so
//!   even an empty answer carries the `=`).
//! - A CUDA client (the test checker's `mps-client`) closes its first connection after the
//!   hello; on the second it sends `CLIENT <pid> <uid>` and gets one line
//!   `SERVER <srv-pid> THREADS <p> MEM <dev>=<value>[,...]` (or `ERROR <why>`) with its channel;
//!   on the third it sends `CHANNEL` and gets `CHANNEL` with one more descriptor. The daemon
//!   takes the pid and uid from the message's credentials (SO_PEERCRED when it has none), not
//!   from its text: inside a container the client's own pid is 1.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use nix::cmsg_space;
use nix::sys::socket::{
    self, AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
    UnixAddr, UnixCredentials, sockopt,
};

pub const DAEMON_HELLO: &str = "HELLO";
pub const UI_HELLO: &str = "UI";
pub const CLIENT_HELLO: &str = "CLIENT";
pub const CHANNEL_HELLO: &str = "CHANNEL";
pub const ANSWER_PREFIX: char = '=';
pub const MAX_MESSAGE: usize = 64 * 1024;

fn seqpacket_socket() -> nix::Result<std::os::fd::OwnedFd> {
    socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
}

/// A listening SOCK_SEQPACKET socket at `path`. std's `UnixListener::accept` works for any
/// socket type, and the accepted `UnixStream`s read and write whole messages.
pub fn listen(path: &Path) -> std::io::Result<UnixListener> {
    let fd = seqpacket_socket()?;
    let addr = UnixAddr::new(path)?;
    // Inherited by accepted connections: every message then carries its sender's credentials.
    socket::setsockopt(&fd, sockopt::PassCred, &true)?;
    socket::bind(fd.as_raw_fd(), &addr)?;
    socket::listen(&fd, Backlog::new(128)?)?;
    Ok(UnixListener::from(fd))
}

/// A SOCK_SEQPACKET connection to `path`.
pub fn connect(path: &Path) -> std::io::Result<UnixStream> {
    let fd = seqpacket_socket()?;
    let addr = UnixAddr::new(path)?;
    socket::connect(fd.as_raw_fd(), &addr)?;
    Ok(UnixStream::from(fd))
}

/// Sends one message. A SEQPACKET write is all or nothing.
pub fn send_message(stream: &UnixStream, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let n = (&*stream).write(text.as_bytes())?;
    if n != text.len() {
        return Err(std::io::Error::other(format!(
            "short write: {n} of {} bytes",
            text.len()
        )));
    }
    Ok(())
}

/// Receives one message; `None` at end of stream.
pub fn recv_message(stream: &UnixStream) -> std::io::Result<Option<String>> {
    use std::io::Read;
    let mut buf = vec![0u8; MAX_MESSAGE];
    let n = (&*stream).read(&mut buf)?;
    Ok((n > 0).then(|| String::from_utf8_lossy(&buf[..n]).into_owned()))
}

/// Receives one message and the credentials it came with; `None` at end of stream.
pub fn recv_with_credentials(
    stream: &UnixStream,
) -> std::io::Result<Option<(String, Option<UnixCredentials>)>> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut cmsg = cmsg_space!(libc::ucred, [RawFd; 4]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    let msg = socket::recvmsg::<()>(
        stream.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let mut credentials = None;
    for c in msg.cmsgs()? {
        match c {
            ControlMessageOwned::ScmCredentials(c) => credentials = Some(c),
            // Nobody passes the daemon descriptors; close any that come.
            ControlMessageOwned::ScmRights(fds) => fds.into_iter().for_each(|fd| {
                let _ = nix::unistd::close(fd);
            }),
            _ => {}
        }
    }
    let n = msg.bytes;
    Ok((n > 0).then(|| (String::from_utf8_lossy(&buf[..n]).into_owned(), credentials)))
}

/// Sends one message with a descriptor.
pub fn send_with_fd(stream: &UnixStream, text: &str, fd: RawFd) -> std::io::Result<()> {
    let fds = [fd];
    socket::sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(text.as_bytes())],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::MSG_NOSIGNAL,
        None,
    )?;
    Ok(())
}

/// A connected pair: the daemon keeps one end as a client's channel and passes the other.
pub fn channel_pair() -> std::io::Result<(UnixStream, UnixStream)> {
    let (a, b) = socket::socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )?;
    Ok((UnixStream::from(a), UnixStream::from(b)))
}
