//! gpu-mps-manager: the node daemon of gpu-mps.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use gpu_mps_api::node_config::{self, NodeConfig};
use gpu_mps_manager::core::ManagerCore;
use gpu_mps_manager::gpu_backend::{FileBackend, GpuBackend, NvmlBackend};
use gpu_mps_manager::mps_control::CliControl;
use gpu_mps_manager::server;

/// gpu-mps-manager: runs one multi-user MPS control daemon per GPU set on demand, enforces each
/// pod's memory and SM limits on the MPS server, accounts GPU capacity, and serves the lease API
/// that gpu-mps-hook calls when a gpu-mps container is created and deleted.
///
/// It must run as root in the host PID namespace (systemd unit gpu-mps-manager.service, or the
/// hostPID DaemonSet). State lives under `root` (default /run/gpu-mps) and survives a restart:
/// running daemons and leases are adopted, running clients are never touched.
#[derive(Debug, Parser)]
#[command(version, about, long_about)]
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
}

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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    init_logging(&args.log_format);
    let config = load_config(&args.config)?;
    tracing::info!(version = env!("CARGO_PKG_VERSION"), config = %args.config.display(), root = %config.root.display(), "gpu-mps-manager starting");
    let backend: Arc<dyn GpuBackend> = match &args.fake_inventory {
        Some(path) => {
            tracing::warn!(path = %path.display(), "TEST ONLY: GPU inventory from a file, no NVML; never use this on a real node");
            Arc::new(FileBackend::new(path))
        }
        None => Arc::new(NvmlBackend::init()?),
    };
    let control = Arc::new(CliControl {
        binary: config.control_binary.clone(),
        timeout: Duration::from_secs(config.start_timeout_seconds),
    });
    let socket = config.manager_socket();
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir)?;
    }
    server::claim_socket(&socket)?;
    let core = Arc::new(ManagerCore::start(config, control, backend).await?);
    server::serve(core, &socket).await?;
    Ok(())
}
