//! What gpu-mps adds to starting a container, against plain runc measured in the same run.
//!
//!   scripts/build-release.sh      # the binaries as shipped: static shim and hook
//!   GPU_MPS_E2E_BIN_DIR=$PWD/target/dist cargo bench -p gpu-mps-e2e --bench overhead
//!   (as root; GPU_MPS_E2E_SUITES=... to pick suites)
//!
//! 1. `ctr run --rm` of a trivial container (`/checker exit 0`), alternating three ways, N times:
//!    plain runc; gpu-mps-shim with no GPU (passthrough: the cost of the extra exec per runc call);
//!    gpu-mps with a GPU (spec rewrite + createRuntime/poststop hooks + Acquire/Release), with the
//!    daemon kept warm by a long-running GPU container, as on a busy node. Medians and ratios.
//! 2. The shim's own time per create: the in-process rewrite, and the shim binary from exec to
//!    exec'ing runc (runc_path = /bin/true) against exec'ing /bin/true directly.
//!
//! 3. Concurrent creates through the CRI API (what kubelet sends when a node fills): 32
//!    containers created and started at once in 2 pods, plain runc (`runc` handler) and gpu-mps
//!    (`gpu-mps` handler with a GPU, policy exact, 4 limit classes) alternating round by round;
//!    per-container create+start latency p50/p99 and their ratios to runc.
//!
//! On this machine the MPS daemon is the test double (fake-mps-control): the numbers are the
//! containerd/runc/gpu-mps software path, not GPU work. tests/gpu/run.sh (E7) repeats part 1 on
//! the GPU machine with the real daemon.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use gpu_mps_api::NodeConfig;
use gpu_mps_api::inventory::Inventory;
use gpu_mps_e2e::{CtrRun, GpuNode, LimitsConfig, suites};

const RUNS: usize = 25;

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

async fn timed(ctr: &gpu_mps_e2e::ctr::Ctr, run: &CtrRun) -> Result<Duration> {
    let start = Instant::now();
    let out = ctr.run(run).await?;
    let elapsed = start.elapsed();
    ensure!(
        out.status.success(),
        "{} failed: {} {}",
        run.id,
        out.stdout,
        out.stderr
    );
    Ok(elapsed)
}

async fn ctr_run_overhead(suite: &suites::Suite) -> Result<()> {
    let node = GpuNode::start(suite, LimitsConfig::uniform()).await?;
    let rootfs = node.rootfs()?;
    let ctr = node.containerd.ctr();
    let gpu = node.gpu_uuid(0).to_string();
    let gpu_run = |prefix: &str, args: &[&str]| {
        CtrRun::checker(prefix, &rootfs, args)
            .runc_binary(&node.bins.shim)
            .gpu(&gpu)
            .gpu_limits("1Gi", 25)
    };

    // Keep the daemon warm: a GPU container that holds a lease for the whole benchmark.
    let holder = gpu_run("holder", &["sleep", "3600"]);
    let holder_id = holder.id.clone();
    let holder_ctr = ctr.clone();
    let holder_task = tokio::spawn(async move { holder_ctr.run(&holder).await });
    let warm = node
        .manager
        .wait_status("a warm daemon", Duration::from_secs(20), |s| s.leases.len() == 1)
        .await;
    warm.context("the holder container did not get its lease")?;

    let variants: [(&str, CtrRun); 3] = [
        ("runc", CtrRun::checker("b-runc", &rootfs, &["exit", "0"])),
        (
            "shim passthrough (no GPU)",
            CtrRun::checker("b-pass", &rootfs, &["exit", "0"]).runc_binary(&node.bins.shim),
        ),
        ("gpu-mps (GPU, warm daemon)", gpu_run("b-gpu", &["exit", "0"])),
    ];
    for (_, run) in &variants {
        timed(
            &ctr,
            &CtrRun {
                id: gpu_mps_e2e::ctr::unique_id("warmup"),
                ..run.clone()
            },
        )
        .await?;
    }
    let mut samples: Vec<Vec<Duration>> = vec![Vec::new(); variants.len()];
    for _ in 0..RUNS {
        for (i, (_, run)) in variants.iter().enumerate() {
            let run = CtrRun {
                id: gpu_mps_e2e::ctr::unique_id("bench"),
                ..run.clone()
            };
            samples[i].push(timed(&ctr, &run).await?);
        }
    }
    ctr.command(&["task", "kill", "-s", "KILL", &holder_id]).await?;
    let _ = holder_task.await;

    println!("\n### ctr run --rm overhead, {RUNS} alternating runs each\n{suite}");
    println!("| variant | median | p90 | ratio to runc (median) |\n|---|---|---|---|");
    let base = median(samples[0].clone());
    for (i, (name, _)) in variants.iter().enumerate() {
        let mut sorted = samples[i].clone();
        sorted.sort();
        let p90 = sorted[(sorted.len() * 9) / 10 - 1];
        let m = median(samples[i].clone());
        println!(
            "| {name} | {:.1} ms | {:.1} ms | {:.3} |",
            ms(m),
            ms(p90),
            ms(m) / ms(base)
        );
    }
    Ok(())
}

/// The shim's own time per create, independent of containerd.
fn shim_time_per_create(shim: &Path) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let root = dir.path().join("root");
    std::fs::create_dir_all(&root)?;
    let inventory = r#"{"source":"bench","gpus":[{"index":0,"uuid":"GPU-bench-0","name":"bench","memory_bytes":17179869184,"compute_mode":"Default","mig_enabled":false}]}"#;
    std::fs::write(root.join("inventory.json"), inventory)?;
    let config_path = dir.path().join("config.toml");
    std::fs::write(
        &config_path,
        format!(
            "root = {:?}\nrunc_path = \"/bin/true\"\n",
            root.display().to_string()
        ),
    )?;
    let spec = r#"{"ociVersion":"1.0.2","process":{"args":["/checker"],"env":["PATH=/bin"],"cwd":"/"},"root":{"path":"rootfs"},"mounts":[{"destination":"/proc","type":"proc","source":"proc"}],"linux":{"namespaces":[{"type":"pid"},{"type":"ipc"},{"type":"mount"}]},"annotations":{"cdi.k8s.io/bench":"nvidia.com/gpu=0","gpu-mps.io/memory-limit":"4Gi","gpu-mps.io/active-thread-percentage":"25"}}"#;

    // In-process: the pure plan (parse, resolve, rewrite, serialize).
    let config = NodeConfig::from_toml(&std::fs::read_to_string(&config_path)?, &config_path)?;
    let inv = Inventory::from_json(inventory)?;
    let n = 2000;
    let start = Instant::now();
    for _ in 0..n {
        let plan = gpu_mps_shim::plan_rewrite(spec, &config, &inv, "bench-container")?;
        ensure!(plan.rewritten.is_some());
    }
    let in_process = start.elapsed() / n;

    // The binary, exec to exec: read config.json, config and inventory, rewrite, write, exec runc.
    let bundle = dir.path().join("bundle");
    std::fs::create_dir_all(&bundle)?;
    let exec = |program: &Path, args: &[&str]| -> Result<Duration> {
        std::fs::write(bundle.join("config.json"), spec)?;
        let start = Instant::now();
        let status = std::process::Command::new(program)
            .args(args)
            .env("GPU_MPS_CONFIG", &config_path)
            .status()?;
        ensure!(status.success(), "{} failed", program.display());
        Ok(start.elapsed())
    };
    let bundle_arg = bundle.display().to_string();
    let (mut shim_times, mut true_times) = (Vec::new(), Vec::new());
    for _ in 0..200 {
        shim_times.push(exec(shim, &["create", "--bundle", &bundle_arg, "bench"])?);
        true_times.push(exec(Path::new("/bin/true"), &[])?);
    }
    let (s, t) = (median(shim_times), median(true_times));
    println!("\n### gpu-mps-shim time per create (GPU container), 200 runs");
    println!("| what | median |\n|---|---|");
    println!(
        "| plan_rewrite in process (parse, resolve, rewrite, serialize) | {:.1} µs |",
        in_process.as_secs_f64() * 1e6
    );
    println!(
        "| shim binary: exec to exec of runc (runc = /bin/true) | {:.2} ms |",
        ms(s)
    );
    println!("| exec of /bin/true alone | {:.2} ms |", ms(t));
    println!(
        "| the shim's own time per create (difference) | {:.2} ms |",
        ms(s.saturating_sub(t))
    );
    Ok(())
}

const CONCURRENT: usize = 32;
const CONCURRENT_ROUNDS: usize = 6;

/// Part 3: create+start latency of `CONCURRENT` containers at once, runc against gpu-mps.
async fn concurrent_create_latency(suite: &suites::Suite) -> Result<()> {
    use gpu_mps_e2e::containerd::{GPU_MPS_HANDLER, RUNC_HANDLER};
    use gpu_mps_e2e::image::TEST_IMAGE;
    use gpu_mps_e2e::{ContainerSpec, PodSpec};
    const CLASSES: [(&str, u8); 4] = [("256Mi", 10), ("384Mi", 20), ("512Mi", 30), ("256Mi", 50)];
    let node = GpuNode::start(suite, LimitsConfig::exact()).await?;
    let mut cri = node.cri().await?;
    let gpu = node.gpu_uuid(0).to_string();
    // As many pods for each: containerd orders some work per sandbox.
    let (mut runc_pods, mut gpu_pods) = (Vec::new(), Vec::new());
    for (c, (memory, threads)) in CLASSES.iter().enumerate() {
        let spec = PodSpec::new(&format!("bench-runc-{c}"), "default", RUNC_HANDLER);
        runc_pods.push(cri.run_pod_sandbox(&spec).await?);
        let spec =
            PodSpec::new(&format!("bench-gpu-{c}"), "default", GPU_MPS_HANDLER).gpu_limits(memory, *threads);
        gpu_pods.push(cri.run_pod_sandbox(&spec).await?);
    }
    let mut latencies: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    for round in 0..CONCURRENT_ROUNDS {
        // Which goes first alternates: a round's deletes can linger into the next creates.
        let order = if round % 2 == 0 {
            [(0, false), (1, true)]
        } else {
            [(1, true), (0, false)]
        };
        for (variant, with_gpu) in order {
            let creates = (0..CONCURRENT).map(|i| {
                let (node, gpu, runc_pods, gpu_pods) = (&node, &gpu, &runc_pods, &gpu_pods);
                async move {
                    let mut cri = node.containerd.cri().await?;
                    let mut spec = ContainerSpec::new(&format!("r{round}-v{variant}-c{i}"), TEST_IMAGE)
                        .command(&["/checker"])
                        .args(&["pause"]);
                    let pod = if with_gpu {
                        spec = spec.gpu(gpu);
                        &gpu_pods[i % gpu_pods.len()]
                    } else {
                        &runc_pods[i % runc_pods.len()]
                    };
                    let t = Instant::now();
                    let container = cri.create_container(pod, &spec).await?;
                    cri.start_container(&container).await?;
                    Ok::<_, anyhow::Error>((container, t.elapsed()))
                }
            });
            let created = gpu_mps_e2e::concurrent::all_ok(creates).await?;
            for (container, elapsed) in created {
                latencies[variant].push(elapsed);
                cri.delete_container(&container).await?;
            }
        }
    }
    let pick = |xs: &mut Vec<Duration>, p: f64| {
        xs.sort();
        xs[((xs.len() as f64 - 1.0) * p).round() as usize]
    };
    let [mut runc, mut gpu_mps] = latencies;
    let n = runc.len();
    let (r50, r99) = (pick(&mut runc, 0.5), pick(&mut runc, 0.99));
    let (g50, g99) = (pick(&mut gpu_mps, 0.5), pick(&mut gpu_mps, 0.99));
    println!(
        "\n### {CONCURRENT} concurrent CRI creates+starts, {CONCURRENT_ROUNDS} alternating rounds ({n} containers each)\n{suite}"
    );
    println!("| variant | p50 | p99 |\n|---|---|---|");
    println!("| runc | {:.0} ms | {:.0} ms |", ms(r50), ms(r99));
    println!(
        "| gpu-mps (GPU, exact, 4 classes) | {:.0} ms | {:.0} ms |",
        ms(g50),
        ms(g99)
    );
    println!(
        "| ratio gpu-mps / runc | {:.3} | {:.3} |",
        ms(g50) / ms(r50),
        ms(g99) / ms(r99)
    );
    Ok(())
}

fn main() -> Result<()> {
    // `cargo bench` passes --bench; plain filters are not supported by this harness.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let suites = suites::discover()?;
    let mut shim = None;
    let bins = gpu_mps_e2e::binaries::Binaries::locate()?;
    println!(
        "binaries: shim {}, hook {}",
        bins.shim.display(),
        bins.hook.display()
    );
    for suite in suites {
        runtime.block_on(ctr_run_overhead(suite))?;
        runtime.block_on(concurrent_create_latency(suite))?;
        shim.get_or_insert_with(|| gpu_mps_e2e::binaries::Binaries::locate().map(|b| b.shim));
    }
    let shim = shim.context("no containerd suite fetched: run tests/support/fetch-containerd.sh")??;
    shim_time_per_create(&shim)
}
