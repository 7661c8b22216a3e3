//! `--shim` defaults to the gpu-mps-shim next to the running gpu-mps, so that the Debian
//! package (/usr/bin) and the DaemonSet (/usr/local/bin) each register their own shim without
//! a flag. Checked with the binary linked into a directory of its own.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn containerd() -> PathBuf {
    let cache = std::env::var_os("GPU_MPS_CACHE").map_or_else(
        || PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".cache/gpu-mps"),
        PathBuf::from,
    );
    let binary = cache.join("containerd/bookworm/usr/bin/containerd");
    assert!(
        binary.is_file(),
        "{} is missing: run tests/support/fetch-containerd.sh (a private cache, nothing installed)",
        binary.display()
    );
    binary
}

/// A temporary directory on the file system of the built binary, so that it can be hard-linked.
fn temp_dir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temporary directory")
}

/// gpu-mps in `<dir>/bin`, where the kernel reports it as the running executable. A hard link,
/// not a copy: a copy's open write descriptor, inherited by a process another test forks at that
/// moment, would make exec fail with "Text file busy".
fn copied_gpu_mps(dir: &Path) -> PathBuf {
    let bin = dir.join("bin");
    fs::create_dir_all(&bin).expect("create the bin dir");
    let link = bin.join("gpu-mps");
    fs::hard_link(env!("CARGO_BIN_EXE_gpu-mps"), &link).expect("hard-link gpu-mps");
    link
}

fn run(binary: &Path, args: &[&str]) -> Output {
    Command::new(binary)
        .args(args)
        .env_remove("GPU_MPS_CONFIG")
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", binary.display()))
}

#[test]
fn install_containerd_registers_the_shim_next_to_gpu_mps() {
    let dir = temp_dir();
    let gpu_mps = copied_gpu_mps(dir.path());
    let main = dir.path().join("containerd.toml");
    // An explicit --containerd-config must exist (a missing one is refused as a typo).
    fs::write(&main, "").unwrap();
    let drop_in = dir.path().join("conf.d/gpu-mps.toml");
    let containerd = containerd();
    let out = run(
        &gpu_mps,
        &[
            "install-containerd",
            "--containerd-config",
            main.to_str().unwrap(),
            "--drop-in",
            drop_in.to_str().unwrap(),
            "--containerd",
            containerd.to_str().unwrap(),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let written = fs::read_to_string(&main).unwrap();
    let expected = format!(
        "BinaryName = \"{}\"",
        dir.path().join("bin/gpu-mps-shim").display()
    );
    assert!(
        written.contains(&expected),
        "{expected} not in {}:\n{written}",
        main.display()
    );
}

#[test]
fn doctor_and_the_registration_commands_show_that_default() {
    let dir = temp_dir();
    let gpu_mps = copied_gpu_mps(dir.path());
    let expected = format!("[default: {}]", dir.path().join("bin/gpu-mps-shim").display());
    for command in ["install-containerd", "uninstall-containerd", "doctor"] {
        let out = run(&gpu_mps, &[command, "--help"]);
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{command} --help: {help}");
        assert!(
            help.contains(&expected),
            "{command} --help lacks {expected}:\n{help}"
        );
    }
}
