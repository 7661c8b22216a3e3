//! A CRI client that plays kubelet over a test containerd's socket.
//!
//! Calls return `tonic::Status` untouched: the tests assert on the message a CRI client
//! (kubelet, crictl) would show, e.g. why gpu-mps refused a container.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use hyper_util::rt::TokioIo;
use k8s_cri::v1 as cri;
use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use tokio::net::UnixStream;
use tonic::Status;
use tonic::transport::{Channel, Endpoint, Uri};

/// kubelet's default grace period is 30 s; the test containers stop on SIGTERM at once.
pub const STOP_TIMEOUT_SECONDS: i64 = 10;

/// A connection to containerd's CRI services.
#[derive(Debug, Clone)]
pub struct CriClient {
    runtime: RuntimeServiceClient<Channel>,
    images: ImageServiceClient<Channel>,
    /// Pod log directories are made below this, as kubelet does under /var/log/pods.
    log_root: PathBuf,
}

/// A pod to run: what kubelet puts in a PodSandboxConfig. Pods use the host network, so no
/// CNI is involved.
#[derive(Debug, Clone, Default)]
pub struct PodSpec {
    pub name: String,
    pub namespace: String,
    pub uid: String,
    pub annotations: HashMap<String, String>,
    /// "runc", "gpu-mps", or empty for containerd's default.
    pub runtime_handler: String,
    /// `hostPID: true`: the pod and its containers share the host's PID namespace.
    pub host_pid: bool,
    /// A privileged sandbox, which kubelet asks for when a container of the pod is privileged
    /// (containerd refuses a privileged container in an unprivileged sandbox).
    pub privileged: bool,
}

impl PodSpec {
    pub fn new(name: &str, namespace: &str, runtime_handler: &str) -> PodSpec {
        PodSpec {
            name: name.into(),
            namespace: namespace.into(),
            uid: format!("uid-{}", crate::ctr::unique_id(name)),
            annotations: HashMap::new(),
            runtime_handler: runtime_handler.into(),
            host_pid: false,
            privileged: false,
        }
    }

    pub fn annotation(mut self, key: &str, value: &str) -> PodSpec {
        self.annotations.insert(key.into(), value.into());
        self
    }

    /// The pod-level gpu-mps limits: `gpu-mps.io/memory-limit`, `gpu-mps.io/active-thread-percentage`.
    pub fn gpu_limits(self, memory: &str, thread_percentage: u8) -> PodSpec {
        use gpu_mps_api::annotations::{ACTIVE_THREAD_PERCENTAGE, MEMORY_LIMIT};
        self.annotation(MEMORY_LIMIT, memory)
            .annotation(ACTIVE_THREAD_PERCENTAGE, &thread_percentage.to_string())
    }

    /// Container-level limits, set on the pod as `<container>.gpu-mps.io/...`.
    pub fn container_gpu_limits(self, container: &str, memory: &str, thread_percentage: u8) -> PodSpec {
        use gpu_mps_api::annotations::{ACTIVE_THREAD_PERCENTAGE, MEMORY_LIMIT, container_key};
        self.annotation(&container_key(container, MEMORY_LIMIT), memory)
            .annotation(
                &container_key(container, ACTIVE_THREAD_PERCENTAGE),
                &thread_percentage.to_string(),
            )
    }
}

/// A running pod sandbox.
#[derive(Debug, Clone)]
pub struct Pod {
    pub id: String,
    pub spec: PodSpec,
    pub log_directory: PathBuf,
    /// Sent again with every CreateContainer, as kubelet does.
    config: cri::PodSandboxConfig,
}

/// A container to create: what kubelet puts in a ContainerConfig.
#[derive(Debug, Clone, Default)]
pub struct ContainerSpec {
    pub name: String,
    pub image: String,
    pub command: Vec<String>,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub annotations: HashMap<String, String>,
    pub mounts: Vec<cri::Mount>,
    pub devices: Vec<cri::Device>,
    /// The CRI `CDIDevices` field (kubelet fills it from a device plugin's Allocate).
    pub cdi_devices: Vec<String>,
    /// `securityContext.privileged`.
    pub privileged: bool,
    /// `securityContext.runAsUser`: the uid of the container's processes (the image's user
    /// when unset).
    pub run_as_user: Option<i64>,
}

impl ContainerSpec {
    pub fn new(name: &str, image: &str) -> ContainerSpec {
        ContainerSpec {
            name: name.into(),
            image: image.into(),
            ..ContainerSpec::default()
        }
    }

    pub fn command(mut self, command: &[&str]) -> ContainerSpec {
        self.command = command.iter().map(|s| s.to_string()).collect();
        self
    }

    pub fn args(mut self, args: &[&str]) -> ContainerSpec {
        self.args = args.iter().map(|s| s.to_string()).collect();
        self
    }

    pub fn env(mut self, key: &str, value: &str) -> ContainerSpec {
        self.env.push((key.into(), value.into()));
        self
    }

    pub fn annotation(mut self, key: &str, value: &str) -> ContainerSpec {
        self.annotations.insert(key.into(), value.into());
        self
    }

    /// `securityContext.runAsUser: uid`.
    pub fn run_as_user(mut self, uid: i64) -> ContainerSpec {
        self.run_as_user = Some(uid);
        self
    }

    /// `NVIDIA_VISIBLE_DEVICES=<gpu>`, as the NVIDIA device plugin sets it.
    pub fn gpu(self, gpu: &str) -> ContainerSpec {
        self.env(NVIDIA_VISIBLE_DEVICES, gpu)
    }
}

/// How a container asks for GPUs (the device plugin's env).
pub const NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";

/// A created container.
#[derive(Debug, Clone)]
pub struct Container {
    pub id: String,
    pub name: String,
    pub pod_id: String,
    /// Where containerd writes its stdout and stderr, in the CRI log format.
    pub log_path: PathBuf,
}

/// What an ExecSync printed.
#[derive(Debug, Clone)]
pub struct ExecOutput {
    pub exit_code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl ExecOutput {
    /// stdout's last non-empty line (the checker prints one JSON line).
    pub fn last_line(&self) -> &str {
        self.stdout
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("")
    }
}

/// One line of a CRI container log: `<RFC 3339 time> <stdout|stderr> <F|P> <text>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    pub time: String,
    pub stream: String,
    /// False for a partial line ("P"), continued by the next one.
    pub full: bool,
    pub text: String,
}

impl CriClient {
    /// Connects over containerd's unix socket. `log_root` holds the pods' log directories.
    pub async fn connect(socket: &Path, log_root: PathBuf) -> Result<CriClient> {
        let socket = socket.to_path_buf();
        // The URI is required by the API and ignored by the connector.
        let channel = Endpoint::try_from("http://[::]:0")?
            .connect_timeout(Duration::from_secs(5))
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let socket = socket.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
            }))
            .await
            .context("connecting to containerd's CRI socket")?;
        Ok(CriClient {
            runtime: RuntimeServiceClient::new(channel.clone()),
            images: ImageServiceClient::new(channel),
            log_root,
        })
    }

    pub async fn version(&mut self) -> Result<cri::VersionResponse, Status> {
        let request = cri::VersionRequest { version: "v1".into() };
        Ok(self.runtime.version(request).await?.into_inner())
    }

    /// Whether the runtime has the image, by name.
    pub async fn image_present(&mut self, image: &str) -> Result<bool, Status> {
        let request = cri::ImageStatusRequest {
            image: Some(cri::ImageSpec {
                image: image.into(),
                ..Default::default()
            }),
            verbose: false,
        };
        Ok(self
            .images
            .image_status(request)
            .await?
            .into_inner()
            .image
            .is_some())
    }

    /// RunPodSandbox with the host network, a log directory, and the spec's annotations and
    /// runtime handler.
    pub async fn run_pod_sandbox(&mut self, spec: &PodSpec) -> Result<Pod, Status> {
        let log_directory = self
            .log_root
            .join(format!("{}_{}_{}", spec.namespace, spec.name, spec.uid));
        std::fs::create_dir_all(&log_directory)
            .map_err(|e| Status::internal(format!("test harness: {e}")))?;
        let config = cri::PodSandboxConfig {
            metadata: Some(cri::PodSandboxMetadata {
                name: spec.name.clone(),
                uid: spec.uid.clone(),
                namespace: spec.namespace.clone(),
                attempt: 0,
            }),
            log_directory: log_directory.display().to_string(),
            annotations: spec.annotations.clone(),
            labels: HashMap::from([
                ("io.kubernetes.pod.name".into(), spec.name.clone()),
                ("io.kubernetes.pod.namespace".into(), spec.namespace.clone()),
                ("io.kubernetes.pod.uid".into(), spec.uid.clone()),
            ]),
            linux: Some(cri::LinuxPodSandboxConfig {
                security_context: Some(cri::LinuxSandboxSecurityContext {
                    namespace_options: Some(namespaces(spec.host_pid)),
                    privileged: spec.privileged,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let request = cri::RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: spec.runtime_handler.clone(),
        };
        let id = self
            .runtime
            .run_pod_sandbox(request)
            .await?
            .into_inner()
            .pod_sandbox_id;
        Ok(Pod {
            id,
            spec: spec.clone(),
            log_directory,
            config,
        })
    }

    pub async fn stop_pod(&mut self, pod: &Pod) -> Result<(), Status> {
        let request = cri::StopPodSandboxRequest {
            pod_sandbox_id: pod.id.clone(),
        };
        self.runtime.stop_pod_sandbox(request).await?;
        Ok(())
    }

    pub async fn remove_pod(&mut self, pod: &Pod) -> Result<(), Status> {
        let request = cri::RemovePodSandboxRequest {
            pod_sandbox_id: pod.id.clone(),
        };
        self.runtime.remove_pod_sandbox(request).await?;
        Ok(())
    }

    /// Stop then remove, as kubelet does when a pod is deleted.
    pub async fn delete_pod(&mut self, pod: &Pod) -> Result<(), Status> {
        self.stop_pod(pod).await?;
        self.remove_pod(pod).await
    }

    /// CreateContainer in `pod`, logging to `<pod log dir>/<name>.log`.
    pub async fn create_container(&mut self, pod: &Pod, spec: &ContainerSpec) -> Result<Container, Status> {
        let log_name = format!("{}.log", spec.name);
        let config = cri::ContainerConfig {
            metadata: Some(cri::ContainerMetadata {
                name: spec.name.clone(),
                attempt: 0,
            }),
            image: Some(cri::ImageSpec {
                image: spec.image.clone(),
                ..Default::default()
            }),
            command: spec.command.clone(),
            args: spec.args.clone(),
            envs: spec
                .env
                .iter()
                .map(|(key, value)| cri::KeyValue {
                    key: key.clone(),
                    value: value.clone(),
                })
                .collect(),
            mounts: spec.mounts.clone(),
            devices: spec.devices.clone(),
            cdi_devices: spec
                .cdi_devices
                .iter()
                .map(|name| cri::CdiDevice { name: name.clone() })
                .collect(),
            annotations: spec.annotations.clone(),
            labels: HashMap::from([("io.kubernetes.container.name".into(), spec.name.clone())]),
            log_path: log_name.clone(),
            linux: Some(cri::LinuxContainerConfig {
                security_context: Some(cri::LinuxContainerSecurityContext {
                    namespace_options: Some(namespaces(pod.spec.host_pid)),
                    privileged: spec.privileged,
                    run_as_user: spec.run_as_user.map(|value| cri::Int64Value { value }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let request = cri::CreateContainerRequest {
            pod_sandbox_id: pod.id.clone(),
            config: Some(config),
            sandbox_config: Some(pod.config.clone()),
        };
        let id = self
            .runtime
            .create_container(request)
            .await?
            .into_inner()
            .container_id;
        Ok(Container {
            id,
            name: spec.name.clone(),
            pod_id: pod.id.clone(),
            log_path: pod.log_directory.join(log_name),
        })
    }

    pub async fn start_container(&mut self, container: &Container) -> Result<(), Status> {
        let request = cri::StartContainerRequest {
            container_id: container.id.clone(),
        };
        self.runtime.start_container(request).await?;
        Ok(())
    }

    pub async fn stop_container(&mut self, container: &Container) -> Result<(), Status> {
        let request = cri::StopContainerRequest {
            container_id: container.id.clone(),
            timeout: STOP_TIMEOUT_SECONDS,
        };
        self.runtime.stop_container(request).await?;
        Ok(())
    }

    pub async fn remove_container(&mut self, container: &Container) -> Result<(), Status> {
        let request = cri::RemoveContainerRequest {
            container_id: container.id.clone(),
        };
        self.runtime.remove_container(request).await?;
        Ok(())
    }

    pub async fn container_status(&mut self, container: &Container) -> Result<cri::ContainerStatus, Status> {
        let request = cri::ContainerStatusRequest {
            container_id: container.id.clone(),
            verbose: false,
        };
        self.runtime
            .container_status(request)
            .await?
            .into_inner()
            .status
            .ok_or_else(|| Status::not_found(format!("no status for container {}", container.id)))
    }

    /// Waits for the container to exit; returns its exit code.
    pub async fn wait_exit(&mut self, container: &Container, timeout: Duration) -> Result<i32> {
        let deadline = Instant::now() + timeout;
        loop {
            let status = self.container_status(container).await?;
            if status.state == cri::ContainerState::ContainerExited as i32 {
                return Ok(status.exit_code);
            }
            if Instant::now() > deadline {
                bail!(
                    "container {} did not exit within {timeout:?} (state {:?})",
                    container.name,
                    cri::ContainerState::try_from(status.state)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the container runs (e.g. `checker pause` after StartContainer).
    pub async fn wait_running(&mut self, container: &Container, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let status = self.container_status(container).await?;
            if status.state == cri::ContainerState::ContainerRunning as i32 {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "container {} is not running after {timeout:?}: {status:?}",
                    container.name
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// ExecSync, as `kubectl exec` does: runs `cmd` in the running container, with the
    /// container's environment.
    pub async fn exec_sync(
        &mut self,
        container: &Container,
        cmd: &[&str],
        timeout: Duration,
    ) -> Result<ExecOutput, Status> {
        let request = cri::ExecSyncRequest {
            container_id: container.id.clone(),
            cmd: cmd.iter().map(|s| s.to_string()).collect(),
            timeout: timeout.as_secs() as i64,
        };
        let response = self.runtime.exec_sync(request).await?.into_inner();
        Ok(ExecOutput {
            exit_code: response.exit_code,
            stdout: String::from_utf8_lossy(&response.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&response.stderr).into_owned(),
        })
    }

    /// Waits for the first stdout line in the container's log (e.g. what `checker mps-client
    /// --hold-seconds N` printed before holding).
    pub async fn first_stdout_line(&mut self, container: &Container, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            if container.log_path.exists() {
                if let Some(line) = stdout_lines(&container.log_path)?
                    .into_iter()
                    .find(|l| !l.trim().is_empty())
                {
                    return Ok(line);
                }
            }
            if Instant::now() > deadline {
                let status = self.container_status(container).await?;
                bail!(
                    "container {} printed nothing within {timeout:?}: {status:?}",
                    container.name
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stop and remove, as kubelet does when a container is deleted.
    pub async fn delete_container(&mut self, container: &Container) -> Result<(), Status> {
        self.stop_container(container).await?;
        self.remove_container(container).await
    }
}

/// The host network always (no CNI here); the host's PID namespace for a hostPID pod.
fn namespaces(host_pid: bool) -> cri::NamespaceOption {
    cri::NamespaceOption {
        network: cri::NamespaceMode::Node as i32,
        pid: if host_pid {
            cri::NamespaceMode::Node as i32
        } else {
            cri::NamespaceMode::Container as i32
        },
        ipc: cri::NamespaceMode::Pod as i32,
        ..Default::default()
    }
}

/// A container's log lines, partial lines joined.
pub fn read_log(path: &Path) -> Result<Vec<LogLine>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the container log {}", path.display()))?;
    parse_log(&text)
}

/// The stdout lines of a container's log.
pub fn stdout_lines(path: &Path) -> Result<Vec<String>> {
    Ok(read_log(path)?
        .into_iter()
        .filter(|l| l.stream == "stdout")
        .map(|l| l.text)
        .collect())
}

fn parse_log(text: &str) -> Result<Vec<LogLine>> {
    let mut lines: Vec<LogLine> = Vec::new();
    // A partial line per stream, waiting for its continuation.
    let mut pending: Vec<LogLine> = Vec::new();
    for raw in text.lines() {
        let mut fields = raw.splitn(4, ' ');
        let (Some(time), Some(stream), Some(tag)) = (fields.next(), fields.next(), fields.next()) else {
            bail!("not a CRI log line: {raw:?}");
        };
        let text = fields.next().unwrap_or("");
        let full = match tag {
            "F" => true,
            "P" => false,
            other => bail!("not a CRI log tag: {other:?} in {raw:?}"),
        };
        let line = match pending.iter().position(|p| p.stream == stream) {
            Some(i) => {
                let mut start = pending.remove(i);
                start.text.push_str(text);
                start.full = full;
                start
            }
            None => LogLine {
                time: time.into(),
                stream: stream.into(),
                full,
                text: text.into(),
            },
        };
        if full {
            lines.push(line);
        } else {
            pending.push(line);
        }
    }
    lines.extend(pending);
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_lines_partial_lines_joined() {
        let text = "2024-01-01T00:00:00.1Z stdout P {\"a\":\n\
                    2024-01-01T00:00:00.2Z stderr F oops\n\
                    2024-01-01T00:00:00.3Z stdout F 1}\n\
                    2024-01-01T00:00:00.4Z stdout F \n";
        let lines = parse_log(text).unwrap();
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert_eq!(lines[0].stream, "stderr");
        let stdout: Vec<_> = lines
            .iter()
            .filter(|l| l.stream == "stdout")
            .map(|l| l.text.as_str())
            .collect();
        assert_eq!(stdout, ["{\"a\":1}", ""]);
        assert_eq!(
            lines[1].time, "2024-01-01T00:00:00.1Z",
            "a joined line keeps the time of its start"
        );
        assert!(parse_log("garbage").is_err());
    }
}
