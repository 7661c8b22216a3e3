//! gpu-mps-device-plugin driven by a test kubelet over kubelet's real device plugin API, and the
//! containers it allocates run through real containerd (1.6, 1.7, 2.x) and runc with the
//! `gpu-mps` handler: registration, ListAndWatch, GetPreferredAllocation and Allocate with
//! kubelet's rules, then CRI CreateContainer built from Allocate's answer as kubelet builds it.
//! The checker inside each container shows the limits the units set; the manager's leases and
//! capacity view count the same units.
//!
//! No GPU: two fake 16 GiB GPUs (15 units of 1 GiB each after the 1 GiB server reserve), fake
//! device nodes 195:<minor> made with mknod in the test's own directory.
//!
//! Run: `cargo test -p gpu-mps-e2e --test cri_device_plugin -- --nocapture`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use gpu_mps_api::annotations::{ALLOCATED_UNITS, MEMORY_LIMIT};
use gpu_mps_api::memory_units::RESOURCE_NAME;
use gpu_mps_e2e::checker::{CheckerLine, Report};
use gpu_mps_e2e::containerd::{CRI_NAMESPACE, GPU_MPS_HANDLER};
use gpu_mps_e2e::cri::{Container, Pod};
use gpu_mps_e2e::device_nodes::{NVIDIA_MAJOR, make_gpu_node};
use gpu_mps_e2e::image::TEST_IMAGE;
use gpu_mps_e2e::kubelet::{
    Allocated, DeviceManager, PluginLink, PluginProcess, TestKubelet, allocate_ids, allocate_on,
    apply_allocation, plugin_client,
};
use gpu_mps_e2e::manager::{FAKE_GPU_MEMORY, fake_gpus};
use gpu_mps_e2e::{
    CdiOptions, ContainerSpec, CriClient, GpuNode, LimitsConfig, PodSpec, StatusLookup, Suite, cdi, per_suite,
};

per_suite!(
    units_place_pods_by_size_and_set_their_limits,
    a_spread_an_unknown_unit_and_a_held_unit_are_refused,
    kubelet_and_plugin_restarts_lose_nothing,
    health_follows_the_manager,
    many_allocations_at_once_are_all_admitted,
    a_gpu_with_a_cdi_spec_goes_as_a_cdi_device,
    the_client_limit_is_kept_by_a_minimum_of_units,
    one_and_eight_gpus_pack_best_fit_and_refuse_a_spread,
);

const WAIT: Duration = Duration::from_secs(20);
const HOLD: &str = "--hold-seconds=300";
/// Units per fake GPU: 16 GiB less the 1 GiB reserve, in 1 GiB units.
const UNITS_PER_GPU: usize = 15;
const GIB: u64 = 1 << 30;

/// A node that schedules by units: policy exact, `[device_plugin] enabled = true`.
fn limits() -> LimitsConfig {
    LimitsConfig::exact()
        .toml("\n[device_plugin]\nenabled = true\nmemory_unit = \"1Gi\"\nserver_reserve = \"1Gi\"\n")
}

/// Everything one test plays: the node, kubelet's directory with fake device nodes, the test
/// kubelet, the plugin process, and kubelet's view of the plugin.
/// Fields drop in order: the plugin (its log is read on drop) before kubelet's directory.
struct Cluster {
    plugin: PluginProcess,
    link: PluginLink,
    kubelet: TestKubelet,
    node: GpuNode,
    devices: DeviceManager,
    cdi_dirs: Vec<PathBuf>,
    dir: tempfile::TempDir,
}

impl Cluster {
    async fn start(suite: &Suite) -> Result<Cluster> {
        Cluster::start_with(suite, CdiOptions::default(), false).await
    }

    /// `plugin_reads_cdi`: the plugin looks for CDI specs in containerd's CDI dir.
    async fn start_with(suite: &Suite, cdi: CdiOptions, plugin_reads_cdi: bool) -> Result<Cluster> {
        Cluster::start_configured(suite, limits(), 2, cdi, plugin_reads_cdi).await
    }

    async fn start_configured(
        suite: &Suite,
        limits: LimitsConfig,
        gpu_count: u32,
        cdi: CdiOptions,
        plugin_reads_cdi: bool,
    ) -> Result<Cluster> {
        let dir = tempfile::Builder::new().prefix("gme2e-kubelet.").tempdir()?;
        let gpus = fake_gpus(gpu_count, FAKE_GPU_MEMORY);
        for gpu in &gpus {
            fake_node(&dev_dir(dir.path()), gpu.minor)?;
        }
        let node = GpuNode::start_with(suite, limits, gpus, cdi).await?;
        let mut kubelet = TestKubelet::start(dir.path())?;
        let cdi_dirs = if plugin_reads_cdi {
            vec![node.containerd.cdi_dir()]
        } else {
            Vec::new()
        };
        let plugin = PluginProcess::start(
            &node.bins,
            node.manager.config_path(),
            dir.path(),
            &dev_dir(dir.path()),
            &cdi_dirs,
        )?;
        let link = register(&mut kubelet, gpu_count as usize).await?;
        Ok(Cluster {
            node,
            dir,
            kubelet,
            plugin,
            link,
            devices: DeviceManager::default(),
            cdi_dirs,
        })
    }

    async fn allocate(&mut self, container: &str, size: usize) -> Result<Allocated> {
        self.devices.allocate(&mut self.link, container, size).await
    }
}

/// Takes the plugin's registration, checks it, and follows its ListAndWatch until every unit
/// of both GPUs is listed healthy.
async fn register(kubelet: &mut TestKubelet, gpu_count: usize) -> Result<PluginLink> {
    let registration = kubelet.registration().await?;
    ensure!(
        registration.resource_name == RESOURCE_NAME && registration.version == "v1beta1",
        "registration: {registration:?}"
    );
    ensure!(
        registration
            .options
            .as_ref()
            .is_some_and(|o| o.get_preferred_allocation_available && !o.pre_start_required),
        "registration options: {registration:?}"
    );
    let mut link = kubelet.plugin(&registration).await?;
    link.watch_until("every unit healthy", WAIT, |d| {
        d.len() == gpu_count * UNITS_PER_GPU && d.values().all(|h| h == "Healthy")
    })
    .await?;
    ensure!(
        link.devices.keys().all(|id| id.len() <= 63),
        "a device ID is longer than 63 characters: {:?}",
        link.devices.keys().max_by_key(|id| id.len())
    );
    Ok(link)
}

fn dev_dir(kubelet_dir: &Path) -> PathBuf {
    kubelet_dir.join("dev")
}

/// `/dev/nvidia<minor>` as a character device 195:<minor>, in the test's own directory.
fn fake_node(dev: &Path, minor: u32) -> Result<PathBuf> {
    std::fs::create_dir_all(dev)?;
    let path = dev.join(format!("nvidia{minor}"));
    make_gpu_node(&path, minor)?;
    Ok(path)
}

fn pod_spec(name: &str) -> PodSpec {
    PodSpec::new(name, "default", GPU_MPS_HANDLER)
}

fn report_container(name: &str) -> ContainerSpec {
    ContainerSpec::new(name, TEST_IMAGE)
        .command(&["/checker"])
        .args(&["report", HOLD])
}

/// A pod with one container given `allocated`, created and started as kubelet does.
async fn run_allocated(
    cri: &mut CriClient,
    pod_spec: PodSpec,
    allocated: &Allocated,
) -> Result<(Pod, Result<Container, tonic::Status>)> {
    let pod = cri.run_pod_sandbox(&pod_spec).await?;
    let spec = apply_allocation(report_container(&pod_spec.name), &allocated.response);
    let container = match cri.create_container(&pod, &spec).await {
        Ok(container) => match cri.start_container(&container).await {
            Ok(()) => Ok(container),
            Err(status) => {
                let _ = cri.delete_container(&container).await;
                Err(status)
            }
        },
        Err(status) => Err(status),
    };
    Ok((pod, container))
}

/// The GPU and unit numbers of device IDs `<uuid>-m<n>`.
fn units_of(ids: &[String]) -> (String, Vec<u32>) {
    let mut gpu = String::new();
    let mut units: Vec<u32> = ids
        .iter()
        .filter_map(|id| {
            let (uuid, n) = id.rsplit_once("-m")?;
            gpu = uuid.to_string();
            n.parse().ok()
        })
        .collect();
    units.sort_unstable();
    (gpu, units)
}

/// The checker shows the container's memory limit and thread cap as the units set them, and
/// the manager's lease carries the same units on the same GPU.
async fn holds_its_units(
    cluster: &Cluster,
    cri: &mut CriClient,
    container: &Container,
    allocated: &Allocated,
) -> Result<()> {
    let report = Report::parse(&cri.first_stdout_line(container, WAIT).await?)?;
    let size = allocated.ids.len() as u64;
    let memory = report.env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT").unwrap_or("");
    ensure!(
        memory == format!("0={}M", size * 1024),
        "{}: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={memory:?} for {size} units",
        container.name
    );
    // The default cap: twice the memory share, rounded up.
    let share = (size as f64 / UNITS_PER_GPU as f64 * 2.0 * 100.0)
        .ceil()
        .min(100.0) as u64;
    let threads = report.env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE").unwrap_or("");
    ensure!(
        threads == share.to_string(),
        "{}: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={threads:?}, expected {share} (2 x {size}/{UNITS_PER_GPU})",
        container.name
    );
    let status = cluster.node.manager.status().await?;
    let lease = status
        .lease(&container.id)
        .with_context(|| format!("no lease of {}: {status:#?}", container.name))?;
    let (gpu, units) = units_of(&allocated.ids);
    ensure!(
        lease.gpu_uuids == [gpu.clone()]
            && lease.memory_units == units
            && lease.memory_limit_bytes == size * GIB,
        "{}: lease {lease:?}, expected GPU {gpu} units {units:?}",
        container.name
    );
    Ok(())
}

/// The manager's capacity view counts exactly the units handed out on each GPU.
async fn manager_counts(cluster: &Cluster, expected: &BTreeMap<String, u64>) -> Result<()> {
    let status = cluster.node.manager.status().await?;
    for gpu in &status.gpus {
        let want = expected.get(&gpu.uuid).copied().unwrap_or(0) * GIB;
        ensure!(
            gpu.memory_reserved_bytes == want,
            "GPU {}: the manager counts {} bytes, the plugin handed out {want}",
            gpu.uuid,
            gpu.memory_reserved_bytes
        );
    }
    Ok(())
}

/// Seven pods of three sizes (2, 2, 2, 4, 4, 6, 6 units) placed by units, each held to its
/// allocation: best fit puts the first five on GPU 0 and the 6-unit pods on GPU 1. A pod that
/// asks 12Gi by annotation gets its 2 units; a pod that writes the plugin's annotation itself
/// and has a GPU without units is refused (the forged pod annotation never reaches the spec).
async fn units_place_pods_by_size_and_set_their_limits(suite: Suite) -> Result<()> {
    let mut cluster = Cluster::start(&suite).await?;
    let mut cri = cluster.node.cri().await?;
    let (gpu0, gpu1) = (
        cluster.node.gpu_uuid(0).to_string(),
        cluster.node.gpu_uuid(1).to_string(),
    );
    let sizes = [2usize, 2, 2, 4, 4, 6, 6];
    let expected_gpu = [&gpu0, &gpu0, &gpu0, &gpu0, &gpu0, &gpu1, &gpu1];
    let mut running = Vec::new();
    let mut counted: BTreeMap<String, u64> = BTreeMap::new();
    for (i, size) in sizes.iter().enumerate() {
        let name = format!("sized-{i}-{size}u");
        let allocated = cluster.allocate(&name, *size).await?;
        let (gpu, _) = units_of(&allocated.ids);
        ensure!(
            &gpu == expected_gpu[i] && allocated.preferred == allocated.ids,
            "{name}: kubelet gave {:?} (plugin preferred {:?}), expected all on {}",
            allocated.ids,
            allocated.preferred,
            expected_gpu[i]
        );
        let mut spec = pod_spec(&name);
        if i == 0 {
            spec = spec.annotation(MEMORY_LIMIT, "12Gi");
        }
        let (pod, container) = run_allocated(&mut cri, spec, &allocated).await?;
        let container = container.map_err(|s| anyhow::anyhow!("{name}: {}", s.message()))?;
        holds_its_units(&cluster, &mut cri, &container, &allocated).await?;
        *counted.entry(gpu.clone()).or_default() += *size as u64;
        println!("{}: {name}: {size} units on {gpu}", suite.containerd_version);
        running.push((pod, container, name));
    }
    manager_counts(&cluster, &counted).await?;

    // A GPU handed over without units, and the plugin's annotation forged on the pod.
    let forged_units: Vec<String> = (0..UNITS_PER_GPU).map(|n| format!("{gpu1}-m{n}")).collect();
    let forger = pod_spec("forger").annotation(ALLOCATED_UNITS, &forged_units.join(","));
    let pod = cri.run_pod_sandbox(&forger).await?;
    let mut spec = report_container("forger");
    spec.devices.push(k8s_cri::v1::Device {
        container_path: "/dev/nvidia0".into(),
        host_path: fake_node(&dev_dir(cluster.dir.path()), 0)?.display().to_string(),
        permissions: "rw".into(),
    });
    let refused = match cri.create_container(&pod, &spec).await {
        Ok(c) => match cri.start_container(&c).await {
            Ok(()) => bail!("a GPU container without units started on a node that schedules by units"),
            Err(status) => status.message().to_string(),
        },
        Err(status) => status.message().to_string(),
    };
    ensure!(
        refused.contains("without units of it") && refused.contains(RESOURCE_NAME),
        "the forger was not refused for its missing units: {refused}"
    );
    println!(
        "{}: forged annotation: refused: {refused}",
        suite.containerd_version
    );
    cri.delete_pod(&pod).await?;
    manager_counts(&cluster, &counted).await?;

    for (pod, container, name) in running {
        cri.delete_container(&container).await?;
        cri.delete_pod(&pod).await?;
        cluster.devices.free(&name);
    }
    cluster
        .node
        .manager
        .wait_status("all leases released", WAIT, |s| s.leases.is_empty())
        .await?;
    Ok(())
}

/// Bad input kubelet could send, and what the node does with each:
/// - a spread: both GPUs have 5 free units, a pod asks 8: kubelet sees 10 available, the plugin
///   prefers nothing (no single GPU fits), kubelet tops up across both, Allocate refuses;
/// - unknown and duplicate device IDs: Allocate refuses with one line each;
/// - units that a running container holds, allocated again (kubelet lost its checkpoint):
///   Allocate cannot know, the manager refuses the container naming the holder, nothing leaks,
///   and once the holder is gone the same units start.
async fn a_spread_an_unknown_unit_and_a_held_unit_are_refused(suite: Suite) -> Result<()> {
    let mut cluster = Cluster::start(&suite).await?;
    let mut cri = cluster.node.cri().await?;
    let gpu0 = cluster.node.gpu_uuid(0).to_string();
    cluster.allocate("fill-0", 10).await?;
    cluster.allocate("fill-1", 10).await?;
    let spread = cluster.allocate("spread", 8).await;
    let message = match spread {
        Ok(a) => bail!("an allocation across GPUs was accepted: {:?}", a.ids),
        Err(e) => format!("{e:#}"),
    };
    ensure!(
        message.contains("must come from one GPU"),
        "the spread was not refused for spanning GPUs: {message}"
    );
    println!("{}: spread refused: {message}", suite.containerd_version);
    cluster.devices.free("fill-0");
    cluster.devices.free("fill-1");

    for (ids, expected) in [
        (
            vec!["GPU-nope-m0".to_string()],
            "is not a gpu-mps.io/memory unit of this node",
        ),
        (vec![format!("{gpu0}-m1"), format!("{gpu0}-m1")], "is named twice"),
        (
            vec![format!("{gpu0}-m{UNITS_PER_GPU}")],
            "is not a gpu-mps.io/memory unit of this node",
        ),
    ] {
        match allocate_ids(&mut cluster.link, &ids).await {
            Ok(r) => bail!("Allocate {ids:?} was accepted: {r:?}"),
            Err(status) => ensure!(
                status.code() == tonic::Code::InvalidArgument
                    && status.message().contains(expected)
                    && !status.message().contains('\n'),
                "Allocate {ids:?}: {status:?}"
            ),
        }
    }

    let holder_units = cluster.allocate("holder", 3).await?;
    let (holder_pod, holder) = run_allocated(&mut cri, pod_spec("holder"), &holder_units).await?;
    let holder = holder.map_err(|s| anyhow::anyhow!("holder: {}", s.message()))?;
    let again = Allocated {
        response: allocate_ids(&mut cluster.link, &holder_units.ids).await?,
        ..holder_units.clone()
    };
    let gates_before = cluster.node.manager.gate_dir_names();
    let (twin_pod, twin) = run_allocated(&mut cri, pod_spec("twin"), &again).await?;
    let message = match twin {
        Ok(c) => bail!("container {} started on units a running container holds", c.name),
        Err(status) => status.message().to_string(),
    };
    ensure!(
        message.contains(&format!("is held by container {}", holder.id)),
        "the twin was not refused for the held units: {message}"
    );
    println!("{}: held units refused: {message}", suite.containerd_version);
    let status = cluster.node.manager.status().await?;
    ensure!(
        status.leases.len() == 1,
        "the refused twin left a lease: {status:#?}"
    );
    ensure!(
        cluster.node.manager.gate_dir_names() == gates_before,
        "the refused twin left a gate dir"
    );
    cri.delete_pod(&twin_pod).await?;
    cri.delete_container(&holder).await?;
    cri.delete_pod(&holder_pod).await?;
    cluster
        .node
        .manager
        .wait_status("the holder's lease released", WAIT, |s| s.leases.is_empty())
        .await?;
    let (pod, after) = run_allocated(&mut cri, pod_spec("after-holder"), &again).await?;
    let after = after.map_err(|s| anyhow::anyhow!("after the holder left: {}", s.message()))?;
    holds_its_units(&cluster, &mut cri, &after, &again).await?;
    cri.delete_container(&after).await?;
    cri.delete_pod(&pod).await?;
    Ok(())
}

/// kubelet restarts (a new kubelet.sock, every plugin socket removed): the plugin registers
/// again. The plugin restarts: it registers again with the same devices, and since it keeps no
/// state, kubelet's record and the manager's leases stay the truth: a new allocation does not
/// reuse the running container's units, and the manager counts both once.
async fn kubelet_and_plugin_restarts_lose_nothing(suite: Suite) -> Result<()> {
    let mut cluster = Cluster::start(&suite).await?;
    let mut cri = cluster.node.cri().await?;
    let first = cluster.allocate("first", 4).await?;
    let (first_pod, first_c) = run_allocated(&mut cri, pod_spec("first"), &first).await?;
    let first_c = first_c.map_err(|s| anyhow::anyhow!("first: {}", s.message()))?;

    let started = std::time::Instant::now();
    cluster.kubelet.restart()?;
    cluster.link = register(&mut cluster.kubelet, 2).await?;
    println!(
        "{}: kubelet restart: registered again after {:.1} s",
        suite.containerd_version,
        started.elapsed().as_secs_f64()
    );

    cluster.plugin.kill();
    let started = std::time::Instant::now();
    cluster.plugin = PluginProcess::start(
        &cluster.node.bins,
        cluster.node.manager.config_path(),
        cluster.dir.path(),
        &dev_dir(cluster.dir.path()),
        &cluster.cdi_dirs,
    )?;
    cluster.link = register(&mut cluster.kubelet, 2).await?;
    println!(
        "{}: plugin restart: registered again after {:.1} s",
        suite.containerd_version,
        started.elapsed().as_secs_f64()
    );

    let second = cluster.allocate("second", 4).await?;
    let overlap: BTreeSet<&String> = first.ids.iter().filter(|id| second.ids.contains(id)).collect();
    ensure!(overlap.is_empty(), "units allocated twice: {overlap:?}");
    let (second_pod, second_c) = run_allocated(&mut cri, pod_spec("second"), &second).await?;
    let second_c = second_c.map_err(|s| anyhow::anyhow!("second: {}", s.message()))?;
    holds_its_units(&cluster, &mut cri, &second_c, &second).await?;
    let (gpu, _) = units_of(&first.ids);
    manager_counts(&cluster, &BTreeMap::from([(gpu, 8)])).await?;
    for (pod, c) in [(first_pod, first_c), (second_pod, second_c)] {
        cri.delete_container(&c).await?;
        cri.delete_pod(&pod).await?;
    }
    Ok(())
}

/// A GPU whose daemon cannot start turns Unhealthy in ListAndWatch, and Healthy again by itself
/// (15 s after the failure, with no container sent to retry), then takes a container; with the manager down every unit turns Unhealthy, and back when it returns.
async fn health_follows_the_manager(suite: Suite) -> Result<()> {
    let mut cluster = Cluster::start(&suite).await?;
    let mut cri = cluster.node.cri().await?;
    let gpu1 = cluster.node.gpu_uuid(1).to_string();
    // A file where the daemon's directory goes: the manager cannot start GPU 1's daemon.
    let blocker = cluster
        .node
        .manager
        .config()
        .daemon_dir(&gpu_mps_api::DaemonKey::new([gpu1.clone()]));
    std::fs::create_dir_all(blocker.parent().context("daemon dir parent")?)?;
    std::fs::write(&blocker, "blocks the daemon dir\n")?;
    let ids: Vec<String> = (0..3).map(|n| format!("{gpu1}-m{n}")).collect();
    let response = allocate_ids(&mut cluster.link, &ids).await?;
    let allocated = Allocated {
        ids: ids.clone(),
        preferred: Vec::new(),
        response,
    };
    let (pod, refused) = run_allocated(&mut cri, pod_spec("blocked"), &allocated).await?;
    ensure!(refused.is_err(), "a container started although its daemon cannot");
    cri.delete_pod(&pod).await?;
    let gpu1_units = move |d: &BTreeMap<String, String>, health: &str| {
        d.iter()
            .filter(|(id, _)| id.starts_with(&gpu1))
            .all(|(_, h)| h == health)
            && d.iter()
                .filter(|(id, _)| !id.starts_with(&gpu1))
                .all(|(_, h)| h == "Healthy")
    };
    let g = gpu1_units.clone();
    cluster
        .link
        .watch_until("GPU 1 Unhealthy", WAIT, move |d| g(d, "Unhealthy"))
        .await?;
    println!(
        "{}: GPU 1 Unhealthy while its daemon cannot start",
        suite.containerd_version
    );
    std::fs::remove_file(&blocker)?;
    // No container comes to retry (kubelet sends none to Unhealthy units): the GPU must come
    // back by itself once the failure is old enough, and then take a container.
    let g = gpu1_units.clone();
    cluster
        .link
        .watch_until(
            "GPU 1 Healthy again by itself",
            Duration::from_secs(30),
            move |d| g(d, "Healthy"),
        )
        .await?;
    println!(
        "{}: GPU 1 Healthy again by itself after its failed start",
        suite.containerd_version
    );
    let (pod, started) = run_allocated(&mut cri, pod_spec("unblocked"), &allocated).await?;
    let started = started.map_err(|s| anyhow::anyhow!("after the fix: {}", s.message()))?;
    cri.delete_container(&started).await?;
    cri.delete_pod(&pod).await?;

    cluster.node.manager.kill();
    cluster
        .link
        .watch_until("every unit Unhealthy with the manager down", WAIT, |d| {
            d.values().all(|h| h == "Unhealthy")
        })
        .await?;
    cluster.node.manager.start_again().await?;
    cluster
        .link
        .watch_until("every unit Healthy with the manager back", WAIT, |d| {
            d.values().all(|h| h == "Healthy")
        })
        .await?;
    println!(
        "{}: manager down: all Unhealthy; back: all Healthy",
        suite.containerd_version
    );
    Ok(())
}

/// Ten allocations of 3 units sent at once on ten connections, then the ten containers created
/// at once: every container that got units is admitted, and the manager counts 30 units, no
/// GPU over its 15.
async fn many_allocations_at_once_are_all_admitted(suite: Suite) -> Result<()> {
    let mut cluster = Cluster::start(&suite).await?;
    // kubelet decides the IDs one pod at a time (its device manager holds a lock); the plugin
    // then gets the Allocate calls concurrently.
    let mut picks = Vec::new();
    for i in 0..10 {
        let name = format!("race-{i}");
        let available = cluster.devices.available(&cluster.link);
        let ids: Vec<String> = {
            let preferred = cluster
                .link
                .client
                .get_preferred_allocation(gpu_mps_device_plugin::v1beta1::PreferredAllocationRequest {
                    container_requests: vec![
                        gpu_mps_device_plugin::v1beta1::ContainerPreferredAllocationRequest {
                            available_device_i_ds: available.iter().cloned().collect(),
                            must_include_device_i_ds: Vec::new(),
                            allocation_size: 3,
                        },
                    ],
                })
                .await?
                .into_inner();
            preferred.container_responses[0].device_i_ds.clone()
        };
        ensure!(ids.len() == 3, "{name}: preferred {ids:?}");
        cluster.devices.in_use.insert(name.clone(), ids.clone());
        picks.push((name, ids));
    }
    let plugin_socket = cluster.dir.path().join("gpu-mps.sock");
    let calls = picks.iter().map(|(name, ids)| {
        let socket = plugin_socket.clone();
        async move {
            let mut client = plugin_client(&socket).await?;
            let response = allocate_on(&mut client, ids).await?;
            Ok::<_, anyhow::Error>((
                name.clone(),
                Allocated {
                    ids: ids.clone(),
                    preferred: ids.clone(),
                    response,
                },
            ))
        }
    });
    let allocations: Vec<(String, Allocated)> = gpu_mps_e2e::concurrent::all_ok(calls).await?;
    let creates = allocations.iter().map(|(name, allocated)| {
        let node = &cluster.node;
        async move {
            let mut cri = node.containerd.cri().await?;
            let (pod, c) = run_allocated(&mut cri, pod_spec(name), allocated).await?;
            let c = c.map_err(|s| anyhow::anyhow!("{name}: {}", s.message()))?;
            Ok::<_, anyhow::Error>((pod, c))
        }
    });
    cluster.node.cri().await?; // the test image, imported once before the races
    let started: Vec<(Pod, Container)> = gpu_mps_e2e::concurrent::all_ok(creates).await?;
    let mut counted: BTreeMap<String, u64> = BTreeMap::new();
    for (_, allocated) in &allocations {
        *counted.entry(units_of(&allocated.ids).0).or_default() += 3;
    }
    ensure!(
        counted.values().all(|u| *u <= UNITS_PER_GPU as u64),
        "over a GPU: {counted:?}"
    );
    manager_counts(&cluster, &counted).await?;
    let status = cluster.node.manager.status().await?;
    ensure!(
        status.leases.len() == 10,
        "{} leases for 10 containers",
        status.leases.len()
    );
    println!(
        "{}: 10 concurrent allocations and creates: all admitted, units per GPU {counted:?}",
        suite.containerd_version
    );
    let mut cri = cluster.node.containerd.cri().await?;
    for (pod, c) in started {
        cri.delete_container(&c).await?;
        cri.delete_pod(&pod).await?;
    }
    Ok(())
}

/// With an NVIDIA CDI spec naming GPU 0, Allocate hands it over as the CDI device
/// `nvidia.com/gpu=<uuid>` (no env, no device nodes); containerd resolves it into the node, and
/// the container runs on GPU 0's daemon with its units. containerd 1.6 has no CDI and drops the
/// device: the shim refuses the container that got units but no GPU.
async fn a_gpu_with_a_cdi_spec_goes_as_a_cdi_device(suite: Suite) -> Result<()> {
    let gpus = fake_gpus(2, FAKE_GPU_MEMORY);
    let holder = tempfile::Builder::new().prefix("gme2e-cdinode.").tempdir()?;
    let node0 = fake_node(holder.path(), gpus[0].minor)?;
    let cdi = CdiOptions {
        enabled: Some(true),
        specs: vec![cdi::gpu_node_spec(&[(gpus[0].uuid.clone(), node0)])],
    };
    let mut cluster = Cluster::start_with(&suite, cdi, true).await?;
    let mut cri = cluster.node.cri().await?;
    let allocated = cluster.allocate("cdi", 2).await?;
    let gpu0 = cluster.node.gpu_uuid(0).to_string();
    ensure!(
        allocated.response.cdi_devices.len() == 1
            && allocated.response.cdi_devices[0].name == format!("nvidia.com/gpu={gpu0}")
            && allocated.response.envs.is_empty()
            && allocated.response.devices.is_empty(),
        "Allocate did not hand GPU 0 over as a CDI device: {:?}",
        allocated.response
    );
    let (pod, c) = run_allocated(&mut cri, pod_spec("cdi"), &allocated).await?;
    if !suite.has_cdi() {
        // containerd 1.6 drops the CDI device: the units arrive without their GPU, and the shim
        // refuses the container rather than let it run on the CPU holding its units.
        let message = match c {
            Ok(c) => bail!("container {} started without the GPU of its units", c.name),
            Err(status) => status.message().to_string(),
        };
        ensure!(
            message.contains("no GPU reached its spec") && message.contains("--gpu-delivery=nodes"),
            "containerd without CDI: {message}"
        );
        let status = cluster.node.manager.status().await?;
        ensure!(status.leases.is_empty(), "a lease without a GPU: {status:#?}");
        println!(
            "{}: no CDI: units without their GPU refused: {message}",
            suite.containerd_version
        );
        cri.delete_pod(&pod).await?;
        return Ok(());
    }
    let c = c.map_err(|s| anyhow::anyhow!("cdi: {}", s.message()))?;
    holds_its_units(&cluster, &mut cri, &c, &allocated).await?;
    let spec = cluster.node.containerd.bundle_spec(CRI_NAMESPACE, &c.id)?;
    let has_node = spec
        .pointer("/linux/devices")
        .and_then(|d| d.as_array())
        .is_some_and(|d| d.iter().any(|d| d["major"] == NVIDIA_MAJOR));
    ensure!(
        has_node,
        "containerd did not resolve the CDI device into a device node"
    );
    println!(
        "{}: CDI device nvidia.com/gpu={gpu0} resolved, 2 units held",
        suite.containerd_version
    );
    cri.delete_container(&c).await?;
    cri.delete_pod(&pod).await?;
    Ok(())
}

/// MPS serves a fixed number of clients per GPU (48; 4 on this node, so that the test can reach
/// it): every CUDA process must hold ceil(15 units / 4) = 4 units. Allocate refuses 3 units; the
/// shim refuses 2 processes on 4 units; four 4-unit pods fit, three on GPU 0 and one on GPU 1, and
/// no GPU ever serves more processes than it may.
async fn the_client_limit_is_kept_by_a_minimum_of_units(suite: Suite) -> Result<()> {
    let mut cluster = Cluster::start_configured(
        &suite,
        limits().limit("max_clients_per_gpu = 4"),
        2,
        CdiOptions::default(),
        false,
    )
    .await?;
    let mut cri = cluster.node.cri().await?;
    let message = match cluster.allocate("small", 3).await {
        Ok(a) => bail!("3 units were allocated below the minimum: {:?}", a.ids),
        Err(e) => format!("{e:#}"),
    };
    ensure!(
        message.contains("fewer than the 4 this node needs per CUDA process")
            && message.contains("ask for at least 4"),
        "Allocate of 3 units: {message}"
    );
    cluster.devices.free("small");

    let two = cluster.allocate("two-processes", 4).await?;
    let spec = pod_spec("two-processes").annotation(gpu_mps_api::annotations::CUDA_PROCESSES, "2");
    let (pod, refused) = run_allocated(&mut cri, spec, &two).await?;
    let message = match refused {
        Ok(c) => bail!("container {} with 2 processes on 4 units started", c.name),
        Err(status) => status.message().to_string(),
    };
    ensure!(
        message.contains("2 CUDA processes need at least 8 units") && message.contains("got 4"),
        "2 processes on 4 units: {message}"
    );
    cri.delete_pod(&pod).await?;
    cluster.devices.free("two-processes");

    let mut running = Vec::new();
    for i in 0..4 {
        let name = format!("four-{i}");
        let allocated = cluster.allocate(&name, 4).await?;
        let (pod, c) = run_allocated(&mut cri, pod_spec(&name), &allocated).await?;
        let c = c.map_err(|s| anyhow::anyhow!("{name}: {}", s.message()))?;
        running.push((pod, c, units_of(&allocated.ids).0));
    }
    let (gpu0, gpu1) = (
        cluster.node.gpu_uuid(0).to_string(),
        cluster.node.gpu_uuid(1).to_string(),
    );
    let on = |gpu: &str| running.iter().filter(|(_, _, g)| g == gpu).count();
    ensure!(
        on(&gpu0) == 3 && on(&gpu1) == 1,
        "placement {} on GPU 0, {} on GPU 1",
        on(&gpu0),
        on(&gpu1)
    );
    let status = cluster.node.manager.status().await?;
    for gpu in &status.gpus {
        let processes: u32 = status
            .leases
            .iter()
            .filter(|l| l.gpu_uuids.contains(&gpu.uuid))
            .map(|l| l.cuda_processes)
            .sum();
        ensure!(
            processes <= 4,
            "GPU {} serves {processes} processes, more than 4",
            gpu.uuid
        );
    }
    println!(
        "{}: minimum 4 units per process: 3 units refused by Allocate, 2 processes on 4 units refused by the shim, 3 + 1 pods placed",
        suite.containerd_version
    );
    for (pod, c, _) in running {
        cri.delete_container(&c).await?;
        cri.delete_pod(&pod).await?;
    }
    Ok(())
}

/// Inventories of one and eight GPUs.
/// One GPU: 8 + 7 units fill it; kubelet has no unit left for the next pod (it never reaches the
/// plugin), and a pod leaving makes room again.
/// Eight GPUs: 10 units on each leave 5 free on every GPU (40 on the node); a 6-unit pod fits the
/// node but no GPU and Allocate refuses the spread; with one GPU emptied, a 5-unit pod still goes to
/// the tightest GPU that holds it (best fit), and a 12-unit pod to the empty one.
async fn one_and_eight_gpus_pack_best_fit_and_refuse_a_spread(suite: Suite) -> Result<()> {
    let mut one = Cluster::start_configured(&suite, limits(), 1, CdiOptions::default(), false).await?;
    let mut cri = one.node.cri().await?;
    let gpu = one.node.gpu_uuid(0).to_string();
    let big = one.allocate("big", 8).await?;
    let (big_pod, big_c) = run_allocated(&mut cri, pod_spec("big"), &big).await?;
    let big_c = big_c.map_err(|s| anyhow::anyhow!("big: {}", s.message()))?;
    holds_its_units(&one, &mut cri, &big_c, &big).await?;
    let rest = one.allocate("rest", 7).await?;
    ensure!(units_of(&rest.ids).0 == gpu, "rest: {:?}", rest.ids);
    let full = one.allocate("one-more", 1).await;
    ensure!(
        full.as_ref()
            .is_err_and(|e| e.to_string().contains("Available: 0")),
        "a pod got units of a full GPU: {:?}",
        full.map(|a| a.ids)
    );
    cri.delete_container(&big_c).await?;
    cri.delete_pod(&big_pod).await?;
    one.devices.free("big");
    let again = one.allocate("after-big", 8).await?;
    let (pod, c) = run_allocated(&mut cri, pod_spec("after-big"), &again).await?;
    let c = c.map_err(|s| anyhow::anyhow!("after-big: {}", s.message()))?;
    holds_its_units(&one, &mut cri, &c, &again).await?;
    cri.delete_container(&c).await?;
    cri.delete_pod(&pod).await?;
    println!(
        "{}: 1 GPU: 8 + 7 units filled it, the next pod found none, 8 again once one left",
        suite.containerd_version
    );
    drop(cri);
    drop(one);

    let mut eight = Cluster::start_configured(&suite, limits(), 8, CdiOptions::default(), false).await?;
    let mut cri = eight.node.cri().await?;
    let mut per_gpu: BTreeMap<String, usize> = BTreeMap::new();
    for i in 0..8 {
        let a = eight.allocate(&format!("ten-{i}"), 10).await?;
        *per_gpu.entry(units_of(&a.ids).0).or_default() += 1;
    }
    ensure!(
        per_gpu.len() == 8 && per_gpu.values().all(|n| *n == 1),
        "10-unit pods not one per GPU: {per_gpu:?}"
    );
    let spread = eight.allocate("six", 6).await;
    let message = match spread {
        Ok(a) => bail!("6 units across GPUs were accepted: {:?}", a.ids),
        Err(e) => format!("{e:#}"),
    };
    ensure!(
        message.contains("must come from one GPU"),
        "the spread: {message}"
    );
    eight.devices.free("six");
    // Empty GPU 3: best fit still puts 5 units on a GPU with exactly 5 free.
    let gpu3 = eight.node.gpu_uuid(3).to_string();
    let on_gpu3 = eight
        .devices
        .in_use
        .iter()
        .find(|(_, ids)| units_of(ids).0 == gpu3)
        .map(|(name, _)| name.clone())
        .context("no pod on GPU 3")?;
    eight.devices.free(&on_gpu3);
    let five = eight.allocate("five", 5).await?;
    let five_gpu = units_of(&five.ids).0;
    ensure!(five_gpu != gpu3, "best fit put 5 units on the empty GPU 3");
    let twelve = eight.allocate("twelve", 12).await?;
    ensure!(
        units_of(&twelve.ids).0 == gpu3,
        "12 units not on the empty GPU 3: {:?}",
        twelve.ids
    );
    let (pod, c) = run_allocated(&mut cri, pod_spec("twelve"), &twelve).await?;
    let c = c.map_err(|s| anyhow::anyhow!("twelve: {}", s.message()))?;
    holds_its_units(&eight, &mut cri, &c, &twelve).await?;
    cri.delete_container(&c).await?;
    cri.delete_pod(&pod).await?;
    println!(
        "{}: 8 GPUs: 6 units refused as a spread with 5 free on each GPU; 5 went to a full-fit GPU ({five_gpu}), 12 to the emptied one",
        suite.containerd_version
    );
    Ok(())
}
