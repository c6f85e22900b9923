//! One virtio-blk request: a descriptor chain the guest (or a frontend that may be buggy or
//! hostile) put in shared memory, parsed and carried out on the [`BlockDev`].
//!
//! Invariants:
//! - Nothing outside the guest memory the frontend gave is ever read or written: every
//!   access goes through vm-memory's checked slices (`Reader`, `Writer`, `write_obj`), and
//!   guest memory is only copied through a bounce buffer, never borrowed as `&[u8]` (the
//!   guest may change it at the same time).
//! - A malformed chain never panics and never stops the queue: it fails with
//!   `VIRTIO_BLK_S_IOERR` where its status byte can be written, and is given back with
//!   length 0 where it cannot. Either way it is counted and logged (rate-limited).
//! - Every request in range is carried out in pieces of at most [`PIECE`] bytes, so a
//!   request's size never sets the backend's memory use.
//! - The used length is what the device wrote into the chain: the data of a read (or ID)
//!   and the status byte.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use vdstream_blockdev::lograte::LogLimiter;
use vdstream_blockdev::{BlockDev, ZeroFlags};
use virtio_bindings::bindings::virtio_blk::*;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{DescriptorChain, Reader, Writer};
use vm_memory::bitmap::BitmapSlice;
use vm_memory::{Bytes, GuestAddress, GuestMemory, GuestMemoryMmap};

use crate::config::{Geometry, MAX_RANGE_SECTORS, MAX_RANGE_SEGS};

/// The largest piece of a request copied at once.
pub const PIECE: usize = 1 << 20;

/// Descriptors of one chain looked at, at most: a chain is also bounded by its queue's size
/// (or its indirect table's), this only bounds the backend's own list.
const MAX_DESCRIPTORS: usize = 4096;

/// Counters of one backend, over every queue and frontend connection.
#[derive(Debug, Default)]
pub struct Stats {
    pub requests: AtomicU64,
    pub read_ops: AtomicU64,
    pub write_ops: AtomicU64,
    pub flush_ops: AtomicU64,
    pub discard_ops: AtomicU64,
    pub zero_ops: AtomicU64,
    /// Requests answered with an error status other than for a malformed chain.
    pub errors: AtomicU64,
    /// Malformed chains (answered IOERR, or given back with no status).
    pub malformed: AtomicU64,
    /// Unknown request types (answered UNSUPP).
    pub unsupported: AtomicU64,
}

/// What a request ended with: the status the device wrote, and the used length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// `VIRTIO_BLK_S_*`, or `None` when the chain had no status byte the device could write.
    pub status: Option<u8>,
    pub used_len: u32,
}

/// Carries out requests on one device; one per queue thread (it owns a bounce buffer).
#[derive(Debug)]
pub struct Executor<'a> {
    pub dev: &'a dyn BlockDev,
    pub geom: &'a Geometry,
    pub stats: &'a Stats,
    pub log: &'a LogLimiter,
    /// Names the device in log lines (the target id).
    pub name: &'a str,
    /// Writes are durable when they complete (FUA): the frontend did not take FLUSH.
    pub write_through: bool,
    pub buf: &'a mut Vec<u8>,
}

/// Why a request failed, with the status it gets.
struct Fail {
    status: u8,
    malformed: bool,
    why: String,
}

fn malformed(why: impl Into<String>) -> Fail {
    Fail {
        status: VIRTIO_BLK_S_IOERR as u8,
        malformed: true,
        why: why.into(),
    }
}

impl Executor<'_> {
    /// Parses and carries out the request of `chain` in `mem`, writes its status, and
    /// returns what it ended with. Never panics.
    pub fn execute<B: BitmapSlice + 'static, T>(
        &mut self,
        mem: &GuestMemoryMmap<B>,
        chain: DescriptorChain<T>,
    ) -> Outcome
    where
        T: std::ops::Deref + Clone,
        T::Target: GuestMemory + Sized,
    {
        self.stats.requests.fetch_add(1, Relaxed);
        let head = chain.head_index();
        let shape = Shape::of(chain.clone());
        let status_addr = match status_address(&shape) {
            Ok(a) => a,
            Err(why) => {
                self.stats.malformed.fetch_add(1, Relaxed);
                self.log.log(
                    log::Level::Warn,
                    "vdstream::vhost",
                    "vhost-malformed",
                    format_args!("{}: request {head} has no status byte the device can write ({why}): given back unanswered", self.name),
                );
                return Outcome {
                    status: None,
                    used_len: 0,
                };
            }
        };
        let mut malformed_counted = false;
        let (status, data_len) = match self.run(mem, chain, &shape) {
            Ok(n) => (VIRTIO_BLK_S_OK as u8, n),
            Err(f) => {
                malformed_counted = f.malformed;
                let counter = if f.malformed {
                    &self.stats.malformed
                } else if f.status == VIRTIO_BLK_S_UNSUPP as u8 {
                    &self.stats.unsupported
                } else {
                    &self.stats.errors
                };
                counter.fetch_add(1, Relaxed);
                let kind = if f.malformed {
                    "vhost-malformed"
                } else {
                    "vhost-failed"
                };
                self.log.log(
                    log::Level::Warn,
                    "vdstream::vhost",
                    kind,
                    format_args!("{}: request {head}: {}", self.name, f.why),
                );
                (f.status, 0)
            }
        };
        if mem.write_obj(status, status_addr).is_err() {
            // status_address checked only the arithmetic: the byte is outside guest memory.
            if !malformed_counted {
                self.stats.malformed.fetch_add(1, Relaxed);
            }
            self.log.log(
                log::Level::Warn,
                "vdstream::vhost",
                "vhost-malformed",
                format_args!("{}: request {head}: its status byte at {:#x} is outside guest memory: given back unanswered", self.name, status_addr.0),
            );
            return Outcome {
                status: None,
                used_len: 0,
            };
        }
        Outcome {
            status: Some(status),
            used_len: data_len.saturating_add(1),
        }
    }

    /// The request itself; returns the bytes written into the chain's data buffers.
    fn run<B: BitmapSlice + 'static, T>(
        &mut self,
        mem: &GuestMemoryMmap<B>,
        chain: DescriptorChain<T>,
        shape: &Shape,
    ) -> Result<u32, Fail>
    where
        T: std::ops::Deref + Clone,
        T::Target: GuestMemory + Sized,
    {
        if shape.count > MAX_DESCRIPTORS {
            return Err(malformed(format!(
                "more than {MAX_DESCRIPTORS} descriptors"
            )));
        }
        if shape.readable_after_writable {
            return Err(malformed(
                "a device-readable descriptor follows a device-writable one",
            ));
        }
        let mut reader: Reader<'_, B> = Reader::new(mem, chain.clone())
            .map_err(|e| malformed(format!("its readable buffers: {e}")))?;
        let mut writer: Writer<'_, B> =
            Writer::new(mem, chain).map_err(|e| malformed(format!("its writable buffers: {e}")))?;
        // The status byte is the writer's last byte; what comes before it is data.
        let writable = writer.available_bytes();
        let _status = writer
            .split_at(writable.saturating_sub(1))
            .map_err(|e| malformed(format!("its status byte: {e}")))?;
        let mut hdr = [0u8; 16];
        reader.read_exact(&mut hdr).map_err(|_| {
            malformed(format!(
                "its header has {} bytes, not 16",
                reader.bytes_read()
            ))
        })?;
        let kind = u32::from_le_bytes(hdr[0..4].try_into().expect("4 bytes"));
        let sector = u64::from_le_bytes(hdr[8..16].try_into().expect("8 bytes"));
        match kind {
            VIRTIO_BLK_T_IN => {
                let len = writer.available_bytes() as u64;
                let offset = self.range("read", sector, len)?;
                self.stats.read_ops.fetch_add(1, Relaxed);
                self.read(&mut writer, offset, len)?;
                u32::try_from(len).map_err(|_| malformed("a read of 4 GiB or more"))
            }
            VIRTIO_BLK_T_OUT => {
                self.writable("write")?;
                let len = reader.available_bytes() as u64;
                let offset = self.range("write", sector, len)?;
                self.stats.write_ops.fetch_add(1, Relaxed);
                self.write(&mut reader, offset, len)?;
                Ok(0)
            }
            VIRTIO_BLK_T_FLUSH => {
                self.stats.flush_ops.fetch_add(1, Relaxed);
                self.dev.flush().map_err(|e| io_fail("flush", &e))?;
                Ok(0)
            }
            VIRTIO_BLK_T_GET_ID => {
                let n = writer.available_bytes().min(self.geom.serial.len());
                writer
                    .write_all(&self.geom.serial[..n])
                    .map_err(|e| malformed(format!("its ID buffer: {e}")))?;
                Ok(n as u32)
            }
            VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
                let discard = kind == VIRTIO_BLK_T_DISCARD;
                let what = if discard { "discard" } else { "write-zeroes" };
                if (discard && !self.geom.discard) || (!discard && !self.geom.write_zeroes) {
                    if self.geom.read_only {
                        return Err(Fail {
                            status: VIRTIO_BLK_S_IOERR as u8,
                            malformed: false,
                            why: format!("a {what} on a read-only disk"),
                        });
                    }
                    return Err(Fail {
                        status: VIRTIO_BLK_S_UNSUPP as u8,
                        malformed: false,
                        why: format!("{what} is not offered"),
                    });
                }
                self.ranges(&mut reader, discard)?;
                Ok(0)
            }
            other => Err(Fail {
                status: VIRTIO_BLK_S_UNSUPP as u8,
                malformed: false,
                why: format!("request type {other} is not supported"),
            }),
        }
    }

    fn writable(&self, what: &str) -> Result<(), Fail> {
        if self.geom.read_only {
            return Err(Fail {
                status: VIRTIO_BLK_S_IOERR as u8,
                malformed: false,
                why: format!("a {what} on a read-only disk"),
            });
        }
        Ok(())
    }

    /// The byte offset of `sector`, once `len` bytes from there are checked to be inside
    /// the disk and aligned to its logical block.
    fn range(&self, what: &str, sector: u64, len: u64) -> Result<u64, Fail> {
        let block = u64::from(self.geom.logical_block);
        let offset = sector
            .checked_mul(512)
            .ok_or_else(|| malformed(format!("a {what} at sector {sector}, past any disk")))?;
        let end = offset
            .checked_add(len)
            .ok_or_else(|| malformed(format!("a {what} of {len} bytes at {offset} overflows")))?;
        if end > self.geom.size {
            return Err(malformed(format!(
                "a {what} of {len} bytes at {offset} ends past the disk's {} bytes",
                self.geom.size
            )));
        }
        if offset % block != 0 || len % block != 0 {
            return Err(malformed(format!("a {what} of {len} bytes at {offset} is not aligned to the {block}-byte logical block")));
        }
        Ok(offset)
    }

    fn read<B: BitmapSlice>(
        &mut self,
        writer: &mut Writer<'_, B>,
        offset: u64,
        len: u64,
    ) -> Result<(), Fail> {
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(PIECE as u64) as usize;
            self.buf.resize(n.max(self.buf.len()), 0);
            let piece = &mut self.buf[..n];
            self.dev
                .read_at(piece, offset + done)
                .map_err(|e| io_fail("read", &e))?;
            writer
                .write_all(piece)
                .map_err(|e| malformed(format!("its data buffers: {e}")))?;
            done += n as u64;
        }
        Ok(())
    }

    fn write<B: BitmapSlice>(
        &mut self,
        reader: &mut Reader<'_, B>,
        offset: u64,
        len: u64,
    ) -> Result<(), Fail> {
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(PIECE as u64) as usize;
            self.buf.resize(n.max(self.buf.len()), 0);
            let piece = &mut self.buf[..n];
            reader
                .read_exact(piece)
                .map_err(|e| malformed(format!("its data buffers: {e}")))?;
            self.dev
                .write_at(piece, offset + done, self.write_through)
                .map_err(|e| io_fail("write", &e))?;
            done += n as u64;
        }
        Ok(())
    }

    /// The segments of a discard or write-zeroes request, each checked before any is done.
    fn ranges<B: BitmapSlice>(
        &mut self,
        reader: &mut Reader<'_, B>,
        discard: bool,
    ) -> Result<(), Fail> {
        let what = if discard { "discard" } else { "write-zeroes" };
        let bytes = reader.available_bytes();
        if bytes == 0 || bytes % 16 != 0 || bytes / 16 > MAX_RANGE_SEGS as usize {
            return Err(malformed(format!("a {what} with {bytes} bytes of segments (16 a segment, 1 to {MAX_RANGE_SEGS} segments)")));
        }
        let mut segs = Vec::with_capacity(bytes / 16);
        for _ in 0..bytes / 16 {
            let mut s = [0u8; 16];
            reader
                .read_exact(&mut s)
                .map_err(|e| malformed(format!("its segments: {e}")))?;
            let sector = u64::from_le_bytes(s[0..8].try_into().expect("8 bytes"));
            let sectors = u32::from_le_bytes(s[8..12].try_into().expect("4 bytes"));
            let flags = u32::from_le_bytes(s[12..16].try_into().expect("4 bytes"));
            let allowed = if discard {
                0
            } else {
                VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP
            };
            if flags & !allowed != 0 {
                return Err(Fail {
                    status: VIRTIO_BLK_S_UNSUPP as u8,
                    malformed: false,
                    why: format!("a {what} with flags {flags:#x}"),
                });
            }
            if sectors > MAX_RANGE_SECTORS {
                return Err(malformed(format!(
                    "a {what} of {sectors} sectors, above the {MAX_RANGE_SECTORS} offered"
                )));
            }
            let len = u64::from(sectors) * 512;
            let offset = self.range(what, sector, len)?;
            segs.push((offset, len, flags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0));
        }
        for (offset, len, unmap) in segs {
            if discard {
                self.stats.discard_ops.fetch_add(1, Relaxed);
                self.dev
                    .trim(offset, len, self.write_through)
                    .map_err(|e| io_fail("discard", &e))?;
            } else {
                self.stats.zero_ops.fetch_add(1, Relaxed);
                let flags = ZeroFlags {
                    may_trim: unmap && self.geom.zeroes_may_unmap,
                    fua: self.write_through,
                    ..ZeroFlags::default()
                };
                self.dev
                    .write_zeroes(offset, len, flags)
                    .map_err(|e| io_fail("write-zeroes", &e))?;
            }
        }
        Ok(())
    }
}

fn io_fail(what: &str, e: &vdstream_blockdev::Error) -> Fail {
    Fail {
        status: VIRTIO_BLK_S_IOERR as u8,
        malformed: false,
        why: format!("the {what} failed: {e}"),
    }
}

/// Where the status byte is: the last byte of the last descriptor, which must be
/// device-writable and not empty.
/// What a walk of the chain saw, without keeping its descriptors.
struct Shape {
    count: usize,
    readable_after_writable: bool,
    last: Option<Descriptor>,
}

impl Shape {
    fn of<T>(chain: DescriptorChain<T>) -> Shape
    where
        T: std::ops::Deref,
        T::Target: GuestMemory + Sized,
    {
        let mut shape = Shape {
            count: 0,
            readable_after_writable: false,
            last: None,
        };
        let mut writable_seen = false;
        for d in chain.take(MAX_DESCRIPTORS + 1) {
            shape.count += 1;
            writable_seen |= d.is_write_only();
            shape.readable_after_writable |= writable_seen && !d.is_write_only();
            shape.last = Some(d);
        }
        shape
    }
}

fn status_address(shape: &Shape) -> Result<GuestAddress, &'static str> {
    let last = shape.last.as_ref().ok_or("no descriptors")?;
    if last.has_next() {
        // virtio-queue ends a chain quietly on a loop, a next index past the queue, a bad
        // indirect table or more than 4 GiB: its real end, and so its status, is unknown.
        return Err("the chain breaks off (a loop, a next index past the queue, a bad indirect table, or over 4 GiB of buffers)");
    }
    if !last.is_write_only() {
        return Err("its last descriptor is not device-writable");
    }
    if last.len() == 0 {
        return Err("its last descriptor is empty");
    }
    last.addr()
        .0
        .checked_add(u64::from(last.len()) - 1)
        .map(GuestAddress)
        .ok_or("its last descriptor wraps around the address space")
}

#[cfg(test)]
mod tests;
