//! Benchmarks of the RAM caches.
//!
//! - `ram_resident_4k_random_write`: 4 KiB writes at random page-aligned offsets into a
//!   1 GiB working set that is entirely in RAM (every write is an overwrite of a RAM page),
//!   against a plain `memcpy` of 4 KiB into a 1 GiB buffer: the ratio is the cost of the
//!   cache's bookkeeping (range check, page lock, shard lock, stats).
//! - `overflow_sustained_4k_random_write`: RAM 64 MiB, working sets of 48 MiB (fits) and
//!   96 MiB (1.5× RAM: the flusher evicts regions to the overflow file while writes go on).
//!
//! Run briefly: `cargo bench -p vdstream-wcache --bench cache -- --warm-up-time 1 --measurement-time 3`.

use std::time::Duration;

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use vdstream_blockdev::BlockDev;
use vdstream_wcache::WriteCache;

mod common;
use common::{fill, overflow_cache, resident_1gib, GIB, MIB, PAGE};

fn ram_resident(c: &mut Criterion) {
    let mut g = c.benchmark_group("ram_resident_4k_random_write");
    g.throughput(Throughput::Elements(1));
    let pages = GIB / PAGE;
    let data = [0xA5u8; PAGE as usize];

    let mut plain = vec![1u8; GIB as usize]; // touched: no page faults while measuring
    let mut rng = fastrand::Rng::with_seed(0x1234_5678);
    g.bench_function("memcpy_into_1gib", |b| {
        b.iter(|| {
            let p = rng.u64(..pages) * PAGE;
            plain[p as usize..(p + PAGE) as usize].copy_from_slice(black_box(&data));
        })
    });
    drop(plain);

    let dir = tempfile::tempdir().unwrap();
    let cache = resident_1gib(dir.path());
    let mut rng = fastrand::Rng::with_seed(0x1234_5678);
    g.bench_function("ram_overflow_1gib", |b| {
        b.iter(|| {
            cache
                .write_at(black_box(&data), rng.u64(..pages) * PAGE, false)
                .unwrap()
        })
    });
    let s = cache.stats();
    assert_eq!(
        s.overflow_write_ops, 0,
        "the working set must stay in RAM: {s:?}"
    );
    g.finish();
}

fn overflow_sustained(c: &mut Criterion) {
    let mut g = c.benchmark_group("overflow_sustained_4k_random_write");
    g.throughput(Throughput::Elements(1));
    let data = [0xA5u8; PAGE as usize];
    for (name, working_set) in [
        ("fits_48mib_of_64mib_ram", 48 * MIB),
        ("overflow_96mib_of_64mib_ram", 96 * MIB),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let cache = overflow_cache(128 * MIB, 64 * MIB, dir.path());
        fill(&cache, working_set);
        let pages = working_set / PAGE;
        let mut rng = fastrand::Rng::with_seed(0x9876_5432);
        g.bench_with_input(BenchmarkId::from_parameter(name), &pages, |b, &pages| {
            b.iter(|| {
                cache
                    .write_at(black_box(&data), rng.u64(..pages) * PAGE, false)
                    .unwrap()
            })
        });
        let s = cache.stats();
        eprintln!(
            "{name}: guest writes {}, overflow writes {} ({} MiB), overflow reads {}, evictions {} pages, ram {} MiB, file {} MiB",
            s.guest_write_ops,
            s.overflow_write_ops,
            s.overflow_write_bytes >> 20,
            s.overflow_read_ops,
            s.evictions,
            s.ram_bytes >> 20,
            s.file_bytes >> 20
        );
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    targets = ram_resident, overflow_sustained
}
criterion_main!(benches);
