//! gpu-mps-schedsim: prints the markdown report of one deterministic simulation run.

use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, ValueEnum};
use gpu_mps_schedsim::{
    ArrivalRate, ClusterSpec, Scoring, SimConfig, SizeMix, StrategyConfig, report, simulate,
};

const EXAMPLE: &str = "\
Examples:
  # The run in docs/scheduling.md (these are the defaults), then the same with bin-packing scores
  cargo run --release -p gpu-mps-schedsim -- --nodes 1000 --gpus-per-node 8 --seed 1 --hours 24
  cargo run --release -p gpu-mps-schedsim -- --score most-allocated
  # A small cluster, checking every B pod against the device plugin's own GetPreferredAllocation
  cargo run --release -p gpu-mps-schedsim -- --nodes 20 --hours 6 --cross-check-preferred

Every GPU is an H200 (143771 MiB, 139 units of 1 GiB after a 1 GiB MPS server reserve, 48 MPS
clients). The report is markdown on stdout; the same flags print the same bytes.";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ScoringArg {
    /// Kubernetes' default: the node with the most left (spreads pods).
    LeastAllocated,
    /// Bin packing: the node with the least left.
    MostAllocated,
}

/// Simulates pods sharing the H200s of a cluster three ways, on the same arrivals: A. time-slicing
/// replicas with gpu-mps refusing at start, B. gpu-mps.io/memory units with best-fit preferred
/// allocation, C. ideal per-GPU best fit. Reports pods placed, refused after scheduling and
/// unschedulable, and GPU memory utilisation.
#[derive(Debug, Clone, PartialEq, Parser)]
#[command(name = "gpu-mps-schedsim", version, after_help = EXAMPLE)]
struct Args {
    /// Nodes in the cluster.
    #[arg(long, default_value_t = 1000)]
    nodes: u32,
    /// GPUs per node.
    #[arg(long, default_value_t = 8)]
    gpus_per_node: u32,
    /// Seeds the pods (arrivals, sizes, lifetimes) and the schedulers' tie-breaks.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Pods arrive for this long.
    #[arg(long, default_value_t = 24.0)]
    hours: f64,
    /// Pods arriving before this are not counted, nor is utilisation before it.
    #[arg(long, default_value_t = 4.0)]
    warmup_hours: f64,
    /// Offered memory as a share of the cluster's (arrival rate x mean lifetime x mean ask /
    /// capacity); sets the arrival rate unless --arrivals-per-minute does.
    #[arg(long, default_value_t = 1.0, conflicts_with = "arrivals_per_minute")]
    load: f64,
    /// Pods per minute (Poisson arrivals), instead of --load.
    #[arg(long)]
    arrivals_per_minute: Option<f64>,
    /// Mean pod lifetime (exponential).
    #[arg(long, default_value_t = 60.0)]
    mean_lifetime_minutes: f64,
    /// nvidia.com/gpu replicas each GPU advertises under time-slicing (strategy A).
    #[arg(long, default_value_t = 8)]
    replicas: u32,
    /// kube-scheduler's NodeResourcesFit scoring on the GPU resource (A and B).
    #[arg(long, value_enum, default_value_t = ScoringArg::LeastAllocated)]
    score: ScoringArg,
    /// kube-scheduler's percentageOfNodesToScore: 0 is its adaptive default (42 % of 1,000 nodes,
    /// at least 100 nodes), 100 scores every node.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=100))]
    percentage_of_nodes_to_score: u32,
    /// Seconds a pod refused after scheduling keeps its replica (A) or its units in the
    /// scheduler's count (B), until kubelet reports it Failed and the scheduler drops it.
    #[arg(long, default_value_t = 2.0)]
    failed_release_seconds: f64,
    /// Also run the device plugin's own GetPreferredAllocation on every B pod and stop if it
    /// disagrees with the simulator's fast best fit (slow: for checking, small clusters).
    #[arg(long)]
    cross_check_preferred: bool,
}

impl Args {
    fn config(&self) -> Result<SimConfig, String> {
        if !(0.0..=86_400.0).contains(&self.failed_release_seconds) {
            return Err(format!(
                "--failed-release-seconds {}: must be between 0 and 86400",
                self.failed_release_seconds
            ));
        }
        Ok(SimConfig {
            cluster: ClusterSpec::h200(self.nodes, self.gpus_per_node),
            strategies: StrategyConfig {
                replicas_per_gpu: self.replicas,
                scoring: match self.score {
                    ScoringArg::LeastAllocated => Scoring::LeastAllocated,
                    ScoringArg::MostAllocated => Scoring::MostAllocated,
                },
                percentage_of_nodes_to_score: self.percentage_of_nodes_to_score,
                seed: self.seed,
                cross_check_preferred: self.cross_check_preferred,
                failed_release_ms: (self.failed_release_seconds * 1000.0).round() as u64,
            },
            seed: self.seed,
            rate: match self.arrivals_per_minute {
                Some(rate) => ArrivalRate::PerMinute(rate),
                None => ArrivalRate::Load(self.load),
            },
            mean_lifetime_minutes: self.mean_lifetime_minutes,
            hours: self.hours,
            warmup_hours: self.warmup_hours,
            mix: SizeMix::inference_heavy(),
            record: false,
        })
    }

    /// The command that reproduces this run, every setting spelled out.
    fn command_line(&self) -> String {
        let rate = match self.arrivals_per_minute {
            Some(rate) => format!("--arrivals-per-minute {rate}"),
            None => format!("--load {}", self.load),
        };
        let score = match self.score {
            ScoringArg::LeastAllocated => "least-allocated",
            ScoringArg::MostAllocated => "most-allocated",
        };
        let check = if self.cross_check_preferred {
            " --cross-check-preferred"
        } else {
            ""
        };
        format!(
            "cargo run --release -p gpu-mps-schedsim -- --nodes {} --gpus-per-node {} --seed {} --hours {} --warmup-hours {} {rate} --mean-lifetime-minutes {} --replicas {} --score {score} --percentage-of-nodes-to-score {} --failed-release-seconds {}{check}",
            self.nodes,
            self.gpus_per_node,
            self.seed,
            self.hours,
            self.warmup_hours,
            self.mean_lifetime_minutes,
            self.replicas,
            self.percentage_of_nodes_to_score,
            self.failed_release_seconds
        )
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let started = Instant::now();
    let config = match args.config() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("gpu-mps-schedsim: {e}");
            return ExitCode::FAILURE;
        }
    };
    match simulate(&config) {
        Ok(sim) => {
            print!("{}", report::markdown(&sim, &args.command_line()));
            eprintln!(
                "gpu-mps-schedsim: {} pods x 3 strategies in {:.1} s",
                sim.pods,
                started.elapsed().as_secs_f64()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gpu-mps-schedsim: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_printed_command_parses_back_to_the_same_settings() {
        for argv in [
            vec!["gpu-mps-schedsim"],
            vec![
                "gpu-mps-schedsim",
                "--nodes",
                "3",
                "--arrivals-per-minute",
                "12.5",
                "--score",
                "most-allocated",
            ],
            vec![
                "gpu-mps-schedsim",
                "--load",
                "0.8",
                "--hours",
                "2.5",
                "--cross-check-preferred",
            ],
            vec![
                "gpu-mps-schedsim",
                "--percentage-of-nodes-to-score",
                "100",
                "--replicas",
                "16",
            ],
            vec!["gpu-mps-schedsim", "--failed-release-seconds", "0.5"],
        ] {
            let args = Args::try_parse_from(&argv).unwrap();
            let line = args.command_line();
            let (_, flags) = line.split_once(" -- ").unwrap();
            let again =
                Args::try_parse_from(std::iter::once("gpu-mps-schedsim").chain(flags.split(' '))).unwrap();
            assert_eq!(again, args, "{line}");
        }
    }

    #[test]
    fn a_negative_release_time_is_refused() {
        let args = Args::try_parse_from(["x", "--failed-release-seconds=-1"]).unwrap();
        assert!(args.config().unwrap_err().contains("--failed-release-seconds -1"));
    }

    #[test]
    fn load_and_a_rate_cannot_both_be_given() {
        assert!(Args::try_parse_from(["x", "--load", "0.5", "--arrivals-per-minute", "3"]).is_err());
    }
}
