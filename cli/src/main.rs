//! gpu-mps: the command line of a gpu-mps node.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use std::path::Path;

use anyhow::Context;
use clap::{Parser, Subcommand};
use gpu_mps_api::client::ManagerConnection;
use gpu_mps_api::message::error_chain_line;
use gpu_mps_api::node_config::{self, NodeConfig};
use gpu_mps_api::status_view::StatusView;
use gpu_mps_cli::containerd_registration as reg;
use gpu_mps_cli::doctor;
use gpu_mps_cli::explain::explain_rewrite;
use gpu_mps_cli::installed;
use gpu_mps_cli::live_leases;
use gpu_mps_cli::remove_state;
use gpu_mps_shim::node_files::load_inventory;

#[derive(Debug, clap::Args)]
struct RegistrationArgs {
    /// containerd's main config file.
    #[arg(long = "containerd-config", default_value = reg::MAIN_CONFIG)]
    main_config: PathBuf,
    /// The drop-in file (used on containerd 2.x). Default: /etc/containerd/conf.d/gpu-mps.toml,
    /// or conf.d/gpu-mps.toml next to a --containerd-config other than the system's.
    #[arg(long)]
    drop_in: Option<PathBuf>,
    /// The gpu-mps-shim binary the runtime entry points at (default: the one next to this
    /// gpu-mps, /usr/bin from the Debian package, /usr/local/bin from the DaemonSet).
    #[arg(long, default_value_os_t = installed::default_shim_path())]
    shim: PathBuf,
    /// The containerd binary (for its version and `config dump`); default: found on PATH.
    #[arg(long)]
    containerd: Option<PathBuf>,
    /// Where the host's / is mounted (installer containers), e.g. /host.
    #[arg(long, default_value = "/")]
    host_root: PathBuf,
    /// Print the change without writing anything.
    #[arg(long)]
    dry_run: bool,
    /// Set runc_path in the node config (--config) to the NVIDIA Container Toolkit's runtime, so
    /// that it adds the GPU after gpu-mps-shim: auto (when the toolkit is containerd's default
    /// runtime), yes (whenever it is found) or no. Install only; uninstall puts runc_path back.
    #[arg(long, default_value = "auto", value_name = "auto|yes|no")]
    chain_toolkit: reg::ChainToolkit,
}

impl RegistrationArgs {
    /// The system's containerd config, the one `systemctl restart containerd` reloads.
    fn is_system_config(&self) -> bool {
        self.main_config == Path::new(reg::MAIN_CONFIG)
    }

    /// A private config (a test's, a second containerd's) keeps its drop-in next to it: the
    /// system's conf.d belongs to the system's containerd.
    fn drop_in(&self) -> PathBuf {
        match &self.drop_in {
            Some(path) => path.clone(),
            None if self.is_system_config() => reg::DROP_IN.into(),
            None => self
                .main_config
                .parent()
                .unwrap_or(Path::new("/"))
                .join("conf.d/gpu-mps.toml"),
        }
    }
}

fn register(r: &RegistrationArgs, remove: bool, node_config: &Path) -> anyhow::Result<()> {
    let opts = reg::InstallOptions {
        main_config: r.main_config.clone(),
        drop_in: r.drop_in(),
        shim_path: r.shim.clone(),
        host_root: r.host_root.clone(),
        node_config: node_config.to_path_buf(),
        chain_toolkit: r.chain_toolkit,
        ..reg::InstallOptions::default()
    };
    let containerd = r.containerd.clone().or_else(|| reg::find_containerd(&opts));
    let outcome = if remove {
        reg::uninstall(&opts, containerd.as_deref(), r.dry_run)?
    } else {
        reg::install(&opts, containerd.as_deref(), r.dry_run)?
    };
    let mut warnings = outcome.warnings.clone();
    if !remove {
        warnings.extend(installed::shim_warning(&r.shim, &opts.on_host(&r.shim)));
    }
    for w in &warnings {
        eprintln!("gpu-mps: warning: {w}");
    }
    if outcome.plan.is_empty() {
        println!(
            "containerd config already {}; nothing to change",
            if remove { "clean" } else { "registers gpu-mps" }
        );
        return Ok(());
    }
    print!("{}", outcome.plan.diff());
    if let Some(chained) = &outcome.chained {
        println!("{chained}");
    }
    for b in &outcome.backups {
        println!("backup: {}", b.display());
    }
    if r.dry_run {
        println!("dry run: nothing written");
        return Ok(());
    }
    if outcome.needs_containerd_restart() {
        if r.is_system_config() {
            println!("restart containerd to apply: systemctl restart containerd");
        } else {
            println!(
                "containerd reads {} only at its start: restart the containerd that uses it to apply",
                r.main_config.display()
            );
        }
    }
    if outcome.node_config_changed {
        println!(
            "{} changed: restart gpu-mps-manager to apply (systemctl restart gpu-mps-manager, or the gpu-mps DaemonSet's pod)",
            node_config.display()
        );
    }
    Ok(())
}

#[derive(Debug, clap::Args)]
struct DoctorArgs {
    /// containerd's main config file (its effective config is read with `containerd config dump`).
    #[arg(long = "containerd-config", default_value = reg::MAIN_CONFIG)]
    main_config: PathBuf,
    /// The drop-in install-containerd writes on containerd 2.x.
    #[arg(long, default_value = reg::DROP_IN)]
    drop_in: PathBuf,
    /// The gpu-mps-shim binary the runtime entry must name as BinaryName (default: the one next
    /// to this gpu-mps).
    #[arg(long, default_value_os_t = installed::default_shim_path())]
    shim: PathBuf,
    /// The containerd binary; default: found on PATH.
    #[arg(long)]
    containerd: Option<PathBuf>,
    /// Directories holding CDI specs, comma-separated.
    #[arg(
        long = "cdi-dir",
        value_delimiter = ',',
        default_value = "/etc/cdi,/var/run/cdi"
    )]
    cdi_dirs: Vec<PathBuf>,
    /// The host dir the NVIDIA toolkit's legacy hook binds into containers (tests point it
    /// elsewhere).
    #[arg(long, hide = true, default_value = doctor::HOST_MPS_DIR)]
    host_mps_dir: PathBuf,
    /// containerd's socket, as kubelet's --container-runtime-endpoint names it: the containerd
    /// serving it is the one whose config is checked against the file's.
    #[arg(long = "containerd-socket", default_value = doctor::CONTAINERD_SOCKET)]
    containerd_socket: PathBuf,
    /// The checks as JSON: {"ok": bool, "checks": [{"check", "status", "found", "fix"}]}.
    #[arg(long)]
    json: bool,
}

/// Runs every check; the exit status is 1 when one of them fails.
fn doctor(args: &Args, d: &DoctorArgs) -> anyhow::Result<ExitCode> {
    let facts = doctor::gather(&doctor::DoctorOptions {
        config: args.config.clone(),
        socket: args.socket.clone(),
        containerd_config: d.main_config.clone(),
        drop_in: d.drop_in.clone(),
        shim: d.shim.clone(),
        containerd: d.containerd.clone(),
        cdi_dirs: d.cdi_dirs.clone(),
        host_mps_dir: d.host_mps_dir.clone(),
        containerd_socket: d.containerd_socket.clone(),
    });
    let report = doctor::diagnose(&facts);
    if d.json {
        println!("{}", serde_json::to_string_pretty(&report.json())?);
    } else {
        print!("{}", report.text());
    }
    Ok(if report.failed() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn explain(bundle: &Path, config: &NodeConfig, inventory_path: &Path) -> anyhow::Result<String> {
    let spec_path = bundle.join("config.json");
    let spec =
        std::fs::read_to_string(&spec_path).with_context(|| format!("reading {}", spec_path.display()))?;
    let wants_gpu = gpu_mps_shim::parse_spec(&spec)?.wants_gpu();
    // A container without a GPU needs no inventory: explain it even where no manager runs.
    let inventory = if wants_gpu {
        load_inventory(inventory_path)?
    } else {
        gpu_mps_api::inventory::Inventory {
            source: "none".into(),
            gpus: Vec::new(),
        }
    };
    // containerd names a task's bundle dir after the container id.
    let container_id = bundle
        .canonicalize()
        .ok()
        .and_then(|b| b.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_default();
    Ok(explain_rewrite(
        &spec_path.display().to_string(),
        &spec,
        config,
        &inventory,
        &container_id,
    )?)
}

/// gpu-mps: inspect a gpu-mps node. `status` shows GPUs, MPS daemons and leases as the
/// manager sees them; `explain` shows how gpu-mps-shim would rewrite a container's bundle;
/// `doctor` checks what the node needs.
#[derive(Debug, Parser)]
#[command(name = "gpu-mps", version, about, long_about, after_help = EXAMPLES)]
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
    /// GPUs, daemons and leases, as the running manager sees them (fails within a second when no
    /// manager answers).
    #[command(after_help = "Examples:
  gpu-mps status
  gpu-mps status --json | jq '.gpus[] | {uuid, compute_mode}'
  gpu-mps --config /etc/gpu-mps/config.toml --socket /run/gpu-mps/manager.sock status")]
    Status {
        /// The manager's whole answer as JSON.
        #[arg(long)]
        json: bool,
    },
    /// MPS control daemons: state, pids, limits on their servers, leases.
    #[command(after_help = "Examples:
  gpu-mps daemons
  gpu-mps daemons --json | jq '.[] | {key, control_pid}'")]
    Daemons {
        /// The daemons as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Leases: which container holds which daemon with which limits.
    #[command(after_help = "Examples:
  gpu-mps leases
  gpu-mps leases --json | jq -r '.[].container_id'")]
    Leases {
        /// The leases as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Register the `gpu-mps` runtime handler with containerd (1.6, 1.7, 2.x): copies the runc
    /// entry's options, sets BinaryName to gpu-mps-shim, checks the result with
    /// `containerd config dump`. Idempotent. containerd must be restarted afterwards.
    #[command(after_help = "Examples:
  gpu-mps install-containerd --dry-run
  gpu-mps install-containerd --chain-toolkit=yes     (runc_path = the NVIDIA toolkit's runtime, docs/gpu-paths.md)
  gpu-mps install-containerd --containerd-config /tmp/ctd/config.toml --containerd /usr/bin/containerd")]
    InstallContainerd {
        #[command(flatten)]
        registration: RegistrationArgs,
    },
    /// Remove what install-containerd added, restoring the containerd config.
    #[command(after_help = "Examples:
  gpu-mps uninstall-containerd --dry-run
  gpu-mps uninstall-containerd
  gpu-mps uninstall-containerd --containerd-config /tmp/ctd/config.toml --containerd /usr/bin/containerd")]
    UninstallContainerd {
        #[command(flatten)]
        registration: RegistrationArgs,
    },
    /// Check the node: containerd registration, runc and the NVIDIA toolkit, CDI specs, compute
    /// mode, NVML, the manager and its config, its descriptors, the MPS binaries. One line per
    /// check (PASS, WARN, FAIL or SKIP) with the fix for each failure; exit status 1 when a check
    /// fails. Run it as root on the node.
    #[command(after_help = "Examples:
  gpu-mps doctor
  gpu-mps doctor --json | jq -r '.checks[] | select(.status == \"FAIL\") | .fix'
  gpu-mps doctor --config /etc/gpu-mps/config.toml --containerd-config /etc/containerd/config.toml")]
    Doctor {
        #[command(flatten)]
        doctor: DoctorArgs,
    },
    /// Show, as a diff, how gpu-mps-shim would rewrite a bundle's config.json (nothing is written).
    #[command(after_help = "Examples:
  gpu-mps explain /run/containerd/io.containerd.runtime.v2.task/k8s.io/<container-id>
  gpu-mps explain ./bundle --inventory /run/gpu-mps/inventory.json")]
    Explain {
        /// The bundle directory (the one holding config.json), e.g.
        /// /run/containerd/io.containerd.runtime.v2.task/k8s.io/<container-id>.
        bundle: PathBuf,
        /// The GPU inventory to resolve GPU names with (default: <root>/inventory.json).
        #[arg(long)]
        inventory: Option<PathBuf>,
    },
    /// The node config as gpu-mps reads it from --config: each setting is the file's value,
    /// else its default. For scripts: they read a value here instead of parsing the TOML.
    #[command(after_help = "Examples:
  gpu-mps config get root
  gpu-mps config get gate.queue_timeout_seconds
  gpu-mps --config /etc/gpu-mps/config.toml config get runc_path
  gpu-mps config show | jq .limits")]
    Config {
        #[command(subcommand)]
        action: ConfigAction,
    },
    /// The node's own gpu-mps: what stands in the way of removing it, and the removal of its
    /// state.
    #[command(after_help = "Examples:
  gpu-mps node live-leases || echo \"drain the node's gpu-mps pods first\"
  gpu-mps node live-leases --host-root /host   (from a container with the host's / at /host and hostPID)
  gpu-mps node remove-state --dry-run")]
    Node {
        #[command(subcommand)]
        action: NodeAction,
    },
}

#[derive(Debug, Subcommand)]
enum NodeAction {
    /// The containers that still hold a lease, from the lease files under the state root (the
    /// manager may be stopped): one line each. Exit status 0 when none, 3 when any runs or a lease
    /// file cannot be read (its container may run), 1 on an error.
    #[command(after_help = "Examples:
  gpu-mps node live-leases || echo \"drain the node's gpu-mps pods first\"
  gpu-mps node live-leases --host-root /host   (from a container with the host's / at /host and hostPID)")]
    LiveLeases {
        /// Where the host's / is mounted; the pids are read from this process's /proc, so run it
        /// with the host's PID namespace.
        #[arg(long, default_value = "/")]
        host_root: PathBuf,
    },
    /// Remove the manager's state root (`root` in the node config) once gpu-mps is uninstalled:
    /// only gpu-mps's own entries, then the root itself when nothing else was in it, so that a
    /// root shared with other files loses nothing else. One line per entry removed or kept and
    /// one for the root. Exit status 0 when removed (or there is none), 3 while gpu-mps-manager
    /// or an MPS control daemon still runs from it (one line each on stderr; nothing is removed),
    /// 1 on an error.
    #[command(after_help = "Examples:
  gpu-mps node remove-state --dry-run
  gpu-mps node remove-state
  gpu-mps --config /etc/gpu-mps/config.toml node remove-state --host-root /host   (from a container with the host's / at /host and hostPID)")]
    RemoveState {
        /// Where the host's / is mounted; the pids are read from this process's /proc, so run it
        /// with the host's PID namespace.
        #[arg(long, default_value = "/")]
        host_root: PathBuf,
        /// Print what would be removed; remove nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

/// A `gpu-mps node` command found gpu-mps still in use: containers holding leases
/// (live-leases), a manager or an MPS daemon running from the root (remove-state).
const STILL_IN_USE_EXIT: u8 = 3;

#[derive(Debug, Subcommand)]
enum ConfigAction {
    /// One setting by its path: the file's (`root`, `limits.policy`, `gate.max_connections`), but
    /// for sizes and limit pairs, which are in bytes and percent (`limits.default_limits`,
    /// `limits.ceiling`, `limits.maxima`, `device_plugin.memory_unit_bytes`); `config show` has
    /// every path. A string prints as is, anything else as JSON (`null` when unset). An unknown
    /// path fails, naming the nearest one.
    #[command(after_help = "Examples:
  gpu-mps config get root
  gpu-mps config get limits.policy
  gpu-mps --config /etc/gpu-mps/config.toml config get gate.max_connections")]
    Get { key: String },
    /// Every setting, as JSON (the shape the manager publishes in <root>/node-config.json).
    #[command(after_help = "Examples:
  gpu-mps config show
  gpu-mps config show | jq .limits")]
    Show,
}

const EXAMPLES: &str = "\
Examples:
  gpu-mps status
  gpu-mps leases --json
  gpu-mps install-containerd --dry-run
  gpu-mps doctor
  gpu-mps explain /run/containerd/io.containerd.runtime.v2.task/k8s.io/<container-id>
  gpu-mps config get root";

/// `gpu-mps node remove-state`: what goes and what stays on stdout, why nothing goes on stderr.
fn remove_state(config: &NodeConfig, host_root: &Path, dry_run: bool) -> anyhow::Result<ExitCode> {
    let root = remove_state::StateRoot::new(&config.root, host_root);
    let survey = remove_state::survey(&root)?;
    let plan = remove_state::plan(survey.as_ref());
    let lines = plan.lines(&root.on_disk, dry_run);
    if plan.refused() {
        for line in lines {
            eprintln!("gpu-mps: {line}");
        }
        return Ok(ExitCode::from(STILL_IN_USE_EXIT));
    }
    if !dry_run {
        remove_state::remove(&root, &plan)?;
    }
    for line in lines {
        println!("{line}");
    }
    Ok(ExitCode::SUCCESS)
}

fn status(args: &Args, config: &NodeConfig) -> anyhow::Result<StatusView> {
    let socket = args.socket.clone().unwrap_or_else(|| config.manager_socket());
    let conn = ManagerConnection::connect_once(&socket, Duration::from_secs(5))?;
    Ok(StatusView::from(&conn.status()?))
}

fn run(args: Args) -> anyhow::Result<ExitCode> {
    match &args.command {
        Command::InstallContainerd { registration } => {
            return register(registration, false, &args.config).map(|()| ExitCode::SUCCESS);
        }
        Command::UninstallContainerd { registration } => {
            return register(registration, true, &args.config).map(|()| ExitCode::SUCCESS);
        }
        // Before the config is loaded: an invalid config is one of its findings.
        Command::Doctor { doctor: d } => return doctor(&args, d),
        _ => {}
    }
    let config = NodeConfig::load(&args.config)?;
    if let Command::Config { action } = &args.command {
        match action {
            ConfigAction::Get { key } => println!("{}", config.value_at(key)?),
            ConfigAction::Show => println!("{}", serde_json::to_string_pretty(&config)?),
        }
        return Ok(ExitCode::SUCCESS);
    }
    if let Command::Node {
        action: NodeAction::LiveLeases { host_root },
    } = &args.command
    {
        let dir = gpu_mps_cli::host_paths::on_host(host_root, &config.lease_files_dir());
        let found = live_leases::read(&dir)
            .with_context(|| format!("reading the lease files in {}", dir.display()))?;
        for line in found.lines() {
            println!("{line}");
        }
        return Ok(if found.any() {
            ExitCode::from(STILL_IN_USE_EXIT)
        } else {
            ExitCode::SUCCESS
        });
    }
    if let Command::Node {
        action: NodeAction::RemoveState { host_root, dry_run },
    } = &args.command
    {
        return remove_state(&config, host_root, *dry_run);
    }
    if let Command::Explain { bundle, inventory } = &args.command {
        let inventory_path = inventory.clone().unwrap_or_else(|| config.inventory_path());
        print!("{}", explain(bundle, &config, &inventory_path)?);
        return Ok(ExitCode::SUCCESS);
    }
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
        Command::Explain { .. }
        | Command::Config { .. }
        | Command::Node { .. }
        | Command::InstallContainerd { .. }
        | Command::UninstallContainerd { .. }
        | Command::Doctor { .. } => {
            unreachable!("handled above")
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("gpu-mps: {}", error_chain_line(e.chain()));
            ExitCode::FAILURE
        }
    }
}
