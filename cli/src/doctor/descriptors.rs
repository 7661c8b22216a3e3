//! Check: the manager has room for more open descriptors. Every connection at a container's gate
//! costs it one (two while relayed to the daemon); at its RLIMIT_NOFILE new CUDA clients are
//! refused.

use super::{Check, DoctorError};

const NAME: &str = "descriptors";
/// Below this share of the limit left free, the check warns.
const HEADROOM: f64 = 0.20;

#[derive(Debug)]
pub enum DescriptorFacts {
    /// The manager check failed: nothing to look at.
    ManagerDown,
    /// The manager answers, but its pid was not found; where it was looked for.
    NoPid(String),
    Process(Box<ProcessDescriptors>),
}

#[derive(Debug)]
pub struct ProcessDescriptors {
    pub pid: u32,
    /// Entries of /proc/<pid>/fd.
    pub open: Result<u64, DoctorError>,
    /// The soft "Max open files" of /proc/<pid>/limits; None: unlimited.
    pub limit: Result<Option<u64>, DoctorError>,
    /// What `[gate] max_connections` may need: two per connection plus 1024 for the rest.
    pub wanted: u64,
}

const RAISE: &str = "raise LimitNOFILE of gpu-mps-manager (systemctl edit gpu-mps-manager: [Service] LimitNOFILE=65536) and restart it, or lower [gate] max_connections";

pub fn check(f: &DescriptorFacts) -> Check {
    let p = match f {
        DescriptorFacts::ManagerDown => {
            return Check::skip(NAME, "gpu-mps-manager is not running (see the manager line)");
        }
        DescriptorFacts::NoPid(looked) => {
            return Check::warn(
                NAME,
                format!("the manager answers, but its process was not found ({looked})"),
                "run gpu-mps doctor on the node itself, as root, in the host's PID namespace",
            );
        }
        DescriptorFacts::Process(p) => p,
    };
    let (open, limit) = match (&p.open, &p.limit) {
        (Ok(open), Ok(limit)) => (*open, *limit),
        (Err(e), _) | (_, Err(e)) => {
            return Check::warn(
                NAME,
                format!(
                    "cannot count the descriptors of gpu-mps-manager (pid {}): {e}",
                    p.pid
                ),
                "run gpu-mps doctor as root",
            );
        }
    };
    let Some(limit) = limit else {
        return Check::pass(NAME, format!("pid {}: {open} open, no limit", p.pid));
    };
    let free = limit.saturating_sub(open);
    let found = format!(
        "pid {}: {open} of {limit} descriptors open ({} % free)",
        p.pid,
        free * 100 / limit.max(1)
    );
    if (free as f64) < HEADROOM * limit as f64 {
        return Check::warn(
            NAME,
            format!("{found}: near its limit, new CUDA clients at the gates are refused once it is reached"),
            RAISE,
        );
    }
    if limit < p.wanted {
        return Check::warn(
            NAME,
            format!(
                "{found}, but the limit is below the {} that [gate] max_connections may need (two per connection, plus 1024)",
                p.wanted
            ),
            RAISE,
        );
    }
    Check::pass(NAME, found)
}

/// The soft limit of the "Max open files" line of /proc/<pid>/limits; `Some(None)`: unlimited.
pub fn parse_open_files_limit(limits: &str) -> Option<Option<u64>> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let soft = line
        .trim_start_matches("Max open files")
        .split_whitespace()
        .next()?;
    if soft == "unlimited" {
        return Some(None);
    }
    soft.parse().ok().map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::Status;

    fn process(open: u64, limit: Option<u64>) -> DescriptorFacts {
        DescriptorFacts::Process(Box::new(ProcessDescriptors {
            pid: 77,
            open: Ok(open),
            limit: Ok(limit),
            wanted: 2 * 4096 + 1024,
        }))
    }

    #[test]
    fn room_to_spare_passes() {
        let c = check(&process(100, Some(65536)));
        assert_eq!(c.status, Status::Pass);
        assert_eq!(c.found, "pid 77: 100 of 65536 descriptors open (99 % free)");
        assert_eq!(check(&process(100, None)).status, Status::Pass);
    }

    #[test]
    fn under_a_fifth_free_warns() {
        let c = check(&process(53000, Some(65536)));
        assert_eq!(c.status, Status::Warn);
        assert!(
            c.found.contains("(19 % free)") && c.found.contains("refused"),
            "{}",
            c.found
        );
        assert!(c.fix.unwrap_or_default().contains("LimitNOFILE"));
        assert_eq!(check(&process(52000, Some(65536))).status, Status::Pass);
    }

    #[test]
    fn a_limit_below_what_the_gates_need_warns() {
        let c = check(&process(30, Some(1024)));
        assert_eq!(c.status, Status::Warn);
        assert!(c.found.contains("below the 9216"), "{}", c.found);
    }

    #[test]
    fn unreadable_or_unknown_warns_and_no_manager_skips() {
        let f = DescriptorFacts::Process(Box::new(ProcessDescriptors {
            pid: 77,
            open: Err(DoctorError::Io {
                path: "/proc/77/fd".into(),
                action: "listing",
                source: std::io::Error::from_raw_os_error(13),
            }),
            limit: Ok(Some(1024)),
            wanted: 0,
        }));
        let c = check(&f);
        assert_eq!(c.status, Status::Warn);
        assert!(
            c.found.contains("/proc/77/fd: listing: Permission denied"),
            "{}",
            c.found
        );
        assert_eq!(check(&DescriptorFacts::NoPid("x".into())).status, Status::Warn);
        assert_eq!(check(&DescriptorFacts::ManagerDown).status, Status::Skip);
    }

    #[test]
    fn limits_file_parses() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \nMax cpu time              unlimited            unlimited            seconds   \nMax open files            1024                 524288               files     \n";
        assert_eq!(parse_open_files_limit(limits), Some(Some(1024)));
        assert_eq!(
            parse_open_files_limit(
                "Max open files            unlimited            unlimited            files\n"
            ),
            Some(None)
        );
        assert_eq!(parse_open_files_limit("Max processes 1 1 processes\n"), None);
    }
}
