//! A host user's process (a non-root uid on the node, outside every container): what a connect
//! to a socket under the manager's root gives it.

use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use anyhow::{Context, Result, bail};
use nix::errno::Errno;
use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr};
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::{ForkResult, Gid, Uid, fork, setgid, setgroups, setuid};

/// The uid a host account without privileges has in these tests (`nobody`).
pub const NOBODY: u32 = 65534;

/// What a connect to the SOCK_SEQPACKET socket at `path` (MPS's and the gates' kind) gives a
/// process of `uid` (gid `uid`, no supplementary groups): `Ok(None)` when it connected, else its
/// errno. Forked so that only the child changes uid; the child makes nothing but syscalls and
/// reports the errno as its exit status.
pub fn connect_as(uid: u32, path: &Path) -> Result<Option<Errno>> {
    let address = UnixAddr::new(path).with_context(|| format!("socket path {}", path.display()))?;
    // SAFETY: the child only makes syscalls (no allocation, no lock) and ends with _exit.
    #[allow(unsafe_code)]
    match unsafe { fork() }.context("fork")? {
        ForkResult::Child => {
            let connected = setgroups(&[])
                .and_then(|()| setgid(Gid::from_raw(uid)))
                .and_then(|()| setuid(Uid::from_raw(uid)))
                .and_then(|()| {
                    socket::socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::empty(), None)
                })
                .and_then(|fd| socket::connect(fd.as_raw_fd(), &address));
            let code = match connected {
                Ok(()) => 0,
                Err(e) => e as i32,
            };
            // SAFETY: ends the forked child without running the parent's destructors.
            #[allow(unsafe_code)]
            unsafe {
                nix::libc::_exit(code)
            }
        }
        ForkResult::Parent { child } => match waitpid(child, None).context("waitpid")? {
            WaitStatus::Exited(_, 0) => Ok(None),
            WaitStatus::Exited(_, code) => Ok(Some(Errno::from_raw(code))),
            other => bail!(
                "the uid {uid} child connecting to {} ended as {other:?}",
                path.display()
            ),
        },
    }
}

/// Lets every user traverse each ancestor of `dir` (not `dir` itself), as `/run` lets them on a
/// node: a test's temp dir is 0700, which alone would keep host users out of what lies under it,
/// so that only the modes the manager gives its own tree decide.
pub fn open_ancestors_to_all(dir: &Path) -> Result<()> {
    for ancestor in dir.ancestors().skip(1) {
        let meta = std::fs::metadata(ancestor).with_context(|| format!("stat {}", ancestor.display()))?;
        let mode = meta.permissions().mode() & 0o7777;
        if mode & 0o001 == 0 {
            std::fs::set_permissions(ancestor, std::fs::Permissions::from_mode(mode | 0o011))
                .with_context(|| format!("chmod {}", ancestor.display()))?;
        }
    }
    Ok(())
}
