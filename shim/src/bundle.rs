//! The shim's file system work: read a bundle's config.json, replace it atomically, and create
//! the container's gate dir that runc bind-mounts.

use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use gpu_mps_api::files::{self, Durability, FileMode};

use thiserror::Error;

pub const CONFIG_FILE: &str = "config.json";
/// The largest config.json the shim reads. containerd writes tens of KiB (Kubernetes caps a
/// pod's annotations at 256 KiB together); anything near this is not a spec a runtime wrote,
/// and the shim, which parses it whole, must not take the node's memory for it.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

#[derive(Debug, Error)]
pub enum BundleError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error(
        "{path} is larger than {}, the most gpu-mps-shim reads as a container spec (a config.json from containerd is tens of Ki: check what wrote it)",
        gpu_mps_api::quantity::format_bytes(MAX_CONFIG_BYTES)
    )]
    TooLarge { path: PathBuf },
    #[error("{path} is not UTF-8 text, which JSON and so a container spec must be: {error}")]
    NotUtf8 {
        path: PathBuf,
        error: std::str::Utf8Error,
    },
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
    #[error("cannot create the container's MPS gate dir {path}: {source}")]
    GateDir { path: PathBuf, source: io::Error },
}

pub fn config_path(bundle: &Path) -> PathBuf {
    bundle.join(CONFIG_FILE)
}

pub fn read_config(bundle: &Path) -> Result<String, BundleError> {
    let path = config_path(bundle);
    let read = |source| BundleError::Read {
        path: path.clone(),
        source,
    };
    let mut bytes = Vec::new();
    // One byte past the cap tells a file at the cap from a larger one without reading the rest.
    fs::File::open(&path)
        .and_then(|file| file.take(MAX_CONFIG_BYTES + 1).read_to_end(&mut bytes))
        .map_err(read)?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(BundleError::TooLarge { path });
    }
    String::from_utf8(bytes).map_err(|e| BundleError::NotUtf8 {
        path,
        error: e.utf8_error(),
    })
}

/// Replaces config.json with `text`, keeping its mode and owner: runc never sees a partial file,
/// and a shim killed mid-write leaves the old spec. No fsync: bundles live on tmpfs
/// (/run/containerd) on a node (see gpu_mps_api::files::Durability).
pub fn write_config_atomically(bundle: &Path, text: &str) -> Result<(), BundleError> {
    let path = config_path(bundle);
    // Replace, never create: a bundle without config.json is not one runc can create from.
    let keep = FileMode::KeepExisting { default: 0o644 };
    fs::metadata(&path)
        .and_then(|_| files::replace_file(&path, text.as_bytes(), keep, Durability::Volatile))
        .map_err(|source| BundleError::Write { path, source })
}

/// `mkdir -p` of the container's gate dir, whatever the umask: the gate dir 0755 (the root of
/// the container's /tmp/nvidia-mps, which its processes of any uid traverse), each missing
/// parent (the state root, `gates`) 0700, so that host users reach no gate.
pub fn create_gate_dir(path: &Path) -> Result<(), BundleError> {
    files::create_dir_in_private_parents(path, files::GATE_DIR_MODE).map_err(|source| BundleError::GateDir {
        path: path.to_path_buf(),
        source,
    })
}

/// Removes `dir` when it is an empty gate dir that no gate serves (no socket in it). True if it
/// was removed; false when it is served or absent. Never recursive: a dir with anything in it
/// is not one this shim left.
pub fn remove_unserved_gate_dir(dir: &Path) -> std::io::Result<bool> {
    if dir.join(gpu_mps_api::node_config::GATE_SOCKET).exists() {
        return Ok(false);
    }
    match fs::remove_dir(dir) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn replaces_config_keeping_its_mode() {
        let dir = tempfile::tempdir().unwrap();
        let path = config_path(dir.path());
        fs::write(&path, "{}").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        write_config_atomically(dir.path(), "{\"a\":1}\n").unwrap();
        assert_eq!(read_config(dir.path()).unwrap(), "{\"a\":1}\n");
        assert_eq!(mode(&path), 0o600);
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        write_config_atomically(dir.path(), "{}").unwrap();
        assert_eq!(mode(&path), 0o644);
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, [CONFIG_FILE], "no temp file is left behind");
    }

    #[test]
    fn a_missing_config_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let e = read_config(dir.path()).unwrap_err().to_string();
        assert!(e.contains("config.json"), "{e}");
        let e = write_config_atomically(dir.path(), "{}").unwrap_err().to_string();
        assert!(e.contains("config.json"), "{e}");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_config_larger_than_the_cap_is_refused_in_one_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = config_path(dir.path());
        // Sparse: no disk is used for the zeros.
        let file = fs::File::create(&path).unwrap();
        file.set_len(MAX_CONFIG_BYTES).unwrap();
        assert_eq!(read_config(dir.path()).unwrap().len() as u64, MAX_CONFIG_BYTES);
        file.set_len(MAX_CONFIG_BYTES + 1).unwrap();
        let e = read_config(dir.path()).unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "{} is larger than 16Mi, the most gpu-mps-shim reads as a container spec (a config.json from containerd is tens of Ki: check what wrote it)",
                path.display()
            )
        );
    }

    #[test]
    fn a_config_that_is_not_utf8_is_refused_in_one_line() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(config_path(dir.path()), b"{\"a\":\"\xff\"}").unwrap();
        let e = read_config(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("config.json") && e.contains("UTF-8") && !e.contains('\n'),
            "{e}"
        );
    }

    #[test]
    fn the_gate_dir_is_0755_under_0700_parents() {
        let dir = tempfile::tempdir().unwrap();
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o750)).unwrap();
        let gate = dir.path().join("root/gates/0123456789abcdef");
        create_gate_dir(&gate).unwrap();
        for (p, wanted) in [
            ("root", 0o700),
            ("root/gates", 0o700),
            ("root/gates/0123456789abcdef", 0o755),
        ] {
            assert_eq!(mode(&dir.path().join(p)), wanted, "{p}");
        }
        assert_eq!(mode(dir.path()), 0o750, "existing components are left alone");
        create_gate_dir(&gate).unwrap();
    }

    #[test]
    fn gate_dir_under_a_file_fails() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("file"), "").unwrap();
        let e = create_gate_dir(&dir.path().join("file/gate"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("file/gate"), "{e}");
    }

    #[test]
    fn only_an_unserved_empty_gate_dir_is_removed() {
        let root = tempfile::tempdir().unwrap();
        let unserved = root.path().join("unserved");
        fs::create_dir(&unserved).unwrap();
        assert!(remove_unserved_gate_dir(&unserved).unwrap());
        assert!(!unserved.exists());
        assert!(
            !remove_unserved_gate_dir(&unserved).unwrap(),
            "absent: nothing to do"
        );
        let served = root.path().join("served");
        fs::create_dir(&served).unwrap();
        fs::write(served.join(gpu_mps_api::node_config::GATE_SOCKET), "").unwrap();
        assert!(!remove_unserved_gate_dir(&served).unwrap());
        assert!(served.is_dir(), "a served gate dir is the manager's");
        let other = root.path().join("other");
        fs::create_dir(&other).unwrap();
        fs::write(other.join("x"), "").unwrap();
        assert!(remove_unserved_gate_dir(&other).is_err(), "never recursive");
        assert!(other.join("x").exists());
    }
}
