//! Soak (issue 8): random GPU container creates and deletes through the CRI API for a while,
//! with the manager's memory and open descriptors sampled every minute: they must stay flat.
//! A benchmark run by hand, not a test; its figures go to docs/reliability.md.
//!
//!   GPU_MPS_SOAK_MINUTES=30 GPU_MPS_E2E_SUITES=bookworm cargo bench -p gpu-mps-e2e --bench soak
//!   (as root, after tests/support/fetch-containerd.sh; GPU_MPS_SOAK_SEED picks the sequence)
//!
//! Each step creates or deletes one container (at most 24 live, 4 limit classes, 2 fake GPUs,
//! policy exact), chosen by a seeded generator so that a run can be repeated. At the end every
//! container is deleted, and the leases must be exactly the live containers all along (checked
//! every minute) and none at the end.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use gpu_mps_e2e::containerd::GPU_MPS_HANDLER;
use gpu_mps_e2e::cri::Container;
use gpu_mps_e2e::image::TEST_IMAGE;
use gpu_mps_e2e::{ContainerSpec, GpuNode, LimitsConfig, PodSpec, suites};

const MAX_LIVE: usize = 24;
const CLASSES: [(&str, u8); 4] = [("256Mi", 10), ("384Mi", 20), ("512Mi", 30), ("256Mi", 50)];

/// xorshift64*: a repeatable sequence without a dependency.
struct Sequence(u64);

impl Sequence {
    fn next(&mut self, below: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % below
    }
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Resident memory (KiB) and open descriptors of `pid`.
fn footprint(pid: u32) -> Result<(u64, usize)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .context("no VmRSS")?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count();
    Ok((rss, fds))
}

async fn soak(suite: &suites::Suite, minutes: u64, seed: u64) -> Result<()> {
    let node = GpuNode::start(suite, LimitsConfig::exact()).await?;
    let mut cri = node.cri().await?;
    let gpus = [node.gpu_uuid(0).to_string(), node.gpu_uuid(1).to_string()];
    let mut pods = Vec::new();
    for (c, (memory, threads)) in CLASSES.iter().enumerate() {
        let spec =
            PodSpec::new(&format!("soak-{c}"), "default", GPU_MPS_HANDLER).gpu_limits(memory, *threads);
        pods.push(cri.run_pod_sandbox(&spec).await?);
    }
    let pid = node.manager.pid().context("manager pid")?;
    let mut sequence = Sequence(seed.max(1));
    let mut live: Vec<Container> = Vec::new();
    let (mut creates, mut deletes) = (0usize, 0usize);
    let started = Instant::now();
    let end = started + Duration::from_secs(minutes * 60);
    let mut next_sample = started;
    let mut samples = Vec::new();
    println!("\n### soak, {minutes} min, seed {seed}\n{suite}");
    println!(
        "| minute | manager RSS | open fds | live containers | creates | deletes |\n|---|---|---|---|---|---|"
    );
    while Instant::now() < end {
        if Instant::now() >= next_sample {
            let status = node.manager.status().await?;
            let leased: BTreeSet<&str> = status.leases.iter().map(|l| l.container_id.as_str()).collect();
            let running: BTreeSet<&str> = live.iter().map(|c| c.id.as_str()).collect();
            ensure!(
                leased == running,
                "leases {leased:?} vs live containers {running:?}"
            );
            let (rss, fds) = footprint(pid)?;
            let minute = started.elapsed().as_secs() / 60;
            println!(
                "| {minute} | {} KiB | {fds} | {} | {creates} | {deletes} |",
                rss,
                live.len()
            );
            samples.push((rss, fds));
            next_sample += Duration::from_secs(60);
        }
        let create = live.is_empty() || (live.len() < MAX_LIVE && sequence.next(2) == 0);
        if create {
            let class = sequence.next(CLASSES.len());
            let spec = ContainerSpec::new(&format!("s{creates}"), TEST_IMAGE)
                .command(&["/checker"])
                .args(&["pause"])
                .gpu(&gpus[sequence.next(2)]);
            let container = cri.create_container(&pods[class], &spec).await?;
            cri.start_container(&container).await?;
            live.push(container);
            creates += 1;
        } else {
            let container = live.swap_remove(sequence.next(live.len()));
            cri.delete_container(&container).await?;
            deletes += 1;
        }
    }
    for container in live.drain(..) {
        cri.delete_container(&container).await?;
        deletes += 1;
    }
    node.manager
        .wait_status("no lease at the end", Duration::from_secs(30), |s| {
            s.leases.is_empty()
        })
        .await?;
    let (rss, fds) = footprint(pid)?;
    let (first_rss, first_fds) = samples.first().copied().unwrap_or((rss, fds));
    let peak_rss = samples.iter().map(|s| s.0).max().unwrap_or(rss);
    println!(
        "end: {creates} creates, {deletes} deletes in {:.0} s; manager RSS {first_rss} -> {rss} KiB (peak {peak_rss}), fds {first_fds} -> {fds}",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn main() -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let minutes = env_number("GPU_MPS_SOAK_MINUTES", 30);
    let seed = env_number("GPU_MPS_SOAK_SEED", 1);
    for suite in suites::discover()? {
        runtime.block_on(soak(suite, minutes, seed))?;
    }
    Ok(())
}
