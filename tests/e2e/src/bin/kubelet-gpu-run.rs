//! The schedule-by-size run on a real GPU (tests/gpu/schedule.sh runs it): the test kubelet
//! drives gpu-mps-device-plugin, then containerd's CRI with the `gpu-mps` handler, then real
//! MPS. Pods of three sizes are placed by units and each is checked against its allocation; then
//! the same pods run a small PyTorch model under three regimes, from one start time:
//!   mps-2x     gpu-mps, the default thread cap (2 x the memory share)
//!   mps-1x     gpu-mps, the cap at the fair share (pod annotation)
//!   timeslice  the same GPU and devices through plain runc: no MPS, no limits
//! One JSON line per pod per regime in $OUT/schedule.jsonl, written as they come.
//!
//! Environment: GPU_MPS_CACHE (the unpacked containerd suite), GPU_MPS_CONFIG (the node config
//! the manager runs with), BIN_DIR (gpu-mps binaries and gpu-mps-checker), KUBELET_DIR, OUT,
//! HOST_MOUNTS (host dirs bound read-only at the same path, comma-separated), CHECK_DIR (bound
//! at /check), PYTHON, SIZES (units per pod, default 8,8,8,16,16,24,24), SECONDS (default 15).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpu_mps_api::annotations::ACTIVE_THREAD_PERCENTAGE;
use gpu_mps_e2e::binaries::Binaries;
use gpu_mps_e2e::containerd::{Containerd, ContainerdOptions, GPU_MPS_HANDLER};
use gpu_mps_e2e::cri::{Container, Pod, stdout_lines};
use gpu_mps_e2e::image::TEST_IMAGE;
use gpu_mps_e2e::kubelet::{DeviceManager, PluginProcess, TestKubelet, apply_allocation};
use gpu_mps_e2e::{ContainerSpec, PodSpec, Suite};
use k8s_cri::v1 as cri;

fn env(name: &str) -> Result<String> {
    std::env::var(name).with_context(|| format!("{name} is not set"))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let bin_dir = PathBuf::from(env("BIN_DIR")?);
    let config = PathBuf::from(env("GPU_MPS_CONFIG")?);
    let kubelet_dir = PathBuf::from(env("KUBELET_DIR")?);
    let out = PathBuf::from(env("OUT")?);
    let mounts: Vec<String> = env("HOST_MOUNTS")?.split(',').map(str::to_string).collect();
    let check_dir = env("CHECK_DIR")?;
    let python = env("PYTHON")?;
    let sizes: Vec<usize> = std::env::var("SIZES")
        .unwrap_or_else(|_| "8,8,8,16,16,24,24".into())
        .split(',')
        .map(|s| s.parse().context("SIZES"))
        .collect::<Result<_>>()?;
    let seconds: f64 = std::env::var("SECONDS").unwrap_or_else(|_| "15".into()).parse()?;
    let p = |name: &str| bin_dir.join(name);
    let bins = Binaries {
        shim: p("gpu-mps-shim"),
        hook: p("gpu-mps-hook"),
        manager: p("gpu-mps-manager"),
        cli: p("gpu-mps"),
        device_plugin: p("gpu-mps-device-plugin"),
        fake_mps_control: PathBuf::from("/nonexistent"),
        checker: p("gpu-mps-checker"),
    };
    let suite = Suite::for_test("trixie")?.context("no trixie suite under GPU_MPS_CACHE")?;
    println!("{suite}");
    let containerd = Containerd::start(
        &suite,
        ContainerdOptions {
            gpu_mps_config: Some(config.clone()),
            gpu_mps_shim: Some(bins.shim.clone()),
            ..Default::default()
        },
    )
    .await?;
    let mut cri = containerd.cri().await?;
    containerd.import_test_image(&bins.checker).await?;

    std::fs::create_dir_all(&kubelet_dir)?;
    let mut kubelet = TestKubelet::start(&kubelet_dir)?;
    let plugin = PluginProcess::start(
        &bins,
        &config,
        &kubelet_dir,
        Path::new("/dev"),
        &[PathBuf::from("/etc/cdi"), PathBuf::from("/var/run/cdi")],
    )?;
    let registration = kubelet.registration().await?;
    let mut link = kubelet.plugin(&registration).await?;
    link.watch_until("devices listed", Duration::from_secs(20), |d| !d.is_empty())
        .await?;
    let per_gpu = link.devices.len();
    println!(
        "registered {} ({}); {per_gpu} units listed, all healthy: {}",
        registration.resource_name,
        registration.endpoint,
        link.devices.values().all(|h| h == "Healthy")
    );
    let mut results = std::fs::File::create(out.join("schedule.jsonl"))?;
    writeln!(
        results,
        "{}",
        serde_json::json!({"units_listed": per_gpu, "sizes": sizes, "containerd": suite.containerd_version})
    )?;

    // kubelet's allocation, once: every regime runs the same pods on the same units.
    let mut devices = DeviceManager::default();
    let mut allocations = Vec::new();
    for (i, size) in sizes.iter().enumerate() {
        let name = format!("p{i}-{size}u");
        let allocated = devices.allocate(&mut link, &name, *size).await?;
        allocations.push((name, *size, allocated));
    }
    for regime in ["mps-2x", "mps-1x", "timeslice"] {
        let start_at = now() + 20.0;
        let mut running: Vec<(Pod, Container, String, usize)> = Vec::new();
        for (name, size, allocated) in &allocations {
            let handler = if regime == "timeslice" {
                "runc"
            } else {
                GPU_MPS_HANDLER
            };
            let mut pod = PodSpec::new(&format!("{regime}-{name}"), "default", handler);
            if regime == "mps-1x" {
                let fair = (*size as f64 / per_gpu as f64 * 100.0).ceil().max(1.0) as u8;
                pod = pod.annotation(ACTIVE_THREAD_PERCENTAGE, &fair.to_string());
            }
            let expect_mib = if regime == "timeslice" { 0 } else { size * 1024 };
            let mut spec = ContainerSpec::new(name, TEST_IMAGE)
                .command(&[&python])
                .args(&[
                    "/check/slice-model.py",
                    &format!("{regime}/{name}"),
                    &format!("{start_at:.3}"),
                    &seconds.to_string(),
                    &expect_mib.to_string(),
                ])
                .env("HOME", "/tmp")
                .env("PYTHONDONTWRITEBYTECODE", "1");
            for dir in &mounts {
                spec.mounts.push(host_mount(dir, dir));
            }
            spec.mounts.push(host_mount(&check_dir, "/check"));
            let spec = apply_allocation(spec, &allocated.response);
            let pod = cri.run_pod_sandbox(&pod).await?;
            let started = Instant::now();
            let container = cri.create_container(&pod, &spec).await;
            let container = match container {
                Ok(c) => c,
                Err(s) => bail!("{regime} {name}: CreateContainer: {}", s.message()),
            };
            if let Err(s) = cri.start_container(&container).await {
                bail!("{regime} {name}: StartContainer: {}", s.message());
            }
            println!(
                "{regime} {name}: {size} units on {} started in {:.2} s",
                allocated
                    .ids
                    .first()
                    .map(|id| id.rsplit_once("-m").map_or("", |(g, _)| g))
                    .unwrap_or(""),
                started.elapsed().as_secs_f64()
            );
            running.push((pod, container, name.clone(), *size));
        }
        let mut total = 0.0;
        let mut by_size: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
        for (pod, container, name, size) in &running {
            let code = cri
                .wait_exit(container, Duration::from_secs(180))
                .await
                .unwrap_or(-1);
            let lines = stdout_lines(&container.log_path).unwrap_or_default();
            let json = lines
                .iter()
                .rev()
                .find(|l| l.starts_with('{'))
                .cloned()
                .unwrap_or_default();
            let mut value: serde_json::Value =
                serde_json::from_str(&json).unwrap_or(serde_json::json!({"raw": lines}));
            value["regime"] = regime.into();
            value["units"] = (*size).into();
            value["exit_code"] = code.into();
            writeln!(results, "{value}")?;
            results.flush()?;
            let it_s = value["it_s"].as_f64().unwrap_or(0.0);
            total += it_s;
            by_size.entry(*size).or_default().push(it_s);
            println!("{regime} {name}: {value}");
            cri.delete_container(container).await.ok();
            cri.delete_pod(pod).await.ok();
        }
        let summary = serde_json::json!({"regime": regime, "total_it_s": (total * 100.0).round() / 100.0, "by_size": by_size});
        println!("== {summary}");
        writeln!(results, "{summary}")?;
        // Let the idle daemon stop before the next regime (time-slicing must run without MPS).
        tokio::time::sleep(Duration::from_secs(4)).await;
    }
    drop(plugin);
    let _ = std::fs::copy(containerd.log_path(), out.join("containerd.log"));
    Ok(())
}

fn host_mount(host: &str, container: &str) -> cri::Mount {
    cri::Mount {
        container_path: container.into(),
        host_path: host.into(),
        readonly: true,
        ..Default::default()
    }
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}
