//! kube-scheduler's part that matters here: the NodeResourcesFit plugin on one extended resource.
//! Filter nodes with enough of it left, starting where the last pod's search stopped and stopping
//! once enough feasible nodes are found (percentageOfNodesToScore), score them, take the best;
//! ties are broken at random as selectHost does (here from a seeded stream, so runs repeat).

use crate::prng::SplitMix64;

/// NodeResourcesFit's scoring strategy, configured for the GPU resource (weight 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scoring {
    /// Kubernetes' default: prefer the node with the most left, spreading pods.
    LeastAllocated,
    /// Bin packing: prefer the node with the least left.
    MostAllocated,
}

impl Scoring {
    pub fn name(self) -> &'static str {
        match self {
            Scoring::LeastAllocated => "least-allocated",
            Scoring::MostAllocated => "most-allocated",
        }
    }
}

/// kube-scheduler's maximum node score.
const MAX_NODE_SCORE: u64 = 100;
/// kube-scheduler scores at least this many feasible nodes, and at least this percentage.
const MIN_FEASIBLE_NODES_TO_FIND: u32 = 100;
const MIN_FEASIBLE_NODES_PERCENTAGE: u32 = 5;

/// How many feasible nodes kube-scheduler looks for before it stops filtering
/// (numFeasibleNodesToFind). `percentage` 0 is its adaptive default: 50 % less 1 % per 125
/// nodes, at least 5 %.
pub fn feasible_nodes_to_find(nodes: u32, percentage: u32) -> u32 {
    if nodes < MIN_FEASIBLE_NODES_TO_FIND || percentage >= 100 {
        return nodes;
    }
    let percentage = if percentage == 0 {
        50u32
            .saturating_sub(nodes / 125)
            .max(MIN_FEASIBLE_NODES_PERCENTAGE)
    } else {
        percentage
    };
    let found = (u64::from(nodes) * u64::from(percentage) / 100) as u32;
    found.max(MIN_FEASIBLE_NODES_TO_FIND)
}

#[derive(Debug, Clone)]
pub struct KubeScheduler {
    scoring: Scoring,
    ties: SplitMix64,
    /// 0 for kube-scheduler's adaptive default, 100 to score every feasible node.
    percentage_of_nodes_to_score: u32,
    next_start: usize,
    /// Score by amount left after the pod, for the capacity last asked about.
    scores: Vec<u8>,
    scores_for: Option<u32>,
}

impl KubeScheduler {
    pub fn new(scoring: Scoring, percentage_of_nodes_to_score: u32, ties: SplitMix64) -> Self {
        KubeScheduler {
            scoring,
            ties,
            percentage_of_nodes_to_score,
            next_start: 0,
            scores: Vec::new(),
            scores_for: None,
        }
    }

    /// NodeResourcesFit's score of a node left with `rest` of `capacity` once the pod is on it
    /// (the score counts the pod's own request), as a table: integer division per node per pod
    /// is most of the simulator's time otherwise.
    fn prepare_scores(&mut self, capacity: u32) {
        if self.scores_for != Some(capacity) {
            let cap = u64::from(capacity.max(1));
            self.scores = (0..=cap)
                .map(|rest| match self.scoring {
                    Scoring::LeastAllocated => (rest * MAX_NODE_SCORE / cap) as u8,
                    Scoring::MostAllocated => ((cap - rest) * MAX_NODE_SCORE / cap) as u8,
                })
                .collect();
            self.scores_for = Some(capacity);
        }
    }

    /// The node a pod requesting `request` goes to, given each node's `free` amount out of
    /// `capacity`; `None` when no node has `request` left (the pod is unschedulable).
    pub fn pick(&mut self, free: &[u32], capacity: u32, request: u32) -> Option<u32> {
        let nodes = free.len();
        if nodes == 0 {
            return None;
        }
        let to_find = feasible_nodes_to_find(nodes as u32, self.percentage_of_nodes_to_score) as usize;
        let start = self.next_start % nodes;
        self.prepare_scores(capacity);
        let scores = &self.scores;
        let ties = &mut self.ties;
        let mut best: Option<(u8, u32)> = None;
        let mut tied = 0u64;
        let mut found = 0usize;
        let mut processed = 0usize;
        // In node order from `start`, wrapping round (no modulo per node: it dominated the time).
        let order = (start..nodes).chain(0..start);
        for node in order {
            processed += 1;
            let left = free[node];
            if left < request {
                continue;
            }
            found += 1;
            let rest = (left - request).min(capacity) as usize;
            let score = scores[rest];
            match best {
                Some((top, _)) if score < top => {}
                Some((top, _)) if score == top => {
                    // Reservoir sampling: each tied node ends up chosen with equal chance.
                    tied += 1;
                    if ties.below(tied) == 0 {
                        best = Some((score, node as u32));
                    }
                }
                _ => {
                    best = Some((score, node as u32));
                    tied = 1;
                }
            }
            if found >= to_find {
                break;
            }
        }
        self.next_start = (start + processed) % nodes;
        best.map(|(_, node)| node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scheduler(scoring: Scoring) -> KubeScheduler {
        KubeScheduler::new(scoring, 100, SplitMix64::new(5))
    }

    #[test]
    fn filters_nodes_without_room() {
        let mut s = scheduler(Scoring::LeastAllocated);
        assert_eq!(s.pick(&[2, 9, 3], 10, 4), Some(1));
        assert_eq!(s.pick(&[2, 3, 3], 10, 4), None);
    }

    #[test]
    fn least_allocated_spreads_most_allocated_packs() {
        let free = [10, 4, 7];
        assert_eq!(scheduler(Scoring::LeastAllocated).pick(&free, 10, 3), Some(0));
        assert_eq!(scheduler(Scoring::MostAllocated).pick(&free, 10, 3), Some(1));
    }

    #[test]
    fn ties_are_shared_among_tied_nodes() {
        let mut s = scheduler(Scoring::LeastAllocated);
        let mut hits = [0u32; 4];
        for _ in 0..4_000 {
            // Nodes 0, 2 and 3 tie at the top score.
            let node = s.pick(&[100, 10, 100, 100], 100, 5).unwrap();
            hits[node as usize] += 1;
        }
        assert_eq!(hits[1], 0);
        assert!(hits[0] > 1_150 && hits[2] > 1_150 && hits[3] > 1_150, "{hits:?}");
    }

    #[test]
    fn nodes_to_find_follow_kube_scheduler() {
        assert_eq!(feasible_nodes_to_find(50, 0), 50);
        assert_eq!(feasible_nodes_to_find(100, 0), 100);
        // 1000 nodes: 50 - 8 = 42 %.
        assert_eq!(feasible_nodes_to_find(1000, 0), 420);
        // 5000 nodes: 50 - 40 = 10 %.
        assert_eq!(feasible_nodes_to_find(5000, 0), 500);
        // Never below 5 %, never below 100 nodes.
        assert_eq!(feasible_nodes_to_find(10_000, 0), 500);
        assert_eq!(feasible_nodes_to_find(150, 10), 100);
        assert_eq!(feasible_nodes_to_find(1000, 100), 1000);
    }

    #[test]
    fn the_search_stops_early_and_resumes_where_it_stopped() {
        // 200 nodes, 50 % to score = 100 feasible nodes looked at per pod.
        let mut free = vec![5u32; 200];
        // The emptiest node is at 150: the first search (nodes 0..100) cannot see it.
        free[150] = 10;
        let mut s = KubeScheduler::new(Scoring::LeastAllocated, 50, SplitMix64::new(1));
        assert_ne!(s.pick(&free, 10, 1), Some(150));
        // The second search covers nodes 100..200 and finds it.
        assert_eq!(s.pick(&free, 10, 1), Some(150));
    }
}
