//! Who may call the HTTP API: the open API of one host (loopback, no TLS, no token made),
//! then bearer tokens with roles, each refusal (401 without or with a revoked token, 403
//! for a role too low) changing nothing in the store, and no token ever in the server's
//! log. Real store, real server on 127.0.0.1, the agent's HTTP client.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use serde_json::{json, Value};
use vdstream_agent::client::{Client, ClientError, Credentials};
use vdstream_server::http::{self, HttpHandle};
use vdstream_server::state::ServerState;
use vdstream_server::tokens::{Role, Tokens};
use vdstream_server::ServerOptions;
use vdstream_store::vdisk::NewVdisk;
use vdstream_store::{documents, Store};

mod common;

/// Every log line of this test process (the server's included).
fn captured() -> &'static common::Capture {
    common::captured(log::LevelFilter::Trace)
}

struct Api {
    _dir: tempfile::TempDir,
    store: Store,
    tokens: Tokens,
    handle: Option<HttpHandle>,
    addr: SocketAddr,
    rt: tokio::runtime::Runtime,
}

impl Drop for Api {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            self.rt.block_on(h.stop());
        }
    }
}

fn api() -> Api {
    captured();
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open_or_create(dir.path().join("store")).unwrap();
    store
        .create_vdisk("win", 8 << 20, NewVdisk::default())
        .unwrap();
    documents::version_new(&store, "win", None, &mut |_, _| {}).unwrap();
    let state = ServerState::new(&ServerOptions {
        listen: Some("127.0.0.1:10809".parse().unwrap()),
        name: Some("pvs1".into()),
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
    let tokens = Tokens::of_store(store.root());
    Api {
        _dir: dir,
        store,
        tokens,
        handle: Some(handle),
        addr,
        rt,
    }
}

impl Api {
    fn client(&self, token: Option<&str>) -> Client {
        Client::with_credentials(
            &format!("http://{}", self.addr),
            Credentials::default().with_token(token.map(str::to_string)),
        )
        .unwrap()
        .with_timeout(Duration::from_secs(20))
    }

    /// The stage of version 1 of `win`, and the target ids: what a refused call must not change.
    fn state(&self) -> (Value, Value) {
        (
            json!(documents::version_list(&self.store, "win").unwrap())["versions"].clone(),
            json!(documents::target_list(&self.store).unwrap()),
        )
    }

    /// A raw request: the status line and head of the answer, and its body.
    fn raw(&self, request: &str) -> (String, String) {
        let mut s = TcpStream::connect(self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        let (head, body) = out.split_once("\r\n\r\n").unwrap();
        (head.to_string(), body.to_string())
    }
}

fn refused(r: Result<Value, ClientError>) -> (u16, String, String) {
    match r {
        Err(ClientError::Api {
            status,
            error,
            what_to_do,
        }) => (status, error, what_to_do),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

const PROMOTE: &str = "/api/v1/vdisks/win/versions/1/promote";

#[test]
fn the_api_on_loopback_is_open_until_a_token_is_made_then_every_call_needs_one() {
    let a = api();
    let anyone = a.client(None);
    // Open: one-host use and the existing tests and demo stay as they were.
    anyone.get("/api/v1/server").unwrap();
    anyone
        .post(
            "/api/v1/targets",
            &json!({"id": "pc-01", "vdisk": "win", "cache": "server"}),
        )
        .unwrap();

    let admin = a.tokens.add("admin-1", Role::Admin).unwrap().token;
    let before = a.state();
    let (status, error, what) = refused(anyone.get("/api/v1/server"));
    assert_eq!(status, 401);
    assert!(
        error.contains("needs a bearer token") && what.contains("vdstream token add"),
        "{error}: {what}"
    );
    let (status, _, _) = refused(anyone.post(PROMOTE, &json!({"to": "test"})));
    assert_eq!(status, 401);
    assert_eq!(refused(anyone.delete("/api/v1/targets/pc-01")).0, 401);
    assert_eq!(refused(anyone.get("/metrics")).0, 401, "metrics too");
    assert_eq!(a.state(), before, "refused calls change nothing");

    // The answer: 401 with WWW-Authenticate: Bearer and the JSON error document.
    let (head, body) = a.raw("POST /api/v1/vdisks/win/versions/1/promote HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 13\r\nConnection: close\r\n\r\n{\"to\":\"test\"}");
    assert!(head.starts_with("HTTP/1.1 401"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("\r\nwww-authenticate: bearer realm=\"vdstream\""),
        "{head}"
    );
    let doc: Value = serde_json::from_str(&body).unwrap();
    assert!(
        doc["error"].is_string() && doc["what_to_do"].is_string(),
        "{doc}"
    );
    let (head, _) = a.raw("GET /api/v1/server HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Basic YTpi\r\nConnection: close\r\n\r\n");
    assert!(
        head.starts_with("HTTP/1.1 401") && head.contains("invalid_token"),
        "{head}"
    );
    // The bearer scheme is case-insensitive.
    let (head, _) = a.raw(&format!("GET /api/v1/server HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: bearer {admin}\r\nConnection: close\r\n\r\n"));
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(a.state(), before);

    a.client(Some(&admin))
        .post(PROMOTE, &json!({"to": "test"}))
        .unwrap();
    assert_eq!(
        json!(documents::version_list(&a.store, "win").unwrap())["test"],
        json!({"version": 1})
    );
}

#[test]
fn each_role_may_do_its_part_and_is_refused_the_rest_with_the_role_it_needs() {
    let a = api();
    let ro = a.tokens.add("dash", Role::ReadOnly).unwrap().token;
    let op = a.tokens.add("helpdesk", Role::Operator).unwrap().token;
    let admin = a.tokens.add("root", Role::Admin).unwrap().token;
    let (ro, op, admin) = (
        a.client(Some(&ro)),
        a.client(Some(&op)),
        a.client(Some(&admin)),
    );

    // Read-only: every GET; nothing else.
    for path in [
        "/api/v1/server",
        "/api/v1/vdisks",
        "/api/v1/vdisks/win/versions",
        "/api/v1/targets",
        "/api/v1/sessions",
        "/metrics",
    ] {
        if path == "/metrics" {
            assert!(
                !matches!(ro.get(path), Err(ClientError::Api { .. })),
                "{path}"
            );
        } else {
            ro.get(path).unwrap();
        }
    }
    let before = a.state();
    let (status, error, what) = refused(ro.post(PROMOTE, &json!({"to": "test"})));
    assert_eq!(status, 403);
    assert!(
        error.contains("\"dash\" has role read-only") && error.contains("needs role admin"),
        "{error}"
    );
    assert!(what.contains("--role admin"), "{what}");
    assert_eq!(
        refused(ro.post(
            "/api/v1/targets",
            &json!({"id": "pc-02", "vdisk": "win", "cache": "server"})
        ))
        .0,
        403
    );
    assert_eq!(a.state(), before, "a read-only token changed nothing");

    // Operator: target records, not versions.
    op.post(
        "/api/v1/targets",
        &json!({"id": "pc-02", "vdisk": "win", "cache": "server"}),
    )
    .unwrap();
    op.put("/api/v1/targets/pc-02", &json!({"description": "lab"}))
        .unwrap();
    let before = a.state();
    let (status, error, _) = refused(op.post(PROMOTE, &json!({"to": "test"})));
    assert!(
        status == 403 && error.contains("needs role admin"),
        "{status}: {error}"
    );
    assert_eq!(
        refused(op.post("/api/v1/vdisks/win/versions", &json!({}))).0,
        403
    );
    assert_eq!(
        refused(op.post("/api/v1/vdisks/win/revert", &json!({"version": 1}))).0,
        403
    );
    assert_eq!(a.state(), before);
    op.delete("/api/v1/targets/pc-02").unwrap();

    // Admin: everything.
    admin.post(PROMOTE, &json!({"to": "test"})).unwrap();
    let audit = std::fs::read_to_string(a.store.audit_path()).unwrap();
    assert!(
        audit.contains("token:root (admin)") && audit.contains("token:helpdesk (operator)"),
        "the audit trail names the token: {audit}"
    );
    admin
        .post(
            "/api/v1/targets",
            &json!({"id": "pc-03", "vdisk": "win", "cache": "server"}),
        )
        .unwrap();
    assert_eq!(
        json!(documents::version_list(&a.store, "win").unwrap())["test"],
        json!({"version": 1})
    );
}

#[test]
fn a_revoked_token_is_refused_on_its_next_call_and_changes_nothing() {
    let a = api();
    let t = a.tokens.add("laptop", Role::Admin).unwrap().token;
    let c = a.client(Some(&t));
    c.post(
        "/api/v1/targets",
        &json!({"id": "pc-01", "vdisk": "win", "cache": "server"}),
    )
    .unwrap();
    a.tokens.revoke("laptop").unwrap();
    let before = a.state();
    let (status, error, _) = refused(c.post(PROMOTE, &json!({"to": "test"})));
    assert_eq!(status, 401);
    assert!(error.contains("not known or was revoked"), "{error}");
    assert_eq!(refused(c.delete("/api/v1/targets/pc-01")).0, 401);
    assert_eq!(refused(c.get("/api/v1/server")).0, 401);
    assert_eq!(a.state(), before);
    // A wrong token of the right shape: the same answer.
    assert_eq!(
        refused(
            a.client(Some(&format!("{}x", &t[..t.len() - 1])))
                .get("/api/v1/server")
        )
        .0,
        401
    );
}

#[test]
fn no_token_is_ever_written_to_the_server_log() {
    let a = api();
    let good = a.tokens.add("ci", Role::ReadOnly).unwrap().token;
    let revoked = a.tokens.add("old", Role::Admin).unwrap().token;
    a.tokens.revoke("old").unwrap();
    let unknown = "vdst_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";
    for t in [&good, &revoked, &unknown.to_string()] {
        let c = a.client(Some(t));
        let _ = c.get("/api/v1/server");
        let _ = c.post(PROMOTE, &json!({"to": "test"}));
        let _ = c.get("/api/v1/nope");
        let _ = c.put("/api/v1/targets/x/agent", &json!({"bad": true}));
    }
    // A malformed Authorization field and a head too large, which hyper refuses itself.
    let _ = a.raw(&format!("GET /api/v1/server HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {good} extra\r\nConnection: close\r\n\r\n"));
    let mut s = TcpStream::connect(a.addr).unwrap();
    let _ = s.write_all(format!("GET /api/v1/server HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {good}\r\nX-Pad: {}\r\n\r\n", "a".repeat(20 << 10)).as_bytes());
    let _ = s.read_to_end(&mut Vec::new());
    let lines = captured().0.lock().unwrap();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("refused") || l.contains("HTTP API")),
        "the capture works: {lines:?}"
    );
    for t in [&good, &revoked, &unknown.to_string()] {
        let secret = &t[5..];
        assert!(
            !lines.iter().any(|l| l.contains(secret)),
            "a token is in the log: {lines:?}"
        );
    }
}

/// Opens `GET /api/v1/events` with `token` and reads its status line: the stream (open
/// while the socket is) and its status.
fn open_events(addr: SocketAddr, token: &str) -> (TcpStream, u16) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET /api/v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n\r\n"
    )
    .unwrap();
    let mut buf = [0u8; 12];
    s.read_exact(&mut buf).unwrap();
    (
        s,
        std::str::from_utf8(&buf[9..12]).unwrap().parse().unwrap(),
    )
}

#[test]
fn one_token_cannot_hold_every_event_stream() {
    let a = api();
    let ro = a.tokens.add("dash", Role::ReadOnly).unwrap().token;
    let admin = a.tokens.add("root", Role::Admin).unwrap().token;
    // The read-only token asks for every stream the server keeps: it gets its share.
    let mut held = Vec::new();
    for _ in 0..http::MAX_EVENT_STREAMS {
        let (s, status) = open_events(a.addr, &ro);
        assert!(status == 200 || status == 429, "{status}");
        if status == 200 {
            held.push(s);
        }
    }
    assert_eq!(
        held.len(),
        http::MAX_EVENT_STREAMS_PER_CALLER,
        "one token's streams"
    );
    let (status, error, what) = refused(a.client(Some(&ro)).get("/api/v1/events"));
    assert_eq!(status, 429);
    assert!(
        error.contains("the token \"dash\" holds") && what.contains("close one of its streams"),
        "{error}: {what}"
    );
    // The administrator's console still gets its stream.
    let (_console, status) = open_events(a.addr, &admin);
    assert_eq!(
        status, 200,
        "the admin's stream while a read-only token holds what it may"
    );
}

#[test]
fn the_server_keeps_its_event_streams_for_all_callers_together() {
    let a = api();
    let per = http::MAX_EVENT_STREAMS_PER_CALLER;
    let callers = http::MAX_EVENT_STREAMS / per;
    let mut held = Vec::new();
    for i in 0..callers {
        let t = a
            .tokens
            .add(&format!("dash-{i}"), Role::ReadOnly)
            .unwrap()
            .token;
        for _ in 0..per {
            let (s, status) = open_events(a.addr, &t);
            assert_eq!(status, 200);
            held.push(s);
        }
    }
    let late = a.tokens.add("late", Role::ReadOnly).unwrap().token;
    let (status, error, _) = refused(a.client(Some(&late)).get("/api/v1/events"));
    assert_eq!(status, 503, "{error}");
    assert!(error.contains("event streams are open"), "{error}");
}

/// `GET path` with `token`, from the local address `src` (any of 127/8 on Linux): the
/// status and the whole answer.
fn get_from(addr: SocketAddr, src: &str, path: &str, token: &str) -> (u16, String) {
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    sock.bind(&SocketAddr::new(src.parse().unwrap(), 0).into())
        .unwrap();
    sock.connect_timeout(&addr.into(), Duration::from_secs(5))
        .unwrap();
    let mut s: TcpStream = sock.into();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    (out[9..12].parse().unwrap(), out)
}

#[test]
fn token_guessing_is_logged_counted_and_slowed() {
    let a = api();
    let admin = a.tokens.add("root", Role::Admin).unwrap().token;
    // 127.0.0.1 is the host itself, exempt from penalties (as from the NBD ones): the
    // guesses come from 127.0.0.3.
    let statuses: Vec<u16> = (0..12)
        .map(|i| {
            get_from(
                a.addr,
                "127.0.0.3",
                "/api/v1/server",
                &format!("vdst_guess{i:02}AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"),
            )
            .0
        })
        .collect();
    assert_eq!(statuses[..10], [401; 10], "{statuses:?}");
    assert_eq!(
        statuses[10..],
        [429; 2],
        "the address is slowed after 10 failures: {statuses:?}"
    );
    let (status, answer) = get_from(a.addr, "127.0.0.3", "/api/v1/server", &admin);
    assert_eq!(
        status, 429,
        "a penalized address is refused whatever it sends"
    );
    assert!(
        answer.to_ascii_lowercase().contains("\r\nretry-after: "),
        "{answer}"
    );
    assert_eq!(
        get_from(a.addr, "127.0.0.1", "/api/v1/server", &admin).0,
        200,
        "the host itself is exempt"
    );
    let lines: Vec<String> = captured()
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.contains("failed authentication from 127.0.0.3"))
        .cloned()
        .collect();
    assert!(
        !lines.is_empty() && lines.len() <= 5,
        "logged with the address, rate-limited: {lines:?}"
    );
    assert!(
        !lines.iter().any(|l| l.contains("vdst_guess")),
        "no token in the log: {lines:?}"
    );
    let (_, metrics) = get_from(a.addr, "127.0.0.1", "/metrics", &admin);
    assert!(
        metrics.contains("\nvdstream_api_auth_failures_total 10\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("\nvdstream_api_auth_penalized_total 3\n"),
        "{metrics}"
    );
}
