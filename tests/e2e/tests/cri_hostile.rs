//! Hostile tenants through the CRI runtime handler `gpu-mps` (issue 7): what a pod can try from
//! inside against its MPS daemon, and what the node holds it to. The MPS daemon is the test
//! double, which speaks the control protocol's measured shape (docs/gpu-results.md section 7);
//! tests/gpu/hostile.sh runs the same attempts against the real daemon on a GPU.
//!
//! - only a gate's `control` reaches a pod, under every policy, and the gate lets only CUDA
//!   clients through: a control session (set, quit, reads) or any other request is refused after
//!   it was sent, and the daemon is untouched;
//! - a container runs at most `gpu-mps.io/cuda-processes` CUDA processes, each with its share of
//!   the memory limit; one more is refused cleanly;
//! - a pod's stalled connections wait in its own gate's backlog and hold nobody else up;
//! - the node's maximums refuse a pod that asks for more, with one line;
//! - the shim lays containers out by the config the manager runs with, not an edited file, and
//!   the manager refuses a container laid out under another config;
//! - one manager per root;
//! - a CUDA process that connects while the manager is down waits and gets its own limits.
//!
//! Run: `cargo test -p gpu-mps-e2e --test cri_hostile -- --nocapture`.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use gpu_mps_api::node_config::{LimitPolicy, PublishedConfig};
use gpu_mps_e2e::checker::{
    CLI_CANNOT_SEND, CUDA_REFUSED, CheckerLine, MpsClient, MpsProcesses, MpsRaw, MpsStall, MpsUi,
};
use gpu_mps_e2e::containerd::GPU_MPS_HANDLER;
use gpu_mps_e2e::cri::{Container, Pod};
use gpu_mps_e2e::image::TEST_IMAGE;
use gpu_mps_e2e::{ContainerSpec, CriClient, GpuNode, LimitsConfig, PodSpec, StatusLookup, Suite, per_suite};

per_suite!(
    a_pod_reaches_only_a_gate_that_lets_only_cuda_clients_through,
    a_container_runs_at_most_its_cuda_processes,
    stalled_connections_wait_in_their_own_gates_backlog,
    the_node_maximums_refuse_a_pod_that_asks_for_more,
    the_running_managers_config_is_the_one_that_counts,
    one_manager_per_root,
    a_process_that_connects_while_the_manager_is_down_gets_its_limits,
    a_restarted_manager_still_counts_the_running_processes,
    a_process_that_leaves_the_server_stuck_is_refused_and_the_gpu_recovers,
);

const WAIT: Duration = Duration::from_secs(20);
const HOLD: &str = "--hold-seconds=300";

fn gpu_pod(name: &str, namespace: &str) -> PodSpec {
    PodSpec::new(name, namespace, GPU_MPS_HANDLER)
}

/// A container that connects as a CUDA process would and holds its channel.
fn client(name: &str, gpu: &str) -> ContainerSpec {
    ContainerSpec::new(name, TEST_IMAGE)
        .command(&["/checker"])
        .args(&["mps-client", HOLD])
        .gpu(gpu)
}

async fn start(cri: &mut CriClient, pod: &Pod, spec: &ContainerSpec) -> Result<Container> {
    let container = cri
        .create_container(pod, spec)
        .await
        .map_err(|s| anyhow::anyhow!("CreateContainer {}: {}", spec.name, s.message()))?;
    cri.start_container(&container)
        .await
        .map_err(|s| anyhow::anyhow!("StartContainer {}: {}", spec.name, s.message()))?;
    Ok(container)
}

async fn admitted(cri: &mut CriClient, pod: &Pod, spec: &ContainerSpec) -> Result<(Container, MpsClient)> {
    let container = start(cri, pod, spec).await?;
    let client = MpsClient::parse(&cri.first_stdout_line(&container, WAIT).await?)?;
    ensure!(
        client.admitted,
        "container {} was not admitted: {client}",
        spec.name
    );
    Ok((container, client))
}

/// `checker <args>` run in a running container, as `kubectl exec` does; its one JSON line.
async fn exec<T: CheckerLine>(cri: &mut CriClient, container: &Container, args: &[&str]) -> Result<T> {
    let mut cmd = vec!["/checker"];
    cmd.extend_from_slice(args);
    let out = cri
        .exec_sync(container, &cmd, WAIT)
        .await
        .map_err(|s| anyhow::anyhow!("exec {args:?}: {}", s.message()))?;
    T::parse(out.last_line()).with_context(|| format!("exec {args:?}: stderr {}", out.stderr))
}

fn served(client: &MpsClient) -> (Option<&str>, Option<&str>) {
    (client.mem.get("0").map(String::as_str), client.threads.as_deref())
}

async fn cleanup(cri: &mut CriClient, pods: &[(&Pod, &Container)]) -> Result<()> {
    for (pod, container) in pods {
        cri.delete_container(container).await?;
        cri.delete_pod(pod).await?;
    }
    Ok(())
}

/// Under uniform, ceiling and exact a pod sees only its gate's `control`; the control CLI's
/// commands from inside (a change, quit, the reads that list other pods' processes) and any
/// request that is not a CUDA client's are refused after they were sent, never relayed.
async fn a_pod_reaches_only_a_gate_that_lets_only_cuda_clients_through(suite: Suite) -> Result<()> {
    for limits in [
        LimitsConfig::uniform(),
        LimitsConfig::ceiling("8Gi", 50),
        LimitsConfig::exact(),
    ] {
        let policy = limits.policy;
        let node = GpuNode::start(&suite, limits).await?;
        let mut cri = node.cri().await?;
        let gpu = node.gpu_uuid(0).to_string();
        let pod = cri
            .run_pod_sandbox(&gpu_pod("tenant", "default").gpu_limits("4Gi", 25))
            .await?;
        let (c, first) = admitted(&mut cri, &pod, &client("infer", &gpu)).await?;
        let daemons_before = node.manager.control_daemons();
        for command in [
            "set_default_active_thread_percentage 100",
            "set_default_device_pinned_mem_limit 0 64G",
            "get_server_list",
            "get_client_list 1",
            "terminate_client 1 1",
            "quit",
        ] {
            let ui: MpsUi = exec(&mut cri, &c, &["mps-ui", command]).await?;
            // A change is answered by the gate as MPS answers a user who may not make it (so
            // the tenant is never told it was made); a read is closed unanswered. Neither
            // reaches the daemon (checked below: the same daemon, the same limits served).
            let refusal = if command == "quit" {
                Some("Not enough privilege to execute quit command")
            } else if command.starts_with("set_") || command.starts_with("terminate_") {
                Some(
                    "Insufficient privileges for UID 0. Control deamon settings can only be modified by the user who started it or by the root user.",
                )
            } else {
                None
            };
            match refusal {
                Some(text) => ensure!(
                    ui.answer.as_deref() == Some(text) && ui.error.is_none(),
                    "{policy}: `{command}` from the pod was not refused as MPS refuses a user: {ui:?}"
                ),
                None => ensure!(
                    !ui.reached_daemon && ui.error.as_deref() == Some(CLI_CANNOT_SEND),
                    "{policy}: `{command}` from the pod: {ui:?}"
                ),
            }
            ensure!(
                ui.socket_used.as_deref() == Some("/tmp/nvidia-mps/control"),
                "{policy}: the pod reached {:?}",
                ui.socket_used
            );
        }
        for kind in ["4", "7", "0"] {
            let raw: MpsRaw = exec(&mut cri, &c, &["mps-raw", "--kind", kind]).await?;
            ensure!(
                raw.closed && raw.replies.is_empty(),
                "{policy}: a request of kind {kind} was answered: {raw:?}"
            );
        }
        // The daemon is untouched: the same process, serving a new pod its own limits.
        let pod2 = cri
            .run_pod_sandbox(&gpu_pod("after", "default").gpu_limits("4Gi", 25))
            .await?;
        let (c2, second) = admitted(&mut cri, &pod2, &client("infer", &gpu)).await?;
        ensure!(
            node.manager.control_daemons() == daemons_before,
            "{policy}: the daemon changed"
        );
        ensure!(
            served(&second) == served(&first) && second.server_pid == first.server_pid,
            "{policy}: before {first}, after {second}"
        );
        let status = node.manager.status().await?;
        let lease = status.lease(&c.id).context("no lease")?;
        ensure!(
            lease.refusals == 9 && lease.last_refusal.contains("not a CUDA client"),
            "{policy}: refusals {} ({})",
            lease.refusals,
            lease.last_refusal
        );
        println!(
            "{policy}: 6 control commands and 3 other requests from a root pod refused; daemon {:?} untouched",
            daemons_before
        );
        cleanup(&mut cri, &[(&pod, &c), (&pod2, &c2)]).await?;
    }
    Ok(())
}

/// `gpu-mps.io/cuda-processes: 2` on a 4Gi pod: two processes get 2Gi each from the server, a
/// third is refused cleanly (an MPS connection error, never a direct context), under exact and
/// uniform; the status shows the processes and the refusal.
async fn a_container_runs_at_most_its_cuda_processes(suite: Suite) -> Result<()> {
    for limits in [LimitsConfig::exact(), LimitsConfig::uniform()] {
        let policy = limits.policy;
        let node = GpuNode::start(&suite, limits).await?;
        let mut cri = node.cri().await?;
        let gpu = node.gpu_uuid(0).to_string();
        let pod = cri
            .run_pod_sandbox(
                &gpu_pod("multi", "default")
                    .gpu_limits("4Gi", 25)
                    .annotation("gpu-mps.io/cuda-processes", "2"),
            )
            .await?;
        let spec = ContainerSpec::new("workers", TEST_IMAGE)
            .command(&["/checker"])
            .args(&["mps-processes", "--count", "3", "--hold-seconds", "300"])
            .gpu(&gpu);
        let c = start(&mut cri, &pod, &spec).await?;
        let line = cri.first_stdout_line(&c, WAIT).await?;
        let procs = MpsProcesses::parse(&line)?;
        ensure!(
            procs.admitted == 2 && procs.refused == 1 && procs.direct_context == 0,
            "{policy}: {line}"
        );
        for child in procs.children.iter().filter(|c| c.admitted) {
            ensure!(
                served(child) == (Some("2G"), Some("25.0")),
                "{policy}: a process got {child}, not its 2Gi share"
            );
        }
        let refused = procs
            .children
            .iter()
            .find(|c| c.refused)
            .context("no refused child")?;
        ensure!(
            refused.error.as_deref() == Some(CUDA_REFUSED),
            "{policy}: {refused}"
        );
        let status = node.manager.status().await?;
        let lease = status.lease(&c.id).context("no lease")?;
        ensure!(
            lease.cuda_processes == 2
                && lease.admitted_pids.len() == 2
                && lease.refusals == 1
                && lease.last_refusal.contains("cuda-processes"),
            "{policy}: {lease:?}"
        );
        println!(
            "{policy}: 3 processes in a pod of 2: 2 admitted with 2Gi each, 1 refused ({})",
            lease.last_refusal
        );
        cleanup(&mut cri, &[(&pod, &c)]).await?;
    }
    Ok(())
}

/// A pod holding 64 silent connections: at most 4 are open at its gate (the rest wait in the
/// listen backlog, which costs the manager nothing), and another pod starts at once with its
/// own limits.
async fn stalled_connections_wait_in_their_own_gates_backlog(suite: Suite) -> Result<()> {
    let node = GpuNode::start(&suite, LimitsConfig::exact()).await?;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    let pod = cri
        .run_pod_sandbox(&gpu_pod("staller", "default").gpu_limits("2Gi", 20))
        .await?;
    let stall = ContainerSpec::new("stall", TEST_IMAGE)
        .command(&["/checker"])
        .args(&[
            "mps-stall",
            "--connections",
            "64",
            "--hold-seconds",
            "8",
            "--read-hello",
        ])
        .gpu(&gpu);
    let s = start(&mut cri, &pod, &stall).await?;
    let status = node
        .manager
        .wait_status("the stalling pod's gate is busy", WAIT, |st| {
            st.lease(&s.id).is_some_and(|l| l.gate_connections > 0)
        })
        .await?;
    let open = status.lease(&s.id).map_or(0, |l| l.gate_connections);
    ensure!(open <= 4, "{open} connections open at one container's gate");
    let started = Instant::now();
    let pod2 = cri
        .run_pod_sandbox(&gpu_pod("patient", "default").gpu_limits("4Gi", 50))
        .await?;
    let (c2, other) = admitted(&mut cri, &pod2, &client("infer", &gpu)).await?;
    let took = started.elapsed();
    ensure!(served(&other) == (Some("4G"), Some("50.0")), "{other}");
    ensure!(took < Duration::from_secs(5), "the other pod took {took:?}");
    let stalled = MpsStall::parse(&cri.first_stdout_line(&s, WAIT).await?)?;
    // It exits once it has printed; a delete racing that exit fails on containerd 1.6.
    cri.wait_exit(&s, WAIT).await?;
    ensure!(
        stalled.got_hello == 4 && stalled.closed_by_peer == 0,
        "the stalling pod: {stalled:?}"
    );
    println!(
        "64 stalled connections: {open} open at the gate, the rest in its backlog ({} got a hello); another pod admitted in {took:?}",
        stalled.got_hello
    );
    cleanup(&mut cri, &[(&pod, &s), (&pod2, &c2)]).await
}

/// `max_memory_limit = 8Gi` on the node, `2Gi` for namespace team-a: a team-a pod asking 4Gi,
/// any pod asking 16Gi and a pod asking for more CUDA processes than allowed are refused at
/// create with one line; the others start.
async fn the_node_maximums_refuse_a_pod_that_asks_for_more(suite: Suite) -> Result<()> {
    let limits = LimitsConfig::exact()
        .limit("max_memory_limit = \"8Gi\"")
        .limit("max_cuda_processes = 2")
        .toml("\n[limits.namespaces.team-a]\nmax_memory_limit = \"2Gi\"\n");
    let node = GpuNode::start(&suite, limits).await?;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    for (name, namespace, memory, processes, refusal) in [
        (
            "team-a-4gi",
            "team-a",
            "4Gi",
            "1",
            Some(
                "memory limit 4Gi is above the maximum 2Gi for namespace team-a (limits.max_memory_limit in the gpu-mps node config)",
            ),
        ),
        (
            "big",
            "default",
            "16Gi",
            "1",
            Some("memory limit 16Gi is above the maximum 8Gi for this node"),
        ),
        (
            "many",
            "default",
            "4Gi",
            "3",
            Some("3 CUDA processes is above the maximum 2 for this node"),
        ),
        ("team-a-2gi", "team-a", "2Gi", "1", None),
        ("fits", "default", "8Gi", "2", None),
    ] {
        let pod = cri
            .run_pod_sandbox(
                &gpu_pod(name, namespace)
                    .gpu_limits(memory, 25)
                    .annotation("gpu-mps.io/cuda-processes", processes),
            )
            .await?;
        let result = start(&mut cri, &pod, &client("infer", &gpu)).await;
        match (refusal, result) {
            (Some(want), Err(e)) => {
                let message = e.to_string();
                ensure!(message.contains(want), "{name}: {message}");
                ensure!(!message.contains('\n'), "{name}: more than one line: {message}");
            }
            (Some(_), Ok(_)) => bail!("{name}: started above a maximum"),
            (None, Err(e)) => bail!("{name}: refused within the maximums: {e}"),
            (None, Ok(c)) => cleanup(&mut cri, &[(&pod, &c)]).await?,
        }
    }
    Ok(())
}

/// The node config is edited without restarting the manager: new pods are still laid out by the
/// config the manager runs with (it published it), `gpu-mps status` warns, and the restart
/// applies the edit. A container laid out under a config the manager does not run with (a
/// published config not its own) is refused with "restart it".
async fn the_running_managers_config_is_the_one_that_counts(suite: Suite) -> Result<()> {
    let mut node = GpuNode::start(&suite, LimitsConfig::exact()).await?;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    let edited = LimitsConfig::ceiling("8Gi", 50);
    let new_config = node.manager.write_config(&edited, &node.bins, &suite.runc)?;

    let pod = cri
        .run_pod_sandbox(&gpu_pod("a", "default").gpu_limits("4Gi", 25))
        .await?;
    let (c, a) = admitted(&mut cri, &pod, &client("infer", &gpu)).await?;
    // Exact, as the manager runs: the server holds the pod's own limits, not the edited ceiling.
    ensure!(served(&a) == (Some("4G"), Some("25.0")), "after the edit: {a}");
    let status = node.manager.status().await?;
    ensure!(
        status.policy == "exact"
            && status
                .config_note
                .contains("has changed since gpu-mps-manager started"),
        "status: policy {} note {:?}",
        status.policy,
        status.config_note
    );
    cleanup(&mut cri, &[(&pod, &c)]).await?;

    // A published config that is not the running manager's: the shim lays the container out for
    // it, and the manager refuses it.
    let published_path = node.manager.config().published_path();
    let original = std::fs::read_to_string(&published_path)?;
    let foreign = PublishedConfig::new(new_config.clone(), node.manager.config_path(), 1);
    std::fs::write(&published_path, serde_json::to_string(&foreign)?)?;
    let pod = cri
        .run_pod_sandbox(&gpu_pod("b", "default").gpu_limits("4Gi", 25))
        .await?;
    let message = match start(&mut cri, &pod, &client("infer", &gpu)).await {
        Ok(_) => bail!("a container laid out under another config started"),
        Err(e) => e.to_string(),
    };
    ensure!(
        message.contains("node config changed since gpu-mps-manager started: restart it"),
        "{message}"
    );
    std::fs::write(&published_path, original)?;
    cri.delete_pod(&pod).await?;

    node.manager.restart().await?;
    node.manager.set_config(new_config);
    let status = node.manager.status().await?;
    ensure!(
        status.policy == LimitPolicy::Ceiling.to_string() && status.config_note.is_empty(),
        "after the restart: policy {} note {:?}",
        status.policy,
        status.config_note
    );
    let pod = cri
        .run_pod_sandbox(&gpu_pod("c", "default").gpu_limits("4Gi", 25))
        .await?;
    let (c, after) = admitted(&mut cri, &pod, &client("infer", &gpu)).await?;
    ensure!(
        served(&after) == (Some("8G"), Some("50.0")),
        "ceiling after the restart: {after}"
    );
    println!("edit without restart: still exact, status warned; foreign layout refused: {message}");
    cleanup(&mut cri, &[(&pod, &c)]).await
}

/// A second manager on the same root exits at once with one line naming the first; the first
/// keeps serving.
async fn one_manager_per_root(suite: Suite) -> Result<()> {
    let node = GpuNode::start(&suite, LimitsConfig::exact()).await?;
    let (status, output) = node.manager.run_second().await?;
    ensure!(!status.success(), "a second manager started: {output}");
    ensure!(
        output.contains("another gpu-mps-manager (pid") && output.contains("one manager per root"),
        "{output}"
    );
    node.manager
        .status()
        .await
        .context("the first manager stopped serving")?;
    let line = output
        .lines()
        .find(|l| l.contains("another gpu-mps-manager"))
        .unwrap_or("");
    println!("second manager refused: {line}");
    Ok(())
}

/// A process takes its channel and does not act as a CUDA client (the test double then leaves
/// its server stuck, as the real one was measured to: every new client waits). The manager
/// notices the daemon no longer answering, kills the server and its daemon, starts them again,
/// and refuses the container whose process took the last channel; the next pod's client is
/// admitted with its own limits.
async fn a_process_that_leaves_the_server_stuck_is_refused_and_the_gpu_recovers(suite: Suite) -> Result<()> {
    let limits = LimitsConfig {
        gate_handshake_timeout_seconds: Some(2),
        ..LimitsConfig::exact()
    };
    let node = GpuNode::start(&suite, limits).await?;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    let pod = cri
        .run_pod_sandbox(
            &gpu_pod("hostile", "default")
                .gpu_limits("4Gi", 25)
                .annotation("gpu-mps.io/cuda-processes", "2"),
        )
        .await?;
    let (h, _) = admitted(&mut cri, &pod, &client("infer", &gpu)).await?;
    let daemon_before = node.manager.status().await?.daemons[0].control_pid;
    let raw: MpsRaw = exec(&mut cri, &h, &["mps-raw", "--kind", "2", "--wait-seconds", "1"]).await?;
    ensure!(
        raw.replies.first().is_some_and(|r| r.descriptors == 1),
        "the raw request got no channel: {raw:?}"
    );
    let started = Instant::now();
    let pod2 = cri
        .run_pod_sandbox(&gpu_pod("victim", "default").gpu_limits("8Gi", 50))
        .await?;
    let (v, victim) = admitted(&mut cri, &pod2, &client("infer", &gpu)).await?;
    let took = started.elapsed();
    ensure!(
        served(&victim) == (Some("8G"), Some("50.0")),
        "the victim got {victim}"
    );
    let status = node.manager.status().await?;
    let daemon = &status.daemons[0];
    ensure!(
        daemon.control_pid != daemon_before && daemon.faults >= 1,
        "the stuck daemon was not replaced: {daemon:?}"
    );
    let again: MpsClient = exec(&mut cri, &h, &["mps-client"]).await?;
    ensure!(
        again.refused,
        "the container that left the server stuck got: {again}"
    );
    let lease = node.manager.status().await?;
    let lease = lease.lease(&h.id).context("no lease")?;
    ensure!(lease.last_refusal.contains("left the server stuck"), "{lease:?}");
    println!(
        "a channel taken and not used: the server was replaced ({} -> {}), the victim admitted after {took:?}, the culprit refused",
        daemon_before, daemon.control_pid
    );
    cleanup(&mut cri, &[(&pod, &h), (&pod2, &v)]).await
}

/// A pod of one CUDA process holds its channel while the manager restarts (SIGTERM, then
/// SIGKILL): the new manager finds the process among the server's clients and still refuses a
/// second one.
async fn a_restarted_manager_still_counts_the_running_processes(suite: Suite) -> Result<()> {
    let mut node = GpuNode::start(&suite, LimitsConfig::exact()).await?;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    let pod = cri
        .run_pod_sandbox(&gpu_pod("single", "default").gpu_limits("4Gi", 25))
        .await?;
    let (c, _) = admitted(&mut cri, &pod, &client("infer", &gpu)).await?;
    for how in ["SIGTERM", "SIGKILL"] {
        if how == "SIGTERM" {
            node.manager.restart().await?;
        } else {
            node.manager.kill();
            node.manager.start_again().await?;
        }
        let second: MpsClient = exec(&mut cri, &c, &["mps-client"]).await?;
        ensure!(
            second.refused && !second.admitted,
            "after a {how} restart a second process of a 1-process pod got: {second}"
        );
        let status = node.manager.status().await?;
        let lease = status.lease(&c.id).context("no lease")?;
        ensure!(lease.admitted_pids.len() == 1, "after a {how} restart: {lease:?}");
    }
    println!("after SIGTERM and SIGKILL restarts the running process still counts: a second one is refused");
    cleanup(&mut cri, &[(&pod, &c)]).await
}

/// The manager is killed (SIGKILL) while a pod runs; a new CUDA process in the pod connects
/// while no manager runs. The gate keeper holds the gate's socket, so the process waits in the
/// backlog, and the next manager admits it with the pod's own limits.
async fn a_process_that_connects_while_the_manager_is_down_gets_its_limits(suite: Suite) -> Result<()> {
    let mut node = GpuNode::start(&suite, LimitsConfig::exact()).await?;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    let pod = cri
        .run_pod_sandbox(
            &gpu_pod("survivor", "default")
                .gpu_limits("4Gi", 25)
                .annotation("gpu-mps.io/cuda-processes", "2"),
        )
        .await?;
    let (c, _) = admitted(&mut cri, &pod, &client("infer", &gpu)).await?;
    node.manager.kill();
    let mut exec_cri = node.cri().await?;
    let waiting = exec::<MpsClient>(&mut exec_cri, &c, &["mps-client"]);
    let restart = async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        node.manager.start_again().await
    };
    let (late, restarted) = tokio::join!(waiting, restart);
    restarted?;
    let late = late?;
    ensure!(
        late.admitted && served(&late) == (Some("2G"), Some("25.0")),
        "the process that connected while the manager was down: {late}"
    );
    println!("a process connected during a SIGKILL restart: admitted afterwards with its 2Gi share");
    cleanup(&mut cri, &[(&pod, &c)]).await
}
