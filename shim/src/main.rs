//! gpu-mps-shim: containerd runs it exactly like runc. `create` rewrites the bundle's
//! config.json for a GPU container, then every subcommand execs the real runc with the same
//! arguments, so runc's pid, signals and exit code are the caller's.

use std::ffi::OsString;
use std::fmt::Display;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::SystemTime;

use gpu_mps_api::message::without_os_error_numbers;
use gpu_mps_api::node_config::config_path_from_env;
use gpu_mps_shim::runc_args::{self, CreateArgs, GlobalOptions, Invocation, LogFormat, Subcommand};
use gpu_mps_shim::{DEBUG_ENV, MESSAGE_PREFIX, ShimError, bundle, node_files, parse_spec, runc_log};

const HELP: &str = "\
gpu-mps-shim: an OCI runtime in front of runc that puts GPU containers on NVIDIA MPS, so that
pods share a GPU with memory and SM limits they cannot escape.

containerd runs it exactly like runc. On `create` it reads <bundle>/config.json; for a container
that got a GPU (a /dev/nvidiaN device, a CDI annotation of kind nvidia.com/gpu or
k8s.device-plugin.nvidia.com/gpu, the toolkit's volume-mounts list; NVIDIA_VISIBLE_DEVICES only
where the node config sets [gpus] trust_visible_devices_env) it mounts the container's gate dir at
/tmp/nvidia-mps and adds CUDA_MPS_* env, masked nvidia-smi and the gpu-mps-hook hooks, then runs
the real runc with the same arguments. Other containers and every other subcommand go to runc
untouched (one whose env says NVIDIA_VISIBLE_DEVICES=all without a GPU gets it set to void).

Register it as a runtime handler of containerd's runc shim, e.g. (config version 2):
  [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.gpu-mps]
    runtime_type = \"io.containerd.runc.v2\"
    pod_annotations = [\"gpu-mps.io/*\", \"*.gpu-mps.io/*\"]
    container_annotations = [\"gpu-mps.io/*\", \"*.gpu-mps.io/*\", \"cdi.k8s.io/*\", \"gpu-mps-device-plugin/*\"]
    [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.gpu-mps.options]
      BinaryName = \"/usr/local/bin/gpu-mps-shim\"
(config version 3: plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes.gpu-mps), and run
pods with runtimeClassName: gpu-mps.

Example (by hand, through ctr):
  ctr run --runc-binary /usr/local/bin/gpu-mps-shim --annotation cdi.k8s.io/demo=nvidia.com/gpu=0 \\
    --annotation gpu-mps.io/memory-limit=4Gi docker.io/library/debian:12 demo env

Limits: pod annotations gpu-mps.io/memory-limit (e.g. 4Gi, the total of the container's CUDA
processes), gpu-mps.io/active-thread-percentage (1-100) and gpu-mps.io/cuda-processes (1-48),
<container-name>.gpu-mps.io/... for one container, else the node default.
Node config: the one gpu-mps-manager published (<root>/node-config.json), else /etc/gpu-mps/config.toml
(or $GPU_MPS_CONFIG); runc_path there names the real runc.
Debug: GPU_MPS_SHIM_DEBUG=1 or runc's --debug logs what the shim does to runc's --log file
(<bundle>/log.json under containerd), or to stderr when runc was given no --log.
";

fn main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let env_debug = std::env::var_os(DEBUG_ENV).is_some_and(|v| !v.is_empty() && v != "0");
    let config_path = config_path_from_env();
    match runc_args::parse(&args) {
        Ok(Invocation::Help) => {
            print!("{HELP}");
            ExitCode::SUCCESS
        }
        Ok(Invocation::Version) => {
            let reporter = Reporter::new(&GlobalOptions::default(), env_debug);
            println!("gpu-mps-shim version {}", env!("CARGO_PKG_VERSION"));
            let _ = std::io::stdout().flush();
            let (runc, note) = node_files::runc_path(&config_path);
            // Its own version is said; runc's follows when runc runs. A runc that cannot is
            // said on stderr, and the version query still succeeds: it asked for the version.
            let e = exec_runc(&runc, &args, &config_path, note, &reporter);
            eprintln!(
                "{MESSAGE_PREFIX}{} (runc's version is not shown)",
                without_os_error_numbers(&e.to_string())
            );
            ExitCode::SUCCESS
        }
        Ok(Invocation::Runc(runc_args)) => {
            let reporter = Reporter::new(&runc_args.global, env_debug);
            let (runc, note) = match &runc_args.subcommand {
                Subcommand::Create(create) => match prepare_create(create, &config_path, &reporter) {
                    Ok(runc) => runc,
                    Err(e) => return reporter.fail(e),
                },
                Subcommand::Other(name) => {
                    if name.as_deref() == Some("delete") {
                        remove_unserved_gate_dir(&args, &config_path, &reporter);
                    }
                    node_files::runc_path(&config_path)
                }
            };
            reporter.fail(exec_runc(&runc, &args, &config_path, note, &reporter))
        }
        Err(e) => Reporter::new(&e.global, env_debug).fail(e.into()),
    }
}

/// Rewrites the bundle's config.json when the container got a GPU; returns the runc to exec.
/// The node config and inventory are only read for a GPU container.
fn prepare_create(
    create: &CreateArgs,
    config_path: &Path,
    reporter: &Reporter,
) -> Result<(PathBuf, Option<String>), ShimError> {
    let bundle = match &create.bundle {
        Some(bundle) => bundle.clone(),
        None => std::env::current_dir().map_err(ShimError::CurrentDir)?,
    };
    let id = create.container_id.as_deref().unwrap_or("");
    let parsed = parse_spec(&bundle::read_config(&bundle)?)?;
    if let Some(reason) = parsed.passthrough_reason() {
        reporter.debug(format_args!(
            "create {id} (bundle {}): {reason}",
            bundle.display()
        ));
        return Ok(node_files::runc_path(config_path));
    }
    let (config, origin) = node_files::load_effective_config(config_path)?;
    reporter.debug(format_args!("create {id}: node config {origin}"));
    let parsed = parsed.judge_env(&config)?;
    if let Some(reason) = parsed.passthrough_reason() {
        if let Some(text) = parsed.passthrough_spec()? {
            bundle::write_config_atomically(&bundle, &text)?;
        }
        reporter.debug(format_args!(
            "create {id} (bundle {}): {reason}",
            bundle.display()
        ));
        return Ok((config.runc_path, None));
    }
    let inventory = node_files::load_inventory(&config.inventory_path())?;
    let plan = parsed.plan(&config, &inventory, id)?;
    if let (Some(text), Some(gate_dir)) = (&plan.rewritten, &plan.gate_dir) {
        // runc bind-mounts the gate dir before the createRuntime hook runs; the manager binds
        // the gate's `control` socket in it at the Acquire that hook asks for.
        bundle::create_gate_dir(gate_dir)?;
        bundle::write_config_atomically(&bundle, text)?;
        reporter.debug(format_args!(
            "create {id} (bundle {}): {}; gate dir {} ready",
            bundle.display(),
            plan.reason,
            gate_dir.display()
        ));
    }
    Ok((config.runc_path, None))
}

/// A container whose create ended before its createRuntime hook got a lease (its runtime
/// killed, runc failing, the hook refused) leaves the gate dir this shim made for it: no
/// Acquire comes to serve it and no poststop hook to release it. On its `delete` (the last
/// argument is the container id) a gate dir nobody serves goes; a served one is the manager's
/// to remove at release. Anything unexpected leaves the dir: runc's delete must go on.
fn remove_unserved_gate_dir(args: &[OsString], config_path: &Path, reporter: &Reporter) {
    let Some(id) = args
        .last()
        .and_then(|a| a.to_str())
        .and_then(|a| gpu_mps_api::ContainerId::parse(a).ok())
    else {
        return;
    };
    let Ok((config, _)) = node_files::load_effective_config(config_path) else {
        return;
    };
    let dir = config.gate_dir(&id);
    match bundle::remove_unserved_gate_dir(&dir) {
        Ok(true) => reporter.debug(format_args!(
            "delete {id}: removed its gate dir {}, which no lease served",
            dir.display()
        )),
        Ok(false) => {}
        Err(e) => reporter.debug(format_args!(
            "delete {id}: its gate dir {} stays: {e}",
            dir.display()
        )),
    }
}

/// Replaces this process with runc; returns only if that failed.
fn exec_runc(
    runc: &Path,
    args: &[OsString],
    config: &Path,
    note: Option<String>,
    reporter: &Reporter,
) -> ShimError {
    reporter.debug(format_args!("exec {} {}", runc.display(), shell_words(args)));
    let source = Command::new(runc).args(args).exec();
    ShimError::Exec {
        path: runc.to_path_buf(),
        source,
        config: config.to_path_buf(),
        note: note
            .map(|n| format!("; default used because {n}"))
            .unwrap_or_default(),
    }
}

fn shell_words(args: &[OsString]) -> String {
    args.iter()
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Where the shim's messages go: errors to runc's `--log` file (which containerd reads back)
/// and stderr, debug lines to the `--log` file (stderr without one).
struct Reporter {
    log: Option<PathBuf>,
    format: LogFormat,
    debug: bool,
}

impl Reporter {
    fn new(global: &GlobalOptions, env_debug: bool) -> Self {
        Reporter {
            log: global.log.clone(),
            format: global.log_format,
            debug: global.debug || env_debug,
        }
    }

    /// To runc's `--log` file when there is one: runc's stderr on `create` is the container's
    /// own, so a debug line there would land, host paths and all, in the container's log.
    /// Without `--log` (a run by hand), to stderr.
    fn debug(&self, message: impl Display) {
        if !self.debug {
            return;
        }
        let line = format!("gpu-mps-shim: {message}");
        match &self.log {
            Some(log) => {
                // A log that cannot be written loses the debug line, never the container.
                let _ = runc_log::append_debug(log, self.format, &line, SystemTime::now());
            }
            None => eprintln!("{line}"),
        }
    }

    /// Reports `error` as one line and gives the exit code, 1 like runc's own failures.
    fn fail(&self, error: ShimError) -> ExitCode {
        let message =
            without_os_error_numbers(&format!("{MESSAGE_PREFIX}{error}")).replace(['\r', '\n'], " ");
        if let Some(log) = &self.log {
            if let Err(e) = runc_log::append_error(log, self.format, &message, SystemTime::now()) {
                eprintln!("gpu-mps-shim: cannot write the runc log {}: {e}", log.display());
            }
        }
        eprintln!("{message}");
        ExitCode::from(1)
    }
}
