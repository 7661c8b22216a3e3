//! What Allocate answers for one container: its GPU (CDI device, or env and device nodes) and
//! its units, as the container annotation the shim reads. Pure.

use std::collections::HashMap;

use gpu_mps_api::annotations::ALLOCATED_UNITS;
use gpu_mps_api::memory_units::{Allocation, UnitId};

use crate::gpu_delivery::GpuDelivery;
use crate::v1beta1::{CdiDevice, ContainerAllocateResponse, DeviceSpec};

/// The env a GPU delivered by device nodes is named in.
pub const VISIBLE_DEVICES_ENV: &str = "NVIDIA_VISIBLE_DEVICES";

pub fn container_response(allocation: &Allocation, delivery: &GpuDelivery) -> ContainerAllocateResponse {
    let units: Vec<String> = allocation
        .units
        .iter()
        .map(|unit| {
            UnitId {
                gpu_uuid: allocation.gpu_uuid.clone(),
                unit: *unit,
            }
            .device_id()
        })
        .collect();
    let mut response = ContainerAllocateResponse {
        annotations: HashMap::from([(ALLOCATED_UNITS.to_string(), units.join(","))]),
        ..Default::default()
    };
    match delivery {
        GpuDelivery::Cdi { device, .. } => {
            response.cdi_devices.push(CdiDevice { name: device.clone() });
        }
        GpuDelivery::DeviceNodes {
            visible_devices,
            nodes,
        } => {
            response
                .envs
                .insert(VISIBLE_DEVICES_ENV.to_string(), visible_devices.clone());
            for (host, container) in nodes {
                response.devices.push(DeviceSpec {
                    container_path: container.clone(),
                    host_path: host.display().to_string(),
                    permissions: "rw".into(),
                });
            }
        }
    }
    response
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn allocation() -> Allocation {
        Allocation {
            gpu_uuid: "GPU-a".into(),
            gpu_index: 0,
            units: vec![1, 4],
            memory_bytes: 2 << 30,
        }
    }

    #[test]
    fn cdi_delivery_names_the_device_and_the_units() {
        let r = container_response(
            &allocation(),
            &GpuDelivery::Cdi {
                device: "nvidia.com/gpu=GPU-a".into(),
                spec: PathBuf::from("/etc/cdi/nvidia.yaml"),
            },
        );
        assert_eq!(r.annotations[ALLOCATED_UNITS], "GPU-a-m1,GPU-a-m4");
        assert_eq!(
            r.cdi_devices,
            vec![CdiDevice {
                name: "nvidia.com/gpu=GPU-a".into()
            }]
        );
        assert!(r.envs.is_empty() && r.devices.is_empty() && r.mounts.is_empty());
    }

    #[test]
    fn node_delivery_sets_the_env_and_the_nodes() {
        let r = container_response(
            &allocation(),
            &GpuDelivery::DeviceNodes {
                visible_devices: "GPU-a".into(),
                nodes: vec![(PathBuf::from("/dev/nvidia3"), "/dev/nvidia3".into())],
            },
        );
        assert_eq!(r.envs[VISIBLE_DEVICES_ENV], "GPU-a");
        assert_eq!(r.devices.len(), 1);
        assert_eq!(r.devices[0].host_path, "/dev/nvidia3");
        assert_eq!(r.devices[0].permissions, "rw");
        assert!(r.cdi_devices.is_empty());
    }
}
