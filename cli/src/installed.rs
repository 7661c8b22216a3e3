//! Where the gpu-mps binaries are installed: /usr/bin from the Debian package, /usr/local/bin
//! from the DaemonSet's init container (or wherever an admin copied them). All four always lie
//! in one directory, so `gpu-mps` finds gpu-mps-shim next to itself, and the containerd entry
//! that `install-containerd` writes names the shim of the same installation.

use std::path::{Path, PathBuf};

use crate::containerd_registration::SHIM_PATH;

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
}
