//! GPU memory as units the Kubernetes scheduler can count (`gpu-mps.io/memory`), and the rules
//! that tie them to what the manager admits. Pure: the device plugin (kubelet's API) and the
//! manager, and later a DRA driver, share it, so they cannot disagree on a count.
//!
//! One device per unit per GPU. Its ID is `<gpu-uuid>-m<n>` (n from 0), at most 63 characters.
//! The count per GPU is (GPU memory x overcommit - the MPS server's reserve) / unit, so units
//! handed out never add up past what the manager's capacity check allows.
//!
//! MPS serves at most `max_clients_per_gpu` clients (48) per GPU, and every CUDA process is one.
//! Units alone do not bound that: 139 one-unit containers fit an H200's memory. So every CUDA
//! process must hold at least [`UnitLayout::min_units_per_process`] units, which makes the
//! number of processes per GPU at most units / minimum <= max clients. See docs/scheduling.md.

use std::collections::{BTreeMap, BTreeSet};

use thiserror::Error;

use crate::inventory::GpuInfo;
use crate::quantity::format_bytes;

/// The extended resource the device plugin advertises.
pub const RESOURCE_NAME: &str = "gpu-mps.io/memory";
/// Kubernetes device IDs longer than this are not portable (a label value's limit).
pub const MAX_DEVICE_ID_LEN: usize = 63;
/// What separates a GPU's UUID from the unit number in a device ID.
const UNIT_SEPARATOR: &str = "-m";

/// How the node turns GPU memory into units.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UnitPolicy {
    pub unit_bytes: u64,
    /// Memory the MPS server itself takes on each GPU, never handed out as units.
    pub server_reserve_bytes: u64,
    pub overcommit: f64,
    pub max_clients_per_gpu: u32,
}

/// The units of one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuUnits {
    pub index: u32,
    pub uuid: String,
    pub units: u32,
}

/// The units of every GPU of the node.
#[derive(Debug, Clone, PartialEq)]
pub struct UnitLayout {
    pub unit_bytes: u64,
    pub gpus: Vec<GpuUnits>,
    /// The fewest units one CUDA process may hold on this node (see the module doc).
    pub min_units_per_process: u32,
    pub max_clients_per_gpu: u32,
}

/// One unit: which GPU and which of its units.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct UnitId {
    pub gpu_uuid: String,
    pub unit: u32,
}

impl UnitId {
    pub fn device_id(&self) -> String {
        format!("{}{UNIT_SEPARATOR}{}", self.gpu_uuid, self.unit)
    }
}

/// What one container was given: units of one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    pub gpu_uuid: String,
    pub gpu_index: u32,
    /// Unit numbers, ascending, no duplicates.
    pub units: Vec<u32>,
    pub memory_bytes: u64,
}

#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum UnitError {
    #[error(
        "GPU {uuid}: device IDs would be {len} characters, more than {MAX_DEVICE_ID_LEN}; gpu-mps expects NVIDIA UUIDs (GPU- and 36 characters)"
    )]
    IdTooLong { uuid: String, len: usize },
    #[error(
        "GPU {uuid} has {memory} of memory, less than one unit of {unit} after the MPS server's reserve of {reserve}"
    )]
    NoUnits {
        uuid: String,
        memory: String,
        unit: String,
        reserve: String,
    },
    #[error("device ID {0:?} is not a gpu-mps.io/memory unit of this node (expected <gpu-uuid>-m<n>)")]
    UnknownDevice(String),
    #[error("device ID {0:?} is named twice in one request")]
    DuplicateDevice(String),
    #[error(
        "the units of one container must come from one GPU, and these come from {gpus}: a container's memory lives on one GPU's MPS server (ask for fewer units, at most {largest} on this node)"
    )]
    SpansGpus { gpus: String, largest: u32 },
    #[error("no units were requested")]
    Empty,
    #[error(
        "{units} unit(s) of gpu-mps.io/memory are fewer than the {min} this node needs per CUDA process (MPS serves {max_clients} clients per GPU, and a GPU has {per_gpu} units): ask for at least {min}"
    )]
    BelowMinimum {
        units: u32,
        min: u32,
        max_clients: u32,
        per_gpu: u32,
    },
}

impl UnitLayout {
    /// Lays out the units of `gpus` under `policy`. A GPU with MIG enabled gets none (gpu-mps
    /// does not serve it). Every GPU must fit at least one unit and IDs must fit in 63 characters.
    pub fn new(gpus: &[GpuInfo], policy: &UnitPolicy) -> Result<UnitLayout, UnitError> {
        let mut laid = Vec::new();
        for gpu in gpus.iter().filter(|g| !g.mig_enabled) {
            let capacity = memory_capacity(gpu.memory_bytes, policy.overcommit);
            let usable = capacity.saturating_sub(policy.server_reserve_bytes);
            let units = u32::try_from(usable / policy.unit_bytes.max(1)).unwrap_or(u32::MAX);
            if units == 0 {
                return Err(UnitError::NoUnits {
                    uuid: gpu.uuid.clone(),
                    memory: format_bytes(capacity),
                    unit: format_bytes(policy.unit_bytes),
                    reserve: format_bytes(policy.server_reserve_bytes),
                });
            }
            let len = UnitId {
                gpu_uuid: gpu.uuid.clone(),
                unit: units - 1,
            }
            .device_id()
            .len();
            if len > MAX_DEVICE_ID_LEN {
                return Err(UnitError::IdTooLong {
                    uuid: gpu.uuid.clone(),
                    len,
                });
            }
            laid.push(GpuUnits {
                index: gpu.index,
                uuid: gpu.uuid.clone(),
                units,
            });
        }
        let most = laid.iter().map(|g| g.units).max().unwrap_or(0);
        let max_clients = policy.max_clients_per_gpu.max(1);
        Ok(UnitLayout {
            unit_bytes: policy.unit_bytes,
            max_clients_per_gpu: max_clients,
            min_units_per_process: most.div_ceil(max_clients).max(1),
            gpus: laid,
        })
    }

    /// Every device ID of the node, GPU by GPU.
    pub fn device_ids(&self) -> Vec<UnitId> {
        self.gpus
            .iter()
            .flat_map(|g| {
                (0..g.units).map(move |unit| UnitId {
                    gpu_uuid: g.uuid.clone(),
                    unit,
                })
            })
            .collect()
    }

    /// The most units one container can get on this node (all of its largest GPU).
    pub fn largest_gpu_units(&self) -> u32 {
        self.gpus.iter().map(|g| g.units).max().unwrap_or(0)
    }

    /// Reads a device ID of this layout.
    pub fn parse(&self, id: &str) -> Result<UnitId, UnitError> {
        let unknown = || UnitError::UnknownDevice(id.to_string());
        let (uuid, unit) = id.rsplit_once(UNIT_SEPARATOR).ok_or_else(unknown)?;
        // Only the canonical spelling: "GPU-x-m007" would name unit 7 twice.
        if unit.is_empty()
            || (unit.len() > 1 && unit.starts_with('0'))
            || !unit.bytes().all(|b| b.is_ascii_digit())
        {
            return Err(unknown());
        }
        let unit: u32 = unit.parse().map_err(|_| unknown())?;
        let gpu = self.gpus.iter().find(|g| g.uuid == uuid).ok_or_else(unknown)?;
        if unit >= gpu.units {
            return Err(unknown());
        }
        Ok(UnitId {
            gpu_uuid: uuid.to_string(),
            unit,
        })
    }

    /// What a container given `ids` holds: all known, none twice, all on one GPU, at least the
    /// minimum for one process.
    pub fn allocation(&self, ids: &[String]) -> Result<Allocation, UnitError> {
        if ids.is_empty() {
            return Err(UnitError::Empty);
        }
        let mut by_gpu: BTreeMap<String, BTreeSet<u32>> = BTreeMap::new();
        for id in ids {
            let unit = self.parse(id)?;
            if !by_gpu.entry(unit.gpu_uuid).or_default().insert(unit.unit) {
                return Err(UnitError::DuplicateDevice(id.clone()));
            }
        }
        if by_gpu.len() > 1 {
            let gpus = by_gpu
                .iter()
                .map(|(uuid, units)| format!("{uuid} ({} units)", units.len()))
                .collect::<Vec<_>>()
                .join(" and ");
            return Err(UnitError::SpansGpus {
                gpus,
                largest: self.largest_gpu_units(),
            });
        }
        let (gpu_uuid, units) = by_gpu.into_iter().next().ok_or(UnitError::Empty)?;
        let units: Vec<u32> = units.into_iter().collect();
        let count = u32::try_from(units.len()).unwrap_or(u32::MAX);
        self.check_minimum(count)?;
        let gpu_index = self
            .gpus
            .iter()
            .find(|g| g.uuid == gpu_uuid)
            .map(|g| g.index)
            .unwrap_or_default();
        Ok(Allocation {
            memory_bytes: u64::from(count) * self.unit_bytes,
            gpu_uuid,
            gpu_index,
            units,
        })
    }

    /// Refuses fewer units than one CUDA process needs here.
    pub fn check_minimum(&self, units: u32) -> Result<(), UnitError> {
        if units < self.min_units_per_process {
            return Err(UnitError::BelowMinimum {
                units,
                min: self.min_units_per_process,
                max_clients: self.max_clients_per_gpu,
                per_gpu: self.largest_gpu_units(),
            });
        }
        Ok(())
    }

    /// kubelet's GetPreferredAllocation: `size` units from `available`, all from one GPU,
    /// including `must_include`. Best fit: the GPU with the fewest available units that still
    /// holds the request, so large holes stay whole for large pods; ties go to the lower GPU
    /// index, and within a GPU the lowest unit numbers are taken. `None` when no single GPU has
    /// room: kubelet then picks on its own, and Allocate refuses a spread.
    pub fn preferred(&self, available: &[String], must_include: &[String], size: u32) -> Option<Vec<String>> {
        // Unit numbers by GPU; an available ID that is not ours is left out, a must-include one
        // that is not ours leaves nothing to prefer.
        let mut free: BTreeMap<String, BTreeSet<u32>> = BTreeMap::new();
        for unit in available.iter().filter_map(|id| self.parse(id).ok()) {
            free.entry(unit.gpu_uuid).or_default().insert(unit.unit);
        }
        let mut must: BTreeMap<String, BTreeSet<u32>> = BTreeMap::new();
        for id in must_include {
            let unit = self.parse(id).ok()?;
            must.entry(unit.gpu_uuid).or_default().insert(unit.unit);
        }
        if must.len() > 1 {
            return None;
        }
        let size = size as usize;
        let mut candidates: Vec<(&GpuUnits, usize)> = self
            .gpus
            .iter()
            .filter(|g| must.is_empty() || must.contains_key(g.uuid.as_str()))
            .filter_map(|g| {
                let mut holds: BTreeSet<u32> = free.get(g.uuid.as_str()).cloned().unwrap_or_default();
                holds.extend(must.get(g.uuid.as_str()).into_iter().flatten().copied());
                (holds.len() >= size).then_some((g, holds.len()))
            })
            .collect();
        candidates.sort_by_key(|(g, n)| (*n, g.index));
        let (gpu, _) = candidates.first()?;
        let mut picked: BTreeSet<u32> = must.get(gpu.uuid.as_str()).cloned().unwrap_or_default();
        for unit in free.get(gpu.uuid.as_str()).into_iter().flatten() {
            if picked.len() >= size {
                break;
            }
            picked.insert(*unit);
        }
        Some(
            picked
                .into_iter()
                .map(|unit| {
                    UnitId {
                        gpu_uuid: gpu.uuid.clone(),
                        unit,
                    }
                    .device_id()
                })
                .collect(),
        )
    }

    /// The default active thread percentage of a container holding `units` of its GPU's units:
    /// `factor` times its memory share, at least 1 and at most 100. The percentage is a cap, not
    /// a reservation; caps above the fair share raised aggregate throughput on the H200
    /// (docs/gpu-results.md).
    pub fn default_thread_percentage(&self, gpu_uuid: &str, units: u32, factor: f64) -> u8 {
        let per_gpu = self
            .gpus
            .iter()
            .find(|g| g.uuid == gpu_uuid)
            .map(|g| g.units)
            .unwrap_or(0);
        if per_gpu == 0 {
            return 100;
        }
        let share = f64::from(units) / f64::from(per_gpu) * factor * 100.0;
        share.ceil().clamp(1.0, 100.0) as u8
    }
}

/// GPU memory x overcommit, in whole MiB (the unit limits are applied in). The manager's
/// capacity check uses the same figure.
pub fn memory_capacity(gpu_memory_bytes: u64, overcommit: f64) -> u64 {
    let mib = (gpu_memory_bytes >> 20) as f64 * overcommit;
    (mib.floor() as u64) << 20
}

/// Unit numbers as the hook passes them to the manager: `3,4,5`.
pub fn format_unit_list(units: &[u32]) -> String {
    units.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// Reads [`format_unit_list`]'s output; empty means none.
pub fn parse_unit_list(text: &str) -> Result<Vec<u32>, String> {
    if text.is_empty() {
        return Ok(Vec::new());
    }
    text.split(',')
        .map(|s| {
            s.parse::<u32>()
                .map_err(|_| format!("{s:?} in {text:?} is not a unit number"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn gpu(index: u32, uuid: &str, gib: u64) -> GpuInfo {
        GpuInfo {
            index,
            minor: index,
            uuid: uuid.into(),
            name: "test".into(),
            memory_bytes: gib * GIB,
            compute_mode: "Default".into(),
            mig_enabled: false,
        }
    }

    fn policy() -> UnitPolicy {
        UnitPolicy {
            unit_bytes: GIB,
            server_reserve_bytes: GIB / 2,
            overcommit: 1.0,
            max_clients_per_gpu: 48,
        }
    }

    const H200_UUID: &str = "GPU-2b5c3d7e-0f1a-4b2c-8d3e-4f5a6b7c8d9e";

    #[test]
    fn an_h200_has_139_units_and_3_per_process() {
        // 143771 MiB, as NVML reports an H200.
        let mut h200 = gpu(0, H200_UUID, 0);
        h200.memory_bytes = 143_771 << 20;
        let layout = UnitLayout::new(&[h200], &policy()).unwrap();
        assert_eq!(layout.gpus[0].units, 139);
        assert_eq!(layout.min_units_per_process, 3);
        // 139 / 3 = 46 processes at most: within MPS's 48.
        assert!(layout.gpus[0].units / layout.min_units_per_process <= 48);
        let ids = layout.device_ids();
        assert_eq!(ids.len(), 139);
        assert_eq!(ids[0].device_id(), format!("{H200_UUID}-m0"));
        assert!(ids.iter().all(|u| u.device_id().len() <= MAX_DEVICE_ID_LEN));
    }

    #[test]
    fn minimum_keeps_processes_within_max_clients_for_every_size() {
        for gib in 2..=200u64 {
            for max_clients in [1, 7, 48] {
                let p = UnitPolicy {
                    max_clients_per_gpu: max_clients,
                    ..policy()
                };
                let layout = UnitLayout::new(&[gpu(0, "GPU-a", gib)], &p).unwrap();
                let units = layout.gpus[0].units;
                assert!(
                    units / layout.min_units_per_process <= max_clients,
                    "{gib} GiB, {max_clients} clients: {units} units, min {}",
                    layout.min_units_per_process
                );
            }
        }
    }

    #[test]
    fn a_gpu_below_one_unit_or_with_a_long_uuid_is_refused() {
        let e = UnitLayout::new(&[gpu(0, "GPU-a", 0)], &policy()).unwrap_err();
        assert!(matches!(e, UnitError::NoUnits { .. }), "{e}");
        let long = format!("GPU-{}", "a".repeat(60));
        let e = UnitLayout::new(&[gpu(0, &long, 8)], &policy()).unwrap_err();
        assert!(e.to_string().contains("more than 63"), "{e}");
    }

    #[test]
    fn mig_gpus_get_no_units() {
        let mut mig = gpu(1, "GPU-b", 8);
        mig.mig_enabled = true;
        let layout = UnitLayout::new(&[gpu(0, "GPU-a", 8), mig], &policy()).unwrap();
        assert_eq!(layout.gpus.len(), 1);
    }

    #[test]
    fn overcommit_and_reserve_set_the_count() {
        let p = UnitPolicy {
            overcommit: 2.0,
            server_reserve_bytes: 2 * GIB,
            ..policy()
        };
        let layout = UnitLayout::new(&[gpu(0, "GPU-a", 10)], &p).unwrap();
        assert_eq!(layout.gpus[0].units, 18);
    }

    fn two_gpus() -> UnitLayout {
        UnitLayout::new(&[gpu(0, "GPU-a", 9), gpu(1, "GPU-b", 9)], &policy()).unwrap()
    }

    fn ids(picks: &[(&str, u32)]) -> Vec<String> {
        picks
            .iter()
            .map(|(g, u)| {
                UnitId {
                    gpu_uuid: (*g).into(),
                    unit: *u,
                }
                .device_id()
            })
            .collect()
    }

    #[test]
    fn parse_takes_only_canonical_ids_of_this_node() {
        let l = two_gpus();
        assert_eq!(l.gpus[0].units, 8);
        assert_eq!(l.parse("GPU-a-m7").unwrap().unit, 7);
        for bad in [
            "GPU-a-m8",
            "GPU-a-m07",
            "GPU-a-m",
            "GPU-c-m1",
            "GPU-a-m-1",
            "GPU-a",
            "",
            "GPU-a-m1x",
            "GPU-a-m99999999999",
        ] {
            assert_eq!(l.parse(bad), Err(UnitError::UnknownDevice(bad.into())), "{bad}");
        }
    }

    #[test]
    fn allocation_checks_one_gpu_no_duplicates_known_ids() {
        let l = two_gpus();
        let a = l.allocation(&ids(&[("GPU-b", 3), ("GPU-b", 1)])).unwrap();
        assert_eq!(
            a,
            Allocation {
                gpu_uuid: "GPU-b".into(),
                gpu_index: 1,
                units: vec![1, 3],
                memory_bytes: 2 * GIB
            }
        );
        let e = l.allocation(&ids(&[("GPU-a", 1), ("GPU-b", 1)])).unwrap_err();
        assert!(
            e.to_string().contains("GPU-a (1 units) and GPU-b (1 units)"),
            "{e}"
        );
        let e = l.allocation(&ids(&[("GPU-a", 1), ("GPU-a", 1)])).unwrap_err();
        assert_eq!(e, UnitError::DuplicateDevice("GPU-a-m1".into()));
        assert_eq!(l.allocation(&[]), Err(UnitError::Empty));
        assert!(matches!(
            l.allocation(&["x".into()]),
            Err(UnitError::UnknownDevice(_))
        ));
    }

    #[test]
    fn allocation_below_the_minimum_is_refused() {
        let p = UnitPolicy {
            max_clients_per_gpu: 2,
            ..policy()
        };
        let l = UnitLayout::new(&[gpu(0, "GPU-a", 9)], &p).unwrap();
        assert_eq!(l.min_units_per_process, 4);
        let e = l.allocation(&ids(&[("GPU-a", 0), ("GPU-a", 1)])).unwrap_err();
        assert!(e.to_string().contains("ask for at least 4"), "{e}");
        assert!(
            l.allocation(&ids(&[("GPU-a", 0), ("GPU-a", 1), ("GPU-a", 2), ("GPU-a", 5)]))
                .is_ok()
        );
    }

    #[test]
    fn preferred_is_best_fit_on_one_gpu() {
        let l = two_gpus();
        // GPU-a has 3 free, GPU-b 8: a request of 2 goes to the tighter GPU-a.
        let mut available = ids(&[("GPU-a", 2), ("GPU-a", 5), ("GPU-a", 6)]);
        available.extend(
            l.device_ids()
                .iter()
                .filter(|u| u.gpu_uuid == "GPU-b")
                .map(UnitId::device_id),
        );
        assert_eq!(
            l.preferred(&available, &[], 2).unwrap(),
            ids(&[("GPU-a", 2), ("GPU-a", 5)])
        );
        // 4 do not fit GPU-a: GPU-b, lowest units first.
        assert_eq!(
            l.preferred(&available, &[], 4).unwrap(),
            ids(&[("GPU-b", 0), ("GPU-b", 1), ("GPU-b", 2), ("GPU-b", 3)])
        );
        // must_include pins the GPU.
        let must = ids(&[("GPU-b", 7)]);
        assert_eq!(
            l.preferred(&available, &must, 2).unwrap(),
            ids(&[("GPU-b", 0), ("GPU-b", 7)])
        );
        // 9 fit no single GPU.
        assert_eq!(l.preferred(&available, &[], 9), None);
        // must_include on two GPUs cannot be honoured on one.
        assert_eq!(
            l.preferred(&available, &ids(&[("GPU-a", 2), ("GPU-b", 0)]), 2),
            None
        );
    }

    #[test]
    fn preferred_ties_go_to_the_lower_index() {
        let l = two_gpus();
        let available: Vec<String> = l.device_ids().iter().map(UnitId::device_id).collect();
        assert_eq!(l.preferred(&available, &[], 1).unwrap(), ids(&[("GPU-a", 0)]));
    }

    #[test]
    fn default_threads_are_a_multiple_of_the_memory_share() {
        let l = two_gpus();
        assert_eq!(l.default_thread_percentage("GPU-a", 2, 2.0), 50);
        assert_eq!(l.default_thread_percentage("GPU-a", 2, 1.0), 25);
        assert_eq!(l.default_thread_percentage("GPU-a", 8, 2.0), 100);
        assert_eq!(l.default_thread_percentage("GPU-a", 1, 0.01), 1);
        assert_eq!(l.default_thread_percentage("GPU-x", 1, 2.0), 100);
    }

    #[test]
    fn unit_lists_round_trip() {
        assert_eq!(
            parse_unit_list(&format_unit_list(&[3, 4, 10])).unwrap(),
            vec![3, 4, 10]
        );
        assert_eq!(parse_unit_list("").unwrap(), Vec::<u32>::new());
        assert!(parse_unit_list("1,x").unwrap_err().contains("\"x\""));
    }
}
