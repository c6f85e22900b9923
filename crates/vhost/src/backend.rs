//! The vhost-user-blk device of one frontend connection: what vhost-user-backend's daemon
//! asks of a backend (features, configuration space, queues and their threads), and the
//! loop that serves a queue when the guest kicks it.
//!
//! Invariants:
//! - `&self` everywhere, no lock around the backend: each queue thread serves its own
//!   queues, so several queues run at once (vhost-user-backend's `Mutex<T>` wrapper would
//!   serialise them).
//! - A queue is drained with notifications off and re-armed after; when re-arming finds
//!   new requests it drains again, so with EVENT_IDX no kick is lost.
//! - The queue's lock is held for a whole batch: GET_VRING_BASE (a frontend stopping the
//!   device) waits for the requests being carried out, and none is lost or done twice.
//! - Nothing the frontend sends ends a queue thread: errors are logged and counted, and the
//!   thread goes on (only the exit event ends it).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use vdstream_blockdev::lograte::LogLimiter;
use vdstream_blockdev::BlockDev;
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringState, VringT};
use virtio_queue::QueueT;
use vm_memory::{
    GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use crate::config::{config_window, Geometry, Options, CONFIG_LEN};
use crate::dirty::DirtyLog;
use crate::request::{Executor, Stats};

/// Guest memory with a dirty log per region: while qemu migrates the VM, every page this
/// backend writes (read data, status bytes, the used ring) is marked in the log qemu gave
/// with SET_LOG_BASE, so qemu sends it again ([`crate::dirty`]).
pub(crate) type Mem = GuestMemoryMmap<DirtyLog>;
pub(crate) type Memory = GuestMemoryAtomic<Mem>;

/// One connection's device. Shared by the daemon and every queue thread.
#[derive(Debug)]
pub struct Backend {
    dev: Arc<dyn BlockDev>,
    geom: Geometry,
    opts: Options,
    config: [u8; CONFIG_LEN],
    mem: Memory,
    stats: Arc<Stats>,
    log: Arc<LogLimiter>,
    name: String,
    /// One exit event per queue thread, handed to the daemon once (it ends its threads
    /// through them).
    exits: Mutex<Vec<Option<(EventConsumer, EventNotifier)>>>,
    /// The exit consumers' fds: vhost-user-backend 0.24 registers them with `into_raw_fd`
    /// and never closes them, so this backend does, when the last queue thread is gone.
    handed: Mutex<Vec<RawFd>>,
    /// The connection is over (or the server stops): queue threads leave their loop.
    stopping: AtomicBool,
    /// The frontend acknowledged VIRTIO_BLK_F_FLUSH. Until it does, a write is stable
    /// when it completes (virtio 1.2 §5.2.6.2): writes are FUA.
    flush_acked: AtomicBool,
}

impl Backend {
    pub(crate) fn new(
        dev: Arc<dyn BlockDev>,
        opts: Options,
        mem: Memory,
        stats: Arc<Stats>,
        log: Arc<LogLimiter>,
        name: String,
    ) -> std::io::Result<Backend> {
        let geom = Geometry::of(&*dev, &opts);
        let config = geom.config_space(opts.queues);
        let exits = (0..threads(&opts))
            .map(|_| {
                new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC).map(Some)
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(Backend {
            dev,
            geom,
            opts,
            config,
            mem,
            stats,
            log,
            name,
            exits: Mutex::new(exits),
            handed: Mutex::new(Vec::new()),
            stopping: AtomicBool::new(false),
            flush_acked: AtomicBool::new(false),
        })
    }

    /// Makes every queue thread leave its loop at the next batch.
    pub(crate) fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    /// Serves `vring` until it holds no request, then re-arms its notification. A batch is
    /// at most one queue's worth of chains, so the vring's lock is let go between batches
    /// (GET_VRING_BASE, a stop) however fast the guest publishes.
    fn serve_queue(&self, vring: &VringRwLock<Memory>, buf: &mut Vec<u8>) -> std::io::Result<()> {
        while !self.stopping.load(Ordering::Relaxed) {
            let mem = self.mem.memory();
            let mut state = vring.get_mut();
            let queue = state.get_queue();
            if !queue.ready() || !state.is_enabled() {
                return Ok(());
            }
            let size = queue.size();
            // An available index more than a queue ahead is the frontend's bug: virtio-queue
            // would refuse each pop and this thread would spin. Leave the queue as it is.
            let ahead = queue
                .avail_idx(&*mem, Ordering::Acquire)
                .map_err(std::io::Error::other)?
                .0
                .wrapping_sub(queue.next_avail());
            if ahead > size {
                self.stats.malformed.fetch_add(1, Ordering::Relaxed);
                self.log.log(
                    log::Level::Warn,
                    "vdstream::vhost",
                    "vhost-queue",
                    format_args!(
                        "{}: the frontend's available index is {ahead} ahead on a queue of {size}: the queue is stopped until it reconnects",
                        self.name
                    ),
                );
                return Ok(());
            }
            state
                .disable_notification()
                .map_err(std::io::Error::other)?;
            let popped = self.batch(&mut state, &mem, usize::from(size), buf)?;
            if popped == 0 && ahead > 0 {
                // Chains were there and none could be taken (the ring itself is outside the
                // frontend's memory): as above.
                self.stats.malformed.fetch_add(1, Ordering::Relaxed);
                self.log.log(
                    log::Level::Warn,
                    "vdstream::vhost",
                    "vhost-queue",
                    format_args!("{}: {ahead} chains are available and none can be read: the queue is stopped until the frontend reconnects", self.name),
                );
                return Ok(());
            }
            if popped == usize::from(size) {
                continue;
            }
            if !state.enable_notification().map_err(std::io::Error::other)? {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Carries out at most `max` requests of the queue and signals the guest once for them;
    /// returns how many chains it took.
    fn batch(
        &self,
        state: &mut VringState<Memory>,
        mem: &Mem,
        max: usize,
        buf: &mut Vec<u8>,
    ) -> std::io::Result<usize> {
        let write_through = !self.flush_acked.load(Ordering::Relaxed);
        let mut exec = Executor {
            dev: &*self.dev,
            geom: &self.geom,
            stats: &self.stats,
            log: &self.log,
            name: &self.name,
            write_through,
            buf,
        };
        let mut popped = 0;
        let mut used = 0;
        while popped < max {
            let Some(chain) = state.get_queue_mut().pop_descriptor_chain(mem) else {
                break;
            };
            popped += 1;
            let head = chain.head_index();
            let outcome = exec.execute(mem, chain);
            if let Err(e) = state.add_used(head, outcome.used_len) {
                self.stats.malformed.fetch_add(1, Ordering::Relaxed);
                self.log.log(
                    log::Level::Warn,
                    "vdstream::vhost",
                    "vhost-used",
                    format_args!(
                        "{}: request {head} cannot be given back ({e}): dropped",
                        self.name
                    ),
                );
                continue;
            }
            used += 1;
        }
        if used > 0 && state.needs_notification().map_err(std::io::Error::other)? {
            state.signal_used_queue()?;
        }
        Ok(popped)
    }

    /// Refuses a memory table the backend cannot use safely; the map is emptied then, so no
    /// request touches it.
    fn check_memory(&self) -> std::io::Result<()> {
        let mem = self.mem.memory();
        let mut why = None;
        if mem.num_regions() > MAX_REGIONS {
            why = Some(format!(
                "{} memory regions, above the {MAX_REGIONS} a frontend may give",
                mem.num_regions()
            ));
        }
        for r in mem.iter() {
            let Some(fo) = r.file_offset() else { continue };
            let need = fo.start().saturating_add(r.len());
            match fo.file().metadata() {
                // A file shorter than its mapping would raise SIGBUS at the first access.
                Ok(m) if m.len() < need => {
                    why = Some(format!(
                    "a region of {} bytes at guest address {:#x} is backed by a file of {} bytes",
                    r.len(),
                    r.start_addr().0,
                    m.len()
                ))
                }
                Err(e) => why = Some(format!("a region's file cannot be checked: {e}")),
                Ok(_) => {}
            }
        }
        drop(mem);
        if let Some(why) = why {
            self.mem
                .lock()
                .expect("guest memory lock")
                .replace(Mem::new());
            log::warn!(
                "{}: the frontend's memory table is refused: {why}",
                self.name
            );
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, why));
        }
        Ok(())
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        for fd in self
            .handed
            .lock()
            .map(|mut v| std::mem::take(&mut *v))
            .unwrap_or_default()
        {
            // SAFETY: each fd was an exit consumer handed to vhost-user-backend, which turned
            // it into a raw fd for its epoll and never closes it; its epoll and thread are
            // gone (they held this backend), so nothing else uses or closes it.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
        }
    }
}

/// Memory regions a frontend may give (vhost-user's VHOST_USER_MAX_RAM_SLOTS).
const MAX_REGIONS: usize = 509;

fn threads(opts: &Options) -> usize {
    usize::from(opts.threads.clamp(1, opts.queues.max(1)))
}

thread_local! {
    /// Each queue thread's bounce buffer (grows to the largest piece, 1 MiB at most).
    static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl VhostUserBackend for Backend {
    type Bitmap = DirtyLog;
    type Vring = VringRwLock<Memory>;

    fn num_queues(&self) -> usize {
        usize::from(self.opts.queues.max(1))
    }

    fn max_queue_size(&self) -> usize {
        usize::from(self.opts.queue_size)
    }

    fn features(&self) -> u64 {
        self.geom.features(self.opts.queues)
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        // CONFIG: qemu's vhost-user-blk reads the configuration space; CONFIGURE_MEM_SLOTS:
        // libblkio's frontend requires it; MQ: GET_QUEUE_NUM, without which qemu takes one
        // queue; LOG_SHMFD: the dirty log comes as a shared memfd (SET_LOG_BASE), without
        // which qemu cannot migrate the VM. (REPLY_ACK is added by the vhost crate.)
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::LOG_SHMFD
    }

    fn set_event_idx(&self, _enabled: bool) {
        // vhost-user-backend sets it on each vring itself (at SET_FEATURES).
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        config_window(&self.config, offset, size)
    }

    fn set_config(&self, _offset: u32, _buf: &[u8]) -> std::io::Result<()> {
        // Nothing is writable: no CONFIG_WCE (the cache mode is the write cache's).
        Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            "the configuration space of a vdstream disk is read-only",
        ))
    }

    fn acked_features(&self, features: u64) {
        self.flush_acked.store(
            features & 1 << virtio_bindings::bindings::virtio_blk::VIRTIO_BLK_F_FLUSH != 0,
            Ordering::Relaxed,
        );
    }

    fn update_memory(&self, _mem: Memory) -> std::io::Result<()> {
        // The daemon replaced the map inside the GuestMemoryAtomic this backend holds.
        self.check_memory()
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        let t = threads(&self.opts);
        (0..t)
            .map(|thread| {
                (0..usize::from(self.opts.queues.max(1)))
                    .filter(|q| q % t == thread)
                    .fold(0u64, |m, q| m | 1 << q)
            })
            .collect()
    }

    fn exit_event(&self, thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        let pair = self
            .exits
            .lock()
            .expect("exit events lock")
            .get_mut(thread_index)?
            .take();
        match pair {
            Some((consumer, notifier)) => {
                self.handed
                    .lock()
                    .expect("exit events lock")
                    .push(consumer.as_raw_fd());
                Some((consumer, notifier))
            }
            None => {
                log::error!(
                    "{}: queue thread {thread_index} asked for its exit event twice",
                    self.name
                );
                None
            }
        }
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[VringRwLock<Memory>],
        _thread_id: usize,
    ) -> std::io::Result<()> {
        if !evset.contains(EventSet::IN) {
            log::warn!(
                "{}: queue event {device_event} with unexpected epoll events {evset:?}: ignored",
                self.name
            );
            return Ok(());
        }
        let Some(vring) = vrings.get(usize::from(device_event)) else {
            return Ok(());
        };
        BUF.with(|buf| {
            let mut buf = buf.borrow_mut();
            if let Err(e) = self.serve_queue(vring, &mut buf) {
                // A ring the frontend broke (an avail index too far ahead, a used ring outside
                // its memory): this kick is dropped, the thread goes on.
                self.log.log(
                    log::Level::Warn,
                    "vdstream::vhost",
                    "vhost-queue",
                    format_args!("{}: a queue of thread {_thread_id}: {e}", self.name),
                );
            }
        });
        Ok(())
    }
}
