//! `device-disk` and `server`: a write cache in a sparse file on local disk, 4 KiB pages,
//! gone on the next attach. The `server` type is the same engine with the file in the
//! store's cache folder for the target (the caller passes it as `cfg.dir`). The persistent
//! types ([`crate::persistent`]) reuse this engine and add durable metadata.
//!
//! Design notes.
//!
//! - **Layout**: page `p` of the device lives at byte `p·4096` of a [`CacheFile`] (see there
//!   why the identity layout beats an allocation-ordered one here); a [`PageMap`] keeps each
//!   page's state in two bits, lock-free:
//!
//!   | state  | reads come from          | a write of the whole page | a partial write           | trim / zero             |
//!   | ------ | ------------------------ | ------------------------- | ------------------------- | ----------------------- |
//!   | absent | the vDisk                | pwrite → data (new page)  | vDisk page + patch → data | → zero                  |
//!   | data   | the cache file           | pwrite                    | pwrite (RMW in O_DIRECT)  | → zero, punch the hole  |
//!   | zero   | zeros                    | pwrite → data (new page)  | zeros + patch → data      | nothing                 |
//!
//! - **Per-I/O cost**: a read is one `pread` per run of data pages (or one lower read per
//!   run of absent pages); a write is one `pwrite` of the whole range. In buffered mode a
//!   write whose partial edge pages are already data goes straight from the caller's buffer;
//!   otherwise the range is assembled in an aligned per-thread buffer (old edge pages read
//!   from the file, the vDisk or as zeros) and written as whole pages.
//! - **Ordering**: a write holds the striped page locks of every page it touches
//!   ([`PageLocks`]), writes the file, *then* marks the pages data; a trim marks pages zero,
//!   *then* punches. So a lock-free reader that sees *data* finds the bytes in the file, and
//!   two writers of one page never lose an update.
//! - **Space**: the file's used bytes are the data pages × 4096 (exact, `file_bytes`).
//!   `cfg.max_file` caps them: a write that would turn pages that are not data into data
//!   past the cap fails whole with [`ErrorKind::NoSpace`] (logged once, counted in
//!   `nospace_errors`); overwrites of data pages always work; trims give space back. A
//!   write the *file system* refuses (ENOSPC: the folder's disk is full before the cap) is
//!   answered the same way: counted in `nospace_errors`, logged at most once a minute with
//!   the folder and what to do, and nothing acknowledged is touched.
//! - **Preallocation**: the first write of new pages into a 2 MiB chunk of the file
//!   `fallocate`s the whole chunk ([`Prealloc`]), so ext4 allocates once per chunk rather
//!   than inside every random 4 KiB write (with O_DIRECT: 0.13–0.20× → 0.21–0.51× of raw
//!   fio on the VDI profile, same runs), and by default writes zeros over it
//!   (`cfg.zero_fill`), so that guest writes land on written blocks and ext4 converts no
//!   extent per write. It changes no accounting above; it stops before
//!   preallocated chunks plus data pages would pass `max_file`, and a trim that frees a
//!   whole chunk punches it whole.
//! - **Batches** (`O_DIRECT` only): the NBD server hands a connection's reads and writes to
//!   [`BlockDev::io_batch`] together. Whole-page writes, and whole-page reads of pages that
//!   are all *data*, take their page locks without waiting, go to the file in one io_uring
//!   submission from the connection's own thread, and update the map when complete — the
//!   same order as a single write. Everything else (partial pages, reads that need the
//!   vDisk, pages whose locks are busy) runs after the submission, one request at a time.
//!   VDI profile through NBD: 0.27× → 0.76× of the raw disk (docs/BENCHMARKS.md), because
//!   no thread sleeps and wakes per request any more; 0.99× with zero-filled chunks.
//! - **Flush**: not advertised (`Caps::flush` and `fua` false) and a no-op: the file is
//!   deleted when the cache closes and a new attach starts empty, so `fdatasync` would make
//!   nothing survive that anyone could read. Completed writes are visible to every
//!   connection at once (one file, one map), so `multi_conn` holds.
//! - **Zeroing** never writes zeros for whole pages (it is a map change and a punch), so it
//!   is always fast; `NO_HOLE` is not honoured as a reservation: this cache never reserves.
//! - **Non-persistence**: every open creates a fresh, uniquely named file in `cfg.dir` with
//!   `O_EXCL` and unlinks it at once; the descriptor keeps it alive until drop.
//!
//! Invariants: the lower device is only read; a page is *data* only after its bytes are in
//! the file; the bytes past the device size in the last page are never read.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use vdstream_blockdev::ring::{self, FileIo};
use vdstream_blockdev::{
    check_range, BatchIo, BatchOp, BlockDev, Caps, Error, ErrorKind, Extent, Hole, IoEngine,
    IoEngineKind, Op, Result, ZeroFlags,
};

use crate::cachefile::{is_aligned, with_arena, with_bounce, CacheFile, BOUNCE_BYTES};
pub use crate::names::file_stem;
use crate::page::{read_lower_page, PageLocks, PAGE, PAGE_SHIFT, PAGE_U64};
use crate::pagemap::{ChangedPages, PageMap, PageState};
use crate::prealloc::Prealloc;
use crate::stats::CacheStats;
use crate::{CacheConfig, CacheType, StatsSnapshot, WriteCache};

/// Stripes of page locks per cache.
const LOCK_STRIPES: usize = 1024;
/// Most extents one block-status answer returns.
const MAX_EXTENTS: usize = 1024;
static ZERO_PAGE: [u8; PAGE] = [0; PAGE];

fn round_down(x: u64) -> u64 {
    x & !(PAGE_U64 - 1)
}

fn round_up(x: u64) -> u64 {
    round_down(x + PAGE_U64 - 1)
}

/// A disk write cache; see the module notes.
#[derive(Debug)]
pub struct DiskCache {
    lower: Arc<dyn BlockDev>,
    file: CacheFile,
    map: PageMap,
    locks: PageLocks,
    /// Chunks of the file preallocated ahead of the writes.
    prealloc: Prealloc,
    stats: CacheStats,
    kind: CacheType,
    target: String,
    dir: PathBuf,
    size: u64,
    /// Most data pages `max_file` allows.
    limit_pages: u64,
    warned_full: AtomicBool,
    /// Rate limit of the "file system full" warning.
    fs_full_log: vdstream_blockdev::lograte::LogLimiter,
    /// Persistent types: pages whose state changed since the last flush.
    changed: Option<ChangedPages>,
    /// Set by every write to the file; cleared by a flush before its `fdatasync`.
    unsynced: AtomicBool,
    /// Delete this path on drop (if unlinking right after creation failed).
    remove_on_drop: Option<PathBuf>,
}

static NEXT_FILE: AtomicU64 = AtomicU64::new(0);

impl DiskCache {
    /// Opens a fresh, empty cache over `lower` in a new file in `cfg.dir`.
    pub fn open(lower: Arc<dyn BlockDev>, cfg: &CacheConfig, kind: CacheType) -> Result<Self> {
        let engine = cfg.io_engine;
        Self::open_with_engine(lower, cfg, kind, |what| IoEngine::open(engine, what))
    }

    /// Like [`open`](Self::open), with the cache file's engine made by `engine` (given the
    /// file's name) instead of from `cfg.io_engine`.
    pub fn open_with_engine(
        lower: Arc<dyn BlockDev>,
        cfg: &CacheConfig,
        kind: CacheType,
        engine: impl FnOnce(&str) -> IoEngine,
    ) -> Result<Self> {
        let pages = lower.size().div_ceil(PAGE_U64);
        if let Some(device) = &cfg.overflow_device {
            let file = CacheFile::open_device(device, pages, !cfg.intermediate_buffering, || {
                engine(&device.display().to_string())
            })
            .map_err(|e| Error {
                message: format!(
                    "cannot use {} as the {kind} cache of target {}: {}",
                    device.display(),
                    cfg.target,
                    e.message
                ),
                ..e
            })?;
            return Ok(DiskCache::with_file(lower, file, cfg, kind, false));
        }
        let name = format!(
            ".vdstream-{kind}-{}-{}-{}.cache",
            file_stem(&cfg.target),
            std::process::id(),
            NEXT_FILE.fetch_add(1, Ordering::Relaxed)
        );
        let path = cfg.dir.join(&name);
        let file = CacheFile::open_with_engine(
            &path,
            pages,
            !cfg.intermediate_buffering,
            true,
            true,
            || engine(&name),
        )
        .map_err(|e| Error {
            message: format!(
                "cannot create the {kind} cache file of target {}: {}",
                cfg.target, e.message
            ),
            ..e
        })?;
        let mut cache = DiskCache::with_file(lower, file, cfg, kind, false);
        if let Err(e) = std::fs::remove_file(&path) {
            log::warn!("cannot unlink the cache file {} right away ({e}); it is removed when the cache closes", path.display());
            cache.remove_on_drop = Some(path);
        }
        Ok(cache)
    }

    /// The engine over an open cache file (all pages absent). With `track_changes`, every
    /// page state change is recorded for [`DiskCache::drain_changed`].
    pub(crate) fn with_file(
        lower: Arc<dyn BlockDev>,
        file: CacheFile,
        cfg: &CacheConfig,
        kind: CacheType,
        track_changes: bool,
    ) -> Self {
        let size = lower.size();
        let pages = size.div_ceil(PAGE_U64);
        let limit_pages = cfg.max_file.map_or(pages, |m| m / PAGE_U64);
        DiskCache {
            lower,
            file,
            map: PageMap::new(pages),
            locks: PageLocks::new(LOCK_STRIPES),
            prealloc: Prealloc::new(pages, limit_pages.min(pages), cfg.zero_fill),
            stats: CacheStats::default(),
            kind,
            target: cfg.target.clone(),
            dir: cfg.dir.clone(),
            size,
            limit_pages,
            warned_full: AtomicBool::new(false),
            fs_full_log: crate::space::full_log(),
            changed: track_changes.then(|| ChangedPages::new(pages)),
            unsynced: AtomicBool::new(false),
            remove_on_drop: None,
        }
    }

    pub(crate) fn map(&self) -> &PageMap {
        &self.map
    }

    pub(crate) fn cache_file(&self) -> &CacheFile {
        &self.file
    }

    /// The engine the cache file's pages go through (sync after a fallback).
    pub fn io_engine(&self) -> IoEngineKind {
        self.file.engine()
    }

    pub(crate) fn counters(&self) -> &CacheStats {
        &self.stats
    }

    /// Recomputes `file_bytes` after the map was loaded from elsewhere.
    pub(crate) fn refresh_file_bytes(&self) {
        self.stats
            .file_bytes
            .store(self.map.data_pages() * PAGE_U64, Ordering::Relaxed);
    }

    /// Takes the pages whose state changed since the last call (ascending).
    pub(crate) fn drain_changed(&self) -> Vec<u64> {
        self.changed
            .as_ref()
            .map(ChangedPages::drain)
            .unwrap_or_default()
    }

    /// Whether anything was written to the file since the last call.
    pub(crate) fn take_unsynced(&self) -> bool {
        self.unsynced.swap(false, Ordering::AcqRel)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Flags that the file has writes a flush has not synced (a failed flush puts it back).
    pub(crate) fn mark_unsynced(&self) {
        self.unsynced.store(true, Ordering::Release);
    }

    pub(crate) fn mark_changed(&self, page: u64) {
        if let Some(c) = &self.changed {
            c.mark(page);
        }
    }

    fn no_space(&self, op: Op, offset: u64, len: u64) -> Error {
        self.stats.nospace_errors.fetch_add(1, Ordering::Relaxed);
        let cap = self.limit_pages * PAGE_U64;
        let message = format!(
            "the {} write cache of target {} is full: its file in {} holds {} bytes, the cap (max_file) is {cap} bytes; \
             writes to pages already cached still work: raise max_file, trim unused space in the guest, or re-attach to start empty",
            self.kind,
            self.target,
            self.dir.display(),
            self.map.data_pages() * PAGE_U64,
        );
        if !self.warned_full.swap(true, Ordering::Relaxed) {
            log::warn!("{message}");
        }
        Error::new(
            ErrorKind::NoSpace,
            op,
            offset,
            len,
            self.describe(),
            message,
        )
    }

    /// A write error from the cache file: when the file system is full (ENOSPC, EDQUOT), the
    /// write is refused for space like one past the cap: counted, logged (rate-limited),
    /// and told what to do.
    fn file_write_err(&self, e: Error) -> Error {
        if e.kind != ErrorKind::NoSpace {
            return e;
        }
        self.stats.nospace_errors.fetch_add(1, Ordering::Relaxed);
        let message = format!(
            "the file system of {} is full: the {} write cache of target {} cannot take new blocks (its file holds {} bytes; {}); \
             writes to pages already cached still work: free space there, trim unused space in the guest, or put the cache on a \
             larger file system (--overflow-dir)",
            self.dir.display(),
            self.kind,
            self.target,
            self.map.data_pages() * PAGE_U64,
            e.message,
        );
        self.fs_full_log.log(
            log::Level::Warn,
            module_path!(),
            "file system full",
            format_args!("{message}"),
        );
        Error { message, ..e }
    }

    /// Fills `out` (one aligned page) with page `p` as the cache sees it now.
    fn old_page(&self, p: u64, out: &mut [u8]) -> Result<()> {
        match self.map.get(p) {
            PageState::Data => {
                self.file.read(out, p << PAGE_SHIFT)?;
                CacheStats::count(
                    &self.stats.disk_read_ops,
                    &self.stats.disk_read_bytes,
                    PAGE_U64,
                );
                Ok(())
            }
            PageState::Absent => read_lower_page(&*self.lower, &self.stats, p, out),
            PageState::Zero => {
                out.fill(0);
                Ok(())
            }
        }
    }

    /// Writes `data` at `offset` (non-empty, in range) with the page locks of the range held.
    fn write_locked(&self, data: &[u8], offset: u64, op: Op) -> Result<()> {
        let len = data.len() as u64;
        let end = offset + len;
        let (first, last) = (offset >> PAGE_SHIFT, (end - 1) >> PAGE_SHIFT);
        let new = (first..=last)
            .filter(|&p| self.map.get(p) != PageState::Data)
            .count() as u64;
        if new > 0 && !self.map.reserve(new, self.limit_pages) {
            return Err(self.no_space(op, offset, len));
        }
        if new > 0 {
            self.prealloc
                .ensure(&self.file, first, last, self.map.data_pages(), &|p| {
                    self.map.get(p) == PageState::Data
                });
        }
        // The page locks keep every page of the range in the state counted above.
        if let Err(e) = self.write_file(data, offset) {
            self.map.release(new);
            return Err(self.file_write_err(Error { op, ..e }));
        }
        for p in first..=last {
            if self.map.set_data_reserved(p) != PageState::Data {
                self.mark_changed(p);
            }
        }
        self.unsynced.store(true, Ordering::Release);
        self.refresh_file_bytes();
        Ok(())
    }

    /// The file part of a write: one pwrite of the caller's bytes when possible, else the
    /// range assembled as whole pages in the aligned bounce buffer.
    fn write_file(&self, data: &[u8], offset: u64) -> Result<()> {
        let end = offset + data.len() as u64;
        let (first, last) = (offset >> PAGE_SHIFT, (end - 1) >> PAGE_SHIFT);
        let head_partial = offset % PAGE_U64 != 0 || (first == last && end % PAGE_U64 != 0);
        let tail_partial = end % PAGE_U64 != 0;
        let direct_ok = if self.file.is_direct() {
            is_aligned(data, offset)
        } else {
            (!head_partial || self.map.get(first) == PageState::Data)
                && (!tail_partial || self.map.get(last) == PageState::Data)
        };
        if direct_ok {
            self.file.write(data, offset)?;
            CacheStats::count(
                &self.stats.disk_write_ops,
                &self.stats.disk_write_bytes,
                data.len() as u64,
            );
            return Ok(());
        }
        for piece in vdstream_blockdev::span::units(offset, data.len() as u64, BOUNCE_BYTES as u64)
        {
            let (ps, pe) = (
                offset + piece.pos as u64,
                offset + (piece.pos + piece.len) as u64,
            );
            let (span_start, span_end) = (round_down(ps), round_up(pe));
            let span = (span_end - span_start) as usize;
            with_bounce(span, |b| {
                if ps != span_start || (pe != span_end && span == PAGE) {
                    self.old_page(span_start >> PAGE_SHIFT, &mut b[..PAGE])?;
                }
                if pe != span_end && span > PAGE {
                    self.old_page((span_end >> PAGE_SHIFT) - 1, &mut b[span - PAGE..])?;
                }
                let at = (ps - span_start) as usize;
                b[at..at + piece.len].copy_from_slice(&data[piece.pos..piece.pos + piece.len]);
                self.file.write(b, span_start)?;
                CacheStats::count(
                    &self.stats.disk_write_ops,
                    &self.stats.disk_write_bytes,
                    span as u64,
                );
                Ok(())
            })?;
        }
        Ok(())
    }

    /// Reads `[offset, offset+buf.len())` of the cache file into `buf`.
    fn read_file(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        if !self.file.is_direct() || is_aligned(buf, offset) {
            self.file.read(buf, offset)?;
            CacheStats::count(
                &self.stats.disk_read_ops,
                &self.stats.disk_read_bytes,
                buf.len() as u64,
            );
            return Ok(());
        }
        for piece in vdstream_blockdev::span::units(offset, buf.len() as u64, BOUNCE_BYTES as u64) {
            let ps = offset + piece.pos as u64;
            let (span_start, span_end) = (round_down(ps), round_up(ps + piece.len as u64));
            let span = (span_end - span_start) as usize;
            with_bounce(span, |b| {
                self.file.read(b, span_start)?;
                CacheStats::count(
                    &self.stats.disk_read_ops,
                    &self.stats.disk_read_bytes,
                    span as u64,
                );
                let at = (ps - span_start) as usize;
                buf[piece.pos..piece.pos + piece.len].copy_from_slice(&b[at..at + piece.len]);
                Ok::<_, Error>(())
            })?;
        }
        Ok(())
    }

    fn read_inner(
        &self,
        buf: &mut [u8],
        offset: u64,
        mut holes: Option<&mut Vec<Hole>>,
    ) -> Result<()> {
        let len = buf.len() as u64;
        check_range(self.size, Op::Read, offset, len, &|| self.describe())?;
        CacheStats::count(
            &self.stats.guest_read_ops,
            &self.stats.guest_read_bytes,
            len,
        );
        if len == 0 {
            return Ok(());
        }
        let end = offset + len;
        let (mut p, stop) = (offset >> PAGE_SHIFT, ((end - 1) >> PAGE_SHIFT) + 1);
        while p < stop {
            let (state, run_end) = self.map.run(p, stop);
            let (bs, be) = (
                (p << PAGE_SHIFT).max(offset),
                (run_end << PAGE_SHIFT).min(end),
            );
            let at = (bs - offset) as usize;
            let piece = &mut buf[at..(be - offset) as usize];
            let pages = run_end - p;
            match state {
                PageState::Data => {
                    self.stats.hits.fetch_add(pages, Ordering::Relaxed);
                    self.read_file(piece, bs)?;
                }
                PageState::Zero => {
                    self.stats.hits.fetch_add(pages, Ordering::Relaxed);
                    piece.fill(0);
                    if let Some(h) = holes.as_deref_mut() {
                        h.push(Hole {
                            start: at,
                            len: piece.len(),
                        });
                    }
                }
                PageState::Absent => {
                    self.stats.misses.fetch_add(pages, Ordering::Relaxed);
                    CacheStats::count(
                        &self.stats.vdisk_read_ops,
                        &self.stats.vdisk_read_bytes,
                        piece.len() as u64,
                    );
                    match holes.as_deref_mut() {
                        None => self.lower.read_at(piece, bs)?,
                        Some(h) => {
                            let mut below = Vec::new();
                            self.lower.read_at_sparse(piece, bs, &mut below)?;
                            h.extend(below.into_iter().map(|x| Hole {
                                start: x.start + at,
                                len: x.len,
                            }));
                        }
                    }
                }
            }
            p = run_end;
        }
        Ok(())
    }

    /// Trim and write-zeroes: whole pages become zero (and are punched), partial pages get
    /// zeros written into them.
    fn zero_range(&self, offset: u64, len: u64, op: Op) -> Result<()> {
        check_range(self.size, op, offset, len, &|| self.describe())?;
        if len == 0 {
            return Ok(());
        }
        let end = offset + len;
        let (first, last) = (offset >> PAGE_SHIFT, (end - 1) >> PAGE_SHIFT);
        // The last page of a device whose size is not a page multiple is whole when the range
        // reaches the end of the device.
        let ends_whole = end % PAGE_U64 == 0 || end == self.size;
        let head_partial = offset % PAGE_U64 != 0 || (first == last && !ends_whole);
        let tail_partial = last != first && !ends_whole;
        let _guard = self.locks.lock_pages(first, last - first + 1);
        let (wf, we) = (first + head_partial as u64, last + 1 - tail_partial as u64);
        if we > wf {
            let was_data = self
                .map
                .set_range(wf, we - wf, PageState::Zero, |p| self.mark_changed(p));
            self.refresh_file_bytes();
            // Punch what was data, and chunks freed whole (they may hold preallocated blocks).
            if (was_data > 0 || self.prealloc.holds_whole(wf, we))
                && self
                    .file
                    .punch(wf << PAGE_SHIFT, (we - wf) << PAGE_SHIFT)
                    .map_err(|e| Error { op, ..e })?
            {
                self.prealloc.freed(wf, we);
            }
        }
        let zero_part = |p: u64| -> Result<()> {
            if self.map.get(p) == PageState::Zero {
                return Ok(());
            }
            let (s, e) = (
                (p << PAGE_SHIFT).max(offset),
                ((p + 1) << PAGE_SHIFT).min(end),
            );
            self.write_locked(&ZERO_PAGE[..(e - s) as usize], s, op)
        };
        if head_partial {
            zero_part(first)?;
        }
        if tail_partial {
            zero_part(last)?;
        }
        Ok(())
    }
}

impl Drop for DiskCache {
    fn drop(&mut self) {
        if let Some(path) = &self.remove_on_drop {
            if let Err(e) = std::fs::remove_file(path) {
                log::warn!(
                    "cannot remove the cache file {}: {e}; delete it by hand",
                    path.display()
                );
            }
        }
    }
}

impl BlockDev for DiskCache {
    fn size(&self) -> u64 {
        self.size
    }

    fn caps(&self) -> Caps {
        crate::volatile_cache_caps(true)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.read_inner(buf, offset, None)
    }

    fn read_at_sparse(&self, buf: &mut [u8], offset: u64, holes: &mut Vec<Hole>) -> Result<()> {
        self.read_inner(buf, offset, Some(holes))
    }

    fn write_at(&self, buf: &[u8], offset: u64, _fua: bool) -> Result<()> {
        let len = buf.len() as u64;
        check_range(self.size, Op::Write, offset, len, &|| self.describe())?;
        CacheStats::count(
            &self.stats.guest_write_ops,
            &self.stats.guest_write_bytes,
            len,
        );
        if len == 0 {
            return Ok(());
        }
        let _guard = self.locks.lock_bytes(offset, len);
        self.write_locked(buf, offset, Op::Write)
    }

    fn trim(&self, offset: u64, len: u64, _fua: bool) -> Result<()> {
        self.zero_range(offset, len, Op::Trim)
    }

    fn write_zeroes(&self, offset: u64, len: u64, _flags: ZeroFlags) -> Result<()> {
        self.zero_range(offset, len, Op::Zero)
    }

    fn block_status(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        check_range(self.size, Op::BlockStatus, offset, len, &|| self.describe())?;
        if len == 0 {
            return Ok(());
        }
        let end = offset + len;
        let (mut p, stop) = (offset >> PAGE_SHIFT, ((end - 1) >> PAGE_SHIFT) + 1);
        let start_len = out.len();
        let push = |out: &mut Vec<Extent>, e: Extent| {
            let mergeable = out.len() > start_len;
            match out.last_mut() {
                Some(l) if mergeable && l.hole == e.hole && l.zero == e.zero => l.len += e.len,
                _ => out.push(e),
            }
        };
        while p < stop && out.len() - start_len < MAX_EXTENTS {
            let (state, run_end) = self.map.run(p, stop);
            let (bs, be) = (
                (p << PAGE_SHIFT).max(offset),
                (run_end << PAGE_SHIFT).min(end),
            );
            match state {
                PageState::Data => push(
                    out,
                    Extent {
                        len: be - bs,
                        hole: false,
                        zero: false,
                    },
                ),
                PageState::Zero => push(
                    out,
                    Extent {
                        len: be - bs,
                        hole: true,
                        zero: true,
                    },
                ),
                PageState::Absent => {
                    let mut below = Vec::new();
                    self.lower.block_status(bs, be - bs, &mut below)?;
                    let covered: u64 = below.iter().map(|e| e.len).sum();
                    for e in below {
                        push(out, e);
                    }
                    if covered < be - bs {
                        break;
                    }
                }
            }
            p = run_end;
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!(
            "{} cache of target {} in {}",
            self.kind,
            self.target,
            self.dir.display()
        )
    }

    fn io_batch(&self, ops: &mut [BatchOp<'_>]) {
        if !self.file.is_direct() {
            // Through the page cache a pwrite is a memcpy: one call per request is cheapest.
            for op in ops {
                op.run_alone(self);
            }
            return;
        }
        self.direct_batch(ops);
    }

    fn prefers_batches(&self) -> bool {
        self.file.is_direct()
    }
}

/// One request of a batch that goes to the cache file in [`DiskCache::direct_batch`].
struct Planned {
    op: usize,
    first: u64,
    pages: u64,
    /// Pages the write turns into data (reserved).
    new: u64,
    /// Where its bytes sit in the batch's aligned arena.
    at: usize,
}

impl DiskCache {
    /// `io_batch` with `O_DIRECT`: every whole-page write, and every whole-page read of pages
    /// that are all *data*, goes to the file in one submission through this thread's
    /// io_uring ([`vdstream_blockdev::ring`]); the rest (partial pages, reads that need the
    /// vDisk, pages another request holds) run one by one afterwards, as `read_at` and
    /// `write_at` would run them.
    ///
    /// The page locks of the submitted requests are taken without waiting and held until
    /// their I/O is complete and the map updated, so the module's ordering rules hold as for
    /// a single write; a request whose locks are busy (held by another thread, or by an
    /// earlier request of this batch) is simply run afterwards.
    fn direct_batch(&self, ops: &mut [BatchOp<'_>]) {
        let mut guards = Vec::new();
        let mut planned: Vec<Planned> = Vec::new();
        let mut later: Vec<usize> = Vec::new();
        let mut below: Vec<usize> = Vec::new();
        let mut bytes = 0usize;
        for (i, op) in ops.iter_mut().enumerate() {
            let (offset, len) = (op.offset, op.len() as u64);
            let kind = if op.is_write() { Op::Write } else { Op::Read };
            if let Err(e) = check_range(self.size, kind, offset, len, &|| self.describe()) {
                op.result = Err(e);
                continue;
            }
            if len == 0 || offset % PAGE_U64 != 0 || len % PAGE_U64 != 0 {
                later.push(i);
                continue;
            }
            let (first, pages) = (offset >> PAGE_SHIFT, len >> PAGE_SHIFT);
            let Some(guard) = self.locks.try_lock_pages(first, pages) else {
                later.push(i);
                continue;
            };
            let mut new = 0;
            if op.is_write() {
                new = (first..first + pages)
                    .filter(|&p| self.map.get(p) != PageState::Data)
                    .count() as u64;
                CacheStats::count(
                    &self.stats.guest_write_ops,
                    &self.stats.guest_write_bytes,
                    len,
                );
                if new > 0 && !self.map.reserve(new, self.limit_pages) {
                    op.result = Err(self.no_space(Op::Write, offset, len));
                    continue;
                }
                if new > 0 {
                    self.prealloc.ensure(
                        &self.file,
                        first,
                        first + pages - 1,
                        self.map.data_pages(),
                        &|p| self.map.get(p) == PageState::Data,
                    );
                }
            } else {
                let (state, run_end) = self.map.run(first, first + pages);
                if state == PageState::Absent && run_end >= first + pages {
                    // All from the vDisk: with the other such reads, in one lower batch.
                    below.push(i);
                    continue;
                }
                if state != PageState::Data || run_end < first + pages {
                    later.push(i);
                    continue;
                }
                CacheStats::count(
                    &self.stats.guest_read_ops,
                    &self.stats.guest_read_bytes,
                    len,
                );
                self.stats.hits.fetch_add(pages, Ordering::Relaxed);
            }
            guards.push(guard);
            planned.push(Planned {
                op: i,
                first,
                pages,
                new,
                at: bytes,
            });
            bytes += len as usize;
        }
        if !planned.is_empty() {
            with_arena(bytes, |arena| self.submit_planned(ops, &planned, arena));
        }
        drop(guards);
        self.read_below(ops, &below);
        for i in later {
            ops[i].run_alone(self);
        }
    }

    /// Reads whose pages are all absent, from the vDisk in one batch of the lower device
    /// (a remote base sends them side by side; a file reads them in one submission).
    fn read_below(&self, ops: &mut [BatchOp<'_>], below: &[usize]) {
        if below.is_empty() {
            return;
        }
        let mut sub: Vec<BatchOp<'_>> = Vec::with_capacity(below.len());
        // `below` is ascending: take those ops, each borrowed once.
        for (_, op) in ops
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| below.binary_search(i).is_ok())
        {
            let len = op.len() as u64;
            if let BatchIo::Read(buf) = &mut op.io {
                CacheStats::count(
                    &self.stats.guest_read_ops,
                    &self.stats.guest_read_bytes,
                    len,
                );
                self.stats
                    .misses
                    .fetch_add(len >> PAGE_SHIFT, Ordering::Relaxed);
                CacheStats::count(
                    &self.stats.vdisk_read_ops,
                    &self.stats.vdisk_read_bytes,
                    len,
                );
                sub.push(BatchOp::read(buf, op.offset));
            }
        }
        self.lower.io_batch(&mut sub);
        let results: Vec<Result<()>> = sub.into_iter().map(|b| b.result).collect();
        for (&i, r) in below.iter().zip(results) {
            ops[i].result = r;
        }
    }

    /// The file I/O of the planned requests, in one batch, and the map updates after it.
    fn submit_planned(&self, ops: &mut [BatchOp<'_>], planned: &[Planned], arena: &mut [u8]) {
        let file = self.file.file();
        let mut ios = Vec::with_capacity(planned.len());
        let mut rest = &mut arena[..];
        for p in planned {
            let len = (p.pages << PAGE_SHIFT) as usize;
            let (mine, tail) = rest.split_at_mut(len);
            rest = tail;
            let at = p.first << PAGE_SHIFT;
            match &ops[p.op].io {
                BatchIo::Write(data, _) => {
                    mine.copy_from_slice(data);
                    ios.push(FileIo::write(file, mine, at));
                }
                BatchIo::Read(_) => ios.push(FileIo::read(file, mine, at)),
            }
        }
        ring::run_batch(&mut ios);
        let results: Vec<std::io::Result<()>> = ios.into_iter().map(|io| io.result).collect();
        let mut wrote = false;
        for (p, r) in planned.iter().zip(results) {
            let op = &mut ops[p.op];
            let (at, len) = (p.first << PAGE_SHIFT, p.pages << PAGE_SHIFT);
            op.result = match (r, &mut op.io) {
                (Ok(()), BatchIo::Write(..)) => {
                    CacheStats::count(
                        &self.stats.disk_write_ops,
                        &self.stats.disk_write_bytes,
                        len,
                    );
                    for page in p.first..p.first + p.pages {
                        if self.map.set_data_reserved(page) != PageState::Data {
                            self.mark_changed(page);
                        }
                    }
                    wrote = true;
                    Ok(())
                }
                (Ok(()), BatchIo::Read(buf)) => {
                    CacheStats::count(&self.stats.disk_read_ops, &self.stats.disk_read_bytes, len);
                    buf.copy_from_slice(&arena[p.at..p.at + len as usize]);
                    Ok(())
                }
                (Err(e), io) => {
                    let write = matches!(io, BatchIo::Write(..));
                    self.map.release(p.new);
                    let err = self
                        .file
                        .err(e, if write { Op::Write } else { Op::Read }, at, len);
                    Err(if write { self.file_write_err(err) } else { err })
                }
            };
        }
        if wrote {
            self.unsynced.store(true, Ordering::Release);
            self.refresh_file_bytes();
        }
    }
}

impl DiskCache {
    /// The byte ranges of pages the cache holds (data or zero), in order.
    pub fn held_ranges(&self) -> Vec<(u64, u64)> {
        let pages = self.map.pages();
        let mut out = Vec::new();
        let mut p = 0;
        while p < pages {
            let (state, end) = self.map.run(p, pages);
            if state != PageState::Absent {
                let start = p << PAGE_SHIFT;
                out.push((start, (end << PAGE_SHIFT).min(self.size) - start));
            }
            p = end;
        }
        out
    }
}

impl WriteCache for DiskCache {
    fn cache_type(&self) -> CacheType {
        self.kind
    }

    fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }
}
