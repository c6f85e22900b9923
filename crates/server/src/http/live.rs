//! The live part of the API: the server document, the sessions with their I/O rates, and
//! the agents' reports.
//!
//! Rates: a sampler takes a snapshot of every session's counters each
//! [`SAMPLE_EVERY`]; a rate is the growth from the oldest snapshot still inside
//! [`RATE_WINDOW`] to the counters now. A session younger than one sample shows 0.
//!
//! Agent reports: `PUT /api/v1/targets/{id}/agent` carries an agent's status document
//! (`vdstream_contract::status::Status`, the JSON `vdstream target status --json` prints).
//! A report that does not read as a `Status` is refused (400); the server keeps the
//! `Status` it read (fields this server does not know are left out) with the time it got
//! it, and every view shows that ([`AgentReport`]).
//!
//! What a report may cost, bounded whoever sends it (an operator token or a target's own
//! certificate; auth.rs checks who before this module sees a report):
//! - only targets with a record in the store may report (404 otherwise), so the reports
//!   kept are at most one per target of the store (and never over [`MAX_REPORTS`]);
//! - a report is at most `MAX_AGENT_REPORT` bytes (413, checked before it is read), at
//!   most [`MAX_REPORT_VALUES`] JSON values and [`MAX_REPORT_DEPTH`] levels deep (400);
//! - it is kept as compact JSON text (not a parsed tree), and parsed when read;
//! - one older than [`REPORT_TTL`] is left out of every view and freed by the sampler's
//!   sweep within a second or so, after which the allocator is asked to return freed
//!   memory to the system (glibc's `malloc_trim`), so the server's RSS goes back down.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::sync::{watch, Semaphore};
use vdstream_contract::server::{IoDoc, IoTotals, NbdAddresses, ReadCacheDoc, ServerDoc};
use vdstream_contract::status::Status;

use super::documents::{AgentReport, LastBoot, ReportAccepted, SessionCache, SessionDoc};
use super::error::ApiError;
use super::limits::{MAX_EVENT_STREAMS, MAX_EVENT_STREAMS_PER_CALLER};
use crate::state::{unix_ms, CountersSnapshot, ServerState, Session};
use vdstream_blockdev::lock;
use vdstream_contract::status::IoStatus;

pub const SAMPLE_EVERY: Duration = Duration::from_secs(1);
pub const RATE_WINDOW: Duration = Duration::from_secs(5);
pub const REPORT_TTL: Duration = Duration::from_secs(60);
/// Reports kept at most (one per target); past it the oldest is dropped.
const MAX_REPORTS: usize = 10_000;
/// JSON values (objects, arrays, strings, numbers, …) in one report at most.
pub const MAX_REPORT_VALUES: usize = 1_000;
/// Nesting of one report at most.
pub const MAX_REPORT_DEPTH: usize = 8;

#[derive(Debug)]
struct Report {
    at: Instant,
    /// The report as compact JSON text.
    json: Box<str>,
}

impl Report {
    fn doc(&self) -> Option<AgentReport> {
        serde_json::from_str(&self.json).ok()
    }
}

/// Agent reports, counter samples, and the event streams' latest document (events.rs).
#[derive(Debug, Default)]
pub(crate) struct Live {
    reports: Mutex<BTreeMap<String, Report>>,
    samples: Mutex<HashMap<u64, VecDeque<(Instant, CountersSnapshot)>>>,
    /// The last boot script served to each network-booted target: when (Unix ms), and what.
    boots: Mutex<BTreeMap<String, (u64, String)>>,
    /// The live migration each target's audit trail records last: (role, started), so that
    /// the reports that repeat its outcome record it once. One entry a target with a record.
    migrations_audited: Mutex<HashMap<String, (String, u64)>>,
    pub events: Events,
}

/// The latest farm document, the places for streams, and how many each caller holds.
#[derive(Debug)]
pub(crate) struct Events {
    pub latest: watch::Sender<Option<Arc<str>>>,
    pub places: Arc<Semaphore>,
    /// Streams open per caller (as `Caller::holder` names it); only callers holding one
    /// are remembered.
    held: Arc<Mutex<HashMap<String, usize>>>,
}

impl Default for Events {
    fn default() -> Self {
        Events {
            latest: watch::Sender::new(None),
            places: Arc::new(Semaphore::new(MAX_EVENT_STREAMS)),
            held: Arc::default(),
        }
    }
}

/// One of a caller's [`MAX_EVENT_STREAMS_PER_CALLER`] streams, given back when dropped.
#[derive(Debug)]
pub(crate) struct Share {
    held: Arc<Mutex<HashMap<String, usize>>>,
    holder: String,
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut held = lock(&self.held);
        if let Some(n) = held.get_mut(&self.holder) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.holder);
            }
        }
    }
}

impl Events {
    /// Whether any stream is open (the sampler builds documents only then).
    pub fn watched(&self) -> bool {
        self.latest.receiver_count() > 0
    }

    /// A stream for `holder`, unless it holds [`MAX_EVENT_STREAMS_PER_CALLER`] already.
    pub fn share(&self, holder: &str) -> Option<Share> {
        let mut held = lock(&self.held);
        let n = held.entry(holder.to_string()).or_insert(0);
        if *n >= MAX_EVENT_STREAMS_PER_CALLER {
            return None;
        }
        *n += 1;
        Some(Share {
            held: self.held.clone(),
            holder: holder.to_string(),
        })
    }
}

/// Operations and bytes per second.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Rates {
    pub guest_iops: f64,
    pub guest_bytes_per_sec: f64,
    pub store_iops: f64,
    pub store_bytes_per_sec: f64,
}

fn rates_between(old: &CountersSnapshot, new: &CountersSnapshot, secs: f64) -> Rates {
    if secs <= 0.0 {
        return Rates::default();
    }
    let d = |a: u64, b: u64| b.saturating_sub(a) as f64 / secs;
    Rates {
        guest_iops: d(
            old.guest_read_ops + old.guest_write_ops,
            new.guest_read_ops + new.guest_write_ops,
        ),
        guest_bytes_per_sec: d(
            old.guest_read_bytes + old.guest_write_bytes,
            new.guest_read_bytes + new.guest_write_bytes,
        ),
        store_iops: d(
            old.store_read_ops + old.store_write_ops,
            new.store_read_ops + new.store_write_ops,
        ),
        store_bytes_per_sec: d(
            old.store_read_bytes + old.store_write_bytes,
            new.store_read_bytes + new.store_write_bytes,
        ),
    }
}

impl Live {
    /// One sampler tick: a snapshot of every live session; sessions gone are forgotten.
    pub fn sample(&self, sessions: &[Arc<Session>]) {
        self.sample_at(Instant::now(), sessions);
    }

    fn sample_at(&self, now: Instant, sessions: &[Arc<Session>]) {
        let mut samples = lock(&self.samples);
        samples.retain(|id, _| sessions.iter().any(|s| s.id == *id));
        for s in sessions {
            let h = samples.entry(s.id).or_default();
            h.push_back((now, s.counters.snapshot()));
            while h.len() > 1
                && h.front()
                    .is_some_and(|(t, _)| now.duration_since(*t) > RATE_WINDOW)
            {
                h.pop_front();
            }
        }
    }

    /// Rates of a session from its oldest sample to `now`.
    pub fn rates(&self, s: &Session, now: Instant) -> Rates {
        let samples = lock(&self.samples);
        match samples.get(&s.id).and_then(|h| h.front()) {
            Some((t, old)) => rates_between(
                old,
                &s.counters.snapshot(),
                now.duration_since(*t).as_secs_f64(),
            ),
            None => Rates::default(),
        }
    }

    /// The latest report of `target`, if it is fresh, with `received_unix_ms` added.
    pub fn agent_report(&self, target: &str) -> Option<AgentReport> {
        let reports = lock(&self.reports);
        let r = reports.get(target)?;
        (r.at.elapsed() <= REPORT_TTL).then(|| r.doc()).flatten()
    }

    /// Fresh reports, by target.
    pub fn agent_reports(&self) -> Vec<(String, AgentReport)> {
        lock(&self.reports)
            .iter()
            .filter(|(_, r)| r.at.elapsed() <= REPORT_TTL)
            .filter_map(|(t, r)| Some((t.clone(), r.doc()?)))
            .collect()
    }

    /// Frees the reports older than [`REPORT_TTL`]; then, if any was freed, hands freed
    /// heap memory back to the system.
    pub fn sweep_reports(&self) {
        let freed = {
            let mut reports = lock(&self.reports);
            let before = reports.len();
            reports.retain(|_, r| r.at.elapsed() <= REPORT_TTL);
            before - reports.len()
        };
        if freed > 0 {
            trim_heap();
        }
    }

    fn put_report(&self, target: &str, status: Status) {
        let report = AgentReport {
            status,
            received_unix_ms: unix_ms(),
        };
        let json = serde_json::to_string(&report)
            .expect("a report serializes")
            .into_boxed_str();
        drop(report);
        let mut reports = lock(&self.reports);
        reports.retain(|_, r| r.at.elapsed() <= REPORT_TTL);
        if reports.len() >= MAX_REPORTS && !reports.contains_key(target) {
            if let Some(oldest) = reports
                .iter()
                .min_by_key(|(_, r)| r.at)
                .map(|(t, _)| t.clone())
            {
                reports.remove(&oldest);
            }
        }
        reports.insert(
            target.to_string(),
            Report {
                at: Instant::now(),
                json,
            },
        );
    }

    /// Notes that the boot service sent `target` its boot script (`what`: MAC, peer,
    /// vDisk). At most [`MAX_REPORTS`] targets are kept, the oldest dropped first.
    pub fn note_boot(&self, target: &str, what: &str) {
        let mut boots = lock(&self.boots);
        if boots.len() >= MAX_REPORTS && !boots.contains_key(target) {
            if let Some(oldest) = boots
                .iter()
                .min_by_key(|(_, (at, _))| *at)
                .map(|(t, _)| t.clone())
            {
                boots.remove(&oldest);
            }
        }
        boots.insert(target.to_string(), (unix_ms(), what.to_string()));
    }

    /// The last boot script served to `target`.
    pub fn last_boot(&self, target: &str) -> Option<LastBoot> {
        lock(&self.boots).get(target).map(|(at, what)| LastBoot {
            at_unix_ms: *at,
            what: what.clone(),
        })
    }

    /// `GET /api/v1/sessions`.
    pub fn sessions_doc(&self, state: &ServerState) -> Vec<SessionDoc> {
        let now = Instant::now();
        state
            .registry
            .sessions()
            .iter()
            .map(|s| {
                let c = s.counters.snapshot();
                let r = self.rates(s, now);
                let i = &s.info;
                let cache = match s.cache_figures() {
                    // The same figures as an agent's status (`vdstream target status`).
                    Some((cap, st)) => SessionCache {
                        kind: i.cache_type.clone(),
                        used_bytes: cap.used,
                        limit_bytes: Some(cap.limit),
                        fs_free_bytes: cap.fs_free,
                        capacity_bytes: Some(cap.capacity),
                        used_percent: Some(cap.used_percent()),
                        nospace_errors: Some(st.nospace_errors),
                    },
                    None => SessionCache {
                        kind: i.cache_type.clone(),
                        used_bytes: c.cache_used,
                        limit_bytes: None,
                        fs_free_bytes: None,
                        capacity_bytes: None,
                        used_percent: None,
                        nospace_errors: None,
                    },
                };
                SessionDoc {
                    id: s.id,
                    server: state.name.clone(),
                    export: i.export.clone(),
                    kind: i.kind,
                    target: i.target.clone(),
                    peer: i.peer.clone(),
                    vdisk: i.vdisk.clone(),
                    version: i.version,
                    cache,
                    reconnects: i
                        .target
                        .as_deref()
                        .map_or(0, |t| state.registry.reconnects(t)),
                    guest: IoStatus {
                        read_ops: c.guest_read_ops,
                        read_bytes: c.guest_read_bytes,
                        write_ops: c.guest_write_ops,
                        write_bytes: c.guest_write_bytes,
                        iops: r.guest_iops,
                        bytes_per_sec: r.guest_bytes_per_sec,
                    },
                    store: IoStatus {
                        read_ops: c.store_read_ops,
                        read_bytes: c.store_read_bytes,
                        write_ops: c.store_write_ops,
                        write_bytes: c.store_write_bytes,
                        iops: r.store_iops,
                        bytes_per_sec: r.store_bytes_per_sec,
                    },
                    connected_unix_ms: s.connected_unix_ms,
                    agent: i.target.as_deref().and_then(|t| self.agent_report(t)),
                }
            })
            .collect()
    }
}

/// `GET /api/v1/server`: the typed document agents read (`vdstream_contract::server`).
pub(crate) fn server_doc(state: &ServerState) -> ServerDoc {
    let c = state.read_cache.snapshot();
    let looked = c.hits + c.misses;
    let t = state.totals.snapshot();
    ServerDoc {
        name: state.name.clone(),
        store: state.store.display().to_string(),
        nbd: NbdAddresses {
            listen: state.nbd_listen.clone(),
            socket: state.nbd_socket.as_ref().map(|p| p.display().to_string()),
        },
        sessions: state.registry.len() as u64,
        draining: state.is_draining(),
        started_unix_ms: state.started_unix_ms,
        version: env!("CARGO_PKG_VERSION").to_string(),
        read_cache: ReadCacheDoc {
            capacity_bytes: c.capacity,
            used_bytes: c.used,
            hits: c.hits,
            misses: c.misses,
            shared_loads: c.shared_loads,
            evictions: c.evictions,
            hit_ratio: (looked > 0)
                .then(|| (c.hits as f64 * 1000.0 / looked as f64).round() / 1000.0),
        },
        io: IoDoc {
            guest: IoTotals {
                read_ops: t.guest_read_ops,
                read_bytes: t.guest_read_bytes,
                write_ops: t.guest_write_ops,
                write_bytes: t.guest_write_bytes,
            },
            store: IoTotals {
                read_ops: t.store_read_ops,
                read_bytes: t.store_read_bytes,
                write_ops: t.store_write_ops,
                write_bytes: t.store_write_bytes,
            },
        },
        boot: state
            .pacer
            .as_ref()
            .map(crate::boot::pacing::Pacer::figures),
        balance: state.balancer.doc(state),
    }
}

/// Returns freed heap memory to the system (glibc keeps it otherwise, and the RSS stays up).
fn trim_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim takes no pointer and only rearranges the allocator's free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Counts the values of `v` (itself included) and checks its depth, stopping early past the limits.
fn within_report_limits(v: &Value, depth: usize, count: &mut usize) -> bool {
    *count += 1;
    if *count > MAX_REPORT_VALUES || depth > MAX_REPORT_DEPTH {
        return false;
    }
    match v {
        Value::Array(a) => a.iter().all(|x| within_report_limits(x, depth + 1, count)),
        Value::Object(o) => o
            .values()
            .all(|x| within_report_limits(x, depth + 1, count)),
        _ => true,
    }
}

impl Live {
    /// `PUT /api/v1/targets/{id}/agent` from `client`: `doc` is the agent's status
    /// document; its `target` (if present) must be `id`, a target with a record in the
    /// store. Blocks (reads the store).
    pub fn accept_report(
        &self,
        state: &ServerState,
        id: &str,
        client: SocketAddr,
        doc: Value,
    ) -> Result<ReportAccepted, ApiError> {
        vdstream_store::names::validate_target_id(id)?;
        let store = vdstream_store::Store::open(&state.store)?;
        let record = match store.target(id) {
            Ok(r) => r,
            Err(vdstream_store::StoreError::UnknownTarget { .. }) => {
                state.log.log(
                    log::Level::Warn,
                    module_path!(),
                    "agent report refused",
                    format_args!("HTTP API: refused an agent report for target {id:?} from {client}: no such target in the store"),
                );
                return Err(ApiError::new(
                    404,
                    format!("target {id:?} has no record in the store of this server, so its reports are refused"),
                    format!("add it first with `vdstream target add {id} --vdisk NAME --cache TYPE` (or POST /api/v1/targets), then start its agent"),
                ));
            }
            Err(e) => return Err(e.into()),
        };
        let Some(obj) = doc.as_object() else {
            return Err(ApiError::bad_request(
                "an agent report is a JSON object",
                "send the document `vdstream target status ID --json` prints",
            ));
        };
        if !within_report_limits(&doc, 0, &mut 0) {
            return Err(ApiError::bad_request(
                format!("the report has more than {MAX_REPORT_VALUES} JSON values or is nested more than {MAX_REPORT_DEPTH} levels deep"),
                "send the document `vdstream target status ID --json` prints",
            ));
        }
        match obj.get("target") {
            None => {}
            Some(Value::String(t)) if t == id => {}
            // A well-formed report for another target: it contradicts the URL (409), which
            // is what the caller was authorized for.
            Some(other) => {
                return Err(ApiError::new(
                    409,
                    format!("the report names target {other} but was sent for target {id:?}"),
                    "send it to /api/v1/targets/{its target}/agent",
                ))
            }
        }
        let mut doc = doc;
        super::error::whole_numbers_as_integers(&mut doc);
        let status = match <Status as serde::Deserialize>::deserialize(&doc) {
            Ok(s) => s,
            Err(e) => {
                return Err(ApiError::bad_request(
                    format!("the report is not an agent status: {e}"),
                    "send the document `vdstream target status ID --json` prints",
                ))
            }
        };
        drop(doc);
        if let Some(m) = &status.migration {
            self.audit_migration(state, &store, id, &record.vdisk, client, m);
        }
        self.put_report(id, status);
        Ok(ReportAccepted {
            target: id.to_string(),
            accepted: true,
            keep_for_secs: REPORT_TTL.as_secs(),
        })
    }
}

impl Live {
    /// Records a live migration of target `id` in the audit trail (`target.migrate`) once
    /// it ended: a handover done, from the destination's report (the source ends with it);
    /// one cancelled, failed or reverted, from the source's (the destination ends then).
    fn audit_migration(
        &self,
        state: &ServerState,
        store: &vdstream_store::Store,
        id: &str,
        vdisk: &str,
        client: SocketAddr,
        m: &vdstream_contract::status::MigrationStatus,
    ) {
        let reported_by = match (m.role.as_str(), m.phase.as_str()) {
            ("destination", "done") => "destination",
            ("source", "cancelled" | "failed" | "reverted") => "source",
            _ => return,
        };
        let key = (m.role.clone(), m.started_unix_ms);
        {
            let mut seen = lock(&self.migrations_audited);
            if seen.get(id) == Some(&key) {
                return;
            }
            if seen.len() >= MAX_REPORTS && !seen.contains_key(id) {
                seen.clear();
            }
            seen.insert(id.to_string(), key);
        }
        let mut details = json!({
            "target": id,
            "outcome": m.phase,
            "reported_by": reported_by,
            "agent": client.to_string(),
            "peer": m.peer,
            "rounds": m.rounds,
            "data_bytes": m.data_bytes,
            "wire_bytes": m.wire_bytes,
            "final_bytes": m.final_bytes,
            "fenced_ms": m.fenced_ms,
            "held_ms": m.held_ms,
            "started_unix_ms": m.started_unix_ms,
            "finished_unix_ms": m.finished_unix_ms,
        });
        if let Some(ms) = m.qemu_downtime_ms {
            details["qemu_downtime_ms"] = json!(ms);
        }
        if let Some(e) = &m.error {
            details["error"] = json!(e);
        }
        if let Err(e) = store.audit_event(MIGRATE_ACTION, vdisk, details) {
            state.log.log(
                log::Level::Warn,
                module_path!(),
                "audit write failed",
                format_args!(
                    "cannot record the live migration of target {id} in the audit trail: {e}"
                ),
            );
        }
    }
}

/// The audit trail's action for a live migration's outcome.
pub const MIGRATE_ACTION: &str = "target.migrate";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Counters, ExportKind, Registry, SessionInfo};

    #[test]
    fn rates_are_growth_over_the_window() {
        let live = Live::default();
        let reg = Registry::new();
        let g = reg.open(SessionInfo {
            export: "vdisk/w".into(),
            kind: ExportKind::Vdisk,
            target: None,
            peer: "unix".into(),
            vdisk: "w".into(),
            version: 0,
            cache_type: None,
            cache_limit: None,
        });
        let t0 = Instant::now();
        live.sample_at(t0, &reg.sessions());
        Counters::add(&g.session.counters.guest_read_ops, 100);
        Counters::add(&g.session.counters.guest_read_bytes, 409_600);
        let r = live.rates(&g.session, t0 + Duration::from_secs(2));
        assert_eq!(
            (r.guest_iops, r.guest_bytes_per_sec, r.store_iops),
            (50.0, 204_800.0, 0.0)
        );
        // Old samples leave the window; gone sessions are forgotten.
        live.sample_at(t0 + Duration::from_secs(10), &reg.sessions());
        assert_eq!(lock(&live.samples)[&g.session.id].len(), 1);
        drop(g);
        live.sample_at(t0 + Duration::from_secs(11), &reg.sessions());
        assert!(lock(&live.samples).is_empty());
    }
}
