//! I/O traces: what a guest asked of a device, request by request, in a compact binary file.
//!
//! [`TraceDev`] wraps any [`BlockDev`], forwards every request unchanged and records its
//! offset, length, operation and time; [`TraceReader`] reads the file back (`vdstream size`
//! replays it through the write-cache types). The agent puts a `TraceDev` on top of its
//! stack (`target attach --record-trace FILE`), as does `serve-image --record-trace FILE`,
//! so a trace holds exactly the requests the local NBD export received.
//!
//! File format, version 1 (all integers little-endian):
//!
//! ```text
//! header, 32 bytes:
//!   0  magic        8 bytes  "VDSTRACE"
//!   8  version      u16      1
//!  10  record_size  u16      24
//!  12  reserved     u32      0
//!  16  device_size  u64      size in bytes of the traced device
//!  24  start_unix_ns u64     wall-clock time of the first possible record (ns since 1970)
//! records, 24 bytes each, in time order:
//!   0  time_ns      u64      when the request arrived, ns after the start
//!   8  offset       u64      bytes (0 for flush)
//!  16  length       u32      bytes (0 for flush)
//!  20  op           u8       1 read, 2 write, 3 trim, 4 write-zeroes, 5 flush
//!  21  flags        u8       bit 0: FUA; bit 1: write-zeroes may trim (NBD: no NO_HOLE)
//!  22  reserved     u16      0
//! ```
//!
//! Invariants:
//! - Records are in non-decreasing `time_ns` order: the time is taken and the record
//!   queued under one short lock, which is the only thing a request waits for; a
//!   background thread writes queued records in chunks of up to [`CHUNK_RECORDS`], and at
//!   least once a second, so a crash loses at most about a second of trace.
//! - A request is recorded when it arrives, before it is forwarded, whether or not it then
//!   succeeds. Block-status and cache (prefetch) requests move no data and are not recorded.
//! - [`TraceDev::finish`] (also run on drop) writes everything queued and syncs the file; a
//!   process stopped by SIGINT/SIGTERM loses nothing.
//! - A reader refuses a file with another magic or version, or whose length is not the
//!   header plus whole records, naming the file and the byte offset at fault.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::{BatchIo, BatchOp, BlockDev, Hole, Result, ZeroFlags};

/// The first 8 bytes of every trace file.
pub const MAGIC: &[u8; 8] = b"VDSTRACE";
/// The format version this code writes and reads.
pub const VERSION: u16 = 1;
/// Bytes of the header.
pub const HEADER_LEN: u64 = 32;
/// Bytes of one record.
pub const RECORD_LEN: u64 = 24;
/// Records the writer thread takes at once at most (about 96 KiB).
pub const CHUNK_RECORDS: usize = 4096;

/// The operation of one traced request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TraceOp {
    Read = 1,
    Write = 2,
    Trim = 3,
    Zero = 4,
    Flush = 5,
}

impl TraceOp {
    pub const ALL: [TraceOp; 5] = [
        TraceOp::Read,
        TraceOp::Write,
        TraceOp::Trim,
        TraceOp::Zero,
        TraceOp::Flush,
    ];

    fn from_code(code: u8) -> Option<TraceOp> {
        TraceOp::ALL.into_iter().find(|op| *op as u8 == code)
    }

    /// The name used in reports: read, write, trim, zero, flush.
    pub fn name(self) -> &'static str {
        match self {
            TraceOp::Read => "read",
            TraceOp::Write => "write",
            TraceOp::Trim => "trim",
            TraceOp::Zero => "zero",
            TraceOp::Flush => "flush",
        }
    }
}

impl std::fmt::Display for TraceOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Flag bit: the request was FUA.
pub const FLAG_FUA: u8 = 1;
/// Flag bit: a write-zeroes request that may deallocate (NBD: `NO_HOLE` not set).
pub const FLAG_MAY_TRIM: u8 = 2;

/// One traced request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceRecord {
    /// Nanoseconds after the trace's start.
    pub time_ns: u64,
    pub offset: u64,
    pub length: u32,
    pub op: TraceOp,
    pub flags: u8,
}

impl TraceRecord {
    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.time_ns.to_le_bytes());
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.length.to_le_bytes());
        out.push(self.op as u8);
        out.push(self.flags);
        out.extend_from_slice(&[0, 0]);
    }
}

/// What is wrong with a trace file, naming it and the byte offset at fault.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    // The OS error is in the message, so it is not also `source()` (printed twice by `{:#}`).
    #[error("{}: {what}: {err}", path.display())]
    Io {
        path: PathBuf,
        what: &'static str,
        err: std::io::Error,
    },
    #[error("{} is not a vdstream I/O trace (bytes 0-7 are {found:?}, not \"VDSTRACE\"); record one with --record-trace", path.display())]
    BadMagic { path: PathBuf, found: String },
    #[error("{}: trace format version {version} (or record size {record_size}) is not supported: this vdstream reads version {VERSION} with {RECORD_LEN}-byte records", path.display())]
    BadVersion {
        path: PathBuf,
        version: u16,
        record_size: u16,
    },
    #[error("{}: truncated at byte offset {offset}: {what} needs {needed} bytes, the file ends after {have}", path.display())]
    Truncated {
        path: PathBuf,
        offset: u64,
        what: &'static str,
        needed: u64,
        have: u64,
    },
    #[error("{}: record at byte offset {offset} has unknown operation code {code} (expected 1-5)", path.display())]
    BadOp {
        path: PathBuf,
        offset: u64,
        code: u8,
    },
    #[error("{}: record at byte offset {offset} goes back in time ({time_ns} ns after one at {previous_ns} ns)", path.display())]
    OutOfOrder {
        path: PathBuf,
        offset: u64,
        time_ns: u64,
        previous_ns: u64,
    },
    /// A later `finish` of a writer whose recording failed: the first error, again.
    #[error("{message}")]
    Failed { message: String },
}

/// The header of a trace file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceHeader {
    pub device_size: u64,
    pub start_unix_ns: u64,
}

impl TraceHeader {
    fn encode(&self) -> [u8; HEADER_LEN as usize] {
        let mut h = [0u8; HEADER_LEN as usize];
        h[..8].copy_from_slice(MAGIC);
        h[8..10].copy_from_slice(&VERSION.to_le_bytes());
        h[10..12].copy_from_slice(&(RECORD_LEN as u16).to_le_bytes());
        h[16..24].copy_from_slice(&self.device_size.to_le_bytes());
        h[24..32].copy_from_slice(&self.start_unix_ns.to_le_bytes());
        h
    }
}

/// Records queued for the writer thread, and whether recording has stopped.
#[derive(Debug, Default)]
struct Queue {
    records: Vec<TraceRecord>,
    done: bool,
}

#[derive(Debug)]
struct Shared {
    start: Instant,
    queue: Mutex<Queue>,
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Writes a trace file from a background thread. Cheap to call from many threads at once.
#[derive(Debug)]
pub struct TraceWriter {
    shared: Arc<Shared>,
    writer: Mutex<Writer>,
    path: PathBuf,
}

/// The writer thread while it runs; once `finish` joined it, how it ended (the count of
/// records written, or its error's message), for the calls after.
#[derive(Debug)]
enum Writer {
    Running(JoinHandle<std::result::Result<u64, TraceError>>),
    Finished(std::result::Result<u64, String>),
}

impl TraceWriter {
    /// Creates (or truncates) `path` and writes the header of a trace of a device of
    /// `device_size` bytes.
    pub fn create(path: &Path, device_size: u64) -> std::result::Result<TraceWriter, TraceError> {
        let io = |what, err| TraceError::Io {
            path: path.to_path_buf(),
            what,
            err,
        };
        let file = File::create(path).map_err(|e| io("cannot create the trace file", e))?;
        let start_unix_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(
            &TraceHeader {
                device_size,
                start_unix_ns,
            }
            .encode(),
        )
        .map_err(|e| io("cannot write the trace header", e))?;
        out.flush()
            .map_err(|e| io("cannot write the trace header", e))?;
        let shared = Arc::new(Shared {
            start: Instant::now(),
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
        });
        let (s, p) = (shared.clone(), path.to_path_buf());
        let thread = std::thread::Builder::new()
            .name("trace-writer".into())
            .spawn(move || write_loop(&s, out, &p))
            .map_err(|e| io("cannot start the trace writer thread", e))?;
        Ok(TraceWriter {
            shared,
            writer: Mutex::new(Writer::Running(thread)),
            path: path.to_path_buf(),
        })
    }

    /// Queues one record stamped with the time now.
    pub fn record(&self, op: TraceOp, offset: u64, length: u64, flags: u8) {
        let mut q = self.shared.lock();
        if q.done {
            return;
        }
        let time_ns = self.shared.start.elapsed().as_nanos() as u64;
        q.records.push(TraceRecord {
            time_ns,
            offset,
            length: length.min(u32::MAX as u64) as u32,
            op,
            flags,
        });
        if q.records.len() == CHUNK_RECORDS {
            self.shared.wake.notify_one();
        }
    }

    /// Stops recording, writes every queued record and syncs the file; returns how many
    /// records the file holds. Later calls return the same count (or error) without work.
    pub fn finish(&self) -> std::result::Result<u64, TraceError> {
        self.shared.lock().done = true;
        self.shared.wake.notify_one();
        // Held across the join, so that a concurrent call waits for the outcome.
        let mut writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        match std::mem::replace(&mut *writer, Writer::Finished(Ok(0))) {
            Writer::Running(h) => {
                let result = h.join().unwrap_or_else(|_| {
                    Err(TraceError::Io {
                        path: self.path.clone(),
                        what: "the trace writer thread failed",
                        err: std::io::Error::other("panicked"),
                    })
                });
                *writer =
                    Writer::Finished(result.as_ref().map(|n| *n).map_err(ToString::to_string));
                result
            }
            Writer::Finished(outcome) => {
                *writer = Writer::Finished(outcome.clone());
                outcome.map_err(|message| TraceError::Failed { message })
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TraceWriter {
    /// Finishes a trace nobody finished, logging its error (a `finish` before already
    /// returned it to its caller).
    fn drop(&mut self) {
        if matches!(
            self.writer
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner),
            Writer::Running(_)
        ) {
            if let Err(e) = self.finish() {
                log::error!("{e}");
            }
        }
    }
}

/// The writer thread: takes whatever is queued when woken (a full chunk, or once a
/// second), encodes it outside the lock and writes it.
fn write_loop(
    shared: &Shared,
    mut out: BufWriter<File>,
    path: &Path,
) -> std::result::Result<u64, TraceError> {
    let io = |what, err| TraceError::Io {
        path: path.to_path_buf(),
        what,
        err,
    };
    let mut taken = Vec::with_capacity(CHUNK_RECORDS);
    let mut bytes = Vec::with_capacity(CHUNK_RECORDS * RECORD_LEN as usize);
    let mut written = 0u64;
    let mut failed = None;
    loop {
        let done = {
            let q = shared.lock();
            let (mut q, _) = shared
                .wake
                .wait_timeout_while(q, Duration::from_secs(1), |q| {
                    !q.done && q.records.len() < CHUNK_RECORDS
                })
                .unwrap_or_else(PoisonError::into_inner);
            std::mem::swap(&mut q.records, &mut taken);
            q.done
        };
        if failed.is_none() && !taken.is_empty() {
            bytes.clear();
            for r in &taken {
                r.encode(&mut bytes);
            }
            match out.write_all(&bytes) {
                Ok(()) => written += taken.len() as u64,
                Err(e) => {
                    log::error!(
                        "{}: cannot write the trace, recording stops: {e}",
                        path.display()
                    );
                    failed = Some(e);
                }
            }
            if failed.is_none() && !done {
                // Hand the chunk to the kernel so that a crash loses little.
                if let Err(e) = out.flush() {
                    failed = Some(e);
                }
            }
        }
        taken.clear();
        if done {
            break;
        }
    }
    if let Some(e) = failed {
        return Err(io("cannot write the trace", e));
    }
    out.flush().map_err(|e| io("cannot write the trace", e))?;
    out.get_ref()
        .sync_data()
        .map_err(|e| io("cannot sync the trace", e))?;
    Ok(written)
}

/// A block device that records every request into a trace, then forwards it to `inner`.
#[derive(Debug)]
pub struct TraceDev {
    inner: Arc<dyn BlockDev>,
    writer: TraceWriter,
}

impl TraceDev {
    /// Starts recording the requests `inner` receives into a new trace file at `path`.
    pub fn create(
        inner: Arc<dyn BlockDev>,
        path: &Path,
    ) -> std::result::Result<TraceDev, TraceError> {
        let writer = TraceWriter::create(path, inner.size())?;
        Ok(TraceDev { inner, writer })
    }

    /// Stops recording and writes out the trace; returns how many records it holds.
    pub fn finish(&self) -> std::result::Result<u64, TraceError> {
        self.writer.finish()
    }

    pub fn trace_path(&self) -> &Path {
        self.writer.path()
    }
}

/// Records, then forwards; everything else (size, caps, block status, batching) passes through.
impl crate::Filter for TraceDev {
    type Inner = dyn BlockDev;
    fn inner(&self) -> &Self::Inner {
        &*self.inner
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.writer
            .record(TraceOp::Read, offset, buf.len() as u64, 0);
        self.inner().read_at(buf, offset)
    }
    fn read_at_sparse(&self, buf: &mut [u8], offset: u64, holes: &mut Vec<Hole>) -> Result<()> {
        self.writer
            .record(TraceOp::Read, offset, buf.len() as u64, 0);
        self.inner().read_at_sparse(buf, offset, holes)
    }
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.writer.record(
            TraceOp::Write,
            offset,
            buf.len() as u64,
            if fua { FLAG_FUA } else { 0 },
        );
        self.inner().write_at(buf, offset, fua)
    }
    fn flush(&self) -> Result<()> {
        self.writer.record(TraceOp::Flush, 0, 0, 0);
        self.inner().flush()
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.writer
            .record(TraceOp::Trim, offset, len, if fua { FLAG_FUA } else { 0 });
        self.inner().trim(offset, len, fua)
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        let f =
            if flags.fua { FLAG_FUA } else { 0 } | if flags.may_trim { FLAG_MAY_TRIM } else { 0 };
        self.writer.record(TraceOp::Zero, offset, len, f);
        self.inner().write_zeroes(offset, len, flags)
    }
    fn io_batch(&self, ops: &mut [BatchOp<'_>]) {
        for op in ops.iter() {
            match &op.io {
                BatchIo::Read(b) => self
                    .writer
                    .record(TraceOp::Read, op.offset, b.len() as u64, 0),
                BatchIo::Write(b, fua) => self.writer.record(
                    TraceOp::Write,
                    op.offset,
                    b.len() as u64,
                    if *fua { FLAG_FUA } else { 0 },
                ),
            }
        }
        self.inner().io_batch(ops)
    }
}

/// Reads a trace file record by record (an iterator of `Result<TraceRecord, TraceError>`).
#[derive(Debug)]
pub struct TraceReader {
    path: PathBuf,
    input: BufReader<File>,
    header: TraceHeader,
    file_len: u64,
    /// Byte offset of the next record.
    pos: u64,
    last_ns: u64,
}

impl TraceReader {
    /// Opens `path` and checks its header and length.
    pub fn open(path: &Path) -> std::result::Result<TraceReader, TraceError> {
        let io = |what, err| TraceError::Io {
            path: path.to_path_buf(),
            what,
            err,
        };
        let file = File::open(path).map_err(|e| io("cannot open the trace", e))?;
        let file_len = file
            .metadata()
            .map_err(|e| io("cannot read the trace", e))?
            .len();
        let mut input = BufReader::with_capacity(1 << 20, file);
        let mut h = [0u8; HEADER_LEN as usize];
        let n = read_full(&mut input, &mut h).map_err(|e| io("cannot read the trace", e))?;
        if n >= 8 && &h[..8] != MAGIC || n < 8 && !MAGIC.starts_with(&h[..n]) {
            return Err(TraceError::BadMagic {
                path: path.to_path_buf(),
                found: String::from_utf8_lossy(&h[..n.min(8)]).into_owned(),
            });
        }
        if (n as u64) < HEADER_LEN {
            return Err(TraceError::Truncated {
                path: path.to_path_buf(),
                offset: 0,
                what: "the header",
                needed: HEADER_LEN,
                have: n as u64,
            });
        }
        let u16_at = |i: usize| u16::from_le_bytes([h[i], h[i + 1]]);
        let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
        let (version, record_size) = (u16_at(8), u16_at(10));
        if version != VERSION || record_size as u64 != RECORD_LEN {
            return Err(TraceError::BadVersion {
                path: path.to_path_buf(),
                version,
                record_size,
            });
        }
        let body = file_len - HEADER_LEN;
        if body % RECORD_LEN != 0 {
            let offset = HEADER_LEN + body / RECORD_LEN * RECORD_LEN;
            return Err(TraceError::Truncated {
                path: path.to_path_buf(),
                offset,
                what: "the last record",
                needed: RECORD_LEN,
                have: body % RECORD_LEN,
            });
        }
        let header = TraceHeader {
            device_size: u64_at(16),
            start_unix_ns: u64_at(24),
        };
        Ok(TraceReader {
            path: path.to_path_buf(),
            input,
            header,
            file_len,
            pos: HEADER_LEN,
            last_ns: 0,
        })
    }

    pub fn header(&self) -> TraceHeader {
        self.header
    }

    /// How many records the file holds (known from its length).
    pub fn record_count(&self) -> u64 {
        (self.file_len - HEADER_LEN) / RECORD_LEN
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn next_record(&mut self) -> std::result::Result<Option<TraceRecord>, TraceError> {
        let mut r = [0u8; RECORD_LEN as usize];
        let n = read_full(&mut self.input, &mut r).map_err(|err| TraceError::Io {
            path: self.path.clone(),
            what: "cannot read the trace",
            err,
        })?;
        if n == 0 {
            return Ok(None);
        }
        let offset = self.pos;
        if (n as u64) < RECORD_LEN {
            // The file shrank after it was opened.
            return Err(TraceError::Truncated {
                path: self.path.clone(),
                offset,
                what: "a record",
                needed: RECORD_LEN,
                have: n as u64,
            });
        }
        self.pos += RECORD_LEN;
        let u64_at = |i: usize| u64::from_le_bytes(r[i..i + 8].try_into().expect("8 bytes"));
        let op = TraceOp::from_code(r[20]).ok_or(TraceError::BadOp {
            path: self.path.clone(),
            offset,
            code: r[20],
        })?;
        let time_ns = u64_at(0);
        if time_ns < self.last_ns {
            return Err(TraceError::OutOfOrder {
                path: self.path.clone(),
                offset,
                time_ns,
                previous_ns: self.last_ns,
            });
        }
        self.last_ns = time_ns;
        Ok(Some(TraceRecord {
            time_ns,
            offset: u64_at(8),
            length: u32::from_le_bytes([r[16], r[17], r[18], r[19]]),
            op,
            flags: r[21],
        }))
    }
}

impl Iterator for TraceReader {
    type Item = std::result::Result<TraceRecord, TraceError>;
    fn next(&mut self) -> Option<Self::Item> {
        self.next_record().transpose()
    }
}

/// Reads until `buf` is full or the input ends; returns the bytes read.
fn read_full(input: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match input.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryDev;
    use std::os::unix::fs::OpenOptionsExt;

    fn read_all(path: &Path) -> std::result::Result<Vec<TraceRecord>, TraceError> {
        TraceReader::open(path)?.collect()
    }

    #[test]
    fn a_traced_device_records_every_request_and_forwards_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.trace");
        let mem: Arc<dyn BlockDev> = Arc::new(MemoryDev::new(1 << 20));
        let dev = TraceDev::create(mem.clone(), &path).unwrap();
        dev.write_at(&[7u8; 4096], 8192, true).unwrap();
        let mut buf = [0u8; 512];
        dev.read_at(&mut buf, 8192).unwrap();
        assert_eq!(buf, [7u8; 512], "reads are forwarded");
        dev.trim(0, 4096, false).unwrap();
        dev.write_zeroes(
            4096,
            4096,
            ZeroFlags {
                may_trim: true,
                ..ZeroFlags::default()
            },
        )
        .unwrap();
        dev.flush().unwrap();
        let (mut a, b) = ([0u8; 4096], [1u8; 4096]);
        let mut ops = [BatchOp::read(&mut a, 0), BatchOp::write(&b, 65536, false)];
        dev.io_batch(&mut ops);
        assert_eq!(dev.finish().unwrap(), 7);
        let reader = TraceReader::open(&path).unwrap();
        assert_eq!(reader.header().device_size, 1 << 20);
        assert_eq!(reader.record_count(), 7);
        let recs = read_all(&path).unwrap();
        let ops: Vec<_> = recs
            .iter()
            .map(|r| (r.op, r.offset, r.length, r.flags))
            .collect();
        assert_eq!(
            ops,
            vec![
                (TraceOp::Write, 8192, 4096, FLAG_FUA),
                (TraceOp::Read, 8192, 512, 0),
                (TraceOp::Trim, 0, 4096, 0),
                (TraceOp::Zero, 4096, 4096, FLAG_MAY_TRIM),
                (TraceOp::Flush, 0, 0, 0),
                (TraceOp::Read, 0, 4096, 0),
                (TraceOp::Write, 65536, 4096, 0),
            ]
        );
        assert!(recs.windows(2).all(|w| w[0].time_ns <= w[1].time_ns));
        // finish is idempotent, and recording after it is ignored
        dev.write_at(&[1u8; 512], 0, false).unwrap();
        assert_eq!(dev.finish().unwrap(), 7);
        assert_eq!(read_all(&path).unwrap().len(), 7);
    }

    #[test]
    fn a_failed_recording_says_so_on_every_finish() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.fifo");
        let cpath = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path; mkfifo has no other preconditions.
        assert_eq!(unsafe { libc::mkfifo(cpath.as_ptr(), 0o600) }, 0, "mkfifo");
        // A reader first, so that opening the FIFO for writing does not wait; once it is
        // gone, every write of the trace fails with EPIPE.
        let reader = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path)
            .unwrap();
        let writer = TraceWriter::create(&path, 1 << 20).unwrap();
        drop(reader);
        for i in 0..1000 {
            writer.record(TraceOp::Write, i * 4096, 4096, 0);
        }
        let first = writer
            .finish()
            .expect_err("writing into a FIFO without a reader fails");
        let again = writer
            .finish()
            .expect_err("a second finish reports the failure too");
        assert_eq!(again.to_string(), first.to_string());
        assert!(
            first.to_string().contains("t.fifo"),
            "the error names the trace file: {first}"
        );
    }

    #[test]
    fn many_threads_record_in_time_order_across_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.trace");
        let dev = Arc::new(TraceDev::create(Arc::new(MemoryDev::new(1 << 24)), &path).unwrap());
        let per = 3 * CHUNK_RECORDS as u64;
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let dev = dev.clone();
                s.spawn(move || {
                    let mut buf = [0u8; 512];
                    for i in 0..per {
                        dev.read_at(&mut buf, (t * per + i) * 512 % (1 << 24))
                            .unwrap();
                    }
                });
            }
        });
        assert_eq!(dev.finish().unwrap(), 4 * per);
        let recs = read_all(&path).unwrap();
        assert_eq!(recs.len() as u64, 4 * per);
    }

    #[test]
    fn corrupt_files_are_refused_naming_file_and_offset() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.trace");
        let w = TraceWriter::create(&path, 4096).unwrap();
        for i in 0..3 {
            w.record(TraceOp::Write, i * 512, 512, 0);
        }
        w.finish().unwrap();
        let good = std::fs::read(&path).unwrap();
        let name = path.display().to_string();

        let check = |bytes: &[u8], want: &str| {
            std::fs::write(&path, bytes).unwrap();
            let err = read_all(&path).unwrap_err().to_string();
            assert!(
                err.contains(&name) && err.contains(want),
                "{err:?} lacks {want:?}"
            );
        };
        check(
            b"GIF89a, not a trace at all................",
            "is not a vdstream I/O trace",
        );
        check(b"", "truncated at byte offset 0");
        check(&good[..20], "truncated at byte offset 0");
        check(&good[..good.len() - 5], "truncated at byte offset 80");
        let mut v = good.clone();
        v[8] = 9;
        check(&v, "version 9");
        let mut v = good.clone();
        v[32 + 24 + 20] = 77;
        check(&v, "byte offset 56 has unknown operation code 77");
        let mut v = good.clone();
        v[32 + 48..32 + 56].copy_from_slice(&0u64.to_le_bytes());
        v[32 + 24..32 + 32].copy_from_slice(&u64::MAX.to_le_bytes());
        check(&v, "byte offset 80 goes back in time");
        let err = read_all(&dir.path().join("missing"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("missing") && err.contains("cannot open"),
            "{err}"
        );
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        fn record() -> impl Strategy<Value = (u64, u64, u32, TraceOp, u8)> {
            (
                0u64..1 << 20,
                any::<u64>(),
                any::<u32>(),
                prop::sample::select(TraceOp::ALL.to_vec()),
                0u8..4,
            )
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(64))]
            /// Whatever is written is read back exactly, with times made non-decreasing.
            #[test]
            fn round_trip(size in any::<u64>(), start in any::<u64>(), recs in prop::collection::vec(record(), 0..300)) {
                let dir = tempfile::tempdir().unwrap();
                let path = dir.path().join("t.trace");
                let mut t = 0u64;
                let recs: Vec<TraceRecord> = recs.into_iter().map(|(dt, offset, length, op, flags)| {
                    t += dt;
                    TraceRecord { time_ns: t, offset, length, op, flags }
                }).collect();
                let mut bytes = TraceHeader { device_size: size, start_unix_ns: start }.encode().to_vec();
                for r in &recs {
                    r.encode(&mut bytes);
                }
                std::fs::write(&path, &bytes).unwrap();
                let reader = TraceReader::open(&path).unwrap();
                prop_assert_eq!(reader.header(), TraceHeader { device_size: size, start_unix_ns: start });
                prop_assert_eq!(reader.record_count(), recs.len() as u64);
                prop_assert_eq!(read_all(&path).unwrap(), recs);
            }

            /// Any cut of a valid file is either a valid shorter trace or an error; never a panic.
            #[test]
            fn cut_files_never_panic(cut in 0usize..200, n in 0usize..6) {
                let dir = tempfile::tempdir().unwrap();
                let path = dir.path().join("t.trace");
                let mut bytes = TraceHeader { device_size: 1, start_unix_ns: 2 }.encode().to_vec();
                for i in 0..n {
                    TraceRecord { time_ns: i as u64, offset: 0, length: 1, op: TraceOp::Read, flags: 0 }.encode(&mut bytes);
                }
                let cut = cut.min(bytes.len());
                std::fs::write(&path, &bytes[..cut]).unwrap();
                let whole = cut >= HEADER_LEN as usize && (cut - HEADER_LEN as usize) % RECORD_LEN as usize == 0;
                prop_assert_eq!(read_all(&path).is_ok(), whole);
            }
        }
    }
}
