//! A path of the host as this process sees it: the commands that run from a container (the
//! DaemonSet's install and uninstall, `gpu-mps node`) take `--host-root`, where the host's / is
//! mounted there.

use std::path::{Path, PathBuf};

/// `path` (a path on the host) under `host_root`; unchanged when the host's / is this one's.
pub fn on_host(host_root: &Path, path: &Path) -> PathBuf {
    if host_root == Path::new("/") {
        return path.to_path_buf();
    }
    host_root.join(path.strip_prefix("/").unwrap_or(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_path_is_found_under_the_host_root() {
        let run = Path::new("/run/gpu-mps/leases");
        assert_eq!(on_host(Path::new("/"), run), run);
        assert_eq!(
            on_host(Path::new("/host"), run),
            Path::new("/host/run/gpu-mps/leases")
        );
        assert_eq!(
            on_host(Path::new("/host"), Path::new("etc/x")),
            Path::new("/host/etc/x")
        );
    }
}
