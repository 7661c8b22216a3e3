//! Faults the node must survive (issue 8), through real containerd (1.6, 1.7, 2.x) and runc
//! with the CRI handler `gpu-mps`; the MPS daemon is the test double.
//!
//! Run: `cargo test -p gpu-mps-e2e --test cri_faults -- --nocapture`.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use gpu_mps_e2e::checker::{CheckerLine, MpsClient, Report};
use gpu_mps_e2e::containerd::{CRI_NAMESPACE, GPU_MPS_HANDLER};
use gpu_mps_e2e::image::TEST_IMAGE;
use gpu_mps_e2e::manager::IDLE_GRACE_SECONDS;
use gpu_mps_e2e::{ContainerSpec, GpuNode, LimitsConfig, PodSpec, StatusLookup, Suite, per_suite};
use k8s_cri::v1 as cri;

per_suite!(
    the_manager_sigkilled_under_running_containers_adopts_them_and_releases_later,
    containerd_restarts_under_a_running_container_and_new_creates_work,
    a_control_daemon_killed_under_a_container_is_replaced_and_its_lease_marked,
    a_server_killed_under_clients_gives_new_clients_their_limits_from_the_next_one,
    a_container_killed_during_its_create_leaves_no_lease_gate_or_daemon,
    a_lost_state_file_is_rebuilt_from_the_running_containers_and_a_full_disk_refuses_in_one_line,
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

/// A container that connects as a CUDA process would, holds its channel, and prints the
/// server's limits as the (fake) server handed them.
fn mps_client(name: &str, gpu: &str) -> ContainerSpec {
    ContainerSpec::new(name, TEST_IMAGE)
        .command(&["/checker"])
        .args(&["mps-client", HOLD])
        .gpu(gpu)
}

async fn admitted(
    cri: &mut gpu_mps_e2e::CriClient,
    name: &str,
    gpu: &str,
    memory: &str,
    threads: u8,
) -> Result<(gpu_mps_e2e::cri::Pod, gpu_mps_e2e::cri::Container, MpsClient)> {
    let pod = cri
        .run_pod_sandbox(&PodSpec::new(name, "default", GPU_MPS_HANDLER).gpu_limits(memory, threads))
        .await?;
    let container = cri.create_container(&pod, &mps_client(name, gpu)).await?;
    cri.start_container(&container).await?;
    let client = MpsClient::parse(&cri.first_stdout_line(&container, WAIT).await?)?;
    ensure!(client.admitted, "{name} was not admitted: {client}");
    Ok((pod, container, client))
}

/// Fault 2: the MPS control daemon is SIGKILLed while a container's client holds its server.
/// The manager notices on its next tick (1 s): it marks the lease (its processes lost their
/// server; `gpu-mps status`), logs it, and starts a new daemon; a new container's client gets
/// its own limits from the new daemon's server.
async fn a_control_daemon_killed_under_a_container_is_replaced_and_its_lease_marked(
    suite: Suite,
) -> Result<()> {
    for limits in [LimitsConfig::uniform(), LimitsConfig::exact()] {
        let policy = limits.policy.to_string();
        let node = GpuNode::start(&suite, limits).await?;
        let mut cri = node.cri().await?;
        let gpu = node.gpu_uuid(0).to_string();
        let (old_pod, old, _) = admitted(&mut cri, "daemon-victim", &gpu, "2Gi", 25).await?;
        let before = node.manager.status().await?;
        let daemon_pid = before.daemons[0].control_pid;
        ensure!(
            before.lease(&old.id).is_some_and(|l| l.daemon_lost_unix == 0),
            "{before:#?}"
        );
        let killed = std::time::Instant::now();
        gpu_mps_e2e::processes::kill_hard(daemon_pid);
        node.manager
            .wait_status("the lease marked", Duration::from_secs(2), |s| {
                s.lease(&old.id).is_some_and(|l| l.daemon_lost_unix > 0)
            })
            .await?;
        let noticed = killed.elapsed();
        let after = node
            .manager
            .wait_status("a new daemon", WAIT, |s| {
                s.daemons.len() == 1
                    && s.daemons[0].control_pid != daemon_pid
                    && gpu_mps_e2e::processes::alive(s.daemons[0].control_pid)
            })
            .await?;
        let log = node.manager.log_tail(200);
        ensure!(
            log.contains("MPS control daemon died while containers use it"),
            "no log line for the death: {log}"
        );
        let summary = after.leases_table();
        ensure!(
            summary.contains("died (unix "),
            "status does not show it: {summary}"
        );
        // Uniform holds every lease of a server to one class: the new container shares it.
        let (memory, threads, served) = if policy == "uniform" {
            ("2Gi", 25, ("2G", "25.0"))
        } else {
            ("3Gi", 40, ("3G", "40.0"))
        };
        let (new_pod, new, client) = admitted(&mut cri, "after-death", &gpu, memory, threads).await?;
        ensure!(
            client.mem.get("0").map(String::as_str) == Some(served.0)
                && client.threads.as_deref() == Some(served.1),
            "{policy}: the container started after the daemon's death got {client}"
        );
        ensure!(
            node.manager
                .status()
                .await?
                .lease(&new.id)
                .is_some_and(|l| l.daemon_lost_unix == 0),
            "a new lease is marked"
        );
        println!(
            "{}: {policy}: control daemon {daemon_pid} SIGKILLed under a client: lease marked after {} ms, new daemon {}, a new container got {memory}/{threads}%",
            suite.containerd_version,
            noticed.as_millis(),
            after.daemons[0].control_pid
        );
        for (pod, container) in [(&old_pod, &old), (&new_pod, &new)] {
            cri.delete_container(container).await?;
            cri.delete_pod(pod).await?;
        }
        node.manager
            .wait_status("both released", WAIT, |s| s.leases.is_empty())
            .await?;
    }
    Ok(())
}

/// Fault 7: the MPS server is SIGKILLed while a client holds it, under `exact` also while
/// clients of three other sizes are mid-handshake (`kubectl exec` of a CUDA process in running
/// containers). A client admitted while it died holds its own limits, never another size's;
/// every client afterwards gets its own limits from the server the daemon starts next (the
/// one limit cache is per daemon process: the new server starts from the defaults the owner
/// set last, and a client of another size gets its limits set before it is let through).
async fn a_server_killed_under_clients_gives_new_clients_their_limits_from_the_next_one(
    suite: Suite,
) -> Result<()> {
    let node = GpuNode::start(&suite, LimitsConfig::exact()).await?;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    let (first_pod, first, client) = admitted(&mut cri, "server-victim", &gpu, "2Gi", 25).await?;
    let server = client.server_pid.context("no server pid")?;
    let sizes = [
        ("1Gi", 10, "1G", "10.0"),
        ("3Gi", 40, "3G", "40.0"),
        ("5Gi", 60, "5G", "60.0"),
    ];
    let mut racing = Vec::new();
    for (i, (memory, threads, _, _)) in sizes.iter().enumerate() {
        let name = format!("racing-{i}");
        let pod = cri
            .run_pod_sandbox(&PodSpec::new(&name, "default", GPU_MPS_HANDLER).gpu_limits(memory, *threads))
            .await?;
        let spec = ContainerSpec::new(&name, TEST_IMAGE)
            .command(&["/checker"])
            .args(&["report", HOLD])
            .gpu(&gpu);
        let container = cri.create_container(&pod, &spec).await?;
        cri.start_container(&container).await?;
        Report::parse(&cri.first_stdout_line(&container, WAIT).await?)?;
        racing.push((pod, container));
    }
    async fn cuda_process(
        mut cri: gpu_mps_e2e::CriClient,
        container: gpu_mps_e2e::cri::Container,
    ) -> Result<MpsClient> {
        let out = cri
            .exec_sync(&container, &["/checker", "mps-client"], WAIT)
            .await
            .map_err(|s| anyhow::anyhow!("exec in {}: {}", container.name, s.message()))?;
        MpsClient::parse(out.last_line())
    }
    // Each container starts CUDA processes one after another while the server is killed:
    // some handshakes come before, some during, some after.
    const ROUNDS: usize = 4;
    let handshakes = racing.iter().map(|(_, c)| {
        let (cri, c) = (cri.clone(), c.clone());
        async move {
            let mut seen = Vec::new();
            for _ in 0..ROUNDS {
                seen.push(cuda_process(cri.clone(), c.clone()).await);
            }
            seen
        }
    });
    let kill = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        gpu_mps_e2e::processes::kill_hard(server);
    };
    let (during, ()) = tokio::join!(gpu_mps_e2e::concurrent::join_all(handshakes), kill);
    let (mut on_old, mut on_new, mut refused) = (0, 0, 0);
    for (clients, (memory, threads, mem, thr)) in during.into_iter().zip(sizes) {
        for client in clients {
            let client = client?;
            if !client.admitted {
                refused += 1;
                continue;
            }
            if client.server_pid == Some(server) {
                on_old += 1;
            } else {
                on_new += 1;
            }
            ensure!(
                client.mem.get("0").map(String::as_str) == Some(mem)
                    && client.threads.as_deref() == Some(thr),
                "a {memory}/{threads}% client admitted while the server died got {client}"
            );
        }
    }
    ensure!(on_new > 0, "no client met the next server during the race");
    for ((_, container), (memory, threads, mem, thr)) in racing.iter().zip(sizes) {
        let again = cuda_process(cri.clone(), container.clone()).await?;
        ensure!(
            again.admitted
                && again.server_pid.is_some_and(|p| p != server)
                && again.mem.get("0").map(String::as_str) == Some(mem)
                && again.threads.as_deref() == Some(thr),
            "a new {memory}/{threads}% client after the server died got {again}"
        );
    }
    let (last_pod, last, after) = admitted(&mut cri, "after-server", &gpu, "2Gi", 25).await?;
    ensure!(
        after.server_pid.is_some_and(|p| p != server)
            && after.mem.get("0").map(String::as_str) == Some("2G")
            && after.threads.as_deref() == Some("25.0"),
        "a 2Gi client after the server died got {after}"
    );
    println!(
        "{}: server {server} SIGKILLed under a client while 3 containers of other sizes started {ROUNDS} CUDA processes each: {on_old} admitted by the old server, {on_new} by the new one, {refused} refused; every admitted one held its own limits (new server {:?})",
        suite.containerd_version, after.server_pid
    );
    racing.push((first_pod, first));
    racing.push((last_pod, last));
    for (pod, container) in &racing {
        cri.delete_container(container).await?;
        cri.delete_pod(pod).await?;
    }
    node.manager
        .wait_status("all released", WAIT, |s| s.leases.is_empty())
        .await?;
    Ok(())
}

/// Where the stand-in runtime of fault 6 says it holds a create, and the file whose presence
/// makes it hold.
struct HeldCreate {
    dir: std::path::PathBuf,
}

impl HeldCreate {
    /// A low-level runtime for gpu-mps-shim's `runc_path`: `create` waits (with its pid in
    /// `<dir>/held`) while `<dir>/hold` exists, then it execs the real runc, as
    /// nvidia-container-runtime would.
    fn install(dir: &std::path::Path, runc: &std::path::Path) -> Result<(HeldCreate, std::path::PathBuf)> {
        let script = dir.join("held-runtime");
        let text = format!(
            "#!/bin/sh\n\
             for a in \"$@\"; do\n\
               if [ \"$a\" = create ] && [ -e '{d}/hold' ]; then\n\
                 echo $$ > '{d}/held'\n\
                 while [ -e '{d}/hold' ]; do sleep 0.05; done\n\
               fi\n\
             done\n\
             exec '{runc}' \"$@\"\n",
            d = dir.display(),
            runc = runc.display()
        );
        std::fs::write(&script, text)?;
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
        Ok((
            HeldCreate {
                dir: dir.to_path_buf(),
            },
            script,
        ))
    }

    fn hold(&self) -> Result<()> {
        let _ = std::fs::remove_file(self.dir.join("held"));
        std::fs::write(self.dir.join("hold"), "")?;
        Ok(())
    }

    fn release(&self) {
        let _ = std::fs::remove_file(self.dir.join("hold"));
    }

    /// The pid of the create it holds, once it holds one.
    async fn held_pid(&self) -> Result<u32> {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            if let Some(pid) = std::fs::read_to_string(self.dir.join("held"))
                .ok()
                .and_then(|t| t.trim().parse().ok())
            {
                return Ok(pid);
            }
            ensure!(std::time::Instant::now() < deadline, "no create was held");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Fault 6: a container is killed during its create, once between gpu-mps-shim's rewrite and
/// runc's start (the low-level runtime the shim execs is SIGKILLed), once during its
/// createRuntime hook (the hook is SIGKILLed while it waits for a paused manager). Each create
/// fails; afterwards nothing of it is left: no lease, no gate dir, and the daemon stops once
/// idle. The same pod then starts a container normally.
async fn a_container_killed_during_its_create_leaves_no_lease_gate_or_daemon(suite: Suite) -> Result<()> {
    let mut node = GpuNode::start(&suite, LimitsConfig::exact()).await?;
    let (held, runtime) = HeldCreate::install(node.manager.dir(), &suite.runc)?;
    let config = node
        .manager
        .write_config(&LimitsConfig::exact(), &node.bins, &runtime)?;
    node.manager.set_config(config);
    node.manager.restart().await?;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    let pod = cri
        .run_pod_sandbox(&PodSpec::new("killed-in-create", "default", GPU_MPS_HANDLER).gpu_limits("2Gi", 25))
        .await?;
    let before = node.manager.gate_dir_names();
    let spec = |name: &str| mps_client(name, &gpu);

    // Between the shim's rewrite and runc.
    held.hold()?;
    // CRI's CreateContainer only records the container: runc create runs in StartContainer.
    let before_runc = cri.create_container(&pod, &spec("before-runc")).await?;
    let create = cri.start_container(&before_runc);
    let kill = async {
        let pid = held.held_pid().await?;
        gpu_mps_e2e::processes::kill_hard(pid);
        held.release();
        Ok::<u32, anyhow::Error>(pid)
    };
    let (created, killed) = tokio::join!(create, kill);
    let killed = killed?;
    ensure!(
        created.is_err(),
        "the create whose runtime was killed succeeded: {created:?}"
    );
    // What kubelet does with a container that failed to start.
    cri.delete_container(&before_runc).await?;
    // containerd 1.6 and 1.7 run gpu-mps-shim's `delete` for it, which removes the gate dir at
    // once; 2.x does not, and the manager removes an unserved gate dir once no Acquire can come
    // for it any more (twice the hook's timeout).
    let hook_timeout = Duration::from_secs(node.manager.config().hook.timeout_seconds);
    let manager = &node.manager;
    manager
        .wait_status(
            "nothing left of a create killed before runc",
            2 * hook_timeout + WAIT,
            |s| s.leases.is_empty() && manager.gate_dir_names() == before,
        )
        .await
        .with_context(|| format!("gate dirs now {:?}, before {before:?}", manager.gate_dir_names()))?;
    println!(
        "{}: runtime {killed} SIGKILLed between the shim's rewrite and runc: create failed, nothing left",
        suite.containerd_version
    );

    // During the createRuntime hook (the manager paused, so the hook waits for its answer).
    node.manager.pause();
    let in_hook = cri.create_container(&pod, &spec("in-hook")).await?;
    let create = cri.start_container(&in_hook);
    let kill = async {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            let hooks = gpu_mps_e2e::processes::with_argument(
                b"gpu-mps-hook",
                gpu_mps_api::hook_invocation::STAGE_CREATE_RUNTIME.as_bytes(),
            );
            if let Some(pid) = hooks.first() {
                tokio::time::sleep(Duration::from_millis(200)).await;
                gpu_mps_e2e::processes::kill_hard(*pid);
                return Ok::<u32, anyhow::Error>(*pid);
            }
            ensure!(std::time::Instant::now() < deadline, "no hook ran");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let (created, killed) = tokio::join!(create, kill);
    node.manager.resume();
    let killed = killed?;
    ensure!(
        created.is_err(),
        "the create whose hook was killed succeeded: {created:?}"
    );
    let manager = &node.manager;
    manager
        .wait_status("nothing left of a create killed in its hook", WAIT, |s| {
            s.leases.is_empty() && manager.gate_dir_names() == before
        })
        .await
        .with_context(|| format!("gate dirs now {:?}, before {before:?}", manager.gate_dir_names()))?;
    println!(
        "{}: hook {killed} SIGKILLed while it waited for the manager: create failed, nothing left",
        suite.containerd_version
    );

    let container = cri.create_container(&pod, &spec("after")).await?;
    cri.start_container(&container).await?;
    let client = MpsClient::parse(&cri.first_stdout_line(&container, WAIT).await?)?;
    ensure!(client.admitted, "the next container: {client}");
    cri.delete_container(&container).await?;
    cri.delete_pod(&pod).await?;
    let grace = Duration::from_secs(IDLE_GRACE_SECONDS);
    node.manager
        .wait_status("no lease and no daemon at the end", grace + WAIT, |s| {
            s.leases.is_empty() && s.daemons.is_empty()
        })
        .await?;
    ensure!(
        node.manager.gate_dir_names() == before,
        "gate dirs left: {:?}",
        node.manager.gate_dir_names()
    );
    Ok(())
}

/// Fills the filesystem of `dir` (a small tmpfs) with one file, until it takes no more.
fn fill_up(dir: &std::path::Path) -> Result<std::path::PathBuf> {
    use std::io::Write;
    let path = dir.join("filler");
    let mut file = std::fs::File::create(&path)?;
    let chunk = vec![0u8; 64 * 1024];
    loop {
        match file.write_all(&chunk) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(nix::libc::ENOSPC) => return Ok(path),
            Err(e) => return Err(e.into()),
        }
    }
}

/// Fault 5: the manager is SIGKILLed under two running GPU containers and its state file is
/// corrupted (then deleted, then of another version); each new manager starts, says so in one
/// line, and rebuilds both leases (same pids, limits) and their daemon from the lease files
/// and the daemon's pid file, so their memory still counts. Then its root (a small tmpfs) fills
/// up: a new container is refused with one line naming the disk, a deletion still releases, a
/// restart with the disk full still serves, and once there is room the next create works and
/// the leases equal the live containers again.
async fn a_lost_state_file_is_rebuilt_from_the_running_containers_and_a_full_disk_refuses_in_one_line(
    suite: Suite,
) -> Result<()> {
    let limits = LimitsConfig::exact().root_on_tmpfs(8 << 20);
    let mut node = GpuNode::start(&suite, limits).await?;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    let root = node.manager.config().root.clone();
    let state_path = node.manager.config().state_path();
    let mut running = Vec::new();
    for (i, memory) in ["6Gi", "5Gi"].iter().enumerate() {
        let (pod, container, _) = admitted(&mut cri, &format!("fault5-{i}"), &gpu, memory, 25).await?;
        running.push((pod, container));
    }
    let before = node.manager.status().await?;
    ensure!(
        before.leases.len() == 2 && before.daemons.len() == 1,
        "before: {before:#?}"
    );
    let daemon_pid = before.daemons[0].control_pid;

    let faults: [(&str, Option<&[u8]>); 3] = [
        ("corrupt", Some(b"{\"version\": 1, \"leases\": {\"trunc")),
        ("deleted", None),
        ("another version", Some(b"{\"version\": 7}")),
    ];
    for (fault, bytes) in faults {
        node.manager.kill();
        match bytes {
            Some(bytes) => std::fs::write(&state_path, bytes)?,
            None => std::fs::remove_file(&state_path)?,
        }
        node.manager.start_again().await?;
        let after = node.manager.status().await?;
        for (_, container) in &running {
            let (was, now) = (before.lease(&container.id), after.lease(&container.id));
            ensure!(
                matches!((was, now), (Some(w), Some(n)) if (w.pid, w.memory_limit_bytes) == (n.pid, n.memory_limit_bytes)),
                "{fault}: the lease of {} was not rebuilt: before {was:?}, after {now:?}",
                container.id
            );
        }
        ensure!(
            after.daemons.len() == 1 && after.daemons[0].control_pid == daemon_pid,
            "{fault}: the daemon {daemon_pid} was not adopted: {:#?}",
            after.daemons
        );
        println!(
            "{}: state file {fault}: both leases and daemon {daemon_pid} rebuilt",
            suite.containerd_version
        );
    }
    let said = node.manager.log_tail(400);
    ensure!(
        said.lines()
            .filter(|l| l.contains("rebuilding the leases from their own files"))
            .count()
            >= 2,
        "the manager did not say it rebuilt: {said}"
    );
    // 11 of the GPU's 16 GiB are still counted: 6 more do not fit.
    let pod = cri
        .run_pod_sandbox(&PodSpec::new("fault5-big", "default", GPU_MPS_HANDLER).gpu_limits("6Gi", 25))
        .await?;
    let big = cri.create_container(&pod, &mps_client("infer", &gpu)).await?;
    let refused = cri
        .start_container(&big)
        .await
        .expect_err("6Gi more was admitted on a GPU with 5Gi left");
    ensure!(
        refused.message().contains("11Gi of 16Gi"),
        "the rebuilt leases were not counted: {}",
        refused.message()
    );
    cri.delete_container(&big).await?;
    cri.delete_pod(&pod).await?;

    // The root fills up.
    let filler = fill_up(&root)?;
    let pod = cri
        .run_pod_sandbox(&PodSpec::new("fault5-full", "default", GPU_MPS_HANDLER).gpu_limits("1Gi", 25))
        .await?;
    let late = cri.create_container(&pod, &mps_client("infer", &gpu)).await?;
    let refused = cri
        .start_container(&late)
        .await
        .expect_err("a lease was given that could not be recorded");
    let line = refused
        .message()
        .lines()
        .find(|l| l.contains("cannot get its lease"))
        .with_context(|| format!("no line says why: {}", refused.message()))?
        .to_string();
    ensure!(line.contains("free space under"), "{line}");
    println!("{}: disk full: {line}", suite.containerd_version);
    cri.delete_container(&late).await?;
    cri.delete_pod(&pod).await?;
    let (pod0, first) = running.remove(0);
    cri.delete_container(&first).await?;
    cri.delete_pod(&pod0).await?;
    node.manager
        .wait_status("the release with the disk full", WAIT, |s| s.leases.len() == 1)
        .await?;
    node.manager.kill();
    node.manager.start_again().await?;
    let full = node.manager.status().await?;
    ensure!(
        full.leases.len() == 1 && full.lease(&running[0].1.id).is_some(),
        "after a restart with the disk full: {:#?}",
        full.leases
    );

    // Room again.
    std::fs::remove_file(&filler)?;
    let (_, again, _) = admitted(&mut cri, "fault5-again", &gpu, "1Gi", 25).await?;
    let now = node.manager.status().await?;
    let mut leased: Vec<&str> = now.leases.iter().map(|l| l.container_id.as_str()).collect();
    let mut live = vec![running[0].1.id.as_str(), again.id.as_str()];
    leased.sort();
    live.sort();
    ensure!(leased == live, "leases {leased:?}, live containers {live:?}");
    let files = std::fs::read_dir(root.join("leases"))?
        .flatten()
        .filter(|f| f.file_name().to_string_lossy().ends_with(".json"))
        .count();
    ensure!(files == 2, "{files} lease files for 2 leases");
    println!(
        "{}: room again: a new container started; 2 leases, 2 lease files",
        suite.containerd_version
    );
    Ok(())
}
