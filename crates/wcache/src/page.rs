//! Pages: the 4 KiB unit every write cache works in, the striped locks that serialize
//! writers of one page, and the read-modify-write that turns a partial write into a full
//! page.
//!
//! Design notes.
//!
//! A cache holds whole pages. A guest write that covers a page fully replaces it; one that
//! covers part of a page the cache does not hold yet must first fetch the rest of the page
//! from below (read-modify-write, [`rmw_from_lower`]). Partial zeroing is the same with a
//! zero patch ([`Patch::Zeros`]). Every cache type tracks each page in one of these states:
//!
//! | state      | reads come from              | storage held            |
//! | ---------- | ---------------------------- | ----------------------- |
//! | absent     | the lower device (vDisk)     | none                    |
//! | ram        | the RAM page                 | one 4 KiB buffer        |
//! | file       | the overflow or cache file   | one 4 KiB slot          |
//! | zero       | nothing: zeros               | none (a marker)         |
//!
//! A trimmed or zeroed page goes to *zero*, never back to *absent*: it must read as zeros,
//! not as the vDisk's bytes underneath.
//!
//! [`PageLocks`] is a fixed set of mutexes; page `p` uses stripe `hash(p) % N`. Two
//! in-flight writes to the same page take the same stripe and serialize (the second sees the
//! first's page, so no update is lost during read-modify-write); writes to different pages
//! almost always take different stripes and run in parallel. A request spanning several
//! pages locks their stripes in ascending stripe order ([`PageLocks::lock_pages`]), so two
//! multi-page requests can never deadlock.
//!
//! Invariants:
//! - Locks are only ever taken in ascending stripe order, and at most once per stripe.
//! - A poisoned stripe is taken over: the lock guards no data of its own, only ordering.
//! - The helpers never read past the end of the lower device: the part of a last, partial
//!   page beyond `size()` is filled with zeros.

use std::sync::{Mutex, MutexGuard, PoisonError};

use vdstream_blockdev::{BlockDev, Result};

use crate::stats::CacheStats;

/// Bytes per page: the granularity of every cache.
pub const PAGE: usize = 4096;
/// [`PAGE`] as a `u64`, for offset arithmetic.
pub const PAGE_U64: u64 = PAGE as u64;
/// log2 of [`PAGE`].
pub const PAGE_SHIFT: u32 = 12;

/// One page of bytes.
pub type PageBuf = [u8; PAGE];

/// A new zero-filled page on the heap (no stack copy of 4 KiB).
pub fn new_page() -> Box<PageBuf> {
    // vec! of zeros uses calloc, which is cheap for fresh memory.
    vec![0u8; PAGE]
        .into_boxed_slice()
        .try_into()
        .expect("PAGE bytes")
}

/// Copies one whole page with non-temporal stores (no read of the destination's old
/// cache lines), then an `sfence` so that the stores are ordered before whatever publishes
/// the page. Plain copy where the destination is not 16-byte aligned or off x86_64.
pub fn copy_page_streaming(dst: &mut [u8], src: &[u8]) {
    assert!(dst.len() == PAGE && src.len() == PAGE);
    #[cfg(target_arch = "x86_64")]
    if dst.as_ptr() as usize % 16 == 0 {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let (d, s) = (
            dst.as_mut_ptr().cast::<__m128i>(),
            src.as_ptr().cast::<__m128i>(),
        );
        for i in 0..PAGE / 16 {
            // SAFETY: both slices are PAGE bytes long (asserted), so every 16-byte chunk i is
            // in bounds; `dst` is 16-byte aligned (checked) as `_mm_stream_si128` needs, and
            // `_mm_loadu_si128` takes any alignment. SSE2 is part of x86_64.
            unsafe { _mm_stream_si128(d.add(i), _mm_loadu_si128(s.add(i))) };
        }
        // SAFETY: a store fence has no operands and no preconditions.
        unsafe { _mm_sfence() };
        return;
    }
    dst.copy_from_slice(src);
}

/// Whether every byte of `buf` is zero (word at a time).
pub fn is_zero(buf: &[u8]) -> bool {
    let (head, body, tail) = {
        // SAFETY: any initialized bytes are valid `u64`s; align_to only splits at alignment.
        unsafe { buf.align_to::<u64>() }
    };
    head.iter().all(|&b| b == 0) && body.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

/// A striped lock set over page indices. See the module notes.
#[derive(Debug)]
pub struct PageLocks {
    stripes: Box<[Stripe]>,
    mask: u64,
}

/// A stripe on its own cache line so neighbouring stripes don't false-share.
#[repr(align(64))]
#[derive(Debug, Default)]
struct Stripe(Mutex<()>);

/// Holds the stripes of a request, in ascending order; released on drop. A one-page
/// request (the common 4 KiB case) holds its stripe inline: no allocation per request.
#[derive(Debug)]
pub struct PageRangeGuard<'a> {
    _guards: Guards<'a>,
}

#[derive(Debug)]
enum Guards<'a> {
    None,
    One(#[allow(dead_code)] MutexGuard<'a, ()>),
    Many(Vec<MutexGuard<'a, ()>>),
}

impl PageRangeGuard<'_> {
    /// Number of stripes held.
    pub fn stripes_held(&self) -> usize {
        match &self._guards {
            Guards::None => 0,
            Guards::One(_) => 1,
            Guards::Many(v) => v.len(),
        }
    }
}

impl PageLocks {
    /// A set of at least `stripes` locks (rounded up to a power of two, at least 1).
    pub fn new(stripes: usize) -> Self {
        let n = stripes.max(1).next_power_of_two();
        PageLocks {
            stripes: (0..n).map(|_| Stripe::default()).collect(),
            mask: n as u64 - 1,
        }
    }

    /// Number of stripes.
    pub fn stripes(&self) -> usize {
        self.stripes.len()
    }

    /// The stripe of page `page` (Fibonacci hashing: neighbouring pages spread out).
    pub fn stripe_of(&self, page: u64) -> usize {
        (page.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(32) & self.mask) as usize
    }

    /// The stripes of pages `first .. first + count`, each once, ascending (the lock order).
    fn stripes_of(&self, first: u64, count: u64) -> Vec<usize> {
        if count >= self.stripes.len() as u64 {
            return (0..self.stripes.len()).collect();
        }
        let mut v: Vec<usize> = (first..first + count).map(|p| self.stripe_of(p)).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Locks the stripe of one page.
    pub fn lock(&self, page: u64) -> MutexGuard<'_, ()> {
        self.stripes[self.stripe_of(page)]
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Locks the stripes of pages `first .. first + count` (each stripe once, ascending).
    /// A range with as many pages as there are stripes locks every stripe.
    pub fn lock_pages(&self, first: u64, count: u64) -> PageRangeGuard<'_> {
        if count == 1 {
            return PageRangeGuard {
                _guards: Guards::One(self.lock(first)),
            };
        }
        let idx = self.stripes_of(first, count);
        let guards = idx
            .into_iter()
            .map(|i| {
                self.stripes[i]
                    .0
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
            })
            .collect();
        PageRangeGuard {
            _guards: Guards::Many(guards),
        }
    }

    /// Like [`lock_pages`](Self::lock_pages), without waiting: `None` if any stripe is held
    /// (by anyone, this thread included), and then nothing stays locked.
    pub fn try_lock_pages(&self, first: u64, count: u64) -> Option<PageRangeGuard<'_>> {
        let try_one = |i: usize| match self.stripes[i].0.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        if count == 1 {
            return try_one(self.stripe_of(first)).map(|g| PageRangeGuard {
                _guards: Guards::One(g),
            });
        }
        let idx = self.stripes_of(first, count);
        let guards = idx.into_iter().map(try_one).collect::<Option<Vec<_>>>()?;
        Some(PageRangeGuard {
            _guards: Guards::Many(guards),
        })
    }

    /// Locks the stripes of every page touched by the byte range `[offset, offset+len)`.
    pub fn lock_bytes(&self, offset: u64, len: u64) -> PageRangeGuard<'_> {
        if len == 0 {
            return PageRangeGuard {
                _guards: Guards::None,
            };
        }
        let first = offset >> PAGE_SHIFT;
        let last = (offset + len - 1) >> PAGE_SHIFT;
        self.lock_pages(first, last - first + 1)
    }
}

/// What a partial write puts into a page.
#[derive(Debug, Clone, Copy)]
pub enum Patch<'a> {
    /// These bytes.
    Data(&'a [u8]),
    /// This many zero bytes.
    Zeros(usize),
}

impl Patch<'_> {
    pub fn len(&self) -> usize {
        match self {
            Patch::Data(d) => d.len(),
            Patch::Zeros(n) => *n,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Applies the patch to `page` at `within` (which must fit in the page).
    pub fn apply(&self, page: &mut [u8], within: usize) {
        match self {
            Patch::Data(d) if within == 0 && d.len() == PAGE && page.len() == PAGE => {
                copy_page_streaming(page, d)
            }
            Patch::Data(d) => page[within..within + d.len()].copy_from_slice(d),
            Patch::Zeros(n) => page[within..within + n].fill(0),
        }
    }

    /// Whether the patch covers a whole page on its own (no read of the old page needed).
    pub fn covers_page(&self, within: usize) -> bool {
        within == 0 && self.len() == PAGE
    }
}

/// Reads page `index` of `lower` into `out` (one page), zero-filling what lies past the end
/// of the device, and counts the read as vDisk I/O in `stats`.
pub fn read_lower_page(
    lower: &dyn BlockDev,
    stats: &CacheStats,
    index: u64,
    out: &mut [u8],
) -> Result<()> {
    debug_assert_eq!(out.len(), PAGE);
    let start = index << PAGE_SHIFT;
    let size = lower.size();
    let avail = size.saturating_sub(start).min(PAGE_U64) as usize;
    if avail > 0 {
        lower.read_at(&mut out[..avail], start)?;
        CacheStats::count(&stats.vdisk_read_ops, &stats.vdisk_read_bytes, avail as u64);
    }
    out[avail..].fill(0);
    Ok(())
}

/// Read-modify-write from the lower device: builds in `out` the full page `index` as the
/// lower device has it with `patch` applied at `within`. If the patch covers the whole page
/// the lower device is not read.
pub fn rmw_from_lower(
    lower: &dyn BlockDev,
    stats: &CacheStats,
    index: u64,
    within: usize,
    patch: Patch<'_>,
    out: &mut [u8],
) -> Result<()> {
    debug_assert!(within + patch.len() <= PAGE);
    if !patch.covers_page(within) {
        read_lower_page(lower, stats, index, out)?;
    }
    patch.apply(out, within);
    Ok(())
}

/// A zero page with a partial write applied: read-modify-write of a page in the *zero*
/// state (no I/O at all).
pub fn rmw_from_zero(within: usize, patch: Patch<'_>, out: &mut [u8]) {
    if !patch.covers_page(within) {
        out.fill(0);
    }
    patch.apply(out, within);
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_streamed_page_copy_equals_the_source_aligned_or_not() {
        let src: Vec<u8> = (0..PAGE).map(|i| (i * 31 % 251) as u8).collect();
        let mut page = new_page();
        copy_page_streaming(&mut page[..], &src);
        assert_eq!(&page[..], &src[..]);
        // A destination that is not 16-byte aligned takes the plain copy.
        let mut wide = vec![0u8; PAGE + 16];
        let off = (0..16)
            .find(|o| (wide.as_ptr() as usize + o) % 16 != 0)
            .unwrap();
        copy_page_streaming(&mut wide[off..off + PAGE], &src);
        assert_eq!(&wide[off..off + PAGE], &src[..]);
        // Through Patch, as the RAM tiers apply whole-page writes.
        let mut again = new_page();
        Patch::Data(&src).apply(&mut again[..], 0);
        assert_eq!(&again[..], &src[..]);
    }

    use super::*;
    use vdstream_blockdev::MemoryDev;

    #[test]
    fn stripes_are_power_of_two_and_ranges_lock_each_stripe_once() {
        let locks = PageLocks::new(100);
        assert_eq!(locks.stripes(), 128);
        // Would deadlock if a stripe were locked twice.
        let g = locks.lock_pages(0, 1000);
        drop(g);
        let g = locks.lock_bytes(4095, 2);
        assert_eq!(g.stripes_held(), 2);
        drop(g);
        let _one = locks.lock(7);
    }

    #[test]
    fn same_page_serializes() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let locks = PageLocks::new(16);
        let inside = AtomicBool::new(false);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..200 {
                        let _g = locks.lock_bytes(8192 + 100, 10);
                        assert!(
                            !inside.swap(true, Ordering::SeqCst),
                            "two holders of one page"
                        );
                        std::hint::spin_loop();
                        inside.store(false, Ordering::SeqCst);
                    }
                });
            }
        });
    }

    #[test]
    fn rmw_reads_lower_only_when_partial_and_zero_fills_past_end() {
        let lower = MemoryDev::new(PAGE_U64 + 100);
        lower.write_at(&[7u8; 100], PAGE_U64, false).unwrap();
        lower.write_at(&[5u8; PAGE], 0, false).unwrap();
        let stats = CacheStats::default();
        let mut out = vec![1u8; PAGE];
        rmw_from_lower(&lower, &stats, 1, 10, Patch::Data(&[9, 9]), &mut out).unwrap();
        assert_eq!(&out[..10], &[7u8; 10]);
        assert_eq!(&out[10..12], &[9, 9]);
        assert_eq!(&out[12..100], &[7u8; 88]);
        assert!(is_zero(&out[100..]));
        assert_eq!(stats.snapshot().vdisk_read_bytes, 100);
        rmw_from_lower(&lower, &stats, 0, 0, Patch::Data(&[3u8; PAGE]), &mut out).unwrap();
        assert_eq!(out, vec![3u8; PAGE]);
        assert_eq!(
            stats.snapshot().vdisk_read_ops,
            1,
            "a whole-page patch must not read below"
        );
        rmw_from_lower(&lower, &stats, 0, 4000, Patch::Zeros(96), &mut out).unwrap();
        assert_eq!(&out[..4000], &[5u8; 4000][..]);
        assert!(is_zero(&out[4000..]));
        rmw_from_zero(1, Patch::Data(&[2]), &mut out);
        assert_eq!(out[1], 2);
        out[1] = 0;
        assert!(is_zero(&out));
    }
}
