//! The agent's link to its servers: one live set of NBD connections at a time (one
//! connection, or for a store server's `server`-type attach up to `connections` of them,
//! all to one server), replaced whole when one of them breaks, by the same server or the
//! next one listed.
//!
//! The link is in one [`LinkState`] at a time: `New` (before the first connect), `Up`
//! (requests go straight to its connections, round-robin), `Down` (an outage: the first
//! request in reconnects, the rest wait on `reconnecting`) or `Lost` (for good: every
//! request fails at once). `Up` holds the connection set's generation, the number of
//! connects so far; the journal orders its changes by it.
//!
//! Invariants:
//! - Only one task reconnects at a time (`reconnecting`); a request that saw generation g
//!   fail reconnects only if the link is still `Up` at g, so an outage costs one reconnect,
//!   not one per request in flight.
//! - The [`Identity`] is taken at the first connect and never changes: a server whose
//!   export differs in size, description or writability is not used (the attempt counts
//!   as failed and the next endpoint is tried). The agent never switches version silently.
//! - Attempts start at the endpoint in use, then go round-robin; after a whole round fails
//!   the link sleeps (50 ms doubling to 2 s by default, ±25% jitter). With a [`Reorder`]
//!   (the store server's API), a reconnect first asks it for a new order (least busy,
//!   draining servers last) and goes round that instead.
//! - An endpoint with a `fallback` export is asked for it when its server refuses the
//!   export or serves another version under it; `vdisk/` exports are pinned either way.
//! - With `retry_for`, an outage longer than it makes requests fail with EIO (after one more
//!   round), naming every server and why it failed; without it, requests wait forever.
//! - Each endpoint's failure reason is logged when it changes, not on every attempt.
//! - **A lost attach.** When every endpoint, in one round, refuses the pinned `target/ID@X`
//!   as gone (`NBD_REP_ERR_UNKNOWN` with an [`AttachGone`] message:
//!   the `server` cache died with its server process), the link is lost for good: that
//!   request and every later one fail with EIO at once, whatever `retry_for` says.
//! - **The attach secret.** A store server hands a new attach of a server type a secret, in
//!   the first word of the reply's description (`target/ID@X#SECRET`, read as a typed
//!   `vdstream_contract::ExportDescription`, as are the pins). The link keeps it in
//!   memory only and sends it with every reconnect (`ConnectOptions::secret`); the
//!   [`Identity`] (and so the status, the API report and the log) never holds it.
//! - **Several connections.** A writable link (the `server` types) with an attach secret
//!   opens `connections - 1` more connections to the same server after the first (and
//!   after the journal's replay on it), each naming the pinned attach with its secret, so
//!   they join the one server-side cache (which then offers multi-conn: a flush on any of
//!   them covers what all of them answered). They share one generation: one of them
//!   breaking replaces the whole set, so the journal's rules stay those of one connection.
//!   An extra that cannot be had (a full server, one that offers no multi-conn) is left
//!   out, and the set works with fewer.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backon::BackoffBuilder;

use vdstream_nbd::client::{Client, ClientError, ConnectOptions};

use vdstream_contract::{ExportDescription, ExportName};

use super::journal::Journal;
use crate::endpoint::Endpoint;
use vdstream_blockdev::lock;
use vdstream_contract::refusal::AttachGone;

/// Tunables of the link.
#[derive(Debug, Clone)]
pub struct RemoteOptions {
    /// Requests in flight to the server, at most (the NBD client itself has no cap).
    pub max_requests: usize,
    /// Payload bytes in flight, at most (a larger single request runs alone).
    pub max_bytes: usize,
    /// First sleep after a round of failed attempts; doubles up to `backoff_max`.
    pub backoff_start: Duration,
    pub backoff_max: Duration,
    /// Give up an outage after this long (EIO to the caller). `None`: never, like PVS.
    pub retry_for: Option<Duration>,
    /// Bound on one connect plus handshake.
    pub connect_timeout: Duration,
    /// A request without a reply for this long means the server is hung: the connection
    /// is dropped and the request re-sent elsewhere.
    pub request_timeout: Option<Duration>,
    /// Writes are forwarded (the `server` cache types); otherwise the base is read-only.
    pub writable: bool,
    /// Who reads, for messages (the target id).
    pub target: String,
    /// `server-persistent`: keep answered writes, trims and zeroes until a flush covers
    /// them, at most about this many bytes (a flush is sent past it), and send them again
    /// on every new connection before anything else (see `journal.rs`). `None`: the
    /// server must make each one durable before answering.
    pub journal: Option<u64>,
    /// NBD over TLS to every server (`--tls-certificates DIR`): STARTTLS is required of
    /// each, the agent shows its target certificate. `None`: plaintext.
    pub tls: Option<std::sync::Arc<rustls::ClientConfig>>,
    /// Connections to the server for a writable attach with a secret (the `server` types on
    /// a store server), at most; see the module docs. Read-only links use one.
    pub connections: usize,
    /// Join this attach of a store server (a live migration's `server`-type destination)
    /// instead of making a new one: its first connection already names it with its secret.
    pub join: Option<JoinAttach>,
}

/// An attach of a `server`-type target and its secret, as the store server handed them out.
#[derive(Clone, PartialEq, Eq)]
pub struct JoinAttach {
    /// `target/ID@ATTACH`.
    pub export: String,
    pub secret: String,
}

impl std::fmt::Debug for JoinAttach {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "JoinAttach {{ export: {:?}, secret: (hidden) }}",
            self.export
        )
    }
}

impl Default for RemoteOptions {
    fn default() -> Self {
        RemoteOptions {
            max_requests: 64,
            max_bytes: 64 << 20,
            backoff_start: Duration::from_millis(50),
            backoff_max: Duration::from_secs(2),
            retry_for: None,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Some(Duration::from_secs(30)),
            writable: false,
            target: "target".into(),
            journal: None,
            tls: None,
            connections: 1,
            join: None,
        }
    }
}

/// What the agent first attached to; every later connection must show the same.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub export: String,
    pub size: u64,
    pub description: Option<String>,
}

impl Identity {
    /// The identity a client shows, with the attach secret (if any) taken out of the
    /// description; the secret is returned apart.
    fn of(client: &Client) -> (Identity, Option<String>) {
        let info = client.info();
        let mut secret = None;
        let description = info
            .description
            .as_ref()
            .map(|d| match d.parse::<ExportDescription>() {
                Ok(mut typed) => match typed.take_secret() {
                    Some(s) => {
                        secret = Some(s);
                        typed.to_string()
                    }
                    None => d.clone(),
                },
                Err(_) => d.clone(),
            });
        (
            Identity {
                export: info.export.clone(),
                size: info.size,
                description,
            },
            secret,
        )
    }

    /// Why `now` is not the export first attached to, or `None` if it is.
    /// `read_only`: the target only reads (a device type), so the same vDisk version under
    /// another name (`target/ID@v3` or `vdisk/NAME@3`) is the same bytes.
    fn mismatch(&self, now: &Identity, read_only: bool) -> Option<String> {
        if now.size != self.size {
            return Some(format!(
                "the export is now {} bytes but was {} bytes at attach: it is not the vDisk version this target started with; \
                 refusing it (restart the target to move to another version)",
                now.size, self.size
            ));
        }
        let (Some(was), Some(is)) = (&self.description, &now.description) else {
            return None;
        };
        // A store server's description names the version (or attach) it serves, whatever
        // its access is now (`vdisk/w@3 (test)`); another server's is compared whole.
        let typed = |d: &str| d.parse::<ExportDescription>().ok();
        let (w, i) = (typed(was), typed(is));
        let same = |f: fn(&ExportDescription) -> Option<ExportName>| match (
            w.as_ref().and_then(f),
            i.as_ref().and_then(f),
        ) {
            (Some(a), Some(b)) => a == b,
            _ => false,
        };
        if was == is
            || same(ExportDescription::pin)
            || (read_only && same(ExportDescription::vdisk_version))
        {
            return None;
        }
        Some(format!("the export is now described as {is:?} but was {was:?} at attach: refusing a different vDisk version"))
    }
}

/// Chooses the order of the endpoints for a reconnect (a new placement). Called off the
/// async workers; may block for a bounded time.
pub trait Reorder: Send + Sync + std::fmt::Debug {
    /// After endpoint `failed` of the `known` ones broke: servers learnt since (appended
    /// as `known..`), and the order to try them all in, best first.
    fn reorder(&self, failed: usize, known: usize) -> Placement;
}

/// What a [`Reorder`] answers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement {
    /// Endpoints of servers that were not known before, appended in this order.
    pub added: Vec<Endpoint>,
    /// A permutation of every endpoint (the added ones included), best first.
    pub order: Vec<usize>,
}

/// Why one attempt failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// No connection, or it broke during the handshake.
    Down,
    /// The server refused the export (a definite answer).
    Refused,
    /// The export is not the vDisk version attached to.
    Mismatch,
    /// The server no longer has the attach asked for (see the module docs).
    Gone,
}

/// Counters of the link, read by the status.
#[derive(Debug, Default)]
pub struct LinkCounters {
    pub read_ops: AtomicU64,
    pub read_bytes: AtomicU64,
    pub write_ops: AtomicU64,
    pub write_bytes: AtomicU64,
    pub other_ops: AtomicU64,
    /// Requests re-sent because their connection broke before the reply.
    pub retries: AtomicU64,
    /// Connections made after the first.
    pub reconnects: AtomicU64,
    /// Reconnects that landed on another endpoint than the one that failed.
    pub failovers: AtomicU64,
    /// Requests failed because the outage outlasted `retry_for`.
    pub gave_up: AtomicU64,
}

/// Where the link is (see the module docs). Changed only under `Link::current`'s lock.
#[derive(Debug, Default)]
enum LinkState {
    /// Before the first connect.
    #[default]
    New,
    /// Connected: the live set (one connection or more to one server), which requests take
    /// in turn (`next`); `generation` is the number of connects so far, this one included.
    Up {
        clients: Vec<Arc<Client>>,
        next: usize,
        generation: u64,
    },
    /// No live set since `since` (an outage, or the first connect under way); `reason`:
    /// why the last set ended (none before the first connect).
    Down {
        since: Instant,
        reason: Option<String>,
    },
    /// The attach is lost for good (the module docs): `why`, for every request from now on.
    Lost { why: String },
}

impl LinkState {
    /// Leaves `Up` for `Down` (now), for `reason`; any other state stays.
    fn break_up(&mut self, reason: String) {
        if matches!(self, LinkState::Up { .. }) {
            *self = LinkState::Down {
                since: Instant::now(),
                reason: Some(reason),
            };
        }
    }
}

#[derive(Debug, Default)]
struct Current {
    state: LinkState,
    /// Connects so far (the generation of the next `Up` is one more).
    connects: u64,
    /// The endpoint in use, or last used.
    index: usize,
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct Link {
    /// Every endpoint known, in the order given; servers learnt later are appended.
    endpoints: Mutex<Vec<Endpoint>>,
    pub opts: RemoteOptions,
    current: Mutex<Current>,
    reconnecting: tokio::sync::Mutex<()>,
    identity: Mutex<Option<Identity>>,
    /// From the first connect to a store server: `vdisk/NAME@V` and `target/ID@X`, each
    /// asked instead of any export of its name from then on (reconnects keep the version,
    /// and for `target/ID` the attach).
    pins: Mutex<Vec<ExportName>>,
    last_reason: Mutex<Vec<Option<String>>>,
    reorder: Option<Arc<dyn Reorder>>,
    pub requests: tokio::sync::Semaphore,
    pub bytes: tokio::sync::Semaphore,
    pub counters: LinkCounters,
    /// With `opts.journal`: the answered changes a new connection gets first.
    pub journal: Option<Arc<Journal>>,
    /// The attach secret a store server handed the first connection (memory only).
    secret: Mutex<Option<String>>,
}

/// A connection failure that the link cannot hide.
#[derive(Debug)]
pub(crate) struct GaveUp {
    pub message: String,
}

impl Link {
    pub fn new(endpoints: Vec<Endpoint>, opts: RemoteOptions) -> Link {
        let n = endpoints.len();
        let journal = opts.journal.map(|cap| Arc::new(Journal::new(cap)));
        let (pins, secret) = match &opts.join {
            Some(j) => (
                j.export.parse::<ExportName>().into_iter().collect(),
                Some(j.secret.clone()),
            ),
            None => (Vec::new(), None),
        };
        Link {
            requests: tokio::sync::Semaphore::new(opts.max_requests.max(1)),
            bytes: tokio::sync::Semaphore::new(opts.max_bytes.clamp(1 << 20, u32::MAX as usize)),
            endpoints: Mutex::new(endpoints),
            opts,
            current: Mutex::new(Current::default()),
            reconnecting: tokio::sync::Mutex::new(()),
            identity: Mutex::new(None),
            pins: Mutex::new(pins),
            last_reason: Mutex::new(vec![None; n]),
            reorder: None,
            counters: LinkCounters::default(),
            journal,
            secret: Mutex::new(secret),
        }
    }

    /// The attach this link holds on a store server with its secret (the `server` types),
    /// for a live migration's destination to join.
    pub fn attach(&self) -> Option<JoinAttach> {
        let secret = lock(&self.secret).clone()?;
        let export = lock(&self.pins).iter().find_map(|p| match p {
            ExportName::Target {
                attach: Some(_), ..
            } => {
                let mut p = p.clone();
                if let ExportName::Target {
                    journaled, secret, ..
                } = &mut p
                {
                    *journaled = false;
                    *secret = None;
                }
                Some(p.to_string())
            }
            _ => None,
        })?;
        Some(JoinAttach { export, secret })
    }

    /// Reconnects ask `reorder` for the order of the endpoints.
    pub fn with_reorder(mut self, reorder: Option<Arc<dyn Reorder>>) -> Link {
        self.reorder = reorder;
        self
    }

    /// Endpoint `i` (a copy: the list may grow meanwhile).
    pub fn endpoint(&self, i: usize) -> Endpoint {
        lock(&self.endpoints)[i].clone()
    }

    /// Every endpoint known now.
    pub fn endpoints(&self) -> Vec<Endpoint> {
        lock(&self.endpoints).clone()
    }

    /// The index of the endpoint in use (or last used).
    pub fn index_in_use(&self) -> usize {
        lock(&self.current).index
    }

    /// The identity taken at the first connect.
    pub fn identity(&self) -> Option<Identity> {
        lock(&self.identity).clone()
    }

    /// The endpoint in use (or last used), and whether it is connected now.
    pub fn endpoint_in_use(&self) -> (Endpoint, bool) {
        let cur = lock(&self.current);
        let live = match &cur.state {
            LinkState::Up { clients, .. } => clients.iter().all(|c| c.closed_reason().is_none()),
            _ => false,
        };
        let ep = self.endpoint(cur.index);
        (ep, live)
    }

    /// A live client and its generation. `failed`: the generation whose connection just
    /// broke under the caller (it is replaced unless someone already did).
    pub async fn client(&self, failed: Option<u64>) -> Result<(Arc<Client>, u64), GaveUp> {
        if let Some(c) = self.usable(failed) {
            return Ok(c);
        }
        self.check_lost()?;
        let _one = self.reconnecting.lock().await;
        if let Some(c) = self.usable(failed) {
            return Ok(c);
        }
        self.check_lost()?;
        self.reconnect().await
    }

    /// Why the attach is lost for good, once it is: the server no longer has the target's cache.
    pub fn lost(&self) -> Option<String> {
        match &lock(&self.current).state {
            LinkState::Lost { why } => Some(why.clone()),
            _ => None,
        }
    }

    fn check_lost(&self) -> Result<(), GaveUp> {
        match self.lost() {
            Some(why) => {
                self.counters.gave_up.fetch_add(1, Relaxed);
                Err(GaveUp { message: why })
            }
            None => Ok(()),
        }
    }

    /// Marks generation `g` broken for a reason the client does not see (a server that
    /// answers ESHUTDOWN while it drains).
    pub fn broken(&self, g: u64, reason: String) {
        let mut cur = lock(&self.current);
        if matches!(cur.state, LinkState::Up { generation, .. } if generation == g) {
            cur.state.break_up(reason);
        }
    }

    /// The generation of the live set when one of its connections has closed (the server
    /// ended it, or it broke) and nobody has replaced it yet.
    pub fn closed_generation(&self) -> Option<u64> {
        match &lock(&self.current).state {
            LinkState::Up {
                clients,
                generation,
                ..
            } if clients.iter().any(|c| c.closed_reason().is_some()) => Some(*generation),
            _ => None,
        }
    }

    /// A connection of the live set and its generation, unless the set is gone, one of
    /// its connections closed, or it is generation `failed` (then the link goes `Down`).
    fn usable(&self, failed: Option<u64>) -> Option<(Arc<Client>, u64)> {
        let mut cur = lock(&self.current);
        let LinkState::Up {
            clients,
            next,
            generation,
        } = &mut cur.state
        else {
            return None;
        };
        let reason = match clients.iter().find_map(|c| c.closed_reason()) {
            None if failed != Some(*generation) => {
                let k = *next % clients.len();
                *next = next.wrapping_add(1);
                return Some((clients[k].clone(), *generation));
            }
            None => "a request on it failed".to_string(),
            Some(r) => r,
        };
        cur.state.break_up(reason);
        None
    }

    async fn reconnect(&self) -> Result<(Arc<Client>, u64), GaveUp> {
        let (start, first_index, reason, first_connect) = {
            let mut cur = lock(&self.current);
            let first = cur.connects == 0;
            let (since, reason) = match &cur.state {
                LinkState::Down { since, reason } => (*since, reason.clone()),
                _ => (Instant::now(), None),
            };
            cur.state = LinkState::Down {
                since,
                reason: reason.clone(),
            };
            (since, cur.index, reason, first)
        };
        let known = lock(&self.endpoints).len();
        if !first_connect {
            log::warn!(
                "target {}: lost {} ({}); reconnecting",
                self.opts.target,
                self.endpoint(first_index),
                reason.as_deref().unwrap_or("connection closed")
            );
        }
        let order = match (&self.reorder, first_connect) {
            (Some(r), false) => {
                let r = r.clone();
                let placement = tokio::task::spawn_blocking(move || r.reorder(first_index, known))
                    .await
                    .unwrap_or_default();
                let n = known + placement.added.len();
                let mut sorted = placement.order.clone();
                sorted.sort_unstable();
                if sorted == (0..n).collect::<Vec<_>>() {
                    for ep in placement.added {
                        log::info!(
                            "target {}: a new server of the farm: {ep}",
                            self.opts.target
                        );
                        lock(&self.endpoints).push(ep);
                        lock(&self.last_reason).push(None);
                    }
                    placement.order
                } else {
                    (0..known).map(|k| (first_index + k) % known).collect()
                }
            }
            _ => (0..known).map(|k| (first_index + k) % known).collect(),
        };
        let n = order.len();
        let mut delays = backoff(&self.opts);
        let mut index = order[0];
        let mut attempts = 0usize;
        // At attach, a round where every server refused the export is an answer, not an
        // outage: an unknown vDisk fails the attach at once.
        let mut refused_in_round = 0usize;
        // After attach, a round where every server answered that the attach is gone: lost.
        let mut gone_in_round = 0usize;
        loop {
            let ep = &self.endpoint(index);
            let attempt = match self.attempt(ep).await {
                // A new connection gets the answered, unflushed changes before anyone else.
                Ok(client) if !first_connect => {
                    match &self.journal {
                        Some(j) => {
                            let next = lock(&self.current).connects + 1;
                            match j.replay(&client, next, &self.opts.target).await {
                            Ok(()) => Ok(client),
                            Err(e) => Err((format!("the connection broke while the journal was sent again: {e}"), Failure::Down)),
                        }
                        }
                        None => Ok(client),
                    }
                }
                other => other,
            };
            match attempt {
                Ok(client) => {
                    let client = Arc::new(client);
                    let mut clients = vec![client.clone()];
                    clients.extend(self.extra_connections(ep).await);
                    let mut cur = lock(&self.current);
                    cur.connects += 1;
                    let generation = cur.connects;
                    cur.state = LinkState::Up {
                        clients,
                        next: 0,
                        generation,
                    };
                    cur.index = index;
                    lock(&self.last_reason)[index] = None;
                    if !first_connect {
                        self.counters.reconnects.fetch_add(1, Relaxed);
                        if index != first_index {
                            self.counters.failovers.fetch_add(1, Relaxed);
                        }
                        log::warn!(
                            "target {}: reconnected to {ep}{} after {:.1?}",
                            self.opts.target,
                            if index != first_index {
                                format!(" (failover from {})", self.endpoint(first_index))
                            } else {
                                String::new()
                            },
                            start.elapsed()
                        );
                    }
                    return Ok((client, generation));
                }
                Err((why, failure)) => {
                    refused_in_round +=
                        usize::from(matches!(failure, Failure::Refused | Failure::Gone));
                    gone_in_round += usize::from(failure == Failure::Gone);
                    let mut last = lock(&self.last_reason);
                    if last[index].as_deref() != Some(why.as_str()) {
                        log::warn!("target {}: {ep}: {why}", self.opts.target);
                        last[index] = Some(why);
                    }
                }
            }
            attempts += 1;
            index = order[attempts % n];
            if attempts % n == 0 {
                if first_connect && refused_in_round == n {
                    return Err(GaveUp {
                        message: self.give_up_message(start.elapsed(), true),
                    });
                }
                if !first_connect && gone_in_round == n {
                    let why = format!(
                        "target {}: the server lost this target's cache: {}; every request of the guest now fails with EIO \
                         (the writes it made since it attached are gone with the cache): detach the target and attach it again",
                        self.opts.target,
                        self.give_up_reasons()
                    );
                    log::error!("{why}");
                    self.counters.gave_up.fetch_add(1, Relaxed);
                    lock(&self.current).state = LinkState::Lost { why: why.clone() };
                    return Err(GaveUp { message: why });
                }
                refused_in_round = 0;
                gone_in_round = 0;
                if let Some(limit) = self.opts.retry_for {
                    if start.elapsed() >= limit {
                        self.counters.gave_up.fetch_add(1, Relaxed);
                        return Err(GaveUp {
                            message: self.give_up_message(start.elapsed(), false),
                        });
                    }
                }
                let mut sleep = delays.next().unwrap_or(self.opts.backoff_max);
                if let Some(limit) = self.opts.retry_for {
                    sleep =
                        sleep.min(limit.saturating_sub(start.elapsed()) + Duration::from_millis(1));
                }
                if first_connect {
                    // At attach (at boot), one line a round on the console: what it waits for.
                    let why = lock(&self.last_reason).clone();
                    let what: Vec<String> = self
                        .endpoints()
                        .iter()
                        .zip(why)
                        .map(|(ep, w)| format!("{ep} ({})", w.unwrap_or_default()))
                        .collect();
                    log::warn!(
                        "target {}: waiting for a server: {}; retrying in {:.1} s",
                        self.opts.target,
                        what.join(", "),
                        sleep.as_secs_f64()
                    );
                }
                tokio::time::sleep(sleep).await;
            }
        }
    }

    /// The connections after the first to `ep` (see "Several connections" in the module
    /// docs): none for a read-only link, for a link without an attach secret, or with
    /// `connections` 1.
    /// Opened at once; one that fails or offers no multi-conn is left out (logged once).
    async fn extra_connections(&self, ep: &Endpoint) -> Vec<Arc<Client>> {
        let want = self.opts.connections.saturating_sub(1);
        if want == 0 || !self.opts.writable || lock(&self.secret).is_none() {
            return Vec::new();
        }
        // The endpoint's own export (pinned to the attach, with its secret), never its fallback.
        let tries = (0..want).map(|_| self.attempt_export(ep, &ep.export));
        let mut extras = Vec::with_capacity(want);
        let mut why = None;
        for attempt in futures_util::future::join_all(tries).await {
            match attempt {
                Ok(c) if c.can_multi_conn() => extras.push(Arc::new(c)),
                Ok(_) => {
                    why = Some(format!(
                        "{ep} does not offer multi-conn on {:?}",
                        self.identity().map(|i| i.export).unwrap_or_default()
                    ))
                }
                Err((e, _)) => why = Some(e),
            }
        }
        if let Some(why) = why {
            log::warn!(
                "target {}: carrying on with {} of {} connections to {ep} ({why})",
                self.opts.target,
                extras.len() + 1,
                want + 1
            );
        }
        extras
    }

    /// One connect + handshake + identity check, of the endpoint's export and, if the
    /// server refuses it or serves another version under it, of its fallback. The error
    /// says why, and whether the server refused the export (a definite answer).
    async fn attempt(&self, ep: &Endpoint) -> Result<Client, (String, Failure)> {
        let (why, failure) = match self.attempt_export(ep, &ep.export).await {
            Ok(c) => return Ok(c),
            Err(e) => e,
        };
        match &ep.fallback {
            Some(fallback) if failure != Failure::Down => {
                match self.attempt_export(ep, fallback).await {
                    Ok(c) => {
                        log::info!(
                            "target {}: {ep}: {why}; reading {:?} instead",
                            self.opts.target,
                            c.info().export
                        );
                        Ok(c)
                    }
                    Err((why2, f2)) => {
                        let both = if failure == Failure::Refused && f2 == Failure::Refused {
                            Failure::Refused
                        } else {
                            Failure::Down
                        };
                        Err((format!("{why}; then {fallback:?}: {why2}"), both))
                    }
                }
            }
            _ => Err((
                why,
                if failure == Failure::Mismatch {
                    Failure::Down
                } else {
                    failure
                },
            )),
        }
    }

    async fn attempt_export(
        &self,
        ep: &Endpoint,
        asked: &str,
    ) -> Result<Client, (String, Failure)> {
        // A store server's export: its pin (if any) is asked instead. Another NBD server's
        // export name is asked as it is.
        let (export, secret) = match asked.parse::<ExportName>() {
            Ok(name) => {
                let mut name = lock(&self.pins)
                    .iter()
                    .find(|p| p.unpinned() == name.unpinned())
                    .cloned()
                    .unwrap_or(name);
                let mut secret = None;
                if let ExportName::Target {
                    attach, journaled, ..
                } = &mut name
                {
                    // With a journal, the store server answers without making each write durable first.
                    *journaled = self.journal.is_some();
                    // Only a reconnect of the attach proves itself: the secret goes with the pinned name.
                    if attach.is_some() {
                        secret = lock(&self.secret).clone();
                    }
                }
                (name.to_string(), secret)
            }
            Err(_) => (asked.to_string(), None),
        };
        let opts = ConnectOptions {
            export,
            secret,
            connect_timeout: self.opts.connect_timeout,
            request_timeout: self.opts.request_timeout,
            tls: self.opts.tls.clone(),
            ..ConnectOptions::default()
        };
        let client = Client::connect(ep.address.clone(), opts)
            .await
            .map_err(|e| {
                let failure = match &e {
                    ClientError::Refused { reply, message, .. }
                        if *reply == vdstream_nbd::proto::REP_ERR_UNKNOWN
                            && AttachGone::from_message(message).is_some() =>
                    {
                        Failure::Gone
                    }
                    e if refused_for_good(e) => Failure::Refused,
                    _ => Failure::Down,
                };
                (e.to_string(), failure)
            })?;
        let (now, secret) = Identity::of(&client);
        if self.opts.writable && client.read_only() {
            return Err((
                format!("export {:?} is read-only, but the target's cache type writes through to the server", now.export),
                Failure::Refused,
            ));
        }
        let mut identity = lock(&self.identity);
        match &*identity {
            None => {
                if secret.is_some() {
                    *lock(&self.secret) = secret;
                }
                let described = now
                    .description
                    .as_deref()
                    .and_then(|d| d.parse::<ExportDescription>().ok());
                let asked_name = asked.parse::<ExportName>().ok();
                let mut pins = lock(&self.pins);
                for pin in described
                    .iter()
                    .flat_map(|d| [d.pin(), d.vdisk_version()])
                    .flatten()
                {
                    if !pins.contains(&pin) {
                        if asked_name
                            .as_ref()
                            .is_some_and(|a| a.unpinned() == pin.unpinned() && *a != pin)
                        {
                            log::info!(
                                "target {}: {asked} is {pin}; reconnects ask for {pin}",
                                self.opts.target
                            );
                        }
                        pins.push(pin);
                    }
                }
                *identity = Some(now);
            }
            Some(was) => {
                if let Some(why) = was.mismatch(&now, !self.opts.writable) {
                    return Err((why, Failure::Mismatch));
                }
            }
        }
        Ok(client)
    }

    /// Every endpoint with why it failed last.
    fn give_up_reasons(&self) -> String {
        let last = lock(&self.last_reason);
        let tried: Vec<String> = self
            .endpoints()
            .iter()
            .zip(last.iter())
            .map(|(ep, why)| format!("{ep} ({})", why.as_deref().unwrap_or("connection lost")))
            .collect();
        tried.join("; ")
    }

    fn give_up_message(&self, waited: Duration, refused: bool) -> String {
        if refused {
            return format!(
                "every server refused the export: {}; check the vDisk name in --server",
                self.give_up_reasons()
            );
        }
        format!(
            "no server answered for {:.1?} (--retry-for {:?}): {}; start a server or list another with --server",
            waited,
            self.opts.retry_for.unwrap_or_default(),
            self.give_up_reasons()
        )
    }
}

/// The sleeps after each round of failed attempts: `backoff_start` doubling up to
/// `backoff_max`, each ±25% (so that many agents do not knock at once after a restart).
fn backoff(opts: &RemoteOptions) -> impl Iterator<Item = Duration> {
    let exp = backon::ExponentialBuilder::new()
        .with_min_delay(opts.backoff_start)
        .with_max_delay(opts.backoff_max);
    exp.without_max_times()
        .build()
        .map(|d| d.mul_f64(0.75 + fastrand::f64() / 2.0))
}

/// Whether a failed connect is the server's answer about the export (unknown, refused by
/// policy: the same on the next try) rather than about the server now. A server that is
/// full or shutting down (`NBD_REP_ERR_SHUTDOWN`) has no room now: that is an outage of
/// that server, retried there later and elsewhere meanwhile, never a final answer.
fn refused_for_good(e: &ClientError) -> bool {
    matches!(e, ClientError::Refused { reply, .. } if *reply != vdstream_nbd::proto::REP_ERR_SHUTDOWN)
}

/// True when the error means "this connection is gone, re-send elsewhere".
pub(crate) fn is_retryable(e: &ClientError) -> bool {
    e.is_connection_lost() || e.errno() == Some(vdstream_nbd::proto::ESHUTDOWN)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(description: &str) -> Identity {
        Identity {
            export: "vdisk/w".into(),
            size: 1 << 20,
            description: Some(description.into()),
        }
    }

    #[test]
    fn the_backoff_doubles_from_its_start_to_its_cap_with_a_quarter_of_jitter() {
        let opts = RemoteOptions {
            backoff_start: Duration::from_millis(50),
            backoff_max: Duration::from_secs(2),
            ..Default::default()
        };
        let sleeps: Vec<Duration> = backoff(&opts).take(12).collect();
        for (i, d) in sleeps.iter().enumerate() {
            let nominal = (Duration::from_millis(50) * (1 << i)).min(Duration::from_secs(2));
            assert!(
                *d >= nominal.mul_f64(0.749) && *d <= nominal.mul_f64(1.251),
                "sleep {i}: {d:?} is not {nominal:?} ±25%"
            );
        }
        // Past the cap every nominal sleep is 2 s: the jitter is what tells them apart.
        assert!(
            sleeps[6..].iter().any(|d| *d != Duration::from_secs(2)),
            "not jittered: {sleeps:?}"
        );
    }

    #[test]
    fn a_full_or_draining_server_is_retried_but_an_unknown_export_is_an_answer() {
        let refused = |reply: u32| ClientError::Refused {
            addr: "unix:/s".into(),
            export: "vdisk/d".into(),
            option: "NBD_OPT_GO",
            reply,
            meaning: "x",
            message: "server full: 4 connections (--max-connections 4)".into(),
        };
        assert!(!refused_for_good(&refused(
            vdstream_nbd::proto::REP_ERR_SHUTDOWN
        )));
        assert!(refused_for_good(&refused(
            vdstream_nbd::proto::REP_ERR_UNKNOWN
        )));
        assert!(refused_for_good(&refused(
            vdstream_nbd::proto::REP_ERR_POLICY
        )));
    }

    #[test]
    fn the_same_version_with_another_access_is_the_same_export() {
        assert_eq!(
            id("vdisk/w@3 (test)").mismatch(&id("vdisk/w@3 (production)"), true),
            None
        );
        assert!(id("vdisk/w@3 (production)")
            .mismatch(&id("vdisk/w@4 (production)"), true)
            .is_some());
        assert!(id("raw image a")
            .mismatch(&id("raw image b"), true)
            .is_some());
        assert_eq!(id("raw image a").mismatch(&id("raw image a"), true), None);
        assert!(
            id("vdisk/w (production)")
                .mismatch(&id("vdisk/w (test)"), true)
                .is_some(),
            "an unpinned name pins nothing"
        );
        // A device type may read its version through target/ID or, on an older server, vdisk/.
        let through_target =
            id("target/vm1@v3 vdisk/w@3 (device-disk cache on the target; read-only)");
        assert_eq!(
            through_target.mismatch(&id("vdisk/w@3 (production)"), true),
            None
        );
        assert!(through_target
            .mismatch(&id("vdisk/w@4 (production)"), true)
            .is_some());
        // A server-side cache is its attach: the same version in another attach is not it.
        let attach = id("target/vm1@a1f vdisk/w@3 (a server cache on server s)");
        assert!(attach
            .mismatch(
                &id("target/vm1@b2c vdisk/w@3 (a server cache on server s)"),
                false
            )
            .is_some());
        assert_eq!(
            attach.mismatch(
                &id("target/vm1@a1f vdisk/w@3 (a server cache on server t)"),
                false
            ),
            None
        );
    }
}
