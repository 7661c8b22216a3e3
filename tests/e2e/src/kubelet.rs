//! A test kubelet for device plugins: it serves Registration on a private `kubelet.sock`, takes
//! the plugin's registration, follows its ListAndWatch, and allocates with kubelet's own rules
//! (pkg/kubelet/cm/devicemanager): the available devices are the healthy ones not in use; the
//! plugin's preferred allocation is taken first when it is valid, then topped up from the
//! available ones; Allocate's answer becomes the CRI CreateContainer request (envs, mounts,
//! devices, annotations, CDI devices), which the caller runs through real containerd.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpu_mps_device_plugin::v1beta1::device_plugin_client::DevicePluginClient;
use gpu_mps_device_plugin::v1beta1::registration_server::{Registration, RegistrationServer};
use gpu_mps_device_plugin::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, ContainerAllocateResponse,
    ContainerPreferredAllocationRequest, Device, Empty, KUBELET_SOCKET, ListAndWatchResponse,
    PreferredAllocationRequest, RegisterRequest,
};
use hyper_util::rt::TokioIo;
use k8s_cri::v1 as cri;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Request, Response, Status, Streaming};

use crate::binaries::Binaries;
use crate::cri::ContainerSpec;

/// How long the plugin may take to (re-)register.
pub const REGISTRATION_WAIT: Duration = Duration::from_secs(20);

/// The Registration service: hands each request to the test.
struct RegistrationDesk {
    requests: mpsc::UnboundedSender<RegisterRequest>,
}

#[tonic::async_trait]
impl Registration for RegistrationDesk {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let request = request.into_inner();
        if request.version != "v1beta1" {
            return Err(Status::invalid_argument(format!(
                "version {:?} is not supported by this kubelet",
                request.version
            )));
        }
        let _ = self.requests.send(request);
        Ok(Response::new(Empty {}))
    }
}

/// kubelet's side: the Registration server on `<dir>/kubelet.sock`. Dropping it stops the
/// server (as a kubelet that stopped).
#[derive(Debug)]
pub struct TestKubelet {
    pub dir: PathBuf,
    registrations: mpsc::UnboundedReceiver<RegisterRequest>,
    stop: Option<oneshot::Sender<()>>,
}

impl TestKubelet {
    pub fn start(dir: &Path) -> Result<TestKubelet> {
        let socket = dir.join(KUBELET_SOCKET);
        let _ = std::fs::remove_file(&socket);
        let listener =
            UnixListener::bind(&socket).with_context(|| format!("binding {}", socket.display()))?;
        let (tx, rx) = mpsc::unbounded_channel();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(RegistrationServer::new(RegistrationDesk { requests: tx }))
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                    let _ = stop_rx.await;
                })
                .await;
        });
        Ok(TestKubelet {
            dir: dir.to_path_buf(),
            registrations: rx,
            stop: Some(stop_tx),
        })
    }

    /// What kubelet does when it restarts: it stops, removes every socket in its directory
    /// (the plugins' too), and serves a new kubelet.sock.
    pub fn restart(&mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        for entry in std::fs::read_dir(&self.dir)? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "sock") {
                std::fs::remove_file(&path)?;
            }
        }
        *self = TestKubelet::start(&self.dir)?;
        Ok(())
    }

    /// The next registration, within [`REGISTRATION_WAIT`].
    pub async fn registration(&mut self) -> Result<RegisterRequest> {
        tokio::time::timeout(REGISTRATION_WAIT, self.registrations.recv())
            .await
            .context("the device plugin did not register")?
            .context("the registration server stopped")
    }

    /// Connects to the plugin at the endpoint it registered.
    pub async fn plugin(&self, registration: &RegisterRequest) -> Result<PluginLink> {
        let mut client = plugin_client(&self.dir.join(&registration.endpoint)).await?;
        let options = client.get_device_plugin_options(Empty {}).await?.into_inner();
        let stream = client.list_and_watch(Empty {}).await?.into_inner();
        Ok(PluginLink {
            client,
            options_preferred: options.get_preferred_allocation_available,
            stream,
            devices: BTreeMap::new(),
        })
    }
}

impl Drop for TestKubelet {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// A client of the device plugin serving on `socket`, on a connection of its own.
pub async fn plugin_client(socket: &Path) -> Result<DevicePluginClient<Channel>> {
    Ok(DevicePluginClient::new(unix_channel(socket).await?))
}

async fn unix_channel(socket: &Path) -> Result<Channel> {
    let socket = socket.to_path_buf();
    let shown = socket.display().to_string();
    Endpoint::try_from("http://[::]:0")?
        .connect_timeout(Duration::from_secs(5))
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
        }))
        .await
        .with_context(|| format!("connecting to the device plugin at {shown}"))
}

/// One registered plugin as kubelet's device manager sees it.
pub struct PluginLink {
    pub client: DevicePluginClient<Channel>,
    pub options_preferred: bool,
    stream: Streaming<ListAndWatchResponse>,
    /// Device ID -> health, from the last ListAndWatch message.
    pub devices: BTreeMap<String, String>,
}

impl PluginLink {
    /// Reads ListAndWatch messages until `done` holds for the device list.
    pub async fn watch_until(
        &mut self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&BTreeMap<String, String>) -> bool,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while !done(&self.devices) {
            let left = deadline.saturating_duration_since(Instant::now());
            let message = tokio::time::timeout(left, self.stream.message())
                .await
                .with_context(|| format!("ListAndWatch: {what} not seen within {timeout:?}"))??
                .context("ListAndWatch ended")?;
            self.devices = message
                .devices
                .into_iter()
                .map(|Device { id, health, .. }| (id, health))
                .collect();
        }
        Ok(())
    }

    pub fn healthy(&self) -> BTreeSet<String> {
        self.devices
            .iter()
            .filter(|(_, h)| *h == "Healthy")
            .map(|(id, _)| id.clone())
            .collect()
    }
}

/// kubelet's device manager for one resource: what is in use, by container.
#[derive(Debug, Default, Clone)]
pub struct DeviceManager {
    pub in_use: BTreeMap<String, Vec<String>>,
}

/// What an allocation gave: the device IDs and the plugin's answer.
#[derive(Debug, Clone)]
pub struct Allocated {
    pub ids: Vec<String>,
    pub preferred: Vec<String>,
    pub response: ContainerAllocateResponse,
}

impl DeviceManager {
    /// Devices kubelet can still hand out: healthy and not in use.
    pub fn available(&self, link: &PluginLink) -> BTreeSet<String> {
        let used: BTreeSet<&String> = self.in_use.values().flatten().collect();
        link.healthy()
            .into_iter()
            .filter(|id| !used.contains(id))
            .collect()
    }

    /// kubelet's devicesToAllocate, then Allocate: `size` devices for `container`.
    pub async fn allocate(
        &mut self,
        link: &mut PluginLink,
        container: &str,
        size: usize,
    ) -> Result<Allocated> {
        let available = self.available(link);
        if available.len() < size {
            bail!(
                "requested number of devices unavailable for gpu-mps.io/memory. Requested: {size}, Available: {}",
                available.len()
            );
        }
        let mut picked: Vec<String> = Vec::new();
        let mut preferred = Vec::new();
        if link.options_preferred {
            let request = PreferredAllocationRequest {
                container_requests: vec![ContainerPreferredAllocationRequest {
                    available_device_i_ds: available.iter().cloned().collect(),
                    must_include_device_i_ds: Vec::new(),
                    allocation_size: i32::try_from(size)?,
                }],
            };
            let answer = link.client.get_preferred_allocation(request).await?.into_inner();
            preferred = answer
                .container_responses
                .into_iter()
                .next()
                .map(|c| c.device_i_ds)
                .unwrap_or_default();
            // kubelet takes the preferred devices that are available, at most `size`.
            for id in &preferred {
                if available.contains(id) && picked.len() < size && !picked.contains(id) {
                    picked.push(id.clone());
                }
            }
        }
        // Topped up from the available ones (kubelet's order is a set's; sorted here).
        for id in &available {
            if picked.len() >= size {
                break;
            }
            if !picked.contains(id) {
                picked.push(id.clone());
            }
        }
        let response = allocate_ids(link, &picked).await?;
        self.in_use.insert(container.to_string(), picked.clone());
        Ok(Allocated {
            ids: picked,
            preferred,
            response,
        })
    }

    pub fn free(&mut self, container: &str) {
        self.in_use.remove(container);
    }
}

/// One Allocate call for one container's `ids`, as kubelet sends it.
pub async fn allocate_ids(
    link: &mut PluginLink,
    ids: &[String],
) -> Result<ContainerAllocateResponse, Status> {
    allocate_on(&mut link.client, ids).await
}

/// [`allocate_ids`] on any client of the plugin.
pub async fn allocate_on(
    client: &mut DevicePluginClient<Channel>,
    ids: &[String],
) -> Result<ContainerAllocateResponse, Status> {
    let request = AllocateRequest {
        container_requests: vec![ContainerAllocateRequest {
            devices_ids: ids.to_vec(),
        }],
    };
    let response = client.allocate(request).await?.into_inner();
    response
        .container_responses
        .into_iter()
        .next()
        .ok_or_else(|| Status::internal("Allocate answered no container"))
}

/// What kubelet adds to a container's CRI config from Allocate's answer.
pub fn apply_allocation(mut spec: ContainerSpec, response: &ContainerAllocateResponse) -> ContainerSpec {
    let mut envs: Vec<(&String, &String)> = response.envs.iter().collect();
    envs.sort();
    for (key, value) in envs {
        spec.env.push((key.clone(), value.clone()));
    }
    for m in &response.mounts {
        spec.mounts.push(cri::Mount {
            container_path: m.container_path.clone(),
            host_path: m.host_path.clone(),
            readonly: m.read_only,
            ..Default::default()
        });
    }
    for d in &response.devices {
        spec.devices.push(cri::Device {
            container_path: d.container_path.clone(),
            host_path: d.host_path.clone(),
            permissions: d.permissions.clone(),
        });
    }
    for (key, value) in &response.annotations {
        spec.annotations.insert(key.clone(), value.clone());
    }
    spec.cdi_devices
        .extend(response.cdi_devices.iter().map(|c| c.name.clone()));
    spec
}

/// gpu-mps-device-plugin as a child process, on a test's kubelet directory; killed on drop.
#[derive(Debug)]
pub struct PluginProcess {
    child: Child,
    pub log: PathBuf,
}

impl PluginProcess {
    pub fn start(
        bins: &Binaries,
        config: &Path,
        kubelet_dir: &Path,
        dev_dir: &Path,
        cdi_dirs: &[PathBuf],
    ) -> Result<PluginProcess> {
        let log = kubelet_dir.join(format!(
            "device-plugin-{}.log",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis())
                .unwrap_or(0)
        ));
        let out = std::fs::File::create(&log)?;
        let cdi: Vec<String> = cdi_dirs.iter().map(|d| d.display().to_string()).collect();
        let child = Command::new(&bins.device_plugin)
            .arg("--config")
            .arg(config)
            .arg("--device-plugin-dir")
            .arg(kubelet_dir)
            .arg("--dev-dir")
            .arg(dev_dir)
            .arg(format!(
                "--cdi-dirs={}",
                if cdi.is_empty() {
                    "/nonexistent".into()
                } else {
                    cdi.join(",")
                }
            ))
            .arg("--health-interval-ms=300")
            .stdout(Stdio::null())
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {}", bins.device_plugin.display()))?;
        Ok(PluginProcess { child, log })
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for PluginProcess {
    fn drop(&mut self) {
        self.kill();
        crate::diagnostics::record(crate::diagnostics::LogTail {
            title: format!("gpu-mps-device-plugin ({})", self.log.display()),
            text: crate::diagnostics::tail_of(&self.log, crate::diagnostics::TAIL_LINES),
        });
    }
}

/// A shared [`DeviceManager`] for concurrent allocations.
pub type SharedDevices = Arc<Mutex<DeviceManager>>;
