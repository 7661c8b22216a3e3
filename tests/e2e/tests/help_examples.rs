//! Every binary's `--help` shows an example of its use (STYLE.md: `--help` has an example).
//! Runs the built binaries (see gpu_mps_e2e::binaries; `cargo build --workspace` first).

use std::path::Path;
use std::process::Command;

use gpu_mps_e2e::Binaries;

fn help_of(binary: &Path) -> String {
    let out = Command::new(binary)
        .arg("--help")
        .env_remove("GPU_MPS_CONFIG")
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", binary.display()));
    assert!(
        out.status.success(),
        "{} --help: {}: {}",
        binary.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn every_help_shows_an_example() {
    let bins = Binaries::locate().unwrap_or_else(|e| panic!("{e:#}"));
    let mut missing = Vec::new();
    for binary in [
        &bins.cli,
        &bins.manager,
        &bins.hook,
        &bins.device_plugin,
        &bins.shim,
    ] {
        let help = help_of(binary);
        let name = binary
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        // An example is a command line naming the binary itself, under an "Example" heading.
        let example = help
            .split_once("Example")
            .map(|(_, rest)| rest.lines().skip(1).any(|l| l.contains(&name)));
        if example != Some(true) {
            missing.push(format!("{name}:\n{help}"));
        }
    }
    assert!(
        missing.is_empty(),
        "--help without an example of its use:\n{}",
        missing.join("\n")
    );
}
