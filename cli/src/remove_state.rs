//! `gpu-mps node remove-state`: removes the manager's state root (`root` in the node config)
//! once gpu-mps is uninstalled, for the Debian package's prerm and the DaemonSet's uninstall,
//! which share this one rule:
//!
//! - only gpu-mps's own entries go (gpu_mps_api::node_config::root_entries), and the root itself
//!   only when nothing else was in it: a root set to a shared directory (`root = "/run"`) loses
//!   nothing else;
//! - nothing goes while the manager still runs from the root (it holds its lock), or while an MPS
//!   control daemon still does: the containers of its clients have its pipe dir mounted, and
//!   their CUDA calls go through it.
//!
//! [`survey`] reads the root, [`plan`] decides without touching anything, [`remove`] carries the
//! plan out.

use std::ffi::OsString;
use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

use gpu_mps_api::mps_pipe_dir::{self, PID_FILE};
use gpu_mps_api::node_config::{DAEMONS_DIR, MANAGER_LOCK_FILE, is_root_entry};
use gpu_mps_api::process_identity::is_running;
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum RemoveStateError {
    #[error("{action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

fn io_error(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> RemoveStateError {
    let path = path.to_path_buf();
    move |source| RemoveStateError::Io { action, path, source }
}

/// The state root, where this command finds it and as the node's processes name it: they
/// differ when the host's / is mounted elsewhere (`--host-root /host`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateRoot {
    /// The path this command reads and removes.
    pub on_disk: PathBuf,
    /// The config's `root`: what the MPS daemons have in their environment.
    pub named: PathBuf,
}

impl StateRoot {
    pub fn new(root: &Path, host_root: &Path) -> Self {
        StateRoot {
            on_disk: crate::host_paths::on_host(host_root, root),
            named: root.to_path_buf(),
        }
    }
}

/// Something still working in the root: each is a reason to remove nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InUse {
    /// gpu-mps-manager holds the root's lock.
    Manager { pid: Option<u32> },
    /// The pid file of `pipe_dir` names a running process that is that pipe dir's MPS control
    /// daemon.
    MpsDaemon { pipe_dir: PathBuf, pid: u32 },
    /// The pid file of `pipe_dir` names a running process whose environment cannot be read,
    /// which may be its daemon.
    MaybeMpsDaemon {
        pipe_dir: PathBuf,
        pid: u32,
        reason: String,
    },
}

impl InUse {
    /// One line: what runs, and what to do before running this again.
    pub fn line(&self, root: &Path) -> String {
        let root = root.display();
        match self {
            InUse::Manager { pid } => format!(
                "kept {root}: gpu-mps-manager{} still runs from it (it holds {root}/{MANAGER_LOCK_FILE}): stop it (systemctl stop gpu-mps-manager, or the gpu-mps DaemonSet's pod), then run this again",
                pid.map(|p| format!(" (pid {p})")).unwrap_or_default()
            ),
            InUse::MpsDaemon { pipe_dir, pid } => format!(
                "kept {root}: the MPS control daemon of {dir} (pid {pid}) still runs, for containers that have that dir mounted: once they are gone, stop it (echo quit | CUDA_MPS_PIPE_DIRECTORY={dir} nvidia-cuda-mps-control), then run this again",
                dir = pipe_dir.display()
            ),
            InUse::MaybeMpsDaemon {
                pipe_dir,
                pid,
                reason,
            } => format!(
                "kept {root}: cannot tell whether pid {pid}, named by {}, is its MPS control daemon: reading /proc/{pid}/environ: {reason} (run this as root)",
                pipe_dir.join(PID_FILE).display()
            ),
        }
    }
}

/// What [`survey`] found in an existing root.
#[derive(Debug, Default)]
pub struct Survey {
    /// The names directly under the root.
    pub entries: Vec<OsString>,
    pub in_use: Vec<InUse>,
    /// The manager's lock, taken by this command and held until it has removed the root: a
    /// manager starting meanwhile refuses (another one holds the root) instead of working in a
    /// root being removed.
    pub manager_lock: Option<Flock<File>>,
}

/// What to do with the root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// There is no root: nothing to do.
    NoRoot,
    /// Something still works in it: nothing is removed.
    Refused(Vec<InUse>),
    Remove {
        /// gpu-mps's entries, in the order they go.
        remove: Vec<OsString>,
        /// Everything else: not gpu-mps's, it stays.
        keep: Vec<OsString>,
        /// Whether the root goes too: only when nothing but gpu-mps's entries was in it.
        root_too: bool,
    },
}

/// Decides what goes; `None`: there is no root.
pub fn plan(survey: Option<&Survey>) -> Plan {
    let Some(survey) = survey else {
        return Plan::NoRoot;
    };
    if !survey.in_use.is_empty() {
        return Plan::Refused(survey.in_use.clone());
    }
    let (mut remove, mut keep): (Vec<OsString>, Vec<OsString>) = survey
        .entries
        .iter()
        .cloned()
        .partition(|name| name.to_str().is_some_and(is_root_entry));
    // The lock last: while it is there (held by this command), a manager that starts refuses.
    remove.sort_by_key(|name| (name == MANAGER_LOCK_FILE, name.clone()));
    keep.sort();
    let root_too = keep.is_empty();
    Plan::Remove {
        remove,
        keep,
        root_too,
    }
}

impl Plan {
    pub fn refused(&self) -> bool {
        matches!(self, Plan::Refused(_))
    }

    /// One line per entry removed or kept and a last one for the root (for a refusal, one line
    /// per reason); `dry_run`: what would be removed.
    pub fn lines(&self, root: &Path, dry_run: bool) -> Vec<String> {
        let shown = root.display();
        let removed = if dry_run { "would remove" } else { "removed" };
        match self {
            Plan::NoRoot => vec![format!("no state root {shown}: nothing to remove")],
            Plan::Refused(in_use) => in_use.iter().map(|u| u.line(root)).collect(),
            Plan::Remove {
                remove,
                keep,
                root_too,
            } => {
                let mut lines: Vec<String> = remove
                    .iter()
                    .map(|name| format!("{removed} {}", root.join(name).display()))
                    .chain(
                        keep.iter()
                            .map(|name| format!("kept {}: not gpu-mps's", root.join(name).display())),
                    )
                    .collect();
                lines.push(if *root_too {
                    format!("{removed} the state root {shown}")
                } else {
                    format!("kept the state root {shown}: it holds more than gpu-mps's files")
                });
                if dry_run {
                    lines.push("dry run: nothing removed".into());
                }
                lines
            }
        }
    }
}

/// Reads the root's entries and what still works in it; `None` when there is no root. Changes
/// nothing, but takes the manager's lock when it is free (see [`Survey::manager_lock`]).
pub fn survey(root: &StateRoot) -> Result<Option<Survey>, RemoveStateError> {
    let mut entries = match fs::read_dir(&root.on_disk) {
        Ok(dir) => dir
            .map(|e| e.map(|e| e.file_name()))
            .collect::<io::Result<Vec<_>>>()
            .map_err(io_error("listing", &root.on_disk))?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_error("listing", &root.on_disk)(e)),
    };
    entries.sort();
    let mut survey = Survey {
        entries,
        ..Survey::default()
    };
    let lock_path = root.on_disk.join(MANAGER_LOCK_FILE);
    match lock_manager(&lock_path)? {
        ManagerLock::Taken(lock) => survey.manager_lock = lock,
        ManagerLock::Held { pid } => survey.in_use.push(InUse::Manager { pid }),
    }
    survey.in_use.extend(running_daemons(root)?);
    Ok(survey.into())
}

enum ManagerLock {
    /// Free, now this command's (`None`: there is no lock file).
    Taken(Option<Flock<File>>),
    /// A running manager holds it; its pid is the file's content.
    Held { pid: Option<u32> },
}

fn lock_manager(path: &Path) -> Result<ManagerLock, RemoveStateError> {
    let file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(ManagerLock::Taken(None)),
        Err(e) => return Err(io_error("opening", path)(e)),
    };
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(ManagerLock::Taken(Some(lock))),
        Err((_, Errno::EWOULDBLOCK)) => Ok(ManagerLock::Held {
            pid: fs::read_to_string(path)
                .ok()
                .and_then(|text| text.trim().parse().ok()),
        }),
        Err((_, errno)) => Err(io_error("locking", path)(errno.into())),
    }
}

/// The MPS control daemons that run from `<root>/daemons/*/pipe`: a pid file naming a running
/// process that has that pipe dir in its environment (a pid the kernel gave to another process
/// since does not count, as the manager sees it).
fn running_daemons(root: &StateRoot) -> Result<Vec<InUse>, RemoveStateError> {
    let daemons = root.on_disk.join(DAEMONS_DIR);
    let mut dirs = match fs::read_dir(&daemons) {
        Ok(dir) => dir
            .map(|e| e.map(|e| e.file_name()))
            .collect::<io::Result<Vec<_>>>()
            .map_err(io_error("listing", &daemons))?,
        Err(e) if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::NotADirectory) => {
            return Ok(Vec::new());
        }
        Err(e) => return Err(io_error("listing", &daemons)(e)),
    };
    dirs.sort();
    let mut running = Vec::new();
    for name in dirs {
        let Some(pid) = mps_pipe_dir::read_pid_file(&daemons.join(&name).join("pipe")) else {
            continue;
        };
        if !is_running(pid) {
            continue;
        }
        let pipe_dir = root.named.join(DAEMONS_DIR).join(&name).join("pipe");
        match mps_pipe_dir::process_names_pipe_dir(pid, &pipe_dir) {
            Ok(true) => running.push(InUse::MpsDaemon { pipe_dir, pid }),
            Ok(false) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => running.push(InUse::MaybeMpsDaemon {
                pipe_dir,
                pid,
                reason: e.to_string(),
            }),
        }
    }
    Ok(running)
}

/// Carries out a [`Plan::Remove`] (any other plan removes nothing). An entry gone meanwhile is
/// not an error; a link is removed, never followed.
pub fn remove(root: &StateRoot, plan: &Plan) -> Result<(), RemoveStateError> {
    let Plan::Remove { remove, root_too, .. } = plan else {
        return Ok(());
    };
    for name in remove {
        let path = root.on_disk.join(name);
        let removed = match fs::symlink_metadata(&path) {
            Ok(m) if m.is_dir() => fs::remove_dir_all(&path),
            Ok(_) => fs::remove_file(&path),
            Err(e) => Err(e),
        };
        match removed {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(io_error("removing", &path)(e)),
            _ => {}
        }
    }
    if *root_too {
        fs::remove_dir(&root.on_disk).map_err(io_error("removing", &root.on_disk))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use gpu_mps_api::node_config::ROOT_ENTRIES;
    use std::process::{Child, Command};

    use super::*;

    fn names(names: &[&str]) -> Vec<OsString> {
        names.iter().map(OsString::from).collect()
    }

    fn survey_of(entries: &[&str], in_use: Vec<InUse>) -> Survey {
        Survey {
            entries: names(entries),
            in_use,
            manager_lock: None,
        }
    }

    #[test]
    fn a_root_of_only_gpu_mps_entries_goes_with_them_its_lock_last() {
        let mut entries: Vec<&str> = ROOT_ENTRIES.to_vec();
        entries.extend(["state.json.unusable-1733570000", ".state.json.gpu-mps.12.tmp"]);
        let plan = plan(Some(&survey_of(&entries, vec![])));
        let Plan::Remove {
            remove,
            keep,
            root_too,
        } = &plan
        else {
            panic!("{plan:?}")
        };
        assert_eq!(remove.len(), entries.len());
        assert_eq!(remove.last().unwrap(), MANAGER_LOCK_FILE);
        assert!(keep.is_empty() && *root_too);
        let lines = plan.lines(Path::new("/run/gpu-mps"), false);
        assert_eq!(lines.len(), entries.len() + 1);
        assert!(
            lines.contains(&"removed /run/gpu-mps/daemons".to_string()),
            "{lines:?}"
        );
        assert_eq!(lines.last().unwrap(), "removed the state root /run/gpu-mps");
    }

    #[test]
    fn a_shared_root_loses_only_gpu_mps_entries_and_stays() {
        let plan = plan(Some(&survey_of(
            &["containerd", "daemons", "manager.sock", "state.json", "utmp"],
            vec![],
        )));
        assert_eq!(
            plan,
            Plan::Remove {
                remove: names(&["daemons", "manager.sock", "state.json"]),
                keep: names(&["containerd", "utmp"]),
                root_too: false,
            }
        );
        assert_eq!(
            plan.lines(Path::new("/run"), true),
            [
                "would remove /run/daemons",
                "would remove /run/manager.sock",
                "would remove /run/state.json",
                "kept /run/containerd: not gpu-mps's",
                "kept /run/utmp: not gpu-mps's",
                "kept the state root /run: it holds more than gpu-mps's files",
                "dry run: nothing removed",
            ]
        );
    }

    #[test]
    fn a_running_daemon_or_manager_removes_nothing_and_says_each_in_one_line() {
        let pipe_dir = PathBuf::from("/run/gpu-mps/daemons/GPU-a/pipe");
        let in_use = vec![
            InUse::Manager { pid: Some(7) },
            InUse::MpsDaemon {
                pipe_dir: pipe_dir.clone(),
                pid: 42,
            },
            InUse::MaybeMpsDaemon {
                pipe_dir,
                pid: 43,
                reason: "Permission denied".into(),
            },
        ];
        let plan = plan(Some(&survey_of(&["daemons", "state.json"], in_use.clone())));
        assert_eq!(plan, Plan::Refused(in_use));
        let lines = plan.lines(Path::new("/run/gpu-mps"), false);
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert!(
            lines
                .iter()
                .all(|l| l.starts_with("kept /run/gpu-mps: ") && !l.contains('\n'))
        );
        assert!(
            lines[0].contains("gpu-mps-manager (pid 7) still runs"),
            "{}",
            lines[0]
        );
        assert!(
            lines[1].contains("/run/gpu-mps/daemons/GPU-a/pipe (pid 42) still runs"),
            "{}",
            lines[1]
        );
        assert!(
            lines[2].contains("pid 43") && lines[2].contains("Permission denied"),
            "{}",
            lines[2]
        );
    }

    #[test]
    fn no_root_is_nothing_to_do() {
        assert_eq!(plan(None), Plan::NoRoot);
        assert_eq!(
            plan(None).lines(Path::new("/run/gpu-mps"), false),
            ["no state root /run/gpu-mps: nothing to remove"]
        );
    }

    fn sleeper(pipe_dir: Option<&Path>) -> Child {
        let mut cmd = Command::new("sleep");
        cmd.arg("60");
        if let Some(dir) = pipe_dir {
            cmd.env("CUDA_MPS_PIPE_DIRECTORY", dir);
        }
        cmd.spawn().unwrap()
    }

    fn write_pid_file(root: &Path, gpu: &str, pid: u32) {
        let pipe = root.join("daemons").join(gpu).join("pipe");
        fs::create_dir_all(&pipe).unwrap();
        fs::write(pipe.join(PID_FILE), format!("{pid}\n")).unwrap();
    }

    #[test]
    fn only_a_live_daemon_of_its_own_pipe_dir_holds_the_root() {
        let dir = tempfile::tempdir().unwrap();
        // The host's / at `dir`, the root at /r on it: the daemons name /r/daemons/..
        let root = StateRoot::new(Path::new("/r"), dir.path());
        assert!(survey(&root).unwrap().is_none());
        // A daemon that ended (its pid file stays), and a pid since given to another process.
        let mut ended = sleeper(None);
        let ended_pid = ended.id();
        ended.kill().unwrap();
        ended.wait().unwrap();
        write_pid_file(&root.on_disk, "GPU-ended", ended_pid);
        let mut stranger = sleeper(Some(Path::new("/elsewhere")));
        write_pid_file(&root.on_disk, "GPU-reused", stranger.id());
        let found = survey(&root).unwrap().unwrap();
        assert!(found.in_use.is_empty(), "{:?}", found.in_use);
        assert_eq!(found.entries, names(&["daemons"]));

        let pipe_dir = Path::new("/r/daemons/GPU-live/pipe");
        let mut daemon = sleeper(Some(pipe_dir));
        write_pid_file(&root.on_disk, "GPU-live", daemon.id());
        let found = survey(&root).unwrap().unwrap();
        assert_eq!(
            found.in_use,
            [InUse::MpsDaemon {
                pipe_dir: pipe_dir.to_path_buf(),
                pid: daemon.id()
            }]
        );
        assert!(plan(Some(&found)).refused());
        for child in [&mut daemon, &mut stranger] {
            child.kill().unwrap();
            child.wait().unwrap();
        }

        let found = survey(&root).unwrap().unwrap();
        let plan = plan(Some(&found));
        remove(&root, &plan).unwrap();
        assert!(!root.on_disk.exists(), "{plan:?}");
    }

    #[test]
    fn a_manager_holding_its_lock_holds_the_root_and_a_free_lock_is_taken() {
        let dir = tempfile::tempdir().unwrap();
        let root = StateRoot::new(Path::new("/"), dir.path());
        let lock_path = dir.path().join(MANAGER_LOCK_FILE);
        fs::write(&lock_path, "4242\n").unwrap();
        let manager = Flock::lock(File::open(&lock_path).unwrap(), FlockArg::LockExclusiveNonblock).unwrap();
        let found = survey(&root).unwrap().unwrap();
        assert_eq!(found.in_use, [InUse::Manager { pid: Some(4242) }]);
        assert!(found.manager_lock.is_none());
        drop(manager);
        let found = survey(&root).unwrap().unwrap();
        assert!(found.in_use.is_empty());
        assert!(found.manager_lock.is_some(), "taken while the root is removed");
        // A manager starting now finds the root held.
        assert!(Flock::lock(File::open(&lock_path).unwrap(), FlockArg::LockExclusiveNonblock).is_err());
    }

    #[test]
    fn removing_takes_gpu_mps_entries_and_links_never_what_they_point_at() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = dir.path().join("elsewhere");
        fs::create_dir(&elsewhere).unwrap();
        fs::write(elsewhere.join("precious"), "x").unwrap();
        let root = StateRoot::new(Path::new("/run/x"), dir.path());
        fs::create_dir_all(root.on_disk.join("gates/ab")).unwrap();
        fs::write(root.on_disk.join("state.json"), "{}").unwrap();
        fs::write(root.on_disk.join("notes.txt"), "mine").unwrap();
        std::os::unix::fs::symlink(&elsewhere, root.on_disk.join("leases")).unwrap();
        let found = survey(&root).unwrap().unwrap();
        let plan = plan(Some(&found));
        remove(&root, &plan).unwrap();
        let left: Vec<_> = fs::read_dir(&root.on_disk)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, names(&["notes.txt"]));
        assert!(elsewhere.join("precious").exists());
    }
}
