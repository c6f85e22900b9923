//! [`DirtyLog`]: the bitmap of guest memory this backend's writes mark while qemu migrates
//! the VM (vhost-user's `SET_LOG_BASE` with `LOG_SHMFD`: one bit per 4 KiB page of guest
//! physical address, in a memfd qemu shares).
//!
//! vhost-user-backend's own `BitmapMmapRegion` takes a shared `RwLock` at every write into
//! guest memory and clones a shared `Arc` at every slice, so the queue threads contend on
//! them at every request even when no migration runs: the vhost-user path lost a third of
//! its IOPS. Here a region's state is allocated once (and kept for the process: a handful
//! per frontend connection) and reached by a plain reference, and a write checks one
//! relaxed flag before anything else: the lock is taken only while qemu logs.

use std::io;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::{Arc, RwLock};

use vhost_user_backend::bitmap::{BitmapReplace, MemRegionBitmap, MmapLogReg};
use vm_memory::bitmap::{Bitmap, BitmapSlice, WithBitmapSlice};
use vm_memory::mmap::NewBitmap;
use vm_memory::{Address, GuestMemoryRegion};

const LOG_PAGE: usize = 4096;

/// One memory region's log: where the region's pages are in qemu's bitmap.
#[derive(Debug)]
pub struct RegionLog {
    log: Arc<MmapLogReg>,
    first_page: usize,
    pages: usize,
}

impl MemRegionBitmap for RegionLog {
    fn new<R: GuestMemoryRegion>(region: &R, log: Arc<MmapLogReg>) -> io::Result<Self> {
        let bad = || io::Error::from(io::ErrorKind::InvalidData);
        let start = usize::try_from(region.start_addr().raw_value()).map_err(|_| bad())?;
        let len = usize::try_from(region.len()).map_err(|_| bad())?;
        let last = start
            .checked_add(len.checked_sub(1).ok_or_else(bad)?)
            .ok_or_else(bad)?;
        // The log must cover the region's last page: MmapLogReg's index asserts it, so it is
        // asked once here rather than failing a guest write later.
        let last_byte = last / LOG_PAGE / 8;
        let covered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            log[last_byte].load(Relaxed)
        }))
        .is_ok();
        if !covered {
            return Err(bad());
        }
        Ok(RegionLog {
            log,
            first_page: start / LOG_PAGE,
            pages: len.div_ceil(LOG_PAGE),
        })
    }
}

impl RegionLog {
    fn mark(&self, offset: usize, len: usize) {
        if len == 0 {
            return;
        }
        let (first, last) = (offset / LOG_PAGE, offset.saturating_add(len - 1) / LOG_PAGE);
        for page in first..=last.min(self.pages.saturating_sub(1)) {
            let p = self.first_page + page;
            self.log[p / 8].fetch_or(1 << (p % 8), Relaxed);
        }
    }
}

#[derive(Debug, Default)]
struct Shared {
    on: AtomicBool,
    log: RwLock<Option<RegionLog>>,
}

/// The dirty log of one memory region, or of a slice of it (`base` bytes in).
#[derive(Debug, Clone, Copy)]
pub struct DirtyLog {
    shared: &'static Shared,
    base: usize,
}

impl Default for DirtyLog {
    fn default() -> Self {
        DirtyLog {
            shared: Box::leak(Box::default()),
            base: 0,
        }
    }
}

impl NewBitmap for DirtyLog {
    fn with_len(_len: usize) -> Self {
        Self::default()
    }
}

impl Bitmap for DirtyLog {
    fn mark_dirty(&self, offset: usize, len: usize) {
        if !self.shared.on.load(Acquire) {
            return;
        }
        let log = self
            .shared
            .log
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(log) = log.as_ref() {
            log.mark(self.base.saturating_add(offset), len);
        }
    }

    fn dirty_at(&self, _offset: usize) -> bool {
        // Nothing here reads the log back (qemu does); say "dirty" to be safe.
        self.shared.on.load(Relaxed)
    }

    fn slice_at(&self, offset: usize) -> Self {
        DirtyLog {
            shared: self.shared,
            base: self.base.saturating_add(offset),
        }
    }
}

impl<'a> WithBitmapSlice<'a> for DirtyLog {
    type S = Self;
}

impl BitmapSlice for DirtyLog {}

impl BitmapReplace for DirtyLog {
    type InnerBitmap = RegionLog;

    fn replace(&self, log: RegionLog) {
        *self
            .shared
            .log
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(log);
        self.shared.on.store(true, Release);
    }
}
