//! A: NVIDIA's device plugin with time-slicing replicas, gpu-mps refusing at start. Each GPU
//! advertises `replicas` devices of `nvidia.com/gpu`; the scheduler counts replicas per node and
//! knows nothing of memory. kubelet takes a replica as NVIDIA's plugin prefers (its default
//! "distributed" policy: the GPU with the fewest replicas in use). Only then does gpu-mps's
//! manager see the pod's memory limit, and it refuses the container if that GPU lacks room.

use super::{Held, Outcome, Placement, Refusal, RefusalReason, Strategy};
use crate::cluster::Shape;
use crate::error::SimError;
use crate::gpu_ledger::{GpuLedger, ManagerRefusal};
use crate::kube_scheduler::KubeScheduler;
use crate::workload::Pod;

pub struct TimeSlicing {
    shape: Shape,
    replicas_per_gpu: u32,
    scheduler: KubeScheduler,
    /// Per node: replicas not in use, what the scheduler sees.
    node_free_replicas: Vec<u32>,
    /// Per GPU: replicas in use, what the plugin's preference looks at.
    replicas_in_use: Vec<u32>,
    ledger: GpuLedger,
}

impl TimeSlicing {
    pub fn new(shape: Shape, replicas_per_gpu: u32, scheduler: KubeScheduler) -> Result<Self, SimError> {
        if replicas_per_gpu == 0 {
            return Err(SimError::Invalid(
                "0 time-slicing replicas per GPU: at least 1 (--replicas)".into(),
            ));
        }
        let per_node = replicas_per_gpu.checked_mul(shape.gpus_per_node).ok_or_else(|| {
            SimError::Invalid(format!(
                "{replicas_per_gpu} replicas per GPU x {} GPUs per node overflows: lower --replicas",
                shape.gpus_per_node
            ))
        })?;
        Ok(TimeSlicing {
            shape,
            replicas_per_gpu,
            scheduler,
            node_free_replicas: vec![per_node; shape.nodes as usize],
            replicas_in_use: vec![0; shape.total_gpus() as usize],
            ledger: GpuLedger::new(&shape),
        })
    }

    /// NVIDIA's "distributed" allocation for one replica: the GPU with the fewest replicas in
    /// use; the plugin breaks ties by map order, we by the lower index.
    fn distributed_gpu(&self, node: u32) -> Option<u32> {
        (0..self.shape.gpus_per_node)
            .filter(|&g| self.replicas_in_use[self.shape.gpu(node, g)] < self.replicas_per_gpu)
            .min_by_key(|&g| (self.replicas_in_use[self.shape.gpu(node, g)], g))
    }
}

impl TimeSlicing {
    fn release_replica(&mut self, node: u32, gpu: u32) {
        self.node_free_replicas[node as usize] += 1;
        self.replicas_in_use[self.shape.gpu(node, gpu)] -= 1;
    }
}

impl Strategy for TimeSlicing {
    fn name(&self) -> &'static str {
        "A. time-slicing replicas, gpu-mps refuses at start"
    }

    fn place(&mut self, pod: &Pod) -> Result<Outcome, SimError> {
        let per_node = self.replicas_per_gpu * self.shape.gpus_per_node;
        let Some(node) = self.scheduler.pick(&self.node_free_replicas, per_node, 1) else {
            return Ok(Outcome::Unschedulable);
        };
        let gpu = self.distributed_gpu(node).ok_or_else(|| {
            SimError::Invalid(format!(
                "node {node} counted a free replica that no GPU of it has"
            ))
        })?;
        let index = self.shape.gpu(node, gpu);
        // kubelet allocates the replica before the container starts, refused or not.
        self.node_free_replicas[node as usize] -= 1;
        self.replicas_in_use[index] += 1;
        match self.ledger.admit(index, pod.ask_gib) {
            Ok(()) => Ok(Outcome::Placed(Placement {
                node,
                gpu,
                gib: pod.ask_gib,
                device_ids: Vec::new(),
                units: Vec::new(),
            })),
            // The pod fails; its replica comes back when it is seen Failed.
            Err(refusal) => {
                let (reason, message) = match refusal {
                    ManagerRefusal::Memory => (
                        RefusalReason::ManagerMemory,
                        format!(
                            "GPU {gpu} of node {node} has {} GiB of {} GiB left; this container asks {} GiB",
                            self.ledger.free_gib(index),
                            self.shape.gib_per_gpu,
                            pod.ask_gib
                        ),
                    ),
                    ManagerRefusal::Clients => (
                        RefusalReason::ManagerClients,
                        format!(
                            "GPU {gpu} of node {node} already serves {} CUDA processes",
                            self.shape.max_clients_per_gpu
                        ),
                    ),
                };
                Ok(Outcome::RefusedAfterScheduling(Refusal {
                    node,
                    reason,
                    message,
                    held: Held::Replica { node, gpu },
                }))
            }
        }
    }

    fn release(&mut self, placement: &Placement) {
        self.release_replica(placement.node, placement.gpu);
        self.ledger
            .release(self.shape.gpu(placement.node, placement.gpu), placement.gib);
    }

    fn release_failed(&mut self, held: &Held) {
        if let Held::Replica { node, gpu } = *held {
            self.release_replica(node, gpu);
        }
    }
}
