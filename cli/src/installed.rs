//! Where the gpu-mps binaries are installed: /usr/bin from the Debian package, /usr/local/bin
//! from the DaemonSet's init container (or wherever an admin copied them). All four always lie
//! in one directory, so `gpu-mps` finds gpu-mps-shim next to itself, and the containerd entry
//! that `install-containerd` writes names the shim of the same installation.

use std::path::{Path, PathBuf};

use crate::containerd_registration::SHIM_PATH;
use crate::doctor::{FileState, file_state};

/// The file name of the runc wrapper that containerd's entry names as BinaryName.
pub const SHIM_NAME: &str = "gpu-mps-shim";

/// gpu-mps-shim next to `exe` (the running gpu-mps), or [`SHIM_PATH`] when the running binary's
/// path is unknown (no /proc, as in some chroots): the DaemonSet's path, the older default.
pub fn shim_next_to(exe: Option<&Path>) -> PathBuf {
    exe.and_then(Path::parent)
        .filter(|dir| dir.is_absolute())
        .map_or_else(|| PathBuf::from(SHIM_PATH), |dir| dir.join(SHIM_NAME))
}

/// The default of `--shim`: gpu-mps-shim next to this gpu-mps (symbolic links resolved, as the
/// kernel reports the executable).
pub fn default_shim_path() -> PathBuf {
    shim_next_to(std::env::current_exe().ok().as_deref())
}

/// Why the shim the entry names cannot run, if it cannot: containerd takes the entry either way,
/// and every pod of the runtime then fails at its start with "no such file". `on_host` is where
/// `shim` lies as this process sees the host (under --host-root).
pub fn shim_warning(shim: &Path, on_host: &Path) -> Option<String> {
    let problem = match file_state(on_host) {
        FileState::Executable { .. } => return None,
        FileState::NotExecutable { .. } => "is not executable",
        FileState::NotAFile { .. } => "is not a file",
        FileState::Missing { .. } => "does not exist",
        FileState::Unreadable(_) => "cannot be read",
    };
    let seen = if on_host == shim {
        String::new()
    } else {
        format!(" (looked at {})", on_host.display())
    };
    Some(format!(
        "{} {problem}{seen}: every pod of the gpu-mps runtime fails to start until gpu-mps-shim is there; install it (the gpu-mps package and the DaemonSet do), or rerun with --shim <its path>",
        shim.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shim_is_looked_for_next_to_the_running_binary() {
        assert_eq!(
            shim_next_to(Some(Path::new("/usr/bin/gpu-mps"))),
            Path::new("/usr/bin/gpu-mps-shim")
        );
        assert_eq!(
            shim_next_to(Some(Path::new("/usr/local/bin/gpu-mps"))),
            Path::new("/usr/local/bin/gpu-mps-shim")
        );
    }

    #[test]
    fn an_unknown_or_relative_location_falls_back_to_usr_local_bin() {
        assert_eq!(shim_next_to(None), Path::new(SHIM_PATH));
        assert_eq!(shim_next_to(Some(Path::new("gpu-mps"))), Path::new(SHIM_PATH));
    }

    #[test]
    fn a_missing_or_unrunnable_shim_is_named_with_the_fix() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let shim = dir.path().join("gpu-mps-shim");
        let missing = shim_warning(Path::new("/usr/bin/gpu-mps-shim"), &shim).expect("missing");
        assert!(
            missing.starts_with(&format!(
                "/usr/bin/gpu-mps-shim does not exist (looked at {})",
                shim.display()
            )),
            "{missing}"
        );
        assert!(missing.contains("--shim <its path>"), "{missing}");
        std::fs::write(&shim, "#!/bin/sh\n").expect("write");
        std::fs::set_permissions(&shim, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let plain = shim_warning(&shim, &shim).expect("not executable");
        assert!(
            plain.starts_with(&format!("{} is not executable:", shim.display())),
            "{plain}"
        );
        std::fs::set_permissions(&shim, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        assert_eq!(shim_warning(&shim, &shim), None);
        assert!(
            shim_warning(dir.path(), dir.path())
                .expect("dir")
                .contains("is not a file")
        );
    }
}
