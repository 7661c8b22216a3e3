//! gpu-mps-manager's Prometheus metrics (docs/metrics.md), scraped over HTTP from the real
//! binary with the fake MPS control daemon, after real Acquires, refusals and CUDA clients
//! through a gate: the values must be what happened, the text must pass `promtool check
//! metrics` (Debian 12's prometheus package), the Grafana dashboard must query only metrics
//! that exist, and a manager without `[metrics] listen` must open no port.
//!
//! Needs the workspace binaries and the static checker (see tests/e2e/README.md), and promtool:
//! `bash tests/support/fetch-promtool.sh` puts it in $GPU_MPS_CACHE; without it the promtool
//! check is skipped with a line saying so, unless GPU_MPS_REQUIRE_PROMTOOL=1 (tests/metrics.sh).
//! No containerd is involved: the Acquires are made as the hook makes them.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use gpu_mps_api::client::{ClientError, ManagerConnection};
use gpu_mps_api::proto;
use gpu_mps_e2e::manager::{FAKE_GPU_MEMORY, fake_gpus};
use gpu_mps_e2e::{Binaries, LimitsConfig, Manager};

/// Where promtool is, when not in $GPU_MPS_CACHE/promtool (tests/support/fetch-promtool.sh).
const PROMTOOL_ENV: &str = "GPU_MPS_PROMTOOL";
/// Set (tests/metrics.sh): a missing promtool fails the test instead of skipping its check.
const REQUIRE_PROMTOOL_ENV: &str = "GPU_MPS_REQUIRE_PROMTOOL";
const GIB: u64 = 1 << 30;
/// The runc path in the node config: no container is run, so it is never executed.
const UNUSED_RUNC: &str = "/usr/sbin/runc";

/// A process of the test, killed on drop (also when the test fails half-way).
struct KilledOnDrop(Child);

/// A stand-in for a container's init process: a lease follows its pid.
struct FakeContainer(KilledOnDrop);

impl FakeContainer {
    fn start() -> Result<Self> {
        Ok(FakeContainer(KilledOnDrop(
            Command::new("sleep").arg("600").spawn()?,
        )))
    }

    fn pid(&self) -> u32 {
        self.0.0.id()
    }
}

impl Drop for KilledOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A port nothing listens on now.
fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn metrics_config(port: u16) -> LimitsConfig {
    LimitsConfig::uniform().toml(&format!("\n[metrics]\nlisten = \"127.0.0.1:{port}\"\n"))
}

/// An Acquire as gpu-mps-hook sends it (blocking: the manager is another process).
fn acquire(
    manager: &Manager,
    container_id: &str,
    gpu: &str,
    memory: u64,
    threads: u32,
    pid: u32,
) -> Result<proto::AcquireResponse, ClientError> {
    let connection = ManagerConnection::connect(&manager.config().manager_socket(), Duration::from_secs(10))?;
    let mut req = proto::AcquireRequest::new();
    req.container_id = container_id.into();
    req.gpu_uuids = vec![gpu.into()];
    req.memory_limit_bytes = memory;
    req.active_thread_percentage = threads;
    req.namespace = "metrics-test".into();
    req.pod = format!("pod-{container_id}");
    req.container_name = "main".into();
    req.pid = pid;
    req.cuda_processes = 1;
    connection.acquire(&req)
}

/// `GET /metrics` on a new connection: the response head and body.
fn scrape(port: u16, accept: Option<&str>) -> Result<(String, String)> {
    let address: SocketAddr = ([127, 0, 0, 1], port).into();
    let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(5))
        .with_context(|| format!("connecting to the metrics on {address}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let accept = accept.map(|a| format!("Accept: {a}\r\n")).unwrap_or_default();
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {address}\r\n{accept}Connection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .with_context(|| format!("no HTTP response: {response:?}"))?;
    ensure!(head.starts_with("HTTP/1.1 200"), "metrics answered {head}");
    Ok((head.to_string(), body.to_string()))
}

/// The samples of a scrape in the Prometheus text format, by `name{labels}` as printed.
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_string(), value.parse().ok()?))
        })
        .collect()
}

fn value(samples: &BTreeMap<String, f64>, series: &str) -> Result<f64> {
    samples
        .get(series)
        .copied()
        .with_context(|| format!("no sample {series} in the scrape: {samples:#?}"))
}

/// The metric names a query can use: each family of a `# TYPE` line, with a histogram's
/// `_bucket`, `_sum` and `_count`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let Some((name, kind)) = rest.split_once(' ') else {
            continue;
        };
        names.insert(name.to_string());
        if kind == "histogram" {
            for suffix in ["_bucket", "_sum", "_count"] {
                names.insert(format!("{name}{suffix}"));
            }
        }
    }
    names
}

/// promtool from $GPU_MPS_PROMTOOL, the cache of tests/support/fetch-promtool.sh, or PATH.
fn promtool() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os(PROMTOOL_ENV).filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(path));
    }
    let cache = std::env::var_os("GPU_MPS_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/gpu-mps")))?;
    let cached = cache.join("promtool/usr/bin/promtool");
    if cached.is_file() {
        return Some(cached);
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join("promtool"))
        .find(|p| p.is_file())
}

/// `promtool check metrics` on `text`: what it printed, or an error with it.
fn promtool_check(text: &str) -> Result<()> {
    let Some(promtool) = promtool() else {
        ensure!(
            std::env::var_os(REQUIRE_PROMTOOL_ENV).is_none(),
            "promtool not found ({PROMTOOL_ENV}, $GPU_MPS_CACHE/promtool, PATH) and {REQUIRE_PROMTOOL_ENV} is set: run tests/support/fetch-promtool.sh"
        );
        println!(
            "SKIPPED the promtool check: promtool not found (run tests/support/fetch-promtool.sh, or set {PROMTOOL_ENV})"
        );
        return Ok(());
    };
    let version = Command::new(&promtool).arg("--version").output()?;
    let version = String::from_utf8_lossy(&version.stdout);
    println!(
        "{}",
        version.lines().next().unwrap_or("promtool, version unknown")
    );
    let mut child = Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {}", promtool.display()))?;
    child
        .stdin
        .take()
        .context("promtool's stdin")?
        .write_all(text.as_bytes())?;
    let out = child.wait_with_output()?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        out.status.success(),
        "promtool check metrics failed ({}): {said}\nthe scrape:\n{text}",
        out.status
    );
    println!(
        "promtool check metrics: passed{}",
        if said.trim().is_empty() {
            String::new()
        } else {
            format!(": {said}")
        }
    );
    Ok(())
}

/// Runs the static checker as a fake CUDA client on a container's gate, and reads its line
/// (printed once it holds its channel). It holds the channel until killed.
fn cuda_client(bins: &Binaries, gate: &Path) -> Result<(KilledOnDrop, String)> {
    let mut child = Command::new(&bins.checker)
        .args(["mps-client", "--hold-seconds", "60"])
        .env("CUDA_MPS_PIPE_DIRECTORY", gate)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the checker as a CUDA client")?;
    let stdout = child.stdout.take().context("the checker's stdout")?;
    let child = KilledOnDrop(child);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    Ok((child, line))
}

/// The manager process's listening TCP ports: its socket descriptors matched against the
/// kernel's table of listening sockets.
fn tcp_listen_ports(pid: u32) -> Result<Vec<u16>> {
    let mut inodes = BTreeSet::new();
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let Ok(target) = std::fs::read_link(fd?.path()) else {
            continue;
        };
        let target = target.to_string_lossy().into_owned();
        if let Some(inode) = target.strip_prefix("socket:[").and_then(|s| s.strip_suffix(']')) {
            inodes.insert(inode.to_string());
        }
    }
    let mut ports = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // local_address is fields[1] (ADDR:PORT in hex), st fields[3] (0A = LISTEN), inode fields[9].
            if fields.len() > 9 && fields[3] == "0A" && inodes.contains(fields[9]) {
                let port = fields[1].rsplit(':').next().unwrap_or("0");
                ports.push(u16::from_str_radix(port, 16)?);
            }
        }
    }
    Ok(ports)
}

async fn in_time<T>(what: &str, body: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    tokio::time::timeout(Duration::from_secs(120), body)
        .await
        .with_context(|| format!("{what}: not done within 120 s"))?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_counts_what_the_manager_did_and_passes_promtool() -> Result<()> {
    in_time("the scrape test", async {
        let bins = Binaries::locate()?;
        let port = free_port()?;
        let manager = Manager::start(
            &bins,
            Path::new(UNUSED_RUNC),
            &metrics_config(port),
            fake_gpus(2, FAKE_GPU_MEMORY),
        )
        .await?;
        let (gpu0, gpu1) = (manager.gpu_uuid(0).to_string(), manager.gpu_uuid(1).to_string());
        let a = FakeContainer::start()?;
        let b = FakeContainer::start()?;
        acquire(&manager, "metrics-a", &gpu0, 4 * GIB, 25, a.pid())?;
        acquire(&manager, "metrics-b", &gpu0, 4 * GIB, 25, b.pid())?;
        // Under uniform, another class on a busy GPU; then more memory than a GPU has.
        let busy = acquire(&manager, "metrics-c", &gpu0, 2 * GIB, 10, b.pid()).unwrap_err();
        ensure!(busy.to_string().contains("limit class"), "{busy}");
        let full = acquire(&manager, "metrics-d", &gpu1, 17 * GIB, 10, b.pid()).unwrap_err();
        ensure!(full.to_string().contains("reserved"), "{full}");
        // A CUDA client through a's gate, and a UI session that the gate refuses.
        let (client, line) = cuda_client(&bins, &manager.gate_dir("metrics-a"))?;
        ensure!(
            line.contains("\"admitted\":true"),
            "the CUDA client was not admitted: {line}"
        );
        let ui = Command::new(&bins.checker)
            .args(["mps-ui", "get_server_list"])
            .env("CUDA_MPS_PIPE_DIRECTORY", manager.gate_dir("metrics-b"))
            .output()?;
        println!(
            "mps-ui through the gate: {}",
            String::from_utf8_lossy(&ui.stdout).trim()
        );

        let (head, text) = scrape(port, None)?;
        println!("{head}\n{text}");
        ensure!(
            head.to_ascii_lowercase()
                .contains("content-type: text/plain; version=0.0.4"),
            "{head}"
        );
        promtool_check(&text)?;
        let s = samples(&text);
        let gpu = |name: &str, uuid: &str| format!("{name}{{gpu=\"{uuid}\"}}");
        let daemon0 = format!("{{daemon=\"{gpu0}\"}}");
        ensure!(
            value(
                &s,
                r#"gpu_mps_acquire_duration_seconds_count{outcome="acquired"}"#
            )? == 2.0
        );
        ensure!(value(&s, r#"gpu_mps_acquire_duration_seconds_count{outcome="refused"}"#)? == 2.0);
        ensure!(value(&s, r#"gpu_mps_lease_refusals_total{reason="class_busy"}"#)? == 1.0);
        ensure!(value(&s, r#"gpu_mps_lease_refusals_total{reason="memory_capacity"}"#)? == 1.0);
        ensure!(value(&s, r#"gpu_mps_lease_refusals_total{reason="tenant_busy"}"#)? == 0.0);
        ensure!(value(&s, &format!("gpu_mps_leases{daemon0}"))? == 2.0);
        ensure!(value(&s, "gpu_mps_leases_pending")? == 0.0);
        ensure!(value(&s, r#"gpu_mps_daemons{state="running"}"#)? == 1.0);
        ensure!(
            value(
                &s,
                &format!("gpu_mps_daemon_starts_total{{daemon=\"{gpu0}\",how=\"started\"}}")
            )? == 1.0
        );
        ensure!(value(&s, &gpu("gpu_mps_gpu_memory_allocated_bytes", &gpu0))? == (8 * GIB) as f64);
        ensure!(value(&s, &gpu("gpu_mps_gpu_memory_capacity_bytes", &gpu0))? == FAKE_GPU_MEMORY as f64);
        ensure!(value(&s, &gpu("gpu_mps_gpu_memory_allocated_bytes", &gpu1))? == 0.0);
        ensure!(value(&s, &gpu("gpu_mps_gpu_threads_allocated_percent", &gpu0))? == 50.0);
        ensure!(value(&s, &gpu("gpu_mps_gpu_clients_allocated", &gpu0))? == 2.0);
        ensure!(value(&s, &gpu("gpu_mps_gpu_clients_capacity", &gpu0))? == 48.0);
        ensure!(value(&s, &gpu("gpu_mps_gpu_unhealthy", &gpu0))? == 0.0);
        // The client's process holds its channels: one client on the server.
        ensure!(value(&s, &format!("gpu_mps_server_clients{daemon0}"))? == 1.0);
        // A CUDA context takes two channels: two admissions for the one client.
        ensure!(value(&s, "gpu_mps_gate_admission_wait_seconds_count")? == 2.0);
        ensure!(value(&s, r#"gpu_mps_gate_refusals_total{reason="not_a_cuda_client"}"#)? == 1.0);
        ensure!(value(&s, &format!("gpu_mps_gate_connections_waiting{daemon0}"))? == 0.0);
        // Every GPU's daemon series are there from the start, at 0.
        ensure!(
            value(
                &s,
                &format!("gpu_mps_daemon_start_failures_total{{daemon=\"{gpu1}\"}}")
            )? == 0.0
        );
        ensure!(
            value(
                &s,
                &format!("gpu_mps_server_faults_total{{daemon=\"{gpu0}\",kind=\"gpu_fault\"}}")
            )? == 0.0
        );
        // Never a container id or a pid as a label.
        for series in s.keys() {
            ensure!(
                !series.contains("metrics-a") && !series.contains(&a.pid().to_string()),
                "{series}"
            );
        }

        // OpenMetrics for a scraper that asks for it, as Prometheus does.
        let (head, open) = scrape(
            port,
            Some("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"),
        )?;
        ensure!(
            head.to_ascii_lowercase()
                .contains("content-type: application/openmetrics-text"),
            "{head}"
        );
        ensure!(open.ends_with("# EOF\n"), "{open}");

        // What a scrape costs, with the two leases and then 40 more.
        let (per_scrape, bytes) = time_scrapes(port)?;
        println!("scrape with 2 leases: {per_scrape:?} each on average over 50, {bytes} bytes");
        let many = FakeContainer::start()?;
        for i in 0..40 {
            acquire(
                &manager,
                &format!("metrics-many-{i}"),
                &gpu1,
                256 << 20,
                2,
                many.pid(),
            )?;
        }
        let (per_scrape, bytes) = time_scrapes(port)?;
        println!("scrape with 42 leases: {per_scrape:?} each on average over 50, {bytes} bytes");
        ensure!(
            per_scrape < Duration::from_millis(250),
            "a scrape took {per_scrape:?}"
        );
        drop(client);
        Ok(())
    })
    .await
}

/// The mean time of 50 scrapes, each on a new connection, and the size of the last.
fn time_scrapes(port: u16) -> Result<(Duration, usize)> {
    let started = Instant::now();
    let mut bytes = 0;
    for _ in 0..50 {
        bytes = scrape(port, None)?.1.len();
    }
    Ok((started.elapsed() / 50, bytes))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grafana_dashboard_queries_only_metrics_a_scrape_has() -> Result<()> {
    in_time("the dashboard test", async {
        let bins = Binaries::locate()?;
        let port = free_port()?;
        let manager = Manager::start(&bins, Path::new(UNUSED_RUNC), &metrics_config(port), fake_gpus(1, FAKE_GPU_MEMORY)).await?;
        let a = FakeContainer::start()?;
        acquire(&manager, "dash-a", manager.gpu_uuid(0), 4 * GIB, 25, a.pid())?;
        let names = metric_names(&scrape(port, None)?.1);
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/grafana/gpu-mps.json");
        let dashboard: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)
            .with_context(|| format!("{} is not JSON", path.display()))?;
        let mut exprs = Vec::new();
        collect_exprs(&dashboard, &mut exprs);
        ensure!(exprs.len() >= 8, "only {} queries in {}", exprs.len(), path.display());
        let mut used = BTreeSet::new();
        for expr in &exprs {
            let found = metric_names_in(expr);
            ensure!(!found.is_empty(), "query {expr:?} uses no gpu_mps metric");
            for name in found {
                if !names.contains(&name) {
                    bail!("the dashboard queries {name} ({expr:?}), which the manager does not export; it exports {names:?}");
                }
                used.insert(name);
            }
        }
        println!("{} queries, metrics used: {used:?}", exprs.len());
        Ok(())
    })
    .await
}

/// Every `expr` string in the dashboard JSON, at any depth.
fn collect_exprs(value: &serde_json::Value, into: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, v) in map {
                match (key.as_str(), v) {
                    ("expr", serde_json::Value::String(expr)) => into.push(expr.clone()),
                    _ => collect_exprs(v, into),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| collect_exprs(v, into)),
        _ => {}
    }
}

/// The `gpu_mps_*` names in a PromQL expression.
fn metric_names_in(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(at) = expr[i..].find("gpu_mps_") {
        let start = i + at;
        let starts_a_word =
            start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let end = expr[start..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(expr.len(), |n| start + n);
        if starts_a_word {
            names.insert(expr[start..end].to_string());
        }
        i = end;
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_key_the_manager_opens_no_port() -> Result<()> {
    in_time("the port test", async {
        let bins = Binaries::locate()?;
        let without = Manager::start(
            &bins,
            Path::new(UNUSED_RUNC),
            &LimitsConfig::uniform(),
            fake_gpus(1, FAKE_GPU_MEMORY),
        )
        .await?;
        let pid = without.pid().context("the manager's pid")?;
        let ports = tcp_listen_ports(pid)?;
        ensure!(
            ports.is_empty(),
            "a manager without [metrics] listens on TCP ports {ports:?}"
        );
        // The same look finds the port of one that has the key.
        let port = free_port()?;
        let with = Manager::start(
            &bins,
            Path::new(UNUSED_RUNC),
            &metrics_config(port),
            fake_gpus(1, FAKE_GPU_MEMORY),
        )
        .await?;
        let ports = tcp_listen_ports(with.pid().context("the manager's pid")?)?;
        ensure!(
            ports == vec![port],
            "a manager with [metrics] listen = 127.0.0.1:{port} listens on {ports:?}"
        );
        Ok(())
    })
    .await
}
