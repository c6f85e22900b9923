//! The API's one error document, `{"error": "...", "what_to_do": "..."}`; the one place
//! that maps store errors, extractor rejections and the tower layers' bare answers to it;
//! and the extractors the handlers take ([`Param`], [`JsonBody`]).
//!
//! | status | when |
//! |---|---|
//! | 400 | malformed request, path, parameter or JSON body; a bad name, size, version |
//! | 404 | unknown route, vDisk or target |
//! | 405 | a known route with another method (with `Allow`) |
//! | 408 | the body did not arrive within `REQUEST_DEADLINE` |
//! | 409 | a rule of the store refuses the change (in use, exists, wrong state) |
//! | 413 | the body is over the route's limit (by `Content-Length` before it is read) |
//! | 429 | the client's address is penalized for failed authentications (failures.rs), or its caller holds its share of the event streams |
//! | 500 | anything else: a damaged or missing file, an I/O error |
//! | 503 | the request took longer than `HANDLER_TIMEOUT` |
//!
//! (What hyper refuses before there is a request, a request line or head that does not
//! parse or is too large, gets hyper's bare 400 or 431 without this document.)

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::{header, request::Parts, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::json;
use vdstream_store::StoreError;

use super::limits::{HANDLER_TIMEOUT, MAX_AGENT_REPORT, MAX_BODY, REQUEST_DEADLINE};

/// An error answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: u16,
    pub error: String,
    pub what_to_do: String,
}

impl ApiError {
    pub fn new(status: u16, error: impl Into<String>, what_to_do: impl Into<String>) -> Self {
        ApiError {
            status,
            error: error.into(),
            what_to_do: what_to_do.into(),
        }
    }

    pub fn bad_request(error: impl Into<String>, what_to_do: impl Into<String>) -> Self {
        Self::new(400, error, what_to_do)
    }

    /// The document for a bare status a tower layer or axum answered with.
    fn of_status(status: StatusCode) -> Self {
        let s = status.as_u16();
        match s {
            408 => Self::new(s, "the request body did not arrive in time", format!("send the whole request within {} seconds", REQUEST_DEADLINE.as_secs())),
            413 => Self::new(s, format!("the request body is over the limit of this route ({MAX_BODY} bytes, {MAX_AGENT_REPORT} for an agent report)"), "send a smaller body"),
            503 => Self::new(s, format!("the request took longer than {} seconds", HANDLER_TIMEOUT.as_secs()), "see the server's log; the store may be stuck or very busy"),
            _ => Self::new(s, format!("HTTP status {status}"), "see docs/openapi.json for the requests of each route"),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status >= 500 {
            log::warn!("HTTP API: answered {}: {}", self.status, self.error);
        }
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (
            status,
            axum::Json(json!({"error": self.error, "what_to_do": self.what_to_do})),
        )
            .into_response()
    }
}

/// Every answer of 400 and over that is not already the error document becomes it (the
/// tower layers' 408, 413, 503, axum's 405), keeping its status and `Allow`.
pub async fn json_errors(resp: Response) -> Response {
    let json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if resp.status().as_u16() < 400 || json {
        return resp;
    }
    let allow = resp.headers().get(header::ALLOW).cloned();
    let mut out = ApiError::of_status(resp.status()).into_response();
    if let Some(a) = allow {
        out.headers_mut().insert(header::ALLOW, a);
    }
    out
}

/// The advice at the end of a store message (`what went wrong: what to do`), if any.
fn advice_of(message: &str) -> String {
    message
        .rsplit_once(": ")
        .map(|(_, a)| a.to_string())
        .unwrap_or_default()
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        let error = e.to_string();
        let (status, what) = match &e {
            StoreError::BadName(m) => (400, m.split_once("; ").map_or(String::new(), |(_, a)| a.to_string())),
            StoreError::BadInput(m) => (400, advice_of(m)),
            StoreError::UnknownVdisk { known, .. } => (404, known.clone()),
            StoreError::UnknownTarget { known, .. } => (404, known.clone()),
            StoreError::UnknownVersion { have, .. } => (404, format!("its versions are: {have}")),
            StoreError::Inconsistent(m) => (422, advice_of(m)),
            StoreError::Refused(m) => (409, advice_of(m)),
            StoreError::Changed { vdisk, .. } => (412, format!("read the vDisk again (GET /api/v1/vdisks/{vdisk}/versions, its ETag) and send the change with that If-Match, if it still makes sense")),
            StoreError::Corrupt { advice, .. } | StoreError::MissingFile { advice, .. } => (500, advice.clone()),
            StoreError::NoStore { .. } => (500, "the store this server serves is gone: check its --store folder, which must hold store.json".to_string()),
            _ => (500, "see the server's log; check the store's files and free space".to_string()),
        };
        ApiError {
            status,
            error,
            what_to_do: what,
        }
    }
}

/// Path parameters (percent-decoded UTF-8), 400 when they are not.
#[derive(Debug)]
pub struct Param<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for Param<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(t)) => Ok(Param(t)),
            Err(e) => Err(ApiError::bad_request(
                format!("a path parameter is not valid: {}", e.body_text()),
                "encode names as UTF-8 and percent-encode reserved bytes (%2F)",
            )),
        }
    }
}

/// `If-Match: "G"` on a change of a vDisk: the generation of its metadata the change was
/// decided on (the ETag its GET answered). `None` without the field or with `*`; 400 when
/// it is not one quoted generation.
#[derive(Debug)]
pub struct IfMatch(pub Option<u64>);

impl<S: Send + Sync> FromRequestParts<S> for IfMatch {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        let Some(v) = parts.headers.get(header::IF_MATCH) else {
            return Ok(IfMatch(None));
        };
        let text = v.to_str().unwrap_or("").trim();
        if text == "*" {
            return Ok(IfMatch(None));
        }
        let inner = text
            .strip_prefix('"')
            .and_then(|t| t.strip_suffix('"'))
            .unwrap_or(text);
        // Digits only (u64's parser would take a sign too): what docs/openapi.json allows.
        let digits =
            !inner.is_empty() && inner.len() <= 19 && inner.bytes().all(|b| b.is_ascii_digit());
        match inner.parse::<u64>() {
            Ok(g) if digits => Ok(IfMatch(Some(g))),
            _ => Err(ApiError::bad_request(
                format!("If-Match {text:?} is not one generation of the vDisk"),
                "send the ETag the vDisk's GET answered, e.g. If-Match: \"7\"",
            )),
        }
    }
}

/// Query parameters, 400 when they do not read as `T` (an unknown one included, where `T`
/// denies unknown fields).
#[derive(Debug)]
pub struct QueryArgs<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for QueryArgs<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(t)) => Ok(QueryArgs(t)),
            Err(e) => Err(ApiError::bad_request(
                format!("the query is not valid: {}", e.body_text()),
                "see docs/openapi.json for the parameters of this route",
            )),
        }
    }
}

/// A JSON body of type `T`, read within [`REQUEST_DEADLINE`] (408) and the route's limit
/// (413); an empty body reads as `{}` when `EMPTY_OK`, and is refused otherwise.
#[derive(Debug)]
pub struct JsonBody<T, const EMPTY_OK: bool = false>(pub T);

impl<T: DeserializeOwned, S: Send + Sync, const EMPTY_OK: bool> FromRequest<S>
    for JsonBody<T, EMPTY_OK>
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes =
            match tokio::time::timeout(REQUEST_DEADLINE, Bytes::from_request(req, state)).await {
                Err(_) => return Err(ApiError::of_status(StatusCode::REQUEST_TIMEOUT)),
                Ok(Err(e)) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                    return Err(ApiError::of_status(e.status()))
                }
                Ok(Err(e)) => {
                    return Err(ApiError::bad_request(
                        format!("the request body could not be read: {}", e.body_text()),
                        "send a body of Content-Length bytes (or chunked), whole",
                    ))
                }
                Ok(Ok(b)) => b,
            };
        let text = std::str::from_utf8(&bytes).map_err(|e| {
            ApiError::bad_request(
                format!("the request body is not UTF-8 (byte {})", e.valid_up_to()),
                "send a JSON document in UTF-8",
            )
        })?;
        let text = match (text.trim().is_empty(), EMPTY_OK) {
            (false, _) => text,
            (true, true) => "{}",
            (true, false) => {
                return Err(ApiError::bad_request(
                    "this request needs a JSON body",
                    "send a JSON object with Content-Type: application/json",
                ))
            }
        };
        serde_json::from_str(text)
            .or_else(|e| {
                // JSON Schema's integers are numbers by value (`3.0` is one): read the body
                // again with each whole number written as a float turned into an integer,
                // and keep the first error (it has the position) if that fails too.
                let mut v: serde_json::Value = serde_json::from_str(text).map_err(|_| e)?;
                whole_numbers_as_integers(&mut v);
                serde_json::from_value(v).map_err(|_| {
                    serde_json::from_str::<T>(text)
                        .err()
                        .expect("the same text fails the same way")
                })
            })
            .map(JsonBody)
            .map_err(|e| {
                ApiError::bad_request(
                    format!("the request body is not what this route takes: {e}"),
                    "see docs/openapi.json for the fields of this request",
                )
            })
    }
}

/// Turns each float of `v` that is a whole number within `i64` or `u64` (`3.0`, `-2.0`) into
/// that integer, as JSON Schema counts it.
pub(crate) fn whole_numbers_as_integers(v: &mut serde_json::Value) {
    use serde_json::Value;
    match v {
        Value::Number(n) if n.is_f64() => {
            let f = n.as_f64().unwrap_or(f64::NAN);
            if f.fract() == 0.0 {
                // 2^63 and 2^64 are exact as f64: the ranges below are whole and exact.
                if (0.0..18_446_744_073_709_551_616.0).contains(&f) {
                    *v = Value::from(f as u64);
                } else if (-9_223_372_036_854_775_808.0..0.0).contains(&f) {
                    *v = Value::from(f as i64);
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(whole_numbers_as_integers),
        Value::Object(o) => o.values_mut().for_each(whole_numbers_as_integers),
        _ => {}
    }
}

/// A request the API refuses although hyper let it through: HTTP/1.1 without `Host`, or a
/// header value that is not printable ASCII.
pub fn check_head(parts: &Parts) -> Result<(), ApiError> {
    if parts.version == axum::http::Version::HTTP_11 && !parts.headers.contains_key(header::HOST) {
        return Err(ApiError::bad_request(
            "an HTTP/1.1 request needs a Host field",
            "send Host: with the server's address",
        ));
    }
    match parts
        .headers
        .iter()
        .find(|(_, v)| HeaderValue::to_str(v).is_err())
    {
        Some((name, _)) => Err(ApiError::bad_request(
            format!("header {name} is not printable ASCII"),
            "send header values in printable ASCII",
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_errors_map_to_statuses_with_advice() {
        let e: ApiError =
            StoreError::Refused("vDisk w is in use: stop its targets first".into()).into();
        assert_eq!(
            (e.status, e.what_to_do.as_str()),
            (409, "stop its targets first")
        );
        let e: ApiError = StoreError::UnknownTarget {
            id: "x".into(),
            store: "/s".into(),
            known: "known targets: a".into(),
        }
        .into();
        assert_eq!((e.status, e.what_to_do.as_str()), (404, "known targets: a"));
        let e: ApiError = vdstream_store::names::validate_name("a/b")
            .unwrap_err()
            .into();
        assert_eq!(e.status, 400);
        assert!(e.what_to_do.starts_with("a name is"), "{}", e.what_to_do);
    }

    #[test]
    fn whole_floats_read_as_integers_and_no_other_number_changes() {
        let mut v = json!({"a": 3.0, "b": [-2.0, 1.5, {"c": 0.0}], "d": 1e20, "e": 7, "f": -1e19});
        whole_numbers_as_integers(&mut v);
        assert_eq!(
            v,
            json!({"a": 3, "b": [-2, 1.5, {"c": 0}], "d": 1e20, "e": 7, "f": -1e19})
        );
        assert!(v["a"].is_u64() && v["b"][0].is_i64() && v["d"].is_f64());
    }
}
