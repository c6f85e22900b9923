//! `target/ID`: a target's vDisk, as its record in the store says (`vdstream target add`,
//! `STORE/targets/`), through its server-side write cache for the `server` types, or
//! read-only for the device types (the agent keeps that cache). This is the one place the
//! server reads target records.
//!
//! **Attaches.** A connection to `target/ID` is a new attach: the version is resolved now
//! (the record's pinned version, else production) and the export describes itself as
//! `target/ID@ATTACH vdisk/NAME@V (…)`. The agent asks for `target/ID@ATTACH` on every
//! reconnect (as it does `vdisk/NAME@V`), which reaches the same version and the same
//! cache, however production has moved meanwhile:
//!
//! | cache type          | ATTACH            | a new attach                          | `target/ID@ATTACH`                        |
//! | ------------------- | ----------------- | ------------------------------------- | ----------------------------------------- |
//! | device types        | `vN` (version N)  | version N read-only                   | version N read-only, on any server        |
//! | `server`            | random, in memory | a fresh cache (the old one is dropped)| the same cache while this server runs; refused after a restart (the cache died with it) |
//! | `server-persistent` | random, on disk   | the cache on disk (under a new ATTACH) if made for version N, else a clean one (logged) | the cache on disk, reopened after a restart or on another server of the store |
//!
//! **One writer per target.** A new attach of a server type while a connection holds the
//! target's cache waits [`HANDOVER`] for it to close, then is refused (`NBD_REP_ERR_POLICY`)
//! naming the holder. After a server is SIGKILLed nothing of it is held: its connections
//! are gone, and the kernel dropped its `flock`s on the persistent cache's files, so the
//! restarted server (or another one on the store) opens them; a live holder in another
//! server process still holds them and is refused by them.
//!
//! **Fencing.** The attach name is published (descriptions, the API, the agent's status),
//! so it is no credential. A new attach also gets a secret (128 random bits), handed out
//! once, in the description of the reply that made the attach (`target/ID@ATTACH#SECRET …`,
//! never logged); a reconnect must name it: `target/ID@ATTACH[+journal]#SECRET` (the NBD
//! client sends it as `ConnectOptions::secret`). A connection naming the attach without it,
//! or with a wrong one, is refused (`NBD_REP_ERR_POLICY`, logged with the client) whether the
//! attach is held or not, on this server and, for `server-persistent` (whose `.vdattach`
//! keeps the secret, mode 0600), after a restart or on another server of the store. With
//! the secret, a reconnect is let in at once, even while its old connection is still open
//! (the agent reconnects only after giving that one up; the server may not have seen it
//! close yet). A new attach of `server-persistent` that continues the cache on disk gets a
//! new name and secret: whoever held the old attach is told it is gone.
//!
//! **A lost attach.** A reconnect whose attach this server does not have (a `server` cache
//! of a server process that stopped; a cache that now belongs to another attach, live here
//! or, for `server-persistent`, on disk) is refused at once with `NBD_REP_ERR_UNKNOWN` and an
//! [`AttachGone`] message, and logged: the agent, when every server answers so,
//! fails its guest's requests with EIO instead of waiting.
//!
//! Files in `STORE/cache/` (`server_cache_dir`): `server` — an unlinked file of the disk
//! cache, gone with the server; `server-persistent` — the cache's files
//! (`wcache::persistent`) and `<stem>.vdattach`, the attach (name, vDisk, version), written
//! when the attach starts and `flock`ed while the cache is open.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use vdstream_blockdev::BlockDev;
use vdstream_contract::ExportName;
use vdstream_store::{Layer, OpenedLayer, Selector, Store, StoreError};
use vdstream_wcache::{CacheConfig, CacheType, StatsSnapshot, WriteCache};

use crate::state::{CacheProbe, Counters, Session};
use vdstream_blockdev::lock;
use vdstream_contract::refusal::AttachGone;

/// How long a new attach waits for the connection holding the target's cache to close.
pub const HANDOVER: Duration = Duration::from_secs(2);

/// A target's record, as the server uses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetSpec {
    pub vdisk: String,
    /// Which version it boots (resolved at connect time).
    pub version: Selector,
    pub cache: CacheType,
    /// Cap on the cache file, in bytes (`None`: the vDisk's size).
    pub overflow_max: Option<u64>,
}

impl TargetSpec {
    /// Whether the server keeps this target's write cache.
    pub fn server_side(&self) -> bool {
        matches!(self.cache, CacheType::Server | CacheType::ServerPersistent)
    }
}

/// Why a target could not be looked up; the message says what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetLookupError {
    /// No such target (`NBD_REP_ERR_UNKNOWN`).
    Unknown(String),
    /// The record exists but cannot be read.
    Failed(String),
}

/// Looks up target `id` in `store`.
pub fn lookup_target(store: &Store, id: &str) -> Result<TargetSpec, TargetLookupError> {
    match store.target(id) {
        Ok(r) => Ok(TargetSpec { vdisk: r.vdisk, version: r.version, cache: r.cache, overflow_max: r.overflow_max }),
        Err(StoreError::UnknownTarget { known, .. }) => Err(TargetLookupError::Unknown(format!(
            "no target named {id:?} in {}: add it with `vdstream target add {id} --vdisk NAME --cache server` \
             (or another cache type), or read a vDisk directly through vdisk/NAME; {known}",
            store.root().display()
        ))),
        Err(e @ (StoreError::BadName(_) | StoreError::BadInput(_))) => Err(TargetLookupError::Unknown(e.to_string())),
        Err(e) => Err(TargetLookupError::Failed(format!("cannot read the record of target {id}: {e}"))),
    }
}

/// What `.vdattach` holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct AttachFile {
    attach: String,
    vdisk: String,
    version: u32,
    /// The attach's secret (absent in files of servers before fencing: such an attach
    /// cannot be reconnected to, only attached anew).
    #[serde(default)]
    secret: Option<String>,
}

/// A server-side cache open in this server.
#[derive(Debug)]
struct LiveCache {
    attach: String,
    /// What a reconnect must present besides the attach's name (see the module docs).
    secret: String,
    version: u32,
    kind: CacheType,
    cache: Arc<dyn WriteCache>,
    limit: u64,
    /// How the API measures it (capacity against the free space of its folder).
    probe: CacheProbe,
    /// Connections using it, and who the first of them is (for refusals).
    holders: usize,
    holder: String,
    /// The cache's figures when last charged to a session, shared by every connection of
    /// the attach (an agent may hold several), so that each I/O is charged once.
    seen: Arc<Mutex<StatsSnapshot>>,
    /// The chain below the cache (its files stay locked while the cache is open).
    _chain: Arc<OpenedLayer>,
    /// `server-persistent`: the `flock`ed `.vdattach`.
    _attach_lock: Option<File>,
}

/// The server-side caches of this server, by target id.
#[derive(Debug)]
pub struct TargetCaches {
    store: Store,
    /// This server's name, for refusals.
    server: String,
    live: Mutex<HashMap<String, LiveCache>>,
}

/// A new attach name: unique enough across restarts and servers of a store.
fn new_attach_name() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!(
        "a{:x}{:x}{n:x}",
        crate::state::unix_ms(),
        std::process::id()
    )
}

/// A new attach secret: 128 bits from the kernel's random source, in hex.
fn new_secret() -> Result<String, String> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b)
        .map_err(|e| format!("cannot get random bytes from the OS for an attach secret: {e}"))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Compares two secrets in time independent of where they differ.
fn same_secret(a: &str, b: &str) -> bool {
    use subtle::ConstantTimeEq;
    a.as_bytes().ct_eq(b.as_bytes()).into()
}

/// What [`TargetCaches::open`] gives a connection.
#[derive(Debug)]
pub struct OpenedTargetCache {
    pub cache: Arc<dyn WriteCache>,
    pub attach: String,
    /// The attach's secret: handed to the client in the reply to a new attach only.
    pub secret: String,
    /// This connection made the attach (it did not name one).
    pub new_attach: bool,
    pub version: u32,
    pub limit: u64,
    pub hold: TargetHold,
}

/// How the caller opens the target's vDisk at a version: a chain under the shared read cache.
pub type OpenChain<'a> = &'a dyn Fn(Selector) -> Result<OpenedLayer, String>;

/// Why a target's cache could not be opened.
#[derive(Debug)]
pub enum TargetOpenError {
    /// The attach named is gone (`NBD_REP_ERR_UNKNOWN`).
    Gone(AttachGone),
    /// Another connection or server holds the cache (`NBD_REP_ERR_POLICY`).
    Busy(String),
    /// The attach was named without its secret, or with a wrong one (`NBD_REP_ERR_POLICY`).
    Fenced(String),
    Failed(String),
}

impl TargetCaches {
    pub fn new(store: Store, server: String) -> TargetCaches {
        TargetCaches {
            store,
            server,
            live: Mutex::new(HashMap::new()),
        }
    }

    /// Opens (or joins) the server-side cache of target `id` for a connection from `peer`.
    /// `attach`: the attach a reconnect names; `None`: a new attach. See the module docs.
    pub fn open(
        self: &Arc<Self>,
        id: &str,
        spec: &TargetSpec,
        attach: Option<&str>,
        secret: Option<&str>,
        peer: &str,
        open_chain: OpenChain<'_>,
    ) -> Result<OpenedTargetCache, TargetOpenError> {
        let deadline = Instant::now() + HANDOVER;
        loop {
            {
                let mut live = lock(&self.live);
                if let Some(c) = live.get_mut(id) {
                    if attach.is_some_and(|a| a == c.attach) {
                        if !secret.is_some_and(|s| same_secret(s, &c.secret)) {
                            return Err(self.fenced(id, &c.attach, secret.is_some(), peer));
                        }
                        // A reconnect of this attach: its old connection may not have closed yet.
                        return Ok(self.join(c, id, peer, false));
                    }
                    if let Some(a) = attach {
                        // The target was attached anew since: attach `a`'s writes are not in
                        // this cache, and waiting would not bring them back.
                        log::warn!("target {id}: refused the reconnect of attach {a} from {peer}: the target was attached again since (attach {}); the agent's guest gets EIO", c.attach);
                        return Err(TargetOpenError::Gone(AttachGone::new(format!(
                            "target {id} has no attach {a} any more: it was attached again since (attach {}, on server {}), \
                             and the writes of attach {a} are not in that cache; restart the target",
                            c.attach,
                            self.server
                        ))));
                    }
                    if c.holders == 0 {
                        live.remove(id);
                    } else if Instant::now() >= deadline {
                        let m = format!(
                            "target {id} already has its one writer ({}, attach {}, on server {}): \
                             detach that one first (vdstream target detach {id} on its machine), or wait for its connection to close",
                            c.holder, c.attach, self.server
                        );
                        log::warn!("target {id}: refused a connection from {peer}: {m}");
                        return Err(TargetOpenError::Busy(m));
                    } else {
                        drop(live);
                        std::thread::sleep(Duration::from_millis(20));
                        continue;
                    }
                }
                if let Some(a) = attach {
                    if spec.cache == CacheType::Server {
                        let m = AttachGone::new(format!(
                            "the server cache of target {id} (attach {a}) is gone: it lived in a server process that has \
                             stopped since, and with it the target's writes since it attached; restart the target \
                             (use cache type server-persistent to keep the cache across server restarts)"
                        ));
                        log::warn!("target {id}: refused the reconnect of attach {a} from {peer}: its server cache is lost (it lived in an earlier server process); the agent's guest gets EIO");
                        return Err(TargetOpenError::Gone(m));
                    }
                }
                let opened = self.create(id, spec, attach, secret, peer, open_chain)?;
                let joined = {
                    let c = live.entry(id.to_string()).or_insert(opened);
                    self.join(c, id, peer, attach.is_none())
                };
                return Ok(joined);
            }
        }
    }

    /// The refusal of a connection that names attach `attach` of target `id` without its
    /// secret (`presented`: with a wrong one); logged, since it is a hijack or a bug.
    fn fenced(&self, id: &str, attach: &str, presented: bool, peer: &str) -> TargetOpenError {
        let why = if presented {
            "a wrong secret"
        } else {
            "no secret"
        };
        let export = ExportName::Target {
            id: id.to_string(),
            attach: Some(attach.to_string()),
            secret: None,
            journaled: false,
        };
        log::warn!("target {id}: refused a connection from {peer} to {export}: it presented {why}; only the agent that made the attach may reconnect to it");
        TargetOpenError::Fenced(format!(
            "{export} is fenced: only the agent that made this attach may reconnect to it (with the secret it was \
             handed at attach), and this connection presented {why}; attach the target with its agent \
             (vdstream target attach {id} ...)"
        ))
    }

    fn join(
        self: &Arc<Self>,
        c: &mut LiveCache,
        id: &str,
        peer: &str,
        new_attach: bool,
    ) -> OpenedTargetCache {
        if c.holders == 0 {
            c.holder = format!(
                "a connection from {peer} since {}",
                vdstream_store::Timestamp::now()
            );
        }
        c.holders += 1;
        OpenedTargetCache {
            cache: c.cache.clone(),
            attach: c.attach.clone(),
            secret: c.secret.clone(),
            new_attach,
            version: c.version,
            limit: c.limit,
            hold: TargetHold {
                probe: c.probe.clone(),
                caches: self.clone(),
                id: id.to_string(),
                cache: c.cache.clone(),
                write_through: c.kind == CacheType::ServerPersistent,
                seen: c.seen.clone(),
            },
        }
    }

    fn create(
        &self,
        id: &str,
        spec: &TargetSpec,
        attach: Option<&str>,
        secret: Option<&str>,
        peer: &str,
        open_chain: OpenChain<'_>,
    ) -> Result<LiveCache, TargetOpenError> {
        let dir = vdstream_store::server_cache_dir(self.store.root())
            .map_err(|e| TargetOpenError::Failed(e.to_string()))?;
        let cfg = |dir: PathBuf| CacheConfig {
            max_file: spec.overflow_max,
            dir,
            ..CacheConfig::new(id)
        };
        if spec.cache == CacheType::Server {
            let chain = open_chain(spec.version).map_err(TargetOpenError::Failed)?;
            let version = layer_number(chain.layer);
            let cache =
                vdstream_wcache::open(CacheType::Server, chain.dev.clone(), &cfg(dir.clone()))
                    .map_err(|e| {
                        TargetOpenError::Failed(format!(
                            "cannot open the server cache of target {id}: {e}"
                        ))
                    })?;
            let limit = spec.overflow_max.unwrap_or(chain.dev.size());
            let probe = CacheProbe {
                kind: CacheType::Server,
                max_file: spec.overflow_max,
                dir,
                vdisk_size: chain.dev.size(),
                cache: cache.clone(),
            };
            let attach = new_attach_name();
            let secret = new_secret().map_err(TargetOpenError::Failed)?;
            log::info!(
                "target {id}: new attach {attach}: vDisk {}@{version} through a fresh server cache",
                spec.vdisk
            );
            let seen = Arc::new(Mutex::new(cache.stats()));
            return Ok(LiveCache {
                attach,
                secret,
                version,
                kind: CacheType::Server,
                cache,
                limit,
                probe,
                holders: 0,
                holder: String::new(),
                seen,
                _chain: Arc::new(chain),
                _attach_lock: None,
            });
        }
        // server-persistent: the attach file says which attach and version the cache on disk is.
        let stem = vdstream_wcache::disk::file_stem(id);
        let attach_path = dir.join(format!("{stem}.vdattach"));
        let fail =
            |what: String| TargetOpenError::Failed(format!("{}: {what}", attach_path.display()));
        // It holds the attach's secret: readable by this server's user only, and never
        // written through a link planted in its place.
        let mut file = {
            use vdstream_blockdev::storefile;
            let f = storefile::open_rw(&attach_path, storefile::PRIVATE)
                .map_err(|e| fail(e.to_string()))?;
            storefile::tighten(&f, storefile::PRIVATE).map_err(|e| fail(e.to_string()))?;
            f
        };
        if !vdstream_wcache::cachefile::try_lock_exclusive(&file)
            .map_err(|e| fail(e.to_string()))?
        {
            return Err(TargetOpenError::Busy(format!(
                "the server-persistent cache of target {id} ({}) is open in another server on this store: \
                 a target has one writer; detach it there first",
                dir.display()
            )));
        }
        let mut text = String::new();
        file.read_to_string(&mut text)
            .map_err(|e| fail(e.to_string()))?;
        let on_disk: Option<AttachFile> = serde_json::from_str(&text).ok();
        let (selector, keep) = match (attach, &on_disk) {
            (Some(a), Some(d)) if d.attach == a => {
                if !matches!((secret, &d.secret), (Some(s), Some(on_disk)) if same_secret(s, on_disk))
                {
                    return Err(self.fenced(id, a, secret.is_some(), peer));
                }
                (version_selector(d.version), Some(d.clone()))
            }
            (Some(a), _) => {
                log::warn!("target {id}: refused the reconnect of attach {a} from {peer}: its server-persistent cache now belongs to another attach (or was removed); the agent's guest gets EIO");
                return Err(TargetOpenError::Gone(AttachGone::new(format!(
                    "target {id} has no attach {a} any more (its server-persistent cache in {} now belongs to {}): \
                     the target was attached again elsewhere or its cache was removed; restart the target",
                    dir.display(),
                    on_disk.as_ref().map_or("no attach".to_string(), |d| format!("attach {}", d.attach))
                ))));
            }
            (None, _) => (spec.version, None),
        };
        let chain = open_chain(selector).map_err(TargetOpenError::Failed)?;
        let version = layer_number(chain.layer);
        let write_record = |file: &mut File, d: &AttachFile| -> Result<(), TargetOpenError> {
            let json = serde_json::to_vec(d).expect("plain JSON");
            file.set_len(0)
                .and_then(|_| file.rewind())
                .and_then(|_| file.write_all(&json))
                .and_then(|_| file.sync_all())
                .map_err(|e| fail(e.to_string()))
        };
        let record = match (keep, on_disk) {
            (Some(d), _) => d,
            (None, Some(mut d)) if d.vdisk == spec.vdisk && d.version == version => {
                // A new attach takes the cache over under a new name and secret: whoever held
                // the old attach is told it is gone (EIO), not let back in.
                let old = std::mem::replace(&mut d.attach, new_attach_name());
                d.secret = Some(new_secret().map_err(TargetOpenError::Failed)?);
                write_record(&mut file, &d)?;
                log::info!("target {id}: new attach {} continues its server-persistent cache (was attach {old}; vDisk {}@{version})", d.attach, d.vdisk);
                d
            }
            (None, old) => {
                if let Some(d) = &old {
                    log::warn!(
                        "target {id}: its server-persistent cache was made for vDisk {}@{}, but the target now boots {}@{version}: \
                         starting the cache clean (the writes kept for the old version are discarded)",
                        d.vdisk, d.version, spec.vdisk
                    );
                }
                for p in vdstream_wcache::persistent::cache_paths(&dir, id) {
                    if let Err(e) = std::fs::remove_file(&p) {
                        if e.kind() != std::io::ErrorKind::NotFound {
                            return Err(fail(format!(
                                "cannot remove the old cache file {}: {e}",
                                p.display()
                            )));
                        }
                    }
                }
                let secret = Some(new_secret().map_err(TargetOpenError::Failed)?);
                let d = AttachFile {
                    attach: new_attach_name(),
                    vdisk: spec.vdisk.clone(),
                    version,
                    secret,
                };
                write_record(&mut file, &d)?;
                log::info!("target {id}: new attach {}: vDisk {}@{version} through a new server-persistent cache", d.attach, d.vdisk);
                d
            }
        };
        let identity = format!("target {id} vdisk {}@{version}", spec.vdisk);
        let cache: Arc<dyn WriteCache> = Arc::new(
            vdstream_wcache::persistent::PersistentDiskCache::open_with_identity(
                chain.dev.clone(),
                &cfg(dir.clone()),
                CacheType::ServerPersistent,
                &identity,
            )
            .map_err(|e| {
                TargetOpenError::Failed(format!(
                    "cannot open the server-persistent cache of target {id}: {e}"
                ))
            })?,
        );
        let limit = spec.overflow_max.unwrap_or(chain.dev.size());
        let probe = CacheProbe {
            kind: CacheType::ServerPersistent,
            max_file: spec.overflow_max,
            dir,
            vdisk_size: chain.dev.size(),
            cache: cache.clone(),
        };
        Ok(LiveCache {
            secret: record
                .secret
                .expect("every attach written or reconnected to has its secret"),
            attach: record.attach,
            version,
            kind: CacheType::ServerPersistent,
            seen: Arc::new(Mutex::new(cache.stats())),
            cache,
            limit,
            probe,
            holders: 0,
            holder: String::new(),
            _chain: Arc::new(chain),
            _attach_lock: Some(file),
        })
    }

    /// Attach, vDisk and version of target `id`'s open cache (for descriptions of INFO).
    pub fn current(&self, id: &str) -> Option<(String, u32)> {
        lock(&self.live)
            .get(id)
            .map(|c| (c.attach.clone(), c.version))
    }
}

/// The selector of version `n` (0: the base).
pub fn version_selector(n: u32) -> Selector {
    if n == 0 {
        Selector::Base
    } else {
        Selector::Number(n)
    }
}

pub fn layer_number(layer: Layer) -> u32 {
    match layer {
        Layer::Base => 0,
        Layer::Version(n) => n,
    }
}

/// One connection's hold on a target's server-side cache; counts what the cache did for
/// the session. Dropped when the connection closes: the last holder of a persistent cache
/// flushes and closes it (so that another server may open it); a `server` cache stays for
/// a reconnect of its attach.
#[derive(Debug)]
pub struct TargetHold {
    /// The cache, for the API's figures of the session.
    pub probe: CacheProbe,
    caches: Arc<TargetCaches>,
    id: String,
    cache: Arc<dyn WriteCache>,
    write_through: bool,
    /// The cache's figures when last charged (shared by the attach's connections).
    seen: Arc<Mutex<StatsSnapshot>>,
}

impl TargetHold {
    /// `server-persistent`: every write, trim and zero is made durable before it is
    /// acknowledged (as if sent with FUA). The agent forgets a write once it is answered,
    /// and NBD cannot replay it, so an answered write must outlive the server process
    /// (SIGKILL, power loss) for the guest never to see it lost.
    ///
    /// Not for an agent that journals (it asks for `target/ID…+journal`): it keeps every
    /// answered write until a flush covers it and sends them all again on its next
    /// connection, before anything else, so a write lost with the server comes back.
    pub fn write_through(&self) -> bool {
        self.write_through
    }

    /// The client keeps a journal of its answered writes (see [`TargetHold::write_through`]).
    pub fn answered_by_journal(&mut self) {
        if self.write_through {
            log::info!(
                "target {}: the agent journals its writes; they are answered without a sync each",
                self.id
            );
        }
        self.write_through = false;
    }

    /// Charges what reached the cache's file since the last call to `session` and
    /// `totals` (store reads and writes), and sets the session's `cache_used`.
    pub fn charge(&self, session: &Session, totals: &Counters) {
        let now = self.cache.stats();
        let mut seen = lock(&self.seen);
        let d = |a: u64, b: u64| a.saturating_sub(b);
        let (ro, rb, wo, wb) = (
            d(now.disk_read_ops, seen.disk_read_ops),
            d(now.disk_read_bytes, seen.disk_read_bytes),
            d(now.disk_write_ops, seen.disk_write_ops),
            d(now.disk_write_bytes, seen.disk_write_bytes),
        );
        *seen = now;
        drop(seen);
        for c in [&session.counters, totals] {
            Counters::add(&c.store_read_ops, ro);
            Counters::add(&c.store_read_bytes, rb);
            Counters::add(&c.store_write_ops, wo);
            Counters::add(&c.store_write_bytes, wb);
        }
        session.counters.cache_used.store(
            now.ram_bytes + now.file_bytes,
            std::sync::atomic::Ordering::Relaxed,
        );
    }
}

impl Drop for TargetHold {
    fn drop(&mut self) {
        let mut live = lock(&self.caches.live);
        let Some(c) = live.get_mut(&self.id) else {
            return;
        };
        if !Arc::ptr_eq(&c.cache, &self.cache) {
            return;
        }
        c.holders = c.holders.saturating_sub(1);
        if c.holders == 0 && c.kind == CacheType::ServerPersistent {
            if let Err(e) = c.cache.flush() {
                log::error!(
                    "target {}: flushing its server-persistent cache at disconnect failed: {e}",
                    self.id
                );
            }
            live.remove(&self.id);
        }
    }
}
