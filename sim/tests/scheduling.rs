//! The simulator end to end: hand-checked cases for each strategy, invariants replayed from the
//! event log of saturated runs (independently of the strategies' own bookkeeping), and
//! determinism of the printed report.

// The helpers below are test code too: a panic with the value is the clearest failure.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};

use gpu_mps_api::memory_units::UnitError;
use gpu_mps_schedsim::simulation::Event;
use gpu_mps_schedsim::strategies::{Outcome, RefusalReason};
use gpu_mps_schedsim::{
    ArrivalRate, ClusterSpec, MS_PER_HOUR, Pod, Scoring, SimConfig, SizeMix, StrategyConfig, StrategyResult,
    Window, lay_out, report, run_strategies, simulate,
};

const LONG: u64 = 10 * MS_PER_HOUR;

fn strategy_config(replicas: u32) -> StrategyConfig {
    StrategyConfig {
        replicas_per_gpu: replicas,
        scoring: Scoring::LeastAllocated,
        percentage_of_nodes_to_score: 0,
        seed: 1,
        cross_check_preferred: true,
        failed_release_ms: 0,
    }
}

/// Pods arriving one millisecond apart, each living `lifetime_ms`.
fn pods(asks: &[u32], lifetime_ms: u64) -> Vec<Pod> {
    asks.iter()
        .enumerate()
        .map(|(i, &ask_gib)| Pod {
            id: i as u32,
            arrival_ms: i as u64,
            lifetime_ms,
            ask_gib,
        })
        .collect()
}

/// Runs A, B and C on `pods` over one node of `gpus` H200s.
fn run_by_hand(gpus: u32, replicas: u32, pods: &[Pod]) -> Vec<StrategyResult> {
    run_by_hand_holding(gpus, replicas, 0, pods)
}

/// The same, with pods refused after scheduling holding their share for `failed_release_ms`.
fn run_by_hand_holding(
    gpus: u32,
    replicas: u32,
    failed_release_ms: u64,
    pods: &[Pod],
) -> Vec<StrategyResult> {
    let (layout, shape) = lay_out(&ClusterSpec::h200(1, gpus)).unwrap();
    let window = Window {
        warmup_ms: 0,
        end_ms: LONG,
    };
    let config = StrategyConfig {
        failed_release_ms,
        ..strategy_config(replicas)
    };
    run_strategies(&config, &layout, shape, pods, window, true).unwrap()
}

/// Each pod's outcome, in arrival order.
fn outcomes(result: &StrategyResult) -> Vec<Outcome> {
    result
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Arrived { outcome, .. } => Some(outcome.clone()),
            Event::Left { .. } => None,
        })
        .collect()
}

/// (GPU, GiB) of a placed pod, or what became of it.
fn short(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Placed(p) => format!("gpu{} {}G", p.gpu, p.gib),
        Outcome::RefusedAfterScheduling(r) => format!("refused {:?}", r.reason),
        Outcome::Unschedulable => "unschedulable".into(),
    }
}

fn shorts(result: &StrategyResult) -> Vec<String> {
    outcomes(result).iter().map(short).collect()
}

#[test]
fn time_slicing_is_refused_at_start_where_units_and_the_oracle_place() {
    // 100 GiB, then 30, then 100 on one node of two H200s (139 GiB each).
    let results = run_by_hand(2, 8, &pods(&[100, 30, 100], LONG));
    // A: NVIDIA's distributed policy puts the 30 GiB pod on the idle GPU 1, and the second
    // 100 GiB pod on GPU 0 (both GPUs hold one replica; the lower index wins), which has 39 GiB.
    assert_eq!(
        shorts(&results[0]),
        ["gpu0 100G", "gpu1 30G", "refused ManagerMemory"]
    );
    let Outcome::RefusedAfterScheduling(refusal) = &outcomes(&results[0])[2] else {
        unreachable!()
    };
    assert_eq!(
        refusal.message,
        "GPU 0 of node 0 has 39 GiB of 139 GiB left; this container asks 100 GiB"
    );
    // B and C: best fit puts the 30 GiB pod beside the first, leaving GPU 1 whole.
    for r in &results[1..] {
        assert_eq!(shorts(r), ["gpu0 100G", "gpu0 30G", "gpu1 100G"], "{}", r.name);
        assert_eq!(r.refused_total(), 0);
    }
    assert_eq!(results[0].refused[&RefusalReason::ManagerMemory], 1);
    assert_eq!(results[0].placed, 2);
    assert_eq!(results[1].placed, 3);
}

#[test]
fn units_are_refused_by_allocate_when_the_node_has_room_but_no_gpu_has() {
    // Two 70 GiB pods leave 69 GiB on each GPU: 138 on the node, but a 100 GiB pod fits neither.
    let results = run_by_hand(2, 8, &pods(&[70, 70, 100], LONG));
    assert_eq!(
        shorts(&results[0]),
        ["gpu0 70G", "gpu1 70G", "refused ManagerMemory"]
    );
    // B: the scheduler sees 138 free units on the node and binds; GetPreferredAllocation has
    // no single GPU; kubelet's own pick spans both; Allocate refuses.
    assert_eq!(
        shorts(&results[1]),
        ["gpu0 70G", "gpu1 70G", "refused AllocateRefused"]
    );
    let Outcome::RefusedAfterScheduling(refusal) = &outcomes(&results[1])[2] else {
        unreachable!()
    };
    // Word for word what the plugin's Allocate says: 69 units of GPU 0 and 31 of GPU 1.
    let uuids: Vec<String> = ClusterSpec::h200(1, 2)
        .node_gpus()
        .into_iter()
        .map(|g| g.uuid)
        .collect();
    let expected = UnitError::SpansGpus {
        gpus: format!("{} (69 units) and {} (31 units)", uuids[0], uuids[1]),
        largest: 139,
    };
    assert_eq!(refusal.message, expected.to_string());
    // C sees that no GPU has 100 GiB: the pod is unschedulable, never refused.
    assert_eq!(shorts(&results[2]), ["gpu0 70G", "gpu1 70G", "unschedulable"]);
    assert_eq!(results[1].refused[&RefusalReason::AllocateRefused], 1);
    assert_eq!(results[2].unschedulable, 1);
}

#[test]
fn time_slicing_runs_out_of_replicas_before_memory() {
    // One replica per GPU: a third pod has no nvidia.com/gpu left though 133 GiB are free.
    let results = run_by_hand(2, 1, &pods(&[3, 3, 3], LONG));
    assert_eq!(shorts(&results[0]), ["gpu0 3G", "gpu1 3G", "unschedulable"]);
    assert_eq!(shorts(&results[1]), ["gpu0 3G", "gpu0 3G", "gpu0 3G"]);
    assert_eq!(shorts(&results[2]), ["gpu0 3G", "gpu0 3G", "gpu0 3G"]);
}

#[test]
fn a_refused_pod_holds_its_replica_until_it_is_seen_failed() {
    // Two replicas per GPU. 100 GiB on each GPU; the third 100 GiB pod gets a replica of GPU 0
    // and is refused. A 3 GiB pod 2 ms later: while the refused pod still holds its replica,
    // GPU 0 has two replicas in use and GPU 1 one, so it goes to GPU 1; once released, to GPU 0
    // (the tie goes to the lower index).
    let list = pods(&[100, 100, 100, 3], LONG);
    let held = run_by_hand_holding(2, 2, 1_000, &list);
    assert_eq!(
        shorts(&held[0]),
        ["gpu0 100G", "gpu1 100G", "refused ManagerMemory", "gpu1 3G"]
    );
    let released = run_by_hand_holding(2, 2, 0, &list);
    assert_eq!(
        shorts(&released[0]),
        ["gpu0 100G", "gpu1 100G", "refused ManagerMemory", "gpu0 3G"]
    );
}

#[test]
fn a_pod_refused_by_allocate_holds_its_request_in_the_schedulers_count() {
    // Fragmentation as above: 69 GiB left on each GPU, a 100 GiB pod bound and refused. While
    // the scheduler still counts its 100 units, the node shows 38 free and a 40 GiB pod is
    // unschedulable, although each GPU has 69; after the release it is placed.
    let mut list = pods(&[70, 70, 100, 40, 40], LONG);
    list[4].arrival_ms = 2_000;
    let b = &run_by_hand_holding(2, 8, 1_000, &list)[1];
    assert_eq!(
        shorts(b),
        [
            "gpu0 70G",
            "gpu1 70G",
            "refused AllocateRefused",
            "unschedulable",
            "gpu0 40G"
        ]
    );
}

#[test]
fn a_pod_leaving_frees_its_room_for_one_arriving_the_same_millisecond() {
    // One GPU: the first pod takes all 139 GiB until t = 5 ms; the next arrives at 5 ms.
    let mut list = pods(&[139, 139], LONG);
    list[0].lifetime_ms = 5;
    list[1].arrival_ms = 5;
    for r in run_by_hand(1, 8, &list) {
        assert_eq!(shorts(&r), ["gpu0 139G", "gpu0 139G"], "{}", r.name);
    }
}

#[test]
fn utilisation_is_allocated_memory_averaged_over_the_window() {
    // One GPU of 139 GiB: one full-GPU pod for 3 of the 4 measured hours, after a 1 h warm-up
    // during which another pod ran (not counted in utilisation, nor its arrival).
    let (layout, shape) = lay_out(&ClusterSpec::h200(1, 1)).unwrap();
    let list = vec![
        Pod {
            id: 0,
            arrival_ms: 0,
            lifetime_ms: MS_PER_HOUR,
            ask_gib: 139,
        },
        Pod {
            id: 1,
            arrival_ms: 2 * MS_PER_HOUR,
            lifetime_ms: 3 * MS_PER_HOUR,
            ask_gib: 139,
        },
    ];
    let window = Window {
        warmup_ms: MS_PER_HOUR,
        end_ms: 5 * MS_PER_HOUR,
    };
    for r in run_strategies(&strategy_config(8), &layout, shape, &list, window, false).unwrap() {
        assert_eq!(r.arrived, 1, "{}", r.name);
        assert_eq!(r.placed, 1, "{}", r.name);
        assert!(
            (r.utilisation - 0.75).abs() < 1e-12,
            "{}: {}",
            r.name,
            r.utilisation
        );
    }
}

/// A small cluster pushed past saturation, with every event recorded and B's fast best fit
/// checked against the device plugin's own GetPreferredAllocation on every pod.
fn saturated(scoring: Scoring, load: f64) -> gpu_mps_schedsim::Simulation {
    let config = SimConfig {
        cluster: ClusterSpec::h200(12, 8),
        strategies: StrategyConfig {
            scoring,
            failed_release_ms: 2_000,
            ..strategy_config(8)
        },
        seed: 7,
        rate: ArrivalRate::Load(load),
        mean_lifetime_minutes: 30.0,
        hours: 6.0,
        warmup_hours: 1.0,
        mix: SizeMix::inference_heavy(),
        record: true,
    };
    simulate(&config).unwrap()
}

/// Replays a run's events and checks, apart from the strategy's own books, that no GPU ever
/// held more memory or more CUDA processes than it has, and that every pod left the GPU it
/// was placed on.
fn replay_within_capacity(sim: &gpu_mps_schedsim::Simulation, result: &StrategyResult) {
    let shape = sim.shape;
    let mut gib: BTreeMap<(u32, u32), u32> = BTreeMap::new();
    let mut clients: BTreeMap<(u32, u32), u32> = BTreeMap::new();
    let mut placed_at: BTreeMap<u32, (u32, u32)> = BTreeMap::new();
    for event in &result.events {
        match event {
            Event::Arrived {
                pod,
                outcome: Outcome::Placed(p),
                ..
            } => {
                assert_eq!(
                    p.gib, pod.ask_gib,
                    "{}: pod {} got another size",
                    result.name, pod.id
                );
                assert!(p.node < shape.nodes && p.gpu < shape.gpus_per_node);
                let g = gib.entry((p.node, p.gpu)).or_default();
                *g += p.gib;
                assert!(
                    *g <= shape.gib_per_gpu,
                    "{}: GPU over its memory at pod {}",
                    result.name,
                    pod.id
                );
                let c = clients.entry((p.node, p.gpu)).or_default();
                *c += 1;
                assert!(
                    *c <= shape.max_clients_per_gpu,
                    "{}: too many clients",
                    result.name
                );
                placed_at.insert(pod.id, (p.node, p.gpu));
            }
            Event::Left { pod, placement, .. } => {
                assert_eq!(placed_at.remove(pod), Some((placement.node, placement.gpu)));
                *gib.get_mut(&(placement.node, placement.gpu)).unwrap() -= placement.gib;
                *clients.get_mut(&(placement.node, placement.gpu)).unwrap() -= 1;
            }
            Event::Arrived { .. } => {}
        }
    }
}

#[test]
fn every_strategy_keeps_every_gpu_within_its_memory_and_clients() {
    for scoring in [Scoring::LeastAllocated, Scoring::MostAllocated] {
        let sim = saturated(scoring, 1.1);
        for r in &sim.results {
            replay_within_capacity(&sim, r);
        }
        // The same arrivals for all three.
        assert!(sim.results.iter().all(|r| r.arrived == sim.results[0].arrived));
        assert!(sim.results[0].arrived > 5_000);
    }
}

#[test]
fn the_ideal_packer_never_refuses_after_scheduling() {
    for scoring in [Scoring::LeastAllocated, Scoring::MostAllocated] {
        let sim = saturated(scoring, 1.2);
        let ideal = &sim.results[2];
        assert_eq!(ideal.refused_total(), 0);
        assert!(
            outcomes(ideal)
                .iter()
                .all(|o| !matches!(o, Outcome::RefusedAfterScheduling(_)))
        );
        // Saturated for real: it had to turn pods away, and they were counted as unschedulable.
        assert!(ideal.unschedulable > 100, "{}", ideal.unschedulable);
        assert!(ideal.utilisation > 0.9, "{}", ideal.utilisation);
    }
}

#[test]
fn units_never_admit_a_pod_whose_units_span_gpus() {
    let sim = saturated(Scoring::LeastAllocated, 1.2);
    let units = &sim.results[1];
    let (layout, _) = lay_out(&sim.config.cluster).unwrap();
    // Fragmentation happened: some pods were bound and then refused by Allocate.
    assert!(
        units.refused[&RefusalReason::AllocateRefused] > 10,
        "{:?}",
        units.refused
    );
    let mut held: BTreeSet<(u32, String)> = BTreeSet::new();
    let mut admitted = 0;
    for event in &units.events {
        match event {
            Event::Arrived {
                pod,
                outcome: Outcome::Placed(p),
                ..
            } => {
                admitted += 1;
                assert_eq!(p.device_ids.len() as u32, pod.ask_gib);
                // Read back with the plugin's parser: one GPU, the one the pod is on.
                let gpus: BTreeSet<String> = p
                    .device_ids
                    .iter()
                    .map(|id| layout.parse(id).unwrap().gpu_uuid)
                    .collect();
                assert_eq!(gpus.len(), 1, "pod {} spans {gpus:?}", pod.id);
                assert_eq!(gpus.first().unwrap(), &layout.gpus[p.gpu as usize].uuid);
                for id in &p.device_ids {
                    assert!(
                        held.insert((p.node, id.clone())),
                        "{id} on node {} handed out twice",
                        p.node
                    );
                }
            }
            Event::Left { placement, .. } => {
                for id in &placement.device_ids {
                    assert!(held.remove(&(placement.node, id.clone())));
                }
            }
            Event::Arrived { .. } => {}
        }
    }
    assert!(admitted > 5_000, "{admitted}");
}

#[test]
fn units_with_bin_packing_scores_keep_binding_pods_to_fragmented_nodes() {
    // MostAllocated sends each pod to the fullest node whose total still fits it; when that
    // total is fragmented, Allocate refuses, the units come back, and the node is chosen again.
    let packed = saturated(Scoring::MostAllocated, 1.0);
    let spread = saturated(Scoring::LeastAllocated, 1.0);
    let refused = |s: &gpu_mps_schedsim::Simulation| s.results[1].refused_total();
    assert!(
        refused(&packed) > 5 * refused(&spread),
        "{} vs {}",
        refused(&packed),
        refused(&spread)
    );
    assert!(packed.results[1].refused_total() > packed.results[1].placed);
}

fn small_config(seed: u64) -> SimConfig {
    SimConfig {
        cluster: ClusterSpec::h200(20, 8),
        strategies: StrategyConfig {
            cross_check_preferred: false,
            ..strategy_config(8)
        },
        seed,
        rate: ArrivalRate::Load(1.0),
        mean_lifetime_minutes: 60.0,
        hours: 8.0,
        warmup_hours: 2.0,
        mix: SizeMix::inference_heavy(),
        record: false,
    }
}

#[test]
fn the_same_seed_gives_a_byte_identical_report() {
    let first = report::markdown(&simulate(&small_config(3)).unwrap(), "cmd");
    let second = report::markdown(&simulate(&small_config(3)).unwrap(), "cmd");
    assert_eq!(first, second);
    let other = report::markdown(&simulate(&small_config(4)).unwrap(), "cmd");
    assert_ne!(first, other);
    // The report carries the table the docs quote.
    assert!(first.contains("| Strategy | Pods arrived | Placed | Refused after scheduling |"));
    assert_eq!(first.matches("\n| A. ").count(), 1);
}

#[test]
fn bad_settings_are_one_line_errors_naming_the_flag() {
    let mut c = small_config(1);
    c.warmup_hours = 8.0;
    let e = simulate(&c).unwrap_err().to_string();
    assert!(e.contains("--warmup-hours"), "{e}");
    let mut c = small_config(1);
    c.strategies.replicas_per_gpu = 0;
    let e = simulate(&c).unwrap_err().to_string();
    assert!(e.contains("--replicas"), "{e}");
    let mut c = small_config(1);
    c.rate = ArrivalRate::PerMinute(-1.0);
    let e = simulate(&c).unwrap_err().to_string();
    assert!(e.contains("--arrivals-per-minute"), "{e}");
    let mut c = small_config(1);
    c.mix = SizeMix {
        sizes: vec![(200, 1)],
    };
    let e = simulate(&c).unwrap_err().to_string();
    assert!(e.contains("200 GiB fit no GPU of 139 GiB"), "{e}");
    assert!(!e.contains('\n'));
}
