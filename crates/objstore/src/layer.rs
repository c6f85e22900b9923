//! A layer in object storage: one object of its non-zero 1 MiB chunks, packed in order,
//! and an index object beside it.
//!
//! ```text
//! PREFIX/vdisks/NAME/FILE.idx        {"format":"vdstream-layer/1","object":"FILE.TOKEN",
//!                                     "len":…,"chunk":1048576,"chunks":[crc32c | null, …]}
//!                                     null: all zeros, not stored
//! PREFIX/vdisks/NAME/FILE.TOKEN      the layer's chunks that are not all zeros, in order
//! ```
//!
//! The data object is never written twice: each upload of a layer gets a new TOKEN, and
//! the index, written after the object is complete, names it. A server that opened the
//! layer before a new upload keeps reading the object its index named, and the chunk
//! cache keys chunks by that object, so an old chunk is never taken for a new one.
//!
//! Chunk `i` of the layer is bytes `i*chunk .. min(len, (i+1)*chunk)`; its place in the
//! object is the number of stored chunks before it, times `chunk`. A raw base of 64 GiB
//! with 3 GiB written is a 3 GiB object. A qcow2 layer is stored as its file is, so a
//! downloaded layer is again the file `qemu-img` reads.
//!
//! Every chunk read from the store is checked against its CRC-32C before it is served or
//! cached; a chunk that fails twice is an I/O error naming the object, never data.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::client::Bucket;
use crate::error::{Error, Result};

/// The unit of storage, checksums, caching and read-ahead: Garage's block size, so that a
/// chunk is one block on the store's disks.
pub const CHUNK: u64 = 1 << 20;

pub const INDEX_FORMAT: &str = "vdstream-layer/1";

/// The largest index read (a 64 MiB index describes a layer of about 6 TiB).
pub const MAX_INDEX: u64 = 64 << 20;

/// The index of a layer object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerIndex {
    pub format: String,
    /// The data object's file name, beside the index (`FILE.TOKEN`).
    pub object: String,
    pub len: u64,
    pub chunk: u64,
    /// Per chunk: the CRC-32C of its bytes, or `None` for a chunk of zeros (not stored).
    pub chunks: Vec<Option<u32>>,
}

impl LayerIndex {
    /// The index of `data` laid out in chunks (tests and small layers).
    pub fn of(data: &[u8]) -> (Self, Vec<u8>) {
        let mut b = IndexBuilder::new("layer.0".into(), data.len() as u64);
        let mut packed = Vec::new();
        for c in data.chunks(CHUNK as usize) {
            if b.push(c) {
                packed.extend_from_slice(c);
            }
        }
        (b.finish(), packed)
    }

    /// Parses and checks an index read from `what`.
    pub fn parse(raw: &[u8], what: &str) -> Result<Self> {
        let idx: LayerIndex = serde_json::from_slice(raw).map_err(|e| {
            Error::Corrupt(format!(
                "{what}: not a layer index ({e}); copy the store again"
            ))
        })?;
        let want = idx.len.div_ceil(idx.chunk.max(1));
        let plain =
            !idx.object.is_empty() && !idx.object.contains('/') && !idx.object.starts_with('.');
        if !plain {
            return Err(Error::Corrupt(format!("{what}: the index names the object {:?}, which is not a plain file name; copy the store again", idx.object)));
        }
        if idx.format != INDEX_FORMAT || idx.chunk != CHUNK || idx.chunks.len() as u64 != want {
            return Err(Error::Corrupt(format!(
                "{what}: index of format {:?}, chunk {}, {} chunks for {} bytes does not fit ({INDEX_FORMAT}, chunk {CHUNK}, {want} chunks); copy the store again",
                idx.format, idx.chunk, idx.chunks.len(), idx.len)));
        }
        Ok(idx)
    }

    /// The store path of the data object this index names, beside the layer `layer_rel`
    /// (`vdisks/NAME/FILE` gives `vdisks/NAME/FILE.TOKEN`).
    pub fn object_rel(&self, layer_rel: &str) -> String {
        match layer_rel.rsplit_once('/') {
            Some((dir, _)) => format!("{dir}/{}", self.object),
            None => self.object.clone(),
        }
    }

    /// Chunk `i` (at `place` in the object, see [`LayerIndex::places`]) from the data
    /// object at `object_rel`, checked against its CRC-32C and
    /// fetched once more when it does not match; a chunk that fails twice is an error
    /// naming the object, never data. `on_get` sees what every GET gave (for counters and
    /// logs). `i` must be a stored chunk.
    pub fn fetch_checked(
        &self,
        bucket: &Bucket,
        object_rel: &str,
        i: u64,
        place: u64,
        mut on_get: impl FnMut(Got<'_>),
    ) -> Result<Bytes> {
        let len = self.chunk_len(i);
        let want = self.chunks[i as usize].expect("stored chunk");
        for attempt in 0..2 {
            let b = bucket
                .get_range(object_rel, place, place + len)
                .inspect_err(|e| on_get(Got::Failed(e)))?;
            if b.len() as u64 == len && crc32c::crc32c(&b) == want {
                on_get(Got::Good(len));
                return Ok(b);
            }
            on_get(Got::Bad(b.len() as u64));
            log::error!(
                "{}: chunk {i} (bytes {place}..{}) fails its checksum (attempt {}); not served",
                bucket.what(object_rel),
                place + len,
                attempt + 1
            );
        }
        Err(Error::Corrupt(format!(
            "{}: chunk {i} fails its CRC-32C twice: the object is damaged in the store; delete its .idx from the bucket and run `vdstream store copy` again from a good copy of the store",
            bucket.what(object_rel)
        )))
    }

    /// Bytes of chunk `i` in the layer.
    pub fn chunk_len(&self, i: u64) -> u64 {
        (self.len - i * self.chunk).min(self.chunk)
    }

    /// Bytes stored in the object (the non-zero chunks).
    pub fn stored_bytes(&self) -> u64 {
        (0..self.chunks.len() as u64)
            .filter(|&i| self.chunks[i as usize].is_some())
            .map(|i| self.chunk_len(i))
            .sum()
    }

    /// Where each stored chunk starts in the object (`None` for zero chunks).
    pub fn places(&self) -> Vec<Option<u64>> {
        let mut at = 0;
        self.chunks
            .iter()
            .enumerate()
            .map(|(i, c)| {
                c.map(|_| {
                    let here = at;
                    at += self.chunk_len(i as u64);
                    here
                })
            })
            .collect()
    }
}

/// What one GET of a chunk gave (see [`LayerIndex::fetch_checked`]).
#[derive(Debug)]
pub enum Got<'a> {
    /// These many bytes, matching the index.
    Good(u64),
    /// These many bytes, failing the chunk's checksum or length.
    Bad(u64),
    /// No answer, or an error.
    Failed(&'a Error),
}

/// Builds an index chunk by chunk.
#[derive(Debug)]
pub struct IndexBuilder {
    object: String,
    len: u64,
    chunks: Vec<Option<u32>>,
}

impl IndexBuilder {
    /// For a layer of `len` bytes stored as the object `object`.
    pub fn new(object: String, len: u64) -> Self {
        IndexBuilder {
            object,
            len,
            chunks: Vec::with_capacity(len.div_ceil(CHUNK) as usize),
        }
    }

    /// Adds the next chunk; true when it is stored (not all zeros).
    pub fn push(&mut self, chunk: &[u8]) -> bool {
        if chunk.iter().all(|&b| b == 0) {
            self.chunks.push(None);
            false
        } else {
            self.chunks.push(Some(crc32c::crc32c(chunk)));
            true
        }
    }

    pub fn finish(self) -> LayerIndex {
        LayerIndex {
            format: INDEX_FORMAT.into(),
            object: self.object,
            len: self.len,
            chunk: CHUNK,
            chunks: self.chunks,
        }
    }
}

/// What the cache and the fetches did, for metrics and the figures.
#[derive(Debug, Default)]
pub struct CacheStats {
    pub gets: AtomicU64,
    pub get_bytes: AtomicU64,
    pub ram_hits: AtomicU64,
    pub disk_hits: AtomicU64,
    pub corrupt: AtomicU64,
    pub failed: AtomicU64,
    pub readahead: AtomicU64,
    /// Reads that found their chunk loaded by another reader's GET while they waited.
    pub shared_waits: AtomicU64,
}

impl CacheStats {
    /// The counters for /metrics: (name, help, value).
    pub fn counters(&self) -> Vec<(&'static str, &'static str, u64)> {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        vec![
            (
                "vdstream_object_gets_total",
                "Chunks fetched from the object store (range GETs).",
                g(&self.gets),
            ),
            (
                "vdstream_object_get_bytes_total",
                "Bytes fetched from the object store.",
                g(&self.get_bytes),
            ),
            (
                "vdstream_object_ram_hits_total",
                "Chunk reads the RAM tier of the chunk cache answered.",
                g(&self.ram_hits),
            ),
            (
                "vdstream_object_disk_hits_total",
                "Chunk reads the SSD tier of the chunk cache answered.",
                g(&self.disk_hits),
            ),
            (
                "vdstream_object_shared_waits_total",
                "Chunk reads that waited for another reader's GET of the same chunk.",
                g(&self.shared_waits),
            ),
            (
                "vdstream_object_readahead_total",
                "Chunks fetched ahead of the reads.",
                g(&self.readahead),
            ),
            (
                "vdstream_object_corrupt_total",
                "Chunks refused for failing their CRC-32C (never served).",
                g(&self.corrupt),
            ),
            (
                "vdstream_object_failed_total",
                "Chunk fetches that failed (timeout, store unreachable).",
                g(&self.failed),
            ),
        ]
    }

    pub fn snapshot(&self) -> serde_json::Value {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        serde_json::json!({
            "gets": g(&self.gets), "get_bytes": g(&self.get_bytes), "ram_hits": g(&self.ram_hits),
            "disk_hits": g(&self.disk_hits), "corrupt": g(&self.corrupt), "failed": g(&self.failed),
            "readahead": g(&self.readahead), "shared_waits": g(&self.shared_waits),
        })
    }
}

type Key = (u32, u64);

#[derive(Clone)]
struct DiskEvict {
    dir: PathBuf,
}

impl quick_cache::Lifecycle<Key, ()> for DiskEvict {
    type RequestState = ();
    fn begin_request(&self) {}
    fn on_evict(&self, _: &mut (), key: Key, _: ()) {
        let _ = std::fs::remove_file(disk_path(&self.dir, key));
    }
}

#[derive(Clone)]
struct ByLen;

impl quick_cache::Weighter<Key, Bytes> for ByLen {
    fn weight(&self, _: &Key, v: &Bytes) -> u64 {
        v.len().max(1) as u64
    }
}

#[derive(Clone)]
struct ChunkWeight;

impl quick_cache::Weighter<Key, ()> for ChunkWeight {
    fn weight(&self, _: &Key, _: &()) -> u64 {
        CHUNK
    }
}

fn disk_path(dir: &Path, (layer, chunk): Key) -> PathBuf {
    dir.join(format!("{layer:08x}"))
        .join(format!("{chunk:010x}"))
}

/// Sizes of the cache a server keeps in front of the object store.
#[derive(Debug, Clone)]
pub struct CacheConfig {
    pub ram_bytes: u64,
    /// The SSD tier: a folder (emptied at start) and its cap; 0 turns it off.
    pub disk_dir: PathBuf,
    pub disk_bytes: u64,
    /// Chunks fetched ahead of a miss, in the same layer.
    pub readahead: u64,
    /// How long a read waits for another reader's GET of the same chunk before it gets
    /// EIO (the object store's request timeout, so a waiter is bounded like a loader).
    pub wait: std::time::Duration,
}

/// Which chunks the SSD folder holds, weighed by size; evicting one removes its file.
type DiskIndex =
    quick_cache::sync::Cache<Key, (), ChunkWeight, quick_cache::DefaultHashBuilder, DiskEvict>;

/// The chunk cache: RAM, then the SSD folder, then one GET per chunk, with concurrent
/// misses of one chunk waiting on the first one's GET (single flight).
pub struct ChunkCache {
    ram: quick_cache::sync::Cache<Key, Bytes, ByLen>,
    disk: Option<(PathBuf, DiskIndex)>,
    readahead: u64,
    wait: std::time::Duration,
    pub stats: CacheStats,
    layers: Mutex<Vec<String>>,
    inflight_ahead: AtomicU64,
}

impl std::fmt::Debug for ChunkCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChunkCache({} B in RAM)", self.ram.weight())
    }
}

impl ChunkCache {
    pub fn new(config: &CacheConfig) -> Result<Arc<Self>> {
        let items = (config.ram_bytes / CHUNK).max(16) as usize;
        let ram =
            quick_cache::sync::Cache::with_weighter(items, config.ram_bytes.max(CHUNK), ByLen);
        let disk = if config.disk_bytes >= CHUNK {
            let dir = config.disk_dir.clone();
            if dir.exists() {
                std::fs::remove_dir_all(&dir)
                    .map_err(crate::error::local("empty the chunk cache folder", &dir))?;
            }
            vdstream_blockdev::storefile::create_dir_all(&dir)
                .map_err(crate::error::local("create the chunk cache folder", &dir))?;
            let n = (config.disk_bytes / CHUNK) as usize;
            let cache = quick_cache::sync::Cache::with(
                n.max(16),
                config.disk_bytes,
                ChunkWeight,
                Default::default(),
                DiskEvict { dir: dir.clone() },
            );
            Some((dir, cache))
        } else {
            None
        };
        Ok(Arc::new(ChunkCache {
            ram,
            disk,
            readahead: config.readahead,
            wait: config.wait,
            stats: CacheStats::default(),
            layers: Mutex::new(Vec::new()),
            inflight_ahead: AtomicU64::new(0),
        }))
    }

    fn layer_id(&self, key: &str) -> u32 {
        let mut l = self.layers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = l.iter().position(|k| k == key) {
            return i as u32;
        }
        l.push(key.to_string());
        (l.len() - 1) as u32
    }

    /// Bytes of RAM the cache holds now.
    pub fn ram_bytes(&self) -> u64 {
        self.ram.weight()
    }
}

/// A layer object opened for reading through the cache.
pub struct ObjectLayer {
    bucket: Arc<Bucket>,
    rel: String,
    index: LayerIndex,
    places: Vec<Option<u64>>,
    id: u32,
    cache: Arc<ChunkCache>,
    /// Itself, for read-ahead tasks started from `&self` reads.
    me: Weak<ObjectLayer>,
}

impl std::fmt::Debug for ObjectLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.bucket.what(&self.rel))
    }
}

impl ObjectLayer {
    /// Opens the layer at `rel` (its index is `rel.idx`); `None` when the store has no
    /// index there.
    pub fn open(
        bucket: Arc<Bucket>,
        rel: &str,
        cache: Arc<ChunkCache>,
    ) -> Result<Option<Arc<Self>>> {
        let idx_rel = format!("{rel}.idx");
        let Some(raw) = bucket.get_capped(&idx_rel, MAX_INDEX)? else {
            return Ok(None);
        };
        let index = LayerIndex::parse(&raw, &bucket.what(&idx_rel))?;
        let places = index.places();
        let rel = index.object_rel(rel);
        let id = cache.layer_id(&bucket.what(&rel));
        let rel = rel.as_str();
        Ok(Some(Arc::new_cyclic(|me| ObjectLayer {
            bucket,
            rel: rel.to_string(),
            index,
            places,
            id,
            cache,
            me: me.clone(),
        })))
    }

    pub fn index(&self) -> &LayerIndex {
        &self.index
    }

    /// Chunk `i`, from the cache or the store, checked.
    pub fn chunk(self: &Arc<Self>, i: u64) -> Result<Bytes> {
        let Some(place) = self.places[i as usize] else {
            return Ok(Bytes::new()); // zeros: the caller fills
        };
        let key = (self.id, i);
        let cache = &self.cache;
        if let Some(b) = cache.ram.get(&key) {
            cache.stats.ram_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(b);
        }
        // Single flight: the first reader of a missing chunk loads it; the others wait,
        // at most `wait` (a loader that fails hands the slot to one waiter, which then
        // loads it itself: every reader is bounded by about twice the store's timeout).
        let guard = match cache.ram.get_value_or_guard(&key, Some(cache.wait)) {
            quick_cache::sync::GuardResult::Value(b) => {
                cache.stats.shared_waits.fetch_add(1, Ordering::Relaxed);
                return Ok(b);
            }
            quick_cache::sync::GuardResult::Timeout => {
                cache.stats.failed.fetch_add(1, Ordering::Relaxed);
                return Err(Error::Io(format!(
                    "{}: chunk {i}: another read of it did not finish within {:?}; the object store is slow or away",
                    self.bucket.what(&self.rel), cache.wait)));
            }
            quick_cache::sync::GuardResult::Guard(g) => g,
        };
        if let Some(b) = self.read_disk(key, i) {
            cache.stats.disk_hits.fetch_add(1, Ordering::Relaxed);
            let _ = guard.insert(b.clone());
            return Ok(b);
        }
        let b = self.fetch(i, place)?; // an error drops the guard: a waiter takes over
        self.to_disk(key, &b);
        let _ = guard.insert(b.clone());
        self.read_ahead(i);
        Ok(b)
    }

    fn fetch(&self, i: u64, place: u64) -> Result<Bytes> {
        let stats = &self.cache.stats;
        self.index
            .fetch_checked(&self.bucket, &self.rel, i, place, |got| {
                stats.gets.fetch_add(1, Ordering::Relaxed);
                match got {
                    Got::Good(n) => {
                        stats.get_bytes.fetch_add(n, Ordering::Relaxed);
                    }
                    Got::Bad(n) => {
                        stats.get_bytes.fetch_add(n, Ordering::Relaxed);
                        stats.corrupt.fetch_add(1, Ordering::Relaxed);
                    }
                    Got::Failed(e) => {
                        stats.failed.fetch_add(1, Ordering::Relaxed);
                        log::error!("{e}");
                    }
                }
            })
    }

    fn read_disk(&self, key: Key, i: u64) -> Option<Bytes> {
        let (dir, index) = self.cache.disk.as_ref()?;
        index.get(&key)?;
        let data = std::fs::read(disk_path(dir, key)).ok()?;
        // The SSD is ours, but a chunk that does not match is fetched again.
        (data.len() as u64 == self.index.chunk_len(i)
            && Some(crc32c::crc32c(&data)) == self.index.chunks[i as usize])
            .then(|| Bytes::from(data))
    }

    fn to_disk(&self, key: Key, data: &Bytes) {
        let Some((dir, index)) = self.cache.disk.as_ref() else {
            return;
        };
        let p = disk_path(dir, key);
        let tmp = p.with_extension("tmp");
        // The chunk file is made afresh, never written through an existing name.
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            vdstream_blockdev::storefile::create_dir_all(p.parent().unwrap_or(dir))?;
            vdstream_blockdev::storefile::create_fresh(
                &tmp,
                vdstream_blockdev::storefile::SHARED_READ,
            )?
            .write_all(data)?;
            std::fs::rename(&tmp, &p)
        };
        let ok = write().is_ok();
        if ok {
            index.insert(key, ());
        } else {
            log::warn!(
                "cannot keep chunk {} of {} in the SSD cache {}",
                key.1,
                self.rel,
                dir.display()
            );
        }
    }

    /// Fetches the next chunks of this layer in the background, one flight each.
    fn read_ahead(self: &Arc<Self>, i: u64) {
        let n = self.cache.readahead;
        let max_inflight = 8;
        for j in i + 1..(i + 1 + n).min(self.places.len() as u64) {
            if self.places[j as usize].is_none() || self.cache.ram.get(&(self.id, j)).is_some() {
                continue;
            }
            if self.cache.inflight_ahead.fetch_add(1, Ordering::Relaxed) >= max_inflight {
                self.cache.inflight_ahead.fetch_sub(1, Ordering::Relaxed);
                return;
            }
            let me = self.clone();
            self.bucket.runtime().spawn_blocking(move || {
                // Counted down however the task ends.
                struct Done<'a>(&'a AtomicU64);
                impl Drop for Done<'_> {
                    fn drop(&mut self) {
                        self.0.fetch_sub(1, Ordering::Relaxed);
                    }
                }
                let _done = Done(&me.cache.inflight_ahead);
                let key = (me.id, j);
                let place = me.places[j as usize].expect("stored");
                // A chunk another reader is loading, or has loaded, is left to it.
                let quick_cache::sync::GuardResult::Guard(guard) = me
                    .cache
                    .ram
                    .get_value_or_guard(&key, Some(std::time::Duration::ZERO))
                else {
                    return;
                };
                let b = match me.read_disk(key, j) {
                    Some(b) => b,
                    None => {
                        me.cache.stats.readahead.fetch_add(1, Ordering::Relaxed);
                        let Ok(b) = me.fetch(j, place) else { return };
                        me.to_disk(key, &b);
                        b
                    }
                };
                let _ = guard.insert(b);
            });
        }
    }
}

impl vdstream_blockdev::layerfile::RemoteFile for ObjectLayer {
    fn size(&self) -> u64 {
        self.index.len
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= self.index.len)
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("{self:?}: read past its end ({} bytes)", self.index.len),
                )
            })?;
        let me = self.me.upgrade().expect("an ObjectLayer lives in its Arc");
        let mut at = offset;
        while at < end {
            let i = at / CHUNK;
            let in_chunk = (at - i * CHUNK) as usize;
            let n = ((end - at) as usize).min(CHUNK as usize - in_chunk);
            let dst = &mut buf[(at - offset) as usize..][..n];
            let data = me.chunk(i).map_err(Error::into_io)?;
            if data.is_empty() {
                dst.fill(0);
            } else {
                dst.copy_from_slice(&data[in_chunk..in_chunk + n]);
            }
            at += n as u64;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A layer of `chunks` chunks (the last one `tail` bytes short), each chunk zeros or a
    /// pattern, as the model.
    fn layer(kinds: &[u8], tail: u64) -> Vec<u8> {
        let mut data = Vec::new();
        for (i, k) in kinds.iter().enumerate() {
            let fill = if *k % 3 == 0 {
                0
            } else {
                (i as u8).wrapping_mul(31).wrapping_add(*k) | 1
            };
            data.extend(std::iter::repeat_n(fill, CHUNK as usize));
        }
        let keep = (data.len() as u64).saturating_sub(tail.min(CHUNK - 1));
        data.truncate(keep as usize);
        data
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Every chunk of the layer is found where the index says, or is zeros and not stored;
        /// the object is exactly the stored chunks; the index survives its JSON.
        #[test]
        fn packed_object_and_index_give_back_the_layer(kinds in proptest::collection::vec(any::<u8>(), 1..12), tail in 0u64..CHUNK) {
            let data = layer(&kinds, tail);
            let (index, packed) = LayerIndex::of(&data);
            prop_assert_eq!(index.len, data.len() as u64);
            prop_assert_eq!(index.stored_bytes(), packed.len() as u64);
            let places = index.places();
            for (i, want) in data.chunks(CHUNK as usize).enumerate() {
                match (index.chunks[i], places[i]) {
                    (None, None) => prop_assert!(want.iter().all(|&b| b == 0)),
                    (Some(crc), Some(at)) => {
                        let got = &packed[at as usize..][..want.len()];
                        prop_assert_eq!(got, want);
                        prop_assert_eq!(crc32c::crc32c(got), crc);
                    }
                    other => prop_assert!(false, "chunk {} has {:?}", i, other),
                }
            }
            let raw = serde_json::to_vec(&index).unwrap();
            prop_assert_eq!(LayerIndex::parse(&raw, "t").unwrap(), index);
        }
    }

    #[test]
    fn an_index_that_does_not_fit_its_length_is_refused() {
        let (mut index, _) = LayerIndex::of(&vec![1u8; 3 * CHUNK as usize]);
        index.chunks.pop();
        let err =
            LayerIndex::parse(&serde_json::to_vec(&index).unwrap(), "s3://b/x.idx").unwrap_err();
        assert!(
            matches!(err, Error::Corrupt(_)) && err.to_string().contains("s3://b/x.idx"),
            "{err}"
        );
        let err = LayerIndex::parse(b"{\"format\":1}", "s3://b/y.idx").unwrap_err();
        assert!(err.to_string().contains("not a layer index"), "{err}");
    }
}
