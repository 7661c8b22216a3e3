//! The pods: when each arrives, how much GPU memory it asks for, how long it runs. Generated once
//! from a seed, so every strategy sees the same sequence.

use crate::error::SimError;
use crate::prng::SplitMix64;

pub const MS_PER_MINUTE: u64 = 60_000;
pub const MS_PER_HOUR: u64 = 60 * MS_PER_MINUTE;

/// One pod: one container with one CUDA process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pod {
    /// Its place in the arrival order, from 0.
    pub id: u32,
    pub arrival_ms: u64,
    pub lifetime_ms: u64,
    /// GiB of GPU memory, which is also its `gpu-mps.io/memory` units (1 GiB each).
    pub ask_gib: u32,
}

/// Memory asks and how often each comes, e.g. 30 of every 100 pods ask for 2 GiB.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SizeMix {
    /// (GiB asked, weight), ascending by size.
    pub sizes: Vec<(u32, u32)>,
}

impl SizeMix {
    /// Mostly small inference pods, a tail of large ones up to half an H200.
    pub fn inference_heavy() -> Self {
        SizeMix {
            sizes: vec![
                (2, 30),
                (4, 20),
                (8, 15),
                (12, 10),
                (16, 10),
                (24, 7),
                (40, 5),
                (70, 3),
            ],
        }
    }

    /// The sizes pods really ask for: none below `min_gib`, the fewest units one CUDA process may
    /// hold (a 2 GiB pod asks for 3 on an H200). Sizes that meet are merged.
    pub fn raised_to(&self, min_gib: u32) -> SizeMix {
        let mut sizes: Vec<(u32, u32)> = Vec::new();
        for &(gib, weight) in &self.sizes {
            let gib = gib.max(min_gib);
            match sizes.last_mut() {
                Some((last, w)) if *last == gib => *w += weight,
                _ => sizes.push((gib, weight)),
            }
        }
        SizeMix { sizes }
    }

    pub fn total_weight(&self) -> u64 {
        self.sizes.iter().map(|&(_, w)| u64::from(w)).sum()
    }

    /// GiB asked per pod on average.
    pub fn mean_gib(&self) -> f64 {
        let weighted: u64 = self.sizes.iter().map(|&(g, w)| u64::from(g) * u64::from(w)).sum();
        weighted as f64 / self.total_weight().max(1) as f64
    }

    fn draw(&self, rng: &mut SplitMix64) -> u32 {
        let mut pick = rng.below(self.total_weight());
        for &(gib, weight) in &self.sizes {
            if pick < u64::from(weight) {
                return gib;
            }
            pick -= u64::from(weight);
        }
        self.sizes.last().map(|&(g, _)| g).unwrap_or(0)
    }
}

/// How pods arrive and leave.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadSpec {
    pub seed: u64,
    pub mix: SizeMix,
    /// Poisson arrivals: exponential gaps with this mean rate.
    pub arrivals_per_minute: f64,
    /// Exponential lifetimes with this mean.
    pub mean_lifetime_minutes: f64,
    /// Pods arrive in [0, duration).
    pub duration_ms: u64,
}

impl WorkloadSpec {
    /// The arrival rate that offers `load` times `capacity_gib` of memory on average (Little's
    /// law: pods in the system = rate x mean lifetime).
    pub fn rate_for_load(load: f64, capacity_gib: u64, mix: &SizeMix, mean_lifetime_minutes: f64) -> f64 {
        load * capacity_gib as f64 / (mix.mean_gib() * mean_lifetime_minutes)
    }

    pub fn generate(&self) -> Result<Vec<Pod>, SimError> {
        if !(self.arrivals_per_minute.is_finite() && self.arrivals_per_minute > 0.0) {
            return Err(SimError::Invalid(format!(
                "arrival rate {} pods per minute: must be a positive number (--arrivals-per-minute, or --load)",
                self.arrivals_per_minute
            )));
        }
        if !(self.mean_lifetime_minutes.is_finite() && self.mean_lifetime_minutes > 0.0) {
            return Err(SimError::Invalid(format!(
                "mean lifetime {} minutes: must be a positive number (--mean-lifetime-minutes)",
                self.mean_lifetime_minutes
            )));
        }
        if self.mix.total_weight() == 0 {
            return Err(SimError::Invalid(
                "the size mix has no weight: give at least one size a weight".into(),
            ));
        }
        let mean_gap_ms = MS_PER_MINUTE as f64 / self.arrivals_per_minute;
        let mean_lifetime_ms = self.mean_lifetime_minutes * MS_PER_MINUTE as f64;
        let mut rng = SplitMix64::new(self.seed);
        let mut pods = Vec::new();
        let mut clock = 0.0f64;
        loop {
            clock += rng.exponential(mean_gap_ms);
            // Whole milliseconds, so event order never hangs on the last bit of a float.
            let arrival_ms = clock as u64;
            if arrival_ms >= self.duration_ms {
                break;
            }
            let ask_gib = self.mix.draw(&mut rng);
            let lifetime_ms = (rng.exponential(mean_lifetime_ms) as u64).max(1);
            let id = u32::try_from(pods.len()).map_err(|_| {
                SimError::Invalid(format!(
                    "more than {} pods: lower --arrivals-per-minute or --hours",
                    u32::MAX
                ))
            })?;
            pods.push(Pod {
                id,
                arrival_ms,
                lifetime_ms,
                ask_gib,
            });
        }
        Ok(pods)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(seed: u64) -> WorkloadSpec {
        WorkloadSpec {
            seed,
            mix: SizeMix::inference_heavy().raised_to(3),
            arrivals_per_minute: 100.0,
            mean_lifetime_minutes: 30.0,
            duration_ms: 10 * MS_PER_HOUR,
        }
    }

    #[test]
    fn the_minimum_raises_and_merges_small_sizes() {
        let mix = SizeMix {
            sizes: vec![(1, 5), (2, 30), (4, 20)],
        };
        assert_eq!(mix.raised_to(3).sizes, vec![(3, 35), (4, 20)]);
        assert_eq!(SizeMix::inference_heavy().raised_to(3).sizes[0], (3, 30));
        assert!((SizeMix::inference_heavy().raised_to(3).mean_gib() - 11.48).abs() < 1e-9);
    }

    #[test]
    fn same_seed_same_pods_other_seed_other_pods() {
        let a = spec(1).generate().unwrap();
        assert_eq!(a, spec(1).generate().unwrap());
        assert_ne!(a, spec(2).generate().unwrap());
    }

    #[test]
    fn pods_follow_rate_lifetime_and_mix() {
        let pods = spec(3).generate().unwrap();
        // 100 per minute for 600 minutes.
        assert!((59_000..61_000).contains(&pods.len()), "{}", pods.len());
        assert!(pods.windows(2).all(|w| w[0].arrival_ms <= w[1].arrival_ms));
        assert!(pods.iter().enumerate().all(|(i, p)| p.id as usize == i));
        let mean_life = pods.iter().map(|p| p.lifetime_ms as f64).sum::<f64>() / pods.len() as f64;
        assert!(
            (mean_life / MS_PER_MINUTE as f64 - 30.0).abs() < 0.5,
            "{mean_life}"
        );
        let small = pods.iter().filter(|p| p.ask_gib == 3).count() as f64 / pods.len() as f64;
        assert!((small - 0.30).abs() < 0.01, "{small}");
        assert!(pods.iter().all(|p| p.ask_gib >= 3 && p.ask_gib <= 70));
    }

    #[test]
    fn rate_for_load_fills_the_capacity_on_average() {
        let mix = SizeMix { sizes: vec![(10, 1)] };
        // 1000 GiB, 10 GiB pods living 50 minutes: 100 pods at once = 2 per minute.
        assert!((WorkloadSpec::rate_for_load(1.0, 1000, &mix, 50.0) - 2.0).abs() < 1e-12);
    }

    #[test]
    fn a_rate_that_is_not_positive_is_refused() {
        let mut s = spec(1);
        s.arrivals_per_minute = 0.0;
        let e = s.generate().unwrap_err();
        assert!(e.to_string().contains("--arrivals-per-minute"), "{e}");
    }
}
