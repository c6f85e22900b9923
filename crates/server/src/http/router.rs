//! The API's routes: one table ([`ROUTES`]), which docs/openapi.yaml must list exactly (a
//! test checks both ways), and the dispatch from a request to its handler.
//!
//! A path is split at `/`; each `{param}` segment is percent-decoded and must be UTF-8.
//! A path no pattern matches is 404; a path a pattern matches with another method is 405
//! with `Allow`. Handlers get parameters and body already checked for shape; the rules
//! of the store are the store's (see store.rs).

use serde_json::Value;
use vdstream_http::wire::Request;

use super::error::ApiError;
use super::{live, metrics, store, ClientAddr, Shared};

/// What a route does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Server,
    Vdisks,
    Vdisk,
    Versions,
    Promote,
    Revert,
    Targets,
    Target,
    TargetAgent,
    Sessions,
    Metrics,
}

/// Every route: path pattern, methods, what it does.
pub const ROUTES: &[(&str, &[&str], Route)] = &[
    ("/api/v1/server", &["GET"], Route::Server),
    ("/api/v1/vdisks", &["GET"], Route::Vdisks),
    ("/api/v1/vdisks/{name}", &["GET"], Route::Vdisk),
    ("/api/v1/vdisks/{name}/versions", &["GET", "POST"], Route::Versions),
    ("/api/v1/vdisks/{name}/versions/{version}/promote", &["POST"], Route::Promote),
    ("/api/v1/vdisks/{name}/revert", &["POST"], Route::Revert),
    ("/api/v1/targets", &["GET", "POST"], Route::Targets),
    ("/api/v1/targets/{id}", &["GET", "PUT", "DELETE"], Route::Target),
    ("/api/v1/targets/{id}/agent", &["PUT"], Route::TargetAgent),
    ("/api/v1/sessions", &["GET"], Route::Sessions),
    ("/metrics", &["GET"], Route::Metrics),
];

/// An answer.
#[derive(Debug)]
pub(crate) struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
    pub allow: Option<String>,
}

impl Reply {
    pub fn json(status: u16, v: &Value) -> Reply {
        let mut body = serde_json::to_vec(v).expect("JSON values serialize");
        body.push(b'\n');
        Reply { status, content_type: "application/json", body, allow: None }
    }

    fn error(e: &ApiError) -> Reply {
        Reply { status: e.status, content_type: "application/json", body: e.body(), allow: None }
    }
}

/// A request as handlers see it: its method, path parameters and body.
#[derive(Debug)]
pub(crate) struct Call<'a> {
    pub method: &'a str,
    /// Who sent it (ip:port), recorded in the audit trail of the changes it makes.
    pub client: Option<ClientAddr>,
    pub params: Vec<String>,
    pub body: &'a [u8],
}

impl Call<'_> {
    /// The body as JSON of type `T`; an empty body reads as `{}` when `empty_ok`.
    pub fn json<T: serde::de::DeserializeOwned>(&self, empty_ok: bool) -> Result<T, ApiError> {
        let text = std::str::from_utf8(self.body).map_err(|e| ApiError::bad_request(
            format!("the request body is not UTF-8 (byte {})", e.valid_up_to()), "send a JSON document in UTF-8"))?;
        let text = if text.trim().is_empty() {
            if !empty_ok {
                return Err(ApiError::bad_request("this request needs a JSON body", "send a JSON object with Content-Type: application/json"));
            }
            "{}"
        } else {
            text
        };
        serde_json::from_str(text).map_err(|e| ApiError::bad_request(format!("the request body is not what this route takes: {e}"), "see docs/openapi.yaml for the fields of this request"))
    }
}

fn percent_decode(seg: &str) -> Result<String, ApiError> {
    let bad = || ApiError::bad_request(format!("the path segment {seg:?} is not validly percent-encoded UTF-8"), "encode names as UTF-8 and percent-encode reserved bytes (%2F)");
    let b = seg.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok()).and_then(|h| u8::from_str_radix(h, 16).ok()).ok_or_else(bad)?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| bad())
}

/// Finds the route of a path: `(route, its methods, raw parameters)`.
fn find(path: &str) -> Option<(Route, &'static [&'static str], Vec<String>)> {
    let path = if path.len() > 1 { path.strip_suffix('/').unwrap_or(path) } else { path };
    let segs: Vec<&str> = path.split('/').collect();
    'routes: for (pattern, methods, route) in ROUTES {
        let pats: Vec<&str> = pattern.split('/').collect();
        if pats.len() != segs.len() {
            continue;
        }
        let mut params = Vec::new();
        for (p, s) in pats.iter().zip(&segs) {
            if p.starts_with('{') {
                if s.is_empty() {
                    continue 'routes;
                }
                params.push(s.to_string());
            } else if p != s {
                continue 'routes;
            }
        }
        return Some((*route, methods, params));
    }
    None
}

/// Answers one request from `client`.
pub(crate) fn handle(shared: &Shared, req: &Request, client: Option<ClientAddr>) -> Reply {
    let Some((route, methods, raw)) = find(&req.path) else {
        return Reply::error(&ApiError::new(404, format!("no API route {}", req.path), "the routes are listed in docs/openapi.yaml; they start with /api/v1/ (and /metrics)"));
    };
    if !methods.contains(&req.method.as_str()) {
        let allow = methods.join(", ");
        let mut r = Reply::error(&ApiError::new(405, format!("{} is not allowed on {}", req.method, req.path), format!("use {allow}")));
        r.allow = Some(allow);
        return r;
    }
    let params = match raw.iter().map(|s| percent_decode(s)).collect::<Result<Vec<_>, _>>() {
        Ok(p) => p,
        Err(e) => return Reply::error(&e),
    };
    let call = Call { method: &req.method, client, params, body: &req.body };
    let result = match route {
        Route::Server => Ok(Reply::json(200, &live::server_doc(&shared.state))),
        Route::Sessions => Ok(Reply::json(200, &shared.live.sessions_doc(&shared.state))),
        Route::TargetAgent => live::put_agent(shared, &call),
        Route::Metrics => Ok(Reply { status: 200, content_type: metrics::CONTENT_TYPE, body: metrics::render(shared).into_bytes(), allow: None }),
        Route::Vdisks | Route::Vdisk | Route::Versions | Route::Promote | Route::Revert | Route::Targets | Route::Target => store::handle(shared, route, &call),
    };
    match result {
        Ok(r) => r,
        Err(e) => {
            if e.status >= 500 {
                log::warn!("HTTP API: {} {}: {}", req.method, req.path, e.error);
            }
            Reply::error(&e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_find_their_routes_and_parameters() {
        assert_eq!(find("/api/v1/vdisks").map(|f| f.0), Some(Route::Vdisks));
        assert_eq!(find("/api/v1/vdisks/").map(|f| f.0), Some(Route::Vdisks));
        let (r, m, p) = find("/api/v1/vdisks/win/versions/3/promote").unwrap();
        assert_eq!((r, m, p), (Route::Promote, &["POST"][..], vec!["win".to_string(), "3".to_string()]));
        assert!(find("/api/v1/vdisks//versions").is_none());
        assert!(find("/api/v2/vdisks").is_none());
        assert!(find("/").is_none());
        assert_eq!(percent_decode("a%2Fb").unwrap(), "a/b");
        assert!(percent_decode("%zz").is_err());
        assert!(percent_decode("%ff").is_err());
        assert!(percent_decode("%4").is_err());
    }
}
