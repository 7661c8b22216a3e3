//! The spec rewrite again, on config.json built from structured input: GPUs named through
//! every source the shim reads (linux.devices, CDI annotations, volume mounts, the env), limit
//! annotations, the device plugin's units, CRI identity, long or odd container ids, and parts
//! of the wrong JSON type. Random text rarely gets past the JSON parser and the GPU detection;
//! this reaches the resolution and the rewrite on most runs. Properties:
//! gpu_mps_fuzz::check_plan.

#![no_main]

use arbitrary::Arbitrary;
use gpu_mps_api::annotations::{
    ACTIVE_THREAD_PERCENTAGE, ALLOCATED_UNITS, CRI_CONTAINER_NAME, CRI_CONTAINER_TYPE, CRI_SANDBOX_NAMESPACE,
    CUDA_PROCESSES, MEMORY_LIMIT,
};
use gpu_mps_fuzz::{check_plan, nodes};
use libfuzzer_sys::fuzz_target;
use serde_json::{Map, Value, json};

/// The UUIDs of the golden inventories.
const UUIDS: [&str; 2] = [
    "GPU-5bc4d1a1-4a1e-9d7b-3c2f-8e1f0a6b7c01",
    "GPU-9e2f7c3d-0b4a-41e6-8d5c-2a7b9f1e3d02",
];

#[derive(Debug, Arbitrary)]
enum Gpu {
    Index(u8),
    Uuid(bool),
    UuidPrefix(bool, u8),
    All,
    NoneWord,
    Void,
    Mig,
    Text(String),
}

impl Gpu {
    fn name(&self) -> String {
        let uuid = |second: &bool| UUIDS[usize::from(*second)];
        match self {
            Gpu::Index(i) => i.to_string(),
            Gpu::Uuid(second) => uuid(second).to_string(),
            Gpu::UuidPrefix(second, len) => uuid(second).chars().take(usize::from(*len) % 40).collect(),
            Gpu::All => "all".into(),
            Gpu::NoneWord => "none".into(),
            Gpu::Void => "void".into(),
            Gpu::Mig => format!("MIG-{}", &UUIDS[0][4..]),
            Gpu::Text(s) => s.clone(),
        }
    }
}

fn names(gpus: &[Gpu]) -> String {
    gpus.iter().map(Gpu::name).collect::<Vec<_>>().join(",")
}

#[derive(Debug, Arbitrary)]
enum Field {
    Memory,
    Threads,
    Processes,
}

#[derive(Debug, Arbitrary)]
enum Annotation {
    Limit {
        field: Field,
        container_level: bool,
        value: LimitValue,
    },
    Cdi {
        plugin: String,
        gpus: Vec<Gpu>,
    },
    Units {
        gpu: bool,
        units: Vec<u8>,
        extra: Option<String>,
    },
    Other {
        key: String,
        value: String,
    },
}

#[derive(Debug, Arbitrary)]
enum LimitValue {
    Gi(u16),
    Mi(u32),
    Number(u8),
    Text(String),
}

#[derive(Debug, Arbitrary)]
enum EnvEntry {
    VisibleDevices(Vec<Gpu>),
    Mps(String),
    Other(String),
}

#[derive(Debug, Arbitrary)]
enum DevicePath {
    Gpu(u8),
    Control,
    Other(String),
}

#[derive(Debug, Arbitrary)]
struct Device {
    path: DevicePath,
    kind: u8,
    major: Option<i16>,
    minor: Option<i16>,
}

#[derive(Debug, Arbitrary)]
struct VolumeMount {
    gpu: Gpu,
    cdi: bool,
    dev_null: bool,
    dot_dot: bool,
}

/// A part of config.json: as the runtime writes it, absent, null, or of another JSON type.
#[derive(Debug, Arbitrary)]
enum Part<T> {
    Valid(T),
    Absent,
    Null,
    Number(i32),
    Text(String),
}

#[derive(Debug, Arbitrary)]
enum ContainerId {
    Golden,
    /// Longer than runc allows, or any length up to 64 KiB.
    Long(u16),
    Text(String),
}

#[derive(Debug, Arbitrary)]
struct Spec {
    node: u8,
    container_id: ContainerId,
    sandbox: bool,
    container_name: Option<String>,
    namespace: Option<String>,
    annotations: Part<Vec<Annotation>>,
    env: Part<Vec<EnvEntry>>,
    process: Part<()>,
    devices: Part<Vec<Device>>,
    mounts: Part<Vec<VolumeMount>>,
    extra: Vec<(String, String)>,
}

fn part<T>(part: Part<T>, valid: impl FnOnce(T) -> Value) -> Option<Value> {
    match part {
        Part::Valid(v) => Some(valid(v)),
        Part::Absent => None,
        Part::Null => Some(Value::Null),
        Part::Number(n) => Some(json!(n)),
        Part::Text(s) => Some(json!(s)),
    }
}

fn limit_value(value: LimitValue) -> String {
    match value {
        LimitValue::Gi(n) => format!("{n}Gi"),
        LimitValue::Mi(n) => format!("{n}Mi"),
        LimitValue::Number(n) => n.to_string(),
        LimitValue::Text(s) => s,
    }
}

fn annotations(list: Vec<Annotation>, container_name: Option<&str>) -> Value {
    let mut map = Map::new();
    for annotation in list {
        let (key, value) = match annotation {
            Annotation::Limit {
                field,
                container_level,
                value,
            } => {
                let base = match field {
                    Field::Memory => MEMORY_LIMIT,
                    Field::Threads => ACTIVE_THREAD_PERCENTAGE,
                    Field::Processes => CUDA_PROCESSES,
                };
                let key = match (container_level, container_name) {
                    (true, Some(name)) => format!("{name}.{base}"),
                    _ => base.to_string(),
                };
                (key, limit_value(value))
            }
            Annotation::Cdi { plugin, gpus } => (
                format!("cdi.k8s.io/{plugin}"),
                gpus.iter()
                    .map(|g| format!("nvidia.com/gpu={}", g.name()))
                    .collect::<Vec<_>>()
                    .join(","),
            ),
            Annotation::Units { gpu, units, extra } => {
                let uuid = UUIDS[usize::from(gpu)];
                let mut ids: Vec<String> = units.iter().map(|u| format!("{uuid}-m{u}")).collect();
                ids.extend(extra);
                (ALLOCATED_UNITS.to_string(), ids.join(","))
            }
            Annotation::Other { key, value } => (key, value),
        };
        map.insert(key, Value::String(value));
    }
    Value::Object(map)
}

fn env(entries: Vec<EnvEntry>) -> Value {
    entries
        .into_iter()
        .map(|e| match e {
            EnvEntry::VisibleDevices(gpus) => format!("NVIDIA_VISIBLE_DEVICES={}", names(&gpus)),
            EnvEntry::Mps(s) => format!("CUDA_MPS_{s}"),
            EnvEntry::Other(s) => s,
        })
        .collect::<Vec<_>>()
        .into()
}

fn devices(list: Vec<Device>) -> Value {
    list.into_iter()
        .map(|d| {
            let path = match d.path {
                DevicePath::Gpu(n) => format!("/dev/nvidia{n}"),
                DevicePath::Control => "/dev/nvidiactl".into(),
                DevicePath::Other(s) => s,
            };
            let kind = ["c", "u", "b", "p", "x"][usize::from(d.kind) % 5];
            let mut device = json!({ "path": path, "type": kind });
            if let Some(major) = d.major {
                device["major"] = json!(major);
            }
            if let Some(minor) = d.minor {
                device["minor"] = json!(minor);
            }
            device
        })
        .collect::<Vec<_>>()
        .into()
}

fn mounts(list: Vec<VolumeMount>) -> Value {
    list.into_iter()
        .map(|m| {
            let name = m.gpu.name();
            let listed = if m.cdi {
                format!("cdi/nvidia.com/gpu={name}")
            } else {
                name
            };
            let parent = if m.dot_dot { "/x/../" } else { "/" };
            json!({
                "destination": format!("{parent}var/run/nvidia-container-devices/{listed}"),
                "type": "bind",
                "source": if m.dev_null { "/dev/null" } else { "/srv/empty" },
                "options": ["bind", "ro"],
            })
        })
        .collect::<Vec<_>>()
        .into()
}

fuzz_target!(|spec: Spec| {
    let mut annotation_map = part(spec.annotations, |list| {
        annotations(list, spec.container_name.as_deref())
    });
    if let Some(Value::Object(map)) = &mut annotation_map {
        let cri = [
            (
                CRI_CONTAINER_TYPE,
                Some(if spec.sandbox { "sandbox" } else { "container" }.to_string()),
            ),
            (CRI_CONTAINER_NAME, spec.container_name.clone()),
            (CRI_SANDBOX_NAMESPACE, spec.namespace.clone()),
        ];
        for (key, value) in cri {
            if let Some(value) = value {
                map.insert(key.to_string(), Value::String(value));
            }
        }
    }
    let mut root = Map::new();
    root.insert("ociVersion".into(), json!("1.2.0"));
    for (key, value) in spec.extra {
        root.insert(key, Value::String(value));
    }
    let env = part(spec.env, env);
    if let Some(process) = part(spec.process, |()| json!({ "args": ["python"], "cwd": "/" })) {
        let mut process = process;
        if let (Some(object), Some(env)) = (process.as_object_mut(), env) {
            object.insert("env".into(), env);
        }
        root.insert("process".into(), process);
    }
    if let Some(devices) = part(spec.devices, devices) {
        root.insert("linux".into(), json!({ "devices": devices }));
    }
    if let Some(mounts) = part(spec.mounts, mounts) {
        root.insert("mounts".into(), mounts);
    }
    if let Some(annotations) = annotation_map {
        root.insert("annotations".into(), annotations);
    }
    let text = Value::Object(root).to_string();
    let container_id = match spec.container_id {
        ContainerId::Golden => "golden-container-1".to_string(),
        ContainerId::Long(len) => "c".repeat(usize::from(len)),
        ContainerId::Text(s) => s,
    };
    let nodes = nodes();
    check_plan(&text, &nodes[usize::from(spec.node) % nodes.len()], &container_id);
});
