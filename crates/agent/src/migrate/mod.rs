//! Live migration of a VM target's write cache from one agent (the source, on the host the
//! VM leaves) to another (the destination, on the host it goes to), while the guest runs.
//!
//! ```text
//!   source agent A                                  destination agent B (--incoming A)
//!   serves the guest; logs dirty pages       ◀── Hello (target, vDisk, cache type)
//!   round 0: everything its cache holds      ──▶ written into B's cache, past its gate
//!   rounds 1..: what the guest dirtied       ──▶ (B's export answers reads, holds writes)
//!   ... converged: rounds stay small ...
//!   qemu reaches pre-switchover (source VM stopped, its disk flushed):
//!     `vdstream target migrate` sends Switch to A
//!   fence: hold new requests, wait for those in flight
//!   the final delta                          ──▶ written; B flushes its cache
//!   Done                                     ──▶ B opens its gate, then Ack (phase switched)
//!   qemu completes: Commit                   ──▶ A ends (its persistent cache files removed)
//!   (qemu fails after the switch: Revert     ──▶ B fails its gate ──▶ Reverted; A serves on)
//! ```
//!
//! The `server` types (`server`, `server-persistent`) keep their cache on the store server:
//! the handover moves their attach. The destination asks its source for the attach (Join,
//! before it opens its vDisk) and connects to it with its secret, as a reconnect would; its
//! reads see the server's cache at once, its writes wait at its gate. Nothing is copied: at
//! the switch the source fences and flushes the server (its journal of answered writes is
//! then empty), and the destination opens its gate.
//!
//! Why it is safe:
//! - Before the switch the destination answers reads (qemu reads the disk to set its device
//!   up) and holds writes; its guest runs only after qemu's switch-over, which comes after
//!   the final delta is in. Its first write after the gate opens is announced to A before
//!   it runs: from then on only B has the newest data.
//! - A is fenced before it takes the final delta: never two writers. A fenced source holds
//!   its requests rather than failing them, so a VM that resumes there after a failed
//!   switch-over sees a pause once the handover is reverted. It reverts only when B failed its
//!   gate, or went away, having served no write.
//! - Before the switch, any failure (destination killed, cancel, the link cut) ends the
//!   session only: A was never fenced and serves on; B fails every held request and ends.
//! - Marking pages after the cache took a write, and clearing a round's pages before reading
//!   them, means a page written during a round is sent in the next one ([`tracked`]).
//! - A source that sent its final delta without an acknowledgement stays fenced and keeps
//!   its whole cache: a new session from the destination gets all of it again.
//!
//! The link: every agent with a host-side cache listens on `RUN/ID.migrate` (owner-only,
//! like its NBD socket): who may connect may read the target's disk anyway. Between hosts,
//! an agent started with `--migrate-listen ADDR` also takes destinations on TCP with TLS,
//! where both agents must show the target's own certificate ([`link`]); only a hello, a
//! join and a status query are taken there: the switch, cancel, commit and revert come on
//! the local socket alone.

pub mod drive;
mod incoming;
pub mod link;
mod source;
pub mod tracked;
pub mod wire;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use vdstream_blockdev::lock;
use vdstream_contract::status::MigrationStatus;

pub use incoming::{join, run_incoming};
pub use source::Listener;
pub use tracked::TrackedDev;

/// Rounds are "converged" below this many dirty bytes: a final delta of this size takes a
/// few milliseconds on a host's link.
pub const CONVERGED_BYTES: u64 = 8 << 20;
/// A converged source sends a round this often while it waits for the switch.
pub const ROUND_EVERY: Duration = Duration::from_millis(50);
/// The longest a source waits for in-flight requests at its fence, and for the
/// destination's acknowledgement of the final delta.
pub const FENCE_LIMIT: Duration = Duration::from_secs(30);
pub const ACK_LIMIT: Duration = Duration::from_secs(60);

/// Why both agents end a migration that qemu failed after its switch-over.
pub(crate) const REVERTED: &str =
    "qemu's migration failed after the switch-over; the source serves on";

/// The migration socket of target `id`.
pub fn socket_path(id: &str) -> PathBuf {
    crate::paths::run_dir().join(format!("{id}.migrate"))
}

/// What the status shows and what the sessions share, one per agent.
#[derive(Debug)]
pub struct Migration {
    pub(crate) dev: Arc<TrackedDev>,
    pub(crate) target: String,
    pub(crate) export: String,
    pub(crate) cache: String,
    status: Mutex<Option<MigrationStatus>>,
    /// The source handed the target over (or the destination's handover failed): the
    /// agent ends.
    ended: AtomicBool,
    pub(crate) end: tokio::sync::Notify,
    /// Persistent cache files to remove once the target is handed over.
    pub(crate) cache_files: Vec<PathBuf>,
    /// The `server` types: the link whose attach a destination joins (their cache is the
    /// store server's; nothing of it is copied).
    pub(crate) server: Option<Arc<crate::remote::RemoteBase>>,
    pub(crate) wake: Mutex<()>,
    pub(crate) cv: Condvar,
}

impl Migration {
    pub fn new(
        dev: Arc<TrackedDev>,
        target: &str,
        export: &str,
        cache: &str,
        cache_files: Vec<PathBuf>,
    ) -> Arc<Migration> {
        Arc::new(Migration::make(
            dev,
            target,
            export,
            cache,
            cache_files,
            None,
        ))
    }

    fn make(
        dev: Arc<TrackedDev>,
        target: &str,
        export: &str,
        cache: &str,
        cache_files: Vec<PathBuf>,
        server: Option<Arc<crate::remote::RemoteBase>>,
    ) -> Migration {
        Migration {
            dev,
            target: target.to_string(),
            export: export.to_string(),
            cache: cache.to_string(),
            status: Mutex::new(None),
            ended: AtomicBool::new(false),
            end: tokio::sync::Notify::new(),
            cache_files,
            server,
            wake: Mutex::new(()),
            cv: Condvar::new(),
        }
    }

    /// For a `server`-type target over `remote`: the handover moves its attach only.
    pub fn for_server(
        dev: Arc<TrackedDev>,
        target: &str,
        export: &str,
        cache: &str,
        remote: Arc<crate::remote::RemoteBase>,
    ) -> Arc<Migration> {
        Arc::new(Migration::make(
            dev,
            target,
            export,
            cache,
            Vec::new(),
            Some(remote),
        ))
    }

    /// The migration's phase, without the live figures (which scan the dirty maps).
    pub(crate) fn phase(&self) -> Option<String> {
        lock(&self.status).as_ref().map(|s| s.phase.clone())
    }

    /// Whether the migration ended (done, cancelled, reverted or failed).
    pub(crate) fn finished(&self) -> bool {
        lock(&self.status)
            .as_ref()
            .is_some_and(|s| s.finished_unix_ms != 0)
    }

    /// The migration for the status (with the live figures), if there is one.
    pub fn status(&self) -> Option<MigrationStatus> {
        let mut s = lock(&self.status).clone()?;
        if s.role == "source" && s.finished_unix_ms == 0 && !self.dev.is_fenced() {
            s.dirty_bytes = self.dev.dirty_bytes();
            s.held_bytes = self.dev.held_bytes();
        }
        if s.role == "destination" {
            s.held_ms = self.dev.held_ms();
        }
        Some(s)
    }

    pub(crate) fn update(&self, f: impl FnOnce(&mut MigrationStatus)) {
        let mut g = lock(&self.status);
        if let Some(s) = g.as_mut() {
            f(s);
        }
    }

    pub(crate) fn begin(&self, role: &str, peer: &str) {
        *lock(&self.status) = Some(MigrationStatus {
            role: role.into(),
            phase: "connecting".into(),
            peer: peer.into(),
            started_unix_ms: crate::status::now_ms(),
            ..MigrationStatus::default()
        });
    }

    pub(crate) fn finish(&self, phase: &str, error: Option<String>) {
        self.update(|s| {
            s.phase = phase.into();
            s.finished_unix_ms = crate::status::now_ms();
            s.error = error;
        });
        self.notify();
    }

    /// True once the agent should end (handed over, or an incoming handover failed).
    pub fn ended(&self) -> bool {
        self.ended.load(SeqCst)
    }

    pub(crate) fn end_agent(&self) {
        self.ended.store(true, SeqCst);
        self.end.notify_one();
    }

    pub(crate) fn notify(&self) {
        let _g = lock(&self.wake);
        self.cv.notify_all();
    }

    /// Waits up to `d` for a [`notify`](Self::notify).
    pub(crate) fn wait(&self, d: Duration) {
        let g = lock(&self.wake);
        let _ = self.cv.wait_timeout(g, d);
    }

    /// Waits until `done` holds (checked at each notify, and every 20 ms) or `limit` passes;
    /// whether it held.
    pub(crate) fn wait_until(&self, limit: Duration, done: impl Fn() -> bool) -> bool {
        let start = std::time::Instant::now();
        while !done() {
            if start.elapsed() >= limit {
                return false;
            }
            self.wait(Duration::from_millis(20));
        }
        true
    }
}

/// Removes a file, logging what is not "already gone".
pub(crate) fn remove_quietly(path: &Path, target: &str) {
    match std::fs::remove_file(path) {
        Ok(()) => log::info!(
            "target {target}: removed {} (the target's cache is with its new agent)",
            path.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => log::warn!("target {target}: cannot remove {}: {e}", path.display()),
    }
}

#[cfg(test)]
mod tests {
    //! The handover's outcomes after the switch, between two agents' migration state in
    //! this process (RAM devices, a real migration socket): commit, revert, and a revert
    //! refused once the destination served a write.
    use super::wire::Kind;
    use super::*;
    use vdstream_blockdev::{BlockDev, MemoryDev};

    const SIZE: u64 = 1 << 20;

    struct Pair {
        a: Arc<Migration>,
        b: Arc<Migration>,
        socket: PathBuf,
        _dir: tempfile::TempDir,
    }

    fn side(held: bool) -> Arc<Migration> {
        let dev = Arc::new(TrackedDev::new(Arc::new(MemoryDev::new(SIZE)), "t", held));
        Migration::new(dev, "t", "vdisk/g@base", "device-ram", Vec::new())
    }

    fn phase(m: &Migration) -> String {
        m.status().map(|s| s.phase).unwrap_or_default()
    }

    fn wait_for(what: &str, f: impl Fn() -> bool) {
        let start = std::time::Instant::now();
        while !f() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "timed out waiting for {what}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// A source with data, a destination that took it and converged, then the switch.
    fn switched() -> Pair {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("t.migrate");
        let a = side(false);
        a.dev.write_at(&[7; 8192], 4096, false).unwrap();
        Listener::bind(&socket).unwrap().start(a.clone());
        let b = side(true);
        run_incoming(b.clone(), link::SourceAddr::Socket(socket.clone()), SIZE);
        wait_for("convergence", || phase(&b) == "converged");
        a.dev.write_at(&[8; 512], 65536, false).unwrap();
        let s = drive::tell(&socket, Kind::Switch).unwrap();
        assert_eq!(s.phase, "switched");
        assert!(a.dev.is_fenced() && b.dev.is_open());
        let mut buf = [0u8; 512];
        b.dev.read_at(&mut buf, 65536).unwrap();
        assert_eq!(buf, [8; 512], "the final delta reached the destination");
        Pair {
            a,
            b,
            socket,
            _dir: dir,
        }
    }

    #[test]
    fn a_commit_ends_the_source_and_the_destination_serves() {
        let p = switched();
        let s = drive::tell(&p.socket, Kind::Commit).unwrap();
        assert_eq!(s.phase, "done");
        wait_for("the source to end", || p.a.ended());
        wait_for("the destination's done", || phase(&p.b) == "done");
        p.b.dev.write_at(&[9; 512], 0, false).unwrap();
    }

    #[test]
    fn a_revert_gives_the_target_back_with_the_source_s_held_write() {
        let p = switched();
        // The source VM resumed: its write waits at the fence.
        let a = p.a.clone();
        let held = std::thread::spawn(move || a.dev.write_at(&[5; 512], 0, false));
        std::thread::sleep(Duration::from_millis(30));
        assert!(!held.is_finished());
        let s = drive::tell(&p.socket, Kind::Revert).unwrap();
        assert_eq!(s.phase, "reverted");
        held.join().unwrap().unwrap();
        assert!(p.a.dev.is_open() && !p.a.ended());
        wait_for("the destination's revert", || p.b.ended());
        let mut buf = [0u8; 512];
        assert!(
            p.b.dev.read_at(&mut buf, 0).is_err(),
            "a reverted destination serves nothing"
        );
    }

    #[test]
    fn no_revert_once_the_destination_served_a_write() {
        let p = switched();
        p.b.dev.write_at(&[6; 512], 0, false).unwrap();
        // The destination's notice of its first write commits the handover by itself.
        wait_for("the source to end", || p.a.ended());
        assert!(p.a.dev.is_fenced());
        assert!(drive::tell(&p.socket, Kind::Revert).is_err());
        let mut buf = [0u8; 512];
        p.b.dev.read_at(&mut buf, 0).unwrap();
        assert_eq!(buf, [6; 512]);
    }
}
