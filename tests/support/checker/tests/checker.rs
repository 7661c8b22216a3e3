//! Runs the built checker on the host and parses what it prints. The MPS subcommands are in
//! tests/mps.rs.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpu_mps_checker::{Exiting, Paused, Report, Sleeping, UsageError};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_gpu-mps-checker");

/// Runs the checker; returns (exit code, the one JSON object it printed).
fn run(args: &[&str], env: &[(&str, &str)]) -> (i32, Value) {
    let out = Command::new(BIN)
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("run checker");
    let stdout = String::from_utf8(out.stdout).expect("utf8");
    assert_eq!(stdout.lines().count(), 1, "exactly one line: {stdout:?}");
    let value = serde_json::from_str(&stdout).expect("json");
    (out.status.code().unwrap_or(-1), value)
}

/// The line read with the library's type: what the e2e tests do.
fn typed<T: DeserializeOwned>(v: &Value) -> T {
    serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("{e}: {v}"))
}

#[test]
fn report_describes_the_host() {
    let (code, v) = run(
        &["report"],
        &[
            ("CUDA_GPU_MPS_CHECKER_TEST", "yes"),
            ("NVIDIA_VISIBLE_DEVICES", "none"),
        ],
    );
    assert_eq!(code, 0);
    let report: Report = typed(&v);
    assert_eq!(report.env("NVIDIA_VISIBLE_DEVICES"), Some("none"));
    assert_eq!(v["uid"], json!(nix::unistd::getuid().as_raw()));
    assert_eq!(v["gid"], json!(nix::unistd::getgid().as_raw()));
    assert!(v["pid"].as_u64().is_some());
    assert!(
        v["cap_eff"].as_str().is_some_and(|c| c.len() == 16),
        "{}",
        v["cap_eff"]
    );
    assert_eq!(v["env"]["CUDA_GPU_MPS_CHECKER_TEST"], "yes");
    assert_eq!(v["env"]["NVIDIA_VISIBLE_DEVICES"], "none");
    assert!(v["env"].get("PATH").is_none());
    for ns in ["ipc", "pid", "mnt", "net", "uts", "user"] {
        let link = v["namespaces"][ns].as_str().expect(ns);
        assert!(link.starts_with(&format!("{ns}:[")), "{link}");
    }
    let mine = std::fs::read_link("/proc/self/ns/mnt").expect("ns");
    assert_eq!(v["namespaces"]["mnt"], json!(mine.to_string_lossy()));
    assert_eq!(
        v["hostname"],
        json!(
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .expect("hostname")
                .trim()
        )
    );

    let pipe = &v["mps_pipe_dir"];
    assert_eq!(pipe["path"], "/tmp/nvidia-mps");
    for key in ["exists", "is_mount_point", "control_exists", "control_is_socket"] {
        assert!(pipe[key].is_boolean(), "{key}: {pipe}");
    }
    assert!(pipe["create_file"].is_string(), "{pipe}");
    if !std::path::Path::new("/tmp/nvidia-mps").exists() {
        assert_eq!(pipe["create_file"], "ENOENT");
    }

    let shm = &v["dev_shm"];
    let marker = shm["marker"].as_str().expect("marker");
    assert!(marker.starts_with("/dev/shm/gpu-mps-checker-"), "{marker}");
    if shm["marker_created"] == json!(true) {
        // Same /dev/shm as ours: the marker is here. Clean it up.
        assert!(std::path::Path::new(marker).exists());
        std::fs::remove_file(marker).expect("remove marker");
        let st_dev = std::os::unix::fs::MetadataExt::dev(&std::fs::metadata("/dev/shm").expect("shm"));
        assert_eq!(shm["st_dev"], json!(st_dev));
        assert!(shm["mount"]["fstype"].is_string(), "{shm}");
        assert!(shm["mount"]["mount_id"].is_u64(), "{shm}");
    }

    let smi = v["nvidia_smi"].as_object().expect("nvidia_smi");
    assert_eq!(smi.len(), 5);
    for (path, entry) in smi {
        let exists = std::path::Path::new(path).exists();
        assert_eq!(entry["exists"], json!(exists), "{path}");
        assert!(entry["masked"].is_boolean());
    }
}

#[test]
fn exit_returns_the_code() {
    let (code, v) = run(&["exit", "3"], &[]);
    assert_eq!(code, 3);
    assert_eq!(typed::<Exiting>(&v).exit_code, 3);
}

#[test]
fn pid_and_sleep() {
    let (code, v) = run(&["pid"], &[]);
    assert_eq!(code, 0);
    assert!(typed::<gpu_mps_checker::Pid>(&v).pid > 1);
    let (code, v) = run(&["sleep", "0.1"], &[]);
    assert_eq!(code, 0);
    assert_eq!(typed::<Sleeping>(&v).sleep_seconds, 0.1);
}

#[test]
fn bad_arguments_are_exit_2_with_json() {
    for args in [
        &["frobnicate"][..],
        &["exit", "x"],
        &["sleep"],
        &["mps-client", "--hold-seconds", "-1"],
        &["mps-ui"],
        &["mps-stall"],
        &["mps-stall", "--connections", "3"],
        &["mps-stall", "--connections", "x", "--hold-seconds", "1"],
        &[
            "mps-stall",
            "--connections",
            "3",
            "--hold-seconds",
            "1",
            "--bogus",
        ],
        &["mps-processes"],
        &["mps-processes", "--count", "2", "--count", "3"],
        &["mps-raw"],
        &["mps-raw", "--kind"],
        &["report", "--hold-seconds", "x"],
        &["report", "extra"],
        &[],
    ] {
        let (code, v) = run(args, &[]);
        assert_eq!(code, 2, "{args:?}");
        assert!(typed::<UsageError>(&v).error.contains("usage"), "{v}");
    }
}

#[test]
fn pause_exits_0_on_sigterm_and_sigint_at_once() {
    for signal in [Signal::SIGTERM, Signal::SIGINT] {
        let mut child = Command::new(BIN)
            .arg("pause")
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read");
        let v: Value = serde_json::from_str(&line).expect("json");
        assert!(typed::<Paused>(&v).paused);
        // Not on the first signal of another kind.
        kill(Pid::from_raw(child.id() as i32), Signal::SIGCHLD).expect("kill");
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            child.try_wait().expect("try_wait").is_none(),
            "pause exited on SIGCHLD"
        );
        let sent = Instant::now();
        kill(Pid::from_raw(child.id() as i32), signal).expect("kill");
        let status = child.wait().expect("wait");
        assert!(status.success(), "{signal}: {status}");
        assert!(sent.elapsed() < Duration::from_secs(1));
    }
}

#[test]
fn sleep_and_a_held_report_are_cut_short_by_sigterm() {
    for args in [&["sleep", "30"][..], &["report", "--hold-seconds", "30"]] {
        let mut child = Command::new(BIN)
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read");
        assert!(line.starts_with('{'), "{args:?}: {line:?}");
        let sent = Instant::now();
        kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).expect("kill");
        let status = child.wait().expect("wait");
        assert_eq!(status.code(), Some(128 + 15), "{args:?}");
        assert!(sent.elapsed() < Duration::from_secs(1), "{args:?}");
    }
}
