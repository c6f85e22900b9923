//! The block device trait stack of vdstream.
//!
//! Every box in the data path is a [`BlockDev`]: the sparse [`MemoryDev`], the raw
//! [`FileDev`], and (in other crates) every write-cache type, the version chain of a vDisk
//! and the remote base of an agent. A write cache is a `BlockDev` that wraps a read-only
//! lower one, so layers stack the way nbdkit filters do. A wrapper that changes only some
//! requests (counting, tracing, a read cache, a journal's flush) is a [`Filter`]: every
//! capability it does not override passes to the device below.
//!
//! ```text
//!            BlockDev  (read, write, flush, trim, zero, block status, cache; Caps says which)
//!           /    |    \
//!   MemoryDev  FileDev  <write caches, version chains, remote base: other crates>
//! ```
//!
//! Invariants every implementation keeps (and the conformance suite checks):
//! - Callers pass ranges inside `size()`; the NBD edge validates them before they get here,
//!   so a device may answer an out-of-range request with [`ErrorKind::OutOfRange`] but never
//!   panics on one.
//! - A read always fills the whole buffer. Bytes never written, trimmed or zeroed read as 0.
//! - `&self` everywhere: a device is shared by many connections and does its own locking,
//!   sharded by block rather than one lock over the whole device.
//! - [`Caps`] tells the truth: the NBD server derives what it advertises from it, and never
//!   from a hand-kept list.

pub mod engine;
pub mod error;
pub mod file;
pub mod flock;
pub mod layerfile;
pub mod lograte;
pub mod memory;
pub mod readonly;
pub mod reclaim;
pub mod ring;
pub mod span;
pub mod storefile;
pub mod trace;
pub mod uring;

#[cfg(any(test, feature = "conformance"))]
pub mod conformance;

use std::sync::Arc;

pub use engine::{IoEngine, IoEngineKind};
pub use error::{Error, ErrorKind, Op, Result};
pub use file::{FileDev, FileOptions};
pub use memory::MemoryDev;
pub use readonly::ReadOnly;
pub use trace::{TraceDev, TraceError, TraceOp, TraceReader, TraceRecord};

/// What a device can do. The NBD server turns this into transmission flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// Writes, trims and zeroes are refused.
    pub read_only: bool,
    /// `flush` is offered (NBD `SEND_FLUSH`): it returns once every completed write is as
    /// durable as this device makes anything. A RAM disk offers it and answers at once, as
    /// nbdkit's memory plugin does, so clients that flush (qemu-img, libnbd) work.
    pub flush: bool,
    /// `fua` on a write is offered (NBD `SEND_FUA`): that write is as durable as a flush
    /// would make it before it returns.
    pub fua: bool,
    /// `trim` gives space back (NBD `SEND_TRIM`).
    pub trim: bool,
    /// `write_zeroes` is native, cheaper than writing a buffer of zeros (NBD `SEND_WRITE_ZEROES`).
    pub zeroes: bool,
    /// `write_zeroes` with `fast_only` answers [`ErrorKind::NotFast`] when it would be slow (NBD `SEND_FAST_ZERO`).
    pub fast_zero: bool,
    /// `cache` (prefetch) is offered (NBD `SEND_CACHE`); a device already in RAM answers at once.
    pub cache: bool,
    /// `block_status` reports real holes and zeros, not just "all data".
    pub block_status: bool,
    /// Every connection sees the same state, and a flush on one makes every connection's
    /// completed writes durable (NBD `CAN_MULTI_CONN`).
    pub multi_conn: bool,
    /// Operations may sleep on I/O: run them off the connection's request reader.
    pub may_block: bool,
    /// The smallest I/O the device handles without read-modify-write penalty.
    pub preferred_block: u32,
}

impl Default for Caps {
    fn default() -> Self {
        Caps {
            read_only: true,
            flush: false,
            fua: false,
            trim: false,
            zeroes: false,
            fast_zero: false,
            cache: false,
            block_status: false,
            multi_conn: true,
            may_block: true,
            preferred_block: 4096,
        }
    }
}

/// Flags of a write-zeroes request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZeroFlags {
    /// The device may deallocate the range (NBD: `NO_HOLE` not set).
    pub may_trim: bool,
    /// Fail with [`ErrorKind::NotFast`] rather than zero slowly (NBD `FAST_ZERO`).
    pub fast_only: bool,
    /// Durable before return (NBD `FUA`).
    pub fua: bool,
}

/// One run of a block-status answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub len: u64,
    /// Not allocated: reading returns zeros and costs no storage.
    pub hole: bool,
    /// Reads as zeros (true for every hole).
    pub zero: bool,
}

/// A hole found while reading, relative to the start of the read buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hole {
    pub start: usize,
    pub len: usize,
}

/// A block device: the one trait every layer of the data path implements.
pub trait BlockDev: Send + Sync + std::fmt::Debug {
    /// Size in bytes. Constant for the life of the device.
    fn size(&self) -> u64;

    /// What this device can do.
    fn caps(&self) -> Caps;

    /// Fills `buf` from `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()>;

    /// Like `read_at`, and also appends to `holes` the parts of `buf` that are unallocated
    /// (they are zeroed in `buf` too, so a caller may ignore `holes`). The default reports
    /// no holes; devices that know them cheaply while reading override it.
    fn read_at_sparse(&self, buf: &mut [u8], offset: u64, holes: &mut Vec<Hole>) -> Result<()> {
        let _ = holes;
        self.read_at(buf, offset)
    }

    /// Writes `buf` at `offset`; with `fua`, durable before returning.
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()>;

    /// Makes every completed write durable.
    fn flush(&self) -> Result<()> {
        Ok(())
    }

    /// Discards a range: afterwards it reads as zeros (NBD allows any content after TRIM; we
    /// promise zeros, which every layer above can rely on).
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()>;

    /// Makes a range read as zeros.
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()>;

    /// Appends extents describing `[offset, offset+len)` to `out`. They must start at
    /// `offset`, be non-empty, and may stop short of `offset+len`; for `len > 0` there is at
    /// least one. (`len == 0` appends nothing; the NBD edge refuses zero-length requests.)
    fn block_status(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        let _ = offset;
        out.push(Extent {
            len,
            hole: false,
            zero: false,
        });
        Ok(())
    }

    /// Advises that a range will be read soon.
    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        let _ = (offset, len);
        Ok(())
    }

    /// A short name for messages and logs: a path, "memory", a target id.
    fn describe(&self) -> String;

    /// Runs every read and write of `ops`, setting each one's `result`. The ops were in
    /// flight together, so they may run in any order or at once (NBD gives overlapping
    /// requests in flight no order). The default runs them one by one with `read_at` and
    /// `write_at`; a device whose I/O is asynchronous underneath submits them together.
    fn io_batch(&self, ops: &mut [BatchOp<'_>]) {
        for op in ops {
            op.run_alone(self);
        }
    }

    /// Whether [`io_batch`](Self::io_batch) is worth more than one call per request (the
    /// NBD server then hands this device a connection's requests in batches).
    fn prefers_batches(&self) -> bool {
        false
    }
}

/// One read or write of an [`BlockDev::io_batch`] call.
#[derive(Debug)]
pub struct BatchOp<'a> {
    pub offset: u64,
    pub io: BatchIo<'a>,
    /// Set by `io_batch`.
    pub result: Result<()>,
    /// Set by `io_batch` for a read, as `read_at_sparse` sets it: parts of the buffer known
    /// to be unallocated (a device may leave it empty).
    pub holes: Vec<Hole>,
}

/// What a [`BatchOp`] does.
#[derive(Debug)]
pub enum BatchIo<'a> {
    Read(&'a mut [u8]),
    /// The bytes, and whether the write is FUA.
    Write(&'a [u8], bool),
}

impl<'a> BatchOp<'a> {
    /// A read of `buf.len()` bytes at `offset`, not run yet.
    pub fn read(buf: &'a mut [u8], offset: u64) -> Self {
        BatchOp {
            offset,
            io: BatchIo::Read(buf),
            result: Ok(()),
            holes: Vec::new(),
        }
    }

    /// A write of `buf` at `offset`, not run yet.
    pub fn write(buf: &'a [u8], offset: u64, fua: bool) -> Self {
        BatchOp {
            offset,
            io: BatchIo::Write(buf, fua),
            result: Ok(()),
            holes: Vec::new(),
        }
    }

    pub fn len(&self) -> usize {
        match &self.io {
            BatchIo::Read(b) => b.len(),
            BatchIo::Write(b, _) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn is_write(&self) -> bool {
        matches!(self.io, BatchIo::Write(..))
    }

    /// Runs this op on its own with `read_at_sparse` or `write_at` of `dev` and sets its result:
    /// what [`BlockDev::io_batch`] does by default, and what a batching device does with
    /// the ops it does not batch.
    pub fn run_alone<D: BlockDev + ?Sized>(&mut self, dev: &D) {
        self.result = match &mut self.io {
            BatchIo::Read(buf) => dev.read_at_sparse(buf, self.offset, &mut self.holes),
            BatchIo::Write(buf, fua) => dev.write_at(buf, self.offset, *fua),
        };
    }
}

/// A device over another (nbdkit's filters): every `Filter` is a [`BlockDev`] whose methods
/// forward to [`inner`](Filter::inner) unless it overrides them, so a wrapper changes only
/// what it means to and never drops a capability (batching, sparse reads, block status).
/// - A filter that changes reads or writes also overrides [`io_batch`](Filter::io_batch).
/// - In `impl Filter for X`, reach the device below by `self.inner()` (`Arc<T>` is a filter
///   too, so `self.arc_field.read_at(..)` is ambiguous there).
/// - A new [`BlockDev`] method gets a forwarding default here and a line in the blanket
///   impl; the test `every_capability_flows_through_filters` fails until it does.
pub trait Filter: Send + Sync + std::fmt::Debug {
    /// The device below.
    type Inner: BlockDev + ?Sized;
    fn inner(&self) -> &Self::Inner;

    fn size(&self) -> u64 {
        self.inner().size()
    }
    fn caps(&self) -> Caps {
        self.inner().caps()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.inner().read_at(buf, offset)
    }
    fn read_at_sparse(&self, buf: &mut [u8], offset: u64, holes: &mut Vec<Hole>) -> Result<()> {
        self.inner().read_at_sparse(buf, offset, holes)
    }
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.inner().write_at(buf, offset, fua)
    }
    fn flush(&self) -> Result<()> {
        self.inner().flush()
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.inner().trim(offset, len, fua)
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.inner().write_zeroes(offset, len, flags)
    }
    fn block_status(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        self.inner().block_status(offset, len, out)
    }
    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        self.inner().cache(offset, len)
    }
    fn describe(&self) -> String {
        self.inner().describe()
    }
    fn io_batch(&self, ops: &mut [BatchOp<'_>]) {
        self.inner().io_batch(ops)
    }
    fn prefers_batches(&self) -> bool {
        self.inner().prefers_batches()
    }
}

impl<F: Filter> BlockDev for F {
    fn size(&self) -> u64 {
        Filter::size(self)
    }
    fn caps(&self) -> Caps {
        Filter::caps(self)
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        Filter::read_at(self, buf, offset)
    }
    fn read_at_sparse(&self, buf: &mut [u8], offset: u64, holes: &mut Vec<Hole>) -> Result<()> {
        Filter::read_at_sparse(self, buf, offset, holes)
    }
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        Filter::write_at(self, buf, offset, fua)
    }
    fn flush(&self) -> Result<()> {
        Filter::flush(self)
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        Filter::trim(self, offset, len, fua)
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        Filter::write_zeroes(self, offset, len, flags)
    }
    fn block_status(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        Filter::block_status(self, offset, len, out)
    }
    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        Filter::cache(self, offset, len)
    }
    fn describe(&self) -> String {
        Filter::describe(self)
    }
    fn io_batch(&self, ops: &mut [BatchOp<'_>]) {
        Filter::io_batch(self, ops)
    }
    fn prefers_batches(&self) -> bool {
        Filter::prefers_batches(self)
    }
}

/// A shared or boxed device is the device itself.
impl<T: BlockDev + ?Sized> Filter for Arc<T> {
    type Inner = T;
    fn inner(&self) -> &T {
        self
    }
}

impl<T: BlockDev + ?Sized> Filter for Box<T> {
    type Inner = T;
    fn inner(&self) -> &T {
        self
    }
}

/// Checks that `[offset, offset+len)` lies inside a device of `size` bytes.
pub fn check_range(
    size: u64,
    op: Op,
    offset: u64,
    len: u64,
    device: &dyn Fn() -> String,
) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(Error::new(
            ErrorKind::OutOfRange,
            op,
            offset,
            len,
            device(),
            format!("the range ends past the device size of {size} bytes"),
        )),
    }
}

/// Locks `m`, taking the data of a lock poisoned by a panicking holder: every structure
/// this workspace keeps under a mutex stays consistent at each await or early return, so
/// a panic elsewhere must not stop the other connections.
pub fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    /// The names of the `fn`s in the block of `src` that starts with `head`.
    fn fns_of(src: &str, head: &str) -> Vec<String> {
        let body = &src[src.find(head).unwrap_or_else(|| panic!("no {head:?}"))..];
        let body = &body[..body.find("\n}\n").expect("the block ends")];
        let mut names: Vec<String> = body
            .split("fn ")
            .skip(1)
            .map(|rest| {
                rest.split(|c: char| !c.is_alphanumeric() && c != '_')
                    .next()
                    .unwrap()
                    .to_string()
            })
            .filter(|n| n != "inner")
            .collect();
        names.sort();
        names
    }

    #[test]
    fn every_capability_flows_through_filters() {
        let src = include_str!("lib.rs");
        let dev = fns_of(src, "pub trait BlockDev:");
        assert!(dev.len() >= 13, "found {dev:?}");
        assert_eq!(
            fns_of(src, "pub trait Filter:"),
            dev,
            "every BlockDev method has a forwarding default in Filter"
        );
        assert_eq!(
            fns_of(src, "impl<F: Filter> BlockDev for F"),
            dev,
            "and a line in the blanket impl"
        );
    }
}
