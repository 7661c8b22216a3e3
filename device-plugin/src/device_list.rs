//! The device list ListAndWatch sends: every unit of every GPU, with its GPU's health. Pure.

use std::collections::HashMap;

use gpu_mps_api::memory_units::UnitLayout;

use crate::v1beta1::{Device, HEALTHY, UNHEALTHY};

/// `unhealthy` maps a GPU's UUID to why it cannot take containers now; a GPU not in it is
/// healthy.
pub fn devices(layout: &UnitLayout, unhealthy: &HashMap<String, String>) -> Vec<Device> {
    layout
        .device_ids()
        .into_iter()
        .map(|unit| Device {
            health: if unhealthy.contains_key(&unit.gpu_uuid) {
                UNHEALTHY
            } else {
                HEALTHY
            }
            .to_string(),
            id: unit.device_id(),
            topology: None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use gpu_mps_api::inventory::GpuInfo;
    use gpu_mps_api::memory_units::UnitPolicy;

    use super::*;

    #[test]
    fn every_unit_is_listed_with_its_gpus_health() {
        let gpu = |index: u32, uuid: &str| GpuInfo {
            index,
            minor: index,
            uuid: uuid.into(),
            name: "t".into(),
            memory_bytes: 4 << 30,
            compute_mode: "Default".into(),
            mig_enabled: false,
        };
        let layout = UnitLayout::new(
            &[gpu(0, "GPU-a"), gpu(1, "GPU-b")],
            &UnitPolicy {
                unit_bytes: 1 << 30,
                server_reserve_bytes: 1 << 30,
                overcommit: 1.0,
                max_clients_per_gpu: 48,
            },
        )
        .unwrap();
        let sick = HashMap::from([("GPU-b".to_string(), "fault".to_string())]);
        let list = devices(&layout, &sick);
        assert_eq!(list.len(), 6);
        assert_eq!(list[0].id, "GPU-a-m0");
        assert!(list[..3].iter().all(|d| d.health == HEALTHY));
        assert!(list[3..].iter().all(|d| d.health == UNHEALTHY));
    }
}
