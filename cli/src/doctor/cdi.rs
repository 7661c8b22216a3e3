//! Check: the CDI specs of each NVIDIA GPU kind present name every GPU of the manager's
//! inventory: `nvidia.com/gpu` (`nvidia-ctk cdi generate`) and `k8s.device-plugin.nvidia.com/gpu`
//! (NVIDIA's device plugin writes it under /var/run/cdi for its CDI strategies; its annotations
//! and CRI CDI devices name that kind, which gpu-mps-shim takes as GPUs too).
//!
//! containerd 2.x (and 1.7 with enable_cdi) resolves a CDI device itself and refuses a container
//! whose device no spec names; gpu-mps-device-plugin hands a GPU over as a CDI device when a spec
//! names it. A spec from before a GPU or driver change names GPUs the node no longer has and
//! misses the new ones. Without any spec, GPUs reach containers as NVIDIA_VISIBLE_DEVICES and
//! device nodes, which need nvidia-container-runtime chained as runc for the driver libraries.

use std::path::PathBuf;

use super::{Check, DoctorError, GpuFacts, GpuSeen};

const NAME: &str = "cdi";
/// The CDI kind of NVIDIA GPUs, as `nvidia-ctk cdi generate` writes it.
pub const GPU_CDI_KIND: &str = gpu_mps_shim::gpu_devices::CDI_GPU_KIND;
/// The kind NVIDIA's device plugin writes its own spec with.
pub const DEVICE_PLUGIN_GPU_CDI_KIND: &str = gpu_mps_shim::gpu_devices::DEVICE_PLUGIN_CDI_GPU_KIND;

#[derive(Debug)]
pub struct CdiFacts {
    pub dirs: Vec<PathBuf>,
    pub specs: Vec<CdiSpec>,
    /// Spec files that could not be read or parsed.
    pub unreadable: Vec<DoctorError>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CdiSpec {
    pub path: PathBuf,
    pub kind: String,
    /// The names of its devices ("0", "GPU-<uuid>", "all").
    pub devices: Vec<String>,
}

impl CdiSpec {
    /// A GPU is named by its index or its UUID (the toolkit's two naming strategies).
    fn names(&self, gpu: &GpuSeen) -> bool {
        self.devices
            .iter()
            .any(|d| *d == gpu.index.to_string() || *d == gpu.uuid)
    }
}

pub fn check(f: &CdiFacts, gpus: &GpuFacts) -> Check {
    let dirs = f
        .dirs
        .iter()
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(" and ");
    let unreadable = if f.unreadable.is_empty() {
        String::new()
    } else {
        format!(
            " (not read: {})",
            f.unreadable
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ")
        )
    };
    let specs: Vec<&CdiSpec> = f
        .specs
        .iter()
        .filter(|s| gpu_mps_shim::gpu_devices::CDI_GPU_KINDS.contains(&s.kind.as_str()))
        .collect();
    if specs.is_empty() {
        return Check::warn(
            NAME,
            format!(
                "no CDI spec of kind {GPU_CDI_KIND} in {dirs} (nor of {DEVICE_PLUGIN_GPU_CDI_KIND}){unreadable}: this node hands GPUs to containers as NVIDIA_VISIBLE_DEVICES and device nodes, which get the driver libraries only through nvidia-container-runtime chained as runc_path"
            ),
            "to hand GPUs over as CDI devices instead: nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml (NVIDIA Container Toolkit); otherwise keep runc_path at nvidia-container-runtime",
        );
    }
    let paths = specs
        .iter()
        .map(|s| s.path.display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    if gpus.gpus.is_empty() {
        return Check::skip(
            NAME,
            format!(
                "{paths} found, but which GPUs it must name is unknown: {}{unreadable}",
                gpus.source.describe()
            ),
        );
    }
    // containerd resolves a device only against specs of its own kind: each kind present must
    // name every GPU.
    for kind in gpu_mps_shim::gpu_devices::CDI_GPU_KINDS {
        let of_kind: Vec<&&CdiSpec> = specs.iter().filter(|s| s.kind == kind).collect();
        if of_kind.is_empty() {
            continue;
        }
        let missing: Vec<String> = gpus
            .gpus
            .iter()
            .filter(|g| !of_kind.iter().any(|s| s.names(g)))
            .map(|g| format!("GPU {} ({})", g.index, g.uuid))
            .collect();
        if missing.is_empty() {
            continue;
        }
        let kind_paths = of_kind
            .iter()
            .map(|s| s.path.display().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        let target = of_kind[0].path.display();
        let fix = if kind == GPU_CDI_KIND {
            format!(
                "generate the spec again for the GPUs the node has now: nvidia-ctk cdi generate --output={target}"
            )
        } else {
            format!(
                "restart NVIDIA's device plugin on this node: it writes {target} for the GPUs it finds at start"
            )
        };
        return Check::fail(
            NAME,
            format!(
                "{kind_paths} does not name {} of this node (GPUs from {}){unreadable}: containerd refuses a container given that GPU as a CDI device of kind {kind}",
                missing.join(", "),
                gpus.source.describe()
            ),
            fix,
        );
    }
    Check::pass(
        NAME,
        format!(
            "{paths} names every GPU ({}){unreadable}",
            gpus.gpus
                .iter()
                .map(|g| format!("{} {}", g.index, g.uuid))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    )
}

/// The kind and device names of a CDI spec, JSON or YAML. YAML is read line by line: the
/// top-level `kind`, and the `name` of each entry of the top-level `devices` list, which is all
/// this check needs (no YAML parser for that).
pub fn parse_cdi_spec(text: &str) -> Result<(String, Vec<String>), String> {
    if text.trim_start().starts_with('{') {
        let spec: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let kind = spec
            .get("kind")
            .and_then(|k| k.as_str())
            .ok_or("it has no kind")?
            .to_string();
        let devices = spec
            .get("devices")
            .and_then(|d| d.as_array())
            .map(|d| {
                d.iter()
                    .filter_map(|d| d.get("name").and_then(|n| n.as_str()).map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        return Ok((kind, devices));
    }
    let mut kind = None;
    let mut devices = Vec::new();
    let mut in_devices = false;
    let mut item_indent = None;
    for line in text.lines() {
        let content = line.trim_start();
        if content.is_empty() || content.starts_with('#') {
            continue;
        }
        let indent = line.len() - content.len();
        if indent == 0 && !content.starts_with('-') {
            in_devices = content.starts_with("devices:");
            item_indent = None;
            if let Some(v) = content.strip_prefix("kind:") {
                kind = Some(yaml_scalar(v));
            }
            continue;
        }
        if !in_devices {
            continue;
        }
        if let Some(item) = content.strip_prefix("- ") {
            let at = *item_indent.get_or_insert(indent);
            if indent == at {
                if let Some(v) = item.trim_start().strip_prefix("name:") {
                    devices.push(yaml_scalar(v));
                }
            }
        } else if let (Some(at), Some(v)) = (item_indent, content.strip_prefix("name:")) {
            if indent == at + 2 {
                devices.push(yaml_scalar(v));
            }
        }
    }
    let kind = kind.ok_or("it has no top-level kind")?;
    Ok((kind, devices))
}

/// A plain or quoted YAML scalar, without a trailing comment.
fn yaml_scalar(v: &str) -> String {
    let v = v.trim();
    for quote in ['"', '\''] {
        if let Some(rest) = v.strip_prefix(quote) {
            return rest.split(quote).next().unwrap_or("").to_string();
        }
    }
    v.split(" #").next().unwrap_or("").trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::{GpuSource, Status};

    const YAML: &str = "---\ncdiVersion: 0.5.0\nkind: nvidia.com/gpu\ncontainerEdits:\n  env:\n  - NVIDIA_VISIBLE_DEVICES=void\ndevices:\n- name: \"0\"\n  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n- containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia1\n  name: GPU-bbbb # the second\n- name: all\n  containerEdits:\n    mounts:\n    - hostPath: /usr/lib/libcuda.so\n      name: notadevice\n";

    fn gpus(n: u32) -> GpuFacts {
        GpuFacts {
            source: GpuSource::Manager,
            gpus: (0..n)
                .map(|i| GpuSeen {
                    index: i,
                    uuid: format!("GPU-{}", ["aaaa", "bbbb", "cccc"][i as usize]),
                    compute_mode: "Default".into(),
                    mig_enabled: false,
                })
                .collect(),
        }
    }

    fn facts(specs: Vec<CdiSpec>) -> CdiFacts {
        CdiFacts {
            dirs: vec!["/etc/cdi".into(), "/var/run/cdi".into()],
            specs,
            unreadable: Vec::new(),
        }
    }

    fn spec(devices: &[&str]) -> CdiSpec {
        CdiSpec {
            path: "/etc/cdi/nvidia.yaml".into(),
            kind: GPU_CDI_KIND.into(),
            devices: devices.iter().map(|d| d.to_string()).collect(),
        }
    }

    #[test]
    fn yaml_and_json_specs_parse() {
        let (kind, devices) = parse_cdi_spec(YAML).unwrap();
        assert_eq!(kind, "nvidia.com/gpu");
        assert_eq!(devices, ["0", "GPU-bbbb", "all"]);
        let json =
            r#"{"cdiVersion":"0.6.0","kind":"nvidia.com/gpu","devices":[{"name":"GPU-aaaa"},{"name":"1"}]}"#;
        assert_eq!(
            parse_cdi_spec(json).unwrap(),
            (
                "nvidia.com/gpu".to_string(),
                vec!["GPU-aaaa".to_string(), "1".into()]
            )
        );
        assert_eq!(
            parse_cdi_spec("kind: 'vendor.com/net'\ndevices:\n  - name: eth0\n").unwrap(),
            ("vendor.com/net".to_string(), vec!["eth0".to_string()])
        );
        assert!(parse_cdi_spec("devices: []\n").is_err());
        assert!(parse_cdi_spec("{").is_err());
    }

    #[test]
    fn a_spec_naming_every_gpu_passes() {
        let c = check(&facts(vec![spec(&["0", "GPU-bbbb", "all"])]), &gpus(2));
        assert_eq!(c.status, Status::Pass, "{c:?}");
        assert_eq!(
            c.found,
            "/etc/cdi/nvidia.yaml names every GPU (0 GPU-aaaa, 1 GPU-bbbb)"
        );
    }

    #[test]
    fn a_gpu_no_spec_names_fails() {
        let c = check(&facts(vec![spec(&["0", "1", "all"])]), &gpus(3));
        assert_eq!(c.status, Status::Fail);
        assert!(c.found.contains("does not name GPU 2 (GPU-cccc)"), "{}", c.found);
        assert_eq!(
            c.fix.as_deref(),
            Some(
                "generate the spec again for the GPUs the node has now: nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml"
            )
        );
    }

    #[test]
    fn no_gpu_spec_warns_about_device_nodes() {
        let mut other = spec(&["eth0"]);
        other.kind = "vendor.com/net".into();
        let mut f = facts(vec![other]);
        f.unreadable.push(DoctorError::Invalid {
            path: "/etc/cdi/broken.yaml".into(),
            message: "it has no top-level kind".into(),
        });
        let c = check(&f, &gpus(1));
        assert_eq!(c.status, Status::Warn);
        assert!(
            c.found
                .contains("no CDI spec of kind nvidia.com/gpu in /etc/cdi and /var/run/cdi")
                && c.found.contains("NVIDIA_VISIBLE_DEVICES")
                && c.found.contains("broken.yaml: it has no top-level kind"),
            "{}",
            c.found
        );
        assert!(c.fix.unwrap_or_default().contains("nvidia-ctk cdi generate"));
    }

    #[test]
    fn the_device_plugins_own_spec_counts_and_must_name_every_gpu() {
        let mut plugin = spec(&["GPU-aaaa", "GPU-bbbb"]);
        plugin.path = "/var/run/cdi/k8s.device-plugin.nvidia.com-gpu.json".into();
        plugin.kind = DEVICE_PLUGIN_GPU_CDI_KIND.into();
        let c = check(&facts(vec![plugin.clone()]), &gpus(2));
        assert_eq!(c.status, Status::Pass, "{c:?}");
        assert!(
            c.found
                .starts_with("/var/run/cdi/k8s.device-plugin.nvidia.com-gpu.json names every GPU"),
            "{}",
            c.found
        );
        // Each kind on its own: the toolkit's spec naming GPU 2 does not resolve the plugin's.
        let c = check(&facts(vec![spec(&["0", "1", "2"]), plugin]), &gpus(3));
        assert_eq!(c.status, Status::Fail, "{c:?}");
        assert!(
            c.found
                .contains("k8s.device-plugin.nvidia.com-gpu.json does not name GPU 2 (GPU-cccc)")
                && c.found.contains("of kind k8s.device-plugin.nvidia.com/gpu"),
            "{}",
            c.found
        );
        assert!(
            c.fix
                .unwrap_or_default()
                .contains("restart NVIDIA's device plugin")
        );
    }

    #[test]
    fn without_a_gpu_list_it_is_skipped() {
        let no_gpus = GpuFacts {
            source: GpuSource::Nowhere("no inventory".into()),
            gpus: Vec::new(),
        };
        let c = check(&facts(vec![spec(&["0"])]), &no_gpus);
        assert_eq!(c.status, Status::Skip);
        assert!(c.found.contains("no inventory"), "{}", c.found);
    }
}
