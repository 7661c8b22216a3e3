//! `/etc/gpu-mps/config.toml`: the node's settings, shared by the shim and the manager.
//!
//! Parsing is pure (`NodeConfig::from_toml`); the binaries read the file. Unknown keys are
//! an error: a typo such as `polcy = "ceiling"` must not silently leave the node on `uniform`.
//!
//! [`NodeConfig`] has the file's shape: the top-level keys, then one section per table
//! (`limits`, `daemon`, `hook`, `gate`, `device_plugin`, `metrics`, `gpus`), each in its own
//! module with its defaults, the file's form of it (`Raw*`, every key optional) and the checks
//! of its own keys beside its fields; checks across sections are in [`NodeConfig::from_toml`].
//! A new key is a field, its default and its `Raw` twin, in one file. `gpu-mps config get KEY`
//! reads any value by the same path (`gate.queue_timeout_seconds`).

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::limits::LimitError;

mod config_number;
mod daemon;
mod device_plugin;
mod gate;
mod limits;
mod observe;
pub mod root_entries;
#[cfg(test)]
mod tests;

pub use daemon::{DaemonConfig, HookConfig};
pub use device_plugin::DevicePluginConfig;
pub use gate::GateConfig;
pub use limits::LimitsConfig;
pub use observe::{GpusConfig, MetricsConfig};
pub use root_entries::{
    DAEMONS_DIR, GATE_KEEPER_LOCK_FILE, GATE_KEEPER_SOCKET_FILE, GATES_DIR, INVENTORY_FILE, LEASES_DIR,
    MANAGER_LOCK_FILE, MANAGER_SOCKET_FILE, NVML_ERROR_FILE, PUBLISHED_CONFIG_FILE, ROOT_ENTRIES, STATE_FILE,
    is_root_entry,
};

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

/// The file's top level; each table is its section's `Raw` form.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    root: Option<PathBuf>,
    hook_path: Option<PathBuf>,
    runc_path: Option<PathBuf>,
    #[serde(default)]
    limits: limits::RawLimits,
    #[serde(default)]
    daemon: daemon::RawDaemon,
    #[serde(default)]
    hook: daemon::RawHook,
    #[serde(default)]
    gate: gate::RawGate,
    #[serde(default)]
    device_plugin: device_plugin::RawDevicePlugin,
    #[serde(default)]
    metrics: observe::RawMetrics,
    #[serde(default)]
    gpus: observe::RawGpus,
}

/// The node's settings, validated, with defaults filled in, in the file's shape. The manager
/// publishes the config it runs with ([`PublishedConfig`]); the shim uses that one, so that
/// both always agree.
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
    #[serde(default)]
    pub limits: LimitsConfig,
    #[serde(default)]
    pub daemon: DaemonConfig,
    #[serde(default)]
    pub hook: HookConfig,
    #[serde(default)]
    pub gate: GateConfig,
    /// Scheduling by `gpu-mps.io/memory` units (gpu-mps-device-plugin).
    #[serde(default)]
    pub device_plugin: DevicePluginConfig,
    #[serde(default)]
    pub metrics: MetricsConfig,
    #[serde(default)]
    pub gpus: GpusConfig,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            root: PathBuf::from("/run/gpu-mps"),
            hook_path: PathBuf::from("/usr/local/bin/gpu-mps-hook"),
            runc_path: PathBuf::from("/usr/sbin/runc"),
            limits: LimitsConfig::default(),
            daemon: DaemonConfig::default(),
            hook: HookConfig::default(),
            gate: GateConfig::default(),
            device_plugin: DevicePluginConfig::default(),
            metrics: MetricsConfig::default(),
            gpus: GpusConfig::default(),
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
        let root = raw.root.unwrap_or(d.root);
        check_root(&p, &root)?;
        let limits = LimitsConfig::from_raw(&p, raw.limits)?;
        let (daemon, hook) = daemon::from_raw(&p, raw.daemon, raw.hook)?;
        let gate = GateConfig::from_raw(&p, raw.gate)?;
        let device_plugin = device_plugin::from_raw(&p, raw.device_plugin, d.device_plugin)?;
        let metrics = MetricsConfig::from_raw(&p, raw.metrics)?;
        let (policy, tenancy) = (limits.policy, limits.tenancy);
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
            root,
            hook_path: raw.hook_path.unwrap_or(d.hook_path),
            runc_path: raw.runc_path.unwrap_or(d.runc_path),
            limits,
            daemon,
            hook,
            gate,
            device_plugin,
            metrics,
            gpus: GpusConfig::from_raw(raw.gpus),
        })
    }

    /// The value at `key`, a dotted path as in the file (`root`, `gate.queue_timeout_seconds`)
    /// or through a section's own shape where it differs from the file's
    /// (`limits.default_limits.memory_bytes`): a string as is, anything else as JSON; a whole
    /// section as JSON. For scripts: `gpu-mps config get KEY`.
    pub fn value_at(&self, key: &str) -> Result<String, UnknownKey> {
        let whole = serde_json::to_value(self).expect("the node config serializes");
        let mut at = &whole;
        let mut walked = Vec::new();
        for part in key.split('.') {
            let next = at.as_object().and_then(|o| o.get(part));
            match next {
                Some(v) => {
                    walked.push(part);
                    at = v;
                }
                None => {
                    let known: Vec<String> = at
                        .as_object()
                        .map(|o| o.keys().map(|k| prefixed(&walked, k)).collect())
                        .unwrap_or_default();
                    let asked = prefixed(&walked, part);
                    let nearest = known
                        .iter()
                        .min_by_key(|k| crate::annotations::edit_distance(&asked, k))
                        .cloned();
                    return Err(UnknownKey {
                        key: key.to_string(),
                        known,
                        nearest,
                    });
                }
            }
        }
        Ok(match at {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        })
    }

    /// A short digest of every setting: the shim passes the one it used to the manager, which
    /// refuses a container laid out under another config than its own.
    pub fn digest(&self) -> String {
        digest_of(&serde_json::to_value(self).expect("the node config serializes"))
    }

    /// Where the manager publishes the config it runs with.
    pub fn published_path(&self) -> PathBuf {
        self.root.join(PUBLISHED_CONFIG_FILE)
    }

    pub fn manager_socket(&self) -> PathBuf {
        self.root.join(MANAGER_SOCKET_FILE)
    }

    pub fn inventory_path(&self) -> PathBuf {
        self.root.join(INVENTORY_FILE)
    }

    pub fn state_path(&self) -> PathBuf {
        self.root.join(STATE_FILE)
    }

    /// One file per recorded lease, beside the state file: what the leases are rebuilt from
    /// when the state file cannot be used.
    pub fn lease_files_dir(&self) -> PathBuf {
        self.root.join(LEASES_DIR)
    }

    /// Held by the running manager (flock): one manager per root.
    pub fn manager_lock_path(&self) -> PathBuf {
        self.root.join(MANAGER_LOCK_FILE)
    }

    /// Where the daemon dirs live.
    pub fn daemons_root(&self) -> PathBuf {
        self.root.join(DAEMONS_DIR)
    }

    pub fn daemon_dir(&self, key: &crate::DaemonKey) -> PathBuf {
        self.daemons_root().join(key.dir_name())
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
        self.root.join(GATES_DIR)
    }
}

/// A key `gpu-mps config get` does not know.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error(
    "no setting {key}{}: the keys there are {}",
    nearest.as_ref().map(|n| format!(" (did you mean {n}?)")).unwrap_or_default(),
    known.join(", ")
)]
pub struct UnknownKey {
    pub key: String,
    pub known: Vec<String>,
    pub nearest: Option<String>,
}

fn prefixed(walked: &[&str], key: &str) -> String {
    walked.iter().copied().chain([key]).collect::<Vec<_>>().join(".")
}

/// `root`: absolute, short enough for the sockets under it, and not where the NVIDIA toolkit
/// mounts its own MPS directory.
fn check_root(path: &str, root: &Path) -> Result<(), ConfigError> {
    let invalid = |message: String| ConfigError::Invalid {
        path: path.to_string(),
        key: "root",
        message,
    };
    if root.is_relative() {
        return Err(invalid("must be an absolute path".into()));
    }
    if root.as_os_str().len() > MAX_ROOT_LEN {
        return Err(invalid(format!(
            "{} is {} bytes long, more than {MAX_ROOT_LEN}: the MPS and gate sockets under it must fit in a unix socket address (107 bytes)",
            crate::message::printable(&root.to_string_lossy()),
            root.as_os_str().len()
        )));
    }
    if root.starts_with("/tmp/nvidia-mps") {
        return Err(invalid(
            "must not be under /tmp/nvidia-mps: nvidia-container-toolkit mounts that host path into every GPU container".into(),
        ));
    }
    Ok(())
}

/// 2 since the config has the file's sections (2026-12-07); a version-1 file, left by a
/// manager of before, is refused with "restart gpu-mps-manager" until the new one publishes.
const PUBLISHED_VERSION: u32 = 2;

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
    /// The digest is checked over the config as published, not as this build would write it
    /// again: a key added since (absent there, its default here) then changes nothing.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let shown = |e: serde_json::Error| crate::message::printable(&e.to_string()).into_owned();
        let value: serde_json::Value = serde_json::from_str(text).map_err(shown)?;
        let version = value.get("version").and_then(serde_json::Value::as_u64);
        if version != Some(u64::from(PUBLISHED_VERSION)) {
            return Err(format!(
                "version {} (this build reads version {PUBLISHED_VERSION})",
                version.map_or_else(|| "missing".to_string(), |v| v.to_string())
            ));
        }
        let as_published = value.get("config").map(digest_of).unwrap_or_default();
        let published: PublishedConfig = serde_json::from_value(value).map_err(shown)?;
        if published.digest != as_published {
            return Err("its digest does not match its content".into());
        }
        Ok(published)
    }
}

/// The digest of a config's JSON (serde_json keeps the keys' order and floats' text, so the
/// JSON read back is the JSON written).
fn digest_of(config: &serde_json::Value) -> String {
    use sha2::{Digest, Sha256};
    let text = serde_json::to_vec(config).expect("JSON serializes");
    let hash = Sha256::digest(&text);
    hash.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// The config path: `$GPU_MPS_CONFIG` if set, else /etc/gpu-mps/config.toml.
pub fn config_path_from_env() -> PathBuf {
    std::env::var_os(CONFIG_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG_PATH))
}
