//! `MemoryDev`: a sparse RAM disk, the in-process peer of nbdkit's `memory` plugin.
//!
//! Design notes.
//!
//! Memory is taken one 4 KiB *page* at a time, on the first write that puts a non-zero byte
//! into it; nothing is reserved up front, so a device of many TiB costs nothing until it is
//! written. Pages are grouped into 2 MiB *chunks* (512 page slots, allocated with the first
//! page in them and dropped with the last), and chunks live in [`SHARDS`] shards selected by
//! chunk index (`chunk % SHARDS`). Each shard is one `RwLock` around an ordered map
//! `chunk index → chunk`, so:
//!
//! - there is no lock over the whole device: two requests contend only when their chunks
//!   fall in the same shard (1 in 64 for random 4 KiB I/O);
//! - a request takes each shard lock once per chunk it touches, so a 2 MiB aligned write is
//!   one lock, not 512;
//! - an ordered map lets block status, sparse reads and trims of huge sparse ranges skip
//!   whole runs of unallocated chunks with one range query per shard, instead of visiting
//!   every chunk index of a many-TiB device.
//!
//! Invariants:
//! - A page slot is `Some` only while the page is allocated; an unallocated page reads as
//!   zeros. A chunk is in its shard's map only while it holds at least one page, and each
//!   shard counts its pages (so [`MemoryDev::allocated_bytes`] is exact).
//! - Every byte of a page is copied in or out while holding its shard lock (write lock to
//!   change, read lock to read), so concurrent writes to one page never lose an update: each
//!   byte ends up from one of the writers, and writes to disjoint bytes both survive.
//! - TRIM and `write_zeroes` with `may_trim` free whole pages; a partial page is zeroed in
//!   place and freed if it became all zero. `write_zeroes` without `may_trim` zeroes
//!   allocated pages in place and leaves holes as holes (there is nothing to reserve in RAM).
//! - Bytes past `size()` in the last page (when the size is not a multiple of 4096) are
//!   never written, so they stay zero.
//! - A poisoned shard lock is taken over rather than propagated: page contents are plain
//!   bytes, always in a valid state.

use std::collections::BTreeMap;
use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::reclaim;
use crate::span::units;
use crate::{check_range, BlockDev, Caps, Extent, Hole, Op, Result, ZeroFlags};

/// Allocation unit: bytes per page.
pub const PAGE_SIZE: u64 = 4096;
/// Pages per chunk (a chunk spans 2 MiB).
const CHUNK_PAGES: usize = 512;
/// Bytes per chunk.
const CHUNK_SIZE: u64 = PAGE_SIZE * CHUNK_PAGES as u64;
/// Number of lock shards; chunk `c` lives in shard `c % SHARDS`.
pub const SHARDS: usize = 64;

type Page = [u8; PAGE_SIZE as usize];

/// The page slots of one 2 MiB chunk.
struct Chunk {
    pages: Box<[Option<Box<Page>>; CHUNK_PAGES]>,
    /// How many slots are `Some`.
    allocated: u32,
}

impl Chunk {
    fn new() -> Self {
        Chunk {
            pages: Box::new([const { None }; CHUNK_PAGES]),
            allocated: 0,
        }
    }
}

/// One lock's worth of chunks.
#[derive(Default)]
struct Shard {
    chunks: BTreeMap<u64, Chunk>,
    /// Pages allocated in this shard.
    pages: u64,
}

/// A shard lock on its own cache lines, so that neighbouring shards don't false-share.
#[repr(align(128))]
#[derive(Default)]
struct PaddedShard(RwLock<Shard>);

/// A sparse RAM disk, sharded by 2 MiB chunk. See the module notes.
pub struct MemoryDev {
    size: u64,
    shards: Box<[PaddedShard]>,
}

impl std::fmt::Debug for MemoryDev {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryDev")
            .field("size", &self.size)
            .field("allocated_bytes", &self.allocated_bytes())
            .finish()
    }
}

/// Whether every byte of `b` is zero (written so that the compiler vectorises it).
pub(crate) fn is_zero(b: &[u8]) -> bool {
    let mut chunks = b.chunks_exact(64);
    for c in &mut chunks {
        if c.iter().fold(0u8, |acc, &x| acc | x) != 0 {
            return false;
        }
    }
    chunks.remainder().iter().all(|&x| x == 0)
}

/// Appends a hole, merging it with the last one appended since index `base`.
fn push_hole(holes: &mut Vec<Hole>, base: usize, start: usize, len: usize) {
    if len == 0 {
        return;
    }
    if holes.len() > base {
        let last = holes.last_mut().expect("non-empty");
        if last.start + last.len == start {
            last.len += len;
            return;
        }
    }
    holes.push(Hole { start, len });
}

/// Appends an extent, merging it with the last one appended since index `base` when both
/// have the same flags.
fn push_extent(out: &mut Vec<Extent>, base: usize, e: Extent) {
    if e.len == 0 {
        return;
    }
    if out.len() > base {
        let last = out.last_mut().expect("non-empty");
        if last.hole == e.hole && last.zero == e.zero {
            last.len += e.len;
            return;
        }
    }
    out.push(e);
}

const HOLE: Extent = Extent {
    len: 0,
    hole: true,
    zero: true,
};
const DATA: Extent = Extent {
    len: 0,
    hole: false,
    zero: false,
};

impl MemoryDev {
    /// A device of `size` bytes, all zero and unallocated. Any size works, including sizes
    /// that are not a multiple of 4096 and sizes of many TiB: nothing is allocated up front.
    pub fn new(size: u64) -> Self {
        MemoryDev {
            size,
            shards: (0..SHARDS).map(|_| PaddedShard::default()).collect(),
        }
    }

    /// Bytes of RAM held by pages (whole 4 KiB pages; the page tables are not counted).
    pub fn allocated_bytes(&self) -> u64 {
        (0..SHARDS)
            .map(|s| self.read_shard(s as u64).pages)
            .sum::<u64>()
            * PAGE_SIZE
    }

    fn shard_of(chunk: u64) -> usize {
        (chunk % SHARDS as u64) as usize
    }

    fn read_shard(&self, chunk: u64) -> RwLockReadGuard<'_, Shard> {
        self.shards[Self::shard_of(chunk)]
            .0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn write_shard(&self, chunk: u64) -> RwLockWriteGuard<'_, Shard> {
        self.shards[Self::shard_of(chunk)]
            .0
            .write()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The first allocated chunk with index in `[from, to]`, if any: one range query per
    /// shard that can hold such a chunk.
    fn next_allocated_chunk(&self, from: u64, to: u64) -> Option<u64> {
        let shards = (to - from).saturating_add(1).min(SHARDS as u64);
        (from..from + shards)
            .filter_map(|c| {
                self.read_shard(c)
                    .chunks
                    .range(from..=to)
                    .next()
                    .map(|(&k, _)| k)
            })
            .min()
    }

    /// Calls `f` under the write lock of every shard that may hold chunks with index in
    /// `[first, last]`, each shard once.
    fn for_each_shard_in(&self, first: u64, last: u64, mut f: impl FnMut(&mut Shard)) {
        let shards = (last - first).saturating_add(1).min(SHARDS as u64);
        for c in first..first + shards {
            f(&mut self.write_shard(c));
        }
    }

    /// Zeroes `[offset, offset+len)`; with `release`, frees the pages that end up all zero.
    fn zero_range(&self, offset: u64, len: u64, release: bool) {
        if len == 0 {
            return;
        }
        let end = offset + len;
        let (first, last) = (offset / CHUNK_SIZE, (end - 1) / CHUNK_SIZE);
        let mut emptied = Vec::new();
        let mut freed = 0u64;
        self.for_each_shard_in(first, last, |shard| {
            let Shard { chunks, pages } = shard;
            emptied.clear();
            for (&index, chunk) in chunks.range_mut(first..=last) {
                let base = index * CHUNK_SIZE;
                let (from, to) = (offset.max(base) - base, end.min(base + CHUNK_SIZE) - base);
                for p in units(from, to - from, PAGE_SIZE) {
                    let slot = &mut chunk.pages[p.index as usize];
                    let Some(page) = slot else { continue };
                    if !p.is_whole(PAGE_SIZE) || !release {
                        page[p.within..p.within + p.len].fill(0);
                    }
                    if release && (p.is_whole(PAGE_SIZE) || is_zero(&page[..])) {
                        *slot = None;
                        chunk.allocated -= 1;
                        *pages -= 1;
                        freed += PAGE_SIZE;
                    }
                }
                if chunk.allocated == 0 {
                    emptied.push(index);
                }
            }
            for index in &emptied {
                chunks.remove(index);
            }
        });
        // Outside the shard locks: hand the freed pages back to the system.
        reclaim::note_freed(freed);
        reclaim::maybe_reclaim();
    }

    /// Copies `[offset, offset+buf.len())` into `buf`, zero-filling and reporting holes
    /// (positions relative to `buf`) when `holes` is given.
    fn read_into(&self, buf: &mut [u8], offset: u64, mut holes: Option<&mut Vec<Hole>>) {
        let base = holes.as_ref().map_or(0, |h| h.len());
        let hole =
            |holes: &mut Option<&mut Vec<Hole>>, buf: &mut [u8], start: usize, len: usize| {
                buf[start..start + len].fill(0);
                if let Some(h) = holes.as_deref_mut() {
                    push_hole(h, base, start, len);
                }
            };
        for c in units(offset, buf.len() as u64, CHUNK_SIZE) {
            let shard = self.read_shard(c.index);
            let Some(chunk) = shard.chunks.get(&c.index) else {
                drop(shard);
                hole(&mut holes, buf, c.pos, c.len);
                continue;
            };
            for p in units(c.within as u64, c.len as u64, PAGE_SIZE) {
                let at = c.pos + p.pos;
                match &chunk.pages[p.index as usize] {
                    Some(page) => {
                        buf[at..at + p.len].copy_from_slice(&page[p.within..p.within + p.len])
                    }
                    None => hole(&mut holes, buf, at, p.len),
                }
            }
        }
    }
}

impl BlockDev for MemoryDev {
    fn size(&self) -> u64 {
        self.size
    }

    fn caps(&self) -> Caps {
        Caps {
            read_only: false,
            flush: true,
            fua: true,
            trim: true,
            zeroes: true,
            fast_zero: true,
            cache: true,
            block_status: true,
            multi_conn: true,
            may_block: false,
            preferred_block: PAGE_SIZE as u32,
        }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.size, Op::Read, offset, buf.len() as u64, &|| {
            self.describe()
        })?;
        self.read_into(buf, offset, None);
        Ok(())
    }

    fn read_at_sparse(&self, buf: &mut [u8], offset: u64, holes: &mut Vec<Hole>) -> Result<()> {
        check_range(self.size, Op::Read, offset, buf.len() as u64, &|| {
            self.describe()
        })?;
        self.read_into(buf, offset, Some(holes));
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64, _fua: bool) -> Result<()> {
        check_range(self.size, Op::Write, offset, buf.len() as u64, &|| {
            self.describe()
        })?;
        for c in units(offset, buf.len() as u64, CHUNK_SIZE) {
            let data = &buf[c.pos..c.pos + c.len];
            let mut guard = self.write_shard(c.index);
            let Shard { chunks, pages } = &mut *guard;
            if !chunks.contains_key(&c.index) && is_zero(data) {
                continue; // zeros into a hole: nothing to store
            }
            let chunk = chunks.entry(c.index).or_insert_with(Chunk::new);
            for p in units(c.within as u64, c.len as u64, PAGE_SIZE) {
                let src = &data[p.pos..p.pos + p.len];
                let slot = &mut chunk.pages[p.index as usize];
                let page = match slot {
                    Some(page) => page,
                    None if is_zero(src) => continue,
                    None => {
                        chunk.allocated += 1;
                        *pages += 1;
                        slot.insert(Box::new([0u8; PAGE_SIZE as usize]))
                    }
                };
                page[p.within..p.within + p.len].copy_from_slice(src);
            }
            if chunk.allocated == 0 {
                chunks.remove(&c.index); // only zero pages were written into a fresh chunk
            }
        }
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64, _fua: bool) -> Result<()> {
        check_range(self.size, Op::Trim, offset, len, &|| self.describe())?;
        self.zero_range(offset, len, true);
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        check_range(self.size, Op::Zero, offset, len, &|| self.describe())?;
        self.zero_range(offset, len, flags.may_trim);
        Ok(())
    }

    fn block_status(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        check_range(self.size, Op::BlockStatus, offset, len, &|| self.describe())?;
        let base = out.len();
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let index = pos / CHUNK_SIZE;
            let chunk_start = index * CHUNK_SIZE;
            let chunk_end = end.min(chunk_start + CHUNK_SIZE);
            let shard = self.read_shard(index);
            if let Some(chunk) = shard.chunks.get(&index) {
                for p in units(pos - chunk_start, chunk_end - pos, PAGE_SIZE) {
                    let kind = if chunk.pages[p.index as usize].is_some() {
                        DATA
                    } else {
                        HOLE
                    };
                    push_extent(
                        out,
                        base,
                        Extent {
                            len: p.len as u64,
                            ..kind
                        },
                    );
                }
                pos = chunk_end;
            } else {
                drop(shard);
                let last = (end - 1) / CHUNK_SIZE;
                let next = match self.next_allocated_chunk(index, last) {
                    Some(n) => (n * CHUNK_SIZE).max(pos),
                    None => end,
                };
                // `index` itself had no chunk a moment ago; if one appeared since, report
                // the current chunk as a hole anyway rather than loop (a racing write).
                let next = if next <= pos { chunk_end } else { next };
                push_extent(
                    out,
                    base,
                    Extent {
                        len: next - pos,
                        ..HOLE
                    },
                );
                pos = next;
            }
        }
        Ok(())
    }

    fn describe(&self) -> String {
        "memory".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_taken_on_write_and_given_back_on_trim() {
        let dev = MemoryDev::new(3 * CHUNK_SIZE + 100);
        assert_eq!(dev.allocated_bytes(), 0);
        dev.write_at(&[1u8; 10], CHUNK_SIZE - 5, false).unwrap();
        assert_eq!(
            dev.allocated_bytes(),
            2 * PAGE_SIZE,
            "a write across a chunk edge takes two pages"
        );
        dev.write_at(&[0u8; 8192], 0, false).unwrap();
        assert_eq!(
            dev.allocated_bytes(),
            2 * PAGE_SIZE,
            "zeros into holes take no memory"
        );
        dev.trim(CHUNK_SIZE - 5, 5, false).unwrap();
        assert_eq!(
            dev.allocated_bytes(),
            PAGE_SIZE,
            "a partial trim that leaves a page all zero frees it"
        );
        dev.write_zeroes(CHUNK_SIZE, 2, ZeroFlags::default())
            .unwrap();
        assert_eq!(
            dev.allocated_bytes(),
            PAGE_SIZE,
            "zeroing without may_trim keeps the page"
        );
        let mut b = [9u8; 10];
        dev.read_at(&mut b, CHUNK_SIZE - 5).unwrap();
        assert_eq!(b, [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]);
        dev.trim(0, dev.size(), false).unwrap();
        assert_eq!(dev.allocated_bytes(), 0);
        assert!(
            dev.shards
                .iter()
                .all(|s| s.0.read().unwrap().chunks.is_empty()),
            "empty chunks are dropped"
        );
    }

    #[test]
    fn block_status_of_a_huge_sparse_device_is_cheap_and_exact() {
        let size = 64u64 << 40; // 64 TiB
        let dev = MemoryDev::new(size);
        let at = 40u64 << 40;
        dev.write_at(&[7u8; 4096], at, false).unwrap();
        let mut out = Vec::new();
        dev.block_status(0, size, &mut out).unwrap();
        assert_eq!(
            out,
            vec![
                Extent {
                    len: at,
                    hole: true,
                    zero: true
                },
                Extent {
                    len: 4096,
                    hole: false,
                    zero: false
                },
                Extent {
                    len: size - at - 4096,
                    hole: true,
                    zero: true
                },
            ]
        );
        let mut holes = Vec::new();
        let mut buf = vec![1u8; 3 * 4096];
        dev.read_at_sparse(&mut buf, at - 4096, &mut holes).unwrap();
        assert_eq!(
            holes,
            vec![
                Hole {
                    start: 0,
                    len: 4096
                },
                Hole {
                    start: 8192,
                    len: 4096
                }
            ]
        );
        dev.trim(0, size, false).unwrap();
        assert_eq!(dev.allocated_bytes(), 0);
    }

    #[test]
    fn is_zero_sees_a_single_bit() {
        for len in [0usize, 1, 63, 64, 65, 4096] {
            let mut v = vec![0u8; len];
            assert!(is_zero(&v));
            for i in 0..len {
                v[i] = 0x10;
                assert!(!is_zero(&v), "len {len} byte {i}");
                v[i] = 0;
            }
        }
    }
}
