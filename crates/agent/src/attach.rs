//! One attach of one target: [`Agent::open`] takes the target's lock, connects the remote
//! base, opens the write cache over it and binds the local socket; [`Agent::serve`] serves
//! the local export and publishes the status every second until shutdown, then drains.
//!
//! Invariants:
//! - One agent per target id (an `flock` on `RUN/ID.lock`), and never two servers on one
//!   socket: a socket a live process answers on is refused, a stale one is replaced.
//! - The local socket exists only once the vDisk is reachable and the cache is open, so a
//!   client that connects is served at once.
//! - A non-persistent cache starts empty (the cache types guarantee it); the persistent
//!   type reopens its cache only over the same vDisk (size and identity are checked).
//! - At shutdown, every request already read is answered, the device is flushed, the
//!   socket removed and a last status with state `stopped` written.
//! - With `record_trace`, a [`TraceDev`] on top of the stack records every request the
//!   local export receives (and nothing the agent does itself, such as its last flush);
//!   the trace is written out after the drain.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vdstream_blockdev::{BlockDev, TraceDev};
use vdstream_nbd::server::{
    ExportInfo, Exports, Listener, OpenError, Server, ServerConfig, ShutdownSignal,
};
use vdstream_wcache::space::{self, prepare_cache_dir, Capacity, DirRule};
use vdstream_wcache::{CacheConfig, CacheType, WriteCache};

use crate::api::ApiLink;
use crate::endpoint::Endpoint;
use crate::kernel_nbd::KernelNbd;
use crate::migrate::{Migration, TrackedDev};
use crate::remote::{RemoteBase, RemoteOptions, Reorder};
use crate::status::{self, CacheStatus, IoStatus, ServerStatus, Status, VdiskStatus};
use crate::{paths, AgentError};

/// Everything an attach needs; the CLI fills it from flags and defaults ([`crate::paths`]).
#[derive(Debug, Clone)]
pub struct AttachConfig {
    pub target: String,
    pub endpoints: Vec<Endpoint>,
    pub cache: CacheType,
    /// RAM for `device-ram` and `ram-overflow`.
    pub ram: u64,
    /// Folder of the overflow or cache file.
    pub cache_dir: PathBuf,
    /// Cap on the overflow or cache file.
    pub overflow_max: Option<u64>,
    /// `--overflow-device`: a raw disk or partition holds ram-overflow's overflow or
    /// device-disk's page file instead of a file in `cache_dir` (empty at every start).
    pub overflow_device: Option<PathBuf>,
    /// Start even when the cache folder's file system has less than
    /// [`vdstream_wcache::space::MIN_FREE`] free (`--allow-low-space`).
    pub allow_low_space: bool,
    pub intermediate_buffering: bool,
    pub socket: PathBuf,
    /// Serve the unix socket `socket` (false: `--kernel-nbd` alone, no `--socket`).
    pub serve_socket: bool,
    /// `--kernel-nbd /dev/nbdN`: present the disk to the kernel's NBD driver there
    /// ([`crate::kernel_nbd`]); the agent ends when the kernel disconnects it.
    pub kernel_nbd: Option<PathBuf>,
    pub listen: Option<SocketAddr>,
    /// `--read-only`: the guest reads the vDisk and cannot write (a shared data disk); no
    /// write cache is opened, and a read-only export is enough for every cache type.
    pub read_only: bool,
    /// `--vhost-user PATH`: also (or only, without `serve_socket`) offer the disk as a
    /// vhost-user-blk backend on this unix socket, for a VM on this host.
    pub vhost_user: Option<PathBuf>,
    /// Queues, threads and block size of the vhost-user-blk device.
    pub vhost: vdstream_vhost::Options,
    pub status_path: PathBuf,
    pub lock_path: PathBuf,
    pub remote: RemoteOptions,
    /// How often the status file is rewritten (and reported to the API).
    pub status_every: Duration,
    /// With `--server http://`: the servers' API, one client per endpoint, for reports
    /// and re-placement after a failover.
    pub api: Option<ApiLink>,
    /// Record every request of the local export into this I/O trace file.
    pub record_trace: Option<PathBuf>,
    /// TLS of the local export's TCP listener (`--listen`); the unix socket stays
    /// plaintext (a one-host client). `None`: plaintext.
    pub listen_tls: Option<(vdstream_nbd::TlsMode, Arc<vdstream_tls::files::ServerTls>)>,
    /// The migration socket this agent listens on, as a live migration's source
    /// ([`crate::migrate`]); host-side cache types only. `None`: none.
    pub migrate_socket: Option<PathBuf>,
    /// `--migrate-listen ADDR`: also take destination agents on TCP with TLS (both show the
    /// target's certificate; [`crate::migrate::link`]). Needs `migrate_socket`.
    pub migrate_listen: Option<crate::migrate::link::TlsListen>,
    /// `--incoming SOCKET|tls://HOST:PORT`: take the target's cache from the source agent
    /// there (a live migration's destination); the export holds every request until the
    /// handover is done.
    pub incoming: Option<crate::migrate::link::SourceAddr>,
}

/// Bytes of answered, unflushed writes a `server-persistent` target keeps for a replay
/// before it flushes the server itself (`--journal-max`).
pub const DEFAULT_JOURNAL_MAX: u64 = 64 << 20;

impl AttachConfig {
    /// A config with every default for target `id` reading from `endpoints`.
    pub fn new(id: &str, endpoints: Vec<Endpoint>) -> AttachConfig {
        AttachConfig {
            target: id.to_string(),
            endpoints,
            cache: CacheType::RamOverflow,
            ram: 256 << 20,
            cache_dir: paths::cache_dir(id),
            overflow_max: None,
            overflow_device: None,
            allow_low_space: false,
            intermediate_buffering: false,
            socket: paths::socket_path(id),
            serve_socket: true,
            kernel_nbd: None,
            listen: None,
            read_only: false,
            vhost_user: None,
            vhost: vdstream_vhost::Options {
                serial: serial_of(id),
                ..vdstream_vhost::Options::default()
            },
            status_path: paths::status_path(id),
            lock_path: paths::lock_path(id),
            remote: RemoteOptions {
                target: id.to_string(),
                journal: Some(DEFAULT_JOURNAL_MAX),
                ..RemoteOptions::default()
            },
            status_every: Duration::from_secs(1),
            api: None,
            record_trace: None,
            listen_tls: None,
            migrate_socket: Some(crate::migrate::socket_path(id)),
            migrate_listen: None,
            incoming: None,
        }
    }

    /// The types whose writes go to the server rather than a local cache.
    pub fn passes_through(&self) -> bool {
        matches!(
            self.cache,
            CacheType::Server | CacheType::ServerPersistent | CacheType::Private
        )
    }

    /// No write cache: the types that pass through, and a read-only attach.
    fn cacheless(&self) -> bool {
        self.read_only || self.passes_through()
    }

    /// A live migration can move this attach: its cache on this host, or its attach on a
    /// store server (`server`, `server-persistent`). Not `private` (its writes go to the
    /// vDisk itself) nor a read-only attach (nothing to move: attach it anew).
    pub fn migrates(&self) -> bool {
        !self.read_only && self.cache != CacheType::Private
    }
}

/// A running attach. See the module docs.
#[derive(Debug)]
pub struct Agent {
    cfg: AttachConfig,
    remote: Arc<RemoteBase>,
    cache: Option<Arc<dyn WriteCache>>,
    dev: Arc<dyn BlockDev>,
    /// The recorder on top of `dev`, with `record_trace`.
    trace: Option<Arc<TraceDev>>,
    unix: Option<std::os::unix::net::UnixListener>,
    /// With `vhost_user`: its socket, bound at open, served from `serve`.
    vhost_listener: Option<std::os::unix::net::UnixListener>,
    vhost: Option<vdstream_vhost::VhostServer>,
    /// With `kernel_nbd`: the device, up since [`Agent::open`].
    kernel: Option<KernelNbd>,
    /// Host-side cache types: the live migration state, and the migration socket (bound
    /// at open, served from `serve`).
    migration: Option<Arc<Migration>>,
    migrate_listener: Option<crate::migrate::Listener>,
    /// The status file, through its folder as opened at attach.
    status_file: status::StatusFile,
    /// The status file cannot be written (warned once).
    status_failing: std::sync::atomic::AtomicBool,
    started_ms: u64,
    _lock: File,
}

impl Agent {
    /// Takes the target's lock, connects, opens the cache and binds the local socket.
    pub fn open(mut cfg: AttachConfig) -> Result<Agent, AgentError> {
        paths::check_target_id(&cfg.target)?;
        cfg.remote.target = cfg.target.clone();
        for dir in [
            cfg.lock_path.parent(),
            cfg.socket.parent(),
            cfg.status_path.parent(),
        ]
        .into_iter()
        .flatten()
        {
            create_private_dir(dir)?;
        }
        let lock = take_lock(&cfg.target, &cfg.lock_path)?;
        let status_file = status::StatusFile::open(&cfg.status_path)?;
        if cfg.serve_socket {
            check_socket(&cfg.socket)?;
        }
        if let Some(path) = &cfg.vhost_user {
            if cfg.serve_socket && path == &cfg.socket {
                return Err(AgentError::SocketInUse {
                    path: path.clone(),
                    reason:
                        "is also the NBD socket: give --vhost-user and --socket different paths"
                            .into(),
                });
            }
            check_socket(path)?;
        }
        if let Some(dev) = &cfg.kernel_nbd {
            // Before connecting: a wrong device is refused at once, not after the wait.
            crate::kernel_nbd::open_device(dev)?;
        }
        cfg.remote.writable = cfg.passes_through() && !cfg.read_only;
        for (asked, flag) in [
            (cfg.incoming.is_some(), "--incoming takes"),
            (cfg.migrate_listen.is_some(), "--migrate-listen offers"),
        ] {
            if asked && !cfg.migrates() {
                return Err(AgentError::Migration {
                    id: cfg.target.clone(),
                    reason: format!("{flag} a target's write cache (every type but private), or its attach on a store server (server, server-persistent), not {}{}", cfg.cache, if cfg.read_only { " --read-only" } else { "" }),
                });
            }
        }
        // A folder the user named must have an existing parent (a typo is refused, not
        // created); the default one is created whole. Checked before connecting.
        let dir_rule = if cfg.cache_dir == paths::cache_dir(&cfg.target) {
            DirRule::CreateAll
        } else {
            DirRule::ParentMustExist
        };
        if let Some(dev) = cfg.overflow_device.clone() {
            let dev = &dev;
            if !matches!(cfg.cache, CacheType::RamOverflow | CacheType::DeviceDisk) {
                return Err(AgentError::OverflowDevice {
                    id: cfg.target.clone(),
                    device: dev.clone(),
                    reason: format!("the {} cache has no use for it: it takes ram-overflow (its overflow) or device-disk (its page file)", cfg.cache),
                });
            }
            // The device's size caps ram-overflow's overflow (and so shows in the status).
            let (_, size) = vdstream_wcache::device::open_exclusive(dev, false).map_err(|e| {
                AgentError::OverflowDevice {
                    id: cfg.target.clone(),
                    device: dev.clone(),
                    reason: e.to_string(),
                }
            })?;
            if cfg.cache == CacheType::RamOverflow {
                let units =
                    size / vdstream_wcache::overflow::UNIT * vdstream_wcache::overflow::UNIT;
                cfg.overflow_max = Some(cfg.overflow_max.map_or(units, |m| m.min(units)));
            }
        }
        if !cfg.cacheless()
            && cfg.overflow_device.is_none()
            && space::file_limit(cfg.cache, cfg.overflow_max, 0).is_some()
        {
            prepare_cache_dir(&cfg.cache_dir, dir_rule).map_err(|source| AgentError::CacheDir {
                id: cfg.target.clone(),
                reason: source,
            })?;
        }
        if cfg.cache != CacheType::ServerPersistent || cfg.read_only {
            // Only a cache that outlives its server can take a replay: a `server` cache dies
            // with it (the reconnect is refused), the others do not write to the server.
            cfg.remote.journal = None;
        }
        if let (Some(source), true) = (&cfg.incoming, cfg.passes_through()) {
            // A `server`-type destination joins the attach its source holds: the store
            // server's cache is the target's, and a new attach would drop it.
            let join =
                crate::migrate::join(source, &cfg.target, cfg.cache.name()).map_err(|reason| {
                    AgentError::Migration {
                        id: cfg.target.clone(),
                        reason: format!("the incoming migration cannot start: {reason}"),
                    }
                })?;
            log::info!(
                "target {}: joining attach {} of the source agent at {source}",
                cfg.target,
                join.export
            );
            cfg.remote.join = Some(join);
        }
        let reorder = cfg.api.clone().map(|a| Arc::new(a) as Arc<dyn Reorder>);
        let remote = Arc::new(RemoteBase::connect_with(
            cfg.endpoints.clone(),
            cfg.remote.clone(),
            reorder,
        )?);
        let id = remote.identity();
        let (ep, _) = remote.endpoint_in_use();
        log::info!(
            "target {}: reading export {:?} ({} bytes) from {ep}",
            cfg.target,
            id.export,
            id.size
        );
        let (cache, dev): (Option<Arc<dyn WriteCache>>, Arc<dyn BlockDev>) = if cfg.read_only {
            (None, Arc::new(vdstream_blockdev::ReadOnly(remote.clone())))
        } else if cfg.passes_through() {
            (None, remote.clone())
        } else {
            let ccfg = CacheConfig {
                target: cfg.target.clone(),
                ram: cfg.ram,
                dir: cfg.cache_dir.clone(),
                max_file: cfg.overflow_max,
                intermediate_buffering: cfg.intermediate_buffering,
                overflow_device: cfg.overflow_device.clone(),
                lock_path: None,
                ..CacheConfig::new(&cfg.target)
            };
            let kind = cfg.cache;
            // A device's room is its size (the cache answers ENOSPC past it); a folder's is checked.
            let room = if cfg.overflow_device.is_some() {
                Ok(None)
            } else {
                space::check_cache_room(kind, &ccfg, dir_rule, id.size, cfg.allow_low_space)
            };
            match room {
                Ok(None) => {}
                Ok(Some(warning)) => log::warn!("target {}: {warning}", cfg.target),
                Err(source) => {
                    return Err(AgentError::CacheDir {
                        id: cfg.target.clone(),
                        reason: source,
                    })
                }
            }
            let lower: Arc<dyn BlockDev> = remote.clone();
            if cfg.incoming.is_some() && kind == CacheType::DeviceDiskPersistent {
                // A destination starts from its source's cache alone: what an earlier attach
                // here left is older than it.
                for f in vdstream_wcache::persistent::cache_paths(&cfg.cache_dir, &cfg.target) {
                    crate::migrate::remove_quietly(&f, &cfg.target);
                }
            }
            let cache: Arc<dyn WriteCache> = if kind == CacheType::DeviceDiskPersistent {
                let identity = format!("{} {}", id.export, id.description.as_deref().unwrap_or(""));
                Arc::new(
                    vdstream_wcache::persistent::PersistentDiskCache::open_with_identity(
                        lower,
                        &ccfg,
                        kind,
                        identity.trim(),
                    )
                    .map_err(|err| AgentError::Cache {
                        id: cfg.target.clone(),
                        kind,
                        err,
                    })?,
                )
            } else {
                vdstream_wcache::open(kind, lower, &ccfg).map_err(|err| AgentError::Cache {
                    id: cfg.target.clone(),
                    kind,
                    err,
                })?
            };
            let dev: Arc<dyn BlockDev> = cache.clone();
            (Some(cache), dev)
        };
        // Host-side caches: dirty logging, the gate of an incoming attach, the fence.
        let (dev, migration) = match &cache {
            Some(c) => {
                let tracked = Arc::new(TrackedDev::new(
                    dev,
                    &format!("target {}", cfg.target),
                    cfg.incoming.is_some(),
                ));
                for (off, len) in c.held().unwrap_or_default() {
                    tracked.mark_held(off, len);
                }
                let files = if cfg.cache == CacheType::DeviceDiskPersistent {
                    vdstream_wcache::persistent::cache_paths(&cfg.cache_dir, &cfg.target).to_vec()
                } else {
                    Vec::new()
                };
                let m = Migration::new(
                    tracked.clone(),
                    &cfg.target,
                    &id.export,
                    cfg.cache.name(),
                    files,
                );
                (tracked as Arc<dyn BlockDev>, Some(m))
            }
            None if cfg.migrates() => {
                // The `server` types: the gate and the fence, no dirty log; the handover
                // moves their attach.
                let tracked = Arc::new(
                    TrackedDev::new(
                        dev,
                        &format!("target {}", cfg.target),
                        cfg.incoming.is_some(),
                    )
                    .untracked(),
                );
                let m = Migration::for_server(
                    tracked.clone(),
                    &cfg.target,
                    &id.export,
                    cfg.cache.name(),
                    remote.clone(),
                );
                (tracked as Arc<dyn BlockDev>, Some(m))
            }
            None => (dev, None),
        };
        let migrate_listener = match (&migration, &cfg.migrate_socket) {
            (Some(_), Some(path)) => {
                let l =
                    crate::migrate::Listener::bind(path).map_err(|e| AgentError::SocketInUse {
                        path: path.clone(),
                        reason: format!("cannot listen for live migrations: {e}"),
                    })?;
                Some(match &cfg.migrate_listen {
                    None => l,
                    Some((addr, tls)) => {
                        l.with_tls(*addr, tls.clone())
                            .map_err(|e| AgentError::SocketInUse {
                                path: PathBuf::from(addr.to_string()),
                                reason: format!(
                                    "cannot listen for live migrations (--migrate-listen): {e}"
                                ),
                            })?
                    }
                })
            }
            _ => None,
        };
        let trace = match &cfg.record_trace {
            None => None,
            Some(path) => Some(Arc::new(TraceDev::create(dev.clone(), path).map_err(
                |e| AgentError::Trace {
                    id: cfg.target.clone(),
                    message: e.to_string(),
                },
            )?)),
        };
        let unix = if cfg.serve_socket {
            check_socket(&cfg.socket)?;
            let unix = std::os::unix::net::UnixListener::bind(&cfg.socket).map_err(|e| {
                AgentError::SocketInUse {
                    path: cfg.socket.clone(),
                    reason: format!("cannot listen: {e}"),
                }
            })?;
            unix.set_nonblocking(true).map_err(|err| AgentError::Io {
                what: "cannot set up the socket".into(),
                err,
            })?;
            Some(unix)
        } else {
            None
        };
        let vhost_listener = match &cfg.vhost_user {
            None => None,
            Some(path) => {
                check_socket(path)?;
                let l = std::os::unix::net::UnixListener::bind(path).map_err(|e| {
                    if unix.is_some() {
                        let _ = std::fs::remove_file(&cfg.socket);
                    }
                    AgentError::SocketInUse {
                        path: path.clone(),
                        reason: format!("cannot listen: {e}"),
                    }
                })?;
                // Whoever connects reads and writes this disk, as the VM: the owner only.
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(
                    |err| AgentError::Io {
                        what: format!("cannot make {} private", path.display()),
                        err,
                    },
                )?;
                Some(l)
            }
        };
        if cfg.vhost_user.is_some() {
            // The block size a guest sees is the vDisk's smallest I/O (512 unless its server says more).
            cfg.vhost.logical_block = remote.min_block().clamp(512, 65536) as u32;
        }
        let mut agent = Agent {
            cfg,
            remote,
            cache,
            dev,
            trace,
            unix,
            vhost_listener,
            vhost: None,
            kernel: None,
            migration,
            migrate_listener,
            status_file,
            status_failing: Default::default(),
            started_ms: status::now_ms(),
            _lock: lock,
        };
        if let Some(device) = agent.cfg.kernel_nbd.clone() {
            let server = Arc::new(Server::new(agent.exports(), local_export_config()));
            let k = KernelNbd::start(&device, server, agent.exported());
            if k.is_err() && agent.cfg.serve_socket {
                let _ = std::fs::remove_file(&agent.cfg.socket);
            }
            agent.kernel = Some(k?);
            log::info!(
                "target {}: {} is up: the kernel reads and writes this target's disk there",
                agent.cfg.target,
                device.display()
            );
        }
        Ok(agent)
    }

    /// What the exports serve: the trace recorder on top, or the device.
    fn exported(&self) -> Arc<dyn BlockDev> {
        match &self.trace {
            Some(t) => t.clone(),
            None => self.dev.clone(),
        }
    }

    /// The local export: "" and the target id.
    fn exports(&self) -> Arc<AgentExports> {
        let description = format!(
            "target {}: vDisk {:?} from {} through a {} write cache",
            self.cfg.target,
            self.remote.identity().export,
            self.remote.endpoint_in_use().0,
            self.cfg.cache
        );
        Arc::new(AgentExports {
            name: self.cfg.target.clone(),
            description,
            dev: self.exported(),
        })
    }

    /// The device the local export serves (the cache, or the remote base for the
    /// pass-through types).
    pub fn device(&self) -> Arc<dyn BlockDev> {
        self.dev.clone()
    }

    /// With `record_trace`: its file and how many requests it holds (after `serve`).
    pub fn trace(&self) -> Option<(PathBuf, Result<u64, vdstream_blockdev::TraceError>)> {
        self.trace
            .as_ref()
            .map(|t| (t.trace_path().to_path_buf(), t.finish()))
    }

    pub fn remote(&self) -> &RemoteBase {
        &self.remote
    }

    pub fn config(&self) -> &AttachConfig {
        &self.cfg
    }

    /// Serves the local export until `shutdown` fires, then drains, flushes, removes the
    /// socket and writes the last status. Must run inside a multi-thread tokio runtime.
    pub async fn serve(&mut self, outer: ShutdownSignal) -> Result<(), AgentError> {
        if let (Some(listener), Some(path)) =
            (self.vhost_listener.take(), self.cfg.vhost_user.clone())
        {
            let server = vdstream_vhost::VhostServer::start(
                listener,
                &path,
                self.exported(),
                self.cfg.vhost.clone(),
                &self.cfg.target,
            )
            .map_err(|err| AgentError::Io {
                what: format!("cannot serve vhost-user-blk on {}", path.display()),
                err,
            })?;
            log::info!(
                "target {}: vhost-user-blk on {} ({} queues): attach a VM with -object memory-backend-memfd,id=mem,size=RAM,share=on -numa node,memdev=mem \
                 -chardev socket,id=c0,path={},reconnect-ms=1000 -device vhost-user-blk-pci,chardev=c0,num-queues={}",
                self.cfg.target,
                path.display(),
                self.cfg.vhost.queues,
                path.display(),
                self.cfg.vhost.queues
            );
            self.vhost = Some(server);
        }
        if let (Some(m), Some(l)) = (&self.migration, self.migrate_listener.take()) {
            log::info!(
                "target {}: live migrations from this agent: {}",
                self.cfg.target,
                l.describe()
            );
            l.start(m.clone());
        }
        if let (Some(m), Some(source)) = (&self.migration, &self.cfg.incoming) {
            crate::migrate::run_incoming(m.clone(), source.clone(), self.remote.identity().size);
        }
        // The local servers drain when `outer` fires, when the kernel lets go of its device,
        // or when a live migration ends this agent.
        let (trigger, shutdown) = ShutdownSignal::new();
        let trigger = Arc::new(trigger);
        let forward = {
            let (trigger, mut outer) = (trigger.clone(), outer);
            tokio::spawn(async move {
                outer.wait().await;
                trigger.shutdown();
            })
        };
        let exports = self.exports();
        let server = Arc::new(Server::new(exports.clone(), local_export_config()));
        let mut tasks = Vec::new();
        if let Some(std_unix) = self.unix.take() {
            let unix =
                tokio::net::UnixListener::from_std(std_unix).map_err(|err| AgentError::Io {
                    what: "cannot serve the socket".into(),
                    err,
                })?;
            let (server, shutdown) = (server.clone(), shutdown.clone());
            tasks.push(tokio::spawn(async move {
                server.serve(Listener::Unix(unix), shutdown).await
            }));
        }
        if let Some(addr) = self.cfg.listen {
            let tcp = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|err| AgentError::Io {
                    what: format!("cannot listen on {addr} (is another server using that port?)"),
                    err,
                })?;
            let server = match &self.cfg.listen_tls {
                Some((mode, tls)) => Arc::new(Server::new(
                    exports.clone(),
                    ServerConfig {
                        tls: Some(tls.clone()),
                        tls_mode: *mode,
                        ..local_export_config()
                    },
                )),
                None => server.clone(),
            };
            let shutdown = shutdown.clone();
            tasks.push(tokio::spawn(async move {
                server.serve(Listener::Tcp(tcp), shutdown).await
            }));
        }
        let mut prev = (self.status(None), Instant::now());
        let mut wait = shutdown.clone();
        loop {
            self.publish(&prev.0);
            let migrated = async {
                match &self.migration {
                    Some(m) if !m.ended() => m.end.notified().await,
                    Some(_) => {}
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = wait.wait() => break,
                _ = migrated => {
                    log::info!("target {}: the live migration ended this attach", self.cfg.target);
                    trigger.shutdown();
                    break;
                }
                _ = tokio::time::sleep(self.cfg.status_every) => {}
            }
            let now = self.status(Some((&prev.0, prev.1.elapsed())));
            prev = (now, Instant::now());
            if self.kernel.as_ref().is_some_and(|k| !k.connected()) {
                log::info!(
                    "target {}: the kernel disconnected {}; detaching",
                    self.cfg.target,
                    self.cfg
                        .kernel_nbd
                        .as_deref()
                        .unwrap_or(Path::new(""))
                        .display()
                );
                trigger.shutdown();
                break;
            }
        }
        forward.abort();
        if let Some(mut k) = self.kernel.take() {
            // The kernel sends DISC; what it sent before is answered; then the device is cleared.
            let _ = tokio::task::spawn_blocking(move || k.stop()).await;
        }
        if let Some(mut v) = self.vhost.take() {
            // The frontend is let go; the requests its queues hold are answered first.
            let figures = tokio::task::spawn_blocking(move || {
                v.stop();
                v.figures()
            })
            .await;
            if let Ok(f) = figures {
                log::info!("target {}: vhost-user-blk stopped after {} frontends, {} requests ({} failed, {} malformed)", self.cfg.target, f.connections, f.requests, f.errors, f.malformed);
            }
        }
        for t in tasks {
            match t.await {
                Ok(Err(e)) => log::error!(
                    "target {}: the local NBD server failed: {e}",
                    self.cfg.target
                ),
                Err(e) => log::error!(
                    "target {}: the local NBD server task failed: {e}",
                    self.cfg.target
                ),
                Ok(Ok(())) => {}
            }
        }
        // A fenced source flushes its cache below the fence (it is gone with the agent).
        let dev = match &self.migration {
            Some(m) if !m.dev.is_open() => m.dev.below().clone(),
            _ => self.dev.clone(),
        };
        if let Err(e) = tokio::task::spawn_blocking(move || dev.flush())
            .await
            .unwrap_or(Ok(()))
        {
            log::error!("target {}: the last flush failed: {e}", self.cfg.target);
        }
        if let Some(trace) = self.trace.clone() {
            match tokio::task::spawn_blocking(move || trace.finish()).await {
                Ok(Ok(n)) => log::info!("target {}: {n} requests recorded", self.cfg.target),
                Ok(Err(e)) => log::error!("target {}: {e}", self.cfg.target),
                Err(e) => log::error!("target {}: the trace writer failed: {e}", self.cfg.target),
            }
        }
        if self.cfg.serve_socket {
            let _ = std::fs::remove_file(&self.cfg.socket);
        }
        let mut last = self.status(Some((&prev.0, prev.1.elapsed())));
        last.state = match last.migration.as_ref() {
            Some(m) if m.role == "source" && m.phase == "done" => "migrated".into(),
            _ => "stopped".into(),
        };
        if let Err(e) = self.status_file.write(&last) {
            log::warn!("target {}: {e}", self.cfg.target);
        }
        let incoming_failed = last
            .migration
            .as_ref()
            .filter(|m| m.role == "destination" && m.phase == "failed")
            .map(|m| m.error.clone().unwrap_or_default());
        if let Some(api) = self.cfg.api.clone() {
            let index = self.remote.endpoint_index();
            let _ = tokio::task::spawn_blocking(move || api.report_blocking(index, &last)).await;
        }
        match incoming_failed {
            Some(reason) => Err(AgentError::Migration {
                id: self.cfg.target.clone(),
                reason: format!(
                    "the incoming migration failed: {reason}; the source agent keeps the target"
                ),
            }),
            None => Ok(()),
        }
    }

    /// Writes the status file and, with the API, reports it to the server in use.
    fn publish(&self, s: &Status) {
        match self.status_file.write(s) {
            // Said once, not every second: the console must not fill up with it.
            Err(e) if !self.status_failing.swap(true, Relaxed) => {
                log::warn!(
                    "target {}: {e} (said once; the agent goes on)",
                    self.cfg.target
                )
            }
            Err(e) => log::debug!("target {}: {e}", self.cfg.target),
            Ok(()) => self.status_failing.store(false, Relaxed),
        }
        if let Some(api) = &self.cfg.api {
            api.report(self.remote.endpoint_index(), s);
        }
    }

    /// The figures now; rates over `prev` (the last reading and its age).
    pub fn status(&self, prev: Option<(&Status, Duration)>) -> Status {
        let c = self.remote.counters();
        let id = self.remote.identity();
        let (endpoint, connected) = self.remote.endpoint_in_use();
        let server = ServerStatus {
            endpoint,
            connected,
            endpoints: self.remote.endpoints(),
            retries: c.retries.load(Relaxed),
            reconnects: c.reconnects.load(Relaxed),
            failovers: c.failovers.load(Relaxed),
            gave_up: c.gave_up.load(Relaxed),
            read_ops: c.read_ops.load(Relaxed),
            read_bytes: c.read_bytes.load(Relaxed),
            write_ops: c.write_ops.load(Relaxed),
            write_bytes: c.write_bytes.load(Relaxed),
            journal: self.remote.journal_status(),
            lost: self.remote.lost(),
        };
        let remote_io = IoStatus {
            read_ops: server.read_ops,
            read_bytes: server.read_bytes,
            write_ops: server.write_ops,
            write_bytes: server.write_bytes,
            ..IoStatus::default()
        };
        let (cache, mut guest, mut storage) = match &self.cache {
            None => (
                CacheStatus {
                    kind: self.cfg.cache.name().into(),
                    ..CacheStatus::default()
                },
                remote_io,
                remote_io,
            ),
            Some(cache) => {
                let s = cache.stats();
                let cap = Capacity::of(
                    self.cfg.cache,
                    self.cfg.ram,
                    self.cfg.overflow_max,
                    &self.cfg.cache_dir,
                    id.size,
                    &s,
                );
                let cs = CacheStatus {
                    kind: self.cfg.cache.name().into(),
                    ram_bytes: s.ram_bytes,
                    ram_limit: space::ram_limit(self.cfg.cache, self.cfg.ram),
                    file_bytes: s.file_bytes,
                    file_limit: space::file_limit(self.cfg.cache, self.cfg.overflow_max, id.size)
                        .unwrap_or(0),
                    limit_bytes: cap.limit,
                    fs_free_bytes: cap.fs_free,
                    capacity_bytes: cap.capacity,
                    used_percent: cap.used_percent(),
                    hits: s.hits,
                    misses: s.misses,
                    evictions: s.evictions,
                    nospace_errors: s.nospace_errors,
                    dir: self.cfg.cache_dir.display().to_string(),
                };
                let guest = IoStatus {
                    read_ops: s.guest_read_ops,
                    read_bytes: s.guest_read_bytes,
                    write_ops: s.guest_write_ops,
                    write_bytes: s.guest_write_bytes,
                    ..IoStatus::default()
                };
                let storage = IoStatus {
                    read_ops: s.vdisk_read_ops + s.overflow_read_ops + s.disk_read_ops,
                    read_bytes: s.vdisk_read_bytes + s.overflow_read_bytes + s.disk_read_bytes,
                    write_ops: s.storage_write_ops(),
                    write_bytes: s.vdisk_write_bytes + s.overflow_write_bytes + s.disk_write_bytes,
                    ..IoStatus::default()
                };
                (cs, guest, storage)
            }
        };
        if let Some((p, age)) = prev {
            guest.rate_from(&p.guest, age.as_secs_f64());
            storage.rate_from(&p.storage, age.as_secs_f64());
        }
        Status {
            target: self.cfg.target.clone(),
            pid: std::process::id(),
            state: if server.lost.is_some() {
                status::STATE_LOST.into()
            } else {
                "running".into()
            },
            started_unix_ms: self.started_ms,
            updated_unix_ms: status::now_ms(),
            socket: if self.cfg.serve_socket {
                self.cfg.socket.display().to_string()
            } else {
                String::new()
            },
            listen: self.cfg.listen.map(|a| a.to_string()),
            vhost_user: self.cfg.vhost_user.as_ref().map(|p| {
                let f = self.vhost.as_ref().map(|v| v.figures()).unwrap_or_default();
                status::VhostUserStatus {
                    socket: p.display().to_string(),
                    queues: self.cfg.vhost.queues,
                    connected: f.connected,
                    connections: f.connections,
                    requests: f.requests,
                    errors: f.errors,
                    malformed: f.malformed,
                }
            }),
            migration: self.migration.as_ref().and_then(|m| m.status()),
            vdisk: VdiskStatus {
                export: id.export,
                description: id.description,
                size: id.size,
            },
            server,
            cache,
            guest,
            storage,
        }
    }

    /// One line for the log at exit: guest against storage I/O, and the link's history.
    pub fn summary(&self) -> String {
        let s = self.status(None);
        format!(
            "target {}: {} cache: guest {} reads and {} writes; storage {} reads and {} writes; \
             server {} reads ({} bytes) and {} writes; {} retries, {} reconnects, {} failovers; \
             RAM in use {} bytes, file in use {} bytes, {} evictions, {} writes refused for space",
            s.target,
            s.cache.kind,
            s.guest.read_ops,
            s.guest.write_ops,
            s.storage.read_ops,
            s.storage.write_ops,
            s.server.read_ops,
            s.server.read_bytes,
            s.server.write_ops,
            s.server.retries,
            s.server.reconnects,
            s.server.failovers,
            s.cache.ram_bytes,
            s.cache.file_bytes,
            s.cache.evictions,
            s.cache.nospace_errors,
        )
    }
}

/// The local export: "" and the target id, one device.
#[derive(Debug)]
struct AgentExports {
    name: String,
    description: String,
    dev: Arc<dyn BlockDev>,
}

impl Exports for AgentExports {
    fn list(&self) -> Vec<ExportInfo> {
        vec![ExportInfo {
            name: self.name.clone(),
            description: self.description.clone(),
        }]
    }

    fn open(&self, name: &str) -> Result<Arc<dyn BlockDev>, OpenError> {
        if name.is_empty() || name == self.name {
            Ok(self.dev.clone())
        } else {
            Err(OpenError::Unknown(format!(
                "no export named {name:?}: this agent offers {:?} (or the default empty name)",
                self.name
            )))
        }
    }

    fn description(&self, name: &str) -> Option<String> {
        (name.is_empty() || name == self.name).then(|| self.description.clone())
    }
}

/// How the agent serves its local export (socket, kernel NBD device): a connection there is
/// one guest's (or one kernel queue's) requests, so a device that prefers batches (the
/// `server` types' remote base, device-disk with O_DIRECT) gets one batch runner per
/// connection, which takes everything queued in one pass. Four runners cost the agent two
/// thirds more CPU a request on two cores (15.9 against 9.6 ms per thousand I/Os), in
/// hand-offs between them, for fewer IOPS (bench/hop-ab.sh; docs/BENCHMARKS.md, "The server
/// hop: one batch runner per local connection").
fn local_export_config() -> ServerConfig {
    ServerConfig {
        batch_runners: 1,
        ..ServerConfig::default()
    }
}

/// The disk's serial number a guest reads: the target id, cut to virtio's 20 bytes on a
/// character boundary.
fn serial_of(id: &str) -> String {
    let mut end = id.len().min(20);
    while !id.is_char_boundary(end) {
        end -= 1;
    }
    id[..end].to_string()
}

fn create_private_dir(dir: &Path) -> Result<(), AgentError> {
    use std::os::unix::fs::DirBuilderExt;
    if dir.as_os_str().is_empty() || dir.is_dir() {
        return Ok(());
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|err| AgentError::Io {
            what: format!("cannot create {}", dir.display()),
            err,
        })
}

/// Locks `RUN/ID.lock` for the life of the agent and writes our pid in it.
fn take_lock(id: &str, path: &Path) -> Result<File, AgentError> {
    use vdstream_blockdev::flock::{try_lock, LockMode, LOCK_PATIENCE};
    let io = |err| AgentError::Io {
        what: format!("cannot use the lock file {}", path.display()),
        err,
    };
    let mut f =
        vdstream_blockdev::storefile::open_rw(path, vdstream_blockdev::storefile::SHARED_READ)
            .map_err(io)?;
    if !try_lock(&f, LockMode::Exclusive, LOCK_PATIENCE).map_err(io)? {
        let mut pid = String::new();
        let _ = f.read_to_string(&mut pid);
        return Err(AgentError::AlreadyAttached {
            id: id.to_string(),
            pid: pid.trim().to_string(),
            lock: path.to_path_buf(),
        });
    }
    f.set_len(0).map_err(io)?;
    f.rewind().map_err(io)?;
    writeln!(f, "{}", std::process::id()).map_err(io)?;
    Ok(f)
}

/// Refuses a path that is not a socket or that a live process answers on; removes a
/// stale socket left by a process that died.
fn check_socket(path: &Path) -> Result<(), AgentError> {
    use vdstream_nbd::listen::BindError;
    let in_use = |reason: &str| AgentError::SocketInUse {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    };
    vdstream_nbd::listen::clear_stale_socket(path).map_err(|e| match e {
        BindError::NotASocket(_) => in_use("exists and is not a socket: choose another --socket path"),
        BindError::InUse(_) => in_use("a live server (another agent or serve-image?) is listening on it: stop it or choose another --socket path"),
        BindError::Stale { source, .. } | BindError::Bind { source, .. } => AgentError::Io { what: format!("cannot remove the stale socket {}", path.display()), err: source },
    })
}
