//! RAM sizing from evidence: replays a recorded I/O trace through the real cache engines
//! and says how much storage I/O each cache type and RAM size would have caused.
//!
//! [`replay`] opens one cache of the asked type (the same code a target runs) over a
//! sparse, zero-filled [`MemoryDev`] of the traced device's size, with its overflow or cache
//! file in a folder the caller gives, and sends it every traced request in order, as fast
//! as it takes them. Storage I/O comes from the cache's own [`StatsSnapshot`]: reads of the
//! vDisk, reads and writes of the overflow file or the cache file. Rates divide by the
//! trace's recorded duration, so they are the rates the target would have caused.
//! [`recommend`] then picks the smallest RAM size that meets a [`SizingGoal`].
//!
//! Invariants:
//! - Every replay starts from an empty cache, as a fresh attach does.
//! - Written bytes are a non-zero pattern: a cache keeps all-zero pages as markers, which
//!   would make writes look free.
//! - A write the cache refuses (ENOSPC, `device-ram` when its RAM is full) is counted, and
//!   the trace time of the first one is kept; the replay goes on, as the target would.
//! - Replay is faster than real time. Where the trace was idle before the next request (a
//!   gap of 1 ms or more) and `ram-overflow`'s RAM is past the flusher's high watermark,
//!   the replay waits for the flusher as the idle time would have let it (at most the gap,
//!   and at most 50 ms), so its evictions follow the trace's pace; within bursts it runs
//!   as fast as the engine takes requests, and what reaches the overflow file is what the
//!   engine decided.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vdstream_blockdev::trace::{FLAG_FUA, FLAG_MAY_TRIM};
use vdstream_blockdev::{BlockDev, ErrorKind, MemoryDev, Result, TraceOp, TraceRecord, ZeroFlags};

use crate::{CacheConfig, CacheType, StatsSnapshot};

/// The longest the replay waits for `ram-overflow`'s flusher in one idle gap of the trace.
const MAX_FLUSHER_WAIT: Duration = Duration::from_millis(50);

/// Requests of a trace by operation, and its span.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TraceSummary {
    pub reads: u64,
    pub writes: u64,
    pub trims: u64,
    pub zeroes: u64,
    pub flushes: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    /// Time of the last request, ns after the recording started.
    pub duration_ns: u64,
}

impl TraceSummary {
    pub fn of(records: &[TraceRecord]) -> TraceSummary {
        let mut s = TraceSummary::default();
        for r in records {
            match r.op {
                TraceOp::Read => {
                    (s.reads, s.read_bytes) = (s.reads + 1, s.read_bytes + r.length as u64)
                }
                TraceOp::Write => {
                    (s.writes, s.write_bytes) = (s.writes + 1, s.write_bytes + r.length as u64)
                }
                TraceOp::Trim => s.trims += 1,
                TraceOp::Zero => s.zeroes += 1,
                TraceOp::Flush => s.flushes += 1,
            }
        }
        s.duration_ns = records.last().map_or(0, |r| r.time_ns);
        s
    }

    pub fn requests(&self) -> u64 {
        self.reads + self.writes + self.trims + self.zeroes + self.flushes
    }

    /// The trace's duration in seconds, or `None` for a trace shorter than a millisecond
    /// (rates over it would mean nothing).
    pub fn seconds(&self) -> Option<f64> {
        (self.duration_ns >= 1_000_000).then(|| self.duration_ns as f64 / 1e9)
    }
}

/// What one replay caused.
#[derive(Debug, Clone)]
pub struct ReplayResult {
    pub kind: CacheType,
    /// RAM budget of the cache (meaningless for the disk types, which use none).
    pub ram: u64,
    /// The cache's counters after the last request.
    pub stats: StatsSnapshot,
    /// The most RAM the cache held at once.
    pub peak_ram_bytes: u64,
    /// The largest the overflow or cache file grew.
    pub peak_file_bytes: u64,
    /// Writes refused for lack of space, and the trace time of the first.
    pub nospace_writes: u64,
    pub first_nospace_ns: Option<u64>,
    /// Requests that failed for another reason (none expected).
    pub other_errors: u64,
}

impl ReplayResult {
    /// Operations that reached storage (vDisk, overflow file, cache file).
    pub fn storage_ops(&self) -> u64 {
        self.stats.storage_ops()
    }

    /// Storage operations per second of the trace's duration.
    pub fn storage_iops(&self, trace: &TraceSummary) -> Option<f64> {
        trace.seconds().map(|s| self.storage_ops() as f64 / s)
    }

    /// Whether the result depends on the RAM budget.
    pub fn uses_ram(&self) -> bool {
        uses_ram(self.kind)
    }
}

/// Whether a cache type's behaviour depends on `--ram`.
pub fn uses_ram(kind: CacheType) -> bool {
    matches!(kind, CacheType::RamOverflow | CacheType::DeviceRam)
}

/// Replays `records` (in order) through a fresh cache of `kind` with `ram` bytes of RAM over
/// a zero-filled device of `device_size` bytes; the overflow or cache file goes in `dir`.
/// `progress` is called now and then with the number of requests done.
pub fn replay(
    records: &[TraceRecord],
    device_size: u64,
    kind: CacheType,
    ram: u64,
    dir: PathBuf,
    progress: &mut dyn FnMut(u64),
) -> Result<ReplayResult> {
    let lower: Arc<dyn BlockDev> = Arc::new(MemoryDev::new(device_size));
    let cfg = CacheConfig {
        ram,
        dir,
        // The page cache, not O_DIRECT: the replay counts operations, it does not time them,
        // and a temporary folder may be on tmpfs, which refuses O_DIRECT.
        intermediate_buffering: true,
        zero_fill: false,
        ..CacheConfig::new("replay")
    };
    let cache = crate::open(kind, lower, &cfg)?;
    let longest = records
        .iter()
        .filter(|r| matches!(r.op, TraceOp::Read | TraceOp::Write))
        .map(|r| r.length)
        .max()
        .unwrap_or(0);
    let data: Vec<u8> = (0..longest as usize)
        .map(|i| 0xa5 ^ (i as u8) | 1)
        .collect();
    let mut buf = vec![0u8; longest as usize];
    let mut out = ReplayResult {
        kind,
        ram,
        stats: StatsSnapshot::default(),
        peak_ram_bytes: 0,
        peak_file_bytes: 0,
        nospace_writes: 0,
        first_nospace_ns: None,
        other_errors: 0,
    };
    for (i, r) in records.iter().enumerate() {
        // Requests reaching past the end cannot come from the NBD edge; skip them rather
        // than fail on a hand-made trace.
        if r.offset
            .checked_add(r.length as u64)
            .is_none_or(|end| end > device_size)
        {
            out.other_errors += 1;
            continue;
        }
        let len = r.length as usize;
        let fua = r.flags & FLAG_FUA != 0;
        let done = match r.op {
            TraceOp::Read => cache.read_at(&mut buf[..len], r.offset),
            TraceOp::Write => cache.write_at(&data[..len], r.offset, fua),
            TraceOp::Trim => cache.trim(r.offset, r.length as u64, fua),
            TraceOp::Zero => cache.write_zeroes(
                r.offset,
                r.length as u64,
                ZeroFlags {
                    may_trim: r.flags & FLAG_MAY_TRIM != 0,
                    fast_only: false,
                    fua,
                },
            ),
            TraceOp::Flush => cache.flush(),
        };
        match done {
            Ok(()) => {}
            Err(e) if e.kind == ErrorKind::NoSpace => {
                out.nospace_writes += 1;
                out.first_nospace_ns.get_or_insert(r.time_ns);
            }
            Err(e) => {
                if out.other_errors == 0 {
                    log::warn!("replaying through {kind}: {e}");
                }
                out.other_errors += 1;
            }
        }
        let s = cache.stats();
        out.peak_ram_bytes = out.peak_ram_bytes.max(s.ram_bytes);
        out.peak_file_bytes = out.peak_file_bytes.max(s.file_bytes);
        if kind == CacheType::RamOverflow && ram > 0 {
            if let Some(next) = records.get(i + 1) {
                let idle = Duration::from_nanos(next.time_ns.saturating_sub(r.time_ns))
                    .min(MAX_FLUSHER_WAIT);
                if idle >= Duration::from_millis(1) {
                    let high = ram / 100 * crate::overflow::HIGH_WATERMARK_PERCENT;
                    let until = Instant::now() + idle;
                    while cache.stats().ram_bytes >= high && Instant::now() < until {
                        std::thread::sleep(Duration::from_micros(200));
                    }
                }
            }
        }
        if i % 4096 == 4095 {
            progress(i as u64 + 1);
        }
    }
    progress(records.len() as u64);
    out.stats = cache.stats();
    out.peak_ram_bytes = out.peak_ram_bytes.max(out.stats.ram_bytes);
    out.peak_file_bytes = out.peak_file_bytes.max(out.stats.file_bytes);
    Ok(out)
}

/// What "enough RAM" means.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SizingGoal {
    /// Storage IOPS at most this.
    StorageIops(f64),
    /// Storage IOPS at least this many percent below `device-disk`'s on the same trace.
    ReductionPercent(f64),
    /// No target given: within 10% (or 1 IOPS) of the lowest storage IOPS any RAM size
    /// tried reached for that type, i.e. where more RAM stops helping.
    NearBest,
}

/// Storage IOPS at or below which `goal` is met by a type whose lowest storage IOPS over
/// the RAM sizes tried is `best`; `baseline` is `device-disk`'s.
pub fn iops_limit(goal: SizingGoal, best: f64, baseline: Option<f64>) -> Option<f64> {
    match goal {
        SizingGoal::StorageIops(n) => Some(n),
        SizingGoal::ReductionPercent(p) => baseline.map(|b| b * (1.0 - p / 100.0)),
        SizingGoal::NearBest => Some((best * 1.1).max(best + 1.0)),
    }
}

/// Whether one result meets a limit: storage IOPS within it, and no write refused.
pub fn meets(result: &ReplayResult, trace: &TraceSummary, limit: Option<f64>) -> bool {
    let iops = result
        .storage_iops(trace)
        .unwrap_or(result.storage_ops() as f64);
    result.nospace_writes == 0
        && result.other_errors == 0
        && limit.is_some_and(|l| iops <= l + 1e-9)
}

/// The smallest RAM of `kind` among `results` that meets `goal`, if any does.
pub fn recommend(
    results: &[ReplayResult],
    kind: CacheType,
    trace: &TraceSummary,
    goal: SizingGoal,
    baseline: Option<f64>,
) -> Option<u64> {
    let mut of_kind: Vec<&ReplayResult> = results.iter().filter(|r| r.kind == kind).collect();
    of_kind.sort_by_key(|r| r.ram);
    let rate = |r: &ReplayResult| r.storage_iops(trace).unwrap_or(r.storage_ops() as f64);
    let best = of_kind
        .iter()
        .filter(|r| r.nospace_writes == 0)
        .map(|r| rate(r))
        .fold(f64::INFINITY, f64::min);
    let limit = iops_limit(goal, best, baseline);
    of_kind
        .into_iter()
        .find(|r| meets(r, trace, limit))
        .map(|r| r.ram)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(i: u64, op: TraceOp, offset: u64, length: u32) -> TraceRecord {
        TraceRecord {
            time_ns: i * 1_000_000,
            offset,
            length,
            op,
            flags: 0,
        }
    }

    /// 1000 writes over 2 MiB, written twice, then read back.
    fn workload() -> Vec<TraceRecord> {
        let mut v = Vec::new();
        for pass in 0..2u64 {
            for p in 0..512u64 {
                v.push(rec(
                    v.len() as u64,
                    TraceOp::Write,
                    ((p * 37 + pass) % 512) * 4096,
                    4096,
                ));
            }
        }
        for p in 0..512u64 {
            v.push(rec(v.len() as u64, TraceOp::Read, p * 4096, 4096));
        }
        v.push(rec(v.len() as u64, TraceOp::Flush, 0, 0));
        v
    }

    #[test]
    fn more_ram_means_fewer_storage_writes_and_device_ram_reports_enospc() {
        let dir = tempfile::tempdir().unwrap();
        let recs = workload();
        let t = TraceSummary::of(&recs);
        assert_eq!((t.writes, t.reads, t.flushes), (1024, 512, 1));
        let run = |kind, ram| {
            replay(
                &recs,
                64 << 20,
                kind,
                ram,
                dir.path().to_path_buf(),
                &mut |_| {},
            )
            .unwrap()
        };
        let small = run(CacheType::RamOverflow, 0);
        let big = run(CacheType::RamOverflow, 8 << 20);
        assert!(small.stats.overflow_write_ops > 0);
        assert_eq!(big.stats.overflow_write_ops, 0, "{big:?}");
        assert!(big.storage_ops() < small.storage_ops());
        assert_eq!(big.peak_ram_bytes, 2 << 20);
        assert!(small.peak_file_bytes >= 2 << 20);

        let full = run(CacheType::DeviceRam, 1 << 20);
        assert_eq!(
            full.nospace_writes,
            2 * 256,
            "half the pages do not fit, in both passes"
        );
        assert_eq!(full.first_nospace_ns, Some(256 * 1_000_000));
        let fits = run(CacheType::DeviceRam, 4 << 20);
        assert_eq!((fits.nospace_writes, fits.first_nospace_ns), (0, None));

        let disk = run(CacheType::DeviceDisk, 0);
        assert!(disk.stats.disk_write_ops >= 1024, "{disk:?}");

        let results = vec![small.clone(), big.clone(), full.clone(), fits.clone()];
        let base = disk.storage_iops(&t);
        assert_eq!(
            recommend(
                &results,
                CacheType::RamOverflow,
                &t,
                SizingGoal::NearBest,
                base
            ),
            Some(8 << 20)
        );
        assert_eq!(
            recommend(
                &results,
                CacheType::DeviceRam,
                &t,
                SizingGoal::NearBest,
                base
            ),
            Some(4 << 20)
        );
        assert_eq!(
            recommend(
                &results,
                CacheType::RamOverflow,
                &t,
                SizingGoal::StorageIops(1e9),
                base
            ),
            Some(0)
        );
        assert_eq!(
            recommend(
                &results,
                CacheType::RamOverflow,
                &t,
                SizingGoal::StorageIops(-1.0),
                base
            ),
            None
        );
        assert_eq!(
            recommend(
                &results,
                CacheType::RamOverflow,
                &t,
                SizingGoal::ReductionPercent(99.0),
                base
            ),
            Some(8 << 20)
        );
    }
}
