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

use std::sync::Arc;

use vdstream_blockdev::lograte::LogLimiter;
use vdstream_blockdev::BlockDev;
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_queue::QueueT;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier};

use crate::config::{config_window, Geometry, Options, CONFIG_LEN};
use crate::request::{Executor, Stats};

pub(crate) type Memory = GuestMemoryAtomic<GuestMemoryMmap>;

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
    /// One exit event per queue thread (the daemon ends its threads through them).
    exits: Vec<(EventConsumer, EventNotifier)>,
}

impl Backend {
    pub(crate) fn new(dev: Arc<dyn BlockDev>, opts: Options, mem: Memory, stats: Arc<Stats>, log: Arc<LogLimiter>, name: String) -> std::io::Result<Backend> {
        let geom = Geometry::of(&*dev, &opts);
        let config = geom.config_space(opts.queues);
        let exits = (0..threads(&opts)).map(|_| new_event_consumer_and_notifier(EventFlag::NONBLOCK)).collect::<std::io::Result<Vec<_>>>()?;
        Ok(Backend { dev, geom, opts, config, mem, stats, log, name, exits })
    }

    /// Serves `vring` until it holds no request, then re-arms its notification.
    fn serve_queue(&self, vring: &VringRwLock, buf: &mut Vec<u8>) -> std::io::Result<()> {
        loop {
            vring.disable_notification().map_err(std::io::Error::other)?;
            self.drain(vring, buf)?;
            if !vring.enable_notification().map_err(std::io::Error::other)? {
                return Ok(());
            }
        }
    }

    /// Carries out every request now in `vring` and signals the guest once for the batch.
    fn drain(&self, vring: &VringRwLock, buf: &mut Vec<u8>) -> std::io::Result<()> {
        let mem = self.mem.memory();
        let mut state = vring.get_mut();
        let mut used = 0usize;
        let mut exec = Executor { dev: &*self.dev, geom: &self.geom, stats: &self.stats, log: &self.log, name: &self.name, buf };
        while let Some(chain) = state.get_queue_mut().pop_descriptor_chain(mem.clone()) {
            let head = chain.head_index();
            let outcome = exec.execute(&mem, chain);
            if let Err(e) = state.add_used(head, outcome.used_len) {
                self.stats.malformed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.log.log(
                    log::Level::Warn,
                    "vdstream::vhost",
                    "vhost-used",
                    format_args!("{}: request {head} cannot be given back ({e}): dropped", self.name),
                );
                continue;
            }
            used += 1;
        }
        if used > 0 && state.needs_notification().map_err(std::io::Error::other)? {
            state.signal_used_queue()?;
        }
        Ok(())
    }
}

fn threads(opts: &Options) -> usize {
    usize::from(opts.threads.clamp(1, opts.queues.max(1)))
}

thread_local! {
    /// Each queue thread's bounce buffer (grows to the largest piece, 1 MiB at most).
    static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl VhostUserBackend for Backend {
    type Bitmap = ();
    type Vring = VringRwLock;

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
        // queue. (REPLY_ACK is added by the vhost crate.)
        VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
    }

    fn set_event_idx(&self, _enabled: bool) {
        // vhost-user-backend sets it on each vring itself (at SET_FEATURES).
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        config_window(&self.config, offset, size)
    }

    fn set_config(&self, _offset: u32, _buf: &[u8]) -> std::io::Result<()> {
        // Nothing is writable: no CONFIG_WCE (the cache mode is the write cache's).
        Err(std::io::Error::new(std::io::ErrorKind::PermissionDenied, "the configuration space of a vdstream disk is read-only"))
    }

    fn update_memory(&self, _mem: Memory) -> std::io::Result<()> {
        // The daemon replaced the map inside the GuestMemoryAtomic this backend holds.
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        let t = threads(&self.opts);
        (0..t).map(|thread| (0..usize::from(self.opts.queues.max(1))).filter(|q| q % t == thread).fold(0u64, |m, q| m | 1 << q)).collect()
    }

    fn exit_event(&self, thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        let (c, n) = self.exits.get(thread_index)?;
        Some((c.try_clone().ok()?, n.try_clone().ok()?))
    }

    fn handle_event(&self, device_event: u16, evset: EventSet, vrings: &[VringRwLock], _thread_id: usize) -> std::io::Result<()> {
        if evset != EventSet::IN {
            log::warn!("{}: queue event {device_event} with unexpected epoll events {evset:?}: ignored", self.name);
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
                self.log.log(log::Level::Warn, "vdstream::vhost", "vhost-queue", format_args!("{}: queue {device_event}: {e}", self.name));
            }
        });
        Ok(())
    }
}
