//! Giving freed memory back to the system.
//!
//! Devices that keep data in RAM (the RAM disk, the RAM write caches) allocate and free it
//! one 4 KiB page at a time. glibc's allocator keeps freed chunks inside its heaps, so
//! without help a process stays at its peak size after a trim frees gigabytes. Devices
//! report the bytes they free with [`note_freed`] (a relaxed add, fine under their locks)
//! and call [`maybe_reclaim`] once their locks are released; when at least
//! [`RECLAIM_AFTER`] bytes were freed since the last time, it calls `malloc_trim(0)`, which
//! returns the free pages of every arena to the kernel. Process-wide, because the allocator
//! is; a no-op where the allocator is not glibc's.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Bytes freed since the last reclaim.
static FREED: AtomicU64 = AtomicU64::new(0);

/// Reclaim once this much has been freed: often enough that a trim of a large range shows
/// in the process size at once, rarely enough that the walk over the heap stays cheap.
pub const RECLAIM_AFTER: u64 = 32 << 20;

/// Records that `bytes` of page memory were freed (or are about to be, by the caller).
pub fn note_freed(bytes: u64) {
    FREED.fetch_add(bytes, Relaxed);
}

/// Returns freed memory to the system if enough has piled up. Call it with no lock held:
/// it may take a few milliseconds.
pub fn maybe_reclaim() {
    if FREED.load(Relaxed) < RECLAIM_AFTER {
        return;
    }
    if FREED.swap(0, Relaxed) < RECLAIM_AFTER {
        return; // another thread reclaimed meanwhile; what we took back is small
    }
    trim_heaps();
}

/// Returns freed memory to the system now, however little was freed: for a caller that
/// has just let go of a pool it kept (the threshold of [`maybe_reclaim`] would keep a
/// pool smaller than [`RECLAIM_AFTER`] in the process for good). Call it with no lock
/// held.
pub fn reclaim_now() {
    FREED.store(0, Relaxed);
    trim_heaps();
}

fn trim_heaps() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks and trims the allocator's own heaps, under the
    // allocator's locks; it has no preconditions on the caller.
    unsafe {
        libc::malloc_trim(0);
    }
}
