//! Which GPUs are unhealthy, from what the manager reports. One owner (the health poll task)
//! keeps a [`HealthTracker`]; it is pure, so the rules are tested without a manager.

use std::collections::HashMap;

use gpu_mps_api::status_view::StatusView;

/// Consecutive failed polls after which every GPU turns unhealthy: with the manager gone no GPU
/// container can start, and the scheduler should stop sending them. A restart of the manager
/// takes less, so its GPUs do not flap.
pub const UNREACHABLE_POLLS: u32 = 3;

#[derive(Debug, Default)]
pub struct HealthTracker {
    gpus: Vec<String>,
    failed_polls: u32,
    unhealthy: HashMap<String, String>,
}

impl HealthTracker {
    pub fn new(gpus: Vec<String>) -> Self {
        HealthTracker {
            gpus,
            ..Default::default()
        }
    }

    pub fn unhealthy(&self) -> &HashMap<String, String> {
        &self.unhealthy
    }

    /// Takes one poll's outcome; returns the new map when it changed.
    pub fn observe(&mut self, poll: Result<&StatusView, &str>) -> Option<HashMap<String, String>> {
        let next: HashMap<String, String> = match poll {
            Ok(status) => {
                self.failed_polls = 0;
                self.gpus
                    .iter()
                    .filter_map(|uuid| {
                        let view = status.gpus.iter().find(|g| &g.uuid == uuid);
                        match view {
                            None => Some((uuid.clone(), "not in gpu-mps-manager's inventory".to_string())),
                            Some(g) if !g.unhealthy_reason.is_empty() => {
                                Some((uuid.clone(), g.unhealthy_reason.clone()))
                            }
                            Some(_) => None,
                        }
                    })
                    .collect()
            }
            Err(reason) => {
                self.failed_polls = self.failed_polls.saturating_add(1);
                if self.failed_polls < UNREACHABLE_POLLS {
                    return None;
                }
                self.gpus
                    .iter()
                    .map(|uuid| (uuid.clone(), format!("gpu-mps-manager is unreachable: {reason}")))
                    .collect()
            }
        };
        if next == self.unhealthy {
            return None;
        }
        self.unhealthy = next.clone();
        Some(next)
    }
}

#[cfg(test)]
mod tests {
    use gpu_mps_api::status_view::GpuView;

    use super::*;

    fn status(reasons: &[(&str, &str)]) -> StatusView {
        StatusView {
            manager_version: String::new(),
            policy: String::new(),
            tenancy: String::new(),
            config_digest: String::new(),
            config_source: String::new(),
            config_note: String::new(),
            gpus: reasons
                .iter()
                .map(|(uuid, reason)| GpuView {
                    index: 0,
                    uuid: (*uuid).into(),
                    name: String::new(),
                    memory_bytes: 0,
                    compute_mode: String::new(),
                    leases: 0,
                    max_clients: 48,
                    memory_reserved_bytes: 0,
                    memory_capacity_bytes: 0,
                    unhealthy_reason: (*reason).into(),
                })
                .collect(),
            daemons: Vec::new(),
            leases: Vec::new(),
        }
    }

    #[test]
    fn a_faulted_gpu_turns_unhealthy_and_back() {
        let mut t = HealthTracker::new(vec!["GPU-a".into(), "GPU-b".into()]);
        assert_eq!(t.observe(Ok(&status(&[("GPU-a", ""), ("GPU-b", "")]))), None);
        let changed = t
            .observe(Ok(&status(&[("GPU-a", ""), ("GPU-b", "fault")])))
            .unwrap();
        assert_eq!(
            changed,
            HashMap::from([("GPU-b".to_string(), "fault".to_string())])
        );
        assert_eq!(t.observe(Ok(&status(&[("GPU-a", ""), ("GPU-b", "fault")]))), None);
        assert_eq!(
            t.observe(Ok(&status(&[("GPU-a", ""), ("GPU-b", "")]))),
            Some(HashMap::new())
        );
    }

    #[test]
    fn an_unreachable_manager_turns_all_unhealthy_after_some_polls() {
        let mut t = HealthTracker::new(vec!["GPU-a".into()]);
        for _ in 1..UNREACHABLE_POLLS {
            assert_eq!(t.observe(Err("refused")), None);
        }
        let all = t.observe(Err("refused")).unwrap();
        assert!(all["GPU-a"].contains("unreachable: refused"));
        assert_eq!(t.observe(Ok(&status(&[("GPU-a", "")]))), Some(HashMap::new()));
    }

    #[test]
    fn a_gpu_the_manager_does_not_know_is_unhealthy() {
        let mut t = HealthTracker::new(vec!["GPU-a".into()]);
        let m = t.observe(Ok(&status(&[]))).unwrap();
        assert!(m["GPU-a"].contains("inventory"));
    }
}
