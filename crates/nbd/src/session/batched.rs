//! The batched engine: a connection's reads and writes go to the device in batches
//! ([`BlockDev::io_batch`]), for devices whose I/O is asynchronous underneath
//! ([`BlockDev::prefers_batches`]: a disk cache with `O_DIRECT`, submitting each batch
//! through the calling thread's io_uring).
//!
//! Design notes.
//!
//! - **Runners, taking turns on the read side.** A connection has up to [`RUNNERS`]
//!   threads. The one holding the read side takes every complete request the input
//!   buffer holds (up to [`MAX_BATCH`]), copying WRITE payloads into a buffer of its own,
//!   lets go of the read side, runs the batch with one `io_batch` call and writes the
//!   replies under the write side's lock. While its batch is in the kernel, the next
//!   runner reads the socket and submits the requests that arrived meanwhile, so the disk
//!   sees the client's queue refilled as it drains, not in bursts of one batch at a time.
//!   A second runner starts only when the first leaves the read side with work: an idle
//!   connection holds one thread.
//! - **Order.** Within one runner, reads and writes taken before another command (FLUSH,
//!   TRIM, WRITE_ZEROES, CACHE, BLOCK_STATUS) complete before it runs, as in the inline
//!   engine. Between runners there is no order, as between any requests in flight in NBD
//!   (a FLUSH covers the writes *answered* before it was received; a write still in
//!   another runner's batch has not been answered).
//! - **Lock order.** A runner never holds the read side and the write side at once.
//!
//! Invariants: every request taken from the input is answered exactly once, by the runner
//! that took it; on DISC, end of file, drain (the read side shut down) or a protocol
//! violation no further request is taken, and the runners that hold batches still answer
//! them before the connection closes.

use std::sync::atomic::{AtomicUsize, Ordering};

use vdstream_blockdev::{BatchOp, BlockDev};

use super::{send_replies, ReadSide, SessionError, WriteSide};
use crate::errno::errno_for;
use crate::exec::{execute, reply_error, Scratch};
use crate::handshake::Negotiated;
use crate::proto::*;
use crate::server::Shared;
use crate::validate::{validate, Command, ExportParams, Rejection, Request};
use crate::wire::ReplyBuf;

/// Most requests in one batch.
const MAX_BATCH: usize = 64;
/// A batch stops taking requests once its reads and writes add up to this many bytes (it
/// always takes one), which bounds a runner's buffers.
const MAX_BATCH_BYTES: u64 = 8 << 20;
/// Most runners (threads) of one connection: two keep one batch in the kernel while the
/// next is read and submitted; more add thread hand-offs without more overlap.
const RUNNERS: usize = 2;

/// Runs the batched engine until the client disconnects, the socket fails, or a drain
/// shuts the read side. See the module notes.
pub fn run_batched_blocking<R, W>(reader: R, writer: W, negotiated: Negotiated, shared: &Shared, runners: usize) -> Result<(), SessionError>
where
    R: std::io::Read + Send,
    W: std::io::Write + Send,
{
    let read_side = std::sync::Mutex::new(ReadSide::new(reader, shared));
    let write_side = std::sync::Mutex::new(WriteSide { sock: writer, failed: None });
    let dev: &dyn BlockDev = &*negotiated.device;
    let x = negotiated.params;
    let crew = Crew { max: runners.clamp(1, RUNNERS), spawned: AtomicUsize::new(1), at_door: AtomicUsize::new(0) };
    let ctx = Ctx { crew: &crew, read_side: &read_side, write_side: &write_side, dev, x: &x, shared };
    std::thread::scope(|scope| runner(scope, ctx));
    let mut rs = read_side.into_inner().unwrap_or_else(|p| p.into_inner());
    rs.tally.publish(&shared.stats);
    let ws = write_side.into_inner().unwrap_or_else(|p| p.into_inner());
    match ws.failed {
        Some(e) => Err(e.into()),
        None => rs.result,
    }
}

/// The runners of one connection, started as work needs them.
struct Crew {
    max: usize,
    spawned: AtomicUsize,
    /// Runners waiting to take the read side.
    at_door: AtomicUsize,
}

struct Ctx<'env, R, W> {
    crew: &'env Crew,
    read_side: &'env std::sync::Mutex<ReadSide<R>>,
    write_side: &'env std::sync::Mutex<WriteSide<W>>,
    dev: &'env dyn BlockDev,
    x: &'env ExportParams,
    shared: &'env Shared,
}

impl<R, W> Clone for Ctx<'_, R, W> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R, W> Copy for Ctx<'_, R, W> {}

impl<'env, R: std::io::Read + Send, W: std::io::Write + Send> Ctx<'env, R, W> {
    /// Starts one more runner if none waits at the read side and the crew is not full. A
    /// thread the system refuses is not an error: the work waits for the runners there are.
    fn grow<'scope>(self, scope: &'scope std::thread::Scope<'scope, 'env>) {
        let crew = self.crew;
        if crew.at_door.load(Ordering::Acquire) > 0 {
            return;
        }
        if crew.spawned.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < crew.max).then_some(n + 1)).is_err() {
            return;
        }
        if let Err(e) = std::thread::Builder::new().name("nbd-runner".into()).spawn_scoped(scope, move || runner(scope, self)) {
            crew.spawned.fetch_sub(1, Ordering::AcqRel);
            log::debug!("cannot start another runner for a connection ({e}); its batches run one at a time");
        }
    }
}

/// What one runner took from the input: reads and writes to run together, then at most
/// one other command to run after them.
#[derive(Default)]
struct Batch {
    /// Each read or write, and where its WRITE payload sits in `payloads`.
    pending: Vec<(Request, std::ops::Range<usize>)>,
    /// WRITE payloads, back to back (copied out of the shared input buffer).
    payloads: Vec<u8>,
    /// A command that is neither READ nor WRITE, with its payload range.
    then: Option<(Request, std::ops::Range<usize>)>,
    /// The READ data of a batch, back to back.
    data: Vec<u8>,
}

impl Batch {
    fn is_empty(&self) -> bool {
        self.pending.is_empty() && self.then.is_none()
    }

    fn take_payload(&mut self, bytes: &[u8]) -> std::ops::Range<usize> {
        let at = self.payloads.len();
        self.payloads.extend_from_slice(bytes);
        at..self.payloads.len()
    }

    fn clear(&mut self) {
        self.pending.clear();
        self.payloads.clear();
        self.then = None;
        if self.payloads.capacity() > 8 << 20 {
            self.payloads = Vec::new();
        }
        if self.data.capacity() > 8 << 20 {
            self.data = Vec::new();
        }
    }
}

/// One runner: take a batch under the read side, run it outside, answer it.
fn runner<'scope, 'env, R: std::io::Read + Send, W: std::io::Write + Send>(scope: &'scope std::thread::Scope<'scope, 'env>, ctx: Ctx<'env, R, W>) {
    let Ctx { crew, read_side, write_side, dev, x, shared } = ctx;
    shared.stats.workers.fetch_add(1, Ordering::Relaxed);
    struct Leaving<'a>(&'a Shared);
    impl Drop for Leaving<'_> {
        fn drop(&mut self) {
            self.0.stats.workers.fetch_sub(1, Ordering::Relaxed);
        }
    }
    let _leaving = Leaving(shared);
    let mut batch = Batch::default();
    let mut out = ReplyBuf::with_capacity(64 << 10);
    let mut scratch = Scratch::default();
    loop {
        let last = {
            crew.at_door.fetch_add(1, Ordering::AcqRel);
            let mut guard = read_side.lock().unwrap_or_else(|p| p.into_inner());
            crew.at_door.fetch_sub(1, Ordering::AcqRel);
            if guard.done {
                return;
            }
            take(&mut guard, x, shared, &mut batch, &mut out);
            guard.done
        };
        if !last && !batch.is_empty() {
            // This batch runs away from the read side: let someone read on meanwhile.
            ctx.grow(scope);
        }
        let errors = run(&mut batch, dev, x, &mut out, &mut scratch);
        if errors > 0 {
            shared.stats.request_errors.fetch_add(errors, Ordering::Relaxed);
        }
        batch.clear();
        if !out.is_empty() && !send_replies(write_side, &mut out) {
            read_side.lock().unwrap_or_else(|p| p.into_inner()).done = true;
            return;
        }
        if last {
            return;
        }
    }
}

/// Under the read side: fills `batch` with the complete requests the input holds, reading
/// the socket only while the runner has nothing to do. Refusals are answered into `out`
/// at once. Sets `rs.done` when no further request is to be taken.
fn take<R: std::io::Read>(rs: &mut ReadSide<R>, x: &ExportParams, shared: &Shared, batch: &mut Batch, out: &mut ReplyBuf) {
    let mut bytes = 0u64;
    while batch.pending.len() < MAX_BATCH && bytes < MAX_BATCH_BYTES {
        let frame = match rs.input.next_frame() {
            Ok(Some(f)) => f,
            Ok(None) => {
                if !batch.is_empty() || !out.is_empty() {
                    return;
                }
                rs.tally.publish(&shared.stats);
                match rs.input.fill_blocking(&mut rs.sock) {
                    Ok(0) => {
                        if rs.input.has_partial() {
                            log::debug!("client closed the connection in the middle of a request");
                        }
                        rs.done = true;
                        return;
                    }
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        rs.done = true;
                        rs.result = Err(e.into());
                        return;
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
            Ok(req) => match req.command {
                Command::Disconnect => {
                    rs.done = true;
                    return;
                }
                Command::Read { .. } => {
                    rs.tally.bytes_read += req.length as u64;
                    bytes += req.length as u64;
                    batch.pending.push((req, 0..0));
                }
                Command::Write { .. } => {
                    rs.tally.bytes_written += req.length as u64;
                    bytes += req.length as u64;
                    let payload = batch.take_payload(&rs.input.buf[frame.payload]);
                    batch.pending.push((req, payload));
                }
                _ => {
                    let payload = batch.take_payload(&rs.input.buf[frame.payload]);
                    batch.then = Some((req, payload));
                    return;
                }
            },
            Err(Rejection::Error { errno, reason }) => {
                rs.tally.errors += 1;
                reply_error(out, x, h.handle, errno, reason, None);
            }
            Err(Rejection::Disconnect(reason)) => {
                rs.done = true;
                rs.result = Err(SessionError::Protocol(reason));
                return;
            }
        }
    }
}

/// Runs a runner's batch: its reads and writes in one `io_batch` call, then its other
/// command; appends every reply to `out`. Returns how many requests failed.
fn run(batch: &mut Batch, dev: &dyn BlockDev, x: &ExportParams, out: &mut ReplyBuf, scratch: &mut Scratch) -> u64 {
    let mut errors = run_reads_and_writes(batch, dev, x, out);
    if let Some((req, payload)) = batch.then.take() {
        if !execute(dev, x, &req, &batch.payloads[payload], out, scratch) {
            errors += 1;
        }
    }
    errors
}

fn run_reads_and_writes(batch: &mut Batch, dev: &dyn BlockDev, x: &ExportParams, out: &mut ReplyBuf) -> u64 {
    if batch.pending.is_empty() {
        return 0;
    }
    let read_bytes: usize = batch.pending.iter().filter(|(r, _)| matches!(r.command, Command::Read { .. })).map(|(r, _)| r.length as usize).sum();
    batch.data.clear();
    batch.data.resize(read_bytes, 0);
    let mut ops = Vec::with_capacity(batch.pending.len());
    let mut rest = &mut batch.data[..];
    for (req, payload) in &batch.pending {
        match req.command {
            Command::Write { fua } => ops.push(BatchOp::write(&batch.payloads[payload.clone()], req.offset, fua)),
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
    let mut errors = 0;
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
            }
            Ok(()) => out.simple_reply(req.handle, 0),
            Err(e) => {
                errors += 1;
                let end = req.offset + len as u64;
                let offset = (is_read && e.offset >= req.offset && e.offset < end).then_some(e.offset);
                reply_error(out, x, req.handle, errno_for(e.kind, false), &e.to_string(), offset);
            }
        }
        if is_read {
            at += len;
        }
    }
    errors
}
