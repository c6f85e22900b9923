//! What a running server knows about itself and its connections, shared by the NBD side
//! (which registers sessions and counts their I/O) and the HTTP side (which shows them).
//!
//! Invariants: a session is in the registry from the end of its handshake until its
//! connection closes; counters only grow; `reconnects` of a target counts every
//! connection of that target after its first one since the server started.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// Which kind of export a session opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ExportKind {
    /// `vdisk/NAME` or `vdisk/NAME@V`: read-only.
    Vdisk,
    /// `target/ID`: the target's vDisk through its server-side write cache.
    Target,
    /// `maintenance/NAME`: the maintenance version, writable by one connection.
    Maintenance,
}

/// What a session is, fixed when it connects.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SessionInfo {
    /// The export name the client asked for, as it asked.
    pub export: String,
    pub kind: ExportKind,
    /// The target, for `target/ID` exports, or as the agent named itself.
    pub target: Option<String>,
    /// `unix` or the peer's `IP:PORT`.
    pub peer: String,
    pub vdisk: String,
    /// The version served (0: the base).
    pub version: u32,
    /// The server-side cache type (`server`, `server-persistent`), if any.
    pub cache_type: Option<String>,
    /// The cache's limit in bytes (RAM plus file), if it has one.
    pub cache_limit: Option<u64>,
}

/// I/O counters of one session. Guest: what the client asked for. Store: what reached the
/// store's files (after the shared read cache and the session's write cache).
#[derive(Debug, Default)]
pub struct Counters {
    pub guest_read_ops: AtomicU64,
    pub guest_read_bytes: AtomicU64,
    pub guest_write_ops: AtomicU64,
    pub guest_write_bytes: AtomicU64,
    pub store_read_ops: AtomicU64,
    pub store_read_bytes: AtomicU64,
    pub store_write_ops: AtomicU64,
    pub store_write_bytes: AtomicU64,
    /// Bytes the session's server-side cache holds now (RAM plus file).
    pub cache_used: AtomicU64,
}

/// A snapshot of [`Counters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CountersSnapshot {
    pub guest_read_ops: u64,
    pub guest_read_bytes: u64,
    pub guest_write_ops: u64,
    pub guest_write_bytes: u64,
    pub store_read_ops: u64,
    pub store_read_bytes: u64,
    pub store_write_ops: u64,
    pub store_write_bytes: u64,
    pub cache_used: u64,
}

impl Counters {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> CountersSnapshot {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CountersSnapshot {
            guest_read_ops: g(&self.guest_read_ops),
            guest_read_bytes: g(&self.guest_read_bytes),
            guest_write_ops: g(&self.guest_write_ops),
            guest_write_bytes: g(&self.guest_write_bytes),
            store_read_ops: g(&self.store_read_ops),
            store_read_bytes: g(&self.store_read_bytes),
            store_write_ops: g(&self.store_write_ops),
            store_write_bytes: g(&self.store_write_bytes),
            cache_used: g(&self.cache_used),
        }
    }
}

impl crate::readcache::StoreReads for Counters {
    fn charge(&self, bytes: u64) {
        Counters::add(&self.store_read_ops, 1);
        Counters::add(&self.store_read_bytes, bytes);
    }
}

/// One live connection.
#[derive(Debug)]
pub struct Session {
    pub id: u64,
    pub info: SessionInfo,
    pub connected_unix_ms: u64,
    pub counters: Counters,
    /// The session's server-side write cache (`target/ID` of a server type), measured
    /// when the API is asked.
    pub cache: Option<CacheProbe>,
    /// Ends this connection at a safe point (a move to another server: `crate::balance`).
    closer: vdstream_nbd::ShutdownTrigger,
    /// The connection's side of `closer`.
    pub close_signal: vdstream_nbd::ShutdownSignal,
}

impl Session {
    /// Ends the connection as a drain would: what it read is answered, then it closes.
    pub fn close(&self) {
        self.closer.shutdown();
    }

    /// Capacity and figures of the session's server-side write cache, if it has one. A
    /// session with a limit but no probe is measured against its limit (the same
    /// calculation with no file system known).
    pub fn cache_figures(
        &self,
    ) -> Option<(
        vdstream_wcache::space::Capacity,
        vdstream_wcache::StatsSnapshot,
    )> {
        self.cache.as_ref().map(CacheProbe::measure).or_else(|| {
            let used = self.counters.cache_used.load(Ordering::Relaxed);
            self.info.cache_limit.map(|l| {
                (
                    vdstream_wcache::space::Capacity::new(0, 0, l, used, None),
                    Default::default(),
                )
            })
        })
    }
}

impl crate::readcache::StoreReads for Session {
    fn charge(&self, bytes: u64) {
        self.counters.charge(bytes)
    }
}

/// A server-side write cache as the API measures it: its figures, and where its file
/// lives. Its capacity is the one calculation the agent uses too
/// ([`vdstream_wcache::space::Capacity`]: the limit, or less when the file system of
/// the cache's file has less room), so `used_percent` means the same on both sides.
#[derive(Debug, Clone)]
pub struct CacheProbe {
    pub kind: vdstream_wcache::CacheType,
    /// The cap of the cache's file (`--overflow-max` of the target; `None`: the vDisk's size).
    pub max_file: Option<u64>,
    /// The folder of the cache's file (`STORE/cache`).
    pub dir: PathBuf,
    pub vdisk_size: u64,
    pub cache: Arc<dyn vdstream_wcache::WriteCache>,
}

impl CacheProbe {
    /// The cache's capacity and use now (one `statvfs` of its folder), and its figures.
    pub fn measure(
        &self,
    ) -> (
        vdstream_wcache::space::Capacity,
        vdstream_wcache::StatsSnapshot,
    ) {
        let s = self.cache.stats();
        (
            vdstream_wcache::space::Capacity::of(
                self.kind,
                0,
                self.max_file,
                &self.dir,
                self.vdisk_size,
                &s,
            ),
            s,
        )
    }
}

/// Every live session, and per-target connection counts.
#[derive(Debug, Default)]
pub struct Registry {
    next_id: AtomicU64,
    sessions: Mutex<BTreeMap<u64, Arc<Session>>>,
    target_connects: Mutex<BTreeMap<String, u64>>,
}

/// Removes its session from the registry when dropped (when the connection ends).
#[derive(Debug)]
pub struct SessionGuard {
    registry: Arc<Registry>,
    pub session: Arc<Session>,
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        self.registry
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.session.id);
    }
}

impl Registry {
    pub fn new() -> Arc<Registry> {
        Arc::new(Registry::default())
    }

    /// Registers a session; it leaves the registry when the guard is dropped.
    pub fn open(self: &Arc<Self>, info: SessionInfo) -> SessionGuard {
        self.open_with_cache(info, None)
    }

    /// [`Registry::open`] of a session with a server-side write cache.
    pub fn open_with_cache(
        self: &Arc<Self>,
        info: SessionInfo,
        cache: Option<CacheProbe>,
    ) -> SessionGuard {
        if let Some(t) = &info.target {
            *self
                .target_connects
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(t.clone())
                .or_default() += 1;
        }
        let (closer, close_signal) = vdstream_nbd::ShutdownSignal::new();
        let session = Arc::new(Session {
            id: self.next_id.fetch_add(1, Ordering::Relaxed) + 1,
            info,
            connected_unix_ms: unix_ms(),
            counters: Counters::default(),
            cache,
            closer,
            close_signal,
        });
        self.sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(session.id, session.clone());
        SessionGuard {
            registry: self.clone(),
            session,
        }
    }

    /// The live sessions, oldest first.
    pub fn sessions(&self) -> Vec<Arc<Session>> {
        self.sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    pub fn len(&self) -> usize {
        self.sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Connections of `target` after its first one since this server started.
    pub fn reconnects(&self, target: &str) -> u64 {
        self.target_connects
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(target)
            .map_or(0, |n| n.saturating_sub(1))
    }
}

/// The server as a whole: its store, where it listens, its sessions, whether it drains.
#[derive(Debug)]
pub struct ServerState {
    /// This server's name in the API (default: `HOSTNAME:PID`).
    pub name: String,
    pub store: PathBuf,
    /// `--listen`, if any.
    pub nbd_listen: Option<String>,
    /// `--socket`, if any.
    pub nbd_socket: Option<PathBuf>,
    /// `--dead-peer-timeout` (`None`: off).
    pub dead_peer_timeout: Option<std::time::Duration>,
    /// NBD over TLS (`--tls`, `--tls-certificates`).
    pub nbd_tls: Option<Arc<vdstream_tls::files::ServerTls>>,
    pub nbd_tls_mode: vdstream_nbd::TlsMode,
    pub registry: Arc<Registry>,
    /// Set on SIGTERM: no new connections; agents should move elsewhere.
    pub draining: AtomicBool,
    pub started_unix_ms: u64,
    /// Guest and store I/O of every session since the server started (closed ones too).
    pub totals: Arc<Counters>,
    /// The read cache shared by every session (capacity 0: disabled).
    pub read_cache: Arc<crate::readcache::ReadCache>,
    /// `--max-connections` (`None`: derived from the open-files limit at start).
    pub max_connections: Option<usize>,
    /// `--max-request-memory`.
    pub max_request_memory: usize,
    /// The NBD listeners' request memory, once they started (for /metrics).
    pub nbd_memory: std::sync::OnceLock<Arc<vdstream_nbd::memory::MemoryPool>>,
    /// Failures a client can provoke (I/O errors) reach the log through this.
    pub log: Arc<vdstream_nbd::lograte::LogLimiter>,
    /// `--anonymous`: what clients without a verified certificate may open (TLS on).
    pub anonymous: crate::policy::AnonymousGrant,
    /// `--boot`: the boot service's settings (`None`: no boot routes).
    pub boot: Option<crate::boot::BootConfig>,
    /// The boot windows (`--max-booting`), with `--boot`.
    pub pacer: Option<crate::boot::pacing::Pacer>,
    /// `--identity-ca`: machines prove their TPM identity and get certificates.
    pub identity: Option<crate::identity::IdentityService>,
    /// `--handshake-penalty`: when the NBD listeners close a failing address at accept.
    pub handshake_penalty: vdstream_nbd::penalty::PenaltyConfig,
    /// The API's changes go to the store's metadata writer (a mirror of object storage).
    pub forward: Option<crate::forwarding::Forwarder>,
    /// Counters of the store's backend for /metrics.
    pub extra_counters: Option<crate::config::ExtraCounters>,
    /// Rebalancing across the store's servers, and the API's drain.
    pub balancer: Arc<crate::balance::Balancer>,
}

impl ServerState {
    /// The state of a server with these options (the name defaults to `HOSTNAME:PID`).
    /// The NBD listeners (`crate::nbd::NbdService::start`) and the HTTP API are started on
    /// it afterwards, each with a clone of the `Arc`.
    pub fn new(opts: &crate::config::ServerOptions) -> Arc<ServerState> {
        let totals = Arc::new(Counters::default());
        Arc::new(ServerState {
            name: opts.name.clone().unwrap_or_else(default_name),
            store: opts.store.clone(),
            nbd_listen: opts.listen.map(|a| a.to_string()),
            nbd_socket: opts.socket.clone(),
            dead_peer_timeout: opts.dead_peer_timeout,
            nbd_tls: opts.nbd_tls.clone(),
            nbd_tls_mode: opts.nbd_tls_mode,
            registry: Registry::new(),
            draining: AtomicBool::new(false),
            started_unix_ms: unix_ms(),
            read_cache: crate::readcache::ReadCache::new(opts.read_cache, totals.clone()),
            totals,
            max_connections: opts.max_connections,
            max_request_memory: opts.max_request_memory,
            nbd_memory: std::sync::OnceLock::new(),
            log: Arc::new(vdstream_nbd::lograte::LogLimiter::default()),
            boot: opts.boot.clone(),
            pacer: opts
                .boot
                .as_ref()
                .map(|b| crate::boot::pacing::Pacer::new(b.max_booting, b.boot_window)),
            identity: opts
                .identity
                .clone()
                .map(crate::identity::IdentityService::new),
            anonymous: opts.anonymous,
            handshake_penalty: opts.handshake_penalty.clone(),
            forward: opts.forward.clone(),
            extra_counters: opts.extra_counters.clone(),
            balancer: Arc::new(crate::balance::Balancer::new(opts.balance.clone())),
        })
    }

    /// Whether a drain has begun (SIGTERM), or the API drained the server: no new
    /// connection is taken.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed) || self.balancer.drained.load(Ordering::Relaxed)
    }

    /// Figures of the whole server: totals, the read cache, the live sessions.
    pub fn stats(&self) -> ServerStatsSnapshot {
        ServerStatsSnapshot {
            name: self.name.clone(),
            draining: self.is_draining(),
            totals: self.totals.snapshot(),
            read_cache: self.read_cache.snapshot(),
            sessions: self
                .registry
                .sessions()
                .iter()
                .map(|s| SessionSnapshot {
                    id: s.id,
                    info: s.info.clone(),
                    connected_unix_ms: s.connected_unix_ms,
                    counters: s.counters.snapshot(),
                })
                .collect(),
        }
    }
}

/// `HOSTNAME:PID`.
pub fn default_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into());
    format!("{host}:{}", std::process::id())
}

/// One session in [`ServerStatsSnapshot`].
#[derive(Debug, Clone, Serialize)]
pub struct SessionSnapshot {
    pub id: u64,
    #[serde(flatten)]
    pub info: SessionInfo,
    pub connected_unix_ms: u64,
    pub counters: CountersSnapshot,
}

/// What `--stats-file` holds.
#[derive(Debug, Clone, Serialize)]
pub struct ServerStatsSnapshot {
    pub name: String,
    pub draining: bool,
    pub totals: CountersSnapshot,
    pub read_cache: crate::readcache::CacheSnapshot,
    pub sessions: Vec<SessionSnapshot>,
}

pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(target: Option<&str>) -> SessionInfo {
        SessionInfo {
            export: "vdisk/w".into(),
            kind: ExportKind::Vdisk,
            target: target.map(str::to_string),
            peer: "unix".into(),
            vdisk: "w".into(),
            version: 1,
            cache_type: None,
            cache_limit: None,
        }
    }

    #[test]
    fn a_session_leaves_the_registry_when_its_connection_ends() {
        let r = Registry::new();
        let a = r.open(info(Some("vm1")));
        let b = r.open(info(None));
        assert_eq!(r.len(), 2);
        Counters::add(&a.session.counters.guest_read_ops, 3);
        assert_eq!(r.sessions()[0].counters.snapshot().guest_read_ops, 3);
        drop(a);
        assert_eq!(
            r.sessions().iter().map(|s| s.id).collect::<Vec<_>>(),
            vec![b.session.id]
        );
    }

    #[test]
    fn reconnects_count_connections_after_the_first() {
        let r = Registry::new();
        assert_eq!(r.reconnects("vm1"), 0);
        drop(r.open(info(Some("vm1"))));
        assert_eq!(r.reconnects("vm1"), 0);
        let _again = r.open(info(Some("vm1")));
        assert_eq!(r.reconnects("vm1"), 1);
        assert_eq!(r.reconnects("vm2"), 0);
    }
}
