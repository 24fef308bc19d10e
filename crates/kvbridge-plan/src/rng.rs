//! The workspace's one small deterministic pseudo-random toolkit (not
//! cryptographic): a 64-bit mixer for hashing indices into patterns and
//! workloads, SplitMix64's output function, and a seeded xorshift64* stream.
//!
//! The synthetic planner scenarios, the demo's KV patterns and workload,
//! and the benches' byte patterns all draw from here, so a producer and the
//! checker at the other end always compute the same values.

/// SplitMix64's increment, `2^64 / φ` rounded to odd.
pub const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's finalizer: a bijective 64-bit mixer (every input bit
/// affects every output bit).
pub const fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// SplitMix64's output for state `x`: [`mix`] of `x + GOLDEN`.
pub const fn splitmix(x: u64) -> u64 {
    mix(x.wrapping_add(GOLDEN))
}

/// A seeded xorshift64* stream: tiny, fast, the same on every platform.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A stream from `seed` (a zero seed is replaced by [`GOLDEN`]: xorshift
    /// never leaves the all-zero state).
    pub const fn new(seed: u64) -> Self {
        Self(if seed == 0 { GOLDEN } else { seed })
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `lo..=hi` (up to modulo bias; `lo` when `hi < lo`).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        let next = self.next_u64();
        match hi.checked_sub(lo).and_then(|d| d.checked_add(1)) {
            Some(span) => lo + next % span,
            None if hi < lo => lo,
            None => next, // the whole u64 range
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        // SplitMix64 seeded with 0: its first output is splitmix(0).
        assert_eq!(splitmix(0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(mix(0), 0);
        let mut r = Rng::new(1);
        assert_eq!(r.next_u64(), 0x47E4_CE4B_896C_DD1D);
        for _ in 0..1000 {
            let v = r.range(3, 9);
            assert!((3..=9).contains(&v));
        }
        assert_eq!(r.range(5, 4), 5);
        let _ = r.range(0, u64::MAX);
    }
}
