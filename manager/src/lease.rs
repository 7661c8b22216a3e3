//! A container's lease on an MPS daemon: its request (what it holds) and what the manager knows
//! of the container.

use gpu_mps_api::ContainerRequest;
use serde::{Deserialize, Serialize};

use crate::process_identity::ProcessIdentity;

/// Serialized flat: the request's fields sit beside the lease's own, the shape records had
/// before the request was one type (tests/fixtures/ holds records written then).
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

    #[cfg(test)]
    pub fn for_test(
        id: &str,
        key: gpu_mps_api::DaemonKey,
        limits: gpu_mps_api::Limits,
        namespace: &str,
    ) -> Self {
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

#[cfg(test)]
mod tests {
    use gpu_mps_api::container_request::ClientPriority;
    use gpu_mps_api::{DaemonKey, Limits};

    use super::*;

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

    fn fixture(name: &str) -> Vec<u8> {
        std::fs::read(format!("{FIXTURES}/{name}")).unwrap()
    }

    #[test]
    fn a_lease_file_written_before_the_request_was_one_type_reads_whole() {
        let plain: LeaseRecord = serde_json::from_slice(&fixture("lease-8214996-plain.json")).unwrap();
        assert_eq!(
            plain.request.key,
            DaemonKey::new(["GPU-9e2f7c3d-0b4a-41e6-8d5c-2a7b9f1e3d02"])
        );
        assert_eq!(
            plain.request.limits,
            Limits {
                memory_bytes: 4 << 30,
                thread_percentage: 25
            }
        );
        assert_eq!(plain.request.cuda_processes, 2);
        assert_eq!(plain.owner(), "team-a/infer-7d9f");
        assert_eq!(plain.request.identity.container_name, "infer");
        assert_eq!(plain.request.priority, ClientPriority::Normal);
        assert!(plain.request.memory_units.is_empty() && plain.daemon_lost_unix.is_none());
        assert_eq!(
            plain.process.map(|p| (p.pid, p.start_ticks)),
            Some((4242, 987_654))
        );
        let units: LeaseRecord = serde_json::from_slice(&fixture("lease-8214996-units.json")).unwrap();
        assert_eq!(units.request.memory_units, [3, 4, 5]);
        assert_eq!(units.daemon_lost_unix, Some(1_796_000_200));
        assert_eq!(units.request.per_process().memory_bytes, 3 << 30);
    }

    #[test]
    fn a_lease_of_a_normal_container_is_written_as_before() {
        // Byte for byte what that commit wrote: a manager rolled back to it reads today's files.
        for name in ["lease-8214996-plain.json", "lease-8214996-units.json"] {
            let old = fixture(name);
            let lease: LeaseRecord = serde_json::from_slice(&old).unwrap();
            let again = serde_json::to_vec_pretty(&lease).unwrap();
            let as_value = |b: &[u8]| serde_json::from_slice::<serde_json::Value>(b).unwrap();
            assert_eq!(as_value(&again), as_value(&old), "{name}");
        }
    }
}
