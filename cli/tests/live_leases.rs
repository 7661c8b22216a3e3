//! `gpu-mps node live-leases`: the one check the Debian prerm and the DaemonSet's uninstall make
//! before gpu-mps goes from under running containers.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Stdio};

fn live_leases(config: &Path, host_root: Option<&Path>) -> (Option<i32>, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpu-mps"));
    cmd.arg("--config").arg(config).args(["node", "live-leases"]);
    if let Some(root) = host_root {
        cmd.arg("--host-root").arg(root);
    }
    let out = cmd.output().unwrap();
    (out.status.code(), String::from_utf8(out.stdout).unwrap())
}

/// `/proc/<pid>/stat`'s start time: what a lease names its container's process by.
fn start_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 1..];
    after.split_whitespace().nth(19).unwrap().parse().unwrap()
}

#[test]
fn a_running_container_is_listed_with_status_3_and_a_gone_one_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    std::fs::write(&config, "root = \"/run/gpu-mps-cli-test\"\n").unwrap();
    // The host's / at `host`, as the DaemonSet's uninstall sees it.
    let host = dir.path().join("host");
    let leases = host.join("run/gpu-mps-cli-test/leases");
    std::fs::create_dir_all(&leases).unwrap();
    assert_eq!(live_leases(&config, Some(&host)), (Some(0), String::new()));

    let mut container = Command::new("sleep")
        .arg("60")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let pid = container.id();
    let id = "4844287073c56bf2a1d0e9c3b7f6a5d4e3c2b1a0918273645546372819201a2b";
    let lease = format!(
        r#"{{"container_id":"{id}","key":["GPU-a"],"limits":{{"memory_bytes":4294967296,"thread_percentage":25}},
            "cuda_processes":1,"namespace":"team-a","pod":"infer","container_name":"c","bundle":"/b",
            "process":{{"pid":{pid},"start_ticks":{}}},"acquired_unix":1}}"#,
        start_ticks(pid)
    );
    std::fs::write(leases.join(gpu_mps_api::lease_record::lease_file_name(id)), lease).unwrap();
    let (code, out) = live_leases(&config, Some(&host));
    assert_eq!(code, Some(3), "{out}");
    assert_eq!(out, format!("{id} team-a/infer pid {pid} on GPU-a\n"));
    container.kill().unwrap();
    container.wait().unwrap();
    assert_eq!(live_leases(&config, Some(&host)), (Some(0), String::new()));
}
