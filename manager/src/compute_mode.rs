//! EXCLUSIVE_PROCESS compute mode: with it, the MPS server is the only process that may hold
//! a context on the GPU, so a client whose pipe dir is missing cannot silently open a direct
//! context with the whole GPU (measured: it gets all 132 SMs and all memory otherwise).

use std::collections::BTreeMap;

use gpu_mps_api::inventory::GpuInfo;
use thiserror::Error;

use crate::gpu_backend::{EXCLUSIVE_PROCESS, GpuBackend, GpuBackendError};

#[derive(Debug, Error)]
#[error(
    "cannot set GPU {uuid} to EXCLUSIVE_PROCESS: {source}; set daemon.exclusive_process = false to run without it (clients that bypass MPS then get the whole GPU)"
)]
pub struct EnforceError {
    pub uuid: String,
    pub source: GpuBackendError,
}

/// Sets EXCLUSIVE_PROCESS on every GPU that is not in it yet, remembering the previous mode
/// in `saved` (unless a previous run already saved it: then that one is the operator's).
pub fn enforce_exclusive_process(
    backend: &dyn GpuBackend,
    gpus: &[GpuInfo],
    saved: &mut BTreeMap<String, String>,
) -> Result<Vec<String>, EnforceError> {
    let mut changed = Vec::new();
    for gpu in gpus {
        let current = backend.compute_mode(&gpu.uuid).map_err(|source| EnforceError {
            uuid: gpu.uuid.clone(),
            source,
        })?;
        if current == EXCLUSIVE_PROCESS {
            continue;
        }
        saved.entry(gpu.uuid.clone()).or_insert(current);
        backend
            .set_compute_mode(&gpu.uuid, EXCLUSIVE_PROCESS)
            .map_err(|source| EnforceError {
                uuid: gpu.uuid.clone(),
                source,
            })?;
        changed.push(gpu.uuid.clone());
    }
    Ok(changed)
}

/// A GPU found out of EXCLUSIVE_PROCESS after the manager had set it, and whether setting it
/// again worked.
#[derive(Debug)]
pub struct Drift {
    pub uuid: String,
    /// The mode found, or why it could not be read.
    pub found: Result<String, GpuBackendError>,
    pub reset: Option<Result<(), GpuBackendError>>,
}

/// Checks that every GPU is still in EXCLUSIVE_PROCESS and sets it again where it is not
/// (someone ran `nvidia-smi -c`, a driver reload): without it a process that misses MPS gets
/// the whole GPU. Returns what was not in order.
pub fn reassert_exclusive_process(backend: &dyn GpuBackend, gpus: &[GpuInfo]) -> Vec<Drift> {
    let mut drifts = Vec::new();
    for gpu in gpus {
        match backend.compute_mode(&gpu.uuid) {
            Ok(mode) if mode == EXCLUSIVE_PROCESS => {}
            Ok(mode) => drifts.push(Drift {
                uuid: gpu.uuid.clone(),
                found: Ok(mode),
                reset: Some(backend.set_compute_mode(&gpu.uuid, EXCLUSIVE_PROCESS)),
            }),
            Err(e) => drifts.push(Drift {
                uuid: gpu.uuid.clone(),
                found: Err(e),
                reset: None,
            }),
        }
    }
    drifts
}

/// Puts back every saved mode; what could not be restored stays in `saved` for the next try.
pub fn restore_compute_modes(
    backend: &dyn GpuBackend,
    saved: &mut BTreeMap<String, String>,
) -> Vec<(String, GpuBackendError)> {
    let mut failures = Vec::new();
    let entries: Vec<(String, String)> = saved.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    for (uuid, mode) in entries {
        match backend.set_compute_mode(&uuid, &mode) {
            Ok(()) => {
                saved.remove(&uuid);
            }
            Err(e) => failures.push((uuid, e)),
        }
    }
    failures
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use gpu_mps_api::inventory::Inventory;

    use super::*;

    /// Records every mode change instead of touching a GPU.
    struct RecordingBackend {
        modes: Mutex<BTreeMap<String, String>>,
        calls: Mutex<Vec<(String, String)>>,
        refuse: bool,
    }

    impl RecordingBackend {
        fn new(modes: &[(&str, &str)], refuse: bool) -> Self {
            RecordingBackend {
                modes: Mutex::new(
                    modes
                        .iter()
                        .map(|(u, m)| (u.to_string(), m.to_string()))
                        .collect(),
                ),
                calls: Mutex::new(Vec::new()),
                refuse,
            }
        }
    }

    impl GpuBackend for RecordingBackend {
        fn inventory(&self) -> Result<Inventory, GpuBackendError> {
            unreachable!("not used")
        }
        fn compute_mode(&self, uuid: &str) -> Result<String, GpuBackendError> {
            Ok(self.modes.lock().unwrap()[uuid].clone())
        }
        fn set_compute_mode(&self, uuid: &str, mode: &str) -> Result<(), GpuBackendError> {
            if self.refuse {
                return Err(GpuBackendError::UnknownGpu(uuid.into()));
            }
            self.calls.lock().unwrap().push((uuid.into(), mode.into()));
            self.modes.lock().unwrap().insert(uuid.into(), mode.into());
            Ok(())
        }
    }

    fn gpus(uuids: &[&str]) -> Vec<GpuInfo> {
        uuids
            .iter()
            .enumerate()
            .map(|(i, u)| GpuInfo {
                index: i as u32,
                minor: i as u32,
                uuid: u.to_string(),
                name: "t".into(),
                memory_bytes: 1 << 34,
                compute_mode: String::new(),
                mig_enabled: false,
            })
            .collect()
    }

    #[test]
    fn sets_exclusive_process_and_restores_the_previous_mode() {
        let b = RecordingBackend::new(&[("GPU-0", "Default"), ("GPU-1", "ExclusiveProcess")], false);
        let mut saved = BTreeMap::new();
        let changed = enforce_exclusive_process(&b, &gpus(&["GPU-0", "GPU-1"]), &mut saved).unwrap();
        assert_eq!(changed, ["GPU-0"]);
        assert_eq!(saved.get("GPU-0").map(String::as_str), Some("Default"));
        assert!(
            !saved.contains_key("GPU-1"),
            "a mode the operator set is not ours to restore"
        );
        assert_eq!(
            b.calls.lock().unwrap().as_slice(),
            [("GPU-0".to_string(), "ExclusiveProcess".to_string())]
        );

        // A restart after a crash finds ExclusiveProcess: it must keep the operator's Default.
        let again = enforce_exclusive_process(&b, &gpus(&["GPU-0"]), &mut saved).unwrap();
        assert!(again.is_empty());
        assert_eq!(saved.get("GPU-0").map(String::as_str), Some("Default"));

        assert!(restore_compute_modes(&b, &mut saved).is_empty());
        assert!(saved.is_empty());
        assert_eq!(b.modes.lock().unwrap()["GPU-0"], "Default");
    }

    #[test]
    fn a_drifted_mode_is_reported_and_set_again() {
        let b = RecordingBackend::new(&[("GPU-0", "ExclusiveProcess"), ("GPU-1", "Default")], false);
        let drifts = reassert_exclusive_process(&b, &gpus(&["GPU-0", "GPU-1"]));
        assert_eq!(drifts.len(), 1);
        assert_eq!(drifts[0].uuid, "GPU-1");
        assert_eq!(drifts[0].found.as_deref().ok(), Some("Default"));
        assert!(matches!(drifts[0].reset, Some(Ok(()))));
        assert_eq!(b.modes.lock().unwrap()["GPU-1"], "ExclusiveProcess");
        assert!(reassert_exclusive_process(&b, &gpus(&["GPU-0", "GPU-1"])).is_empty());
        let refusing = RecordingBackend::new(&[("GPU-0", "Default")], true);
        let drifts = reassert_exclusive_process(&refusing, &gpus(&["GPU-0"]));
        assert!(matches!(drifts[0].reset, Some(Err(_))));
    }

    #[test]
    fn a_refused_change_is_an_error_that_says_how_to_opt_out() {
        let b = RecordingBackend::new(&[("GPU-0", "Default")], true);
        let mut saved = BTreeMap::new();
        let e = enforce_exclusive_process(&b, &gpus(&["GPU-0"]), &mut saved)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("GPU-0") && e.contains("exclusive_process = false"),
            "{e}"
        );
        let mut saved = BTreeMap::from([("GPU-0".to_string(), "Default".to_string())]);
        assert_eq!(restore_compute_modes(&b, &mut saved).len(), 1);
        assert!(saved.contains_key("GPU-0"), "kept for the next try");
    }
}
