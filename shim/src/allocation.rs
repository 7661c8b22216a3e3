//! The `gpu-mps.io/memory` units gpu-mps-device-plugin allocated to a container, read from the
//! container annotation its Allocate sets, and checked against the node's unit layout and the
//! GPU the container really got. Pure.

use std::collections::HashMap;

use gpu_mps_api::annotations::ALLOCATED_UNITS;
use gpu_mps_api::inventory::Inventory;
use gpu_mps_api::memory_units::{Allocation, RESOURCE_NAME, UnitError, UnitLayout};
use gpu_mps_api::message::printable;
use gpu_mps_api::{DaemonKey, NodeConfig};
use thiserror::Error;

use crate::request::AllocatedMemory;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum AllocationError {
    #[error(
        "this node schedules GPU memory by {RESOURCE_NAME} (device_plugin.enabled in the gpu-mps node config), and this container got GPU {gpus} without units of it: ask resources.limits {RESOURCE_NAME}: <GiB> instead of another GPU resource"
    )]
    Missing { gpus: String },
    #[error("container annotation {ALLOCATED_UNITS}: {0}")]
    Invalid(UnitError),
    #[error("the node's GPUs cannot be laid out in {RESOURCE_NAME} units: {0}")]
    Layout(UnitError),
    #[error(
        "the container got GPU {gpus}, but its {RESOURCE_NAME} units are on GPU {allocated}: a container must run on the GPU its units come from"
    )]
    OtherGpu { gpus: String, allocated: String },
    #[error(
        "the container got {RESOURCE_NAME} units ({units}) but no GPU reached its spec: where the device plugin hands GPUs over as CDI devices, containerd must have CDI on (enable_cdi on 1.7) and kubelet must pass CDI devices (1.28+); else start gpu-mps-device-plugin with --gpu-delivery=nodes"
    )]
    NoGpu { units: String },
}

/// Refuses a spec that carries units but no GPU: it would run without its GPU while its units
/// stay taken.
pub fn require_gpu_for_units(annotations: &HashMap<String, String>) -> Result<(), AllocationError> {
    match annotations.get(ALLOCATED_UNITS) {
        Some(units) => Err(AllocationError::NoGpu {
            units: printable(&units.chars().take(120).collect::<String>()).into_owned(),
        }),
        None => Ok(()),
    }
}

/// The allocation of a container and what it means for its limits; `None` when the spec
/// carries none and the node does not require one.
pub fn allocated_units(
    annotations: &HashMap<String, String>,
    daemon: &DaemonKey,
    config: &NodeConfig,
    inventory: &Inventory,
) -> Result<Option<(Allocation, AllocatedMemory)>, AllocationError> {
    let Some(value) = annotations.get(ALLOCATED_UNITS) else {
        if config.device_plugin.enabled {
            return Err(AllocationError::Missing {
                gpus: daemon.to_string(),
            });
        }
        return Ok(None);
    };
    let policy = config
        .device_plugin
        .unit_policy(config.limits.overcommit, config.limits.max_clients_per_gpu);
    let layout = UnitLayout::new(&inventory.gpus, &policy).map_err(AllocationError::Layout)?;
    let ids: Vec<String> = value.split(',').map(str::to_string).collect();
    let allocation = layout.allocation(&ids).map_err(AllocationError::Invalid)?;
    if daemon.gpu_uuids() != [allocation.gpu_uuid.clone()] {
        return Err(AllocationError::OtherGpu {
            gpus: daemon.to_string(),
            allocated: allocation.gpu_uuid.clone(),
        });
    }
    let units = u32::try_from(allocation.units.len()).unwrap_or(u32::MAX);
    let factor = config.device_plugin.default_thread_share_factor;
    let memory = AllocatedMemory {
        memory_bytes: allocation.memory_bytes,
        units,
        min_units_per_process: layout.min_units_per_process,
        max_clients_per_gpu: layout.max_clients_per_gpu,
        default_thread_percentage: layout.default_thread_percentage(&allocation.gpu_uuid, units, factor),
        thread_share_factor: factor,
    };
    Ok(Some((allocation, memory)))
}

#[cfg(test)]
mod tests {
    use gpu_mps_api::inventory::GpuInfo;

    use super::*;

    fn inventory() -> Inventory {
        let gpu = |index: u32, uuid: &str| GpuInfo {
            index,
            minor: index,
            uuid: uuid.into(),
            name: "test".into(),
            memory_bytes: 9 << 30,
            compute_mode: "Default".into(),
            mig_enabled: false,
        };
        Inventory {
            source: "file:test".into(),
            gpus: vec![gpu(0, "GPU-a"), gpu(1, "GPU-b")],
        }
    }

    fn with(value: &str) -> HashMap<String, String> {
        HashMap::from([(ALLOCATED_UNITS.to_string(), value.to_string())])
    }

    #[test]
    fn units_give_memory_and_a_thread_default() {
        let config = NodeConfig::default();
        let (a, m) = allocated_units(
            &with("GPU-a-m0,GPU-a-m3"),
            &DaemonKey::new(["GPU-a"]),
            &config,
            &inventory(),
        )
        .unwrap()
        .unwrap();
        assert_eq!(a.units, vec![0, 3]);
        assert_eq!((m.memory_bytes, m.units), (2 << 30, 2));
        // 8 units per GPU (9 GiB less 1 GiB reserve): 2 of 8 x 2 = 50 %.
        assert_eq!(m.default_thread_percentage, 50);
    }

    #[test]
    fn no_annotation_is_fine_unless_the_node_requires_one() {
        let mut config = NodeConfig::default();
        let key = DaemonKey::new(["GPU-a"]);
        assert_eq!(
            allocated_units(&HashMap::new(), &key, &config, &inventory()),
            Ok(None)
        );
        config.device_plugin.enabled = true;
        let e = allocated_units(&HashMap::new(), &key, &config, &inventory())
            .unwrap_err()
            .to_string();
        assert!(e.contains("resources.limits gpu-mps.io/memory"), "{e}");
    }

    #[test]
    fn units_without_a_gpu_are_refused() {
        let e = require_gpu_for_units(&with("GPU-a-m0")).unwrap_err().to_string();
        assert!(
            e.contains("no GPU reached its spec") && e.contains("--gpu-delivery=nodes"),
            "{e}"
        );
        assert_eq!(require_gpu_for_units(&HashMap::new()), Ok(()));
        // Found by fuzzing: the value is quoted as the spec holds it.
        let e = require_gpu_for_units(&with("GPU-a-m0\n\0GPU-a-m1"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("units (GPU-a-m0\\n\\0GPU-a-m1)") && !e.contains('\n'),
            "{e}"
        );
    }

    #[test]
    fn units_of_another_gpu_or_bad_ids_are_refused() {
        let config = NodeConfig::default();
        let e = allocated_units(
            &with("GPU-b-m0"),
            &DaemonKey::new(["GPU-a"]),
            &config,
            &inventory(),
        )
        .unwrap_err();
        assert!(matches!(e, AllocationError::OtherGpu { .. }), "{e}");
        for bad in ["GPU-a-m0,GPU-b-m0", "GPU-a-m9", "", "GPU-a-m1,GPU-a-m1"] {
            let e =
                allocated_units(&with(bad), &DaemonKey::new(["GPU-a"]), &config, &inventory()).unwrap_err();
            assert!(matches!(e, AllocationError::Invalid(_)), "{bad}: {e}");
            assert!(
                e.to_string()
                    .starts_with("container annotation gpu-mps-device-plugin/units: "),
                "{e}"
            );
        }
    }
}
