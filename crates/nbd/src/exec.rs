//! Executing one validated request against a [`BlockDev`] and appending its reply.
//!
//! Invariants: requests arrive validated ([`crate::validate`]), so ranges are inside the
//! export and lengths are bounded (checked here only with `debug_assert!`). A READ's data
//! is read straight into the output buffer behind its reserved header (no extra copy) —
//! except when a structured reply is split around holes. Replies follow the spec: simple
//! replies unless structured replies were negotiated; with them, a READ always gets
//! structured chunks, other successes get a 16-byte simple reply, and every error is an
//! error chunk carrying a message. A device error becomes an errno only through
//! [`crate::errno::errno_for`]. A device that panics gets its request answered with EIO.

use std::panic::{catch_unwind, AssertUnwindSafe};

use vdstream_blockdev::{BlockDev, Extent, Hole};

use crate::errno::errno_for;
use crate::handshake::BASE_ALLOCATION_CONTEXT_ID;
use crate::proto::*;
use crate::validate::{Command, ExportParams, Request};
use crate::wire::{
    write_chunk_header, write_simple_reply, ReplyBuf, CHUNK_HEADER_LEN, SIMPLE_REPLY_LEN,
};

/// Holes shorter than this are sent as data: a hole chunk is not worth its header.
const MIN_HOLE_CHUNK: usize = 512;
/// Most block-status descriptors in one reply (the spec allows answering less).
const MAX_EXTENTS: usize = 8192;

/// Reusable per-connection (or per-worker) scratch space, so the hot path allocates nothing.
#[derive(Debug, Default)]
pub struct Scratch {
    holes: Vec<Hole>,
    extents: Vec<Extent>,
    data: Vec<u8>,
}

/// Appends an error reply: a structured error chunk when structured replies are on (with
/// `ERROR_OFFSET` when an offset is known), else a simple reply with the errno.
pub fn reply_error(
    out: &mut ReplyBuf,
    x: &ExportParams,
    handle: u64,
    errno: u32,
    message: &str,
    offset: Option<u64>,
) {
    if x.structured {
        out.error_chunk(handle, errno, message, offset);
    } else {
        out.simple_reply(handle, errno);
    }
}

/// Appends the answer to a request whose device call panicked: EIO, naming the command.
/// The caller logs the panic.
pub fn reply_panicked(out: &mut ReplyBuf, x: &ExportParams, req: &Request) {
    let what = match req.command {
        Command::Read { .. } => "read",
        Command::Write { .. } => "write",
        Command::Flush => "flush",
        Command::Trim { .. } => "trim",
        Command::Cache => "cache",
        Command::WriteZeroes(_) => "write-zeroes",
        Command::BlockStatus { .. } => "block-status",
        Command::Disconnect => "disconnect",
    };
    let message = format!(
        "internal error in the block device during a {what} (it panicked); see the server log"
    );
    reply_error(out, x, req.handle, EIO, &message, None);
}

/// Runs `req` on `dev` and appends its reply to `out`. `payload` is the WRITE data (empty
/// otherwise). Returns whether the request succeeded (for counters).
pub fn execute(
    dev: &dyn BlockDev,
    x: &ExportParams,
    req: &Request,
    payload: &[u8],
    out: &mut ReplyBuf,
    scratch: &mut Scratch,
) -> bool {
    let start = out.len();
    match catch_unwind(AssertUnwindSafe(|| {
        execute_inner(dev, x, req, payload, out, scratch)
    })) {
        Ok(ok) => ok,
        Err(_) => {
            log::error!(
                "device {} panicked on {:?}; answered EIO",
                dev.describe(),
                req
            );
            out.truncate(start);
            reply_panicked(out, x, req);
            false
        }
    }
}

fn execute_inner(
    dev: &dyn BlockDev,
    x: &ExportParams,
    req: &Request,
    payload: &[u8],
    out: &mut ReplyBuf,
    scratch: &mut Scratch,
) -> bool {
    debug_assert!(req.offset + req.length as u64 <= x.size || req.command == Command::Flush);
    let (off, len) = (req.offset, req.length as u64);
    let result = match req.command {
        Command::Read { .. } => return read(dev, x, req, out, scratch),
        Command::BlockStatus { req_one } => {
            return block_status(dev, x, req, req_one, out, scratch)
        }
        Command::Write { fua } => {
            debug_assert_eq!(payload.len() as u64, len);
            dev.write_at(payload, off, fua)
        }
        Command::Flush => dev.flush(),
        Command::Trim { fua } => dev.trim(off, len, fua),
        Command::Cache => dev.cache(off, len),
        Command::WriteZeroes(flags) => dev.write_zeroes(off, len, flags),
        Command::Disconnect => {
            debug_assert!(false, "DISC has no reply; the session handles it");
            return true;
        }
    };
    reply_status(out, x, req, result)
}

/// Appends the reply to a request other than READ and BLOCK_STATUS once its device call
/// returned `result`. Returns whether it succeeded.
pub fn reply_status(
    out: &mut ReplyBuf,
    x: &ExportParams,
    req: &Request,
    result: vdstream_blockdev::Result<()>,
) -> bool {
    match result {
        Ok(()) => {
            out.simple_reply(req.handle, 0);
            true
        }
        Err(e) => {
            let fast = matches!(req.command, Command::WriteZeroes(f) if f.fast_only);
            // A READ's error names where it failed, when that is inside the request.
            let end = req.offset + req.length as u64;
            let at = matches!(req.command, Command::Read { .. })
                .then_some(e.offset)
                .filter(|&o| o >= req.offset && o < end);
            reply_error(
                out,
                x,
                req.handle,
                errno_for(e.kind, fast),
                &e.to_string(),
                at,
            );
            false
        }
    }
}

const PREFIX: usize = CHUNK_HEADER_LEN + 8;

/// A READ, its data read straight into `out` behind the reply header.
fn read(
    dev: &dyn BlockDev,
    x: &ExportParams,
    req: &Request,
    out: &mut ReplyBuf,
    scratch: &mut Scratch,
) -> bool {
    let len = req.length as usize;
    let start = out.len();
    let head_len = if x.structured {
        PREFIX
    } else {
        SIMPLE_REPLY_LEN
    };
    let r = out.reserve(head_len + len);
    let (head, data) = out.slice_mut(r).split_at_mut(head_len);
    scratch.holes.clear();
    let result = if x.structured {
        dev.read_at_sparse(data, req.offset, &mut scratch.holes)
    } else {
        dev.read_at(data, req.offset)
    };
    if result.is_err() || !keep_holes(req, len, &mut scratch.holes) {
        if let Err(e) = result {
            out.truncate(start);
            return reply_status(out, x, req, Err(e));
        }
        if x.structured {
            write_chunk_header(
                head,
                REPLY_FLAG_DONE,
                REPLY_TYPE_OFFSET_DATA,
                req.handle,
                (8 + len) as u32,
            );
            head[CHUNK_HEADER_LEN..].copy_from_slice(&req.offset.to_be_bytes());
        } else {
            write_simple_reply(head, req.handle, 0);
        }
        return true;
    }
    // Fragment around the holes: move the data aside, then emit data and hole chunks.
    scratch.data.clear();
    scratch.data.extend_from_slice(data);
    out.truncate(start);
    fragments(out, req, &scratch.data, &scratch.holes);
    true
}

/// Appends the reply to a READ whose data was read elsewhere (the batched engine), with
/// the device's `result` and the `holes` it reported in `data`.
pub fn reply_read(
    out: &mut ReplyBuf,
    x: &ExportParams,
    req: &Request,
    result: vdstream_blockdev::Result<()>,
    data: &[u8],
    holes: &mut Vec<Hole>,
) -> bool {
    if result.is_err() {
        return reply_status(out, x, req, result);
    }
    if !x.structured {
        out.simple_reply(req.handle, 0);
    } else if keep_holes(req, data.len(), holes) {
        fragments(out, req, data, holes);
        return true;
    } else {
        out.chunk_header(
            REPLY_FLAG_DONE,
            REPLY_TYPE_OFFSET_DATA,
            req.handle,
            (PREFIX - CHUNK_HEADER_LEN + data.len()) as u32,
        );
        out.put_u64(req.offset);
    }
    out.put(data);
    true
}

/// Keeps only holes worth a chunk that lie inside the buffer, in order; whether any are
/// left to send (never with DF, which asks for one data chunk).
fn keep_holes(req: &Request, len: usize, holes: &mut Vec<Hole>) -> bool {
    if matches!(req.command, Command::Read { df: true }) {
        return false;
    }
    holes.retain(|h| {
        h.len >= MIN_HOLE_CHUNK && h.start.checked_add(h.len).is_some_and(|end| end <= len)
    });
    holes.sort_unstable_by_key(|h| h.start);
    !holes.is_empty()
}

/// Appends a structured READ reply as data and hole chunks, the last one marked DONE.
fn fragments(out: &mut ReplyBuf, req: &Request, data: &[u8], holes: &[Hole]) {
    let mut pos = 0usize;
    let mut last_chunk = out.len();
    let data_chunk = |out: &mut ReplyBuf, from: usize, to: usize| {
        let at = out.len();
        out.chunk_header(
            0,
            REPLY_TYPE_OFFSET_DATA,
            req.handle,
            (8 + to - from) as u32,
        );
        out.put_u64(req.offset + from as u64);
        out.put(&data[from..to]);
        at
    };
    for h in holes {
        if h.start < pos {
            continue; // overlaps the previous hole: its bytes are zero in the data anyway
        }
        if h.start > pos {
            data_chunk(out, pos, h.start);
        }
        last_chunk = out.len();
        out.chunk_header(0, REPLY_TYPE_OFFSET_HOLE, req.handle, 12);
        out.put_u64(req.offset + h.start as u64);
        out.put_u32(h.len as u32);
        pos = h.start + h.len;
    }
    if pos < data.len() {
        last_chunk = data_chunk(out, pos, data.len());
    }
    // Mark the last chunk as the final one.
    out.slice_mut(last_chunk + 4..last_chunk + 6)
        .copy_from_slice(&REPLY_FLAG_DONE.to_be_bytes());
}

fn block_status(
    dev: &dyn BlockDev,
    x: &ExportParams,
    req: &Request,
    req_one: bool,
    out: &mut ReplyBuf,
    scratch: &mut Scratch,
) -> bool {
    debug_assert!(x.base_allocation);
    scratch.extents.clear();
    if let Err(e) = dev.block_status(req.offset, req.length as u64, &mut scratch.extents) {
        return reply_status(out, x, req, Err(e));
    }
    // (length, flags) descriptors: clamped to the request (so each fits in u32), merged
    // when consecutive extents have the same flags, at most MAX_EXTENTS of them.
    let mut descriptors: Vec<(u32, u32)> = Vec::new();
    let mut remaining = req.length as u64;
    for e in &scratch.extents {
        if remaining == 0 {
            break;
        }
        if e.len == 0 {
            continue;
        }
        let len = e.len.min(remaining) as u32;
        remaining -= len as u64;
        let flags =
            if e.hole { STATE_HOLE } else { 0 } | if e.zero || e.hole { STATE_ZERO } else { 0 };
        match descriptors.last_mut() {
            Some(last) if last.1 == flags => last.0 += len,
            _ => {
                if descriptors.len() >= MAX_EXTENTS {
                    break;
                }
                descriptors.push((len, flags));
            }
        }
    }
    if descriptors.is_empty() {
        // The device reported nothing usable: "status 0" is always a safe answer.
        descriptors.push((req.length, 0));
    }
    if req_one {
        descriptors.truncate(1);
    }
    out.chunk_header(
        REPLY_FLAG_DONE,
        REPLY_TYPE_BLOCK_STATUS,
        req.handle,
        (4 + 8 * descriptors.len()) as u32,
    );
    out.put_u32(BASE_ALLOCATION_CONTEXT_ID);
    for (len, flags) in descriptors {
        out.put_u32(len);
        out.put_u32(flags);
    }
    true
}
