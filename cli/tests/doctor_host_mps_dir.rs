//! `gpu-mps doctor` on a node whose runc_path chains the NVIDIA Container Toolkit: it fails while
//! the host has the dir the toolkit's legacy hook binds over every GPU container's gate
//! (/tmp/nvidia-mps; `--host-mps-dir` points it at a scratch dir, so the host's is never made).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Output;

fn doctor(dir: &Path, host_mps_dir: &Path) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_gpu-mps"))
        .arg("--config")
        .arg(dir.join("config.toml"))
        .arg("doctor")
        .arg("--cdi-dir")
        .arg(dir.join("cdi"))
        .arg("--containerd")
        .arg(dir.join("no-containerd"))
        .arg("--containerd-config")
        .arg(dir.join("containerd.toml"))
        .arg("--host-mps-dir")
        .arg(host_mps_dir)
        .env_remove("GPU_MPS_CONFIG")
        .output()
        .expect("run gpu-mps doctor")
}

fn host_mps_dir_line(out: &Output) -> String {
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find(|l| l.split_whitespace().nth(1) == Some("host-mps-dir"))
        .unwrap_or_else(|| panic!("no host-mps-dir line:\n{text}"))
        .to_string()
}

#[test]
fn a_chained_toolkit_with_a_host_mps_dir_fails_the_doctor() {
    let dir = tempfile::Builder::new()
        .prefix("doctor")
        .tempdir_in("/tmp")
        .expect("tempdir");
    let toolkit = dir.path().join("nvidia-container-runtime");
    fs::write(&toolkit, "#!/bin/sh\nexit 0\n").expect("toolkit");
    fs::set_permissions(&toolkit, fs::Permissions::from_mode(0o755)).expect("chmod");
    fs::create_dir(dir.path().join("r")).expect("root");
    fs::write(
        dir.path().join("config.toml"),
        format!(
            "root = \"{}\"\nrunc_path = \"{}\"\n",
            dir.path().join("r").display(),
            toolkit.display()
        ),
    )
    .expect("config");
    let host_dir = dir.path().join("nvidia-mps");

    let absent = host_mps_dir_line(&doctor(dir.path(), &host_dir));
    assert!(absent.starts_with("PASS host-mps-dir"), "{absent}");

    fs::create_dir(&host_dir).expect("host dir");
    let out = doctor(dir.path(), &host_dir);
    let line = host_mps_dir_line(&out);
    assert_eq!(out.status.code(), Some(1), "{line}");
    assert!(
        line.starts_with("FAIL host-mps-dir")
            && line.contains(&format!("{} (a directory)", host_dir.display()))
            && line.contains("binds it over each GPU container's gate")
            && line.contains(&format!("Fix: remove {} from the host", host_dir.display())),
        "{line}"
    );
}
