//! `[device_plugin]`: how gpu-mps-device-plugin turns GPU memory into `gpu-mps.io/memory` units.

use serde::{Deserialize, Serialize};

use super::ConfigError;

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

/// `[device_plugin]`, validated; keys left out take `defaults`.
pub(super) fn from_raw(
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

/// Smallest and largest `device_plugin.memory_unit`: kubelet lists every unit as a device, so a
/// tiny unit floods it (an H200 in 1Mi units would be 143,771 devices).
const MIN_MEMORY_UNIT: u64 = 64 << 20;
const MAX_MEMORY_UNIT: u64 = 64 << 30;

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDevicePlugin {
    enabled: Option<bool>,
    memory_unit: Option<String>,
    server_reserve: Option<String>,
    default_thread_share_factor: Option<f64>,
}
