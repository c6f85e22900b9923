//! `ram-overflow`, the default cache type: RAM first, the least recently used data spilled to
//! an overflow file on the target's local disk in 2 MiB units (PVS's "cache in device RAM
//! with overflow on hard disk", whose file is `vdiskdif.vhdx`).
//!
//! Design notes.
//!
//! The data path is [`crate::tiers::Tiers`] with an [`OverflowFile`]; this module adds the
//! [`Flusher`] and the configuration. Page states (see [`crate::region_map`]):
//!
//! | state    | reads from               | held                       | on write                 | on trim/zero            |
//! | -------- | ------------------------ | -------------------------- | ------------------------ | ----------------------- |
//! | absent   | the vDisk                | nothing                    | → ram, else → overflow   | → zero                  |
//! | ram      | RAM (no disk I/O)        | 4 KiB of RAM (+stale slot) | in place, no I/O         | → zero, page freed      |
//! | overflow | its slot in the unit     | a 4 KiB slot               | → ram, else in place     | → zero, slot punched    |
//! | zero     | zeros                    | nothing                    | → ram, else → overflow   | stays zero              |
//!
//! - RAM is taken page by page up to `cfg.ram`. The flusher thread wakes when RAM use
//!   reaches the high watermark (90%) and evicts least-recently-used regions (CLOCK) until it
//!   is under the low watermark (75%), so a burst of guest writes does not wait on the disk.
//!   Only when RAM is completely full does a writer evict one region itself first
//!   (backpressure, bounded to one region per request); a page that still finds no RAM goes
//!   straight to its slot in the file.
//! - An evicted region is written sorted and coalesced: each run of adjacent RAM pages is one
//!   `pwritev` to consecutive slots, so a fully written 2 MiB region costs one 2 MiB write.
//! - The file holds at most `cfg.max_file` bytes (default: the vDisk size) in whole units;
//!   a write that needs a new unit past that fails with ENOSPC (logged once, counted every
//!   time), exactly as `device-ram` does when its RAM is full. Trimming gives units back.
//! - `cfg.ram == 0` sends every write straight to the file; no flusher runs.
//! - Non-persistent: the file is created fresh and unlinked at once (see
//!   [`crate::overflow_file`]); `flush` and FUA are not advertised, because nothing is made
//!   durable, and every completed write is visible to every connection (`multi_conn`).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use vdstream_blockdev::{BlockDev, Error, Op, Result};

use crate::overflow_file::OverflowFile;
/// Bytes per unit of the overflow (file or device): its size counts in whole units.
pub use crate::overflow_file::UNIT;
use crate::page::PAGE;
use crate::tiers::{tiers_cache_impls, Tiers};
use crate::{CacheConfig, CacheType};

/// RAM use (percent of the budget) at which the flusher starts evicting.
pub const HIGH_WATERMARK_PERCENT: u64 = 90;
/// RAM use (percent of the budget) at which the flusher stops.
pub const LOW_WATERMARK_PERCENT: u64 = 75;

/// The `ram-overflow` cache. See the module notes.
#[derive(Debug)]
pub struct RamOverflowCache {
    tiers: Arc<Tiers>,
    /// Held for its `Drop`, which stops and joins the thread.
    _flusher: Option<Flusher>,
}

impl RamOverflowCache {
    /// Opens an empty cache over `lower`: `cfg.ram` bytes of RAM, a fresh overflow file in
    /// `cfg.dir` capped at `cfg.max_file` bytes.
    pub fn open(lower: Arc<dyn BlockDev>, cfg: &CacheConfig) -> Result<Self> {
        let name = format!(
            "ram-overflow cache of {} over {}",
            cfg.target,
            lower.describe()
        );
        let mut max_bytes = cfg
            .max_file
            .unwrap_or_else(|| lower.size().div_ceil(UNIT) * UNIT);
        let (file, full) = match &cfg.overflow_device {
            Some(device) => {
                let (file, size) =
                    OverflowFile::on_device(device, max_bytes / UNIT).map_err(|e| {
                        let mut err = Error::from_io(e, Op::Open, 0, 0, name.clone());
                        err.message = format!("cannot use the overflow device: {}", err.message);
                        err
                    })?;
                max_bytes = max_bytes.min(size / UNIT * UNIT);
                let full = format!(
                    "the write cache of target {} is full: {} bytes of RAM and {} bytes of the overflow device {} are in use: give a larger device (or --ram), or free space in the guest (fstrim)",
                    cfg.target,
                    cfg.ram,
                    max_bytes,
                    device.display()
                );
                (file, full)
            }
            None => {
                let file = OverflowFile::create(&cfg.dir, &cfg.target, max_bytes / UNIT).map_err(|e| {
                    let mut err = Error::from_io(e, Op::Open, 0, 0, name.clone());
                    err.message = format!(
                        "cannot create the overflow file in {}: {}: check that the folder exists, is writable and is on a local disk",
                        cfg.dir.display(),
                        err.message
                    );
                    err
                })?;
                let full = format!(
                    "the write cache of target {} is full: {} bytes of RAM and an overflow file of {} bytes in {} are in use: raise --overflow-max (or --ram), or free space in the guest (fstrim)",
                    cfg.target,
                    cfg.ram,
                    max_bytes / UNIT * UNIT,
                    cfg.dir.display()
                );
                (file, full)
            }
        };
        let mut tiers = Tiers::new(lower, name, cfg.ram, Some(file), full);
        let low = tiers.ram_limit / 100 * LOW_WATERMARK_PERCENT / PAGE as u64 * PAGE as u64;
        if tiers.ram_limit > 0 {
            tiers.high = (tiers.ram_limit / 100 * HIGH_WATERMARK_PERCENT).max(PAGE as u64);
        }
        let tiers = Arc::new(tiers);
        let flusher = if tiers.ram_limit > 0 {
            Some(
                Flusher::start(Arc::clone(&tiers), low)
                    .map_err(|e| Error::from_io(e, Op::Open, 0, 0, tiers.name.clone()))?,
            )
        } else {
            None
        };
        Ok(RamOverflowCache {
            tiers,
            _flusher: flusher,
        })
    }

    /// Evicts least-recently-used regions until RAM use is at most `ram_bytes`, or nothing
    /// more can go; returns the pages moved. For tests, benches and "spill now" commands.
    pub fn evict_until(&self, ram_bytes: u64) -> Result<u64> {
        let mut moved = 0u64;
        let mut idle = 0;
        while self.tiers.stats.ram_bytes.load(Relaxed) > ram_bytes && idle < 4 {
            match self.tiers.evict_one()? {
                0 => idle += 1,
                n => {
                    moved += n as u64;
                    idle = 0;
                }
            }
        }
        Ok(moved)
    }

    /// Units of the overflow file owned by regions now.
    pub fn overflow_units(&self) -> u64 {
        self.tiers.file.as_ref().map_or(0, |f| f.units_in_use())
    }

    /// Bytes the overflow file occupies on disk now (its allocated blocks).
    pub fn overflow_disk_bytes(&self) -> u64 {
        self.tiers.file.as_ref().map_or(0, |f| f.disk_bytes())
    }
}

/// The background thread that evicts ahead of need, between the watermarks.
#[derive(Debug)]
pub struct Flusher {
    tiers: Arc<Tiers>,
    thread: Option<JoinHandle<()>>,
}

/// Quiet 100 ms ticks of the flusher (no eviction needed) after which it empties the
/// spare page pool.
const QUIET_TICKS_BEFORE_DROPPING_SPARES: u32 = 10;

impl Flusher {
    fn start(tiers: Arc<Tiers>, low: u64) -> std::io::Result<Self> {
        let t = Arc::clone(&tiers);
        let thread = std::thread::Builder::new()
            .name("vdstream-flusher".into())
            .spawn(move || {
                let mut warned = false;
                let mut quiet = 0u32;
                while !t.wake.stop.load(Relaxed) {
                    let woken = t.wake.wait(Duration::from_millis(100));
                    if !woken && t.stats.ram_bytes.load(Relaxed) < t.high {
                        // A quiet moment: give back what evictions freed. Not while they churn:
                        // the pages freed then are allocated again at once by writes coming
                        // back into RAM, and trimming them costs a heap walk, TLB shootdowns
                        // and fresh page faults for nothing. The spare pool goes after a
                        // quiet second.
                        quiet += 1;
                        if quiet == QUIET_TICKS_BEFORE_DROPPING_SPARES && t.drop_spares() > 0 {
                            vdstream_blockdev::reclaim::reclaim_now();
                        } else {
                            vdstream_blockdev::reclaim::maybe_reclaim();
                        }
                        continue;
                    }
                    quiet = 0;
                    let mut idle = 0;
                    while !t.wake.stop.load(Relaxed)
                        && t.stats.ram_bytes.load(Relaxed) > low
                        && idle < 4
                    {
                        match t.evict_one() {
                            Ok(0) => idle += 1,
                            Ok(_) => idle = 0,
                            Err(e) => {
                                if !warned {
                                    log::warn!("{}: the flusher cannot evict: {e}", t.name);
                                    warned = true;
                                }
                                break;
                            }
                        }
                    }
                }
            })?;
        Ok(Flusher {
            tiers,
            thread: Some(thread),
        })
    }
}

impl Drop for Flusher {
    fn drop(&mut self) {
        self.tiers.wake.stop.store(true, Relaxed);
        self.tiers.wake.notify();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

tiers_cache_impls!(RamOverflowCache, CacheType::RamOverflow);

#[cfg(test)]
mod tests {
    use super::*;
    use vdstream_blockdev::MemoryDev;

    #[test]
    fn the_flusher_gives_the_spare_pool_back_when_writes_stop() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = CacheConfig {
            ram: 1 << 20,
            dir: dir.path().into(),
            ..CacheConfig::new("spares")
        };
        let c = RamOverflowCache::open(Arc::new(MemoryDev::new(8 << 20)), &cfg).unwrap();
        let data: Vec<u8> = (0..4 << 20).map(|i: u32| (i / 4096) as u8 ^ 0x5a).collect();
        c.write_at(&data, 0, false).unwrap(); // 4 MiB through 1 MiB of RAM
        c.evict_until(0).unwrap();
        assert!(
            c.tiers.spare_count() > 0,
            "evicted pages wait in the pool for reuse"
        );
        let start = std::time::Instant::now();
        while c.tiers.spare_count() > 0 && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(
            c.tiers.spare_count(),
            0,
            "the pool is still held {:?} after the last write",
            start.elapsed()
        );
        let mut back = vec![0u8; data.len()];
        c.read_at(&mut back, 0).unwrap();
        assert!(back == data, "the data reads back after the pool is gone");
    }
}
