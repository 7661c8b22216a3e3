//! A process named by pid AND start time, so a recycled pid is never mistaken for the
//! container (or daemon) that had it before.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessIdentity {
    pub pid: u32,
    /// Field 22 of /proc/<pid>/stat: clock ticks since boot at process start.
    pub start_ticks: u64,
}

impl ProcessIdentity {
    /// Reads the identity of a running process; `None` if it is gone.
    pub fn of(pid: u32) -> Option<Self> {
        if pid == 0 {
            return None;
        }
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        Some(ProcessIdentity {
            pid,
            start_ticks: parse_start_ticks(&stat)?,
        })
    }

    /// True while the same process (same pid, same start) still runs and is not a zombie.
    pub fn is_alive(&self) -> bool {
        match std::fs::read_to_string(format!("/proc/{}/stat", self.pid)) {
            Ok(stat) => parse_start_ticks(&stat) == Some(self.start_ticks) && parse_state(&stat) != Some('Z'),
            Err(_) => false,
        }
    }
}

impl ProcessIdentity {
    /// SIGTERM, then SIGKILL if it still runs after `grace`. Only ever used on an MPS control
    /// daemon that owns a pipe dir but no longer answers; never on a container's process.
    pub async fn terminate(&self, grace: std::time::Duration) {
        use nix::sys::signal::{Signal, kill};
        use nix::unistd::Pid;
        let pid = Pid::from_raw(self.pid as i32);
        if !self.is_alive() || kill(pid, Signal::SIGTERM).is_err() {
            return;
        }
        let deadline = tokio::time::Instant::now() + grace;
        while self.is_alive() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        if self.is_alive() {
            let _ = kill(pid, Signal::SIGKILL);
        }
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

/// The parent pid of a running process.
pub fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    fields_after_comm(&stat)?.get(1)?.parse().ok()
}

/// True if a process with this pid runs (and is not a zombie).
pub fn is_running(pid: u32) -> bool {
    ProcessIdentity::of(pid).is_some_and(|p| p.is_alive())
}

// The command name in field 2 may contain spaces and parentheses: parse after the LAST ')'.
fn fields_after_comm(stat: &str) -> Option<Vec<&str>> {
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().collect())
}

fn parse_state(stat: &str) -> Option<char> {
    fields_after_comm(stat)?.first()?.chars().next()
}

fn parse_start_ticks(stat: &str) -> Option<u64> {
    // After the comm, field 3 (state) is index 0, so field 22 (starttime) is index 19.
    fields_after_comm(stat)?.get(19)?.parse().ok()
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

    #[test]
    fn parses_stat_with_odd_command_names() {
        let stat =
            "1234 (a (weird) name) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(parse_start_ticks(stat), Some(987654));
        assert_eq!(parse_state(stat), Some('S'));
    }

    #[test]
    fn own_process_is_alive_and_a_changed_start_is_not() {
        let me = ProcessIdentity::of(std::process::id()).expect("own /proc entry");
        assert!(me.is_alive());
        assert!(
            !ProcessIdentity {
                start_ticks: me.start_ticks + 1,
                ..me
            }
            .is_alive()
        );
        assert!(ProcessIdentity::of(0).is_none());
    }
}
