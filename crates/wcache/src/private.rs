//! `private`: no cache at all. Reads and writes go straight to the vDisk (the lower
//! device), as PVS's private-image mode does, so only one writer may have it at a time.
//!
//! Design notes.
//!
//! - Exclusion is an `flock(LOCK_EX | LOCK_NB)` on `cfg.lock_path` (the vDisk's own file),
//!   taken at open and held until drop. `flock` locks belong to the open file description,
//!   so a second open refuses whether it comes from another process or from this one; the
//!   kernel drops the lock when the process dies, so a crash never leaves a stale lock.
//! - The lower device must be writable; a read-only one is refused at open, not at the
//!   first write.
//! - Every operation is forwarded; caps are the lower device's. Stats count guest I/O and
//!   the same I/O as vDisk reads and writes, and flushes as storage flushes.
//!
//! Invariants: while a `PrivateDev` exists, it holds the lock; no other `PrivateDev` over
//! the same lock path can exist at the same time on this machine.

use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use vdstream_blockdev::{BlockDev, Caps, Error, ErrorKind, Extent, Hole, Op, Result, ZeroFlags};

use crate::cachefile::try_lock_exclusive;
use crate::stats::CacheStats;
use crate::{CacheConfig, CacheType, StatsSnapshot, WriteCache};

/// A vDisk written in place by its one writer; see the module notes.
#[derive(Debug)]
pub struct PrivateDev {
    lower: Arc<dyn BlockDev>,
    stats: CacheStats,
    lock_path: PathBuf,
    /// Holds the `flock` for the life of the device.
    _lock: File,
}

impl PrivateDev {
    /// Takes the vDisk for writing; refused while another writer has it.
    pub fn open(lower: Arc<dyn BlockDev>, cfg: &CacheConfig) -> Result<Self> {
        let refuse = |kind, device: String, message: String| Error::new(kind, Op::Open, 0, 0, device, message);
        let lock_path = cfg.lock_path.clone().ok_or_else(|| {
            refuse(ErrorKind::Invalid, lower.describe(), format!("private mode for target {} needs a lock path (the vDisk's file) so that a second writer is refused", cfg.target))
        })?;
        let name = lock_path.display().to_string();
        if lower.caps().read_only {
            return Err(refuse(
                ErrorKind::ReadOnly,
                lower.describe(),
                format!("private mode writes to the vDisk itself, but {} is read-only: open it writable", lower.describe()),
            ));
        }
        let lock = File::open(&lock_path).map_err(|e| {
            let mut err = Error::from_io(e, Op::Open, 0, 0, name.clone());
            err.message = format!("cannot open the lock file of private mode: {}", err.message);
            err
        })?;
        match try_lock_exclusive(&lock) {
            Ok(true) => {}
            Ok(false) => {
                return Err(refuse(
                    ErrorKind::Invalid,
                    name.clone(),
                    format!("{name} is in use by another writer (another process, or another open in this one); private mode allows one writer: stop the other one first"),
                ))
            }
            Err(e) => return Err(Error::from_io(e, Op::Open, 0, 0, name)),
        }
        Ok(PrivateDev { lower, stats: CacheStats::default(), lock_path, _lock: lock })
    }

    pub fn lock_path(&self) -> &std::path::Path {
        &self.lock_path
    }
}

impl BlockDev for PrivateDev {
    fn size(&self) -> u64 {
        self.lower.size()
    }

    fn caps(&self) -> Caps {
        Caps { read_only: false, ..self.lower.caps() }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let n = buf.len() as u64;
        self.lower.read_at(buf, offset)?;
        CacheStats::count(&self.stats.guest_read_ops, &self.stats.guest_read_bytes, n);
        CacheStats::count(&self.stats.vdisk_read_ops, &self.stats.vdisk_read_bytes, n);
        Ok(())
    }

    fn read_at_sparse(&self, buf: &mut [u8], offset: u64, holes: &mut Vec<Hole>) -> Result<()> {
        let n = buf.len() as u64;
        self.lower.read_at_sparse(buf, offset, holes)?;
        CacheStats::count(&self.stats.guest_read_ops, &self.stats.guest_read_bytes, n);
        CacheStats::count(&self.stats.vdisk_read_ops, &self.stats.vdisk_read_bytes, n);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        let n = buf.len() as u64;
        self.lower.write_at(buf, offset, fua)?;
        CacheStats::count(&self.stats.guest_write_ops, &self.stats.guest_write_bytes, n);
        CacheStats::count(&self.stats.vdisk_write_ops, &self.stats.vdisk_write_bytes, n);
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        self.lower.flush()?;
        self.stats.storage_flushes.fetch_add(1, Relaxed);
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.lower.trim(offset, len, fua)
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.lower.write_zeroes(offset, len, flags)
    }

    fn block_status(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        self.lower.block_status(offset, len, out)
    }

    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        self.lower.cache(offset, len)
    }

    fn describe(&self) -> String {
        format!("{} (private)", self.lower.describe())
    }
}

impl WriteCache for PrivateDev {
    fn cache_type(&self) -> CacheType {
        CacheType::Private
    }

    fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }
}
