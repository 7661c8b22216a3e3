//! One message over a unix socket with the descriptors (SCM_RIGHTS) and credentials
//! (SCM_CREDENTIALS) that come with it: the gate keeper's requests and the connect gate's relay
//! both pass descriptors through here.
//!
//! The workspace's one `unsafe` for received descriptors is [`adopt`]: nix 0.29 hands them over
//! as bare numbers, and only `from_raw_fd` turns a number into an owner. Everything received is
//! owned at once, so a descriptor is closed exactly once whatever the caller does next (passes it
//! on, refuses the message, or is cancelled).

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::cmsg_space;
use nix::sys::socket::{self, ControlMessage, ControlMessageOwned, MsgFlags, UnixCredentials};

/// Most descriptors one message may carry: the kernel's SCM_MAX_FD. Room for all of them is
/// always made, so that no message can have some cut off (those would stay open in this
/// process, out of reach).
pub const MAX_FDS: usize = 253;

/// One message as received; its descriptors are the receiver's and close when it drops.
#[derive(Debug)]
pub struct Received {
    /// Bytes written at the start of the buffer given to [`receive`].
    pub bytes: usize,
    pub fds: Vec<OwnedFd>,
    /// The sender's credentials, when the socket has SO_PASSCRED (the kernel attaches them).
    pub credentials: Option<UnixCredentials>,
    /// The message or its descriptors did not fit (MSG_TRUNC, MSG_CTRUNC): the caller refuses
    /// it, never acts on half of it.
    pub cut: bool,
}

impl Received {
    /// End of stream: a SOCK_SEQPACKET peer closed (an empty message carries at least
    /// credentials on a socket that asks for them).
    pub fn is_end_of_stream(&self) -> bool {
        self.bytes == 0 && self.fds.is_empty() && self.credentials.is_none()
    }
}

/// Receives one message into `buf` with `flags` (MSG_CMSG_CLOEXEC is always added: a passed
/// descriptor must not leak into a process the receiver starts).
pub fn receive(socket: BorrowedFd<'_>, buf: &mut [u8], flags: MsgFlags) -> nix::Result<Received> {
    let mut cmsg = cmsg_space!(nix::libc::ucred, [RawFd; MAX_FDS]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = socket::recvmsg::<()>(
        socket.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        flags | MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let mut raw = Vec::new();
    let mut credentials = None;
    // With MSG_CTRUNC (only when this process is out of descriptors: the buffer holds
    // SCM_MAX_FD) nix may not list what did arrive; the message is marked cut.
    if let Ok(cmsgs) = msg.cmsgs() {
        for c in cmsgs {
            match c {
                ControlMessageOwned::ScmRights(fds) => raw.extend(fds),
                ControlMessageOwned::ScmCredentials(c) => credentials = Some(c),
                _ => {}
            }
        }
    }
    let (bytes, cut) = (
        msg.bytes,
        msg.flags.intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC),
    );
    Ok(Received {
        bytes,
        fds: adopt(raw),
        credentials,
        cut,
    })
}

/// Sends `data` as one message, with `fds` (the receiver gets its own duplicates; ours stay
/// ours) and `credentials` if given (another process's need CAP_SYS_ADMIN, which the manager has).
/// Returns the bytes sent.
pub fn send(
    socket: BorrowedFd<'_>,
    data: &[u8],
    fds: &[BorrowedFd<'_>],
    credentials: Option<&UnixCredentials>,
    flags: MsgFlags,
) -> nix::Result<usize> {
    let raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    let mut cmsgs = Vec::new();
    if let Some(c) = credentials {
        cmsgs.push(ControlMessage::ScmCredentials(c));
    }
    if !raw.is_empty() {
        cmsgs.push(ControlMessage::ScmRights(&raw));
    }
    socket::sendmsg::<()>(
        socket.as_raw_fd(),
        &[IoSlice::new(data)],
        &cmsgs,
        flags | MsgFlags::MSG_NOSIGNAL,
        None,
    )
}

/// Takes ownership of descriptors the kernel just installed for a recvmsg (SCM_RIGHTS).
#[allow(unsafe_code)]
fn adopt(received: Vec<RawFd>) -> Vec<OwnedFd> {
    received
        .into_iter()
        // SAFETY: the kernel installed each of these descriptors in this process for the
        // recvmsg that returned them; nothing else knows their numbers, so each gets exactly
        // one owner, which closes it once.
        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::io::{Read, Write};
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    use nix::sys::socket::{AddressFamily, SockFlag, SockType, sockopt};

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

    #[test]
    fn a_message_keeps_its_boundary_credentials_and_working_descriptors() {
        let (a, b) = pair();
        socket::setsockopt(&b, sockopt::PassCred, &true).unwrap();
        let (keep, pass) = pair();
        let me = UnixCredentials::new();
        let sent = send(a.as_fd(), b"hello", &[pass.as_fd()], Some(&me), MsgFlags::empty()).unwrap();
        assert_eq!(sent, 5);
        send(a.as_fd(), b"second", &[], None, MsgFlags::empty()).unwrap();
        drop(pass);

        let mut buf = [0u8; 64];
        let first = receive(b.as_fd(), &mut buf, MsgFlags::empty()).unwrap();
        assert_eq!(&buf[..first.bytes], b"hello");
        assert!(!first.cut && !first.is_end_of_stream());
        assert_eq!(
            first.credentials.map(|c| c.pid()),
            Some(std::process::id() as i32)
        );
        assert_eq!(first.fds.len(), 1);
        let received = UnixStream::from(first.fds.into_iter().next().unwrap());
        (&received).write_all(b"through").unwrap();
        assert_eq!((&keep).read(&mut buf).unwrap(), 7);

        let second = receive(b.as_fd(), &mut buf, MsgFlags::empty()).unwrap();
        assert_eq!(&buf[..second.bytes], b"second");
        assert!(second.fds.is_empty());
    }

    #[test]
    fn a_message_that_does_not_fit_is_cut_and_its_descriptors_still_owned() {
        let (a, b) = pair();
        let (keep, pass) = pair();
        send(
            a.as_fd(),
            b"a longer message",
            &[pass.as_fd()],
            None,
            MsgFlags::empty(),
        )
        .unwrap();
        drop(pass);
        let mut buf = [0u8; 4];
        let got = receive(b.as_fd(), &mut buf, MsgFlags::empty()).unwrap();
        assert!(got.cut);
        assert_eq!(got.fds.len(), 1);
        drop(got);
        // Ours was the last copy of the passed end: the peer sees it closed.
        let mut rest = [0u8; 8];
        keep.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        assert_eq!((&keep).read(&mut rest).unwrap(), 0);
    }

    #[test]
    fn end_of_stream_is_an_empty_message_without_anything_attached() {
        let (a, b) = pair();
        drop(a);
        let mut buf = [0u8; 8];
        assert!(
            receive(b.as_fd(), &mut buf, MsgFlags::empty())
                .unwrap()
                .is_end_of_stream()
        );
    }
}
