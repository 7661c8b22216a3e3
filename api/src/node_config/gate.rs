//! `[gate]`: how each container's connect gate waits and how many connections it takes.

use std::ops::RangeInclusive;

use serde::{Deserialize, Serialize};

use super::{ConfigError, config_number};

/// `[gate]`, validated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GateConfig {
    /// Longest a client's control connection may stay open through its gate.
    pub handshake_timeout_seconds: u64,
    /// Longest a CUDA client waits for the server (limits set, daemon answering) before the
    /// gate refuses it cleanly.
    pub queue_timeout_seconds: u64,
    /// Connections one container may have open at its gate at once; more wait in the listen
    /// backlog, which costs the manager no descriptor.
    pub connections_per_container: u32,
    /// Gate connections open at once on the whole node (a descriptor budget).
    pub max_connections: u32,
}

impl Default for GateConfig {
    fn default() -> Self {
        GateConfig {
            // A client's connection with the first client of a new server waits for the server
            // to start (0.3 s measured), the others take milliseconds. The control daemon serves
            // one connection at a time, so a stalled one holds up every pod on the GPU this long.
            handshake_timeout_seconds: 5,
            // Measured (docs/gpu-results.md section 7): the daemon answers a client's request in
            // 0.2-0.4 ms, or 150-250 ms when it starts the server for it. 48 clients queued
            // behind each other with a limit change each take a few seconds.
            queue_timeout_seconds: 30,
            // A CUDA process uses one control connection at a time (three in a row), so a
            // container of 4 processes starting at once never waits for its own.
            connections_per_container: 4,
            // Far below the manager's raised descriptor limit (it asks for 65536).
            max_connections: 4096,
        }
    }
}

impl GateConfig {
    /// `[gate]` as written in the file at `path`; keys left out take the defaults.
    pub(super) fn from_raw(path: &str, raw: RawGate) -> Result<Self, ConfigError> {
        let d = GateConfig::default();
        fn in_range<T: PartialOrd + Copy + std::fmt::Display>(
            path: &str,
            key: &'static str,
            value: Option<T>,
            default: T,
            range: RangeInclusive<T>,
            unit: &str,
        ) -> Result<T, ConfigError> {
            match value {
                Some(v) if !range.contains(&v) => Err(ConfigError::Invalid {
                    path: path.to_string(),
                    key,
                    message: format!(
                        "{v} is out of range: expected {} to {}{unit}",
                        range.start(),
                        range.end()
                    ),
                }),
                v => Ok(v.unwrap_or(default)),
            }
        }
        Ok(GateConfig {
            handshake_timeout_seconds: in_range(
                path,
                "gate.handshake_timeout_seconds",
                raw.handshake_timeout_seconds,
                d.handshake_timeout_seconds,
                1..=300,
                " seconds",
            )?,
            queue_timeout_seconds: in_range(
                path,
                "gate.queue_timeout_seconds",
                raw.queue_timeout_seconds,
                d.queue_timeout_seconds,
                1..=300,
                " seconds",
            )?,
            connections_per_container: in_range(
                path,
                "gate.connections_per_container",
                raw.connections_per_container,
                d.connections_per_container,
                1..=64,
                "",
            )?,
            max_connections: in_range(
                path,
                "gate.max_connections",
                raw.max_connections,
                d.max_connections,
                16..=65536,
                "",
            )?,
        })
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawGate {
    #[serde(default, deserialize_with = "config_number::whole")]
    handshake_timeout_seconds: Option<u64>,
    #[serde(default, deserialize_with = "config_number::whole")]
    queue_timeout_seconds: Option<u64>,
    #[serde(default, deserialize_with = "config_number::whole")]
    connections_per_container: Option<u32>,
    #[serde(default, deserialize_with = "config_number::whole")]
    max_connections: Option<u32>,
}
