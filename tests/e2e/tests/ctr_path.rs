//! gpu-mps through plain `ctr run --runc-binary gpu-mps-shim`, the way a person debugs a node:
//! what a GPU container sees, what a non-GPU container does not see, and that a container
//! cannot override what the shim sets.
//!
//! Needs the workspace built (`cargo build --workspace`) and the static checker; see
//! gpu_mps_e2e::binaries. Run: `cargo test -p gpu-mps-e2e --test ctr_path -- --nocapture`.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use gpu_mps_e2e::checker::{CONTAINER_PIPE_DIR, CheckerLine, MpsClient, Report, comparable, host_namespace};
use gpu_mps_e2e::ctr::{CTR_NAMESPACE, CtrOutput};
use gpu_mps_e2e::image::{CHECKER_PATH, NVIDIA_SMI_PATH};
use gpu_mps_e2e::{CtrRun, GpuNode, LimitsConfig, Suite, per_suite, processes};

per_suite!(
    gpu_container_sees_its_daemon,
    container_cannot_override_the_shim,
    non_gpu_container_is_untouched,
    a_network_namespace_bound_on_the_host_does_not_stop_a_gpu_container
);

/// A container of GPU `gpu` with limits 4Gi / 25 %, through gpu-mps-shim.
fn gpu_run(node: &GpuNode, rootfs: &Path, gpu: &str, args: &[&str]) -> CtrRun {
    CtrRun::checker("gpu", rootfs, args)
        .runc_binary(&node.bins.shim)
        .gpu(gpu)
        .gpu_limits("4Gi", 25)
}

fn succeeded(what: &str, out: &CtrOutput) -> Result<()> {
    ensure!(
        out.status.success(),
        "{what} failed ({}): stdout {:?} stderr {:?}",
        out.status,
        out.stdout,
        out.stderr
    );
    Ok(())
}

async fn report_of(node: &GpuNode, run: &CtrRun) -> Result<Report> {
    let out = node.containerd.ctr().run(run).await?;
    succeeded(&format!("ctr run {}", run.id), &out)?;
    Report::parse(out.last_line())
}

/// The env, its own read-only gate dir, on ITS GPU's daemon, a private /dev/shm and IPC namespace,
/// nvidia-smi masked, no capability added; and the fake daemon serves the pod's limits.
async fn gpu_container_sees_its_daemon(suite: Suite) -> Result<()> {
    let node = GpuNode::start(&suite, LimitsConfig::uniform()).await?;
    let rootfs = node.rootfs()?;
    let uuid = node.gpu_uuid(0).to_string();
    let run = gpu_run(&node, &rootfs, &uuid, &["report"]);
    let report = report_of(&node, &run).await?;
    println!("GPU container report: {}", report);

    let env = report.mps_env();
    ensure!(
        env.get("CUDA_MPS_PIPE_DIRECTORY") == Some(&CONTAINER_PIPE_DIR),
        "pipe dir env: {env:?}"
    );
    ensure!(
        env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") == Some(&"25"),
        "thread env: {env:?}"
    );
    ensure!(
        env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") == Some(&"0=4096M"),
        "memory env: {env:?}"
    );

    let pipe = &report.mps_pipe_dir;
    let mount = pipe.mount.as_ref().context("no mount at /tmp/nvidia-mps")?;
    ensure!(
        pipe.is_mount_point && mount.has_option("ro"),
        "/tmp/nvidia-mps is not a read-only mount: {pipe:?}"
    );
    ensure!(
        pipe.create_file == "EROFS",
        "creating a file in /tmp/nvidia-mps gave {:?}, not EROFS",
        pipe.create_file
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
    let gate = node.manager.gate_dir(&run.id);
    ensure!(
        mount.is_bind_of(&gate.to_string_lossy()),
        "/tmp/nvidia-mps is {}, not the container's gate {} (GPU {uuid})",
        mount.root,
        gate.display()
    );

    let shm = &report.dev_shm;
    ensure!(
        shm.marker_created,
        "the checker could not write its /dev/shm marker: {shm:?}"
    );
    ensure!(
        !Path::new(&shm.marker).exists(),
        "the host's /dev/shm has the container's marker {}",
        shm.marker
    );
    let ipc = report.namespaces.get("ipc").cloned().flatten();
    ensure!(
        ipc.is_some() && ipc != host_namespace("ipc"),
        "the container shares the host's IPC namespace: {ipc:?}"
    );

    let smi = report
        .nvidia_smi
        .get(NVIDIA_SMI_PATH)
        .context("no nvidia-smi entry in the report")?;
    ensure!(
        smi.masked && smi.head.as_deref() == Some(""),
        "{NVIDIA_SMI_PATH} is not masked: {smi:?}"
    );

    // The same container through plain runc: the shim adds no capability, uid or gid.
    let plain = report_of(
        &node,
        &CtrRun {
            runc_binary: None,
            ..gpu_run(&node, &rootfs, &uuid, &["report"])
        },
    )
    .await?;
    ensure!(
        (report.cap_eff.as_ref(), report.uid, report.gid) == (plain.cap_eff.as_ref(), plain.uid, plain.gid),
        "capabilities/uid/gid through the shim {:?} differ from plain runc {:?}",
        (&report.cap_eff, report.uid, report.gid),
        (&plain.cap_eff, plain.uid, plain.gid)
    );
    ensure!(
        plain.mps_env().is_empty() && !plain.nvidia_smi[NVIDIA_SMI_PATH].masked,
        "plain runc changed: {}",
        plain
    );

    // A client reaches the fake daemon, whose server holds the pod's limits.
    let out = node
        .containerd
        .ctr()
        .run(&gpu_run(&node, &rootfs, &uuid, &["mps-client"]))
        .await?;
    succeeded("checker mps-client", &out)?;
    let client = MpsClient::parse(out.last_line())?;
    ensure!(client.connected, "mps-client did not connect: {}", client);
    ensure!(
        client.threads.as_deref() == Some("25.0"),
        "server threads: {}",
        client
    );
    ensure!(
        client.mem.get("0").map(String::as_str) == Some("4G"),
        "server memory: {}",
        client
    );

    // GPU 1, named by index: its own gate, on GPU 1's daemon (checked by its lease below).
    let other_run = gpu_run(&node, &rootfs, "1", &["report"]);
    let other = report_of(&node, &other_run).await?;
    let other_mount = other.mps_pipe_dir.mount;
    let other_gate = node.manager.gate_dir(&other_run.id);
    ensure!(
        other_mount
            .as_ref()
            .is_some_and(|m| m.is_bind_of(&other_gate.to_string_lossy())),
        "GPU 1's container has {:?}, not {}",
        other_mount.map(|m| m.root),
        other_gate.display()
    );

    // ctr run --rm deleted the containers: the poststop hook released their leases.
    node.manager
        .wait_status(
            "leases released after ctr run --rm",
            Duration::from_secs(10),
            |s| s.leases.is_empty(),
        )
        .await?;
    Ok(())
}

/// A container that sets CUDA_MPS_* itself and mounts something at /tmp/nvidia-mps still gets
/// the pod's limits and its gate dir: the shim strips the overrides, it does not only
/// append (getenv returns the FIRST of duplicate names).
async fn container_cannot_override_the_shim(suite: Suite) -> Result<()> {
    let node = GpuNode::start(&suite, LimitsConfig::uniform()).await?;
    let rootfs = node.rootfs()?;
    let uuid = node.gpu_uuid(0).to_string();
    let decoy = node.containerd.dir().join("decoy-pipe-dir");
    std::fs::create_dir_all(&decoy)?;
    let overriding = |args: &[&str]| {
        gpu_run(&node, &rootfs, &uuid, args)
            .env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100")
            .env("CUDA_MPS_PIPE_DIRECTORY", "/elsewhere")
            .env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=100G")
            .mount(&format!(
                "type=bind,src={},dst={CONTAINER_PIPE_DIR},options=rbind:rw",
                decoy.display()
            ))
    };

    let reporting = overriding(&["report"]);
    let report = report_of(&node, &reporting).await?;
    let env = report.mps_env();
    ensure!(
        env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") == Some(&"25"),
        "thread env: {env:?}"
    );
    ensure!(
        env.get("CUDA_MPS_PIPE_DIRECTORY") == Some(&CONTAINER_PIPE_DIR),
        "pipe dir env: {env:?}"
    );
    ensure!(
        env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") == Some(&"0=4096M"),
        "memory env: {env:?}"
    );
    let gate = node.manager.gate_dir(&reporting.id);
    let mount = report.mps_pipe_dir.mount.as_ref();
    ensure!(
        mount.is_some_and(|m| m.is_bind_of(&gate.to_string_lossy())),
        "pipe dir mount: {:?}, not the container's gate {}",
        mount.map(|m| &m.root),
        gate.display()
    );
    ensure!(
        report.mps_pipe_dir.create_file == "EROFS",
        "the decoy rw mount survived: {:?}",
        report.mps_pipe_dir
    );

    // The process's real environment, duplicates included, read from the host while it runs.
    let run = overriding(&["sleep", "3"]);
    let ctr = node.containerd.ctr();
    let (out, environ) = tokio::join!(ctr.run(&run), async {
        for _ in 0..100 {
            // Until runc's init has exec'd the checker, the pid shows runc's own environment.
            let pid = node.containerd.container_pid(CTR_NAMESPACE, &run.id);
            if let Some(pid) =
                pid.filter(|pid| processes::cmdline(*pid).first().map(String::as_str) == Some(CHECKER_PATH))
            {
                return Ok(processes::environ(pid)?);
            }
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        anyhow::bail!("container {} did not show up in runc's state", run.id)
    });
    succeeded("checker sleep", &out?)?;
    let mps: Vec<String> = environ?
        .into_iter()
        .filter(|v| v.starts_with("CUDA_MPS_"))
        .collect();
    let mut sorted = mps.clone();
    sorted.sort();
    ensure!(
        sorted
            == [
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M",
                "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"
            ],
        "the container's environment has {mps:?}"
    );

    // A client that asked for /elsewhere lands on the daemon anyway.
    let out = node.containerd.ctr().run(&overriding(&["mps-client"])).await?;
    succeeded("checker mps-client", &out)?;
    let client = MpsClient::parse(out.last_line())?;
    ensure!(
        client.connected && client.pipe_dir_used == CONTAINER_PIPE_DIR,
        "mps-client: {}",
        client
    );
    ensure!(
        client.threads.as_deref() == Some("25.0"),
        "server threads: {}",
        client
    );
    Ok(())
}

/// Without a GPU (no NVIDIA_VISIBLE_DEVICES, or `none`), a container through the shim is the
/// same as through plain runc, even with gpu-mps annotations.
async fn non_gpu_container_is_untouched(suite: Suite) -> Result<()> {
    let node = GpuNode::start(&suite, LimitsConfig::uniform()).await?;
    let rootfs = node.rootfs()?;
    for (what, gpu) in [
        ("no NVIDIA_VISIBLE_DEVICES", None),
        ("NVIDIA_VISIBLE_DEVICES=none", Some("none")),
    ] {
        let run = || {
            let run = CtrRun::checker("nogpu", &rootfs, &["report"]).gpu_limits("4Gi", 25);
            match gpu {
                Some(gpu) => run.gpu(gpu),
                None => run,
            }
        };
        let plain = report_of(&node, &run()).await?;
        let report = report_of(&node, &run().runc_binary(&node.bins.shim)).await?;
        ensure!(
            report.mps_env().is_empty(),
            "{what}: CUDA_MPS env through the shim: {:?}",
            report.mps_env()
        );
        ensure!(
            !report.mps_pipe_dir.exists,
            "{what}: /tmp/nvidia-mps exists: {:?}",
            report.mps_pipe_dir
        );
        ensure!(
            comparable(&report)? == comparable(&plain)?,
            "{what}: the shim changed the container:\n shim:  {}\n plain: {}",
            comparable(&report)?,
            comparable(&plain)?
        );
    }
    let status = node.manager.status().await?;
    ensure!(
        status.leases.is_empty() && status.daemons.is_empty(),
        "a non-GPU container got a lease: {status:?}"
    );
    Ok(())
}

/// A network namespace bound to a file on the host, unmounted (lazily) when dropped.
struct BoundNetns(std::path::PathBuf);

impl Drop for BoundNetns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// Every Kubernetes node with CNI pods has their network namespaces bound under /run/netns: an
/// nsfs mount whose root in mountinfo is `net:[<inode>]`, not a path. The hook reads the host's
/// mountinfo for its gate check; a line it cannot read refuses the container, so such a line
/// must read.
async fn a_network_namespace_bound_on_the_host_does_not_stop_a_gpu_container(suite: Suite) -> Result<()> {
    let node = GpuNode::start(&suite, LimitsConfig::uniform()).await?;
    let file = node.containerd.dir().join("netns-cni-test");
    std::fs::write(&file, "")?;
    let status = std::process::Command::new("unshare")
        .arg(format!("--net={}", file.display()))
        .arg("true")
        .status()
        .context("running unshare")?;
    ensure!(
        status.success(),
        "unshare --net={} failed: {status}",
        file.display()
    );
    let _bound = BoundNetns(file.clone());
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    ensure!(
        mountinfo
            .lines()
            .any(|l| l.contains(" nsfs ") && l.contains(&file.display().to_string())),
        "no nsfs mount of {} in the host's mountinfo",
        file.display()
    );
    let rootfs = node.rootfs()?;
    let run = gpu_run(&node, &rootfs, node.gpu_uuid(0), &["report"]);
    let report = report_of(&node, &run).await?;
    ensure!(
        report.mps_pipe_dir.control_exists,
        "the GPU container has no control socket: {:?}",
        report.mps_pipe_dir
    );
    Ok(())
}
