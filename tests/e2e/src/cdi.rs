//! GPUs handed over through CDI, as a device plugin with the CDI strategy does it: a container
//! annotation `cdi.k8s.io/<plugin>: nvidia.com/gpu=<uuid>`, and a CDI spec naming the device,
//! which containerd resolves the annotation against where it has CDI on (1.7 with
//! `enable_cdi = true`, 2.x by default).

use std::path::PathBuf;

use serde_json::json;

/// The CDI kind of NVIDIA GPUs.
pub const GPU_KIND: &str = "nvidia.com/gpu";
/// The container annotation key the NVIDIA device plugin sets.
pub const DEVICE_PLUGIN_ANNOTATION: &str = "cdi.k8s.io/nvidia-device-plugin";
/// Old enough for the CDI library of every tested containerd (1.7 vendors 0.7, 2.1 vendors 1.0).
const CDI_VERSION: &str = "0.5.0";
/// The env the NVIDIA toolkit's CDI specs set, so that a container's env does not also name the
/// GPUs: "the devices come from CDI".
pub const VISIBLE_DEVICES_VOID: &str = "NVIDIA_VISIBLE_DEVICES=void";

/// `nvidia.com/gpu=<uuid>`: a fully qualified CDI device name.
pub fn gpu_device(uuid: &str) -> String {
    format!("{GPU_KIND}={uuid}")
}

/// A CDI spec file (name, JSON) naming each of `uuids` as a device of kind `nvidia.com/gpu`.
/// Its edits only set NVIDIA_VISIBLE_DEVICES=void: there is no GPU, so no device node.
pub fn gpu_spec(uuids: &[String]) -> (String, String) {
    let devices: Vec<_> = uuids
        .iter()
        .map(|uuid| json!({"name": uuid, "containerEdits": {"env": [VISIBLE_DEVICES_VOID]}}))
        .collect();
    let spec = json!({"cdiVersion": CDI_VERSION, "kind": GPU_KIND, "devices": devices});
    ("gpu-mps-e2e-nvidia-gpu.json".into(), spec.to_string())
}

/// A CDI spec file (name, JSON) naming each `(uuid, host node)` as a device of kind
/// `nvidia.com/gpu` whose edits add that host node at `/dev/nvidia0`, as the toolkit's specs add
/// a GPU's node. Type and numbers are left out: containerd's CDI library reads them from the
/// host node, so the container's linux.devices entry carries the node's real 195:<minor>.
pub fn gpu_node_spec(devices: &[(String, PathBuf)]) -> (String, String) {
    let devices: Vec<_> = devices
        .iter()
        .map(|(uuid, host)| {
            json!({"name": uuid, "containerEdits": {
                "env": [VISIBLE_DEVICES_VOID],
                "deviceNodes": [{"path": "/dev/nvidia0", "hostPath": host}],
            }})
        })
        .collect();
    let spec = json!({"cdiVersion": CDI_VERSION, "kind": GPU_KIND, "devices": devices});
    ("gpu-mps-e2e-nvidia-gpu-nodes.json".into(), spec.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_names_each_gpu() {
        let (name, text) = gpu_spec(&["GPU-a".into(), "GPU-b".into()]);
        assert!(name.ends_with(".json"));
        let spec: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(spec["kind"], GPU_KIND);
        assert_eq!(spec["devices"][1]["name"], "GPU-b");
        assert_eq!(
            spec["devices"][0]["containerEdits"]["env"][0],
            VISIBLE_DEVICES_VOID
        );
        assert_eq!(gpu_device("GPU-a"), "nvidia.com/gpu=GPU-a");
    }

    #[test]
    fn a_node_spec_adds_each_gpus_host_node() {
        let (name, text) = gpu_node_spec(&[("GPU-a".into(), PathBuf::from("/t/nvidia-fake-3"))]);
        assert!(name.ends_with(".json"));
        let spec: serde_json::Value = serde_json::from_str(&text).unwrap();
        let node = &spec["devices"][0]["containerEdits"]["deviceNodes"][0];
        assert_eq!(node["path"], "/dev/nvidia0");
        assert_eq!(node["hostPath"], "/t/nvidia-fake-3");
    }
}
