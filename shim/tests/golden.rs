//! Golden files: `tests/golden/<case>/input.json` and one expected outcome next to it:
//! - `expected.json`: the config.json the shim writes (compare with `diff input.json expected.json`);
//! - `expected-passthrough.txt`: why the spec passes through (config.json is not written);
//! - `expected-error.txt`: the one-line error that fails the create.
//!
//! Each case runs with `tests/golden/node.toml` and `tests/golden/inventory.json` unless the case
//! has its own. `UPDATE_GOLDEN=1 cargo test -p gpu-mps-shim --test golden every_case` rewrites
//! the expectations from the current code (the other tests read them meanwhile, so run only
//! that one); review the diff before committing it.

// Test helpers may unwrap: a panic that shows the value is the clearest failure here.
#![allow(clippy::unwrap_used)]

use std::fs;
use std::path::{Path, PathBuf};

use gpu_mps_api::annotations::{DAEMON, LIMITS};
use gpu_mps_api::inventory::Inventory;
use gpu_mps_api::{CONTAINER_PIPE_DIR, NodeConfig};
use gpu_mps_shim::rewrite::{MASKED_NVIDIA_SMI, MAX_CONNECTIONS_ENV, MPS_ENV_PREFIX};
use gpu_mps_shim::{RewritePlan, ShimError, plan_rewrite};
use serde_json::Value;

const EXPECTED_REWRITE: &str = "expected.json";
const EXPECTED_PASSTHROUGH: &str = "expected-passthrough.txt";
const EXPECTED_ERROR: &str = "expected-error.txt";
/// The id every golden case is created as (it names the gate dir under policy `exact`).
const GOLDEN_CONTAINER_ID: &str = "golden-container-1";

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

struct Case {
    name: String,
    dir: PathBuf,
    input: String,
    config: NodeConfig,
    inventory: Inventory,
}

impl Case {
    fn outcome(&self) -> Result<RewritePlan, ShimError> {
        plan_rewrite(&self.input, &self.config, &self.inventory, GOLDEN_CONTAINER_ID)
    }

    /// A GPU container's rewrite: input and output. A container without a GPU whose env was
    /// voided has its own test.
    fn rewritten(&self) -> Option<(Value, Value)> {
        let plan = self.outcome().ok()?;
        plan.daemon.as_ref()?;
        let output: Value = serde_json::from_str(plan.rewritten.as_deref()?).unwrap();
        Some((serde_json::from_str(&self.input).unwrap(), output))
    }
}

fn case_file(dir: &Path, name: &str) -> PathBuf {
    let own = dir.join(name);
    if own.exists() {
        own
    } else {
        golden_dir().join(name)
    }
}

fn cases() -> Vec<Case> {
    let mut dirs: Vec<PathBuf> = fs::read_dir(golden_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("input.json").exists())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 30, "golden cases are missing: {dirs:?}");
    dirs.into_iter()
        .map(|dir| {
            let config_path = case_file(&dir, "node.toml");
            let config =
                NodeConfig::from_toml(&fs::read_to_string(&config_path).unwrap(), &config_path).unwrap();
            let inventory =
                Inventory::from_json(&fs::read_to_string(case_file(&dir, "inventory.json")).unwrap())
                    .unwrap();
            Case {
                name: dir.file_name().unwrap().to_string_lossy().into_owned(),
                input: fs::read_to_string(dir.join("input.json")).unwrap(),
                dir,
                config,
                inventory,
            }
        })
        .collect()
}

#[test]
fn every_case_matches_its_golden_file() {
    let update = std::env::var_os("UPDATE_GOLDEN").is_some();
    let mut failures = Vec::new();
    for case in cases() {
        let (file, actual) = match case.outcome() {
            Ok(RewritePlan {
                rewritten: Some(text),
                ..
            }) => (EXPECTED_REWRITE, text),
            Ok(plan) => (EXPECTED_PASSTHROUGH, format!("{}\n", plan.reason)),
            Err(e) => (EXPECTED_ERROR, format!("{e}\n")),
        };
        if update {
            for other in [EXPECTED_REWRITE, EXPECTED_PASSTHROUGH, EXPECTED_ERROR] {
                let _ = fs::remove_file(case.dir.join(other));
            }
            fs::write(case.dir.join(file), &actual).unwrap();
            continue;
        }
        match fs::read_to_string(case.dir.join(file)) {
            Ok(expected) if expected == actual => {}
            Ok(expected) => failures.push(format!(
                "{}: {file} differs:\n--- expected\n{expected}\n--- actual\n{actual}",
                case.name
            )),
            Err(_) => failures.push(format!(
                "{}: got an outcome for {file}, which the case does not have:\n{actual}",
                case.name
            )),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn passthrough_leaves_the_spec_alone() {
    let mut seen = 0;
    for case in cases()
        .into_iter()
        .filter(|c| c.dir.join(EXPECTED_PASSTHROUGH).exists())
    {
        let plan = case.outcome().unwrap();
        assert_eq!(plan.rewritten, None, "{}", case.name);
        assert_eq!(
            (plan.daemon, plan.limits, plan.acquire),
            (None, None, None),
            "{}",
            case.name
        );
        seen += 1;
    }
    assert!(seen >= 6, "{seen} passthrough cases");
}

#[test]
fn pause_container_is_a_realistic_spec_with_unknown_fields() {
    let case = cases().into_iter().find(|c| c.name == "pause").unwrap();
    assert!(!case.input.contains('\n'), "containerd writes compact JSON");
    let spec: Value = serde_json::from_str(&case.input).unwrap();
    assert!(spec.pointer("/linux/intelRdt").is_some() && spec.get("x-vendor").is_some());
    assert!(
        spec["process"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e.as_str().unwrap().starts_with("NVIDIA_VISIBLE_DEVICES="))
    );
    assert_eq!(case.outcome().unwrap().rewritten, None);
}

#[test]
fn inputs_and_outputs_are_valid_oci_specs() {
    for case in cases() {
        let Some((input, output)) = case.rewritten() else {
            continue;
        };
        for (what, spec) in [("input", input), ("output", output)] {
            if let Err(e) = serde_json::from_value::<oci_spec::runtime::Spec>(spec) {
                panic!("{}: {what} is not an OCI spec: {e}", case.name);
            }
        }
    }
}

/// The spec without what the shim owns; equal before and after, in the same key order.
fn without_owned_parts(spec: &Value, hook_path: &str) -> Value {
    let mut spec = spec.clone();
    let root = spec.as_object_mut().unwrap();
    if let Some(Value::Array(mounts)) = root.get_mut("mounts") {
        mounts.retain(|m| Path::new(m["destination"].as_str().unwrap()) != Path::new(CONTAINER_PIPE_DIR));
    }
    if let Some(Value::Array(env)) = root.get_mut("process").and_then(|p| p.get_mut("env")) {
        // NVIDIA_VISIBLE_DEVICES is the shim's when it narrows a pod-written value to the GPUs
        // of trusted sources; it keeps its place in the list.
        env.retain(|e| {
            let name = e.as_str().unwrap().split('=').next().unwrap();
            !name.starts_with(MPS_ENV_PREFIX)
                && name != MAX_CONNECTIONS_ENV
                && name != "NVIDIA_VISIBLE_DEVICES"
        });
    }
    remove_from_list(root, "linux", "maskedPaths", |p| {
        MASKED_NVIDIA_SMI.contains(&p.as_str().unwrap())
    });
    for stage in ["createRuntime", "poststop"] {
        remove_from_list(root, "hooks", stage, |h| h["path"] == hook_path);
    }
    if let Some(Value::Object(annotations)) = root.get_mut("annotations") {
        annotations.shift_remove(DAEMON);
        annotations.shift_remove(LIMITS);
        if annotations.is_empty() {
            root.shift_remove("annotations");
        }
    }
    spec
}

fn remove_from_list(
    root: &mut serde_json::Map<String, Value>,
    parent: &str,
    key: &str,
    owned: impl Fn(&Value) -> bool,
) {
    let Some(Value::Object(object)) = root.get_mut(parent) else {
        return;
    };
    if let Some(Value::Array(list)) = object.get_mut(key) {
        list.retain(|v| !owned(v));
        if list.is_empty() {
            object.shift_remove(key);
        }
    }
    if object.is_empty() {
        root.shift_remove(parent);
    }
}

#[test]
fn only_the_owned_parts_change() {
    let mut seen = 0;
    for case in cases() {
        let Some((input, output)) = case.rewritten() else {
            continue;
        };
        let hook_path = case.config.hook_path.to_str().unwrap();
        assert_eq!(
            serde_json::to_string_pretty(&without_owned_parts(&input, hook_path)).unwrap(),
            serde_json::to_string_pretty(&without_owned_parts(&output, hook_path)).unwrap(),
            "{}",
            case.name
        );
        seen += 1;
    }
    assert!(seen >= 10, "{seen} rewrite cases");
}

#[test]
fn no_host_ipc_no_shm_no_uid_no_capability_change() {
    for case in cases() {
        let Some((input, output)) = case.rewritten() else {
            continue;
        };
        for pointer in [
            "/linux/namespaces",
            "/process/user",
            "/process/capabilities",
            "/process/noNewPrivileges",
        ] {
            assert_eq!(
                input.pointer(pointer),
                output.pointer(pointer),
                "{}: {pointer}",
                case.name
            );
        }
        let shm = |spec: &Value| -> Vec<Value> {
            spec["mounts"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|m| m["destination"] == "/dev/shm")
                .cloned()
                .collect()
        };
        assert_eq!(shm(&input), shm(&output), "{}: /dev/shm", case.name);
        let pipe: Vec<&Value> = output["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["destination"] == CONTAINER_PIPE_DIR)
            .collect();
        assert_eq!(pipe.len(), 1, "{}", case.name);
        assert_eq!(
            pipe[0]["options"],
            serde_json::json!(["rbind", "ro", "nosuid", "nodev", "noexec"])
        );
    }
}

#[test]
fn rewriting_a_rewritten_spec_changes_nothing() {
    for case in cases() {
        let Ok(RewritePlan {
            rewritten: Some(once),
            daemon: Some(_),
            ..
        }) = case.outcome()
        else {
            continue;
        };
        let twice = plan_rewrite(&once, &case.config, &case.inventory, GOLDEN_CONTAINER_ID)
            .unwrap()
            .rewritten
            .unwrap();
        assert_eq!(once, twice, "{}", case.name);
    }
}

#[test]
fn a_cuda_images_env_without_a_scheduled_gpu_is_only_voided() {
    let case = cases()
        .into_iter()
        .find(|c| c.name == "env-all-untrusted")
        .unwrap();
    assert!(!case.config.gpus.trust_visible_devices_env);
    let plan = case.outcome().unwrap();
    assert_eq!(
        (&plan.daemon, &plan.limits, &plan.acquire, &plan.gate_dir),
        (&None, &None, &None, &None)
    );
    assert!(
        plan.reason
            .starts_with("passthrough: no GPU scheduled (NVIDIA_VISIBLE_DEVICES=\"all\"")
            && plan.reason.contains("[gpus] trust_visible_devices_env is off"),
        "{}",
        plan.reason
    );
    let once = plan.rewritten.unwrap();
    // Only the env's NVIDIA_VISIBLE_DEVICES changed, in its place.
    let mut input: Value = serde_json::from_str(&case.input).unwrap();
    let output: Value = serde_json::from_str(&once).unwrap();
    for e in input["process"]["env"].as_array_mut().unwrap() {
        if e.as_str().unwrap().starts_with("NVIDIA_VISIBLE_DEVICES=") {
            *e = Value::String("NVIDIA_VISIBLE_DEVICES=void".into());
        }
    }
    assert_eq!(input, output);
    // The voided spec is a plain container without a GPU: planned again, it passes through.
    let again = plan_rewrite(&once, &case.config, &case.inventory, GOLDEN_CONTAINER_ID).unwrap();
    assert_eq!(again.rewritten, None);
}

#[test]
fn errors_are_one_line_naming_what_was_wrong() {
    let table: &[(&str, &[&str])] = &[
        (
            "error-devices-unknown-minor",
            &[
                "linux.devices /dev/nvidia0 (195:4)",
                "no GPU of this node has device minor 4",
                "known minors: 0=GPU 0",
            ],
        ),
        (
            "error-devices-malformed",
            &["config.json: linux.devices: entry 1", "\"195\"", "c|u|b|p"],
        ),
        (
            "error-memory-unknown-suffix",
            &[
                "annotation gpu-mps.io/memory-limit=\"4GB\"",
                "allowed are Ki, Mi, Gi",
                "set it on the pod",
            ],
        ),
        (
            "error-memory-too-small",
            &["annotation gpu-mps.io/memory-limit=\"4096\"", "64Mi"],
        ),
        (
            "error-memory-fractional-bytes",
            &["annotation gpu-mps.io/memory-limit=\"0.5\""],
        ),
        (
            "error-threads-out-of-range",
            &[
                "annotation gpu-mps.io/active-thread-percentage=\"250\"",
                "1 to 100",
            ],
        ),
        (
            "error-threads-percent-sign",
            &[
                "annotation gpu-mps.io/active-thread-percentage=\"25%\"",
                "1 to 100",
            ],
        ),
        (
            "error-container-level-invalid",
            &[
                "annotation infer.gpu-mps.io/memory-limit=\"8gi\"",
                "unknown suffix \"gi\"",
            ],
        ),
        (
            "error-missing-limits",
            &[
                "no memory limit for container \"infer\"",
                "gpu-mps.io/memory-limit",
                "limits.default_memory_limit",
            ],
        ),
        (
            "error-missing-threads",
            &[
                "no active thread percentage",
                "infer.gpu-mps.io/active-thread-percentage",
            ],
        ),
        (
            "error-unknown-gpu-index",
            &[
                "NVIDIA_VISIBLE_DEVICES=\"7\"",
                "GPU \"7\" is not on this node",
                "known: 0=GPU-",
            ],
        ),
        (
            "error-unknown-cdi-uuid",
            &[
                "annotation cdi.k8s.io/nvidia-device-plugin_infer=",
                "GPU-00000000-dead-beef",
            ],
        ),
        (
            "error-cdi-empty-name",
            &[
                "annotation cdi.k8s.io/nvidia-device-plugin_infer=\"nvidia.com/gpu=\"",
                "<index|uuid|all>",
            ],
        ),
        (
            "error-mig-device",
            &["NVIDIA_VISIBLE_DEVICES=\"MIG-", "is a MIG device", "not support"],
        ),
        (
            "error-mig-enabled-gpu",
            &["NVIDIA_VISIBLE_DEVICES=\"1\"", "has MIG enabled", "not support"],
        ),
        (
            "env-all",
            &[
                "NVIDIA_VISIBLE_DEVICES=\"all\" with no GPU scheduled",
                "never all",
            ],
        ),
        (
            "error-env-index-untrusted",
            &[
                "NVIDIA_VISIBLE_DEVICES=\"1\" names GPUs, but none was scheduled",
                "[gpus] trust_visible_devices_env = true",
            ],
        ),
        (
            "error-cdi-unknown-nvidia-kind",
            &[
                "annotation cdi.k8s.io/vfio=\"nvidia.com/pgpu=0\"",
                "an NVIDIA CDI kind gpu-mps does not know",
            ],
        ),
        ("error-env-not-a-list", &["config.json: process.env:"]),
        (
            "error-mount-without-destination",
            &["config.json: mounts:", "destination"],
        ),
        ("error-annotation-not-a-string", &["config.json: annotations:"]),
        ("error-not-json", &["config.json is not valid JSON"]),
        (
            "error-priority-invalid",
            &[
                "annotation gpu-mps.io/priority=\"low\"",
                "expected normal or below-normal",
                "(set it on the pod)",
            ],
        ),
    ];
    let all = cases();
    let error_cases: Vec<&Case> = all
        .iter()
        .filter(|c| c.dir.join(EXPECTED_ERROR).exists())
        .collect();
    assert_eq!(error_cases.len(), table.len(), "every error case is in the table");
    for (name, wanted) in table {
        let case = all
            .iter()
            .find(|c| c.name == *name)
            .unwrap_or_else(|| panic!("no case {name}"));
        let message = case.outcome().unwrap_err().to_string();
        assert!(!message.contains('\n'), "{name}: {message}");
        for w in *wanted {
            assert!(message.contains(w), "{name}: {message:?} does not contain {w:?}");
        }
    }
}
