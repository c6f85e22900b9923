//! `CacheFile`: the file that holds a disk cache's pages, page `p` at byte `p·4096`, read
//! and written in whole aligned pages with `pread`/`pwrite`, either through the page cache
//! (`intermediate_buffering`) or with `O_DIRECT`.
//!
//! Design notes.
//!
//! - The file is sparse and as long as the device rounded up to a page; a page that was
//!   never written, or was trimmed, is a hole — or, in a chunk the disk cache preallocated
//!   ([`CacheFile::preallocate`], see [`crate::prealloc`]), an allocated unwritten block. The identity layout (no allocation table)
//!   keeps every guest I/O to one `pread`/`pwrite` of a contiguous range, needs no
//!   allocator and no metadata for where a page lives, and lets TRIM punch exactly the
//!   pages it frees. The cost is a file that is fragmented on disk the way the guest's
//!   writes are; for random 4 KiB guest I/O that is no worse than any other layout.
//! - With `O_DIRECT` every offset, length and buffer address is 4096-aligned: callers pass
//!   whole pages, and [`with_bounce`] lends a per-thread aligned buffer to copy through.
//!   A file system that refuses `O_DIRECT` (tmpfs) is reported at open with what to do.
//! - Hole punching is probed at open; if the file system cannot punch, trims still work
//!   (the page map says *zero*), they just do not give the blocks back.
//! - Page reads and writes go through an [`IoEngine`]: `pread`/`pwrite` on the calling
//!   thread, or a batched io_uring queue shared by every thread using the file (the
//!   NBD server's workers), chosen by [`IoEngineKind`] at open. Either way a call returns
//!   only when its I/O is complete, so the disk cache's rule "a page is *data* only after
//!   its bytes are in the file" and the persistent types' flush ordering (`fdatasync`
//!   covers every completed write) hold unchanged.
//!
//! Invariants: every I/O here is whole pages inside the file; every error names the file.

use std::cell::RefCell;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use vdstream_blockdev::{storefile, Error, ErrorKind, IoEngine, IoEngineKind, Op, Result};

use crate::page::{PAGE, PAGE_U64};

/// Largest I/O through the bounce buffer.
pub const BOUNCE_BYTES: usize = 1 << 20;

#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct AlignedPage([u8; PAGE]);

thread_local! {
    static BOUNCE: RefCell<Vec<AlignedPage>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with a 4096-aligned buffer of `len` bytes (a multiple of [`PAGE`], at most
/// [`BOUNCE_BYTES`]); its contents on entry are unspecified.
pub fn with_bounce<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    debug_assert!(len % PAGE == 0 && len <= BOUNCE_BYTES);
    BOUNCE.with(|cell| {
        let mut pages = cell.borrow_mut();
        let n = len / PAGE;
        if pages.len() < n {
            pages.resize(n, AlignedPage([0; PAGE]));
        }
        // SAFETY: `AlignedPage` is `repr(C)` around `[u8; PAGE]` with alignment PAGE, so `n`
        // of them are `n * PAGE` contiguous initialised bytes; the `RefCell` borrow makes this
        // the only reference to them while `f` runs.
        let bytes = unsafe { std::slice::from_raw_parts_mut(pages.as_mut_ptr().cast::<u8>(), len) };
        f(bytes)
    })
}

thread_local! {
    static ARENA: RefCell<Vec<AlignedPage>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with a 4096-aligned buffer of `len` bytes (a multiple of [`PAGE`]) for a batch
/// of page I/O, apart from [`with_bounce`]'s (so `f` may use that one too); contents on
/// entry are unspecified. The thread's arena is reused from batch to batch; should it be
/// in use already (a batch inside a batch), `f` gets a buffer of its own.
pub fn with_arena<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    debug_assert!(len % PAGE == 0);
    let run = |pages: &mut Vec<AlignedPage>| {
        let n = len / PAGE;
        if pages.len() < n {
            pages.resize(n, AlignedPage([0; PAGE]));
        }
        // SAFETY: as in `with_bounce`: `n` aligned pages are `len` contiguous initialised
        // bytes, and the caller's exclusive borrow of `pages` makes this the only reference.
        f(unsafe { std::slice::from_raw_parts_mut(pages.as_mut_ptr().cast::<u8>(), len) })
    };
    ARENA.with(|cell| match cell.try_borrow_mut() {
        Ok(mut pages) => {
            let r = run(&mut pages);
            if pages.len() > 256 {
                // Keep at most 1 MiB per thread between batches.
                pages.truncate(256);
                pages.shrink_to_fit();
            }
            r
        }
        Err(_) => run(&mut Vec::new()),
    })
}

/// Whether `O_DIRECT` could use `buf` at `offset` as it is.
pub fn is_aligned(buf: &[u8], offset: u64) -> bool {
    buf.as_ptr() as usize % PAGE == 0 && buf.len() % PAGE == 0 && offset % PAGE_U64 == 0
}

/// The page file of a disk cache. See the module notes.
#[derive(Debug)]
pub struct CacheFile {
    /// Declared before `file`: dropped (its ring thread ended) before the descriptor closes.
    engine: IoEngine,
    file: File,
    path: PathBuf,
    direct: bool,
    punch_works: AtomicBool,
}

impl CacheFile {
    /// Opens (creating it if `create`) the file at `path` and sets its length to `pages`
    /// pages. With `exclusive`, the file must not exist yet. Page I/O uses an engine of
    /// `engine` (sync where io_uring cannot be set up).
    pub fn open(
        path: &Path,
        pages: u64,
        direct: bool,
        create: bool,
        exclusive: bool,
        engine: IoEngineKind,
    ) -> Result<CacheFile> {
        let what = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Self::open_with_engine(path, pages, direct, create, exclusive, || {
            IoEngine::open(engine, &what)
        })
    }

    /// Like [`open`](Self::open), with the engine made by `engine` once the file is open.
    pub fn open_with_engine(
        path: &Path,
        pages: u64,
        direct: bool,
        create: bool,
        exclusive: bool,
        engine: impl FnOnce() -> IoEngine,
    ) -> Result<CacheFile> {
        let name = path.display().to_string();
        // A target's writes: owner-only, and never through a link (vdstream_blockdev::storefile).
        let mut oo = storefile::options(storefile::PRIVATE);
        oo.read(true).write(true);
        if exclusive {
            oo.create_new(true);
        } else {
            oo.create(create);
        }
        if direct {
            oo.custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_DIRECT);
        }
        let refuse_direct = |e: io::Error| {
            Error {
            kind: ErrorKind::NotSupported,
            message: format!(
                "the file system of {} refuses O_DIRECT (tmpfs does, for one): set intermediate_buffering, \
                 or put the cache folder on ext4 or xfs ({e})",
                path.parent().unwrap_or(path).display()
            ),
            ..Error::from_io(e, Op::Open, 0, 0, name.clone())
        }
        };
        let file = oo
            .open(path)
            .map_err(|e| storefile::explain(e, path))
            .map_err(|e| match e.raw_os_error() {
                Some(libc::EINVAL) if direct => refuse_direct(e),
                _ => {
                    let mut err = Error::from_io(e, Op::Open, 0, 0, name.clone());
                    err.message
                        .push_str("; check that the cache folder exists and is writable");
                    err
                }
            })?;
        storefile::tighten_logged(&file, storefile::PRIVATE, path);
        let len = pages * PAGE_U64;
        let cur = file
            .metadata()
            .map_err(|e| Error::from_io(e, Op::Open, 0, 0, name.clone()))?
            .len();
        if cur != len {
            file.set_len(len)
                .map_err(|e| Error::from_io(e, Op::Open, 0, len, name.clone()))?;
        }
        let cf = CacheFile {
            engine: IoEngine::Sync,
            file,
            path: path.to_path_buf(),
            direct,
            punch_works: AtomicBool::new(true),
        };
        if direct && pages > 0 {
            // Some file systems accept O_DIRECT at open and refuse it at the first I/O.
            with_bounce(PAGE, |b| cf.file.read_exact_at(b, 0)).map_err(refuse_direct)?;
        }
        // Probe hole punching past the end of the file, where no data is touched.
        let punch = fallocate(
            &cf.file,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            len,
            PAGE_U64,
        );
        cf.punch_works.store(punch.is_ok(), Ordering::Relaxed);
        Ok(CacheFile {
            engine: engine(),
            ..cf
        })
    }

    /// The page file on a raw disk or partition (`--overflow-device`, see `device`): opened
    /// exclusively, never resized; it must hold `pages` pages (the identity layout keeps
    /// page i at offset i × 4 KiB). Its old contents are never read: the cache starts empty.
    pub fn open_device(
        device: &Path,
        pages: u64,
        direct: bool,
        engine: impl FnOnce() -> IoEngine,
    ) -> Result<CacheFile> {
        let name = device.display().to_string();
        let (file, size) = crate::device::open_exclusive(device, direct)
            .map_err(|e| Error::from_io(e, Op::Open, 0, 0, name.clone()))?;
        let len = pages * PAGE_U64;
        if size < len {
            return Err(Error {
                kind: ErrorKind::NoSpace,
                message: format!(
                    "{name} holds {size} bytes, and a device-disk cache keeps every page of the vDisk at its own offset: it needs {len} bytes; \
                     use ram-overflow (its overflow takes a device of any size), or a larger device"
                ),
                ..Error::from_io(io::ErrorKind::StorageFull.into(), Op::Open, 0, len, name.clone())
            });
        }
        let cf = CacheFile {
            engine: IoEngine::Sync,
            file,
            path: device.to_path_buf(),
            direct,
            punch_works: AtomicBool::new(true),
        };
        // Probe hole punching (discard or zeroing on a device) on the first page: the cache
        // is empty, so no data is touched.
        let punch = fallocate(
            &cf.file,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            0,
            PAGE_U64,
        );
        cf.punch_works.store(punch.is_ok(), Ordering::Relaxed);
        Ok(CacheFile {
            engine: engine(),
            ..cf
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// The engine in use (sync after a fallback).
    pub fn engine(&self) -> IoEngineKind {
        self.engine.kind()
    }

    pub(crate) fn err(&self, e: io::Error, op: Op, offset: u64, len: u64) -> Error {
        Error::from_io(e, op, offset, len, self.path.display().to_string())
    }

    /// Reads `buf` at `offset` (aligned in direct mode).
    pub fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        debug_assert!(!self.direct || is_aligned(buf, offset));
        self.engine
            .read_exact_at(&self.file, buf, offset)
            .map_err(|e| self.err(e, Op::Read, offset, buf.len() as u64))
    }

    /// Writes `buf` at `offset` (aligned in direct mode).
    pub fn write(&self, buf: &[u8], offset: u64) -> Result<()> {
        debug_assert!(!self.direct || is_aligned(buf, offset));
        self.engine
            .write_all_at(&self.file, buf, offset)
            .map_err(|e| self.err(e, Op::Write, offset, buf.len() as u64))
    }

    /// Gives back the blocks of `[offset, offset+len)` (whole pages). `false` when the file
    /// system cannot punch holes (remembered; the pages still read as zeros by the map).
    pub fn punch(&self, offset: u64, len: u64) -> Result<bool> {
        if !self.punch_works.load(Ordering::Relaxed) {
            return Ok(false);
        }
        match fallocate(
            &self.file,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset,
            len,
        ) {
            Ok(()) => Ok(true),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS)
                ) =>
            {
                self.punch_works.store(false, Ordering::Relaxed);
                Ok(false)
            }
            Err(e) => Err(self.err(e, Op::Trim, offset, len)),
        }
    }

    /// Allocates the blocks of `[offset, offset+len)` (whole pages) without changing any
    /// byte or the file's length; the raw `io::Error` so the caller can tell kinds apart.
    pub fn preallocate(&self, offset: u64, len: u64) -> io::Result<()> {
        fallocate(&self.file, libc::FALLOC_FL_KEEP_SIZE, offset, len)
    }

    /// `fdatasync`: every completed write to the file is durable.
    pub fn sync_data(&self) -> Result<()> {
        self.file
            .sync_data()
            .map_err(|e| self.err(e, Op::Flush, 0, 0))
    }

    /// The open file, for locking.
    pub fn file(&self) -> &File {
        &self.file
    }
}

/// `fallocate(2)` on `file`, retried on EINTR.
pub fn fallocate(file: &File, mode: libc::c_int, offset: u64, len: u64) -> io::Result<()> {
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

/// Takes an exclusive `flock` on `file`: `Ok(false)` when another open file still holds
/// one after [`LOCK_PATIENCE`](vdstream_blockdev::flock::LOCK_PATIENCE) (see
/// [`vdstream_blockdev::flock`]).
pub fn try_lock_exclusive(file: &File) -> io::Result<bool> {
    use vdstream_blockdev::flock::{try_lock, LockMode, LOCK_PATIENCE};
    try_lock(file, LockMode::Exclusive, LOCK_PATIENCE)
}
