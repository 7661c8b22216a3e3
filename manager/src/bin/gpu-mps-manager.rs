//! gpu-mps-manager: the node daemon of gpu-mps.

use std::collections::HashMap;
use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use gpu_mps_api::message::error_chain_line;
use gpu_mps_api::node_config::{self, NodeConfig};
use gpu_mps_gate_keeper::{self as gate_keeper, KeeperClient};
use gpu_mps_manager::core::{ManagerCore, StartOptions};
use gpu_mps_manager::gate::ListenerStore;
use gpu_mps_manager::gpu_backend::{self, FileBackend, GpuBackend, NvmlBackend};
use gpu_mps_manager::metrics::{self, Exposition, LevelSource, Metrics};
use gpu_mps_manager::mps_control::CliControl;
use gpu_mps_manager::{node_guard, server};

/// gpu-mps-manager: runs one multi-user MPS control daemon per GPU set on demand, enforces each
/// pod's memory and SM limits on the MPS server, accounts GPU capacity, and serves the lease API
/// that gpu-mps-hook calls when a gpu-mps container is created and deleted.
///
/// It must run as root in the host PID namespace (systemd unit gpu-mps-manager.service, or the
/// hostPID DaemonSet). State lives under `root` (default /run/gpu-mps) and survives a restart:
/// running daemons and leases are adopted, running clients are never touched.
#[derive(Debug, Parser)]
#[command(version, about, long_about, after_help = EXAMPLE)]
struct Args {
    /// Node config file.
    #[arg(long, env = node_config::CONFIG_ENV, default_value = node_config::DEFAULT_CONFIG_PATH)]
    config: PathBuf,
    /// Log format: text or json.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    /// TEST ONLY: take the GPU inventory from this JSON file instead of NVML, for machines
    /// without a GPU (CI). Compute mode changes then only happen in memory.
    #[arg(long, hide = true)]
    fake_inventory: Option<PathBuf>,
    /// Internal: run as the gate keeper of this state root (the manager starts it itself).
    #[arg(long, hide = true, value_name = "ROOT")]
    gate_keeper: Option<PathBuf>,
    /// Internal: where the gate keeper writes its error lines (default: its stderr, which is
    /// /dev/null when the manager starts it).
    #[arg(long, hide = true, value_name = "FILE", requires = "gate_keeper")]
    gate_keeper_log: Option<PathBuf>,
}

const EXAMPLE: &str = "\
Examples:
  gpu-mps-manager --config /etc/gpu-mps/config.toml         (what gpu-mps-manager.service runs)
  GPU_MPS_LOG=debug gpu-mps-manager --log-format json       (every lease and refusal, as JSON)
Then `gpu-mps status` shows its GPUs, daemons and leases.";

fn init_logging(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("GPU_MPS_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only on a terminal: journald and log files get plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}

fn load_config(path: &Path) -> anyhow::Result<NodeConfig> {
    if !path.exists() {
        tracing::warn!(path = %path.display(), "no config file: built-in defaults (containers must then set both limits)");
    }
    Ok(NodeConfig::load(path)?)
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line, each cause once, for the journal and `kubectl logs` (anyhow's default
            // `Error: ... Caused by:` repeated causes our messages already carry).
            eprintln!("gpu-mps-manager: {}", error_chain_line(e.chain()));
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    if let Some(root) = &args.gate_keeper {
        // Before any thread exists: the keeper blocks SIGHUP on the calling thread only.
        gate_keeper::run_keeper(root, args.gate_keeper_log.as_deref())?;
        return Ok(());
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(manager(args))
}

async fn manager(args: Args) -> anyhow::Result<()> {
    init_logging(&args.log_format);
    let config = load_config(&args.config)?;
    tracing::info!(version = env!("CARGO_PKG_VERSION"), config = %args.config.display(), root = %config.root.display(), "gpu-mps-manager starting");
    // Before anything under the root is touched: two managers would both start daemons.
    let _root_lock = node_guard::lock_root(&config.root)?;
    let limit = node_guard::raise_descriptor_limit(config.gate.max_connections)?;
    if limit.now < limit.wanted {
        tracing::warn!(
            limit = limit.now,
            wanted = limit.wanted,
            "the open-file limit is below what [gate] max_connections may need: raise LimitNOFILE, or lower max_connections"
        );
    } else {
        tracing::info!(before = limit.before, now = limit.now, "open-file limit");
    }
    // Bound now, served once the core runs: a port in use is said next to the config it
    // comes from. Without `[metrics] listen` no port is opened at all.
    let metrics_listener = match config.metrics.listen {
        Some(address) => metrics::http::bind(address)
            .await
            .inspect_err(|e| tracing::error!("{e}"))
            .ok(),
        None => None,
    };
    let metrics = Metrics::default();
    // After the limit is raised (the keeper inherits it), before NVML opens device files.
    let (keeper, inherited_gates) = start_gate_keeper(&config.root).await;
    let backend: Arc<dyn GpuBackend> = match &args.fake_inventory {
        Some(path) => {
            tracing::warn!(path = %path.display(), "TEST ONLY: GPU inventory from a file, no NVML; never use this on a real node");
            Arc::new(FileBackend::new(path))
        }
        None => match NvmlBackend::init() {
            Ok(nvml) => {
                if let Err(e) = gpu_backend::clear_nvml_failure(&config.root) {
                    tracing::warn!(error = %e, "removing the NVML error an earlier start left");
                }
                Arc::new(nvml)
            }
            Err(e) => {
                // The shim tells GPU pods this instead of "the manager is not running".
                if let Err(io) = gpu_backend::record_nvml_failure(&config.root, &e) {
                    tracing::warn!(error = %io, "recording the NVML error for the shim");
                }
                // A keeper this start made holds no gate: it goes with the manager.
                if let Some(keeper) = keeper {
                    let _ = tokio::task::spawn_blocking(move || keeper.quit_if_empty()).await;
                }
                return Err(e.into());
            }
        },
    };
    let control = Arc::new(CliControl {
        binary: config.daemon.control_binary.clone(),
        timeout: Duration::from_secs(config.daemon.start_timeout_seconds),
    });
    let socket = config.manager_socket();
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir)?;
    }
    server::claim_socket(&socket)?;
    let options = StartOptions {
        config_source: args.config.clone(),
        inherited_gates,
        listener_store: keeper.clone().map(|k| k as Arc<dyn ListenerStore>),
        metrics: metrics.clone(),
    };
    let core = Arc::new(ManagerCore::start_with(config, control, backend, options).await?);
    if let Some(listener) = metrics_listener {
        let source: Arc<dyn LevelSource> = core.clone();
        let exposition = Arc::new(Exposition::new(&metrics, Arc::downgrade(&source)));
        tokio::spawn(metrics::http::serve(listener, exposition));
    }
    server::serve(core, &socket).await?;
    // With no gate left to keep (every lease released), the keeper has nothing to do until the
    // next manager starts one.
    if let Some(keeper) = keeper {
        match tokio::task::spawn_blocking(move || keeper.quit_if_empty()).await {
            Ok(Ok(true)) => tracing::info!("gate keeper stopped: no gate left"),
            Ok(Ok(false)) => {
                tracing::info!("gate keeper left running: it holds the gates of running containers")
            }
            Ok(Err(e)) => tracing::warn!(error = %e, "gate keeper"),
            Err(e) => tracing::warn!(error = %e, "gate keeper"),
        }
    }
    Ok(())
}

/// Finds or starts the gate keeper and takes back the listening sockets a previous manager left
/// with it. Never fatal: without a keeper the gates work; only a restart leaves them unserved.
async fn start_gate_keeper(root: &Path) -> (Option<Arc<KeeperClient>>, HashMap<String, OwnedFd>) {
    let root = root.to_path_buf();
    let found = tokio::task::spawn_blocking(move || {
        let exe = std::env::current_exe()?;
        let keeper_args = [OsString::from("--gate-keeper"), root.clone().into_os_string()];
        let keeper = KeeperClient::connect_or_spawn(&root, &exe, &keeper_args)?;
        let pid = keeper.ping()?;
        let version = keeper.protocol_version()?;
        let held = keeper.take()?;
        anyhow::Ok((keeper, pid, version, held))
    })
    .await
    .map_err(anyhow::Error::from)
    .and_then(|found| found);
    let (keeper, pid, version, held) = match found {
        Ok(found) => found,
        Err(e) => {
            tracing::error!(error = %e, "no gate keeper: while this manager restarts, its gates will not listen");
            return (None, HashMap::new());
        }
    };
    let inherited: HashMap<String, OwnedFd> = held.into_iter().map(|held| (held.name, held.fd)).collect();
    // A keeper outlives upgrades: the one found may be older than this manager.
    tracing::info!(
        pid,
        protocol_version = version,
        inherited = inherited.len(),
        "gate keeper"
    );
    (Some(Arc::new(keeper)), inherited)
}
