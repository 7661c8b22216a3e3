//! B: gpu-mps's device plugin advertising `gpu-mps.io/memory` units. The scheduler sees a node's
//! free units as one number (a node's allocatable count, not per GPU). kubelet asks the plugin's
//! GetPreferredAllocation, which takes all of a pod's units from one GPU, best fit. When no
//! single GPU has room although the node total does (fragmentation), there is no such answer:
//! kubelet picks units itself, they span GPUs, and the plugin's Allocate refuses them.
//!
//! The device IDs, the spread check and the unit numbers come from the plugin's own code
//! ([`UnitLayout::allocation`]). GetPreferredAllocation's best fit is recomputed here from free
//! counts, because [`UnitLayout::preferred`] parses every free ID of the node on each call (a
//! thousand strings per pod, millions of pods); `cross_check` runs both and stops on any
//! difference, and the tests run it.

use gpu_mps_api::memory_units::{UnitId, UnitLayout};

use super::{Held, Outcome, Placement, Refusal, RefusalReason, Strategy};
use crate::cluster::Shape;
use crate::error::SimError;
use crate::gpu_ledger::{GpuLedger, ManagerRefusal};
use crate::kube_scheduler::KubeScheduler;
use crate::workload::Pod;

/// The free units of one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitSet {
    words: Vec<u64>,
    count: u32,
}

impl UnitSet {
    pub fn full(units: u32) -> Self {
        let mut words = vec![u64::MAX; units.div_ceil(64) as usize];
        if units % 64 != 0 {
            if let Some(last) = words.last_mut() {
                *last = (1u64 << (units % 64)) - 1;
            }
        }
        UnitSet { words, count: units }
    }

    pub fn from_units(total: u32, free: &[u32]) -> Self {
        let mut set = UnitSet {
            words: vec![0; total.div_ceil(64) as usize],
            count: 0,
        };
        set.put(free);
        set
    }

    pub fn count(&self) -> u32 {
        self.count
    }

    pub fn contains(&self, unit: u32) -> bool {
        self.words
            .get((unit / 64) as usize)
            .is_some_and(|w| w & (1 << (unit % 64)) != 0)
    }

    /// The free units, ascending.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &word)| {
            let mut rest = word;
            std::iter::from_fn(move || {
                (rest != 0).then(|| {
                    let bit = rest.trailing_zeros();
                    rest &= rest - 1;
                    i as u32 * 64 + bit
                })
            })
        })
    }

    /// Removes `units`; false, and nothing removed, if any is not free.
    pub fn take(&mut self, units: &[u32]) -> bool {
        if !units.iter().all(|&u| self.contains(u)) {
            return false;
        }
        for &u in units {
            self.words[(u / 64) as usize] &= !(1 << (u % 64));
        }
        self.count -= units.len() as u32;
        true
    }

    pub fn put(&mut self, units: &[u32]) {
        for &u in units {
            let Some(word) = self.words.get_mut((u / 64) as usize) else {
                continue;
            };
            if *word & (1 << (u % 64)) == 0 {
                *word |= 1 << (u % 64);
                self.count += 1;
            }
        }
    }
}

/// GetPreferredAllocation's choice as [`UnitLayout::preferred`] makes it: the GPU (by position
/// on the node) with the fewest free units that still holds `size`, ties to the lower index,
/// and its lowest free unit numbers; `None` when no GPU holds `size`.
pub fn best_fit(gpus: &[UnitSet], size: u32) -> Option<(usize, Vec<u32>)> {
    let (gpu, set) = gpus
        .iter()
        .enumerate()
        .filter(|(_, s)| s.count() >= size)
        .min_by_key(|(i, s)| (s.count(), *i))?;
    Some((gpu, set.iter().take(size as usize).collect()))
}

/// What kubelet takes when the plugin prefers nothing: the lowest available IDs, GPU by GPU.
/// Any `size` units here span GPUs (no single GPU holds `size`), so which ones does not change
/// the outcome.
fn kubelet_own_pick(gpus: &[UnitSet], size: u32) -> Vec<(usize, u32)> {
    gpus.iter()
        .enumerate()
        .flat_map(|(g, set)| set.iter().map(move |u| (g, u)))
        .take(size as usize)
        .collect()
}

pub struct MemoryUnits {
    shape: Shape,
    layout: UnitLayout,
    scheduler: KubeScheduler,
    /// Per node: free units, the node's allocatable count the scheduler sees.
    node_free_units: Vec<u32>,
    /// Per GPU: its free units, what kubelet offers the plugin as available.
    free: Vec<UnitSet>,
    ledger: GpuLedger,
    cross_check: bool,
}

impl MemoryUnits {
    pub fn new(shape: Shape, layout: UnitLayout, scheduler: KubeScheduler, cross_check: bool) -> Self {
        let per_node = shape.gib_per_gpu * shape.gpus_per_node;
        MemoryUnits {
            node_free_units: vec![per_node; shape.nodes as usize],
            free: (0..shape.total_gpus())
                .map(|_| UnitSet::full(shape.gib_per_gpu))
                .collect(),
            ledger: GpuLedger::new(&shape),
            shape,
            layout,
            scheduler,
            cross_check,
        }
    }

    fn device_id(&self, gpu: usize, unit: u32) -> String {
        UnitId {
            gpu_uuid: self.layout.gpus[gpu].uuid.clone(),
            unit,
        }
        .device_id()
    }

    fn node_gpus(&self, node: u32) -> &[UnitSet] {
        let first = self.shape.gpu(node, 0);
        &self.free[first..first + self.shape.gpus_per_node as usize]
    }

    /// The pod fails admission on `node`. kubelet keeps no units of it, but the scheduler counts
    /// its request on the node until it sees the pod Failed.
    fn refuse(&mut self, node: u32, pod: &Pod, reason: RefusalReason, message: String) -> Outcome {
        self.node_free_units[node as usize] -= pod.ask_gib;
        Outcome::RefusedAfterScheduling(Refusal {
            node,
            reason,
            message,
            held: Held::NodeUnits {
                node,
                units: pod.ask_gib,
            },
        })
    }

    /// Runs the plugin's own GetPreferredAllocation on the node's free IDs and compares.
    fn check_preferred(&self, node: u32, size: u32, fast: &Option<Vec<String>>) -> Result<(), SimError> {
        let available: Vec<String> = self
            .node_gpus(node)
            .iter()
            .enumerate()
            .flat_map(|(g, set)| set.iter().map(move |u| (g, u)))
            .map(|(g, u)| self.device_id(g, u))
            .collect();
        let real = self.layout.preferred(&available, &[], size);
        if &real != fast {
            return Err(SimError::PreferredDisagrees {
                node,
                size,
                fast: fast.clone(),
                real,
            });
        }
        Ok(())
    }
}

impl Strategy for MemoryUnits {
    fn name(&self) -> &'static str {
        "B. gpu-mps.io/memory units, best-fit preferred allocation"
    }

    fn place(&mut self, pod: &Pod) -> Result<Outcome, SimError> {
        let per_node = self.shape.gib_per_gpu * self.shape.gpus_per_node;
        let Some(node) = self.scheduler.pick(&self.node_free_units, per_node, pod.ask_gib) else {
            return Ok(Outcome::Unschedulable);
        };
        let gpus = self.node_gpus(node);
        let preferred = best_fit(gpus, pod.ask_gib).map(|(g, units)| {
            units
                .into_iter()
                .map(|u| self.device_id(g, u))
                .collect::<Vec<_>>()
        });
        if self.cross_check {
            self.check_preferred(node, pod.ask_gib, &preferred)?;
        }
        let ids = match preferred {
            Some(ids) => ids,
            None => kubelet_own_pick(gpus, pod.ask_gib)
                .into_iter()
                .map(|(g, u)| self.device_id(g, u))
                .collect(),
        };
        let allocation = match self.layout.allocation(&ids) {
            Ok(a) => a,
            Err(e) => return Ok(self.refuse(node, pod, RefusalReason::AllocateRefused, e.to_string())),
        };
        let gpu = self
            .layout
            .gpus
            .iter()
            .position(|g| g.index == allocation.gpu_index)
            .ok_or_else(|| SimError::Invalid(format!("Allocate named GPU index {}", allocation.gpu_index)))?;
        let index = self.shape.gpu(node, gpu as u32);
        // The manager's own check, which units must always pass (no run has reached the refusal;
        // were it reached, the pod would be treated like one Allocate refused).
        if let Err(refusal) = self.ledger.admit(index, allocation.units.len() as u32) {
            let reason = match refusal {
                ManagerRefusal::Memory => RefusalReason::ManagerMemory,
                ManagerRefusal::Clients => RefusalReason::ManagerClients,
            };
            let message = format!("GPU {gpu} of node {node} refused units the plugin allocated");
            return Ok(self.refuse(node, pod, reason, message));
        }
        if !self.free[index].take(&allocation.units) {
            return Err(SimError::Invalid(format!(
                "units {:?} of GPU {gpu} on node {node} were allocated twice",
                allocation.units
            )));
        }
        self.node_free_units[node as usize] -= allocation.units.len() as u32;
        Ok(Outcome::Placed(Placement {
            node,
            gpu: gpu as u32,
            gib: allocation.units.len() as u32,
            device_ids: ids,
            units: allocation.units,
        }))
    }

    fn release(&mut self, placement: &Placement) {
        let index = self.shape.gpu(placement.node, placement.gpu);
        self.free[index].put(&placement.units);
        self.node_free_units[placement.node as usize] += placement.units.len() as u32;
        self.ledger.release(index, placement.gib);
    }

    fn release_failed(&mut self, held: &Held) {
        if let Held::NodeUnits { node, units } = *held {
            self.node_free_units[node as usize] += units;
        }
    }
}

#[cfg(test)]
mod tests {
    use gpu_mps_api::inventory::GpuInfo;
    use gpu_mps_api::memory_units::UnitPolicy;

    use super::*;
    use crate::prng::SplitMix64;

    #[test]
    fn unit_sets_take_put_and_list_ascending() {
        let mut s = UnitSet::full(139);
        assert_eq!(s.count(), 139);
        assert_eq!(s.iter().count(), 139);
        assert!(s.contains(138) && !s.contains(139));
        assert!(s.take(&[0, 64, 138]));
        assert!(!s.take(&[1, 64]), "64 is taken");
        assert!(s.contains(1), "a refused take removes nothing");
        assert_eq!(s.count(), 136);
        assert_eq!(s.iter().take(3).collect::<Vec<_>>(), [1, 2, 3]);
        s.put(&[64, 64]);
        assert_eq!(s.count(), 137);
        assert_eq!(
            UnitSet::from_units(10, &[7, 2]).iter().collect::<Vec<_>>(),
            [2, 7]
        );
    }

    fn small_layout(gpus: u32, gib: u64) -> UnitLayout {
        let infos: Vec<GpuInfo> = (0..gpus)
            .map(|index| GpuInfo {
                index,
                minor: index,
                uuid: format!("GPU-{index}"),
                name: "test".into(),
                memory_bytes: gib << 30,
                compute_mode: "Default".into(),
                mig_enabled: false,
            })
            .collect();
        let policy = UnitPolicy {
            unit_bytes: 1 << 30,
            server_reserve_bytes: 1 << 30,
            overcommit: 1.0,
            max_clients_per_gpu: 48,
        };
        UnitLayout::new(&infos, &policy).unwrap()
    }

    /// The fast path against the plugin's own GetPreferredAllocation, on random free sets.
    #[test]
    fn best_fit_picks_what_unit_layout_preferred_picks() {
        let mut rng = SplitMix64::new(42);
        let mut some = 0;
        let mut none = 0;
        for _ in 0..3_000 {
            let gpus = 1 + rng.below(4) as u32;
            let gib = 2 + rng.below(20);
            let layout = small_layout(gpus, gib);
            let units = layout.gpus[0].units;
            // Each GPU free with some chance per unit; some GPUs nearly full, some empty.
            let sets: Vec<UnitSet> = (0..gpus)
                .map(|_| {
                    let p = rng.below(101);
                    let free: Vec<u32> = (0..units).filter(|_| rng.below(100) < p).collect();
                    UnitSet::from_units(units, &free)
                })
                .collect();
            let available: Vec<String> = sets
                .iter()
                .enumerate()
                .flat_map(|(g, s)| s.iter().map(move |u| (g, u)))
                .map(|(g, u)| format!("GPU-{g}-m{u}"))
                .collect();
            let size = 1 + rng.below(u64::from(units) + 1) as u32;
            let fast = best_fit(&sets, size).map(|(g, us)| {
                us.into_iter()
                    .map(|u| format!("GPU-{g}-m{u}"))
                    .collect::<Vec<_>>()
            });
            let real = layout.preferred(&available, &[], size);
            assert_eq!(fast, real, "gpus {gpus}, {gib} GiB, size {size}, free {sets:?}");
            if real.is_some() {
                some += 1;
            } else {
                none += 1;
            }
        }
        // Both answers were exercised, not just one.
        assert!(some > 500 && none > 500, "{some} fits, {none} misses");
    }

    #[test]
    fn kubelet_own_pick_takes_the_lowest_ids_across_gpus() {
        let sets = [
            UnitSet::from_units(8, &[5, 6]),
            UnitSet::from_units(8, &[0, 1, 2]),
        ];
        assert_eq!(kubelet_own_pick(&sets, 4), [(0, 5), (0, 6), (1, 0), (1, 1)]);
        assert_eq!(best_fit(&sets, 4), None);
        assert_eq!(best_fit(&sets, 2), Some((0, vec![5, 6])));
    }
}
