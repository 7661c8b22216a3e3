//! From config.json text to what `create` will do, without I/O: pass the spec through, or the
//! new spec with the daemon, limits and hook arguments. The binary and `gpu-mps explain` both
//! call this, so explain shows exactly what the shim does.

use std::collections::HashMap;
use std::path::PathBuf;

use gpu_mps_api::annotations::CRI_CONTAINER_TYPE;
use gpu_mps_api::container_request::{ContainerRequest, Layout};
use gpu_mps_api::hook_invocation::AcquireArgs;
use gpu_mps_api::inventory::Inventory;
use gpu_mps_api::{ContainerId, DaemonKey, Limits, NodeConfig};
use serde_json::Value;

use crate::allocation;
use crate::error::ShimError;
use crate::gpu_devices::{self, DeviceRequest, EnvVerdict, TRUST_ENV_KEY, VISIBLE_DEVICES_ENV};
use crate::request::{self, NodeRules, ResolvedLimits, ResolvedRequest};
use crate::rewrite::{self, RewriteError};
use crate::spec_fields;

/// What the shim does with one config.json.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RewritePlan {
    /// `None`: passthrough, config.json is not written. `Some`: the new config.json, as
    /// written (pretty-printed, two-space indent, trailing newline); with `daemon: None`, that of
    /// a container without a GPU whose env said `NVIDIA_VISIBLE_DEVICES=all`, set to `void`
    /// ([`ParsedSpec::judge_env`]).
    pub rewritten: Option<String>,
    pub daemon: Option<DaemonKey>,
    pub limits: Option<Limits>,
    /// The limits and where each one came from (annotation or node default).
    pub resolved_limits: Option<ResolvedLimits>,
    pub acquire: Option<AcquireArgs>,
    /// The host directory the container sees at /tmp/nvidia-mps, which the shim creates: the
    /// container's gate dir (under every policy, docs/adr/0006).
    pub gate_dir: Option<PathBuf>,
    /// One line saying why, for debug logs and `gpu-mps explain`.
    pub reason: String,
}

/// A parsed config.json and whether it asks for a GPU; what the shim needs to decide before it
/// loads the node config or the inventory.
#[derive(Debug, Clone)]
pub struct ParsedSpec {
    spec: Value,
    annotations: HashMap<String, String>,
    devices: Option<DeviceRequest>,
    passthrough_reason: Option<String>,
    /// The env's `NVIDIA_VISIBLE_DEVICES` was set to `void` ([`ParsedSpec::judge_env`]): the
    /// container passes through, but config.json is written.
    env_voided: bool,
}

/// Parses config.json text and finds its GPUs. A spec whose annotations, env, linux.devices,
/// mounts or CDI device names are malformed is an error: the shim cannot tell whether it has a
/// GPU.
pub fn parse_spec(text: &str) -> Result<ParsedSpec, ShimError> {
    let spec = spec_fields::parse(text)?;
    let annotations = spec_fields::annotations(&spec)?;
    if annotations
        .get(CRI_CONTAINER_TYPE)
        .is_some_and(|t| t == "sandbox")
    {
        let reason = format!("passthrough: sandbox container ({CRI_CONTAINER_TYPE}=sandbox) runs no CUDA");
        return Ok(ParsedSpec {
            spec,
            annotations,
            devices: None,
            passthrough_reason: Some(reason),
            env_voided: false,
        });
    }
    let env = spec_fields::env(&spec)?;
    let linux_devices = spec_fields::linux_devices(&spec)?;
    let mounts = spec_fields::mounts(&spec)?;
    let fields = gpu_devices::SpecDevices {
        env: &env,
        annotations: &annotations,
        linux_devices: &linux_devices,
        mounts: &mounts,
    };
    // A trusted source naming a GPU makes this Some: from here on the container is rewritten
    // or refused, never passed through.
    let devices = gpu_devices::requested(fields)?;
    if devices.is_none() {
        allocation::require_gpu_for_units(&annotations)?;
    } else {
        // Before the node config and the inventory are read (a node whose manager is down must
        // still tell the pod what is wrong with its annotations), and every bad one at once.
        let container_name = request::identity_from_annotations(&annotations).container_name;
        request::check_annotations(&annotations, &container_name)?;
    }
    let passthrough_reason = devices.is_none().then(|| gpu_devices::no_gpu_reason(fields));
    Ok(ParsedSpec {
        spec,
        annotations,
        devices,
        passthrough_reason,
        env_voided: false,
    })
}

impl ParsedSpec {
    /// Whether the container got a GPU, so the node config and inventory are needed.
    pub fn wants_gpu(&self) -> bool {
        self.passthrough_reason.is_none()
    }

    /// Why the spec passes through untouched; `None` for a GPU container.
    pub fn passthrough_reason(&self) -> Option<&str> {
        self.passthrough_reason.as_deref()
    }

    /// Applies the node's `[gpus] trust_visible_devices_env` to a container whose GPUs only its
    /// own env names (before the inventory is read: the answer does not depend on it). Refused
    /// where the node does not take GPUs from the env, or the env says `all` where it does; a
    /// container whose env says `all` (a CUDA image's default) on a node that does not trust the
    /// env got no GPU: it passes through with `NVIDIA_VISIBLE_DEVICES=void`, so that the
    /// toolkit's runtime, when chained after the shim, hands it none either. Idempotent.
    pub fn judge_env(mut self, config: &NodeConfig) -> Result<ParsedSpec, ShimError> {
        let Some(devices) = &self.devices else {
            return Ok(self);
        };
        match gpu_devices::judge_env(devices, config.gpus.trust_visible_devices_env)? {
            EnvVerdict::Gpus => Ok(self),
            EnvVerdict::NoGpu { value } => {
                allocation::require_gpu_for_units(&self.annotations)?;
                rewrite::void_visible_devices(&mut self.spec)?;
                self.devices = None;
                self.env_voided = true;
                self.passthrough_reason = Some(format!(
                    "passthrough: no GPU scheduled ({VISIBLE_DEVICES_ENV}={value:?} is no GPU source on this node: {TRUST_ENV_KEY} is off); {VISIBLE_DEVICES_ENV} set to \"void\" so that no runtime after gpu-mps hands the container a GPU"
                ));
                Ok(self)
            }
        }
    }

    /// The config.json to write for a container that passes through: `None` (leave it as it
    /// is) unless [`ParsedSpec::judge_env`] set its env to `void`.
    pub fn passthrough_spec(&self) -> Result<Option<String>, ShimError> {
        if !self.env_voided {
            return Ok(None);
        }
        Ok(Some(spec_text(&self.spec)?))
    }

    /// Resolves the request against the node's config and GPUs and rewrites the spec.
    /// `container_id` names the container's gate dir.
    pub fn plan(
        self,
        config: &NodeConfig,
        inventory: &Inventory,
        container_id: &str,
    ) -> Result<RewritePlan, ShimError> {
        let parsed = self.judge_env(config)?;
        let (Some(devices), None) = (&parsed.devices, &parsed.passthrough_reason) else {
            let rewritten = parsed.passthrough_spec()?;
            let reason = parsed.passthrough_reason.unwrap_or_default();
            return Ok(RewritePlan {
                rewritten,
                daemon: None,
                limits: None,
                resolved_limits: None,
                acquire: None,
                gate_dir: None,
                reason,
            });
        };
        let identity = request::identity_from_annotations(&parsed.annotations);
        request::check_names_for_hook(&identity)?;
        let (maxima, maxima_scope) = config.limits.maxima_for(&identity.namespace);
        let rules = NodeRules {
            default_limits: config.limits.default_limits,
            default_cuda_processes: config.limits.default_cuda_processes,
            maxima,
            maxima_scope: &maxima_scope,
        };
        let daemon = gpu_devices::resolve(devices, inventory)?;
        let allocation = allocation::allocated_units(&parsed.annotations, &daemon, config, inventory)?;
        let resolved = match &allocation {
            Some((_, allocated)) => request::resolve_allocated_limits(
                &parsed.annotations,
                &identity.container_name,
                rules,
                *allocated,
            )?,
            None => request::resolve_limits(&parsed.annotations, &identity.container_name, rules)?,
        };
        let (priority, priority_source) =
            request::resolve_priority(&parsed.annotations, &identity.container_name)?;
        // Under every policy the container sees only its gate's `control`, never the daemon's
        // pipe dir: that one holds `control_privileged`, through which a root pod could change
        // or quit the daemon (measured on the H200, MPS-FACTS.md "Hostile tenants").
        let gate_dir = config.gate_dir(&ContainerId::parse(container_id)?);
        let env = spec_fields::env(&parsed.spec)?;
        let request = ResolvedRequest {
            container: ContainerRequest {
                key: daemon.clone(),
                limits: resolved.limits,
                cuda_processes: resolved.cuda_processes,
                identity,
                memory_units: allocation.map(|(a, _)| a.units).unwrap_or_default(),
                priority,
                layout: Layout {
                    policy: config.limits.policy.to_string(),
                    config_digest: config.digest(),
                },
            },
            gate_dir: gate_dir.clone(),
            narrow_visible_devices: devices.trusted() && gpu_devices::env_names_devices(&env),
        };
        let mut spec = parsed.spec;
        let acquire = rewrite::rewrite(&mut spec, &request, config)?;
        let mut origins: Vec<String> = devices.devices.iter().map(|d| d.origin.to_string()).collect();
        origins.dedup();
        let reason = format!(
            "rewrite: GPUs {daemon} from {}; limits {} for {} CUDA process(es), {} each (memory from {}, threads from {}, processes from {}); daemon {}; policy {}: /tmp/nvidia-mps is the gate {}",
            origins.join(" and "),
            resolved.limits,
            resolved.cuda_processes,
            resolved.per_process(),
            resolved.memory_source,
            resolved.threads_source,
            resolved.processes_source,
            daemon.dir_name(),
            config.limits.policy,
            gate_dir.display(),
        );
        // Said only where it is not MPS's default, so every reason of a normal container reads
        // as it did before priorities existed.
        let reason = if priority.is_normal() {
            reason
        } else {
            format!("{reason}; client priority {priority} (from {priority_source})")
        };
        Ok(RewritePlan {
            rewritten: Some(spec_text(&spec)?),
            daemon: Some(daemon),
            limits: Some(resolved.limits),
            resolved_limits: Some(resolved),
            acquire: Some(acquire),
            gate_dir: Some(gate_dir),
            reason,
        })
    }
}

/// What `create` of container `container_id` does with `spec_text` on a node with `config`
/// and `inventory`.
pub fn plan_rewrite(
    spec_text: &str,
    config: &NodeConfig,
    inventory: &Inventory,
    container_id: &str,
) -> Result<RewritePlan, ShimError> {
    parse_spec(spec_text)?.plan(config, inventory, container_id)
}

/// The text of a rewritten config.json: pretty-printed so that a diff against containerd's
/// compact original reads field by field once both are pretty-printed.
pub fn spec_text(spec: &Value) -> Result<String, RewriteError> {
    let mut text = serde_json::to_string_pretty(spec).map_err(|e| RewriteError::Build {
        what: "config.json text",
        message: e.to_string(),
    })?;
    text.push('\n');
    Ok(text)
}
