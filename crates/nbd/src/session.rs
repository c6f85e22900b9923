//! The transmission phase of one connection: read requests, validate, execute, reply.
//!
//! Three engines, chosen by the device's `Caps::may_block` and `prefers_batches`:
//!
//! - **inline** (memory devices): the connection task reads the socket into a large
//!   buffer, handles *every* complete request it holds (executing on the spot and
//!   appending each reply to one output buffer, READ data read in place), and writes the
//!   output with one syscall before it waits for more input. Per request: no allocation,
//!   no task switch, no lock of ours.
//! - **batched** (devices that prefer batches, [`BlockDev::prefers_batches`]: a disk cache
//!   with `O_DIRECT`): like inline, but the reads and writes of a pass go to the device in
//!   one [`BlockDev::io_batch`] call, which submits them together (io_uring) and returns
//!   when all are done; one sleep per batch instead of a thread hand-off per request.
//! - **concurrent** (devices that may sleep): the reader dispatches each request to
//!   tokio's blocking pool; replies come back out of order over a channel to a writer that
//!   batches whatever is ready into one write. Payload bytes in flight are bounded by
//!   `max_in_flight_bytes` (the reader waits for budget: backpressure).
//!
//! Invariants: a header is validated before its payload is buffered; a WRITE payload over
//! `MAX_PAYLOAD` or a bad magic ends the connection (never an allocation sized by the
//! wire); a refused WRITE's payload is skipped so the stream stays in sync; on DISC,
//! shutdown or EOF no further request is read, every request already read is answered,
//! and the connection closes after its replies are written.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use vdstream_blockdev::{BatchOp, BlockDev};

use crate::errno::errno_for;
use crate::exec::{execute, reply_error, Scratch};
use crate::handshake::Negotiated;
use crate::proto::*;
use crate::server::{ServerStats, Shared, ShutdownSignal};
use crate::validate::{validate, Command, ExportParams, Rejection, Request};
use crate::wire::{ReplyBuf, RequestHeader, REQUEST_HEADER_LEN};

/// Write the output buffer once it holds this much, even mid-batch.
const FLUSH_AT: usize = 512 << 10;
/// Budget charged per request on top of its payload, so tiny requests are bounded too.
const REQUEST_OVERHEAD: usize = 512;

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
}

/// One complete request: its header and where its payload sits in the input buffer.
struct Frame {
    header: RequestHeader,
    payload: std::ops::Range<usize>,
}

impl Input {
    fn new(size: usize) -> Input {
        let size = size.max(64 << 10);
        Input { buf: vec![0; size], start: 0, end: 0, default_size: size }
    }

    /// The next complete request, if the buffer holds one. Checks magic and payload size
    /// as soon as the header is in, before waiting for (or making room for) a payload.
    fn next_frame(&mut self) -> Result<Option<Frame>, SessionError> {
        let avail = &self.buf[self.start..self.end];
        let Some(header) = RequestHeader::parse(avail) else { return Ok(None) };
        if header.magic != REQUEST_MAGIC {
            return Err(SessionError::Protocol("bad request magic: the stream is out of sync"));
        }
        let payload_len = header.payload_len();
        if payload_len > MAX_PAYLOAD {
            return Err(SessionError::Protocol("WRITE payload larger than the 32 MiB maximum block size"));
        }
        let total = REQUEST_HEADER_LEN + payload_len as usize;
        if avail.len() < total {
            if self.buf.len() < total {
                // A large WRITE: make room for all of it (bounded by MAX_PAYLOAD above).
                self.compact();
                self.buf.resize(total, 0);
            }
            return Ok(None);
        }
        let payload_start = self.start + REQUEST_HEADER_LEN;
        self.start += total;
        Ok(Some(Frame { header, payload: payload_start..self.start }))
    }

    /// Whether the next request is larger than the buffer, so that taking it would move the
    /// bytes of requests already taken (the batched engine runs its batch first).
    fn needs_room(&self) -> bool {
        RequestHeader::parse(&self.buf[self.start..self.end])
            .is_some_and(|h| h.magic == REQUEST_MAGIC && h.payload_len() <= MAX_PAYLOAD && REQUEST_HEADER_LEN + h.payload_len() as usize > self.buf.len())
    }

    fn compact(&mut self) {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
    }

    fn has_partial(&self) -> bool {
        self.end > self.start
    }

    /// Makes room at the end of the buffer for the next read.
    fn make_room(&mut self) {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            if self.buf.len() > self.default_size {
                self.buf = vec![0; self.default_size];
            }
        } else if self.end == self.buf.len() {
            self.compact();
        }
    }

    /// Reads more bytes; 0 means EOF.
    async fn fill<R: AsyncRead + Unpin>(&mut self, r: &mut R) -> io::Result<usize> {
        self.make_room();
        let n = r.read(&mut self.buf[self.end..]).await?;
        self.end += n;
        Ok(n)
    }

    /// Reads more bytes from a blocking stream; 0 means EOF.
    fn fill_blocking<R: std::io::Read>(&mut self, r: &mut R) -> io::Result<usize> {
        self.make_room();
        let n = r.read(&mut self.buf[self.end..])?;
        self.end += n;
        Ok(n)
    }
}

/// Counters kept locally and added to the shared stats once per batch.
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
            stats.request_errors.fetch_add(self.errors, Ordering::Relaxed);
            stats.bytes_read.fetch_add(self.bytes_read, Ordering::Relaxed);
            stats.bytes_written.fetch_add(self.bytes_written, Ordering::Relaxed);
            *self = Tally::default();
        }
    }
}

/// Runs the transmission phase until the client disconnects or shutdown drains it.
pub async fn run<S>(stream: S, negotiated: Negotiated, shared: &Shared, shutdown: ShutdownSignal) -> Result<(), SessionError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    if negotiated.device.caps().may_block {
        run_concurrent(stream, negotiated, shared, shutdown).await
    } else {
        run_inline(stream, negotiated, shared, shutdown).await
    }
}

/// How one pass over the input buffer ended.
enum Step {
    /// Every complete request was handled; read more input.
    NeedInput,
    /// The output buffer is full: write it, then call again.
    OutputFull,
    /// The client sent DISC.
    Disconnect,
    Failed(SessionError),
}

/// The inline engine's core, shared by its async and blocking loops: handles complete
/// requests from `input`, appending replies to `out`, until the input runs dry or the
/// output fills.
///
/// With `pace`, each request is timed and recorded there, and the pass ends (as if the
/// output were full) after a request slower than [`FAST_REQUEST_NS`], so that the threaded
/// engine can hand the rest out to its workers.
fn process(input: &mut Input, dev: &dyn BlockDev, x: &ExportParams, out: &mut ReplyBuf, scratch: &mut Scratch, tally: &mut Tally, pace: Option<&Pace>) -> Step {
    loop {
        let started = pace.map(|_| std::time::Instant::now());
        let frame = match input.next_frame() {
            Ok(Some(f)) => f,
            Ok(None) => return Step::NeedInput,
            Err(e) => return Step::Failed(e),
        };
        let h = frame.header;
        tally.requests += 1;
        match validate(&h, x) {
            Ok(req) if req.command == Command::Disconnect => return Step::Disconnect,
            Ok(req) => {
                if !execute(dev, x, &req, &input.buf[frame.payload], out, scratch) {
                    tally.errors += 1;
                }
                match req.command {
                    Command::Read { .. } => tally.bytes_read += req.length as u64,
                    Command::Write { .. } => tally.bytes_written += req.length as u64,
                    _ => {}
                }
            }
            Err(Rejection::Error { errno, reason }) => {
                tally.errors += 1;
                reply_error(out, x, h.handle, errno, reason, None);
            }
            Err(Rejection::Disconnect(reason)) => return Step::Failed(SessionError::Protocol(reason)),
        }
        if let (Some(pace), Some(started)) = (pace, started) {
            if pace.record(started.elapsed()) > FAST_REQUEST_NS {
                return Step::OutputFull;
            }
        }
        if out.len() >= FLUSH_AT {
            return Step::OutputFull;
        }
    }
}

/// The inline engine over an async stream (in-memory streams of tests and fuzzing).
async fn run_inline<S>(mut stream: S, negotiated: Negotiated, shared: &Shared, mut shutdown: ShutdownSignal) -> Result<(), SessionError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let dev: &dyn BlockDev = &*negotiated.device;
    let x = negotiated.params;
    let mut input = Input::new(shared.config.read_buffer_size);
    let mut out = ReplyBuf::with_capacity(64 << 10);
    let mut scratch = Scratch::default();
    let mut tally = Tally::default();

    let result = 'session: loop {
        match process(&mut input, dev, &x, &mut out, &mut scratch, &mut tally, None) {
            Step::NeedInput => {}
            Step::OutputFull => {
                if let Err(e) = stream.write_all(out.as_slice()).await {
                    break 'session Err(e.into());
                }
                out.clear();
                continue;
            }
            Step::Disconnect => break 'session Ok(()),
            Step::Failed(e) => break 'session Err(e),
        }
        if !out.is_empty() {
            if let Err(e) = stream.write_all(out.as_slice()).await {
                break 'session Err(e.into());
            }
            out.clear();
            out.shrink_to(1 << 20);
        }
        tally.publish(&shared.stats);
        let n = tokio::select! {
            biased;
            _ = shutdown.wait() => break 'session Ok(()),
            r = input.fill(&mut stream) => r,
        };
        match n {
            Ok(0) => {
                if input.has_partial() {
                    log::debug!("client closed the connection in the middle of a request");
                }
                break 'session Ok(());
            }
            Ok(_) => {}
            Err(e) => break 'session Err(e.into()),
        }
    };
    // Whatever was answered before the end still goes out.
    if !out.is_empty() {
        let _ = stream.write_all(out.as_slice()).await;
    }
    tally.publish(&shared.stats);
    let _ = stream.flush().await;
    let _ = stream.shutdown().await;
    result
}

/// The inline engine on a blocking socket, one thread per connection: the kernel wakes
/// this thread straight from the socket, with no event loop between (the fastest path for
/// devices that never sleep). Drain works by shutting down the socket's read side, which
/// makes the blocked read return end-of-file; every request already read is answered.
pub fn run_inline_blocking<S>(stream: S, negotiated: Negotiated, shared: &Shared) -> Result<(), SessionError>
where
    S: std::io::Read + std::io::Write,
{
    let dev: &dyn BlockDev = &*negotiated.device;
    let x = negotiated.params;
    blocking_loop(stream, shared, |input, out, scratch, tally| process(input, dev, &x, out, scratch, tally, None))
}

/// The loop the inline and batched engines share on a blocking socket: `core` handles what
/// the input buffer holds and appends replies; the loop writes them, then reads more, until
/// DISC, end of file, an error, or a protocol violation. What was answered still goes out.
fn blocking_loop<S>(mut stream: S, shared: &Shared, mut core: impl FnMut(&mut Input, &mut ReplyBuf, &mut Scratch, &mut Tally) -> Step) -> Result<(), SessionError>
where
    S: std::io::Read + std::io::Write,
{
    let mut input = Input::new(shared.config.read_buffer_size);
    let mut out = ReplyBuf::with_capacity(64 << 10);
    let mut scratch = Scratch::default();
    let mut tally = Tally::default();

    let result = 'session: loop {
        match core(&mut input, &mut out, &mut scratch, &mut tally) {
            Step::NeedInput => {}
            Step::OutputFull => {
                if let Err(e) = stream.write_all(out.as_slice()) {
                    break 'session Err(e.into());
                }
                out.clear();
                continue;
            }
            Step::Disconnect => break 'session Ok(()),
            Step::Failed(e) => break 'session Err(e),
        }
        if !out.is_empty() {
            if let Err(e) = stream.write_all(out.as_slice()) {
                break 'session Err(e.into());
            }
            out.clear();
            out.shrink_to(1 << 20);
        }
        tally.publish(&shared.stats);
        match input.fill_blocking(&mut stream) {
            Ok(0) => {
                if input.has_partial() {
                    log::debug!("client closed the connection in the middle of a request");
                }
                break 'session Ok(());
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => break 'session Err(e.into()),
        }
    };
    if !out.is_empty() {
        let _ = stream.write_all(out.as_slice());
    }
    tally.publish(&shared.stats);
    let _ = stream.flush();
    result
}

/// Most requests in one batch of the batched engine.
const MAX_BATCH: usize = 64;

/// The batched engine on a blocking socket, one thread per connection, for devices whose
/// I/O is asynchronous underneath ([`BlockDev::prefers_batches`]: a disk cache with
/// `O_DIRECT`): every complete READ and WRITE in the input buffer goes to the device in one
/// [`BlockDev::io_batch`] call, which submits them together and returns when all are done;
/// then their replies go out in one write. Other commands run as in the inline engine,
/// after the reads and writes taken before them. One sleep per batch, where the threaded
/// engine pays a thread hand-off and a sleep per request. Drain works as in the inline
/// engine.
pub fn run_batched_blocking<S>(stream: S, negotiated: Negotiated, shared: &Shared) -> Result<(), SessionError>
where
    S: std::io::Read + std::io::Write,
{
    let dev: &dyn BlockDev = &*negotiated.device;
    let x = negotiated.params;
    let mut batch = Batch::default();
    blocking_loop(stream, shared, |input, out, scratch, tally| process_batched(input, dev, &x, out, scratch, tally, &mut batch))
}

/// The reads and writes taken from the input buffer and not run yet.
#[derive(Default)]
struct Batch {
    /// Each request, and where its WRITE payload sits in the input buffer.
    pending: Vec<(Request, std::ops::Range<usize>)>,
    /// The READ data of a batch, back to back.
    data: Vec<u8>,
}

/// The batched engine's core: like [`process`], with reads and writes collected and run
/// together (see [`run_batched_blocking`]).
fn process_batched(input: &mut Input, dev: &dyn BlockDev, x: &ExportParams, out: &mut ReplyBuf, scratch: &mut Scratch, tally: &mut Tally, batch: &mut Batch) -> Step {
    let step = loop {
        if !batch.pending.is_empty() && (batch.pending.len() >= MAX_BATCH || input.needs_room()) {
            run_batch(batch, &input.buf, dev, x, out, tally);
        }
        if out.len() >= FLUSH_AT {
            break Step::OutputFull;
        }
        let frame = match input.next_frame() {
            Ok(Some(f)) => f,
            Ok(None) => break Step::NeedInput,
            Err(e) => break Step::Failed(e),
        };
        let h = frame.header;
        tally.requests += 1;
        match validate(&h, x) {
            Ok(req) => match req.command {
                Command::Read { .. } | Command::Write { .. } => batch.pending.push((req, frame.payload)),
                Command::Disconnect => break Step::Disconnect,
                _ => {
                    run_batch(batch, &input.buf, dev, x, out, tally);
                    if !execute(dev, x, &req, &input.buf[frame.payload], out, scratch) {
                        tally.errors += 1;
                    }
                }
            },
            Err(Rejection::Error { errno, reason }) => {
                tally.errors += 1;
                reply_error(out, x, h.handle, errno, reason, None);
            }
            Err(Rejection::Disconnect(reason)) => break Step::Failed(SessionError::Protocol(reason)),
        }
    };
    // Whatever ends the pass, the reads and writes taken so far are answered first.
    run_batch(batch, &input.buf, dev, x, out, tally);
    step
}

/// Runs the pending reads and writes with one `io_batch` call and appends their replies.
fn run_batch(batch: &mut Batch, input: &[u8], dev: &dyn BlockDev, x: &ExportParams, out: &mut ReplyBuf, tally: &mut Tally) {
    if batch.pending.is_empty() {
        return;
    }
    let read_bytes: usize = batch.pending.iter().filter(|(r, _)| matches!(r.command, Command::Read { .. })).map(|(r, _)| r.length as usize).sum();
    batch.data.clear();
    batch.data.resize(read_bytes, 0);
    let mut ops = Vec::with_capacity(batch.pending.len());
    let mut rest = &mut batch.data[..];
    for (req, payload) in &batch.pending {
        match req.command {
            Command::Write { fua } => ops.push(BatchOp::write(&input[payload.clone()], req.offset, fua)),
            _ => {
                let (mine, tail) = std::mem::take(&mut rest).split_at_mut(req.length as usize);
                rest = tail;
                ops.push(BatchOp::read(mine, req.offset));
            }
        }
    }
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| dev.io_batch(&mut ops)));
    let results: Vec<Result<(), vdstream_blockdev::Error>> = match ran {
        Ok(()) => ops.into_iter().map(|op| op.result).collect(),
        Err(_) => {
            log::error!("device {} panicked on a batch of {} requests; answered EIO", dev.describe(), batch.pending.len());
            drop(ops);
            batch.pending.iter().map(|_| Err(vdstream_blockdev::Error::new(vdstream_blockdev::ErrorKind::Io, vdstream_blockdev::Op::Read, 0, 0, dev.describe(), "internal error in the block device (it panicked); see the server log"))).collect()
        }
    };
    let mut at = 0usize;
    for ((req, _), result) in batch.pending.iter().zip(results) {
        let len = req.length as usize;
        let is_read = matches!(req.command, Command::Read { .. });
        match result {
            Ok(()) if is_read => {
                if x.structured {
                    out.chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, req.handle, (8 + len) as u32);
                    out.put_u64(req.offset);
                } else {
                    out.simple_reply(req.handle, 0);
                }
                out.put(&batch.data[at..at + len]);
                tally.bytes_read += len as u64;
            }
            Ok(()) => {
                out.simple_reply(req.handle, 0);
                tally.bytes_written += len as u64;
            }
            Err(e) => {
                tally.errors += 1;
                let end = req.offset + len as u64;
                let offset = (is_read && e.offset >= req.offset && e.offset < end).then_some(e.offset);
                reply_error(out, x, req.handle, errno_for(e.kind, false), &e.to_string(), offset);
            }
        }
        if is_read {
            at += len;
        }
    }
    batch.pending.clear();
    if batch.data.capacity() > 4 << 20 {
        batch.data = Vec::new();
    }
}

/// The threaded engine on a blocking socket, for devices that may sleep (nbdkit's
/// parallel model): `threads` workers take turns holding the read side, each taking the
/// next request from the shared input buffer (reading the socket when it runs dry), then
/// execute it outside any lock of ours and write the reply under the write side's lock.
/// Up to `threads` requests run at once and replies go out in completion order. Bytes in
/// flight are bounded by the input buffer plus one payload per worker. While requests
/// finish fast (a RAM cache that is not waiting on its disk), the worker holding the read
/// side runs the inline engine's batch core instead, so such devices are not held to the
/// speed of a thread hand-off per request.
pub fn run_threaded_blocking<R, W>(reader: R, writer: W, negotiated: Negotiated, shared: &Shared, threads: usize) -> Result<(), SessionError>
where
    R: std::io::Read + Send,
    W: std::io::Write + Send,
{
    let read_side = std::sync::Mutex::new(ReadSide {
        sock: reader,
        input: Input::new(shared.config.read_buffer_size),
        done: false,
        result: Ok(()),
        tally: Tally::default(),
    });
    let write_side = std::sync::Mutex::new(WriteSide { sock: writer, failed: None });
    let dev: &dyn BlockDev = &*negotiated.device;
    let x = negotiated.params;
    let pace = Pace::default();
    let crew = Crew { max: threads.max(1), spawned: AtomicUsize::new(1), at_door: AtomicUsize::new(0) };
    let ctx = WorkerCtx { crew: &crew, read_side: &read_side, write_side: &write_side, pace: &pace, dev, x: &x, shared };
    std::thread::scope(|scope| threaded_worker(scope, ctx));
    let mut rs = read_side.into_inner().unwrap_or_else(|p| p.into_inner());
    rs.tally.publish(&shared.stats);
    let ws = write_side.into_inner().unwrap_or_else(|p| p.into_inner());
    match ws.failed {
        Some(e) => Err(e.into()),
        None => rs.result,
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

/// What every worker of a connection shares.
struct WorkerCtx<'env, R, W> {
    crew: &'env Crew,
    read_side: &'env std::sync::Mutex<ReadSide<R>>,
    write_side: &'env std::sync::Mutex<WriteSide<W>>,
    pace: &'env Pace,
    dev: &'env dyn BlockDev,
    x: &'env ExportParams,
    shared: &'env Shared,
}

impl<R, W> Clone for WorkerCtx<'_, R, W> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R, W> Copy for WorkerCtx<'_, R, W> {}

impl<'env, R: std::io::Read + Send, W: std::io::Write + Send> WorkerCtx<'env, R, W> {
    /// Starts one more worker if no worker is waiting to read the next request and the
    /// connection has fewer than `max`. A thread the system refuses is not an error: the
    /// requests wait for the workers there are.
    fn grow<'scope>(self, scope: &'scope std::thread::Scope<'scope, 'env>) {
        let crew = self.crew;
        if crew.at_door.load(Ordering::Acquire) > 0 {
            return;
        }
        if crew.spawned.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < crew.max).then_some(n + 1)).is_err() {
            return;
        }
        if let Err(e) = std::thread::Builder::new().name("nbd-worker".into()).spawn_scoped(scope, move || threaded_worker(scope, self)) {
            crew.spawned.fetch_sub(1, Ordering::AcqRel);
            log::debug!("cannot start another worker for a connection ({e}); its requests wait for the ones it has");
        }
    }
}

struct ReadSide<R> {
    sock: R,
    input: Input,
    /// No further request is taken (DISC, EOF, drain, error).
    done: bool,
    result: Result<(), SessionError>,
    tally: Tally,
}

struct WriteSide<W> {
    sock: W,
    failed: Option<io::Error>,
}

/// What a worker took from the input.
enum Job {
    Execute(crate::validate::Request),
    Refuse { handle: u64, errno: u32, reason: &'static str },
}

/// Below this mean time per request (ns) the device counts as fast: a worker holding the
/// read side handles every complete request in the input buffer on the spot, like the
/// inline engine, instead of handing one request at a time to the pool.
const FAST_REQUEST_NS: u64 = 20_000;

/// The recent mean execution time per request, an exponentially weighted average (1/8 new)
/// that every worker updates; approximate under races, which is all it needs to be.
#[derive(Default)]
struct Pace(std::sync::atomic::AtomicU64);

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

/// A worker of the threaded engine. While the device is fast (see [`Pace`]) the worker
/// holding the read side runs the inline batch core there and then, with payloads read in
/// place; once requests turn slow (a cache waiting on its disk) it hands them out one by
/// one, so others keep running while one waits.
fn threaded_worker<'scope, 'env, R: std::io::Read + Send, W: std::io::Write + Send>(scope: &'scope std::thread::Scope<'scope, 'env>, ctx: WorkerCtx<'env, R, W>) {
    let WorkerCtx { crew, read_side, write_side, pace, dev, x, shared } = ctx;
    shared.stats.workers.fetch_add(1, Ordering::Relaxed);
    struct Leaving<'a>(&'a Shared);
    impl Drop for Leaving<'_> {
        fn drop(&mut self) {
            self.0.stats.workers.fetch_sub(1, Ordering::Relaxed);
        }
    }
    let _leaving = Leaving(shared);
    let mut payload = Vec::new();
    let mut out = ReplyBuf::with_capacity(4 << 10);
    let mut scratch = Scratch::default();
    loop {
        let job = {
            crew.at_door.fetch_add(1, Ordering::AcqRel);
            let mut guard = read_side.lock().unwrap_or_else(|p| p.into_inner());
            crew.at_door.fetch_sub(1, Ordering::AcqRel);
            let rs = &mut *guard;
            loop {
                if rs.done {
                    return;
                }
                if pace.is_fast() {
                    let step = process(&mut rs.input, dev, x, &mut out, &mut scratch, &mut rs.tally, Some(pace));
                    let answered = !out.is_empty();
                    // The replies go out while this worker still holds the read side: in
                    // fast mode it is the connection's one runner, as in the inline
                    // engine, with no hand-off between threads per batch.
                    if answered && !send_replies(write_side, &mut out) {
                        rs.done = true;
                        return;
                    }
                    match step {
                        Step::NeedInput if !answered => {}
                        Step::NeedInput | Step::OutputFull => continue,
                        Step::Disconnect => {
                            rs.done = true;
                            return;
                        }
                        Step::Failed(e) => {
                            rs.done = true;
                            rs.result = Err(e);
                            return;
                        }
                    }
                }
                let frame = match rs.input.next_frame() {
                    Ok(Some(f)) => f,
                    Ok(None) => {
                        rs.tally.publish(&shared.stats);
                        match rs.input.fill_blocking(&mut rs.sock) {
                            Ok(0) => rs.done = true,
                            Ok(_) => {}
                            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                            Err(e) => {
                                rs.done = true;
                                rs.result = Err(e.into());
                            }
                        }
                        continue;
                    }
                    Err(e) => {
                        rs.done = true;
                        rs.result = Err(e);
                        return;
                    }
                };
                let h = frame.header;
                rs.tally.requests += 1;
                match validate(&h, x) {
                    Ok(req) if req.command == Command::Disconnect => {
                        rs.done = true;
                        return;
                    }
                    Ok(req) => {
                        match req.command {
                            Command::Read { .. } => rs.tally.bytes_read += req.length as u64,
                            Command::Write { .. } => rs.tally.bytes_written += req.length as u64,
                            _ => {}
                        }
                        payload.clear();
                        payload.extend_from_slice(&rs.input.buf[frame.payload]);
                        break Job::Execute(req);
                    }
                    Err(Rejection::Error { errno, reason }) => {
                        rs.tally.errors += 1;
                        break Job::Refuse { handle: h.handle, errno, reason };
                    }
                    Err(Rejection::Disconnect(reason)) => {
                        rs.done = true;
                        rs.result = Err(SessionError::Protocol(reason));
                        return;
                    }
                }
            }
        };
        match job {
            Job::Execute(req) => {
                // This request runs away from the read side: make sure someone reads on.
                ctx.grow(scope);
                out.clear();
                let started = std::time::Instant::now();
                if !execute(dev, x, &req, &payload, &mut out, &mut scratch) {
                    shared.stats.request_errors.fetch_add(1, Ordering::Relaxed);
                }
                pace.record(started.elapsed());
            }
            Job::Refuse { handle, errno, reason } => {
                out.clear();
                reply_error(&mut out, x, handle, errno, reason, None);
            }
        }
        if payload.capacity() > 4 << 20 {
            payload = Vec::new();
        }
        if !send_replies(write_side, &mut out) {
            return;
        }
    }
}

/// Writes `out` under the write side's lock and empties it; false once the socket failed.
fn send_replies<W: std::io::Write>(write_side: &std::sync::Mutex<WriteSide<W>>, out: &mut ReplyBuf) -> bool {
    let mut ws = write_side.lock().unwrap_or_else(|p| p.into_inner());
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

/// A finished reply on its way to the writer, holding its share of the in-flight budget.
struct Reply {
    bytes: ReplyBuf,
    _budget: Option<OwnedSemaphorePermit>,
}

async fn run_concurrent<S>(stream: S, negotiated: Negotiated, shared: &Shared, mut shutdown: ShutdownSignal) -> Result<(), SessionError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut rd, mut wr) = tokio::io::split(stream);
    let dev = negotiated.device.clone();
    let x = negotiated.params;
    let max_budget = shared.config.max_in_flight_bytes.clamp(MAX_PAYLOAD as usize + REQUEST_OVERHEAD, u32::MAX as usize);
    let budget = Arc::new(Semaphore::new(max_budget));
    let (tx, mut rx) = mpsc::unbounded_channel::<Reply>();
    let stats = shared.stats.clone();

    let reader = async move {
        let mut input = Input::new(shared.config.read_buffer_size);
        let mut tally = Tally::default();
        let result = 'session: loop {
            loop {
                let frame = match input.next_frame() {
                    Ok(Some(f)) => f,
                    Ok(None) => break,
                    Err(e) => break 'session Err(e),
                };
                let h = frame.header;
                tally.requests += 1;
                let verdict = if shutdown.is_shutdown() {
                    Err(Rejection::Error { errno: ESHUTDOWN, reason: "the server is shutting down; reconnect later" })
                } else {
                    validate(&h, &x)
                };
                match verdict {
                    Ok(req) if req.command == Command::Disconnect => break 'session Ok(()),
                    Ok(req) => {
                        let data_len = match req.command {
                            Command::Read { .. } => {
                                tally.bytes_read += req.length as u64;
                                req.length as usize
                            }
                            Command::Write { .. } => {
                                tally.bytes_written += req.length as u64;
                                req.length as usize
                            }
                            _ => 0,
                        };
                        let cost = (data_len + REQUEST_OVERHEAD).min(max_budget) as u32;
                        let permit = tokio::select! {
                            p = budget.clone().acquire_many_owned(cost) => p.expect("the budget semaphore is never closed"),
                            _ = tx.closed() => break 'session Ok(()),
                        };
                        let payload = input.buf[frame.payload].to_vec();
                        let (dev, tx) = (dev.clone(), tx.clone());
                        tokio::task::spawn_blocking(move || {
                            let mut bytes = ReplyBuf::with_capacity(0);
                            let mut scratch = Scratch::default();
                            execute(&*dev, &x, &req, &payload, &mut bytes, &mut scratch);
                            // The writer may be gone (client left): nothing to do then.
                            let _ = tx.send(Reply { bytes, _budget: Some(permit) });
                        });
                    }
                    Err(Rejection::Error { errno, reason }) => {
                        tally.errors += 1;
                        let mut bytes = ReplyBuf::with_capacity(0);
                        reply_error(&mut bytes, &x, h.handle, errno, reason, None);
                        let _ = tx.send(Reply { bytes, _budget: None });
                    }
                    Err(Rejection::Disconnect(reason)) => break 'session Err(SessionError::Protocol(reason)),
                }
            }
            tally.publish(&stats);
            let n = tokio::select! {
                biased;
                _ = shutdown.wait() => break 'session Ok(()),
                _ = tx.closed() => break 'session Ok(()),
                r = input.fill(&mut rd) => r,
            };
            match n {
                Ok(0) => break 'session Ok(()),
                Ok(_) => {}
                Err(e) => break 'session Err(SessionError::from(e)),
            }
        };
        tally.publish(&stats);
        // Dropping our sender: the writer ends once every in-flight request has replied.
        drop(tx);
        result
    };

    let writer = async move {
        let mut batch = Vec::with_capacity(256 << 10);
        let mut held = Vec::new();
        let mut result: Result<(), SessionError> = Ok(());
        while let Some(first) = rx.recv().await {
            batch.extend_from_slice(first.bytes.as_slice());
            held.push(first);
            while batch.len() < FLUSH_AT {
                match rx.try_recv() {
                    Ok(r) => {
                        batch.extend_from_slice(r.bytes.as_slice());
                        held.push(r);
                    }
                    Err(_) => break,
                }
            }
            if let Err(e) = wr.write_all(&batch).await {
                result = Err(e.into());
                break;
            }
            batch.clear();
            if batch.capacity() > 4 << 20 {
                batch = Vec::with_capacity(256 << 10);
            }
            held.clear(); // releases the budget of what was written
        }
        drop(rx);
        let _ = wr.flush().await;
        let _ = wr.shutdown().await;
        result
    };

    let (read_result, write_result) = tokio::join!(reader, writer);
    read_result.and(write_result)
}
