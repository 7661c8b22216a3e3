//! `[daemon]` (how the manager runs an MPS control daemon) and `[hook]` (how long the hook
//! waits for the manager), validated together: the hook must outwait a daemon's start.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{ConfigError, config_number};

/// `[daemon]`, validated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DaemonConfig {
    pub control_binary: PathBuf,
    pub idle_grace_seconds: u64,
    pub exclusive_process: bool,
    pub start_timeout_seconds: u64,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        DaemonConfig {
            control_binary: PathBuf::from("nvidia-cuda-mps-control"),
            idle_grace_seconds: 60,
            exclusive_process: true,
            // Measured: a daemon starts and serves its first client in well under a second.
            start_timeout_seconds: 4,
        }
    }
}

/// `[hook]`, validated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HookConfig {
    pub timeout_seconds: u64,
}

impl Default for HookConfig {
    fn default() -> Self {
        HookConfig { timeout_seconds: 10 }
    }
}

/// `[daemon]` and `[hook]` as written in the file at `path`; keys left out take the defaults.
pub(super) fn from_raw(
    path: &str,
    daemon: RawDaemon,
    hook: RawHook,
) -> Result<(DaemonConfig, HookConfig), ConfigError> {
    let d = DaemonConfig::default();
    let start_timeout = daemon
        .start_timeout_seconds
        .unwrap_or(d.start_timeout_seconds)
        .max(1);
    let hook_timeout = hook
        .timeout_seconds
        .unwrap_or(HookConfig::default().timeout_seconds)
        .clamp(1, 60);
    // A daemon start waits up to start_timeout twice (for `-d` to return, then for its pid
    // file): the hook must outwait that, or the CRI caller sees a timeout instead of the reason.
    if hook_timeout < 2 * start_timeout + 2 {
        return Err(ConfigError::Invalid {
            path: path.to_string(),
            key: "hook.timeout_seconds",
            message: format!(
                "{hook_timeout} is too short for daemon.start_timeout_seconds = {start_timeout}: it must be at least {}",
                2 * start_timeout + 2
            ),
        });
    }
    Ok((
        DaemonConfig {
            control_binary: daemon.control_binary.unwrap_or(d.control_binary),
            idle_grace_seconds: daemon.idle_grace_seconds.unwrap_or(d.idle_grace_seconds),
            exclusive_process: daemon.exclusive_process.unwrap_or(d.exclusive_process),
            start_timeout_seconds: start_timeout,
        },
        HookConfig {
            timeout_seconds: hook_timeout,
        },
    ))
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDaemon {
    control_binary: Option<PathBuf>,
    #[serde(default, deserialize_with = "config_number::whole")]
    idle_grace_seconds: Option<u64>,
    exclusive_process: Option<bool>,
    #[serde(default, deserialize_with = "config_number::whole")]
    start_timeout_seconds: Option<u64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawHook {
    #[serde(default, deserialize_with = "config_number::whole")]
    timeout_seconds: Option<u64>,
}
