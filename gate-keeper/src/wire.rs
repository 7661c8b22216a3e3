//! One request or answer on a blocking connection to the keeper, through [`crate::fd_passing`].

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use nix::errno::Errno;
use nix::sys::socket::MsgFlags;

use crate::fd_passing;
use crate::protocol::MAX_MESSAGE;

/// One message as received; its descriptors are ours and close when it drops.
pub(crate) struct Message {
    pub(crate) text: Vec<u8>,
    pub(crate) fds: Vec<OwnedFd>,
    /// The message or its descriptors did not fit: refused, never half-read.
    pub(crate) cut: bool,
}

impl Message {
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.text).into_owned()
    }
}

/// Receives one message; `None` at end of stream. Waits at most the socket's receive timeout.
pub(crate) fn receive(conn: &UnixStream) -> io::Result<Option<Message>> {
    let mut buf = [0u8; MAX_MESSAGE];
    let received = loop {
        match fd_passing::receive(conn.as_fd(), &mut buf, MsgFlags::empty()) {
            Err(Errno::EINTR) => continue,
            other => break other?,
        }
    };
    if received.is_end_of_stream() {
        return Ok(None);
    }
    Ok(Some(Message {
        text: buf[..received.bytes].to_vec(),
        fds: received.fds,
        cut: received.cut,
    }))
}

/// Sends one message with at most one descriptor; waits at most the socket's send timeout.
pub(crate) fn send(conn: &UnixStream, text: &str, fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let fds: Vec<BorrowedFd<'_>> = fd.into_iter().collect();
    loop {
        match fd_passing::send(conn.as_fd(), text.as_bytes(), &fds, None, MsgFlags::empty()) {
            Ok(n) if n == text.len() => return Ok(()),
            Ok(n) => {
                return Err(io::Error::other(format!(
                    "short send: {n} of {} bytes",
                    text.len()
                )));
            }
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}
