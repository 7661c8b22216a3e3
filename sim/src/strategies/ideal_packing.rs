//! C: an oracle that sees every GPU's free memory in the cluster and places each pod by best
//! fit: the GPU with the least memory left that still holds the pod (and has an MPS client
//! free), ties to the lowest GPU number. It decides with the same facts the manager checks, so
//! it never places a pod that is then refused. An upper reference, not something Kubernetes
//! does: no scheduler sees per-GPU capacity through the device plugin API.

use std::collections::BTreeSet;

use super::{Held, Outcome, Placement, Strategy};
use crate::cluster::Shape;
use crate::error::SimError;
use crate::gpu_ledger::GpuLedger;
use crate::workload::Pod;

pub struct IdealPacking {
    shape: Shape,
    ledger: GpuLedger,
    /// GPUs (cluster-wide numbers) by free GiB: `by_free[f]` holds the GPUs with f GiB left.
    by_free: Vec<BTreeSet<u32>>,
}

impl IdealPacking {
    pub fn new(shape: Shape) -> Self {
        let mut by_free = vec![BTreeSet::new(); shape.gib_per_gpu as usize + 1];
        by_free[shape.gib_per_gpu as usize] = (0..shape.total_gpus()).collect();
        IdealPacking {
            ledger: GpuLedger::new(&shape),
            shape,
            by_free,
        }
    }

    fn best_fit(&self, gib: u32) -> Option<u32> {
        self.by_free.iter().skip(gib as usize).find_map(|gpus| {
            gpus.iter()
                .copied()
                .find(|&g| self.ledger.has_client_slot(g as usize))
        })
    }

    fn move_bucket(&mut self, gpu: u32, from: u32, to: u32) {
        self.by_free[from as usize].remove(&gpu);
        self.by_free[to as usize].insert(gpu);
    }
}

impl Strategy for IdealPacking {
    fn name(&self) -> &'static str {
        "C. ideal per-GPU best fit (oracle)"
    }

    fn place(&mut self, pod: &Pod) -> Result<Outcome, SimError> {
        let Some(global) = self.best_fit(pod.ask_gib) else {
            return Ok(Outcome::Unschedulable);
        };
        let before = self.ledger.free_gib(global as usize);
        self.ledger.admit(global as usize, pod.ask_gib).map_err(|refusal| {
            SimError::Invalid(format!(
                "the oracle chose GPU {global} with {before} GiB free for {} GiB and the manager refused ({refusal:?})",
                pod.ask_gib
            ))
        })?;
        self.move_bucket(global, before, before - pod.ask_gib);
        Ok(Outcome::Placed(Placement {
            node: global / self.shape.gpus_per_node,
            gpu: global % self.shape.gpus_per_node,
            gib: pod.ask_gib,
            device_ids: Vec::new(),
            units: Vec::new(),
        }))
    }

    /// The oracle never refuses after scheduling, so holds nothing for failed pods.
    fn release_failed(&mut self, _held: &Held) {}

    fn release(&mut self, placement: &Placement) {
        let global = self.shape.gpu(placement.node, placement.gpu);
        let before = self.ledger.free_gib(global);
        self.ledger.release(global, placement.gib);
        self.move_bucket(global as u32, before, before + placement.gib);
    }
}
