//! `GET /metrics`: the figures of the API in the Prometheus text format (version 0.0.4),
//! encoded by `prometheus-client` from a registry built for each scrape (every figure is a
//! snapshot of the server's state). Per-session series are labelled `session`, `target`
//! (empty when none), `export`, `vdisk` and `version`; agent series `target`, read from
//! each fresh report as the agent's typed [`Status`].
//!
//! Invariants: names are the full exposed names (counters end in `_total`, which the
//! encoder adds back); a family is listed even with no series; whole quantities are
//! integer gauges, ratios and rates `f64`.

use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::TypedMetric;
use prometheus_client::registry::{Metric, Registry};
use vdstream_contract::status::Status;
use vdstream_wcache::space::Capacity;

use super::shared::Shared;
use crate::state::CountersSnapshot;

pub use prometheus_text::CONTENT_TYPE;

type Labels = Vec<(&'static str, String)>;
type Counters = Family<Labels, Counter>;
type Gauges = Family<Labels, Gauge>;
type Ratios = Family<Labels, Gauge<f64, AtomicU64>>;

/// The registry of one scrape.
struct Scrape(Registry);

impl Scrape {
    /// Registers `metric` as `name` (a counter without its `_total`, which the encoder adds;
    /// `help` without its final '.', which the registry adds) and hands it back to fill.
    fn add<M: Metric + TypedMetric + Clone>(&mut self, name: &str, help: &str, metric: M) -> M {
        let name = if M::TYPE == prometheus_client::metrics::MetricType::Counter {
            name.strip_suffix("_total").unwrap_or(name)
        } else {
            name
        };
        self.0
            .register(name, help.strip_suffix('.').unwrap_or(help), metric.clone());
        metric
    }

    fn counter(&mut self, name: &str, help: &str, v: u64) {
        self.add(name, help, Counter::<u64>::default()).inc_by(v);
    }

    fn gauge(&mut self, name: &str, help: &str, v: u64) {
        self.add(name, help, Gauge::<i64>::default()).set(int(v));
    }

    fn gauge_f64(&mut self, name: &str, help: &str, v: f64) {
        self.add(name, help, Gauge::<f64, AtomicU64>::default())
            .set(v);
    }
}

fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// A figure of the table's kind: its name, its help and how to read it from `T`.
type Figure<T, V> = (&'static str, &'static str, fn(&T) -> V);

const SESSION_COUNTERS: [Figure<CountersSnapshot, u64>; 8] = [
    (
        "vdstream_session_guest_read_ops_total",
        "Reads the client asked for.",
        |c| c.guest_read_ops,
    ),
    (
        "vdstream_session_guest_read_bytes_total",
        "Bytes the client read.",
        |c| c.guest_read_bytes,
    ),
    (
        "vdstream_session_guest_write_ops_total",
        "Writes the client asked for.",
        |c| c.guest_write_ops,
    ),
    (
        "vdstream_session_guest_write_bytes_total",
        "Bytes the client wrote.",
        |c| c.guest_write_bytes,
    ),
    (
        "vdstream_session_store_read_ops_total",
        "Reads that reached the store's files.",
        |c| c.store_read_ops,
    ),
    (
        "vdstream_session_store_read_bytes_total",
        "Bytes read from the store's files.",
        |c| c.store_read_bytes,
    ),
    (
        "vdstream_session_store_write_ops_total",
        "Writes that reached a file (the server-side cache).",
        |c| c.store_write_ops,
    ),
    (
        "vdstream_session_store_write_bytes_total",
        "Bytes written to a file (the server-side cache).",
        |c| c.store_write_bytes,
    ),
];

/// Every session's I/O since the server started (closed sessions too).
const SERVER_COUNTERS: [Figure<CountersSnapshot, u64>; 8] = [
    (
        "vdstream_guest_read_ops_total",
        "Reads clients asked for, every session.",
        |c| c.guest_read_ops,
    ),
    (
        "vdstream_guest_read_bytes_total",
        "Bytes clients read, every session.",
        |c| c.guest_read_bytes,
    ),
    (
        "vdstream_guest_write_ops_total",
        "Writes clients asked for, every session.",
        |c| c.guest_write_ops,
    ),
    (
        "vdstream_guest_write_bytes_total",
        "Bytes clients wrote, every session.",
        |c| c.guest_write_bytes,
    ),
    (
        "vdstream_store_read_ops_total",
        "Reads that reached the store's files (after the read cache).",
        |c| c.store_read_ops,
    ),
    (
        "vdstream_store_read_bytes_total",
        "Bytes read from the store's files (after the read cache).",
        |c| c.store_read_bytes,
    ),
    (
        "vdstream_store_write_ops_total",
        "Writes that reached a file (maintenance versions, server-side caches).",
        |c| c.store_write_ops,
    ),
    (
        "vdstream_store_write_bytes_total",
        "Bytes written to a file (maintenance versions, server-side caches).",
        |c| c.store_write_bytes,
    ),
];

/// A server-side write cache's capacity, as an agent's status has it (see CacheProbe).
const CACHE_BYTES: [Figure<Capacity, Option<u64>>; 3] = [
    ("vdstream_session_cache_limit_bytes", "The configured limit of the session's server-side write cache (its file's cap, or the vDisk's size).", |c| Some(c.limit)),
    ("vdstream_session_cache_fs_free_bytes", "Free bytes on the file system of the server-side write cache's file.", |c| c.fs_free),
    ("vdstream_session_cache_capacity_bytes", "What the server-side write cache can hold: the least of its limit and its use plus the free space of its file system.", |c| Some(c.capacity)),
];

const AGENT_COUNTERS: [Figure<Status, u64>; 4] = [
    (
        "vdstream_agent_retries_total",
        "Requests the agent re-sent after a connection broke.",
        |s| s.server.retries,
    ),
    (
        "vdstream_agent_reconnects_total",
        "Reconnects of the agent.",
        |s| s.server.reconnects,
    ),
    (
        "vdstream_agent_failovers_total",
        "Reconnects that moved the agent to another server.",
        |s| s.server.failovers,
    ),
    (
        "vdstream_agent_gave_up_total",
        "Requests failed after --retry-for ran out.",
        |s| s.server.gave_up,
    ),
];

const AGENT_RATIOS: [Figure<Status, f64>; 2] = [
    ("vdstream_agent_cache_used_percent", "The agent's write cache in use, percent of its capacity (its limit, or less when its file system has less room).", |s| s.cache.used_percent),
    ("vdstream_agent_guest_iops", "Guest operations per second at the agent.", |s| s.guest.iops),
];

pub(crate) fn render(shared: &Shared) -> String {
    let state = &shared.state;
    let sessions = state.registry.sessions();
    let mut m = Scrape(Registry::default());
    m.gauge(
        "vdstream_sessions",
        "Live NBD sessions.",
        sessions.len() as u64,
    );
    m.gauge(
        "vdstream_server_draining",
        "1 while the server drains (SIGTERM).",
        u64::from(state.is_draining()),
    );
    if let Some(p) = state
        .pacer
        .as_ref()
        .map(crate::boot::pacing::Pacer::figures)
    {
        m.gauge(
            "vdstream_boot_max_booting",
            "--max-booting: machines in their boot window at once, at most (0: no limit).",
            p.max_booting,
        );
        m.gauge(
            "vdstream_boot_booting",
            "Machines in their boot window now.",
            p.booting,
        );
        m.gauge(
            "vdstream_boot_booting_peak",
            "The most machines in their boot window at once since the server started.",
            p.booting_peak,
        );
        m.gauge(
            "vdstream_boot_waiting",
            "Machines told to wait for a boot place that are still asking.",
            p.waiting,
        );
        m.counter(
            "vdstream_boot_admitted_total",
            "Boot windows opened.",
            p.admitted_total,
        );
        m.counter(
            "vdstream_boot_waits_total",
            "Answers that told a machine to wait for a boot place.",
            p.waits_total,
        );
        m.counter(
            "vdstream_boot_booted_total",
            "Boot windows closed by the machine saying it booted.",
            p.booted_total,
        );
        m.counter(
            "vdstream_boot_expired_total",
            "Boot windows closed by --boot-window running out.",
            p.expired_total,
        );
    }
    if let Some(i) = &state.identity {
        use std::sync::atomic::Ordering::Relaxed;
        let c = &i.counters;
        m.counter(
            "vdstream_identity_challenges_total",
            "Credential challenges made for machines proving their TPM identity.",
            c.challenges.load(Relaxed),
        );
        m.counter(
            "vdstream_identity_certified_total",
            "Proofs of an approved key: certificates issued.",
            c.approved.load(Relaxed),
        );
        m.counter(
            "vdstream_identity_pending_total",
            "Proofs of a key that waits for approval.",
            c.pending.load(Relaxed),
        );
        m.counter(
            "vdstream_identity_refused_total",
            "Proofs refused: a failed activation or signature, another key than the approved one, a revoked target.",
            c.refused.load(Relaxed),
        );
    }
    let b = state.balancer.doc(state);
    m.gauge(
        "vdstream_balance_targets",
        "Targets with a connection to this server.",
        b.targets,
    );
    m.gauge_f64(
        "vdstream_balance_share",
        "This server's fair share of the farm's targets, by weight (--weight).",
        b.share,
    );
    m.gauge(
        "vdstream_balance_servers",
        "Servers of the store seen alive, this one included.",
        b.servers,
    );
    m.counter(
        "vdstream_balance_rounds_total",
        "Rebalancing rounds that moved targets away.",
        b.rounds,
    );
    m.counter(
        "vdstream_balance_moved_out_total",
        "Targets moved to other servers (rebalancing and drains).",
        b.moved_out,
    );
    if let Some(pool) = state.nbd_memory.get() {
        m.gauge("vdstream_nbd_request_memory_bytes", "Bytes the NBD connections' requests hold now (READ data not yet sent, WRITE payloads).", pool.used() as u64);
        m.gauge(
            "vdstream_nbd_request_memory_limit_bytes",
            "The bound on them (--max-request-memory).",
            pool.limit() as u64,
        );
        m.gauge(
            "vdstream_nbd_request_memory_peak_bytes",
            "The most they held at once since the server started.",
            pool.peak.load(Ordering::Relaxed),
        );
        m.counter("vdstream_nbd_request_memory_waits_total", "Requests that waited for memory before they were read (a connection holding more than its share while the bound was reached).", pool.waits.load(Ordering::Relaxed));
    }
    m.add(
        "vdstream_server_start_time_seconds",
        "When the server started, Unix time.",
        Gauge::<f64, AtomicU64>::default(),
    )
    .set(state.started_unix_ms as f64 / 1000.0);

    let totals = state.totals.snapshot();
    for (name, help, get) in SERVER_COUNTERS {
        m.counter(name, help, get(&totals));
    }
    let rc = state.read_cache.snapshot();
    m.counter(
        "vdstream_read_cache_hits_total",
        "Blocks the shared read cache answered.",
        rc.hits,
    );
    m.counter(
        "vdstream_read_cache_misses_total",
        "Blocks the shared read cache read from the store.",
        rc.misses,
    );
    m.counter(
        "vdstream_read_cache_shared_loads_total",
        "Misses that waited for another reader's load of the same block.",
        rc.shared_loads,
    );
    m.counter(
        "vdstream_read_cache_evictions_total",
        "Blocks dropped from the shared read cache to make room.",
        rc.evictions,
    );
    m.gauge(
        "vdstream_read_cache_used_bytes",
        "Bytes the shared read cache holds.",
        rc.used,
    );
    m.gauge(
        "vdstream_read_cache_capacity_bytes",
        "The shared read cache's size (--read-cache).",
        rc.capacity,
    );

    let auth = shared.failures.counts();
    m.counter("vdstream_api_auth_failures_total", "API requests with a wrong credential: a bearer token not known or revoked, or an Authorization field that is not Bearer TOKEN.", auth.failures);
    m.counter("vdstream_api_auth_penalized_total", "API requests refused (429) because their address failed too many authentications (--handshake-penalty).", auth.penalized);
    m.counter(
        "vdstream_api_agent_reports_refused_total",
        "Agent status reports the API refused for want of a credential (401) or of one that may report for the target (403).",
        auth.reports_refused,
    );

    if let Some(extra) = &state.extra_counters {
        for (name, help, v) in (extra.0)() {
            m.counter(name, help, v);
        }
    }

    let snaps: Vec<_> = sessions
        .iter()
        .map(|s| {
            let i = &s.info;
            let target = i.target.clone().unwrap_or_default();
            let labels: Labels = vec![
                ("session", s.id.to_string()),
                ("target", target),
                ("export", i.export.clone()),
                ("vdisk", i.vdisk.clone()),
                ("version", i.version.to_string()),
            ];
            (labels, s.counters.snapshot(), s.cache_figures())
        })
        .collect();
    for (name, help, get) in SESSION_COUNTERS {
        let f = m.add(name, help, Counters::default());
        for (l, c, _) in &snaps {
            f.get_or_create(l).inc_by(get(c));
        }
    }
    let used = m.add(
        "vdstream_session_cache_used_bytes",
        "Bytes the session's server-side write cache holds.",
        Gauges::default(),
    );
    for (l, c, _) in &snaps {
        used.get_or_create(l).set(int(c.cache_used));
    }
    for (name, help, get) in CACHE_BYTES {
        let f = m.add(name, help, Gauges::default());
        for (l, v) in snaps
            .iter()
            .filter_map(|(l, _, cache)| Some((l, get(&cache.as_ref()?.0)?)))
        {
            f.get_or_create(l).set(int(v));
        }
    }
    let percent = m.add(
        "vdstream_session_cache_used_percent",
        "The server-side write cache in use, percent of its capacity.",
        Ratios::default(),
    );
    let nospace_help = "Writes the server-side write cache refused for space (its limit, or its file system full: ENOSPC).";
    let nospace = m.add(
        "vdstream_session_cache_nospace_errors_total",
        nospace_help,
        Counters::default(),
    );
    for (l, (cap, stats)) in snaps
        .iter()
        .filter_map(|(l, _, cache)| Some((l, cache.as_ref()?)))
    {
        percent.get_or_create(l).set(cap.used_percent());
        nospace.get_or_create(l).inc_by(stats.nospace_errors);
    }

    let mut targets: Vec<&str> = sessions
        .iter()
        .filter_map(|s| s.info.target.as_deref())
        .collect();
    targets.sort_unstable();
    targets.dedup();
    let f = m.add(
        "vdstream_target_reconnects_total",
        "Connections of a target after its first since the server started.",
        Counters::default(),
    );
    for t in targets {
        f.get_or_create(&vec![("target", t.to_string())])
            .inc_by(state.registry.reconnects(t));
    }

    let reports: Vec<(Labels, Status)> = shared
        .live
        .agent_reports()
        .into_iter()
        .map(|(t, r)| (vec![("target", t)], r.status))
        .collect();
    for (name, help, get) in AGENT_COUNTERS {
        let f = m.add(name, help, Counters::default());
        for (l, s) in &reports {
            f.get_or_create(l).inc_by(get(s));
        }
    }
    for (name, help, get) in AGENT_RATIOS {
        let f = m.add(name, help, Ratios::default());
        for (l, s) in &reports {
            f.get_or_create(l).set(get(s));
        }
    }
    let f = m.add(
        "vdstream_agent_connected",
        "1 when the agent's last report says it is connected to a server.",
        Gauges::default(),
    );
    for (l, s) in &reports {
        f.get_or_create(l).set(i64::from(s.server.connected));
    }

    let mut out = String::new();
    prometheus_text::encode(&mut out, &m.0).expect("writing to a String cannot fail");
    out
}
