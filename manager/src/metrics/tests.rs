use std::sync::Arc;

use gpu_mps_api::DaemonKey;
use hyper::{Method, StatusCode};

use super::http::respond;
use super::*;

struct Fixed(NodeLevels);

impl LevelSource for Fixed {
    fn node_levels(&self) -> NodeLevels {
        self.0.clone()
    }
}

fn levels() -> NodeLevels {
    NodeLevels {
        version: "0.1.0".into(),
        policy: "exact".into(),
        tenancy: "shared".into(),
        gpus: vec![GpuLevels {
            uuid: "GPU-1".into(),
            index: 0,
            name: "Fake GPU".into(),
            memory_bytes: 16 << 30,
            memory_capacity_bytes: 16 << 30,
            memory_allocated_bytes: 6 << 30,
            threads_allocated_percent: 75,
            clients_allocated: 3,
            clients_capacity: 48,
            leases: 2,
            unhealthy: false,
        }],
        daemons: vec![
            DaemonLevels {
                daemon: "GPU-1".into(),
                state: "running",
                leases: 2,
                clients: 1,
            },
            DaemonLevels {
                daemon: "GPU-2".into(),
                state: "idle",
                leases: 0,
                clients: 0,
            },
        ],
        leases_pending: 1,
        gate_connections_open: 4,
    }
}

fn sample(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name_and_labels)?.strip_prefix(' ')?.parse().ok())
}

#[test]
fn a_scrape_shows_recorded_events_and_the_levels_of_the_books() {
    let metrics = Metrics::default();
    let source: Arc<dyn LevelSource> = Arc::new(Fixed(levels()));
    let exposition = Exposition::new(&metrics, Arc::downgrade(&source));
    let gpu = DaemonKey::new(vec!["GPU-1".to_string()]);
    metrics.acquire_finished(Duration::from_millis(3), AcquireOutcome::Acquired);
    metrics.acquire_finished(
        Duration::from_millis(1),
        AcquireOutcome::Refused("memory_capacity"),
    );
    metrics.acquire_finished(Duration::from_secs(2), AcquireOutcome::Failed);
    metrics.gate_admitted(Duration::from_micros(300));
    metrics.gate_refused(GateRefusal::NotACudaClient);
    metrics.daemon_started(&gpu, DaemonStart::Started);
    metrics.daemon_started(&gpu, DaemonStart::Restarted);
    metrics.daemon_start_failed(&gpu);
    metrics.server_fault(&gpu, ServerFault::GpuFault);
    let waiting = metrics.gate_connection_waits(&gpu);

    let text = exposition.encode(Format::PrometheusText).unwrap();
    let at = |s: &str| sample(&text, s).unwrap_or_else(|| panic!("no sample {s} in:\n{text}"));
    assert_eq!(
        at(r#"gpu_mps_acquire_duration_seconds_count{outcome="acquired"}"#),
        1.0
    );
    assert_eq!(
        at(r#"gpu_mps_acquire_duration_seconds_count{outcome="refused"}"#),
        1.0
    );
    assert_eq!(
        at(r#"gpu_mps_acquire_duration_seconds_bucket{outcome="acquired",le="0.005"}"#),
        1.0
    );
    assert_eq!(
        at(r#"gpu_mps_acquire_duration_seconds_count{outcome="failed"}"#),
        1.0
    );
    assert_eq!(
        at(r#"gpu_mps_lease_refusals_total{reason="memory_capacity"}"#),
        1.0
    );
    // Every known reason is there from the start, at 0.
    assert_eq!(at(r#"gpu_mps_lease_refusals_total{reason="class_busy"}"#), 0.0);
    assert_eq!(
        at(r#"gpu_mps_gate_refusals_total{reason="not_a_cuda_client"}"#),
        1.0
    );
    assert_eq!(at(r#"gpu_mps_gate_refusals_total{reason="blocked"}"#), 0.0);
    assert_eq!(at("gpu_mps_gate_admission_wait_seconds_count"), 1.0);
    assert_eq!(
        at(r#"gpu_mps_gate_admission_wait_seconds_bucket{le="0.0005"}"#),
        1.0
    );
    assert_eq!(at(r#"gpu_mps_gate_connections_waiting{daemon="GPU-1"}"#), 1.0);
    assert_eq!(
        at(r#"gpu_mps_daemon_starts_total{daemon="GPU-1",how="restarted"}"#),
        1.0
    );
    assert_eq!(at(r#"gpu_mps_daemon_start_failures_total{daemon="GPU-1"}"#), 1.0);
    assert_eq!(
        at(r#"gpu_mps_server_faults_total{daemon="GPU-1",kind="gpu_fault"}"#),
        1.0
    );
    assert_eq!(
        at(r#"gpu_mps_manager_info{version="0.1.0",policy="exact",tenancy="shared"}"#),
        1.0
    );
    assert_eq!(
        at(r#"gpu_mps_gpu_info{gpu="GPU-1",index="0",name="Fake GPU"}"#),
        1.0
    );
    assert_eq!(
        at(r#"gpu_mps_gpu_memory_allocated_bytes{gpu="GPU-1"}"#),
        (6u64 << 30) as f64
    );
    assert_eq!(at(r#"gpu_mps_gpu_threads_allocated_percent{gpu="GPU-1"}"#), 75.0);
    assert_eq!(at(r#"gpu_mps_gpu_clients_allocated{gpu="GPU-1"}"#), 3.0);
    assert_eq!(at(r#"gpu_mps_gpu_clients_capacity{gpu="GPU-1"}"#), 48.0);
    assert_eq!(at(r#"gpu_mps_gpu_unhealthy{gpu="GPU-1"}"#), 0.0);
    assert_eq!(at(r#"gpu_mps_daemons{state="running"}"#), 1.0);
    assert_eq!(at(r#"gpu_mps_daemons{state="idle"}"#), 1.0);
    assert_eq!(at(r#"gpu_mps_leases{daemon="GPU-1"}"#), 2.0);
    assert_eq!(at("gpu_mps_leases_pending"), 1.0);
    assert_eq!(at(r#"gpu_mps_server_clients{daemon="GPU-1"}"#), 1.0);
    assert_eq!(at("gpu_mps_gate_connections_open"), 4.0);
    // Counters are named with their suffix in the Prometheus text format, as its parsers want.
    assert!(
        text.contains("# TYPE gpu_mps_lease_refusals_total counter\n"),
        "{text}"
    );

    drop(waiting);
    let text = exposition.encode(Format::PrometheusText).unwrap();
    assert_eq!(
        sample(&text, r#"gpu_mps_gate_connections_waiting{daemon="GPU-1"}"#),
        Some(0.0)
    );
}

#[test]
fn open_metrics_for_prometheus_and_the_text_format_for_everyone_else() {
    // What Prometheus 2.x sends.
    let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
    assert_eq!(Format::from_accept(Some(prometheus)), Format::OpenMetrics);
    assert_eq!(Format::from_accept(Some("*/*")), Format::PrometheusText);
    assert_eq!(Format::from_accept(None), Format::PrometheusText);
    let metrics = Metrics::default();
    let source: Arc<dyn LevelSource> = Arc::new(Fixed(levels()));
    let exposition = Exposition::new(&metrics, Arc::downgrade(&source));
    let open = exposition.encode(Format::OpenMetrics).unwrap();
    assert!(open.ends_with("# EOF\n"), "{open}");
    assert!(open.contains("# TYPE gpu_mps_lease_refusals counter\n"), "{open}");
    let text = exposition.encode(Format::PrometheusText).unwrap();
    assert!(!text.contains("# EOF"), "{text}");
}

#[test]
fn once_the_manager_is_gone_a_scrape_has_only_the_recorded_families() {
    let metrics = Metrics::default();
    let source: Arc<dyn LevelSource> = Arc::new(Fixed(levels()));
    let exposition = Exposition::new(&metrics, Arc::downgrade(&source));
    drop(source);
    let text = exposition.encode(Format::PrometheusText).unwrap();
    assert!(text.contains("gpu_mps_lease_refusals_total"), "{text}");
    assert!(!text.contains("gpu_mps_leases"), "{text}");
}

#[test]
fn only_get_or_head_on_the_metrics_path_is_answered() {
    let metrics = Metrics::default();
    let source: Arc<dyn LevelSource> = Arc::new(Fixed(levels()));
    let exposition = Exposition::new(&metrics, Arc::downgrade(&source));
    let ok = respond(&Method::GET, "/metrics", None, &exposition);
    assert_eq!(ok.status(), StatusCode::OK);
    assert_eq!(
        ok.headers()["content-type"],
        "text/plain; version=0.0.4; charset=utf-8"
    );
    assert_eq!(
        respond(&Method::HEAD, "/metrics", None, &exposition).status(),
        StatusCode::OK
    );
    assert_eq!(
        respond(&Method::GET, "/", None, &exposition).status(),
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        respond(&Method::GET, "/metrics/x", None, &exposition).status(),
        StatusCode::NOT_FOUND
    );
    let post = respond(&Method::POST, "/metrics", None, &exposition);
    assert_eq!(post.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(post.headers()["allow"], "GET, HEAD");
}
