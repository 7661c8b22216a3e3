//! What every fuzz target checks, and the nodes the spec targets plan against.
//!
//! The nodes are the shim's golden test setups (shim/tests/golden), read at build time, so that
//! the seed corpus (the golden config.json files) reaches the same code it reaches there.

use std::fmt::Display;
use std::path::Path;
use std::sync::OnceLock;

use gpu_mps_api::NodeConfig;
use gpu_mps_api::inventory::Inventory;

/// Every error a user can cause is read as one line (kubectl describe, runc's log, a journal):
/// its text must hold no line break.
pub fn assert_one_line(error: &dyn Display) {
    let text = error.to_string();
    assert!(
        !text.contains(['\n', '\r']),
        "an error message is not one line: {text:?}"
    );
}

/// A node config and GPU inventory a spec is planned against.
#[derive(Debug)]
pub struct Node {
    pub name: &'static str,
    pub config: NodeConfig,
    pub inventory: Inventory,
}

const GOLDEN_NODE: &str = include_str!("../../shim/tests/golden/node.toml");
const DEFAULTS_NODE: &str = include_str!("../../shim/tests/golden/node-default/node.toml");
const EXACT_NODE: &str = include_str!("../../shim/tests/golden/exact-gate-dir/node.toml");
const INVENTORY: &str = include_str!("../../shim/tests/golden/inventory.json");
const MINORS_NOT_INDICES: &str =
    include_str!("../../shim/tests/golden/devices-minor-not-index/inventory.json");
const MIG_ON_GPU_1: &str = include_str!("../../shim/tests/golden/error-mig-enabled-gpu/inventory.json");
/// The device plugin's units need policy exact; defaults so that a unit-less spec reaches the
/// refusal for missing units rather than for missing limits.
const DEVICE_PLUGIN_NODE: &str = "[limits]\ndefault_memory_limit = \"2Gi\"\ndefault_active_thread_percentage = 10\n[device_plugin]\nenabled = true\n";

/// The nodes, parsed once per fuzzing process.
pub fn nodes() -> &'static [Node] {
    static NODES: OnceLock<Vec<Node>> = OnceLock::new();
    NODES.get_or_init(|| {
        let node = |name, toml: &str, inventory: &str| Node {
            name,
            config: NodeConfig::from_toml(toml, Path::new(name))
                .unwrap_or_else(|e| panic!("golden node config {name}: {e}")),
            inventory: Inventory::from_json(inventory)
                .unwrap_or_else(|e| panic!("golden inventory of {name}: {e}")),
        };
        vec![
            node("golden", GOLDEN_NODE, INVENTORY),
            node("node-default", DEFAULTS_NODE, INVENTORY),
            node("exact", EXACT_NODE, MINORS_NOT_INDICES),
            node("device-plugin", DEVICE_PLUGIN_NODE, INVENTORY),
            node("mig-on-gpu-1", DEFAULTS_NODE, MIG_ON_GPU_1),
        ]
    })
}

/// Fields of config.json the rewrite may change; every other top-level field is carried
/// through as it came.
const REWRITTEN_FIELDS: [&str; 5] = ["process", "mounts", "linux", "hooks", "annotations"];

/// Plans `spec_text` as `create` of `container_id` on `node` and checks the plan: a refusal is
/// one line; a rewrite is a JSON object that keeps every field the shim does not own, and
/// planning it again changes nothing (a create retried on the same bundle must not stack
/// hooks or env entries).
pub fn check_plan(spec_text: &str, node: &Node, container_id: &str) {
    let plan = match gpu_mps_shim::plan_rewrite(spec_text, &node.config, &node.inventory, container_id) {
        Ok(plan) => plan,
        Err(e) => {
            assert_one_line(&e);
            return;
        }
    };
    let Some(rewritten) = plan.rewritten else {
        assert!(
            plan.daemon.is_none() && plan.acquire.is_none(),
            "a passthrough holds no daemon"
        );
        return;
    };
    if plan.daemon.is_none() {
        // A container without a GPU whose NVIDIA_VISIBLE_DEVICES=all was set to void: no
        // limits, no hook, and planned again it passes through as it is.
        assert!(
            plan.acquire.is_none() && plan.limits.is_none(),
            "a container without a GPU got limits"
        );
        let again = gpu_mps_shim::plan_rewrite(&rewritten, &node.config, &node.inventory, container_id)
            .unwrap_or_else(|e| panic!("the voided spec is refused: {e}"));
        assert_eq!(again.rewritten, None, "a voided spec was rewritten again");
        return;
    }
    let input: serde_json::Value = serde_json::from_str(spec_text).expect("a planned spec is JSON");
    let output: serde_json::Value = serde_json::from_str(&rewritten).expect("the rewritten spec is JSON");
    let (Some(input), Some(output)) = (input.as_object(), output.as_object()) else {
        panic!("a rewritten spec is not an object");
    };
    for (key, value) in input {
        if !REWRITTEN_FIELDS.contains(&key.as_str()) {
            assert_eq!(
                output.get(key),
                Some(value),
                "field {key} was not carried through"
            );
        }
    }
    let limits = plan.limits.expect("a rewrite has limits");
    assert!((1..=100).contains(&limits.thread_percentage), "{limits:?}");
    assert!(
        plan.daemon.is_some_and(|d| !d.gpu_uuids().is_empty()),
        "a rewrite has GPUs"
    );

    let again = gpu_mps_shim::plan_rewrite(&rewritten, &node.config, &node.inventory, container_id)
        .unwrap_or_else(|e| panic!("the rewritten spec is refused: {e}"));
    assert_eq!(
        again.rewritten.as_deref(),
        Some(rewritten.as_str()),
        "a second rewrite changed the spec"
    );
}
