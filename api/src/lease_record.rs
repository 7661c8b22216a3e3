//! A container's lease on an MPS daemon: its request (what it holds) and what the manager knows
//! of the container. The manager writes them (state.json, `<root>/leases/<gate name>.json`); the
//! CLI reads the lease files too (`gpu-mps node live-leases`, with the manager stopped).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::container_id::ContainerId;
use crate::container_request::ContainerRequest;
use crate::process_identity::ProcessIdentity;

/// A lease file's name ends so.
const LEASE_FILE_SUFFIX: &str = ".json";

/// Serialized flat: the request's fields sit beside the lease's own, the shape records had
/// before the request was one type (manager/tests/fixtures/ holds records written then).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    pub container_id: String,
    #[serde(flatten)]
    pub request: ContainerRequest,
    pub bundle: String,
    /// The container's init process; the lease is dropped once it is gone, in case the
    /// poststop hook never ran (runc killed, node crash, containerd restart).
    pub process: Option<ProcessIdentity>,
    pub acquired_unix: i64,
    /// When the daemon its CUDA processes used died under it (unix seconds): MPS ended those
    /// processes' server with it; the ones started since reach the daemon started in its place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub daemon_lost_unix: Option<i64>,
}

impl LeaseRecord {
    /// namespace/pod, or the container id for a container started without CRI (ctr).
    pub fn owner(&self) -> String {
        let identity = &self.request.identity;
        if identity.pod.is_empty() {
            self.container_id.clone()
        } else {
            format!("{}/{}", identity.namespace, identity.pod)
        }
    }

    /// False once the container's init process has exited.
    pub fn container_alive(&self) -> bool {
        self.process.is_some_and(|p| p.is_alive())
    }

    #[doc(hidden)]
    /// A lease of `id` with these limits and nothing else, for tests.
    pub fn for_test(id: &str, key: crate::DaemonKey, limits: crate::Limits, namespace: &str) -> Self {
        let mut request = ContainerRequest::for_test(&[], limits, namespace);
        request.key = key;
        LeaseRecord {
            container_id: id.into(),
            request,
            bundle: String::new(),
            process: None,
            acquired_unix: 0,
            daemon_lost_unix: None,
        }
    }
}

/// The name of the lease file of `container_id` in `<root>/leases/`.
pub fn lease_file_name(container_id: &str) -> String {
    match ContainerId::parse(container_id) {
        Ok(id) => format!("{}{LEASE_FILE_SUFFIX}", id.gate_name()),
        // Leases are only made for valid ids; this keeps an odd one from escaping the dir.
        Err(_) => format!("invalid-{}{LEASE_FILE_SUFFIX}", container_id.len()),
    }
}

/// A lease file's bytes, checked: a lease, of a valid container id, under the name that id gets.
fn parse_lease_file(bytes: &[u8], name: &str) -> Result<LeaseRecord, String> {
    let lease: LeaseRecord = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    ContainerId::parse(&lease.container_id).map_err(|e| e.to_string())?;
    let expected = lease_file_name(&lease.container_id);
    if name != expected {
        return Err(format!(
            "it holds the lease of container {}, whose file is {expected}",
            lease.container_id
        ));
    }
    Ok(lease)
}

/// A lease file's path, and its lease or why it is none.
pub type LeaseFile = (PathBuf, Result<LeaseRecord, String>);

/// Every lease file in `dir` (`*.json`; temp files of a write in progress start with a dot), read,
/// in name order: its path and its lease or why it is none. Changes nothing in `dir`.
pub fn read_lease_dir(dir: &Path) -> std::io::Result<Vec<LeaseFile>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)?
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| {
            path.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.ends_with(LEASE_FILE_SUFFIX) && !n.starts_with('.'))
        })
        .collect();
    paths.sort();
    Ok(paths
        .into_iter()
        .map(|path| {
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default()
                .to_string();
            let lease = std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|bytes| parse_lease_file(&bytes, &name));
            (path, lease)
        })
        .collect())
}
