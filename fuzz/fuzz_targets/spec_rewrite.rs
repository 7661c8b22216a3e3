//! The shim's whole decision for one config.json (`plan_rewrite`): parse, find the GPUs,
//! resolve the limits, rewrite. Input: one byte choosing the node (the shim's golden setups,
//! gpu_mps_fuzz::nodes), then the config.json text; the seed corpus is the golden input.json
//! files behind each node. Properties: gpu_mps_fuzz::check_plan.

#![no_main]

use gpu_mps_fuzz::{check_plan, nodes};
use libfuzzer_sys::fuzz_target;

/// The id the golden cases are created as.
const CONTAINER_ID: &str = "golden-container-1";

fuzz_target!(|data: &[u8]| {
    let Some((&node, text)) = data.split_first() else {
        return;
    };
    // config.json is read as UTF-8 text; other bytes fail the read, before any parsing.
    let Ok(text) = std::str::from_utf8(text) else {
        return;
    };
    let nodes = nodes();
    check_plan(text, &nodes[usize::from(node) % nodes.len()], CONTAINER_ID);
});
