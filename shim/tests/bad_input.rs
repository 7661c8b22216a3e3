//! Bad input (issue 8): what a pod, ctr or a broken runtime can put in config.json, through the
//! shim's whole decision (`plan_rewrite`) on the golden node. Each case is refused in exactly
//! one line that names what was wrong and what is allowed, or accepted where that is right.
//! The size cap and non-UTF-8 files are refused before parsing (src/bundle.rs tests them).

// Test helpers may unwrap: a panic that shows the value is the clearest failure here.
#![allow(clippy::unwrap_used)]

use std::path::Path;

use gpu_mps_api::NodeConfig;
use gpu_mps_api::inventory::Inventory;
use gpu_mps_shim::{RewritePlan, plan_rewrite};
use serde_json::{Value, json};

const ID: &str = "golden-container-1";

fn node() -> (NodeConfig, Inventory) {
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let toml = std::fs::read_to_string(golden.join("node.toml")).unwrap();
    let config = NodeConfig::from_toml(&toml, &golden.join("node.toml")).unwrap();
    let inventory =
        Inventory::from_json(&std::fs::read_to_string(golden.join("inventory.json")).unwrap()).unwrap();
    (config, inventory)
}

/// A GPU container (GPU 0 through CDI) with limits, as containerd writes it.
fn spec() -> Value {
    json!({
        "ociVersion": "1.2.0",
        "process": { "args": ["python3"], "env": ["PATH=/usr/bin"], "cwd": "/" },
        "annotations": {
            "io.kubernetes.cri.container-type": "container",
            "io.kubernetes.cri.container-name": "infer",
            "io.kubernetes.cri.sandbox-name": "infer-7d9f",
            "io.kubernetes.cri.sandbox-namespace": "team-a",
            "cdi.k8s.io/nvidia-device-plugin_infer": "nvidia.com/gpu=0",
            "gpu-mps.io/memory-limit": "4Gi",
            "gpu-mps.io/active-thread-percentage": "25"
        }
    })
}

fn with_annotation(key: &str, value: &str) -> Value {
    let mut s = spec();
    s["annotations"][key] = json!(value);
    s
}

fn plan_text(text: &str, id: &str) -> Result<RewritePlan, String> {
    let (config, inventory) = node();
    plan_rewrite(text, &config, &inventory, id).map_err(|e| e.to_string())
}

fn plan(spec: &Value) -> Result<RewritePlan, String> {
    plan_text(&spec.to_string(), ID)
}

/// The refusal, checked to be one line holding every one of `parts`.
fn refused(outcome: Result<RewritePlan, String>, parts: &[&str]) -> String {
    let e = match outcome {
        Ok(plan) => panic!("accepted: {}", plan.reason),
        Err(e) => e,
    };
    assert!(!e.contains(['\n', '\r']), "not one line: {e:?}");
    for part in parts {
        assert!(e.contains(part), "{e:?} does not say {part:?}");
    }
    e
}

/// The rewritten spec of an accepted GPU container.
fn rewritten(outcome: Result<RewritePlan, String>) -> Value {
    let plan = outcome.unwrap();
    serde_json::from_str(plan.rewritten.as_deref().expect("a GPU container is rewritten")).unwrap()
}

fn hook_args(spec: &Value) -> Vec<String> {
    serde_json::from_value(spec["hooks"]["createRuntime"][0]["args"].clone()).unwrap()
}

#[test]
fn the_base_spec_is_accepted() {
    let out = rewritten(plan(&spec()));
    assert_eq!(out["annotations"]["gpu-mps.io/limits"], "4Gi/25%");
}

#[test]
fn malformed_config_json_is_refused() {
    let cases: &[(&str, &[&str])] = &[
        ("", &["config.json is not valid JSON: EOF while parsing"]),
        (
            r#"{"process": {"#,
            &["config.json is not valid JSON: EOF while parsing an object"],
        ),
        ("[]", &["config.json is not a JSON object"]),
        ("null", &["config.json is not a JSON object"]),
        (
            r#"{"a":1}{"b":2}"#,
            &["config.json is not valid JSON: trailing characters"],
        ),
        (
            r#"{"annotations": ["gpu-mps.io/memory-limit=4Gi"]}"#,
            &["config.json: annotations: invalid type: sequence, expected a map"],
        ),
        (
            r#"{"annotations": {"gpu-mps.io/memory-limit": 4}}"#,
            &["config.json: annotations: invalid type: integer `4`, expected a string"],
        ),
        (
            r#"{"process": {"env": "NVIDIA_VISIBLE_DEVICES=0"}}"#,
            &[
                "config.json: process.env: invalid type: string",
                "expected a sequence",
            ],
        ),
        (
            r#"{"linux": {"devices": [{"path": "/dev/nvidia0", "type": "q"}]}}"#,
            &[
                "config.json: linux.devices: entry 0",
                "unknown variant `q`",
                "type\": c|u|b|p",
            ],
        ),
    ];
    for (text, parts) in cases {
        refused(plan_text(text, ID), parts);
    }
    // A GPU container without a process cannot be given MPS env.
    let mut no_process = spec();
    no_process.as_object_mut().unwrap().remove("process");
    refused(
        plan(&no_process),
        &["config.json has no process: a container that gets a GPU needs one"],
    );
}

#[test]
fn a_large_spec_under_the_cap_is_carried_through() {
    // 8 MiB of an annotation the shim does not read: half the cap, far beyond any real spec.
    let big = "x".repeat(8 << 20);
    let out = rewritten(plan(&with_annotation("example.com/blob", &big)));
    assert_eq!(
        out["annotations"]["example.com/blob"].as_str().map(str::len),
        Some(8 << 20)
    );
}

#[test]
fn nul_bytes_in_annotation_values() {
    refused(
        plan(&with_annotation("gpu-mps.io/memory-limit", "4Gi\0")),
        &[
            r#"annotation gpu-mps.io/memory-limit="4Gi\0""#,
            r#"has unknown suffix "Gi\0": allowed are Ki, Mi, Gi"#,
        ],
    );
    refused(
        plan(&with_annotation("gpu-mps.io/active-thread-percentage", "25\0")),
        &[r#"="25\0""#, "expected a whole number from 1 to 100"],
    );
    refused(
        plan(&with_annotation("gpu-mps.io/cuda-processes", "\0")),
        &[
            r#"annotation gpu-mps.io/cuda-processes="\0""#,
            "expected a whole number from 1 to 48",
        ],
    );
    refused(
        plan(&with_annotation(
            "cdi.k8s.io/nvidia-device-plugin_infer",
            "nvidia.com/gpu=0\0",
        )),
        &[r#"GPU "0\0" is not on this node (known: 0=GPU-"#],
    );
    // The names go into gpu-mps-hook's arguments, which cannot carry a NUL.
    for key in [
        "io.kubernetes.cri.container-name",
        "io.kubernetes.cri.sandbox-name",
        "io.kubernetes.cri.sandbox-namespace",
    ] {
        refused(
            plan(&with_annotation(key, "in\0fer")),
            &[
                &format!(r#"annotation {key}="in\0fer" holds a NUL byte"#),
                "a Kubernetes name has none",
            ],
        );
    }
    // An annotation the shim does not read is carried through as it is.
    let out = rewritten(plan(&with_annotation("example.com/note", "a\0b")));
    assert_eq!(out["annotations"]["example.com/note"], "a\0b");
}

#[test]
fn unicode_in_annotation_values_names_and_ids() {
    // Full-width digits are digits to Unicode, not to a Kubernetes quantity.
    refused(
        plan(&with_annotation("gpu-mps.io/memory-limit", "４Gi")),
        &[r#""４Gi" is not a quantity: expected a number with an optional suffix"#],
    );
    refused(
        plan(&with_annotation("gpu-mps.io/active-thread-percentage", "２５")),
        &["expected a whole number from 1 to 100"],
    );
    // Names are passed on as they are.
    let mut s = with_annotation("io.kubernetes.cri.sandbox-namespace", "équipe-α");
    s["annotations"]["io.kubernetes.cri.container-name"] = json!("推理");
    s["annotations"]["推理.gpu-mps.io/memory-limit"] = json!("8Gi");
    let out = rewritten(plan(&s));
    assert_eq!(out["annotations"]["gpu-mps.io/limits"], "8Gi/25%");
    let args = hook_args(&out);
    assert!(args.contains(&"--namespace=équipe-α".to_string()), "{args:?}");
    assert!(args.contains(&"--container-name=推理".to_string()), "{args:?}");
    // A container id names a gate dir: runc's characters only.
    refused(
        plan_text(&spec().to_string(), "容器-1"),
        &[
            r#"container id "容器-1" cannot name a gate dir: it has a character outside the allowed set"#,
            "allowed: 1 to 128 of A-Z a-z 0-9 . _ - +",
        ],
    );
}

#[test]
fn very_long_ids_names_and_values() {
    for len in [129, 256, 4097] {
        refused(
            plan_text(&spec().to_string(), &"c".repeat(len)),
            &[&format!(
                "... ({len} characters) cannot name a gate dir: it is too long (allowed: 1 to 128 of"
            )],
        );
    }
    assert!(plan_text(&spec().to_string(), &"c".repeat(128)).is_ok());
    // Kubernetes names are at most 253 characters; longer ones from ctr still work.
    let mut s = with_annotation("io.kubernetes.cri.sandbox-name", &"p".repeat(4097));
    s["annotations"]["io.kubernetes.cri.container-name"] = json!("n".repeat(4097));
    let args = hook_args(&rewritten(plan(&s)));
    assert!(args.contains(&format!("--pod={}", "p".repeat(4097))));
    let huge = format!("1{}Gi", "0".repeat(300));
    refused(
        plan(&with_annotation("gpu-mps.io/memory-limit", &huge)),
        &["is too large: a quantity is at most 18446744073709551615 bytes"],
    );
}

#[test]
fn empty_values() {
    let cases: &[(&str, &str)] = &[
        ("gpu-mps.io/memory-limit", "is not a quantity: expected a number"),
        (
            "gpu-mps.io/active-thread-percentage",
            "expected a whole number from 1 to 100",
        ),
        (
            "gpu-mps.io/cuda-processes",
            "expected a whole number from 1 to 48",
        ),
        (
            "gpu-mps-device-plugin/units",
            r#"device ID "" is not a gpu-mps.io/memory unit of this node (expected <gpu-uuid>-m<n>)"#,
        ),
    ];
    for (key, allowed) in cases {
        refused(plan(&with_annotation(key, "")), &[key, allowed]);
    }
    refused(
        plan_text(&spec().to_string(), ""),
        &[r#"container id "" cannot name a gate dir: it is empty (allowed: 1 to 128"#],
    );
    // An empty CDI value or NVIDIA_VISIBLE_DEVICES names no GPU: the container passes through.
    let plan_of = |s: &Value| plan(s).unwrap();
    let no_cdi = with_annotation("cdi.k8s.io/nvidia-device-plugin_infer", "");
    assert_eq!(plan_of(&no_cdi).rewritten, None);
    let mut empty_env = no_cdi.clone();
    empty_env["process"]["env"] = json!(["NVIDIA_VISIBLE_DEVICES="]);
    assert_eq!(plan_of(&empty_env).rewritten, None);
    // An empty container name is a container without CRI: only pod-level keys count.
    let mut s = with_annotation("io.kubernetes.cri.container-name", "");
    s["annotations"][".gpu-mps.io/memory-limit"] = json!("8Gi");
    assert_eq!(rewritten(plan(&s))["annotations"]["gpu-mps.io/limits"], "4Gi/25%");
}
