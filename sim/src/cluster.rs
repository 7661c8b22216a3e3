//! The cluster: identical nodes of identical GPUs, laid out as `gpu-mps.io/memory` units by the
//! device plugin's own code ([`UnitLayout`]), so every strategy counts the same capacity.

use gpu_mps_api::inventory::GpuInfo;
use gpu_mps_api::memory_units::{UnitLayout, UnitPolicy};

use crate::error::SimError;

/// An H200's memory as NVML reports it.
pub const H200_MEMORY_MIB: u64 = 143_771;
const GIB: u64 = 1 << 30;

#[derive(Debug, Clone, PartialEq)]
pub struct ClusterSpec {
    pub nodes: u32,
    pub gpus_per_node: u32,
    pub gpu_memory_bytes: u64,
    pub policy: UnitPolicy,
}

impl ClusterSpec {
    /// H200s with 1 GiB units, a 1 GiB reserve for the MPS server, no overcommit, 48 clients.
    pub fn h200(nodes: u32, gpus_per_node: u32) -> Self {
        ClusterSpec {
            nodes,
            gpus_per_node,
            gpu_memory_bytes: H200_MEMORY_MIB << 20,
            policy: UnitPolicy {
                unit_bytes: GIB,
                server_reserve_bytes: GIB,
                overcommit: 1.0,
                max_clients_per_gpu: 48,
            },
        }
    }

    /// One node's GPUs. Every node has the same UUIDs: each node is its own device plugin, and
    /// one layout then serves them all.
    pub fn node_gpus(&self) -> Vec<GpuInfo> {
        (0..self.gpus_per_node)
            .map(|index| GpuInfo {
                index,
                minor: index,
                uuid: format!("GPU-5c4ed000-0000-4000-8000-{index:012x}"),
                name: "NVIDIA H200".into(),
                memory_bytes: self.gpu_memory_bytes,
                compute_mode: "Default".into(),
                mig_enabled: false,
            })
            .collect()
    }

    /// The node's units, by the device plugin's code.
    pub fn layout(&self) -> Result<UnitLayout, SimError> {
        if self.nodes == 0 || self.gpus_per_node == 0 {
            return Err(SimError::Invalid(format!(
                "{} nodes x {} GPUs: both must be at least 1 (--nodes, --gpus-per-node)",
                self.nodes, self.gpus_per_node
            )));
        }
        if self.nodes.checked_mul(self.gpus_per_node).is_none() {
            return Err(SimError::Invalid(format!(
                "{} nodes x {} GPUs is more GPUs than the simulator counts ({}): lower --nodes or --gpus-per-node",
                self.nodes,
                self.gpus_per_node,
                u32::MAX
            )));
        }
        Ok(UnitLayout::new(&self.node_gpus(), &self.policy)?)
    }
}

/// The numbers every strategy shares. A unit is one GiB, so a GPU's capacity in GiB is its unit
/// count: what the device plugin advertises and what gpu-mps admits per GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub nodes: u32,
    pub gpus_per_node: u32,
    pub gib_per_gpu: u32,
    pub max_clients_per_gpu: u32,
    pub min_units_per_process: u32,
}

impl Shape {
    pub fn new(spec: &ClusterSpec, layout: &UnitLayout) -> Result<Shape, SimError> {
        if layout.unit_bytes != GIB {
            return Err(SimError::Invalid(format!(
                "units of {} bytes: the simulator counts memory in 1 GiB units",
                layout.unit_bytes
            )));
        }
        let gib_per_gpu = layout.largest_gpu_units();
        if layout.gpus.len() != spec.gpus_per_node as usize
            || layout.gpus.iter().any(|g| g.units != gib_per_gpu)
        {
            return Err(SimError::Invalid(
                "the simulator needs identical GPUs on every node".into(),
            ));
        }
        Ok(Shape {
            nodes: spec.nodes,
            gpus_per_node: spec.gpus_per_node,
            gib_per_gpu,
            max_clients_per_gpu: layout.max_clients_per_gpu,
            min_units_per_process: layout.min_units_per_process,
        })
    }

    pub fn total_gpus(&self) -> u32 {
        self.nodes * self.gpus_per_node
    }

    pub fn capacity_gib(&self) -> u64 {
        u64::from(self.total_gpus()) * u64::from(self.gib_per_gpu)
    }

    /// The cluster-wide number of GPU `gpu` of node `node`.
    pub fn gpu(&self, node: u32, gpu: u32) -> usize {
        (node * self.gpus_per_node + gpu) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_h200_node_has_139_units_per_gpu_and_3_per_process() {
        let spec = ClusterSpec::h200(1000, 8);
        let layout = spec.layout().unwrap();
        let shape = Shape::new(&spec, &layout).unwrap();
        assert_eq!(shape.gib_per_gpu, 139);
        assert_eq!(shape.min_units_per_process, 3);
        assert_eq!(shape.max_clients_per_gpu, 48);
        assert_eq!(shape.capacity_gib(), 1000 * 8 * 139);
        assert!(spec.node_gpus().iter().all(|g| g.uuid.len() == 40));
    }

    #[test]
    fn an_empty_cluster_is_refused() {
        let e = ClusterSpec::h200(0, 8).layout().unwrap_err();
        assert!(e.to_string().contains("--nodes"), "{e}");
    }
}
