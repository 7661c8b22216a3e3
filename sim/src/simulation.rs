//! The event loop: pods arrive in order and are placed at once; a placed pod leaves after its
//! lifetime, and a pod refused after scheduling gives back what it held once Kubernetes sees it
//! Failed. A pod no node can take is dropped, not queued, so every strategy sees exactly the
//! same arrivals. Counts and utilisation cover the measured window after the warm-up.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use crate::error::SimError;
use crate::strategies::{Held, Outcome, Placement, RefusalReason, Strategy};
use crate::workload::{MS_PER_HOUR, Pod};

/// Pods arriving in [warmup, end) are counted; utilisation is averaged over the same span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub warmup_ms: u64,
    pub end_ms: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SizeCounts {
    pub arrived: u64,
    pub placed: u64,
}

/// What happened, in order, when a run is recorded (for the tests' independent checks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Arrived {
        at_ms: u64,
        pod: Pod,
        outcome: Outcome,
    },
    Left {
        at_ms: u64,
        pod: u32,
        placement: Placement,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct StrategyResult {
    pub name: &'static str,
    pub arrived: u64,
    pub placed: u64,
    pub refused: BTreeMap<RefusalReason, u64>,
    pub unschedulable: u64,
    /// The first refusal of each kind, as the pod's events would word it.
    pub first_refusal: BTreeMap<RefusalReason, String>,
    pub by_size: BTreeMap<u32, SizeCounts>,
    /// Allocated GiB / capacity GiB, averaged over time in the window.
    pub utilisation: f64,
    /// Every arrival and departure, only when recorded.
    pub events: Vec<Event>,
}

impl StrategyResult {
    pub fn refused_total(&self) -> u64 {
        self.refused.values().sum()
    }
}

/// When a placed pod leaves; ordered by time, then pod, so a run never depends on heap order.
/// Its placement waits in a slot of [`Running`]: heap entries stay small.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Departure {
    at_ms: u64,
    pod: u32,
    slot: u32,
}

/// What a pod holds until its departure.
enum Holding {
    Running(Placement),
    /// Refused after scheduling, until Kubernetes sees it Failed.
    Failed(Held),
}

/// What pods hold, in reusable slots.
#[derive(Default)]
struct Running {
    slots: Vec<Option<Holding>>,
    vacant: Vec<u32>,
}

impl Running {
    fn insert(&mut self, placement: Holding) -> u32 {
        match self.vacant.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some(placement);
                slot
            }
            None => {
                self.slots.push(Some(placement));
                (self.slots.len() - 1) as u32
            }
        }
    }

    fn remove(&mut self, slot: u32) -> Option<Holding> {
        let placement = self.slots.get_mut(slot as usize)?.take();
        if placement.is_some() {
            self.vacant.push(slot);
        }
        placement
    }
}

/// The time integral of allocated GiB inside the window.
struct Meter {
    window: Window,
    last_ms: u64,
    allocated_gib: u64,
    gib_ms: u128,
}

impl Meter {
    fn advance(&mut self, to_ms: u64) {
        let from = self.last_ms.max(self.window.warmup_ms);
        let to = to_ms.min(self.window.end_ms);
        if to > from {
            self.gib_ms += u128::from(self.allocated_gib) * u128::from(to - from);
        }
        self.last_ms = self.last_ms.max(to_ms);
    }
}

/// The running pods and the clock.
struct Cluster {
    meter: Meter,
    departures: BinaryHeap<Reverse<Departure>>,
    running: Running,
    failed_release_ms: u64,
    record: bool,
}

impl Cluster {
    fn start(&mut self, pod: &Pod, placement: Placement) {
        self.meter.allocated_gib += u64::from(placement.gib);
        let slot = self.running.insert(Holding::Running(placement));
        self.departures.push(Reverse(Departure {
            at_ms: pod.arrival_ms.saturating_add(pod.lifetime_ms),
            pod: pod.id,
            slot,
        }));
    }

    fn fail(&mut self, pod: &Pod, held: Held) {
        let slot = self.running.insert(Holding::Failed(held));
        self.departures.push(Reverse(Departure {
            at_ms: pod.arrival_ms.saturating_add(self.failed_release_ms),
            pod: pod.id,
            slot,
        }));
    }

    /// Ends every pod due by `until_ms` and moves the clock there. A departure at the same
    /// millisecond as an arrival frees its room first.
    fn advance(&mut self, until_ms: u64, strategy: &mut dyn Strategy, events: &mut Vec<Event>) {
        while let Some(&Reverse(d)) = self.departures.peek() {
            if d.at_ms > until_ms {
                break;
            }
            self.departures.pop();
            let placement = match self.running.remove(d.slot) {
                Some(Holding::Running(placement)) => placement,
                Some(Holding::Failed(held)) => {
                    strategy.release_failed(&held);
                    continue;
                }
                None => continue,
            };
            self.meter.advance(d.at_ms);
            strategy.release(&placement);
            self.meter.allocated_gib -= u64::from(placement.gib);
            if self.record {
                events.push(Event::Left {
                    at_ms: d.at_ms,
                    pod: d.pod,
                    placement,
                });
            }
        }
        self.meter.advance(until_ms);
    }
}

/// Runs `strategy` over `pods` (in arrival order). A pod refused after scheduling keeps what it
/// held for `failed_release_ms`: the time until the scheduler sees it Failed.
pub fn run(
    strategy: &mut dyn Strategy,
    pods: &[Pod],
    window: Window,
    capacity_gib: u64,
    failed_release_ms: u64,
    record: bool,
) -> Result<StrategyResult, SimError> {
    if window.warmup_ms >= window.end_ms {
        let hours = |ms: u64| ms as f64 / MS_PER_HOUR as f64;
        return Err(SimError::Invalid(format!(
            "a warm-up of {} h leaves nothing of a {} h run to measure: make --warmup-hours less than --hours",
            hours(window.warmup_ms),
            hours(window.end_ms)
        )));
    }
    let mut result = StrategyResult {
        name: strategy.name(),
        arrived: 0,
        placed: 0,
        refused: BTreeMap::new(),
        unschedulable: 0,
        first_refusal: BTreeMap::new(),
        by_size: BTreeMap::new(),
        utilisation: 0.0,
        events: Vec::new(),
    };
    let mut cluster = Cluster {
        meter: Meter {
            window,
            last_ms: 0,
            allocated_gib: 0,
            gib_ms: 0,
        },
        departures: BinaryHeap::new(),
        running: Running::default(),
        failed_release_ms,
        record,
    };
    for pod in pods.iter().take_while(|p| p.arrival_ms < window.end_ms) {
        cluster.advance(pod.arrival_ms, strategy, &mut result.events);
        let outcome = strategy.place(pod)?;
        let measured = pod.arrival_ms >= window.warmup_ms;
        if measured {
            result.arrived += 1;
            result.by_size.entry(pod.ask_gib).or_default().arrived += 1;
        }
        match &outcome {
            Outcome::Placed(_) if measured => {
                result.placed += 1;
                result.by_size.entry(pod.ask_gib).or_default().placed += 1;
            }
            Outcome::RefusedAfterScheduling(refusal) if measured => {
                *result.refused.entry(refusal.reason).or_default() += 1;
                result
                    .first_refusal
                    .entry(refusal.reason)
                    .or_insert_with(|| refusal.message.clone());
            }
            Outcome::Unschedulable if measured => result.unschedulable += 1,
            _ => {}
        }
        if record {
            result.events.push(Event::Arrived {
                at_ms: pod.arrival_ms,
                pod: *pod,
                outcome: outcome.clone(),
            });
        }
        match outcome {
            Outcome::Placed(placement) => cluster.start(pod, placement),
            Outcome::RefusedAfterScheduling(refusal) => cluster.fail(pod, refusal.held),
            Outcome::Unschedulable => {}
        }
    }
    cluster.advance(window.end_ms, strategy, &mut result.events);
    let span = u128::from(window.end_ms - window.warmup_ms);
    result.utilisation = cluster.meter.gib_ms as f64 / (u128::from(capacity_gib.max(1)) * span) as f64;
    Ok(result)
}
