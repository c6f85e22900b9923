//! Who may call what: every request is tied to a caller (a bearer token, a verified client
//! certificate, or a local user of an open API) and checked against the role its route
//! needs, before any handler runs. docs/SERVER.md has the table for administrators.
//!
//! | route | needs |
//! |---|---|
//! | every GET (server, vDisks, versions, targets, sessions, `/metrics`) | read-only |
//! | `POST /targets`, `PUT /targets/{id}`, `DELETE /targets/{id}`, `PUT /targets/{id}/agent` | operator |
//! | `POST .../versions`, `.../promote`, `.../revert` (and anything else) | admin |
//!
//! A target's certificate (`urn:vdstream:target:ID`) may call `GET /api/v1/server`,
//! `GET /api/v1/targets/ID` and `PUT /api/v1/targets/ID/agent` for its own ID only; an
//! administrator's certificate acts as admin; other certificates get nothing.
//!
//! With the boot service (`--boot`), a caller without a credential may `GET /api/v1/server`
//! and `GET /api/v1/targets/ID` (see [`booting_may`]): a PXE-booted target's agent has no
//! credential, and needs them to attach.
//!
//! Open API: when the API listens on loopback without TLS and no token was ever made in
//! the store (no `api-tokens.json`), every request is a local user's and may do
//! everything, as before tokens existed. Otherwise a request without a credential is 401.
//!
//! Failed authentications (a wrong or revoked token, a malformed `Authorization` field) are
//! logged with the address, counted, and penalized per address (failures.rs): an address
//! under penalty is answered 429 before its credential is read. Agent reports refused here
//! are counted for `/metrics` and logged with what the agent needs.
//!
//! Invariants:
//! - A token is checked by hash in constant time (`tokens::find`); the `Authorization`
//!   field is read here only and never formatted into a log line or an answer.
//! - 401 answers carry `WWW-Authenticate: Bearer`; 403 answers name the role needed.
//! - A refusal happens before the handler, so it changes nothing.
//! - A browser cannot be made to act for its user by another site: a request that would
//!   change something and carries an `Origin` other than this server is refused (403), and
//!   an open API answers only requests that name it by an address or `localhost`, never
//!   by another DNS name (no DNS rebinding). Tokens travel in `Authorization`, never in
//!   cookies.

use std::sync::Arc;

use axum::extract::{FromRequestParts, MatchedPath, RawPathParams, Request, State};
use axum::http::{header, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use vdstream_contract::Identity;

use super::error::ApiError;
use super::shared::{AuditClient, ClientAddr, PeerIdentity, Shared};
use crate::tokens::Role;

/// Who made a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Caller {
    /// The API is open (loopback, no TLS, no token ever made).
    Local,
    /// A bearer token: its name and role.
    Token { name: String, role: Role },
    /// A verified client certificate's identity.
    Cert(Identity),
    /// No credential, on a server with the boot service: a network-booted target's agent
    /// (a PXE-booted machine has no token and no certificate in this release). It may
    /// call only what [`booting_may`] lets it.
    Booting,
}

impl std::fmt::Display for Caller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Caller::Local => f.write_str("local"),
            Caller::Token { name, role } => write!(f, "token:{name} ({role})"),
            Caller::Cert(id) => write!(f, "{id}"),
            Caller::Booting => f.write_str("a network-booted machine (no credential)"),
        }
    }
}

impl Caller {
    /// Who holds an event stream, as a 429 names it: one token, one certificate, the local
    /// users of an open API, or the network-booted machines.
    pub(crate) fn holder(&self) -> String {
        match self {
            Caller::Local => "the local users of this open API".into(),
            Caller::Token { name, .. } => format!("the token {name:?}"),
            Caller::Cert(id) => format!("the client certificate of {id}"),
            Caller::Booting => "the machines without a credential".into(),
        }
    }
}

/// The role a route needs, by method and path pattern (`None`: no route matched; reading
/// that it does not exist needs read-only).
pub(crate) fn need_of(method: &Method, route: Option<&str>) -> Role {
    match (method.as_str(), route) {
        ("GET" | "HEAD", _) | (_, None) => Role::ReadOnly,
        ("POST", Some("/api/v1/targets"))
        | ("PUT" | "DELETE", Some("/api/v1/targets/{id}"))
        | ("PUT", Some("/api/v1/targets/{id}/agent")) => Role::Operator,
        _ => Role::Admin,
    }
}

/// Whether a caller without a credential may make this request on a server with the boot
/// service (`--boot`): what the agent inside a network-booted target needs to attach, no
/// more: the server's document (placement, NBD address) and one target's record by id
/// (whose contents the target's boot script and kernel command line, served to anyone who
/// names its MAC, carry anyway). Reports and every other call still need a credential.
fn booting_may(method: &Method, route: Option<&str>) -> bool {
    matches!(
        (method.as_str(), route),
        (
            "GET" | "HEAD",
            Some("/api/v1/server" | "/api/v1/targets/{id}" | "/api/v1/targets/{id}/placement")
        )
    )
}

/// Whether a target's certificate (its `own` id) may make this request.
fn target_may(own: &str, method: &Method, route: Option<&str>, id: Option<&str>) -> bool {
    match (method.as_str(), route) {
        ("GET" | "HEAD", Some("/api/v1/server")) => true,
        ("GET" | "HEAD", Some("/api/v1/targets/{id}" | "/api/v1/targets/{id}/placement"))
        | ("PUT", Some("/api/v1/targets/{id}/agent")) => id == Some(own),
        _ => false,
    }
}

fn unauthorized(error: String, invalid: bool) -> Response {
    let mut r = ApiError::new(401, error, "send `Authorization: Bearer TOKEN` with a token from `vdstream token add NAME --role ROLE` (the CLI reads it from VDSTREAM_TOKEN or --token-file, an agent from VDSTREAM_TOKEN or VDSTREAM_TOKEN_FILE)").into_response();
    let challenge = if invalid {
        "Bearer realm=\"vdstream\", error=\"invalid_token\""
    } else {
        "Bearer realm=\"vdstream\""
    };
    r.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static(challenge),
    );
    r
}

fn forbidden(caller: &Caller, method: &Method, route: &str, need: Role) -> Response {
    let what = match caller {
        Caller::Token { name, role } => format!("the token {name:?} has role {role}"),
        other => format!("the client certificate of {other} does not grant it"),
    };
    ApiError::new(
        403,
        format!("{what}; {method} {route} needs role {need}"),
        format!("use a token with role {need} or higher (`vdstream token add NAME --role {need}`)"),
    )
    .into_response()
}

/// The bearer token of a request: `Ok(None)` without `Authorization`, `Err` when the field
/// is not `Bearer TOKEN`.
fn bearer(req: &Request) -> Result<Option<&str>, ()> {
    let Some(v) = req.headers().get(header::AUTHORIZATION) else {
        return Ok(None);
    };
    let v = v.to_str().map_err(|_| ())?;
    let (scheme, token) = v.split_once(' ').ok_or(())?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() {
        return Err(());
    }
    Ok(Some(token))
}

/// The name or address of a Host field (NAME, NAME:PORT, [V6]:PORT, V6), without the port.
fn host_name(host: &str) -> &str {
    let name = match host.rsplit_once(':') {
        Some((n, port))
            if !port.is_empty()
                && port.bytes().all(|b| b.is_ascii_digit())
                && (!n.contains(':') || n.ends_with(']')) =>
        {
            n
        }
        _ => host,
    };
    name.trim_start_matches('[').trim_end_matches(']')
}

/// Whether `host` (a Host field) names this machine's loopback.
#[cfg(test)]
fn loopback_name(host: &str) -> bool {
    let name = host_name(host);
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Whether `host` (a Host field) is a DNS name other than `localhost`: what a page that
/// re-pointed its own name at 127.0.0.1 sends (an address, loopback or not, cannot be
/// re-pointed; a forwarded port, such as qemu's 10.0.2.2, arrives under one).
fn foreign_name(host: &str) -> bool {
    let name = host_name(host);
    !name.eq_ignore_ascii_case("localhost") && name.parse::<std::net::IpAddr>().is_err()
}

/// What a browser must not do, whatever its credential: change the farm from a page of
/// another site (an `Origin` that is not this server), and, on an open API, reach it under
/// a DNS name other than `localhost` (a site whose name was re-pointed at 127.0.0.1: DNS
/// rebinding). The CLI and agents send no `Origin`, and name the server as told.
fn browser_refusal(s: &Shared, req: &Request) -> Option<ApiError> {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok());
    // A same-origin GET of a rebound page carries neither Origin nor Sec-Fetch-*: every
    // request is checked, not only those that look like a browser's.
    if let Some(host) = host.filter(|h| s.open() && foreign_name(h)) {
        return Some(ApiError::new(
            403,
            format!("this API is open to local users only, and the request names it {host:?}, a name other than localhost"),
            "call it as http://127.0.0.1:PORT or http://localhost:PORT (or by an address), or make a token (`vdstream token add NAME --role ROLE`) to open it beyond loopback",
        ));
    }
    let changes = !matches!(req.method().as_str(), "GET" | "HEAD");
    let origin = req
        .headers()
        .get(header::ORIGIN)
        .map(|v| v.to_str().unwrap_or("?"))?;
    let authority = origin.split_once("://").map_or("", |(_, a)| a);
    (changes && !host.is_some_and(|h| authority.eq_ignore_ascii_case(h))).then(|| {
        ApiError::new(
            403,
            format!("a page of {origin} may not change this server's farm"),
            "use the console this server serves (/console), the CLI or a script",
        )
    })
}

/// The middleware: refuses an address under penalty for failed authentications (429),
/// finds the caller, checks the route's need, and passes the request on with the
/// [`Caller`] in its extensions, or answers 401/403. A refused agent report is counted.
pub(crate) async fn authorize(State(s): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let client = req.extensions().get::<ClientAddr>().map(|c| c.0);
    if let Some(left) = client.and_then(|c| s.failures.penalized(c)) {
        return too_many_failures(left);
    }
    let report = (req.method() == Method::PUT)
        .then(|| {
            req.uri()
                .path()
                .strip_prefix("/api/v1/targets/")
                .and_then(|p| p.strip_suffix("/agent"))
                .map(str::to_string)
        })
        .flatten()
        .filter(|_| {
            req.extensions()
                .get::<MatchedPath>()
                .is_some_and(|m| m.as_str() == "/api/v1/targets/{id}/agent")
        });
    match check(&s, req, client).await {
        Ok(req) => next.run(req).await,
        Err(refusal) => {
            let status = refusal.status().as_u16();
            if let (Some(id), Some(c), 401 | 403) = (report, client, status) {
                s.failures.report_refused(&id, c, status);
            }
            refusal
        }
    }
}

/// The answer to an address under penalty: 429 with `Retry-After`.
fn too_many_failures(left: std::time::Duration) -> Response {
    let secs = left.as_secs().max(1);
    let mut r = ApiError::new(
        429,
        format!("too many failed authentications from this address: it is refused for {secs} more seconds"),
        "use a valid token (`vdstream token list` names them; `vdstream token add NAME --role ROLE` makes one), then retry after the time Retry-After gives",
    )
    .into_response();
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    r
}

/// Finds the caller and checks the route's need: the request with its [`Caller`] marked,
/// or the refusal (401/403). A wrong credential counts against `client`'s address.
async fn check(
    s: &Shared,
    req: Request,
    client: Option<std::net::SocketAddr>,
) -> Result<Request, Response> {
    if let Some(e) = browser_refusal(s, &req) {
        let from = client.map(|c| c.to_string()).unwrap_or_default();
        log::info!(
            "HTTP API: refused {} {} from {from}: {}",
            req.method(),
            req.uri().path(),
            e.error
        );
        return Err(e.into_response());
    }
    let failed = |why: &str| {
        if let Some(c) = client {
            s.failures.failed(c, why);
        }
    };
    let method = req.method().clone();
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_string());
    let shown = route
        .clone()
        .unwrap_or_else(|| req.uri().path().to_string());
    let need = need_of(&method, route.as_deref());
    let caller = match bearer(&req) {
        Err(()) => {
            failed("the Authorization field is not `Bearer TOKEN`");
            return Err(unauthorized(
                "the Authorization field is not `Bearer TOKEN`".into(),
                true,
            ));
        }
        Ok(Some(token)) => match s.tokens.check(token) {
            Some(t) => Caller::Token {
                name: t.name,
                role: t.role,
            },
            None => {
                failed(&format!(
                    "{method} {shown} with a bearer token that is not known or was revoked"
                ));
                return Err(unauthorized(
                    "the bearer token is not known or was revoked".into(),
                    true,
                ));
            }
        },
        Ok(None) => match req.extensions().get::<PeerIdentity>() {
            Some(PeerIdentity(
                id @ (Identity::Target(_) | Identity::Admin(_) | Identity::Server(_)),
            )) => Caller::Cert(id.clone()),
            _ if s.open() => Caller::Local,
            _ if s.state.boot.is_some() && booting_may(&method, route.as_deref()) => {
                Caller::Booting
            }
            _ => {
                return Err(unauthorized(
                    format!("{method} {shown} needs a bearer token (role {need})"),
                    false,
                ))
            }
        },
    };
    let allowed = match &caller {
        Caller::Local | Caller::Cert(Identity::Admin(_)) | Caller::Booting => true,
        Caller::Token { role, .. } => *role >= need,
        Caller::Cert(Identity::Target(own)) => {
            let (mut parts, body) = req.into_parts();
            let params = RawPathParams::from_request_parts(&mut parts, &())
                .await
                .ok();
            let id = params.as_ref().and_then(|p| {
                p.iter()
                    .find(|(k, _)| *k == "id")
                    .map(|(_, v)| v.to_string())
            });
            let ok = target_may(own, &method, route.as_deref(), id.as_deref());
            if !ok {
                log::info!("HTTP API: refused {method} {shown} to {caller}: a target may report and read only its own record");
                return Err(ApiError::new(403, format!("{caller} may call only GET /api/v1/server, GET /api/v1/targets/{own} and PUT /api/v1/targets/{own}/agent"), "an agent reports status only for its own target; use a token for anything else").into_response());
            }
            let mut req = Request::from_parts(parts, body);
            mark(&mut req, caller);
            return Ok(req);
        }
        Caller::Cert(_) => false,
    };
    if !allowed {
        log::info!("HTTP API: refused {method} {shown} to {caller}: needs role {need}");
        return Err(forbidden(&caller, &method, &shown, need));
    }
    let mut req = req;
    mark(&mut req, caller);
    Ok(req)
}

/// Puts the caller and its audit name in the request's extensions.
fn mark(req: &mut Request, caller: Caller) {
    let addr = req
        .extensions()
        .get::<ClientAddr>()
        .map(|c| c.0.to_string())
        .unwrap_or_default();
    let audit = if caller == Caller::Local {
        addr
    } else {
        format!("{addr} {caller}")
    };
    req.extensions_mut().insert(AuditClient(audit));
    req.extensions_mut().insert(caller);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_needs_a_role_and_writes_need_more_than_reads() {
        for (path, method) in super::super::routes() {
            let need = need_of(&method, Some(&path));
            match method.as_str() {
                "GET" => assert_eq!(need, Role::ReadOnly, "{path}"),
                // Approving a machine's key lets it have a certificate: an administrator's call.
                _ if path.contains("/identity/") => {
                    assert_eq!(need, Role::Admin, "{method} {path}")
                }
                _ if path.starts_with("/api/v1/targets") => {
                    assert_eq!(need, Role::Operator, "{method} {path}")
                }
                _ => assert_eq!(need, Role::Admin, "{method} {path}"),
            }
        }
        assert_eq!(need_of(&Method::PATCH, None), Role::ReadOnly);
    }

    #[test]
    fn loopback_names_are_told_from_others() {
        for ok in [
            "127.0.0.1",
            "127.0.0.1:8480",
            "localhost",
            "LOCALHOST:80",
            "[::1]:8480",
            "::1",
            "127.8.9.10:1",
        ] {
            assert!(loopback_name(ok) && !foreign_name(ok), "{ok}");
        }
        for no in [
            "evil.example",
            "evil.example:8480",
            "10.0.0.1:8480",
            "127.0.0.1.evil.example",
            "[::2]:80",
            "localhost.evil:80",
            "",
        ] {
            assert!(!loopback_name(no), "{no}");
        }
        // Addresses are never foreign names (a forwarded port arrives under one); names are.
        for addr in ["10.0.2.2:8480", "[fe80::1]:80", "192.168.1.5"] {
            assert!(!foreign_name(addr), "{addr}");
        }
        for name in [
            "evil.example:8480",
            "127.0.0.1.evil.example",
            "localhost.evil",
            "pvs1",
        ] {
            assert!(foreign_name(name), "{name}");
        }
    }

    #[test]
    fn a_booting_machine_may_read_the_server_and_one_record_only() {
        assert!(booting_may(&Method::GET, Some("/api/v1/server")));
        assert!(booting_may(&Method::GET, Some("/api/v1/targets/{id}")));
        assert!(!booting_may(
            &Method::PUT,
            Some("/api/v1/targets/{id}/agent")
        ));
        assert!(!booting_may(&Method::GET, Some("/api/v1/targets")));
        assert!(!booting_may(&Method::GET, Some("/api/v1/sessions")));
        assert!(!booting_may(&Method::DELETE, Some("/api/v1/targets/{id}")));
        assert!(!booting_may(&Method::GET, None));
    }

    #[test]
    fn a_target_may_touch_only_its_own_record() {
        let (get, put, post) = (Method::GET, Method::PUT, Method::POST);
        assert!(target_may(
            "pc-07",
            &put,
            Some("/api/v1/targets/{id}/agent"),
            Some("pc-07")
        ));
        assert!(!target_may(
            "pc-07",
            &put,
            Some("/api/v1/targets/{id}/agent"),
            Some("pc-08")
        ));
        assert!(target_may(
            "pc-07",
            &get,
            Some("/api/v1/targets/{id}"),
            Some("pc-07")
        ));
        assert!(!target_may(
            "pc-07",
            &put,
            Some("/api/v1/targets/{id}"),
            Some("pc-07")
        ));
        assert!(target_may("pc-07", &get, Some("/api/v1/server"), None));
        assert!(!target_may("pc-07", &get, Some("/api/v1/targets"), None));
        assert!(!target_may(
            "pc-07",
            &post,
            Some("/api/v1/vdisks/{name}/versions"),
            None
        ));
    }
}
