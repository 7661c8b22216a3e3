//! Load (issue 8): 64 GPU containers created at once through real containerd (1.6, 1.7, 2.x) and
//! runc with the `gpu-mps` handler, across 4 limit classes, 3 namespaces and 2 fake GPUs, then
//! deleted at once; 10 rounds. After each round's creates the manager's leases are exactly the
//! live containers, each with its own limits and namespace, and each GPU's reserved memory is
//! exactly theirs; after each round's deletes no lease is left; after the last, no daemon.
//! Create latencies are printed (p50/p99), not asserted: the benchmark against plain runc is
//! separate (`cargo bench -p gpu-mps-e2e --bench overhead`).
//!
//! GPU_MPS_LOAD_ROUNDS sets the number of rounds (default 10).
//! Run: `cargo test -p gpu-mps-e2e --test cri_load -- --nocapture`.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use gpu_mps_api::quantity::parse_bytes;
use gpu_mps_e2e::concurrent::all_ok;
use gpu_mps_e2e::containerd::GPU_MPS_HANDLER;
use gpu_mps_e2e::cri::{Container, Pod};
use gpu_mps_e2e::image::TEST_IMAGE;
use gpu_mps_e2e::manager::IDLE_GRACE_SECONDS;
use gpu_mps_e2e::{ContainerSpec, GpuNode, LimitsConfig, PodSpec, Suite, per_suite};

per_suite!(sixty_four_creates_at_once_ten_rounds_leave_the_state_exact);

const CONTAINERS: usize = 64;
const NAMESPACES: [&str; 3] = ["team-a", "team-b", "team-c"];
/// (memory, threads): 64 of them fit two 16 GiB GPUs and 48 clients each.
const CLASSES: [(&str, u8); 4] = [("256Mi", 10), ("384Mi", 20), ("512Mi", 30), ("256Mi", 50)];
const WAIT: Duration = Duration::from_secs(60);

fn rounds() -> usize {
    std::env::var("GPU_MPS_LOAD_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10)
}

/// What one container is: its pod (one per namespace and class) and GPU.
struct Slot {
    pod: usize,
    namespace: &'static str,
    memory_bytes: u64,
    threads: u8,
    gpu: usize,
}

fn slot(i: usize) -> Result<Slot> {
    let (n, c) = (i % NAMESPACES.len(), i % CLASSES.len());
    Ok(Slot {
        pod: n * CLASSES.len() + c,
        namespace: NAMESPACES[n],
        memory_bytes: parse_bytes(CLASSES[c].0)?,
        threads: CLASSES[c].1,
        gpu: i % 2,
    })
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(index).copied().unwrap_or(0.0)
}

async fn sixty_four_creates_at_once_ten_rounds_leave_the_state_exact(suite: Suite) -> Result<()> {
    let node = GpuNode::start(&suite, LimitsConfig::exact()).await?;
    let mut cri = node.cri().await?;
    let gpus = [node.gpu_uuid(0).to_string(), node.gpu_uuid(1).to_string()];
    // One pod per namespace and limit class, for every round.
    let mut pods: Vec<Pod> = Vec::new();
    for namespace in NAMESPACES {
        for (c, (memory, threads)) in CLASSES.iter().enumerate() {
            let spec =
                PodSpec::new(&format!("load-{c}"), namespace, GPU_MPS_HANDLER).gpu_limits(memory, *threads);
            pods.push(cri.run_pod_sandbox(&spec).await?);
        }
    }
    let mut latencies: Vec<f64> = Vec::new();
    let started = Instant::now();
    for round in 0..rounds() {
        let creates = (0..CONTAINERS).map(|i| {
            let (pods, gpus, node) = (&pods, &gpus, &node);
            async move {
                let s = slot(i)?;
                let mut cri = node.containerd.cri().await?;
                let spec = ContainerSpec::new(&format!("r{round}-c{i}"), TEST_IMAGE)
                    .command(&["/checker"])
                    .args(&["pause"])
                    .gpu(&gpus[s.gpu]);
                let t = Instant::now();
                let container = cri
                    .create_container(&pods[s.pod], &spec)
                    .await
                    .with_context(|| format!("round {round}: creating container {i}"))?;
                cri.start_container(&container)
                    .await
                    .with_context(|| format!("round {round}: starting container {i}"))?;
                Ok::<_, anyhow::Error>((i, container, t.elapsed().as_secs_f64()))
            }
        });
        let created: Vec<(usize, Container, f64)> = all_ok(creates).await?;
        latencies.extend(created.iter().map(|(_, _, s)| *s));

        let status = node.manager.status().await?;
        let live: BTreeSet<&str> = created.iter().map(|(_, c, _)| c.id.as_str()).collect();
        let leased: BTreeSet<&str> = status.leases.iter().map(|l| l.container_id.as_str()).collect();
        ensure!(
            leased == live,
            "round {round}: leases {} vs live containers {}: missing {:?}, extra {:?}",
            leased.len(),
            live.len(),
            live.difference(&leased).collect::<Vec<_>>(),
            leased.difference(&live).collect::<Vec<_>>()
        );
        let mut reserved: BTreeMap<&str, u64> = BTreeMap::new();
        for (i, container, _) in &created {
            let s = slot(*i)?;
            let lease = status
                .leases
                .iter()
                .find(|l| l.container_id == container.id)
                .context("lease")?;
            ensure!(
                lease.memory_limit_bytes == s.memory_bytes
                    && lease.active_thread_percentage == u32::from(s.threads)
                    && lease.namespace == s.namespace
                    && lease.gpu_uuids == [gpus[s.gpu].clone()],
                "round {round}: container {i}: lease {lease:?}"
            );
            *reserved.entry(gpus[s.gpu].as_str()).or_default() += s.memory_bytes;
        }
        for gpu in &status.gpus {
            let want = reserved.get(gpu.uuid.as_str()).copied().unwrap_or(0);
            ensure!(
                gpu.memory_reserved_bytes == want,
                "round {round}: GPU {} reserved {} bytes, its containers {want}",
                gpu.uuid,
                gpu.memory_reserved_bytes
            );
        }
        ensure!(
            status.daemons.len() == 2,
            "round {round}: {} daemons",
            status.daemons.len()
        );

        let deletes = created.iter().map(|(_, container, _)| {
            let node = &node;
            async move {
                let mut cri = node.containerd.cri().await?;
                cri.delete_container(container).await?;
                Ok::<_, anyhow::Error>(())
            }
        });
        all_ok(deletes).await?;
        node.manager
            .wait_status(&format!("round {round}: every lease released"), WAIT, |s| {
                s.leases.is_empty() && s.gpus.iter().all(|g| g.memory_reserved_bytes == 0)
            })
            .await?;
    }
    for pod in &pods {
        cri.delete_pod(pod).await?;
    }
    let grace = Duration::from_secs(IDLE_GRACE_SECONDS);
    node.manager
        .wait_status("no daemon once all are deleted", grace + WAIT, |s| {
            s.daemons.is_empty()
        })
        .await?;
    latencies.sort_by(f64::total_cmp);
    println!(
        "{}: {} rounds of {CONTAINERS} concurrent creates ({} containers) in {:.1} s; create+start p50 {:.0} ms, p99 {:.0} ms; state exact after every round",
        suite.containerd_version,
        rounds(),
        latencies.len(),
        started.elapsed().as_secs_f64(),
        percentile(&latencies, 0.5) * 1000.0,
        percentile(&latencies, 0.99) * 1000.0
    );
    Ok(())
}
