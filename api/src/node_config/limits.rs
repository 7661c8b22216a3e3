//! `[limits]`: what a container may ask for and how one server serves several.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{ConfigError, LimitPolicy, MPS_MAX_CLIENTS_PER_GPU, Tenancy, config_number};
use crate::limits::{self, LimitError, Limits, MAX_CUDA_PROCESSES};
use crate::maxima::Maxima;

/// `[limits]`, validated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsConfig {
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
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
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
        }
    }
}

impl LimitsConfig {
    /// The maximums for a container of `namespace` and how to name them in a message.
    pub fn maxima_for(&self, namespace: &str) -> (Maxima, String) {
        match self.namespace_maxima.get(namespace) {
            Some(m) => (*m, format!("namespace {namespace}")),
            None => (self.maxima, "this node".to_string()),
        }
    }

    /// `[limits]` as written in the file at `path` (for messages); keys left out take the
    /// defaults.
    pub(super) fn from_raw(path: &str, raw: RawLimits) -> Result<Self, ConfigError> {
        let d = LimitsConfig::default();
        let memory = |key: &'static str, value: Option<String>| -> Result<Option<u64>, ConfigError> {
            value
                .map(|v| {
                    limits::parse_memory_limit(&v).map_err(|source| ConfigError::Limit {
                        path: path.to_string(),
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
                    path: path.to_string(),
                    key,
                    value: v.to_string(),
                    source: LimitError::ThreadPercentage { value: v.to_string() },
                }),
                v => Ok(v),
            }
        };
        let invalid = |key: &'static str, message: String| ConfigError::Invalid {
            path: path.to_string(),
            key,
            message,
        };
        let pair =
            |key: &'static str, m: Option<u64>, t: Option<u8>| -> Result<Option<Limits>, ConfigError> {
                match (m, t) {
                    (Some(memory_bytes), Some(thread_percentage)) => Ok(Some(Limits {
                        memory_bytes,
                        thread_percentage,
                    })),
                    (None, None) => Ok(None),
                    _ => Err(invalid(
                        key,
                        "set both the memory limit and the active thread percentage, or neither".into(),
                    )),
                }
            };
        let l = raw;
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
            return Err(invalid(
                "limits.ceiling_memory_limit",
                "policy = \"ceiling\" needs ceiling_memory_limit and ceiling_active_thread_percentage".into(),
            ));
        }
        let overcommit = l.overcommit.unwrap_or(d.overcommit);
        if !(overcommit > 0.0 && overcommit <= 16.0) {
            return Err(invalid(
                "limits.overcommit",
                format!("{overcommit} is out of range: expected a factor above 0 and at most 16"),
            ));
        }
        let max_clients = l.max_clients_per_gpu.unwrap_or(d.max_clients_per_gpu);
        if max_clients == 0 || max_clients > MPS_MAX_CLIENTS_PER_GPU {
            return Err(invalid(
                "limits.max_clients_per_gpu",
                format!("{max_clients} is out of range: expected 1 to {MPS_MAX_CLIENTS_PER_GPU}"),
            ));
        }
        let default_cuda_processes = l.default_cuda_processes.unwrap_or(d.default_cuda_processes);
        if !(1..=MAX_CUDA_PROCESSES).contains(&default_cuda_processes) {
            return Err(invalid(
                "limits.default_cuda_processes",
                format!("{default_cuda_processes} is out of range: expected 1 to {MAX_CUDA_PROCESSES}"),
            ));
        }
        let node_maxima = raw_maxima(
            path,
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
                raw_maxima(path, "limits.namespaces.*", raw_ns, node_maxima)?,
            );
        }
        if let Some(defaults) = default_limits {
            node_maxima
                .check(defaults, default_cuda_processes, "this node")
                .map_err(|e| {
                    invalid(
                        "limits.default_*",
                        format!("the node defaults break a node maximum: {e}"),
                    )
                })?;
        }
        Ok(LimitsConfig {
            policy,
            tenancy: l.tenancy.unwrap_or(d.tenancy),
            default_limits,
            default_cuda_processes,
            maxima: node_maxima,
            namespace_maxima,
            ceiling,
            overcommit,
            max_clients_per_gpu: max_clients,
            allow_overlapping_gpu_sets: l
                .allow_overlapping_gpu_sets
                .unwrap_or(d.allow_overlapping_gpu_sets),
        })
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLimits {
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
