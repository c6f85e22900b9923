//! `PageMap`: the in-memory state of every page of a disk cache file, two bits per page in
//! atomic words, plus `ChangedPages`, the set of pages whose state changed since the last
//! flush (what the persistent cache journals).
//!
//! Design notes.
//!
//! | bits | state  | reads come from            | cache file holds         |
//! | ---- | ------ | -------------------------- | ------------------------ |
//! | 00   | absent | the lower device (vDisk)   | a hole                   |
//! | 01   | data   | the cache file, at p·4096  | the page's bytes         |
//! | 10   | zero   | nothing: zeros             | a hole (punched)         |
//! | 11   | —      | never stored               |                          |
//!
//! Transitions: absent → data | zero, data ↔ zero; never back to absent (a trimmed page
//! must read as zeros, not as the vDisk's bytes).
//!
//! There is no lock here at all: 32 pages share one `AtomicU64`, and a state change is one
//! compare-and-swap of that word, so a reader never sees a half-done change (a clear-then-
//! set would show a page as *absent* for a moment and let a reader fetch the vDisk's
//! bytes). Writers of one page are serialized by the caller's page locks; the CAS only
//! protects the 31 neighbours in the same word. The number of data pages is kept in an
//! atomic counter beside the words, so `file_bytes` and the `max_file` cap are exact.
//!
//! `ChangedPages` is a two-level bitmap: one bit per page, and one summary bit per word of
//! page bits, so draining it at a flush touches only words that changed. Marking sets the
//! page bit first and the summary bit when the word was empty; draining clears a summary
//! bit before taking its words, so a mark racing with a drain is picked up by this drain or
//! the next one, never lost.

use std::sync::atomic::{AtomicU64, Ordering};

/// The state of one page of a disk cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageState {
    Absent = 0,
    Data = 1,
    Zero = 2,
}

impl PageState {
    /// From the two stored bits; `None` for the unused pattern 11.
    pub fn from_bits(bits: u64) -> Option<PageState> {
        match bits {
            0 => Some(PageState::Absent),
            1 => Some(PageState::Data),
            2 => Some(PageState::Zero),
            _ => None,
        }
    }
}

const PER_WORD: u64 = 32;

/// The state of every page. See the module notes.
#[derive(Debug)]
pub struct PageMap {
    words: Box<[AtomicU64]>,
    pages: u64,
    data_pages: AtomicU64,
}

impl PageMap {
    /// A map of `pages` pages, all absent.
    pub fn new(pages: u64) -> PageMap {
        let n = pages.div_ceil(PER_WORD) as usize;
        PageMap {
            words: (0..n).map(|_| AtomicU64::new(0)).collect(),
            pages,
            data_pages: AtomicU64::new(0),
        }
    }

    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Pages in the data state now.
    pub fn data_pages(&self) -> u64 {
        self.data_pages.load(Ordering::Relaxed)
    }

    pub fn get(&self, page: u64) -> PageState {
        let w = self.words[(page / PER_WORD) as usize].load(Ordering::Acquire);
        let bits = (w >> ((page % PER_WORD) * 2)) & 3;
        PageState::from_bits(bits).unwrap_or(PageState::Absent)
    }

    /// The state of `page` and the end (exclusive, at most `end`) of the run of pages in that
    /// state that starts there. Skips uniform words whole.
    pub fn run(&self, page: u64, end: u64) -> (PageState, u64) {
        let state = self.get(page);
        let uniform = state as u64 * 0x5555_5555_5555_5555;
        let mut p = page + 1;
        while p < end {
            if p % PER_WORD == 0
                && p + PER_WORD <= end
                && self.words[(p / PER_WORD) as usize].load(Ordering::Acquire) == uniform
            {
                p += PER_WORD;
                continue;
            }
            if self.get(p) != state {
                break;
            }
            p += 1;
        }
        (state, p)
    }

    /// Sets one page's state; returns the state it had.
    pub fn set(&self, page: u64, state: PageState) -> PageState {
        let old = self.swap(page, state);
        self.count_change(old, state);
        old
    }

    /// Makes a page data under a reservation from [`PageMap::reserve`], which already
    /// counted it (so a page that was not data is not counted twice). Returns the old state.
    pub fn set_data_reserved(&self, page: u64) -> PageState {
        self.swap(page, PageState::Data)
    }

    fn swap(&self, page: u64, state: PageState) -> PageState {
        let shift = (page % PER_WORD) * 2;
        let word = &self.words[(page / PER_WORD) as usize];
        let prev = word
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                Some((w & !(3 << shift)) | ((state as u64) << shift))
            })
            .unwrap_or_else(|w| w);
        PageState::from_bits((prev >> shift) & 3).unwrap_or(PageState::Absent)
    }

    fn count_change(&self, old: PageState, new: PageState) {
        match (old == PageState::Data, new == PageState::Data) {
            (false, true) => {
                self.data_pages.fetch_add(1, Ordering::Relaxed);
            }
            (true, false) => {
                self.data_pages.fetch_sub(1, Ordering::Relaxed);
            }
            _ => {}
        }
    }

    /// Sets pages `first .. first+count` to `state`, a word at a time, calling `changed` for
    /// every page whose state actually changed. Returns how many pages were data before.
    pub fn set_range(
        &self,
        first: u64,
        count: u64,
        state: PageState,
        mut changed: impl FnMut(u64),
    ) -> u64 {
        let end = first + count;
        let mut page = first;
        let mut was_data = 0u64;
        while page < end {
            let wi = page / PER_WORD;
            let lo = page % PER_WORD;
            let hi = (end - wi * PER_WORD).min(PER_WORD);
            let nbits = (hi - lo) * 2;
            let mask = if nbits == 64 {
                u64::MAX
            } else {
                ((1u64 << nbits) - 1) << (lo * 2)
            };
            let pattern =
                (0..PER_WORD).fold(0u64, |acc, i| acc | ((state as u64) << (i * 2))) & mask;
            let prev = self.words[wi as usize]
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                    Some((w & !mask) | pattern)
                })
                .unwrap_or_else(|w| w);
            for i in lo..hi {
                let old = PageState::from_bits((prev >> (i * 2)) & 3).unwrap_or(PageState::Absent);
                if old != state {
                    if old == PageState::Data {
                        was_data += 1;
                    }
                    self.count_change(old, state);
                    changed(wi * PER_WORD + i);
                }
            }
            page = wi * PER_WORD + hi;
        }
        was_data
    }

    /// Counts `count` more data pages if the total stays within `limit`: taken before a
    /// write turns pages that are not data into data ([`PageMap::set_data_reserved`]), and
    /// given back with [`PageMap::release`] if the write fails.
    pub fn reserve(&self, count: u64, limit: u64) -> bool {
        self.data_pages
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |d| {
                d.checked_add(count).filter(|&n| n <= limit)
            })
            .is_ok()
    }

    /// Gives back (part of) a reservation taken with [`PageMap::reserve`].
    pub fn release(&self, count: u64) {
        self.data_pages.fetch_sub(count, Ordering::AcqRel);
    }

    /// The raw words, for a checkpoint (a consistent copy only under the caller's ordering).
    pub fn export_words(&self) -> Vec<u64> {
        self.words
            .iter()
            .map(|w| w.load(Ordering::Acquire))
            .collect()
    }

    /// Loads raw words (from a checkpoint); fails on a stored 11 pattern or a bit set past
    /// the last page.
    pub fn import_words(&self, words: &[u64]) -> std::result::Result<(), String> {
        if words.len() != self.words.len() {
            return Err(format!(
                "the map has {} words, expected {}",
                words.len(),
                self.words.len()
            ));
        }
        let mut data = 0u64;
        for (i, (&w, slot)) in words.iter().zip(self.words.iter()).enumerate() {
            for b in 0..PER_WORD {
                let page = i as u64 * PER_WORD + b;
                let bits = (w >> (b * 2)) & 3;
                if bits == 3 || (page >= self.pages && bits != 0) {
                    return Err(format!("page {page} has an invalid state {bits:#b}"));
                }
                data += (bits == 1) as u64;
            }
            slot.store(w, Ordering::Release);
        }
        self.data_pages.store(data, Ordering::Release);
        Ok(())
    }
}

/// The set of pages whose state changed since the last drain. See the module notes.
#[derive(Debug)]
pub struct ChangedPages {
    bits: Box<[AtomicU64]>,
    summary: Box<[AtomicU64]>,
}

impl ChangedPages {
    pub fn new(pages: u64) -> ChangedPages {
        let words = pages.div_ceil(64) as usize;
        ChangedPages {
            bits: (0..words).map(|_| AtomicU64::new(0)).collect(),
            summary: (0..words.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    pub fn mark(&self, page: u64) {
        let wi = (page / 64) as usize;
        let prev = self.bits[wi].fetch_or(1 << (page % 64), Ordering::AcqRel);
        if prev == 0 {
            self.summary[wi / 64].fetch_or(1 << (wi % 64), Ordering::AcqRel);
        }
    }

    /// Takes every marked page (ascending) and clears them.
    pub fn drain(&self) -> Vec<u64> {
        let mut out = Vec::new();
        for (si, s) in self.summary.iter().enumerate() {
            let mut sum = s.swap(0, Ordering::AcqRel);
            while sum != 0 {
                let b = sum.trailing_zeros() as usize;
                sum &= sum - 1;
                let wi = si * 64 + b;
                let mut w = self.bits[wi].swap(0, Ordering::AcqRel);
                while w != 0 {
                    let bit = w.trailing_zeros() as u64;
                    w &= w - 1;
                    out.push(wi as u64 * 64 + bit);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_round_trip_and_count_data_pages() {
        let m = PageMap::new(100);
        assert_eq!(m.get(99), PageState::Absent);
        assert_eq!(m.set(33, PageState::Data), PageState::Absent);
        assert_eq!(m.set(34, PageState::Zero), PageState::Absent);
        assert_eq!(m.get(33), PageState::Data);
        assert_eq!(m.get(34), PageState::Zero);
        assert_eq!(m.get(32), PageState::Absent);
        assert_eq!(m.data_pages(), 1);
        let mut changed = Vec::new();
        let was = m.set_range(30, 40, PageState::Zero, |p| changed.push(p));
        assert_eq!(was, 1);
        assert_eq!(m.data_pages(), 0);
        assert_eq!(changed.len(), 39, "page 34 was already zero");
        assert!((30..70).all(|p| m.get(p) == PageState::Zero));
        assert_eq!(m.get(29), PageState::Absent);
        assert_eq!(m.get(70), PageState::Absent);
        let copy = PageMap::new(100);
        copy.import_words(&m.export_words()).unwrap();
        assert!((0..100).all(|p| copy.get(p) == m.get(p)));
        assert!(copy.import_words(&[u64::MAX; 4]).is_err());
        assert_eq!(m.run(0, 100), (PageState::Absent, 30));
        assert_eq!(m.run(30, 100), (PageState::Zero, 70));
        assert_eq!(m.run(35, 50), (PageState::Zero, 50));
        assert_eq!(m.run(70, 100), (PageState::Absent, 100));
    }

    #[test]
    fn reservations_respect_the_limit() {
        let m = PageMap::new(10);
        assert!(m.reserve(3, 3));
        assert!(!m.reserve(1, 3));
        m.release(3);
        assert!(m.reserve(1, 3));
    }

    #[test]
    fn changed_pages_drain_once() {
        let c = ChangedPages::new(10_000);
        for p in [0, 63, 64, 4095, 4096, 9999, 64] {
            c.mark(p);
        }
        assert_eq!(c.drain(), vec![0, 63, 64, 4095, 4096, 9999]);
        assert!(c.drain().is_empty());
        c.mark(5);
        assert_eq!(c.drain(), vec![5]);
    }
}
