//! `gpu-mps node live-leases`: the containers that still hold a lease on this node, read from the
//! manager's lease files (`<root>/leases/`), so it answers with the manager stopped. Asked before
//! gpu-mps is removed from under them, by the Debian package's prerm and the DaemonSet's
//! uninstall, which share the one rule: refused while any runs, unless forced.

use std::path::Path;

use gpu_mps_api::lease_record::{LeaseRecord, read_lease_dir};

/// What the lease files say.
#[derive(Debug, Default)]
pub struct LiveLeases {
    /// Leases whose container's init process (pid and start time) still runs.
    pub live: Vec<LeaseRecord>,
    /// Lease files that could not be read as a lease, with why: counted as live, since the
    /// container they name may run.
    pub unreadable: Vec<String>,
}

impl LiveLeases {
    /// Whether removing gpu-mps now would leave a container without its bookkeeping.
    pub fn any(&self) -> bool {
        !self.live.is_empty() || !self.unreadable.is_empty()
    }

    /// One line per live lease and unreadable file.
    pub fn lines(&self) -> Vec<String> {
        let live = self.live.iter().map(|l| {
            format!(
                "{} {} pid {} on {}",
                l.container_id,
                l.owner(),
                l.process.map_or(0, |p| p.pid),
                l.request.key
            )
        });
        live.chain(self.unreadable.iter().map(|u| format!("unreadable: {u}")))
            .collect()
    }
}

/// Reads every lease file in `dir` (a missing dir: none) without changing anything there.
pub fn read(dir: &Path) -> std::io::Result<LiveLeases> {
    let mut found = LiveLeases::default();
    let files = match read_lease_dir(dir) {
        Ok(files) => files,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(found),
        Err(e) => return Err(e),
    };
    for (path, lease) in files {
        match lease {
            Ok(lease) if lease.container_alive() => found.live.push(lease),
            Ok(_) => {}
            Err(reason) => found.unreadable.push(format!("{}: {reason}", path.display())),
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use gpu_mps_api::lease_record::lease_file_name;
    use gpu_mps_api::process_identity::ProcessIdentity;
    use gpu_mps_api::{DaemonKey, Limits};

    use super::*;

    const ID: &str = "4844287073c56bf2a1d0e9c3b7f6a5d4e3c2b1a0918273645546372819201a2b";

    fn write(dir: &Path, id: &str, process: Option<ProcessIdentity>) {
        let limits = Limits {
            memory_bytes: 1 << 30,
            thread_percentage: 10,
        };
        let mut lease = LeaseRecord::for_test(id, DaemonKey::new(["GPU-a"]), limits, "team-a");
        lease.request.identity.pod = "infer".into();
        lease.process = process;
        std::fs::write(dir.join(lease_file_name(id)), serde_json::to_vec(&lease).unwrap()).unwrap();
    }

    #[test]
    fn only_leases_whose_process_runs_count_and_an_unreadable_file_counts_too() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!read(&dir.path().join("absent")).unwrap().any());
        let me = ProcessIdentity::of(std::process::id()).unwrap();
        write(dir.path(), ID, Some(me));
        let gone = ProcessIdentity {
            start_ticks: me.start_ticks + 1,
            ..me
        };
        write(dir.path(), &ID.replace('4', "5"), Some(gone));
        write(dir.path(), &ID.replace('4', "6"), None);
        let found = read(dir.path()).unwrap();
        assert_eq!(found.live.len(), 1, "{:?}", found.lines());
        assert_eq!(found.live[0].container_id, ID);
        assert_eq!(
            found.lines(),
            [format!("{ID} team-a/infer pid {} on GPU-a", me.pid)]
        );
        std::fs::write(dir.path().join("torn.json"), b"{\"container_id\":").unwrap();
        std::fs::write(dir.path().join(".tmp-write.json"), b"x").unwrap();
        let found = read(dir.path()).unwrap();
        assert_eq!(found.unreadable.len(), 1, "{:?}", found.lines());
        assert!(
            found.lines()[1].starts_with("unreadable: "),
            "{:?}",
            found.lines()
        );
        assert!(
            dir.path().join("torn.json").exists(),
            "nothing is moved or removed"
        );
    }
}
