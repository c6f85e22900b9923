//! `FileDev`: a raw image file or block device, read and written with `pread`/`pwrite`.
//!
//! Design notes.
//!
//! - **Buffered mode** (the default) goes through the page cache: `flush` is `fdatasync`,
//!   a FUA write is `pwritev2(RWF_DSYNC)` (falling back to `pwrite` + `fdatasync` on kernels
//!   or file systems that refuse the flag).
//! - **Direct mode** opens the file with `O_DIRECT`. Every I/O the kernel sees is 4096-aligned
//!   in offset, length and memory: requests are copied through a per-thread aligned bounce
//!   buffer (skipped when the caller's buffer and range are already aligned), and a write
//!   that starts or ends inside a 4 KiB block reads that block first (read-modify-write).
//!   A read-modify-write must not interleave with any other change to that block, or it
//!   would write back stale bytes outside its own range, so every direct write, trim and
//!   zero holds the striped locks of *all* the blocks it covers while it runs (taken in
//!   stripe order; a range longer than the stripe count takes every stripe). When the
//!   size is not a multiple of 4096, the bytes of the final partial block go through a
//!   second, buffered descriptor: an `O_DIRECT` write of that block would grow the file.
//! - **TRIM** is `fallocate(PUNCH_HOLE|KEEP_SIZE)`, probed once at open (past the end of a
//!   regular file, so that no data is touched); if the file system cannot punch holes,
//!   `Caps::trim` is false and a trim still zeroes the range (we promise zeros after TRIM).
//!   **Write zeroes** punches when `may_trim` allows it, else uses `FALLOC_FL_ZERO_RANGE`,
//!   else writes zeros — unless the request is `fast_only`, which then fails with
//!   [`ErrorKind::NotFast`].
//! - **Block status** (regular files) walks `lseek(SEEK_DATA/SEEK_HOLE)`; holes are reported
//!   as hole+zero. Block devices report all data. Reads of 64 KiB or more use the same walk
//!   (`read_at_sparse`): holes are zero-filled without reading and reported, so the NBD edge
//!   sends them as holes.
//! - A read-only device answers every write, trim and zero with [`ErrorKind::ReadOnly`];
//!   reads, flush, block status and cache work.
//!
//! Invariants: the size is read once at open (metadata, or the end offset for a block
//! device) and never changes; no `O_DIRECT` I/O ever reaches past `size` rounded down to
//! 4096; every error carries the operation, offset, length and the file's path.

use std::cell::RefCell;
use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::span::units;
use crate::{
    check_range, BatchIo, BatchOp, BlockDev, Caps, Error, ErrorKind, Extent, Hole, Op, Result,
    ZeroFlags,
};

/// Alignment of every `O_DIRECT` I/O: offset, length and buffer address.
const ALIGN: u64 = 4096;
/// Largest single I/O through the bounce buffer (and the size of the zero-writing pieces).
const BOUNCE_BYTES: u64 = 1 << 20;
/// Number of striped read-modify-write locks (direct mode).
const RMW_STRIPES: usize = 256;
/// Reads at least this long look for holes first (`read_at_sparse`): skipping a hole saves
/// reading it, and the NBD edge can send it as a hole rather than as bytes.
const SPARSE_READ_MIN: usize = 64 << 10;

/// How to open a [`FileDev`].
#[derive(Debug, Clone, Default)]
pub struct FileOptions {
    /// Open for reading only: writes, trims and zeroes answer [`ErrorKind::ReadOnly`].
    pub read_only: bool,
    /// Bypass the page cache with `O_DIRECT`.
    pub direct: bool,
}

/// The stripe locks one change holds; one stripe needs no allocation.
#[allow(dead_code)] // held only for their drop
enum StripeGuards<'a> {
    One(MutexGuard<'a, ()>),
    Many(Vec<MutexGuard<'a, ()>>),
}

/// One aligned 4 KiB block: a `Vec` of them is an aligned buffer.
#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct AlignedBlock([u8; ALIGN as usize]);

thread_local! {
    /// Per-thread bounce buffer for direct I/O, grown on demand up to `BOUNCE_BYTES`.
    static BOUNCE: RefCell<Vec<AlignedBlock>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with an aligned buffer of `len` bytes (`len` a multiple of `ALIGN`, at most
/// `BOUNCE_BYTES`). The contents on entry are unspecified.
fn with_bounce<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    debug_assert!(is_aligned(len as u64) && len as u64 <= BOUNCE_BYTES);
    BOUNCE.with(|cell| {
        let mut blocks = cell.borrow_mut();
        let n = len / ALIGN as usize;
        if blocks.len() < n {
            blocks.resize(n, AlignedBlock([0; ALIGN as usize]));
        }
        // SAFETY: `AlignedBlock` is `repr(C)` around `[u8; 4096]` with alignment 4096, so
        // its size is exactly 4096 and `n` of them are `n * 4096` contiguous initialised
        // bytes; the `RefCell` borrow makes this the only reference to them while `f` runs.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(blocks.as_mut_ptr().cast::<u8>(), len) };
        f(bytes)
    })
}

fn is_aligned(x: u64) -> bool {
    x & (ALIGN - 1) == 0
}

/// Whether a buffer at address `addr` of `len` bytes can go to `offset` with no bounce.
fn can_go_direct(addr: usize, offset: u64, len: usize) -> bool {
    is_aligned(addr as u64) && is_aligned(offset) && is_aligned(len as u64)
}

fn round_down(x: u64) -> u64 {
    x & !(ALIGN - 1)
}

fn round_up(x: u64) -> u64 {
    round_down(x + ALIGN - 1)
}

fn is_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS)
    )
}

/// `fallocate(2)` on `file`.
fn fallocate(file: &File, mode: libc::c_int, offset: u64, len: u64) -> io::Result<()> {
    loop {
        // SAFETY: fallocate only reads its integer arguments; the descriptor is owned by
        // `file`, which outlives the call.
        let r = unsafe {
            libc::fallocate(
                file.as_raw_fd(),
                mode,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        if r == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `lseek(2)` with `SEEK_DATA` or `SEEK_HOLE`; `Ok(None)` for ENXIO (nothing past `offset`).
fn seek_extent(file: &File, offset: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
    // SAFETY: lseek only reads its integer arguments. It moves the shared file position,
    // which nothing here uses: all I/O is positioned (pread/pwrite).
    let r = unsafe { libc::lseek(file.as_raw_fd(), offset as libc::off_t, whence) };
    if r >= 0 {
        return Ok(Some(r as u64));
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::ENXIO) {
        Ok(None)
    } else {
        Err(e)
    }
}

/// Writes all of `buf` at `offset` with `RWF_DSYNC` (durable on return).
fn pwrite_dsync(file: &File, buf: &[u8], offset: u64) -> io::Result<()> {
    let mut done = 0usize;
    while done < buf.len() {
        let rest = &buf[done..];
        let iov = libc::iovec {
            iov_base: rest.as_ptr() as *mut libc::c_void,
            iov_len: rest.len(),
        };
        // SAFETY: `iov` describes `rest`, which stays borrowed (and so alive and unchanged)
        // for the whole call; pwritev2 only reads from it. The descriptor is owned by `file`.
        let n = unsafe {
            libc::pwritev2(
                file.as_raw_fd(),
                &iov,
                1,
                (offset + done as u64) as libc::off_t,
                libc::RWF_DSYNC,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "pwritev2 wrote nothing",
            ));
        }
        done += n as usize;
    }
    Ok(())
}

/// A raw file or block device. See the module notes.
#[derive(Debug)]
pub struct FileDev {
    file: File,
    /// Direct mode only: a buffered descriptor for the bytes at or past `direct_end`.
    tail: Option<File>,
    path: PathBuf,
    size: u64,
    read_only: bool,
    direct: bool,
    /// Direct mode: `size` rounded down to 4096; buffered mode: `size`.
    direct_end: u64,
    is_block_device: bool,
    /// PUNCH_HOLE worked when probed at open (or is assumed for a block device).
    can_punch: bool,
    /// Cleared the first time the file system refuses PUNCH_HOLE / ZERO_RANGE / RWF_DSYNC.
    punch_works: AtomicBool,
    zero_range_works: AtomicBool,
    dsync_works: AtomicBool,
    /// Direct mode: locks for read-modify-write of partial blocks, by block index.
    rmw_locks: Box<[Mutex<()>]>,
}

impl FileDev {
    /// Opens an existing file or block device.
    pub fn open(path: impl AsRef<Path>, options: FileOptions) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let name = path.display().to_string();
        let open_err = |e: io::Error| {
            let hint = match e.raw_os_error() {
                Some(libc::EINVAL) if options.direct => {
                    return Error {
                        kind: ErrorKind::NotSupported,
                        message: "the file system refuses O_DIRECT (tmpfs does, for one): open it without direct I/O, \
                                  or move the file to ext4 or xfs"
                            .into(),
                        ..Error::from_io(e, Op::Open, 0, 0, name.clone())
                    }
                }
                Some(libc::ENOENT) => "; check the path, or create the image first",
                Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) if !options.read_only => {
                    "; open it read-only, or fix its permissions"
                }
                _ => "",
            };
            let mut err = Error::from_io(e, Op::Open, 0, 0, name.clone());
            err.message.push_str(hint);
            err
        };
        // No link is followed (crate::storefile): a caller with a path an administrator
        // typed resolves it first.
        let mut oo = OpenOptions::new();
        oo.read(true)
            .write(!options.read_only)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC);
        let mut file = {
            let mut o = oo.clone();
            if options.direct {
                o.custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_DIRECT);
            }
            o.open(&path)
                .map_err(|e| crate::storefile::explain(e, &path))
                .map_err(open_err)?
        };
        let meta = file.metadata().map_err(open_err)?;
        let is_block_device = meta.file_type().is_block_device();
        let size = if is_block_device {
            file.seek(SeekFrom::End(0)).map_err(open_err)?
        } else if meta.is_file() {
            meta.len()
        } else {
            return Err(Error::new(
                ErrorKind::Invalid,
                Op::Open,
                0,
                0,
                name,
                "not a regular file or block device: give the path of a disk image or a block device",
            ));
        };
        let (tail, direct_end) = if options.direct {
            (Some(oo.open(&path).map_err(open_err)?), round_down(size))
        } else {
            (None, size)
        };
        if options.direct && direct_end > 0 {
            // Some file systems accept O_DIRECT at open and refuse it at the first I/O.
            with_bounce(ALIGN as usize, |b| file.read_exact_at(b, 0)).map_err(open_err)?;
        }
        let can_punch = !options.read_only
            && (is_block_device
                || fallocate(
                    &file,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    round_up(size),
                    ALIGN,
                )
                .is_ok());
        Ok(FileDev {
            file,
            tail,
            path,
            size,
            read_only: options.read_only,
            direct: options.direct,
            direct_end,
            is_block_device,
            can_punch,
            punch_works: AtomicBool::new(can_punch),
            zero_range_works: AtomicBool::new(true),
            dsync_works: AtomicBool::new(true),
            rmw_locks: (0..if options.direct { RMW_STRIPES } else { 0 })
                .map(|_| Mutex::new(()))
                .collect(),
        })
    }

    /// Creates (or truncates) a regular file of `size` bytes, all zero and sparse, and opens
    /// it read-write in buffered mode.
    pub fn create(path: impl AsRef<Path>, size: u64) -> Result<Self> {
        let path = path.as_ref();
        let err = |e| Error::from_io(e, Op::Open, 0, size, path.display().to_string());
        let file = crate::storefile::options(crate::storefile::PRIVATE)
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|e| crate::storefile::explain(e, path))
            .map_err(err)?;
        file.set_len(size).map_err(err)?;
        drop(file);
        Self::open(path, FileOptions::default())
    }

    /// The path the device was opened with.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn io_err(&self, e: io::Error, op: Op, offset: u64, len: u64) -> Error {
        Error::from_io(e, op, offset, len, self.describe())
    }

    fn refuse_if_read_only(&self, op: Op, offset: u64, len: u64) -> Result<()> {
        if !self.read_only {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::ReadOnly,
            op,
            offset,
            len,
            self.describe(),
            "the file is open read-only; open it without read_only to change it",
        ))
    }

    /// The descriptor that serves bytes at `offset` and up (direct mode: the buffered tail
    /// descriptor past `direct_end`).
    fn buffered_file(&self) -> &File {
        self.tail.as_ref().unwrap_or(&self.file)
    }

    /// Writes `buf` at `offset` on `file`, durably when `fua`.
    fn pwrite(&self, file: &File, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        if fua && self.dsync_works.load(Ordering::Relaxed) {
            match pwrite_dsync(file, buf, offset) {
                Err(e) if is_unsupported(&e) => self.dsync_works.store(false, Ordering::Relaxed),
                r => return r,
            }
        }
        file.write_all_at(buf, offset)?;
        if fua {
            file.sync_data()?;
        }
        Ok(())
    }

    /// Locks the read-modify-write stripes of every block in `first..=last`, in stripe
    /// order (all stripes when the range has more blocks than there are stripes).
    fn lock_blocks(&self, first: u64, last: u64) -> StripeGuards<'_> {
        let lock = |s: usize| {
            self.rmw_locks[s]
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
        };
        let blocks = last - first + 1;
        if blocks == 1 {
            return StripeGuards::One(lock((first % RMW_STRIPES as u64) as usize));
        }
        let mut stripes: Vec<usize> = if blocks >= RMW_STRIPES as u64 {
            (0..RMW_STRIPES).collect()
        } else {
            (first..=last)
                .map(|b| (b % RMW_STRIPES as u64) as usize)
                .collect()
        };
        stripes.sort_unstable();
        stripes.dedup();
        StripeGuards::Many(stripes.into_iter().map(lock).collect())
    }

    /// Direct mode: locks every block of `[offset, offset+len)` (len > 0), so that no
    /// read-modify-write of one of them interleaves with this change. Buffered mode:
    /// nothing to lock.
    fn lock_range(&self, offset: u64, len: u64) -> Option<StripeGuards<'_>> {
        self.direct
            .then(|| self.lock_blocks(offset / ALIGN, (offset + len - 1) / ALIGN))
    }

    /// Direct-mode read of `[offset, offset+buf.len())`, all below `direct_end`.
    fn read_direct(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if can_go_direct(buf.as_ptr() as usize, offset, buf.len()) {
            return self.file.read_exact_at(buf, offset);
        }
        for w in units(offset, buf.len() as u64, BOUNCE_BYTES) {
            let (start, end) = (
                round_down(offset + w.pos as u64),
                round_up(offset + (w.pos + w.len) as u64),
            );
            let head = (offset + w.pos as u64 - start) as usize;
            with_bounce((end - start) as usize, |b| {
                self.file.read_exact_at(b, start)?;
                buf[w.pos..w.pos + w.len].copy_from_slice(&b[head..head + w.len]);
                Ok::<_, io::Error>(())
            })?;
        }
        Ok(())
    }

    /// Direct-mode write of `[offset, offset+buf.len())`, all below `direct_end`.
    fn write_direct(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        if can_go_direct(buf.as_ptr() as usize, offset, buf.len()) {
            let _locks = self.lock_range(offset, buf.len() as u64);
            return self.pwrite(&self.file, buf, offset, fua);
        }
        for w in units(offset, buf.len() as u64, BOUNCE_BYTES) {
            let (wstart, wend) = (offset + w.pos as u64, offset + (w.pos + w.len) as u64);
            let (start, end) = (round_down(wstart), round_up(wend));
            let (first_block, last_block) = (start / ALIGN, end / ALIGN - 1);
            let _locks = self.lock_blocks(first_block, last_block);
            with_bounce((end - start) as usize, |b| {
                if wstart != start {
                    self.file.read_exact_at(&mut b[..ALIGN as usize], start)?;
                }
                if wend != end && (last_block != first_block || wstart == start) {
                    let at = (end - ALIGN - start) as usize;
                    self.file.read_exact_at(&mut b[at..], end - ALIGN)?;
                }
                let head = (wstart - start) as usize;
                b[head..head + w.len].copy_from_slice(&buf[w.pos..w.pos + w.len]);
                self.pwrite(&self.file, b, start, fua)
            })?;
        }
        Ok(())
    }

    /// Writes zeros over `[offset, offset+len)` with ordinary writes.
    fn write_zero_buffers(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        with_bounce(BOUNCE_BYTES as usize, |zeros| {
            zeros.fill(0);
            for piece in units(offset, len, BOUNCE_BYTES) {
                self.write_at(&zeros[..piece.len], offset + piece.pos as u64, fua)
                    .map_err(|e| Error { op: Op::Zero, ..e })?;
            }
            Ok(())
        })
    }

    /// Tries `fallocate(mode)` unless `works` says the file system refused it before.
    /// `Ok(false)`: not supported here (and now remembered).
    fn try_fallocate(
        &self,
        works: &AtomicBool,
        mode: libc::c_int,
        op: Op,
        offset: u64,
        len: u64,
    ) -> Result<bool> {
        if !works.load(Ordering::Relaxed) {
            return Ok(false);
        }
        match fallocate(&self.file, mode | libc::FALLOC_FL_KEEP_SIZE, offset, len) {
            Ok(()) => Ok(true),
            Err(e) if is_unsupported(&e) => {
                works.store(false, Ordering::Relaxed);
                Ok(false)
            }
            Err(e) => Err(self.io_err(e, op, offset, len)),
        }
    }

    fn sync_if(&self, fua: bool, op: Op, offset: u64, len: u64) -> Result<()> {
        if fua {
            self.file
                .sync_data()
                .map_err(|e| self.io_err(e, op, offset, len))?;
        }
        Ok(())
    }
}

impl BlockDev for FileDev {
    /// Reads through the page cache go to the kernel together (the caller's io_uring):
    /// the ones cached complete at once, the others are read side by side. Writes, and
    /// everything with `O_DIRECT`, run one by one.
    fn io_batch(&self, ops: &mut [BatchOp<'_>]) {
        let mut reads = Vec::new();
        let mut idx = Vec::new();
        for (i, op) in ops.iter_mut().enumerate() {
            let offset = op.offset;
            if self.direct || op.is_write() {
                op.run_alone(self);
                continue;
            }
            if let BatchIo::Read(buf) = &mut op.io {
                match check_range(self.size, Op::Read, offset, buf.len() as u64, &|| {
                    self.describe()
                }) {
                    Ok(()) => {
                        idx.push(i);
                        reads.push(crate::ring::FileIo::read(&self.file, buf, offset));
                    }
                    Err(e) => op.result = Err(e),
                }
            }
        }
        crate::ring::run_batch(&mut reads);
        let results: Vec<(u64, usize, io::Result<()>)> = reads
            .into_iter()
            .map(|r| (r.offset, r.len(), r.result))
            .collect();
        for (i, (offset, len, r)) in idx.into_iter().zip(results) {
            ops[i].result = r.map_err(|e| self.io_err(e, Op::Read, offset, len as u64));
        }
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn caps(&self) -> Caps {
        let writable = !self.read_only;
        Caps {
            read_only: self.read_only,
            flush: writable,
            fua: writable,
            trim: self.can_punch,
            zeroes: writable,
            fast_zero: writable,
            cache: !self.direct,
            block_status: !self.is_block_device,
            multi_conn: true,
            may_block: true,
            preferred_block: ALIGN as u32,
        }
    }

    fn read_at_sparse(&self, buf: &mut [u8], offset: u64, holes: &mut Vec<Hole>) -> Result<()> {
        if self.is_block_device || buf.len() < SPARSE_READ_MIN {
            return self.read_at(buf, offset);
        }
        let mut extents = Vec::new();
        self.block_status(offset, buf.len() as u64, &mut extents)?;
        // Past the end of a file cut short under us, "no data" is lost bytes, not a hole.
        if extents.last().is_some_and(|e| e.hole)
            && self
                .file
                .metadata()
                .map_or(true, |m| m.len() < offset + buf.len() as u64)
        {
            return self.read_at(buf, offset);
        }
        let mut pos = 0usize;
        for e in extents {
            let end = pos + e.len as usize;
            if e.hole {
                buf[pos..end].fill(0);
                holes.push(Hole {
                    start: pos,
                    len: end - pos,
                });
            } else {
                self.read_at(&mut buf[pos..end], offset + pos as u64)?;
            }
            pos = end;
        }
        // Block status may stop short of the end: read the rest as data.
        if pos < buf.len() {
            self.read_at(&mut buf[pos..], offset + pos as u64)?;
        }
        Ok(())
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        check_range(self.size, Op::Read, offset, len, &|| self.describe())?;
        let split = (self.direct_end.clamp(offset, offset + len) - offset) as usize;
        let (body, tail) = buf.split_at_mut(split);
        let r = if self.direct && !body.is_empty() {
            self.read_direct(body, offset)
        } else {
            self.file.read_exact_at(body, offset)
        };
        r.and_then(|()| {
            self.buffered_file()
                .read_exact_at(tail, offset + split as u64)
        })
        .map_err(|e| self.io_err(e, Op::Read, offset, len))
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        let len = buf.len() as u64;
        self.refuse_if_read_only(Op::Write, offset, len)?;
        check_range(self.size, Op::Write, offset, len, &|| self.describe())?;
        let split = (self.direct_end.clamp(offset, offset + len) - offset) as usize;
        let (body, tail) = buf.split_at(split);
        let r = if self.direct && !body.is_empty() {
            self.write_direct(body, offset, fua)
        } else {
            self.pwrite(&self.file, body, offset, fua)
        };
        r.and_then(|()| {
            if tail.is_empty() {
                Ok(())
            } else {
                self.pwrite(self.buffered_file(), tail, offset + split as u64, fua)
            }
        })
        .map_err(|e| self.io_err(e, Op::Write, offset, len))
    }

    fn flush(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.file
            .sync_data()
            .map_err(|e| self.io_err(e, Op::Flush, 0, 0))
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.refuse_if_read_only(Op::Trim, offset, len)?;
        check_range(self.size, Op::Trim, offset, len, &|| self.describe())?;
        if len == 0 {
            return Ok(());
        }
        let punched = {
            let _locks = self.lock_range(offset, len);
            self.try_fallocate(
                &self.punch_works,
                libc::FALLOC_FL_PUNCH_HOLE,
                Op::Trim,
                offset,
                len,
            )?
        };
        if !punched {
            // We promise zeros after a trim, even where holes cannot be punched.
            let flags = ZeroFlags {
                may_trim: false,
                fast_only: false,
                fua: false,
            };
            self.write_zeroes(offset, len, flags)
                .map_err(|e| Error { op: Op::Trim, ..e })?;
        }
        self.sync_if(fua, Op::Trim, offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.refuse_if_read_only(Op::Zero, offset, len)?;
        check_range(self.size, Op::Zero, offset, len, &|| self.describe())?;
        if len == 0 {
            return Ok(());
        }
        let done = {
            let _locks = self.lock_range(offset, len);
            (flags.may_trim
                && self.try_fallocate(
                    &self.punch_works,
                    libc::FALLOC_FL_PUNCH_HOLE,
                    Op::Zero,
                    offset,
                    len,
                )?)
                || self.try_fallocate(
                    &self.zero_range_works,
                    libc::FALLOC_FL_ZERO_RANGE,
                    Op::Zero,
                    offset,
                    len,
                )?
        };
        if !done {
            if flags.fast_only {
                return Err(Error::new(
                    ErrorKind::NotFast,
                    Op::Zero,
                    offset,
                    len,
                    self.describe(),
                    "the file system cannot zero a range without writing zeros (no FALLOC_FL_ZERO_RANGE)",
                ));
            }
            return self.write_zero_buffers(offset, len, flags.fua);
        }
        self.sync_if(flags.fua, Op::Zero, offset, len)
    }

    fn block_status(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        check_range(self.size, Op::BlockStatus, offset, len, &|| self.describe())?;
        if self.is_block_device {
            if len > 0 {
                out.push(Extent {
                    len,
                    hole: false,
                    zero: false,
                });
            }
            return Ok(());
        }
        let end = offset + len;
        let err = |e| self.io_err(e, Op::BlockStatus, offset, len);
        let mut pos = offset;
        while pos < end {
            let data = seek_extent(&self.file, pos, libc::SEEK_DATA)
                .map_err(err)?
                .unwrap_or(end)
                .clamp(pos, end);
            if data > pos {
                out.push(Extent {
                    len: data - pos,
                    hole: true,
                    zero: true,
                });
                pos = data;
                continue;
            }
            let hole = seek_extent(&self.file, pos, libc::SEEK_HOLE)
                .map_err(err)?
                .unwrap_or(end)
                .min(end);
            // A racing write can fill the hole between the two seeks: report one page as data.
            let hole = if hole > pos {
                hole
            } else {
                (pos + ALIGN).min(end)
            };
            out.push(Extent {
                len: hole - pos,
                hole: false,
                zero: false,
            });
            pos = hole;
        }
        Ok(())
    }

    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        check_range(self.size, Op::Cache, offset, len, &|| self.describe())?;
        if self.direct {
            return Ok(());
        }
        // SAFETY: posix_fadvise only reads its integer arguments; the descriptor is owned by
        // `self.file`, which outlives the call.
        let r = unsafe {
            libc::posix_fadvise(
                self.file.as_raw_fd(),
                offset as libc::off_t,
                len as libc::off_t,
                libc::POSIX_FADV_WILLNEED,
            )
        };
        if r != 0 {
            return Err(self.io_err(io::Error::from_raw_os_error(r), Op::Cache, offset, len));
        }
        Ok(())
    }

    fn describe(&self) -> String {
        self.path.display().to_string()
    }
}
