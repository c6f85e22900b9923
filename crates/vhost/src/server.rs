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
//!   accept with a connection of its own, or shuts the frontend's socket; the queue threads
//!   finish the requests they hold before they end.

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use vdstream_blockdev::lograte::LogLimiter;
use vdstream_blockdev::BlockDev;
use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

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
    stats: Arc<Stats>,
    /// Frontends that connected, and whether one is connected now.
    connections: AtomicU64,
    connected: AtomicBool,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("stop", &self.stop).field("connections", &self.connections).finish_non_exhaustive()
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
    pub fn start(listener: UnixListener, path: &Path, dev: Arc<dyn BlockDev>, opts: Options, name: &str) -> std::io::Result<VhostServer> {
        listener.set_nonblocking(false)?;
        let shared = Arc::new(Shared::default());
        let (s, name, path_owned) = (shared.clone(), name.to_string(), path.to_path_buf());
        let thread =
            std::thread::Builder::new().name("vhost-user".into()).spawn(move || accept_loop(Listener::from(listener), &path_owned, dev, opts, &name, &s))?;
        Ok(VhostServer { path: path.to_path_buf(), shared, thread: Some(thread) })
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
        if let Some(h) = self.shared.conn.lock().expect("connection lock").as_ref() {
            h.shutdown();
        }
        // Wakes an accept that waits for a frontend (and is refused at once).
        let _ = UnixStream::connect(&self.path);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
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

fn accept_loop(mut listener: Listener, path: &Path, dev: Arc<dyn BlockDev>, opts: Options, name: &str, shared: &Shared) {
    let log = Arc::new(LogLimiter::default());
    while !shared.stop.load(Ordering::SeqCst) {
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let backend = match Backend::new(dev.clone(), opts.clone(), mem.clone(), shared.stats.clone(), log.clone(), name.to_string()) {
            Ok(b) => Arc::new(b),
            Err(e) => {
                log::error!("{name}: vhost-user-blk on {}: cannot set up a device: {e}; stopped", path.display());
                return;
            }
        };
        let mut daemon = match VhostUserDaemon::new("vhost-user-blk".into(), backend, mem) {
            Ok(d) => d,
            Err(e) => {
                log::error!("{name}: vhost-user-blk on {}: cannot set up a device: {e}; stopped", path.display());
                return;
            }
        };
        if let Err(e) = daemon.start(&mut listener) {
            if shared.stop.load(Ordering::SeqCst) {
                break;
            }
            log::warn!("{name}: vhost-user-blk on {}: a frontend could not connect: {e}", path.display());
            std::thread::sleep(std::time::Duration::from_millis(100));
            continue;
        }
        *shared.conn.lock().expect("connection lock") = daemon.shutdown_handle();
        if shared.stop.load(Ordering::SeqCst) {
            // The connection is stop's own wake-up (or came as it stopped): not a frontend.
            daemon.request_shutdown();
            let _ = daemon.wait();
            break;
        }
        let n = shared.connections.fetch_add(1, Ordering::Relaxed) + 1;
        shared.connected.store(true, Ordering::Relaxed);
        log::info!("{name}: vhost-user-blk on {}: frontend {n} connected", path.display());
        let ended = daemon.wait();
        *shared.conn.lock().expect("connection lock") = None;
        shared.connected.store(false, Ordering::Relaxed);
        // Dropping the daemon ends this connection's queue threads (they finish their batch).
        drop(daemon);
        match ended {
            _ if shared.stop.load(Ordering::SeqCst) => break,
            // A frontend that closes its socket (qemu exits, a guest powers off) ends this way.
            Ok(()) | Err(vhost_user_backend::Error::HandleRequest(vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage)) => {
                log::info!("{name}: vhost-user-blk on {}: frontend {n} disconnected", path.display())
            }
            Err(e) => log::warn!("{name}: vhost-user-blk on {}: frontend {n} disconnected: {e}", path.display()),
        }
    }
}
