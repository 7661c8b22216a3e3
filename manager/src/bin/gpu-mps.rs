//! gpu-mps: the command line of a gpu-mps node.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use gpu_mps_api::client::ManagerConnection;
use gpu_mps_api::node_config::{self, NodeConfig};
use gpu_mps_manager::status_view::StatusView;

/// gpu-mps: inspect a gpu-mps node. `status` shows GPUs, MPS daemons and leases as the
/// manager sees them; `explain` shows how gpu-mps-shim would rewrite a container's bundle.
#[derive(Debug, Parser)]
#[command(version, about, long_about)]
struct Args {
    /// Node config file (for the manager's socket and root).
    #[arg(long, global = true, env = node_config::CONFIG_ENV, default_value = node_config::DEFAULT_CONFIG_PATH)]
    config: PathBuf,
    /// The manager's socket (default: <root>/manager.sock from the config).
    #[arg(long, global = true)]
    socket: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// GPUs, daemons and leases.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// MPS control daemons: state, pids, limits on their servers, leases.
    Daemons {
        #[arg(long)]
        json: bool,
    },
    /// Leases: which container holds which daemon with which limits.
    Leases {
        #[arg(long)]
        json: bool,
    },
}

fn load_config(path: &PathBuf) -> anyhow::Result<NodeConfig> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(NodeConfig::from_toml(&text, path)?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(NodeConfig::default()),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

fn status(args: &Args, config: &NodeConfig) -> anyhow::Result<StatusView> {
    let socket = args.socket.clone().unwrap_or_else(|| config.manager_socket());
    let conn = ManagerConnection::connect(&socket, Duration::from_secs(5))?;
    Ok(StatusView::from(&conn.status()?))
}

fn run(args: Args) -> anyhow::Result<()> {
    let config = load_config(&args.config)?;
    match &args.command {
        Command::Status { json } => {
            let view = status(&args, &config)?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&view)?);
            } else {
                print!("{}", view.summary());
            }
        }
        Command::Daemons { json } => {
            let view = status(&args, &config)?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&view.daemons)?);
            } else {
                print!("{}", view.daemons_table());
            }
        }
        Command::Leases { json } => {
            let view = status(&args, &config)?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&view.leases)?);
            } else {
                print!("{}", view.leases_table());
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu-mps: {e:#}");
            ExitCode::FAILURE
        }
    }
}
