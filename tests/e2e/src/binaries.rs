//! The workspace binaries under test, found in the cargo target dir the tests run from.
//!
//! Cargo builds an integration test's own package, not the other workspace binaries, so the
//! tests look for them and say which build command is missing.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// Overrides the static checker's path (e.g. a checker built elsewhere).
pub const CHECKER_ENV: &str = "GPU_MPS_E2E_CHECKER";
/// Takes gpu-mps-shim, gpu-mps-hook, gpu-mps-manager and gpu-mps from this directory instead of
/// the cargo profile dir, e.g. `target/dist` from scripts/build-release.sh (what ships).
pub const BIN_DIR_ENV: &str = "GPU_MPS_E2E_BIN_DIR";
/// The target the static checker is built for: a static glibc binary runs in any image.
pub const CHECKER_TARGET: &str = "x86_64-unknown-linux-gnu";
const BUILD_WORKSPACE: &str = "cargo build --workspace";
/// The command that builds the static checker.
pub const BUILD_CHECKER: &str = "RUSTFLAGS='-C target-feature=+crt-static' cargo build -p gpu-mps-checker --target x86_64-unknown-linux-gnu";

/// Paths of the gpu-mps binaries and the test doubles.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub shim: PathBuf,
    pub hook: PathBuf,
    pub manager: PathBuf,
    /// The `gpu-mps` CLI.
    pub cli: PathBuf,
    pub device_plugin: PathBuf,
    pub fake_mps_control: PathBuf,
    pub checker: PathBuf,
}

impl Binaries {
    /// All of them; the error names every missing one and the command that builds it.
    pub fn locate() -> Result<Binaries> {
        let profile = profile_dir()?;
        let product = std::env::var_os(BIN_DIR_ENV)
            .filter(|d| !d.is_empty())
            .map(PathBuf::from);
        let mut missing = Vec::new();
        let mut find = |name: &str| {
            let dir = match &product {
                Some(dir) if name != "fake-mps-control" => dir,
                _ => &profile,
            };
            let path = dir.join(name);
            if !path.is_file() {
                missing.push(path.display().to_string());
            }
            path
        };
        let (shim, hook, manager, cli, device_plugin, fake_mps_control) = (
            find("gpu-mps-shim"),
            find("gpu-mps-hook"),
            find("gpu-mps-manager"),
            find("gpu-mps"),
            find("gpu-mps-device-plugin"),
            find("fake-mps-control"),
        );
        let checker = checker();
        if !missing.is_empty() {
            bail!(
                "gpu-mps binaries missing ({}): build the workspace first: {BUILD_WORKSPACE}",
                missing.join(", ")
            );
        }
        Ok(Binaries {
            shim,
            hook,
            manager,
            cli,
            device_plugin,
            fake_mps_control,
            checker: checker?,
        })
    }
}

/// The static gpu-mps-checker that runs inside the test containers.
pub fn checker() -> Result<PathBuf> {
    let path = match std::env::var_os(CHECKER_ENV) {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => {
            let profile = profile_dir()?;
            let profile_name = profile.file_name().context("target profile dir has no name")?;
            let target = profile.parent().context("target profile dir has no parent")?;
            target
                .join(CHECKER_TARGET)
                .join(profile_name)
                .join("gpu-mps-checker")
        }
    };
    if !path.is_file() {
        bail!(
            "the static checker {} is missing: build it first: {BUILD_CHECKER}",
            path.display()
        );
    }
    if has_interpreter(&path)? {
        bail!(
            "{} is dynamically linked, it must be static to run in the test image: build it with {BUILD_CHECKER}",
            path.display()
        );
    }
    Ok(path)
}

/// `target/<profile>`: the test executable is `target/<profile>/deps/<test>-<hash>`.
fn profile_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the test executable")?;
    let deps = exe.parent().context("test executable has no parent dir")?;
    let profile = if deps.file_name().is_some_and(|n| n == "deps") {
        deps.parent()
    } else {
        Some(deps)
    };
    profile
        .map(Path::to_path_buf)
        .context("no cargo profile dir above the test executable")
}

/// Whether an ELF file asks for a program interpreter (ld.so): a dynamically linked binary.
fn has_interpreter(path: &Path) -> Result<bool> {
    const PT_INTERP: u32 = 3;
    let elf = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let u16_at = |o: usize| {
        elf.get(o..o + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]) as usize)
    };
    let u32_at = |o: usize| {
        elf.get(o..o + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let u64_at = |o: usize| {
        elf.get(o..o + 8)
            .map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as usize)
    };
    // ELF64, little endian: the only kind the checker target produces.
    if elf.get(..6) != Some(b"\x7fELF\x02\x01".as_slice()) {
        bail!("{} is not a 64-bit little-endian ELF binary", path.display());
    }
    let (Some(phoff), Some(phentsize), Some(phnum)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38)) else {
        bail!("{}: truncated ELF header", path.display());
    };
    Ok((0..phnum).any(|i| u32_at(phoff + i * phentsize) == Some(PT_INTERP)))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_test_binary_itself_is_dynamic() {
        let exe = std::env::current_exe().unwrap();
        assert!(super::has_interpreter(&exe).unwrap());
    }
}
