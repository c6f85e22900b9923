//! The agent and the store server's HTTP API: `vdstream target attach ID --server
//! http://HOST:PORT ...`. From the API the agent learns what to attach (the target's
//! record), where (each server's NBD address and load), and it reports its status back.
//!
//! ```text
//!   GET /api/v1/targets/ID   first server that answers ─▶ record ─┐
//!   --vdisk, --cache, --ram, --overflow-max (flags win) ──────────┴▶ [`Plan`]
//!   GET /api/v1/server       every server ─▶ [`ServerDoc`] ─▶ [`placement_order`]
//!        ─▶ one [`Endpoint`] per server: export target/ID (fallback vdisk/NAME[@V])
//!   PUT /api/v1/targets/ID/agent   every status interval, to the server in use ([`ApiLink`])
//! ```
//!
//! Invariants:
//! - Placement and merging are pure functions of what the API answered and the flags
//!   ([`placement_order`], [`plan`]); the tests check them without a server.
//! - A new target goes to the answering, non-draining server with the fewest sessions
//!   (ties: the order listed); the others follow as the failover order; draining servers
//!   come last. A server whose API does not answer at attach is left out (its NBD address
//!   is unknown).
//! - The export is `target/ID` when the record is followed as it is, so the server knows
//!   the target; device types fall back to `vdisk/NAME[@V]` on a server that does not
//!   know `target/ID`. Either way the link pins the version at the first connect
//!   (`remote::link`), so a reconnect never moves a running target to another version.
//! - Reports are best effort: a failed report is logged at debug and never stops the agent,
//!   except a report the API refuses for its credential (401, 403), which means every
//!   later one is refused too: that is logged at WARN once, with what to do, and again only
//!   after a report got through.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use crate::client::{Client, ClientError};
use serde_json::Value;
use url::{Host, Url};
use vdstream_contract::name::parse_ref;
use vdstream_contract::server::{PlacementDoc, ServerDoc};
use vdstream_contract::target::TargetRecord;
use vdstream_contract::{ExportName, Selector};
use vdstream_nbd::client::Address;
use vdstream_wcache::CacheType;

pub use crate::endpoint::is_api_url;
use crate::endpoint::Endpoint;
use crate::status::Status;
use crate::AgentError;

/// How long a placement or report call may take (a report must not pile up behind a
/// dead server; a placement is asked of every server at once).
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// How long an attach waits for the servers' `GET /api/v1/server`.
const ATTACH_WAIT: Duration = Duration::from_secs(5);

/// How long a reconnect waits for them (the guest is waiting too).
const REPLACE_WAIT: Duration = Duration::from_secs(1);

/// A server's NBD address, as seen from an agent that reached its API at `api`: the unix
/// socket when the API is on this machine (loopback) or the server has no TCP listener,
/// else TCP, with an unspecified listen address (`0.0.0.0`, `[::]`) replaced by the API's
/// host, and a loopback one too when the API was reached from elsewhere (the listener is
/// on the API's machine: behind qemu's user-mode network a network-booted target reaches
/// the host's 127.0.0.1 as 10.0.2.2, and the server's own loopback is not the target's).
pub fn nbd_address(doc: &ServerDoc, api: &Url) -> Option<Address> {
    let local = match api.host()? {
        Host::Domain(d) => d == "localhost",
        Host::Ipv4(ip) => ip.is_loopback(),
        Host::Ipv6(ip) => ip.is_loopback(),
    };
    let given = |a: &Option<String>| a.clone().filter(|a| !a.is_empty());
    match (given(&doc.nbd.socket), given(&doc.nbd.listen)) {
        (Some(sock), None) => Some(Address::unix(sock)),
        (Some(sock), Some(_)) if local => Some(Address::unix(sock)),
        (_, Some(listen)) => match listen.parse::<SocketAddr>() {
            Ok(at) if at.ip().is_unspecified() || (at.ip().is_loopback() && !local) => {
                Some(Address::tcp(format!("{}:{}", api.host_str()?, at.port())))
            }
            // A given address or host name: as the server says it, if it has a port.
            _ => Url::parse(&format!("nbd://{listen}"))
                .ok()?
                .port()
                .map(|_| Address::tcp(listen)),
        },
        (None, None) => None,
    }
}

/// Indexes of `docs` in placement order: answering, non-draining servers by fewest
/// sessions (ties keep the listed order), then draining ones (listed order). Servers
/// that did not answer (`None`) are left out.
pub fn placement_order(docs: &[Option<ServerDoc>]) -> Vec<usize> {
    let mut live: Vec<usize> = (0..docs.len())
        .filter(|&i| docs[i].as_ref().is_some_and(|d| !d.draining))
        .collect();
    live.sort_by_key(|&i| docs[i].as_ref().map_or(u64::MAX, |d| d.sessions));
    live.extend((0..docs.len()).filter(|&i| docs[i].as_ref().is_some_and(|d| d.draining)));
    live
}

/// What the command line says, each `None` when not given.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `NAME` or `NAME@V`.
    pub vdisk: Option<String>,
    pub cache: Option<CacheType>,
    pub ram: Option<u64>,
    pub overflow_max: Option<u64>,
}

/// What the agent attaches: the record with the flags laid over it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub vdisk: String,
    /// `None`: production, chosen by the server at the first connect.
    pub version: Option<Selector>,
    pub cache: CacheType,
    pub ram: Option<u64>,
    pub overflow_max: Option<u64>,
    /// The export asked first on every server.
    pub export: String,
    /// Asked when a server does not know `export` (device types reading `target/ID`).
    pub fallback: Option<String>,
    /// Where the settings came from, for the log: `record`, `record and flags`, `flags`.
    pub source: &'static str,
}

fn is_server_type(c: CacheType) -> bool {
    matches!(c, CacheType::Server | CacheType::ServerPersistent)
}

/// `vdisk/NAME` for production, else `vdisk/NAME@V`.
fn vdisk_export(vdisk: &str, version: Option<Selector>) -> String {
    ExportName::Vdisk {
        vdisk: vdisk.to_string(),
        selector: version.unwrap_or(Selector::Production),
    }
    .to_string()
}

/// `target/ID`: the target's vDisk as its record says, through a new attach.
fn target_export(id: &str) -> String {
    ExportName::Target {
        id: id.to_string(),
        attach: None,
        secret: None,
        journaled: false,
    }
    .to_string()
}

/// Lays the flags over the record (`None`: the target has no record on `server`). See
/// docs/AGENT.md, "--server http://".
pub fn plan(
    id: &str,
    server: &str,
    record: Option<&TargetRecord>,
    flags: &Overrides,
) -> Result<Plan, AgentError> {
    // `NAME[@V]`; V is `None` without `@V` (the record's version may then hold).
    let (name, version) = match flags.vdisk.as_deref() {
        Some(v) => match parse_ref(v, Selector::Production) {
            Ok((n, selector)) => (Some(n), v.contains('@').then_some(selector)),
            Err(e) => {
                return Err(AgentError::Api {
                    message: format!(
                        "--vdisk {v:?}: {e}; give NAME or NAME@VERSION, e.g. win11 or win11@3"
                    ),
                })
            }
        },
        None => (None, None),
    };
    if flags.cache == Some(CacheType::Private) {
        return Err(AgentError::Api {
            message: "--cache private: the store server does not serve private vDisks; attach a private vDisk with `vdstream serve-image --vdisk NAME` and an NBD --server URI".into(),
        });
    }
    let Some(rec) = record else {
        let Some(vdisk) = name else {
            return Err(AgentError::NoTargetRecord {
                id: id.to_string(),
                server: server.to_string(),
            });
        };
        let cache = flags.cache.unwrap_or(CacheType::RamOverflow);
        if is_server_type(cache) {
            return Err(AgentError::Api {
                message: format!(
                    "target {id} has no record on {server}, and a {cache} cache lives on the server, which keeps it by the record: \
                     add one with `vdstream target add {id} --vdisk {vdisk} --cache {cache} --server {server}`"
                ),
            });
        }
        let export = vdisk_export(&vdisk, version);
        let version = version.filter(|v| *v != Selector::Production);
        return Ok(Plan {
            vdisk,
            version,
            cache,
            ram: flags.ram,
            overflow_max: flags.overflow_max,
            export,
            fallback: None,
            source: "flags",
        });
    };
    // `--vdisk NAME` with the record's name keeps the record's version; another name
    // without @V means production.
    let (vdisk, version) = match (name, version) {
        (None, _) => (rec.vdisk.clone(), Some(rec.version)),
        (Some(n), None) if n == rec.vdisk => (n, Some(rec.version)),
        (Some(n), v) => (n, v),
    };
    let version = version.filter(|v| *v != Selector::Production);
    let cache = flags.cache.unwrap_or(rec.cache);
    let rec_version = Some(rec.version).filter(|v| *v != Selector::Production);
    let as_recorded = vdisk == rec.vdisk && version == rec_version;
    let source = if *flags == Overrides::default() {
        "record"
    } else {
        "record and flags"
    };
    let common = |export: String, fallback: Option<String>| Plan {
        vdisk: vdisk.clone(),
        version,
        cache,
        ram: flags.ram.or(rec.ram),
        overflow_max: flags.overflow_max.or(rec.overflow_max),
        export,
        fallback,
        source,
    };
    if is_server_type(cache) {
        // The server-side cache follows the record: the flags cannot move it.
        if !as_recorded || cache != rec.cache {
            return Err(AgentError::Api {
                message: format!(
                    "target {id}'s record on {server} says vDisk {}@{} with a {} cache; a {cache} cache lives on the server and follows \
                     the record: change the record (`vdstream target set {id} ... --server {server}`) instead of the flags",
                    rec.vdisk, rec.version, rec.cache
                ),
            });
        }
        return Ok(common(target_export(id), None));
    }
    let vdisk_exp = vdisk_export(&vdisk, version);
    if as_recorded && !is_server_type(rec.cache) {
        Ok(common(target_export(id), Some(vdisk_exp)))
    } else {
        // The flags chose another vDisk, version or side of the cache than the record:
        // target/ID would serve the record's, so read the vDisk directly.
        Ok(common(vdisk_exp, None))
    }
}

/// The result of asking the API: what to attach and where.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub plan: Plan,
    /// In placement order: the first is the least busy server.
    pub endpoints: Vec<Endpoint>,
    pub link: ApiLink,
    /// One line per server for the log: its URL, name, sessions, draining, NBD address.
    pub servers: Vec<String>,
}

/// Asks the servers at `urls` (every `http://HOST:PORT`) what target `id` is and where it
/// goes. See the module docs.
pub fn resolve(id: &str, urls: &[String], flags: &Overrides) -> Result<Resolved, AgentError> {
    resolve_waiting(id, urls, flags, None)
}

/// A client of the store server at `url` for the agent's short calls ([`CALL_TIMEOUT`]).
fn api_client(url: &str) -> Result<Client, AgentError> {
    Client::new(url)
        .map(|c| c.with_timeout(CALL_TIMEOUT))
        .map_err(|e| AgentError::BadEndpoint {
            uri: url.to_string(),
            reason: e.to_string(),
        })
}

/// How [`resolve_waiting`] waits while no store server answers at all (down at boot time).
#[allow(missing_debug_implementations)]
pub struct Waiting<'a> {
    /// Give up after this long (the attach then fails as [`resolve`] does). `None`: never.
    pub retry_for: Option<Duration>,
    /// Told one line per round: what it waits for and when it tries again (the console).
    pub say: &'a dyn Fn(&str),
}

/// First pause between rounds of [`resolve_waiting`], doubling up to [`WAIT_MAX`], ±25%.
const WAIT_START: Duration = Duration::from_secs(1);
const WAIT_MAX: Duration = Duration::from_secs(5);

/// [`resolve`], but while no server gives the target's record (none answers
/// `GET /api/v1/server`, or those that do cannot give the record in time), asks again after
/// a pause (1 s doubling to 5 s, ±25% so that a room of targets booting together does not
/// knock at once), saying each round what it waits for, until one gives it or
/// `wait.retry_for` runs out. A record, or a 404 for it, ends the wait.
pub fn resolve_waiting(
    id: &str,
    urls: &[String],
    flags: &Overrides,
    wait: Option<&Waiting<'_>>,
) -> Result<Resolved, AgentError> {
    let clients = urls
        .iter()
        .map(|u| api_client(u))
        .collect::<Result<Vec<_>, _>>()?;
    let started = std::time::Instant::now();
    let mut pause = WAIT_START;
    let (answers, record) = loop {
        let answers = ask_all(&clients, ATTACH_WAIT);
        // The record, from the first server that answers in the order listed. A server
        // that answered but could not give the record in time (a boot storm on a busy
        // server) is waited for like one that did not answer at all.
        let record = read_record(&clients, &answers, id)?;
        let Some(w) = wait.filter(|_| record.is_none()) else {
            break (answers, record);
        };
        let left = w
            .retry_for
            .map(|limit| limit.saturating_sub(started.elapsed()));
        if left.is_some_and(|l| l.is_zero()) {
            break (answers, record);
        }
        let jittered = pause.mul_f64(0.75 + fastrand::f64() / 2.0);
        let sleep = left.map_or(jittered, |l| jittered.min(l));
        let what: Vec<String> = clients
            .iter()
            .zip(&answers)
            .map(|(c, a)| {
                format!(
                    "{} ({})",
                    c.url(),
                    a.as_ref()
                        .err()
                        .map_or("the target's record did not come", |u| u.brief.as_str())
                )
            })
            .collect();
        (w.say)(&format!(
            "waiting for store server{} {}; retrying in {:.1} s",
            if clients.len() > 1 { "s" } else { "" },
            what.join(", "),
            sleep.as_secs_f64()
        ));
        std::thread::sleep(sleep);
        pause = (pause * 2).min(WAIT_MAX);
    };
    let mut failures = Vec::new();
    let docs: Vec<Option<ServerDoc>> = answers
        .into_iter()
        .zip(&clients)
        .map(|(a, c)| match a {
            Ok(doc) => Some(doc),
            Err(e) => {
                log::warn!("{}: {e}; it is left out of this attach", c.url());
                failures.push(format!("{} ({e})", c.url()));
                None
            }
        })
        .collect();
    let Some((from, record)) = record else {
        let why = if failures.is_empty() {
            "the servers answered, but none gave its record in time (the warnings above say why)"
                .to_string()
        } else {
            failures.join("; ")
        };
        return Err(AgentError::NoServer { message: format!("no store server answered for target {id}: {why}; start one or list another with --server") });
    };
    let plan = plan(id, &from, record.as_ref(), flags)?;
    let mut endpoints = Vec::new();
    let mut apis = Vec::new();
    let mut servers = Vec::new();
    for i in placement_order(&docs) {
        let doc = docs[i].as_ref().expect("placement lists answering servers");
        let url = clients[i].url();
        let Some(address) = Url::parse(url).ok().and_then(|api| nbd_address(doc, &api)) else {
            log::warn!(
                "{url}: server {} serves no NBD (no listen address, no socket); it is left out",
                doc.name
            );
            continue;
        };
        let mut ep = Endpoint::at(address, &plan.export);
        ep.fallback = plan.fallback.clone();
        servers.push(format!(
            "{url} ({}: {} sessions{}, NBD {})",
            doc.name,
            doc.sessions,
            if doc.draining { ", draining" } else { "" },
            ep.uri
        ));
        endpoints.push(ep);
        apis.push(clients[i].clone());
    }
    if endpoints.is_empty() {
        return Err(AgentError::NoServer {
            message: format!(
                "no store server can take target {id}: {}",
                if failures.is_empty() {
                    "none serves NBD".to_string()
                } else {
                    failures.join("; ")
                }
            ),
        });
    }
    let link = ApiLink::new(id, apis, clients.clone(), &plan);
    Ok(Resolved {
        plan,
        endpoints,
        link,
        servers,
    })
}

/// What `GET /boot/admit/ID` answers (the boot service's pacing, `--max-booting`).
#[derive(Debug, serde::Deserialize)]
struct BootPlace {
    admitted: bool,
    #[serde(default)]
    booting: u64,
    #[serde(default)]
    max_booting: u64,
    #[serde(default)]
    ahead: u64,
    #[serde(default)]
    retry_after_secs: u64,
}

/// What one server said to a machine asking for a boot place.
enum PlaceAnswer {
    /// Admitted, or no pacing there (no boot service: 404).
    Admitted,
    Wait(BootPlace),
    Unanswered(String),
}

fn ask_place(c: &Client, id: &str) -> PlaceAnswer {
    let r = match c.relay("GET", &format!("/boot/admit/{id}"), &[], Vec::new()) {
        Ok(r) => r,
        Err(e) => return PlaceAnswer::Unanswered(e.to_string()),
    };
    match (r.status, serde_json::from_slice::<BootPlace>(&r.body)) {
        (200, _) | (404, _) => PlaceAnswer::Admitted,
        (503, Ok(p)) if !p.admitted => PlaceAnswer::Wait(p),
        (status, _) => PlaceAnswer::Unanswered(format!(
            "GET /boot/admit/{id} answered {status}: {}",
            String::from_utf8_lossy(&r.body[..r.body.len().min(200)]).trim()
        )),
    }
}

/// The most a booting machine waits between two asks for a boot place, whatever a server
/// says.
const PLACE_WAIT_MAX: Duration = Duration::from_secs(30);

impl Resolved {
    /// `target attach --booting`: a place in a server's boot window (`--max-booting`)
    /// before attaching. The servers are asked in placement order; the first that admits
    /// the machine goes first in the placement (its window is there). While every one says
    /// to wait, the agent waits what the soonest asked (±20%, so that machines told
    /// together do not come back together), saying so on the console each round, until
    /// one admits it or `wait.retry_for` runs out. A server without a boot service (404)
    /// paces nothing and admits; while none answers, it asks again after about a second.
    pub fn wait_for_boot_place(&mut self, wait: &Waiting<'_>) -> Result<(), AgentError> {
        let started = std::time::Instant::now();
        let id = self.link.target.clone();
        loop {
            let mut soonest: Option<BootPlace> = None;
            let mut unanswered = Vec::new();
            for i in 0..self.link.len() {
                let Some(api) = self.link.api(i) else {
                    continue;
                };
                match ask_place(&api, &id) {
                    PlaceAnswer::Admitted => {
                        if i > 0 {
                            self.endpoints.swap(0, i);
                            vdstream_blockdev::lock(&self.link.apis).swap(0, i);
                            self.servers.swap(0, i);
                        }
                        return Ok(());
                    }
                    PlaceAnswer::Wait(p) => {
                        if soonest
                            .as_ref()
                            .is_none_or(|s| p.retry_after_secs < s.retry_after_secs)
                        {
                            soonest = Some(p);
                        }
                    }
                    PlaceAnswer::Unanswered(why) => {
                        unanswered.push(format!("{} ({why})", api.url()));
                    }
                }
            }
            // A server that did not answer (busy in a storm, or down) may have a place
            // all the same: ask again soon rather than boot past its pacing.
            let retry = soonest.as_ref().map_or(1, |p| p.retry_after_secs.max(1));
            let pause = Duration::from_secs(retry)
                .min(PLACE_WAIT_MAX)
                .mul_f64(0.8 + fastrand::f64() * 0.4);
            let said = match &soonest {
                Some(p) => format!(
                    "waiting: {} booting (at most {} at once), {} waiting ahead",
                    p.booting, p.max_booting, p.ahead
                ),
                None => format!("waiting for a boot place: {}", unanswered.join("; ")),
            };
            let left = wait.retry_for.map(|l| l.saturating_sub(started.elapsed()));
            if left.is_some_and(|l| l < pause) {
                return Err(AgentError::NoServer {
                    message: format!(
                        "no server gave target {id} a boot place within {:.0} s (the last round: {said}); \
                         raise --retry-for, or the servers' --max-booting",
                        started.elapsed().as_secs_f64()
                    ),
                });
            }
            (wait.say)(&format!(
                "{said}; asking again in {:.1} s",
                pause.as_secs_f64()
            ));
            std::thread::sleep(pause);
        }
    }
}

/// `vdstream target booted ID`: the machine's root is mounted; every server at `urls`
/// closes its boot window, if it holds one. How many did; an error when none answered.
pub fn boot_done(id: &str, urls: &[String]) -> Result<usize, AgentError> {
    // A server busy with a storm may not answer within a call's timeout: ask the ones
    // that did not answer again, a few rounds a second apart, before giving up.
    let mut pending: Vec<&String> = urls.iter().collect();
    let mut closed = 0;
    let mut answered = 0;
    let mut failures = Vec::new();
    for round in 0..BOOTED_ROUNDS {
        if round > 0 {
            std::thread::sleep(Duration::from_secs(1));
        }
        let (c, a, unanswered, f) = boot_done_round(id, &pending)?;
        closed += c;
        answered += a;
        failures = f;
        pending = unanswered;
        if pending.is_empty() {
            break;
        }
    }
    if answered == 0 {
        return Err(AgentError::NoServer {
            message: format!(
                "no server took target {id}'s end of boot: {}",
                failures.join("; ")
            ),
        });
    }
    Ok(closed)
}

/// Rounds of [`boot_done`] at most.
const BOOTED_ROUNDS: usize = 5;

/// One round of [`boot_done`] over `urls`: windows closed, servers that answered, those
/// that did not, and why.
#[allow(clippy::type_complexity)]
fn boot_done_round<'a>(
    id: &str,
    urls: &[&'a String],
) -> Result<(usize, usize, Vec<&'a String>, Vec<String>), AgentError> {
    let mut closed = 0;
    let mut answered = 0;
    let mut unanswered = Vec::new();
    let mut failures = Vec::new();
    for &u in urls {
        let c = api_client(u)?;
        match c.relay("GET", &format!("/boot/booted/{id}"), &[], Vec::new()) {
            Ok(r) if r.status == 200 => {
                answered += 1;
                let v: Value = serde_json::from_slice(&r.body).unwrap_or_default();
                if v["closed"].as_bool() == Some(true) {
                    closed += 1;
                }
            }
            Ok(r) if r.status == 404 => answered += 1,
            Ok(r) => {
                unanswered.push(u);
                failures.push(format!("{u}: status {}", r.status));
            }
            Err(e) => {
                unanswered.push(u);
                failures.push(format!("{u}: {e}"));
            }
        }
    }
    Ok((closed, answered, unanswered, failures))
}

/// Target `id`'s record from the first of `clients` that answered `GET /api/v1/server` and
/// can give it: `Some((url, None))` when that server has no such record (404), `None` when
/// no server could give an answer.
fn read_record(
    clients: &[Client],
    answers: &[Result<ServerDoc, Unanswered>],
    id: &str,
) -> Result<Option<(String, Option<TargetRecord>)>, AgentError> {
    let path = format!("/api/v1/targets/{id}");
    for (c, _) in clients.iter().zip(answers).filter(|(_, a)| a.is_ok()) {
        match c.get(&path) {
            Ok(v) => {
                let r = serde_json::from_value::<TargetRecord>(v).map_err(|e| AgentError::Api {
                    message: format!("{}{path}: the target record is not usable: {e}", c.url()),
                })?;
                return Ok(Some((c.url().to_string(), Some(r))));
            }
            Err(ClientError::Api { status: 404, .. }) => {
                return Ok(Some((c.url().to_string(), None)))
            }
            Err(e) => log::warn!("{}: cannot read target {id}'s record: {e}", c.url()),
        }
    }
    Ok(None)
}

/// `GET /api/v1/server` of every client at once; a server that has not answered within
/// `within` counts as not answering (its call finishes in the background, bounded by the
/// client's own timeouts), so a host that swallows packets cannot stall a reconnect.
fn ask_all(clients: &[Client], within: Duration) -> Vec<Result<ServerDoc, Unanswered>> {
    let (tx, rx) = std::sync::mpsc::channel();
    for (i, c) in clients.iter().enumerate() {
        let (c, sender) = (c.clone(), tx.clone());
        let spawned = std::thread::Builder::new()
            .name("vdstream-api".into())
            .spawn(move || {
                let doc = c
                    .get("/api/v1/server")
                    .map_err(|e| Unanswered::from_client(&e))
                    .and_then(|v| {
                        serde_json::from_value::<ServerDoc>(v)
                            .map_err(|e| Unanswered::new(format!("its /api/v1/server answer: {e}")))
                    });
                let _ = sender.send((i, doc));
            });
        if let Err(e) = spawned {
            let _ = tx.send((
                i,
                Err(Unanswered::new(format!("cannot start the query: {e}"))),
            ));
        }
    }
    drop(tx);
    let mut out: Vec<Result<ServerDoc, Unanswered>> = clients
        .iter()
        .map(|_| {
            Err(Unanswered {
                message: format!("no answer within {within:?}"),
                brief: "no answer".into(),
            })
        })
        .collect();
    let deadline = std::time::Instant::now() + within;
    for _ in 0..clients.len() {
        match rx.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now())) {
            Ok((i, doc)) => out[i] = doc,
            Err(_) => break,
        }
    }
    out
}

/// Why a server did not answer `GET /api/v1/server`: the whole message, and a few words
/// for the console's waiting line ("connection refused").
#[derive(Debug)]
struct Unanswered {
    message: String,
    brief: String,
}

impl Unanswered {
    fn new(message: String) -> Unanswered {
        Unanswered {
            brief: message.clone(),
            message,
        }
    }

    fn from_client(e: &ClientError) -> Unanswered {
        let brief = match e {
            ClientError::Connect { err, .. } | ClientError::Io { err, .. } => match err.kind() {
                std::io::ErrorKind::ConnectionRefused => "connection refused".to_string(),
                std::io::ErrorKind::TimedOut => "timed out".to_string(),
                _ => err.to_string(),
            },
            other => other.to_string(),
        };
        Unanswered {
            message: e.to_string(),
            brief,
        }
    }
}

impl std::fmt::Display for Unanswered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// The agent's side of the API once attached: one client per endpoint (same order), for
/// reports and for re-placement after a failover; and every server listed, so that one
/// that did not answer at attach (not started yet, or down) joins the endpoints once it
/// answers a re-placement.
#[derive(Debug, Clone)]
pub struct ApiLink {
    target: String,
    /// One per endpoint, in the endpoints' order (grows with them).
    apis: Arc<std::sync::Mutex<Vec<Client>>>,
    /// Every server listed (`--server`), answering or not.
    listed: Vec<Client>,
    /// The export (and fallback) a server learnt later is asked for.
    export: String,
    fallback: Option<String>,
    reporting: Arc<AtomicBool>,
    /// A refused report was logged at WARN and none got through since.
    refused_told: Arc<AtomicBool>,
}

impl ApiLink {
    /// `apis`: one client per endpoint; `listed`: every server given; `plan`: what a server
    /// learnt later is asked for.
    pub fn new(target: &str, apis: Vec<Client>, listed: Vec<Client>, plan: &Plan) -> ApiLink {
        ApiLink {
            target: target.to_string(),
            apis: Arc::new(std::sync::Mutex::new(apis)),
            listed,
            export: plan.export.clone(),
            fallback: plan.fallback.clone(),
            reporting: Arc::new(AtomicBool::new(false)),
            refused_told: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The client of endpoint `index`.
    fn api(&self, index: usize) -> Option<Client> {
        vdstream_blockdev::lock(&self.apis).get(index).cloned()
    }

    /// How many endpoints have a client.
    fn len(&self) -> usize {
        vdstream_blockdev::lock(&self.apis).len()
    }

    /// The API URL of endpoint `index`.
    pub fn url(&self, index: usize) -> Option<String> {
        self.api(index).map(|c| c.url().to_string())
    }

    /// Sends `status` to the API of endpoint `index` in the background, unless the last
    /// report is still under way (a slow server never piles reports up).
    pub fn report(&self, index: usize, status: &Status) {
        let Some(client) = self.api(index) else {
            return;
        };
        if self.reporting.swap(true, Relaxed) {
            log::debug!(
                "target {}: the last report to {} is still under way; skipping one",
                self.target,
                client.url()
            );
            return;
        }
        let doc = serde_json::to_value(status).expect("a status always serializes");
        let (flag, told, target) = (
            self.reporting.clone(),
            self.refused_told.clone(),
            self.target.clone(),
        );
        let spawned = std::thread::Builder::new()
            .name("vdstream-report".into())
            .spawn(move || {
                report_now(&client, &target, &doc, &told);
                flag.store(false, Relaxed);
            });
        if let Err(e) = spawned {
            self.reporting.store(false, Relaxed);
            log::debug!("target {}: cannot start a report: {e}", self.target);
        }
    }

    /// Sends `status` now and waits (the last report, at exit).
    pub fn report_blocking(&self, index: usize, status: &Status) {
        if let Some(client) = self.api(index) {
            report_now(
                &client,
                &self.target,
                &serde_json::to_value(status).expect("a status always serializes"),
                &self.refused_told,
            );
        }
    }

    /// After endpoint `failed` (of `known`) broke: a new placement over what the servers
    /// answer now. The server the failed one moved this target to (rebalancing, a drain:
    /// `GET /api/v1/targets/ID/placement`) first, if it answers and does not drain; then
    /// fewest sessions first, draining last; those that do not answer after, `failed`
    /// last among them. A listed server that was no endpoint yet and answers now becomes
    /// one (appended).
    pub fn reorder(&self, failed: usize, known: usize) -> crate::remote::Placement {
        let apis: Vec<Client> = vdstream_blockdev::lock(&self.apis)
            .iter()
            .take(known)
            .cloned()
            .collect();
        let known = apis.len();
        let unknown: Vec<Client> = self
            .listed
            .iter()
            .filter(|c| !apis.iter().any(|a| a.url() == c.url()))
            .cloned()
            .collect();
        let hint = apis.get(failed).cloned().map(|c| {
            let (tx, rx) = std::sync::mpsc::channel();
            let path = format!("/api/v1/targets/{}/placement", self.target);
            let _ = std::thread::Builder::new()
                .name("vdstream-api".into())
                .spawn(move || {
                    let doc = c
                        .get(&path)
                        .ok()
                        .and_then(|v| serde_json::from_value::<PlacementDoc>(v).ok());
                    let _ = tx.send(doc);
                });
            rx
        });
        let asked: Vec<Client> = apis.iter().chain(&unknown).cloned().collect();
        let started = std::time::Instant::now();
        let answers = ask_all(&asked, REPLACE_WAIT);
        let hint = hint
            .and_then(|rx| {
                rx.recv_timeout(REPLACE_WAIT.saturating_sub(started.elapsed()))
                    .ok()
            })
            .flatten();
        let mut docs: Vec<Option<ServerDoc>> = answers
            .iter()
            .take(known)
            .map(|a| a.as_ref().ok().cloned())
            .collect();
        let mut added = Vec::new();
        for (c, answer) in unknown.iter().zip(&answers[known..]) {
            let Ok(doc) = answer else { continue };
            let Some(address) = Url::parse(c.url())
                .ok()
                .and_then(|api| nbd_address(doc, &api))
            else {
                continue;
            };
            let mut ep = Endpoint::at(address, &self.export);
            ep.fallback = self.fallback.clone();
            added.push(ep);
            docs.push(Some(doc.clone()));
            vdstream_blockdev::lock(&self.apis).push(c.clone());
        }
        let mut order = placement_order(&docs);
        if let Some(to) = hint.and_then(|h| h.server) {
            let at = order.iter().position(|&i| {
                docs[i]
                    .as_ref()
                    .is_some_and(|d| d.name == to && !d.draining)
            });
            if let Some(at) = at {
                let i = order.remove(at);
                order.insert(0, i);
                log::info!(
                    "target {}: moved by its server to {to}: reconnecting there",
                    self.target
                );
            }
        }
        let n = docs.len();
        order.extend(
            (1..=n)
                .map(|k| (failed + k) % n)
                .filter(|i| docs[*i].is_none()),
        );
        crate::remote::Placement { added, order }
    }
}

impl crate::remote::Reorder for ApiLink {
    fn reorder(&self, failed: usize, known: usize) -> crate::remote::Placement {
        ApiLink::reorder(self, failed, known)
    }
}

/// Sends one report. A refusal for the credential is told at WARN once (`told`), until a
/// report gets through again; other failures at debug (the next report retries).
fn report_now(client: &Client, target: &str, doc: &Value, told: &AtomicBool) {
    match client.put(&format!("/api/v1/targets/{target}/agent"), doc) {
        Ok(_) => told.store(false, Relaxed),
        Err(
            e @ ClientError::Api {
                status: 401 | 403, ..
            },
        ) if !told.swap(true, Relaxed) => {
            log::warn!("target {target}: {}", refused_report(client.url(), &e));
        }
        Err(e) => log::debug!("target {target}: report to {} failed: {e}", client.url()),
    }
}

/// What a report refused for its credential means, and what to do (logged once).
fn refused_report(url: &str, e: &ClientError) -> String {
    let status = match e {
        ClientError::Api { status, .. } => *status,
        _ => 0,
    };
    format!(
        "the API at {url} refused its status report ({status}: {e}); the console shows the target offline until reports get through. \
         The API needs a credential once a token was made in the store: give this agent a token of role operator in a file \
         (`vdstream token add NAME --role operator > FILE`, then VDSTREAM_TOKEN_FILE=FILE in the agent's environment) or, \
         with https, its target certificate (VDSTREAM_TLS_CERTIFICATES=DIR). The agent keeps running and reporting; \
         this is logged once"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use vdstream_contract::server::NbdAddresses;

    fn doc(sessions: u64, draining: bool) -> Option<ServerDoc> {
        Some(ServerDoc {
            nbd: NbdAddresses {
                listen: None,
                socket: Some("/s".into()),
            },
            sessions,
            draining,
            ..ServerDoc::default()
        })
    }

    #[test]
    fn placement_prefers_the_least_busy_and_puts_draining_last() {
        assert_eq!(
            placement_order(&[doc(3, false), doc(1, false), doc(2, false)]),
            vec![1, 2, 0]
        );
        // Ties keep the order listed.
        assert_eq!(placement_order(&[doc(1, false), doc(1, false)]), vec![0, 1]);
        // A draining server is never first, however idle; one that did not answer is left out.
        assert_eq!(
            placement_order(&[doc(0, true), None, doc(5, false)]),
            vec![2, 0]
        );
        assert_eq!(placement_order(&[None, None]), Vec::<usize>::new());
    }

    #[test]
    fn server_documents_give_nbd_addresses() {
        let v = json!({"name": "pvs1", "nbd": {"listen": "0.0.0.0:10809", "socket": "/run/s.sock"}, "sessions": 4, "draining": false});
        let mut d: ServerDoc = serde_json::from_value(v).unwrap();
        assert_eq!((d.sessions, d.draining), (4, false));
        let at = |api: &str, d: &ServerDoc| nbd_address(d, &Url::parse(api).unwrap());
        // On this machine: the socket; from elsewhere: TCP, at the host the API answered on.
        for local in [
            "http://127.0.0.1:8480/",
            "http://localhost:8480",
            "http://[::1]:8480",
        ] {
            assert_eq!(at(local, &d), Some(Address::unix("/run/s.sock")), "{local}");
        }
        assert_eq!(
            at("http://10.0.0.2:8480", &d),
            Some(Address::tcp("10.0.0.2:10809"))
        );
        assert_eq!(
            at("http://pvs1.example:8480", &d),
            Some(Address::tcp("pvs1.example:10809"))
        );
        d.nbd = NbdAddresses {
            listen: Some("10.0.0.9:10900".into()),
            socket: Some(String::new()),
        };
        assert_eq!(
            at("http://127.0.0.1:8480", &d),
            Some(Address::tcp("10.0.0.9:10900"))
        );
        d.nbd.listen = Some("[::]:10809".into());
        assert_eq!(
            at("http://[::1]:8480", &d),
            Some(Address::tcp("[::1]:10809"))
        );
        assert_eq!(
            at("http://[fd00::2]:8480", &d),
            Some(Address::tcp("[fd00::2]:10809"))
        );
        d.nbd.listen = Some("[fd00::9]:10900".into());
        assert_eq!(
            at("http://[fd00::2]:8480", &d),
            Some(Address::tcp("[fd00::9]:10900"))
        );
        // A loopback listener seen through a non-loopback API address: the API's host (the
        // guest of qemu's user-mode network reaches the host's 127.0.0.1 as 10.0.2.2).
        d.nbd = NbdAddresses {
            listen: Some("127.0.0.1:10900".into()),
            socket: None,
        };
        assert_eq!(
            at("http://10.0.2.2:8480", &d),
            Some(Address::tcp("10.0.2.2:10900"))
        );
        assert_eq!(
            at("http://127.0.0.1:8480", &d),
            Some(Address::tcp("127.0.0.1:10900"))
        );
        d.nbd.listen = Some("pvs1:10900".into());
        assert_eq!(
            at("http://10.0.0.2:8480", &d),
            Some(Address::tcp("pvs1:10900"))
        );
        // No port, or nothing at all: no NBD address.
        d.nbd.listen = Some("pvs1".into());
        assert_eq!(at("http://10.0.0.2:8480", &d), None);
        d.nbd.listen = None;
        assert_eq!(at("http://127.0.0.1:8480", &d), None);
    }

    #[test]
    fn servers_are_asked_at_once_and_a_silent_one_does_not_stall() {
        use std::io::{Read, Write};
        let answering = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = |l: &std::net::TcpListener| format!("http://{}", l.local_addr().unwrap());
        let clients = vec![
            Client::new(&url(&silent)).unwrap(),
            Client::new(&url(&answering)).unwrap(),
        ];
        let server = std::thread::spawn(move || {
            let (mut s, _) = answering.accept().unwrap();
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let body = r#"{"name": "b", "nbd": {"listen": null, "socket": "/b.sock"}, "sessions": 2, "draining": true}"#;
            write!(s, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
        });
        let t = std::time::Instant::now();
        let answers = ask_all(&clients, Duration::from_millis(500));
        assert!(
            t.elapsed() < Duration::from_millis(1500),
            "took {:?}",
            t.elapsed()
        );
        assert!(
            answers[0]
                .as_ref()
                .unwrap_err()
                .message
                .contains("no answer"),
            "{:?}",
            answers[0]
        );
        let b = answers[1].as_ref().unwrap();
        assert_eq!(
            (b.sessions, b.draining, b.nbd.socket.as_deref()),
            (2, true, Some("/b.sock"))
        );
        server.join().unwrap();
        drop(silent);
    }

    /// A store server's API on loopback for `within`: `GET /api/v1/server` answers a
    /// document named `name` with `sessions` and NBD socket `/NAME.sock`; the placement of
    /// target `t` names `hint`.
    fn fake_api(
        name: &'static str,
        sessions: u64,
        hint: Option<&'static str>,
    ) -> (String, std::thread::JoinHandle<()>) {
        use std::io::{Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        l.set_nonblocking(true).unwrap();
        let t = std::thread::spawn(move || {
            let until = std::time::Instant::now() + Duration::from_secs(3);
            while std::time::Instant::now() < until {
                let Ok((mut s, _)) = l.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                s.set_nonblocking(false).unwrap();
                let mut buf = [0u8; 4096];
                let n = s.read(&mut buf).unwrap_or(0);
                let req = String::from_utf8_lossy(&buf[..n]).to_string();
                let body = if req.starts_with("GET /api/v1/targets/t/placement") {
                    json!({"target": "t", "server": hint, "reason": hint.map(|_| "rebalance")})
                        .to_string()
                } else {
                    json!({"name": name, "nbd": {"listen": null, "socket": format!("/{name}.sock")}, "sessions": sessions, "draining": false}).to_string()
                };
                let _ = write!(s, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}", body.len());
            }
        });
        (url, t)
    }

    #[test]
    fn a_moved_target_goes_where_its_server_said_and_servers_that_start_later_join() {
        // a (in use, 9 sessions) moved t to c; b (1 session) was an endpoint at attach;
        // c (5 sessions) did not answer then, and answers now.
        let (a, ta) = fake_api("a", 9, Some("c"));
        let (b, tb) = fake_api("b", 1, None);
        let (c, tc) = fake_api("c", 5, None);
        let client = |u: &str| Client::new(u).unwrap();
        let plan = Plan {
            vdisk: "w".into(),
            version: None,
            cache: CacheType::RamOverflow,
            ram: None,
            overflow_max: None,
            export: "target/t".into(),
            fallback: Some("vdisk/w".into()),
            source: "record",
        };
        let link = ApiLink::new(
            "t",
            vec![client(&a), client(&b)],
            vec![client(&a), client(&b), client(&c)],
            &plan,
        );
        let p = link.reorder(0, 2);
        assert_eq!(p.added.len(), 1, "c joins: {p:?}");
        assert_eq!(p.added[0].address, Address::unix("/c.sock"));
        assert_eq!(
            (p.added[0].export.as_str(), p.added[0].fallback.as_deref()),
            ("target/t", Some("vdisk/w"))
        );
        assert_eq!(
            p.order,
            vec![2, 1, 0],
            "the hinted server first, then the least busy"
        );
        assert_eq!(
            link.url(2).as_deref(),
            Some(c.as_str()),
            "its API reports go to c once in use"
        );
        // Without a hint: fewest sessions first.
        let link = ApiLink::new(
            "t",
            vec![client(&b), client(&c)],
            vec![client(&b), client(&c)],
            &plan,
        );
        assert_eq!(link.reorder(0, 2).order, vec![0, 1]);
        for t in [ta, tb, tc] {
            t.join().unwrap();
        }
    }

    fn rec(cache: CacheType) -> TargetRecord {
        record(
            json!({"vdisk": "win11", "version": "production", "cache": cache, "ram": 1u64 << 30, "overflow_max": 8u64 << 30}),
        )
    }

    /// A record as the server sends it, with `fields` laid over the ones every record has.
    fn record(fields: Value) -> TargetRecord {
        let mut doc = json!({"format": "vdstream-target", "format_version": 1, "id": "vm1", "created": "2025-03-01T22:00:00Z",
            "created_by": "t", "updated": "2025-03-01T22:00:00Z", "updated_by": "t", "generation": 1});
        doc.as_object_mut()
            .unwrap()
            .extend(fields.as_object().unwrap().clone());
        serde_json::from_value(doc).unwrap()
    }

    #[test]
    fn records_read_with_string_or_number_versions_and_known_caches_only() {
        let r = record(json!({"vdisk": "w", "version": 3, "cache": "device-disk", "ram": 5}));
        assert_eq!(
            (r.version, r.cache, r.ram, r.overflow_max),
            (Selector::Number(3), CacheType::DeviceDisk, Some(5), None)
        );
        assert_eq!(
            record(json!({"vdisk": "w", "version": "test", "cache": "server"})).version,
            Selector::Test
        );
        let mut bad = serde_json::to_value(rec(CacheType::Server)).unwrap();
        bad["cache"] = json!("floppy");
        assert!(serde_json::from_value::<TargetRecord>(bad)
            .unwrap_err()
            .to_string()
            .contains("floppy"));
    }

    #[test]
    fn the_record_alone_reads_target_id_with_a_vdisk_fallback() {
        let p = plan(
            "vm1",
            "http://a:1",
            Some(&rec(CacheType::DeviceDisk)),
            &Overrides::default(),
        )
        .unwrap();
        assert_eq!(
            (p.export.as_str(), p.fallback.as_deref(), p.source),
            ("target/vm1", Some("vdisk/win11"), "record")
        );
        assert_eq!(
            (p.cache, p.ram, p.overflow_max, p.version),
            (CacheType::DeviceDisk, Some(1 << 30), Some(8 << 30), None)
        );
        let r = TargetRecord {
            version: Selector::Number(3),
            ..rec(CacheType::RamOverflow)
        };
        let p = plan("vm1", "http://a:1", Some(&r), &Overrides::default()).unwrap();
        assert_eq!(
            (p.export.as_str(), p.fallback.as_deref()),
            ("target/vm1", Some("vdisk/win11@3"))
        );
        // Server types have no fallback: their cache is the server's target/ID.
        let p = plan(
            "vm1",
            "http://a:1",
            Some(&rec(CacheType::Server)),
            &Overrides::default(),
        )
        .unwrap();
        assert_eq!((p.export.as_str(), p.fallback), ("target/vm1", None));
    }

    #[test]
    fn flags_win_over_the_record() {
        let flags = Overrides {
            cache: Some(CacheType::DeviceRam),
            ram: Some(64 << 20),
            ..Overrides::default()
        };
        let p = plan(
            "vm1",
            "http://a:1",
            Some(&rec(CacheType::DeviceDisk)),
            &flags,
        )
        .unwrap();
        assert_eq!(
            (p.cache, p.ram, p.overflow_max, p.source),
            (
                CacheType::DeviceRam,
                Some(64 << 20),
                Some(8 << 30),
                "record and flags"
            )
        );
        assert_eq!(p.export, "target/vm1");
        // Another version than the record's: target/ID would serve the record's, so the vDisk is read directly.
        let flags = Overrides {
            vdisk: Some("win11@2".into()),
            ..Overrides::default()
        };
        let p = plan(
            "vm1",
            "http://a:1",
            Some(&rec(CacheType::DeviceDisk)),
            &flags,
        )
        .unwrap();
        assert_eq!(
            (p.export.as_str(), p.fallback, p.version),
            ("vdisk/win11@2", None, Some(Selector::Number(2)))
        );
        // The record's name without @V keeps the record's version.
        let r = TargetRecord {
            version: Selector::Test,
            ..rec(CacheType::DeviceDisk)
        };
        let p = plan(
            "vm1",
            "http://a:1",
            Some(&r),
            &Overrides {
                vdisk: Some("win11".into()),
                ..Overrides::default()
            },
        )
        .unwrap();
        assert_eq!(
            (p.export.as_str(), p.fallback.as_deref()),
            ("target/vm1", Some("vdisk/win11@test"))
        );
        // A device type over a record of a server type: the vDisk, not the server's cache.
        let flags = Overrides {
            cache: Some(CacheType::DeviceDisk),
            ..Overrides::default()
        };
        let p = plan("vm1", "http://a:1", Some(&rec(CacheType::Server)), &flags).unwrap();
        assert_eq!(p.export, "vdisk/win11");
    }

    #[test]
    fn a_server_side_cache_follows_its_record() {
        let flags = Overrides {
            cache: Some(CacheType::ServerPersistent),
            ..Overrides::default()
        };
        let e = plan("vm1", "http://a:1", Some(&rec(CacheType::Server)), &flags)
            .unwrap_err()
            .to_string();
        assert!(e.contains("vdstream target set vm1"), "{e}");
        let flags = Overrides {
            cache: Some(CacheType::Server),
            ..Overrides::default()
        };
        let e = plan(
            "vm1",
            "http://a:1",
            None,
            &Overrides {
                vdisk: Some("w".into()),
                ..flags
            },
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("vdstream target add vm1 --vdisk w --cache server"),
            "{e}"
        );
    }

    #[test]
    fn without_a_record_the_flags_must_name_the_vdisk() {
        let e = plan("vm1", "http://a:1", None, &Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("vm1") && e.contains("vdstream target add vm1") && e.contains("--vdisk"),
            "{e}"
        );
        let flags = Overrides {
            vdisk: Some("win11@3".into()),
            cache: Some(CacheType::DeviceDisk),
            ..Overrides::default()
        };
        let p = plan("vm1", "http://a:1", None, &flags).unwrap();
        assert_eq!(
            (p.export.as_str(), p.fallback, p.cache, p.source),
            ("vdisk/win11@3", None, CacheType::DeviceDisk, "flags")
        );
        let p = plan(
            "vm1",
            "http://a:1",
            None,
            &Overrides {
                vdisk: Some("win11".into()),
                ..Overrides::default()
            },
        )
        .unwrap();
        assert_eq!(
            (p.export.as_str(), p.cache),
            ("vdisk/win11", CacheType::RamOverflow)
        );
        // What the export-name grammar refuses is refused here, saying why and what to give.
        for (bad, why) in [
            ("", "empty"),
            ("a/b", "path separator"),
            ("w@", "not a version"),
            ("w@x", "not a version"),
            ("-rf", "'-'"),
            ("../x", "separator"),
        ] {
            let e = plan(
                "vm1",
                "u",
                None,
                &Overrides {
                    vdisk: Some(bad.into()),
                    ..Overrides::default()
                },
            )
            .unwrap_err()
            .to_string();
            assert!(
                e.starts_with(&format!("--vdisk {bad:?}: "))
                    && e.contains(why)
                    && e.ends_with("e.g. win11 or win11@3"),
                "{bad}: {e}"
            );
        }
        let p = plan(
            "vm1",
            "u",
            None,
            &Overrides {
                vdisk: Some("w@latest".into()),
                ..Overrides::default()
            },
        )
        .unwrap();
        assert_eq!(
            (p.export.as_str(), p.version),
            ("vdisk/w@latest", Some(Selector::Latest))
        );
        let p = plan(
            "vm1",
            "u",
            None,
            &Overrides {
                vdisk: Some("w@prod".into()),
                ..Overrides::default()
            },
        )
        .unwrap();
        assert_eq!((p.export.as_str(), p.version), ("vdisk/w", None));
        let flags = Overrides {
            vdisk: Some("w".into()),
            cache: Some(CacheType::Private),
            ..Overrides::default()
        };
        assert!(plan("vm1", "u", None, &flags)
            .unwrap_err()
            .to_string()
            .contains("private"));
    }
}
