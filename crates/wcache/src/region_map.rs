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
//!   `unit_gen` changes whenever the region gets a unit, so a reader that did file I/O
//!   without the lock can tell whether the unit changed hands meanwhile.
//! - A region in RAM is in its shard's CLOCK ring (`in_ring`); eviction walks the ring,
//!   giving a second chance to regions touched since the last pass (`referenced`).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::overflow_file::UNIT_PAGES;
use crate::page::PageBuf;

/// Number of shards; region `r` lives in shard `r % SHARDS`.
pub const SHARDS: usize = 64;

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

/// Where one page is. See the state table in the module notes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageState {
    Absent,
    Ram,
    Overflow,
    Zero,
}

/// The state of one 2 MiB region. See the module notes.
#[derive(Debug, Default)]
pub struct Region {
    ram: Option<Box<[Option<RamPage>; UNIT_PAGES]>>,
    pub ram_count: u32,
    pub zero: Bits512,
    pub file: Bits512,
    pub file_count: u32,
    /// The overflow unit this region owns.
    pub unit: Option<u64>,
    /// Changes whenever `unit` is assigned.
    pub unit_gen: u64,
    /// I/O in flight on `unit` (evictions, in-place writes): the unit must not be released.
    pub pins: u32,
    /// Touched since the CLOCK hand last passed.
    pub referenced: bool,
    in_ring: bool,
}

impl Region {
    pub fn state(&self, slot: usize) -> PageState {
        if self.ram_page(slot).is_some() {
            PageState::Ram
        } else if self.zero.get(slot) {
            PageState::Zero
        } else if self.file.get(slot) {
            PageState::Overflow
        } else {
            PageState::Absent
        }
    }

    pub fn ram_page(&self, slot: usize) -> Option<&RamPage> {
        self.ram.as_ref().and_then(|r| r[slot].as_ref())
    }

    pub fn ram_page_mut(&mut self, slot: usize) -> Option<&mut RamPage> {
        self.ram.as_mut().and_then(|r| r[slot].as_mut())
    }

    /// Puts a page in RAM (the slot must be empty); clears its zero bit.
    pub fn insert_ram(&mut self, slot: usize, page: RamPage) {
        let arr = self.ram.get_or_insert_with(|| Box::new([const { None }; UNIT_PAGES]));
        debug_assert!(arr[slot].is_none());
        arr[slot] = Some(page);
        self.ram_count += 1;
        self.zero.clear(slot);
    }

    /// Takes the RAM page out of a slot; drops the slot array with the last page.
    pub fn remove_ram(&mut self, slot: usize) -> Option<RamPage> {
        let page = self.ram.as_mut()?[slot].take()?;
        self.ram_count -= 1;
        if self.ram_count == 0 {
            self.ram = None;
        }
        Some(page)
    }

    /// Slots holding RAM pages, ascending, with the pages (cloned handles).
    pub fn ram_pages(&self) -> Vec<(usize, RamPage)> {
        match &self.ram {
            None => Vec::new(),
            Some(arr) => arr.iter().enumerate().filter_map(|(i, p)| p.as_ref().map(|p| (i, Arc::clone(p)))).collect(),
        }
    }

    /// Sets the file bit; returns whether it was newly set.
    pub fn set_file(&mut self, slot: usize) -> bool {
        let new = self.file.set(slot);
        if new {
            self.file_count += 1;
        }
        new
    }

    /// Clears the file bit; returns whether it was set.
    pub fn clear_file(&mut self, slot: usize) -> bool {
        let was = self.file.clear(slot);
        if was {
            self.file_count -= 1;
        }
        was
    }

    /// Nothing cached and nothing in flight: the entry can go.
    pub fn is_empty(&self) -> bool {
        self.ram_count == 0 && self.file_count == 0 && self.pins == 0 && self.unit.is_none() && self.zero.is_empty()
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

    pub fn get_mut(&mut self, region: u64) -> Option<&mut Region> {
        self.regions.get_mut(&region)
    }

    /// The region's entry, created empty if missing; marks it referenced.
    /// The region's entry if it has one (marked referenced, as [`Shard::region_mut`] does).
    pub fn region_if_present(&mut self, region: u64) -> Option<&mut Region> {
        let r = self.regions.get_mut(&region)?;
        r.referenced = true;
        Some(r)
    }

    pub fn region_mut(&mut self, region: u64) -> &mut Region {
        let r = self.regions.entry(region).or_default();
        r.referenced = true;
        r
    }

    /// Call after giving a region RAM pages: puts it in the CLOCK ring once.
    pub fn note_ram(&mut self, region: u64) {
        if let Some(r) = self.regions.get_mut(&region) {
            if r.ram_count > 0 && !r.in_ring {
                r.in_ring = true;
                self.ring.push_back(region);
            }
        }
    }

    /// Drops the region's entry if it holds nothing.
    pub fn forget_if_empty(&mut self, region: u64) {
        if self.regions.get(&region).is_some_and(|r| r.is_empty() && !r.in_ring) {
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
            let Some(r) = self.regions.get_mut(&idx) else { continue };
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
        RegionMap { shards: (0..SHARDS).map(|_| PaddedShard::default()).collect(), hand: AtomicUsize::new(0) }
    }
}

impl RegionMap {
    /// Locks the shard of `region`.
    pub fn lock(&self, region: u64) -> MutexGuard<'_, Shard> {
        self.lock_shard((region % SHARDS as u64) as usize)
    }

    fn lock_shard(&self, i: usize) -> MutexGuard<'_, Shard> {
        self.shards[i].0.lock().unwrap_or_else(PoisonError::into_inner)
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
        {
            let mut sh = map.lock(3);
            let r = sh.region_mut(3);
            r.insert_ram(5, Arc::new([1; 4096]));
            assert_eq!(r.state(5), PageState::Ram);
            r.zero.set(6);
            assert_eq!(r.state(6), PageState::Zero);
            r.set_file(7);
            assert_eq!(r.state(7), PageState::Overflow);
            assert_eq!(r.state(8), PageState::Absent);
            sh.note_ram(3);
            sh.note_ram(3);
            // Referenced: the first pass clears the bit, the second picks it.
            assert_eq!(sh.clock_victim(), Some(3));
            assert_eq!(sh.ring.len(), 1);
            let r = sh.get_mut(3).unwrap();
            r.remove_ram(5).unwrap();
            assert!(r.ram.is_none(), "the slot array goes with the last RAM page");
            assert_eq!(sh.clock_victim(), None);
            assert!(sh.ring.is_empty());
        }
        assert_eq!(map.eviction_victim(), None);
        assert_eq!(map.regions(), 1);
    }
}
