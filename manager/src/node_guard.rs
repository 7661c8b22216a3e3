//! What the manager claims on the node before it touches anything else: the one-manager-per-
//! root lock, and enough file descriptors for its gates.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use nix::sys::resource::{Resource, getrlimit, setrlimit};
use thiserror::Error;

/// File under the root whose exclusive lock a running manager holds.
pub const LOCK_FILE: &str = gpu_mps_api::node_config::MANAGER_LOCK_FILE;

#[derive(Debug, Error)]
pub enum GuardError {
    #[error(
        "another gpu-mps-manager (pid {pid}) already runs for {root}: one manager per root (stop it first, or give this one another root in its config)"
    )]
    AlreadyRunning { root: PathBuf, pid: String },
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
    #[error(transparent)]
    Root(#[from] crate::state_root::StateRootError),
}

/// Held for the manager's lifetime; the kernel releases it when the process ends, also on
/// SIGKILL, so a crashed manager never blocks its successor.
#[derive(Debug)]
pub struct RootLock {
    _lock: Flock<File>,
}

/// Takes the root's lock, or says which manager holds it. Two managers on one root would both
/// start daemons and write the state: the second must not touch anything. The root is made
/// 0700 first, or refused when another uid owns it or others can write it (state_root.rs).
pub fn lock_root(root: &Path) -> Result<RootLock, GuardError> {
    let io = |context: String| move |source| GuardError::Io { context, source };
    if let Some(n) = crate::state_root::claim_root(root)? {
        tracing::warn!(path = %n.path.display(), from = format_args!("{:04o}", n.from), to = format_args!("{:04o}", n.to), "narrowed the state root: host users must reach no gate and no MPS daemon");
    }
    let path = root.join(LOCK_FILE);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io(format!("opening {}", path.display())))?;
    let mut lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => lock,
        Err((mut file, Errno::EWOULDBLOCK)) => {
            let mut pid = String::new();
            let _ = file.read_to_string(&mut pid);
            let pid = pid.trim();
            return Err(GuardError::AlreadyRunning {
                root: root.to_path_buf(),
                pid: if pid.is_empty() {
                    "unknown".into()
                } else {
                    pid.to_string()
                },
            });
        }
        Err((_, e)) => {
            return Err(GuardError::Io {
                context: format!("locking {}", path.display()),
                source: e.into(),
            });
        }
    };
    // Only for the message a second manager prints.
    let _ = lock.set_len(0);
    let _ = lock.rewind();
    let _ = write!(lock, "{}", std::process::id());
    Ok(RootLock { _lock: lock })
}

/// What the descriptor limit is after [`raise_descriptor_limit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DescriptorLimit {
    pub before: u64,
    pub now: u64,
    /// What the gates may need: two per connection (the client's and, while relayed, the
    /// daemon's), with room for the rest of the manager.
    pub wanted: u64,
}

/// Raises the soft limit on open descriptors to the hard limit: every open gate connection
/// costs one (a systemd unit without LimitNOFILE gets 1024).
pub fn raise_descriptor_limit(gate_connections: u32) -> Result<DescriptorLimit, GuardError> {
    let io = |context: &str| {
        let context = context.to_string();
        move |e: Errno| GuardError::Io {
            context,
            source: e.into(),
        }
    };
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(io("reading RLIMIT_NOFILE"))?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).map_err(io("raising RLIMIT_NOFILE"))?;
    }
    Ok(DescriptorLimit {
        before: soft,
        now: hard.max(soft),
        wanted: 2 * u64::from(gate_connections) + 1024,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_manager_per_root() {
        let dir = tempfile::tempdir().unwrap();
        let first = lock_root(dir.path()).unwrap();
        let e = lock_root(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains(&std::process::id().to_string()) && e.contains("one manager per root"),
            "{e}"
        );
        drop(first);
        assert!(lock_root(dir.path()).is_ok(), "released with its holder");
    }

    #[test]
    fn the_descriptor_limit_is_raised_to_the_hard_limit() {
        let limit = raise_descriptor_limit(4096).unwrap();
        let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        assert_eq!(soft, hard);
        assert_eq!(limit.now, hard);
        assert_eq!(limit.wanted, 2 * 4096 + 1024);
    }
}
