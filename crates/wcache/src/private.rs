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

use vdstream_blockdev::{BatchOp, BlockDev, Caps, Error, ErrorKind, Hole, Op, Result};

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
        let refuse = |kind, device: String, message: String| {
            Error::new(kind, Op::Open, 0, 0, device, message)
        };
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
        Ok(PrivateDev {
            lower,
            stats: CacheStats::default(),
            lock_path,
            _lock: lock,
        })
    }

    pub fn lock_path(&self) -> &std::path::Path {
        &self.lock_path
    }
}

/// Counts, and passes everything to the vDisk.
impl vdstream_blockdev::Filter for PrivateDev {
    type Inner = dyn BlockDev;

    fn inner(&self) -> &Self::Inner {
        &*self.lower
    }

    fn caps(&self) -> Caps {
        Caps {
            read_only: false,
            ..self.inner().caps()
        }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.inner().read_at(buf, offset)?;
        self.count(false, buf.len() as u64);
        Ok(())
    }

    fn read_at_sparse(&self, buf: &mut [u8], offset: u64, holes: &mut Vec<Hole>) -> Result<()> {
        self.inner().read_at_sparse(buf, offset, holes)?;
        self.count(false, buf.len() as u64);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.inner().write_at(buf, offset, fua)?;
        self.count(true, buf.len() as u64);
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        self.inner().flush()?;
        self.stats.storage_flushes.fetch_add(1, Relaxed);
        Ok(())
    }

    fn describe(&self) -> String {
        format!("{} (private)", self.inner().describe())
    }

    fn io_batch(&self, ops: &mut [BatchOp<'_>]) {
        self.inner().io_batch(ops);
        for op in ops.iter().filter(|op| op.result.is_ok()) {
            self.count(op.is_write(), op.len() as u64);
        }
    }
}

impl PrivateDev {
    /// Counts a completed guest read or write as vDisk I/O too.
    fn count(&self, write: bool, n: u64) {
        let s = &self.stats;
        if write {
            CacheStats::count(&s.guest_write_ops, &s.guest_write_bytes, n);
            CacheStats::count(&s.vdisk_write_ops, &s.vdisk_write_bytes, n);
        } else {
            CacheStats::count(&s.guest_read_ops, &s.guest_read_bytes, n);
            CacheStats::count(&s.vdisk_read_ops, &s.vdisk_read_bytes, n);
        }
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
