//! How a GPU reaches a container that got units of it: as the CDI device
//! `nvidia.com/gpu=<uuid>` where the node has an NVIDIA CDI spec naming it, otherwise as
//! `NVIDIA_VISIBLE_DEVICES=<uuid>` plus the device nodes (what the NVIDIA device plugin's
//! envvar strategy gives, which nvidia-container-runtime turns into libraries).
//! Deciding from a spec's text is pure; [`discover`] reads the directories.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use gpu_mps_api::inventory::GpuInfo;

/// The CDI kind of NVIDIA GPUs.
pub const GPU_CDI_KIND: &str = "nvidia.com/gpu";
/// The control nodes a CUDA process opens besides its GPU's, where the host has them.
const CONTROL_NODES: [&str; 3] = ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"];

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuDelivery {
    /// The fully qualified CDI device name, and the spec file that names it.
    Cdi { device: String, spec: PathBuf },
    /// `NVIDIA_VISIBLE_DEVICES` and the device nodes (host path, container path).
    DeviceNodes {
        visible_devices: String,
        nodes: Vec<(PathBuf, String)>,
    },
}

impl GpuDelivery {
    pub fn describe(&self) -> String {
        match self {
            GpuDelivery::Cdi { device, spec } => format!("CDI device {device} ({})", spec.display()),
            GpuDelivery::DeviceNodes { nodes, .. } => format!(
                "NVIDIA_VISIBLE_DEVICES and {}",
                nodes
                    .iter()
                    .map(|(host, _)| host.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
}

/// Whether a CDI spec's text names `uuid` as a device of kind nvidia.com/gpu. JSON specs are
/// parsed; YAML ones (what `nvidia-ctk cdi generate` writes) are read line by line for
/// `kind: nvidia.com/gpu` and a `name: <uuid>` entry, which is all this needs.
pub fn spec_names_gpu(file_name: &str, text: &str, uuid: &str) -> bool {
    if file_name.ends_with(".json") {
        let Ok(spec) = serde_json::from_str::<serde_json::Value>(text) else {
            return false;
        };
        return spec.get("kind").and_then(|k| k.as_str()) == Some(GPU_CDI_KIND)
            && spec
                .get("devices")
                .and_then(|d| d.as_array())
                .is_some_and(|devices| {
                    devices
                        .iter()
                        .any(|d| d.get("name").and_then(|n| n.as_str()) == Some(uuid))
                });
    }
    if file_name.ends_with(".yaml") || file_name.ends_with(".yml") {
        let unquote = |v: &str| v.trim().trim_matches(['"', '\'']).to_string();
        let mut kind = false;
        let mut named = false;
        for line in text.lines() {
            let line = line.trim().trim_start_matches("- ");
            if let Some(v) = line.strip_prefix("kind:") {
                kind |= unquote(v) == GPU_CDI_KIND;
            }
            if let Some(v) = line.strip_prefix("name:") {
                named |= unquote(v) == uuid;
            }
        }
        return kind && named;
    }
    false
}

/// Which ways of handing a GPU over the plugin may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DeliveryMode {
    /// The CDI device where a CDI spec names the GPU, else env and device nodes.
    Auto,
    /// Always env and device nodes (containerd or kubelet without CDI).
    Nodes,
}

/// Decides the delivery of each GPU from the CDI spec dirs (in order; unreadable ones are
/// skipped) and the device nodes under `dev_dir`.
pub fn discover(
    gpus: &[GpuInfo],
    cdi_dirs: &[PathBuf],
    dev_dir: &Path,
    mode: DeliveryMode,
) -> HashMap<String, GpuDelivery> {
    let cdi_dirs = if mode == DeliveryMode::Nodes {
        &[][..]
    } else {
        cdi_dirs
    };
    let mut specs: Vec<(PathBuf, String)> = Vec::new();
    for dir in cdi_dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for path in paths {
            if let Ok(text) = std::fs::read_to_string(&path) {
                specs.push((path, text));
            }
        }
    }
    let controls: Vec<(PathBuf, String)> = CONTROL_NODES
        .iter()
        .map(|name| (dev_dir.join(name), format!("/dev/{name}")))
        .filter(|(host, _)| host.exists())
        .collect();
    gpus.iter()
        .map(|gpu| {
            let cdi = specs.iter().find(|(path, text)| {
                let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
                spec_names_gpu(name, text, &gpu.uuid)
            });
            let delivery = match cdi {
                Some((spec, _)) => GpuDelivery::Cdi {
                    device: format!("{GPU_CDI_KIND}={}", gpu.uuid),
                    spec: spec.clone(),
                },
                None => {
                    let mut nodes = vec![(
                        dev_dir.join(format!("nvidia{}", gpu.minor)),
                        format!("/dev/nvidia{}", gpu.minor),
                    )];
                    nodes.extend(controls.iter().cloned());
                    GpuDelivery::DeviceNodes {
                        visible_devices: gpu.uuid.clone(),
                        nodes,
                    }
                }
            };
            (gpu.uuid.clone(), delivery)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const UUID: &str = "GPU-2b5c3d7e-0f1a-4b2c-8d3e-4f5a6b7c8d9e";

    #[test]
    fn json_and_yaml_specs_name_a_gpu() {
        let json = format!(
            r#"{{"cdiVersion":"0.5.0","kind":"nvidia.com/gpu","devices":[{{"name":"0"}},{{"name":"{UUID}"}}]}}"#
        );
        assert!(spec_names_gpu("nvidia.json", &json, UUID));
        assert!(!spec_names_gpu("nvidia.json", &json, "GPU-other"));
        assert!(!spec_names_gpu(
            "nvidia.json",
            &json.replace("nvidia.com/gpu", "acme.com/fpga"),
            UUID
        ));
        assert!(!spec_names_gpu("nvidia.json", "{not json", UUID));
        let yaml = format!(
            "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: \"0\"\n  containerEdits: {{}}\n- name: {UUID}\n  containerEdits: {{}}\n"
        );
        assert!(spec_names_gpu("nvidia.yaml", &yaml, UUID));
        assert!(!spec_names_gpu(
            "nvidia.yaml",
            &yaml.replace("kind: nvidia.com/gpu", "kind: acme.com/x"),
            UUID
        ));
        assert!(!spec_names_gpu("nvidia.txt", &json, UUID));
    }

    #[test]
    fn discover_prefers_cdi_and_falls_back_to_nodes() {
        let dir = tempfile::tempdir().unwrap();
        let cdi = dir.path().join("cdi");
        let dev = dir.path().join("dev");
        std::fs::create_dir_all(&cdi).unwrap();
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("nvidiactl"), "").unwrap();
        let gpu = |index: u32, minor: u32, uuid: &str| GpuInfo {
            index,
            minor,
            uuid: uuid.into(),
            name: "test".into(),
            memory_bytes: 1 << 34,
            compute_mode: "Default".into(),
            mig_enabled: false,
        };
        let gpus = [gpu(0, 3, UUID), gpu(1, 2, "GPU-b")];
        std::fs::write(
            cdi.join("nvidia.json"),
            format!(r#"{{"kind":"nvidia.com/gpu","devices":[{{"name":"{UUID}"}}]}}"#),
        )
        .unwrap();
        let only_nodes = discover(&gpus, std::slice::from_ref(&cdi), &dev, DeliveryMode::Nodes);
        assert!(matches!(only_nodes[UUID], GpuDelivery::DeviceNodes { .. }));
        let found = discover(
            &gpus,
            &[dir.path().join("missing"), cdi.clone()],
            &dev,
            DeliveryMode::Auto,
        );
        assert_eq!(
            found[UUID],
            GpuDelivery::Cdi {
                device: format!("nvidia.com/gpu={UUID}"),
                spec: cdi.join("nvidia.json")
            }
        );
        assert_eq!(
            found["GPU-b"],
            GpuDelivery::DeviceNodes {
                visible_devices: "GPU-b".into(),
                nodes: vec![
                    (dev.join("nvidia2"), "/dev/nvidia2".into()),
                    (dev.join("nvidiactl"), "/dev/nvidiactl".into())
                ]
            }
        );
    }
}
