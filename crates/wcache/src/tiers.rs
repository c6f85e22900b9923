//! `Tiers`: the data path shared by `device-ram` and `ram-overflow`: RAM pages first, then
//! (for `ram-overflow`) the overflow file, then the lower device (the vDisk).
//!
//! Design notes.
//!
//! Page states and the region layout are in [`crate::region_map`], which this module calls
//! with a page's [`PageAddr`] (made once from the guest offset) and is never called back by:
//! this module decides (RAM budget, I/O, ENOSPC, stats), the map records. The rules:
//! - A read resolves each page under its region's shard lock: RAM pages and zero pages are
//!   copied out right there; overflow and absent pages become file reads and vDisk reads,
//!   coalesced into runs and issued after the lock is dropped. A reader does not take page
//!   locks, so it re-checks afterwards that every region it read from the file still owns
//!   the same unit (`unit_gen`) and retries otherwise (a unit released and reused meanwhile).
//! - A write, trim or zero takes the page locks of its range ([`PageLocks`]) for its whole
//!   duration, so two requests never interleave on one page. Under the page lock, a page in
//!   RAM is patched in place (no I/O: overwrites of RAM pages are free); any other page is
//!   rebuilt (read-modify-write from zero, the file or the vDisk) and placed: into RAM when
//!   the budget has room, else into its region's unit of the overflow file, else ENOSPC.
//! - A page whose new content is all zeros becomes a zero marker instead: its RAM page and
//!   file slot are freed (hole punched), and a unit left with no pages is released.
//! - Eviction (the flusher thread, or a writer when RAM is full) takes a region lock (not the
//!   page locks, so guest writes keep going), snapshots the region's RAM pages (`Arc` clones),
//!   writes them to the unit as runs of adjacent pages with one `pwritev` each, then drops
//!   from RAM exactly the pages that did not change meanwhile (a writer that patched one
//!   copied it on write: [`crate::region_map::Region::page_mut`]). The unit is pinned
//!   during the I/O so that it cannot be released. Evicted pages go to a spare pool that writers reuse for pages coming back; the pool is
//!   part of the RAM budget, and the flusher empties it after a quiet second.
//! - Lock order: page locks → region lock → shard lock → the file's unit table. The flusher
//!   and writers evicting for room hold no page locks.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use vdstream_blockdev::span::units;
use vdstream_blockdev::{check_range, BlockDev, Caps, Error, ErrorKind, Extent, Op, Result};

use crate::overflow_file::{OverflowFile, UNIT, UNIT_PAGES};
use crate::page::{is_zero, read_lower_page, rmw_from_zero, PageLocks, Patch, PAGE, PAGE_U64};
use crate::region_map::{Eviction, Found, Freed, PageAddr, RamPage, RegionMap, Shard};
use crate::stats::CacheStats;

/// Page lock stripes.
const PAGE_STRIPES: usize = 1024;
/// Region lock stripes (evictions against in-place file writes).
const REGION_STRIPES: usize = 64;
/// Longest range one `block_status` call looks at; the answer may stop short there.
const STATUS_SCAN: u64 = 1 << 30;

/// Wakes the flusher when RAM use crosses the high watermark.
#[derive(Debug, Default)]
pub(crate) struct Wake {
    pending: Mutex<bool>,
    cv: Condvar,
    pub stop: AtomicBool,
}

impl Wake {
    pub fn notify(&self) {
        *self.pending.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.cv.notify_one();
    }

    /// Waits for a notification or `timeout`; returns whether one came.
    pub fn wait(&self, timeout: std::time::Duration) -> bool {
        let g = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let (mut g, _) = self
            .cv
            .wait_timeout_while(g, timeout, |p| !*p)
            .unwrap_or_else(PoisonError::into_inner);
        std::mem::replace(&mut *g, false)
    }
}

/// What the cache says when it is full.
#[derive(Debug)]
pub(crate) struct FullReport {
    pub message: String,
    warned: AtomicBool,
    /// Rate limit of the "file system full" warning.
    fs_log: vdstream_blockdev::lograte::LogLimiter,
}

impl FullReport {
    pub fn new(message: String) -> Self {
        FullReport {
            message,
            warned: AtomicBool::new(false),
            fs_log: crate::space::full_log(),
        }
    }
}

/// The shared data path. See the module notes.
#[derive(Debug)]
pub(crate) struct Tiers {
    pub lower: Arc<dyn BlockDev>,
    pub size: u64,
    pub name: String,
    pub map: RegionMap,
    pub locks: PageLocks,
    region_locks: PageLocks,
    pub file: Option<OverflowFile>,
    pub stats: CacheStats,
    /// RAM budget in bytes (a multiple of the page size).
    pub ram_limit: u64,
    /// RAM use at which the flusher is woken (`u64::MAX`: no flusher).
    pub high: u64,
    pub wake: Wake,
    full: FullReport,
    /// Page buffers freed by evictions, kept for reuse inside the RAM budget: pages in RAM
    /// plus spares stay within `ram_limit` (see [`Tiers::recycle`]).
    spares: Mutex<Vec<RamPage>>,
}

/// A piece of a read served by I/O after the shard lock is dropped.
#[derive(Debug)]
struct ReadIo {
    /// `Some(file offset)`, or `None` for the lower device at `dev_off`.
    file_off: Option<u64>,
    dev_off: u64,
    pos: usize,
    len: usize,
}

impl Tiers {
    pub fn new(
        lower: Arc<dyn BlockDev>,
        name: String,
        ram: u64,
        file: Option<OverflowFile>,
        full: String,
    ) -> Self {
        let size = lower.size();
        Tiers {
            lower,
            size,
            name,
            map: RegionMap::default(),
            locks: PageLocks::new(PAGE_STRIPES),
            region_locks: PageLocks::new(REGION_STRIPES),
            file,
            stats: CacheStats::default(),
            ram_limit: ram / PAGE_U64 * PAGE_U64,
            high: u64::MAX,
            wake: Wake::default(),
            full: FullReport::new(full),
            spares: Mutex::new(Vec::new()),
        }
    }

    fn io_err(&self, e: std::io::Error, op: Op, offset: u64, len: u64) -> Error {
        let path = self
            .file
            .as_ref()
            .map(|f| f.path().display().to_string())
            .unwrap_or_default();
        let mut err = Error::from_io(e, op, offset, len, self.name.clone());
        err.message = format!("overflow file {path}: {}", err.message);
        err
    }

    /// The ENOSPC answer: counted every time, logged once per cache.
    fn nospace(&self, op: Op, offset: u64, len: u64) -> Error {
        self.stats.nospace_errors.fetch_add(1, Relaxed);
        if !self.full.warned.swap(true, Relaxed) {
            log::error!("{}: {}", self.name, self.full.message);
        }
        Error::new(
            ErrorKind::NoSpace,
            op,
            offset,
            len,
            self.name.clone(),
            self.full.message.clone(),
        )
    }

    /// Takes one page of the RAM budget, waking the flusher past the high watermark.
    fn take_ram(&self) -> bool {
        let limit = self.ram_limit;
        match self.stats.ram_bytes.fetch_update(Relaxed, Relaxed, |v| {
            (v + PAGE_U64 <= limit).then_some(v + PAGE_U64)
        }) {
            Ok(prev) => {
                if prev + PAGE_U64 >= self.high && prev < self.high {
                    self.wake.notify();
                }
                true
            }
            Err(_) => false,
        }
    }

    /// A page buffer for a page being rebuilt, from the spare pool if it has one (its old
    /// bytes are left: every caller overwrites the whole page), else freshly allocated.
    fn spare_page(&self) -> RamPage {
        let spare = self
            .spares
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        spare.unwrap_or_else(|| Arc::new([0u8; PAGE]))
    }

    /// Keeps the unique ones of `pages` (evicted pages, copies replaced during an eviction)
    /// as spares, so that the pages coming back into RAM do not cost an allocation, a
    /// zero fill and a free each. The pool is part of the RAM budget: it keeps a page only
    /// while pages in RAM plus spares stay within `--ram` (call it after the evicted pages
    /// left the RAM count). A writer takes a spare as it takes a page of the budget, so
    /// the sum does not grow (a writer that allocates while the pool is being refilled may
    /// pass `--ram` by its one page), and the pool can hold every page an eviction freed.
    /// The flusher empties the pool after a quiet second ([`Tiers::drop_spares`]).
    fn recycle(&self, pages: Vec<(usize, RamPage)>) {
        let room = (self
            .ram_limit
            .saturating_sub(self.stats.ram_bytes.load(Relaxed))
            / PAGE_U64) as usize;
        let mut rest = pages.into_iter();
        {
            let mut spares = self.spares.lock().unwrap_or_else(PoisonError::into_inner);
            for (_, p) in rest.by_ref() {
                if spares.len() >= room {
                    break;
                }
                if Arc::strong_count(&p) == 1 {
                    spares.push(p);
                }
            }
        }
        drop(rest); // freed outside the pool's lock (`give_ram` counted them as freed)
    }

    /// Gives the spare pool back to the allocator and returns the pages dropped; the
    /// caller then returns the memory to the system with `reclaim::reclaim_now` (the pool
    /// may be smaller than `maybe_reclaim`'s threshold, and a reclaim may have run while
    /// its pages sat in it).
    pub fn drop_spares(&self) -> usize {
        let spares =
            std::mem::take(&mut *self.spares.lock().unwrap_or_else(PoisonError::into_inner));
        spares.len()
    }

    /// Spare page buffers held now (for tests).
    #[cfg(test)]
    pub(crate) fn spare_count(&self) -> usize {
        self.spares
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Takes `pages` off the RAM in use; the memory goes back to the system at the next
    /// `reclaim::maybe_reclaim` outside the locks (after a trim, or in the flusher).
    fn give_ram(&self, pages: u64) {
        self.stats.ram_bytes.fetch_sub(pages * PAGE_U64, Relaxed);
        vdstream_blockdev::reclaim::note_freed(pages * PAGE_U64);
    }

    /// Accounts for what zeroing freed.
    fn freed(&self, freed: Freed) {
        self.give_ram(freed.ram);
        self.stats
            .file_bytes
            .fetch_sub(freed.file * PAGE_U64, Relaxed);
    }

    /// What a cache over these tiers can do: the same for `device-ram` and `ram-overflow`,
    /// except that the overflow file may block (reads and evictions are disk I/O), while a
    /// RAM-only cache blocks only if its lower device does.
    pub fn caps(&self) -> Caps {
        crate::volatile_cache_caps(self.file.is_some() || self.lower.caps().may_block)
    }

    /// Validates a request's range against the device (the NBD edge validated it already;
    /// this guards in-process callers).
    pub fn check(&self, op: Op, offset: u64, len: u64) -> Result<()> {
        check_range(self.size, op, offset, len, &|| self.name.clone())
    }

    pub fn ram_full(&self) -> bool {
        self.stats.ram_bytes.load(Relaxed) + PAGE_U64 > self.ram_limit
    }

    // ---- read ---------------------------------------------------------------------------

    pub fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        CacheStats::count(
            &self.stats.guest_read_ops,
            &self.stats.guest_read_bytes,
            buf.len() as u64,
        );
        loop {
            let mut ios: Vec<ReadIo> = Vec::new();
            let mut checks: Vec<(u64, Option<u64>)> = Vec::new();
            let (mut pages, mut misses) = (0u64, 0u64);
            for rp in units(offset, buf.len() as u64, UNIT) {
                let sh = self.map.lock(rp.index);
                let reg = sh.get(rp.index);
                let mut from_file = false;
                for pp in units(offset + rp.pos as u64, rp.len as u64, PAGE_U64) {
                    let slot = (pp.index % UNIT_PAGES as u64) as usize;
                    let pos = rp.pos + pp.pos;
                    let mut push = |file_off: Option<u64>| match ios.last_mut() {
                        Some(last)
                            if last.pos + last.len == pos
                                && last.file_off.is_some() == file_off.is_some()
                                && last.file_off.map(|o| o + last.len as u64) == file_off =>
                        {
                            last.len += pp.len
                        }
                        _ => ios.push(ReadIo {
                            file_off,
                            dev_off: offset + pos as u64,
                            pos,
                            len: pp.len,
                        }),
                    };
                    pages += 1;
                    match reg.map_or(Found::Absent, |r| r.page(slot)) {
                        Found::Ram(page) => buf[pos..pos + pp.len]
                            .copy_from_slice(&page[pp.within..pp.within + pp.len]),
                        Found::Zero => buf[pos..pos + pp.len].fill(0),
                        Found::Overflow(off) => {
                            push(Some(off + pp.within as u64));
                            from_file = true;
                        }
                        Found::Absent => {
                            push(None);
                            misses += 1;
                        }
                    }
                }
                if from_file {
                    checks.push((rp.index, reg.and_then(|r| r.unit_gen())));
                }
            }
            for io in &ios {
                let dst = &mut buf[io.pos..io.pos + io.len];
                match io.file_off {
                    Some(off) => {
                        let file = self.file.as_ref().expect("file pages need a file");
                        file.read_at(dst, off)
                            .map_err(|e| self.io_err(e, Op::Read, io.dev_off, io.len as u64))?;
                        CacheStats::count(
                            &self.stats.overflow_read_ops,
                            &self.stats.overflow_read_bytes,
                            io.len as u64,
                        );
                    }
                    None => {
                        self.lower.read_at(dst, io.dev_off)?;
                        CacheStats::count(
                            &self.stats.vdisk_read_ops,
                            &self.stats.vdisk_read_bytes,
                            io.len as u64,
                        );
                    }
                }
            }
            let unchanged = checks.iter().all(|&(region, gen)| {
                self.map.lock(region).get(region).and_then(|r| r.unit_gen()) == gen
            });
            if unchanged {
                self.stats.hits.fetch_add(pages - misses, Relaxed);
                self.stats.misses.fetch_add(misses, Relaxed);
                return Ok(());
            }
        }
    }

    // ---- write, trim, zero --------------------------------------------------------------

    pub fn write(&self, buf: &[u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        CacheStats::count(
            &self.stats.guest_write_ops,
            &self.stats.guest_write_bytes,
            len,
        );
        if self.file.is_some() && self.ram_limit > 0 && self.ram_full() {
            // Backpressure, bounded: make room for this write by evicting one region now.
            if let Err(e) = self.evict_one() {
                log::debug!("{}: eviction for room failed: {e}", self.name);
            }
        }
        if offset / PAGE_U64 == (offset + len - 1) / PAGE_U64 && self.patch_if_in_ram(offset, buf) {
            return Ok(());
        }
        let _pages = self.locks.lock_bytes(offset, len);
        for pp in units(offset, len, PAGE_U64) {
            self.write_page(
                PageAddr::of(pp.index),
                pp.within,
                Patch::Data(&buf[pp.pos..pp.pos + pp.len]),
                Op::Write,
                offset,
                len,
            )?;
        }
        Ok(())
    }

    /// The fast path of a write inside one page that is in RAM: patched under the shard
    /// lock alone, without the page lock. That is safe because every write path that drops
    /// the shard lock mid-way (read-modify-write from the vDisk or the overflow file,
    /// placing a page) starts from a page that is *not* in RAM, and such a page sends this
    /// path to the page lock too; a page in RAM is only ever changed whole under the
    /// shard lock. Returns false, having changed nothing, when the page is not in RAM.
    fn patch_if_in_ram(&self, offset: u64, data: &[u8]) -> bool {
        let at = PageAddr::of(offset / PAGE_U64);
        let mut sh = self.map.lock(at.region);
        let Found::Ram(page) = sh.page_mut(at) else {
            return false;
        };
        Patch::Data(data).apply(page, (offset % PAGE_U64) as usize);
        true
    }

    /// Trim and write-zeroes: the range reads as zeros afterwards.
    pub fn zero_range(&self, offset: u64, len: u64, op: Op) -> Result<()> {
        let _pages = self.locks.lock_bytes(offset, len);
        for rp in units(offset, len, UNIT) {
            if rp.is_whole(UNIT) {
                self.zero_region(rp.index)?;
                continue;
            }
            for pp in units(offset + rp.pos as u64, rp.len as u64, PAGE_U64) {
                let at = PageAddr::of(pp.index);
                if pp.is_whole(PAGE_U64) {
                    self.freed(self.map.lock(at.region).mark_zero(at, self.file.as_ref()));
                } else {
                    self.write_page(at, pp.within, Patch::Zeros(pp.len), op, offset, len)?;
                }
            }
        }
        Ok(())
    }

    /// Applies `patch` at `within` of the page at `at`; the caller holds the page lock.
    fn write_page(
        &self,
        at: PageAddr,
        within: usize,
        patch: Patch<'_>,
        op: Op,
        offset: u64,
        len: u64,
    ) -> Result<()> {
        let zeros = matches!(patch, Patch::Zeros(_));
        let mut sh = self.map.lock(at.region);
        let found: Found<()> = match sh.page_mut(at) {
            Found::Ram(page) => {
                patch.apply(page, within);
                if zeros && is_zero(page) {
                    self.freed(sh.mark_zero(at, self.file.as_ref()));
                }
                return Ok(());
            }
            Found::Zero if zeros => return Ok(()),
            Found::Zero => Found::Zero,
            Found::Overflow(off) => Found::Overflow(off),
            Found::Absent => Found::Absent,
        };
        if self.file.is_none() && !zeros && self.ram_full() {
            return Err(self.nospace(op, offset, len));
        }
        let mut page = self.spare_page();
        let buf = Arc::get_mut(&mut page).expect("a spare page is unique");
        match found {
            Found::Zero => rmw_from_zero(within, patch, buf),
            _ if patch.covers_page(within) => patch.apply(buf, 0),
            _ => {
                drop(sh);
                if let Found::Overflow(off) = found {
                    let file = self.file.as_ref().expect("file pages need a file");
                    file.read_at(buf, off)
                        .map_err(|e| self.io_err(e, op, offset, len))?;
                    CacheStats::count(
                        &self.stats.overflow_read_ops,
                        &self.stats.overflow_read_bytes,
                        PAGE_U64,
                    );
                } else {
                    read_lower_page(&*self.lower, &self.stats, at.index(), buf)?;
                }
                if zeros && is_zero(&buf[within..within + patch.len()]) {
                    return Ok(()); // zeros there already: nothing to remember
                }
                patch.apply(buf, within);
                sh = self.map.lock(at.region);
            }
        }
        if is_zero(&page[..]) {
            self.freed(sh.mark_zero(at, self.file.as_ref()));
            return Ok(());
        }
        self.place(sh, at, page, op, offset, len)
    }

    /// Puts a rebuilt page (not in RAM now) into RAM, or else into the overflow file.
    fn place(
        &self,
        mut sh: MutexGuard<'_, Shard>,
        at: PageAddr,
        page: RamPage,
        op: Op,
        offset: u64,
        len: u64,
    ) -> Result<()> {
        if self.take_ram() {
            sh.insert_ram(at, page);
            return Ok(());
        }
        drop(sh);
        let Some(file) = &self.file else {
            return Err(self.nospace(op, offset, len));
        };
        let _region_lock = self.region_locks.lock(at.region);
        let Ok(unit) = self.map.lock(at.region).pin_unit(at.region, file) else {
            return Err(self.nospace(op, offset, len));
        };
        let r = file.write_slot(unit, at.slot, &page);
        if self
            .map
            .lock(at.region)
            .unpin(at.region, file, r.is_ok().then_some(at.slot))
        {
            self.stats.file_bytes.fetch_add(PAGE_U64, Relaxed);
        }
        match r {
            Ok(()) => {
                CacheStats::count(
                    &self.stats.overflow_write_ops,
                    &self.stats.overflow_write_bytes,
                    PAGE_U64,
                );
                Ok(())
            }
            Err(e) => {
                let full = matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT));
                let mut err = self.io_err(e, op, offset, len);
                if full {
                    // The overflow file's file system is full before the cap: refused for space.
                    self.stats.nospace_errors.fetch_add(1, Relaxed);
                    err.message = format!(
                        "{}: the file system of the overflow file is full before the cache's cap; writes to pages already \
                         cached still work: free space there, trim unused space in the guest, or move the overflow file \
                         (--overflow-dir)",
                        err.message
                    );
                    self.full.fs_log.log(
                        log::Level::Warn,
                        module_path!(),
                        "file system full",
                        format_args!("{}: {}", self.name, err.message),
                    );
                }
                Err(err)
            }
        }
    }

    /// Zeroes a whole region (the caller holds its page locks).
    fn zero_region(&self, region: u64) -> Result<()> {
        if self.map.lock(region).get(region).is_none()
            && self.lower_reads_zero(region * UNIT, UNIT)?
        {
            return Ok(());
        }
        self.freed(
            self.map
                .lock(region)
                .zero_region(region, self.file.as_ref()),
        );
        Ok(())
    }

    /// Whether the lower device reports `[offset, offset+len)` as reading zero.
    fn lower_reads_zero(&self, offset: u64, len: u64) -> Result<bool> {
        if !self.lower.caps().block_status {
            return Ok(false);
        }
        let (mut pos, end) = (offset, offset + len);
        let mut out = Vec::new();
        while pos < end {
            out.clear();
            self.lower.block_status(pos, end - pos, &mut out)?;
            if out.is_empty() || out.iter().any(|e| !e.zero) {
                return Ok(false);
            }
            pos += out.iter().map(|e| e.len).sum::<u64>();
        }
        Ok(true)
    }

    // ---- block status -------------------------------------------------------------------

    pub fn block_status(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        let end = offset + len.min(STATUS_SCAN);
        // Runs of `Some(zero)`: the cache holds data or zeros; `None`: the vDisk is asked.
        let mut runs: Vec<(Option<bool>, u64)> = Vec::new();
        let mut push = |run: Option<bool>, n: u64| match runs.last_mut() {
            Some((r, l)) if *r == run => *l += n,
            _ => runs.push((run, n)),
        };
        for rp in units(offset, end - offset, UNIT) {
            let sh = self.map.lock(rp.index);
            let Some(reg) = sh.get(rp.index) else {
                push(None, rp.len as u64);
                continue;
            };
            for pp in units(offset + rp.pos as u64, rp.len as u64, PAGE_U64) {
                let run = match reg.page((pp.index % UNIT_PAGES as u64) as usize) {
                    Found::Ram(_) | Found::Overflow(_) => Some(false),
                    Found::Zero => Some(true),
                    Found::Absent => None,
                };
                push(run, pp.len as u64);
            }
        }
        let mut pos = offset;
        for (run, n) in runs {
            match run {
                Some(zero) => out.push(Extent {
                    len: n,
                    hole: zero,
                    zero,
                }),
                None => {
                    let first = out.len();
                    self.lower.block_status(pos, n, out)?;
                    let got: u64 = out[first..].iter().map(|e| e.len).sum();
                    if got < n {
                        return Ok(()); // the lower stopped short: so do we
                    }
                }
            }
            pos += n;
        }
        Ok(())
    }

    // ---- eviction -----------------------------------------------------------------------

    /// Evicts one least-recently-used region; returns the pages moved to the file.
    pub fn evict_one(&self) -> Result<usize> {
        if self.file.is_none() {
            return Ok(0);
        }
        match self.map.eviction_victim() {
            Some(region) => self.evict_region(region),
            None => Ok(0),
        }
    }

    /// Writes a region's RAM pages to its unit and frees those that did not change meanwhile.
    pub fn evict_region(&self, region: u64) -> Result<usize> {
        let _region_lock = self.region_locks.lock(region);
        let Some(snap) = self.evict_begin(region)? else {
            return Ok(0);
        };
        let written = self.evict_write(&snap);
        self.evict_finish(snap, written)
    }

    /// Eviction, step 1 (region lock held): pin the region's unit (allocating one) and take
    /// handles on its RAM pages. `None`: nothing in RAM.
    fn evict_begin(&self, region: u64) -> Result<Option<Eviction>> {
        let file = self.file.as_ref().expect("eviction needs a file");
        let ev = self.map.lock(region).begin_eviction(region, file);
        ev.map_err(|_| {
            Error::new(
                ErrorKind::NoSpace,
                Op::Write,
                region * UNIT,
                UNIT,
                self.name.clone(),
                self.full.message.clone(),
            )
        })
    }

    /// Eviction, step 2 (no shard lock): one `pwritev` per run of adjacent pages.
    fn evict_write(&self, ev: &Eviction) -> std::io::Result<()> {
        let file = self.file.as_ref().expect("eviction needs a file");
        let pages = &ev.pages;
        let mut i = 0;
        while i < pages.len() {
            let mut j = i + 1;
            while j < pages.len() && pages[j].0 == pages[j - 1].0 + 1 {
                j += 1;
            }
            let run: Vec<&[u8; PAGE]> = pages[i..j].iter().map(|(_, p)| &**p).collect();
            file.write_run(ev.unit, pages[i].0, &run)?;
            CacheStats::count(
                &self.stats.overflow_write_ops,
                &self.stats.overflow_write_bytes,
                (j - i) as u64 * PAGE_U64,
            );
            i = j;
        }
        Ok(())
    }

    /// Eviction, step 3: the map drops from RAM the pages that did not change since step 1
    /// and unpins ([`Shard::finish_eviction`]); their buffers go to the spare pool.
    fn evict_finish(&self, mut ev: Eviction, written: std::io::Result<()>) -> Result<usize> {
        let file = self.file.as_ref().expect("eviction needs a file");
        if written.is_err() {
            // The pages stay in RAM: drop our handles on them before unpinning, so that an
            // unpinned region's RAM pages are never shared (see `Region::page_mut`).
            ev.pages.clear();
        }
        let (moved, newly) = self.map.lock(ev.region).finish_eviction(&ev, file);
        self.give_ram(moved);
        self.stats.file_bytes.fetch_add(newly * PAGE_U64, Relaxed);
        self.stats.evictions.fetch_add(moved, Relaxed);
        // Every handle left in `ev.pages` is now on a page that left RAM or on an old copy a
        // writer replaced: none aliases a RAM page any more.
        let region = ev.region;
        self.recycle(ev.pages);
        written
            .map(|()| moved as usize)
            .map_err(|e| self.io_err(e, Op::Write, region * UNIT, UNIT))
    }
}

/// The `BlockDev` and `WriteCache` impls of a cache type whose field `tiers` is (or derefs
/// to) a [`Tiers`]: `device-ram` and `ram-overflow` share the whole data path, so it is
/// written once, here. `flush` and FUA are not advertised (nothing is ever made durable,
/// and every completed write is visible to every connection); zeroing is markers plus at
/// most two partial pages, so it is always fast and `fast_only` is never refused.
macro_rules! tiers_cache_impls {
    ($ty:ty, $kind:expr) => {
        impl vdstream_blockdev::BlockDev for $ty {
            fn size(&self) -> u64 {
                self.tiers.size
            }

            fn caps(&self) -> vdstream_blockdev::Caps {
                self.tiers.caps()
            }

            fn read_at(&self, buf: &mut [u8], offset: u64) -> vdstream_blockdev::Result<()> {
                self.tiers
                    .check(vdstream_blockdev::Op::Read, offset, buf.len() as u64)?;
                self.tiers.read(buf, offset)
            }

            fn write_at(
                &self,
                buf: &[u8],
                offset: u64,
                _fua: bool,
            ) -> vdstream_blockdev::Result<()> {
                self.tiers
                    .check(vdstream_blockdev::Op::Write, offset, buf.len() as u64)?;
                self.tiers.write(buf, offset)
            }

            fn trim(&self, offset: u64, len: u64, _fua: bool) -> vdstream_blockdev::Result<()> {
                self.tiers.check(vdstream_blockdev::Op::Trim, offset, len)?;
                let done = self
                    .tiers
                    .zero_range(offset, len, vdstream_blockdev::Op::Trim);
                vdstream_blockdev::reclaim::maybe_reclaim();
                done
            }

            fn write_zeroes(
                &self,
                offset: u64,
                len: u64,
                _flags: vdstream_blockdev::ZeroFlags,
            ) -> vdstream_blockdev::Result<()> {
                self.tiers.check(vdstream_blockdev::Op::Zero, offset, len)?;
                let done = self
                    .tiers
                    .zero_range(offset, len, vdstream_blockdev::Op::Zero);
                vdstream_blockdev::reclaim::maybe_reclaim();
                done
            }

            fn block_status(
                &self,
                offset: u64,
                len: u64,
                out: &mut Vec<vdstream_blockdev::Extent>,
            ) -> vdstream_blockdev::Result<()> {
                self.tiers
                    .check(vdstream_blockdev::Op::BlockStatus, offset, len)?;
                self.tiers.block_status(offset, len, out)
            }

            fn describe(&self) -> String {
                self.tiers.name.clone()
            }
        }

        impl $crate::WriteCache for $ty {
            fn cache_type(&self) -> $crate::CacheType {
                $kind
            }

            fn stats(&self) -> $crate::StatsSnapshot {
                self.tiers.stats.snapshot()
            }
        }
    };
}
pub(crate) use tiers_cache_impls;

#[cfg(test)]
mod tests {
    use super::*;
    use vdstream_blockdev::MemoryDev;

    fn tiers(dir: &std::path::Path) -> Tiers {
        let file = OverflowFile::create(dir, "unit-test", 8).unwrap();
        Tiers::new(
            Arc::new(MemoryDev::new(8 << 20)),
            "test".into(),
            1 << 20,
            Some(file),
            "full".into(),
        )
    }

    #[test]
    fn a_page_patched_during_eviction_stays_in_ram_with_the_patch() {
        let dir = tempfile::tempdir().unwrap();
        let t = tiers(dir.path());
        t.write(&[1u8; 8192], 0).unwrap();
        let ev = t.evict_begin(0).unwrap().unwrap();
        t.write(&[2u8; 10], 100).unwrap(); // patches page 0 while its eviction is in flight
        let written = t.evict_write(&ev);
        assert_eq!(
            t.evict_finish(ev, written).unwrap(),
            1,
            "only the unchanged page leaves RAM"
        );
        assert_eq!(t.stats.ram_bytes.load(Relaxed), PAGE_U64);
        let mut buf = vec![0u8; 8192];
        t.read(&mut buf, 0).unwrap();
        assert_eq!(&buf[100..110], &[2u8; 10]);
        assert!(buf[..100].iter().chain(&buf[110..]).all(|&b| b == 1));
        // The next eviction takes it too.
        assert_eq!(t.evict_region(0).unwrap(), 1);
        t.read(&mut buf, 0).unwrap();
        assert_eq!(&buf[100..110], &[2u8; 10]);
    }

    #[test]
    fn a_page_zeroed_during_eviction_reads_zero_and_keeps_no_slot() {
        let dir = tempfile::tempdir().unwrap();
        let t = tiers(dir.path());
        t.write(&[1u8; 8192], 0).unwrap();
        let ev = t.evict_begin(0).unwrap().unwrap();
        t.zero_range(0, 4096, Op::Trim).unwrap();
        let written = t.evict_write(&ev);
        assert_eq!(t.evict_finish(ev, written).unwrap(), 1);
        assert_eq!(
            t.stats.file_bytes.load(Relaxed),
            PAGE_U64,
            "only page 1 holds a slot"
        );
        let mut buf = vec![9u8; 8192];
        t.read(&mut buf, 0).unwrap();
        assert!(buf[..4096].iter().all(|&b| b == 0) && buf[4096..].iter().all(|&b| b == 1));
    }

    #[test]
    fn evicted_pages_are_kept_as_spares_within_the_ram_budget_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let t = tiers(dir.path()); // 1 MiB of RAM: 256 pages
        let limit_pages = (t.ram_limit / PAGE_U64) as usize;
        // Fill RAM from two regions: 192 pages in region 0, 64 in region 1.
        t.write(&vec![3u8; 192 * PAGE], 0).unwrap();
        t.write(&vec![4u8; 64 * PAGE], UNIT).unwrap();
        assert_eq!(t.stats.ram_bytes.load(Relaxed), t.ram_limit);
        assert_eq!(t.spare_count(), 0);
        assert_eq!(t.evict_region(0).unwrap(), 192);
        // All 192 fit in the budget beside the 64 pages still in RAM.
        assert_eq!(t.spare_count(), 192);
        let in_ram = (t.stats.ram_bytes.load(Relaxed) / PAGE_U64) as usize;
        assert!(in_ram + t.spare_count() <= limit_pages);
        // Pages coming back into RAM take spares, and RAM plus spares stays within the budget.
        t.write(&vec![5u8; 100 * PAGE], 0).unwrap();
        assert_eq!(t.spare_count(), 92);
        let in_ram = (t.stats.ram_bytes.load(Relaxed) / PAGE_U64) as usize;
        assert_eq!(in_ram, 164);
        assert!(in_ram + t.spare_count() <= limit_pages);
        // A second eviction: its pages join the pool, and RAM plus spares is the budget again.
        assert_eq!(t.evict_region(1).unwrap(), 64);
        let in_ram = (t.stats.ram_bytes.load(Relaxed) / PAGE_U64) as usize;
        assert_eq!(in_ram + t.spare_count(), limit_pages);
        // The bytes are right wherever they are.
        let mut buf = vec![0u8; 256 * PAGE];
        t.read(&mut buf[..192 * PAGE], 0).unwrap();
        assert!(
            buf[..100 * PAGE].iter().all(|&b| b == 5)
                && buf[100 * PAGE..192 * PAGE].iter().all(|&b| b == 3)
        );
        t.read(&mut buf[..64 * PAGE], UNIT).unwrap();
        assert!(buf[..64 * PAGE].iter().all(|&b| b == 4));
        // Dropping the pool leaves the data alone.
        assert_eq!(t.drop_spares(), 156);
        assert_eq!(t.spare_count(), 0);
        t.read(&mut buf[..64 * PAGE], UNIT).unwrap();
        assert!(buf[..64 * PAGE].iter().all(|&b| b == 4));
    }
}
