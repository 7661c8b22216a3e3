//! What gpu-mps-checker prints inside a container: one JSON line per subcommand. The checker
//! writes these types and the e2e tests read them back with the same types, so that a key
//! renamed on one side cannot turn into an empty value on the other.
//!
//! Reading is strict: every key must be there (an `Option` as a value or `null`) and no other
//! key may be, so a checker built from other sources than the tests fails to parse instead of
//! passing a negative assertion (`!mps_pipe_dir.exists`) by accident.

/// The one mountinfo parser (crate gpu-mps-mountinfo), as the checker and the e2e harness name it.
pub use gpu_mps_mountinfo as mountinfo;
pub mod mps_framing;

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
    /// What the directory holds, sorted: only `control` when it is the container's gate.
    pub entries: Vec<String>,
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

/// `mps-client`: how a CUDA client's three control connections went (mps_client.rs). Exactly
/// one of `admitted`, `refused`, `direct_context` is true, or none when something else went
/// wrong (`error` says what).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MpsClient {
    /// Something at the control socket said the measured hello.
    pub connected: bool,
    /// Got its channel with the server's line, and a second descriptor.
    pub admitted: bool,
    /// The connection was closed after the request without an answer: a real CUDA client then
    /// fails cleanly (`error` is its message, [`CUDA_REFUSED`]).
    pub refused: bool,
    /// No socket, nobody listening, or closed before the hello: a real CUDA client would then
    /// open a direct context on the whole GPU, without MPS and its limits.
    pub direct_context: bool,
    /// Descriptors the daemon passed over the client's connections (2 when admitted).
    pub descriptors: u32,
    #[serde(deserialize_with = "present")]
    pub server_pid: Option<u32>,
    /// The server's active thread percentage, as the daemon prints it (`25.0`).
    #[serde(deserialize_with = "present")]
    pub threads: Option<String>,
    /// Pinned memory limit per device index, as the daemon prints it (`4G`); empty when no
    /// server answered.
    pub mem: BTreeMap<String, String>,
    pub pipe_dir_used: String,
    /// The pid and uid of the credentials the client sent, as it sees them (in a container
    /// the pid is 1; the kernel gives the daemon the pid of its own namespace).
    pub sent_pid: i32,
    pub sent_uid: u32,
    /// The line the fake daemon sent on the channel (`SERVER <pid> THREADS <p> MEM ...`).
    #[serde(deserialize_with = "present")]
    pub answer: Option<String>,
    #[serde(deserialize_with = "present")]
    pub error: Option<String>,
    /// What happened on which connection, for a person reading a failed test.
    #[serde(deserialize_with = "present")]
    pub detail: Option<String>,
}

/// What a real CUDA client reports when the daemon (or a gate) closes its request unanswered
/// (measured on the H200).
pub const CUDA_REFUSED: &str = "MPS client failed to connect to the MPS control daemon or the MPS server";
/// What the real control CLI prints when no daemon answers at the socket.
pub const CLI_NO_DAEMON: &str = "Cannot find MPS control daemon process";
/// What the real control CLI prints when its session is closed after the request unanswered.
pub const CLI_CANNOT_SEND: &str = "Cannot send command to MPS control daemon process";

/// `mps-ui <command...>`: one command sent as the control CLI sends it, from inside the pod.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MpsUi {
    pub command: String,
    /// `control_privileged` when it took the connection, else `control`; null when neither.
    #[serde(deserialize_with = "present")]
    pub socket_used: Option<String>,
    /// Any answer message came after the request.
    pub reached_daemon: bool,
    /// The output the daemon sent (`""` for an answer without output, as `set_*` have).
    #[serde(deserialize_with = "present")]
    pub answer: Option<String>,
    /// What the real CLI would print instead ([`CLI_NO_DAEMON`], [`CLI_CANNOT_SEND`]).
    #[serde(deserialize_with = "present")]
    pub error: Option<String>,
    #[serde(deserialize_with = "present")]
    pub detail: Option<String>,
}

/// `mps-stall`: connections opened at once that say nothing while they are held.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MpsStall {
    pub socket_used: String,
    pub connections: u32,
    pub hold_seconds: f64,
    pub read_hello: bool,
    /// connect(2) returned a connection.
    pub connected: u32,
    /// connect(2) had not returned when the hold ended (a full listen backlog blocks it).
    pub blocked: u32,
    /// connect(2) failed; `connect_errors` has why.
    pub failed: u32,
    /// errno name -> how many.
    pub connect_errors: BTreeMap<String, u32>,
    /// Connections on which the hello came by the end of the hold.
    pub got_hello: u32,
    /// Connections the other side had closed by the end of the hold.
    pub closed_by_peer: u32,
    #[serde(deserialize_with = "present")]
    pub connect_ms_median: Option<f64>,
    #[serde(deserialize_with = "present")]
    pub connect_ms_max: Option<f64>,
}

/// `mps-processes`: N `mps-client` processes started at once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MpsProcesses {
    pub count: u32,
    pub hold_seconds: f64,
    pub admitted: u32,
    pub refused: u32,
    pub direct_context: u32,
    /// Neither admitted, refused nor direct, or no readable line.
    pub failed: u32,
    /// Each child's own line, in the order they were started.
    pub children: Vec<MpsClient>,
    /// Children whose output was not an `mps-client` line: what they printed, or why not.
    pub unreadable: Vec<String>,
}

/// `mps-raw --kind K`: what came back to a hello, credentials and one kind, unframed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MpsRaw {
    pub kind: u32,
    pub socket_used: String,
    /// The first message, hex.
    #[serde(deserialize_with = "present")]
    pub hello_hex: Option<String>,
    /// The messages after the request, in order.
    pub replies: Vec<RawReply>,
    /// The other side closed (or reset) the connection; false when the wait ran out first.
    pub closed: bool,
    #[serde(deserialize_with = "present")]
    pub error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawReply {
    pub hex: String,
    pub descriptors: u32,
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

display_as_json!(
    Report,
    MpsClient,
    MpsUi,
    MpsStall,
    MpsProcesses,
    MpsRaw,
    Pid,
    Sleeping,
    Exiting,
    Paused,
    UsageError
);

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
                "control_exists": true, "control_is_socket": true, "create_file": "EROFS",
                "entries": ["control"]
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
        let line = r#"{"connected":true,"admitted":true,"refused":false,"direct_context":false,"descriptors":2,
            "server_pid":7,"threads":"25.0","mem":{"0":"4G"},"pipe_dir_used":"/tmp/nvidia-mps","sent_pid":1,"sent_uid":0,
            "answer":"SERVER 7 THREADS 25.0 MEM 0=4G","error":null,"detail":null}"#;
        let c: MpsClient = serde_json::from_str(line).unwrap();
        assert_eq!((c.threads.as_deref(), c.mem["0"].as_str()), (Some("25.0"), "4G"));
        assert!(serde_json::from_str::<MpsClient>(r#"{"connected":true}"#).is_err());
        let again: MpsClient = serde_json::from_str(&c.to_string()).unwrap();
        assert_eq!(again, c);
    }

    #[test]
    fn the_hostile_tenant_lines_read_back_as_written() {
        let ui: MpsUi = serde_json::from_str(
            r#"{"command":"quit","socket_used":"/tmp/nvidia-mps/control","reached_daemon":true,
            "answer":"Not enough privilege to execute quit command","error":null,"detail":null}"#,
        )
        .unwrap();
        assert_eq!(serde_json::from_str::<MpsUi>(&ui.to_string()).unwrap(), ui);
        let stall: MpsStall = serde_json::from_str(
            r#"{"socket_used":"/tmp/nvidia-mps/control","connections":3,"hold_seconds":1.0,"read_hello":true,
            "connected":2,"blocked":1,"failed":0,"connect_errors":{},"got_hello":1,"closed_by_peer":0,
            "connect_ms_median":0.1,"connect_ms_max":0.2}"#,
        )
        .unwrap();
        assert_eq!(
            serde_json::from_str::<MpsStall>(&stall.to_string()).unwrap(),
            stall
        );
        let raw: MpsRaw = serde_json::from_str(
            r#"{"kind":2,"socket_used":"/tmp/nvidia-mps/control","hello_hex":"4f55544248454c4c00",
            "replies":[{"hex":"4f5554424355464400","descriptors":1}],"closed":false,"error":null}"#,
        )
        .unwrap();
        assert_eq!(serde_json::from_str::<MpsRaw>(&raw.to_string()).unwrap(), raw);
        let processes: MpsProcesses = serde_json::from_str(
            r#"{"count":0,"hold_seconds":0.0,"admitted":0,"refused":0,"direct_context":0,"failed":0,
            "children":[],"unreadable":[]}"#,
        )
        .unwrap();
        assert_eq!(
            serde_json::from_str::<MpsProcesses>(&processes.to_string()).unwrap(),
            processes
        );
        // Strict as the others: a missing Option key is an error.
        assert!(
            serde_json::from_str::<MpsUi>(
                r#"{"command":"quit","socket_used":null,"reached_daemon":false,"answer":null,"error":null}"#
            )
            .is_err()
        );
    }
}
