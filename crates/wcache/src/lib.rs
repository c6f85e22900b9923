//! The write-cache types of vdstream. A target's writes never touch the shared vDisk: they
//! land in its write cache, and reads come from the cache where the target wrote and from
//! the vDisk (the *lower* device, read-only) everywhere else. Every cache type is a
//! [`BlockDev`] that wraps a lower `BlockDev`, so the NBD session, the server and the agent
//! stack it like any other device.
//!
//! ```text
//!   guest I/O ──▶ WriteCache (one of CacheType) ──▶ lower BlockDev (vDisk, read-only)
//!                    │ RAM pages / overflow file / cache file
//!                    ▼
//!                 storage I/O (counted in CacheStats)
//! ```
//!
//! Invariants every type keeps (the conformance suite and the model tests check them):
//! - The lower device is never written (except by `private`, which has no cache).
//! - Cache granularity is the 4 KiB page: a write that covers part of a page not yet in
//!   the cache reads the page from below first (read-modify-write). Two in-flight writes to
//!   the same page never lose an update (per-page locks, sharded; never one lock over the
//!   whole device).
//! - A trimmed or zeroed page reads as zeros, never as the vDisk's bytes underneath: the
//!   cache records it as a zero page and frees whatever held its data.
//! - A cache that fills answers [`ErrorKind::NoSpace`] for writes to pages it does not yet
//!   hold; it never crashes, loses acknowledged data, or stops serving reads; overwrites of
//!   pages it holds still succeed.
//! - Non-persistent types start empty on every open, so a fresh attach is a clean boot.

pub mod cachefile;
pub mod device;
pub mod disk;
pub mod journal;
mod names;
pub mod overflow;
mod overflow_file;
pub mod page;
pub mod pagemap;
pub mod persistent;
pub mod prealloc;
pub mod private;
pub mod ram;
mod region_map;
pub mod sizing;
pub mod space;
pub mod stats;
mod tiers;

use std::path::PathBuf;
use std::sync::Arc;

pub use stats::{CacheStats, StatsSnapshot};
use vdstream_blockdev::{BlockDev, IoEngineKind, Result};

pub use vdstream_contract::CacheType;

/// Everything a cache type may need to open. Each type reads the fields it uses.
#[derive(Debug, Clone)]
pub struct CacheConfig {
    /// Who the cache belongs to, for messages and logs (a target id, or the image path).
    pub target: String,
    /// RAM budget for `device-ram` and `ram-overflow`, in bytes.
    pub ram: u64,
    /// Folder of the overflow file (`ram-overflow`) or the cache file (disk and server types).
    pub dir: PathBuf,
    /// Cap on the overflow file or cache file, in bytes; `None` = the size of the vDisk.
    pub max_file: Option<u64>,
    /// Disk types: write through the page cache (`true`) or with O_DIRECT (`false`).
    pub intermediate_buffering: bool,
    /// Disk types: how the cache file's pages are read and written (io_uring falls back to
    /// sync where the kernel refuses it).
    pub io_engine: IoEngineKind,
    /// Disk types with O_DIRECT: write zeros over each 2 MiB chunk of the cache file when
    /// it is preallocated, so guest writes land on written blocks (see `prealloc`). On by
    /// default: it costs one sequential 2 MiB write per chunk and no extra space (the chunk
    /// is preallocated anyway), and spares every guest write ext4's unwritten-extent
    /// conversion (0.69× → 0.99× of the raw disk, docs/BENCHMARKS.md).
    pub zero_fill: bool,
    /// `ram-overflow` and `device-disk`: a raw disk or partition (`--overflow-device`) holds
    /// the overflow or the page file instead of a new file in `dir`; treated as empty at
    /// every start (see `device`).
    pub overflow_device: Option<PathBuf>,
    /// `private`: the file to lock exclusively so that a second writer is refused (the
    /// vDisk's own file).
    pub lock_path: Option<PathBuf>,
}

impl CacheConfig {
    /// A config with PVS's usual defaults: 256 MiB of RAM, overflow in the system temp dir.
    pub fn new(target: impl Into<String>) -> Self {
        CacheConfig {
            target: target.into(),
            ram: 256 << 20,
            dir: std::env::temp_dir(),
            max_file: None,
            intermediate_buffering: false,
            io_engine: IoEngineKind::default(),
            zero_fill: true,
            overflow_device: None,
            lock_path: None,
        }
    }
}

/// What every non-persistent cache type offers: writable, trim and fast zeroing (a zeroed
/// page is a marker), block status (cached data, zero pages, and the vDisk's own extents
/// below), several connections on one cache; no flush or FUA, because nothing in such a
/// cache outlives it, so there is nothing to make durable. `may_block` is the type's own.
/// The persistent types add flush and FUA on top of this.
pub(crate) fn volatile_cache_caps(may_block: bool) -> vdstream_blockdev::Caps {
    vdstream_blockdev::Caps {
        read_only: false,
        flush: false,
        fua: false,
        trim: true,
        zeroes: true,
        fast_zero: true,
        cache: false,
        block_status: true,
        multi_conn: true,
        may_block,
        preferred_block: page::PAGE as u32,
    }
}

/// A write cache: a block device that also reports what it did.
pub trait WriteCache: BlockDev {
    fn cache_type(&self) -> CacheType;
    fn stats(&self) -> StatsSnapshot;
    /// Byte ranges whose contents the cache holds rather than the device below (data,
    /// zeroed or trimmed): what a live migration copies first. `None` for a cache that
    /// starts empty at every open (its caller sees every write that fills it).
    fn held(&self) -> Option<Vec<(u64, u64)>> {
        None
    }
}

/// Opens a write cache of `kind` over `lower` (which is only read, except by `private`).
pub fn open(
    kind: CacheType,
    lower: Arc<dyn BlockDev>,
    cfg: &CacheConfig,
) -> Result<Arc<dyn WriteCache>> {
    Ok(match kind {
        CacheType::DeviceRam => Arc::new(ram::RamCache::open(lower, cfg)?),
        CacheType::RamOverflow => Arc::new(overflow::RamOverflowCache::open(lower, cfg)?),
        CacheType::DeviceDisk | CacheType::Server => {
            Arc::new(disk::DiskCache::open(lower, cfg, kind)?)
        }
        CacheType::DeviceDiskPersistent | CacheType::ServerPersistent => {
            Arc::new(persistent::PersistentDiskCache::open(lower, cfg, kind)?)
        }
        CacheType::Private => Arc::new(private::PrivateDev::open(lower, cfg)?),
    })
}
