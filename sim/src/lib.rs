//! A deterministic simulation of a GPU cluster that shares GPUs through gpu-mps: the same pods,
//! arriving and leaving, placed three ways (time-slicing replicas, `gpu-mps.io/memory` units,
//! an ideal per-GPU packer), to compare memory utilisation, pods placed and pods refused after
//! the scheduler had bound them. docs/scheduling.md, "Simulation at cluster scale".

pub mod cluster;
pub mod error;
pub mod gpu_ledger;
pub mod kube_scheduler;
pub mod prng;
pub mod report;
pub mod simulation;
pub mod strategies;
pub mod workload;

use gpu_mps_api::memory_units::UnitLayout;

pub use crate::cluster::{ClusterSpec, Shape};
pub use crate::error::SimError;
pub use crate::kube_scheduler::{KubeScheduler, Scoring};
pub use crate::simulation::{StrategyResult, Window};
pub use crate::workload::{MS_PER_HOUR, Pod, SizeMix, WorkloadSpec};

use crate::prng::SplitMix64;
use crate::strategies::Strategy;
use crate::strategies::ideal_packing::IdealPacking;
use crate::strategies::memory_units::MemoryUnits;
use crate::strategies::time_slicing::TimeSlicing;

/// How fast pods arrive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ArrivalRate {
    /// Offered memory as a share of the cluster's: rate = load x capacity / (mean ask x mean lifetime).
    Load(f64),
    PerMinute(f64),
}

/// How the strategies are set up; the same for every run on a given set of pods.
#[derive(Debug, Clone, PartialEq)]
pub struct StrategyConfig {
    pub replicas_per_gpu: u32,
    pub scoring: Scoring,
    /// kube-scheduler's percentageOfNodesToScore: 0 for its adaptive default.
    pub percentage_of_nodes_to_score: u32,
    /// Seeds the schedulers' tie-breaks (a stream apart from the pods').
    pub seed: u64,
    /// Runs the device plugin's own GetPreferredAllocation beside the fast path on every pod.
    pub cross_check_preferred: bool,
    /// How long a pod refused after scheduling keeps its replica or its request on the node,
    /// until kubelet reports it Failed and the scheduler drops it.
    pub failed_release_ms: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    pub cluster: ClusterSpec,
    pub strategies: StrategyConfig,
    pub seed: u64,
    pub rate: ArrivalRate,
    pub mean_lifetime_minutes: f64,
    pub hours: f64,
    pub warmup_hours: f64,
    pub mix: SizeMix,
    /// Keep every event (for tests; memory grows with the pods).
    pub record: bool,
}

/// A finished run: the inputs it resolved to and one result per strategy.
#[derive(Debug, Clone, PartialEq)]
pub struct Simulation {
    pub config: SimConfig,
    pub shape: Shape,
    /// The mix as pods asked, after raising to the minimum per process.
    pub mix: SizeMix,
    pub arrivals_per_minute: f64,
    pub pods: usize,
    pub window: Window,
    pub results: Vec<StrategyResult>,
}

/// The cluster laid out by the device plugin's code, and the numbers the strategies share.
pub fn lay_out(cluster: &ClusterSpec) -> Result<(UnitLayout, Shape), SimError> {
    let layout = cluster.layout()?;
    let shape = Shape::new(cluster, &layout)?;
    Ok((layout, shape))
}

/// The three strategies, fresh, in report order.
pub fn strategies(
    config: &StrategyConfig,
    layout: &UnitLayout,
    shape: Shape,
) -> Result<Vec<Box<dyn Strategy>>, SimError> {
    let scheduler = || {
        KubeScheduler::new(
            config.scoring,
            config.percentage_of_nodes_to_score,
            SplitMix64::derived(config.seed, 1),
        )
    };
    Ok(vec![
        Box::new(TimeSlicing::new(shape, config.replicas_per_gpu, scheduler())?),
        Box::new(MemoryUnits::new(
            shape,
            layout.clone(),
            scheduler(),
            config.cross_check_preferred,
        )),
        Box::new(IdealPacking::new(shape)),
    ])
}

/// Runs every strategy on the same pods.
pub fn run_strategies(
    config: &StrategyConfig,
    layout: &UnitLayout,
    shape: Shape,
    pods: &[Pod],
    window: Window,
    record: bool,
) -> Result<Vec<StrategyResult>, SimError> {
    strategies(config, layout, shape)?
        .iter_mut()
        .map(|s| {
            simulation::run(
                s.as_mut(),
                pods,
                window,
                shape.capacity_gib(),
                config.failed_release_ms,
                record,
            )
        })
        .collect()
}

fn hours_to_ms(hours: f64, flag: &str) -> Result<u64, SimError> {
    if !(0.0..=24.0 * 365.0).contains(&hours) {
        return Err(SimError::Invalid(format!(
            "{hours} hours: must be between 0 and a year ({flag})"
        )));
    }
    Ok((hours * MS_PER_HOUR as f64).round() as u64)
}

pub fn simulate(config: &SimConfig) -> Result<Simulation, SimError> {
    let (layout, shape) = lay_out(&config.cluster)?;
    let mix = config.mix.raised_to(shape.min_units_per_process);
    if let Some(&(largest, _)) = mix.sizes.iter().find(|&&(gib, _)| gib > shape.gib_per_gpu) {
        return Err(SimError::Invalid(format!(
            "pods of {largest} GiB fit no GPU of {} GiB: every size must fit one GPU",
            shape.gib_per_gpu
        )));
    }
    let arrivals_per_minute = match config.rate {
        ArrivalRate::PerMinute(rate) => rate,
        ArrivalRate::Load(load) => {
            WorkloadSpec::rate_for_load(load, shape.capacity_gib(), &mix, config.mean_lifetime_minutes)
        }
    };
    let window = Window {
        warmup_ms: hours_to_ms(config.warmup_hours, "--warmup-hours")?,
        end_ms: hours_to_ms(config.hours, "--hours")?,
    };
    let pods = WorkloadSpec {
        seed: config.seed,
        mix: mix.clone(),
        arrivals_per_minute,
        mean_lifetime_minutes: config.mean_lifetime_minutes,
        duration_ms: window.end_ms,
    }
    .generate()?;
    let results = run_strategies(&config.strategies, &layout, shape, &pods, window, config.record)?;
    Ok(Simulation {
        config: config.clone(),
        shape,
        mix,
        arrivals_per_minute,
        pods: pods.len(),
        window,
        results,
    })
}
