//! `GET /metrics`: the figures of the API in the Prometheus text format (version 0.0.4),
//! each family with `# HELP` and `# TYPE`. Per-session series are labelled `session`,
//! `target` (empty when none), `export`, `vdisk` and `version`; agent series `target`.
//! Label values are escaped (`\\`, `\"`, `\n`).

use std::fmt::Write;
use std::sync::atomic::Ordering;

use serde_json::Value;

use super::shared::Shared;
use crate::state::CountersSnapshot;

pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn labels(pairs: &[(&str, &str)]) -> String {
    let inner: Vec<String> = pairs.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
    format!("{{{}}}", inner.join(","))
}

/// One metric family: its header, then its samples.
struct Family<'a> {
    out: &'a mut String,
}

impl<'a> Family<'a> {
    fn new(out: &'a mut String, name: &str, kind: &str, help: &str) -> Self {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        Family { out }
    }

    fn sample(&mut self, name: &str, labels: &str, value: f64) {
        let _ = writeln!(self.out, "{name}{labels} {value}");
    }
}

type Counter = (&'static str, &'static str, fn(&CountersSnapshot) -> u64);

const SESSION_COUNTERS: [Counter; 8] = [
    ("vdstream_session_guest_read_ops_total", "Reads the client asked for.", |c| c.guest_read_ops),
    ("vdstream_session_guest_read_bytes_total", "Bytes the client read.", |c| c.guest_read_bytes),
    ("vdstream_session_guest_write_ops_total", "Writes the client asked for.", |c| c.guest_write_ops),
    ("vdstream_session_guest_write_bytes_total", "Bytes the client wrote.", |c| c.guest_write_bytes),
    ("vdstream_session_store_read_ops_total", "Reads that reached the store's files.", |c| c.store_read_ops),
    ("vdstream_session_store_read_bytes_total", "Bytes read from the store's files.", |c| c.store_read_bytes),
    ("vdstream_session_store_write_ops_total", "Writes that reached a file (the server-side cache).", |c| c.store_write_ops),
    ("vdstream_session_store_write_bytes_total", "Bytes written to a file (the server-side cache).", |c| c.store_write_bytes),
];

/// Every session's I/O since the server started (closed sessions too).
const SERVER_COUNTERS: [Counter; 8] = [
    ("vdstream_guest_read_ops_total", "Reads clients asked for, every session.", |c| c.guest_read_ops),
    ("vdstream_guest_read_bytes_total", "Bytes clients read, every session.", |c| c.guest_read_bytes),
    ("vdstream_guest_write_ops_total", "Writes clients asked for, every session.", |c| c.guest_write_ops),
    ("vdstream_guest_write_bytes_total", "Bytes clients wrote, every session.", |c| c.guest_write_bytes),
    ("vdstream_store_read_ops_total", "Reads that reached the store's files (after the read cache).", |c| c.store_read_ops),
    ("vdstream_store_read_bytes_total", "Bytes read from the store's files (after the read cache).", |c| c.store_read_bytes),
    ("vdstream_store_write_ops_total", "Writes that reached a file (maintenance versions, server-side caches).", |c| c.store_write_ops),
    ("vdstream_store_write_bytes_total", "Bytes written to a file (maintenance versions, server-side caches).", |c| c.store_write_bytes),
];

/// The agent figures exported, by JSON pointer into its report.
const AGENT_FIGURES: [(&str, &str, &str, &str); 6] = [
    ("vdstream_agent_retries_total", "counter", "Requests the agent re-sent after a connection broke.", "/server/retries"),
    ("vdstream_agent_reconnects_total", "counter", "Reconnects of the agent.", "/server/reconnects"),
    ("vdstream_agent_failovers_total", "counter", "Reconnects that moved the agent to another server.", "/server/failovers"),
    ("vdstream_agent_gave_up_total", "counter", "Requests failed after --retry-for ran out.", "/server/gave_up"),
    ("vdstream_agent_cache_used_percent", "gauge", "The agent's write cache in use, percent of its capacity (its limit, or less when its file system has less room).", "/cache/used_percent"),
    ("vdstream_agent_guest_iops", "gauge", "Guest operations per second at the agent.", "/guest/iops"),
];

pub(crate) fn render(shared: &Shared) -> String {
    let state = &shared.state;
    let sessions = state.registry.sessions();
    let mut out = String::new();
    Family::new(&mut out, "vdstream_sessions", "gauge", "Live NBD sessions.").sample("vdstream_sessions", "", sessions.len() as f64);
    Family::new(&mut out, "vdstream_server_draining", "gauge", "1 while the server drains (SIGTERM).")
        .sample("vdstream_server_draining", "", if state.draining.load(Ordering::Relaxed) { 1.0 } else { 0.0 });
    let started = state.started_unix_ms as f64 / 1000.0;
    Family::new(&mut out, "vdstream_server_start_time_seconds", "gauge", "When the server started, Unix time.").sample("vdstream_server_start_time_seconds", "", started);

    let totals = state.totals.snapshot();
    for (name, help, get) in SERVER_COUNTERS {
        Family::new(&mut out, name, "counter", help).sample(name, "", get(&totals) as f64);
    }
    let rc = state.read_cache.snapshot();
    for (name, kind, help, value) in [
        ("vdstream_read_cache_hits_total", "counter", "Blocks the shared read cache answered.", rc.hits),
        ("vdstream_read_cache_misses_total", "counter", "Blocks the shared read cache read from the store.", rc.misses),
        ("vdstream_read_cache_shared_loads_total", "counter", "Misses that waited for another reader's load of the same block.", rc.shared_loads),
        ("vdstream_read_cache_evictions_total", "counter", "Blocks dropped from the shared read cache to make room.", rc.evictions),
        ("vdstream_read_cache_used_bytes", "gauge", "Bytes the shared read cache holds.", rc.used),
        ("vdstream_read_cache_capacity_bytes", "gauge", "The shared read cache's size (--read-cache).", rc.capacity),
    ] {
        Family::new(&mut out, name, kind, help).sample(name, "", value as f64);
    }

    let snaps: Vec<_> = sessions.iter().map(|s| {
        let i = &s.info;
        let l = labels(&[
            ("session", &s.id.to_string()),
            ("target", i.target.as_deref().unwrap_or("")),
            ("export", &i.export),
            ("vdisk", &i.vdisk),
            ("version", &i.version.to_string()),
        ]);
        (l, s.counters.snapshot(), s.cache_figures())
    }).collect();
    for (name, help, get) in SESSION_COUNTERS {
        let mut f = Family::new(&mut out, name, "counter", help);
        for (l, c, _) in &snaps {
            f.sample(name, l, get(c) as f64);
        }
    }
    let mut f = Family::new(&mut out, "vdstream_session_cache_used_bytes", "gauge", "Bytes the session's server-side write cache holds.");
    for (l, c, _) in &snaps {
        f.sample("vdstream_session_cache_used_bytes", l, c.cache_used as f64);
    }
    // A server-side write cache's capacity, as an agent's status has it (see CacheProbe).
    type CacheFigure = fn(&(vdstream_wcache::space::Capacity, vdstream_wcache::StatsSnapshot)) -> Option<f64>;
    const CACHE_FIGURES: [(&str, &str, &str, CacheFigure); 5] = [
        ("vdstream_session_cache_limit_bytes", "gauge", "The configured limit of the session's server-side write cache (its file's cap, or the vDisk's size).", |(c, _)| Some(c.limit as f64)),
        ("vdstream_session_cache_fs_free_bytes", "gauge", "Free bytes on the file system of the server-side write cache's file.", |(c, _)| c.fs_free.map(|f| f as f64)),
        ("vdstream_session_cache_capacity_bytes", "gauge", "What the server-side write cache can hold: the least of its limit and its use plus the free space of its file system.", |(c, _)| Some(c.capacity as f64)),
        ("vdstream_session_cache_used_percent", "gauge", "The server-side write cache in use, percent of its capacity.", |(c, _)| Some(c.used_percent())),
        ("vdstream_session_cache_nospace_errors_total", "counter", "Writes the server-side write cache refused for space (its limit, or its file system full: ENOSPC).", |(_, s)| Some(s.nospace_errors as f64)),
    ];
    for (name, kind, help, get) in CACHE_FIGURES {
        let mut f = Family::new(&mut out, name, kind, help);
        for (l, _, cache) in &snaps {
            if let Some(v) = cache.as_ref().and_then(get) {
                f.sample(name, l, v);
            }
        }
    }

    let mut targets: Vec<&str> = sessions.iter().filter_map(|s| s.info.target.as_deref()).collect();
    targets.sort_unstable();
    targets.dedup();
    let mut f = Family::new(&mut out, "vdstream_target_reconnects_total", "counter", "Connections of a target after its first since the server started.");
    for t in &targets {
        f.sample("vdstream_target_reconnects_total", &labels(&[("target", t)]), state.registry.reconnects(t) as f64);
    }

    let reports = shared.live.agent_reports();
    for (name, kind, help, pointer) in AGENT_FIGURES {
        let mut f = Family::new(&mut out, name, kind, help);
        for (t, doc) in &reports {
            if let Some(v) = doc.pointer(pointer).and_then(Value::as_f64) {
                f.sample(name, &labels(&[("target", t)]), v);
            }
        }
    }
    let mut f = Family::new(&mut out, "vdstream_agent_connected", "gauge", "1 when the agent's last report says it is connected to a server.");
    for (t, doc) in &reports {
        let c = doc.pointer("/server/connected").and_then(Value::as_bool).unwrap_or(false);
        f.sample("vdstream_agent_connected", &labels(&[("target", t)]), if c { 1.0 } else { 0.0 });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(labels(&[("a", "x\"y\\z\nw")]), r#"{a="x\"y\\z\nw"}"#);
    }
}
