//! What the write-cache benchmarks share: the RAM-overflow caches they measure. (Page
//! indices come from `fastrand::Rng::with_seed`, a deterministic stream.)

use std::sync::Arc;

use vdstream_blockdev::{BlockDev, MemoryDev};
use vdstream_wcache::overflow::RamOverflowCache;
use vdstream_wcache::CacheConfig;

pub const PAGE: u64 = 4096;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// A `ram-overflow` cache of `size` bytes over a RAM disk, with `ram` of RAM.
pub fn overflow_cache(size: u64, ram: u64, dir: &std::path::Path) -> RamOverflowCache {
    let lower: Arc<dyn BlockDev> = Arc::new(MemoryDev::new(size));
    let cfg = CacheConfig {
        ram,
        dir: dir.to_path_buf(),
        ..CacheConfig::new("bench")
    };
    RamOverflowCache::open(lower, &cfg).unwrap()
}

/// Writes the first `bytes` of the cache, 1 MiB at a time.
pub fn fill(cache: &RamOverflowCache, bytes: u64) {
    let chunk = vec![0x5Au8; MIB as usize];
    for off in (0..bytes).step_by(MIB as usize) {
        cache.write_at(&chunk, off, false).unwrap();
    }
}

/// A 1 GiB cache written whole, with RAM above the working set by more than the flusher's
/// high watermark: every later write overwrites a RAM page and nothing evicts.
pub fn resident_1gib(dir: &std::path::Path) -> RamOverflowCache {
    let cache = overflow_cache(GIB, GIB + GIB / 4, dir);
    fill(&cache, GIB);
    cache
}
