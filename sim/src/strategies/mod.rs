//! The three ways of placing a pod on a GPU that the simulation compares, behind one trait so
//! the event loop runs each on the same pods.

pub mod ideal_packing;
pub mod memory_units;
pub mod time_slicing;

use crate::error::SimError;
use crate::workload::Pod;

/// Where a pod runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub node: u32,
    /// The GPU's index on its node.
    pub gpu: u32,
    pub gib: u32,
    /// The `gpu-mps.io/memory` device IDs the container was allocated (units strategy only).
    pub device_ids: Vec<String>,
    /// Their unit numbers on `gpu`, as Allocate read them (units strategy only).
    pub units: Vec<u32>,
}

/// Why a pod that the scheduler bound to a node failed there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum RefusalReason {
    /// gpu-mps's manager: the GPU kubelet gave it has too little memory left.
    ManagerMemory,
    /// gpu-mps's manager: the GPU already serves its maximum of MPS clients.
    ManagerClients,
    /// The device plugin's Allocate: the units kubelet chose span GPUs (or are otherwise invalid).
    AllocateRefused,
}

impl RefusalReason {
    pub fn describe(self) -> &'static str {
        match self {
            RefusalReason::ManagerMemory => "gpu-mps manager at start: GPU memory",
            RefusalReason::ManagerClients => "gpu-mps manager at start: MPS clients",
            RefusalReason::AllocateRefused => "device plugin Allocate (UnexpectedAdmissionError)",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub node: u32,
    pub reason: RefusalReason,
    /// What the pod's events would say.
    pub message: String,
    /// What the failed pod still holds until Kubernetes sees it Failed; the strategy has taken
    /// it and gets it back through [`Strategy::release_failed`].
    pub held: Held,
}

/// What a pod refused after scheduling holds until it is seen Failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// A time-slicing replica of this GPU (index on the node): kubelet allocated it and the
    /// scheduler counts it.
    Replica { node: u32, gpu: u32 },
    /// Units the scheduler counts on the node; kubelet gave them back when Allocate failed.
    NodeUnits { node: u32, units: u32 },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Placed(Placement),
    /// Bound to a node, then failed there: a Job with restartPolicy Never does not retry.
    RefusedAfterScheduling(Refusal),
    /// No node passes the scheduler's filter; the pod is dropped.
    Unschedulable,
}

pub trait Strategy {
    /// The name in the report.
    fn name(&self) -> &'static str;
    /// Schedules and starts `pod` at its arrival.
    fn place(&mut self, pod: &Pod) -> Result<Outcome, SimError>;
    /// Gives back what `placement` held when its pod ends.
    fn release(&mut self, placement: &Placement);
    /// Gives back what a pod refused after scheduling held, once it is seen Failed.
    fn release_failed(&mut self, held: &Held);
}
