//! `MemoryDev` against the memcpy bound: random 4 KiB writes and reads into 1 GiB, one and
//! two threads, next to the same copies into a preallocated 1 GiB `Vec` — the ratio of the
//! two is the cost of the device (locking, page lookup) over the copy itself.
//!
//! Run: `cargo bench -p vdstream-blockdev --bench memory -- --measurement-time 3`.
//! Each figure is time per 4 KiB operation (with 2 threads: wall time per operation over
//! both threads, so throughput is the aggregate). Every page is written once before the
//! timing, so the figures are for the steady state, not for first-touch allocation.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use vdstream_blockdev::{BlockDev, MemoryDev};

const SIZE: u64 = 1 << 30;
const BLOCK: usize = 4096;
const PAGES: u64 = SIZE / BLOCK as u64;

/// Random page indices (`fastrand`, cheap, so that the generator is not what we measure).
type Pages = fastrand::Rng;

/// Runs `iters` operations on each of `threads` threads (each thread builds its operation
/// with `make(thread)` before the clock matters); returns wall time divided by the thread
/// count, so that criterion's per-iteration time and throughput are the aggregate.
fn timed<F: FnMut(&mut Pages)>(
    threads: usize,
    iters: u64,
    make: impl Fn(usize) -> F + Sync,
) -> Duration {
    let make = &make;
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            s.spawn(move || {
                let mut op = make(t);
                let mut pages = Pages::with_seed(t as u64 + 1);
                for _ in 0..iters {
                    op(&mut pages);
                }
            });
        }
    });
    start.elapsed() / threads as u32
}

fn bench(c: &mut Criterion) {
    let dev = MemoryDev::new(SIZE);
    let fill = vec![0xA5u8; 1 << 20];
    for off in (0..SIZE).step_by(fill.len()) {
        dev.write_at(&fill, off, false).expect("prefill");
    }
    // The baseline is split in halves, one per thread with 2 threads; each thread takes
    // its half's `Mutex` once per batch, not per copy.
    let mut baseline = vec![0xA5u8; SIZE as usize];
    let data = vec![0x5Au8; BLOCK];
    let (data, dev) = (&data[..], &dev);

    for (name, write) in [("write", true), ("read", false)] {
        let mut g = c.benchmark_group(format!("4k_random_{name}_1GiB"));
        g.throughput(Throughput::Elements(1));
        for threads in [1usize, 2] {
            g.bench_function(BenchmarkId::new("memcpy_vec", threads), |b| {
                b.iter_custom(|iters| {
                    let half = baseline.len() / threads;
                    let parts: Vec<std::sync::Mutex<&mut [u8]>> = baseline
                        .chunks_mut(half)
                        .map(std::sync::Mutex::new)
                        .collect();
                    timed(threads, iters, |t| {
                        let mut part = parts[t].lock().unwrap();
                        move |pages: &mut Pages| {
                            let at = pages.u64(..(half / BLOCK) as u64) as usize * BLOCK;
                            if write {
                                part[at..at + BLOCK].copy_from_slice(black_box(data));
                            } else {
                                let mut out = [0u8; BLOCK];
                                out.copy_from_slice(&part[at..at + BLOCK]);
                                black_box(&out);
                            }
                        }
                    })
                })
            });
            g.bench_function(BenchmarkId::new("memory_dev", threads), |b| {
                b.iter_custom(|iters| {
                    timed(threads, iters, |_| {
                        |pages: &mut Pages| {
                            let at = pages.u64(..PAGES) * BLOCK as u64;
                            if write {
                                dev.write_at(black_box(data), at, false).expect("write");
                            } else {
                                let mut out = [0u8; BLOCK];
                                dev.read_at(&mut out, at).expect("read");
                                black_box(&out);
                            }
                        }
                    })
                })
            });
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
