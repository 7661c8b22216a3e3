//! `/etc/gpu-mps/config.toml`: the node's settings, shared by the shim and the manager.
//!
//! Parsing is pure (`NodeConfig::from_toml`); the binaries read the file. Unknown keys are
//! an error: a typo such as `polcy = "ceiling"` must not silently leave the node on `uniform`.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::limits::{self, LimitError, Limits, MAX_CUDA_PROCESSES};
use crate::maxima::Maxima;

pub const DEFAULT_CONFIG_PATH: &str = "/etc/gpu-mps/config.toml";
/// The socket in a gate dir: the name MPS gives its control socket, which CUDA clients look
/// for in their pipe dir. A gate dir without it has no lease (the manager opens the gate before
/// it records the lease).
pub const GATE_SOCKET: &str = "control";

/// Environment variable that points the shim, manager and CLI at another config file.
pub const CONFIG_ENV: &str = "GPU_MPS_CONFIG";
/// The MPS limit on client contexts per GPU on Volta and newer up to CUDA 13.0.
pub const MPS_MAX_CLIENTS_PER_GPU: u32 = 48;
/// Longest root: the longest socket under it, `<root>/daemons/GPU-<36 hex and dashes>/pipe/
/// control_privileged` (73 bytes after the root), must fit in the 107 bytes of a unix socket
/// address.
pub const MAX_ROOT_LEN: usize = 34;

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read the node config {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("{path}: {message}")]
    Syntax { path: String, message: String },
    #[error("{path}: {key} = {value:?}: {source}")]
    Limit {
        path: String,
        key: &'static str,
        value: String,
        source: LimitError,
    },
    #[error("{path}: {key}: {message}")]
    Invalid {
        path: String,
        key: &'static str,
        message: String,
    },
}

/// How one server serves pods with different limits (see
/// docs/adr/0003-limit-policies-and-daemon-lifecycle.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LimitPolicy {
    /// A GPU serves one limit class at a time, enforced exactly by its server. The default
    /// before docs/adr/0005.
    Uniform,
    /// The server enforces the node's ceiling; each container's env asks for less.
    Ceiling,
    /// Every client is held by the server to its own container's limits: the manager serves
    /// each container's `control` socket (a connect gate) and sets the server's limits to that
    /// container's before it relays the client's handshake (docs/adr/0005).
    Exact,
}

/// Whether pods of different namespaces may share a GPU's server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tenancy {
    Shared,
    Exclusive,
}

impl fmt::Display for LimitPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LimitPolicy::Uniform => "uniform",
            LimitPolicy::Ceiling => "ceiling",
            LimitPolicy::Exact => "exact",
        })
    }
}

impl fmt::Display for Tenancy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tenancy::Shared => "shared",
            Tenancy::Exclusive => "exclusive",
        })
    }
}

impl FromStr for LimitPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "uniform" => Ok(LimitPolicy::Uniform),
            "ceiling" => Ok(LimitPolicy::Ceiling),
            "exact" => Ok(LimitPolicy::Exact),
            other => Err(format!(
                "{other:?} is not a policy: expected \"uniform\", \"ceiling\" or \"exact\""
            )),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    root: Option<PathBuf>,
    hook_path: Option<PathBuf>,
    runc_path: Option<PathBuf>,
    #[serde(default)]
    limits: RawLimits,
    #[serde(default)]
    daemon: RawDaemon,
    #[serde(default)]
    hook: RawHook,
    #[serde(default)]
    gate: RawGate,
    #[serde(default)]
    device_plugin: RawDevicePlugin,
    #[serde(default)]
    metrics: RawMetrics,
    #[serde(default)]
    gpus: RawGpus,
}

/// `[gpus]`: where a container's GPUs may come from.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGpus {
    trust_visible_devices_env: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMetrics {
    listen: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDevicePlugin {
    enabled: Option<bool>,
    memory_unit: Option<String>,
    server_reserve: Option<String>,
    default_thread_share_factor: Option<f64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimits {
    policy: Option<LimitPolicy>,
    tenancy: Option<Tenancy>,
    default_memory_limit: Option<String>,
    #[serde(default, deserialize_with = "config_number::thread_percentage")]
    default_active_thread_percentage: Option<u8>,
    ceiling_memory_limit: Option<String>,
    #[serde(default, deserialize_with = "config_number::thread_percentage")]
    ceiling_active_thread_percentage: Option<u8>,
    overcommit: Option<f64>,
    #[serde(default, deserialize_with = "config_number::whole")]
    max_clients_per_gpu: Option<u32>,
    allow_overlapping_gpu_sets: Option<bool>,
    #[serde(default, deserialize_with = "config_number::whole")]
    default_cuda_processes: Option<u32>,
    max_memory_limit: Option<String>,
    #[serde(default, deserialize_with = "config_number::thread_percentage")]
    max_active_thread_percentage: Option<u8>,
    #[serde(default, deserialize_with = "config_number::whole")]
    max_cuda_processes: Option<u32>,
    #[serde(default)]
    namespaces: BTreeMap<String, RawMaxima>,
}

/// `[limits.namespaces."<namespace>"]`: the maximums of one namespace; a key left out takes
/// the node's.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMaxima {
    max_memory_limit: Option<String>,
    #[serde(default, deserialize_with = "config_number::thread_percentage")]
    max_active_thread_percentage: Option<u8>,
    #[serde(default, deserialize_with = "config_number::whole")]
    max_cuda_processes: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDaemon {
    control_binary: Option<PathBuf>,
    #[serde(default, deserialize_with = "config_number::whole")]
    idle_grace_seconds: Option<u64>,
    exclusive_process: Option<bool>,
    #[serde(default, deserialize_with = "config_number::whole")]
    start_timeout_seconds: Option<u64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGate {
    #[serde(default, deserialize_with = "config_number::whole")]
    handshake_timeout_seconds: Option<u64>,
    #[serde(default, deserialize_with = "config_number::whole")]
    queue_timeout_seconds: Option<u64>,
    #[serde(default, deserialize_with = "config_number::whole")]
    connections_per_container: Option<u32>,
    #[serde(default, deserialize_with = "config_number::whole")]
    max_connections: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHook {
    #[serde(default, deserialize_with = "config_number::whole")]
    timeout_seconds: Option<u64>,
}

/// serde says "invalid type: string \"abc\", expected u8" for a number of the wrong kind; the
/// operator reads "expected a whole number from 1 to 100, got \"abc\"", with TOML's line,
/// column and key around it.
mod config_number {
    use std::fmt;
    use std::marker::PhantomData;

    use serde::Deserializer;
    use serde::de::{Error, Visitor};

    /// A whole number in the range of its type (a finer range is checked with the key's name).
    pub fn whole<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
    where
        D: Deserializer<'de>,
        T: TryFrom<i128> + Bounded,
    {
        in_range(deserializer, T::MIN, T::MAX)
    }

    /// An active thread percentage: said to be 1 to 100 (what fits a u8 but is outside that is
    /// refused with the key's name, after parsing).
    pub fn thread_percentage<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u8>, D::Error> {
        let range = crate::limits::THREAD_PERCENTAGE;
        in_range(deserializer, i128::from(*range.start()), i128::from(*range.end()))
    }

    pub trait Bounded {
        const MIN: i128;
        const MAX: i128;
    }
    impl Bounded for u32 {
        const MIN: i128 = 0;
        const MAX: i128 = u32::MAX as i128;
    }
    impl Bounded for u64 {
        const MIN: i128 = 0;
        const MAX: i128 = u64::MAX as i128;
    }

    fn in_range<'de, D, T>(deserializer: D, min: i128, max: i128) -> Result<Option<T>, D::Error>
    where
        D: Deserializer<'de>,
        T: TryFrom<i128>,
    {
        deserializer
            .deserialize_any(WholeNumber {
                min,
                max,
                number: PhantomData,
            })
            .map(Some)
    }

    struct WholeNumber<T> {
        min: i128,
        max: i128,
        number: PhantomData<T>,
    }

    impl<T> WholeNumber<T> {
        fn refuse<E: Error>(&self, got: impl fmt::Display) -> E {
            E::custom(format!(
                "expected a whole number from {} to {}, got {got}",
                self.min, self.max
            ))
        }
    }

    impl<T: TryFrom<i128>> Visitor<'_> for WholeNumber<T> {
        type Value = T;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "a whole number from {} to {}", self.min, self.max)
        }

        fn visit_i64<E: Error>(self, v: i64) -> Result<T, E> {
            self.visit_i128(i128::from(v))
        }

        fn visit_u64<E: Error>(self, v: u64) -> Result<T, E> {
            self.visit_i128(i128::from(v))
        }

        /// Only what does not fit the type is refused here: a value that fits but is out of
        /// the range is refused later, in a message that names the key in full.
        fn visit_i128<E: Error>(self, v: i128) -> Result<T, E> {
            T::try_from(v).map_err(|_| self.refuse(v))
        }

        fn visit_f64<E: Error>(self, v: f64) -> Result<T, E> {
            Err(self.refuse(v))
        }

        fn visit_str<E: Error>(self, v: &str) -> Result<T, E> {
            Err(self.refuse(format_args!("{v:?}")))
        }

        fn visit_bool<E: Error>(self, v: bool) -> Result<T, E> {
            Err(self.refuse(v))
        }
    }
}

/// The node's settings, validated, with defaults filled in. The manager publishes the config it
/// runs with ([`PublishedConfig`]); the shim uses that one, so that both always agree.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// Host directory for daemons, state, inventory and the manager socket. Never
    /// /tmp/nvidia-mps: nvidia-container-toolkit bind-mounts that path into GPU containers.
    pub root: PathBuf,
    /// Where the shim tells runc to find gpu-mps-hook.
    pub hook_path: PathBuf,
    /// The real runc the shim execs.
    pub runc_path: PathBuf,
    pub policy: LimitPolicy,
    pub tenancy: Tenancy,
    /// Limits of a container that asks for none. `None`: such a container is refused.
    pub default_limits: Option<Limits>,
    /// CUDA processes of a container that does not say (`gpu-mps.io/cuda-processes`).
    pub default_cuda_processes: u32,
    /// The most a container may ask for, under every policy.
    pub maxima: Maxima,
    /// Per-namespace maximums, each complete (keys left out in the file take the node's).
    pub namespace_maxima: BTreeMap<String, Maxima>,
    /// Server limits under `policy = "ceiling"`.
    pub ceiling: Option<Limits>,
    pub overcommit: f64,
    pub max_clients_per_gpu: u32,
    pub allow_overlapping_gpu_sets: bool,
    pub control_binary: PathBuf,
    pub idle_grace_seconds: u64,
    pub exclusive_process: bool,
    pub start_timeout_seconds: u64,
    pub hook_timeout_seconds: u64,
    /// Policy `exact`: longest a client's control connection may stay open through its gate.
    pub gate_handshake_timeout_seconds: u64,
    /// Longest a CUDA client waits for the server (limits set, daemon answering) before the
    /// gate refuses it cleanly.
    pub gate_queue_timeout_seconds: u64,
    /// Connections one container may have open at its gate at once; more wait in the listen
    /// backlog, which costs the manager no descriptor.
    pub gate_connections_per_container: u32,
    /// Gate connections open at once on the whole node (a descriptor budget).
    pub gate_max_connections: u32,
    /// Scheduling by `gpu-mps.io/memory` units (gpu-mps-device-plugin).
    #[serde(default)]
    pub device_plugin: DevicePluginConfig,
    /// `[metrics] listen`: where the manager serves Prometheus metrics over HTTP (`GET /metrics`).
    /// `None`, the default: no metrics, no port. Left out of the published config when unset, so
    /// that a config without it keeps the digest it had before the key existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<SocketAddr>,
    /// `[gpus] trust_visible_devices_env`: a container's own `NVIDIA_VISIBLE_DEVICES` names its
    /// GPUs where nothing written for the pod (device nodes, CDI, the volume-mounts list) does.
    /// Off by default: the env is the pod's to write, so it is a GPU source only where the
    /// operator says the NVIDIA device plugin's `envvar` strategy hands GPUs over. Left out of
    /// the published config when off, so that a config without it keeps its digest.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub trust_visible_devices_env: bool,
}

/// `[device_plugin]`: how gpu-mps-device-plugin turns GPU memory into `gpu-mps.io/memory` units.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DevicePluginConfig {
    /// When true, the scheduler places GPU pods by units: a GPU container must come with the
    /// plugin's allocation, which then sets its memory (pod annotations cannot raise it).
    pub enabled: bool,
    pub memory_unit_bytes: u64,
    /// GPU memory never handed out as units: what the MPS server takes for itself.
    pub server_reserve_bytes: u64,
    /// A container that sets no active thread percentage gets this many times its memory share.
    pub default_thread_share_factor: f64,
}

impl Default for DevicePluginConfig {
    fn default() -> Self {
        DevicePluginConfig {
            enabled: false,
            memory_unit_bytes: 1 << 30,
            // Measured on the H200: see docs/gpu-results.md, "Device plugin".
            server_reserve_bytes: 1 << 30,
            // Measured: caps of twice the fair share gave more aggregate throughput on a real
            // model than fair-share caps (MPS-FACTS.md, "Thread caps and throughput").
            default_thread_share_factor: 2.0,
        }
    }
}

impl DevicePluginConfig {
    /// How units are laid out on this node with `overcommit` and `max_clients_per_gpu`.
    pub fn unit_policy(&self, overcommit: f64, max_clients_per_gpu: u32) -> crate::memory_units::UnitPolicy {
        crate::memory_units::UnitPolicy {
            unit_bytes: self.memory_unit_bytes,
            server_reserve_bytes: self.server_reserve_bytes,
            overcommit,
            max_clients_per_gpu,
        }
    }
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            root: PathBuf::from("/run/gpu-mps"),
            hook_path: PathBuf::from("/usr/local/bin/gpu-mps-hook"),
            runc_path: PathBuf::from("/usr/sbin/runc"),
            // docs/adr/0005: every container held to its own limits by one server.
            policy: LimitPolicy::Exact,
            tenancy: Tenancy::Shared,
            default_limits: None,
            default_cuda_processes: 1,
            maxima: Maxima::default(),
            namespace_maxima: BTreeMap::new(),
            ceiling: None,
            overcommit: 1.0,
            max_clients_per_gpu: MPS_MAX_CLIENTS_PER_GPU,
            allow_overlapping_gpu_sets: false,
            control_binary: PathBuf::from("nvidia-cuda-mps-control"),
            idle_grace_seconds: 60,
            exclusive_process: true,
            // Measured: a daemon starts and serves its first client in well under a second.
            start_timeout_seconds: 4,
            hook_timeout_seconds: 10,
            // A client's connection with the first client of a new server waits for the server
            // to start (0.3 s measured), the others take milliseconds. The control daemon serves
            // one connection at a time, so a stalled one holds up every pod on the GPU this long.
            gate_handshake_timeout_seconds: 5,
            // Measured (docs/gpu-results.md section 7): the daemon answers a client's request in
            // 0.2-0.4 ms, or 150-250 ms when it starts the server for it. 48 clients queued
            // behind each other with a limit change each take a few seconds.
            gate_queue_timeout_seconds: 30,
            // A CUDA process uses one control connection at a time (three in a row), so a
            // container of 4 processes starting at once never waits for its own.
            gate_connections_per_container: 4,
            // Far below the manager's raised descriptor limit (it asks for 65536).
            gate_max_connections: 4096,
            device_plugin: DevicePluginConfig::default(),
            metrics_listen: None,
            trust_visible_devices_env: false,
        }
    }
}

impl NodeConfig {
    /// Reads and parses the config file at `path`; a missing file means all defaults (which
    /// refuse containers that set no limits of their own).
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => NodeConfig::from_toml(&text, path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(NodeConfig::default()),
            Err(source) => Err(ConfigError::Read {
                path: path.display().to_string(),
                source,
            }),
        }
    }

    /// Parses the TOML text of a config file; `path` is only used in error messages.
    pub fn from_toml(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let p = path.display().to_string();
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Syntax {
            path: p.clone(),
            message: crate::message::one_line(&e.to_string()),
        })?;
        let d = NodeConfig::default();
        let memory = |key: &'static str, value: Option<String>| -> Result<Option<u64>, ConfigError> {
            value
                .map(|v| {
                    limits::parse_memory_limit(&v).map_err(|source| ConfigError::Limit {
                        path: p.clone(),
                        key,
                        value: v.clone(),
                        source,
                    })
                })
                .transpose()
        };
        let threads = |key: &'static str, value: Option<u8>| -> Result<Option<u8>, ConfigError> {
            match value {
                Some(v) if !(1..=100).contains(&v) => Err(ConfigError::Limit {
                    path: p.clone(),
                    key,
                    value: v.to_string(),
                    source: LimitError::ThreadPercentage { value: v.to_string() },
                }),
                v => Ok(v),
            }
        };
        let pair =
            |key: &'static str, m: Option<u64>, t: Option<u8>| -> Result<Option<Limits>, ConfigError> {
                match (m, t) {
                    (Some(memory_bytes), Some(thread_percentage)) => Ok(Some(Limits {
                        memory_bytes,
                        thread_percentage,
                    })),
                    (None, None) => Ok(None),
                    _ => Err(ConfigError::Invalid {
                        path: p.clone(),
                        key,
                        message: "set both the memory limit and the active thread percentage, or neither"
                            .into(),
                    }),
                }
            };
        let l = raw.limits;
        let default_limits = pair(
            "limits.default_*",
            memory("limits.default_memory_limit", l.default_memory_limit)?,
            threads(
                "limits.default_active_thread_percentage",
                l.default_active_thread_percentage,
            )?,
        )?;
        let ceiling = pair(
            "limits.ceiling_*",
            memory("limits.ceiling_memory_limit", l.ceiling_memory_limit)?,
            threads(
                "limits.ceiling_active_thread_percentage",
                l.ceiling_active_thread_percentage,
            )?,
        )?;
        let policy = l.policy.unwrap_or(d.policy);
        if policy == LimitPolicy::Ceiling && ceiling.is_none() {
            return Err(ConfigError::Invalid {
                path: p,
                key: "limits.ceiling_memory_limit",
                message:
                    "policy = \"ceiling\" needs ceiling_memory_limit and ceiling_active_thread_percentage"
                        .into(),
            });
        }
        let overcommit = l.overcommit.unwrap_or(d.overcommit);
        if !(overcommit > 0.0 && overcommit <= 16.0) {
            return Err(ConfigError::Invalid {
                path: p,
                key: "limits.overcommit",
                message: format!("{overcommit} is out of range: expected a factor above 0 and at most 16"),
            });
        }
        let max_clients = l.max_clients_per_gpu.unwrap_or(d.max_clients_per_gpu);
        if max_clients == 0 || max_clients > MPS_MAX_CLIENTS_PER_GPU {
            return Err(ConfigError::Invalid {
                path: p,
                key: "limits.max_clients_per_gpu",
                message: format!("{max_clients} is out of range: expected 1 to {MPS_MAX_CLIENTS_PER_GPU}"),
            });
        }
        let root = raw.root.unwrap_or(d.root);
        if root.is_relative() {
            return Err(ConfigError::Invalid {
                path: p,
                key: "root",
                message: "must be an absolute path".into(),
            });
        }
        if root.as_os_str().len() > MAX_ROOT_LEN {
            return Err(ConfigError::Invalid {
                path: p,
                key: "root",
                message: format!(
                    "{} is {} bytes long, more than {MAX_ROOT_LEN}: the MPS and gate sockets under it must fit in a unix socket address (107 bytes)",
                    crate::message::printable(&root.to_string_lossy()),
                    root.as_os_str().len()
                ),
            });
        }
        if root.starts_with("/tmp/nvidia-mps") {
            return Err(ConfigError::Invalid {
                path: p,
                key: "root",
                message: "must not be under /tmp/nvidia-mps: nvidia-container-toolkit mounts that host path into every GPU container".into(),
            });
        }
        let start_timeout = raw
            .daemon
            .start_timeout_seconds
            .unwrap_or(d.start_timeout_seconds)
            .max(1);
        let hook_timeout = raw
            .hook
            .timeout_seconds
            .unwrap_or(d.hook_timeout_seconds)
            .clamp(1, 60);
        // A daemon start waits up to start_timeout twice (for `-d` to return, then for its pid
        // file): the hook must outwait that, or the CRI caller sees a timeout instead of the reason.
        if hook_timeout < 2 * start_timeout + 2 {
            return Err(ConfigError::Invalid {
                path: p,
                key: "hook.timeout_seconds",
                message: format!(
                    "{hook_timeout} is too short for daemon.start_timeout_seconds = {start_timeout}: it must be at least {}",
                    2 * start_timeout + 2
                ),
            });
        }
        let gate_seconds = |key: &'static str, value: Option<u64>, default: u64| match value {
            Some(v) if !(1..=300).contains(&v) => Err(ConfigError::Invalid {
                path: p.clone(),
                key,
                message: format!("{v} is out of range: expected 1 to 300 seconds"),
            }),
            v => Ok(v.unwrap_or(default)),
        };
        let gate_handshake_timeout_seconds = gate_seconds(
            "gate.handshake_timeout_seconds",
            raw.gate.handshake_timeout_seconds,
            d.gate_handshake_timeout_seconds,
        )?;
        let gate_queue_timeout_seconds = gate_seconds(
            "gate.queue_timeout_seconds",
            raw.gate.queue_timeout_seconds,
            d.gate_queue_timeout_seconds,
        )?;
        let default_cuda_processes = l.default_cuda_processes.unwrap_or(d.default_cuda_processes);
        if !(1..=MAX_CUDA_PROCESSES).contains(&default_cuda_processes) {
            return Err(ConfigError::Invalid {
                path: p,
                key: "limits.default_cuda_processes",
                message: format!(
                    "{default_cuda_processes} is out of range: expected 1 to {MAX_CUDA_PROCESSES}"
                ),
            });
        }
        let node_maxima = raw_maxima(
            &p,
            "limits",
            &RawMaxima {
                max_memory_limit: l.max_memory_limit,
                max_active_thread_percentage: l.max_active_thread_percentage,
                max_cuda_processes: l.max_cuda_processes,
            },
            d.maxima,
        )?;
        let mut namespace_maxima = BTreeMap::new();
        for (namespace, raw_ns) in &l.namespaces {
            namespace_maxima.insert(
                namespace.clone(),
                raw_maxima(&p, "limits.namespaces.*", raw_ns, node_maxima)?,
            );
        }
        if let Some(defaults) = default_limits {
            node_maxima
                .check(defaults, default_cuda_processes, "this node")
                .map_err(|e| ConfigError::Invalid {
                    path: p.clone(),
                    key: "limits.default_*",
                    message: format!("the node defaults break a node maximum: {e}"),
                })?;
        }
        let gate_count =
            |key: &'static str, value: Option<u32>, default: u32, range: std::ops::RangeInclusive<u32>| {
                match value {
                    Some(v) if !range.contains(&v) => Err(ConfigError::Invalid {
                        path: p.clone(),
                        key,
                        message: format!(
                            "{v} is out of range: expected {} to {}",
                            range.start(),
                            range.end()
                        ),
                    }),
                    v => Ok(v.unwrap_or(default)),
                }
            };
        let gate_connections_per_container = gate_count(
            "gate.connections_per_container",
            raw.gate.connections_per_container,
            d.gate_connections_per_container,
            1..=64,
        )?;
        let gate_max_connections = gate_count(
            "gate.max_connections",
            raw.gate.max_connections,
            d.gate_max_connections,
            16..=65536,
        )?;
        let device_plugin = device_plugin_config(&p, raw.device_plugin, d.device_plugin)?;
        let metrics_listen = raw
            .metrics
            .listen
            .map(|value| metrics_address(&value))
            .transpose()
            .map_err(|message| ConfigError::Invalid {
                path: p.clone(),
                key: "metrics.listen",
                message,
            })?;
        let tenancy = l.tenancy.unwrap_or(d.tenancy);
        // Units promise the scheduler that any mix of sizes and namespaces fits a GPU: only one
        // server holding each container to its own limits keeps that promise.
        if device_plugin.enabled && (policy != LimitPolicy::Exact || tenancy != Tenancy::Shared) {
            return Err(ConfigError::Invalid {
                path: p,
                key: "device_plugin.enabled",
                message: format!(
                    "scheduling by gpu-mps.io/memory units needs policy = \"exact\" and tenancy = \"shared\" (this node has {policy} and {tenancy}): under the others the manager would refuse pods the scheduler placed"
                ),
            });
        }
        Ok(NodeConfig {
            device_plugin,
            metrics_listen,
            trust_visible_devices_env: raw
                .gpus
                .trust_visible_devices_env
                .unwrap_or(d.trust_visible_devices_env),
            root,
            hook_path: raw.hook_path.unwrap_or(d.hook_path),
            runc_path: raw.runc_path.unwrap_or(d.runc_path),
            policy,
            tenancy,
            default_limits,
            ceiling,
            overcommit,
            max_clients_per_gpu: max_clients,
            allow_overlapping_gpu_sets: l
                .allow_overlapping_gpu_sets
                .unwrap_or(d.allow_overlapping_gpu_sets),
            control_binary: raw.daemon.control_binary.unwrap_or(d.control_binary),
            idle_grace_seconds: raw.daemon.idle_grace_seconds.unwrap_or(d.idle_grace_seconds),
            exclusive_process: raw.daemon.exclusive_process.unwrap_or(d.exclusive_process),
            start_timeout_seconds: start_timeout,
            hook_timeout_seconds: hook_timeout,
            gate_handshake_timeout_seconds,
            gate_queue_timeout_seconds,
            gate_connections_per_container,
            gate_max_connections,
            default_cuda_processes,
            maxima: node_maxima,
            namespace_maxima,
        })
    }

    /// The maximums for a container of `namespace` and how to name them in a message.
    pub fn maxima_for(&self, namespace: &str) -> (Maxima, String) {
        match self.namespace_maxima.get(namespace) {
            Some(m) => (*m, format!("namespace {namespace}")),
            None => (self.maxima, "this node".to_string()),
        }
    }

    /// A short digest of every setting: the shim passes the one it used to the manager, which
    /// refuses a container laid out under another config than its own.
    pub fn digest(&self) -> String {
        use sha2::{Digest, Sha256};
        let text = serde_json::to_vec(self).expect("the node config serializes");
        let hash = Sha256::digest(&text);
        hash.iter().take(8).map(|b| format!("{b:02x}")).collect()
    }

    /// Where the manager publishes the config it runs with.
    pub fn published_path(&self) -> PathBuf {
        self.root.join(PUBLISHED_CONFIG_FILE)
    }

    pub fn manager_socket(&self) -> PathBuf {
        self.root.join("manager.sock")
    }

    pub fn inventory_path(&self) -> PathBuf {
        self.root.join("inventory.json")
    }

    pub fn state_path(&self) -> PathBuf {
        self.root.join("state.json")
    }

    /// One file per recorded lease, beside the state file: what the leases are rebuilt from
    /// when the state file cannot be used.
    pub fn lease_files_dir(&self) -> PathBuf {
        self.root.join("leases")
    }

    pub fn daemon_dir(&self, key: &crate::DaemonKey) -> PathBuf {
        self.root.join("daemons").join(key.dir_name())
    }

    pub fn pipe_dir(&self, key: &crate::DaemonKey) -> PathBuf {
        self.daemon_dir(key).join("pipe")
    }

    pub fn log_dir(&self, key: &crate::DaemonKey) -> PathBuf {
        self.daemon_dir(key).join("log")
    }

    /// The container's own gate dir (under every policy), which holds only the [`GATE_SOCKET`]
    /// the manager serves for it (its connect gate). The shim creates it, the manager fills it
    /// at Acquire (before the lease is recorded) and removes it at Release.
    pub fn gate_dir(&self, container_id: &crate::ContainerId) -> PathBuf {
        self.gates_root().join(container_id.gate_name())
    }

    /// Where the gate dirs live.
    pub fn gates_root(&self) -> PathBuf {
        self.root.join("gates")
    }
}

/// `[device_plugin]`, validated; keys left out take `defaults`.
fn device_plugin_config(
    path: &str,
    raw: RawDevicePlugin,
    defaults: DevicePluginConfig,
) -> Result<DevicePluginConfig, ConfigError> {
    let bytes = |key: &'static str, value: Option<String>, default: u64| -> Result<u64, ConfigError> {
        match value {
            None => Ok(default),
            Some(v) => crate::quantity::parse_bytes(&v).map_err(|e| ConfigError::Invalid {
                path: path.to_string(),
                key,
                message: e.to_string(),
            }),
        }
    };
    let memory_unit_bytes = bytes(
        "device_plugin.memory_unit",
        raw.memory_unit,
        defaults.memory_unit_bytes,
    )?;
    if !(MIN_MEMORY_UNIT..=MAX_MEMORY_UNIT).contains(&memory_unit_bytes) {
        return Err(ConfigError::Invalid {
            path: path.to_string(),
            key: "device_plugin.memory_unit",
            message: format!(
                "{} is out of range: expected 64Mi to 64Gi",
                crate::quantity::format_bytes(memory_unit_bytes)
            ),
        });
    }
    let server_reserve_bytes = bytes(
        "device_plugin.server_reserve",
        raw.server_reserve,
        defaults.server_reserve_bytes,
    )?;
    let factor = raw
        .default_thread_share_factor
        .unwrap_or(defaults.default_thread_share_factor);
    if !(factor > 0.0 && factor <= 100.0) {
        return Err(ConfigError::Invalid {
            path: path.to_string(),
            key: "device_plugin.default_thread_share_factor",
            message: format!("{factor} is out of range: expected a factor above 0 and at most 100"),
        });
    }
    Ok(DevicePluginConfig {
        enabled: raw.enabled.unwrap_or(defaults.enabled),
        memory_unit_bytes,
        server_reserve_bytes,
        default_thread_share_factor: factor,
    })
}

/// `[metrics] listen`: an IP address and a port, never a host name (the manager resolves
/// nothing: what it binds is what the file says).
fn metrics_address(value: &str) -> Result<SocketAddr, String> {
    // Debug quoting keeps a line break in the value from breaking the one-line message.
    let shown = value;
    let address: SocketAddr = value.parse().map_err(|_| {
        format!(
            "{shown:?} is not an IP address and port: expected e.g. \"127.0.0.1:9401\" (this host only) or \"0.0.0.0:9401\" (every address); leave the key out to serve no metrics"
        )
    })?;
    if address.port() == 0 {
        return Err(format!(
            "{shown:?} has port 0: expected a fixed port from 1 to 65535, which Prometheus can be told"
        ));
    }
    Ok(address)
}

/// Smallest and largest `device_plugin.memory_unit`: kubelet lists every unit as a device, so a
/// tiny unit floods it (an H200 in 1Mi units would be 143,771 devices).
const MIN_MEMORY_UNIT: u64 = 64 << 20;
const MAX_MEMORY_UNIT: u64 = 64 << 30;

/// The maximums of one `[limits]` or `[limits.namespaces."<ns>"]` table; keys left out take
/// `inherited`.
fn raw_maxima(
    path: &str,
    table: &'static str,
    raw: &RawMaxima,
    inherited: Maxima,
) -> Result<Maxima, ConfigError> {
    let key = |name: &'static str| -> &'static str {
        match (table, name) {
            ("limits", "memory") => "limits.max_memory_limit",
            ("limits", "threads") => "limits.max_active_thread_percentage",
            ("limits", _) => "limits.max_cuda_processes",
            (_, "memory") => "limits.namespaces.*.max_memory_limit",
            (_, "threads") => "limits.namespaces.*.max_active_thread_percentage",
            _ => "limits.namespaces.*.max_cuda_processes",
        }
    };
    let memory_bytes = match &raw.max_memory_limit {
        Some(v) => Some(
            limits::parse_memory_limit(v).map_err(|source| ConfigError::Limit {
                path: path.to_string(),
                key: key("memory"),
                value: v.clone(),
                source,
            })?,
        ),
        None => inherited.memory_bytes,
    };
    let thread_percentage = match raw.max_active_thread_percentage {
        Some(v) if !(1..=100).contains(&v) => {
            return Err(ConfigError::Limit {
                path: path.to_string(),
                key: key("threads"),
                value: v.to_string(),
                source: LimitError::ThreadPercentage { value: v.to_string() },
            });
        }
        Some(v) => v,
        None => inherited.thread_percentage,
    };
    let cuda_processes = match raw.max_cuda_processes {
        Some(v) if !(1..=MAX_CUDA_PROCESSES).contains(&v) => {
            return Err(ConfigError::Invalid {
                path: path.to_string(),
                key: key("processes"),
                message: format!("{v} is out of range: expected 1 to {MAX_CUDA_PROCESSES}"),
            });
        }
        Some(v) => v,
        None => inherited.cuda_processes,
    };
    Ok(Maxima {
        memory_bytes,
        thread_percentage,
        cuda_processes,
    })
}

/// File name of the published config, under the root.
pub const PUBLISHED_CONFIG_FILE: &str = "node-config.json";
const PUBLISHED_VERSION: u32 = 1;

/// The config the running manager uses, as it publishes it at `<root>/node-config.json` at
/// start. The shim lays containers out by this one rather than by config.toml, so that an edit
/// of config.toml takes effect only when the manager is restarted, for both at once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PublishedConfig {
    pub version: u32,
    pub digest: String,
    /// The manager that published it.
    pub manager_pid: u32,
    /// The file it was read from.
    pub source: PathBuf,
    pub config: NodeConfig,
}

impl PublishedConfig {
    pub fn new(config: NodeConfig, source: &Path, manager_pid: u32) -> Self {
        PublishedConfig {
            version: PUBLISHED_VERSION,
            digest: config.digest(),
            manager_pid,
            source: source.to_path_buf(),
            config,
        }
    }

    /// Parses a published config; refuses another version and a digest that does not match.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let published: PublishedConfig =
            serde_json::from_str(text).map_err(|e| crate::message::printable(&e.to_string()).into_owned())?;
        if published.version != PUBLISHED_VERSION {
            return Err(format!(
                "version {} (this build reads version {PUBLISHED_VERSION})",
                published.version
            ));
        }
        if published.digest != published.config.digest() {
            return Err("its digest does not match its content".into());
        }
        Ok(published)
    }
}

/// The config path: `$GPU_MPS_CONFIG` if set, else /etc/gpu-mps/config.toml.
pub fn config_path_from_env() -> PathBuf {
    std::env::var_os(CONFIG_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG_PATH))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<NodeConfig, ConfigError> {
        NodeConfig::from_toml(text, Path::new("/etc/gpu-mps/config.toml"))
    }

    #[test]
    fn empty_file_gives_defaults() {
        assert_eq!(parse("").unwrap(), NodeConfig::default());
    }

    #[test]
    fn a_root_too_long_for_socket_addresses_is_refused() {
        let e = parse(&format!("root = \"/{}\"", "r".repeat(MAX_ROOT_LEN)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("unix socket address"), "{e}");
        assert!(parse(&format!("root = \"/{}\"", "r".repeat(MAX_ROOT_LEN - 1))).is_ok());
        // Found by fuzzing: TOML escapes put line breaks in the root, which the message quotes.
        let e = parse(&format!("root = \"/run/\\r\\n{}\"", "r".repeat(MAX_ROOT_LEN)))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("root: /run/\\r\\nrrr") && !e.contains(['\n', '\r']),
            "{e:?}"
        );
    }

    #[test]
    fn the_shipped_config_parses_and_matches_the_defaults_it_documents() {
        let c = parse(include_str!("../../packaging/config.toml")).unwrap();
        assert_eq!(c.policy, LimitPolicy::Exact);
        assert_eq!(c.policy, NodeConfig::default().policy);
        assert_eq!(
            (c.gate_handshake_timeout_seconds, c.gate_queue_timeout_seconds),
            (
                NodeConfig::default().gate_handshake_timeout_seconds,
                NodeConfig::default().gate_queue_timeout_seconds
            )
        );
    }

    #[test]
    fn policy_exact_and_its_gate_timeouts() {
        let c = parse("[limits]\npolicy = \"exact\"\n[gate]\nhandshake_timeout_seconds = 5\nqueue_timeout_seconds = 60\n").unwrap();
        assert_eq!(c.policy, LimitPolicy::Exact);
        assert_eq!(
            (c.gate_handshake_timeout_seconds, c.gate_queue_timeout_seconds),
            (5, 60)
        );
        let id = crate::ContainerId::parse("abc").unwrap();
        assert_eq!(c.gate_dir(&id), Path::new("/run/gpu-mps/gates/ba7816bf8f01cfea"));
        let e = parse("[gate]\nqueue_timeout_seconds = 0\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("gate.queue_timeout_seconds") && e.contains("1 to 300"),
            "{e}"
        );
        let e = parse("[limits]\npolicy = \"exactly\"\n").unwrap_err().to_string();
        assert!(e.contains("exact"), "{e}");
    }

    #[test]
    fn maximums_per_node_and_namespace() {
        let c = parse(
            r#"
            [limits]
            default_memory_limit = "4Gi"
            default_active_thread_percentage = 25
            default_cuda_processes = 2
            max_memory_limit = "16Gi"
            max_active_thread_percentage = 50
            max_cuda_processes = 8
            [limits.namespaces.team-a]
            max_memory_limit = "4Gi"
            [limits.namespaces."batch"]
            max_active_thread_percentage = 100
            max_cuda_processes = 48
            "#,
        )
        .unwrap();
        assert_eq!(c.default_cuda_processes, 2);
        let (node, scope) = c.maxima_for("other");
        assert_eq!(scope, "this node");
        assert_eq!(
            node,
            Maxima {
                memory_bytes: Some(16 << 30),
                thread_percentage: 50,
                cuda_processes: 8
            }
        );
        let (team, scope) = c.maxima_for("team-a");
        assert_eq!(scope, "namespace team-a");
        assert_eq!(
            team,
            Maxima {
                memory_bytes: Some(4 << 30),
                thread_percentage: 50,
                cuda_processes: 8
            },
            "keys left out take the node's"
        );
        assert_eq!(c.maxima_for("batch").0.thread_percentage, 100);
        assert_eq!(c.maxima_for("batch").0.cuda_processes, 48);
        assert_eq!(NodeConfig::default().maxima, Maxima::default());
    }

    #[test]
    fn a_number_of_the_wrong_kind_is_refused_in_words_not_rust_types() {
        for (text, said) in [
            (
                "[limits]\ndefault_active_thread_percentage = \"abc\"",
                "expected a whole number from 1 to 100, got \"abc\"",
            ),
            (
                "[limits]\nmax_active_thread_percentage = 300",
                "expected a whole number from 1 to 100, got 300",
            ),
            (
                "[limits]\nceiling_active_thread_percentage = 12.5",
                "expected a whole number from 1 to 100, got 12.5",
            ),
            (
                "[limits]\ndefault_cuda_processes = -1",
                "expected a whole number from 0 to 4294967295, got -1",
            ),
            (
                "[limits.namespaces.a]\nmax_cuda_processes = \"4\"",
                "expected a whole number from 0 to 4294967295, got \"4\"",
            ),
            (
                "[gate]\nmax_connections = true",
                "expected a whole number from 0 to 4294967295, got true",
            ),
            (
                "[daemon]\nidle_grace_seconds = \"60s\"",
                "expected a whole number from 0 to 18446744073709551615, got \"60s\"",
            ),
            (
                "[hook]\ntimeout_seconds = -5",
                "expected a whole number from 0 to 18446744073709551615, got -5",
            ),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.contains(said), "{text}: {e}");
            assert!(
                !e.contains("expected u") && !e.contains("expected i"),
                "{text}: {e}"
            );
            // TOML's location names the key.
            let key = text.rsplit_once('\n').unwrap().1.split(' ').next().unwrap();
            assert!(e.contains(key), "{text}: {e}");
            assert!(!e.contains('\n'), "{text}: {e}");
        }
        // Numbers that fit still get their key's own range check.
        let e = parse("[limits]\nmax_active_thread_percentage = 0")
            .unwrap_err()
            .to_string();
        assert!(e.contains("limits.max_active_thread_percentage"), "{e}");
        assert_eq!(
            parse("[daemon]\nidle_grace_seconds = 90")
                .unwrap()
                .idle_grace_seconds,
            90
        );
    }

    #[test]
    fn bad_maximums_name_their_key() {
        for (text, key) in [
            ("[limits]\nmax_memory_limit = \"4GB\"", "limits.max_memory_limit"),
            (
                "[limits]\nmax_active_thread_percentage = 0",
                "limits.max_active_thread_percentage",
            ),
            ("[limits]\nmax_cuda_processes = 49", "limits.max_cuda_processes"),
            (
                "[limits]\ndefault_cuda_processes = 0",
                "limits.default_cuda_processes",
            ),
            (
                "[limits.namespaces.a]\nmax_cuda_processes = 0",
                "limits.namespaces.*.max_cuda_processes",
            ),
            (
                "[limits.namespaces.a]\nmax_memry_limit = \"1Gi\"",
                "max_memry_limit",
            ),
            (
                "[limits]\ndefault_memory_limit = \"8Gi\"\ndefault_active_thread_percentage = 25\nmax_memory_limit = \"4Gi\"",
                "limits.default_*",
            ),
            (
                "[gate]\nconnections_per_container = 0",
                "gate.connections_per_container",
            ),
            ("[gate]\nmax_connections = 1", "gate.max_connections"),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.contains(key), "{text}: {e}");
        }
    }

    #[test]
    fn the_published_config_round_trips_and_checks_its_digest() {
        let c =
            parse("[limits]\npolicy = \"uniform\"\n[limits.namespaces.a]\nmax_cuda_processes = 2\n").unwrap();
        let published = PublishedConfig::new(c.clone(), Path::new("/etc/gpu-mps/config.toml"), 42);
        let text = serde_json::to_string(&published).unwrap();
        let back = PublishedConfig::from_json(&text).unwrap();
        assert_eq!(back.config, c);
        assert_eq!(back.digest, c.digest());
        assert_ne!(
            c.digest(),
            NodeConfig::default().digest(),
            "the digest follows the content"
        );
        let tampered = text.replace("\"uniform\"", "\"ceiling\"");
        assert!(
            PublishedConfig::from_json(&tampered)
                .unwrap_err()
                .contains("digest")
        );
        let other_version = text.replace("\"version\":1", "\"version\":9");
        assert!(
            PublishedConfig::from_json(&other_version)
                .unwrap_err()
                .contains("version 9")
        );
        assert_eq!(c.published_path(), Path::new("/run/gpu-mps/node-config.json"));
        // serde quotes an unknown policy as the file spells it.
        let odd_policy = text.replace("\"uniform\"", "\"uni\\nform\"");
        let e = PublishedConfig::from_json(&odd_policy).unwrap_err();
        assert!(
            e.contains("unknown variant `uni\\nform`") && !e.contains('\n'),
            "{e}"
        );
    }

    #[test]
    fn full_file() {
        let c = parse(
            r#"
            root = "/run/x"
            [limits]
            policy = "ceiling"
            tenancy = "exclusive"
            default_memory_limit = "4Gi"
            default_active_thread_percentage = 25
            ceiling_memory_limit = "16Gi"
            ceiling_active_thread_percentage = 50
            overcommit = 1.5
            [daemon]
            idle_grace_seconds = 5
            exclusive_process = false
            "#,
        )
        .unwrap();
        assert_eq!(c.policy, LimitPolicy::Ceiling);
        assert_eq!(c.tenancy, Tenancy::Exclusive);
        assert_eq!(
            c.default_limits,
            Some(Limits {
                memory_bytes: 4 << 30,
                thread_percentage: 25
            })
        );
        assert_eq!(
            c.ceiling,
            Some(Limits {
                memory_bytes: 16 << 30,
                thread_percentage: 50
            })
        );
        assert_eq!(c.manager_socket(), PathBuf::from("/run/x/manager.sock"));
        assert!(!c.exclusive_process);
    }

    #[test]
    fn errors_name_file_key_and_value() {
        let e = parse("[limits]\npolcy = \"ceiling\"").unwrap_err().to_string();
        assert!(
            e.contains("/etc/gpu-mps/config.toml") && e.contains("polcy"),
            "{e}"
        );
        let e = parse("[limits]\ndefault_memory_limit = \"4GB\"\ndefault_active_thread_percentage = 5")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("limits.default_memory_limit") && e.contains("4GB"),
            "{e}"
        );
        let e = parse("[limits]\npolicy = \"ceiling\"").unwrap_err().to_string();
        assert!(e.contains("ceiling_memory_limit"), "{e}");
        let e = parse("[limits]\ndefault_memory_limit = \"4Gi\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("both"), "{e}");
        assert!(parse("root = \"/tmp/nvidia-mps\"").is_err());
        assert!(parse("[limits]\nmax_clients_per_gpu = 49").is_err());
        let e = parse("[daemon]\nstart_timeout_seconds = 10")
            .unwrap_err()
            .to_string();
        assert!(e.contains("hook.timeout_seconds") && e.contains("22"), "{e}");
        assert!(parse("[daemon]\nstart_timeout_seconds = 10\n[hook]\ntimeout_seconds = 22").is_ok());
        assert!(
            parse("[limits]\ndefault_active_thread_percentage = 0\ndefault_memory_limit = \"1Gi\"").is_err()
        );
    }

    #[test]
    fn metrics_are_off_by_default_and_listen_where_the_file_says() {
        assert_eq!(parse("").unwrap().metrics_listen, None);
        let c = parse("[metrics]\nlisten = \"127.0.0.1:9401\"\n").unwrap();
        assert_eq!(c.metrics_listen, Some("127.0.0.1:9401".parse().unwrap()));
        let c = parse("[metrics]\nlisten = \"[::1]:9401\"\n").unwrap();
        assert_eq!(c.metrics_listen, Some("[::1]:9401".parse().unwrap()));
        assert_eq!(parse("[metrics]\n").unwrap().metrics_listen, None);
        for (value, says) in [
            ("localhost:9401", "not an IP address and port"),
            ("127.0.0.1", "not an IP address and port"),
            ("127.0.0.1:99999", "not an IP address and port"),
            ("127.0.0.1:0", "port 0"),
            ("127.0.0.1:94\\n01", "not an IP address and port"),
        ] {
            let e = parse(&format!("[metrics]\nlisten = \"{value}\"\n"))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("metrics.listen") && e.contains(says) && !e.contains('\n'),
                "{value}: {e}"
            );
        }
        let e = parse("[metrics]\naddress = \"127.0.0.1:9401\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("address"), "{e}");
    }

    #[test]
    fn a_config_without_metrics_keeps_its_digest() {
        // The key is left out of the published JSON when unset: a node that does not use it
        // publishes what a manager from before the key published.
        let c = NodeConfig::default();
        let json = serde_json::to_string(&c).unwrap();
        assert!(!json.contains("metrics"), "{json}");
        let with = NodeConfig {
            metrics_listen: Some("127.0.0.1:9401".parse().unwrap()),
            ..NodeConfig::default()
        };
        assert_ne!(with.digest(), c.digest());
        let back: NodeConfig = serde_json::from_str(&serde_json::to_string(&with).unwrap()).unwrap();
        assert_eq!(back, with);
    }

    #[test]
    fn the_env_is_no_gpu_source_unless_the_node_says_so() {
        assert!(!parse("").unwrap().trust_visible_devices_env);
        assert!(!NodeConfig::default().trust_visible_devices_env);
        let on = parse("[gpus]\ntrust_visible_devices_env = true\n").unwrap();
        assert!(on.trust_visible_devices_env);
        assert!(
            !parse("[gpus]\ntrust_visible_devices_env = false\n")
                .unwrap()
                .trust_visible_devices_env
        );
        // Off, the key is left out of the published JSON (the digest of a node that does not
        // use it is unchanged); on, it is in it and changes the digest.
        let off = NodeConfig::default();
        assert!(
            !serde_json::to_string(&off)
                .unwrap()
                .contains("trust_visible_devices_env")
        );
        assert_ne!(on.digest(), off.digest());
        let back: NodeConfig = serde_json::from_str(&serde_json::to_string(&on).unwrap()).unwrap();
        assert_eq!(back, on);
        for text in [
            "[gpus]\ntrust_visible_devices_env = \"yes\"\n",
            "[gpus]\ntrust_env = true\n",
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(!e.contains('\n'), "{e}");
        }
    }

    #[test]
    fn device_plugin_section_parses_and_refuses_bad_values() {
        let c = parse("").unwrap();
        assert!(!c.device_plugin.enabled);
        assert_eq!(c.device_plugin.memory_unit_bytes, 1 << 30);
        let c = parse(
            "[device_plugin]\nenabled = true\nmemory_unit = \"512Mi\"\nserver_reserve = \"2Gi\"\ndefault_thread_share_factor = 1.5\n",
        )
        .unwrap();
        assert_eq!(
            c.device_plugin,
            DevicePluginConfig {
                enabled: true,
                memory_unit_bytes: 512 << 20,
                server_reserve_bytes: 2 << 30,
                default_thread_share_factor: 1.5,
            }
        );
        for (text, key) in [
            ("memory_unit = \"1Mi\"", "device_plugin.memory_unit"),
            ("memory_unit = \"lots\"", "device_plugin.memory_unit"),
            ("server_reserve = \"-1\"", "device_plugin.server_reserve"),
            (
                "default_thread_share_factor = 0.0",
                "device_plugin.default_thread_share_factor",
            ),
            (
                "default_thread_share_factor = nan",
                "device_plugin.default_thread_share_factor",
            ),
        ] {
            let e = parse(&format!("[device_plugin]\n{text}\n"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(key) && !e.contains('\n'), "{text}: {e}");
        }
        for limits in ["policy = \"uniform\"", "tenancy = \"exclusive\""] {
            let e = parse(&format!("[limits]\n{limits}\n[device_plugin]\nenabled = true\n"))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("device_plugin.enabled") && e.contains("exact"),
                "{limits}: {e}"
            );
        }
        assert!(parse("[limits]\npolicy = \"uniform\"\n[device_plugin]\nenabled = false\n").is_ok());
        let e = parse("[device_plugin]\nunit = \"1Gi\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unit"), "{e}");
    }
}
