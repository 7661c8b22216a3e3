//! The harness itself, with plain runc and no gpu-mps: ctr and CRI run the checker in the
//! test image on every containerd suite.
//!
//! Needs only the static checker:
//! `RUSTFLAGS='-C target-feature=+crt-static' cargo build -p gpu-mps-checker --target x86_64-unknown-linux-gnu`
//! then `cargo test -p gpu-mps-e2e --test smoke -- --nocapture`.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use gpu_mps_e2e::checker::{CheckerLine, Report, host_namespace};
use gpu_mps_e2e::containerd::RUNC_HANDLER;
use gpu_mps_e2e::image::{NVIDIA_SMI_CONTENT, NVIDIA_SMI_PATH};
use gpu_mps_e2e::{
    ContainerSpec, Containerd, ContainerdOptions, CtrRun, PodSpec, Suite, binaries, cri, per_suite, processes,
};

per_suite!(ctr_run_report, cri_run_report, drop_cleans_up);

/// What any container of the test image sees through plain runc: the image's files, no MPS,
/// its own /dev/shm and IPC namespace.
fn plain_runc_baseline(path: &str, report: &Report) -> Result<()> {
    println!("{path}: checker report: {}", report);
    ensure!(
        report.mps_env().is_empty(),
        "{path}: CUDA_MPS env without gpu-mps: {:?}",
        report.mps_env()
    );
    ensure!(
        !report.mps_pipe_dir.exists,
        "{path}: /tmp/nvidia-mps exists without gpu-mps"
    );
    let smi = report
        .nvidia_smi
        .get(NVIDIA_SMI_PATH)
        .context("no nvidia-smi entry in the report")?;
    ensure!(
        !smi.masked && smi.head.as_deref() == Some(NVIDIA_SMI_CONTENT),
        "{path}: the image's {NVIDIA_SMI_PATH} is not as built: {smi:?}"
    );
    let shm = &report.dev_shm;
    ensure!(
        shm.marker_created && !Path::new(&shm.marker).exists(),
        "{path}: /dev/shm is not private: {shm:?}"
    );
    let ipc = report.namespaces.get("ipc").cloned().flatten();
    ensure!(
        ipc.is_some() && ipc != host_namespace("ipc"),
        "{path}: the host's IPC namespace: {ipc:?}"
    );
    Ok(())
}

/// `ctr run --rm --rootfs <dir> <id> /checker report` through plain runc.
async fn ctr_run_report(suite: Suite) -> Result<()> {
    let checker = binaries::checker()?;
    let containerd = Containerd::start(&suite, ContainerdOptions::default()).await?;
    let rootfs = containerd.test_rootfs(&checker)?;
    let out = containerd
        .ctr()
        .run(&CtrRun::checker("smoke", &rootfs, &["report"]))
        .await?;
    ensure!(
        out.status.success(),
        "ctr run failed ({}): {}{}",
        out.status,
        out.stdout,
        out.stderr
    );
    let report = Report::parse(out.last_line())?;
    plain_runc_baseline("ctr run", &report)
}

/// A pod through the CRI runtime handler `runc`, as kubelet runs one: RunPodSandbox,
/// CreateContainer `/checker report`, StartContainer, its log, then removal.
async fn cri_run_report(suite: Suite) -> Result<()> {
    let checker = binaries::checker()?;
    let containerd = Containerd::start(&suite, ContainerdOptions::default()).await?;
    let mut cri = containerd.cri().await?;
    let version = cri.version().await?;
    println!(
        "CRI: {} {} (API {})",
        version.runtime_name, version.runtime_version, version.runtime_api_version
    );
    let image = containerd.import_test_image(&checker).await?;
    ensure!(
        cri.image_present(image).await?,
        "the CRI plugin does not see the imported image {image}"
    );

    let pod = cri
        .run_pod_sandbox(&PodSpec::new("smoke", "default", RUNC_HANDLER))
        .await?;
    let spec = ContainerSpec::new("report", image)
        .command(&["/checker"])
        .args(&["report"]);
    let container = cri.create_container(&pod, &spec).await?;
    cri.start_container(&container).await?;
    let exit_code = cri.wait_exit(&container, Duration::from_secs(30)).await?;
    let lines = cri::stdout_lines(&container.log_path)?;
    ensure!(
        exit_code == 0,
        "checker report exited {exit_code}; its log: {lines:?}"
    );
    let report = Report::parse(lines.last().map(String::as_str).unwrap_or(""))?;
    plain_runc_baseline("CRI", &report)?;
    let net = report.namespaces.get("net").cloned().flatten();
    ensure!(
        net.is_some() && net == host_namespace("net"),
        "the pod is not on the host network: {net:?}"
    );

    cri.stop_container(&container).await?;
    cri.remove_container(&container).await?;
    let gone = cri.container_status(&container).await;
    ensure!(
        gone.is_err(),
        "container {} still has a status after RemoveContainer: {gone:?}",
        container.id
    );
    cri.delete_pod(&pod).await?;
    Ok(())
}

/// Dropping a containerd with a pod still running leaves no process, mount or directory.
async fn drop_cleans_up(suite: Suite) -> Result<()> {
    let checker = binaries::checker()?;
    let containerd = Containerd::start(&suite, ContainerdOptions::default()).await?;
    let mut cri = containerd.cri().await?;
    let image = containerd.import_test_image(&checker).await?;
    let pod = cri
        .run_pod_sandbox(&PodSpec::new("left-running", "default", RUNC_HANDLER))
        .await?;
    // The image's default command: /checker pause.
    let container = cri
        .create_container(&pod, &ContainerSpec::new("pause", image))
        .await?;
    cri.start_container(&container).await?;
    cri.wait_running(&container, Duration::from_secs(10)).await?;
    let containers = containerd.container_pids();
    let shims = containerd.shim_pids();
    let shim_sockets = containerd.shim_sockets();
    ensure!(
        containers.len() == 2,
        "expected the sandbox and one container, runc knows {containers:?}"
    );
    ensure!(
        !shims.is_empty(),
        "no containerd-shim found for {}",
        containerd.socket().display()
    );
    let dir = containerd.dir().to_path_buf();

    drop(cri);
    let started = std::time::Instant::now();
    drop(containerd);
    println!(
        "dropped containerd with a running pod in {:.1?}",
        started.elapsed()
    );
    let left: Vec<u32> = containers
        .iter()
        .chain(&shims)
        .copied()
        .filter(|p| processes::alive(*p))
        .collect();
    ensure!(left.is_empty(), "still running after drop: {left:?}");
    let sockets: Vec<_> = shim_sockets.iter().filter(|s| s.exists()).collect();
    ensure!(sockets.is_empty(), "shim sockets left after drop: {sockets:?}");
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    let mounts: Vec<&str> = mountinfo
        .lines()
        .filter(|l| l.contains(&*dir.to_string_lossy()))
        .collect();
    ensure!(mounts.is_empty(), "still mounted after drop: {mounts:#?}");
    if std::env::var_os(gpu_mps_e2e::workdir::KEEP_ENV).is_none() {
        ensure!(!dir.exists(), "{} is still there after drop", dir.display());
    }
    Ok(())
}
