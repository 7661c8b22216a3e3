//! The parsers of annotation values a pod writes: quantities (`gpu-mps.io/memory-limit`), thread
//! percentages, CUDA process counts, the device plugin's unit IDs, and the container ids that
//! name gate dirs. Input: the value's text (annotation values are JSON strings, so UTF-8).
//! Properties: no panic; every refusal is one line; what is accepted lies in the documented
//! range, and a quantity read back from its own formatting is the same number of bytes.

#![no_main]

use gpu_mps_api::ContainerId;
use gpu_mps_api::limits::{self, MAX_CUDA_PROCESSES, MIN_MEMORY_LIMIT_BYTES};
use gpu_mps_api::memory_units::{self, UnitLayout};
use gpu_mps_api::quantity;
use gpu_mps_fuzz::{assert_one_line, nodes};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(value) = std::str::from_utf8(data) else {
        return;
    };

    match quantity::parse_bytes(value) {
        Ok(bytes) => {
            let formatted = quantity::format_bytes(bytes);
            assert_eq!(
                quantity::parse_bytes(&formatted),
                Ok(bytes),
                "{value:?} -> {bytes} -> {formatted:?}"
            );
        }
        Err(e) => assert_one_line(&e),
    }

    match limits::parse_memory_limit(value) {
        Ok(bytes) => {
            assert!(bytes >= MIN_MEMORY_LIMIT_BYTES, "{value:?} -> {bytes}");
            assert_eq!(quantity::parse_bytes(value), Ok(bytes), "{value:?}");
        }
        Err(e) => assert_one_line(&e),
    }

    match limits::parse_thread_percentage(value) {
        Ok(p) => assert!((1..=100).contains(&p), "{value:?} -> {p}"),
        Err(e) => assert_one_line(&e),
    }

    match limits::parse_cuda_processes(value) {
        Ok(n) => assert!((1..=MAX_CUDA_PROCESSES).contains(&n), "{value:?} -> {n}"),
        Err(e) => assert_one_line(&e),
    }

    match ContainerId::parse(value) {
        Ok(id) => {
            assert_eq!(id.as_str(), value);
            assert!(!value.is_empty() && value.len() <= gpu_mps_api::container_id::MAX_LEN);
            assert!(!value.contains('/') && value != "." && value != "..", "{value:?}");
            let gate = id.gate_name();
            assert!(
                gate.len() == 16 && gate.bytes().all(|b| b.is_ascii_hexdigit()),
                "{gate}"
            );
        }
        Err(e) => assert_one_line(&e),
    }

    match memory_units::parse_unit_list(value) {
        Ok(units) => assert_eq!(
            memory_units::parse_unit_list(&memory_units::format_unit_list(&units)),
            Ok(units)
        ),
        Err(e) => assert_one_line(&e),
    }

    // The device plugin's allocation annotation, against the golden node's units.
    let node = &nodes()[0];
    let policy = node
        .config
        .device_plugin
        .unit_policy(node.config.limits.overcommit, node.config.limits.max_clients_per_gpu);
    let layout = UnitLayout::new(&node.inventory.gpus, &policy).expect("the golden GPUs have units");
    let ids: Vec<String> = value.split(',').map(str::to_string).collect();
    match layout.allocation(&ids) {
        Ok(allocation) => {
            assert!(!allocation.units.is_empty());
            assert_eq!(
                allocation.memory_bytes,
                allocation.units.len() as u64 * layout.unit_bytes
            );
            assert!(
                ids.len() == allocation.units.len(),
                "{value:?}: every ID is one unit"
            );
        }
        Err(e) => assert_one_line(&e),
    }
});
