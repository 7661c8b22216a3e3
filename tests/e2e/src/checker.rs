//! What gpu-mps-checker prints inside a container: one JSON line per subcommand
//! (tests/support/checker). Fields missing from a line read as their defaults, so a test
//! fails on the value it checks, with the whole line in its message, not on parsing.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Where a GPU container sees its daemon's pipe dir.
pub use gpu_mps_api::CONTAINER_PIPE_DIR;

/// `checker report`: what the container sees of what gpu-mps changes or must leave alone.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Report {
    pub pid: i64,
    pub uid: u32,
    pub gid: u32,
    /// `CapEff` from /proc/self/status, hex.
    pub cap_eff: Option<String>,
    /// The container's CUDA_* and NVIDIA_* variables.
    pub env: BTreeMap<String, String>,
    /// `ipc:[4026531839]` per namespace type.
    pub namespaces: BTreeMap<String, Option<String>>,
    pub hostname: Option<String>,
    pub mps_pipe_dir: PipeDir,
    pub dev_shm: DevShm,
    /// Per nvidia-smi path the shim masks.
    pub nvidia_smi: BTreeMap<String, NvidiaSmi>,
    /// The line as printed.
    #[serde(skip)]
    pub json: Value,
}

/// /tmp/nvidia-mps as the container sees it.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct PipeDir {
    pub exists: bool,
    pub is_mount_point: bool,
    /// The mount /tmp/nvidia-mps is on.
    pub mount: Option<MountInfo>,
    pub control_exists: bool,
    pub control_is_socket: bool,
    /// "ok", or the errno name of creating a file there (EROFS when read-only).
    pub create_file: String,
}

/// A /proc/self/mountinfo line.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct MountInfo {
    /// The path inside the mounted filesystem: for a bind mount, its source.
    pub root: String,
    pub mount_point: String,
    /// Per-mount options, e.g. `ro,nosuid,nodev,noexec,relatime`.
    pub options: String,
    pub fstype: String,
    pub source: String,
}

impl MountInfo {
    pub fn has_option(&self, option: &str) -> bool {
        self.options.split(',').any(|o| o == option)
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct DevShm {
    pub exists: bool,
    pub is_mount_point: bool,
    pub mount: Option<MountInfo>,
    /// A file the checker left in its /dev/shm: the host's /dev/shm must not have it.
    pub marker: String,
    pub marker_created: bool,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct NvidiaSmi {
    pub exists: bool,
    /// /dev/null (char 1:3) mounted over it.
    pub masked: bool,
    pub size: Option<u64>,
    /// The first bytes read from it.
    pub head: Option<String>,
}

/// `checker mps-client`: what the (fake) MPS control daemon told a client.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct MpsClient {
    pub connected: bool,
    pub server_pid: Option<u32>,
    /// The server's active thread percentage, as the daemon prints it (`25.0`).
    pub threads: Option<String>,
    /// Pinned memory limit per device index, as the daemon prints it (`4G`).
    pub mem: BTreeMap<String, String>,
    pub pipe_dir_used: String,
    pub answer: Option<String>,
    pub error: Option<String>,
    #[serde(skip)]
    pub json: Value,
}

/// A checker line, typed, keeping the raw JSON for messages.
pub trait CheckerLine: DeserializeOwned {
    fn set_json(&mut self, json: Value);

    fn parse(line: &str) -> Result<Self> {
        let json: Value = serde_json::from_str(line.trim())
            .with_context(|| format!("the checker printed {line:?}, not JSON"))?;
        let mut parsed: Self = serde_json::from_value(json.clone())
            .with_context(|| format!("unexpected checker output {line}"))?;
        parsed.set_json(json);
        Ok(parsed)
    }
}

impl CheckerLine for Report {
    fn set_json(&mut self, json: Value) {
        self.json = json;
    }
}

impl CheckerLine for MpsClient {
    fn set_json(&mut self, json: Value) {
        self.json = json;
    }
}

impl Report {
    pub fn parse(line: &str) -> Result<Report> {
        <Report as CheckerLine>::parse(line)
    }

    pub fn env(&self, key: &str) -> Option<&str> {
        self.env.get(key).map(String::as_str)
    }

    /// The CUDA_MPS_* variables the container sees.
    pub fn mps_env(&self) -> BTreeMap<&str, &str> {
        self.env
            .iter()
            .filter(|(k, _)| k.starts_with("CUDA_MPS_"))
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect()
    }

    /// The report without what differs between any two containers (namespace ids, marker
    /// names, device numbers, mount ids): two containers given the same spec compare equal.
    pub fn comparable(&self) -> Value {
        let mut json = self.json.clone();
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
        json
    }
}

impl MpsClient {
    pub fn parse(line: &str) -> Result<MpsClient> {
        <MpsClient as CheckerLine>::parse(line)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_report_and_keeps_its_json() {
        let line = r#"{"pid":1,"cap_eff":"00000000a80425fb","env":{"CUDA_MPS_PIPE_DIRECTORY":"/tmp/nvidia-mps"},
            "namespaces":{"ipc":"ipc:[4026532180]"},
            "mps_pipe_dir":{"exists":true,"is_mount_point":true,"mount":{"mount_id":5,"root":"/r/daemons/GPU-1/pipe","options":"ro,nosuid"},"create_file":"EROFS"},
            "dev_shm":{"marker":"/dev/shm/x","st_dev":7},"nvidia_smi":{"/usr/bin/nvidia-smi":{"exists":true,"masked":true,"head":""}}}"#;
        let report = Report::parse(line).unwrap();
        assert_eq!(report.env("CUDA_MPS_PIPE_DIRECTORY"), Some("/tmp/nvidia-mps"));
        assert!(report.mps_pipe_dir.mount.as_ref().unwrap().has_option("ro"));
        assert!(report.nvidia_smi["/usr/bin/nvidia-smi"].masked);
        let comparable = report.comparable();
        assert!(comparable.get("namespaces").is_none() && comparable["dev_shm"].get("marker").is_none());
        assert!(comparable["mps_pipe_dir"]["mount"].get("root").is_none());
        assert_eq!(comparable["mps_pipe_dir"]["create_file"], "EROFS");
    }

    #[test]
    fn parses_an_mps_client_line() {
        let c = MpsClient::parse(r#"{"connected":true,"server_pid":7,"threads":"25.0","mem":{"0":"4G"}}"#)
            .unwrap();
        assert_eq!((c.threads.as_deref(), c.mem["0"].as_str()), (Some("25.0"), "4G"));
        assert!(MpsClient::parse("not json").is_err());
    }
}
