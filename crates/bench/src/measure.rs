//! What every runner shares, so that the NBD ([`crate::run`](mod@crate::run)), in-process
//! ([`crate::device`]) and vhost-user ([`crate::vhost_user`]) figures are measured the same
//! way: the run's options and progress reports, the counters, the `--verify` ledger, picking
//! a worker's next operation, recording an answered request, the per-interval sampler and
//! the final [`BenchResult`].
//!
//! Invariants: a runner takes each request's latency from just before it hands the request
//! over to its answer and reports it once through `Shared::wrote`, `Shared::read` or
//! `Shared::failed`; those bump every counter once and release the request's block in the
//! ledger, so what a read checks is exactly the last acknowledged write to that block (or
//! nothing, if none). The sampler runs on the caller's thread while the requests run
//! elsewhere, and sets `stop` when the duration is over; a runner then finishes the requests
//! it has in flight and starts no new one.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::histogram::Histogram;
use crate::pattern::{self, Ledger, Mismatch};
use crate::result::{round1, BenchResult, Interval, OpFigures, VerifyFigures};
use crate::workload::{OpStream, Workload};
use crate::BenchError;

/// How a run is carried out, beyond the workload.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Length of one interval of the time series (and of progress reports).
    pub interval: Duration,
    /// Seed of the offset streams.
    pub seed: u64,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            interval: Duration::from_secs(1),
            seed: 0x5644_5354_5245_414d,
        }
    }
}

/// What the progress function sees, once per interval.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    pub elapsed: Duration,
    pub duration: Duration,
    pub interval: Interval,
}

#[derive(Debug, Default)]
struct Counters {
    read_ops: AtomicU64,
    write_ops: AtomicU64,
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
    latency_ns: AtomicU64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Snapshot {
    read_ops: u64,
    write_ops: u64,
    read_bytes: u64,
    write_bytes: u64,
    latency_ns: u64,
}

impl Counters {
    fn snapshot(&self) -> Snapshot {
        Snapshot {
            read_ops: self.read_ops.load(Relaxed),
            write_ops: self.write_ops.load(Relaxed),
            read_bytes: self.read_bytes.load(Relaxed),
            write_bytes: self.write_bytes.load(Relaxed),
            latency_ns: self.latency_ns.load(Relaxed),
        }
    }
}

/// Error messages and mismatches kept for the result.
const KEEP: usize = 20;

/// One operation a worker picked: a read or write of `block`, which the request holds in
/// the ledger (with `--verify`) until it is reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pick {
    pub write: bool,
    pub block: u64,
    /// The block's last acknowledged generation (0: unknown or not verifying).
    pub generation: u32,
    /// For a write with `--verify`: the generation its stamps carry.
    pub new_generation: u32,
}

/// What one request loop (task or thread) measured.
#[derive(Debug, Default)]
pub(crate) struct TaskFigures {
    pub read: Histogram,
    pub write: Histogram,
}

impl TaskFigures {
    pub fn merge(&mut self, other: &TaskFigures) {
        self.read.merge(&other.read);
        self.write.merge(&other.write);
    }
}

/// State every request loop shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub block_size: u32,
    ledger: Option<Ledger>,
    counters: Counters,
    stop: AtomicBool,
    errors: AtomicU64,
    error_messages: Mutex<Vec<String>>,
    checked_reads: AtomicU64,
    mismatches: AtomicU64,
    first_mismatches: Mutex<Vec<Mismatch>>,
}

impl Shared {
    /// For `workload` over a working set of `blocks` blocks.
    pub fn new(workload: &Workload, blocks: u64) -> Shared {
        Shared {
            block_size: workload.block_size,
            ledger: workload.verify.then(|| Ledger::new(blocks)),
            counters: Counters::default(),
            stop: AtomicBool::new(false),
            errors: AtomicU64::new(0),
            error_messages: Mutex::new(Vec::new()),
            checked_reads: AtomicU64::new(0),
            mismatches: AtomicU64::new(0),
            first_mismatches: Mutex::new(Vec::new()),
        }
    }

    /// Whether request loops should start no new request.
    pub fn stopped(&self) -> bool {
        self.stop.load(Relaxed)
    }

    /// Ends the run: the duration is over, or the transport broke.
    pub fn stop(&self) {
        self.stop.store(true, Relaxed);
    }

    /// Counts an error that is not a request's (one request's goes through [`Shared::failed`]).
    pub fn error(&self, message: String) {
        self.errors.fetch_add(1, Relaxed);
        let mut m = self.error_messages.lock().expect("error list lock");
        if m.len() < KEEP {
            m.push(message);
        }
    }

    fn mismatch(&self, m: Mismatch) {
        self.mismatches.fetch_add(1, Relaxed);
        let mut v = self.first_mismatches.lock().expect("mismatch list lock");
        if v.len() < KEEP {
            v.push(m);
        }
    }

    /// The next operation of `stream`; with a ledger, holds its block (stepping past blocks
    /// other requests hold). `None` when every block it stepped to was held: try again
    /// after yielding (or after one of the caller's own requests is answered).
    pub fn try_pick(&self, stream: &mut OpStream) -> Option<Pick> {
        let op = stream.next_op();
        let Some(ledger) = &self.ledger else {
            return Some(Pick {
                write: op.write,
                block: op.block,
                generation: 0,
                new_generation: 0,
            });
        };
        let mut block = op.block;
        for attempt in 0..8 {
            if let Some(generation) = ledger.try_hold(block) {
                let new_generation = if op.write {
                    pattern::next_generation(generation)
                } else {
                    0
                };
                return Some(Pick {
                    write: op.write,
                    block,
                    generation,
                    new_generation,
                });
            }
            block = if attempt % 2 == 0 {
                stream.random_block()
            } else {
                stream.skip(block)
            };
        }
        None
    }

    /// Byte offset of `pick`'s block.
    pub fn offset(&self, pick: &Pick) -> u64 {
        pick.block * u64::from(self.block_size)
    }

    /// Before a write with `--verify`: stamps `buf` with the pick's offset and new
    /// generation. Without, `buf` is written as it is (every runner stamps its write
    /// buffers with generation 0 once, as the NBD runner always did).
    pub fn stamp(&self, pick: &Pick, buf: &mut [u8]) {
        if self.ledger.is_some() && pick.write {
            pattern::fill(buf, self.offset(pick), pick.new_generation);
        }
    }

    /// A write answered without error after `ns` nanoseconds.
    pub fn wrote(&self, figures: &mut TaskFigures, pick: &Pick, ns: u64) {
        figures.write.record(ns);
        let c = &self.counters;
        c.write_ops.fetch_add(1, Relaxed);
        c.write_bytes.fetch_add(u64::from(self.block_size), Relaxed);
        c.latency_ns.fetch_add(ns, Relaxed);
        if let Some(l) = &self.ledger {
            l.release(pick.block, pick.new_generation);
        }
    }

    /// A read answered without error after `ns` nanoseconds, with `data`; with `--verify`,
    /// checks it against the block's last acknowledged write.
    pub fn read(&self, figures: &mut TaskFigures, pick: &Pick, data: &[u8], ns: u64) {
        figures.read.record(ns);
        let c = &self.counters;
        c.read_ops.fetch_add(1, Relaxed);
        c.read_bytes.fetch_add(u64::from(self.block_size), Relaxed);
        c.latency_ns.fetch_add(ns, Relaxed);
        if let Some(l) = &self.ledger {
            if pick.generation != 0 {
                self.checked_reads.fetch_add(1, Relaxed);
                if let Some(m) = pattern::check(data, self.offset(pick), pick.generation) {
                    self.mismatch(m);
                }
            }
            l.release(pick.block, pick.generation);
        }
    }

    /// A request answered with an error (or lost with the transport): counted, and its
    /// block released (after a failed write its contents are unknown). `fatal` ends the run.
    pub fn failed(&self, pick: &Pick, message: String, fatal: bool) {
        if let Some(l) = &self.ledger {
            l.release(pick.block, if pick.write { 0 } else { pick.generation });
        }
        self.error(message);
        if fatal {
            self.stop();
        }
    }
}

/// Samples the counters every interval, on the caller's thread, until the duration is over
/// or the run stops (a broken transport); calls `progress` with each interval; sets `stop`
/// before it returns. `start` is when the first request could start.
pub(crate) fn sample(
    shared: &Shared,
    workload: &Workload,
    opts: &RunOptions,
    start: Instant,
    progress: &mut dyn FnMut(&Progress),
) -> Vec<Interval> {
    let mut series = Vec::new();
    let mut prev = Snapshot::default();
    let mut prev_t = Duration::ZERO;
    let mut next_tick = opts.interval;
    loop {
        let remaining = workload.duration.saturating_sub(start.elapsed());
        let broken = shared.stopped();
        let stopping = remaining < opts.interval.mul_f64(0.5) || broken;
        if stopping {
            if !broken {
                sleep_until(shared, start + workload.duration);
            }
            shared.stop();
        } else {
            sleep_until(shared, start + next_tick);
            next_tick += opts.interval;
        }
        let now = start.elapsed();
        let snap = shared.counters.snapshot();
        let interval = interval_between(
            &prev,
            &snap,
            (now - prev_t).as_secs_f64(),
            now.as_secs_f64(),
        );
        if (now - prev_t) >= opts.interval.mul_f64(0.25) {
            series.push(interval);
            progress(&Progress {
                elapsed: now,
                duration: workload.duration,
                interval,
            });
        }
        prev = snap;
        prev_t = now;
        if stopping {
            return series;
        }
    }
}

/// Sleeps until `deadline`, waking early when the run stops.
fn sleep_until(shared: &Shared, deadline: Instant) {
    loop {
        let now = Instant::now();
        if now >= deadline || shared.stopped() {
            return;
        }
        std::thread::sleep((deadline - now).min(Duration::from_millis(20)));
    }
}

fn interval_between(a: &Snapshot, b: &Snapshot, secs: f64, t_secs: f64) -> Interval {
    let rate = |x: u64, y: u64| {
        if secs > 0.0 {
            round1((y - x) as f64 / secs)
        } else {
            0.0
        }
    };
    let mib = |x: u64, y: u64| {
        if secs > 0.0 {
            round1((y - x) as f64 / secs / f64::from(1 << 20))
        } else {
            0.0
        }
    };
    let ops = (b.read_ops + b.write_ops) - (a.read_ops + a.write_ops);
    let mean_latency_us = if ops > 0 {
        round1((b.latency_ns - a.latency_ns) as f64 / ops as f64 / 1000.0)
    } else {
        0.0
    };
    Interval {
        t_secs: (t_secs * 100.0).round() / 100.0,
        read_iops: rate(a.read_ops, b.read_ops),
        write_iops: rate(a.write_ops, b.write_ops),
        read_mib_per_sec: mib(a.read_bytes, b.read_bytes),
        write_mib_per_sec: mib(a.write_bytes, b.write_bytes),
        mean_latency_us,
    }
}

/// What a finished run measured, for [`finish`].
pub(crate) struct Finished<'a> {
    pub uri: String,
    pub export_size: u64,
    pub blocks: u64,
    pub workload: &'a Workload,
    pub figures: TaskFigures,
    pub series: Vec<Interval>,
    /// Seconds from the first request to the last answer.
    pub elapsed: f64,
}

/// The result of a run whose request loops have all ended.
pub(crate) fn finish(shared: &Shared, f: Finished<'_>) -> BenchResult {
    let snap = shared.counters.snapshot();
    let mut both = f.figures.read.clone();
    both.merge(&f.figures.write);
    let verify = shared.ledger.as_ref().map(|_| VerifyFigures {
        checked_reads: shared.checked_reads.load(Relaxed),
        mismatches: shared.mismatches.load(Relaxed),
        first: shared
            .first_mismatches
            .lock()
            .expect("mismatch list lock")
            .clone(),
    });
    let error_messages = shared
        .error_messages
        .lock()
        .expect("error list lock")
        .clone();
    let elapsed = f.elapsed;
    BenchResult {
        uri: f.uri,
        export_size: f.export_size,
        working_set: f.blocks * u64::from(f.workload.block_size),
        workload: f.workload.clone(),
        elapsed_secs: (elapsed * 100.0).round() / 100.0,
        total: OpFigures::from_histogram(&both, snap.read_bytes + snap.write_bytes, elapsed),
        read: OpFigures::from_histogram(&f.figures.read, snap.read_bytes, elapsed),
        write: OpFigures::from_histogram(&f.figures.write, snap.write_bytes, elapsed),
        errors: shared.errors.load(Relaxed),
        error_messages,
        verify,
        series: f.series,
    }
}

/// Joins the worker threads of a run and merges what they measured; a worker that
/// panicked makes the run an error.
pub(crate) fn join_workers(
    handles: Vec<std::thread::ScopedJoinHandle<'_, TaskFigures>>,
) -> Result<TaskFigures, BenchError> {
    let mut figures = TaskFigures::default();
    let mut panicked = None;
    for h in handles {
        match h.join() {
            Ok(f) => figures.merge(&f),
            Err(p) => panicked = Some(panic_message(&*p)),
        }
    }
    match panicked {
        Some(p) => Err(BenchError::Task(p)),
        None => Ok(figures),
    }
}

/// What a panicking request thread said.
pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a thread panicked".into())
}
