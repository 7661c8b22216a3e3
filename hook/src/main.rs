//! gpu-mps-hook: the OCI hook gpu-mps-shim installs in GPU containers.
//!
//! createRuntime: check that the container's /tmp/nvidia-mps is its gate (no prestart hook
//! mounted over it, see gate_mount), then lease the container's MPS daemon from
//! gpu-mps-manager (the manager starts it on demand and sets the pod's limits on its server). A
//! refusal fails the container create with ONE line on stderr, which runc passes up to
//! containerd and the CRI caller.
//! poststop: release the lease. Never fails: a delete must go through, and the manager drops
//! leases of dead containers on its own. A container whose gate was never opened (its create
//! failed before the manager leased it, e.g. with the manager down) holds no lease: its empty
//! gate dir is removed and the manager is not asked, so a down manager costs a create one hook
//! timeout, not two.

mod gate_mount;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use gpu_mps_api::client::{ClientError, ManagerConnection};
use gpu_mps_api::hook_invocation::RequestArgs;
use gpu_mps_api::message::without_os_error_numbers;
use gpu_mps_api::node_config::GATE_SOCKET;
use thiserror::Error;

/// gpu-mps-hook: leases an MPS daemon from gpu-mps-manager for a container (createRuntime)
/// and releases it (poststop). runc runs it with the container's OCI state on stdin; gpu-mps-shim
/// writes its arguments into the container's config.json. Not meant to be run by hand.
#[derive(Debug, Parser)]
#[command(version, about, long_about, after_help = EXAMPLE)]
struct Args {
    #[command(subcommand)]
    stage: Stage,
}

// Each example is written once: the top-level help shows both, each subcommand's its own.
macro_rules! create_runtime_example {
    () => {
        "  gpu-mps-hook create-runtime --socket=/run/gpu-mps/manager.sock --timeout-seconds=10 \\
    --gpus=GPU-9e2f7c3d-0b4a-41e6-8d5c-2a7b9f1e3d02 --memory-limit-bytes=4294967296 \\
    --active-thread-percentage=25 --namespace=team-a --pod=infer --container-name=infer"
    };
}
macro_rules! poststop_example {
    () => {
        "  gpu-mps-hook poststop --socket=/run/gpu-mps/manager.sock --gate-dir=/run/gpu-mps/gates/4844287073c56bf2"
    };
}

const EXAMPLE: &str = concat!(
    "Example (what gpu-mps-shim writes into config.json, and runc runs with the OCI state on stdin):\n",
    create_runtime_example!(),
    "\n",
    poststop_example!()
);
const CREATE_RUNTIME_EXAMPLE: &str = concat!(
    "Example (runc runs it with the container's OCI state on stdin):\n",
    create_runtime_example!()
);
const POSTSTOP_EXAMPLE: &str = concat!(
    "Example (runc runs it with the container's OCI state on stdin):\n",
    poststop_example!()
);

#[derive(Debug, Subcommand)]
enum Stage {
    /// Acquire the lease (OCI createRuntime hook).
    #[command(after_help = CREATE_RUNTIME_EXAMPLE)]
    CreateRuntime {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        request: RequestArgs,
    },
    /// Release the lease (OCI poststop hook).
    #[command(after_help = POSTSTOP_EXAMPLE)]
    Poststop {
        #[command(flatten)]
        common: Common,
        /// The container's gate dir; without its socket no lease was made.
        #[arg(long)]
        gate_dir: Option<PathBuf>,
    },
}

#[derive(Debug, clap::Args)]
struct Common {
    /// The manager's socket.
    #[arg(long, default_value = "/run/gpu-mps/manager.sock")]
    socket: PathBuf,
    /// Upper bound for reaching the manager and getting its answer.
    #[arg(long, default_value_t = 10)]
    timeout_seconds: u64,
}

#[derive(Debug, Error)]
enum HookError {
    #[error("reading the OCI state from stdin: {0}")]
    Stdin(std::io::Error),
    #[error("the OCI state on stdin is not valid: {0}")]
    State(String),
    #[error(
        "the OCI state of container {0} has no pid: a lease needs the container's process (runc passes it to createRuntime hooks)"
    )]
    NoPid(String),
    #[error("{0}")]
    GateMount(#[from] gate_mount::GateMountError),
    #[error("{0}")]
    Manager(#[from] ClientError),
}

/// The fields of the OCI state runc passes to hooks that the hook needs.
#[derive(Debug, PartialEq)]
struct ContainerState {
    id: String,
    pid: u32,
    bundle: String,
}

fn parse_state(text: &str) -> Result<ContainerState, HookError> {
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| HookError::State(e.to_string()))?;
    let id = v.get("id").and_then(|x| x.as_str()).filter(|s| !s.is_empty());
    let Some(id) = id else {
        return Err(HookError::State("no container id".into()));
    };
    Ok(ContainerState {
        id: id.to_string(),
        pid: v.get("pid").and_then(|x| x.as_u64()).unwrap_or(0) as u32,
        bundle: v.get("bundle").and_then(|x| x.as_str()).unwrap_or("").to_string(),
    })
}

fn read_state() -> Result<ContainerState, HookError> {
    let mut text = String::new();
    std::io::stdin()
        .read_to_string(&mut text)
        .map_err(HookError::Stdin)?;
    parse_state(&text)
}

fn run(args: Args) -> Result<(), HookError> {
    match args.stage {
        Stage::CreateRuntime { common, request } => {
            let state = read_state()?;
            // A lease is dropped once its container's process is gone; without a pid it could
            // never be, and would hold its GPU memory forever.
            if state.pid == 0 {
                return Err(HookError::NoPid(state.id));
            }
            // Before the lease: a container refused here never held a daemon.
            gate_mount::verify(&state.id, Path::new(&state.bundle), state.pid)?;
            let req = request.to_acquire_request(&state.id, state.pid, &state.bundle);
            let conn =
                ManagerConnection::connect(&common.socket, Duration::from_secs(common.timeout_seconds))?;
            conn.acquire(&req)?;
            Ok(())
        }
        Stage::Poststop { common, gate_dir } => release(&common, gate_dir.as_deref(), &read_state()?.id),
    }
}

/// Releases the container's lease, if it got one.
fn release(common: &Common, gate_dir: Option<&Path>, container_id: &str) -> Result<(), HookError> {
    if let Some(gate_dir) = gate_dir.filter(|dir| !dir.join(GATE_SOCKET).exists()) {
        remove_unused_gate_dir(gate_dir);
        return Ok(());
    }
    let conn = ManagerConnection::connect(&common.socket, Duration::from_secs(common.timeout_seconds))?;
    conn.release(container_id)?;
    Ok(())
}

/// Removes a gate dir the manager never served: only while it is empty, so nothing the manager
/// put there is ever removed from under it.
fn remove_unused_gate_dir(dir: &Path) {
    match std::fs::remove_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => eprintln!(
            "gpu-mps: warning: the unused gate dir {} stays: {e}",
            dir.display()
        ),
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let poststop = matches!(args.stage, Stage::Poststop { .. });
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if poststop => {
            eprintln!(
                "gpu-mps: warning: releasing the lease failed: {} (the manager drops it once the container is gone)",
                without_os_error_numbers(&e.to_string())
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gpu-mps: {}", without_os_error_numbers(&e.to_string()));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use gpu_mps_api::container_request::{ClientPriority, ContainerRequest, Layout, PodIdentity};
    use gpu_mps_api::hook_invocation::{AcquireArgs, release_hook_args};
    use gpu_mps_api::{DaemonKey, Limits};

    use super::*;

    #[test]
    fn parses_the_args_the_shim_writes() {
        let request = ContainerRequest {
            key: DaemonKey::new(["GPU-a", "GPU-b"]),
            limits: Limits {
                memory_bytes: 4 << 30,
                thread_percentage: 25,
            },
            cuda_processes: 3,
            identity: PodIdentity {
                namespace: "team".into(),
                pod: "p".into(),
                container_name: "c".into(),
            },
            memory_units: vec![3, 4, 10],
            priority: ClientPriority::BelowNormal,
            layout: Layout {
                policy: "exact".into(),
                config_digest: "0123456789abcdef".into(),
            },
        };
        let args = AcquireArgs {
            socket: "/run/x/manager.sock".into(),
            timeout_seconds: 7,
            request: request.clone(),
        };
        let parsed = Args::try_parse_from(args.to_hook_args()).unwrap();
        match parsed.stage {
            Stage::CreateRuntime {
                common,
                request: args,
            } => {
                assert_eq!(common.socket, PathBuf::from("/run/x/manager.sock"));
                assert_eq!(common.timeout_seconds, 7);
                let req = args.to_acquire_request("c1", 42, "/bundle");
                assert_eq!(
                    (req.container_id.as_str(), req.pid, req.bundle.as_str()),
                    ("c1", 42, "/bundle")
                );
                assert_eq!(ContainerRequest::from_acquire_request(&req).unwrap(), request);
            }
            other => panic!("{other:?}"),
        }
        let parsed = Args::try_parse_from(release_hook_args(
            "/run/x/manager.sock",
            3,
            Path::new("/run/x/gates/abc"),
        ))
        .unwrap();
        match parsed.stage {
            Stage::Poststop { common, gate_dir } => {
                assert_eq!(common.timeout_seconds, 3);
                assert_eq!(gate_dir, Some(PathBuf::from("/run/x/gates/abc")));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_container_whose_gate_never_opened_is_released_without_the_manager() {
        let dir = tempfile::tempdir().unwrap();
        let patient = Common {
            socket: dir.path().join("down.sock"),
            timeout_seconds: 60,
        };
        let gate = dir.path().join("gates").join("abc");
        std::fs::create_dir_all(&gate).unwrap();
        let start = std::time::Instant::now();
        release(&patient, Some(&gate), "abc").unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the down manager was not waited for"
        );
        assert!(!gate.exists(), "the empty gate dir is removed");
        // A gate the manager opened: the manager is asked (here it is down, so that fails).
        let common = Common {
            socket: dir.path().join("down.sock"),
            timeout_seconds: 1,
        };
        std::fs::create_dir_all(&gate).unwrap();
        std::fs::write(gate.join(GATE_SOCKET), "").unwrap();
        let err = release(&common, Some(&gate), "abc").unwrap_err();
        assert!(err.to_string().contains("down.sock"), "{err}");
        assert!(
            gate.join(GATE_SOCKET).exists(),
            "a served gate dir is left to the manager"
        );
        // Not empty: left as it is.
        std::fs::remove_file(gate.join(GATE_SOCKET)).unwrap();
        std::fs::write(gate.join("other"), "").unwrap();
        release(&common, Some(&gate), "abc").unwrap();
        assert!(gate.join("other").exists());
    }

    #[test]
    fn empty_ctr_fields_parse() {
        let limits = Limits {
            memory_bytes: 1 << 30,
            thread_percentage: 5,
        };
        let args = AcquireArgs {
            socket: "/s".into(),
            timeout_seconds: 1,
            request: ContainerRequest::for_test(&["GPU-a"], limits, ""),
        };
        assert!(Args::try_parse_from(args.to_hook_args()).is_ok());
    }

    #[test]
    fn reads_the_oci_state() {
        let s = parse_state(r#"{"ociVersion":"1.0.2","id":"abc","status":"creating","pid":42,"bundle":"/b","annotations":{}}"#)
            .unwrap();
        assert_eq!(
            s,
            ContainerState {
                id: "abc".into(),
                pid: 42,
                bundle: "/b".into()
            }
        );
        assert!(parse_state("{}").is_err());
        assert_eq!(
            parse_state(r#"{"id":"abc"}"#).unwrap().pid,
            0,
            "pid 0 is refused at acquire"
        );
        assert!(parse_state("nope").is_err());
    }

    #[test]
    fn an_unreachable_manager_fails_within_the_budget() {
        let dir = tempfile::tempdir().unwrap();
        let start = std::time::Instant::now();
        let err = ManagerConnection::connect(&dir.path().join("none.sock"), Duration::from_secs(1))
            .err()
            .unwrap();
        assert!(start.elapsed() < Duration::from_secs(3));
        let msg = err.to_string();
        assert!(
            msg.contains("cannot reach gpu-mps-manager") && msg.contains("none.sock"),
            "{msg}"
        );
    }
}
