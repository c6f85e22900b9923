//! `UringQueue`: page I/O of one file through io_uring, batched across the threads that
//! call it, behind a plain synchronous call ([`UringQueue::read`], [`UringQueue::write`]).
//!
//! Design notes.
//!
//! - **One ring thread per queue** owns the ring (`IORING_SETUP_SINGLE_ISSUER` and
//!   `DEFER_TASKRUN` where the kernel has them, so completions are processed only when
//!   that thread asks and never interrupt a caller). A caller puts a [`Slot`] describing its
//!   I/O on the queue and parks; the ring thread takes *everything* queued, pushes it as
//!   one batch of SQEs, submits them with one `io_uring_enter` that also waits for the
//!   next completion, reaps every completion that is ready, and unparks each caller whose
//!   I/O finished. With many callers blocked at once (the NBD server's workers), many
//!   `pwrite`s become one submission (one block-layer plug, one device notification).
//!   Why not a "group commit" leader among the callers instead: io_uring runs a request's
//!   completion as task work of the thread that *submitted* it, so a leader that handed its
//!   role on would still be woken for completions of requests it submitted.
//! - **Waking the ring thread**: it sleeps in `io_uring_enter` until a completion arrives.
//!   An eventfd read is always armed in the ring; a caller writes the eventfd (a "nudge")
//!   only when fewer than [`NUDGE_BELOW`] requests are in flight, because otherwise the
//!   next completion comes soon and the ring thread takes the queue then — that wait is
//!   what makes batches. At most one nudge is outstanding per pass of the ring thread.
//! - **Short transfers, EINTR, EAGAIN**: the ring thread resubmits the rest of the request
//!   (same buffer, advanced) until it is whole; a transfer of 0 bytes ends a read with
//!   `UnexpectedEof` and a write with `WriteZero`, as `read_exact_at`/`write_all_at` do.
//!   Other errors go back to the caller as the `io::Error` of the errno, so ENOSPC and EIO
//!   map to the same kinds as with `pwrite`.
//! - **Hand-back**: a request the ring cannot take (the ring broke: `io_uring_enter` failed
//!   with an error that retrying cannot fix; or the queue is stopping) is handed back
//!   unsubmitted (`None`), and the caller does the I/O itself with `pread`/`pwrite`. A ring
//!   that broke stays broken (logged once): from then on every request is handed back.
//! - **Measured** (docs/BENCHMARKS.md, VDI profile through NBD, ext4 in a 2-CPU VM):
//!   batching works — the device notifications (`iowrite16` in perf) fall from 7% to 1% of
//!   the samples — yet the queue is *slower* than `pwrite` from the blocked workers: the ring
//!   thread does ext4's submission work (extent lookups) for every request alone, where the
//!   workers did it in parallel; every request costs one more thread hand-off (caller → ring
//!   thread → caller); and io_uring punts writes into preallocated, unwritten blocks to its
//!   io-wq threads. Hence `sync` is the default engine and this one is opt-in.
//!
//! Invariants: a caller's buffer is only touched by the kernel between the caller's push
//! and the moment the ring thread marks its slot done or handed back, and the caller does
//! not return (so the buffer and the slot stay alive) until then; a slot handed back was
//! never submitted and never will be; the ring thread exits only when no request is in the
//! kernel (the eventfd read included), so dropping the queue neither hangs nor leaves the
//! kernel writing into freed memory.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{JoinHandle, Thread};

use io_uring::{opcode, squeue, types, IoUring};

/// Submission queue entries (the completion queue gets twice as many).
const ENTRIES: u32 = 256;
/// A caller nudges the ring thread only while fewer requests than this are in flight.
pub const NUDGE_BELOW: usize = 4;
/// `IORING_ENTER_GETEVENTS` of the kernel ABI (the crate keeps its `sys` module private).
const IORING_ENTER_GETEVENTS: u32 = 1;
/// `user_data` of the eventfd read.
const NUDGE_TAG: u64 = u64::MAX;

const PENDING: u8 = 0;
const DONE: u8 = 1;
const HANDED_BACK: u8 = 2;
/// `Slot::outcome` values besides 0 (success) and a positive errno.
const EOF: i32 = -1;
const WROTE_ZERO: i32 = -2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    Read,
    Write,
}

/// One caller's I/O, on the caller's stack while it waits.
struct Slot {
    dir: Dir,
    fd: RawFd,
    ptr: *mut u8,
    len: usize,
    offset: u64,
    waiter: Thread,
    state: AtomicU8,
    /// 0, a positive errno, [`EOF`] or [`WROTE_ZERO`]; written before `state` leaves PENDING.
    outcome: AtomicI32,
}

/// A pointer to a waiting caller's [`Slot`].
#[derive(Clone, Copy)]
struct SlotPtr(*const Slot);

// SAFETY: the slot is only read through this pointer (its mutable parts are atomics), and
// its owner keeps it alive until the ring thread has finished with it (module invariants).
unsafe impl Send for SlotPtr {}

impl SlotPtr {
    fn slot(&self) -> &Slot {
        // SAFETY: the owner of the slot waits (and so keeps it alive) until its state
        // leaves PENDING, and the ring thread never uses the pointer after that store.
        unsafe { &*self.0 }
    }

    /// Publishes `state` with `outcome` and wakes the owner. The pointer must not be used
    /// after this call.
    fn finish(self, state: u8, outcome: i32) {
        let slot = self.slot();
        // Clone the handle first: once `state` is stored the owner may return and free the slot.
        let waiter = slot.waiter.clone();
        slot.outcome.store(outcome, Ordering::Relaxed);
        slot.state.store(state, Ordering::Release);
        waiter.unpark();
    }
}

/// What callers and the ring thread share.
struct Queue {
    incoming: Vec<SlotPtr>,
    /// Requests the ring thread holds (taken from `incoming`, not yet finished).
    in_flight: usize,
    /// The eventfd was written since the ring thread last took `incoming`.
    nudged: bool,
    /// The owner is dropping the queue: no new requests.
    stop: bool,
    /// The ring failed: every request is handed back.
    broken: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    nudge: OwnedFd,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn nudge(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live local buffer to the eventfd this struct owns.
        // A full counter (EAGAIN) already means "wake up"; nothing else can fail here.
        let _ = unsafe { libc::write(self.nudge.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }
}

/// A batched io_uring engine for one file; see the module notes.
pub struct UringQueue {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for UringQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringQueue")
            .field("broken", &self.shared.lock().broken)
            .finish()
    }
}

impl UringQueue {
    /// Starts the ring thread (named after `what`) and its ring; fails with the error of
    /// the ring's setup (ENOSYS on old kernels, EPERM under seccomp or with io_uring
    /// disabled, EINVAL when the kernel lacks the read/write opcodes).
    pub fn new(what: &str) -> io::Result<UringQueue> {
        // SAFETY: eventfd takes two integer arguments and returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by nothing else.
        let nudge = unsafe { OwnedFd::from_raw_fd(fd) };
        let queue = Queue {
            incoming: Vec::new(),
            in_flight: 0,
            nudged: false,
            stop: false,
            broken: false,
        };
        let shared = Arc::new(Shared {
            queue: Mutex::new(queue),
            nudge,
        });
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let ring_shared = shared.clone();
        let name: String = format!("uring {what}").chars().take(15).collect();
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || match setup_ring() {
                Ok(ring) => {
                    let _ = tx.send(Ok(()));
                    RingThread::new(ring, ring_shared).run();
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                }
            })?;
        let ready = rx
            .recv()
            .unwrap_or_else(|_| Err(io::Error::other("the io_uring thread ended during setup")));
        if let Err(e) = ready {
            let _ = thread.join();
            return Err(e);
        }
        Ok(UringQueue {
            shared,
            thread: Some(thread),
        })
    }

    /// Reads `buf.len()` bytes at `offset` of `fd`; `None` hands the request back unread.
    pub fn read(&self, fd: RawFd, buf: &mut [u8], offset: u64) -> Option<io::Result<()>> {
        self.run(Dir::Read, fd, buf.as_mut_ptr(), buf.len(), offset)
    }

    /// Writes `buf` at `offset` of `fd`; `None` hands the request back unwritten.
    pub fn write(&self, fd: RawFd, buf: &[u8], offset: u64) -> Option<io::Result<()>> {
        // The kernel only reads the buffer of a write; the pointer is mutable for the slot's sake.
        self.run(Dir::Write, fd, buf.as_ptr().cast_mut(), buf.len(), offset)
    }

    /// Whether the ring broke and every request is handed back.
    pub fn is_broken(&self) -> bool {
        self.shared.lock().broken
    }

    fn run(
        &self,
        dir: Dir,
        fd: RawFd,
        ptr: *mut u8,
        len: usize,
        offset: u64,
    ) -> Option<io::Result<()>> {
        if len == 0 {
            return Some(Ok(()));
        }
        let slot = Slot {
            dir,
            fd,
            ptr,
            len,
            offset,
            waiter: std::thread::current(),
            state: AtomicU8::new(PENDING),
            outcome: AtomicI32::new(0),
        };
        let nudge = {
            let mut q = self.shared.lock();
            if q.broken || q.stop {
                return None;
            }
            q.incoming.push(SlotPtr(&slot));
            let nudge = !q.nudged && q.in_flight < NUDGE_BELOW;
            q.nudged |= nudge;
            nudge
        };
        if nudge {
            self.shared.nudge();
        }
        // The slot is on the ring thread's queue: do not return (and free it) before it is
        // finished. park() may return spuriously; the state decides.
        loop {
            match slot.state.load(Ordering::Acquire) {
                PENDING => std::thread::park(),
                HANDED_BACK => return None,
                _ => break,
            }
        }
        Some(match slot.outcome.load(Ordering::Relaxed) {
            0 => Ok(()),
            EOF => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "failed to fill whole buffer",
            )),
            WROTE_ZERO => Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "failed to write whole buffer",
            )),
            errno => Err(io::Error::from_raw_os_error(errno)),
        })
    }
}

impl Drop for UringQueue {
    fn drop(&mut self) {
        // No caller can be waiting (they borrow the queue), so nothing is in flight but the
        // eventfd read, which this nudge completes; the ring thread then ends.
        self.shared.lock().stop = true;
        self.shared.nudge();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                log::error!("the io_uring thread panicked");
            }
        }
    }
}

/// A ring that can do what the queue needs: single issuer and deferred task work when the
/// kernel has them (6.1+), plain otherwise; read and write opcodes present.
fn setup_ring() -> io::Result<IoUring> {
    setup_ring_of(ENTRIES)
}

/// A ring of `entries` for one thread's use (`SINGLE_ISSUER` and `DEFER_TASKRUN` where the
/// kernel has them) that can read and write files; also [`crate::ring`]'s per-thread ring.
pub(crate) fn setup_ring_of(entries: u32) -> io::Result<IoUring> {
    let ring = match IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(entries)
    {
        Ok(r) => r,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => IoUring::new(entries)?,
        Err(e) => return Err(e),
    };
    let mut probe = io_uring::Probe::new();
    ring.submitter().register_probe(&mut probe)?;
    if !probe.is_supported(opcode::Read::CODE) || !probe.is_supported(opcode::Write::CODE) {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    Ok(ring)
}

/// A request the ring thread holds: the slot and how many bytes are done.
#[derive(Clone, Copy)]
struct Held {
    slot: SlotPtr,
    done: usize,
}

/// The ring thread's state; see the module notes.
struct RingThread {
    ring: IoUring,
    shared: Arc<Shared>,
    /// Requests in the kernel, indexed by `user_data`.
    in_kernel: Vec<Option<Held>>,
    free: Vec<usize>,
    /// Requests (or the rest of them) waiting for room in the ring.
    backlog: VecDeque<Held>,
    /// Requests finished since `in_flight` was last brought down.
    finished: usize,
    nudge_armed: bool,
    nudge_buf: Box<u64>,
    /// `user_data` of the entries pushed but not yet consumed by `io_uring_enter`, oldest first.
    unconsumed: VecDeque<u64>,
}

impl RingThread {
    fn new(ring: IoUring, shared: Arc<Shared>) -> RingThread {
        let cap = ENTRIES as usize - 1; // one entry stays for the eventfd read
        RingThread {
            ring,
            shared,
            in_kernel: vec![None; cap],
            free: (0..cap).rev().collect(),
            backlog: VecDeque::new(),
            finished: 0,
            nudge_armed: false,
            nudge_buf: Box::new(0),
            unconsumed: VecDeque::new(),
        }
    }

    fn run(mut self) {
        loop {
            let (stop, broken) = {
                let mut q = self.shared.lock();
                q.in_flight -= self.finished;
                self.finished = 0;
                q.nudged = false;
                q.in_flight += q.incoming.len();
                let (stop, broken) = (q.stop, q.broken);
                for slot in q.incoming.drain(..) {
                    if broken {
                        // Not submitted, never will be: the caller does it itself.
                        self.finished += 1;
                        slot.finish(HANDED_BACK, 0);
                    } else {
                        self.backlog.push_back(Held { slot, done: 0 });
                    }
                }
                (stop, broken)
            };
            let kernel_idle = self.free.len() == self.in_kernel.len() && !self.nudge_armed;
            if broken {
                // Nothing new is queued once `broken` is set (callers see it under the lock,
                // and the drain above handed back what came before): end when the kernel is done.
                if kernel_idle {
                    return;
                }
            } else {
                if !self.nudge_armed && !stop {
                    self.arm_nudge();
                }
                self.push_backlog();
                if stop && kernel_idle && self.backlog.is_empty() {
                    return;
                }
            }
            // Submit what was pushed, wait for one completion (the eventfd read included).
            let entered = if broken {
                // SAFETY: submits nothing (to_submit 0), only waits for completions; no
                // argument pointer is passed.
                unsafe {
                    self.ring.submitter().enter::<libc::sigset_t>(
                        0,
                        1,
                        IORING_ENTER_GETEVENTS,
                        None,
                    )
                }
            } else {
                self.ring.submit_and_wait(1)
            };
            match entered {
                Ok(n) if !broken => {
                    self.unconsumed.drain(..n.min(self.unconsumed.len()));
                }
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
                    ) => {}
                Err(e) if broken => {
                    log::error!("io_uring wait failed ({e}); retrying");
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                Err(e) => self.break_ring(e),
            }
            self.reap();
        }
    }

    fn arm_nudge(&mut self) {
        let buf: *mut u64 = &mut *self.nudge_buf;
        let entry = opcode::Read::new(types::Fd(self.shared.nudge.as_raw_fd()), buf.cast(), 8)
            .build()
            .user_data(NUDGE_TAG);
        // SAFETY: the eventfd and `nudge_buf` live as long as this thread, which does not
        // end while the read is armed (`nudge_armed`).
        if unsafe { self.ring.submission().push(&entry) }.is_ok() {
            self.nudge_armed = true;
            self.unconsumed.push_back(NUDGE_TAG);
        }
    }

    /// Pushes backlogged requests while the ring and the index table have room.
    fn push_backlog(&mut self) {
        let mut sq = self.ring.submission();
        while let Some(held) = self.backlog.front().copied() {
            let Some(&index) = self.free.last() else {
                break;
            };
            let slot = held.slot.slot();
            // SAFETY: `done < len`, so the pointer stays inside the caller's buffer.
            let ptr = unsafe { slot.ptr.add(held.done) };
            let len = (slot.len - held.done) as u32;
            let fd = types::Fd(slot.fd);
            let offset = slot.offset + held.done as u64;
            let entry: squeue::Entry = match slot.dir {
                Dir::Read => opcode::Read::new(fd, ptr, len).offset(offset).build(),
                Dir::Write => opcode::Write::new(fd, ptr, len).offset(offset).build(),
            };
            // SAFETY: the buffer is the caller's, valid for `len` bytes from `ptr` until the
            // slot is finished, which happens only after this entry's completion is reaped.
            if unsafe { sq.push(&entry.user_data(index as u64)) }.is_err() {
                break;
            }
            self.free.pop();
            self.in_kernel[index] = Some(held);
            self.backlog.pop_front();
            self.unconsumed.push_back(index as u64);
        }
    }

    fn reap(&mut self) {
        let done: Vec<(u64, i32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (tag, res) in done {
            if tag == NUDGE_TAG {
                self.nudge_armed = false;
                continue;
            }
            let index = tag as usize;
            let Some(mut held) = self.in_kernel[index].take() else {
                log::error!("io_uring returned a completion for no request ({tag})");
                continue;
            };
            self.free.push(index);
            let slot = held.slot.slot();
            let outcome = match res {
                r if r == -libc::EINTR || r == -libc::EAGAIN => {
                    self.backlog.push_front(held);
                    continue;
                }
                r if r < 0 => -r,
                0 if slot.dir == Dir::Read => EOF,
                0 => WROTE_ZERO,
                n => {
                    held.done += n as usize;
                    if held.done < slot.len {
                        self.backlog.push_back(held);
                        continue;
                    }
                    0
                }
            };
            self.finished += 1;
            held.slot.finish(DONE, outcome);
        }
    }

    /// The ring cannot submit: hand back every request that is not in the kernel (the
    /// backlog, and entries pushed but not consumed, which nothing submits from now on);
    /// requests already in the kernel are still reaped.
    #[cold]
    fn break_ring(&mut self, e: io::Error) {
        log::error!("io_uring submission failed ({e}); this file's I/O goes through pread/pwrite from now on");
        self.shared.lock().broken = true;
        for tag in std::mem::take(&mut self.unconsumed) {
            if tag == NUDGE_TAG {
                self.nudge_armed = false;
            } else if let Some(held) = self.in_kernel[tag as usize].take() {
                self.free.push(tag as usize);
                self.backlog.push_back(held);
            }
        }
        for held in self.backlog.drain(..) {
            self.finished += 1;
            held.slot.finish(HANDED_BACK, 0);
        }
    }
}
