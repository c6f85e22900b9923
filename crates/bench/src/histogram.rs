//! Latency histogram: log-linear buckets over nanoseconds (64 linear sub-buckets per power
//! of two), so any percentile is known to within 1/64 (1.6%) of its value while the whole
//! histogram stays a fixed array of counters.
//!
//! Invariants: `count`, `sum` and `max` are exact; a percentile is the upper edge of the
//! bucket that holds it, clamped to the exact maximum; merging two histograms equals
//! recording both sets of samples into one.

use serde::Serialize;

const SUB_BITS: u32 = 6;
const SUB: u64 = 1 << SUB_BITS;
/// Values below SUB get one bucket each; then SUB buckets per power of two up to 2^64.
const BUCKETS: usize = (SUB as usize) * (64 - SUB_BITS as usize + 1);

/// Latencies in nanoseconds.
#[derive(Debug, Clone)]
pub struct Histogram {
    counts: Vec<u64>,
    count: u64,
    sum: u128,
    max: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: vec![0; BUCKETS],
            count: 0,
            sum: 0,
            max: 0,
        }
    }
}

fn bucket(v: u64) -> usize {
    if v < SUB {
        return v as usize;
    }
    let exp = 63 - v.leading_zeros(); // >= SUB_BITS
    let shift = exp - SUB_BITS;
    let sub = (v >> shift) - SUB; // 0..SUB
    (SUB as usize) * (shift as usize + 1) + sub as usize
}

/// The largest value that falls in bucket `b`.
fn upper(b: usize) -> u64 {
    let b = b as u64;
    if b < SUB {
        return b;
    }
    let shift = b / SUB - 1;
    let sub = b % SUB;
    let low = (SUB + sub) << shift;
    low + ((1u64 << shift) - 1)
}

/// Mean, percentiles and maximum, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LatencySummary {
    pub mean_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
}

impl Histogram {
    pub fn record(&mut self, nanos: u64) {
        self.counts[bucket(nanos)] += 1;
        self.count += 1;
        self.sum += u128::from(nanos);
        self.max = self.max.max(nanos);
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.count += other.count;
        self.sum += other.sum;
        self.max = self.max.max(other.max);
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    /// Mean in nanoseconds (0 when empty).
    pub fn mean(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum as f64 / self.count as f64
        }
    }

    /// The value at or below which `q` (0..=1) of the samples lie, in nanoseconds.
    pub fn quantile(&self, q: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (b, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return upper(b).min(self.max);
            }
        }
        self.max
    }

    pub fn summary(&self) -> LatencySummary {
        let us = |ns: f64| (ns / 10.0).round() / 100.0;
        LatencySummary {
            mean_us: us(self.mean()),
            p50_us: us(self.quantile(0.50) as f64),
            p99_us: us(self.quantile(0.99) as f64),
            max_us: us(self.max as f64),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn buckets_are_ordered_and_contain_their_values() {
        for b in 1..BUCKETS {
            assert!(upper(b) > upper(b - 1), "bucket {b}");
        }
        for v in [
            0,
            1,
            63,
            64,
            65,
            127,
            128,
            1000,
            123_456,
            u64::MAX / 3,
            u64::MAX,
        ] {
            let b = bucket(v);
            assert!(v <= upper(b), "{v} in bucket {b} with upper {}", upper(b));
            assert!(
                b == 0 || v > upper(b - 1),
                "{v} belongs to an earlier bucket"
            );
        }
    }

    #[test]
    fn percentiles_of_a_known_set() {
        let mut h = Histogram::default();
        for us in 1..=100u64 {
            h.record(us * 1000);
        }
        let s = h.summary();
        assert_eq!(s.max_us, 100.0);
        assert!((s.mean_us - 50.5).abs() < 0.01, "{s:?}");
        assert!((50.0..=51.0).contains(&s.p50_us), "{s:?}");
        assert!((99.0..=100.0).contains(&s.p99_us), "{s:?}");
        assert_eq!(Histogram::default().summary(), LatencySummary::default());
    }

    proptest! {
        #[test]
        fn quantiles_are_within_one_sixty_fourth(mut v in prop::collection::vec(1u64..10_000_000_000, 1..300), q in 0.0f64..=1.0) {
            let mut h = Histogram::default();
            for &x in &v { h.record(x); }
            v.sort_unstable();
            let rank = ((q * v.len() as f64).ceil() as usize).max(1);
            let exact = v[rank - 1];
            let got = h.quantile(q);
            prop_assert!(got >= exact && got as f64 <= exact as f64 * (1.0 + 1.0 / 64.0) + 1.0, "q {} exact {} got {}", q, exact, got);
        }

        #[test]
        fn merge_equals_one_histogram(a in prop::collection::vec(0u64..1 << 40, 0..100), b in prop::collection::vec(0u64..1 << 40, 0..100)) {
            let (mut ha, mut hb, mut hab) = (Histogram::default(), Histogram::default(), Histogram::default());
            for &x in &a { ha.record(x); hab.record(x); }
            for &x in &b { hb.record(x); hab.record(x); }
            ha.merge(&hb);
            prop_assert_eq!(ha.counts, hab.counts);
            prop_assert_eq!((ha.count, ha.sum, ha.max), (hab.count, hab.sum, hab.max));
        }
    }
}
