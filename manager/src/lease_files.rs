//! One small file per recorded lease (`<root>/leases/<gate name>.json`), beside the state file.
//! The state file is the node's whole picture; these files are what the manager rebuilds its
//! leases from when that file cannot be used (corrupt, truncated, empty, another version, gone):
//! the containers they name may still run, and their memory must still be counted
//! (docs/adr/0010-leases-rebuilt-from-their-own-files.md).
//!
//! The books own the one [`LeaseFiles`]: it is brought in line with the leases each time the
//! state is saved, so the files never hold a lease the state has dropped for longer than one save.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gpu_mps_api::files::{self, Durability, FileMode};
use thiserror::Error;

use gpu_mps_api::lease_record::{LeaseFile, lease_file_name, read_lease_dir};

use crate::lease::LeaseRecord;

#[derive(Debug, Error)]
pub enum LeaseFilesError {
    #[error("writing the lease file {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("removing the lease file {path}: {source}")]
    Remove { path: PathBuf, source: std::io::Error },
    #[error("listing the lease files in {dir}: {source}")]
    List { dir: PathBuf, source: std::io::Error },
    #[error("the lease file {path} is not a lease: {reason}")]
    Unusable { path: PathBuf, reason: String },
}

/// The lease files of one manager root, and what this run has written to them.
#[derive(Debug)]
pub struct LeaseFiles {
    dir: PathBuf,
    /// The bytes written for each lease this run, by container id: a lease is rewritten only
    /// when its record changed (a daemon lost under it), never on every save.
    written: BTreeMap<String, Vec<u8>>,
    /// Whether files of an earlier run (not in `written`) may still be in the dir.
    listed: bool,
}

impl LeaseFiles {
    pub fn new(dir: PathBuf) -> Self {
        LeaseFiles {
            dir,
            written: BTreeMap::new(),
            listed: false,
        }
    }

    /// Brings the dir in line with `leases`: writes the new or changed ones, removes the rest.
    /// Stops at the first failure (a full disk), leaving what it has done: the next call
    /// starts again from what it knows was written.
    pub fn sync(&mut self, leases: &BTreeMap<String, LeaseRecord>) -> Result<(), LeaseFilesError> {
        if !self.listed {
            files::create_dir_in_private_parents(&self.dir, files::PRIVATE_DIR_MODE).map_err(|source| {
                LeaseFilesError::Write {
                    path: self.dir.clone(),
                    source,
                }
            })?;
            for (id, path) in list(&self.dir)? {
                if !leases.contains_key(&id) {
                    remove(&path)?;
                }
            }
            self.listed = true;
        }
        let gone: Vec<String> = self
            .written
            .keys()
            .filter(|id| !leases.contains_key(*id))
            .cloned()
            .collect();
        for id in gone {
            remove(&self.path_of(&id))?;
            self.written.remove(&id);
        }
        for (id, lease) in leases {
            let bytes = serde_json::to_vec_pretty(lease).expect("a lease serializes");
            if self.written.get(id) == Some(&bytes) {
                continue;
            }
            let path = self.path_of(id);
            files::replace_file(&path, &bytes, FileMode::Set(0o600), Durability::Volatile)
                .map_err(|source| LeaseFilesError::Write { path, source })?;
            self.written.insert(id.clone(), bytes);
        }
        Ok(())
    }

    fn path_of(&self, container_id: &str) -> PathBuf {
        self.dir.join(lease_file_name(container_id))
    }
}

/// Every lease file in `dir`, read back: the leases, and one line for each file that could not
/// be used (set aside as `<name>.unusable`, so it is reported once). A missing dir is no leases.
pub fn read_all(dir: &Path) -> (Vec<LeaseRecord>, Vec<String>) {
    let mut leases = Vec::new();
    let mut notes = Vec::new();
    let found = match scan(dir) {
        Ok(found) => found,
        Err(LeaseFilesError::List { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            return (leases, notes);
        }
        Err(e) => return (leases, vec![e.to_string()]),
    };
    for (path, parsed) in found {
        match parsed {
            Ok(lease) => leases.push(lease),
            Err(reason) => {
                let aside = path.with_extension("json.unusable");
                let _ = std::fs::rename(&path, &aside);
                notes.push(gpu_mps_api::message::one_line(
                    &LeaseFilesError::Unusable { path, reason }.to_string(),
                ));
            }
        }
    }
    leases.sort_by(|a, b| a.container_id.cmp(&b.container_id));
    (leases, notes)
}

/// `(container id, path)` of every lease file in `dir` that reads as a lease.
fn list(dir: &Path) -> Result<Vec<(String, PathBuf)>, LeaseFilesError> {
    Ok(scan(dir)?
        .into_iter()
        .filter_map(|(path, parsed)| Some((parsed.ok()?.container_id, path)))
        .collect())
}

/// Every lease file in `dir`, read (gpu_mps_api's reader, which the CLI shares).
fn scan(dir: &Path) -> Result<Vec<LeaseFile>, LeaseFilesError> {
    read_lease_dir(dir).map_err(|source| LeaseFilesError::List {
        dir: dir.into(),
        source,
    })
}

fn remove(path: &Path) -> Result<(), LeaseFilesError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(LeaseFilesError::Remove {
            path: path.into(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_mps_api::{DaemonKey, Limits};

    fn lease(id: &str, memory_bytes: u64) -> LeaseRecord {
        let mut lease = LeaseRecord::for_test(
            id,
            DaemonKey::new(["GPU-a"]),
            Limits {
                memory_bytes,
                thread_percentage: 25,
            },
            "default",
        );
        lease.request.identity.pod = "p".into();
        lease.request.identity.container_name = "c".into();
        lease.bundle = "/b".into();
        lease.acquired_unix = 1;
        lease
    }

    fn leases(list: &[LeaseRecord]) -> BTreeMap<String, LeaseRecord> {
        list.iter().map(|l| (l.container_id.clone(), l.clone())).collect()
    }

    #[test]
    fn files_follow_the_leases_and_read_back_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let leases_dir = dir.path().join("leases");
        let mut files = LeaseFiles::new(leases_dir.clone());
        let (a, b) = (lease("aaa", 1 << 30), lease("bbb", 2 << 30));
        files.sync(&leases(&[a.clone(), b.clone()])).unwrap();
        assert_eq!(read_all(&leases_dir), (vec![a.clone(), b.clone()], vec![]));

        let mut lost = a.clone();
        lost.daemon_lost_unix = Some(7);
        files.sync(&leases(&[lost.clone()])).unwrap();
        assert_eq!(read_all(&leases_dir), (vec![lost], vec![]));
        files.sync(&BTreeMap::new()).unwrap();
        assert_eq!(std::fs::read_dir(&leases_dir).unwrap().count(), 0);
    }

    #[test]
    fn files_of_an_earlier_run_that_no_lease_keeps_are_removed_at_the_first_sync() {
        let dir = tempfile::tempdir().unwrap();
        let leases_dir = dir.path().join("leases");
        let (a, b) = (lease("aaa", 1 << 30), lease("bbb", 2 << 30));
        LeaseFiles::new(leases_dir.clone())
            .sync(&leases(&[a.clone(), b.clone()]))
            .unwrap();
        // A new run whose state holds only b.
        LeaseFiles::new(leases_dir.clone())
            .sync(&leases(std::slice::from_ref(&b)))
            .unwrap();
        assert_eq!(read_all(&leases_dir), (vec![b], vec![]));
    }

    #[test]
    fn an_unusable_lease_file_is_set_aside_with_one_line_and_the_rest_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let a = lease("aaa", 1 << 30);
        LeaseFiles::new(dir.path().into())
            .sync(&leases(std::slice::from_ref(&a)))
            .unwrap();
        let b_name = lease_file_name("bbb");
        let bad: [(&str, &[u8]); 4] = [
            (&b_name, b"{ not json"),
            ("0000000000000000.json", b""),
            // A lease under another container's name: never trusted.
            (
                "1111111111111111.json",
                &serde_json::to_vec(&lease("ccc", 1)).unwrap(),
            ),
            ("2222222222222222.json", b"{\"container_id\": \"x\"}\n\n"),
        ];
        for (name, bytes) in bad {
            std::fs::write(dir.path().join(name), bytes).unwrap();
        }
        let (found, notes) = read_all(dir.path());
        assert_eq!(found, vec![a]);
        assert_eq!(notes.len(), 4, "{notes:#?}");
        for note in &notes {
            assert!(!note.contains('\n') && note.contains("is not a lease"), "{note}");
        }
        // Set aside: reported once.
        assert_eq!(read_all(dir.path()).1, Vec::<String>::new());
    }

    #[test]
    fn a_write_that_fails_is_an_error_and_the_next_sync_writes_it() {
        let dir = tempfile::tempdir().unwrap();
        let blocked = dir.path().join("leases");
        // A file where the dir should be: every write fails.
        std::fs::write(&blocked, b"").unwrap();
        let mut files = LeaseFiles::new(blocked.clone());
        let a = lease("aaa", 1 << 30);
        let e = files.sync(&leases(std::slice::from_ref(&a))).unwrap_err();
        assert!(e.to_string().contains("leases"), "{e}");
        std::fs::remove_file(&blocked).unwrap();
        files.sync(&leases(std::slice::from_ref(&a))).unwrap();
        assert_eq!(read_all(&blocked), (vec![a], vec![]));
    }

    #[test]
    fn a_missing_dir_is_no_leases() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_all(&dir.path().join("none")), (vec![], vec![]));
    }
}
