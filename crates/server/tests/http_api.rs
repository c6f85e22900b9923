//! The HTTP API against a real store in a temporary folder and a real registry of
//! sessions: every route, the answers being the CLI's JSON documents, the error statuses,
//! agent reports merged into sessions and targets, metrics, and malformed requests (each
//! answered 400-class, none crashing or stalling the server). Also: the OpenAPI document
//! lists exactly the routes the router knows, with every status each can answer; the
//! server serves it, and docs/openapi.json is it.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use vdstream_agent::client::{Client, ClientError};
use vdstream_server::http::{self, HttpHandle};
use vdstream_server::state::{unix_ms, Counters, ExportKind, Registry, ServerState, SessionInfo};
use vdstream_server::ServerOptions;
use vdstream_store::vdisk::NewVdisk;
use vdstream_store::{documents, Store};

struct Api {
    _dir: tempfile::TempDir,
    store: Store,
    state: Arc<ServerState>,
    handle: Option<HttpHandle>,
    addr: SocketAddr,
    client: Client,
    /// The server's runtime (dropped after the handle: fields drop in order).
    rt: tokio::runtime::Runtime,
}

fn api() -> Api {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open_or_create(dir.path().join("store")).unwrap();
    store
        .create_vdisk("win", 8 << 20, NewVdisk::default())
        .unwrap();
    let state = ServerState::new(&ServerOptions {
        listen: Some("127.0.0.1:10809".parse().unwrap()),
        name: Some("pvs1:4242".into()),
        ..ServerOptions::new(store.root())
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let handle = rt
        .block_on(async { http::spawn(TcpListener::bind("127.0.0.1:0").unwrap(), state.clone()) })
        .unwrap();
    let addr = handle.local_addr();
    let client = Client::new(&format!("http://{addr}"))
        .unwrap()
        .with_timeout(Duration::from_secs(20));
    Api {
        _dir: dir,
        store,
        state,
        handle: Some(handle),
        addr,
        client,
        rt,
    }
}

fn api_error(r: Result<Value, ClientError>) -> (u16, String, String) {
    match r {
        Err(ClientError::Api {
            status,
            error,
            what_to_do,
        }) => (status, error, what_to_do),
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[test]
fn the_server_document_says_who_and_where() {
    let a = api();
    let doc = a.client.get("/api/v1/server").unwrap();
    assert_eq!(doc["name"], "pvs1:4242");
    assert_eq!(doc["store"], json!(a.store.root()));
    assert_eq!(
        doc["nbd"],
        json!({"listen": "127.0.0.1:10809", "socket": null})
    );
    assert_eq!(
        (doc["sessions"].as_u64(), doc["draining"].as_bool()),
        (Some(0), Some(false))
    );
    assert_eq!(doc["version"], env!("CARGO_PKG_VERSION"));
    assert!(doc["started_unix_ms"].as_u64().unwrap() <= unix_ms());
    assert_eq!(
        doc["read_cache"]["capacity_bytes"], 0,
        "read_cache: 0 in the options"
    );
    assert_eq!(
        (
            doc["read_cache"]["hits"].as_u64(),
            doc["read_cache"]["hit_ratio"].is_null()
        ),
        (Some(0), true)
    );
    assert_eq!(doc["io"]["guest"]["read_bytes"], 0);
    assert_eq!(doc["io"]["store"]["write_ops"], 0);
}

#[test]
fn vdisks_and_versions_answer_the_cli_documents() {
    let a = api();
    assert_eq!(
        a.client.get("/api/v1/vdisks").unwrap(),
        json!(documents::vdisk_list(&a.store).unwrap())
    );
    assert_eq!(
        a.client.get("/api/v1/vdisks/win").unwrap(),
        json!(documents::vdisk_show(&a.store, "win").unwrap())
    );
    // A trailing slash is the same route; an empty name is refused by the store's rule.
    assert_eq!(
        a.client.get("/api/v1/vdisks/").unwrap(),
        json!(documents::vdisk_list(&a.store).unwrap())
    );
    let (status, error, _) = api_error(a.client.get("/api/v1/vdisks//versions"));
    assert!(
        status == 400 && error.contains("empty"),
        "{status}: {error}"
    );

    let made = a
        .client
        .post(
            "/api/v1/vdisks/win/versions",
            &json!({"note": "May patches"}),
        )
        .unwrap();
    assert_eq!(
        (
            made["vdisk"].as_str(),
            made["version"]["number"].as_u64(),
            made["version"]["access"].as_str()
        ),
        (Some("win"), Some(1), Some("maintenance"))
    );
    assert_eq!(made["auto_merge"], Value::Null);
    let (status, error, _) = api_error(a.client.post("/api/v1/vdisks/win/versions", &json!({})));
    assert_eq!(status, 409);
    assert!(
        error.contains("already has version 1 in maintenance"),
        "{error}"
    );

    let p = a
        .client
        .post(
            "/api/v1/vdisks/win/versions/1/promote",
            &json!({"to": "test"}),
        )
        .unwrap();
    assert_eq!(p["version"]["access"], "test");
    let p = a
        .client
        .post(
            "/api/v1/vdisks/win/versions/1/promote",
            &json!({"to": "production", "at": "+2h"}),
        )
        .unwrap();
    assert!(p["version"]["scheduled_at"].is_string(), "{p}");
    let list = a.client.get("/api/v1/vdisks/win/versions").unwrap();
    assert_eq!(
        list,
        json!(documents::version_list(&a.store, "win").unwrap())
    );
    assert_eq!(
        (list["production"].clone(), list["test"].clone()),
        (json!("base"), json!({"version": 1}))
    );

    let r = a
        .client
        .post("/api/v1/vdisks/win/revert", &json!({"version": 1}))
        .unwrap();
    assert_eq!(
        r,
        json!({"vdisk": "win", "version": 1, "result": {"to": "test"}})
    );

    // Errors: statuses and messages of the store.
    let (status, error, what) = api_error(a.client.get("/api/v1/vdisks/nope"));
    assert_eq!((status, what.as_str()), (404, "known vDisks: win"));
    assert!(error.contains("no vDisk named \"nope\""), "{error}");
    assert_eq!(
        api_error(a.client.post(
            "/api/v1/vdisks/win/versions/x/promote",
            &json!({"to": "test"})
        ))
        .0,
        400
    );
    assert_eq!(
        api_error(a.client.post(
            "/api/v1/vdisks/win/versions/1/promote",
            &json!({"to": "maintenance"})
        ))
        .0,
        400
    );
    assert_eq!(
        api_error(a.client.post(
            "/api/v1/vdisks/win/versions/9/promote",
            &json!({"to": "test"})
        ))
        .0,
        404
    );
    assert_eq!(
        api_error(a.client.post(
            "/api/v1/vdisks/win/versions/1/promote",
            &json!({"to": "test", "at": "+1h"})
        ))
        .0,
        422,
        "each field is valid, together they are not: 422, not 400"
    );
    assert_eq!(
        api_error(
            a.client
                .post("/api/v1/vdisks/win/revert", &json!({"version": "one"}))
        )
        .0,
        400
    );
    assert_eq!(api_error(a.client.get("/api/v1/vdisks/a%2Fb")).0, 400);
}

#[test]
fn targets_are_added_shown_patched_and_removed() {
    let a = api();
    assert_eq!(a.client.get("/api/v1/targets").unwrap(), json!([]));
    let t = a
        .client
        .post(
            "/api/v1/targets",
            &json!({"id": "vm1", "vdisk": "win", "cache": "ram-overflow", "ram": 536870912}),
        )
        .unwrap();
    assert_eq!(t, json!(documents::target_show(&a.store, "vm1").unwrap()));
    assert_eq!(a.client.get("/api/v1/targets/vm1").unwrap(), t);
    let p = a
        .client
        .put(
            "/api/v1/targets/vm1",
            &json!({"version": "test", "description": "lab 1"}),
        )
        .unwrap();
    assert_eq!(
        (
            p["version"].as_str(),
            p["ram"].as_u64(),
            p["generation"].as_u64()
        ),
        (Some("test"), Some(536870912), Some(2))
    );
    let p = a
        .client
        .put("/api/v1/targets/vm1", &json!({"ram": null}))
        .unwrap();
    assert!(p.get("ram").is_none(), "{p}");
    assert_eq!(
        a.client.get("/api/v1/targets").unwrap(),
        json!(documents::target_list(&a.store).unwrap())
    );

    assert_eq!(
        api_error(a.client.post(
            "/api/v1/targets",
            &json!({"id": "vm1", "vdisk": "win", "cache": "server"})
        ))
        .0,
        409
    );
    assert_eq!(
        api_error(a.client.post(
            "/api/v1/targets",
            &json!({"id": "vm2", "vdisk": "nope", "cache": "server"})
        ))
        .0,
        422,
        "the body names a vDisk the store has not: 422, not 404 (the route is there)"
    );
    let (status, error, what) = api_error(a.client.post(
        "/api/v1/targets",
        &json!({"id": "vm2", "vdisk": "win", "cache": "server", "version": 21}),
    ));
    assert_eq!(
        status, 422,
        "the body names a version the vDisk has not: 422 ({error})"
    );
    assert!(
        error.contains("21") && what.contains("production"),
        "{error}: {what}"
    );
    assert_eq!(
        api_error(
            a.client
                .put("/api/v1/targets/vm1", &json!({"vdisk": "nope"}))
        )
        .0,
        422
    );
    assert_eq!(
        api_error(
            a.client
                .put("/api/v1/targets/nope", &json!({"vdisk": "win"}))
        )
        .0,
        404,
        "the route's own target is missing: 404"
    );
    // Fields valid each alone that do not go together: 422, and nothing written.
    for body in [
        json!({"id": "vm2", "vdisk": "win", "cache": "server", "ram": 0}),
        json!({"id": "vm2", "vdisk": "win", "cache": "device-ram", "ram": 0}),
        json!({"id": "vm2", "vdisk": "win", "cache": "device-ram", "ram": 1048576, "overflow_max": 1}),
    ] {
        assert_eq!(
            api_error(a.client.post("/api/v1/targets", &body)).0,
            422,
            "{body}"
        );
    }
    assert_eq!(
        api_error(a.client.put(
            "/api/v1/targets/vm1",
            &json!({"cache": "server", "ram": 1048576})
        ))
        .0,
        422,
        "the record the change would make holds ram with a server cache"
    );
    // Taking off a MAC the record does not have is a conflict with the record: 409.
    assert_eq!(
        api_error(a.client.put(
            "/api/v1/targets/vm1",
            &json!({"remove_macs": ["52:54:00:00:00:09"]})
        ))
        .0,
        409
    );
    assert!(a.store.target("vm2").is_err(), "nothing was written");
    assert_eq!(
        api_error(a.client.post(
            "/api/v1/targets",
            &json!({"id": "vm2", "vdisk": "win", "cache": "private"})
        ))
        .0,
        400
    );
    assert_eq!(
        api_error(
            a.client
                .post("/api/v1/targets", &json!({"id": "vm2", "vdisk": "win"}))
        )
        .0,
        400
    );
    assert_eq!(
        api_error(a.client.post(
            "/api/v1/targets",
            &json!({"id": "vm2", "vdisk": "win", "cache": "server", "colour": "red"})
        ))
        .0,
        400
    );
    assert_eq!(
        api_error(a.client.put("/api/v1/targets/vm1", &json!({}))).0,
        400
    );
    assert_eq!(
        api_error(
            a.client
                .put("/api/v1/targets/nope", &json!({"version": "test"}))
        )
        .0,
        404
    );
    assert_eq!(api_error(a.client.get("/api/v1/targets/..")).0, 400);
    let (status, error, _) = api_error(a.client.call("DELETE", "/api/v1/vdisks/win", None));
    assert_eq!(status, 405, "{error}");

    let d = a.client.delete("/api/v1/targets/vm1").unwrap();
    assert_eq!(d["removed"], "vm1");
    assert_eq!(d["target"]["id"], "vm1");
    assert_eq!(api_error(a.client.get("/api/v1/targets/vm1")).0, 404);
}

fn session(reg: &Arc<Registry>, target: &str) -> vdstream_server::state::SessionGuard {
    reg.open(SessionInfo {
        export: format!("target/{target}"),
        kind: ExportKind::Target,
        target: Some(target.into()),
        peer: "127.0.0.1:50000".into(),
        vdisk: "win".into(),
        version: 0,
        cache_type: Some("server".into()),
        cache_limit: Some(1000),
    })
}

#[test]
fn sessions_show_counters_rates_and_the_agents_report() {
    let a = api();
    let reg = &a.state.registry;
    drop(session(reg, "vm1"));
    let g = session(reg, "vm1");
    let _other = reg.open(SessionInfo {
        export: "vdisk/win@0".into(),
        kind: ExportKind::Vdisk,
        target: None,
        peer: "unix".into(),
        vdisk: "win".into(),
        version: 0,
        cache_type: None,
        cache_limit: None,
    });
    Counters::add(&g.session.counters.guest_write_ops, 10);
    Counters::add(&g.session.counters.guest_write_bytes, 40960);
    Counters::add(&g.session.counters.cache_used, 250);

    // The agent reports the document `target status --json` prints.
    let mut st = vdstream_agent::Status {
        target: "vm1".into(),
        pid: 7,
        state: "running".into(),
        ..Default::default()
    };
    st.server.retries = 3;
    st.server.reconnects = 2;
    st.server.connected = true;
    st.cache.used_percent = 12.5;
    // Only targets with a record may report.
    let (status, error, what) = api_error(a.client.put("/api/v1/targets/vm1/agent", &json!(st)));
    assert_eq!(status, 404, "{error}");
    assert!(
        error.contains("\"vm1\"") && what.contains("vdstream target add vm1"),
        "{error}: {what}"
    );
    a.client
        .post(
            "/api/v1/targets",
            &json!({"id": "vm1", "vdisk": "win", "cache": "server"}),
        )
        .unwrap();
    a.client
        .post(
            "/api/v1/targets",
            &json!({"id": "vm2", "vdisk": "win", "cache": "server"}),
        )
        .unwrap();
    let ok = a
        .client
        .put("/api/v1/targets/vm1/agent", &json!(st))
        .unwrap();
    assert_eq!(ok["accepted"], true);
    let (status, error, _) = api_error(a.client.put("/api/v1/targets/vm2/agent", &json!(st)));
    assert_eq!(status, 409, "a report naming another target: {error}");
    // What a report may hold is bounded: bytes (413), values and depth (400).
    let big = json!({"target": "vm1", "note": "x".repeat(http::MAX_AGENT_REPORT)});
    assert_eq!(
        api_error(a.client.put("/api/v1/targets/vm1/agent", &big)).0,
        413
    );
    let many = json!({"target": "vm1", "server": {"endpoints": vec![1; 5000]}});
    assert_eq!(
        api_error(a.client.put("/api/v1/targets/vm1/agent", &many)).0,
        400
    );
    let mut deep = json!(1);
    for _ in 0..20 {
        deep = json!({"a": deep});
    }
    assert_eq!(
        api_error(a.client.put(
            "/api/v1/targets/vm1/agent",
            &json!({"target": "vm1", "x": deep})
        ))
        .0,
        400
    );
    assert_eq!(
        api_error(a.client.put("/api/v1/targets/vm1/agent", &json!([1, 2]))).0,
        400
    );
    assert_eq!(
        api_error(
            a.client
                .put("/api/v1/targets/vm1/agent", &json!({"server": 5}))
        )
        .0,
        400
    );
    // A report is read as the agent's typed Status: a field of another type is refused.
    let (status, error, _) = api_error(a.client.put(
        "/api/v1/targets/vm1/agent",
        &json!({"server": {"retries": "many"}}),
    ));
    assert_eq!(status, 400, "{error}");
    assert!(
        error.contains("not an agent status") && error.contains("expected u64"),
        "{error}"
    );

    let list = a.client.get("/api/v1/sessions").unwrap();
    let list = list.as_array().unwrap();
    assert_eq!(list.len(), 2);
    let s = &list[0];
    assert_eq!(
        (
            s["id"].as_u64(),
            s["target"].as_str(),
            s["kind"].as_str(),
            s["server"].as_str()
        ),
        (
            Some(g.session.id),
            Some("vm1"),
            Some("target"),
            Some("pvs1:4242")
        )
    );
    assert_eq!(
        (
            s["reconnects"].as_u64(),
            s["guest"]["write_ops"].as_u64(),
            s["guest"]["write_bytes"].as_u64()
        ),
        (Some(1), Some(10), Some(40960))
    );
    assert_eq!(
        s["cache"],
        json!({"type": "server", "used_bytes": 250, "limit_bytes": 1000, "fs_free_bytes": null, "capacity_bytes": 1000,
               "used_percent": 25.0, "nospace_errors": 0})
    );
    assert_eq!(
        (
            s["agent"]["server"]["retries"].as_u64(),
            s["agent"]["pid"].as_u64()
        ),
        (Some(3), Some(7))
    );
    assert!(s["agent"]["received_unix_ms"].as_u64().is_some());
    assert!(s["guest"]["iops"].as_f64().is_some() && s["connected_unix_ms"].as_u64().is_some());
    assert_eq!(list[1]["agent"], Value::Null);

    // The rate over the last seconds: writes made after a sample show as IOPS.
    std::thread::sleep(Duration::from_millis(1200));
    Counters::add(&g.session.counters.guest_write_ops, 1000);
    let list = a.client.get("/api/v1/sessions").unwrap();
    let iops = list[0]["guest"]["iops"].as_f64().unwrap();
    assert!((100.0..5000.0).contains(&iops), "{iops}");

    // The target's record shows the report too.
    assert_eq!(
        a.client.get("/api/v1/targets/vm1").unwrap()["agent"]["server"]["reconnects"],
        2
    );

    let m = String::from_utf8(raw_get(a.addr, "/metrics")).unwrap();
    for want in [
        "# TYPE vdstream_sessions gauge\nvdstream_sessions 2\n",
        "# HELP vdstream_session_guest_write_ops_total ",
        &format!("vdstream_session_guest_write_ops_total{{session=\"{}\",target=\"vm1\",export=\"target/vm1\",vdisk=\"win\",version=\"0\"}} 1010\n", g.session.id),
        "vdstream_target_reconnects_total{target=\"vm1\"} 1\n",
        "vdstream_agent_retries_total{target=\"vm1\"} 3\n",
        "vdstream_agent_cache_used_percent{target=\"vm1\"} 12.5\n",
        "vdstream_agent_connected{target=\"vm1\"} 1\n",
        "# TYPE vdstream_read_cache_hits_total counter\nvdstream_read_cache_hits_total 0\n",
        "vdstream_read_cache_capacity_bytes 0\n",
        "# TYPE vdstream_store_read_bytes_total counter\n",
    ] {
        assert!(m.contains(want), "metrics lack {want:?}:\n{m}");
    }
    for line in m.lines().filter(|l| !l.starts_with('#')) {
        let (_, value) = line.rsplit_once(' ').unwrap();
        value
            .parse::<f64>()
            .unwrap_or_else(|_| panic!("not a sample line: {line}"));
    }
    drop(g);
    assert_eq!(
        a.client
            .get("/api/v1/sessions")
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        1
    );
}

fn raw_get(addr: SocketAddr, path: &str) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    assert!(
        text.contains("Content-Type: text/plain; version=0.0.4"),
        "{text}"
    );
    text.split_once("\r\n\r\n").unwrap().1.as_bytes().to_vec()
}

/// Sends raw bytes, half-closes, returns the status and the body of the answer, or
/// `None` when the server closed the connection without one.
fn raw_answer(addr: SocketAddr, bytes: &[u8]) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(bytes).unwrap();
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    if out.is_empty() {
        return None;
    }
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .get(9..12)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Some((status, body))
}

/// A chunked POST of 17 chunks of 64 KiB, over the 1 MiB cap (no Content-Length to check first).
fn chunked_over_the_cap() -> Vec<u8> {
    let mut out =
        b"POST /api/v1/targets HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
            .to_vec();
    for _ in 0..17 {
        out.extend_from_slice(b"10000\r\n");
        out.extend_from_slice(&[b' '; 0x10000]);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

/// What a malformed request gets.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Want {
    /// The API's own answer: this status and the JSON error document.
    Json(u16),
    /// hyper refuses it before it is a request: this status, an empty body.
    Bare(u16),
    /// hyper closes the connection without an answer (a head cut short, an HTTP/2 preface).
    Closed,
}

#[test]
fn malformed_requests_get_400_class_answers_and_the_server_goes_on() {
    let a = api();
    let big_header = format!(
        "GET /api/v1/server HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: {}\r\n\r\n",
        "a".repeat(20_000)
    );
    let many_headers = format!(
        "GET /api/v1/server HTTP/1.1\r\nHost: 127.0.0.1\r\n{}\r\n",
        (0..70).map(|i| format!("X-{i}: y\r\n")).collect::<String>()
    );
    let cases: Vec<(&str, Vec<u8>, Want)> = vec![
        ("garbage request line", b"HELLO THERE\r\n\r\n".to_vec(), Want::Bare(400)),
        ("binary noise", vec![0, 1, 2, 255, 254, b'\n', b'\n'], Want::Bare(400)),
        ("HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec(), Want::Closed),
        ("bad Content-Length", b"POST /api/v1/targets HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: ten\r\n\r\n".to_vec(), Want::Bare(400)),
        ("negative Content-Length", b"POST /api/v1/targets HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -5\r\n\r\n".to_vec(), Want::Bare(400)),
        ("chunked, empty", b"POST /api/v1/targets HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".to_vec(), Want::Json(400)),
        ("chunked, over the cap", chunked_over_the_cap(), Want::Json(413)),
        ("oversized header", big_header.into_bytes(), Want::Bare(431)),
        ("too many header fields", many_headers.into_bytes(), Want::Bare(431)),
        ("body over the cap", b"POST /api/v1/targets HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 10000000\r\n\r\n{".to_vec(), Want::Json(413)),
        ("truncated body", b"POST /api/v1/targets HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 50\r\n\r\n{\"id\": \"vm1\"".to_vec(), Want::Json(400)),
        ("truncated head", b"GET /api/v1/server HTTP/1.1\r\nHost: 127.0.0.1\r\n".to_vec(), Want::Closed),
        ("invalid UTF-8 body", b"POST /api/v1/targets HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 4\r\n\r\n\"\xff\xfe\"".to_vec(), Want::Json(400)),
        ("invalid UTF-8 path", b"GET /api/v1/targets/%ff%fe HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".to_vec(), Want::Json(400)),
        ("invalid UTF-8 in the head", b"GET /api/v1/server HTTP/1.1\r\nHost: \xff\r\n\r\n".to_vec(), Want::Json(400)),
        ("malformed JSON", b"POST /api/v1/targets HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 7\r\n\r\n{\"id\": ".to_vec(), Want::Json(400)),
        ("JSON of the wrong shape", b"POST /api/v1/targets HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n[]".to_vec(), Want::Json(400)),
        ("no body", b"POST /api/v1/targets HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n".to_vec(), Want::Json(400)),
        ("no Host", b"GET /api/v1/server HTTP/1.1\r\n\r\n".to_vec(), Want::Json(400)),
        ("bad percent-encoding", b"GET /api/v1/vdisks/%zz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".to_vec(), Want::Json(400)),
        ("unknown route", b"GET /api/v1/nothing HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".to_vec(), Want::Json(404)),
        ("wrong method", b"DELETE /api/v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".to_vec(), Want::Json(405)),
    ];
    for (what, bytes, want) in cases {
        let got = raw_answer(a.addr, &bytes);
        match (want, &got) {
            (Want::Closed, None) => {}
            (Want::Bare(w), Some((status, _))) => assert_eq!(*status, w, "{what}: {got:?}"),
            (Want::Json(w), Some((status, body))) => {
                assert_eq!(*status, w, "{what}: {body}");
                let doc: Value = serde_json::from_str(body)
                    .unwrap_or_else(|e| panic!("{what}: the body is not JSON ({e}): {body}"));
                assert!(
                    doc["error"].is_string() && doc["what_to_do"].is_string(),
                    "{what}: {doc}"
                );
            }
            _ => panic!("{what}: wanted {want:?}, got {got:?}"),
        }
        // The server goes on.
        assert_eq!(
            a.client.get("/api/v1/server").unwrap()["name"],
            "pvs1:4242",
            "after {what}"
        );
    }
    // A stalled client holds only its own connection.
    let mut stalled = TcpStream::connect(a.addr).unwrap();
    stalled.write_all(b"GET /api/v1/ser").unwrap();
    assert_eq!(a.client.get("/api/v1/server").unwrap()["name"], "pvs1:4242");
    // 405 names the allowed methods.
    let mut s = TcpStream::connect(a.addr).unwrap();
    s.write_all(b"PUT /api/v1/vdisks HTTP/1.0\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    // (An HTTP/1.0 request is answered in HTTP/1.0.)
    assert!(
        out.starts_with("HTTP/1.0 405") && out.contains("\r\nAllow: GET,HEAD\r\n"),
        "{out}"
    );
    drop(stalled);
}

#[test]
fn keep_alive_serves_several_requests_on_one_connection() {
    let a = api();
    let mut s = TcpStream::connect(a.addr).unwrap();
    s.write_all(b"GET /api/v1/server HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGET /api/v1/targets HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert_eq!(out.matches("HTTP/1.1 200 OK").count(), 2, "{out}");
}

/// One GET on a new connection with a 1 s budget for connecting, sending and the whole
/// answer: its status, or why it failed.
fn timed_get(addr: SocketAddr, path: &str) -> Result<(u16, Duration), String> {
    let started = std::time::Instant::now();
    let budget = Duration::from_secs(1);
    let mut s = TcpStream::connect_timeout(&addr, budget).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(budget)).unwrap();
    s.set_write_timeout(Some(budget)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| format!("send: {e}"))?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)
        .map_err(|e| format!("read after {:?}: {e}", started.elapsed()))?;
    let text = String::from_utf8_lossy(&out);
    let status = text
        .get(9..12)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("no status line in {text:?}"))?;
    Ok((status, started.elapsed()))
}

#[test]
fn clients_are_answered_within_a_second_beside_200_slow_loris_and_40_idle_connections() {
    let a = api();
    // 40 idle keep-alive connections: each made a request, read its answer, and stays open.
    let idle: Vec<TcpStream> = (0..40)
        .map(|_| {
            let mut s = TcpStream::connect(a.addr).unwrap();
            s.write_all(b"GET /api/v1/server HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                .unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut buf = [0u8; 4096];
            let n = s.read(&mut buf).unwrap();
            assert!(
                buf[..n].starts_with(b"HTTP/1.1 200 "),
                "{}",
                String::from_utf8_lossy(&buf[..n])
            );
            s
        })
        .collect();
    // 200 slow-loris sockets, each sending one byte of a request head a second (8 s at most).
    let head = b"GET /api/v1/vdisks HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n";
    let mut loris: Vec<TcpStream> = (0..200)
        .map(|_| TcpStream::connect(a.addr).unwrap())
        .collect();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sender = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            for i in 0..8 {
                for s in &mut loris {
                    let _ = s.write_all(&head[i..i + 1]);
                }
                for _ in 0..10 {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        return loris;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            loris
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    // Several rounds while they are all open: each answer within 1 s.
    for round in 0..5 {
        for path in ["/metrics", "/api/v1/vdisks"] {
            match timed_get(a.addr, path) {
                Ok((200, took)) => assert!(took < Duration::from_secs(1), "round {round}, {path}: {took:?}"),
                other => panic!("round {round}, {path}: beside 200 slow-loris and 40 idle connections: {other:?}"),
            }
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let loris = sender.join().unwrap();
    drop(loris);
    drop(idle);
}

#[test]
fn stop_closes_every_connection_and_the_listener() {
    let mut a = api();
    assert_eq!(a.client.get("/api/v1/server").unwrap()["name"], "pvs1:4242");
    let held = TcpStream::connect(a.addr).unwrap();
    let mut busy = TcpStream::connect(a.addr).unwrap();
    busy.write_all(b"GET /api/v1/server HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let started = std::time::Instant::now();
    a.rt.block_on(a.handle.take().unwrap().stop());
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "stop took {:?}",
        started.elapsed()
    );
    for s in [&held, &busy] {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut out = Vec::new();
        let r = (&*s).read_to_end(&mut out);
        assert!(
            r.is_ok()
                || r.as_ref()
                    .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
            "stop closes open connections: {r:?}"
        );
    }
    assert!(
        TcpStream::connect(a.addr).is_err() || a.client.get("/api/v1/server").is_err(),
        "stop closes the listener"
    );
}

/// The (path, method, statuses) of every operation of the generated document.
fn openapi_routes(doc: &Value) -> Vec<(String, String, Vec<u16>)> {
    let mut out = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let statuses = op["responses"]
                .as_object()
                .unwrap()
                .keys()
                .map(|k| k.parse().unwrap())
                .collect();
            out.push((path.clone(), method.to_uppercase(), statuses));
        }
    }
    out.sort();
    out
}

/// The error statuses an operation can answer: 400 and 503 on every route (a request
/// without Host, the handler timeout), 401, 403 and 429 on every route (no token, a role
/// too low, an address penalized for failed authentications), 408 and 413 with a body,
/// 404 with a path parameter, 500 on the store's routes, 409 on the store's changes.
fn error_statuses(path: &str, method: &str) -> Vec<u16> {
    let mut s = vec![400, 401, 403, 429, 503];
    let store = path.starts_with("/api/v1/vdisks") || path.starts_with("/api/v1/targets");
    let body = method == "POST" || method == "PUT";
    if body {
        s.extend([408, 413]);
    }
    if path.contains('{') {
        s.push(404);
    }
    if store {
        s.push(500);
    }
    if store && method != "GET" && !path.ends_with("/agent") {
        s.push(409);
    }
    s.sort();
    s
}

#[test]
fn openapi_lists_exactly_the_routes_of_the_router_and_every_error_they_answer() {
    let doc: Value = serde_json::from_str(http::openapi_text()).unwrap();
    let ops = openapi_routes(&doc);
    let documented: Vec<(String, String)> =
        ops.iter().map(|(p, m, _)| (p.clone(), m.clone())).collect();
    let mut known: Vec<(String, String)> = http::routes()
        .into_iter()
        .map(|(p, m)| (p.to_string(), m.to_string()))
        .collect();
    known.sort();
    let missing: Vec<_> = known.iter().filter(|r| !documented.contains(r)).collect();
    let extra: Vec<_> = documented.iter().filter(|r| !known.contains(r)).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "the OpenAPI document lacks {missing:?} and lists routes the router does not know: {extra:?}"
    );
    for (path, method, statuses) in &ops {
        let lacking: Vec<u16> = error_statuses(path, method)
            .into_iter()
            .filter(|s| !statuses.contains(s))
            .collect();
        assert!(lacking.is_empty(), "the OpenAPI document: {method} {path} does not describe the answers {lacking:?} the server can give");
        assert!(
            statuses.iter().any(|s| (200..300).contains(s)),
            "{method} {path}: no success answer"
        );
    }
}

/// JSON Schema counts `3.0` as an integer, so the server does too: a whole number written
/// as a float reads as that integer; a fraction is still refused.
#[test]
fn a_whole_number_written_as_a_float_is_an_integer() {
    let a = api();
    let (status, error, _) = api_error(
        a.client
            .post("/api/v1/vdisks/win/revert", &json!({"version": 7.0})),
    );
    assert_eq!(status, 404, "{error}");
    assert!(error.contains('7'), "{error}");
    let (status, error, _) = api_error(
        a.client
            .post("/api/v1/vdisks/win/revert", &json!({"version": 7.5})),
    );
    assert_eq!(status, 400, "{error}");
    assert!(error.contains("7.5") && error.contains("line 1"), "{error}");
    // An agent's report too.
    a.client
        .post(
            "/api/v1/targets",
            &json!({"id": "vm1", "vdisk": "win", "cache": "server", "ram": null}),
        )
        .unwrap();
    a.client
        .put(
            "/api/v1/targets/vm1/agent",
            &json!({"pid": 155.0, "state": "running"}),
        )
        .unwrap();
    let t = a.client.get("/api/v1/targets/vm1").unwrap();
    assert_eq!(t["agent"]["pid"], 155, "{t}");
}

#[test]
fn the_server_serves_its_openapi_document_and_docs_holds_the_same() {
    let a = api();
    let served = a.client.get("/api/v1/openapi.json").unwrap();
    let generated: Value = serde_json::from_str(http::openapi_text()).unwrap();
    assert_eq!(served, generated);
    assert!(
        served["openapi"].as_str().unwrap().starts_with("3.1"),
        "{}",
        served["openapi"]
    );
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/openapi.json");
    if std::env::var_os("VDSTREAM_WRITE_OPENAPI").is_some() {
        std::fs::write(&path, http::openapi_text()).unwrap();
    }
    let kept = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        kept == http::openapi_text(),
        "docs/openapi.json is not the document the server generates: write it again with `VDSTREAM_WRITE_OPENAPI=1 cargo test -p vdstream-server --test http_api the_server_serves_its_openapi` and commit it"
    );
}

#[test]
fn a_stalled_request_and_an_idle_connection_are_closed_within_the_deadline() {
    let a = api();
    let mut stalled = TcpStream::connect(a.addr).unwrap();
    stalled
        .write_all(b"GET /api/v1/server HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        .unwrap();
    let mut idle = TcpStream::connect(a.addr).unwrap();
    idle.write_all(b"GET /api/v1/server HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .unwrap();
    let limit = http::REQUEST_DEADLINE + Duration::from_secs(10);
    let started = std::time::Instant::now();
    for s in [&stalled, &idle] {
        s.set_read_timeout(Some(limit)).unwrap();
    }
    // A head not whole within the deadline: the connection is closed (hyper sends no answer).
    let mut out = String::new();
    stalled.read_to_string(&mut out).unwrap();
    assert_eq!(out, "", "{out}");
    let mut out = String::new();
    idle.read_to_string(&mut out).unwrap();
    assert_eq!(
        out.matches("HTTP/1.1 ").count(),
        1,
        "one answer, then a silent close: {out}"
    );
    assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
    assert!(
        started.elapsed() < limit,
        "the server closed both within its deadline"
    );
    // A slow body gets 408.
    let mut slow = TcpStream::connect(a.addr).unwrap();
    slow.write_all(
        b"POST /api/v1/targets HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 10\r\n\r\n{",
    )
    .unwrap();
    slow.set_read_timeout(Some(limit)).unwrap();
    let mut out = String::new();
    let _ = slow.read_to_string(&mut out);
    assert!(out.starts_with("HTTP/1.1 408 "), "{out}");
}

#[test]
fn an_oversize_body_is_refused_from_its_content_length_at_once() {
    let a = api();
    for (path, len) in [
        ("/api/v1/targets", 1_000_000_000u64),
        (
            "/api/v1/targets/vm1/agent",
            http::MAX_AGENT_REPORT as u64 + 1,
        ),
    ] {
        let method = if path.ends_with("/agent") {
            "PUT"
        } else {
            "POST"
        };
        let mut s = TcpStream::connect(a.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        // Five bytes of the body, and the connection left open: only the head can say 413.
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len}\r\n\r\n{{\"id\""
        )
        .unwrap();
        let started = std::time::Instant::now();
        let mut buf = [0u8; 4096];
        let n = s.read(&mut buf).unwrap();
        let text = String::from_utf8_lossy(&buf[..n]);
        assert!(text.starts_with("HTTP/1.1 413 "), "{method} {path}: {text}");
        assert!(
            text.contains("\"what_to_do\""),
            "the error document: {text}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{method} {path}: 413 after {:?}",
            started.elapsed()
        );
    }
}

/// Reads `GET /api/v1/events` until `n` events have come (bounded by the socket's read
/// timeout); returns each event's data as JSON.
fn farm_events(addr: SocketAddr, n: usize) -> Vec<Value> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET /api/v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    let mut buf = [0u8; 65536];
    // Chunked transfer: each event is one chunk, which ends "\n\n\r\n".
    while text.matches("event: farm\n").count() < n || text.matches("\n\n\r\n").count() < n {
        let k = s.read(&mut buf).expect("the event stream stalled");
        assert!(k > 0, "the event stream ended: {text}");
        text.push_str(&String::from_utf8_lossy(&buf[..k]));
    }
    let head = &text[..text.find("\r\n\r\n").unwrap()];
    assert!(
        head.starts_with("HTTP/1.1 200")
            && head
                .to_ascii_lowercase()
                .contains("content-type: text/event-stream"),
        "{head}"
    );
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .take(n)
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[test]
fn the_event_stream_sends_the_farm_every_second_with_reports_and_store_changes() {
    let a = api();
    a.client
        .post(
            "/api/v1/targets",
            &json!({"id": "vm1", "vdisk": "win", "cache": "server"}),
        )
        .unwrap();
    let st = vdstream_agent::Status {
        target: "vm1".into(),
        pid: 99,
        state: "running".into(),
        ..Default::default()
    };
    a.client
        .put("/api/v1/targets/vm1/agent", &json!(st))
        .unwrap();
    let g = session(&a.state.registry, "vm1");
    let events = farm_events(a.addr, 3);
    // The first comes at once, the next on the sampler's ticks, a second apart.
    let at = |i: usize| events[i]["at_unix_ms"].as_u64().unwrap();
    assert!(
        at(2) - at(1) >= 900,
        "events {} ms apart: not one a second",
        at(2) - at(1)
    );
    let e = &events[0];
    assert_eq!(e["server"]["name"], "pvs1:4242");
    assert_eq!(e["targets"][0]["id"], "vm1");
    assert_eq!(e["targets"][0]["agent"]["pid"], 99);
    assert_eq!(e["sessions"][0]["id"].as_u64(), Some(g.session.id));
    let changes = e["store_changes"].as_u64().unwrap();
    assert!(changes > 0, "{e}");
    // A change of the store moves store_changes.
    a.client
        .post(
            "/api/v1/targets",
            &json!({"id": "vm2", "vdisk": "win", "cache": "server"}),
        )
        .unwrap();
    let later = farm_events(a.addr, 1);
    assert!(later[0]["store_changes"].as_u64().unwrap() > changes);
    assert_eq!(later[0]["targets"].as_array().unwrap().len(), 2);
}

/// Opens `GET /api/v1/events` with `auth` (extra head lines) and reads its status line:
/// the stream (open while the socket is) and its status.
fn open_events(addr: SocketAddr, auth: &str) -> (TcpStream, u16) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET /api/v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}\r\n"
    )
    .unwrap();
    let mut buf = [0u8; 12];
    s.read_exact(&mut buf).unwrap();
    let status = std::str::from_utf8(&buf[9..12]).unwrap().parse().unwrap();
    (s, status)
}

#[test]
fn event_streams_are_bounded_per_caller() {
    let a = api();
    // The local users of an open API are one caller: they hold their share, no more.
    let mut open = Vec::new();
    for _ in 0..http::MAX_EVENT_STREAMS_PER_CALLER {
        let (s, status) = open_events(a.addr, "");
        assert_eq!(status, 200);
        open.push(s);
    }
    let (status, error, what) = api_error(a.client.get("/api/v1/events"));
    assert_eq!(status, 429, "{error}");
    assert!(
        error.contains("the local users of this open API holds") && what.contains("close"),
        "{error}: {what}"
    );
    // A closed stream gives its place back.
    drop(open.pop());
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while open_events(a.addr, "").1 != 200 {
        assert!(
            std::time::Instant::now() < deadline,
            "the place of a closed stream did not come back"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_target_in_use_is_not_removed() {
    let a = api();
    a.client
        .post(
            "/api/v1/targets",
            &json!({"id": "vm1", "vdisk": "win", "cache": "server"}),
        )
        .unwrap();
    // A session serves it.
    let g = session(&a.state.registry, "vm1");
    let (status, error, what) = api_error(a.client.delete("/api/v1/targets/vm1"));
    assert_eq!(status, 409, "{error}");
    assert!(
        error.contains("in use")
            && error.contains("nothing was removed")
            && what.contains("stop its agent")
            && what.contains("force=true"),
        "{error}: {what}"
    );
    drop(g);
    // Its agent reports it running (an agent of a vDisk export has no session of the target).
    let mut st = vdstream_agent::Status {
        target: "vm1".into(),
        pid: 5,
        state: "running".into(),
        ..Default::default()
    };
    a.client
        .put("/api/v1/targets/vm1/agent", &json!(st))
        .unwrap();
    let (status, error, _) = api_error(a.client.delete("/api/v1/targets/vm1"));
    assert_eq!(status, 409, "{error}");
    assert!(
        error.contains("pid 5") && error.contains("running"),
        "{error}"
    );
    assert_eq!(a.client.get("/api/v1/targets/vm1").unwrap()["id"], "vm1");
    // Once it has stopped, the record goes.
    st.state = "stopped".into();
    a.client
        .put("/api/v1/targets/vm1/agent", &json!(st))
        .unwrap();
    assert_eq!(
        a.client.delete("/api/v1/targets/vm1").unwrap()["removed"],
        "vm1"
    );
}

#[test]
fn force_removes_a_target_in_use() {
    let a = api();
    a.client
        .post(
            "/api/v1/targets",
            &json!({"id": "vm1", "vdisk": "win", "cache": "server"}),
        )
        .unwrap();
    let _g = session(&a.state.registry, "vm1");
    assert_eq!(api_error(a.client.delete("/api/v1/targets/vm1")).0, 409);
    assert_eq!(
        a.client.delete("/api/v1/targets/vm1?force=true").unwrap()["removed"],
        "vm1"
    );
    assert_eq!(api_error(a.client.get("/api/v1/targets/vm1")).0, 404);
}

#[test]
fn merge_and_audit_answer_the_cli_documents() {
    let a = api();
    for _ in 0..2 {
        let v = a
            .client
            .post("/api/v1/vdisks/win/versions", &json!({}))
            .unwrap();
        let n = v["version"]["number"].as_u64().unwrap();
        a.client
            .post(
                &format!("/api/v1/vdisks/win/versions/{n}/promote"),
                &json!({"to": "production"}),
            )
            .unwrap();
    }
    let m = a
        .client
        .post("/api/v1/vdisks/win/merge", &json!({}))
        .unwrap();
    assert_eq!(
        (m["vdisk"].as_str(), m["merge"]["kind"].as_str()),
        (Some("win"), Some("updates"))
    );
    assert_eq!(m["merge"]["merged"], json!([1, 2]));
    let (status, error, _) = api_error(
        a.client
            .post("/api/v1/vdisks/win/merge", &json!({"base": "yes"})),
    );
    assert_eq!(status, 400, "{error}");
    assert_eq!(
        api_error(a.client.post("/api/v1/vdisks/nope/merge", &json!({}))).0,
        404
    );

    let all = a.client.get("/api/v1/audit").unwrap();
    assert_eq!(
        all,
        json!(documents::audit(&a.store, None, Some(100)).unwrap())
    );
    let actions: Vec<&str> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    assert_eq!(actions.last(), Some(&"version.merge"), "{actions:?}");
    assert!(all.as_array().unwrap().last().unwrap()["client"]
        .as_str()
        .unwrap()
        .starts_with("127.0.0.1:"));
    let two = a.client.get("/api/v1/audit?vdisk=win&limit=2").unwrap();
    assert_eq!(two.as_array().unwrap().len(), 2);
    assert_eq!(two[1]["action"], "version.merge");
    assert_eq!(
        a.client.get("/api/v1/audit?vdisk=other").unwrap(),
        json!([])
    );
    for bad in [
        "/api/v1/audit?limit=0",
        "/api/v1/audit?limit=1001",
        "/api/v1/audit?limit=x",
        "/api/v1/audit?colour=red",
        "/api/v1/audit?vdisk=a%2Fb",
    ] {
        assert_eq!(api_error(a.client.get(bad)).0, 400, "{bad}");
    }
}

#[test]
fn the_console_is_served_without_a_credential_with_a_strict_policy() {
    let a = api();
    let raw = |path: &str| {
        let mut s = TcpStream::connect(a.addr).unwrap();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    let root = raw("/");
    assert!(
        root.starts_with("HTTP/1.1 303") && root.contains("\r\nLocation: /console\r\n"),
        "{root}"
    );
    let page = raw("/console");
    assert!(page.starts_with("HTTP/1.1 200"), "{page}");
    assert!(
        page.contains("Content-Type: text/html")
            && page.contains("Content-Security-Policy: default-src 'none'; script-src 'self'"),
        "{page}"
    );
    assert!(
        page.contains("<script src=\"/console/app.js\" defer></script>"),
        "{page}"
    );
    assert!(
        !page.contains("<script>") && !page.contains(" style=\""),
        "inline script or style would break the page's CSP"
    );
    let js = raw("/console/app.js");
    assert!(
        js.starts_with("HTTP/1.1 200")
            && js.contains("Content-Type: text/javascript")
            && js.contains("/api/v1/events"),
        "{}",
        &js[..200]
    );
    assert!(
        !js.contains("innerHTML"),
        "the page puts the API's text in as text only"
    );
    assert!(raw("/console/app.css").contains("Content-Type: text/css"));
    assert!(raw("/console/nope").starts_with("HTTP/1.1 404"));
}

/// Sends one request with `headers`; returns its status.
fn status_of(addr: SocketAddr, method: &str, path: &str, headers: &str, body: &str) -> u16 {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out[9..12].parse().unwrap()
}

#[test]
fn another_site_cannot_make_a_browser_change_the_farm() {
    let a = api();
    let host = format!("Host: {}\r\n", a.addr);
    let versions = || {
        json!(documents::version_list(&a.store, "win").unwrap())["versions"]
            .as_array()
            .unwrap()
            .len()
    };
    // A page of another site POSTs a "simple" request (no preflight): refused, nothing made.
    let evil = format!("{host}Origin: http://evil.example\r\nContent-Type: text/plain\r\n");
    assert_eq!(
        status_of(a.addr, "POST", "/api/v1/vdisks/win/versions", &evil, ""),
        403
    );
    assert_eq!(
        status_of(
            a.addr,
            "POST",
            "/api/v1/targets",
            &evil,
            r#"{"id": "x", "vdisk": "win", "cache": "server"}"#
        ),
        403
    );
    assert_eq!(versions(), 0);
    assert_eq!(api_error(a.client.get("/api/v1/targets/x")).0, 404);
    let null = format!("{host}Origin: null\r\n");
    assert_eq!(
        status_of(a.addr, "POST", "/api/v1/vdisks/win/versions", &null, ""),
        403
    );
    // Reading is not a change; the page of this server (its own origin) may change.
    assert_eq!(status_of(a.addr, "GET", "/api/v1/vdisks", &evil, ""), 200);
    let own = format!("{host}Origin: http://{}\r\n", a.addr);
    assert_eq!(
        status_of(a.addr, "POST", "/api/v1/vdisks/win/versions", &own, ""),
        201
    );
    assert_eq!(versions(), 1);
    // The open API answers only under a loopback name (DNS rebinding).
    // A rebound page's same-origin GET carries neither Origin nor Sec-Fetch-*.
    let rebound = "Host: evil.example:8480\r\n";
    assert_eq!(status_of(a.addr, "GET", "/api/v1/vdisks", rebound, ""), 403);
    assert_eq!(status_of(a.addr, "GET", "/api/v1/events", rebound, ""), 403);
    let rebound_post = "Host: evil.example:8480\r\nOrigin: http://evil.example:8480\r\n";
    assert_eq!(
        status_of(
            a.addr,
            "POST",
            "/api/v1/vdisks/win/versions",
            rebound_post,
            ""
        ),
        403
    );
    assert_eq!(versions(), 1);
    let local = format!(
        "Host: localhost:{}\r\nSec-Fetch-Site: same-origin\r\n",
        a.addr.port()
    );
    assert_eq!(status_of(a.addr, "GET", "/api/v1/vdisks", &local, ""), 200);
}

/// A vDisk's GET carries its generation as the ETag; a change sent with `If-Match` of an
/// older one is 412 with the error document, and changes nothing; with the current one
/// it is made; a malformed `If-Match` is 400.
#[test]
fn a_change_decided_on_an_old_reading_is_412() {
    let a = api();
    a.client
        .post("/api/v1/vdisks/win/versions", &json!({}))
        .unwrap();
    let head = |path: &str| -> String {
        let mut s = TcpStream::connect(a.addr).unwrap();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out.lines()
            .find_map(|l| {
                l.split_once(": ")
                    .filter(|(k, _)| k.eq_ignore_ascii_case("etag"))
                    .map(|(_, v)| v.to_string())
            })
            .unwrap_or_else(|| panic!("no ETag in {out}"))
    };
    let g = a.store.get("win").unwrap().generation;
    assert_eq!(head("/api/v1/vdisks/win/versions"), format!("\"{g}\""));
    assert_eq!(head("/api/v1/vdisks/win"), format!("\"{g}\""));
    let promote = |if_match: &str| {
        let body = r#"{"to":"test"}"#;
        raw_answer(
            a.addr,
            format!(
                "POST /api/v1/vdisks/win/versions/1/promote HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nIf-Match: {if_match}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .unwrap()
    };
    let (status, body) = promote(&format!("\"{}\"", g - 1));
    assert_eq!(status, 412, "{body}");
    let doc: Value = serde_json::from_str(&body).unwrap();
    assert!(
        doc["error"]
            .as_str()
            .unwrap()
            .contains(&format!("changed since generation {}", g - 1)),
        "{doc}"
    );
    assert!(
        doc["what_to_do"].as_str().unwrap().contains("If-Match"),
        "{doc}"
    );
    assert_eq!(a.store.get("win").unwrap().generation, g, "nothing changed");
    assert_eq!(promote("not-a-generation").0, 400);
    let (status, body) = promote(&format!("\"{g}\""));
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        a.store.get("win").unwrap().version(1).unwrap().access,
        vdstream_store::Access::Test
    );
}

/// What a fake metadata writer saw, and what it answers.
struct FakeWriter {
    seen: std::sync::Mutex<Vec<vdstream_server::http::forward::ForwardRequest>>,
    answer: std::sync::Mutex<
        Result<
            vdstream_server::http::forward::ForwardAnswer,
            vdstream_server::http::forward::ForwardError,
        >,
    >,
}

impl vdstream_server::http::forward::Forward for FakeWriter {
    fn forward(
        &self,
        req: vdstream_server::http::forward::ForwardRequest,
    ) -> Result<
        vdstream_server::http::forward::ForwardAnswer,
        vdstream_server::http::forward::ForwardError,
    > {
        self.seen.lock().unwrap().push(req);
        self.answer.lock().unwrap().clone()
    }
}

/// A mirror of a store in object storage: the API's changes go to the writer after this
/// server authorized them (no token: 401, nothing sent; a read-only token: 403), with the
/// caller's token, body and If-Match; the writer's status, document and ETag come back as
/// they were; reads and agents' reports stay here; a change that could not be sent is
/// 503, one whose answer was lost 504.
#[test]
fn a_mirror_sends_changes_to_the_writer_after_authorizing_them() {
    use vdstream_server::http::forward::{ForwardAnswer, ForwardError, Forwarder};
    use vdstream_server::tokens::{Role, Tokens};
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open_or_create(dir.path().join("store")).unwrap();
    store
        .create_vdisk("win", 8 << 20, NewVdisk::default())
        .unwrap();
    let admin = Tokens::of_store(store.root())
        .add("ops", Role::Admin)
        .unwrap()
        .token;
    let reader = Tokens::of_store(store.root())
        .add("viewer", Role::ReadOnly)
        .unwrap()
        .token;
    let fake = Arc::new(FakeWriter {
        seen: Default::default(),
        answer: std::sync::Mutex::new(Ok(ForwardAnswer {
            status: 201,
            content_type: Some("application/json".into()),
            etag: Some("\"9\"".into()),
            body: br#"{"from":"the writer"}"#.to_vec(),
            writer: "http://127.0.0.1:1".into(),
        })),
    });
    let state = ServerState::new(&ServerOptions {
        forward: Some(Forwarder(fake.clone())),
        ..ServerOptions::new(store.root())
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let handle = rt
        .block_on(async { http::spawn(TcpListener::bind("127.0.0.1:0").unwrap(), state.clone()) })
        .unwrap();
    let addr = handle.local_addr();
    let post = |token: Option<&str>, path: &str, extra: &str| {
        let body = r#"{"note":"x"}"#;
        let auth = token
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        raw_answer(
            addr,
            format!("POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}{extra}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len())
                .as_bytes(),
        )
        .unwrap()
    };
    assert_eq!(post(None, "/api/v1/vdisks/win/versions", "").0, 401);
    assert_eq!(
        post(Some(&reader), "/api/v1/vdisks/win/versions", "").0,
        403
    );
    assert!(
        fake.seen.lock().unwrap().is_empty(),
        "nothing unauthorized reaches the writer"
    );

    let (status, body) = post(
        Some(&admin),
        "/api/v1/vdisks/win/versions",
        "If-Match: \"4\"\r\n",
    );
    assert_eq!((status, body.as_str()), (201, r#"{"from":"the writer"}"#));
    {
        let seen = fake.seen.lock().unwrap();
        assert_eq!(seen.len(), 1);
        let r = &seen[0];
        assert_eq!(
            (r.method.as_str(), r.path.as_str(), r.body.as_slice()),
            (
                "POST",
                "/api/v1/vdisks/win/versions",
                br#"{"note":"x"}"#.as_slice()
            )
        );
        let h = |k: &str| {
            r.headers
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(h("authorization"), Some(format!("Bearer {admin}")));
        assert_eq!(h("if-match").as_deref(), Some("\"4\""));
    }
    assert!(
        store.get("win").unwrap().versions.is_empty(),
        "the mirror changed nothing itself"
    );

    // Reads stay here.
    let c = Client::with_credentials(
        &format!("http://{addr}"),
        vdstream_agent::client::Credentials::default().with_token(Some(admin.clone())),
    )
    .unwrap();
    assert_eq!(
        c.get("/api/v1/vdisks/win/versions").unwrap()["vdisk"],
        "win"
    );
    assert_eq!(fake.seen.lock().unwrap().len(), 1);

    *fake.answer.lock().unwrap() = Err(ForwardError::NotSent(
        "no server is the metadata writer".into(),
    ));
    let (status, body) = post(Some(&admin), "/api/v1/vdisks/win/revert", "");
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("no server is the metadata writer") && body.contains("nothing was changed"),
        "{body}"
    );
    *fake.answer.lock().unwrap() = Err(ForwardError::Unknown("timed out".into()));
    let (status, body) = post(Some(&admin), "/api/v1/vdisks/win/merge", "");
    assert_eq!(status, 504, "{body}");
    assert!(body.contains("may have been made"), "{body}");
    drop(handle);
}

#[test]
fn the_audit_trail_records_each_live_migration_once_with_its_outcome() {
    let a = api();
    a.client
        .post(
            "/api/v1/targets",
            &json!({"id": "vm1", "vdisk": "win", "cache": "device-disk"}),
        )
        .unwrap();
    let migrations = || -> Vec<Value> {
        a.client
            .get("/api/v1/audit?vdisk=win")
            .unwrap()
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["action"] == "target.migrate")
            .cloned()
            .collect()
    };
    let report = |role: &str, phase: &str, started: u64| {
        let st = vdstream_agent::Status {
            target: "vm1".into(),
            state: "running".into(),
            migration: Some(vdstream_contract::status::MigrationStatus {
                role: role.into(),
                phase: phase.into(),
                peer: "tls://10.0.0.1:10811".into(),
                rounds: 3,
                data_bytes: 4096,
                fenced_ms: 12,
                started_unix_ms: started,
                finished_unix_ms: started + 500,
                qemu_downtime_ms: (phase == "done").then_some(19),
                error: (phase == "failed").then(|| "the destination agent went away".into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        a.client
            .put("/api/v1/targets/vm1/agent", &json!(st))
            .unwrap();
    };
    // Under way, or done as the source sees it (the destination reports the handover):
    // nothing yet.
    report("destination", "pre-copy", 1000);
    report("source", "done", 1000);
    assert_eq!(migrations(), Vec::<Value>::new());
    // The destination serves: recorded once, however often it reports so.
    report("destination", "done", 1000);
    report("destination", "done", 1000);
    let m = migrations();
    assert_eq!(m.len(), 1, "{m:?}");
    let d = &m[0]["details"];
    assert_eq!(
        (
            d["target"].as_str(),
            d["outcome"].as_str(),
            d["reported_by"].as_str()
        ),
        (Some("vm1"), Some("done"), Some("destination"))
    );
    assert_eq!(
        (d["rounds"].as_u64(), d["fenced_ms"].as_u64()),
        (Some(3), Some(12))
    );
    assert_eq!(d["peer"], "tls://10.0.0.1:10811");
    assert_eq!(d["qemu_downtime_ms"], 19);
    // A failed one, from the source that serves on; the next migration is another line.
    report("source", "failed", 2000);
    report("source", "failed", 2000);
    report("destination", "done", 3000);
    let m = migrations();
    assert_eq!(m.len(), 3, "{m:?}");
    assert_eq!(m[1]["details"]["outcome"], "failed");
    assert_eq!(m[1]["details"]["error"], "the destination agent went away");
    assert_eq!(m[2]["details"]["started_unix_ms"], 3000);
}
