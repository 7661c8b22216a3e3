//! Where a container's GPUs come from, through the CRI runtime handler `gpu-mps` with this
//! harness playing kubelet (issue 21, items 2 and 3):
//! - on a node as shipped (`[gpus] trust_visible_devices_env = false`), a container that got no
//!   GPU from the scheduler and names one in its own NVIDIA_VISIBLE_DEVICES is refused with one
//!   line; one whose env says `all` (every CUDA image's default) runs as a container without a
//!   GPU: no gate, no lease, no daemon, and its env set to `void` so that the chained toolkit
//!   would hand it none either;
//! - where the node trusts the env (the device plugin's envvar strategy), `all` is still refused:
//!   never a daemon over every GPU from a pod's own env;
//! - NVIDIA's k8s-device-plugin under its `cdi-annotations` strategy writes the container
//!   annotation `cdi.k8s.io/nvidia-device-plugin_<response uuid>:
//!   k8s.device-plugin.nvidia.com/gpu=<GPU uuid>` (its vendor is fixed in its source): the
//!   container gets its gate and a lease on exactly that GPU, on containerd 1.6 (no CDI), 1.7 (CDI
//!   off by default: the annotation passes through unresolved) and 2.x (resolved against the
//!   plugin's spec of that kind, which the test writes).
//!
//! Needs the workspace built (`cargo build --workspace`) and the static checker; see
//! gpu_mps_e2e::binaries. Run: `cargo test -p gpu-mps-e2e --test cri_gpu_sources -- --nocapture`.

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use gpu_mps_api::annotations::DAEMON;
use gpu_mps_e2e::checker::{CheckerLine, Report};
use gpu_mps_e2e::containerd::{CRI_NAMESPACE, GPU_MPS_HANDLER};
use gpu_mps_e2e::cri::{Container, Pod};
use gpu_mps_e2e::image::TEST_IMAGE;
use gpu_mps_e2e::manager::{FAKE_GPU_MEMORY, fake_gpus};
use gpu_mps_e2e::{
    CdiOptions, ContainerSpec, CriClient, GpuNode, LimitsConfig, PodSpec, StatusLookup, Suite, per_suite,
};
use serde_json::json;

per_suite!(
    an_env_only_gpu_is_refused_or_none_on_a_node_as_shipped,
    an_env_only_all_is_refused_where_the_env_is_trusted,
    the_device_plugins_cdi_annotation_gets_exactly_its_gpu,
);

const WAIT: Duration = Duration::from_secs(20);
/// Long enough to outlive any test; containers are removed (or killed) before.
const HOLD: &str = "--hold-seconds=300";
/// The CDI kind NVIDIA's device plugin names its GPUs by.
const PLUGIN_GPU_KIND: &str = "k8s.device-plugin.nvidia.com/gpu";
/// The key the plugin's Allocate gives: `nvidia-device-plugin_` and a fresh UUID per response.
const PLUGIN_ANNOTATION: &str = "cdi.k8s.io/nvidia-device-plugin_5e0c9a3f-2b7d-4c1e-8f6a-9d0b1c2e3f4a";

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

/// The CRI error of a refused container, checked to hold each of `needles` on one line.
fn expect_refusal(result: Result<Container, tonic::Status>, needles: &[&str]) -> Result<String> {
    let status = match result {
        Ok(container) => bail!(
            "container {} started, expected a refusal mentioning {needles:?}",
            container.name
        ),
        Err(status) => status,
    };
    let message = status.message().to_string();
    println!("refused as expected ({:?}): {message}", status.code());
    for needle in needles {
        ensure!(
            message.contains(needle),
            "the CRI error does not mention {needle:?}: {message}"
        );
    }
    Ok(message)
}

/// The node holds no lease, runs no daemon and has no gate dir.
async fn nothing_on_the_node(node: &GpuNode, what: &str) -> Result<()> {
    let status = node.manager.status().await?;
    ensure!(
        status.leases.is_empty() && status.daemons.is_empty(),
        "{what}: a lease or a daemon: {status:#?}"
    );
    let gates = node.manager.gate_dir_names();
    ensure!(gates.is_empty(), "{what}: gate dirs {gates:?}");
    Ok(())
}

async fn an_env_only_gpu_is_refused_or_none_on_a_node_as_shipped(suite: Suite) -> Result<()> {
    let node = GpuNode::start(&suite, LimitsConfig::uniform().env_untrusted()).await?;
    let mut cri = node.cri().await?;
    let pod = cri.run_pod_sandbox(&gpu_pod("env-only")).await?;

    let uuid = node.gpu_uuid(1).to_string();
    // StartContainer is what fails (runc's create): each attempt has a name of its own.
    for (i, value) in ["0", uuid.as_str()].into_iter().enumerate() {
        let name = format!("env-names-{i}");
        let result = create_and_start(&mut cri, &pod, &report_container(&name).gpu(value)).await;
        let message = expect_refusal(
            result,
            &[
                &format!("NVIDIA_VISIBLE_DEVICES={value:?} names GPUs, but none was scheduled"),
                "[gpus] trust_visible_devices_env = true",
            ],
        )?;
        ensure!(!message.contains('\n'), "not one line: {message:?}");
        nothing_on_the_node(&node, &format!("after NVIDIA_VISIBLE_DEVICES={value}")).await?;
    }

    // A CUDA image's default, and no GPU scheduled: a container without a GPU.
    let container = create_and_start(&mut cri, &pod, &report_container("cuda-image").gpu("all"))
        .await
        .context("a container whose env says NVIDIA_VISIBLE_DEVICES=all and that got no GPU")?;
    let report = Report::parse(&cri.first_stdout_line(&container, WAIT).await?)?;
    println!("cuda-image: checker report: {report}");
    ensure!(
        report.env("NVIDIA_VISIBLE_DEVICES") == Some("void"),
        "the env was not voided: {report}"
    );
    ensure!(
        report.mps_env().is_empty(),
        "MPS env in a container without a GPU: {report}"
    );
    let pipe = &report.mps_pipe_dir;
    ensure!(
        !pipe.exists && !pipe.is_mount_point && !pipe.control_exists,
        "a container without a GPU sees /tmp/nvidia-mps: {pipe:?}"
    );
    let spec = node.containerd.bundle_spec(CRI_NAMESPACE, &container.id)?;
    ensure!(
        spec["annotations"].get(DAEMON).is_none() && spec.get("hooks").is_none(),
        "the shim laid it out as a GPU container: {spec}"
    );
    nothing_on_the_node(&node, "a running container without a GPU").await?;
    println!(
        "{}: NVIDIA_VISIBLE_DEVICES=0 and =<uuid> refused, =all ran without a GPU (env void), no lease, no daemon, no gate",
        suite.containerd_version
    );
    cri.delete_container(&container).await?;
    cri.delete_pod(&pod).await?;
    Ok(())
}

async fn an_env_only_all_is_refused_where_the_env_is_trusted(suite: Suite) -> Result<()> {
    let node = GpuNode::start(&suite, LimitsConfig::uniform()).await?;
    ensure!(node.manager.config().gpus.trust_visible_devices_env);
    let mut cri = node.cri().await?;
    let pod = cri.run_pod_sandbox(&gpu_pod("env-all")).await?;
    for (i, value) in ["all", "0,all"].into_iter().enumerate() {
        let name = format!("env-all-{i}");
        let result = create_and_start(&mut cri, &pod, &report_container(&name).gpu(value)).await;
        expect_refusal(
            result,
            &[
                &format!("NVIDIA_VISIBLE_DEVICES={value:?} with no GPU scheduled"),
                "never all",
            ],
        )?;
        nothing_on_the_node(&node, &format!("after NVIDIA_VISIBLE_DEVICES={value}")).await?;
    }
    println!(
        "{}: under trust_visible_devices_env, an env-only `all` refused: no daemon over every GPU",
        suite.containerd_version
    );
    cri.delete_pod(&pod).await?;
    Ok(())
}

/// A CDI spec file (name, JSON) of the plugin's kind naming `uuid`, its edits setting only
/// NVIDIA_VISIBLE_DEVICES=void (there is no GPU, so no device node).
fn plugin_spec(uuid: &str) -> (String, String) {
    let spec = json!({
        "cdiVersion": "0.5.0",
        "kind": PLUGIN_GPU_KIND,
        "devices": [{"name": uuid, "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}}],
    });
    ("k8s.device-plugin.nvidia.com-gpu.json".into(), spec.to_string())
}

async fn the_device_plugins_cdi_annotation_gets_exactly_its_gpu(suite: Suite) -> Result<()> {
    let gpus = fake_gpus(2, FAKE_GPU_MEMORY);
    let uuid = gpus[1].uuid.clone();
    let cdi = CdiOptions {
        enabled: None,
        specs: vec![plugin_spec(&uuid)],
    };
    // As shipped: the env names no GPU, so only the annotation can.
    let node = GpuNode::start_with(&suite, LimitsConfig::uniform().env_untrusted(), gpus, cdi).await?;
    let mut cri = node.cri().await?;
    let pod = cri.run_pod_sandbox(&gpu_pod("plugin-cdi")).await?;
    let device = format!("{PLUGIN_GPU_KIND}={uuid}");
    // A CUDA image (NVIDIA_VISIBLE_DEVICES=all) given GPU 1 by the plugin.
    let spec = report_container("infer")
        .gpu("all")
        .annotation(PLUGIN_ANNOTATION, &device);
    let container = create_and_start(&mut cri, &pod, &spec)
        .await
        .with_context(|| format!("starting a container given {device} by the device plugin"))?;
    let report = Report::parse(&cri.first_stdout_line(&container, WAIT).await?)?;
    println!("infer: checker report: {report}");

    let pipe = &report.mps_pipe_dir;
    let mount = pipe.mount.as_ref().context("no mount at /tmp/nvidia-mps")?;
    ensure!(
        pipe.is_mount_point
            && mount.has_option("ro")
            && pipe.entries == ["control"]
            && pipe.control_is_socket,
        "/tmp/nvidia-mps is not the container's gate: {pipe:?}"
    );
    let gate = node.manager.gate_dir(&container.id);
    ensure!(
        mount.is_bind_of(&gate.to_string_lossy()),
        "/tmp/nvidia-mps is {}, not the container's gate {}",
        mount.root,
        gate.display()
    );
    let memory = report.env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT").unwrap_or("");
    ensure!(
        memory == "0=2048M",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={memory:?}, expected one GPU's 2Gi"
    );

    let bundle = node.containerd.bundle_spec(CRI_NAMESPACE, &container.id)?;
    let annotations = &bundle["annotations"];
    ensure!(
        annotations[PLUGIN_ANNOTATION].as_str() == Some(device.as_str())
            && annotations[DAEMON].as_str() == Some(uuid.as_str()),
        "the spec lacks the plugin's annotation or was not served by {uuid}'s daemon: {annotations}"
    );
    let status = node.manager.status().await?;
    let lease = status
        .lease(&container.id)
        .with_context(|| format!("no lease of the container: {status:#?}"))?;
    ensure!(
        lease.gpu_uuids == [uuid.as_str()],
        "lease on {:?}, expected exactly [{uuid}]",
        lease.gpu_uuids
    );
    ensure!(
        status.daemons.len() == 1 && status.daemons[0].gpu_uuids == [uuid.as_str()],
        "expected one daemon, on {uuid} alone: {status:#?}"
    );
    // Unresolved (1.6; 1.7 with CDI off by default), the shim narrowed the image's `all` to the
    // plugin's GPU; resolved (2.x), the plugin's spec set it to void after the image's.
    let resolved = suite.cdi_by_default();
    let visible = report.env("NVIDIA_VISIBLE_DEVICES");
    if resolved {
        ensure!(
            visible != Some("all"),
            "NVIDIA_VISIBLE_DEVICES=all reached the container: {report}"
        );
    } else {
        ensure!(
            visible == Some(uuid.as_str()),
            "NVIDIA_VISIBLE_DEVICES {visible:?}, expected the plugin's GPU {uuid}"
        );
    }
    println!(
        "{}: {device} ({}) got its gate and a lease on exactly {uuid}; NVIDIA_VISIBLE_DEVICES {visible:?}",
        suite.containerd_version,
        if resolved {
            "resolved by containerd against the plugin's spec"
        } else {
            "passed through unresolved"
        }
    );
    cri.delete_container(&container).await?;
    node.manager
        .wait_status("the lease released", WAIT, |s| s.leases.is_empty())
        .await?;
    cri.delete_pod(&pod).await?;
    Ok(())
}
