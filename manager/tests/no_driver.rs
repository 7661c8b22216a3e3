//! gpu-mps-manager on a node where NVML does not load (no NVIDIA driver, as on CI machines): it
//! exits with NVML's reason and leaves it in `<root>/nvml-error`, so that the shim tells a GPU
//! pod the node has no driver instead of "the manager is probably not running". Skipped where
//! NVML loads (a GPU machine).

use std::process::Command;
use std::time::{Duration, Instant};

use gpu_mps_api::node_files::{NVML_ERROR_FILE, load_inventory};

#[test]
fn without_nvml_the_manager_leaves_its_reason_for_the_shim() {
    if nvml_wrapper::Nvml::init().is_ok() {
        println!("skipped: NVML loads on this machine");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().join("root");
    let config = dir.path().join("config.toml");
    std::fs::write(&config, format!("root = {:?}\n", root.display().to_string())).expect("config");
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpu-mps-manager"))
        .arg("--config")
        .arg(&config)
        .env("GPU_MPS_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start gpu-mps-manager");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("gpu-mps-manager still runs without NVML after 30 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success(), "gpu-mps-manager started without NVML");
    let reason = std::fs::read_to_string(root.join(NVML_ERROR_FILE)).expect("the NVML error file");
    assert!(
        reason.contains("NVML") && reason.ends_with('\n') && reason.lines().count() == 1,
        "{reason:?}"
    );

    let e = load_inventory(&root.join("inventory.json"))
        .expect_err("no inventory")
        .to_string();
    assert!(
        e.contains("no usable NVIDIA driver") && !e.contains("not running"),
        "{e}"
    );
}
