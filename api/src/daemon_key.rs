//! Which MPS control daemon serves a container: one per set of GPUs.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The sorted, de-duplicated GPU UUIDs a daemon is scoped to (its `CUDA_VISIBLE_DEVICES`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DaemonKey(Vec<String>);

impl DaemonKey {
    pub fn new<I, S>(uuids: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut v: Vec<String> = uuids.into_iter().map(Into::into).collect();
        v.sort();
        v.dedup();
        DaemonKey(v)
    }

    pub fn gpu_uuids(&self) -> &[String] {
        &self.0
    }

    pub fn contains(&self, uuid: &str) -> bool {
        self.0.iter().any(|u| u == uuid)
    }

    pub fn overlaps(&self, other: &DaemonKey) -> bool {
        self.0.iter().any(|u| other.contains(u))
    }

    /// The daemon's directory name under `<root>/daemons/`. One GPU: its UUID, which an
    /// operator recognises. Several: a stable hash, because the pipe dir path must stay
    /// short: the daemon binds `<dir>/pipe/control`, and a unix socket path has 108 bytes.
    pub fn dir_name(&self) -> String {
        match self.0.as_slice() {
            [one] => one.clone(),
            many => format!("set-{:016x}", fnv1a64(many.join(",").as_bytes())),
        }
    }

    /// `CUDA_VISIBLE_DEVICES` for the daemon.
    pub fn cuda_visible_devices(&self) -> String {
        self.0.join(",")
    }
}

impl fmt::Display for DaemonKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join("+"))
    }
}

// FNV-1a: stable across releases and platforms, which std's hasher is not promised to be.
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorted_and_deduplicated() {
        let k = DaemonKey::new(["GPU-b", "GPU-a", "GPU-b"]);
        assert_eq!(k.gpu_uuids(), ["GPU-a", "GPU-b"]);
        assert_eq!(k, DaemonKey::new(["GPU-a", "GPU-b"]));
        assert_eq!(k.cuda_visible_devices(), "GPU-a,GPU-b");
    }

    #[test]
    fn dir_names_are_short_and_stable() {
        let one = DaemonKey::new(["GPU-f4a5989b-1a67-4cc0-7351-377fc0e0cef8"]);
        assert_eq!(one.dir_name(), "GPU-f4a5989b-1a67-4cc0-7351-377fc0e0cef8");
        let two = DaemonKey::new([
            "GPU-f4a5989b-1a67-4cc0-7351-377fc0e0cef8",
            "GPU-00000000-1a67-4cc0-7351-377fc0e0cef8",
        ]);
        assert_eq!(two.dir_name().len(), 20);
        assert_eq!(two.dir_name(), two.clone().dir_name());
        assert_ne!(two.dir_name(), DaemonKey::new(["GPU-x", "GPU-y"]).dir_name());
    }

    #[test]
    fn overlap() {
        let a = DaemonKey::new(["GPU-0"]);
        let ab = DaemonKey::new(["GPU-0", "GPU-1"]);
        assert!(a.overlaps(&ab));
        assert!(!a.overlaps(&DaemonKey::new(["GPU-1"])));
    }
}
