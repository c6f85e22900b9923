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
//! store's layer hook). A layer's blocks are keyed by the layer file's identity (device,
//! inode, size, mtime and ctime at open) and the block's offset, so sessions on one version
//! share blocks, and a newer version, missing in its own file, falls through to the cached
//! blocks of the layers it shares with older ones.
//!
//! Invariants:
//! - The bytes cached for a key are the bytes the layer read for that block; a layer file
//!   is immutable while any session holds it (shared `flock`; writers take it exclusive),
//!   and a file changed or replaced between sessions gets another key (its ctime, or inode,
//!   differs), so the cache never returns bytes the layer would not.
//! - Bytes held stay at or below the capacity (each of [`SHARDS`] shards keeps its share).
//! - Eviction is least recently used, per shard.
//! - Concurrent readers of one missing block wait for the first one's read (single flight);
//!   if that read fails, each reads for itself.
//! - A block is [`BLOCK`] bytes, aligned, shorter only at the end of a layer.
//!
//! Counting: every read that misses the cache is charged to the session running it (a
//! thread-local set by the session's device) and to the server's totals, as the bytes the
//! layer supplied from its own file: the bytes it asked of the layer below (itself wrapped,
//! and so counted there) are subtracted.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};

use vdstream_blockdev::{BlockDev, Caps, Extent, Result, ZeroFlags};

use crate::state::{Counters, Session};

/// Bytes per cached block (the qcow2 cluster size the store writes).
pub const BLOCK: usize = 64 << 10;
/// Independent LRU lists, each with its own lock and its share of the capacity.
pub const SHARDS: usize = 16;

/// Server-wide figures of the cache.
#[derive(Debug, Default)]
pub struct CacheFigures {
    pub hits: std::sync::atomic::AtomicU64,
    pub misses: std::sync::atomic::AtomicU64,
    /// Misses that waited for another reader's load of the same block.
    pub shared_loads: std::sync::atomic::AtomicU64,
    pub evictions: std::sync::atomic::AtomicU64,
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

struct Flight {
    done: Mutex<Option<Option<Arc<[u8]>>>>,
    cv: Condvar,
}

enum Slot {
    Ready { data: Arc<[u8]>, tick: u64 },
    Loading(Arc<Flight>),
}

#[derive(Default)]
struct Shard {
    map: HashMap<Key, Slot>,
    /// Ready blocks by last use, oldest first.
    lru: BTreeMap<u64, Key>,
    used: u64,
    tick: u64,
}

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
    shards: Vec<Mutex<Shard>>,
    files: Mutex<HashMap<FileIdentity, u64>>,
    pub figures: CacheFigures,
    /// Server-wide guest and store counters (store reads are charged here).
    totals: Arc<Counters>,
}

impl std::fmt::Debug for ReadCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadCache").field("capacity", &self.capacity).field("used", &self.used()).finish_non_exhaustive()
    }
}

thread_local! {
    /// The session whose request this thread runs (set by the session's device).
    static SESSION: RefCell<Option<Arc<Session>>> = const { RefCell::new(None) };
    /// Bytes asked of wrapped layers below since the innermost miss began.
    static BELOW: Cell<u64> = const { Cell::new(0) };
}

/// Charges the store reads of everything run inside `f` on this thread to `session`.
pub fn with_session<T>(session: &Arc<Session>, f: impl FnOnce() -> T) -> T {
    let prev = SESSION.with(|s| s.replace(Some(session.clone())));
    let out = f();
    SESSION.with(|s| *s.borrow_mut() = prev);
    out
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl ReadCache {
    pub fn new(capacity: u64, totals: Arc<Counters>) -> Arc<ReadCache> {
        Arc::new(ReadCache {
            capacity,
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            files: Mutex::new(HashMap::new()),
            figures: CacheFigures::default(),
            totals,
        })
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Whether anything is kept: each shard must hold at least one block.
    pub fn enabled(&self) -> bool {
        self.capacity / SHARDS as u64 >= BLOCK as u64
    }

    /// Bytes held now.
    pub fn used(&self) -> u64 {
        self.shards.iter().map(|s| lock(s).used).sum()
    }

    pub fn snapshot(&self) -> CacheSnapshot {
        use std::sync::atomic::Ordering::Relaxed;
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
        Arc::new(CachedLayer { inner: dev, file, cache: self.clone() })
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
        let mut files = lock(&self.files);
        let next = files.len() as u64 + 1;
        Some(*files.entry(id).or_insert(next))
    }

    fn shard(&self, key: Key) -> &Mutex<Shard> {
        // Consecutive blocks of one file land on different shards.
        let h = key.1.wrapping_add(key.0.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        &self.shards[(h % SHARDS as u64) as usize]
    }

    /// The block `key`, loaded by `load` on a miss (once, however many readers wait).
    fn get(&self, key: Key, load: impl Fn() -> Result<Arc<[u8]>>) -> Result<Arc<[u8]>> {
        use std::sync::atomic::Ordering::Relaxed;
        let shard_cap = self.capacity / SHARDS as u64;
        if !self.enabled() {
            self.figures.misses.fetch_add(1, Relaxed);
            return load();
        }
        let shard = self.shard(key);
        let flight = {
            let mut s = lock(shard);
            s.tick += 1;
            let tick = s.tick;
            match s.map.get_mut(&key) {
                Some(Slot::Ready { data, tick: t }) => {
                    let data = data.clone();
                    let old = std::mem::replace(t, tick);
                    s.lru.remove(&old);
                    s.lru.insert(tick, key);
                    self.figures.hits.fetch_add(1, Relaxed);
                    return Ok(data);
                }
                Some(Slot::Loading(f)) => Some(f.clone()),
                None => {
                    s.map.insert(key, Slot::Loading(Arc::new(Flight { done: Mutex::new(None), cv: Condvar::new() })));
                    None
                }
            }
        };
        if let Some(f) = flight {
            // Someone else is reading this block: wait for it.
            let mut done = lock(&f.done);
            while done.is_none() {
                done = f.cv.wait(done).unwrap_or_else(std::sync::PoisonError::into_inner);
            }
            if let Some(Some(data)) = &*done {
                self.figures.shared_loads.fetch_add(1, Relaxed);
                self.figures.hits.fetch_add(1, Relaxed);
                return Ok(data.clone());
            }
            drop(done);
            self.figures.misses.fetch_add(1, Relaxed);
            return load();
        }
        self.figures.misses.fetch_add(1, Relaxed);
        let loaded = load();
        let mut s = lock(shard);
        let Some(Slot::Loading(f)) = s.map.remove(&key) else { unreachable!("only the loader removes a loading slot") };
        if let Ok(data) = &loaded {
            s.tick += 1;
            let tick = s.tick;
            s.used += data.len() as u64;
            s.map.insert(key, Slot::Ready { data: data.clone(), tick });
            s.lru.insert(tick, key);
            while s.used > shard_cap {
                let Some((_, old)) = s.lru.pop_first() else { break };
                if let Some(Slot::Ready { data, .. }) = s.map.remove(&old) {
                    s.used -= data.len() as u64;
                    self.figures.evictions.fetch_add(1, Relaxed);
                }
            }
        }
        drop(s);
        *lock(&f.done) = Some(loaded.as_ref().ok().cloned());
        f.cv.notify_all();
        loaded
    }

    fn charge(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        Counters::add(&self.totals.store_read_ops, 1);
        Counters::add(&self.totals.store_read_bytes, bytes);
        SESSION.with(|s| {
            if let Some(s) = &*s.borrow() {
                Counters::add(&s.counters.store_read_ops, 1);
                Counters::add(&s.counters.store_read_bytes, bytes);
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
    fn read_inner(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let outer = BELOW.with(|b| b.replace(0));
        let r = self.inner.read_at(buf, offset);
        let below = BELOW.with(|b| b.replace(outer));
        self.cache.charge((buf.len() as u64).saturating_sub(below));
        r
    }
}

impl BlockDev for CachedLayer {
    fn size(&self) -> u64 {
        self.inner.size()
    }

    fn caps(&self) -> Caps {
        self.inner.caps()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        // Tell the layer above (if it is reading through us) that these bytes came from below.
        BELOW.with(|b| b.set(b.get() + buf.len() as u64));
        let size = self.inner.size();
        let Some(file) = self.file else { return self.read_inner(buf, offset) };
        if !self.cache.enabled() {
            return self.read_inner(buf, offset);
        }
        vdstream_blockdev::check_range(size, vdstream_blockdev::Op::Read, offset, buf.len() as u64, &|| self.inner.describe())?;
        let mut done = 0usize;
        while done < buf.len() {
            let at = offset + done as u64;
            let index = at / BLOCK as u64;
            let start = index * BLOCK as u64;
            let len = (size - start).min(BLOCK as u64) as usize;
            let block = self.cache.get((file, index), || {
                let mut data = vec![0u8; len];
                self.read_inner(&mut data, start)?;
                Ok(Arc::from(data))
            })?;
            let from = (at - start) as usize;
            let n = (len - from).min(buf.len() - done);
            buf[done..done + n].copy_from_slice(&block[from..from + n]);
            done += n;
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.inner.write_at(buf, offset, fua)
    }

    fn flush(&self) -> Result<()> {
        self.inner.flush()
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.inner.trim(offset, len, fua)
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.inner.write_zeroes(offset, len, flags)
    }

    fn block_status(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        self.inner.block_status(offset, len, out)
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use vdstream_blockdev::MemoryDev;

    /// A device that counts the bytes read from it.
    #[derive(Debug)]
    struct Counting {
        inner: MemoryDev,
        bytes: AtomicU64,
    }

    impl BlockDev for Counting {
        fn size(&self) -> u64 {
            self.inner.size()
        }
        fn caps(&self) -> Caps {
            Caps::default()
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
            self.bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
            std::thread::sleep(std::time::Duration::from_micros(200));
            self.inner.read_at(buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
            self.inner.write_at(buf, offset, fua)
        }
        fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
            self.inner.trim(offset, len, fua)
        }
        fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
            self.inner.write_zeroes(offset, len, flags)
        }
        fn describe(&self) -> String {
            "counting".into()
        }
    }

    fn patterned(size: u64, seed: u8) -> Arc<Counting> {
        let dev = MemoryDev::new(size);
        let data: Vec<u8> = (0..size).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed).wrapping_add((i >> 12) as u8)).collect();
        dev.write_at(&data, 0, false).unwrap();
        Arc::new(Counting { inner: dev, bytes: AtomicU64::new(0) })
    }

    fn layer(cache: &Arc<ReadCache>, file: u64, dev: Arc<dyn BlockDev>) -> CachedLayer {
        CachedLayer { inner: dev, file: Some(file), cache: cache.clone() }
    }

    #[test]
    fn many_readers_of_one_region_read_the_store_once() {
        let totals = Arc::new(Counters::default());
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
        assert_eq!(base.bytes.load(Ordering::Relaxed), 4 << 20, "each block read once");
        assert_eq!(totals.snapshot().store_read_bytes, 4 << 20);
    }

    #[test]
    fn a_layer_above_is_charged_only_for_its_own_bytes() {
        // A "version" that holds nothing itself: every byte comes from the base.
        #[derive(Debug)]
        struct PassThrough(Arc<dyn BlockDev>);
        impl BlockDev for PassThrough {
            fn size(&self) -> u64 {
                self.0.size()
            }
            fn caps(&self) -> Caps {
                Caps::default()
            }
            fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
                self.0.read_at(buf, offset)
            }
            fn write_at(&self, b: &[u8], o: u64, f: bool) -> Result<()> {
                self.0.write_at(b, o, f)
            }
            fn trim(&self, o: u64, l: u64, f: bool) -> Result<()> {
                self.0.trim(o, l, f)
            }
            fn write_zeroes(&self, o: u64, l: u64, f: ZeroFlags) -> Result<()> {
                self.0.write_zeroes(o, l, f)
            }
            fn describe(&self) -> String {
                "pass".into()
            }
        }
        let totals = Arc::new(Counters::default());
        let cache = ReadCache::new(64 << 20, totals.clone());
        let base = patterned(4 << 20, 2);
        let base_layer: Arc<dyn BlockDev> = Arc::new(layer(&cache, 1, base.clone()));
        let v1 = layer(&cache, 2, Arc::new(PassThrough(base_layer.clone())));
        let v2 = layer(&cache, 3, Arc::new(PassThrough(base_layer)));
        let mut buf = vec![0u8; 1 << 20];
        v1.read_at(&mut buf, 0).unwrap();
        v2.read_at(&mut buf, 0).unwrap();
        assert_eq!(base.bytes.load(Ordering::Relaxed), 1 << 20, "versions sharing a base share its blocks");
        assert_eq!(totals.snapshot().store_read_bytes, 1 << 20, "the versions supplied nothing of their own");
    }

    #[derive(Debug, Clone)]
    enum Step {
        Read { file: usize, offset: u64, len: usize },
    }

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        prop::collection::vec(
            (0usize..3, 0u64..(1 << 20), 1usize..(200 << 10)).prop_map(|(file, offset, len)| Step::Read { file, offset, len }),
            1..60,
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn the_cache_returns_the_layers_bytes_and_stays_bounded(capacity_blocks in 0u64..64, steps in steps()) {
            let capacity = capacity_blocks * BLOCK as u64;
            let cache = ReadCache::new(capacity, Arc::new(Counters::default()));
            // Sizes not a multiple of the block: the last block is short.
            let sizes = [(1 << 20) + 4096 + 17, (1 << 20) + (300 << 10), 2 << 20];
            let devs: Vec<Arc<Counting>> = sizes.iter().enumerate().map(|(i, &s)| patterned(s, i as u8 * 50)).collect();
            let layers: Vec<CachedLayer> = devs.iter().enumerate().map(|(i, d)| layer(&cache, i as u64 + 1, d.clone())).collect();
            for Step::Read { file, offset, len } in steps {
                let size = sizes[file];
                let offset = offset.min(size - 1);
                let len = len.min((size - offset) as usize);
                let mut got = vec![0u8; len];
                let mut want = vec![0u8; len];
                layers[file].read_at(&mut got, offset).unwrap();
                devs[file].inner.read_at(&mut want, offset).unwrap();
                prop_assert!(got == want, "file {} offset {} len {}", file, offset, len);
                prop_assert!(cache.used() <= capacity, "used {} > capacity {}", cache.used(), capacity);
            }
            let mut past = vec![0u8; 10];
            prop_assert!(layers[0].read_at(&mut past, sizes[0] - 5).is_err());
        }
    }
}
