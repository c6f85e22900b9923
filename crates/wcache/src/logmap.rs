//! The log layout of the disk cache (`device-disk` and `server` with O_DIRECT): where each
//! data page lives in the cache file when pages are not kept at `p·4096`.
//!
//! Design notes.
//!
//! - **Why**: with the identity layout every random 4 KiB guest write is a random 4 KiB
//!   O_DIRECT write; the disk pays one operation per guest write and the zeroing of each
//!   fresh 2 MiB chunk. In the log layout the writes of one batch (or one request) take the
//!   next free slots of the open *segment* (2 MiB, 512 slots) and go to the file as one
//!   sequential write, whatever pages they belong to.
//! - **Maps**: `loc[page]` is the page's slot + 1 (0: not in the log), `owner[slot]` the
//!   slot's page + 1 (0: never written). Both are flat arrays of atomics, allocated zeroed,
//!   so the system maps them only where they are used. A slot is *live* while
//!   `loc[owner[slot]] == slot`; each segment counts the slots it hands out, minus those
//!   that die (the page was written again, trimmed, or moved by the cleaner).
//! - **Ordering**: a write fills its slots, then swaps `loc` (the caller holds the page
//!   locks, as for the identity layout) and kills the slot it replaced. The cleaner moves a
//!   live page without taking page locks: it copies the bytes to a new slot, then
//!   compare-and-swaps `loc` from the old slot to the new one; if a writer or a trim got
//!   there first, the copy dies instead. Slots are never written in place, so the bytes the
//!   cleaner copies cannot change under it.
//! - **Reuse**: a segment whose slots are all dead (and that is full) is freed, but it is
//!   handed out again only after every read that might still be reading it has finished:
//!   readers hold `reuse.read()` from looking up `loc` to the end of their I/O, and the
//!   allocator takes `reuse.write()` before it recycles freed segments. Nobody allocates
//!   while holding the read side.
//! - **Space**: the cache's data-page cap (`max_file`, or the device size) is enforced by
//!   the caller as with the identity layout; the log may hold up to `capacity` segments, a
//!   quarter more than that cap plus a few, so that a segment with dead slots always exists
//!   when the log is full. The **cleaner** then picks the full segment with the fewest live
//!   slots, copies them into its own open segment (cold data kept apart from fresh
//!   writes), and frees it. Two segments are kept in reserve for the cleaner.
//! - **Giving space back**: freed segments beyond a few spares are punched, so a trimmed
//!   cache gives its blocks back; a punched segment is preallocated again when reused.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard};

use crate::cachefile::CacheFile;
use crate::page::{PAGE_SHIFT, PAGE_U64};

/// Slots (pages) per segment.
pub const SEG_PAGES: u64 = 512;
pub const SEG_BYTES: u64 = SEG_PAGES * PAGE_U64;
/// Free segments only the cleaner may take.
const RESERVE: usize = 2;
/// Free segments kept allocated (not punched) for reuse.
const SPARE: usize = 8;

const FREE: u8 = 0;
const OPEN: u8 = 1;
const FULL: u8 = 2;
/// Freed (all slots dead), waiting for reuse.
const FREED: u8 = 3;
/// Being cleaned: not freed until the cleaner is done with it.
const CLEANING: u8 = 4;

/// A run of slots: `len` slots from `slot`, in one segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub slot: u64,
    pub len: u64,
}

impl Run {
    /// Byte offset of the run in the cache file.
    pub fn offset(&self) -> u64 {
        self.slot << PAGE_SHIFT
    }
}

#[derive(Debug, Default)]
struct Open {
    seg: u32,
    next: u64,
}

#[derive(Debug, Default)]
struct Alloc {
    hot: Option<Open>,
    cold: Option<Open>,
    free: Vec<u32>,
    freed: Vec<u32>,
    /// Segments made so far (segment ids below this exist in the file).
    made: u32,
}

/// Where pages live in a log-structured cache file. See the module notes.
#[derive(Debug)]
pub struct LogMap {
    loc: Box<[AtomicU32]>,
    owner: Box<[AtomicU32]>,
    live: Box<[AtomicU32]>,
    state: Box<[AtomicU8]>,
    /// Segment was punched: preallocate it again before use.
    punched: Box<[AtomicU8]>,
    capacity: u32,
    alloc: Mutex<Alloc>,
    cleaner: Mutex<()>,
    reuse: RwLock<()>,
    /// Segments the cleaner has emptied.
    cleaned: AtomicU64,
}

/// A zeroed array of atomics, without touching its memory (the system maps pages as they
/// are first written).
fn zeroed_atomics(n: usize) -> Box<[AtomicU32]> {
    let v: Vec<u32> = vec![0; n];
    let mut v = std::mem::ManuallyDrop::new(v);
    // SAFETY: `AtomicU32` has the same size, alignment and bit validity as `u32`; the
    // vector's allocation is handed over whole (pointer, length, capacity) and never used
    // through `v` again.
    unsafe { Vec::from_raw_parts(v.as_mut_ptr().cast::<AtomicU32>(), v.len(), v.capacity()) }.into_boxed_slice()
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl LogMap {
    /// A log for a device of `pages` pages holding at most `limit_pages` data pages, or
    /// `None` when the device is too large for 32-bit page numbers.
    pub fn new(pages: u64, limit_pages: u64) -> Option<LogMap> {
        let segs = (limit_pages.min(pages) * 5 / 4).div_ceil(SEG_PAGES) + RESERVE as u64 + 4;
        if pages >= u32::MAX as u64 || segs * SEG_PAGES >= u32::MAX as u64 {
            return None;
        }
        let capacity = segs as u32;
        Some(LogMap {
            loc: zeroed_atomics(pages as usize),
            owner: zeroed_atomics((segs * SEG_PAGES) as usize),
            live: (0..segs).map(|_| AtomicU32::new(0)).collect(),
            state: (0..segs).map(|_| AtomicU8::new(FREE)).collect(),
            punched: (0..segs).map(|_| AtomicU8::new(0)).collect(),
            capacity,
            alloc: Mutex::new(Alloc::default()),
            cleaner: Mutex::new(()),
            reuse: RwLock::new(()),
            cleaned: AtomicU64::new(0),
        })
    }

    /// Most bytes the file may reach.
    pub fn max_bytes(&self) -> u64 {
        self.capacity as u64 * SEG_BYTES
    }

    /// Segments in use or ready (the file's allocated part), for statistics and tests.
    pub fn segments_made(&self) -> u32 {
        lock(&self.alloc).made
    }

    /// Segments the cleaner has emptied so far.
    pub fn cleanings(&self) -> u64 {
        self.cleaned.load(Ordering::Relaxed)
    }

    /// Held by readers from looking a page up to the end of their I/O.
    pub fn read_guard(&self) -> RwLockReadGuard<'_, ()> {
        self.reuse.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The slot of `page`, if it lives in the log (call with a read guard held).
    pub fn slot(&self, page: u64) -> Option<u64> {
        match self.loc[page as usize].load(Ordering::Acquire) {
            0 => None,
            s => Some(s as u64 - 1),
        }
    }

    /// Records that `run`'s slots hold `pages` (one page per slot, in order), before they
    /// are written.
    pub fn set_owners(&self, run: Run, first_page: impl Fn(u64) -> u64) {
        for i in 0..run.len {
            self.owner[(run.slot + i) as usize].store(first_page(i) as u32 + 1, Ordering::Relaxed);
        }
    }

    /// `page` now lives at `slot` (its bytes are written; the caller holds its page lock).
    pub fn commit(&self, page: u64, slot: u64) {
        let old = self.loc[page as usize].swap(slot as u32 + 1, Ordering::AcqRel);
        if old != 0 {
            self.kill(old as u64 - 1);
        }
    }

    /// `page` no longer lives in the log (trimmed or zeroed; the caller holds its lock).
    pub fn forget(&self, page: u64) {
        let old = self.loc[page as usize].swap(0, Ordering::AcqRel);
        if old != 0 {
            self.kill(old as u64 - 1);
        }
    }

    /// The slots of a failed write die.
    pub fn abandon(&self, runs: &[Run]) {
        for r in runs {
            for s in r.slot..r.slot + r.len {
                self.kill(s);
            }
        }
    }

    fn kill(&self, slot: u64) {
        let seg = (slot / SEG_PAGES) as usize;
        if self.live[seg].fetch_sub(1, Ordering::AcqRel) == 1
            && self.state[seg].compare_exchange(FULL, FREED, Ordering::AcqRel, Ordering::Acquire).is_ok()
        {
            lock(&self.alloc).freed.push(seg as u32);
        }
    }

    /// `n` slots for new page bytes, in runs of consecutive slots (one segment each);
    /// `cold` for the cleaner's copies. Cleans when the log is full; `None` only if the
    /// log cannot make room (the caller's data-page cap makes that impossible).
    pub fn allocate(&self, file: &CacheFile, n: u64, cold: bool, clean: &dyn Fn(&LogMap) -> bool) -> Option<Vec<Run>> {
        let mut runs: Vec<Run> = Vec::new();
        let mut need = n;
        let mut rounds = 0;
        while need > 0 {
            {
                let mut st = lock(&self.alloc);
                while need > 0 {
                    let open = if cold { st.cold.take() } else { st.hot.take() };
                    let mut open = match open {
                        Some(o) => o,
                        None => match self.take_segment(&mut st, file, cold) {
                            Some(seg) => Open { seg, next: 0 },
                            None => break,
                        },
                    };
                    let k = need.min(SEG_PAGES - open.next);
                    let slot = open.seg as u64 * SEG_PAGES + open.next;
                    self.live[open.seg as usize].fetch_add(k as u32, Ordering::AcqRel);
                    match runs.last_mut() {
                        Some(r) if r.slot + r.len == slot => r.len += k,
                        _ => runs.push(Run { slot, len: k }),
                    }
                    open.next += k;
                    need -= k;
                    if open.next == SEG_PAGES {
                        let seg = open.seg as usize;
                        self.state[seg].store(FULL, Ordering::Release);
                        if self.live[seg].load(Ordering::Acquire) == 0
                            && self.state[seg].compare_exchange(FULL, FREED, Ordering::AcqRel, Ordering::Acquire).is_ok()
                        {
                            st.freed.push(seg as u32);
                        }
                    } else if cold {
                        st.cold = Some(open);
                    } else {
                        st.hot = Some(open);
                    }
                }
            }
            if need == 0 {
                break;
            }
            rounds += 1;
            if rounds > 4 * self.capacity as usize || !clean(self) {
                self.abandon(&runs);
                return None;
            }
        }
        // Runs that cross a segment boundary were merged above only when consecutive; split
        // them back so each run is inside one segment (one write never spans two).
        let mut out = Vec::with_capacity(runs.len());
        for r in runs {
            let mut s = r.slot;
            let end = r.slot + r.len;
            while s < end {
                let e = end.min((s / SEG_PAGES + 1) * SEG_PAGES);
                out.push(Run { slot: s, len: e - s });
                s = e;
            }
        }
        Some(out)
    }

    /// A segment to open: a free one (the last `RESERVE` only for the cleaner), a new one
    /// while the file may grow, or freed ones once no reader can still be reading them.
    fn take_segment(&self, st: &mut Alloc, file: &CacheFile, cold: bool) -> Option<u32> {
        let floor = if cold { 0 } else { RESERVE };
        let unmade = (self.capacity - st.made) as usize;
        if st.free.len() + unmade <= floor || (st.free.is_empty() && !st.freed.is_empty()) {
            if st.freed.is_empty() {
                return None;
            }
            // No read that might still use a freed segment may be running.
            let _drain = self.reuse.write().unwrap_or_else(|p| p.into_inner());
            let freed = std::mem::take(&mut st.freed);
            st.free.extend(freed);
            // Give back what is not needed soon: keep a few allocated, punch the rest.
            let mut unpunched = st.free.iter().filter(|&&s| self.punched[s as usize].load(Ordering::Relaxed) == 0).count();
            for &seg in &st.free {
                if unpunched <= SPARE + RESERVE {
                    break;
                }
                if self.punched[seg as usize].load(Ordering::Relaxed) == 0 {
                    if let Ok(true) = file.punch(seg as u64 * SEG_BYTES, SEG_BYTES) {
                        self.punched[seg as usize].store(1, Ordering::Relaxed);
                    }
                    unpunched -= 1;
                }
            }
            if st.free.len() + unmade <= floor {
                return None;
            }
        }
        if let Some(pick) = st.free.iter().rposition(|&s| self.punched[s as usize].load(Ordering::Relaxed) == 0).or(st.free.len().checked_sub(1)) {
            // A segment still allocated if there is one.
            let seg = st.free.swap_remove(pick);
            if self.punched[seg as usize].swap(0, Ordering::Relaxed) != 0 {
                let _ = file.preallocate(seg as u64 * SEG_BYTES, SEG_BYTES);
            }
            return Some(self.open_segment(seg));
        }
        let seg = st.made;
        st.made += 1;
        // Allocating the segment whole keeps it contiguous on disk; failure only means the
        // writes allocate blocks as they go.
        let _ = file.preallocate(seg as u64 * SEG_BYTES, SEG_BYTES);
        Some(self.open_segment(seg))
    }

    fn open_segment(&self, seg: u32) -> u32 {
        debug_assert_eq!(self.live[seg as usize].load(Ordering::Relaxed), 0);
        self.state[seg as usize].store(OPEN, Ordering::Release);
        seg
    }

    /// Whether the allocator has more free segments than it keeps for the cleaner.
    fn has_room(&self) -> bool {
        let st = lock(&self.alloc);
        st.free.len() + st.freed.len() + (self.capacity - st.made) as usize > RESERVE
    }

    /// One cleaning step, run by a writer that found the log full: picks the full segment
    /// with the fewest live slots and hands `copy` its index and its live pages' (slot,
    /// page) pairs; `copy` reads them, writes them to slots from `allocate(.., cold)` and
    /// calls [`LogMap::relocate`] for each. The segment is freed once none of its slots is
    /// live. Returns `false` when nothing could be cleaned.
    pub fn clean(&self, copy: impl FnOnce(u64, &[(u64, u64)]) -> bool) -> bool {
        let _one = lock(&self.cleaner);
        if self.has_room() {
            return true;
        }
        let made = lock(&self.alloc).made as usize;
        let mut best: Option<(usize, u32)> = None;
        for seg in 0..made {
            if self.state[seg].load(Ordering::Acquire) != FULL {
                continue;
            }
            let live = self.live[seg].load(Ordering::Acquire);
            if best.map_or(true, |(_, l)| live < l) {
                best = Some((seg, live));
            }
        }
        let Some((seg, live)) = best else { return false };
        if live as u64 >= SEG_PAGES || self.state[seg].compare_exchange(FULL, CLEANING, Ordering::AcqRel, Ordering::Acquire).is_err() {
            return false;
        }
        let base = seg as u64 * SEG_PAGES;
        let mut moves = Vec::with_capacity(live as usize);
        for slot in base..base + SEG_PAGES {
            let owner = self.owner[slot as usize].load(Ordering::Acquire);
            if owner != 0 && self.loc[owner as usize - 1].load(Ordering::Acquire) == slot as u32 + 1 {
                moves.push((slot, owner as u64 - 1));
            }
        }
        let ok = moves.is_empty() || copy(seg as u64, &moves);
        if ok {
            self.cleaned.fetch_add(1, Ordering::Relaxed);
        }
        // Back to full; freed now if every slot died (a kill while cleaning left it to us).
        self.state[seg].store(FULL, Ordering::Release);
        if self.live[seg].load(Ordering::Acquire) == 0
            && self.state[seg].compare_exchange(FULL, FREED, Ordering::AcqRel, Ordering::Acquire).is_ok()
        {
            lock(&self.alloc).freed.push(seg as u32);
        }
        ok
    }

    /// Byte offset of segment `seg` in the file.
    pub fn segment_offset(seg: u64) -> u64 {
        seg * SEG_BYTES
    }

    /// The cleaner copied `page` from slot `from` to slot `to`: it lives there now, unless
    /// it was written or trimmed meanwhile (then the copy dies).
    pub fn relocate(&self, page: u64, from: u64, to: u64) {
        match self.loc[page as usize].compare_exchange(from as u32 + 1, to as u32 + 1, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => self.kill(from),
            Err(_) => self.kill(to),
        }
    }

    /// Byte offset of a slot.
    pub fn offset(slot: u64) -> u64 {
        slot << PAGE_SHIFT
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(dir: &std::path::Path) -> CacheFile {
        CacheFile::open(&dir.join("log"), 0, false, true, true, vdstream_blockdev::IoEngineKind::Sync).unwrap()
    }

    #[test]
    fn writes_of_one_request_get_consecutive_slots_and_overwrites_free_them() {
        let dir = tempfile::tempdir().unwrap();
        let f = file(dir.path());
        let log = LogMap::new(4096, 4096).unwrap();
        let never = |_: &LogMap| false;
        let runs = log.allocate(&f, 10, false, &never).unwrap();
        assert_eq!(runs, vec![Run { slot: 0, len: 10 }]);
        for i in 0..10 {
            log.commit(100 + i, i);
        }
        assert_eq!(log.slot(105), Some(5));
        // Rewriting all ten pages kills their old slots; segment 0 is still open, so it is
        // not freed.
        let runs = log.allocate(&f, 10, false, &never).unwrap();
        assert_eq!(runs, vec![Run { slot: 10, len: 10 }]);
        for i in 0..10 {
            log.commit(100 + i, 10 + i);
        }
        assert_eq!(log.live[0].load(Ordering::Relaxed), 10);
        log.forget(100);
        assert_eq!(log.slot(100), None);
        assert_eq!(log.live[0].load(Ordering::Relaxed), 9);
    }

    #[test]
    fn a_request_that_crosses_a_segment_gets_one_run_per_segment() {
        let dir = tempfile::tempdir().unwrap();
        let f = file(dir.path());
        let log = LogMap::new(8192, 8192).unwrap();
        let never = |_: &LogMap| false;
        log.allocate(&f, 500, false, &never).unwrap();
        let runs = log.allocate(&f, 30, false, &never).unwrap();
        assert_eq!(runs, vec![Run { slot: 500, len: 12 }, Run { slot: 512, len: 18 }]);
    }

    #[test]
    fn a_full_log_asks_the_cleaner_and_reuses_what_it_freed() {
        let dir = tempfile::tempdir().unwrap();
        let f = file(dir.path());
        // 512 pages: capacity 1.25 × 512 → 2 segments + reserve + 4.
        let log = LogMap::new(512, 512).unwrap();
        let cap = log.capacity as u64;
        let never = |_: &LogMap| false;
        // Write page 0 over and over: every full segment but the open one is all dead.
        let mut slot_of_0 = None;
        for _ in 0..(cap * SEG_PAGES * 3) {
            let runs = log.allocate(&f, 1, false, &never).expect("dead segments are reused without cleaning");
            log.set_owners(runs[0], |_| 0);
            log.commit(0, runs[0].slot);
            slot_of_0 = Some(runs[0].slot);
        }
        assert_eq!(log.slot(0), slot_of_0);
        assert!(log.segments_made() as u64 <= cap);
    }
}
