//! Faults the node must survive (issue 8), through real containerd (1.6, 1.7, 2.x) and runc
//! with the CRI handler `gpu-mps`; the MPS daemon is the test double.
//!
//! Run: `cargo test -p gpu-mps-e2e --test cri_faults -- --nocapture`.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use gpu_mps_e2e::checker::{CheckerLine, Report};
use gpu_mps_e2e::containerd::{CRI_NAMESPACE, GPU_MPS_HANDLER};
use gpu_mps_e2e::image::TEST_IMAGE;
use gpu_mps_e2e::manager::IDLE_GRACE_SECONDS;
use gpu_mps_e2e::{ContainerSpec, GpuNode, LimitsConfig, PodSpec, StatusLookup, Suite, per_suite};
use k8s_cri::v1 as cri;

per_suite!(
    the_manager_sigkilled_under_running_containers_adopts_them_and_releases_later,
    containerd_restarts_under_a_running_container_and_new_creates_work,
);

const WAIT: Duration = Duration::from_secs(20);
const HOLD: &str = "--hold-seconds=300";

/// Fault 1: the manager is SIGKILLed while two GPU containers run, and started again. The
/// containers run on undisturbed (same processes, still running, while no manager runs and
/// after); the new manager adopts their leases and their daemon (the same control daemon, not a
/// new one); later releases work, and the daemon stops once it is idle.
async fn the_manager_sigkilled_under_running_containers_adopts_them_and_releases_later(
    suite: Suite,
) -> Result<()> {
    let mut node = GpuNode::start(&suite, LimitsConfig::exact()).await?;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    let mut running = Vec::new();
    for (i, memory) in ["2Gi", "3Gi"].iter().enumerate() {
        let pod = cri
            .run_pod_sandbox(
                &PodSpec::new(&format!("fault1-{i}"), "default", GPU_MPS_HANDLER).gpu_limits(memory, 25),
            )
            .await?;
        let spec = ContainerSpec::new("infer", TEST_IMAGE)
            .command(&["/checker"])
            .args(&["report", HOLD])
            .gpu(&gpu);
        let container = cri.create_container(&pod, &spec).await?;
        cri.start_container(&container).await?;
        Report::parse(&cri.first_stdout_line(&container, WAIT).await?)?;
        let pid = node
            .containerd
            .container_pid(CRI_NAMESPACE, &container.id)
            .context("container pid")?;
        running.push((pod, container, pid));
    }
    let before = node.manager.status().await?;
    ensure!(
        before.leases.len() == 2 && before.daemons.len() == 1,
        "before: {before:#?}"
    );
    let daemon_pid = before.daemons[0].control_pid;

    node.manager.kill();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let still_running = |state: i32| state == cri::ContainerState::ContainerRunning as i32;
    for (_, container, pid) in &running {
        let status = cri.container_status(container).await?;
        ensure!(
            still_running(status.state)
                && node.containerd.container_pid(CRI_NAMESPACE, &container.id) == Some(*pid),
            "{} was disturbed while no manager ran: {status:?}",
            container.name
        );
    }
    node.manager.start_again().await?;
    let after = node.manager.status().await?;
    for (_, container, pid) in &running {
        let was = before.lease(&container.id).context("lease before")?;
        let lease = after
            .lease(&container.id)
            .with_context(|| format!("the new manager did not adopt the lease of {}", container.name))?;
        ensure!(
            lease.memory_limit_bytes == was.memory_limit_bytes && lease.pid == *pid,
            "{}: lease {lease:?}, was {was:?}",
            container.name
        );
        let status = cri.container_status(container).await?;
        ensure!(
            still_running(status.state),
            "{} stopped after the restart",
            container.name
        );
    }
    ensure!(
        after.daemons.len() == 1 && after.daemons[0].control_pid == daemon_pid,
        "the daemon was not adopted (pid {daemon_pid} before): {:#?}",
        after.daemons
    );
    println!(
        "{}: SIGKILL under 2 running containers: both ran on, leases and daemon {daemon_pid} adopted",
        suite.containerd_version
    );

    for (i, (pod, container, _)) in running.iter().enumerate() {
        cri.delete_container(container).await?;
        cri.delete_pod(pod).await?;
        let left = running.len() - i - 1;
        node.manager
            .wait_status("the release after the restart", WAIT, |s| s.leases.len() == left)
            .await?;
    }
    let grace = Duration::from_secs(IDLE_GRACE_SECONDS);
    node.manager
        .wait_status("the adopted daemon stopped once idle", grace + WAIT, |s| {
            s.daemons.is_empty()
        })
        .await?;
    ensure!(
        !gpu_mps_e2e::processes::alive(daemon_pid),
        "the adopted control daemon {daemon_pid} still runs"
    );
    println!(
        "{}: later releases worked and the idle daemon stopped",
        suite.containerd_version
    );
    Ok(())
}

/// Fault 3: containerd restarts (SIGTERM, then started again on the same root and state) while a
/// GPU container runs. The container runs on (same process, its lease kept), a new GPU
/// container starts with its own limits through the restarted containerd, and both release.
async fn containerd_restarts_under_a_running_container_and_new_creates_work(suite: Suite) -> Result<()> {
    let mut node = GpuNode::start(&suite, LimitsConfig::exact()).await?;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    let spec = |name: &str| {
        ContainerSpec::new(name, TEST_IMAGE)
            .command(&["/checker"])
            .args(&["report", HOLD])
            .gpu(&gpu)
    };
    let old_pod = cri
        .run_pod_sandbox(&PodSpec::new("before", "default", GPU_MPS_HANDLER).gpu_limits("2Gi", 25))
        .await?;
    let old = cri.create_container(&old_pod, &spec("before")).await?;
    cri.start_container(&old).await?;
    Report::parse(&cri.first_stdout_line(&old, WAIT).await?)?;
    let pid = node
        .containerd
        .container_pid(CRI_NAMESPACE, &old.id)
        .context("container pid")?;

    node.containerd.restart().await?;
    let mut cri = node.containerd.cri().await?;
    let status = cri.container_status(&old).await?;
    ensure!(
        status.state == cri::ContainerState::ContainerRunning as i32
            && node.containerd.container_pid(CRI_NAMESPACE, &old.id) == Some(pid),
        "the running container did not survive the containerd restart: {status:?}"
    );
    ensure!(
        node.manager.status().await?.lease(&old.id).is_some(),
        "the running container lost its lease"
    );
    let new_pod = cri
        .run_pod_sandbox(&PodSpec::new("after", "default", GPU_MPS_HANDLER).gpu_limits("3Gi", 40))
        .await?;
    let new = cri.create_container(&new_pod, &spec("after")).await?;
    cri.start_container(&new).await?;
    let report = Report::parse(&cri.first_stdout_line(&new, WAIT).await?)?;
    ensure!(
        report.env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") == Some("0=3072M")
            && report.env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") == Some("40"),
        "the container created after the restart: {report}"
    );
    println!(
        "{}: containerd restarted under a running container: it ran on; a new one started with 3Gi/40%",
        suite.containerd_version
    );
    for (pod, container) in [(&old_pod, &old), (&new_pod, &new)] {
        cri.delete_container(container).await?;
        cri.delete_pod(pod).await?;
    }
    node.manager
        .wait_status("both released", WAIT, |s| s.leases.is_empty())
        .await?;
    Ok(())
}
