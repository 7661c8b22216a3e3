//! What gpu-mps-checker prints inside a container: one JSON line per subcommand, read with the
//! types the checker writes it with (tests/support/checker, its library). Reading is strict: a
//! missing or unknown key fails the parse, with the line and a hint in the message.

use anyhow::{Context, Result};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Where a GPU container sees its gate dir.
pub use gpu_mps_api::CONTAINER_PIPE_DIR;
pub use gpu_mps_checker::{
    CLI_CANNOT_SEND, CUDA_REFUSED, DevShm, Mount, MpsClient, MpsProcesses, MpsRaw, MpsStall, MpsUi,
    NvidiaSmi, PipeDir, Report,
};

use crate::binaries::BUILD_CHECKER;

/// A checker line, parsed: `Report::parse(line)`, `MpsClient::parse(line)`.
pub trait CheckerLine: DeserializeOwned {
    fn parse(line: &str) -> Result<Self> {
        serde_json::from_str(line.trim()).with_context(|| {
            format!(
                "unexpected checker output {line:?} (a checker built from other sources? rebuild it: {BUILD_CHECKER})"
            )
        })
    }
}

impl CheckerLine for Report {}
impl CheckerLine for MpsClient {}
impl CheckerLine for MpsUi {}
impl CheckerLine for MpsStall {}
impl CheckerLine for MpsProcesses {}
impl CheckerLine for MpsRaw {}

/// The report without what differs between any two containers (namespace ids, marker names,
/// device numbers, mount ids): two containers given the same spec compare equal.
pub fn comparable(report: &Report) -> Result<Value> {
    let mut json = to_json(report)?;
    strip(
        &mut json,
        &[
            "pid",
            "namespaces",
            "marker",
            "st_dev",
            "st_dev_major",
            "st_dev_minor",
        ],
    );
    strip(
        &mut json,
        &[
            "mount_id",
            "parent_id",
            "major_minor",
            "root",
            "source",
            "super_options",
        ],
    );
    Ok(json)
}

fn to_json(line: &impl Serialize) -> Result<Value> {
    serde_json::to_value(line).context("a checker line as JSON")
}

/// Removes `keys` from every object in `value`, recursively.
fn strip(value: &mut Value, keys: &[&str]) {
    match value {
        Value::Object(map) => {
            map.retain(|k, _| !keys.contains(&k.as_str()));
            map.values_mut().for_each(|v| strip(v, keys));
        }
        Value::Array(items) => items.iter_mut().for_each(|v| strip(v, keys)),
        _ => {}
    }
}

/// The host's own namespace of a type, as a container's report spells it.
pub fn host_namespace(kind: &str) -> Option<String> {
    std::fs::read_link(format!("/proc/self/ns/{kind}"))
        .ok()
        .map(|l| l.to_string_lossy().into_owned())
}

/// A SOCK_SEQPACKET connection to an MPS `control` socket, as a CUDA client opens one (for a
/// test that plays a misbehaving client from the host).
pub fn seqpacket_connect(path: &std::path::Path) -> Result<std::os::unix::net::UnixStream> {
    use std::os::fd::AsRawFd;

    use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr};
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    socket::connect(fd.as_raw_fd(), &UnixAddr::new(path)?)
        .with_context(|| format!("connecting to {}", path.display()))?;
    Ok(std::os::unix::net::UnixStream::from(fd))
}

#[cfg(test)]
mod tests {
    use super::*;

    const REPORT: &str = r#"{"pid":1,"uid":0,"gid":0,"euid":0,"egid":0,"cap_eff":"00000000a80425fb",
        "env":{"CUDA_MPS_PIPE_DIRECTORY":"/tmp/nvidia-mps"},"namespaces":{"ipc":"ipc:[4026532180]"},"hostname":"h",
        "mps_pipe_dir":{"path":"/tmp/nvidia-mps","exists":true,"is_mount_point":true,
            "mount":{"mount_id":5,"parent_id":1,"major_minor":"0:1","root":"/r/daemons/GPU-1/pipe",
                "mount_point":"/tmp/nvidia-mps","options":"ro,nosuid","fstype":"tmpfs","source":"tmpfs","super_options":"rw"},
            "control_exists":true,"control_is_socket":true,"create_file":"EROFS","entries":["control"]},
        "dev_shm":{"exists":true,"is_mount_point":true,"mount":null,"st_dev":7,"st_dev_major":0,"st_dev_minor":7,
            "marker":"/dev/shm/x","marker_created":true,"marker_error":null},
        "nvidia_smi":{"/usr/bin/nvidia-smi":{"exists":true,"masked":true,"size":0,"head":"","error":null}}}"#;

    #[test]
    fn comparable_drops_what_differs_between_containers() {
        let report = Report::parse(REPORT).unwrap();
        assert_eq!(report.env("CUDA_MPS_PIPE_DIRECTORY"), Some("/tmp/nvidia-mps"));
        let comparable = comparable(&report).unwrap();
        assert!(comparable.get("namespaces").is_none() && comparable["dev_shm"].get("marker").is_none());
        assert!(comparable["mps_pipe_dir"]["mount"].get("root").is_none());
        assert_eq!(comparable["mps_pipe_dir"]["create_file"], "EROFS");
    }

    #[test]
    fn a_line_of_another_checker_fails_with_a_hint() {
        let renamed = REPORT.replace(r#""control_exists""#, r#""control_present""#);
        let e = format!("{:#}", Report::parse(&renamed).unwrap_err());
        assert!(e.contains("rebuild it") && e.contains("control_present"), "{e}");
        assert!(MpsClient::parse("not json").is_err());
        assert!(MpsClient::parse(r#"{"connected":true}"#).is_err());
    }
}
