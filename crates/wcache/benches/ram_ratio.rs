//! Paired rounds for the in-process goal "RAM-resident 4 KiB random writes at ≥ 1 M ops/s
//! per core" and its baseline, a plain 4 KiB `memcpy` at random offsets into 1 GiB.
//!
//! Criterion measures the two one after the other, seconds apart, and on a shared machine
//! the load drifts between them. Here each round times a burst of memcpy writes and a burst
//! of cache writes back to back (which goes first alternates), and the per-round ratio is
//! reported with its median: drift hits both halves of a round alike.
//!
//! Run: `cargo bench -p vdstream-wcache --bench ram_ratio [-- ROUNDS]` (default 15 rounds of
//! 300 000 writes each side).

use std::time::Instant;

use vdstream_blockdev::BlockDev;
use vdstream_wcache::WriteCache;

const PER_ROUND: u64 = 300_000;

mod common;
use common::{resident_1gib, GIB, PAGE};

fn main() {
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(15);
    let pages = GIB / PAGE;
    let data = [0xA5u8; PAGE as usize];

    let mut plain = vec![1u8; GIB as usize];
    let dir = tempfile::tempdir().unwrap();
    let cache = resident_1gib(dir.path());

    let mut rng_plain = fastrand::Rng::with_seed(0x1234_5678);
    let mut rng_cache = fastrand::Rng::with_seed(0x1234_5678);
    let mut memcpy_burst = || {
        let t = Instant::now();
        for _ in 0..PER_ROUND {
            let p = (rng_plain.u64(..pages) * PAGE) as usize;
            plain[p..p + PAGE as usize].copy_from_slice(std::hint::black_box(&data));
        }
        PER_ROUND as f64 / t.elapsed().as_secs_f64()
    };
    let mut cache_burst = || {
        let t = Instant::now();
        for _ in 0..PER_ROUND {
            cache
                .write_at(
                    std::hint::black_box(&data),
                    rng_cache.u64(..pages) * PAGE,
                    false,
                )
                .unwrap();
        }
        PER_ROUND as f64 / t.elapsed().as_secs_f64()
    };
    memcpy_burst();
    cache_burst();

    let mut rows = Vec::new();
    println!("round  memcpy M/s  cache M/s  cache/memcpy");
    for r in 0..rounds {
        let (m, c) = if r % 2 == 0 {
            let m = memcpy_burst();
            (m, cache_burst())
        } else {
            let c = cache_burst();
            (memcpy_burst(), c)
        };
        println!(
            "{:>5}  {:>10.2}  {:>9.2}  {:>12.2}",
            r + 1,
            m / 1e6,
            c / 1e6,
            c / m
        );
        rows.push((m, c, c / m));
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    let s = cache.stats();
    assert_eq!(
        s.overflow_write_ops, 0,
        "the working set must stay in RAM: {s:?}"
    );
    println!(
        "median over {rounds} rounds: memcpy {:.2} M/s, cache {:.2} M/s, ratio {:.2}",
        median(rows.iter().map(|r| r.0).collect()) / 1e6,
        median(rows.iter().map(|r| r.1).collect()) / 1e6,
        median(rows.iter().map(|r| r.2).collect())
    );
}
