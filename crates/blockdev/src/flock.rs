//! `flock` without blocking, for every file vdstream locks to keep a second user out (qcow2
//! images, store files, persistent caches, the vDisk under `private`, an agent's attach
//! lock): one helper, so all of them wait out the same short conflict and retry `EINTR`.
//!
//! A lock of ours that was just released can outlive its descriptor for a moment: flock
//! locks belong to the open file, and a child process that another thread forked and that
//! has not yet reached `exec` holds a copy of every descriptor. A real second user holds
//! the lock for good. So a taker waits up to [`LOCK_PATIENCE`] for a conflict to clear
//! before it reports the file busy; a probe ("is anyone using this?") passes
//! `Duration::ZERO` and answers at once.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// How long a taker waits for a conflicting lock to go away before refusing.
pub const LOCK_PATIENCE: Duration = Duration::from_millis(200);

/// How often a waiting taker tries again.
const RETRY_EVERY: Duration = Duration::from_millis(5);

/// Shared or exclusive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockMode {
    Shared,
    Exclusive,
}

/// Tries to take a `mode` lock on `file` for up to `patience`: `Ok(true)` once held,
/// `Ok(false)` when another open file still holds a conflicting lock after that, `Err` for
/// anything else (`EBADF`, `ENOLCK`, ...). `EINTR` is retried.
pub fn try_lock(file: &File, mode: LockMode, patience: Duration) -> io::Result<bool> {
    let start = Instant::now();
    loop {
        match flock(file, mode.op() | libc::LOCK_NB) {
            Ok(()) => return Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => {
                if start.elapsed() >= patience {
                    return Ok(false);
                }
                std::thread::sleep(RETRY_EVERY);
            }
            Err(e) => return Err(e),
        }
    }
}

/// Takes a `mode` lock on `file`, waiting as long as it takes.
pub fn lock_wait(file: &File, mode: LockMode) -> io::Result<()> {
    flock(file, mode.op())
}

impl LockMode {
    fn op(self) -> libc::c_int {
        match self {
            LockMode::Shared => libc::LOCK_SH,
            LockMode::Exclusive => libc::LOCK_EX,
        }
    }
}

/// `flock(file, op)`, retried on `EINTR`.
fn flock(file: &File, op: libc::c_int) -> io::Result<()> {
    loop {
        // SAFETY: flock only takes the descriptor, which `file` keeps open for this call,
        // and an integer; it touches no memory of ours.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_opens() -> (tempfile::TempDir, File, File) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let a = File::create(&path).unwrap();
        let b = File::open(&path).unwrap();
        (dir, a, b)
    }

    #[test]
    fn a_lock_held_for_good_is_refused_after_the_patience() {
        let (_dir, a, b) = two_opens();
        assert!(try_lock(&a, LockMode::Exclusive, Duration::ZERO).unwrap());
        let start = Instant::now();
        assert!(!try_lock(&b, LockMode::Shared, LOCK_PATIENCE).unwrap());
        assert!(start.elapsed() >= LOCK_PATIENCE);
        // A probe answers at once.
        let start = Instant::now();
        assert!(!try_lock(&b, LockMode::Exclusive, Duration::ZERO).unwrap());
        assert!(start.elapsed() < LOCK_PATIENCE);
    }

    #[test]
    fn a_lock_released_within_the_patience_is_taken() {
        let (_dir, a, b) = two_opens();
        assert!(try_lock(&a, LockMode::Exclusive, Duration::ZERO).unwrap());
        std::thread::scope(|s| {
            s.spawn(move || {
                std::thread::sleep(Duration::from_millis(40));
                drop(a);
            });
            assert!(
                try_lock(&b, LockMode::Exclusive, LOCK_PATIENCE).unwrap(),
                "the lock was released after 40 ms"
            );
        });
    }

    #[test]
    fn shared_locks_do_not_conflict() {
        let (_dir, a, b) = two_opens();
        assert!(try_lock(&a, LockMode::Shared, Duration::ZERO).unwrap());
        assert!(try_lock(&b, LockMode::Shared, Duration::ZERO).unwrap());
        lock_wait(&a, LockMode::Shared).unwrap();
    }
}
