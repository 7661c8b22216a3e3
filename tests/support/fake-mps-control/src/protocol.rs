//! The messages on the control socket. The fake copies the framing of the real MPS control
//! protocol byte for byte, as measured on the H200 (driver 580, MPS v2: docs/gpu-results.md
//! section 7, tests/gpu/shape-probe.py), because gpu-mps's connect gate admits only
//! connections of that measured shape: a fake of its own would test a gate that real CUDA
//! clients never meet. What is copied is the framing; what goes on a client's channel to its
//! server is the fake's own (the real one is not public).
//!
//! Every message is one SOCK_SEQPACKET message (one send, one message).
//!
//! - The daemon speaks first on every connection: `OUTBHELL\0` ([`HELLO`]). It serves ONE
//!   connection at a time (a silent connection holds everyone, measured).
//! - The connecting side sends `OUTBCRED\0` ([`CREDENTIALS`]), then a little-endian u32 kind
//!   ([`KIND_CUDA_CLIENT`] = 2, [`KIND_UI`] = 4), both with SCM_CREDENTIALS. The daemon takes
//!   the client's pid and uid from those credentials (a relaying gate forwards the client's;
//!   SO_PEERCRED would name the gate), and from SO_PEERCRED only when a message has none.
//! - Kind 2, a CUDA client: the daemon answers `OUTBCUFD\0` ([`CHANNEL_PASSED`]) with ONE
//!   descriptor, its channel to the server; the client sends [`CLIENT_ACK`] (4 zero bytes) and
//!   closes. A CUDA client makes three connections: a probe that reads the hello and closes,
//!   a kind-2 request (the server latches its limits here), and a second kind-2 request that
//!   gets a second descriptor. The fake registers a client on the first kind-2 request of a pid
//!   with no live client and sends, as the first message on that channel, its own line
//!   `SERVER <srv-pid> THREADS <p> MEM <dev>=<v>[,...]`; a later request of the same pid only
//!   gets another descriptor. The client is on the server for as long as it holds its channel.
//!   A refused client gets no answer: the daemon closes the connection after the request, as
//!   a real daemon that is shutting down does (the CUDA client then fails cleanly).
//! - Kind 4, a UI session (the control CLI): per command a u64 length L, then L bytes: the
//!   command, `\n`, `\0` ([`ui_command`]); after the last command a u64 0. The daemon answers
//!   each command with one output message, 4 zero bytes then the text ([`ui_output`]), when
//!   the output is not empty, then a u64 1 ([`END_OF_ANSWER`]); after the 0 it closes. The
//!   real CLI sends one command per run and adds the final newline when it prints.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use nix::cmsg_space;
use nix::sys::socket::{
    self, AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
    UnixAddr, UnixCredentials, sockopt,
};

/// The daemon's first message on every connection.
pub const HELLO: &[u8] = b"OUTBHELL\0";
/// The connecting side's first message.
pub const CREDENTIALS: &[u8] = b"OUTBCRED\0";
/// The daemon's answer to a CUDA client, with its channel as the one descriptor.
pub const CHANNEL_PASSED: &[u8] = b"OUTBCUFD\0";
/// A CUDA client's last message on a kind-2 connection.
pub const CLIENT_ACK: [u8; 4] = [0; 4];
/// The fake's own first message of a client on its channel (what a real client sends there was
/// not measured; that a client which sends nothing leaves the server stuck was).
pub const CHANNEL_REGISTER: &[u8] = b"REGISTER";
pub const KIND_CUDA_CLIENT: u32 = 2;
pub const KIND_UI: u32 = 4;
/// What starts a UI output message.
const OUTPUT_PREFIX: [u8; 4] = [0; 4];
/// The u64 after each answer of a UI session.
pub const END_OF_ANSWER: u64 = 1;
/// The u64 a UI session ends with.
pub const END_OF_SESSION: u64 = 0;
pub const MAX_MESSAGE: usize = 64 * 1024;

/// The 4-byte kind message.
pub fn kind_message(kind: u32) -> [u8; 4] {
    kind.to_le_bytes()
}

/// The kind of a 4-byte kind message; `None` for any other size.
pub fn parse_kind(message: &[u8]) -> Option<u32> {
    Some(u32::from_le_bytes(message.try_into().ok()?))
}

/// An 8-byte length or marker of a UI session.
pub fn u64_message(value: u64) -> [u8; 8] {
    value.to_le_bytes()
}

/// The value of an 8-byte message; `None` for any other size.
pub fn parse_u64(message: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(message.try_into().ok()?))
}

/// A command as the CLI frames it: `get_server_list\n\0`.
pub fn ui_command(command: &str) -> Vec<u8> {
    let mut message = command.as_bytes().to_vec();
    message.extend_from_slice(b"\n\0");
    message
}

/// The command text of a framed command; `None` when it does not end with `\n\0`.
pub fn parse_ui_command(message: &[u8]) -> Option<String> {
    let text = message.strip_suffix(b"\n\0")?;
    Some(String::from_utf8_lossy(text).into_owned())
}

/// An answer's output message: 4 zero bytes, then the text.
pub fn ui_output(text: &str) -> Vec<u8> {
    let mut message = OUTPUT_PREFIX.to_vec();
    message.extend_from_slice(text.as_bytes());
    message
}

/// The text of an output message; `None` when it does not start with the 4 zero bytes.
pub fn parse_ui_output(message: &[u8]) -> Option<String> {
    let text = message.strip_prefix(&OUTPUT_PREFIX[..])?;
    Some(String::from_utf8_lossy(text).into_owned())
}

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
pub fn send_message(stream: &UnixStream, message: &[u8]) -> std::io::Result<()> {
    send(stream, message, &[])
}

/// Sends one message with this process's credentials, as the CLI and CUDA clients do.
pub fn send_with_credentials(stream: &UnixStream, message: &[u8]) -> std::io::Result<()> {
    let credentials = UnixCredentials::new();
    send(stream, message, &[ControlMessage::ScmCredentials(&credentials)])
}

/// Sends one message with a descriptor.
pub fn send_with_fd(stream: &UnixStream, message: &[u8], fd: RawFd) -> std::io::Result<()> {
    let fds = [fd];
    send(stream, message, &[ControlMessage::ScmRights(&fds)])
}

fn send(stream: &UnixStream, message: &[u8], cmsgs: &[ControlMessage<'_>]) -> std::io::Result<()> {
    let n = socket::sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(message)],
        cmsgs,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )?;
    if n != message.len() {
        return Err(std::io::Error::other(format!(
            "short write: {n} of {} bytes",
            message.len()
        )));
    }
    Ok(())
}

/// Receives one message; `None` at end of stream. Descriptors that come with it are closed.
pub fn recv_message(stream: &UnixStream) -> std::io::Result<Option<Vec<u8>>> {
    Ok(recv_with_credentials(stream)?.map(|(message, _)| message))
}

/// Receives one message and the credentials it came with; `None` at end of stream.
pub fn recv_with_credentials(
    stream: &UnixStream,
) -> std::io::Result<Option<(Vec<u8>, Option<UnixCredentials>)>> {
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
            // Nobody passes the daemon or the CLI descriptors; close any that come.
            ControlMessageOwned::ScmRights(fds) => fds.into_iter().for_each(|fd| {
                let _ = nix::unistd::close(fd);
            }),
            _ => {}
        }
    }
    let n = msg.bytes;
    // No message of the protocol is empty, so 0 bytes is the end of the stream.
    Ok((n > 0).then(|| (buf[..n].to_vec(), credentials)))
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

/// Bytes as lowercase hex, for logs.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_measured_bytes() {
        assert_eq!(hex(HELLO), "4f55544248454c4c00");
        assert_eq!(hex(CREDENTIALS), "4f5554424352454400");
        assert_eq!(hex(CHANNEL_PASSED), "4f5554424355464400");
        assert_eq!(kind_message(KIND_CUDA_CLIENT), [2, 0, 0, 0]);
        assert_eq!(kind_message(KIND_UI), [4, 0, 0, 0]);
        assert_eq!(u64_message(END_OF_ANSWER), [1, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(u64_message(END_OF_SESSION), [0; 8]);
    }

    #[test]
    fn ui_framing_round_trips() {
        let command = ui_command("get_server_list");
        assert_eq!(command, b"get_server_list\n\0");
        assert_eq!(command.len(), 17);
        assert_eq!(parse_ui_command(&command).as_deref(), Some("get_server_list"));
        assert_eq!(parse_ui_command(b"get_server_list"), None);
        assert_eq!(ui_output("547"), [0, 0, 0, 0, b'5', b'4', b'7']);
        assert_eq!(parse_ui_output(&ui_output("547")).as_deref(), Some("547"));
        assert_eq!(parse_ui_output(b"547"), None);
        assert_eq!(parse_u64(&u64_message(17)), Some(17));
        assert_eq!(parse_u64(&[1, 0, 0, 0]), None);
        assert_eq!(parse_kind(&[4, 0, 0, 0]), Some(4));
        assert_eq!(parse_kind(&[4, 0, 0, 0, 0]), None);
    }
}
