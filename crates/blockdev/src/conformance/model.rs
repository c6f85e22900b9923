//! Model-based property tests for any [`BlockDev`]: random sequences of read, write, trim,
//! zero, flush, block status and sparse reads are applied both to the device and to a plain
//! byte vector (the *model*), every read is compared with the model, and the whole device
//! is read back at the end. proptest shrinks a failure to a minimal sequence of
//! [`ModelOp`]s, which the panic message prints.
//!
//! The strategies are public so that write-cache crates can drive their own models (say, a
//! cache over a read-only base) with the same biased offsets and lengths: offsets cluster
//! on 4 KiB page and 2 MiB unit edges and on the ends of the region, lengths on 1, 4095,
//! 4096, 4097 and page multiples, because that is where block arithmetic breaks.
//!
//! The concurrent variant splits the device into regions at *unaligned* boundaries (so
//! neighbouring regions share a page), runs one thread per region, checks each thread's
//! reads against its own region of the model, and compares the whole device at the end:
//! a device that loses an update to a shared page fails it.

use std::sync::Arc;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use super::{
    check_extents, check_extents_against, check_holes, compare, compare_all, pattern_buf,
    CheckResult, MakeDev,
};
use crate::{BatchOp, BlockDev, Hole, ZeroFlags};

const PAGE: u64 = 4096;
const UNIT: u64 = 2 << 20;

/// One operation of a generated sequence. Offsets are absolute device offsets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelOp {
    Read {
        offset: u64,
        len: u64,
    },
    ReadSparse {
        offset: u64,
        len: u64,
    },
    /// Writes [`pattern_buf`]`(seed, offset, len)`; seed 0 writes zeros.
    Write {
        offset: u64,
        len: u64,
        seed: u8,
        fua: bool,
    },
    Trim {
        offset: u64,
        len: u64,
    },
    Zero {
        offset: u64,
        len: u64,
        may_trim: bool,
    },
    Flush,
    BlockStatus {
        offset: u64,
        len: u64,
    },
    /// Reads and writes (never `Batch`) of ranges that do not overlap, run with one
    /// [`BlockDev::io_batch`] call.
    Batch(Vec<ModelOp>),
}

/// Offsets in `[start, end)` (non-empty), biased to page and 2 MiB edges and to the ends.
pub fn offset_in(start: u64, end: u64) -> BoxedStrategy<u64> {
    assert!(start < end, "empty region [{start}, {end})");
    let clamp = move |x: i128| x.clamp(start as i128, end as i128 - 1) as u64;
    let near = move |unit: u64| {
        (start / unit..=(end - 1) / unit, -3i64..=3)
            .prop_map(move |(i, d)| clamp(i as i128 * unit as i128 + d as i128))
    };
    prop_oneof![
        3 => start..end,
        3 => near(PAGE),
        1 => near(UNIT),
        1 => (0u64..8).prop_map(move |d| clamp(end as i128 - 1 - d as i128)),
        1 => (0u64..8).prop_map(move |d| clamp(start as i128 + d as i128)),
    ]
    .boxed()
}

/// Lengths from 1 to `max`, biased to page-sized ones.
pub fn len_up_to(max: u64) -> BoxedStrategy<u64> {
    let max = max.max(1);
    prop_oneof![
        3 => 1..=max,
        2 => (1u64..=16).prop_map(|n| n),
        2 => prop::sample::select(vec![511u64, 512, 4095, 4096, 4097, 8191, 8192, 8193]),
        2 => (1..=(max / PAGE).max(1)).prop_map(|n| n * PAGE),
    ]
    .prop_map(move |l| l.min(max))
    .boxed()
}

/// A non-empty range `(offset, len)` inside `[start, end)`, at most `max_len` long.
pub fn range_in(start: u64, end: u64, max_len: u64) -> BoxedStrategy<(u64, u64)> {
    (offset_in(start, end), len_up_to(max_len))
        .prop_map(move |(o, l)| (o, l.min(end - o)))
        .boxed()
}

/// One operation inside `[start, end)`.
pub fn op_in(start: u64, end: u64, max_len: u64) -> BoxedStrategy<ModelOp> {
    let r = move || range_in(start, end, max_len);
    prop_oneof![
        5 => (r(), 0u8..=255, prop::bool::weighted(0.1))
            .prop_map(|((offset, len), seed, fua)| ModelOp::Write { offset, len, seed: if seed < 8 { 0 } else { seed }, fua }),
        3 => r().prop_map(|(offset, len)| ModelOp::Read { offset, len }),
        1 => r().prop_map(|(offset, len)| ModelOp::ReadSparse { offset, len }),
        1 => r().prop_map(|(offset, len)| ModelOp::Trim { offset, len }),
        2 => (r(), any::<bool>()).prop_map(|((offset, len), may_trim)| ModelOp::Zero { offset, len, may_trim }),
        1 => Just(ModelOp::Flush),
        1 => r().prop_map(|(offset, len)| ModelOp::BlockStatus { offset, len }),
        2 => batch_in(start, end, max_len),
    ]
    .boxed()
}

/// A batch of 1 to 8 reads and writes inside `[start, end)` whose ranges do not overlap,
/// half of them whole aligned pages (the ranges a batching device submits at once).
pub fn batch_in(start: u64, end: u64, max_len: u64) -> BoxedStrategy<ModelOp> {
    let first_page = start.div_ceil(PAGE);
    let last_page = end / PAGE; // exclusive
    let aligned = move || {
        (
            first_page..last_page.max(first_page + 1),
            1u64..=(max_len / PAGE).clamp(1, 4),
        )
            .prop_map(move |(p, n)| (p * PAGE, (n * PAGE).min(end.saturating_sub(p * PAGE))))
    };
    let one = move || {
        let range = if last_page > first_page {
            prop_oneof![1 => range_in(start, end, max_len), 1 => aligned()].boxed()
        } else {
            range_in(start, end, max_len)
        };
        (range, any::<bool>(), 8u8..=255).prop_map(|((offset, len), write, seed)| {
            if write {
                ModelOp::Write {
                    offset,
                    len,
                    seed,
                    fua: false,
                }
            } else {
                ModelOp::Read { offset, len }
            }
        })
    };
    prop::collection::vec(one(), 1..=8)
        .prop_map(|ops| {
            let mut kept: Vec<ModelOp> = Vec::new();
            let span = |op: &ModelOp| match *op {
                ModelOp::Read { offset, len } | ModelOp::Write { offset, len, .. } => {
                    (offset, offset + len)
                }
                _ => (0, 0),
            };
            for op in ops {
                let (s, e) = span(&op);
                if e > s
                    && kept.iter().all(|k| {
                        let (ks, ke) = span(k);
                        e <= ks || s >= ke
                    })
                {
                    kept.push(op);
                }
            }
            ModelOp::Batch(kept)
        })
        .boxed()
}

/// A sequence of 1 to `max_ops` operations inside `[start, end)`.
pub fn ops_in(start: u64, end: u64, max_len: u64, max_ops: usize) -> BoxedStrategy<Vec<ModelOp>> {
    prop::collection::vec(op_in(start, end, max_len), 1..=max_ops).boxed()
}

/// Applies `op` to the device and to `model`, which mirrors the device bytes from `base`
/// on (a thread's region, or the whole device with `base` 0), and compares what was read.
pub fn step(dev: &dyn BlockDev, model: &mut [u8], base: u64, op: &ModelOp) -> CheckResult {
    let at = |offset: u64, len: u64| (offset - base) as usize..(offset - base + len) as usize;
    match *op {
        ModelOp::Read { offset, len } => {
            let mut buf = vec![0xEEu8; len as usize];
            dev.read_at(&mut buf, offset).map_err(|e| e.to_string())?;
            compare(&buf, &model[at(offset, len)], offset, "read")
        }
        ModelOp::ReadSparse { offset, len } => {
            let mut buf = vec![0xEEu8; len as usize];
            let mut holes: Vec<Hole> = Vec::new();
            dev.read_at_sparse(&mut buf, offset, &mut holes)
                .map_err(|e| e.to_string())?;
            check_holes(&buf, &holes, "read_at_sparse")?;
            compare(&buf, &model[at(offset, len)], offset, "read_at_sparse")
        }
        ModelOp::Write {
            offset,
            len,
            seed,
            fua,
        } => {
            let data = pattern_buf(seed, offset, len as usize);
            dev.write_at(&data, offset, fua)
                .map_err(|e| e.to_string())?;
            model[at(offset, len)].copy_from_slice(&data);
            Ok(())
        }
        ModelOp::Trim { offset, len } => {
            dev.trim(offset, len, false).map_err(|e| e.to_string())?;
            model[at(offset, len)].fill(0);
            Ok(())
        }
        ModelOp::Zero {
            offset,
            len,
            may_trim,
        } => {
            dev.write_zeroes(
                offset,
                len,
                ZeroFlags {
                    may_trim,
                    ..Default::default()
                },
            )
            .map_err(|e| e.to_string())?;
            model[at(offset, len)].fill(0);
            Ok(())
        }
        ModelOp::Flush => dev.flush().map_err(|e| e.to_string()),
        ModelOp::BlockStatus { offset, len } => {
            let mut out = Vec::new();
            dev.block_status(offset, len, &mut out)
                .map_err(|e| e.to_string())?;
            check_extents(offset, len, &out)?;
            check_extents_against(&model[at(offset, len)], 0, &out)
                .map_err(|e| format!("{e} (relative to offset {offset})"))
        }
        ModelOp::Batch(ref ops) => {
            let writes: Vec<Vec<u8>> = ops
                .iter()
                .map(|op| match *op {
                    ModelOp::Write {
                        offset, len, seed, ..
                    } => pattern_buf(seed, offset, len as usize),
                    _ => Vec::new(),
                })
                .collect();
            let mut reads: Vec<Vec<u8>> = ops
                .iter()
                .map(|op| match *op {
                    ModelOp::Read { len, .. } => vec![0xEEu8; len as usize],
                    _ => Vec::new(),
                })
                .collect();
            let mut batch: Vec<BatchOp<'_>> = Vec::with_capacity(ops.len());
            for ((op, w), r) in ops.iter().zip(&writes).zip(reads.iter_mut()) {
                match *op {
                    ModelOp::Write { offset, fua, .. } => {
                        batch.push(BatchOp::write(w, offset, fua))
                    }
                    ModelOp::Read { offset, .. } => batch.push(BatchOp::read(r, offset)),
                    _ => return Err(format!("a batch holds only reads and writes, not {op:?}")),
                }
            }
            dev.io_batch(&mut batch);
            let results: Vec<_> = batch.into_iter().map(|b| b.result).collect();
            // The ranges do not overlap, so every read sees the state before the batch.
            for ((op, result), (w, r)) in ops.iter().zip(results).zip(writes.iter().zip(&reads)) {
                result.map_err(|e| format!("in a batch: {e}"))?;
                match *op {
                    ModelOp::Read { offset, len } => {
                        compare(r, &model[at(offset, len)], offset, "read in a batch")?
                    }
                    ModelOp::Write { offset, len, .. } => model[at(offset, len)].copy_from_slice(w),
                    _ => {}
                }
            }
            Ok(())
        }
    }
}

/// Parameters of a model check.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// Device size; the default is not a multiple of 4096 and spans three 2 MiB units.
    pub size: u64,
    /// Generated sequences (proptest cases). `PROPTEST_CASES` in the environment wins.
    pub cases: u32,
    /// Longest sequence (per thread in the concurrent variant).
    pub max_ops: usize,
    /// Longest single request.
    pub max_len: u64,
    /// Threads of the concurrent variant.
    pub threads: usize,
    /// `Some(seed)`: fresh devices from `make` hold [`pattern_buf`]`(seed, 0, size)` rather
    /// than zeros (say, a write cache over a pre-filled vDisk), and the model starts so.
    pub initial_seed: Option<u8>,
}

/// What a fresh device of `size` bytes holds under `cfg`.
fn initial(cfg_seed: Option<u8>, size: u64) -> Vec<u8> {
    match cfg_seed {
        Some(seed) => pattern_buf(seed, 0, size as usize),
        None => vec![0u8; size as usize],
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            size: 4 * (1 << 20) + 3 * PAGE + 1234,
            cases: 48,
            max_ops: 40,
            max_len: 300 * 1024,
            threads: 3,
            initial_seed: None,
        }
    }
}

fn runner(cfg: &ModelConfig) -> TestRunner {
    let cases = if std::env::var_os("PROPTEST_CASES").is_some() {
        Config::default().cases
    } else {
        cfg.cases
    };
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    })
}

/// Random sequences of operations on fresh devices from `make`, against the model.
/// Panics with the device name and the minimal failing sequence.
pub fn model_check(name: &str, make: MakeDev<'_>, cfg: ModelConfig) {
    let size = cfg.size;
    let result = runner(&cfg).run(&ops_in(0, size, cfg.max_len, cfg.max_ops), |ops| {
        let dev = make(size);
        let mut model = initial(cfg.initial_seed, size);
        for (i, op) in ops.iter().enumerate() {
            step(&*dev, &mut model, 0, op)
                .map_err(|e| TestCaseError::fail(format!("op #{i} {op:?}: {e}")))?;
        }
        compare_all(&*dev, &model, "final full read").map_err(TestCaseError::fail)
    });
    if let Err(e) = result {
        panic!("model check failed for {name} (size {size}): {e}");
    }
}

/// Region bounds for `threads` threads: equal shares, each inner boundary moved by up to
/// 2000 bytes either way so that it falls inside a page shared by two threads.
fn regions(size: u64, threads: usize) -> BoxedStrategy<Vec<(u64, u64)>> {
    prop::collection::vec(-2000i64..2000, threads - 1)
        .prop_map(move |deltas| {
            let mut bounds = vec![0u64];
            for (i, d) in deltas.iter().enumerate() {
                bounds.push(((i as u64 + 1) * (size / threads as u64)).saturating_add_signed(*d));
            }
            bounds.push(size);
            bounds.windows(2).map(|w| (w[0], w[1])).collect()
        })
        .boxed()
}

/// The concurrent variant: one thread per region, each running its own random sequence,
/// every read checked against the thread's region, the whole device compared at the end.
pub fn model_check_concurrent(name: &str, make: MakeDev<'_>, cfg: ModelConfig) {
    let size = cfg.size;
    let threads = cfg.threads.max(2);
    assert!(
        size / threads as u64 > 4096,
        "device too small for {threads} regions"
    );
    let (max_len, max_ops) = (cfg.max_len, cfg.max_ops);
    let start_bytes = initial(cfg.initial_seed, size);
    let strategy = regions(size, threads).prop_flat_map(move |regions| {
        let per_thread: Vec<_> = regions
            .iter()
            .map(|&(s, e)| ops_in(s, e, max_len, max_ops))
            .collect();
        (Just(regions), per_thread)
    });
    let result = runner(&cfg).run(&strategy, |(regions, ops)| {
        let dev: Arc<dyn BlockDev> = make(size);
        let results: Vec<(Vec<u8>, CheckResult)> = std::thread::scope(|s| {
            let handles: Vec<_> = regions
                .iter()
                .zip(&ops)
                .map(|(&(start, end), ops)| {
                    let dev = &dev;
                    let start_bytes = &start_bytes;
                    s.spawn(move || {
                        let mut model = start_bytes[start as usize..end as usize].to_vec();
                        for (i, op) in ops.iter().enumerate() {
                            if let Err(e) = step(&**dev, &mut model, start, op) {
                                return (
                                    model,
                                    Err(format!(
                                        "thread for [{start}, {end}), op #{i} {op:?}: {e}"
                                    )),
                                );
                            }
                        }
                        (model, Ok(()))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| (Vec::new(), Err("thread panicked".into())))
                })
                .collect()
        });
        let mut model = Vec::with_capacity(size as usize);
        for (part, r) in results {
            r.map_err(TestCaseError::fail)?;
            model.extend_from_slice(&part);
        }
        compare_all(&*dev, &model, "final full read after concurrent sequences")
            .map_err(TestCaseError::fail)
    });
    if let Err(e) = result {
        panic!("concurrent model check failed for {name} (size {size}, {threads} threads): {e}");
    }
}
