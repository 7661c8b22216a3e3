//! Which GPUs a container got, read from what the NVIDIA stack already put in its spec, and
//! their UUIDs from the manager's inventory.
//!
//! Two sources, in any combination: `NVIDIA_VISIBLE_DEVICES` in `process.env` (the device
//! plugin's env strategy, or `docker run --gpus`-style specs) and CDI annotations
//! `cdi.k8s.io/<name>: nvidia.com/gpu=<index|uuid|all>[,...]`. The container's GPUs are the
//! union of both; `NVIDIA_VISIBLE_DEVICES=void` next to CDI annotations (the toolkit's way to
//! say "devices come from CDI") only contributes nothing.

use std::collections::HashMap;
use std::fmt;

use gpu_mps_api::DaemonKey;
use gpu_mps_api::annotations::CDI_PREFIX;
use gpu_mps_api::inventory::{GpuInfo, Inventory, LookupError};
use thiserror::Error;

pub const VISIBLE_DEVICES_ENV: &str = "NVIDIA_VISIBLE_DEVICES";
/// The CDI kind (`vendor/class`) of NVIDIA GPUs; other kinds are other devices.
pub const CDI_GPU_KIND: &str = "nvidia.com/gpu";

/// Where a device name was written, so an error can point at it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSource {
    Env { value: String },
    Cdi { key: String, value: String },
}

impl fmt::Display for DeviceSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSource::Env { value } => write!(f, "{VISIBLE_DEVICES_ENV}={value:?}"),
            DeviceSource::Cdi { key, value } => write!(f, "annotation {key}={value:?}"),
        }
    }
}

/// One GPU as the spec names it: an index, a UUID (or a unique prefix of one) or `all`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceName {
    pub name: String,
    pub origin: DeviceSource,
}

/// The GPUs a container asks for, not yet resolved. Never empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceRequest {
    pub devices: Vec<DeviceName>,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum DeviceError {
    #[error("{origin}: device {entry:?} names no GPU: expected {CDI_GPU_KIND}=<index|uuid|all>")]
    EmptyCdiName { origin: DeviceSource, entry: String },
    #[error(
        "{origin}: {lookup} (gpu-mps-manager writes the inventory at start: restart it if the node's GPUs changed)"
    )]
    Unknown {
        origin: DeviceSource,
        lookup: LookupError,
    },
    #[error(
        "{origin}: {name:?} is a MIG device: gpu-mps does not support MPS on MIG (request whole GPUs without MIG)"
    )]
    MigDevice { origin: DeviceSource, name: String },
    #[error(
        "{origin}: GPU {index} ({uuid}) has MIG enabled: gpu-mps does not support MPS on MIG-enabled GPUs (disable MIG on it or give the node's gpu-mps pods other GPUs)"
    )]
    MigEnabled {
        origin: DeviceSource,
        index: u32,
        uuid: String,
    },
    #[error("{origin}: asks for all GPUs, but the node's GPU inventory lists none")]
    NoGpus { origin: DeviceSource },
}

/// What the spec asks for; `None` for a container without an NVIDIA GPU.
pub fn requested(
    env: &[String],
    annotations: &HashMap<String, String>,
) -> Result<Option<DeviceRequest>, DeviceError> {
    let mut devices = Vec::new();
    if let Some(value) = visible_devices(env) {
        let value = value.trim();
        if !matches!(value, "" | "none" | "void") {
            let origin = DeviceSource::Env {
                value: value.to_string(),
            };
            devices.extend(list(value).map(|name| DeviceName {
                name: name.to_string(),
                origin: origin.clone(),
            }));
        }
    }
    let mut cdi: Vec<_> = annotations
        .iter()
        .filter(|(k, _)| k.starts_with(CDI_PREFIX))
        .collect();
    cdi.sort();
    for (key, value) in cdi {
        let origin = DeviceSource::Cdi {
            key: key.clone(),
            value: value.clone(),
        };
        for entry in list(value) {
            let Some((kind, name)) = entry.split_once('=') else {
                continue;
            };
            if kind.trim() != CDI_GPU_KIND {
                continue;
            }
            let name = name.trim();
            if name.is_empty() {
                return Err(DeviceError::EmptyCdiName {
                    origin,
                    entry: entry.to_string(),
                });
            }
            devices.push(DeviceName {
                name: name.to_string(),
                origin: origin.clone(),
            });
        }
    }
    Ok((!devices.is_empty()).then_some(DeviceRequest { devices }))
}

/// The value of `NVIDIA_VISIBLE_DEVICES` in `env`. Later entries override earlier ones, as when
/// the env is turned into a map.
pub fn visible_devices(env: &[String]) -> Option<&str> {
    env.iter()
        .rev()
        .find_map(|e| e.strip_prefix(VISIBLE_DEVICES_ENV)?.strip_prefix('='))
}

/// The daemon serving these GPUs: their UUIDs, looked up in the node's inventory.
pub fn resolve(request: &DeviceRequest, inventory: &Inventory) -> Result<DaemonKey, DeviceError> {
    let mut uuids = Vec::new();
    for DeviceName { name, origin } in &request.devices {
        let usable = |gpu: &GpuInfo| {
            if gpu.mig_enabled {
                Err(DeviceError::MigEnabled {
                    origin: origin.clone(),
                    index: gpu.index,
                    uuid: gpu.uuid.clone(),
                })
            } else {
                Ok(gpu.uuid.clone())
            }
        };
        if name == "all" {
            if inventory.gpus.is_empty() {
                return Err(DeviceError::NoGpus {
                    origin: origin.clone(),
                });
            }
            for gpu in &inventory.gpus {
                uuids.push(usable(gpu)?);
            }
        } else if name.starts_with("MIG-") || name.contains(':') {
            // `MIG-<uuid>` or `<gpu>:<gi>` (a MIG device by index pair).
            return Err(DeviceError::MigDevice {
                origin: origin.clone(),
                name: name.clone(),
            });
        } else {
            let gpu = inventory.lookup(name).map_err(|lookup| DeviceError::Unknown {
                origin: origin.clone(),
                lookup,
            })?;
            uuids.push(usable(gpu)?);
        }
    }
    Ok(DaemonKey::new(uuids))
}

fn list(value: &str) -> impl Iterator<Item = &str> {
    value.split(',').map(str::trim).filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use gpu_mps_api::inventory::GpuInfo;

    use super::*;

    const A: &str = "GPU-aaaaaaaa-1111-2222-3333-444444444444";
    const B: &str = "GPU-bbbbbbbb-1111-2222-3333-444444444444";

    fn inventory(mig_on_1: bool) -> Inventory {
        let gpu = |index: u32, uuid: &str, mig_enabled: bool| GpuInfo {
            index,
            uuid: uuid.into(),
            name: "NVIDIA H200".into(),
            memory_bytes: 141 << 30,
            compute_mode: "Default".into(),
            mig_enabled,
        };
        Inventory {
            source: "nvml".into(),
            gpus: vec![gpu(0, A, false), gpu(1, B, mig_on_1)],
        }
    }

    fn env(value: &str) -> Vec<String> {
        vec!["PATH=/usr/bin".into(), format!("{VISIBLE_DEVICES_ENV}={value}")]
    }

    fn cdi(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn gpus(
        env: &[String],
        annotations: &HashMap<String, String>,
    ) -> Result<Option<Vec<String>>, DeviceError> {
        match requested(env, annotations)? {
            None => Ok(None),
            Some(r) => Ok(Some(resolve(&r, &inventory(false))?.gpu_uuids().to_vec())),
        }
    }

    #[test]
    fn no_gpu_means_passthrough() {
        let none = HashMap::new();
        for value in ["", "none", "void", " void "] {
            assert_eq!(gpus(&env(value), &none), Ok(None), "{value:?}");
        }
        assert_eq!(gpus(&["PATH=/bin".into()], &none), Ok(None));
        assert_eq!(
            gpus(
                &[],
                &cdi(&[
                    ("cdi.k8s.io/fpga", "vendor.com/fpga=0"),
                    ("other/x", "nvidia.com/gpu=0")
                ])
            ),
            Ok(None)
        );
        assert_eq!(gpus(&["NVIDIA_VISIBLE_DEVICES_X=0".into()], &none), Ok(None));
    }

    #[test]
    fn env_names_indices_uuids_prefixes_and_all() {
        let none = HashMap::new();
        let cases: &[(&str, &[&str])] = &[
            ("0", &[A]),
            ("1,0", &[A, B]),
            (" 1 , 1 ", &[B]),
            (B, &[B]),
            ("GPU-aaaaaaaa", &[A]),
            ("all", &[A, B]),
        ];
        for (value, want) in cases {
            let want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
            assert_eq!(gpus(&env(value), &none), Ok(Some(want)), "{value}");
        }
    }

    #[test]
    fn the_last_env_entry_wins() {
        let e = vec![
            format!("{VISIBLE_DEVICES_ENV}=0"),
            format!("{VISIBLE_DEVICES_ENV}=void"),
        ];
        assert_eq!(gpus(&e, &HashMap::new()), Ok(None));
    }

    #[test]
    fn cdi_annotations_name_gpus_and_other_kinds_are_ignored() {
        type Annotations<'a> = &'a [(&'a str, &'a str)];
        let cases: &[(Annotations, &[&str])] = &[
            (&[("cdi.k8s.io/nvidia-device-plugin", "nvidia.com/gpu=1")], &[B]),
            (&[("cdi.k8s.io/p", &format!("nvidia.com/gpu={A}"))], &[A]),
            (&[("cdi.k8s.io/p", "nvidia.com/gpu=all")], &[A, B]),
            (
                &[(
                    "cdi.k8s.io/p",
                    "vendor.com/fpga=0, nvidia.com/gpu=0,nvidia.com/nic=1",
                )],
                &[A],
            ),
            (
                &[
                    ("cdi.k8s.io/p", "nvidia.com/gpu=0"),
                    ("cdi.k8s.io/q", "nvidia.com/gpu=1"),
                ],
                &[A, B],
            ),
        ];
        for (annotations, want) in cases {
            let want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
            assert_eq!(
                gpus(&env("void"), &cdi(annotations)),
                Ok(Some(want)),
                "{annotations:?}"
            );
        }
    }

    #[test]
    fn env_and_cdi_are_combined() {
        let a = cdi(&[("cdi.k8s.io/p", "nvidia.com/gpu=1")]);
        assert_eq!(gpus(&env("0"), &a), Ok(Some(vec![A.to_string(), B.to_string()])));
    }

    #[test]
    fn errors_name_the_source_and_value() {
        let none = HashMap::new();
        let e = gpus(&env("7"), &none).unwrap_err().to_string();
        assert!(
            e.starts_with("NVIDIA_VISIBLE_DEVICES=\"7\": GPU \"7\" is not on this node (known: 0=GPU-aaaa"),
            "{e}"
        );
        let e = gpus(&[], &cdi(&[("cdi.k8s.io/p", "nvidia.com/gpu=GPU-ffff")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("annotation cdi.k8s.io/p=\"nvidia.com/gpu=GPU-ffff\": GPU \"GPU-ffff\""),
            "{e}"
        );
        let e = gpus(&[], &cdi(&[("cdi.k8s.io/p", "nvidia.com/gpu=")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cdi.k8s.io/p") && e.contains("nvidia.com/gpu=<index|uuid|all>"),
            "{e}"
        );
        for mig in ["MIG-0c7a1f8e-5d4b-5f0e-9a3c-1b2c3d4e5f60", "0:1"] {
            let e = gpus(&env(mig), &none).unwrap_err().to_string();
            assert!(e.contains(mig) && e.contains("MIG"), "{e}");
        }
    }

    #[test]
    fn mig_enabled_gpus_are_refused() {
        let inv = inventory(true);
        let r = |v: &str| resolve(&requested(&env(v), &HashMap::new()).unwrap().unwrap(), &inv);
        assert!(r("0").is_ok());
        for value in ["1", "all", B] {
            let e = r(value).unwrap_err();
            assert!(
                matches!(e, DeviceError::MigEnabled { index: 1, .. }),
                "{value}: {e}"
            );
            assert!(e.to_string().contains("has MIG enabled"), "{e}");
        }
        let empty = Inventory {
            source: "nvml".into(),
            gpus: vec![],
        };
        let e = resolve(&requested(&env("all"), &HashMap::new()).unwrap().unwrap(), &empty).unwrap_err();
        assert!(matches!(e, DeviceError::NoGpus { .. }), "{e}");
    }
}
