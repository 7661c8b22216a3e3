//! The manager's state on disk (`<root>/state.json`): written atomically after every change,
//! read at start so a restarted manager adopts the daemons and leases it had.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gpu_mps_api::files::{self, Durability, FileMode};
use gpu_mps_api::{DaemonKey, Limits};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::lease::LeaseRecord;
use crate::process_identity::ProcessIdentity;

const STATE_VERSION: u32 = 1;

#[derive(Debug, Error)]
pub enum StateError {
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path} is not a gpu-mps state file: {source}")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path} has state version {found}; this manager understands version {STATE_VERSION}")]
    Version { path: PathBuf, found: u32 },
    #[error("writing {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DaemonRecord {
    pub key: DaemonKey,
    pub control: ProcessIdentity,
    pub pipe_dir: PathBuf,
    pub log_dir: PathBuf,
    pub started_unix: i64,
    /// The limits last set on this daemon's servers and read back.
    pub applied: Option<Limits>,
    /// Set while no lease uses the daemon; it is stopped once idle_grace_seconds have passed.
    pub idle_since_unix: Option<i64>,
    /// Fatal GPU faults its server reported in server.log (crate::fault_watch).
    #[serde(default)]
    pub faults: u32,
    #[serde(default)]
    pub last_fault_unix: Option<i64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct State {
    pub version: u32,
    /// By DaemonKey::dir_name().
    pub daemons: BTreeMap<String, DaemonRecord>,
    /// By container id.
    pub leases: BTreeMap<String, LeaseRecord>,
    /// Compute modes found before the manager set EXCLUSIVE_PROCESS, by GPU UUID; kept across
    /// restarts so that the mode restored at the end is the operator's, not our own.
    pub saved_compute_modes: BTreeMap<String, String>,
}

impl Default for State {
    fn default() -> Self {
        State {
            version: STATE_VERSION,
            daemons: BTreeMap::new(),
            leases: BTreeMap::new(),
            saved_compute_modes: BTreeMap::new(),
        }
    }
}

impl State {
    /// Loads the state; a missing file is an empty state (first start, or after a reboot
    /// emptied /run).
    pub fn load(path: &Path) -> Result<State, StateError> {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(State::default()),
            Err(source) => {
                return Err(StateError::Read {
                    path: path.into(),
                    source,
                });
            }
        };
        State::from_bytes(&bytes, path)
    }

    /// Parses the content of a state file; `path` is only used in error messages. Pure, so that
    /// it is fuzzed on its own (fuzz/fuzz_targets/state.rs).
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<State, StateError> {
        let state: State = serde_json::from_slice(bytes).map_err(|source| StateError::Parse {
            path: path.into(),
            source,
        })?;
        if state.version != STATE_VERSION {
            return Err(StateError::Version {
                path: path.into(),
                found: state.version,
            });
        }
        Ok(state)
    }

    /// Loads the state, or starts from an empty one when the file cannot be used (corrupt,
    /// truncated, empty, another version, unreadable): a manager that refused to start would
    /// strand every GPU pod of the node. The unusable file is renamed aside, kept for a person to
    /// look at; the note says what happened, in one line. Running daemons are adopted again from
    /// their pid files when their GPUs are next used.
    pub fn load_or_set_aside(path: &Path, now_unix: i64) -> (State, Option<String>) {
        let error = match State::load(path) {
            Ok(state) => return (state, None),
            Err(e) => e,
        };
        let aside = path.with_extension(format!("json.unusable-{now_unix}"));
        let note = match std::fs::rename(path, &aside) {
            Ok(()) => format!(
                "{error}; rebuilding the leases from their own files and the daemons from their pid files (the file is kept as {})",
                aside.display()
            ),
            Err(e) => format!(
                "{error}; rebuilding the leases from their own files and the daemons from their pid files (the file could not be set aside: {e})"
            ),
        };
        (State::default(), Some(gpu_mps_api::message::one_line(&note)))
    }

    pub fn save(&self, path: &Path) -> Result<(), StateError> {
        StateOnDisk::new(self.daemons.values(), &self.leases, &self.saved_compute_modes).save(path)
    }

    pub fn leases_of<'a>(&'a self, key: &'a DaemonKey) -> impl Iterator<Item = &'a LeaseRecord> + 'a {
        self.leases.values().filter(move |l| &l.request.key == key)
    }
}

/// The state file's content, borrowed from where a running manager keeps it (the daemons in
/// crate::daemon_life, the leases in the books): the same JSON as [`State`]'s.
#[derive(Serialize)]
pub struct StateOnDisk<'a> {
    pub version: u32,
    /// By DaemonKey::dir_name().
    pub daemons: BTreeMap<String, &'a DaemonRecord>,
    pub leases: &'a BTreeMap<String, LeaseRecord>,
    pub saved_compute_modes: &'a BTreeMap<String, String>,
}

impl<'a> StateOnDisk<'a> {
    pub fn new(
        daemons: impl IntoIterator<Item = &'a DaemonRecord>,
        leases: &'a BTreeMap<String, LeaseRecord>,
        saved_compute_modes: &'a BTreeMap<String, String>,
    ) -> Self {
        StateOnDisk {
            version: STATE_VERSION,
            daemons: daemons.into_iter().map(|d| (d.key.dir_name(), d)).collect(),
            leases,
            saved_compute_modes,
        }
    }

    pub fn save(&self, path: &Path) -> Result<(), StateError> {
        let text = serde_json::to_vec_pretty(self).expect("state serializes");
        // Volatile: the state lives on tmpfs (/run/gpu-mps); see gpu_mps_api::files::Durability.
        files::replace_file(path, &text, FileMode::Set(0o600), Durability::Volatile).map_err(|source| {
            StateError::Write {
                path: path.into(),
                source,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state file written by commit 8214996's code (tests/fixtures/).
    const STATE_8214996: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/state-8214996.json");

    #[test]
    fn a_state_file_written_before_the_request_was_one_type_loads_whole() {
        // Written by commit 8214996 (tests/fixtures/): a manager upgraded over it adopts every
        // lease with what it held.
        let path = Path::new(STATE_8214996);
        let s = State::load(path).unwrap();
        let key = DaemonKey::new(["GPU-9e2f7c3d-0b4a-41e6-8d5c-2a7b9f1e3d02"]);
        assert_eq!(s.daemons[&key.dir_name()].faults, 1);
        assert_eq!(s.leases_of(&key).count(), 2);
        let units = &s.leases["aa00bb11cc22dd33"];
        assert_eq!(units.request.memory_units, [3, 4, 5]);
        assert_eq!(units.request.identity.namespace, "team-b");
        assert_eq!(units.request.limits.thread_percentage, 10);
        let plain = s.leases.values().find(|l| l.request.cuda_processes == 2).unwrap();
        assert_eq!(plain.request.per_process().memory_bytes, 2 << 30);
        assert_eq!(s.saved_compute_modes.len(), 1);
        // Saved again, it is the same JSON: a manager rolled back to that commit reads it.
        let again: serde_json::Value = serde_json::from_slice(&serde_json::to_vec(&s).unwrap()).unwrap();
        let old: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        assert_eq!(again, old);
    }

    #[test]
    fn the_borrowed_form_writes_the_same_json_as_the_state() {
        let path = Path::new(STATE_8214996);
        let s = State::load(path).unwrap();
        let borrowed = StateOnDisk::new(s.daemons.values(), &s.leases, &s.saved_compute_modes);
        assert_eq!(
            serde_json::to_string_pretty(&borrowed).unwrap(),
            serde_json::to_string_pretty(&s).unwrap()
        );
    }

    #[test]
    fn round_trip_and_missing_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        assert_eq!(State::load(&path).unwrap(), State::default());
        let mut s = State::default();
        let key = DaemonKey::new(["GPU-0"]);
        s.leases.insert(
            "c1".into(),
            LeaseRecord::for_test(
                "c1",
                key.clone(),
                Limits {
                    memory_bytes: 1 << 30,
                    thread_percentage: 10,
                },
                "ns",
            ),
        );
        s.saved_compute_modes.insert("GPU-0".into(), "Default".into());
        s.save(&path).unwrap();
        assert_eq!(State::load(&path).unwrap(), s);
        assert_eq!(s.leases_of(&key).count(), 1);
        assert!(
            !std::fs::read_dir(dir.path()).unwrap().any(|e| e
                .unwrap()
                .file_name()
                .to_string_lossy()
                .contains(".tmp"))
        );
    }

    #[test]
    fn refuses_garbage_and_other_versions() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        std::fs::write(&path, "{not json").unwrap();
        assert!(matches!(State::load(&path), Err(StateError::Parse { .. })));
        std::fs::write(
            &path,
            r#"{"version":99,"daemons":{},"leases":{},"saved_compute_modes":{}}"#,
        )
        .unwrap();
        assert!(matches!(
            State::load(&path),
            Err(StateError::Version { found: 99, .. })
        ));
    }

    #[test]
    fn from_bytes_reads_saved_state_and_refuses_other_bytes_in_one_line() {
        let path = Path::new("/run/gpu-mps/state.json");
        let mut s = State::default();
        s.saved_compute_modes.insert("GPU-0".into(), "Default".into());
        let saved = serde_json::to_vec_pretty(&s).unwrap();
        assert_eq!(State::from_bytes(&saved, path).unwrap(), s);
        for bad in [&b"\xff\xfe{}"[..], b"", b"[]", b"{\"version\":1}"] {
            let e = State::from_bytes(bad, path).unwrap_err();
            assert!(matches!(e, StateError::Parse { .. }), "{bad:?}: {e}");
            let text = e.to_string();
            assert!(
                text.starts_with("/run/gpu-mps/state.json is not a gpu-mps state file: ")
                    && !text.contains('\n'),
                "{text}"
            );
        }
    }

    #[test]
    fn an_unusable_state_file_is_set_aside_and_said_in_one_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        let good = serde_json::to_string(&State::default()).unwrap();
        let cases = [
            ("corrupt", "{ this is not json".to_string()),
            ("truncated", good[..good.len() / 2].to_string()),
            ("empty", String::new()),
            (
                "another version",
                good.replace(&format!("\"version\": {STATE_VERSION}"), "\"version\": 99")
                    .replace(&format!("\"version\":{STATE_VERSION}"), "\"version\":99"),
            ),
        ];
        for (i, (what, text)) in cases.iter().enumerate() {
            std::fs::write(&path, text).unwrap();
            let (state, note) = State::load_or_set_aside(&path, 1000 + i as i64);
            assert_eq!(state, State::default(), "{what}");
            let note = note.unwrap_or_else(|| panic!("{what}: no note"));
            assert!(
                note.contains("rebuilding the leases from their own files") && !note.contains('\n'),
                "{what}: {note}"
            );
            assert!(!path.exists(), "{what}: the file was not set aside");
            let aside = dir.path().join(format!("state.json.unusable-{}", 1000 + i));
            assert_eq!(std::fs::read_to_string(&aside).unwrap(), *text, "{what}");
        }
        // A good file loads as it is, with no note.
        std::fs::write(&path, &good).unwrap();
        assert_eq!(State::load_or_set_aside(&path, 5), (State::default(), None));
    }
}
