//! The transmission phase of one connection: the one request core.
//!
//! Every request of every connection goes through the same steps, the shape of nbdkit's
//! `protocol_recv_request_send_reply`: **parse** a frame from the input buffer, **validate**
//! it once at the edge ([`take`], the only caller of [`validate`]), **execute** it with
//! the connection's executor, and **reply**. The executor ([`Exec`]) is chosen by the device:
//!
//! - **inline** (devices that never sleep, and devices that may sleep while they are fast):
//!   each request runs on the spot, its reply appended to one output buffer (READ data read
//!   in place), which goes out with one write per pass over the input.
//! - **batched** (devices that prefer batches, [`BlockDev::prefers_batches`]: a disk cache
//!   with `O_DIRECT`, the agent's remote base): the reads and writes taken together go to
//!   the device in one [`BlockDev::io_batch`] call (io_uring underneath); another command
//!   ends the batch and runs after the reads and writes taken before it. Up to
//!   `batch_runners` (of [`crate::ServerConfig`]) runners take turns on the read side: the
//!   holder takes a batch (its WRITE payloads copied out of the input), lets go, and runs
//!   it, so the next batch is read and submitted while one is in the device (one
//!   connection carrying many clients' requests, such as the agent's link to the server,
//!   keeps its queue full). With one runner a pass runs as one batch straight from the
//!   input (the agent's local export, where a connection is one guest's queue).
//! - **worker pool** (devices that may sleep, nbdkit's parallel model): the connection's
//!   workers take turns holding the read side; the holder takes one request and runs it
//!   away from the read side, so up to `threads_per_connection` requests run at once and
//!   replies go out in completion order. Workers start as requests need them.
//!
//! All of it runs on blocking threads (one per connection, more for the pool): the kernel
//! wakes a thread straight from the socket, with no event loop between.
//!
//! Invariants: a header is validated before its payload is buffered; a WRITE payload over
//! `MAX_PAYLOAD` or a bad magic ends the connection (never an allocation sized by the
//! wire); a refused WRITE's payload is skipped so the stream stays in sync; the bytes of
//! requests taken and not yet answered on the socket (data plus a fixed overhead each)
//! stay within `max_in_flight_bytes` on every executor, a single larger request running
//! alone; on DISC, drain or EOF no further request is read, every request already read is
//! answered, and the connection closes after its replies are written.

use std::io;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::thread::ScopedJoinHandle;

use vdstream_blockdev::{BatchOp, BlockDev};

use crate::exec::{execute, reply_error, reply_panicked, reply_read, reply_status, Scratch};
use crate::handshake::Negotiated;
use crate::memory::MemoryPool;
use crate::proto::*;
use crate::state::{ServerStats, Shared};
use crate::validate::{validate, Command, ExportParams, Rejection, Request};
use crate::wire::{ReplyBuf, RequestHeader, REQUEST_HEADER_LEN};

/// Write the output buffer once it holds this much, even mid-pass.
const FLUSH_AT: usize = 512 << 10;
/// Budget charged per request on top of its data, so tiny requests are bounded too.
const REQUEST_OVERHEAD: usize = 512;
/// Most reads and writes in one `io_batch` call.
const MAX_BATCH: usize = 64;
/// Below this mean time per request (ns) a device that may sleep counts as fast: the
/// worker holding the read side runs a whole pass inline, like a device that never sleeps,
/// instead of handing one request at a time to the pool.
const FAST_REQUEST_NS: u64 = 20_000;

/// Why a session ended abnormally.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
    #[error("protocol violation, connection closed: {0}")]
    Protocol(&'static str),
}

/// The request input buffer: bytes read from the socket, consumed frame by frame.
struct Input {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    default_size: usize,
    /// What growing `buf` past `default_size` for a large WRITE charged to the server's
    /// memory pool (given back when it shrinks again, or when the session ends).
    grown: usize,
}

/// One complete request: its header and where its payload sits in the input buffer.
struct Frame {
    header: RequestHeader,
    payload: Range<usize>,
}

impl Input {
    fn new(size: usize) -> Input {
        let size = size.max(64 << 10);
        Input {
            buf: vec![0; size],
            start: 0,
            end: 0,
            default_size: size,
            grown: 0,
        }
    }

    /// The next complete request, if the buffer holds one. Checks magic and payload size
    /// as soon as the header is in, before waiting for (or making room for) a payload.
    fn next_frame(&mut self) -> Result<Option<Frame>, SessionError> {
        let avail = &self.buf[self.start..self.end];
        let Some(header) = RequestHeader::parse(avail) else {
            return Ok(None);
        };
        if header.magic != REQUEST_MAGIC {
            return Err(SessionError::Protocol(
                "bad request magic: the stream is out of sync",
            ));
        }
        let payload_len = header.payload_len();
        if payload_len > MAX_PAYLOAD {
            return Err(SessionError::Protocol(
                "WRITE payload larger than the 32 MiB maximum block size",
            ));
        }
        let total = REQUEST_HEADER_LEN + payload_len as usize;
        if avail.len() < total {
            // A WRITE larger than the buffer gets room in `fill`, charged first.
            return Ok(None);
        }
        let payload_start = self.start + REQUEST_HEADER_LEN;
        self.start += total;
        Ok(Some(Frame {
            header,
            payload: payload_start..self.start,
        }))
    }

    /// What the next request will hold while in flight (its READ or WRITE data and
    /// [`REQUEST_OVERHEAD`]), once its header is in. Reckoned before validation, so a
    /// request that will be refused is charged as if it ran.
    fn next_cost(&self) -> Option<usize> {
        let h = RequestHeader::parse(&self.buf[self.start..self.end])?;
        let data = if h.command == CMD_READ {
            h.length
        } else {
            h.payload_len()
        };
        Some(REQUEST_OVERHEAD + data.min(MAX_PAYLOAD) as usize)
    }

    /// The whole size (header and payload) of the next request, once its header is in and
    /// valid.
    fn next_total(&self) -> Option<usize> {
        RequestHeader::parse(&self.buf[self.start..self.end])
            .filter(|h| h.magic == REQUEST_MAGIC && h.payload_len() <= MAX_PAYLOAD)
            .map(|h| REQUEST_HEADER_LEN + h.payload_len() as usize)
    }

    /// Whether the next request is larger than the buffer, so that taking it would move the
    /// bytes of requests already taken (the batched executor runs its batch first).
    fn needs_room(&self) -> bool {
        RequestHeader::parse(&self.buf[self.start..self.end]).is_some_and(|h| {
            h.magic == REQUEST_MAGIC
                && h.payload_len() <= MAX_PAYLOAD
                && REQUEST_HEADER_LEN + h.payload_len() as usize > self.buf.len()
        })
    }

    fn compact(&mut self) {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
    }

    /// Reads more bytes; 0 means EOF. A WRITE larger than the buffer (its header validated:
    /// at most `MAX_PAYLOAD`) makes it grow to hold the whole request, the growth charged to
    /// `budget`'s memory pool first (waiting there when the server holds too much).
    fn fill<R: io::Read>(&mut self, r: &mut R, budget: &Budget) -> io::Result<usize> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            if self.buf.len() > self.default_size {
                self.buf = vec![0; self.default_size];
                budget.pool.release(std::mem::take(&mut self.grown));
            }
        } else if self.end == self.buf.len() {
            self.compact();
        }
        if let Some(total) = self.next_total().filter(|&t| t > self.buf.len()) {
            self.compact();
            self.grown += budget.pool.acquire(budget.held(), total - self.buf.len());
            self.buf.resize(total, 0);
        }
        let n = r.read(&mut self.buf[self.end..])?;
        self.end += n;
        Ok(n)
    }
}

/// Counters kept locally and added to the shared stats once per pass.
#[derive(Default)]
struct Tally {
    requests: u64,
    errors: u64,
    bytes_read: u64,
    bytes_written: u64,
}

impl Tally {
    fn publish(&mut self, stats: &ServerStats) {
        if self.requests | self.bytes_read | self.bytes_written != 0 {
            stats.requests.fetch_add(self.requests, Ordering::Relaxed);
            stats
                .request_errors
                .fetch_add(self.errors, Ordering::Relaxed);
            stats
                .bytes_read
                .fetch_add(self.bytes_read, Ordering::Relaxed);
            stats
                .bytes_written
                .fetch_add(self.bytes_written, Ordering::Relaxed);
            *self = Tally::default();
        }
    }
}

/// What the edge made of the next request in the input.
enum Took {
    /// A valid request to execute, and where its payload sits in the input buffer.
    Run(Request, Range<usize>),
    /// Refused; its error reply is already in the output.
    Refused,
    NeedInput,
    /// DISC, or a protocol violation.
    Stop(Step),
}

/// The edge: parses and validates the next request (the one place requests are validated)
/// and answers a refused one into `out` at once.
fn take(input: &mut Input, x: &ExportParams, tally: &mut Tally, out: &mut ReplyBuf) -> Took {
    let frame = match input.next_frame() {
        Ok(Some(f)) => f,
        Ok(None) => return Took::NeedInput,
        Err(e) => return Took::Stop(Step::Failed(e)),
    };
    tally.requests += 1;
    match validate(&frame.header, x) {
        Ok(req) if req.command == Command::Disconnect => Took::Stop(Step::Disconnect),
        Ok(req) => {
            match req.command {
                Command::Read { .. } => tally.bytes_read += req.length as u64,
                Command::Write { .. } => tally.bytes_written += req.length as u64,
                _ => {}
            }
            Took::Run(req, frame.payload)
        }
        Err(Rejection::Error { errno, reason }) => {
            tally.errors += 1;
            reply_error(out, x, frame.header.handle, errno, reason, None);
            Took::Refused
        }
        Err(Rejection::Disconnect(reason)) => {
            Took::Stop(Step::Failed(SessionError::Protocol(reason)))
        }
    }
}

/// How one pass over the input buffer ended.
enum Step {
    /// Every complete request was handled; read more input.
    NeedInput,
    /// The output buffer is full, or the budget is spent: write it, then call again.
    OutputFull,
    /// The client sent DISC.
    Disconnect,
    Failed(SessionError),
}

/// How requests run once taken.
enum Exec {
    Inline,
    Batched(Batch),
}

/// The reads and writes taken from the input buffer and not run yet.
#[derive(Default)]
struct Batch {
    /// Each request, and where its WRITE payload sits in the input buffer.
    pending: Vec<(Request, Range<usize>)>,
    /// The READ data of a batch, back to back.
    data: Vec<u8>,
}

impl Exec {
    /// Runs `req` now (inline), or queues it for the next `io_batch` (batched reads and
    /// writes); its reply is in `out` after [`Exec::finish`] at the latest.
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &mut self,
        dev: &dyn BlockDev,
        x: &ExportParams,
        req: Request,
        payload: Range<usize>,
        input: &[u8],
        out: &mut ReplyBuf,
        scratch: &mut Scratch,
        tally: &mut Tally,
    ) {
        match self {
            Exec::Batched(b)
                if matches!(req.command, Command::Read { .. } | Command::Write { .. }) =>
            {
                b.pending.push((req, payload))
            }
            _ => {
                // Other commands run after the reads and writes taken before them.
                self.finish(dev, x, input, out, tally);
                if !execute(dev, x, &req, &input[payload], out, scratch) {
                    tally.errors += 1;
                }
            }
        }
    }

    fn is_full(&self) -> bool {
        matches!(self, Exec::Batched(b) if b.pending.len() >= MAX_BATCH)
    }

    /// Runs whatever is queued with one `io_batch` call and appends the replies.
    fn finish(
        &mut self,
        dev: &dyn BlockDev,
        x: &ExportParams,
        input: &[u8],
        out: &mut ReplyBuf,
        tally: &mut Tally,
    ) {
        let Exec::Batched(batch) = self else { return };
        if batch.pending.is_empty() {
            return;
        }
        let read_bytes: usize = batch
            .pending
            .iter()
            .filter(|(r, _)| matches!(r.command, Command::Read { .. }))
            .map(|(r, _)| r.length as usize)
            .sum();
        batch.data.clear();
        batch.data.resize(read_bytes, 0);
        let mut ops = Vec::with_capacity(batch.pending.len());
        let mut rest = &mut batch.data[..];
        for (req, payload) in &batch.pending {
            match req.command {
                Command::Write { fua } => {
                    ops.push(BatchOp::write(&input[payload.clone()], req.offset, fua))
                }
                _ => {
                    let (mine, tail) = std::mem::take(&mut rest).split_at_mut(req.length as usize);
                    rest = tail;
                    ops.push(BatchOp::read(mine, req.offset));
                }
            }
        }
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| dev.io_batch(&mut ops)));
        let mut results = ran.ok().map(|()| {
            ops.into_iter()
                .map(|op| (op.result, op.holes))
                .collect::<Vec<_>>()
                .into_iter()
        });
        if results.is_none() {
            log::error!(
                "device {} panicked on a batch of {} requests; answered EIO",
                dev.describe(),
                batch.pending.len()
            );
        }
        let mut at = 0usize;
        for (req, _) in &batch.pending {
            let data = if matches!(req.command, Command::Read { .. }) {
                &batch.data[at..at + req.length as usize]
            } else {
                &[][..]
            };
            at += data.len();
            let ok = match results.as_mut().and_then(Iterator::next) {
                None => {
                    reply_panicked(out, x, req);
                    false
                }
                Some((result, mut holes)) if matches!(req.command, Command::Read { .. }) => {
                    reply_read(out, x, req, result, data, &mut holes)
                }
                Some((result, _)) => reply_status(out, x, req, result),
            };
            if !ok {
                tally.errors += 1;
            }
        }
        batch.pending.clear();
        if batch.data.capacity() > 4 << 20 {
            batch.data = Vec::new();
        }
    }
}

/// One pass of the core: takes complete requests from `input` and executes them, their
/// replies appended to `out`, until the input runs dry, the output fills, or the next
/// request does not fit in `budget` now (the first request of a pass waits until it fits:
/// in the connection's budget, then in the server's memory pool). Returns how the pass
/// ended and what it charged to `budget`, which the caller gives back once the replies
/// are written.
///
/// With `pace`, each request is timed there, and the pass ends after a request slower
/// than [`FAST_REQUEST_NS`], so that the pool can hand the rest out to its workers.
#[allow(clippy::too_many_arguments)]
fn process(
    input: &mut Input,
    exec: &mut Exec,
    dev: &dyn BlockDev,
    x: &ExportParams,
    out: &mut ReplyBuf,
    scratch: &mut Scratch,
    tally: &mut Tally,
    budget: &Budget,
    pace: Option<&Pace>,
) -> (Step, usize) {
    let mut held = 0usize;
    let step = loop {
        let Some(cost) = input.next_cost() else {
            break Step::NeedInput;
        };
        let charge = if held == 0 {
            budget.acquire(cost)
        } else {
            match budget.try_acquire(cost) {
                Some(n) => n,
                None => break Step::OutputFull,
            }
        };
        held += charge;
        if input.needs_room() {
            exec.finish(dev, x, &input.buf, out, tally);
        }
        let started = pace.map(|_| std::time::Instant::now());
        match take(input, x, tally, out) {
            Took::Run(req, payload) => {
                exec.submit(dev, x, req, payload, &input.buf, out, scratch, tally)
            }
            Took::Refused => {}
            Took::NeedInput => {
                // Its payload is still on its way: charged again when it is taken.
                budget.release(charge);
                held -= charge;
                break Step::NeedInput;
            }
            Took::Stop(step) => break step,
        }
        if exec.is_full() {
            exec.finish(dev, x, &input.buf, out, tally);
        }
        if let (Some(pace), Some(started)) = (pace, started) {
            if pace.record(started.elapsed()) > FAST_REQUEST_NS {
                break Step::OutputFull;
            }
        }
        if out.len() >= FLUSH_AT {
            break Step::OutputFull;
        }
    };
    // Whatever ends the pass, the reads and writes taken so far are answered first.
    exec.finish(dev, x, &input.buf, out, tally);
    (step, held)
}

/// Runs the transmission phase on a blocking socket (`reader` and `writer` are handles on
/// it) until DISC, end of file (a drain shuts the read side), an error or a protocol
/// violation. The executor follows the device (see the module docs).
pub fn run<R, W>(
    reader: R,
    writer: W,
    negotiated: Negotiated,
    shared: &Shared,
) -> Result<(), SessionError>
where
    R: io::Read + Send,
    W: io::Write + Send,
{
    let dev: &dyn BlockDev = &*negotiated.device;
    let batched = dev.prefers_batches();
    let threads = shared.config.threads_per_connection.max(1);
    let workers = if batched {
        threads.min(shared.config.batch_runners.max(1))
    } else if dev.caps().may_block {
        threads
    } else {
        1
    };
    let conn = Conn {
        read_side: Mutex::new(ReadSide {
            sock: reader,
            input: Input::new(shared.config.read_buffer_size),
            exec: if batched {
                Exec::Batched(Batch::default())
            } else {
                Exec::Inline
            },
            done: false,
            result: Ok(()),
            tally: Tally::default(),
        }),
        write_side: Mutex::new(WriteSide {
            sock: writer,
            failed: None,
        }),
        budget: Budget::new(shared.config.max_in_flight_bytes, &shared.memory),
        pace: Pace::default(),
        crew: Crew {
            max: workers,
            spawned: AtomicUsize::new(1),
            at_door: AtomicUsize::new(0),
        },
        dev,
        x: negotiated.params,
        shared,
        batched,
    };
    std::thread::scope(|scope| worker(scope, &conn));
    let Conn {
        read_side,
        write_side,
        ..
    } = conn;
    let mut rs = read_side.into_inner().unwrap_or_else(|p| p.into_inner());
    rs.tally.publish(&shared.stats);
    shared.memory.release(std::mem::take(&mut rs.input.grown));
    match write_side
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .failed
    {
        Some(e) => Err(e.into()),
        None => rs.result,
    }
}

/// Bytes of requests taken and not yet answered on the socket, over all of a
/// connection's workers; a taker waits until its request fits, in this connection's
/// budget and then in the server's [`MemoryPool`] (where connections that hold more wait
/// first).
struct Budget<'a> {
    max: usize,
    used: Mutex<usize>,
    freed: Condvar,
    pool: &'a MemoryPool,
}

impl<'a> Budget<'a> {
    fn new(max: usize, pool: &'a MemoryPool) -> Budget<'a> {
        Budget {
            max: max.max(REQUEST_OVERHEAD),
            used: Mutex::new(0),
            freed: Condvar::new(),
            pool,
        }
    }

    /// What the connection holds now.
    fn held(&self) -> usize {
        *self.used.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until `n` more bytes fit (a request over the whole budget waits until it is
    /// alone); returns what was charged.
    fn acquire(&self, n: usize) -> usize {
        let n = n.min(self.max);
        let held = {
            let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
            while *used + n > self.max {
                used = self.freed.wait(used).unwrap_or_else(|p| p.into_inner());
            }
            *used += n;
            *used - n
        };
        self.pool.acquire(held, n)
    }

    /// Charges `n` bytes if they fit now, without waiting; the charge, or `None`.
    fn try_acquire(&self, n: usize) -> Option<usize> {
        let n = n.min(self.max);
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        if *used + n > self.max {
            return None;
        }
        let charged = self.pool.try_acquire(*used, n)?;
        *used += charged;
        Some(charged)
    }

    fn release(&self, n: usize) {
        if n == 0 {
            return;
        }
        *self.used.lock().unwrap_or_else(|p| p.into_inner()) -= n;
        self.freed.notify_all();
        self.pool.release(n);
    }
}

/// The workers of one connection: started one at a time as requests need them, up to `max`.
/// An idle connection holds one thread (blocked reading the socket), not `max`.
struct Crew {
    max: usize,
    spawned: AtomicUsize,
    /// Workers waiting to take the read side.
    at_door: AtomicUsize,
}

/// The recent mean execution time per request, an exponentially weighted average (1/8 new)
/// that every worker updates; approximate under races, which is all it needs to be.
#[derive(Default)]
struct Pace(AtomicU64);

impl Pace {
    fn is_fast(&self) -> bool {
        self.0.load(Ordering::Relaxed) < FAST_REQUEST_NS
    }

    /// Records one request's time; returns that time in ns.
    fn record(&self, elapsed: std::time::Duration) -> u64 {
        let ns = (elapsed.as_nanos() as u64).min(1 << 40);
        let old = self.0.load(Ordering::Relaxed);
        self.0.store(old - old / 8 + ns / 8, Ordering::Relaxed);
        ns
    }
}

/// What every worker of a connection shares.
struct Conn<'a, R, W> {
    read_side: Mutex<ReadSide<R>>,
    write_side: Mutex<WriteSide<W>>,
    budget: Budget<'a>,
    pace: Pace,
    crew: Crew,
    dev: &'a dyn BlockDev,
    x: ExportParams,
    shared: &'a Shared,
    /// The device prefers batches: several workers are batch runners.
    batched: bool,
}

struct ReadSide<R> {
    sock: R,
    input: Input,
    exec: Exec,
    /// No further request is taken (DISC, EOF, drain, error).
    done: bool,
    result: Result<(), SessionError>,
    tally: Tally,
}

impl<R: io::Read> ReadSide<R> {
    /// Reads more input; at end of file or on an error, no further request is taken.
    fn fill(&mut self, stats: &ServerStats, budget: &Budget) {
        self.tally.publish(stats);
        match self.input.fill(&mut self.sock, budget) {
            Ok(0) => self.done = true,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => self.stop(Step::Failed(e.into())),
        }
    }

    fn stop(&mut self, step: Step) {
        self.done = true;
        if let Step::Failed(e) = step {
            self.result = Err(e);
        }
    }
}

struct WriteSide<W> {
    sock: W,
    failed: Option<io::Error>,
}

impl<'a, R: io::Read + Send, W: io::Write + Send> Conn<'a, R, W> {
    /// Starts one more worker if no worker is waiting to read the next request and the
    /// connection has fewer than `max`, and returns it for its starter to join. A thread
    /// the system refuses is not an error: the requests wait for the workers there are.
    fn grow<'scope>(
        &'a self,
        scope: &'scope std::thread::Scope<'scope, 'a>,
    ) -> Option<ScopedJoinHandle<'scope, ()>> {
        let crew = &self.crew;
        if crew.at_door.load(Ordering::Acquire) > 0 {
            return None;
        }
        if crew
            .spawned
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < crew.max).then_some(n + 1)
            })
            .is_err()
        {
            return None;
        }
        match std::thread::Builder::new()
            .name("nbd-worker".into())
            .spawn_scoped(scope, move || worker(scope, self))
        {
            Ok(h) => Some(h),
            Err(e) => {
                crew.spawned.fetch_sub(1, Ordering::AcqRel);
                log::debug!("cannot start another worker for a connection ({e}); its requests wait for the ones it has");
                None
            }
        }
    }

    /// Takes the read side, counted "at the door" while it waits, so that [`Conn::grow`]
    /// starts no worker while one is already waiting to read.
    fn enter_read_side(&self) -> std::sync::MutexGuard<'_, ReadSide<R>> {
        self.crew.at_door.fetch_add(1, Ordering::AcqRel);
        let guard = self.read_side.lock().unwrap_or_else(|p| p.into_inner());
        self.crew.at_door.fetch_sub(1, Ordering::AcqRel);
        guard
    }

    /// Writes `out` under the write side's lock and empties it; false once the socket failed.
    fn send(&self, out: &mut ReplyBuf) -> bool {
        if out.is_empty() {
            return true;
        }
        let mut ws = self.write_side.lock().unwrap_or_else(|p| p.into_inner());
        if ws.failed.is_some() {
            return false;
        }
        if let Err(e) = ws.sock.write_all(out.as_slice()) {
            ws.failed = Some(e);
            return false;
        }
        drop(ws);
        out.clear();
        out.shrink_to(1 << 20);
        true
    }
}

/// The workers a worker started, joined when it returns (after its read-side lock is let
/// go): an explicit join waits for a thread's whole exit, its thread-local destructors
/// included, where the scope's implicit join does not (rust-lang/rust#116179), so no thread
/// of a connection outlives [`run`].
struct Children<'scope>(Vec<ScopedJoinHandle<'scope, ()>>);

impl Drop for Children<'_> {
    fn drop(&mut self) {
        // A worker's panic goes on up, as the scope's own join would carry it.
        let panics: Vec<_> = self.0.drain(..).filter_map(|h| h.join().err()).collect();
        if let Some(p) = panics
            .into_iter()
            .next()
            .filter(|_| !std::thread::panicking())
        {
            std::panic::resume_unwind(p);
        }
    }
}

/// A worker of a connection (the first one is the session thread). Holding the read side,
/// it runs whole passes of the core while the device is fast, or is the connection's only
/// worker; once a pool's requests turn slow (a cache waiting on its disk) it takes one
/// request and runs it away from the read side, so others keep running while one waits.
fn worker<'scope, 'a, R: io::Read + Send, W: io::Write + Send>(
    scope: &'scope std::thread::Scope<'scope, 'a>,
    c: &'a Conn<'a, R, W>,
) {
    let stats = &c.shared.stats;
    stats.workers.fetch_add(1, Ordering::Relaxed);
    struct Leaving<'s>(&'s ServerStats);
    impl Drop for Leaving<'_> {
        fn drop(&mut self) {
            self.0.workers.fetch_sub(1, Ordering::Relaxed);
        }
    }
    let _leaving = Leaving(stats);
    let mut children = Children(Vec::new());
    let alone = c.crew.max == 1;
    if c.batched && !alone {
        return batch_runner(scope, c, &mut children);
    }
    let mut payload = Vec::new();
    let mut out = ReplyBuf::with_capacity(64 << 10);
    let mut scratch = Scratch::default();
    loop {
        let (req, charged) = {
            let mut guard = c.enter_read_side();
            let rs = &mut *guard;
            loop {
                if rs.done {
                    return;
                }
                if alone || c.pace.is_fast() {
                    // The replies go out while this worker still holds the read side: it
                    // is the connection's one runner for the pass, with no hand-off.
                    let pace = (!alone).then_some(&c.pace);
                    let (step, charged) = process(
                        &mut rs.input,
                        &mut rs.exec,
                        c.dev,
                        &c.x,
                        &mut out,
                        &mut scratch,
                        &mut rs.tally,
                        &c.budget,
                        pace,
                    );
                    let answered = !out.is_empty();
                    let sent = c.send(&mut out);
                    c.budget.release(charged);
                    match step {
                        _ if !sent => return rs.stop(Step::Disconnect),
                        Step::NeedInput if !answered => rs.fill(stats, &c.budget),
                        Step::NeedInput | Step::OutputFull => {}
                        stop => return rs.stop(stop),
                    }
                    continue;
                }
                let Some(cost) = rs.input.next_cost() else {
                    rs.fill(stats, &c.budget);
                    continue;
                };
                let charged = c.budget.acquire(cost);
                match take(&mut rs.input, &c.x, &mut rs.tally, &mut out) {
                    Took::Run(req, range) => {
                        payload.clear();
                        payload.extend_from_slice(&rs.input.buf[range]);
                        break (req, charged);
                    }
                    took => {
                        c.budget.release(charged);
                        if !c.send(&mut out) {
                            return rs.stop(Step::Disconnect);
                        }
                        match took {
                            Took::NeedInput => rs.fill(stats, &c.budget),
                            Took::Stop(stop) => return rs.stop(stop),
                            _ => {}
                        }
                    }
                }
            }
        };
        // This request runs away from the read side: make sure someone reads on.
        children.0.extend(c.grow(scope));
        let started = std::time::Instant::now();
        if !execute(c.dev, &c.x, &req, &payload, &mut out, &mut scratch) {
            stats.request_errors.fetch_add(1, Ordering::Relaxed);
        }
        c.pace.record(started.elapsed());
        let sent = c.send(&mut out);
        c.budget.release(charged);
        if payload.capacity() > 4 << 20 {
            payload = Vec::new();
        }
        if !sent {
            return;
        }
    }
}

/// A batch runner of a connection whose device prefers batches (the first one is the
/// session thread; more start as batches need them, up to `batch_runners` of
/// [`crate::ServerConfig`]). Holding the read side, it takes a batch: the complete reads
/// and writes in the input, at most [`MAX_BATCH`], their WRITE payloads copied into its own
/// buffer. It waits for room in the budget only while it holds none (so never for itself);
/// later requests join only while they fit. Another command ends the batch and runs after
/// it. The runner then lets go of the read side, so that another runner reads on, runs the
/// batch with one [`BlockDev::io_batch`] call and writes the replies. Refused requests are
/// answered as they are taken.
fn batch_runner<'scope, 'a, R: io::Read + Send, W: io::Write + Send>(
    scope: &'scope std::thread::Scope<'scope, 'a>,
    c: &'a Conn<'a, R, W>,
    children: &mut Children<'scope>,
) {
    let stats = &c.shared.stats;
    let mut exec = Exec::Batched(Batch::default());
    let mut payload = Vec::new();
    let mut out = ReplyBuf::with_capacity(64 << 10);
    let mut scratch = Scratch::default();
    loop {
        let (last, charged) = {
            let mut guard = c.enter_read_side();
            let rs = &mut *guard;
            loop {
                if rs.done {
                    return;
                }
                payload.clear();
                let (mut charged, mut taken, mut last) = (0usize, 0usize, None);
                let need_input = loop {
                    let Some(cost) = rs.input.next_cost() else {
                        break true;
                    };
                    if charged == 0 {
                        charged += c.budget.acquire(cost);
                    } else if let Some(n) = (taken < MAX_BATCH)
                        .then(|| c.budget.try_acquire(cost))
                        .flatten()
                    {
                        charged += n;
                    } else {
                        break false;
                    }
                    match take(&mut rs.input, &c.x, &mut rs.tally, &mut out) {
                        Took::Run(req, range) => {
                            let at = payload.len();
                            payload.extend_from_slice(&rs.input.buf[range]);
                            taken += 1;
                            if let (
                                Exec::Batched(b),
                                Command::Read { .. } | Command::Write { .. },
                            ) = (&mut exec, req.command)
                            {
                                b.pending.push((req, at..payload.len()));
                            } else {
                                last = Some((req, at..payload.len()));
                                break false;
                            }
                        }
                        Took::Refused => {}
                        Took::NeedInput => {
                            let n = cost.min(c.budget.max);
                            c.budget.release(n);
                            charged -= n;
                            break true;
                        }
                        Took::Stop(step) => {
                            rs.stop(step);
                            break false;
                        }
                    }
                };
                if taken > 0 {
                    break (last, charged);
                }
                // Nothing to run: answer the refused requests, then read on.
                c.budget.release(charged);
                if !c.send(&mut out) {
                    return rs.stop(Step::Disconnect);
                }
                if need_input && !rs.done {
                    rs.fill(stats, &c.budget);
                }
            }
        };
        // This batch runs away from the read side: make sure someone reads on.
        children.0.extend(c.grow(scope));
        let mut tally = Tally::default();
        exec.finish(c.dev, &c.x, &payload, &mut out, &mut tally);
        if let Some((req, range)) = last {
            if !execute(c.dev, &c.x, &req, &payload[range], &mut out, &mut scratch) {
                tally.errors += 1;
            }
        }
        if tally.errors > 0 {
            stats
                .request_errors
                .fetch_add(tally.errors, Ordering::Relaxed);
        }
        let sent = c.send(&mut out);
        c.budget.release(charged);
        if payload.capacity() > 4 << 20 {
            payload = Vec::new();
        }
        if !sent {
            return;
        }
    }
}
