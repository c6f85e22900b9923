//! `RegionMap`: where every cached page of a RAM cache is, sharded by 2 MiB region.
//!
//! Design notes.
//!
//! The guest disk is cut into 2 MiB *regions* of 512 pages. A region that holds anything
//! (a RAM page, a page in the overflow file, a zero marker) has a [`Region`] entry: an
//! optional array of 512 RAM page slots (allocated with the first RAM page, dropped with the
//! last), a zero bitmap, a file bitmap, and the overflow unit it owns, if any (the block
//! allocation table, region → unit, is this field). Regions live in [`SHARDS`] shards
//! chosen by `region % SHARDS`, each one mutex around a small hash map, so there is no lock
//! over the whole device and a 4 KiB request takes exactly one shard lock.
//!
//! Page states (first match wins when reading):
//!
//! | ram slot | zero bit | file bit | state    | reads from                      |
//! | -------- | -------- | -------- | -------- | ------------------------------- |
//! | `Some`   | 0        | any      | ram      | the RAM page (a file copy, if any, is stale) |
//! | `None`   | 1        | 0        | zero     | nothing: zeros                  |
//! | `None`   | 0        | 1        | overflow | the page's slot in the unit     |
//! | `None`   | 0        | 0        | absent   | the lower device (the vDisk)    |
//!
//! Invariants:
//! - A zero page has neither a RAM page nor a file slot; the two bits are never both set.
//! - `ram_count`, `file_count` equal the number of `Some` slots and of file bits.
//! - A region with `file_count > 0` or `pins > 0` owns a unit; a unit is released (under the
//!   shard lock) only when both are zero, so no I/O is ever in flight on a released unit.
//!   `unit_gen` changes whenever the region gets a unit (from one counter for all regions),
//!   so a reader that did file I/O without the lock can tell whether the unit changed hands.
//! - A region in RAM is in its shard's CLOCK ring (`in_ring`); eviction walks the ring,
//!   giving a second chance to regions touched since the last pass (`referenced`).
//!
//! The data path (tiers.rs) calls this module with a [`PageAddr`] and is never called back;
//! every change of a page's state is a method here, which keeps the invariants above and
//! gives back only what the caller accounts for ([`Freed`], counts).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::overflow_file::{OverflowFile, UNIT, UNIT_PAGES};
use crate::page::{PageBuf, PAGE, PAGE_U64};

/// Number of shards; region `r` lives in shard `r % SHARDS`.
pub const SHARDS: usize = 64;

/// Source of `Region::unit_gen`: unique across regions, so that a region dropped and made
/// again never repeats a generation a reader saw.
static UNIT_GEN: AtomicU64 = AtomicU64::new(0);

/// A page's place in the map, made once from its guest page index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageAddr {
    pub region: u64,
    pub slot: usize,
}

impl PageAddr {
    pub fn of(index: u64) -> Self {
        PageAddr {
            region: index / UNIT_PAGES as u64,
            slot: (index % UNIT_PAGES as u64) as usize,
        }
    }

    pub fn index(self) -> u64 {
        self.region * UNIT_PAGES as u64 + self.slot as u64
    }
}

/// Where one page is (see the state table), with where to find its bytes: `P` is
/// `&[u8; PAGE]` for a reader, `&mut [u8; PAGE]` for a writer (see [`Region::page_mut`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found<P> {
    Ram(P),
    Zero,
    /// In the overflow file at this offset.
    Overflow(u64),
    Absent,
}

/// RAM pages and file slots a change freed, for the caller's accounting.
#[derive(Debug, Default, Clone, Copy)]
pub struct Freed {
    pub ram: u64,
    pub file: u64,
}

/// An eviction in flight: the region, its pinned unit, handles on its RAM pages.
#[derive(Debug)]
pub struct Eviction {
    pub region: u64,
    pub unit: u64,
    pub pages: Vec<(usize, RamPage)>,
}

/// No overflow unit is left for a region (the file is at its cap).
#[derive(Debug)]
pub struct NoUnit;

/// One bit per page of a region.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bits512([u64; UNIT_PAGES / 64]);

impl Bits512 {
    pub fn get(&self, i: usize) -> bool {
        self.0[i / 64] >> (i % 64) & 1 == 1
    }
    /// Sets bit `i`; returns whether it changed.
    pub fn set(&mut self, i: usize) -> bool {
        let was = self.get(i);
        self.0[i / 64] |= 1 << (i % 64);
        !was
    }
    /// Clears bit `i`; returns whether it changed.
    pub fn clear(&mut self, i: usize) -> bool {
        let was = self.get(i);
        self.0[i / 64] &= !(1 << (i % 64));
        was
    }
    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|&w| w == 0)
    }
}

/// A RAM page: shared only while an eviction writes it out (copy-on-write otherwise).
pub type RamPage = Arc<PageBuf>;

/// The state of one 2 MiB region. See the module notes.
#[derive(Debug, Default)]
pub struct Region {
    ram: Option<Box<[Option<RamPage>; UNIT_PAGES]>>,
    ram_count: u32,
    zero: Bits512,
    file: Bits512,
    file_count: u32,
    /// The overflow unit this region owns.
    unit: Option<u64>,
    /// Changes whenever `unit` is assigned.
    unit_gen: u64,
    /// I/O in flight on `unit` (evictions, in-place writes): the unit must not be released.
    pins: u32,
    /// Touched since the CLOCK hand last passed.
    referenced: bool,
    in_ring: bool,
}

impl Region {
    /// The page at `slot` for a reader (under the shard lock).
    pub fn page(&self, slot: usize) -> Found<&[u8; PAGE]> {
        match self.ram.as_ref().and_then(|r| r[slot].as_ref()) {
            Some(page) => Found::Ram(page),
            None if self.zero.get(slot) => Found::Zero,
            None if self.file.get(slot) => Found::Overflow(OverflowFile::slot_offset(
                self.unit.expect("file pages have a unit"),
                slot,
            )),
            None => Found::Absent,
        }
    }

    /// The page at `slot` for a writer holding its page lock: a RAM page comes writable,
    /// copied on write while the region is pinned (an eviction may hold a handle on it), in
    /// place otherwise: evictions take handles only while pinned and drop any that still
    /// alias a RAM page before unpinning, so then the region's is the only one.
    pub fn page_mut(&mut self, slot: usize) -> Found<&mut [u8; PAGE]> {
        let page = match self.page(slot) {
            Found::Ram(_) => self
                .ram
                .as_mut()
                .and_then(|r| r[slot].as_mut())
                .expect("in RAM"),
            Found::Zero => return Found::Zero,
            Found::Overflow(off) => return Found::Overflow(off),
            Found::Absent => return Found::Absent,
        };
        if self.pins > 0 {
            return Found::Ram(Arc::make_mut(page));
        }
        debug_assert_eq!(
            Arc::strong_count(page),
            1,
            "an unpinned region's RAM page is shared"
        );
        // SAFETY: the region is not pinned, so this `Arc` is the only handle on the page (see
        // above; checked in debug builds), and `&mut self` (under the shard lock) excludes any
        // other reference to the bytes for the returned lifetime.
        Found::Ram(unsafe { &mut *(Arc::as_ptr(page) as *mut [u8; PAGE]) })
    }

    /// The generation of the unit the region owns (`None`: it owns none).
    pub fn unit_gen(&self) -> Option<u64> {
        self.unit.map(|_| self.unit_gen)
    }

    /// Takes the RAM page out of a slot; drops the slot array with the last page.
    fn remove_ram(&mut self, slot: usize) -> Option<RamPage> {
        let page = self.ram.as_mut()?[slot].take()?;
        self.ram_count -= 1;
        if self.ram_count == 0 {
            self.ram = None;
        }
        Some(page)
    }

    /// Slots holding RAM pages, ascending, with the pages (cloned handles).
    fn ram_pages(&self) -> Vec<(usize, RamPage)> {
        match &self.ram {
            None => Vec::new(),
            Some(arr) => arr
                .iter()
                .enumerate()
                .filter_map(|(i, p)| p.as_ref().map(|p| (i, Arc::clone(p))))
                .collect(),
        }
    }

    /// Sets the file bit; returns whether it was newly set.
    fn set_file(&mut self, slot: usize) -> bool {
        let new = self.file.set(slot);
        if new {
            self.file_count += 1;
        }
        new
    }

    /// Clears the file bit; returns whether it was set.
    fn clear_file(&mut self, slot: usize) -> bool {
        let was = self.file.clear(slot);
        if was {
            self.file_count -= 1;
        }
        was
    }

    /// Nothing cached and nothing in flight: the entry can go.
    fn is_empty(&self) -> bool {
        self.ram_count == 0
            && self.file_count == 0
            && self.pins == 0
            && self.unit.is_none()
            && self.zero.is_empty()
    }

    /// Makes one page a zero marker, freeing its RAM page and file slot.
    fn mark_zero(&mut self, slot: usize, file: Option<&OverflowFile>) -> Freed {
        let mut freed = Freed {
            ram: self.remove_ram(slot).is_some() as u64,
            file: 0,
        };
        if self.clear_file(slot) {
            freed.file = 1;
            if let (Some(unit), Some(file), true) =
                (self.unit, file, self.file_count > 0 || self.pins > 0)
            {
                if let Err(e) = file.punch(OverflowFile::slot_offset(unit, slot), PAGE_U64) {
                    log::debug!(
                        "overflow file {}: punching a freed page failed: {e}",
                        file.path().display()
                    );
                }
            }
        }
        self.zero.set(slot);
        self.release_if_unused(file);
        freed
    }

    /// Releases the region's unit if no page and no I/O uses it.
    fn release_if_unused(&mut self, file: Option<&OverflowFile>) {
        if self.file_count == 0 && self.pins == 0 {
            if let (Some(unit), Some(file)) = (self.unit.take(), file) {
                file.release_unit(unit);
            }
        }
    }
}

/// A fast hasher for region indices (Fibonacci mixing; keys are plain integers).
#[derive(Debug, Default)]
pub struct RegionHasher(u64);

impl Hasher for RegionHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (n ^ self.0).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// The regions of one shard, and its CLOCK ring of regions that hold RAM pages.
#[derive(Debug, Default)]
pub struct Shard {
    regions: HashMap<u64, Region, BuildHasherDefault<RegionHasher>>,
    ring: VecDeque<u64>,
}

impl Shard {
    pub fn get(&self, region: u64) -> Option<&Region> {
        self.regions.get(&region)
    }

    /// The region's entry, created empty if missing; marks it referenced.
    fn region_mut(&mut self, region: u64) -> &mut Region {
        let r = self.regions.entry(region).or_default();
        r.referenced = true;
        r
    }

    /// The page at `at` for a writer holding its page lock ([`Region::page_mut`]); marks
    /// its region referenced.
    pub fn page_mut(&mut self, at: PageAddr) -> Found<&mut [u8; PAGE]> {
        let Some(r) = self.regions.get_mut(&at.region) else {
            return Found::Absent;
        };
        r.referenced = true;
        r.page_mut(at.slot)
    }

    /// Puts a rebuilt page into RAM (the slot must be empty; the caller took the page from
    /// the RAM budget); clears its zero bit.
    pub fn insert_ram(&mut self, at: PageAddr, page: RamPage) {
        let r = self.region_mut(at.region);
        let arr = r
            .ram
            .get_or_insert_with(|| Box::new([const { None }; UNIT_PAGES]));
        debug_assert!(arr[at.slot].is_none());
        arr[at.slot] = Some(page);
        r.ram_count += 1;
        r.zero.clear(at.slot);
        if !r.in_ring {
            r.in_ring = true;
            self.ring.push_back(at.region);
        }
    }

    /// Makes the page at `at` a zero marker (see [`Region::mark_zero`]).
    pub fn mark_zero(&mut self, at: PageAddr, file: Option<&OverflowFile>) -> Freed {
        self.region_mut(at.region).mark_zero(at.slot, file)
    }

    /// Makes every page of `region` a zero marker.
    pub fn zero_region(&mut self, region: u64, file: Option<&OverflowFile>) -> Freed {
        let r = self.region_mut(region);
        let freed = Freed {
            ram: r.ram_count as u64,
            file: r.file_count as u64,
        };
        (r.ram, r.ram_count) = (None, 0);
        if r.file_count > 0 {
            (r.file, r.file_count) = (Bits512::default(), 0);
            if let (Some(unit), Some(file), true) = (r.unit, file, r.pins > 0) {
                let _ = file.punch(unit * UNIT, UNIT);
            }
        }
        r.zero = Bits512([!0; UNIT_PAGES / 64]);
        r.release_if_unused(file);
        freed
    }

    /// Pins the unit of `region` for I/O, giving it one first if it has none.
    pub fn pin_unit(&mut self, region: u64, file: &OverflowFile) -> Result<u64, NoUnit> {
        let r = self.region_mut(region);
        if r.unit.is_none() {
            let Some(unit) = file.alloc_unit() else {
                self.forget_if_empty(region);
                return Err(NoUnit);
            };
            (r.unit, r.unit_gen) = (Some(unit), UNIT_GEN.fetch_add(1, Ordering::Relaxed) + 1);
        }
        r.pins += 1;
        Ok(r.unit.expect("given above"))
    }

    /// Ends a [`Shard::pin_unit`]; `stored`: the slot whose page was just written to the
    /// unit. Returns whether that slot newly holds a file page.
    pub fn unpin(&mut self, region: u64, file: &OverflowFile, stored: Option<usize>) -> bool {
        let r = self.region_mut(region);
        r.pins -= 1;
        let newly = stored.is_some_and(|slot| {
            r.zero.clear(slot);
            r.set_file(slot)
        });
        r.release_if_unused(Some(file));
        self.forget_if_empty(region);
        newly
    }

    /// Eviction, step 1: pins the region's unit and takes handles on its RAM pages (`None`:
    /// nothing in RAM).
    pub fn begin_eviction(
        &mut self,
        region: u64,
        file: &OverflowFile,
    ) -> Result<Option<Eviction>, NoUnit> {
        if self.regions.get(&region).is_none_or(|r| r.ram_count == 0) {
            return Ok(None);
        }
        let unit = self.pin_unit(region, file)?;
        Ok(Some(Eviction {
            region,
            unit,
            pages: self.region_mut(region).ram_pages(),
        }))
    }

    /// Eviction, step 3 (its pages were written to its unit, or the caller emptied the list
    /// because writing failed): drops from RAM the pages that did not change meanwhile (now
    /// in their slots), keeps the patched ones, unpins. Returns the pages that left RAM and
    /// the slots that newly hold a file page.
    pub fn finish_eviction(&mut self, ev: &Eviction, file: &OverflowFile) -> (u64, u64) {
        let r = self
            .regions
            .get_mut(&ev.region)
            .expect("a pinned region stays");
        let (mut moved, mut newly, unit) = (0, 0, ev.unit);
        for &(slot, ref snap) in &ev.pages {
            match r
                .ram
                .as_ref()
                .and_then(|a| a[slot].as_ref())
                .map(|cur| Arc::ptr_eq(cur, snap))
            {
                // Unchanged: leaves RAM. Patched meanwhile: stays; the slot holds an older copy.
                Some(unchanged) => {
                    moved += u64::from(unchanged && r.remove_ram(slot).is_some());
                    newly += u64::from(r.set_file(slot));
                }
                // Zeroed meanwhile: free what was just written.
                None if !r.file.get(slot) => {
                    drop(file.punch(OverflowFile::slot_offset(unit, slot), PAGE_U64))
                }
                None => {}
            }
        }
        r.pins -= 1;
        r.release_if_unused(Some(file));
        (moved, newly)
    }

    /// Drops the region's entry if it holds nothing.
    fn forget_if_empty(&mut self, region: u64) {
        if self
            .regions
            .get(&region)
            .is_some_and(|r| r.is_empty() && !r.in_ring)
        {
            self.regions.remove(&region);
        }
    }

    /// Runs the CLOCK hand: the next region holding RAM pages that was not touched since the
    /// last pass (or, after a full sweep, any one). Regions without RAM leave the ring.
    pub fn clock_victim(&mut self) -> Option<u64> {
        let mut budget = 2 * self.ring.len() + 1;
        while budget > 0 {
            budget -= 1;
            let idx = self.ring.pop_front()?;
            let Some(r) = self.regions.get_mut(&idx) else {
                continue;
            };
            if r.ram_count == 0 {
                r.in_ring = false;
                if r.is_empty() {
                    self.regions.remove(&idx);
                }
                continue;
            }
            self.ring.push_back(idx);
            if r.referenced && budget > 0 {
                r.referenced = false;
                continue;
            }
            return Some(idx);
        }
        None
    }
}

#[repr(align(128))]
#[derive(Debug, Default)]
struct PaddedShard(Mutex<Shard>);

/// The sharded map region index → [`Region`]. See the module notes.
#[derive(Debug)]
pub struct RegionMap {
    shards: Box<[PaddedShard]>,
    /// Which shard the eviction hand looks at next.
    hand: AtomicUsize,
}

impl Default for RegionMap {
    fn default() -> Self {
        RegionMap {
            shards: (0..SHARDS).map(|_| PaddedShard::default()).collect(),
            hand: AtomicUsize::new(0),
        }
    }
}

impl RegionMap {
    /// Locks the shard of `region`.
    pub fn lock(&self, region: u64) -> MutexGuard<'_, Shard> {
        self.lock_shard((region % SHARDS as u64) as usize)
    }

    fn lock_shard(&self, i: usize) -> MutexGuard<'_, Shard> {
        self.shards[i]
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// An approximately least-recently-used region holding RAM pages: shards are visited
    /// round-robin, each running its own CLOCK hand.
    pub fn eviction_victim(&self) -> Option<u64> {
        for _ in 0..SHARDS {
            let i = self.hand.fetch_add(1, Ordering::Relaxed) % SHARDS;
            if let Some(r) = self.lock_shard(i).clock_victim() {
                return Some(r);
            }
        }
        None
    }

    /// Number of region entries (for tests).
    #[cfg(test)]
    pub fn regions(&self) -> usize {
        (0..SHARDS).map(|i| self.lock_shard(i).regions.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_follow_the_table_and_clock_gives_a_second_chance() {
        let map = RegionMap::default();
        let at = |slot| PageAddr { region: 3, slot };
        {
            let mut sh = map.lock(3);
            sh.insert_ram(at(5), Arc::new([1; 4096]));
            sh.insert_ram(at(9), Arc::new([2; 4096]));
            assert!(matches!(sh.page_mut(at(5)), Found::Ram(p) if p[0] == 1));
            sh.mark_zero(at(6), None);
            assert!(matches!(sh.page_mut(at(6)), Found::Zero));
            let r = sh.region_mut(3);
            r.unit = Some(2);
            r.set_file(7);
            assert_eq!(r.page(7), Found::Overflow(OverflowFile::slot_offset(2, 7)));
            assert_eq!(r.page(8), Found::Absent);
            // Referenced: the first pass clears the bit, the second picks it.
            assert_eq!(sh.clock_victim(), Some(3));
            assert_eq!(sh.ring.len(), 1);
            let r = sh.region_mut(3);
            r.remove_ram(5).unwrap();
            assert!(r.ram.is_some());
            r.remove_ram(9).unwrap();
            assert!(
                r.ram.is_none(),
                "the slot array goes with the last RAM page"
            );
            assert_eq!(sh.clock_victim(), None);
            assert!(sh.ring.is_empty());
        }
        assert_eq!(map.eviction_victim(), None);
        assert_eq!(map.regions(), 1);
        assert_eq!(PageAddr::of(3 * 512 + 7), at(7));
        assert_eq!(at(7).index(), 3 * 512 + 7);
    }
}
