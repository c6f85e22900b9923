//! The memory a server holds for requests, bounded across all of its connections.
//!
//! Each connection already keeps the bytes of the requests it has taken and not answered
//! under its own budget (`ServerConfig::max_in_flight_bytes`). That alone does not bound the
//! server: a client that sends large READs and never reads the replies makes each of its
//! connections hold a full budget until the reply write times out, and the server accepts
//! thousands of connections. So every byte a connection holds for a request (READ data
//! waiting to be sent, a WRITE payload, the read buffer grown for one) is also charged to
//! one [`MemoryPool`] per server, before it is allocated.
//!
//! Admission, with `limit` the pool's size and `reserve` its last eighth:
//!
//! ```text
//!   used + n <= limit - reserve                         → admitted (anyone)
//!   used + n <= limit  and  held + n <= SMALL_HOLDER    → admitted (the reserve: connections
//!                                                          that hold little, like a guest's
//!                                                          queue of small requests)
//!   otherwise                                           → wait (acquire) / refuse (try_acquire)
//! ```
//!
//! where `held` is what the asking connection already holds. So when the pool fills, the
//! connections that hold the most stop being read (their next request waits until memory is
//! given back) and nothing more is allocated for them, while a normal client's small
//! requests are still served from the reserve. Memory comes back as replies are written;
//! a client that stopped reading loses its connection after the reply write timeout, and
//! with it what it held.
//!
//! Invariant: `used` never exceeds `limit` (the session charges at most one request of 32
//! MiB and its overhead at a time, and the limit is at least [`MIN_LIMIT`]), and every
//! charge is given back exactly once (the callers pair them; `release` of more than is
//! held is a bug and saturates).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};

/// What a connection may hold and still be served from the reserve.
pub const SMALL_HOLDER: usize = 4 << 20;

/// The smallest pool: the largest request (32 MiB of data) fits below its reserve.
pub const MIN_LIMIT: usize = 64 << 20;

/// The pool's size when `--max-request-memory` is not given.
pub const DEFAULT_LIMIT: usize = 128 << 20;

/// What the pool's lock guards.
#[derive(Debug, Default)]
struct State {
    used: usize,
    /// `(held, n)` of each charge waiting: a release wakes the waiters only when one of
    /// them would now be admitted (a flood's threads are not woken by every small request
    /// a normal client completes).
    waiting: Vec<(usize, usize)>,
}

/// A `--max-request-memory` below [`MIN_LIMIT`].
#[derive(Debug, thiserror::Error)]
#[error("--max-request-memory {} MiB is below {} MiB: the largest NBD request (32 MiB) must fit with room to spare", .0 >> 20, MIN_LIMIT >> 20)]
pub struct LimitTooSmall(pub u64);

/// The pool's size from `--max-request-memory` (or its config-file key): the default when
/// unset, an error below [`MIN_LIMIT`].
pub fn limit(size: Option<u64>) -> Result<usize, LimitTooSmall> {
    match size {
        None => Ok(DEFAULT_LIMIT),
        Some(n) if n < MIN_LIMIT as u64 => Err(LimitTooSmall(n)),
        Some(n) => Ok(usize::try_from(n).unwrap_or(usize::MAX)),
    }
}

/// The server-wide bound on request memory. See the module doc.
#[derive(Debug)]
pub struct MemoryPool {
    limit: usize,
    reserve: usize,
    state: Mutex<State>,
    freed: Condvar,
    /// Charges that had to wait for memory (a flood, or a pool too small for the load).
    pub waits: AtomicU64,
    /// The most held at once.
    pub peak: AtomicU64,
    log: vdstream_blockdev::lograte::LogLimiter,
}

impl MemoryPool {
    /// A pool of `limit` bytes (at least [`MIN_LIMIT`], so that the largest request fits
    /// below the reserve).
    pub fn new(limit: usize) -> MemoryPool {
        let limit = limit.max(MIN_LIMIT);
        MemoryPool {
            limit,
            reserve: limit / 8,
            state: Mutex::new(State::default()),
            freed: Condvar::new(),
            waits: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            log: vdstream_blockdev::lograte::LogLimiter::every(std::time::Duration::from_secs(10)),
        }
    }

    /// The pool's size.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes charged now.
    pub fn used(&self) -> usize {
        self.lock().used
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn admits(&self, used: usize, held: usize, n: usize) -> bool {
        // An empty pool admits anything: a charge above the limit (a caller's mistake) runs
        // alone rather than never.
        used == 0
            || used + n <= self.limit - self.reserve
            || (used + n <= self.limit && held + n <= SMALL_HOLDER)
    }

    fn charge(&self, state: &mut State, n: usize) {
        state.used += n;
        self.peak.fetch_max(state.used as u64, Ordering::Relaxed);
    }

    /// Charges `n` bytes for a connection that holds `held` now, waiting until they are
    /// admitted; returns what was charged (give exactly that back to [`MemoryPool::release`]).
    pub fn acquire(&self, held: usize, n: usize) -> usize {
        let mut state = self.lock();
        if !self.admits(state.used, held, n) {
            self.waits.fetch_add(1, Ordering::Relaxed);
            self.log.log(log::Level::Warn, module_path!(), "request memory full", format_args!(
                "NBD request memory is full ({} of {} MiB held, --max-request-memory): a connection holding {} KiB waits before its next request is read; \
                 clients that do not read their replies keep theirs until the reply write times out",
                state.used >> 20, self.limit >> 20, held >> 10));
            state.waiting.push((held, n));
            while !self.admits(state.used, held, n) {
                state = self.freed.wait(state).unwrap_or_else(|p| p.into_inner());
            }
            let at = state
                .waiting
                .iter()
                .position(|&w| w == (held, n))
                .expect("registered above");
            state.waiting.swap_remove(at);
        }
        self.charge(&mut state, n);
        n
    }

    /// Charges `n` bytes if they are admitted now; the charge, or `None`.
    pub fn try_acquire(&self, held: usize, n: usize) -> Option<usize> {
        let mut state = self.lock();
        self.admits(state.used, held, n).then(|| {
            self.charge(&mut state, n);
            n
        })
    }

    /// Gives back a charge.
    pub fn release(&self, n: usize) {
        if n == 0 {
            return;
        }
        let mut state = self.lock();
        debug_assert!(
            state.used >= n,
            "released {n} bytes of request memory with {} held",
            state.used
        );
        state.used = state.used.saturating_sub(n);
        let wake = state
            .waiting
            .iter()
            .any(|&(held, want)| self.admits(state.used, held, want));
        drop(state);
        if wake {
            self.freed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    const MIB: usize = 1 << 20;

    #[test]
    fn big_holders_fill_the_pool_and_wait_while_small_ones_use_the_reserve() {
        let pool = MemoryPool::new(128 * MIB);
        // A flood of 32 MiB reads: three fit below the reserve, the fourth does not.
        let mut flood = Vec::new();
        for _ in 0..3 {
            flood.push(
                pool.try_acquire(0, 32 * MIB)
                    .expect("fits below the reserve"),
            );
        }
        assert_eq!(
            pool.try_acquire(0, 32 * MIB),
            None,
            "a fourth 32 MiB request would eat the reserve"
        );
        flood.push(
            pool.try_acquire(0, 16 * MIB)
                .expect("the rest below the reserve"),
        );
        assert_eq!(
            pool.try_acquire(0, 8 * MIB),
            None,
            "a large holder gets nothing of the reserve"
        );
        // A guest's small requests are served from the reserve, up to SMALL_HOLDER each.
        let mut held = 0;
        while let Some(n) = pool.try_acquire(held, 64 * 1024) {
            held += n;
        }
        assert_eq!(
            held, SMALL_HOLDER,
            "a connection takes the reserve up to SMALL_HOLDER"
        );
        assert!(pool.used() <= pool.limit());
        assert_eq!(pool.peak.load(Ordering::Relaxed) as usize, pool.used());
        pool.release(held);
        for n in flood {
            pool.release(n);
        }
        assert_eq!(pool.used(), 0);
    }

    #[test]
    fn a_waiting_charge_goes_on_when_memory_comes_back() {
        let pool = Arc::new(MemoryPool::new(64 * MIB));
        let big = pool.acquire(0, 50 * MIB);
        let waiter = {
            let pool = pool.clone();
            std::thread::spawn(move || pool.acquire(SMALL_HOLDER, 8 * MIB))
        };
        std::thread::sleep(Duration::from_millis(100));
        assert!(!waiter.is_finished(), "the second large charge waits");
        assert_eq!(pool.waits.load(Ordering::Relaxed), 1);
        pool.release(big);
        let got = waiter.join().unwrap();
        assert_eq!(got, 8 * MIB);
        pool.release(got);
        assert_eq!(pool.used(), 0);
    }

    #[test]
    fn a_pool_is_never_smaller_than_the_largest_request_needs() {
        let pool = MemoryPool::new(1 << 20);
        assert_eq!(pool.limit(), MIN_LIMIT);
        let n = pool
            .try_acquire(0, (32 << 20) + 512)
            .expect("the largest request fits below the reserve");
        pool.release(n);
    }
}
