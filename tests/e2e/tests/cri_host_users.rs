//! Host users (non-root on the node) reach no gate and no MPS daemon, while a container's
//! processes of any uid still reach their own gate (issue 21, item 4), through the CRI runtime
//! handler `gpu-mps` with the MPS test double. The gates' sockets are 0666 and MPS makes a
//! daemon's `control` 0666: the state root's 0700 directories keep host users out, and inside
//! the container the gate dir is the root of its /tmp/nvidia-mps bind mount, whose own mode
//! (0755) is all that path resolution there walks.
//!
//! Run: `cargo test -p gpu-mps-e2e --test cri_host_users -- --nocapture`.

use std::time::Duration;

use anyhow::{Result, ensure};
use gpu_mps_e2e::checker::{CheckerLine, MpsClient};
use gpu_mps_e2e::containerd::GPU_MPS_HANDLER;
use gpu_mps_e2e::host_user::{NOBODY, connect_as, open_ancestors_to_all};
use gpu_mps_e2e::image::TEST_IMAGE;
use gpu_mps_e2e::{ContainerSpec, GpuNode, LimitsConfig, PodSpec, StatusLookup, Suite, per_suite};
use nix::errno::Errno;

per_suite!(a_host_user_reaches_no_gate_and_no_daemon_and_a_non_root_container_reaches_its_gate);

const WAIT: Duration = Duration::from_secs(20);
/// The uid of the container's processes (`runAsUser`), which no file of the image belongs to.
const CONTAINER_UID: i64 = 1000;

async fn a_host_user_reaches_no_gate_and_no_daemon_and_a_non_root_container_reaches_its_gate(
    suite: Suite,
) -> Result<()> {
    let node = GpuNode::start(&suite, LimitsConfig::exact()).await?;
    open_ancestors_to_all(&node.manager.config().root)?;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    let pod = cri
        .run_pod_sandbox(&PodSpec::new("nonroot", "default", GPU_MPS_HANDLER).gpu_limits("4Gi", 25))
        .await?;
    let spec = ContainerSpec::new("infer", TEST_IMAGE)
        .command(&["/checker"])
        .args(&["mps-client", "--hold-seconds=300"])
        .gpu(&gpu)
        .run_as_user(CONTAINER_UID);
    let container = cri
        .create_container(&pod, &spec)
        .await
        .map_err(|s| anyhow::anyhow!("CreateContainer: {}", s.message()))?;
    cri.start_container(&container)
        .await
        .map_err(|s| anyhow::anyhow!("StartContainer: {}", s.message()))?;
    let client = MpsClient::parse(&cri.first_stdout_line(&container, WAIT).await?)?;
    ensure!(
        client.admitted && client.sent_uid == CONTAINER_UID as u32,
        "a uid {CONTAINER_UID} process in the container did not get through its gate: {client}"
    );
    ensure!(
        client.mem.get("0").map(String::as_str) == Some("4G"),
        "served with the wrong limits: {client}"
    );

    let gate = node.manager.gate_dir(&container.id).join("control");
    let pipe = node.manager.pipe_dir(&gpu);
    for socket in [
        gate.clone(),
        pipe.join("control"),
        pipe.join("control_privileged"),
    ] {
        ensure!(
            connect_as(0, &socket)?.is_none(),
            "root cannot connect to {}: the test looks at the wrong socket",
            socket.display()
        );
        let got = connect_as(NOBODY, &socket)?;
        ensure!(
            got == Some(Errno::EACCES),
            "uid {NOBODY} on the host connecting to {}: {got:?}, not EACCES",
            socket.display()
        );
    }
    // The host user's attempts cost the pod nothing: its one process is all that is counted.
    let status = node.manager.status().await?;
    let lease = status
        .lease(&container.id)
        .ok_or_else(|| anyhow::anyhow!("no lease"))?;
    ensure!(
        lease.admitted_pids.len() == 1,
        "the pod's processes as counted: {:?}",
        lease.admitted_pids
    );
    println!(
        "uid {CONTAINER_UID} in the container admitted through its gate; uid {NOBODY} on the host refused (EACCES) at {}, {}/control and {}/control_privileged",
        gate.display(),
        pipe.display(),
        pipe.display()
    );
    cri.delete_container(&container).await?;
    cri.delete_pod(&pod).await?;
    Ok(())
}
