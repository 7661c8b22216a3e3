//! A container's lease on an MPS daemon (the type is gpu-mps-api's, which the CLI reads too).

pub use gpu_mps_api::lease_record::LeaseRecord;

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
