//! One SOCK_SEQPACKET connection to an MPS control socket, from the client side: connect, the
//! daemon's hello, messages with credentials, and descriptors received as owned streams. The
//! subcommands that play a CUDA client, the CLI or a hostile tenant are built on it.

use std::fmt;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpu_mps_checker::mps_framing::{self, HELLO};
use nix::cmsg_space;
use nix::errno::Errno;
use nix::sys::socket::{
    self, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType, UnixAddr,
    UnixCredentials,
};

/// How long the checker waits for any one message: far longer than a handshake, and a gate
/// queues clients behind the one it serves.
pub const RECEIVE_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug)]
pub enum ConnectionError {
    /// connect(2) failed: no socket, nobody listening, no permission.
    Connect {
        socket: PathBuf,
        errno: Errno,
    },
    /// Closed (or reset) before the daemon's hello.
    ClosedBeforeHello {
        socket: PathBuf,
    },
    UnexpectedHello {
        socket: PathBuf,
        got: Vec<u8>,
    },
    Timeout {
        socket: PathBuf,
        waiting_for: &'static str,
    },
    Io {
        socket: PathBuf,
        context: &'static str,
        errno: Errno,
    },
}

impl fmt::Display for ConnectionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConnectionError::Connect { socket, errno } => {
                write!(f, "connect {}: {errno:?}", socket.display())
            }
            ConnectionError::ClosedBeforeHello { socket } => {
                write!(f, "{} closed the connection before its hello", socket.display())
            }
            ConnectionError::UnexpectedHello { socket, got } => write!(
                f,
                "{} said {} instead of the hello {}",
                socket.display(),
                mps_framing::hex(got),
                mps_framing::hex(HELLO)
            ),
            ConnectionError::Timeout { socket, waiting_for } => write!(
                f,
                "{}: no {waiting_for} within {} s",
                socket.display(),
                RECEIVE_TIMEOUT.as_secs()
            ),
            ConnectionError::Io {
                socket,
                context,
                errno,
            } => write!(f, "{} {context}: {errno:?}", socket.display()),
        }
    }
}

impl std::error::Error for ConnectionError {}

/// One message, with the descriptors that came with it.
#[derive(Debug)]
pub struct Message {
    pub bytes: Vec<u8>,
    pub descriptors: Vec<UnixStream>,
}

#[derive(Debug)]
pub struct ControlConnection {
    pub stream: UnixStream,
    pub socket: PathBuf,
}

impl ControlConnection {
    /// connect(2) only; blocks while the listener's backlog is full.
    pub fn open(socket: &Path) -> Result<ControlConnection, ConnectionError> {
        let connect_error = |errno| ConnectionError::Connect {
            socket: socket.to_path_buf(),
            errno,
        };
        let fd = socket::socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .map_err(connect_error)?;
        let addr = UnixAddr::new(socket).map_err(connect_error)?;
        socket::connect(fd.as_raw_fd(), &addr).map_err(connect_error)?;
        let stream = UnixStream::from(fd);
        let _ = stream.set_read_timeout(Some(RECEIVE_TIMEOUT));
        let _ = stream.set_write_timeout(Some(RECEIVE_TIMEOUT));
        Ok(ControlConnection {
            stream,
            socket: socket.to_path_buf(),
        })
    }

    /// Connects and reads the daemon's hello.
    pub fn open_after_hello(socket: &Path) -> Result<ControlConnection, ConnectionError> {
        let connection = ControlConnection::open(socket)?;
        connection.read_hello()?;
        Ok(connection)
    }

    pub fn read_hello(&self) -> Result<(), ConnectionError> {
        match self.recv("hello")? {
            None => Err(ConnectionError::ClosedBeforeHello {
                socket: self.socket.clone(),
            }),
            Some(m) if m.bytes == HELLO => Ok(()),
            Some(m) => Err(ConnectionError::UnexpectedHello {
                socket: self.socket.clone(),
                got: m.bytes,
            }),
        }
    }

    /// `OUTBCRED\0` and the kind, each with this process's credentials.
    pub fn send_request(&self, kind: u32) -> Result<(), ConnectionError> {
        self.send_with_credentials(mps_framing::CREDENTIALS)?;
        self.send_with_credentials(&mps_framing::kind_message(kind))
    }

    pub fn send_with_credentials(&self, bytes: &[u8]) -> Result<(), ConnectionError> {
        let credentials = UnixCredentials::new();
        self.send_raw(bytes, &[ControlMessage::ScmCredentials(&credentials)])
    }

    pub fn send(&self, bytes: &[u8]) -> Result<(), ConnectionError> {
        self.send_raw(bytes, &[])
    }

    fn send_raw(&self, bytes: &[u8], cmsgs: &[ControlMessage<'_>]) -> Result<(), ConnectionError> {
        socket::sendmsg::<()>(
            self.stream.as_raw_fd(),
            &[IoSlice::new(bytes)],
            cmsgs,
            MsgFlags::MSG_NOSIGNAL,
            None,
        )
        .map(drop)
        .map_err(|errno| ConnectionError::Io {
            socket: self.socket.clone(),
            context: "send",
            errno,
        })
    }

    /// One message; `None` when the other side closed, or reset the connection (it closed with
    /// our messages unread, as a gate that refuses may).
    pub fn recv(&self, waiting_for: &'static str) -> Result<Option<Message>, ConnectionError> {
        match receive(&self.stream) {
            Ok(m) => Ok(m),
            Err(Errno::EAGAIN) => Err(ConnectionError::Timeout {
                socket: self.socket.clone(),
                waiting_for,
            }),
            Err(errno) => Err(ConnectionError::Io {
                socket: self.socket.clone(),
                context: "receive",
                errno,
            }),
        }
    }
}

/// One message from any SEQPACKET stream (a control connection or a passed channel); `None` at
/// end of stream or on a reset. Timeouts come back as EAGAIN.
pub fn receive(stream: &UnixStream) -> Result<Option<Message>, Errno> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut cmsg = cmsg_space!([RawFd; 8]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    // CLOEXEC: a channel must not outlive the client in a process it starts (mps-processes).
    let msg = match socket::recvmsg::<()>(
        stream.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_CMSG_CLOEXEC,
    ) {
        Ok(msg) => msg,
        Err(Errno::ECONNRESET) => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut descriptors = Vec::new();
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(fds) = c {
            descriptors.extend(fds.into_iter().map(|fd| UnixStream::from(adopt(fd))));
        }
    }
    let n = msg.bytes;
    if n == 0 && descriptors.is_empty() {
        return Ok(None);
    }
    Ok(Some(Message {
        bytes: buf[..n].to_vec(),
        descriptors,
    }))
}

/// Owns a descriptor just received over SCM_RIGHTS.
fn adopt(fd: RawFd) -> OwnedFd {
    #[allow(unsafe_code)]
    // SAFETY: the kernel installed `fd` in this process for this message; nothing else in the
    // process knows it, so this is its only owner.
    unsafe {
        OwnedFd::from_raw_fd(fd)
    }
}
