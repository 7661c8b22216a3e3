//! Every binary's `--help`, and each of its subcommands' at every depth (`gpu-mps status --help`,
//! `gpu-mps node remove-state --help`), shows an
//! example of its use (STYLE.md: `--help` has an example).
//! Runs the built binaries (see gpu_mps_e2e::binaries; `cargo build --workspace` first).

use std::path::Path;
use std::process::Command;

use gpu_mps_e2e::Binaries;

fn help_of(binary: &Path, path: &[String]) -> String {
    let out = Command::new(binary)
        .args(path)
        .arg("--help")
        .env_remove("GPU_MPS_CONFIG")
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", binary.display()));
    assert!(
        out.status.success(),
        "{} {} --help: {}: {}",
        binary.display(),
        path.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The subcommands a clap `--help` lists under "Commands:", `help` itself left out.
fn subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| l.trim() != "Commands:")
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_help_shows_an_example() {
    let bins = Binaries::locate().unwrap_or_else(|e| panic!("{e:#}"));
    let mut missing = Vec::new();
    let mut seen = Vec::new();
    for binary in [
        &bins.cli,
        &bins.manager,
        &bins.hook,
        &bins.device_plugin,
        &bins.shim,
    ] {
        let name = binary
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        // Every level: `gpu-mps node` and `gpu-mps node remove-state` alike.
        let mut helps = Vec::new();
        let mut to_read: Vec<Vec<String>> = vec![Vec::new()];
        while let Some(path) = to_read.pop() {
            let help = help_of(binary, &path);
            for sub in subcommands(&help) {
                let mut deeper = path.clone();
                deeper.push(sub);
                to_read.push(deeper);
            }
            let what = std::iter::once(name.clone())
                .chain(path)
                .collect::<Vec<_>>()
                .join(" ");
            helps.push((what, help));
        }
        for (what, help) in helps {
            // An example is a command line naming the binary itself, under an "Example" heading.
            let example = help
                .split_once("Example")
                .map(|(_, rest)| rest.lines().skip(1).any(|l| l.contains(&name)));
            if example != Some(true) {
                missing.push(format!("{what}:\n{help}"));
            }
            seen.push(what);
        }
    }
    // The subcommands are found, not listed here: the CLI's and the hook's must be among them.
    for expected in [
        "gpu-mps status",
        "gpu-mps explain",
        "gpu-mps-hook poststop",
        "gpu-mps node remove-state",
        "gpu-mps config get",
    ] {
        assert!(
            seen.iter().any(|s| s == expected),
            "{expected} not found in {seen:?}"
        );
    }
    assert!(
        missing.is_empty(),
        "--help without an example of its use:\n{}",
        missing.join("\n")
    );
}
