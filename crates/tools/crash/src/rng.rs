//! The harness's seeded randomness: `rand_xoshiro`'s xoshiro256++ seeded
//! with [`SeedableRng::seed_from_u64`], the few draws the workloads and
//! crash-point sampling make, and the key mixer used for hashing.
//!
//! Owns nothing else. A reported seed reproduces its run as long as the
//! `rand` crates keep their versions in Cargo.lock (the workspace pins them
//! in one place, and `vdcache-eval`'s `rng_is_fixed` test pins the stream).

use rand::RngExt;
use rand_xoshiro::Xoshiro256PlusPlus;

pub(crate) use rand::SeedableRng;

pub(crate) type Rng = Xoshiro256PlusPlus;

/// SplitMix64's finalizer: a hash of one word (not a generator).
pub(crate) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The draws of the harness, total over their arguments (never a panic on
/// an empty range).
pub(crate) trait Draw {
    /// Uniform in `0..n` (0 when `n` is 0).
    fn below(&mut self, n: u64) -> u64;
    /// Uniform in `lo..=hi` (`lo` when `hi < lo`).
    fn range(&mut self, lo: u64, hi: u64) -> u64;
    /// True with probability `percent` / 100 (always from 100 up).
    fn chance(&mut self, percent: u64) -> bool;
}

impl Draw for Rng {
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.random_range(0..n) }
    }

    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        self.random_range(lo..=hi.max(lo))
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.random_range(0..100) < percent
    }
}
