//! `gpu-mps config get|show`: what scripts read instead of parsing the TOML.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

fn gpu_mps(config: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-mps"))
        .arg("--config")
        .arg(config)
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn a_value_is_the_files_else_its_default_and_a_typo_fails_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        "root = \"/run/x\"\n[limits]\npolicy = \"uniform\"\n[gate]\nqueue_timeout_seconds = 12\n",
    )
    .unwrap();
    assert_eq!(gpu_mps(&config, &["config", "get", "root"]).1, "/run/x\n");
    assert_eq!(
        gpu_mps(&config, &["config", "get", "limits.policy"]).1,
        "uniform\n"
    );
    assert_eq!(
        gpu_mps(&config, &["config", "get", "gate.queue_timeout_seconds"]).1,
        "12\n"
    );
    assert_eq!(
        gpu_mps(&config, &["config", "get", "runc_path"]).1,
        "/usr/sbin/runc\n"
    );

    let (ok, out, err) = gpu_mps(&config, &["config", "get", "limits.polcy"]);
    assert!(!ok && out.is_empty());
    assert!(
        err.contains("no setting limits.polcy (did you mean limits.policy?)"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");

    let (ok, show, _) = gpu_mps(&config, &["config", "show"]);
    assert!(ok);
    let shown: serde_json::Value = serde_json::from_str(&show).unwrap();
    assert_eq!(shown["gate"]["queue_timeout_seconds"], 12);

    // No file: every default, as the manager would run.
    let none = dir.path().join("absent.toml");
    assert_eq!(gpu_mps(&none, &["config", "get", "root"]).1, "/run/gpu-mps\n");
    // A file with a typo is refused, never read around.
    std::fs::write(&config, "rot = \"/run/x\"\n").unwrap();
    let (ok, _, err) = gpu_mps(&config, &["config", "get", "root"]);
    assert!(!ok && err.contains("unknown field `rot`"), "{err}");
}
