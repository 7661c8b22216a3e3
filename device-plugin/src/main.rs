//! gpu-mps-device-plugin: advertises each GPU's memory to kubelet as `gpu-mps.io/memory` units,
//! so the scheduler places GPU pods by size, and hands each container its GPU and its units.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use gpu_mps_api::memory_units::{RESOURCE_NAME, UnitLayout};
use gpu_mps_api::node_config::DEFAULT_CONFIG_PATH;
use gpu_mps_api::node_files::{self, NodeFileError};
use gpu_mps_api::quantity::format_bytes;
use gpu_mps_device_plugin::device_list::devices;
use gpu_mps_device_plugin::gpu_delivery::{DeliveryMode, discover};
use gpu_mps_device_plugin::health::HealthTracker;
use gpu_mps_device_plugin::kubelet_link::{self, socket_identity};
use gpu_mps_device_plugin::node_view;
use gpu_mps_device_plugin::service::PluginService;
use gpu_mps_device_plugin::v1beta1::device_plugin_server::DevicePluginServer;
use gpu_mps_device_plugin::v1beta1::{Device, KUBELET_SOCKET};
use tokio::net::UnixListener;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tracing::{error, info, warn};

const EXAMPLE: &str = "\
Example (what the DaemonSet runs; kubelet's directory mounted at the same path):
  gpu-mps-device-plugin --device-plugin-dir /var/lib/kubelet/device-plugins

A pod then asks for GPU memory in units (1 GiB each by default):
  resources: { limits: { gpu-mps.io/memory: 4 } }
and runs with runtimeClassName: gpu-mps. Units, reserve and the default thread cap are set in
[device_plugin] of the gpu-mps node config.";

#[derive(Debug, Parser)]
#[command(name = "gpu-mps-device-plugin", version, about, after_help = EXAMPLE)]
struct Args {
    /// The gpu-mps node config (the manager's published copy under its root wins).
    #[arg(long, env = "GPU_MPS_CONFIG", default_value = DEFAULT_CONFIG_PATH)]
    config: PathBuf,
    /// kubelet's device plugin directory, holding kubelet.sock.
    #[arg(long, default_value = "/var/lib/kubelet/device-plugins")]
    device_plugin_dir: PathBuf,
    /// Where to look for NVIDIA CDI specs; a GPU named in one is handed over as a CDI device.
    #[arg(long, value_delimiter = ',', default_value = "/etc/cdi,/var/run/cdi")]
    cdi_dirs: Vec<PathBuf>,
    /// How GPUs reach containers: auto (a CDI device where a CDI spec names the GPU, else
    /// NVIDIA_VISIBLE_DEVICES and device nodes) or nodes (always the latter: for containerd or
    /// kubelet without CDI).
    #[arg(long, value_enum, default_value = "auto")]
    gpu_delivery: DeliveryMode,
    /// Where the GPU device nodes are (for GPUs handed over without CDI).
    #[arg(long, default_value = "/dev")]
    dev_dir: PathBuf,
    /// The plugin's socket name in the device plugin directory.
    #[arg(long, default_value = "gpu-mps.sock")]
    socket_name: String,
    /// How often to ask gpu-mps-manager for the GPUs' health.
    #[arg(long, default_value_t = 2000)]
    health_interval_ms: u64,
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = Args::parse();
    if let Err(e) = run(args).await {
        let line = gpu_mps_api::message::error_chain_line(e.chain());
        error!("{line}");
        eprintln!("gpu-mps-device-plugin: {line}");
        std::process::exit(1);
    }
}

async fn run(args: Args) -> Result<()> {
    // As the shim lays containers out: the running manager's published config, else the file.
    let (config, origin) = node_files::load_effective_config(&args.config)?;
    info!(config = %origin, "node config");
    if !config.device_plugin.enabled {
        warn!(
            "device_plugin.enabled is false in the gpu-mps node config: GPU containers without units still get GPUs and use memory the scheduler does not see; set it to true on nodes this plugin serves"
        );
    }
    let inventory = wait_for_inventory(&config).await?;
    let policy = config
        .device_plugin
        .unit_policy(config.limits.overcommit, config.limits.max_clients_per_gpu);
    let layout =
        Arc::new(UnitLayout::new(&inventory.gpus, &policy).context("laying out gpu-mps.io/memory units")?);
    let deliveries = Arc::new(discover(
        &inventory.gpus,
        &args.cdi_dirs,
        &args.dev_dir,
        args.gpu_delivery,
    ));
    for gpu in &layout.gpus {
        let via = deliveries
            .get(&gpu.uuid)
            .map(|d| d.describe())
            .unwrap_or_default();
        info!(gpu = gpu.index, uuid = %gpu.uuid, units = gpu.units, unit = %format_bytes(layout.unit_bytes), via = %via, "GPU advertised");
    }
    info!(
        resource = RESOURCE_NAME,
        min_units_per_process = layout.min_units_per_process,
        reserve = %format_bytes(policy.server_reserve_bytes),
        overcommit = policy.overcommit,
        "a container's CUDA processes need this many units each (MPS serves {} clients per GPU)",
        layout.max_clients_per_gpu
    );

    let (devices_tx, devices_rx) = watch::channel(devices(&layout, &HashMap::new()));
    tokio::spawn(watch_health(
        layout.clone(),
        config.digest(),
        config.manager_socket(),
        Duration::from_millis(args.health_interval_ms.max(100)),
        devices_tx,
    ));

    let mut terminate = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let kubelet_socket = args.device_plugin_dir.join(KUBELET_SOCKET);
    let own_socket = args.device_plugin_dir.join(&args.socket_name);
    loop {
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = serve(
            &own_socket,
            PluginService::new(layout.clone(), deliveries.clone(), devices_rx.clone()),
            stop_rx,
        )?;
        let kubelet = register_until_done(&kubelet_socket, &args.socket_name, &mut terminate).await;
        let Some(kubelet) = kubelet else {
            stop_server(stop_tx, server).await;
            remove_socket(&own_socket);
            return Ok(());
        };
        info!(kubelet = %kubelet_socket.display(), endpoint = %args.socket_name, resource = RESOURCE_NAME, "registered with kubelet");
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        let stop = loop {
            tokio::select! {
                _ = terminate.recv() => break true,
                _ = interrupt.recv() => break true,
                _ = tick.tick() => {
                    let ours_gone = socket_identity(&own_socket).is_none();
                    let kubelet_new = socket_identity(&kubelet_socket) != Some(kubelet);
                    if ours_gone || kubelet_new {
                        warn!(our_socket_removed = ours_gone, new_kubelet_socket = kubelet_new, "kubelet restarted; serving and registering again");
                        break false;
                    }
                }
            }
        };
        stop_server(stop_tx, server).await;
        if stop {
            remove_socket(&own_socket);
            info!("stopped");
            return Ok(());
        }
    }
}

/// Waits for the manager's inventory: the plugin may start first.
async fn wait_for_inventory(config: &gpu_mps_api::NodeConfig) -> Result<gpu_mps_api::inventory::Inventory> {
    let mut waited = 0u64;
    loop {
        match node_files::load_inventory(&config.inventory_path()) {
            Ok(inventory) => return Ok(inventory),
            Err(e @ NodeFileError::InventoryMissing { .. }) => {
                if waited % 30 == 0 {
                    warn!("{e}; waiting");
                }
            }
            Err(e) => return Err(e.into()),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        waited += 1;
    }
}

fn serve(
    socket: &Path,
    service: PluginService,
    stop: tokio::sync::oneshot::Receiver<()>,
) -> Result<tokio::task::JoinHandle<()>> {
    remove_socket(socket);
    let listener =
        UnixListener::bind(socket).with_context(|| format!("listening on {}", socket.display()))?;
    let incoming = UnixListenerStream::new(listener);
    Ok(tokio::spawn(async move {
        let served = tonic::transport::Server::builder()
            .add_service(DevicePluginServer::new(service))
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stop.await;
            })
            .await;
        if let Err(e) = served {
            error!(error = %e, "the device plugin server stopped");
        }
    }))
}

/// Registers until kubelet takes it; `None` when asked to stop meanwhile. Returns the identity
/// of the kubelet.sock it registered on.
async fn register_until_done(
    kubelet_socket: &Path,
    endpoint: &str,
    terminate: &mut tokio::signal::unix::Signal,
) -> Option<(u64, u64)> {
    let mut attempt = 0u32;
    loop {
        let identity = socket_identity(kubelet_socket);
        match kubelet_link::register(kubelet_socket, endpoint, RESOURCE_NAME).await {
            Ok(()) => return identity.or(Some((0, 0))),
            Err(e) => {
                if attempt % 15 == 0 {
                    warn!("{e}; retrying every 2 s");
                }
            }
        }
        attempt += 1;
        tokio::select! {
            _ = terminate.recv() => return None,
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
        }
    }
}

/// Polls the manager and publishes the device list whenever a GPU's health changes. The only
/// writer of the list.
async fn watch_health(
    layout: Arc<UnitLayout>,
    config_digest: String,
    manager_socket: PathBuf,
    interval: Duration,
    devices_tx: watch::Sender<Vec<Device>>,
) {
    let mut tracker = HealthTracker::new(layout.gpus.iter().map(|g| g.uuid.clone()).collect());
    let mut tick = tokio::time::interval(interval);
    loop {
        tick.tick().await;
        let socket = manager_socket.clone();
        let budget = interval.min(Duration::from_secs(2));
        let poll = tokio::task::spawn_blocking(move || node_view::manager_status(&socket, budget))
            .await
            .unwrap_or_else(|e| Err(e.to_string()));
        // Units laid out by another config than the manager's would promise kubelet memory the
        // shim then measures differently: start over (the DaemonSet restarts the plugin).
        if let Ok(status) = &poll {
            if !status.config_digest.is_empty() && status.config_digest != config_digest {
                error!(plugin = %config_digest, manager = %status.config_digest, "gpu-mps-manager runs with another node config than the units were laid out by; exiting to lay them out again");
                std::process::exit(3);
            }
        }
        let before = tracker.unhealthy().clone();
        let changed = match &poll {
            Ok(status) => tracker.observe(Ok(status)),
            Err(reason) => tracker.observe(Err(reason)),
        };
        if let Some(now) = changed {
            for (gpu, reason) in &now {
                if before.get(gpu) != Some(reason) {
                    warn!(gpu = %gpu, reason = %reason, "GPU reported Unhealthy to kubelet");
                }
            }
            for gpu in before.keys().filter(|g| !now.contains_key(*g)) {
                info!(gpu = %gpu, "GPU healthy again");
            }
            let _ = devices_tx.send(devices(&layout, &now));
        }
    }
}

/// Stops the server: a graceful stop waits for open ListAndWatch streams, which a kubelet that
/// went away never closes, so it gets a second and then the task is aborted.
async fn stop_server(stop: tokio::sync::oneshot::Sender<()>, mut server: tokio::task::JoinHandle<()>) {
    let _ = stop.send(());
    if tokio::time::timeout(Duration::from_secs(1), &mut server)
        .await
        .is_err()
    {
        server.abort();
        let _ = server.await;
    }
}

fn remove_socket(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            warn!(socket = %path.display(), error = %e, "cannot remove the plugin socket");
        }
    }
}
