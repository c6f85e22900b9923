//! The shared read cache: one bounded RAM cache in front of the store's layer files, shared
//! by every session of the server, so that when many targets read the same blocks the
//! store is read about once.
//!
//! ```text
//!   session ─▶ CachedLayer(v3) ─miss─▶ Qcow2Image(v3 file) ─unallocated─▶ CachedLayer(v2) ─▶ …
//!                    │                                                        │
//!                    └──────────────── ReadCache (blocks keyed by file) ──────┘
//! ```
//!
//! Every layer of a chain is wrapped, as it is opened, in a [`CachedLayer`] (through the
//! store's layer hook), a [`Filter`](vdstream_blockdev::Filter) that changes reads only. A
//! layer's blocks are keyed by the layer file's identity (device, inode, size, mtime and
//! ctime at open) and the block's offset, so sessions on one version share blocks, and a
//! newer version, missing in its own file, falls through to the cached blocks of the
//! layers it shares with older ones. The cache itself is `quick_cache`'s concurrent cache
//! (CLOCK-Pro eviction, weighted by bytes, single flight through its placeholder guards).
//!
//! Invariants:
//! - The bytes cached for a key are the bytes the layer read for that block, with the holes
//!   it reported (so sparse reads through the cache report them too); a layer file is
//!   immutable while any session holds it (shared `flock`; writers take it exclusive), and
//!   a file changed or replaced between sessions gets another key (its ctime, or inode,
//!   differs), so the cache never returns bytes the layer would not.
//! - Bytes held stay at or below the capacity.
//! - Concurrent readers of one missing block wait for the first one's read (single flight);
//!   if that read fails, the next waiter reads for itself.
//! - A block is [`BLOCK`] bytes, aligned, shorter only at the end of a layer.
//!
//! Counting: every read that misses the cache is charged to the session running it (a
//! thread-local set by the session's device) and to the server's totals, as the bytes the
//! layer supplied from its own file: the bytes it asked of the layer below (itself wrapped,
//! and so counted there) are subtracted. Both are [`StoreReads`], so this module needs
//! nothing of the server's state.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use quick_cache::sync::{Cache, GuardResult};
use vdstream_blockdev::{BatchOp, BlockDev, Hole, Result};

/// Bytes per cached block (the qcow2 cluster size the store writes).
pub const BLOCK: usize = 64 << 10;
/// Independent parts of the cache, each with its own lock and its share of the capacity.
pub const SHARDS: usize = 16;

/// Where store reads are charged: the server's totals, and the session running the read.
pub trait StoreReads: Send + Sync {
    /// One read of `bytes` from the store's files.
    fn charge(&self, bytes: u64);
}

/// Server-wide figures of the cache.
#[derive(Debug, Default)]
pub struct CacheFigures {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    /// Misses that waited for another reader's load of the same block.
    pub shared_loads: AtomicU64,
    pub evictions: Arc<AtomicU64>,
}

/// A snapshot of [`CacheFigures`] and the bytes held.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CacheSnapshot {
    pub capacity: u64,
    pub used: u64,
    pub hits: u64,
    pub misses: u64,
    pub shared_loads: u64,
    pub evictions: u64,
}

type Key = (u64, u64); // (file id, block index)

/// One cached block: its bytes and the holes the layer reported in it.
#[derive(Debug)]
struct Block {
    data: Vec<u8>,
    holes: Vec<Hole>,
}

/// Blocks weigh their bytes; evictions are counted into [`CacheFigures::evictions`].
#[derive(Debug, Clone)]
struct Policy(Arc<AtomicU64>);

impl quick_cache::Weighter<Key, Arc<Block>> for Policy {
    fn weight(&self, _: &Key, block: &Arc<Block>) -> u64 {
        block.data.len() as u64
    }
}

impl quick_cache::Lifecycle<Key, Arc<Block>> for Policy {
    type RequestState = ();
    fn begin_request(&self) {}
    fn on_evict(&self, _: &mut (), _: Key, _: Arc<Block>) {
        self.0.fetch_add(1, Relaxed);
    }
}

type Blocks = Cache<Key, Arc<Block>, Policy, std::collections::hash_map::RandomState, Policy>;

/// The identity of a layer file at open: changed or replaced files get a new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct FileIdentity {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

/// The cache. `capacity` 0 keeps nothing (every read goes to the files; counting still works).
pub struct ReadCache {
    capacity: u64,
    blocks: Blocks,
    files: Mutex<HashMap<FileIdentity, u64>>,
    pub figures: CacheFigures,
    /// Server-wide store reads are charged here.
    totals: Arc<dyn StoreReads>,
}

impl std::fmt::Debug for ReadCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadCache")
            .field("capacity", &self.capacity)
            .field("used", &self.used())
            .finish_non_exhaustive()
    }
}

thread_local! {
    /// The session whose request this thread runs (set by the session's device).
    static SESSION: RefCell<Option<Arc<dyn StoreReads>>> = const { RefCell::new(None) };
    /// Bytes asked of wrapped layers below since the innermost miss began.
    static BELOW: Cell<u64> = const { Cell::new(0) };
}

/// Charges the store reads of everything run inside `f` on this thread to `session`.
pub fn with_session<T>(session: Arc<dyn StoreReads>, f: impl FnOnce() -> T) -> T {
    let prev = SESSION.with(|s| s.replace(Some(session)));
    let out = f();
    SESSION.with(|s| *s.borrow_mut() = prev);
    out
}

impl ReadCache {
    pub fn new(capacity: u64, totals: Arc<dyn StoreReads>) -> Arc<ReadCache> {
        let figures = CacheFigures::default();
        // A multiple of the shard count, so that the shards' shares add up to no more.
        let options = quick_cache::OptionsBuilder::new()
            .shards(SHARDS)
            .weight_capacity(capacity / SHARDS as u64 * SHARDS as u64)
            .estimated_items_capacity((capacity / BLOCK as u64).max(1) as usize)
            .build()
            .expect("every option is set");
        let policy = Policy(figures.evictions.clone());
        let blocks = Cache::with_options(options, policy.clone(), Default::default(), policy);
        Arc::new(ReadCache {
            capacity,
            blocks,
            files: Mutex::new(HashMap::new()),
            figures,
            totals,
        })
    }

    /// Whether anything is kept: each shard must hold at least one block.
    pub fn enabled(&self) -> bool {
        self.blocks.shard_capacity() >= BLOCK as u64
    }

    /// Bytes held now.
    pub fn used(&self) -> u64 {
        self.blocks.weight()
    }

    pub fn snapshot(&self) -> CacheSnapshot {
        CacheSnapshot {
            capacity: self.capacity,
            used: self.used(),
            hits: self.figures.hits.load(Relaxed),
            misses: self.figures.misses.load(Relaxed),
            shared_loads: self.figures.shared_loads.load(Relaxed),
            evictions: self.figures.evictions.load(Relaxed),
        }
    }

    /// Wraps a layer device opened from `path` (the store's layer hook). A file whose
    /// identity cannot be read is still counted, but never cached.
    pub fn wrap(self: &Arc<Self>, path: &Path, dev: Arc<dyn BlockDev>) -> Arc<dyn BlockDev> {
        let file = self.file_id(path);
        Arc::new(CachedLayer {
            inner: dev,
            file,
            cache: self.clone(),
        })
    }

    fn file_id(&self, path: &Path) -> Option<u64> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path).ok()?;
        let id = FileIdentity {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
            ctime_ns: m.ctime() as i128 * 1_000_000_000 + m.ctime_nsec() as i128,
        };
        let mut files = self
            .files
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let next = files.len() as u64 + 1;
        Some(*files.entry(id).or_insert(next))
    }

    /// The block `key`, loaded by `load` on a miss (once, however many readers wait).
    fn get(&self, key: Key, load: impl Fn() -> Result<Block>) -> Result<Arc<Block>> {
        let f = &self.figures;
        if let Some(block) = self.blocks.get(&key) {
            f.hits.fetch_add(1, Relaxed);
            return Ok(block);
        }
        match self.blocks.get_value_or_guard(&key, None) {
            GuardResult::Value(block) => {
                // Another reader loaded it while this one waited.
                f.shared_loads.fetch_add(1, Relaxed);
                f.hits.fetch_add(1, Relaxed);
                Ok(block)
            }
            GuardResult::Guard(guard) => {
                f.misses.fetch_add(1, Relaxed);
                // A failed load drops the guard: the next waiter loads for itself.
                let block = Arc::new(load()?);
                let _ = guard.insert(block.clone());
                Ok(block)
            }
            GuardResult::Timeout => unreachable!("no timeout was given"),
        }
    }

    fn charge(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        self.totals.charge(bytes);
        SESSION.with(|s| {
            if let Some(s) = &*s.borrow() {
                s.charge(bytes);
            }
        });
    }
}

/// One layer of a chain, read through the shared cache. Reads only; everything else goes
/// to the layer (which is read-only and refuses).
#[derive(Debug)]
pub struct CachedLayer {
    inner: Arc<dyn BlockDev>,
    /// `None`: not cacheable (identity unknown), counted only.
    file: Option<u64>,
    cache: Arc<ReadCache>,
}

impl CachedLayer {
    /// Reads `buf.len()` bytes at `offset` from the layer itself, charging what its own
    /// file supplied.
    fn read_inner(&self, buf: &mut [u8], offset: u64, holes: &mut Vec<Hole>) -> Result<()> {
        let outer = BELOW.with(|b| b.replace(0));
        let r = self.inner.read_at_sparse(buf, offset, holes);
        let below = BELOW.with(|b| b.replace(outer));
        self.cache.charge((buf.len() as u64).saturating_sub(below));
        r
    }

    /// Fills `buf` from `offset` block by block through the cache, appending its holes.
    fn read(&self, buf: &mut [u8], offset: u64, holes: &mut Vec<Hole>) -> Result<()> {
        // Tell the layer above (if it is reading through us) that these bytes came from below.
        BELOW.with(|b| b.set(b.get() + buf.len() as u64));
        let size = self.inner.size();
        let Some(file) = self.file.filter(|_| self.cache.enabled()) else {
            return self.read_inner(buf, offset, holes);
        };
        vdstream_blockdev::check_range(
            size,
            vdstream_blockdev::Op::Read,
            offset,
            buf.len() as u64,
            &|| self.inner.describe(),
        )?;
        let mut done = 0usize;
        while done < buf.len() {
            let at = offset + done as u64;
            let index = at / BLOCK as u64;
            let start = index * BLOCK as u64;
            let len = (size - start).min(BLOCK as u64) as usize;
            let block = self.cache.get((file, index), || {
                let mut block = Block {
                    data: vec![0u8; len],
                    holes: Vec::new(),
                };
                self.read_inner(&mut block.data, start, &mut block.holes)?;
                Ok(block)
            })?;
            let from = (at - start) as usize;
            let n = (len - from).min(buf.len() - done);
            buf[done..done + n].copy_from_slice(&block.data[from..from + n]);
            for h in &block.holes {
                let (s, e) = (h.start.max(from), (h.start + h.len).min(from + n));
                if s >= e {
                    continue;
                }
                let start = done + s - from;
                match holes.last_mut() {
                    Some(last) if last.start + last.len == start => last.len += e - s,
                    _ => holes.push(Hole { start, len: e - s }),
                }
            }
            done += n;
        }
        Ok(())
    }
}

/// Reads go through the cache; everything else passes to the layer.
impl vdstream_blockdev::Filter for CachedLayer {
    type Inner = dyn BlockDev;

    fn inner(&self) -> &Self::Inner {
        &*self.inner
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.read(buf, offset, &mut Vec::new())
    }

    fn read_at_sparse(&self, buf: &mut [u8], offset: u64, holes: &mut Vec<Hole>) -> Result<()> {
        self.read(buf, offset, holes)
    }

    /// One op at a time through the cache (a layer below that batches would pass it by).
    fn io_batch(&self, ops: &mut [BatchOp<'_>]) {
        ops.iter_mut().for_each(|op| op.run_alone(self));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use vdstream_blockdev::conformance::{self, check_holes};
    use vdstream_blockdev::MemoryDev;

    /// Store reads charged, as the server's totals count them.
    #[derive(Debug, Default)]
    struct Charged(AtomicU64);

    impl StoreReads for Charged {
        fn charge(&self, bytes: u64) {
            self.0.fetch_add(bytes, Relaxed);
        }
    }

    /// A memory device that counts the bytes read from it.
    #[derive(Debug)]
    struct Counting {
        inner: MemoryDev,
        bytes: AtomicU64,
    }

    impl vdstream_blockdev::Filter for Counting {
        type Inner = MemoryDev;
        fn inner(&self) -> &MemoryDev {
            &self.inner
        }
        fn read_at_sparse(&self, buf: &mut [u8], offset: u64, holes: &mut Vec<Hole>) -> Result<()> {
            self.bytes.fetch_add(buf.len() as u64, Relaxed);
            std::thread::sleep(std::time::Duration::from_micros(200));
            self.inner.read_at_sparse(buf, offset, holes)
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
            BlockDev::read_at_sparse(self, buf, offset, &mut Vec::new())
        }
    }

    /// A device of `size` bytes holding a pattern, with a 40 KiB hole every 120 KiB (so
    /// holes start and end inside blocks).
    fn patterned(size: u64, seed: u8) -> Arc<Counting> {
        let dev = MemoryDev::new(size);
        let data: Vec<u8> = (0..size)
            .map(|i| {
                (i as u8)
                    .wrapping_mul(31)
                    .wrapping_add(seed)
                    .wrapping_add((i >> 12) as u8)
                    | 1
            })
            .collect();
        for (i, chunk) in data
            .chunks(40 << 10)
            .enumerate()
            .filter(|(i, _)| i % 3 != 1)
        {
            dev.write_at(chunk, (i as u64) * (40 << 10), false).unwrap();
        }
        Arc::new(Counting {
            inner: dev,
            bytes: AtomicU64::new(0),
        })
    }

    fn layer(cache: &Arc<ReadCache>, file: u64, dev: Arc<dyn BlockDev>) -> CachedLayer {
        CachedLayer {
            inner: dev,
            file: Some(file),
            cache: cache.clone(),
        }
    }

    /// Which bytes of a `len`-byte buffer `holes` cover.
    fn covered(len: usize, holes: &[Hole]) -> Vec<bool> {
        let mut map = vec![false; len];
        holes
            .iter()
            .for_each(|h| map[h.start..h.start + h.len].fill(true));
        map
    }

    #[test]
    fn many_readers_of_one_region_read_the_store_once() {
        let totals = Arc::new(Charged::default());
        let cache = ReadCache::new(64 << 20, totals.clone());
        let base = patterned(8 << 20, 1);
        let l = Arc::new(layer(&cache, 1, base.clone()));
        std::thread::scope(|s| {
            for _ in 0..8 {
                let l = l.clone();
                s.spawn(move || {
                    let mut buf = vec![0u8; 1 << 20];
                    for i in 0..4 {
                        l.read_at(&mut buf, i << 20).unwrap();
                    }
                });
            }
        });
        assert_eq!(base.bytes.load(Relaxed), 4 << 20, "each block read once");
        assert_eq!(totals.0.load(Relaxed), 4 << 20);
        let s = cache.snapshot();
        assert_eq!((s.misses, s.hits), (64, 8 * 64 - 64), "{s:?}");
    }

    #[test]
    fn a_layer_above_is_charged_only_for_its_own_bytes() {
        /// A "version" that holds nothing itself: every byte comes from the base.
        #[derive(Debug)]
        struct PassThrough(Arc<dyn BlockDev>);
        impl vdstream_blockdev::Filter for PassThrough {
            type Inner = dyn BlockDev;
            fn inner(&self) -> &Self::Inner {
                &*self.0
            }
        }
        let totals = Arc::new(Charged::default());
        let cache = ReadCache::new(64 << 20, totals.clone());
        let base = patterned(4 << 20, 2);
        let base_layer: Arc<dyn BlockDev> = Arc::new(layer(&cache, 1, base.clone()));
        let v1 = layer(&cache, 2, Arc::new(PassThrough(base_layer.clone())));
        let v2 = layer(&cache, 3, Arc::new(PassThrough(base_layer)));
        let mut buf = vec![0u8; 1 << 20];
        v1.read_at(&mut buf, 0).unwrap();
        v2.read_at(&mut buf, 0).unwrap();
        assert_eq!(
            base.bytes.load(Relaxed),
            1 << 20,
            "versions sharing a base share its blocks"
        );
        assert_eq!(
            totals.0.load(Relaxed),
            1 << 20,
            "the versions supplied nothing of their own"
        );
    }

    #[test]
    fn sparse_reads_report_the_layers_holes_from_the_cache_too() {
        let cache = ReadCache::new(64 << 20, Arc::new(Charged::default()));
        let base = patterned(1 << 20, 3);
        let l = layer(&cache, 1, base.clone());
        let (mut want, mut want_holes) = (vec![0u8; 300 << 10], Vec::new());
        base.inner
            .read_at_sparse(&mut want, 10_000, &mut want_holes)
            .unwrap();
        assert!(!want_holes.is_empty());
        for round in ["miss", "hit"] {
            let (mut got, mut holes) = (vec![0u8; 300 << 10], Vec::new());
            l.read_at_sparse(&mut got, 10_000, &mut holes).unwrap();
            assert!(got == want, "{round}: bytes");
            assert_eq!(holes, want_holes, "{round}: holes");
        }
        assert_eq!(
            cache.snapshot().hits,
            5,
            "the second read came from the cache"
        );
    }

    #[test]
    fn a_cached_layer_passes_the_conformance_suite() {
        // Small enough that the suite's reads evict.
        let cache = ReadCache::new(2 << 20, Arc::new(Charged::default()));
        let dir = tempfile::tempdir().unwrap();
        let n = AtomicU64::new(0);
        conformance::run_read_only("CachedLayer(FileDev)", &|content| {
            let path = dir.path().join(format!("layer{}", n.fetch_add(1, Relaxed)));
            std::fs::write(&path, content).unwrap();
            let dev = vdstream_blockdev::FileDev::open(
                &path,
                vdstream_blockdev::FileOptions {
                    read_only: true,
                    direct: false,
                },
            )
            .unwrap();
            cache.wrap(&path, Arc::new(dev))
        });
        assert!(
            cache.snapshot().hits > 0 && cache.snapshot().evictions > 0,
            "{:?}",
            cache.snapshot()
        );
    }

    #[derive(Debug, Clone)]
    enum Step {
        Read {
            file: usize,
            offset: u64,
            len: usize,
        },
    }

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        prop::collection::vec(
            (0usize..3, 0u64..(1 << 20), 1usize..(200 << 10))
                .prop_map(|(file, offset, len)| Step::Read { file, offset, len }),
            1..60,
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Model: the base device itself. Through the cache, every read returns its bytes and
        /// reports exactly its holes, whatever the capacity.
        #[test]
        fn the_cache_returns_the_layers_bytes_and_holes_and_stays_bounded(capacity_blocks in 0u64..64, steps in steps()) {
            let capacity = capacity_blocks * BLOCK as u64;
            let cache = ReadCache::new(capacity, Arc::new(Charged::default()));
            // Sizes not a multiple of the block: the last block is short.
            let sizes = [(1 << 20) + 4096 + 17, (1 << 20) + (300 << 10), 2 << 20];
            let devs: Vec<Arc<Counting>> = sizes.iter().enumerate().map(|(i, &s)| patterned(s, i as u8 * 50)).collect();
            let layers: Vec<CachedLayer> = devs.iter().enumerate().map(|(i, d)| layer(&cache, i as u64 + 1, d.clone())).collect();
            for Step::Read { file, offset, len } in steps {
                let size = sizes[file];
                let offset = offset.min(size - 1);
                let len = len.min((size - offset) as usize);
                let (mut got, mut holes) = (vec![0u8; len], Vec::new());
                let (mut want, mut want_holes) = (vec![0u8; len], Vec::new());
                layers[file].read_at_sparse(&mut got, offset, &mut holes).unwrap();
                devs[file].inner.read_at_sparse(&mut want, offset, &mut want_holes).unwrap();
                prop_assert!(got == want, "file {} offset {} len {}", file, offset, len);
                prop_assert_eq!(check_holes(&got, &holes, "through the cache"), Ok(()));
                prop_assert!(covered(len, &holes) == covered(len, &want_holes), "holes {:?} want {:?}", holes, want_holes);
                prop_assert!(cache.used() <= capacity, "used {} > capacity {}", cache.used(), capacity);
            }
            let mut past = vec![0u8; 10];
            prop_assert!(layers[0].read_at(&mut past, sizes[0] - 5).is_err());
        }
    }
}
