#![allow(clippy::unwrap_used)]
use super::*;
use crate::limits::Limits;
use crate::maxima::Maxima;

fn parse(text: &str) -> Result<NodeConfig, ConfigError> {
    NodeConfig::from_toml(text, Path::new("/etc/gpu-mps/config.toml"))
}

#[test]
fn empty_file_gives_defaults() {
    assert_eq!(parse("").unwrap(), NodeConfig::default());
}

#[test]
fn a_root_too_long_for_socket_addresses_is_refused() {
    let e = parse(&format!("root = \"/{}\"", "r".repeat(MAX_ROOT_LEN)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("unix socket address"), "{e}");
    assert!(parse(&format!("root = \"/{}\"", "r".repeat(MAX_ROOT_LEN - 1))).is_ok());
    // Found by fuzzing: TOML escapes put line breaks in the root, which the message quotes.
    let e = parse(&format!("root = \"/run/\\r\\n{}\"", "r".repeat(MAX_ROOT_LEN)))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("root: /run/\\r\\nrrr") && !e.contains(['\n', '\r']),
        "{e:?}"
    );
}

#[test]
fn the_shipped_config_parses_and_matches_the_defaults_it_documents() {
    let c = parse(include_str!("../../../packaging/config.toml")).unwrap();
    assert_eq!(c.limits.policy, LimitPolicy::Exact);
    assert_eq!(c.limits.policy, NodeConfig::default().limits.policy);
    assert_eq!(
        (c.gate.handshake_timeout_seconds, c.gate.queue_timeout_seconds),
        (
            NodeConfig::default().gate.handshake_timeout_seconds,
            NodeConfig::default().gate.queue_timeout_seconds
        )
    );
}

#[test]
fn policy_exact_and_its_gate_timeouts() {
    let c = parse(
        "[limits]\npolicy = \"exact\"\n[gate]\nhandshake_timeout_seconds = 5\nqueue_timeout_seconds = 60\n",
    )
    .unwrap();
    assert_eq!(c.limits.policy, LimitPolicy::Exact);
    assert_eq!(
        (c.gate.handshake_timeout_seconds, c.gate.queue_timeout_seconds),
        (5, 60)
    );
    let id = crate::ContainerId::parse("abc").unwrap();
    assert_eq!(c.gate_dir(&id), Path::new("/run/gpu-mps/gates/ba7816bf8f01cfea"));
    let e = parse("[gate]\nqueue_timeout_seconds = 0\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("gate.queue_timeout_seconds") && e.contains("1 to 300"),
        "{e}"
    );
    let e = parse("[limits]\npolicy = \"exactly\"\n").unwrap_err().to_string();
    assert!(e.contains("exact"), "{e}");
}

#[test]
fn maximums_per_node_and_namespace() {
    let c = parse(
        r#"
        [limits]
        default_memory_limit = "4Gi"
        default_active_thread_percentage = 25
        default_cuda_processes = 2
        max_memory_limit = "16Gi"
        max_active_thread_percentage = 50
        max_cuda_processes = 8
        [limits.namespaces.team-a]
        max_memory_limit = "4Gi"
        [limits.namespaces."batch"]
        max_active_thread_percentage = 100
        max_cuda_processes = 48
        "#,
    )
    .unwrap();
    assert_eq!(c.limits.default_cuda_processes, 2);
    let (node, scope) = c.limits.maxima_for("other");
    assert_eq!(scope, "this node");
    assert_eq!(
        node,
        Maxima {
            memory_bytes: Some(16 << 30),
            thread_percentage: 50,
            cuda_processes: 8
        }
    );
    let (team, scope) = c.limits.maxima_for("team-a");
    assert_eq!(scope, "namespace team-a");
    assert_eq!(
        team,
        Maxima {
            memory_bytes: Some(4 << 30),
            thread_percentage: 50,
            cuda_processes: 8
        },
        "keys left out take the node's"
    );
    assert_eq!(c.limits.maxima_for("batch").0.thread_percentage, 100);
    assert_eq!(c.limits.maxima_for("batch").0.cuda_processes, 48);
    assert_eq!(NodeConfig::default().limits.maxima, Maxima::default());
}

#[test]
fn a_number_of_the_wrong_kind_is_refused_in_words_not_rust_types() {
    for (text, said) in [
        (
            "[limits]\ndefault_active_thread_percentage = \"abc\"",
            "expected a whole number from 1 to 100, got \"abc\"",
        ),
        (
            "[limits]\nmax_active_thread_percentage = 300",
            "expected a whole number from 1 to 100, got 300",
        ),
        (
            "[limits]\nceiling_active_thread_percentage = 12.5",
            "expected a whole number from 1 to 100, got 12.5",
        ),
        (
            "[limits]\ndefault_cuda_processes = -1",
            "expected a whole number from 0 to 4294967295, got -1",
        ),
        (
            "[limits.namespaces.a]\nmax_cuda_processes = \"4\"",
            "expected a whole number from 0 to 4294967295, got \"4\"",
        ),
        (
            "[gate]\nmax_connections = true",
            "expected a whole number from 0 to 4294967295, got true",
        ),
        (
            "[daemon]\nidle_grace_seconds = \"60s\"",
            "expected a whole number from 0 to 18446744073709551615, got \"60s\"",
        ),
        (
            "[hook]\ntimeout_seconds = -5",
            "expected a whole number from 0 to 18446744073709551615, got -5",
        ),
    ] {
        let e = parse(text).unwrap_err().to_string();
        assert!(e.contains(said), "{text}: {e}");
        assert!(
            !e.contains("expected u") && !e.contains("expected i"),
            "{text}: {e}"
        );
        // TOML's location names the key.
        let key = text.rsplit_once('\n').unwrap().1.split(' ').next().unwrap();
        assert!(e.contains(key), "{text}: {e}");
        assert!(!e.contains('\n'), "{text}: {e}");
    }
    // Numbers that fit still get their key's own range check.
    let e = parse("[limits]\nmax_active_thread_percentage = 0")
        .unwrap_err()
        .to_string();
    assert!(e.contains("limits.max_active_thread_percentage"), "{e}");
    assert_eq!(
        parse("[daemon]\nidle_grace_seconds = 90")
            .unwrap()
            .daemon
            .idle_grace_seconds,
        90
    );
}

#[test]
fn bad_maximums_name_their_key() {
    for (text, key) in [
        ("[limits]\nmax_memory_limit = \"4GB\"", "limits.max_memory_limit"),
        (
            "[limits]\nmax_active_thread_percentage = 0",
            "limits.max_active_thread_percentage",
        ),
        ("[limits]\nmax_cuda_processes = 49", "limits.max_cuda_processes"),
        (
            "[limits]\ndefault_cuda_processes = 0",
            "limits.default_cuda_processes",
        ),
        (
            "[limits.namespaces.a]\nmax_cuda_processes = 0",
            "limits.namespaces.*.max_cuda_processes",
        ),
        (
            "[limits.namespaces.a]\nmax_memry_limit = \"1Gi\"",
            "max_memry_limit",
        ),
        (
            "[limits]\ndefault_memory_limit = \"8Gi\"\ndefault_active_thread_percentage = 25\nmax_memory_limit = \"4Gi\"",
            "limits.default_*",
        ),
        (
            "[gate]\nconnections_per_container = 0",
            "gate.connections_per_container",
        ),
        ("[gate]\nmax_connections = 1", "gate.max_connections"),
    ] {
        let e = parse(text).unwrap_err().to_string();
        assert!(e.contains(key), "{text}: {e}");
    }
}

#[test]
fn the_published_config_round_trips_and_checks_its_digest() {
    let c = parse("[limits]\npolicy = \"uniform\"\n[limits.namespaces.a]\nmax_cuda_processes = 2\n").unwrap();
    let published = PublishedConfig::new(c.clone(), Path::new("/etc/gpu-mps/config.toml"), 42);
    let text = serde_json::to_string(&published).unwrap();
    let back = PublishedConfig::from_json(&text).unwrap();
    assert_eq!(back.config, c);
    assert_eq!(back.digest, c.digest());
    assert_ne!(
        c.digest(),
        NodeConfig::default().digest(),
        "the digest follows the content"
    );
    let tampered = text.replace("\"uniform\"", "\"ceiling\"");
    assert!(
        PublishedConfig::from_json(&tampered)
            .unwrap_err()
            .contains("digest")
    );
    let other_version = text.replace("\"version\":2", "\"version\":9");
    assert!(
        PublishedConfig::from_json(&other_version)
            .unwrap_err()
            .contains("version 9")
    );
    assert_eq!(c.published_path(), Path::new("/run/gpu-mps/node-config.json"));
    // serde quotes an unknown policy as the file spells it.
    let odd_policy = text.replace("\"uniform\"", "\"uni\\nform\"");
    let e = PublishedConfig::from_json(&odd_policy).unwrap_err();
    assert!(
        e.contains("unknown variant `uni\\nform`") && !e.contains('\n'),
        "{e}"
    );
}

#[test]
fn full_file() {
    let c = parse(
        r#"
        root = "/run/x"
        [limits]
        policy = "ceiling"
        tenancy = "exclusive"
        default_memory_limit = "4Gi"
        default_active_thread_percentage = 25
        ceiling_memory_limit = "16Gi"
        ceiling_active_thread_percentage = 50
        overcommit = 1.5
        [daemon]
        idle_grace_seconds = 5
        exclusive_process = false
        "#,
    )
    .unwrap();
    assert_eq!(c.limits.policy, LimitPolicy::Ceiling);
    assert_eq!(c.limits.tenancy, Tenancy::Exclusive);
    assert_eq!(
        c.limits.default_limits,
        Some(Limits {
            memory_bytes: 4 << 30,
            thread_percentage: 25
        })
    );
    assert_eq!(
        c.limits.ceiling,
        Some(Limits {
            memory_bytes: 16 << 30,
            thread_percentage: 50
        })
    );
    assert_eq!(c.manager_socket(), PathBuf::from("/run/x/manager.sock"));
    assert!(!c.daemon.exclusive_process);
}

#[test]
fn errors_name_file_key_and_value() {
    let e = parse("[limits]\npolcy = \"ceiling\"").unwrap_err().to_string();
    assert!(
        e.contains("/etc/gpu-mps/config.toml") && e.contains("polcy"),
        "{e}"
    );
    let e = parse("[limits]\ndefault_memory_limit = \"4GB\"\ndefault_active_thread_percentage = 5")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("limits.default_memory_limit") && e.contains("4GB"),
        "{e}"
    );
    let e = parse("[limits]\npolicy = \"ceiling\"").unwrap_err().to_string();
    assert!(e.contains("ceiling_memory_limit"), "{e}");
    let e = parse("[limits]\ndefault_memory_limit = \"4Gi\"")
        .unwrap_err()
        .to_string();
    assert!(e.contains("both"), "{e}");
    assert!(parse("root = \"/tmp/nvidia-mps\"").is_err());
    assert!(parse("[limits]\nmax_clients_per_gpu = 49").is_err());
    let e = parse("[daemon]\nstart_timeout_seconds = 10")
        .unwrap_err()
        .to_string();
    assert!(e.contains("hook.timeout_seconds") && e.contains("22"), "{e}");
    assert!(parse("[daemon]\nstart_timeout_seconds = 10\n[hook]\ntimeout_seconds = 22").is_ok());
    assert!(parse("[limits]\ndefault_active_thread_percentage = 0\ndefault_memory_limit = \"1Gi\"").is_err());
}

#[test]
fn metrics_are_off_by_default_and_listen_where_the_file_says() {
    assert_eq!(parse("").unwrap().metrics.listen, None);
    let c = parse("[metrics]\nlisten = \"127.0.0.1:9401\"\n").unwrap();
    assert_eq!(c.metrics.listen, Some("127.0.0.1:9401".parse().unwrap()));
    let c = parse("[metrics]\nlisten = \"[::1]:9401\"\n").unwrap();
    assert_eq!(c.metrics.listen, Some("[::1]:9401".parse().unwrap()));
    assert_eq!(parse("[metrics]\n").unwrap().metrics.listen, None);
    for (value, says) in [
        ("localhost:9401", "not an IP address and port"),
        ("127.0.0.1", "not an IP address and port"),
        ("127.0.0.1:99999", "not an IP address and port"),
        ("127.0.0.1:0", "port 0"),
        ("127.0.0.1:94\\n01", "not an IP address and port"),
    ] {
        let e = parse(&format!("[metrics]\nlisten = \"{value}\"\n"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("metrics.listen") && e.contains(says) && !e.contains('\n'),
            "{value}: {e}"
        );
    }
    let e = parse("[metrics]\naddress = \"127.0.0.1:9401\"\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("address"), "{e}");
}

#[test]
fn a_config_published_before_a_key_existed_is_still_read() {
    // A manager of an older build published its config without a key this build has (here
    // metrics.listen, the gpus table): its digest is over what it wrote, and this build
    // reads it with the key's default.
    let newer = PublishedConfig::new(NodeConfig::default(), Path::new("/etc/gpu-mps/config.toml"), 7);
    let mut older: serde_json::Value = serde_json::to_value(&newer).unwrap();
    let config = older["config"].as_object_mut().unwrap();
    config["metrics"].as_object_mut().unwrap().remove("listen");
    config.remove("gpus");
    let written = serde_json::to_vec(&older["config"]).unwrap();
    older["digest"] = digest_of(&serde_json::from_slice(&written).unwrap()).into();
    let read = PublishedConfig::from_json(&older.to_string()).unwrap();
    assert_eq!(read.config, NodeConfig::default());
    assert_eq!(read.digest, older["digest"].as_str().unwrap());
    // Its digest is the older manager's, which the hook hands that manager back.
    assert_ne!(read.digest, NodeConfig::default().digest());
}

#[test]
fn every_setting_changes_the_digest() {
    let c = NodeConfig::default();
    let mut with = c.clone();
    with.metrics.listen = Some("127.0.0.1:9401".parse().unwrap());
    assert_ne!(with.digest(), c.digest());
    let mut trusting = c.clone();
    trusting.gpus.trust_visible_devices_env = true;
    assert_ne!(trusting.digest(), c.digest());
    for back in [&with, &trusting] {
        let json = serde_json::to_string(back).unwrap();
        assert_eq!(&serde_json::from_str::<NodeConfig>(&json).unwrap(), back);
    }
}

#[test]
fn config_get_reads_any_value_by_its_path_and_names_the_nearest_key() {
    let c = parse("root = \"/run/x\"\n[gate]\nqueue_timeout_seconds = 12\n[limits]\npolicy = \"uniform\"\n")
        .unwrap();
    assert_eq!(c.value_at("root").unwrap(), "/run/x");
    assert_eq!(c.value_at("gate.queue_timeout_seconds").unwrap(), "12");
    assert_eq!(c.value_at("limits.policy").unwrap(), "uniform");
    assert_eq!(c.value_at("hook_path").unwrap(), "/usr/local/bin/gpu-mps-hook");
    assert_eq!(c.value_at("metrics.listen").unwrap(), "null");
    assert!(
        c.value_at("gate")
            .unwrap()
            .starts_with("{\"handshake_timeout_seconds\":5,")
    );
    let e = c.value_at("gate.queue_timeout").unwrap_err();
    assert_eq!(e.nearest.as_deref(), Some("gate.queue_timeout_seconds"));
    assert!(e.to_string().starts_with("no setting gate.queue_timeout (did you mean gate.queue_timeout_seconds?): the keys there are gate.handshake_timeout_seconds, "), "{e}");
    let e = c.value_at("rot").unwrap_err();
    assert_eq!(e.nearest.as_deref(), Some("root"));
    assert!(c.value_at("root.x").is_err(), "a value has no keys under it");
}

#[test]
fn the_env_is_no_gpu_source_unless_the_node_says_so() {
    assert!(!parse("").unwrap().gpus.trust_visible_devices_env);
    assert!(!NodeConfig::default().gpus.trust_visible_devices_env);
    let on = parse("[gpus]\ntrust_visible_devices_env = true\n").unwrap();
    assert!(on.gpus.trust_visible_devices_env);
    assert!(
        !parse("[gpus]\ntrust_visible_devices_env = false\n")
            .unwrap()
            .gpus
            .trust_visible_devices_env
    );
    for text in [
        "[gpus]\ntrust_visible_devices_env = \"yes\"\n",
        "[gpus]\ntrust_env = true\n",
    ] {
        let e = parse(text).unwrap_err().to_string();
        assert!(!e.contains('\n'), "{e}");
    }
}

#[test]
fn device_plugin_section_parses_and_refuses_bad_values() {
    let c = parse("").unwrap();
    assert!(!c.device_plugin.enabled);
    assert_eq!(c.device_plugin.memory_unit_bytes, 1 << 30);
    let c = parse(
        "[device_plugin]\nenabled = true\nmemory_unit = \"512Mi\"\nserver_reserve = \"2Gi\"\ndefault_thread_share_factor = 1.5\n",
    )
    .unwrap();
    assert_eq!(
        c.device_plugin,
        DevicePluginConfig {
            enabled: true,
            memory_unit_bytes: 512 << 20,
            server_reserve_bytes: 2 << 30,
            default_thread_share_factor: 1.5,
        }
    );
    for (text, key) in [
        ("memory_unit = \"1Mi\"", "device_plugin.memory_unit"),
        ("memory_unit = \"lots\"", "device_plugin.memory_unit"),
        ("server_reserve = \"-1\"", "device_plugin.server_reserve"),
        (
            "default_thread_share_factor = 0.0",
            "device_plugin.default_thread_share_factor",
        ),
        (
            "default_thread_share_factor = nan",
            "device_plugin.default_thread_share_factor",
        ),
    ] {
        let e = parse(&format!("[device_plugin]\n{text}\n"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(key) && !e.contains('\n'), "{text}: {e}");
    }
    for limits in ["policy = \"uniform\"", "tenancy = \"exclusive\""] {
        let e = parse(&format!("[limits]\n{limits}\n[device_plugin]\nenabled = true\n"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("device_plugin.enabled") && e.contains("exact"),
            "{limits}: {e}"
        );
    }
    assert!(parse("[limits]\npolicy = \"uniform\"\n[device_plugin]\nenabled = false\n").is_ok());
    let e = parse("[device_plugin]\nunit = \"1Gi\"\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("unit"), "{e}");
}

#[test]
fn every_path_under_the_root_is_named_in_the_root_entries() {
    let c = parse("root = \"/run/x\"").unwrap();
    let key = crate::DaemonKey::new(["GPU-a"]);
    let id = crate::ContainerId::parse("4844287073c56bf2a1d0e9c3b7f6a5d4e3c2b1a0918273645546372819201a2b")
        .unwrap();
    let top = [
        c.manager_socket(),
        c.manager_lock_path(),
        c.state_path(),
        c.inventory_path(),
        c.published_path(),
        c.lease_files_dir(),
        c.daemons_root(),
        c.gates_root(),
    ];
    let nested = [
        c.daemon_dir(&key),
        c.pipe_dir(&key),
        c.log_dir(&key),
        c.gate_dir(&id),
    ];
    let under_root = nested.iter().map(|p| {
        let rest = p.strip_prefix(&c.root).unwrap();
        c.root.join(rest.iter().next().unwrap())
    });
    for path in top.into_iter().chain(under_root) {
        assert_eq!(path.parent(), Some(c.root.as_path()), "{}", path.display());
        let name = path.file_name().unwrap().to_str().unwrap();
        assert!(
            ROOT_ENTRIES.contains(&name),
            "{} is not in ROOT_ENTRIES",
            path.display()
        );
    }
    let nvml_error = c.inventory_path().with_file_name(NVML_ERROR_FILE);
    assert!(is_root_entry(nvml_error.file_name().unwrap().to_str().unwrap()));
}
