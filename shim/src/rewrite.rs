//! The spec rewrite for a container that got a GPU: exactly the changes docs/internals.md
//! lists, and nothing else. Namespaces, `/dev/shm`, the user and capabilities stay as the pod
//! asked: a containerized MPS client needs only its gate dir.
//!
//! Rewriting an already rewritten spec gives the same spec, so a create retried on the same
//! bundle does not stack hooks or env entries.

use std::path::{Path, PathBuf};

use gpu_mps_api::CONTAINER_PIPE_DIR;
use gpu_mps_api::NodeConfig;
use gpu_mps_api::annotations::{DAEMON, LIMITS};
use gpu_mps_api::hook_invocation::{AcquireArgs, release_hook_args};
use oci_spec::runtime::{HookBuilder, MountBuilder};
use serde_json::Value;
use thiserror::Error;

use crate::gpu_devices::VISIBLE_DEVICES_ENV;
use crate::request::ResolvedRequest;
use crate::spec_fields::{self, SpecError, array_entry, object_entry, root_object};

/// nvidia-smi reads the whole GPU through NVML, past MPS: hidden from the container.
pub const MASKED_NVIDIA_SMI: [&str; 5] = [
    "/usr/bin/nvidia-smi",
    "/usr/local/bin/nvidia-smi",
    "/usr/local/nvidia/bin/nvidia-smi",
    "/bin/nvidia-smi",
    "/usr/sbin/nvidia-smi",
];
/// Every variable with this prefix belongs to the shim: pipe dir, limits, client priority.
pub const MPS_ENV_PREFIX: &str = "CUDA_MPS_";
/// Stripped: a client could use it to take more of the server's work queues than its share.
pub const MAX_CONNECTIONS_ENV: &str = "CUDA_DEVICE_MAX_CONNECTIONS";
/// MPS's client priority; set from `gpu-mps.io/priority`.
pub const PRIORITY_ENV: &str = "CUDA_MPS_CLIENT_PRIORITY";
/// Options of the gate dir mount: the container may connect to the socket, never change it.
pub const GATE_MOUNT_OPTIONS: [&str; 5] = ["rbind", "ro", "nosuid", "nodev", "noexec"];
/// Seconds an OCI hook gets beyond its own timeout to report before runc kills it.
pub const HOOK_TIMEOUT_MARGIN_SECONDS: u64 = 5;

#[derive(Debug, Error)]
pub enum RewriteError {
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("config.json has no process: a container that gets a GPU needs one")]
    NoProcess,
    #[error("cannot build the {what} to add to config.json: {message}")]
    Build { what: &'static str, message: String },
}

/// What the createRuntime hook will ask the manager for.
pub fn acquire_args(request: &ResolvedRequest, config: &NodeConfig) -> AcquireArgs {
    AcquireArgs {
        socket: config.manager_socket().display().to_string(),
        timeout_seconds: config.hook.timeout_seconds,
        request: request.container.clone(),
    }
}

/// Edits `spec` in place for `request`; returns the hook's acquire arguments. On error the
/// spec is left as it was.
pub fn rewrite(
    spec: &mut Value,
    request: &ResolvedRequest,
    config: &NodeConfig,
) -> Result<AcquireArgs, RewriteError> {
    let mut edited = spec.clone();
    let acquire = rewrite_in_place(&mut edited, request, config)?;
    *spec = edited;
    Ok(acquire)
}

fn rewrite_in_place(
    spec: &mut Value,
    request: &ResolvedRequest,
    config: &NodeConfig,
) -> Result<AcquireArgs, RewriteError> {
    if !spec.get("process").is_some_and(Value::is_object) {
        return Err(RewriteError::NoProcess);
    }
    let env = spec_fields::env(spec)?;
    let mounts = spec_fields::mounts(spec)?;
    let masked = spec_fields::masked_paths(spec)?;
    spec_fields::hooks(spec)?;
    spec_fields::annotations(spec)?;

    let acquire = acquire_args(request, config);
    let gate_mount = gate_mount(&request.gate_dir)?;
    let hook_timeout = config.hook.timeout_seconds + HOOK_TIMEOUT_MARGIN_SECONDS;
    let create_runtime = hook(&config.hook_path, acquire.to_hook_args(), hook_timeout)?;
    let socket = config.manager_socket().display().to_string();
    let poststop = hook(
        &config.hook_path,
        release_hook_args(&socket, config.hook.timeout_seconds, &request.gate_dir),
        hook_timeout,
    )?;

    let root = root_object(spec)?;

    let spec_mounts = array_entry(root, "mounts", "mounts")?;
    let mut kept = mounts
        .iter()
        .map(|m| m.destination() != Path::new(CONTAINER_PIPE_DIR));
    spec_mounts.retain(|_| kept.next().unwrap_or(true));
    spec_mounts.push(gate_mount);

    let process = object_entry(root, "process", "process")?;
    let container = &request.container;
    let limits = container.limits;
    // What each CUDA process gets: the server holds it there under policy exact; the env says
    // it too, for frameworks that read it and for policy ceiling.
    let each = container.per_process();
    let ours = [
        format!("CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}"),
        format!("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={}", each.thread_percentage),
        format!(
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={}",
            each.mps_memory_env(container.key.gpu_uuids().len())
        ),
    ];
    // Only below normal: MPS's default needs no variable, and the pod's own was removed with
    // every CUDA_MPS_* it set (a courtesy, not a limit: a process can set it back).
    let priority = (!container.priority.is_normal())
        .then(|| format!("{PRIORITY_ENV}={}", container.priority.mps_value()));
    let narrowed = format!("{VISIBLE_DEVICES_ENV}={}", container.key.gpu_uuids().join(","));
    let new_env = env
        .into_iter()
        .filter(|e| !owned_env(e))
        .map(|e| {
            if request.narrow_visible_devices && is_visible_devices(&e) {
                narrowed.clone()
            } else {
                e
            }
        })
        .chain(ours)
        .chain(priority)
        .map(Value::String)
        .collect();
    *array_entry(process, "env", "process.env")? = new_env;

    let linux = object_entry(root, "linux", "linux")?;
    let spec_masked = array_entry(linux, "maskedPaths", "linux.maskedPaths")?;
    for path in MASKED_NVIDIA_SMI {
        if !masked.iter().any(|m| m == path) {
            spec_masked.push(Value::String(path.to_string()));
        }
    }

    let hooks = object_entry(root, "hooks", "hooks")?;
    push_once(
        array_entry(hooks, "createRuntime", "hooks.createRuntime")?,
        create_runtime,
    );
    push_once(array_entry(hooks, "poststop", "hooks.poststop")?, poststop);

    let annotations = object_entry(root, "annotations", "annotations")?;
    annotations.insert(DAEMON.to_string(), Value::String(container.key.dir_name()));
    let limits_text = if container.cuda_processes == 1 {
        limits.to_string()
    } else {
        format!(
            "{limits} in {} CUDA processes of {each}",
            container.cuda_processes
        )
    };
    annotations.insert(LIMITS.to_string(), Value::String(limits_text));

    Ok(acquire)
}

/// Sets every `NVIDIA_VISIBLE_DEVICES` entry of a container that got no GPU to `void`: its env
/// said `all` (a CUDA image's default), which nvidia-container-runtime after the shim would turn
/// into every GPU of the node, outside MPS. Nothing else of the spec changes.
pub fn void_visible_devices(spec: &mut Value) -> Result<(), RewriteError> {
    let env = spec_fields::env(spec)?;
    let voided = format!("{VISIBLE_DEVICES_ENV}=void");
    let new_env = env
        .into_iter()
        .map(|e| if is_visible_devices(&e) { voided.clone() } else { e })
        .map(Value::String)
        .collect();
    let root = root_object(spec)?;
    let process = object_entry(root, "process", "process")?;
    *array_entry(process, "env", "process.env")? = new_env;
    Ok(())
}

fn is_visible_devices(entry: &str) -> bool {
    entry
        .strip_prefix(VISIBLE_DEVICES_ENV)
        .is_some_and(|rest| rest.starts_with('='))
}

/// Whether an env entry is one the shim removes.
fn owned_env(entry: &str) -> bool {
    let name = entry.split_once('=').map_or(entry, |(name, _)| name);
    name.starts_with(MPS_ENV_PREFIX) || name == MAX_CONNECTIONS_ENV
}

fn gate_mount(gate_dir: &Path) -> Result<Value, RewriteError> {
    let build = |message: String| RewriteError::Build {
        what: "gate dir mount",
        message,
    };
    let mount = MountBuilder::default()
        .destination(CONTAINER_PIPE_DIR)
        .typ("bind")
        .source(gate_dir)
        .options(GATE_MOUNT_OPTIONS.map(String::from).to_vec())
        .build()
        .map_err(|e| build(e.to_string()))?;
    serde_json::to_value(mount).map_err(|e| build(e.to_string()))
}

fn hook(path: &Path, args: Vec<String>, timeout_seconds: u64) -> Result<Value, RewriteError> {
    let build = |message: String| RewriteError::Build {
        what: "hook",
        message,
    };
    let timeout = i64::try_from(timeout_seconds).map_err(|e| build(e.to_string()))?;
    let hook = HookBuilder::default()
        .path(PathBuf::from(path))
        .args(args)
        .timeout(timeout)
        .build()
        .map_err(|e| build(e.to_string()))?;
    serde_json::to_value(hook).map_err(|e| build(e.to_string()))
}

fn push_once(list: &mut Vec<Value>, item: Value) {
    if !list.contains(&item) {
        list.push(item);
    }
}

#[cfg(test)]
mod tests {
    use gpu_mps_api::{DaemonKey, Limits};
    use serde_json::json;

    use gpu_mps_api::container_request::{ClientPriority, ContainerRequest, Layout, PodIdentity};

    use super::*;

    const UUID: &str = "GPU-aaaaaaaa-1111-2222-3333-444444444444";

    fn request() -> ResolvedRequest {
        let config = NodeConfig::default();
        ResolvedRequest {
            container: ContainerRequest {
                key: DaemonKey::new([UUID]),
                limits: Limits {
                    memory_bytes: 4 << 30,
                    thread_percentage: 25,
                },
                cuda_processes: 1,
                identity: PodIdentity {
                    namespace: "ns".into(),
                    pod: "pod".into(),
                    container_name: "infer".into(),
                },
                memory_units: Vec::new(),
                priority: ClientPriority::Normal,
                layout: Layout {
                    policy: config.limits.policy.to_string(),
                    config_digest: config.digest(),
                },
            },
            gate_dir: "/run/gpu-mps/gates/0123456789abcdef".into(),
            narrow_visible_devices: false,
        }
    }

    fn spec() -> Value {
        json!({
            "ociVersion": "1.2.0",
            "process": {
                "user": { "uid": 1000, "gid": 1000 },
                "args": ["python"],
                "env": ["PATH=/bin", "CUDA_MPS_CLIENT_PRIORITY=0", "CUDA_DEVICE_MAX_CONNECTIONS=32",
                        "CUDA_MPS_PIPE_DIRECTORY=/elsewhere", "CUDA_VISIBLE_DEVICES=0", "NVIDIA_VISIBLE_DEVICES=0"],
                "capabilities": { "bounding": ["CAP_CHOWN"] }
            },
            "mounts": [
                { "destination": "/dev/shm", "type": "tmpfs", "source": "shm", "x-extra": 1 },
                { "destination": "/tmp/nvidia-mps/", "type": "bind", "source": "/tmp/nvidia-mps" },
                { "destination": "/data", "type": "bind", "source": "/srv/data" }
            ],
            "linux": { "namespaces": [{ "type": "ipc" }], "maskedPaths": ["/proc/kcore", "/bin/nvidia-smi"] }
        })
    }

    #[test]
    fn injects_exactly_the_contract() {
        let mut s = spec();
        let acquire = rewrite(&mut s, &request(), &NodeConfig::default()).unwrap();
        assert_eq!(acquire.request.key.gpu_uuids(), [UUID]);
        assert_eq!(acquire.socket, "/run/gpu-mps/manager.sock");
        assert_eq!(
            (
                acquire.request.identity.namespace.as_str(),
                acquire.request.identity.pod.as_str()
            ),
            ("ns", "pod")
        );
        assert_eq!(
            s["process"]["env"],
            json!([
                "PATH=/bin",
                "CUDA_VISIBLE_DEVICES=0",
                "NVIDIA_VISIBLE_DEVICES=0",
                "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M"
            ])
        );
        let mounts = s["mounts"].as_array().unwrap();
        assert_eq!(mounts.len(), 3);
        assert_eq!(mounts[0]["x-extra"], 1);
        assert_eq!(
            mounts[2],
            json!({
                "destination": "/tmp/nvidia-mps",
                "type": "bind",
                "source": "/run/gpu-mps/gates/0123456789abcdef",
                "options": ["rbind", "ro", "nosuid", "nodev", "noexec"]
            })
        );
        let masked = s["linux"]["maskedPaths"].as_array().unwrap();
        assert_eq!(masked.len(), 6, "{masked:?}");
        assert_eq!(masked.iter().filter(|m| *m == "/bin/nvidia-smi").count(), 1);
        assert_eq!(
            s["hooks"]["createRuntime"][0]["path"],
            "/usr/local/bin/gpu-mps-hook"
        );
        assert_eq!(s["hooks"]["createRuntime"][0]["timeout"], 15);
        assert_eq!(
            s["hooks"]["createRuntime"][0]["args"],
            json!(acquire.to_hook_args())
        );
        assert_eq!(
            s["hooks"]["poststop"][0]["args"],
            json!(release_hook_args(
                "/run/gpu-mps/manager.sock",
                10,
                Path::new("/run/gpu-mps/gates/0123456789abcdef")
            ))
        );
        assert_eq!(s["annotations"][DAEMON], UUID);
        assert_eq!(s["annotations"][LIMITS], "4Gi/25%");
        for unchanged in [
            "/process/user",
            "/process/capabilities",
            "/linux/namespaces",
            "/ociVersion",
        ] {
            assert_eq!(s.pointer(unchanged), spec().pointer(unchanged), "{unchanged}");
        }
    }

    #[test]
    fn one_memory_entry_per_gpu_of_the_daemon() {
        let mut r = request();
        r.container.key = DaemonKey::new([UUID, "GPU-bbbb"]);
        let mut s = spec();
        rewrite(&mut s, &r, &NodeConfig::default()).unwrap();
        let env = s["process"]["env"].as_array().unwrap();
        assert!(
            env.contains(&json!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M,1=4096M")),
            "{env:?}"
        );
        assert_eq!(s["annotations"][DAEMON], r.container.key.dir_name());
    }

    #[test]
    fn the_env_gives_each_process_its_share() {
        let mut r = request();
        r.container.cuda_processes = 4;
        let mut s = spec();
        let acquire = rewrite(&mut s, &r, &NodeConfig::default()).unwrap();
        assert_eq!(acquire.request.cuda_processes, 4);
        assert_eq!(
            acquire.request.limits, r.container.limits,
            "the manager gets the container's total"
        );
        let env = s["process"]["env"].as_array().unwrap();
        assert!(
            env.contains(&json!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1024M")),
            "{env:?}"
        );
        assert!(
            env.contains(&json!("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25")),
            "{env:?}"
        );
        assert_eq!(s["annotations"][LIMITS], "4Gi/25% in 4 CUDA processes of 1Gi/25%");
    }

    #[test]
    fn a_below_normal_container_gets_the_priority_variable_and_the_pods_own_is_gone() {
        let mut r = request();
        r.container.priority = ClientPriority::BelowNormal;
        let mut s = spec();
        s["process"]["env"]
            .as_array_mut()
            .unwrap()
            .push(json!("CUDA_MPS_CLIENT_PRIORITY=0"));
        let acquire = rewrite(&mut s, &r, &NodeConfig::default()).unwrap();
        let env = s["process"]["env"].as_array().unwrap();
        let priorities: Vec<_> = env
            .iter()
            .filter(|e| e.as_str().unwrap().starts_with("CUDA_MPS_CLIENT_PRIORITY="))
            .collect();
        assert_eq!(priorities, [&json!("CUDA_MPS_CLIENT_PRIORITY=1")]);
        assert!(
            acquire
                .to_hook_args()
                .contains(&"--priority=below-normal".to_string())
        );
        // Normal: no variable at all (MPS's default), as before priorities existed.
        let mut s = spec();
        rewrite(&mut s, &request(), &NodeConfig::default()).unwrap();
        let env = s["process"]["env"].as_array().unwrap();
        assert!(
            !env.iter()
                .any(|e| e.as_str().unwrap().starts_with("CUDA_MPS_CLIENT_PRIORITY")),
            "{env:?}"
        );
    }

    #[test]
    fn a_pod_written_visible_devices_is_narrowed_to_the_gpus_it_was_given() {
        let mut r = request();
        r.narrow_visible_devices = true;
        let mut s = spec();
        s["process"]["env"]
            .as_array_mut()
            .unwrap()
            .push(json!("NVIDIA_VISIBLE_DEVICES=all"));
        rewrite(&mut s, &r, &NodeConfig::default()).unwrap();
        let env = s["process"]["env"].as_array().unwrap();
        let visible: Vec<_> = env
            .iter()
            .filter(|e| e.as_str().unwrap().starts_with("NVIDIA_VISIBLE_DEVICES="))
            .collect();
        assert_eq!(visible, [&json!(format!("NVIDIA_VISIBLE_DEVICES={UUID}")); 2]);
        // Not narrowed: the env is left as the pod wrote it.
        let mut s = spec();
        rewrite(&mut s, &request(), &NodeConfig::default()).unwrap();
        assert!(
            s["process"]["env"]
                .as_array()
                .unwrap()
                .contains(&json!("NVIDIA_VISIBLE_DEVICES=0"))
        );
    }

    #[test]
    fn the_hook_carries_the_request_as_resolved_layout_included() {
        // The plan sets the layout from the node config (the golden files show it per case);
        // the rewrite hands on the request whole.
        let config = NodeConfig::default();
        let acquire = rewrite(&mut spec(), &request(), &config).unwrap();
        assert_eq!(acquire.request, request().container);
        assert_eq!(acquire.request.layout.policy, "exact");
        assert_eq!(acquire.request.layout.config_digest, config.digest());
    }

    #[test]
    fn rewriting_twice_changes_nothing_more() {
        let mut once = spec();
        rewrite(&mut once, &request(), &NodeConfig::default()).unwrap();
        let mut twice = once.clone();
        rewrite(&mut twice, &request(), &NodeConfig::default()).unwrap();
        assert_eq!(once, twice);
    }

    #[test]
    fn existing_hooks_are_kept() {
        let mut s = spec();
        s["hooks"] = json!({ "createRuntime": [{ "path": "/usr/bin/nvidia-ctk", "args": ["nvidia-ctk", "hook"] }],
                             "prestart": [{ "path": "/x" }] });
        rewrite(&mut s, &request(), &NodeConfig::default()).unwrap();
        assert_eq!(s["hooks"]["createRuntime"].as_array().unwrap().len(), 2);
        assert_eq!(s["hooks"]["createRuntime"][0]["path"], "/usr/bin/nvidia-ctk");
        assert_eq!(s["hooks"]["prestart"], json!([{ "path": "/x" }]));
    }

    #[test]
    fn a_malformed_spec_is_refused_untouched() {
        let cases = [
            (json!({ "process": { "env": "PATH=/bin" } }), "process.env"),
            (json!({ "process": {}, "mounts": {} }), "mounts"),
            (json!({ "process": {}, "hooks": { "poststop": {} } }), "hooks"),
            (
                json!({ "process": {}, "linux": { "maskedPaths": [1] } }),
                "linux.maskedPaths",
            ),
            (json!({ "process": {}, "linux": [] }), "linux"),
            (json!({ "process": {}, "annotations": [] }), "annotations"),
            (json!({ "mounts": [] }), "process"),
        ];
        for (input, field) in cases {
            let mut s = input.clone();
            let e = rewrite(&mut s, &request(), &NodeConfig::default())
                .unwrap_err()
                .to_string();
            assert!(e.contains(field), "{field}: {e}");
            assert_eq!(s, input, "{field}: changed on error");
        }
    }
}
