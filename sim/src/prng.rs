//! SplitMix64 (Steele, Lea and Flood; the generator Vigna recommends for seeding): written here so
//! that a seed gives the same pods on every machine and every future build, whatever a random
//! crate decides to change.

/// A SplitMix64 stream.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// A stream for another purpose (a scheduler's tie-breaks) that must not shift the pods a
    /// seed gives.
    pub fn derived(seed: u64, purpose: u64) -> Self {
        let mut mixer = SplitMix64::new(seed ^ purpose.wrapping_mul(0xD6E8_FEB8_6659_FD93));
        SplitMix64::new(mixer.next_u64())
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1), from the top 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in [0, n); 0 when n is 0. The multiply-shift's bias is below 2^-32 for any n we use.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Exponentially distributed with the given mean (inverse transform).
    pub fn exponential(&mut self, mean: f64) -> f64 {
        // 1 - u is in (0, 1], so the logarithm is finite.
        -mean * (1.0 - self.next_f64()).ln()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_splitmix64() {
        // First outputs for seed 1234567 of Vigna's splitmix64.c.
        let mut rng = SplitMix64::new(1_234_567);
        let got: Vec<u64> = (0..3).map(|_| rng.next_u64()).collect();
        assert_eq!(
            got,
            [
                6_457_827_717_110_365_317,
                3_203_168_211_198_807_973,
                9_817_491_932_198_370_423
            ]
        );
    }

    #[test]
    fn below_stays_in_range_and_covers_it() {
        let mut rng = SplitMix64::new(7);
        let mut seen = [0u32; 5];
        for _ in 0..10_000 {
            let v = rng.below(5);
            assert!(v < 5);
            seen[v as usize] += 1;
        }
        assert!(seen.iter().all(|&n| n > 1_800), "{seen:?}");
        assert_eq!(rng.below(0), 0);
    }

    #[test]
    fn exponential_has_its_mean() {
        let mut rng = SplitMix64::new(11);
        let n = 200_000;
        let mean = (0..n).map(|_| rng.exponential(60.0)).sum::<f64>() / f64::from(n);
        assert!((mean - 60.0).abs() < 0.6, "{mean}");
    }

    #[test]
    fn derived_streams_differ_from_the_seed_stream() {
        let a = SplitMix64::new(1).next_u64();
        let b = SplitMix64::derived(1, 1).next_u64();
        let c = SplitMix64::derived(1, 2).next_u64();
        assert_ne!(a, b);
        assert_ne!(b, c);
    }
}
