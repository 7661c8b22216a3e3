//! The manager's state root (`/run/gpu-mps`) and the directories the layout puts under it
//! (docs/internals.md): what they must be before the manager trusts them, and the modes it
//! gives them.
//!
//! MPS makes a daemon's `control` socket 0666 (measured, docs/gpu-runs/2026-12-03-probe.log)
//! and a gate's socket is 0666 so that a container's processes of any uid reach it. The
//! directories are what keeps host users out: the root and everything under it is 0700, except
//! the gate dirs themselves (0755), each of which is the root of one container's
//! `/tmp/nvidia-mps` and is never reached by a host path except through its 0700 parents.
//!
//! A directory the manager did not make, or one others could write, is refused rather than
//! repaired: whoever could write it may have put sockets or directories of their own in it, and
//! a chmod does not take them out. A directory that is only readable or traversable by others
//! (what gpu-mps made before 0700) is narrowed, and the manager says so.

use std::fs;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use gpu_mps_api::files::{self, GATE_DIR_MODE, PRIVATE_DIR_MODE};
use gpu_mps_api::node_config;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum StateRootError {
    #[error(
        "{path} is a symbolic link: the state root and the directories under it must be real directories (set `root` in the node config to the directory itself, or remove the link)"
    )]
    Symlink { path: PathBuf },
    #[error(
        "{path} is not a directory: the state root needs it as one (remove it; gpu-mps-manager recreates it)"
    )]
    NotADirectory { path: PathBuf },
    #[error(
        "{path} belongs to uid {owner}, not to uid {expected} that gpu-mps-manager runs as: its owner could replace the gates and MPS daemons in it; check what is inside, then remove it (gpu-mps-manager recreates it) or chown it to root"
    )]
    ForeignOwner {
        path: PathBuf,
        owner: u32,
        expected: u32,
    },
    #[error(
        "{path} is writable by group or others (mode {mode:04o}): anyone could have put sockets or directories of their own in it; check what is inside, then chmod 0700 it or remove it (gpu-mps-manager recreates it)"
    )]
    Writable { path: PathBuf, mode: u32 },
    #[error("{context} {path}: {source}")]
    Io {
        context: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

/// A directory whose mode was wider than the layout's and was narrowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Narrowed {
    pub path: PathBuf,
    pub from: u32,
    pub to: u32,
}

/// What to do with one directory of the tree, from its metadata: pure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Keep,
    Narrow { from: u32 },
    NotADirectory,
    Symlink,
    ForeignOwner { owner: u32 },
    Writable { mode: u32 },
}

fn judge(file_type: fs::FileType, owner: u32, mode: u32, expected_owner: u32, wanted: u32) -> Verdict {
    let mode = mode & 0o7777;
    if file_type.is_symlink() {
        Verdict::Symlink
    } else if !file_type.is_dir() {
        Verdict::NotADirectory
    } else if owner != expected_owner {
        Verdict::ForeignOwner { owner }
    } else if mode & 0o022 != 0 {
        Verdict::Writable { mode }
    } else if mode & !wanted != 0 {
        Verdict::Narrow { from: mode }
    } else {
        Verdict::Keep
    }
}

/// Checks one existing directory and narrows its mode to `wanted`. `Ok(None)` when it was
/// already as wanted.
fn secure_dir(path: &Path, wanted: u32) -> Result<Option<Narrowed>, StateRootError> {
    let meta = fs::symlink_metadata(path).map_err(|source| StateRootError::Io {
        context: "reading",
        path: path.to_path_buf(),
        source,
    })?;
    let expected = nix::unistd::geteuid().as_raw();
    let path_buf = || path.to_path_buf();
    match judge(meta.file_type(), meta.uid(), meta.mode(), expected, wanted) {
        Verdict::Keep => Ok(None),
        Verdict::Narrow { from } => {
            fs::set_permissions(path, fs::Permissions::from_mode(wanted)).map_err(|source| {
                StateRootError::Io {
                    context: "narrowing the mode of",
                    path: path_buf(),
                    source,
                }
            })?;
            Ok(Some(Narrowed {
                path: path_buf(),
                from,
                to: wanted,
            }))
        }
        Verdict::NotADirectory => Err(StateRootError::NotADirectory { path: path_buf() }),
        Verdict::Symlink => Err(StateRootError::Symlink { path: path_buf() }),
        Verdict::ForeignOwner { owner } => Err(StateRootError::ForeignOwner {
            path: path_buf(),
            owner,
            expected,
        }),
        Verdict::Writable { mode } => Err(StateRootError::Writable {
            path: path_buf(),
            mode,
        }),
    }
}

/// Creates `path` with `mode` (missing ancestors 0700) when it is missing, else checks and
/// narrows it.
fn ensure_dir(path: &Path, mode: u32) -> Result<Option<Narrowed>, StateRootError> {
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            files::create_dir_in_private_parents(path, mode).map_err(|source| StateRootError::Io {
                context: "creating",
                path: path.to_path_buf(),
                source,
            })?;
            Ok(None)
        }
        _ => secure_dir(path, mode),
    }
}

/// The root itself, before anything in it is touched (the manager's lock file): created 0700
/// when missing; refused when it is not a directory of the manager's uid that only it can
/// write; narrowed to 0700 otherwise.
pub fn claim_root(root: &Path) -> Result<Option<Narrowed>, StateRootError> {
    ensure_dir(root, PRIVATE_DIR_MODE)
}

/// The root and every directory the layout puts under it: `daemons`, `gates`, `leases`, each
/// daemon's dir with its `pipe` and `log`, and each gate dir (0755; everything else 0700).
/// `daemons` and `gates` are created when missing. What a manager of an earlier version left
/// (0755 everywhere) is narrowed here, at the start that adopts it.
pub fn secure_tree(root: &Path) -> Result<Vec<Narrowed>, StateRootError> {
    let mut narrowed: Vec<Narrowed> = Vec::new();
    narrowed.extend(claim_root(root)?);
    let daemons = root.join(node_config::DAEMONS_DIR);
    let gates = root.join(node_config::GATES_DIR);
    narrowed.extend(ensure_dir(&daemons, PRIVATE_DIR_MODE)?);
    narrowed.extend(ensure_dir(&gates, PRIVATE_DIR_MODE)?);
    // Something else in the way of `leases` is the lease files' to report at each save (a
    // disk that cannot be written); the manager still starts.
    let leases = root.join(node_config::LEASES_DIR);
    if fs::symlink_metadata(&leases).is_ok_and(|m| m.is_dir() || m.file_type().is_symlink()) {
        narrowed.extend(secure_dir(&leases, PRIVATE_DIR_MODE)?);
    }
    for daemon in subdirectories(&daemons)? {
        narrowed.extend(secure_dir(&daemon, PRIVATE_DIR_MODE)?);
        for inner in ["pipe", "log"] {
            let dir = daemon.join(inner);
            if fs::symlink_metadata(&dir).is_ok() {
                narrowed.extend(secure_dir(&dir, PRIVATE_DIR_MODE)?);
            }
        }
    }
    for gate in subdirectories(&gates)? {
        narrowed.extend(secure_dir(&gate, GATE_DIR_MODE)?);
    }
    Ok(narrowed)
}

/// Every entry of `dir` but plain files and sockets: a symbolic link is returned too, so that
/// [`secure_dir`] refuses it.
fn subdirectories(dir: &Path) -> Result<Vec<PathBuf>, StateRootError> {
    let io_err = |source| StateRootError::Io {
        context: "listing",
        path: dir.to_path_buf(),
        source,
    };
    let mut found = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_err)? {
        let entry = entry.map_err(io_err)?;
        let kind = entry.file_type().map_err(io_err)?;
        if kind.is_dir() || kind.is_symlink() {
            found.push(entry.path());
        }
    }
    found.sort();
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn mode_of(path: &Path) -> u32 {
        fs::symlink_metadata(path).unwrap().mode() & 0o7777
    }

    fn chmod(path: &Path, mode: u32) {
        fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn judging_a_directory() {
        let dir = tempfile::tempdir().unwrap();
        let kind = fs::metadata(dir.path()).unwrap().file_type();
        let me = nix::unistd::geteuid().as_raw();
        assert_eq!(judge(kind, me, 0o40700, me, 0o700), Verdict::Keep);
        assert_eq!(
            judge(kind, me, 0o700, me, 0o755),
            Verdict::Keep,
            "narrower is fine"
        );
        assert_eq!(judge(kind, me, 0o755, me, 0o700), Verdict::Narrow { from: 0o755 });
        assert_eq!(
            judge(kind, me, 0o2711, me, 0o700),
            Verdict::Narrow { from: 0o2711 }
        );
        assert_eq!(
            judge(kind, me, 0o775, me, 0o700),
            Verdict::Writable { mode: 0o775 }
        );
        assert_eq!(
            judge(kind, me, 0o1777, me, 0o700),
            Verdict::Writable { mode: 0o1777 }
        );
        assert_eq!(
            judge(kind, me + 1, 0o700, me, 0o700),
            Verdict::ForeignOwner { owner: me + 1 }
        );
    }

    #[test]
    fn a_missing_root_is_made_0700_with_its_subtrees() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("run/gpu-mps");
        assert_eq!(secure_tree(&root).unwrap(), []);
        for p in [
            dir.path().join("run"),
            root.clone(),
            root.join("daemons"),
            root.join("gates"),
        ] {
            assert_eq!(mode_of(&p), 0o700, "{}", p.display());
        }
    }

    #[test]
    fn what_an_earlier_manager_left_is_narrowed() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("r");
        let pipe = root.join("daemons/GPU-0/pipe");
        let log = root.join("daemons/GPU-0/log");
        let gate = root.join("gates/0123456789abcdef");
        for d in [&pipe, &log, &gate, &root.join("leases")] {
            fs::create_dir_all(d).unwrap();
        }
        let all = [
            root.clone(),
            root.join("daemons"),
            root.join("daemons/GPU-0"),
            pipe.clone(),
            log.clone(),
            root.join("gates"),
            gate.clone(),
            root.join("leases"),
        ];
        for d in &all {
            chmod(d, 0o755);
        }
        fs::write(root.join("state.json"), "{}").unwrap();
        let narrowed = secure_tree(&root).unwrap();
        assert_eq!(
            narrowed.len(),
            all.len() - 1,
            "all but the gate dir: {narrowed:?}"
        );
        for d in &all {
            let wanted = if *d == gate { 0o755 } else { 0o700 };
            assert_eq!(mode_of(d), wanted, "{}", d.display());
        }
        assert_eq!(
            secure_tree(&root).unwrap(),
            [],
            "a second start finds nothing to do"
        );
    }

    #[test]
    fn a_root_others_can_write_or_that_is_a_link_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("r");
        fs::create_dir(&root).unwrap();
        chmod(&root, 0o777);
        let e = claim_root(&root).unwrap_err().to_string();
        assert!(e.contains("writable by group or others (mode 0777)"), "{e}");
        assert_eq!(mode_of(&root), 0o777, "a refused root is left as it was");

        chmod(&root, 0o700);
        fs::create_dir_all(root.join("gates/ab")).unwrap();
        chmod(&root.join("gates/ab"), 0o777);
        let e = secure_tree(&root).unwrap_err().to_string();
        assert!(e.contains("gates/ab is writable"), "{e}");

        let link = dir.path().join("link");
        symlink(&root, &link).unwrap();
        let e = claim_root(&link).unwrap_err().to_string();
        assert!(e.contains("is a symbolic link"), "{e}");
        fs::write(dir.path().join("file"), "").unwrap();
        let e = claim_root(&dir.path().join("file")).unwrap_err().to_string();
        assert!(e.contains("is not a directory"), "{e}");
    }

    #[test]
    fn a_root_of_another_uid_is_refused() {
        if !nix::unistd::geteuid().is_root() {
            println!("skipped: chown needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("r");
        fs::create_dir(&root).unwrap();
        chmod(&root, 0o700);
        std::os::unix::fs::chown(&root, Some(65534), Some(65534)).unwrap();
        let e = claim_root(&root).unwrap_err().to_string();
        assert!(e.contains("belongs to uid 65534, not to uid 0"), "{e}");
    }
}
