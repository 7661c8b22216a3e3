//! A test's private directory. containerd and runc mount things under it (overlay rootfs,
//! sandbox /dev/shm, bind mounts); whatever they leave mounted is unmounted before the
//! directory is removed, so a failed test does not leak mounts into the host.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use gpu_mps_checker::mountinfo;
use nix::mount::{MntFlags, umount2};

/// Set to keep the test directories (after unmounting) for a post-mortem.
pub const KEEP_ENV: &str = "GPU_MPS_E2E_KEEP";

#[derive(Debug)]
pub struct WorkDir {
    dir: Option<tempfile::TempDir>,
    path: PathBuf,
}

impl WorkDir {
    /// A fresh directory under the system temp dir. Keep `prefix` short: unix socket paths
    /// (containerd's, the MPS pipe dirs') must stay under 108 bytes.
    pub fn new(prefix: &str) -> Result<WorkDir> {
        let dir = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir()
            .context("creating a test directory")?;
        let path = dir.path().to_path_buf();
        Ok(WorkDir { dir: Some(dir), path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn join(&self, relative: impl AsRef<Path>) -> PathBuf {
        self.path.join(relative)
    }

    /// Unmounts everything at or below this directory, innermost first.
    pub fn unmount_all(&self) {
        unmount_below(&self.path);
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        self.unmount_all();
        if let Some(dir) = self.dir.take() {
            if std::env::var_os(KEEP_ENV).is_some() {
                eprintln!("kept {} ({KEEP_ENV} is set)", dir.keep().display());
            } else if let Err(e) = dir.close() {
                eprintln!("could not remove {}: {e}", self.path.display());
            }
        }
    }
}

/// Unmounts every mount point at or below `dir`, deepest first, lazily (a mount still busy
/// goes away once its last user does). Stacked mounts take several rounds.
pub fn unmount_below(dir: &Path) {
    for _ in 0..8 {
        let mut points: Vec<PathBuf> = mount_points()
            .into_iter()
            .filter(|p| p.starts_with(dir))
            .collect();
        if points.is_empty() {
            return;
        }
        points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for point in points {
            if let Err(e) = umount2(&point, MntFlags::MNT_DETACH) {
                eprintln!("umount {}: {e}", point.display());
            }
        }
    }
}

/// Mount points of this mount namespace.
fn mount_points() -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    mountinfo::parse_readable(&text)
        .into_iter()
        .map(|m| PathBuf::from(m.mount_point))
        .collect()
}
