use clap::Parser;
use proptest::prelude::*;

use super::*;
use crate::hook_invocation::{AcquireArgs, RequestArgs};

/// What gpu-mps-hook's `create-runtime` parses: its own two flags and the request's.
#[derive(Debug, Parser)]
struct HookCommandLine {
    #[arg(long)]
    socket: String,
    #[arg(long)]
    timeout_seconds: u64,
    #[command(flatten)]
    request: RequestArgs,
}

fn name() -> impl Strategy<Value = String> {
    // What a Kubernetes name can hold, and the characters a flag's value must carry through
    // (`=`, `,`, a leading `-`): the shim refuses only a NUL.
    "[-a-z0-9.=, ]{0,24}"
}

prop_compose! {
    fn request()(
        gpus in proptest::collection::btree_set("GPU-[0-9a-f]{8}(-[0-9a-f]{4}){0,3}", 1..4),
        memory_bytes in limits::MIN_MEMORY_LIMIT_BYTES..(1u64 << 42),
        thread_percentage in 1u8..=100,
        cuda_processes in 1u32..=limits::MAX_CUDA_PROCESSES,
        namespace in name(), pod in name(), container_name in name(),
        memory_units in proptest::collection::vec(0u32..4096, 0..6),
        below in any::<bool>(),
        policy in prop_oneof![Just(String::new()), Just("exact".to_string()), Just("uniform".to_string())],
        config_digest in "[0-9a-f]{0,16}",
    ) -> ContainerRequest {
        ContainerRequest {
            key: DaemonKey::new(gpus),
            limits: Limits { memory_bytes, thread_percentage },
            cuda_processes,
            identity: PodIdentity { namespace, pod, container_name },
            memory_units,
            priority: if below { ClientPriority::BelowNormal } else { ClientPriority::Normal },
            layout: Layout { policy, config_digest },
        }
    }
}

/// The Acquire the hook sends for `request` as the shim wrote it into the hook's arguments.
fn acquire_through_the_hook(request: &ContainerRequest) -> proto::AcquireRequest {
    let args = AcquireArgs {
        socket: "/run/x/manager.sock".into(),
        timeout_seconds: 7,
        request: request.clone(),
    };
    let parsed = HookCommandLine::try_parse_from(&args.to_hook_args()[1..]).unwrap();
    parsed.request.to_acquire_request("c1", 4242, "/b")
}

proptest! {
    #[test]
    fn a_request_survives_the_hook_arguments_and_the_proto(request in request()) {
        let args = AcquireArgs { socket: "/run/x/manager.sock".into(), timeout_seconds: 7, request: request.clone() };
        let argv = args.to_hook_args();
        prop_assert_eq!(&argv[..2], &["gpu-mps-hook".to_string(), "create-runtime".to_string()]);
        let parsed = HookCommandLine::try_parse_from(&argv[1..]).unwrap();
        prop_assert_eq!(parsed.socket, "/run/x/manager.sock");
        prop_assert_eq!(parsed.timeout_seconds, 7);
        let req = parsed.request.to_acquire_request("c1", 4242, "/b");
        prop_assert_eq!((req.container_id.as_str(), req.pid, req.bundle.as_str()), ("c1", 4242, "/b"));
        prop_assert_eq!(ContainerRequest::from_acquire_request(&req).unwrap(), request);
    }

    #[test]
    fn a_request_survives_its_lease_record_form(request in request()) {
        let json = serde_json::to_string(&request).unwrap();
        prop_assert_eq!(serde_json::from_str::<ContainerRequest>(&json).unwrap(), request);
    }
}

#[test]
fn a_request_without_the_newer_fields_reads_with_their_defaults() {
    // What a lease record held before the process count, units, priority and layout existed.
    let old = r#"{"key":["GPU-a"],"limits":{"memory_bytes":4294967296,"thread_percentage":25},
                  "namespace":"team-a","pod":"p","container_name":"c"}"#;
    let request: ContainerRequest = serde_json::from_str(old).unwrap();
    assert_eq!(request.cuda_processes, 1);
    assert_eq!(request.priority, ClientPriority::Normal);
    assert_eq!(request.layout, Layout::default());
    assert!(request.memory_units.is_empty());
    assert_eq!(request.identity.namespace, "team-a");
}

#[test]
fn a_normal_request_writes_only_the_fields_a_record_had_before_priority_and_layout() {
    let request = ContainerRequest::for_test(
        &["GPU-a"],
        Limits {
            memory_bytes: 1 << 30,
            thread_percentage: 10,
        },
        "ns",
    );
    let value = serde_json::to_value(&request).unwrap();
    let mut keys: Vec<&str> = value.as_object().unwrap().keys().map(String::as_str).collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "container_name",
            "cuda_processes",
            "key",
            "limits",
            "namespace",
            "pod"
        ]
    );
}

#[test]
fn the_hook_arguments_of_a_normal_request_are_those_before_priority_existed() {
    let args = AcquireArgs {
        socket: "/s".into(),
        timeout_seconds: 1,
        request: ContainerRequest::for_test(
            &["GPU-a"],
            Limits {
                memory_bytes: 1 << 30,
                thread_percentage: 10,
            },
            "ns",
        ),
    };
    assert!(
        !args
            .to_hook_args()
            .iter()
            .any(|a| a.starts_with("--priority") || a.starts_with("--memory-units"))
    );
    let below = AcquireArgs {
        request: ContainerRequest {
            priority: ClientPriority::BelowNormal,
            ..args.request.clone()
        },
        ..args
    };
    assert_eq!(below.to_hook_args().last().unwrap(), "--priority=below-normal");
}

#[test]
fn the_socket_refuses_what_the_annotations_would() {
    let good = acquire_through_the_hook(&ContainerRequest::for_test(
        &["GPU-a"],
        Limits {
            memory_bytes: 1 << 30,
            thread_percentage: 10,
        },
        "ns",
    ));
    let refused = |edit: fn(&mut proto::AcquireRequest)| {
        let mut req = good.clone();
        edit(&mut req);
        ContainerRequest::from_acquire_request(&req)
            .unwrap_err()
            .to_string()
    };
    assert_eq!(refused(|r| r.gpu_uuids.clear()), "no GPU in the request");
    assert!(refused(|r| r.active_thread_percentage = 101).contains("not an active thread percentage"));
    assert!(refused(|r| r.active_thread_percentage = 256 + 25).contains("281"));
    assert!(refused(|r| r.memory_limit_bytes = 1 << 20).contains("below the minimum memory limit"));
    assert_eq!(
        refused(|r| r.cuda_processes = 49),
        "cuda_processes 49 is out of range: expected 1 to 48"
    );
    assert_eq!(
        refused(|r| r.client_priority = 2),
        "client_priority 2 is out of range: expected 0 (normal) or 1 (below-normal)"
    );
    // The hook of a shim older than the process count sends none: one process.
    let mut old = good.clone();
    old.cuda_processes = 0;
    assert_eq!(
        ContainerRequest::from_acquire_request(&old)
            .unwrap()
            .cuda_processes,
        1
    );
}

#[test]
fn priority_names_parse_and_print_as_the_annotation_writes_them() {
    for name in ClientPriority::NAMES {
        assert_eq!(ClientPriority::parse(name).unwrap().name(), name);
    }
    assert_eq!(
        ClientPriority::parse("low").unwrap_err().to_string(),
        "\"low\" is not a client priority: expected normal or below-normal"
    );
}
