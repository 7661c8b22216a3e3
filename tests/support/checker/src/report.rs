//! `report`: what the container sees of the things gpu-mps changes or must leave alone.

use std::fs::{self, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use std::collections::BTreeMap;

use gpu_mps_checker::mountinfo::{self, Mount};
use gpu_mps_checker::{DevShm, NvidiaSmi, PIPE_DIR, PipeDir, Report};
use nix::sys::stat::{major, minor};
use nix::unistd::{getegid, geteuid, getgid, getpid, getuid};

use crate::errno_name;

pub const NVIDIA_SMI_PATHS: [&str; 5] = [
    "/usr/bin/nvidia-smi",
    "/usr/local/bin/nvidia-smi",
    "/usr/local/nvidia/bin/nvidia-smi",
    "/bin/nvidia-smi",
    "/usr/sbin/nvidia-smi",
];
const NAMESPACES: [&str; 6] = ["ipc", "pid", "mnt", "net", "uts", "user"];

pub fn report() -> Report {
    let mounts = fs::read_to_string("/proc/self/mountinfo")
        .map(|t| mountinfo::parse_readable(&t))
        .unwrap_or_default();
    Report {
        pid: getpid().as_raw(),
        uid: getuid().as_raw(),
        gid: getgid().as_raw(),
        euid: geteuid().as_raw(),
        egid: getegid().as_raw(),
        cap_eff: cap_eff(),
        env: env(),
        namespaces: namespaces(),
        hostname: fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_string()),
        mps_pipe_dir: pipe_dir(&mounts),
        dev_shm: dev_shm(&mounts),
        nvidia_smi: NVIDIA_SMI_PATHS
            .iter()
            .map(|p| (p.to_string(), nvidia_smi(p)))
            .collect(),
    }
}

/// The `CapEff` hex mask from /proc/self/status.
fn cap_eff() -> Option<String> {
    let status = fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|v| v.trim().to_string())
}

fn env() -> BTreeMap<String, String> {
    std::env::vars_os()
        .map(|(k, v)| (k.to_string_lossy().into_owned(), v.to_string_lossy().into_owned()))
        .filter(|(k, _)| k.starts_with("CUDA_") || k.starts_with("NVIDIA_"))
        .collect()
}

/// `ipc:[4026531839]` per namespace; None where it cannot be read.
fn namespaces() -> BTreeMap<String, Option<String>> {
    NAMESPACES
        .iter()
        .map(|ns| {
            let link = fs::read_link(format!("/proc/self/ns/{ns}"))
                .ok()
                .map(|l| l.to_string_lossy().into_owned());
            (ns.to_string(), link)
        })
        .collect()
}

/// The mount `path` is on, and whether `path` is its mount point.
fn mount_of(mounts: &[Mount], path: &str) -> (bool, Option<Mount>) {
    let resolved = fs::canonicalize(path)
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or(path.to_string());
    match mountinfo::containing(mounts, &resolved) {
        Some(m) => (m.mount_point == resolved, Some(m.clone())),
        None => (false, None),
    }
}

fn pipe_dir(mounts: &[Mount]) -> PipeDir {
    let dir = Path::new(PIPE_DIR);
    let control = fs::symlink_metadata(dir.join("control")).ok();
    let (is_mount_point, mount) = mount_of(mounts, PIPE_DIR);
    PipeDir {
        path: PIPE_DIR.to_string(),
        exists: dir.exists(),
        is_mount_point,
        mount,
        control_exists: control.is_some(),
        control_is_socket: control.is_some_and(|m| m.file_type().is_socket()),
        create_file: try_create(dir),
        entries: entries(dir),
    }
}

/// The names in `dir`, sorted; empty when it cannot be read.
fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// "ok" when a new file can be created in `dir` (it is removed again), else the errno name.
fn try_create(dir: &Path) -> String {
    let probe = dir.join(format!(
        ".gpu-mps-checker-probe-{}-{}",
        std::process::id(),
        nanos()
    ));
    match OpenOptions::new().write(true).create_new(true).open(&probe) {
        Ok(_) => {
            let _ = fs::remove_file(&probe);
            "ok".to_string()
        }
        Err(e) => errno_name(&e),
    }
}

/// /dev/shm: its mount and device, and a marker file left there on purpose, so that a test can
/// check that the host's /dev/shm does not get it (the container's /dev/shm is its own).
fn dev_shm(mounts: &[Mount]) -> DevShm {
    let (is_mount_point, mount) = mount_of(mounts, "/dev/shm");
    let meta = fs::metadata("/dev/shm").ok();
    let marker = format!("/dev/shm/gpu-mps-checker-{}-{}", std::process::id(), nanos());
    let created = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&marker)
        .and_then(|mut f| f.write_all(format!("gpu-mps-checker pid {}\n", std::process::id()).as_bytes()));
    DevShm {
        exists: meta.is_some(),
        is_mount_point,
        mount,
        st_dev: meta.as_ref().map(|m| m.dev()),
        st_dev_major: meta.as_ref().map(|m| major(m.dev())),
        st_dev_minor: meta.as_ref().map(|m| minor(m.dev())),
        marker,
        marker_created: created.is_ok(),
        marker_error: created.err().map(|e| errno_name(&e)),
    }
}

/// Masked paths are /dev/null (char 1:3) bind-mounted over the file.
fn nvidia_smi(path: &str) -> NvidiaSmi {
    let meta = match fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) => {
            return NvidiaSmi {
                exists: false,
                masked: false,
                size: None,
                head: None,
                error: (e.kind() != std::io::ErrorKind::NotFound).then(|| errno_name(&e)),
            };
        }
    };
    let masked = meta.file_type().is_char_device() && major(meta.rdev()) == 1 && minor(meta.rdev()) == 3;
    let mut head = Vec::new();
    let read = fs::File::open(path).and_then(|f| f.take(64).read_to_end(&mut head));
    NvidiaSmi {
        exists: true,
        masked,
        size: Some(meta.len()),
        head: read.is_ok().then(|| String::from_utf8_lossy(&head).into_owned()),
        error: read.err().map(|e| errno_name(&e)),
    }
}

fn nanos() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}
