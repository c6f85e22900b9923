//! `IoEngine`: how a file's whole-buffer reads and writes reach the kernel — `pread`/`pwrite`
//! on the calling thread (`sync`), or through a batched io_uring queue (`io_uring`, see
//! [`crate::uring`]). An enum, not a generic parameter: the choice is made once at open,
//! from configuration, and everything above calls the same two methods.
//!
//! Design notes.
//!
//! - **Fallback**: asking for io_uring where it cannot be set up (an old kernel, a seccomp
//!   filter, `kernel.io_uring_disabled`, EPERM in a container) gives the sync engine, with
//!   one warning per process; the file works either way. A request the io_uring queue
//!   hands back (see there) is done with `pread`/`pwrite` on the calling thread.
//! - Both engines have `read_exact_at`/`write_all_at` semantics: the whole buffer or an
//!   error, EINTR retried, a short transfer continued, end of file an `UnexpectedEof`.
//!
//! Invariants: when a call returns `Ok`, the bytes are read, or written as far as
//! `pwrite` would have written them (in the page cache, or on the device with `O_DIRECT`).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::uring::UringQueue;

/// Which engine to ask for; see the module notes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoEngineKind {
    /// `pread`/`pwrite` on the calling thread. The default: with the NBD server's worker
    /// threads blocked in I/O it measured faster than io_uring (docs/BENCHMARKS.md).
    #[default]
    Sync,
    /// A batched io_uring queue per file, falling back to `Sync` where io_uring is refused.
    IoUring,
}

impl IoEngineKind {
    /// The name used on the command line and in logs.
    pub fn name(self) -> &'static str {
        match self {
            IoEngineKind::Sync => "sync",
            IoEngineKind::IoUring => "io_uring",
        }
    }
}

impl std::fmt::Display for IoEngineKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for IoEngineKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sync" => Ok(IoEngineKind::Sync),
            "io_uring" | "io-uring" | "uring" => Ok(IoEngineKind::IoUring),
            _ => Err(format!("unknown I/O engine {s:?}: choose sync or io_uring")),
        }
    }
}

/// Warned once per process that io_uring is unavailable.
static WARNED_FALLBACK: AtomicBool = AtomicBool::new(false);

/// The engine of one file; see the module notes.
#[derive(Debug)]
pub enum IoEngine {
    Sync,
    IoUring(UringQueue),
}

impl IoEngine {
    /// The engine of `kind` for the file described by `what` (for the thread name and logs).
    pub fn open(kind: IoEngineKind, what: &str) -> IoEngine {
        IoEngine::from_setup(kind, what, || UringQueue::new(what))
    }

    /// Like [`open`](Self::open) with the io_uring setup given: a setup that fails gives
    /// the sync engine, as a refused io_uring does (tests inject failures here).
    pub fn from_setup(
        kind: IoEngineKind,
        what: &str,
        setup: impl FnOnce() -> io::Result<UringQueue>,
    ) -> IoEngine {
        match kind {
            IoEngineKind::Sync => IoEngine::Sync,
            IoEngineKind::IoUring => match setup() {
                Ok(queue) => IoEngine::IoUring(queue),
                Err(e) => {
                    if !WARNED_FALLBACK.swap(true, Ordering::Relaxed) {
                        log::warn!("io_uring is not available ({e}): {what} and every later file use pread/pwrite");
                    } else {
                        log::debug!(
                            "io_uring is not available for {what} ({e}): using pread/pwrite"
                        );
                    }
                    IoEngine::Sync
                }
            },
        }
    }

    /// The engine actually in use (`Sync` after a fallback).
    pub fn kind(&self) -> IoEngineKind {
        match self {
            IoEngine::Sync => IoEngineKind::Sync,
            IoEngine::IoUring(_) => IoEngineKind::IoUring,
        }
    }

    /// Reads exactly `buf.len()` bytes of `file` at `offset`.
    pub fn read_exact_at(&self, file: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if let IoEngine::IoUring(q) = self {
            if let Some(r) = q.read(file.as_raw_fd(), buf, offset) {
                return r;
            }
        }
        file.read_exact_at(buf, offset)
    }

    /// Writes all of `buf` to `file` at `offset`.
    pub fn write_all_at(&self, file: &File, buf: &[u8], offset: u64) -> io::Result<()> {
        if let IoEngine::IoUring(q) = self {
            if let Some(r) = q.write(file.as_raw_fd(), buf, offset) {
                return r;
            }
        }
        file.write_all_at(buf, offset)
    }
}
