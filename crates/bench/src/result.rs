//! What a run measured: totals, read and write figures with latency percentiles, the
//! per-interval time series, errors and verify mismatches; as JSON (`--json`) and as text
//! for a person.
//!
//! Invariants: `total` is `read` plus `write` (ops, bytes, rates; its latency is over both);
//! rates are over `elapsed_secs`, the time from the first request to the last answer; every
//! figure is counted from answered requests, none is derived from the settings.

use serde::Serialize;

use crate::histogram::{Histogram, LatencySummary};
use crate::pattern::Mismatch;
use crate::workload::Workload;

/// One kind of operation (or both) over the whole run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct OpFigures {
    pub ops: u64,
    pub bytes: u64,
    pub iops: f64,
    /// MiB (2^20 bytes) per second.
    pub mib_per_sec: f64,
    pub latency: LatencySummary,
}

impl OpFigures {
    pub(crate) fn from_histogram(h: &Histogram, bytes: u64, secs: f64) -> OpFigures {
        let per_sec = |x: f64| if secs > 0.0 { x / secs } else { 0.0 };
        OpFigures {
            ops: h.count(),
            bytes,
            iops: round1(per_sec(h.count() as f64)),
            mib_per_sec: round1(per_sec(bytes as f64 / f64::from(1 << 20))),
            latency: h.summary(),
        }
    }
}

pub(crate) fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// One interval of the time series.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Interval {
    /// Seconds from the start of the run to the end of this interval.
    pub t_secs: f64,
    pub read_iops: f64,
    pub write_iops: f64,
    pub read_mib_per_sec: f64,
    pub write_mib_per_sec: f64,
    /// Mean latency of the requests answered in this interval.
    pub mean_latency_us: f64,
}

impl Interval {
    pub fn iops(&self) -> f64 {
        self.read_iops + self.write_iops
    }
}

/// `--verify` figures.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct VerifyFigures {
    /// Reads of blocks this run had written, compared stamp by stamp.
    pub checked_reads: u64,
    pub mismatches: u64,
    /// The first mismatches (at most 20), in the order found.
    pub first: Vec<Mismatch>,
}

/// The result of a run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BenchResult {
    pub uri: String,
    pub export_size: u64,
    /// Bytes from offset 0 the run touched (whole blocks).
    pub working_set: u64,
    pub workload: Workload,
    pub elapsed_secs: f64,
    pub total: OpFigures,
    pub read: OpFigures,
    pub write: OpFigures,
    /// Requests the server answered with an error, or that failed with the connection.
    pub errors: u64,
    /// The first error messages (at most 20).
    pub error_messages: Vec<String>,
    pub verify: Option<VerifyFigures>,
    pub series: Vec<Interval>,
}

impl BenchResult {
    /// Whether the run is clean: no errors and no verify mismatches.
    pub fn ok(&self) -> bool {
        self.errors == 0 && self.verify.as_ref().is_none_or(|v| v.mismatches == 0)
    }

    /// The result as text for a person.
    pub fn render(&self) -> String {
        let w = &self.workload;
        let mut out = format!(
            "{}: {} workers x queue depth {}, {} B blocks, {}% writes, {}% random, working set {} MiB, {:.1} s\n",
            self.uri,
            w.workers,
            w.queue_depth,
            w.block_size,
            w.write_pct,
            w.random_pct,
            self.working_set >> 20,
            self.elapsed_secs
        );
        let line = |name: &str, f: &OpFigures| {
            format!(
                "  {name:<6} {:>10.0} IOPS {:>9.1} MiB/s   latency mean {:>8.1} us  p50 {:>8.1}  p99 {:>8.1}  max {:>9.1}  ({} ops)\n",
                f.iops, f.mib_per_sec, f.latency.mean_us, f.latency.p50_us, f.latency.p99_us, f.latency.max_us, f.ops
            )
        };
        out += &line("total", &self.total);
        out += &line("read", &self.read);
        out += &line("write", &self.write);
        if let Some(v) = &self.verify {
            out += &format!(
                "  verify: {} reads checked, {} mismatches\n",
                v.checked_reads, v.mismatches
            );
            for m in &v.first {
                out += &format!(
                    "    offset {}: expected generation {}, found {}\n",
                    m.offset, m.expected_generation, m.found
                );
            }
        }
        if self.errors > 0 {
            out += &format!("  errors: {}\n", self.errors);
            for e in &self.error_messages {
                out += &format!("    {e}\n");
            }
        }
        out
    }
}
