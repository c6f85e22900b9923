//! The store's exports over NBD: what each export name opens, one chain per connection.
//!
//! A connection's layer is chosen when it opens its export (`NBD_OPT_GO`), under the
//! store's shared lock, and its chain stays open, holding the files' shared `flock`s, until
//! the connection closes: a promote meanwhile changes what the *next* connection gets, never
//! this one. Every layer of the chain reads through the server's shared [`ReadCache`].
//!
//! Each connection's device is a [`SessionDev`]: it counts the session's guest I/O, charges
//! its store reads to it (see `readcache`), and holds what the session holds (the opened
//! chain, its registry entry, the maintenance writer slot), releasing them when the
//! connection drops the device.
//!
//! Every open is first put to the authorization policy ([`crate::policy`]) with the
//! client's identity, before the export is looked up: a refusal answers
//! `NBD_REP_ERR_POLICY` naming the rule, and is recorded in the audit trail
//! ([`crate::refusal`]). `NBD_OPT_INFO` is checked as `NBD_OPT_GO`, and `NBD_OPT_LIST`
//! shows a client only the exports it may open.
//!
//! A maintenance version has one writer: the first `maintenance/NAME` connection takes the
//! vDisk's writer slot (and the store's exclusive lock on the file); a second one is
//! refused with `NBD_REP_ERR_POLICY`, naming the session that holds it.

use std::sync::Arc;

use vdstream_blockdev::{BatchIo, BatchOp, BlockDev, Extent, Hole, Result as DevResult, ZeroFlags};
use vdstream_contract::{ExportDescription, ExportName, Identity};
use vdstream_nbd::server::{
    ExportInfo, Exports, OpenError, OpenPurpose, OpenRequest, OpenedExport,
};
use vdstream_store::{Access, DiskAccess, Layer, OpenedLayer, Selector, Store, StoreError};

use crate::policy::{self, Refusal};
use crate::readcache::with_session;
use crate::refusal::{RefusalAudit, RefusedOpen};
use crate::state::{
    unix_ms, Counters, ExportKind, ServerState, Session, SessionGuard, SessionInfo,
};
use crate::target::{
    layer_number, lookup_target, version_selector, TargetCaches, TargetHold, TargetLookupError,
    TargetOpenError,
};
use crate::writer_slot::{WriterSlot, WriterSlots};

/// The exports of one store. See the module docs.
#[derive(Debug)]
pub struct StoreExports {
    state: Arc<ServerState>,
    store: Store,
    /// vDisk name → who writes its maintenance version now.
    writers: WriterSlots,
    /// The server-side caches of `target/ID` exports.
    targets: Arc<TargetCaches>,
    /// Refused opens reach the audit trail through this (bounded).
    refusals: RefusalAudit,
}

/// Whether this process cannot open one more file now (`EMFILE`/`ENFILE`).
fn out_of_fds_now() -> bool {
    match std::fs::File::open("/dev/null") {
        Ok(_) => false,
        Err(e) => matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)),
    }
}

/// The export name that pins version `v` of `vdisk` (0: the base): `vdisk/NAME@3`.
fn vdisk_at(vdisk: &str, v: u32) -> ExportName {
    ExportName::Vdisk {
        vdisk: vdisk.to_string(),
        selector: version_selector(v),
    }
}

/// The description of an export (see `vdstream_contract::description`).
fn describe(
    export: ExportName,
    reads: Option<ExportName>,
    note: impl Into<String>,
) -> ExportDescription {
    ExportDescription {
        export,
        reads,
        note: note.into(),
    }
}

/// `target/ID[@ATTACH]`.
fn target_name(id: &str, attach: Option<String>) -> ExportName {
    ExportName::Target {
        id: id.to_string(),
        attach,
        secret: None,
        journaled: false,
    }
}

/// How a store error reaches the client: unknown things are `UNKNOWN`, a held writer lock
/// is `POLICY` (busy), running out of file descriptors is `Full` (never "unknown"), the
/// rest `UNKNOWN` with the message.
fn open_error(e: StoreError) -> OpenError {
    if e.os_error()
        .is_some_and(|io| vdstream_nbd::server::is_out_of_fds(io))
        || vdstream_nbd::server::is_out_of_fds(&e)
    {
        return OpenError::Full(format!(
            "out of file descriptors ({e}): connect to another server, or lower --max-connections / raise the open-files limit"
        ));
    }
    match e {
        StoreError::UnknownVdisk { .. }
        | StoreError::UnknownVersion { .. }
        | StoreError::BadName(_)
        | StoreError::BadInput(_) => OpenError::Unknown(e.to_string()),
        StoreError::Refused(m) => OpenError::Busy(m),
        other => OpenError::Failed(other.to_string()),
    }
}

fn access_word(opened: &OpenedLayer) -> &'static str {
    if opened.meta.access == DiskAccess::Private {
        return "private";
    }
    match opened.access {
        Some(a) => a.name(),
        None => "base",
    }
}

impl StoreExports {
    pub fn new(state: Arc<ServerState>) -> vdstream_store::Result<StoreExports> {
        let store = Store::open(state.store.clone())?;
        let targets = Arc::new(TargetCaches::new(store.clone(), state.name.clone()));
        Ok(StoreExports {
            state,
            store,
            writers: WriterSlots::default(),
            targets,
            refusals: RefusalAudit::default(),
        })
    }

    /// The vDisk of target `id`'s record, if it has one that can be read.
    fn record_vdisk(&self, id: &str) -> Option<String> {
        lookup_target(&self.store, id).ok().map(|spec| spec.vdisk)
    }

    /// Whether `client` may open `export` (see `policy`); a refusal is audited.
    fn authorize(&self, req: &OpenRequest<'_>, export: &ExportName) -> Result<(), OpenError> {
        let refusal: Refusal =
            match policy::decide(req.client, export, self.state.anonymous, &|id| {
                self.record_vdisk(id)
            }) {
                Ok(()) => return Ok(()),
                Err(r) => r,
            };
        let vdisk = || match export {
            ExportName::Vdisk { vdisk, .. } | ExportName::Maintenance { vdisk, .. } => {
                vdisk.clone()
            }
            ExportName::Target { id, .. } => self.record_vdisk(id).unwrap_or_default(),
        };
        let refused = RefusedOpen {
            client: req.client,
            peer: req.peer,
            export,
            purpose: req.purpose,
            refusal: &refusal,
        };
        self.refusals.record(&self.store, &refused, vdisk);
        Err(OpenError::Policy(refusal.to_string()))
    }

    fn open_vdisk(
        &self,
        export: &str,
        vdisk: &str,
        selector: Selector,
        req: &OpenRequest<'_>,
    ) -> Result<OpenedExport, OpenError> {
        let cache = self.state.read_cache.clone();
        let opened = self
            .store
            .open_layer_with(vdisk, selector, false, &|p, d| cache.wrap(p, d))
            .map_err(open_error)?;
        if opened.meta.access == DiskAccess::Private {
            return Err(OpenError::Policy(format!(
                "vDisk {vdisk} has private access: it is written directly by one target and not served by the store server")));
        }
        let description = describe(
            vdisk_at(vdisk, layer_number(opened.layer)),
            None,
            access_word(&opened),
        )
        .to_string();
        let info = SessionInfo {
            export: export.to_string(),
            kind: ExportKind::Vdisk,
            target: None,
            peer: req.peer.to_string(),
            vdisk: vdisk.to_string(),
            version: layer_number(opened.layer),
            cache_type: None,
            cache_limit: None,
        };
        Ok(self.session(
            req,
            info,
            opened.dev.clone(),
            Held {
                _chain: Some(opened),
                writer: None,
                target: None,
            },
            description,
        ))
    }

    fn open_maintenance(
        &self,
        export: &str,
        vdisk: &str,
        version: Option<u32>,
        req: &OpenRequest<'_>,
    ) -> Result<OpenedExport, OpenError> {
        let slot = self.take_writer_slot(vdisk, req)?;
        let cache = self.state.read_cache.clone();
        let opened = self
            .store
            .open_layer_with(vdisk, Selector::Maintenance, true, &|p, d| cache.wrap(p, d))
            .map_err(open_error)?;
        if opened.meta.access == DiskAccess::Private {
            return Err(OpenError::Policy(format!(
                "vDisk {vdisk} has private access and no versions: it is not served by the store server")));
        }
        let number = layer_number(opened.layer);
        if let Some(want) = version {
            if want != number {
                return Err(OpenError::Unknown(format!(
                    "version {want} of vDisk {vdisk} is no longer in maintenance (version {number} is): connect to {}",
                    ExportName::Maintenance { vdisk: vdisk.to_string(), version: None })));
            }
        }
        if !opened.writable || opened.access != Some(Access::Maintenance) {
            return Err(OpenError::Failed(format!(
                "the maintenance version of vDisk {vdisk} could not be opened read-write"
            )));
        }
        let pinned = ExportName::Maintenance {
            vdisk: vdisk.to_string(),
            version: Some(number),
        };
        let description = describe(pinned, None, "maintenance, read-write, one writer").to_string();
        let info = SessionInfo {
            export: export.to_string(),
            kind: ExportKind::Maintenance,
            target: None,
            peer: req.peer.to_string(),
            vdisk: vdisk.to_string(),
            version: number,
            cache_type: None,
            cache_limit: None,
        };
        Ok(self.session(
            req,
            info,
            opened.dev.clone(),
            Held {
                _chain: Some(opened),
                writer: Some(slot),
                target: None,
            },
            description,
        ))
    }

    /// The vDisk's maintenance writer slot, or the refusal naming who holds it.
    fn take_writer_slot(
        &self,
        vdisk: &str,
        req: &OpenRequest<'_>,
    ) -> Result<WriterSlot, OpenError> {
        self.writers
            .take(vdisk, || {
                let since = vdstream_store::Timestamp::now();
                format!("a connection from {} since {since}", req.peer)
            })
            .map_err(|holder| OpenError::Busy(format!(
                "the maintenance version of vDisk {vdisk} already has its one writer ({holder}, on server {}): \
                 disconnect it first, or read the version read-only through {} once it is released",
                self.state.name, ExportName::Vdisk { vdisk: vdisk.to_string(), selector: Selector::Latest })))
    }

    fn open_target(
        &self,
        export: &str,
        id: &str,
        attach: Option<&str>,
        secret: Option<&str>,
        journaled: bool,
        req: &OpenRequest<'_>,
    ) -> Result<OpenedExport, OpenError> {
        let spec = match lookup_target(&self.store, id) {
            // Only a client that may see every target is told the known ones.
            Err(TargetLookupError::Unknown(m)) if matches!(req.client, Identity::Local | Identity::Admin(_)) => return Err(OpenError::Unknown(m)),
            Err(TargetLookupError::Unknown(_)) => {
                return Err(OpenError::Unknown(format!(
                    "no target named {id:?} on server {}: an administrator adds it with `vdstream target add {id} --vdisk NAME --cache TYPE`",
                    self.state.name
                )))
            }
            Err(TargetLookupError::Failed(m)) => return Err(OpenError::Failed(m)),
            Ok(spec) => spec,
        };
        let cache = self.state.read_cache.clone();
        let open_chain = |selector: Selector| -> Result<OpenedLayer, String> {
            let opened = self
                .store
                .open_layer_with(&spec.vdisk, selector, false, &|p, d| cache.wrap(p, d))
                .map_err(|e| e.to_string())?;
            if opened.meta.access == DiskAccess::Private {
                return Err(format!("vDisk {} of target {id} has private access: it is not served by the store server", spec.vdisk));
            }
            Ok(opened)
        };
        let mut info = SessionInfo {
            export: export.to_string(),
            kind: ExportKind::Target,
            target: Some(id.to_string()),
            peer: req.peer.to_string(),
            vdisk: spec.vdisk.clone(),
            version: 0,
            cache_type: Some(spec.cache.name().to_string()),
            cache_limit: None,
        };
        // INFO that names an attach of a server type goes the way GO does, through the
        // attach's fence: its name is published, and answers nothing without its secret.
        if !spec.server_side() || (req.purpose == OpenPurpose::Info && attach.is_none()) {
            // The device types (the agent keeps the cache): the version, read-only; its
            // number is the attach. INFO of a new attach of a server type: size and name
            // only, no cache.
            let selector = match attach {
                None => spec.version,
                Some(a) => match a.strip_prefix('v').and_then(|n| n.parse::<u32>().ok()) {
                    Some(n) => version_selector(n),
                    None => return Err(OpenError::Unknown(format!("target {id} has cache type {}: its attaches are vN (a version number), not {a:?}", spec.cache))),
                },
            };
            let opened = open_chain(selector).map_err(OpenError::Unknown)?;
            info.version = layer_number(opened.layer);
            let v = info.version;
            let reads = Some(vdisk_at(&spec.vdisk, v));
            let description = if spec.server_side() {
                let name = target_name(id, self.targets.current(id).map(|(a, _)| a));
                describe(
                    name,
                    reads,
                    format!("a {} cache on server {}", spec.cache, self.state.name),
                )
            } else {
                describe(
                    target_name(id, Some(format!("v{v}"))),
                    reads,
                    format!("{} cache on the target; read-only", spec.cache),
                )
            };
            let description = description.to_string();
            return Ok(self.session(
                req,
                info,
                opened.dev.clone(),
                Held {
                    _chain: Some(opened),
                    writer: None,
                    target: None,
                },
                description,
            ));
        }
        let mut opened = self
            .targets
            .open(id, &spec, attach, secret, req.peer, &open_chain)
            .map_err(|e| match e {
                TargetOpenError::Gone(g) => OpenError::Unknown(g.to_string()),
                TargetOpenError::Busy(m) => OpenError::Busy(m),
                TargetOpenError::Fenced(m) => OpenError::Policy(m),
                TargetOpenError::Failed(m) => OpenError::Failed(m),
            })?;
        if journaled {
            opened.hold.answered_by_journal();
        }
        info.version = opened.version;
        info.cache_limit = Some(opened.limit);
        let mut description = describe(
            target_name(id, Some(opened.attach.clone())),
            Some(vdisk_at(&spec.vdisk, opened.version)),
            format!(
                "a {} cache on server {}, read-write, one writer",
                spec.cache, self.state.name
            ),
        );
        let dev: Arc<dyn BlockDev> = opened.cache.clone();
        let (new_attach, secret) = (opened.new_attach, opened.secret);
        let mut out = self.session(
            req,
            info,
            dev,
            Held {
                _chain: None,
                writer: None,
                target: Some(opened.hold),
            },
            description.to_string(),
        );
        if !new_attach {
            // A connection that proved the attach (its name and secret) joins its cache: the
            // agent that made it may hold several, and a flush on any covers them all, so
            // multi-conn is offered to it (a client without the secret never gets here).
            out.exclusive = false;
        }
        if new_attach && req.purpose == OpenPurpose::Session {
            // The one place the secret leaves the server: to the client that made the attach
            // (after the session's description was logged without it).
            description.set_secret(secret);
            out.description = Some(description.to_string());
        }
        Ok(out)
    }

    /// A failed open while the process has no file descriptor left is the server being
    /// full, whatever the error that surfaced said (some paths carry it only as text).
    fn full_if_out_of_fds(&self, e: OpenError) -> OpenError {
        match e {
            OpenError::Unknown(m) | OpenError::Failed(m) if out_of_fds_now() => OpenError::Full(format!(
                "server {} is out of file descriptors (open failed: {m}): connect to another server, or lower \
                 --max-connections / raise the open-files limit",
                self.state.name
            )),
            other => other,
        }
    }

    /// Wraps an opened device for its connection (registered for a session; bare for INFO).
    fn session(
        &self,
        req: &OpenRequest<'_>,
        info: SessionInfo,
        dev: Arc<dyn BlockDev>,
        held: Held,
        description: String,
    ) -> OpenedExport {
        // A maintenance writer or a server-side target cache: a second connection to this
        // export is refused while this one holds it, so it must not offer multi-conn.
        let exclusive = held.writer.is_some() || held.target.is_some();
        if req.purpose == OpenPurpose::Info {
            // Size and caps only; the chain is released when the server drops the device.
            let device = Arc::new(SessionDev {
                inner: dev,
                held,
                session: None,
                log: self.state.log.clone(),
            });
            return OpenedExport {
                device,
                description: Some(description),
                exclusive,
                close: None,
            };
        }
        log::info!(
            "session: {} from {} opened {description}",
            info.export,
            info.peer
        );
        let probe = held.target.as_ref().map(|t| t.probe.clone());
        let guard = self.state.registry.open_with_cache(info, probe);
        let close = Some(guard.session.close_signal.clone());
        let session = Some(SessionCounting {
            guard,
            totals: self.state.totals.clone(),
        });
        let device = Arc::new(SessionDev {
            inner: dev,
            held,
            session,
            log: self.state.log.clone(),
        });
        OpenedExport {
            device,
            description: Some(description),
            exclusive,
            close,
        }
    }

    /// One line per export for `NBD_OPT_LIST`: every vDisk's production and (when there
    /// is one) maintenance export, with what they resolve to now; only those `client` may
    /// open.
    fn list_exports(&self, client: &Identity) -> Vec<ExportInfo> {
        // A target's record is read once for the whole list.
        let own = match client {
            Identity::Target(id) => self.record_vdisk(id),
            _ => None,
        };
        let may_open = |name: &ExportName| {
            policy::decide(client, name, self.state.anonymous, &|_| own.clone()).is_ok()
        };
        let mut out = self.all_exports();
        out.retain(|e| e.name.parse::<ExportName>().is_ok_and(|n| may_open(&n)));
        out
    }

    fn all_exports(&self) -> Vec<ExportInfo> {
        let now = vdstream_store::Timestamp::now();
        let mut out = Vec::new();
        let Ok(list) = self.store.list() else {
            return out;
        };
        for (name, meta) in list {
            let Ok(meta) = meta else { continue };
            if meta.access == DiskAccess::Private {
                continue;
            }
            if let Ok(layer) = vdstream_store::select(&meta, Selector::Production, now) {
                let access = match layer {
                    Layer::Base => "base",
                    Layer::Version(n) => meta.version(n).map_or("production", |v| v.access.name()),
                };
                let export = vdisk_at(&name, layer_number(layer));
                out.push(ExportInfo {
                    name: export.unpinned().to_string(),
                    description: describe(export, None, access).to_string(),
                });
            }
            for v in meta
                .versions
                .iter()
                .filter(|v| v.access != Access::Maintenance)
            {
                let export = vdisk_at(&name, v.number);
                out.push(ExportInfo {
                    name: export.to_string(),
                    description: describe(export, None, v.access.name()).to_string(),
                });
            }
            if let Some(m) = meta.maintenance() {
                let export = ExportName::Maintenance {
                    vdisk: name.clone(),
                    version: Some(m.number),
                };
                out.push(ExportInfo {
                    name: export.unpinned().to_string(),
                    description: describe(export, None, "maintenance, read-write, one writer")
                        .to_string(),
                });
            }
        }
        out
    }
}

impl Exports for StoreExports {
    fn list(&self) -> Vec<ExportInfo> {
        self.list_exports(&Identity::Local)
    }

    fn list_for(&self, client: &Identity) -> Vec<ExportInfo> {
        self.list_exports(client)
    }

    fn open(&self, name: &str) -> std::result::Result<Arc<dyn BlockDev>, OpenError> {
        self.open_export(&OpenRequest {
            name,
            peer: "local",
            client: &Identity::Local,
            purpose: OpenPurpose::Info,
        })
        .map(|o| o.device)
    }

    fn description(&self, name: &str) -> Option<String> {
        self.open_export(&OpenRequest {
            name,
            peer: "local",
            client: &Identity::Local,
            purpose: OpenPurpose::Info,
        })
        .ok()
        .and_then(|o| o.description)
    }

    fn open_export(&self, req: &OpenRequest<'_>) -> std::result::Result<OpenedExport, OpenError> {
        if self.state.is_draining() {
            return Err(OpenError::Shutdown(format!(
                "server {} is shutting down; connect to another server",
                self.state.name
            )));
        }
        let export = req
            .name
            .parse::<ExportName>()
            .map_err(|e| OpenError::Unknown(e.to_string()))?;
        self.authorize(req, &export)?;
        let opened = match export {
            ExportName::Vdisk { vdisk, selector } => {
                self.open_vdisk(req.name, &vdisk, selector, req)
            }
            ExportName::Maintenance { vdisk, version } => {
                self.open_maintenance(req.name, &vdisk, version, req)
            }
            ExportName::Target {
                id,
                attach,
                secret,
                journaled,
            } => self.open_target(
                vdstream_nbd::shown_export_name(req.name),
                &id,
                attach.as_deref(),
                secret.as_deref(),
                journaled,
                req,
            ),
        };
        opened.map_err(|e| self.full_if_out_of_fds(e))
    }
}

/// What a connection holds besides its device, released in this order when it closes:
/// the chain (and its file locks) before the writer slot, so a writer that connects next
/// finds the file free.
#[derive(Debug)]
struct Held {
    _chain: Option<OpenedLayer>,
    writer: Option<WriterSlot>,
    /// `target/ID` of a server type: the hold on the target's cache (`inner` is the cache).
    target: Option<TargetHold>,
}

#[derive(Debug)]
struct SessionCounting {
    guard: SessionGuard,
    totals: Arc<Counters>,
}

impl SessionCounting {
    fn session(&self) -> &Arc<Session> {
        &self.guard.session
    }

    fn count(
        &self,
        pick: impl Fn(&Counters) -> (&std::sync::atomic::AtomicU64, &std::sync::atomic::AtomicU64),
        bytes: u64,
    ) {
        for c in [&self.guard.session.counters, &*self.totals] {
            let (ops, b) = pick(c);
            Counters::add(ops, 1);
            Counters::add(b, bytes);
        }
    }
}

/// One connection's device: the opened chain (or cache), counted, holding what the
/// session holds. Drop order: `inner`, then `held` (chain, then writer slot), then the
/// registry entry.
#[derive(Debug)]
pub struct SessionDev {
    inner: Arc<dyn BlockDev>,
    held: Held,
    session: Option<SessionCounting>,
    /// I/O errors reach the server log through this (rate-limited).
    log: Arc<vdstream_nbd::lograte::LogLimiter>,
}

impl Drop for SessionDev {
    fn drop(&mut self) {
        if let Some(s) = &self.session {
            let info = &s.session().info;
            let c = s.session().counters.snapshot();
            log::info!(
                "session: {} from {} closed after {:.1}s: guest {} reads ({} bytes), {} writes ({} bytes); store {} reads ({} bytes)",
                info.export,
                info.peer,
                unix_ms().saturating_sub(s.session().connected_unix_ms) as f64 / 1000.0,
                c.guest_read_ops,
                c.guest_read_bytes,
                c.guest_write_ops,
                c.guest_write_bytes,
                c.store_read_ops,
                c.store_read_bytes
            );
        }
        // The writable top must be flushed and closed before the slot frees.
        if self.held.writer.is_some() {
            if let Err(e) = self.inner.flush() {
                log::error!("flushing the maintenance version at disconnect failed: {e}");
            }
        }
    }
}

impl SessionDev {
    /// Runs `f` in the session (store reads charged to it), then charges the cache and logs
    /// a failure.
    fn call<T>(
        &self,
        op: &str,
        offset: u64,
        len: u64,
        f: impl FnOnce() -> DevResult<T>,
    ) -> DevResult<T> {
        let r = match &self.session {
            Some(s) => with_session(s.session().clone(), f),
            None => f(),
        };
        self.charge_cache();
        self.logged(op, offset, len, r)
    }

    /// Logs a failure the client is answered with (`EIO`, `ENOSPC`: the server's trouble,
    /// not the client's mistake), naming the client, the export and the reason.
    fn logged<T>(&self, op: &str, offset: u64, len: u64, r: DevResult<T>) -> DevResult<T> {
        if let (Err(e), Some(s)) = (&r, &self.session) {
            if matches!(
                e.kind,
                vdstream_blockdev::ErrorKind::Io | vdstream_blockdev::ErrorKind::NoSpace
            ) {
                let info = &s.session().info;
                let kind = if e.kind == vdstream_blockdev::ErrorKind::Io {
                    "I/O error"
                } else {
                    "no space"
                };
                self.log.log(
                    log::Level::Warn,
                    module_path!(),
                    kind,
                    format_args!(
                        "{kind}: client {}, export {:?}, {op} of {len} bytes at {offset}: {e}",
                        info.peer, info.export
                    ),
                );
            }
        }
        r
    }

    /// Counts a guest read or write of `len` bytes (and a store write, when writes go there).
    fn count(&self, write: bool, len: u64) {
        let Some(s) = &self.session else { return };
        match write {
            false => s.count(|c| (&c.guest_read_ops, &c.guest_read_bytes), len),
            true => s.count(|c| (&c.guest_write_ops, &c.guest_write_bytes), len),
        }
        if write && self.held.writer.is_some() {
            s.count(|c| (&c.store_write_ops, &c.store_write_bytes), len);
        }
    }

    /// Whether writes must be durable before they are answered (see `TargetHold::write_through`).
    fn write_through(&self) -> bool {
        self.held
            .target
            .as_ref()
            .is_some_and(TargetHold::write_through)
    }

    /// After an operation on a target's server-side cache: what reached its file.
    fn charge_cache(&self) {
        if let (Some(hold), Some(s)) = (&self.held.target, &self.session) {
            hold.charge(s.session(), &s.totals);
        }
    }
}

/// Counts, charges and logs; forces FUA under write-through; everything else, batching
/// included, passes to the device below.
impl vdstream_blockdev::Filter for SessionDev {
    type Inner = dyn BlockDev;

    fn inner(&self) -> &Self::Inner {
        &*self.inner
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> DevResult<()> {
        self.count(false, buf.len() as u64);
        self.call("read", offset, buf.len() as u64, || {
            self.inner().read_at(buf, offset)
        })
    }

    fn read_at_sparse(&self, buf: &mut [u8], offset: u64, holes: &mut Vec<Hole>) -> DevResult<()> {
        self.count(false, buf.len() as u64);
        self.call("read", offset, buf.len() as u64, || {
            self.inner().read_at_sparse(buf, offset, holes)
        })
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> DevResult<()> {
        self.count(true, buf.len() as u64);
        self.call("write", offset, buf.len() as u64, || {
            self.inner()
                .write_at(buf, offset, fua || self.write_through())
        })
    }

    fn flush(&self) -> DevResult<()> {
        self.call("flush", 0, 0, || self.inner().flush())
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> DevResult<()> {
        self.call("trim", offset, len, || {
            self.inner().trim(offset, len, fua || self.write_through())
        })
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> DevResult<()> {
        let flags = ZeroFlags {
            fua: flags.fua || self.write_through(),
            ..flags
        };
        self.call("write-zeroes", offset, len, || {
            self.inner().write_zeroes(offset, len, flags)
        })
    }

    fn block_status(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> DevResult<()> {
        self.logged(
            "block-status",
            offset,
            len,
            self.inner().block_status(offset, len, out),
        )
    }

    fn cache(&self, offset: u64, len: u64) -> DevResult<()> {
        self.logged("cache", offset, len, self.inner().cache(offset, len))
    }

    fn io_batch(&self, ops: &mut [BatchOp<'_>]) {
        let write_through = self.write_through();
        for op in ops.iter_mut() {
            self.count(op.is_write(), op.len() as u64);
            if let BatchIo::Write(_, fua) = &mut op.io {
                *fua |= write_through;
            }
        }
        let _ = self.call("batch", 0, 0, || {
            self.inner().io_batch(ops);
            Ok(())
        });
        for op in ops.iter_mut() {
            let r = std::mem::replace(&mut op.result, Ok(()));
            op.result = self.logged(
                if op.is_write() { "write" } else { "read" },
                op.offset,
                op.len() as u64,
                r,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Registry;
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    use vdstream_blockdev::conformance::{self, model};
    use vdstream_blockdev::MemoryDev;

    /// A memory device whose I/O is "asynchronous underneath": it asks for batches and
    /// counts the ops that reach it in one.
    #[derive(Debug)]
    struct Batching {
        mem: MemoryDev,
        batched: AtomicU64,
    }

    impl vdstream_blockdev::Filter for Batching {
        type Inner = MemoryDev;
        fn inner(&self) -> &MemoryDev {
            &self.mem
        }
        fn io_batch(&self, ops: &mut [BatchOp<'_>]) {
            self.batched.fetch_add(ops.len() as u64, Relaxed);
            for op in ops {
                op.run_alone(&self.mem);
            }
        }
        fn prefers_batches(&self) -> bool {
            true
        }
    }

    /// A registered session's device over `dev`, and the server's totals it counts into.
    fn session_dev(dev: Arc<dyn BlockDev>) -> (SessionDev, Arc<Counters>) {
        let info = SessionInfo {
            export: "vdisk/w".into(),
            kind: ExportKind::Vdisk,
            target: None,
            peer: "unix".into(),
            vdisk: "w".into(),
            version: 1,
            cache_type: None,
            cache_limit: None,
        };
        let totals = Arc::new(Counters::default());
        let session = SessionCounting {
            guard: Registry::new().open(info),
            totals: totals.clone(),
        };
        let held = Held {
            _chain: None,
            writer: None,
            target: None,
        };
        (
            SessionDev {
                inner: dev,
                held,
                session: Some(session),
                log: Default::default(),
            },
            totals,
        )
    }

    #[test]
    fn a_session_device_hands_batches_to_a_device_that_wants_them_and_counts_them() {
        let below = Arc::new(Batching {
            mem: MemoryDev::new(1 << 20),
            batched: AtomicU64::new(0),
        });
        let (dev, totals) = session_dev(below.clone());
        assert!(
            dev.prefers_batches(),
            "the batched engine must see through the session's device"
        );
        let (data, mut back) = (vec![7u8; 8192], vec![0u8; 8192]);
        dev.io_batch(&mut [
            BatchOp::write(&data, 4096, false),
            BatchOp::write(&data, 65536, true),
        ]);
        let mut reads = [BatchOp::read(&mut back, 4096)];
        dev.io_batch(&mut reads);
        assert!(reads[0].result.is_ok());
        assert!(back == data);
        assert_eq!(
            below.batched.load(Relaxed),
            3,
            "every op reached the device below in a batch"
        );
        let c = totals.snapshot();
        assert_eq!(
            (
                c.guest_write_ops,
                c.guest_write_bytes,
                c.guest_read_ops,
                c.guest_read_bytes
            ),
            (2, 16384, 1, 8192)
        );
        assert_eq!(
            dev.session
                .as_ref()
                .unwrap()
                .session()
                .counters
                .snapshot()
                .guest_write_ops,
            2
        );
    }

    #[test]
    fn a_session_device_conforms() {
        let make =
            |size| -> Arc<dyn BlockDev> { Arc::new(session_dev(Arc::new(MemoryDev::new(size))).0) };
        conformance::run_all("SessionDev(MemoryDev)", &make);
        model::model_check(
            "SessionDev(MemoryDev)",
            &make,
            model::ModelConfig {
                cases: 32,
                ..Default::default()
            },
        );
        model::model_check_concurrent(
            "SessionDev(MemoryDev)",
            &make,
            model::ModelConfig {
                cases: 16,
                ..Default::default()
            },
        );
        let batching = |size| -> Arc<dyn BlockDev> {
            Arc::new(
                session_dev(Arc::new(Batching {
                    mem: MemoryDev::new(size),
                    batched: AtomicU64::new(0),
                }))
                .0,
            )
        };
        conformance::run_all("SessionDev(batching)", &batching);
        model::model_check(
            "SessionDev(batching)",
            &batching,
            model::ModelConfig {
                cases: 32,
                ..Default::default()
            },
        );
    }
}
