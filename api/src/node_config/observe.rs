//! `[metrics]` (where the manager serves Prometheus metrics) and `[gpus]` (where a container's
//! GPUs may come from): two small tables of one key each.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use super::ConfigError;

/// `[metrics]`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// Where the manager serves `GET /metrics` over HTTP. `None`, the default: no metrics, no
    /// port.
    pub listen: Option<SocketAddr>,
}

impl MetricsConfig {
    pub(super) fn from_raw(path: &str, raw: RawMetrics) -> Result<Self, ConfigError> {
        let listen = raw
            .listen
            .map(|value| metrics_address(&value))
            .transpose()
            .map_err(|message| ConfigError::Invalid {
                path: path.to_string(),
                key: "metrics.listen",
                message,
            })?;
        Ok(MetricsConfig { listen })
    }
}

/// `[gpus]`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpusConfig {
    /// A container's own `NVIDIA_VISIBLE_DEVICES` names its GPUs where nothing written for the
    /// pod (device nodes, CDI, the volume-mounts list) does. Off by default: the env is the
    /// pod's to write, so it is a GPU source only where the operator says the NVIDIA device
    /// plugin's `envvar` strategy hands GPUs over.
    pub trust_visible_devices_env: bool,
}

impl GpusConfig {
    pub(super) fn from_raw(raw: RawGpus) -> Self {
        GpusConfig {
            trust_visible_devices_env: raw.trust_visible_devices_env.unwrap_or_default(),
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawGpus {
    trust_visible_devices_env: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMetrics {
    listen: Option<String>,
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
