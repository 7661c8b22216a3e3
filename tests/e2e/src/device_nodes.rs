//! Fake GPU device nodes for tests without a GPU: character devices with NVIDIA's major (195)
//! and a GPU's minor, made with mknod in a test's own directory, as the driver makes
//! /dev/nvidia<minor>.

use std::path::Path;

use anyhow::{Context, Result};
use nix::sys::stat::{Mode, SFlag, makedev, mknod};

/// The major of NVIDIA's device nodes.
pub const NVIDIA_MAJOR: u64 = 195;

/// Makes `path` a character device 195:<minor>, unless it exists.
pub fn make_gpu_node(path: &Path, minor: u32) -> Result<()> {
    if path.exists() {
        return Ok(());
    }
    mknod(
        path,
        SFlag::S_IFCHR,
        Mode::from_bits_truncate(0o666),
        makedev(NVIDIA_MAJOR, u64::from(minor)),
    )
    .with_context(|| format!("mknod {} c {NVIDIA_MAJOR} {minor}", path.display()))
}
