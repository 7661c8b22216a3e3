//! The shim's limit resolution: a container's annotations (container-level, pod-level, other
//! keys) against the node's defaults and maximums, with or without the device plugin's units.
//! Structured input, so that most runs carry the keys the resolution reads and values near
//! what it accepts. Properties: no panic; every refusal is one line; what is resolved lies
//! within the node's maximums and MPS's ranges and names where each value came from.

#![no_main]

use std::collections::HashMap;

use arbitrary::Arbitrary;
use gpu_mps_api::Limits;
use gpu_mps_api::annotations::{self, ACTIVE_THREAD_PERCENTAGE, CUDA_PROCESSES, MEMORY_LIMIT};
use gpu_mps_api::limits::MAX_CUDA_PROCESSES;
use gpu_mps_api::maxima::Maxima;
use gpu_mps_fuzz::assert_one_line;
use gpu_mps_shim::request::{self, AllocatedMemory, LimitSource, NodeRules, ResolvedLimits};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
enum ContainerName {
    /// Not from CRI (ctr): only pod-level keys count.
    None,
    Infer,
    Other(String),
}

#[derive(Debug, Arbitrary)]
enum Field {
    Memory,
    Threads,
    Processes,
}

#[derive(Debug, Arbitrary)]
enum Key {
    Pod(Field),
    /// `<this container's name>.gpu-mps.io/<field>`.
    Container(Field),
    /// Another container's key, or anything else.
    Other(String),
}

#[derive(Debug, Arbitrary)]
enum Suffix {
    None,
    Ki,
    Mi,
    Gi,
    G,
    Exponent(u8),
    Other(String),
}

#[derive(Debug, Arbitrary)]
enum Value {
    Quantity(u32, Suffix),
    Number(i64),
    Text(String),
}

#[derive(Debug, Arbitrary)]
struct Input {
    container_name: ContainerName,
    annotations: Vec<(Key, Value)>,
    default_limits: Option<(u64, u32)>,
    default_cuda_processes: u32,
    max_memory_bytes: Option<u64>,
    max_thread_percentage: u8,
    max_cuda_processes: u32,
    allocated: Option<Allocated>,
}

#[derive(Debug, Arbitrary)]
struct Allocated {
    units: u8,
    unit_mib: u16,
    min_units_per_process: u8,
    default_thread_percentage: u8,
}

fn base(field: &Field) -> &'static str {
    match field {
        Field::Memory => MEMORY_LIMIT,
        Field::Threads => ACTIVE_THREAD_PERCENTAGE,
        Field::Processes => CUDA_PROCESSES,
    }
}

fn text(value: Value) -> String {
    match value {
        Value::Quantity(n, suffix) => {
            let suffix = match suffix {
                Suffix::None => String::new(),
                Suffix::Ki => "Ki".into(),
                Suffix::Mi => "Mi".into(),
                Suffix::Gi => "Gi".into(),
                Suffix::G => "G".into(),
                Suffix::Exponent(e) => format!("e{e}"),
                Suffix::Other(s) => s,
            };
            format!("{n}{suffix}")
        }
        Value::Number(n) => n.to_string(),
        Value::Text(s) => s,
    }
}

/// Whether `source` is one of the places a value may come from for `field`.
fn source_is_valid(source: &LimitSource, container_name: &str, field: &str, allocated: bool) -> bool {
    match source {
        LimitSource::ContainerAnnotation(key) => {
            !container_name.is_empty() && *key == annotations::container_key(container_name, field)
        }
        LimitSource::PodAnnotation(key) => key == field,
        LimitSource::NodeDefault => true,
        LimitSource::DevicePlugin(_) | LimitSource::MemoryShare(_) => allocated,
    }
}

fuzz_target!(|input: Input| {
    let container_name = match input.container_name {
        ContainerName::None => String::new(),
        ContainerName::Infer => "infer".to_string(),
        ContainerName::Other(name) => name,
    };
    let annotations: HashMap<String, String> = input
        .annotations
        .into_iter()
        .map(|(key, value)| {
            let key = match key {
                Key::Pod(field) => base(&field).to_string(),
                Key::Container(field) => annotations::container_key(&container_name, base(&field)),
                Key::Other(key) => key,
            };
            (key, text(value))
        })
        .collect();
    // The node config refuses defaults and maximums out of range (node_config fuzzes that):
    // the rules here are ones a node can have.
    let default_limits = input
        .default_limits
        .and_then(|(memory, threads)| Limits::checked(memory, threads).ok());
    let default_cuda_processes = input.default_cuda_processes % MAX_CUDA_PROCESSES + 1;
    let maxima = Maxima {
        memory_bytes: input.max_memory_bytes,
        thread_percentage: input.max_thread_percentage % 100 + 1,
        cuda_processes: input.max_cuda_processes % MAX_CUDA_PROCESSES + 1,
    };
    let rules = NodeRules {
        default_limits,
        default_cuda_processes,
        maxima,
        maxima_scope: "this node",
    };

    let allocated = input.allocated.map(|a| {
        let units = u32::from(a.units);
        AllocatedMemory {
            memory_bytes: u64::from(units) * (u64::from(a.unit_mib) << 20),
            units,
            min_units_per_process: u32::from(a.min_units_per_process).max(1),
            max_clients_per_gpu: 48,
            default_thread_percentage: a.default_thread_percentage % 100 + 1,
            thread_share_factor: 2.0,
        }
    });
    let resolved = match allocated {
        Some(allocated) => request::resolve_allocated_limits(&annotations, &container_name, rules, allocated),
        None => request::resolve_limits(&annotations, &container_name, rules),
    };
    let ResolvedLimits {
        limits,
        cuda_processes,
        memory_source,
        threads_source,
        processes_source,
    } = match resolved {
        Ok(resolved) => resolved,
        Err(e) => {
            assert_one_line(&e);
            return;
        }
    };
    assert!((1..=100).contains(&limits.thread_percentage), "{limits:?}");
    assert!(
        (1..=MAX_CUDA_PROCESSES).contains(&cuda_processes),
        "{cuda_processes}"
    );
    let checked = match allocated {
        Some(a) => {
            assert_eq!(limits.memory_bytes, a.memory_bytes);
            assert!(a.units >= cuda_processes * a.min_units_per_process);
            maxima.for_allocated_units()
        }
        None => maxima,
    };
    assert_eq!(
        checked.check(limits, cuda_processes, "this node"),
        Ok(()),
        "resolved limits break the maximums"
    );
    let from_plugin = allocated.is_some();
    assert!(source_is_valid(
        &memory_source,
        &container_name,
        MEMORY_LIMIT,
        from_plugin
    ));
    assert!(source_is_valid(
        &threads_source,
        &container_name,
        ACTIVE_THREAD_PERCENTAGE,
        from_plugin
    ));
    assert!(source_is_valid(
        &processes_source,
        &container_name,
        CUDA_PROCESSES,
        false
    ));
    if from_plugin {
        assert_eq!(
            memory_source,
            LimitSource::DevicePlugin(allocated.map_or(0, |a| a.units))
        );
    }
});
