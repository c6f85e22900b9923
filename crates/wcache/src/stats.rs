//! Statistics every write cache keeps: what the guest asked for (guest I/O) against what
//! reached a disk or the vDisk (storage I/O), split by where it went. Counters are relaxed
//! atomics, bumped on the data path and read by the API, metrics and the demo table.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Live counters, shared by a cache's data path.
#[derive(Debug, Default)]
pub struct CacheStats {
    pub guest_read_ops: AtomicU64,
    pub guest_read_bytes: AtomicU64,
    pub guest_write_ops: AtomicU64,
    pub guest_write_bytes: AtomicU64,
    /// Reads that reached the lower device (the vDisk).
    pub vdisk_read_ops: AtomicU64,
    pub vdisk_read_bytes: AtomicU64,
    /// Writes that reached the vDisk (only `private`).
    pub vdisk_write_ops: AtomicU64,
    pub vdisk_write_bytes: AtomicU64,
    /// I/O on the overflow file of `ram-overflow`.
    pub overflow_read_ops: AtomicU64,
    pub overflow_read_bytes: AtomicU64,
    pub overflow_write_ops: AtomicU64,
    pub overflow_write_bytes: AtomicU64,
    /// I/O on the cache file of the disk and server types.
    pub disk_read_ops: AtomicU64,
    pub disk_read_bytes: AtomicU64,
    pub disk_write_ops: AtomicU64,
    pub disk_write_bytes: AtomicU64,
    /// Flushes that reached storage (fdatasync and the like).
    pub storage_flushes: AtomicU64,
    /// Bytes of RAM holding cached pages now.
    pub ram_bytes: AtomicU64,
    /// Bytes of the overflow or cache file in use now.
    pub file_bytes: AtomicU64,
    /// Pages moved from RAM to the overflow file.
    pub evictions: AtomicU64,
    /// Guest read pages served from the cache (RAM, overflow or cache file).
    pub hits: AtomicU64,
    /// Guest read pages that went to the vDisk.
    pub misses: AtomicU64,
    /// Writes refused because the cache was full.
    pub nospace_errors: AtomicU64,
}

/// A plain copy of the counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub guest_read_ops: u64,
    pub guest_read_bytes: u64,
    pub guest_write_ops: u64,
    pub guest_write_bytes: u64,
    pub vdisk_read_ops: u64,
    pub vdisk_read_bytes: u64,
    pub vdisk_write_ops: u64,
    pub vdisk_write_bytes: u64,
    pub overflow_read_ops: u64,
    pub overflow_read_bytes: u64,
    pub overflow_write_ops: u64,
    pub overflow_write_bytes: u64,
    pub disk_read_ops: u64,
    pub disk_read_bytes: u64,
    pub disk_write_ops: u64,
    pub disk_write_bytes: u64,
    pub storage_flushes: u64,
    pub ram_bytes: u64,
    pub file_bytes: u64,
    pub evictions: u64,
    pub hits: u64,
    pub misses: u64,
    pub nospace_errors: u64,
}

macro_rules! snapshot_fields {
    ($src:expr, $($f:ident),*) => { StatsSnapshot { $($f: $src.$f.load(Relaxed)),* } };
}

impl CacheStats {
    pub fn snapshot(&self) -> StatsSnapshot {
        snapshot_fields!(
            self,
            guest_read_ops,
            guest_read_bytes,
            guest_write_ops,
            guest_write_bytes,
            vdisk_read_ops,
            vdisk_read_bytes,
            vdisk_write_ops,
            vdisk_write_bytes,
            overflow_read_ops,
            overflow_read_bytes,
            overflow_write_ops,
            overflow_write_bytes,
            disk_read_ops,
            disk_read_bytes,
            disk_write_ops,
            disk_write_bytes,
            storage_flushes,
            ram_bytes,
            file_bytes,
            evictions,
            hits,
            misses,
            nospace_errors
        )
    }

    /// Counts one operation of `bytes` on a pair of counters.
    pub fn count(ops: &AtomicU64, bytes_counter: &AtomicU64, bytes: u64) {
        ops.fetch_add(1, Relaxed);
        bytes_counter.fetch_add(bytes, Relaxed);
    }
}

impl StatsSnapshot {
    /// Operations that reached storage: the vDisk, the overflow file or the cache file.
    pub fn storage_ops(&self) -> u64 {
        self.vdisk_read_ops
            + self.vdisk_write_ops
            + self.overflow_read_ops
            + self.overflow_write_ops
            + self.disk_read_ops
            + self.disk_write_ops
    }

    /// Write operations that reached storage.
    pub fn storage_write_ops(&self) -> u64 {
        self.vdisk_write_ops + self.overflow_write_ops + self.disk_write_ops
    }
}
