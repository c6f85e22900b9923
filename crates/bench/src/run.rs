//! Running a [`Workload`] against an NBD export: one connection per worker (the project's
//! async client, pipelined), `queue_depth` requests in flight on each, until the duration
//! is over; a sampler turns shared counters into the per-interval time series and calls
//! the caller's progress function.
//!
//! Invariants: a request's latency runs from just before it is handed to the client to its
//! answer; every counter is bumped once per answered request; with `verify`, a block is
//! held by one request at a time through the [`Ledger`], so what a read checks is exactly
//! the last acknowledged write to that block (or nothing, if none). A connection that
//! breaks ends the run (and is reported); an errno answer is counted and the run goes on.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vdstream_nbd::client::{Client, ClientError, ConnectOptions};

use crate::histogram::Histogram;
use crate::pattern::{self, Ledger, Mismatch};
use crate::result::{round1, BenchResult, Interval, OpFigures, VerifyFigures};
use crate::workload::{OpStream, Workload, WorkloadError};
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
        RunOptions { interval: Duration::from_secs(1), seed: 0x5644_5354_5245_414d }
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

const KEEP: usize = 20;

/// State every request task shares.
#[derive(Debug)]
struct Shared {
    block_size: u32,
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
    fn error(&self, message: String) {
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
}

/// What one request task measured.
#[derive(Debug, Default)]
struct TaskFigures {
    read: Histogram,
    write: Histogram,
}

/// Runs `workload` against the export at `uri` (`nbd+unix:///NAME?socket=PATH`,
/// `nbd://HOST:PORT/NAME`), calling `progress` once per interval. Blocks until the run is
/// over; builds its own runtime.
pub fn run(uri: &str, workload: &Workload, opts: &RunOptions, progress: &mut dyn FnMut(&Progress)) -> Result<BenchResult, BenchError> {
    // At least two runtime threads, even on one CPU: with one, the connections' reader
    // tasks fell behind the request tasks (measured pinned to one CPU against nbdkit
    // memory: 6-18k IOPS and a p99 of 20-250 ms, against 39-58k with two threads).
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 8);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name("vdstream-bench")
        .enable_all()
        .build()
        .map_err(BenchError::Runtime)?;
    rt.block_on(run_async(uri, workload, opts, progress))
}

/// Waits until `uri` answers an NBD handshake (a server that is starting), at most
/// `timeout`; returns the export's size. The last connection error on timeout.
pub fn wait_ready(uri: &str, timeout: Duration) -> Result<u64, BenchError> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(BenchError::Runtime)?;
    rt.block_on(async {
        let deadline = Instant::now() + timeout;
        loop {
            match connect(uri).await {
                Ok(client) => {
                    let size = client.size();
                    let _ = client.disconnect().await;
                    return Ok(size);
                }
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    })
}

async fn connect(uri: &str) -> Result<Client, BenchError> {
    // No allocation map or structured replies needed: plain reads, like fio's engine.
    let opts = ConnectOptions { structured_replies: true, base_allocation: false, ..ConnectOptions::default() };
    Client::connect_uri(uri, opts).await.map_err(|cause| {
        let hint = match cause {
            ClientError::Address { .. } => "give nbd+unix:///NAME?socket=PATH or nbd://HOST:PORT/NAME",
            ClientError::Connect { .. } | ClientError::ConnectTimeout { .. } => "is an NBD server listening there?",
            _ => "is it an NBD server, and does it have that export?",
        };
        BenchError::Connect { uri: uri.to_string(), cause: Box::new(cause), hint }
    })
}

async fn run_async(
    uri: &str,
    workload: &Workload,
    opts: &RunOptions,
    progress: &mut dyn FnMut(&Progress),
) -> Result<BenchResult, BenchError> {
    let mut clients = Vec::new();
    for _ in 0..workload.workers.max(1) {
        clients.push(Arc::new(connect(uri).await?));
    }
    let export_size = clients[0].size();
    let blocks = workload.blocks(export_size).map_err(|cause: WorkloadError| BenchError::Workload { uri: uri.to_string(), cause })?;
    if workload.write_pct > 0 && clients[0].read_only() {
        return Err(BenchError::ReadOnly { uri: uri.to_string() });
    }
    let shared = Arc::new(Shared {
        block_size: workload.block_size,
        ledger: workload.verify.then(|| Ledger::new(blocks)),
        counters: Counters::default(),
        stop: AtomicBool::new(false),
        errors: AtomicU64::new(0),
        error_messages: Mutex::new(Vec::new()),
        checked_reads: AtomicU64::new(0),
        mismatches: AtomicU64::new(0),
        first_mismatches: Mutex::new(Vec::new()),
    });

    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (w, client) in clients.iter().enumerate() {
        let stream = Arc::new(Mutex::new(OpStream::new(workload, blocks, w as u32, opts.seed)));
        for _ in 0..workload.queue_depth {
            tasks.spawn(request_loop(client.clone(), stream.clone(), shared.clone()));
        }
    }

    // Sample the counters every interval until the duration is over.
    let mut series = Vec::new();
    let mut prev = Snapshot::default();
    let mut prev_t = Duration::ZERO;
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + opts.interval, opts.interval);
    loop {
        let remaining = workload.duration.saturating_sub(start.elapsed());
        let broken = shared.stop.load(Relaxed);
        let stopping = remaining < opts.interval.mul_f64(0.5) || broken;
        if stopping {
            if !broken {
                tokio::time::sleep(remaining).await;
            }
            shared.stop.store(true, Relaxed);
        } else {
            tick.tick().await;
        }
        let now = start.elapsed();
        let snap = shared.counters.snapshot();
        let interval = interval_between(&prev, &snap, (now - prev_t).as_secs_f64(), now.as_secs_f64());
        if (now - prev_t) >= opts.interval.mul_f64(0.25) {
            series.push(interval);
            progress(&Progress { elapsed: now, duration: workload.duration, interval });
        }
        prev = snap;
        prev_t = now;
        if stopping {
            break;
        }
    }

    let mut figures = TaskFigures::default();
    while let Some(joined) = tasks.join_next().await {
        let f = joined.map_err(|e| BenchError::Task(e.to_string()))?;
        figures.read.merge(&f.read);
        figures.write.merge(&f.write);
    }
    let elapsed = start.elapsed().as_secs_f64();
    for c in &clients {
        let _ = c.disconnect().await;
    }

    let snap = shared.counters.snapshot();
    let mut both = figures.read.clone();
    both.merge(&figures.write);
    let verify = shared.ledger.as_ref().map(|_| VerifyFigures {
        checked_reads: shared.checked_reads.load(Relaxed),
        mismatches: shared.mismatches.load(Relaxed),
        first: shared.first_mismatches.lock().expect("mismatch list lock").clone(),
    });
    let error_messages = shared.error_messages.lock().expect("error list lock").clone();
    Ok(BenchResult {
        uri: uri.to_string(),
        export_size,
        working_set: blocks * u64::from(workload.block_size),
        workload: workload.clone(),
        elapsed_secs: (elapsed * 100.0).round() / 100.0,
        total: OpFigures::from_histogram(&both, snap.read_bytes + snap.write_bytes, elapsed),
        read: OpFigures::from_histogram(&figures.read, snap.read_bytes, elapsed),
        write: OpFigures::from_histogram(&figures.write, snap.write_bytes, elapsed),
        errors: shared.errors.load(Relaxed),
        error_messages,
        verify,
        series,
    })
}

fn interval_between(a: &Snapshot, b: &Snapshot, secs: f64, t_secs: f64) -> Interval {
    let rate = |x: u64, y: u64| if secs > 0.0 { round1((y - x) as f64 / secs) } else { 0.0 };
    let mib = |x: u64, y: u64| if secs > 0.0 { round1((y - x) as f64 / secs / f64::from(1 << 20)) } else { 0.0 };
    let ops = (b.read_ops + b.write_ops) - (a.read_ops + a.write_ops);
    let mean_latency_us = if ops > 0 { round1((b.latency_ns - a.latency_ns) as f64 / ops as f64 / 1000.0) } else { 0.0 };
    Interval {
        t_secs: (t_secs * 100.0).round() / 100.0,
        read_iops: rate(a.read_ops, b.read_ops),
        write_iops: rate(a.write_ops, b.write_ops),
        read_mib_per_sec: mib(a.read_bytes, b.read_bytes),
        write_mib_per_sec: mib(a.write_bytes, b.write_bytes),
        mean_latency_us,
    }
}

/// Picks the next operation; with a ledger, holds its block (stepping past held blocks)
/// and returns the block's last acknowledged generation.
async fn next_op(stream: &Mutex<OpStream>, ledger: Option<&Ledger>) -> (bool, u64, u32) {
    loop {
        if let Some(op) = try_next_op(stream, ledger) {
            return op;
        }
        tokio::task::yield_now().await;
    }
}

/// One try of [`next_op`]: `None` when every block it stepped to was held.
fn try_next_op(stream: &Mutex<OpStream>, ledger: Option<&Ledger>) -> Option<(bool, u64, u32)> {
    let mut s = stream.lock().expect("op stream lock");
    let op = s.next_op();
    let Some(ledger) = ledger else { return Some((op.write, op.block, 0)) };
    let mut block = op.block;
    for attempt in 0..8 {
        if let Some(generation) = ledger.try_hold(block) {
            return Some((op.write, block, generation));
        }
        block = if attempt % 2 == 0 { s.random_block() } else { s.skip(block) };
    }
    None
}

async fn request_loop(client: Arc<Client>, stream: Arc<Mutex<OpStream>>, shared: Arc<Shared>) -> TaskFigures {
    let bs = shared.block_size as usize;
    let mut figures = TaskFigures::default();
    let mut buf = vec![0u8; bs];
    // Without --verify every write carries the same stamped block (generation 0).
    pattern::fill(&mut buf, 0, 0);
    let ledger = shared.ledger.as_ref();
    while !shared.stop.load(Relaxed) {
        let (write, block, generation) = next_op(&stream, ledger).await;
        let offset = block * bs as u64;
        let c = &shared.counters;
        if write {
            let new_gen = pattern::next_generation(generation);
            if ledger.is_some() {
                pattern::fill(&mut buf, offset, new_gen);
            }
            let t0 = Instant::now();
            let result = client.write(offset, &buf, false).await;
            let ns = t0.elapsed().as_nanos() as u64;
            match result {
                Ok(()) => {
                    figures.write.record(ns);
                    c.write_ops.fetch_add(1, Relaxed);
                    c.write_bytes.fetch_add(bs as u64, Relaxed);
                    c.latency_ns.fetch_add(ns, Relaxed);
                    if let Some(l) = ledger {
                        l.release(block, new_gen);
                    }
                }
                Err(e) => {
                    if let Some(l) = ledger {
                        l.release(block, 0);
                    }
                    failed(&shared, e);
                }
            }
        } else {
            let t0 = Instant::now();
            let result = client.read_buf(offset, std::mem::take(&mut buf)).await;
            let ns = t0.elapsed().as_nanos() as u64;
            match result {
                Ok(data) => {
                    buf = data;
                    figures.read.record(ns);
                    c.read_ops.fetch_add(1, Relaxed);
                    c.read_bytes.fetch_add(bs as u64, Relaxed);
                    c.latency_ns.fetch_add(ns, Relaxed);
                    if let Some(l) = ledger {
                        if generation != 0 {
                            shared.checked_reads.fetch_add(1, Relaxed);
                            if let Some(m) = pattern::check(&buf, offset, generation) {
                                shared.mismatch(m);
                            }
                        }
                        l.release(block, generation);
                    }
                }
                Err(e) => {
                    buf = vec![0u8; bs];
                    if let Some(l) = ledger {
                        l.release(block, generation);
                    }
                    failed(&shared, e);
                }
            }
        }
    }
    figures
}

/// Counts a failed request; a broken connection ends the run.
fn failed(shared: &Shared, e: ClientError) {
    let fatal = matches!(e, ClientError::Disconnected { .. } | ClientError::Timeout { .. });
    shared.error(e.to_string());
    if fatal {
        shared.stop.store(true, Relaxed);
    }
}
