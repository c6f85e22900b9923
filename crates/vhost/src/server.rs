//! The vhost-user socket: one frontend (a qemu, a libblkio program) at a time, each on a
//! fresh device, for as long as the server runs.
//!
//! Invariants:
//! - The socket is bound once and stays while the server runs: a frontend that goes away
//!   (a guest powered off, qemu killed, a `reconnect-ms` chardev between two tries) can
//!   connect again at once, and gets a new device with empty queues (a vhost-user daemon
//!   serves one connection; its queue threads end with it).
//! - The block device is shared by every connection in turn: what one frontend wrote, the
//!   next one reads (a rebooting VM finds its write cache as it left it).
//! - [`VhostServer::stop`] ends the server within the current request batch: it wakes the
//!   accept by shutting the listening socket, and the frontend's socket; the queue threads
//!   finish the requests they hold before they end, and are waited for 10 s at most.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use vdstream_blockdev::lograte::LogLimiter;
use vdstream_blockdev::BlockDev;
use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vm_memory::GuestMemoryAtomic;

use crate::backend::Backend;
use crate::config::Options;
use crate::request::Stats;

/// A running vhost-user-blk server; see the module docs.
#[derive(Debug)]
pub struct VhostServer {
    path: PathBuf,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    /// The connected frontend's socket, to shut at stop.
    conn: Mutex<Option<ShutdownHandle>>,
    /// The connected frontend's device, told to stop its queue threads.
    device: Mutex<Option<Arc<Backend>>>,
    /// The listening socket, shut to wake an accept at stop.
    listener: Mutex<Option<UnixListener>>,
    stats: Arc<Stats>,
    /// Frontends that connected, and whether one is connected now.
    connections: AtomicU64,
    connected: AtomicBool,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("stop", &self.stop)
            .field("connections", &self.connections)
            .finish_non_exhaustive()
    }
}

/// What the server has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerFigures {
    pub connections: u64,
    pub connected: bool,
    pub requests: u64,
    pub errors: u64,
    pub malformed: u64,
    pub unsupported: u64,
}

impl VhostServer {
    /// Serves `dev` on `listener` (already bound at `path`) from a thread of its own.
    /// `name` names the device in log lines (the target id).
    pub fn start(
        listener: UnixListener,
        path: &Path,
        dev: Arc<dyn BlockDev>,
        opts: Options,
        name: &str,
    ) -> std::io::Result<VhostServer> {
        let bad = |why: String| Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, why));
        if !(1..=64).contains(&opts.queues) {
            return bad(format!("{} queues: offer 1 to 64", opts.queues));
        }
        if !opts.queue_size.is_power_of_two() || opts.queue_size > 32768 {
            return bad(format!(
                "a queue size of {}: a power of two up to 32768",
                opts.queue_size
            ));
        }
        listener.set_nonblocking(false)?;
        let shared = Arc::new(Shared::default());
        *shared.listener.lock().expect("listener lock") = Some(listener.try_clone()?);
        let (s, name, path_owned) = (shared.clone(), name.to_string(), path.to_path_buf());
        let thread = std::thread::Builder::new()
            .name("vhost-user".into())
            .spawn(move || {
                accept_loop(Listener::from(listener), &path_owned, dev, opts, &name, &s)
            })?;
        Ok(VhostServer {
            path: path.to_path_buf(),
            shared,
            thread: Some(thread),
        })
    }

    /// The counters of every connection so far.
    pub fn figures(&self) -> ServerFigures {
        let s = &self.shared.stats;
        let o = Ordering::Relaxed;
        ServerFigures {
            connections: self.shared.connections.load(o),
            connected: self.shared.connected.load(o),
            requests: s.requests.load(o),
            errors: s.errors.load(o),
            malformed: s.malformed.load(o),
            unsupported: s.unsupported.load(o),
        }
    }

    /// Ends the server: the frontend is disconnected, the queue threads finish what they
    /// hold, and the socket file is removed.
    pub fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(d) = self.shared.device.lock().expect("device lock").as_ref() {
            d.stop();
        }
        if let Some(h) = self.shared.conn.lock().expect("connection lock").as_ref() {
            h.shutdown();
        }
        // Wakes an accept that waits for a frontend: a shut listening socket fails it.
        if let Some(l) = self.shared.listener.lock().expect("listener lock").as_ref() {
            // SAFETY: shutdown(2) on a socket fd this server owns (a dup of the listener).
            unsafe { libc::shutdown(l.as_raw_fd(), libc::SHUT_RDWR) };
        }
        if let Some(t) = self.thread.take() {
            // A queue thread stuck in the device (a server that does not answer) must not
            // keep the agent from its last flush: wait a bounded time, then go on without it.
            let deadline = std::time::Instant::now() + STOP_PATIENCE;
            while !t.is_finished() && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            if t.is_finished() {
                let _ = t.join();
            } else {
                log::warn!("vhost-user-blk on {}: its threads did not end within {} s; going on without them", self.path.display(), STOP_PATIENCE.as_secs());
            }
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for VhostServer {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.stop();
        }
    }
}

/// How long [`VhostServer::stop`] waits for the queue threads.
const STOP_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

fn accept_loop(
    mut listener: Listener,
    path: &Path,
    dev: Arc<dyn BlockDev>,
    opts: Options,
    name: &str,
    shared: &Shared,
) {
    let log = Arc::new(LogLimiter::default());
    while !shared.stop.load(Ordering::SeqCst) {
        let mem = GuestMemoryAtomic::new(crate::backend::Mem::new());
        let made = Backend::new(
            dev.clone(),
            opts.clone(),
            mem.clone(),
            shared.stats.clone(),
            log.clone(),
            name.to_string(),
        )
        .map(Arc::new)
        .map_err(|e| e.to_string())
        .and_then(|b| {
            VhostUserDaemon::new("vhost-user-blk".into(), b.clone(), mem)
                .map(|d| (b, d))
                .map_err(|e| e.to_string())
        });
        let (backend, mut daemon) = match made {
            Ok(pair) => pair,
            Err(e) => {
                // Out of file descriptors or threads: try again, a second later.
                log::error!("{name}: vhost-user-blk on {}: cannot set up a device for the next frontend: {e}; trying again in 1 s", path.display());
                std::thread::sleep(std::time::Duration::from_secs(1));
                continue;
            }
        };
        *shared.device.lock().expect("device lock") = Some(backend.clone());
        if let Err(e) = daemon.start(&mut listener) {
            if shared.stop.load(Ordering::SeqCst) {
                break;
            }
            log::warn!(
                "{name}: vhost-user-blk on {}: a frontend could not connect: {e}",
                path.display()
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
            continue;
        }
        *shared.conn.lock().expect("connection lock") = daemon.shutdown_handle();
        if shared.stop.load(Ordering::SeqCst) {
            // The connection is stop's own wake-up (or came as it stopped): not a frontend.
            backend.stop();
            daemon.request_shutdown();
            let _ = daemon.wait();
            break;
        }
        let n = shared.connections.fetch_add(1, Ordering::Relaxed) + 1;
        shared.connected.store(true, Ordering::Relaxed);
        log::info!(
            "{name}: vhost-user-blk on {}: frontend {n} connected",
            path.display()
        );
        let ended = daemon.wait();
        *shared.conn.lock().expect("connection lock") = None;
        shared.connected.store(false, Ordering::Relaxed);
        // The frontend is gone, though its memory may still change: the queue threads stop
        // at their next batch, and dropping the daemon ends them.
        backend.stop();
        drop(daemon);
        *shared.device.lock().expect("device lock") = None;
        match ended {
            _ if shared.stop.load(Ordering::SeqCst) => break,
            // A frontend that closes its socket (qemu exits, a guest powers off) ends this way.
            Ok(())
            | Err(vhost_user_backend::Error::HandleRequest(
                vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage,
            )) => {
                log::info!(
                    "{name}: vhost-user-blk on {}: frontend {n} disconnected",
                    path.display()
                )
            }
            Err(e) => log::warn!(
                "{name}: vhost-user-blk on {}: frontend {n} disconnected: {e}",
                path.display()
            ),
        }
    }
}
