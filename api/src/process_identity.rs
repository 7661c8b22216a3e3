//! A process named by pid AND start time, so a recycled pid is never mistaken for the
//! container (or daemon) that had it before. Read from `/proc/<pid>/stat`; the manager records
//! them in its leases, `gpu-mps node live-leases` checks them.

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
    fn parses_stat_with_odd_command_names() {
        let stat =
            "1234 (a (weird) name) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(parse_start_ticks(stat), Some(987654));
        assert_eq!(parse_state(stat), Some('S'));
        let stat =
            "1234 (contain) erd) S 1 1234 1234 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 12 0 98765 100000 500";
        assert_eq!(parse_start_ticks(stat), Some(98765));
        assert_eq!(parse_start_ticks("garbage"), None);
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

    #[test]
    fn the_parent_is_read_after_the_command_name() {
        assert_eq!(
            parent_of(std::process::id()),
            Some(std::os::unix::process::parent_id())
        );
        assert!(is_running(std::process::id()));
    }
}
