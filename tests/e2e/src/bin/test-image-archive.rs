//! Writes the e2e test image (image.rs: the static gpu-mps-checker as entrypoint, no registry)
//! as an OCI archive for `ctr images import`, for scripts that run a container without the Rust
//! harness (tests/deb.sh, in a fresh Debian root).
//!
//!   test-image-archive <gpu-mps-checker> <out.tar>
//!   ctr images import out.tar    # -> docker.io/gpu-mps/test:e2e

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use gpu_mps_e2e::image::{TEST_IMAGE, oci_archive};

fn main() -> Result<()> {
    let args: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    let [checker, out] = args.as_slice() else {
        bail!(
            "usage: test-image-archive <gpu-mps-checker> <out.tar> (example: test-image-archive target/x86_64-unknown-linux-gnu/debug/gpu-mps-checker /tmp/image.tar)"
        );
    };
    let archive = oci_archive(checker)?;
    std::fs::write(out, archive).with_context(|| format!("writing {}", out.display()))?;
    println!("{TEST_IMAGE}");
    Ok(())
}
