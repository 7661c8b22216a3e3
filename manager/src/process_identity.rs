//! The manager's side of processes: ending an MPS control daemon, cgroups, children. A process's
//! identity (pid and start time) is gpu-mps-api's, shared with the CLI.

pub use gpu_mps_api::process_identity::{ProcessIdentity, is_running, parent_of};

/// SIGTERM, then SIGKILL if it still runs after `grace`. Only ever used on an MPS control daemon
/// that owns a pipe dir but no longer answers; never on a container's process.
pub async fn terminate(process: &ProcessIdentity, grace: std::time::Duration) {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let pid = Pid::from_raw(process.pid as i32);
    if !process.is_alive() || kill(pid, Signal::SIGTERM).is_err() {
        return;
    }
    let deadline = tokio::time::Instant::now() + grace;
    while process.is_alive() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    if process.is_alive() {
        let _ = kill(pid, Signal::SIGKILL);
    }
}

/// The cgroup a process is in (`/proc/<pid>/cgroup`): a container's processes share their
/// init's, whatever their pid namespace. `None` if it is gone.
pub fn cgroup_of(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()
}

/// True when a process whose `/proc/<pid>/cgroup` reads `process` is in the container whose
/// init's reads `init`: the same cgroup or one below it (a container may create its own
/// cgroups, under cgroup v2 with its own cgroup namespace). Under cgroup v1 (several lines)
/// only the same cgroups match.
pub fn in_cgroup_of(process: &str, init: &str) -> bool {
    let unified = |file: &str| {
        let mut lines = file.lines().filter(|l| !l.is_empty());
        let only = lines.next()?;
        match (only.strip_prefix("0::"), lines.next()) {
            (Some(path), None) => Some(path.trim_end().to_string()),
            _ => None,
        }
    };
    match (unified(process), unified(init)) {
        (Some(process), Some(init)) => {
            process == init
                || process
                    .strip_prefix(&init)
                    .is_some_and(|rest| rest.starts_with('/') && init != "/")
        }
        _ => process == init,
    }
}

/// The processes whose parent is `parent` (an MPS control daemon's servers).
pub fn children_of(parent: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| parent_of(*pid) == Some(parent))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_is_in_its_containers_cgroup_or_below_it() {
        let init = "0::/kubepods/pod1/ctr-a\n";
        assert!(in_cgroup_of("0::/kubepods/pod1/ctr-a\n", init));
        assert!(in_cgroup_of("0::/kubepods/pod1/ctr-a/worker\n", init));
        assert!(!in_cgroup_of("0::/kubepods/pod1/ctr-ab\n", init));
        assert!(!in_cgroup_of("0::/kubepods/pod1\n", init));
        assert!(!in_cgroup_of("0::/kubepods/pod2/ctr-a\n", init));
        // An init at the root of its view owns nothing below it by prefix.
        assert!(!in_cgroup_of("0::/other\n", "0::/\n"));
        // cgroup v1: only the same cgroups.
        let v1 = "12:memory:/a\n11:cpu:/a\n";
        assert!(in_cgroup_of(v1, v1));
        assert!(!in_cgroup_of("12:memory:/a/b\n11:cpu:/a/b\n", v1));
    }
}
