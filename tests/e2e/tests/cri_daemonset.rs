//! The DaemonSet image (packaging/container/Dockerfile, built by tests/image.sh with buildah from a
//! Debian root) run the way kubelet runs packaging/kubernetes/gpu-mps.yaml, through CRI on a
//! private containerd: the pod and container specs are read from the manifests themselves
//! (hostPID, privileged, the host's / at /host with its propagation, command, env).
//!
//! The "host" is this machine, as on a node: the init container chroots into /host and the
//! manager container runs chrooted there. Everything the containers write on the host goes to a
//! private tree, through the env an operator would set too: GPU_MPS_PREFIX (the binaries),
//! GPU_MPS_CONFIG (the node config, written by the test, so its root, hook and fake MPS daemon
//! are private), CONTAINERD_CONFIG (this test's containerd), CONTAINERD_DROP_IN, CONTAINERD_BINARY.
//! The real /usr/local/bin, /etc/gpu-mps and /run/gpu-mps are never touched, so this runs in
//! parallel with the other tests. CONTAINERD_RESTART_COMMAND asks this test to restart its
//! containerd and waits until it has, as `systemctl restart containerd` would. The manager gets
//! `args: [--fake-inventory, <file>]`: this machine has no GPU.
//!
//! Skipped (with a line saying so) when the image archive is missing, unless
//! GPU_MPS_E2E_REQUIRE_IMAGE=1 (tests/image.sh sets it). Run: `bash tests/image.sh`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use gpu_mps_api::inventory::Inventory;
use gpu_mps_api::node_config::NodeConfig;
use gpu_mps_e2e::checker::{CheckerLine, MpsClient};
use gpu_mps_e2e::containerd::GPU_MPS_HANDLER;
use gpu_mps_e2e::cri::Container;
use gpu_mps_e2e::image::TEST_IMAGE;
use gpu_mps_e2e::manager::{FAKE_GPU_MEMORY, fake_gpus, node_config_toml};
use gpu_mps_e2e::manifest::{ManifestContainer, PodTemplateSpec, load_workload};
use gpu_mps_e2e::workdir::WorkDir;
use gpu_mps_e2e::{
    Binaries, ContainerSpec, Containerd, ContainerdOptions, CriClient, LimitsConfig, PodSpec, Suite,
    per_suite, processes,
};
use k8s_cri::v1 as cri;

per_suite!(the_daemonset_installs_serves_a_gpu_container_and_uninstalls);

/// The env every container of the DaemonSet and the uninstall Job must agree on: where the
/// binaries are and which node config they use. Needs no image and no containerd.
#[test]
fn the_manifests_agree_on_the_host_paths() -> Result<()> {
    let daemonset = load_workload(&repository().join(DAEMONSET), "DaemonSet")?;
    let job = load_workload(&repository().join(UNINSTALL_JOB), "Job")?;
    let install = daemonset.spec.template.spec.container("install")?;
    let image = &install.image;
    let all = daemonset
        .spec
        .template
        .spec
        .init_containers
        .iter()
        .chain(&daemonset.spec.template.spec.containers)
        .chain(&job.spec.template.spec.containers);
    for container in all {
        ensure!(
            &container.image == image,
            "{}: image {} is not {image}",
            container.name,
            container.image
        );
        for name in ["GPU_MPS_PREFIX", "GPU_MPS_CONFIG"] {
            ensure!(
                container.env_value(name).is_some() && container.env_value(name) == install.env_value(name),
                "{}: {name} = {:?}, the init container has {:?}",
                container.name,
                container.env_value(name),
                install.env_value(name)
            );
        }
        // A chrooted binary of the host is named through the prefix kubelet expands.
        if container.command.first().map(String::as_str) == Some("chroot") {
            ensure!(
                container
                    .command
                    .get(2)
                    .is_some_and(|b| b.starts_with("$(GPU_MPS_PREFIX)/bin/")),
                "{}: {:?} does not run $(GPU_MPS_PREFIX)/bin/...",
                container.name,
                container.command
            );
        }
    }
    for name in [
        "HOST_ROOT",
        "CONTAINERD_CONFIG",
        "RESTART_CONTAINERD",
        "CONTAINERD_RESTART_COMMAND",
    ] {
        let uninstall = job.spec.template.spec.container("uninstall")?;
        ensure!(
            uninstall.env_value(name) == install.env_value(name),
            "uninstall: {name} = {:?}, the init container has {:?}",
            uninstall.env_value(name),
            install.env_value(name)
        );
    }
    Ok(())
}

/// The OCI archive tests/image.sh exports; GPU_MPS_E2E_IMAGE_ARCHIVE overrides it.
const ARCHIVE_ENV: &str = "GPU_MPS_E2E_IMAGE_ARCHIVE";
const DEFAULT_ARCHIVE: &str = "target/image/gpu-mps.oci.tar";
/// Set by tests/image.sh: a missing archive fails the test instead of skipping it.
const REQUIRE_ENV: &str = "GPU_MPS_E2E_REQUIRE_IMAGE";
const DAEMONSET: &str = "packaging/kubernetes/gpu-mps.yaml";
const UNINSTALL_JOB: &str = "packaging/kubernetes/uninstall/gpu-mps-uninstall.yaml";
/// The shipped binaries: the first column of packaging/binaries.txt, the one list.
fn shipped_binaries() -> Vec<String> {
    let list = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../packaging/binaries.txt"
    ))
    .expect("packaging/binaries.txt");
    list.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split_whitespace().next().map(String::from))
        .collect()
}
const WAIT: Duration = Duration::from_secs(60);

fn repository() -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    path.canonicalize().unwrap_or(path)
}

/// What the image is built from: an archive older than one of them is stale.
const IMAGE_INPUTS: [&str; 4] = [
    "packaging/container/Dockerfile",
    "packaging/kubernetes/install-on-host.sh",
    "packaging/config.toml",
    "target/dist/gpu-mps",
];

/// The image archive, or None (after saying why) when it is missing or older than what it is
/// built from, and not required.
fn image_archive() -> Result<Option<PathBuf>> {
    let path = std::env::var_os(ARCHIVE_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| repository().join(DEFAULT_ARCHIVE));
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let newer: Vec<&str> = match modified(&path) {
        Some(built) => IMAGE_INPUTS
            .into_iter()
            .filter(|input| modified(&repository().join(input)).is_some_and(|t| t > built))
            .collect(),
        None => Vec::new(),
    };
    if path.is_file() && newer.is_empty() {
        return Ok(Some(path));
    }
    let message = if newer.is_empty() {
        format!(
            "no DaemonSet image archive at {} ({ARCHIVE_ENV}): build it with `bash tests/image.sh`",
            path.display()
        )
    } else {
        format!(
            "the DaemonSet image archive {} is older than {}: rebuild it with `bash tests/image.sh`",
            path.display(),
            newer.join(", ")
        )
    };
    if std::env::var_os(REQUIRE_ENV).is_some_and(|v| v == "1") {
        bail!("{message} ({REQUIRE_ENV}=1)");
    }
    println!("skipped: {message}");
    Ok(None)
}

/// The host paths the containers are pointed at, all in one private directory.
struct HostTree {
    prefix: PathBuf,
    node_config: PathBuf,
    inventory: PathBuf,
    config: NodeConfig,
    drop_in: PathBuf,
    restart_requested: PathBuf,
    restart_done: PathBuf,
    /// Held until the test ends: removed with everything in it.
    _dir: WorkDir,
}

impl HostTree {
    fn new(bins: &Binaries, suite: &Suite) -> Result<HostTree> {
        let dir = WorkDir::new("gme2e-img.")?;
        let prefix = dir.join("usr-local");
        let node_config = dir.join("etc/gpu-mps/config.toml");
        let inventory = dir.join("inventory.json");
        // The hook runc runs is the one the init container installs.
        let installed = Binaries {
            hook: prefix.join("bin/gpu-mps-hook"),
            ..bins.clone()
        };
        let text = node_config_toml(&dir.join("r"), &installed, &suite.runc, &LimitsConfig::uniform());
        let config = NodeConfig::from_toml(&text, &node_config).context("the test node config is invalid")?;
        std::fs::create_dir_all(dir.join("etc/gpu-mps"))?;
        std::fs::write(&node_config, text)?;
        let fake = Inventory {
            source: format!("file:{}", inventory.display()),
            gpus: fake_gpus(2, FAKE_GPU_MEMORY),
        };
        std::fs::write(&inventory, serde_json::to_vec_pretty(&fake)?)?;
        Ok(HostTree {
            prefix,
            node_config,
            inventory,
            config,
            drop_in: dir.join("containerd-conf.d/gpu-mps.toml"),
            restart_requested: dir.join("restart-requested"),
            restart_done: dir.join("restart-done"),
            _dir: dir,
        })
    }

    fn path(p: &Path) -> String {
        p.display().to_string()
    }

    /// What CONTAINERD_RESTART_COMMAND runs on the "host": ask, then wait (60 s at most) until
    /// the test has restarted containerd.
    fn restart_command(&self) -> String {
        format!(
            "touch {asked} && i=0 && while [ ! -e {done} ]; do i=$((i+1)); [ $i -le 600 ] || exit 1; sleep 0.1; done && rm -f {done}",
            asked = self.restart_requested.display(),
            done = self.restart_done.display()
        )
    }

    /// The env of install-on-host.sh (init container, uninstall Job) pointed at this tree.
    fn point_installer(&self, container: &mut ManifestContainer, containerd: &Containerd) -> Result<()> {
        container.override_env(&[
            ("GPU_MPS_PREFIX", &Self::path(&self.prefix)),
            ("GPU_MPS_CONFIG", &Self::path(&self.node_config)),
            ("CONTAINERD_CONFIG", &Self::path(containerd.config_path())),
            ("RESTART_CONTAINERD", "true"),
            ("CONTAINERD_RESTART_COMMAND", &self.restart_command()),
        ])?;
        container.add_env(&[
            ("CONTAINERD_DROP_IN", &Self::path(&self.drop_in)),
            ("CONTAINERD_BINARY", &Self::path(&containerd.suite().containerd)),
        ])
    }

    fn installed(&self, binary: &str) -> PathBuf {
        self.prefix.join("bin").join(binary)
    }
}

/// Kills the (fake) MPS control daemons a manager left under the tree's root, when the test
/// fails before the manager container was stopped with SIGTERM. Declared before the containerd,
/// so it runs after the containerd (and the manager container) is gone.
struct LeftoverDaemons {
    config: NodeConfig,
}

impl Drop for LeftoverDaemons {
    fn drop(&mut self) {
        let binary = self.config.daemon.control_binary.as_os_str().as_encoded_bytes();
        let dirs = std::fs::read_dir(self.config.root.join("daemons"))
            .into_iter()
            .flatten()
            .flatten();
        for dir in dirs {
            let pid_file = dir.path().join("pipe/nvidia-cuda-mps-control.pid");
            let Some(pid) = std::fs::read_to_string(pid_file)
                .ok()
                .and_then(|t| t.trim().parse::<u32>().ok())
            else {
                continue;
            };
            if processes::runs(pid, binary) {
                let servers = processes::children_of(pid);
                processes::kill_hard(pid);
                servers.into_iter().for_each(processes::kill_hard);
            }
        }
    }
}

/// Waits for `container` to exit, as kubelet does, and meanwhile serves the restart requests of
/// CONTAINERD_RESTART_COMMAND: restarts containerd (its containers run on in their shims),
/// reconnects, and lets the command go on. Returns the exit code and the number of restarts.
async fn run_to_exit(
    containerd: &mut Containerd,
    cri: &mut CriClient,
    container: &Container,
    tree: &HostTree,
) -> Result<(i32, usize)> {
    let deadline = Instant::now() + WAIT;
    let mut restarts = 0;
    loop {
        if tree.restart_requested.exists() {
            std::fs::remove_file(&tree.restart_requested)?;
            let before = containerd.pid();
            containerd.restart().await?;
            *cri = containerd.cri().await?;
            restarts += 1;
            println!(
                "restarted containerd for {}: pid {before:?} -> {:?}",
                container.name,
                containerd.pid()
            );
            std::fs::write(&tree.restart_done, b"")?;
        }
        let status = cri.container_status(container).await?;
        if status.state == cri::ContainerState::ContainerExited as i32 {
            return Ok((status.exit_code, restarts));
        }
        if Instant::now() > deadline {
            bail!(
                "container {} did not exit within {WAIT:?}; its log:\n{}",
                container.name,
                container_log(container)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn container_log(container: &Container) -> String {
    match gpu_mps_e2e::cri::read_log(&container.log_path) {
        Ok(lines) => lines.into_iter().map(|l| l.text + "\n").collect(),
        Err(e) => format!("(no log: {e:#})"),
    }
}

/// The RuntimeClass's pod is refused while containerd has no gpu-mps handler.
async fn expect_no_gpu_mps_handler(cri: &mut CriClient, name: &str) -> Result<()> {
    match cri
        .run_pod_sandbox(&PodSpec::new(name, "default", GPU_MPS_HANDLER))
        .await
    {
        Ok(pod) => bail!(
            "a pod of handler gpu-mps started ({}): the handler is registered",
            pod.id
        ),
        Err(status) => {
            println!("no gpu-mps handler, as expected: {}", status.message());
            ensure!(
                status.message().contains(GPU_MPS_HANDLER),
                "RunPodSandbox failed for another reason: {status}"
            );
            Ok(())
        }
    }
}

/// Starts the uninstall Job in a pod of its own; [`uninstall_refused`] waits for its end.
async fn start_uninstall(
    cri: &mut CriClient,
    (pod_spec, spec): (&PodSpec, &ContainerSpec),
) -> Result<(gpu_mps_e2e::cri::Pod, Container)> {
    let pod = cri.run_pod_sandbox(pod_spec).await?;
    let job = cri.create_container(&pod, spec).await?;
    cri.start_container(&job).await?;
    Ok((pod, job))
}

/// Waits for the uninstall Job started by [`start_uninstall`] and checks that it refused, with
/// `why` in its log, restarting nothing and removing no binary. Returns its log.
async fn uninstall_refused(
    containerd: &mut Containerd,
    cri: &mut CriClient,
    (pod, job): (gpu_mps_e2e::cri::Pod, Container),
    tree: &HostTree,
    why: &str,
) -> Result<String> {
    let (code, restarts) = run_to_exit(containerd, cri, &job, tree).await?;
    let log = container_log(&job);
    ensure!(
        code != 0 && restarts == 0 && log.contains(why),
        "the uninstall did not refuse with {why:?}: exit {code}, {restarts} restarts:\n{log}"
    );
    cri.delete_pod(&pod).await?;
    for binary in &shipped_binaries() {
        ensure!(
            tree.installed(binary).is_file(),
            "the refused uninstall removed {binary}"
        );
    }
    Ok(log)
}

/// Runs `container` of `template` in `pod` to its exit; it must exit 0 after `restarts`
/// containerd restarts (one when it changed containerd's config). Returns its log.
async fn run_installer(
    containerd: &mut Containerd,
    cri: &mut CriClient,
    pod: &gpu_mps_e2e::cri::Pod,
    (template, container): (&PodTemplateSpec, &ManifestContainer),
    tree: &HostTree,
    expected_restarts: usize,
) -> Result<String> {
    let spec = template.container_spec(container)?;
    let created = cri.create_container(pod, &spec).await?;
    cri.start_container(&created).await?;
    let (code, restarts) = run_to_exit(containerd, cri, &created, tree).await?;
    let log = container_log(&created);
    println!("--- {} (exit {code}):\n{log}---", container.name);
    ensure!(code == 0, "{} exited {code}:\n{log}", container.name);
    ensure!(
        restarts == expected_restarts,
        "{} restarted containerd {restarts} times, expected {expected_restarts}:\n{log}",
        container.name
    );
    ensure!(
        (restarts == 0) == log.contains("containerd config unchanged"),
        "{} restarted containerd {restarts} times, and says:\n{log}",
        container.name
    );
    Ok(log)
}

/// The installed CLI's `status --json`, run on the host.
async fn status_json(tree: &HostTree) -> Result<serde_json::Value> {
    let out = tokio::process::Command::new(tree.installed("gpu-mps"))
        .arg("--config")
        .arg(&tree.node_config)
        .args(["status", "--json"])
        .kill_on_drop(true)
        .output()
        .await?;
    ensure!(
        out.status.success(),
        "gpu-mps status failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

async fn the_daemonset_installs_serves_a_gpu_container_and_uninstalls(suite: Suite) -> Result<()> {
    let Some(archive) = image_archive()? else {
        return Ok(());
    };
    let bins = Binaries::locate()?;
    let daemonset = load_workload(&repository().join(DAEMONSET), "DaemonSet")?;
    let template = &daemonset.spec.template.spec;
    let tree = HostTree::new(&bins, &suite)?;
    let _leftovers = LeftoverDaemons {
        config: tree.config.clone(),
    };
    let mut containerd = Containerd::start(
        &suite,
        ContainerdOptions {
            gpu_mps_config: Some(tree.node_config.clone()),
            shared_root_namespace: true,
            ..ContainerdOptions::default()
        },
    )
    .await?;
    let config_before = std::fs::read(containerd.config_path())?;
    let mut cri = containerd.cri().await?;
    containerd.import_test_image(&bins.checker).await?;
    let started = Instant::now();
    containerd.import_image_archive(&archive).await?;
    let image = template.container("install")?.image.clone();
    ensure!(
        cri.image_present(&image).await?,
        "{} imported, but containerd has no image {image} (the name in {DAEMONSET}): tests/image.sh tags it so",
        archive.display()
    );
    println!("imported {image} in {:.1?}", started.elapsed());
    expect_no_gpu_mps_handler(&mut cri, "before-install").await?;

    // The DaemonSet's pod on this node; no runtime class: containerd's default (runc).
    let pod = cri
        .run_pod_sandbox(&template.pod_spec(&daemonset.metadata.name, &daemonset.metadata.namespace, ""))
        .await?;

    // The init container: installs, registers, restarts containerd.
    let mut install = template.container("install")?.clone();
    ensure!(
        install.command == ["/opt/gpu-mps/install-on-host.sh", "install"],
        "the init container's command changed: {:?}",
        install.command
    );
    tree.point_installer(&mut install, &containerd)?;
    let containerd_pid = containerd.pid();
    let log = run_installer(&mut containerd, &mut cri, &pod, (template, &install), &tree, 1).await?;
    ensure!(containerd.pid() != containerd_pid, "containerd was not restarted");
    for binary in &shipped_binaries() {
        ensure!(
            tree.installed(binary).is_file(),
            "{} is not installed:\n{log}",
            tree.installed(binary).display()
        );
    }
    ensure!(
        log.contains(&format!("kept {}", tree.node_config.display())),
        "the init container did not keep the node's config:\n{log}"
    );
    let registered = [containerd.config_path(), tree.drop_in.as_path()]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .collect::<String>();
    let shim = tree.installed("gpu-mps-shim").display().to_string();
    ensure!(
        registered.contains(&format!("BinaryName = \"{shim}\"")),
        "containerd's config does not name {shim}:\n{registered}"
    );

    // The init container again, as in a recreated pod: nothing changes, no restart.
    let again = cri
        .run_pod_sandbox(&template.pod_spec(&daemonset.metadata.name, &daemonset.metadata.namespace, ""))
        .await?;
    run_installer(&mut containerd, &mut cri, &again, (template, &install), &tree, 0).await?;
    cri.delete_pod(&again).await?;

    // The manager container: the host's copy, chrooted into the host, on fake GPUs.
    let mut manager = template.container("manager")?.clone();
    manager.override_env(&[
        ("GPU_MPS_PREFIX", &HostTree::path(&tree.prefix)),
        ("GPU_MPS_CONFIG", &HostTree::path(&tree.node_config)),
    ])?;
    ensure!(
        manager.args.is_empty(),
        "the manager has args now: {:?}",
        manager.args
    );
    manager.args = vec!["--fake-inventory".into(), HostTree::path(&tree.inventory)];
    let manager_spec = template.container_spec(&manager)?;
    ensure!(
        manager_spec.command
            == [
                "chroot",
                "/host",
                &tree.installed("gpu-mps-manager").display().to_string()
            ],
        "the manager's command: {:?}",
        manager_spec.command
    );
    let host_root = cri::Mount {
        container_path: "/host".into(),
        host_path: "/".into(),
        propagation: cri::MountPropagation::PropagationHostToContainer as i32,
        ..Default::default()
    };
    ensure!(
        manager_spec.mounts == [host_root] && manager_spec.privileged && template.host_pid,
        "the manager container must be privileged, hostPID, with the host's / at /host (HostToContainer): {manager_spec:?}"
    );
    let manager_container = cri.create_container(&pod, &manager_spec).await?;
    cri.start_container(&manager_container).await?;
    let probe = manager
        .readiness_probe
        .as_ref()
        .and_then(|p| p.exec.as_ref())
        .context("the manager has no exec readiness probe")?
        .command
        .clone();
    let probe: Vec<&str> = probe.iter().map(String::as_str).collect();
    let deadline = Instant::now() + WAIT;
    loop {
        let out = cri
            .exec_sync(&manager_container, &probe, Duration::from_secs(5))
            .await?;
        if out.exit_code == 0 {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "the manager's readiness probe {probe:?} still fails: {}{}\nmanager log:\n{}",
                out.stdout,
                out.stderr,
                container_log(&manager_container)
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let status = status_json(&tree).await?;
    ensure!(
        status["gpus"].as_array().map(Vec::len) == Some(2),
        "the manager does not serve the two fake GPUs: {status}"
    );
    println!("the manager container is ready");

    // The uninstall Job waits for the manager to stop, and refuses while it still answers.
    let job = load_workload(&repository().join(UNINSTALL_JOB), "Job")?;
    let job_template = &job.spec.template.spec;
    let mut uninstall = job_template.container("uninstall")?.clone();
    tree.point_installer(&mut uninstall, &containerd)?;
    uninstall.override_env(&[("PURGE_NODE_CONFIG", "false")])?;
    let job_pod_spec = job_template.pod_spec(&job.metadata.name, &job.metadata.namespace, "");
    let mut impatient = uninstall.clone();
    impatient.override_env(&[("MANAGER_WAIT_SECONDS", "2")])?;
    let started = start_uninstall(
        &mut cri,
        (&job_pod_spec, &job_template.container_spec(&impatient)?),
    )
    .await?;
    let log = uninstall_refused(&mut containerd, &mut cri, started, &tree, "still answers").await?;
    ensure!(
        log.contains("waiting up to 2 s for it to stop"),
        "the uninstall did not wait for the manager:\n{log}"
    );

    // A GPU container through the registered handler and the manager container.
    let gpu = fake_gpus(1, FAKE_GPU_MEMORY)[0].uuid.clone();
    let gpu_pod = cri
        .run_pod_sandbox(&PodSpec::new("infer", "default", GPU_MPS_HANDLER).gpu_limits("4Gi", 25))
        .await?;
    let client = cri
        .create_container(
            &gpu_pod,
            &ContainerSpec::new("infer", TEST_IMAGE)
                .command(&["/checker"])
                .args(&["mps-client", "--hold-seconds=300"])
                .gpu(&gpu),
        )
        .await?;
    cri.start_container(&client).await?;
    let line = cri.first_stdout_line(&client, WAIT).await?;
    let admitted = MpsClient::parse(&line)?;
    ensure!(
        admitted.admitted,
        "the GPU container did not reach its MPS daemon: {admitted}"
    );
    let status = status_json(&tree).await?;
    let leases = status["leases"].as_array().cloned().unwrap_or_default();
    ensure!(
        leases.iter().any(|l| l["container_id"] == client.id.as_str()),
        "the manager container holds no lease for {}: {status}",
        client.id
    );
    println!("a GPU container ran through handler gpu-mps: {admitted}");
    let daemon_pid = status["daemons"][0]["control_pid"].as_u64().unwrap_or(0) as u32;

    // The uninstall Job as the README runs it: created while the node's manager still answers, it
    // waits for it to stop.
    let job_spec = job_template.container_spec(&uninstall)?;
    let waiting = start_uninstall(&mut cri, (&job_pod_spec, &job_spec)).await?;
    let deadline = Instant::now() + WAIT;
    while !container_log(&waiting.1).contains("waiting up to 120 s") {
        ensure!(
            Instant::now() < deadline,
            "the uninstall Job does not wait for the manager:\n{}",
            container_log(&waiting.1)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The node's label is taken off before the node was drained: kubelet stops the DaemonSet's
    // pod, SIGTERM to the manager, which keeps the daemon the GPU container's lease uses.
    cri.stop_container(&manager_container).await?;
    let stopped = cri.container_status(&manager_container).await?;
    ensure!(
        stopped.exit_code == 0,
        "the manager exited {} on SIGTERM:\n{}",
        stopped.exit_code,
        container_log(&manager_container)
    );
    cri.delete_pod(&pod).await?;

    // The waiting Job goes on once the manager stopped, and refuses: a gpu-mps container still
    // runs with its lease, and removing the shim under it would leave it stuck.
    let log = uninstall_refused(&mut containerd, &mut cri, waiting, &tree, "still run with leases").await?;
    ensure!(
        log.contains("waiting up to 120 s") && log.contains("the manager stopped after"),
        "the uninstall did not wait for the manager to stop:\n{log}"
    );
    // Drained now: the GPU pod goes (its poststop hook finds no manager), and the daemon the
    // stopped manager left is ended by hand, as an operator would.
    cri.delete_pod(&gpu_pod).await?;
    if daemon_pid != 0 {
        let servers = processes::children_of(daemon_pid);
        processes::kill_hard(daemon_pid);
        servers.into_iter().for_each(processes::kill_hard);
    }

    // The uninstall Job, created again (a new pod): the config as before, byte for byte; the
    // binaries and the state root gone.
    let job_pod = cri
        .run_pod_sandbox(&job_template.pod_spec(&job.metadata.name, &job.metadata.namespace, ""))
        .await?;
    let log = run_installer(
        &mut containerd,
        &mut cri,
        &job_pod,
        (job_template, &uninstall),
        &tree,
        1,
    )
    .await?;
    ensure!(!log.contains("still answers"), "the uninstall refused:\n{log}");
    cri.delete_pod(&job_pod).await?;
    let config_after = std::fs::read(containerd.config_path())?;
    ensure!(
        config_after == config_before,
        "containerd's config differs from before the install:\n--- before\n{}\n--- after\n{}",
        String::from_utf8_lossy(&config_before),
        String::from_utf8_lossy(&config_after)
    );
    ensure!(!tree.drop_in.exists(), "{} is left", tree.drop_in.display());
    for binary in &shipped_binaries() {
        ensure!(!tree.installed(binary).exists(), "{binary} is left:\n{log}");
    }
    ensure!(
        !tree.config.root.exists(),
        "the state root {} is left",
        tree.config.root.display()
    );
    ensure!(
        tree.node_config.is_file(),
        "the node config was removed without PURGE_NODE_CONFIG"
    );
    expect_no_gpu_mps_handler(&mut cri, "after-uninstall").await?;

    // Once more with PURGE_NODE_CONFIG: nothing left to change in containerd, the node config goes.
    uninstall.override_env(&[("PURGE_NODE_CONFIG", "true")])?;
    let job_pod = cri
        .run_pod_sandbox(&job_template.pod_spec(&job.metadata.name, &job.metadata.namespace, ""))
        .await?;
    run_installer(
        &mut containerd,
        &mut cri,
        &job_pod,
        (job_template, &uninstall),
        &tree,
        0,
    )
    .await?;
    cri.delete_pod(&job_pod).await?;
    ensure!(
        !tree.node_config.exists() && std::fs::read(containerd.config_path())? == config_before,
        "after the purge: node config {} exists: {}; containerd's config changed",
        tree.node_config.display(),
        tree.node_config.exists()
    );
    Ok(())
}
