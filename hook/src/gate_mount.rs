//! Whether the container's /tmp/nvidia-mps is its gate when its createRuntime hooks run.
//!
//! runc runs every prestart hook before the createRuntime hooks, both in the runtime's
//! namespaces, after it has made the spec's mounts and before pivot_root (docs/adr/0011): so a
//! prestart hook can mount over the gate. The NVIDIA Container Toolkit's legacy hook does, where
//! the host has a /tmp/nvidia-mps: it binds that over the container's. /tmp is world-writable,
//! so any host account would then choose what the container's CUDA processes reach: an empty
//! dir (a direct context, the whole GPU) or a daemon of its own. The create is refused instead.
//!
//! The gate is found in the container's mountinfo by what its bind shows (the filesystem and
//! the gate dir's path inside it, from the hook's own mountinfo, the host's), not by a path
//! under the rootfs, so an image whose /tmp is a symlink is judged where runc really mounted.

use std::path::{Path, PathBuf};

use gpu_mps_api::{CONTAINER_PIPE_DIR, ContainerId};
use thiserror::Error;

use gpu_mps_mountinfo::{self as mountinfo, Mount};

#[derive(Debug, Error)]
pub enum GateMountError {
    #[error("reading the container's spec {path}: {source}")]
    Spec { path: PathBuf, source: std::io::Error },
    #[error("the container's spec {path} is not valid JSON: {message}")]
    SpecJson { path: PathBuf, message: String },
    #[error("{0}")]
    ContainerId(#[from] gpu_mps_api::container_id::ContainerIdError),
    #[error(
        "the container's spec {path} mounts no gate dir named {gate_name} at {CONTAINER_PIPE_DIR} (gpu-mps-shim writes one; did something rewrite the spec after it?)"
    )]
    NoGateInSpec { path: PathBuf, gate_name: String },
    #[error("the container's gate dir {path}: {source}")]
    GateDir { path: PathBuf, source: std::io::Error },
    #[error("reading {path}: {source}")]
    ReadMountinfo { path: String, source: std::io::Error },
    #[error("{path}: {source}")]
    Mountinfo {
        path: String,
        source: mountinfo::ParseError,
    },
    #[error("the host's mountinfo has no mount that holds the gate dir {0}")]
    GateNotOnHost(String),
    #[error("{0}")]
    NotTheGate(#[from] NotTheGate),
}

/// What the container has at /tmp/nvidia-mps instead of its gate.
#[derive(Debug, PartialEq, Eq, Error)]
pub enum NotTheGate {
    #[error(
        "the container's {CONTAINER_PIPE_DIR} is not its MPS gate {gate}: no mount of the gate is in the container (a prestart hook unmounted it?); refused"
    )]
    Missing { gate: String },
    #[error(
        "the container's {CONTAINER_PIPE_DIR} is not its MPS gate {gate}: a mount made after runc's covers it ({} {} on {}); the NVIDIA toolkit's legacy hook binds the host's {CONTAINER_PIPE_DIR} there when the host has one: remove that dir from the host or run the toolkit in CDI mode (see gpu-mps doctor); refused",
        .by.fstype, describe_source(.by), .by.mount_point
    )]
    Covered { gate: String, by: Box<Mount> },
    #[error(
        "the container's {CONTAINER_PIPE_DIR} is not only its MPS gate {gate}: a mount inside it ({} {} on {}) answers for part of it; refused",
        .by.fstype, describe_source(.by), .by.mount_point
    )]
    Inside { gate: String, by: Box<Mount> },
}

/// `/dev/vda:/tmp/nvidia-mps`: the filesystem and the directory of it that is mounted.
fn describe_source(m: &Mount) -> String {
    format!("{}:{}", m.source, m.root)
}

/// Refuses unless every mount of the gate in `container` (the container's mountinfo) at a
/// `.../tmp/nvidia-mps` is what serves its mount point, with no mount inside it, and there is
/// one. `gate` is what a bind of the gate dir shows ([`mountinfo::bind_identity`]); `gate_dir`
/// names it in the refusal.
pub fn check(container: &[Mount], gate: &(String, String), gate_dir: &str) -> Result<(), NotTheGate> {
    let is_gate = |m: &Mount| m.major_minor == gate.0 && m.root == gate.1;
    let at_container_mps_dir = |m: &Mount| {
        m.mount_point
            .strip_suffix(CONTAINER_PIPE_DIR)
            .is_some_and(|head| !head.ends_with('/'))
    };
    let gates: Vec<&Mount> = container
        .iter()
        .filter(|m| is_gate(m) && at_container_mps_dir(m))
        .collect();
    if gates.is_empty() {
        return Err(NotTheGate::Missing {
            gate: gate_dir.to_string(),
        });
    }
    for g in gates {
        match mountinfo::serving(container, &g.mount_point) {
            Some(top) if is_gate(top) && top.mount_point == g.mount_point => {}
            Some(top) => {
                return Err(NotTheGate::Covered {
                    gate: gate_dir.to_string(),
                    by: Box::new(top.clone()),
                });
            }
            None => {
                return Err(NotTheGate::Missing {
                    gate: gate_dir.to_string(),
                });
            }
        }
        let inside = container.iter().find(|m| {
            m.mount_point != g.mount_point
                && mountinfo::is_at_or_below(&m.mount_point, &g.mount_point)
                && mountinfo::serving(container, &m.mount_point).is_some_and(|top| top == *m)
        });
        if let Some(m) = inside {
            return Err(NotTheGate::Inside {
                gate: gate_dir.to_string(),
                by: Box::new(m.clone()),
            });
        }
    }
    Ok(())
}

/// The gate dir the shim mounted at /tmp/nvidia-mps: the source of the spec's mount there that
/// is named for this container (a mount another runtime added at the same place is not it).
pub fn gate_dir_in_spec(spec: &serde_json::Value, gate_name: &str) -> Option<PathBuf> {
    spec.get("mounts")?
        .as_array()?
        .iter()
        .filter(|m| m.get("destination").and_then(|d| d.as_str()) == Some(CONTAINER_PIPE_DIR))
        .filter_map(|m| m.get("source").and_then(|s| s.as_str()))
        .map(PathBuf::from)
        .find(|source| source.file_name().is_some_and(|n| n == gate_name))
}

/// Reads what [`check`] needs: the spec in `bundle`, the hook's mountinfo (the host's) and the
/// mountinfo of the container's init process `pid`.
pub fn verify(container_id: &str, bundle: &Path, pid: u32) -> Result<(), GateMountError> {
    let spec_path = bundle.join("config.json");
    let text = std::fs::read_to_string(&spec_path).map_err(|source| GateMountError::Spec {
        path: spec_path.clone(),
        source,
    })?;
    let spec: serde_json::Value = serde_json::from_str(&text).map_err(|e| GateMountError::SpecJson {
        path: spec_path.clone(),
        message: e.to_string(),
    })?;
    let gate_name = ContainerId::parse(container_id)?.gate_name();
    let gate_dir = gate_dir_in_spec(&spec, &gate_name).ok_or(GateMountError::NoGateInSpec {
        path: spec_path,
        gate_name,
    })?;
    let gate_dir = std::fs::canonicalize(&gate_dir).map_err(|source| GateMountError::GateDir {
        path: gate_dir,
        source,
    })?;
    let gate_dir = gate_dir.to_string_lossy().into_owned();
    let host = read_mountinfo("/proc/self/mountinfo")?;
    let gate = mountinfo::bind_identity(&host, &gate_dir)
        .ok_or_else(|| GateMountError::GateNotOnHost(gate_dir.clone()))?;
    let container = read_mountinfo(&format!("/proc/{pid}/mountinfo"))?;
    Ok(check(&container, &gate, &gate_dir)?)
}

fn read_mountinfo(path: &str) -> Result<Vec<Mount>, GateMountError> {
    let text = std::fs::read_to_string(path).map_err(|source| GateMountError::ReadMountinfo {
        path: path.to_string(),
        source,
    })?;
    mountinfo::parse(&text).map_err(|source| GateMountError::Mountinfo {
        path: path.to_string(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GATE_DIR: &str = "/run/gpu-mps/gates/49c1";

    fn gate() -> (String, String) {
        ("0:30".into(), "/gpu-mps/gates/49c1".into())
    }

    /// A container before pivot_root as runc 1.1.5 left it: containerd's overlay at the rootfs,
    /// runc's bind of the rootfs onto itself, the gate bound read-only (mount ids from a run).
    const RUNC: &str = "\
1 0 254:0 / / rw - ext4 /dev/vda rw
30 1 0:30 / /run rw - tmpfs tmpfs rw
68 30 0:40 / /run/c/b/rootfs rw - overlay overlay rw
69 68 0:40 / /run/c/b/rootfs rw - overlay overlay rw
70 69 0:41 / /run/c/b/rootfs/proc rw - proc proc rw
85 69 0:30 /gpu-mps/gates/49c1 /run/c/b/rootfs/tmp/nvidia-mps ro - tmpfs tmpfs rw
";

    fn with(extra: &str) -> Vec<Mount> {
        mountinfo::parse(&format!("{RUNC}{extra}")).unwrap()
    }

    #[test]
    fn the_gate_runc_mounted_passes() {
        assert_eq!(check(&with(""), &gate(), GATE_DIR), Ok(()));
        // A mount elsewhere made later, or the gate bound a second time elsewhere, is no cover.
        let later = "86 69 0:42 / /run/c/b/rootfs/dev rw - tmpfs tmpfs rw\n\
                     87 69 0:30 /gpu-mps/gates/49c1 /run/c/b/rootfs/elsewhere ro - tmpfs tmpfs rw\n";
        assert_eq!(check(&with(later), &gate(), GATE_DIR), Ok(()));
    }

    #[test]
    fn a_bind_stacked_on_the_gate_is_refused_with_what_covers_it() {
        // What the toolkit's legacy hook does: the host's /tmp/nvidia-mps over the gate.
        let over = "86 85 254:0 /tmp/nvidia-mps /run/c/b/rootfs/tmp/nvidia-mps rw - ext4 /dev/vda rw\n";
        let err = check(&with(over), &gate(), GATE_DIR).unwrap_err();
        assert!(
            matches!(&err, NotTheGate::Covered { by, .. } if by.mount_id == 86),
            "{err:?}"
        );
        let line = err.to_string();
        assert!(
            line.contains("is not its MPS gate /run/gpu-mps/gates/49c1")
                && line.contains("ext4 /dev/vda:/tmp/nvidia-mps on /run/c/b/rootfs/tmp/nvidia-mps")
                && line.contains("remove that dir from the host or run the toolkit in CDI mode")
                && !line.contains('\n'),
            "{line}"
        );
    }

    #[test]
    fn a_mount_over_a_dir_above_the_gate_is_refused() {
        let over_tmp = "86 69 0:50 / /run/c/b/rootfs/tmp rw - tmpfs tmpfs rw\n";
        let err = check(&with(over_tmp), &gate(), GATE_DIR).unwrap_err();
        assert!(
            matches!(&err, NotTheGate::Covered { by, .. } if by.mount_id == 86),
            "{err:?}"
        );
        let over_rootfs = "86 69 0:50 / /run/c/b/rootfs rw - tmpfs tmpfs rw\n";
        assert!(matches!(
            check(&with(over_rootfs), &gate(), GATE_DIR),
            Err(NotTheGate::Covered { .. })
        ));
    }

    #[test]
    fn a_mount_inside_the_gate_is_refused() {
        let inside = "86 85 254:0 /tmp/evil /run/c/b/rootfs/tmp/nvidia-mps/control rw - ext4 /dev/vda rw\n";
        let err = check(&with(inside), &gate(), GATE_DIR).unwrap_err();
        assert!(
            matches!(&err, NotTheGate::Inside { by, .. } if by.mount_id == 86),
            "{err:?}"
        );
    }

    #[test]
    fn no_gate_mount_is_refused() {
        let without: Vec<Mount> = with("").into_iter().filter(|m| m.mount_id != 85).collect();
        assert_eq!(
            check(&without, &gate(), GATE_DIR),
            Err(NotTheGate::Missing {
                gate: GATE_DIR.into()
            })
        );
        // The host's /tmp/nvidia-mps in its place: not the gate, so missing.
        let other = mountinfo::parse(&RUNC.replace(
            "0:30 /gpu-mps/gates/49c1 /run/c/b",
            "254:0 /tmp/nvidia-mps /run/c/b",
        ))
        .unwrap();
        assert!(matches!(
            check(&other, &gate(), GATE_DIR),
            Err(NotTheGate::Missing { .. })
        ));
        // Another container's gate, a name that only ends the same.
        let neighbour = mountinfo::parse(&RUNC.replace("gates/49c1", "gates/149c1")).unwrap();
        assert!(matches!(
            check(&neighbour, &gate(), GATE_DIR),
            Err(NotTheGate::Missing { .. })
        ));
        // The gate only at a point that is not .../tmp/nvidia-mps.
        let moved =
            mountinfo::parse(&RUNC.replace("rootfs/tmp/nvidia-mps", "rootfs/tmp/xnvidia-mps")).unwrap();
        assert!(matches!(
            check(&moved, &gate(), GATE_DIR),
            Err(NotTheGate::Missing { .. })
        ));
    }

    #[test]
    fn paths_with_escaped_spaces_are_compared_unescaped() {
        let spaced = mountinfo::parse(
            &RUNC
                .replace("/run/c/b", "/run/c\\040d/b")
                .replace("/gpu-mps/gates/49c1", "/gpu\\040mps/gates/49c1"),
        )
        .unwrap();
        let gate = ("0:30".to_string(), "/gpu mps/gates/49c1".to_string());
        assert_eq!(check(&spaced, &gate, "/run/gpu mps/gates/49c1"), Ok(()));
        let covered = mountinfo::parse(&format!(
            "{}86 85 254:0 /tmp/nvidia-mps /run/c\\040d/b/rootfs/tmp/nvidia-mps rw - ext4 /dev/vda rw\n",
            RUNC.replace("/run/c/b", "/run/c\\040d/b")
                .replace("/gpu-mps/gates/49c1", "/gpu\\040mps/gates/49c1")
        ))
        .unwrap();
        assert!(matches!(
            check(&covered, &gate, "/run/gpu mps/gates/49c1"),
            Err(NotTheGate::Covered { .. })
        ));
    }

    #[test]
    fn the_gate_dir_is_the_spec_mount_named_for_the_container() {
        let spec = serde_json::json!({"mounts": [
            {"destination": "/proc", "source": "proc"},
            {"destination": "/tmp/nvidia-mps", "source": "/run/gpu-mps/gates/49c1"},
            {"destination": "/tmp/nvidia-mps", "source": "/tmp/nvidia-mps"},
        ]});
        assert_eq!(
            gate_dir_in_spec(&spec, "49c1"),
            Some(PathBuf::from("/run/gpu-mps/gates/49c1"))
        );
        assert_eq!(gate_dir_in_spec(&spec, "ffff"), None);
        assert_eq!(gate_dir_in_spec(&serde_json::json!({}), "49c1"), None);
    }
}
