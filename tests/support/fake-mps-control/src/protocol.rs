//! The fake's own messages on the control socket. The real MPS wire protocol is not public and
//! is not imitated; only the socket type (SOCK_SEQPACKET, one message per send) is the same.
//!
//! - The control CLI sends `UI`, then one message per command; every answer is `=` followed by
//!   exactly what the CLI prints (a zero-length SEQPACKET message reads like end of stream, so
//!   even an empty answer carries the `=`).
//! - A CUDA client (the test checker's `mps-client`) sends `CLIENT <pid> <uid>` and gets one
//!   line `SERVER <srv-pid> THREADS <p> MEM <dev>=<value>[,...]` (or `ERROR <why>`), then keeps
//!   the connection open while it "uses" the server. The daemon takes the pid and uid from
//!   SO_PEERCRED, not from the message: inside a container the client's own pid is 1.

use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use nix::sys::socket::{self, AddressFamily, Backlog, SockFlag, SockType, UnixAddr};

pub const UI_HELLO: &str = "UI";
pub const CLIENT_HELLO: &str = "CLIENT";
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
