//! The names the manager and the gate keeper use under the state root are those
//! gpu_mps_api::node_config::root_entries lists, which `gpu-mps node remove-state` removes by.
#![allow(clippy::unwrap_used)]

use gpu_mps_api::node_config::{self, is_root_entry};
use gpu_mps_manager::state::State;

#[test]
fn the_gate_keepers_and_the_managers_names_are_root_entries() {
    assert_eq!(
        gpu_mps_gate_keeper::SOCKET_NAME,
        node_config::GATE_KEEPER_SOCKET_FILE
    );
    assert_eq!(gpu_mps_gate_keeper::LOCK_NAME, node_config::GATE_KEEPER_LOCK_FILE);
    assert_eq!(
        gpu_mps_manager::node_guard::LOCK_FILE,
        node_config::MANAGER_LOCK_FILE
    );
    assert_eq!(
        gpu_mps_manager::gpu_backend::NVML_ERROR_FILE,
        node_config::NVML_ERROR_FILE
    );
}

#[test]
fn an_unusable_state_file_is_set_aside_under_a_root_entry_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(node_config::STATE_FILE);
    std::fs::write(&path, "{\"version\": 1, \"daemons\": {").unwrap();
    let (_, note) = State::load_or_set_aside(&path, 1_733_570_000);
    assert!(note.is_some(), "set aside");
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(!names.is_empty());
    for name in names {
        assert!(is_root_entry(&name), "{name} is not a root entry");
    }
}
