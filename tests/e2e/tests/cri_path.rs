//! gpu-mps through the CRI runtime handler `gpu-mps`, with this harness playing kubelet and the
//! device plugin (it sets NVIDIA_VISIBLE_DEVICES, or a CDI annotation): sharing, policies,
//! tenancy, capacity, idle shutdown, GPUs handed over through CDI, and the messages a CRI client
//! sees when gpu-mps refuses a container.
//!
//! Needs the workspace built (`cargo build --workspace`) and the static checker; see
//! gpu_mps_e2e::binaries. Run: `cargo test -p gpu-mps-e2e --test cri_path -- --nocapture`.

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use gpu_mps_api::annotations::DAEMON;
use gpu_mps_api::node_config::Tenancy;
use gpu_mps_e2e::cdi::{self, DEVICE_PLUGIN_ANNOTATION};
use gpu_mps_e2e::checker::{CONTAINER_PIPE_DIR, CheckerLine, MpsClient, Report};
use gpu_mps_e2e::containerd::{CRI_NAMESPACE, GPU_MPS_HANDLER};
use gpu_mps_e2e::cri::{Container, Pod};
use gpu_mps_e2e::image::{NVIDIA_SMI_PATH, TEST_IMAGE};
use gpu_mps_e2e::manager::{FAKE_GPU_MEMORY, IDLE_GRACE_SECONDS, fake_gpus};
use gpu_mps_e2e::{
    CdiOptions, ContainerSpec, CriClient, GpuNode, LimitsConfig, PodSpec, StatusLookup, Suite, per_suite,
    processes,
};

per_suite!(
    two_containers_share_one_daemon,
    uniform_refuses_another_class_until_it_left,
    ceiling_runs_mixed_sizes,
    exclusive_tenancy_refuses_another_namespace,
    bad_requests_fail_with_their_message,
    cdi_annotation_gets_its_gpus_daemon,
    cdi_annotation_without_a_cdi_spec,
    exact_holds_each_container_to_its_own_limits,
    exact_a_stalled_client_holds_nobody,
    exact_gates_come_back_after_a_manager_restart,
    a_create_with_the_manager_down_fails_within_one_hook_timeout_and_leaves_nothing,
    a_create_with_the_manager_hung_fails_within_one_hook_timeout_and_all_is_consistent_after,
);

const GIB: u64 = 1 << 30;
const WAIT: Duration = Duration::from_secs(20);
/// Long enough to outlive any test; containers are removed (or killed) before.
const HOLD: &str = "--hold-seconds=300";

/// A pod of the gpu-mps runtime class.
fn gpu_pod(name: &str, namespace: &str) -> PodSpec {
    PodSpec::new(name, namespace, GPU_MPS_HANDLER)
}

/// A container on `gpu` that connects to its MPS daemon as a CUDA process would, prints what
/// the daemon said, and stays connected.
fn client_container(name: &str, gpu: &str) -> ContainerSpec {
    ContainerSpec::new(name, TEST_IMAGE)
        .command(&["/checker"])
        .args(&["mps-client", HOLD])
        .gpu(gpu)
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

/// Starts a client container and returns it with what the daemon told it.
async fn start_client(
    cri: &mut CriClient,
    pod: &Pod,
    spec: &ContainerSpec,
) -> Result<(Container, MpsClient)> {
    let container = create_and_start(cri, pod, spec)
        .await
        .with_context(|| format!("starting container {} in pod {}", spec.name, pod.spec.name))?;
    let line = cri.first_stdout_line(&container, WAIT).await?;
    let client = MpsClient::parse(&line)?;
    ensure!(
        client.admitted,
        "container {} did not reach its MPS daemon: {}",
        spec.name,
        client
    );
    Ok((container, client))
}

/// The CUDA_MPS_* variables of a running container's process, read from the host (an exec
/// would not do: CRI builds an exec's environment from the spec it stored, not from the
/// config.json the shim rewrote).
fn mps_environ(node: &GpuNode, container: &Container) -> Result<Vec<String>> {
    let pid = node
        .containerd
        .container_pid(CRI_NAMESPACE, &container.id)
        .with_context(|| format!("runc has no state for container {}", container.name))?;
    let mut env: Vec<String> = processes::environ(pid)?
        .into_iter()
        .filter(|v| v.starts_with("CUDA_MPS_"))
        .collect();
    env.sort();
    Ok(env)
}

fn expected_env(memory_mib: u64, threads: u8) -> Vec<String> {
    vec![
        format!("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={threads}"),
        format!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={memory_mib}M"),
        format!("CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}"),
    ]
}

/// The message of a refused StartContainer, which must contain every one of `needles`.
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

/// Two pods on one GPU share ONE daemon (one server); removal releases the leases; the idle
/// daemon stops after the grace period.
async fn two_containers_share_one_daemon(suite: Suite) -> Result<()> {
    let node = GpuNode::start(&suite, LimitsConfig::uniform()).await?;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    let pod_a = cri
        .run_pod_sandbox(&gpu_pod("infer-a", "default").gpu_limits("4Gi", 25))
        .await?;
    let pod_b = cri
        .run_pod_sandbox(&gpu_pod("infer-b", "default").gpu_limits("4Gi", 25))
        .await?;
    let (a, client_a) = start_client(&mut cri, &pod_a, &client_container("infer", &gpu)).await?;
    let (b, client_b) = start_client(&mut cri, &pod_b, &client_container("infer", &gpu)).await?;

    for (container, client) in [(&a, &client_a), (&b, &client_b)] {
        ensure!(
            client.threads.as_deref() == Some("25.0"),
            "{}: server threads: {}",
            container.id,
            client
        );
        ensure!(
            client.mem.get("0").map(String::as_str) == Some("4G"),
            "{}: server memory: {}",
            container.id,
            client
        );
        ensure!(
            mps_environ(&node, container)? == expected_env(4096, 25),
            "{}: env {:?}",
            container.id,
            mps_environ(&node, container)?
        );
    }
    ensure!(
        client_a.server_pid == client_b.server_pid,
        "two servers: {} / {}",
        client_a,
        client_b
    );

    let status = node.manager.status().await?;
    let daemons = status.daemons_of(&gpu);
    ensure!(
        daemons.len() == 1 && status.daemons.len() == 1,
        "expected one daemon: {status:#?}"
    );
    ensure!(
        daemons[0].leases == 2,
        "expected 2 leases on the daemon: {status:#?}"
    );
    ensure!(
        status.lease(&a.id).is_some() && status.lease(&b.id).is_some(),
        "leases: {status:#?}"
    );
    let control_pid = daemons[0].control_pid;
    ensure!(
        processes::alive(control_pid),
        "the daemon's control pid {control_pid} does not run"
    );

    // An exec session sees the pod's mounts and masks (it joins the container's namespaces).
    let exec = cri
        .exec_sync(&a, &["/checker", "report"], Duration::from_secs(20))
        .await?;
    let seen = Report::parse(exec.last_line())?;
    let smi_masked = seen.nvidia_smi.get(NVIDIA_SMI_PATH).is_some_and(|s| s.masked);
    ensure!(
        seen.mps_pipe_dir.control_is_socket && smi_masked,
        "an exec session does not see the pipe dir or the nvidia-smi mask: {}",
        seen
    );
    println!(
        "exec session CUDA_MPS env (CRI builds it from its stored spec): {:?}",
        seen.mps_env()
    );

    cri.delete_container(&a).await?;
    cri.delete_container(&b).await?;
    node.manager
        .wait_status("leases released on removal", WAIT, |s| s.leases.is_empty())
        .await?;
    let grace = Duration::from_secs(IDLE_GRACE_SECONDS);
    node.manager
        .wait_status("idle daemon stopped", grace + WAIT, |s| s.daemons.is_empty())
        .await?;
    ensure!(
        processes::wait_gone(&[control_pid], WAIT),
        "the fake daemon {control_pid} still runs after the idle grace"
    );
    cri.delete_pod(&pod_a).await?;
    cri.delete_pod(&pod_b).await?;
    Ok(())
}

/// Policy uniform: a GPU serves one limit class at a time. Another class is refused at
/// StartContainer with the current class in the message, and starts once that class is gone.
async fn uniform_refuses_another_class_until_it_left(suite: Suite) -> Result<()> {
    let node = GpuNode::start(&suite, LimitsConfig::uniform()).await?;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    let small = cri
        .run_pod_sandbox(&gpu_pod("small", "default").gpu_limits("4Gi", 25))
        .await?;
    let large = cri
        .run_pod_sandbox(&gpu_pod("large", "default").gpu_limits("8Gi", 50))
        .await?;
    let (first, _) = start_client(&mut cri, &small, &client_container("infer", &gpu)).await?;

    let refused = cri
        .create_container(&large, &client_container("infer", &gpu))
        .await?;
    let result = cri.start_container(&refused).await.map(|()| refused.clone());
    expect_refusal(result, &[&gpu, "limit class 4Gi/25%"])?;
    let status = node.manager.status().await?;
    ensure!(
        status.lease(&refused.id).is_none() && status.leases.len() == 1,
        "the refused container holds a lease: {status:#?}"
    );

    // kubelet retries with a new container once the first class has left.
    cri.remove_container(&refused).await?;
    cri.delete_container(&first).await?;
    node.manager
        .wait_status("the 4Gi/25% lease released", WAIT, |s| s.leases.is_empty())
        .await?;
    let (second, client) = start_client(&mut cri, &large, &client_container("infer", &gpu)).await?;
    ensure!(
        client.threads.as_deref() == Some("50.0"),
        "server threads after the class changed: {}",
        client
    );
    ensure!(
        client.mem.get("0").map(String::as_str) == Some("8G"),
        "server memory after the class changed: {}",
        client
    );
    ensure!(
        mps_environ(&node, &second)? == expected_env(8192, 50),
        "env {:?}",
        mps_environ(&node, &second)?
    );
    cri.delete_container(&second).await?;
    cri.delete_pod(&small).await?;
    cri.delete_pod(&large).await?;
    Ok(())
}

/// Policy ceiling (8Gi / 50 %): 4Gi/25% and 8Gi/50% containers share the GPU's server, which
/// enforces the ceiling; each container's env has its own limits. The small one gets its
/// limits from a container-level annotation, which beats the pod-level one.
async fn ceiling_runs_mixed_sizes(suite: Suite) -> Result<()> {
    let node = GpuNode::start(&suite, LimitsConfig::ceiling("8Gi", 50)).await?;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    let mixed = gpu_pod("mixed", "default")
        .gpu_limits("8Gi", 50)
        .container_gpu_limits("small", "4Gi", 25);
    let mixed = cri.run_pod_sandbox(&mixed).await?;
    let large = cri
        .run_pod_sandbox(&gpu_pod("large", "default").gpu_limits("8Gi", 50))
        .await?;
    let (small_c, small_client) = start_client(&mut cri, &mixed, &client_container("small", &gpu)).await?;
    let (large_c, large_client) = start_client(&mut cri, &large, &client_container("large", &gpu)).await?;

    ensure!(
        mps_environ(&node, &small_c)? == expected_env(4096, 25),
        "small env {:?}",
        mps_environ(&node, &small_c)?
    );
    ensure!(
        mps_environ(&node, &large_c)? == expected_env(8192, 50),
        "large env {:?}",
        mps_environ(&node, &large_c)?
    );
    for client in [&small_client, &large_client] {
        ensure!(
            client.threads.as_deref() == Some("50.0")
                && client.mem.get("0").map(String::as_str) == Some("8G"),
            "the server does not enforce the ceiling 8Gi/50%: {}",
            client
        );
    }
    ensure!(
        small_client.server_pid == large_client.server_pid,
        "two servers on one GPU"
    );

    let status = node.manager.status().await?;
    ensure!(status.policy == "ceiling", "policy {:?}", status.policy);
    let daemons = status.daemons_of(&gpu);
    ensure!(
        daemons.len() == 1 && daemons[0].leases == 2,
        "expected one daemon with 2 leases: {status:#?}"
    );
    let limits = |id: &str| {
        status
            .lease(id)
            .map(|l| (l.memory_limit_bytes, l.active_thread_percentage))
    };
    ensure!(
        limits(&small_c.id) == Some((4 * GIB, 25)),
        "small lease: {:?}",
        status.lease(&small_c.id)
    );
    ensure!(
        limits(&large_c.id) == Some((8 * GIB, 50)),
        "large lease: {:?}",
        status.lease(&large_c.id)
    );
    cri.delete_container(&small_c).await?;
    cri.delete_container(&large_c).await?;
    cri.delete_pod(&mixed).await?;
    cri.delete_pod(&large).await?;
    Ok(())
}

/// Tenancy exclusive: a GPU serves one namespace at a time; another namespace's pod is
/// refused on the busy GPU and runs on a free one.
async fn exclusive_tenancy_refuses_another_namespace(suite: Suite) -> Result<()> {
    let node = GpuNode::start(&suite, LimitsConfig::uniform().tenancy(Tenancy::Exclusive)).await?;
    let mut cri = node.cri().await?;
    let (gpu0, gpu1) = (node.gpu_uuid(0).to_string(), node.gpu_uuid(1).to_string());
    let pod_a = cri
        .run_pod_sandbox(&gpu_pod("infer", "team-a").gpu_limits("4Gi", 25))
        .await?;
    let pod_b = cri
        .run_pod_sandbox(&gpu_pod("infer", "team-b").gpu_limits("4Gi", 25))
        .await?;
    let (a, _) = start_client(&mut cri, &pod_a, &client_container("infer", &gpu0)).await?;

    let result = create_and_start(&mut cri, &pod_b, &client_container("infer", &gpu0)).await;
    expect_refusal(result, &[&gpu0, "team-a", "exclusive"])?;
    let (b, _) = start_client(&mut cri, &pod_b, &client_container("infer-other-gpu", &gpu1)).await?;

    let status = node.manager.status().await?;
    let namespace = |id: &str| status.lease(id).map(|l| l.namespace.clone());
    ensure!(
        namespace(&a.id).as_deref() == Some("team-a") && namespace(&b.id).as_deref() == Some("team-b"),
        "leases: {status:#?}"
    );
    cri.delete_container(&a).await?;
    cri.delete_container(&b).await?;
    cri.delete_pod(&pod_a).await?;
    cri.delete_pod(&pod_b).await?;
    Ok(())
}

/// A malformed annotation and a request over the GPU's memory each fail at StartContainer,
/// with the reason in the message the CRI client sees.
async fn bad_requests_fail_with_their_message(suite: Suite) -> Result<()> {
    let node = GpuNode::start(&suite, LimitsConfig::uniform()).await?;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();

    let bad = cri
        .run_pod_sandbox(&gpu_pod("bad", "default").gpu_limits("4GB", 25))
        .await?;
    let result = create_and_start(&mut cri, &bad, &client_container("infer", &gpu)).await;
    expect_refusal(result, &["gpu-mps.io/memory-limit", "4GB"])?;

    // 3 x 8Gi on a 16Gi GPU: the third does not fit.
    let mut pods = Vec::new();
    let mut running = Vec::new();
    for name in ["big-1", "big-2", "big-3"] {
        pods.push(
            cri.run_pod_sandbox(&gpu_pod(name, "default").gpu_limits("8Gi", 25))
                .await?,
        );
    }
    for pod in &pods[..2] {
        running.push(
            start_client(&mut cri, pod, &client_container("infer", &gpu))
                .await?
                .0,
        );
    }
    let result = create_and_start(&mut cri, &pods[2], &client_container("infer", &gpu)).await;
    expect_refusal(result, &[&gpu, "memory reserved"])?;

    let status = node.manager.status().await?;
    ensure!(
        status.leases.len() == 2,
        "expected only the two fitting leases: {status:#?}"
    );
    let reserved = status
        .gpus
        .iter()
        .find(|g| g.uuid == gpu)
        .map(|g| g.memory_reserved_bytes);
    ensure!(
        reserved == Some(16 * GIB),
        "GPU {gpu} reserved {reserved:?}, expected 16Gi"
    );
    for container in &running {
        cri.delete_container(container).await?;
    }
    for pod in pods.iter().chain([&bad]) {
        cri.delete_pod(pod).await?;
    }
    Ok(())
}

/// With no manager running, a GPU container's create fails with the hook's one line, after one
/// hook timeout (the createRuntime hook waits for a manager that may be restarting), not two:
/// the poststop hook sees that no gate was opened, so there is no lease to release and it does
/// not wait for the manager. The gate dir the shim made is gone.
async fn a_create_with_the_manager_down_fails_within_one_hook_timeout_and_leaves_nothing(
    suite: Suite,
) -> Result<()> {
    let mut node = GpuNode::start(&suite, LimitsConfig::exact()).await?;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    let pod = cri
        .run_pod_sandbox(&gpu_pod("orphan", "default").gpu_limits("4Gi", 25))
        .await?;
    let before = node.manager.gate_dir_names();
    node.manager.kill();
    create_fails_within_one_hook_timeout(&mut cri, &pod, &gpu, "down", "cannot reach gpu-mps-manager")
        .await?;
    let after = node.manager.gate_dir_names();
    ensure!(
        after == before,
        "gate dirs before {before:?}, after the failed create {after:?}"
    );
    node.manager.start_again().await?;
    cri.delete_pod(&pod).await?;
    Ok(())
}

/// Creates a client container that must fail with `needle` within one hook timeout (10 s here,
/// and the containerd/runc work around it; two timeouts were 20 s).
async fn create_fails_within_one_hook_timeout(
    cri: &mut CriClient,
    pod: &Pod,
    gpu: &str,
    manager_state: &str,
    needle: &str,
) -> Result<()> {
    let started = std::time::Instant::now();
    let result = create_and_start(cri, pod, &client_container("infer", gpu)).await;
    let took = started.elapsed();
    expect_refusal(result, &[needle])?;
    println!(
        "create with the manager {manager_state} failed after {:.1} s (hook timeout 10 s)",
        took.as_secs_f64()
    );
    ensure!(
        took < Duration::from_secs(17),
        "the create took {took:?}: more than one hook timeout"
    );
    Ok(())
}

/// Issue 8, fault 4: the manager hangs (SIGSTOP). A create fails with a clear error within one
/// hook timeout; when the manager runs again it answers the request it held (the container is
/// gone by then), and within a reconcile grace nothing of it is left: no lease, no gate dir, and
/// the next container starts.
async fn a_create_with_the_manager_hung_fails_within_one_hook_timeout_and_all_is_consistent_after(
    suite: Suite,
) -> Result<()> {
    let node = GpuNode::start(&suite, LimitsConfig::exact()).await?;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    let pod = cri
        .run_pod_sandbox(&gpu_pod("hung", "default").gpu_limits("4Gi", 25))
        .await?;
    let before = node.manager.gate_dir_names();
    node.manager.pause();
    let failed = create_fails_within_one_hook_timeout(
        &mut cri,
        &pod,
        &gpu,
        "hung",
        "gpu-mps-manager did not answer within",
    )
    .await;
    node.manager.resume();
    failed?;
    // The request it held is answered now: give it the time to arrive, then the lease of the
    // container that is gone must go (poststop already ran, so reconcile drops it) with its gate.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let manager = &node.manager;
    manager
        .wait_status(
            "no lease and no gate dir after the manager ran again",
            WAIT,
            |s| s.leases.is_empty() && manager.gate_dir_names() == before,
        )
        .await
        .with_context(|| format!("gate dirs now {:?}, before {before:?}", manager.gate_dir_names()))?;
    let (_container, client) = start_client(&mut cri, &pod, &client_container("next", &gpu)).await?;
    println!("after SIGCONT a new container reached its daemon: {client}");
    cri.delete_pod(&pod).await?;
    node.manager
        .wait_status("leases released", WAIT, |s| s.leases.is_empty())
        .await?;
    Ok(())
}

/// A container whose only GPU is a CDI annotation, `cdi.k8s.io/nvidia-device-plugin:
/// nvidia.com/gpu=<uuid>`, running `checker report` and staying up.
fn cdi_report_container(name: &str, gpu_uuid: &str) -> ContainerSpec {
    ContainerSpec::new(name, TEST_IMAGE)
        .command(&["/checker"])
        .args(&["report", HOLD])
        .annotation(DEVICE_PLUGIN_ANNOTATION, &cdi::gpu_device(gpu_uuid))
}

/// What the container's own process saw: the pod's limits in its env, and its gate dir,
/// read-only, at /tmp/nvidia-mps with the control socket in it.
fn sees_its_daemon(
    node: &GpuNode,
    report: &Report,
    container_id: &str,
    gpu_uuid: &str,
    memory_mib: u64,
    threads: u8,
) -> Result<()> {
    let env = report.mps_env();
    let expected = [
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", threads.to_string()),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", format!("0={memory_mib}M")),
        ("CUDA_MPS_PIPE_DIRECTORY", CONTAINER_PIPE_DIR.to_string()),
    ];
    ensure!(
        env.len() == expected.len() && expected.iter().all(|(k, v)| env.get(k) == Some(&v.as_str())),
        "CUDA_MPS env {env:?}, expected {expected:?}"
    );
    let pipe = &report.mps_pipe_dir;
    let mount = pipe.mount.as_ref().context("no mount at /tmp/nvidia-mps")?;
    ensure!(
        pipe.is_mount_point && mount.has_option("ro") && pipe.create_file == "EROFS",
        "/tmp/nvidia-mps is not a read-only mount: {pipe:?}"
    );
    ensure!(
        pipe.control_exists && pipe.control_is_socket,
        "no control socket in /tmp/nvidia-mps: {pipe:?}"
    );
    // Its own gate, never the daemon's pipe dir (which holds control_privileged).
    ensure!(
        pipe.entries == ["control"],
        "/tmp/nvidia-mps holds {:?}: only the gate's control socket may reach a pod",
        pipe.entries
    );
    let gate = node.manager.gate_dir(container_id);
    ensure!(
        mount.is_bind_of(&gate.to_string_lossy()),
        "/tmp/nvidia-mps is {}, not the container's gate {} (GPU {gpu_uuid})",
        mount.root,
        gate.display()
    );
    Ok(())
}

/// The manager holds a lease of the container on that GPU's daemon, with the pod's limits.
async fn holds_a_lease(
    node: &GpuNode,
    container: &Container,
    gpu_uuid: &str,
    memory: u64,
    threads: u32,
) -> Result<()> {
    let status = node.manager.status().await?;
    let lease = status
        .lease(&container.id)
        .with_context(|| format!("no lease of container {}: {status:#?}", container.name))?;
    ensure!(
        lease.gpu_uuids == [gpu_uuid]
            && (lease.memory_limit_bytes, lease.active_thread_percentage) == (memory, threads),
        "lease of {}: {lease:?}",
        container.name
    );
    let daemons = status.daemons_of(gpu_uuid);
    ensure!(
        daemons.len() == 1 && daemons[0].leases == 1,
        "expected one daemon with one lease on {gpu_uuid}: {status:#?}"
    );
    Ok(())
}

/// A GPU handed over only as a CDI annotation, with no NVIDIA_VISIBLE_DEVICES or with it `void`,
/// gets its GPU's daemon as one named by env does. containerd keeps the annotation in the spec
/// (the `gpu-mps` handler passes `cdi.k8s.io/*`) and, where it has CDI (1.7, here switched on,
/// and 2.x), resolves it against the test's own CDI spec, which sets NVIDIA_VISIBLE_DEVICES=void;
/// 1.6 has no CDI and passes the annotation through unresolved.
async fn cdi_annotation_gets_its_gpus_daemon(suite: Suite) -> Result<()> {
    let gpus = fake_gpus(2, FAKE_GPU_MEMORY);
    let uuids: Vec<String> = gpus.iter().map(|g| g.uuid.clone()).collect();
    let cdi = CdiOptions {
        enabled: Some(true),
        specs: vec![cdi::gpu_spec(&uuids)],
    };
    let node = GpuNode::start_with(&suite, LimitsConfig::uniform(), gpus, cdi).await?;
    let mut cri = node.cri().await?;
    let pod = cri
        .run_pod_sandbox(&gpu_pod("cdi", "default").gpu_limits("2Gi", 30))
        .await?;
    let mut running = Vec::new();
    for (name, uuid, visible) in [
        ("cdi-only", &uuids[0], None),
        ("cdi-void", &uuids[1], Some("void")),
    ] {
        let spec = match visible {
            Some(visible) => cdi_report_container(name, uuid).gpu(visible),
            None => cdi_report_container(name, uuid),
        };
        let container = create_and_start(&mut cri, &pod, &spec)
            .await
            .with_context(|| format!("starting container {name} (CDI annotation for {uuid})"))?;
        let report = Report::parse(&cri.first_stdout_line(&container, WAIT).await?)?;
        println!("{name}: checker report: {report}");
        sees_its_daemon(&node, &report, &container.id, uuid, 2048, 30)
            .with_context(|| format!("container {name}"))?;
        holds_a_lease(&node, &container, uuid, 2 * GIB, 30).await?;

        let spec = node.containerd.bundle_spec(CRI_NAMESPACE, &container.id)?;
        let annotations = &spec["annotations"];
        ensure!(
            annotations[DEVICE_PLUGIN_ANNOTATION].as_str() == Some(&cdi::gpu_device(uuid)),
            "{name}: the spec lacks the CDI annotation: {annotations}"
        );
        ensure!(
            annotations[DAEMON].as_str() == Some(uuid.as_str()),
            "{name}: the shim did not serve it from {uuid}'s daemon: {annotations}"
        );
        // CDI edits are the only source of `void` in "cdi-only".
        let resolved = suite.has_cdi();
        let expected = if resolved { Some("void") } else { visible };
        ensure!(
            report.env("NVIDIA_VISIBLE_DEVICES") == expected,
            "{name}: NVIDIA_VISIBLE_DEVICES {:?}, expected {expected:?} (CDI {})",
            report.env("NVIDIA_VISIBLE_DEVICES"),
            if resolved { "resolved" } else { "not resolved" }
        );
        println!(
            "{name}: {}: annotation kept in the spec, CDI device {}",
            suite.containerd_version,
            if resolved {
                "resolved against the test's CDI spec"
            } else {
                "not resolved (no CDI in this containerd)"
            }
        );
        running.push(container);
    }
    for container in &running {
        cri.delete_container(container).await?;
    }
    node.manager
        .wait_status("CDI containers' leases released", WAIT, |s| s.leases.is_empty())
        .await?;
    cri.delete_pod(&pod).await?;
    Ok(())
}

/// With no CDI spec naming the GPU (the spec dir is empty) and CDI as containerd ships it:
/// 2.x resolves CDI annotations by default and fails CreateContainer on a device it cannot
/// resolve; 1.6 (no CDI) and 1.7 (CDI off by default) pass the annotation through, and the shim
/// gives the container its GPU's daemon.
async fn cdi_annotation_without_a_cdi_spec(suite: Suite) -> Result<()> {
    let node = GpuNode::start(&suite, LimitsConfig::uniform()).await?;
    let mut cri = node.cri().await?;
    let uuid = node.gpu_uuid(0).to_string();
    let pod = cri
        .run_pod_sandbox(&gpu_pod("cdi-nospec", "default").gpu_limits("2Gi", 30))
        .await?;
    let result = create_and_start(&mut cri, &pod, &cdi_report_container("cdi-only", &uuid)).await;
    if suite.cdi_by_default() {
        let device = cdi::gpu_device(&uuid);
        let message = expect_refusal(result, &["unresolvable CDI devices", &device])?;
        println!(
            "{}: CDI on by default, CreateContainer failed: {message}",
            suite.containerd_version
        );
        let status = node.manager.status().await?;
        ensure!(
            status.leases.is_empty(),
            "a lease without a container: {status:#?}"
        );
    } else {
        let container = result.context("starting a container with an unresolved CDI annotation")?;
        let report = Report::parse(&cri.first_stdout_line(&container, WAIT).await?)?;
        println!("cdi-only: checker report: {report}");
        sees_its_daemon(&node, &report, &container.id, &uuid, 2048, 30)?;
        holds_a_lease(&node, &container, &uuid, 2 * GIB, 30).await?;
        ensure!(
            report.env("NVIDIA_VISIBLE_DEVICES").is_none(),
            "CDI resolved without a spec: {report}"
        );
        println!(
            "{}: {}, the annotation passed through unresolved",
            suite.containerd_version,
            if suite.has_cdi() {
                "CDI off by default"
            } else {
                "no CDI"
            }
        );
        cri.delete_container(&container).await?;
    }
    cri.delete_pod(&pod).await?;
    Ok(())
}

/// The limits the fake server gave a client, as `(memory, threads)` the daemon prints them.
fn served(client: &MpsClient) -> (Option<&str>, Option<&str>) {
    (client.mem.get("0").map(String::as_str), client.threads.as_deref())
}

/// `get_client_list` of the daemon's (one) server: host pids.
async fn listed_clients(node: &GpuNode, gpu: &str) -> Result<Vec<u32>> {
    let pipe = node.manager.pipe_dir(gpu);
    let run = |command: &str| -> Result<String> {
        let mut child = std::process::Command::new(&node.bins.fake_mps_control)
            .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()?;
        std::io::Write::write_all(
            child.stdin.as_mut().context("stdin")?,
            format!("{command}\n").as_bytes(),
        )?;
        drop(child.stdin.take());
        Ok(String::from_utf8_lossy(&child.wait_with_output()?.stdout).into_owned())
    };
    let mut pids = Vec::new();
    for server in run("get_server_list")?.split_whitespace() {
        pids.extend(
            run(&format!("get_client_list {server}"))?
                .split_whitespace()
                .filter_map(|p| p.parse::<u32>().ok()),
        );
    }
    Ok(pids)
}

/// Policy exact: containers with six different limits, started all at once on one GPU, each
/// get their OWN limits from the one server, through a gate dir that holds only `control`; the
/// server lists each container's own process (the gate forwards the client's credentials), and
/// removal closes the gates.
async fn exact_holds_each_container_to_its_own_limits(suite: Suite) -> Result<()> {
    let node = GpuNode::start(&suite, LimitsConfig::exact()).await?;
    let gpu = node.gpu_uuid(0).to_string();
    // 1500Mi: MPS prints it back as "1G" (whole GiB, rounded down; measured), which the gate
    // must take as set.
    let sizes = [
        ("1500Mi", 10, "1500M"),
        ("2Gi", 20, "2G"),
        ("3Gi", 30, "3G"),
        ("1Gi", 40, "1G"),
        ("2Gi", 50, "2G"),
        ("3Gi", 60, "3G"),
    ];
    let mut tasks = Vec::new();
    for (i, (memory, threads, _)) in sizes.iter().enumerate() {
        let mut cri = node.cri().await?;
        let pod = cri
            .run_pod_sandbox(&gpu_pod(&format!("exact-{i}"), "default").gpu_limits(memory, *threads))
            .await?;
        let spec = client_container("infer", &gpu);
        tasks.push(tokio::spawn(async move {
            let started = start_client(&mut cri, &pod, &spec).await;
            (pod, started)
        }));
    }
    let mut running = Vec::new();
    for task in tasks {
        let (pod, started) = task.await?;
        running.push((pod, started?));
    }
    let server = running[0].1.1.server_pid;
    for ((pod, (container, client)), (memory, threads, printed)) in running.iter().zip(sizes) {
        let want_threads = format!("{threads}.0");
        ensure!(
            served(client) == (Some(printed), Some(want_threads.as_str())),
            "pod {} asked {memory}/{threads}% and the server gave its client {}",
            pod.spec.name,
            client
        );
        ensure!(client.server_pid == server, "two servers on one GPU: {client}");
        let gate = node
            .manager
            .config()
            .gate_dir(&gpu_mps_api::ContainerId::parse(&container.id)?);
        let names: Vec<String> = std::fs::read_dir(&gate)
            .with_context(|| format!("gate dir {}", gate.display()))?
            .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
            .collect::<Result<_>>()?;
        ensure!(
            names == ["control"],
            "gate dir {} holds {names:?}",
            gate.display()
        );
    }
    let listed = listed_clients(&node, &gpu).await?;
    for (_, (container, _)) in &running {
        let pid = node
            .containerd
            .container_pid(CRI_NAMESPACE, &container.id)
            .context("container pid")?;
        ensure!(
            listed.contains(&pid),
            "the server does not list container {}'s process {pid} (it lists {listed:?}): the gate did not forward the client's credentials",
            container.name
        );
    }
    let status = node.manager.status().await?;
    ensure!(status.policy == "exact", "policy {:?}", status.policy);
    ensure!(
        status.daemons.len() == 1 && status.daemons[0].leases == 6,
        "{status:#?}"
    );
    let mut cri = node.cri().await?;
    for (pod, (container, _)) in &running {
        cri.delete_container(container).await?;
        cri.delete_pod(pod).await?;
    }
    node.manager
        .wait_status("leases released", WAIT, |s| s.leases.is_empty())
        .await?;
    let gates = node.manager.config().gates_root();
    let left: Vec<_> = std::fs::read_dir(&gates)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    ensure!(left.is_empty(), "gate dirs left after removal: {left:?}");
    Ok(())
}

/// Policy exact: a process that connects to its gate and then says nothing holds nobody. The gate
/// answers the hello itself and reaches the daemon only with a complete request (the daemon
/// serves one connection at a time: a silent connection relayed to it held every pod, measured
/// 18.4 s for 4 of them on the H200); a pod of another size starts at once with its own limits,
/// and the silent connection is kept open, never closed before its request (closing it then
/// would let a CUDA client fall back to a direct context, measured).
async fn exact_a_stalled_client_holds_nobody(suite: Suite) -> Result<()> {
    let limits = LimitsConfig {
        gate_handshake_timeout_seconds: Some(2),
        ..LimitsConfig::exact()
    };
    let node = GpuNode::start(&suite, limits).await?;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    let pod_a = cri
        .run_pod_sandbox(&gpu_pod("staller", "default").gpu_limits("2Gi", 20))
        .await?;
    let (a, client_a) = start_client(&mut cri, &pod_a, &client_container("infer", &gpu)).await?;
    ensure!(served(&client_a) == (Some("2G"), Some("20.0")), "{client_a}");

    // A process of pod A opens a control connection through A's gate and stalls after the hello.
    let gate = node
        .manager
        .config()
        .gate_dir(&gpu_mps_api::ContainerId::parse(&a.id)?);
    let stalled = gpu_mps_e2e::checker::seqpacket_connect(&gate.join("control"))?;
    let mut hello = [0u8; 16];
    let n = std::io::Read::read(&mut &stalled, &mut hello)?;
    ensure!(
        &hello[..n] == gpu_mps_checker::mps_framing::HELLO,
        "no hello through the gate: {:?}",
        &hello[..n]
    );
    let stalled_at = std::time::Instant::now();

    let pod_b = cri
        .run_pod_sandbox(&gpu_pod("patient", "default").gpu_limits("4Gi", 50))
        .await?;
    let (b, client_b) = start_client(&mut cri, &pod_b, &client_container("infer", &gpu)).await?;
    let waited = stalled_at.elapsed();
    ensure!(
        served(&client_b) == (Some("4G"), Some("50.0")),
        "pod B got {client_b}"
    );
    // Relayed, the stalled connection would have held the daemon for the whole handshake
    // timeout (2 s here) before pod B's client could reach it.
    ensure!(
        waited < Duration::from_secs(2),
        "pod B reached the daemon only after {waited:?}: the stalled connection held it"
    );
    stalled.set_read_timeout(Some(Duration::from_millis(500)))?;
    let kept = std::io::Read::read(&mut &stalled, &mut hello);
    ensure!(
        matches!(&kept, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the stalled connection should stay open and unanswered, got {kept:?}"
    );
    println!("a stalled connection held nobody: pod B started {waited:?} after it, with its own limits");
    for (pod, container) in [(&pod_a, &a), (&pod_b, &b)] {
        cri.delete_container(container).await?;
        cri.delete_pod(pod).await?;
    }
    Ok(())
}

/// Policy exact: the manager restarts (SIGTERM, then a new one) while a gated pod runs. The
/// running client is untouched, the gate socket is served again, and a new CUDA process in the
/// pod (an exec) and a new pod of another size both get their own limits.
async fn exact_gates_come_back_after_a_manager_restart(suite: Suite) -> Result<()> {
    let mut node = GpuNode::start(&suite, LimitsConfig::exact()).await?;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    // Two CUDA processes of 2Gi each: the running one and the one exec'd after the restart
    // (the new manager recounts the running one from the server's clients).
    let pod_a = cri
        .run_pod_sandbox(
            &gpu_pod("survivor", "default")
                .gpu_limits("4Gi", 20)
                .annotation("gpu-mps.io/cuda-processes", "2"),
        )
        .await?;
    let (a, client_a) = start_client(&mut cri, &pod_a, &client_container("infer", &gpu)).await?;
    let pid_a = node
        .containerd
        .container_pid(CRI_NAMESPACE, &a.id)
        .context("container pid")?;

    node.manager.restart().await?;

    ensure!(
        listed_clients(&node, &gpu).await?.contains(&pid_a),
        "the running client left the server over the restart"
    );
    let exec = cri
        .exec_sync(&a, &["/checker", "mps-client"], Duration::from_secs(20))
        .await?;
    let again = MpsClient::parse(exec.last_line())?;
    ensure!(
        served(&again) == (Some("2G"), Some("20.0")) && again.server_pid == client_a.server_pid,
        "a new process in pod A after the restart got {again}"
    );
    let pod_b = cri
        .run_pod_sandbox(&gpu_pod("newcomer", "default").gpu_limits("4Gi", 50))
        .await?;
    let (b, client_b) = start_client(&mut cri, &pod_b, &client_container("infer", &gpu)).await?;
    ensure!(
        served(&client_b) == (Some("4G"), Some("50.0")),
        "pod B got {client_b}"
    );
    ensure!(client_b.server_pid == client_a.server_pid, "two servers");
    let log = node.manager.log_tail(400);
    ensure!(log.contains("gate open"), "{log}");
    for (pod, container) in [(&pod_a, &a), (&pod_b, &b)] {
        cri.delete_container(container).await?;
        cri.delete_pod(pod).await?;
    }
    Ok(())
}
