//! The limits a container asks for, resolved per field from its annotations and the node
//! default, and who is asking (namespace, pod, container) for the manager.
//!
//! Per field: `<container-name>.gpu-mps.io/<field>` (container-level), then `gpu-mps.io/<field>`
//! (pod-level, or `ctr run --annotation`), then the node default. Fields: memory-limit (the
//! container's total), active-thread-percentage, cuda-processes. Then the node's maximums for
//! the container's namespace.

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;

use gpu_mps_api::Limits;
use gpu_mps_api::annotations::{
    self, ACTIVE_THREAD_PERCENTAGE, ALLOCATED_UNITS, CLIENT_PRIORITY, CRI_CONTAINER_NAME, CRI_SANDBOX_NAME,
    CRI_SANDBOX_NAMESPACE, CUDA_PROCESSES, MEMORY_LIMIT,
};
use gpu_mps_api::container_request::{ClientPriority, ContainerRequest, PodIdentity};
use gpu_mps_api::limits::{self, LimitError};
use gpu_mps_api::maxima::{Maxima, MaximaError};
use gpu_mps_api::message::printable;
use thiserror::Error;

/// Where the value of one limit came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimitSource {
    /// `<container-name>.gpu-mps.io/<field>`; the key.
    ContainerAnnotation(String),
    /// `gpu-mps.io/<field>`; the key.
    PodAnnotation(String),
    NodeDefault,
    /// gpu-mps-device-plugin's allocation: this many units of `gpu-mps.io/memory`.
    DevicePlugin(u32),
    /// A multiple of the memory share the device plugin allocated (`device_plugin.default_thread_share_factor`).
    MemoryShare(String),
}

impl fmt::Display for LimitSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LimitSource::ContainerAnnotation(key) => write!(f, "container annotation {}", printable(key)),
            LimitSource::PodAnnotation(key) => write!(f, "annotation {}", printable(key)),
            LimitSource::NodeDefault => f.write_str("node default"),
            LimitSource::DevicePlugin(units) => {
                write!(f, "device plugin allocation ({units} units of gpu-mps.io/memory)")
            }
            LimitSource::MemoryShare(factor) => write!(f, "{factor} x the allocated memory share"),
        }
    }
}

/// The limits and where each came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedLimits {
    /// The container's limits: memory is the total of its CUDA processes.
    pub limits: Limits,
    pub cuda_processes: u32,
    pub memory_source: LimitSource,
    pub threads_source: LimitSource,
    pub processes_source: LimitSource,
}

impl ResolvedLimits {
    /// What each CUDA process of the container gets.
    pub fn per_process(&self) -> Limits {
        self.limits.per_process(self.cuda_processes)
    }
}

/// Who the container is, from the CRI plugin's annotations; empty strings when absent (ctr).
pub fn identity_from_annotations(annotations: &HashMap<String, String>) -> PodIdentity {
    let get = |key: &str| annotations.get(key).cloned().unwrap_or_default();
    PodIdentity {
        namespace: get(CRI_SANDBOX_NAMESPACE),
        pod: get(CRI_SANDBOX_NAME),
        container_name: get(CRI_CONTAINER_NAME),
    }
}

/// The names go into the createRuntime hook's arguments, which runc passes to exec as C
/// strings: a NUL byte would fail the hook with only "invalid argument", after the spec was
/// written.
pub fn check_names_for_hook(identity: &PodIdentity) -> Result<(), RequestError> {
    let names = [
        (CRI_SANDBOX_NAMESPACE, &identity.namespace),
        (CRI_SANDBOX_NAME, &identity.pod),
        (CRI_CONTAINER_NAME, &identity.container_name),
    ];
    match names.into_iter().find(|(_, value)| value.contains('\0')) {
        Some((key, value)) => Err(RequestError::NulInName {
            key,
            value: value.clone(),
        }),
        None => Ok(()),
    }
}

/// Everything the rewrite needs to know about one GPU container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedRequest {
    /// What the container asks of the node: what the hook carries to the manager.
    pub container: ContainerRequest,
    /// The host directory mounted at /tmp/nvidia-mps: the container's gate dir, under every
    /// policy (docs/adr/0006).
    pub gate_dir: PathBuf,
    /// The GPUs came from sources the pod cannot write, and its own `NVIDIA_VISIBLE_DEVICES`
    /// names devices: it is set to these GPUs, so that a runtime after the shim
    /// (nvidia-container-runtime) does not hand the container the GPUs the pod wrote there.
    pub narrow_visible_devices: bool,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum RequestError {
    #[error(
        "annotation {key}={value:?} holds a NUL byte, which the arguments of gpu-mps-hook cannot carry: a Kubernetes name has none (fix what wrote the spec)"
    )]
    NulInName { key: &'static str, value: String },
    #[error("annotation {}={value:?}: {error} (set it on the pod)", printable(.key))]
    Invalid {
        key: String,
        value: String,
        error: LimitError,
    },
    #[error(
        "no {field} for {who}: set the pod annotation {pod_key} ({allowed}){container_hint}, or a node default ({config_key} in the gpu-mps node config)"
    )]
    Missing {
        field: &'static str,
        who: String,
        pod_key: &'static str,
        allowed: &'static str,
        container_hint: String,
        config_key: &'static str,
    },
    /// A key under gpu-mps.io/ that gpu-mps does not read (a typo, most likely).
    #[error("{0}")]
    UnknownKey(annotations::UnknownKey),
    #[error("{} gpu-mps annotations are invalid: {}", .0.len(), join_errors(.0))]
    SeveralInvalid(Vec<RequestError>),
    #[error("{0}")]
    AboveMaximum(MaximaError),
    #[error(
        "{processes} CUDA processes need at least {needed} units of gpu-mps.io/memory on this node ({min} each: MPS serves {max_clients} clients per GPU), and the container got {units}: ask for {needed} units, or set fewer processes ({key})"
    )]
    TooFewUnitsPerProcess {
        processes: u32,
        units: u32,
        min: u32,
        needed: u32,
        max_clients: u32,
        key: &'static str,
    },
}

fn join_errors(errors: &[RequestError]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Checks every limit annotation the container has (its container-level ones and the pod-level
/// ones), before anything of the node is read: a bad value is the pod's to fix whatever state the
/// node is in, and the pod learns of every bad one at once. Under a device plugin allocation the
/// memory comes from the units, so a memory-limit annotation is not read (nor checked).
/// A key in gpu-mps's domain that it does not read is refused, whichever container it names.
pub fn check_annotations(
    annotations: &HashMap<String, String>,
    container_name: &str,
) -> Result<(), RequestError> {
    let mut errors: Vec<RequestError> = annotations::unknown_keys(annotations.keys())
        .into_iter()
        .map(RequestError::UnknownKey)
        .collect();
    if !annotations.contains_key(ALLOCATED_UNITS) {
        check_field(&MEMORY, annotations, container_name, &mut errors);
    }
    check_field(&THREADS, annotations, container_name, &mut errors);
    check_field(&PROCESSES, annotations, container_name, &mut errors);
    check_field(&PRIORITY, annotations, container_name, &mut errors);
    match errors.len() {
        0 => Ok(()),
        1 => Err(errors.remove(0)),
        _ => Err(RequestError::SeveralInvalid(errors)),
    }
}

fn check_field<T>(
    field: &Field<T>,
    annotations: &HashMap<String, String>,
    container_name: &str,
    errors: &mut Vec<RequestError>,
) {
    for (key, _) in field_keys(field, container_name) {
        if let Some(value) = annotations.get(&key) {
            if let Err(error) = (field.parse)(value) {
                errors.push(RequestError::Invalid {
                    key,
                    value: value.clone(),
                    error,
                });
            }
        }
    }
}

/// The keys of `field` that apply to the container, container-level first (`true`).
fn field_keys<T>(field: &Field<T>, container_name: &str) -> Vec<(String, bool)> {
    let mut keys = Vec::with_capacity(2);
    if !container_name.is_empty() {
        keys.push((annotations::container_key(container_name, field.base), true));
    }
    keys.push((field.base.to_string(), false));
    keys
}

/// What gpu-mps-device-plugin gave the container, and the node's rules for units.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AllocatedMemory {
    pub memory_bytes: u64,
    pub units: u32,
    pub min_units_per_process: u32,
    pub max_clients_per_gpu: u32,
    /// The default active thread percentage (a multiple of the memory share) and its factor.
    pub default_thread_percentage: u8,
    pub thread_share_factor: f64,
}

/// Resolves the limits of a container the device plugin allocated units to: its memory is the
/// units' (whatever its annotations say: it cannot take more than it was scheduled for), its
/// thread cap and process count come from annotations or defaults. Every process must hold the
/// node's minimum of units, so that a GPU never has more processes than MPS serves.
pub fn resolve_allocated_limits(
    annotations: &HashMap<String, String>,
    container_name: &str,
    rules: NodeRules<'_>,
    allocated: AllocatedMemory,
) -> Result<ResolvedLimits, RequestError> {
    let (thread_percentage, threads_source) = match resolve_field(
        &THREADS,
        annotations,
        container_name,
        Some(allocated.default_thread_percentage),
    )? {
        (v, LimitSource::NodeDefault) => (
            v,
            LimitSource::MemoryShare(allocated.thread_share_factor.to_string()),
        ),
        other => other,
    };
    let (cuda_processes, processes_source) = resolve_field(
        &PROCESSES,
        annotations,
        container_name,
        Some(rules.default_cuda_processes),
    )?;
    let needed = cuda_processes.saturating_mul(allocated.min_units_per_process);
    if allocated.units < needed {
        return Err(RequestError::TooFewUnitsPerProcess {
            processes: cuda_processes,
            units: allocated.units,
            min: allocated.min_units_per_process,
            needed,
            max_clients: allocated.max_clients_per_gpu,
            key: CUDA_PROCESSES,
        });
    }
    let limits = Limits {
        memory_bytes: allocated.memory_bytes,
        thread_percentage,
    };
    rules
        .maxima
        .for_allocated_units()
        .check(limits, cuda_processes, rules.maxima_scope)
        .map_err(RequestError::AboveMaximum)?;
    Ok(ResolvedLimits {
        limits,
        cuda_processes,
        memory_source: LimitSource::DevicePlugin(allocated.units),
        threads_source,
        processes_source,
    })
}

/// One limit field: its annotation, how to parse it, and how to explain it.
struct Field<T> {
    base: &'static str,
    describe: &'static str,
    allowed: &'static str,
    config_key: &'static str,
    parse: fn(&str) -> Result<T, LimitError>,
}

const MEMORY: Field<u64> = Field {
    base: MEMORY_LIMIT,
    describe: "memory limit",
    allowed: "a Kubernetes quantity of at least 64Mi, e.g. 4Gi",
    config_key: "limits.default_memory_limit",
    parse: limits::parse_memory_limit,
};

const THREADS: Field<u8> = Field {
    base: ACTIVE_THREAD_PERCENTAGE,
    describe: "active thread percentage",
    allowed: "a whole number from 1 to 100",
    config_key: "limits.default_active_thread_percentage",
    parse: limits::parse_thread_percentage,
};

const PROCESSES: Field<u32> = Field {
    base: CUDA_PROCESSES,
    describe: "number of CUDA processes",
    allowed: "a whole number from 1 to 48",
    config_key: "limits.default_cuda_processes",
    parse: limits::parse_cuda_processes,
};

const PRIORITY: Field<ClientPriority> = Field {
    base: CLIENT_PRIORITY,
    describe: "client priority",
    allowed: "normal or below-normal",
    // Never missing: without an annotation the priority is MPS's own default, normal.
    config_key: "none",
    parse: ClientPriority::parse,
};

/// The MPS client priority of the container's processes: its annotation, else normal.
pub fn resolve_priority(
    annotations: &HashMap<String, String>,
    container_name: &str,
) -> Result<(ClientPriority, LimitSource), RequestError> {
    resolve_field(
        &PRIORITY,
        annotations,
        container_name,
        Some(ClientPriority::Normal),
    )
}

/// What a container may ask for at most, and the defaults of what it does not ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRules<'a> {
    pub default_limits: Option<Limits>,
    pub default_cuda_processes: u32,
    pub maxima: Maxima,
    /// Whose maximums they are, for the message: "this node", "namespace team-a".
    pub maxima_scope: &'a str,
}

/// Resolves the limits and the number of CUDA processes, and checks them against the node's
/// maximums; `container_name` is empty when the spec does not come from CRI.
pub fn resolve_limits(
    annotations: &HashMap<String, String>,
    container_name: &str,
    rules: NodeRules<'_>,
) -> Result<ResolvedLimits, RequestError> {
    let defaults = rules.default_limits;
    let (memory_bytes, memory_source) = resolve_field(
        &MEMORY,
        annotations,
        container_name,
        defaults.map(|l| l.memory_bytes),
    )?;
    let (thread_percentage, threads_source) = resolve_field(
        &THREADS,
        annotations,
        container_name,
        defaults.map(|l| l.thread_percentage),
    )?;
    let (cuda_processes, processes_source) = resolve_field(
        &PROCESSES,
        annotations,
        container_name,
        Some(rules.default_cuda_processes),
    )?;
    let limits = Limits {
        memory_bytes,
        thread_percentage,
    };
    rules
        .maxima
        .check(limits, cuda_processes, rules.maxima_scope)
        .map_err(RequestError::AboveMaximum)?;
    Ok(ResolvedLimits {
        limits,
        cuda_processes,
        memory_source,
        threads_source,
        processes_source,
    })
}

fn resolve_field<T>(
    field: &Field<T>,
    annotations: &HashMap<String, String>,
    container_name: &str,
    node_default: Option<T>,
) -> Result<(T, LimitSource), RequestError> {
    for (key, container_level) in field_keys(field, container_name) {
        if let Some(value) = annotations.get(&key) {
            let parsed = (field.parse)(value).map_err(|error| RequestError::Invalid {
                key: key.clone(),
                value: value.clone(),
                error,
            })?;
            let source = if container_level {
                LimitSource::ContainerAnnotation(key)
            } else {
                LimitSource::PodAnnotation(key)
            };
            return Ok((parsed, source));
        }
    }
    match node_default {
        Some(value) => Ok((value, LimitSource::NodeDefault)),
        None => Err(RequestError::Missing {
            field: field.describe,
            who: if container_name.is_empty() {
                "this container".into()
            } else {
                format!("container {container_name:?}")
            },
            pod_key: field.base,
            allowed: field.allowed,
            container_hint: if container_name.is_empty() {
                String::new()
            } else {
                format!(
                    " or {} for this container only",
                    printable(&annotations::container_key(container_name, field.base))
                )
            },
            config_key: field.config_key,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GI: u64 = 1 << 30;

    fn annotations(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn default() -> Option<Limits> {
        Some(Limits {
            memory_bytes: 2 * GI,
            thread_percentage: 10,
        })
    }

    fn rules(default_limits: Option<Limits>) -> NodeRules<'static> {
        NodeRules {
            default_limits,
            default_cuda_processes: 1,
            maxima: Maxima::default(),
            maxima_scope: "this node",
        }
    }

    fn allocated(units: u32) -> AllocatedMemory {
        AllocatedMemory {
            memory_bytes: u64::from(units) * GI,
            units,
            min_units_per_process: 3,
            max_clients_per_gpu: 48,
            default_thread_percentage: 12,
            thread_share_factor: 2.0,
        }
    }

    #[test]
    fn every_bad_annotation_is_reported_at_once() {
        let a = annotations(&[
            (MEMORY_LIMIT, "4GB"),
            ("infer.gpu-mps.io/active-thread-percentage", "0"),
            (CUDA_PROCESSES, "many"),
        ]);
        let e = check_annotations(&a, "infer").unwrap_err().to_string();
        for needle in [
            "3 gpu-mps annotations are invalid",
            "gpu-mps.io/memory-limit=\"4GB\"",
            "infer.gpu-mps.io/active-thread-percentage=\"0\"",
            "gpu-mps.io/cuda-processes=\"many\"",
        ] {
            assert!(e.contains(needle), "{needle:?} not in {e}");
        }
        assert!(!e.contains('\n'), "{e}");
        // One bad field: the message it always had.
        let one = check_annotations(&annotations(&[(MEMORY_LIMIT, "4GB")]), "").unwrap_err();
        assert!(matches!(one, RequestError::Invalid { .. }), "{one}");
        // Another container's annotation is not this container's business.
        assert_eq!(
            check_annotations(&annotations(&[("other.gpu-mps.io/memory-limit", "4GB")]), "infer"),
            Ok(())
        );
        assert_eq!(
            check_annotations(&annotations(&[(MEMORY_LIMIT, "4Gi")]), "infer"),
            Ok(())
        );
    }

    #[test]
    fn an_unknown_key_is_refused_with_the_nearest_known_one() {
        let e = check_annotations(&annotations(&[("gpu-mps.io/memry-limit", "16Gi")]), "infer")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(
                "unknown annotation gpu-mps.io/memry-limit (did you mean gpu-mps.io/memory-limit?): "
            ),
            "{e}"
        );
        // Another container's misspelled key too, and with a bad value: every one at once.
        let a = annotations(&[
            ("sidecar.gpu-mps.io/memory-limt", "1Gi"),
            (ACTIVE_THREAD_PERCENTAGE, "abc"),
        ]);
        let e = check_annotations(&a, "infer").unwrap_err().to_string();
        assert!(e.starts_with("2 gpu-mps annotations are invalid: "), "{e}");
        assert!(
            e.contains("unknown annotation sidecar.gpu-mps.io/memory-limt (did you mean sidecar.gpu-mps.io/memory-limit?)"),
            "{e}"
        );
        assert!(!e.contains('\n'), "{e}");
        // Also under a device plugin allocation, where memory-limit itself is not read.
        let a = annotations(&[(ALLOCATED_UNITS, "0,1"), ("gpu-mps.io/cuda-processess", "2")]);
        assert!(matches!(
            check_annotations(&a, "infer"),
            Err(RequestError::UnknownKey(_))
        ));
    }

    #[test]
    fn allocated_units_set_the_memory_over_any_annotation() {
        let a = annotations(&[(MEMORY_LIMIT, "64Gi"), ("infer.gpu-mps.io/memory-limit", "32Gi")]);
        let r = resolve_allocated_limits(&a, "infer", rules(None), allocated(8)).unwrap();
        assert_eq!(r.limits.memory_bytes, 8 * GI);
        assert_eq!(r.memory_source, LimitSource::DevicePlugin(8));
        assert_eq!(r.limits.thread_percentage, 12);
        assert_eq!(r.threads_source, LimitSource::MemoryShare("2".into()));
        assert_eq!(
            r.memory_source.to_string(),
            "device plugin allocation (8 units of gpu-mps.io/memory)"
        );
        let a = annotations(&[(ACTIVE_THREAD_PERCENTAGE, "50")]);
        let r = resolve_allocated_limits(&a, "infer", rules(None), allocated(8)).unwrap();
        assert_eq!(r.limits.thread_percentage, 50);
    }

    #[test]
    fn every_process_needs_the_minimum_of_units() {
        let a = annotations(&[(CUDA_PROCESSES, "3")]);
        let e = resolve_allocated_limits(&a, "infer", rules(None), allocated(8))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("3 CUDA processes need at least 9 units") && e.contains("got 8"),
            "{e}"
        );
        assert!(resolve_allocated_limits(&a, "infer", rules(None), allocated(9)).is_ok());
    }

    #[test]
    fn thread_and_process_maximums_still_hold_for_allocated_containers() {
        let mut node = rules(None);
        node.maxima = Maxima {
            memory_bytes: Some(GI),
            thread_percentage: 10,
            cuda_processes: 4,
        };
        // The memory maximum is the scheduler's business once units are allocated.
        let a = annotations(&[(ACTIVE_THREAD_PERCENTAGE, "10")]);
        assert!(resolve_allocated_limits(&a, "infer", node, allocated(8)).is_ok());
        let a = annotations(&[(ACTIVE_THREAD_PERCENTAGE, "11")]);
        assert!(resolve_allocated_limits(&a, "infer", node, allocated(8)).is_err());
    }

    #[test]
    fn cuda_processes_come_from_annotations_or_the_node_default() {
        let a = annotations(&[(MEMORY_LIMIT, "4Gi"), (CUDA_PROCESSES, "4")]);
        let r = resolve_limits(&a, "infer", rules(default())).unwrap();
        assert_eq!(r.cuda_processes, 4);
        assert_eq!(
            r.processes_source,
            LimitSource::PodAnnotation(CUDA_PROCESSES.into())
        );
        assert_eq!(r.per_process().memory_bytes, GI);
        let a = annotations(&[(CUDA_PROCESSES, "4"), ("infer.gpu-mps.io/cuda-processes", "2")]);
        assert_eq!(
            resolve_limits(&a, "infer", rules(default()))
                .unwrap()
                .cuda_processes,
            2
        );
        let mut node = rules(default());
        node.default_cuda_processes = 3;
        let r = resolve_limits(&HashMap::new(), "infer", node).unwrap();
        assert_eq!(
            (r.cuda_processes, r.processes_source),
            (3, LimitSource::NodeDefault)
        );
        let e = resolve_limits(&annotations(&[(CUDA_PROCESSES, "0")]), "infer", rules(default()))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("annotation gpu-mps.io/cuda-processes=\"0\": ") && e.contains("1 to 48"),
            "{e}"
        );
    }

    #[test]
    fn the_node_maximums_refuse_with_one_line() {
        let mut node = rules(default());
        node.maxima = Maxima {
            memory_bytes: Some(4 * GI),
            thread_percentage: 50,
            cuda_processes: 2,
        };
        node.maxima_scope = "namespace team-a";
        let e = resolve_limits(&annotations(&[(MEMORY_LIMIT, "8Gi")]), "infer", node)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "memory limit 8Gi is above the maximum 4Gi for namespace team-a (limits.max_memory_limit in the gpu-mps node config)"
        );
        assert!(resolve_limits(&annotations(&[(ACTIVE_THREAD_PERCENTAGE, "75")]), "infer", node).is_err());
        assert!(resolve_limits(&annotations(&[(CUDA_PROCESSES, "3")]), "infer", node).is_err());
        assert!(
            resolve_limits(
                &annotations(&[(MEMORY_LIMIT, "4Gi"), (CUDA_PROCESSES, "2")]),
                "infer",
                node
            )
            .is_ok()
        );
    }

    #[test]
    fn container_then_pod_then_node_default_per_field() {
        use LimitSource::*;
        let pod = |k: &str| PodAnnotation(k.to_string());
        let ctr = |k: &str| ContainerAnnotation(k.to_string());
        /// Annotations, node default -> memory, threads, and where each came from.
        type Case<'a> = (
            &'a [(&'a str, &'a str)],
            Option<Limits>,
            u64,
            u8,
            LimitSource,
            LimitSource,
        );
        let cases: &[Case] = &[
            (
                &[(MEMORY_LIMIT, "4Gi"), (ACTIVE_THREAD_PERCENTAGE, "25")],
                None,
                4 * GI,
                25,
                pod(MEMORY_LIMIT),
                pod(ACTIVE_THREAD_PERCENTAGE),
            ),
            (
                &[
                    (MEMORY_LIMIT, "4Gi"),
                    (ACTIVE_THREAD_PERCENTAGE, "25"),
                    ("infer.gpu-mps.io/memory-limit", "8Gi"),
                ],
                None,
                8 * GI,
                25,
                ctr("infer.gpu-mps.io/memory-limit"),
                pod(ACTIVE_THREAD_PERCENTAGE),
            ),
            (
                &[("infer.gpu-mps.io/active-thread-percentage", "50")],
                default(),
                2 * GI,
                50,
                NodeDefault,
                ctr("infer.gpu-mps.io/active-thread-percentage"),
            ),
            (&[], default(), 2 * GI, 10, NodeDefault, NodeDefault),
            // Another container's annotation is not this one's.
            (
                &[("sidecar.gpu-mps.io/memory-limit", "8Gi")],
                default(),
                2 * GI,
                10,
                NodeDefault,
                NodeDefault,
            ),
        ];
        for (pairs, node_default, memory, threads, memory_source, threads_source) in cases {
            let r = resolve_limits(&annotations(pairs), "infer", rules(*node_default)).unwrap();
            assert_eq!(
                r.limits,
                Limits {
                    memory_bytes: *memory,
                    thread_percentage: *threads
                },
                "{pairs:?}"
            );
            assert_eq!(&r.memory_source, memory_source, "{pairs:?}");
            assert_eq!(&r.threads_source, threads_source, "{pairs:?}");
        }
    }

    #[test]
    fn without_a_container_name_only_pod_keys_count() {
        let a = annotations(&[(".gpu-mps.io/memory-limit", "8Gi"), (MEMORY_LIMIT, "4Gi")]);
        let r = resolve_limits(&a, "", rules(default())).unwrap();
        assert_eq!(r.limits.memory_bytes, 4 * GI);
    }

    #[test]
    fn invalid_values_name_the_annotation_the_value_and_what_is_allowed() {
        let cases: &[(&str, &str, &str)] = &[
            (
                MEMORY_LIMIT,
                "4GB",
                "has unknown suffix \"GB\": allowed are Ki, Mi, Gi",
            ),
            (MEMORY_LIMIT, "4096", "below the minimum memory limit of 64Mi"),
            (MEMORY_LIMIT, "lots", "is not a quantity"),
            (MEMORY_LIMIT, "", "is not a quantity"),
            (MEMORY_LIMIT, "1.5", "not a whole number of bytes"),
            (
                ACTIVE_THREAD_PERCENTAGE,
                "0",
                "expected a whole number from 1 to 100",
            ),
            (
                ACTIVE_THREAD_PERCENTAGE,
                "101",
                "expected a whole number from 1 to 100",
            ),
            (
                ACTIVE_THREAD_PERCENTAGE,
                "25%",
                "expected a whole number from 1 to 100",
            ),
            (
                "infer.gpu-mps.io/memory-limit",
                "8GB",
                "has unknown suffix \"GB\"",
            ),
            (
                "infer.gpu-mps.io/active-thread-percentage",
                "half",
                "expected a whole number from 1 to 100",
            ),
        ];
        for (key, value, allowed) in cases {
            let e = resolve_limits(&annotations(&[(key, value)]), "infer", rules(default()))
                .unwrap_err()
                .to_string();
            let named = format!("annotation {key}={value:?}: ");
            assert!(e.starts_with(&named), "{e}");
            assert!(e.contains(allowed) && e.ends_with("(set it on the pod)"), "{e}");
            assert!(!e.contains('\n'), "{e}");
        }
        let e =
            resolve_limits(&annotations(&[(MEMORY_LIMIT, "4GB")]), "infer", rules(default())).unwrap_err();
        assert_eq!(
            e.to_string(),
            "annotation gpu-mps.io/memory-limit=\"4GB\": \"4GB\" has unknown suffix \"GB\": \
             allowed are Ki, Mi, Gi, Ti, Pi, k, M, G, T, P, or an exponent such as e9 (set it on the pod)"
        );
    }

    #[test]
    fn a_container_name_with_line_breaks_stays_on_one_line() {
        // containerd takes the name from the pod as it is; ctr takes any annotation.
        let name = "in\nfer\u{1b}";
        let key = annotations::container_key(name, MEMORY_LIMIT);
        let e = resolve_limits(&annotations(&[(&key, "4GB")]), name, rules(default()))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("annotation in\\nfer\\u{1b}.gpu-mps.io/memory-limit=\"4GB\": ")
                && !e.contains('\n'),
            "{e}"
        );
        let e = resolve_limits(&HashMap::new(), name, rules(None))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("or in\\nfer\\u{1b}.gpu-mps.io/memory-limit for this container only")
                && !e.contains('\n'),
            "{e}"
        );
        let r = resolve_limits(&annotations(&[(&key, "4Gi")]), name, rules(default())).unwrap();
        assert_eq!(
            r.memory_source.to_string(),
            "container annotation in\\nfer\\u{1b}.gpu-mps.io/memory-limit"
        );
    }

    #[test]
    fn a_missing_limit_says_where_to_set_it() {
        let e = resolve_limits(&annotations(&[(MEMORY_LIMIT, "4Gi")]), "infer", rules(None))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "no active thread percentage for container \"infer\": set the pod annotation \
             gpu-mps.io/active-thread-percentage (a whole number from 1 to 100) or \
             infer.gpu-mps.io/active-thread-percentage for this container only, or a node default \
             (limits.default_active_thread_percentage in the gpu-mps node config)"
        );
        let e = resolve_limits(&HashMap::new(), "", rules(None))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "no memory limit for this container: set the pod annotation gpu-mps.io/memory-limit \
             (a Kubernetes quantity of at least 64Mi, e.g. 4Gi), or a node default \
             (limits.default_memory_limit in the gpu-mps node config)"
        );
    }

    #[test]
    fn a_nul_byte_in_a_name_the_hook_gets_is_refused() {
        let ok = annotations(&[
            (CRI_SANDBOX_NAMESPACE, "équipe-α"),
            (CRI_SANDBOX_NAME, &"p".repeat(4096)),
            (CRI_CONTAINER_NAME, ""),
        ]);
        assert_eq!(check_names_for_hook(&identity_from_annotations(&ok)), Ok(()));
        for key in [CRI_SANDBOX_NAMESPACE, CRI_SANDBOX_NAME, CRI_CONTAINER_NAME] {
            let a = annotations(&[(key, "in\0fer")]);
            let e = check_names_for_hook(&identity_from_annotations(&a))
                .unwrap_err()
                .to_string();
            assert_eq!(
                e,
                format!(
                    "annotation {key}=\"in\\0fer\" holds a NUL byte, which the arguments of gpu-mps-hook cannot carry: a Kubernetes name has none (fix what wrote the spec)"
                )
            );
        }
    }

    #[test]
    fn identity_comes_from_cri_annotations() {
        let a = annotations(&[
            (CRI_SANDBOX_NAMESPACE, "team-a"),
            (CRI_SANDBOX_NAME, "infer-7d9f"),
            (CRI_CONTAINER_NAME, "infer"),
        ]);
        let id = identity_from_annotations(&a);
        assert_eq!(
            (id.namespace.as_str(), id.pod.as_str(), id.container_name.as_str()),
            ("team-a", "infer-7d9f", "infer")
        );
        assert_eq!(identity_from_annotations(&HashMap::new()), PodIdentity::default());
    }
}
