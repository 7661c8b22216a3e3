//! GPUs that reach a container only as device nodes, through the CRI runtime handler `gpu-mps`
//! with this harness playing kubelet: the CRI `devices` of a device plugin's Allocate, and CDI
//! devices of the CRI `CDIDevices` field, which containerd resolves into linux.devices before
//! runc. The shim must find the GPU by the node's minor (fail closed: a GPU it cannot name is
//! refused, never passed through), and the pod's own NVIDIA_VISIBLE_DEVICES must not widen it.
//!
//! No GPU: the nodes are fake character devices 195:<minor> made with mknod in the test's own
//! directory, and the fake inventory gives the GPUs minors that are not their indices.
//!
//! Needs the workspace built (`cargo build --workspace`) and the static checker; see
//! gpu_mps_e2e::binaries. Run: `cargo test -p gpu-mps-e2e --test cri_devices -- --nocapture`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use gpu_mps_api::annotations::DAEMON;
use gpu_mps_api::inventory::GpuInfo;
use gpu_mps_e2e::cdi;
use gpu_mps_e2e::checker::{CheckerLine, Report};
use gpu_mps_e2e::containerd::{CRI_NAMESPACE, GPU_MPS_HANDLER};
use gpu_mps_e2e::cri::{Container, Pod};
use gpu_mps_e2e::device_nodes::{NVIDIA_MAJOR, make_gpu_node};
use gpu_mps_e2e::image::TEST_IMAGE;
use gpu_mps_e2e::manager::{FAKE_GPU_MEMORY, fake_gpus};
use gpu_mps_e2e::{
    CdiOptions, ContainerSpec, CriClient, GpuNode, LimitsConfig, PodSpec, StatusLookup, Suite, per_suite,
};
use hyper_util::rt::TokioIo;
use k8s_cri::v1 as cri;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use tokio::net::UnixStream;
use tonic::transport::{Endpoint, Uri};

per_suite!(
    device_nodes_of_the_cri_devices_field,
    device_node_of_a_cri_cdi_device,
);

const WAIT: Duration = Duration::from_secs(20);
/// Long enough to outlive any test; containers are removed (or killed) before.
const HOLD: &str = "--hold-seconds=300";
/// The fake GPUs' minors: GPU 0 is /dev/nvidia3, GPU 1 /dev/nvidia2 (not their indices, as
/// when the driver numbers nodes in another order than NVML lists GPUs).
const MINORS: [u32; 2] = [3, 2];
/// No GPU of the fake inventory has it.
const UNKNOWN_MINOR: u32 = 7;
/// Where every test container sees its GPU node, whatever its minor (the CRI's choice).
const CONTAINER_NODE: &str = "/dev/nvidia0";

/// Two fake GPUs with [`MINORS`].
fn gpus_with_minors() -> Vec<GpuInfo> {
    let mut gpus = fake_gpus(2, FAKE_GPU_MEMORY);
    for (gpu, minor) in gpus.iter_mut().zip(MINORS) {
        gpu.minor = minor;
    }
    gpus
}

/// Fake GPU device nodes on the host, in a directory of the test's own.
struct FakeNodes {
    dir: tempfile::TempDir,
}

impl FakeNodes {
    fn new() -> Result<FakeNodes> {
        let dir = tempfile::Builder::new()
            .prefix("gme2e-dev.")
            .tempdir()
            .context("creating the fake device node dir")?;
        Ok(FakeNodes { dir })
    }

    /// A character device 195:<minor>, as the driver makes /dev/nvidia<minor>.
    fn make(&self, minor: u32) -> Result<PathBuf> {
        let path = self.dir.path().join(format!("nvidia-fake-{minor}"));
        make_gpu_node(&path, minor)?;
        Ok(path)
    }
}

/// A pod of the gpu-mps runtime class, 2Gi/30% per container.
fn gpu_pod(name: &str) -> PodSpec {
    PodSpec::new(name, "default", GPU_MPS_HANDLER).gpu_limits("2Gi", 30)
}

/// A container running `checker report` and staying up; no GPU of its own.
fn report_container(name: &str) -> ContainerSpec {
    ContainerSpec::new(name, TEST_IMAGE)
        .command(&["/checker"])
        .args(&["report", HOLD])
}

/// The CRI `devices` entry a device plugin's Allocate gives for a GPU: the host node at
/// [`CONTAINER_NODE`].
fn cri_device(host: &Path) -> cri::Device {
    cri::Device {
        container_path: CONTAINER_NODE.into(),
        host_path: host.display().to_string(),
        permissions: "rw".into(),
    }
}

fn with_device(mut spec: ContainerSpec, host: &Path) -> ContainerSpec {
    spec.devices.push(cri_device(host));
    spec
}

/// CreateContainer + StartContainer, as kubelet does; the error is the CRI status.
async fn create_and_start(
    cri: &mut CriClient,
    pod: &Pod,
    spec: &ContainerSpec,
) -> Result<Container, tonic::Status> {
    let container = cri.create_container(pod, spec).await?;
    cri.start_container(&container).await?;
    Ok(container)
}

/// The linux.devices entry runc got at [`CONTAINER_NODE`], as (major, minor).
fn device_numbers(node: &GpuNode, container: &Container) -> Result<Option<(u64, u64)>> {
    let spec = node.containerd.bundle_spec(CRI_NAMESPACE, &container.id)?;
    let devices = spec.pointer("/linux/devices").and_then(|d| d.as_array());
    Ok(devices
        .into_iter()
        .flatten()
        .find(|d| d["path"] == CONTAINER_NODE)
        .map(|d| (d["major"].as_u64().unwrap_or(0), d["minor"].as_u64().unwrap_or(0))))
}

/// The container runs on MPS with its GPU, and only that one: the checker inside sees the
/// read-only /tmp/nvidia-mps with a control socket and a memory limit for one GPU; the shim
/// named `gpu_uuid`'s daemon; the manager holds its lease on that GPU alone, and no daemon of
/// the node spans two GPUs.
async fn runs_on_its_gpu_only(
    node: &GpuNode,
    cri: &mut CriClient,
    container: &Container,
    gpu_uuid: &str,
) -> Result<Report> {
    let report = Report::parse(&cri.first_stdout_line(container, WAIT).await?)?;
    println!("{}: checker report: {report}", container.name);
    let pipe = &report.mps_pipe_dir;
    let mount = pipe
        .mount
        .as_ref()
        .with_context(|| format!("{}: no mount at /tmp/nvidia-mps: {pipe:?}", container.name))?;
    ensure!(
        pipe.is_mount_point && mount.has_option("ro") && pipe.control_exists && pipe.control_is_socket,
        "{}: /tmp/nvidia-mps is not a read-only mount with a control socket: {pipe:?}",
        container.name
    );
    let memory = report.env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT").unwrap_or("");
    ensure!(
        memory.starts_with("0=") && !memory.contains(','),
        "{}: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={memory:?}, expected one GPU's limit",
        container.name
    );
    let spec = node.containerd.bundle_spec(CRI_NAMESPACE, &container.id)?;
    ensure!(
        spec["annotations"][DAEMON].as_str() == Some(gpu_uuid),
        "{}: the shim did not serve it from {gpu_uuid}'s daemon: {}",
        container.name,
        spec["annotations"]
    );
    let status = node.manager.status().await?;
    let lease = status
        .lease(&container.id)
        .with_context(|| format!("no lease of container {}: {status:#?}", container.name))?;
    ensure!(
        lease.gpu_uuids == [gpu_uuid],
        "{}: lease on {:?}, expected [{gpu_uuid}]",
        container.name,
        lease.gpu_uuids
    );
    ensure!(
        status.daemons.iter().all(|d| d.gpu_uuids.len() == 1),
        "a daemon spans several GPUs: {status:#?}"
    );
    Ok(report)
}

/// The CRI `devices` field, as a device plugin's Allocate fills it:
/// (a) GPU 1's node (minor 2) at /dev/nvidia0 and nothing else: the container gets GPU 1's
///     daemon (found by the minor, not by the path);
/// (c) GPU 0's node and the pod's own NVIDIA_VISIBLE_DEVICES=all: GPU 0 only;
/// (d) a node whose minor no GPU has: StartContainer fails with the shim's one line.
async fn device_nodes_of_the_cri_devices_field(suite: Suite) -> Result<()> {
    let nodes = FakeNodes::new()?;
    let node = GpuNode::start_with_gpus(&suite, LimitsConfig::uniform(), gpus_with_minors()).await?;
    let mut cri = node.cri().await?;
    let (gpu0, gpu1) = (node.gpu_uuid(0).to_string(), node.gpu_uuid(1).to_string());
    let pod = cri.run_pod_sandbox(&gpu_pod("devices")).await?;

    let only = with_device(report_container("node-only"), &nodes.make(MINORS[1])?);
    let only = create_and_start(&mut cri, &pod, &only)
        .await
        .context("(a) starting a container whose GPU is only a CRI device node")?;
    let report = runs_on_its_gpu_only(&node, &mut cri, &only, &gpu1)
        .await
        .context("(a) a GPU only in the CRI devices field")?;
    ensure!(
        report.env("NVIDIA_VISIBLE_DEVICES").is_none(),
        "(a) the container has an NVIDIA_VISIBLE_DEVICES: {report}"
    );
    let numbers = device_numbers(&node, &only)?;
    ensure!(
        numbers == Some((NVIDIA_MAJOR, u64::from(MINORS[1]))),
        "(a) runc got {CONTAINER_NODE} as {numbers:?}"
    );
    println!(
        "(a) {}: {CONTAINER_NODE} = 195:{} only: GPU 1's daemon ({gpu1})",
        suite.containerd_version, MINORS[1]
    );

    let widened = with_device(report_container("node-and-env-all"), &nodes.make(MINORS[0])?).gpu("all");
    let widened = create_and_start(&mut cri, &pod, &widened)
        .await
        .context("(c) starting a container with a device node and NVIDIA_VISIBLE_DEVICES=all")?;
    let report = runs_on_its_gpu_only(&node, &mut cri, &widened, &gpu0)
        .await
        .context("(c) NVIDIA_VISIBLE_DEVICES=all beside GPU 0's node")?;
    // Narrowed by the shim to the GPU the container was given, so that a runtime after it
    // (nvidia-container-runtime) cannot hand it the others.
    ensure!(
        report.env("NVIDIA_VISIBLE_DEVICES") == Some(gpu0.as_str()),
        "(c) the pod's NVIDIA_VISIBLE_DEVICES=all was not narrowed to GPU 0: {report}"
    );
    println!(
        "(c) {}: the pod's NVIDIA_VISIBLE_DEVICES=all beside 195:{}: GPU 0's daemon only ({gpu0}), env narrowed to it",
        suite.containerd_version, MINORS[0]
    );

    let unknown = with_device(report_container("unknown-minor"), &nodes.make(UNKNOWN_MINOR)?);
    let message = match create_and_start(&mut cri, &pod, &unknown).await {
        Ok(container) => bail!(
            "(d) container {} with {CONTAINER_NODE} = 195:{UNKNOWN_MINOR} started; expected a refusal",
            container.name
        ),
        Err(status) => status.message().to_string(),
    };
    println!("(d) {}: refused as expected: {message}", suite.containerd_version);
    let shim_line = format!(
        "linux.devices {CONTAINER_NODE} (195:{UNKNOWN_MINOR}): no GPU of this node has device minor {UNKNOWN_MINOR} (known minors: {}=GPU 0 {gpu0}, {}=GPU 1 {gpu1})",
        MINORS[0], MINORS[1]
    );
    ensure!(
        message.contains(&shim_line),
        "(d) the CRI error does not carry the shim's line {shim_line:?}: {message}"
    );
    let status = node.manager.status().await?;
    ensure!(
        status.leases.len() == 2,
        "(d) the refused container changed the leases: {status:#?}"
    );

    cri.delete_container(&only).await?;
    cri.delete_container(&widened).await?;
    node.manager
        .wait_status("leases released", WAIT, |s| s.leases.is_empty())
        .await?;
    cri.delete_pod(&pod).await?;
    Ok(())
}

/// (b) CDI through the CRI `CDIDevices` field (kubelet's way for a device plugin's CDI devices):
/// containerd resolves `nvidia.com/gpu=<GPU 0>` against the test's CDI spec, whose edits add
/// GPU 0's node at /dev/nvidia0, so the spec reaches the shim with the node in linux.devices and
/// no CDI annotation. containerd 1.6 has no CDI: the field is dropped, the container gets no
/// node, and it runs without a GPU (passed through).
async fn device_node_of_a_cri_cdi_device(suite: Suite) -> Result<()> {
    let nodes = FakeNodes::new()?;
    let gpus = gpus_with_minors();
    let gpu0 = gpus[0].uuid.clone();
    let cdi = CdiOptions {
        enabled: Some(true),
        specs: vec![cdi::gpu_node_spec(&[(gpu0.clone(), nodes.make(MINORS[0])?)])],
    };
    let node = GpuNode::start_with(&suite, LimitsConfig::uniform(), gpus, cdi).await?;
    let mut cri = node.cri().await?;
    let pod = cri.run_pod_sandbox(&gpu_pod("cdi-devices")).await?;
    let spec = report_container("cdi-device");
    let container = create_with_cdi_devices(&node, &pod, &spec, &[cdi::gpu_device(&gpu0)])
        .await
        .context("(b) CreateContainer with CDIDevices")?;
    cri.start_container(&container)
        .await
        .context("(b) starting a container whose GPU is a CRI CDI device")?;
    let numbers = device_numbers(&node, &container)?;
    let bundle = node.containerd.bundle_spec(CRI_NAMESPACE, &container.id)?;
    let cdi_annotations: Vec<&String> = bundle["annotations"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, _)| k)
        .filter(|k| k.starts_with(gpu_mps_api::annotations::CDI_PREFIX))
        .collect();
    if suite.has_cdi() {
        ensure!(
            numbers == Some((NVIDIA_MAJOR, u64::from(MINORS[0]))),
            "(b) containerd did not resolve the CDI device into {CONTAINER_NODE}: {numbers:?}"
        );
        let report = runs_on_its_gpu_only(&node, &mut cri, &container, &gpu0)
            .await
            .context("(b) a GPU of a CRI CDI device")?;
        ensure!(
            report.env("NVIDIA_VISIBLE_DEVICES") == Some("void"),
            "(b) the CDI spec's edits did not apply: {report}"
        );
        println!(
            "(b) {}: CDIDevices nvidia.com/gpu={gpu0} resolved to {CONTAINER_NODE} = 195:{} (CDI annotations in the spec: {cdi_annotations:?}): GPU 0's daemon",
            suite.containerd_version, MINORS[0]
        );
    } else {
        let report = Report::parse(&cri.first_stdout_line(&container, WAIT).await?)?;
        ensure!(
            numbers.is_none() && !report.mps_pipe_dir.exists,
            "(b) containerd without CDI gave the container a node {numbers:?} or MPS: {report}"
        );
        let status = node.manager.status().await?;
        ensure!(status.leases.is_empty(), "(b) a lease without a GPU: {status:#?}");
        println!(
            "(b) {}: no CDI: the CDIDevices field is dropped, no device node, passed through",
            suite.containerd_version
        );
    }
    cri.delete_container(&container).await?;
    cri.delete_pod(&pod).await?;
    Ok(())
}

/// CreateContainer with the CRI `CDIDevices` field, which the harness's ContainerSpec does not
/// carry: the same request as CriClient::create_container, sent on a connection of its own.
async fn create_with_cdi_devices(
    node: &GpuNode,
    pod: &Pod,
    spec: &ContainerSpec,
    cdi_devices: &[String],
) -> Result<Container> {
    let socket = node.containerd.socket().to_path_buf();
    let channel = Endpoint::try_from("http://[::]:0")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
        }))
        .await
        .context("connecting to containerd's CRI socket")?;
    let mut runtime = RuntimeServiceClient::new(channel);
    let host_network = cri::NamespaceOption {
        network: cri::NamespaceMode::Node as i32,
        pid: cri::NamespaceMode::Container as i32,
        ipc: cri::NamespaceMode::Pod as i32,
        ..Default::default()
    };
    // What kubelet sends again with every CreateContainer: the pod's sandbox config.
    let sandbox_config = cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: pod.spec.name.clone(),
            uid: pod.spec.uid.clone(),
            namespace: pod.spec.namespace.clone(),
            attempt: 0,
        }),
        log_directory: pod.log_directory.display().to_string(),
        annotations: pod.spec.annotations.clone(),
        labels: HashMap::from([
            ("io.kubernetes.pod.name".into(), pod.spec.name.clone()),
            ("io.kubernetes.pod.namespace".into(), pod.spec.namespace.clone()),
            ("io.kubernetes.pod.uid".into(), pod.spec.uid.clone()),
        ]),
        linux: Some(cri::LinuxPodSandboxConfig {
            security_context: Some(cri::LinuxSandboxSecurityContext {
                namespace_options: Some(host_network.clone()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
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
        labels: HashMap::from([("io.kubernetes.container.name".into(), spec.name.clone())]),
        log_path: log_name.clone(),
        linux: Some(cri::LinuxContainerConfig {
            security_context: Some(cri::LinuxContainerSecurityContext {
                namespace_options: Some(host_network),
                ..Default::default()
            }),
            ..Default::default()
        }),
        cdi_devices: cdi_devices
            .iter()
            .map(|name| cri::CdiDevice { name: name.clone() })
            .collect(),
        ..Default::default()
    };
    let request = cri::CreateContainerRequest {
        pod_sandbox_id: pod.id.clone(),
        config: Some(config),
        sandbox_config: Some(sandbox_config),
    };
    let id = runtime.create_container(request).await?.into_inner().container_id;
    Ok(Container {
        id,
        name: spec.name.clone(),
        pod_id: pod.id.clone(),
        log_path: pod.log_directory.join(log_name),
    })
}
