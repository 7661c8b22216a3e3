//! What gpu-mps keeps directly under the state root (`root` in the node config): the manager's
//! files and dirs, and the gate keeper's it starts. Named once here: the path functions of
//! [`NodeConfig`](super::NodeConfig) join these names, and `gpu-mps node remove-state` removes
//! by this list only, so that a root shared with other files (`root = "/run"`) loses nothing
//! else. A new entry under the root is a constant here and a name in [`ROOT_ENTRIES`]; the
//! tests check that every path function's name is in it.

use crate::files;

/// The manager's ttrpc socket.
pub const MANAGER_SOCKET_FILE: &str = "manager.sock";
/// Whose exclusive lock (flock) a running manager holds, with its pid as content: one manager
/// per root (gpu-mps-manager's node_guard).
pub const MANAGER_LOCK_FILE: &str = "manager.lock";
/// The manager's books: daemons and leases.
pub const STATE_FILE: &str = "state.json";
/// The GPU inventory the manager publishes for the shim and the device plugin.
pub const INVENTORY_FILE: &str = "inventory.json";
/// File name of the published config, under the root.
pub const PUBLISHED_CONFIG_FILE: &str = "node-config.json";
/// Written by gpu-mps-manager next to the inventory when NVML does not load (no NVIDIA driver, or
/// a library that does not match the kernel module), with NVML's reason on one line; removed at
/// a start where NVML loads. It is how the shim, which never loads NVML, tells a pod that the node
/// has no driver rather than that the manager is not running.
pub const NVML_ERROR_FILE: &str = "nvml-error";
/// The gate keeper's socket (gpu-mps-gate-keeper's SOCKET_NAME; the manager's tests check that
/// both agree).
pub const GATE_KEEPER_SOCKET_FILE: &str = "gate-keeper.sock";
/// Held (flock) by the running gate keeper (gpu-mps-gate-keeper's LOCK_NAME).
pub const GATE_KEEPER_LOCK_FILE: &str = "gate-keeper.lock";
/// One dir per MPS control daemon, with its pipe and log dirs.
pub const DAEMONS_DIR: &str = "daemons";
/// One gate dir per container.
pub const GATES_DIR: &str = "gates";
/// One file per recorded lease.
pub const LEASES_DIR: &str = "leases";

/// Every entry of the root that is gpu-mps's by its exact name.
pub const ROOT_ENTRIES: [&str; 11] = [
    MANAGER_SOCKET_FILE,
    MANAGER_LOCK_FILE,
    STATE_FILE,
    INVENTORY_FILE,
    PUBLISHED_CONFIG_FILE,
    NVML_ERROR_FILE,
    GATE_KEEPER_SOCKET_FILE,
    GATE_KEEPER_LOCK_FILE,
    DAEMONS_DIR,
    GATES_DIR,
    LEASES_DIR,
];

/// An unusable state file, set aside by the manager for a person to read as
/// `state.json.unusable-<unix time>` (gpu-mps-manager's State::load_or_set_aside).
const SET_ASIDE_STATE_PREFIX: &str = "state.json.unusable-";

/// Whether the root's entry `name` is gpu-mps's: one of [`ROOT_ENTRIES`], a state file set
/// aside, or what a writer killed mid-write left of one (the temp file of
/// [`files::replace_file`], the gate keeper's socket before its rename).
pub fn is_root_entry(name: &str) -> bool {
    ROOT_ENTRIES.contains(&name)
        || name
            .strip_prefix(SET_ASIDE_STATE_PREFIX)
            .is_some_and(|time| !time.is_empty() && time.bytes().all(|b| b.is_ascii_digit()))
        || files::replaced_by_temp_file(name).is_some_and(|target| ROOT_ENTRIES.contains(&target))
        || is_gate_keeper_socket_before_rename(name)
}

/// The gate keeper binds its socket as `.gate-keeper.sock.new` and renames it into place
/// (gate-keeper/src/keeper.rs, bind_private).
fn is_gate_keeper_socket_before_rename(name: &str) -> bool {
    name.strip_prefix('.')
        .and_then(|n| n.strip_suffix(".new"))
        .is_some_and(|n| n == GATE_KEEPER_SOCKET_FILE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_managers_names_and_what_its_writers_leave_are_entries_and_nothing_else() {
        for name in ROOT_ENTRIES {
            assert!(is_root_entry(name), "{name}");
        }
        for name in [
            "state.json.unusable-1733570000",
            ".gate-keeper.sock.new",
            &files::temp_file_name(STATE_FILE, 4242),
            &files::temp_file_name(PUBLISHED_CONFIG_FILE, 1),
        ] {
            assert!(is_root_entry(name), "{name}");
        }
        for name in [
            "",
            "other",
            "state.json.bak",
            "state.json.unusable-",
            "state.json.unusable-12x",
            ".manager.sock.new",
            &files::temp_file_name("config.toml", 4242),
            "daemons.old",
            "containerd",
        ] {
            assert!(!is_root_entry(name), "{name}");
        }
    }
}
