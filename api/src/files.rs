//! The files the node components write: whole-file replacement that a reader (or a process
//! restarted after a crash) sees as the old or the new content, never torn; and directories
//! created with an explicit mode whatever the umask.
//!
//! One implementation for the shim (config.json), the manager (state, inventory) and the
//! containerd registration (/etc/containerd), which differ only in the options below.

use std::fs::{self, DirBuilder, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// The mode of the replacement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileMode {
    /// The existing file's mode and owner (a root-only config stays root-only); `default` when
    /// there is no file yet.
    KeepExisting {
        default: u32,
    },
    Set(u32),
}

/// Whether the replacement must survive a power loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// fsync of the file and its directory: for /etc.
    Durable,
    /// Rename only: for files on tmpfs (/run), which a power loss discards anyway together with
    /// the containers and daemons they describe; an fsync costs ~1 ms on every container start
    /// where such a directory is on disk (test setups).
    Volatile,
}

/// Replaces `path` with `bytes` through a temp file in the same directory and a rename.
pub fn replace_file(path: &Path, bytes: &[u8], mode: FileMode, durability: Durability) -> io::Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(temp_file_name(&name, std::process::id()));
    let result = write_then_rename(path, &tmp, bytes, mode, durability);
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// The temp file [`replace_file`] writes `name`'s new content to, in the same dir, before its
/// rename: one per writer (`pid`), so that two never write into one.
pub fn temp_file_name(name: &str, pid: u32) -> String {
    format!(".{name}.gpu-mps.{pid}.tmp")
}

/// The name whose temp file `name` is (see [`temp_file_name`]): a writer killed between the
/// write and the rename leaves it.
pub fn replaced_by_temp_file(name: &str) -> Option<&str> {
    let (target, pid) = name
        .strip_prefix('.')?
        .strip_suffix(".tmp")?
        .rsplit_once(".gpu-mps.")?;
    let is_pid = !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit());
    (is_pid && !target.is_empty()).then_some(target)
}

fn write_then_rename(
    path: &Path,
    tmp: &Path,
    bytes: &[u8],
    mode: FileMode,
    durability: Durability,
) -> io::Result<()> {
    let existing = fs::metadata(path).ok();
    let (mode, owner) = match mode {
        FileMode::Set(m) => (m, None),
        FileMode::KeepExisting { default } => match &existing {
            Some(m) => (m.permissions().mode() & 0o7777, Some((m.uid(), m.gid()))),
            None => (default, None),
        },
    };
    // A leftover of a writer killed mid-write that had the same pid.
    match fs::remove_file(tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(tmp)?;
    if let Some((uid, gid)) = owner {
        let created = file.metadata()?;
        if (created.uid(), created.gid()) != (uid, gid) {
            std::os::unix::fs::fchown(&file, Some(uid), Some(gid))?;
        }
    }
    // The umask may have narrowed the mode; chmod after chown so that set-id bits survive.
    file.set_permissions(fs::Permissions::from_mode(mode))?;
    file.write_all(bytes)?;
    if durability == Durability::Durable {
        file.sync_all()?;
    }
    drop(file);
    fs::rename(tmp, path)?;
    if durability == Durability::Durable {
        fs::File::open(
            path.parent()
                .filter(|d| !d.as_os_str().is_empty())
                .unwrap_or(Path::new(".")),
        )?
        .sync_all()?;
    }
    Ok(())
}

/// `mkdir -p` where every component it creates gets `mode`, whatever the umask (a gate dir must
/// be [`GATE_DIR_MODE`], traversable by the container's non-root clients, and every other
/// directory of the state root, the daemons' pipe dirs included, exactly [`PRIVATE_DIR_MODE`]).
/// Existing components are left as they are; a concurrent creator of the same directory is not
/// an error.
pub fn create_dirs(path: &Path, mode: u32) -> io::Result<()> {
    let missing: Vec<&Path> = path
        .ancestors()
        .take_while(|p| !p.as_os_str().is_empty() && !p.is_dir())
        .collect();
    for dir in missing.into_iter().rev() {
        match DirBuilder::new().mode(mode).create(dir) {
            Ok(()) => fs::set_permissions(dir, fs::Permissions::from_mode(mode))?,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Mode of the state root (`/run/gpu-mps`) and of every directory under it except the gate dirs:
/// root only. MPS makes a daemon's `control` 0666 and the gates' sockets are 0666 for containers
/// of any uid, so these directories are what keeps host users from every daemon and gate.
pub const PRIVATE_DIR_MODE: u32 = 0o700;

/// Mode of a container's gate dir (`<root>/gates/<name>`). It is the root of the container's
/// `/tmp/nvidia-mps` bind mount, which the container's processes (of any uid) traverse; path
/// resolution inside the container starts at the mount and never walks the host's parents,
/// whose [`PRIVATE_DIR_MODE`] keeps host users out.
pub const GATE_DIR_MODE: u32 = 0o755;

/// `mkdir -p path` where every missing ancestor gets [`PRIVATE_DIR_MODE`] and `path` itself, if
/// missing, `mode`, whatever the umask. Existing directories are left as they are (the manager
/// checks and narrows its tree when it starts); a concurrent creator is not an error.
pub fn create_dir_in_private_parents(path: &Path, mode: u32) -> io::Result<()> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        create_dirs(parent, PRIVATE_DIR_MODE)?;
    }
    create_dirs(path, mode)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode_of(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn keeps_the_mode_or_sets_it_and_leaves_no_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.json");
        let keep = FileMode::KeepExisting { default: 0o640 };
        replace_file(&path, b"1", keep, Durability::Volatile).unwrap();
        assert_eq!(mode_of(&path), 0o640, "default for a new file");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        replace_file(&path, b"2", keep, Durability::Durable).unwrap();
        assert_eq!(
            (fs::read_to_string(&path).unwrap().as_str(), mode_of(&path)),
            ("2", 0o600)
        );
        replace_file(&path, b"3", FileMode::Set(0o644), Durability::Volatile).unwrap();
        assert_eq!(mode_of(&path), 0o644);
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["f.json"]);
    }

    #[test]
    fn a_temp_file_name_reads_back_as_the_name_it_replaces() {
        assert_eq!(temp_file_name("state.json", 77), ".state.json.gpu-mps.77.tmp");
        assert_eq!(
            replaced_by_temp_file(".state.json.gpu-mps.77.tmp"),
            Some("state.json")
        );
        assert_eq!(
            replaced_by_temp_file(".a.gpu-mps.b.gpu-mps.1.tmp"),
            Some("a.gpu-mps.b")
        );
        for other in [
            ".state.json.gpu-mps..tmp",
            ".state.json.gpu-mps.7x.tmp",
            "state.json.gpu-mps.7.tmp",
            "..gpu-mps.7.tmp",
            ".x.tmp",
        ] {
            assert_eq!(replaced_by_temp_file(other), None, "{other}");
        }
    }

    #[test]
    fn a_failed_replace_keeps_the_old_content() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub");
        fs::create_dir(&path).unwrap();
        // Renaming a file over a directory fails: the directory stays, no temp file stays.
        assert!(replace_file(&path, b"x", FileMode::Set(0o644), Durability::Volatile).is_err());
        assert!(path.is_dir());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn creates_every_missing_component_with_the_mode() {
        let dir = tempfile::tempdir().unwrap();
        let deep = dir.path().join("a/b/c");
        create_dirs(&deep, 0o755).unwrap();
        for p in [dir.path().join("a"), dir.path().join("a/b"), deep.clone()] {
            assert_eq!(mode_of(&p), 0o755, "{}", p.display());
        }
        create_dirs(&deep, 0o700).unwrap();
        assert_eq!(mode_of(&deep), 0o755, "existing directories are left alone");
    }

    #[test]
    fn a_leaf_in_private_parents_gets_its_own_mode() {
        let dir = tempfile::tempdir().unwrap();
        let gate = dir.path().join("root/gates/0123");
        create_dir_in_private_parents(&gate, GATE_DIR_MODE).unwrap();
        assert_eq!(mode_of(&dir.path().join("root")), 0o700);
        assert_eq!(mode_of(&dir.path().join("root/gates")), 0o700);
        assert_eq!(mode_of(&gate), 0o755);
        let other = dir.path().join("root/gates/4567");
        create_dir_in_private_parents(&other, GATE_DIR_MODE).unwrap();
        assert_eq!(mode_of(&other), 0o755);
    }
}
