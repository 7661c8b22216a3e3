//! What gpu-mps-checker prints inside a container: one JSON line per subcommand. The checker
//! writes these types and the e2e tests read them back with the same types, so that a key
//! renamed on one side cannot turn into an empty value on the other.
//!
//! Reading is strict: every key must be there (an `Option` as a value or `null`) and no other
//! key may be, so a checker built from other sources than the tests fails to parse instead of
//! passing a negative assertion (`!mps_pipe_dir.exists`) by accident.

pub mod mountinfo;

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize};

pub use mountinfo::Mount;

/// Where a GPU container sees its daemon's pipe dir, and where CUDA looks when
/// CUDA_MPS_PIPE_DIRECTORY is unset.
pub const PIPE_DIR: &str = "/tmp/nvidia-mps";

/// `report`: what the container sees of the things gpu-mps changes or must leave alone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Report {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
    pub euid: u32,
    pub egid: u32,
    /// `CapEff` from /proc/self/status, hex.
    #[serde(deserialize_with = "present")]
    pub cap_eff: Option<String>,
    /// The container's CUDA_* and NVIDIA_* variables.
    pub env: BTreeMap<String, String>,
    /// `ipc:[4026531839]` per namespace type; null where it cannot be read.
    pub namespaces: BTreeMap<String, Option<String>>,
    #[serde(deserialize_with = "present")]
    pub hostname: Option<String>,
    pub mps_pipe_dir: PipeDir,
    pub dev_shm: DevShm,
    /// Per nvidia-smi path the shim masks.
    pub nvidia_smi: BTreeMap<String, NvidiaSmi>,
}

/// /tmp/nvidia-mps as the container sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipeDir {
    pub path: String,
    pub exists: bool,
    pub is_mount_point: bool,
    /// The mount the path is on.
    #[serde(deserialize_with = "present")]
    pub mount: Option<Mount>,
    pub control_exists: bool,
    pub control_is_socket: bool,
    /// "ok", or the errno name of creating a file there (EROFS when read-only).
    pub create_file: String,
}

/// /dev/shm: its mount and device, and a marker file the checker left there on purpose, so
/// that a test can check that the host's /dev/shm does not get it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DevShm {
    pub exists: bool,
    pub is_mount_point: bool,
    #[serde(deserialize_with = "present")]
    pub mount: Option<Mount>,
    #[serde(deserialize_with = "present")]
    pub st_dev: Option<u64>,
    #[serde(deserialize_with = "present")]
    pub st_dev_major: Option<u64>,
    #[serde(deserialize_with = "present")]
    pub st_dev_minor: Option<u64>,
    pub marker: String,
    pub marker_created: bool,
    #[serde(deserialize_with = "present")]
    pub marker_error: Option<String>,
}

/// One nvidia-smi path.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvidiaSmi {
    pub exists: bool,
    /// /dev/null (char 1:3) mounted over it.
    pub masked: bool,
    #[serde(deserialize_with = "present")]
    pub size: Option<u64>,
    /// The first bytes read from it.
    #[serde(deserialize_with = "present")]
    pub head: Option<String>,
    /// The errno name of stat or read, other than ENOENT.
    #[serde(deserialize_with = "present")]
    pub error: Option<String>,
}

/// `mps-client`: what the (fake) MPS control daemon told a client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MpsClient {
    pub connected: bool,
    #[serde(deserialize_with = "present")]
    pub server_pid: Option<u32>,
    /// The server's active thread percentage, as the daemon prints it (`25.0`).
    #[serde(deserialize_with = "present")]
    pub threads: Option<String>,
    /// Pinned memory limit per device index, as the daemon prints it (`4G`); empty when no
    /// server answered.
    pub mem: BTreeMap<String, String>,
    pub pipe_dir_used: String,
    /// The pid and uid the client sent, as it sees them (the daemon uses SO_PEERCRED instead).
    pub sent_pid: i32,
    pub sent_uid: u32,
    /// The daemon's answer line.
    #[serde(deserialize_with = "present")]
    pub answer: Option<String>,
    #[serde(deserialize_with = "present")]
    pub error: Option<String>,
}

/// `pid`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pid {
    pub pid: i32,
}

/// `sleep <seconds>`, printed before sleeping.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sleeping {
    pub sleep_seconds: f64,
    pub pid: i32,
}

/// `exit <code>`, printed before exiting.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Exiting {
    pub exit_code: i32,
    pub pid: i32,
}

/// `pause`, printed once the signals are blocked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Paused {
    pub paused: bool,
    pub pid: i32,
}

/// A command line the checker does not understand (exit code 2).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageError {
    pub error: String,
}

impl Report {
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
}

/// Prints the JSON line, as the checker printed it.
macro_rules! display_as_json {
    ($($line:ty),+) => {
        $(
            impl fmt::Display for $line {
                fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    let json = serde_json::to_string(self).map_err(|_| fmt::Error)?;
                    f.write_str(&json)
                }
            }
        )+
    };
}

display_as_json!(Report, MpsClient, Pid, Sleeping, Exiting, Paused, UsageError);

/// Reads an `Option` whose key must be there. Plain serde reads a missing key as `None`, which
/// would make a renamed key look like "not there" to a test.
fn present<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::deserialize(deserializer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn report_json() -> Value {
        let smi = json!({"exists": true, "masked": true, "size": 0, "head": "", "error": null});
        json!({
            "pid": 1, "uid": 0, "gid": 0, "euid": 0, "egid": 0,
            "cap_eff": "00000000a80425fb",
            "env": {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps", "NVIDIA_VISIBLE_DEVICES": "void"},
            "namespaces": {"ipc": "ipc:[4026532180]", "user": null},
            "hostname": "h",
            "mps_pipe_dir": {
                "path": "/tmp/nvidia-mps", "exists": true, "is_mount_point": true,
                "mount": {"mount_id": 5, "parent_id": 1, "major_minor": "0:1", "root": "/r/daemons/GPU-1/pipe",
                    "mount_point": "/tmp/nvidia-mps", "options": "ro,nosuid", "fstype": "tmpfs",
                    "source": "tmpfs", "super_options": "rw"},
                "control_exists": true, "control_is_socket": true, "create_file": "EROFS"
            },
            "dev_shm": {"exists": true, "is_mount_point": true, "mount": null, "st_dev": 7,
                "st_dev_major": 0, "st_dev_minor": 7, "marker": "/dev/shm/x", "marker_created": true,
                "marker_error": null},
            "nvidia_smi": {"/usr/bin/nvidia-smi": smi},
        })
    }

    #[test]
    fn a_report_reads_back_as_written() {
        let report: Report = serde_json::from_value(report_json()).unwrap();
        assert_eq!(
            report.mps_env(),
            BTreeMap::from([("CUDA_MPS_PIPE_DIRECTORY", PIPE_DIR)])
        );
        assert_eq!(report.env("NVIDIA_VISIBLE_DEVICES"), Some("void"));
        assert!(report.mps_pipe_dir.mount.as_ref().unwrap().has_option("ro"));
        assert_eq!(report.namespaces["user"], None);
        let again: Report = serde_json::from_str(&report.to_string()).unwrap();
        assert_eq!(again, report);
    }

    #[test]
    fn a_missing_or_unknown_key_is_an_error() {
        for (object, key) in [
            ("", "pid"),
            ("", "cap_eff"),
            ("mps_pipe_dir", "exists"),
            ("mps_pipe_dir", "mount"),
            ("dev_shm", "marker_error"),
        ] {
            let mut json = report_json();
            let target = if object.is_empty() {
                &mut json
            } else {
                &mut json[object]
            };
            target.as_object_mut().unwrap().remove(key);
            let e = serde_json::from_value::<Report>(json).unwrap_err().to_string();
            assert!(e.contains(&format!("missing field `{key}`")), "{key}: {e}");
        }
        let mut json = report_json();
        json["mps_pipe_dir"]["exist"] = json!(false);
        assert!(serde_json::from_value::<Report>(json).is_err());
    }

    #[test]
    fn an_mps_client_line() {
        let line = r#"{"connected":true,"server_pid":7,"threads":"25.0","mem":{"0":"4G"},
            "pipe_dir_used":"/tmp/nvidia-mps","sent_pid":1,"sent_uid":0,"answer":"SERVER 7 THREADS 25.0 MEM 0=4G","error":null}"#;
        let c: MpsClient = serde_json::from_str(line).unwrap();
        assert_eq!((c.threads.as_deref(), c.mem["0"].as_str()), (Some("25.0"), "4G"));
        assert!(serde_json::from_str::<MpsClient>(r#"{"connected":true}"#).is_err());
    }
}
