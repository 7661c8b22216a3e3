//! `gpu-mps node remove-state`: the one removal of the state root that the Debian prerm and the
//! DaemonSet's uninstall run, against a root under a temporary host root.
#![allow(clippy::unwrap_used)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn remove_state(config: &Path, host_root: &Path, extra: &[&str]) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-mps"))
        .env("GPU_MPS_CONFIG", config)
        .args(["node", "remove-state", "--host-root"])
        .arg(host_root)
        .args(extra)
        .output()
        .unwrap();
    Run {
        code: out.status.code(),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}

/// A root as a stopped manager leaves it: its files, a daemon dir with its pid file, a gate dir.
fn managers_root(root: &Path, daemon_pid: u32) -> PathBuf {
    let pipe = root.join("daemons/GPU-a/pipe");
    fs::create_dir_all(&pipe).unwrap();
    fs::create_dir_all(root.join("daemons/GPU-a/log")).unwrap();
    fs::create_dir_all(root.join("gates/0123456789abcdef")).unwrap();
    fs::create_dir_all(root.join("leases")).unwrap();
    for file in ["state.json", "inventory.json", "node-config.json", "manager.lock"] {
        fs::write(root.join(file), "{}").unwrap();
    }
    fs::write(root.join("state.json.unusable-1733570000"), "{").unwrap();
    fs::write(
        pipe.join("nvidia-cuda-mps-control.pid"),
        format!("{daemon_pid}\n"),
    )
    .unwrap();
    pipe
}

#[test]
fn a_shared_root_loses_only_gpu_mps_entries_and_a_dry_run_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    fs::write(&config, "root = \"/run\"\n").unwrap();
    let host = dir.path().join("host");
    let root = host.join("run");
    managers_root(&root, 0);
    fs::write(root.join("utmp"), "someone else's").unwrap();

    let dry = remove_state(&config, &host, &["--dry-run"]);
    assert_eq!(dry.code, Some(0), "{}{}", dry.stdout, dry.stderr);
    assert!(
        dry.stdout
            .contains(&format!("would remove {}/daemons\n", root.display())),
        "{}",
        dry.stdout
    );
    assert!(
        dry.stdout.ends_with("dry run: nothing removed\n"),
        "{}",
        dry.stdout
    );
    assert!(root.join("state.json").exists() && root.join("daemons").exists());

    let run = remove_state(&config, &host, &[]);
    assert_eq!(run.code, Some(0), "{}{}", run.stdout, run.stderr);
    let names: Vec<_> = fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["utmp"]);
    assert!(
        run.stdout
            .contains(&format!("kept {}/utmp: not gpu-mps's\n", root.display())),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.ends_with(&format!(
            "kept the state root {}: it holds more than gpu-mps's files\n",
            root.display()
        )),
        "{}",
        run.stdout
    );
}

#[test]
fn a_running_mps_daemon_keeps_everything_with_status_3_until_it_ends() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    fs::write(&config, "root = \"/run/gpu-mps-custom\"\n").unwrap();
    let host = dir.path().join("host");
    let root = host.join("run/gpu-mps-custom");
    // The daemon names its pipe dir as the host does: /run/gpu-mps-custom/daemons/GPU-a/pipe.
    let mut daemon = Command::new("sleep")
        .arg("60")
        .env(
            "CUDA_MPS_PIPE_DIRECTORY",
            "/run/gpu-mps-custom/daemons/GPU-a/pipe",
        )
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    managers_root(&root, daemon.id());

    let refused = remove_state(&config, &host, &[]);
    assert_eq!(refused.code, Some(3), "{}{}", refused.stdout, refused.stderr);
    assert_eq!(refused.stdout, "");
    assert_eq!(refused.stderr.lines().count(), 1, "{}", refused.stderr);
    assert!(
        refused.stderr.starts_with(&format!(
            "gpu-mps: kept {}: the MPS control daemon of /run/gpu-mps-custom/daemons/GPU-a/pipe (pid {}) still runs",
            root.display(),
            daemon.id()
        )),
        "{}",
        refused.stderr
    );
    assert!(root.join("state.json").exists() && root.join("gates/0123456789abcdef").exists());

    daemon.kill().unwrap();
    daemon.wait().unwrap();
    // Its pid file stays and names a dead process now: the root goes.
    let run = remove_state(&config, &host, &[]);
    assert_eq!(run.code, Some(0), "{}{}", run.stdout, run.stderr);
    assert!(!root.exists(), "{}", run.stdout);
    assert!(
        run.stdout
            .ends_with(&format!("removed the state root {}\n", root.display())),
        "{}",
        run.stdout
    );
    assert!(host.join("run").exists(), "only the root goes, not its parent");

    let again = remove_state(&config, &host, &[]);
    assert_eq!(
        (again.code, again.stdout),
        (
            Some(0),
            format!("no state root {}: nothing to remove\n", root.display())
        )
    );
}
