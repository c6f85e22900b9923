//! [`TrackedDev`]: the device under an agent's local exports when the agent can take part in
//! a live migration. It does three things on top of the write cache:
//!
//! - **Dirty logging.** Every write, trim and zero marks its 4 KiB pages in the `round` map
//!   after the cache took it: what changed since a round last took it. What a round takes
//!   goes into `since_open`, so the two together are everything the cache holds beyond the
//!   vDisk, for a full copy (one map marked per write: the hop's cost is one atomic OR).
//!   Marking *after* the write means a round that clears a page before the write lands
//!   sees it marked again, so the next round sends it: a page is never lost, at worst sent
//!   twice.
//! - **The gate** (destination): while `Held`, writes wait for the handover. Reads are
//!   answered: before the switch the destination qemu is not running its guest, but it reads
//!   the disk to set up its device (virtio-blk reads sector 0 for the disk's geometry).
//! - **The fence** (source): `fence` holds every new request and waits for those in
//!   flight, so the final delta holds every write the guest was ever answered. A source
//!   whose VM resumes after a failed switch-over finds its requests waiting, not failed,
//!   until the handover is reverted (`open`).
//! - **The first write** after the gate opens is announced (`on_first_write`): proof that the
//!   guest runs at the destination.
//!
//! | state   | requests                                   | reached by                                  |
//! | ------- | ------------------------------------------ | ------------------------------------------- |
//! | Open    | served                                     | an ordinary attach; `open` after a handover |
//! | Held    | reads served, writes wait                  | an incoming attach                          |
//! | Fenced  | wait                                       | `fence`: the source sends its final delta   |
//! | Failed  | refused (EIO)                              | `fail`: the handover cannot finish          |

use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicU64, AtomicU8};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use vdstream_blockdev::{
    lock, BatchIo, BatchOp, BlockDev, Error, ErrorKind, Filter, Hole, Op, Result, ZeroFlags,
};

/// The unit of dirty logging.
pub const PAGE: u64 = 4096;

const OPEN: u8 = 0;
const HELD: u8 = 1;
const FENCED: u8 = 2;
const FAILED: u8 = 3;

/// The longest a request waits at the gate before it fails: a handover that takes longer
/// has failed (its source is gone), and the guest gets an error rather than a hang.
pub const HOLD_LIMIT: Duration = Duration::from_secs(120);

/// A map of 4 KiB pages, set concurrently by requests and taken by rounds.
#[derive(Debug)]
pub struct DirtyMap {
    words: Vec<AtomicU64>,
    size: u64,
}

impl DirtyMap {
    pub fn new(size: u64) -> DirtyMap {
        let pages = size.div_ceil(PAGE);
        DirtyMap {
            words: (0..pages.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            size,
        }
    }

    /// Marks every page `offset..offset+len` touches.
    pub fn mark(&self, offset: u64, len: u64) {
        if len == 0 || offset >= self.size {
            return;
        }
        let (first, last) = (offset / PAGE, (offset + len - 1).min(self.size - 1) / PAGE);
        let mut p = first;
        while p <= last {
            let (w, bit) = ((p / 64) as usize, p % 64);
            let n = (64 - bit).min(last - p + 1);
            let bits = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << bit
            };
            if self.words[w].load(SeqCst) & bits != bits {
                self.words[w].fetch_or(bits, SeqCst);
            }
            p += n;
        }
    }

    /// The marked byte ranges, each at most `max_run` long; `clear` takes them (a page
    /// marked again after its word was taken stays marked), and marks them in `keep`.
    pub fn runs(&self, max_run: u64, clear: bool, keep: Option<&DirtyMap>) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        for (w, word) in self.words.iter().enumerate() {
            let mut v = if clear {
                word.swap(0, SeqCst)
            } else {
                word.load(SeqCst)
            };
            if let (Some(k), true) = (keep, v != 0) {
                k.words[w].fetch_or(v, SeqCst);
            }
            while v != 0 {
                let bit = u64::from(v.trailing_zeros());
                v &= v - 1;
                let start = (w as u64 * 64 + bit) * PAGE;
                if start >= self.size {
                    break;
                }
                let len = PAGE.min(self.size - start);
                match out.last_mut() {
                    Some((s, l)) if *s + *l == start && *l + len <= max_run => *l += len,
                    _ => out.push((start, len)),
                }
            }
        }
        out
    }

    /// Bytes marked now.
    pub fn bytes(&self) -> u64 {
        let pages: u64 = self
            .words
            .iter()
            .map(|w| u64::from(w.load(SeqCst).count_ones()))
            .sum();
        (pages * PAGE).min(self.size)
    }
}

/// See the module docs.
pub struct TrackedDev {
    inner: Arc<dyn BlockDev>,
    since_open: DirtyMap,
    round: DirtyMap,
    state: AtomicU8,
    inflight: InFlightCount,
    wake: Mutex<()>,
    cv: Condvar,
    /// Destination: called once, by the first write served once the gate is open.
    on_write: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    watch_writes: std::sync::atomic::AtomicBool,
    wrote: std::sync::atomic::AtomicBool,
    /// Destination: the longest wait at the gate, in milliseconds.
    held_ms: AtomicU64,
    /// Pages written are logged (a cache on this host); off for the `server` types, whose
    /// cache the store server keeps: nothing of theirs is copied.
    track: bool,
    name: String,
}

impl std::fmt::Debug for TrackedDev {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrackedDev")
            .field("inner", &self.inner)
            .field("state", &self.state.load(SeqCst))
            .finish()
    }
}

/// What a round takes from the source's maps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// Everything since the open (a new session's first round); clears the round map too.
    All,
    /// What changed since the last take.
    Round,
}

impl TrackedDev {
    /// Over `inner`; `held` starts with the gate closed (an incoming attach).
    pub fn new(inner: Arc<dyn BlockDev>, name: &str, held: bool) -> TrackedDev {
        let size = BlockDev::size(&*inner);
        TrackedDev {
            inner,
            since_open: DirtyMap::new(size),
            round: DirtyMap::new(size),
            state: AtomicU8::new(if held { HELD } else { OPEN }),
            inflight: InFlightCount::default(),
            wake: Mutex::new(()),
            cv: Condvar::new(),
            on_write: Mutex::new(None),
            watch_writes: Default::default(),
            wrote: Default::default(),
            held_ms: AtomicU64::new(0),
            track: true,
            name: name.to_string(),
        }
    }

    /// The gate and the fence without the dirty log (the `server` types).
    pub fn untracked(mut self) -> TrackedDev {
        self.track = false;
        self
    }

    /// The device below (the write cache): a handover reads and writes it past the gate.
    pub fn below(&self) -> &Arc<dyn BlockDev> {
        &self.inner
    }

    fn dev(&self) -> &dyn BlockDev {
        &*self.inner
    }

    /// Marks bytes the cache holds that this device did not see written (a persistent
    /// cache reopened with an earlier attach's writes).
    pub fn mark_held(&self, offset: u64, len: u64) {
        self.since_open.mark(offset, len);
    }

    /// Writes past the gate (a handover's data), marked like a guest's write.
    pub fn apply_write(&self, buf: &[u8], offset: u64) -> Result<()> {
        let r = self.dev().write_at(buf, offset, false);
        self.mark(offset, buf.len() as u64);
        r
    }

    /// Zeroes past the gate (a handover's zero range), marked like a guest's.
    pub fn apply_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        let r = self.dev().write_zeroes(offset, len, ZeroFlags::default());
        self.mark(offset, len);
        r
    }

    /// The ranges to send next, at most `max_run` bytes each.
    pub fn take(&self, what: Take, max_run: u64) -> Vec<(u64, u64)> {
        match what {
            Take::All => {
                // Cleared first: a write landing after this is marked again for the next round.
                self.round.runs(u64::MAX, true, Some(&self.since_open));
                self.since_open.runs(max_run, false, None)
            }
            Take::Round => self.round.runs(max_run, true, Some(&self.since_open)),
        }
    }

    /// Bytes dirtied since the last round was taken.
    pub fn dirty_bytes(&self) -> u64 {
        self.round.bytes()
    }

    /// Bytes the cache holds beyond the vDisk.
    pub fn held_bytes(&self) -> u64 {
        let pages: u64 = self
            .since_open
            .words
            .iter()
            .zip(&self.round.words)
            .map(|(a, b)| u64::from((a.load(SeqCst) | b.load(SeqCst)).count_ones()))
            .sum();
        (pages * PAGE).min(self.since_open.size)
    }

    /// Destination: what the first write served after the gate opened calls (before the
    /// write runs).
    pub fn on_first_write(&self, f: Box<dyn FnOnce() + Send>) {
        *lock(&self.on_write) = Some(f);
        self.watch_writes.store(true, SeqCst);
    }

    /// Whether a write was served since the gate opened.
    pub fn wrote(&self) -> bool {
        self.wrote.load(SeqCst)
    }

    /// Source: refuses every new request and waits (at most `limit`) for those in
    /// flight; true when none is left.
    pub fn fence(&self, limit: Duration) -> bool {
        self.set(FENCED);
        let start = Instant::now();
        while self.inflight.total() != 0 {
            if start.elapsed() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        true
    }

    /// Opens the gate (destination after the handover) or lifts a fence (a source whose
    /// migration ended before its final delta).
    pub fn open(&self) {
        self.set(OPEN);
    }

    /// The handover cannot finish: every waiting and later request fails.
    pub fn fail(&self) {
        self.set(FAILED);
    }

    pub fn is_open(&self) -> bool {
        self.state.load(SeqCst) == OPEN
    }

    pub fn is_fenced(&self) -> bool {
        self.state.load(SeqCst) == FENCED
    }

    /// The longest a request waited at the gate, in milliseconds.
    pub fn held_ms(&self) -> u64 {
        self.held_ms.load(SeqCst)
    }

    fn set(&self, state: u8) {
        let _g = lock(&self.wake);
        self.state.store(state, SeqCst);
        self.cv.notify_all();
    }

    fn mark(&self, offset: u64, len: u64) {
        if self.track {
            self.round.mark(offset, len);
        }
    }

    /// Lets one request in, waiting at a closed gate; the guard counts it in flight.
    fn enter(&self, op: Op, offset: u64, len: u64) -> Result<InFlight<'_>> {
        let refused = |why: &str| {
            Error::new(
                ErrorKind::Io,
                op,
                offset,
                len,
                BlockDev::describe(self),
                why.to_string(),
            )
        };
        let write = matches!(op, Op::Write | Op::Trim | Op::Zero);
        loop {
            let slot = self.inflight.enter();
            let state = self.state.load(SeqCst);
            if state == OPEN || (state == HELD && !write) {
                if write
                    && state == OPEN
                    && self.watch_writes.load(SeqCst)
                    && self.watch_writes.swap(false, SeqCst)
                {
                    self.wrote.store(true, SeqCst);
                    if let Some(f) = lock(&self.on_write).take() {
                        f();
                    }
                }
                return Ok(InFlight(slot));
            }
            slot.fetch_sub(1, SeqCst);
            if state == FAILED {
                return Err(refused("the live migration into this agent failed: its cache is not whole, so it serves nothing (see the agent's log)"));
            }
            // Held (a write before the switch) or fenced: wait for the handover's outcome.
            let start = Instant::now();
            let mut g = lock(&self.wake);
            while self.state.load(SeqCst) == state {
                let left = HOLD_LIMIT.saturating_sub(start.elapsed());
                if left.is_zero() {
                    return Err(refused(if state == HELD {
                        "a live migration into this agent did not switch over in time; the target's cache is with its source agent"
                    } else {
                        "this agent handed the target over to another agent in a live migration (fenced): the guest runs there now"
                    }));
                }
                g = self
                    .cv
                    .wait_timeout(g, left)
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0;
            }
            drop(g);
            self.held_ms
                .fetch_max(start.elapsed().as_millis() as u64, SeqCst);
        }
    }
}

/// One request in flight, counted in its thread's slot.
struct InFlight<'a>(&'a AtomicU64);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, SeqCst);
    }
}

/// Requests in flight, counted in slots a cache line apart, each thread in its own (by a
/// thread-local index): one shared counter bouncing between the cores of every request
/// thread cost the agent's hop 14% of its IOPS. The fence sums the slots.
#[derive(Debug, Default)]
struct InFlightCount {
    slots: [Slot; SLOTS],
}

const SLOTS: usize = 16;

#[derive(Debug, Default)]
#[repr(align(128))]
struct Slot(AtomicU64);

impl InFlightCount {
    fn enter(&self) -> &AtomicU64 {
        use std::sync::atomic::AtomicUsize;
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        thread_local! {
            static INDEX: usize = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % SLOTS;
        }
        let slot = &self.slots[INDEX.with(|i| *i)].0;
        slot.fetch_add(1, SeqCst);
        slot
    }

    fn total(&self) -> u64 {
        self.slots.iter().map(|s| s.0.load(SeqCst)).sum()
    }
}

impl Filter for TrackedDev {
    type Inner = dyn BlockDev;
    fn inner(&self) -> &Self::Inner {
        &*self.inner
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let _g = self.enter(Op::Read, offset, buf.len() as u64)?;
        self.dev().read_at(buf, offset)
    }
    fn read_at_sparse(&self, buf: &mut [u8], offset: u64, holes: &mut Vec<Hole>) -> Result<()> {
        let _g = self.enter(Op::Read, offset, buf.len() as u64)?;
        self.dev().read_at_sparse(buf, offset, holes)
    }
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        let _g = self.enter(Op::Write, offset, buf.len() as u64)?;
        let r = self.dev().write_at(buf, offset, fua);
        self.mark(offset, buf.len() as u64);
        r
    }
    fn flush(&self) -> Result<()> {
        let _g = self.enter(Op::Flush, 0, 0)?;
        self.dev().flush()
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        let _g = self.enter(Op::Trim, offset, len)?;
        let r = self.dev().trim(offset, len, fua);
        self.mark(offset, len);
        r
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        let _g = self.enter(Op::Zero, offset, len)?;
        let r = self.dev().write_zeroes(offset, len, flags);
        self.mark(offset, len);
        r
    }
    fn block_status(
        &self,
        offset: u64,
        len: u64,
        out: &mut Vec<vdstream_blockdev::Extent>,
    ) -> Result<()> {
        let _g = self.enter(Op::BlockStatus, offset, len)?;
        self.dev().block_status(offset, len, out)
    }
    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        let _g = self.enter(Op::Cache, offset, len)?;
        self.dev().cache(offset, len)
    }
    fn describe(&self) -> String {
        format!("{} ({})", self.dev().describe(), self.name)
    }
    fn io_batch(&self, ops: &mut [BatchOp<'_>]) {
        let total: u64 = ops.iter().map(|o| o.len() as u64).sum();
        let first = ops.first().map_or(0, |o| o.offset);
        let guard = match self.enter(Op::Read, first, total) {
            Ok(g) => g,
            Err(e) => {
                for op in ops.iter_mut() {
                    let kind = if op.is_write() { Op::Write } else { Op::Read };
                    op.result = Err(Error::new(
                        e.kind,
                        kind,
                        op.offset,
                        op.len() as u64,
                        e.device.clone(),
                        e.message.clone(),
                    ));
                }
                return;
            }
        };
        self.dev().io_batch(ops);
        for op in ops.iter() {
            if let BatchIo::Write(buf, _) = &op.io {
                self.mark(op.offset, buf.len() as u64);
            }
        }
        drop(guard);
    }
}

#[cfg(test)]
mod tests {
    use super::{DirtyMap, Take, TrackedDev, PAGE};
    use proptest::prelude::*;
    use std::sync::atomic::AtomicU64;
    use std::sync::atomic::Ordering::SeqCst;
    use std::sync::Arc;
    use std::time::Duration;
    use vdstream_blockdev::{BlockDev, MemoryDev};
    use vdstream_blockdev::{ErrorKind, ZeroFlags};

    fn dev(size: u64, held: bool) -> TrackedDev {
        TrackedDev::new(Arc::new(MemoryDev::new(size)), "test", held)
    }

    #[test]
    fn runs_join_neighbouring_pages_and_stop_at_the_size() {
        let m = DirtyMap::new(10 * PAGE + 100);
        m.mark(PAGE + 1, 1);
        m.mark(2 * PAGE, 2 * PAGE);
        m.mark(10 * PAGE + 50, 10);
        assert_eq!(
            m.runs(u64::MAX, false, None),
            vec![(PAGE, 3 * PAGE), (10 * PAGE, 100)]
        );
        assert_eq!(
            m.runs(2 * PAGE, true, None),
            vec![(PAGE, 2 * PAGE), (3 * PAGE, PAGE), (10 * PAGE, 100)]
        );
        assert!(m.runs(u64::MAX, false, None).is_empty());
        assert_eq!(m.bytes(), 0);
    }

    /// Spawns `f` and waits until it is blocked (it has not finished after 30 ms).
    fn blocked<T: Send + 'static>(
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::thread::JoinHandle<T> {
        let t = std::thread::spawn(f);
        std::thread::sleep(Duration::from_millis(30));
        assert!(!t.is_finished(), "the request was not held");
        t
    }

    #[test]
    fn a_fence_holds_requests_until_it_is_lifted_and_a_failed_gate_errors() {
        let d = Arc::new(dev(1 << 20, false));
        d.write_at(&[1; 512], 0, false).unwrap();
        assert!(d.fence(Duration::from_secs(1)));
        let d2 = d.clone();
        let t = blocked(move || d2.write_at(&[2; 512], 0, false));
        // A reverted switch-over: the source serves on, the held write included.
        d.open();
        t.join().unwrap().unwrap();
        let mut b = [0u8; 512];
        d.read_at(&mut b, 0).unwrap();
        assert_eq!(b, [2; 512]);
        assert!(d.fence(Duration::from_secs(1)));
        let d2 = d.clone();
        let t = blocked(move || {
            let mut b = [0u8; 512];
            d2.read_at(&mut b, 0)
        });
        d.fail();
        let err = t.join().unwrap().unwrap_err();
        assert_eq!(err.kind, ErrorKind::Io);
        assert!(err.message.contains("failed"), "{err}");
    }

    #[test]
    fn a_held_gate_answers_reads_holds_writes_and_announces_the_first_write_after() {
        let d = Arc::new(dev(1 << 20, true));
        let mut b = [9u8; 4096];
        d.read_at(&mut b, 8192).unwrap();
        assert_eq!(b, [0; 4096]);
        let announced = Arc::new(AtomicU64::new(0));
        let a = announced.clone();
        d.on_first_write(Box::new(move || {
            a.fetch_add(1, SeqCst);
        }));
        let d2 = d.clone();
        let t = blocked(move || d2.write_at(&[5; 4096], 0, false));
        d.apply_write(&[7; 4096], 8192).unwrap();
        d.open();
        t.join().unwrap().unwrap();
        d.write_at(&[6; 512], 0, false).unwrap();
        assert_eq!(announced.load(SeqCst), 1);
        assert!(d.wrote());
        assert!(d.held_ms() >= 20, "{}", d.held_ms());
        d.read_at(&mut b, 8192).unwrap();
        assert_eq!(b, [7; 4096]);
        // The handover's data and the guest's writes count as held: this agent can hand
        // them on.
        assert_eq!(d.take(Take::All, u64::MAX), vec![(0, 4096), (8192, 4096)]);
    }

    #[test]
    fn an_untracked_device_gates_and_fences_but_logs_nothing_to_copy() {
        // The server types: the store server keeps the cache, the handover copies nothing.
        let d =
            Arc::new(TrackedDev::new(Arc::new(MemoryDev::new(1 << 20)), "test", true).untracked());
        let d2 = d.clone();
        let t = blocked(move || d2.write_at(&[5; 4096], 0, false));
        d.open();
        t.join().unwrap().unwrap();
        d.write_zeroes(65536, 8192, ZeroFlags::default()).unwrap();
        assert_eq!(d.dirty_bytes(), 0);
        assert!(d.take(Take::All, u64::MAX).is_empty());
        assert!(d.fence(Duration::from_secs(1)));
        let d2 = d.clone();
        let t = blocked(move || d2.write_at(&[6; 512], 0, false));
        d.open();
        t.join().unwrap().unwrap();
    }

    proptest! {
        /// A model of a migration: writes land between rounds; after a fence, the pages a
        /// destination received (full copy, then rounds, then the final round) read as the
        /// source's.
        #[test]
        fn rounds_then_a_final_delta_copy_every_byte(
            batches in proptest::collection::vec(
                proptest::collection::vec((0u64..256 * 1024, 1u64..20_000, any::<u8>(), 0u8..3), 0..12),
                1..5)
        ) {
            let size = 256 * 1024 + 777;
            let src = dev(size, false);
            let dst = dev(size, true);
            let copy = |runs: Vec<(u64, u64)>| {
                for (off, len) in runs {
                    let mut b = vec![0u8; len as usize];
                    src.below().read_at(&mut b, off).unwrap();
                    dst.apply_write(&b, off).unwrap();
                }
            };
            for (i, batch) in batches.iter().enumerate() {
                for &(off, len, byte, kind) in batch {
                    let len = len.min(size - off);
                    match kind {
                        0 => src.write_at(&vec![byte; len as usize], off, false).unwrap(),
                        1 => src.trim(off, len, false).unwrap(),
                        _ => src.write_zeroes(off, len, ZeroFlags::default()).unwrap(),
                    }
                }
                copy(src.take(if i == 0 { Take::All } else { Take::Round }, 64 * 1024));
            }
            prop_assert!(src.fence(Duration::from_secs(1)));
            copy(src.take(Take::Round, 64 * 1024));
            dst.open();
            let (mut a, mut b) = (vec![0u8; size as usize], vec![0u8; size as usize]);
            src.below().read_at(&mut a, 0).unwrap();
            dst.read_at(&mut b, 0).unwrap();
            prop_assert!(a == b);
        }
    }
}
